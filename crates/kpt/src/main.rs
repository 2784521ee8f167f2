//! The `kpt` command-line tool.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kpt::bench::{default_cases, run_case};
use kpt::core::config::BackendChoice;
use kpt::core::graph::{AttentionParams, Op, OpKind, TensorSpec};
use kpt::core::validate::validate_plan;
use kpt::core::{DType, KptConfig, OptLevel};
use kpt::demo::{
    default_demo_root, demo_checkpoint, prompt_inputs, run_demo, DemoConfig, DemoOptions,
};
use kpt::kernels::CpuReference;
use kpt::model::{bench_model, plan_runner, require_decoder, ModelBenchOptions};
use kpt::models::generate::{Generator, SamplingParams, StopCondition};
use kpt::models::{ModelError, Phase};
use kpt::monitor::metrics::{write_openmetrics, BackendCounters};
use kpt::table::Table;
use kpt::Runtime;

#[derive(Parser)]
#[command(
    name = "kpt",
    version,
    about = "Run deep-learning models fast on the hardware you have"
)]
struct Cli {
    /// Configuration file (TOML or JSON); KPT_* environment variables override it.
    #[arg(long, global = true, env = "KPT_CONFIG")]
    config: Option<PathBuf>,
    /// Device to run on; overrides hardware.backend of the configuration file and
    /// KPT_BACKEND.
    #[arg(
        long,
        global = true,
        value_name = "DEVICE",
        ignore_case = true,
        value_parser = device_parser()
    )]
    device: Option<BackendChoice>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the hardware kpt sees.
    Detect {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create, show or validate a configuration.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// List kernels; with --explain, show the selection for a sample shape on this machine
    /// (or, with --on, on a recorded device).
    Kernels {
        /// Only this op (e.g. linear, attention).
        #[arg(long)]
        op: Option<String>,
        /// Explain which kernel is selected and why the others are not.
        #[arg(long)]
        explain: bool,
        /// Explain for a recorded device instead of this machine's: mi250x, mi300x or
        /// rx7900xtx (AMD property tables kpt-amd ships; needs the `rocm` feature).
        #[arg(long, requires = "explain", value_name = "DEVICE")]
        on: Option<String>,
    },
    /// Optimize a model (the demo checkpoint, or --model) and validate every op against
    /// the f64 reference; then compare every level's logits and greedy tokens with the
    /// unoptimized fp32 model.
    Validate {
        /// Optimization level of the per-op table (default: precision.level of the config).
        #[arg(long)]
        level: Option<OptLevel>,
        /// Checkpoint directory (config.json, safetensors, tokenizer.json) of a decoder.
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Greedy tokens compared per level.
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        /// After the run, write the backend's counters (an XLA backend's compile
        /// cache) to this file as OpenMetrics text.
        #[arg(long, value_name = "FILE")]
        metrics: Option<PathBuf>,
    },
    /// Generate text with a checkpoint, streaming it as it comes.
    Run(RunArgs),
    /// Sentence embeddings (mean pooling) of texts with a BERT checkpoint.
    Embed {
        /// Checkpoint directory of a BERT encoder.
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// A text to embed (repeatable; several run in one packed pass).
        #[arg(long, required = true)]
        text: Vec<String>,
        /// Optimization level (default: precision.level of the config).
        #[arg(long)]
        level: Option<OptLevel>,
        /// Print JSON (every value) instead of a summary table.
        #[arg(long)]
        json: bool,
    },
    /// Benchmark single ops through the full stack, or a model (`kpt bench model`).
    #[command(args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        target: Option<BenchTarget>,
        /// Small sizes (seconds instead of a minute).
        #[arg(long)]
        quick: bool,
        /// Timed runs per case.
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Write the results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also print each kernel's measured time, bandwidth and FLOP rate.
        #[arg(long)]
        profile: bool,
    },
    /// Write a small LLaMA-shaped checkpoint (or take --model), optimize it at every
    /// level, validate and time it.
    Demo {
        /// Run this checkpoint directory instead of the demo checkpoint.
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Tokens generated after the prompt.
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Also print each kernel's measured time, bandwidth and FLOP rate.
        #[arg(long)]
        profile: bool,
        /// Only these levels (repeatable; default: all three).
        #[arg(long = "level", value_enum)]
        levels: Vec<OptLevel>,
        /// After the run, write the backend's counters (an XLA backend's compile
        /// cache) to this file as OpenMetrics text.
        #[arg(long, value_name = "FILE")]
        metrics: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json) of a decoder.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Prompt text (repeatable: several prompts run as one batch).
    #[arg(long, required = true)]
    prompt: Vec<String>,
    /// Most tokens generated per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the most likely tokens whose probability reaches p, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the generated text contains this (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Optimization level (default: precision.level of the config).
    #[arg(long)]
    level: Option<OptLevel>,
}

