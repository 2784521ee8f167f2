//! kpt's NVIDIA backend. CUDA is reached through the driver API of
//! [cudarc](https://docs.rs/cudarc) with dynamic loading: nothing links against CUDA at
//! build time, a binary built without a GPU runs on a GPU machine, and on a machine
//! without the driver every entry point returns [`NvidiaError::NoDriver`] instead of
//! failing to start.
//!
//! - [`devices`], [`CudaDetector`]: discovery for `kpt detect`; [`GpuTelemetry`]:
//!   clocks, temperature and power from NVML (`libnvidia-ml`, also loaded at run time
//!   and optional), matched to CUDA ordinals by [`PciAddress`].
//! - [`Gpu`]: a device in use: context, stream, [`CachingAllocator`], kernel modules
//!   loaded from `kpt_kernels::artifacts` (cubin for the device, else PTX).
//! - [`Blas`]: cuBLASLt GEMMs with fused bias/activation epilogues and FP8.
//! - [`CudaBackend`]: the `Backend` the manager, validator and CLI use.

pub mod autotune_cache;
mod backend;
mod blas;
mod device;
mod error;
mod gpu;
mod kernels;
mod memory;
mod nvml;
mod pinned;
mod profiler;
mod tma;

pub use backend::{CudaBackend, CudaOptions};
pub use blas::{cublaslt_present, Blas, Epilogue, GemmArgs, GemmShape, GemmTuning, Layout};
pub use device::{
    devices, devices_with_telemetry, driver_present, CudaDetector, GpuProperties, PciAddress,
};
pub use error::NvidiaError;
pub use gpu::{Gpu, GpuGraph, LaunchGrid, LoadedFunction};
pub use memory::{
    estimate_bytes, size_class, CachingAllocator, DeviceBlock, MemoryStatistics, PrivateBlocks,
};
pub use nvml::{telemetry, GpuTelemetry};
pub use pinned::PendingRead;
