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
pub mod model;
pub mod table;

use std::sync::Arc;

#[cfg(feature = "rocm")]
pub use kpt_amd as amd;
pub use kpt_core as core;
pub use kpt_core::{KptConfig, KptError, OptLevel, Result};
pub use kpt_kernels as kernels;
pub use kpt_models as models;
pub use kpt_monitor as monitor;
#[cfg(feature = "cuda")]
pub use kpt_nvidia as nvidia;
#[cfg(feature = "tpu")]
pub use kpt_tpu as tpu;

use kpt_core::backend::{Backend, BackendRegistry};
use kpt_core::config::BackendChoice;
use kpt_core::exec::Executor;
use kpt_core::graph::Graph;
use kpt_core::hardware::{CpuDetector, DeviceKind, HardwareDetector};
use kpt_core::optimize::{auto_optimize, Plan, PrecisionPolicy};
use kpt_kernels::{CpuBackend, CpuTuning, KernelRegistry};

/// A detector for every device kind built into this binary (the one place that lists
/// the backend crates): the CPU, CUDA with the `cuda` feature, ROCm with the `rocm`
/// feature, PJRT devices (XLA) with the `tpu` feature.
pub fn detectors() -> Vec<Box<dyn HardwareDetector>> {
    vec![
        Box::new(CpuDetector),
        #[cfg(feature = "cuda")]
        Box::new(kpt_nvidia::CudaDetector),
        #[cfg(feature = "rocm")]
        Box::new(kpt_amd::RocmDetector),
        #[cfg(feature = "tpu")]
        Box::new(kpt_tpu::PjrtDetector),
    ]
}

/// A CUDA backend for every device the config allows, or why there is none (no driver,
/// disabled, no device, below `nvidia.min_compute_capability`, failed to open). A device
/// that fails to open while others open is logged and skipped.
#[cfg(feature = "cuda")]
fn cuda_backends(config: &KptConfig) -> std::result::Result<Vec<Arc<dyn Backend>>, String> {
    let nv = &config.nvidia;
    if !nv.enabled {
        return Err(
            "the CUDA backend is disabled in the configuration (nvidia.enabled = false)".into(),
        );
    }
    if !kpt_nvidia::driver_present() {
        return Err(
            "no NVIDIA driver: libcuda could not be loaded (install the NVIDIA driver, or run on a machine with an NVIDIA GPU)"
                .into(),
        );
    }
    let found = kpt_nvidia::devices().map_err(|e| {
        tracing::warn!(error = %e, "CUDA devices could not be listed");
        format!("CUDA devices could not be listed: {e}")
    })?;
    if found.is_empty() {
        return Err(
            "the NVIDIA driver is loaded but sees no CUDA device (check `nvidia-smi` and CUDA_VISIBLE_DEVICES)"
                .into(),
        );
    }
    let min = nv.compute_capability().unwrap_or((0, 0));
    let options = kpt_nvidia::CudaOptions {
        allow_tf32: nv.allow_tf32,
        gemm: (&config.kernel).into(),
        ..Default::default()
    };
    let mut opened = Vec::new();
    let mut skipped = Vec::new();
    for d in &found {
        if d.compute_capability < min {
            let (major, minor) = d.compute_capability;
            skipped.push(format!(
                "cuda:{} ({}) has compute capability {major}.{minor}, below nvidia.min_compute_capability = {}",
                d.index, d.name, nv.min_compute_capability
            ));
            continue;
        }
        match kpt_nvidia::CudaBackend::new(d.index, options.clone()) {
            Ok(b) => opened.push(Arc::new(b) as Arc<dyn Backend>),
            Err(e) => {
                tracing::warn!(device = d.index, error = %e, "CUDA device skipped");
                skipped.push(format!("cuda:{} ({}) failed to open: {e}", d.index, d.name));
            }
        }
    }
    if opened.is_empty() {
        return Err(format!("no CUDA device is usable: {}", skipped.join("; ")));
    }
    Ok(opened)
}

