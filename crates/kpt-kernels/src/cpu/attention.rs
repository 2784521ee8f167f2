//! Blocked ("flash") attention in f32 with GQA, additive mask and bottom-right causal
//! masking. Semantics are those of [`reference::attention`](super::reference::attention)
//! (see [`AttentionShape`]).
//!
//! Each rayon task owns one (batch, head, block of `block_q` queries). It walks the key
//! blocks with an online softmax (running max `m`, running sum `l`, accumulator rescaled
//! by `exp(m_old - m_new)`), so only a `block_q × block_kv` score tile ever exists. Key
//! blocks that causality masks for every query of the task are never visited.
//!
//! Both products run on the f32 GEMM's register-tile micro-kernels (`MR × NR`: 12 × 32
//! on AVX-512, 6 × 16 on AVX2, 4 × 16 portable; see `sgemm`), computed transposed so
//! that every operand is already in the layout a micro-kernel streams:
//! - `Sᵀ = K·Qᵀ`: keys are the tile rows, queries the columns. K is packed once per
//!   (batch, kv head) into `MR`-key panels `[head_dim][MR]`; each task packs its scaled
//!   queries into `NR`-query panels `[head_dim][NR]`. The scores land as
//!   `[key][NR queries]` per query panel.
//! - The softmax then runs down the columns: per key row, `NR` queries side by side,
//!   so the running max / sum of every query are vectors.
//! - `Oᵀ += Vᵀ·Pᵀ`: head dims are the tile rows, queries the columns. V is packed once
//!   into `MR`-dim panels `[key][MR]`; `Pᵀ` is the probability block exactly as the
//!   softmax left it. `Oᵀ` (`[head_dim][block_q]`) is transposed once at the end. On
//!   AVX-512 this product runs on an 8 × 32 tile when the head dim pads less for 8 rows
//!   than for 12 (64, 128).
//!
//! Keys, queries and head dims are zero-padded to whole panels, so every tile is full.

use half::bf16;
use kpt_core::{DType, KptError, Result};

use super::par::for_each_row;
use super::scratch::Scratch;
use super::sgemm::{self, Micro, Portable};
use super::shapes::AttentionShape;
use super::simd::{
    self, dispatch, dot_decode, exp_f32_fma, exp_softmax_f32_fma, fmadd, Decode, Encode,
};
use super::softmax::row_max;
use super::wide::Widen;
use super::{amx, attention_amx};

/// A good default query block (rows per task).
pub const DEFAULT_BLOCK_Q: usize = 64;
/// A good default key block (rounded up to whole key panels internally).
pub const DEFAULT_BLOCK_KV: usize = 256;

/// Widest query panel (`NR`) of any micro-kernel.
const MAX_NR: usize = 32;

/// Columns the softmax handles at a time; every micro-kernel's `NR` is a multiple.
const COLUMN_CHUNK: usize = 16;
const _: () = assert!(Portable::NR % COLUMN_CHUNK == 0 && Portable::NR <= MAX_NR);
#[cfg(target_arch = "x86_64")]
const _: () = {
    use super::sgemm::{Avx2, Avx512};
    assert!(Avx2::NR % COLUMN_CHUNK == 0 && Avx2::NR <= MAX_NR);
    assert!(Avx512::NR % COLUMN_CHUNK == 0 && Avx512::NR <= MAX_NR);
};

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

/// One key block of the online softmax on the score tile `st` (rows `bkv` apart):
/// adds the mask, masks keys outside each query's window and limit, updates the running max `m`
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
        // Keys before the sliding window's start.
        let first = s.key_start(i).saturating_sub(j0).min(valid);
        if let Some(mask) = mask {
            let mrow = &mask[i * s.seq_kv + j0 + first..i * s.seq_kv + j0 + valid];
            srow[first..valid]
                .iter_mut()
                .zip(mrow)
                .for_each(|(x, &a)| *x += a);
        }
        srow[..first].fill(f32::NEG_INFINITY);
        srow[valid..].fill(f32::NEG_INFINITY);
        let bm = row_max(srow);
        let m_new = if bm > m_run[r] { bm } else { m_run[r] };
        if m_new == f32::NEG_INFINITY {
            srow.fill(0.0);
            continue;
        }
        // Once a row's maximum stops growing (most key blocks) the factor is exactly 1.
        let alpha = if m_new == m_run[r] {
            1.0
        } else {
            exp_f32_fma::<false>(m_run[r] - m_new)
        };
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

