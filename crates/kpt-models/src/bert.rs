//! BERT encoders lowered to kpt's graph, and mean pooling for sentence embeddings.
//!
//! As in Hugging Face's `modeling_bert.py`: word + position + token-type embeddings and
//! a layer norm, then post-LN blocks `h = ln(h + attn_out(attn(h)))`,
//! `h = ln(h + out(act(intermediate(h))))` with bidirectional attention. The graph
//! encodes one sequence ([`Bert::graph`]) or several packed without padding through
//! variable-length attention ([`Bert::graph_packed`]); pooling runs on the host output
//! ([`mean_pool`], [`mean_pool_packed`]), since the op catalog has no reduction over
//! the sequence.

use kpt_core::graph::{Activation, AttentionParams, Graph, Op};
use kpt_core::{DType, Tensor};

use crate::config::BertConfig;
use crate::error::{ModelError, Result};
use crate::lower::{activation, check_compute_dtype, NormParams, Projection};
use crate::weights::Weights;

/// One encoder layer's parameters.
#[derive(Debug, Clone)]
pub struct BertLayer {
    /// Query projection.
    pub query: Projection,
    /// Key projection.
    pub key: Projection,
    /// Value projection.
    pub value: Projection,
    /// Attention output projection.
    pub attention_output: Projection,
    /// Layer norm after the attention residual.
    pub attention_norm: NormParams,
    /// MLP up projection.
    pub intermediate: Projection,
    /// MLP down projection.
    pub output: Projection,
    /// Layer norm after the MLP residual.
    pub output_norm: NormParams,
}

/// A BERT encoder with its weights loaded in the compute dtype.
#[derive(Debug, Clone)]
pub struct Bert {
    /// The configuration.
    pub config: BertConfig,
    /// Dtype of every parameter and activation of the built graph.
    pub dtype: DType,
    /// Word embedding `[vocab, hidden]`.
    pub word_embeddings: Tensor,
    /// Position embedding `[max_position_embeddings, hidden]`.
    pub position_embeddings: Tensor,
    /// Token-type embedding `[type_vocab_size, hidden]`.
    pub token_type_embeddings: Tensor,
    /// Layer norm of the summed embeddings.
    pub embeddings_norm: NormParams,
    /// Encoder layers.
    pub layers: Vec<BertLayer>,
    act: Activation,
}

impl Bert {
    /// Loads and shape-checks every weight of `config` from `weights`, converted to
    /// `dtype`. Tensor names may carry the `bert.` prefix of task heads' state dicts.
    pub fn load(config: &BertConfig, weights: &Weights, dtype: DType) -> Result<Self> {
        check_compute_dtype(dtype)?;
        let act = activation("hidden_act", &config.hidden_act)?;
        let pre = if weights.contains("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let (d, f) = (config.hidden_size, config.intermediate_size);
        let e = format!("{pre}embeddings");
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("{pre}encoder.layer.{i}");
            let proj = |name: &str, out: usize, inp: usize| {
                Projection::load(weights, &format!("{p}.{name}"), out, inp, true, dtype)
            };
            let norm = |name: &str| load_norm(weights, &format!("{p}.{name}"), d, dtype);
            layers.push(BertLayer {
                query: proj("attention.self.query", d, d)?,
                key: proj("attention.self.key", d, d)?,
                value: proj("attention.self.value", d, d)?,
                attention_output: proj("attention.output.dense", d, d)?,
                attention_norm: norm("attention.output.LayerNorm")?,
                intermediate: proj("intermediate.dense", f, d)?,
                output: proj("output.dense", d, f)?,
                output_norm: norm("output.LayerNorm")?,
            });
        }
        Ok(Self {
            config: config.clone(),
            dtype,
            word_embeddings: weights.load(
                &format!("{e}.word_embeddings.weight"),
                &[config.vocab_size, d],
                dtype,
            )?,
            position_embeddings: weights.load(
                &format!("{e}.position_embeddings.weight"),
                &[config.max_position_embeddings, d],
                dtype,
            )?,
            token_type_embeddings: weights.load(
                &format!("{e}.token_type_embeddings.weight"),
                &[config.type_vocab_size, d],
                dtype,
            )?,
            embeddings_norm: load_norm(weights, &format!("{e}.LayerNorm"), d, dtype)?,
            layers,
            act,
        })
    }

