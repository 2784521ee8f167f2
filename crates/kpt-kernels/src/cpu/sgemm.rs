//! kpt's own f32 GEMM for x86-64, the structure of BLIS and of the kernels in MKL /
//! oneDNN. The default on AVX-512 CPUs; its AVX2 kernel runs with `KPT_CPU_GEMM=own`
//! (it measured no faster than the `gemm` crate there) and in this module's tests.
//!
//! - Both operands are packed once into zero-padded micro-panels that hold every k
//!   step: `MR` rows of A (`K × MR`) and `NR` columns of B (`K × NR`), k-major. Any row
//!   / column strides are accepted, so transposed operands (the weights of a linear
//!   layer, `[n, k]`) cost nothing extra; k-contiguous lines are transposed in 4 × 8
//!   AVX blocks. The tasks below pack the panels they need on first use
//!   ([`LazyPanels`]): one parallel region per call, no separate packing phase.
//!   Operands larger than [`PACK_LIMIT`] are packed and multiplied a chunk of rows or
//!   columns at a time.
//! - The output is cut into [`TASKS_PER_THREAD`] small rectangles per thread (see
//!   [`task_shape`]); each thread starts on its own run of neighbouring tasks and then
//!   takes the others' ([`for_each_task`]), so a thread on a slower or busier core
//!   runs fewer of them: on a 16-core VM the same static share ran
//!   from 9.5 to 20 ms on different threads of one call (12 tasks per thread and
//!   `KC` = 512 ran 5-10% faster there than 6 and 256). A task walks k blocks of `KC`;
//!   per block its A micro-panel (`KC × MR`, in L1) meets each of its B micro-panels
//!   (`KC × NR`, all of them in L2).
//! - The micro-kernel keeps an `MR × NR` tile of f32 accumulators in registers
//!   (AVX-512: 12 × 32 in 24 zmm; AVX2: 6 × 16 in 12 ymm), broadcasts one A value per
//!   row and k step and issues two FMAs per row; it adds to the output after the first
//!   k block. Edge tiles run the same kernel on a local tile.
//! - An optional epilogue (bias, activation) runs on each finished row segment of a
//!   task while it is still in cache.

use super::gemm::Strided;
use super::panels::LazyPanels;
use super::par::for_each_task;
use super::scratch::Scratch;

/// A register-blocked micro-kernel and the blocking that suits it.
pub(crate) trait Micro: Copy + Send + Sync {
    /// Rows of the register tile.
    const MR: usize;
    /// Columns of the register tile.
    const NR: usize;
    /// k steps per block (the A micro-panel, `MR × KC`, stays in L1).
    const KC: usize;

    /// `c[MR × NR] = (accumulate ? c : 0) + Σ_p a[p][..] ⊗ b[p][..]` over
    /// `kc = a.len() / MR` steps.
    ///
    /// # Safety
    /// `a.len() == kc * MR` and `b.len() == kc * NR`; `c` points at `MR` rows of `NR`
    /// writable f32, `ldc` apart, that nothing else accesses during the call.
    unsafe fn tile(self, a: &[f32], b: &[f32], c: *mut f32, ldc: usize, accumulate: bool);
}

/// Elements of the largest register tile (edge tiles are computed in a local buffer).
const MAX_TILE: usize = 12 * 32;

/// Finishes a row segment of the output: `(segment, first column)`.
pub(crate) type Epilogue<'a> = &'a (dyn Fn(&mut [f32], usize) + Sync);

/// The output pointer shared by the tasks (each writes only its own rectangle).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint rectangles of the output (see `sgemm`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Below this many multiply-adds the product runs on the calling thread.
const PAR_THRESHOLD: usize = 1 << 17;

/// Largest packed operand chunk, in f32 (32 MiB): bigger operands are packed and
/// multiplied a chunk of rows (A) or columns (B) at a time.
const PACK_LIMIT: usize = 8 << 20;

/// Tasks per thread the output is cut into, so that threads that run slower (a busy
/// core, a shared one) take fewer tasks instead of holding up the call.
const TASKS_PER_THREAD: usize = 12;

