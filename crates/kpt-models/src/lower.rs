//! Pieces shared by the lowerings: the phase, projections and activation names.

use kpt_core::graph::{Activation, AttentionParams, Graph, Op, ValueId};
use kpt_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::Weights;

/// Which graph of a decoder to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The whole prompt at once; outputs logits and the key/value cache of every layer.
    Prefill,
    /// [`Phase::Prefill`] that computes the logits of each sequence's last token only, as
    /// generation needs (vLLM's prefill, HF's `logits_to_keep=1`): an input
    /// [`LAST_ROWS`] `[1, sequences]` (i64) names those tokens' rows, and the logits are
    /// `[1, sequences, vocab]`. The final norm and the LM head run on those rows alone.
    PrefillLast,
    /// One token per sequence against caches of a fixed capacity, which the step writes
    /// its keys and values into; outputs logits and the updated caches.
    Decode,
    /// [`Phase::Decode`] that also picks each sequence's most likely next token on the
    /// device ([`Op::ArgMax`] of the logits): outputs logits, the next tokens `[B, 1]`
    /// (i64; -1 where the logits hold a NaN), then the caches. Greedy decoding then
    /// downloads one id per sequence instead of a vocabulary of logits.
    DecodeGreedy,
}

/// The name of [`Phase::PrefillLast`]'s input of rows whose logits it computes.
pub const LAST_ROWS: &str = "last_rows";

impl Phase {
    /// Whether this is a prefill phase (the whole prompt, no cache inputs).
    pub fn is_prefill(self) -> bool {
        matches!(self, Phase::Prefill | Phase::PrefillLast)
    }
}

/// The inputs of a decoder graph.
///
/// Prefill: ids `[1, S]` (i64), positions `[S]` (i64), for a packed prefill
/// `cu_seqlens` `[sequences + 1]` (i64), and for [`Phase::PrefillLast`] the rows
/// [`LAST_ROWS`] `[1, sequences]` (i64) of each sequence's last token; `seq` is the prompt
/// length (all prompts').
///
/// Decode, `B` sequences of one token each: ids `[B, 1]`, positions `[B, 1]` (each
/// sequence's own), `slots` `[B]` (the cache row each sequence's new key and value go to),
/// `block_table` `[B, blocks per sequence]` and `seq_lens` `[B]` (lengths with the new
/// token), all i64, then each layer's caches `cache.{i}.k` / `cache.{i}.v` `[blocks,
/// block_size, kv_dim]`: paged attention's layout (vLLM's), which a cache of one block
/// per sequence (`block_size` = its capacity) also is. The step writes into the caches
/// ([`Op::CacheWrite`], in place in the executor) and returns them, so every input of a
/// step has the shape of the step before; `seq` is the declared capacity.
/// [`crate::generate::decode_inputs`] builds the small inputs.
#[derive(Debug, Clone)]
pub struct DecoderInputs {
    /// Token ids.
    pub ids: ValueId,
    /// Absolute positions of the tokens.
    pub positions: ValueId,
    /// The caches of a decode step and where its rows go.
    pub cache: Option<CacheInputs>,
    /// Sequence offsets of a packed prefill.
    pub cu_seqlens: Option<ValueId>,
    /// The rows whose logits a [`Phase::PrefillLast`] graph computes.
    pub last_rows: Option<ValueId>,
    /// Whether the graph outputs the greedy next tokens ([`Phase::DecodeGreedy`]).
    pub greedy: bool,
}

/// The cache inputs of a decode graph (see [`DecoderInputs`]).
#[derive(Debug, Clone)]
pub struct CacheInputs {
    /// The cache row of each sequence's new key and value.
    pub slots: ValueId,
    /// Each sequence's cache blocks.
    pub block_table: ValueId,
    /// Each sequence's length, the new token included.
    pub seq_lens: ValueId,
    /// Keys and values per layer.
    pub layers: Vec<(ValueId, ValueId)>,
}

