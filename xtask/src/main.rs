//! `cargo xtask`: kpt's developer tasks, in plain Rust.
//!
//! - `test`: rustfmt check, clippy with `-D warnings`, the whole test suite, and
//!   `check-kernels` — what CI runs.
//! - `check-kernels`: fails when a kernel source under `kernels/` changed and the
//!   committed artifact manifest (`crates/kpt-kernels/artifacts/manifest.json`) does
//!   not record its current hash, or an artifact does not match its recorded hash.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "kpt developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// fmt check, clippy -D warnings, every test, check-kernels.
    Test,
    /// Verify that committed kernel artifacts match their sources.
    CheckKernels,
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Test => test(),
        Task::CheckKernels => check_kernels(),
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot run {cargo}"))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn test() -> Result<()> {
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    cargo(&["test", "--workspace"])?;
    check_kernels()?;
    eprintln!("xtask test: all checks passed");
    Ok(())
}

/// One entry of `crates/kpt-kernels/artifacts/manifest.json`.
#[derive(serde::Deserialize)]
struct ManifestEntry {
    /// Source path relative to the repository root.
    source: String,
    /// sha256 of the source when its artifacts were built.
    source_sha256: String,
    /// Artifact paths relative to the manifest's folder.
    artifacts: Vec<ArtifactEntry>,
}

#[derive(serde::Deserialize)]
struct ArtifactEntry {
    path: String,
    sha256: String,
}

fn sha256_hex(path: &Path) -> Result<String> {
    use sha2::Digest;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Every kernel source under `kernels/` must be in the artifact manifest with its
/// current sha256, and every artifact the manifest lists must exist with its hash.
fn check_kernels() -> Result<()> {
    let root = root();
    let sources = list_sources(&root.join("kernels"))?;
    let artifacts_dir = root.join("crates/kpt-kernels/artifacts");
    let manifest_path = artifacts_dir.join("manifest.json");
    let entries: Vec<ManifestEntry> = if manifest_path.exists() {
        let text = std::fs::read_to_string(&manifest_path)?;
        serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", manifest_path.display()))?
    } else {
        Vec::new()
    };
    let mut problems = Vec::new();
    for src in &sources {
        let rel = src
            .strip_prefix(&root)
            .unwrap_or(src)
            .to_string_lossy()
            .replace('\\', "/");
        match entries.iter().find(|e| e.source == rel) {
            None => problems.push(format!(
                "{rel}: not in the manifest (run `cargo xtask build-kernels`)"
            )),
            Some(e) if e.source_sha256 != sha256_hex(src)? => problems.push(format!(
                "{rel}: changed since its artifacts were built (run `cargo xtask build-kernels`)"
            )),
            Some(e) => {
                for a in &e.artifacts {
                    let path = artifacts_dir.join(&a.path);
                    if !path.exists() {
                        problems.push(format!("{}: artifact missing", a.path));
                    } else if sha256_hex(&path)? != a.sha256 {
                        problems.push(format!(
                            "{}: artifact does not match its manifest hash",
                            a.path
                        ));
                    }
                }
            }
        }
    }
    for e in &entries {
        if !root.join(&e.source).exists() {
            problems.push(format!(
                "{}: in the manifest but the source is gone",
                e.source
            ));
        }
    }
    if !problems.is_empty() {
        bail!(
            "check-kernels found {} problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    eprintln!(
        "check-kernels: {} kernel source(s), all artifacts current",
        sources.len()
    );
    Ok(())
}

fn list_sources(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if !dir.exists() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(list_sources(&path)?);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh" | "py" | "hip")
        ) {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}