#[derive(Subcommand)]
enum BenchTarget {
    /// Prefill and decode speed of a checkpoint at each level.
    Model {
        /// Checkpoint directory of a decoder.
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Prompt length in tokens.
        #[arg(long, default_value_t = 32)]
        prompt_tokens: usize,
        /// Tokens generated per level (decode steps + 1).
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Timed prefills per level.
        #[arg(long, default_value_t = 5)]
        iters: usize,
        /// Only these levels (repeatable; default: all three).
        #[arg(long = "level", value_enum)]
        levels: Vec<OptLevel>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Write a default configuration file.
    Init {
        /// Where to write it (.toml or .json).
        #[arg(default_value = "kpt.toml")]
        path: PathBuf,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Print the effective configuration (defaults, file, environment, --device).
    Show {
        /// Print JSON instead of TOML.
        #[arg(long)]
        json: bool,
    },
    /// Check a configuration and list every problem.
    Validate {
        /// File to check (default: --config, else defaults + environment).
        path: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KPT_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A model error's message already names its cause (file, field, tensor).
            match e.downcast_ref::<ModelError>() {
                Some(m) => eprintln!("error: {m}"),
                None => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// The values of `--device`: every [`BackendChoice`], with the aliases its `FromStr`
/// accepts.
fn device_parser() -> impl TypedValueParser<Value = BackendChoice> {
    let values = BackendChoice::ALL.map(|choice| {
        let (help, aliases): (&str, &[&str]) = match choice {
            BackendChoice::Auto => ("the best device present: CUDA, then ROCm, TPU, CPU", &[]),
            BackendChoice::Cpu => ("the host CPU", &[]),
            BackendChoice::Cuda => (
                "an NVIDIA GPU (needs the `cuda` feature and the NVIDIA driver)",
                &["nvidia"],
            ),
            BackendChoice::Rocm => (
                "an AMD GPU (needs the `rocm` feature and ROCm's HIP runtime; GEMMs need rocBLAS)",
                &["hip", "amd"],
            ),
            BackendChoice::Tpu => (
                "XLA through a PJRT plugin: libtpu on a TPU VM, or the plugin KPT_PJRT_PLUGIN names",
                &["xla"],
            ),
        };
        PossibleValue::new(choice.name())
            .help(help)
            .aliases(aliases.iter().copied())
    });
    PossibleValuesParser::new(values).try_map(|name| name.parse::<BackendChoice>())
}

/// Defaults, then the file, then the `KPT_*` environment, then `--device`.
fn load_config(path: Option<&Path>, device: Option<BackendChoice>) -> anyhow::Result<KptConfig> {
    Ok(with_device(KptConfig::load_layered(path)?, device))
}

/// `cfg` with `hardware.backend` set from `--device`, when it was given.
fn with_device(mut cfg: KptConfig, device: Option<BackendChoice>) -> KptConfig {
    if let Some(device) = device {
        cfg.hardware.backend = device;
    }
    cfg
}

/// A runtime whose configured backend is present, checked before any work starts.
fn runtime(cfg: KptConfig) -> anyhow::Result<Runtime> {
    let rt = Runtime::new(cfg)?;
    rt.backend()?;
    Ok(rt)
}

fn spinner(len: u64) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let config_path = cli.config.as_deref();
    let device = cli.device;
    match cli.command {
        Command::Detect { json } => detect(json),
        Command::Config { action } => config(action, config_path, device),
        Command::Kernels { op, explain, on } => kernels(
            load_config(config_path, device)?,
            op.as_deref(),
            explain,
            on.as_deref(),
        ),
        Command::Validate {
            level,
            model,
            tokens,
            metrics,
        } => validate(
            load_config(config_path, device)?,
            level,
            model,
            tokens,
            metrics.as_deref(),
        ),
        Command::Run(args) => run_model(load_config(config_path, device)?, args),
        Command::Embed {
            model,
            text,
            level,
            json,
        } => embed(
            load_config(config_path, device)?,
            &model,
            &text,
            level,
            json,
        ),
        Command::Bench {
            target:
                Some(BenchTarget::Model {
                    model,
                    prompt_tokens,
                    tokens,
                    iters,
                    levels,
                    json,
                }),
            ..
        } => bench_model_cmd(
            load_config(config_path, device)?,
            &model,
            ModelBenchOptions {
                levels: if levels.is_empty() {
                    OptLevel::ALL.to_vec()
                } else {
                    levels
                },
                prompt_tokens,
                new_tokens: tokens,
                iters,
            },
            json,
        ),
        Command::Bench {
            target: None,
            quick,
            iters,
            json,
            profile,
        } => bench(
            load_config(config_path, device)?,
            quick,
            iters,
            json.as_deref(),
            profile,
        ),
        Command::Demo {
            model,
            tokens,
            json,
            profile,
            levels,
            metrics,
        } => demo(
            load_config(config_path, device)?,
            model,
            tokens,
            json,
            profile,
            levels,
            metrics.as_deref(),
        ),
    }
}

fn detect(json: bool) -> anyhow::Result<()> {
    let mut devices = Vec::new();
    let mut none_found = Vec::new();
    for detector in kpt::detectors() {
        let found = detector.detect()?;
        if found.is_empty() {
            none_found.push(detector.kind().to_string());
        }
        devices.extend(found);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&devices)?);
        return Ok(());
    }
    for d in &devices {
        println!("{} {}: {}", d.kind, d.index, d.name);
        let mut t = Table::new(["property", "value"]);
        t.row([
            "arch".to_string(),
            d.arch.clone().unwrap_or_else(|| "-".into()),
        ]);
        if let Some(c) = d.compute_units {
            t.row(["compute units".to_string(), c.to_string()]);
        }
        if let Some(m) = d.memory_bytes {
            t.row([
                "memory".to_string(),
                format!("{:.1} GiB", m as f64 / (1u64 << 30) as f64),
            ]);
        }
        t.row(["features".to_string(), d.features.join(" ")]);
        for (k, v) in &d.properties {
            t.row([k.clone(), v.clone()]);
        }
        println!("{t}");
    }
    for kind in none_found {
        if kind == kpt::core::hardware::DeviceKind::Tpu.to_string() {
            println!(
                "{kind}: no PJRT plugin found (libtpu on a TPU VM; KPT_PJRT_PLUGIN names another, e.g. XLA's CPU plugin)"
            );
        } else {
            println!("{kind}: no device found (no driver, or the driver sees none)");
        }
    }
    Ok(())
}

fn config(
    action: ConfigAction,
    config_path: Option<&Path>,
    device: Option<BackendChoice>,
) -> anyhow::Result<()> {
    match action {
        ConfigAction::Init { path, force } => {
            if path.exists() && !force {
                anyhow::bail!("{} exists; pass --force to overwrite", path.display());
            }
            KptConfig::default().save(&path)?;
            println!("wrote {}", path.display());
        }
        ConfigAction::Show { json } => {
            let cfg = load_config(config_path, device)?;
            if json {
                println!("{}", cfg.to_json_string()?);
            } else {
                print!("{}", cfg.to_toml_string()?);
            }
        }
        ConfigAction::Validate { path } => {
            let cfg = load_config(path.as_deref().or(config_path), device)?;
            cfg.validate()?;
            println!("configuration is valid");
        }
    }
    Ok(())
}

/// A representative input signature per op, for `kpt kernels --explain`.
fn sample(op: OpKind) -> (Op, Vec<TensorSpec>) {
    let f = |s: &[usize]| TensorSpec::new(s, DType::F32);
    let i = |s: &[usize]| TensorSpec::new(s, DType::I64);
    match op {
        OpKind::Embedding => (Op::Embedding, vec![i(&[1, 16]), f(&[32000, 4096])]),
        OpKind::MatMul => (Op::MatMul, vec![f(&[512, 1024]), f(&[1024, 512])]),
        OpKind::Linear => (
            Op::Linear { bias: false },
            vec![f(&[16, 4096]), TensorSpec::new(&[4096, 4096], DType::BF16)],
        ),
        OpKind::LinearAct => (
            Op::LinearAct {
                bias: false,
                act: kpt::core::graph::Activation::Silu,
            },
            vec![
                f(&[16, 4096]),
                TensorSpec::new(&[11008, 4096], DType::F8E4M3),
            ],
        ),
        OpKind::Activation => (
            Op::Activation {
                act: kpt::core::graph::Activation::GeluErf,
            },
            vec![f(&[16, 4096])],
        ),
        OpKind::RmsNorm => (Op::RmsNorm { eps: 1e-5 }, vec![f(&[16, 4096]), f(&[4096])]),
        OpKind::LayerNorm => (
            Op::LayerNorm { eps: 1e-5 },
            vec![f(&[16, 4096]), f(&[4096]), f(&[4096])],
        ),
        OpKind::AddRmsNorm => (
            Op::AddRmsNorm { eps: 1e-5 },
            vec![f(&[16, 4096]), f(&[16, 4096]), f(&[4096])],
        ),
        OpKind::AddLayerNorm => (
            Op::AddLayerNorm { eps: 1e-5 },
            vec![f(&[16, 4096]), f(&[16, 4096]), f(&[4096]), f(&[4096])],
        ),
        OpKind::Rotary => (
            Op::Rotary {
                head_dim: 128,
                theta: 10000.0,
                scaling: None,
            },
            vec![f(&[1, 16, 4096]), i(&[16])],
        ),
        OpKind::SplitRotary => (
            Op::SplitRotary {
                head_dim: 128,
                theta: 10000.0,
                scaling: None,
                sizes: vec![4096, 1024, 1024],
                cache: false,
            },
            vec![f(&[8, 1, 6144]), i(&[8, 1])],
        ),
        OpKind::Softmax => (Op::Softmax, vec![f(&[16, 4096])]),
        OpKind::ArgMax => (Op::ArgMax, vec![f(&[32, 1, 32000])]),
        OpKind::Attention => (
            Op::Attention(AttentionParams::new(32, 8, 128, true)),
            vec![f(&[1, 16, 4096]), f(&[1, 16, 1024]), f(&[1, 16, 1024])],
        ),
        OpKind::AttentionBackward => (
            Op::AttentionBackward(AttentionParams::new(32, 8, 128, true)),
            vec![
                f(&[1, 16, 4096]),
                f(&[1, 16, 1024]),
                f(&[1, 16, 1024]),
                f(&[1, 16, 4096]),
                f(&[1, 16, 4096]),
            ],
        ),
        OpKind::Add => (Op::Add, vec![f(&[16, 4096]), f(&[16, 4096])]),
        OpKind::Mul => (Op::Mul, vec![f(&[16, 4096]), f(&[16, 4096])]),
        OpKind::Quantize => (
            Op::Quantize {
                dtype: DType::F8E4M3,
                scale: 1.0,
            },
            vec![f(&[16, 4096])],
        ),
        OpKind::Dequantize => (
            Op::Dequantize { dtype: DType::F32 },
            vec![TensorSpec::new(&[16, 4096], DType::F8E4M3)],
        ),
        OpKind::Cast => (Op::Cast { dtype: DType::BF16 }, vec![f(&[16, 4096])]),
        OpKind::Concat => (
            Op::Concat { axis: 1 },
            vec![f(&[1, 16, 1024]), f(&[1, 1, 1024])],
        ),
        OpKind::Split => (
            Op::Split {
                axis: 2,
                sizes: vec![4096, 1024, 1024],
            },
            vec![f(&[1, 16, 6144])],
        ),
        OpKind::CacheWrite => (
            Op::CacheWrite,
            vec![
                f(&[64, 16, 1024]),
                f(&[8, 1, 1024]),
                TensorSpec::new(&[8], DType::I64),
            ],
        ),
        OpKind::ActAndMul => (
            Op::ActAndMul {
                act: kpt::core::graph::Activation::Silu,
            },
            vec![f(&[16, 22016])],
        ),
    }
}

/// The device `kpt kernels --explain --on NAME` explains against: a recorded AMD device
/// as the ROCm backend would present it with rocBLAS and hipBLASLt installed.
#[cfg(feature = "rocm")]
fn recorded_device(name: &str) -> anyhow::Result<kpt::core::hardware::DeviceInfo> {
    Ok(kpt::amd::backend_device_info(
        &kpt::amd::recorded_device(name)?,
        kpt::amd::Libraries::ALL,
    ))
}

#[cfg(not(feature = "rocm"))]
fn recorded_device(name: &str) -> anyhow::Result<kpt::core::hardware::DeviceInfo> {
    anyhow::bail!(
        "`--on {name}` needs the AMD device tables of the `rocm` cargo feature \
         (rebuild with `cargo build --release -p kpt --features rocm`)"
    )
}

fn kernels(
    cfg: KptConfig,
    op: Option<&str>,
    explain: bool,
    on: Option<&str>,
) -> anyhow::Result<()> {
    let rt = Runtime::new(cfg)?;
    let ops: Vec<OpKind> = match op {
        Some(name) => vec![name.parse()?],
        None => OpKind::ALL.to_vec(),
    };
    if !explain {
        let mut t = Table::new([
            "op",
            "kernel",
            "backend",
            "dtypes",
            "weights",
            "priority",
            "description",
        ]);
        for &k in &ops {
            for def in rt.kernels().for_op(k) {
                let names = |d: &[DType]| d.iter().map(|d| d.name()).collect::<Vec<_>>().join(",");
                t.row([
                    k.to_string(),
                    def.name.clone(),
                    def.backend.to_string(),
                    names(&def.dtypes),
                    if def.weight_dtypes.is_empty() {
                        "-".into()
                    } else {
                        names(&def.weight_dtypes)
                    },
                    def.priority.to_string(),
                    def.description.clone(),
                ]);
            }
        }
        println!("{t}");
        return Ok(());
    }
    let device = match on {
        Some(name) => recorded_device(name)?,
        None => rt.backend()?.device().clone(),
    };
    if on.is_some() {
        println!(
            "{} ({}, recorded: what the ROCm backend would run there with rocBLAS and \
             hipBLASLt installed)",
            device.name,
            device.arch.as_deref().unwrap_or("-")
        );
    }
    for &k in &ops {
        let (op, specs) = sample(k);
        let sig: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        println!("{op} on {} with [{}]:", device.name, sig.join(", "));
        let mut t = Table::new(["rank", "kernel", "priority", "reason"]);
        for c in rt.kernels().explain(&op, &specs, &device) {
            t.row([
                c.rank.map_or("-".into(), |r| r.to_string()),
                c.kernel,
                c.priority.to_string(),
                c.reason,
            ]);
        }
        println!("{t}");
    }
    Ok(())
}

fn validate(
    cfg: KptConfig,
    level: Option<OptLevel>,
    model: Option<PathBuf>,
    tokens: usize,
    metrics: Option<&Path>,
) -> anyhow::Result<()> {
    let level = level.unwrap_or(cfg.precision.level);
    let scale = cfg.precision.tolerance_scale;
    let rt = runtime(cfg)?;
    let pb = spinner(6);
    pb.set_message("loading the checkpoint");
    let dir = match model {
        Some(dir) => dir,
        None => demo_checkpoint(&default_demo_root(), &DemoConfig::default())?,
    };
    let m = kpt::model::load(&dir)?;
    require_decoder(&m.model, "validate")?;
    let prompt_len = 16;
    let graph = m.model.graph(Phase::Prefill, prompt_len)?;
    pb.set_message(format!("{level}: optimizing"));
    let mut exec = rt.executor(rt.optimize(&graph, level)?)?;
    let inputs = prompt_inputs(&m.tokenizer, prompt_len)?;
    pb.set_message(format!("{level}: validating every op"));
    let report = validate_plan(&mut exec, &graph, &CpuReference, &inputs, scale)?;
    let compared = run_demo(
        &rt,
        &DemoOptions {
            model_dir: Some(dir),
            prompt_len,
            new_tokens: tokens.max(1),
            ..DemoOptions::default()
        },
        |msg| {
            pb.set_message(msg.to_string());
            pb.inc(1);
        },
    )?;
    pb.finish_and_clear();
    let mut t = Table::new([
        "node",
        "op",
        "kernel",
        "dtype",
        "max abs",
        "max rel",
        "tolerance",
        "ok",
    ]);
    for o in &report.ops {
        t.row([
            o.node.clone(),
            o.op.clone(),
            o.kernel.clone(),
            o.dtype.to_string(),
            format!("{:.2e}", o.error.max_abs),
            format!("{:.2e}", o.error.max_rel),
            format!("{:.1e}", o.tolerance.abs),
            if o.error.within { "yes" } else { "NO" }.to_string(),
        ]);
    }
    println!("{}: {}", compared.model_dir.display(), compared.description);
    println!("{t}");
    for o in &report.outputs {
        println!(
            "output {}: max abs {:.3e} (max |ref| {:.3e}), budget {:.1e} -> {}",
            o.output,
            o.error.max_abs,
            o.error.ref_max,
            o.budget,
            if o.error.within { "ok" } else { "FAILED" }
        );
    }
    println!(
        "\nevery level against the unoptimized fp32 model (f64 reference ops), prompt of {} tokens:",
        compared.prompt_tokens
    );
    let mut c = Table::new([
        "level",
        "weights",
        "logits max abs",
        "logits max rel",
        "= greedy tokens",
        "worst op/tol",
        "valid",
    ]);
    for r in &compared.rows {
        c.row([
            r.level.clone(),
            r.weights.clone(),
            format!("{:.2e}", r.max_abs_error),
            format!("{:.2e}", r.max_rel_error),
            format!("{}/{}", r.tokens_matching, compared.new_tokens),
            format!("{:.2}", r.worst_op_ratio),
            if r.passed { "yes" } else { "NO" }.to_string(),
        ]);
    }
    println!("{c}");
    if let Some(path) = metrics {
        write_metrics(&rt, path)?;
    }
    report.into_result()?;
    if let Some(bad) = compared.rows.iter().find(|r| !r.passed) {
        anyhow::bail!("level {} failed validation", bad.level);
    }
    println!(
        "level {level}: all {} ops within tolerance",
        exec.plan().graph.nodes().len()
    );
    Ok(())
}

/// Writes `text` to stdout at once (streaming), as a typed error when stdout is gone.
fn emit(text: &str) -> Result<(), ModelError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| ModelError::Io {
            path: PathBuf::from("<stdout>"),
            source: e,
        })
}