impl DecoderInputs {
    /// Declares the inputs on `g`; `packed` is the number of sequences of a packed
    /// prefill.
    pub fn declare(
        g: &mut Graph,
        phase: Phase,
        seq: usize,
        packed: Option<usize>,
        (layers, kv_dim): (usize, usize),
        dtype: DType,
    ) -> Result<Self> {
        if phase.is_prefill() {
            let ids = g.input("ids", DType::I64, &[1, seq]);
            let positions = g.input("positions", DType::I64, &[seq]);
            let cu_seqlens = packed.map(|n| g.input("cu_seqlens", DType::I64, &[n + 1]));
            let last_rows = (phase == Phase::PrefillLast)
                .then(|| g.input(LAST_ROWS, DType::I64, &[1, packed.unwrap_or(1)]));
            return Ok(Self {
                ids,
                positions,
                cache: None,
                cu_seqlens,
                last_rows,
                greedy: false,
            });
        }
        if packed.is_some() {
            return Err(ModelError::Unsupported(
                "packed decode: a decode step takes one token per sequence".into(),
            ));
        }
        let ids = g.input("ids", DType::I64, &[1, 1]);
        let positions = g.input("positions", DType::I64, &[1, 1]);
        let slots = g.input("slots", DType::I64, &[1]);
        let block_table = g.input("block_table", DType::I64, &[1, 1]);
        let seq_lens = g.input("seq_lens", DType::I64, &[1]);
        let layers = (0..layers)
            .map(|i| {
                let k = g.input(format!("cache.{i}.k"), dtype, &[1, seq, kv_dim]);
                let v = g.input(format!("cache.{i}.v"), dtype, &[1, seq, kv_dim]);
                (k, v)
            })
            .collect();
        Ok(Self {
            ids,
            positions,
            cache: Some(CacheInputs {
                slots,
                block_table,
                seq_lens,
                layers,
            }),
            cu_seqlens: None,
            last_rows: None,
            greedy: phase == Phase::DecodeGreedy,
        })
    }

    /// Adds attention of `q` over `k`, `v` with `params`: variable-length over
    /// `cu_seqlens` for a packed prefill, paged over the caches for a decode step.
    pub fn attention(
        &self,
        g: &mut Graph,
        name: &str,
        params: AttentionParams,
        q: ValueId,
        k: ValueId,
        v: ValueId,
    ) -> Result<ValueId> {
        let mut inputs = vec![q, k, v];
        inputs.extend(self.cu_seqlens.iter().flat_map(|&c| [c, c]));
        if let Some(c) = &self.cache {
            inputs.extend([c.block_table, c.seq_lens]);
        }
        let params = AttentionParams {
            varlen: self.cu_seqlens.is_some(),
            paged: self.cache.is_some(),
            ..params
        };
        Ok(g.op(name, Op::Attention(params), &inputs)?)
    }

    /// The rows of the final hidden state `h` `[1, S, hidden]` that the logits are computed
    /// from: those of [`LAST_ROWS`] (`[1, sequences, hidden]`) for [`Phase::PrefillLast`],
    /// all of them otherwise.
    pub fn logit_rows(&self, g: &mut Graph, h: ValueId) -> Result<ValueId> {
        let Some(rows) = self.last_rows else {
            return Ok(h);
        };
        Ok(g.op("last_rows", Op::Embedding, &[rows, h])?)
    }

    /// Marks the outputs of the decoder graph: logits, the greedy next tokens (of
    /// [`Phase::DecodeGreedy`]), then each layer's keys and values.
    pub fn outputs(
        &self,
        g: &mut Graph,
        logits: ValueId,
        caches: &[(ValueId, ValueId)],
    ) -> Result<()> {
        g.output(logits)?;
        if self.greedy {
            let next = g.op("next_tokens", Op::ArgMax, &[logits])?;
            g.output(next)?;
        }
        for &(k, v) in caches {
            g.output(k)?;
            g.output(v)?;
        }
        Ok(())
    }

    /// Writes layer `layer`'s new keys and values into its caches and returns the
    /// updated caches (decode), or returns them as they are (prefill).
    pub fn update_cache(
        &self,
        g: &mut Graph,
        prefix: &str,
        layer: usize,
        k: ValueId,
        v: ValueId,
    ) -> Result<(ValueId, ValueId)> {
        let Some(c) = &self.cache else {
            return Ok((k, v));
        };
        let &(ck, cv) = c.layers.get(layer).ok_or_else(|| {
            ModelError::Generation(format!("no cache declared for layer {layer}"))
        })?;
        Ok((
            g.op(
                format!("{prefix}.k_cache"),
                Op::CacheWrite,
                &[ck, k, c.slots],
            )?,
            g.op(
                format!("{prefix}.v_cache"),
                Op::CacheWrite,
                &[cv, v, c.slots],
            )?,
        ))
    }
}

/// A linear layer's weight `[out, in]` and optional bias `[out]`.
#[derive(Debug, Clone)]
pub struct Projection {
    /// Weight in PyTorch layout.
    pub weight: Tensor,
    /// Bias.
    pub bias: Option<Tensor>,
}