/// `dst[m, n] (row stride dst_rs) = lhs[m, k] · rhs[k, n]`, then `epi` on every output
/// row segment. The caller has checked that every view fits its slice and that
/// `m`, `n`, `k` are non-zero.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm<M: Micro>(
    mk: M,
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    epi: Option<Epilogue<'_>>,
) {
    let rhs = Operand::strided(rhs, n, rhs.cs, rhs.rs);
    let operands = (Operand::strided(lhs, m, lhs.rs, lhs.cs), rhs);
    sgemm_chunked(mk, (m, n, k), dst, dst_rs, operands, epi, PACK_LIMIT);
}

/// Writes line `l` of an operand (`k` values) into the slice it is given.
pub(crate) type LineFn<'a> = &'a (dyn Fn(usize, &mut [f32]) + Sync);

/// [`sgemm`] with B given by its columns: `rhs(j, dst)` writes column `j` (`k` values),
/// as a linear layer's `[n, k]` weights in a compact dtype widen one row at a time.
/// The columns are produced as the tasks pack them, so no f32 copy of B is made.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_rhs_lines<M: Micro>(
    mk: M,
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Strided<'_>,
    rhs: LineFn<'_>,
    epi: Option<Epilogue<'_>>,
) {
    let rhs = Operand {
        src: Source::Lines(rhs),
        lines: n,
        k,
    };
    let operands = (Operand::strided(lhs, m, lhs.rs, lhs.cs), rhs);
    sgemm_chunked(mk, (m, n, k), dst, dst_rs, operands, epi, PACK_LIMIT);
}

/// [`sgemm`] with operands packed at most `pack_limit` f32 at a time.
fn sgemm_chunked<M: Micro>(
    mk: M,
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    (a_op, b_op): (Operand<'_>, Operand<'_>),
    epi: Option<Epilogue<'_>>,
    pack_limit: usize,
) {
    let (mr, nr) = (M::MR, M::NR);
    let (mp, np) = (m.div_ceil(mr), n.div_ceil(nr));
    let work = m.saturating_mul(n).saturating_mul(k);
    let threads = if work >= PAR_THRESHOLD {
        rayon::current_num_threads()
    } else {
        1
    };
    let a_chunk = (pack_limit / (k * mr)).clamp(1, mp);
    let b_chunk = (pack_limit / (k * nr)).clamp(1, np);
    let mut ap = Scratch::<f32>::new(a_chunk * mr * k);
    let mut bp = Scratch::<f32>::new(b_chunk * nr * k);
    debug_assert!(dst.len() > (m - 1) * dst_rs + n - 1);
    let out = OutPtr(dst.as_mut_ptr());
    let d = Dims {
        m,
        n,
        k,
        ldc: dst_rs,
    };
    for i0 in (0..mp).step_by(a_chunk) {
        let i1 = (i0 + a_chunk).min(mp);
        let a_panels = LazyPanels::new(&mut ap[..(i1 - i0) * mr * k], mr * k);
        for j0 in (0..np).step_by(b_chunk) {
            let j1 = (j0 + b_chunk).min(np);
            let b_panels = LazyPanels::new(&mut bp[..(j1 - j0) * nr * k], nr * k);
            let (mb, nb) = task_shape((i1 - i0, j1 - j0), (mr, nr), k, threads);
            let (tm, tn) = ((i1 - i0).div_ceil(mb), (j1 - j0).div_ceil(nb));
            let task = |t: usize| {
                let (ti, tj) = (t / tn, t % tn);
                let ip = ti * mb..((ti + 1) * mb).min(i1 - i0);
                let jp = tj * nb..((tj + 1) * nb).min(j1 - j0);
                let a = a_panels.get(ip.clone(), |p, dst| a_op.pack(dst, mr, i0 + p));
                let b = b_panels.get(jp.clone(), |p, dst| b_op.pack(dst, nr, j0 + p));
                let (ip, jp) = (i0 + ip.start..i0 + ip.end, j0 + jp.start..j0 + jp.end);
                // SAFETY: the rectangles of different `t` are disjoint (rows `ip` ×
                // columns `jp` of a tm × tn grid), `out` covers every output element
                // (checked by the caller), and `dst` stays borrowed until all tasks are
                // done.
                unsafe { rectangle(mk, a, b, out, d, ip, jp, epi) };
            };
            if threads > 1 {
                for_each_task(tm * tn, &task);
            } else {
                (0..tm * tn).for_each(task);
            }
        }
    }
}

