//! The CUDA backend on a real GPU: every kernel and dtype against the CPU f64 reference
//! over random shapes (1, odd sizes, rows too long for the register path), the caching
//! allocator with a deliberate over-allocation, and the error paths.
//!
//! Without a CUDA device every test returns after printing one `SKIPPED` line to the
//! terminal. With `KPT_REQUIRE_GPU=1` (the GPU bundle's runner sets it) a missing device
//! fails the tests instead, so a GPU run can never pass by skipping.

mod common;

use std::io::Write;
use std::sync::OnceLock;

use common::{attention_mask, random};
use kpt_core::backend::{Backend, BufferMut, BufferRef, DeviceBuffer};
use kpt_core::graph::{Activation, Op, RopeScaling, TensorSpec};
use kpt_core::rand::SplitMix64;
use kpt_core::tensor::Tensor;
use kpt_core::validate::{
    compare, output_tolerance, reduction_len, reference_outputs, tolerance, ReferenceOps,
};
use kpt_core::DType;
use kpt_kernels::{CpuReference, KernelRegistry};
use kpt_nvidia::{CudaBackend, CudaOptions, NvidiaError};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The most activation rows for which the registry picks `cuda.linear.gemv` (its shape
/// limit in kpt-kernels' catalog, the measured crossover with cuBLASLt); the kernel
/// itself takes up to 32 and is tested by name at every row count.
const GEMV_ROWS: usize = 2;

/// The backend on device 0, or `None` (after saying so) when there is no GPU.
fn backend() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| {
        let required = std::env::var("KPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
        let found = kpt_nvidia::devices().map(|d| d.len()).unwrap_or(0);
        if found == 0 {
            assert!(!required, "KPT_REQUIRE_GPU=1 but no CUDA device is visible");
            // Written to the terminal directly: the test harness captures `eprintln!`.
            let _ = writeln!(
                std::io::stderr(),
                "kpt-nvidia GPU tests SKIPPED: no CUDA device (run them with `cargo xtask gpu-bundle` on a GPU machine)"
            );
            return None;
        }
        // The GEMV kernel on every row count it has a class for, so that its tests reach
        // them all (plans hand it more than 2 rows only through this option).
        let options = CudaOptions {
            gemv_rows: 32,
            ..CudaOptions::default()
        };
        Some(CudaBackend::new(0, options).expect("CUDA backend on device 0"))
    })
    .as_ref()
}

fn registry() -> &'static KernelRegistry {
    static R: OnceLock<KernelRegistry> = OnceLock::new();
    R.get_or_init(KernelRegistry::with_builtin)
}

fn ids(rng: &mut SplitMix64, n: usize, below: usize, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..n)
        .map(|_| (rng.next_u64() % below as u64) as f64)
        .collect();
    Tensor::from_f64(&v, &[n], dtype).unwrap()
}

fn spec(t: &Tensor) -> TensorSpec {
    TensorSpec::new(t.shape(), t.dtype())
}

/// Runs `op` through `kernel` on the GPU and returns the outputs.
fn run_kernel(
    b: &CudaBackend,
    kernel: &str,
    op: &Op,
    inputs: &[Tensor],
) -> kpt_core::Result<Vec<Tensor>> {
    kpt_core::backend::run_op(b, kernel, op, inputs)
}

/// `Op::Linear` on `cuda.linear.gemv` with the weight buffer marked constant, as the
/// executor marks a plan's parameters, right after a kernel that writes the activations
/// (so that a weight load issued before the wait overlaps it).
fn gemv_constant_weights(b: &CudaBackend, op: &Op, inputs: &[Tensor]) -> kpt_core::Result<Tensor> {
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let out_spec = op.infer(&specs)?.remove(0);
    let mut buffers = inputs
        .iter()
        .map(|t| b.upload(t))
        .collect::<kpt_core::Result<Vec<_>>>()?;
    buffers[1].mark_constant();
    // x = x + 0: the GEMV's producer on the stream.
    let zeros = b.upload(&Tensor::zeros(inputs[0].dtype(), inputs[0].shape()))?;
    let mut x = b.allocate(specs[0].dtype, specs[0].numel())?;
    b.execute(
        "cuda.add",
        &Op::Add,
        &[
            BufferRef {
                buffer: &buffers[0],
                spec: &specs[0],
            },
            BufferRef {
                buffer: &zeros,
                spec: &specs[0],
            },
        ],
        &mut [BufferMut {
            buffer: &mut x,
            spec: &specs[0],
        }],
    )?;
    buffers[0] = x;
    let refs: Vec<BufferRef<'_>> = buffers
        .iter()
        .zip(&specs)
        .map(|(buffer, spec)| BufferRef { buffer, spec })
        .collect();
    let mut out = b.allocate(out_spec.dtype, out_spec.numel())?;
    b.execute(
        "cuda.linear.gemv",
        op,
        &refs,
        &mut [BufferMut {
            buffer: &mut out,
            spec: &out_spec,
        }],
    )?;
    b.download(&out, &out_spec)
}

/// Runs `op` with every device kernel (`cuda.*`, `triton.*`) the registry accepts for
/// the GPU, checking each output against the f64 reference; the registry's first
/// choice must be one of them.
fn check(op: &Op, inputs: &[Tensor]) -> Result<(), TestCaseError> {
    let Some(b) = backend() else { return Ok(()) };
    let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
    let on_device = |k: &str| k.starts_with("cuda.") || k.starts_with("triton.");
    let chain = registry().fallback_chain(op, &specs, b.device());
    prop_assert!(
        chain.first().is_some_and(|k| on_device(k)),
        "{op} on {specs:?} chose {chain:?}"
    );
    for kernel in chain.iter().filter(|k| on_device(k)) {
        let got = run_kernel(b, kernel, op, inputs)
            .map_err(|e| TestCaseError::fail(format!("{kernel}: {e}")))?;
        let want = reference_outputs(&CpuReference, op, inputs, &got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let tol = output_tolerance(op, inputs, i, g.dtype());
            let stats = compare(g, w, tol).unwrap();
            prop_assert!(
                stats.within,
                "{kernel} {op} {specs:?} -> {}: {stats:?} vs {tol:?}",
                g.dtype()
            );
        }
    }
    Ok(())
}

/// The cumulative offsets `[0, l0, l0 + l1, ...]` of sequence lengths, as a variable-length
/// batch's `cu_seqlens` input of index dtype `dtype`.
fn cu_seqlens(lens: impl Iterator<Item = usize>, dtype: DType) -> Tensor {
    let v: Vec<f64> = std::iter::once(0.0)
        .chain(lens.scan(0usize, |t, l| {
            *t += l;
            Some(*t as f64)
        }))
        .collect();
    Tensor::from_f64(&v, &[v.len()], dtype).unwrap()
}

/// q, k, v (random in [-2, 2]) and the offsets (`index`) of a variable-length batch of
/// (queries, keys) lengths `seqs`, with `kv_heads` kv heads of `group` query heads each.
fn varlen_inputs(
    seqs: &[(usize, usize)],
    [kv_heads, group, head_dim]: [usize; 3],
    dt: DType,
    index: DType,
    seed: u64,
) -> Vec<Tensor> {
    let mut rng = SplitMix64::new(seed);
    let (tq, tk): (usize, usize) = (
        seqs.iter().map(|s| s.0).sum(),
        seqs.iter().map(|s| s.1).sum(),
    );
    vec![
        random(
            &mut rng,
            &[1, tq, kv_heads * group * head_dim],
            dt,
            -2.0,
            2.0,
        ),
        random(&mut rng, &[1, tk, kv_heads * head_dim], dt, -2.0, 2.0),
        random(&mut rng, &[1, tk, kv_heads * head_dim], dt, -2.0, 2.0),
        cu_seqlens(seqs.iter().map(|s| s.0), index),
        cu_seqlens(seqs.iter().map(|s| s.1), index),
    ]
}

/// Rotary positions below `below`: `[seq]` shared by every sequence, or `[batch, seq]`
/// with `per_token`; i64 when `wide`, else i32.
fn positions(
    rng: &mut SplitMix64,
    (batch, seq, per_token): (usize, usize, bool),
    below: usize,
    wide: bool,
) -> Tensor {
    let dtype = if wide { DType::I64 } else { DType::I32 };
    let shape = if per_token {
        vec![batch, seq]
    } else {
        vec![seq]
    };
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| (rng.next_u64() % below as u64) as f64)
        .collect();
    Tensor::from_f64(&v, &shape, dtype).unwrap()
}

/// Rotary scaling by number: 0 none, 1 linear, 2 dynamic NTK, 3 LLaMA 3, else YaRN.
fn rope_scaling(kind: usize, factor: f64, context: usize) -> Option<RopeScaling> {
    Some(match kind {
        0 => return None,
        1 => RopeScaling::Linear { factor },
        2 => RopeScaling::Dynamic {
            factor,
            max_position_embeddings: context,
        },
        3 => RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: context,
        },
        _ => RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: context,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        },
    })
}

/// Attention `[batch, seq_q, seq_kv, kv_heads, group, head_dim]` (optionally causal and
/// with an additive mask) on every device kernel against the f64 reference.
fn check_attention(
    shape: [usize; 6],
    (causal, window): (bool, Option<usize>),
    with_mask: bool,
    dt: DType,
    seed: u64,
) -> Result<(), TestCaseError> {
    let (op, inputs) = attention_case(shape, (causal, window), with_mask, dt, seed);
    check(&op, &inputs)
}

/// The op and inputs of [`check_attention`].
fn attention_case(
    [batch, seq_q, seq_kv, kv_heads, group, head_dim]: [usize; 6],
    (causal, window): (bool, Option<usize>),
    with_mask: bool,
    dt: DType,
    seed: u64,
) -> (Op, Vec<Tensor>) {
    let mut rng = SplitMix64::new(seed);
    let heads = kv_heads * group;
    let p = kpt_core::graph::AttentionParams {
        mask: with_mask,
        window,
        ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
    };
    let mut inputs = vec![
        random(&mut rng, &[batch, seq_q, heads * head_dim], dt, -2.0, 2.0),
        random(
            &mut rng,
            &[batch, seq_kv, kv_heads * head_dim],
            dt,
            -2.0,
            2.0,
        ),
        random(
            &mut rng,
            &[batch, seq_kv, kv_heads * head_dim],
            dt,
            -2.0,
            2.0,
        ),
    ];
    if with_mask {
        inputs.push(attention_mask(&mut rng, seq_q, seq_kv));
    }
    (Op::Attention(p), inputs)
}

/// FP8 e4m3 attention (bf16 output) on every device kernel against the f64 reference of
/// the same dequantized inputs. The kernels round the probabilities to e4m3 (3 mantissa
/// bits: at most 1/16 relative error each), so an output may be off by up to 1/16 of the
/// largest |v|, plus bf16 rounding; with a large softmax scale the attention is nearly
/// one-hot, so keys taken in the wrong order would miss by about |v|.
fn check_attention_fp8(
    [batch, seq_q, seq_kv, kv_heads, group, head_dim]: [usize; 6],
    (causal, with_mask, scale): (bool, bool, Option<f32>),
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut rng = SplitMix64::new(seed);
    let heads = kv_heads * group;
    let p = kpt_core::graph::AttentionParams {
        mask: with_mask,
        scale,
        ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
    };
    let fp8 = DType::F8E4M3;
    let kv_shape = [batch, seq_kv, kv_heads * head_dim];
    let mut inputs = vec![
        random(&mut rng, &[batch, seq_q, heads * head_dim], fp8, -2.0, 2.0),
        random(&mut rng, &kv_shape, fp8, -2.0, 2.0),
        random(&mut rng, &kv_shape, fp8, -2.0, 2.0),
    ];
    if with_mask {
        let m: Vec<f64> = (0..seq_q * seq_kv).map(|_| -2.0 * rng.next_f64()).collect();
        inputs.push(Tensor::from_f64(&m, &[seq_q, seq_kv], DType::F32).unwrap());
    }
    check_fp8_inputs(&Op::Attention(p), &inputs)
}

