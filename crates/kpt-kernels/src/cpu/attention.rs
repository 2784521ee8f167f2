//! Blocked ("flash") attention in f32 with GQA, additive mask and bottom-right causal
//! masking. Semantics are those of [`reference::attention`](super::reference::attention)
//! (see [`AttentionShape`]).
//!
//! Each rayon task owns one (batch, head, block of `block_q` queries). It walks the key
//! blocks with an online softmax (running max `m`, running sum `l`, accumulator rescaled
//! by `exp(m_old - m_new)`), so only a `block_q × block_kv` score tile ever exists. Key
//! blocks that causality masks for every query of the task are never visited.
//!
//! Before the tasks start, K is repacked per (batch, kv head) as `Kᵀ [head_dim, seq_kv]`
//! and V as `[seq_kv, head_dim]`, both zero-padded (keys to 16, head_dim to 8), so that
//! the two micro-kernels (`Q·Kᵀ`: 4 queries × 16 keys, `P·V`: 4 queries × 16 dims, 8
//! independent FMA accumulators each) run on full vectors without edge cases.

use kpt_core::{KptError, Result};

use super::par::for_each_row;
use super::shapes::AttentionShape;
use super::simd::{dispatch, exp_f32, fmadd, hsum};
use super::softmax::max16;

/// A good default query block (rows per task).
pub const DEFAULT_BLOCK_Q: usize = 64;
/// A good default key block (rounded up to a multiple of 16 internally).
pub const DEFAULT_BLOCK_KV: usize = 64;

/// Keys per `Q·Kᵀ` micro-kernel call (and key padding).
const KC: usize = 16;
/// Queries per micro-kernel call (and query-tile padding).
const QR: usize = 4;

/// Read-only state shared by the tasks.
struct Ctx<'a> {
    s: AttentionShape,
    q: &'a [f32],
    /// `Kᵀ` per (batch, kv head): `[head_dim, skv_pad]`.
    kt: &'a [f32],
    /// V per (batch, kv head): `[skv_pad, d_pad]`.
    vp: &'a [f32],
    mask: Option<&'a [f32]>,
    scale: f32,
    /// Queries per task.
    bq: usize,
    /// Keys per block (multiple of `KC`).
    bkv: usize,
    /// Query blocks per (batch, head).
    nqb: usize,
    skv_pad: usize,
    d_pad: usize,
}

/// Scores of 4 query rows (`q`, `[4, d]`) against keys `c0..c0+16` of `kt` (`[d, kts]`).
#[inline(always)]
fn qk_4x16<const FMA: bool>(
    q: &[f32],
    kt: &[f32],
    kts: usize,
    c0: usize,
    d: usize,
) -> [[f32; KC]; QR] {
    let mut acc = [[0f32; KC]; QR];
    let (q01, q23) = q.split_at(2 * d);
    let (q0, q1) = q01.split_at(d);
    let (q2, q3) = q23.split_at(d);
    let rows = kt[c0..].chunks(kts.max(1)).zip(q0).zip(q1).zip(q2).zip(q3);
    for ((((krow, &a), &b), &c), &e) in rows {
        let Some(kr) = krow.first_chunk::<KC>() else {
            break;
        };
        let qv = [a, b, c, e];
        for r in 0..QR {
            for j in 0..KC {
                acc[r][j] = fmadd::<FMA>(qv[r], kr[j], acc[r][j]);
            }
        }
    }
    acc
}

/// `o[r, d0..d0+W] += Σ_c p[r, c] · vp[j0 + c, d0..d0+W]` for 4 rows `r` (`p` rows are
/// `ps` apart, `o` and `vp` rows `dp` apart).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_4xw<const FMA: bool, const W: usize>(
    p: &[f32],
    ps: usize,
    vp: &[f32],
    dp: usize,
    j0: usize,
    nk: usize,
    d0: usize,
    o: &mut [f32],
) {
    let mut acc = [[0f32; W]; QR];
    for (r, a) in acc.iter_mut().enumerate() {
        a.copy_from_slice(&o[r * dp + d0..r * dp + d0 + W]);
    }
    let p0 = &p[..nk];
    let p1 = &p[ps..ps + nk];
    let p2 = &p[2 * ps..2 * ps + nk];
    let p3 = &p[3 * ps..3 * ps + nk];
    let rows = vp[j0 * dp + d0..]
        .chunks(dp)
        .zip(p0)
        .zip(p1)
        .zip(p2)
        .zip(p3);
    for ((((vrow, &a), &b), &c), &e) in rows {
        let Some(vr) = vrow.first_chunk::<W>() else {
            break;
        };
        let pv = [a, b, c, e];
        for r in 0..QR {
            for j in 0..W {
                acc[r][j] = fmadd::<FMA>(pv[r], vr[j], acc[r][j]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        o[r * dp + d0..r * dp + d0 + W].copy_from_slice(a);
    }
}

/// `x = exp(x - shift)` in place, returning the sum.
#[inline(always)]
fn exp_inplace_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for j in 0..16 {
            c[j] = exp_f32(c[j] - shift);
            acc[j] += c[j];
        }
    }
    let mut t = 0f32;
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - shift);
        t += *v;
    }
    hsum(acc) + t
}

