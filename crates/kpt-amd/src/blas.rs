//! GEMM on AMD GPUs through rocBLAS (`rocblas_gemm_ex`, `rocblas_gemm_strided_batched_ex`),
//! opened with `dlopen` at run time like the HIP runtime: nothing links against ROCm,
//! and a machine without rocBLAS gets [`AmdError::NoLibrary`] naming every path tried.
//!
//! The signatures and enum values are written from rocBLAS's public headers, not
//! generated: `library/include/internal/rocblas-types.h` and `rocblas-functions.h`,
//! `rocblas-auxiliary.h` of ROCm/rocBLAS 4.4.0 (ROCm 6.4; `rocblas_SOVERSION` 4.4).
//! The values kpt uses (`rocblas_operation_none` 111, `_transpose` 112,
//! `rocblas_datatype_f16_r` 150, `_f32_r` 151, `_bf16_r` 168, `rocblas_gemm_algo_standard`
//! 0, `rocblas_status_success` 0) and the `rocblas_gemm_ex` argument list are the same
//! since rocBLAS 2.x (ROCm 3.x); `rocblas_int` is `int32_t` (the LP64 build every ROCm
//! release ships). Debian 12 packages no rocBLAS, so these bindings have not been called
//! on a machine with the library.
//!
//! Everything is row-major on kpt's side and column-major in rocBLAS, so a row-major
//! `Y[M, N]` is computed as the column-major `Yᵀ[N, M]` (see [`GemmPlan`]).

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::OnceLock;

use kpt_core::DType;

use crate::runtime::Handle;
use crate::AmdError;

/// Environment variable naming the rocBLAS library to load.
pub const ROCBLAS_ENV: &str = "KPT_ROCBLAS_LIBRARY";

/// The raw rocBLAS interface kpt calls.
pub mod sys {
    use std::ffi::c_void;

    /// `rocblas_status`.
    pub type Status = i32;
    /// `rocblas_handle` (a pointer to an opaque struct).
    pub type RocblasHandle = *mut c_void;
    /// `rocblas_operation_none`.
    pub const OPERATION_NONE: i32 = 111;
    /// `rocblas_operation_transpose`.
    pub const OPERATION_TRANSPOSE: i32 = 112;
    /// `rocblas_datatype_f16_r`.
    pub const DATATYPE_F16_R: i32 = 150;
    /// `rocblas_datatype_f32_r`.
    pub const DATATYPE_F32_R: i32 = 151;
    /// `rocblas_datatype_bf16_r`.
    pub const DATATYPE_BF16_R: i32 = 168;
    /// `rocblas_gemm_algo_standard`.
    pub const GEMM_ALGO_STANDARD: i32 = 0;
    /// `rocblas_gemm_flags_none`.
    pub const GEMM_FLAGS_NONE: u32 = 0;

    /// `rocblas_status rocblas_create_handle(rocblas_handle* handle)`.
    pub type CreateHandle = unsafe extern "C" fn(handle: *mut RocblasHandle) -> Status;
    /// `rocblas_status rocblas_destroy_handle(rocblas_handle handle)`.
    pub type DestroyHandle = unsafe extern "C" fn(handle: RocblasHandle) -> Status;
    /// `rocblas_status rocblas_set_stream(rocblas_handle handle, hipStream_t stream)`.
    pub type SetStream = unsafe extern "C" fn(handle: RocblasHandle, stream: *mut c_void) -> Status;
    /// `rocblas_status rocblas_gemm_ex(rocblas_handle handle, rocblas_operation transA,
    /// rocblas_operation transB, rocblas_int m, rocblas_int n, rocblas_int k,
    /// const void* alpha, const void* a, rocblas_datatype a_type, rocblas_int lda,
    /// const void* b, rocblas_datatype b_type, rocblas_int ldb, const void* beta,
    /// const void* c, rocblas_datatype c_type, rocblas_int ldc, void* d,
    /// rocblas_datatype d_type, rocblas_int ldd, rocblas_datatype compute_type,
    /// rocblas_gemm_algo algo, int32_t solution_index, uint32_t flags)`.
    pub type GemmEx = unsafe extern "C" fn(
        handle: RocblasHandle,
        trans_a: i32,
        trans_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: *const c_void,
        a: *const c_void,
        a_type: i32,
        lda: i32,
        b: *const c_void,
        b_type: i32,
        ldb: i32,
        beta: *const c_void,
        c: *const c_void,
        c_type: i32,
        ldc: i32,
        d: *mut c_void,
        d_type: i32,
        ldd: i32,
        compute_type: i32,
        algo: i32,
        solution_index: i32,
        flags: u32,
    ) -> Status;
    /// `rocblas_status rocblas_gemm_strided_batched_ex(...)`: `rocblas_gemm_ex` with a
    /// `rocblas_stride` (`int64_t`) after each matrix's leading dimension and
    /// `rocblas_int batch_count` after `stride_d`.
    pub type GemmStridedBatchedEx = unsafe extern "C" fn(
        handle: RocblasHandle,
        trans_a: i32,
        trans_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: *const c_void,
        a: *const c_void,
        a_type: i32,
        lda: i32,
        stride_a: i64,
        b: *const c_void,
        b_type: i32,
        ldb: i32,
        stride_b: i64,
        beta: *const c_void,
        c: *const c_void,
        c_type: i32,
        ldc: i32,
        stride_c: i64,
        d: *mut c_void,
        d_type: i32,
        ldd: i32,
        stride_d: i64,
        batch_count: i32,
        compute_type: i32,
        algo: i32,
        solution_index: i32,
        flags: u32,
    ) -> Status;
}

