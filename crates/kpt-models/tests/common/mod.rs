//! Shared by the integration tests: raw weights read straight from the safetensors
//! files, plain f64 forward passes written from the Hugging Face model definitions
//! (independent of kpt's graph, ops and kernels), and runners for kpt's plans.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::validate::run_reference;
use kpt_core::{Graph, OptLevel, Tensor};
use kpt_kernels::{CpuBackend, CpuReference, KernelRegistry};
use kpt_models::generate::decode_step_inputs;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

/// Every tensor of a checkpoint directory as f64, decoded by hand from the raw bytes.
pub struct Raw(pub HashMap<String, (Vec<usize>, Vec<f64>)>);

impl Raw {
    pub fn read(dir: &Path) -> Raw {
        let mut map = HashMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let data = view.data();
                let values: Vec<f64> = match view.dtype() {
                    Dtype::F32 => data
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                        .collect(),
                    // bf16 is the upper half of an f32.
                    Dtype::BF16 => data
                        .chunks_exact(2)
                        .map(|c| {
                            f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16) as f64
                        })
                        .collect(),
                    Dtype::F16 => data
                        .chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
                        .collect(),
                    d => panic!("unexpected dtype {d:?}"),
                };
                map.insert(name, (view.shape().to_vec(), values));
            }
        }
        Raw(map)
    }

    pub fn get(&self, name: &str) -> &[f64] {
        &self.0.get(name).unwrap_or_else(|| panic!("no {name}")).1
    }

    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// Rewrites `dir/model.safetensors` with every tensor name passed through `rename`.
pub fn rename_tensors(dir: &Path, rename: impl Fn(&str) -> String) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (rename(&name), view))
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, out).unwrap();
}

/// Reads the raw tensors of `dir` with every name passed through `rename`.
pub fn renamed(raw: Raw, rename: impl Fn(&str) -> String) -> Raw {
    Raw(raw.0.into_iter().map(|(k, v)| (rename(&k), v)).collect())
}

/// `x [rows, k] · w[out, k]^T (+ b)`.
pub fn linear(x: &[Vec<f64>], w: &[f64], b: Option<&[f64]>, out: usize) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            let k = row.len();
            (0..out)
                .map(|o| {
                    let dot: f64 = (0..k).map(|i| row[i] * w[o * k + i]).sum();
                    dot + b.map_or(0.0, |b| b[o])
                })
                .collect()
        })
        .collect()
}

/// `x [rows, in] · w[in, out]` (GPT-2's Conv1D) `+ b`.
pub fn conv1d(x: &[Vec<f64>], w: &[f64], b: &[f64], out: usize) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            (0..out)
                .map(|o| {
                    b[o] + row
                        .iter()
                        .enumerate()
                        .map(|(i, v)| v * w[i * out + o])
                        .sum::<f64>()
                })
                .collect()
        })
        .collect()
}

pub fn rms_norm(x: &[Vec<f64>], w: &[f64], eps: f64) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter().zip(w).map(|(v, g)| v * inv * g).collect()
        })
        .collect()
}

pub fn layer_norm(x: &[Vec<f64>], w: &[f64], b: &[f64], eps: f64) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            let n = row.len() as f64;
            let mean = row.iter().sum::<f64>() / n;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
            let inv = 1.0 / (var + eps).sqrt();
            row.iter()
                .enumerate()
                .map(|(i, v)| (v - mean) * inv * w[i] + b[i])
                .collect()
        })
        .collect()
}

