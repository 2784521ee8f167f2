//! `config.json` of the LLaMA family: llama, mistral, qwen2.

use kpt_core::graph::RopeScaling;
use serde_json::Value;

use super::fields::Fields;
use super::SpecialTokens;
use crate::error::{ModelError, Result};

/// Which member of the LLaMA family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `model_type: "llama"` (LLaMA 2/3 and derivatives).
    Llama,
    /// `model_type: "mistral"` (sliding-window attention).
    Mistral,
    /// `model_type: "qwen2"` (q/k/v projections with bias).
    Qwen2,
}

impl LlamaFamily {
    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "llama",
            LlamaFamily::Mistral => "mistral",
            LlamaFamily::Qwen2 => "qwen2",
        }
    }
}

/// Which layers of a LLaMA-family model use the sliding window (kept as a rule rather
/// than a list, so that no allocation follows a layer count read from the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlidingLayers {
    /// Every layer (Mistral).
    All,
    /// Layers from this index on (Qwen2's `max_window_layers`).
    From(usize),
    /// One entry per layer (`layer_types`).
    Each(Vec<bool>),
}

impl SlidingLayers {
    /// Whether layer `layer` uses the window.
    pub fn contains(&self, layer: usize) -> bool {
        match self {
            SlidingLayers::All => true,
            SlidingLayers::From(first) => layer >= *first,
            SlidingLayers::Each(v) => v.get(layer).copied().unwrap_or(false),
        }
    }
}

/// A LLaMA, Mistral or Qwen2 decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which family member.
    pub family: LlamaFamily,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP hidden size (SwiGLU).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); `num_attention_heads` when absent.
    pub num_key_value_heads: usize,
    /// Size of one head; `hidden_size / num_attention_heads` when absent.
    pub head_dim: usize,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary base.
    pub rope_theta: f64,
    /// Rotary scaling (`rope_scaling`, or transformers 5's `rope_parameters`), as
    /// [`Op::Rotary`](kpt_core::Op::Rotary) takes it; `None` for the default rotary.
    pub rope_scaling: Option<RopeScaling>,
    /// Trained context length.
    pub max_position_embeddings: usize,
    /// Whether the output projection reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Sliding attention window (Mistral; Qwen2 when `use_sliding_window`), `None`
    /// when no layer uses one.
    pub sliding_window: Option<usize>,
    /// Which layers attend through the sliding window.
    pub sliding_layers: SlidingLayers,
    /// Whether q/k/v projections carry a bias (Qwen2, or `attention_bias`).
    pub attention_bias: bool,
    /// Whether the output projection carries a bias (`attention_bias` of LLaMA).
    pub o_proj_bias: bool,
    /// Whether the MLP projections carry a bias (`mlp_bias`).
    pub mlp_bias: bool,
    /// MLP activation (`hidden_act`).
    pub hidden_act: String,
    /// Special token ids.
    pub special_tokens: SpecialTokens,
}

