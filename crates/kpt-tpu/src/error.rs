//! Errors of the PJRT layer, each with the plugin's own message where it gave one.

use std::path::PathBuf;

use kpt_core::KptError;

/// Result of the PJRT layer.
pub type Result<T, E = PjrtError> = std::result::Result<T, E>;

/// What went wrong in a PJRT call.
#[derive(Debug, thiserror::Error)]
pub enum PjrtError {
    /// The plugin library could not be loaded or has no `GetPjrtApi`.
    #[error("cannot load the PJRT plugin {path}: {reason}")]
    Load {
        /// The library's path.
        path: PathBuf,
        /// What the loader said.
        reason: String,
    },
    /// The plugin implements another major version of the C API.
    #[error(
        "the PJRT plugin {path} implements C API {major}.{minor}; kpt is built for {want_major}.x"
    )]
    Version {
        /// The library's path.
        path: PathBuf,
        /// The plugin's major version.
        major: i32,
        /// The plugin's minor version.
        minor: i32,
        /// The major version of kpt's bindings.
        want_major: i32,
    },
    /// The plugin's API table lacks a function kpt calls (an older minor version).
    #[error("the PJRT plugin does not provide {0}")]
    Missing(&'static str),
    /// A C API call returned an error.
    #[error("{func} failed ({code}): {message}")]
    Call {
        /// The C API function.
        func: &'static str,
        /// The error code's name (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`, ...).
        code: &'static str,
        /// The plugin's message.
        message: String,
    },
    /// An argument kpt checked before calling the plugin.
    #[error("{0}")]
    Invalid(String),
}

impl From<PjrtError> for KptError {
    fn from(e: PjrtError) -> Self {
        KptError::Backend {
            backend: "xla".into(),
            message: e.to_string(),
        }
    }
}

/// The name of a `PJRT_Error_Code` (the absl status codes).
pub(crate) fn code_name(code: u32) -> &'static str {
    match code {
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNKNOWN_CODE",
    }
}
