//! [`RocmBackend`]: kpt's `Backend` on one ROCm device. Buffers are blocks of the
//! shared caching allocator on [`AmdGpu`]; `amd.*` kernels run on the device (rocBLAS
//! GEMMs, the HSACO code objects of `kernels/hip` and the Triton norms, device copies);
//! `cpu.*` kernels, the end of every fallback chain, run on the host with the data
//! copied over and back, as on the CUDA backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kpt_core::backend::{
    cache_write_into, check_output_specs, copy_extent, row_write_extent, split_rotary_cache_into,
    Backend, BufferMut, BufferRef, DeviceBuffer, MemoryStats,
};
use kpt_core::graph::{rope_frequencies, rope_seq_len, Op, RopeScaling, TensorSpec};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::tensor::Tensor;
use kpt_core::{DType, KptError, Result};
use kpt_kernels::artifacts;
use kpt_kernels::CpuBackend;

use crate::arch::Fp8Format;
use crate::blas::{one_bytes, BlasHandle, GemmArgs, GemmPlan, Layout, Rocblas};
use crate::device::AmdDevice;
use crate::fp8;
use crate::gpu::AmdGpu;
use crate::hipblaslt::{Fp8Args, Fp8Linear, HipBlasLt, LtHandle, WORKSPACE_BYTES};
use crate::kernels::{AttentionDims, Binary, Launch, NormImpl, Planner, QuantScale, RowOp};
use crate::memory::DeviceBlock;
use crate::rtc::{first_rocm_for, Hiprtc};
use crate::AmdError;

/// The device feature the registry's rocBLAS kernels need (`amd.*.rocblas`).
pub const ROCBLAS_FEATURE: &str = "rocblas";
/// The device feature of `amd.linear.hipblaslt_fp8`: hipBLASLt loaded on an FNUZ FP8
/// processor (MI300) with a hiprtc that builds for it (the activations' quantization
/// and the OCP -> FNUZ conversion are compiled at run time there).
pub const HIPBLASLT_FP8_FEATURE: &str = "hipblaslt_fp8";

/// The libraries a backend found for a device, besides the HIP runtime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Libraries {
    /// rocBLAS is loaded.
    pub rocblas: bool,
    /// hipBLASLt is loaded, and hiprtc can build kpt's kernels for the processor.
    pub hipblaslt_fp8: bool,
}

impl Libraries {
    /// Both, as a machine with a complete ROCm installation has them.
    pub const ALL: Libraries = Libraries {
        rocblas: true,
        hipblaslt_fp8: true,
    };
}

/// What `kpt detect` and the kernel registry see of `device` under a backend with
/// `libraries`: its [`AmdDevice::device_info`], plus [`ROCBLAS_FEATURE`] with rocBLAS and
/// [`HIPBLASLT_FP8_FEATURE`] with hipBLASLt on a processor whose FP8 is FNUZ. The one
/// place the backend's features are decided, so that an explanation on a recorded device
/// (`kpt kernels --explain --on mi300x`) selects what the backend would launch.
pub fn backend_device_info(device: &AmdDevice, libraries: Libraries) -> DeviceInfo {
    let mut info = device.device_info();
    if libraries.rocblas {
        info.features.push(ROCBLAS_FEATURE.into());
    }
    if libraries.hipblaslt_fp8 && device.arch.fp8() == Some(Fp8Format::Fnuz) {
        info.features.push(HIPBLASLT_FP8_FEATURE.into());
    }
    info
}

/// Whether hiprtc (of the loaded runtime) can build kpt's kernels for `processor`.
pub(crate) fn hiprtc_builds(processor: &str) -> bool {
    let Ok(rtc) = Hiprtc::global() else {
        return false;
    };
    let has = rtc.version().map(|v| (v.major, v.minor));
    matches!((first_rocm_for(processor), has), (Some(needs), Some(has)) if has >= needs)
}

/// The FP8 linear's registry name.
const HIPBLASLT_FP8: &str = "amd.linear.hipblaslt_fp8";

/// Options of the ROCm backend (from `KptConfig`'s `amd` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RocmOptions {
    /// Load rocBLAS for GEMMs (without it, GEMMs fall back down the kernel chain).
    pub rocblas: bool,
    /// Load hipBLASLt for FP8 linears on MI300 (`amd.use_hipblaslt`).
    pub hipblaslt: bool,
}

impl Default for RocmOptions {
    fn default() -> Self {
        Self {
            rocblas: true,
            hipblaslt: true,
        }
    }
}

/// The ROCm backend for one device.
pub struct RocmBackend {
    gpu: Arc<AmdGpu>,
    blas: Option<Mutex<BlasHandle>>,
    /// hipBLASLt with its workspace, where the device has the FP8 path.
    lt: Option<Mutex<(LtHandle, DeviceBlock)>>,
    info: DeviceInfo,
    name: String,
    host: CpuBackend,
    planner: Planner,
    /// Scaled rotary tables on the device, by `(head_dim, theta, scaling)`.
    rope_tables: Mutex<HashMap<String, (Arc<DeviceBlock>, f64)>>,
    /// A vector of ones per dtype (its length in elements) for the bias's rank-1 update.
    ones: Mutex<HashMap<DType, (Arc<DeviceBlock>, usize)>>,
    /// Kernels and steps run on the host (copied over and back) since the backend opened.
    host_runs: AtomicU64,
}

