//! The CPU backend: host memory and the CPU kernels behind the `Backend` trait.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use half::{bf16, f16};
use kpt_core::backend::{
    cache_write_into, copy_extent, row_write_extent, split_rotary_cache_into, Backend, BufferMut,
    BufferRef, DeviceBuffer, MemoryStats,
};
use kpt_core::graph::{Op, TensorSpec};
use kpt_core::hardware::{CpuDetector, DeviceInfo, DeviceKind, HardwareDetector};
use kpt_core::profile::{KernelProfile, ProfileTotals};
use kpt_core::tensor::Element;
use kpt_core::validate::ReferenceOps;
use kpt_core::{DType, KptError, Result, Storage, Tensor};

use crate::cpu;
use crate::cpu::linear::WeightsRef;
use crate::reference::{
    act, attention_shape, rotary_dims, rows_dim, split_rotary_sizes, CpuReference,
};

/// Attention tile sizes of the CPU flash kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTuning {
    /// Query rows per tile.
    pub block_q: usize,
    /// Key/value rows per tile.
    pub block_kv: usize,
}

impl Default for CpuTuning {
    fn default() -> Self {
        Self {
            block_q: cpu::DEFAULT_BLOCK_Q,
            block_kv: cpu::DEFAULT_BLOCK_KV,
        }
    }
}

/// The host CPU as a kpt backend. Buffers are typed host vectors ([`Storage`]).
#[derive(Debug)]
pub struct CpuBackend {
    device: DeviceInfo,
    tuning: CpuTuning,
    live: Arc<AtomicU64>,
    peak: AtomicU64,
    /// Whether `execute` records into `profile`.
    profiling: AtomicBool,
    /// Per-kernel wall-clock totals since profiling started.
    profile: Mutex<ProfileTotals>,
}

impl CpuBackend {
    /// Detects the host CPU.
    pub fn new() -> Result<Self> {
        Self::with_tuning(CpuTuning::default())
    }

    /// Detects the host CPU and sets the attention tiles.
    pub fn with_tuning(tuning: CpuTuning) -> Result<Self> {
        let device = CpuDetector
            .detect()?
            .into_iter()
            .next()
            .ok_or_else(|| KptError::Backend {
                backend: "cpu".into(),
                message: "no CPU detected".into(),
            })?;
        if tuning.block_q == 0 || tuning.block_kv == 0 {
            return Err(KptError::InvalidArgument(
                "attention blocks must be > 0".into(),
            ));
        }
        Ok(Self {
            device,
            tuning,
            live: Arc::new(AtomicU64::new(0)),
            peak: AtomicU64::new(0),
            profiling: AtomicBool::new(false),
            profile: Mutex::new(ProfileTotals::default()),
        })
    }

    /// Wraps storage into a buffer whose bytes count as live until it is dropped.
    fn buffer(&self, storage: Storage, scale: f32) -> DeviceBuffer {
        let bytes = storage.as_bytes().len() as u64;
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        let (dtype, len) = (storage.dtype(), storage.len());
        let mut b = DeviceBuffer::new(
            dtype,
            len,
            Box::new(HostAlloc {
                storage,
                live: self.live.clone(),
            }),
        );
        b.scale = scale;
        b
    }
}

/// A host allocation that takes its bytes off the backend's live count when dropped.
struct HostAlloc {
    storage: Storage,
    live: Arc<AtomicU64>,
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        self.live
            .fetch_sub(self.storage.as_bytes().len() as u64, Ordering::Relaxed);
    }
}

fn storage(b: &DeviceBuffer) -> Result<&Storage> {
    b.inner::<HostAlloc>()
        .map(|a| &a.storage)
        .ok_or_else(|| KptError::Backend {
            backend: "cpu".into(),
            message: "buffer does not belong to the CPU backend".into(),
        })
}