fn run_model(cfg: KptConfig, args: RunArgs) -> anyhow::Result<()> {
    let level = args.level.unwrap_or(cfg.precision.level);
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;
    let rt = runtime(cfg)?;
    let pb = spinner(2);
    pb.set_message(format!("loading {}", args.model.display()));
    let m = kpt::model::load(&args.model)?;
    require_decoder(&m.model, "run")?;
    let prompts = args
        .prompt
        .iter()
        .map(|p| m.tokenizer.encode(p, true))
        .collect::<Result<Vec<_>, _>>()?;
    pb.inc(1);
    pb.set_message(format!("optimizing at {level}"));
    let runner = plan_runner(&rt, &m.model, level, prompts.len() > 1, Phase::DecodeGreedy)?;
    pb.finish_and_clear();
    let eos: &[u32] = if args.ignore_eos {
        &[]
    } else {
        &m.tokenizer.special_tokens().eos
    };
    let stop = StopCondition::new(args.max_tokens)
        .with_eos(eos)
        .with_stop_strings(args.stop.iter().cloned());
    let mut g = Generator::for_model(runner, &m.model)?;
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let single = refs.len() == 1;
    let mut stream = m.tokenizer.stream(true);
    let gen = g.generate(&refs, &sampling, &stop, Some(&m.tokenizer), |e| {
        if single {
            if let Some(piece) = stream.step(e.token)? {
                emit(&piece)?;
            }
        }
        Ok(())
    })?;
    if single {
        emit("\n")?;
    } else {
        for (i, o) in gen.outputs.iter().enumerate() {
            emit(&format!(
                "[{i}] {}{}\n",
                args.prompt[i],
                m.tokenizer.decode(&o.tokens, true)?
            ))?;
        }
    }
    let s = &gen.stats;
    let stops: Vec<String> = gen.outputs.iter().map(|o| o.stop.to_string()).collect();
    eprintln!(
        "{} prompt tokens, {} generated at {level} on {}: prefill {:.1} ms ({:.0} tokens/s), \
         decode {:.2} ms/step ({:.1} tokens/s); stopped: {}",
        s.prompt_tokens,
        s.generated_tokens,
        rt.backend()?.name(),
        s.prefill_ms,
        s.prefill_tokens_per_second(),
        kpt_monitor::median(&s.decode_ms).unwrap_or(0.0),
        s.decode_tokens_per_second(),
        stops.join(", ")
    );
    Ok(())
}