/// A ROCm backend for every AMD device the config allows, or why there is none (no HIP
/// runtime, disabled, no device, failed to open). A device that fails to open while
/// others open is logged and skipped.
#[cfg(feature = "rocm")]
fn rocm_backends(config: &KptConfig) -> std::result::Result<Vec<Arc<dyn Backend>>, String> {
    if !config.amd.enabled {
        return Err(
            "the ROCm backend is disabled in the configuration (amd.enabled = false)".into(),
        );
    }
    let found = kpt_amd::devices().map_err(|e| {
        tracing::debug!(error = %e, "ROCm devices could not be listed");
        e.to_string()
    })?;
    if found.is_empty() {
        return Err(
            "the HIP runtime is loaded but sees no AMD GPU (check `rocminfo`, /dev/kfd and \
             HIP_VISIBLE_DEVICES)"
                .into(),
        );
    }
    let mut opened = Vec::new();
    let mut skipped = Vec::new();
    for d in &found {
        if let Some(want) = config.amd.gfx_arch.as_deref() {
            if d.arch.processor() != want {
                skipped.push(format!(
                    "rocm:{} ({}) is {}, not amd.gfx_arch = {want}",
                    d.index,
                    d.properties.name,
                    d.arch.processor()
                ));
                continue;
            }
        }
        let options = kpt_amd::RocmOptions {
            hipblaslt: config.amd.use_hipblaslt,
            ..kpt_amd::RocmOptions::default()
        };
        match kpt_amd::RocmBackend::new(d.index, options) {
            Ok(b) => opened.push(Arc::new(b) as Arc<dyn Backend>),
            Err(e) => {
                tracing::warn!(device = d.index, error = %e, "ROCm device skipped");
                skipped.push(format!(
                    "rocm:{} ({}) failed to open: {e}",
                    d.index, d.properties.name
                ));
            }
        }
    }
    if opened.is_empty() {
        return Err(format!("no ROCm device is usable: {}", skipped.join("; ")));
    }
    Ok(opened)
}

/// Without the `rocm` feature there is no ROCm backend; the error says how to get one.
#[cfg(not(feature = "rocm"))]
fn rocm_backends(_config: &KptConfig) -> std::result::Result<Vec<Arc<dyn Backend>>, String> {
    Err(
        "this kpt binary was built without the `rocm` cargo feature (rebuild with `cargo build --release -p kpt --features rocm`)"
            .into(),
    )
}

