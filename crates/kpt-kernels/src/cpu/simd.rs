//! Building blocks for the fast kernels: a vectorizable `exp`, branch-free decoders from
//! the stored weight dtypes to f32, and the run-time AVX2/FMA dispatch.
//!
//! Everything here is plain safe Rust written so that LLVM vectorizes it (fixed-size
//! arrays, no data-dependent branches). Generic bodies are `#[inline(always)]` and take a
//! `const FMA: bool`; [`dispatch!`] instantiates them inside a
//! `#[target_feature(enable = "avx512f,…")]` wrapper (512-bit SIMD), an `avx2,fma`
//! wrapper (256-bit SIMD and FMA even though the crate is built for baseline x86-64) and
//! a portable copy, and picks the best the CPU has at run time.

/// Whether the running CPU has AVX-512 F/BW/VL/DQ (cached by std after the first call).
#[inline]
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the running CPU has AVX2 and FMA (cached by std after the first call).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(args) -> ret` that calls `$body::<true>(args)` compiled with
/// AVX-512 (F/BW/VL/DQ) or else `avx2,fma` when the CPU has them, and
/// `$body::<false>(args)` otherwise. With `=> $body [W, A, P]` the body's generic
/// arguments are `W` in the AVX-512 copy, `A` in the AVX2 copy and `P` in the portable
/// one (e.g. micro-kernel types sized for 32 zmm or 16 ymm registers). A generic
/// `fn $name<T: Bound>` spells out the body's generic arguments per copy:
/// `=> $body [true, T] [true, T] [false, T]`.
macro_rules! dispatch {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident
    ) => {
        $crate::cpu::simd::dispatch!(@gen [$(#[$meta])*] $vis fn $name[]($($arg: $ty),*)
            $(-> $ret)? => $body [true] [true] [false]);
    };
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?
            => $body:ident [$wide:ty, $avx2:ty, $portable:ty]
    ) => {
        $crate::cpu::simd::dispatch!(@gen [$(#[$meta])*] $vis fn $name[]($($arg: $ty),*)
            $(-> $ret)? => $body [$wide] [$avx2] [$portable]);
    };
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident<$($gp:ident: $gb:ident $(+ $gbs:ident)*),+>(
            $($arg:ident : $ty:ty),* $(,)?)
            $(-> $ret:ty)? => $body:ident [$($g512:tt)*] [$($g256:tt)*] [$($gport:tt)*]
    ) => {
        $crate::cpu::simd::dispatch!(@gen [$(#[$meta])*] $vis fn $name[$($gp: $gb $(+ $gbs)*),+](
            $($arg: $ty),*) $(-> $ret)? => $body [$($g512)*] [$($g256)*] [$($gport)*]);
    };
    (
        @gen [$($meta:tt)*] $vis:vis fn $name:ident[$($gp:ident: $gb:ident $(+ $gbs:ident)*),*](
            $($arg:ident : $ty:ty),*) $(-> $ret:ty)?
            => $body:ident [$($g512:tt)*] [$($g256:tt)*] [$($gport:tt)*]
    ) => {
        $($meta)*
        $vis fn $name<$($gp: $gb $(+ $gbs)*),*>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn avx512<$($gp: $gb $(+ $gbs)*),*>($($arg: $ty),*) $(-> $ret)? {
                    $body::<$($g512)*>($($arg),*)
                }
                if $crate::cpu::simd::has_avx512() {
                    // SAFETY: `avx512` is safe code whose only requirement is the target
                    // features it enables, detected on this CPU just above.
                    return unsafe { avx512($($arg),*) };
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2_fma<$($gp: $gb $(+ $gbs)*),*>($($arg: $ty),*) $(-> $ret)? {
                    $body::<$($g256)*>($($arg),*)
                }
                if $crate::cpu::simd::has_avx2_fma() {
                    // SAFETY: `avx2_fma` is safe code whose only requirement is the
                    // `avx2` and `fma` target features, detected on this CPU just above.
                    return unsafe { avx2_fma($($arg),*) };
                }
            }
            $body::<$($gport)*>($($arg),*)
        }
    };
}
pub(crate) use dispatch;

/// `a * b + c`, fused when `FMA` (only instantiated as `true` where FMA is enabled, so it
/// compiles to `vfmadd`; a libm call would be far slower than the unfused form).
#[inline(always)]
pub(crate) fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `2^e` for an integer `-126 <= e <= 127`, built from the exponent bits.
#[inline(always)]
fn pow2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `e^x` in f32, branch-free and vectorizable; relative error below 3 ulp over the
/// normal range, correct 0 / +inf / NaN at the ends (`-inf -> 0`).
///
/// Cody–Waite reduction `x = n ln2 + r`, `|r| <= ln2/2`, degree-7 Taylor polynomial
/// for `e^r` (truncation error < 6e-9), and `2^n` applied as two exponent-bit factors so
/// that results from the subnormal range up to overflow come out right.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp_f32_fma::<false>(x)
}

/// [`exp_f32`] with its polynomial and reduction fused into FMAs when `FMA` (only
/// instantiate `true` where the FMA feature is enabled; see [`fmadd`]).
#[inline(always)]
pub(crate) fn exp_f32_fma<const FMA: bool>(x: f32) -> f32 {
    // Clamp (NaN passes through `clamp`): below -104 the result underflows to 0,
    // above 88.73 it overflows to +inf.
    let (p, n) = exp_parts::<FMA>(x.clamp(-104.0, 88.73));
    let n1 = n >> 1;
    p * pow2i(n1) * pow2i(n - n1)
}

/// `e^x` for `x <= 88.7` where results below 2⁻¹²⁶ may be 0: a softmax after
/// subtracting the row maximum (an input below -87.3 gives 0, next to the maximum's
/// 1). One exponent factor instead of [`exp_f32_fma`]'s two; same accuracy above
/// -87.3; `-inf -> 0`, NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_softmax_f32_fma<const FMA: bool>(x: f32) -> f32 {
    const LOW: f32 = -87.3;
    // `x < LOW` is false for NaN, which then flows through the polynomial.
    let (p, n) = exp_parts::<FMA>(if x < LOW { LOW } else { x });
    if x < LOW {
        0.0
    } else {
        p * pow2i(n)
    }
}

/// `(e^r, n)` with `x = n·ln 2 + r`, `|r| <= ln2/2` (Cody–Waite, degree-7 Taylor), for
/// `-104 <= x <= 88.73` (or NaN).
#[inline(always)]
fn exp_parts<const FMA: bool>(xc: f32) -> (f32, i32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 0.693359375, exact in 9 bits: n * LN2_HI is exact.
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer.
    const MAGIC: f32 = 12_582_912.0;
    let t = xc * LOG2E + MAGIC;
    let n_f = t - MAGIC;
    let n = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = fmadd::<FMA>(-n_f, LN2_LO, fmadd::<FMA>(-n_f, LN2_HI, xc));
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = fmadd::<FMA>(p, r, c);
    }
    (p, n)
}

/// 2¹²⁰: rescales an FP8 E4M3 magnitude placed in f32's exponent/mantissa bits.
const TWO_POW_120: f32 = f32::from_bits((120 + 127) << 23);
/// 2¹¹²: rescales an f16 magnitude placed in f32's exponent/mantissa bits.
const TWO_POW_112: f32 = f32::from_bits((112 + 127) << 23);

/// bf16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bf16 bits: round to nearest even, NaN stays (quiet) NaN; same as `half`.
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if x.is_nan() { nan } else { rounded }) as u16
}

/// f16 bits to f32 (exact, subnormals, infinities and NaN included), branch-free.
///
/// The bits are sign-extended once: the low 15 bits are the magnitude, bit 31 the sign
/// (one widening instruction per 8 lanes instead of two).
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let v = h as i16 as i32 as u32;
    let em = v & 0x7fff;
    // Normal and subnormal: the f16 exponent/mantissa moved into f32 position, times
    // 2^(127-15) (an f16 subnormal becomes an f32 subnormal, scaled back exactly).
    let finite = f32::from_bits(em << 13) * TWO_POW_112;
    let special = f32::from_bits((em << 13) | 0x7f80_0000);
    let mag = if em >= 0x7c00 { special } else { finite };
    f32::from_bits(mag.to_bits() | (v & 0x8000_0000))
}

/// FP8 E4M3 ("fn": no infinities, 0x7f/0xff are NaN) bits to f32 (exact), branch-free.
#[inline(always)]
pub(crate) fn f8e4m3_bits_to_f32(b: u8) -> f32 {
    let v = b as i8 as i32 as u32;
    let em = v & 0x7f;
    // Same trick as f16: exponent bias 7 -> 127 is a factor 2^120, subnormals included.
    let finite = f32::from_bits(em << 20) * TWO_POW_120;
    let mag = if em == 0x7f { f32::NAN } else { finite };
    f32::from_bits(mag.to_bits() | (v & 0x8000_0000))
}

/// FP8 E5M2 bits to f32 (exact; E5M2 is the upper byte of an f16).
#[inline(always)]
pub(crate) fn f8e5m2_bits_to_f32(b: u8) -> f32 {
    let v = b as i8 as i32 as u32;
    let em = v & 0x7f;
    let finite = f32::from_bits(em << 21) * TWO_POW_112;
    let special = f32::from_bits((em << 21) | 0x7f80_0000);
    let mag = if em >= 0x7c { special } else { finite };
    f32::from_bits(mag.to_bits() | (v & 0x8000_0000))
}

/// A stored element type that decodes to f32 without a scale.
pub(crate) trait Decode: Copy + Send + Sync {
    /// The element as f32.
    fn decode(self) -> f32;

    /// The slice itself when it already is f32 (lets kernels skip a widening copy).
    #[inline(always)]
    fn as_f32(_s: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Decode for f32 {
    #[inline(always)]
    fn decode(self) -> f32 {
        self
    }

    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Decode for half::bf16 {
    #[inline(always)]
    fn decode(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
}

impl Decode for half::f16 {
    #[inline(always)]
    fn decode(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
}

impl Decode for i8 {
    #[inline(always)]
    fn decode(self) -> f32 {
        self as f32
    }
}

/// A stored element type that f32 results are rounded to (to nearest even).
pub(crate) trait Encode: Copy + Send + Sync {
    /// `x` rounded to the type.
    fn encode(x: f32) -> Self;

    /// `out[i] = encode(x[i])` over the shorter of the two, vectorized.
    fn encode_slice(x: &[f32], out: &mut [Self]);
}

impl Encode for f32 {
    #[inline(always)]
    fn encode(x: f32) -> Self {
        x
    }

    fn encode_slice(x: &[f32], out: &mut [Self]) {
        let n = x.len().min(out.len());
        out[..n].copy_from_slice(&x[..n]);
    }
}

impl Encode for half::bf16 {
    #[inline(always)]
    fn encode(x: f32) -> Self {
        half::bf16::from_bits(f32_to_bf16_bits(x))
    }

    fn encode_slice(x: &[f32], out: &mut [Self]) {
        f32_to_bf16_slice(x, bytemuck::cast_slice_mut(out));
    }
}

#[inline(always)]
fn f32_to_bf16_body<const SIMD: bool>(x: &[f32], out: &mut [u16]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f32_to_bf16_bits(v);
    }
}

dispatch!(
    /// `out[i] = f32_to_bf16_bits(x[i])` over the shorter of the two.
    pub(crate) fn f32_to_bf16_slice(x: &[f32], out: &mut [u16]) => f32_to_bf16_body
);

/// FP8 E4M3 bits (`bytemuck::cast_slice` turns `&[u8]` into `&[E4M3]`).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub(crate) struct E4M3(pub u8);

impl Decode for E4M3 {
    #[inline(always)]
    fn decode(self) -> f32 {
        f8e4m3_bits_to_f32(self.0)
    }
}

/// FP8 E5M2 bits (`bytemuck::cast_slice` turns `&[u8]` into `&[E5M2]`).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub(crate) struct E5M2(pub u8);

impl Decode for E5M2 {
    #[inline(always)]
    fn decode(self) -> f32 {
        f8e5m2_bits_to_f32(self.0)
    }
}

/// Sum of vector partial sums, left to right.
///
/// Deliberately a plain sequential sum: a pairwise reduction tree right after a
/// vectorized accumulation loop makes LLVM's SLP vectorizer regroup the accumulator
/// lanes and turn the loop into 128-bit shuffles (measured 3-5x slower).
#[inline(always)]
pub(crate) fn hsum<const N: usize>(a: [f32; N]) -> f32 {
    a.iter().sum()
}

/// `Σ x_i · decode(w_i)`: 32 lanes in 4 independent vector accumulators, weights decoded
/// in registers (compiles to load / widen / FMA, no spills).
#[inline(always)]
pub(crate) fn dot_decode<const FMA: bool, T: Decode>(x: &[f32], w: &[T]) -> f32 {
    const L: usize = 32;
    let mut acc = [0f32; L];
    let xc = x.chunks_exact(L);
    let wc = w.chunks_exact(L);
    let (xt, wt) = (xc.remainder(), wc.remainder());
    for (xs, ws) in xc.zip(wc) {
        for j in 0..L {
            acc[j] = fmadd::<FMA>(xs[j], ws[j].decode(), acc[j]);
        }
    }
    let mut tail = 0f32;
    for (a, b) in xt.iter().zip(wt) {
        tail = fmadd::<FMA>(*a, b.decode(), tail);
    }
    hsum(acc) + tail
}

/// Decodes `src` into `dst` (same length), multiplying by `scale`.
#[inline(always)]
pub(crate) fn decode_scaled<T: Decode>(src: &[T], scale: f32, dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.decode() * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_handles_ends() {
        let mut worst = 0.0f64;
        let mut x = -103.0f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            for got in [exp_f32(x) as f64, exp_f32_fma::<true>(x) as f64] {
                if want > f32::MIN_POSITIVE as f64 {
                    worst = worst.max((got - want).abs() / want);
                } else {
                    assert!((got - want).abs() <= 2.0 * 1.5e-45, "exp({x})");
                }
            }
            x += 0.0137;
        }
        assert!(worst < 3.0 * f32::EPSILON as f64, "worst rel err {worst:e}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.72).is_finite());
    }

    #[test]
    fn softmax_exp_matches_exp_above_its_cutoff() {
        let mut x = -90.0f32;
        while x < 1.0 {
            let got = exp_softmax_f32_fma::<true>(x);
            if x < -87.3 {
                assert_eq!(got, 0.0, "exp({x})");
            } else {
                assert_eq!(got, exp_f32_fma::<true>(x), "exp({x})");
            }
            x += 0.0071;
        }
        assert_eq!(exp_softmax_f32_fma::<false>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_softmax_f32_fma::<false>(0.0), 1.0);
        assert!(exp_softmax_f32_fma::<false>(f32::NAN).is_nan());
    }

    #[test]
    fn decoders_match_reference_conversions() {
        for b in 0..=255u8 {
            let (got, want) = (f8e4m3_bits_to_f32(b), kpt_core::dtype::f8e4m3_to_f32(b));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{b:#x}"
            );
            let (got, want) = (f8e5m2_bits_to_f32(b), kpt_core::dtype::f8e5m2_to_f32(b));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{b:#x}"
            );
        }
        for h in 0..=u16::MAX {
            let (got, want) = (f16_bits_to_f32(h), half::f16::from_bits(h).to_f32());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#x}"
            );
            let x = f32::from_bits((h as u32) << 16 | 0x8000);
            let y = f32::from_bits((h as u32) << 16 | 0x7fff);
            for v in [x, y, bf16_bits_to_f32(h)] {
                let (got, want) = (f32_to_bf16_bits(v), half::bf16::from_f32(v).to_bits());
                assert!(
                    got == want || (v.is_nan() && bf16_bits_to_f32(got).is_nan()),
                    "{v}"
                );
            }
        }
    }
}
