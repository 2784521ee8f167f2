//! `CudaBackend`: kpt's `Backend` on one CUDA device. Buffers are blocks of the caching
//! allocator; `cuda.*` kernels run on the device (cuBLASLt GEMMs, kpt's own kernels);
//! the CPU reference, the last step of every fallback chain, runs on the host with
//! the data copied over and back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kpt_core::backend::{
    cache_write_into, check_output_specs, copy_extent, row_write_extent, split_rotary_cache_into,
    split_rotary_via_temporaries, Backend, BufferMut, BufferRef, CapturedRun, DeviceBuffer,
    MemoryStats, PendingDownload, RotaryCaches,
};
use kpt_core::graph::{
    rope_frequencies, rope_seq_len, Activation, AttentionParams, Op, RopeScaling, TensorSpec,
};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::profile::KernelProfile;
use kpt_core::tensor::Tensor;
use kpt_core::{DType, KptError, Result};
use kpt_kernels::CpuBackend;

use crate::blas::{cublaslt_present, Blas, Epilogue, GemmArgs, GemmShape, GemmTuning, Layout};
use crate::gpu::{Gpu, GpuGraph};
use crate::kernels::{
    AttentionDims, Binary, FlashBackward, Impl, PagedCache, QuantScale, RowOp, GEMV_MAX_ROWS,
};
use crate::memory::DeviceBlock;
use crate::pinned::PendingRead;
use crate::profiler::Profiler;
use crate::NvidiaError;

/// The registry names of the tensor-core attention kernels: `kernels/cuda/flash_attention.cu`
/// (mma.sync, sm_80+) and `flash_attention_sm90.cu` (wgmma, sm_90a; bf16/f16 and FP8).
const FLASH_ATTENTION: &str = "cuda.attention.flash";
const FLASH_ATTENTION_SM90: &str = "cuda.attention.flash_sm90";
const FLASH_ATTENTION_FP8: &str = "cuda.attention.fp8_sm90";
/// The registry name of the GEMV kernel for linear ops with few rows (`kernels/cuda/gemv.cu`).
const GEMV: &str = "cuda.linear.gemv";

/// Options of the CUDA backend (from `KptConfig`'s `nvidia` and `kernel` sections).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let f32 GEMMs use TF32 tensor cores.
    pub allow_tf32: bool,
    /// How cuBLASLt's algorithm for each GEMM problem is chosen.
    pub gemm: GemmTuning,
    /// The most activation rows a `cuda.linear.gemv` node runs on the GEMV kernel; a run
    /// with more (a plan selected for one sequence, run on a batch) goes to cuBLASLt.
    /// 2 by default, the crossover measured on the H100 (docs/decisions.md, "Decode
    /// kernels"); at most 32, the kernel's largest row class.
    pub gemv_rows: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            allow_tf32: false,
            gemm: GemmTuning::default(),
            gemv_rows: 2,
        }
    }
}

/// The CUDA backend for one device.
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    blas: Option<Blas>,
    info: DeviceInfo,
    name: String,
    host: CpuBackend,
    profiler: Arc<Profiler>,
    /// Scaled rotary tables on the device, by `(head_dim, theta, scaling)`.
    rope_tables: Mutex<HashMap<String, (Arc<DeviceBlock>, f64)>>,
    /// [`CudaOptions::gemv_rows`], at most `GEMV_MAX_ROWS`.
    gemv_rows: usize,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("name", &self.name)
            .field("gpu", &self.gpu)
            .finish_non_exhaustive()
    }
}

fn err(message: impl Into<String>) -> KptError {
    KptError::Backend {
        backend: "cuda".into(),
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
        .ok_or_else(|| err("buffer does not belong to the CUDA backend"))
}

/// The shapes of an attention op's q and k (its first two inputs), which must be
/// `[batch, seq, heads * head_dim]`.
fn q_k_shapes<'a>(op: &str, inputs: &[BufferRef<'a>]) -> Result<(&'a [usize], &'a [usize])> {
    let (qs, ks) = (&inputs[0].spec.shape, &inputs[1].spec.shape);
    if qs.len() != 3 || ks.len() != 3 {
        return Err(err(format!(
            "{op} takes q [batch, seq_q, heads * d] and k, v [batch, seq_kv, kv_heads * d], \
             not {qs:?} and {ks:?}"
        )));
    }
    Ok((qs, ks))
}

