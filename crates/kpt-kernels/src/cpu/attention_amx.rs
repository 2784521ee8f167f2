//! bf16 attention on AMX tiles: the blocked online-softmax attention of
//! [`attention`](super::attention), with both products (`S = Q·Kᵀ` and `O += P·V`) as
//! `TDPBF16PS` tile products (bf16 inputs, f32 accumulation) and the softmax in f32.
//!
//! Per (batch, kv head), K and V are packed once into pair-interleaved B tiles
//! (`Kᵀ`: k = head_dim, n = keys; `V`: k = keys, n = head_dim). Each task scales its
//! query block, rounds it to bf16 and reads it in place as A tiles; after the softmax
//! the probabilities are rounded to bf16 (as in FlashAttention's bf16 kernels) and read
//! in place as A tiles of the `P·V` product, which accumulates into the f32 output
//! block. Query blocks, keys and head_dim are padded to multiples of 32.

use half::bf16;

use super::amx::{self, Tiles, TILE};
use super::attention::{balanced_block_q, normalize, online_softmax, scatter, Ctx, TaskRows};
use super::par::for_each_row;
use super::scratch::Scratch;
use super::shapes::AttentionShape;
use super::simd::{dispatch, exp_f32, f32_to_bf16_bits, f32_to_bf16_slice, Decode};

/// Tile edge of the products (rows, keys and head_dim are padded to it).
const T: usize = 32;

/// The tasks' shared state: K as Kᵀ tiles `[skv_pad / 16][d_pad / 32]` and V as tiles
/// `[d_pad / 16][skv_pad / 32]` per (batch, kv head), and how to load tiles.
struct AmxCtx<'a> {
    c: Ctx<'a, bf16, u16>,
    /// Loads this thread's tiles ([`Tiles::load`]; tests emulate them).
    tiles: fn() -> Option<Tiles>,
}

/// [`attention_bf16`](super::attention_bf16) on AMX tiles; the operands are validated by
/// the caller and [`amx::available`] is true. `block_q` / `block_kv` are rounded up to 32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    mask: Option<&[f32]>,
    out: &mut [bf16],
    s: &AttentionShape,
    block_q: usize,
    block_kv: usize,
) {
    attention_with(q, k, v, mask, out, s, block_q, block_kv, Tiles::load);
}

/// [`attention`] with the given way of loading tiles.
#[allow(clippy::too_many_arguments)]
fn attention_with(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    mask: Option<&[f32]>,
    out: &mut [bf16],
    s: &AttentionShape,
    block_q: usize,
    block_kv: usize,
    tiles: fn() -> Option<Tiles>,
) {
    let d = s.head_dim;
    if out.is_empty() {
        return;
    }
    let (skv_pad, d_pad) = (s.seq_kv.next_multiple_of(T), d.next_multiple_of(T));
    let kv_row = s.kv_row();
    let k_tiles = (skv_pad / 16) * (d_pad / T) * TILE;
    let v_tiles = (d_pad / 16) * (skv_pad / T) * TILE;
    let mut kp = Scratch::new(s.batch * s.num_kv_heads * k_tiles);
    let mut vp = Scratch::new(s.batch * s.num_kv_heads * v_tiles);
    // One rayon row per 16-key (K) / 16-column (V) panel of a (batch, kv head).
    let (k_panels, v_panels) = (skv_pad / 16, d_pad / 16);
    let kv_base = |bg: usize| (bg / s.num_kv_heads) * s.seq_kv * kv_row + (bg % s.num_kv_heads) * d;
    // K and V side by side: one wait for both instead of two in a row.
    rayon::join(
        || {
            for_each_row(&mut kp, k_tiles / k_panels, 16 * d, |i, dst| {
                let src = &k[kv_base(i / k_panels)..];
                amx::pack_bt_tiles(dst, i % k_panels, src, kv_row, d, s.seq_kv);
            })
        },
        || {
            for_each_row(&mut vp, v_tiles / v_panels, 16 * s.seq_kv, |i, dst| {
                let src = &v[kv_base(i / v_panels)..];
                amx::pack_b_tiles(dst, i % v_panels, src, kv_row, s.seq_kv, d);
            })
        },
    );

    let bq = balanced_block_q(s, block_q, rayon::current_num_threads(), T);
    let nqb = s.seq_q.div_ceil(bq);
    let ctx = AmxCtx {
        c: Ctx {
            s: *s,
            q,
            kp: &kp,
            vp: &vp,
            mask,
            scale: s.scale as f32,
            bq,
            bkv: block_kv.next_multiple_of(T),
            nqb,
            skv_pad,
            d_pad,
        },
        tiles,
    };
    // Every row that `scatter` reads is written by its task.
    let mut out_t = Scratch::new(s.batch * s.num_heads * nqb * bq * d);
    let task_cost = bq.saturating_mul(s.seq_kv.max(1)).saturating_mul(d);
    for_each_row(&mut out_t, bq * d, task_cost, |t, o| task_d(&ctx, t, o));
    scatter(&out_t, out, s, bq);
}

