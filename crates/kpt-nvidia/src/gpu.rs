//! One CUDA device in use: its context, the stream all work goes to, the caching
//! allocator and the kernels loaded from `kpt_kernels::artifacts`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaStream,
};
use cudarc::nvrtc::Ptx;
use kpt_kernels::artifacts::{self, Artifact, EntryPoint, Format};

use crate::device::{self, GpuProperties};
use crate::memory::{CachingAllocator, DeviceBlock, PrivateBlocks, RawMemory};
use crate::pinned::{self, PendingRead, PinnedPool};
use crate::NvidiaError;

/// Device memory straight from the driver.
struct DriverMemory {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl RawMemory for DriverMemory {
    type Error = NvidiaError;

    fn alloc(&self, bytes: usize) -> Result<Option<u64>, NvidiaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| NvidiaError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: the context is current; the memory is only handed out as raw bytes.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(Some(ptr)),
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Ok(None),
            Err(e) => Err(NvidiaError::driver("cuMemAlloc", e)),
        }
    }

    fn free(&self, ptr: u64) -> Result<(), NvidiaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| NvidiaError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: `ptr` came from `cuMemAlloc` of this context and is no longer in use
        // (the pool drains the stream before releasing).
        unsafe { result::free_sync(ptr) }.map_err(|e| NvidiaError::driver("cuMemFree", e))
    }

    fn free_bytes(&self) -> Result<u64, NvidiaError> {
        self.ctx
            .mem_get_info()
            .map(|(free, _)| free as u64)
            .map_err(|e| NvidiaError::driver("cuMemGetInfo", e))
    }

    fn drain(&self) -> Result<(), NvidiaError> {
        self.stream
            .synchronize()
            .map_err(|e| NvidiaError::driver("cuStreamSynchronize", e))
    }
}

/// The loaded functions of one kernel, with their launch metadata, by entry point.
type EntryPoints = HashMap<String, LoadedFunction>;

/// One entry point of a loaded kernel module, ready to launch with
/// [`Gpu::launch`].
#[derive(Debug, Clone)]
pub struct LoadedFunction {
    /// The driver's function.
    pub function: CudaFunction,
    /// Block size, shared memory and grid of the entry point (its manifest line).
    pub meta: EntryPoint,
    /// Whether its image waits for the previous kernel itself
    /// ([`Artifact::waits_for_producer`]): then [`Gpu::launch`] uses programmatic stream
    /// serialization where [`Gpu::programmatic_launches`] is on.
    pub waits_for_producer: bool,
}

/// The grid of a launch: `blocks` blocks in thread-block clusters of `cluster`
/// consecutive blocks (1: no clusters; more needs sm_90).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchGrid {
    /// Blocks in the grid (a multiple of `cluster`).
    pub blocks: u32,
    /// Blocks per cluster.
    pub cluster: u32,
}

impl From<u32> for LaunchGrid {
    fn from(blocks: u32) -> Self {
        Self { blocks, cluster: 1 }
    }
}

/// Whether kernels that wait for their producer are launched with programmatic stream
/// serialization on a device of compute capability `major`: from sm_90 (Hopper) on,
/// unless `KPT_CUDA_PDL=0`.
fn programmatic_launches(major: u32) -> bool {
    major >= 9 && switched_on("KPT_CUDA_PDL")
}

/// A performance switch that is on unless the environment sets `name=0` (for A/B runs in
/// one build).
fn switched_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// A performance switch that is off unless the environment sets `name=1` (features still
/// being measured).
fn opted_in(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// A check that a launcher would make on the host after its kernel (a flag the kernel
/// sets on bad input), deferred to after each replay of a captured graph.
type DeferredCheck = (DeviceBlock, String);

/// The work of one capture on [`Gpu`]'s stream, instantiated: replay it with
/// [`GpuGraph::launch`]. It owns the memory its launches allocated while they were
/// recorded (returned to the allocator after the graph is destroyed) and the checks they
/// deferred.
pub struct GpuGraph {
    // Fields drop in order: the graph before the memory it uses.
    graph: CudaGraph,
    checks: Vec<DeferredCheck>,
    _memory: PrivateBlocks,
}

// SAFETY: the graph handles are used only through `&mut self` (launch) or `&self` after
// the launches were queued (the checks read device memory through the `Gpu`), so no two
// threads touch the graph at once; the driver calls on them may come from any thread
// where the context is current (`CudaGraph::launch` binds it).
unsafe impl Send for GpuGraph {}

impl std::fmt::Debug for GpuGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuGraph")
            .field("checks", &self.checks.len())
            .field("memory", &self._memory)
            .finish_non_exhaustive()
    }
}

