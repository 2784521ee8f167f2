//! Whole plans on a real AMD GPU: a two-layer LLaMA-style decoder (kpt-kernels' shared
//! test graph) optimized for the ROCm device at the balanced level (bf16 activations and
//! caches) runs on `RocmBackend` through the executor, prefill caches feeding decode, and
//! stays within the balanced budget of the f64 reference. Every node runs the kernel the
//! registry chose for the device: `amd.*` kernels where the processor has them, the host
//! reference elsewhere. Without a device the test returns after printing one `SKIPPED`
//! line; with `KPT_REQUIRE_ROCM=1` a missing device fails it. It has not run on an AMD
//! GPU.

use std::io::Write;
use std::sync::Arc;

use kpt_amd::{AmdError, RocmBackend, RocmOptions};
use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::graph::Graph;
use kpt_core::hardware::DeviceKind;
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::OptLevel;
use kpt_kernels::KernelRegistry;

/// The backend on device 0, or `None` (after checking why and saying so).
fn backend() -> Option<Arc<dyn Backend>> {
    let required = std::env::var("KPT_REQUIRE_ROCM").is_ok_and(|v| v == "1");
    match RocmBackend::new(0, RocmOptions::default()) {
        Ok(b) => Some(Arc::new(b)),
        Err(e) => {
            assert!(
                matches!(e, AmdError::NoRuntime { .. } | AmdError::NoDevice { .. }),
                "{e}"
            );
            assert!(!required, "KPT_REQUIRE_ROCM=1 but no ROCm device: {e}");
            let _ = writeln!(std::io::stderr(), "kpt-amd plan test SKIPPED: {e}");
            None
        }
    }
}

#[allow(dead_code)]
#[path = "../../kpt-kernels/tests/support/decoder.rs"]
mod decoder;
use decoder::{check_balanced_bf16, decoder};

#[test]
fn balanced_plans_run_on_the_device_within_the_budget() {
    let Some(backend) = backend() else { return };
    assert_eq!(backend.kind(), DeviceKind::Rocm);
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
        for choice in &plan.kernels {
            assert!(
                choice.kernel.starts_with("amd.") || choice.kernel.starts_with("cpu."),
                "{}",
                choice.kernel
            );
        }
        Executor::new(plan, backend.clone()).expect("executor")
    };
    let (prefill, decode) = (decoder(false), decoder(true));
    let (mut pre, mut dec) = (executor(&prefill), executor(&decode));
    check_balanced_bf16((&prefill, &decode), &mut pre, &mut dec);
}
