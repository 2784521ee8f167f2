//! kpt: make deep-learning models run fast on the hardware you have.
//!
//! This facade re-exports the kpt crates and adds [`Runtime`], which turns one
//! [`KptConfig`] into backends, a kernel registry and optimized, validated plans.
//!
//! ```
//! use kpt::core::graph::{Activation, Graph, Op};
//! use kpt::core::{DType, OptLevel, Tensor};
//!
//! let rt = kpt::Runtime::new(kpt::KptConfig::default())?;
//! let mut g = Graph::new();
//! let x = g.input("x", DType::F32, &[2, 4]);
//! let w = g.param("w", Tensor::from_vec(vec![0.5f32; 12], &[3, 4])?);
//! let y = g.op("fc", Op::Linear { bias: false }, &[x, w])?;
//! let y = g.op("act", Op::Activation { act: Activation::Relu }, &[y])?;
//! g.output(y)?;
//! let plan = rt.optimize(&g, OptLevel::Conservative)?;
//! let mut exec = rt.executor(plan)?;
//! let out = exec.run(&[Tensor::from_vec(vec![1f32; 8], &[2, 4])?])?;
//! assert_eq!(out[0].to_f64_vec(), vec![2.0; 6]);
//! # Ok::<(), kpt::KptError>(())
//! ```

pub mod bench;
pub mod demo;
pub mod demo_model;
pub mod table;

use std::sync::Arc;

pub use kpt_core as core;
pub use kpt_core::{KptConfig, KptError, OptLevel, Result};
pub use kpt_kernels as kernels;
#[cfg(feature = "cuda")]
pub use kpt_nvidia as nvidia;

use kpt_core::backend::{Backend, BackendRegistry};
use kpt_core::config::BackendChoice;
use kpt_core::exec::Executor;
use kpt_core::graph::Graph;
use kpt_core::hardware::{CpuDetector, DeviceKind, HardwareDetector};
use kpt_core::optimize::{auto_optimize, Plan, PrecisionPolicy};
use kpt_kernels::{CpuBackend, CpuTuning, KernelRegistry};

/// A detector for every device kind built into this binary (the one place that lists
/// the backend crates): the CPU, and CUDA with the `cuda` feature.
pub fn detectors() -> Vec<Box<dyn HardwareDetector>> {
    vec![
        Box::new(CpuDetector),
        #[cfg(feature = "cuda")]
        Box::new(kpt_nvidia::CudaDetector),
    ]
}

/// A CUDA backend for every device the config allows; none without a driver. A device
/// that fails to open is logged and skipped (the CPU still runs).
#[cfg(feature = "cuda")]
fn cuda_backends(config: &KptConfig) -> Vec<Arc<dyn Backend>> {
    let nv = &config.nvidia;
    if !nv.enabled || !kpt_nvidia::driver_present() {
        return Vec::new();
    }
    let found = match kpt_nvidia::devices() {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(error = %e, "CUDA devices could not be listed");
            return Vec::new();
        }
    };
    let min = nv.compute_capability().unwrap_or((0, 0));
    let options = kpt_nvidia::CudaOptions {
        allow_tf32: nv.allow_tf32,
        ..Default::default()
    };
    found
        .iter()
        .filter(|d| d.compute_capability >= min)
        .filter_map(|d| match kpt_nvidia::CudaBackend::new(d.index, options) {
            Ok(b) => Some(Arc::new(b) as Arc<dyn Backend>),
            Err(e) => {
                tracing::warn!(device = d.index, error = %e, "CUDA device skipped");
                None
            }
        })
        .collect()
}

/// Backends, kernels and configuration of one process.
#[derive(Debug)]
pub struct Runtime {
    config: KptConfig,
    backends: BackendRegistry,
    kernels: KernelRegistry,
}

impl Runtime {
    /// Validates `config`, detects the hardware and registers every available backend.
    pub fn new(config: KptConfig) -> Result<Self> {
        config.validate()?;
        if let Some(n) = config.hardware.num_threads {
            // The global pool can be built once per process; later runtimes share it.
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build_global();
        }
        let mut backends = BackendRegistry::new();
        let tuning = CpuTuning {
            block_q: config.kernel.attention_block_q,
            block_kv: config.kernel.attention_block_kv,
        };
        backends.register(Arc::new(CpuBackend::with_tuning(tuning)?));
        #[cfg(feature = "cuda")]
        for backend in cuda_backends(&config) {
            backends.register(backend);
        }
        let mut kernels = KernelRegistry::with_builtin();
        kernels.set_disabled(&config.kernel.disable);
        kernels.set_preferred(&config.kernel.prefer);
        Ok(Self {
            config,
            backends,
            kernels,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KptConfig {
        &self.config
    }

    /// The registered backends.
    pub fn backends(&self) -> &BackendRegistry {
        &self.backends
    }

    /// The kernel registry.
    pub fn kernels(&self) -> &KernelRegistry {
        &self.kernels
    }

    /// The backend the config asks for (`auto` = the best one present).
    pub fn backend(&self) -> Result<Arc<dyn Backend>> {
        match self.config.hardware.backend {
            BackendChoice::Auto => self.backends.best(),
            BackendChoice::Cpu => self.backends.by_kind(DeviceKind::Cpu),
            BackendChoice::Cuda => self.backends.by_kind(DeviceKind::Cuda),
            BackendChoice::Rocm => self.backends.by_kind(DeviceKind::Rocm),
            BackendChoice::Tpu => self.backends.by_kind(DeviceKind::Tpu),
        }
    }

    /// Optimizes `graph` at `level` for the configured backend.
    pub fn optimize(&self, graph: &Graph, level: OptLevel) -> Result<Plan> {
        let backend = self.backend()?;
        auto_optimize(
            graph,
            level,
            &PrecisionPolicy::from_config(&self.config),
            &self.kernels,
            backend.device(),
        )
    }

    /// An executor for `plan` on the configured backend.
    pub fn executor(&self, plan: Plan) -> Result<Executor> {
        Executor::new(plan, self.backend()?)
    }
}
