//! kpt-core: configuration, errors, dtypes, tensors, the `Backend` trait, the graph IR,
//! the optimizing manager and the validator.

pub mod dtype;
pub mod error;

pub use dtype::DType;
pub use error::{ConfigIssue, KptError, Result};