pub fn add(a: &mut [Vec<f64>], b: &[Vec<f64>]) {
    for (r, s) in a.iter_mut().zip(b) {
        for (x, y) in r.iter_mut().zip(s) {
            *x += y;
        }
    }
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// erf by its Taylor series (|x| < 3) or continued fraction, accurate to ~1e-14.
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let v = if a < 3.0 {
        let mut term = a;
        let mut sum = a;
        let mut n = 0.0;
        loop {
            n += 1.0;
            term *= -a * a / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(a) = exp(-a^2)/sqrt(pi) * 1/(a + 1/2/(a + 1/(a + 3/2/(a + ...))))
        let mut f = a;
        for k in (1..60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
    };
    v.copysign(x)
}

pub fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

/// HF's `apply_rotary_pos_emb`: `x * cos + rotate_half(x) * sin` per head, with
/// `cos`/`sin` of `cat(freqs, freqs)` (times HF's `attention_scaling`) and
/// `rotate_half(x) = cat(-x2, x1)`; `freqs = position * inv_freq`.
pub fn rope(x: &mut [Vec<f64>], positions: &[usize], inv_freq: &[f64], attention_scaling: f64) {
    let half = inv_freq.len();
    let head_dim = 2 * half;
    for (row, &p) in x.iter_mut().zip(positions) {
        for head in row.chunks_mut(head_dim) {
            // emb = cat(freqs, freqs)
            let emb: Vec<f64> = (0..head_dim)
                .map(|i| p as f64 * inv_freq[i % half])
                .collect();
            let rotated: Vec<f64> = (0..head_dim)
                .map(|i| {
                    if i < half {
                        -head[i + half]
                    } else {
                        head[i - half]
                    }
                })
                .collect();
            for i in 0..head_dim {
                let cos = emb[i].cos() * attention_scaling;
                let sin = emb[i].sin() * attention_scaling;
                head[i] = head[i] * cos + rotated[i] * sin;
            }
        }
    }
}

/// The rotary parameters of a config.json, read straight from the JSON: `rope_theta`,
/// `max_position_embeddings` and the `rope_scaling` object as Hugging Face stores it.
#[derive(Debug, Clone)]
pub struct HfRope {
    pub theta: f64,
    pub max_position_embeddings: f64,
    pub scaling: Option<serde_json::Value>,
}

impl HfRope {
    /// Unscaled rotary with base `theta`.
    pub fn plain(theta: f64) -> HfRope {
        HfRope {
            theta,
            max_position_embeddings: 2048.0,
            scaling: None,
        }
    }

    /// From a config.json value (HF's defaults: theta 10000, 2048 positions).
    pub fn from_config(cfg: &serde_json::Value) -> HfRope {
        HfRope {
            theta: cfg["rope_theta"].as_f64().unwrap_or(10000.0),
            max_position_embeddings: cfg["max_position_embeddings"].as_f64().unwrap_or(2048.0),
            scaling: cfg.get("rope_scaling").filter(|v| !v.is_null()).cloned(),
        }
    }

    /// `(inv_freq, attention_scaling)` as the rope init functions of
    /// `modeling_rope_utils.py` compute them for head size `dim`, `seq_len` being the
    /// length `dynamic_rope_update` passes (the largest position + 1).
    pub fn params(&self, dim: usize, seq_len: usize) -> (Vec<f64>, f64) {
        let d = dim as f64;
        // 1.0 / (base ** (arange(0, dim, 2) / dim))
        let default = |base: f64| -> Vec<f64> {
            (0..dim)
                .step_by(2)
                .map(|j| 1.0 / base.powf(j as f64 / d))
                .collect()
        };
        let Some(sc) = &self.scaling else {
            return (default(self.theta), 1.0);
        };
        let ty = sc
            .get("rope_type")
            .or_else(|| sc.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let num = |k: &str| sc.get(k).and_then(|v| v.as_f64());
        let factor = num("factor");
        match ty {
            "default" => (default(self.theta), 1.0),
            "linear" => {
                let f = factor.unwrap();
                (default(self.theta).iter().map(|x| x / f).collect(), 1.0)
            }
            "dynamic" => {
                let f = factor.unwrap();
                let max = self.max_position_embeddings;
                let seq = (seq_len as f64).max(max);
                let base = self.theta * ((f * seq / max) - (f - 1.0)).powf(d / (d - 2.0));
                (default(base), 1.0)
            }
            "llama3" => {
                let f = factor.unwrap();
                let low = num("low_freq_factor").unwrap();
                let high = num("high_freq_factor").unwrap();
                let old = num("original_max_position_embeddings").unwrap();
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                let inv = default(self.theta);
                // The torch.where sequence of `_compute_llama3_parameters`.
                let wavelen: Vec<f64> =
                    inv.iter().map(|x| 2.0 * std::f64::consts::PI / x).collect();
                let inv_llama: Vec<f64> = inv
                    .iter()
                    .zip(&wavelen)
                    .map(|(&x, &w)| if w > low_wavelen { x / f } else { x })
                    .collect();
                let out = inv_llama
                    .iter()
                    .zip(&wavelen)
                    .map(|(&x, &w)| {
                        let smooth = (old / w - low) / (high - low);
                        let smoothed = (1.0 - smooth) * x / f + smooth * x;
                        // ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
                        let medium = w >= high_wavelen && w <= low_wavelen;
                        if medium {
                            smoothed
                        } else {
                            x
                        }
                    })
                    .collect();
                (out, 1.0)
            }
            "yarn" => {
                let orig =
                    num("original_max_position_embeddings").unwrap_or(self.max_position_embeddings);
                let f = factor.unwrap_or(self.max_position_embeddings / orig);
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention = match (
                    num("attention_factor"),
                    num("mscale"),
                    num("mscale_all_dim"),
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        get_mscale(f, m) / get_mscale(f, a)
                    }
                    _ => get_mscale(f, 1.0),
                };
                let beta_fast = num("beta_fast").filter(|&b| b != 0.0).unwrap_or(32.0);
                let beta_slow = num("beta_slow").filter(|&b| b != 0.0).unwrap_or(1.0);
                let base = self.theta;
                let find_correction_dim = |rot: f64| {
                    (d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
                };
                let truncate = sc.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true);
                let (mut lo, mut hi) = (
                    find_correction_dim(beta_fast),
                    find_correction_dim(beta_slow),
                );
                if truncate {
                    lo = lo.floor();
                    hi = hi.ceil();
                }
                let (lo, mut hi) = (lo.max(0.0), hi.min(d - 1.0));
                if lo == hi {
                    hi += 0.001;
                }
                let pos_freqs: Vec<f64> = (0..dim)
                    .step_by(2)
                    .map(|j| base.powf(j as f64 / d))
                    .collect();
                let inv: Vec<f64> = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &pf)| {
                        let extrapolation = 1.0 / pf;
                        let interpolation = 1.0 / (f * pf);
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                (inv, attention)
            }
            other => panic!("rope type {other} not in the reference"),
        }
    }
}

/// Softmax attention of queries `q [S, H*D]` over keys/values `[T, Hkv*D]`; query `i`
/// sits at key position `offset + i`; `causal` hides later keys, `window` keys at
/// distance `window` or more.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[Vec<f64>],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
    window: Option<usize>,
) -> Vec<Vec<f64>> {
    let scale = 1.0 / (d as f64).sqrt();
    attention_scaled(q, k, v, heads, kv_heads, d, causal, window, scale)
}

/// [`attention`] with scores multiplied by `scale`.
#[allow(clippy::too_many_arguments)]
pub fn attention_scaled(
    q: &[Vec<f64>],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
    window: Option<usize>,
    scale: f64,
) -> Vec<Vec<f64>> {
    let offset = k.len() - q.len();
    let group = heads / kv_heads;
    q.iter()
        .enumerate()
        .map(|(i, qi)| {
            let at = offset + i;
            let mut out = vec![0.0; heads * d];
            for h in 0..heads {
                let kh = h / group;
                let visible: Vec<usize> = (0..k.len())
                    .filter(|&j| !causal || j <= at)
                    .filter(|&j| window.is_none_or(|w| at - j.min(at) < w))
                    .collect();
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        (0..d)
                            .map(|x| qi[h * d + x] * k[j][kh * d + x])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (w, &j) in e.iter().zip(&visible) {
                    for x in 0..d {
                        out[h * d + x] += w / z * v[j][kh * d + x];
                    }
                }
            }
            out
        })
        .collect()
}

/// Sizes the reference needs from a LLaMA config.json.
pub struct LlamaSizes {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub eps: f64,
    /// Rotary base and scaling.
    pub rope: HfRope,
    /// Attention window of each layer.
    pub windows: Vec<Option<usize>>,
}

impl LlamaSizes {
    /// The sizes of a parsed LLaMA-family config, with unscaled rotary embeddings.
    pub fn of(cfg: &kpt_models::ModelConfig) -> Self {
        let kpt_models::ModelConfig::Llama(c) = cfg else {
            panic!("not a LLaMA config")
        };
        LlamaSizes {
            vocab: c.vocab_size,
            dim: c.hidden_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            ffn: c.intermediate_size,
            eps: c.rms_norm_eps,
            rope: HfRope::plain(c.rope_theta),
            windows: (0..c.num_hidden_layers).map(|i| c.window(i)).collect(),
        }
    }
}

/// LLaMA / Mistral / Qwen2 logits `[S, vocab]` of `ids` at positions `0..S`, as
/// `modeling_llama.py` computes them.
pub fn llama_forward(raw: &Raw, s: &LlamaSizes, ids: &[i64]) -> Vec<Vec<f64>> {
    let embed = raw.get("model.embed_tokens.weight");
    let mut h: Vec<Vec<f64>> = ids
        .iter()
        .map(|&t| embed[t as usize * s.dim..(t as usize + 1) * s.dim].to_vec())
        .collect();
    let positions: Vec<usize> = (0..ids.len()).collect();
    let bias = |name: &str| raw.has(name).then(|| raw.get(name));
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        let x = rms_norm(&h, raw.get(&format!("{p}.input_layernorm.weight")), s.eps);
        let proj = |name: &str, x: &[Vec<f64>], out: usize| {
            linear(
                x,
                raw.get(&format!("{p}.{name}.weight")),
                bias(&format!("{p}.{name}.bias")),
                out,
            )
        };
        let mut q = proj("self_attn.q_proj", &x, s.heads * s.head_dim);
        let mut k = proj("self_attn.k_proj", &x, s.kv_heads * s.head_dim);
        let v = proj("self_attn.v_proj", &x, s.kv_heads * s.head_dim);
        // `dynamic_rope_update`: the sequence length is the largest position + 1.
        let (inv_freq, scaling) = s.rope.params(s.head_dim, ids.len());
        rope(&mut q, &positions, &inv_freq, scaling);
        rope(&mut k, &positions, &inv_freq, scaling);
        let a = attention(
            &q,
            &k,
            &v,
            s.heads,
            s.kv_heads,
            s.head_dim,
            true,
            s.windows[l],
        );
        add(&mut h, &proj("self_attn.o_proj", &a, s.dim));
        let x = rms_norm(
            &h,
            raw.get(&format!("{p}.post_attention_layernorm.weight")),
            s.eps,
        );
        let gate = proj("mlp.gate_proj", &x, s.ffn);
        let up = proj("mlp.up_proj", &x, s.ffn);
        let m: Vec<Vec<f64>> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect())
            .collect();
        add(&mut h, &proj("mlp.down_proj", &m, s.dim));
    }
    let x = rms_norm(&h, raw.get("model.norm.weight"), s.eps);
    let head = if raw.has("lm_head.weight") {
        raw.get("lm_head.weight")
    } else {
        embed
    };
    linear(&x, head, None, s.vocab)
}

