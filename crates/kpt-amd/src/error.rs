//! Errors of the AMD backend.

use kpt_core::memory::MemoryError;
use kpt_core::KptError;

/// A failure of the AMD backend, with the HIP call or the input that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmdError {
    /// The HIP runtime library (`libamdhip64`) could not be loaded.
    #[error(
        "no ROCm runtime found ({reason}); install ROCm (libamdhip64), set {env} to the \
         library's path, or run on another backend"
    )]
    NoRuntime {
        /// What was tried and why each attempt failed.
        reason: String,
        /// The environment variable that names the library directly.
        env: &'static str,
    },
    /// A ROCm library other than the runtime (rocBLAS, hipBLASLt) could not be loaded.
    #[error(
        "no {library} found ({reason}); install it (ROCm's {package} package) or set {env} \
         to the library's path"
    )]
    NoLibrary {
        /// The library, e.g. `rocBLAS`.
        library: &'static str,
        /// Its ROCm package, e.g. `rocblas`.
        package: &'static str,
        /// What was tried and why each attempt failed.
        reason: String,
        /// The environment variable that names the library directly.
        env: &'static str,
    },
    /// A rocBLAS or hipBLASLt call returned an error status.
    #[error("{call} failed: {name} ({status})")]
    Blas {
        /// The function, e.g. `rocblas_gemm_ex`.
        call: &'static str,
        /// The `rocblas_status` / `hipblasStatus_t` value.
        status: i32,
        /// Its name, e.g. `rocblas_status_invalid_size`.
        name: &'static str,
    },
    /// A ROCm library (the HIP runtime, rocBLAS, hipBLASLt) was loaded but lacks a
    /// function kpt needs.
    #[error("the ROCm library at {library} has no `{symbol}` ({reason})")]
    MissingSymbol {
        /// The library that was loaded.
        library: String,
        /// The function that was looked up.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// A HIP runtime call returned an error.
    #[error("{call} failed: {name} ({code}): {message}")]
    Hip {
        /// The HIP function, e.g. `hipInit`.
        call: &'static str,
        /// The `hipError_t` value.
        code: i32,
        /// Its name, e.g. `hipErrorNoDevice`.
        name: String,
        /// The runtime's description of it.
        message: String,
    },
    /// The runtime's `hipDeviceProp_t` did not have the layout kpt reads it with.
    #[error(
        "hipDeviceProp_t of HIP runtime {runtime} does not have the {layout} layout: {detail}"
    )]
    PropertiesLayout {
        /// The runtime version, e.g. `5.2.21153`.
        runtime: String,
        /// The layout that was assumed (`R0000` or `R0600`).
        layout: &'static str,
        /// What did not match.
        detail: String,
    },
    /// No device of that ordinal.
    #[error("no ROCm device {index}: the HIP runtime sees {found}")]
    NoDevice {
        /// The ordinal asked for.
        index: usize,
        /// How many devices the runtime sees.
        found: usize,
    },
    /// The device could not hold an allocation even after kpt released its cache.
    #[error("{}", kpt_core::memory::out_of_memory_message(*requested, *free, *reserved))]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the runtime reports free.
        free: u64,
        /// Bytes kpt's allocator holds from the runtime.
        reserved: u64,
    },
    /// Arguments the backend cannot take (a capture already recording, a size that
    /// overflows).
    #[error("{0}")]
    Invalid(String),
    /// A string that is not an AMD GPU target such as `gfx90a:sramecc+:xnack-`.
    #[error("`{text}` is not an AMD GPU target: {reason}")]
    InvalidArch {
        /// The text that was parsed.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A name that is not one of the recorded devices (`kpt_amd::recorded_device`).
    #[error("no recorded AMD device `{name}` ({reason}); recorded: {known}")]
    Recorded {
        /// The name asked for.
        name: String,
        /// Why it could not be given.
        reason: String,
        /// The recorded names.
        known: String,
    },
    /// The compiler at hand cannot build for the processor.
    #[error("{compiler} cannot build code for {processor}; {needs} does")]
    Unsupported {
        /// The processor asked for.
        processor: String,
        /// The compiler (`hiprtc 5.2.21153`).
        compiler: String,
        /// What would build it.
        needs: String,
    },
    /// hiprtc did not compile a kernel.
    #[error("hiprtc could not compile {kernel} with `{options}`:\n{log}")]
    Compile {
        /// The kernel's source name.
        kernel: String,
        /// The options given.
        options: String,
        /// The compiler's log.
        log: String,
    },
    /// A code object (HSACO) that is not a valid AMDGPU ELF or lacks what it should hold.
    #[error("invalid AMDGPU code object: {0}")]
    CodeObject(String),
}

impl From<MemoryError> for AmdError {
    /// The shared allocator's errors as the AMD backend reports them.
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::OutOfMemory {
                requested,
                free,
                reserved,
            } => AmdError::OutOfMemory {
                requested,
                free,
                reserved,
            },
            other => AmdError::Invalid(other.to_string()),
        }
    }
}

impl From<AmdError> for KptError {
    fn from(e: AmdError) -> Self {
        KptError::Backend {
            backend: "rocm".into(),
            message: e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_to_do() {
        let e = AmdError::NoRuntime {
            reason: "libamdhip64.so: cannot open shared object file".into(),
            env: "KPT_HIP_LIBRARY",
        };
        let m = e.to_string();
        assert!(m.starts_with("no ROCm runtime found ("), "{m}");
        assert!(
            m.contains("KPT_HIP_LIBRARY") && m.contains("cannot open"),
            "{m}"
        );
        let k: KptError = e.into();
        assert!(k.to_string().contains("no ROCm runtime found"), "{k}");
        let h = AmdError::Hip {
            call: "hipInit",
            code: 100,
            name: "hipErrorNoDevice".into(),
            message: "no ROCm-capable device is detected".into(),
        };
        assert_eq!(
            h.to_string(),
            "hipInit failed: hipErrorNoDevice (100): no ROCm-capable device is detected"
        );
        let oom = MemoryError::OutOfMemory {
            requested: 3 << 30,
            free: 512 << 20,
            reserved: 1536 << 20,
        };
        assert_eq!(AmdError::from(oom.clone()).to_string(), oom.to_string());
        assert!(matches!(
            AmdError::from(MemoryError::CaptureActive),
            AmdError::Invalid(_)
        ));
    }
}
