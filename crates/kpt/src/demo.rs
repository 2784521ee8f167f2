//! `kpt demo`: a small decoder-only transformer optimized at every level, validated
//! against the f64 reference, and timed on greedy generation with a KV cache.

use std::time::Instant;

use kpt_core::exec::Executor;
use kpt_core::graph::{Graph, OpKind};
use kpt_core::validate::{run_reference, validate_plan, ValidationReport};
use kpt_core::{DType, KptError, OptLevel, Result, Tensor};
use kpt_kernels::CpuReference;
use serde::Serialize;

use crate::demo_model::{build_graph, DemoConfig, Phase};
use crate::Runtime;

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Model sizes.
    pub model: DemoConfig,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens generated after the prompt.
    pub new_tokens: usize,
    /// Levels to run.
    pub levels: Vec<OptLevel>,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            model: DemoConfig::default(),
            prompt_len: 32,
            new_tokens: 32,
            levels: OptLevel::ALL.to_vec(),
        }
    }
}

/// One row of the demo table.
#[derive(Debug, Clone, Serialize)]
pub struct DemoRow {
    /// Optimization level.
    pub level: String,
    /// Dtype of the linear weights after the precision pass.
    pub weights: String,
    /// Nodes before and after optimization.
    pub nodes: (usize, usize),
    /// Weight bytes after optimization.
    pub weight_bytes: usize,
    /// Prompt processing time.
    pub prefill_ms: f64,
    /// Median time of one decode step.
    pub ms_per_token: f64,
    /// Largest per-op error relative to the op's tolerance (<= 1 passes).
    pub worst_op_ratio: f64,
    /// Largest error of the logits, relative to the largest reference logit.
    pub max_rel_error: f64,
    /// Generated tokens equal to the f64 reference's greedy tokens.
    pub tokens_matching: usize,
    /// Whether validation passed.
    pub passed: bool,
}

/// Greedy generation with a plan pair; returns the tokens, prefill time and per-step times.
pub struct Generation {
    /// Generated token ids.
    pub tokens: Vec<i64>,
    /// Prompt time in ms.
    pub prefill_ms: f64,
    /// Each decode step in ms.
    pub step_ms: Vec<f64>,
}

fn argmax_last(logits: &Tensor) -> Result<i64> {
    let v = logits.to_f64_vec();
    let vocab = *logits
        .shape()
        .last()
        .ok_or_else(|| KptError::Graph("logits have no dims".into()))?;
    let last = &v[v.len() - vocab..];
    let (best, _) = last
        .iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        });
    Ok(best as i64)
}

fn step_inputs(ids: &[i64], start: usize, cache: &[Tensor]) -> Result<Vec<Tensor>> {
    let n = ids.len();
    let mut v = vec![
        Tensor::from_vec(ids.to_vec(), &[1, n])?,
        Tensor::from_vec((start..start + n).map(|p| p as i64).collect(), &[n])?,
    ];
    v.extend(cache.iter().cloned());
    Ok(v)
}

/// Runs `prompt` through `prefill`, then `new_tokens` decode steps; `run` executes one graph.
pub fn generate(
    prompt: &[i64],
    new_tokens: usize,
    mut run: impl FnMut(Phase, &[Tensor]) -> Result<Vec<Tensor>>,
) -> Result<Generation> {
    let t0 = Instant::now();
    let mut outs = run(Phase::Prefill, &step_inputs(prompt, 0, &[])?)?;
    let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut tokens = Vec::with_capacity(new_tokens);
    let mut step_ms = Vec::with_capacity(new_tokens);
    let mut next = argmax_last(&outs[0])?;
    for i in 0..new_tokens {
        tokens.push(next);
        if i + 1 == new_tokens {
            break;
        }
        let t = Instant::now();
        outs = run(
            Phase::Decode,
            &step_inputs(&[next], prompt.len() + i, &outs[1..])?,
        )?;
        step_ms.push(t.elapsed().as_secs_f64() * 1e3);
        next = argmax_last(&outs[0])?;
    }
    Ok(Generation {
        tokens,
        prefill_ms,
        step_ms,
    })
}

/// The prompt: deterministic token ids.
pub fn demo_prompt(len: usize, vocab: usize) -> Vec<i64> {
    (0..len).map(|i| ((i * 7919 + 13) % vocab) as i64).collect()
}

