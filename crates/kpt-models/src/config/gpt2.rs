//! `config.json` of GPT-2.

use super::fields::Fields;
use super::SpecialTokens;
use crate::error::Result;

/// A GPT-2 decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size (`n_embd`).
    pub n_embd: usize,
    /// Layers (`n_layer`).
    pub n_layer: usize,
    /// Heads (`n_head`).
    pub n_head: usize,
    /// Learned positions (`n_positions`).
    pub n_positions: usize,
    /// MLP hidden size (`n_inner`; `4 * n_embd` when absent or null).
    pub n_inner: usize,
    /// Layer norm epsilon.
    pub layer_norm_epsilon: f64,
    /// MLP activation (`activation_function`).
    pub activation_function: String,
    /// Whether attention scores are divided by `sqrt(head_dim)` (`scale_attn_weights`).
    pub scale_attn_weights: bool,
    /// Whether layer `i`'s scores are further divided by `i + 1`
    /// (`scale_attn_by_inverse_layer_idx`).
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Special token ids.
    pub special_tokens: SpecialTokens,
}

impl Gpt2Config {
    pub(super) fn parse(f: &Fields<'_>) -> Result<Self> {
        let n_embd = f.req_usize("n_embd")?;
        let n_head = f.req_usize("n_head")?;
        f.divides("n_head", n_head, "n_embd", n_embd)?;
        let cfg = Self {
            vocab_size: f.req_usize("vocab_size")?,
            n_embd,
            n_layer: f.req_usize("n_layer")?,
            n_head,
            n_positions: f.req_usize("n_positions")?,
            n_inner: f.opt_usize("n_inner")?.unwrap_or(4 * n_embd),
            layer_norm_epsilon: f.opt_f64("layer_norm_epsilon")?.unwrap_or(1e-5),
            activation_function: f
                .opt_str("activation_function")?
                .unwrap_or_else(|| "gelu_new".into()),
            scale_attn_weights: f.opt_bool("scale_attn_weights")?.unwrap_or(true),
            scale_attn_by_inverse_layer_idx: f
                .opt_bool("scale_attn_by_inverse_layer_idx")?
                .unwrap_or(false),
            special_tokens: SpecialTokens::parse(f)?,
        };
        for (name, v) in [
            ("vocab_size", cfg.vocab_size),
            ("n_layer", cfg.n_layer),
            ("n_positions", cfg.n_positions),
            ("n_inner", cfg.n_inner),
        ] {
            f.positive(name, v)?;
        }
        Ok(cfg)
    }

    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// The softmax scale of layer `layer`, as `modeling_gpt2.py` applies it.
    pub fn attention_scale(&self, layer: usize) -> f64 {
        let mut scale = 1.0;
        if self.scale_attn_weights {
            scale /= (self.head_dim() as f64).sqrt();
        }
        if self.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        scale
    }
}