/// One task ([`Ctx::task_rows`]) on micro-kernels `mk` (`Sᵀ = K·Qᵀ`) and `mv`
/// (`Oᵀ += Vᵀ·Pᵀ`, same `NR`); writes `[rows, head_dim]` at the start of `out`.
/// `c.bq` is a multiple of `NR`, `c.bkv` and `c.skv_pad` of `mk`'s `MR`, `c.d_pad` of
/// `mv`'s.
fn task<M: Micro, V: Micro>(mk: M, mv: V, c: &Ctx<'_, f32, f32>, t: usize, out: &mut [f32]) {
    let (mr, nr) = (M::MR, M::NR);
    let s = &c.s;
    let (d, dp, bq, bkv) = (s.head_dim, c.d_pad, c.bq, c.bkv);
    let Some(TaskRows { b, h, g, i0, rows }) = c.task_rows(t) else {
        return;
    };
    let panels = rows.div_ceil(nr);
    // Per query panel: scaled queries [d][NR], scores / probabilities [bkv][NR], key
    // limits, running max and sum.
    let mut qt = Scratch::<f32>::new(panels * d * nr);
    qt.fill(0.0);
    for r in 0..rows {
        let src = &c.q[(b * s.seq_q + i0 + r) * s.q_row() + h * d..][..d];
        let panel = &mut qt[(r / nr) * d * nr..][..d * nr];
        for (p, &x) in src.iter().enumerate() {
            panel[p * nr + r % nr] = x * c.scale;
        }
    }
    let mut st = Scratch::<f32>::new(panels * bkv * nr);
    let mut ot = Scratch::<f32>::new(dp * bq);
    ot.fill(0.0);
    let lim: Vec<u32> = (0..panels * nr)
        .map(|r| {
            if r < rows {
                s.key_limit(i0 + r) as u32
            } else {
                0
            }
        })
        .collect();
    // First visible key per query (a sliding window's start; 0 without one). It grows
    // with the query, so the task starts at its first query's, in whole key panels.
    let first: Vec<u32> = (0..panels * nr)
        .map(|r| s.key_start(i0 + r.min(rows - 1)) as u32)
        .collect();
    let mut m_run = vec![f32::NEG_INFINITY; panels * nr];
    let mut l_run = vec![0f32; panels * nr];

    let bg = b * s.num_kv_heads + g;
    let kp = &c.kp[bg * d * c.skv_pad..][..d * c.skv_pad];
    let vp = &c.vp[bg * c.skv_pad * dp..][..c.skv_pad * dp];
    let mut j0 = first[0] as usize / mr * mr;
    loop {
        let mut more = false;
        for qp in 0..panels {
            // Keys of this block that some query of the panel sees, in whole panels.
            let panel_end = lim[qp * nr..][..nr].iter().max().copied().unwrap_or(0) as usize;
            let nk = panel_end
                .next_multiple_of(mr)
                .min(c.skv_pad)
                .saturating_sub(j0)
                .min(bkv);
            if nk == 0 {
                continue;
            }
            more |= j0 + nk < panel_end;
            let sp = &mut st[qp * bkv * nr..][..nk * nr];
            let qpan = &qt[qp * d * nr..][..d * nr];
            for jj in (0..nk).step_by(mr) {
                let kpan = &kp[(j0 + jj) * d..][..mr * d];
                // SAFETY: the tile is rows jj..jj + MR (< nk) of `sp`, NR f32 each with
                // row stride NR; both panels hold `d` k steps.
                unsafe { mk.tile(kpan, qpan, sp[jj * nr..].as_mut_ptr(), nr, false) };
            }
            let cols = qp * nr..(qp + 1) * nr;
            let alpha = column_softmax_d(
                s,
                c.mask,
                sp,
                (i0 + qp * nr, rows.saturating_sub(qp * nr).min(nr)),
                j0,
                (&first[cols.clone()], &lim[cols.clone()]),
                &mut m_run[cols.clone()],
                &mut l_run[cols.clone()],
            );
            let alpha = &alpha[..nr];
            // Dropout after the sums (the softmax's), before P·V: column r is query
            // i0 + qp·NR + r, row jj key j0 + jj.
            if s.dropout.is_some() {
                for r in 0..rows.saturating_sub(qp * nr).min(nr) {
                    s.apply_dropout((b, h, i0 + qp * nr + r), j0, &mut sp[r..], nr);
                }
            }
            if alpha.iter().any(|&a| a != 1.0) {
                for row in ot.chunks_exact_mut(bq) {
                    row[cols.clone()]
                        .iter_mut()
                        .zip(alpha)
                        .for_each(|(o, &a)| *o *= a);
                }
            }
            for dd in (0..dp).step_by(V::MR) {
                let vpan = &vp[dd * c.skv_pad + j0 * V::MR..][..nk * V::MR];
                // SAFETY: rows dd..dd + MR (< dp) of `ot`, columns of query panel qp:
                // inside `ot` (row stride bq); both panels hold `nk` k steps.
                unsafe { mv.tile(vpan, sp, ot[dd * bq + qp * nr..].as_mut_ptr(), bq, true) };
            }
        }
        j0 += bkv;
        if !more {
            break;
        }
    }
    for (r, dst) in out.chunks_exact_mut(d).take(rows).enumerate() {
        let l = l_run[r];
        if l > 0.0 {
            let inv = 1.0 / l;
            for (p, x) in dst.iter_mut().enumerate() {
                *x = ot[p * bq + r] * inv;
            }
        } else {
            dst.fill(0.0);
        }
    }
}