/// An operand as `lines` lines (rows of A, columns of B) of `k` steps each.
#[derive(Clone, Copy)]
struct Operand<'a> {
    src: Source<'a>,
    lines: usize,
    k: usize,
}

/// Where an operand's elements come from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// f32 in memory: element `(l, p)` at `data[l * ls + p * ps]`.
    Strided {
        data: &'a [f32],
        ls: usize,
        ps: usize,
    },
    /// Each line written by a function (`k` contiguous values).
    Lines(LineFn<'a>),
}

impl<'a> Operand<'a> {
    /// The f32 operand `view` with `lines` lines, `ls` apart, of k steps `ps` apart.
    fn strided(view: Strided<'a>, lines: usize, ls: usize, ps: usize) -> Self {
        Operand {
            src: Source::Strided {
                data: view.data,
                ls,
                ps,
            },
            lines,
            k: 0,
        }
    }

    /// Packs the panel of `width` lines from line `panel * width` over all k steps into
    /// `out` (`k · width` f32).
    fn pack(&self, out: &mut [f32], width: usize, panel: usize) {
        let first = panel * width;
        match self.src {
            Source::Strided { data, ls, ps } => {
                pack(out, width, first, self.lines, data, ls, ps);
            }
            Source::Lines(line) => {
                // The panel's lines one after the other (each k-contiguous), then the
                // transposing pack from there.
                let live = width.min(self.lines - first);
                let mut stage = Scratch::<f32>::new(live * self.k);
                for (l, dst) in stage.chunks_exact_mut(self.k).enumerate() {
                    line(first + l, dst);
                }
                pack(out, width, 0, live, &stage, self.k, 1);
            }
        }
    }
}

/// Smallest task, in multiply-adds, that [`task_shape`] halves (512K: ~5 µs on one
/// AVX-512 core, against a few tenths of a µs of task overhead).
const MIN_TASK_MACS: usize = 1 << 19;

/// Task rectangle `(row panels, column panels)` for `mp × np` micro-tiles of `mr × nr`
/// over `k` on `threads`: from 192 × 256 outputs (operand traffic per multiply-add
/// low, the B block in L2), halving the longer side until there are
/// `TASKS_PER_THREAD` tasks per thread, the rectangle is one tile, or a half would
/// have fewer than [`MIN_TASK_MACS`] multiply-adds.
fn task_shape(
    (mp, np): (usize, usize),
    (mr, nr): (usize, usize),
    k: usize,
    threads: usize,
) -> (usize, usize) {
    let (mut mb, mut nb) = ((192 / mr).clamp(1, mp), (256 / nr).clamp(1, np));
    let want = if threads > 1 {
        threads * TASKS_PER_THREAD
    } else {
        1
    };
    while mp.div_ceil(mb) * np.div_ceil(nb) < want
        && (mb > 1 || nb > 1)
        && mb * mr * nb * nr * k >= 2 * MIN_TASK_MACS
    {
        if nb > 1 && nb * nr >= mb * mr {
            nb = nb.div_ceil(2);
        } else {
            mb = mb.div_ceil(2);
        }
    }
    (mb, nb)
}