/// The name of a `rocblas_status` (rocblas-types.h).
pub fn status_name(status: i32) -> &'static str {
    match status {
        0 => "rocblas_status_success",
        1 => "rocblas_status_invalid_handle",
        2 => "rocblas_status_not_implemented",
        3 => "rocblas_status_invalid_pointer",
        4 => "rocblas_status_invalid_size",
        5 => "rocblas_status_memory_error",
        6 => "rocblas_status_internal_error",
        7 => "rocblas_status_perf_degraded",
        8 => "rocblas_status_size_query_mismatch",
        9 => "rocblas_status_size_increased",
        10 => "rocblas_status_size_unchanged",
        11 => "rocblas_status_invalid_value",
        12 => "rocblas_status_continue",
        13 => "rocblas_status_check_numerics_fail",
        14 => "rocblas_status_excluded_from_build",
        15 => "rocblas_status_arch_mismatch",
        _ => "unknown rocblas_status",
    }
}

/// Where kpt looks for a ROCm library: `env` if set (and then only it), then
/// `$ROCM_PATH/lib/NAME.so`, `/opt/rocm/lib/NAME.so`, then the sonames by the loader's
/// search path.
pub fn candidates(env: &str, name: &str, sonames: &[&str]) -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return vec![PathBuf::from(p)];
    }
    let mut out = Vec::new();
    if let Some(root) = std::env::var_os("ROCM_PATH") {
        out.push(PathBuf::from(root).join(format!("lib/{name}.so")));
    }
    out.push(PathBuf::from(format!("/opt/rocm/lib/{name}.so")));
    out.push(PathBuf::from(format!("{name}.so")));
    out.extend(
        sonames
            .iter()
            .map(|s| PathBuf::from(format!("{name}.so.{s}"))),
    );
    out
}

/// Opens the first of `paths` that loads; [`AmdError::NoLibrary`] listing every attempt.
pub(crate) fn open_first(
    paths: &[PathBuf],
    library: &'static str,
    package: &'static str,
    env: &'static str,
) -> Result<(libloading::Library, PathBuf), AmdError> {
    let mut attempts = Vec::new();
    for path in paths {
        // SAFETY: loading runs the library's initializers; ROCm's math libraries are
        // built to be opened this way (PyTorch's ROCm build dlopens them lazily).
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => return Ok((lib, path.clone())),
            Err(e) => attempts.push(e.to_string()),
        }
    }
    Err(AmdError::NoLibrary {
        library,
        package,
        reason: if attempts.is_empty() {
            "no library to try".into()
        } else {
            attempts.join("; ")
        },
        env,
    })
}

/// The rocBLAS library and the functions kpt calls. Never unloaded (it keeps device
/// state for the process, like the HIP runtime).
pub struct Rocblas {
    _lib: ManuallyDrop<libloading::Library>,
    path: PathBuf,
    create_handle: sys::CreateHandle,
    destroy_handle: sys::DestroyHandle,
    set_stream: sys::SetStream,
    gemm_ex: sys::GemmEx,
    gemm_strided_batched_ex: sys::GemmStridedBatchedEx,
}

