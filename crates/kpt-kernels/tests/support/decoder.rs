//! A two-layer LLaMA-style decoder graph in f32 with random weights, prefill and decode,
//! shared by the activation-precision tests of kpt-kernels (CPU, H100 description) and
//! kpt-nvidia (on the GPU).

use kpt_core::exec::Executor;
use kpt_core::graph::{AttentionParams, Graph, Op};
use kpt_core::rand::SplitMix64 as Rng;
use kpt_core::validate::{run_reference, validate_plan};
use kpt_core::{DType, Tensor};
use kpt_kernels::CpuReference;

pub const HEAD: usize = 64;
pub const HEADS: usize = 2;
pub const KV_HEADS: usize = 1;
pub const VOCAB: usize = 48;
pub const PROMPT: usize = 5;

pub fn random(rng: &mut Rng, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape).unwrap()
}

/// A two-layer LLaMA-style decoder in f32 (tied embeddings): prefill takes ids and
/// positions, decode also the past keys and values of each layer. Outputs: logits, then
/// each layer's keys and values.
pub fn decoder(decode: bool) -> Graph {
    let (d, kvd) = (HEADS * HEAD, KV_HEADS * HEAD);
    let s = if decode { 1 } else { PROMPT };
    let mut rng = Rng::new(7);
    let mut g = Graph::new();
    let ids = g.input("ids", DType::I64, &[1, s]);
    let pos = g.input("pos", DType::I64, &[s]);
    let past: Vec<_> = (0..2)
        .filter(|_| decode)
        .map(|l| {
            (
                g.input(format!("past.{l}.k"), DType::F32, &[1, PROMPT, kvd]),
                g.input(format!("past.{l}.v"), DType::F32, &[1, PROMPT, kvd]),
            )
        })
        .collect();
    let table = g.param("embed", random(&mut rng, &[VOCAB, d], 1.0));
    let mut x = g.op("embed", Op::Embedding, &[ids, table]).unwrap();
    let mut caches = Vec::new();
    let rot = Op::Rotary {
        head_dim: HEAD,
        theta: 10000.0,
        scaling: None,
    };
    for l in 0..2 {
        let p = |n: &str| format!("layers.{l}.{n}");
        let ones = Tensor::from_vec(vec![1f32; d], &[d]).unwrap();
        let n1 = g.param(p("norm1"), ones.clone());
        let n2 = g.param(p("norm2"), ones);
        let w = |rng: &mut Rng, g: &mut Graph, n: &str, o: usize, i: usize| {
            g.param(p(n), random(rng, &[o, i], 1.0 / (i as f32).sqrt()))
        };
        let (wq, wk, wv) = (
            w(&mut rng, &mut g, "q", d, d),
            w(&mut rng, &mut g, "k", kvd, d),
            w(&mut rng, &mut g, "v", kvd, d),
        );
        let wo = w(&mut rng, &mut g, "o", d, d);
        let (wg, wu, wdn) = (
            w(&mut rng, &mut g, "gate", 2 * d, d),
            w(&mut rng, &mut g, "up", 2 * d, d),
            w(&mut rng, &mut g, "down", d, 2 * d),
        );
        let lin = Op::Linear { bias: false };
        let h = g
            .op(p("norm1"), Op::RmsNorm { eps: 1e-5 }, &[x, n1])
            .unwrap();
        let q = g.op(p("q"), lin.clone(), &[h, wq]).unwrap();
        let k = g.op(p("k"), lin.clone(), &[h, wk]).unwrap();
        let mut v = g.op(p("v"), lin.clone(), &[h, wv]).unwrap();
        let q = g.op(p("q_rot"), rot.clone(), &[q, pos]).unwrap();
        let mut k = g.op(p("k_rot"), rot.clone(), &[k, pos]).unwrap();
        if let Some(&(pk, pv)) = past.get(l) {
            k = g
                .op(p("k_cache"), Op::Concat { axis: 1 }, &[pk, k])
                .unwrap();
            v = g
                .op(p("v_cache"), Op::Concat { axis: 1 }, &[pv, v])
                .unwrap();
        }
        caches.push((k, v));
        let attn = Op::Attention(AttentionParams::new(HEADS, KV_HEADS, HEAD, true));
        let a = g.op(p("attn"), attn, &[q, k, v]).unwrap();
        let o = g.op(p("o"), lin.clone(), &[a, wo]).unwrap();
        x = g.op(p("residual1"), Op::Add, &[x, o]).unwrap();
        let h = g
            .op(p("norm2"), Op::RmsNorm { eps: 1e-5 }, &[x, n2])
            .unwrap();
        let gate = g.op(p("gate"), lin.clone(), &[h, wg]).unwrap();
        let gate = g
            .op(
                p("act"),
                Op::Activation {
                    act: kpt_core::graph::Activation::Silu,
                },
                &[gate],
            )
            .unwrap();
        let up = g.op(p("up"), lin.clone(), &[h, wu]).unwrap();
        let m = g.op(p("mul"), Op::Mul, &[gate, up]).unwrap();
        let m = g.op(p("down"), lin, &[m, wdn]).unwrap();
        x = g.op(p("residual2"), Op::Add, &[x, m]).unwrap();
    }
    let logits = g
        .op("lm_head", Op::Linear { bias: false }, &[x, table])
        .unwrap();
    g.output(logits).unwrap();
    for (k, v) in caches {
        g.output(k).unwrap();
        g.output(v).unwrap();
    }
    g
}

