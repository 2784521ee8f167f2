//! The `Backend` trait: devices, memory and op execution, chosen at run time.
//!
//! A backend owns device memory ([`DeviceBuffer`]) and runs kernels chosen by the
//! kernel registry. Callers hold backends as `Arc<dyn Backend>` in a
//! [`BackendRegistry`] and never `#[cfg]` on a backend.

use std::any::Any;
use std::sync::Arc;

use crate::error::{KptError, Result};
use crate::graph::{Op, TensorSpec};
use crate::hardware::{DeviceInfo, DeviceKind};
use crate::profile::KernelProfile;
use crate::tensor::Tensor;
use crate::DType;

/// A block of device memory holding `len` elements of `dtype`.
///
/// The backend-specific allocation sits behind `inner`; a value stored in the buffer
/// uses its first `numel` elements. Quantized contents carry their per-tensor `scale`.
pub struct DeviceBuffer {
    dtype: DType,
    len: usize,
    /// Quantization scale of the current contents (1.0 when not quantized).
    pub scale: f32,
    constant: bool,
    inner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .field("scale", &self.scale)
            .finish_non_exhaustive()
    }
}

impl DeviceBuffer {
    /// Wraps a backend allocation.
    pub fn new(dtype: DType, len: usize, inner: Box<dyn Any + Send + Sync>) -> Self {
        Self {
            dtype,
            len,
            scale: 1.0,
            constant: false,
            inner,
        }
    }

    /// Marks the contents as never written again (a plan's parameters, uploaded once): a
    /// backend may then read them before the kernels queued ahead of a reader finish.
    pub fn mark_constant(&mut self) {
        self.constant = true;
    }

    /// Whether [`mark_constant`](Self::mark_constant) was called.
    pub fn is_constant(&self) -> bool {
        self.constant
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Capacity in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the capacity is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }

    /// The backend allocation, if it is of type `T`.
    pub fn inner<T: 'static>(&self) -> Option<&T> {
        self.inner.downcast_ref()
    }

    /// The backend allocation, mutably, if it is of type `T`.
    pub fn inner_mut<T: 'static>(&mut self) -> Option<&mut T> {
        self.inner.downcast_mut()
    }
}

/// A read-only view of a buffer as a tensor of `spec`.
#[derive(Debug, Clone, Copy)]
pub struct BufferRef<'a> {
    /// The buffer.
    pub buffer: &'a DeviceBuffer,
    /// Shape and dtype of the value in it.
    pub spec: &'a TensorSpec,
}

/// A writable view of a buffer as a tensor of `spec`.
#[derive(Debug)]
pub struct BufferMut<'a> {
    /// The buffer.
    pub buffer: &'a mut DeviceBuffer,
    /// Shape and dtype of the value to write.
    pub spec: &'a TensorSpec,
}

impl BufferMut<'_> {
    /// A shorter-lived view of the same buffer.
    pub fn reborrow(&mut self) -> BufferMut<'_> {
        BufferMut {
            buffer: &mut *self.buffer,
            spec: self.spec,
        }
    }
}

