//! Pieces shared by the lowerings: the phase, projections and activation names.

use kpt_core::graph::{Activation, Graph, Op, ValueId};
use kpt_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::Weights;

/// Which graph of a decoder to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The whole prompt at once; outputs logits and the key/value cache of every layer.
    Prefill,
    /// One token with the cache as input; outputs logits and the extended cache.
    Decode,
}

/// The inputs of a decoder graph: ids `[1, S]` (i64), positions `[S]` (i64), and for
/// decode the past keys and values of each layer, `past.{i}.k` / `past.{i}.v`
/// `[1, past, kv_dim]`. `seq` is the prompt length for prefill and the past length for
/// decode.
#[derive(Debug, Clone)]
pub struct DecoderInputs {
    /// Token ids.
    pub ids: ValueId,
    /// Absolute positions of the tokens.
    pub positions: ValueId,
    /// Past keys and values per layer (empty for prefill).
    pub past: Vec<(ValueId, ValueId)>,
}

impl DecoderInputs {
    /// Declares the inputs on `g`.
    pub fn declare(
        g: &mut Graph,
        phase: Phase,
        seq: usize,
        layers: usize,
        kv_dim: usize,
        dtype: DType,
    ) -> Self {
        let s = if phase == Phase::Decode { 1 } else { seq };
        let ids = g.input("ids", DType::I64, &[1, s]);
        let positions = g.input("positions", DType::I64, &[s]);
        let past = if phase == Phase::Decode {
            (0..layers)
                .map(|i| {
                    let k = g.input(format!("past.{i}.k"), dtype, &[1, seq, kv_dim]);
                    let v = g.input(format!("past.{i}.v"), dtype, &[1, seq, kv_dim]);
                    (k, v)
                })
                .collect()
        } else {
            Vec::new()
        };
        Self {
            ids,
            positions,
            past,
        }
    }

    /// Appends layer `layer`'s new keys and values to its past (decode) or returns them
    /// as they are (prefill).
    pub fn extend_cache(
        &self,
        g: &mut Graph,
        prefix: &str,
        layer: usize,
        k: ValueId,
        v: ValueId,
    ) -> Result<(ValueId, ValueId)> {
        match self.past.get(layer) {
            Some(&(pk, pv)) => Ok((
                g.op(
                    format!("{prefix}.k_cache"),
                    Op::Concat { axis: 1 },
                    &[pk, k],
                )?,
                g.op(
                    format!("{prefix}.v_cache"),
                    Op::Concat { axis: 1 },
                    &[pv, v],
                )?,
            )),
            None => Ok((k, v)),
        }
    }
}

/// Marks the outputs of a decoder graph: logits, then each layer's keys and values.
pub fn decoder_outputs(
    g: &mut Graph,
    logits: ValueId,
    caches: &[(ValueId, ValueId)],
) -> Result<()> {
    g.output(logits)?;
    for &(k, v) in caches {
        g.output(k)?;
        g.output(v)?;
    }
    Ok(())
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

/// Checks that `dtype` is one the lowered graph can compute in.
pub fn check_compute_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        other => Err(ModelError::Unsupported(format!(
            "compute dtype {other}; use f32, f64, bf16 or f16"
        ))),
    }
}
