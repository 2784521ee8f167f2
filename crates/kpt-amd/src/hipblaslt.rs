//! FP8 GEMM on MI300 (gfx942) through hipBLASLt, opened with `dlopen` at run time like
//! rocBLAS: [`AmdError::NoLibrary`] naming every path tried when it is absent.
//!
//! Written from `library/include/hipblaslt.h` of ROCm/hipBLASLt 0.11.0 (ROCm 6.3/6.4):
//! the functions' signatures, `hipblasLtMatmulDescAttributes_t` (`TRANSA` 0, `TRANSB` 1,
//! `EPILOGUE` 2, `BIAS_POINTER` 3, `BIAS_DATA_TYPE` 4, `A_SCALE_POINTER` 5,
//! `B_SCALE_POINTER` 6), `hipblasLtEpilogue_t` (`DEFAULT` 1, `BIAS` 4),
//! `HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES` (1, a `uint64_t`) and the layout of
//! `hipblasLtMatmulHeuristicResult_t` (a 16-byte algo blob and its `size_t` workspace,
//! `size_t workspaceSize`, `hipblasStatus_t state`, `float wavesCount`, `int
//! reserved[4]`: 56 bytes). From `hip/library_types.h`: `hipDataType` (`HIP_R_32F` 0,
//! `HIP_R_16F` 2, `HIP_R_16BF` 14, `HIP_R_8F_E4M3_FNUZ` 1000). From hipBLAS-common:
//! `HIPBLAS_OP_N` 111, `HIPBLAS_OP_T` 112, `HIPBLAS_COMPUTE_32F` 2, `hipblasStatus_t`
//! (`SUCCESS` 0 ... `ARCH_MISMATCH` 8). Debian 12 packages no hipBLASLt: these bindings
//! have never been called on a machine with the library.
//!
//! The GEMM is the linear `Y[M, N] = X[M, K] · W[N, K]ᵀ` in column-major form
//! `Yᵀ = W · Xᵀ` (as [`crate::blas::GemmPlan`]): A = W (FNUZ e4m3, transposed), B = X
//! (FNUZ e4m3), D = Y (f32, bf16 or f16), f32 compute, with per-tensor scales on the
//! device and the bias fused in the epilogue.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::OnceLock;

use kpt_core::DType;

use crate::blas::{candidates, open_first};
use crate::runtime::Handle;
use crate::AmdError;

/// Environment variable naming the hipBLASLt library to load.
pub const HIPBLASLT_ENV: &str = "KPT_HIPBLASLT_LIBRARY";

/// The raw hipBLASLt interface kpt calls.
pub mod sys {
    use std::ffi::c_void;

    /// `hipblasStatus_t`.
    pub type Status = i32;
    /// Opaque handles and descriptors (`hipblasLtHandle_t`, `hipblasLtMatmulDesc_t`,
    /// `hipblasLtMatrixLayout_t`, `hipblasLtMatmulPreference_t`).
    pub type Opaque = *mut c_void;

