//! The LLaMA family (LLaMA 2/3, Mistral, Qwen2) lowered to kpt's graph.
//!
//! Layout per layer, as in Hugging Face's `modeling_llama.py`:
//! `h += o_proj(attn(rope(q_proj(rms(h))), rope(k_proj(..)), v_proj(..)))`, then
//! `h += down_proj(act(gate_proj(rms(h))) * up_proj(rms(h)))`; a final RMS norm and
//! `lm_head` (or the embedding table when tied). HF applies rotary embeddings in the
//! "rotate half" layout (first half of each head against the second), which is
//! `Op::Rotary`'s layout, so the q/k projections are used as stored. `rope_scaling`
//! (linear, dynamic, llama3, yarn) is carried on every `Op::Rotary` as parsed.

use kpt_core::graph::{Activation, AttentionParams, Graph, Op, ValueId};
use kpt_core::{DType, Tensor};

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::lower::{activation, check_compute_dtype, DecoderInputs, Phase, Projection};
use crate::weights::Weights;

/// One decoder layer's parameters.
#[derive(Debug, Clone)]
pub struct LlamaLayer {
    /// RMS norm before attention.
    pub input_layernorm: Tensor,
    /// Query projection.
    pub q_proj: Projection,
    /// Key projection.
    pub k_proj: Projection,
    /// Value projection.
    pub v_proj: Projection,
    /// Attention output projection.
    pub o_proj: Projection,
    /// RMS norm before the MLP.
    pub post_attention_layernorm: Tensor,
    /// MLP gate projection.
    pub gate_proj: Projection,
    /// MLP up projection.
    pub up_proj: Projection,
    /// MLP down projection.
    pub down_proj: Projection,
}

/// A LLaMA-family decoder with its weights loaded in the compute dtype.
#[derive(Debug, Clone)]
pub struct Llama {
    /// The configuration.
    pub config: LlamaConfig,
    /// Dtype of every parameter and activation of the built graphs.
    pub dtype: DType,
    /// Token embedding `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// Decoder layers.
    pub layers: Vec<LlamaLayer>,
    /// Final RMS norm.
    pub norm: Tensor,
    /// Output projection `[vocab, hidden]` (the embedding table when tied).
    pub lm_head: Tensor,
    act: Activation,
}

