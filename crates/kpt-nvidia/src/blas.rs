//! GEMM through cuBLASLt: f32 (TF32 only when allowed), f16, bf16 and FP8 with
//! per-tensor scales, bias and ReLU/GELU epilogues fused, and an autotune cache of
//! algorithms keyed by problem.
//!
//! Everything is row-major on kpt's side. cuBLASLt is column-major, so a row-major
//! `Y[M, N]` is computed as the column-major `Yᵀ[N, M]`:
//! - linear `Y = X Wᵀ` with `W [N, K]`: `Yᵀ = W Xᵀ`, A = W transposed ("TN", the layout
//!   FP8 needs on Hopper), B = X;
//! - matmul `Y = A B` with `B [K, N]`: `Yᵀ = Bᵀ Aᵀ`, both untransposed.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self, cublasComputeType_t as Compute, cublasLtEpilogue_t as Epi,
    cublasLtMatmulDescAttributes_t as DescAttr, cudaDataType_t as Data,
};
use kpt_core::DType;

use crate::autotune_cache::{AutotuneCache, Choice};
use crate::gpu::Gpu;
use crate::memory::DeviceBlock;
use crate::NvidiaError;

/// `cublasOperation_t` values (an `int32` attribute).
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// An activation cuBLASLt applies in the GEMM epilogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// None.
    None,
    /// `max(x, 0)`.
    Relu,
    /// GELU, tanh approximation.
    GeluTanh,
}

/// Which operand layout the GEMM has (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `Y[M, N] = X[M, K] · W[N, K]ᵀ`.
    Linear,
    /// `Y[M, N] = A[M, K] · B[K, N]`.
    MatMul,
}

/// One GEMM problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// Independent problems laid out back to back (both operands and the output).
    pub batch: usize,
    /// Operand layout.
    pub layout: Layout,
    /// dtype of the first operand (X or A).
    pub a: DType,
    /// dtype of the second operand (W or B).
    pub b: DType,
    /// dtype of the output (and of the bias).
    pub out: DType,
    /// Whether a bias `[N]` is added.
    pub bias: bool,
    /// The fused activation.
    pub epilogue: Epilogue,
}

impl std::fmt::Display for GemmShape {
    /// The problem as the autotune cache file keys it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} {}x{}x{} batch {} {}*{}->{} bias {} {:?}",
            self.layout,
            self.m,
            self.n,
            self.k,
            self.batch,
            self.a,
            self.b,
            self.out,
            self.bias,
            self.epilogue
        )
    }
}

/// Device addresses of one GEMM's operands.
#[derive(Debug, Clone, Copy)]
pub struct GemmArgs {
    /// X or A.
    pub a: u64,
    /// W or B.
    pub b: u64,
    /// Y.
    pub out: u64,
    /// Bias `[N]` (0 when the shape has none).
    pub bias: u64,
    /// f32 scale of `a` on the device (FP8 only, else 0).
    pub a_scale: u64,
    /// f32 scale of `b` on the device (FP8 only, else 0).
    pub b_scale: u64,
}

fn data_type(d: DType) -> Result<Data, NvidiaError> {
    Ok(match d {
        DType::F32 => Data::CUDA_R_32F,
        DType::F16 => Data::CUDA_R_16F,
        DType::BF16 => Data::CUDA_R_16BF,
        DType::F8E4M3 => Data::CUDA_R_8F_E4M3,
        DType::F8E5M2 => Data::CUDA_R_8F_E5M2,
        d => {
            return Err(NvidiaError::Invalid(format!(
                "cuBLASLt GEMM takes f32, f16, bf16, f8e4m3 or f8e5m2, not {d}"
            )))
        }
    })
}

