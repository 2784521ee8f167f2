//! Activation precision with the built-in kernel registry: a graph built in f32 and
//! optimized for an H100 (a recorded device description, no GPU needed) computes in
//! bf16 at the balanced and aggressive levels and gets the bf16 kernels (FlashAttention
//! on Hopper); the same converted graphs, given CPU kernels, run on the CPU backend
//! within the balanced budget of the f64 reference, prefill caches feeding decode.

use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::graph::{Graph, Op};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::optimize::{auto_optimize, plan_memory, select_kernels, Plan, PrecisionPolicy};
use kpt_core::{DType, OptLevel};
use kpt_kernels::{CpuBackend, KernelRegistry};

/// An H100 SXM as `CudaBackend` describes it (sm_90, cuBLASLt present).
fn h100() -> DeviceInfo {
    DeviceInfo {
        kind: DeviceKind::Cuda,
        index: 0,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_bytes: Some(85_045_870_592),
        compute_units: Some(132),
        arch: Some("sm_90".into()),
        features: vec!["cublaslt".into()],
        properties: Default::default(),
    }
}

// The decoder graph is shared with kpt-nvidia's GPU test of the same plans.
#[allow(dead_code)]
#[path = "support/decoder.rs"]
mod decoder;
use decoder::{check_balanced_bf16, decoder};

fn optimize(graph: &Graph, level: OptLevel, device: &DeviceInfo) -> Plan {
    auto_optimize(
        graph,
        level,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        device,
    )
    .unwrap_or_else(|e| panic!("auto_optimize at {level}: {e}"))
}

/// The kernel of each node whose op is of `kind`.
fn kernels_of(plan: &Plan, kind: &str) -> Vec<String> {
    plan.graph
        .nodes()
        .iter()
        .zip(&plan.kernels)
        .filter(|(n, _)| n.op.kind().name() == kind)
        .map(|(_, k)| k.kernel.clone())
        .collect()
}

fn input_dtypes(g: &Graph) -> Vec<DType> {
    g.inputs()
        .iter()
        .map(|&i| g.spec(i).unwrap().dtype)
        .collect()
}

fn output_dtypes(g: &Graph) -> Vec<DType> {
    g.outputs()
        .iter()
        .map(|&o| g.spec(o).unwrap().dtype)
        .collect()
}

#[test]
fn h100_balanced_plans_compute_in_bf16_with_flash_attention() {
    for decode in [false, true] {
        let graph = decoder(decode);
        let plan = optimize(&graph, OptLevel::Balanced, &h100());
        let attn = kernels_of(&plan, "attention");
        assert_eq!(
            attn,
            vec!["cuda.attention.flash_sm90"; 2],
            "decode {decode}"
        );
        for kernel in kernels_of(&plan, "rms_norm")
            .iter()
            .chain(&kernels_of(&plan, "add_rms_norm"))
        {
            assert!(kernel.starts_with("triton."), "{kernel}");
        }
        for node in plan.graph.nodes() {
            let out = plan.graph.spec(node.outputs[0]).unwrap().dtype;
            let cast_back = node.name == "lm_head" && matches!(node.op, Op::Cast { .. });
            if matches!(
                node.op.kind().name(),
                "attention" | "rms_norm" | "add_rms_norm"
            ) {
                assert_eq!(out, DType::BF16, "{}", node.name);
            }
            if matches!(node.op, Op::Linear { .. }) {
                assert_eq!(out, DType::BF16, "{}", node.name);
                let w = plan.graph.spec(node.inputs[1]).unwrap().dtype;
                assert_eq!(w, DType::BF16, "{} weight", node.name);
            }
            assert!(
                !matches!(node.op, Op::Cast { .. }) || cast_back,
                "only the logits are cast: {}",
                node.name
            );
        }
        // Logits as declared; the caches in bf16, taken by decode as they come.
        let mut want = vec![DType::F32];
        want.extend([DType::BF16; 4]);
        assert_eq!(output_dtypes(&plan.graph), want);
        let mut want_in = vec![DType::I64; 2];
        if decode {
            want_in.extend([DType::BF16; 4]);
        }
        assert_eq!(input_dtypes(&plan.graph), want_in);
        let report = plan
            .reports
            .iter()
            .find(|r| r.pass == "activation_precision")
            .expect("activation pass report");
        assert!(report.changes.iter().any(|c| c.contains("param embed")));
    }
}

#[test]
fn h100_other_levels() {
    let graph = decoder(false);
    // Conservative keeps the graph's f32: the general kernel.
    let plan = optimize(&graph, OptLevel::Conservative, &h100());
    assert_eq!(kernels_of(&plan, "attention"), vec!["cuda.attention"; 2]);
    assert!(output_dtypes(&plan.graph).iter().all(|&d| d == DType::F32));
    // Aggressive: FP8 weights under bf16 activations.
    let plan = optimize(&graph, OptLevel::Aggressive, &h100());
    assert_eq!(
        kernels_of(&plan, "attention"),
        vec!["cuda.attention.flash_sm90"; 2]
    );
    let weights: Vec<DType> = plan
        .graph
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::Linear { .. }) && n.name != "lm_head")
        .map(|n| plan.graph.spec(n.inputs[1]).unwrap().dtype)
        .collect();
    assert!(!weights.is_empty());
    assert!(weights.iter().all(|&d| d == DType::F8E4M3), "{weights:?}");
    // The config's override keeps f32 on the GPU.
    let keep = PrecisionPolicy {
        activation_dtype: Some(DType::F32),
        ..PrecisionPolicy::default()
    };
    let plan = auto_optimize(
        &graph,
        OptLevel::Balanced,
        &keep,
        &KernelRegistry::with_builtin(),
        &h100(),
    )
    .unwrap();
    assert_eq!(kernels_of(&plan, "attention"), vec!["cuda.attention"; 2]);
}

#[test]
fn cpu_plans_keep_f32_activations() {
    let backend = CpuBackend::new().unwrap();
    for level in OptLevel::ALL {
        let plan = optimize(&decoder(true), level, backend.device());
        assert!(input_dtypes(&plan.graph)[2..]
            .iter()
            .all(|&d| d == DType::F32));
        assert!(output_dtypes(&plan.graph).iter().all(|&d| d == DType::F32));
        let report = plan
            .reports
            .iter()
            .find(|r| r.pass == "activation_precision")
            .unwrap();
        assert!(report.changes.is_empty(), "{level}: {report:?}");
    }
}

/// `plan` with kernels chosen again for `backend` (the graph as optimized elsewhere).
fn on_cpu(plan: Plan, backend: &Arc<dyn Backend>) -> Executor {
    let registry = KernelRegistry::with_builtin();
    let (kernels, _) = select_kernels(&plan.graph, &registry, backend.device()).unwrap();
    let memory = plan_memory(&plan.graph);
    let plan = Plan {
        kernels,
        memory,
        ..plan
    };
    Executor::new(plan, backend.clone()).unwrap()
}

#[test]
fn h100_balanced_graphs_run_within_the_balanced_budget() {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let (prefill, decode) = (decoder(false), decoder(true));
    let mut pre = on_cpu(optimize(&prefill, OptLevel::Balanced, &h100()), &backend);
    let mut dec = on_cpu(optimize(&decode, OptLevel::Balanced, &h100()), &backend);
    check_balanced_bf16((&prefill, &decode), &mut pre, &mut dec);
}
