//! The manager's passes on small graphs, with a stand-in kernel selector.

use kpt_core::graph::{Activation, Graph, Op, TensorSpec};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::optimize::{
    auto_optimize, fuse_add_layer_norm, fuse_add_rms_norm, fuse_linear_activation, plan_memory,
    KernelChoice, KernelSelector, PrecisionPolicy,
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
    let weights = |level, sel: &Selector, policy: &PrecisionPolicy| {
        let plan = auto_optimize(&block(), level, policy, sel, &device()).unwrap();
        plan.graph
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Linear { .. } | Op::LinearAct { .. }))
            .map(|n| plan.graph.spec(n.inputs[1]).unwrap().dtype)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        weights(OptLevel::Conservative, &sel, &policy),
        vec![DType::F32; 2]
    );
    assert_eq!(
        weights(OptLevel::Balanced, &sel, &policy),
        vec![DType::BF16; 2]
    );
    assert_eq!(
        weights(OptLevel::Aggressive, &sel, &policy),
        vec![DType::F8E4M3; 2]
    );
    let no_fp8 = PrecisionPolicy {
        allow_fp8: false,
        ..policy.clone()
    };
    assert_eq!(
        weights(OptLevel::Aggressive, &sel, &no_fp8),
        vec![DType::I8; 2]
    );
    let picky = Selector {
        reject: vec![DType::F8E4M3, DType::I8],
    };
    assert_eq!(
        weights(OptLevel::Aggressive, &picky, &policy),
        vec![DType::BF16; 2]
    );
    let forced = PrecisionPolicy {
        weight_dtype: Some(DType::F16),
        ..policy
    };
    assert_eq!(
        weights(OptLevel::Balanced, &sel, &forced),
        vec![DType::F16; 2]
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
            "fuse_linear_activation",
            "fuse_add_rms_norm",
            "fuse_add_layer_norm",
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