impl LlamaConfig {
    pub(super) fn parse(f: &Fields<'_>, model_type: &str) -> Result<Self> {
        let family = match model_type {
            "mistral" => LlamaFamily::Mistral,
            "qwen2" => LlamaFamily::Qwen2,
            _ => LlamaFamily::Llama,
        };
        let hidden_size = f.req_usize("hidden_size")?;
        let heads = f.req_usize("num_attention_heads")?;
        let kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                f.divides("num_attention_heads", heads, "hidden_size", hidden_size)?;
                hidden_size / heads
            }
        };
        f.divides(
            "num_key_value_heads",
            kv_heads,
            "num_attention_heads",
            heads,
        )?;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(f.invalid(
                "head_dim",
                format!("{head_dim} must be even and non-zero for rotary embeddings"),
            ));
        }
        let max_position_embeddings = f.opt_usize("max_position_embeddings")?.unwrap_or(2048);
        let explicit_bias = f.opt_bool("attention_bias")?;
        let attention_bias = explicit_bias.unwrap_or(family == LlamaFamily::Qwen2);
        // LLaMA's `attention_bias` covers o_proj too; Qwen2's q/k/v bias does not.
        let o_proj_bias = family != LlamaFamily::Qwen2 && explicit_bias.unwrap_or(false);
        let layers = f.req_usize("num_hidden_layers")?;
        let (sliding_window, sliding_layers) = parse_sliding_window(f, family, layers)?;
        let cfg = Self {
            family,
            vocab_size: f.req_usize("vocab_size")?,
            hidden_size,
            intermediate_size: f.req_usize("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: rope_theta(f)?,
            rope_scaling: parse_rope_scaling(f, max_position_embeddings)?,
            max_position_embeddings,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            sliding_window,
            sliding_layers,
            attention_bias,
            o_proj_bias,
            mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
            hidden_act: f.opt_str("hidden_act")?.unwrap_or_else(|| "silu".into()),
            special_tokens: SpecialTokens::parse(f)?,
        };
        for (name, v) in [
            ("vocab_size", cfg.vocab_size),
            ("hidden_size", cfg.hidden_size),
            ("intermediate_size", cfg.intermediate_size),
            ("num_hidden_layers", cfg.num_hidden_layers),
        ] {
            f.positive(name, v)?;
        }
        // Finite: `opt_f64` rejects NaN and infinities.
        if cfg.rope_theta <= 0.0 {
            return Err(f.invalid("rope_theta", format!("{} must be > 0", cfg.rope_theta)));
        }
        // Rotating part of each head (Phi, StableLM) is not what Op::Rotary computes.
        if let Some(p) = f.opt_f64("partial_rotary_factor")? {
            if p != 1.0 {
                return Err(f.invalid(
                    "partial_rotary_factor",
                    format!("{p}: kpt's rotary op rotates whole heads (1.0 only)"),
                ));
            }
        }
        if let Some(s) = &cfg.rope_scaling {
            // The op carries theta as f32; check what the kernels will compute with.
            s.validate(cfg.head_dim, f64::from(cfg.rope_theta as f32))
                .map_err(|e| f.invalid(rope_field(f), e.to_string()))?;
        }
        Ok(cfg)
    }

    /// Width of the key/value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The attention window of layer `layer`, `None` for full attention.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding_layers.contains(layer))
    }

    /// Width of the query projection.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
}

/// The window and which layers use it: `layer_types` when given, else every layer for
/// Mistral and layers `max_window_layers..` for Qwen2 with `use_sliding_window` (as
/// Hugging Face's configs derive them); LLaMA has none.
fn parse_sliding_window(
    f: &Fields<'_>,
    family: LlamaFamily,
    layers: usize,
) -> Result<(Option<usize>, SlidingLayers)> {
    let window = match family {
        LlamaFamily::Llama => None,
        LlamaFamily::Mistral => f.opt_usize("sliding_window")?,
        LlamaFamily::Qwen2 if f.opt_bool("use_sliding_window")?.unwrap_or(false) => {
            f.opt_usize("sliding_window")?
        }
        LlamaFamily::Qwen2 => None,
    };
    if window == Some(0) {
        return Err(f.invalid("sliding_window", "must be at least 1"));
    }
    let sliding = match f.get("layer_types") {
        Some(Value::Array(types)) => {
            if types.len() != layers {
                return Err(f.invalid(
                    "layer_types",
                    format!("{} entries for {layers} layers", types.len()),
                ));
            }
            let each = types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => Err(f.invalid(
                        "layer_types",
                        format!("{t} is neither \"full_attention\" nor \"sliding_attention\""),
                    )),
                })
                .collect::<Result<Vec<bool>>>()?;
            if window.is_none() && each.iter().any(|&s| s) {
                return Err(f.invalid(
                    "layer_types",
                    "names sliding_attention layers but no sliding_window is set",
                ));
            }
            SlidingLayers::Each(each)
        }
        Some(v) => return Err(f.invalid("layer_types", format!("expected a list, got {v}"))),
        // Qwen2Config's default.
        None if family == LlamaFamily::Qwen2 => {
            SlidingLayers::From(f.opt_usize("max_window_layers")?.unwrap_or(28))
        }
        None => SlidingLayers::All,
    };
    let any = match &sliding {
        SlidingLayers::All => layers > 0,
        SlidingLayers::From(first) => *first < layers,
        SlidingLayers::Each(each) => each.iter().any(|&s| s),
    };
    Ok((window.filter(|_| any), sliding))
}

