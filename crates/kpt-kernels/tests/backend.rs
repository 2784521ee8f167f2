//! End to end on the CPU backend: graph -> `auto_optimize` (with the built-in kernel
//! registry) -> `Executor` -> `validate_plan` against the f64 reference, at every
//! optimization level; plus the executor's error paths, shape changes between runs,
//! memory accounting and buffer reuse.

use std::sync::Arc;

use kpt_core::backend::{Backend, BufferMut, BufferRef};
use kpt_core::exec::Executor;
use kpt_core::graph::{
    Activation, AttentionParams, Graph, Op, RopeScaling, TensorSpec, ValueSource,
};
use kpt_core::hardware::DeviceKind;
use kpt_core::optimize::{auto_optimize, Plan, PrecisionPolicy};
use kpt_core::validate::{run_reference, validate_plan, ReferenceOps};
use kpt_core::{DType, KptError, OptLevel, Tensor};
use kpt_kernels::{CpuBackend, CpuReference, KernelRegistry};

use kpt_core::rand::SplitMix64 as Rng;

fn backend() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new().expect("CPU backend"))
}

fn optimize(graph: &Graph, level: OptLevel, backend: &Arc<dyn Backend>) -> Plan {
    let registry = KernelRegistry::with_builtin();
    auto_optimize(
        graph,
        level,
        &PrecisionPolicy::default(),
        &registry,
        backend.device(),
    )
    .unwrap_or_else(|e| panic!("auto_optimize at {level}: {e}"))
}

/// The end-to-end error budget (relative to the largest reference magnitude) of a level
/// with the default precision policy.
fn budget(level: OptLevel) -> f64 {
    match level {
        OptLevel::Conservative => 1e-4,
        OptLevel::Balanced => 5e-2,
        OptLevel::Aggressive => 2.5e-1,
    }
}

/// `max |got - want| / max |want|`; NaN where exactly one side is NaN.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.shape(), want.shape(), "shape");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let ref_max = w
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()));
    let mut worst = 0f64;
    for (a, b) in g.iter().zip(&w) {
        if a.is_nan() && b.is_nan() || a == b {
            continue;
        }
        worst = worst.max((a - b).abs());
    }
    worst / ref_max.max(1e-30)
}

/// Optimizes `graph` at every level; validates each plan, runs it again and compares
/// the outputs with the reference of the original graph. Returns the plans.
fn check_all_levels(graph: &Graph, inputs: &[Tensor]) -> Vec<Plan> {
    let backend = backend();
    let want = run_reference(graph, &CpuReference, inputs).expect("reference");
    let mut plans = Vec::new();
    for level in OptLevel::ALL {
        let plan = optimize(graph, level, &backend);
        plans.push(plan.clone());
        let mut exec = Executor::new(plan, backend.clone()).expect("executor");
        let report =
            validate_plan(&mut exec, graph, &CpuReference, inputs, 1.0).expect("validate_plan");
        assert!(report.passed(), "{level}: {report:#?}");
        assert_eq!(report.ops.len(), exec.plan().graph.nodes().len(), "{level}");
        assert_eq!(report.outputs.len(), graph.outputs().len(), "{level}");
        for _ in 0..2 {
            let got = exec.run(inputs).expect("run");
            assert_eq!(got.len(), want.len(), "{level}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let spec = graph.spec(graph.outputs()[i]).unwrap();
                assert_eq!(g.dtype(), spec.dtype, "{level}: output {i}");
                let e = rel_err(g, w);
                assert!(
                    e <= budget(level),
                    "{level}: output {i} error {e:.3e} > {:.1e}",
                    budget(level)
                );
            }
        }
    }
    plans
}

fn kernels(plan: &Plan) -> Vec<&str> {
    plan.kernels.iter().map(|c| c.kernel.as_str()).collect()
}

fn param_dtypes(plan: &Plan, shape: &[usize]) -> Vec<DType> {
    plan.graph
        .values()
        .iter()
        .filter(|v| matches!(v.source, ValueSource::Param(_)) && v.spec.shape == shape)
        .map(|v| v.spec.dtype)
        .collect()
}

fn mlp_graph(rng: &mut Rng) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[3, 16]);
    let w = g.param("fc.weight", tensor(rng, &[24, 16], -0.5, 0.5));
    let b = g.param("fc.bias", tensor(rng, &[24], -0.5, 0.5));
    let h = g.op("fc", Op::Linear { bias: true }, &[x, w, b]).unwrap();
    let y = g
        .op(
            "gelu",
            Op::Activation {
                act: Activation::GeluErf,
            },
            &[h],
        )
        .unwrap();
    g.output(y).unwrap();
    g
}

#[test]
fn linear_bias_gelu_fuses_and_validates_at_every_level() {
    let mut rng = Rng::new(1);
    let g = mlp_graph(&mut rng);
    let x = tensor(&mut rng, &[3, 16], -2.0, 2.0);
    let plans = check_all_levels(&g, &[x]);
    for (plan, want_w) in plans.iter().zip([DType::F32, DType::BF16, DType::I8]) {
        assert_eq!(plan.graph.nodes().len(), 1, "{}", plan.level);
        assert_eq!(
            plan.graph.nodes()[0].op,
            Op::LinearAct {
                bias: true,
                act: Activation::GeluErf
            }
        );
        assert_eq!(kernels(plan), ["cpu.linear_act.fused"], "{}", plan.level);
        assert_eq!(param_dtypes(plan, &[24, 16]), [want_w], "{}", plan.level);
        assert_eq!(
            param_dtypes(plan, &[24]),
            [DType::F32],
            "bias stays f32 at {}",
            plan.level
        );
    }
}

/// LLaMA's projections: q/k/v of one input, o, and the gated (SwiGLU) MLP.
fn projections_graph(rng: &mut Rng) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[1, 5, 16]);
    let mut w = |g: &mut Graph, name: &str, n: usize, k: usize| {
        g.param(name, tensor(rng, &[n, k], -0.4, 0.4))
    };
    let (wq, wk, wv) = (
        w(&mut g, "wq", 16, 16),
        w(&mut g, "wk", 8, 16),
        w(&mut g, "wv", 8, 16),
    );
    let (wg, wu, wd) = (
        w(&mut g, "wg", 24, 16),
        w(&mut g, "wu", 24, 16),
        w(&mut g, "wd", 16, 24),
    );
    let lin = Op::Linear { bias: false };
    let q = g.op("q", lin.clone(), &[x, wq]).unwrap();
    let k = g.op("k", lin.clone(), &[x, wk]).unwrap();
    let v = g.op("v", lin.clone(), &[x, wv]).unwrap();
    let gate = g.op("gate", lin.clone(), &[q, wg]).unwrap();
    let silu = Op::Activation {
        act: Activation::Silu,
    };
    let gate = g.op("act", silu, &[gate]).unwrap();
    let up = g.op("up", lin.clone(), &[q, wu]).unwrap();
    let m = g.op("mul", Op::Mul, &[gate, up]).unwrap();
    let y = g.op("down", lin, &[m, wd]).unwrap();
    for out in [y, k, v] {
        g.output(out).unwrap();
    }
    g
}

#[test]
fn merged_projections_validate_at_every_level() {
    let mut rng = Rng::new(21);
    let g = projections_graph(&mut rng);
    let x = tensor(&mut rng, &[1, 5, 16], -2.0, 2.0);
    for plan in check_all_levels(&g, &[x]) {
        assert_eq!(
            kernels(&plan),
            [
                "cpu.linear.fused",
                "cpu.split",
                "cpu.linear.fused",
                "cpu.act_and_mul",
                "cpu.linear.fused"
            ],
            "{}",
            plan.level
        );
    }
}

#[test]
fn split_along_every_axis_and_dtype() {
    let mut rng = Rng::new(22);
    for (axis, dtype) in [
        (0, DType::F32),
        (1, DType::BF16),
        (2, DType::I64),
        (2, DType::F16),
    ] {
        let shape = [4, 5, 6];
        let sizes = vec![1, shape[axis] - 3, 2];
        let mut g = Graph::new();
        let x = g.input("x", dtype, &shape);
        let parts = g
            .op_multi(
                "split",
                Op::Split {
                    axis,
                    sizes: sizes.clone(),
                },
                &[x],
            )
            .unwrap();
        for p in &parts {
            g.output(*p).unwrap();
        }
        let xt = tensor(&mut rng, &shape, -9.0, 9.0).to_dtype(dtype).unwrap();
        let backend = backend();
        let plan = optimize(&g, OptLevel::Conservative, &backend);
        assert_eq!(kernels(&plan), ["cpu.split"], "{dtype}");
        let mut exec = Executor::new(plan, backend).unwrap();
        let out = exec.run(std::slice::from_ref(&xt)).unwrap();
        // Each part equals the input narrowed to its range along `axis`.
        let mut start = 0;
        for (o, &n) in out.iter().zip(&sizes) {
            let want = xt.narrow(axis, start, n).unwrap();
            assert_eq!(o.shape(), want.shape(), "{dtype} axis {axis}");
            assert_eq!(o.to_f64_vec(), want.to_f64_vec(), "{dtype} axis {axis}");
            start += n;
        }
    }
}