/// The FP8 attention `op` on `inputs` ([`check_attention_fp8`]'s bounds).
fn check_fp8_inputs(op: &Op, inputs: &[Tensor]) -> Result<(), TestCaseError> {
    let Some(b) = backend() else { return Ok(()) };
    let Op::Attention(p) = op else {
        return Err(TestCaseError::fail(format!("{op} is not an attention op")));
    };
    let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
    let chain = registry().fallback_chain(op, &specs, b.device());
    let hopper = b.device().arch.as_deref() == Some("sm_90");
    if hopper && p.head_dim == 128 {
        prop_assert_eq!(
            chain.first().map(String::as_str),
            Some("cuda.attention.fp8_sm90")
        );
    }
    let want = CpuReference.eval(op, inputs).unwrap()[0].to_f64_vec();
    let vmax = inputs[2]
        .to_f64_vec()
        .iter()
        .fold(0f64, |m, x| m.max(x.abs()));
    for kernel in chain.iter().filter(|k| k.starts_with("cuda.")) {
        let got = run_kernel(b, kernel, op, inputs)
            .map_err(|e| TestCaseError::fail(format!("{kernel}: {e}")))?;
        prop_assert_eq!(got[0].dtype(), DType::BF16);
        let got = got[0].to_f64_vec();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let bound = vmax / 15.0 + w.abs() / 128.0;
            prop_assert!(
                (g - w).abs() <= bound,
                "{kernel} {op} {specs:?}: element {i} is {g}, reference {w} (bound {bound})"
            );
        }
    }
    Ok(())
}

/// An attention-gradient op for `[batch, seq_q, seq_kv, kv_heads, group, head_dim]`
/// (optionally causal, windowed and with an additive mask) and random inputs: q, k, v,
/// `out`, `dout` [, mask].
fn attention_backward_inputs(
    shape: [usize; 6],
    (causal, window): (bool, Option<usize>),
    with_mask: bool,
    dt: DType,
    seed: u64,
) -> (Op, Vec<Tensor>) {
    attention_backward_inputs_lse(shape, (causal, window), (with_mask, false), dt, seed)
}

/// [`attention_backward_inputs`], with the forward's log-sum-exp (f32, from the f64
/// reference forward of q, k, v and the mask) as the last input when `with_lse`.
fn attention_backward_inputs_lse(
    [batch, seq_q, seq_kv, kv_heads, group, head_dim]: [usize; 6],
    (causal, window): (bool, Option<usize>),
    (with_mask, with_lse): (bool, bool),
    dt: DType,
    seed: u64,
) -> (Op, Vec<Tensor>) {
    let mut rng = SplitMix64::new(seed);
    let heads = kv_heads * group;
    let p = kpt_core::graph::AttentionParams {
        mask: with_mask,
        window,
        lse: with_lse,
        ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
    };
    let (q_shape, kv_shape) = (
        [batch, seq_q, heads * head_dim],
        [batch, seq_kv, kv_heads * head_dim],
    );
    let mut inputs = vec![
        random(&mut rng, &q_shape, dt, -2.0, 2.0),
        random(&mut rng, &kv_shape, dt, -2.0, 2.0),
        random(&mut rng, &kv_shape, dt, -2.0, 2.0),
        random(&mut rng, &q_shape, dt, -1.0, 1.0),
        random(&mut rng, &q_shape, dt, -1.0, 1.0),
    ];
    if with_mask {
        inputs.push(attention_mask(&mut rng, seq_q, seq_kv));
    }
    if with_lse {
        let mut forward = inputs[..3].to_vec();
        forward.extend(inputs.get(5).cloned());
        let lse = CpuReference.eval(&Op::Attention(p), &forward).unwrap()[1].to_f64_vec();
        inputs.push(Tensor::from_f64(&lse, &p.lse_shape(inputs[0].shape()), DType::F32).unwrap());
    }
    (Op::AttentionBackward(p), inputs)
}

/// Inputs of paged attention: q `[B, seq_q, heads * d]`, K and V caches `[num_blocks,
/// block_size, kv_heads * d]` with each sequence's blocks scattered over the cache
/// (seeded shuffle), the block table `[B, max_blocks]` (`spare` more columns than the
/// longest sequence needs; every entry past a sequence's blocks holds garbage: negative
/// ids, ids past the cache, ids of other sequences' blocks) and `seq_lens` `[B]`, with
/// the table's and the lengths' index dtypes.
#[allow(clippy::too_many_arguments)]
fn paged_inputs(
    rng: &mut SplitMix64,
    lens: &[usize],
    spare: usize,
    block_size: usize,
    [seq_q, kv_heads, group, head_dim]: [usize; 4],
    dt: DType,
    (table_dt, lens_dt): (DType, DType),
) -> Vec<Tensor> {
    let heads = kv_heads * group;
    let max_blocks = (lens.iter().max().unwrap().div_ceil(block_size) + spare).max(1);
    let used: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum();
    let num_blocks = used + 3;
    let mut ids: Vec<usize> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut next = ids.into_iter();
    let big = if table_dt == DType::I64 { 1e12 } else { 2e9 };
    let garbage = [
        -1.0,
        -1000.0,
        num_blocks as f64,
        num_blocks as f64 + 7.0,
        big,
        0.0,
    ];
    let mut table = Vec::with_capacity(lens.len() * max_blocks);
    for &len in lens {
        let n = len.div_ceil(block_size);
        for i in 0..max_blocks {
            table.push(match i < n {
                true => next.next().unwrap() as f64,
                false => garbage[(rng.next_u64() % garbage.len() as u64) as usize],
            });
        }
    }
    let row = kv_heads * head_dim;
    let lens_f: Vec<f64> = lens.iter().map(|&l| l as f64).collect();
    vec![
        random(rng, &[lens.len(), seq_q, heads * head_dim], dt, -2.0, 2.0),
        random(rng, &[num_blocks, block_size, row], dt, -2.0, 2.0),
        random(rng, &[num_blocks, block_size, row], dt, -2.0, 2.0),
        Tensor::from_f64(&table, &[lens.len(), max_blocks], table_dt).unwrap(),
        Tensor::from_f64(&lens_f, &[lens.len()], lens_dt).unwrap(),
    ]
}

fn index_dtype(wide: bool) -> DType {
    if wide {
        DType::I64
    } else {
        DType::I32
    }
}

/// A cache write of `n` rows into a cache `[blocks, block_size, row]`: distinct random
/// slots, `negative` of them negative (skipped), as i32 or i64.
fn cache_write_inputs(
    rng: &mut SplitMix64,
    [blocks, block_size, row]: [usize; 3],
    n: usize,
    negative: usize,
    dt: DType,
    slots_dt: DType,
) -> Vec<Tensor> {
    let cache_rows = blocks * block_size;
    let n = n.min(cache_rows);
    let mut slots: Vec<f64> = (0..cache_rows).map(|s| s as f64).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    slots.truncate(n);
    for s in slots.iter_mut().take(negative) {
        *s = -1.0 - (rng.next_u64() % 5) as f64;
    }
    vec![
        random(rng, &[blocks, block_size, row], dt, -4.0, 4.0),
        random(rng, &[n, row], dt, -4.0, 4.0),
        Tensor::from_f64(&slots, &[n], slots_dt).unwrap(),
    ]
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(FLOATS.to_vec())
}

fn act() -> impl Strategy<Value = Activation> {
    prop::sample::select(Activation::ALL.to_vec())
}

