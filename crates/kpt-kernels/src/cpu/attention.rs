//! Blocked ("flash") attention in f32 with GQA, additive mask and bottom-right causal
//! masking. Semantics are those of [`reference::attention`](super::reference::attention)
//! (see [`AttentionShape`]).
//!
//! Each rayon task owns one (batch, head, block of `block_q` queries). It walks the key
//! blocks with an online softmax (running max `m`, running sum `l`, accumulator rescaled
//! by `exp(m_old - m_new)`), so only a `block_q × block_kv` score tile ever exists. Key
//! blocks that causality masks for every query of the task are never visited.
//!
//! Before the tasks start, K and V are repacked per (batch, kv head) into 16-wide panels,
//! as a GEMM packs its operands: K as `[seq_kv / 16][head_dim][16]` (16 keys side by side
//! for each dimension) and V as `[head_dim / 16][seq_kv][16]` (16 dimensions for each
//! key), zero-padded (keys and head_dim to multiples of 16). Each micro-kernel
//! (`Q·Kᵀ`: QR queries × 16 keys, `P·V`: QR queries × 16 dims; QR = 6 on AVX2 (12 ymm
//! accumulators), 8 on AVX-512 (8 zmm), 4 portable) then streams one contiguous
//! panel, with Q packed QR-wide (`[d][QR]`). (A plain `Kᵀ [head_dim, seq_kv]`
//! layout strides by `seq_kv` floats, a power of two for usual lengths, and thrashes
//! the L1 sets: attention ran at half the speed.)

use half::bf16;
use kpt_core::{DType, KptError, Result};

use super::par::for_each_row;
use super::scratch::Scratch;
use super::shapes::AttentionShape;
use super::simd::{dispatch, exp_f32_fma, hsum, Decode, Encode};
use super::softmax::max16;
use super::{amx, attention_amx};

/// A good default query block (rows per task).
pub const DEFAULT_BLOCK_Q: usize = 64;
/// A good default key block (rounded up to a multiple of 16 internally).
pub const DEFAULT_BLOCK_KV: usize = 256;

/// Keys per `Q·Kᵀ` micro-kernel call (and key padding).
const KC: usize = 16;

/// Read-only state shared by the tasks of one call: queries of type `Q`, K and V
/// packed as `P` (f32 panels here, bf16 tiles in the AMX path).
pub(super) struct Ctx<'a, Q, P> {
    pub(super) s: AttentionShape,
    pub(super) q: &'a [Q],
    /// Packed K per (batch, kv head).
    pub(super) kp: &'a [P],
    /// Packed V per (batch, kv head).
    pub(super) vp: &'a [P],
    pub(super) mask: Option<&'a [f32]>,
    pub(super) scale: f32,
    /// Queries per task.
    pub(super) bq: usize,
    /// Keys per block.
    pub(super) bkv: usize,
    /// Query blocks per (batch, head).
    pub(super) nqb: usize,
    pub(super) skv_pad: usize,
    pub(super) d_pad: usize,
}

/// The queries of one task.
pub(super) struct TaskRows {
    /// Batch.
    pub(super) b: usize,
    /// Query head.
    pub(super) h: usize,
    /// Its kv head.
    pub(super) g: usize,
    /// First query.
    pub(super) i0: usize,
    /// Queries in the task.
    pub(super) rows: usize,
}

impl<Q, P> Ctx<'_, Q, P> {
    /// Task `t = (b·H + h)·nqb + qb`: queries `qb·bq ..` of head `h` in batch `b`
    /// (`None` for a block past the last query).
    pub(super) fn task_rows(&self, t: usize) -> Option<TaskRows> {
        let s = &self.s;
        let (bh, qb) = (t / self.nqb, t % self.nqb);
        let (b, h) = (bh / s.num_heads, bh % s.num_heads);
        let i0 = qb * self.bq;
        (i0 < s.seq_q).then(|| TaskRows {
            b,
            h,
            g: h / s.group_size(),
            i0,
            rows: self.bq.min(s.seq_q - i0),
        })
    }
}

/// Scores of `QR` query rows (`qg`, packed `[d][QR]`) against the 16 keys of one K
/// panel (`kp`, `[d][16]`).
#[inline(always)]
fn qk_tile<const QR: usize>(qg: &[f32], kp: &[f32]) -> [[f32; KC]; QR] {
    let mut acc = [[0f32; KC]; QR];
    let (qs, _) = qg.as_chunks::<QR>();
    let (ks, _) = kp.as_chunks::<KC>();
    for (qv, kr) in qs.iter().zip(ks) {
        for r in 0..QR {
            for j in 0..KC {
                acc[r][j] += qv[r] * kr[j];
            }
        }
    }
    acc
}

