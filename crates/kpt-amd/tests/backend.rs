//! The ROCm backend on a real AMD GPU: every `amd.*` kernel the registry selects for the
//! device (and the host fallback at the end of each chain), every float dtype, against
//! the CPU f64 reference over random shapes with the validator's per-dtype tolerances;
//! the rocBLAS GEMMs with bias, activation and converted weights; device copies.
//!
//! Without a device the tests check that opening one is a typed error (no runtime, or a
//! runtime that sees no device), print one `SKIPPED` line and return. With
//! `KPT_REQUIRE_ROCM=1` a missing device fails them instead, so a GPU run cannot pass by
//! skipping. No AMD GPU was available when these tests were written: they have run only
//! on their skipping path.

use std::io::Write;
use std::sync::OnceLock;

use kpt_amd::{AmdError, RocmBackend, RocmOptions};
use kpt_core::backend::{Backend, BufferMut, BufferRef};
use kpt_core::graph::{Activation, AttentionParams, Op, TensorSpec};
use kpt_core::rand::SplitMix64;
use kpt_core::tensor::Tensor;
use kpt_core::validate::{compare, output_tolerance, tolerance, ReferenceOps};
use kpt_core::DType;
use kpt_kernels::{CpuReference, KernelRegistry};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The backend on device 0, or `None` (after checking why and saying so).
fn backend() -> Option<&'static RocmBackend> {
    static B: OnceLock<Option<RocmBackend>> = OnceLock::new();
    B.get_or_init(|| {
        let required = std::env::var("KPT_REQUIRE_ROCM").is_ok_and(|v| v == "1");
        match RocmBackend::new(0, RocmOptions::default()) {
            Ok(b) => Some(b),
            Err(e) => {
                assert!(
                    matches!(e, AmdError::NoRuntime { .. } | AmdError::NoDevice { .. }),
                    "opening ROCm device 0 failed with something other than a missing \
                     runtime or device: {e}"
                );
                assert!(!required, "KPT_REQUIRE_ROCM=1 but no ROCm device: {e}");
                // Written to the terminal directly: the harness captures `eprintln!`.
                let _ = writeln!(std::io::stderr(), "kpt-amd GPU tests SKIPPED: {e}");
                None
            }
        }
    })
    .as_ref()
}

fn registry() -> &'static KernelRegistry {
    static R: OnceLock<KernelRegistry> = OnceLock::new();
    R.get_or_init(KernelRegistry::with_builtin)
}

fn random(rng: &mut SplitMix64, shape: &[usize], dtype: DType, lo: f32, hi: f32) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = rng.vec(n, lo, hi).into_iter().map(f64::from).collect();
    Tensor::from_f64(&v, shape, dtype).unwrap()
}

fn spec(t: &Tensor) -> TensorSpec {
    TensorSpec::new(t.shape(), t.dtype())
}

/// Runs `op` through `kernel` on the device and returns the outputs.
fn run_kernel(
    b: &RocmBackend,
    kernel: &str,
    op: &Op,
    inputs: &[Tensor],
) -> kpt_core::Result<Vec<Tensor>> {
    kpt_core::backend::run_op(b, kernel, op, inputs)
}