fn storage_mut(b: &mut DeviceBuffer) -> Result<&mut Storage> {
    b.inner_mut::<HostAlloc>()
        .map(|a| &mut a.storage)
        .ok_or_else(|| KptError::Backend {
            backend: "cpu".into(),
            message: "buffer does not belong to the CPU backend".into(),
        })
}

fn input<'a, T: Element>(r: &BufferRef<'a>) -> Result<&'a [T]> {
    let s = storage(r.buffer)?;
    let all = T::slice(s)
        .ok_or_else(|| KptError::dtype("cpu kernel input", T::DTYPE.name(), s.dtype()))?;
    all.get(..r.spec.numel())
        .ok_or_else(|| too_small(all.len(), r.spec))
}

fn output<'a, T: Element>(m: &'a mut BufferMut<'_>) -> Result<&'a mut [T]> {
    let n = m.spec.numel();
    let spec = m.spec.clone();
    let s = storage_mut(m.buffer)?;
    let dtype = s.dtype();
    let all = T::slice_mut(s)
        .ok_or_else(|| KptError::dtype("cpu kernel output", T::DTYPE.name(), dtype))?;
    let len = all.len();
    all.get_mut(..n).ok_or_else(|| too_small(len, &spec))
}

fn bytes_in<'a>(r: &BufferRef<'a>) -> Result<&'a [u8]> {
    match storage(r.buffer)? {
        Storage::F8E4M3(v) | Storage::F8E5M2(v) => v
            .get(..r.spec.numel())
            .ok_or_else(|| too_small(v.len(), r.spec)),
        s => Err(KptError::dtype(
            "cpu fp8 input",
            "f8e4m3 or f8e5m2",
            s.dtype(),
        )),
    }
}

fn bytes_out<'a>(m: &'a mut BufferMut<'_>) -> Result<&'a mut [u8]> {
    let n = m.spec.numel();
    match m.buffer.inner_mut::<HostAlloc>().map(|a| &mut a.storage) {
        Some(Storage::F8E4M3(v) | Storage::F8E5M2(v)) => {
            let len = v.len();
            v.get_mut(..n).ok_or_else(|| KptError::Backend {
                backend: "cpu".into(),
                message: format!("buffer of {len} < {n}"),
            })
        }
        Some(s) => Err(KptError::dtype(
            "cpu fp8 output",
            "f8e4m3 or f8e5m2",
            s.dtype(),
        )),
        None => Err(KptError::Backend {
            backend: "cpu".into(),
            message: "foreign buffer".into(),
        }),
    }
}

fn too_small(len: usize, spec: &TensorSpec) -> KptError {
    KptError::Backend {
        backend: "cpu".into(),
        message: format!("buffer of {len} elements cannot hold {spec}"),
    }
}

/// Index tensors (ids, positions) as i64, whatever their integer dtype.
fn indices(r: &BufferRef<'_>) -> Result<Vec<i64>> {
    match r.spec.dtype {
        DType::I64 => Ok(input::<i64>(r)?.to_vec()),
        DType::I32 => Ok(input::<i32>(r)?.iter().map(|&x| x as i64).collect()),
        d => Err(KptError::dtype("indices", "i32 or i64", d)),
    }
}

fn weights<'a>(r: &BufferRef<'a>) -> Result<WeightsRef<'a>> {
    let scale = r.buffer.scale;
    Ok(match r.spec.dtype {
        DType::F32 => WeightsRef::F32(input(r)?),
        DType::BF16 => WeightsRef::BF16(input(r)?),
        DType::F16 => WeightsRef::F16(input(r)?),
        DType::F8E4M3 => WeightsRef::F8E4M3 {
            bits: bytes_in(r)?,
            scale,
        },
        DType::F8E5M2 => WeightsRef::F8E5M2 {
            bits: bytes_in(r)?,
            scale,
        },
        DType::I8 => WeightsRef::I8 {
            data: input(r)?,
            scale,
        },
        d => {
            return Err(KptError::dtype(
                "linear weights",
                "f32, bf16, f16, f8e4m3, f8e5m2 or i8",
                d,
            ))
        }
    })
}

