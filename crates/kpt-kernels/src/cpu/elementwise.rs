//! Elementwise kernels in f32: activations, broadcasting add/mul, embedding lookup,
//! quantization to FP8 / int8 and back, and f32 <-> bf16 / f16 casts.

use half::{bf16, f16, slice::HalfFloatSliceExt};
use kpt_core::Result;

use super::par::for_each_row;
use super::reference::{check_broadcast, check_embedding, check_scale, f64_to_f32_round_odd};
use super::simd::{self, dispatch, Decode, E4M3, E5M2};
use super::{check_len, Act};

/// Elements per parallel task of a streaming elementwise kernel.
const CHUNK: usize = 1 << 14;

#[inline(always)]
fn act_chunk<const FMA: bool>(x: &[f32], out: &mut [f32], act: Act) {
    // One loop per variant so that each one vectorizes on its own.
    match act {
        Act::Relu => out
            .iter_mut()
            .zip(x)
            .for_each(|(o, &v)| *o = Act::Relu.apply_f32(v)),
        Act::GeluErf => out
            .iter_mut()
            .zip(x)
            .for_each(|(o, &v)| *o = Act::GeluErf.apply_f32(v)),
        Act::GeluTanh => out
            .iter_mut()
            .zip(x)
            .for_each(|(o, &v)| *o = Act::GeluTanh.apply_f32(v)),
        Act::Silu => out
            .iter_mut()
            .zip(x)
            .for_each(|(o, &v)| *o = Act::Silu.apply_f32(v)),
    }
}

dispatch!(
    /// Applies `act` to every element of `x` (in place of `out`); used by the epilogues.
    pub(crate) fn act_slice(x: &[f32], out: &mut [f32], act: Act) => act_chunk
);

/// `out[i] = act(x[i])`.
pub fn activation(x: &[f32], out: &mut [f32], act: Act) -> Result<()> {
    check_len("activation", "out", out.len(), x.len())?;
    for_each_row(out, CHUNK, 8 * CHUNK, |c, o| {
        act_slice(&x[c * CHUNK..][..o.len()], o, act)
    });
    Ok(())
}

#[inline(always)]
fn gated_row<const FMA: bool>(gate: &[f32], up: &[f32], out: &mut [f32], act: Act) {
    act_chunk::<FMA>(gate, out, act);
    out.iter_mut().zip(up).for_each(|(o, &u)| *o *= u);
}

dispatch!(fn gated_row_d(gate: &[f32], up: &[f32], out: &mut [f32], act: Act) => gated_row);

/// Gated activation over rows of `2 * n` (a fused gate/up projection):
/// `out[r, c] = act(x[r, c]) * x[r, n + c]`, `out` `[rows, n]`.
pub fn act_and_mul(x: &[f32], out: &mut [f32], n: usize, act: Act) -> Result<()> {
    let rows = out.len().checked_div(n).unwrap_or(0);
    check_len("act_and_mul", "out [rows, n]", out.len(), rows * n)?;
    check_len("act_and_mul", "x [rows, 2n]", x.len(), rows * 2 * n)?;
    if n == 0 {
        return Ok(());
    }
    // Tasks of whole rows, at least about CHUNK outputs each.
    let per = CHUNK.div_ceil(n);
    for_each_row(out, per * n, 8 * per * n, |c, o| {
        let x = &x[c * per * 2 * n..];
        for (r, o) in o.chunks_exact_mut(n).enumerate() {
            let (gate, up) = x[r * 2 * n..(r + 1) * 2 * n].split_at(n);
            gated_row_d(gate, up, o, act);
        }
    });
    Ok(())
}

#[inline(always)]
fn binary_rows<const FMA: bool>(a: &[f32], b: &[f32], out: &mut [f32], is_mul: bool) {
    // `a` and `out` hold whole repetitions of `b`.
    for (oa, aa) in out.chunks_exact_mut(b.len()).zip(a.chunks_exact(b.len())) {
        if is_mul {
            oa.iter_mut()
                .zip(aa)
                .zip(b)
                .for_each(|((o, &x), &y)| *o = x * y);
        } else {
            oa.iter_mut()
                .zip(aa)
                .zip(b)
                .for_each(|((o, &x), &y)| *o = x + y);
        }
    }
}

dispatch!(fn binary_rows_d(a: &[f32], b: &[f32], out: &mut [f32], is_mul: bool) => binary_rows);

fn binary(op: &str, a: &[f32], b: &[f32], out: &mut [f32], is_mul: bool) -> Result<()> {
    check_broadcast(op, a.len(), b.len(), out.len())?;
    if b.is_empty() {
        return Ok(());
    }
    // Tasks of whole repetitions of `b`, at least about CHUNK elements each.
    let task = b.len() * CHUNK.div_ceil(b.len());
    for_each_row(out, task, task, |c, o| {
        binary_rows_d(&a[c * task..][..o.len()], b, o, is_mul)
    });
    Ok(())
}

/// `out = a + b`, where `b` is a trailing-suffix shape of `a`: `a.len() % b.len() == 0`
/// and `b` repeats over `a`'s leading rows.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    binary("add", a, b, out, false)
}

/// `out = a * b`, broadcasting `b` over `a`'s leading rows like [`add`].
pub fn mul(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    binary("mul", a, b, out, true)
}

/// Row lookup `out[i, :] = table[ids[i], :]` with `table [vocab, dim]`; any id outside
/// `0..vocab` is an [`InvalidArgument`](kpt_core::KptError::InvalidArgument) error
/// (checked before anything is written).
pub fn embedding(
    ids: &[i64],
    table: &[f32],
    out: &mut [f32],
    vocab: usize,
    dim: usize,
) -> Result<()> {
    check_embedding(ids, table.len(), out.len(), vocab, dim)?;
    for_each_row(out, dim, dim, |i, o| {
        let id = ids[i] as usize;
        o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
    });
    Ok(())
}

