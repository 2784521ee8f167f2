//! `kpt-bench-models`: a LLaMA-shaped checkpoint through kpt-models and through Hugging
//! Face transformers (`attn_implementation="sdpa"`) on the same device, in one run.
//!
//! The worker (`hf_models.py`) creates the model with random weights and saves it as
//! safetensors; kpt loads that checkpoint, optimizes its graphs at the balanced level and
//! runs them. Prefill and decode are timed on both sides (warm-up, then the median of
//! the repetitions); the logits of an fp32 run and the greedy tokens of a bf16 run are
//! compared. The report follows docs/reports' schema.

// The worker module of the op benches; their `time` request is not used here.
#[allow(dead_code)]
#[path = "../compare/torch.rs"]
mod torch;

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kpt_core::backend::Backend;
use kpt_core::exec::{DeviceTensor, Executor, RunTensor};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::rand::SplitMix64;
use kpt_core::validate::run_reference;
use kpt_core::{DType, Graph, OptLevel, Tensor};
use kpt_kernels::{CpuBackend, CpuReference, KernelRegistry};
use kpt_models::generate::{
    argmax, decode_greedy_pipelined, decode_inputs, host_cache_with_room, picked_tokens,
    picks_tokens, prefill_inputs, prefill_inputs_for, resident_outputs, CachePool,
};
use kpt_models::lower::pack_prompts;
use kpt_models::{Checkpoint, Model, Phase};
use kpt_monitor::{median, Machine, Report, Row};
use kpt_nvidia::{CudaBackend, CudaOptions};
use serde_json::{json, Value};

use torch::TorchWorker;

#[derive(Parser, Debug)]
#[command(about = "kpt-models vs Hugging Face transformers on the same device, same run")]
struct Args {
    /// Python interpreter with torch and transformers.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The transformers worker script.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/hf_models.py"))]
    script: PathBuf,
    /// Where the report goes.
    #[arg(long, default_value = "docs/reports")]
    out: PathBuf,
    /// Report name (files are NAME-latest.json etc.).
    #[arg(long, default_value = "models-h100")]
    name: String,
    /// Where the worker writes the checkpoint.
    #[arg(long, default_value = "target/bench-models/llama")]
    dir: PathBuf,
    /// Device of both sides.
    #[arg(long, value_enum, default_value = "cuda")]
    device: Device,
    /// Model size.
    #[arg(long, value_enum, default_value = "1b")]
    size: Size,
    /// Timed repetitions per side.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Decode steps per repetition.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// The command recorded in the report.
    #[arg(long, default_value = "kpt-bench-models (cargo xtask gpu-bundle)")]
    command: String,
    /// Only write the checkpoint to `--dir` (for benchmarks that read it), then exit.
    #[arg(long)]
    checkpoint_only: bool,
    /// Run one greedy decode step of one sequence (the decode rows' context, launched
    /// node by node) between `cuProfilerStart` and `cuProfilerStop`, for Nsight Compute
    /// with `--profile-from-start off`, then exit.
    #[arg(long)]
    ncu_decode_step: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
enum Device {
    Cpu,
    Cuda,
}

/// Model sizes: the 1.1B LLaMA shape, and a tiny one to try the harness.
#[derive(ValueEnum, Clone, Copy, Debug)]
enum Size {
    #[value(name = "1b")]
    OneB,
    /// ~124M parameters (hidden 768, 12 layers): the CPU comparison.
    #[value(name = "100m")]
    M100,
    Tiny,
}

/// Shapes of the timed cases for a size.
struct Shapes {
    prefill_seq: usize,
    packed: (usize, usize),
    context: usize,
    decode_batch: usize,
}

impl Size {
    /// `LlamaConfig` keyword arguments.
    fn config(self) -> Value {
        let (hidden, layers, heads, kv, inter, vocab) = match self {
            Size::OneB => (2048, 22, 32, 4, 5632, 32000),
            Size::M100 => (768, 12, 12, 4, 2048, 32000),
            Size::Tiny => (256, 2, 8, 2, 688, 1000),
        };
        json!({
            "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": inter, "vocab_size": vocab,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false,
        })
    }