/// `o[r, 0..16] += Σ_c p[r, c] · vp[c, 0..16]` for `QR` rows `r` over `nk` keys (`p`
/// rows are `ps` apart, `o` rows `dp` apart; `vp` is a V panel from the block's first
/// key).
#[inline(always)]
fn pv_tile<const QR: usize>(p: &[f32], ps: usize, vp: &[f32], nk: usize, dp: usize, o: &mut [f32]) {
    let mut acc = [[0f32; KC]; QR];
    for (r, a) in acc.iter_mut().enumerate() {
        a.copy_from_slice(&o[r * dp..r * dp + KC]);
    }
    let prow: [&[f32]; QR] = std::array::from_fn(|r| &p[r * ps..r * ps + nk]);
    let (vs, _) = vp[..nk * KC].as_chunks::<KC>();
    for (c, vr) in vs.iter().enumerate() {
        for r in 0..QR {
            for j in 0..KC {
                acc[r][j] += prow[r][c] * vr[j];
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        o[r * dp..r * dp + KC].copy_from_slice(a);
    }
}

/// The two micro-kernels of a task, `QR` query rows per call.
trait Tile {
    /// Query rows per call (and query-tile padding).
    const QR: usize;
    /// `st[r * ss..][..16] = Σ_p qg[p * QR + r] · kp[p * 16..][..16]` for each row `r`
    /// (see [`qk_tile`]).
    fn qk(qg: &[f32], kp: &[f32], st: &mut [f32], ss: usize);
    /// See [`pv_tile`].
    fn pv(p: &[f32], ps: usize, vp: &[f32], nk: usize, dp: usize, o: &mut [f32]);
    /// `x = exp(x - shift)`, returning the sum ([`exp_inplace_sum`]).
    fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
        exp_inplace_sum::<false>(x, shift)
    }
}

/// 4 rows of 16 f32 accumulators in portable code (CPUs without AVX2 + FMA).
struct Rows4;

impl Tile for Rows4 {
    const QR: usize = 4;

    #[inline(always)]
    fn qk(qg: &[f32], kp: &[f32], st: &mut [f32], ss: usize) {
        for (r, a) in qk_tile::<4>(qg, kp).iter().enumerate() {
            st[r * ss..r * ss + KC].copy_from_slice(a);
        }
    }

    #[inline(always)]
    fn pv(p: &[f32], ps: usize, vp: &[f32], nk: usize, dp: usize, o: &mut [f32]) {
        pv_tile::<4>(p, ps, vp, nk, dp, o);
    }
}

/// Defines the tile type `$name<QR>` that runs the explicit-SIMD micro-kernels of module
/// `$module` where `$has()` says the CPU can, portable code otherwise.
macro_rules! simd_rows {
    ($(#[$doc:meta])* $name:ident, $has:ident, $module:ident) => {
        $(#[$doc])*
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        struct $name<const QR: usize>;

        impl<const QR: usize> Tile for $name<QR> {
            const QR: usize = QR;

            #[inline(always)]
            fn qk(qg: &[f32], kp: &[f32], st: &mut [f32], ss: usize) {
                #[cfg(target_arch = "x86_64")]
                if super::simd::$has() {
                    // SAFETY: the CPU has the module's instruction set (checked above).
                    return unsafe { $module::qk::<QR>(qg, kp, st, ss) };
                }
                for (r, a) in qk_tile::<QR>(qg, kp).iter().enumerate() {
                    st[r * ss..r * ss + KC].copy_from_slice(a);
                }
            }

            #[inline(always)]
            fn pv(p: &[f32], ps: usize, vp: &[f32], nk: usize, dp: usize, o: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                if super::simd::$has() {
                    // SAFETY: the CPU has the module's instruction set (checked above).
                    return unsafe { $module::pv::<QR>(p, ps, vp, nk, dp, o) };
                }
                pv_tile::<QR>(p, ps, vp, nk, dp, o);
            }

            /// Only dispatched where the CPU has FMA, so `mul_add` is one instruction.
            #[inline(always)]
            fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
                exp_inplace_sum::<true>(x, shift)
            }
        }
    };
}

simd_rows!(
    /// `QR` rows in explicit AVX-512 intrinsics, one zmm accumulator per row (LLVM's
    /// auto-vectorizer spreads generic many-row loops across rows and ran 10x slower).
    RowsZmm,
    has_avx512,
    zmm
);
simd_rows!(
    /// `QR` rows in explicit AVX2 + FMA intrinsics, two ymm accumulators per row.
    RowsYmm,
    has_avx2_fma,
    ymm
);

/// Generates the `qk` / `pv` micro-kernels (contracts of [`qk_tile`] / [`pv_tile`]) in
/// one instruction set: `$v` vector type holding `$lanes` f32, `$n = 16 / $lanes`
/// vectors per row.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_tiles {
    ($feature:literal, $v:ty, $lanes:literal, $n:literal,
     $zero:ident, $load:ident, $store:ident, $set1:ident, $fma:ident) => {
        use std::arch::x86_64::*;

        use super::KC;

        /// Loads the `$n` vectors of 16 f32 at the start of `x` (panics if shorter).
        #[inline]
        #[target_feature(enable = $feature)]
        fn load(x: &[f32]) -> [$v; $n] {
            let x = &x[..KC];
            // SAFETY: `x` holds 16 f32; unaligned loads.
            std::array::from_fn(|i| unsafe { $load(x[i * $lanes..].as_ptr()) })
        }

        /// Stores 16 f32 at the start of `x` (panics if shorter).
        #[inline]
        #[target_feature(enable = $feature)]
        fn store(x: &mut [f32], v: [$v; $n]) {
            let x = &mut x[..KC];
            for (i, v) in v.into_iter().enumerate() {
                // SAFETY: `x` holds 16 f32; unaligned stores.
                unsafe { $store(x[i * $lanes..].as_mut_ptr(), v) }
            }
        }

        #[target_feature(enable = $feature)]
        pub(super) fn qk<const QR: usize>(qg: &[f32], kp: &[f32], st: &mut [f32], ss: usize) {
            let mut acc = [[$zero(); $n]; QR];
            let (qs, _) = qg.as_chunks::<QR>();
            for (qv, kr) in qs.iter().zip(kp.chunks_exact(KC)) {
                let k = load(kr);
                for (a, &q) in acc.iter_mut().zip(qv) {
                    let x = $set1(q);
                    for i in 0..$n {
                        a[i] = $fma(x, k[i], a[i]);
                    }
                }
            }
            for (r, &a) in acc.iter().enumerate() {
                store(&mut st[r * ss..], a);
            }
        }

        #[target_feature(enable = $feature)]
        pub(super) fn pv<const QR: usize>(
            p: &[f32],
            ps: usize,
            vp: &[f32],
            nk: usize,
            dp: usize,
            o: &mut [f32],
        ) {
            let mut acc: [[$v; $n]; QR] = std::array::from_fn(|r| load(&o[r * dp..]));
            let prow: [&[f32]; QR] = std::array::from_fn(|r| &p[r * ps..r * ps + nk]);
            for (c, vr) in vp[..nk * KC].chunks_exact(KC).enumerate() {
                let v = load(vr);
                for (a, row) in acc.iter_mut().zip(&prow) {
                    let x = $set1(row[c]);
                    for i in 0..$n {
                        a[i] = $fma(x, v[i], a[i]);
                    }
                }
            }
            for (r, &a) in acc.iter().enumerate() {
                store(&mut o[r * dp..], a);
            }
        }
    };
}

/// The AVX-512 micro-kernels.
#[cfg(target_arch = "x86_64")]
mod zmm {
    simd_tiles!(
        "avx512f",
        __m512,
        16,
        1,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps
    );
}

/// The AVX2 + FMA micro-kernels.
#[cfg(target_arch = "x86_64")]
mod ymm {
    simd_tiles!(
        "avx2,fma",
        __m256,
        8,
        2,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps
    );
}

/// `x = exp(x - shift)` in place, returning the sum (exp in FMAs when `FMA`).
#[inline(always)]
fn exp_inplace_sum<const FMA: bool>(x: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for j in 0..16 {
            c[j] = exp_f32_fma::<FMA>(c[j] - shift);
            acc[j] += c[j];
        }
    }
    let mut t = 0f32;
    for v in chunks.into_remainder() {
        *v = exp_f32_fma::<FMA>(*v - shift);
        t += *v;
    }
    hsum(acc) + t
}

