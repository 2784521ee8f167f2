//! `kpt-bench-graphs`: the host's time per run of a decode-shaped plan with captured runs
//! (CUDA graphs, `Executor::set_graphs`) off and on, on the same executor and device.
//!
//! Each shape is a LLaMA-like decode step of `layers` layers (embedding, RMS norm, q/k/v
//! on the GEMV kernel, rotary at a host position, `CacheWrite` into device-resident
//! caches at a host slot, split-KV attention over a fixed dense k/v, o, SwiGLU MLP,
//! residual adds, lm_head), about 16 launches per layer. For each mode it reports the
//! median wall time of a step (inputs in, logits out on the host) and the median of
//! `Executor::last_launch_seconds`, and checks that both modes give the same logits bit
//! for bit. Writes one JSON object to stdout (and to `--out` when given).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Parser;
use kpt_core::backend::Backend;
use kpt_core::exec::{DeviceTensor, Executor, RunTensor};
use kpt_core::graph::{Activation, AttentionParams, Graph, Op};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::rand::SplitMix64;
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::KernelRegistry;
use kpt_monitor::median;
use kpt_nvidia::{CudaBackend, CudaOptions};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "host time per decode-shaped run with CUDA graphs off and on")]
struct Args {
    /// Timed steps per mode.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Only the shapes whose name contains this (or, comma-separated, any of these); a
    /// term ending in `$` must end the name.
    #[arg(long)]
    filter: Option<String>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    layers: usize,
    /// Rows of each KV cache.
    capacity: usize,
    /// Keys of the fixed k/v attention reads.
    keys: usize,
}

const SHAPES: [Shape; 2] = [
    // Many small kernels: the host's launches are nearly all of a step.
    Shape {
        name: "small-24l-h256",
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        ffn: 688,
        vocab: 1024,
        layers: 24,
        capacity: 1024,
        keys: 512,
    },
    // The 1.1B LLaMA's decode shapes (TinyLlama: 22 layers, 32 query / 4 kv heads).
    Shape {
        name: "llama-1.1b",
        hidden: 2048,
        heads: 32,
        kv_heads: 4,
        head_dim: 64,
        ffn: 5632,
        vocab: 32000,
        layers: 22,
        capacity: 2048,
        keys: 512,
    },
];

const DT: DType = DType::BF16;

fn random(rng: &mut SplitMix64, shape: &[usize], scale: f32) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f64> = rng
        .vec(n, -scale, scale)
        .into_iter()
        .map(f64::from)
        .collect();
    Ok(Tensor::from_f64(&v, shape, DT)?)
}