/// Runs the demo, calling `progress` with a message after each step.
pub fn run_demo(
    rt: &Runtime,
    opts: &DemoOptions,
    mut progress: impl FnMut(&str),
) -> Result<Vec<DemoRow>> {
    let cfg = &opts.model;
    let prefill = build_graph(cfg, Phase::Prefill, opts.prompt_len)?;
    let decode = build_graph(cfg, Phase::Decode, opts.prompt_len)?;
    let prompt = demo_prompt(opts.prompt_len, cfg.vocab);
    let graph_of = |p: Phase| -> &Graph {
        if p == Phase::Prefill {
            &prefill
        } else {
            &decode
        }
    };
    progress("f64 reference generation");
    let reference = generate(&prompt, opts.new_tokens, |p, ins| {
        run_reference(graph_of(p), &CpuReference, ins)
    })?;
    let mut rows = Vec::new();
    for &level in &opts.levels {
        progress(&format!("{level}: optimizing"));
        let mut pre = rt.executor(rt.optimize(&prefill, level)?)?;
        let mut dec = rt.executor(rt.optimize(&decode, level)?)?;
        progress(&format!("{level}: validating"));
        let pre_inputs = step_inputs(&prompt, 0, &[])?;
        let report_pre = validate_plan(
            &mut pre,
            &prefill,
            &CpuReference,
            &pre_inputs,
            rt.config().precision.tolerance_scale,
        )?;
        let cache = run_reference(&prefill, &CpuReference, &pre_inputs)?
            .iter()
            .skip(1)
            .map(|t| t.to_dtype(DType::F32))
            .collect::<Result<Vec<_>>>()?;
        let dec_inputs = step_inputs(&[prompt[0]], prompt.len(), &cache)?;
        let report_dec = validate_plan(
            &mut dec,
            &decode,
            &CpuReference,
            &dec_inputs,
            rt.config().precision.tolerance_scale,
        )?;
        progress(&format!("{level}: generating"));
        let gen = generate(&prompt, opts.new_tokens, |p, ins| match p {
            Phase::Prefill => pre.run(ins),
            Phase::Decode => dec.run(ins),
        })?;
        let matching = gen
            .tokens
            .iter()
            .zip(&reference.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        rows.push(row(
            level,
            &pre,
            &prefill,
            [&report_pre, &report_dec],
            &gen,
            matching,
        ));
    }
    Ok(rows)
}

fn row(
    level: OptLevel,
    exec: &Executor,
    original: &Graph,
    reports: [&ValidationReport; 2],
    gen: &Generation,
    matching: usize,
) -> DemoRow {
    let graph = &exec.plan().graph;
    let weights = graph
        .nodes()
        .iter()
        .filter(|n| matches!(n.op.kind(), OpKind::Linear | OpKind::LinearAct))
        .filter_map(|n| graph.spec(n.inputs[1]).ok().map(|s| s.dtype))
        .min_by_key(|d| d.size_in_bytes())
        .unwrap_or(DType::F32);
    let worst_op_ratio = reports
        .iter()
        .flat_map(|r| &r.ops)
        .map(|o| o.error.max_abs / (o.tolerance.abs * o.error.ref_max).max(1e-30))
        .fold(0.0, f64::max);
    DemoRow {
        level: level.to_string(),
        weights: weights.to_string(),
        nodes: (original.nodes().len(), graph.nodes().len()),
        weight_bytes: graph.param_bytes(),
        prefill_ms: gen.prefill_ms,
        ms_per_token: kpt_monitor::median(&gen.step_ms).unwrap_or(0.0),
        worst_op_ratio,
        max_rel_error: reports
            .iter()
            .map(|r| r.max_output_rel_error())
            .fold(0.0, f64::max),
        tokens_matching: matching,
        passed: reports.iter().all(|r| r.passed()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_demo_runs_and_validates() {
        let rt = Runtime::new(kpt_core::KptConfig::default()).unwrap();
        let opts = DemoOptions {
            model: DemoConfig {
                vocab: 96,
                dim: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                ffn: 96,
                seed: 3,
            },
            prompt_len: 5,
            new_tokens: 4,
            levels: OptLevel::ALL.to_vec(),
        };
        let rows = run_demo(&rt, &opts, |_| {}).unwrap();
        assert_eq!(rows.len(), 3);
        for r in &rows {
            assert!(r.passed, "{r:?}");
            assert!(r.nodes.1 < r.nodes.0, "fusion removed no node: {r:?}");
        }
        assert_eq!(rows[0].weights, "f32");
        assert_eq!(
            rows[0].tokens_matching, 4,
            "conservative must match the reference"
        );
        assert_eq!(rows[1].weights, "bf16");
        assert_eq!(rows[2].weights, "f8e4m3");
        assert!(
            rows[2].weight_bytes < rows[1].weight_bytes
                && rows[1].weight_bytes < rows[0].weight_bytes
        );
    }
}
