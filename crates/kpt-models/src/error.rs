//! The error type of kpt-models.

use std::path::{Path, PathBuf};

use kpt_core::KptError;

/// Errors raised while reading a checkpoint or lowering it to a graph. Every variant
/// names the file, field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The path given as a checkpoint directory is missing, not a directory, or has no
    /// `config.json`.
    #[error("{}: {reason}", path.display())]
    NotACheckpoint {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A JSON file is not valid JSON or not of the expected form.
    #[error("{}: invalid JSON: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// Parser message.
        message: String,
    },
    /// `config.json` names an architecture that kpt cannot lower.
    #[error(
        "{}: unsupported model_type `{model_type}`; supported: llama, mistral, qwen2, gpt2, bert",
        path.display()
    )]
    UnknownArchitecture {
        /// The file.
        path: PathBuf,
        /// The `model_type` found.
        model_type: String,
    },
    /// A required field is absent.
    #[error("{}: missing field `{field}`", path.display())]
    MissingField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
    },
    /// A field has a value of the wrong type or an inconsistent value.
    #[error("{}: field `{field}`: {message}", path.display())]
    InvalidField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A safetensors file or its index is malformed.
    #[error("{}: invalid safetensors data: {message}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint has no tensor of this name.
    #[error("tensor `{name}` not found in the checkpoint at {}", dir.display())]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor's shape differs from what the architecture needs.
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    TensorShape {
        /// The tensor name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype that kpt does not load.
    #[error("tensor `{name}` in {}: unsupported dtype {dtype}; supported: F32, F16, BF16, F64", path.display())]
    UnsupportedDType {
        /// The tensor name.
        name: String,
        /// The file holding it.
        path: PathBuf,
        /// The safetensors dtype name.
        dtype: String,
    },
    /// `tokenizer.json` could not be loaded, or encoding/decoding failed.
    #[error("tokenizer {}: {message}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// A sampling parameter is out of its range (e.g. `top_p` outside `(0, 1]`, a
    /// negative temperature).
    #[error("invalid sampling parameter `{parameter}`: {message}")]
    InvalidSampling {
        /// The parameter.
        parameter: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// A generation request that cannot run (no prompt, an empty prompt, a token
    /// outside the vocabulary, more positions than the model has) or logits that
    /// cannot be sampled (NaN).
    #[error("generation: {0}")]
    Generation(String),
    /// `rope_scaling` names a rotary scaling type that kpt does not implement.
    #[error(
        "{}: unsupported rope_scaling type `{rope_type}`; supported: default, linear, dynamic, llama3, yarn",
        path.display()
    )]
    UnsupportedRopeType {
        /// The file.
        path: PathBuf,
        /// The `rope_type` (or `type`) found.
        rope_type: String,
    },
    /// A feature of the checkpoint that kpt cannot lower yet.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An error of kpt-core (graph construction, tensors).
    #[error(transparent)]
    Core(#[from] KptError),
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn invalid(path: &Path, field: &str, message: impl Into<String>) -> Self {
        Self::InvalidField {
            path: path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }
}

impl From<ModelError> for KptError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Core(e) => e,
            ModelError::Io { path, source } => KptError::Io {
                path: path.display().to_string(),
                source,
            },
            other => KptError::InvalidArgument(other.to_string()),
        }
    }
}

/// Result with [`ModelError`].
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
