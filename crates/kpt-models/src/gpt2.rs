//! GPT-2 lowered to kpt's graph.
//!
//! As in Hugging Face's `modeling_gpt2.py`: token plus learned position embeddings,
//! pre-LN blocks `h += c_proj(attn(c_attn(ln_1(h))))`, `h += mlp(ln_2(h))`, a final
//! `ln_f`, and logits through the token table (tied). GPT-2 stores its projections as
//! `Conv1D`, `[in, out]`; they are transposed to kpt's `[out, in]` at load time, and the
//! fused `c_attn` is cut into q, k and v projections (the manager merges them again).

use kpt_core::graph::{Activation, AttentionParams, Graph, Op};
use kpt_core::{DType, Tensor};

use crate::config::Gpt2Config;
use crate::error::Result;
use crate::lower::{activation, check_compute_dtype, DecoderInputs, NormParams, Phase, Projection};
use crate::weights::Weights;

/// One GPT-2 block's parameters.
#[derive(Debug, Clone)]
pub struct Gpt2Block {
    /// Layer norm before attention.
    pub ln_1: NormParams,
    /// Query projection (the first third of `c_attn`).
    pub q: Projection,
    /// Key projection (the second third of `c_attn`).
    pub k: Projection,
    /// Value projection (the last third of `c_attn`).
    pub v: Projection,
    /// Attention output projection.
    pub attn_proj: Projection,
    /// Layer norm before the MLP.
    pub ln_2: NormParams,
    /// MLP up projection (`c_fc`).
    pub fc: Projection,
    /// MLP down projection (`mlp.c_proj`).
    pub mlp_proj: Projection,
}

/// A GPT-2 decoder with its weights loaded in the compute dtype.
#[derive(Debug, Clone)]
pub struct Gpt2 {
    /// The configuration.
    pub config: Gpt2Config,
    /// Dtype of every parameter and activation of the built graphs.
    pub dtype: DType,
    /// Token embedding `[vocab, n_embd]`, also the output projection.
    pub wte: Tensor,
    /// Position embedding `[n_positions, n_embd]`.
    pub wpe: Tensor,
    /// Blocks.
    pub blocks: Vec<Gpt2Block>,
    /// Final layer norm.
    pub ln_f: NormParams,
    act: Activation,
}

/// `transformer.` when the checkpoint is a `GPT2LMHeadModel` state dict, else empty.
fn prefix(weights: &Weights) -> &'static str {
    if weights.contains("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    }
}

impl Gpt2 {
    /// Loads and shape-checks every weight of `config` from `weights`, converted to
    /// `dtype`. Tensor names may carry the `transformer.` prefix of `GPT2LMHeadModel`.
    pub fn load(config: &Gpt2Config, weights: &Weights, dtype: DType) -> Result<Self> {
        check_compute_dtype(dtype)?;
        let act = activation("activation_function", &config.activation_function)?;
        let pre = prefix(weights);
        let (d, f) = (config.n_embd, config.n_inner);
        let mut blocks = Vec::new();
        for i in 0..config.n_layer {
            let p = format!("{pre}h.{i}");
            let qkv =
                Projection::load_conv1d(weights, &format!("{p}.attn.c_attn"), d, 3 * d, dtype)?;
            let third = |j: usize| -> Result<Projection> {
                let bias = match &qkv.bias {
                    Some(b) => Some(b.narrow(0, j * d, d)?.contiguous()),
                    None => None,
                };
                Ok(Projection {
                    weight: qkv.weight.narrow(0, j * d, d)?.contiguous(),
                    bias,
                })
            };
            blocks.push(Gpt2Block {
                ln_1: NormParams::load(weights, &format!("{p}.ln_1"), d, dtype)?,
                q: third(0)?,
                k: third(1)?,
                v: third(2)?,
                attn_proj: Projection::load_conv1d(
                    weights,
                    &format!("{p}.attn.c_proj"),
                    d,
                    d,
                    dtype,
                )?,
                ln_2: NormParams::load(weights, &format!("{p}.ln_2"), d, dtype)?,
                fc: Projection::load_conv1d(weights, &format!("{p}.mlp.c_fc"), d, f, dtype)?,
                mlp_proj: Projection::load_conv1d(
                    weights,
                    &format!("{p}.mlp.c_proj"),
                    f,
                    d,
                    dtype,
                )?,
            });
        }
        Ok(Self {
            config: config.clone(),
            dtype,
            wte: weights.load(&format!("{pre}wte.weight"), &[config.vocab_size, d], dtype)?,
            wpe: weights.load(&format!("{pre}wpe.weight"), &[config.n_positions, d], dtype)?,
            blocks,
            ln_f: NormParams::load(weights, &format!("{pre}ln_f"), d, dtype)?,
            act,
        })
    }