/// Inputs: ids, positions, slots (host), then per layer its k and v caches (device).
/// Outputs: logits, then the caches.
fn decode_graph(s: &Shape) -> Result<Graph> {
    let mut rng = SplitMix64::new(5);
    let mut g = Graph::new();
    let kv = s.kv_heads * s.head_dim;
    let q_dim = s.heads * s.head_dim;
    let ids = g.input("ids", DType::I32, &[1, 1]);
    let pos = g.input("positions", DType::I32, &[1]);
    let slots = g.input("slots", DType::I64, &[1]);
    let caches: Vec<_> = (0..s.layers)
        .map(|l| {
            (
                g.input(format!("k_cache{l}"), DT, &[s.capacity, kv]),
                g.input(format!("v_cache{l}"), DT, &[s.capacity, kv]),
            )
        })
        .collect();
    let mut param = |g: &mut Graph, name: String, shape: &[usize], scale: f32| -> Result<_> {
        Ok(g.param(name, random(&mut rng, shape, scale)?))
    };
    let k_fix = param(&mut g, "k_fixed".into(), &[1, s.keys, kv], 1.0)?;
    let v_fix = param(&mut g, "v_fixed".into(), &[1, s.keys, kv], 1.0)?;
    let table = param(&mut g, "embed".into(), &[s.vocab, s.hidden], 1.0)?;
    let mut x = g.op("embed", Op::Embedding, &[ids, table])?;
    let rotary = Op::Rotary {
        head_dim: s.head_dim,
        theta: 10000.0,
        scaling: None,
    };
    let lin = Op::Linear { bias: false };
    let norm = Op::RmsNorm { eps: 1e-5 };
    let w_scale = 1.0 / (s.hidden as f32).sqrt();
    let mut written = Vec::new();
    for (l, &(kc, vc)) in caches.iter().enumerate() {
        let w = param(&mut g, format!("n1.{l}"), &[s.hidden], 1.0)?;
        let h = g.op(format!("n1.{l}"), norm.clone(), &[x, w])?;
        let wq = param(&mut g, format!("q.{l}"), &[q_dim, s.hidden], w_scale)?;
        let wk = param(&mut g, format!("k.{l}"), &[kv, s.hidden], w_scale)?;
        let wv = param(&mut g, format!("v.{l}"), &[kv, s.hidden], w_scale)?;
        let q = g.op(format!("q.{l}"), lin.clone(), &[h, wq])?;
        let k = g.op(format!("k.{l}"), lin.clone(), &[h, wk])?;
        let v = g.op(format!("v.{l}"), lin.clone(), &[h, wv])?;
        let q = g.op(format!("rq.{l}"), rotary.clone(), &[q, pos])?;
        let k = g.op(format!("rk.{l}"), rotary.clone(), &[k, pos])?;
        written.push(g.op(format!("kw.{l}"), Op::CacheWrite, &[kc, k, slots])?);
        written.push(g.op(format!("vw.{l}"), Op::CacheWrite, &[vc, v, slots])?);
        let attn = Op::Attention(AttentionParams::new(s.heads, s.kv_heads, s.head_dim, false));
        let a = g.op(format!("attn.{l}"), attn, &[q, k_fix, v_fix])?;
        let wo = param(&mut g, format!("o.{l}"), &[s.hidden, q_dim], w_scale)?;
        let o = g.op(format!("o.{l}"), lin.clone(), &[a, wo])?;
        x = g.op(format!("res1.{l}"), Op::Add, &[x, o])?;
        let w = param(&mut g, format!("n2.{l}"), &[s.hidden], 1.0)?;
        let h = g.op(format!("n2.{l}"), norm.clone(), &[x, w])?;
        let wgu = param(&mut g, format!("gu.{l}"), &[2 * s.ffn, s.hidden], w_scale)?;
        let gu = g.op(format!("gu.{l}"), lin.clone(), &[h, wgu])?;
        let act = Op::ActAndMul {
            act: Activation::Silu,
        };
        let a = g.op(format!("swiglu.{l}"), act, &[gu])?;
        let wd = param(
            &mut g,
            format!("down.{l}"),
            &[s.hidden, s.ffn],
            1.0 / (s.ffn as f32).sqrt(),
        )?;
        let d = g.op(format!("down.{l}"), lin.clone(), &[a, wd])?;
        x = g.op(format!("res2.{l}"), Op::Add, &[x, d])?;
    }
    let w = param(&mut g, "norm".into(), &[s.hidden], 1.0)?;
    let h = g.op("norm", norm, &[x, w])?;
    let wl = param(&mut g, "lm_head".into(), &[s.vocab, s.hidden], w_scale)?;
    let logits = g.op("lm_head", lin, &[h, wl])?;
    g.output(logits)?;
    for w in written {
        g.output(w)?;
    }
    Ok(g)
}

