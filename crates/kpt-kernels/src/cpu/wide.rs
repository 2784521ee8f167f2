//! AVX-512 dot products of one f32 row against four weight rows at once, the inner
//! loop of the decode (`m = 1`) GEMV.
//!
//! Portable code (`simd::dot_decode`) runs one weight row at a time with two vector
//! accumulators and sums the lanes sequentially; on a 512-bit machine that is bound by
//! the FMA and add latency chains, not by loading the weights. Four rows share each
//! load of `x`, eight accumulators keep both FMA pipes busy, and the four lane sums
//! overlap.

use super::simd::{Decode, E4M3, E5M2};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A stored weight type that AVX-512 code widens to f32 sixteen at a time.
pub(crate) trait Widen: Decode {
    /// The sixteen elements at `p`, widened to f32 (element by element unless the type
    /// has a vector conversion).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `p` points at 16 readable elements.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        let mut v = [0f32; 16];
        for (i, o) in v.iter_mut().enumerate() {
            // SAFETY: i < 16 elements are readable (caller).
            *o = unsafe { *p.add(i) }.decode();
        }
        // SAFETY: `v` holds 16 f32.
        unsafe { _mm512_loadu_ps(v.as_ptr()) }
    }
}

impl Widen for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: 16 readable f32 (caller).
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Widen for half::bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: 16 readable bf16 = 32 bytes (caller). bf16 is the top half of an f32.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

impl Widen for half::f16 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: 16 readable f16 = 32 bytes (caller).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl Widen for i8 {
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: 16 readable bytes (caller).
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
}

impl Widen for E4M3 {}
impl Widen for E5M2 {}

/// Weight rows per step.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 4;

/// Steps ahead whose weight lines are prefetched: weights streamed from DRAM on a
/// 2-core Zen 4 ran at 12 vs 8.4 GB/s per core (f32, one thread) with 2 steps, no
/// faster with 4; cache-resident weights are unaffected.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 2;

/// `out[j] = Σ_i x_i · row(j)_i` for `j < out.len()`, four rows per [`dot4`] (the last
/// step repeats the last row as filler). Each row is at least `x.len()` long.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ and FMA ([`super::simd::has_avx512`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
pub(crate) unsafe fn dots<'a, T: Widen + 'a>(
    x: &[f32],
    row: impl Fn(usize) -> &'a [T],
    out: &mut [f32],
) {
    let last = out.len().saturating_sub(1);
    for (j0, dst) in (0..).step_by(ROWS).zip(out.chunks_mut(ROWS)) {
        let at = |r: usize| row((j0 + r).min(last));
        // SAFETY: the caller guarantees the target features.
        let d = unsafe { dot4(x, [at(0), at(1), at(2), at(3)]) };
        dst.copy_from_slice(&d[..dst.len()]);
    }
}

/// `[Σ_i x_i · w[r]_i]` for four weight rows, each at least `x.len()` long.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ and FMA ([`super::simd::has_avx512`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
pub(crate) unsafe fn dot4<T: Widen>(x: &[f32], w: [&[T]; ROWS]) -> [f32; ROWS] {
    let k = x.len();
    assert!(w.iter().all(|w| w.len() >= k), "weight rows shorter than x");
    let xp = x.as_ptr();
    let wp = [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr()];
    let mut lo = [_mm512_setzero_ps(); ROWS];
    let mut hi = [_mm512_setzero_ps(); ROWS];
    let mut p = 0;
    // SAFETY (all loads): p + 32 <= k, and x and every row hold k elements.
    while p + 32 <= k {
        let (x0, x1) = unsafe { (_mm512_loadu_ps(xp.add(p)), _mm512_loadu_ps(xp.add(p + 16))) };
        for r in 0..ROWS {
            // The same columns AHEAD·ROWS rows further on, the caller's step after next
            // when rows are consecutive (a prefetch never faults, even past the end).
            let ahead = wp[r].wrapping_add(AHEAD * ROWS * k + p).cast::<i8>();
            for line in (0..32 * size_of::<T>()).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
            }
            let (w0, w1) = unsafe { (T::load16(wp[r].add(p)), T::load16(wp[r].add(p + 16))) };
            lo[r] = _mm512_fmadd_ps(x0, w0, lo[r]);
            hi[r] = _mm512_fmadd_ps(x1, w1, hi[r]);
        }
        p += 32;
    }
    // The last k % 32 elements, 16 (or fewer, zero-padded) at a time.
    while p < k {
        let n = (k - p).min(16);
        let mut xs = [0f32; 16];
        xs[..n].copy_from_slice(&x[p..p + n]);
        // SAFETY: `xs` holds 16 f32.
        let xv = unsafe { _mm512_loadu_ps(xs.as_ptr()) };
        for r in 0..ROWS {
            let mut ws = [0f32; 16];
            for (o, v) in ws.iter_mut().zip(&w[r][p..p + n]) {
                *o = v.decode();
            }
            // SAFETY: `ws` holds 16 f32.
            lo[r] = _mm512_fmadd_ps(xv, unsafe { _mm512_loadu_ps(ws.as_ptr()) }, lo[r]);
        }
        p += n;
    }
    let mut dots = [0f32; ROWS];
    for r in 0..ROWS {
        dots[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
    }
    dots
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::cpu::simd::has_avx512;
    use half::{bf16, f16};
    use kpt_core::rand::SplitMix64;

    fn check<T: Widen>(name: &str, w: &[T], x: &[f32], k: usize) {
        let rows: [&[T]; ROWS] = std::array::from_fn(|r| &w[r * k..(r + 1) * k]);
        // SAFETY: AVX-512 was detected by the caller.
        let got = unsafe { dot4(x, rows) };
        for (r, (&g, row)) in got.iter().zip(rows).enumerate() {
            let want: f64 = x
                .iter()
                .zip(row)
                .map(|(&a, b)| f64::from(a) * f64::from(b.decode()))
                .sum();
            let bound = 1e-5 * (k as f64).sqrt() * (1.0 + want.abs());
            assert!(
                (f64::from(g) - want).abs() <= bound,
                "{name} k {k} row {r}: {g} vs {want}"
            );
        }
    }

    /// Every widened type and every length class (below 16, 16..32, whole 32s, tails)
    /// against an f64 sum of the decoded weights.
    #[test]
    fn dot4_matches_f64_for_every_type_and_length() {
        if !has_avx512() {
            return;
        }
        let mut rng = SplitMix64::new(11);
        for k in [1, 7, 16, 17, 31, 32, 33, 64, 95, 512, 1376] {
            let x = rng.vec(k, -1.0, 1.0);
            let w = rng.vec(ROWS * k, -1.0, 1.0);
            check("f32", &w, &x, k);
            let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            check("bf16", &b, &x, k);
            let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            check("f16", &h, &x, k);
            let i: Vec<i8> = w.iter().map(|&v| (v * 127.0) as i8).collect();
            check("i8", &i, &x, k);
            let e: Vec<E4M3> = (0..ROWS * k)
                .map(|j| E4M3((j * 37 % 251) as u8 & 0xFE))
                .collect();
            check("e4m3", &e, &x, k);
        }
    }
}