    /// Builds the graph of `phase`, with the inputs and outputs of
    /// [`crate::llama::Llama::graph`] (keys and values `[1, T, n_embd]` per layer).
    /// Positions index the learned table, so they must stay below `n_positions`.
    pub fn graph(&self, phase: Phase, seq: usize) -> Result<Graph> {
        self.build(phase, seq, None)
    }

    /// The prefill graph of several prompts packed without padding, as
    /// [`crate::llama::Llama::graph_packed`].
    pub fn graph_packed(&self, total: usize, sequences: usize) -> Result<Graph> {
        self.build(Phase::Prefill, total, Some(sequences))
    }

    /// The packed prefill of [`Phase::PrefillLast`], as
    /// [`crate::llama::Llama::graph_packed_last`].
    pub fn graph_packed_last(&self, total: usize, sequences: usize) -> Result<Graph> {
        self.build(Phase::PrefillLast, total, Some(sequences))
    }

    fn build(&self, phase: Phase, seq: usize, packed: Option<usize>) -> Result<Graph> {
        let c = &self.config;
        let d = c.n_embd;
        let mut g = Graph::new();
        let inputs =
            DecoderInputs::declare(&mut g, phase, seq, packed, (c.n_layer, d), self.dtype)?;
        let wte = g.param("wte.weight", self.wte.clone());
        let wpe = g.param("wpe.weight", self.wpe.clone());
        let tok = g.op("wte", Op::Embedding, &[inputs.ids, wte])?;
        let pos = g.op("wpe", Op::Embedding, &[inputs.positions, wpe])?;
        let mut h = g.op("embed", Op::Add, &[tok, pos])?;
        let attn = AttentionParams::new(c.n_head, c.n_head, c.head_dim(), true);
        let eps = c.layer_norm_epsilon;
        let mut caches = Vec::with_capacity(c.n_layer);
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("h.{i}");
            let x = b.ln_1.apply(&mut g, &format!("{p}.ln_1"), h, eps)?;
            let q = b.q.apply(&mut g, &format!("{p}.attn.q"), x)?;
            let k = b.k.apply(&mut g, &format!("{p}.attn.k"), x)?;
            let v = b.v.apply(&mut g, &format!("{p}.attn.v"), x)?;
            let (k, v) = inputs.update_cache(&mut g, &format!("{p}.attn"), i, k, v)?;
            caches.push((k, v));
            let layer_attn = AttentionParams {
                scale: Some(c.attention_scale(i) as f32),
                ..attn
            };
            let a = inputs.attention(&mut g, &format!("{p}.attn"), layer_attn, q, k, v)?;
            let o = b.attn_proj.apply(&mut g, &format!("{p}.attn.c_proj"), a)?;
            h = g.op(format!("{p}.attn_residual"), Op::Add, &[h, o])?;
            let x = b.ln_2.apply(&mut g, &format!("{p}.ln_2"), h, eps)?;
            let m = b.fc.apply(&mut g, &format!("{p}.mlp.c_fc"), x)?;
            let m = g.op(
                format!("{p}.mlp.act"),
                Op::Activation { act: self.act },
                &[m],
            )?;
            let m = b.mlp_proj.apply(&mut g, &format!("{p}.mlp.c_proj"), m)?;
            h = g.op(format!("{p}.mlp_residual"), Op::Add, &[h, m])?;
        }
        let h = inputs.logit_rows(&mut g, h)?;
        let x = self.ln_f.apply(&mut g, "ln_f", h, eps)?;
        let head = g.param("lm_head.weight", self.wte.clone());
        let logits = g.op("lm_head", Op::Linear { bias: false }, &[x, head])?;
        inputs.outputs(&mut g, logits, &caches)?;
        Ok(g)
    }
}
