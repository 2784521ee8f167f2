//! CPU kernels on plain row-major slices: an f64 [`reference`](mod@reference) for every
//! op, and fast multi-threaded f32 kernels (weights also in bf16, f16, FP8 and int8).
//!
//! Every function validates each slice length against the dimensions it is given and
//! returns [`KptError::Shape`](kpt_core::KptError::Shape) on a mismatch; none of them
//! panics on bad input or silently truncates.
//!
//! The fast kernels are written so that LLVM vectorizes them (fixed-width chunks with
//! independent accumulators); the hot loops are compiled twice, once with
//! `avx2,fma` enabled and once portable, and the AVX2 copy is chosen at run time.
//! They run on the current rayon pool and stay on the calling thread when the work is
//! too small to be worth splitting.

mod amx;
pub mod attention;
mod attention_amx;
pub mod attention_backward;
pub mod elementwise;
pub mod gemm;
pub mod linear;
pub mod norm;
pub mod reference;
pub mod rotary;
pub mod shapes;
pub mod softmax;

mod panels;
mod par;
mod scratch;
mod sgemm;
mod simd;
mod team;
mod wide;

use kpt_core::DType;

pub use attention::{
    attention, attention_bf16, attention_bf16_tolerance, DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q,
};
pub use attention_backward::{attention_backward, attention_lse};
pub use elementwise::{
    act_and_mul, activation, add, cast_bf16_to_f32, cast_f16_to_f32, cast_f32_to_bf16,
    cast_f32_to_f16, dequantize_f8e4m3, dequantize_f8e5m2, dequantize_i8, embedding, mul,
    quantize_f8e4m3, quantize_f8e5m2, quantize_i8,
};
pub use gemm::{matmul_bf16, matmul_f16, matmul_f32};
pub use linear::{linear, WeightsRef};
pub use norm::{add_layer_norm, add_rms_norm, layer_norm, rms_norm};
pub use rotary::{rotary, split_rotary};
pub use shapes::{
    for_each_paged_sequence, for_each_sequence, for_each_sequence_backward, varlen_segments,
    AttentionShape, PagedKv, ShapeDropout,
};
pub use softmax::{argmax, softmax};

/// An elementwise activation function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    /// `max(x, 0)`.
    Relu,
    /// Exact GELU: `x/2 * (1 + erf(x/√2))`.
    GeluErf,
    /// GELU, tanh approximation: `x/2 * (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    GeluTanh,
    /// SiLU (swish): `x * sigmoid(x)`.
    Silu,
}

/// `√(2/π)`, the GELU tanh approximation's inner scale.
const GELU_TANH_K: f64 = 0.797_884_560_802_865_4;
/// The GELU tanh approximation's cubic coefficient.
const GELU_TANH_C: f64 = 0.044_715;

impl Act {
    /// Every activation, in a stable order.
    pub const ALL: [Act; 4] = [Act::Relu, Act::GeluErf, Act::GeluTanh, Act::Silu];

    /// The activation in f64 (reference precision; NaN propagates).
    pub fn apply_f64(self, x: f64) -> f64 {
        match self {
            Act::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            // erfc(-t) = 1 + erf(t), without the cancellation for negative x.
            Act::GeluErf => 0.5 * x * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2),
            // (1 + tanh(u)) / 2 = sigmoid(2u), again cancellation-free.
            Act::GeluTanh => {
                let u = GELU_TANH_K * (x + GELU_TANH_C * x * x * x);
                x / (1.0 + (-2.0 * u).exp())
            }
            Act::Silu => x / (1.0 + (-x).exp()),
        }
    }

    /// The activation in f32. `Relu`, `GeluTanh` and `Silu` vectorize (they use the
    /// crate's polynomial `exp`, a few ulp); `GeluErf` uses a scalar `erfc` (< 1 ulp).
    #[inline(always)]
    pub fn apply_f32(self, x: f32) -> f32 {
        match self {
            Act::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            Act::GeluErf => 0.5 * x * libm::erfcf(-x * std::f32::consts::FRAC_1_SQRT_2),
            Act::GeluTanh => {
                let u = GELU_TANH_K as f32 * (x + GELU_TANH_C as f32 * x * x * x);
                x / (1.0 + simd::exp_f32(-2.0 * u))
            }
            Act::Silu => x / (1.0 + simd::exp_f32(-x)),
        }
    }
}