#[test]
fn residual_add_rms_norm_fuses_and_both_outputs_are_right() {
    let mut rng = Rng::new(2);
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[4, 32]);
    let r = g.input("residual", DType::F32, &[4, 32]);
    let nw = g.param("norm.weight", tensor(&mut rng, &[32], 0.5, 1.5));
    let s = g.op("residual_add", Op::Add, &[x, r]).unwrap();
    let y = g.op("norm", Op::RmsNorm { eps: 1e-5 }, &[s, nw]).unwrap();
    g.output(y).unwrap();
    g.output(s).unwrap();

    let xt = tensor(&mut rng, &[4, 32], -3.0, 3.0);
    let rt = tensor(&mut rng, &[4, 32], -3.0, 3.0);
    let inputs = [xt.clone(), rt.clone()];
    let plans = check_all_levels(&g, &inputs);
    let sum: Vec<f32> = xt
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .zip(rt.as_slice::<f32>().unwrap())
        .map(|(a, b)| a + b)
        .collect();
    let want = run_reference(&g, &CpuReference, &inputs).unwrap();
    let backend = backend();
    for plan in plans {
        let fusion = plan
            .reports
            .iter()
            .find(|r| r.pass == "fuse_add_rms_norm")
            .expect("fusion report");
        assert_eq!(fusion.changes.len(), 1, "{:?}", fusion.changes);
        assert!(
            fusion.changes[0].contains("add_rms_norm"),
            "{:?}",
            fusion.changes
        );
        assert!(fusion.changes[0].contains("residual_add") && fusion.changes[0].contains("norm"));
        assert_eq!(plan.graph.nodes().len(), 1);
        assert_eq!(plan.graph.nodes()[0].op, Op::AddRmsNorm { eps: 1e-5 });
        assert_eq!(kernels(&plan), ["cpu.add_rms_norm"]);

        let level = plan.level;
        let mut exec = Executor::new(plan, backend.clone()).unwrap();
        let out = exec.run(&inputs).unwrap();
        assert_eq!(out.len(), 2);
        // Output 0: the normalized sum; output 1: the sum itself, exactly as f32 adds it.
        assert_eq!(out[0].shape(), [4, 32]);
        assert!(
            rel_err(&out[0], &want[0]) < 1e-5,
            "{level}: norm {:e}",
            rel_err(&out[0], &want[0])
        );
        assert_eq!(
            out[1].as_slice::<f32>().unwrap(),
            sum.as_slice(),
            "{level}: sum"
        );
    }
}

/// `x + r -> layer_norm` with the sum also an output, in `dtype`.
fn add_layer_norm_graph(rng: &mut Rng, dtype: DType, rows: usize, dim: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", dtype, &[rows, dim]);
    let r = g.input("residual", dtype, &[rows, dim]);
    let param = |rng: &mut Rng, lo, hi| tensor(rng, &[dim], lo, hi).to_dtype(dtype).unwrap();
    let nw = g.param("norm.weight", param(rng, 0.5, 1.5));
    let nb = g.param("norm.bias", param(rng, -1.0, 1.0));
    let s = g.op("residual_add", Op::Add, &[x, r]).unwrap();
    let y = g
        .op("norm", Op::LayerNorm { eps: 1e-5 }, &[s, nw, nb])
        .unwrap();
    g.output(y).unwrap();
    g.output(s).unwrap();
    g
}

#[test]
fn residual_add_layer_norm_fuses_and_both_outputs_are_right() {
    let mut rng = Rng::new(3);
    let g = add_layer_norm_graph(&mut rng, DType::F32, 4, 33);
    let xt = tensor(&mut rng, &[4, 33], -3.0, 3.0);
    let rt = tensor(&mut rng, &[4, 33], -3.0, 3.0);
    let inputs = [xt.clone(), rt.clone()];
    let plans = check_all_levels(&g, &inputs);
    let sum: Vec<f32> = xt
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .zip(rt.as_slice::<f32>().unwrap())
        .map(|(a, b)| a + b)
        .collect();
    let want = run_reference(&g, &CpuReference, &inputs).unwrap();
    let backend = backend();
    for plan in plans {
        let fusion = plan
            .reports
            .iter()
            .find(|r| r.pass == "fuse_add_layer_norm")
            .expect("fusion report");
        assert_eq!(
            fusion.changes,
            ["residual_add + norm -> add_layer_norm"],
            "{}",
            plan.level
        );
        assert_eq!(plan.graph.nodes().len(), 1);
        assert_eq!(plan.graph.nodes()[0].op, Op::AddLayerNorm { eps: 1e-5 });
        assert_eq!(kernels(&plan), ["cpu.add_layer_norm"]);

        let level = plan.level;
        let mut exec = Executor::new(plan, backend.clone()).unwrap();
        let out = exec.run(&inputs).unwrap();
        assert_eq!(out.len(), 2);
        // Output 0: the normalized sum; output 1: the sum itself, exactly as f32 adds it.
        assert!(
            rel_err(&out[0], &want[0]) < 1e-5,
            "{level}: norm {:e}",
            rel_err(&out[0], &want[0])
        );
        assert_eq!(
            out[1].as_slice::<f32>().unwrap(),
            sum.as_slice(),
            "{level}: sum"
        );
    }
}

#[test]
fn add_layer_norm_validates_in_low_precision() {
    for (dtype, seed) in [(DType::BF16, 4), (DType::F16, 5)] {
        let mut rng = Rng::new(seed);
        for (rows, dim) in [(1, 1), (3, 7), (2, 1024)] {
            let g = add_layer_norm_graph(&mut rng, dtype, rows, dim);
            let inputs: Vec<Tensor> = (0..2)
                .map(|_| {
                    tensor(&mut rng, &[rows, dim], -3.0, 3.0)
                        .to_dtype(dtype)
                        .unwrap()
                })
                .collect();
            let backend = backend();
            let plan = optimize(&g, OptLevel::Conservative, &backend);
            assert_eq!(plan.graph.nodes()[0].op, Op::AddLayerNorm { eps: 1e-5 });
            let mut exec = Executor::new(plan, backend).unwrap();
            let report = validate_plan(&mut exec, &g, &CpuReference, &inputs, 1.0).unwrap();
            assert!(report.passed(), "{dtype} [{rows}, {dim}]: {report:#?}");
        }
    }
}

/// An f32 add + layer norm over two columns whose sum differs by less than f32 keeps:
/// `cpu.add_layer_norm` normalizes the sum it stores (equal columns: zeros), the f64 sum
/// normalizes to +-5e-3. The per-op check accepts the kernel (the norm of its stored
/// sum); the end-to-end check, against the f64 reference of the whole graph, reports
/// the rounding.
#[test]
fn add_layer_norm_is_checked_against_the_sum_it_stored() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[1, 2]);
    let r = g.input("residual", DType::F32, &[1, 2]);
    let nw = g.param(
        "norm.weight",
        Tensor::from_vec(vec![1.0f32; 2], &[2]).unwrap(),
    );
    let nb = g.param("norm.bias", Tensor::zeros(DType::F32, &[2]));
    let s = g.op("residual_add", Op::Add, &[x, r]).unwrap();
    let y = g
        .op("norm", Op::LayerNorm { eps: 1e-12 }, &[s, nw, nb])
        .unwrap();
    g.output(y).unwrap();
    g.output(s).unwrap();
    let row = |v: [f32; 2]| Tensor::from_vec(v.to_vec(), &[1, 2]).unwrap();
    let inputs = [row([1.0, 1.0]), row([0.0, 1e-8])];
    let backend = backend();
    let plan = optimize(&g, OptLevel::Conservative, &backend);
    assert_eq!(kernels(&plan), ["cpu.add_layer_norm"]);
    let mut exec = Executor::new(plan, backend).unwrap();
    let report = validate_plan(&mut exec, &g, &CpuReference, &inputs, 1.0).unwrap();
    // The node's worst output is its sum (f32 rounding, 1e-8), not the norm (0).
    assert!(report.ops[0].error.within, "{report:#?}");
    assert!(report.ops[0].error.max_abs < 1e-7, "{report:#?}");
    assert!(!report.outputs[0].error.within, "{report:#?}");
}

