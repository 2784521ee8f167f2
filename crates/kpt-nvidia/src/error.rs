//! Errors of the NVIDIA backend.

use kpt_core::KptError;

/// A failure of the NVIDIA backend, with the CUDA call that failed.
#[derive(Debug, thiserror::Error)]
pub enum NvidiaError {
    /// No CUDA driver library (`libcuda.so`) could be loaded.
    #[error("no CUDA driver found (libcuda could not be loaded); install the NVIDIA driver or run on the CPU")]
    NoDriver,
    /// A driver API call returned an error.
    #[error("{call} failed: {name} ({message})")]
    Driver {
        /// The driver API function, e.g. `cuInit`.
        call: &'static str,
        /// The CUDA error name, e.g. `CUDA_ERROR_NO_DEVICE`.
        name: String,
        /// The driver's description of it.
        message: String,
    },
}

impl NvidiaError {
    /// Wraps a driver error of `call`.
    pub(crate) fn driver(call: &'static str, e: cudarc::driver::DriverError) -> Self {
        let text = |r: Result<&std::ffi::CStr, _>| {
            r.map(|s: &std::ffi::CStr| s.to_string_lossy().into_owned())
                .unwrap_or_else(|_| format!("{:?}", e.0))
        };
        NvidiaError::Driver {
            call,
            name: text(e.error_name()),
            message: text(e.error_string()),
        }
    }
}

impl From<NvidiaError> for KptError {
    fn from(e: NvidiaError) -> Self {
        KptError::Backend {
            backend: "cuda".into(),
            message: e.to_string(),
        }
    }
}