/// Checks that `outputs` are exactly the specs `op` infers from `inputs` (which also
/// checks the number of inputs): device kernels trust the sizes they are given, so a
/// device backend's [`Backend::execute`] calls this before it launches anything.
pub fn check_output_specs(
    op: &Op,
    inputs: &[BufferRef<'_>],
    outputs: &[BufferMut<'_>],
) -> Result<()> {
    let specs: Vec<TensorSpec> = inputs.iter().map(|r| r.spec.clone()).collect();
    let expected = op.infer(&specs)?;
    if expected.len() != outputs.len() || expected.iter().zip(outputs).any(|(e, m)| e != m.spec) {
        return Err(KptError::Graph(format!(
            "{op}: outputs {:?} do not match the inferred {:?}",
            outputs
                .iter()
                .map(|m| m.spec.to_string())
                .collect::<Vec<_>>(),
            expected.iter().map(ToString::to_string).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

/// Checks a [`Backend::copy_into`] request and returns its destination offset and
/// length in bytes.
pub fn copy_extent(
    src: BufferRef<'_>,
    dst: &DeviceBuffer,
    dst_offset: usize,
) -> Result<(usize, usize)> {
    let n = src.spec.numel();
    if src.buffer.dtype() != src.spec.dtype || src.buffer.len() < n {
        return Err(KptError::InvalidArgument(format!(
            "copy source of {} {} cannot hold {}",
            src.buffer.len(),
            src.buffer.dtype(),
            src.spec
        )));
    }
    if dst.dtype() != src.spec.dtype {
        return Err(KptError::dtype(
            "copy destination",
            src.spec.dtype.name(),
            dst.dtype(),
        ));
    }
    match dst_offset.checked_add(n) {
        Some(end) if end <= dst.len() => {
            let size = dst.dtype().size_in_bytes();
            Ok((dst_offset * size, n * size))
        }
        _ => Err(KptError::InvalidArgument(format!(
            "copying {n} elements to offset {dst_offset} overruns a buffer of {}",
            dst.len()
        ))),
    }
}

/// The sizes of a [`Backend::write_rows`] request, checked by [`row_write_extent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowWrite {
    /// Rows to write (one slot each).
    pub rows: usize,
    /// Elements per row.
    pub row: usize,
    /// Rows the cache holds (the slots' range).
    pub cache_rows: usize,
}

impl RowWrite {
    /// The cache row of `slot`: `None` for a negative slot (skipped), an error past the
    /// cache's end.
    pub fn cache_row(&self, slot: i64) -> Result<Option<usize>> {
        match usize::try_from(slot) {
            Err(_) => Ok(None),
            Ok(r) if r < self.cache_rows => Ok(Some(r)),
            Ok(r) => Err(KptError::InvalidArgument(format!(
                "cache_write slot {r} is past the cache's {} rows",
                self.cache_rows
            ))),
        }
    }
}

/// Checks a [`Backend::write_rows`] request against [`Op::CacheWrite`]'s rules and the
/// buffers' sizes.
pub fn row_write_extent(
    rows: BufferRef<'_>,
    slots: BufferRef<'_>,
    cache: &BufferMut<'_>,
) -> Result<RowWrite> {
    Op::CacheWrite.infer(&[cache.spec.clone(), rows.spec.clone(), slots.spec.clone()])?;
    for (what, buffer, spec) in [
        ("rows", rows.buffer, rows.spec),
        ("slots", slots.buffer, slots.spec),
        ("cache", &*cache.buffer, cache.spec),
    ] {
        if buffer.dtype() != spec.dtype || buffer.len() < spec.numel() {
            return Err(KptError::InvalidArgument(format!(
                "cache_write {what}: a buffer of {} {} cannot hold {spec}",
                buffer.len(),
                buffer.dtype()
            )));
        }
    }
    let row = cache.spec.shape.last().copied().unwrap_or(0);
    Ok(RowWrite {
        rows: slots.spec.numel(),
        row,
        cache_rows: cache.spec.numel() / row.max(1),
    })
}

/// The launches of one plan run recorded by [`Backend::capture`], replayable on the
/// same buffers (on CUDA, an instantiated graph). It owns the memory its launches
/// allocated while they were recorded; dropping it frees that memory and the graph.
pub trait CapturedRun: Send {
    /// Queues every recorded launch again, in order, on the buffers recorded. `false`:
    /// the backend cannot replay now (it is profiling, which times each launch) and
    /// queued nothing; the caller launches the run's kernels itself.
    fn replay(&mut self) -> Result<bool>;

    /// Checks that launchers would have made on the host after their kernels (an
    /// embedding id outside the table, ...) for the last replay; call it after the
    /// backend synchronized. The default has nothing to check.
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// [`Op::CacheWrite`] into a new output: copies the cache (`inputs[0]`) into `out`,
/// then writes the rows (`inputs[1]`) at the slots (`inputs[2]`) there with
/// [`Backend::write_rows`]. What a backend's `execute` of the op runs.
pub fn cache_write_into(
    backend: &(impl Backend + ?Sized),
    inputs: &[BufferRef<'_>],
    out: &mut BufferMut<'_>,
) -> Result<()> {
    let [cache, rows, slots] = inputs else {
        return Err(KptError::Graph(format!(
            "cache_write takes 3 inputs, got {}",
            inputs.len()
        )));
    };
    backend.copy_into(*cache, out.buffer, 0)?;
    let cache = BufferMut {
        buffer: &mut *out.buffer,
        spec: out.spec,
    };
    backend.write_rows(*rows, *slots, cache)
}

/// Runs `op` once through `kernel` on host tensors: uploads the inputs, allocates the
/// outputs `op` infers, executes and downloads them (for tests and one-off calls).
pub fn run_op(
    backend: &(impl Backend + ?Sized),
    kernel: &str,
    op: &Op,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>> {
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let out_specs = op.infer(&specs)?;
    let buffers = inputs
        .iter()
        .map(|t| backend.upload(t))
        .collect::<Result<Vec<_>>>()?;
    let mut outs = out_specs
        .iter()
        .map(|s| backend.allocate(s.dtype, s.numel()))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<BufferRef<'_>> = buffers
        .iter()
        .zip(&specs)
        .map(|(buffer, spec)| BufferRef { buffer, spec })
        .collect();
    let mut muts: Vec<BufferMut<'_>> = outs
        .iter_mut()
        .zip(&out_specs)
        .map(|(buffer, spec)| BufferMut { buffer, spec })
        .collect();
    backend.execute(kernel, op, &refs, &mut muts)?;
    outs.iter()
        .zip(&out_specs)
        .map(|(o, s)| backend.download(o, s))
        .collect()
}

/// The buffers of an in-place split + rotary into caches
/// ([`Backend::split_rotary_into_caches`]): its qkv, positions and slots inputs, the q
/// output and the two caches it writes rows into.
#[derive(Debug)]
pub struct RotaryCaches<'a> {
    /// The merged projection `[.., S, q+k+v]`.
    pub qkv: BufferRef<'a>,
    /// The positions.
    pub positions: BufferRef<'a>,
    /// The cache row of each token.
    pub slots: BufferRef<'a>,
    /// The rotated q.
    pub q: BufferMut<'a>,
    /// The key cache.
    pub k_cache: BufferMut<'a>,
    /// The value cache.
    pub v_cache: BufferMut<'a>,
}

impl RotaryCaches<'_> {
    /// The specs of the op's inputs: qkv, positions, k cache, v cache, slots.
    pub fn input_specs(&self) -> Vec<TensorSpec> {
        [
            self.qkv.spec,
            self.positions.spec,
            self.k_cache.spec,
            self.v_cache.spec,
            self.slots.spec,
        ]
        .map(TensorSpec::clone)
        .to_vec()
    }

    /// The specs of its outputs: q, k cache, v cache.
    pub fn output_specs(&self) -> Vec<TensorSpec> {
        [self.q.spec, self.k_cache.spec, self.v_cache.spec]
            .map(TensorSpec::clone)
            .to_vec()
    }
}

/// [`Backend::split_rotary_into_caches`] from other launches: the plain split + rotary
/// (`kernel`) into temporary k and v buffers, then [`Backend::write_rows`] into each
/// cache.
pub fn split_rotary_via_temporaries(
    backend: &(impl Backend + ?Sized),
    kernel: &str,
    op: &Op,
    io: RotaryCaches<'_>,
) -> Result<()> {
    let plain = op.split_rotary_with_cache(false)?;
    let specs = plain.infer(&[io.qkv.spec.clone(), io.positions.spec.clone()])?;
    let mut k = backend.allocate(specs[1].dtype, specs[1].numel())?;
    let mut v = backend.allocate(specs[2].dtype, specs[2].numel())?;
    backend.execute_inferred(
        kernel,
        &plain,
        &[io.qkv, io.positions],
        &mut [
            io.q,
            BufferMut {
                buffer: &mut k,
                spec: &specs[1],
            },
            BufferMut {
                buffer: &mut v,
                spec: &specs[2],
            },
        ],
    )?;
    for (rows, spec, cache) in [(&k, &specs[1], io.k_cache), (&v, &specs[2], io.v_cache)] {
        backend.write_rows(BufferRef { buffer: rows, spec }, io.slots, cache)?;
    }
    Ok(())
}

/// [`Op::SplitRotary`] with `cache` into new outputs: copies the caches (`inputs[2]`,
/// `inputs[3]`) into `outputs[1]` and `outputs[2]`, then writes there with `write`
/// (a backend's [`Backend::split_rotary_into_caches`], or the launch behind it). What a
/// backend's `execute` of the op runs.
pub fn split_rotary_cache_into(
    backend: &(impl Backend + ?Sized),
    op: &Op,
    inputs: &[BufferRef<'_>],
    outputs: &mut [BufferMut<'_>],
    write: impl FnOnce(RotaryCaches<'_>) -> Result<()>,
) -> Result<()> {
    let counts = (inputs.len(), outputs.len());
    let ([qkv, positions, k_cache, v_cache, slots], [q, k_out, v_out]) = (inputs, outputs) else {
        return Err(KptError::Graph(format!(
            "{op} takes 5 inputs and 3 outputs, got {} and {}",
            counts.0, counts.1
        )));
    };
    backend.copy_into(*k_cache, k_out.buffer, 0)?;
    backend.copy_into(*v_cache, v_out.buffer, 0)?;
    write(RotaryCaches {
        qkv: *qkv,
        positions: *positions,
        slots: *slots,
        q: q.reborrow(),
        k_cache: k_out.reborrow(),
        v_cache: v_out.reborrow(),
    })
}

/// Memory use of a backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryStats {
    /// Bytes currently allocated through the backend.
    pub allocated_bytes: u64,
    /// Highest `allocated_bytes` seen.
    pub peak_bytes: u64,
    /// Device capacity, when known.
    pub total_bytes: Option<u64>,
}

/// A download started by [`Backend::download_async`].
pub trait PendingDownload: Send {
    /// Waits for the copy (and the work queued before it) and returns the tensor.
    fn wait(self: Box<Self>) -> Result<Tensor>;
}

/// A download that finished when it started: what [`Backend::download_async`] gives
/// on a backend whose downloads are synchronous.
#[derive(Debug)]
pub struct Downloaded(pub Tensor);

impl PendingDownload for Downloaded {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        Ok(self.0)
    }
}

/// A compute backend: one device, its memory and its kernels.
pub trait Backend: Send + Sync {
    /// Short name, e.g. `cpu`, `cuda:0`.
    fn name(&self) -> &str;

    /// The kind of device.
    fn kind(&self) -> DeviceKind;

    /// What the hardware is (name, arch, features).
    fn device(&self) -> &DeviceInfo;

    /// Allocates a zeroed buffer of `len` elements.
    fn allocate(&self, dtype: DType, len: usize) -> Result<DeviceBuffer>;

    /// Copies a host tensor to a new device buffer (keeping its scale).
    fn upload(&self, tensor: &Tensor) -> Result<DeviceBuffer>;

    /// Copies the first `spec.numel()` elements of a buffer back to the host.
    fn download(&self, buffer: &DeviceBuffer, spec: &TensorSpec) -> Result<Tensor>;

    /// Starts [`Backend::download`] behind the work queued so far and returns without
    /// waiting for it; [`PendingDownload::wait`] gives the tensor. Work queued after
    /// this call may run before the wait returns, and `buffer` may be dropped once this
    /// returns. The default downloads at once.
    fn download_async(
        &self,
        buffer: &DeviceBuffer,
        spec: &TensorSpec,
    ) -> Result<Box<dyn PendingDownload>> {
        Ok(Box::new(Downloaded(self.download(buffer, spec)?)))
    }

    /// Copies the `src.spec.numel()` elements of `src` into `dst` from element
    /// `dst_offset` on (queued like a kernel). The dtypes must match and `dst` must have
    /// room; appending a token's keys to a cache with spare capacity is one such copy.
    fn copy_into(
        &self,
        src: BufferRef<'_>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()>;

    /// [`Op::CacheWrite`] in place: writes row `i` of `rows` over row `slots[i]` of the
    /// cache in `cache` (negative slots skipped), queued like a kernel. Executors call it
    /// when the cache input is theirs to change; `execute` of the op copies the cache to
    /// its output first. Check the request with [`row_write_extent`].
    fn write_rows(
        &self,
        rows: BufferRef<'_>,
        slots: BufferRef<'_>,
        cache: BufferMut<'_>,
    ) -> Result<()>;

    /// [`Op::SplitRotary`] with `cache` in place: q into `q`, the rotated k and the v rows
    /// of `qkv` over rows `slots[i]` of `k_cache` and `v_cache` (negative slots skipped),
    /// queued like a kernel; `kernel` is the registry's choice for the op. Executors call
    /// it when the caches are theirs to change; `execute` of the op copies the caches to
    /// its outputs first ([`split_rotary_cache_into`]). The default is
    /// [`split_rotary_via_temporaries`]; a backend with a kernel that writes the caches
    /// directly overrides it.
    fn split_rotary_into_caches(&self, kernel: &str, op: &Op, io: RotaryCaches<'_>) -> Result<()> {
        split_rotary_via_temporaries(self, kernel, op, io)
    }

    /// Runs `kernel` (a name from the kernel registry) for `op`.
    fn execute(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()>;

    /// [`Backend::execute`] for a caller that has already inferred every output spec
    /// from the input specs with `op.infer` and sized the buffers for them, as the
    /// executor does for the whole graph once per run: a backend may skip inferring them
    /// again for each launch. The default runs [`Backend::execute`].
    fn execute_inferred(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        self.execute(kernel, op, inputs, outputs)
    }

    /// Runs `work`, the kernel launches of one plan run, where this backend launches
    /// best. The CPU backend runs it on one of its worker threads, so that each kernel's
    /// parallel loop starts from a worker (which joins in) instead of handing the loop
    /// to the pool and sleeping until it is done. The default runs it on the calling
    /// thread.
    fn run_launches(&self, work: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        work()
    }

    /// Copies a host tensor into the first `tensor.numel()` elements of `dst`, queued
    /// like a kernel (the host's copy of the data may be dropped when this returns), and
    /// sets `dst.scale` to the tensor's. The dtypes must match and `dst` must have room.
    /// A captured run's inputs are refreshed this way before each replay, at the
    /// addresses the capture recorded. The default uploads the tensor to a new buffer
    /// and copies that with [`Backend::copy_into`].
    fn write(&self, tensor: &Tensor, dst: &mut DeviceBuffer) -> Result<()> {
        let spec = TensorSpec::new(tensor.shape(), tensor.dtype());
        let staged = self.upload(tensor)?;
        self.copy_into(
            BufferRef {
                buffer: &staged,
                spec: &spec,
            },
            dst,
            0,
        )?;
        dst.scale = tensor.scale();
        Ok(())
    }

    /// The device address of `buffer`, where the backend has one. Two live buffers
    /// with the same address are the same allocation; a captured run recorded the
    /// addresses of the buffers it reads and writes. The default is `None` (no
    /// addresses: the backend cannot capture).
    fn buffer_address(&self, _buffer: &DeviceBuffer) -> Option<u64> {
        None
    }

    /// Records the launches `work` queues (the kernel launches of one plan run, with
    /// every buffer they use already allocated) instead of running them, so that
    /// [`CapturedRun::replay`] can queue them all again at once (a CUDA graph).
    /// Nothing `work` queues has run when this returns: replay the result once to run
    /// it. `Ok(None)`: this backend cannot capture now (no support, or profiling is
    /// on), and `work` was not called. `Err`: `work` failed or did something a
    /// capture cannot record (a wait for the device, a copy back to the host); the
    /// capture was abandoned, nothing ran, and the same launches can run normally.
    /// Buffers allocated while `work` runs belong to the captured run until it is
    /// dropped. The default cannot capture.
    fn capture(
        &self,
        _work: &mut (dyn FnMut() -> Result<()> + Send),
    ) -> Result<Option<Box<dyn CapturedRun>>> {
        Ok(None)
    }

    /// Waits until all queued work is done.
    fn synchronize(&self) -> Result<()>;

    /// Current memory statistics.
    fn memory_stats(&self) -> MemoryStats;

    /// Starts (`true`, clearing earlier records) or stops recording the time of every
    /// kernel [`Backend::execute`] runs. Returns whether this backend can profile.
    fn set_profiling(&self, _on: bool) -> Result<bool> {
        Ok(false)
    }

    /// Per-kernel totals recorded since profiling started, the most time first (waits
    /// for queued work). Empty when profiling never started.
    fn profile(&self) -> Result<Vec<KernelProfile>> {
        Ok(Vec::new())
    }

    /// Counters of this backend's own machinery (an XLA backend's compile cache hits,
    /// misses and sizes, say), as `(name, value)` pairs for display and metrics. The
    /// default has none.
    fn counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}

/// The backends available in this process, chosen at run time.
#[derive(Default, Clone)]
pub struct BackendRegistry {
    backends: Vec<Arc<dyn Backend>>,
}

impl std::fmt::Debug for BackendRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.backends.iter().map(|b| b.name()))
            .finish()
    }
}

impl BackendRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a backend; later registrations of the same name replace earlier ones.
    pub fn register(&mut self, backend: Arc<dyn Backend>) {
        self.backends.retain(|b| b.name() != backend.name());
        self.backends.push(backend);
    }

    /// Every registered backend, in registration order.
    pub fn all(&self) -> &[Arc<dyn Backend>] {
        &self.backends
    }

    /// A backend by name.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Backend>> {
        self.backends
            .iter()
            .find(|b| b.name() == name)
            .cloned()
            .ok_or_else(|| KptError::Backend {
                backend: name.to_string(),
                message: format!("not registered; available: {}", self.names().join(", ")),
            })
    }

    /// The first backend of a kind.
    pub fn by_kind(&self, kind: DeviceKind) -> Result<Arc<dyn Backend>> {
        self.backends
            .iter()
            .find(|b| b.kind() == kind)
            .cloned()
            .ok_or_else(|| KptError::Backend {
                backend: kind.to_string(),
                message: format!(
                    "no {kind} device found; available: {} (build with the matching cargo feature and check `kpt detect`)",
                    self.names().join(", ")
                ),
            })
    }

    /// The preferred backend: accelerators first (CUDA, ROCm, TPU), then the CPU.
    pub fn best(&self) -> Result<Arc<dyn Backend>> {
        [
            DeviceKind::Cuda,
            DeviceKind::Rocm,
            DeviceKind::Tpu,
            DeviceKind::Cpu,
        ]
        .into_iter()
        .find_map(|k| self.by_kind(k).ok())
        .ok_or_else(|| KptError::Backend {
            backend: "any".into(),
            message: "no backend registered".into(),
        })
    }

    /// Names of the registered backends.
    pub fn names(&self) -> Vec<String> {
        self.backends.iter().map(|b| b.name().to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(spec: &TensorSpec) -> DeviceBuffer {
        DeviceBuffer::new(spec.dtype, spec.numel(), Box::new(()))
    }

    #[test]
    fn output_specs_must_be_the_inferred_ones() {
        let x = TensorSpec::new(&[2, 3], DType::F32);
        let xb = buffer(&x);
        let inputs = [BufferRef {
            buffer: &xb,
            spec: &x,
        }];
        let check = |out: &TensorSpec| {
            let mut ob = buffer(out);
            let outputs = [BufferMut {
                buffer: &mut ob,
                spec: out,
            }];
            check_output_specs(&Op::Softmax, &inputs, &outputs)
        };
        assert!(check(&x).is_ok());
        let err = check(&TensorSpec::new(&[3, 2], DType::F32)).unwrap_err();
        assert!(matches!(err, KptError::Graph(_)), "{err}");
        assert!(
            err.to_string().contains("do not match the inferred"),
            "{err}"
        );
        assert!(check(&TensorSpec::new(&[2, 3], DType::BF16)).is_err());
        // Missing inputs are the op's own error.
        assert!(check_output_specs(&Op::Softmax, &[], &[]).is_err());
    }
}
