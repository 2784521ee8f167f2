//! kpt's AMD backend. ROCm is reached through the HIP runtime, `libamdhip64`, opened
//! at run time: nothing links against ROCm at build time, kpt builds and tests on
//! machines without it, and there every entry point returns
//! [`AmdError::NoRuntime`] ("no ROCm runtime found (…)") instead of failing to start.
//!
//! - [`HipRuntime`]: the loaded runtime and the HIP functions kpt calls, each error a
//!   typed [`AmdError::Hip`]; [`sys`], the raw signatures, enum values and the two
//!   `hipDeviceProp_t` layouts (ROCm 5 and ROCm 6+).
//! - [`devices`], [`RocmDetector`]: discovery for `kpt detect`; [`DeviceProperties`]
//!   (what the runtime reports, serde-serializable so recorded tables of real devices
//!   test the same code) and [`AmdDevice`]; [`recorded_device`], the recorded tables of
//!   an MI250X die, an MI300X and an RX 7900 XTX (`devices/*.json`, with their sources).
//! - [`GcnArch`]: a target ID such as `gfx942:sramecc+:xnack-` parsed into processor and
//!   features, with its [`Family`] (CDNA2, CDNA3, RDNA3, ...), wave size, LDS, matrix
//!   cores, FP8 encoding and [`Tuning`] table.
//! - [`AmdGpu`]: a device in use: one stream, kpt-core's shared caching allocator over
//!   [`HipMemory`] (`hipMalloc` / `hipFree`), copies, and the code objects of
//!   `kpt_kernels::artifacts` for its processor loaded with `hipModuleLoadData` after
//!   [`CodeObject::check`].
//! - [`Hiprtc`], [`CompileCache`]: run-time compilation of `kernels/hip/*.hip` for a
//!   processor no shipped code object was built for, cached by source, options and
//!   compiler (in memory, and in `KPT_ROCM_CACHE_DIR` when set).
//! - [`RocmBackend`]: kpt-core's `Backend` on an [`AmdGpu`]. `amd.*` kernels launch the
//!   code objects through [`kernels`]' launch plans, whose argument layouts are checked
//!   against each code object's metadata before every launch (and by the tests, for
//!   every shipped object, without a GPU); GEMMs go to rocBLAS ([`blas`]) and FP8
//!   linears on MI300 to hipBLASLt ([`hipblaslt`], with the OCP -> FNUZ conversion of
//!   [`fp8`]), both loaded at run time; `cpu.*` kernels, the end of every fallback
//!   chain, run on the host with the data copied over and back.
//!   [`backend_device_info`] is what the registry sees of a device under the backend.
//! - [`CodeObject`]: an HSACO (AMDGPU ELF code object) parsed and checked: machine,
//!   processor from `e_flags`, kernel symbols and descriptors, and the kernels'
//!   metadata (registers, LDS, wave size) from the `NT_AMDGPU_METADATA` note.
//!
//! ```
//! use kpt_amd::{Family, GcnArch};
//!
//! let mi300x = GcnArch::parse("gfx942:sramecc+:xnack-")?;
//! assert_eq!(mi300x.family(), Family::Cdna3);
//! assert_eq!(mi300x.wave_size(), 64);
//! assert!(mi300x.fp8().is_some());
//!
//! // On a machine without ROCm this is `Err(AmdError::NoRuntime { .. })`, never a panic.
//! match kpt_amd::devices() {
//!     Ok(found) => println!("{} ROCm device(s)", found.len()),
//!     Err(e) => println!("{e}"),
//! }
//! # Ok::<(), kpt_amd::AmdError>(())
//! ```

mod arch;
mod backend;
pub mod blas;
mod device;
mod error;
pub mod fp8;
mod gpu;
pub mod hipblaslt;
mod hsaco;
pub mod kernels;
mod memory;
mod rtc;
mod runtime;
pub mod sys;

pub use arch::{Family, FeatureSetting, Fp8Format, GcnArch, MatrixCores, Tuning};
pub use backend::{
    backend_device_info, launches_on, Libraries, RocmBackend, RocmOptions, HIPBLASLT_FP8_FEATURE,
    ROCBLAS_FEATURE,
};
pub use blas::{rocblas_present, Rocblas, ROCBLAS_ENV};
pub use device::{
    devices, devices_of, read_properties, recorded_device, recorded_devices, runtime_present,
    AmdDevice, DeviceProperties, RocmDetector,
};
pub use error::AmdError;
pub use gpu::{AmdGpu, Function};
pub use hipblaslt::{hipblaslt_present, HipBlasLt, HIPBLASLT_ENV};
pub use hsaco::{processor_of_mach, CodeObject, FeatureFlag, KernelArgMetadata, KernelMetadata};
pub use memory::{CachingAllocator, DeviceBlock, HipMemory};
pub use rtc::{
    first_rocm_for, rtc_kernels, rtc_source, CacheStats, CompileCache, Hiprtc, CACHE_DIR_ENV,
};
pub use runtime::{library_candidates, Handle, HipRuntime, HipVersion, LIBRARY_ENV};