impl CpuBackend {
    /// Runs CPU kernel `kernel` for another backend, the last step of its fallback
    /// chain: each input is read with `download` and copied here, and each result,
    /// a host tensor with the kernel's scale, is handed to `store` for its output.
    pub fn run_for_device(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
        download: impl Fn(&DeviceBuffer, &TensorSpec) -> Result<Tensor>,
        mut store: impl FnMut(&Tensor, &mut BufferMut<'_>) -> Result<()>,
    ) -> Result<()> {
        tracing::debug!(kernel, %op, "running on the host (fallback)");
        let host_in = inputs
            .iter()
            .map(|r| self.upload(&download(r.buffer, r.spec)?))
            .collect::<Result<Vec<_>>>()?;
        let mut host_out = outputs
            .iter()
            .map(|m| self.allocate(m.spec.dtype, m.spec.numel()))
            .collect::<Result<Vec<_>>>()?;
        {
            let refs: Vec<_> = host_in
                .iter()
                .zip(inputs)
                .map(|(b, r)| BufferRef {
                    buffer: b,
                    spec: r.spec,
                })
                .collect();
            let mut muts: Vec<_> = host_out
                .iter_mut()
                .zip(outputs.iter())
                .map(|(b, m)| BufferMut {
                    buffer: b,
                    spec: m.spec,
                })
                .collect();
            self.execute(kernel, op, &refs, &mut muts)?;
        }
        for (h, m) in host_out.iter().zip(outputs.iter_mut()) {
            store(&self.download(h, m.spec)?, m)?;
        }
        Ok(())
    }
}

impl CpuBackend {
    /// Runs the f64 reference and writes its results in the output dtypes.
    fn run_reference(
        &self,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        let ins = inputs
            .iter()
            .map(|r| self.download(r.buffer, r.spec))
            .collect::<Result<Vec<_>>>()?;
        let outs = CpuReference.eval(op, &ins)?;
        for (m, t) in outputs.iter_mut().zip(outs) {
            let values = t.to_f64_vec();
            let scale = match op {
                Op::Quantize { scale, .. } => *scale,
                _ if m.spec.dtype.is_quantized() => {
                    // Keep the inputs' scale when they share one (exact for concat),
                    // otherwise choose one from the result's range.
                    let scales: Vec<f32> = inputs
                        .iter()
                        .filter(|r| r.spec.dtype.is_quantized())
                        .map(|r| r.buffer.scale)
                        .collect();
                    match scales.split_first() {
                        Some((&s0, rest)) if rest.iter().all(|&s| s == s0) => s0,
                        _ => {
                            let amax = values.iter().fold(0f64, |a, x| a.max(x.abs())) as f32;
                            kpt_core::dtype::quant_scale(amax, m.spec.dtype)
                        }
                    }
                }
                _ => 1.0,
            };
            let converted = Storage::from_f64(m.spec.dtype, &values, scale);
            let dst = m
                .buffer
                .inner_mut::<HostAlloc>()
                .map(|a| &mut a.storage)
                .ok_or_else(|| too_small(0, m.spec))?;
            copy_prefix(dst, &converted)?;
            m.buffer.scale = scale;
        }
        Ok(())
    }

