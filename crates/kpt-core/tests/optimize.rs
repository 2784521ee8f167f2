//! The manager's passes on small graphs, with a stand-in kernel selector.

use kpt_core::graph::{Activation, Graph, Op, TensorSpec};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::optimize::{
    auto_optimize, fuse_add_layer_norm, fuse_add_rms_norm, fuse_gated_mlp, fuse_linear_activation,
    fuse_sibling_linears, plan_memory, KernelChoice, KernelSelector, PrecisionPolicy,
};
use kpt_core::{DType, KptError, OptLevel, Result, Tensor};

/// Accepts every op except linear layers whose weights are in `reject`.
struct Selector {
    reject: Vec<DType>,
}

impl KernelSelector for Selector {
    fn select(&self, op: &Op, inputs: &[TensorSpec], device: &DeviceInfo) -> Result<KernelChoice> {
        let is_linear = matches!(op, Op::Linear { .. } | Op::LinearAct { .. });
        if is_linear && self.reject.contains(&inputs[1].dtype) {
            return Err(KptError::NoKernel {
                op: op.to_string(),
                backend: device.name.clone(),
                reasons: vec![],
            });
        }
        Ok(KernelChoice {
            kernel: format!("test.{}", op.kind()),
            backend: device.kind,
            skipped: vec![],
        })
    }
}

fn device() -> DeviceInfo {
    DeviceInfo {
        kind: DeviceKind::Cpu,
        index: 0,
        name: "test cpu".into(),
        memory_bytes: None,
        compute_units: Some(1),
        arch: None,
        features: vec![],
        properties: Default::default(),
    }
}

fn weight(n: usize, k: usize) -> Tensor {
    let data: Vec<f32> = (0..n * k).map(|i| ((i % 7) as f32 - 3.0) / 7.0).collect();
    Tensor::from_vec(data, &[n, k]).unwrap()
}

/// x -> linear -> silu -> linear -> add(x) -> rms_norm, with the sum also an output.
fn block() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[3, 8]);
    let w1 = g.param("w1", weight(16, 8));
    let w2 = g.param("w2", weight(8, 16));
    let nw = g.param("norm", Tensor::from_vec(vec![1f32; 8], &[8]).unwrap());
    let h = g.op("up", Op::Linear { bias: false }, &[x, w1]).unwrap();
    let h = g
        .op(
            "act",
            Op::Activation {
                act: Activation::Silu,
            },
            &[h],
        )
        .unwrap();
    let h = g.op("down", Op::Linear { bias: false }, &[h, w2]).unwrap();
    let s = g.op("residual", Op::Add, &[x, h]).unwrap();
    let y = g.op("norm", Op::RmsNorm { eps: 1e-5 }, &[s, nw]).unwrap();
    g.output(y).unwrap();
    g.output(s).unwrap();
    g
}

#[test]
fn linear_activation_fuses_only_single_consumers() {
    let (g, report) = fuse_linear_activation(&block()).unwrap();
    assert_eq!(
        report.changes,
        vec!["up + act -> linear_act(silu)".to_string()]
    );
    assert_eq!(g.nodes().len(), 4);
    assert!(matches!(
        g.nodes()[0].op,
        Op::LinearAct {
            act: Activation::Silu,
            bias: false
        }
    ));

    // A linear whose output is also read elsewhere must stay unfused.
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[2, 4]);
    let w = g.param("w", weight(4, 4));
    let h = g.op("fc", Op::Linear { bias: false }, &[x, w]).unwrap();
    let a = g
        .op(
            "act",
            Op::Activation {
                act: Activation::Relu,
            },
            &[h],
        )
        .unwrap();
    let y = g.op("sum", Op::Add, &[a, h]).unwrap();
    g.output(y).unwrap();
    let (fused, report) = fuse_linear_activation(&g).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(fused, g);
}