impl std::fmt::Debug for RocmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocmBackend")
            .field("name", &self.name)
            .field("gpu", &self.gpu)
            .finish_non_exhaustive()
    }
}

fn err(message: impl Into<String>) -> KptError {
    KptError::Backend {
        backend: "rocm".into(),
        message: message.into(),
    }
}

/// The device block behind `buffer`, checked to hold `spec`.
fn block<'a>(buffer: &'a DeviceBuffer, spec: &TensorSpec) -> Result<&'a DeviceBlock> {
    if buffer.dtype() != spec.dtype || buffer.len() < spec.numel() {
        return Err(err(format!(
            "buffer of {} {} cannot hold {spec}",
            buffer.len(),
            buffer.dtype()
        )));
    }
    buffer
        .inner::<DeviceBlock>()
        .ok_or_else(|| err("buffer does not belong to the ROCm backend"))
}

fn ptr(r: &BufferRef<'_>) -> Result<u64> {
    block(r.buffer, r.spec).map(DeviceBlock::ptr)
}

fn out_ptr(m: &BufferMut<'_>) -> Result<u64> {
    block(m.buffer, m.spec).map(DeviceBlock::ptr)
}

/// `(rows, last dim)` of a shape.
fn rows_dim(shape: &[usize]) -> (usize, usize) {
    let dim = shape.last().copied().unwrap_or(1);
    (shape.iter().product::<usize>() / dim.max(1), dim)
}

/// The code object (`kpt_kernels::artifacts` kernel name) an `amd.*` registry kernel
/// of `op` launches from; `None` for kernels that launch none (rocBLAS, copies).
fn code_object_of(op: &Op) -> Option<&'static str> {
    Some(match op {
        Op::RmsNorm { .. } | Op::AddRmsNorm { .. } => "rms_norm",
        Op::LayerNorm { .. } | Op::AddLayerNorm { .. } => "layer_norm",
        Op::Softmax | Op::ArgMax => "softmax",
        Op::Rotary { .. } | Op::SplitRotary { .. } => "rotary",
        Op::Activation { .. } | Op::Add | Op::Mul | Op::Cast { .. } | Op::ActAndMul { .. } => {
            "elementwise"
        }
        Op::Embedding => "embedding",
        Op::Attention(_) => "attention",
        Op::Quantize { .. } | Op::Dequantize { .. } => "quantize",
        _ => return None,
    })
}

/// Whether [`RocmBackend`] runs `kernel` (a registry name) for `op` on `processor` with
/// what kpt ships: a `cpu.*` kernel on the host; an `amd.*` kernel of kpt's code objects
/// where one was built for the processor (Triton's norms: the specialization's object);
/// the rocBLAS, hipBLASLt and copy kernels, which launch no code object of kpt's, on any
/// processor. Run-time compilation is not counted: this is what works without it.
pub fn launches_on(kernel: &str, op: &Op, processor: &str) -> bool {
    if kernel.starts_with("cpu.") {
        return true;
    }
    if !kernel.starts_with("amd.") {
        return false;
    }
    if kernel.starts_with("amd.triton.") {
        // Every specialization is built for the same processors.
        return matches!(op, Op::RmsNorm { .. } | Op::AddRmsNorm { .. })
            && artifacts::hsaco_targets("triton_rms_norm_f32_1024").contains(&processor);
    }
    match op {
        Op::Linear { .. } if kernel == HIPBLASLT_FP8 => true,
        Op::MatMul | Op::Linear { .. } | Op::LinearAct { .. } => kernel.ends_with(".rocblas"),
        Op::Concat { .. } | Op::Split { .. } | Op::CacheWrite => true,
        op => code_object_of(op)
            .is_some_and(|object| !artifacts::hsaco_candidates(object, processor).is_empty()),
    }
}