fn attention_graph(rng: &mut Rng) -> Graph {
    let p = AttentionParams {
        mask: true,
        ..AttentionParams::new(4, 2, 16, true)
    };
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[1, 5, 32]);
    let k = g.input("k", DType::F32, &[1, 7, 32]);
    let v = g.input("v", DType::F32, &[1, 7, 32]);
    let mask = g.input("mask", DType::F32, &[5, 7]);
    let wq = g.param("q_proj", tensor(rng, &[64, 32], -0.3, 0.3));
    let q = g
        .op("q_proj", Op::Linear { bias: false }, &[x, wq])
        .unwrap();
    let o = g.op("attn", Op::Attention(p), &[q, k, v, mask]).unwrap();
    g.output(o).unwrap();
    g
}

/// Variable-length attention over sequences of `(queries, keys)`: the packed call equals
/// dense calls on each sequence (checked against the reference of each), at every level.
fn check_varlen(rng: &mut Rng, seqs: &[(usize, usize)], causal: bool) {
    let (h, hk, d) = (4, 2, 8);
    let p = AttentionParams {
        varlen: true,
        ..AttentionParams::new(h, hk, d, causal)
    };
    let (tq, tk): (usize, usize) = (
        seqs.iter().map(|s| s.0).sum(),
        seqs.iter().map(|s| s.1).sum(),
    );
    let cu = |f: fn(&(usize, usize)) -> usize| {
        let mut v = vec![0i32];
        for s in seqs {
            v.push(v.last().unwrap() + f(s) as i32);
        }
        Tensor::from_vec(v, &[seqs.len() + 1]).unwrap()
    };
    let (cu_q, cu_k) = (cu(|s| s.0), cu(|s| s.1));
    let mut g = Graph::new();
    let q = g.input("q", DType::F32, &[1, tq, h * d]);
    let k = g.input("k", DType::F32, &[1, tk, hk * d]);
    let v = g.input("v", DType::F32, &[1, tk, hk * d]);
    let cq = g.input("cu_q", DType::I32, &[seqs.len() + 1]);
    let ck = g.input("cu_k", DType::I32, &[seqs.len() + 1]);
    let o = g.op("attn", Op::Attention(p), &[q, k, v, cq, ck]).unwrap();
    g.output(o).unwrap();
    let (qt, kt, vt) = (
        tensor(rng, &[1, tq, h * d], -2.0, 2.0),
        tensor(rng, &[1, tk, hk * d], -2.0, 2.0),
        tensor(rng, &[1, tk, hk * d], -2.0, 2.0),
    );
    let inputs = [qt.clone(), kt.clone(), vt.clone(), cu_q, cu_k];
    let plans = check_all_levels(&g, &inputs);
    assert_eq!(kernels(&plans[0]), ["cpu.attention.flash"]);
    let got = Executor::new(plans[0].clone(), backend())
        .unwrap()
        .run(&inputs)
        .unwrap()
        .remove(0);
    // Each sequence alone, dense, through the reference.
    let dense = Op::Attention(AttentionParams { varlen: false, ..p });
    let (mut q0, mut k0) = (0, 0);
    for &(sq, sk) in seqs {
        if sq > 0 {
            let want = CpuReference
                .eval(
                    &dense,
                    &[
                        qt.narrow(1, q0, sq).unwrap(),
                        kt.narrow(1, k0, sk).unwrap(),
                        vt.narrow(1, k0, sk).unwrap(),
                    ],
                )
                .unwrap()
                .remove(0);
            let part = got.narrow(1, q0, sq).unwrap().to_f64_vec();
            for (a, b) in part.iter().zip(want.to_f64_vec()) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{seqs:?}: {a} vs {b}"
                );
            }
        }
        (q0, k0) = (q0 + sq, k0 + sk);
    }
}

#[test]
fn varlen_attention_equals_each_sequence_alone() {
    let mut rng = Rng::new(31);
    // Prefill-like (equal lengths), decode-like (1 query, a cache), an empty sequence,
    // and a sequence with queries but no keys (zeros).
    check_varlen(
        &mut rng,
        &[(5, 5), (1, 9), (0, 0), (3, 3), (2, 0), (7, 12)],
        true,
    );
    check_varlen(&mut rng, &[(4, 6), (1, 1), (9, 2)], false);
    check_varlen(&mut rng, &[(70, 70), (33, 65)], true);
}

/// The gradients of a variable-length batch: the CPU kernel (through a plan) equals the
/// reference, with GQA, causal or not, with and without dropout; without dropout both
/// equal each sequence's dense gradients from the reference. Keys of a sequence without
/// queries get zero gradients, as do queries without keys.
#[test]
fn varlen_attention_backward_equals_each_sequence_alone() {
    let mut rng = Rng::new(37);
    let seqs = [(5usize, 5usize), (1, 9), (0, 4), (3, 3), (2, 0), (17, 20)];
    let (h, hk, d) = (4, 2, 8);
    let (tq, tk): (usize, usize) = (
        seqs.iter().map(|s| s.0).sum(),
        seqs.iter().map(|s| s.1).sum(),
    );
    let cu = |f: fn(&(usize, usize)) -> usize| {
        let mut v = vec![0i64];
        for s in &seqs {
            v.push(v.last().unwrap() + f(s) as i64);
        }
        Tensor::from_vec(v, &[seqs.len() + 1]).unwrap()
    };
    let close = |what: &str, a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{what}: {x} vs {y}"
            );
        }
    };
    for (causal, dropout) in [
        (true, None),
        (false, None),
        (
            true,
            Some(kpt_core::graph::AttentionDropout { p: 0.25, seed: 9 }),
        ),
    ] {
        let p = AttentionParams {
            varlen: true,
            dropout,
            ..AttentionParams::new(h, hk, d, causal)
        };
        let (qt, kt, vt) = (
            tensor(&mut rng, &[1, tq, h * d], -2.0, 2.0),
            tensor(&mut rng, &[1, tk, hk * d], -2.0, 2.0),
            tensor(&mut rng, &[1, tk, hk * d], -2.0, 2.0),
        );
        let (cu_q, cu_k) = (cu(|s| s.0), cu(|s| s.1));
        let forward = [
            qt.clone(),
            kt.clone(),
            vt.clone(),
            cu_q.clone(),
            cu_k.clone(),
        ];
        let out = CpuReference
            .eval(&Op::Attention(p), &forward)
            .unwrap()
            .remove(0)
            .to_dtype(DType::F32)
            .unwrap();
        let dout = tensor(&mut rng, &[1, tq, h * d], -2.0, 2.0);
        let inputs = [
            qt.clone(),
            kt.clone(),
            vt.clone(),
            out.clone(),
            dout.clone(),
            cu_q,
            cu_k,
        ];
        let op = Op::AttentionBackward(p);
        let g = one_op_graph(&op, &inputs).unwrap();
        let backend = backend();
        let plan = optimize(&g, OptLevel::Conservative, &backend);
        assert_eq!(kernels(&plan), ["cpu.attention_backward"]);
        let got = Executor::new(plan, backend).unwrap().run(&inputs).unwrap();
        let reference = CpuReference.eval(&op, &inputs).unwrap();
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            close(
                &format!("grad {i}, causal {causal}, dropout {dropout:?}"),
                &a.to_f64_vec(),
                &b.to_f64_vec(),
            );
        }
        if dropout.is_some() {
            continue;
        }
        // Each sequence alone, dense, through the reference.
        let dense = Op::AttentionBackward(AttentionParams { varlen: false, ..p });
        let rows = |t: &Tensor, at: usize, n: usize| t.narrow(1, at, n).unwrap().to_f64_vec();
        let (mut q0, mut k0) = (0, 0);
        for (s, &(sq, sk)) in seqs.iter().enumerate() {
            let want: Vec<Vec<f64>> = if sq > 0 && sk > 0 {
                let one = [
                    qt.narrow(1, q0, sq).unwrap(),
                    kt.narrow(1, k0, sk).unwrap(),
                    vt.narrow(1, k0, sk).unwrap(),
                    out.narrow(1, q0, sq).unwrap(),
                    dout.narrow(1, q0, sq).unwrap(),
                ];
                let grads = CpuReference.eval(&dense, &one).unwrap();
                grads.iter().map(Tensor::to_f64_vec).collect()
            } else {
                vec![
                    vec![0.0; sq * h * d],
                    vec![0.0; sk * hk * d],
                    vec![0.0; sk * hk * d],
                ]
            };
            for (i, (at, n)) in [(q0, sq), (k0, sk), (k0, sk)].into_iter().enumerate() {
                let what = format!("grad {i} of sequence {s}, causal {causal}");
                close(&what, &rows(&reference[i], at, n), &want[i]);
            }
            (q0, k0) = (q0 + sq, k0 + sk);
        }
    }
}