impl GemmShape {
    /// Checks the dtype combination cuBLASLt supports.
    fn validate(&self) -> Result<(), NvidiaError> {
        let fp8 = |d: DType| matches!(d, DType::F8E4M3 | DType::F8E5M2);
        let ok = if fp8(self.a) || fp8(self.b) {
            fp8(self.a)
                && fp8(self.b)
                && !(self.a == DType::F8E5M2 && self.b == DType::F8E5M2)
                && self.layout == Layout::Linear
                && matches!(self.out, DType::BF16 | DType::F16 | DType::F32)
        } else {
            self.a == self.b && self.out == self.a
        };
        if !ok {
            return Err(NvidiaError::Invalid(format!(
                "unsupported GEMM dtypes {} x {} -> {} ({:?}); FP8 needs the linear layout \
                 and at most one e5m2 operand",
                self.a, self.b, self.out, self.layout
            )));
        }
        if fp8(self.a) && self.out == DType::F32 && self.bias {
            // cuBLASLt's FP8 kernels with an f32 output want a bf16 bias, not the
            // output's dtype that `GemmArgs::bias` holds.
            return Err(NvidiaError::Invalid(
                "an FP8 GEMM with an f32 output takes no bias in cuBLASLt; use a bf16 or \
                 f16 output, or add the bias afterwards"
                    .into(),
            ));
        }
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return Err(NvidiaError::Invalid(format!("empty GEMM {self:?}")));
        }
        Ok(())
    }

    /// FLOPs of the whole problem.
    pub fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k * self.batch) as f64
    }
}

/// Frees cuBLASLt descriptors when dropped.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created by cuBLASLt below and destroyed once, here.
        unsafe {
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: DescAttr, v: &T) -> Result<(), NvidiaError> {
    // SAFETY: `v` is the attribute's documented type and lives through the call.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            v as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| NvidiaError::cublas("cublasLtMatmulDescSetAttribute", e))
}

/// `rows x cols` column-major matrices with leading dimension `rows`, `batch` of them.
fn layout(
    dtype: DType,
    rows: usize,
    cols: usize,
    batch: usize,
) -> Result<sys::cublasLtMatrixLayout_t, NvidiaError> {
    let l = lt::create_matrix_layout(data_type(dtype)?, rows as u64, cols as u64, rows as i64)
        .map_err(|e| NvidiaError::cublas("cublasLtMatrixLayoutCreate", e))?;
    if batch > 1 {
        let count = batch as i32;
        let stride = (rows * cols) as i64;
        let set = |attr, v: *const c_void, size| {
            // SAFETY: `v` points at a value of the attribute's type.
            unsafe { lt::set_matrix_layout_attribute(l, attr, v, size) }
                .map_err(|e| NvidiaError::cublas("cublasLtMatrixLayoutSetAttribute", e))
        };
        set(
            sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
            &count as *const i32 as *const c_void,
            4,
        )?;
        set(
            sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
            &stride as *const i64 as *const c_void,
            8,
        )?;
    }
    Ok(l)
}

/// How cuBLASLt algorithms are chosen (the `kernel` section of kpt's configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmTuning {
    /// Time the heuristic's candidates on the first use of each problem and keep the
    /// fastest; otherwise take the heuristic's first.
    pub autotune: bool,
    /// Untimed calls of each candidate before its timed ones.
    pub warmup: usize,
    /// Timed calls of each candidate in the first round (at least 1).
    pub iters: usize,
    /// A file of picks that later processes reuse ([`crate::autotune_cache`]).
    pub cache: Option<PathBuf>,
}

impl Default for GemmTuning {
    /// The configuration's defaults.
    fn default() -> Self {
        (&kpt_core::config::KernelConfig::default()).into()
    }
}

impl From<&kpt_core::config::KernelConfig> for GemmTuning {
    /// The configuration's `kernel.autotune*` fields.
    fn from(k: &kpt_core::config::KernelConfig) -> Self {
        Self {
            autotune: k.autotune,
            warmup: k.autotune_warmup,
            iters: k.autotune_iters,
            cache: k.autotune_cache.clone(),
        }
    }
}

/// cuBLASLt on one device: a handle, a workspace and the algorithm cache.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBlock,
    allow_tf32: bool,
    tuning: GemmTuning,
    /// The autotune cache file's picks, and this device's prefix of their keys.
    file: Option<(Mutex<AutotuneCache>, String)>,
    /// Per shape, made on first use: the descriptors and the chosen algorithm. The lock
    /// is held from setting a call's pointers to its enqueue.
    shapes: Mutex<HashMap<GemmShape, (Descriptors, sys::cublasLtMatmulAlgo_t)>>,
}

