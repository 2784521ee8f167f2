//! Small checkpoints with random weights, written in the real formats: `config.json`,
//! `model.safetensors` (or shards with `model.safetensors.index.json`) and a
//! byte-level BPE `tokenizer.json` trained on a fixed text. Tests and demos use them
//! to exercise the whole loading path without downloading a model.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use kpt_core::rand::SplitMix64;
use kpt_core::DType;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::{INDEX_FILE, SINGLE_FILE};
use crate::CONFIG_FILE;

/// The special tokens of [`write_tokenizer`]'s vocabulary, ids 0, 1 and 2.
pub const SPECIAL_TOKENS: [&str; 3] = ["<s>", "</s>", "<pad>"];

/// How to write the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    /// Seed of the random weights.
    pub seed: u64,
    /// Stored dtype: f32, f16 or bf16.
    pub dtype: DType,
    /// Number of safetensors files; more than one writes an index.
    pub shards: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            seed: 1,
            dtype: DType::F32,
            shards: 1,
        }
    }
}

impl WriteOptions {
    /// The default options with weights from `seed`.
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            ..Self::default()
        }
    }
}

/// Names and shapes of every tensor that kpt loads for `config`, in HF's names
/// and layouts (GPT-2's `Conv1D` weights are `[in, out]`).
pub fn expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let mut t: Vec<(String, Vec<usize>)> = Vec::new();
    let mut add = |name: String, shape: &[usize]| t.push((name, shape.to_vec()));
    match config {
        ModelConfig::Llama(c) => {
            let (d, f) = (c.hidden_size, c.intermediate_size);
            add("model.embed_tokens.weight".into(), &[c.vocab_size, d]);
            for i in 0..c.num_hidden_layers {
                let p = format!("model.layers.{i}");
                add(format!("{p}.input_layernorm.weight"), &[d]);
                add(format!("{p}.post_attention_layernorm.weight"), &[d]);
                for (name, out, inp, bias) in [
                    ("self_attn.q_proj", c.q_dim(), d, c.attention_bias),
                    ("self_attn.k_proj", c.kv_dim(), d, c.attention_bias),
                    ("self_attn.v_proj", c.kv_dim(), d, c.attention_bias),
                    ("self_attn.o_proj", d, c.q_dim(), c.o_proj_bias),
                    ("mlp.gate_proj", f, d, c.mlp_bias),
                    ("mlp.up_proj", f, d, c.mlp_bias),
                    ("mlp.down_proj", d, f, c.mlp_bias),
                ] {
                    add(format!("{p}.{name}.weight"), &[out, inp]);
                    if bias {
                        add(format!("{p}.{name}.bias"), &[out]);
                    }
                }
            }
            add("model.norm.weight".into(), &[d]);
            if !c.tie_word_embeddings {
                add("lm_head.weight".into(), &[c.vocab_size, d]);
            }
        }
        ModelConfig::Gpt2(c) => {
            let (d, f) = (c.n_embd, c.n_inner);
            add("wte.weight".into(), &[c.vocab_size, d]);
            add("wpe.weight".into(), &[c.n_positions, d]);
            for i in 0..c.n_layer {
                let p = format!("h.{i}");
                for (name, shape) in [
                    ("ln_1.weight", vec![d]),
                    ("ln_1.bias", vec![d]),
                    ("attn.c_attn.weight", vec![d, 3 * d]),
                    ("attn.c_attn.bias", vec![3 * d]),
                    ("attn.c_proj.weight", vec![d, d]),
                    ("attn.c_proj.bias", vec![d]),
                    ("ln_2.weight", vec![d]),
                    ("ln_2.bias", vec![d]),
                    ("mlp.c_fc.weight", vec![d, f]),
                    ("mlp.c_fc.bias", vec![f]),
                    ("mlp.c_proj.weight", vec![f, d]),
                    ("mlp.c_proj.bias", vec![d]),
                ] {
                    add(format!("{p}.{name}"), &shape);
                }
            }
            add("ln_f.weight".into(), &[d]);
            add("ln_f.bias".into(), &[d]);
        }
        ModelConfig::Bert(c) => {
            let (d, f) = (c.hidden_size, c.intermediate_size);
            let e = "embeddings";
            add(format!("{e}.word_embeddings.weight"), &[c.vocab_size, d]);
            add(
                format!("{e}.position_embeddings.weight"),
                &[c.max_position_embeddings, d],
            );
            add(
                format!("{e}.token_type_embeddings.weight"),
                &[c.type_vocab_size, d],
            );
            add(format!("{e}.LayerNorm.weight"), &[d]);
            add(format!("{e}.LayerNorm.bias"), &[d]);
            for i in 0..c.num_hidden_layers {
                let p = format!("encoder.layer.{i}");
                for (name, shape) in [
                    ("attention.self.query.weight", vec![d, d]),
                    ("attention.self.query.bias", vec![d]),
                    ("attention.self.key.weight", vec![d, d]),
                    ("attention.self.key.bias", vec![d]),
                    ("attention.self.value.weight", vec![d, d]),
                    ("attention.self.value.bias", vec![d]),
                    ("attention.output.dense.weight", vec![d, d]),
                    ("attention.output.dense.bias", vec![d]),
                    ("attention.output.LayerNorm.weight", vec![d]),
                    ("attention.output.LayerNorm.bias", vec![d]),
                    ("intermediate.dense.weight", vec![f, d]),
                    ("intermediate.dense.bias", vec![f]),
                    ("output.dense.weight", vec![d, f]),
                    ("output.dense.bias", vec![d]),
                    ("output.LayerNorm.weight", vec![d]),
                    ("output.LayerNorm.bias", vec![d]),
                ] {
                    add(format!("{p}.{name}"), &shape);
                }
            }
        }
    }
    t
}