impl Llama {
    /// Loads and shape-checks every weight of `config` from `weights`, converted to
    /// `dtype`.
    pub fn load(config: &LlamaConfig, weights: &Weights, dtype: DType) -> Result<Self> {
        check_compute_dtype(dtype)?;
        let act = activation("hidden_act", &config.hidden_act)?;
        let c = config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let norm = |name: &str| weights.load(name, &[d], dtype);
        let embed_tokens = weights.load("model.embed_tokens.weight", &[v, d], dtype)?;
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let proj = |name: &str, out: usize, inp: usize, bias: bool| {
                Projection::load(weights, &format!("{p}.{name}"), out, inp, bias, dtype)
            };
            layers.push(LlamaLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"))?,
                q_proj: proj("self_attn.q_proj", c.q_dim(), d, c.attention_bias)?,
                k_proj: proj("self_attn.k_proj", c.kv_dim(), d, c.attention_bias)?,
                v_proj: proj("self_attn.v_proj", c.kv_dim(), d, c.attention_bias)?,
                o_proj: proj("self_attn.o_proj", d, c.q_dim(), c.o_proj_bias)?,
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                gate_proj: proj("mlp.gate_proj", c.intermediate_size, d, c.mlp_bias)?,
                up_proj: proj("mlp.up_proj", c.intermediate_size, d, c.mlp_bias)?,
                down_proj: proj("mlp.down_proj", d, c.intermediate_size, c.mlp_bias)?,
            });
        }
        let lm_head = if c.tie_word_embeddings && !weights.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            weights.load("lm_head.weight", &[v, d], dtype)?
        };
        Ok(Self {
            config: c.clone(),
            dtype,
            embed_tokens,
            layers,
            norm: norm("model.norm.weight")?,
            lm_head,
            act,
        })
    }

    /// Builds the graph of `phase` with the inputs of [`DecoderInputs`]. Outputs: logits
    /// `[B, S, vocab]`, then the keys and values of each layer: `[1, S, kv_dim]` after
    /// prefill, the updated caches `[blocks, block_size, kv_dim]` after decode. `seq` is
    /// the prompt length for prefill and the cache capacity for decode; the executor
    /// re-infers shapes, so one graph serves every length.
    pub fn graph(&self, phase: Phase, seq: usize) -> Result<Graph> {
        self.build(phase, seq, None)
    }

    /// The prefill graph of several prompts packed without padding into one row of
    /// `total` tokens: variable-length causal attention keeps each prompt to itself.
    /// Inputs: ids `[1, total]`, positions `[total]` (restarting at 0 for each prompt),
    /// `cu_seqlens` `[sequences + 1]` ([`crate::lower::pack_prompts`] builds them).
    /// Outputs as for [`Phase::Prefill`], over the packed tokens
    /// ([`crate::lower::unpack`] cuts them per prompt, e.g. into decode caches).
    pub fn graph_packed(&self, total: usize, sequences: usize) -> Result<Graph> {
        self.build(Phase::Prefill, total, Some(sequences))
    }

    /// [`Self::graph_packed`] with [`Phase::PrefillLast`]'s logits: those of each
    /// prompt's last token, `[1, sequences, vocab]` ([`crate::lower::last_rows`] gives the
    /// rows input).
    pub fn graph_packed_last(&self, total: usize, sequences: usize) -> Result<Graph> {
        self.build(Phase::PrefillLast, total, Some(sequences))
    }

    fn build(&self, phase: Phase, seq: usize, packed: Option<usize>) -> Result<Graph> {
        let c = &self.config;
        let mut g = Graph::new();
        let inputs = DecoderInputs::declare(
            &mut g,
            phase,
            seq,
            packed,
            (c.num_hidden_layers, c.kv_dim()),
            self.dtype,
        )?;
        let (ids, pos) = (inputs.ids, inputs.positions);
        let table = g.param("model.embed_tokens.weight", self.embed_tokens.clone());
        let mut h = g.op("model.embed_tokens", Op::Embedding, &[ids, table])?;
        let attn = AttentionParams::new(
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            true,
        );
        let rope = Op::Rotary {
            head_dim: c.head_dim,
            theta: c.rope_theta as f32,
            scaling: c.rope_scaling,
        };
        let eps = c.rms_norm_eps as f32;
        let mut caches = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let x = rms_norm(
                &mut g,
                &format!("{p}.input_layernorm"),
                h,
                &layer.input_layernorm,
                eps,
            )?;
            let q = layer
                .q_proj
                .apply(&mut g, &format!("{p}.self_attn.q_proj"), x)?;
            let k = layer
                .k_proj
                .apply(&mut g, &format!("{p}.self_attn.k_proj"), x)?;
            let v = layer
                .v_proj
                .apply(&mut g, &format!("{p}.self_attn.v_proj"), x)?;
            let q = g.op(format!("{p}.self_attn.q_rope"), rope.clone(), &[q, pos])?;
            let k = g.op(format!("{p}.self_attn.k_rope"), rope.clone(), &[k, pos])?;
            let (k, v) = inputs.update_cache(&mut g, &format!("{p}.self_attn"), i, k, v)?;
            caches.push((k, v));
            let layer_attn = AttentionParams {
                window: c.window(i),
                ..attn
            };
            let a = inputs.attention(&mut g, &format!("{p}.self_attn"), layer_attn, q, k, v)?;
            let o = layer
                .o_proj
                .apply(&mut g, &format!("{p}.self_attn.o_proj"), a)?;
            h = g.op(format!("{p}.attn_residual"), Op::Add, &[h, o])?;
            let x = rms_norm(
                &mut g,
                &format!("{p}.post_attention_layernorm"),
                h,
                &layer.post_attention_layernorm,
                eps,
            )?;
            let gate = layer
                .gate_proj
                .apply(&mut g, &format!("{p}.mlp.gate_proj"), x)?;
            let gate = g.op(
                format!("{p}.mlp.act"),
                Op::Activation { act: self.act },
                &[gate],
            )?;
            let up = layer
                .up_proj
                .apply(&mut g, &format!("{p}.mlp.up_proj"), x)?;
            let m = g.op(format!("{p}.mlp.gated"), Op::Mul, &[gate, up])?;
            let down = layer
                .down_proj
                .apply(&mut g, &format!("{p}.mlp.down_proj"), m)?;
            h = g.op(format!("{p}.mlp_residual"), Op::Add, &[h, down])?;
        }
        let h = inputs.logit_rows(&mut g, h)?;
        let x = rms_norm(&mut g, "model.norm", h, &self.norm, eps)?;
        let head = g.param("lm_head.weight", self.lm_head.clone());
        let logits = g.op("lm_head", Op::Linear { bias: false }, &[x, head])?;
        inputs.outputs(&mut g, logits, &caches)?;
        Ok(g)
    }
}

fn rms_norm(g: &mut Graph, name: &str, x: ValueId, weight: &Tensor, eps: f32) -> Result<ValueId> {
    let w = g.param(format!("{name}.weight"), weight.clone());
    Ok(g.op(name, Op::RmsNorm { eps }, &[x, w])?)
}
