//! Attention gradients in f32 (the backward pass of [`super::attention`]): tasks of one
//! (batch, kv head) in parallel, each recomputing its query heads' probabilities row by
//! row and accumulating `dk` and `dv` of its kv head privately, so no two tasks write the
//! same element. Same formulas as the f64 reference
//! ([`super::reference::attention_backward`]).

use kpt_core::Result;
use rayon::prelude::*;

use super::shapes::AttentionShape;
use super::simd::exp_f32;

/// Gradients `(dq, dk, dv)` of attention over `q`, `k`, `v` (optional additive mask) for the
/// forward output `out` and its gradient `dout`; layouts as [`AttentionShape`] says.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    out: &[f32],
    dout: &[f32],
    grads: (&mut [f32], &mut [f32], &mut [f32]),
    shape: &AttentionShape,
) -> Result<()> {
    let s = *shape;
    let (dq, dk, dv) = grads;
    s.check_backward_buffers(
        "attention_backward",
        (q.len(), k.len(), v.len(), mask.map(<[f32]>::len), out.len()),
        (dout.len(), dq.len(), dk.len(), dv.len()),
    )?;
    let (d, group) = (s.head_dim, s.group_size());
    let (q_row, kv_row) = (s.q_row(), s.kv_row());
    let scale = s.scale as f32;
    // Per (batch, kv head): dq of its query heads [seq_q][group][d], dk and dv [seq_kv][d].
    let tasks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..s.batch * s.num_kv_heads)
        .into_par_iter()
        .map(|bg| {
            let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
            let mut tq = vec![0f32; s.seq_q * group * d];
            let (mut tk, mut tv) = (vec![0f32; s.seq_kv * d], vec![0f32; s.seq_kv * d]);
            let mut p = vec![0f32; s.seq_kv];
            let key = |j: usize| (b * s.seq_kv + j) * kv_row + g * d;
            for hh in 0..group {
                let h = g * group + hh;
                for i in 0..s.seq_q {
                    let at = (b * s.seq_q + i) * q_row + h * d;
                    let (qi, oi, doi) = (&q[at..at + d], &out[at..at + d], &dout[at..at + d]);
                    let (start, limit) = (s.key_start(i), s.key_limit(i));
                    let mut max = f32::NEG_INFINITY;
                    for j in start..limit {
                        let dot: f32 = qi
                            .iter()
                            .zip(&k[key(j)..key(j) + d])
                            .map(|(a, c)| a * c)
                            .sum();
                        p[j] = dot * scale + mask.map_or(0.0, |m| m[i * s.seq_kv + j]);
                        max = max.max(p[j]);
                    }
                    if max == f32::NEG_INFINITY {
                        continue;
                    }
                    let mut sum = 0f32;
                    for x in &mut p[start..limit] {
                        *x = exp_f32(*x - max);
                        sum += *x;
                    }
                    let delta: f32 = doi.iter().zip(oi).map(|(a, c)| a * c).sum();
                    let dqi = &mut tq[(i * group + hh) * d..][..d];
                    for j in start..limit {
                        let pj = p[j] / sum;
                        if pj == 0.0 {
                            continue;
                        }
                        let (kj, vj) = (&k[key(j)..key(j) + d], &v[key(j)..key(j) + d]);
                        let dp: f32 = doi.iter().zip(vj).map(|(a, c)| a * c).sum();
                        let ds = pj * (dp - delta) * scale;
                        let (dkj, dvj) = (&mut tk[j * d..(j + 1) * d], &mut tv[j * d..(j + 1) * d]);
                        for c in 0..d {
                            dvj[c] += pj * doi[c];
                            dqi[c] += ds * kj[c];
                            dkj[c] += ds * qi[c];
                        }
                    }
                }
            }
            (tq, tk, tv)
        })
        .collect();
    for (bg, (tq, tk, tv)) in tasks.into_iter().enumerate() {
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        for i in 0..s.seq_q {
            for hh in 0..group {
                let at = (b * s.seq_q + i) * q_row + (g * group + hh) * d;
                dq[at..at + d].copy_from_slice(&tq[(i * group + hh) * d..][..d]);
            }
        }
        for j in 0..s.seq_kv {
            let at = (b * s.seq_kv + j) * kv_row + g * d;
            dk[at..at + d].copy_from_slice(&tk[j * d..(j + 1) * d]);
            dv[at..at + d].copy_from_slice(&tv[j * d..(j + 1) * d]);
        }
    }
    Ok(())
}