/// One key block of the online softmax on the score tile `st` (rows `bkv` apart):
/// adds the mask, masks keys beyond each query's limit, updates the running max `m`
/// and sum `l`, has `exp_sum(r, row, m)` turn row `r` into probabilities `exp(s - m)`
/// (in place or elsewhere) and return their sum, and rescales the rows of the
/// accumulator `o` (rows `dp` apart). `rows` = (first query, real rows, padded rows;
/// padded rows become 0 in `st`), `keys` = (first key, keys in the block).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn online_softmax(
    s: &AttentionShape,
    mask: Option<&[f32]>,
    st: &mut [f32],
    bkv: usize,
    (i0, rows, rows_pad): (usize, usize, usize),
    (j0, nk): (usize, usize),
    (m_run, l_run): (&mut [f32], &mut [f32]),
    o: &mut [f32],
    dp: usize,
    mut exp_sum: impl FnMut(usize, &mut [f32], f32) -> f32,
) {
    for r in 0..rows_pad {
        let srow = &mut st[r * bkv..r * bkv + nk];
        if r >= rows {
            srow.fill(0.0);
            continue;
        }
        let i = i0 + r;
        let valid = s.key_limit(i).saturating_sub(j0).min(nk);
        if let Some(mask) = mask {
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
        let alpha = exp_f32_fma::<false>(m_run[r] - m_new);
        let sum = exp_sum(r, srow, m_new);
        l_run[r] = l_run[r] * alpha + sum;
        m_run[r] = m_new;
        if alpha != 1.0 {
            o[r * dp..(r + 1) * dp].iter_mut().for_each(|x| *x *= alpha);
        }
    }
}

/// `out[r, ..d] = o[r, ..d] / l[r]` for each row (0 where no key was visible).
#[inline(always)]
pub(super) fn normalize(out: &mut [f32], o: &[f32], dp: usize, d: usize, l_run: &[f32]) {
    for (r, &l) in l_run.iter().enumerate() {
        let dst = &mut out[r * d..(r + 1) * d];
        if l > 0.0 {
            let inv = 1.0 / l;
            for (x, &a) in dst.iter_mut().zip(&o[r * dp..r * dp + d]) {
                *x = a * inv;
            }
        } else {
            dst.fill(0.0);
        }
    }
}

/// One task ([`Ctx::task_rows`]); writes `[rows, head_dim]` at the start of `out`.
#[inline(always)]
fn task<M: Tile>(c: &Ctx<'_, f32, f32>, t: usize, out: &mut [f32]) {
    let qr = M::QR;
    let s = &c.s;
    let d = s.head_dim;
    let dp = c.d_pad;
    let bkv = c.bkv;
    let Some(TaskRows { b, h, g, i0, rows }) = c.task_rows(t) else {
        return;
    };
    let rows_pad = rows.next_multiple_of(qr);

    // Scaled query tile, zero-padded to a multiple of qr rows, packed per qr-row group
    // as [d][qr].
    let mut qt = vec![0f32; rows_pad * d];
    for r in 0..rows {
        let src = &c.q[(b * s.seq_q + i0 + r) * s.q_row() + h * d..][..d];
        let group = &mut qt[(r / qr) * qr * d..][..qr * d];
        for (p, &v) in src.iter().enumerate() {
            group[p * qr + r % qr] = v * c.scale;
        }
    }
    let mut o = vec![0f32; rows_pad * dp];
    let mut st = vec![0f32; rows_pad * bkv];
    let mut m_run = vec![f32::NEG_INFINITY; rows];
    let mut l_run = vec![0f32; rows];

    let bg = b * s.num_kv_heads + g;
    let kp = &c.kp[bg * d * c.skv_pad..(bg + 1) * d * c.skv_pad];
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
        for r0 in (0..rows_pad).step_by(qr) {
            for c0 in (0..nk).step_by(KC) {
                let panel = &kp[(j0 + c0) * d..(j0 + c0 + KC) * d];
                M::qk(
                    &qt[r0 * d..(r0 + qr) * d],
                    panel,
                    &mut st[r0 * bkv + c0..],
                    bkv,
                );
            }
        }
        // Mask, online softmax, rescale the accumulator.
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
            |_, row, m| M::exp_sum(row, m),
        );
        // O += P·V.
        for r0 in (0..rows_pad).step_by(qr) {
            let p = &st[r0 * bkv..];
            let orows = &mut o[r0 * dp..(r0 + qr) * dp];
            for d0 in (0..dp).step_by(KC) {
                let panel = &vp[(d0 * c.skv_pad + j0 * KC)..];
                M::pv(p, bkv, panel, nk, dp, &mut orows[d0..]);
            }
        }
        j0 += nk;
    }
    normalize(out, &o, dp, d, &l_run);
}