/// The inputs of a prefill graph (no `cache`: ids `[1, S]`, positions `start..start +
/// S`) or of a decode step of the one token in `ids` at `start` with the layers' caches
/// (grown where full, see `kpt_models::generate::decode_step_inputs`).
pub fn inputs(ids: &[i64], start: usize, cache: &[Tensor]) -> Vec<Tensor> {
    if !cache.is_empty() {
        assert_eq!(ids.len(), 1, "a decode step takes one token");
        return decode_step_inputs(ids[0], start, cache.to_vec()).unwrap();
    }
    let n = ids.len();
    vec![
        Tensor::from_vec(ids.to_vec(), &[1, n]).unwrap(),
        Tensor::from_vec((start..start + n).map(|p| p as i64).collect(), &[n]).unwrap(),
    ]
}

/// Runs `graph` on kpt's f64 reference.
pub fn run_ref(graph: &Graph, inputs: &[Tensor]) -> Vec<Tensor> {
    run_reference(graph, &CpuReference, inputs).unwrap()
}

/// An executor of `graph` optimized at `level` for the CPU.
pub fn executor(graph: &Graph, level: OptLevel) -> Executor {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let plan = auto_optimize(
        graph,
        level,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap_or_else(|e| panic!("auto_optimize at {level}: {e}"));
    Executor::new(plan, backend).unwrap()
}

/// End-to-end error budget of a level (relative to the largest reference logit).
pub fn budget(level: OptLevel) -> f64 {
    match level {
        OptLevel::Conservative => 1e-4,
        OptLevel::Balanced => 5e-2,
        OptLevel::Aggressive => 2.5e-1,
    }
}

/// `max |got - want| / max |want|` of a tensor against nested reference rows.
pub fn rel_err(got: &Tensor, want: &[Vec<f64>]) -> f64 {
    let g = got.to_f64_vec();
    let w: Vec<f64> = want.iter().flatten().copied().collect();
    assert_eq!(g.len(), w.len(), "element count");
    let max = w.iter().fold(0f64, |m, x| m.max(x.abs()));
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0f64, f64::max);
    assert!(worst.is_finite(), "non-finite output");
    worst / max.max(1e-30)
}

