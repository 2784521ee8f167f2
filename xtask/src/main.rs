//! `cargo xtask`: kpt's developer tasks, in plain Rust.
//!
//! - `test`: rustfmt check, clippy with `-D warnings`, the whole test suite, rustdoc
//!   with `-D warnings`, and `check-kernels` — what CI runs.
//! - `check-kernels`: fails when a kernel source under `kernels/` changed and the
//!   committed artifact manifest (`crates/kpt-kernels/artifacts/manifest.json`) does
//!   not record its current hash, or an artifact does not match its recorded hash.
//! - `build-kernels`: installs the pinned nvcc and Triton (`kernels/requirements.txt`)
//!   into `target/kernels-venv`, compiles `kernels/cuda/*.cu` and the specializations
//!   of `kernels/triton/*.py` to cubin (sm_80, sm_90a) and PTX (compute_80), has the
//!   pinned hipcc (Debian's ROCm 5.2 packages, installed with apt when missing) compile
//!   `kernels/hip/*.hip` to HSACO code objects for gfx90a, gfx940 and gfx1030, and
//!   Debian 12's clang 19 (also installed with apt) the same sources for gfx942 and
//!   gfx1100, and rewrites the manifest; `--only cuda|triton|hip` builds one toolchain's kernels and keeps the
//!   others' entries as they are.
//! - `bench-models`: the same environment (with HF transformers), then
//!   `kpt-bench-models` on the CPU with a ~100M-parameter LLaMA-shaped model.
//! - `bench-cpu`: installs PyTorch (pinned in `benches/requirements-cpu.txt`) into a
//!   virtual environment under `target/`, builds `kpt-bench-cpu` in release mode and runs
//!   kpt and PyTorch side by side, writing `docs/reports/cpu-latest.{json,md,svg}`.
//! - `pjrt-plugin`: installs XLA's CPU PJRT plugin (pinned in
//!   `crates/kpt-tpu/requirements.txt`) into `target/pjrt-venv`; `test` does this first
//!   and runs kpt-tpu's XLA tests on it.
//! - `pjrt-bindings`: regenerates `crates/kpt-tpu/src/sys.rs` from the plugin's
//!   `pjrt_c_api.h` with bindgen (needs libclang).
//! - `bench-xla`: the 124M checkpoint of `bench-models` through kpt-tpu on XLA's CPU
//!   plugin against the same model in JAX (pinned in `benches/requirements-xla.txt`,
//!   installed into `target/jax-venv`), writing `docs/reports/tpu-xla-cpu-*`.
//! - `models-report`: `docs/reports/models-latest.*`, the newest GPU model report
//!   (`models-<gpu>-latest.json`) and the CPU one (`models-cpu-latest.json`) in one
//!   report, each row labelled with its run.
//! - `gpu-bundle`: builds the GPU tests, `kpt` and `kpt-bench-cuda` in release mode into
//!   `.gpu/` with `run.sh` (usage in `xtask/gpu/run.sh`), to copy to a GPU machine.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod bundle;
mod kernels;
mod models_report;
mod pjrt;

