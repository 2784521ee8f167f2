//! kpt's own f32 GEMM for x86-64, the structure of BLIS and of the kernels in MKL /
//! oneDNN. The default on AVX-512 CPUs; its AVX2 kernel runs with `KPT_CPU_GEMM=own`
//! (the `gemm` crate measured faster on AVX2) and in this module's tests.
//!
//! - The output is split into one rectangle of micro-tiles per rayon thread (see
//!   [`split`]). Each task packs the operand blocks it needs itself, right before use,
//!   into its thread's scratch buffers, so packed data never leaves the core's caches:
//!   blocks of `NC` columns, then k blocks of `KC`; the B block (`KC × NC`, `NR`-column
//!   micro-panels stored k-major, in L2), then per `MR` rows an A micro-panel
//!   (`KC × MR`, in L1) that meets every B micro-panel of the block. Panels are
//!   zero-padded at the edges; any row / column strides are accepted, so transposed
//!   operands (the weights of a linear layer, `[n, k]`) cost nothing extra.
//! - The micro-kernel keeps an `MR × NR` tile of f32 accumulators in registers
//!   (AVX-512: 12 × 32 in 24 zmm; AVX2: 6 × 16 in 12 ymm), broadcasts one A value per
//!   row and k step and issues two FMAs per row; it adds to the output after the first
//!   k block. Edge tiles run the same kernel on a local tile.
//! - An optional epilogue (bias, activation) runs on each finished row segment while it
//!   is still in cache.

use rayon::prelude::*;

use super::gemm::Strided;
use super::scratch::Scratch;