/// Runs `op` with every kernel of the registry's chain for the device (the `amd.*`
/// kernels and the host reference that ends it), checking each output against the f64
/// reference. Where this processor has a shipped code object of the op, the registry's
/// first choice must be an `amd.*` kernel.
fn check(op: &Op, inputs: &[Tensor]) -> Result<(), TestCaseError> {
    let Some(b) = backend() else { return Ok(()) };
    let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
    let chain = registry().fallback_chain(op, &specs, b.device());
    prop_assert!(!chain.is_empty(), "{op} on {specs:?}: no kernel");
    let want = CpuReference.eval(op, inputs).unwrap();
    // The FP8 GEMM quantizes the activations: checked with its own bound below.
    for kernel in chain.iter().filter(|k| *k != FP8_LINEAR) {
        let got = run_kernel(b, kernel, op, inputs)
            .map_err(|e| TestCaseError::fail(format!("{kernel}: {e}")))?;
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

/// The registry name of the FP8 linear on hipBLASLt (MI300).
const FP8_LINEAR: &str = "amd.linear.hipblaslt_fp8";

/// A linear with e4m3 weights on `amd.linear.hipblaslt_fp8`, where the registry offers it
/// (an MI300 with hipBLASLt): it must be the first choice there, and each output within
/// the activations' e4m3 rounding (at most 1/16 of each |x·w| term) plus the output
/// dtype's tolerance of the reference.
fn check_fp8_linear(inputs: &[Tensor], bias: bool) -> Result<(), TestCaseError> {
    let Some(b) = backend() else { return Ok(()) };
    let op = Op::Linear { bias };
    let specs: Vec<TensorSpec> = inputs.iter().map(spec).collect();
    let chain = registry().fallback_chain(&op, &specs, b.device());
    if !chain.iter().any(|k| k == FP8_LINEAR) {
        prop_assert!(!b.device().has_feature("hipblaslt_fp8"), "{chain:?}");
        return Ok(());
    }
    prop_assert_eq!(chain[0].as_str(), FP8_LINEAR);
    let want = CpuReference.eval(&op, inputs).unwrap()[0].to_f64_vec();
    let got = run_kernel(b, FP8_LINEAR, &op, inputs)
        .map_err(|e| TestCaseError::fail(format!("{FP8_LINEAR}: {e}")))?;
    let out = got[0].dtype();
    let got = got[0].to_f64_vec();
    let (x, w) = (inputs[0].to_f64_vec(), inputs[1].to_f64_vec());
    let k = inputs[0].shape()[1];
    let n = inputs[1].shape()[0];
    let tol = tolerance(&op, out, k);
    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
        let (row, col) = (i / n, i % n);
        let terms: f64 = (0..k)
            .map(|j| (x[row * k + j] * w[col * k + j]).abs())
            .sum();
        let bound = terms / 16.0 + tol.abs + tol.rel * r.abs();
        prop_assert!(
            (g - r).abs() <= bound,
            "{FP8_LINEAR}: element {i} is {g}, reference {r} (bound {bound})"
        );
    }
    Ok(())
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(FLOATS.to_vec())
}

fn act() -> impl Strategy<Value = Activation> {
    prop::sample::select(Activation::ALL.to_vec())
}

/// Row lengths: tiny, odd, and multiples of 16 at and between the Triton row blocks.
fn dim() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![
        1, 3, 7, 16, 64, 100, 255, 1024, 1040, 4096, 4100, 8192, 9000,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

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

    #[test]
    fn elementwise(rows in 1usize..20, cols in 1usize..300, dt in dtype(), a in act(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[rows, cols], dt, -4.0, 4.0);
        let y = random(&mut rng, &[cols], dt, -2.0, 2.0);
        check(&Op::Activation { act: a }, std::slice::from_ref(&x))?;
        check(&Op::Add, &[x.clone(), y.clone()])?;
        check(&Op::Mul, &[x.clone(), y])?;
        let gated = random(&mut rng, &[rows, 2 * cols], dt, -4.0, 4.0);
        check(&Op::ActAndMul { act: a }, &[gated])?;
        for to in FLOATS {
            if to != dt {
                check(&Op::Cast { dtype: to }, std::slice::from_ref(&x))?;
            }
        }
    }

    #[test]
    fn gemms(m in 1usize..70, n in 1usize..90, k in 1usize..130, batch in 1usize..4,
             dt in dtype(), bias: bool, a in act(), wdt in 0usize..6, seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[m, k], dt, -1.0, 1.0);
        let b = random(&mut rng, &[batch, k, n], dt, -1.0, 1.0);
        let xb = random(&mut rng, &[batch, m, k], dt, -1.0, 1.0);
        check(&Op::MatMul, &[xb, b])?;
        // Weights of every dtype a linear takes: converted (or dequantized) first.
        let wdt = [DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I8][wdt];
        // Quantized targets get an amax-based scale.
        let w = random(&mut rng, &[n, k], DType::F32, -1.0, 1.0).to_dtype(wdt).unwrap();
        let mut inputs = vec![x, w];
        if bias {
            inputs.push(random(&mut rng, &[n], dt, -1.0, 1.0));
        }
        check(&Op::Linear { bias }, &inputs)?;
        check(&Op::LinearAct { bias, act: a }, &inputs)?;
        if wdt == DType::F8E4M3 {
            check_fp8_linear(&inputs, bias)?;
        }
    }

    #[test]
    fn attention(batch in 1usize..3, seq_q in 1usize..20, seq_kv in 1usize..40,
                 kv_heads in 1usize..3, group in 1usize..3,
                 head_dim in prop::sample::select(vec![8usize, 64, 80, 128]),
                 causal: bool, window in prop::option::of(1usize..8), mask: bool,
                 dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let heads = kv_heads * group;
        let p = AttentionParams {
            mask,
            window,
            ..AttentionParams::new(heads, kv_heads, head_dim, causal)
        };
        let mut inputs = vec![
            random(&mut rng, &[batch, seq_q, heads * head_dim], dt, -2.0, 2.0),
            random(&mut rng, &[batch, seq_kv, kv_heads * head_dim], dt, -2.0, 2.0),
            random(&mut rng, &[batch, seq_kv, kv_heads * head_dim], dt, -2.0, 2.0),
        ];
        if mask {
            let m: Vec<f64> = (0..seq_q * seq_kv).map(|_| -2.0 * rng.next_f64()).collect();
            inputs.push(Tensor::from_f64(&m, &[seq_q, seq_kv], DType::F32).unwrap());
        }
        check(&Op::Attention(p), &inputs)?;
    }

    #[test]
    fn rotary_embedding_and_quantize(tokens in 1usize..12, heads in 1usize..4,
                                     head_dim in prop::sample::select(vec![2usize, 16, 64, 128]),
                                     vocab in 1usize..50, wide: bool, dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let index = if wide { DType::I64 } else { DType::I32 };
        let pos: Vec<f64> = (0..tokens).map(|_| (rng.next_u64() % 4096) as f64).collect();
        let positions = Tensor::from_f64(&pos, &[tokens], index).unwrap();
        let x = random(&mut rng, &[1, tokens, heads * head_dim], dt, -2.0, 2.0);
        let rotary = Op::Rotary { head_dim, theta: 10000.0, scaling: None };
        check(&rotary, &[x.clone(), positions.clone()])?;
        let qkv = random(&mut rng, &[1, tokens, (2 * heads + 1) * head_dim], dt, -2.0, 2.0);
        let split = Op::SplitRotary {
            head_dim,
            theta: 10000.0,
            scaling: None,
            sizes: vec![heads * head_dim, head_dim, heads * head_dim],
            cache: false,
        };
        check(&split, &[qkv, positions])?;
        let ids: Vec<f64> = (0..tokens).map(|_| (rng.next_u64() % vocab as u64) as f64).collect();
        let ids = Tensor::from_f64(&ids, &[tokens], index).unwrap();
        let table = random(&mut rng, &[vocab, head_dim], dt, -1.0, 1.0);
        check(&Op::Embedding, &[ids.clone(), table])?;
        // Rows of an activation [1, vocab, head_dim] (a prefill's last tokens).
        let rows = random(&mut rng, &[1, vocab, head_dim], dt, -1.0, 1.0);
        check(&Op::Embedding, &[ids, rows])?;
        for q in [DType::F8E4M3, DType::F8E5M2, DType::I8] {
            let op = Op::Quantize { dtype: q, scale: 0.05 };
            check(&op, std::slice::from_ref(&x))?;
            let quantized = x.to_dtype(q).unwrap();
            check(&Op::Dequantize { dtype: dt }, &[quantized])?;
        }
    }

    #[test]
    fn copies(outer in 1usize..6, a in 1usize..9, b in 1usize..9, dt in dtype(), seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let x = random(&mut rng, &[outer, a], dt, -2.0, 2.0);
        let y = random(&mut rng, &[outer, b], dt, -2.0, 2.0);
        check(&Op::Concat { axis: 1 }, &[x, y])?;
        let z = random(&mut rng, &[outer, a + b], dt, -2.0, 2.0);
        check(&Op::Split { axis: 1, sizes: vec![a, b] }, &[z])?;
        let cache = random(&mut rng, &[4, 2, a], dt, -2.0, 2.0);
        let rows = random(&mut rng, &[2, a], dt, -2.0, 2.0);
        let slots = Tensor::from_f64(&[5.0, -1.0], &[2], DType::I64).unwrap();
        check(&Op::CacheWrite, &[cache, rows, slots])?;
    }
}