#[test]
fn residual_add_and_norm_fuse_keeping_the_sum() {
    let (g, report) = fuse_add_rms_norm(&block()).unwrap();
    assert_eq!(
        report.changes,
        vec!["residual + norm -> add_rms_norm".to_string()]
    );
    let fused = g.nodes().last().unwrap();
    assert!(matches!(fused.op, Op::AddRmsNorm { .. }));
    assert_eq!(fused.outputs.len(), 2);
    // Graph outputs are (normed, sum), in the original order.
    assert_eq!(g.outputs(), &[fused.outputs[1], fused.outputs[0]]);
}

/// The ops of `g`, in order.
fn ops(g: &Graph) -> Vec<Op> {
    g.nodes().iter().map(|n| n.op.clone()).collect()
}

/// x + r -> layer_norm, with the sum also read by a `Mul` and returned.
fn layer_norm_block() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[3, 8]);
    let r = g.input("r", DType::F32, &[3, 8]);
    let nw = g.param(
        "norm.weight",
        Tensor::from_vec(vec![1f32; 8], &[8]).unwrap(),
    );
    let nb = g.param("norm.bias", Tensor::from_vec(vec![0f32; 8], &[8]).unwrap());
    let s = g.op("residual", Op::Add, &[x, r]).unwrap();
    let y = g
        .op("norm", Op::LayerNorm { eps: 1e-5 }, &[s, nw, nb])
        .unwrap();
    let z = g.op("gate", Op::Mul, &[s, y]).unwrap();
    g.output(z).unwrap();
    g.output(s).unwrap();
    g
}

#[test]
fn residual_add_and_layer_norm_fuse_keeping_the_sum() {
    let (g, report) = fuse_add_layer_norm(&layer_norm_block()).unwrap();
    assert_eq!(
        report.pass, "fuse_add_layer_norm",
        "the pass names itself in its report"
    );
    assert_eq!(
        report.changes,
        vec!["residual + norm -> add_layer_norm".to_string()]
    );
    assert_eq!(g.nodes().len(), 2);
    let fused = &g.nodes()[0];
    assert_eq!(fused.op, Op::AddLayerNorm { eps: 1e-5 });
    assert_eq!(fused.inputs.len(), 4);
    assert_eq!(fused.outputs.len(), 2);
    // The sum (output 0) still feeds the other consumer and stays a graph output.
    let gate = &g.nodes()[1];
    assert_eq!(gate.inputs, [fused.outputs[0], fused.outputs[1]]);
    assert_eq!(g.outputs(), &[gate.outputs[0], fused.outputs[0]]);

    // Each residual pass leaves the other norm alone.
    let (same, report) = fuse_add_rms_norm(&layer_norm_block()).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(ops(&same), ops(&layer_norm_block()));
    let (same, report) = fuse_add_layer_norm(&block()).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(ops(&same), ops(&block()));
}

#[test]
fn add_layer_norm_needs_param_weights_and_same_shapes() {
    // A bias computed by an op could be defined after the add: no fusion.
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[2, 4]);
    let r = g.input("r", DType::F32, &[2, 4]);
    let nw = g.param("w", Tensor::from_vec(vec![1f32; 4], &[4]).unwrap());
    let s = g.op("residual", Op::Add, &[x, r]).unwrap();
    let nb = g
        .op(
            "bias",
            Op::Activation {
                act: Activation::Relu,
            },
            &[nw],
        )
        .unwrap();
    let y = g
        .op("norm", Op::LayerNorm { eps: 1e-5 }, &[s, nw, nb])
        .unwrap();
    g.output(y).unwrap();
    let (same, report) = fuse_add_layer_norm(&g).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(ops(&same), ops(&g));

    // A broadcasting add is not a residual add.
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[2, 4]);
    let nw = g.param("w", Tensor::from_vec(vec![1f32; 4], &[4]).unwrap());
    let nb = g.param("b", Tensor::from_vec(vec![0f32; 4], &[4]).unwrap());
    let s = g.op("shift", Op::Add, &[x, nb]).unwrap();
    let y = g
        .op("norm", Op::LayerNorm { eps: 1e-5 }, &[s, nw, nb])
        .unwrap();
    g.output(y).unwrap();
    let (same, report) = fuse_add_layer_norm(&g).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(ops(&same), ops(&g));
}