/// Runs `steps` decode steps from zeroed caches; returns per-step wall and launch
/// seconds and the logits of the first few steps.
fn decode(
    exec: &mut Executor,
    s: &Shape,
    steps: usize,
) -> Result<(Vec<f64>, Vec<f64>, Vec<Tensor>)> {
    let backend = exec.backend().clone();
    let kv = s.kv_heads * s.head_dim;
    let mut caches = (0..2 * s.layers)
        .map(|_| {
            let b = backend.allocate(DT, s.capacity * kv)?;
            Ok(DeviceTensor {
                buffer: b,
                spec: kpt_core::TensorSpec::new(&[s.capacity, kv], DT),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut keep = vec![false];
    keep.extend(vec![true; 2 * s.layers]);
    let (mut wall, mut launch, mut logits) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..steps {
        let index = |v: usize, dt: DType, shape: &[usize]| -> Result<RunTensor> {
            Ok(RunTensor::Host(Tensor::from_f64(&[v as f64], shape, dt)?))
        };
        let mut inputs = vec![
            index((step * 7919 + 3) % s.vocab, DType::I32, &[1, 1])?,
            index(step, DType::I32, &[1])?,
            index(step % s.capacity, DType::I64, &[1])?,
        ];
        inputs.extend(caches.drain(..).map(RunTensor::Device));
        let t0 = Instant::now();
        let mut out = exec.run_resident(inputs, &keep)?.into_iter();
        let first = out.next().context("logits")?.into_host(backend.as_ref())?;
        wall.push(t0.elapsed().as_secs_f64());
        launch.push(exec.last_launch_seconds());
        for o in out {
            match o {
                RunTensor::Device(d) => caches.push(d),
                RunTensor::Host(_) => anyhow::bail!("a cache came back to the host"),
            }
        }
        if step < 8 {
            logits.push(first);
        }
    }
    Ok((wall, launch, logits))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let backend: Arc<dyn Backend> = Arc::new(CudaBackend::new(0, CudaOptions::default())?);
    let device = backend.device().name.clone();
    // `KPT_KERNEL__DISABLE` (the config's environment layer) takes kernels out for A/B runs.
    let mut registry = KernelRegistry::with_builtin();
    registry.set_disabled(&kpt_core::KptConfig::load_layered(None)?.kernel.disable);
    let mut rows = Vec::new();
    for s in SHAPES
        .iter()
        .filter(|s| kpt_benches::filter_matches(args.filter.as_deref(), s.name))
    {
        let graph = decode_graph(s)?;
        let plan = auto_optimize(
            &graph,
            OptLevel::Conservative,
            &PrecisionPolicy::default(),
            &registry,
            backend.device(),
        )?;
        let nodes = plan.graph.nodes().len();
        let gemv = plan
            .kernels
            .iter()
            .filter(|k| k.kernel == "cuda.linear.gemv")
            .count();
        drop(graph);
        let mut exec = Executor::new(plan, backend.clone())?;
        let mut modes = serde_json::Map::new();
        let mut first_logits: Option<Vec<Tensor>> = None;
        for graphs in [false, true, false, true] {
            exec.set_graphs(graphs);
            let (wall, launch, logits) = decode(&mut exec, s, args.steps)?;
            match &first_logits {
                None => first_logits = Some(logits),
                Some(want) => ensure!(
                    want == &logits,
                    "{}: logits differ with graphs {}",
                    s.name,
                    if graphs { "on" } else { "off" }
                ),
            }
            // The first steps of each round warm up (and capture).
            let (wall, launch) = (&wall[3..], &launch[3..]);
            let key = if graphs { "graphs_on" } else { "graphs_off" };
            let row = json!({
                "wall_ms": median(wall).unwrap_or(f64::NAN) * 1e3,
                "launch_ms": median(launch).unwrap_or(f64::NAN) * 1e3,
                "stats": format!("{:?}", exec.graph_stats()),
            });
            eprintln!("{} {key}: {row}", s.name);
            modes.insert(key.to_string(), row);
        }
        let off = modes["graphs_off"]["wall_ms"].as_f64().unwrap_or(f64::NAN);
        let on = modes["graphs_on"]["wall_ms"].as_f64().unwrap_or(f64::NAN);
        rows.push(json!({
            "shape": s.name,
            "nodes": nodes,
            "gemv_nodes": gemv,
            "steps": args.steps,
            "modes": modes,
            "speedup": off / on,
            "tokens_per_s_off": 1e3 / off,
            "tokens_per_s_on": 1e3 / on,
        }));
    }
    let report = json!({ "device": device, "bench": "graphs", "rows": rows });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text)?;
    }
    Ok(())
}