pub fn step_inputs(ids: &[i64], start: usize, caches: &[Tensor]) -> Vec<Tensor> {
    let n = ids.len();
    let mut v = vec![
        Tensor::from_vec(ids.to_vec(), &[1, n]).unwrap(),
        Tensor::from_vec((start..start + n).map(|p| p as i64).collect(), &[n]).unwrap(),
    ];
    v.extend(caches.iter().cloned());
    v
}

fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let m = w.iter().fold(0f64, |m, x| m.max(x.abs()));
    let e = g
        .iter()
        .zip(&w)
        .fold(0f64, |e, (a, b)| e.max((a - b).abs()));
    e / m.max(1e-30)
}

/// Checks balanced plans of [`decoder`]'s graphs (`pre` of `prefill`, `dec` of `decode`)
/// that compute in bf16: each validated against the f64 reference within the
/// balanced budget (decode on the reference's caches, given in f32 as the original graph
/// declares them), then generation with the plans' own bf16 caches passed from prefill to
/// decode, logits in f32.
pub fn check_balanced_bf16(
    (prefill, decode): (&Graph, &Graph),
    pre: &mut Executor,
    dec: &mut Executor,
) {
    let prompt: Vec<i64> = (0..PROMPT as i64)
        .map(|i| (i * 7 + 3) % VOCAB as i64)
        .collect();
    let pre_in = step_inputs(&prompt, 0, &[]);
    let report = validate_plan(pre, prefill, &CpuReference, &pre_in, 1.0).unwrap();
    assert!(report.passed(), "prefill: {report:#?}");
    let reference = run_reference(prefill, &CpuReference, &pre_in).unwrap();
    let caches: Vec<Tensor> = reference[1..]
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let dec_in = step_inputs(&[prompt[0]], PROMPT, &caches);
    let report = validate_plan(dec, decode, &CpuReference, &dec_in, 1.0).unwrap();
    assert!(report.passed(), "decode: {report:#?}");
    let outs = pre.run(&pre_in).unwrap();
    assert_eq!(outs[0].dtype(), DType::F32);
    assert!(outs[1..].iter().all(|t| t.dtype() == DType::BF16));
    let step = dec
        .run(&step_inputs(&[prompt[0]], PROMPT, &outs[1..]))
        .unwrap();
    let want = run_reference(decode, &CpuReference, &dec_in).unwrap();
    assert_eq!(step[0].dtype(), DType::F32);
    for (i, (g, w)) in step.iter().zip(&want).enumerate() {
        let e = rel_err(g, w);
        assert!(e <= 5e-2, "decode output {i}: {e:.3e}");
    }
}