#[test]
fn auto_optimize_fuses_add_layer_norm() {
    let sel = Selector { reject: vec![] };
    let plan = auto_optimize(
        &layer_norm_block(),
        OptLevel::Balanced,
        &PrecisionPolicy::default(),
        &sel,
        &device(),
    )
    .unwrap();
    let report = plan
        .reports
        .iter()
        .find(|r| r.pass == "fuse_add_layer_norm")
        .unwrap();
    assert_eq!(report.changes.len(), 1);
    assert_eq!(plan.graph.nodes()[0].op, Op::AddLayerNorm { eps: 1e-5 });
    assert_eq!(plan.kernels[0].kernel, "test.add_layer_norm");
}

#[test]
fn levels_pick_weight_dtypes_and_fall_back_without_kernels() {
    let sel = Selector { reject: vec![] };
    let policy = PrecisionPolicy::default();
    let cpu = device();
    let gpu = DeviceInfo {
        kind: DeviceKind::Cuda,
        arch: Some("sm_90".into()),
        ..device()
    };
    let weights = |level, sel: &Selector, policy: &PrecisionPolicy, dev: &DeviceInfo| {
        let plan = auto_optimize(&block(), level, policy, sel, dev).unwrap();
        plan.graph
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Linear { .. } | Op::LinearAct { .. }))
            .map(|n| plan.graph.spec(n.inputs[1]).unwrap().dtype)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        weights(OptLevel::Conservative, &sel, &policy, &cpu),
        vec![DType::F32; 2]
    );
    assert_eq!(
        weights(OptLevel::Balanced, &sel, &policy, &cpu),
        vec![DType::BF16; 2]
    );
    // Aggressive: int8 weight-only on the CPU, FP8 on a GPU, each the other's fallback.
    assert_eq!(
        weights(OptLevel::Aggressive, &sel, &policy, &cpu),
        vec![DType::I8; 2]
    );
    assert_eq!(
        weights(OptLevel::Aggressive, &sel, &policy, &gpu),
        vec![DType::F8E4M3; 2]
    );
    let no_int8 = PrecisionPolicy {
        allow_int8: false,
        ..policy.clone()
    };
    assert_eq!(
        weights(OptLevel::Aggressive, &sel, &no_int8, &cpu),
        vec![DType::F8E4M3; 2]
    );
    let no_fp8 = PrecisionPolicy {
        allow_fp8: false,
        ..policy.clone()
    };
    assert_eq!(
        weights(OptLevel::Aggressive, &sel, &no_fp8, &gpu),
        vec![DType::I8; 2]
    );
    let picky = Selector {
        reject: vec![DType::F8E4M3, DType::I8],
    };
    assert_eq!(
        weights(OptLevel::Aggressive, &picky, &policy, &cpu),
        vec![DType::BF16; 2]
    );
    let forced = PrecisionPolicy {
        weight_dtype: Some(DType::F16),
        ..policy
    };
    assert_eq!(
        weights(OptLevel::Balanced, &sel, &forced, &cpu),
        vec![DType::F16; 2]
    );
    // A forced dtype leaves the conservative level's f32 weights alone.
    assert_eq!(
        weights(OptLevel::Conservative, &sel, &forced, &cpu),
        vec![DType::F32; 2]
    );
}

#[test]
fn optimization_is_deterministic_and_reports_every_pass() {
    let sel = Selector { reject: vec![] };
    let a = auto_optimize(
        &block(),
        OptLevel::Aggressive,
        &PrecisionPolicy::default(),
        &sel,
        &device(),
    )
    .unwrap();
    let b = auto_optimize(
        &block(),
        OptLevel::Aggressive,
        &PrecisionPolicy::default(),
        &sel,
        &device(),
    )
    .unwrap();
    assert_eq!(a.graph, b.graph);
    assert_eq!(a.reports, b.reports);
    let passes: Vec<&str> = a.reports.iter().map(|r| r.pass.as_str()).collect();
    assert_eq!(
        passes,
        [
            "fuse_gated_mlp",
            "fuse_linear_activation",
            "fuse_sibling_linears",
            "fuse_split_rotary",
            "fuse_add_rms_norm",
            "fuse_add_layer_norm",
            "activation_precision",
            "fuse_rotary_cache_writes",
            "precision",
            "kernel_selection",
            "memory_plan"
        ]
    );
    assert_eq!(a.kernels.len(), a.graph.nodes().len());
}