dispatch!(
    /// [`task`] with 8-row micro-kernels on AVX-512, 6-row ones on AVX2 and 4-row
    /// portable ones otherwise.
    fn task_d(c: &Ctx<'_, f32, f32>, t: usize, out: &mut [f32]) => task [RowsZmm<8>, RowsYmm<6>, Rows4]
);

/// Blocked ("flash") attention (see the module docs); `block_q` queries per task, keys in
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
    attention_impl(q, k, v, mask, out, shape, block_q, block_kv, task_d)
}

/// [`attention`] on bf16 `q`, `k`, `v` and `out` (the mask stays f32). On CPUs with AMX
/// both products run on bf16 tiles with f32 accumulation (the scaled queries and the
/// softmax probabilities are rounded to bf16 first, as FlashAttention does); elsewhere
/// the operands are widened to f32 while they are repacked and everything is computed
/// in f32. Each output is rounded once (to nearest even) to bf16.
#[allow(clippy::too_many_arguments)]
pub fn attention_bf16(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    mask: Option<&[f32]>,
    out: &mut [bf16],
    shape: &AttentionShape,
    block_q: usize,
    block_kv: usize,
) -> Result<()> {
    if amx::available() {
        check(q, k, v, mask, out, shape, block_q, block_kv)?;
        attention_amx::attention(q, k, v, mask, out, shape, block_q, block_kv);
        return Ok(());
    }
    attention_impl(q, k, v, mask, out, shape, block_q, block_kv, task_d)
}