/// Row lengths: tiny, odd, at and past the CUDA register path's limit (8192 bf16, 4096
/// f32), and multiples of 16 at and between the Triton row blocks (1024..8192).
fn dim() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![
        1, 3, 7, 8, 16, 64, 100, 255, 1024, 1040, 2048, 3008, 4096, 4100, 8192, 9000,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn norms_and_softmax(rows in 1usize..24, dim in dim(), dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[rows, dim], dt, -3.0, 3.0);
        let r = random(&mut rng, &[rows, dim], dt, -3.0, 3.0);
        let w = random(&mut rng, &[dim], dt, 0.5, 1.5);
        let bias = random(&mut rng, &[dim], dt, -1.0, 1.0);
        check(&Op::RmsNorm { eps: 1e-5 }, &[x.clone(), w.clone()])?;
        check(&Op::AddRmsNorm { eps: 1e-5 }, &[x.clone(), r.clone(), w.clone()])?;
        check(&Op::LayerNorm { eps: 1e-5 }, &[x.clone(), w.clone(), bias.clone()])?;
        check(&Op::AddLayerNorm { eps: 1e-5 }, &[x.clone(), r, w, bias])?;
        check(&Op::Softmax, std::slice::from_ref(&x))?;
        check(&Op::ArgMax, &[x])?;
    }

    /// Argmax over vocabulary-sized rows with few distinct values (ties), -inf rows and
    /// now and then a NaN (-> -1).
    #[test]
    fn argmax(rows in 1usize..40, dim in prop::sample::select(vec![1usize, 5, 511, 513, 32000]),
              dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let v: Vec<f64> = (0..rows * dim)
            .map(|_| match rng.next_u64() % 4096 {
                0 => f64::NAN,
                1..=8 => f64::NEG_INFINITY,
                r => (r % 9) as f64 - 4.0,
            })
            .collect();
        let mut x = Tensor::from_f64(&v, &[rows, dim], dt).unwrap();
        if rows > 1 {
            // One row of only -inf: its first index.
            let mut w = v.clone();
            w[dim..2 * dim].fill(f64::NEG_INFINITY);
            x = Tensor::from_f64(&w, &[rows, dim], dt).unwrap();
        }
        check(&Op::ArgMax, &[x])?;
    }

    #[test]
    fn elementwise(rows in 1usize..20, cols in 1usize..300, dt in dtype(), a in act(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[rows, cols], dt, -4.0, 4.0);
        let y = random(&mut rng, &[cols], dt, -2.0, 2.0);
        check(&Op::Activation { act: a }, std::slice::from_ref(&x))?;
        check(&Op::Add, &[x.clone(), y.clone()])?;
        check(&Op::Mul, &[x.clone(), y])?;
        for to in FLOATS {
            if to != dt {
                check(&Op::Cast { dtype: to }, std::slice::from_ref(&x))?;
            }
        }
    }

    #[test]
    fn rotary(batch in 1usize..4, seq in 1usize..24, heads in 1usize..5,
              head_dim in prop::sample::select(vec![2usize, 6, 16, 64, 128]),
              dt in dtype(), wide in any::<bool>(), per_token in any::<bool>(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[batch, seq, heads * head_dim], dt, -2.0, 2.0);
        let pos = positions(&mut rng, (batch, seq, per_token), 4096, wide);
        check(&Op::Rotary { head_dim, theta: 10_000.0, scaling: None }, &[x, pos])?;
    }

    /// The fused split + rotary: odd v widths (the scalar path), 16-byte multiples (the
    /// vector path), q or v empty, shared and per-token positions, every scaling.
    #[test]
    fn split_rotary(batch in 1usize..4, seq in 1usize..20, q_heads in 0usize..5,
                    k_heads in 1usize..3, v in prop::sample::select(vec![0usize, 1, 7, 8, 64, 72, 130]),
                    head_dim in prop::sample::select(vec![2usize, 6, 16, 64, 128]),
                    kind in 0usize..5, dt in dtype(), wide in any::<bool>(),
                    per_token in any::<bool>(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let sizes = vec![q_heads * head_dim, k_heads * head_dim, v];
        let width: usize = sizes.iter().sum();
        let x = random(&mut rng, &[batch, seq, width], dt, -2.0, 2.0);
        let pos = positions(&mut rng, (batch, seq, per_token), 16_384, wide);
        // Dynamic NTK needs head_dim > 2.
        let kind = if head_dim == 2 && kind == 2 { 0 } else { kind };
        let scaling = rope_scaling(kind, 4.0, 1024);
        check(&Op::SplitRotary { head_dim, theta: 500_000.0, scaling, sizes, cache: false }, &[x, pos])?;
    }

    /// The split + rotary that writes k and v into caches (one launch) against the
    /// plain split + rotary and two `cuda.cache_write`s, bit for bit: tokens of a decode
    /// batch or a prompt, slots negative (skipped) or not, i32 or i64 slots, the scalar
    /// and the vector path, and against the f64 reference.
    #[test]
    fn split_rotary_into_caches(tokens in 1usize..12, q_heads in 0usize..5, k_heads in 1usize..3,
                                head_dim in prop::sample::select(vec![2usize, 6, 16, 64, 128]),
                                spare in 0usize..9, negative in 0usize..3, dt in dtype(),
                                wide in any::<bool>(), seed: u64) {
        let Some(b) = backend() else { return Ok(()) };
        let mut rng = SplitMix64::new(seed);
        let (wq, wk) = (q_heads * head_dim, k_heads * head_dim);
        let x = random(&mut rng, &[1, tokens, wq + 2 * wk], dt, -2.0, 2.0);
        let pos = positions(&mut rng, (1, tokens, false), 16_384, wide);
        let slots_dt = if wide { DType::I64 } else { DType::I32 };
        let caches = [
            cache_write_inputs(&mut rng, [1, tokens + spare, wk], tokens, negative, dt, slots_dt),
            cache_write_inputs(&mut rng, [1, tokens + spare, wk], tokens, negative, dt, slots_dt),
        ];
        let slots = caches[0][2].clone();
        let plain = Op::SplitRotary { head_dim, theta: 500_000.0, scaling: None, sizes: vec![wq, wk, wk], cache: false };
        let fused = plain.split_rotary_with_cache(true).unwrap();
        let inputs = [x.clone(), pos.clone(), caches[0][0].clone(), caches[1][0].clone(), slots.clone()];
        let got = run_kernel(b, "cuda.split_rotary", &fused, &inputs).unwrap();
        let parts = run_kernel(b, "cuda.split_rotary", &plain, &[x, pos]).unwrap();
        prop_assert_eq!(got[0].to_f64_vec(), parts[0].to_f64_vec(), "q");
        for (i, cache) in caches.iter().enumerate() {
            let want = run_kernel(
                b,
                "cuda.cache_write",
                &Op::CacheWrite,
                &[cache[0].clone(), parts[i + 1].clone(), slots.clone()],
            )
            .unwrap();
            prop_assert_eq!(got[i + 1].to_f64_vec(), want[0].to_f64_vec(), "cache {}", i);
        }
        check(&fused, &inputs)?;
    }

    /// Scaled rotary: the inverse-frequency table of every scaling type, uploaded once
    /// (dynamic NTK: per call, from the positions read back) against the f64 reference.
    #[test]
    fn scaled_rotary(batch in 1usize..3, seq in 1usize..24, heads in 1usize..5,
                     head_dim in prop::sample::select(vec![6usize, 16, 64, 128]),
                     theta in prop::sample::select(vec![10_000f32, 500_000.0]),
                     kind in 0usize..4, factor in prop::sample::select(vec![2.0f64, 8.0]),
                     context in prop::sample::select(vec![16usize, 1024, 8192]),
                     dt in dtype(), wide in any::<bool>(), per_token in any::<bool>(),
                     seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[batch, seq, heads * head_dim], dt, -2.0, 2.0);
        let pos = positions(&mut rng, (batch, seq, per_token), 16_384, wide);
        let scaling = rope_scaling(kind + 1, factor, context);
        check(&Op::Rotary { head_dim, theta, scaling }, &[x, pos])?;
    }

    #[test]
    fn attention(batch in 1usize..3, seq_q in 1usize..40, seq_kv in 1usize..70,
                 kv_heads in 1usize..3, group in 1usize..4,
                 head_dim in prop::sample::select(vec![1usize, 8, 33, 64, 128, 192, 256]),
                 causal in any::<bool>(), window in prop::option::of(1usize..50),
                 with_mask in any::<bool>(), dt in dtype(), seed: u64) {
        check_attention([batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, window), with_mask, dt, seed)?;
    }

    /// Prefill-shaped calls over several query and key tiles (64 each), partial tiles,
    /// caches shorter and longer than the query: the tensor-core kernels for bf16/f16
    /// at head dims 64 to 256 (the wgmma kernels at 64 and 128 on Hopper, the mma.sync
    /// one with Q in shared memory at 192 and 256).
    #[test]
    fn attention_prefill(batch in 1usize..3, seq_q in 17usize..200, seq_kv in 1usize..260,
                         kv_heads in 1usize..3, group in 1usize..=4,
                         head_dim in prop::sample::select(vec![64usize, 128, 192, 256]),
                         causal in any::<bool>(), window in prop::option::of(1usize..150),
                         with_mask in any::<bool>(),
                         dt in prop::sample::select(vec![DType::BF16, DType::F16]), seed: u64) {
        check_attention([batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, window), with_mask, dt, seed)?;
    }

    /// Prefill-shaped calls on a persistent grid of 1 to 8 blocks, so that every block walks
    /// several query tiles (paired ones under a causal mask): the Hopper kernel carries
    /// its K/V ring and Q buffer across tiles (see `attention_persistent_grid`), sliding
    /// windows starting each tile's keys past 0 (the `_tma_window_` entries).
    #[test]
    fn attention_prefill_persistent(batch in 1usize..4, seq_q in 1usize..450, seq_kv in 1usize..400,
                                    kv_heads in 1usize..3, group in 1usize..=4,
                                    head_dim in prop::sample::select(vec![64usize, 128]),
                                    causal in any::<bool>(), with_mask in any::<bool>(),
                                    window in prop::option::of(1usize..300),
                                    dt in prop::sample::select(vec![DType::BF16, DType::F16]),
                                    blocks in 1usize..=8, seed: u64) {
        let Some(b) = backend() else { return Ok(()) };
        b.gpu().set_attention_blocks(Some(blocks));
        let result = check_attention([batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, window), with_mask, dt, seed);
        b.gpu().set_attention_blocks(None);
        result?;
    }

    /// FP8 e4m3 inputs: the Hopper FP8 kernel at head dim 128 (prefill shapes, partial
    /// tiles, caches shorter and longer than the query), and the dequantize-to-bf16 path
    /// for decode shapes and head dim 64.
    #[test]
    fn attention_fp8(batch in 1usize..3, seq_q in 1usize..300, seq_kv in 1usize..400,
                     kv_heads in 1usize..3, group in 1usize..=4,
                     head_dim in prop::sample::select(vec![64usize, 128, 128]),
                     causal in any::<bool>(), with_mask in any::<bool>(),
                     scale in prop::option::of(0.05f32..1.0), seed: u64) {
        check_attention_fp8([batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, with_mask, scale), seed)?;
    }

    /// Dropout (training) on the tensor-core kernels, forward and backward, against the
    /// reference's decisions (the same Philox words on both sides).
    #[test]
    fn attention_dropout(batch in 1usize..=2, seq_q in 1usize..150, seq_kv in 1usize..200,
                         kv_heads in 1usize..=2, group in prop::sample::select(vec![1usize, 2, 4]),
                         head_dim in prop::sample::select(vec![64usize, 128]),
                         causal in any::<bool>(), with_mask in any::<bool>(),
                         p in 0.0f32..0.6, dropout_seed: u64,
                         blocks in prop::option::of(1usize..=4), with_lse in any::<bool>(),
                         dt in prop::sample::select(vec![DType::BF16, DType::F16]), seed: u64) {
        let Some(b) = backend() else { return Ok(()) };
        let shape = [batch, seq_q, seq_kv, kv_heads, group, head_dim];
        let dropout = Some(kpt_core::graph::AttentionDropout { p, seed: dropout_seed });
        let with_dropout = |op: Op| match op {
            Op::Attention(a) => Op::Attention(kpt_core::graph::AttentionParams { dropout, ..a }),
            Op::AttentionBackward(a) => {
                Op::AttentionBackward(kpt_core::graph::AttentionParams { dropout, ..a })
            }
            other => other,
        };
        // Some cases on a persistent grid of 1 to 4 blocks (each walks several work tiles).
        b.gpu().set_attention_blocks(blocks);
        let (op, inputs) = attention_case(shape, (causal, None), with_mask, dt, seed);
        let forward = check(&with_dropout(op), &inputs);
        b.gpu().set_attention_blocks(None);
        forward?;
        // The backward on the wgmma kernels (on Hopper; dq there only with the forward's
        // log-sum-exp), then on the mma.sync ones.
        let (op, inputs) =
            attention_backward_inputs_lse(shape, (causal, None), (with_mask, with_lse), dt, seed);
        let op = with_dropout(op);
        check(&op, &inputs)?;
        b.gpu().set_wgmma_backward(false);
        let sync = check(&op, &inputs);
        b.gpu().set_wgmma_backward(true);
        sync?;
    }

    /// Dropout at head dims 192 and 256 (the mma.sync forward with Q in shared memory, and
    /// the backward's blocks per half of the head dim).
    #[test]
    fn attention_dropout_wide_heads(seq_q in 1usize..150, seq_kv in 1usize..200,
                                    group in prop::sample::select(vec![1usize, 2]),
                                    head_dim in prop::sample::select(vec![192usize, 256]),
                                    causal in any::<bool>(), with_mask in any::<bool>(),
                                    p in 0.0f32..0.6, dropout_seed: u64,
                                    dt in prop::sample::select(vec![DType::BF16, DType::F16]),
                                    seed: u64) {
        let (op, inputs) =
            attention_case([1, seq_q, seq_kv, 1, group, head_dim], (causal, None), with_mask, dt, seed);
        let Op::Attention(a) = op else { unreachable!("an attention case") };
        let dropout = Some(kpt_core::graph::AttentionDropout { p, seed: dropout_seed });
        check(&Op::Attention(kpt_core::graph::AttentionParams { dropout, ..a }), &inputs)?;
        // The gradients (a block per half of the head dim).
        let (op, inputs) = attention_backward_inputs(
            [1, seq_q, seq_kv, 1, group, head_dim], (causal, None), with_mask, dt, seed);
        let Op::AttentionBackward(a) = op else { unreachable!("a backward case") };
        check(&Op::AttentionBackward(kpt_core::graph::AttentionParams { dropout, ..a }), &inputs)?;
    }

    /// FP8 at head dim 128 on a persistent grid of 1 to 8 blocks: every block walks several
    /// work tiles, so the producer's V transpose and the consumers' carried ping-pong run
    /// across them.
    #[test]
    fn attention_fp8_persistent(batch in 1usize..3, seq_q in 1usize..450, seq_kv in 1usize..500,
                                kv_heads in 1usize..3, group in 1usize..=4,
                                causal in any::<bool>(), with_mask in any::<bool>(),
                                blocks in 1usize..=8, seed: u64) {
        let Some(b) = backend() else { return Ok(()) };
        b.gpu().set_attention_blocks(Some(blocks));
        let result = check_attention_fp8([batch, seq_q, seq_kv, kv_heads, group, 128], (causal, with_mask, None), seed);
        b.gpu().set_attention_blocks(None);
        result?;
    }

    /// Variable-length batches: prefill and decode sequences (and empty ones) packed into
    /// one call, one launch per sequence on every dense kernel.
    #[test]
    fn attention_varlen(seqs in prop::collection::vec((0usize..90, 0usize..150), 1..5),
                        kv_heads in 1usize..3, group in 1usize..=4,
                        head_dim in prop::sample::select(vec![8usize, 64, 128]),
                        causal in any::<bool>(), window in prop::option::of(1usize..100),
                        dt in dtype(), seed: u64) {
        let p = kpt_core::graph::AttentionParams {
            varlen: true,
            window,
            ..kpt_core::graph::AttentionParams::new(kv_heads * group, kv_heads, head_dim, causal)
        };
        let inputs = varlen_inputs(&seqs, [kv_heads, group, head_dim], dt, DType::I32, seed);
        if inputs[0].shape()[1] > 0 {
            check(&Op::Attention(p), &inputs)?;
        }
    }

    /// Variable-length batches of longer sequences (lengths 1, around and at the 128- and
    /// 192-row tiles, empty ones), i32 and i64 offsets: on Hopper one launch that reads the
    /// offsets on the device (some cases on a persistent grid of 1 to 6 blocks, each
    /// walking work tiles of several sequences), and every other dense kernel of the chain.
    #[test]
    fn attention_varlen_one_launch(
        seqs in prop::collection::vec(
            (prop_oneof![0usize..300, Just(1usize), Just(128), Just(192)],
             prop_oneof![0usize..400, Just(1usize), Just(128)]), 1..7),
        kv_heads in 1usize..=2, group in prop::sample::select(vec![1usize, 2, 4]),
        head_dim in prop::sample::select(vec![64usize, 128]), causal in any::<bool>(),
        dt in prop::sample::select(vec![DType::BF16, DType::F16]), wide in any::<bool>(),
        blocks in prop_oneof![Just(None), (1usize..=6).prop_map(Some)], seed: u64,
    ) {
        let p = kpt_core::graph::AttentionParams {
            varlen: true,
            ..kpt_core::graph::AttentionParams::new(kv_heads * group, kv_heads, head_dim, causal)
        };
        let index = if wide { DType::I64 } else { DType::I32 };
        let inputs = varlen_inputs(&seqs, [kv_heads, group, head_dim], dt, index, seed);
        if inputs[0].shape()[1] > 0 {
            let Some(b) = backend() else { return Ok(()) };
            b.gpu().set_attention_blocks(blocks);
            let result = check(&Op::Attention(p), &inputs);
            b.gpu().set_attention_blocks(None);
            result?;
        }
    }

    /// Paged KV caches: each sequence's blocks scattered over the cache (seeded shuffle),
    /// gathered on the device, then every dense kernel.
    #[test]
    fn attention_paged(lens in prop::collection::vec(0usize..300, 1..4),
                       block_size in prop::sample::select(vec![1usize, 16, 32]),
                       seq_q in 1usize..=8, kv_heads in 1usize..3, group in 1usize..=4,
                       head_dim in prop::sample::select(vec![8usize, 64, 128]),
                       causal in any::<bool>(), wide in any::<bool>(), dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let heads = kv_heads * group;
        let p = kpt_core::graph::AttentionParams {
            paged: true,
            ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let max_blocks = lens.iter().max().unwrap().div_ceil(block_size).max(1);
        let num_blocks = lens.len() * max_blocks + 2;
        let mut ids: Vec<usize> = (0..num_blocks).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, (rng.next_f64() * (i + 1) as f64) as usize % (i + 1));
        }
        let table: Vec<f64> = ids[..lens.len() * max_blocks].iter().map(|&b| b as f64).collect();
        let index = if wide { DType::I64 } else { DType::I32 };
        let row = kv_heads * head_dim;
        let inputs = [
            random(&mut rng, &[lens.len(), seq_q, heads * head_dim], dt, -2.0, 2.0),
            random(&mut rng, &[num_blocks, block_size, row], dt, -2.0, 2.0),
            random(&mut rng, &[num_blocks, block_size, row], dt, -2.0, 2.0),
            Tensor::from_f64(&table, &[lens.len(), max_blocks], index).unwrap(),
            Tensor::from_f64(&lens.iter().map(|&l| l as f64).collect::<Vec<_>>(), &[lens.len()], index)
                .unwrap(),
        ];
        check(&Op::Attention(p), &inputs)?;
    }

    /// Paged decode (the kv group's query rows fit the split-KV kernels): K and V read
    /// through the block table and each length taken from device memory, no host
    /// readback. Block sizes of 1, below, above and not a multiple of the key tile (64
    /// keys at head dim 64, 32 at 128), lengths of 0, 1, odd and off the tile, different
    /// per sequence, spare table columns (splits past every length) full of garbage ids,
    /// i32 and i64 tables and lengths mixed; 33 to 64 query rows a kv group on the wide
    /// entries. f32 with 32 query rows of head dim 128 (more than the f32 kernel's shared
    /// memory) or more than 32 rows takes the gather path.
    #[test]
    fn attention_paged_decode(lens in prop::collection::vec(
                                  prop_oneof![Just(1usize), 0usize..70, 1usize..700], 1..=3),
                              spare in 0usize..3,
                              block_size in prop::sample::select(vec![1usize, 5, 16, 24, 48, 64, 100]),
                              seq_q in 1usize..=8, kv_heads in 1usize..=2,
                              group in prop::sample::select(vec![1usize, 4, 8]),
                              head_dim in prop::sample::select(vec![64usize, 128]),
                              causal in any::<bool>(), wide in any::<(bool, bool)>(),
                              dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let heads = kv_heads * group;
        let p = kpt_core::graph::AttentionParams {
            paged: true,
            ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let inputs = paged_inputs(
            &mut rng,
            &lens,
            spare,
            block_size,
            [seq_q, kv_heads, group, head_dim],
            dt,
            (index_dtype(wide.0), index_dtype(wide.1)),
        );
        check(&Op::Attention(p), &inputs)?;
    }

    /// `Op::CacheWrite` on `cuda.cache_write` (through `execute`, a copy of the cache,
    /// and in place through `write_rows`) against the reference, bit for bit: rows of
    /// 1 to 1000 elements (2 to 4000 bytes: 16-byte units, 4-byte and 2-byte ones),
    /// negative slots skipped, i32 and i64 slots.
    #[test]
    fn cache_write(blocks in 1usize..6, block_size in prop::sample::select(vec![1usize, 3, 16]),
                   row in prop::sample::select(vec![1usize, 3, 5, 6, 8, 12, 24, 100, 128, 1000]),
                   n in 1usize..24, negative in 0usize..4, wide in any::<bool>(),
                   dt in dtype(), seed: u64) {
        let Some(b) = backend() else { return Ok(()) };
        let mut rng = SplitMix64::new(seed);
        let inputs = cache_write_inputs(
            &mut rng, [blocks, block_size, row], n, negative, dt, index_dtype(wide));
        let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
        let chain = registry().fallback_chain(&Op::CacheWrite, &specs, b.device());
        prop_assert_eq!(chain.first().map(String::as_str), Some("cuda.cache_write"));
        let want = CpuReference.eval(&Op::CacheWrite, &inputs).unwrap()[0].to_f64_vec();
        let got = run_kernel(b, "cuda.cache_write", &Op::CacheWrite, &inputs)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(got[0].dtype(), dt);
        prop_assert!(got[0].to_f64_vec() == want, "execute: {specs:?}");
        let in_place = write_rows_in_place(b, &inputs)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(in_place.to_f64_vec() == want, "write_rows: {specs:?}");
    }

    /// Decode-shaped calls against caches of several tiles: the split-KV kernels (33 to
    /// 64 query rows a kv group on the wide entries, e.g. 16 queries at group 4).
    #[test]
    fn attention_long_cache(batch in 1usize..3, seq_q in 1usize..=16, seq_kv in 65usize..1500,
                            kv_heads in 1usize..3, group in 1usize..=4,
                            head_dim in prop::sample::select(vec![8usize, 64, 80, 128, 256]),
                            causal in any::<bool>(), with_mask in any::<bool>(), dt in dtype(),
                            window in prop::option::of(prop::option::of(1usize..600)), seed: u64) {
        // Mostly without a window (the split-KV kernels), sometimes with one.
        let window = window.flatten();
        check_attention([batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, window), with_mask, dt, seed)?;
    }

    /// Split-KV attention over a short cache, its runs merged inside thread-block
    /// clusters (sm_90), against the same runs merged by the combine launch, bit for bit:
    /// at most 8 tiles of keys, where both plans give each run one tile. Longer caches
    /// (two tiles a run in a cluster) are checked against the reference by
    /// `attention_long_cache` and `attention_paged_decode`.
    #[test]
    fn attention_cluster_merge_matches_combine(batch in 1usize..3, seq_q in 1usize..=2,
                                               kv_heads in 1usize..3,
                                               group in prop::sample::select(vec![1usize, 4, 8]),
                                               head_dim in prop::sample::select(vec![64usize, 128]),
                                               keys in 65usize..=256, causal in any::<bool>(),
                                               with_mask in any::<bool>(),
                                               dt in prop::sample::select(vec![DType::BF16, DType::F16]),
                                               seed: u64) {
        let Some(b) = backend() else { return Ok(()) };
        if !b.gpu().cluster_attention() {
            return Ok(());
        }
        let mut rng = SplitMix64::new(seed);
        let heads = kv_heads * group;
        let p = kpt_core::graph::AttentionParams {
            mask: with_mask,
            ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let mut inputs = vec![
            random(&mut rng, &[batch, seq_q, heads * head_dim], dt, -2.0, 2.0),
            random(&mut rng, &[batch, keys, kv_heads * head_dim], dt, -2.0, 2.0),
            random(&mut rng, &[batch, keys, kv_heads * head_dim], dt, -2.0, 2.0),
        ];
        if with_mask {
            inputs.push(random(&mut rng, &[seq_q, keys], DType::F32, -1.0, 1.0));
        }
        let op = Op::Attention(p);
        let clustered = run_kernel(b, "cuda.attention", &op, &inputs);
        b.gpu().set_cluster_attention(false);
        let combined = run_kernel(b, "cuda.attention", &op, &inputs);
        b.gpu().set_cluster_attention(true);
        let (clustered, combined) = (clustered.unwrap(), combined.unwrap());
        prop_assert!(clustered[0].to_f64_vec() == combined[0].to_f64_vec());
    }

    /// Attention gradients on the tensor-core backward: odd lengths (1, not multiples of
    /// the 64-row tiles), caches shorter and longer than the query (rows that see no key
    /// under the causal mask), GQA groups of 1, 2 and 4, sliding windows (the mma.sync
    /// kernels on every GPU) with tiles inside and across a window's start.
    #[test]
    fn attention_backward(batch in 1usize..=3,
                          seq_q in prop_oneof![Just(1usize), 1usize..150],
                          seq_kv in prop_oneof![Just(1usize), 1usize..200],
                          kv_heads in 1usize..=2, group in prop::sample::select(vec![1usize, 2, 4]),
                          head_dim in prop::sample::select(vec![64usize, 128, 192, 256]),
                          causal in any::<bool>(), with_mask in any::<bool>(),
                          window in prop::option::of(1usize..150),
                          dt in prop::sample::select(vec![DType::BF16, DType::F16]), seed: u64) {
        let (op, inputs) = attention_backward_inputs(
            [batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, window), with_mask, dt, seed);
        check(&op, &inputs)?;
    }

    /// Gradients of variable-length batches (prefill and decode sequences, and ones
    /// without queries or keys, packed into one call): one dense backward per sequence,
    /// with dropout's decisions of batch entry s for sequence s.
    #[test]
    fn attention_varlen_backward(seqs in prop::collection::vec((0usize..90, 0usize..150), 1..5),
                                 kv_heads in 1usize..=2,
                                 group in prop::sample::select(vec![1usize, 2, 4]),
                                 head_dim in prop::sample::select(vec![64usize, 128]),
                                 causal in any::<bool>(), dropout in any::<bool>(),
                                 dt in prop::sample::select(vec![DType::BF16, DType::F16]),
                                 seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let heads = kv_heads * group;
        let p = kpt_core::graph::AttentionParams {
            varlen: true,
            dropout: dropout.then_some(kpt_core::graph::AttentionDropout { p: 0.1, seed: 7 }),
            ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let cu = |f: fn(&(usize, usize)) -> usize| cu_seqlens(seqs.iter().map(f), DType::I64);
        let (tq, tk): (usize, usize) = (seqs.iter().map(|s| s.0).sum(), seqs.iter().map(|s| s.1).sum());
        let (q_shape, kv_shape) = ([1, tq, heads * head_dim], [1, tk, kv_heads * head_dim]);
        let inputs = [
            random(&mut rng, &q_shape, dt, -2.0, 2.0),
            random(&mut rng, &kv_shape, dt, -2.0, 2.0),
            random(&mut rng, &kv_shape, dt, -2.0, 2.0),
            random(&mut rng, &q_shape, dt, -1.0, 1.0),
            random(&mut rng, &q_shape, dt, -1.0, 1.0),
            cu(|s| s.0),
            cu(|s| s.1),
        ];
        if tq > 0 && tk > 0 {
            check(&Op::AttentionBackward(p), &inputs)?;
        }
    }

    /// The backward pass given the forward's log-sum-exp (the probabilities come from it,
    /// no online softmax): the same shapes as `attention_backward`.
    #[test]
    fn attention_backward_lse(batch in 1usize..=3,
                              seq_q in prop_oneof![Just(1usize), 1usize..150],
                              seq_kv in prop_oneof![Just(1usize), 1usize..200],
                              kv_heads in 1usize..=2, group in prop::sample::select(vec![1usize, 2, 4]),
                              head_dim in prop::sample::select(vec![64usize, 128, 192, 256]),
                              causal in any::<bool>(), with_mask in any::<bool>(),
                              window in prop::option::of(1usize..150),
                              dt in prop::sample::select(vec![DType::BF16, DType::F16]), seed: u64) {
        let (op, inputs) = attention_backward_inputs_lse(
            [batch, seq_q, seq_kv, kv_heads, group, head_dim], (causal, window), (with_mask, true),
            dt, seed);
        check(&op, &inputs)?;
    }

    /// The forward's log-sum-exp output (and the output beside it) on the tensor-core
    /// kernels: prefill and decode shapes (which then skip the split-KV kernels), odd
    /// lengths, caches shorter than the query (rows that see no key: +inf), GQA, masks,
    /// sliding windows.
    #[test]
    fn attention_lse(batch in 1usize..3,
                     (seq_q, seq_kv) in prop_oneof![
                         (1usize..150, 1usize..200),
                         (1usize..=4, 65usize..1500),
                         (Just(1usize), Just(1usize)),
                     ],
                     kv_heads in 1usize..3, group in 1usize..=4,
                     head_dim in prop::sample::select(vec![64usize, 128]),
                     causal in any::<bool>(), window in prop::option::of(1usize..150),
                     with_mask in any::<bool>(),
                     dt in prop::sample::select(vec![DType::BF16, DType::F16]), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let heads = kv_heads * group;
        let p = kpt_core::graph::AttentionParams {
            mask: with_mask,
            window,
            lse: true,
            ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let kv_shape = [batch, seq_kv, kv_heads * head_dim];
        let mut inputs = vec![
            random(&mut rng, &[batch, seq_q, heads * head_dim], dt, -2.0, 2.0),
            random(&mut rng, &kv_shape, dt, -2.0, 2.0),
            random(&mut rng, &kv_shape, dt, -2.0, 2.0),
        ];
        if with_mask {
            inputs.push(attention_mask(&mut rng, seq_q, seq_kv));
        }
        check(&Op::Attention(p), &inputs)?;
    }

    #[test]
    fn concat(a0 in 1usize..4, a in 1usize..30, b in 1usize..30, inner in 1usize..40,
              axis in 0usize..3, dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let mut sa = [a0, inner, 3];
        let mut sb = sa;
        sa[axis] = a;
        sb[axis] = b;
        let x = random(&mut rng, &sa, dt, -1.0, 1.0);
        let y = random(&mut rng, &sb, dt, -1.0, 1.0);
        check(&Op::Concat { axis }, &[x, y])?;
    }

    #[test]
    fn embedding(n in 1usize..40, vocab in 1usize..60,
                 dim in prop::sample::select(vec![1usize, 3, 8, 64, 100]),
                 lead in prop::sample::select(vec![0usize, 1, 3]),
                 dt in dtype(), wide in any::<bool>(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        // lead > 0: rows of a [lead, vocab, dim] activation (a prefill's last tokens).
        let (shape, rows) = if lead == 0 { (vec![vocab, dim], vocab) } else { (vec![lead, vocab, dim], lead * vocab) };
        let table = random(&mut rng, &shape, dt, -1.0, 1.0);
        let i = ids(&mut rng, n, rows, if wide { DType::I64 } else { DType::I32 });
        check(&Op::Embedding, &[i, table])?;
    }

    #[test]
    fn quantize_round_trip(n in 1usize..5000, dt in dtype(),
                           q in prop::sample::select(vec![DType::F8E4M3, DType::F8E5M2, DType::I8]),
                           seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[n], dt, -10.0, 10.0);
        let amax = x.to_f64_vec().iter().fold(0f64, |m, v| m.max(v.abs())) as f32;
        let scale = kpt_core::dtype::quant_scale(amax, q);
        check(&Op::Quantize { dtype: q, scale }, std::slice::from_ref(&x))?;
        let stored = random(&mut rng, &[n], q, -10.0, 10.0);
        check(&Op::Dequantize { dtype: dt }, &[stored])?;
    }

    #[test]
    fn gemm(m in 1usize..130, k in 1usize..200, n in 1usize..130, batch in 1usize..3,
            dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let a = random(&mut rng, &[batch, m, k], dt, -1.0, 1.0);
        let b = random(&mut rng, &[batch, k, n], dt, -1.0, 1.0);
        check(&Op::MatMul, &[a.clone(), b])?;
        let b2 = random(&mut rng, &[k, n], dt, -1.0, 1.0);
        check(&Op::MatMul, &[a, b2])?;
    }

    #[test]
    fn linear(m in 1usize..100, k in 1usize..200, n in 1usize..100, bias in any::<bool>(),
              a in prop::option::of(act()), dt in dtype(),
              w_dt in prop::sample::select(vec![None, Some(DType::BF16), Some(DType::F8E4M3), Some(DType::I8)]),
              seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[m, k], dt, -1.0, 1.0);
        let w = random(&mut rng, &[n, k], w_dt.unwrap_or(dt), -1.0, 1.0);
        let mut inputs = vec![x, w];
        if bias {
            inputs.push(random(&mut rng, &[n], dt, -1.0, 1.0));
        }
        let op = match a {
            Some(act) => Op::LinearAct { bias, act },
            None => Op::Linear { bias },
        };
        check(&op, &inputs)?;
    }

    #[test]
    fn linear_few_rows(batch in 1usize..=4, seq in 1usize..=8, k in 1usize..700, n in 1usize..300,
                       bias in any::<bool>(), dt in dtype(), seed: u64) {
        // Linears of up to 32 rows: the GEMV kernel up to the registry's crossover
        // (GEMV_ROWS), cuBLASLt above; each device kernel the registry accepts is checked
        // (odd K, K of whole 16-byte vectors).
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[batch, seq, k], dt, -1.0, 1.0);
        let w = random(&mut rng, &[n, k], dt, -1.0, 1.0);
        let mut inputs = vec![x, w];
        if bias {
            inputs.push(random(&mut rng, &[n], dt, -1.0, 1.0));
        }
        let op = Op::Linear { bias };
        let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
        if let Some(b) = backend() {
            let chain = registry().fallback_chain(&op, &specs, b.device());
            let gemv = chain.first().is_some_and(|k| k == "cuda.linear.gemv");
            prop_assert_eq!(gemv, batch * seq <= GEMV_ROWS, "{:?}", chain);
        }
        check(&op, &inputs)?;
    }

    #[test]
    fn gemv_every_row_class(m in 1usize..=32,
                            k in prop_oneof![1usize..700, (1usize..330).prop_map(|v| 8 * v)],
                            n in 1usize..300, bias in any::<bool>(), dt in dtype(), seed: u64) {
        // `cuda.linear.gemv` by name at every row count it takes, whatever the registry
        // would pick: K of whole 16-byte vectors (the vector loops; for bf16 / f16 at 5
        // to 32 rows the tensor-core loop, with K steps cut short, several steps per warp
        // and weight tiles cut off by N) and K that is not (the scalar loops).
        let Some(b) = backend() else { return Ok(()) };
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[m, k], dt, -1.0, 1.0);
        let w = random(&mut rng, &[n, k], dt, -1.0, 1.0);
        let mut inputs = vec![x, w];
        if bias {
            inputs.push(random(&mut rng, &[n], dt, -1.0, 1.0));
        }
        let op = Op::Linear { bias };
        let want = CpuReference.eval(&op, &inputs).unwrap();
        let got = run_kernel(b, "cuda.linear.gemv", &op, &inputs)
            .map_err(|e| TestCaseError::fail(format!("gemv: {e}")))?;
        let tol = tolerance(&op, dt, k);
        let stats = compare(&got[0], &want[0], tol).unwrap();
        prop_assert!(stats.within, "gemv m {} k {} n {} {}: {:?} vs {:?}", m, k, n, dt, stats, tol);
        // Weights marked constant (a plan's parameters) are read before the kernel waits
        // for its producer; the sums are the same.
        let preloaded = gemv_constant_weights(b, &op, &inputs)
            .map_err(|e| TestCaseError::fail(format!("gemv, constant weights: {e}")))?;
        prop_assert_eq!(preloaded.to_f64_vec(), got[0].to_f64_vec());
    }

    #[test]
    fn gated_activation(rows in 1usize..20, d in 1usize..300, dt in dtype(), a in act(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[rows, 2 * d], dt, -3.0, 3.0);
        check(&Op::ActAndMul { act: a }, &[x])?;
    }

    #[test]
    fn split(outer in 1usize..4, parts in prop::collection::vec(1usize..40, 1..4), inner in 1usize..9,
             axis in 0usize..3, dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let mut shape = [outer, 3, inner];
        shape[axis] = parts.iter().sum();
        let x = random(&mut rng, &shape, dt, -1.0, 1.0);
        check(&Op::Split { axis, sizes: parts }, &[x])?;
    }
}

