//! Fused `y = act(x · wᵀ + bias)` with weights stored in f32, bf16, f16, FP8 or int8.
//!
//! - Small `m` (decode, `m <=` [`GEMV_MAX_M`]): a GEMV-style kernel, parallel over output
//!   columns, that streams each weight row once in its stored dtype and widens it to f32
//!   on the fly (in registers for `m = 1`; for `m > 1` into an L1-resident row buffer
//!   reused by every row of `x`). The kernel is memory-bound, so 2-byte / 1-byte weights
//!   cut the traffic by 2x / 4x. Scales are applied once per dot product; bias and
//!   activation on the finished value.
//! - Larger `m` with bf16 weights, on CPUs with bf16 products (AMX, AVX-512-BF16): the
//!   rows of `x` are rounded to bf16 and multiplied by the weights on the bf16 engine
//!   (f32 accumulation and output, bias + activation on each finished segment), at about
//!   twice the f32 FMA rate. This is what `torch.autocast` does to a linear, and what
//!   a GPU's bf16 GEMM computes; the validator holds a linear with 16-bit weights to
//!   their dtype's tolerance (`validate::output_tolerance`). `KPT_CPU_LINEAR_BF16=off`
//!   keeps these products in f32.
//! - Larger `m` otherwise: f32 weights go straight to `gemm` (`wᵀ` is just a stride swap).
//!   Other dtypes run kpt's own GEMM (AVX-512 or AVX2), whose tasks widen each weight
//!   row as they pack it into a micro-panel; without it (`KPT_CPU_GEMM=crate`, CPUs
//!   without AVX2) they are widened tile by tile ([`TILE_N`] weight rows at a time,
//!   spread over the threads) into an f32 buffer that `gemm` consumes. Bias +
//!   activation run on each output segment right after its product, while it is
//!   still in cache.

use std::sync::OnceLock;

use half::{bf16, f16};
use kpt_core::{DType, KptError, Result};

use super::amx;
use super::gemm::{gemm_f32_raw, gemm_f32_rhs_lines, Strided};
use super::par::for_each_row;
use super::scratch::Scratch;
use super::sgemm::Epilogue;
use super::simd::{self, Decode, E4M3, E5M2};
use super::wide::Widen;
use super::{check_linear, Act};

/// Largest `m` handled by the GEMV kernel; above it the `gemm` paths are faster (measured
/// on a 2-core Zen 3 at k = n = 4096: GEMV and `gemm` cross over between m = 16 and 32).
pub const GEMV_MAX_M: usize = 16;

/// Weight rows widened to f32 per `gemm` call on the large-`m` path (256 was ~1.7x
/// slower at m = 64: `gemm` re-packs `x` for every call; 1024 was no faster than 512).
pub const TILE_N: usize = 512;

/// Output columns per GEMV task.
const GEMV_COLS: usize = 8;