impl std::fmt::Debug for Rocblas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rocblas").field("path", &self.path).finish()
    }
}

impl Rocblas {
    /// The sonames tried after the unversioned name: ROCm 7 (5), ROCm 6 (4), ROCm 5 (0).
    pub const SONAMES: [&'static str; 3] = ["5", "4", "0"];

    /// The places kpt looks for rocBLAS ([`candidates`] with `KPT_ROCBLAS_LIBRARY`).
    pub fn library_candidates() -> Vec<PathBuf> {
        candidates(ROCBLAS_ENV, "librocblas", &Self::SONAMES)
    }

    /// The process's rocBLAS, loaded on first use; the outcome is kept.
    pub fn global() -> Result<&'static Rocblas, AmdError> {
        static LIB: OnceLock<Result<Rocblas, AmdError>> = OnceLock::new();
        LIB.get_or_init(|| Rocblas::load_first(&Rocblas::library_candidates()))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Loads the first of `paths` that opens and has every function kpt calls.
    pub fn load_first(paths: &[PathBuf]) -> Result<Rocblas, AmdError> {
        let (lib, path) = open_first(paths, "rocBLAS", "rocblas", ROCBLAS_ENV)?;
        let library = path.display().to_string();
        macro_rules! load {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol is a rocBLAS function whose C signature is `$ty`
                // (see `sys`, written from rocblas-functions.h / rocblas-auxiliary.h).
                let f =
                    unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                        AmdError::MissingSymbol {
                            library: library.clone(),
                            symbol: $name,
                            reason: e.to_string(),
                        }
                    })?;
                *f
            }};
        }
        Ok(Rocblas {
            create_handle: load!("rocblas_create_handle", sys::CreateHandle),
            destroy_handle: load!("rocblas_destroy_handle", sys::DestroyHandle),
            set_stream: load!("rocblas_set_stream", sys::SetStream),
            gemm_ex: load!("rocblas_gemm_ex", sys::GemmEx),
            gemm_strided_batched_ex: load!(
                "rocblas_gemm_strided_batched_ex",
                sys::GemmStridedBatchedEx
            ),
            path,
            _lib: ManuallyDrop::new(lib),
        })
    }

    /// The library that was loaded.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn check(call: &'static str, status: sys::Status) -> Result<(), AmdError> {
        if status == 0 {
            return Ok(());
        }
        Err(AmdError::Blas {
            call,
            status,
            name: status_name(status),
        })
    }
}

/// A rocBLAS handle bound to one device's stream.
pub struct BlasHandle {
    lib: &'static Rocblas,
    handle: sys::RocblasHandle,
}

// SAFETY: a rocBLAS handle may be used from any thread, one call at a time; the backend
// serializes calls with a mutex.
unsafe impl Send for BlasHandle {}

impl std::fmt::Debug for BlasHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlasHandle")
            .field("library", &self.lib.path)
            .finish()
    }
}

impl BlasHandle {
    /// A handle whose work goes to `stream` (call with the device current).
    pub fn new(lib: &'static Rocblas, stream: Handle) -> Result<BlasHandle, AmdError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: the pointer is to a local.
        Rocblas::check("rocblas_create_handle", unsafe {
            (lib.create_handle)(&mut handle)
        })?;
        let out = BlasHandle { lib, handle };
        // SAFETY: a live handle and a live stream of the current device.
        Rocblas::check("rocblas_set_stream", unsafe {
            (lib.set_stream)(handle, stream.raw())
        })?;
        Ok(out)
    }