impl GpuGraph {
    /// Queues the whole graph on the stream it was captured on.
    pub fn launch(&mut self) -> Result<(), NvidiaError> {
        self.graph
            .launch()
            .map_err(|e| NvidiaError::driver("cuGraphLaunch", e))
    }

    /// Runs the deferred checks of the last launch on `gpu` (waits for it).
    pub fn check(&self, gpu: &Gpu) -> Result<(), NvidiaError> {
        for (flag, message) in &self.checks {
            if gpu.read(flag, 4)? != [0; 4] {
                return Err(NvidiaError::Invalid(message.clone()));
            }
        }
        Ok(())
    }
}

/// That the first `len` bytes of `src` exist, for a read back to the host.
pub(crate) fn check_read(src: &DeviceBlock, len: usize) -> Result<(), NvidiaError> {
    if len > src.bytes() {
        return Err(NvidiaError::Invalid(format!(
            "cannot read {len} bytes from a {}-byte device block",
            src.bytes()
        )));
    }
    Ok(())
}

/// A CUDA device ready for work.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    props: GpuProperties,
    memory: CachingAllocator,
    /// Page-locked host blocks for [`Gpu::read_async`].
    pinned: PinnedPool,
    modules: Mutex<HashMap<&'static str, (&'static Artifact, Arc<CudaModule>)>>,
    /// Loaded functions by kernel, then entry point (Triton specializations of one
    /// kernel source share their entry point's name).
    functions: Mutex<HashMap<&'static str, EntryPoints>>,
    /// While a capture records: the checks its launchers deferred.
    capture: Mutex<Option<Vec<DeferredCheck>>>,
    /// Whether kernels whose image waits for its producer get programmatic launches
    /// ([`Gpu::programmatic_launches`]).
    programmatic: AtomicBool,
    /// Most blocks of a persistent attention grid; 0: the SM count
    /// ([`Gpu::set_attention_blocks`]).
    attention_blocks: AtomicUsize,
    /// Whether split-KV attention may merge its runs in thread-block clusters
    /// ([`Gpu::cluster_attention`]).
    cluster_attention: AtomicBool,
    /// Whether Hopper attention shares K/V tiles between the blocks of a cluster
    /// ([`Gpu::kv_multicast`]).
    kv_multicast: AtomicBool,
    /// [`Gpu::max_active_clusters`] by entry point and cluster size.
    active_clusters: Mutex<HashMap<(String, u32), usize>>,
    /// Whether the attention backward runs its wgmma kernels on sm_90a
    /// ([`Gpu::set_wgmma_backward`]).
    wgmma_backward: AtomicBool,
    /// Whether GEMVs read constant weights before waiting for their producer
    /// ([`Gpu::gemv_preload`]).
    gemv_preload: bool,
    /// Whether one-row 16-bit GEMVs stage the activations ([`Gpu::gemv_stage`]).
    gemv_stage: bool,
    /// Whether variable-length attention runs in one launch ([`Gpu::varlen_launch`]).
    varlen_launch: bool,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.props.name)
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens device `ordinal` (its primary context) and creates a stream on it.
    pub fn new(ordinal: usize) -> Result<Self, NvidiaError> {
        let all = device::devices()?;
        let props = all.get(ordinal).cloned().ok_or_else(|| {
            NvidiaError::Invalid(format!(
                "no CUDA device {ordinal} (this machine has {})",
                all.len()
            ))
        })?;
        let ctx = CudaContext::new(ordinal).map_err(|e| NvidiaError::driver("cuCtxCreate", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| NvidiaError::driver("cuStreamCreate", e))?;
        let memory = CachingAllocator::new(Box::new(DriverMemory {
            ctx: Arc::clone(&ctx),
            stream: Arc::clone(&stream),
        }));
        let programmatic = programmatic_launches(props.compute_capability.0);
        let clusters = props.compute_capability.0 >= 9 && switched_on("KPT_CUDA_CLUSTER_ATTENTION");
        let multicast = props.compute_capability.0 >= 9 && opted_in("KPT_CUDA_KV_MULTICAST");
        tracing::info!(
            device = %props.name,
            arch = %props.arch(),
            programmatic_dependent_launch = programmatic,
            "CUDA device opened"
        );
        Ok(Self {
            ctx,
            stream,
            props,
            memory,
            pinned: PinnedPool::default(),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            capture: Mutex::new(None),
            programmatic: AtomicBool::new(programmatic),
            attention_blocks: AtomicUsize::new(0),
            cluster_attention: AtomicBool::new(clusters),
            kv_multicast: AtomicBool::new(multicast),
            active_clusters: Mutex::new(HashMap::new()),
            wgmma_backward: AtomicBool::new(true),
            gemv_preload: switched_on("KPT_CUDA_GEMV_PRELOAD"),
            gemv_stage: switched_on("KPT_CUDA_GEMV_STAGE"),
            varlen_launch: switched_on("KPT_CUDA_VARLEN_LAUNCH"),
        })
    }

    /// Most blocks of the Hopper attention kernel's persistent grid: by default (`None`)
    /// one per SM. Fewer make each block walk more query tiles (tests use that to reach
    /// many tiles per block with small shapes); at least as many as a call has tiles give
    /// it a block per tile. The result does not depend on it.
    pub fn set_attention_blocks(&self, blocks: Option<usize>) {
        self.attention_blocks
            .store(blocks.map_or(0, |b| b.max(1)), Ordering::Relaxed);
    }

    /// The persistent attention grid's most blocks ([`Gpu::set_attention_blocks`]).
    pub(crate) fn attention_blocks(&self) -> usize {
        match self.attention_blocks.load(Ordering::Relaxed) {
            0 => self.props.sm_count.max(1) as usize,
            b => b,
        }
    }

    /// Whether kernels whose image waits for the previous kernel
    /// ([`LoadedFunction::waits_for_producer`]) are launched with programmatic stream
    /// serialization (programmatic dependent launch): on sm_90 and newer unless
    /// `KPT_CUDA_PDL=0`, or as last set by [`Gpu::set_programmatic_launches`].
    pub fn programmatic_launches(&self) -> bool {
        self.programmatic.load(Ordering::Relaxed)
    }

    /// Turns programmatic launches on or off for the launches that follow (a captured
    /// graph keeps the launches it recorded). On a device older than sm_90 they stay off.
    pub fn set_programmatic_launches(&self, on: bool) {
        let on = on && self.props.compute_capability.0 >= 9;
        self.programmatic.store(on, Ordering::Relaxed);
    }

    /// Whether split-KV attention over a short cache (decode) merges its runs inside
    /// thread-block clusters instead of a combine launch: on sm_90 and newer unless
    /// `KPT_CUDA_CLUSTER_ATTENTION=0`, or as last set by [`Gpu::set_cluster_attention`].
    pub fn cluster_attention(&self) -> bool {
        self.cluster_attention.load(Ordering::Relaxed)
    }

    /// Turns [`Gpu::cluster_attention`] on or off for the calls that follow; on a device
    /// older than sm_90 it stays off.
    pub fn set_cluster_attention(&self, on: bool) {
        let on = on && self.props.compute_capability.0 >= 9;
        self.cluster_attention.store(on, Ordering::Relaxed);
    }

    /// Whether prefill attention without a causal mask or an additive mask runs on Hopper
    /// in clusters of two blocks on neighbouring query tiles that copy each K/V tile once
    /// for both (TMA multicast): off unless `KPT_CUDA_KV_MULTICAST=1` (on sm_90 and
    /// newer), or as last set by [`Gpu::set_kv_multicast`]; measured no faster than the
    /// blocks on their own so far (docs/reports/attention-h200-notes.md). The result does
    /// not depend on it.
    pub fn kv_multicast(&self) -> bool {
        self.kv_multicast.load(Ordering::Relaxed)
    }

    /// Turns [`Gpu::kv_multicast`] on or off for the calls that follow; on a device older
    /// than sm_90 it stays off.
    pub fn set_kv_multicast(&self, on: bool) {
        let on = on && self.props.compute_capability.0 >= 9;
        self.kv_multicast.store(on, Ordering::Relaxed);
    }

    /// Clusters of `cluster` blocks of `entry` (of kernel source `kernel`) that the device
    /// runs at once (`cuOccupancyMaxActiveClusters`: a cluster's blocks share a GPC, so
    /// fewer than the SM count over the cluster size may fit, and 0 where none does);
    /// cached per entry point.
    pub(crate) fn max_active_clusters(
        &self,
        kernel: &'static str,
        entry: &str,
        cluster: u32,
    ) -> Result<usize, NvidiaError> {
        let key = (entry.to_string(), cluster);
        if let Some(&n) = self
            .active_clusters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(n);
        }
        let f = self.function(kernel, entry)?;
        self.bind()?;
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            // SAFETY: an all-zero attribute value is valid (a union of plain integers).
            value: unsafe { std::mem::zeroed() },
        };
        attribute.value.clusterDim.x = cluster;
        attribute.value.clusterDim.y = 1;
        attribute.value.clusterDim.z = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: f.meta.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: f.meta.shared_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        let mut clusters: std::ffi::c_int = 0;
        // SAFETY: `config` and its attribute live across the call; the driver writes one int.
        unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut clusters, f.function.cu_function(), &config)
        }
        .result()
        .map_err(|e| NvidiaError::driver("cuOccupancyMaxActiveClusters", e))?;
        let n = usize::try_from(clusters).unwrap_or(0);
        self.active_clusters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, n);
        Ok(n)
    }

    /// Whether the attention backward runs its wgmma kernels where the sm_90a cubin is
    /// loaded (the default), or the mma.sync kernels everywhere (tests reach those on
    /// Hopper this way). The result does not depend on it beyond rounding.
    pub fn set_wgmma_backward(&self, on: bool) {
        self.wgmma_backward.store(on, Ordering::Relaxed);
    }

    /// [`Gpu::set_wgmma_backward`]'s setting.
    pub(crate) fn wgmma_backward(&self) -> bool {
        self.wgmma_backward.load(Ordering::Relaxed)
    }

    /// Whether the GEMV kernel issues its first loads of weights that no kernel writes
    /// (a plan's parameters) before it waits for the kernel ahead of it: unless
    /// `KPT_CUDA_GEMV_PRELOAD=0`.
    pub fn gemv_preload(&self) -> bool {
        self.gemv_preload
    }

    /// Whether bf16 / f16 GEMVs of one row (K <= 8192) convert the activation row to f32
    /// in shared memory once per block (`kpt_gemv_staged_*_m1`): unless
    /// `KPT_CUDA_GEMV_STAGE=0`.
    pub fn gemv_stage(&self) -> bool {
        self.gemv_stage
    }

    /// Whether variable-length attention batches on Hopper run in one launch that reads
    /// the offsets on the device (`Gpu::flash_attention_varlen`): unless
    /// `KPT_CUDA_VARLEN_LAUNCH=0`, which runs one launch per sequence after a host read of
    /// the offsets, as other GPUs do.
    pub fn varlen_launch(&self) -> bool {
        self.varlen_launch
    }

    /// What the device is.
    pub fn properties(&self) -> &GpuProperties {
        &self.props
    }

    /// The stream every operation of this device is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The page-locked host blocks of [`Gpu::read_async`].
    pub(crate) fn pinned(&self) -> &PinnedPool {
        &self.pinned
    }

    /// The device's caching allocator.
    pub fn memory(&self) -> &CachingAllocator {
        &self.memory
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), NvidiaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| NvidiaError::driver("cuCtxSetCurrent", e))
    }

    /// A block of `bytes` (contents undefined).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBlock, NvidiaError> {
        self.memory.allocate(bytes)
    }

    /// A block of `bytes` set to zero.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBlock, NvidiaError> {
        let block = self.alloc(bytes)?;
        self.bind()?;
        // SAFETY: the block holds at least `bytes`.
        unsafe { result::memset_d8_async(block.ptr(), 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| NvidiaError::driver("cuMemsetD8Async", e))?;
        Ok(block)
    }

    /// Copies `data` to the start of `dst`.
    pub fn write(&self, dst: &DeviceBlock, data: &[u8]) -> Result<(), NvidiaError> {
        self.write_async(dst, data)?;
        self.synchronize()
    }

    /// Copies `data` to the start of `dst`, queued on the stream without waiting: the
    /// driver stages pageable host memory before the call returns, so `data` may be
    /// dropped at once.
    pub fn write_async(&self, dst: &DeviceBlock, data: &[u8]) -> Result<(), NvidiaError> {
        if data.len() > dst.bytes() {
            return Err(NvidiaError::Invalid(format!(
                "cannot copy {} bytes into a {}-byte device block",
                data.len(),
                dst.bytes()
            )));
        }
        self.bind()?;
        // SAFETY: the block holds `data.len()` bytes; a host-to-device copy from pageable
        // memory returns once the source was copied to a staging buffer.
        unsafe { result::memcpy_htod_async(dst.ptr(), data, self.stream.cu_stream()) }
            .map_err(|e| NvidiaError::driver("cuMemcpyHtoDAsync", e))
    }

    /// Starts recording the work queued on the stream into a graph (relaxed capture
    /// mode) instead of running it; the allocator keeps the blocks freed meanwhile for
    /// the graph. End it with [`Gpu::end_capture`], also when the recorded work failed.
    pub fn begin_capture(&self) -> Result<(), NvidiaError> {
        self.memory.begin_private()?;
        *self.capture.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
        let began = self
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| NvidiaError::driver("cuStreamBeginCapture", e));
        if began.is_err() {
            self.capture
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            drop(self.memory.end_private());
        }
        began
    }

    /// Ends the capture begun by [`Gpu::begin_capture`] and instantiates its graph. An
    /// error when the capture was invalidated (a launcher waited for the device, read a
    /// value back, or failed): nothing recorded ran, and its memory is free again.
    pub fn end_capture(&self) -> Result<GpuGraph, NvidiaError> {
        let checks = self
            .capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| NvidiaError::driver("cuStreamEndCapture", e));
        let memory = self.memory.end_private();
        match graph? {
            Some(graph) => Ok(GpuGraph {
                graph,
                checks,
                _memory: memory,
            }),
            None => Err(NvidiaError::Invalid("the capture recorded no graph".into())),
        }
    }

    /// Whether a capture is recording on the stream.
    pub fn capturing(&self) -> bool {
        self.capture
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Checks `flag` (4 bytes that the kernel just queued sets on bad input): reads it now
    /// (waiting for the kernel) and fails with `message` where it is set, or while a
    /// capture records keeps it to be checked after each replay instead.
    pub(crate) fn check_flag(&self, flag: DeviceBlock, message: String) -> Result<(), NvidiaError> {
        {
            let mut capture = self.capture.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(checks) = capture.as_mut() {
                checks.push((flag, message));
                return Ok(());
            }
        }
        if self.read(&flag, 4)? != [0; 4] {
            return Err(NvidiaError::Invalid(message));
        }
        Ok(())
    }

    /// A new block holding `data`.
    pub fn upload(&self, data: &[u8]) -> Result<DeviceBlock, NvidiaError> {
        let block = self.alloc(data.len())?;
        self.write(&block, data)?;
        Ok(block)
    }

    /// The first `len` bytes of `src`, after all queued work.
    pub fn read(&self, src: &DeviceBlock, len: usize) -> Result<Vec<u8>, NvidiaError> {
        check_read(src, len)?;
        let mut out = vec![0u8; len];
        self.bind()?;
        // SAFETY: the block holds `len` bytes; `out` outlives the copy (synchronized).
        unsafe { result::memcpy_dtoh_async(&mut out, src.ptr(), self.stream.cu_stream()) }
            .map_err(|e| NvidiaError::driver("cuMemcpyDtoHAsync", e))?;
        self.synchronize()?;
        Ok(out)
    }

    /// The first `len` bytes of `src` after the work queued so far, copied into
    /// page-locked memory without waiting: [`PendingRead::wait`] gives them, while work
    /// queued after this call may run on.
    pub fn read_async(
        self: &Arc<Self>,
        src: &DeviceBlock,
        len: usize,
    ) -> Result<PendingRead, NvidiaError> {
        pinned::read_async(self, src, len)
    }

    /// Copies `bytes` from `src` to `dst` on the stream.
    pub fn copy(&self, src: u64, dst: u64, bytes: usize) -> Result<(), NvidiaError> {
        self.bind()?;
        // SAFETY: callers pass addresses of blocks holding at least `bytes`.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| NvidiaError::driver("cuMemcpyDtoDAsync", e))
    }

    /// Copies `height` rows of `width` bytes from `src` (rows `src_pitch` bytes apart) to
    /// `dst` (rows `dst_pitch` apart) on the stream.
    pub fn copy_2d(
        &self,
        (src, src_pitch): (u64, usize),
        (dst, dst_pitch): (u64, usize),
        width: usize,
        height: usize,
    ) -> Result<(), NvidiaError> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        self.bind()?;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        // SAFETY: callers pass blocks holding `height` rows of `width` bytes at the given
        // pitches; the descriptor lives across the call (the driver copies it).
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream()) }
            .result()
            .map_err(|e| NvidiaError::driver("cuMemcpy2DAsync", e))
    }

    /// Starts (`true`) or stops recording for an external profiler attached to the
    /// process (`cuProfilerStart` / `cuProfilerStop`), so that Nsight Compute run with
    /// `--profile-from-start off` profiles only the work queued in between.
    pub fn external_profiler(&self, on: bool) -> Result<(), NvidiaError> {
        self.bind()?;
        // SAFETY: the context is current; both calls take no arguments.
        let (r, name) = match on {
            true => (unsafe { sys::cuProfilerStart() }, "cuProfilerStart"),
            false => (unsafe { sys::cuProfilerStop() }, "cuProfilerStop"),
        };
        r.result().map_err(|e| NvidiaError::driver(name, e))
    }

    /// Waits for all queued work; reports a failed kernel here.
    pub fn synchronize(&self) -> Result<(), NvidiaError> {
        self.stream
            .synchronize()
            .map_err(|e| NvidiaError::driver("cuStreamSynchronize", e))
    }

    /// Seconds per call of `f` (which queues work on this device's stream), measured
    /// with CUDA events around `calls` back-to-back calls after the queue drained.
    pub fn time_per_call(
        &self,
        calls: usize,
        mut f: impl FnMut() -> Result<(), NvidiaError>,
    ) -> Result<f64, NvidiaError> {
        self.synchronize()?;
        let start = self.record_event()?;
        for _ in 0..calls.max(1) {
            f()?;
        }
        let end = self.record_event()?;
        end.synchronize()
            .map_err(|e| NvidiaError::driver("cuEventSynchronize", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| NvidiaError::driver("cuEventElapsedTime", e))?;
        Ok(f64::from(ms) / 1e3 / calls.max(1) as f64)
    }

    /// A timing event recorded on the stream now (it completes when the work queued
    /// before it has run).
    pub fn record_event(&self) -> Result<CudaEvent, NvidiaError> {
        let event = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| NvidiaError::driver("cuEventCreate", e))?;
        event
            .record(&self.stream)
            .map_err(|e| NvidiaError::driver("cuEventRecord", e))?;
        Ok(event)
    }

    /// Entry point `entry` of kernel source `kernel`, loaded from the artifact that fits
    /// this device (exact cubin first, then PTX for the driver to JIT) on first use.
    pub fn function(&self, kernel: &str, entry: &str) -> Result<LoadedFunction, NvidiaError> {
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(kernel).and_then(|k| k.get(entry)) {
            return Ok(f.clone());
        }
        let (major, minor) = self.props.compute_capability;
        let candidates = artifacts::cuda_candidates(kernel, major, minor);
        let (artifact, module) = self.module(kernel, &candidates)?;
        let meta = *artifact
            .entry_points
            .iter()
            .find(|e| e.name == entry)
            .ok_or_else(|| {
                NvidiaError::Invalid(format!("kernel {kernel} has no entry point {entry}"))
            })?;
        let f = module
            .load_function(entry)
            .map_err(|e| NvidiaError::driver("cuModuleGetFunction", e))?;
        // Dynamic shared memory beyond the default 48 KiB must be asked for per function.
        if meta.shared_bytes > 48 * 1024 {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                meta.shared_bytes as i32,
            )
            .map_err(|e| NvidiaError::driver("cuFuncSetAttribute", e))?;
        }
        let loaded = LoadedFunction {
            function: f,
            meta,
            waits_for_producer: artifact.waits_for_producer(),
        };
        functions
            .entry(artifact.kernel)
            .or_default()
            .insert(entry.to_string(), loaded.clone());
        Ok(loaded)
    }

    /// Launches `f` on `grid` blocks (its manifest's block size and shared memory) on the
    /// stream, with programmatic stream serialization where `f` waits for its producer
    /// and [`Gpu::programmatic_launches`] is on: the kernel
    /// may then start before the previous kernel on the stream has finished, and waits
    /// for it in its prologue (`kpt::wait_for_producer`). Stream capture records that as
    /// a programmatic edge of the graph.
    ///
    /// # Safety
    /// `params` holds one pointer per parameter of the entry point, in order, each to a
    /// live value of the parameter's type and layout, and the device addresses among them
    /// are valid for what the kernel reads and writes.
    pub unsafe fn launch(
        &self,
        f: &LoadedFunction,
        grid: impl Into<LaunchGrid>,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), NvidiaError> {
        self.bind()?;
        let LaunchGrid { blocks, cluster } = grid.into();
        let (block, shared) = (f.meta.block, f.meta.shared_bytes);
        let programmatic = f.waits_for_producer && self.programmatic_launches();
        if cluster > 1 && !blocks.is_multiple_of(cluster) {
            return Err(NvidiaError::Invalid(format!(
                "{blocks} blocks do not form clusters of {cluster}"
            )));
        }
        if !programmatic && cluster <= 1 {
            // SAFETY: the caller's contract.
            return unsafe {
                result::launch_kernel(
                    f.function.cu_function(),
                    (blocks, 1, 1),
                    (block, 1, 1),
                    shared,
                    self.stream.cu_stream(),
                    params,
                )
            }
            .map_err(|e| NvidiaError::driver("cuLaunchKernel", e));
        }
        // Both attributes on the stack (this is every kernel launch); the launch passes
        // the serialization one, the cluster one, or both in that order.
        let attribute = |id| sys::CUlaunchAttribute {
            id,
            pad: [0; 4],
            // SAFETY: an all-zero attribute value is valid (a union of plain integers).
            value: unsafe { std::mem::zeroed() },
        };
        let mut attributes = [
            attribute(
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            ),
            attribute(sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
        ];
        attributes[0].value.programmaticStreamSerializationAllowed = 1;
        attributes[1].value.clusterDim.x = cluster;
        attributes[1].value.clusterDim.y = 1;
        attributes[1].value.clusterDim.z = 1;
        let attributes = match (programmatic, cluster > 1) {
            (true, true) => &mut attributes[..],
            (true, false) => &mut attributes[..1],
            (false, _) => &mut attributes[1..],
        };
        let config = sys::CUlaunchConfig {
            gridDimX: blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: attributes.as_mut_ptr(),
            numAttrs: attributes.len() as u32,
        };
        // SAFETY: the caller's contract for `params`; `config` and `attributes` live
        // across the call (the driver copies them).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| NvidiaError::driver("cuLaunchKernelEx", e))
    }

    /// The target of the image `kernel` runs from (`sm_90a`, `compute_80`, ...): the
    /// cubin for this device, or PTX that the driver compiled; loads its module if needed.
    pub(crate) fn loaded_target(&self, kernel: &str) -> Result<&'static str, NvidiaError> {
        // Asked on every attention call: a loaded module answers without listing the
        // candidates again.
        if let Some((a, _)) = self
            .modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(kernel)
        {
            return Ok(a.target);
        }
        let (major, minor) = self.props.compute_capability;
        let candidates = artifacts::cuda_candidates(kernel, major, minor);
        let (artifact, _) = self.module(kernel, &candidates)?;
        Ok(artifact.target)
    }

    /// The loaded module of `kernel`: cached, else the first of `candidates` that the
    /// driver accepts (a refused cubin or PTX is logged and the next one tried).
    fn module(
        &self,
        kernel: &str,
        candidates: &[&'static Artifact],
    ) -> Result<(&'static Artifact, Arc<CudaModule>), NvidiaError> {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((a, m)) = modules.get(kernel) {
            return Ok((a, Arc::clone(m)));
        }
        let mut last = None;
        for &artifact in candidates {
            let image = match artifact.format {
                Format::Cubin => Ptx::from_binary(artifact.bytes.to_vec()),
                Format::Ptx => Ptx::from_src(String::from_utf8_lossy(artifact.bytes).into_owned()),
                // `cuda_candidates` never lists AMD code objects.
                Format::Hsaco => continue,
            };
            match self.ctx.load_module(image) {
                Ok(m) => {
                    tracing::info!(
                        kernel,
                        target = artifact.target,
                        format = ?artifact.format,
                        "loaded CUDA module"
                    );
                    modules.insert(artifact.kernel, (artifact, Arc::clone(&m)));
                    return Ok((artifact, m));
                }
                Err(e) => {
                    tracing::warn!(
                        kernel,
                        target = artifact.target,
                        error = %e,
                        "the driver refused this CUDA image; trying the next"
                    );
                    last = Some(e);
                }
            }
        }
        Err(match last {
            Some(e) => NvidiaError::driver("cuModuleLoadData", e),
            None => NvidiaError::NoKernel {
                kernel: kernel.into(),
                arch: self.props.arch(),
            },
        })
    }
}