/// Linear-layer weights `[n, k]` (row-major, PyTorch layout) in their stored dtype.
/// The weight value is `stored * scale` for the quantized variants.
#[derive(Debug, Clone, Copy)]
pub enum WeightsRef<'a> {
    /// f32 weights.
    F32(&'a [f32]),
    /// bf16 weights.
    BF16(&'a [bf16]),
    /// f16 weights.
    F16(&'a [f16]),
    /// FP8 E4M3 bits with a per-tensor scale.
    F8E4M3 {
        /// The FP8 bit patterns.
        bits: &'a [u8],
        /// Dequantization scale.
        scale: f32,
    },
    /// FP8 E5M2 bits with a per-tensor scale.
    F8E5M2 {
        /// The FP8 bit patterns.
        bits: &'a [u8],
        /// Dequantization scale.
        scale: f32,
    },
    /// Symmetric int8 with a per-tensor scale.
    I8 {
        /// The int8 values.
        data: &'a [i8],
        /// Dequantization scale.
        scale: f32,
    },
}

impl WeightsRef<'_> {
    /// Number of stored elements.
    pub fn len(&self) -> usize {
        match self {
            WeightsRef::F32(w) => w.len(),
            WeightsRef::BF16(w) => w.len(),
            WeightsRef::F16(w) => w.len(),
            WeightsRef::F8E4M3 { bits, .. } | WeightsRef::F8E5M2 { bits, .. } => bits.len(),
            WeightsRef::I8 { data, .. } => data.len(),
        }
    }

    /// Whether there are no weights.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored dtype.
    pub fn dtype(&self) -> DType {
        match self {
            WeightsRef::F32(_) => DType::F32,
            WeightsRef::BF16(_) => DType::BF16,
            WeightsRef::F16(_) => DType::F16,
            WeightsRef::F8E4M3 { .. } => DType::F8E4M3,
            WeightsRef::F8E5M2 { .. } => DType::F8E5M2,
            WeightsRef::I8 { .. } => DType::I8,
        }
    }

    /// The dequantization scale (1 for the unscaled dtypes).
    pub fn scale(&self) -> f32 {
        match self {
            WeightsRef::F32(_) | WeightsRef::BF16(_) | WeightsRef::F16(_) => 1.0,
            WeightsRef::F8E4M3 { scale, .. }
            | WeightsRef::F8E5M2 { scale, .. }
            | WeightsRef::I8 { scale, .. } => *scale,
        }
    }
}

/// `y[m, n] = act(x[m, k] · w[n, k]ᵀ + bias[n])`, fused (see the module docs).
///
/// Errors: a slice whose length does not match `m`, `k`, `n`
/// ([`KptError::Shape`]), a non-finite scale ([`KptError::InvalidArgument`]).
#[allow(clippy::too_many_arguments)]
pub fn linear(
    x: &[f32],
    w: WeightsRef<'_>,
    bias: Option<&[f32]>,
    act: Option<Act>,
    out: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "linear";
    check_linear(
        OP,
        x.len(),
        w.len(),
        bias.map(<[f32]>::len),
        out.len(),
        m,
        k,
        n,
    )?;
    let scale = w.scale();
    if !scale.is_finite() {
        return Err(KptError::InvalidArgument(format!(
            "linear: weight scale must be finite, got {scale}"
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // Empty reduction: every output is act(bias).
        for row in out.chunks_exact_mut(n) {
            for (j, o) in row.iter_mut().enumerate() {
                *o = finish(0.0, scale, bias.map_or(0.0, |b| b[j]), act);
            }
        }
        return Ok(());
    }
    let p = Problem {
        x,
        bias,
        act,
        scale,
        m,
        k,
        n,
    };
    if m <= GEMV_MAX_M {
        match w {
            WeightsRef::F32(w) => gemv(&p, w, out),
            WeightsRef::BF16(w) => gemv(&p, w, out),
            WeightsRef::F16(w) => gemv(&p, w, out),
            WeightsRef::F8E4M3 { bits, .. } => {
                gemv(&p, bytemuck::cast_slice::<u8, E4M3>(bits), out)
            }
            WeightsRef::F8E5M2 { bits, .. } => {
                gemv(&p, bytemuck::cast_slice::<u8, E5M2>(bits), out)
            }
            WeightsRef::I8 { data, .. } => gemv(&p, data, out),
        }
        return Ok(());
    }
    // Bias and activation on each finished output segment, for the engines that take it.
    let finish = |seg: &mut [f32], c0: usize| finish_cols(seg, c0, bias, act);
    let epi = (bias.is_some() || act.is_some()).then_some(&finish as Epilogue<'_>);
    let ok = match w {
        WeightsRef::BF16(w) if bf16_products() => {
            let mut xb = Scratch::<u16>::new(m * k);
            for_each_row(&mut xb, k, k, |r, dst| {
                simd::f32_to_bf16_slice(&x[r * k..][..k], dst)
            });
            amx::linear_bf16(bytemuck::cast_slice(&xb), w, out, (m, k, n), epi)
        }
        WeightsRef::F32(w) => gemm_f32_raw(
            m,
            n,
            k,
            out,
            n,
            Strided {
                data: x,
                rs: k,
                cs: 1,
            },
            Strided {
                data: w,
                rs: 1,
                cs: k,
            },
            epi,
        ),
        WeightsRef::BF16(w) => tiled(&p, w, out),
        WeightsRef::F16(w) => tiled(&p, w, out),
        WeightsRef::F8E4M3 { bits, .. } => tiled(&p, bytemuck::cast_slice::<u8, E4M3>(bits), out),
        WeightsRef::F8E5M2 { bits, .. } => tiled(&p, bytemuck::cast_slice::<u8, E5M2>(bits), out),
        WeightsRef::I8 { data, .. } => tiled(&p, data, out),
    };
    if ok {
        Ok(())
    } else {
        Err(KptError::shape(
            OP,
            "internal error: a matrix view does not fit its buffer",
        ))
    }
}

/// Whether linears with bf16 weights compute their larger products in bf16: the CPU
/// has a bf16 engine and `KPT_CPU_LINEAR_BF16` is not `off` (or `0`).
pub fn bf16_products() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        amx::bf16_products()
            && !std::env::var("KPT_CPU_LINEAR_BF16").is_ok_and(|v| v == "off" || v == "0")
    })
}

/// The validated arguments of one call.
struct Problem<'a> {
    x: &'a [f32],
    bias: Option<&'a [f32]>,
    act: Option<Act>,
    scale: f32,
    m: usize,
    k: usize,
    n: usize,
}

/// `act(dot * scale + bias)` for one output.
#[inline(always)]
fn finish(dot: f32, scale: f32, bias: f32, act: Option<Act>) -> f32 {
    let v = dot * scale + bias;
    match act {
        Some(a) => a.apply_f32(v),
        None => v,
    }
}

/// GEMV for a block of output columns: `out_t` is `[cols, m]` (column-major output),
/// `w` holds the block's `cols` weight rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemv_block<const FMA: bool, T: Decode>(
    x: &[f32],
    w: &[T],
    bias: &[f32],
    out_t: &mut [f32],
    scale: f32,
    act: Option<Act>,
    m: usize,
    k: usize,
) {
    // With several rows, each weight row is widened once into an L1-resident buffer and
    // reused by every row of `x`.
    let mut wbuf = if m > 1 && T::as_f32(w).is_none() {
        vec![0f32; k]
    } else {
        Vec::new()
    };
    for (c, (o, wr)) in out_t
        .chunks_exact_mut(m)
        .zip(w.chunks_exact(k.max(1)))
        .enumerate()
    {
        let b = bias.get(c).copied().unwrap_or(0.0);
        if m == 1 {
            o[0] = finish(simd::dot_decode::<FMA, T>(&x[..k], wr), scale, b, act);
            continue;
        }
        let wf = match T::as_f32(wr) {
            Some(wf) => wf,
            None => {
                for (d, s) in wbuf.iter_mut().zip(wr) {
                    *d = s.decode();
                }
                &wbuf[..]
            }
        };
        for (i, v) in o.iter_mut().enumerate() {
            let dot = simd::dot_decode::<FMA, f32>(&x[i * k..(i + 1) * k], wf);
            *v = finish(dot, scale, b, act);
        }
    }
}