/// One task: queries `qb*bq ..` of head `h` in batch `b` (`t = (b*H + h)*nqb + qb`);
/// writes `[rows, head_dim]` at the start of `out`.
#[inline(always)]
fn task<const FMA: bool>(c: &Ctx<'_>, t: usize, out: &mut [f32]) {
    let s = &c.s;
    let d = s.head_dim;
    let dp = c.d_pad;
    let bkv = c.bkv;
    let (bh, qb) = (t / c.nqb, t % c.nqb);
    let (b, h) = (bh / s.num_heads, bh % s.num_heads);
    let g = h / s.group_size();
    let i0 = qb * c.bq;
    if i0 >= s.seq_q {
        return;
    }
    let rows = c.bq.min(s.seq_q - i0);
    let rows_pad = rows.next_multiple_of(QR);

    // Scaled query tile, zero-padded to a multiple of 4 rows.
    let mut qt = vec![0f32; rows_pad * d];
    for r in 0..rows {
        let src = &c.q[(b * s.seq_q + i0 + r) * s.q_row() + h * d..][..d];
        for (dst, &v) in qt[r * d..(r + 1) * d].iter_mut().zip(src) {
            *dst = v * c.scale;
        }
    }
    let mut o = vec![0f32; rows_pad * dp];
    let mut st = vec![0f32; rows_pad * bkv];
    let mut m_run = vec![f32::NEG_INFINITY; rows];
    let mut l_run = vec![0f32; rows];

    let bg = b * s.num_kv_heads + g;
    let kt = &c.kt[bg * d * c.skv_pad..(bg + 1) * d * c.skv_pad];
    let vp = &c.vp[bg * c.skv_pad * dp..(bg + 1) * c.skv_pad * dp];
    // Keys visible to the last (most permissive) query of the task.
    let kv_end = s
        .key_limit(i0 + rows - 1)
        .next_multiple_of(KC)
        .min(c.skv_pad);

    let mut j0 = 0;
    while j0 < kv_end {
        let nk = bkv.min(kv_end - j0);
        // S = Q·Kᵀ for the tile.
        for r0 in (0..rows_pad).step_by(QR) {
            for c0 in (0..nk).step_by(KC) {
                let acc = qk_4x16::<FMA>(&qt[r0 * d..(r0 + QR) * d], kt, c.skv_pad, j0 + c0, d);
                for (r, a) in acc.iter().enumerate() {
                    st[(r0 + r) * bkv + c0..(r0 + r) * bkv + c0 + KC].copy_from_slice(a);
                }
            }
        }
        // Mask, online softmax, rescale the accumulator.
        for r in 0..rows_pad {
            let srow = &mut st[r * bkv..r * bkv + nk];
            if r >= rows {
                srow.fill(0.0);
                continue;
            }
            let i = i0 + r;
            let valid = s.key_limit(i).saturating_sub(j0).min(nk);
            if let Some(mask) = c.mask {
                let mrow = &mask[i * s.seq_kv + j0..i * s.seq_kv + j0 + valid];
                srow[..valid]
                    .iter_mut()
                    .zip(mrow)
                    .for_each(|(x, &a)| *x += a);
            }
            srow[valid..].fill(f32::NEG_INFINITY);
            let bm = max16(srow);
            let m_new = if bm > m_run[r] { bm } else { m_run[r] };
            if m_new == f32::NEG_INFINITY {
                srow.fill(0.0);
                continue;
            }
            let alpha = exp_f32(m_run[r] - m_new);
            let sum = exp_inplace_sum(srow, m_new);
            l_run[r] = l_run[r] * alpha + sum;
            m_run[r] = m_new;
            if alpha != 1.0 {
                o[r * dp..(r + 1) * dp].iter_mut().for_each(|x| *x *= alpha);
            }
        }
        // O += P·V.
        for r0 in (0..rows_pad).step_by(QR) {
            let p = &st[r0 * bkv..];
            let orows = &mut o[r0 * dp..(r0 + QR) * dp];
            let mut d0 = 0;
            while d0 + 16 <= dp {
                pv_4xw::<FMA, 16>(p, bkv, vp, dp, j0, nk, d0, orows);
                d0 += 16;
            }
            if d0 < dp {
                pv_4xw::<FMA, 8>(p, bkv, vp, dp, j0, nk, d0, orows);
            }
        }
        j0 += nk;
    }
    for r in 0..rows {
        let dst = &mut out[r * d..(r + 1) * d];
        if l_run[r] > 0.0 {
            let inv = 1.0 / l_run[r];
            for (x, &a) in dst.iter_mut().zip(&o[r * dp..r * dp + d]) {
                *x = a * inv;
            }
        } else {
            dst.fill(0.0);
        }
    }
}

