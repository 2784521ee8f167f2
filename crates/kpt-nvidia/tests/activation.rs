//! Activation precision on a real GPU: an f32 LLaMA-style decoder optimized for the
//! CUDA backend at the balanced level computes in bf16 (flash attention, bf16 caches)
//! and stays within the balanced budget of the f64 reference, prefill caches feeding
//! decode. Without a CUDA device the test returns after printing one `SKIPPED` line;
//! with `KPT_REQUIRE_GPU=1` a missing device fails it.

use std::io::Write;
use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::graph::{Graph, Op};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::validate::{run_reference, validate_plan};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::{CpuReference, KernelRegistry};
use kpt_nvidia::{CudaBackend, CudaOptions};

/// The backend on device 0, or `None` (after saying so) when there is no GPU.
fn backend() -> Option<Arc<dyn Backend>> {
    let required = std::env::var("KPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let found = kpt_nvidia::devices().map(|d| d.len()).unwrap_or(0);
    if found == 0 {
        assert!(!required, "KPT_REQUIRE_GPU=1 but no CUDA device is visible");
        let _ = writeln!(
            std::io::stderr(),
            "kpt-nvidia activation test SKIPPED: no CUDA device"
        );
        return None;
    }
    let b = CudaBackend::new(0, CudaOptions::default()).expect("CUDA backend on device 0");
    Some(Arc::new(b))
}

// The decoder graph of kpt-kernels' activation test (the same plans on the CPU).
#[allow(dead_code)]
#[path = "../../kpt-kernels/tests/support/decoder.rs"]
mod decoder;
use decoder::{decoder, step_inputs, PROMPT, VOCAB};

fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let m = w.iter().fold(0f64, |m, x| m.max(x.abs()));
    let e = g
        .iter()
        .zip(&w)
        .fold(0f64, |e, (a, b)| e.max((a - b).abs()));
    e / m.max(1e-30)
}

#[test]
fn balanced_plans_run_in_bf16_within_the_budget() {
    let Some(backend) = backend() else { return };
    let registry = KernelRegistry::with_builtin();
    let executor = |graph: &Graph| {
        let plan = auto_optimize(
            graph,
            OptLevel::Balanced,
            &PrecisionPolicy::default(),
            &registry,
            backend.device(),
        )
        .expect("plan");
        for (node, choice) in plan.graph.nodes().iter().zip(&plan.kernels) {
            if matches!(node.op, Op::Attention(_)) {
                assert!(
                    choice.kernel.starts_with("cuda.attention.flash"),
                    "{}: {}",
                    node.name,
                    choice.kernel
                );
                let q = plan.graph.spec(node.inputs[0]).unwrap().dtype;
                assert_eq!(q, DType::BF16, "{}", node.name);
            }
        }
        Executor::new(plan, backend.clone()).expect("executor")
    };
    let (prefill, decode) = (decoder(false), decoder(true));
    let (mut pre, mut dec) = (executor(&prefill), executor(&decode));
    let prompt: Vec<i64> = (0..PROMPT as i64)
        .map(|i| (i * 7 + 3) % VOCAB as i64)
        .collect();
    let pre_in = step_inputs(&prompt, 0, &[]);
    let report = validate_plan(&mut pre, &prefill, &CpuReference, &pre_in, 1.0).unwrap();
    assert!(report.passed(), "prefill: {report:#?}");
    let reference = run_reference(&prefill, &CpuReference, &pre_in).unwrap();
    let caches: Vec<Tensor> = reference[1..]
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let dec_in = step_inputs(&[prompt[0]], PROMPT, &caches);
    let report = validate_plan(&mut dec, &decode, &CpuReference, &dec_in, 1.0).unwrap();
    assert!(report.passed(), "decode: {report:#?}");
    let outs = pre.run(&pre_in).unwrap();
    assert_eq!(outs[0].dtype(), DType::F32);
    assert!(outs[1..].iter().all(|t| t.dtype() == DType::BF16));
    let step = dec
        .run(&step_inputs(&[prompt[0]], PROMPT, &outs[1..]))
        .unwrap();
    let want = run_reference(&decode, &CpuReference, &dec_in).unwrap();
    for (i, (g, w)) in step.iter().zip(&want).enumerate() {
        let e = rel_err(g, w);
        assert!(e <= 5e-2, "decode output {i}: {e:.3e}");
    }
}