/// Computes the output rectangle of row panels `ip` × column panels `jp` from their
/// packed panels (`ap`: those of `ip`, `bp`: those of `jp`).
///
/// # Safety
/// `out` points at the output (`m` rows, `ldc` apart, `n` columns each) and no other
/// thread accesses this rectangle during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn rectangle<M: Micro>(
    mk: M,
    ap: &[f32],
    bp: &[f32],
    out: OutPtr,
    d: Dims,
    ip: std::ops::Range<usize>,
    jp: std::ops::Range<usize>,
    epi: Option<Epilogue<'_>>,
) {
    let (mr, nr, k) = (M::MR, M::NR, d.k);
    let mut kb = 0;
    while kb < k {
        let kc = M::KC.min(k - kb);
        for i in ip.clone() {
            let a = &ap[(i - ip.start) * mr * k + kb * mr..][..kc * mr];
            for j in jp.clone() {
                let b = &bp[(j - jp.start) * nr * k + kb * nr..][..kc * nr];
                // SAFETY: tile (i, j) is in this task's rectangle (caller).
                unsafe { tile(mk, a, b, out, d, i, j, kb > 0) };
            }
        }
        kb += kc;
    }
    if let Some(f) = epi {
        let c0 = jp.start * nr;
        let width = (jp.end * nr).min(d.n) - c0;
        for r in ip.start * mr..(ip.end * mr).min(d.m) {
            // SAFETY: a finished row segment of this task's rectangle.
            let seg = unsafe { std::slice::from_raw_parts_mut(out.0.add(r * d.ldc + c0), width) };
            f(seg, c0);
        }
    }
}

/// Runs the micro-kernel on output tile `(i, j)`; edge tiles go through a local buffer.
///
/// # Safety
/// Tile `(i, j)` lies inside the output `out` points at and no other thread accesses
/// it during the call; `a`, `b` hold the same number of k steps.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile<M: Micro>(
    mk: M,
    a: &[f32],
    b: &[f32],
    out: OutPtr,
    d: Dims,
    i: usize,
    j: usize,
    accumulate: bool,
) {
    let (mr, nr) = (M::MR, M::NR);
    let (rows, cols) = (mr.min(d.m - i * mr), nr.min(d.n - j * nr));
    // SAFETY: tile (i, j) lies inside the output (caller).
    let c = unsafe { out.0.add(i * mr * d.ldc + j * nr) };
    if rows == mr && cols == nr {
        // SAFETY: a full tile: MR rows × NR columns of the output; a, b hold kc steps.
        unsafe { mk.tile(a, b, c, d.ldc, accumulate) };
        return;
    }
    let mut edge = [0f32; MAX_TILE];
    let t = &mut edge[..mr * nr];
    for r in 0..rows {
        // SAFETY: row r < rows, columns < cols: inside the tile.
        let src = unsafe { std::slice::from_raw_parts(c.add(r * d.ldc), cols) };
        t[r * nr..r * nr + cols].copy_from_slice(src);
    }
    // SAFETY: `t` holds MR × NR f32 (ldc = NR); a, b hold kc steps.
    unsafe { mk.tile(a, b, t.as_mut_ptr(), nr, accumulate) };
    for r in 0..rows {
        // SAFETY: as for the copy in.
        let dst = unsafe { std::slice::from_raw_parts_mut(c.add(r * d.ldc), cols) };
        dst.copy_from_slice(&t[r * nr..r * nr + cols]);
    }
}

/// Problem sizes and the output row stride.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    n: usize,
    k: usize,
    ldc: usize,
}

/// Packs lines `first..first + width` (rows of A or columns of B; `lines` in all) over
/// k steps `0..kc` (`kc = panel.len() / width`) into `panel`, k-major:
/// `panel[p * width + l] = data[(first + l) * ls + p * ps]`, zero past the last
/// line.
pub(super) fn pack(
    panel: &mut [f32],
    width: usize,
    first: usize,
    lines: usize,
    data: &[f32],
    ls: usize,
    ps: usize,
) {
    let live = width.min(lines - first);
    if live == width {
        let avx = cfg!(target_arch = "x86_64") && super::simd::has_avx2_fma();
        let packed = match width {
            4 => pack_full::<4>(panel, first, data, ls, ps, avx),
            6 => pack_full::<6>(panel, first, data, ls, ps, avx),
            12 => pack_full::<12>(panel, first, data, ls, ps, avx),
            16 => pack_full::<16>(panel, first, data, ls, ps, avx),
            32 => pack_full::<32>(panel, first, data, ls, ps, avx),
            _ => false,
        };
        if packed {
            return;
        }
    }
    if live < width {
        panel.fill(0.0);
    }
    if ls == 1 {
        // Lines adjacent in memory: one contiguous copy per k step.
        for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
            dst[..live].copy_from_slice(&data[first + p * ps..][..live]);
        }
    } else if ps == 1 {
        // Each line contiguous along k: read lines, write strided.
        let kc = panel.len() / width;
        for l in 0..live {
            let src = &data[(first + l) * ls..][..kc];
            for (dst, &v) in panel.chunks_exact_mut(width).zip(src) {
                dst[l] = v;
            }
        }
    } else {
        for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
            for (l, d) in dst[..live].iter_mut().enumerate() {
                *d = data[(first + l) * ls + p * ps];
            }
        }
    }
}