/// The `m = 1` GEMV of a block of output columns on AVX-512 ([`dots`](super::wide::dots),
/// four weight rows per step), then scale, bias and activation.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_row_avx512<T: Widen>(
    x: &[f32],
    w: &[T],
    bias: &[f32],
    out: &mut [f32],
    scale: f32,
    act: Option<Act>,
    k: usize,
) {
    // SAFETY: the caller guarantees the target features.
    unsafe { super::wide::dots(&x[..k], |c| &w[c * k..(c + 1) * k], out) };
    for (c, o) in out.iter_mut().enumerate() {
        *o = finish(*o, scale, bias.get(c).copied().unwrap_or(0.0), act);
    }
}

simd::dispatch!(
    /// [`gemv_block`] vectorized for the CPU.
    #[allow(clippy::too_many_arguments)]
    fn gemv_block_d<T: Decode>(
        x: &[f32],
        w: &[T],
        bias: &[f32],
        out_t: &mut [f32],
        scale: f32,
        act: Option<Act>,
        m: usize,
        k: usize,
    ) => gemv_block [true, T] [true, T] [false, T]
);

/// The small-`m` path: parallel over blocks of output columns.
fn gemv<T: Widen>(p: &Problem<'_>, w: &[T], out: &mut [f32]) {
    let (m, k, n) = (p.m, p.k, p.n);
    let task = |c: usize, o: &mut [f32]| {
        let j0 = c * GEMV_COLS;
        let cols = o.len() / m;
        let bias = p.bias.map_or(&[][..], |b| &b[j0..j0 + cols]);
        let w = &w[j0 * k..(j0 + cols) * k];
        #[cfg(target_arch = "x86_64")]
        if m == 1 && simd::has_avx512() {
            // SAFETY: AVX-512 was detected on this CPU.
            unsafe { gemv_row_avx512(p.x, w, bias, o, p.scale, p.act, k) };
            return;
        }
        gemv_block_d(p.x, w, bias, o, p.scale, p.act, m, k);
    };
    let cost = GEMV_COLS * k.max(1) * m;
    if m == 1 {
        for_each_row(out, GEMV_COLS, cost, task);
        return;
    }
    // Column-major scratch [n, m], transposed into `out` afterwards (m <= 4: cheap).
    let mut out_t = vec![0f32; n * m];
    for_each_row(&mut out_t, GEMV_COLS * m, cost, task);
    for (i, row) in out.chunks_exact_mut(n).enumerate() {
        for (j, o) in row.iter_mut().enumerate() {
            *o = out_t[j * m + i];
        }
    }
}