/// The Hopper attention kernel's persistent grid with a few blocks, so that each walks
/// many query tiles, carrying the K/V ring and the Q buffer from one tile to the next: one
/// tile a step without a causal mask, a long and a short tile paired with one. Partial
/// first tiles, caches shorter and longer than the query (under the causal mask, rows
/// that see no key), additive masks, both 16-bit dtypes and head dims, and FP8. The grid
/// size is set on the shared backend; other tests running meanwhile are not affected,
/// as the result does not depend on it. The 3-block grid runs the calls without masks at
/// head dim 128 in one cluster of two blocks sharing K/V (`Gpu::kv_multicast`), the 7- and
/// 5-block ones on 160-key tiles; each pass adds a causal case over 2101 keys.
#[test]
fn attention_persistent_grid() -> Result<(), TestCaseError> {
    let Some(b) = backend() else { return Ok(()) };
    let cases = [
        ([2, 400, 333, 2, 4, 64], false, DType::BF16),
        ([2, 385, 500, 2, 2, 128], true, DType::F16),
        ([3, 260, 129, 1, 3, 128], false, DType::BF16),
        ([2, 300, 300, 2, 2, 64], true, DType::F16),
        ([1, 300, 211, 2, 2, 128], false, DType::F16),
        // 288 = 160 + 128 keys: the last 160-key tile holds exactly 128.
        ([2, 130, 288, 1, 2, 128], false, DType::BF16),
    ];
    let mut result = Ok(());
    let multicast_before = b.gpu().kv_multicast();
    for (blocks, multicast) in [(3, true), (7, false), (5, false)] {
        b.gpu().set_attention_blocks(Some(blocks));
        b.gpu().set_kv_multicast(multicast);
        result = result.and(check_attention(
            [1, 150, 2101, 1, 2, 128],
            (true, None),
            false,
            DType::BF16,
            11,
        ));
        for (seed, (shape, with_mask, dt)) in cases.into_iter().enumerate() {
            for causal in [false, true] {
                result = result.and(check_attention(
                    shape,
                    (causal, None),
                    with_mask,
                    dt,
                    seed as u64,
                ));
            }
        }
        for causal in [false, true] {
            result = result.and(check_attention_fp8(
                [2, 300, 400, 2, 2, 128],
                (causal, false, None),
                7,
            ));
        }
    }
    b.gpu().set_attention_blocks(None);
    b.gpu().set_kv_multicast(multicast_before);
    result
}