/// Backends, kernels and configuration of one process.
#[derive(Debug)]
pub struct Runtime {
    config: KptConfig,
    backends: BackendRegistry,
    kernels: KernelRegistry,
    /// Why no backend of a kind was registered, for the error of [`Runtime::backend`].
    missing: Vec<(DeviceKind, String)>,
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
        let mut missing = Vec::new();
        match rocm_backends(&config) {
            Ok(found) => {
                for backend in found {
                    backends.register(backend);
                }
            }
            Err(why) => missing.push((DeviceKind::Rocm, why)),
        }
        #[cfg(feature = "tpu")]
        {
            let requested = config.hardware.backend == BackendChoice::Tpu;
            match kpt_tpu::backends(&config.tpu, requested) {
                Ok(found) => {
                    for backend in found {
                        backends.register(backend);
                    }
                }
                Err(why) => missing.push((DeviceKind::Tpu, why)),
            }
        }
        #[cfg(not(feature = "tpu"))]
        missing.push((
            DeviceKind::Tpu,
            "this kpt binary was built without the `tpu` cargo feature (rebuild with `cargo build --release -p kpt --features tpu`)"
                .to_string(),
        ));
        #[cfg(feature = "cuda")]
        match cuda_backends(&config) {
            Ok(found) => {
                for backend in found {
                    backends.register(backend);
                }
            }
            Err(why) => missing.push((DeviceKind::Cuda, why)),
        }
        #[cfg(not(feature = "cuda"))]
        missing.push((
            DeviceKind::Cuda,
            "this kpt binary was built without the `cuda` cargo feature (rebuild with `cargo build --release -p kpt --features cuda`)"
                .to_string(),
        ));
        let mut kernels = KernelRegistry::with_builtin();
        kernels.set_disabled(&config.kernel.disable);
        kernels.set_preferred(&config.kernel.prefer);
        Ok(Self {
            config,
            backends,
            kernels,
            missing,
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
    ///
    /// A kind that is not present is a [`KptError::Backend`] that says why (no driver,
    /// the binary built without its feature, disabled in the config, ...) and which
    /// devices are present instead.
    pub fn backend(&self) -> Result<Arc<dyn Backend>> {
        let kind = match self.config.hardware.backend {
            BackendChoice::Auto => return self.backends.best(),
            BackendChoice::Cpu => DeviceKind::Cpu,
            BackendChoice::Cuda => DeviceKind::Cuda,
            BackendChoice::Rocm => DeviceKind::Rocm,
            BackendChoice::Tpu => DeviceKind::Tpu,
        };
        self.backends
            .by_kind(kind)
            .map_err(|_| self.missing_backend(kind))
    }

    /// The error for a device kind that has no registered backend.
    fn missing_backend(&self, kind: DeviceKind) -> KptError {
        let why = self
            .missing
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or("no backend of this kind was registered", |(_, why)| {
                why.as_str()
            });
        let present: Vec<String> = self
            .backends
            .all()
            .iter()
            .map(|b| format!("{} ({})", b.name(), b.device().name))
            .collect();
        let present = if present.is_empty() {
            "none".to_string()
        } else {
            present.join(", ")
        };
        KptError::Backend {
            backend: kind.to_string(),
            message: format!(
                "no {kind} device available: {why}. Devices present: {present}. \
                 Run `kpt detect` to see the hardware, and choose one of them (or auto) \
                 with --device, KPT_BACKEND or hardware.backend"
            ),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime(backend: BackendChoice) -> Runtime {
        let mut config = KptConfig::default();
        config.hardware.backend = backend;
        Runtime::new(config).expect("the default configuration is valid")
    }

    /// The message of the error for a backend that is not present.
    fn missing(rt: &Runtime, kind: &str) -> String {
        match rt.backend() {
            Err(KptError::Backend { backend, message }) => {
                assert_eq!(backend, kind);
                message
            }
            Err(e) => panic!("expected a backend error, got {e}"),
            Ok(b) => panic!("expected no {kind} backend, got {}", b.name()),
        }
    }

    #[test]
    fn cpu_and_auto_always_resolve() {
        assert_eq!(runtime(BackendChoice::Cpu).backend().unwrap().name(), "cpu");
        assert!(runtime(BackendChoice::Auto).backend().is_ok());
    }

    #[test]
    fn a_missing_backend_says_why_and_what_is_present() {
        let m = missing(&runtime(BackendChoice::Rocm), "rocm");
        // No AMD GPU on the machines kpt is tested on: the runtime is missing, or
        // present (Debian's libamdhip64) and sees no device; or the feature is off.
        assert!(
            m.contains("no ROCm runtime found")
                || m.contains("sees no AMD GPU")
                || m.contains("without the `rocm` cargo feature"),
            "{m}"
        );
        assert!(m.contains("Devices present: cpu ("), "{m}");
        assert!(m.contains("--device") && m.contains("kpt detect"), "{m}");
    }

    #[test]
    fn the_tpu_backend_runs_on_a_named_plugin_or_says_there_is_none() {
        let rt = runtime(BackendChoice::Tpu);
        match rt.backend() {
            // `KPT_PJRT_PLUGIN` names a plugin (XLA's CPU plugin under `cargo xtask test`).
            Ok(b) => {
                assert_eq!(b.kind(), DeviceKind::Tpu);
                assert!(b.device().has_feature("xla"), "{:?}", b.device());
            }
            Err(e) => {
                let m = e.to_string();
                assert!(
                    m.contains("no PJRT plugin") || m.contains("tpu.enabled"),
                    "{m}"
                );
                assert!(m.contains("Devices present: cpu ("), "{m}");
            }
        }
        // Under `auto`, a named plugin never replaces the CPU backend.
        if std::env::var_os("KPT_PJRT_PLUGIN").is_some() {
            let auto = runtime(BackendChoice::Auto);
            assert!(auto.backends().by_kind(DeviceKind::Tpu).is_err());
        }
    }

    #[test]
    fn a_missing_cuda_device_names_the_cause() {
        // (`backend = cuda` with CUDA disabled is a configuration error, so ask directly.)
        let mut config = KptConfig::default();
        config.nvidia.enabled = false;
        let rt = Runtime::new(config).expect("valid configuration");
        assert!(rt.backends().by_kind(DeviceKind::Cuda).is_err());
        let m = rt.missing_backend(DeviceKind::Cuda).to_string();
        if cfg!(feature = "cuda") {
            assert!(m.contains("nvidia.enabled = false"), "{m}");
        } else {
            assert!(m.contains("without the `cuda` cargo feature"), "{m}");
        }
        assert!(m.contains("Devices present: cpu ("), "{m}");
        // With CUDA enabled, a machine without a GPU says why there is none.
        let rt = runtime(BackendChoice::Cuda);
        if rt.backends().by_kind(DeviceKind::Cuda).is_err() {
            let m = missing(&rt, "cuda");
            assert!(
                m.contains("driver") || m.contains("feature") || m.contains("CUDA device"),
                "{m}"
            );
            assert!(m.contains("Devices present: cpu ("), "{m}");
        }
    }
}