/// Online softmax of one key block down the columns of `sp` (`[keys][NR]`, first key
/// `j0`) for the `NR` queries of a panel (`queries` = (first query, real ones)):
/// adds the mask, sets keys before each query's first key `first` (a sliding window) or
/// at or past its limit `lim` to `-inf`, updates the
/// running max `m` and sum `l`, leaves `exp(s - m)` in `sp` and returns each column's
/// factor for rescaling its accumulator.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn column_softmax<const FMA: bool>(
    s: &AttentionShape,
    mask: Option<&[f32]>,
    sp: &mut [f32],
    (q0, real): (usize, usize),
    j0: usize,
    (first, lim): (&[u32], &[u32]),
    m_run: &mut [f32],
    l_run: &mut [f32],
) -> [f32; MAX_NR] {
    let nr = lim.len();
    if let Some(mask) = mask {
        for (jj, row) in sp.chunks_exact_mut(nr).enumerate() {
            for (r, x) in row[..real].iter_mut().enumerate() {
                let j = j0 + jj;
                if (first[r] as usize..lim[r] as usize).contains(&j) {
                    *x += mask[(q0 + r) * s.seq_kv + j];
                }
            }
        }
    }
    // Each key row is handled in fixed chunks of `L` columns so that every inner loop
    // has a constant trip count and compiles to straight vector code.
    const L: usize = COLUMN_CHUNK;
    // Keys inside every real query's window and below its limit need no masking
    // (padded columns are never read back, whatever they hold).
    let all_see = lim[..real].iter().min().map_or(0, |&l| l as usize);
    let all_from = first[..real].iter().max().map_or(0, |&f| f as usize);
    let mut bmax = [[f32::NEG_INFINITY; L]; MAX_NR / L];
    let (lims, _) = lim.as_chunks::<L>();
    let (firsts, _) = first.as_chunks::<L>();
    for (jj, row) in sp.chunks_exact_mut(nr).enumerate() {
        let j = j0 + jj;
        let (chs, _) = row.as_chunks_mut::<L>();
        if (all_from..all_see).contains(&j) {
            for (ch, m) in chs.iter().zip(&mut bmax) {
                for i in 0..L {
                    m[i] = if ch[i] > m[i] { ch[i] } else { m[i] };
                }
            }
            continue;
        }
        for (((ch, m), lc), fc) in chs.iter_mut().zip(&mut bmax).zip(lims).zip(firsts) {
            for i in 0..L {
                let v = if (j as u32) < lc[i] && (j as u32) >= fc[i] {
                    ch[i]
                } else {
                    f32::NEG_INFINITY
                };
                ch[i] = v;
                m[i] = if v > m[i] { v } else { m[i] };
            }
        }
    }
    let bmax = bmax.as_flattened();
    // A column with no visible key yet keeps m = -inf; it subtracts 0 instead so that
    // its probabilities are exp(-inf) = 0 rather than NaN.
    let mut alpha = [1f32; MAX_NR];
    let mut shift = [0f32; MAX_NR];
    for r in 0..nr {
        let m_new = m_run[r].max(bmax[r]);
        shift[r] = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        alpha[r] = exp_f32_fma::<FMA>(m_run[r] - shift[r]);
        m_run[r] = m_new;
    }
    let mut sum = [[0f32; L]; MAX_NR / L];
    let (shifts, _) = shift.as_chunks::<L>();
    for row in sp.chunks_exact_mut(nr) {
        for ((ch, a), sh) in row
            .as_chunks_mut::<L>()
            .0
            .iter_mut()
            .zip(&mut sum)
            .zip(shifts)
        {
            for i in 0..L {
                ch[i] = exp_softmax_f32_fma::<FMA>(ch[i] - sh[i]);
                a[i] += ch[i];
            }
        }
    }
    let sum = sum.as_flattened();
    for r in 0..nr {
        l_run[r] = l_run[r] * alpha[r] + sum[r];
    }
    alpha
}