    fn shapes(self) -> Shapes {
        match self {
            Size::OneB => Shapes {
                prefill_seq: 2048,
                packed: (8, 512),
                context: 512,
                decode_batch: 32,
            },
            Size::M100 => Shapes {
                prefill_seq: 256,
                packed: (4, 64),
                context: 128,
                decode_batch: 4,
            },
            Size::Tiny => Shapes {
                prefill_seq: 128,
                packed: (4, 32),
                context: 32,
                decode_batch: 4,
            },
        }
    }
}

/// What kpt needs to run a model on one backend.
struct Kpt {
    backend: Arc<dyn Backend>,
    registry: KernelRegistry,
    vocab: usize,
    rng: SplitMix64,
    /// Caches of finished repetitions, reused so that every repetition's decode steps
    /// replay one captured graph (as a server's preallocated cache would).
    pool: RefCell<CachePool>,
}

impl Kpt {
    fn executor(&self, graph: &Graph, level: OptLevel) -> Result<Executor> {
        let plan = auto_optimize(
            graph,
            level,
            &PrecisionPolicy::default(),
            &self.registry,
            self.backend.device(),
        )?;
        Ok(Executor::new(plan, self.backend.clone())?)
    }

    fn ids(&mut self, n: usize) -> Vec<i64> {
        (0..n).map(|_| self.rng.below(self.vocab) as i64).collect()
    }

    /// Seconds of each of `reps` calls of `f` after two warm-up calls.
    fn repeat(&self, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
        for _ in 0..2 {
            f()?;
        }
        (0..reps).map(|_| self.time(&mut f)).collect()
    }

