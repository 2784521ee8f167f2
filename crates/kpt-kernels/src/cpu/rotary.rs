//! Rotary position embeddings (NeoX / LLaMA "rotate half" layout) in f32, alone and
//! fused with the q/k/v split of a merged projection.

use kpt_core::graph::{rope_frequencies, rope_seq_len, RopeScaling};
use kpt_core::Result;

use super::par::{for_each_row, for_each_row2};
use super::reference::{check_rotary, check_split_rotary};
use super::simd::{dispatch, fmadd};

#[inline(always)]
fn rotate_row<const FMA: bool>(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = cos.len();
    let (x0, x1) = x.split_at(half);
    let (o0, o1) = out.split_at_mut(half);
    for i in 0..half.min(x1.len()).min(o1.len()).min(sin.len()) {
        o0[i] = fmadd::<FMA>(x0[i], cos[i], -(x1[i] * sin[i]));
        o1[i] = fmadd::<FMA>(x1[i], cos[i], x0[i] * sin[i]);
    }
}

dispatch!(fn rotate_row_d(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) => rotate_row);

/// The f32 cos/sin table of `positions` (`positions.len() × head_dim/2` each), computed
/// in f64 from kpt-core's [`rope_frequencies`] and rounded once.
fn cos_sin(
    positions: &[i64],
    head_dim: usize,
    theta: f32,
    scaling: Option<&RopeScaling>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let half = head_dim / 2;
    let table = rope_frequencies(head_dim, f64::from(theta), scaling, rope_seq_len(positions))?;
    let (freqs, scale) = (&table.inv_freq, table.attention_factor);
    let mut cos = vec![0f32; positions.len() * half];
    let mut sin = vec![0f32; positions.len() * half];
    // The table costs ~30 ns an entry in f64: spread it over threads like the rows.
    for_each_row2(&mut cos, half, &mut sin, half, 32 * half, |s, c, sn| {
        let pos = positions[s] as f64;
        for ((c, sn), &f) in c.iter_mut().zip(sn.iter_mut()).zip(freqs) {
            let (si, co) = (pos * f).sin_cos();
            *c = (co * scale) as f32;
            *sn = (si * scale) as f32;
        }
    });
    Ok((cos, sin))
}

/// Rotates the heads of one part of every token: token `t`'s part starts at
/// `x[t * stride + offset]` and goes to `out[t * width..]` (`width` a multiple of
/// `head_dim`); token `t` takes table row `t % period`.
#[allow(clippy::too_many_arguments)]
fn rotate_part(
    x: &[f32],
    (stride, offset): (usize, usize),
    out: &mut [f32],
    width: usize,
    head_dim: usize,
    (cos, sin): (&[f32], &[f32]),
    period: usize,
) {
    let half = head_dim / 2;
    let heads = width / head_dim;
    if heads == 0 || period == 0 {
        return;
    }
    // One task row = one head of one token.
    for_each_row(out, head_dim, 3 * head_dim, |r, o| {
        let (t, h) = (r / heads, r % heads);
        let s = t % period;
        let tab = s * half..(s + 1) * half;
        let at = t * stride + offset + h * head_dim;
        rotate_row_d(&x[at..at + head_dim], &cos[tab.clone()], &sin[tab], o);
    });
}

/// Rotary embedding of `x [batch, seq, heads * head_dim]` at `positions`, either `[seq]`
/// (the same for every batch) or `[batch, seq]` (one per token): for
/// `i < head_dim/2`, `angle = pos · inv_freq[i]`,
/// `out[i] = x[i] cos - x[i+h/2] sin`, `out[i+h/2] = x[i+h/2] cos + x[i] sin`, with
/// `inv_freq` and the factor on cos/sin from kpt-core's [`rope_frequencies`] (`theta`
/// and `scaling`; dynamic NTK reads the largest position).
///
/// The cos/sin table (one row per position × head_dim/2) is computed once per call in
/// f64 and rounded to f32. `head_dim` must be even.
#[allow(clippy::too_many_arguments)]
pub fn rotary(
    x: &[f32],
    positions: &[i64],
    out: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    theta: f32,
    scaling: Option<&RopeScaling>,
) -> Result<()> {
    check_rotary(
        x.len(),
        positions.len(),
        out.len(),
        batch,
        seq,
        heads,
        head_dim,
    )?;
    if head_dim == 0 || x.is_empty() {
        return Ok(());
    }
    let (cos, sin) = cos_sin(positions, head_dim, theta, scaling)?;
    let width = heads * head_dim;
    rotate_part(
        x,
        (width, 0),
        out,
        width,
        head_dim,
        (&cos, &sin),
        positions.len(),
    );
    Ok(())
}

/// [`rotary`] fused with the split of a merged projection: `qkv [batch, seq, q + k + v]`
/// (`sizes = [q, k, v]`) at `positions` (`[seq]` or `[batch, seq]`) gives q (the first
/// `q` features of each token, rotated), k (the next `k`, rotated) and v (the last `v`,
/// copied), each `[batch, seq, width]`. One cos/sin table serves q and k.
#[allow(clippy::too_many_arguments)]
pub fn split_rotary(
    qkv: &[f32],
    positions: &[i64],
    (q, k, v): (&mut [f32], &mut [f32], &mut [f32]),
    batch: usize,
    seq: usize,
    sizes: [usize; 3],
    head_dim: usize,
    theta: f32,
    scaling: Option<&RopeScaling>,
) -> Result<()> {
    check_split_rotary(
        qkv.len(),
        positions.len(),
        [q.len(), k.len(), v.len()],
        batch,
        seq,
        sizes,
        head_dim,
    )?;
    if head_dim == 0 || qkv.is_empty() {
        return Ok(());
    }
    let (cos, sin) = cos_sin(positions, head_dim, theta, scaling)?;
    let [wq, wk, wv] = sizes;
    let stride = wq + wk + wv;
    let period = positions.len();
    rotate_part(qkv, (stride, 0), q, wq, head_dim, (&cos, &sin), period);
    rotate_part(qkv, (stride, wq), k, wk, head_dim, (&cos, &sin), period);
    if wv > 0 {
        for_each_row(v, wv, wv, |t, o| {
            let at = t * stride + wq + wk;
            o.copy_from_slice(&qkv[at..at + wv]);
        });
    }
    Ok(())
}