/// A paged cache holding each sequence's keys in shuffled blocks gives the same result as
/// dense attention on each sequence's own keys, at every level.
#[test]
fn paged_attention_equals_dense_attention_per_sequence() {
    let mut rng = Rng::new(41);
    let (h, hk, d, bs, s) = (4usize, 2usize, 8usize, 4usize, 3usize);
    let lens = [9usize, 1, 0, 12];
    let batch = lens.len();
    let max_blocks = 3;
    let num_blocks = 12;
    // Blocks handed out in a scrambled order; unused table entries point at block 0.
    let order = [7usize, 2, 11, 5, 0, 9, 3, 10, 1, 6, 8, 4];
    let mut next = order.iter();
    let mut table = vec![0i64; batch * max_blocks];
    let mut k_cache = tensor(&mut rng, &[num_blocks, bs, hk * d], -2.0, 2.0).to_f64_vec();
    let mut v_cache = tensor(&mut rng, &[num_blocks, bs, hk * d], -2.0, 2.0).to_f64_vec();
    let row = hk * d;
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    for (b, &len) in lens.iter().enumerate() {
        let k = tensor(&mut rng, &[1, len, row], -2.0, 2.0).to_f64_vec();
        let v = tensor(&mut rng, &[1, len, row], -2.0, 2.0).to_f64_vec();
        for blk in 0..len.div_ceil(bs) {
            let id = *next.next().unwrap();
            table[b * max_blocks + blk] = id as i64;
            for slot in 0..bs.min(len - blk * bs) {
                let (src, dst) = ((blk * bs + slot) * row, (id * bs + slot) * row);
                k_cache[dst..dst + row].copy_from_slice(&k[src..src + row]);
                v_cache[dst..dst + row].copy_from_slice(&v[src..src + row]);
            }
        }
        ks.push(k);
        vs.push(v);
    }
    let f32s = |v: &[f64], shape: &[usize]| {
        Tensor::from_vec(v.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape).unwrap()
    };
    let p = AttentionParams {
        paged: true,
        ..AttentionParams::new(h, hk, d, true)
    };
    let mut g = Graph::new();
    let q = g.input("q", DType::F32, &[batch, s, h * d]);
    let kc = g.input("k_cache", DType::F32, &[num_blocks, bs, row]);
    let vc = g.input("v_cache", DType::F32, &[num_blocks, bs, row]);
    let bt = g.input("block_table", DType::I64, &[batch, max_blocks]);
    let sl = g.input("seq_lens", DType::I32, &[batch]);
    let o = g
        .op("attn", Op::Attention(p), &[q, kc, vc, bt, sl])
        .unwrap();
    g.output(o).unwrap();
    let qt = tensor(&mut rng, &[batch, s, h * d], -2.0, 2.0);
    let inputs = [
        qt.clone(),
        f32s(&k_cache, &[num_blocks, bs, row]),
        f32s(&v_cache, &[num_blocks, bs, row]),
        Tensor::from_vec(table.clone(), &[batch, max_blocks]).unwrap(),
        Tensor::from_vec(lens.iter().map(|&l| l as i32).collect::<Vec<_>>(), &[batch]).unwrap(),
    ];
    let plans = check_all_levels(&g, &inputs);
    assert_eq!(kernels(&plans[0]), ["cpu.attention.flash"]);
    let got = Executor::new(plans[0].clone(), backend())
        .unwrap()
        .run(&inputs)
        .unwrap()
        .remove(0);
    let dense = Op::Attention(AttentionParams { paged: false, ..p });
    for (b, &len) in lens.iter().enumerate() {
        let part = got.narrow(0, b, 1).unwrap().to_f64_vec();
        if len == 0 {
            assert!(
                part.iter().all(|&x| x == 0.0),
                "a sequence without keys gives zeros"
            );
            continue;
        }
        let want = CpuReference
            .eval(
                &dense,
                &[
                    qt.narrow(0, b, 1).unwrap(),
                    f32s(&ks[b], &[1, len, row]),
                    f32s(&vs[b], &[1, len, row]),
                ],
            )
            .unwrap()
            .remove(0)
            .to_f64_vec();
        for (a, w) in part.iter().zip(&want) {
            assert!(
                (a - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "sequence {b}: {a} vs {w}"
            );
        }
    }
    // A table entry outside the cache and a length past the table are typed errors.
    let mut bad_table = table.clone();
    bad_table[0] = num_blocks as i64;
    let mut bad = inputs.clone();
    bad[3] = Tensor::from_vec(bad_table, &[batch, max_blocks]).unwrap();
    let err = run_op_on_backend(&Op::Attention(p), &bad).unwrap_err();
    assert!(err.to_string().contains("block_table[0][0]"), "{err}");
    let mut bad = inputs.clone();
    bad[4] = Tensor::from_vec(vec![13i32, 1, 0, 12], &[batch]).unwrap();
    let err = run_op_on_backend(&Op::Attention(p), &bad).unwrap_err();
    assert!(err.to_string().contains("seq_lens[0] = 13"), "{err}");
}

#[test]
fn bad_cu_seqlens_are_typed_errors() {
    let p = AttentionParams {
        varlen: true,
        ..AttentionParams::new(2, 2, 4, true)
    };
    let op = Op::Attention(p);
    let x = Tensor::from_vec(vec![0.5f32; 5 * 8], &[1, 5, 8]).unwrap();
    let cu = |v: Vec<i64>| Tensor::from_vec(v.clone(), &[v.len()]).unwrap();
    for (cq, ck, needle) in [
        (vec![0, 2, 5], vec![0, 3, 4], "ends at 4"),
        (vec![0, 3, 2], vec![0, 2, 5], "decreases at entry 2"),
        (vec![1, 2, 5], vec![0, 2, 5], "must start at 0"),
    ] {
        let inputs = [x.clone(), x.clone(), x.clone(), cu(cq), cu(ck)];
        for result in [
            CpuReference.eval(&op, &inputs).map(|_| ()),
            run_op_on_backend(&op, &inputs),
        ] {
            let err = result.unwrap_err();
            assert!(
                matches!(err, KptError::InvalidArgument(_)) && err.to_string().contains(needle),
                "{err}"
            );
        }
    }
}

/// A graph of one op on inputs shaped like `inputs`, every output of it a graph output.
fn one_op_graph(op: &Op, inputs: &[Tensor]) -> kpt_core::Result<Graph> {
    let mut g = Graph::new();
    let ins: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| g.input(format!("in{i}"), t.dtype(), t.shape()))
        .collect();
    for o in g.op_multi("op", op.clone(), &ins)? {
        g.output(o)?;
    }
    Ok(g)
}

/// Runs one op through the CPU backend's registry kernel.
fn run_op_on_backend(op: &Op, inputs: &[Tensor]) -> kpt_core::Result<()> {
    let g = one_op_graph(op, inputs)?;
    let backend = backend();
    let plan = optimize(&g, OptLevel::Conservative, &backend);
    Executor::new(plan, backend)?.run(inputs).map(|_| ())
}

/// Inputs of [`attention_graph`] for `s` queries and `t` keys; the mask has `-inf`
/// entries (one query row fully masked) and finite biases elsewhere.
fn attention_inputs(rng: &mut Rng, s: usize, t: usize) -> Vec<Tensor> {
    let x = tensor(rng, &[1, s, 32], -1.0, 1.0);
    let k = tensor(rng, &[1, t, 32], -1.0, 1.0);
    let v = tensor(rng, &[1, t, 32], -1.0, 1.0);
    let mut mask: Vec<f32> = (0..s * t).map(|_| rng.uniform(-1.0, 0.0)).collect();
    if s > 1 {
        mask[..t].fill(f32::NEG_INFINITY);
    }
    if s > 2 && t > 1 {
        mask[2 * t + 1] = f32::NEG_INFINITY;
    }
    vec![x, k, v, Tensor::from_vec(mask, &[s, t]).unwrap()]
}

#[test]
fn attention_with_mask_and_gqa_validates_at_every_level() {
    let mut rng = Rng::new(3);
    let g = attention_graph(&mut rng);
    let inputs = attention_inputs(&mut rng, 5, 7);
    let plans = check_all_levels(&g, &inputs);
    for plan in &plans {
        assert_eq!(
            kernels(plan),
            ["cpu.linear.fused", "cpu.attention.flash"],
            "{}",
            plan.level
        );
    }
    // The fully masked first query row is zero in every head.
    let backend = backend();
    let mut exec = Executor::new(plans[0].clone(), backend).unwrap();
    let out = exec.run(&inputs).unwrap();
    let row0 = &out[0].as_slice::<f32>().unwrap()[..64];
    assert!(row0.iter().all(|&x| x == 0.0), "{row0:?}");
    assert!(out[0]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .all(|x| x.is_finite()));
}