    /// `HIPBLAS_OP_N`.
    pub const OP_N: i32 = 111;
    /// `HIPBLAS_OP_T`.
    pub const OP_T: i32 = 112;
    /// `HIPBLAS_COMPUTE_32F`.
    pub const COMPUTE_32F: i32 = 2;
    /// `HIP_R_32F`.
    pub const R_32F: i32 = 0;
    /// `HIP_R_16F`.
    pub const R_16F: i32 = 2;
    /// `HIP_R_16BF`.
    pub const R_16BF: i32 = 14;
    /// `HIP_R_8F_E4M3_FNUZ`.
    pub const R_8F_E4M3_FNUZ: i32 = 1000;
    /// `HIPBLASLT_MATMUL_DESC_TRANSA` (`int32_t`).
    pub const DESC_TRANSA: i32 = 0;
    /// `HIPBLASLT_MATMUL_DESC_TRANSB` (`int32_t`).
    pub const DESC_TRANSB: i32 = 1;
    /// `HIPBLASLT_MATMUL_DESC_EPILOGUE` (`uint32_t`).
    pub const DESC_EPILOGUE: i32 = 2;
    /// `HIPBLASLT_MATMUL_DESC_BIAS_POINTER` (`void*`).
    pub const DESC_BIAS_POINTER: i32 = 3;
    /// `HIPBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` (`int32_t`, a `hipDataType`).
    pub const DESC_BIAS_DATA_TYPE: i32 = 4;
    /// `HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER` (`void*`, device f32).
    pub const DESC_A_SCALE_POINTER: i32 = 5;
    /// `HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER` (`void*`, device f32).
    pub const DESC_B_SCALE_POINTER: i32 = 6;
    /// `HIPBLASLT_EPILOGUE_DEFAULT`.
    pub const EPILOGUE_DEFAULT: u32 = 1;
    /// `HIPBLASLT_EPILOGUE_BIAS`.
    pub const EPILOGUE_BIAS: u32 = 4;
    /// `HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES` (`uint64_t`).
    pub const PREF_MAX_WORKSPACE_BYTES: i32 = 1;

    /// `hipblasLtMatmulAlgo_t`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default)]
    pub struct MatmulAlgo {
        /// Opaque.
        pub data: [u8; 16],
        /// The algorithm's workspace limit.
        pub max_workspace_bytes: usize,
    }

    /// `hipblasLtMatmulHeuristicResult_t`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default)]
    pub struct HeuristicResult {
        /// The algorithm.
        pub algo: MatmulAlgo,
        /// Workspace it needs.
        pub workspace_size: usize,
        /// `HIPBLAS_STATUS_SUCCESS` when the other fields are valid.
        pub state: Status,
        /// Device utilization estimate.
        pub waves_count: f32,
        /// Reserved.
        pub reserved: [i32; 4],
    }

    /// `hipblasStatus_t hipblasLtCreate(hipblasLtHandle_t*)`, and the other
    /// create functions of one out-pointer.
    pub type Create = unsafe extern "C" fn(out: *mut Opaque) -> Status;
    /// `hipblasStatus_t hipblasLtDestroy(hipblasLtHandle_t)`, and the descriptors'
    /// destroy functions.
    pub type Destroy = unsafe extern "C" fn(handle: Opaque) -> Status;
    /// `hipblasLtMatmulDescCreate(hipblasLtMatmulDesc_t*, hipblasComputeType_t,
    /// hipDataType scaleType)`.
    pub type DescCreate =
        unsafe extern "C" fn(out: *mut Opaque, compute: i32, scale: i32) -> Status;
    /// `hipblasLtMatmulDescSetAttribute(desc, attr, const void* buf, size_t size)`, and
    /// `hipblasLtMatmulPreferenceSetAttribute`.
    pub type SetAttribute =
        unsafe extern "C" fn(desc: Opaque, attr: i32, buf: *const c_void, size: usize) -> Status;
    /// `hipblasLtMatrixLayoutCreate(hipblasLtMatrixLayout_t*, hipDataType, uint64_t rows,
    /// uint64_t cols, int64_t ld)`.
    pub type LayoutCreate =
        unsafe extern "C" fn(out: *mut Opaque, dtype: i32, rows: u64, cols: u64, ld: i64) -> Status;
    /// `hipblasLtMatmulAlgoGetHeuristic(handle, desc, A, B, C, D, pref, int requested,
    /// hipblasLtMatmulHeuristicResult_t results[], int* returned)`.
    pub type GetHeuristic = unsafe extern "C" fn(
        handle: Opaque,
        desc: Opaque,
        a: Opaque,
        b: Opaque,
        c: Opaque,
        d: Opaque,
        pref: Opaque,
        requested: i32,
        results: *mut HeuristicResult,
        returned: *mut i32,
    ) -> Status;
    /// `hipblasLtMatmul(handle, desc, const void* alpha, const void* A, Adesc,
    /// const void* B, Bdesc, const void* beta, const void* C, Cdesc, void* D, Ddesc,
    /// const hipblasLtMatmulAlgo_t* algo, void* workspace, size_t workspaceSize,
    /// hipStream_t stream)`.
    pub type Matmul = unsafe extern "C" fn(
        handle: Opaque,
        desc: Opaque,
        alpha: *const c_void,
        a: *const c_void,
        a_desc: Opaque,
        b: *const c_void,
        b_desc: Opaque,
        beta: *const c_void,
        c: *const c_void,
        c_desc: Opaque,
        d: *mut c_void,
        d_desc: Opaque,
        algo: *const MatmulAlgo,
        workspace: *mut c_void,
        workspace_size: usize,
        stream: *mut c_void,
    ) -> Status;
}