/// The error bound `(abs, rel)` of [`attention_bf16`] on this CPU against the f64
/// reference of the same bf16 inputs: `|got - want| <= abs + rel·|want|`. It is the
/// bf16 [`tolerance`](super::tolerance) (f32 math, one output rounding), plus on AMX
/// CPUs the effect of rounding the scaled queries and the probabilities to bf16:
/// `2⁻⁸·max|v|·(4 + 4·scale·√d·max|q|·max|k|)` (a probabilistic bound on the score
/// error; unstructured inputs stay well inside it).
pub fn attention_bf16_tolerance(
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    shape: &AttentionShape,
) -> (f64, f64) {
    let (abs, rel) = super::tolerance(DType::BF16, shape.seq_kv + shape.head_dim);
    if !amx::available() {
        return (abs, rel);
    }
    let max = |x: &[bf16]| x.iter().fold(0f64, |m, a| m.max(a.to_f64().abs()));
    let score = shape.scale * (shape.head_dim as f64).sqrt() * max(q) * max(k);
    let extra = DType::BF16.epsilon() * max(v) * (4.0 + 4.0 * score);
    (abs + extra, rel)
}

/// One task of [`attention_impl`] (see [`task`]).
type TaskFn = fn(&Ctx<'_, f32, f32>, usize, &mut [f32]);

#[allow(clippy::too_many_arguments)]
fn attention_impl<T: Decode + Encode>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&[f32]>,
    out: &mut [T],
    shape: &AttentionShape,
    block_q: usize,
    block_kv: usize,
    task: TaskFn,
) -> Result<()> {
    check(q, k, v, mask, out, shape, block_q, block_kv)?;
    let s = *shape;
    let d = s.head_dim;
    if out.is_empty() {
        return Ok(());
    }
    let skv_pad = s.seq_kv.next_multiple_of(KC);
    let d_pad = d.next_multiple_of(KC);
    let groups = s.batch * s.num_kv_heads;
    let kv_row = s.kv_row();

    // Queries as f32 (borrowed when they already are).
    let mut q_wide = None;
    let q32: &[f32] = match T::as_f32(q) {
        Some(q) => q,
        None => {
            let w = q_wide.insert(Scratch::new(q.len()));
            let row = s.q_row().max(1);
            for_each_row(w, row, row, |r, dst| {
                for (o, &x) in dst.iter_mut().zip(&q[r * row..]) {
                    *o = x.decode();
                }
            });
            w
        }
    };

    // Pack K and V into 16-wide panels per (batch, kv head), widened to f32.
    let mut kp = Scratch::new(groups * d * skv_pad);
    let mut vp = Scratch::new(groups * skv_pad * d_pad);
    let cost = s.seq_kv * d;
    for_each_row(&mut kp, d * skv_pad, cost, |bg, dst| {
        dst.fill(0.0);
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        for j in 0..s.seq_kv {
            let src = &k[(b * s.seq_kv + j) * kv_row + g * d..][..d];
            let panel = &mut dst[(j / KC) * KC * d..][..KC * d];
            for (p, &x) in src.iter().enumerate() {
                panel[p * KC + j % KC] = x.decode();
            }
        }
    });
    for_each_row(&mut vp, skv_pad * d_pad, cost, |bg, dst| {
        dst.fill(0.0);
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        for j in 0..s.seq_kv {
            let src = &v[(b * s.seq_kv + j) * kv_row + g * d..][..d];
            for (p, &x) in src.iter().enumerate() {
                dst[((p / KC) * skv_pad + j) * KC + p % KC] = x.decode();
            }
        }
    });

    let bq = block_q.min(s.seq_q.max(1));
    let nqb = s.seq_q.div_ceil(bq);
    let ctx = Ctx {
        s,
        q: q32,
        kp: &kp,
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
    // Every row that `scatter` reads is written by its task.
    let mut out_t = Scratch::new(s.batch * s.num_heads * nqb * bq * d);
    let task_cost = bq
        .saturating_mul(s.seq_kv.max(1))
        .saturating_mul(d)
        .saturating_mul(4);
    for_each_row(&mut out_t, bq * d, task_cost, |t, o| task(&ctx, t, o));

    scatter(&out_t, out, &s, bq);
    Ok(())
}

/// Validates the operands of an attention call.
#[allow(clippy::too_many_arguments)]
pub(super) fn check<T>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&[f32]>,
    out: &[T],
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
    Ok(())
}

