//! kpt-kernels: the op catalog, the kernel registry, and the CPU kernels and backend.
//!
//! - [`KernelRegistry`] holds [`KernelDef`]s (op, backend, dtypes, minimum arch, shape
//!   limits, priority), selects the best for an op on a device, keeps the rest as a
//!   fallback chain and explains every decision.
//! - [`cpu`] has the kernels themselves: [`cpu::reference`] in f64 for every op, and
//!   fast multi-threaded SIMD kernels in f32 (with bf16/f16/FP8/int8 weights).
//! - [`CpuBackend`] runs them behind `kpt_core::backend::Backend`; [`CpuReference`]
//!   implements the validator's reference.
//!
//! ```
//! use kpt_core::graph::{Op, TensorSpec};
//! use kpt_core::hardware::{CpuDetector, HardwareDetector};
//! use kpt_core::DType;
//! use kpt_kernels::KernelRegistry;
//!
//! let registry = KernelRegistry::with_builtin();
//! let cpu = CpuDetector.detect()?.remove(0);
//! let inputs = [TensorSpec::new(&[1, 64], DType::F32), TensorSpec::new(&[32, 64], DType::BF16)];
//! let chain = registry.fallback_chain(&Op::Linear { bias: false }, &inputs, &cpu);
//! assert_eq!(chain, ["cpu.linear.fused", "cpu.reference"]);
//! # Ok::<(), kpt_core::KptError>(())
//! ```

pub mod artifacts;
pub mod catalog;
pub mod cpu;
mod cpu_backend;
mod reference;
pub mod registry;

pub use catalog::CPU_REFERENCE;
pub use cpu_backend::{CpuBackend, CpuTuning};
pub use reference::{act, CpuReference};
pub use registry::{Candidate, KernelDef, KernelRegistry, ShapeLimits};