/// Tolerance `(abs, rel)` for comparing a kernel result with the f64 [`reference`](mod@reference):
/// an element passes when `|got - want| <= abs + rel * |want|`.
///
/// `dtype` is the dtype the result is *stored* in, `k` the length of the longest
/// reduction behind one output element (1 for elementwise ops).
///
/// Rationale:
/// - f32 compute: rounding errors of a `k`-term f32 sum grow like `√k` unit roundoffs
///   (random-walk bound; the fast kernels use several partial sums, which only helps),
///   so `abs = rel = 1e-6 · (4 + √k)` — about 20x f32's unit roundoff at `k = 1`, with
///   headroom for the polynomial `exp`, `erf`, etc. and for tails of the random error.
/// - bf16 / f16 outputs: the f32 tolerance plus one rounding to the output dtype, with a
///   2x / 4x margin: `rel += 2·2⁻⁸ ≈ 7.8e-3` (bf16), `rel += 4·2⁻¹¹ ≈ 2e-3` (f16).
/// - FP8 / int8 (quantization, values in units of the scale: multiply `abs` by the scale):
///   one rounding to nearest, `rel = 2⁻⁴` (e4m3), `2⁻³` (e5m2), plus half the smallest
///   subnormal spacing as `abs` (`2⁻¹⁰`, `2⁻¹⁷`); int8 rounds to integers, `abs = 0.5`.
/// - f64: `1e-12 · (4 + √k)`; integer dtypes must match exactly.
pub fn tolerance(dtype: DType, k: usize) -> (f64, f64) {
    let growth = 4.0 + (k.max(1) as f64).sqrt();
    let f32_tol = 1e-6 * growth;
    match dtype {
        DType::F64 => (1e-12 * growth, 1e-12 * growth),
        DType::F32 => (f32_tol, f32_tol),
        DType::BF16 => (f32_tol, f32_tol + 2.0 * DType::BF16.epsilon()),
        DType::F16 => (
            f32_tol + 2f64.powi(-25),
            f32_tol + 4.0 * DType::F16.epsilon(),
        ),
        DType::F8E4M3 => (f32_tol + 2f64.powi(-10), f32_tol + DType::F8E4M3.epsilon()),
        DType::F8E5M2 => (f32_tol + 2f64.powi(-17), f32_tol + DType::F8E5M2.epsilon()),
        DType::I8 => (f32_tol + 0.5, f32_tol),
        DType::I32 | DType::I64 => (0.0, 0.0),
    }
}

/// Checks `len == expected` for the slice called `what` of op `op`.
pub(crate) fn check_len(op: &str, what: &str, len: usize, expected: usize) -> kpt_core::Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(kpt_core::KptError::shape(
            op,
            format!("{what} has {len} elements, expected {expected}"),
        ))
    }
}

/// Checks `[rows, dim]` tensors (`tensors`) and `[dim]` parameters (`params`).
pub(crate) fn check_rows(
    op: &str,
    tensors: &[(&str, usize)],
    params: &[(&str, usize)],
    rows: usize,
    dim: usize,
) -> kpt_core::Result<()> {
    let total = checked_product(op, "[rows, dim]", &[rows, dim])?;
    for &(name, len) in tensors {
        check_len(op, name, len, total)?;
    }
    for &(name, len) in params {
        check_len(op, name, len, dim)?;
    }
    Ok(())
}

/// Checks a fused residual add + norm: `x`, `residual`, `sum_out` and `norm_out` (their
/// lengths, in that order) are `[rows, dim]`, each of `params` is `[dim]`.
pub(crate) fn check_add_norm(
    op: &str,
    [x, residual, sum_out, norm_out]: [usize; 4],
    params: &[(&str, usize)],
    rows: usize,
    dim: usize,
) -> kpt_core::Result<()> {
    check_rows(
        op,
        &[
            ("x [rows, dim]", x),
            ("residual [rows, dim]", residual),
            ("sum_out [rows, dim]", sum_out),
            ("norm_out [rows, dim]", norm_out),
        ],
        params,
        rows,
        dim,
    )
}

/// Checks the slices of a linear layer: x `[m, k]`, w `[n, k]`, bias `[n]`, out `[m, n]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_linear(
    op: &str,
    x: usize,
    w: usize,
    bias: Option<usize>,
    out: usize,
    m: usize,
    k: usize,
    n: usize,
) -> kpt_core::Result<()> {
    check_len(op, "x [m, k]", x, checked_product(op, "[m, k]", &[m, k])?)?;
    check_len(op, "w [n, k]", w, checked_product(op, "[n, k]", &[n, k])?)?;
    if let Some(b) = bias {
        check_len(op, "bias [n]", b, n)?;
    }
    check_len(
        op,
        "out [m, n]",
        out,
        checked_product(op, "[m, n]", &[m, n])?,
    )
}

/// The product of `dims` (named in `desc` for the error), or a shape error on overflow.
pub(crate) fn checked_product(op: &str, desc: &str, dims: &[usize]) -> kpt_core::Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&p| p <= isize::MAX as usize)
        .ok_or_else(|| {
            kpt_core::KptError::shape(op, format!("{desc} = {dims:?} overflows the address space"))
        })
}

#[cfg(test)]
mod tests {
    use super::Act;

    /// erf by the everywhere-positive series `2/√π e^(-x²) Σ 2ⁿ x^(2n+1) / (2n+1)!!`.
    fn erf_series(x: f64) -> f64 {
        let (mut term, mut sum, mut n) = (x, x, 0.0);
        while term.abs() > 1e-18 * sum.abs() {
            n += 1.0;
            term *= 2.0 * x * x / (2.0 * n + 1.0);
            sum += term;
        }
        2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp() * sum
    }

    /// Exact GELU, `x Φ(x) = x (1 + erf(x / √2)) / 2`, in f64 and f32 against the series.
    #[test]
    fn gelu_erf_matches_the_erf_series() {
        for i in -6000..=6000 {
            let x = f64::from(i) * 1e-3;
            let want = 0.5 * x * (1.0 + erf_series(x * std::f64::consts::FRAC_1_SQRT_2));
            let got = Act::GeluErf.apply_f64(x);
            assert!(
                (got - want).abs() <= 1e-14 * x.abs().max(1.0),
                "f64 gelu({x})"
            );
            // f32: a few roundings, and that of x / √2 moves erfc's tail by ~x² of it.
            let got32 = f64::from(Act::GeluErf.apply_f32(x as f32));
            let want32 = Act::GeluErf.apply_f64(f64::from(x as f32));
            let tol = 3e-7 * (1.0 + x * x) * want32.abs() + 1e-30;
            assert!(
                (got32 - want32).abs() <= tol,
                "f32 gelu({x}): {got32:e} vs {want32:e}"
            );
        }
    }
}