impl Projection {
    /// Loads `{prefix}.weight` `[out, inp]` and, when `bias`, `{prefix}.bias` `[out]`.
    pub fn load(
        w: &Weights,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
        dtype: DType,
    ) -> Result<Self> {
        Ok(Self {
            weight: w.load(&format!("{prefix}.weight"), &[out, inp], dtype)?,
            bias: if bias {
                Some(w.load(&format!("{prefix}.bias"), &[out], dtype)?)
            } else {
                None
            },
        })
    }

    /// Loads a GPT-2 `Conv1D` (`{prefix}.weight` stored `[inp, out]`), transposed to
    /// `[out, inp]`, with its bias `[out]`.
    pub fn load_conv1d(
        w: &Weights,
        prefix: &str,
        inp: usize,
        out: usize,
        dtype: DType,
    ) -> Result<Self> {
        let weight = w
            .load(&format!("{prefix}.weight"), &[inp, out], dtype)?
            .transpose(0, 1)?
            .contiguous();
        Ok(Self {
            weight,
            bias: Some(w.load(&format!("{prefix}.bias"), &[out], dtype)?),
        })
    }

    /// Adds the parameters (named after `name`) and the linear node to `g`.
    pub fn apply(&self, g: &mut Graph, name: &str, x: ValueId) -> Result<ValueId> {
        let w = g.param(format!("{name}.weight"), self.weight.clone());
        let mut inputs = vec![x, w];
        if let Some(b) = &self.bias {
            inputs.push(g.param(format!("{name}.bias"), b.clone()));
        }
        Ok(g.op(
            name,
            Op::Linear {
                bias: self.bias.is_some(),
            },
            &inputs,
        )?)
    }
}

/// Weight and bias of a layer norm.
#[derive(Debug, Clone)]
pub struct NormParams {
    /// Scale `[D]`.
    pub weight: Tensor,
    /// Shift `[D]`.
    pub bias: Tensor,
}

impl NormParams {
    /// Loads `{prefix}.weight` and `{prefix}.bias`, each `[dim]`.
    pub fn load(w: &Weights, prefix: &str, dim: usize, dtype: DType) -> Result<Self> {
        Ok(Self {
            weight: w.load(&format!("{prefix}.weight"), &[dim], dtype)?,
            bias: w.load(&format!("{prefix}.bias"), &[dim], dtype)?,
        })
    }

    /// Adds a layer norm of `x` to `g`.
    pub fn apply(&self, g: &mut Graph, name: &str, x: ValueId, eps: f64) -> Result<ValueId> {
        let w = g.param(format!("{name}.weight"), self.weight.clone());
        let b = g.param(format!("{name}.bias"), self.bias.clone());
        Ok(g.op(name, Op::LayerNorm { eps: eps as f32 }, &[x, w, b])?)
    }
}

/// The kpt activation of a Hugging Face activation name (`hidden_act`,
/// `activation_function`).
pub fn activation(field: &str, name: &str) -> Result<Activation> {
    match name {
        "silu" | "swish" => Ok(Activation::Silu),
        "gelu" => Ok(Activation::GeluErf),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
        "relu" => Ok(Activation::Relu),
        other => Err(ModelError::Unsupported(format!(
            "{field} `{other}`; supported: silu, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu"
        ))),
    }
}

/// The inputs of a packed prefill of `prompts` (see [`DecoderInputs`]): ids `[1, total]`,
/// positions restarting at 0 for each prompt, and `cu_seqlens`.
pub fn pack_prompts(prompts: &[&[i64]]) -> Result<Vec<Tensor>> {
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut cu = vec![0i64];
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(ModelError::Core(kpt_core::KptError::InvalidArgument(
                format!("prompt {i} is empty"),
            )));
        }
        ids.extend_from_slice(p);
        positions.extend(0..p.len() as i64);
        cu.push(ids.len() as i64);
    }
    let (n, m) = (ids.len(), cu.len());
    Ok(vec![
        Tensor::from_vec(ids, &[1, n])?,
        Tensor::from_vec(positions, &[n])?,
        Tensor::from_vec(cu, &[m])?,
    ])
}

