//! Every fast CPU kernel against the f64 reference, over random shapes (sizes of 1 and
//! odd sizes included), plus large deterministic cases and the error paths.
//!
//! Tolerances come from `cpu::tolerance`. Low-precision weights are compared with the
//! reference on the *dequantized* weights, so the kernel's own error is what is measured;
//! the quantization error is checked separately.

use half::{bf16, f16};
use kpt_core::graph::{AttentionDropout, RopeScaling, RopeScalingError};
use kpt_core::{DType, KptError};
use kpt_kernels::cpu::{
    self, reference as r, tolerance, Act, AttentionShape, ShapeDropout, WeightsRef,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use kpt_core::rand::SplitMix64 as Rng;

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Checks a log-sum-exp: `+inf` (a row that sees no key) must match exactly, the rest
/// within `abs + rel |want|`.
fn check_lse(got: &[f32], want: &[f64], tol: (f64, f64)) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "lse: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_infinite() {
            prop_assert_eq!(g as f64, w, "lse[{}]", i);
        } else {
            let err = (g as f64 - w).abs();
            prop_assert!(
                err <= tol.0 + tol.1 * w.abs(),
                "lse[{}]: got {}, want {}",
                i,
                g,
                w
            );
        }
    }
    Ok(())
}

/// Checks `|got - want| <= abs + rel |want|` everywhere (NaN must match NaN).
fn check_close(
    what: &str,
    got: &[f64],
    want: &[f64],
    (abs, rel): (f64, f64),
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "{}: length", what);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            prop_assert!(g.is_nan(), "{}[{}]: got {}, want NaN", what, i, g);
            continue;
        }
        let err = (g - w).abs();
        prop_assert!(
            err <= abs + rel * w.abs(),
            "{}[{}]: got {}, want {}, err {:e} > {:e} + {:e}·|want|",
            what,
            i,
            g,
            w,
            err,
            abs,
            rel
        );
    }
    Ok(())
}

fn act_of(i: usize) -> Option<Act> {
    Act::ALL.get(i).copied()
}

/// Weights in one stored dtype, with the dequantized values the reference uses.
struct Weights {
    dtype: DType,
    f32: Vec<f32>,
    bf16: Vec<bf16>,
    f16: Vec<f16>,
    bits: Vec<u8>,
    i8: Vec<i8>,
    scale: f32,
    dequantized: Vec<f64>,
}

impl Weights {
    fn new(w: &[f32], dtype: DType) -> Self {
        let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = kpt_core::dtype::quant_scale(amax, dtype);
        let mut s = Weights {
            dtype,
            f32: Vec::new(),
            bf16: Vec::new(),
            f16: Vec::new(),
            bits: vec![0; w.len()],
            i8: vec![0; w.len()],
            scale,
            dequantized: Vec::new(),
        };
        let mut deq = vec![0f32; w.len()];
        match dtype {
            DType::F32 => {
                s.f32 = w.to_vec();
                deq.copy_from_slice(w);
            }
            DType::BF16 => {
                s.bf16 = w.iter().map(|&v| bf16::from_f32(v)).collect();
                deq = s.bf16.iter().map(|v| v.to_f32()).collect();
            }
            DType::F16 => {
                s.f16 = w.iter().map(|&v| f16::from_f32(v)).collect();
                deq = s.f16.iter().map(|v| v.to_f32()).collect();
            }
            DType::F8E4M3 => {
                cpu::quantize_f8e4m3(w, scale, &mut s.bits).expect("quantize");
                cpu::dequantize_f8e4m3(&s.bits, scale, &mut deq).expect("dequantize");
            }
            DType::F8E5M2 => {
                cpu::quantize_f8e5m2(w, scale, &mut s.bits).expect("quantize");
                cpu::dequantize_f8e5m2(&s.bits, scale, &mut deq).expect("dequantize");
            }
            DType::I8 => {
                cpu::quantize_i8(w, scale, &mut s.i8).expect("quantize");
                cpu::dequantize_i8(&s.i8, scale, &mut deq).expect("dequantize");
            }
            other => panic!("no weights in {other}"),
        }
        // Exact in f64: stored value times scale (dequantize rounds it to f32 once).
        s.dequantized = match dtype {
            DType::F8E4M3 => s
                .bits
                .iter()
                .map(|&b| kpt_core::dtype::f8e4m3_to_f32(b) as f64 * scale as f64)
                .collect(),
            DType::F8E5M2 => s
                .bits
                .iter()
                .map(|&b| kpt_core::dtype::f8e5m2_to_f32(b) as f64 * scale as f64)
                .collect(),
            DType::I8 => s.i8.iter().map(|&v| v as f64 * scale as f64).collect(),
            _ => f64s(&deq),
        };
        s
    }

    fn as_ref(&self) -> WeightsRef<'_> {
        match self.dtype {
            DType::F32 => WeightsRef::F32(&self.f32),
            DType::BF16 => WeightsRef::BF16(&self.bf16),
            DType::F16 => WeightsRef::F16(&self.f16),
            DType::F8E4M3 => WeightsRef::F8E4M3 {
                bits: &self.bits,
                scale: self.scale,
            },
            DType::F8E5M2 => WeightsRef::F8E5M2 {
                bits: &self.bits,
                scale: self.scale,
            },
            _ => WeightsRef::I8 {
                data: &self.i8,
                scale: self.scale,
            },
        }
    }
}

const WEIGHT_DTYPES: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F8E4M3,
    DType::F8E5M2,
    DType::I8,
];

/// Runs fast `linear` for every weight dtype and compares with the reference.
#[allow(clippy::too_many_arguments)]
fn check_linear(
    seed: u64,
    m: usize,
    k: usize,
    n: usize,
    with_bias: bool,
    act: Option<Act>,
) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let x = rng.vec(m * k, -1.0, 1.0);
    let w = rng.vec(n * k, -1.0, 1.0);
    let bias = rng.vec(n, -1.0, 1.0);
    let bias = with_bias.then_some(&bias[..]);
    for dtype in WEIGHT_DTYPES {
        let wq = Weights::new(&w, dtype);
        // With bf16 weights, many rows and a bf16 engine, the kernel multiplies x rounded
        // to bf16 (f32 accumulation): the reference takes the same x.
        let bf16_x =
            dtype == DType::BF16 && m > cpu::linear::GEMV_MAX_M && cpu::linear::bf16_products();
        let x_ref: Vec<f64> = if bf16_x {
            x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect()
        } else {
            f64s(&x)
        };
        let mut want = vec![0f64; m * n];
        r::linear_act(
            &x_ref,
            &wq.dequantized,
            bias.map(f64s).as_deref(),
            act,
            &mut want,
            m,
            k,
            n,
        )
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut got = vec![f32::NAN; m * n];
        cpu::linear(&x, wq.as_ref(), bias, act, &mut got, m, k, n)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_close(
            &format!("linear {dtype} {m}x{k}x{n} {act:?}"),
            &f64s(&got),
            &want,
            tolerance(DType::F32, k),
        )?;
    }
    Ok(())
}

fn check_attention(
    seed: u64,
    shape: AttentionShape,
    with_mask: bool,
    block_q: usize,
    block_kv: usize,
) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let q = rng.vec(shape.q_len(), -1.0, 1.0);
    let k = rng.vec(shape.kv_len(), -1.0, 1.0);
    let v = rng.vec(shape.kv_len(), -1.0, 1.0);
    let mask: Vec<f32> = (0..shape.mask_len())
        .map(|_| {
            if rng.below(8) == 0 {
                f32::NEG_INFINITY
            } else {
                rng.uniform(-2.0, 0.5)
            }
        })
        .collect();
    let mask = with_mask.then_some(&mask[..]);
    let mut want = vec![0f64; shape.q_len()];
    r::attention(
        &f64s(&q),
        &f64s(&k),
        &f64s(&v),
        mask.map(f64s).as_deref(),
        &mut want,
        &shape,
    )
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut got = vec![f32::NAN; shape.q_len()];
    cpu::attention(&q, &k, &v, mask, &mut got, &shape, block_q, block_kv)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    check_close(
        &format!("attention {shape:?} mask={with_mask} blocks {block_q}x{block_kv}"),
        &f64s(&got),
        &want,
        tolerance(DType::F32, shape.seq_kv + shape.head_dim),
    )?;

    // bf16 storage: the reference sees the same (bf16-rounded) operands.
    let to16 = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    let to64 = |x: &[bf16]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
    let (q16, k16, v16) = (to16(&q), to16(&k), to16(&v));
    r::attention(
        &to64(&q16),
        &to64(&k16),
        &to64(&v16),
        mask.map(f64s).as_deref(),
        &mut want,
        &shape,
    )
    .map_err(fail)?;
    let mut got = vec![bf16::NAN; shape.q_len()];
    cpu::attention_bf16(&q16, &k16, &v16, mask, &mut got, &shape, block_q, block_kv)
        .map_err(fail)?;
    check_close(
        &format!("attention_bf16 {shape:?} mask={with_mask} blocks {block_q}x{block_kv}"),
        &to64(&got),
        &want,
        cpu::attention_bf16_tolerance(&q16, &k16, &v16, &shape),
    )
}