dispatch!(
    /// [`column_softmax`] with FMA where the CPU has it.
    #[allow(clippy::too_many_arguments)]
    fn column_softmax_d(
        s: &AttentionShape,
        mask: Option<&[f32]>,
        sp: &mut [f32],
        queries: (usize, usize),
        j0: usize,
        bounds: (&[u32], &[u32]),
        m_run: &mut [f32],
        l_run: &mut [f32],
    ) -> [f32; MAX_NR] => column_softmax
);

/// Blocked ("flash") attention (see the module docs); `block_q` queries per task and keys
/// in blocks of `block_kv`, rounded up to the micro-kernel's query and key panels; with at
/// most 4 queries per head (decode) row by row instead. Same results as the reference up
/// to f32 rounding. Errors on any length mismatch, a head count that does not group, or a
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
    attention_impl(q, k, v, mask, out, shape, block_q, block_kv)
}

/// [`attention`] on bf16 `q`, `k`, `v` and `out` (the mask stays f32). On CPUs with AMX
/// both products run on bf16 tiles with f32 accumulation (the scaled queries and the
/// softmax probabilities are rounded to bf16 first, as FlashAttention does); elsewhere,
/// and for decode-sized calls (at most 4 queries per head) on any CPU, the operands are
/// widened to f32 as they are read and everything is computed in f32. Each output is rounded once (to nearest even) to bf16.
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
    if amx::available() && shape.seq_q > DIRECT_MAX_Q {
        check(q, k, v, mask, out, shape, block_q, block_kv)?;
        attention_amx::attention(q, k, v, mask, out, shape, block_q, block_kv);
        return Ok(());
    }
    attention_impl(q, k, v, mask, out, shape, block_q, block_kv)
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

/// Validates the operands, then runs [`attention_with`] on the best micro-kernel of
/// this CPU.
#[allow(clippy::too_many_arguments)]
fn attention_impl<T: Widen + Encode>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<&[f32]>,
    out: &mut [T],
    shape: &AttentionShape,
    block_q: usize,
    block_kv: usize,
) -> Result<()> {
    check(q, k, v, mask, out, shape, block_q, block_kv)?;
    let args = (q, k, v, mask);
    if shape.seq_q <= DIRECT_MAX_Q {
        attention_direct(args, out, shape);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        use super::sgemm::{Avx2, Avx512, Avx512x8};
        if let (Some(mk), Some(mv)) = (Avx512::detect(), Avx512x8::detect()) {
            // Head dims that are a multiple of 8 but not of 12 (64, 128) would pad V's
            // panels for the 12-row tile: P·V runs on the 8-row one instead.
            if shape.head_dim.next_multiple_of(8) < shape.head_dim.next_multiple_of(12) {
                attention_with((mk, mv), args, out, shape, block_q, block_kv);
            } else {
                attention_with((mk, mk), args, out, shape, block_q, block_kv);
            }
            return Ok(());
        }
        if let Some(mk) = Avx2::detect() {
            attention_with((mk, mk), args, out, shape, block_q, block_kv);
            return Ok(());
        }
    }
    attention_with((Portable, Portable), args, out, shape, block_q, block_kv);
    Ok(())
}