dispatch!(fn task_d(c: &Ctx<'_>, t: usize, out: &mut [f32]) => task);

/// Blocked flash attention (see the module docs); `block_q` queries per task, keys in
/// blocks of `block_kv` (rounded up to 16). Same results as the reference up to f32
/// rounding. Errors on any length mismatch, a head count that does not group, or a
/// zero block size.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    out: &mut [f32],
    shape: &AttentionShape,
    block_q: usize,
    block_kv: usize,
) -> Result<()> {
    shape.check_buffers(
        "attention",
        q.len(),
        k.len(),
        v.len(),
        mask.map(<[f32]>::len),
        out.len(),
    )?;
    if block_q == 0 || block_kv == 0 {
        return Err(KptError::InvalidArgument(format!(
            "attention: block sizes must be positive, got block_q {block_q}, block_kv {block_kv}"
        )));
    }
    let s = *shape;
    let d = s.head_dim;
    if out.is_empty() {
        return Ok(());
    }
    let skv_pad = s.seq_kv.next_multiple_of(KC);
    let d_pad = d.next_multiple_of(8);
    let groups = s.batch * s.num_kv_heads;
    let kv_row = s.kv_row();

    // Repack K as Kᵀ and V with padded rows, per (batch, kv head).
    let mut kt = vec![0f32; groups * d * skv_pad];
    let mut vp = vec![0f32; groups * skv_pad * d_pad];
    let cost = s.seq_kv * d;
    for_each_row(&mut kt, d * skv_pad, cost, |bg, dst| {
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        for j in 0..s.seq_kv {
            let src = &k[(b * s.seq_kv + j) * kv_row + g * d..][..d];
            for (p, &x) in src.iter().enumerate() {
                dst[p * skv_pad + j] = x;
            }
        }
    });
    for_each_row(&mut vp, skv_pad * d_pad, cost, |bg, dst| {
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        for j in 0..s.seq_kv {
            let src = &v[(b * s.seq_kv + j) * kv_row + g * d..][..d];
            dst[j * d_pad..j * d_pad + d].copy_from_slice(src);
        }
    });

    let bq = block_q.min(s.seq_q.max(1));
    let nqb = s.seq_q.div_ceil(bq);
    let ctx = Ctx {
        s,
        q,
        kt: &kt,
        vp: &vp,
        mask,
        scale: s.scale as f32,
        bq,
        bkv: block_kv.next_multiple_of(KC),
        nqb,
        skv_pad,
        d_pad,
    };
    // Task outputs, [batch, heads, nqb * bq, head_dim] (query blocks padded).
    let mut out_t = vec![0f32; s.batch * s.num_heads * nqb * bq * d];
    let task_cost = bq
        .saturating_mul(s.seq_kv.max(1))
        .saturating_mul(d)
        .saturating_mul(4);
    for_each_row(&mut out_t, bq * d, task_cost, |t, o| task_d(&ctx, t, o));

    // Scatter into [batch, seq_q, heads * head_dim].
    let q_row = s.q_row();
    for_each_row(out, q_row, q_row, |bi, row| {
        let (b, i) = (bi / s.seq_q, bi % s.seq_q);
        for h in 0..s.num_heads {
            let src = &out_t[((b * s.num_heads + h) * nqb * bq + i) * d..][..d];
            row[h * d..(h + 1) * d].copy_from_slice(src);
        }
    });
    Ok(())
}