fn embed(
    cfg: KptConfig,
    model: &Path,
    texts: &[String],
    level: Option<OptLevel>,
    json: bool,
) -> anyhow::Result<()> {
    let level = level.unwrap_or(cfg.precision.level);
    let rt = runtime(cfg)?;
    let m = kpt::model::load(model)?;
    let vectors = kpt::model::embed(&rt, &m, texts, level)?;
    if json {
        let items: Vec<serde_json::Value> = texts
            .iter()
            .zip(&vectors)
            .map(|(t, v)| serde_json::json!({ "text": t, "dim": v.len(), "embedding": v }))
            .collect();
        println!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(());
    }
    let mut t = Table::new(["text", "dim", "norm", "first values"]);
    for (text, v) in texts.iter().zip(&vectors) {
        let short: String = if text.chars().count() > 40 {
            text.chars().take(37).chain("...".chars()).collect()
        } else {
            text.clone()
        };
        let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let first: Vec<String> = v.iter().take(4).map(|x| format!("{x:.4}")).collect();
        t.row([
            short,
            v.len().to_string(),
            format!("{norm:.4}"),
            format!("[{}, ...]", first.join(", ")),
        ]);
    }
    println!(
        "{} ({}), level {level}:",
        m.dir.display(),
        kpt::model::describe(&m.config)
    );
    println!("{t}");
    Ok(())
}

