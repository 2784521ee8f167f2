//! Typed model configurations parsed from a Hugging Face `config.json`.
//!
//! Fields are read one by one so that a missing or malformed field is reported by
//! name, with the file it came from. Derived sizes are checked for consistency
//! (heads dividing the hidden size, kv heads dividing heads, even head sizes).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// A parsed `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// LLaMA, Mistral and Qwen2 decoders.
    Llama(LlamaConfig),
    /// GPT-2 decoders.
    Gpt2(Gpt2Config),
    /// BERT encoders.
    Bert(BertConfig),
}

impl ModelConfig {
    /// Reads and parses `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Parses the text of a `config.json`; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let Value::Object(map) = value else {
            return Err(ModelError::Json {
                path: path.to_path_buf(),
                message: "the top level is not an object".into(),
            });
        };
        let f = Fields::new(&map, path);
        let model_type = f.req_str("model_type")?;
        match model_type.as_str() {
            "llama" | "mistral" | "qwen2" => LlamaConfig::parse(&f, &model_type).map(Self::Llama),
            "gpt2" => Gpt2Config::parse(&f).map(Self::Gpt2),
            "bert" => BertConfig::parse(&f).map(Self::Bert),
            _ => Err(ModelError::UnknownArchitecture {
                path: path.to_path_buf(),
                model_type,
            }),
        }
    }

    /// The `model_type` this config was parsed from.
    pub fn model_type(&self) -> &'static str {
        match self {
            ModelConfig::Llama(c) => c.family.model_type(),
            ModelConfig::Gpt2(_) => "gpt2",
            ModelConfig::Bert(_) => "bert",
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.vocab_size,
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Bert(c) => c.vocab_size,
        }
    }

    /// Special token ids given in `config.json`.
    pub fn special_tokens(&self) -> SpecialTokens {
        match self {
            ModelConfig::Llama(c) => c.special_tokens.clone(),
            ModelConfig::Gpt2(c) => c.special_tokens.clone(),
            ModelConfig::Bert(c) => c.special_tokens.clone(),
        }
    }
}

/// Beginning/end-of-sequence token ids (HF allows one eos id or a list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// Every end-of-sequence id.
    pub eos: Vec<u32>,
    /// Padding.
    pub pad: Option<u32>,
}

impl SpecialTokens {
    /// Reads `bos_token_id`, `eos_token_id` (int or list) and `pad_token_id` from `f`.
    pub(crate) fn parse(f: &Fields<'_>) -> Result<Self> {
        Ok(Self {
            bos: f.opt_u32("bos_token_id")?,
            eos: f.u32_or_list("eos_token_id")?,
            pad: f.opt_u32("pad_token_id")?,
        })
    }

    /// Each field of `self`, else the one of `other`.
    pub fn or(self, other: &SpecialTokens) -> SpecialTokens {
        SpecialTokens {
            bos: self.bos.or(other.bos),
            eos: if self.eos.is_empty() {
                other.eos.clone()
            } else {
                self.eos
            },
            pad: self.pad.or(other.pad),
        }
    }
}

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

