//! Typed model configurations parsed from a Hugging Face `config.json`.
//!
//! Fields are read one by one so that a missing or malformed field is reported by
//! name, with the file it came from. Derived sizes are checked for consistency
//! (heads dividing the hidden size, kv heads dividing heads, even head sizes).

mod bert;
mod fields;
mod gpt2;
mod llama;

use std::path::Path;

use serde_json::Value;

pub use bert::BertConfig;
pub(crate) use fields::Fields;
pub use gpt2::Gpt2Config;
pub use kpt_core::graph::RopeScaling;
pub use llama::{LlamaConfig, LlamaFamily, SlidingLayers};

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
            Some(RopeScaling::Dynamic {
                factor: 4.0,
                max_position_embeddings: 2048
            })
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
        // Qwen2.5's YaRN entry: HF's defaults fill the rest.
        assert_eq!(
            with(r#"{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}"#),
            Some(RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 2048,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
                truncate: true,
            })
        );
        // No factor: the ratio of the context lengths (max_position_embeddings 2048); beta 0 takes the default
        // (Python's `or`); DeepSeek's mscale fields and `truncate` are kept.
        assert_eq!(
            with(
                r#"{"rope_type": "yarn", "original_max_position_embeddings": 512,
                "beta_fast": 0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                "truncate": false}"#
            ),
            Some(RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 512,
                beta_fast: 32.0,
                beta_slow: 2.0,
                attention_factor: None,
                mscale: Some(0.707),
                mscale_all_dim: Some(0.707),
                truncate: false,
            })
        );
        let err = parse(&LLAMA.replace(
            "}",
            r#", "rope_scaling": {"type": "longrope", "factor": 2}}"#,
        ))
        .unwrap_err();
        assert!(
            matches!(&err, ModelError::UnsupportedRopeType { rope_type, .. } if rope_type == "longrope"),
            "{err:?}"
        );
        assert!(err.to_string().contains("`longrope`"), "{err}");
        let err = parse(&LLAMA.replace("}", r#", "partial_rotary_factor": 0.5}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("partial_rotary_factor"), "{err}");
        // Parameters kpt-core rejects name the field.
        let err = parse(&LLAMA.replace(
            "}",
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}"#,
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("rope_scaling") && err.contains("low_freq_factor"),
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
