//! The error type of kpt-core. Every fallible public function returns [`Result`].

use crate::dtype::DType;

/// One problem found in a configuration: where it is, what is wrong, how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConfigIssue {
    /// Dotted path of the offending field, e.g. `nvidia.device_id`.
    pub field: String,
    /// What is wrong with the value.
    pub message: String,
    /// What the user can do about it.
    pub hint: String,
}

impl std::fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} (hint: {})", self.field, self.message, self.hint)
    }
}

/// Errors raised by kpt-core and, through `#[from]` conversions, the crates above it.
#[derive(Debug, thiserror::Error)]
pub enum KptError {
    /// A configuration failed validation; every problem found is listed.
    #[error("invalid configuration ({} problem(s)):\n{}", .0.len(), format_issues(.0))]
    InvalidConfig(Vec<ConfigIssue>),
    /// A configuration file or environment variable could not be parsed.
    #[error("cannot parse configuration {source_name}: {message}")]
    ConfigParse {
        /// File path or variable name.
        source_name: String,
        /// Parser message.
        message: String,
    },
    /// Shapes that an op cannot accept.
    #[error("shape error in {op}: {message}")]
    Shape {
        /// Op or function that rejected the shapes.
        op: String,
        /// What was expected and what was given.
        message: String,
    },
    /// A tensor has the wrong dtype for an op.
    #[error("dtype mismatch in {op}: expected {expected}, got {got}")]
    DTypeMismatch {
        /// Op or function that rejected the dtype.
        op: String,
        /// Accepted dtype(s).
        expected: String,
        /// The dtype that was given.
        got: DType,
    },
    /// An op name that kpt does not know.
    #[error("unknown op `{0}`; run `kpt kernels` to list the known ops")]
    UnknownOp(String),
    /// A dtype name that kpt does not know.
    #[error("unknown dtype `{0}`; known: f64, f32, f16, bf16, f8e4m3, f8e5m2, i8, i32, i64")]
    UnknownDType(String),
    /// No kernel can run an op on the selected hardware and precision.
    #[error("no kernel for {op} on {backend}: {}", .reasons.join("; "))]
    NoKernel {
        /// The op that needs a kernel.
        op: String,
        /// The backend that was searched.
        backend: String,
        /// Why each candidate was rejected.
        reasons: Vec<String>,
    },
    /// A graph is malformed (dangling value, wrong input count, ...).
    #[error("invalid graph: {0}")]
    Graph(String),
    /// A backend failed or is unavailable.
    #[error("backend {backend}: {message}")]
    Backend {
        /// Backend name.
        backend: String,
        /// What happened.
        message: String,
    },
    /// Numeric validation found errors above tolerance.
    #[error("validation failed: {0}")]
    Validation(String),
    /// An invalid argument that is none of the above.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Rotary scaling parameters that cannot be evaluated.
    #[error(transparent)]
    RopeScaling(#[from] crate::graph::RopeScalingError),
    /// I/O failure with the path involved.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// File that was read or written.
        path: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
}

fn format_issues(issues: &[ConfigIssue]) -> String {
    issues
        .iter()
        .map(|i| format!("  - {i}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl KptError {
    /// Shorthand for [`KptError::Shape`].
    pub fn shape(op: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Shape {
            op: op.into(),
            message: message.into(),
        }
    }

    /// Shorthand for [`KptError::DTypeMismatch`].
    pub fn dtype(op: impl Into<String>, expected: impl Into<String>, got: DType) -> Self {
        Self::DTypeMismatch {
            op: op.into(),
            expected: expected.into(),
            got,
        }
    }

    /// Shorthand for [`KptError::Io`].
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// `Result` with [`KptError`].
pub type Result<T, E = KptError> = std::result::Result<T, E>;
