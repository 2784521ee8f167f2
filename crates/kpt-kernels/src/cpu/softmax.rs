//! Softmax over the last axis in f32 (row max subtracted first; rows in parallel), and
//! the index of each row's maximum (greedy decoding).

use kpt_core::Result;

use super::par::for_each_row;
use super::simd::{dispatch, exp_f32_fma, hsum};
use super::{check_len, checked_product};

/// Maximum of `x` (`-inf` for an empty slice), 16 lanes.
#[inline(always)]
fn max16(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..16 {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    // Halving steps (vector shuffles) instead of a chain of 16 dependent compares, paid
    // once per row (per key block of a row in attention).
    for w in [8, 4, 2, 1] {
        for j in 0..w {
            acc[j] = if acc[j + w] > acc[j] {
                acc[j + w]
            } else {
                acc[j]
            };
        }
    }
    let mut m = acc[0];
    for &v in tail {
        m = if v > m { v } else { m };
    }
    m
}

/// Maximum of `x` as [`max16`] gives it (NaNs skipped, `-inf` for an empty slice): with
/// AVX-512, four independent 16-lane accumulators, so that a row is not bound by the
/// latency of one chain of maxima (docs/decisions.md, "Softmax row passes"); otherwise
/// [`max16`].
#[inline(always)]
pub(crate) fn row_max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx512() {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { zmm::max_x4(x) };
    }
    max16(x)
}

#[cfg(target_arch = "x86_64")]
mod zmm {
    use std::arch::x86_64::*;

    /// [`row_max`](super::row_max) on AVX-512.
    #[target_feature(enable = "avx512f")]
    pub(super) fn max_x4(x: &[f32]) -> f32 {
        let mut acc = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
        let (wide, rest) = x.as_chunks::<64>();
        for c in wide {
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: 16 f32 of the 64-element chunk; the load is unaligned.
                let v = unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * i)) };
                // max(v, a) is `a` where `v` is NaN: NaNs are skipped, as in max16.
                *a = _mm512_max_ps(v, *a);
            }
        }
        let a = _mm512_max_ps(_mm512_max_ps(acc[0], acc[1]), _mm512_max_ps(acc[2], acc[3]));
        let (m, t) = (_mm512_reduce_max_ps(a), super::max16(rest));
        if t > m {
            t
        } else {
            m
        }
    }
}

/// `out = exp(x - shift)`, returning the sum of `out` (16 partial sums).
#[inline(always)]
pub(crate) fn exp_shift_sum<const FMA: bool>(x: &[f32], shift: f32, out: &mut [f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut xc = x.chunks_exact(16);
    let mut oc = out.chunks_exact_mut(16);
    for (c, o) in (&mut xc).zip(&mut oc) {
        for j in 0..16 {
            let e = exp_f32_fma::<FMA>(c[j] - shift);
            o[j] = e;
            acc[j] += e;
        }
    }
    let mut t = 0f32;
    for (&v, o) in xc.remainder().iter().zip(oc.into_remainder()) {
        *o = exp_f32_fma::<FMA>(v - shift);
        t += *o;
    }
    hsum(acc) + t
}

#[inline(always)]
fn softmax_row<const FMA: bool>(x: &[f32], out: &mut [f32]) {
    let max = row_max(x);
    if max == f32::NEG_INFINITY {
        out.fill(0.0);
        return;
    }
    let sum = exp_shift_sum::<FMA>(x, max, out);
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

dispatch!(fn softmax_row_d(x: &[f32], out: &mut [f32]) => softmax_row);

/// Softmax over the last axis of `x [rows, dim]`. A row of only `-inf` gives zeros
/// (like a fully masked attention row); NaN propagates.
pub fn softmax(x: &[f32], out: &mut [f32], rows: usize, dim: usize) -> Result<()> {
    const OP: &str = "softmax";
    let total = checked_product(OP, "[rows, dim]", &[rows, dim])?;
    check_len(OP, "x [rows, dim]", x.len(), total)?;
    check_len(OP, "out [rows, dim]", out.len(), total)?;
    for_each_row(out, dim, 16 * dim, |r, o| {
        softmax_row_d(&x[r * dim..(r + 1) * dim], o)
    });
    Ok(())
}

/// Index of the largest element of each row of `x [rows, dim]` into `out [rows]`: the
/// lowest index on ties, -1 for a row that holds a NaN (as [`super::reference::argmax`]).
pub fn argmax(x: &[f32], out: &mut [i64], rows: usize, dim: usize) -> Result<()> {
    const OP: &str = "argmax";
    let total = checked_product(OP, "[rows, dim]", &[rows, dim])?;
    check_len(OP, "x [rows, dim]", x.len(), total)?;
    check_len(OP, "out [rows]", out.len(), rows)?;
    if dim == 0 && rows > 0 {
        return Err(kpt_core::KptError::shape(
            OP,
            "rows of no element have no maximum",
        ));
    }
    for (o, row) in out.iter_mut().zip(x.chunks_exact(dim.max(1))) {
        // row_max skips NaNs (every comparison with one is false), so they are looked for
        // separately; the first element equal to the maximum is the lowest index.
        *o = if row.iter().any(|v| v.is_nan()) {
            -1
        } else {
            let max = row_max(row);
            row.iter().position(|&v| v == max).unwrap_or(0) as i64
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kpt_core::rand::SplitMix64;

    /// The row maximum of this CPU's path equals max16's at every length around the
    /// 64-element steps, with NaNs (skipped), -inf, and rows of only -inf.
    #[test]
    fn row_max_matches_max16() {
        let mut rng = SplitMix64::new(4);
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 128, 200, 256, 1000] {
            let mut x = rng.vec(len, -50.0, 50.0);
            assert_eq!(row_max(&x).to_bits(), max16(&x).to_bits(), "{len}");
            if len > 3 {
                x[len / 2] = f32::NAN;
                x[len - 1] = f32::NEG_INFINITY;
                assert_eq!(row_max(&x), max16(&x), "{len} with NaN");
                assert!(!row_max(&x).is_nan());
            }
            let inf = vec![f32::NEG_INFINITY; len];
            assert_eq!(row_max(&inf), f32::NEG_INFINITY, "{len} all -inf");
        }
    }
}
