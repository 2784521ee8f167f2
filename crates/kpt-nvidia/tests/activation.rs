//! Activation precision on a real GPU: an f32 LLaMA-style decoder optimized for the
//! CUDA backend at the balanced level computes in bf16 (flash attention, bf16 caches)
//! and stays within the balanced budget of the f64 reference, prefill caches feeding
//! decode. Without a CUDA device the test returns after printing one `SKIPPED` line;
//! with `KPT_REQUIRE_GPU=1` a missing device fails it.

use std::io::Write;
use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::graph::{AttentionParams, Graph, Op};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::rand::SplitMix64 as Rng;
use kpt_core::validate::{run_reference, validate_plan};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::{CpuReference, KernelRegistry};
use kpt_nvidia::{CudaBackend, CudaOptions};

/// The backend on device 0, or `None` (after saying so) when there is no GPU.
fn backend() -> Option<Arc<dyn Backend>> {
    let required = std::env::var("KPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let found = kpt_nvidia::devices().map(|d| d.len()).unwrap_or(0);
    if found == 0 {
        assert!(!required, "KPT_REQUIRE_GPU=1 but no CUDA device is visible");
        let _ = writeln!(
            std::io::stderr(),
            "kpt-nvidia activation test SKIPPED: no CUDA device"
        );
        return None;
    }
    let b = CudaBackend::new(0, CudaOptions::default()).expect("CUDA backend on device 0");
    Some(Arc::new(b))
}

const HEAD: usize = 64;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const VOCAB: usize = 48;
const PROMPT: usize = 5;

fn random(rng: &mut Rng, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape).unwrap()
}

/// A two-layer LLaMA-style decoder in f32 (tied embeddings): prefill takes ids and
/// positions, decode also the past keys and values of each layer. Outputs: logits, then
/// each layer's keys and values.
fn decoder(decode: bool) -> Graph {
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

fn step_inputs(ids: &[i64], start: usize, caches: &[Tensor]) -> Vec<Tensor> {
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

#[test]
fn balanced_plans_run_in_bf16_within_the_budget() {
    let Some(backend) = backend() else { return };
    let registry = KernelRegistry::with_builtin();
    let executor = |graph: &Graph| {
        let plan = auto_optimize(
            graph,
            OptLevel::Balanced,
            &PrecisionPolicy::default(),
            &registry,
            backend.device(),
        )
        .expect("plan");
        for (node, choice) in plan.graph.nodes().iter().zip(&plan.kernels) {
            if matches!(node.op, Op::Attention(_)) {
                assert!(
                    choice.kernel.starts_with("cuda.attention.flash"),
                    "{}: {}",
                    node.name,
                    choice.kernel
                );
                let q = plan.graph.spec(node.inputs[0]).unwrap().dtype;
                assert_eq!(q, DType::BF16, "{}", node.name);
            }
        }
        Executor::new(plan, backend.clone()).expect("executor")
    };
    let (prefill, decode) = (decoder(false), decoder(true));
    let (mut pre, mut dec) = (executor(&prefill), executor(&decode));
    let prompt: Vec<i64> = (0..PROMPT as i64)
        .map(|i| (i * 7 + 3) % VOCAB as i64)
        .collect();
    let pre_in = step_inputs(&prompt, 0, &[]);
    let report = validate_plan(&mut pre, &prefill, &CpuReference, &pre_in, 1.0).unwrap();
    assert!(report.passed(), "prefill: {report:#?}");
    let reference = run_reference(&prefill, &CpuReference, &pre_in).unwrap();
    let caches: Vec<Tensor> = reference[1..]
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let dec_in = step_inputs(&[prompt[0]], PROMPT, &caches);
    let report = validate_plan(&mut dec, &decode, &CpuReference, &dec_in, 1.0).unwrap();
    assert!(report.passed(), "decode: {report:#?}");
    let outs = pre.run(&pre_in).unwrap();
    assert_eq!(outs[0].dtype(), DType::F32);
    assert!(outs[1..].iter().all(|t| t.dtype() == DType::BF16));
    let step = dec
        .run(&step_inputs(&[prompt[0]], PROMPT, &outs[1..]))
        .unwrap();
    let want = run_reference(&decode, &CpuReference, &dec_in).unwrap();
    for (i, (g, w)) in step.iter().zip(&want).enumerate() {
        let e = rel_err(g, w);
        assert!(e <= 5e-2, "decode output {i}: {e:.3e}");
    }
}