/// The kernels' sizes of attention `p` over `batch` sequences of `seq_q` queries and
/// `seq_kv` keys, its window and dropout included.
fn attention_dims(
    p: &AttentionParams,
    batch: usize,
    seq_q: usize,
    seq_kv: usize,
) -> Result<AttentionDims> {
    Ok(AttentionDims::new(
        batch,
        seq_q,
        seq_kv,
        p.num_heads,
        p.num_kv_heads,
        p.head_dim,
        p.causal,
        p.effective_scale(),
    )?
    .with_window(p.window)?
    .with_dropout(p.dropout))
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

impl CudaBackend {
    /// Opens device `ordinal`. cuBLASLt is optional: without it GEMMs are not offered
    /// on this device (the registry falls back) and `kpt detect` lacks `cublaslt`.
    pub fn new(ordinal: usize, options: CudaOptions) -> std::result::Result<Self, NvidiaError> {
        let gpu = Arc::new(Gpu::new(ordinal)?);
        let blas = if cublaslt_present() {
            Some(Blas::new(&gpu, options.allow_tf32, &options.gemm)?)
        } else {
            tracing::warn!("cuBLASLt not found; CUDA GEMMs fall back down the kernel chain");
            None
        };
        let mut info = gpu.properties().device_info();
        if blas.is_some() {
            info.features.push("cublaslt".into());
        }
        Ok(Self {
            name: format!("cuda:{ordinal}"),
            gpu,
            blas,
            info,
            host: CpuBackend::new().map_err(|e| NvidiaError::Invalid(e.to_string()))?,
            profiler: Arc::default(),
            rope_tables: Mutex::default(),
            gemv_rows: options.gemv_rows.min(GEMV_MAX_ROWS),
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// cuBLASLt, when the library is present.
    pub fn blas(&self) -> Option<&Blas> {
        self.blas.as_ref()
    }

    fn blas_or_err(&self) -> Result<&Blas> {
        self.blas
            .as_ref()
            .ok_or_else(|| err("cuBLASLt is not available on this machine"))
    }

    /// Gated activation (SwiGLU with SiLU, GeGLU with GELU): `x [.., 2d]` ->
    /// `act(x[.., :d]) * x[.., d:]` into `out [.., d]`.
    pub fn act_and_mul(&self, x: BufferRef<'_>, out: BufferMut<'_>, act: Activation) -> Result<()> {
        let (rows, two_d) = rows_dim(&x.spec.shape);
        let (out_rows, d) = rows_dim(&out.spec.shape);
        if d * 2 != two_d || rows != out_rows || x.spec.dtype != out.spec.dtype {
            return Err(err(format!(
                "act_and_mul takes [.., 2d] -> [.., d] of one dtype, got {} -> {}",
                x.spec, out.spec
            )));
        }
        Ok(self
            .gpu
            .act_and_mul(x.spec.dtype, ptr(&x)?, out_ptr(&out)?, rows, d, act)?)
    }

    /// Quantizes `x` to `out`'s dtype with the scale `max|x| / max_finite` computed on
    /// the device; returns the scale (also stored in `out.buffer.scale`).
    pub fn quantize_dynamic(&self, x: BufferRef<'_>, out: BufferMut<'_>) -> Result<f32> {
        let n = x.spec.numel();
        if out.spec.numel() != n {
            return Err(err(format!("quantize {} into {}", x.spec, out.spec)));
        }
        let slot = self.gpu.alloc_zeroed(4)?;
        self.gpu.amax(x.spec.dtype, ptr(&x)?, n, slot.ptr())?;
        self.gpu.amax_to_scale(slot.ptr(), out.spec.dtype)?;
        self.gpu.quantize(
            x.spec.dtype,
            out.spec.dtype,
            ptr(&x)?,
            out_ptr(&out)?,
            n,
            QuantScale::OnDevice(slot.ptr()),
        )?;
        let scale = f32::from_le_bytes(
            self.gpu.read(&slot, 4)?[..4]
                .try_into()
                .map_err(|_| err("short read of the scale"))?,
        );
        out.buffer.scale = scale;
        Ok(scale)
    }

    fn gemm(&self, op: &Op, inputs: &[BufferRef<'_>], out: &mut BufferMut<'_>) -> Result<()> {
        let blas = self.blas_or_err()?;
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
        let epilogue = match act {
            Some(Activation::Relu) => Epilogue::Relu,
            Some(Activation::GeluTanh) => Epilogue::GeluTanh,
            _ => Epilogue::None,
        };
        // Weights of another dtype are converted to the activations' dtype first.
        let w = ptr(&inputs[1])?;
        let converted = if b.dtype != a.dtype {
            let block = self.gpu.alloc(b.numel() * a.dtype.size_in_bytes())?;
            if b.dtype.is_quantized() {
                self.gpu.dequantize(
                    b.dtype,
                    a.dtype,
                    w,
                    block.ptr(),
                    b.numel(),
                    inputs[1].buffer.scale,
                )?;
            } else {
                self.gpu.cast(b.dtype, a.dtype, w, block.ptr(), b.numel())?;
            }
            Some(block)
        } else {
            None
        };
        let shape = GemmShape {
            m,
            n,
            k,
            batch,
            layout,
            a: a.dtype,
            b: a.dtype,
            out: out.spec.dtype,
            bias,
            epilogue,
        };
        let y = out_ptr(out)?;
        let args = GemmArgs {
            a: ptr(&inputs[0])?,
            b: converted.as_ref().map_or(w, DeviceBlock::ptr),
            out: y,
            bias: if bias { ptr(&inputs[2])? } else { 0 },
            a_scale: 0,
            b_scale: 0,
        };
        blas.gemm(&self.gpu, &shape, &args)?;
        if let Some(act @ (Activation::GeluErf | Activation::Silu)) = act {
            self.gpu
                .activation(out.spec.dtype, y, y, out.spec.numel(), act)?;
        }
        Ok(())
    }

    /// The device copy of a rotary's inverse frequencies (f64, from kpt-core's
    /// `rope_frequencies`) and its cos/sin factor. Tables that do not depend on the
    /// positions are uploaded once and cached per `(head_dim, theta, scaling)`; dynamic
    /// NTK reads the positions back (its table follows the largest one) and uploads a
    /// fresh table. The block stays alive until the launch that reads it is queued.
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

    /// [`Op::SplitRotary`] on `kpt_split_rotary_*`: q, k, v into `outs`, or with `slots`
    /// (and the caches' rows) k and v into the caches at `outs[1]` and `outs[2]`.
    fn split_rotary(
        &self,
        op: &Op,
        [qkv, positions]: [&BufferRef<'_>; 2],
        outs: [u64; 3],
        slots: Option<(&BufferRef<'_>, usize)>,
    ) -> Result<()> {
        let Op::SplitRotary {
            head_dim,
            theta,
            scaling,
            sizes,
            ..
        } = op
        else {
            return Err(err(format!("{op} is not split_rotary")));
        };
        let sizes: [usize; 3] = sizes[..]
            .try_into()
            .map_err(|_| err(format!("{op}: sizes {sizes:?} are not q, k, v")))?;
        let (tokens, _) = rows_dim(&qkv.spec.shape);
        let (table, factor) = self.rope_table(*head_dim, *theta, scaling.as_ref(), positions)?;
        let slots = match slots {
            Some((s, rows)) => Some((ptr(s)?, s.spec.dtype, rows)),
            None => None,
        };
        self.gpu.split_rotary(
            qkv.spec.dtype,
            positions.spec.dtype,
            ptr(qkv)?,
            ptr(positions)?,
            outs,
            (tokens, positions.spec.numel(), sizes, *head_dim),
            slots,
            (table.ptr(), factor),
        )?;
        Ok(())
    }

    /// Linear on the GEMV kernel (`cuda.linear.gemv`) when the activations, weights and
    /// output share one dtype and the call has at most [`CudaOptions::gemv_rows`] rows;
    /// anything else (weights to convert, more rows) goes to cuBLASLt. The specs were checked
    /// against the op's inference before this runs.
    fn gemv(&self, bias: bool, inputs: &[BufferRef<'_>], out: &mut BufferMut<'_>) -> Result<()> {
        let (a, w) = (inputs[0].spec, inputs[1].spec);
        let k = a.shape.last().copied().unwrap_or(1);
        let m: usize = a.shape[..a.shape.len().saturating_sub(1)].iter().product();
        let n = w.shape.first().copied().unwrap_or(0);
        let same = a.dtype == w.dtype && out.spec.dtype == a.dtype;
        if !same || m > self.gemv_rows || w.shape.len() != 2 {
            return self.gemm(&Op::Linear { bias }, inputs, out);
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let b = if bias { ptr(&inputs[2])? } else { 0 };
        self.gpu.gemv(
            a.dtype,
            [ptr(&inputs[0])?, ptr(&inputs[1])?, b],
            inputs[1].buffer.is_constant(),
            out_ptr(out)?,
            m,
            n,
            k,
        )?;
        Ok(())
    }

    /// [`Op::SplitRotary`] with `cache` in place on `kpt_split_rotary_*`, after checking
    /// the buffers' specs against the op's inference.
    fn rotary_caches(&self, op: &Op, io: RotaryCaches<'_>) -> Result<()> {
        let want = op.infer(&io.input_specs())?;
        if want != io.output_specs() {
            return Err(err(format!(
                "{op}: outputs {:?} do not match the inferred {want:?}",
                io.output_specs()
            )));
        }
        let rows = |m: &BufferMut<'_>| {
            let width = m.spec.shape.last().copied().unwrap_or(1).max(1);
            m.spec.numel() / width
        };
        let cache_rows = rows(&io.k_cache).min(rows(&io.v_cache));
        let outs = [
            out_ptr(&io.q)?,
            out_ptr(&io.k_cache)?,
            out_ptr(&io.v_cache)?,
        ];
        let slots = Some((&io.slots, cache_rows));
        self.split_rotary(op, [&io.qkv, &io.positions], outs, slots)
    }

    /// An index tensor (i32/i64 offsets, block ids, lengths) read back to the host.
    fn host_ids(&self, r: &BufferRef<'_>) -> Result<Vec<i64>> {
        let t = self.download(r.buffer, r.spec)?;
        Ok(t.to_f64_vec().into_iter().map(|x| x as i64).collect())
    }

    /// The sequences of a variable-length attention batch of `dt` (offsets `cu_q` and
    /// `cu_k`, read on the host: a small synchronous copy, checked against the `total_q` /
    /// `total_k` packed rows): per sequence, the byte offsets of its first query row and
    /// first key row, and its numbers of queries and keys.
    fn varlen_sequences(
        &self,
        p: &AttentionParams,
        dt: DType,
        [cu_q, cu_k]: [&BufferRef<'_>; 2],
        [total_q, total_k]: [usize; 2],
    ) -> Result<Vec<(u64, u64, usize, usize)>> {
        let segments = kpt_kernels::cpu::varlen_segments(
            &self.host_ids(cu_q)?,
            &self.host_ids(cu_k)?,
            total_q,
            total_k,
        )?;
        let size = (p.head_dim * dt.size_in_bytes()) as u64;
        let (q_row, kv_row) = (p.num_heads as u64 * size, p.num_kv_heads as u64 * size);
        Ok(segments
            .into_iter()
            .map(|(sq, sk)| {
                let (qo, ko) = (sq.start as u64 * q_row, sk.start as u64 * kv_row);
                (qo, ko, sq.len(), sk.len())
            })
            .collect())
    }

    /// Runs a `cuda.*` kernel.
    fn run_device(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        let out0 = outputs
            .first_mut()
            .ok_or_else(|| err(format!("{op}: no output")))?;
        let x = inputs[0].spec;
        let dt = x.dtype;
        let g = &self.gpu;
        match op {
            Op::Linear { bias } if kernel == GEMV => return self.gemv(*bias, inputs, out0),
            Op::MatMul | Op::Linear { .. } | Op::LinearAct { .. } => {
                return self.gemm(op, inputs, out0)
            }
            Op::RmsNorm { .. } | Op::AddRmsNorm { .. } => {
                return self.run_norm(Impl::Cuda, op, inputs, outputs)
            }
            Op::LayerNorm { eps } => {
                let (rows, dim) = rows_dim(&x.shape);
                g.layer_norm(
                    dt,
                    ptr(&inputs[0])?,
                    ptr(&inputs[1])?,
                    ptr(&inputs[2])?,
                    out_ptr(out0)?,
                    rows,
                    dim,
                    *eps,
                )?;
            }
            Op::AddLayerNorm { eps } => {
                let (rows, dim) = rows_dim(&x.shape);
                let [sum, out] = outputs else {
                    return Err(err(format!("{op}: needs two outputs")));
                };
                g.add_layer_norm(
                    dt,
                    [
                        ptr(&inputs[0])?,
                        ptr(&inputs[1])?,
                        ptr(&inputs[2])?,
                        ptr(&inputs[3])?,
                    ],
                    [out_ptr(sum)?, out_ptr(out)?],
                    rows,
                    dim,
                    *eps,
                )?;
            }
            Op::Softmax | Op::ArgMax => {
                let (rows, dim) = rows_dim(&x.shape);
                let kind = if matches!(op, Op::Softmax) {
                    RowOp::Softmax
                } else {
                    RowOp::ArgMax
                };
                if rows > 0 {
                    g.row_op(kind, dt, ptr(&inputs[0])?, out_ptr(out0)?, rows, dim)?;
                }
            }
            Op::Activation { act } => {
                g.activation(dt, ptr(&inputs[0])?, out_ptr(out0)?, x.numel(), *act)?;
            }
            Op::Add | Op::Mul => {
                let kind = if matches!(op, Op::Add) {
                    Binary::Add
                } else {
                    Binary::Mul
                };
                g.binary(
                    dt,
                    ptr(&inputs[0])?,
                    ptr(&inputs[1])?,
                    out_ptr(out0)?,
                    x.numel(),
                    inputs[1].spec.numel(),
                    kind,
                )?;
            }
            Op::Rotary {
                head_dim,
                theta,
                scaling,
            } => {
                let (tokens, width) = rows_dim(&x.shape);
                let (table, factor) =
                    self.rope_table(*head_dim, *theta, scaling.as_ref(), &inputs[1])?;
                g.rotary(
                    dt,
                    inputs[1].spec.dtype,
                    ptr(&inputs[0])?,
                    ptr(&inputs[1])?,
                    out_ptr(out0)?,
                    (tokens, inputs[1].spec.numel(), width / head_dim, *head_dim),
                    (table.ptr(), factor),
                )?;
            }
            Op::SplitRotary { cache: true, .. } => {
                // `launch` profiles this call: the launch without a profile of its own.
                return split_rotary_cache_into(self, op, inputs, outputs, |io| {
                    self.rotary_caches(op, io)
                });
            }
            Op::SplitRotary { .. } => {
                let [q, k, v] = outputs else {
                    return Err(err(format!("{op}: needs three outputs")));
                };
                let outs = [out_ptr(q)?, out_ptr(k)?, out_ptr(v)?];
                self.split_rotary(op, [&inputs[0], &inputs[1]], outs, None)?;
            }
            Op::Embedding => {
                let table = inputs[1].spec;
                let (rows, dim) = table.rows_and_width();
                g.embedding(
                    table.dtype,
                    dt,
                    ptr(&inputs[0])?,
                    ptr(&inputs[1])?,
                    out_ptr(out0)?,
                    x.numel(),
                    rows,
                    dim,
                )?;
            }
            Op::Quantize { dtype, scale } => {
                if !(*scale > 0.0 && scale.is_finite()) {
                    return Err(err(format!(
                        "quantize scale must be positive and finite, got {scale}"
                    )));
                }
                g.quantize(
                    dt,
                    *dtype,
                    ptr(&inputs[0])?,
                    out_ptr(out0)?,
                    x.numel(),
                    QuantScale::Value(*scale),
                )?;
                out0.buffer.scale = *scale;
            }
            Op::Dequantize { dtype } => {
                let scale = inputs[0].buffer.scale;
                g.dequantize(
                    dt,
                    *dtype,
                    ptr(&inputs[0])?,
                    out_ptr(out0)?,
                    x.numel(),
                    scale,
                )?;
            }
            Op::Cast { dtype } => {
                g.cast(dt, *dtype, ptr(&inputs[0])?, out_ptr(out0)?, x.numel())?;
            }
            Op::AttentionBackward(p) => {
                let (qs, ks) = q_k_shapes("attention_backward", inputs)?;
                if !matches!(dt, DType::BF16 | DType::F16) {
                    return Err(KptError::dtype(kernel, "bf16 or f16", dt));
                }
                let dims = |batch, seq_q, seq_kv| attention_dims(p, batch, seq_q, seq_kv);
                let plan = |dims| {
                    FlashBackward::new(dt, dims).map_err(|e| KptError::shape(kernel, e.to_string()))
                };
                let [dq, dk, dv] = outputs else {
                    return Err(err(format!("{op}: needs three outputs")));
                };
                let at = |i: usize| ptr(&inputs[i]);
                let (q, k, v, out, dout) = (at(0)?, at(1)?, at(2)?, at(3)?, at(4)?);
                let (dq, dk, dv) = (out_ptr(dq)?, out_ptr(dk)?, out_ptr(dv)?);
                if p.varlen {
                    // Variable-length batch (no mask, no log-sum-exp): each sequence runs as
                    // a dense call on its rows, taking dropout's decisions as batch entry s,
                    // as the forward does. Sequences without queries still run, so that
                    // their keys' gradients are zeros.
                    let cu = [&inputs[5], &inputs[6]];
                    let sequences = self.varlen_sequences(p, dt, cu, [qs[1], ks[1]])?;
                    for (s, (qo, ko, sq, sk)) in sequences.into_iter().enumerate() {
                        if sq == 0 && sk == 0 {
                            continue;
                        }
                        let dims = dims(1, sq, sk)?.with_batch_offset(s)?;
                        g.flash_attention_backward(
                            &plan(dims)?,
                            [q + qo, k + ko, v + ko, out + qo, dout + qo],
                            [0, 0],
                            [dq + qo, dk + ko, dv + ko],
                        )?;
                    }
                    return Ok(());
                }
                let plan = plan(dims(qs[0], qs[1], ks[1])?)?;
                let mask = if p.mask {
                    let m = &inputs[5];
                    if m.spec.dtype != DType::F32 {
                        return Err(KptError::dtype(kernel, "f32 mask", m.spec.dtype));
                    }
                    ptr(m)?
                } else {
                    0
                };
                // The forward's log-sum-exp, f32 [batch, heads, seq_q], after the mask.
                let lse = if p.lse {
                    let l = inputs
                        .get(5 + usize::from(p.mask))
                        .ok_or_else(|| err(format!("{op}: needs its lse input")))?;
                    let want = p.lse_shape(qs);
                    if l.spec.dtype != DType::F32 || l.spec.shape != want {
                        return Err(KptError::shape(
                            kernel,
                            format!("lse must be f32 {want:?}, got {}", l.spec),
                        ));
                    }
                    ptr(l)?
                } else {
                    0
                };
                g.flash_attention_backward(&plan, [q, k, v, out, dout], [mask, lse], [dq, dk, dv])?;
            }
            Op::Attention(p) => {
                // Dropout: the tensor-core kernels only (the registry's choice).
                if kernel != FLASH_ATTENTION && kernel != FLASH_ATTENTION_SM90 {
                    p.require_no_dropout(kernel)?;
                }
                let (qs, ks) = q_k_shapes("attention", inputs)?;
                // FP8 inputs: q_scale * k_scale goes into the softmax scale and q, k are
                // used (or dequantized) unscaled, as e4m3 values are exact in bf16; scaled
                // before rounding to bf16, they would carry a 2^-9 relative error into
                // every score.
                let fp8 = dt == DType::F8E4M3;
                let scale = |i: usize| inputs[i].buffer.scale;
                let qk_scale = if fp8 { scale(0) * scale(1) } else { 1.0 };
                let dims = |batch, seq_q, seq_kv| {
                    attention_dims(p, batch, seq_q, seq_kv).map(|d| d.scaled(qk_scale))
                };
                let mask = if p.mask {
                    let m = &inputs[3];
                    if m.spec.dtype != DType::F32 {
                        return Err(KptError::dtype("cuda.attention mask", "f32", m.spec.dtype));
                    }
                    ptr(m)?
                } else {
                    0
                };
                let (mut q, mut k, mut v, out) = (
                    ptr(&inputs[0])?,
                    ptr(&inputs[1])?,
                    ptr(&inputs[2])?,
                    out_ptr(out0)?,
                );
                if p.lse {
                    // The log-sum-exp comes from the tensor-core kernels only, on dense
                    // batches (the registry offers no other kernel for it).
                    let flash = kernel == FLASH_ATTENTION || kernel == FLASH_ATTENTION_SM90;
                    if !flash || p.varlen || p.paged || dt == DType::F8E4M3 {
                        return Err(err(format!(
                            "{kernel} gives no log-sum-exp for this call ({dt}, varlen {}, \
                             paged {})",
                            p.varlen, p.paged
                        )));
                    }
                    let lse = outputs
                        .get_mut(1)
                        .ok_or_else(|| err(format!("{op}: needs its lse output")))?;
                    let want = p.lse_shape(qs);
                    if lse.spec.dtype != DType::F32 || lse.spec.shape != want {
                        return Err(KptError::shape(
                            kernel,
                            format!("lse must be f32 {want:?}, got {}", lse.spec),
                        ));
                    }
                    g.flash_attention(
                        dt,
                        [q, k, v, mask],
                        out,
                        out_ptr(lse)?,
                        dims(qs[0], qs[1], ks[1])?,
                        kernel == FLASH_ATTENTION_SM90,
                    )?;
                    return Ok(());
                }
                // FP8 inputs (bf16 output): the FP8 wgmma kernel where it applies, else
                // q, k (unscaled) and v dequantized into bf16 scratch for the bf16 kernels.
                let mut dequantized = Vec::new();
                let dt = if fp8 {
                    if kernel == FLASH_ATTENTION_FP8 && !p.varlen && !p.paged {
                        let d = dims(qs[0], qs[1], ks[1])?;
                        if g.flash_attention_fp8(q, k, v, mask, out, d, scale(2))? {
                            return Ok(());
                        }
                    }
                    for (i, at) in [&mut q, &mut k, &mut v].into_iter().enumerate() {
                        let n = inputs[i].spec.numel();
                        let block = g.alloc(n * DType::BF16.size_in_bytes())?;
                        let factor = if i == 2 { scale(2) } else { 1.0 };
                        g.dequantize(dt, DType::BF16, *at, block.ptr(), n, factor)?;
                        *at = block.ptr();
                        dequantized.push(block);
                    }
                    DType::BF16
                } else {
                    dt
                };
                let run = |q, k, v, out, dims| {
                    if fp8 || kernel == FLASH_ATTENTION || kernel == FLASH_ATTENTION_SM90 {
                        let hopper = fp8 || kernel == FLASH_ATTENTION_SM90;
                        g.flash_attention(dt, [q, k, v, mask], out, 0, dims, hopper)
                    } else {
                        g.attention(dt, q, k, v, mask, out, dims)
                    }
                };
                let size = dt.size_in_bytes() * p.head_dim;
                let (q_row, kv_row) = (p.num_heads * size, p.num_kv_heads * size);
                if p.paged {
                    // Decode shapes: the split-KV kernels read K and V through the block
                    // table and take each length from device memory (no host readback,
                    // so a decode step can be captured into a CUDA graph).
                    let (batch, sq) = (qs[0], qs[1]);
                    let (table_spec, lens_spec) = (inputs[3].spec, inputs[4].spec);
                    let cache = PagedCache {
                        table: (ptr(&inputs[3])?, table_spec.dtype),
                        lens: (ptr(&inputs[4])?, lens_spec.dtype),
                        block_size: ks[1],
                        max_blocks: table_spec.shape[1],
                        num_blocks: ks[0],
                    };
                    let capacity = cache.max_blocks * cache.block_size;
                    if g.paged_attention(dt, [q, k, v], out, cache, dims(batch, sq, capacity)?)? {
                        return Ok(());
                    }
                    // Other shapes: block ids and lengths are read on the host (checked
                    // there), each sequence's K and V rows are gathered on the device
                    // into contiguous scratch, then the dense kernel runs on them.
                    let (table, lens) = (self.host_ids(&inputs[3])?, self.host_ids(&inputs[4])?);
                    let paged = kpt_kernels::cpu::PagedKv {
                        block_size: ks[1],
                        num_blocks: ks[0],
                        block_table: &table,
                        seq_lens: &lens,
                    };
                    let lens = (0..batch)
                        .map(|b| paged.checked_len(b))
                        .collect::<Result<Vec<_>>>()?;
                    let longest = lens.iter().max().copied().unwrap_or(0);
                    let scratch = (longest * kv_row).max(16);
                    let (kb, vb) = (g.alloc(scratch)?, g.alloc(scratch)?);
                    let table_dt = inputs[3].spec.dtype;
                    let table_row = (paged.max_blocks() * table_dt.size_in_bytes()) as u64;
                    let seq = (sq * q_row) as u64;
                    for (b, &len) in lens.iter().enumerate() {
                        let t = ptr(&inputs[3])? + b as u64 * table_row;
                        g.paged_gather(k, kb.ptr(), t, table_dt, len, ks[1], kv_row)?;
                        g.paged_gather(v, vb.ptr(), t, table_dt, len, ks[1], kv_row)?;
                        let (qb, ob) = (q + b as u64 * seq, out + b as u64 * seq);
                        run(qb, kb.ptr(), vb.ptr(), ob, dims(1, sq, len)?)?;
                    }
                    return Ok(());
                }
                if !p.varlen {
                    run(q, k, v, out, dims(qs[0], qs[1], ks[1])?)?;
                    return Ok(());
                }
                // Variable-length batch on Hopper: one launch that reads the offsets on
                // the device, where that kernel applies.
                let cu = [&inputs[3], &inputs[4]];
                let index = cu[0].spec.dtype;
                let sequences = cu[0].spec.numel().saturating_sub(1);
                if (fp8 || kernel == FLASH_ATTENTION_SM90)
                    && cu[1].spec.dtype == index
                    && cu[1].spec.numel() == sequences + 1
                    && g.flash_attention_varlen(
                        dt,
                        [q, k, v],
                        out,
                        ([ptr(cu[0])?, ptr(cu[1])?], index),
                        dims(1, qs[1], ks[1])?.packed(sequences)?,
                    )?
                {
                    return Ok(());
                }
                // Elsewhere each sequence runs as a dense call on its rows (offsets read
                // on the host); sequence s takes dropout decisions as batch entry s.
                for (s, (qo, ko, sq, sk)) in self
                    .varlen_sequences(p, dt, cu, [qs[1], ks[1]])?
                    .into_iter()
                    .enumerate()
                {
                    if sq == 0 {
                        continue;
                    }
                    let dims = dims(1, sq, sk)?.with_batch_offset(s)?;
                    run(q + qo, k + ko, v + ko, out + qo, dims)?;
                }
            }
            Op::CacheWrite => return cache_write_into(self, inputs, out0),
            Op::Concat { axis } => {
                if inputs.iter().any(|r| r.spec.shape.len() <= *axis) {
                    return Err(err(format!("concat axis {axis} is past an input's rank")));
                }
                // Each input is `outer` rows of its slab; the output interleaves them.
                let outer: usize = x.shape[..*axis].iter().product();
                let slab = |r: &BufferRef<'_>| -> usize {
                    r.spec.shape[*axis..].iter().product::<usize>() * dt.size_in_bytes()
                };
                let row: usize = inputs.iter().map(slab).sum();
                let dst = out_ptr(out0)?;
                let mut offset = 0;
                for input in inputs {
                    let w = slab(input);
                    g.copy_2d((ptr(input)?, w), (dst + offset as u64, row), w, outer)?;
                    offset += w;
                }
            }
            Op::Split { axis, .. } => {
                // The input is `outer` rows of `row` bytes; each output takes its slab
                // of every row.
                let outer: usize = x.shape[..*axis].iter().product();
                let slab = |spec: &TensorSpec| -> usize {
                    spec.shape[*axis..].iter().product::<usize>() * dt.size_in_bytes()
                };
                let (src, row) = (ptr(&inputs[0])?, slab(x));
                let mut offset = 0;
                for out in outputs.iter_mut() {
                    let w = slab(out.spec);
                    g.copy_2d((src + offset as u64, row), (out_ptr(out)?, w), w, outer)?;
                    offset += w;
                }
            }
            Op::ActAndMul { act } => {
                let (rows, d) = rows_dim(&out0.spec.shape);
                g.act_and_mul(dt, ptr(&inputs[0])?, out_ptr(out0)?, rows, d, *act)?;
            }
        }
        Ok(())
    }

    /// Runs an RMS norm (plain or with the residual add) on the kernel built by `imp`.
    fn run_norm(
        &self,
        imp: Impl,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        let x = inputs[0].spec;
        let (rows, dim) = rows_dim(&x.shape);
        match (op, outputs) {
            (Op::RmsNorm { eps }, [out]) => self.gpu.rms_norm(
                imp,
                x.dtype,
                ptr(&inputs[0])?,
                ptr(&inputs[1])?,
                out_ptr(out)?,
                rows,
                dim,
                *eps,
            )?,
            (Op::AddRmsNorm { eps }, [sum, out]) => self.gpu.add_rms_norm(
                imp,
                x.dtype,
                ptr(&inputs[0])?,
                ptr(&inputs[1])?,
                ptr(&inputs[2])?,
                out_ptr(sum)?,
                out_ptr(out)?,
                rows,
                dim,
                *eps,
            )?,
            (op, _) => return Err(err(format!("no {imp:?} norm kernel for {op}"))),
        }
        Ok(())
    }

    /// Runs `kernel` on buffers whose specs were checked against `op.infer`, between two
    /// CUDA events while the profiler is on.
    fn launch(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        let start = match self.profiler.is_on() {
            true => Some(self.gpu.record_event()?),
            false => None,
        };
        if kernel.starts_with("cuda.") {
            self.run_device(kernel, op, inputs, outputs)?;
        } else if kernel.starts_with("triton.") {
            self.run_norm(Impl::Triton, op, inputs, outputs)?;
        } else if kernel.starts_with("cpu.") {
            self.run_on_host(kernel, op, inputs, outputs)?;
        } else {
            return Err(err(format!("kernel {kernel} does not run on CUDA")));
        }
        if let Some(start) = start {
            let end = self.gpu.record_event()?;
            let specs = inputs.iter().map(|r| r.spec.clone()).collect();
            let outs = outputs.iter().map(|m| m.spec.clone()).collect();
            self.profiler
                .record(kernel, op, specs, outs, (start, end))?;
        }
        Ok(())
    }

    /// Runs a CPU kernel on copies of the inputs and copies the results back.
    fn run_on_host(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
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

/// A download into page-locked memory queued on the backend's stream.
struct CudaDownload {
    read: PendingRead,
    spec: TensorSpec,
    scale: f32,
}

impl PendingDownload for CudaDownload {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        let bytes = self.read.wait()?;
        let t = Tensor::from_bytes(&bytes, self.spec.dtype, &self.spec.shape)?;
        Ok(t.with_scale(self.scale))
    }
}

/// A plan run captured into a CUDA graph on the backend's stream.
struct CudaCapturedRun {
    graph: GpuGraph,
    gpu: Arc<Gpu>,
    profiler: Arc<Profiler>,
}

impl CapturedRun for CudaCapturedRun {
    fn replay(&mut self) -> Result<bool> {
        // Profiling times each kernel between events: the launches run one by one.
        if self.profiler.is_on() {
            return Ok(false);
        }
        self.graph.launch()?;
        Ok(true)
    }

    fn check(&self) -> Result<()> {
        Ok(self.graph.check(&self.gpu)?)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
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
        let bytes = self
            .gpu
            .read(b, spec.numel() * spec.dtype.size_in_bytes())?;
        Ok(Tensor::from_bytes(&bytes, spec.dtype, &spec.shape)?.with_scale(buffer.scale))
    }

    fn download_async(
        &self,
        buffer: &DeviceBuffer,
        spec: &TensorSpec,
    ) -> Result<Box<dyn PendingDownload>> {
        let b = block(buffer, spec)?;
        let read = self
            .gpu
            .read_async(b, spec.numel() * spec.dtype.size_in_bytes())?;
        Ok(Box::new(CudaDownload {
            read,
            spec: spec.clone(),
            scale: buffer.scale,
        }))
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
            .ok_or_else(|| err("buffer does not belong to the CUDA backend"))?
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
        Ok(self.gpu.cache_write(
            ptr(&rows)?,
            out_ptr(&cache)?,
            ptr(&slots)?,
            slots.spec.dtype,
            w.rows,
            w.cache_rows,
            w.row * rows.spec.dtype.size_in_bytes(),
        )?)
    }

    fn split_rotary_into_caches(&self, kernel: &str, op: &Op, io: RotaryCaches<'_>) -> Result<()> {
        if !kernel.starts_with("cuda.") {
            return split_rotary_via_temporaries(self, kernel, op, io);
        }
        let start = match self.profiler.is_on() {
            true => Some(self.gpu.record_event()?),
            false => None,
        };
        let (ins, outs) = (io.input_specs(), io.output_specs());
        self.rotary_caches(op, io)?;
        if let Some(start) = start {
            let end = self.gpu.record_event()?;
            self.profiler.record(kernel, op, ins, outs, (start, end))?;
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
        // The executor inferred these specs with `op.infer` for this run; the sizes of
        // the buffers behind them are still checked by every launcher (`block`).
        if outputs.is_empty() {
            return Err(err(format!("{op}: no output")));
        }
        self.launch(kernel, op, inputs, outputs)
    }

    fn write(&self, tensor: &Tensor, dst: &mut DeviceBuffer) -> Result<()> {
        let spec = TensorSpec::new(tensor.shape(), tensor.dtype());
        let t = tensor.contiguous();
        self.gpu.write_async(block(dst, &spec)?, t.as_bytes()?)?;
        dst.scale = t.scale();
        Ok(())
    }

    fn buffer_address(&self, buffer: &DeviceBuffer) -> Option<u64> {
        buffer.inner::<DeviceBlock>().map(DeviceBlock::ptr)
    }

    fn capture(
        &self,
        work: &mut (dyn FnMut() -> Result<()> + Send),
    ) -> Result<Option<Box<dyn CapturedRun>>> {
        // Profiling brackets every kernel with events it reads back: never captured.
        if self.profiler.is_on() {
            return Ok(None);
        }
        self.gpu.begin_capture()?;
        let recorded = work();
        let graph = self.gpu.end_capture();
        recorded?;
        Ok(Some(Box::new(CudaCapturedRun {
            graph: graph?,
            gpu: Arc::clone(&self.gpu),
            profiler: Arc::clone(&self.profiler),
        })))
    }

    fn set_profiling(&self, on: bool) -> Result<bool> {
        self.profiler.set(on);
        Ok(true)
    }

    fn profile(&self) -> Result<Vec<KernelProfile>> {
        Ok(self.profiler.report()?)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.gpu.synchronize()?)
    }

    fn memory_stats(&self) -> MemoryStats {
        let s = self.gpu.memory().statistics();
        MemoryStats {
            allocated_bytes: s.requested_bytes,
            peak_bytes: s.peak_allocated_bytes,
            total_bytes: Some(self.gpu.properties().memory_bytes),
        }
    }
}