/// [`pack`] of a full panel of `W` lines in fixed-size pieces the compiler keeps in
/// vector registers: one `W`-wide copy per k step when lines are adjacent (`ls == 1`),
/// or an `8 × W` transpose per 8 k steps when each line is contiguous (`ps == 1`), in
/// 4 × 8 AVX blocks when `avx` (the CPU has AVX). Returns false (nothing written) for
/// other layouts.
fn pack_full<const W: usize>(
    panel: &mut [f32],
    first: usize,
    data: &[f32],
    ls: usize,
    ps: usize,
    avx: bool,
) -> bool {
    const KB: usize = 8;
    let (steps, _) = panel.as_chunks_mut::<W>();
    if ls == 1 {
        for (p, dst) in steps.iter_mut().enumerate() {
            dst.copy_from_slice(&data[first + p * ps..][..W]);
        }
        true
    } else if ps == 1 {
        let kc = steps.len();
        let rows: [&[f32]; W] = std::array::from_fn(|l| &data[(first + l) * ls..][..kc]);
        let (blocks, tail) = steps.as_chunks_mut::<KB>();
        let avx = avx && W >= 4;
        for (b, block) in blocks.iter_mut().enumerate() {
            if avx {
                // Blocks of 4 lines; the last one overlaps the one before when W is not
                // a multiple of 4 (it rewrites the same values).
                #[cfg(target_arch = "x86_64")]
                for l0 in (0..W).step_by(4).map(|l| l.min(W - 4)) {
                    let src = std::array::from_fn(|r| &rows[l0 + r][b * KB..][..KB]);
                    // SAFETY: AVX is present (AVX2 implies it); `src` holds 4 rows of 8
                    // and `block` 8 steps of W >= l0 + 4 values.
                    unsafe { transpose_4x8(src, block.as_mut_ptr().cast::<f32>().add(l0), W) };
                }
            } else {
                for (l, row) in rows.iter().enumerate() {
                    let src: &[f32; KB] = row[b * KB..][..KB].try_into().expect("KB long");
                    for (dst, &v) in block.iter_mut().zip(src) {
                        dst[l] = v;
                    }
                }
            }
        }
        let p0 = blocks.len() * KB;
        for (j, dst) in tail.iter_mut().enumerate() {
            for (d, row) in dst.iter_mut().zip(&rows) {
                *d = row[p0 + j];
            }
        }
        true
    } else {
        false
    }
}

/// Writes the 4 × 8 block `src` (4 lines of 8 k steps) transposed: step `j` of line
/// `r` to `dst[j * w + r]`.
///
/// # Safety
/// The CPU has AVX; `dst[j * w + r]` is writable for `j < 8`, `r < 4`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_4x8(src: [&[f32]; 4], dst: *mut f32, w: usize) {
    use std::arch::x86_64::*;
    assert!(src.iter().all(|r| r.len() >= 8));
    // SAFETY: each row has 8 readable f32 (asserted); the stores write dst[j * w..][..4]
    // for j < 8 (caller).
    unsafe {
        let [r0, r1, r2, r3] = src.map(|r| _mm256_loadu_ps(r.as_ptr()));
        // (a, b, c, d) = rows 0..3: t0 = a0 b0 a1 b1 | a4 b4 a5 b5, t1 = a2 b2 a3 b3 | ...
        let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
        // u[j] = step j in the low half, step j + 4 in the high half.
        let u = [
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xEE>(t0, t2),
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xEE>(t1, t3),
        ];
        for (j, v) in u.into_iter().enumerate() {
            _mm_storeu_ps(dst.add(j * w), _mm256_castps256_ps128(v));
            _mm_storeu_ps(dst.add((j + 4) * w), _mm256_extractf128_ps::<1>(v));
        }
    }
}