/// A register-blocked micro-kernel and the blocking that suits it.
pub(crate) trait Micro: Copy + Send + Sync {
    /// Rows of the register tile.
    const MR: usize;
    /// Columns of the register tile.
    const NR: usize;
    /// k steps per block (the A micro-panel, `MR × KC`, stays in L1).
    const KC: usize;
    /// Columns per block of B kept in L2 (a multiple of `NR`).
    const NC: usize;

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
    let (mp, np) = (m.div_ceil(M::MR), n.div_ceil(M::NR));
    let work = m.saturating_mul(n).saturating_mul(k);
    let threads = if work >= PAR_THRESHOLD {
        rayon::current_num_threads()
    } else {
        1
    };
    let (pm, pn) = split(mp, np, M::MR, M::NR, threads);
    let (rows_per, cols_per) = (mp.div_ceil(pm), np.div_ceil(pn));
    debug_assert!(dst.len() > (m - 1) * dst_rs + n - 1);
    let out = OutPtr(dst.as_mut_ptr());
    let d = Dims {
        m,
        n,
        k,
        ldc: dst_rs,
    };
    let task = |t: usize| {
        let (ti, tj) = (t / pn, t % pn);
        let ip = ti * rows_per..((ti + 1) * rows_per).min(mp);
        let jp = tj * cols_per..((tj + 1) * cols_per).min(np);
        // SAFETY: the rectangles of different `t` are disjoint (rows `ip` × columns
        // `jp` of a pm × pn grid), `out` covers every output element (checked by the
        // caller), and `dst` stays borrowed until all tasks are done.
        unsafe { rectangle(mk, lhs, rhs, out, d, ip, jp, epi) };
    };
    if pm * pn == 1 {
        task(0);
    } else {
        (0..pm * pn).into_par_iter().for_each(task);
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

/// The task grid `(row groups, column groups)` for `mp × np` micro-tiles of
/// `mr × nr` on `threads`, minimizing the largest task's estimated time: its
/// multiply-adds (32 per cycle) plus half of its operand traffic per k step
/// (`rows + columns` f32 at about 16 bytes per cycle), which favours square tasks.
fn split(mp: usize, np: usize, mr: usize, nr: usize, threads: usize) -> (usize, usize) {
    let mut best = (usize::MAX, 1, 1);
    for pm in 1..=threads.min(mp) {
        let pn = (threads / pm).clamp(1, np);
        let (r, c) = (mp.div_ceil(pm), np.div_ceil(pn));
        let cost = r * c * mr * nr * 4 + (r * mr + c * nr) * 16;
        if cost < best.0 {
            best = (cost, mp.div_ceil(r), np.div_ceil(c));
        }
    }
    (best.1, best.2)
}

/// Packs lines `first..first + width` (rows of A or columns of B; `lines` in all) over
/// k steps `k0..k0 + kc` into `panel`, k-major:
/// `panel[p * width + l] = data[(first + l) * ls + (k0 + p) * ps]`, zero past the last
/// line.
#[allow(clippy::too_many_arguments)]
fn pack(
    panel: &mut [f32],
    width: usize,
    first: usize,
    lines: usize,
    k0: usize,
    data: &[f32],
    ls: usize,
    ps: usize,
) {
    let live = width.min(lines - first);
    if live < width {
        panel.fill(0.0);
    }
    if ls == 1 {
        // Lines adjacent in memory: one contiguous copy per k step.
        for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
            dst[..live].copy_from_slice(&data[first + (k0 + p) * ps..][..live]);
        }
    } else if ps == 1 {
        // Each line contiguous along k: read lines, write strided.
        let kc = panel.len() / width;
        for l in 0..live {
            let src = &data[(first + l) * ls + k0..][..kc];
            for (dst, &v) in panel.chunks_exact_mut(width).zip(src) {
                dst[l] = v;
            }
        }
    } else {
        for (p, dst) in panel.chunks_exact_mut(width).enumerate() {
            for (l, d) in dst[..live].iter_mut().enumerate() {
                *d = data[(first + l) * ls + (k0 + p) * ps];
            }
        }
    }
}

/// Computes the output rectangle of row panels `ip` × column panels `jp`.
///
/// # Safety
/// `out` points at the output (`m` rows, `ldc` apart, `n` columns each) and no other
/// thread accesses this rectangle during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn rectangle<M: Micro>(
    mk: M,
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    out: OutPtr,
    d: Dims,
    ip: std::ops::Range<usize>,
    jp: std::ops::Range<usize>,
    epi: Option<Epilogue<'_>>,
) {
    let (mr, nr, k) = (M::MR, M::NR, d.k);
    assert!(mr * nr <= MAX_TILE, "register tile larger than MAX_TILE");
    let block = (M::NC / nr).max(1);
    let mut ap = Scratch::<f32>::new(M::KC * mr);
    let mut bp = Scratch::<f32>::new(M::KC * nr * block.min(jp.len()));
    let mut edge = [0f32; MAX_TILE];
    let mut tile = |a: &[f32], b: &[f32], i: usize, j: usize, accumulate: bool| {
        let (rows, cols) = (mr.min(d.m - i * mr), nr.min(d.n - j * nr));
        // SAFETY: tile (i, j) lies in this task's rectangle (caller), inside the output.
        let c = unsafe { out.0.add(i * mr * d.ldc + j * nr) };
        if rows == mr && cols == nr {
            // SAFETY: a full tile: MR rows × NR columns of the output; a, b hold kc steps.
            unsafe { mk.tile(a, b, c, d.ldc, accumulate) };
            return;
        }
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
    };
    let mut jc = jp.start;
    while jc < jp.end {
        let jc_end = (jc + block).min(jp.end);
        let mut kb = 0;
        while kb < k {
            let kc = M::KC.min(k - kb);
            let bblock = &mut bp[..(jc_end - jc) * kc * nr];
            for (j, panel) in (jc..).zip(bblock.chunks_exact_mut(kc * nr)) {
                pack(panel, nr, j * nr, d.n, kb, rhs.data, rhs.cs, rhs.rs);
            }
            for i in ip.clone() {
                let a = &mut ap[..kc * mr];
                pack(a, mr, i * mr, d.m, kb, lhs.data, lhs.rs, lhs.cs);
                for (j, b) in (jc..).zip(bblock.chunks_exact(kc * nr)) {
                    tile(a, b, i, j, kb > 0);
                }
            }
            kb += kc;
        }
        if let Some(f) = epi {
            let c0 = jc * nr;
            let width = (jc_end * nr).min(d.n) - c0;
            for r in ip.start * mr..(ip.end * mr).min(d.m) {
                // SAFETY: a finished row segment of this task's rectangle.
                let seg =
                    unsafe { std::slice::from_raw_parts_mut(out.0.add(r * d.ldc + c0), width) };
                f(seg, c0);
            }
        }
        jc = jc_end;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Micro;
    use crate::cpu::simd;

    /// Defines the micro-kernel type `$name` (constructed only where `simd::$has()`):
    /// an `$mr × ($lanes · $nv)` register tile of `$v` vectors in the instruction set
    /// `$feature`, with C prefetched first.
    macro_rules! micro_kernel {
        ($(#[$doc:meta])* $name:ident, $has:ident, $feature:literal, $v:ty, $lanes:literal,
         mr = $mr:literal, nv = $nv:literal, kc = $kc:literal, nc = $nc:literal,
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
                const NC: usize = $nc;

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
        /// The AVX-512 micro-kernel: 12 × 32 in 24 zmm accumulators.
        Avx512,
        has_avx512,
        "avx512f",
        __m512,
        16,
        mr = 12,
        nv = 2,
        kc = 256,
        nc = 512,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps
    );

    micro_kernel!(
        /// The AVX2 + FMA micro-kernel: 6 × 16 in 12 ymm accumulators.
        Avx2,
        has_avx2_fma,
        "avx2,fma",
        __m256,
        8,
        mr = 6,
        nv = 2,
        kc = 256,
        nc = 256,
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
    fn split_balances_tiles() {
        assert_eq!(split(1, 1, 12, 32, 16), (1, 1));
        // 43 × 16 tiles on 16 threads: 4 × 4 tasks of at most 11 × 4, not 16 column
        // bands of 43 × 1 (one fewer tile, but every task reads all of A).
        assert_eq!(split(43, 16, 12, 32, 16), (4, 4));
        // A single row of panels: split the columns only, and the other way round.
        assert_eq!(split(1, 64, 12, 32, 8), (1, 8));
        assert_eq!(split(64, 1, 12, 32, 8), (8, 1));
    }

    /// The driver (packing, task split, edge tiles, k blocks, epilogue) with every
    /// micro-kernel this CPU has, against a plain f64 product.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sgemm_matches_a_plain_product() {
        fn check<M: Micro>(mk: M) {
            for (m, k, n, transposed) in [
                (1, 1, 1, false),
                (7, 300, 45, true),
                (37, 513, 70, false),
                (130, 260, 600, true),
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
                sgemm(
                    mk,
                    m,
                    n,
                    k,
                    &mut c,
                    ldc,
                    Strided {
                        data: &a,
                        rs: k,
                        cs: 1,
                    },
                    Strided {
                        data: &bt,
                        rs: rhs.0,
                        cs: rhs.1,
                    },
                    Some(&epi),
                );
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]))
                            .sum::<f64>()
                            + j as f64;
                        let got = f64::from(c[i * ldc + j]);
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{m}x{k}x{n} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
        if let Some(mk) = Avx2::detect() {
            check(mk);
        }
        if let Some(mk) = Avx512::detect() {
            check(mk);
        }
    }

    #[test]
    fn pack_pads_and_transposes() {
        // A 3 × 2 row-major matrix packed as rows in panels of 2: lines 0, 1 | 2, pad.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut p = [9.0; 4];
        pack(&mut p, 2, 0, 3, 0, &a, 2, 1);
        assert_eq!(p, [1.0, 3.0, 2.0, 4.0]);
        pack(&mut p, 2, 2, 3, 0, &a, 2, 1);
        assert_eq!(p, [5.0, 0.0, 6.0, 0.0]);
        // Its second k step only.
        let mut q = [9.0; 2];
        pack(&mut q, 2, 0, 3, 1, &a, 2, 1);
        assert_eq!(q, [2.0, 4.0]);
        // The same matrix as columns (line stride 1, k stride 2): a copy per k step.
        let mut r = [9.0; 6];
        pack(&mut r, 2, 0, 2, 0, &a, 1, 2);
        assert_eq!(r, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // Neither stride 1.
        let mut t = [9.0; 4];
        pack(&mut t, 2, 0, 2, 0, &a, 2, 3);
        assert_eq!(t, [1.0, 3.0, 4.0, 6.0]);
    }
}
