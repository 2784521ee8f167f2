//! Attention dropout (training): the reference applies the Philox decisions of
//! `AttentionDropout::keeps`; its forward pass is checked against a naive computation
//! written here (its backward pass against central differences in `cpu_kernels.rs`), and
//! the registry sends dropout only to kernels that apply it.

use kpt_core::backend::{run_op, Backend};
use kpt_core::graph::{AttentionDropout, AttentionParams, Op};
use kpt_core::rand::SplitMix64 as Rng;
use kpt_core::validate::ReferenceOps;
use kpt_core::{DType, KptError, Tensor, TensorSpec};
use kpt_kernels::cpu::{reference as r, AttentionShape, ShapeDropout};
use kpt_kernels::{CpuBackend, CpuReference, KernelRegistry};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

fn fail(e: KptError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

fn values(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0) as f64).collect()
}

fn with_dropout(shape: AttentionShape, mask: AttentionDropout) -> AttentionShape {
    AttentionShape {
        dropout: Some(ShapeDropout {
            mask,
            first_batch: 0,
            first_query: 0,
        }),
        ..shape
    }
}

/// Attention written out for one query row at a time: scores over the keys the query
/// sees, their softmax, the dropout decisions applied, the weighted sum of v.
fn naive(s: &AttentionShape, d: AttentionDropout, (q, k, v): (&[f64], &[f64], &[f64])) -> Vec<f64> {
    let hd = s.head_dim;
    let mut out = vec![0.0; s.q_len()];
    for b in 0..s.batch {
        for h in 0..s.num_heads {
            let g = h / (s.num_heads / s.num_kv_heads);
            for i in 0..s.seq_q {
                let qi = &q[(b * s.seq_q + i) * s.num_heads * hd + h * hd..][..hd];
                let keys: Vec<usize> = (0..s.seq_kv)
                    .filter(|&j| !s.causal || j + s.seq_q <= i + s.seq_kv)
                    .collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let kj = &k[(b * s.seq_kv + j) * s.num_kv_heads * hd + g * hd..][..hd];
                        qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f64>() * s.scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                let o = &mut out[(b * s.seq_q + i) * s.num_heads * hd + h * hd..][..hd];
                for (&j, x) in keys.iter().zip(&scores) {
                    if !d.keeps(b, h, i, j) {
                        continue;
                    }
                    let p = (x - max).exp() / sum / (1.0 - f64::from(d.p));
                    let vj = &v[(b * s.seq_kv + j) * s.num_kv_heads * hd + g * hd..][..hd];
                    o.iter_mut().zip(vj).for_each(|(oc, vc)| *oc += p * vc);
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The reference's forward pass with dropout equals the naive computation.
    #[test]
    fn reference_forward_applies_the_decisions(
        batch in 1usize..=2, seq_q in 1usize..=9, seq_kv in 1usize..=13, kv_heads in 1usize..=2,
        ratio in 1usize..=2, head_dim in 1usize..=5, causal in any::<bool>(),
        p in 0.0f32..0.9, dropout_seed in any::<u64>(), seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let d = AttentionDropout { p, seed: dropout_seed };
        let shape = with_dropout(
            AttentionShape::new(batch, seq_q, seq_kv, kv_heads * ratio, kv_heads, head_dim, causal),
            d,
        );
        let (q, k, v) = (
            values(&mut rng, shape.q_len()),
            values(&mut rng, shape.kv_len()),
            values(&mut rng, shape.kv_len()),
        );
        let mut out = vec![0.0; shape.q_len()];
        r::attention(&q, &k, &v, None, &mut out, &shape).map_err(fail)?;
        let want = naive(&shape, d, (&q, &k, &v));
        for (idx, (a, b)) in out.iter().zip(&want).enumerate() {
            prop_assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "out[{idx}]: {a} vs {b}");
        }
    }
}

/// q, k, v of a dense batch and the attention op with dropout.
fn dense_case(batch: usize, seq: usize, p: f32) -> (Op, Vec<Tensor>) {
    let params = AttentionParams {
        dropout: Some(AttentionDropout { p, seed: 11 }),
        ..AttentionParams::new(4, 2, 8, true)
    };
    let mut rng = Rng::new(5);
    let q = Tensor::from_f64(
        &values(&mut rng, batch * seq * 32),
        &[batch, seq, 32],
        DType::F32,
    );
    let k = Tensor::from_f64(
        &values(&mut rng, batch * seq * 16),
        &[batch, seq, 16],
        DType::F32,
    );
    let v = Tensor::from_f64(
        &values(&mut rng, batch * seq * 16),
        &[batch, seq, 16],
        DType::F32,
    );
    (
        Op::Attention(params),
        vec![q.unwrap(), k.unwrap(), v.unwrap()],
    )
}

#[test]
fn dropout_zero_changes_nothing_and_seeds_reproduce() {
    let (op, inputs) = dense_case(2, 7, 0.0);
    let Op::Attention(params) = op else {
        unreachable!()
    };
    let plain = Op::Attention(AttentionParams {
        dropout: None,
        ..params
    });
    let eval = |op: &Op| CpuReference.eval(op, &inputs).unwrap()[0].to_f64_vec();
    assert_eq!(eval(&op), eval(&plain));
    let with = |p: f32, seed: u64| {
        Op::Attention(AttentionParams {
            dropout: Some(AttentionDropout { p, seed }),
            ..params
        })
    };
    assert_eq!(eval(&with(0.3, 9)), eval(&with(0.3, 9)));
    assert_ne!(eval(&with(0.3, 9)), eval(&with(0.3, 10)));
}

#[test]
fn decisions_drop_the_asked_fraction_independently_of_position() {
    let d = AttentionDropout { p: 0.1, seed: 3 };
    let n = 200_000usize;
    let dropped = (0..n)
        .filter(|&x| !d.keeps(x % 3, (x / 3) % 5, (x / 15) % 41, x / 615))
        .count();
    let fraction = dropped as f64 / n as f64;
    // 0.1 with a standard deviation of 6.7e-4.
    assert!((fraction - 0.1).abs() < 0.004, "dropped {fraction}");
    // Neighbouring keys of one row are not correlated.
    let pairs = (0..n / 2)
        .filter(|&j| !d.keeps(0, 0, 0, 2 * j) && !d.keeps(0, 0, 0, 2 * j + 1))
        .count();
    let both = pairs as f64 / (n / 2) as f64;
    assert!((both - 0.01).abs() < 0.002, "both dropped {both}");
}

/// A variable-length batch applies to sequence `s` the decisions of batch entry `s`.
#[test]
fn varlen_sequences_take_their_index_as_batch() {
    let (op, inputs) = dense_case(2, 6, 0.4);
    let Op::Attention(params) = op else {
        unreachable!()
    };
    let dense = CpuReference.eval(&op, &inputs).unwrap()[0].to_f64_vec();
    let packed: Vec<Tensor> = inputs
        .iter()
        .map(|t| {
            let shape = t.shape();
            Tensor::from_f64(
                &t.to_f64_vec(),
                &[1, shape[0] * shape[1], shape[2]],
                DType::F32,
            )
            .unwrap()
        })
        .collect();
    let cu = Tensor::from_f64(&[0.0, 6.0, 12.0], &[3], DType::I64).unwrap();
    let varlen = Op::Attention(AttentionParams {
        varlen: true,
        ..params
    });
    let mut ins = packed;
    ins.extend([cu.clone(), cu]);
    let got = CpuReference.eval(&varlen, &ins).unwrap()[0].to_f64_vec();
    assert_eq!(got, dense);
    // The CPU kernel runs each sequence as a batch of one with the same decisions.
    let backend = CpuBackend::new().unwrap();
    let fast = run_op(&backend, "cpu.attention.flash", &varlen, &ins).unwrap()[0].to_f64_vec();
    for (a, b) in fast.iter().zip(&dense) {
        assert!((a - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

#[test]
fn only_kernels_that_apply_dropout_are_chosen() {
    let backend = CpuBackend::new().unwrap();
    let (op, inputs) = dense_case(1, 5, 0.2);
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let registry = KernelRegistry::with_builtin();
    let chain = registry.fallback_chain(&op, &specs, backend.device());
    assert_eq!(chain, ["cpu.attention.flash", "cpu.reference"]);
    // bf16 inputs: the CPU kernel takes f32 only, the reference takes the call.
    let bf16: Vec<TensorSpec> = specs
        .iter()
        .map(|s| TensorSpec::new(&s.shape, DType::BF16))
        .collect();
    assert_eq!(
        registry.fallback_chain(&op, &bf16, backend.device()),
        ["cpu.reference"]
    );
    // Both run it on the backend, with the same decisions.
    let want = CpuReference.eval(&op, &inputs).unwrap()[0].to_f64_vec();
    for kernel in chain {
        let got = run_op(&backend, &kernel, &op, &inputs).unwrap()[0].to_f64_vec();
        for (a, b) in got.iter().zip(&want) {
            assert!(
                (a - b).abs() < 1e-5 * (1.0 + b.abs()),
                "{kernel}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn bad_dropout_parameters_are_typed_errors() {
    let (op, inputs) = dense_case(1, 3, 0.2);
    let Op::Attention(params) = op else {
        unreachable!()
    };
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    for p in [1.0f32, -0.1, f32::NAN] {
        let op = Op::Attention(AttentionParams {
            dropout: Some(AttentionDropout { p, seed: 1 }),
            ..params
        });
        let err = op.infer(&specs).unwrap_err();
        assert!(err.to_string().contains("dropout probability"), "{err}");
    }
}

/// A call's last queries run as a shorter call (bottom-right causal keeps what they see)
/// take the full call's decisions when the shape says where they start, in the forward
/// and in the backward's dq (as `kpt-bench-cuda` checks its dropout rows).
#[test]
fn last_queries_keep_their_decisions_with_a_query_offset() {
    let (s, r, hd) = (7usize, 2usize, 4usize);
    let d = AttentionDropout { p: 0.3, seed: 21 };
    let full = with_dropout(AttentionShape::new(1, s, s, 2, 1, hd, true), d);
    let mut rng = Rng::new(8);
    let (q, k, v) = (
        values(&mut rng, full.q_len()),
        values(&mut rng, full.kv_len()),
        values(&mut rng, full.kv_len()),
    );
    let mut want = vec![0.0; full.q_len()];
    r::attention(&q, &k, &v, None, &mut want, &full).unwrap();
    let tail = AttentionShape {
        seq_q: r,
        dropout: Some(ShapeDropout {
            mask: d,
            first_batch: 0,
            first_query: s - r,
        }),
        ..full
    };
    let row = full.q_row();
    let mut got = vec![0.0; tail.q_len()];
    r::attention(&q[(s - r) * row..], &k, &v, None, &mut got, &tail).unwrap();
    assert_eq!(got, want[(s - r) * row..]);

    // The backward's dq rows of those queries likewise, given the forward's log-sum-exp
    // ([batch, heads, seq_q]: the last r of each head's row).
    let mut lse = vec![0.0; full.num_heads * s];
    r::attention_lse(&q, &k, &v, None, &mut want, Some(&mut lse), &full).unwrap();
    let dout = values(&mut rng, full.q_len());
    let grads = |shape: &AttentionShape, (q, out, dout, lse): (&[f64], &[f64], &[f64], &[f64])| {
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        r::attention_backward(
            (q, &k, &v, None),
            (out, dout, Some(lse)),
            (&mut dq, &mut dk, &mut dv),
            shape,
        )
        .unwrap();
        dq
    };
    let dq = grads(&full, (&q, &want, &dout, &lse));
    let tail_lse: Vec<f64> = lse.chunks(s).flat_map(|h| h[s - r..].to_vec()).collect();
    let tail_dq = grads(
        &tail,
        (
            &q[(s - r) * row..],
            &want[(s - r) * row..],
            &dout[(s - r) * row..],
            &tail_lse,
        ),
    );
    assert_eq!(tail_dq, dq[(s - r) * row..]);
}

/// A graph with dropout attention, optimized at every level and run by the executor on
/// the CPU backend, validates against the f64 reference of the unoptimized graph: the
/// plan's kernels and the reference take the same decisions.
#[test]
fn optimized_plans_validate_with_dropout() {
    use kpt_core::exec::Executor;
    use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
    use kpt_core::validate::validate_plan;
    use kpt_core::{Graph, OptLevel};
    use std::sync::Arc;

    let (op, inputs) = dense_case(2, 9, 0.25);
    let mut g = Graph::new();
    let ids: Vec<_> = ["q", "k", "v"]
        .iter()
        .zip(&inputs)
        .map(|(name, t)| g.input(*name, t.dtype(), t.shape()))
        .collect();
    let y = g.op("attention", op, &ids).unwrap();
    g.output(y).unwrap();
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let registry = KernelRegistry::with_builtin();
    for level in [
        OptLevel::Conservative,
        OptLevel::Balanced,
        OptLevel::Aggressive,
    ] {
        let plan = auto_optimize(
            &g,
            level,
            &PrecisionPolicy::default(),
            &registry,
            backend.device(),
        )
        .unwrap();
        let mut exec = Executor::new(plan, backend.clone()).unwrap();
        let report = validate_plan(&mut exec, &g, &CpuReference, &inputs, 1.0).unwrap();
        assert!(report.passed(), "{level}: {report:#?}");
    }
}
