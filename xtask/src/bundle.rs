//! `gpu-bundle`: builds the GPU test and benchmark binaries here (no GPU or CUDA
//! toolkit needed: CUDA is loaded at run time) and packs them with `run.sh`, the
//! PyTorch and JAX workers and kpt-tpu's tests (`xla-tests/`, run on the machine's
//! PJRT plugin) into `.gpu/`, a folder to copy to a GPU machine and run there.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{cargo, root};

/// Copies `from` to `to` and strips its symbols when `strip` is available.
fn install(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    let _ = Command::new("strip").arg(to).status();
    Ok(())
}

/// The test executables `cargo test --release --no-run` builds for `package`.
fn test_executables(package: &str) -> Result<Vec<std::path::PathBuf>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["test", "--release", "-p", package, "--no-run"])
        .args(["--message-format=json-render-diagnostics"])
        .current_dir(root())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test -p {package} --no-run failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact" && msg["profile"]["test"] == true {
            if let Some(exe) = msg["executable"].as_str() {
                found.push(exe.into());
            }
        }
    }
    Ok(found)
}

pub fn gpu_bundle() -> Result<()> {
    let root = root();
    let dir = root.join(".gpu");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    for sub in ["bin", "tests", "xla-tests"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    cargo(&["build", "--release", "-p", "kpt", "--bin", "kpt"])?;
    cargo(&[
        "build",
        "--release",
        "-p",
        "kpt-benches",
        "--bin",
        "kpt-bench-cuda",
        "--bin",
        "kpt-bench-models",
        "--bin",
        "kpt-bench-graphs",
        "--bin",
        "kpt-bench-xla",
    ])?;
    let release = root.join("target/release");
    for bin in [
        "kpt",
        "kpt-bench-cuda",
        "kpt-bench-models",
        "kpt-bench-graphs",
        "kpt-bench-xla",
    ] {
        install(&release.join(bin), &dir.join("bin").join(bin))?;
    }
    // kpt-nvidia's tests run as they are; kpt-tpu's on the machine's PJRT plugin.
    // Of kpt's, the transformers oracle of every model architecture (`hf_oracle`).
    for (package, sub, only) in [
        ("kpt-nvidia", "tests", ""),
        ("kpt-tpu", "xla-tests", ""),
        ("kpt", "tests", "hf_oracle-"),
    ] {
        for exe in test_executables(package)? {
            let name = exe
                .file_name()
                .and_then(|n| n.to_str())
                .context("test executable name")?
                .to_string();
            if name.starts_with(only) {
                install(&exe, &dir.join(sub).join(name))?;
            }
        }
    }
    for script in [
        "torch_cuda.py",
        "torch_attention_oracle.py",
        "sdpa_cudnn.py",
        "hf_models.py",
        "jax_llama.py",
    ] {
        std::fs::copy(root.join("benches").join(script), dir.join(script))?;
    }
    std::fs::copy(root.join("xtask/gpu/run.sh"), dir.join("run.sh"))?;
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(&root)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    std::fs::write(dir.join("GIT_COMMIT"), commit + "\n")?;
    eprintln!(
        "gpu-bundle: {} ready; on the GPU machine run `.gpu/run.sh OUT_DIR`",
        dir.display()
    );
    Ok(())
}