fn bench_model_cmd(
    cfg: KptConfig,
    model: &Path,
    opts: ModelBenchOptions,
    json: bool,
) -> anyhow::Result<()> {
    let rt = runtime(cfg)?;
    let pb = spinner(1 + opts.levels.len() as u64 * (opts.iters.max(1) as u64 + 2));
    pb.set_message(format!("loading {}", model.display()));
    let m = kpt::model::load(model)?;
    pb.inc(1);
    let rows = bench_model(&rt, &m, &opts, |msg| {
        pb.set_message(msg.to_string());
        pb.inc(1);
    })?;
    pb.finish_and_clear();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{} ({}) on {}:",
        m.dir.display(),
        kpt::model::describe(&m.config),
        rt.backend()?.name()
    );
    let mut t = Table::new([
        "level",
        "weights",
        "prompt",
        "prefill ms",
        "prefill tok/s",
        "tokens",
        "ms/token",
        "decode tok/s",
    ]);
    for r in &rows {
        t.row([
            r.level.clone(),
            r.weights.clone(),
            r.prompt_tokens.to_string(),
            format!("{:.2}", r.prefill_ms),
            format!("{:.0}", r.prefill_tokens_per_s),
            r.new_tokens.to_string(),
            format!("{:.2}", r.decode_ms_per_token),
            format!("{:.1}", r.decode_tokens_per_s),
        ]);
    }
    println!("{t}");
    Ok(())
}

