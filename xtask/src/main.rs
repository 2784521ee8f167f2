//! `cargo xtask`: kpt's developer tasks, in plain Rust.
//!
//! - `test`: rustfmt check, clippy with `-D warnings`, the whole test suite, and
//!   `check-kernels` — what CI runs.
//! - `check-kernels`: fails when a kernel source under `kernels/` changed and the
//!   committed artifact manifest does not record its current hash.

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
    cargo(&["clippy", "--workspace", "--all-targets", "--release", "--", "-D", "warnings"])?;
    cargo(&["test", "--workspace", "--release"])?;
    check_kernels()?;
    eprintln!("xtask test: all checks passed");
    Ok(())
}

/// Every file under `kernels/` must appear in the artifact manifest with its sha256.
fn check_kernels() -> Result<()> {
    let root = root();
    let sources = list_sources(&root.join("kernels"))?;
    let manifest = root.join("crates/kpt-kernels/artifacts/manifest.json");
    if sources.is_empty() {
        eprintln!("check-kernels: no GPU kernel sources under kernels/; nothing to check");
        return Ok(());
    }
    if !manifest.exists() {
        bail!(
            "{} kernel source(s) but no {}; run `cargo xtask build-kernels`",
            sources.len(),
            manifest.display()
        );
    }
    bail!("kernel sources exist but this xtask cannot verify artifacts yet; see docs/kernels.md")
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
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("cu" | "cuh" | "py" | "hip")) {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}