    fn run_fast(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        let (out0, rest) = outputs
            .split_first_mut()
            .ok_or_else(|| KptError::Graph(format!("{kernel}: no output")))?;
        match op {
            Op::Embedding => {
                let (vocab, dim) = inputs[1].spec.rows_and_width();
                cpu::elementwise::embedding(
                    &indices(&inputs[0])?,
                    input(&inputs[1])?,
                    output(out0)?,
                    vocab,
                    dim,
                )
            }
            Op::MatMul => {
                let a = inputs[0].spec;
                let b = inputs[1].spec;
                let (k, n) = (b.shape[b.shape.len() - 2], b.shape[b.shape.len() - 1]);
                let m: usize = a.shape[..a.shape.len() - 1].iter().product();
                if b.shape.len() != 2 {
                    return self.run_reference(op, inputs, outputs);
                }
                match a.dtype {
                    DType::F32 => cpu::gemm::matmul_f32(
                        input(&inputs[0])?,
                        input(&inputs[1])?,
                        output(out0)?,
                        m,
                        k,
                        n,
                    ),
                    DType::BF16 => cpu::gemm::matmul_bf16(
                        input::<bf16>(&inputs[0])?,
                        input(&inputs[1])?,
                        output(out0)?,
                        m,
                        k,
                        n,
                    ),
                    DType::F16 => cpu::gemm::matmul_f16(
                        input::<f16>(&inputs[0])?,
                        input(&inputs[1])?,
                        output(out0)?,
                        m,
                        k,
                        n,
                    ),
                    d => Err(KptError::dtype(kernel, "f32, bf16 or f16", d)),
                }
            }
            Op::Linear { bias } | Op::LinearAct { bias, .. } => {
                let a = match op {
                    Op::LinearAct { act: a, .. } => Some(act(*a)),
                    _ => None,
                };
                let (m, k) = rows_dim(&inputs[0].spec.shape);
                let n = inputs[1].spec.shape[0];
                let b = if *bias {
                    Some(input::<f32>(&inputs[2])?)
                } else {
                    None
                };
                cpu::linear::linear(
                    input(&inputs[0])?,
                    weights(&inputs[1])?,
                    b,
                    a,
                    output(out0)?,
                    m,
                    k,
                    n,
                )
            }
            Op::Activation { act: a } => {
                cpu::elementwise::activation(input(&inputs[0])?, output(out0)?, act(*a))
            }
            Op::RmsNorm { eps } => {
                let (rows, dim) = rows_dim(&inputs[0].spec.shape);
                cpu::norm::rms_norm(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    output(out0)?,
                    rows,
                    dim,
                    *eps,
                )
            }
            Op::LayerNorm { eps } => {
                let (rows, dim) = rows_dim(&inputs[0].spec.shape);
                cpu::norm::layer_norm(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    input(&inputs[2])?,
                    output(out0)?,
                    rows,
                    dim,
                    *eps,
                )
            }
            Op::AddRmsNorm { eps } => {
                let (rows, dim) = rows_dim(&inputs[0].spec.shape);
                let out1 = rest
                    .first_mut()
                    .ok_or_else(|| KptError::Graph("add_rms_norm needs two outputs".into()))?;
                cpu::norm::add_rms_norm(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    input(&inputs[2])?,
                    output(out0)?,
                    output(out1)?,
                    rows,
                    dim,
                    *eps,
                )
            }
            Op::AddLayerNorm { eps } => {
                let (rows, dim) = rows_dim(&inputs[0].spec.shape);
                let out1 = rest
                    .first_mut()
                    .ok_or_else(|| KptError::Graph("add_layer_norm needs two outputs".into()))?;
                cpu::norm::add_layer_norm(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    input(&inputs[2])?,
                    input(&inputs[3])?,
                    output(out0)?,
                    output(out1)?,
                    rows,
                    dim,
                    *eps,
                )
            }
            Op::Rotary {
                head_dim,
                theta,
                scaling,
            } => {
                let (batch, seq, width) = rotary_dims(&inputs[0].spec.shape);
                cpu::rotary::rotary(
                    input(&inputs[0])?,
                    &indices(&inputs[1])?,
                    output(out0)?,
                    batch,
                    seq,
                    width / head_dim,
                    *head_dim,
                    *theta,
                    scaling.as_ref(),
                )
            }
            Op::SplitRotary {
                head_dim,
                theta,
                scaling,
                sizes,
                ..
            } => {
                let (batch, seq, _) = rotary_dims(&inputs[0].spec.shape);
                let [k, v] = rest else {
                    return Err(KptError::Graph("split_rotary needs three outputs".into()));
                };
                cpu::rotary::split_rotary(
                    input(&inputs[0])?,
                    &indices(&inputs[1])?,
                    (output(out0)?, output(k)?, output(v)?),
                    batch,
                    seq,
                    split_rotary_sizes(sizes)?,
                    *head_dim,
                    *theta,
                    scaling.as_ref(),
                )
            }
            Op::Softmax => {
                let (rows, dim) = rows_dim(&inputs[0].spec.shape);
                cpu::softmax::softmax(input(&inputs[0])?, output(out0)?, rows, dim)
            }
            Op::ArgMax => {
                let (rows, dim) = rows_dim(&inputs[0].spec.shape);
                cpu::softmax::argmax(input(&inputs[0])?, output(out0)?, rows, dim)
            }
            Op::AttentionBackward(p) if p.varlen => {
                let shape = attention_shape(p, &inputs[0].spec.shape, &inputs[1].spec.shape);
                let [dq, dk, dv] = outputs else {
                    return Err(KptError::Graph(
                        "attention_backward needs three outputs".into(),
                    ));
                };
                cpu::for_each_sequence_backward(
                    &shape,
                    &indices(&inputs[5])?,
                    &indices(&inputs[6])?,
                    (
                        input(&inputs[0])?,
                        input(&inputs[1])?,
                        input(&inputs[2])?,
                        input(&inputs[3])?,
                        input(&inputs[4])?,
                    ),
                    (output(dq)?, output(dk)?, output(dv)?),
                    |(q, k, v, out, dout), grads, s| {
                        cpu::attention_backward(q, k, v, None, (out, dout, None), grads, s)
                    },
                )
            }
            Op::AttentionBackward(p) => {
                let shape = attention_shape(p, &inputs[0].spec.shape, &inputs[1].spec.shape);
                let mask = if p.mask {
                    Some(input::<f32>(&inputs[5])?)
                } else {
                    None
                };
                let lse = if p.lse {
                    let at = 5 + usize::from(p.mask);
                    let l = inputs.get(at).ok_or_else(|| {
                        KptError::Graph("attention_backward needs its lse input".into())
                    })?;
                    Some(input::<f32>(l)?)
                } else {
                    None
                };
                let [dq, dk, dv] = outputs else {
                    return Err(KptError::Graph(
                        "attention_backward needs three outputs".into(),
                    ));
                };
                cpu::attention_backward(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    input(&inputs[2])?,
                    mask,
                    (input(&inputs[3])?, input(&inputs[4])?, lse),
                    (output(dq)?, output(dk)?, output(dv)?),
                    &shape,
                )
            }
            Op::Attention(p) if p.paged => {
                let shape = attention_shape(p, &inputs[0].spec.shape, &inputs[1].spec.shape);
                let (bq, bkv) = (self.tuning.block_q, self.tuning.block_kv);
                let cache = &inputs[1].spec.shape;
                cpu::for_each_paged_sequence(
                    &shape,
                    &cpu::PagedKv {
                        block_size: cache[1],
                        num_blocks: cache[0],
                        block_table: &indices(&inputs[3])?,
                        seq_lens: &indices(&inputs[4])?,
                    },
                    (input(&inputs[0])?, input(&inputs[1])?, input(&inputs[2])?),
                    output(out0)?,
                    |q, k, v, out, s| cpu::attention::attention(q, k, v, None, out, s, bq, bkv),
                )
            }
            Op::Attention(p) if p.varlen => {
                let shape = attention_shape(p, &inputs[0].spec.shape, &inputs[1].spec.shape);
                let (bq, bkv) = (self.tuning.block_q, self.tuning.block_kv);
                cpu::for_each_sequence(
                    &shape,
                    &indices(&inputs[3])?,
                    &indices(&inputs[4])?,
                    (input(&inputs[0])?, input(&inputs[1])?, input(&inputs[2])?),
                    output(out0)?,
                    |q, k, v, out, s| cpu::attention::attention(q, k, v, None, out, s, bq, bkv),
                )
            }
            Op::Attention(p) => {
                let shape = attention_shape(p, &inputs[0].spec.shape, &inputs[1].spec.shape);
                let mask = if p.mask {
                    Some(input::<f32>(&inputs[3])?)
                } else {
                    None
                };
                cpu::attention::attention(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    input(&inputs[2])?,
                    mask,
                    output(out0)?,
                    &shape,
                    self.tuning.block_q,
                    self.tuning.block_kv,
                )?;
                if !p.lse {
                    return Ok(());
                }
                // The log-sum-exp: a second pass over the scores.
                let lse = rest.first_mut().ok_or_else(|| {
                    KptError::Graph("attention with lse needs two outputs".into())
                })?;
                cpu::attention_lse(
                    input(&inputs[0])?,
                    input(&inputs[1])?,
                    mask,
                    output(lse)?,
                    &shape,
                )
            }
            Op::Add => cpu::elementwise::add(input(&inputs[0])?, input(&inputs[1])?, output(out0)?),
            Op::Mul => cpu::elementwise::mul(input(&inputs[0])?, input(&inputs[1])?, output(out0)?),
            Op::Quantize { dtype, scale } => {
                let x = input::<f32>(&inputs[0])?;
                match dtype {
                    DType::F8E4M3 => cpu::elementwise::quantize_f8e4m3(x, *scale, bytes_out(out0)?),
                    DType::F8E5M2 => cpu::elementwise::quantize_f8e5m2(x, *scale, bytes_out(out0)?),
                    DType::I8 => cpu::elementwise::quantize_i8(x, *scale, output(out0)?),
                    d => Err(KptError::dtype(kernel, "f8e4m3, f8e5m2 or i8", *d)),
                }?;
                out0.buffer.scale = *scale;
                Ok(())
            }
            Op::Dequantize { .. } => {
                let scale = inputs[0].buffer.scale;
                let out = output::<f32>(out0)?;
                match inputs[0].spec.dtype {
                    DType::F8E4M3 => {
                        cpu::elementwise::dequantize_f8e4m3(bytes_in(&inputs[0])?, scale, out)
                    }
                    DType::F8E5M2 => {
                        cpu::elementwise::dequantize_f8e5m2(bytes_in(&inputs[0])?, scale, out)
                    }
                    DType::I8 => cpu::elementwise::dequantize_i8(input(&inputs[0])?, scale, out),
                    d => Err(KptError::dtype(kernel, "f8e4m3, f8e5m2 or i8", d)),
                }
            }
            Op::Cast { dtype } => match (inputs[0].spec.dtype, dtype) {
                (DType::F32, DType::BF16) => {
                    cpu::elementwise::cast_f32_to_bf16(input(&inputs[0])?, output(out0)?)
                }
                (DType::F32, DType::F16) => {
                    cpu::elementwise::cast_f32_to_f16(input(&inputs[0])?, output(out0)?)
                }
                (DType::BF16, DType::F32) => {
                    cpu::elementwise::cast_bf16_to_f32(input(&inputs[0])?, output(out0)?)
                }
                (DType::F16, DType::F32) => {
                    cpu::elementwise::cast_f16_to_f32(input(&inputs[0])?, output(out0)?)
                }
                _ => self.run_reference(op, inputs, outputs),
            },
            Op::Concat { axis } => concat(inputs, out0, *axis),
            Op::Split { axis, .. } => split(op, &inputs[0], outputs, *axis),
            Op::ActAndMul { act: a } => {
                let n = out0.spec.shape.last().copied().unwrap_or(0);
                cpu::elementwise::act_and_mul(input(&inputs[0])?, output(out0)?, n, act(*a))
            }
            Op::CacheWrite => cache_write_into(self, inputs, out0),
        }
    }
}

/// Copies `src` into the front of `dst` (same dtype).
fn copy_prefix(dst: &mut Storage, src: &Storage) -> Result<()> {
    macro_rules! copy {
        ($($v:ident),*) => {
            match (dst, src) {
                $((Storage::$v(d), Storage::$v(s)) => {
                    let len = d.len();
                    d.get_mut(..s.len())
                        .ok_or_else(|| KptError::Backend { backend: "cpu".into(), message: format!("buffer of {len} < {}", s.len()) })?
                        .copy_from_slice(s);
                    Ok(())
                })*
                (d, s) => Err(KptError::dtype("cpu copy", d.dtype().name(), s.dtype())),
            }
        };
    }
    copy!(F64, F32, F16, BF16, F8E4M3, F8E5M2, I8, I32, I64)
}

/// Expands the caller's `run!` macro for the element type of `dtype`, one of the dtypes the
/// copy ops (concat, split) take; any other is a dtype error of `op`.
macro_rules! by_copy_dtype {
    ($dtype:expr, $op:expr, $run:ident) => {
        match $dtype {
            DType::F32 => $run!(f32),
            DType::BF16 => $run!(bf16),
            DType::F16 => $run!(f16),
            DType::F64 => $run!(f64),
            DType::I32 => $run!(i32),
            DType::I64 => $run!(i64),
            d => Err(KptError::dtype($op, "f64, f32, f16, bf16, i32 or i64", d)),
        }
    };
}

/// Concatenation along `axis` as a sequence of contiguous block copies.
fn concat(inputs: &[BufferRef<'_>], out: &mut BufferMut<'_>, axis: usize) -> Result<()> {
    let (a, b) = (inputs[0].spec, inputs[1].spec);
    let outer: usize = a.shape[..axis].iter().product();
    let inner: usize = a.shape[axis + 1..].iter().product();
    let (na, nb) = (a.shape[axis] * inner, b.shape[axis] * inner);
    macro_rules! run {
        ($t:ty) => {{
            let (x, y) = (input::<$t>(&inputs[0])?, input::<$t>(&inputs[1])?);
            let o = output::<$t>(out)?;
            for i in 0..outer {
                let row = &mut o[i * (na + nb)..(i + 1) * (na + nb)];
                row[..na].copy_from_slice(&x[i * na..(i + 1) * na]);
                row[na..].copy_from_slice(&y[i * nb..(i + 1) * nb]);
            }
            Ok(())
        }};
    }
    by_copy_dtype!(a.dtype, "cpu.concat", run)
}

/// Split along `axis` into `outputs` (which must have the specs `op` infers), as
/// contiguous block copies.
fn split(op: &Op, x: &BufferRef<'_>, outputs: &mut [BufferMut<'_>], axis: usize) -> Result<()> {
    let expected = op.infer(std::slice::from_ref(x.spec))?;
    if expected.len() != outputs.len()
        || expected
            .iter()
            .zip(outputs.iter())
            .any(|(e, o)| e != o.spec)
    {
        return Err(KptError::Graph(format!(
            "{op}: {} outputs do not match the {} inferred ones",
            outputs.len(),
            expected.len()
        )));
    }
    let shape = &x.spec.shape;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let row = shape[axis] * inner;
    macro_rules! run {
        ($t:ty) => {{
            let x = input::<$t>(x)?;
            let mut start = 0;
            for out in outputs.iter_mut() {
                let n = out.spec.shape[axis] * inner;
                let o = output::<$t>(out)?;
                for i in 0..outer {
                    o[i * n..(i + 1) * n].copy_from_slice(&x[i * row + start..][..n]);
                }
                start += n;
            }
            Ok(())
        }};
    }
    by_copy_dtype!(x.spec.dtype, "cpu.split", run)
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn buffer_address(&self, buffer: &DeviceBuffer) -> Option<u64> {
        storage(buffer)
            .ok()
            .map(|s| s.as_bytes().as_ptr() as usize as u64)
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn device(&self) -> &DeviceInfo {
        &self.device
    }

    fn allocate(&self, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        Ok(self.buffer(Storage::zeros(dtype, len), 1.0))
    }

    fn upload(&self, tensor: &Tensor) -> Result<DeviceBuffer> {
        let t = tensor.contiguous();
        let storage = t.storage().clone();
        Ok(self.buffer(storage, t.scale()))
    }

    fn download(&self, buffer: &DeviceBuffer, spec: &TensorSpec) -> Result<Tensor> {
        let s = storage(buffer)?;
        let n = spec.numel();
        if s.len() < n || s.dtype() != spec.dtype {
            return Err(too_small(s.len(), spec));
        }
        let size = spec.dtype.size_in_bytes();
        Ok(
            Tensor::from_bytes(&s.as_bytes()[..n * size], spec.dtype, &spec.shape)?
                .with_scale(buffer.scale),
        )
    }

    fn copy_into(
        &self,
        src: BufferRef<'_>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let (at, bytes) = copy_extent(src, dst, dst_offset)?;
        let from = &storage(src.buffer)?.as_bytes()[..bytes];
        storage_mut(dst)?.as_bytes_mut()[at..at + bytes].copy_from_slice(from);
        Ok(())
    }

    fn write_rows(
        &self,
        rows: BufferRef<'_>,
        slots: BufferRef<'_>,
        cache: BufferMut<'_>,
    ) -> Result<()> {
        // The extent check also makes sure the buffers hold their specs' elements.
        let w = row_write_extent(rows, slots, &cache)?;
        let size = rows.spec.dtype.size_in_bytes() * w.row;
        let slots = indices(&slots)?;
        let from = &storage(rows.buffer)?.as_bytes()[..w.rows * size];
        let to = storage_mut(cache.buffer)?.as_bytes_mut();
        for (src, &slot) in from.chunks_exact(size.max(1)).zip(&slots) {
            if let Some(r) = w.cache_row(slot)? {
                to[r * size..(r + 1) * size].copy_from_slice(src);
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
        if inputs.len() != op.num_inputs() {
            return Err(KptError::Graph(format!(
                "{op} takes {} inputs, got {}",
                op.num_inputs(),
                inputs.len()
            )));
        }
        if let Op::SplitRotary { cache: true, .. } = op {
            // The split + rotary into temporaries, then the cache writes.
            return split_rotary_cache_into(self, op, inputs, outputs, |io| {
                self.split_rotary_into_caches(kernel, op, io)
            });
        }
        let start = Instant::now();
        if kernel == crate::catalog::CPU_REFERENCE {
            self.run_reference(op, inputs, outputs)?;
        } else if kernel.starts_with("cpu.") {
            self.run_fast(kernel, op, inputs, outputs)?;
        } else {
            return Err(KptError::Backend {
                backend: "cpu".into(),
                message: format!("kernel {kernel} is not a CPU kernel"),
            });
        }
        if self.profiling.load(Ordering::Relaxed) {
            let ins: Vec<TensorSpec> = inputs.iter().map(|r| r.spec.clone()).collect();
            let outs: Vec<TensorSpec> = outputs.iter().map(|m| m.spec.clone()).collect();
            self.profile.lock().unwrap_or_else(|p| p.into_inner()).add(
                kernel,
                op,
                &ins,
                &outs,
                start.elapsed().as_secs_f64(),
            );
        }
        Ok(())
    }

    fn run_launches(&self, work: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        // From a thread outside the pool this runs `work` on a worker (the caller waits
        // once per run instead of once per kernel); on a worker it runs in place.
        rayon::scope(|_| work())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn set_profiling(&self, on: bool) -> Result<bool> {
        if on {
            *self.profile.lock().unwrap_or_else(|p| p.into_inner()) = ProfileTotals::default();
        }
        self.profiling.store(on, Ordering::Relaxed);
        Ok(true)
    }

    fn profile(&self) -> Result<Vec<KernelProfile>> {
        Ok(self
            .profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .report())
    }

    fn memory_stats(&self) -> MemoryStats {
        MemoryStats {
            allocated_bytes: self.live.load(Ordering::Relaxed),
            peak_bytes: self.peak.load(Ordering::Relaxed),
            total_bytes: self.device.memory_bytes,
        }
    }
}