/// FP8 attention on the bf16 fallback (`cuda.attention`, after dequantization) with a
/// large softmax scale, causal, an additive mask and more queries than keys: q and k
/// dequantized with their scales rounded every score by up to 2^-9 and missed the bound
/// by 12% (q and k are now dequantized exactly and their scales go into the softmax scale).
#[test]
fn attention_fp8_fallback_large_scale() -> Result<(), TestCaseError> {
    check_attention_fp8(
        [2, 223, 195, 2, 2, 128],
        (true, true, Some(0.950_893_46)),
        15_715_554_676_013_631_552,
    )
}

/// The Hopper FP8 kernel guesses each key tile's max from the tiles before it and falls
/// back to the exact softmax where the guess would overflow e4m3. Three batch entries of
/// 1000 keys (six 192-key tiles) with the softmax scale 1: keys whose norm grows along the
/// first half of the sequence and is 16 to 48 times larger in the second (tile maxima above
/// the running max, the first after the jump by more than 2^127: the fallback after a half
/// tile), keys
/// that all equal one row (all scores of a row equal: the sums of P exceed the bound and
/// the scores themselves are compared), and random keys (the guess holds); without and
/// with a causal mask.
#[test]
fn attention_fp8_guessed_max() -> Result<(), TestCaseError> {
    let (seq_q, seq_kv, d) = (130, 1000, 128);
    let mut rng = SplitMix64::new(11);
    let mut unit = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.next_f64() * 2.0 - 1.0).collect() };
    let q = unit(3 * seq_q * d);
    let mut k = unit(3 * seq_kv * d);
    for (j, x) in k[..seq_kv * d].iter_mut().enumerate() {
        let key = j / d;
        *x *= if key < seq_kv / 2 {
            0.25 + key as f64 / seq_kv as f64
        } else {
            12.0
        };
    }
    let row = k[seq_kv * d..seq_kv * d + d].to_vec();
    for chunk in k[seq_kv * d..2 * seq_kv * d].chunks_mut(d) {
        chunk.copy_from_slice(&row);
    }
    let v = unit(3 * seq_kv * d);
    let fp8 = |x: &[f64], seq: usize| Tensor::from_f64(x, &[3, seq, d], DType::F8E4M3).unwrap();
    let inputs = [fp8(&q, seq_q), fp8(&k, seq_kv), fp8(&v, seq_kv)];
    // Without and with a causal mask (the causal entry takes part of its exp2s on the FMA
    // units, whose input the guess must clamp).
    for causal in [false, true] {
        let p = kpt_core::graph::AttentionParams {
            scale: Some(1.0),
            ..kpt_core::graph::AttentionParams::new(1, 1, d, causal)
        };
        check_fp8_inputs(&Op::Attention(p), &inputs)?;
    }
    Ok(())
}

