//! kpt's XLA backend, on the PJRT C API: the interface JAX and PyTorch/XLA use to drive
//! libtpu, and that XLA's CPU and CUDA plugins implement as well. The same code runs
//! on a TPU VM (libtpu), on NVIDIA GPUs (the CUDA PJRT plugin) and on the CPU (the CPU
//! plugin, which is how kpt tests it on every machine).
//!
//! - [`sys`]: the C API, generated from `pjrt_c_api.h` (`cargo xtask pjrt-bindings`).
//! - [`Plugin`]: loads a plugin library by path ([`Plugin::load`]), from
//!   `KPT_PJRT_PLUGIN` ([`Plugin::from_env`]) or from a Python environment
//!   ([`find_plugin`]), and turns every C API error into a [`PjrtError`] with the
//!   plugin's message.
//! - [`Client`]: the plugin's devices ([`Device`], [`DeviceDescription`]), buffers
//!   ([`Buffer`]: host to device and back), and programs: [`Client::compile`] hands a
//!   StableHLO module to XLA and returns an [`Executable`]. [`Client::topology`] and
//!   [`Device::memory_stats`] describe the devices further.
//! - [`TpuGeneration`]: a TPU's generation from its device kind (`TPU v5 lite` is a
//!   v5e), with the chip's published TensorCores, HBM and peak bf16 compute.
//!
//! ```no_run
//! # fn main() -> Result<(), kpt_tpu::PjrtError> {
//! use kpt_tpu::{Client, CompileOptions, Plugin};
//! let plugin = Plugin::load("xla_cpu_pjrt.so")?;
//! let client = Client::new(&plugin)?;
//! let device = client.devices()?.remove(0);
//! let program = "func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {
//!   %y = stablehlo.add %x, %x : tensor<2xf32>
//!   return %y : tensor<2xf32>
//! }";
//! let exe = client.compile(program.as_bytes(), &CompileOptions::default())?;
//! let x = client.buffer(&[1.0f32, 2.0], &[2], &device)?;
//! let y = exe.execute(&[&x])?;
//! assert_eq!(y[0].to_vec::<f32>()?, [2.0, 4.0]);
//! # Ok(())
//! # }
//! ```

mod backend;
mod buffer;
mod cache;
mod client;
mod detect;
mod error;
mod executable;
mod generation;
mod locate;
mod options;
mod plugin;
pub mod stablehlo;
pub mod sys;

pub use backend::XlaBackend;
pub use buffer::{dtype_of, element_type, Buffer, HostElement};
pub use cache::{CacheStats, CompileCache};
pub use client::{AttrValue, Client, Device, DeviceDescription, DeviceMemoryStats, Topology};
pub use detect::{backends, plugin_path, PjrtDetector};
pub use error::{PjrtError, Result};
pub use executable::Executable;
pub use generation::{TpuChipSpecs, TpuGeneration};
pub use locate::{find_libtpu, find_plugin, PluginKind};
pub use options::CompileOptions;
pub use plugin::{Plugin, PLUGIN_ENV};
