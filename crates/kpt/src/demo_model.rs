//! A small decoder-only transformer (LLaMA layout) with deterministic weights,
//! lowered to kpt's graph IR; the model behind `kpt demo` and `kpt validate`.

use kpt_core::graph::{Activation, AttentionParams, Graph, Op, ValueId};
use kpt_core::rand::SplitMix64;
use kpt_core::{DType, KptError, Result, Tensor};

/// Sizes of the demo transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemoConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub dim: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA).
    pub kv_heads: usize,
    /// MLP hidden size (SwiGLU).
    pub ffn: usize,
    /// Weight seed.
    pub seed: u64,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            vocab: 1024,
            dim: 512,
            layers: 4,
            heads: 8,
            kv_heads: 2,
            ffn: 1376,
            seed: 42,
        }
    }
}

impl DemoConfig {
    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.dim / self.heads
    }

    /// Width of the key/value projections.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim()
    }

    /// Number of weights.
    pub fn num_params(&self) -> usize {
        let attn = self.dim * self.dim * 2 + self.dim * self.kv_dim() * 2;
        let mlp = 3 * self.dim * self.ffn;
        self.vocab * self.dim * 2 + self.layers * (attn + mlp + 2 * self.dim) + self.dim
    }

    fn check(&self) -> Result<()> {
        if self.heads == 0
            || self.kv_heads == 0
            || !self.dim.is_multiple_of(self.heads)
            || !self.heads.is_multiple_of(self.kv_heads)
        {
            return Err(KptError::InvalidArgument(format!(
                "dim {} must split into {} heads, and heads into {} kv heads",
                self.dim, self.heads, self.kv_heads
            )));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(KptError::InvalidArgument(format!(
                "head_dim {} must be even for rotary",
                self.head_dim()
            )));
        }
        Ok(())
    }
}

/// Deterministic weights, uniform in `±sqrt(3/fan_in)` (unit variance outputs).
pub fn random_tensor(shape: &[usize], fan_in: usize, seed: u64) -> Result<Tensor> {
    let mut rng = SplitMix64::new(seed);
    let bound = (3.0 / fan_in.max(1) as f64).sqrt();
    let data: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
        .collect();
    Tensor::from_vec(data, shape)
}

/// Which graph to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Whole prompt at once; outputs logits and the key/value cache of every layer.
    Prefill,
    /// One token with the cache as input; outputs logits and the extended cache.
    Decode,
}

