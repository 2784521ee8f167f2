//! Errors of the NVIDIA backend.

use kpt_core::memory::MemoryError;
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
    /// A cuBLASLt call returned an error.
    #[error("{call} failed: {status}")]
    Cublas {
        /// The cuBLASLt function, e.g. `cublasLtMatmul`.
        call: &'static str,
        /// The status name, e.g. `CUBLAS_STATUS_NOT_SUPPORTED`.
        status: String,
    },
    /// The device could not hold an allocation even after kpt released its cache.
    #[error("{}", kpt_core::memory::out_of_memory_message(*requested, *free, *reserved))]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the driver reports free.
        free: u64,
        /// Bytes kpt's allocator holds from the driver.
        reserved: u64,
    },
    /// No compiled kernel fits the device.
    #[error("no build of CUDA kernel {kernel} runs on {arch}; run `cargo xtask build-kernels`")]
    NoKernel {
        /// Kernel (source) name.
        kernel: String,
        /// The device's architecture.
        arch: String,
    },
    /// Arguments the backend cannot run (shapes, dtypes, sizes).
    #[error("{0}")]
    Invalid(String),
}

impl From<MemoryError> for NvidiaError {
    /// The shared allocator's errors as the NVIDIA backend reports them.
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::OutOfMemory {
                requested,
                free,
                reserved,
            } => NvidiaError::OutOfMemory {
                requested,
                free,
                reserved,
            },
            other => NvidiaError::Invalid(other.to_string()),
        }
    }
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

    /// Wraps a cuBLASLt error of `call`.
    pub(crate) fn cublas(call: &'static str, e: cudarc::cublaslt::result::CublasError) -> Self {
        NvidiaError::Cublas {
            call,
            status: format!("{:?}", e.0),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_message_names_the_sizes() {
        let e = NvidiaError::OutOfMemory {
            requested: 3 << 30,
            free: 512 << 20,
            reserved: 1536 << 20,
        };
        let m = e.to_string();
        assert!(
            m.contains("3.00 GiB") && m.contains("512.00 MiB") && m.contains("1.50 GiB"),
            "{m}"
        );
        // The shared allocator's errors keep the backend's variants and messages.
        let shared = MemoryError::OutOfMemory {
            requested: 3 << 30,
            free: 512 << 20,
            reserved: 1536 << 20,
        };
        assert_eq!(NvidiaError::from(shared.clone()).to_string(), m);
        assert_eq!(shared.to_string(), m);
        assert_eq!(
            NvidiaError::from(MemoryError::CaptureActive).to_string(),
            "a capture is already recording on this device"
        );
    }
}