use bundle::gpu_bundle;
use kernels::{build_kernels, check_kernels};

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
    /// Compile kernels/cuda/*.cu, kernels/triton/*.py and kernels/hip/*.hip into
    /// crates/kpt-kernels/artifacts (only sources that changed since their artifacts were
    /// built, unless --force).
    BuildKernels {
        /// Rebuild every kernel.
        #[arg(long)]
        force: bool,
        /// Build only this toolchain's kernels; the manifest keeps the others' entries.
        #[arg(long, value_enum)]
        only: Option<kernels::Toolchain>,
    },
    /// kpt's CPU kernels vs PyTorch on this machine, same run; writes docs/reports/cpu-*.
    BenchCpu {
        /// Extra arguments for kpt-bench-cpu (e.g. `--filter gemm`, `--quick`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// A ~100M-parameter LLaMA-shaped model through kpt-models and HF transformers on
    /// this machine's CPU, same run; writes docs/reports/models-cpu-*.
    BenchModels {
        /// Extra arguments for kpt-bench-models (e.g. `--steps 16`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The 124M checkpoint through kpt-tpu on XLA's CPU plugin vs the same model in JAX,
    /// same run; writes docs/reports/tpu-xla-cpu-* (run bench-models first).
    BenchXla {
        /// Extra arguments for kpt-bench-xla (e.g. `--seq 256`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// docs/reports/models-latest.*: the newest GPU model report and the CPU one in one
    /// report, each row labelled with its run.
    ModelsReport {
        /// The GPU report's name (default: the newest `models-*-latest.json` but the CPU's).
        #[arg(long)]
        gpu: Option<String>,
        /// The CPU report's name.
        #[arg(long, default_value = "models-cpu")]
        cpu: String,
    },
    /// Build the GPU tests and kpt-bench-cuda into .gpu/ with run.sh, for a GPU machine.
    GpuBundle,
    /// Install XLA's CPU PJRT plugin into target/pjrt-venv and print its path.
    PjrtPlugin,
    /// Regenerate crates/kpt-tpu/src/sys.rs from the plugin's pjrt_c_api.h (bindgen).
    PjrtBindings,
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Test => test(),
        Task::CheckKernels => check_kernels(),
        Task::BuildKernels { force, only } => build_kernels(force, only),
        Task::BenchCpu { args } => bench_cpu(&args),
        Task::BenchModels { args } => bench_models(&args),
        Task::BenchXla { args } => bench_xla(&args),
        Task::ModelsReport { gpu, cpu } => {
            models_report::write(&root().join("docs/reports"), gpu.as_deref(), &cpu)
        }
        Task::GpuBundle => gpu_bundle(),
        Task::PjrtPlugin => {
            println!("{}", pjrt::cpu_plugin()?.display());
            Ok(())
        }
        Task::PjrtBindings => pjrt::pjrt_bindings(),
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cargo(args: &[&str]) -> Result<()> {
    cargo_env(args, &[])
}

/// `cargo args` with extra environment variables.
fn cargo_env(args: &[&str], envs: &[(&str, &Path)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .envs(envs.iter().map(|&(k, v)| (k, v.as_os_str())))
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
    // kpt-tpu's XLA tests run on the CPU plugin, and fail rather than skip without it.
    let plugin = pjrt::cpu_plugin()?;
    cargo_env(
        &["test", "--workspace"],
        &[
            ("KPT_PJRT_PLUGIN", plugin.as_path()),
            ("KPT_REQUIRE_PJRT", Path::new("1")),
        ],
    )?;
    // Broken intra-doc links and other rustdoc warnings fail the check.
    cargo_env(
        &["doc", "--workspace", "--no-deps"],
        &[("RUSTDOCFLAGS", Path::new("-D warnings"))],
    )?;
    check_kernels()?;
    eprintln!("xtask test: all checks passed");
    Ok(())
}

/// Runs `program args` in the repository root, failing on a non-zero exit.
fn run(program: &Path, args: &[&str]) -> Result<()> {
    eprintln!("$ {} {}", program.display(), args.join(" "));
    let status = Command::new(program)
        .args(args)
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot run {}", program.display()))?;
    if !status.success() {
        bail!("{} {} failed ({status})", program.display(), args.join(" "));
    }
    Ok(())
}

/// A virtual environment under `target/` with the packages of `requirements` installed;
/// reinstalled only when the requirements file changes. Returns its python.
fn python_env(name: &str, requirements: &str) -> Result<PathBuf> {
    let root = root();
    let dir = root.join("target").join(name);
    let python = dir.join("bin").join("python");
    let req_path = root.join(requirements);
    let wanted = std::fs::read_to_string(&req_path)
        .with_context(|| format!("reading {}", req_path.display()))?;
    let stamp = dir.join("kpt-requirements.txt");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(python);
    }
    if !python.exists() {
        let host = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let dir_s = dir.to_string_lossy().into_owned();
        run(Path::new(&host), &["-m", "venv", &dir_s])?;
    }
    eprintln!(
        "installing {requirements} into {} (a large download the first time)",
        dir.display()
    );
    let req_s = req_path.to_string_lossy().into_owned();
    run(
        &python,
        &[
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-r",
            &req_s,
        ],
    )?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

fn bench_cpu(extra: &[String]) -> Result<()> {
    run_bench("kpt-bench-cpu", &[], extra)
}

fn bench_models(extra: &[String]) -> Result<()> {
    let checkpoint = root().join("target/bench-models/llama-100m");
    let checkpoint = checkpoint.to_string_lossy().into_owned();
    let args = [
        "--device",
        "cpu",
        "--size",
        "100m",
        "--name",
        "models-cpu",
        "--dir",
        &checkpoint,
        "--command",
        "cargo xtask bench-models",
    ];
    run_bench("kpt-bench-models", &args, extra)
}

fn bench_xla(extra: &[String]) -> Result<()> {
    let checkpoint = root().join("target/bench-models/llama-100m");
    if !checkpoint.join("config.json").is_file() {
        bail!(
            "bench-xla runs the 124M checkpoint that `cargo xtask bench-models` writes to {}: run that first",
            checkpoint.display()
        );
    }
    let python = python_env("jax-venv", "benches/requirements-xla.txt")?;
    let plugin = pjrt::cpu_plugin()?;
    cargo(&[
        "build",
        "--release",
        "-p",
        "kpt-benches",
        "--bin",
        "kpt-bench-xla",
    ])?;
    let exe = root().join("target/release/kpt-bench-xla");
    let (python, plugin, checkpoint) = (
        python.to_string_lossy().into_owned(),
        plugin.to_string_lossy().into_owned(),
        checkpoint.to_string_lossy().into_owned(),
    );
    let mut all = vec![
        "--python",
        &python,
        "--plugin",
        &plugin,
        "--dir",
        &checkpoint,
        "--seq",
        "128",
        "--dtype",
        "f32",
        "--name",
        "tpu-xla-cpu",
        "--command",
        "cargo xtask bench-xla",
    ];
    all.extend(extra.iter().map(String::as_str));
    run(&exe, &all)
}

/// Builds the side-by-side harness `bin` in release mode and runs it with the bench
/// environment's python, then `args`, then `extra`.
fn run_bench(bin: &str, args: &[&str], extra: &[String]) -> Result<()> {
    let python = python_env("bench-venv", "benches/requirements-cpu.txt")?;
    cargo(&["build", "--release", "-p", "kpt-benches", "--bin", bin])?;
    let exe = root().join("target/release").join(bin);
    let python_s = python.to_string_lossy().into_owned();
    let mut all = vec!["--python", &python_s];
    all.extend_from_slice(args);
    all.extend(extra.iter().map(String::as_str));
    run(&exe, &all)
}