/// Attention dropout of probability `p` and `seed` at the start of a call.
fn dropout_of((p, seed): (f32, u64)) -> ShapeDropout {
    ShapeDropout {
        mask: AttentionDropout { p, seed },
        first_batch: 0,
        first_query: 0,
    }
}

fn fail(e: KptError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Rotary scalings of every kind over the ranges real configs use.
fn rope_scaling() -> impl Strategy<Value = RopeScaling> {
    let factor = prop::sample::select(vec![1.0f64, 2.0, 4.0, 8.0, 32.0]);
    let context = prop::sample::select(vec![16usize, 256, 2048, 8192, 32_768]);
    prop_oneof![
        factor
            .clone()
            .prop_map(|factor| RopeScaling::Linear { factor }),
        (factor.clone(), context.clone()).prop_map(|(factor, max_position_embeddings)| {
            RopeScaling::Dynamic {
                factor,
                max_position_embeddings,
            }
        }),
        (factor.clone(), 0.5f64..2.0, 2.5f64..8.0, context.clone()).prop_map(
            |(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)| {
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }
            }
        ),
        (
            factor,
            context,
            prop::sample::select(vec![16.0f64, 32.0]),
            prop::sample::select(vec![1.0f64, 2.0]),
            prop::option::of(0.5f64..1.5),
            any::<bool>(),
        )
            .prop_map(
                |(factor, original, beta_fast, beta_slow, attention_factor, truncate)| {
                    RopeScaling::Yarn {
                        factor,
                        original_max_position_embeddings: original,
                        beta_fast,
                        beta_slow,
                        attention_factor,
                        mscale: None,
                        mscale_all_dim: None,
                        truncate,
                    }
                }
            ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn linear_matches_reference(
        m in 1usize..=37, k in 1usize..=70, n in 1usize..=45,
        seed in any::<u64>(), with_bias in any::<bool>(), act in 0usize..5,
    ) {
        check_linear(seed, m, k, n, with_bias, act_of(act))?;
    }

    #[test]
    fn matmul_matches_reference(
        m in 1usize..=37, k in 1usize..=70, n in 1usize..=45, seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let a = rng.vec(m * k, -1.0, 1.0);
        let b = rng.vec(k * n, -1.0, 1.0);
        let mut want = vec![0f64; m * n];
        r::matmul(&f64s(&a), &f64s(&b), &mut want, m, k, n).map_err(fail)?;
        let mut got = vec![0f32; m * n];
        cpu::matmul_f32(&a, &b, &mut got, m, k, n).map_err(fail)?;
        check_close("matmul_f32", &f64s(&got), &want, tolerance(DType::F32, k))?;

        let a16: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
        let b16: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
        let to64 = |x: &[bf16]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
        r::matmul(&to64(&a16), &to64(&b16), &mut want, m, k, n).map_err(fail)?;
        let mut got = vec![bf16::ZERO; m * n];
        cpu::matmul_bf16(&a16, &b16, &mut got, m, k, n).map_err(fail)?;
        check_close("matmul_bf16", &to64(&got), &want, tolerance(DType::BF16, k))?;

        let ah: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
        let bh: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
        let to64 = |x: &[f16]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
        r::matmul(&to64(&ah), &to64(&bh), &mut want, m, k, n).map_err(fail)?;
        let mut got = vec![f16::ZERO; m * n];
        cpu::matmul_f16(&ah, &bh, &mut got, m, k, n).map_err(fail)?;
        check_close("matmul_f16", &to64(&got), &want, tolerance(DType::F16, k))?;
    }

    #[test]
    fn attention_matches_reference(
        batch in 1usize..=2, kv_heads in 1usize..=2,
        ratio in prop::sample::select(vec![1usize, 2, 4]),
        seq_q in 1usize..=33, seq_kv in 1usize..=70,
        head_dim in prop::sample::select(vec![1usize, 2, 8, 16, 64]),
        causal in any::<bool>(), with_mask in any::<bool>(),
        block_q in prop::sample::select(vec![1usize, 4, 7, 16, 64]),
        block_kv in prop::sample::select(vec![1usize, 16, 20, 64]),
        window in prop::option::of(1usize..80),
        dropout in prop::option::of((0.0f32..0.7, any::<u64>())),
        seed in any::<u64>(),
    ) {
        let heads = kv_heads * ratio;
        let shape = AttentionShape {
            dropout: dropout.map(dropout_of),
            ..AttentionShape::new(batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal)
                .with_window(window)
        };
        check_attention(seed, shape, with_mask, block_q, block_kv)?;
    }

    /// The reference's sliding window equals an additive mask of -inf outside the window.
    #[test]
    fn window_equals_its_mask(seq_q in 1usize..=20, seq_kv in 1usize..=30, window in 1usize..40,
                              causal in any::<bool>(), seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let shape = AttentionShape::new(1, seq_q, seq_kv, 2, 1, 4, causal);
        let q = f64s(&rng.vec(shape.q_len(), -1.0, 1.0));
        let k = f64s(&rng.vec(shape.kv_len(), -1.0, 1.0));
        let v = f64s(&rng.vec(shape.kv_len(), -1.0, 1.0));
        // Key j is in query i's window iff j + window > i + seq_kv - seq_q.
        let mask: Vec<f64> = (0..seq_q * seq_kv)
            .map(|x| {
                let (i, j) = ((x / seq_kv) as i64, (x % seq_kv) as i64);
                let inside = j + window as i64 > i + seq_kv as i64 - seq_q as i64;
                if inside { 0.0 } else { f64::NEG_INFINITY }
            })
            .collect();
        let mut want = vec![0f64; shape.q_len()];
        r::attention(&q, &k, &v, Some(&mask), &mut want, &shape).map_err(fail)?;
        let mut got = vec![0f64; shape.q_len()];
        r::attention(&q, &k, &v, None, &mut got, &shape.with_window(Some(window))).map_err(fail)?;
        prop_assert_eq!(got, want);
    }

    #[test]
    fn varlen_attention_matches_reference(
        seqs in prop::collection::vec((0usize..=40, 0usize..=50), 1..5),
        kv_heads in 1usize..=2, ratio in prop::sample::select(vec![1usize, 3]),
        head_dim in prop::sample::select(vec![1usize, 8, 64]), causal in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let cu = |f: fn(&(usize, usize)) -> usize| {
            std::iter::once(0).chain(seqs.iter().scan(0i64, |t, s| { *t += f(s) as i64; Some(*t) }))
                .collect::<Vec<i64>>()
        };
        let (cu_q, cu_k) = (cu(|s| s.0), cu(|s| s.1));
        let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
        let shape = AttentionShape::new(1, tq, tk, kv_heads * ratio, kv_heads, head_dim, causal);
        let q = rng.vec(shape.q_len(), -1.0, 1.0);
        let k = rng.vec(shape.kv_len(), -1.0, 1.0);
        let v = rng.vec(shape.kv_len(), -1.0, 1.0);
        let mut want = vec![0f64; shape.q_len()];
        let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
        cpu::for_each_sequence(&shape, &cu_q, &cu_k, (&q64, &k64, &v64), &mut want,
            |q, k, v, o, s| r::attention(q, k, v, None, o, s)).map_err(fail)?;
        let mut got = vec![0f32; shape.q_len()];
        cpu::for_each_sequence(&shape, &cu_q, &cu_k, (&q, &k, &v), &mut got,
            |q, k, v, o, s| cpu::attention(q, k, v, None, o, s, 16, 16)).map_err(fail)?;
        let longest = seqs.iter().map(|s| s.1).max().unwrap_or(1);
        check_close("varlen attention", &f64s(&got), &want, tolerance(DType::F32, longest))?;
    }

    #[test]
    fn paged_attention_matches_reference(
        lens in prop::collection::vec(0usize..=40, 1..4), block_size in 1usize..=9,
        seq_q in 1usize..=5, head_dim in prop::sample::select(vec![1usize, 8, 64]),
        causal in any::<bool>(), seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let max_blocks = lens.iter().max().unwrap().div_ceil(block_size).max(1);
        let num_blocks = lens.len() * max_blocks + 1;
        // Block ids in a seeded shuffle, so sequences are scattered over the cache.
        let mut ids: Vec<i64> = (0..num_blocks as i64).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let table: Vec<i64> = ids[..lens.len() * max_blocks].to_vec();
        let seq_lens: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
        let shape = AttentionShape::new(lens.len(), seq_q, 0, 2, 1, head_dim, causal);
        let row = shape.kv_row();
        let q = rng.vec(shape.q_len(), -1.0, 1.0);
        let k = rng.vec(num_blocks * block_size * row, -1.0, 1.0);
        let v = rng.vec(num_blocks * block_size * row, -1.0, 1.0);
        let paged = cpu::PagedKv { block_size, num_blocks, block_table: &table, seq_lens: &seq_lens };
        let mut want = vec![0f64; shape.q_len()];
        let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
        cpu::for_each_paged_sequence(&shape, &paged, (&q64, &k64, &v64), &mut want,
            |q, k, v, o, s| r::attention(q, k, v, None, o, s)).map_err(fail)?;
        let mut got = vec![0f32; shape.q_len()];
        cpu::for_each_paged_sequence(&shape, &paged, (&q, &k, &v), &mut got,
            |q, k, v, o, s| cpu::attention(q, k, v, None, o, s, 16, 16)).map_err(fail)?;
        check_close("paged attention", &f64s(&got), &want, tolerance(DType::F32, 40))?;
    }

    #[test]
    fn attention_backward_matches_reference(
        batch in 1usize..=2, seq_q in 1usize..=40, seq_kv in 1usize..=50, kv_heads in 1usize..=2,
        ratio in prop::sample::select(vec![1usize, 4]), head_dim in prop::sample::select(vec![1usize, 8, 64]),
        causal in any::<bool>(), window in prop::option::of(1usize..30), with_mask in any::<bool>(),
        with_lse in any::<bool>(), dropout in prop::option::of((0.0f32..0.7, any::<u64>())),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let shape = AttentionShape {
            dropout: dropout.map(dropout_of),
            ..AttentionShape::new(batch, seq_q, seq_kv, kv_heads * ratio, kv_heads, head_dim, causal)
                .with_window(window)
        };
        let q = rng.vec(shape.q_len(), -1.0, 1.0);
        let k = rng.vec(shape.kv_len(), -1.0, 1.0);
        let v = rng.vec(shape.kv_len(), -1.0, 1.0);
        let dout = rng.vec(shape.q_len(), -1.0, 1.0);
        let mask: Vec<f32> = (0..shape.mask_len())
            .map(|_| if rng.below(8) == 0 { f32::NEG_INFINITY } else { rng.uniform(-2.0, 0.5) })
            .collect();
        let mask = with_mask.then_some(&mask[..]);
        let mask64 = mask.map(f64s);
        let (q64, k64, v64, do64) = (f64s(&q), f64s(&k), f64s(&v), f64s(&dout));
        let mut out64 = vec![0.0; shape.q_len()];
        let mut lse64 = vec![0.0; shape.lse_len()];
        r::attention_lse(&q64, &k64, &v64, mask64.as_deref(), &mut out64, Some(&mut lse64), &shape)
            .map_err(fail)?;
        let out: Vec<f32> = out64.iter().map(|&x| x as f32).collect();
        let out64 = f64s(&out);
        // The f32 log-sum-exp pass against the reference's.
        let mut lse = vec![0f32; shape.lse_len()];
        cpu::attention_lse(&q, &k, mask, &mut lse, &shape).map_err(fail)?;
        check_lse(&lse, &lse64, tolerance(DType::F32, seq_kv.max(head_dim)))?;
        let (mut dq, mut dk, mut dv) =
            (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let lse_in = with_lse.then_some(&lse64[..]);
        r::attention_backward((&q64, &k64, &v64, mask64.as_deref()), (&out64, &do64, lse_in),
            (&mut dq, &mut dk, &mut dv), &shape).map_err(fail)?;
        let (mut gq, mut gk, mut gv) =
            (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
        let lse_in = with_lse.then_some(&lse[..]);
        cpu::attention_backward(&q, &k, &v, mask, (&out, &dout, lse_in), (&mut gq, &mut gk, &mut gv), &shape)
            .map_err(fail)?;
        // dk and dv sum over the group's queries and heads.
        let tol = tolerance(DType::F32, seq_kv.max(head_dim) * ratio * seq_q);
        check_close("dq", &f64s(&gq), &dq, tol)?;
        check_close("dk", &f64s(&gk), &dk, tol)?;
        check_close("dv", &f64s(&gv), &dv, tol)?;
    }

    /// The reference gradients equal central differences of the reference forward pass
    /// (loss = Σ dout · out), for q, k and v, with GQA, causal, a window, a mask and
    /// dropout (the forward's decisions are a function of the seed, so the loss is smooth
    /// in q, k and v).
    #[test]
    fn attention_backward_matches_finite_differences(
        batch in 1usize..=2, seq_q in 1usize..=5, seq_kv in 1usize..=6, kv_heads in 1usize..=2,
        ratio in 1usize..=2, head_dim in 1usize..=4, causal in any::<bool>(),
        window in prop::option::of(1usize..5), with_mask in any::<bool>(),
        dropout in prop::option::of((0.0f32..0.8, any::<u64>())), seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let shape = AttentionShape {
            dropout: dropout.map(dropout_of),
            ..AttentionShape::new(batch, seq_q, seq_kv, kv_heads * ratio, kv_heads, head_dim, causal)
                .with_window(window)
        };
        let q = f64s(&rng.vec(shape.q_len(), -1.0, 1.0));
        let k = f64s(&rng.vec(shape.kv_len(), -1.0, 1.0));
        let v = f64s(&rng.vec(shape.kv_len(), -1.0, 1.0));
        let dout = f64s(&rng.vec(shape.q_len(), -1.0, 1.0));
        let mask: Vec<f64> = (0..shape.mask_len())
            .map(|_| if rng.below(6) == 0 { f64::NEG_INFINITY } else { rng.uniform(-1.0, 0.5) as f64 })
            .collect();
        let mask = with_mask.then_some(&mask[..]);
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let mut out = vec![0.0; shape.q_len()];
            r::attention(q, k, v, mask, &mut out, &shape).unwrap();
            out.iter().zip(&dout).map(|(a, b)| a * b).sum()
        };
        let mut out = vec![0.0; shape.q_len()];
        let mut lse = vec![0.0; shape.lse_len()];
        r::attention_lse(&q, &k, &v, mask, &mut out, Some(&mut lse), &shape).map_err(fail)?;
        let (mut dq, mut dk, mut dv) =
            (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        r::attention_backward((&q, &k, &v, mask), (&out, &dout, None), (&mut dq, &mut dk, &mut dv), &shape)
            .map_err(fail)?;
        // Taking the probabilities from the log-sum-exp gives the same gradients.
        let (mut lq, mut lk, mut lv) =
            (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        r::attention_backward((&q, &k, &v, mask), (&out, &dout, Some(&lse)),
            (&mut lq, &mut lk, &mut lv), &shape).map_err(fail)?;
        for (what, a, b) in [("dq", &dq, &lq), ("dk", &dk, &lk), ("dv", &dv, &lv)] {
            check_close(what, a, b, (1e-12, 1e-12))?;
        }
        // The log-sum-exp is ln Σ exp(s) over the visible keys: log(Σ_j P_j) = 0 checked
        // through the definition on a brute-force recomputation of one row's scores.
        for (idx, &l) in lse.iter().enumerate() {
            let (bh, i) = (idx / seq_q, idx % seq_q);
            let (b, h) = (bh / shape.num_heads, bh % shape.num_heads);
            let g = h / shape.group_size();
            let d = shape.head_dim;
            let qi = &q[(b * seq_q + i) * shape.q_row() + h * d..][..d];
            let sum: f64 = (shape.key_start(i)..shape.key_limit(i))
                .map(|j| {
                    let kj = &k[(b * seq_kv + j) * shape.kv_row() + g * d..][..d];
                    let dot: f64 = qi.iter().zip(kj).map(|(a, c)| a * c).sum();
                    dot * shape.scale + mask.map_or(0.0, |m| m[i * seq_kv + j])
                })
                .map(f64::exp)
                .sum();
            if sum == 0.0 {
                prop_assert_eq!(l, f64::INFINITY, "lse[{}] of a row that sees nothing", idx);
            } else {
                prop_assert!((l - sum.ln()).abs() <= 1e-12 * (1.0 + l.abs()), "lse[{}]: {} vs {}", idx, l, sum.ln());
            }
        }
        let h = 1e-6;
        for (which, grad) in [(0usize, &dq), (1, &dk), (2, &dv)] {
            for idx in 0..grad.len() {
                let mut t = [q.clone(), k.clone(), v.clone()];
                t[which][idx] += h;
                let up = loss(&t[0], &t[1], &t[2]);
                t[which][idx] -= 2.0 * h;
                let down = loss(&t[0], &t[1], &t[2]);
                let numeric = (up - down) / (2.0 * h);
                prop_assert!((numeric - grad[idx]).abs() <= 1e-6 * (1.0 + numeric.abs()),
                    "d{}[{idx}]: analytic {} vs numeric {numeric}", ["q", "k", "v"][which], grad[idx]);
            }
        }
    }

    #[test]
    fn norms_match_reference(rows in 1usize..=9, dim in 1usize..=300, seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let x = rng.vec(rows * dim, -2.0, 2.0);
        let res = rng.vec(rows * dim, -2.0, 2.0);
        let w = rng.vec(dim, -1.5, 1.5);
        let b = rng.vec(dim, -1.0, 1.0);
        let tol = tolerance(DType::F32, dim);
        let mut want = vec![0f64; rows * dim];
        let mut got = vec![0f32; rows * dim];

        r::rms_norm(&f64s(&x), &f64s(&w), &mut want, rows, dim, 1e-5).map_err(fail)?;
        cpu::rms_norm(&x, &w, &mut got, rows, dim, 1e-5).map_err(fail)?;
        check_close("rms_norm", &f64s(&got), &want, tol)?;

        r::layer_norm(&f64s(&x), &f64s(&w), &f64s(&b), &mut want, rows, dim, 1e-5).map_err(fail)?;
        cpu::layer_norm(&x, &w, &b, &mut got, rows, dim, 1e-5).map_err(fail)?;
        check_close("layer_norm", &f64s(&got), &want, tol)?;

        let mut want_sum = vec![0f64; rows * dim];
        let mut got_sum = vec![0f32; rows * dim];
        let (x64, res64, w64) = (f64s(&x), f64s(&res), f64s(&w));
        r::add_rms_norm(&x64, &res64, &w64, &mut want_sum, &mut want, rows, dim, 1e-5)
            .map_err(fail)?;
        cpu::add_rms_norm(&x, &res, &w, &mut got_sum, &mut got, rows, dim, 1e-5).map_err(fail)?;
        check_close("add_rms_norm.sum", &f64s(&got_sum), &want_sum, tolerance(DType::F32, 1))?;
        check_close("add_rms_norm.norm", &f64s(&got), &want, tol)?;

        let b64 = f64s(&b);
        r::add_layer_norm(&x64, &res64, &w64, &b64, &mut want_sum, &mut want, rows, dim, 1e-5)
            .map_err(fail)?;
        cpu::add_layer_norm(&x, &res, &w, &b, &mut got_sum, &mut got, rows, dim, 1e-5)
            .map_err(fail)?;
        check_close("add_layer_norm.sum", &f64s(&got_sum), &want_sum, tolerance(DType::F32, 1))?;
        check_close("add_layer_norm.norm", &f64s(&got), &want, tol)?;
    }

    #[test]
    fn rotary_matches_reference(
        batch in 1usize..=3, seq in 1usize..=9, heads in 1usize..=3,
        head_dim in prop::sample::select(vec![2usize, 6, 8, 16, 64]), per_token in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let x = rng.vec(batch * seq * heads * head_dim, -1.0, 1.0);
        let n = if per_token { batch * seq } else { seq };
        let positions: Vec<i64> = (0..n).map(|_| rng.below(4096) as i64).collect();
        let mut want = vec![0f64; x.len()];
        r::rotary(&f64s(&x), &positions, &mut want, batch, seq, heads, head_dim, 10_000.0, None)
            .map_err(fail)?;
        let mut got = vec![0f32; x.len()];
        cpu::rotary(&x, &positions, &mut got, batch, seq, heads, head_dim, 10_000.0, None)
            .map_err(fail)?;
        check_close("rotary", &f64s(&got), &want, tolerance(DType::F32, 2))?;
    }

    #[test]
    fn scaled_rotary_matches_reference(
        batch in 1usize..=2, seq in 1usize..=9, heads in 1usize..=3,
        head_dim in prop::sample::select(vec![4usize, 8, 16, 64, 128]),
        theta in prop::sample::select(vec![10_000f32, 500_000.0, 1e6]),
        scaling in rope_scaling(), per_token in any::<bool>(), seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let x = rng.vec(batch * seq * heads * head_dim, -1.0, 1.0);
        let n = if per_token { batch * seq } else { seq };
        let positions: Vec<i64> = (0..n).map(|_| rng.below(16_384) as i64).collect();
        let mut want = vec![0f64; x.len()];
        r::rotary(
            &f64s(&x), &positions, &mut want, batch, seq, heads, head_dim, theta as f64,
            Some(&scaling),
        )
        .map_err(fail)?;
        let mut got = vec![0f32; x.len()];
        cpu::rotary(&x, &positions, &mut got, batch, seq, heads, head_dim, theta, Some(&scaling))
            .map_err(fail)?;
        check_close("rotary (scaled)", &f64s(&got), &want, tolerance(DType::F32, 2))?;
    }

    #[test]
    fn split_rotary_matches_reference(
        batch in 1usize..=3, seq in 1usize..=9, q_heads in 0usize..=4, k_heads in 1usize..=2,
        v in 0usize..=40, head_dim in prop::sample::select(vec![2usize, 6, 8, 64, 128]),
        per_token in any::<bool>(), scaling in prop::option::of(rope_scaling()),
        seed in any::<u64>(),
    ) {
        // Dynamic NTK needs head_dim > 2.
        prop_assume!(head_dim > 2 || scaling.is_none());
        let mut rng = Rng::new(seed);
        let sizes = [q_heads * head_dim, k_heads * head_dim, v];
        let width: usize = sizes.iter().sum();
        let tokens = batch * seq;
        let qkv = rng.vec(tokens * width, -1.0, 1.0);
        let n = if per_token { tokens } else { seq };
        let positions: Vec<i64> = (0..n).map(|_| rng.below(16_384) as i64).collect();
        let mut want: Vec<Vec<f64>> = sizes.iter().map(|w| vec![0f64; tokens * w]).collect();
        let [wq, wk, wv] = &mut want[..] else { unreachable!() };
        r::split_rotary(
            &f64s(&qkv), &positions, (wq, wk, wv), batch, seq, sizes, head_dim, 10_000.0,
            scaling.as_ref(),
        )
        .map_err(fail)?;
        let mut got: Vec<Vec<f32>> = sizes.iter().map(|w| vec![0f32; tokens * w]).collect();
        let [gq, gk, gv] = &mut got[..] else { unreachable!() };
        cpu::split_rotary(
            &qkv, &positions, (gq, gk, gv), batch, seq, sizes, head_dim, 10_000.0,
            scaling.as_ref(),
        )
        .map_err(fail)?;
        for ((g, w), what) in got.iter().zip(&want).zip(["q", "k", "v"]) {
            check_close(what, &f64s(g), w, tolerance(DType::F32, 2))?;
        }
        // v is a plain copy, and the reference is split then rotary by definition.
        prop_assert_eq!(f64s(&got[2]), want[2].clone());
    }

    #[test]
    fn softmax_matches_reference(rows in 1usize..=9, dim in 1usize..=300, seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let x: Vec<f32> = (0..rows * dim)
            .map(|_| if rng.below(16) == 0 { f32::NEG_INFINITY } else { rng.uniform(-20.0, 20.0) })
            .collect();
        let mut want = vec![0f64; x.len()];
        r::softmax(&f64s(&x), &mut want, rows, dim).map_err(fail)?;
        let mut got = vec![0f32; x.len()];
        cpu::softmax(&x, &mut got, rows, dim).map_err(fail)?;
        check_close("softmax", &f64s(&got), &want, tolerance(DType::F32, dim))?;
    }

    #[test]
    fn argmax_matches_reference(rows in 1usize..=9, dim in 1usize..=300, seed in any::<u64>()) {
        // Few distinct values so that ties are common; some -inf, a NaN now and then.
        let mut rng = Rng::new(seed);
        let x: Vec<f32> = (0..rows * dim)
            .map(|_| match rng.below(64) {
                0 => f32::NEG_INFINITY,
                1 if dim > 1 => f32::NAN,
                _ => rng.below(7) as f32 - 3.0,
            })
            .collect();
        let mut want = vec![0f64; rows];
        r::argmax(&f64s(&x), &mut want, rows, dim).map_err(fail)?;
        let mut got = vec![0i64; rows];
        cpu::argmax(&x, &mut got, rows, dim).map_err(fail)?;
        let got: Vec<f64> = got.iter().map(|&i| i as f64).collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn elementwise_matches_reference(
        rows in 1usize..=20, cols in 1usize..=70, seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let a = rng.vec(rows * cols, -8.0, 8.0);
        let b = rng.vec(cols, -2.0, 2.0);
        let tol = tolerance(DType::F32, 1);
        let mut want = vec![0f64; a.len()];
        let mut got = vec![0f32; a.len()];
        for act in Act::ALL {
            r::activation(&f64s(&a), &mut want, act).map_err(fail)?;
            cpu::activation(&a, &mut got, act).map_err(fail)?;
            check_close(&format!("{act:?}"), &f64s(&got), &want, tol)?;
        }
        r::add(&f64s(&a), &f64s(&b), &mut want).map_err(fail)?;
        cpu::add(&a, &b, &mut got).map_err(fail)?;
        check_close("add", &f64s(&got), &want, tol)?;
        r::mul(&f64s(&a), &f64s(&b), &mut want).map_err(fail)?;
        cpu::mul(&a, &b, &mut got).map_err(fail)?;
        check_close("mul", &f64s(&got), &want, tol)?;

        // Gated activation over [rows, 2 cols] -> [rows, cols].
        let gu = rng.vec(rows * 2 * cols, -8.0, 8.0);
        let mut want = vec![0f64; rows * cols];
        let mut got = vec![0f32; rows * cols];
        for act in Act::ALL {
            r::act_and_mul(&f64s(&gu), &mut want, cols, act).map_err(fail)?;
            cpu::act_and_mul(&gu, &mut got, cols, act).map_err(fail)?;
            check_close(&format!("act_and_mul {act:?}"), &f64s(&got), &want, tol)?;
        }
        prop_assert!(cpu::act_and_mul(&gu[1..], &mut got, cols, Act::Silu).is_err());

        // Embedding: `a` as a [rows, cols] table.
        let ids: Vec<i64> = (0..rng.below(12) + 1).map(|_| rng.below(rows) as i64).collect();
        let mut want = vec![0f64; ids.len() * cols];
        let mut got = vec![0f32; ids.len() * cols];
        r::embedding(&ids, &f64s(&a), &mut want, rows, cols).map_err(fail)?;
        cpu::embedding(&ids, &a, &mut got, rows, cols).map_err(fail)?;
        prop_assert_eq!(f64s(&got), want);
    }

    #[test]
    fn quantize_matches_reference_and_error_is_bounded(
        len in 1usize..=500, seed in any::<u64>(), range in 0.01f32..100.0,
    ) {
        let mut rng = Rng::new(seed);
        let x = rng.vec(len, -range, range);
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        for dtype in [DType::F8E4M3, DType::F8E5M2, DType::I8] {
            let scale = kpt_core::dtype::quant_scale(amax, dtype);
            let mut want_stored = vec![0f64; len];
            r::quantize(&f64s(&x), dtype, scale as f64, &mut want_stored).map_err(fail)?;
            let mut got_stored = vec![0f64; len];
            let mut got_deq = vec![0f32; len];
            match dtype {
                DType::F8E4M3 => {
                    let mut bits = vec![0u8; len];
                    cpu::quantize_f8e4m3(&x, scale, &mut bits).map_err(fail)?;
                    for (g, &b) in got_stored.iter_mut().zip(&bits) {
                        *g = kpt_core::dtype::f8e4m3_to_f32(b) as f64;
                    }
                    cpu::dequantize_f8e4m3(&bits, scale, &mut got_deq).map_err(fail)?;
                }
                DType::F8E5M2 => {
                    let mut bits = vec![0u8; len];
                    cpu::quantize_f8e5m2(&x, scale, &mut bits).map_err(fail)?;
                    for (g, &b) in got_stored.iter_mut().zip(&bits) {
                        *g = kpt_core::dtype::f8e5m2_to_f32(b) as f64;
                    }
                    cpu::dequantize_f8e5m2(&bits, scale, &mut got_deq).map_err(fail)?;
                }
                _ => {
                    let mut q = vec![0i8; len];
                    cpu::quantize_i8(&x, scale, &mut q).map_err(fail)?;
                    for (g, &v) in got_stored.iter_mut().zip(&q) {
                        *g = v as f64;
                    }
                    cpu::dequantize_i8(&q, scale, &mut got_deq).map_err(fail)?;
                }
            }
            prop_assert_eq!(&got_stored, &want_stored, "{} stored values", dtype);
            let mut want_deq = vec![0f64; len];
            r::dequantize(&want_stored, scale as f64, &mut want_deq).map_err(fail)?;
            let tol = tolerance(DType::F32, 1);
            check_close(&format!("dequantize {dtype}"), &f64s(&got_deq), &want_deq, tol)?;
            // The quantization error itself: one rounding on the dtype's grid.
            let (abs, rel) = tolerance(dtype, 1);
            let tol = (abs * scale as f64, rel);
            check_close(&format!("quantization error {dtype}"), &want_deq, &f64s(&x), tol)?;
        }
        for dtype in [DType::BF16, DType::F16] {
            let mut want = vec![0f64; len];
            r::quantize(&f64s(&x), dtype, 1.0, &mut want).map_err(fail)?;
            let got: Vec<f64> = if dtype == DType::BF16 {
                let mut h = vec![bf16::ZERO; len];
                cpu::cast_f32_to_bf16(&x, &mut h).map_err(fail)?;
                let mut back = vec![0f32; len];
                cpu::cast_bf16_to_f32(&h, &mut back).map_err(fail)?;
                f64s(&back)
            } else {
                let mut h = vec![f16::ZERO; len];
                cpu::cast_f32_to_f16(&x, &mut h).map_err(fail)?;
                let mut back = vec![0f32; len];
                cpu::cast_f16_to_f32(&h, &mut back).map_err(fail)?;
                f64s(&back)
            };
            prop_assert_eq!(&got, &want, "cast to {}", dtype);
            check_close(&format!("rounding error {dtype}"), &got, &f64s(&x), tolerance(dtype, 1))?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// Shapes past one register tile, one k block and one column block of the f32 GEMM,
    /// large enough to split over threads: partial edge tiles, accumulation over k
    /// blocks and the fused epilogue of a linear layer (transposed weights).
    #[test]
    fn large_f32_gemm_matches_reference(
        m in 1usize..=300, k in 200usize..=700, n in 1usize..=700,
        seed in any::<u64>(), act in 0usize..5,
    ) {
        let mut rng = Rng::new(seed);
        let a = rng.vec(m * k, -1.0, 1.0);
        let b = rng.vec(k * n, -1.0, 1.0);
        let mut want = vec![0f64; m * n];
        r::matmul(&f64s(&a), &f64s(&b), &mut want, m, k, n).map_err(fail)?;
        let mut got = vec![f32::NAN; m * n];
        cpu::matmul_f32(&a, &b, &mut got, m, k, n).map_err(fail)?;
        check_close("matmul_f32", &f64s(&got), &want, tolerance(DType::F32, k))?;
        check_linear(seed, m.max(cpu::linear::GEMV_MAX_M + 1), k, n, true, act_of(act))?;
    }
}

#[test]
fn linear_large_all_dtypes() {
    for (m, k, n, act) in [
        (128, 512, 384, Some(Act::Silu)),
        // Several weight tiles on the gemm path (n > TILE_N).
        (20, 300, 1100, Some(Act::GeluTanh)),
        // GEMV with several rows, and with one.
        (3, 1000, 600, Some(Act::GeluErf)),
        (1, 4096, 64, None),
    ] {
        check_linear(7, m, k, n, true, act).expect("linear large");
    }
}

#[test]
fn attention_large() {
    for causal in [false, true] {
        let shape = AttentionShape::new(1, 257, 257, 4, 2, 64, causal);
        check_attention(
            11,
            shape,
            false,
            cpu::DEFAULT_BLOCK_Q,
            cpu::DEFAULT_BLOCK_KV,
        )
        .expect("attention large");
    }
    // Decode: one query against a long cache, GQA 4.
    let shape = AttentionShape::new(2, 1, 300, 8, 2, 64, true);
    check_attention(12, shape, true, cpu::DEFAULT_BLOCK_Q, cpu::DEFAULT_BLOCK_KV)
        .expect("attention decode");
}

#[test]
fn large_elementwise_and_norms_run_in_parallel() {
    let mut rng = Rng::new(5);
    let (rows, dim) = (300, 1024);
    let x = rng.vec(rows * dim, -4.0, 4.0);
    let w = rng.vec(dim, -1.0, 1.0);
    let mut got = vec![0f32; x.len()];
    let mut want = vec![0f64; x.len()];
    cpu::activation(&x, &mut got, Act::GeluTanh).expect("activation");
    r::activation(&f64s(&x), &mut want, Act::GeluTanh).expect("reference");
    check_close(
        "gelu_tanh large",
        &f64s(&got),
        &want,
        tolerance(DType::F32, 1),
    )
    .expect("close");
    cpu::rms_norm(&x, &w, &mut got, rows, dim, 1e-6).expect("rms_norm");
    r::rms_norm(&f64s(&x), &f64s(&w), &mut want, rows, dim, 1e-6).expect("reference");
    check_close(
        "rms_norm large",
        &f64s(&got),
        &want,
        tolerance(DType::F32, dim),
    )
    .expect("close");
    let res = rng.vec(rows * dim, -4.0, 4.0);
    let b = rng.vec(dim, -1.0, 1.0);
    let mut got_sum = vec![0f32; x.len()];
    let mut want_sum = vec![0f64; x.len()];
    cpu::add_layer_norm(&x, &res, &w, &b, &mut got_sum, &mut got, rows, dim, 1e-6)
        .expect("add_layer_norm");
    r::add_layer_norm(
        &f64s(&x),
        &f64s(&res),
        &f64s(&w),
        &f64s(&b),
        &mut want_sum,
        &mut want,
        rows,
        dim,
        1e-6,
    )
    .expect("reference");
    check_close(
        "add_layer_norm.sum large",
        &f64s(&got_sum),
        &want_sum,
        tolerance(DType::F32, 1),
    )
    .expect("close");
    check_close(
        "add_layer_norm.norm large",
        &f64s(&got),
        &want,
        tolerance(DType::F32, dim),
    )
    .expect("close");
    cpu::softmax(&x, &mut got, rows, dim).expect("softmax");
    r::softmax(&f64s(&x), &mut want, rows, dim).expect("reference");
    check_close(
        "softmax large",
        &f64s(&got),
        &want,
        tolerance(DType::F32, dim),
    )
    .expect("close");
    cpu::mul(&x, &w, &mut got).expect("mul");
    r::mul(&f64s(&x), &f64s(&w), &mut want).expect("reference");
    check_close("mul large", &f64s(&got), &want, tolerance(DType::F32, 1)).expect("close");
    // SwiGLU over [rows, 2 * dim / 2] rows.
    let half = dim / 2;
    let (got, want) = (&mut got[..rows * half], &mut want[..rows * half]);
    cpu::act_and_mul(&x, got, half, Act::Silu).expect("act_and_mul");
    r::act_and_mul(&f64s(&x), want, half, Act::Silu).expect("reference");
    check_close(
        "act_and_mul large",
        &f64s(got),
        want,
        tolerance(DType::F32, 1),
    )
    .expect("close");
}

#[test]
fn split_rotary_large_per_token_positions() {
    // A LLaMA-3-8B-shaped decode batch: 16 sequences at different lengths, one token each.
    let mut rng = Rng::new(11);
    let (batch, seq, head_dim, sizes) = (16, 1, 128, [4096, 1024, 1024]);
    let width: usize = sizes.iter().sum();
    let qkv = rng.vec(batch * width, -2.0, 2.0);
    let positions: Vec<i64> = (0..batch).map(|_| rng.below(131_072) as i64).collect();
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let mut want: Vec<Vec<f64>> = sizes.iter().map(|w| vec![0f64; batch * w]).collect();
    let [wq, wk, wv] = &mut want[..] else {
        unreachable!()
    };
    r::split_rotary(
        &f64s(&qkv),
        &positions,
        (wq, wk, wv),
        batch,
        seq,
        sizes,
        head_dim,
        500_000.0,
        Some(&scaling),
    )
    .expect("reference");
    let mut got: Vec<Vec<f32>> = sizes.iter().map(|w| vec![0f32; batch * w]).collect();
    let [gq, gk, gv] = &mut got[..] else {
        unreachable!()
    };
    cpu::split_rotary(
        &qkv,
        &positions,
        (gq, gk, gv),
        batch,
        seq,
        sizes,
        head_dim,
        500_000.0,
        Some(&scaling),
    )
    .expect("split_rotary");
    for ((g, w), what) in got.iter().zip(&want).zip(["q", "k", "v"]) {
        check_close(what, &f64s(g), w, tolerance(DType::F32, 2)).expect("close");
    }
    // The same q as the plain rotary over per-token positions of the split-out q.
    let q_in: Vec<f32> = qkv.chunks(width).flat_map(|r| r[..4096].to_vec()).collect();
    let mut q = vec![0f32; q_in.len()];
    cpu::rotary(
        &q_in,
        &positions,
        &mut q,
        batch,
        seq,
        32,
        head_dim,
        500_000.0,
        Some(&scaling),
    )
    .expect("rotary");
    assert_eq!(q, got[0]);
}

#[test]
fn reference_rounding_is_correct_from_f64() {
    // Just above the bf16 tie 38.625 (between 38.5 and 38.75): must round up.
    let v = 38.625 + 1e-12;
    let mut out = [0.0];
    r::quantize(&[v], DType::BF16, 1.0, &mut out).expect("quantize");
    assert_eq!(out[0], 38.75);
    r::quantize(&[38.625], DType::BF16, 1.0, &mut out).expect("quantize");
    assert_eq!(out[0], 38.5);
    // f16: 1 + 2^-11 is a tie (-> 1), a hair above rounds up.
    r::quantize(&[1.0 + 2f64.powi(-11) + 1e-15], DType::F16, 1.0, &mut out).expect("quantize");
    assert_eq!(out[0], 1.0 + 2f64.powi(-10));
    r::quantize(&[2.5 + 1e-12], DType::I8, 1.0, &mut out).expect("quantize");
    assert_eq!(out[0], 3.0);
    r::quantize(&[2.5], DType::I8, 1.0, &mut out).expect("quantize");
    assert_eq!(out[0], 2.0);
}

#[test]
fn edge_cases() {
    // A softmax row of only -inf gives zeros, like a fully masked attention row.
    let x = [f32::NEG_INFINITY; 5];
    let mut out = [1f32; 5];
    cpu::softmax(&x, &mut out, 1, 5).expect("softmax");
    assert_eq!(out, [0.0; 5]);
    // argmax: the first of equal maxima, 0 for a row of -inf, -1 for a row with a NaN.
    let x = [
        1.0,
        3.0,
        3.0,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        2.0,
        f32::NAN,
        9.0,
        0.0,
    ];
    let mut ids = [7i64; 3];
    cpu::argmax(&x, &mut ids, 3, 3).expect("argmax");
    assert_eq!(ids, [1, 2, -1]);
    cpu::argmax(&[f32::NEG_INFINITY; 4], &mut ids[..1], 1, 4).expect("argmax");
    assert_eq!(ids[0], 0);
    assert!(cpu::argmax(&x, &mut ids, 4, 3).is_err());
    // Causal with more queries than keys: the first queries see nothing -> zeros.
    let shape = AttentionShape::new(1, 4, 2, 1, 1, 2, true);
    let q = [1f32; 8];
    let kv = [0.5f32; 4];
    let mut out = [f32::NAN; 8];
    cpu::attention(&q, &kv, &kv, None, &mut out, &shape, 2, 16).expect("attention");
    assert_eq!(&out[..4], &[0.0; 4]);
    assert_eq!(&out[4..], &[0.5; 4]);
    // k = 0: linear is act(bias).
    let mut out = [f32::NAN; 2];
    cpu::linear(
        &[],
        WeightsRef::F32(&[]),
        Some(&[-1.0, 2.0]),
        Some(Act::Relu),
        &mut out,
        1,
        0,
        2,
    )
    .expect("linear");
    assert_eq!(out, [0.0, 2.0]);
    // Zero-sized inputs are fine.
    cpu::matmul_f32(&[], &[], &mut [], 0, 3, 0).expect("empty matmul");
    cpu::add(&[], &[], &mut []).expect("empty add");
}

fn assert_shape_err<T: std::fmt::Debug>(r: kpt_core::Result<T>, needle: &str) {
    match r {
        Err(KptError::Shape { message, .. }) => assert!(
            message.contains(needle),
            "message `{message}` lacks `{needle}`"
        ),
        other => panic!("expected a shape error containing `{needle}`, got {other:?}"),
    }
}

fn assert_invalid<T: std::fmt::Debug>(r: kpt_core::Result<T>) {
    assert!(
        matches!(r, Err(KptError::InvalidArgument(_))),
        "expected InvalidArgument, got {r:?}"
    );
}

#[test]
fn bad_inputs_are_typed_errors() {
    let x = vec![0f32; 6];
    let w = vec![0f32; 6];
    let mut out = vec![0f32; 4];
    // linear: x has 6 elements, [m=2, k=4] needs 8.
    assert_shape_err(
        cpu::linear(&x, WeightsRef::F32(&w), None, None, &mut out, 2, 4, 2),
        "x [m, k] has 6 elements, expected 8",
    );
    assert_shape_err(
        cpu::linear(
            &x,
            WeightsRef::BF16(&[bf16::ZERO; 5]),
            None,
            None,
            &mut out,
            2,
            3,
            2,
        ),
        "w [n, k]",
    );
    assert_shape_err(
        cpu::linear(
            &x,
            WeightsRef::F32(&w),
            Some(&[0.0; 3]),
            None,
            &mut out,
            2,
            3,
            2,
        ),
        "bias [n]",
    );
    assert_shape_err(
        cpu::linear(&x, WeightsRef::F32(&w), None, None, &mut out[..3], 2, 3, 2),
        "out [m, n]",
    );
    assert_invalid(cpu::linear(
        &x,
        WeightsRef::I8 {
            data: &[0; 6],
            scale: f32::NAN,
        },
        None,
        None,
        &mut out,
        2,
        3,
        2,
    ));
    assert_shape_err(
        cpu::matmul_f32(&x, &w, &mut out[..3], 2, 3, 2),
        "out [m, n] has 3 elements, expected 4",
    );
    assert_shape_err(
        cpu::matmul_bf16(
            &[bf16::ZERO; 6],
            &[bf16::ZERO; 5],
            &mut [bf16::ZERO; 4],
            2,
            3,
            2,
        ),
        "b [k, n]",
    );
    assert_shape_err(
        r::matmul(&[0.0; 6], &[0.0; 6], &mut [0.0; 3], 2, 3, 2),
        "out [m, n]",
    );
    // usize overflow is an error, not a panic.
    assert_shape_err(
        cpu::matmul_f32(&x, &w, &mut out, usize::MAX, 2, 2),
        "overflows",
    );

    // Attention: GQA heads that do not group, wrong lengths, zero block.
    let shape = AttentionShape::new(1, 2, 2, 6, 4, 2, false);
    assert_shape_err(
        shape.validate(),
        "num_heads 6 is not a multiple of num_kv_heads 4",
    );
    let q = vec![0f32; shape.q_len()];
    let kv = vec![0f32; 2 * 2 * 4 * 2];
    let mut o = vec![0f32; shape.q_len()];
    assert_shape_err(
        cpu::attention(&q, &kv, &kv, None, &mut o, &shape, 4, 4),
        "not a multiple",
    );
    let shape = AttentionShape::new(1, 2, 3, 4, 2, 2, false);
    let (q, kv) = (vec![0f32; shape.q_len()], vec![0f32; shape.kv_len()]);
    let mut o = vec![0f32; shape.q_len()];
    assert_shape_err(
        cpu::attention(&q, &kv[1..], &kv, None, &mut o, &shape, 4, 4),
        "k [batch",
    );
    assert_shape_err(
        cpu::attention(&q, &kv, &kv, Some(&[0.0; 5]), &mut o, &shape, 4, 4),
        "mask [seq_q, seq_kv] has 5 elements, expected 6",
    );
    assert_invalid(cpu::attention(&q, &kv, &kv, None, &mut o, &shape, 0, 4));
    let q64 = vec![0f64; shape.q_len()];
    assert_shape_err(
        r::attention(
            &q64[1..],
            &f64s(&kv),
            &f64s(&kv),
            None,
            &mut vec![0.0; shape.q_len()],
            &shape,
        ),
        "q [batch",
    );

    // Rotary: odd head_dim, wrong positions length.
    let x = vec![0f32; 2 * 3];
    let mut o = vec![0f32; 6];
    assert_shape_err(
        cpu::rotary(&x, &[0, 1], &mut o, 1, 2, 1, 3, 10_000.0, None),
        "head_dim must be even, got 3",
    );
    assert_shape_err(
        r::rotary(
            &[0.0; 6],
            &[0, 1],
            &mut [0.0; 6],
            1,
            2,
            1,
            3,
            10_000.0,
            None,
        ),
        "even",
    );
    assert_shape_err(
        cpu::rotary(&x, &[0], &mut o, 1, 2, 1, 3 - 1, 10_000.0, None),
        "x [batch",
    );
    assert_shape_err(
        cpu::rotary(&x[..4], &[0], &mut o[..4], 1, 2, 1, 2, 10_000.0, None),
        "positions must have 2 ([seq]) or 2 ([batch, seq]) entries, got 1",
    );
    // Rotary scaling: bad parameters are typed errors in both.
    let bad = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 4.0,
        high_freq_factor: 1.0,
        original_max_position_embeddings: 8192,
    };
    let x = vec![0f32; 4];
    let mut o = vec![0f32; 4];
    assert!(matches!(
        cpu::rotary(&x, &[0], &mut o, 1, 1, 1, 4, 10_000.0, Some(&bad)),
        Err(KptError::RopeScaling(RopeScalingError::FreqFactors { .. }))
    ));
    assert!(matches!(
        r::rotary(
            &[0.0; 4],
            &[0],
            &mut [0.0; 4],
            1,
            1,
            1,
            4,
            10_000.0,
            Some(&RopeScaling::Linear { factor: 0.0 })
        ),
        Err(KptError::RopeScaling(RopeScalingError::Factor { .. }))
    ));

    // Split + rotary: widths that head_dim does not divide, short outputs, positions.
    let qkv = vec![0f32; 2 * 12];
    let (mut q, mut k, mut v) = (vec![0f32; 8], vec![0f32; 8], vec![0f32; 8]);
    assert_shape_err(
        cpu::split_rotary(
            &qkv,
            &[0, 1],
            (&mut q, &mut k, &mut v),
            1,
            2,
            [4, 4, 4],
            3,
            1e4,
            None,
        ),
        "head_dim 3 must be even",
    );
    assert_shape_err(
        cpu::split_rotary(
            &qkv,
            &[0, 1],
            (&mut q, &mut k, &mut v),
            1,
            2,
            [6, 2, 4],
            4,
            1e4,
            None,
        ),
        "divide the q and k widths",
    );
    assert_shape_err(
        cpu::split_rotary(
            &qkv,
            &[0],
            (&mut q, &mut k, &mut v),
            1,
            2,
            [4, 4, 4],
            4,
            1e4,
            None,
        ),
        "positions must have 2",
    );
    assert_shape_err(
        cpu::split_rotary(
            &qkv,
            &[0, 1],
            (&mut q, &mut k[..4], &mut v),
            1,
            2,
            [4, 4, 4],
            4,
            1e4,
            None,
        ),
        "k [batch, seq, 4]",
    );
    assert_shape_err(
        r::split_rotary(
            &[0.0; 24],
            &[0, 1, 2],
            (&mut [0.0; 8], &mut [0.0; 8], &mut [0.0; 8]),
            1,
            2,
            [4, 4, 4],
            4,
            1e4,
            None,
        ),
        "positions must have 2",
    );

    // Embedding: id out of range (checked before anything is written).
    let table = vec![1f32; 3 * 2];
    let mut o = vec![0f32; 4];
    assert_invalid(cpu::embedding(&[0, 3], &table, &mut o, 3, 2));
    assert_invalid(cpu::embedding(&[-1, 0], &table, &mut o, 3, 2));
    assert_eq!(o, [0.0; 4]);
    assert_invalid(r::embedding(&[5, 0], &[0.0; 6], &mut [0.0; 4], 3, 2));
    assert_shape_err(
        cpu::embedding(&[0, 1], &table, &mut o[..3], 3, 2),
        "out [ids, dim]",
    );

    // Broadcast, norms, softmax, quantization.
    assert_shape_err(cpu::add(&[0.0; 6], &[0.0; 4], &mut [0.0; 6]), "must divide");
    assert_shape_err(cpu::mul(&[0.0; 6], &[0.0; 3], &mut [0.0; 5]), "out");
    assert_shape_err(
        cpu::rms_norm(&[0.0; 6], &[0.0; 2], &mut [0.0; 6], 2, 3, 1e-5),
        "w [dim] has 2 elements, expected 3",
    );
    assert_shape_err(
        cpu::layer_norm(&[0.0; 6], &[0.0; 3], &[0.0; 3], &mut [0.0; 6], 3, 3, 1e-5),
        "x [rows, dim]",
    );
    assert_shape_err(
        cpu::add_rms_norm(
            &[0.0; 6],
            &[0.0; 6],
            &[0.0; 3],
            &mut [0.0; 6],
            &mut [0.0; 5],
            2,
            3,
            1e-5,
        ),
        "norm_out",
    );
    assert_shape_err(
        cpu::add_layer_norm(
            &[0.0; 6],
            &[0.0; 6],
            &[0.0; 3],
            &[0.0; 2],
            &mut [0.0; 6],
            &mut [0.0; 6],
            2,
            3,
            1e-5,
        ),
        "b [dim] has 2 elements, expected 3",
    );
    assert_shape_err(
        cpu::add_layer_norm(
            &[0.0; 6],
            &[0.0; 5],
            &[0.0; 3],
            &[0.0; 3],
            &mut [0.0; 6],
            &mut [0.0; 6],
            2,
            3,
            1e-5,
        ),
        "residual",
    );
    assert_shape_err(
        r::add_layer_norm(
            &[0.0; 6],
            &[0.0; 6],
            &[0.0; 3],
            &[0.0; 3],
            &mut [0.0; 6],
            &mut [0.0; 4],
            2,
            3,
            1e-5,
        ),
        "norm_out",
    );
    assert_shape_err(
        cpu::softmax(&[0.0; 6], &mut [0.0; 6], 4, 2),
        "x [rows, dim]",
    );
    assert_shape_err(cpu::activation(&[0.0; 6], &mut [0.0; 5], Act::Relu), "out");
    assert_invalid(cpu::quantize_f8e4m3(&[1.0], 0.0, &mut [0]));
    assert_shape_err(cpu::quantize_i8(&[1.0, 2.0], 1.0, &mut [0]), "out");
    assert_shape_err(cpu::dequantize_f8e5m2(&[0, 0], 1.0, &mut [0.0]), "out");
    assert_shape_err(cpu::cast_f32_to_bf16(&[1.0, 2.0], &mut [bf16::ZERO]), "out");
    assert!(matches!(
        r::quantize(&[1.0], DType::I32, 1.0, &mut [0.0]),
        Err(KptError::DTypeMismatch { .. })
    ));
}

/// Rough timings (run with `--ignored --nocapture`): GEMV with f32 vs bf16/fp8 weights,
/// and a mid-sized attention.
#[test]
#[ignore = "timing report, not a test"]
fn timing_report() {
    use std::time::Instant;
    fn best(mut f: impl FnMut(), reps: usize) -> f64 {
        f();
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min)
    }
    let mut rng = Rng::new(1);
    let (k, n) = (4096, 4096);
    let x = rng.vec(k, -1.0, 1.0);
    let w = rng.vec(n * k, -1.0, 1.0);
    let mut out = vec![0f32; n];
    for dtype in WEIGHT_DTYPES {
        let wq = Weights::new(&w, dtype);
        let ms = best(
            || cpu::linear(&x, wq.as_ref(), None, None, &mut out, 1, k, n).expect("linear"),
            20,
        );
        let gbs = (n * k * dtype.size_in_bytes()) as f64 / ms / 1e6;
        println!("linear m=1 k={k} n={n} {dtype:>7}: {ms:7.3} ms ({gbs:5.1} GB/s of weights)");
    }
    for m in [4, 8, 16, 64] {
        let xm = rng.vec(m * k, -1.0, 1.0);
        let mut om = vec![0f32; m * n];
        for dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
            let wq = Weights::new(&w, dtype);
            let ms = best(
                || cpu::linear(&xm, wq.as_ref(), None, None, &mut om, m, k, n).expect("linear"),
                5,
            );
            println!(
                "linear m={m} k={k} n={n} {dtype:>7}: {ms:7.3} ms ({:5.1} GFLOP/s)",
                2.0 * (m * n * k) as f64 / ms / 1e6
            );
        }
    }
    for causal in [false, true] {
        let shape = AttentionShape::new(1, 512, 512, 8, 8, 64, causal);
        let q = rng.vec(shape.q_len(), -1.0, 1.0);
        let kk = rng.vec(shape.kv_len(), -1.0, 1.0);
        let v = rng.vec(shape.kv_len(), -1.0, 1.0);
        let mut o = vec![0f32; shape.q_len()];
        let ms = best(
            || {
                cpu::attention(
                    &q,
                    &kk,
                    &v,
                    None,
                    &mut o,
                    &shape,
                    cpu::DEFAULT_BLOCK_Q,
                    cpu::DEFAULT_BLOCK_KV,
                )
                .expect("attention")
            },
            10,
        );
        let flops = 4.0 * (8 * 512 * 512 * 64) as f64 / if causal { 2.0 } else { 1.0 };
        println!(
            "attention B1 H8 S512 D64 causal={causal}: {ms:7.3} ms ({:5.1} GFLOP/s)",
            flops / ms / 1e6
        );
    }
    let (m, kk, nn) = (512, 512, 512);
    let a = rng.vec(m * kk, -1.0, 1.0);
    let b = rng.vec(kk * nn, -1.0, 1.0);
    let mut o = vec![0f32; m * nn];
    let ms = best(
        || cpu::matmul_f32(&a, &b, &mut o, m, kk, nn).expect("matmul"),
        5,
    );
    println!(
        "matmul_f32 512^3: {ms:7.3} ms ({:5.1} GFLOP/s)",
        2.0 * (m * kk * nn) as f64 / ms / 1e6
    );
    let ah: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
    let bh: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
    let mut oh = vec![f16::ZERO; m * nn];
    let ms = best(
        || cpu::matmul_f16(&ah, &bh, &mut oh, m, kk, nn).expect("matmul"),
        5,
    );
    println!("matmul_f16 512^3 (via f32): {ms:7.3} ms");
    let ms = best(
        || unsafe {
            gemm_native_f16(&ah, &bh, &mut oh, m, kk, nn);
        },
        5,
    );
    println!("matmul_f16 512^3 (gemm native f16): {ms:7.3} ms");
    let ab: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
    let bb: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut ob = vec![bf16::ZERO; m * nn];
    let ms = best(
        || cpu::matmul_bf16(&ab, &bb, &mut ob, m, kk, nn).expect("matmul"),
        5,
    );
    println!("matmul_bf16 512^3: {ms:7.3} ms");
}

/// gemm's own f16 kernel, for the timing comparison only.
///
/// # Safety
/// Slices must hold `m*k`, `k*n` and `m*n` elements.
unsafe fn gemm_native_f16(a: &[f16], b: &[f16], out: &mut [f16], m: usize, k: usize, n: usize) {
    assert!(a.len() == m * k && b.len() == k * n && out.len() == m * n);
    // SAFETY: lengths asserted above; row-major strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            f16::ZERO,
            f16::ONE,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        );
    }
}
