//! Writes every `kernels/hip/*.hip` as one self-contained translation unit for hiprtc
//! (run-time compilation has no include path): local `#include "…"` files and the
//! `<cuda_*.h>` shims of `kernels/hip/include` inlined once each, `#pragma once` dropped,
//! and `#include <cstdint>` dropped from the CUDA sources (the dialect header provides
//! those types under hiprtc). `$OUT_DIR/rtc_sources.rs` lists them for `include_str!`.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn expand(path: &Path, shims: &Path, seen: &mut BTreeSet<PathBuf>, out: &mut String) {
    let path = path
        .canonicalize()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if !seen.insert(path.clone()) {
        return;
    }
    println!("cargo:rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let dir = path.parent().expect("a file has a folder");
    let cuda_source = dir.file_name().is_some_and(|n| n == "cuda");
    for line in text.lines() {
        let t = line.trim();
        if t == "#pragma once" || (cuda_source && t == "#include <cstdint>") {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include \"") {
            let name = rest.split('"').next().unwrap_or_default();
            expand(&dir.join(name), shims, seen, out);
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include <cuda_") {
            let name = format!("cuda_{}", rest.split('>').next().unwrap_or_default());
            expand(&shims.join(name), shims, seen, out);
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let hip = manifest.join("../../kernels/hip");
    let shims = hip.join("include");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-changed={}", hip.display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&hip)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "hip"))
                .collect()
        })
        .unwrap_or_default();
    sources.sort();
    std::fs::create_dir_all(out_dir.join("rtc")).expect("creating OUT_DIR/rtc");
    let mut table =
        String::from("/// Every `kernels/hip/*.hip` as one translation unit: (kernel, source).\n");
    table.push_str("pub(crate) static SOURCES: &[(&str, &str)] = &[\n");
    for src in sources {
        let name = src
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a UTF-8 name")
            .to_string();
        let mut text = String::new();
        expand(&src, &shims, &mut BTreeSet::new(), &mut text);
        let file = out_dir.join("rtc").join(format!("{name}.hip"));
        std::fs::write(&file, text).expect("writing a translation unit");
        writeln!(
            table,
            "    ({name:?}, include_str!({:?})),",
            file.display().to_string()
        )
        .expect("writing to a String");
    }
    table.push_str("];\n");
    std::fs::write(out_dir.join("rtc_sources.rs"), table).expect("writing rtc_sources.rs");
}
