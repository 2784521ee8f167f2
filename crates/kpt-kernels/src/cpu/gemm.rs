//! Dense matrix products `out[m,n] = a[m,k] · b[k,n]` (row-major).
//!
//! f32 runs on kpt's own packed GEMM (`sgemm`) where the CPU has AVX-512, and on the
//! `gemm` crate elsewhere; `KPT_CPU_GEMM=crate` or `own` forces one. bf16 runs on
//! AMX tiles where the CPU and OS offer them, else on AVX-512-BF16 dot-product
//! instructions with the same driver and operand layouts (see `amx`; `KPT_CPU_AMX=off`
//! and `KPT_CPU_BF16DP=off` turn them off). Otherwise bf16 and f16 inputs
//! are widened to f32 (exact), multiplied
//! with the f32 kernel (f32 accumulation) and the result is rounded once to the output
//! dtype: on AVX2 machines `gemm`'s own f16 path does the same conversions internally
//! and was not faster (see the crate's report), and `gemm` has no bf16 path at all.

use gemm::Parallelism;
use half::{bf16, f16};
use kpt_core::Result;

use super::par::for_each_row;
use super::sgemm::{self, Epilogue};
use super::{amx, check_len, checked_product, elementwise};

/// Below this many multiply-adds, `gemm` runs on the calling thread.
const GEMM_PAR_THRESHOLD: usize = 1 << 16;

/// A strided matrix operand for [`gemm_f32_raw`].
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a> {
    /// The elements (the view must stay in bounds, checked by `gemm_f32_raw`).
    pub data: &'a [f32],
    /// Distance between consecutive rows.
    pub rs: usize,
    /// Distance between consecutive columns.
    pub cs: usize,
}

impl Strided<'_> {
    /// Whether a `rows × cols` view fits in `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1).checked_mul(self.rs).and_then(|r| {
            (cols - 1)
                .checked_mul(self.cs)
                .and_then(|c| r.checked_add(c))
        });
        matches!(last, Some(l) if l < self.data.len())
    }
}

/// Which f32 GEMM runs: `KPT_CPU_GEMM=crate` or `own` forces one, otherwise kpt's own
/// where the CPU has AVX-512 (read once).
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemmChoice {
    Auto,
    Crate,
    Own,
}

fn gemm_choice() -> GemmChoice {
    static CHOICE: std::sync::OnceLock<GemmChoice> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("KPT_CPU_GEMM").as_deref() {
        Ok("crate") => GemmChoice::Crate,
        Ok("own") => GemmChoice::Own,
        _ => GemmChoice::Auto,
    })
}

