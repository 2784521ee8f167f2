//! kpt-models: Hugging Face checkpoints lowered to kpt's graph IR.
//!
//! A checkpoint directory holds `config.json` ([`ModelConfig`]), `model.safetensors`
//! or shards listed in `model.safetensors.index.json` ([`Weights`], memory-mapped),
//! and `tokenizer.json` ([`Tokenizer`]). [`Checkpoint::open`] reads the first two;
//! [`Checkpoint::load_model`] picks the architecture's loader ([`llama::Llama`],
//! [`gpt2::Gpt2`], [`bert::Bert`]), which checks every weight against the config and
//! builds [`kpt_core::Graph`]s that the manager optimizes and the executor runs.
//! [`synthetic`] writes small random checkpoints in the same formats. Every problem
//! with the files is a [`ModelError`] naming the file, field or tensor.
//!
//! ```no_run
//! use kpt_models::{Checkpoint, Phase};
//!
//! # fn main() -> kpt_models::Result<()> {
//! let ckpt = Checkpoint::open(std::path::Path::new("models/tiny-llama"))?;
//! let model = ckpt.load_model(kpt_core::DType::F32)?;
//! let tokenizer = ckpt.tokenizer()?;
//! let ids = tokenizer.encode("Hello", true)?;
//! // Logits `[1, S, vocab]`, then the keys and values of every layer.
//! let prefill = model.graph(Phase::Prefill, ids.len())?;
//! // The same with the cache of `ids.len()` tokens as inputs, for one new token.
//! let decode = model.graph(Phase::Decode, ids.len())?;
//! # let _ = (prefill, decode);
//! # Ok(())
//! # }
//! ```

pub mod bert;
pub mod config;
pub mod error;
pub mod generate;
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

/// A loaded model of any supported architecture.
#[derive(Debug, Clone)]
pub enum Model {
    /// LLaMA, Mistral or Qwen2 decoder.
    Llama(llama::Llama),
    /// GPT-2 decoder.
    Gpt2(gpt2::Gpt2),
    /// BERT encoder.
    Bert(bert::Bert),
}

impl Model {
    /// Whether it generates text (a decoder with a KV cache) rather than embeddings.
    pub fn is_decoder(&self) -> bool {
        !matches!(self, Model::Bert(_))
    }

    /// The compute dtype of its parameters and activations (chosen at load time).
    pub fn dtype(&self) -> kpt_core::DType {
        match self {
            Model::Llama(m) => m.dtype,
            Model::Gpt2(m) => m.dtype,
            Model::Bert(m) => m.dtype,
        }
    }

    /// Vocabulary size (rows of the logits).
    pub fn vocab_size(&self) -> usize {
        match self {
            Model::Llama(m) => m.config.vocab_size,
            Model::Gpt2(m) => m.config.vocab_size,
            Model::Bert(m) => m.config.vocab_size,
        }
    }

    /// The number of positions of a learned position table (GPT-2, BERT); `None` for
    /// rotary models, whose positions have no hard limit.
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            Model::Llama(_) => None,
            Model::Gpt2(m) => Some(m.config.n_positions),
            Model::Bert(m) => Some(m.config.max_position_embeddings),
        }
    }

    /// The decoder graph of `phase` (see [`llama::Llama::graph`]); for BERT, the
    /// encoder graph over `seq` tokens, whatever the phase.
    pub fn graph(&self, phase: Phase, seq: usize) -> Result<kpt_core::Graph> {
        match self {
            Model::Llama(m) => m.graph(phase, seq),
            Model::Gpt2(m) => m.graph(phase, seq),
            Model::Bert(m) => m.graph(seq),
        }
    }

    /// The graph of `sequences` sequences packed without padding into `total` tokens:
    /// a decoder's packed prefill ([`llama::Llama::graph_packed`], inputs from
    /// [`lower::pack_prompts`]) or BERT's packed encoder ([`bert::Bert::graph_packed`],
    /// inputs from [`bert::pack`]).
    pub fn graph_packed(&self, total: usize, sequences: usize) -> Result<kpt_core::Graph> {
        match self {
            Model::Llama(m) => m.graph_packed(total, sequences),
            Model::Gpt2(m) => m.graph_packed(total, sequences),
            Model::Bert(m) => m.graph_packed(total, sequences),
        }
    }

    /// A decoder's packed prefill of [`Phase::PrefillLast`] (the logits of each prompt's
    /// last token; [`llama::Llama::graph_packed_last`]); BERT has no logits, an error.
    pub fn graph_packed_last(&self, total: usize, sequences: usize) -> Result<kpt_core::Graph> {
        match self {
            Model::Llama(m) => m.graph_packed_last(total, sequences),
            Model::Gpt2(m) => m.graph_packed_last(total, sequences),
            Model::Bert(_) => Err(ModelError::Unsupported(
                "BERT is an encoder: it has no logits to keep the last of".into(),
            )),
        }
    }
}

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
    /// Reads `dir/config.json` and maps the safetensors of `dir`. A path that does not
    /// exist, is not a directory or has no `config.json` is
    /// [`ModelError::NotACheckpoint`].
    pub fn open(dir: &Path) -> Result<Self> {
        let _span = tracing::info_span!("load_checkpoint", dir = %dir.display()).entered();
        let not = |reason: &str| ModelError::NotACheckpoint {
            path: dir.to_path_buf(),
            reason: reason.to_string(),
        };
        if !dir.exists() {
            return Err(not("no such model directory"));
        }
        if !dir.is_dir() {
            return Err(not(
                "not a directory (a checkpoint is a directory with config.json, \
                 *.safetensors and tokenizer.json)",
            ));
        }
        if !dir.join(CONFIG_FILE).is_file() {
            return Err(not(
                "not a checkpoint directory: it has no config.json (a Hugging Face model \
                 directory holds config.json, model.safetensors and tokenizer.json)",
            ));
        }
        let config = ModelConfig::from_file(&dir.join(CONFIG_FILE))?;
        let weights = Weights::open(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
        })
    }

    /// Loads and shape-checks the weights of the configured architecture, converted to
    /// `dtype` (f32 for the optimized CPU path; the manager lowers precision per level).
    pub fn load_model(&self, dtype: kpt_core::DType) -> Result<Model> {
        let _span = tracing::info_span!("load_model", arch = self.config.model_type()).entered();
        Ok(match &self.config {
            ModelConfig::Llama(c) => Model::Llama(llama::Llama::load(c, &self.weights, dtype)?),
            ModelConfig::Gpt2(c) => Model::Gpt2(gpt2::Gpt2::load(c, &self.weights, dtype)?),
            ModelConfig::Bert(c) => Model::Bert(bert::Bert::load(c, &self.weights, dtype)?),
        })
    }

    /// Loads `dir/tokenizer.json` with the special ids of this checkpoint. A vocabulary
    /// larger than the model's is logged (ids past the embedding table fail when run).
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let tok = Tokenizer::from_dir(&self.dir, &self.config.special_tokens())?;
        if tok.vocab_size() > self.config.vocab_size() {
            tracing::warn!(
                tokenizer = tok.vocab_size(),
                model = self.config.vocab_size(),
                "tokenizer.json has more tokens than the model's vocab_size"
            );
        }
        Ok(tok)
    }
}
