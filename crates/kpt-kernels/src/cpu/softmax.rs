//! Softmax over the last axis in f32 (row max subtracted first; rows in parallel), and
//! the index of each row's maximum (greedy decoding).

use kpt_core::Result;

use super::par::for_each_row;
use super::simd::{dispatch, exp_f32_fma, hsum};
use super::{check_len, checked_product};

/// Maximum of `x` (`-inf` for an empty slice), 16 lanes.
#[inline(always)]
pub(crate) fn max16(x: &[f32]) -> f32 {
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
    let max = max16(x);
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
        // max16 skips NaNs (every comparison with one is false), so they are looked for
        // separately; the first element equal to the maximum is the lowest index.
        *o = if row.iter().any(|v| v.is_nan()) {
            -1
        } else {
            let max = max16(row);
            row.iter().position(|&v| v == max).unwrap_or(0) as i64
        };
    }
    Ok(())
}