/// The [`LAST_ROWS`] input of a [`Phase::PrefillLast`] graph: the row of each
/// sequence's last token, `cu_seqlens[i + 1] - 1`, as `[1, sequences]` (`[0, n]` for one
/// prompt of `n` tokens).
pub fn last_rows(cu_seqlens: &[i64]) -> Result<Tensor> {
    let rows: Vec<i64> = cu_seqlens.windows(2).map(|w| w[1] - 1).collect();
    if rows.is_empty() || cu_seqlens.windows(2).any(|w| w[1] <= w[0]) || cu_seqlens[0] != 0 {
        return Err(ModelError::Core(kpt_core::KptError::InvalidArgument(
            format!("cu_seqlens must start at 0 and rise at every sequence, got {cu_seqlens:?}"),
        )));
    }
    let n = rows.len();
    Ok(Tensor::from_vec(rows, &[1, n])?)
}

/// Cuts the packed outputs `[1, total, width]` of a packed prefill (logits or one layer's
/// keys or values) into one `[1, len, width]` tensor per sequence, by `cu_seqlens`.
pub fn unpack(packed: &Tensor, cu_seqlens: &[i64]) -> Result<Vec<Tensor>> {
    let total = packed.shape().get(1).copied().unwrap_or(0);
    if packed.rank() != 3
        || cu_seqlens.first() != Some(&0)
        || cu_seqlens.last() != Some(&(total as i64))
        || cu_seqlens.windows(2).any(|w| w[1] < w[0])
    {
        return Err(ModelError::Core(kpt_core::KptError::InvalidArgument(
            format!(
                "cannot cut {:?} by cu_seqlens {cu_seqlens:?}",
                packed.shape()
            ),
        )));
    }
    cu_seqlens
        .windows(2)
        .map(|w| {
            let (start, len) = (w[0] as usize, (w[1] - w[0]) as usize);
            Ok(packed.narrow(1, start, len)?.contiguous())
        })
        .collect()
}

/// Checks that `dtype` is one the lowered graph can compute in.
pub fn check_compute_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        other => Err(ModelError::Unsupported(format!(
            "compute dtype {other}; use f32, f64, bf16 or f16"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_rows_are_each_sequences_last_token() {
        let t = last_rows(&[0, 5, 6, 9]).unwrap();
        assert_eq!(t.shape(), [1, 3]);
        assert_eq!(t.as_slice::<i64>().unwrap(), [4, 5, 8]);
        for bad in [&[][..], &[0], &[1, 4], &[0, 3, 3], &[0, 4, 2]] {
            assert!(last_rows(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn decoder_inputs_by_phase() {
        let mut g = Graph::new();
        let d = DecoderInputs::declare(&mut g, Phase::Decode, 5, None, (2, 8), DType::F32).unwrap();
        let c = d.cache.unwrap();
        assert_eq!(c.layers.len(), 2);
        assert_eq!(g.spec(c.layers[1].0).unwrap().shape, vec![1, 5, 8]);
        assert_eq!(g.spec(c.block_table).unwrap().shape, vec![1, 1]);
        assert_eq!(g.spec(d.ids).unwrap().shape, vec![1, 1]);
        let mut g = Graph::new();
        let p =
            DecoderInputs::declare(&mut g, Phase::Prefill, 9, Some(3), (2, 8), DType::F32).unwrap();
        assert!(p.cache.is_none());
        assert_eq!(g.spec(p.cu_seqlens.unwrap()).unwrap().shape, vec![4]);
        let mut g = Graph::new();
        let d = DecoderInputs::declare(&mut g, Phase::DecodeGreedy, 5, None, (1, 8), DType::F32)
            .unwrap();
        assert!(d.greedy);
        let logits = g.input("logits", DType::F32, &[3, 1, 10]);
        let caches = d.cache.as_ref().unwrap().layers.clone();
        d.outputs(&mut g, logits, &caches).unwrap();
        assert_eq!(g.outputs().len(), 4);
        assert_eq!(g.spec(g.outputs()[1]).unwrap().shape, vec![3, 1]);
        assert_eq!(g.spec(g.outputs()[1]).unwrap().dtype, DType::I64);
        let mut g = Graph::new();
        let err = DecoderInputs::declare(&mut g, Phase::Decode, 9, Some(3), (2, 8), DType::F32);
        assert!(matches!(err, Err(ModelError::Unsupported(_))));
    }

    #[test]
    fn activation_names() {
        assert_eq!(activation("a", "silu").unwrap(), Activation::Silu);
        assert_eq!(activation("a", "gelu_new").unwrap(), Activation::GeluTanh);
        assert_eq!(activation("a", "gelu").unwrap(), Activation::GeluErf);
        let err = activation("hidden_act", "mish").unwrap_err().to_string();
        assert!(err.contains("hidden_act `mish`"), "{err}");
        assert!(check_compute_dtype(DType::I8).is_err());
    }
}
