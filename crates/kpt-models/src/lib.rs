//! kpt-models: Hugging Face checkpoints lowered to kpt's graph IR.
//!
//! A checkpoint directory holds `config.json` ([`ModelConfig`]), `model.safetensors`
//! or shards listed in `model.safetensors.index.json` ([`Weights`], memory-mapped),
//! and `tokenizer.json` ([`Tokenizer`]). [`Checkpoint::open`] reads the first two;
//! an architecture's loader ([`llama::Llama`], [`gpt2::Gpt2`], [`bert::Bert`]) checks
//! every weight against the config and builds [`kpt_core::Graph`]s that the manager
//! optimizes and the executor runs. Every problem with the files is a [`ModelError`]
//! naming the file, field or tensor.
//!
//! ```no_run
//! use kpt_models::{Checkpoint, ModelConfig, Phase};
//! use kpt_models::llama::Llama;
//!
//! # fn main() -> kpt_models::Result<()> {
//! let ckpt = Checkpoint::open(std::path::Path::new("models/tiny-llama"))?;
//! let ModelConfig::Llama(cfg) = &ckpt.config else { panic!("not a LLaMA") };
//! let model = Llama::load(cfg, &ckpt.weights, kpt_core::DType::F32)?;
//! let prefill = model.graph(Phase::Prefill, 16)?;
//! assert_eq!(prefill.outputs().len(), 1 + 2 * cfg.num_hidden_layers);
//! # Ok(())
//! # }
//! ```

pub mod bert;
pub mod config;
pub mod error;
pub mod gpt2;
pub mod llama;
pub mod lower;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

pub use config::{ModelConfig, SpecialTokens};
pub use error::{ModelError, Result};
pub use lower::Phase;
pub use tokenizer::Tokenizer;
pub use weights::Weights;

/// The configuration file of a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";

/// A checkpoint directory: its config and mapped weights.
#[derive(Debug)]
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// `config.json`.
    pub config: ModelConfig,
    /// The safetensors files.
    pub weights: Weights,
}

impl Checkpoint {
    /// Reads `dir/config.json` and maps the safetensors of `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let _span = tracing::info_span!("load_checkpoint", dir = %dir.display()).entered();
        let config = ModelConfig::from_file(&dir.join(CONFIG_FILE))?;
        let weights = Weights::open(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
        })
    }

    /// Loads `dir/tokenizer.json` with the special ids of this checkpoint.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::from_dir(&self.dir, &self.config.special_tokens())
    }
}