#[test]
fn executor_reruns_with_new_sequence_lengths() {
    let mut rng = Rng::new(4);
    let g = attention_graph(&mut rng);
    let backend = backend();
    for level in [OptLevel::Conservative, OptLevel::Balanced] {
        let mut exec = Executor::new(optimize(&g, level, &backend), backend.clone()).unwrap();
        // Grow, shrink to a single decode step, grow past the first size, shrink again.
        for (s, t) in [(5, 7), (9, 12), (1, 13), (70, 70), (3, 3), (5, 7)] {
            let inputs = attention_inputs(&mut rng, s, t);
            let got = exec
                .run(&inputs)
                .unwrap_or_else(|e| panic!("{level} S={s} T={t}: {e}"));
            assert_eq!(got[0].shape(), [1, s, 64]);
            let want = run_reference(&g, &CpuReference, &inputs).unwrap();
            let e = rel_err(&got[0], &want[0]);
            assert!(e <= budget(level), "{level} S={s} T={t}: error {e:.3e}");
            let report = validate_plan(&mut exec, &g, &CpuReference, &inputs, 1.0).unwrap();
            assert!(report.passed(), "{level} S={s} T={t}: {report:#?}");
        }
    }
}

#[test]
fn rotary_validates_at_every_level() {
    let mut rng = Rng::new(5);
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[2, 5, 32]);
    let pos = g.input("positions", DType::I64, &[5]);
    let y = g
        .op(
            "rope",
            Op::Rotary {
                head_dim: 8,
                theta: 10000.0,
                scaling: None,
            },
            &[x, pos],
        )
        .unwrap();
    g.output(y).unwrap();
    let xt = tensor(&mut rng, &[2, 5, 32], -2.0, 2.0);
    let positions = Tensor::from_vec(vec![3i64, 4, 5, 6, 1000], &[5]).unwrap();
    let plans = check_all_levels(&g, &[xt.clone(), positions]);
    assert_eq!(kernels(&plans[0]), ["cpu.rotary"]);
    // Position 0 is the identity; i32 positions are accepted after re-declaration.
    let mut g32 = Graph::new();
    let x = g32.input("x", DType::F32, &[2, 5, 32]);
    let pos = g32.input("positions", DType::I32, &[5]);
    let y = g32
        .op(
            "rope",
            Op::Rotary {
                head_dim: 8,
                theta: 10000.0,
                scaling: None,
            },
            &[x, pos],
        )
        .unwrap();
    g32.output(y).unwrap();
    let backend = backend();
    let mut exec =
        Executor::new(optimize(&g32, OptLevel::Conservative, &backend), backend).unwrap();
    let out = exec
        .run(&[xt.clone(), Tensor::from_vec(vec![0i32; 5], &[5]).unwrap()])
        .unwrap();
    assert!(rel_err(&out[0], &xt) < 1e-6);
}

/// q, k and v projections of one input with rotary on q and k at per-token positions
/// (a decode batch of sequences at different lengths): every level merges the
/// projections and fuses the split with both rotaries into `cpu.split_rotary`, and the
/// plan matches the f64 reference of the unfused graph.
#[test]
fn split_rotary_fuses_and_validates_at_every_level() {
    let mut rng = Rng::new(25);
    let (batch, hidden, head_dim) = (3, 32, 8);
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[batch, 1, hidden]);
    let pos = g.input("positions", DType::I64, &[batch, 1]);
    let rope = Op::Rotary {
        head_dim,
        theta: 10000.0,
        scaling: Some(RopeScaling::Linear { factor: 2.0 }),
    };
    let mut proj = |g: &mut Graph, name: &str, n: usize| {
        let w = g.param(
            format!("attn.{name}.w"),
            tensor(&mut rng, &[n, hidden], -0.3, 0.3),
        );
        g.op(format!("attn.{name}"), Op::Linear { bias: false }, &[x, w])
            .unwrap()
    };
    let q = proj(&mut g, "q", 32);
    let k = proj(&mut g, "k", 16);
    let v = proj(&mut g, "v", 16);
    let q = g.op("attn.q_rope", rope.clone(), &[q, pos]).unwrap();
    let k = g.op("attn.k_rope", rope, &[k, pos]).unwrap();
    for o in [q, k, v] {
        g.output(o).unwrap();
    }
    let xt = tensor(&mut rng, &[batch, 1, hidden], -2.0, 2.0);
    let positions = Tensor::from_vec(vec![7i64, 0, 4000], &[batch, 1]).unwrap();
    let plans = check_all_levels(&g, &[xt, positions]);
    for plan in &plans {
        assert_eq!(
            kernels(plan),
            ["cpu.linear.fused", "cpu.split_rotary"],
            "{}",
            plan.level
        );
    }
}

#[test]
fn scaled_rotary_validates_at_every_level() {
    let mut rng = Rng::new(15);
    let scalings = [
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 64,
        },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        },
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        },
    ];
    for scaling in scalings {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, &[2, 5, 32]);
        let pos = g.input("positions", DType::I64, &[5]);
        let op = Op::Rotary {
            head_dim: 8,
            theta: 10000.0,
            scaling: Some(scaling),
        };
        let y = g.op("rope", op, &[x, pos]).unwrap();
        g.output(y).unwrap();
        let xt = tensor(&mut rng, &[2, 5, 32], -2.0, 2.0);
        let positions = Tensor::from_vec(vec![3i64, 4, 5, 6, 1000], &[5]).unwrap();
        let plans = check_all_levels(&g, &[xt, positions]);
        assert_eq!(kernels(&plans[0]), ["cpu.rotary"], "{scaling:?}");
    }
    // Bad parameters are rejected when the graph is built.
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[1, 2, 8]);
    let pos = g.input("positions", DType::I64, &[2]);
    let bad = Op::Rotary {
        head_dim: 8,
        theta: 10000.0,
        scaling: Some(RopeScaling::Linear { factor: -2.0 }),
    };
    let err = g.op("rope", bad, &[x, pos]).unwrap_err();
    assert!(matches!(err, KptError::RopeScaling(_)), "{err:?}");
}

fn embedding_graph(rng: &mut Rng) -> Graph {
    let mut g = Graph::new();
    let ids = g.input("ids", DType::I64, &[2, 3]);
    let table = g.param("embed", tensor(rng, &[10, 8], -1.0, 1.0));
    let e = g.op("embed", Op::Embedding, &[ids, table]).unwrap();
    g.output(e).unwrap();
    g
}

#[test]
fn embedding_out_of_range_is_a_typed_error() {
    let mut rng = Rng::new(6);
    let g = embedding_graph(&mut rng);
    let good = Tensor::from_vec(vec![0i64, 9, 3, 3, 1, 2], &[2, 3]).unwrap();
    let plans = check_all_levels(&g, std::slice::from_ref(&good));
    assert_eq!(kernels(&plans[0]), ["cpu.embedding"]);

    let backend = backend();
    let mut exec = Executor::new(plans[1].clone(), backend).unwrap();
    for bad_id in [10i64, -1, i64::MAX] {
        let bad = Tensor::from_vec(vec![0i64, 1, bad_id, 3, 4, 5], &[2, 3]).unwrap();
        let err = exec
            .run(std::slice::from_ref(&bad))
            .expect_err("out-of-range id must fail");
        assert!(
            matches!(err, KptError::InvalidArgument(_)),
            "id {bad_id}: {err:?}"
        );
        assert!(
            err.to_string().contains(&bad_id.to_string()),
            "id {bad_id}: {err}"
        );
        let err =
            run_reference(&g, &CpuReference, &[bad]).expect_err("the reference must fail too");
        assert!(matches!(err, KptError::InvalidArgument(_)), "{err:?}");
    }
    // The executor is still usable after the error.
    let out = exec.run(std::slice::from_ref(&good)).unwrap();
    let want = run_reference(&g, &CpuReference, &[good]).unwrap();
    assert_eq!(out[0].to_f64_vec(), want[0].to_f64_vec());
    // i32 ids are a dtype error (the graph declared i64).
    let ids32 = Tensor::from_vec(vec![0i32; 6], &[2, 3]).unwrap();
    assert!(matches!(
        exec.run(&[ids32]),
        Err(KptError::InvalidArgument(_))
    ));
}

/// The rows of a prefill's last tokens out of its `[1, S, D]` activation
/// (`Phase::PrefillLast` in kpt-models), then the final norm on those rows alone.
#[test]
fn embedding_gathers_rows_of_an_activation() {
    let mut rng = Rng::new(8);
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[1, 7, 24]);
    let rows = g.input("rows", DType::I64, &[1, 3]);
    let w = g.param("w", tensor(&mut rng, &[24], 0.5, 1.5));
    let picked = g.op("last_rows", Op::Embedding, &[rows, x]).unwrap();
    let y = g
        .op("norm", Op::RmsNorm { eps: 1e-5 }, &[picked, w])
        .unwrap();
    g.output(y).unwrap();
    let x = tensor(&mut rng, &[1, 7, 24], -1.0, 1.0);
    let rows = Tensor::from_vec(vec![6i64, 0, 3], &[1, 3]).unwrap();
    check_all_levels(&g, &[x.clone(), rows]);
    let out = run_reference(
        &g,
        &CpuReference,
        &[
            x.clone(),
            Tensor::from_vec(vec![7i64, 0, 1], &[1, 3]).unwrap(),
        ],
    );
    assert!(
        matches!(out, Err(KptError::InvalidArgument(_))),
        "row 7 of 7: {out:?}"
    );
}