/// Quantizes chunks in parallel with the scalar `kpt_core` conversion `conv(x / scale)`.
///
/// The quotient is formed in f64 and rounded to f32 with round-to-odd, so the final
/// rounding by `conv` is the correctly rounded result of the exact `x / scale` (an f32
/// division could land exactly on a tie of the coarse grid and round the wrong way).
fn quantize_with<T: Copy + Send + Sync>(
    op: &str,
    x: &[f32],
    scale: f32,
    out: &mut [T],
    conv: fn(f32) -> T,
) -> Result<()> {
    check_scale(op, scale as f64)?;
    check_len(op, "out", out.len(), x.len())?;
    for_each_row(out, CHUNK, 8 * CHUNK, |c, o| {
        for (d, &v) in o.iter_mut().zip(&x[c * CHUNK..]) {
            *d = conv(f64_to_f32_round_odd(v as f64 / scale as f64));
        }
    });
    Ok(())
}

/// FP8 E4M3 bits of `x / scale` (correctly rounded to nearest even, saturating to ±448).
pub fn quantize_f8e4m3(x: &[f32], scale: f32, out: &mut [u8]) -> Result<()> {
    quantize_with(
        "quantize_f8e4m3",
        x,
        scale,
        out,
        kpt_core::dtype::f32_to_f8e4m3,
    )
}

/// FP8 E5M2 bits of `x / scale` (correctly rounded to nearest even, saturating to ±57344).
pub fn quantize_f8e5m2(x: &[f32], scale: f32, out: &mut [u8]) -> Result<()> {
    quantize_with(
        "quantize_f8e5m2",
        x,
        scale,
        out,
        kpt_core::dtype::f32_to_f8e5m2,
    )
}

/// `round(x / scale)` as int8 (correctly rounded, ties to even, saturating to ±127).
pub fn quantize_i8(x: &[f32], scale: f32, out: &mut [i8]) -> Result<()> {
    quantize_with("quantize_i8", x, scale, out, kpt_core::dtype::f32_to_i8)
}

#[inline(always)]
fn dequant_chunk<const FMA: bool, T: Decode>(src: &[T], scale: f32, out: &mut [f32]) {
    simd::decode_scaled(src, scale, out);
}

fn dequantize_with<T: Decode>(op: &str, src: &[T], scale: f32, out: &mut [f32]) -> Result<()> {
    check_len(op, "out", out.len(), src.len())?;
    for_each_row(out, CHUNK, 2 * CHUNK, |c, o| {
        let s = &src[c * CHUNK..][..o.len()];
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<T: Decode>(s: &[T], scale: f32, o: &mut [f32]) {
                dequant_chunk::<true, T>(s, scale, o);
            }
            if simd::has_avx2_fma() {
                // SAFETY: avx2 and fma were detected on this CPU.
                unsafe { avx2(s, scale, o) };
                return;
            }
        }
        dequant_chunk::<false, T>(s, scale, o);
    });
    Ok(())
}

/// `out = f8e4m3(bits) * scale`.
pub fn dequantize_f8e4m3(bits: &[u8], scale: f32, out: &mut [f32]) -> Result<()> {
    dequantize_with(
        "dequantize_f8e4m3",
        bytemuck::cast_slice::<u8, E4M3>(bits),
        scale,
        out,
    )
}

/// `out = f8e5m2(bits) * scale`.
pub fn dequantize_f8e5m2(bits: &[u8], scale: f32, out: &mut [f32]) -> Result<()> {
    dequantize_with(
        "dequantize_f8e5m2",
        bytemuck::cast_slice::<u8, E5M2>(bits),
        scale,
        out,
    )
}

/// `out = data * scale`.
pub fn dequantize_i8(data: &[i8], scale: f32, out: &mut [f32]) -> Result<()> {
    dequantize_with("dequantize_i8", data, scale, out)
}

/// f32 to bf16, round to nearest even (NaN stays NaN).
pub fn cast_f32_to_bf16(x: &[f32], out: &mut [bf16]) -> Result<()> {
    check_len("cast_f32_to_bf16", "out", out.len(), x.len())?;
    let out: &mut [u16] = out.reinterpret_cast_mut();
    for_each_row(out, CHUNK, CHUNK, |c, o| {
        simd::f32_to_bf16_slice(&x[c * CHUNK..][..o.len()], o)
    });
    Ok(())
}

/// bf16 to f32 (exact).
pub fn cast_bf16_to_f32(x: &[bf16], out: &mut [f32]) -> Result<()> {
    dequantize_with("cast_bf16_to_f32", x, 1.0, out)
}

/// f32 to f16, round to nearest even (`half`'s F16C-accelerated slice conversion).
pub fn cast_f32_to_f16(x: &[f32], out: &mut [f16]) -> Result<()> {
    check_len("cast_f32_to_f16", "out", out.len(), x.len())?;
    for_each_row(out, CHUNK, CHUNK, |c, o| {
        o.convert_from_f32_slice(&x[c * CHUNK..][..o.len()])
    });
    Ok(())
}

/// f16 to f32 (exact; `half`'s F16C-accelerated slice conversion).
pub fn cast_f16_to_f32(x: &[f16], out: &mut [f32]) -> Result<()> {
    check_len("cast_f16_to_f32", "out", out.len(), x.len())?;
    for_each_row(out, CHUNK, CHUNK, |c, o| {
        x[c * CHUNK..][..o.len()].convert_to_f32_slice(o)
    });
    Ok(())
}