/// Rows `[n, width]` of a tensor `[1, n, width]`.
pub fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    let width = *t.shape().last().unwrap();
    t.to_f64_vec().chunks(width).map(<[f64]>::to_vec).collect()
}

/// GPT-2 logits `[S, vocab]` of `ids` at positions `0..S`, as `modeling_gpt2.py`
/// computes them (Conv1D weights `[in, out]`, fused c_attn, tanh GELU, tied head).
pub fn gpt2_forward(
    raw: &Raw,
    d: usize,
    layers: usize,
    heads: usize,
    vocab: usize,
    ids: &[i64],
) -> Vec<Vec<f64>> {
    gpt2_forward_scaled(raw, (d, layers, heads, vocab), ids, false)
}

/// [`gpt2_forward`], with layer `l`'s scores divided by `l + 1` when
/// `inverse_layer_scaling` (`scale_attn_by_inverse_layer_idx`).
pub fn gpt2_forward_scaled(
    raw: &Raw,
    (d, layers, heads, vocab): (usize, usize, usize, usize),
    ids: &[i64],
    inverse_layer_scaling: bool,
) -> Vec<Vec<f64>> {
    let (wte, wpe) = (raw.get("wte.weight"), raw.get("wpe.weight"));
    let mut h: Vec<Vec<f64>> = ids
        .iter()
        .enumerate()
        .map(|(p, &t)| {
            (0..d)
                .map(|i| wte[t as usize * d + i] + wpe[p * d + i])
                .collect()
        })
        .collect();
    let eps = 1e-5;
    for l in 0..layers {
        let p = format!("h.{l}");
        let g = |n: &str| raw.get(&format!("{p}.{n}"));
        let x = layer_norm(&h, g("ln_1.weight"), g("ln_1.bias"), eps);
        let qkv = conv1d(&x, g("attn.c_attn.weight"), g("attn.c_attn.bias"), 3 * d);
        let q: Vec<Vec<f64>> = qkv.iter().map(|r| r[..d].to_vec()).collect();
        let k: Vec<Vec<f64>> = qkv.iter().map(|r| r[d..2 * d].to_vec()).collect();
        let v: Vec<Vec<f64>> = qkv.iter().map(|r| r[2 * d..].to_vec()).collect();
        let mut scale = 1.0 / ((d / heads) as f64).sqrt();
        if inverse_layer_scaling {
            scale /= (l + 1) as f64;
        }
        let a = attention_scaled(&q, &k, &v, heads, heads, d / heads, true, None, scale);
        add(
            &mut h,
            &conv1d(&a, g("attn.c_proj.weight"), g("attn.c_proj.bias"), d),
        );
        let x = layer_norm(&h, g("ln_2.weight"), g("ln_2.bias"), eps);
        let f = g("mlp.c_fc.bias").len();
        let m: Vec<Vec<f64>> = conv1d(&x, g("mlp.c_fc.weight"), g("mlp.c_fc.bias"), f)
            .into_iter()
            .map(|r| r.into_iter().map(gelu_tanh).collect())
            .collect();
        add(
            &mut h,
            &conv1d(&m, g("mlp.c_proj.weight"), g("mlp.c_proj.bias"), d),
        );
    }
    let x = layer_norm(&h, raw.get("ln_f.weight"), raw.get("ln_f.bias"), eps);
    linear(&x, wte, None, vocab)
}