#[test]
fn selection_errors_propagate() {
    let sel = Selector {
        reject: vec![DType::F32],
    };
    let err = auto_optimize(
        &block(),
        OptLevel::Conservative,
        &PrecisionPolicy::default(),
        &sel,
        &device(),
    )
    .unwrap_err();
    assert!(matches!(err, KptError::NoKernel { .. }), "{err}");
}

#[test]
fn memory_plan_reuses_dead_buffers_but_never_outputs() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[64, 64]);
    let mut h = x;
    for i in 0..6 {
        h = g
            .op(
                format!("act{i}"),
                Op::Activation {
                    act: Activation::Relu,
                },
                &[h],
            )
            .unwrap();
    }
    g.output(h).unwrap();
    let plan = plan_memory(&g);
    assert_eq!(plan.num_slots(), 2, "a chain needs two alternating buffers");
    assert_eq!(plan.naive_bytes, 6 * 64 * 64 * 4);
    assert_eq!(plan.planned_bytes, 2 * 64 * 64 * 4);
    // Outputs keep their slot: nothing produced after them may share it.
    let mut later = Graph::new();
    let x = later.input("x", DType::F32, &[4]);
    let a = later
        .op(
            "a",
            Op::Activation {
                act: Activation::Relu,
            },
            &[x],
        )
        .unwrap();
    let b = later
        .op(
            "b",
            Op::Activation {
                act: Activation::Relu,
            },
            &[a],
        )
        .unwrap();
    let c = later
        .op(
            "c",
            Op::Activation {
                act: Activation::Relu,
            },
            &[b],
        )
        .unwrap();
    later.output(a).unwrap();
    later.output(c).unwrap();
    let p = plan_memory(&later);
    assert_ne!(p.slot_of[a.0], p.slot_of[c.0]);
    assert_ne!(p.slot_of[a.0], p.slot_of[b.0]);
}

/// Attention projections: q, k, v with biases read `x`; `o` reads `y`, and `extra`
/// reads `x` without a bias.
fn projections() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[3, 8]);
    let y = g.input("y", DType::F32, &[3, 8]);
    let bias = |n: usize| Tensor::from_vec((0..n).map(|i| i as f32).collect(), &[n]).unwrap();
    let mut outs = Vec::new();
    for (name, n) in [("q", 8), ("k", 4), ("v", 4)] {
        let w = g.param(format!("attn.w{name}"), weight(n, 8));
        let b = g.param(format!("attn.b{name}"), bias(n));
        outs.push(
            g.op(
                format!("attn.{name}"),
                Op::Linear { bias: true },
                &[x, w, b],
            )
            .unwrap(),
        );
    }
    let wo = g.param("attn.wo", weight(8, 8));
    outs.push(
        g.op("attn.o", Op::Linear { bias: false }, &[y, wo])
            .unwrap(),
    );
    let we = g.param("extra.w", weight(2, 8));
    outs.push(g.op("extra", Op::Linear { bias: false }, &[x, we]).unwrap());
    for o in outs {
        g.output(o).unwrap();
    }
    g
}