/// One task ([`Ctx::task_rows`]); writes `[rows, head_dim]` at the start of `out`. `_W`
/// only selects the instruction
/// set of the softmax code (see [`dispatch!`]).
#[inline(always)]
fn task<const _W: bool>(ctx: &AmxCtx<'_>, t: usize, out: &mut [f32]) {
    let c = &ctx.c;
    let s = &c.s;
    let (d, dp, bkv) = (s.head_dim, c.d_pad, c.bkv);
    let Some(TaskRows { b, h, g, i0, rows }) = c.task_rows(t) else {
        return;
    };
    let rows_pad = rows.next_multiple_of(T);
    let Some(tiles) = (ctx.tiles)() else {
        unreachable!("the AMX attention runs only where AMX is available")
    };

    // Scaled queries in bf16, [rows_pad][d_pad], zero-padded.
    let mut qb16 = Scratch::<u16>::new(rows_pad * dp);
    let mut qrow = Scratch::<f32>::new(d);
    for (r, dst) in qb16.chunks_exact_mut(dp).enumerate() {
        if r < rows {
            let src = &c.q[(b * s.seq_q + i0 + r) * s.q_row() + h * d..][..d];
            for (y, &x) in qrow.iter_mut().zip(src) {
                *y = x.decode() * c.scale;
            }
            f32_to_bf16_slice(&qrow, &mut dst[..d]);
            dst[d..].fill(0);
        } else {
            dst.fill(0);
        }
    }
    // Scores (every element read is written first), bf16 probabilities (rows never
    // written must read 0), the output accumulators.
    let mut st = Scratch::<f32>::new(rows_pad * bkv);
    let mut pb = Scratch::<u16>::new(rows_pad * bkv);
    pb.fill(0);
    let mut o = Scratch::<f32>::new(rows_pad * dp);
    o.fill(0.0);
    let mut m_run = vec![f32::NEG_INFINITY; rows];
    let mut l_run = vec![0f32; rows];

    let bg = b * s.num_kv_heads + g;
    let (dkt, skt) = (dp / T, c.skv_pad / T);
    let k_tiles = (c.skv_pad / 16) * dkt * TILE;
    let v_tiles = (dp / 16) * skt * TILE;
    let kp = &c.kp[bg * k_tiles..(bg + 1) * k_tiles];
    let vp = &c.vp[bg * v_tiles..(bg + 1) * v_tiles];
    let kv_end = s
        .key_limit(i0 + rows - 1)
        .next_multiple_of(T)
        .min(c.skv_pad);

    // From the first query's first visible key (a sliding window's start), in whole tiles.
    let mut j0 = s.key_start(i0) / T * T;
    while j0 < kv_end {
        let nk = bkv.min(kv_end - j0);
        for i in (0..rows_pad).step_by(T) {
            if dkt == 2 {
                // head_dim 33..=64: the query block's tiles stay loaded.
                let kt = &kp[j0 / 16 * dkt * TILE..];
                tiles.block_k64(&qb16[i * dp..], dp, kt, nk / 16, &mut st[i * bkv..], bkv);
                continue;
            }
            for j in (0..nk).step_by(T) {
                let kt = &kp[(j0 + j) / 16 * dkt * TILE..];
                let c_blk = &mut st[i * bkv + j..];
                tiles.block(&qb16[i * dp..], dp, kt, dkt * TILE, dkt, c_blk, bkv, false);
            }
        }
        let run = (&mut m_run[..], &mut l_run[..]);
        online_softmax(
            s,
            c.mask,
            &mut st,
            bkv,
            (i0, rows, rows_pad),
            (j0, nk),
            run,
            &mut o,
            dp,
            // Probabilities go to `pb` in bf16. Rows that stay 0 there: padded rows
            // (never written) and rows with no visible key yet (skipped).
            |r, row, m| exp_row_bf16(row, m, &mut pb[r * bkv..]),
        );
        for i in (0..rows_pad).step_by(T) {
            for dn in (0..dp).step_by(T) {
                let vt = &vp[(dn / 16 * skt + j0 / T) * TILE..];
                let o_blk = &mut o[i * dp + dn..];
                tiles.block(&pb[i * bkv..], bkv, vt, skt * TILE, nk / T, o_blk, dp, true);
            }
        }
        j0 += nk;
    }
    drop(tiles);
    normalize(out, &o, dp, d, &l_run);
}