#[test]
fn quantize_dequantize_round_trips() {
    let mut rng = Rng::new(7);
    for (dtype, max_stored) in [
        (DType::F8E4M3, 448.0f32),
        (DType::F8E5M2, 57344.0),
        (DType::I8, 127.0),
    ] {
        let x = tensor(&mut rng, &[4, 32], -3.0, 3.0);
        let amax = x
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / max_stored;
        let mut g = Graph::new();
        let xi = g.input("x", DType::F32, &[4, 32]);
        let q = g.op("quant", Op::Quantize { dtype, scale }, &[xi]).unwrap();
        let y = g
            .op("dequant", Op::Dequantize { dtype: DType::F32 }, &[q])
            .unwrap();
        g.output(y).unwrap();
        let plans = check_all_levels(&g, std::slice::from_ref(&x));
        assert_eq!(
            kernels(&plans[0]),
            ["cpu.quantize", "cpu.dequantize"],
            "{dtype}"
        );

        let backend = backend();
        let mut exec = Executor::new(plans[0].clone(), backend).unwrap();
        let (out, traced) = exec.run_traced(std::slice::from_ref(&x)).unwrap();
        let stored = traced[q.0].as_ref().expect("quantized value traced");
        assert_eq!(stored.dtype(), dtype);
        assert_eq!(
            stored.scale(),
            scale,
            "{dtype}: the scale travels with the buffer"
        );
        // Round-trip error: at most half a step of the format: relative 2^-4 for e4m3,
        // 2^-3 for e5m2 (plus half the smallest subnormal step), half a step for int8.
        let scale = scale as f64;
        let bound = |x: f64| {
            let b = match dtype {
                DType::F8E4M3 => x.abs() / 16.0 + scale * 2f64.powi(-10),
                DType::F8E5M2 => x.abs() / 8.0 + scale * 2f64.powi(-17),
                _ => scale / 2.0,
            };
            b * (1.0 + 1e-6)
        };
        for (a, b) in out[0].to_f64_vec().iter().zip(x.to_f64_vec()) {
            assert!(
                (a - b).abs() <= bound(b),
                "{dtype}: {b} -> {a} (bound {:e})",
                bound(b)
            );
        }
    }
}

#[test]
fn concat_along_every_axis() {
    let mut rng = Rng::new(8);
    for axis in 0..3 {
        let mut b_shape = [2, 3, 4];
        b_shape[axis] = 5;
        let mut g = Graph::new();
        let a = g.input("a", DType::F32, &[2, 3, 4]);
        let b = g.input("b", DType::F32, &b_shape);
        let c = g.op("cat", Op::Concat { axis }, &[a, b]).unwrap();
        g.output(c).unwrap();
        let at = tensor(&mut rng, &[2, 3, 4], -1.0, 1.0);
        let bt = tensor(&mut rng, &b_shape, -1.0, 1.0);
        let plans = check_all_levels(&g, &[at.clone(), bt.clone()]);
        assert_eq!(kernels(&plans[0]), ["cpu.concat"]);
        let backend = backend();
        let mut exec = Executor::new(plans[0].clone(), backend).unwrap();
        let out = exec.run(&[at.clone(), bt.clone()]).unwrap();
        let mut want_shape = [2, 3, 4];
        want_shape[axis] += 5;
        assert_eq!(out[0].shape(), want_shape);
        // Element by element: out[i] comes from a or b by the index along `axis`.
        let (av, bv, ov) = (at.to_f64_vec(), bt.to_f64_vec(), out[0].to_f64_vec());
        let strides = |s: [usize; 3]| [s[1] * s[2], s[2], 1];
        let (sa, sb, so) = (strides([2, 3, 4]), strides(b_shape), strides(want_shape));
        for i in 0..want_shape[0] {
            for j in 0..want_shape[1] {
                for k in 0..want_shape[2] {
                    let idx = [i, j, k];
                    let got = ov[i * so[0] + j * so[1] + k * so[2]];
                    let na = [2, 3, 4][axis];
                    let want = if idx[axis] < na {
                        av[i * sa[0] + j * sa[1] + k * sa[2]]
                    } else {
                        let mut bi = idx;
                        bi[axis] -= na;
                        bv[bi[0] * sb[0] + bi[1] * sb[1] + bi[2] * sb[2]]
                    };
                    assert_eq!(got, want, "axis {axis} at {idx:?}");
                }
            }
        }
    }
}

#[test]
fn concat_of_a_growing_cache_with_i64() {
    let mut g = Graph::new();
    let a = g.input("cache", DType::I64, &[1, 3]);
    let b = g.input("new", DType::I64, &[1, 1]);
    let c = g.op("append", Op::Concat { axis: 1 }, &[a, b]).unwrap();
    g.output(c).unwrap();
    let backend = backend();
    let mut exec = Executor::new(optimize(&g, OptLevel::Balanced, &backend), backend).unwrap();
    let out = exec
        .run(&[
            Tensor::from_vec(vec![1i64, 2, 3], &[1, 3]).unwrap(),
            Tensor::from_vec(vec![4i64], &[1, 1]).unwrap(),
        ])
        .unwrap();
    assert_eq!(out[0].as_slice::<i64>().unwrap(), [1, 2, 3, 4]);
    let out = exec
        .run(&[
            Tensor::from_vec(vec![1i64, 2, 3, 4], &[1, 4]).unwrap(),
            Tensor::from_vec(vec![5i64], &[1, 1]).unwrap(),
        ])
        .unwrap();
    assert_eq!(out[0].as_slice::<i64>().unwrap(), [1, 2, 3, 4, 5]);
}

#[test]
fn wrong_inputs_are_invalid_arguments() {
    let mut rng = Rng::new(9);
    let g = mlp_graph(&mut rng);
    let backend = backend();
    let mut exec = Executor::new(optimize(&g, OptLevel::Conservative, &backend), backend).unwrap();
    let cases = [
        ("f64 input", vec![Tensor::zeros(DType::F64, &[3, 16])]),
        ("bf16 input", vec![Tensor::zeros(DType::BF16, &[3, 16])]),
        ("i32 input", vec![Tensor::zeros(DType::I32, &[3, 16])]),
        ("rank 3", vec![Tensor::zeros(DType::F32, &[1, 3, 16])]),
        ("rank 1", vec![Tensor::zeros(DType::F32, &[16])]),
        ("no input", vec![]),
        (
            "two inputs",
            vec![
                Tensor::zeros(DType::F32, &[3, 16]),
                Tensor::zeros(DType::F32, &[3, 16]),
            ],
        ),
    ];
    for (what, inputs) in cases {
        match exec.run(&inputs) {
            Err(KptError::InvalidArgument(msg)) => assert!(!msg.is_empty()),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    // Right rank and dtype but the wrong feature size: a shape error naming the node.
    let err = exec
        .run(&[Tensor::zeros(DType::F32, &[3, 15])])
        .unwrap_err();
    assert!(matches!(err, KptError::Shape { .. }), "{err:?}");
    assert!(err.to_string().contains("fc"), "{err}");
    // And the executor still works with a valid input of another row count.
    let x = tensor(&mut rng, &[7, 16], -1.0, 1.0);
    let got = exec.run(std::slice::from_ref(&x)).unwrap();
    let want = run_reference(&g, &CpuReference, &[x]).unwrap();
    assert!(rel_err(&got[0], &want[0]) < 1e-5);
}

#[test]
fn memory_is_released_when_the_executor_is_dropped() {
    let mut rng = Rng::new(10);
    let g = mlp_graph(&mut rng);
    let cpu = Arc::new(CpuBackend::new().unwrap());
    let backend: Arc<dyn Backend> = cpu.clone();
    let before = backend.memory_stats();
    assert_eq!(before.allocated_bytes, 0);
    let mut exec = Executor::new(
        optimize(&g, OptLevel::Conservative, &backend),
        backend.clone(),
    )
    .unwrap();
    let params = backend.memory_stats().allocated_bytes;
    assert_eq!(
        params,
        (24 * 16 + 24) * 4,
        "the parameters are uploaded once"
    );
    exec.run(&[tensor(&mut rng, &[3, 16], -1.0, 1.0)]).unwrap();
    let after_run = backend.memory_stats();
    assert!(after_run.allocated_bytes > params, "{after_run:?}");
    assert!(
        after_run.peak_bytes >= after_run.allocated_bytes + 3 * 16 * 4,
        "the input was live: {after_run:?}"
    );
    // A second run of the same shape allocates nothing new.
    exec.run(&[tensor(&mut rng, &[3, 16], -1.0, 1.0)]).unwrap();
    assert_eq!(
        backend.memory_stats().allocated_bytes,
        after_run.allocated_bytes
    );
    drop(exec);
    let end = cpu.memory_stats();
    assert_eq!(end.allocated_bytes, before.allocated_bytes, "{end:?}");
    assert!(end.peak_bytes >= after_run.allocated_bytes);
}

#[test]
fn the_memory_plan_reuses_buffers_in_a_chain() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[16, 64]);
    let acts = [
        Activation::Relu,
        Activation::Silu,
        Activation::GeluErf,
        Activation::GeluTanh,
        Activation::Silu,
        Activation::Relu,
    ];
    let mut h = x;
    for (i, act) in acts.into_iter().enumerate() {
        h = g
            .op(format!("act{i}"), Op::Activation { act }, &[h])
            .unwrap();
    }
    g.output(h).unwrap();
    let backend = backend();
    let plan = optimize(&g, OptLevel::Balanced, &backend);
    let bytes = 16 * 64 * 4;
    assert_eq!(plan.memory.naive_bytes, 6 * bytes);
    assert!(
        plan.memory.planned_bytes < plan.memory.naive_bytes,
        "{:?}",
        plan.memory
    );
    assert!(plan.memory.num_slots() <= 3, "{:?}", plan.memory);
    let report = plan
        .reports
        .iter()
        .find(|r| r.pass == "memory_plan")
        .expect("memory report");
    assert!(
        report.changes[0].contains("6 intermediate buffers"),
        "{:?}",
        report.changes
    );

    let x = tensor(&mut Rng::new(11), &[16, 64], -3.0, 3.0);
    let mut exec = Executor::new(plan, backend).unwrap();
    let report =
        validate_plan(&mut exec, &g, &CpuReference, std::slice::from_ref(&x), 1.0).unwrap();
    assert!(report.passed(), "{report:#?}");
    let got = exec.run(std::slice::from_ref(&x)).unwrap();
    let want = run_reference(&g, &CpuReference, &[x]).unwrap();
    assert!(rel_err(&got[0], &want[0]) < 1e-5);
}

