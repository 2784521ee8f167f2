//! Rotary position embeddings (NeoX / LLaMA "rotate half" layout) in f32.

use kpt_core::graph::{rope_frequencies, rope_seq_len, RopeScaling};
use kpt_core::Result;

use super::par::{for_each_row, for_each_row2};
use super::reference::check_rotary;
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

/// Rotary embedding of `x [batch, seq, heads * head_dim]` at `positions [seq]` (the same
/// for every batch): for `i < head_dim/2`, `angle = pos · inv_freq[i]`,
/// `out[i] = x[i] cos - x[i+h/2] sin`, `out[i+h/2] = x[i+h/2] cos + x[i] sin`, with
/// `inv_freq` and the factor on cos/sin from kpt-core's [`rope_frequencies`] (`theta`
/// and `scaling`; dynamic NTK reads the largest position).
///
/// The cos/sin table (`seq × head_dim/2`) is computed once per call in f64 and rounded to
/// f32. `head_dim` must be even.
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
    let half = head_dim / 2;
    if half == 0 || x.is_empty() {
        return Ok(());
    }
    let table = rope_frequencies(head_dim, f64::from(theta), scaling, rope_seq_len(positions))?;
    let (freqs, scale) = (&table.inv_freq, table.attention_factor);
    let mut cos = vec![0f32; seq * half];
    let mut sin = vec![0f32; seq * half];
    // The table costs ~30 ns an entry in f64: spread it over threads like the rows.
    for_each_row2(&mut cos, half, &mut sin, half, 32 * half, |s, c, sn| {
        let pos = positions[s] as f64;
        for ((c, sn), &f) in c.iter_mut().zip(sn.iter_mut()).zip(freqs) {
            let (si, co) = (pos * f).sin_cos();
            *c = (co * scale) as f32;
            *sn = (si * scale) as f32;
        }
    });
    // One task row = one head of one token.
    for_each_row(out, head_dim, 3 * head_dim, |r, o| {
        let s = (r / heads) % seq;
        let tab = s * half..(s + 1) * half;
        rotate_row_d(
            &x[r * head_dim..(r + 1) * head_dim],
            &cos[tab.clone()],
            &sin[tab],
            o,
        );
    });
    Ok(())
}
