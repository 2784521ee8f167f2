//! Errors of the AMD backend.

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
    /// The HIP runtime was loaded but lacks a function kpt needs.
    #[error("the HIP runtime at {library} has no `{symbol}` ({reason})")]
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
    /// A code object (HSACO) that is not a valid AMDGPU ELF or lacks what it should hold.
    #[error("invalid AMDGPU code object: {0}")]
    CodeObject(String),
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
    }
}