/// Where the rotary parameters are: `rope_scaling` (transformers 4), else
/// `rope_parameters` (transformers 5, which also holds `rope_theta`).
fn rope_field(f: &Fields<'_>) -> &'static str {
    if f.get("rope_scaling").is_none() && f.get("rope_parameters").is_some() {
        "rope_parameters"
    } else {
        "rope_scaling"
    }
}

/// `rope_theta`, at the top level or inside `rope_parameters`; 10000 when absent.
fn rope_theta(f: &Fields<'_>) -> Result<f64> {
    if let Some(t) = f.opt_f64("rope_theta")? {
        return Ok(t);
    }
    if let Some(Value::Object(map)) = f.get("rope_parameters") {
        let sub = Fields {
            map,
            path: f.path,
            prefix: "rope_parameters.",
        };
        if let Some(t) = sub.opt_f64("rope_theta")? {
            return Ok(t);
        }
    }
    Ok(10000.0)
}

/// Hugging Face's rotary scaling object mapped to kpt's [`RopeScaling`]: the type from
/// `rope_type` (or the older `type`); `default` is no scaling; `linear`, `dynamic`,
/// `llama3` and `yarn` map to their variants with HF's defaults (YaRN: `factor` from
/// `max_position_embeddings / original_max_position_embeddings` when absent,
/// `original_max_position_embeddings` from the config's when absent, `beta_fast` 32
/// and `beta_slow` 1 when absent or 0, `truncate` true); any other type is
/// [`ModelError::UnsupportedRopeType`].
fn parse_rope_scaling(f: &Fields<'_>, max_pos: usize) -> Result<Option<RopeScaling>> {
    let field = rope_field(f);
    let Some(v) = f.map.get(field) else {
        return Ok(None);
    };
    let Value::Object(map) = v else {
        if v.is_null() {
            return Ok(None);
        }
        return Err(f.invalid(field, "must be an object or null"));
    };
    let sub = Fields {
        map,
        path: f.path,
        prefix: if field == "rope_scaling" {
            "rope_scaling."
        } else {
            "rope_parameters."
        },
    };
    // HF accepts `rope_type` (new) or `type` (old).
    let kind = match sub.opt_str("rope_type")? {
        Some(k) => k,
        None => sub.opt_str("type")?.unwrap_or_else(|| "default".into()),
    };
    let check_factor = |x: f64| -> Result<f64> {
        if x >= 1.0 {
            Ok(x)
        } else {
            Err(sub.invalid("factor", format!("{x} must be >= 1")))
        }
    };
    let factor = || check_factor(sub.req_f64("factor")?);
    let original = || -> Result<usize> {
        let v = sub
            .opt_usize("original_max_position_embeddings")?
            .unwrap_or(max_pos);
        sub.positive("original_max_position_embeddings", v)?;
        Ok(v)
    };
    // Python's `x or default`: absent, null and 0 take the default.
    let or_default = |name: &str, default: f64| -> Result<f64> {
        Ok(sub.opt_f64(name)?.filter(|&x| x != 0.0).unwrap_or(default))
    };
    Ok(match kind.as_str() {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "dynamic" => {
            f.positive("max_position_embeddings", max_pos)?;
            Some(RopeScaling::Dynamic {
                factor: factor()?,
                max_position_embeddings: max_pos,
            })
        }
        "llama3" => Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: sub.req_f64("low_freq_factor")?,
            high_freq_factor: sub.req_f64("high_freq_factor")?,
            original_max_position_embeddings: original()?,
        }),
        "yarn" => {
            let original = original()?;
            let factor = match sub.opt_f64("factor")? {
                Some(x) => check_factor(x)?,
                None => check_factor(max_pos as f64 / original as f64)?,
            };
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: or_default("beta_fast", 32.0)?,
                beta_slow: or_default("beta_slow", 1.0)?,
                attention_factor: sub.opt_f64("attention_factor")?,
                mscale: sub.opt_f64("mscale")?,
                mscale_all_dim: sub.opt_f64("mscale_all_dim")?,
                truncate: sub.opt_bool("truncate")?.unwrap_or(true),
            })
        }
        other => {
            return Err(ModelError::UnsupportedRopeType {
                path: f.path.to_path_buf(),
                rope_type: other.to_string(),
            })
        }
    })
}
