//! Row normalizations in f32: RMS norm, layer norm, and each fused with a residual add.
//!
//! Sums are accumulated in f32 with 16 independent partial sums (vectorized, and the
//! pairwise-like split keeps the error around `√(dim/16)` roundoffs instead of `dim`).
//! Layer norm uses two passes (mean, then the sum of squared deviations), which avoids
//! the cancellation of `E[x²] - E[x]²`. Rows are processed in parallel.

use kpt_core::Result;

use super::par::for_each_row;
use super::simd::{dispatch, fmadd, hsum};
use super::{check_add_norm, check_rows};

/// `Σ f(x_i)` with 16 partial sums.
#[inline(always)]
fn sum16(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..16 {
            acc[j] += f(c[j]);
        }
    }
    let mut t = 0f32;
    for &v in tail {
        t += f(v);
    }
    hsum(acc) + t
}

/// `Σ x_i²` with 16 partial sums (FMA when available).
#[inline(always)]
fn sum_sq<const FMA: bool>(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..16 {
            acc[j] = fmadd::<FMA>(c[j], c[j], acc[j]);
        }
    }
    let mut t = 0f32;
    for &v in tail {
        t = fmadd::<FMA>(v, v, t);
    }
    hsum(acc) + t
}

#[inline(always)]
fn rms_row<const FMA: bool>(x: &[f32], w: &[f32], out: &mut [f32], eps: f32) {
    let inv = 1.0 / (sum_sq::<FMA>(x) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

dispatch!(fn rms_row_d(x: &[f32], w: &[f32], out: &mut [f32], eps: f32) => rms_row);

#[inline(always)]
fn add_rms_row<const FMA: bool>(
    x: &[f32],
    r: &[f32],
    w: &[f32],
    sum: &mut [f32],
    out: &mut [f32],
    eps: f32,
) {
    for ((s, &a), &b) in sum.iter_mut().zip(x).zip(r) {
        *s = a + b;
    }
    rms_row::<FMA>(sum, w, out, eps);
}

dispatch!(
    fn add_rms_row_d(
        x: &[f32],
        r: &[f32],
        w: &[f32],
        sum: &mut [f32],
        out: &mut [f32],
        eps: f32,
    ) => add_rms_row
);

#[inline(always)]
fn layer_row<const FMA: bool>(x: &[f32], w: &[f32], b: &[f32], out: &mut [f32], eps: f32) {
    let n = x.len() as f32;
    let mean = sum16(x, |v| v) / n;
    let var = sum16(x, |v| (v - mean) * (v - mean)) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for (((o, &v), &g), &c) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = fmadd::<FMA>((v - mean) * inv, g, c);
    }
}

dispatch!(fn layer_row_d(x: &[f32], w: &[f32], b: &[f32], out: &mut [f32], eps: f32) => layer_row);

#[inline(always)]
fn add_layer_row<const FMA: bool>(
    x: &[f32],
    r: &[f32],
    w: &[f32],
    b: &[f32],
    sum: &mut [f32],
    out: &mut [f32],
    eps: f32,
) {
    for ((s, &a), &c) in sum.iter_mut().zip(x).zip(r) {
        *s = a + c;
    }
    layer_row::<FMA>(sum, w, b, out, eps);
}

dispatch!(
    fn add_layer_row_d(
        x: &[f32],
        r: &[f32],
        w: &[f32],
        b: &[f32],
        sum: &mut [f32],
        out: &mut [f32],
        eps: f32,
    ) => add_layer_row
);

/// RMS norm over the last axis of `x [rows, dim]`: `y = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    check_rows(
        "rms_norm",
        &[("x [rows, dim]", x.len()), ("out [rows, dim]", out.len())],
        &[("w [dim]", w.len())],
        rows,
        dim,
    )?;
    for_each_row(out, dim, 3 * dim, |r, o| {
        rms_row_d(&x[r * dim..(r + 1) * dim], w, o, eps)
    });
    Ok(())
}

/// Layer norm over the last axis: `y = (x - mean) / sqrt(var + eps) * w + b`, with the
/// biased variance (as PyTorch).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    out: &mut [f32],
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    check_rows(
        "layer_norm",
        &[("x [rows, dim]", x.len()), ("out [rows, dim]", out.len())],
        &[("w [dim]", w.len()), ("b [dim]", b.len())],
        rows,
        dim,
    )?;
    for_each_row(out, dim, 4 * dim, |r, o| {
        layer_row_d(&x[r * dim..(r + 1) * dim], w, b, o, eps)
    });
    Ok(())
}

/// Fused residual add and RMS norm: `sum_out = x + residual` (rounded to f32), then
/// `norm_out = rms_norm(sum_out, w)`, in one pass over each row.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    x: &[f32],
    residual: &[f32],
    w: &[f32],
    sum_out: &mut [f32],
    norm_out: &mut [f32],
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    check_add_norm(
        "add_rms_norm",
        [x.len(), residual.len(), sum_out.len(), norm_out.len()],
        &[("w [dim]", w.len())],
        rows,
        dim,
    )?;
    super::par::for_each_row2(sum_out, dim, norm_out, dim, 4 * dim, |r, s, o| {
        let range = r * dim..(r + 1) * dim;
        add_rms_row_d(&x[range.clone()], &residual[range], w, s, o, eps);
    });
    Ok(())
}

/// Fused residual add and layer norm: `sum_out = x + residual` (rounded to f32), then
/// `norm_out = layer_norm(sum_out, w, b)`, in one pass over each row.
#[allow(clippy::too_many_arguments)]
pub fn add_layer_norm(
    x: &[f32],
    residual: &[f32],
    w: &[f32],
    b: &[f32],
    sum_out: &mut [f32],
    norm_out: &mut [f32],
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    check_add_norm(
        "add_layer_norm",
        [x.len(), residual.len(), sum_out.len(), norm_out.len()],
        &[("w [dim]", w.len()), ("b [dim]", b.len())],
        rows,
        dim,
    )?;
    super::par::for_each_row2(sum_out, dim, norm_out, dim, 5 * dim, |r, s, o| {
        let range = r * dim..(r + 1) * dim;
        add_layer_row_d(&x[range.clone()], &residual[range], w, b, s, o, eps);
    });
    Ok(())
}