#[test]
fn execute_rejects_kernels_of_other_backends() {
    let backend = backend();
    let op = Op::Activation {
        act: Activation::Relu,
    };
    let spec = TensorSpec::new(&[2, 3], DType::F32);
    let x = backend
        .upload(&Tensor::from_vec(vec![-1f32, 2.0, -3.0, 4.0, -5.0, 6.0], &[2, 3]).unwrap())
        .unwrap();
    let mut out = backend.allocate(DType::F32, 6).unwrap();
    for kernel in ["cuda.activation", "rocm.activation", "", "reference"] {
        let ins = [BufferRef {
            buffer: &x,
            spec: &spec,
        }];
        let mut outs = [BufferMut {
            buffer: &mut out,
            spec: &spec,
        }];
        let err = backend
            .execute(kernel, &op, &ins, &mut outs)
            .expect_err(kernel);
        assert!(matches!(err, KptError::Backend { .. }), "{kernel}: {err:?}");
        assert!(
            err.to_string().contains("not a CPU kernel"),
            "{kernel}: {err}"
        );
    }
    // The CPU kernels themselves run, fast and reference alike.
    for kernel in ["cpu.activation", "cpu.reference"] {
        let ins = [BufferRef {
            buffer: &x,
            spec: &spec,
        }];
        let mut outs = [BufferMut {
            buffer: &mut out,
            spec: &spec,
        }];
        backend.execute(kernel, &op, &ins, &mut outs).unwrap();
        let y = backend.download(&out, &spec).unwrap();
        assert_eq!(
            y.as_slice::<f32>().unwrap(),
            [0.0, 2.0, 0.0, 4.0, 0.0, 6.0],
            "{kernel}"
        );
    }
    // A wrong input count is an error, not a panic.
    let mut outs = [BufferMut {
        buffer: &mut out,
        spec: &spec,
    }];
    let err = backend
        .execute(
            "cpu.add",
            &Op::Add,
            &[BufferRef {
                buffer: &x,
                spec: &spec,
            }],
            &mut outs,
        )
        .unwrap_err();
    assert!(matches!(err, KptError::Graph(_)), "{err:?}");
}

#[test]
fn a_plan_for_another_backend_is_refused() {
    let mut rng = Rng::new(12);
    let g = mlp_graph(&mut rng);
    let backend = backend();
    let mut plan = optimize(&g, OptLevel::Conservative, &backend);
    plan.kernels[0].backend = DeviceKind::Cuda;
    let err = Executor::new(plan, backend).unwrap_err();
    assert!(matches!(err, KptError::Backend { .. }), "{err:?}");
    assert!(err.to_string().contains("cuda"), "{err}");
}

// Known bugs found while writing these tests: each test states the correct behaviour
// and is ignored until the bug is fixed (run them with `cargo test -- --ignored`).

/// Reruns `graph` after a run that fills its buffers with other values, so a kernel
/// that leaves its output unwritten shows stale data.
fn run_after_dirty_run(graph: &Graph, dirty: &[Tensor], inputs: &[Tensor]) -> Vec<Tensor> {
    let backend = backend();
    let mut exec =
        Executor::new(optimize(graph, OptLevel::Conservative, &backend), backend).unwrap();
    exec.run(dirty).unwrap();
    exec.run(inputs).unwrap()
}

#[test]

fn concat_with_an_empty_operand() {
    for (a_len, b_len) in [(0usize, 2usize), (2, 0)] {
        let mut g = Graph::new();
        let a = g.input("cache", DType::F32, &[1, a_len, 4]);
        let b = g.input("new", DType::F32, &[1, b_len, 4]);
        let c = g.op("append", Op::Concat { axis: 1 }, &[a, b]).unwrap();
        g.output(c).unwrap();
        let dirty = [
            Tensor::from_vec(vec![7f32; 12], &[1, 3, 4]).unwrap(),
            Tensor::from_vec(vec![9f32; 12], &[1, 3, 4]).unwrap(),
        ];
        let inputs = [
            Tensor::from_vec(vec![1f32; a_len * 4], &[1, a_len, 4]).unwrap(),
            Tensor::from_vec(vec![2f32; b_len * 4], &[1, b_len, 4]).unwrap(),
        ];
        let got = run_after_dirty_run(&g, &dirty, &inputs);
        let want = run_reference(&g, &CpuReference, &inputs).unwrap();
        assert_eq!(
            got[0].to_f64_vec(),
            want[0].to_f64_vec(),
            "a {a_len}, b {b_len}"
        );
    }
}

#[test]

fn matmul_with_an_empty_inner_dimension() {
    let mut g = Graph::new();
    let a = g.input("a", DType::F32, &[2, 0]);
    let b = g.param("b", Tensor::zeros(DType::F32, &[0, 3]));
    let c = g.op("mm", Op::MatMul, &[a, b]).unwrap();
    g.output(c).unwrap();
    let backend = backend();
    let mut exec = Executor::new(optimize(&g, OptLevel::Conservative, &backend), backend).unwrap();
    let x = Tensor::zeros(DType::F32, &[2, 0]);
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        exec.run(std::slice::from_ref(&x))
    }))
    .expect("matmul with K = 0 must not panic");
    let want = run_reference(&g, &CpuReference, &[x]).unwrap();
    assert_eq!(got.unwrap()[0].to_f64_vec(), want[0].to_f64_vec());
}

#[test]

fn int8_concat_keeps_values_and_scale() {
    let mut g = Graph::new();
    let a = g.input("a", DType::I8, &[1, 2]);
    let b = g.input("b", DType::I8, &[1, 2]);
    let c = g.op("cat", Op::Concat { axis: 1 }, &[a, b]).unwrap();
    g.output(c).unwrap();
    let at = Tensor::from_vec(vec![3i8, -5], &[1, 2])
        .unwrap()
        .with_scale(0.5);
    let bt = Tensor::from_vec(vec![7i8, 1], &[1, 2])
        .unwrap()
        .with_scale(0.5);
    let backend = backend();
    let mut exec = Executor::new(optimize(&g, OptLevel::Conservative, &backend), backend).unwrap();
    let got = exec.run(&[at, bt]).unwrap();
    assert_eq!(
        got[0].to_f64_vec(),
        [1.5, -2.5, 3.5, 0.5],
        "stored {:?} scale {}",
        got[0].storage(),
        got[0].scale()
    );
}

#[test]

fn tied_embedding_and_output_weights() {
    let mut rng = Rng::new(13);
    let mut g = Graph::new();
    let ids = g.input("ids", DType::I64, &[1, 3]);
    let table = g.param("embed", tensor(&mut rng, &[10, 8], -1.0, 1.0));
    let h = g.op("embed", Op::Embedding, &[ids, table]).unwrap();
    let logits = g
        .op("lm_head", Op::Linear { bias: false }, &[h, table])
        .unwrap();
    g.output(logits).unwrap();
    check_all_levels(&g, &[Tensor::from_vec(vec![1i64, 2, 3], &[1, 3]).unwrap()]);
}

