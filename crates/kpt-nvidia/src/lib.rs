//! kpt's NVIDIA backend. CUDA is reached through the driver API of
//! [cudarc](https://docs.rs/cudarc) with dynamic loading: nothing links against CUDA at
//! build time, a binary built without a GPU runs on a GPU machine, and on a machine
//! without the driver every entry point returns [`NvidiaError::NoDriver`] instead of
//! failing to start.
//!
//! So far: device discovery ([`devices`], [`CudaDetector`] for `kpt detect`). The
//! kernels it will launch are built by `cargo xtask build-kernels` and embedded in
//! `kpt_kernels::artifacts`.

mod device;
mod error;

pub use device::{devices, driver_present, CudaDetector, GpuProperties};
pub use error::NvidiaError;