fn bench(
    cfg: KptConfig,
    quick: bool,
    iters: usize,
    json: Option<&Path>,
    profile: bool,
) -> anyhow::Result<()> {
    let rt = runtime(cfg)?;
    let profiling = start_profile(&rt, profile)?;
    let cases = default_cases(quick)?;
    let pb = spinner(cases.len() as u64);
    let mut results = Vec::new();
    for case in &cases {
        pb.set_message(case.name.clone());
        results.push(run_case(&rt, case, iters)?);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let mut t = Table::new(["case", "kernel", "median µs", "GFLOP/s", "GB/s"]);
    for r in &results {
        t.row([
            r.name.clone(),
            r.kernel.clone(),
            format!("{:.1}", r.median_us),
            format!("{:.2}", r.gflops),
            format!("{:.2}", r.gbps),
        ]);
    }
    println!("{t}");
    if profiling {
        print_profile(&rt)?;
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Turns the backend's profiler on when asked; false (with a note) when the backend
/// has none.
fn start_profile(rt: &Runtime, asked: bool) -> anyhow::Result<bool> {
    if !asked {
        return Ok(false);
    }
    let backend = rt.backend()?;
    let on = backend.set_profiling(true)?;
    if !on {
        eprintln!("note: backend {} has no profiler", backend.name());
    }
    Ok(on)
}

/// Prints the backend's per-kernel profile as an aligned table.
fn print_profile(rt: &Runtime) -> anyhow::Result<()> {
    let backend = rt.backend()?;
    let rows = backend.profile()?;
    println!(
        "kernel profile on {} (CUDA events on a GPU, wall clock on the CPU):",
        backend.name()
    );
    let mut t = Table::new([
        "kernel", "op", "calls", "total ms", "mean µs", "GB/s", "GFLOP/s",
    ]);
    for p in &rows {
        t.row([
            p.kernel.clone(),
            p.op.clone(),
            p.calls.to_string(),
            format!("{:.3}", p.seconds * 1e3),
            format!("{:.1}", p.mean_seconds() * 1e6),
            format!("{:.1}", p.bytes_per_second() / 1e9),
            format!("{:.1}", p.flops_per_second() / 1e9),
        ]);
    }
    println!("{t}");
    Ok(())
}

/// Writes the backend's counters to `path` as OpenMetrics text (a note on stderr, so
/// that `--json` output stays one document).
fn write_metrics(rt: &Runtime, path: &Path) -> anyhow::Result<()> {
    let backend = rt.backend()?;
    let counters = BackendCounters::of(backend.as_ref());
    write_openmetrics(path, std::slice::from_ref(&counters))?;
    eprintln!(
        "wrote {} ({} counters of {})",
        path.display(),
        counters.counters.len(),
        counters.backend
    );
    Ok(())
}

fn demo(
    cfg: KptConfig,
    model: Option<PathBuf>,
    tokens: usize,
    json: bool,
    profile: bool,
    levels: Vec<OptLevel>,
    metrics: Option<&Path>,
) -> anyhow::Result<()> {
    let rt = runtime(cfg)?;
    let profiling = start_profile(&rt, profile)?;
    let mut opts = DemoOptions {
        new_tokens: tokens.max(1),
        model_dir: model,
        ..DemoOptions::default()
    };
    if !levels.is_empty() {
        opts.levels = levels;
    }
    let pb = spinner(3 + 3 * opts.levels.len() as u64);
    let report = run_demo(&rt, &opts, |msg| {
        pb.set_message(msg.to_string());
        pb.inc(1);
    })?;
    pb.finish_and_clear();
    let rows = &report.rows;
    if json {
        println!("{}", serde_json::to_string_pretty(rows)?);
    } else {
        println!(
            "kpt demo: {} ({:.1} M params)\ncheckpoint: {}",
            report.description,
            report.params as f64 / 1e6,
            report.model_dir.display()
        );
        println!(
            "backend: {} ({}); prompt {} tokens, generating {}",
            rt.backend()?.name(),
            rt.backend()?.device().name,
            report.prompt_tokens,
            report.new_tokens
        );
        let mut t = Table::new([
            "level",
            "weights",
            "nodes",
            "weight MiB",
            "prefill ms",
            "ms/token",
            "tokens/s",
            "max rel err",
            "worst op/tol",
            "= ref tokens",
            "valid",
        ]);
        for r in rows {
            t.row([
                r.level.clone(),
                r.weights.clone(),
                format!("{} -> {}", r.nodes.0, r.nodes.1),
                format!("{:.1}", r.weight_bytes as f64 / (1 << 20) as f64),
                format!("{:.1}", r.prefill_ms),
                format!("{:.2}", r.ms_per_token),
                format!("{:.0}", 1e3 / r.ms_per_token.max(1e-9)),
                format!("{:.1e}", r.max_rel_error),
                format!("{:.2}", r.worst_op_ratio),
                format!("{}/{}", r.tokens_matching, report.new_tokens),
                if r.passed { "yes" } else { "NO" }.to_string(),
            ]);
        }
        println!("{t}");
        let counters = rt.backend()?.counters();
        if !counters.is_empty() {
            let mut t = Table::new(["backend counter", "value"]);
            for (name, value) in counters {
                t.row([name, value.to_string()]);
            }
            println!("{t}");
        }
    }
    if profiling {
        print_profile(&rt)?;
    }
    if let Some(path) = metrics {
        write_metrics(&rt, path)?;
    }
    if let Some(bad) = rows.iter().find(|r| !r.passed) {
        anyhow::bail!("level {} failed validation", bad.level);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kpt").chain(args.iter().copied()))
    }

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn device_is_global_and_takes_every_backend() {
        for choice in BackendChoice::ALL {
            for args in [
                ["--device", choice.name(), "demo"],
                ["demo", "--device", choice.name()],
                ["validate", "--device", choice.name()],
                ["bench", "--device", choice.name()],
            ] {
                let cli = parse(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
                assert_eq!(cli.device, Some(choice), "{args:?}");
            }
        }
        let cli = parse(&["kernels", "--explain"]).expect("parses");
        assert_eq!(cli.device, None);
        let cli = parse(&["bench", "--quick", "--device=CUDA"]).expect("case is ignored");
        assert_eq!(cli.device, Some(BackendChoice::Cuda));
        let cli = parse(&["demo", "--device", "nvidia"]).expect("alias");
        assert_eq!(cli.device, Some(BackendChoice::Cuda));
    }

    #[test]
    fn kernels_explain_on_a_recorded_device() {
        let cli = parse(&["kernels", "--explain", "--on", "mi300x"]).expect("parses");
        match cli.command {
            Command::Kernels { on, explain, .. } => {
                assert!(explain);
                assert_eq!(on.as_deref(), Some("mi300x"));
            }
            _ => panic!("not the kernels command"),
        }
        assert!(
            parse(&["kernels", "--on", "mi300x"]).is_err(),
            "--on needs --explain"
        );
        let cfg = KptConfig::default();
        let ok = kernels(cfg.clone(), Some("softmax"), true, Some("mi300x"));
        let unknown = kernels(cfg, Some("softmax"), true, Some("mi100"));
        if cfg!(feature = "rocm") {
            ok.unwrap();
            let e = unknown.unwrap_err().to_string();
            assert!(e.contains("no recorded AMD device `mi100`"), "{e}");
        } else {
            assert!(ok.unwrap_err().to_string().contains("rocm"));
        }
    }

    #[test]
    fn an_unknown_device_is_a_usage_error_listing_the_choices() {
        let e = match parse(&["demo", "--device", "gpu"]) {
            Err(e) => e,
            Ok(_) => panic!("`--device gpu` parsed"),
        };
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
        let text = e.to_string();
        for name in ["auto", "cpu", "cuda", "rocm", "tpu"] {
            assert!(text.contains(name), "{name} missing: {text}");
        }
    }

    #[test]
    fn device_wins_over_environment_and_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("kpt.toml");
        std::fs::write(&path, "[hardware]\nbackend = \"tpu\"\n").expect("write config");
        let env = [("KPT_BACKEND", "rocm"), ("KPT_HARDWARE__BACKEND", "cuda")];
        let layered = KptConfig::load_layered_from(Some(&path), env).expect("loads");
        assert_eq!(layered.hardware.backend, BackendChoice::Cuda);
        let cfg = with_device(layered.clone(), Some(BackendChoice::Cpu));
        assert_eq!(cfg.hardware.backend, BackendChoice::Cpu);
        // Without the flag the layered value stays.
        assert_eq!(
            with_device(layered, None).hardware.backend,
            BackendChoice::Cuda
        );
    }
}
