//! Every lowered op, compiled by XLA on the CPU plugin, against the f64 reference
//! (`CpuReference`) within the validator's per-op tolerance, over random shapes.
//! Skipped (with a note) where no plugin is installed; see `tests/plugin.rs`.

mod common;

use common::{client, ints, random};
use kpt_core::graph::{Activation, AttentionDropout, AttentionParams, Op, RopeScaling};
use kpt_core::rand::SplitMix64;
use kpt_core::validate::{output_tolerance, reference_outputs, ReferenceOps};
use kpt_core::{DType, Graph, Tensor, TensorSpec};
use kpt_kernels::CpuReference;
use kpt_tpu::stablehlo::{emit_graph, emit_graph_for, Target};
use proptest::prelude::*;

/// Runs `op` on `inputs` through XLA and through the reference; compares every output.
fn check(op: Op, inputs: Vec<Tensor>) -> Result<(), TestCaseError> {
    check_for(op, inputs, Target::default())
}

/// [`check`] with the program written for `target`.
fn check_for(op: Op, inputs: Vec<Tensor>, target: Target) -> Result<(), TestCaseError> {
    let Some(client) = client() else {
        return Ok(());
    };
    let mut g = Graph::new();
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let ids: Vec<_> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| g.input(format!("in{i}"), s.dtype, &s.shape))
        .collect();
    let outs = g.op_multi("node", op.clone(), &ids).unwrap();
    for &o in &outs {
        g.output(o).unwrap();
    }
    let program = emit_graph_for(&g, &specs, target).unwrap();
    if target.no_f64 {
        prop_assert!(!program.mlir.contains("f64"), "{}", program.mlir);
    }
    let got = client
        .run_program(&program, &g, &inputs)
        .map_err(|e| TestCaseError::fail(format!("{op:?}: {e}\n{}", program.mlir)))?;
    let want = reference_outputs(&CpuReference, &op, &inputs, &got).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        prop_assert_eq!(g.shape(), w.shape(), "output {} shape", i);
        let (gv, wv) = (g.to_f64_vec(), w.to_f64_vec());
        if g.dtype().is_float() || g.dtype().is_quantized() {
            // An output the reference makes exactly zero (gradients that cancel, as when
            // each query sees one key) is measured against the inputs' magnitude.
            // Finite values only: an infinite log-sum-exp (a row that sees no key) would
            // otherwise make every tolerance infinite.
            let largest = |v: &[f64]| {
                v.iter()
                    .filter(|x| x.is_finite())
                    .fold(0f64, |m, x| m.max(x.abs()))
            };
            let mut scale = largest(&wv);
            if scale == 0.0 {
                scale = inputs
                    .iter()
                    .filter(|t| t.dtype().is_float())
                    .map(|t| largest(&t.to_f64_vec()))
                    .fold(0f64, f64::max);
            }
            let scale = scale.max(1e-30);
            let tol = output_tolerance(&op, &inputs, i, g.dtype());
            for (j, (a, b)) in gv.iter().zip(&wv).enumerate() {
                prop_assert!(
                    a == b
                        || (a - b).abs() <= tol.abs * scale + tol.rel * b.abs()
                        || (a.is_nan() && b.is_nan()),
                    "{:?} output {} element {}: {} vs {} (tol {:?}, scale {})",
                    op,
                    i,
                    j,
                    a,
                    b,
                    tol,
                    scale
                );
            }
        } else {
            prop_assert_eq!(gv, wv, "{:?} output {}", op, i);
        }
    }
    Ok(())
}

/// An additive attention mask `[s, t]` with some -inf entries, so that a row can see no
/// key.
fn additive_mask(rng: &mut SplitMix64, s: usize, t: usize, dt: DType) -> Tensor {
    let m: Vec<f64> = (0..s * t)
        .map(|_| {
            if rng.next_u64().is_multiple_of(4) {
                f64::NEG_INFINITY
            } else {
                f64::from(rng.uniform(-1.0, 1.0))
            }
        })
        .collect();
    Tensor::from_f64(&m, &[s, t], dt).unwrap()
}

fn float_dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
}

/// No dropout, or dropout of probability below 0.7 with any seed.
fn dropout() -> impl Strategy<Value = Option<AttentionDropout>> {
    prop::option::of((0.0f32..0.7, any::<u64>()).prop_map(|(p, seed)| AttentionDropout { p, seed }))
}