/// Validated operands `(q, k, v, mask)` of one call.
type Operands<'a, T> = (&'a [T], &'a [T], &'a [T], Option<&'a [f32]>);

/// Queries per head up to which attention runs one query row at a time on K and V as
/// they are (decode): the block path would pad every query panel to `NR` columns (or
/// 32 rows on AMX) and repack the whole key/value cache on every call.
const DIRECT_MAX_Q: usize = 4;

/// Attention row by row (see [`DIRECT_MAX_Q`]), parallel over (batch, query, head).
fn attention_direct<T: Widen + Encode>(ops: Operands<'_, T>, out: &mut [T], s: &AttentionShape) {
    let d = s.head_dim;
    if out.is_empty() || d == 0 {
        return;
    }
    let cost = s.seq_kv.max(1) * d * 2;
    for_each_row(out, d, cost, |t, row| direct_row_d(s, ops, t, row));
}

dispatch!(
    /// [`direct_row`] vectorized for the CPU.
    fn direct_row_d<T: Widen + Encode>(
        s: &AttentionShape,
        ops: Operands<'_, T>,
        t: usize,
        row: &mut [T],
    ) => direct_row [true, T] [true, T] [false, T]
);

/// Output row `t` = (batch, query, head) of [`attention_direct`]: scores against every
/// visible key, softmax, then the probability-weighted sum of the value rows.
#[inline(always)]
fn direct_row<const FMA: bool, T: Widen + Encode>(
    s: &AttentionShape,
    (q, k, v, mask): Operands<'_, T>,
    t: usize,
    row: &mut [T],
) {
    let d = s.head_dim;
    let (bi, h) = (t / s.num_heads, t % s.num_heads);
    let (b, i) = (bi / s.seq_q, bi % s.seq_q);
    let g = h / s.group_size();
    let scale = s.scale as f32;
    let qrow: Vec<f32> = q[bi * s.q_row() + h * d..][..d]
        .iter()
        .map(|x| x.decode() * scale)
        .collect();
    let at = |j: usize| (b * s.seq_kv + j) * s.kv_row() + g * d;
    // Visible keys: start..lim (`p[j]` is key `start + j`).
    let (start, lim) = (s.key_start(i), s.key_limit(i));
    let at = |j: usize| at(start + j);
    let key = |j: usize| &k[at(j)..][..d];
    let mut p = vec![0f32; lim.saturating_sub(start)];
    #[cfg(target_arch = "x86_64")]
    let done = if simd::has_avx512() {
        // SAFETY: AVX-512 was detected on this CPU.
        unsafe { super::wide::dots(&qrow, key, &mut p) };
        p.len()
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (j, x) in p.iter_mut().enumerate().skip(done) {
        *x = dot_decode::<FMA, T>(&qrow, key(j));
    }
    if let Some(mask) = mask {
        for (x, &a) in p.iter_mut().zip(&mask[i * s.seq_kv + start..]) {
            *x += a;
        }
    }
    let m = p.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    if m == f32::NEG_INFINITY {
        // No visible key (or all masked): zeros, like the reference.
        row.fill(T::encode(0.0));
        return;
    }
    let mut l = 0f32;
    for x in &mut p {
        *x = exp_f32_fma::<FMA>(*x - m);
        l += *x;
    }
    // Dropout after the sum (the softmax's), before P·V.
    s.apply_dropout((b, h, i), start, &mut p, 1);
    let mut o = vec![0f32; d];
    for (j, &pj) in p.iter().enumerate() {
        for (a, x) in o.iter_mut().zip(&v[at(j)..][..d]) {
            *a = fmadd::<FMA>(pj, x.decode(), *a);
        }
    }
    let inv = 1.0 / l;
    for (dst, &a) in row.iter_mut().zip(&o) {
        *dst = T::encode(a * inv);
    }
}

/// Attention on micro-kernels `(mk, mv)` (see [`task`] and the module docs) of
/// validated operands.
fn attention_with<M: Micro, V: Micro, T: Decode + Encode>(
    (mk, mv): (M, V),
    (q, k, v, mask): Operands<'_, T>,
    out: &mut [T],
    shape: &AttentionShape,
    block_q: usize,
    block_kv: usize,
) {
    let (mr, nr) = (M::MR, M::NR);
    assert_eq!(V::NR, nr, "both products run on query panels of one width");
    let s = *shape;
    let d = s.head_dim;
    if out.is_empty() {
        return;
    }
    let skv_pad = s.seq_kv.next_multiple_of(mr);
    let d_pad = d.next_multiple_of(V::MR);
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

    // Per (batch, kv head): K as MR-key panels [d][MR], V as MR-dim panels [key][MR],
    // widened to f32 and zero-padded.
    let mut kp = Scratch::new(groups * d * skv_pad);
    let mut vp = Scratch::new(groups * skv_pad * d_pad);
    let cost = s.seq_kv * d;
    for_each_row(&mut kp, d * skv_pad, cost, |bg, dst| {
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        let keys = &k[b * s.seq_kv * kv_row + g * d..];
        let mut rows = Vec::new();
        for (j0, panel) in (0..s.seq_kv).step_by(mr).zip(dst.chunks_exact_mut(mr * d)) {
            // The panel's keys as f32 rows (borrowed when K already is f32), then
            // transposed into [d][MR].
            let live = mr.min(s.seq_kv - j0);
            let (src, ls) = match T::as_f32(keys) {
                Some(k32) => (&k32[j0 * kv_row..], kv_row),
                None => {
                    rows.clear();
                    for j in j0..j0 + live {
                        rows.extend(keys[j * kv_row..][..d].iter().map(|x| x.decode()));
                    }
                    (&rows[..], d)
                }
            };
            sgemm::pack(panel, mr, 0, live, src, ls, 1);
        }
        dst[s.seq_kv.next_multiple_of(mr) * d..].fill(0.0);
    });
    for_each_row(&mut vp, skv_pad * d_pad, cost, |bg, dst| {
        let (b, g) = (bg / s.num_kv_heads, bg % s.num_kv_heads);
        let vr = V::MR;
        for (pi, panel) in dst.chunks_exact_mut(skv_pad * vr).enumerate() {
            // Dims pi·MR.. of every key, MR side by side (zero past the last dim).
            let (p0, w) = (pi * vr, vr.min(d - pi * vr));
            for (j, dst) in panel.chunks_exact_mut(vr).take(s.seq_kv).enumerate() {
                let src = &v[(b * s.seq_kv + j) * kv_row + g * d + p0..][..w];
                dst.iter_mut().zip(src).for_each(|(o, x)| *o = x.decode());
                dst[w..].fill(0.0);
            }
            panel[s.seq_kv * vr..].fill(0.0);
        }
    });

    let bq = balanced_block_q(&s, block_q, rayon::current_num_threads(), nr);
    let nqb = s.seq_q.div_ceil(bq);
    let ctx = Ctx {
        s,
        q: q32,
        kp: &kp,
        vp: &vp,
        mask,
        scale: s.scale as f32,
        bq,
        bkv: block_kv.next_multiple_of(mr),
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
    for_each_row(&mut out_t, bq * d, task_cost, |t, o| {
        task(mk, mv, &ctx, t, o)
    });

    scatter(&out_t, out, &s, bq);
}

/// Tasks per thread below which [`balanced_block_q`] halves the query block.
const TASKS_PER_THREAD: usize = 16;

/// The query block: `block_q` rounded up to `panel` rows (and at most the padded
/// queries), halved down to one panel while that leaves fewer than [`TASKS_PER_THREAD`]
/// tasks per thread. Tasks differ in cost (causal rows see more keys the later they
/// are), and with few per thread the slowest thread sets the time: at B1 H8 S1024 D64
/// on 16 threads, 32-row blocks (256 tasks) ran bf16 causal attention 17% and full
/// attention 5% faster than 64-row ones on AMX, and f32 attention 2-3% faster.
pub(super) fn balanced_block_q(
    s: &AttentionShape,
    block_q: usize,
    threads: usize,
    panel: usize,
) -> usize {
    let mut bq = block_q
        .next_multiple_of(panel)
        .min(s.seq_q.max(1).next_multiple_of(panel));
    let heads = s.batch * s.num_heads;
    while bq > panel && heads * s.seq_q.div_ceil(bq) < TASKS_PER_THREAD * threads {
        bq = (bq / 2).next_multiple_of(panel);
    }
    bq
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
            T::encode_slice(src, &mut row[h * d..(h + 1) * d]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference;
    use kpt_core::rand::SplitMix64;

    #[test]
    fn query_blocks_shrink_until_each_thread_has_enough_tasks() {
        let shape = |h, seq| AttentionShape::new(1, seq, seq, h, h, 64, true);
        // 8 heads × 1024 queries on 16 threads: 64-row blocks give 128 tasks, 32 give 256.
        assert_eq!(balanced_block_q(&shape(8, 1024), 64, 16, 32), 32);
        // 16 heads × 2048 queries: 512 tasks of 64 rows are enough.
        assert_eq!(balanced_block_q(&shape(16, 2048), 64, 16, 32), 64);
        // Never below one panel, never above the padded queries, a multiple of the panel.
        assert_eq!(balanced_block_q(&shape(1, 40), 64, 64, 32), 32);
        assert_eq!(balanced_block_q(&shape(64, 100), 500, 1, 32), 128);
        assert_eq!(balanced_block_q(&shape(64, 4096), 100, 2, 32), 128);
        assert_eq!(balanced_block_q(&shape(8, 1024), 64, 16, 16), 32);
        assert_eq!(balanced_block_q(&shape(1, 1024), 64, 64, 16), 16);
    }

    /// The row-by-row path (few queries) matches the reference: GQA, causal with fewer
    /// queries than keys, a mask, and a row that sees no key.
    #[test]
    fn direct_path_matches_reference() {
        let mut rng = SplitMix64::new(5);
        for (shape, masked) in [
            (AttentionShape::new(2, 1, 9, 8, 2, 24, true), false),
            (AttentionShape::new(1, 4, 70, 4, 4, 40, true), true),
            (AttentionShape::new(1, 3, 2, 2, 1, 8, true), false),
        ] {
            let q = rng.vec(shape.q_len(), -1.0, 1.0);
            let k = rng.vec(shape.kv_len(), -1.0, 1.0);
            let v = rng.vec(shape.kv_len(), -1.0, 1.0);
            let mask = rng.vec(shape.mask_len(), -2.0, 0.0);
            let mask = masked.then_some(&mask[..]);
            let f64s = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
            let mut want = vec![0f64; shape.q_len()];
            let mask64 = mask.map(f64s);
            reference::attention(
                &f64s(&q),
                &f64s(&k),
                &f64s(&v),
                mask64.as_deref(),
                &mut want,
                &shape,
            )
            .unwrap();
            let mut got = vec![f32::NAN; shape.q_len()];
            attention_direct((&q, &k, &v, mask), &mut got, &shape);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(g) - w).abs() < 1e-5,
                    "{shape:?} [{i}]: {g} vs {w}"
                );
            }
        }
    }

    /// Every micro-kernel this CPU has matches the reference.
    #[test]
    fn every_micro_kernel_matches_reference() {
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
            let check = |name: &str, got: &[f32]| {
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(g) - w).abs() < 1e-5,
                        "{name} {shape:?} [{i}]: {g} vs {w}"
                    );
                }
            };
            let mut got = vec![f32::NAN; shape.q_len()];
            let ops = (&q[..], &k[..], &v[..], None);
            attention_with((Portable, Portable), ops, &mut got, &shape, 16, 32);
            check("portable", &got);
            #[cfg(target_arch = "x86_64")]
            {
                use crate::cpu::sgemm::{Avx2, Avx512, Avx512x8};
                if let Some(mk) = Avx2::detect() {
                    got.fill(f32::NAN);
                    attention_with((mk, mk), ops, &mut got, &shape, 16, 32);
                    check("avx2", &got);
                }
                if let (Some(mk), Some(mv)) = (Avx512::detect(), Avx512x8::detect()) {
                    got.fill(f32::NAN);
                    attention_with((mk, mk), ops, &mut got, &shape, 16, 32);
                    check("avx512", &got);
                    got.fill(f32::NAN);
                    attention_with((mk, mv), ops, &mut got, &shape, 16, 32);
                    check("avx512 + 8-row P·V", &got);
                }
            }
        }
    }
}