#[test]
fn dynamic_quantization_finds_the_scale() {
    let Some(b) = backend() else { return };
    let mut rng = SplitMix64::new(7);
    for dt in FLOATS {
        for q in [DType::F8E4M3, DType::F8E5M2, DType::I8] {
            let x = random(&mut rng, &[3, 1001], dt, -20.0, 20.0);
            let xs = spec(&x);
            let qs = TensorSpec::new(x.shape(), q);
            let xb = b.upload(&x).unwrap();
            let mut qb = b.allocate(q, x.numel()).unwrap();
            let scale = b
                .quantize_dynamic(
                    BufferRef {
                        buffer: &xb,
                        spec: &xs,
                    },
                    BufferMut {
                        buffer: &mut qb,
                        spec: &qs,
                    },
                )
                .unwrap();
            let amax = x.to_f64_vec().iter().fold(0f64, |m, v| m.max(v.abs())) as f32;
            let want = kpt_core::dtype::quant_scale(amax, q);
            assert!(
                (scale - want).abs() <= want * 1e-6,
                "{dt}->{q}: {scale} vs {want}"
            );
            let got = b.download(&qb, &qs).unwrap();
            let reference = CpuReference
                .eval(&Op::Quantize { dtype: q, scale }, std::slice::from_ref(&x))
                .unwrap();
            let stats = compare(
                &got,
                &reference[0],
                tolerance(&Op::Quantize { dtype: q, scale }, q, 1),
            )
            .unwrap();
            assert!(stats.within, "{dt}->{q}: {stats:?}");
        }
    }
}

/// `y = act(sx·sw · x·wᵀ + bias)` in f64 from the dequantized operands.
fn fp8_linear_reference(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, relu: bool) -> Tensor {
    let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let (xv, wv) = (x.to_f64_vec(), w.to_f64_vec());
    let bv = bias.map(Tensor::to_f64_vec);
    let mut y = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|l| xv[i * k + l] * wv[j * k + l]).sum();
            let v = dot + bv.as_ref().map_or(0.0, |b| b[j]);
            y[i * n + j] = if relu { v.max(0.0) } else { v };
        }
    }
    Tensor::from_f64(&y, &[m, n], DType::F64).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// cuBLASLt's FP8 GEMM (e4m3 x e4m3 / e5m2, per-tensor scales, bias, ReLU) against
    /// the f64 product of the dequantized operands.
    #[test]
    fn fp8_gemm(m in 1usize..70, k in prop::sample::select(vec![16usize, 32, 48, 112, 256]),
                n in prop::sample::select(vec![16usize, 32, 80, 144]),
                w_dt in prop::sample::select(vec![DType::F8E4M3, DType::F8E5M2]),
                out in prop::sample::select(vec![DType::BF16, DType::F16, DType::F32]),
                bias in any::<bool>(), relu in any::<bool>(), seed: u64) {
        use kpt_nvidia::{DeviceBlock, Epilogue, GemmArgs, GemmShape, Layout};
        let Some(b) = backend() else { return Ok(()) };
        let Some(blas) = b.blas() else { return Ok(()) };
        if !b.gpu().properties().has_fp8() {
            return Ok(());
        }
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[m, k], DType::F8E4M3, -3.0, 3.0);
        let w = random(&mut rng, &[n, k], w_dt, -0.5, 0.5);
        let bias_t = bias.then(|| random(&mut rng, &[n], out, -1.0, 1.0));
        let shape = GemmShape {
            m, n, k, batch: 1, layout: Layout::Linear, a: DType::F8E4M3, b: w_dt, out,
            bias, epilogue: if relu { Epilogue::Relu } else { Epilogue::None },
        };
        let up = |t: &Tensor| b.upload(t).unwrap();
        let scale = |t: &Tensor| up(&Tensor::from_f64(&[f64::from(t.scale())], &[1], DType::F32).unwrap());
        let (xb, wb, sx, sw) = (up(&x), up(&w), scale(&x), scale(&w));
        let bb = bias_t.as_ref().map(up);
        let y = b.allocate(out, m * n).unwrap();
        let ptr = |d: &DeviceBuffer| d.inner::<DeviceBlock>().unwrap().ptr();
        let args = GemmArgs {
            a: ptr(&xb), b: ptr(&wb), out: ptr(&y), bias: bb.as_ref().map_or(0, ptr),
            a_scale: ptr(&sx), b_scale: ptr(&sw),
        };
        let ran = blas.gemm(b.gpu(), &shape, &args);
        if out == DType::F32 && bias {
            // Not a cuBLASLt combination: a typed error, not a launch.
            let e = ran.expect_err("FP8 GEMM with f32 output and bias");
            prop_assert!(e.to_string().contains("bias"), "{e}");
            return Ok(());
        }
        ran.map_err(|e| TestCaseError::fail(format!("{shape:?}: {e}")))?;
        let got = b.download(&y, &TensorSpec::new(&[m, n], out)).unwrap();
        let want = fp8_linear_reference(&x, &w, bias_t.as_ref(), relu);
        // Hopper's FP8 tensor cores accumulate with about 14 mantissa bits, not a full
        // f32 accumulator (seen: 8.7e-5 relative at k = 16), so an f32 output is held to
        // bf16's tolerance.
        let op = Op::Linear { bias };
        let tol = tolerance(&op, if out == DType::F32 { DType::BF16 } else { out }, k);
        let stats = compare(&got, &want, tol).unwrap();
        prop_assert!(stats.within, "{shape:?}: {stats:?} vs {tol:?}");
    }
}

/// A LLaMA-3-8B decode batch (64 sequences at different lengths, one token each) through
/// `cuda.split_rotary`, and the same q and k from `Split` then `Rotary`, bit for bit.
#[test]
fn split_rotary_decode_batch_matches_split_then_rotary() {
    let Some(b) = backend() else { return };
    let mut rng = SplitMix64::new(17);
    let (batch, head_dim, sizes) = (64, 128, vec![4096, 1024, 1024]);
    let scaling = rope_scaling(3, 8.0, 8192);
    for dt in FLOATS {
        let x = random(&mut rng, &[batch, 1, 6144], dt, -2.0, 2.0);
        let pos = positions(&mut rng, (batch, 1, true), 131_072, true);
        let fused = Op::SplitRotary {
            head_dim,
            theta: 500_000.0,
            scaling,
            sizes: sizes.clone(),
            cache: false,
        };
        check(&fused, &[x.clone(), pos.clone()]).unwrap();
        let got = run_kernel(b, "cuda.split_rotary", &fused, &[x.clone(), pos.clone()]).unwrap();
        let split = Op::Split {
            axis: 2,
            sizes: sizes.clone(),
        };
        let parts = run_kernel(b, "cuda.split", &split, &[x]).unwrap();
        let rope = Op::Rotary {
            head_dim,
            theta: 500_000.0,
            scaling,
        };
        for i in 0..2 {
            let want =
                run_kernel(b, "cuda.rotary", &rope, &[parts[i].clone(), pos.clone()]).unwrap();
            assert_eq!(got[i].to_f64_vec(), want[0].to_f64_vec(), "{dt} part {i}");
        }
        assert_eq!(got[2].to_f64_vec(), parts[2].to_f64_vec(), "{dt} v");
    }
}

