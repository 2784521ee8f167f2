//! `config.json` of BERT.

use super::fields::Fields;
use super::SpecialTokens;
use crate::error::Result;

/// A BERT encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Heads.
    pub num_attention_heads: usize,
    /// MLP hidden size.
    pub intermediate_size: usize,
    /// Learned positions.
    pub max_position_embeddings: usize,
    /// Token type (segment) vocabulary.
    pub type_vocab_size: usize,
    /// Layer norm epsilon.
    pub layer_norm_eps: f64,
    /// MLP activation (`hidden_act`).
    pub hidden_act: String,
    /// Special token ids.
    pub special_tokens: SpecialTokens,
}

impl BertConfig {
    pub(super) fn parse(f: &Fields<'_>) -> Result<Self> {
        let hidden_size = f.req_usize("hidden_size")?;
        let heads = f.req_usize("num_attention_heads")?;
        f.divides("num_attention_heads", heads, "hidden_size", hidden_size)?;
        if let Some(kind) = f.opt_str("position_embedding_type")? {
            if kind != "absolute" {
                return Err(f.invalid(
                    "position_embedding_type",
                    format!("`{kind}` is not supported; supported: absolute"),
                ));
            }
        }
        let cfg = Self {
            vocab_size: f.req_usize("vocab_size")?,
            hidden_size,
            num_hidden_layers: f.req_usize("num_hidden_layers")?,
            num_attention_heads: heads,
            intermediate_size: f.req_usize("intermediate_size")?,
            max_position_embeddings: f.req_usize("max_position_embeddings")?,
            type_vocab_size: f.opt_usize("type_vocab_size")?.unwrap_or(2),
            layer_norm_eps: f.opt_f64("layer_norm_eps")?.unwrap_or(1e-12),
            hidden_act: f.opt_str("hidden_act")?.unwrap_or_else(|| "gelu".into()),
            special_tokens: SpecialTokens::parse(f)?,
        };
        for (name, v) in [
            ("vocab_size", cfg.vocab_size),
            ("num_hidden_layers", cfg.num_hidden_layers),
            ("intermediate_size", cfg.intermediate_size),
            ("max_position_embeddings", cfg.max_position_embeddings),
            ("type_vocab_size", cfg.type_vocab_size),
        ] {
            f.positive(name, v)?;
        }
        Ok(cfg)
    }

    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}