/// The portable micro-kernel: a 4 × 16 tile in plain Rust, for CPUs without AVX2 (the
/// compiler vectorizes it for the baseline instruction set).
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Micro for Portable {
    const MR: usize = 4;
    const NR: usize = 16;
    const KC: usize = 256;

    unsafe fn tile(self, a: &[f32], b: &[f32], c: *mut f32, ldc: usize, accumulate: bool) {
        let mut acc = [[0f32; 16]; 4];
        let (a, _) = a.as_chunks::<4>();
        let (b, _) = b.as_chunks::<16>();
        for (av, bv) in a.iter().zip(b) {
            for (row, &x) in acc.iter_mut().zip(av) {
                for (o, &y) in row.iter_mut().zip(bv) {
                    *o += x * y;
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            // SAFETY: row r of the tile: 16 writable f32 at c + r·ldc (caller).
            let dst = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), 16) };
            for (o, &x) in dst.iter_mut().zip(row) {
                *o = if accumulate { *o + x } else { x };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512, Avx512x8};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Micro;
    use crate::cpu::simd;

    /// Defines the micro-kernel types `$name` (constructed only where `simd::$has()`):
    /// `$mr × ($lanes · $nv)` register tiles of `$v` vectors in the instruction set
    /// `$feature`, with C prefetched first; one type per `[name, mr]`.
    macro_rules! micro_kernel {
        ($([$(#[$doc:meta])* $name:ident, mr = $mr:literal]),+ ; $has:ident, $feature:literal,
         $v:ty, $lanes:literal, nv = $nv:literal, kc = $kc:literal,
         $zero:ident, $load:ident, $store:ident, $set1:ident, $fma:ident, $add:ident) => {
            $(micro_kernel!(@one $(#[$doc])* $name, $has, $feature, $v, $lanes,
                mr = $mr, nv = $nv, kc = $kc, $zero, $load, $store, $set1, $fma, $add);)+
        };
        (@one $(#[$doc:meta])* $name:ident, $has:ident, $feature:literal, $v:ty, $lanes:literal,
         mr = $mr:literal, nv = $nv:literal, kc = $kc:literal,
         $zero:ident, $load:ident, $store:ident, $set1:ident, $fma:ident, $add:ident) => {
            $(#[$doc])*
            #[derive(Clone, Copy)]
            pub(crate) struct $name(());

            impl $name {
                /// The kernel, if this CPU has its instruction set.
                pub(crate) fn detect() -> Option<Self> {
                    simd::$has().then_some(Self(()))
                }
            }

            impl Micro for $name {
                const MR: usize = $mr;
                const NR: usize = $lanes * $nv;
                const KC: usize = $kc;

                unsafe fn tile(
                    self,
                    a: &[f32],
                    b: &[f32],
                    c: *mut f32,
                    ldc: usize,
                    accumulate: bool,
                ) {
                    #[target_feature(enable = $feature)]
                    unsafe fn kernel(
                        a: &[f32],
                        b: &[f32],
                        c: *mut f32,
                        ldc: usize,
                        accumulate: bool,
                    ) {
                        for r in 0..$mr {
                            for v in 0..($lanes * $nv as usize).div_ceil(16) {
                                // SAFETY: a prefetch never faults; the address is in the tile.
                                unsafe {
                                    _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 16 * v) as *const i8)
                                };
                            }
                        }
                        let mut acc: [[$v; $nv]; $mr] = [[$zero(); $nv]; $mr];
                        let (a, _) = a.as_chunks::<$mr>();
                        let (b, _) = b.as_chunks::<{ $lanes * $nv }>();
                        for (av, bv) in a.iter().zip(b) {
                            // SAFETY: `bv` holds $lanes · $nv f32; unaligned loads.
                            let bw: [$v; $nv] = std::array::from_fn(|i| unsafe {
                                $load(bv[$lanes * i..].as_ptr())
                            });
                            for (acc, &x) in acc.iter_mut().zip(av) {
                                let x = $set1(x);
                                for i in 0..$nv {
                                    acc[i] = $fma(x, bw[i], acc[i]);
                                }
                            }
                        }
                        for (r, acc) in acc.iter().enumerate() {
                            for (i, &x) in acc.iter().enumerate() {
                                // SAFETY: row r of the tile: NR writable f32 at c + r·ldc.
                                unsafe {
                                    let p = c.add(r * ldc + $lanes * i);
                                    let y = if accumulate { $add(x, $load(p)) } else { x };
                                    $store(p, y);
                                }
                            }
                        }
                    }
                    // SAFETY: this type exists only where the CPU has `$feature`; the
                    // caller upholds the slice and pointer contract.
                    unsafe { kernel(a, b, c, ldc, accumulate) }
                }
            }
        };
    }

    micro_kernel!(
        [
            /// The AVX-512 micro-kernel: 12 × 32 in 24 zmm accumulators.
            Avx512, mr = 12
        ],
        [
            /// An AVX-512 8 × 32 tile in 16 zmm accumulators, for row counts that are a
            /// multiple of 8 but not of 12 (attention's P·V over 64 or 128 head dims).
            Avx512x8, mr = 8
        ];
        has_avx512,
        "avx512f",
        __m512,
        16,
        nv = 2,
        kc = 512,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps
    );

    micro_kernel!(
        [
            /// The AVX2 + FMA micro-kernel: 6 × 16 in 12 ymm accumulators.
            Avx2, mr = 6
        ];
        has_avx2_fma,
        "avx2,fma",
        __m256,
        8,
        nv = 2,
        kc = 256,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_shape_gives_each_thread_several_tasks() {
        // One thread: one task of at most 192 × 256 outputs.
        assert_eq!(task_shape((1, 1), (12, 32), 1, 1), (1, 1));
        assert_eq!(task_shape((171, 64), (12, 32), 2048, 1), (16, 8));
        // 2048² on 16 threads: 256 columns, then 192 rows halve once: 22 × 16 tasks
        // of 96 × 128.
        assert_eq!(task_shape((171, 64), (12, 32), 2048, 16), (8, 4));
        // 1024²: 22 × 16 tasks of 48 × 64.
        assert_eq!(task_shape((86, 32), (12, 32), 1024, 16), (4, 2));
        // 512²: down to 48 × 32 outputs (786K multiply-adds, a half would be too
        // small), 11 × 16 = 176 tasks.
        assert_eq!(task_shape((43, 16), (12, 32), 512, 16), (4, 1));
        // Fewer tiles than tasks wanted: one tile per task.
        assert_eq!(task_shape((3, 2), (12, 32), 4096, 16), (1, 1));
    }

    /// The driver (packing, task split, edge tiles, k blocks, epilogue) with every
    /// micro-kernel this CPU has, against a plain f64 product.
    #[test]
    fn sgemm_matches_a_plain_product() {
        fn check<M: Micro>(mk: M) {
            for (m, k, n, transposed) in [
                (1, 1, 1, false),
                (7, 300, 45, true),
                (37, 513, 70, false),
                (130, 260, 600, true),
                (300, 70, 200, false),
            ] {
                let a: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                    .collect();
                let b: Vec<f32> = (0..k * n)
                    .map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0)
                    .collect();
                // B as given, or stored transposed ([n, k]) like a linear layer's weights.
                let (bt, rhs) = if transposed {
                    let mut t = vec![0f32; n * k];
                    for p in 0..k {
                        for j in 0..n {
                            t[j * k + p] = b[p * n + j];
                        }
                    }
                    (t, (1, k))
                } else {
                    (b.clone(), (n, 1))
                };
                let ldc = n + 3;
                let mut c = vec![f32::NAN; (m - 1) * ldc + n];
                let epi = |seg: &mut [f32], c0: usize| {
                    seg.iter_mut()
                        .enumerate()
                        .for_each(|(j, x)| *x += (c0 + j) as f32)
                };
                let lhs = Strided {
                    data: &a,
                    rs: k,
                    cs: 1,
                };
                let rhs = Strided {
                    data: &bt,
                    rs: rhs.0,
                    cs: rhs.1,
                };
                let column = |j: usize, dst: &mut [f32]| {
                    for (p, d) in dst.iter_mut().enumerate() {
                        *d = b[p * n + j];
                    }
                };
                let by_lines = Operand {
                    src: Source::Lines(&column),
                    lines: n,
                    k,
                };
                let lhs = Operand::strided(lhs, m, lhs.rs, lhs.cs);
                // B as a strided view and as columns written by a function; the default
                // chunking, and operands packed a few panels at a time.
                let rhs_all = [Operand::strided(rhs, n, rhs.cs, rhs.rs), by_lines];
                for (rhs, limit) in rhs_all
                    .into_iter()
                    .flat_map(|r| [(r, PACK_LIMIT), (r, 3 * k * 32)])
                {
                    c.fill(f32::NAN);
                    sgemm_chunked(mk, (m, n, k), &mut c, ldc, (lhs, rhs), Some(&epi), limit);
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k)
                                .map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]))
                                .sum::<f64>()
                                + j as f64;
                            let got = f64::from(c[i * ldc + j]);
                            assert!(
                                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                                "{m}x{k}x{n} limit {limit} [{i},{j}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        check(Portable);
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(mk) = Avx2::detect() {
                check(mk);
            }
            if let Some(mk) = Avx512::detect() {
                check(mk);
            }
        }
    }

    #[test]
    fn pack_pads_and_transposes() {
        // A 3 × 2 row-major matrix packed as rows in panels of 2: lines 0, 1 | 2, pad.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut p = [9.0; 4];
        pack(&mut p, 2, 0, 3, &a, 2, 1);
        assert_eq!(p, [1.0, 3.0, 2.0, 4.0]);
        pack(&mut p, 2, 2, 3, &a, 2, 1);
        assert_eq!(p, [5.0, 0.0, 6.0, 0.0]);
        // Its first k step only.
        let mut q = [9.0; 2];
        pack(&mut q, 2, 0, 3, &a, 2, 1);
        assert_eq!(q, [1.0, 3.0]);
        // The same matrix as columns (line stride 1, k stride 2): a copy per k step.
        let mut r = [9.0; 6];
        pack(&mut r, 2, 0, 2, &a, 1, 2);
        assert_eq!(r, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // Neither stride 1.
        let mut t = [9.0; 4];
        pack(&mut t, 2, 0, 2, &a, 2, 3);
        assert_eq!(t, [1.0, 3.0, 4.0, 6.0]);
    }

    /// The full-panel fast paths (copy, transpose in scalar code and in AVX blocks)
    /// write what the general loop writes.
    #[test]
    fn full_panels_pack_like_the_general_loop() {
        fn check<const W: usize>(kc: usize) {
            let lines = W + 3;
            let data: Vec<f32> = (0..lines * kc).map(|i| i as f32).collect();
            for (ls, ps) in [(kc, 1), (1, lines)] {
                let mut want = vec![0f32; W * kc];
                for (p, step) in want.chunks_exact_mut(W).enumerate() {
                    for (l, x) in step.iter_mut().enumerate() {
                        *x = data[(2 + l) * ls + p * ps];
                    }
                }
                let avx = cfg!(target_arch = "x86_64") && crate::cpu::simd::has_avx2_fma();
                for simd in [false, avx] {
                    let mut got = vec![f32::NAN; W * kc];
                    assert!(pack_full::<W>(&mut got, 2, &data, ls, ps, simd));
                    assert_eq!(got, want, "W {W} kc {kc} ls {ls} simd {simd}");
                }
            }
        }
        for kc in [1, 7, 8, 19, 64] {
            check::<4>(kc);
            check::<6>(kc);
            check::<12>(kc);
            check::<16>(kc);
            check::<32>(kc);
        }
    }
}