/// The name of a `hipblasStatus_t`.
pub fn status_name(status: i32) -> &'static str {
    match status {
        0 => "HIPBLAS_STATUS_SUCCESS",
        1 => "HIPBLAS_STATUS_NOT_INITIALIZED",
        2 => "HIPBLAS_STATUS_ALLOC_FAILED",
        3 => "HIPBLAS_STATUS_INVALID_VALUE",
        4 => "HIPBLAS_STATUS_MAPPING_ERROR",
        5 => "HIPBLAS_STATUS_EXECUTION_FAILED",
        6 => "HIPBLAS_STATUS_INTERNAL_ERROR",
        7 => "HIPBLAS_STATUS_NOT_SUPPORTED",
        8 => "HIPBLAS_STATUS_ARCH_MISMATCH",
        _ => "unknown hipblasStatus_t",
    }
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

/// The hipBLASLt library and the functions kpt calls; never unloaded.
pub struct HipBlasLt {
    _lib: ManuallyDrop<libloading::Library>,
    path: PathBuf,
    create: sys::Create,
    destroy: sys::Destroy,
    desc_create: sys::DescCreate,
    desc_destroy: sys::Destroy,
    desc_set: sys::SetAttribute,
    layout_create: sys::LayoutCreate,
    layout_destroy: sys::Destroy,
    pref_create: sys::Create,
    pref_destroy: sys::Destroy,
    pref_set: sys::SetAttribute,
    heuristic: sys::GetHeuristic,
    matmul: sys::Matmul,
}

impl std::fmt::Debug for HipBlasLt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBlasLt")
            .field("path", &self.path)
            .finish()
    }
}

/// The workspace kpt offers hipBLASLt's algorithms (32 MiB, what PyTorch's ROCm build
/// defaults to for hipBLASLt).
pub const WORKSPACE_BYTES: usize = 32 << 20;