    /// Seconds of one call of `f`, after the device finished it.
    fn time(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.backend.synchronize()?;
        let t0 = Instant::now();
        f()?;
        self.backend.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// `[b, n]` ids of `b` sequences of `n` tokens and their `[n]` positions from `start`.
fn batch_inputs(rows: &[Vec<i64>], start: usize) -> Result<Vec<RunTensor>> {
    let n = rows.first().map_or(0, Vec::len);
    if rows.iter().any(|r| r.len() != n) {
        bail!("a dense batch needs sequences of one length");
    }
    Ok(vec![
        RunTensor::Host(Tensor::from_vec(rows.concat(), &[rows.len(), n])?),
        RunTensor::Host(Tensor::from_vec(
            (start..start + n).map(|p| p as i64).collect(),
            &[n],
        )?),
    ])
}

/// The greedy token of each sequence: the argmax of its last position's logits
/// `[b, s, vocab]`.
fn argmax_last(logits: &Tensor) -> Result<Vec<i64>> {
    let (b, vocab) = (
        logits.shape()[0],
        logits.shape().last().copied().unwrap_or(1),
    );
    let per_seq = logits.numel() / b.max(1);
    // The last row of each sequence, read in the logits' own dtype: converting a whole
    // batch's logits to f64 first (32 x 32000 values) costs milliseconds per step.
    let rows = |at: &dyn Fn(usize) -> f64| -> Result<Vec<i64>> {
        (0..b)
            .map(|i| {
                let start = (i + 1) * per_seq - vocab;
                let last: Vec<f64> = (start..start + vocab).map(at).collect();
                Ok(i64::from(argmax(&last)?))
            })
            .collect()
    };
    let t = logits.contiguous();
    match t.dtype() {
        DType::BF16 => {
            let v = t.as_slice::<half::bf16>()?;
            rows(&|i| v[i].to_f64())
        }
        DType::F32 => {
            let v = t.as_slice::<f32>()?;
            rows(&|i| f64::from(v[i]))
        }
        _ => {
            let v = t.to_f64_vec();
            rows(&|i| v[i])
        }
    }
}

/// Sequences of one length decoded together as a `[batch, 1]` graph run: their caches
/// on the device (one block per sequence, written in place), their length and their
/// next tokens.
struct Batch {
    caches: Vec<DeviceTensor>,
    len: usize,
    next: Vec<i64>,
    /// Seconds the host spent launching the steps (`Executor::last_launch_seconds`, every
    /// output left on the device so that nothing waits for the GPU before the run's end).
    enqueue: f64,
}

impl Batch {
    /// Prefills the prompts (one length) and keeps the caches on the device, one block
    /// per sequence with room for a decode step (see `kpt_models::generate`).
    fn prefill(kpt: &Kpt, prefill: &mut Executor, prompts: &[Vec<i64>]) -> Result<Self> {
        let keep: Vec<bool> = (0..prefill.plan().graph.outputs().len())
            .map(|i| i > 0)
            .collect();
        let mut outs = prefill
            .run_resident(batch_inputs(prompts, 0)?, &keep)?
            .into_iter();
        let logits = outs
            .next()
            .context("no logits")?
            .into_host(kpt.backend.as_ref())?;
        let len = prompts.first().map_or(0, Vec::len);
        let backend = kpt.backend.as_ref();
        let caches = outs
            .map(|o| Ok(o.into_device(backend)?))
            .collect::<Result<Vec<_>>>()?;
        let mut pool = kpt.pool.borrow_mut();
        let caches = if prompts.len() == 1 {
            pool.with_room(caches, len, backend)?
        } else {
            // Each sequence's rows move to its own block: once, through the host.
            let grown = caches
                .iter()
                .map(|d| Ok(host_cache_with_room(d.download(backend)?, len)?))
                .collect::<Result<Vec<_>>>()?;
            pool.upload(grown, backend)?
        };
        Ok(Self {
            caches,
            len,
            next: argmax_last(&logits)?,
            enqueue: 0.0,
        })
    }

    /// One decode step: writes the next tokens' keys and values and picks the following
    /// tokens. A single sequence's full cache grows; a batch must have room.
    fn step(&mut self, kpt: &Kpt, decode: &mut Executor) -> Result<Vec<i64>> {
        let backend = kpt.backend.as_ref();
        if self.next.len() == 1 {
            self.caches = kpt.pool.borrow_mut().with_room(
                std::mem::take(&mut self.caches),
                self.len,
                backend,
            )?;
        }
        let capacity = self.caches.first().map_or(0, |c| c.spec.shape[1]);
        let mut inputs: Vec<RunTensor> = decode_inputs(&self.next, self.len, capacity)?
            .into_iter()
            .map(RunTensor::Host)
            .collect();
        inputs.extend(self.caches.drain(..).map(RunTensor::Device));
        // A plan that picks the tokens itself (`Phase::DecodeGreedy`) keeps its logits on
        // the device and sends one id per sequence; otherwise the logits come to the host.
        let picks = picks_tokens(&decode.plan().graph);
        let keep = resident_outputs(&decode.plan().graph, picks);
        let mut outs = decode.run_resident(inputs, &keep)?.into_iter();
        self.enqueue += decode.last_launch_seconds();
        let logits = outs.next().context("no logits")?;
        let next = if picks {
            let ids = outs.next().context("no tokens")?.into_host(backend)?;
            picked_tokens(&ids)?.into_iter().map(i64::from).collect()
        } else {
            argmax_last(&logits.into_host(backend)?)?
        };
        for o in outs {
            match o {
                RunTensor::Device(d) => self.caches.push(d),
                RunTensor::Host(_) => bail!("a cache left the device"),
            }
        }
        self.len += 1;
        Ok(std::mem::replace(&mut self.next, next))
    }
}

/// How a decode timing runs its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Steps {
    /// Each step waited for ([`Batch::step`]).
    Waited,
    /// One sequence's steps queued ahead of its tokens ([`decode_ahead`]).
    Ahead,
}

/// Seconds per decode step of `batch` sequences (`steps` steps after a prefill of `ctx`
/// tokens, `reps` timed repetitions after one warm-up), and per step the host's time
/// launching it (waited steps only).
fn decode_per_token(
    kpt: &mut Kpt,
    (prefill, decode): (&mut Executor, &mut Executor),
    batch: usize,
    (ctx, steps, reps): (usize, usize, usize),
    how: Steps,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut per_token, mut enqueue) = (Vec::new(), Vec::new());
    for rep in 0..reps + 1 {
        let prompts: Vec<Vec<i64>> = (0..batch).map(|_| kpt.ids(ctx)).collect();
        let mut seqs = Batch::prefill(kpt, prefill, &prompts)?;
        let t = kpt.time(|| match how {
            Steps::Ahead => decode_ahead(kpt, decode, &mut seqs, steps).map(drop),
            Steps::Waited => {
                for _ in 0..steps {
                    seqs.step(kpt, decode)?;
                }
                Ok(())
            }
        })?;
        if rep >= 1 {
            per_token.push(t / steps as f64);
            enqueue.push(seqs.enqueue / steps as f64);
        }
        kpt.pool.borrow_mut().release(seqs.caches);
    }
    Ok((per_token, enqueue))
}

/// `steps` greedy tokens of `seq` (one sequence) as `kpt run` decodes them
/// (`decode_greedy_pipelined`: each step queued before the token of the step before is
/// read). Leaves `seq`'s length and next token as they were.
fn decode_ahead(
    kpt: &Kpt,
    decode: &mut Executor,
    seq: &mut Batch,
    steps: usize,
) -> Result<Vec<u32>> {
    let mut tokens = Vec::with_capacity(steps);
    decode_greedy_pipelined(
        decode,
        &mut kpt.pool.borrow_mut(),
        &mut seq.caches,
        seq.next[0],
        seq.len,
        &mut |t| {
            tokens.push(t);
            Ok(tokens.len() < steps)
        },
    )?;
    Ok(tokens)
}

/// One greedy decode step of one sequence after a prefill of `ctx` tokens, launched node
/// by node, then one replayed as a CUDA graph, each after three unprofiled steps and
/// between `cuProfilerStart` and `cuProfilerStop`.
fn ncu_decode_step(kpt: &mut Kpt, cuda: &CudaBackend, model: &Model, ctx: usize) -> Result<()> {
    let level = OptLevel::Balanced;
    let mut prefill = kpt.executor(&model.graph(Phase::Prefill, ctx)?, level)?;
    let mut decode = kpt.executor(&model.graph(Phase::DecodeGreedy, ctx)?, level)?;
    let prompt = kpt.ids(ctx);
    let mut seq = Batch::prefill(kpt, &mut prefill, &[prompt])?;
    for graphs in [false, true] {
        decode.set_graphs(graphs);
        for _ in 0..3 {
            seq.step(kpt, &mut decode)?;
        }
        cuda.synchronize()?;
        cuda.gpu().external_profiler(true)?;
        seq.step(kpt, &mut decode)?;
        cuda.synchronize()?;
        cuda.gpu().external_profiler(false)?;
    }
    Ok(())
}

/// Kernel time per call of `f` (run `calls` times) from the backend's profiler, and the
/// five kernels that take most of it, as a note.
fn kernel_time(kpt: &Kpt, calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<String> {
    if !kpt.backend.set_profiling(true)? {
        return Ok("no kernel profiler on this backend".into());
    }
    for _ in 0..calls {
        f()?;
    }
    kpt.backend.synchronize()?;
    let profile = kpt.backend.profile()?;
    kpt.backend.set_profiling(false)?;
    let per_call = |seconds: f64| seconds / calls.max(1) as f64 * 1e3;
    let total: f64 = profile.iter().map(|p| p.seconds).sum();
    let top = profile
        .iter()
        .take(5)
        .map(|p| format!("{} {:.2} ms", p.kernel, per_call(p.seconds)))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(format!(
        "kernels {:.2} ms per call (profiled); most time: {top}",
        per_call(total)
    ))
}

/// The targets: its H100 figures on the GPU, parity with transformers on the
/// CPU.
trait Target {
    fn with_target_or_parity(self, gpu: bool, gpu_target: impl FnOnce(Row) -> Row) -> Row;
}

impl Target for Row {
    fn with_target_or_parity(self, gpu: bool, gpu_target: impl FnOnce(Row) -> Row) -> Row {
        if gpu {
            gpu_target(self)
        } else {
            self.with_target_ratio(1.0)
        }
    }
}

fn median_of(v: &[f64]) -> f64 {
    median(v).unwrap_or(f64::NAN)
}

fn hf_seconds(worker: &mut TorchWorker, req: Value) -> Result<Vec<f64>> {
    let reply = worker.call(&req)?;
    serde_json::from_value(reply["seconds"].clone()).context("worker seconds")
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cuda = match args.device {
        Device::Cpu => None,
        Device::Cuda => {
            // The configuration's environment layer: `KPT_KERNEL__AUTOTUNE_CACHE` pins
            // cuBLASLt's algorithms across runs.
            let options = CudaOptions {
                gemm: (&kpt_core::KptConfig::load_layered(None)?.kernel).into(),
                ..CudaOptions::default()
            };
            Some(Arc::new(
                CudaBackend::new(0, options).context("opening CUDA device 0")?,
            ))
        }
    };
    let backend: Arc<dyn Backend> = match &cuda {
        Some(c) => c.clone(),
        None => Arc::new(CpuBackend::new()?),
    };
    let (dtype, dname) = match args.device {
        Device::Cpu => (DType::F32, "f32"),
        Device::Cuda => (DType::BF16, "bf16"),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut worker = TorchWorker::start(&args.python, &args.script, threads, &[])?;
    let info = worker.info.clone();
    let text = |k: &str| info[k].as_str().unwrap_or("unknown").to_string();
    let mut versions = std::collections::BTreeMap::new();
    for k in ["torch", "transformers"] {
        versions.insert(k.to_string(), text(k));
    }
    versions.insert("kpt".into(), env!("CARGO_PKG_VERSION").into());
    let machine = Machine {
        device: backend.device().name.clone(),
        driver: None,
        cpu: kpt_core::hardware::cpu_info().model_name,
        versions,
    };
    let mut report = Report::new(
        &args.name,
        &args.command,
        kpt_benches::git_commit(),
        machine,
    );

    let progress = ProgressBar::new(7).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    progress.set_message("creating the checkpoint");
    std::fs::create_dir_all(&args.dir)?;
    let dir = args.dir.canonicalize()?;
    let created = worker.call(&json!({
        "op": "create", "config": args.size.config(), "dtype": dname,
        "dir": dir, "seed": 0,
    }))?;
    // HF's `save_pretrained` of a random model writes no tokenizer; `kpt run` and `kpt
    // bench model` on this directory need one.
    let vocab = args.size.config()["vocab_size"].as_u64().unwrap_or(0) as usize;
    kpt_models::synthetic::write_tokenizer(&dir, vocab)?;
    if args.checkpoint_only {
        progress.finish_and_clear();
        eprintln!("wrote the checkpoint to {}", dir.display());
        return Ok(());
    }
    progress.inc(1);
    progress.set_message("loading it in kpt");
    let ckpt = Checkpoint::open(&dir)?;
    let model = ckpt.load_model(dtype)?;
    let Model::Llama(llama) = &model else {
        bail!("the worker wrote a {} checkpoint", ckpt.config.model_type());
    };
    let hidden = llama.config.hidden_size;
    let mut kpt = Kpt {
        backend: backend.clone(),
        registry: KernelRegistry::with_builtin(),
        vocab: llama.config.vocab_size,
        rng: SplitMix64::new(7),
        pool: RefCell::default(),
    };
    let hf = format!("HF transformers {} (sdpa, {dname})", text("transformers"));
    let gpu = args.device == Device::Cuda;
    let shapes = args.size.shapes();
    let level = OptLevel::Balanced;
    let reps = args.reps.max(1);
    if args.ncu_decode_step {
        let gpu = cuda
            .as_ref()
            .context("--ncu-decode-step needs --device cuda")?;
        return ncu_decode_step(&mut kpt, gpu, &model, shapes.context);
    }
    let params = created["params"].as_u64().unwrap_or(0);
    let model_note = format!(
        "{params} parameters, hidden {hidden}, {} layers, random weights",
        llama.config.num_hidden_layers
    );

    // Prefill, one sequence: every position's logits (the row), then as
    // generation runs it, the last position's only.
    progress.inc(1);
    let s = shapes.prefill_seq;
    let ids = kpt.ids(s);
    for phase in [Phase::Prefill, Phase::PrefillLast] {
        let last = phase == Phase::PrefillLast;
        progress.set_message(if last {
            "first-token prefill"
        } else {
            "prefill"
        });
        let graph = model.graph(phase, s)?;
        let mut exec = kpt.executor(&graph, level)?;
        let keep = vec![true; exec.plan().graph.outputs().len()];
        let inputs = || -> Result<Vec<RunTensor>> {
            let host = prefill_inputs_for(&graph, &ids)?;
            Ok(host.into_iter().map(RunTensor::Host).collect())
        };
        let times = kpt.repeat(reps, || {
            exec.run_resident(inputs()?, &keep)?;
            Ok(())
        })?;
        let profile = kernel_time(&kpt, 2, || {
            exec.run_resident(inputs()?, &keep)?;
            Ok(())
        })?;
        drop(exec);
        let hf_t = hf_seconds(
            &mut worker,
            json!({"op": "prefill", "dtype": dname, "batch": 1, "seq": s, "reps": reps,
                   "logits_to_keep": usize::from(last)}),
        )?;
        let (name, note) = if last {
            (
                format!("first-token prefill B1 S{s}"),
                "the last position's logits only, as generation needs them (kpt \
                 Phase::PrefillLast, HF logits_to_keep=1, as generate() and vLLM do)"
                    .to_string(),
            )
        } else {
            (
                format!("prefill B1 S{s}"),
                format!("{model_note}; all logits computed on both sides"),
            )
        };
        let row = Row::compared(
            name,
            "ms",
            false,
            median_of(&times) * 1e3,
            median_of(&hf_t) * 1e3,
            &hf,
        )
        .with_target_or_parity(gpu, |r| if last { r } else { r.with_target(9.0) });
        report.rows.push(row.with_note(note).with_note(profile));
    }

    // Prefill, a batch packed without padding.
    progress.inc(1);
    progress.set_message("packed prefill");
    let (b, s) = shapes.packed;
    let mut exec = kpt.executor(&model.graph_packed(b * s, b)?, level)?;
    let prompts: Vec<Vec<i64>> = (0..b).map(|_| kpt.ids(s)).collect();
    let refs: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    let packed = pack_prompts(&refs)?;
    let keep = vec![true; exec.plan().graph.outputs().len()];
    let times = kpt.repeat(reps, || {
        let inputs = packed.iter().cloned().map(RunTensor::Host).collect();
        exec.run_resident(inputs, &keep)?;
        Ok(())
    })?;
    drop(exec);
    let hf_t = hf_seconds(
        &mut worker,
        json!({"op": "prefill", "dtype": dname, "batch": b, "seq": s, "reps": reps}),
    )?;
    let tokens = (b * s) as f64;
    report.rows.push(
        Row::compared(
            format!("prefill B{b} S{s}"),
            "tokens/s",
            true,
            tokens / median_of(&times),
            tokens / median_of(&hf_t),
            &hf,
        )
        .with_target_or_parity(gpu, |r| r.with_target_ratio(3.0))
        .with_note("kpt: one packed variable-length batch; HF: [batch, seq] (no padding needed)"),
    );

    // Decode, one sequence and a batch.
    let steps = args.steps.max(1);
    let ctx = shapes.context;
    let mut prefill = kpt.executor(&model.graph(Phase::Prefill, ctx)?, level)?;
    let mut decode = kpt.executor(&model.graph(Phase::DecodeGreedy, ctx)?, level)?;
    // Every step has one shape: on CUDA each step after the second replays a graph.
    decode.set_graphs(true);
    for batch in [1, shapes.decode_batch] {
        progress.inc(1);
        progress.set_message(format!("decode B{batch}"));
        let (per_token, enqueue) = decode_per_token(
            &mut kpt,
            (&mut prefill, &mut decode),
            batch,
            (ctx, steps, reps),
            Steps::Waited,
        )?;
        // One sequence decodes as `kpt run` does: each step queued ahead of its token.
        let waited = per_token;
        let per_token = match batch {
            1 => {
                let execs = (&mut prefill, &mut decode);
                decode_per_token(&mut kpt, execs, 1, (ctx, steps, reps), Steps::Ahead)?.0
            }
            _ => waited.clone(),
        };
        let hf_t = hf_seconds(
            &mut worker,
            json!({"op": "decode", "dtype": dname, "batch": batch, "context": ctx,
                   "steps": steps, "reps": reps}),
        )?;
        let rate = |t: f64| batch as f64 / t;
        let mut row = Row::compared(
            format!("decode B{batch}, context {ctx}"),
            "tokens/s",
            true,
            rate(median_of(&per_token)),
            rate(median_of(&hf_t)),
            &hf,
        )
        .with_note(format!(
            "{steps} greedy steps per repetition, KV cache kept on the device, tokens \
             picked on the device (argmax in the decode graph)"
        ));
        row = if batch == 1 {
            let prompt: Vec<i64> = (0..ctx as i64).map(|i| i % kpt.vocab as i64).collect();
            // The tokens of steps queued ahead are those of steps waited for one by one.
            let mut seq = Batch::prefill(&kpt, &mut prefill, std::slice::from_ref(&prompt))?;
            let ahead = decode_ahead(&kpt, &mut decode, &mut seq, steps)?;
            kpt.pool.borrow_mut().release(seq.caches);
            let mut seq = Batch::prefill(&kpt, &mut prefill, &[prompt])?;
            let mut one_by_one = Vec::with_capacity(steps);
            for _ in 0..steps {
                seq.step(&kpt, &mut decode)?;
                one_by_one.push(seq.next[0] as u32);
            }
            ensure!(
                ahead == one_by_one,
                "steps queued ahead picked {ahead:?}, steps waited for {one_by_one:?}"
            );
            let profile = kernel_time(&kpt, steps, || {
                seq.step(&kpt, &mut decode)?;
                Ok(())
            })?;
            let row = row
                .with_target_or_parity(gpu, |r| r.with_target(1000.0))
                .with_note(format!(
                    "each step queued before the token of the step before is read and fed \
                     that token on the device, as `kpt run` decodes one greedy sequence: \
                     {:.3} ms per token; steps waited for one by one (the same tokens): \
                     {:.1} tokens/s ({:.3} ms per token, of which the host spends {:.3} ms \
                     launching the step); {profile}",
                    median_of(&per_token) * 1e3,
                    1.0 / median_of(&waited),
                    median_of(&waited) * 1e3,
                    median_of(&enqueue) * 1e3,
                ));
            if gpu {
                // The same step without CUDA graphs, and with cuBLASLt for every linear
                // (no GEMV kernel).
                decode.set_graphs(false);
                let (plain_t, plain_enqueue) = decode_per_token(
                    &mut kpt,
                    (&mut prefill, &mut decode),
                    1,
                    (ctx, steps, reps),
                    Steps::Waited,
                )?;
                decode.set_graphs(true);
                let mut without = kpt.registry.clone();
                without.set_disabled(&["cuda.linear.gemv".to_string()]);
                let plan = auto_optimize(
                    &model.graph(Phase::DecodeGreedy, ctx)?,
                    level,
                    &PrecisionPolicy::default(),
                    &without,
                    kpt.backend.device(),
                )?;
                let mut cublas = Executor::new(plan, kpt.backend.clone())?;
                let (cublas_t, _) = decode_per_token(
                    &mut kpt,
                    (&mut prefill, &mut cublas),
                    1,
                    (ctx, steps, reps),
                    Steps::Waited,
                )?;
                row.with_note(format!(
                    "each step replays a CUDA graph; without graphs, launching node by \
                     node: {:.1} tokens/s ({:.2} ms of host launching per token); kernel \
                     times (profiled without graphs) from CUDA events around each launch, \
                     so they include gaps where the GPU waits for the host; without graphs \
                     and with cuBLASLt for every linear (no GEMV kernel): {:.1} tokens/s",
                    1.0 / median_of(&plain_t),
                    median_of(&plain_enqueue) * 1e3,
                    1.0 / median_of(&cublas_t),
                ))
            } else {
                row
            }
        } else {
            let prompts: Vec<Vec<i64>> = (0..batch).map(|_| kpt.ids(ctx)).collect();
            let mut seqs = Batch::prefill(&kpt, &mut prefill, &prompts)?;
            let profile = kernel_time(&kpt, steps, || {
                seqs.step(&kpt, &mut decode)?;
                Ok(())
            })?;
            row.with_target_or_parity(gpu, |r| r.with_target_ratio(10.0))
                .with_note(format!(
                    "one [batch, 1] decode graph over sequences of one length, each with its \
                     own block of the caches, written in place; {:.2} ms per step, of which \
                     the host spends {:.2} ms launching it; {profile}",
                    median_of(&per_token) * 1e3,
                    median_of(&enqueue) * 1e3,
                ))
        };
        report.rows.push(row);
    }
    drop((prefill, decode));

    // Accuracy: fp32 logits, bf16 greedy tokens.
    progress.inc(1);
    progress.set_message("fp32 logits");
    let prompt = kpt.ids(16);
    let last = 4;
    let reply =
        worker.call(&json!({"op": "logits", "dtype": "f32", "ids": prompt, "last": last}))?;
    let want: Vec<Vec<f64>> = serde_json::from_value(reply["logits"].clone())?;
    let f32_model = ckpt.load_model(DType::F32)?;
    let logits = prefill_logits(&kpt, &f32_model, OptLevel::Conservative, &prompt)?;
    // The f64 reference of the same graph says which side is off.
    let graph = f32_model.graph(Phase::Prefill, prompt.len())?;
    let reference = run_reference(&graph, &CpuReference, &prefill_inputs(&prompt)?)?
        .remove(0)
        .to_f64_vec();
    drop(graph);
    let tail = |v: &[f64]| v[v.len() - last * kpt.vocab..].to_vec();
    let (got, exact) = (tail(&logits), tail(&reference));
    let want: Vec<f64> = want.into_iter().flatten().collect();
    let max_diff =
        |a: &[f64], b: &[f64]| a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    let diff = max_diff(&want, &got);
    let largest = exact.iter().fold(0f64, |m, x| m.max(x.abs()));
    report.rows.push(
        Row::absolute("fp32 logits vs HF", "max abs diff", false, diff)
            .with_target(1e-3)
            .with_max_abs_err(diff)
            .with_note(format!(
                "conservative level, f32 weights; last {last} positions of a 16-token \
                 prompt; against the f64 reference: kpt {:.1e}, HF {:.1e} (largest \
                 logit {largest:.2})",
                max_diff(&got, &exact),
                max_diff(&want, &exact),
            )),
    );

    progress.inc(1);
    progress.set_message("bf16 greedy tokens");
    let new = 32;
    let reply =
        worker.call(&json!({"op": "greedy", "dtype": "bf16", "ids": prompt, "new": new}))?;
    let want: Vec<i64> = serde_json::from_value(reply["tokens"].clone())?;
    let bf16_model = match dtype {
        DType::BF16 => model,
        _ => ckpt.load_model(DType::BF16)?,
    };
    let got = greedy(&kpt, &bf16_model, level, &prompt, new)?;
    let same = common_prefix(&want, &got);
    // Each side's bf16 logits against the f64 reference of the fp32 model, on the
    // prompt's last positions: whether kpt's bf16 run is as exact as HF's.
    let reply =
        worker.call(&json!({"op": "logits", "dtype": "bf16", "ids": prompt, "last": last}))?;
    let hf_bf16: Vec<f64> = serde_json::from_value::<Vec<Vec<f64>>>(reply["logits"].clone())?
        .into_iter()
        .flatten()
        .collect();
    let kpt_bf16 = tail(&prefill_logits(&kpt, &bf16_model, level, &prompt)?);
    let rms = |a: &[f64]| {
        let s: f64 = a.iter().zip(&exact).map(|(x, y)| (x - y) * (x - y)).sum();
        (s / a.len().max(1) as f64).sqrt()
    };
    let bf16_note = format!(
        "; bf16 logits of the prompt's last {last} positions against the f64 reference of \
         the fp32 model, max abs / rms: kpt {:.1e} / {:.1e}, HF {:.1e} / {:.1e}",
        max_diff(&kpt_bf16, &exact),
        rms(&kpt_bf16),
        max_diff(&hf_bf16, &exact),
        rms(&hf_bf16),
    );
    // The fp32 greedy sequence (both sides), which neither bf16 run is bound to keep:
    // how long each follows it says whether kpt's roundings part earlier than HF's.
    let reply = worker.call(&json!({"op": "greedy", "dtype": "f32", "ids": prompt, "new": new}))?;
    let hf_f32: Vec<i64> = serde_json::from_value(reply["tokens"].clone())?;
    let kpt_f32 = greedy(&kpt, &f32_model, OptLevel::Conservative, &prompt, new)?;
    let fp32_note = format!(
        "; the fp32 greedy sequences of HF and kpt agree for {} tokens, and HF's bf16 run \
         follows HF's fp32 one for {}, kpt's bf16 run kpt's fp32 one for {}",
        common_prefix(&hf_f32, &kpt_f32),
        common_prefix(&want, &hf_f32),
        common_prefix(&got, &kpt_f32),
    );
    let mut row = Row::absolute(
        "bf16 greedy tokens equal to HF",
        "tokens",
        true,
        same as f64,
    )
    .with_target(new as f64)
    .with_note(format!(
        "first {new} greedy tokens after a 16-token prompt, {}{fp32_note}{bf16_note}",
        if gpu {
            "bf16 weights and activations"
        } else {
            "bf16 weights (on the CPU kpt rounds activations to bf16 only in linears of more \
             than 16 rows, none here; HF runs bf16 throughout)"
        }
    ));
    if same < new.min(got.len()) {
        // How close the two choices are in fp32, on the text both agreed on.
        let mut text = prompt.clone();
        text.extend_from_slice(&want[..same]);
        let logits = prefill_logits(&kpt, &f32_model, OptLevel::Conservative, &text)?;
        let last = &logits[logits.len() - kpt.vocab..];
        let margin = (last[want[same] as usize] - last[got[same] as usize]).abs();
        row = row.with_note(format!(
            "at token {same} HF chose {} and kpt {}, whose fp32 logits differ by {margin:.1e} \
             (bf16 keeps 8 bits of mantissa)",
            want[same], got[same]
        ));
    }
    report.rows.push(row);
    progress.finish_and_clear();
    write_report(&report, &args.out)
}

/// `new` greedy tokens of `model` at `level` after `prompt`, decoding from a replayed
/// graph as the decode rows do.
fn greedy(
    kpt: &Kpt,
    model: &Model,
    level: OptLevel,
    prompt: &[i64],
    new: usize,
) -> Result<Vec<i64>> {
    let mut prefill = kpt.executor(&model.graph(Phase::Prefill, prompt.len())?, level)?;
    let mut decode = kpt.executor(&model.graph(Phase::DecodeGreedy, prompt.len())?, level)?;
    decode.set_graphs(true);
    let mut seq = Batch::prefill(kpt, &mut prefill, &[prompt.to_vec()])?;
    (0..new)
        .map(|_| Ok(seq.step(kpt, &mut decode)?[0]))
        .collect()
}

/// The logits of every position of `ids` from `model`'s prefill at `level`.
fn prefill_logits(kpt: &Kpt, model: &Model, level: OptLevel, ids: &[i64]) -> Result<Vec<f64>> {
    let mut exec = kpt.executor(&model.graph(Phase::Prefill, ids.len())?, level)?;
    Ok(exec.run(&prefill_inputs(ids)?)?.remove(0).to_f64_vec())
}

/// How many leading tokens two sequences share.
fn common_prefix(a: &[i64], b: &[i64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn write_report(report: &Report, out: &Path) -> Result<()> {
    let written = report.write(out)?;
    println!("{}", report.to_markdown());
    for p in written {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