#[test]
fn sibling_linears_merge_into_one_linear_and_a_split() {
    let (g, report) = fuse_sibling_linears(&projections()).unwrap();
    assert_eq!(
        report.changes,
        vec!["attn.q+k+v -> linear + split".to_string()]
    );
    let kinds: Vec<String> = g.nodes().iter().map(|n| n.op.kind().to_string()).collect();
    assert_eq!(kinds, ["linear", "split", "linear", "linear"]);
    let merged = &g.nodes()[0];
    assert_eq!(merged.name, "attn.q+k+v");
    let (w, b) = (merged.inputs[1], merged.inputs[2]);
    assert_eq!(g.value(w).name, "attn.wq+wk+wv");
    assert_eq!(g.spec(w).unwrap().shape, [16, 8]);
    let bias: Vec<f64> = g.param_tensor(b).unwrap().to_f64_vec();
    let want: Vec<f64> = [0..8, 0..4, 0..4]
        .into_iter()
        .flatten()
        .map(f64::from)
        .collect();
    assert_eq!(bias, want);
    // Rows 8..12 of the merged weight are k's weight.
    let wm = g.param_tensor(w).unwrap().to_f64_vec();
    assert_eq!(wm[8 * 8..12 * 8], weight(4, 8).to_f64_vec()[..]);
    assert_eq!(
        g.nodes()[1].op,
        Op::Split {
            axis: 1,
            sizes: vec![8, 4, 4]
        }
    );
    // The graph outputs are the split's parts, in the original order.
    assert_eq!(&g.outputs()[..3], &g.nodes()[1].outputs[..]);
    // Nothing left to merge: the pass is idempotent.
    let (again, report) = fuse_sibling_linears(&g).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(again, g);
}

/// LLaMA's MLP: down(silu(gate(x)) * up(x)); `leak` also returns the gate.
fn gated_mlp(leak: bool) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[3, 8]);
    let wg = g.param("mlp.gate.w", weight(16, 8));
    let wu = g.param("mlp.up.w", weight(16, 8));
    let wd = g.param("mlp.down.w", weight(8, 16));
    let gate = g
        .op("mlp.gate", Op::Linear { bias: false }, &[x, wg])
        .unwrap();
    let act = Op::Activation {
        act: Activation::Silu,
    };
    let a = g.op("mlp.act", act, &[gate]).unwrap();
    let up = g
        .op("mlp.up", Op::Linear { bias: false }, &[x, wu])
        .unwrap();
    // The product with the operands swapped: the pass must see both orders.
    let m = g.op("mlp.mul", Op::Mul, &[up, a]).unwrap();
    let y = g
        .op("mlp.down", Op::Linear { bias: false }, &[m, wd])
        .unwrap();
    g.output(y).unwrap();
    if leak {
        g.output(gate).unwrap();
    }
    g
}

#[test]
fn gated_mlp_becomes_one_linear_and_act_and_mul() {
    let (g, report) = fuse_gated_mlp(&gated_mlp(false)).unwrap();
    assert_eq!(
        report.changes,
        vec!["mlp.gate+up + mlp.act + mlp.mul -> linear + act_and_mul(silu)".to_string()]
    );
    let kinds: Vec<String> = g.nodes().iter().map(|n| n.op.to_string()).collect();
    assert_eq!(kinds, ["linear", "act_and_mul(silu)", "linear"]);
    let w = g.nodes()[0].inputs[1];
    assert_eq!(g.spec(w).unwrap().shape, [32, 8]);
    assert_eq!(g.spec(g.nodes()[1].outputs[0]).unwrap().shape, [3, 16]);
    // The gate is a graph output: nothing may be fused.
    let leaky = gated_mlp(true);
    let (g, report) = fuse_gated_mlp(&leaky).unwrap();
    assert!(report.changes.is_empty());
    assert_eq!(ops(&g), ops(&leaky));
}

#[test]
fn auto_optimize_merges_projections_at_every_level() {
    for level in OptLevel::ALL {
        let plan = auto_optimize(
            &gated_mlp(false),
            level,
            &PrecisionPolicy::default(),
            &Selector { reject: vec![] },
            &device(),
        )
        .unwrap();
        let hist = plan.graph.op_histogram();
        assert_eq!(
            hist.get(&kpt_core::graph::OpKind::ActAndMul),
            Some(&1),
            "{level:?}"
        );
        assert_eq!(hist.get(&kpt_core::graph::OpKind::Mul), None, "{level:?}");
    }
}