impl RocmBackend {
    /// Opens device `index`: [`AmdError::NoRuntime`] without a HIP runtime,
    /// [`AmdError::NoDevice`] without such a device. rocBLAS is optional: without it GEMMs
    /// are not offered on this device (the registry falls back) and the device lacks the
    /// `rocblas` feature.
    pub fn new(index: usize, options: RocmOptions) -> std::result::Result<Self, AmdError> {
        let gpu = Arc::new(AmdGpu::new(index)?);
        let blas = if options.rocblas {
            match Rocblas::global() {
                Ok(lib) => Some(Mutex::new(BlasHandle::new(lib, gpu.stream())?)),
                Err(e) => {
                    tracing::warn!(error = %e, "rocBLAS not loaded; GEMMs fall back down the kernel chain");
                    None
                }
            }
        } else {
            None
        };
        let fnuz = gpu.device().arch.fp8() == Some(Fp8Format::Fnuz);
        let processor = gpu.device().arch.processor();
        let lt = if options.hipblaslt && fnuz && hiprtc_builds(processor) {
            match HipBlasLt::global() {
                Ok(lib) => {
                    let workspace = gpu.alloc(WORKSPACE_BYTES)?;
                    Some(Mutex::new((LtHandle::new(lib)?, workspace)))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "hipBLASLt not loaded; FP8 linears are dequantized for rocBLAS");
                    None
                }
            }
        } else {
            None
        };
        let libraries = Libraries {
            rocblas: blas.is_some(),
            hipblaslt_fp8: lt.is_some(),
        };
        let info = backend_device_info(gpu.device(), libraries);
        let planner = Planner {
            compute_units: gpu.device().properties.compute_units,
        };
        Ok(Self {
            name: format!("rocm:{index}"),
            gpu,
            blas,
            lt,
            info,
            host: CpuBackend::new().map_err(|e| AmdError::Invalid(e.to_string()))?,
            planner,
            rope_tables: Mutex::default(),
            ones: Mutex::default(),
            host_runs: AtomicU64::new(0),
        })
    }

    /// The device.
    pub fn gpu(&self) -> &AmdGpu {
        &self.gpu
    }

    /// Whether rocBLAS is loaded for this device.
    pub fn has_rocblas(&self) -> bool {
        self.blas.is_some()
    }

    fn launch_kernel(&self, launch: Result<Launch, AmdError>) -> Result<()> {
        Ok(self.gpu.launch(&launch?)?)
    }

    /// Whether a code object of `kernel` was shipped for this device's processor.
    fn shipped(&self, kernel: &str) -> bool {
        let processor = self.gpu.device().arch.processor();
        !artifacts::hsaco_candidates(kernel, processor).is_empty()
    }

    /// Runs `op` as a step of another op (a weight conversion, an activation after a
    /// GEMM): on the device when this processor has the op's code object, else with the
    /// f64 reference on the host.
    fn step(&self, op: &Op, inputs: &[BufferRef<'_>], outputs: &mut [BufferMut<'_>]) -> Result<()> {
        match code_object_of(op) {
            Some(kernel) if self.shipped(kernel) => {
                self.run_device("amd.step", op, inputs, outputs)
            }
            _ => {
                tracing::debug!(%op, "no code object for this processor; the step runs on the host");
                self.run_on_host(kpt_kernels::catalog::CPU_REFERENCE, op, inputs, outputs)
            }
        }
    }

    /// A device vector of at least `n` ones of `dtype`.
    fn ones(&self, dtype: DType, n: usize) -> Result<Arc<DeviceBlock>> {
        let mut ones = self.ones.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((block, len)) = ones.get(&dtype) {
            if *len >= n {
                return Ok(Arc::clone(block));
            }
        }
        let len = n.next_power_of_two().max(256);
        let one = one_bytes(dtype)?;
        let bytes: Vec<u8> = one.iter().copied().cycle().take(len * one.len()).collect();
        let block = Arc::new(self.gpu.upload(&bytes)?);
        ones.insert(dtype, (Arc::clone(&block), len));
        Ok(block)
    }

    fn gemm(&self, op: &Op, inputs: &[BufferRef<'_>], out: &mut BufferMut<'_>) -> Result<()> {
        let blas = self
            .blas
            .as_ref()
            .ok_or_else(|| err("rocBLAS is not available on this machine"))?;
        let a = inputs[0].spec;
        let b = inputs[1].spec;
        let (layout, m, k, n, batch, bias, act) = match op {
            Op::MatMul => {
                let (k, n) = (b.shape[b.shape.len() - 2], b.shape[b.shape.len() - 1]);
                if b.shape.len() == 2 {
                    let (m, _) = rows_dim(&a.shape);
                    (Layout::MatMul, m, k, n, 1, false, None)
                } else {
                    let m = a.shape[a.shape.len() - 2];
                    let batch = a.shape[..a.shape.len() - 2].iter().product();
                    (Layout::MatMul, m, k, n, batch, false, None)
                }
            }
            Op::Linear { bias } => {
                let (m, k) = rows_dim(&a.shape);
                (Layout::Linear, m, k, b.shape[0], 1, *bias, None)
            }
            Op::LinearAct { bias, act } => {
                let (m, k) = rows_dim(&a.shape);
                (Layout::Linear, m, k, b.shape[0], 1, *bias, Some(*act))
            }
            _ => return Err(err(format!("{op} is not a GEMM"))),
        };
        if out.spec.numel() == 0 {
            return Ok(());
        }
        // Weights of another dtype are converted to the activations' dtype first
        // (dequantized with their scale when quantized).
        let w_spec = TensorSpec::new(&b.shape, a.dtype);
        let mut converted = None;
        if b.dtype != a.dtype {
            let mut buffer = self.allocate(a.dtype, b.numel())?;
            let step = if b.dtype.is_quantized() {
                Op::Dequantize { dtype: a.dtype }
            } else {
                Op::Cast { dtype: a.dtype }
            };
            self.step(
                &step,
                &[inputs[1]],
                &mut [BufferMut {
                    buffer: &mut buffer,
                    spec: &w_spec,
                }],
            )?;
            converted = Some(buffer);
        }
        let w = match &converted {
            Some(buffer) => block(buffer, &w_spec)?.ptr(),
            None => ptr(&inputs[1])?,
        };
        // With an activation after it, the GEMM writes to scratch first.
        let mut scratch = match act {
            Some(_) => Some(self.allocate(out.spec.dtype, out.spec.numel())?),
            None => None,
        };
        let y = match &scratch {
            Some(buffer) => block(buffer, out.spec)?.ptr(),
            None => out_ptr(out)?,
        };
        let handle = blas.lock().unwrap_or_else(|p| p.into_inner());
        if k == 0 {
            // An empty reduction: the product is zero (then the bias and the activation).
            self.gpu
                .zero(y, out.spec.numel() * out.spec.dtype.size_in_bytes())?;
        } else {
            let plan = GemmPlan::new(layout, a.dtype, (m, n, k), batch)?;
            plan.validate()?;
            // SAFETY: the buffers were checked to hold the specs op.infer gave, which are
            // the sizes the plan reads and writes; they outlive the queued call (the
            // converted weights and scratch are freed through the allocator, which drains
            // the stream before reusing memory).
            unsafe { handle.gemm(&plan, &GemmArgs::new(ptr(&inputs[0])?, w, y))? };
        }
        if bias && m > 0 {
            let ones = self.ones(a.dtype, m)?;
            let plan = GemmPlan::bias(a.dtype, m, n)?;
            plan.validate()?;
            let args = GemmArgs {
                a: ptr(&inputs[2])?,
                b: ones.ptr(),
                d: y,
            };
            // SAFETY: bias holds N values, ones at least M, the output M × N.
            unsafe { handle.gemm(&plan, &args)? };
        }
        drop(handle);
        if let (Some(act), Some(buffer)) = (act, scratch.as_mut()) {
            self.step(
                &Op::Activation { act },
                &[BufferRef {
                    buffer,
                    spec: out.spec,
                }],
                std::slice::from_mut(out),
            )?;
        }
        Ok(())
    }

    /// Linear with FP8 e4m3 weights on hipBLASLt (MI300): the activations are quantized
    /// to e4m3 with a scale from their amax (all on the device), both operands converted
    /// to FNUZ (half the value per byte, so each scale doubles), then one FP8 GEMM with
    /// f32 compute, the scales and the bias applied by hipBLASLt.
    fn fp8_linear(
        &self,
        bias: bool,
        inputs: &[BufferRef<'_>],
        out: &mut BufferMut<'_>,
    ) -> Result<()> {
        let lt = self
            .lt
            .as_ref()
            .ok_or_else(|| err("hipBLASLt's FP8 path is not available on this device"))?;
        let (a, w) = (inputs[0].spec, inputs[1].spec);
        let fp8 = DType::F8E4M3;
        if w.dtype != fp8 || w.shape.len() != 2 || out.spec.dtype != a.dtype {
            return Err(err(format!(
                "{HIPBLASLT_FP8} takes f8e4m3 weights [N, K] and writes the activations' \
                 dtype, not {} -> {}",
                w, out.spec
            )));
        }
        let (m, k) = rows_dim(&a.shape);
        let n = w.shape[0];
        if m * n == 0 {
            return Ok(());
        }
        if k == 0 {
            return self.gemm(&Op::Linear { bias }, inputs, out);
        }
        let p = &self.planner;
        let g = &self.gpu;
        // Scales on the device: [activations, 2 * activations, 2 * weights].
        let slots = g.alloc_zeroed(12)?;
        let (sx, sx2, sw2) = (slots.ptr(), slots.ptr() + 4, slots.ptr() + 8);
        let x = ptr(&inputs[0])?;
        let xq = g.alloc(m * k)?;
        self.launch_kernel(p.amax(a.dtype, x, m * k, sx))?;
        g.copy(sx, sx2, 4)?;
        let max = fp8.max_finite() as f32;
        self.launch_kernel(p.amax_to_scale_of(sx, max))?;
        self.launch_kernel(p.amax_to_scale_of(sx2, max / 2.0))?;
        let q = QuantScale::OnDevice(sx);
        self.launch_kernel(p.quantize(a.dtype, fp8, [x, xq.ptr()], m * k, q))?;
        self.launch_kernel(fp8::plan(p, fp8, [xq.ptr(), xq.ptr()], m * k))?;
        let wq = g.alloc(n * k)?;
        self.launch_kernel(fp8::plan(p, fp8, [ptr(&inputs[1])?, wq.ptr()], n * k))?;
        let w_scale = 2.0 * inputs[1].buffer.scale;
        let scale = g.upload(&w_scale.to_le_bytes())?;
        g.copy(scale.ptr(), sw2, 4)?;
        let shape = Fp8Linear {
            m,
            n,
            k,
            out: out.spec.dtype,
            bias,
        };
        let guard = lt.lock().unwrap_or_else(|p| p.into_inner());
        let (handle, workspace) = &*guard;
        let args = Fp8Args {
            x: xq.ptr(),
            w: wq.ptr(),
            y: out_ptr(out)?,
            bias: if bias { ptr(&inputs[2])? } else { 0 },
            x_scale: sx2,
            w_scale: sw2,
            workspace: workspace.ptr(),
        };
        // SAFETY: the operands were sized above from the checked specs; the temporaries
        // go back to the allocator, which drains the stream before reusing memory.
        if unsafe { handle.fp8_linear(&shape, &args, g.stream())? } {
            return Ok(());
        }
        drop(guard);
        // No FP8 algorithm for this shape: rocBLAS on the dequantized weights, else the
        // host reference.
        tracing::debug!(m, n, k, "no hipBLASLt FP8 algorithm for this linear");
        let op = Op::Linear { bias };
        if self.blas.is_some() {
            self.gemm(&op, inputs, out)
        } else {
            let reference = kpt_kernels::catalog::CPU_REFERENCE;
            self.run_on_host(reference, &op, inputs, std::slice::from_mut(out))
        }
    }

    /// The device copy of a rotary's inverse frequencies (f64, from kpt-core's
    /// `rope_frequencies`) and its cos/sin factor, cached per `(head_dim, theta, scaling)`
    /// unless it depends on the positions.
    fn rope_table(
        &self,
        head_dim: usize,
        theta: f32,
        scaling: Option<&RopeScaling>,
        positions: &BufferRef<'_>,
    ) -> Result<(Arc<DeviceBlock>, f64)> {
        let upload = |seq_len: usize| -> Result<(Arc<DeviceBlock>, f64)> {
            let t = rope_frequencies(head_dim, f64::from(theta), scaling, seq_len)?;
            let bytes: Vec<u8> = t.inv_freq.iter().flat_map(|f| f.to_le_bytes()).collect();
            Ok((Arc::new(self.gpu.upload(&bytes)?), t.attention_factor))
        };
        if scaling.is_some_and(RopeScaling::depends_on_positions) {
            return upload(rope_seq_len(&self.host_ids(positions)?));
        }
        let key = format!("{head_dim}/{:#x}/{scaling:?}", theta.to_bits());
        let mut tables = self.rope_tables.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(hit) = tables.get(&key) {
            return Ok(hit.clone());
        }
        let fresh = upload(0)?;
        tables.insert(key, fresh.clone());
        Ok(fresh)
    }

    /// An index tensor read back to the host.
    fn host_ids(&self, r: &BufferRef<'_>) -> Result<Vec<i64>> {
        let t = self.download(r.buffer, r.spec)?;
        Ok(t.to_f64_vec().into_iter().map(|x| x as i64).collect())
    }

    /// Runs an `amd.*` kernel (or, through [`RocmBackend::step`], one step of another).
    fn run_device(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        let p = &self.planner;
        let Some(out0) = outputs.first_mut() else {
            return Err(err(format!("{op}: no output")));
        };
        let x = inputs[0].spec;
        let dt = x.dtype;
        match op {
            Op::Linear { bias } if kernel == HIPBLASLT_FP8 => {
                return self.fp8_linear(*bias, inputs, out0)
            }
            Op::MatMul | Op::Linear { .. } | Op::LinearAct { .. } => {
                return self.gemm(op, inputs, out0)
            }
            Op::RmsNorm { eps } => {
                let imp = if kernel.starts_with("amd.triton.") {
                    NormImpl::Triton
                } else {
                    NormImpl::Hip
                };
                let (rows, dim) = rows_dim(&x.shape);
                if rows > 0 {
                    let ptrs = [ptr(&inputs[0])?, ptr(&inputs[1])?, out_ptr(out0)?];
                    self.launch_kernel(p.rms_norm(imp, dt, ptrs, rows, dim, *eps))?;
                }
            }
            Op::AddRmsNorm { eps } => {
                let imp = if kernel.starts_with("amd.triton.") {
                    NormImpl::Triton
                } else {
                    NormImpl::Hip
                };
                let (rows, dim) = rows_dim(&x.shape);
                let [sum, out] = outputs else {
                    return Err(err(format!("{op}: needs two outputs")));
                };
                if rows > 0 {
                    let ins = [ptr(&inputs[0])?, ptr(&inputs[1])?, ptr(&inputs[2])?];
                    let outs = [out_ptr(sum)?, out_ptr(out)?];
                    self.launch_kernel(p.add_rms_norm(imp, dt, ins, outs, rows, dim, *eps))?;
                }
            }
            Op::LayerNorm { eps } => {
                let (rows, dim) = rows_dim(&x.shape);
                if rows > 0 {
                    let ptrs = [
                        ptr(&inputs[0])?,
                        ptr(&inputs[1])?,
                        ptr(&inputs[2])?,
                        out_ptr(out0)?,
                    ];
                    self.launch_kernel(p.layer_norm(dt, ptrs, rows, dim, *eps))?;
                }
            }
            Op::AddLayerNorm { eps } => {
                let (rows, dim) = rows_dim(&x.shape);
                let [sum, out] = outputs else {
                    return Err(err(format!("{op}: needs two outputs")));
                };
                if rows > 0 {
                    let ins = [
                        ptr(&inputs[0])?,
                        ptr(&inputs[1])?,
                        ptr(&inputs[2])?,
                        ptr(&inputs[3])?,
                    ];
                    let outs = [out_ptr(sum)?, out_ptr(out)?];
                    self.launch_kernel(p.add_layer_norm(dt, ins, outs, rows, dim, *eps))?;
                }
            }
            Op::Softmax | Op::ArgMax => {
                let (rows, dim) = rows_dim(&x.shape);
                let kind = if matches!(op, Op::Softmax) {
                    RowOp::Softmax
                } else {
                    RowOp::ArgMax
                };
                if rows > 0 {
                    let ptrs = [ptr(&inputs[0])?, out_ptr(out0)?];
                    self.launch_kernel(p.row_op(kind, dt, ptrs, rows, dim))?;
                }
            }
            Op::Activation { act } => {
                if x.numel() > 0 {
                    let ptrs = [ptr(&inputs[0])?, out_ptr(out0)?];
                    self.launch_kernel(p.activation(dt, ptrs, x.numel(), *act))?;
                }
            }
            Op::ActAndMul { act } => {
                let (rows, d) = rows_dim(&out0.spec.shape);
                if rows * d > 0 {
                    let ptrs = [ptr(&inputs[0])?, out_ptr(out0)?];
                    self.launch_kernel(p.act_and_mul(dt, ptrs, rows, d, *act))?;
                }
            }
            Op::Add | Op::Mul => {
                let kind = if matches!(op, Op::Add) {
                    Binary::Add
                } else {
                    Binary::Mul
                };
                if x.numel() > 0 {
                    let ptrs = [ptr(&inputs[0])?, ptr(&inputs[1])?, out_ptr(out0)?];
                    let nb = inputs[1].spec.numel();
                    self.launch_kernel(p.binary(dt, ptrs, x.numel(), nb, kind))?;
                }
            }
            Op::Cast { dtype } => {
                let n = x.numel();
                if *dtype == dt {
                    self.gpu
                        .copy(ptr(&inputs[0])?, out_ptr(out0)?, n * dt.size_in_bytes())?;
                } else if n > 0 {
                    let ptrs = [ptr(&inputs[0])?, out_ptr(out0)?];
                    self.launch_kernel(p.cast(dt, *dtype, ptrs, n))?;
                }
            }
            Op::Rotary {
                head_dim,
                theta,
                scaling,
            } => {
                let (tokens, width) = rows_dim(&x.shape);
                let (table, factor) =
                    self.rope_table(*head_dim, *theta, scaling.as_ref(), &inputs[1])?;
                let freqs = (table.ptr(), factor);
                let heads = width / (*head_dim).max(1);
                if tokens > 0 && heads > 0 {
                    let ptrs = [ptr(&inputs[0])?, ptr(&inputs[1])?, out_ptr(out0)?];
                    let dims = (tokens, inputs[1].spec.numel(), heads, *head_dim);
                    let index = inputs[1].spec.dtype;
                    self.launch_kernel(p.rotary(dt, index, ptrs, dims, freqs))?;
                }
            }
            Op::SplitRotary { cache: true, .. } => {
                return split_rotary_cache_into(self, op, inputs, outputs, |io| {
                    self.split_rotary_into_caches(kernel, op, io)
                });
            }
            Op::SplitRotary {
                head_dim,
                theta,
                scaling,
                sizes,
                ..
            } => {
                let (tokens, _) = rows_dim(&x.shape);
                let [q, k, v] = outputs else {
                    return Err(err(format!("{op}: needs three outputs")));
                };
                let sizes: [usize; 3] = sizes[..]
                    .try_into()
                    .map_err(|_| err(format!("{op}: sizes {sizes:?} are not q, k, v")))?;
                let (table, factor) =
                    self.rope_table(*head_dim, *theta, scaling.as_ref(), &inputs[1])?;
                let freqs = (table.ptr(), factor);
                if tokens > 0 && sizes.iter().sum::<usize>() > 0 {
                    let ins = [ptr(&inputs[0])?, ptr(&inputs[1])?];
                    let outs = [out_ptr(q)?, out_ptr(k)?, out_ptr(v)?];
                    let dims = (tokens, inputs[1].spec.numel(), sizes, *head_dim);
                    let index = inputs[1].spec.dtype;
                    self.launch_kernel(p.split_rotary(dt, index, ins, outs, dims, freqs))?;
                }
            }
            Op::Embedding => {
                let table = inputs[1].spec;
                let (rows, dim) = table.rows_and_width();
                if x.numel() > 0 {
                    let bad = self.gpu.alloc_zeroed(4)?;
                    let ptrs = [
                        ptr(&inputs[0])?,
                        ptr(&inputs[1])?,
                        out_ptr(out0)?,
                        bad.ptr(),
                    ];
                    self.launch_kernel(p.embedding(table.dtype, dt, ptrs, x.numel(), rows, dim))?;
                    let mut flag = [0u8; 4];
                    self.gpu.download(&bad, &mut flag)?;
                    if flag != [0; 4] {
                        return Err(err(format!(
                            "embedding: an id is outside the table of {} rows",
                            table.shape[0]
                        )));
                    }
                }
            }
            Op::Quantize { dtype, scale } => {
                if !(*scale > 0.0 && scale.is_finite()) {
                    return Err(err(format!(
                        "quantize scale must be positive and finite, got {scale}"
                    )));
                }
                if x.numel() > 0 {
                    let ptrs = [ptr(&inputs[0])?, out_ptr(out0)?];
                    let q = QuantScale::Value(*scale);
                    self.launch_kernel(p.quantize(dt, *dtype, ptrs, x.numel(), q))?;
                }
                out0.buffer.scale = *scale;
            }
            Op::Dequantize { dtype } => {
                let scale = inputs[0].buffer.scale;
                if x.numel() > 0 {
                    let ptrs = [ptr(&inputs[0])?, out_ptr(out0)?];
                    self.launch_kernel(p.dequantize(dt, *dtype, ptrs, x.numel(), scale))?;
                }
            }
            Op::Attention(a) => {
                a.require_no_dropout(kernel)?;
                if a.varlen || a.paged || a.lse {
                    return Err(err(format!(
                        "{kernel} runs dense attention without a log-sum-exp only (varlen {}, \
                         paged {}, lse {})",
                        a.varlen, a.paged, a.lse
                    )));
                }
                let (qs, ks) = (&x.shape, &inputs[1].spec.shape);
                if qs.len() != 3 || ks.len() != 3 {
                    return Err(err(format!(
                        "attention takes q [batch, seq_q, heads * d] and k, v [batch, seq_kv, \
                         kv_heads * d], not {qs:?} and {ks:?}"
                    )));
                }
                let mask = if a.mask {
                    let m = &inputs[3];
                    if m.spec.dtype != DType::F32 {
                        return Err(KptError::dtype("amd.attention mask", "f32", m.spec.dtype));
                    }
                    ptr(m)?
                } else {
                    0
                };
                let dims = AttentionDims::new(
                    qs[0],
                    qs[1],
                    ks[1],
                    a.num_heads,
                    a.num_kv_heads,
                    a.head_dim,
                    a.causal,
                    a.effective_scale(),
                    a.window,
                )?;
                if qs[0] * qs[1] * a.num_heads > 0 {
                    let ptrs = [
                        ptr(&inputs[0])?,
                        ptr(&inputs[1])?,
                        ptr(&inputs[2])?,
                        mask,
                        out_ptr(out0)?,
                    ];
                    self.launch_kernel(p.attention(dt, ptrs, dims))?;
                }
            }
            Op::CacheWrite => return cache_write_into(self, inputs, out0),
            Op::Concat { axis } => {
                if inputs.iter().any(|r| r.spec.shape.len() <= *axis) {
                    return Err(err(format!("concat axis {axis} is past an input's rank")));
                }
                let outer: usize = x.shape[..*axis].iter().product();
                let slab = |r: &TensorSpec| -> usize {
                    r.shape[*axis..].iter().product::<usize>() * dt.size_in_bytes()
                };
                let row: usize = inputs.iter().map(|r| slab(r.spec)).sum();
                let dst = out_ptr(out0)?;
                let mut offset = 0;
                for input in inputs {
                    let w = slab(input.spec);
                    self.gpu
                        .copy_2d((ptr(input)?, w), (dst + offset as u64, row), w, outer)?;
                    offset += w;
                }
            }
            Op::Split { axis, .. } => {
                if x.shape.len() <= *axis {
                    return Err(err(format!("split axis {axis} is past the input's rank")));
                }
                let outer: usize = x.shape[..*axis].iter().product();
                let slab = |spec: &TensorSpec| -> usize {
                    spec.shape[*axis..].iter().product::<usize>() * dt.size_in_bytes()
                };
                let (src, row) = (ptr(&inputs[0])?, slab(x));
                let mut offset = 0;
                for out in outputs.iter_mut() {
                    let w = slab(out.spec);
                    self.gpu
                        .copy_2d((src + offset as u64, row), (out_ptr(out)?, w), w, outer)?;
                    offset += w;
                }
            }
            other => return Err(err(format!("{kernel}: no ROCm launcher for {other}"))),
        }
        Ok(())
    }

    /// Runs `kernel` on buffers whose specs were checked against `op.infer`.
    fn launch(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        if kernel.starts_with("amd.") {
            self.run_device(kernel, op, inputs, outputs)
        } else if kernel.starts_with("cpu.") {
            self.run_on_host(kernel, op, inputs, outputs)
        } else {
            Err(err(format!("kernel {kernel} does not run on ROCm")))
        }
    }

    /// Runs a CPU kernel on copies of the inputs and copies the results back.
    fn run_on_host(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        self.host_runs.fetch_add(1, Ordering::Relaxed);
        self.host.run_for_device(
            kernel,
            op,
            inputs,
            outputs,
            |b, spec| self.download(b, spec),
            |t, m| {
                self.gpu.write(block(m.buffer, m.spec)?, t.as_bytes()?)?;
                m.buffer.scale = t.scale();
                Ok(())
            },
        )
    }
}

impl Backend for RocmBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Rocm
    }

    fn device(&self) -> &DeviceInfo {
        &self.info
    }

    fn allocate(&self, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| err(format!("{len} elements of {dtype} overflow")))?;
        let block = self.gpu.alloc_zeroed(bytes)?;
        Ok(DeviceBuffer::new(dtype, len, Box::new(block)))
    }

    fn upload(&self, tensor: &Tensor) -> Result<DeviceBuffer> {
        let t = tensor.contiguous();
        let block = self.gpu.upload(t.as_bytes()?)?;
        let mut buffer = DeviceBuffer::new(t.dtype(), t.numel(), Box::new(block));
        buffer.scale = t.scale();
        Ok(buffer)
    }

    fn download(&self, buffer: &DeviceBuffer, spec: &TensorSpec) -> Result<Tensor> {
        let b = block(buffer, spec)?;
        let mut bytes = vec![0u8; spec.numel() * spec.dtype.size_in_bytes()];
        self.gpu.download(b, &mut bytes)?;
        Ok(Tensor::from_bytes(&bytes, spec.dtype, &spec.shape)?.with_scale(buffer.scale))
    }

    fn copy_into(
        &self,
        src: BufferRef<'_>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let (at, bytes) = copy_extent(src, dst, dst_offset)?;
        let from = block(src.buffer, src.spec)?.ptr();
        let to = dst
            .inner::<DeviceBlock>()
            .ok_or_else(|| err("buffer does not belong to the ROCm backend"))?
            .ptr();
        Ok(self.gpu.copy(from, to + at as u64, bytes)?)
    }

    fn write_rows(
        &self,
        rows: BufferRef<'_>,
        slots: BufferRef<'_>,
        cache: BufferMut<'_>,
    ) -> Result<()> {
        let w = row_write_extent(rows, slots, &cache)?;
        let row_bytes = w.row * rows.spec.dtype.size_in_bytes();
        let (src, dst) = (ptr(&rows)?, out_ptr(&cache)?);
        // No row-scatter kernel is built for AMD: the slots are read on the host and
        // each row is one device copy.
        for (i, slot) in self.host_ids(&slots)?.into_iter().enumerate().take(w.rows) {
            if let Some(r) = w.cache_row(slot)? {
                let (from, to) = ((i * row_bytes) as u64, (r * row_bytes) as u64);
                self.gpu.copy(src + from, dst + to, row_bytes)?;
            }
        }
        Ok(())
    }

    fn execute(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        check_output_specs(op, inputs, outputs)?;
        self.launch(kernel, op, inputs, outputs)
    }

    fn execute_inferred(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        if outputs.is_empty() {
            return Err(err(format!("{op}: no output")));
        }
        self.launch(kernel, op, inputs, outputs)
    }

    fn buffer_address(&self, buffer: &DeviceBuffer) -> Option<u64> {
        buffer.inner::<DeviceBlock>().map(DeviceBlock::ptr)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.gpu.synchronize()?)
    }

    /// The run-time compile cache's hits, disk hits and misses (hiprtc builds for a
    /// processor without shipped code objects, and the FP8 conversion), and how many
    /// kernels ran on the host.
    fn counters(&self) -> Vec<(String, u64)> {
        let c = self.gpu.compile_stats();
        [
            ("rocm_compile_cache_hits", c.hits),
            ("rocm_compile_cache_disk_hits", c.disk_hits),
            ("rocm_compile_cache_misses", c.misses),
            (
                "rocm_host_runs_total",
                self.host_runs.load(Ordering::Relaxed),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn memory_stats(&self) -> MemoryStats {
        let s = self.gpu.memory_statistics();
        MemoryStats {
            allocated_bytes: s.requested_bytes,
            peak_bytes: s.peak_allocated_bytes,
            total_bytes: Some(self.gpu.device().properties.memory_bytes),
        }
    }
}