dispatch!(fn task_d(c: &AmxCtx<'_>, t: usize, out: &mut [f32]) => task);

/// `p[j] = bf16(exp(x[j] - m))` for the row, returning `Σ exp(x[j] - m)` (before
/// rounding).
#[inline(always)]
fn exp_row_bf16(x: &[f32], m: f32, p: &mut [u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if zmm::available() {
        // SAFETY: the CPU has AVX-512F and AVX-512-BF16 (checked just above).
        return unsafe { zmm::exp_row_bf16(x, m, p) };
    }
    let mut sum = 0f32;
    for (y, &v) in p.iter_mut().zip(x) {
        let e = exp_f32(v - m);
        sum += e;
        *y = f32_to_bf16_bits(e);
    }
    sum
}

/// [`exp_row_bf16`] in AVX-512: `e^x = 2^n · 2^f` with `n = round(x·log2 e)`, a degree-4
/// polynomial for `2^f` on `[-1/2, 1/2]` (Chebyshev-node fit, relative error < 4e-6,
/// far below bf16's 2⁻⁹; the sum of the unrounded values keeps that accuracy) and
/// `vscalefps` for the `2^n` (exact, saturating to 0 and +inf), then `vcvtneps2bf16`
/// (round to nearest even).
#[cfg(target_arch = "x86_64")]
mod zmm {
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        super::super::simd::has_avx512() && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) fn exp_row_bf16(x: &[f32], m: f32, p: &mut [u16]) -> f32 {
        const C: [f32; 4] = [0.693_121, 0.240_223_5, 0.055_921_976, 0.009_666_368];
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let shift = _mm512_set1_ps(-m * std::f32::consts::LOG2_E);
        // e^(x - m) of 16 scores, rounded to bf16 into `pv`.
        let exp16 = |xv: &[f32], pv: &mut [u16]| {
            // SAFETY: `xv` holds 16 f32; the load is unaligned.
            let v = unsafe { _mm512_loadu_ps(xv.as_ptr()) };
            // (x - m)·log2 e as one FMA (x·log2 e - m·log2 e); clamped below so that -inf (a masked
            // key) gives 0, not inf - inf = NaN; `max(c, t)` keeps a NaN `t`.
            let t = _mm512_fmadd_ps(v, log2e, shift);
            let t = _mm512_max_ps(_mm512_set1_ps(-150.0), t);
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
            let f = _mm512_sub_ps(t, n);
            let mut q = _mm512_set1_ps(C[3]);
            for &c in C[..3].iter().rev() {
                q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(c));
            }
            q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0));
            let e = _mm512_scalef_ps(q, n);
            // SAFETY: both are 256-bit vectors; every bit pattern is a valid __m256i.
            let h = unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(e)) };
            debug_assert!(pv.len() >= 16);
            // SAFETY: every caller passes 16 u16 (32 bytes); the store is unaligned.
            unsafe { _mm256_storeu_si256(pv.as_mut_ptr().cast(), h) };
            e
        };
        // 32 scores a step into two sums, so that the additions are two chains.
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (pairs, _) = x.as_chunks::<32>();
        for (xv, pv) in pairs.iter().zip(p.chunks_exact_mut(32)) {
            let (p0, p1) = pv.split_at_mut(16);
            s0 = _mm512_add_ps(s0, exp16(&xv[..16], p0));
            s1 = _mm512_add_ps(s1, exp16(&xv[16..], p1));
        }
        let mut done = pairs.len() * 32;
        if x.len() - done >= 16 {
            s0 = _mm512_add_ps(s0, exp16(&x[done..done + 16], &mut p[done..done + 16]));
            done += 16;
        }
        let mut total = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        for (y, &v) in p[done..].iter_mut().zip(&x[done..]) {
            let e = super::exp_f32(v - m);
            total += e;
            *y = super::f32_to_bf16_bits(e);
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cpu::reference;
    use kpt_core::rand::SplitMix64;

    /// Probabilities in bf16 and their sum, for masked (-inf), tiny and ordinary scores,
    /// at lengths of whole 32-score steps, a lone 16-lane chunk, tails and short rows.
    #[test]
    fn exp_row_bf16_matches_exp() {
        let mut rng = SplitMix64::new(9);
        for len in [1, 5, 16, 17, 32, 37, 48, 64, 69, 256] {
            let mut x: Vec<f32> = (0..len).map(|_| rng.uniform(-30.0, 2.0)).collect();
            for at in [3, 20, len - 1] {
                if at < len {
                    x[at] = f32::NEG_INFINITY;
                }
            }
            if len > 10 {
                x[10] = -200.0;
            }
            let m = 2.5f32;
            let mut p = vec![0u16; len];
            let sum = exp_row_bf16(&x, m, &mut p);
            let mut want_sum = 0f64;
            for (i, (&v, &h)) in x.iter().zip(&p).enumerate() {
                let want = (f64::from(v) - f64::from(m)).exp();
                want_sum += want;
                let got = f64::from(bf16::from_bits(h).to_f32());
                assert!(
                    (got - want).abs() <= 4e-3 * want + 1e-30,
                    "{len} [{i}] {got} vs {want}"
                );
            }
            // The polynomial's relative error (< 4e-6) plus the f32 sums'.
            assert!(
                (f64::from(sum) - want_sum).abs() <= 5e-6 * want_sum + 1e-30,
                "{len}: {sum} vs {want_sum}"
            );
        }
    }

    /// The AMX attention's packing, blocking and softmax with emulated tile products
    /// (any CPU), against the f64 reference.
    #[test]
    fn emulated_tiles_match_reference() {
        let mut rng = SplitMix64::new(5);
        let shapes = [
            (AttentionShape::new(1, 1, 1, 1, 1, 1, false), 32, 32),
            (AttentionShape::new(2, 13, 37, 4, 2, 24, true), 32, 32),
            (AttentionShape::new(1, 70, 45, 2, 1, 64, false), 64, 32),
            (AttentionShape::new(1, 33, 300, 2, 2, 128, true), 64, 256),
            (AttentionShape::new(1, 40, 40, 4, 1, 40, false), 16, 50),
        ];
        for (shape, bq, bkv) in shapes {
            let gen = |rng: &mut SplitMix64, n: usize| -> Vec<bf16> {
                (0..n)
                    .map(|_| bf16::from_f32(rng.uniform(-1.0, 1.0)))
                    .collect()
            };
            let (q, k, v) = (
                gen(&mut rng, shape.q_len()),
                gen(&mut rng, shape.kv_len()),
                gen(&mut rng, shape.kv_len()),
            );
            let mask: Vec<f32> = (0..shape.mask_len())
                .map(|_| rng.uniform(-2.0, 0.5))
                .collect();
            let f64s = |x: &[bf16]| x.iter().map(|a| a.to_f64()).collect::<Vec<_>>();
            let mask64: Vec<f64> = mask.iter().map(|&a| f64::from(a)).collect();
            let mut want = vec![0f64; shape.q_len()];
            let (q64, k64, v64) = (f64s(&q), f64s(&k), f64s(&v));
            reference::attention(&q64, &k64, &v64, Some(&mask64), &mut want, &shape).unwrap();
            let mut got = vec![bf16::NAN; shape.q_len()];
            let load = Tiles::emulated;
            attention_with(&q, &k, &v, Some(&mask), &mut got, &shape, bq, bkv, load);
            for (i, (g, &w)) in got.iter().zip(&want).enumerate() {
                let tol = 2e-2 * w.abs().max(0.25);
                assert!((g.to_f64() - w).abs() <= tol, "{shape:?} [{i}]: {g} vs {w}");
            }
        }
    }
}