/// BERT's last hidden state `[S, d]`, as `modeling_bert.py` computes it (post-LN,
/// erf GELU, bidirectional attention).
pub fn bert_forward(
    raw: &Raw,
    d: usize,
    layers: usize,
    heads: usize,
    eps: f64,
    ids: &[i64],
    types: &[i64],
) -> Vec<Vec<f64>> {
    let e = |n: &str| raw.get(&format!("embeddings.{n}"));
    let (word, pos, typ) = (
        e("word_embeddings.weight"),
        e("position_embeddings.weight"),
        e("token_type_embeddings.weight"),
    );
    let h: Vec<Vec<f64>> = ids
        .iter()
        .zip(types)
        .enumerate()
        .map(|(p, (&t, &y))| {
            (0..d)
                .map(|i| word[t as usize * d + i] + pos[p * d + i] + typ[y as usize * d + i])
                .collect()
        })
        .collect();
    let mut h = layer_norm(&h, e("LayerNorm.weight"), e("LayerNorm.bias"), eps);
    for l in 0..layers {
        let p = format!("encoder.layer.{l}");
        let g = |n: &str| raw.get(&format!("{p}.{n}"));
        let lin = |x: &[Vec<f64>], n: &str, out: usize| {
            linear(
                x,
                g(&format!("{n}.weight")),
                Some(g(&format!("{n}.bias"))),
                out,
            )
        };
        let q = lin(&h, "attention.self.query", d);
        let k = lin(&h, "attention.self.key", d);
        let v = lin(&h, "attention.self.value", d);
        let a = attention(&q, &k, &v, heads, heads, d / heads, false, None);
        let mut r = lin(&a, "attention.output.dense", d);
        add(&mut r, &h);
        h = layer_norm(
            &r,
            g("attention.output.LayerNorm.weight"),
            g("attention.output.LayerNorm.bias"),
            eps,
        );
        let f = g("intermediate.dense.bias").len();
        let m: Vec<Vec<f64>> = lin(&h, "intermediate.dense", f)
            .into_iter()
            .map(|r| r.into_iter().map(gelu_erf).collect())
            .collect();
        let mut r = lin(&m, "output.dense", d);
        add(&mut r, &h);
        h = layer_norm(
            &r,
            g("output.LayerNorm.weight"),
            g("output.LayerNorm.bias"),
            eps,
        );
    }
    h
}
