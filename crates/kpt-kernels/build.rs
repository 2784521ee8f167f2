//! Embeds the compiled GPU kernels listed in `artifacts/manifest.json` (built by
//! `cargo xtask build-kernels` and committed), so that `cargo build` never needs a GPU
//! toolchain: writes `$OUT_DIR/artifacts.rs`, a static table with `include_bytes!`.

use std::fmt::Write as _;
use std::path::PathBuf;

#[path = "src/artifacts/manifest.rs"]
#[allow(dead_code)]
mod manifest;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let artifacts = dir.join("artifacts");
    let path = artifacts.join("manifest.json");
    println!("cargo:rerun-if-changed={}", artifacts.display());
    let manifest: manifest::Manifest = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not a valid manifest: {e}", path.display())),
        Err(_) => manifest::Manifest::default(),
    };
    let toolchain = manifest
        .toolchains
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut code = String::from("/// Every embedded artifact (generated from the manifest).\n");
    code.push_str("pub static EMBEDDED: &[Artifact] = &[\n");
    for k in &manifest.kernels {
        let entries = k
            .entry_points
            .iter()
            .map(|e| {
                format!(
                    "EntryPoint {{ name: {:?}, block: {}, shared_bytes: {}, grid: {:?} }}",
                    e.name, e.block, e.shared_bytes, e.grid
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        for a in &k.artifacts {
            let file = artifacts.join(&a.path);
            let format = match a.format.as_str() {
                "cubin" => "Format::Cubin",
                "ptx" => "Format::Ptx",
                "hsaco" => "Format::Hsaco",
                other => panic!("{}: unknown artifact format {other:?}", a.path),
            };
            writeln!(
                code,
                "    Artifact {{ kernel: {:?}, source: {:?}, target: {:?}, format: {format}, \
                 sha256: {:?}, toolchain: {:?}, entry_points: &[{entries}], \
                 bytes: include_bytes!({:?}) }},",
                k.name,
                k.source,
                a.target,
                a.sha256,
                toolchain,
                file.display().to_string()
            )
            .expect("writing to a String");
        }
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("artifacts.rs");
    std::fs::write(&out, code).expect("writing artifacts.rs");
}