/// `rope_scaling` of a LLaMA-family config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Dynamic NTK: the base grows once the sequence passes the trained length.
    Dynamic {
        /// Scale factor.
        factor: f64,
    },
    /// LLaMA 3.1: low frequencies divided by `factor`, high ones kept, smooth between.
    Llama3 {
        /// Scale factor.
        factor: f64,
        /// Wavelength bound (as a fraction of the original context) of the scaled band.
        low_freq_factor: f64,
        /// Wavelength bound of the unscaled band.
        high_freq_factor: f64,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
    },
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
    /// Rotary scaling; `None` for the default (unscaled) rotary.
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
    fn parse(f: &Fields<'_>, model_type: &str) -> Result<Self> {
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
            rope_theta: f.opt_f64("rope_theta")?.unwrap_or(10000.0),
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

fn parse_rope_scaling(f: &Fields<'_>, max_pos: usize) -> Result<Option<RopeScaling>> {
    let Some(v) = f.map.get("rope_scaling") else {
        return Ok(None);
    };
    let Value::Object(map) = v else {
        if v.is_null() {
            return Ok(None);
        }
        return Err(f.invalid("rope_scaling", "must be an object or null"));
    };
    let sub = Fields {
        map,
        path: f.path,
        prefix: "rope_scaling.",
    };
    // HF accepts `rope_type` (new) or `type` (old).
    let kind = match sub.opt_str("rope_type")? {
        Some(k) => k,
        None => sub.opt_str("type")?.unwrap_or_else(|| "default".into()),
    };
    let factor = || -> Result<f64> {
        let x = sub.req_f64("factor")?;
        if x >= 1.0 {
            Ok(x)
        } else {
            Err(sub.invalid("factor", format!("{x} must be >= 1")))
        }
    };
    Ok(match kind.as_str() {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "dynamic" => Some(RopeScaling::Dynamic { factor: factor()? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: sub.req_f64("low_freq_factor")?,
            high_freq_factor: sub.req_f64("high_freq_factor")?,
            original_max_position_embeddings: sub
                .opt_usize("original_max_position_embeddings")?
                .unwrap_or(max_pos),
        }),
        other => {
            return Err(sub.invalid(
                "rope_type",
                format!("`{other}` is not supported; supported: default, linear, dynamic, llama3"),
            ))
        }
    })
}

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
    fn parse(f: &Fields<'_>) -> Result<Self> {
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
    fn parse(f: &Fields<'_>) -> Result<Self> {
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

/// Typed access to the fields of one JSON object, with errors naming file and field.
pub(crate) struct Fields<'a> {
    pub(crate) map: &'a Map<String, Value>,
    pub(crate) path: &'a Path,
    pub(crate) prefix: &'static str,
}

impl<'a> Fields<'a> {
    /// The fields of a top-level object.
    pub(crate) fn new(map: &'a Map<String, Value>, path: &'a Path) -> Self {
        Self {
            map,
            path,
            prefix: "",
        }
    }

    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    fn invalid(&self, field: &str, message: impl Into<String>) -> ModelError {
        ModelError::invalid(self.path, &self.name(field), message)
    }

    fn missing(&self, field: &str) -> ModelError {
        ModelError::MissingField {
            path: PathBuf::from(self.path),
            field: self.name(field),
        }
    }

    /// The value, `None` when absent or null.
    pub(crate) fn get(&self, field: &str) -> Option<&'a Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    pub(crate) fn opt_str(&self, field: &str) -> Result<Option<String>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.invalid(field, format!("expected a string, got {v}"))),
        }
    }

    fn req_str(&self, field: &str) -> Result<String> {
        self.opt_str(field)?.ok_or_else(|| self.missing(field))
    }

    pub(crate) fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.invalid(field, format!("expected a non-negative integer, got {v}"))
                }),
        }
    }

    fn req_usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?.ok_or_else(|| self.missing(field))
    }

    pub(crate) fn opt_u32(&self, field: &str) -> Result<Option<u32>> {
        match self.opt_usize(field)? {
            None => Ok(None),
            Some(x) => u32::try_from(x)
                .map(Some)
                .map_err(|_| self.invalid(field, format!("{x} does not fit a token id"))),
        }
    }

    /// An id or a list of ids; empty when absent.
    pub(crate) fn u32_or_list(&self, field: &str) -> Result<Vec<u32>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| self.invalid(field, format!("{v} is not a token id")))
                })
                .collect(),
            Some(_) => Ok(self.opt_u32(field)?.into_iter().collect()),
        }
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| self.invalid(field, format!("expected a number, got {v}"))),
        }
    }

    fn req_f64(&self, field: &str) -> Result<f64> {
        self.opt_f64(field)?.ok_or_else(|| self.missing(field))
    }

    pub(crate) fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(field, format!("expected true or false, got {v}"))),
        }
    }

    fn positive(&self, field: &str, v: usize) -> Result<()> {
        if v == 0 {
            Err(self.invalid(field, "must be at least 1"))
        } else {
            Ok(())
        }
    }

    /// Checks that `part` (a count of pieces) is non-zero and divides `whole`.
    fn divides(&self, part_name: &str, part: usize, whole_name: &str, whole: usize) -> Result<()> {
        if part == 0 || !whole.is_multiple_of(part) {
            return Err(self.invalid(
                part_name,
                format!("{part} does not divide {whole_name} = {whole}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(json, Path::new("dir/config.json"))
    }

    const LLAMA: &str = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "bos_token_id": 1, "eos_token_id": [2, 3], "tie_word_embeddings": true}"#;

    #[test]
    fn llama_fields_and_defaults() {
        let ModelConfig::Llama(c) = parse(LLAMA).unwrap() else {
            panic!("not llama")
        };
        assert_eq!(c.family, LlamaFamily::Llama);
        assert_eq!((c.head_dim, c.kv_dim(), c.q_dim()), (16, 32, 64));
        assert_eq!(c.rope_theta, 500000.0);
        assert!(c.tie_word_embeddings && !c.attention_bias && c.sliding_window.is_none());
        assert_eq!(c.special_tokens.bos, Some(1));
        assert_eq!(c.special_tokens.eos, vec![2, 3]);
        assert_eq!(c.rope_scaling, None);
    }

    #[test]
    fn family_specifics() {
        let mistral = LLAMA
            .replace("\"llama\"", "\"mistral\"")
            .replace("\"tie_word_embeddings\": true", "\"sliding_window\": 4096");
        let ModelConfig::Llama(c) = parse(&mistral).unwrap() else {
            panic!()
        };
        assert_eq!(
            (c.family, c.sliding_window),
            (LlamaFamily::Mistral, Some(4096))
        );
        let qwen = LLAMA.replace("\"llama\"", "\"qwen2\"").replace(
            "\"tie_word_embeddings\": true",
            "\"sliding_window\": 4096, \"use_sliding_window\": false",
        );
        let ModelConfig::Llama(c) = parse(&qwen).unwrap() else {
            panic!()
        };
        assert!(c.attention_bias && !c.o_proj_bias && c.sliding_window.is_none());
        assert_eq!(parse(&qwen).unwrap().model_type(), "qwen2");
        let windowed = |extra: &str| {
            let json = LLAMA.replace("\"llama\"", "\"qwen2\"").replace(
                "\"tie_word_embeddings\": true",
                &format!("\"sliding_window\": 8, \"use_sliding_window\": true{extra}"),
            );
            parse(&json).map(|c| match c {
                ModelConfig::Llama(c) => (c.window(0), c.window(1)),
                _ => panic!(),
            })
        };
        // Qwen2Config's default max_window_layers (28) leaves both layers full.
        assert_eq!(windowed("").unwrap(), (None, None));
        assert_eq!(
            windowed(", \"max_window_layers\": 1").unwrap(),
            (None, Some(8))
        );
        assert_eq!(
            windowed(", \"layer_types\": [\"sliding_attention\", \"full_attention\"]").unwrap(),
            (Some(8), None)
        );
        let err = windowed(", \"layer_types\": [\"sliding_attention\"]").unwrap_err();
        assert!(err.to_string().contains("1 entries for 2 layers"), "{err}");
    }

    #[test]
    fn rope_scaling_variants() {
        let with = |s: &str| {
            let ModelConfig::Llama(c) =
                parse(&LLAMA.replace("}", &format!(", \"rope_scaling\": {s}}}"))).unwrap()
            else {
                panic!()
            };
            c.rope_scaling
        };
        assert_eq!(with("null"), None);
        assert_eq!(with(r#"{"rope_type": "default"}"#), None);
        assert_eq!(
            with(r#"{"type": "linear", "factor": 2.0}"#),
            Some(RopeScaling::Linear { factor: 2.0 })
        );
        assert_eq!(
            with(r#"{"type": "dynamic", "factor": 4}"#),
            Some(RopeScaling::Dynamic { factor: 4.0 })
        );
        assert_eq!(
            with(
                r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#
            ),
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            })
        );
        let err = parse(&LLAMA.replace("}", r#", "rope_scaling": {"type": "yarn", "factor": 2}}"#))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rope_scaling.rope_type") && err.contains("yarn"),
            "{err}"
        );
        let err = parse(&LLAMA.replace("}", r#", "rope_scaling": {"type": "linear"}}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `rope_scaling.factor`"), "{err}");
    }

    #[test]
    fn gpt2_and_bert() {
        let g = parse(
            r#"{"model_type": "gpt2", "vocab_size": 50, "n_embd": 32, "n_layer": 2,
            "n_head": 4, "n_positions": 64, "n_inner": null, "activation_function": "gelu_new",
            "eos_token_id": 0}"#,
        )
        .unwrap();
        let ModelConfig::Gpt2(c) = &g else { panic!() };
        assert_eq!(
            (c.n_inner, c.head_dim(), c.layer_norm_epsilon),
            (128, 8, 1e-5)
        );
        assert_eq!(g.special_tokens().eos, vec![0]);
        let ModelConfig::Bert(b) = parse(
            r#"{"model_type": "bert", "vocab_size": 50, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
            "max_position_embeddings": 40, "hidden_act": "gelu"}"#,
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (b.type_vocab_size, b.layer_norm_eps, b.head_dim()),
            (2, 1e-12, 8)
        );
    }

    #[test]
    fn errors_name_the_field_and_file() {
        let err = parse(r#"{"model_type": "mamba"}"#).unwrap_err().to_string();
        assert!(
            err.contains("dir/config.json") && err.contains("`mamba`"),
            "{err}"
        );
        let err = parse(&LLAMA.replace("\"hidden_size\": 64,", ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `hidden_size`"), "{err}");
        let err = parse(&LLAMA.replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 5"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("num_attention_heads") && err.contains("hidden_size = 64"),
            "{err}"
        );
        let err = parse(&LLAMA.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
        let err = parse(&LLAMA.replace("\"vocab_size\": 100", "\"vocab_size\": \"big\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`vocab_size`") && err.contains("integer"),
            "{err}"
        );
        assert!(matches!(parse("[1, 2]"), Err(ModelError::Json { .. })));
        assert!(matches!(parse("{not json"), Err(ModelError::Json { .. })));
        assert!(matches!(parse("{}"), Err(ModelError::MissingField { .. })));
    }
}