/// `dst[m, n] (row stride dst_rs, column stride 1) = lhs[m, k] · rhs[k, n]` in f32, with
/// every view bounds-checked first, then `epi` on every row segment of the result.
/// Returns false (and does nothing) if a view does not fit, which callers rule out by
/// validating shapes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    epi: Option<Epilogue<'_>>,
) -> bool {
    let dst_view = Strided {
        data: dst,
        rs: dst_rs,
        cs: 1,
    };
    if !dst_view.fits(m, n) || !lhs.fits(m, k) || !rhs.fits(k, n) {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    if k == 0 {
        for i in 0..m {
            let row = &mut dst[i * dst_rs..i * dst_rs + n];
            row.fill(0.0);
            if let Some(f) = epi {
                f(row, 0);
            }
        }
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if gemm_choice() != GemmChoice::Crate {
        if let Some(mk) = sgemm::Avx512::detect() {
            sgemm::sgemm(mk, m, n, k, dst, dst_rs, lhs, rhs, epi);
            return true;
        }
        // On AVX2 kpt's GEMM measured no faster than the `gemm` crate (docs/decisions.md).
        if let (GemmChoice::Own, Some(mk)) = (gemm_choice(), sgemm::Avx2::detect()) {
            sgemm::sgemm(mk, m, n, k, dst, dst_rs, lhs, rhs, epi);
            return true;
        }
    }
    let work = m.saturating_mul(n).saturating_mul(k);
    let par = if work >= GEMM_PAR_THRESHOLD && rayon::current_num_threads() > 1 {
        super::team::rest();
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: every element `gemm` reads or writes lies inside the borrowed slices:
    // `fits` checked the last element of each `rows × cols` view (all offsets are
    // non-negative, and the slices are at most isize::MAX bytes so the casts are exact).
    // `dst` is a unique borrow, so it does not alias `lhs` or `rhs`. With
    // `read_dst = false` the destination is only written: dst = 1.0 * lhs · rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
    if let Some(f) = epi {
        let rows = &mut dst[..(m - 1) * dst_rs + n];
        for_each_row(rows, dst_rs, n * 16, |_, row| f(&mut row[..n], 0));
    }
    true
}

/// `dst[m, n] (row stride dst_rs) = lhs[m, k] · B` with B's column `j` written by
/// `rhs(j, dst)` (`k` values), then `epi` on every row segment, on kpt's own GEMM:
/// a compact copy of B is widened as the tasks pack it, never whole. Returns false
/// (and does nothing) where kpt's GEMM does not run (no AVX2, or `KPT_CPU_GEMM=crate`:
/// widen B and call [`gemm_f32_raw`] instead), or if a view does not fit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32_rhs_lines(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Strided<'_>,
    rhs: sgemm::LineFn<'_>,
    epi: Option<Epilogue<'_>>,
) -> bool {
    let dst_view = Strided {
        data: dst,
        rs: dst_rs,
        cs: 1,
    };
    if m == 0 || n == 0 || k == 0 || !dst_view.fits(m, n) || !lhs.fits(m, k) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if gemm_choice() != GemmChoice::Crate {
        if let Some(mk) = sgemm::Avx512::detect() {
            sgemm::sgemm_rhs_lines(mk, m, n, k, dst, dst_rs, lhs, rhs, epi);
            return true;
        }
        // Unlike f32 operands, on AVX2 too: widening B as it is packed beat widening
        // tiles of it for the `gemm` crate (docs/decisions.md).
        if let Some(mk) = sgemm::Avx2::detect() {
            sgemm::sgemm_rhs_lines(mk, m, n, k, dst, dst_rs, lhs, rhs, epi);
            return true;
        }
    }
    let _ = (rhs, epi);
    false
}

/// Validates the three operands of a matmul.
fn check(op: &str, a: usize, b: usize, out: usize, m: usize, k: usize, n: usize) -> Result<()> {
    check_len(op, "a [m, k]", a, checked_product(op, "[m, k]", &[m, k])?)?;
    check_len(op, "b [k, n]", b, checked_product(op, "[k, n]", &[k, n])?)?;
    check_len(
        op,
        "out [m, n]",
        out,
        checked_product(op, "[m, n]", &[m, n])?,
    )
}

/// The unreachable case of a view that does not fit after validation.
fn internal(op: &str) -> kpt_core::KptError {
    kpt_core::KptError::shape(op, "internal error: a matrix view does not fit its buffer")
}

/// `out[m,n] = a[m,k] · b[k,n]` in f32 (multi-threaded for large products).
pub fn matmul_f32(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "matmul_f32";
    check(OP, a.len(), b.len(), out.len(), m, k, n)?;
    let lhs = Strided {
        data: a,
        rs: k,
        cs: 1,
    };
    let rhs = Strided {
        data: b,
        rs: n,
        cs: 1,
    };
    if gemm_f32_raw(m, n, k, out, n, lhs, rhs, None) {
        Ok(())
    } else {
        Err(internal(OP))
    }
}

/// `out[m,n] = a[m,k] · b[k,n]` for bf16 operands: f32 products and accumulation, one
/// rounding (to nearest even) of each output.
pub fn matmul_bf16(
    a: &[bf16],
    b: &[bf16],
    out: &mut [bf16],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "matmul_bf16";
    check(OP, a.len(), b.len(), out.len(), m, k, n)?;
    if amx::matmul_bf16(a, b, out, m, k, n) {
        return Ok(());
    }
    let mut a32 = vec![0f32; a.len()];
    let mut b32 = vec![0f32; b.len()];
    let mut o32 = vec![0f32; out.len()];
    elementwise::cast_bf16_to_f32(a, &mut a32)?;
    elementwise::cast_bf16_to_f32(b, &mut b32)?;
    matmul_f32(&a32, &b32, &mut o32, m, k, n)?;
    elementwise::cast_f32_to_bf16(&o32, out)
}

/// `out[m,n] = a[m,k] · b[k,n]` for f16 operands: f32 products and accumulation, one
/// rounding (to nearest even) of each output.
pub fn matmul_f16(
    a: &[f16],
    b: &[f16],
    out: &mut [f16],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "matmul_f16";
    check(OP, a.len(), b.len(), out.len(), m, k, n)?;
    let mut a32 = vec![0f32; a.len()];
    let mut b32 = vec![0f32; b.len()];
    let mut o32 = vec![0f32; out.len()];
    elementwise::cast_f16_to_f32(a, &mut a32)?;
    elementwise::cast_f16_to_f32(b, &mut b32)?;
    matmul_f32(&a32, &b32, &mut o32, m, k, n)?;
    elementwise::cast_f32_to_f16(&o32, out)
}