    /// Builds the encoder graph of one sequence. Inputs: ids `[1, S]`, token type ids
    /// `[1, S]` and positions `[S]` (all i64; positions below `max_position_embeddings`).
    /// Output: the last hidden state `[1, S, hidden]`.
    pub fn graph(&self, seq: usize) -> Result<Graph> {
        self.build(seq, None)
    }

    /// Builds the encoder graph of several sequences packed without padding into one
    /// row of `total` tokens (variable-length attention: each token attends only within
    /// its sequence). Inputs: those of [`Bert::graph`] over the packed tokens, positions
    /// restarting at 0 for each sequence, then `cu_seqlens` `[sequences + 1]` (i64).
    /// [`pack`] builds them; [`mean_pool_packed`] pools the output per sequence.
    pub fn graph_packed(&self, total: usize, sequences: usize) -> Result<Graph> {
        self.build(total, Some(sequences))
    }

    fn build(&self, seq: usize, packed: Option<usize>) -> Result<Graph> {
        let c = &self.config;
        let mut g = Graph::new();
        let ids = g.input("ids", DType::I64, &[1, seq]);
        let types = g.input("token_type_ids", DType::I64, &[1, seq]);
        let pos = g.input("positions", DType::I64, &[seq]);
        let cu = packed.map(|n| g.input("cu_seqlens", DType::I64, &[n + 1]));
        let word = g.param("word_embeddings.weight", self.word_embeddings.clone());
        let typ = g.param(
            "token_type_embeddings.weight",
            self.token_type_embeddings.clone(),
        );
        let posw = g.param(
            "position_embeddings.weight",
            self.position_embeddings.clone(),
        );
        let w = g.op("word_embeddings", Op::Embedding, &[ids, word])?;
        let t = g.op("token_type_embeddings", Op::Embedding, &[types, typ])?;
        let p = g.op("position_embeddings", Op::Embedding, &[pos, posw])?;
        let h = g.op("embeddings.sum_types", Op::Add, &[w, t])?;
        let h = g.op("embeddings.sum_positions", Op::Add, &[h, p])?;
        let eps = c.layer_norm_eps;
        let mut h = self
            .embeddings_norm
            .apply(&mut g, "embeddings.LayerNorm", h, eps)?;
        let attn = AttentionParams {
            varlen: cu.is_some(),
            ..AttentionParams::new(
                c.num_attention_heads,
                c.num_attention_heads,
                c.head_dim(),
                false,
            )
        };
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("encoder.layer.{i}");
            let q = l
                .query
                .apply(&mut g, &format!("{p}.attention.self.query"), h)?;
            let k = l.key.apply(&mut g, &format!("{p}.attention.self.key"), h)?;
            let v = l
                .value
                .apply(&mut g, &format!("{p}.attention.self.value"), h)?;
            let mut attn_inputs = vec![q, k, v];
            attn_inputs.extend(cu.iter().flat_map(|&c| [c, c]));
            let a = g.op(
                format!("{p}.attention.self"),
                Op::Attention(attn),
                &attn_inputs,
            )?;
            let o = l
                .attention_output
                .apply(&mut g, &format!("{p}.attention.output.dense"), a)?;
            let r = g.op(format!("{p}.attention.residual"), Op::Add, &[o, h])?;
            h = l.attention_norm.apply(
                &mut g,
                &format!("{p}.attention.output.LayerNorm"),
                r,
                eps,
            )?;
            let m = l
                .intermediate
                .apply(&mut g, &format!("{p}.intermediate.dense"), h)?;
            let m = g.op(
                format!("{p}.intermediate.act"),
                Op::Activation { act: self.act },
                &[m],
            )?;
            let m = l.output.apply(&mut g, &format!("{p}.output.dense"), m)?;
            let r = g.op(format!("{p}.output.residual"), Op::Add, &[m, h])?;
            h = l
                .output_norm
                .apply(&mut g, &format!("{p}.output.LayerNorm"), r, eps)?;
        }
        g.output(h)?;
        Ok(g)
    }
}