#[test]
fn large_rows_and_gemms_match_the_reference() {
    let mut rng = SplitMix64::new(11);
    for dt in FLOATS {
        let x = random(&mut rng, &[64, 16384], dt, -2.0, 2.0);
        let w = random(&mut rng, &[16384], dt, 0.5, 1.5);
        check(&Op::RmsNorm { eps: 1e-6 }, &[x, w]).unwrap();
        let a = random(&mut rng, &[256, 1024], dt, -1.0, 1.0);
        let wt = random(&mut rng, &[768, 1024], dt, -1.0, 1.0);
        let bias = random(&mut rng, &[768], dt, -1.0, 1.0);
        check(
            &Op::LinearAct {
                bias: true,
                act: Activation::GeluTanh,
            },
            &[a, wt, bias],
        )
        .unwrap();
    }
}

#[test]
fn gemv_takes_decode_shapes_and_leaves_larger_ones_to_cublaslt() {
    let Some(b) = backend() else { return };
    let mut rng = SplitMix64::new(12);
    // The 1.1B LLaMA decode shapes (merged q/k/v, down) at 1 to 32 rows, with a bias:
    // the registry's choice (GEMV up to GEMV_ROWS rows) and the GEMV kernel by name.
    for (m, k, n) in [
        (1, 2048, 2560),
        (5, 5632, 2048),
        (16, 2048, 1000),
        (17, 5632, 2048),
        (32, 2048, 2560),
    ] {
        for dt in FLOATS {
            let x = random(&mut rng, &[m, k], dt, -1.0, 1.0);
            let w = random(&mut rng, &[n, k], dt, -1.0, 1.0);
            let bias = random(&mut rng, &[n], dt, -1.0, 1.0);
            let op = Op::Linear { bias: true };
            let specs = [spec(&x), spec(&w), spec(&bias)];
            let chain = registry().fallback_chain(&op, &specs, b.device());
            let gemv = chain.first().is_some_and(|k| k == "cuda.linear.gemv");
            assert_eq!(gemv, m <= GEMV_ROWS, "{m} rows: {chain:?}");
            check(&op, &[x.clone(), w.clone(), bias.clone()]).unwrap();
            // The kernel by name, wherever the registry's crossover lies.
            let inputs = [x, w, bias];
            let want = CpuReference.eval(&op, &inputs).unwrap();
            let got = run_kernel(b, "cuda.linear.gemv", &op, &inputs).unwrap();
            let stats = compare(&got[0], &want[0], tolerance(&op, dt, k)).unwrap();
            assert!(stats.within, "{m}x{k}x{n} {dt}: {stats:?}");
        }
    }
    let specs = [
        TensorSpec::new(&[33, 64], DType::BF16),
        TensorSpec::new(&[32, 64], DType::BF16),
    ];
    let chain = registry().fallback_chain(&Op::Linear { bias: false }, &specs, b.device());
    assert!(!chain.iter().any(|k| k == "cuda.linear.gemv"), "{chain:?}");
    // Weights of another dtype are converted for cuBLASLt rather than failing.
    let x = random(&mut rng, &[2, 96], DType::F32, -1.0, 1.0);
    let w = random(&mut rng, &[40, 96], DType::BF16, -1.0, 1.0);
    let want = CpuReference
        .eval(&Op::Linear { bias: false }, &[x.clone(), w.clone()])
        .unwrap();
    let got = run_kernel(b, "cuda.linear.gemv", &Op::Linear { bias: false }, &[x, w]).unwrap();
    let tol = tolerance(&Op::Linear { bias: false }, DType::F32, 96);
    assert!(compare(&got[0], &want[0], tol).unwrap().within);
}

#[test]
fn attention_falls_back_to_the_host_reference() {
    let Some(b) = backend() else { return };
    let p = kpt_core::graph::AttentionParams::new(2, 2, 8, true);
    let op = Op::Attention(p);
    let mut rng = SplitMix64::new(3);
    let q = random(&mut rng, &[1, 5, 16], DType::F32, -1.0, 1.0);
    let k = random(&mut rng, &[1, 5, 16], DType::F32, -1.0, 1.0);
    let v = random(&mut rng, &[1, 5, 16], DType::F32, -1.0, 1.0);
    let inputs = [q, k, v];
    let specs: Vec<_> = inputs.iter().map(spec).collect();
    let chain = registry().fallback_chain(&op, &specs, b.device());
    assert_eq!(
        chain.last().map(String::as_str),
        Some(kpt_kernels::CPU_REFERENCE)
    );
    let got = run_kernel(b, kpt_kernels::CPU_REFERENCE, &op, &inputs).unwrap();
    let want = CpuReference.eval(&op, &inputs).unwrap();
    assert!(
        compare(&got[0], &want[0], tolerance(&op, DType::F32, 13))
            .unwrap()
            .within
    );
}

/// `inputs` = [cache, rows, slots]: the cache uploaded, `Backend::write_rows` into it in
/// place, downloaded.
fn write_rows_in_place(b: &CudaBackend, inputs: &[Tensor]) -> kpt_core::Result<Tensor> {
    let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
    let mut cache = b.upload(&inputs[0])?;
    let (rows, slots) = (b.upload(&inputs[1])?, b.upload(&inputs[2])?);
    b.write_rows(
        BufferRef {
            buffer: &rows,
            spec: &specs[1],
        },
        BufferRef {
            buffer: &slots,
            spec: &specs[2],
        },
        BufferMut {
            buffer: &mut cache,
            spec: &specs[0],
        },
    )?;
    b.download(&cache, &specs[0])
}

#[test]
fn cache_write_skips_slots_past_the_cache() {
    let Some(b) = backend() else { return };
    let mut rng = SplitMix64::new(11);
    for dt in FLOATS {
        let mut inputs = cache_write_inputs(&mut rng, [3, 4, 5], 6, 1, dt, DType::I64);
        let want = CpuReference.eval(&Op::CacheWrite, &inputs).unwrap()[0].to_f64_vec();
        // Slots past the 12 rows: the reference rejects them, the kernel skips them.
        let mut slots = inputs[2].to_f64_vec();
        slots.extend([12.0, 1e15]);
        let extra = random(&mut rng, &[2, 5], dt, -4.0, 4.0);
        let rows = inputs[1].to_f64_vec().into_iter().chain(extra.to_f64_vec());
        inputs[1] = Tensor::from_f64(&rows.collect::<Vec<_>>(), &[8, 5], dt).unwrap();
        inputs[2] = Tensor::from_f64(&slots, &[8], DType::I64).unwrap();
        let got = run_kernel(b, "cuda.cache_write", &Op::CacheWrite, &inputs).unwrap();
        assert_eq!(got[0].to_f64_vec(), want, "{dt}");
        assert_eq!(
            write_rows_in_place(b, &inputs).unwrap().to_f64_vec(),
            want,
            "{dt}"
        );
    }
}