#[test]

fn bf16_graphs_validate() {
    let mut g = Graph::new();
    let a = g.input("a", DType::BF16, &[2, 3, 4]);
    let b = g.input("b", DType::BF16, &[2, 4, 5]);
    let y = g.op("mm", Op::MatMul, &[a, b]).unwrap();
    g.output(y).unwrap();
    let a = tensor(&mut Rng::new(14), &[2, 3, 4], -1.0, 1.0)
        .to_dtype(DType::BF16)
        .unwrap();
    let b = tensor(&mut Rng::new(15), &[2, 4, 5], -1.0, 1.0)
        .to_dtype(DType::BF16)
        .unwrap();
    let backend = backend();
    let mut exec = Executor::new(optimize(&g, OptLevel::Conservative, &backend), backend).unwrap();
    let report = validate_plan(&mut exec, &g, &CpuReference, &[a, b], 1.0).unwrap();
    assert!(report.passed(), "{report:#?}");
}

fn tensor(rng: &mut Rng, shape: &[usize], lo: f32, hi: f32) -> Tensor {
    let v = rng.vec(shape.iter().product(), lo, hi);
    Tensor::from_vec(v, shape).unwrap()
}

/// A plan's launches run on one of the pool's workers (so each kernel's parallel loop
/// starts from a worker), and errors from the launches come back.
#[test]
fn launches_run_on_a_pool_worker() {
    let b = backend();
    let mut on_worker = None;
    b.run_launches(&mut || {
        on_worker = Some(rayon::current_thread_index().is_some());
        Ok(())
    })
    .unwrap();
    assert_eq!(on_worker, Some(true));
    let err = b
        .run_launches(&mut || Err(KptError::InvalidArgument("stop".into())))
        .unwrap_err();
    assert!(err.to_string().contains("stop"), "{err}");
}

/// FP8 e4m3 q, k, v with their per-tensor scales: the plan runs the reference (no CPU
/// FP8 attention kernel) and gives bf16, the attention of the dequantized values.
#[test]
fn fp8_attention_is_attention_of_the_dequantized_inputs() {
    let mut rng = Rng::new(7);
    let p = AttentionParams::new(4, 2, 16, true);
    let op = Op::Attention(p);
    let f64s = |rng: &mut Rng, shape: &[usize]| -> Vec<f64> {
        let n = shape.iter().product();
        rng.vec(n, -3.0, 3.0).into_iter().map(f64::from).collect()
    };
    let fp8 = |v: &[f64], shape: &[usize]| Tensor::from_f64(v, shape, DType::F8E4M3).unwrap();
    let (qs, kvs) = ([2, 5, 64], [2, 9, 32]);
    let inputs = [
        fp8(&f64s(&mut rng, &qs), &qs),
        fp8(&f64s(&mut rng, &kvs), &kvs),
        fp8(&f64s(&mut rng, &kvs), &kvs),
    ];
    assert!(inputs.iter().all(|t| t.scale() != 1.0));
    let dequantized: Vec<Tensor> = inputs
        .iter()
        .map(|t| Tensor::from_f64(&t.to_f64_vec(), t.shape(), DType::F64).unwrap())
        .collect();
    let want = CpuReference.eval(&op, &dequantized).unwrap().remove(0);
    let mut g = Graph::new();
    let ids: Vec<_> = ["q", "k", "v"]
        .iter()
        .zip(&inputs)
        .map(|(name, t)| g.input(*name, DType::F8E4M3, t.shape()))
        .collect();
    let o = g.op("attn", op, &ids).unwrap();
    g.output(o).unwrap();
    let plan = optimize(&g, OptLevel::Balanced, &backend());
    let got = Executor::new(plan, backend())
        .unwrap()
        .run(&inputs)
        .unwrap()
        .remove(0);
    assert_eq!(got.dtype(), DType::BF16);
    for (a, b) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
        assert!((a - b).abs() <= (1.0 + b.abs()) / 128.0, "{a} vs {b}");
    }
}

/// Forward attention giving its log-sum-exp, then the backward taking it: a training
/// step's attention on the CPU backend (GQA, causal, a mask), every output against the
/// f64 reference, at every level.
fn attention_lse_graph(s: usize, t: usize, with_mask: bool) -> Graph {
    let p = AttentionParams {
        lse: true,
        mask: with_mask,
        ..AttentionParams::new(4, 2, 8, true)
    };
    let mut g = Graph::new();
    let q = g.input("q", DType::F32, &[2, s, 32]);
    let k = g.input("k", DType::F32, &[2, t, 16]);
    let v = g.input("v", DType::F32, &[2, t, 16]);
    let dout = g.input("dout", DType::F32, &[2, s, 32]);
    let mut ins = vec![q, k, v];
    let mask = with_mask.then(|| g.input("mask", DType::F32, &[s, t]));
    ins.extend(mask);
    let fwd = g.op_multi("attn", Op::Attention(p), &ins).unwrap();
    let (out, lse) = (fwd[0], fwd[1]);
    let mut bins = vec![q, k, v, out, dout];
    bins.extend(mask);
    bins.push(lse);
    let grads = g
        .op_multi("attn_grad", Op::AttentionBackward(p), &bins)
        .unwrap();
    for o in [out, lse].into_iter().chain(grads) {
        g.output(o).unwrap();
    }
    g
}

#[test]
fn attention_lse_feeds_the_backward_on_the_cpu() {
    let mut rng = Rng::new(11);
    for (s, t, with_mask) in [(5, 7, false), (1, 1, false), (6, 9, true)] {
        let g = attention_lse_graph(s, t, with_mask);
        let mut inputs = vec![
            tensor(&mut rng, &[2, s, 32], -1.0, 1.0),
            tensor(&mut rng, &[2, t, 16], -1.0, 1.0),
            tensor(&mut rng, &[2, t, 16], -1.0, 1.0),
            tensor(&mut rng, &[2, s, 32], -1.0, 1.0),
        ];
        if with_mask {
            inputs.push(tensor(&mut rng, &[s, t], -1.0, 0.0));
        }
        let plans = check_all_levels(&g, &inputs);
        for plan in &plans {
            assert_eq!(
                kernels(plan),
                ["cpu.attention.flash", "cpu.attention_backward"],
                "{}",
                plan.level
            );
        }
    }
    // A fully masked query row: its log-sum-exp is +inf and its gradients are 0.
    let (s, t) = (3, 4);
    let g = attention_lse_graph(s, t, true);
    let mut mask = vec![0f32; s * t];
    mask[t..2 * t].fill(f32::NEG_INFINITY);
    let inputs = vec![
        tensor(&mut rng, &[2, s, 32], -1.0, 1.0),
        tensor(&mut rng, &[2, t, 16], -1.0, 1.0),
        tensor(&mut rng, &[2, t, 16], -1.0, 1.0),
        tensor(&mut rng, &[2, s, 32], -1.0, 1.0),
        Tensor::from_vec(mask, &[s, t]).unwrap(),
    ];
    let want = run_reference(&g, &CpuReference, &inputs).unwrap();
    let backend = backend();
    let plan = optimize(&g, OptLevel::Conservative, &backend);
    let got = Executor::new(plan, backend).unwrap().run(&inputs).unwrap();
    let lse = got[1].as_slice::<f32>().unwrap();
    assert_eq!(got[1].shape(), [2, 4, 3]);
    for (i, &l) in lse.iter().enumerate() {
        assert_eq!(l == f32::INFINITY, i % s == 1, "lse[{i}] = {l}");
    }
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        let e = rel_err(a, b);
        assert!(e <= 1e-5, "output {i}: error {e:.3e}");
    }
    let dq = got[2].as_slice::<f32>().unwrap();
    assert!(dq[32..64].iter().all(|&x| x == 0.0), "{:?}", &dq[32..64]);
}

#[test]
fn attention_lse_of_the_wrong_shape_is_a_typed_error() {
    let p = AttentionParams {
        lse: true,
        ..AttentionParams::new(4, 2, 8, false)
    };
    let mut rng = Rng::new(5);
    let q = tensor(&mut rng, &[1, 3, 32], -1.0, 1.0);
    let kv = tensor(&mut rng, &[1, 4, 16], -1.0, 1.0);
    let bad = tensor(&mut rng, &[1, 3, 4], 0.0, 1.0);
    let err = run_op_on_backend(
        &Op::AttentionBackward(p),
        &[q.clone(), kv.clone(), kv, q.clone(), q, bad],
    )
    .unwrap_err();
    assert!(err.to_string().contains("lse"), "{err}");
}
