//! `kpt bench`: times single ops through the full stack (registry, backend, executor).

use std::time::Instant;

use kpt_core::graph::{Activation, AttentionParams, Graph, Op, TensorSpec};
use kpt_core::{DType, OptLevel, Result, Tensor};
use serde::Serialize;

use crate::Runtime;

/// One op benchmark case.
#[derive(Debug, Clone)]
pub struct BenchCase {
    /// Readable name.
    pub name: String,
    /// The graph (one op).
    pub graph: Graph,
    /// Its inputs.
    pub inputs: Vec<Tensor>,
    /// Bytes the op must move at least (for GB/s).
    pub bytes: f64,
}

/// Result of one case.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Case name.
    pub name: String,
    /// Kernel that ran.
    pub kernel: String,
    /// Median time in microseconds.
    pub median_us: f64,
    /// Throughput.
    pub gflops: f64,
    /// Memory throughput.
    pub gbps: f64,
}

fn single_op(op: Op, inputs: &[(&str, Tensor, bool)]) -> Result<(Graph, Vec<Tensor>)> {
    let mut g = Graph::new();
    let mut ids = Vec::new();
    let mut run_inputs = Vec::new();
    for (name, t, is_param) in inputs {
        if *is_param {
            ids.push(g.param(*name, t.clone()));
        } else {
            ids.push(g.input(*name, t.dtype(), t.shape()));
            run_inputs.push(t.clone());
        }
    }
    let y = g.op("op", op, &ids)?;
    g.output(y)?;
    Ok((g, run_inputs))
}

/// Deterministic values uniform in `±sqrt(3/fan_in)` (unit-variance outputs).
pub fn random_tensor(shape: &[usize], fan_in: usize, seed: u64) -> Result<Tensor> {
    let mut rng = kpt_core::rand::SplitMix64::new(seed);
    let bound = (3.0 / fan_in.max(1) as f64).sqrt();
    let data: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
        .collect();
    Tensor::from_vec(data, shape)
}

/// The default cases: linear (decode and prefill, per weight dtype), attention, norms.
pub fn default_cases(quick: bool) -> Result<Vec<BenchCase>> {
    let (k, n) = if quick { (512, 512) } else { (4096, 4096) };
    let mut cases = Vec::new();
    for m in [1usize, 64] {
        for wd in [DType::F32, DType::BF16, DType::F8E4M3, DType::I8] {
            let x = random_tensor(&[m, k], 1, 1)?;
            let w = random_tensor(&[n, k], k, 2)?.to_dtype(wd)?;
            let bytes = (n * k * wd.size_in_bytes() + 4 * m * (k + n)) as f64;
            let (graph, inputs) = single_op(
                Op::LinearAct {
                    bias: false,
                    act: Activation::Silu,
                },
                &[("x", x, false), ("w", w, true)],
            )?;
            cases.push(BenchCase {
                name: format!("linear_silu m{m} {k}x{n} w={wd}"),
                graph,
                inputs,
                bytes,
            });
        }
    }
    let (s, h, d) = if quick { (128, 4, 64) } else { (1024, 8, 64) };
    let q = random_tensor(&[1, s, h * d], 1, 3)?;
    let kv = random_tensor(&[1, s, h * d], 1, 4)?;
    let p = AttentionParams::new(h, h, d, true);
    let (graph, inputs) = single_op(
        Op::Attention(p),
        &[("q", q, false), ("k", kv.clone(), false), ("v", kv, false)],
    )?;
    cases.push(BenchCase {
        name: format!("attention causal s{s} h{h} d{d}"),
        graph,
        inputs,
        bytes: (4 * s * h * d * 4) as f64,
    });
    let rows = if quick { 256 } else { 4096 };
    let x = random_tensor(&[rows, k], 1, 5)?;
    let w = Tensor::from_vec(vec![1f32; k], &[k])?;
    let (graph, inputs) = single_op(
        Op::RmsNorm { eps: 1e-5 },
        &[("x", x.clone(), false), ("w", w, true)],
    )?;
    cases.push(BenchCase {
        name: format!("rms_norm {rows}x{k}"),
        graph,
        inputs,
        bytes: (2 * rows * k * 4) as f64,
    });
    let (graph, inputs) = single_op(Op::Softmax, &[("x", x, false)])?;
    cases.push(BenchCase {
        name: format!("softmax {rows}x{k}"),
        graph,
        inputs,
        bytes: (2 * rows * k * 4) as f64,
    });
    Ok(cases)
}

/// Times one case: warm-up, then the median of `iters` runs.
pub fn run_case(rt: &Runtime, case: &BenchCase, iters: usize) -> Result<BenchResult> {
    let plan = rt.optimize(&case.graph, OptLevel::Conservative)?;
    let kernel = plan
        .kernels
        .first()
        .map(|k| k.kernel.clone())
        .unwrap_or_default();
    let specs: Vec<TensorSpec> = case.graph.nodes()[0]
        .inputs
        .iter()
        .map(|&v| case.graph.spec(v).cloned())
        .collect::<Result<_>>()?;
    let flops = case.graph.nodes()[0].op.flops(&specs);
    let mut exec = rt.executor(plan)?;
    exec.run(&case.inputs)?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        exec.run(&case.inputs)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    Ok(BenchResult {
        name: case.name.clone(),
        kernel,
        median_us: median * 1e6,
        gflops: flops / median / 1e9,
        gbps: case.bytes / median / 1e9,
    })
}
