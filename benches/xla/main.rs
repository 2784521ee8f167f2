//! `kpt-bench-xla`: kpt-tpu against JAX on the same PJRT device, same run.
//!
//! A LLaMA-shaped checkpoint's prefill (one prompt of `--seq` tokens, every position's
//! logits) is lowered by kpt-models, optimized by kpt's manager for the XLA backend,
//! written as one StableHLO module and compiled by XLA through the plugin; the baseline
//! is the same model in JAX, jitted (`benches/jax_llama.py`), on the same plugin's
//! device. Both take the median of `--reps` timed runs after a warm-up; the last
//! position's logits are compared. The compile cache's timings are rows of their own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kpt_core::backend::Backend;
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::KernelRegistry;
use kpt_monitor::report::{Machine, Report, Row};
use kpt_tpu::{Client, CompileCache, CompileOptions, Plugin, XlaBackend};

#[derive(Parser, Debug)]
#[command(about = "kpt-tpu vs JAX (jitted) on the same PJRT device, same run")]
struct Args {
    /// The PJRT plugin (default: `KPT_PJRT_PLUGIN`).
    #[arg(long, env = "KPT_PJRT_PLUGIN")]
    plugin: PathBuf,
    /// Python with JAX (and the plugin's JAX package for GPUs).
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The JAX model script.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/jax_llama.py"))]
    script: PathBuf,
    /// A LLaMA-shaped checkpoint directory (config.json + safetensors).
    #[arg(long)]
    dir: PathBuf,
    /// Prompt length.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Compute dtype of both sides: f32 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Timed runs per side.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Where the report goes.
    #[arg(long, default_value = "docs/reports")]
    out: PathBuf,
    /// Report name.
    #[arg(long, default_value = "tpu-xla")]
    name: String,
    /// The command recorded in the report.
    #[arg(long, default_value = "kpt-bench-xla")]
    command: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => bail!("--dtype must be f32 or bf16, got {other}"),
    };
    let progress = ProgressBar::new(5).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    progress.set_message("loading the plugin and the checkpoint");
    let plugin = Plugin::load(&args.plugin)?;
    let client = Client::new(&plugin)?;
    let backend = XlaBackend::new(&client, 0)?;
    let ck = kpt_models::Checkpoint::open(&args.dir)?;
    let model = ck.load_model(DType::F32)?;
    let vocab = ck.config.vocab_size();
    let graph = model.graph(kpt_models::Phase::Prefill, args.seq)?;
    progress.inc(1);

    // kpt: the balanced level's plan (fusions), in the requested dtype, as one program.
    progress.set_message("kpt: optimizing, emitting and compiling");
    let policy = PrecisionPolicy {
        activation_dtype: Some(dtype),
        weight_dtype: Some(dtype),
        ..PrecisionPolicy::default()
    };
    let level = OptLevel::Balanced;
    let plan = auto_optimize(
        &graph,
        level,
        &policy,
        &KernelRegistry::with_builtin(),
        backend.device(),
    )?;
    let ids: Vec<f64> = (0..args.seq)
        .map(|i| ((i * 7 + 3) % vocab) as f64)
        .collect();
    let positions: Vec<f64> = (0..args.seq).map(|i| i as f64).collect();
    let inputs = [
        Tensor::from_f64(&ids, &[1, args.seq], DType::I64)?,
        Tensor::from_f64(&positions, &[args.seq], DType::I64)?,
    ];
    let specs: Vec<_> = inputs
        .iter()
        .map(|t| kpt_core::TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let program = kpt_tpu::stablehlo::emit_graph(&plan.graph, &specs)?;
    let cache = CompileCache::new(&client, usize::MAX);
    let t = Instant::now();
    let exe = cache.get_or_compile(program.mlir.as_bytes(), &CompileOptions::default())?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let hit_us = median(
        (0..1000)
            .map(|_| {
                let t = Instant::now();
                let _ = cache.get_or_compile(program.mlir.as_bytes(), &CompileOptions::default());
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    );
    progress.inc(1);

    progress.set_message("kpt: timing the prefill");
    let device = client.devices()?.remove(0);
    let buffers = client.program_arguments(&program, &plan.graph, &inputs, &device)?;
    let refs: Vec<_> = buffers.iter().collect();
    let mut outs = exe.execute(&refs)?;
    let mut times = Vec::with_capacity(args.reps);
    for _ in 0..args.reps {
        let t = Instant::now();
        outs = exe.execute(&refs)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let kpt_ms = median(times);
    let logits_at = program
        .outputs
        .iter()
        .position(|s| s.shape.last() == Some(&vocab))
        .context("no logits output")?;
    let logits = Tensor::from_bytes(
        &outs[logits_at].to_bytes()?,
        program.outputs[logits_at].dtype,
        &program.outputs[logits_at].shape,
    )?
    .to_f64_vec();
    let kpt_last = &logits[logits.len() - vocab..];
    progress.inc(1);

    progress.set_message("JAX: jit and timing");
    let tmp = std::env::temp_dir().join(format!("kpt-bench-xla-{}.f32", std::process::id()));
    let jax = run_jax(&args, &tmp);
    progress.inc(1);

    let mut versions = std::collections::BTreeMap::new();
    versions.insert("kpt".into(), env!("CARGO_PKG_VERSION").into());
    versions.insert("pjrt_platform".into(), client.platform_name()?);
    versions.insert("pjrt_platform_version".into(), client.platform_version()?);
    let (major, minor) = plugin.api_version();
    versions.insert("pjrt_c_api".into(), format!("{major}.{minor}"));
    let mut report = Report::new(
        &args.name,
        &args.command,
        kpt_benches::git_commit(),
        Machine {
            device: backend.device().name.clone(),
            driver: None,
            cpu: kpt_core::hardware::cpu_info().model_name,
            versions,
        },
    );
    let case = format!(
        "prefill_{}_s{}_{}",
        ck.config.model_type(),
        args.seq,
        args.dtype
    );
    let params = graph.param_bytes() / 4;
    let shape_note = format!(
        "{params} parameters, one {}-token prompt, all logits; kpt: the {level} plan ({} nodes) as one StableHLO program",
        args.seq,
        plan.graph.nodes().len()
    );
    match jax {
        Ok((jax_ms, jax_version, jax_last)) => {
            report.machine.versions.insert("jax".into(), jax_version);
            let err = kpt_last
                .iter()
                .zip(&jax_last)
                .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            report.rows.push(
                Row::compared(&case, "ms", false, kpt_ms, jax_ms, "JAX jit")
                    .with_target_ratio(1.0 / 1.2)
                    .with_max_abs_err(err)
                    .with_note(format!(
                        "{shape_note}; max abs err: last position's logits, kpt vs JAX"
                    )),
            );
        }
        Err(e) => report.rows.push(
            Row::not_run(
                &case,
                "ms",
                false,
                "JAX jit",
                format!("JAX side failed: {e}"),
            )
            .with_note(format!("kpt: {kpt_ms:.3} ms; {shape_note}")),
        ),
    }
    report.rows.push(
        Row::compared(
            "compile_cache_hit_prefill",
            "ms",
            false,
            hit_us / 1e3,
            compile_ms,
            "compiling it (first request)",
        )
        .with_target(1.0)
        .with_note(format!(
            "second request for the prefill program: median of 1000; the first, compiled by XLA: {compile_ms:.1} ms"
        )),
    );
    progress.inc(1);
    progress.finish_and_clear();
    let written = report.write(&args.out)?;
    println!("{}", report.to_markdown());
    for p in written {
        eprintln!("wrote {}", p.display());
    }
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

/// JAX's median ms, version and last-position logits.
fn run_jax(args: &Args, logits: &Path) -> Result<(f64, String, Vec<f64>)> {
    let out = Command::new(&args.python)
        .arg(&args.script)
        .arg("--dir")
        .arg(&args.dir)
        .args(["--seq", &args.seq.to_string()])
        .args(["--dtype", &args.dtype])
        .args(["--reps", &args.reps.to_string()])
        .arg("--logits")
        .arg(logits)
        .output()
        .with_context(|| format!("cannot run {}", args.python.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.script.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .last()
        .context("no output from the JAX script")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let ms = v["median_ms"].as_f64().context("no median_ms")?;
    let version = v["jax"].as_str().unwrap_or("?").to_string();
    let bytes = std::fs::read(logits)?;
    let vals = bytes
        .chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    Ok((ms, version, vals))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