    /// Queues `plan` on the handle's stream.
    ///
    /// # Safety
    /// Every address in `args` is a device allocation holding what `plan` reads or
    /// writes there, alive until the stream has run the GEMM.
    pub unsafe fn gemm(&self, plan: &GemmPlan, args: &GemmArgs) -> Result<(), AmdError> {
        let alpha = 1.0f32;
        let beta = if plan.accumulate { 1.0f32 } else { 0.0 };
        let (alpha, beta) = (
            (&alpha as *const f32).cast::<c_void>(),
            (&beta as *const f32).cast::<c_void>(),
        );
        let (a, b, d) = (
            args.a as *const c_void,
            args.b as *const c_void,
            args.d as *mut c_void,
        );
        if plan.batch == 1 {
            // SAFETY: the caller's contract; alpha and beta are host f32 (the default
            // pointer mode, and the f32 compute type's scalar type).
            return Rocblas::check("rocblas_gemm_ex", unsafe {
                (self.lib.gemm_ex)(
                    self.handle,
                    plan.trans_a,
                    plan.trans_b,
                    plan.m,
                    plan.n,
                    plan.k,
                    alpha,
                    a,
                    plan.a_type,
                    plan.lda,
                    b,
                    plan.b_type,
                    plan.ldb,
                    beta,
                    d,
                    plan.d_type,
                    plan.ldd,
                    d,
                    plan.d_type,
                    plan.ldd,
                    sys::DATATYPE_F32_R,
                    sys::GEMM_ALGO_STANDARD,
                    0,
                    sys::GEMM_FLAGS_NONE,
                )
            });
        }
        // SAFETY: as above, with the strides of `plan`.
        Rocblas::check("rocblas_gemm_strided_batched_ex", unsafe {
            (self.lib.gemm_strided_batched_ex)(
                self.handle,
                plan.trans_a,
                plan.trans_b,
                plan.m,
                plan.n,
                plan.k,
                alpha,
                a,
                plan.a_type,
                plan.lda,
                plan.stride_a,
                b,
                plan.b_type,
                plan.ldb,
                plan.stride_b,
                beta,
                d,
                plan.d_type,
                plan.ldd,
                plan.stride_d,
                d,
                plan.d_type,
                plan.ldd,
                plan.stride_d,
                plan.batch,
                sys::DATATYPE_F32_R,
                sys::GEMM_ALGO_STANDARD,
                0,
                sys::GEMM_FLAGS_NONE,
            )
        })
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and not used again.
        let status = unsafe { (self.lib.destroy_handle)(self.handle) };
        if status != 0 {
            tracing::warn!(
                status = status_name(status),
                "rocblas_destroy_handle failed"
            );
        }
    }
}

/// Which product a GEMM computes, row-major on kpt's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `Y[M, N] = X[M, K] · W[N, K]ᵀ` (linear).
    Linear,
    /// `Y[M, N] = A[M, K] · B[K, N]` (matmul), `batch` times with both operands strided.
    MatMul,
}

/// Device addresses of one GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmArgs {
    /// rocBLAS's A (see [`GemmPlan::new`]: kpt's second operand).
    pub a: u64,
    /// rocBLAS's B (kpt's first operand).
    pub b: u64,
    /// The output (also C when accumulating).
    pub d: u64,
}

impl GemmArgs {
    /// The addresses of `Y = X op W`: W is rocBLAS's A, X its B.
    pub fn new(x: u64, w: u64, y: u64) -> GemmArgs {
        GemmArgs { a: w, b: x, d: y }
    }
}

/// One `rocblas_gemm_ex` call: the column-major problem `Yᵀ = op(A) · op(B)` that
/// computes a row-major `Y`.
///
/// - Linear, `Y = X Wᵀ`: `Yᵀ[N, M] = W · Xᵀ`. The row-major `W[N, K]` is the
///   column-major `K × N` matrix with `lda = K`, used transposed; the row-major `X[M, K]`
///   is the column-major `Xᵀ` (`K × M`, `ldb = K`), used as is.
/// - MatMul, `Y = A B`: `Yᵀ[N, M] = Bᵀ Aᵀ`. Row-major `B[K, N]` is column-major `Bᵀ`
///   (`N × K`, `lda = N`), row-major `A[M, K]` is column-major `Aᵀ` (`K × M`, `ldb = K`),
///   both used as they are.
///
/// In both, the output is `N × M` column-major with `ldd = N`: the row-major `Y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmPlan {
    /// `rocblas_operation` of A.
    pub trans_a: i32,
    /// `rocblas_operation` of B.
    pub trans_b: i32,
    /// Rows of op(A) and of the output (kpt's N).
    pub m: i32,
    /// Columns of op(B) and of the output (kpt's M).
    pub n: i32,
    /// The reduction length.
    pub k: i32,
    /// Leading dimension of A.
    pub lda: i32,
    /// Leading dimension of B.
    pub ldb: i32,
    /// Leading dimension of the output.
    pub ldd: i32,
    /// `rocblas_datatype` of A.
    pub a_type: i32,
    /// `rocblas_datatype` of B.
    pub b_type: i32,
    /// `rocblas_datatype` of the output.
    pub d_type: i32,
    /// Problems (1: `rocblas_gemm_ex`, more: the strided batched call).
    pub batch: i32,
    /// Elements between A's problems.
    pub stride_a: i64,
    /// Elements between B's problems.
    pub stride_b: i64,
    /// Elements between the outputs.
    pub stride_d: i64,
    /// `beta = 1`: add to what the output holds (the bias's rank-1 update).
    pub accumulate: bool,
}

