//! kpt-core: configuration, errors, dtypes, tensors, the `Backend` trait, hardware
//! detection, the graph IR, the optimizing manager, the executor and the validator.
//!
//! kpt-core knows no kernel and no backend implementation: kernels are chosen through
//! [`optimize::KernelSelector`] and run through [`backend::Backend`], both implemented
//! by the crates above it.
//!
//! ```
//! use kpt_core::graph::{Activation, Graph, Op};
//! use kpt_core::{DType, Tensor};
//!
//! let mut g = Graph::new();
//! let x = g.input("x", DType::F32, &[4, 16]);
//! let w = g.param("w", Tensor::zeros(DType::F32, &[8, 16]));
//! let y = g.op("fc", Op::Linear { bias: false }, &[x, w])?;
//! let y = g.op("act", Op::Activation { act: Activation::Silu }, &[y])?;
//! g.output(y)?;
//! assert_eq!(g.spec(y)?.shape, vec![4, 8]);
//! # Ok::<(), kpt_core::KptError>(())
//! ```

pub mod backend;
pub mod config;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod graph;
pub mod hardware;
pub mod memory;
pub mod optimize;
pub mod profile;
pub mod rand;
pub mod tensor;
pub mod validate;

pub use config::{KptConfig, OptLevel};
pub use dtype::DType;
pub use error::{ConfigIssue, KptError, Result};
pub use graph::{Graph, Op, OpKind, TensorSpec, ValueId};
pub use hardware::{CpuDetector, DeviceInfo, DeviceKind, HardwareDetector};
pub use tensor::{Storage, Tensor};