/// The inputs of [`Bert::graph_packed`] for `sequences`, each token ids with their token
/// type ids (equal lengths): ids, token types, per-sequence positions, `cu_seqlens`.
pub fn pack(sequences: &[(&[i64], &[i64])]) -> Result<Vec<Tensor>> {
    let mut ids = Vec::new();
    let mut types = Vec::new();
    let mut positions = Vec::new();
    let mut cu = vec![0i64];
    for (i, (s, t)) in sequences.iter().enumerate() {
        if s.len() != t.len() || s.is_empty() {
            return Err(ModelError::Core(kpt_core::KptError::InvalidArgument(
                format!(
                    "sequence {i}: {} ids and {} token type ids (must be equal and non-zero)",
                    s.len(),
                    t.len()
                ),
            )));
        }
        ids.extend_from_slice(s);
        types.extend_from_slice(t);
        positions.extend(0..s.len() as i64);
        cu.push(ids.len() as i64);
    }
    let n = ids.len();
    let cu_len = cu.len();
    Ok(vec![
        Tensor::from_vec(ids, &[1, n])?,
        Tensor::from_vec(types, &[1, n])?,
        Tensor::from_vec(positions, &[n])?,
        Tensor::from_vec(cu, &[cu_len])?,
    ])
}

/// Mean pooling of each sequence of a packed output `[1, total, D]`, split by
/// `cu_seqlens` (as given to [`Bert::graph_packed`]).
pub fn mean_pool_packed(hidden: &Tensor, cu_seqlens: &[i64]) -> Result<Vec<Vec<f32>>> {
    let total = hidden.shape().get(1).copied().unwrap_or(0);
    let bad = |msg: String| ModelError::Core(kpt_core::KptError::InvalidArgument(msg));
    if cu_seqlens.first() != Some(&0) || cu_seqlens.last() != Some(&(total as i64)) {
        return Err(bad(format!(
            "cu_seqlens {cu_seqlens:?} must run from 0 to the {total} packed tokens"
        )));
    }
    let &[1, _, d] = hidden.shape() else {
        return Err(bad(format!(
            "hidden states must be [1, total, dim], got {:?}",
            hidden.shape()
        )));
    };
    let values = hidden.to_f64_vec();
    cu_seqlens
        .windows(2)
        .map(|w| {
            if w[1] <= w[0] {
                return Err(bad(format!(
                    "cu_seqlens {cu_seqlens:?} has an empty or decreasing entry"
                )));
            }
            let (start, end) = (w[0] as usize, w[1] as usize);
            let mut sum = vec![0f64; d];
            for row in values[start * d..end * d].chunks(d) {
                for (acc, x) in sum.iter_mut().zip(row) {
                    *acc += x;
                }
            }
            Ok(sum
                .iter()
                .map(|x| (x / (end - start) as f64) as f32)
                .collect())
        })
        .collect()
}

/// A layer norm stored as `weight`/`bias`, or as `gamma`/`beta` (the names of
/// checkpoints converted from the original TensorFlow BERT).
fn load_norm(weights: &Weights, prefix: &str, dim: usize, dtype: DType) -> Result<NormParams> {
    let (w, b) = (format!("{prefix}.gamma"), format!("{prefix}.beta"));
    if !weights.contains(&format!("{prefix}.weight")) && weights.contains(&w) {
        return Ok(NormParams {
            weight: weights.load(&w, &[dim], dtype)?,
            bias: weights.load(&b, &[dim], dtype)?,
        });
    }
    NormParams::load(weights, prefix, dim, dtype)
}

/// Mean of the hidden states `[1, S, D]` over the positions whose `mask` entry is
/// non-zero (every position when `mask` is `None`): sentence-transformers' mean pooling.
pub fn mean_pool(hidden: &Tensor, mask: Option<&[u32]>) -> Result<Vec<f32>> {
    let shape = hidden.shape();
    let &[1, s, d] = shape else {
        return Err(ModelError::Core(kpt_core::KptError::shape(
            "mean_pool",
            format!("hidden states must be [1, seq, dim], got {shape:?}"),
        )));
    };
    if let Some(m) = mask {
        if m.len() != s {
            return Err(ModelError::Core(kpt_core::KptError::shape(
                "mean_pool",
                format!("mask has {} entries for {s} positions", m.len()),
            )));
        }
    }
    let values = hidden.to_f64_vec();
    let mut sum = vec![0f64; d];
    let mut count = 0usize;
    for (i, row) in values.chunks(d).enumerate() {
        if mask.is_some_and(|m| m[i] == 0) {
            continue;
        }
        count += 1;
        for (acc, x) in sum.iter_mut().zip(row) {
            *acc += x;
        }
    }
    if count == 0 {
        return Err(ModelError::Core(kpt_core::KptError::InvalidArgument(
            "mean_pool: the mask selects no position".into(),
        )));
    }
    Ok(sum.iter().map(|x| (x / count as f64) as f32).collect())
}