/// The `rocblas_datatype` of a dtype rocBLAS GEMMs take here (f32 compute).
pub fn datatype(dtype: DType) -> Result<i32, AmdError> {
    match dtype {
        DType::F32 => Ok(sys::DATATYPE_F32_R),
        DType::F16 => Ok(sys::DATATYPE_F16_R),
        DType::BF16 => Ok(sys::DATATYPE_BF16_R),
        d => Err(AmdError::Invalid(format!(
            "rocBLAS GEMMs take f32, f16 or bf16 (f32 compute), not {d}"
        ))),
    }
}

fn dim(what: &str, v: usize) -> Result<i32, AmdError> {
    i32::try_from(v)
        .map_err(|_| AmdError::Invalid(format!("GEMM {what} = {v} exceeds rocblas_int (2^31 - 1)")))
}

impl GemmPlan {
    /// The call computing `Y[M, N]` of `layout` from operands and output of `dtype`,
    /// `batch` times (matmul only).
    pub fn new(
        layout: Layout,
        dtype: DType,
        (m, n, k): (usize, usize, usize),
        batch: usize,
    ) -> Result<GemmPlan, AmdError> {
        let t = datatype(dtype)?;
        if batch == 0 || m == 0 || n == 0 || k == 0 {
            return Err(AmdError::Invalid(format!(
                "empty GEMM (batch {batch}, m {m}, n {n}, k {k}): nothing to launch"
            )));
        }
        if layout == Layout::Linear && batch != 1 {
            return Err(AmdError::Invalid(format!(
                "a linear GEMM is one problem, not {batch}"
            )));
        }
        let (trans_a, lda) = match layout {
            Layout::Linear => (sys::OPERATION_TRANSPOSE, k),
            Layout::MatMul => (sys::OPERATION_NONE, n),
        };
        let stride = |a: usize, b: usize| -> Result<i64, AmdError> {
            a.checked_mul(b)
                .and_then(|s| i64::try_from(s).ok())
                .ok_or_else(|| AmdError::Invalid("GEMM stride overflows".into()))
        };
        Ok(GemmPlan {
            trans_a,
            trans_b: sys::OPERATION_NONE,
            m: dim("n", n)?,
            n: dim("m", m)?,
            k: dim("k", k)?,
            lda: dim("lda", lda)?,
            ldb: dim("k", k)?,
            ldd: dim("n", n)?,
            a_type: t,
            b_type: t,
            d_type: t,
            batch: dim("batch", batch)?,
            stride_a: stride(k, n)?,
            stride_b: stride(m, k)?,
            stride_d: stride(m, n)?,
            accumulate: false,
        })
    }

    /// The rank-1 update `Y[M, N] += ones[M] ⊗ bias[N]` that adds a linear's bias:
    /// column-major `Yᵀ += bias · onesᵀ` with A = bias (`N × 1`) and B = ones (`1 × M`).
    /// Its [`GemmArgs`] are `a = bias`, `b = ones`, `d = Y`.
    pub fn bias(dtype: DType, m: usize, n: usize) -> Result<GemmPlan, AmdError> {
        let t = datatype(dtype)?;
        if m == 0 || n == 0 {
            return Err(AmdError::Invalid("bias of an empty output".into()));
        }
        Ok(GemmPlan {
            trans_a: sys::OPERATION_NONE,
            trans_b: sys::OPERATION_NONE,
            m: dim("n", n)?,
            n: dim("m", m)?,
            k: 1,
            lda: dim("n", n)?,
            ldb: 1,
            ldd: dim("n", n)?,
            a_type: t,
            b_type: t,
            d_type: t,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_d: 0,
            accumulate: true,
        })
    }

