//! Shared by the integration tests: the plugin, random tensors, a decoder block.

#![allow(dead_code)]

use std::path::Path;
use std::sync::{Arc, OnceLock};

use kpt_core::graph::{Activation, AttentionParams, Op};
use kpt_core::rand::SplitMix64;
use kpt_core::{DType, Graph, Tensor};
use kpt_tpu::{find_plugin, Client, Plugin, PluginKind};

/// The CPU plugin from `KPT_PJRT_PLUGIN` or `target/pjrt-venv`; `None` (with a note) when
/// neither has one, unless `KPT_REQUIRE_PJRT=1`, which makes that a failure.
pub fn plugin() -> Option<Arc<Plugin>> {
    static PLUGIN: OnceLock<Option<Arc<Plugin>>> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/pjrt-venv");
            let loaded = Plugin::from_env()
                .or_else(|| find_plugin(&venv, PluginKind::Cpu).map(Plugin::load));
            match loaded {
                Some(p) => Some(p.expect("the PJRT plugin loads")),
                None if std::env::var("KPT_REQUIRE_PJRT").is_ok_and(|v| v == "1") => {
                    panic!("KPT_REQUIRE_PJRT=1 but no PJRT plugin: set KPT_PJRT_PLUGIN or run `cargo xtask pjrt-plugin`")
                }
                None => {
                    eprintln!("skipped: no PJRT plugin (run `cargo xtask pjrt-plugin`)");
                    None
                }
            }
        })
        .clone()
}

/// A client of the plugin, if there is one.
pub fn client() -> Option<Client> {
    plugin().map(|p| Client::new(&p).expect("client"))
}

/// Uniform values in [-1, 1) of `dtype`.
pub fn random(rng: &mut SplitMix64, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| f64::from(rng.uniform(-1.0, 1.0))).collect();
    Tensor::from_f64(&v, shape, dtype).unwrap()
}

/// An index tensor.
pub fn ints(values: &[i64], shape: &[usize], dtype: DType) -> Tensor {
    let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
    Tensor::from_f64(&v, shape, dtype).unwrap()
}

/// The decoder block's vocabulary.
pub const VOCAB: usize = 50;

/// A LLaMA-shaped decoder block (embedding, RMSNorm, fused q/k/v projection with split
/// and rotary, causal GQA attention, residual norms, SwiGLU MLP, output layer and
/// greedy token), f32 weights as parameters, and its inputs (ids `[1, 7]`, positions
/// `[7]`).
pub fn decoder_block() -> (Graph, Vec<Tensor>) {
    let (seq, hidden, heads, kv, d, inter, vocab) = (7usize, 64, 4, 2, 16, 96, VOCAB);
    let mut rng = SplitMix64::new(5);
    let mut g = Graph::new();
    let mut param = |g: &mut Graph, name: &str, shape: &[usize]| {
        let mut t = random(&mut rng, shape, DType::F32);
        if shape.len() == 2 {
            // Scale weights so activations stay O(1) through the block.
            let s = 1.0 / (shape[1] as f64).sqrt();
            let v: Vec<f64> = t.to_f64_vec().iter().map(|x| x * s).collect();
            t = Tensor::from_f64(&v, shape, DType::F32).unwrap();
        }
        g.param(name, t)
    };
    let ids = g.input("ids", DType::I64, &[1, seq]);
    let pos = g.input("positions", DType::I64, &[seq]);
    let table = param(&mut g, "embed", &[vocab, hidden]);
    let norm1 = param(&mut g, "norm1", &[hidden]);
    let wqkv = param(&mut g, "wqkv", &[(heads + 2 * kv) * d, hidden]);
    let wo = param(&mut g, "wo", &[hidden, heads * d]);
    let norm2 = param(&mut g, "norm2", &[hidden]);
    let wgu = param(&mut g, "wgate_up", &[2 * inter, hidden]);
    let wdown = param(&mut g, "wdown", &[hidden, inter]);
    let norm3 = param(&mut g, "norm3", &[hidden]);
    let head = param(&mut g, "lm_head", &[vocab, hidden]);
    let x = g.op("embed", Op::Embedding, &[ids, table]).unwrap();
    let h = g
        .op("norm1", Op::RmsNorm { eps: 1e-5 }, &[x, norm1])
        .unwrap();
    let qkv = g.op("qkv", Op::Linear { bias: false }, &[h, wqkv]).unwrap();
    let parts = g
        .op_multi(
            "rope",
            Op::SplitRotary {
                head_dim: d,
                theta: 10000.0,
                scaling: None,
                sizes: vec![heads * d, kv * d, kv * d],
                cache: false,
            },
            &[qkv, pos],
        )
        .unwrap();
    let att = g
        .op(
            "attn",
            Op::Attention(AttentionParams::new(heads, kv, d, true)),
            &[parts[0], parts[1], parts[2]],
        )
        .unwrap();
    let o = g.op("o", Op::Linear { bias: false }, &[att, wo]).unwrap();
    let sums = g
        .op_multi("norm2", Op::AddRmsNorm { eps: 1e-5 }, &[o, x, norm2])
        .unwrap();
    let gu = g
        .op("gate_up", Op::Linear { bias: false }, &[sums[1], wgu])
        .unwrap();
    let act = g
        .op(
            "swiglu",
            Op::ActAndMul {
                act: Activation::Silu,
            },
            &[gu],
        )
        .unwrap();
    let down = g
        .op("down", Op::Linear { bias: false }, &[act, wdown])
        .unwrap();
    let out = g
        .op_multi(
            "norm3",
            Op::AddRmsNorm { eps: 1e-5 },
            &[down, sums[0], norm3],
        )
        .unwrap();
    let logits = g
        .op("lm_head", Op::Linear { bias: false }, &[out[1], head])
        .unwrap();
    let next = g.op("argmax", Op::ArgMax, &[logits]).unwrap();
    g.output(logits).unwrap();
    g.output(next).unwrap();

    let id_values: Vec<i64> = (0..seq as i64)
        .map(|i| (i * 7 + 3) % vocab as i64)
        .collect();
    let inputs = vec![
        ints(&id_values, &[1, seq], DType::I64),
        ints(&(0..seq as i64).collect::<Vec<_>>(), &[seq], DType::I64),
    ];
    (g, inputs)
}
