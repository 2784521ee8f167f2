//! Attention gradients in f32 (the backward pass of [`attention`](fn@super::attention)): tasks of one
//! (batch, kv head) in parallel, each recomputing its query heads' probabilities row by
//! row (as `exp(s - lse)` when the forward's log-sum-exp is given, else with the row's
//! max and sum) and accumulating `dk` and `dv` of its kv head privately, so no two tasks
//! write the same element. Same formulas as the f64 reference
//! ([`super::reference::attention_backward`]). [`attention_lse`] gives the log-sum-exp
//! that the forward pass hands to the backward.

use kpt_core::Result;
use rayon::prelude::*;

use super::shapes::AttentionShape;
use super::simd::exp_f32;

/// The log-sum-exp of every softmax row of attention over `q`, `k` (optional additive
/// mask) into `lse` (`[batch, num_heads, seq_q]`, natural log, `+inf` for a row that sees
/// no key), as [`super::reference::attention_lse`] gives it: one pass over the scores per
/// row (its max, then the sum of `exp(s - max)`), rows of one (batch, head) per task.
pub fn attention_lse(
    q: &[f32],
    k: &[f32],
    mask: Option<&[f32]>,
    lse: &mut [f32],
    shape: &AttentionShape,
) -> Result<()> {
    let s = *shape;
    // k stands in for v, which this pass does not read (same length).
    s.check_buffers(
        "attention",
        q.len(),
        k.len(),
        k.len(),
        mask.map(<[f32]>::len),
        q.len(),
    )?;
    s.check_lse("attention", lse.len())?;
    let (d, group) = (s.head_dim, s.group_size());
    let (q_row, kv_row) = (s.q_row(), s.kv_row());
    let scale = s.scale as f32;
    let rows = s.seq_q.max(1);
    lse.par_chunks_mut(rows).enumerate().for_each(|(bh, out)| {
        let (b, h) = (bh / s.num_heads, bh % s.num_heads);
        let g = h / group;
        let mut sc = vec![0f32; s.seq_kv];
        for (i, l) in out.iter_mut().enumerate() {
            let qi = &q[(b * s.seq_q + i) * q_row + h * d..][..d];
            let (start, limit) = (s.key_start(i), s.key_limit(i));
            let mut max = f32::NEG_INFINITY;
            for j in start..limit {
                let kj = &k[(b * s.seq_kv + j) * kv_row + g * d..][..d];
                let dot: f32 = qi.iter().zip(kj).map(|(a, c)| a * c).sum();
                sc[j] = dot * scale + mask.map_or(0.0, |m| m[i * s.seq_kv + j]);
                max = max.max(sc[j]);
            }
            *l = if max == f32::NEG_INFINITY {
                f32::INFINITY
            } else {
                let sum: f32 = sc[start..limit].iter().map(|&x| exp_f32(x - max)).sum();
                if sum > 0.0 {
                    max + sum.ln()
                } else {
                    f32::INFINITY
                }
            };
        }
    });
    Ok(())
}

/// Gradients `(dq, dk, dv)` of attention over `q`, `k`, `v` (optional additive mask) for the
/// forward output `out` and its gradient `dout`; layouts as [`AttentionShape`] says. With
/// `lse` (the forward's log-sum-exp, `[batch, num_heads, seq_q]`, see [`attention_lse`]) the
/// probabilities are `exp(s - lse)` and the row's max and sum are not recomputed.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    (out, dout, lse): (&[f32], &[f32], Option<&[f32]>),
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
    if let Some(l) = lse {
        s.check_lse("attention_backward", l.len())?;
    }
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
            // Dropout factors of a row (all 1 without dropout).
            let mut z = vec![1f32; s.seq_kv];
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
                    // Probabilities exp(s - base) / sum: with the given log-sum-exp,
                    // base = lse and sum = 1; else the row's max and sum.
                    let base = lse.map_or(max, |l| l[(b * s.num_heads + h) * s.seq_q + i]);
                    if base == f32::INFINITY {
                        continue;
                    }
                    let mut total = 0f32;
                    for x in &mut p[start..limit] {
                        *x = exp_f32(*x - base);
                        total += *x;
                    }
                    let sum = if lse.is_some() { 1.0 } else { total };
                    let delta: f32 = doi.iter().zip(oi).map(|(a, c)| a * c).sum();
                    let dqi = &mut tq[(i * group + hh) * d..][..d];
                    if s.dropout.is_some() {
                        z[start..limit].fill(1.0);
                        s.apply_dropout((b, h, i), start, &mut z[start..limit], 1);
                    }
                    for j in start..limit {
                        let pj = p[j] / sum;
                        if pj == 0.0 {
                            continue;
                        }
                        let (kj, vj) = (&k[key(j)..key(j) + d], &v[key(j)..key(j) + d]);
                        // Dropout: out = Σ P Z v, so dv takes P Z and dP = Z (dout · v).
                        let dp: f32 = z[j] * doi.iter().zip(vj).map(|(a, c)| a * c).sum::<f32>();
                        let ds = pj * (dp - delta) * scale;
                        let (dkj, dvj) = (&mut tk[j * d..(j + 1) * d], &mut tv[j * d..(j + 1) * d]);
                        let pz = pj * z[j];
                        for c in 0..d {
                            dvj[c] += pz * doi[c];
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