impl HipBlasLt {
    /// The sonames tried after the unversioned name: ROCm 7 (1), ROCm 6 (0).
    pub const SONAMES: [&'static str; 2] = ["1", "0"];

    /// The places kpt looks for hipBLASLt (`KPT_HIPBLASLT_LIBRARY` first).
    pub fn library_candidates() -> Vec<PathBuf> {
        candidates(HIPBLASLT_ENV, "libhipblaslt", &Self::SONAMES)
    }

    /// The process's hipBLASLt, loaded on first use; the outcome is kept.
    pub fn global() -> Result<&'static HipBlasLt, AmdError> {
        static LIB: OnceLock<Result<HipBlasLt, AmdError>> = OnceLock::new();
        LIB.get_or_init(|| HipBlasLt::load_first(&HipBlasLt::library_candidates()))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Loads the first of `paths` that opens and has every function kpt calls.
    pub fn load_first(paths: &[PathBuf]) -> Result<HipBlasLt, AmdError> {
        let (lib, path) = open_first(paths, "hipBLASLt", "hipblaslt", HIPBLASLT_ENV)?;
        let library = path.display().to_string();
        macro_rules! load {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol is a hipBLASLt function whose C signature is `$ty`
                // (see `sys`, written from hipblaslt.h).
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
        Ok(HipBlasLt {
            create: load!("hipblasLtCreate", sys::Create),
            destroy: load!("hipblasLtDestroy", sys::Destroy),
            desc_create: load!("hipblasLtMatmulDescCreate", sys::DescCreate),
            desc_destroy: load!("hipblasLtMatmulDescDestroy", sys::Destroy),
            desc_set: load!("hipblasLtMatmulDescSetAttribute", sys::SetAttribute),
            layout_create: load!("hipblasLtMatrixLayoutCreate", sys::LayoutCreate),
            layout_destroy: load!("hipblasLtMatrixLayoutDestroy", sys::Destroy),
            pref_create: load!("hipblasLtMatmulPreferenceCreate", sys::Create),
            pref_destroy: load!("hipblasLtMatmulPreferenceDestroy", sys::Destroy),
            pref_set: load!("hipblasLtMatmulPreferenceSetAttribute", sys::SetAttribute),
            heuristic: load!("hipblasLtMatmulAlgoGetHeuristic", sys::GetHeuristic),
            matmul: load!("hipblasLtMatmul", sys::Matmul),
            path,
            _lib: ManuallyDrop::new(lib),
        })
    }

    /// The library that was loaded.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

/// Whether hipBLASLt can be loaded on this machine.
pub fn hipblaslt_present() -> bool {
    HipBlasLt::global().is_ok()
}

/// One FP8 linear: `Y[M, N] = (X · sx) (W · sw)ᵀ (+ bias)`, X and W FNUZ e4m3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Linear {
    /// Rows of X and Y.
    pub m: usize,
    /// Rows of W, columns of Y.
    pub n: usize,
    /// The reduction length.
    pub k: usize,
    /// The output (and bias) dtype: f32, bf16 or f16.
    pub out: DType,
    /// Whether a bias `[N]` is added in the epilogue.
    pub bias: bool,
}

/// Device addresses of one [`Fp8Linear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Args {
    /// X, FNUZ e4m3 `[M, K]`.
    pub x: u64,
    /// W, FNUZ e4m3 `[N, K]`.
    pub w: u64,
    /// Y `[M, N]`.
    pub y: u64,
    /// Bias `[N]` (0 without).
    pub bias: u64,
    /// f32 scale of X on the device.
    pub x_scale: u64,
    /// f32 scale of W on the device.
    pub w_scale: u64,
    /// Workspace of [`WORKSPACE_BYTES`].
    pub workspace: u64,
}

/// The `hipDataType` of an FP8 GEMM's output.
pub fn out_datatype(dtype: DType) -> Result<i32, AmdError> {
    match dtype {
        DType::F32 => Ok(sys::R_32F),
        DType::F16 => Ok(sys::R_16F),
        DType::BF16 => Ok(sys::R_16BF),
        d => Err(AmdError::Invalid(format!(
            "hipBLASLt FP8 GEMMs write f32, f16 or bf16, not {d}"
        ))),
    }
}

/// The column-major matrix layouts `(type, rows, cols, ld)` of A (= W), B (= X) and
/// C/D (= Y) for `shape` (see the module docs).
pub fn layouts(shape: &Fp8Linear) -> Result<[(i32, u64, u64, i64); 3], AmdError> {
    let d = out_datatype(shape.out)?;
    if shape.m == 0 || shape.n == 0 || shape.k == 0 {
        return Err(AmdError::Invalid(format!("empty FP8 GEMM {shape:?}")));
    }
    let (m, n, k) = (shape.m as u64, shape.n as u64, shape.k as u64);
    let ld = |v: u64| i64::try_from(v).map_err(|_| AmdError::Invalid(format!("{v} rows")));
    Ok([
        (sys::R_8F_E4M3_FNUZ, k, n, ld(k)?),
        (sys::R_8F_E4M3_FNUZ, k, m, ld(k)?),
        (d, n, m, ld(n)?),
    ])
}

/// A hipBLASLt handle for one device.
pub struct LtHandle {
    lib: &'static HipBlasLt,
    handle: sys::Opaque,
}

// SAFETY: a hipBLASLt handle may be used from any thread, one call at a time; the
// backend serializes calls with a mutex.
unsafe impl Send for LtHandle {}

impl std::fmt::Debug for LtHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LtHandle")
            .field("library", &self.lib.path)
            .finish()
    }
}

