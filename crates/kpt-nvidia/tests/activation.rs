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
use kpt_core::{DType, OptLevel};
use kpt_kernels::KernelRegistry;
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
use decoder::{check_balanced_bf16, decoder};

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
    check_balanced_bf16((&prefill, &decode), &mut pre, &mut dec);
}