    /// Checks the plan against the BLAS rules rocBLAS enforces (`rocblas_status_invalid_size`
    /// otherwise): each leading dimension at least the rows of its stored matrix.
    pub fn validate(&self) -> Result<(), AmdError> {
        let rows_a = if self.trans_a == sys::OPERATION_NONE {
            self.m
        } else {
            self.k
        };
        let rows_b = if self.trans_b == sys::OPERATION_NONE {
            self.k
        } else {
            self.n
        };
        if self.lda < rows_a.max(1) || self.ldb < rows_b.max(1) || self.ldd < self.m.max(1) {
            return Err(AmdError::Invalid(format!(
                "GEMM leading dimensions {} / {} / {} below the rows {rows_a} / {rows_b} / {}",
                self.lda, self.ldb, self.ldd, self.m
            )));
        }
        Ok(())
    }
}

/// The bytes of one `1.0` in `dtype` (f32, bf16 or f16), for the bias update's ones.
pub fn one_bytes(dtype: DType) -> Result<Vec<u8>, AmdError> {
    match dtype {
        DType::F32 => Ok(1.0f32.to_le_bytes().to_vec()),
        DType::BF16 => Ok(0x3f80u16.to_le_bytes().to_vec()),
        DType::F16 => Ok(0x3c00u16.to_le_bytes().to_vec()),
        d => Err(AmdError::Invalid(format!("no GEMM ones of {d}"))),
    }
}

/// Whether rocBLAS can be loaded on this machine.
pub fn rocblas_present() -> bool {
    Rocblas::global().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_is_the_transposed_weight_times_the_activations() {
        let p = GemmPlan::new(Layout::Linear, DType::BF16, (3, 5, 7), 1).unwrap();
        assert_eq!((p.m, p.n, p.k), (5, 3, 7));
        assert_eq!((p.trans_a, p.trans_b), (112, 111));
        assert_eq!((p.lda, p.ldb, p.ldd), (7, 7, 5));
        assert_eq!((p.a_type, p.d_type), (168, 168));
        p.validate().unwrap();
        let p = GemmPlan::new(Layout::MatMul, DType::F32, (3, 5, 7), 4).unwrap();
        assert_eq!((p.trans_a, p.trans_b), (111, 111));
        assert_eq!((p.lda, p.ldb, p.ldd), (5, 7, 5));
        assert_eq!((p.stride_a, p.stride_b, p.stride_d), (35, 21, 15));
        p.validate().unwrap();
        let b = GemmPlan::bias(DType::F16, 3, 5).unwrap();
        assert_eq!((b.m, b.n, b.k, b.lda, b.ldb, b.ldd), (5, 3, 1, 5, 1, 5));
        assert!(b.accumulate);
        b.validate().unwrap();
    }

    #[test]
    fn bad_problems_are_typed_errors() {
        assert!(GemmPlan::new(Layout::Linear, DType::F8E4M3, (1, 1, 1), 1).is_err());
        assert!(GemmPlan::new(Layout::Linear, DType::F32, (0, 1, 1), 1).is_err());
        assert!(GemmPlan::new(Layout::Linear, DType::F32, (1, 1, 1), 2).is_err());
        assert!(GemmPlan::new(Layout::MatMul, DType::F32, (1, 1 << 31, 1), 1).is_err());
        let mut p = GemmPlan::new(Layout::Linear, DType::F32, (2, 2, 2), 1).unwrap();
        p.lda = 1;
        assert!(p.validate().is_err());
    }

    #[test]
    fn ones_and_status_names() {
        assert_eq!(one_bytes(DType::F32).unwrap(), 1.0f32.to_le_bytes());
        assert_eq!(
            half::bf16::from_le_bytes(one_bytes(DType::BF16).unwrap().try_into().unwrap()),
            half::bf16::ONE
        );
        assert_eq!(
            half::f16::from_le_bytes(one_bytes(DType::F16).unwrap().try_into().unwrap()),
            half::f16::ONE
        );
        assert_eq!(status_name(4), "rocblas_status_invalid_size");
        assert_eq!(status_name(99), "unknown rocblas_status");
    }

    #[test]
    fn a_missing_library_names_what_was_tried() {
        let e = Rocblas::load_first(&[PathBuf::from("/nonexistent/librocblas.so")]).unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("no rocBLAS found ("), "{m}");
        assert!(
            m.contains("/nonexistent/librocblas.so") && m.contains(ROCBLAS_ENV),
            "{m}"
        );
    }
}