/// No dropout, or dropout whose factor `1 / (1 - p)` is a power of two (p 0.5 or 0.75),
/// for the backward pass: the forward output it is given (`Z v` where a query sees one
/// key) is then exact in every dtype, so gradients that cancel cancel exactly in the
/// reference, as the check's rule for outputs the reference makes zero assumes. With
/// another factor the rounded output leaves the reference ~1e-8 of noise, which the
/// check would hold XLA's f32 noise to.
fn dropout_exact_scale() -> impl Strategy<Value = Option<AttentionDropout>> {
    prop::option::of(
        (prop_oneof![Just(0.5f32), Just(0.75)], any::<u64>())
            .prop_map(|(p, seed)| AttentionDropout { p, seed }),
    )
}

fn activation() -> impl Strategy<Value = Activation> {
    prop_oneof![
        Just(Activation::Relu),
        Just(Activation::GeluErf),
        Just(Activation::GeluTanh),
        Just(Activation::Silu)
    ]
}

/// Sizes that include 1, odd and larger values.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![Just(1usize), 2usize..9, Just(33), Just(130)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn elementwise_and_rows(rows in dim(), cols in dim(), dt in float_dtype(), act in activation(), seed in any::<u64>()) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[rows, cols], dt);
        let y = random(&mut rng, &[cols], dt);
        let w = random(&mut rng, &[cols], dt);
        let bias = random(&mut rng, &[cols], dt);
        let r = random(&mut rng, &[rows, cols], dt);
        check(Op::Add, vec![x.clone(), y.clone()])?;
        check(Op::Mul, vec![x.clone(), r.clone()])?;
        check(Op::Activation { act }, vec![x.clone()])?;
        check(Op::Softmax, vec![x.clone()])?;
        check(Op::RmsNorm { eps: 1e-5 }, vec![x.clone(), w.clone()])?;
        check(Op::LayerNorm { eps: 1e-5 }, vec![x.clone(), w.clone(), bias.clone()])?;
        check(Op::AddRmsNorm { eps: 1e-6 }, vec![x.clone(), r.clone(), w.clone()])?;
        check(Op::AddLayerNorm { eps: 1e-6 }, vec![x.clone(), r.clone(), w.clone(), bias])?;
        check(Op::ArgMax, vec![x.clone()])?;
        let other = if dt == DType::F32 { DType::BF16 } else { DType::F32 };
        check(Op::Cast { dtype: other }, vec![x.clone()])?;
        check(Op::Concat { axis: 1 }, vec![x.clone(), r])?;
        if cols % 2 == 0 {
            check(Op::ActAndMul { act }, vec![x.clone()])?;
        }
        check(Op::Split { axis: 1, sizes: vec![cols / 2, cols - cols / 2] }, vec![x])?;
    }

    #[test]
    fn products(m in dim(), k in dim(), n in dim(), batch in 1usize..4, dt in float_dtype(), act in activation(), seed in any::<u64>()) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[batch, m, k], dt);
        let w = random(&mut rng, &[n, k], dt);
        let bias = random(&mut rng, &[n], dt);
        check(Op::Linear { bias: false }, vec![x.clone(), w.clone()])?;
        check(Op::LinearAct { bias: true, act }, vec![x.clone(), w.clone(), bias])?;
        // f32 activations with bf16 weights (the balanced level's linears).
        let xf = random(&mut rng, &[m, k], DType::F32);
        check(Op::Linear { bias: false }, vec![xf, random(&mut rng, &[n, k], DType::BF16)])?;
        check(Op::MatMul, vec![x.clone(), random(&mut rng, &[k, n], dt)])?;
        check(Op::MatMul, vec![x, random(&mut rng, &[batch, k, n], dt)])?;
    }

    #[test]
    fn embedding_and_rotary(
        seq in 1usize..9, heads in 1usize..4, half in 1usize..9, vocab in 1usize..50,
        dt in float_dtype(), per_token in any::<bool>(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let d = 2 * half;
        let table = random(&mut rng, &[vocab, d], dt);
        let ids: Vec<i64> = (0..2 * seq).map(|_| (rng.next_u64() % vocab as u64) as i64).collect();
        check(Op::Embedding, vec![ints(&ids, &[2, seq], DType::I64), table])?;
        // Rows of an activation [1, vocab, d] (a prefill's last tokens).
        let rows = random(&mut rng, &[1, vocab, d], dt);
        check(Op::Embedding, vec![ints(&ids, &[2, seq], DType::I64), rows])?;
        let x = random(&mut rng, &[2, seq, heads * d], dt);
        let (pos, shape): (Vec<i64>, Vec<usize>) = if per_token {
            ((0..2 * seq).map(|_| (rng.next_u64() % 4096) as i64).collect(), vec![2, seq])
        } else {
            ((0..seq as i64).map(|p| p + 7).collect(), vec![seq])
        };
        let positions = ints(&pos, &shape, DType::I32);
        check(Op::Rotary { head_dim: d, theta: 10000.0, scaling: None }, vec![x.clone(), positions.clone()])?;
        let qkv = random(&mut rng, &[2, seq, (heads + 2) * d], dt);
        check(
            Op::SplitRotary { head_dim: d, theta: 500000.0, scaling: None, sizes: vec![heads * d, d, d], cache: false },
            vec![qkv, positions],
        )?;
    }

    #[test]
    fn cache_write(
        blocks in 1usize..4, block in 1usize..6, width in dim(), n in 1usize..5,
        dt in float_dtype(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let capacity = blocks * block;
        let cache = random(&mut rng, &[blocks, block, width], dt);
        let rows = random(&mut rng, &[n, width], dt);
        // Distinct slots inside the cache, some of them -1 (padding, skipped).
        let mut free: Vec<i64> = (0..capacity as i64).collect();
        let slots: Vec<i64> = (0..n)
            .map(|_| {
                if free.is_empty() || rng.next_u64().is_multiple_of(4) {
                    -1
                } else {
                    free.swap_remove((rng.next_u64() % free.len() as u64) as usize)
                }
            })
            .collect();
        check(Op::CacheWrite, vec![cache, rows, ints(&slots, &[n], DType::I64)])?;
    }

    #[test]
    fn attention(
        batch in 1usize..3, s in 1usize..20, extra in 0usize..20, kv in 1usize..3, group in 1usize..3,
        d in prop_oneof![Just(8usize), Just(16), Just(64)], causal in any::<bool>(),
        window in prop_oneof![Just(None), (1usize..8).prop_map(Some)], mask in any::<bool>(),
        lse in any::<bool>(), dropout in dropout(), dt in float_dtype(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let t = s + extra;
        let hq = kv * group;
        let mut p = AttentionParams::new(hq, kv, d, causal);
        p.window = window;
        p.mask = mask;
        p.lse = lse;
        p.dropout = dropout;
        let mut ins = vec![
            random(&mut rng, &[batch, s, hq * d], dt),
            random(&mut rng, &[batch, t, kv * d], dt),
            random(&mut rng, &[batch, t, kv * d], dt),
        ];
        if mask {
            ins.push(additive_mask(&mut rng, s, t, dt));
        }
        check(Op::Attention(p), ins)?;
    }

    #[test]
    fn attention_backward(
        batch in 1usize..3, s in 1usize..12, extra in 0usize..12, kv in 1usize..3, group in 1usize..3,
        d in prop_oneof![Just(8usize), Just(16)], causal in any::<bool>(),
        window in prop_oneof![Just(None), (1usize..6).prop_map(Some)], mask in any::<bool>(),
        lse in any::<bool>(), dropout in dropout_exact_scale(), dt in float_dtype(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let t = s + extra;
        let hq = kv * group;
        let mut p = AttentionParams::new(hq, kv, d, causal);
        p.window = window;
        p.mask = mask;
        p.dropout = dropout;
        let (q, k, v) = (
            random(&mut rng, &[batch, s, hq * d], dt),
            random(&mut rng, &[batch, t, kv * d], dt),
            random(&mut rng, &[batch, t, kv * d], dt),
        );
        let mut forward = vec![q.clone(), k.clone(), v.clone()];
        if mask {
            forward.push(additive_mask(&mut rng, s, t, dt));
        }
        // The forward's output and log-sum-exp from the reference, as training has them.
        let mut fp = p;
        fp.lse = true;
        let outs = CpuReference.eval(&Op::Attention(fp), &forward).unwrap();
        let o = outs[0].to_dtype(dt).unwrap();
        let mut ins = vec![q, k, v, o, random(&mut rng, &[batch, s, hq * d], dt)];
        if mask {
            ins.push(forward[3].clone());
        }
        if lse {
            p.lse = true;
            ins.push(outs[1].to_dtype(DType::F32).unwrap());
        }
        check(Op::AttentionBackward(p), ins)?;
    }

    #[test]
    fn attention_varlen(
        lens in proptest::collection::vec((0usize..7, 0usize..7), 1..4), kv in 1usize..3,
        group in 1usize..3, d in prop_oneof![Just(8usize), Just(16)], causal in any::<bool>(),
        window in prop_oneof![Just(None), (1usize..5).prop_map(Some)], dropout in dropout(),
        dt in float_dtype(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let hq = kv * group;
        let mut p = AttentionParams::new(hq, kv, d, causal);
        p.window = window;
        p.varlen = true;
        p.dropout = dropout;
        // Sequences with as many or more keys than queries (a cache before new tokens),
        // some of them empty.
        let (mut cu_q, mut cu_k) = (vec![0i64], vec![0i64]);
        for &(sq, extra) in &lens {
            cu_q.push(cu_q.last().unwrap() + sq as i64);
            cu_k.push(cu_k.last().unwrap() + (sq + extra) as i64);
        }
        let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
        let n = cu_q.len();
        let ins = vec![
            random(&mut rng, &[1, tq, hq * d], dt),
            random(&mut rng, &[1, tk, kv * d], dt),
            random(&mut rng, &[1, tk, kv * d], dt),
            ints(&cu_q, &[n], DType::I32),
            ints(&cu_k, &[n], DType::I64),
        ];
        check(Op::Attention(p), ins)?;
    }

    #[test]
    fn attention_paged(
        batch in 1usize..4, s in 1usize..4, block in 1usize..5, max_blocks in 1usize..4,
        kv in 1usize..3, group in 1usize..3, causal in any::<bool>(),
        window in prop_oneof![Just(None), (1usize..5).prop_map(Some)], dt in float_dtype(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let (hq, d) = (kv * group, 8);
        let mut p = AttentionParams::new(hq, kv, d, causal);
        p.window = window;
        p.paged = true;
        // Every sequence owns `max_blocks` distinct blocks of a shuffled cache, plus one
        // spare block nobody reads.
        let blocks = batch * max_blocks + 1;
        let mut order: Vec<i64> = (0..blocks as i64).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let table = &order[..batch * max_blocks];
        let lens: Vec<i64> = (0..batch)
            .map(|_| (rng.next_u64() % (max_blocks * block) as u64) as i64 + 1)
            .collect();
        let ins = vec![
            random(&mut rng, &[batch, s, hq * d], dt),
            random(&mut rng, &[blocks, block, kv * d], dt),
            random(&mut rng, &[blocks, block, kv * d], dt),
            ints(table, &[batch, max_blocks], DType::I32),
            ints(&lens, &[batch], DType::I64),
        ];
        check(Op::Attention(p), ins)?;
    }

    #[test]
    fn quantization(
        rows in dim(), cols in dim(), n in 1usize..9, dt in float_dtype(),
        q in prop_oneof![Just(DType::F8E4M3), Just(DType::F8E5M2), Just(DType::I8)],
        small in any::<bool>(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[rows, cols], dt);
        // The scale that maps |x| <= 1 onto the dtype's range, or one that saturates.
        let scale = if small { 1e-3 } else { kpt_core::dtype::quant_scale(1.0, q) };
        check(Op::Quantize { dtype: q, scale }, vec![x.clone()])?;
        // Stored values with their own scale (an argument of the program).
        check(Op::Dequantize { dtype: dt }, vec![random(&mut rng, &[rows, cols], q)])?;
        // FP8 / int8 weights, as the aggressive level makes them.
        check(Op::Linear { bias: false }, vec![x, random(&mut rng, &[n, cols], q)])?;
    }

    /// The f32 rotary of targets without f64 (TPUs), at positions up to 2^22.
    #[test]
    fn rotary_without_f64(
        seq in 1usize..6, heads in 1usize..3, half in 1usize..33, far in 0i64..(1 << 22),
        yarn in any::<bool>(), dt in float_dtype(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let d = 2 * half;
        let x = random(&mut rng, &[2, seq, heads * d], dt);
        let pos: Vec<i64> = (0..2 * seq as i64).map(|i| if i % 2 == 0 { far + i } else { i }).collect();
        let positions = ints(&pos, &[2, seq], DType::I64);
        let scaling = yarn.then_some(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        });
        let tpu = Target::of_platform("tpu");
        check_for(Op::Rotary { head_dim: d, theta: 500000.0, scaling }, vec![x, positions.clone()], tpu)?;
        let qkv = random(&mut rng, &[2, seq, (heads + 2) * d], dt);
        check_for(
            Op::SplitRotary { head_dim: d, theta: 10000.0, scaling: None, sizes: vec![heads * d, d, d], cache: false },
            vec![qkv, positions],
            tpu,
        )?;
    }

    #[test]
    fn dynamic_ntk_rotary(
        seq in 1usize..6, heads in 1usize..3, half in 2usize..9, start in 0i64..40,
        dt in float_dtype(), seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let d = 2 * half;
        let scaling = RopeScaling::Dynamic { factor: 2.0, max_position_embeddings: 16 };
        let x = random(&mut rng, &[1, seq, heads * d], dt);
        // Positions below and past the trained length: the base grows with the largest.
        let pos: Vec<i64> = (0..seq as i64).map(|i| start + 3 * i).collect();
        let positions = ints(&pos, &[seq], DType::I64);
        check(Op::Rotary { head_dim: d, theta: 10000.0, scaling: Some(scaling) }, vec![x, positions])?;
    }
}

/// A LLaMA-shaped decoder block with its weights as graph parameters, written as one
/// StableHLO module and compiled by XLA into one executable, against the f64 reference
/// run of the same graph.
#[test]
fn a_transformer_block_is_one_executable() {
    let Some(client) = client() else {
        return;
    };
    let (g, inputs) = common::decoder_block();
    let vocab = common::VOCAB;
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let program = emit_graph(&g, &specs).unwrap();
    assert_eq!(program.args.len(), 2 + 9, "inputs, then the nine weights");
    let got = client.run_program(&program, &g, &inputs).unwrap();
    let want = kpt_core::validate::run_reference(&g, &CpuReference, &inputs).unwrap();
    let (gl, wl) = (got[0].to_f64_vec(), want[0].to_f64_vec());
    let scale = wl.iter().fold(0f64, |m, x| m.max(x.abs()));
    let err = gl
        .iter()
        .zip(&wl)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= 1e-4 * scale,
        "logits: max error {err:e} at scale {scale}"
    );
    // Greedy tokens agree wherever the reference's top two logits are not a near-tie.
    let (gt, wt) = (got[1].to_f64_vec(), want[1].to_f64_vec());
    for (row, (a, b)) in gt.iter().zip(&wt).enumerate() {
        let r = &wl[row * vocab..(row + 1) * vocab];
        let mut sorted = r.to_vec();
        sorted.sort_by(|x, y| y.total_cmp(x));
        if sorted[0] - sorted[1] > 1e-3 * scale {
            assert_eq!(a, b, "token of row {row}");
        }
    }
}

/// Causal attention with a window of one: each query sees only its own key, so the
/// reference's dq and dk are exactly zero and XLA's are rounding residue, which the
/// comparison measures against the inputs' magnitude.
#[test]
fn backward_with_one_visible_key_per_query() {
    let mut rng = SplitMix64::new(7);
    let mut p = AttentionParams::new(1, 1, 8, true);
    p.window = Some(1);
    let (q, k, v) = (
        random(&mut rng, &[1, 7, 8], DType::F32),
        random(&mut rng, &[1, 7, 8], DType::F32),
        random(&mut rng, &[1, 7, 8], DType::F32),
    );
    let o = CpuReference
        .eval(&Op::Attention(p), &[q.clone(), k.clone(), v.clone()])
        .unwrap()
        .remove(0)
        .to_dtype(DType::F32)
        .unwrap();
    let dout = random(&mut rng, &[1, 7, 8], DType::F32);
    check(Op::AttentionBackward(p), vec![q, k, v, o, dout]).unwrap();
}

/// Dynamic NTK's base comes from the positions in the program, in f64: a target
/// without f64 gets an error that says so instead of a program XLA:TPU would reject.
#[test]
fn dynamic_ntk_needs_f64() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[1, 3, 8]);
    let p = g.input("p", DType::I64, &[3]);
    let scaling = Some(RopeScaling::Dynamic {
        factor: 2.0,
        max_position_embeddings: 16,
    });
    let y = g
        .op(
            "rope",
            Op::Rotary {
                head_dim: 8,
                theta: 10000.0,
                scaling,
            },
            &[x, p],
        )
        .unwrap();
    g.output(y).unwrap();
    let specs = [
        TensorSpec::new(&[1, 3, 8], DType::F32),
        TensorSpec::new(&[3], DType::I64),
    ];
    assert!(emit_graph(&g, &specs).is_ok());
    let e = emit_graph_for(&g, &specs, Target::of_platform("tpu")).unwrap_err();
    assert!(
        e.to_string().contains("`rope`") && e.to_string().contains("f64"),
        "{e}"
    );
}

/// One query against one key under a sliding window: the visibility test folds to
/// constants there, and XLA's CPU plugin folds a comparison against a negative i64
/// constant wrongly (`0 > -1` gave false), so the rule is written without negative
/// constants.
#[test]
fn one_query_one_key_with_a_window() {
    for causal in [false, true] {
        let mut rng = SplitMix64::new(3);
        let mut p = AttentionParams::new(1, 1, 16, causal);
        p.window = Some(1);
        let ins = vec![
            random(&mut rng, &[1, 1, 16], DType::F32),
            random(&mut rng, &[1, 1, 16], DType::F32),
            random(&mut rng, &[1, 1, 16], DType::F32),
        ];
        check(Op::Attention(p), ins).unwrap();
    }
}