/// Destroys a descriptor when dropped.
struct Owned(sys::Opaque, sys::Destroy, &'static str);

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: a live descriptor of the matching kind, not used again.
        let status = unsafe { (self.1)(self.0) };
        if status != 0 {
            tracing::warn!(
                call = self.2,
                status = status_name(status),
                "hipBLASLt destroy failed"
            );
        }
    }
}

impl LtHandle {
    /// A handle (call with the device current).
    pub fn new(lib: &'static HipBlasLt) -> Result<LtHandle, AmdError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: the pointer is to a local.
        check("hipblasLtCreate", unsafe { (lib.create)(&mut handle) })?;
        Ok(LtHandle { lib, handle })
    }

    /// Queues the FP8 linear `shape` on `stream`; `Ok(false)` (nothing queued) when
    /// hipBLASLt has no algorithm for it (FP8 kernels want K and N in multiples of their
    /// tiles), for the caller to take another path.
    ///
    /// # Safety
    /// Every address of `args` is a device allocation holding what `shape` reads or
    /// writes there (the workspace [`WORKSPACE_BYTES`]), alive until `stream` has run it.
    pub unsafe fn fp8_linear(
        &self,
        shape: &Fp8Linear,
        args: &Fp8Args,
        stream: Handle,
    ) -> Result<bool, AmdError> {
        let lib = self.lib;
        let [la, lb, ld] = layouts(shape)?;
        let mut desc = std::ptr::null_mut();
        // SAFETY: the pointer is to a local.
        check("hipblasLtMatmulDescCreate", unsafe {
            (lib.desc_create)(&mut desc, sys::COMPUTE_32F, sys::R_32F)
        })?;
        let desc = Owned(desc, lib.desc_destroy, "hipblasLtMatmulDescDestroy");
        let set = |attr: i32, value: *const c_void, size: usize| {
            // SAFETY: `value` points at `size` bytes of the attribute's type, read
            // during the call.
            check("hipblasLtMatmulDescSetAttribute", unsafe {
                (lib.desc_set)(desc.0, attr, value, size)
            })
        };
        let (op_t, op_n) = (sys::OP_T, sys::OP_N);
        set(sys::DESC_TRANSA, (&op_t as *const i32).cast(), 4)?;
        set(sys::DESC_TRANSB, (&op_n as *const i32).cast(), 4)?;
        let (w_scale, x_scale) = (args.w_scale as *const c_void, args.x_scale as *const c_void);
        set(
            sys::DESC_A_SCALE_POINTER,
            (&w_scale as *const *const c_void).cast(),
            8,
        )?;
        set(
            sys::DESC_B_SCALE_POINTER,
            (&x_scale as *const *const c_void).cast(),
            8,
        )?;
        let epilogue = if shape.bias {
            let bias = args.bias as *const c_void;
            set(
                sys::DESC_BIAS_POINTER,
                (&bias as *const *const c_void).cast(),
                8,
            )?;
            let t = ld.0;
            set(sys::DESC_BIAS_DATA_TYPE, (&t as *const i32).cast(), 4)?;
            sys::EPILOGUE_BIAS
        } else {
            sys::EPILOGUE_DEFAULT
        };
        set(sys::DESC_EPILOGUE, (&epilogue as *const u32).cast(), 4)?;
        let layout = |(t, rows, cols, l): (i32, u64, u64, i64)| -> Result<Owned, AmdError> {
            let mut out = std::ptr::null_mut();
            // SAFETY: the pointer is to a local.
            check("hipblasLtMatrixLayoutCreate", unsafe {
                (lib.layout_create)(&mut out, t, rows, cols, l)
            })?;
            Ok(Owned(
                out,
                lib.layout_destroy,
                "hipblasLtMatrixLayoutDestroy",
            ))
        };
        let (a, b, d) = (layout(la)?, layout(lb)?, layout(ld)?);
        let mut pref = std::ptr::null_mut();
        // SAFETY: the pointer is to a local.
        check("hipblasLtMatmulPreferenceCreate", unsafe {
            (lib.pref_create)(&mut pref)
        })?;
        let pref = Owned(pref, lib.pref_destroy, "hipblasLtMatmulPreferenceDestroy");
        let workspace = WORKSPACE_BYTES as u64;
        // SAFETY: a u64 attribute, read during the call.
        check("hipblasLtMatmulPreferenceSetAttribute", unsafe {
            (lib.pref_set)(
                pref.0,
                sys::PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                8,
            )
        })?;
        let mut result = sys::HeuristicResult::default();
        let mut returned = 0i32;
        // SAFETY: live descriptors; one result slot.
        check("hipblasLtMatmulAlgoGetHeuristic", unsafe {
            (lib.heuristic)(
                self.handle,
                desc.0,
                a.0,
                b.0,
                d.0,
                d.0,
                pref.0,
                1,
                &mut result,
                &mut returned,
            )
        })?;
        if returned < 1 || result.state != 0 {
            tracing::debug!(
                ?shape,
                state = result.state,
                "hipBLASLt has no FP8 algorithm"
            );
            return Ok(false);
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's contract for the device addresses; alpha and beta are
        // host f32 (the default pointer mode, the f32 scale type); C is D with beta 0.
        check("hipblasLtMatmul", unsafe {
            (lib.matmul)(
                self.handle,
                desc.0,
                (&alpha as *const f32).cast(),
                args.w as *const c_void,
                a.0,
                args.x as *const c_void,
                b.0,
                (&beta as *const f32).cast(),
                args.y as *const c_void,
                d.0,
                args.y as *mut c_void,
                d.0,
                &result.algo,
                args.workspace as *mut c_void,
                WORKSPACE_BYTES.min(result.workspace_size.max(1)),
                stream.raw(),
            )
        })?;
        Ok(true)
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and not used again.
        let status = unsafe { (self.lib.destroy)(self.handle) };
        if status != 0 {
            tracing::warn!(status = status_name(status), "hipblasLtDestroy failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heuristic_result_has_the_header_layout() {
        assert_eq!(std::mem::size_of::<sys::MatmulAlgo>(), 24);
        assert_eq!(std::mem::size_of::<sys::HeuristicResult>(), 56);
        assert_eq!(
            std::mem::offset_of!(sys::HeuristicResult, workspace_size),
            24
        );
        assert_eq!(std::mem::offset_of!(sys::HeuristicResult, state), 32);
        assert_eq!(std::mem::offset_of!(sys::HeuristicResult, reserved), 40);
    }

    #[test]
    fn layouts_are_the_transposed_weights_times_the_activations() {
        let s = Fp8Linear {
            m: 3,
            n: 5,
            k: 64,
            out: DType::BF16,
            bias: true,
        };
        assert_eq!(
            layouts(&s).unwrap(),
            [(1000, 64, 5, 64), (1000, 64, 3, 64), (14, 5, 3, 5)]
        );
        assert!(layouts(&Fp8Linear { m: 0, ..s }).is_err());
        assert!(layouts(&Fp8Linear {
            out: DType::F8E4M3,
            ..s
        })
        .is_err());
        assert_eq!(status_name(7), "HIPBLAS_STATUS_NOT_SUPPORTED");
    }

    #[test]
    fn a_missing_library_names_what_was_tried() {
        let e =
            HipBlasLt::load_first(&[PathBuf::from("/nonexistent/libhipblaslt.so")]).unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("no hipBLASLt found ("), "{m}");
        assert!(m.contains(HIPBLASLT_ENV) && m.contains("hipblaslt"), "{m}");
    }
}