/// Random values for tensor `name`: norm scales near 1, biases and position tables
/// small, matrices uniform in `±sqrt(3 / fan_in)` (unit-variance outputs).
fn random_values(name: &str, shape: &[usize], rng: &mut SplitMix64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let is_norm = name.contains("norm") || name.contains("LayerNorm") || name.contains("ln_");
    let (lo, hi) = if is_norm && name.ends_with(".weight") {
        (0.8, 1.2)
    } else if name.ends_with(".bias") {
        (-0.1, 0.1)
    } else if shape.len() == 2 {
        let fan_in = if name.contains("embed") || name.starts_with("wte") || name.starts_with("wpe")
        {
            1
        } else {
            shape[1]
        };
        let b = (3.0 / fan_in as f32).sqrt();
        (-b, b)
    } else {
        (-1.0, 1.0)
    };
    rng.vec(n, lo, hi)
}

fn encode(values: &[f32], dtype: DType) -> Result<(Dtype, Vec<u8>)> {
    Ok(match dtype {
        DType::F32 => (
            Dtype::F32,
            values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        DType::F16 => (
            Dtype::F16,
            values
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        DType::BF16 => (
            Dtype::BF16,
            values
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        other => {
            return Err(ModelError::Unsupported(format!(
                "writing {other} weights; use f32, f16 or bf16"
            )))
        }
    })
}

/// Writes `config` as `dir/config.json` and random weights for every tensor of
/// [`expected_tensors`]; returns the parsed config.
pub fn write_checkpoint(dir: &Path, config: &Value, opts: WriteOptions) -> Result<ModelConfig> {
    let config_path = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(config).map_err(|e| ModelError::Json {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    std::fs::write(&config_path, text).map_err(|e| ModelError::io(&config_path, e))?;
    let parsed = ModelConfig::from_file(&config_path)?;
    let mut rng = SplitMix64::new(opts.seed);
    let tensors = expected_tensors(&parsed)
        .into_iter()
        .map(|(name, shape)| {
            let values = random_values(&name, &shape, &mut rng);
            let (dtype, bytes) = encode(&values, opts.dtype)?;
            Ok((name, shape, dtype, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    write_safetensors(dir, &tensors, opts.shards.max(1))?;
    Ok(parsed)
}

type RawTensor = (String, Vec<usize>, Dtype, Vec<u8>);

fn write_safetensors(dir: &Path, tensors: &[RawTensor], shards: usize) -> Result<()> {
    let per_shard = tensors.len().div_ceil(shards).max(1);
    let chunks: Vec<&[RawTensor]> = tensors.chunks(per_shard).collect();
    let mut weight_map = BTreeMap::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let file = if shards == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, chunks.len())
        };
        let path = dir.join(&file);
        let views = chunk
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                let view = TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| {
                    ModelError::Safetensors {
                        path: path.clone(),
                        message: e.to_string(),
                    }
                })?;
                weight_map.insert(name.clone(), Value::String(file.clone()));
                Ok((name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize_to_file(views, None, &path).map_err(|e| {
            ModelError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            }
        })?;
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let path = dir.join(INDEX_FILE);
        std::fs::write(&path, index.to_string()).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}

/// The text [`write_tokenizer`] trains on.
const CORPUS: &[&str] = &[
    "kpt makes deep learning models run fast on the hardware you have.",
    "The manager optimizes a graph, the validator proves it against a reference.",
    "A kernel registry picks the best kernel for each op on each device.",
    "Hello world! Tokens, numbers 0123456789 and punctuation: (a, b); c.",
    "the quick brown fox jumps over the lazy dog while the cat sleeps",
];

/// Trains a byte-level BPE tokenizer of at most `vocab_size` tokens (GPT-2 style: every
/// byte is a token, so any text encodes) on a fixed text, with `<s>`, `</s>` and
/// `<pad>` as ids 0-2 and `<s>` prepended when special tokens are added; writes it to
/// `dir/tokenizer.json` and returns its vocabulary size.
pub fn write_tokenizer(dir: &Path, vocab_size: usize) -> Result<usize> {
    let path = dir.join(crate::tokenizer::TOKENIZER_FILE);
    let err = |e: tokenizers::Error| ModelError::Tokenizer {
        path: path.clone(),
        message: e.to_string(),
    };
    let mut tok = tokenizers::Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .show_progress(false)
        .special_tokens(
            SPECIAL_TOKENS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tok.train(&mut trainer, CORPUS.iter().copied())
        .map_err(err)?;
    let bos = tok
        .token_to_id(SPECIAL_TOKENS[0])
        .ok_or_else(|| ModelError::Tokenizer {
            path: path.clone(),
            message: "training dropped <s>".into(),
        })?;
    let post = TemplateProcessing::builder()
        .try_single(format!("{} $A", SPECIAL_TOKENS[0]))
        .map_err(|e| ModelError::Tokenizer {
            path: path.clone(),
            message: e,
        })?
        .special_tokens(vec![(SPECIAL_TOKENS[0], bos)])
        .build()
        .map_err(|e| ModelError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
    tok.with_post_processor(Some(post));
    tok.save(&path, false).map_err(err)?;
    Ok(tok.get_vocab_size(true))
}