#[inline(always)]
fn epilogue<const FMA: bool>(row: &mut [f32], bias: Option<&[f32]>, act: Option<Act>) {
    if let Some(b) = bias {
        row.iter_mut().zip(b).for_each(|(v, &c)| *v += c);
    }
    match act {
        None => {}
        Some(Act::Relu) => row.iter_mut().for_each(|v| *v = Act::Relu.apply_f32(*v)),
        Some(Act::GeluErf) => row.iter_mut().for_each(|v| *v = Act::GeluErf.apply_f32(*v)),
        Some(Act::GeluTanh) => row
            .iter_mut()
            .for_each(|v| *v = Act::GeluTanh.apply_f32(*v)),
        Some(Act::Silu) => row.iter_mut().for_each(|v| *v = Act::Silu.apply_f32(*v)),
    }
}

simd::dispatch!(fn epilogue_d(row: &mut [f32], bias: Option<&[f32]>, act: Option<Act>) => epilogue);

/// Bias + activation on `seg`, the output columns starting at `c0` of one row.
fn finish_cols(seg: &mut [f32], c0: usize, bias: Option<&[f32]>, act: Option<Act>) {
    epilogue_d(seg, bias.map(|b| &b[c0..c0 + seg.len()]), act);
}

#[inline(always)]
fn decode_rows<const FMA: bool, T: Decode>(src: &[T], scale: f32, dst: &mut [f32]) {
    simd::decode_scaled(src, scale, dst);
}

simd::dispatch!(
    /// Widens `src` to f32 times `scale`, vectorized for the CPU.
    fn decode_rows_d<T: Decode>(src: &[T], scale: f32, dst: &mut [f32])
        => decode_rows [true, T] [true, T] [false, T]
);

/// The large-`m` path for non-f32 weights. On kpt's own GEMM one product over all
/// columns whose tasks widen each weight row as they pack it; elsewhere widen
/// `TILE_N` weight rows at a time, `gemm` them into the output columns, then bias +
/// activation on those columns.
fn tiled<T: Decode>(p: &Problem<'_>, w: &[T], out: &mut [f32]) -> bool {
    let (m, k, n) = (p.m, p.k, p.n);
    let x = Strided {
        data: p.x,
        rs: k,
        cs: 1,
    };
    let row = |j: usize, dst: &mut [f32]| decode_rows_d(&w[j * k..][..k], p.scale, dst);
    let epi = |seg: &mut [f32], c0: usize| finish_cols(seg, c0, p.bias, p.act);
    let epi = (p.bias.is_some() || p.act.is_some()).then_some(&epi as Epilogue<'_>);
    if gemm_f32_rhs_lines(m, n, k, out, n, x, &row, epi) {
        return true;
    }
    let tile_n = TILE_N.min(n);
    let mut tile = vec![0f32; tile_n * k];
    let mut j0 = 0;
    while j0 < n {
        let nt = tile_n.min(n - j0);
        let buf = &mut tile[..nt * k];
        let src = &w[j0 * k..(j0 + nt) * k];
        for_each_row(buf, k.max(1), 2 * k, |r, dst| {
            decode_rows_d(&src[r * k..][..dst.len()], p.scale, dst)
        });
        let epi = |seg: &mut [f32], c0: usize| finish_cols(seg, j0 + c0, p.bias, p.act);
        let rhs = Strided {
            data: &tile[..nt * k],
            rs: 1,
            cs: k,
        };
        if !gemm_f32_raw(
            m,
            nt,
            k,
            &mut out[j0..],
            n,
            Strided {
                data: p.x,
                rs: k,
                cs: 1,
            },
            rhs,
            (p.bias.is_some() || p.act.is_some()).then_some(&epi),
        ) {
            return false;
        }
        j0 += nt;
    }
    true
}