/// The paged decode kernels' device-side guards: a length past the table's capacity is
/// clamped to it, a negative one to 0, and the keys of block ids outside the cache are
/// masked (never read), as the same attention over the gathered rows with those keys
/// masked out (-inf) gives.
#[test]
fn paged_decode_clamps_lengths_and_masks_bad_blocks() {
    let Some(b) = backend() else { return };
    let (seq_q, kv_heads, group, head_dim) = (2usize, 2usize, 4usize, 128usize);
    let heads = kv_heads * group;
    let row = kv_heads * head_dim;
    for (dt, block_size, causal, wide) in [
        (DType::BF16, 16, true, false),
        (DType::F16, 5, false, true),
        (DType::F32, 16, false, false),
        (DType::BF16, 5, true, true),
        (DType::F32, 7, true, true),
    ] {
        let mut rng = SplitMix64::new(block_size as u64);
        let lens = [150usize, 77, 3];
        let mut inputs = paged_inputs(
            &mut rng,
            &lens,
            0,
            block_size,
            [seq_q, kv_heads, group, head_dim],
            dt,
            (index_dtype(wide), index_dtype(!wide)),
        );
        let max_blocks = inputs[3].shape()[1];
        let num_blocks = inputs[1].shape()[0];
        let capacity = max_blocks * block_size;
        // Sequence 0 claims more keys than the table holds (its garbage entries made
        // valid), sequence 1 has two bad ids among its blocks, sequence 2 a negative
        // length.
        let mut table = inputs[3].to_f64_vec();
        for (i, id) in table[..max_blocks].iter_mut().enumerate() {
            *id = (i % num_blocks) as f64;
        }
        table[max_blocks + 1] = num_blocks as f64 + 3.0;
        table[max_blocks + 3] = -2.0;
        inputs[3] = Tensor::from_f64(&table, &[3, max_blocks], index_dtype(wide)).unwrap();
        let claimed = [capacity as f64 + 50.0, 77.0, -5.0];
        inputs[4] = Tensor::from_f64(&claimed, &[3], index_dtype(!wide)).unwrap();
        let p = kpt_core::graph::AttentionParams {
            paged: true,
            ..kpt_core::graph::AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let op = Op::Attention(p);
        // The expected output, one sequence at a time: dense attention over the rows the
        // table names (zeros and a -inf mask for bad ids).
        let (kc, vc, q) = (
            inputs[1].to_f64_vec(),
            inputs[2].to_f64_vec(),
            inputs[0].to_f64_vec(),
        );
        let q_len = seq_q * heads * head_dim;
        let mut want = vec![0.0; 3 * q_len];
        for (s, len) in [capacity, 77, 0].into_iter().enumerate() {
            if len == 0 {
                continue;
            }
            let (mut k, mut v, mut mask) = (vec![], vec![], vec![0.0; seq_q * len]);
            for j in 0..len {
                let id = table[s * max_blocks + j / block_size];
                if id < 0.0 || id >= num_blocks as f64 {
                    k.extend(std::iter::repeat_n(0.0, row));
                    v.extend(std::iter::repeat_n(0.0, row));
                    for i in 0..seq_q {
                        mask[i * len + j] = f64::NEG_INFINITY;
                    }
                    continue;
                }
                let at = (id as usize * block_size + j % block_size) * row;
                k.extend_from_slice(&kc[at..at + row]);
                v.extend_from_slice(&vc[at..at + row]);
            }
            let dense = kpt_core::graph::AttentionParams { mask: true, ..p };
            let dense = Op::Attention(kpt_core::graph::AttentionParams {
                paged: false,
                ..dense
            });
            let t = |x: &[f64], shape: &[usize]| Tensor::from_f64(x, shape, DType::F64).unwrap();
            let out = CpuReference
                .eval(
                    &dense,
                    &[
                        t(
                            &q[s * q_len..(s + 1) * q_len],
                            &[1, seq_q, heads * head_dim],
                        ),
                        t(&k, &[1, len, row]),
                        t(&v, &[1, len, row]),
                        t(&mask, &[seq_q, len]),
                    ],
                )
                .unwrap();
            want[s * q_len..(s + 1) * q_len].copy_from_slice(&out[0].to_f64_vec());
        }
        let want = Tensor::from_f64(&want, &[3, seq_q, heads * head_dim], DType::F64).unwrap();
        let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
        let tol = tolerance(&op, dt, reduction_len(&op, &specs));
        let chain = registry().fallback_chain(&op, &specs, b.device());
        for kernel in chain.iter().filter(|k| k.starts_with("cuda.")) {
            // The gather path would reject these lengths: success means no host check.
            let got = run_kernel(b, kernel, &op, &inputs).unwrap();
            let stats = compare(&got[0], &want, tol).unwrap();
            assert!(stats.within, "{kernel} {dt} block {block_size}: {stats:?}");
        }
    }
}

#[test]
fn over_allocation_is_a_typed_error_and_the_device_stays_usable() {
    let Some(b) = backend() else { return };
    let mem = b.gpu().memory();
    let total = b.gpu().properties().memory_bytes as usize;
    let keep = b.gpu().alloc(64 << 20).unwrap();
    drop(b.gpu().alloc(32 << 20).unwrap()); // cached
    match b.gpu().alloc(total * 2) {
        Err(NvidiaError::OutOfMemory {
            requested,
            free,
            reserved,
        }) => {
            assert_eq!(requested, (total * 2) as u64);
            assert!(free < total as u64);
            assert!(
                reserved >= 64 << 20,
                "live block still reserved: {reserved}"
            );
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(mem.statistics().cache_flushes >= 1);
    assert!(mem.check_memory_available(total * 2).is_err());
    assert!(mem.check_memory_available(1 << 20).is_ok());
    let again = b.gpu().alloc(1 << 20).unwrap();
    b.gpu().write(&again, &[7u8; 1 << 20]).unwrap();
    assert_eq!(b.gpu().read(&again, 16).unwrap(), vec![7u8; 16]);
    drop((keep, again));
    assert!(mem.statistics().peak_allocated_bytes >= 64 << 20);
}

#[test]
fn bad_requests_are_errors() {
    let Some(b) = backend() else { return };
    let mut rng = SplitMix64::new(5);
    // An id past the table.
    let table = random(&mut rng, &[4, 8], DType::F32, -1.0, 1.0);
    let bad = Tensor::from_f64(&[1.0, 9.0], &[2], DType::I32).unwrap();
    let e = run_kernel(b, "cuda.embedding", &Op::Embedding, &[bad, table]).unwrap_err();
    assert!(e.to_string().contains("outside the table"), "{e}");
    // Outputs that do not match the op.
    let x = random(&mut rng, &[2, 8], DType::F32, -1.0, 1.0);
    let xb = b.upload(&x).unwrap();
    let wrong = TensorSpec::new(&[2, 9], DType::F32);
    let mut ob = b.allocate(DType::F32, 18).unwrap();
    let xs = spec(&x);
    let e = b
        .execute(
            "cuda.softmax",
            &Op::Softmax,
            &[BufferRef {
                buffer: &xb,
                spec: &xs,
            }],
            &mut [BufferMut {
                buffer: &mut ob,
                spec: &wrong,
            }],
        )
        .unwrap_err();
    assert!(e.to_string().contains("do not match"), "{e}");
    // A head too wide for the rotary kernels' shared cos/sin tables.
    let op = Op::SplitRotary {
        head_dim: 1024,
        theta: 10_000.0,
        scaling: None,
        sizes: vec![1024, 1024, 8],
        cache: false,
    };
    let qkv = random(&mut rng, &[1, 2, 2056], DType::BF16, -1.0, 1.0);
    let pos = Tensor::from_f64(&[0.0, 1.0], &[2], DType::I64).unwrap();
    let e = run_kernel(b, "cuda.split_rotary", &op, &[qkv, pos]).unwrap_err();
    assert!(e.to_string().contains("at most 512"), "{e}");
    // A kernel of another backend family.
    let e = run_kernel(b, "rocm.softmax", &Op::Softmax, &[x]).unwrap_err();
    assert!(e.to_string().contains("does not run on CUDA"), "{e}");
}

#[test]
fn attention_backward_declines_what_the_flash_kernel_does_not_take() {
    let Some(b) = backend() else { return };
    const FLASH: &str = "cuda.attention_backward.flash";
    // Head dim 96 and f32: not offered, and refused with a typed error if asked.
    for (head_dim, dt) in [(96, DType::BF16), (64, DType::F32)] {
        let (op, inputs) =
            attention_backward_inputs([1, 5, 7, 1, 2, head_dim], (true, Some(3)), false, dt, 11);
        let specs: Vec<_> = inputs.iter().map(spec).collect();
        let chain = registry().fallback_chain(&op, &specs, b.device());
        assert!(!chain.iter().any(|k| k == FLASH), "{chain:?}");
        assert_eq!(
            chain.last().map(String::as_str),
            Some(kpt_kernels::CPU_REFERENCE)
        );
        assert!(run_kernel(b, FLASH, &op, &inputs).is_err());
        // The host fallback computes them.
        let got = run_kernel(b, kpt_kernels::CPU_REFERENCE, &op, &inputs).unwrap();
        let want = CpuReference.eval(&op, &inputs).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(compare(g, w, tolerance(&op, dt, 71)).unwrap().within);
        }
    }
}

#[test]
fn attention_lse_runs_only_where_a_kernel_gives_it() {
    let Some(b) = backend() else { return };
    // f32 and head dim 80: no device kernel gives the log-sum-exp, so the host
    // reference does; the general kernel refuses it with an error.
    for (dt, head_dim) in [(DType::F32, 64), (DType::BF16, 80)] {
        let p = kpt_core::graph::AttentionParams {
            lse: true,
            ..kpt_core::graph::AttentionParams::new(2, 1, head_dim, true)
        };
        let op = Op::Attention(p);
        let mut rng = SplitMix64::new(3);
        let inputs = [
            random(&mut rng, &[1, 5, 2 * head_dim], dt, -1.0, 1.0),
            random(&mut rng, &[1, 7, head_dim], dt, -1.0, 1.0),
            random(&mut rng, &[1, 7, head_dim], dt, -1.0, 1.0),
        ];
        let specs: Vec<_> = inputs.iter().map(spec).collect();
        let chain = registry().fallback_chain(&op, &specs, b.device());
        assert!(!chain.iter().any(|k| k == "cuda.attention"), "{chain:?}");
        assert_eq!(
            chain.first().map(String::as_str),
            Some(kpt_kernels::CPU_REFERENCE)
        );
        assert!(run_kernel(b, "cuda.attention", &op, &inputs).is_err());
        let got = run_kernel(b, kpt_kernels::CPU_REFERENCE, &op, &inputs).unwrap();
        let want = CpuReference.eval(&op, &inputs).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].dtype(), DType::F32);
        for (g, w) in got.iter().zip(&want) {
            assert!(compare(g, w, tolerance(&op, dt, 71)).unwrap().within);
        }
    }
}

#[test]
fn detect_reports_the_device() {
    let Some(b) = backend() else { return };
    let d = b.device();
    assert!(d.name.contains("NVIDIA"), "{}", d.name);
    assert!(d.compute_units.unwrap_or(0) > 0);
    assert!(d.memory_bytes.unwrap_or(0) > 1 << 30);
    assert!(
        d.features.iter().any(|f| f == "cublaslt"),
        "{:?}",
        d.features
    );
}

/// `GemmTuning::cache`: the first backend times the candidates and writes its pick; a
/// second backend on the same file runs that pick (the same bits out) without timing; an
/// unreadable file is an error naming it.
#[test]
fn autotune_cache_file_pins_the_algorithm_across_backends() {
    if backend().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kpt-gpu-autotune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("cublaslt.json");
    let options = CudaOptions {
        gemm: kpt_nvidia::GemmTuning {
            cache: Some(path.clone()),
            ..Default::default()
        },
        ..CudaOptions::default()
    };
    let mut rng = SplitMix64::new(77);
    let op = Op::Linear { bias: false };
    let inputs = [
        random(&mut rng, &[300, 512], DType::BF16, -1.0, 1.0),
        random(&mut rng, &[1000, 512], DType::BF16, -0.05, 0.05),
    ];
    let first = CudaBackend::new(0, options.clone()).unwrap();
    let want = run_kernel(&first, "cuda.linear.cublaslt", &op, &inputs).unwrap();
    drop(first);
    let written = std::fs::read_to_string(&path).unwrap();
    assert!(written.contains("Linear 300x1000x512"), "{written}");
    let second = CudaBackend::new(0, options.clone()).unwrap();
    let got = run_kernel(&second, "cuda.linear.cublaslt", &op, &inputs).unwrap();
    assert_eq!(got[0].to_f64_vec(), want[0].to_f64_vec());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), written);
    drop(second);
    std::fs::write(&path, "{").unwrap();
    let Err(e) = CudaBackend::new(0, options) else {
        panic!("a broken cache file must fail")
    };
    assert!(e.to_string().contains("cublaslt.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Invalid offsets of a variable-length batch are a typed error on every dense kernel: on
/// Hopper the one-launch kernel flags them on the device (and clamps its reads and writes
/// to the packed rows meanwhile), elsewhere the host reads them first. A valid call after
/// each still computes.
#[test]
fn attention_varlen_bad_offsets() {
    let Some(b) = backend() else { return };
    let mut rng = SplitMix64::new(5);
    let (heads, d) = (2, 64);
    let p = kpt_core::graph::AttentionParams {
        varlen: true,
        ..kpt_core::graph::AttentionParams::new(heads, heads, d, true)
    };
    let (tq, tk) = (300, 300);
    let mut rows = |n: usize| random(&mut rng, &[1, n, heads * d], DType::BF16, -2.0, 2.0);
    let (q, k, v) = (rows(tq), rows(tk), rows(tk));
    let offsets = |v: &[f64], dt| Tensor::from_f64(v, &[v.len()], dt).unwrap();
    let good = [0.0, 100.0, 300.0];
    let bad: [&[f64]; 4] = [
        &[10.0, 100.0, 300.0],
        &[0.0, 200.0, 100.0, 300.0],
        &[0.0, 100.0, 250.0],
        &[0.0, 100.0, 400.0],
    ];
    let specs: Vec<TensorSpec> = [
        &q,
        &k,
        &v,
        &offsets(&good, DType::I32),
        &offsets(&good, DType::I32),
    ]
    .into_iter()
    .map(spec)
    .collect();
    let op = Op::Attention(p);
    let chain = registry().fallback_chain(&op, &specs, b.device());
    for kernel in chain.iter().filter(|k| k.starts_with("cuda.")) {
        for (cu, dt) in bad
            .iter()
            .flat_map(|cu| [(cu, DType::I32), (cu, DType::I64)])
        {
            let (cq, ck) = (offsets(cu, dt), offsets(&good, dt));
            for (a, c) in [(&cq, &ck), (&ck, &cq)] {
                let inputs = [q.clone(), k.clone(), v.clone(), a.clone(), c.clone()];
                let err = run_kernel(b, kernel, &op, &inputs).expect_err(kernel);
                assert!(err.to_string().contains("cu_seqlens"), "{kernel}: {err}");
            }
            let inputs = [
                q.clone(),
                k.clone(),
                v.clone(),
                offsets(&good, dt),
                offsets(&good, dt),
            ];
            let got = run_kernel(b, kernel, &op, &inputs).unwrap();
            let want = CpuReference.eval(&op, &inputs).unwrap();
            let tol = output_tolerance(&op, &inputs, 0, got[0].dtype());
            assert!(
                compare(&got[0], &want[0], tol).unwrap().within,
                "{kernel} after {cu:?}"
            );
        }
    }
}