/// Scatters task outputs `[batch, heads, query blocks × bq, head_dim]` into
/// `[batch, seq_q, heads × head_dim]`, rounding to the output dtype.
pub(super) fn scatter<T: Encode>(out_t: &[f32], out: &mut [T], s: &AttentionShape, bq: usize) {
    let (d, q_row) = (s.head_dim, s.q_row());
    let nqb = s.seq_q.div_ceil(bq);
    for_each_row(out, q_row, q_row, |bi, row| {
        let (b, i) = (bi / s.seq_q, bi % s.seq_q);
        for h in 0..s.num_heads {
            let src = &out_t[((b * s.num_heads + h) * nqb * bq + i) * d..][..d];
            for (o, &x) in row[h * d..(h + 1) * d].iter_mut().zip(src) {
                *o = T::encode(x);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference;
    use kpt_core::rand::SplitMix64;

    /// Every micro-kernel variant matches the reference on this CPU (the intrinsic tiles
    /// run their portable fallback where the CPU lacks their instruction set).
    #[test]
    fn every_tile_matches_reference() {
        let tasks: [(&str, TaskFn); 3] = [
            ("rows4 portable", task::<Rows4>),
            ("rows6 ymm", task::<RowsYmm<6>>),
            ("rows8 zmm", task::<RowsZmm<8>>),
        ];
        let mut rng = SplitMix64::new(3);
        let shapes = [
            AttentionShape::new(1, 1, 1, 1, 1, 1, false),
            AttentionShape::new(2, 13, 37, 4, 2, 24, true),
            AttentionShape::new(1, 70, 45, 2, 1, 64, false),
            AttentionShape::new(1, 33, 300, 1, 1, 128, true),
        ];
        for shape in shapes {
            let q = rng.vec(shape.q_len(), -1.0, 1.0);
            let k = rng.vec(shape.kv_len(), -1.0, 1.0);
            let v = rng.vec(shape.kv_len(), -1.0, 1.0);
            let f64s = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
            let mut want = vec![0f64; shape.q_len()];
            reference::attention(&f64s(&q), &f64s(&k), &f64s(&v), None, &mut want, &shape).unwrap();
            for (name, task) in tasks {
                let mut got = vec![f32::NAN; shape.q_len()];
                attention_impl(&q, &k, &v, None, &mut got, &shape, 16, 32, task).unwrap();
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(g) - w).abs() < 1e-5,
                        "{name} {shape:?} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}