// SAFETY: the handle is used under the device's single stream; cuBLASLt handles may be
// shared across threads when calls on it do not overlap, which `Blas::gemm`'s callers
// (the backend, on its stream) guarantee.
unsafe impl Send for Blas {}
// SAFETY: see `Send`.
unsafe impl Sync for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("allow_tf32", &self.allow_tf32)
            .field("tuning", &self.tuning)
            .finish_non_exhaustive()
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Whether the cuBLASLt library can be loaded.
pub fn cublaslt_present() -> bool {
    // SAFETY: only tries to open the library; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// Heuristic candidates timed per shape by the autotuner, and how many of the fastest
/// are timed again.
const AUTOTUNE_CANDIDATES: usize = 24;
const AUTOTUNE_FINALISTS: usize = 4;

/// Workspace cuBLASLt may use: 32 MiB on Hopper, 4 MiB before (NVIDIA's advice).
fn workspace_bytes(gpu: &Gpu) -> usize {
    if gpu.properties().compute_capability.0 >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

impl Blas {
    /// cuBLASLt for `gpu`. `allow_tf32` lets f32 GEMMs use TF32 tensor cores; `tuning`
    /// says how each problem's algorithm is chosen (an unreadable cache file is an
    /// error).
    pub fn new(gpu: &Gpu, allow_tf32: bool, tuning: &GemmTuning) -> Result<Self, NvidiaError> {
        if !cublaslt_present() {
            return Err(NvidiaError::Invalid(
                "the cuBLASLt library (libcublasLt.so) was not found; add the CUDA toolkit's \
                 lib64 folder to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        // The cache file first: an unreadable one fails before anything needs freeing.
        let file = match (&tuning.cache, tuning.autotune) {
            (Some(path), true) => {
                let p = gpu.properties();
                // SAFETY: a version query without arguments.
                let version = unsafe { sys::cublasLtGetVersion() };
                let prefix = format!(
                    "{} sm_{}{} | cublasLt {version} | workspace {} | tf32 {allow_tf32}",
                    p.name,
                    p.compute_capability.0,
                    p.compute_capability.1,
                    workspace_bytes(gpu)
                );
                Some((Mutex::new(AutotuneCache::open(path)?), prefix))
            }
            _ => None,
        };
        gpu.bind()?;
        let workspace = gpu.alloc(workspace_bytes(gpu))?;
        let handle = lt::create_handle().map_err(|e| NvidiaError::cublas("cublasLtCreate", e))?;
        Ok(Self {
            handle,
            workspace,
            allow_tf32,
            tuning: tuning.clone(),
            file,
            shapes: Mutex::new(HashMap::new()),
        })
    }

    /// The descriptors of shape `s` (everything but the per-call pointers).
    fn descriptors(&self, s: &GemmShape) -> Result<Descriptors, NvidiaError> {
        let compute = match s.a {
            DType::F32 if self.allow_tf32 => Compute::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => Compute::CUBLAS_COMPUTE_32F,
        };
        let desc = lt::create_matmul_desc(compute, Data::CUDA_R_32F)
            .map_err(|e| NvidiaError::cublas("cublasLtMatmulDescCreate", e))?;
        // Column-major view: D[n x m] = op(A) · op(B), A = the second operand.
        let (trans_a, a_rows, a_cols) = match s.layout {
            Layout::Linear => (OP_T, s.k, s.n),
            Layout::MatMul => (OP_N, s.n, s.k),
        };
        let d = Descriptors {
            desc,
            layouts: [
                layout(s.b, a_rows, a_cols, s.batch)?,
                layout(s.a, s.k, s.m, s.batch)?,
                layout(s.out, s.n, s.m, s.batch)?,
            ],
        };
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, &trans_a)?;
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, &OP_N)?;
        let epilogue = match (s.bias, s.epilogue) {
            (false, Epilogue::None) => Epi::CUBLASLT_EPILOGUE_DEFAULT,
            (false, Epilogue::Relu) => Epi::CUBLASLT_EPILOGUE_RELU,
            (false, Epilogue::GeluTanh) => Epi::CUBLASLT_EPILOGUE_GELU,
            (true, Epilogue::None) => Epi::CUBLASLT_EPILOGUE_BIAS,
            (true, Epilogue::Relu) => Epi::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, Epilogue::GeluTanh) => Epi::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        if s.bias {
            set_desc(
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                &data_type(s.out)?,
            )?;
        }
        Ok(d)
    }

    /// Points `d` at this call's bias and FP8 scales.
    fn set_pointers(d: &Descriptors, s: &GemmShape, args: &GemmArgs) -> Result<(), NvidiaError> {
        if s.bias {
            let ptr = args.bias as *const c_void;
            set_desc(d.desc, DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr)?;
        }
        if matches!(s.a, DType::F8E4M3 | DType::F8E5M2) {
            // cuBLASLt's A is kpt's second operand.
            let (a, b) = (args.b_scale as *const c_void, args.a_scale as *const c_void);
            set_desc(d.desc, DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a)?;
            set_desc(d.desc, DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b)?;
        }
        Ok(())
    }

    /// Up to `count` algorithms cuBLASLt's heuristic proposes, best first.
    fn candidates(
        &self,
        d: &Descriptors,
        count: usize,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, NvidiaError> {
        let pref = lt::create_matmul_pref()
            .map_err(|e| NvidiaError::cublas("cublasLtMatmulPreferenceCreate", e))?;
        let size = self.workspace.bytes();
        // SAFETY: `pref` was just created; the value is the attribute's type (u64 bytes).
        let set = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &size as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
        };
        let mut results = vec![
            // SAFETY: a plain C struct for cuBLASLt to fill; all-zero is a valid value.
            unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() };
            count
        ];
        let mut found = 0i32;
        let status = set.and_then(|_| {
            // SAFETY: descriptors are live; `results` holds `count` entries.
            unsafe {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    d.desc,
                    d.layouts[0],
                    d.layouts[1],
                    d.layouts[2],
                    d.layouts[2],
                    pref,
                    count as i32,
                    results.as_mut_ptr(),
                    &mut found,
                )
            }
            .result()
        });
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        status.map_err(|e| NvidiaError::cublas("cublasLtMatmulAlgoGetHeuristic", e))?;
        let algos: Vec<_> = results[..found.max(0) as usize]
            .iter()
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if algos.is_empty() {
            return Err(NvidiaError::Cublas {
                call: "cublasLtMatmulAlgoGetHeuristic",
                status: "no algorithm for this problem".into(),
            });
        }
        Ok(algos)
    }

    fn run(
        &self,
        gpu: &Gpu,
        d: &Descriptors,
        args: &GemmArgs,
        algo: &sys::cublasLtMatmulAlgo_t,
    ) -> Result<(), NvidiaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the backend checked every operand buffer against the shape the
        // descriptors encode; the workspace is ours; beta = 0 so C is not read.
        unsafe {
            lt::matmul(
                self.handle,
                d.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                args.b as *const c_void,
                d.layouts[0],
                args.a as *const c_void,
                d.layouts[1],
                args.out as *const c_void,
                d.layouts[2],
                args.out as *mut c_void,
                d.layouts[2],
                algo,
                self.workspace.ptr() as *mut c_void,
                self.workspace.bytes(),
                gpu.stream().cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| NvidiaError::cublas("cublasLtMatmul", e))
    }

    /// The algorithm for `s`: the fastest of the heuristic's candidates (timed with
    /// events when autotuning; the cache file's pick where it has one), else its first.
    fn algorithm(
        &self,
        gpu: &Gpu,
        s: &GemmShape,
        d: &Descriptors,
        args: &GemmArgs,
    ) -> Result<sys::cublasLtMatmulAlgo_t, NvidiaError> {
        if !self.tuning.autotune {
            return Ok(self.candidates(d, 1)?[0]);
        }
        let candidates = self.candidates(d, AUTOTUNE_CANDIDATES)?;
        let cached = self
            .file
            .as_ref()
            .map(|(cache, prefix)| (cache, format!("{prefix} | {s}")));
        if let Some((cache, key)) = &cached {
            // A pick past the candidates the heuristic now gives is timed again.
            let pick = lock(cache).get(key).map(|c| c.candidate);
            if let Some(&algo) = pick.and_then(|i| candidates.get(i)) {
                return Ok(algo);
            }
        }
        let mut best = (f64::INFINITY, 0);
        if candidates.len() > 1 {
            // Round one: every candidate, `iters` timed calls after `warmup` untimed
            // ones; candidates that fail to run are skipped.
            let mut timed = Vec::new();
            for (i, algo) in candidates.iter().enumerate() {
                if self.run(gpu, d, args, algo).is_err() {
                    continue;
                }
                for _ in 0..self.tuning.warmup {
                    self.run(gpu, d, args, algo)?;
                }
                let t = gpu.time_per_call(self.tuning.iters, || self.run(gpu, d, args, algo))?;
                timed.push((t, i));
            }
            // Round two: the fastest few again over about 2 ms each, so that clock
            // changes during round one do not decide.
            timed.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (t0, i) in timed.into_iter().take(AUTOTUNE_FINALISTS) {
                let calls = ((2e-3 / t0.max(1e-7)).ceil() as usize).clamp(3, 100);
                let t = gpu.time_per_call(calls, || self.run(gpu, d, args, &candidates[i]))?;
                if t < best.0 {
                    best = (t, i);
                }
            }
            tracing::debug!(
                ?s,
                candidates = candidates.len(),
                best_s = best.0,
                "cuBLASLt autotuned"
            );
        }
        if let Some((cache, key)) = cached {
            let choice = Choice {
                candidate: best.1,
                seconds: if best.0.is_finite() { best.0 } else { 0.0 },
            };
            lock(cache).insert(key, choice)?;
        }
        Ok(candidates[best.1])
    }

    /// Queues the GEMM `s` on `gpu`'s stream.
    pub fn gemm(&self, gpu: &Gpu, s: &GemmShape, args: &GemmArgs) -> Result<(), NvidiaError> {
        s.validate()?;
        gpu.bind()?;
        let mut shapes = lock(&self.shapes);
        let (d, algo) = match shapes.entry(*s) {
            Entry::Occupied(e) => {
                let (d, algo) = e.into_mut();
                Self::set_pointers(d, s, args)?;
                (&*d, *algo)
            }
            Entry::Vacant(e) => {
                // Autotuning runs the GEMM, so the pointers are set first.
                let d = self.descriptors(s)?;
                Self::set_pointers(&d, s, args)?;
                let algo = self.algorithm(gpu, s, &d, args)?;
                let (d, _) = e.insert((d, algo));
                (&*d, algo)
            }
        };
        self.run(gpu, d, args, &algo)
    }

    /// Shapes whose algorithm is cached.
    pub fn tuned_shapes(&self) -> usize {
        lock(&self.shapes).len()
    }
}

/// A lock whose holder cannot leave its value inconsistent by panicking (every update is
/// one insert), so a poisoned one is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_follows_the_kernel_configuration() {
        let mut k = kpt_core::config::KernelConfig::default();
        assert_eq!(GemmTuning::from(&k), GemmTuning::default());
        k.autotune = false;
        k.autotune_iters = 7;
        k.autotune_warmup = 2;
        k.autotune_cache = Some(PathBuf::from("tuning/cublaslt.json"));
        let t = GemmTuning::from(&k);
        assert!(!t.autotune);
        assert_eq!((t.iters, t.warmup), (7, 2));
        assert_eq!(
            t.cache.as_deref(),
            Some(std::path::Path::new("tuning/cublaslt.json"))
        );
    }

    #[test]
    fn a_problem_names_everything_that_picks_its_algorithm() {
        let s = GemmShape {
            m: 2048,
            n: 32000,
            k: 2048,
            batch: 1,
            layout: Layout::Linear,
            a: DType::BF16,
            b: DType::BF16,
            out: DType::F32,
            bias: true,
            epilogue: Epilogue::GeluTanh,
        };
        assert_eq!(
            s.to_string(),
            "Linear 2048x32000x2048 batch 1 bf16*bf16->f32 bias true GeluTanh"
        );
    }
}