/// Bad input on a device: typed errors, never a panic or a launch.
#[test]
fn bad_input_is_a_typed_error() {
    let Some(b) = backend() else { return };
    let x = Tensor::from_vec(vec![1f32; 6], &[2, 3]).unwrap();
    let buf = b.upload(&x).unwrap();
    let wrong = TensorSpec::new(&[3, 3], DType::F32);
    assert!(b.download(&buf, &wrong).is_err());
    let spec = spec(&x);
    let mut out = b.allocate(DType::F32, 6).unwrap();
    let r = b.execute(
        "cuda.softmax",
        &Op::Softmax,
        &[BufferRef {
            buffer: &buf,
            spec: &spec,
        }],
        &mut [BufferMut {
            buffer: &mut out,
            spec: &spec,
        }],
    );
    assert!(r.unwrap_err().to_string().contains("does not run on ROCm"));
    let short = TensorSpec::new(&[2, 2], DType::F32);
    let r = b.execute(
        "amd.softmax",
        &Op::Softmax,
        &[BufferRef {
            buffer: &buf,
            spec: &spec,
        }],
        &mut [BufferMut {
            buffer: &mut out,
            spec: &short,
        }],
    );
    assert!(r.is_err());
}

/// Opening the backend on this machine: "no ROCm runtime found" without a runtime,
/// `NoDevice` with one that sees no GPU (Debian's libamdhip64 5.2 without `/dev/kfd`),
/// a backend with a device; never a panic. A device index past the last is `NoDevice`
/// everywhere.
#[test]
fn opening_the_backend_is_typed_on_every_machine() {
    match kpt_amd::HipRuntime::global() {
        Err(e) => {
            assert!(matches!(e, AmdError::NoRuntime { .. }), "{e}");
            let b = RocmBackend::new(0, RocmOptions::default()).unwrap_err();
            assert!(b.to_string().starts_with("no ROCm runtime found ("), "{b}");
        }
        Ok(rt) => {
            let found = kpt_amd::devices_of(rt).unwrap().len();
            match RocmBackend::new(0, RocmOptions::default()) {
                Ok(b) => {
                    assert!(found > 0);
                    assert_eq!(b.kind(), kpt_core::hardware::DeviceKind::Rocm);
                    assert_eq!(b.name(), "rocm:0");
                }
                Err(e) => {
                    assert_eq!(found, 0, "{e}");
                    assert_eq!(e, AmdError::NoDevice { index: 0, found: 0 });
                    assert_eq!(e.to_string(), "no ROCm device 0: the HIP runtime sees 0");
                }
            }
            let past = RocmBackend::new(found, RocmOptions::default()).unwrap_err();
            assert_eq!(
                past,
                AmdError::NoDevice {
                    index: found,
                    found
                }
            );
        }
    }
}

/// The backend's counters: host runs count each `cpu.*` kernel it ran.
#[test]
fn host_runs_are_counted() {
    let Some(b) = backend() else { return };
    let count = |b: &RocmBackend| {
        b.counters()
            .into_iter()
            .find(|(k, _)| k == "rocm_host_runs_total")
            .map(|(_, v)| v)
            .unwrap()
    };
    let before = count(b);
    let x = Tensor::from_vec(vec![1f32, 2.0, 3.0], &[1, 3]).unwrap();
    let got = run_kernel(b, kpt_kernels::CPU_REFERENCE, &Op::Softmax, &[x]).unwrap();
    assert!((got[0].to_f64_vec().iter().sum::<f64>() - 1.0).abs() < 1e-6);
    assert!(count(b) > before);
    for name in ["rocm_compile_cache_hits", "rocm_compile_cache_misses"] {
        assert!(b.counters().iter().any(|(k, _)| k == name), "{name}");
    }
}