/// Builds the graph. Inputs: ids `[1, S]` (i64), positions `[S]` (i64), and for
/// decode the past keys and values of each layer `[1, T, kv_dim]`. Outputs: logits
/// `[1, S, vocab]`, then keys and values of each layer.
pub fn build_graph(cfg: &DemoConfig, phase: Phase, example_seq: usize) -> Result<Graph> {
    cfg.check()?;
    let mut g = Graph::new();
    let (d, hd, kvd) = (cfg.dim, cfg.head_dim(), cfg.kv_dim());
    let seq = if phase == Phase::Decode {
        1
    } else {
        example_seq
    };
    let ids = g.input("ids", DType::I64, &[1, seq]);
    let pos = g.input("positions", DType::I64, &[seq]);
    let mut past = Vec::new();
    if phase == Phase::Decode {
        for l in 0..cfg.layers {
            let k = g.input(format!("past.{l}.k"), DType::F32, &[1, example_seq, kvd]);
            let v = g.input(format!("past.{l}.v"), DType::F32, &[1, example_seq, kvd]);
            past.push((k, v));
        }
    }
    let mut seed = cfg.seed;
    let mut weight =
        |g: &mut Graph, name: &str, shape: &[usize], fan_in: usize| -> Result<ValueId> {
            seed = seed.wrapping_add(1);
            Ok(g.param(name, random_tensor(shape, fan_in, seed)?))
        };
    let ones = |g: &mut Graph, name: &str| -> Result<ValueId> {
        Ok(g.param(name, Tensor::from_vec(vec![1f32; d], &[d])?))
    };
    let table = weight(&mut g, "embed", &[cfg.vocab, d], 1)?;
    let mut h = g.op("embed", Op::Embedding, &[ids, table])?;
    let mut caches = Vec::new();
    let attn = AttentionParams::new(cfg.heads, cfg.kv_heads, hd, true);
    let eps = 1e-5;
    for l in 0..cfg.layers {
        let p = format!("layers.{l}");
        let w = ones(&mut g, &format!("{p}.attn_norm"))?;
        let x = g.op(format!("{p}.attn_norm"), Op::RmsNorm { eps }, &[h, w])?;
        let wq = weight(&mut g, &format!("{p}.wq"), &[d, d], d)?;
        let wk = weight(&mut g, &format!("{p}.wk"), &[kvd, d], d)?;
        let wv = weight(&mut g, &format!("{p}.wv"), &[kvd, d], d)?;
        let q = g.op(format!("{p}.q"), Op::Linear { bias: false }, &[x, wq])?;
        let k = g.op(format!("{p}.k"), Op::Linear { bias: false }, &[x, wk])?;
        let mut v = g.op(format!("{p}.v"), Op::Linear { bias: false }, &[x, wv])?;
        let rot = Op::Rotary {
            head_dim: hd,
            theta: 10000.0,
            scaling: None,
        };
        let q = g.op(format!("{p}.q_rot"), rot.clone(), &[q, pos])?;
        let mut k = g.op(format!("{p}.k_rot"), rot, &[k, pos])?;
        if let Some(&(pk, pv)) = past.get(l) {
            k = g.op(format!("{p}.k_cache"), Op::Concat { axis: 1 }, &[pk, k])?;
            v = g.op(format!("{p}.v_cache"), Op::Concat { axis: 1 }, &[pv, v])?;
        }
        caches.push((k, v));
        let a = g.op(format!("{p}.attn"), Op::Attention(attn), &[q, k, v])?;
        let wo = weight(&mut g, &format!("{p}.wo"), &[d, d], d)?;
        let o = g.op(format!("{p}.o"), Op::Linear { bias: false }, &[a, wo])?;
        h = g.op(format!("{p}.attn_residual"), Op::Add, &[h, o])?;
        let w = ones(&mut g, &format!("{p}.mlp_norm"))?;
        let x = g.op(format!("{p}.mlp_norm"), Op::RmsNorm { eps }, &[h, w])?;
        let wg = weight(&mut g, &format!("{p}.gate"), &[cfg.ffn, d], d)?;
        let wu = weight(&mut g, &format!("{p}.up"), &[cfg.ffn, d], d)?;
        let wd = weight(&mut g, &format!("{p}.down"), &[d, cfg.ffn], cfg.ffn)?;
        let gate = g.op(format!("{p}.gate"), Op::Linear { bias: false }, &[x, wg])?;
        let gate = g.op(
            format!("{p}.gate_act"),
            Op::Activation {
                act: Activation::Silu,
            },
            &[gate],
        )?;
        let up = g.op(format!("{p}.up"), Op::Linear { bias: false }, &[x, wu])?;
        let m = g.op(format!("{p}.swiglu"), Op::Mul, &[gate, up])?;
        let down = g.op(format!("{p}.down"), Op::Linear { bias: false }, &[m, wd])?;
        h = g.op(format!("{p}.mlp_residual"), Op::Add, &[h, down])?;
    }
    let w = ones(&mut g, "final_norm")?;
    let x = g.op("final_norm", Op::RmsNorm { eps }, &[h, w])?;
    let head = weight(&mut g, "lm_head", &[cfg.vocab, d], d)?;
    let logits = g.op("lm_head", Op::Linear { bias: false }, &[x, head])?;
    g.output(logits)?;
    for (k, v) in caches {
        g.output(k)?;
        g.output(v)?;
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_build_with_expected_shapes() {
        let cfg = DemoConfig {
            vocab: 64,
            dim: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            seed: 1,
        };
        let g = build_graph(&cfg, Phase::Prefill, 5).unwrap();
        assert_eq!(g.outputs().len(), 1 + 2 * cfg.layers);
        assert_eq!(g.spec(g.outputs()[0]).unwrap().shape, vec![1, 5, 64]);
        let d = build_graph(&cfg, Phase::Decode, 5).unwrap();
        assert_eq!(
            d.spec(d.outputs()[1]).unwrap().shape,
            vec![1, 6, cfg.kv_dim()]
        );
        assert!(build_graph(&DemoConfig { heads: 5, ..cfg }, Phase::Prefill, 4).is_err());
    }

    #[test]
    fn weights_are_deterministic() {
        let a = random_tensor(&[3, 4], 4, 7).unwrap();
        let b = random_tensor(&[3, 4], 4, 7).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, random_tensor(&[3, 4], 4, 8).unwrap());
    }
}
