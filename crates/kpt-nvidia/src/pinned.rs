//! Page-locked host memory for reads that return before their copy is done
//! ([`Gpu::read_async`]): a copy into pageable memory waits for the stream, a copy into
//! page-locked memory is queued like a kernel, and an event tells when it landed.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaEvent};

use crate::gpu::{check_read, Gpu};
use crate::memory::DeviceBlock;
use crate::NvidiaError;

/// Smallest block allocated: a decode step's picked tokens fit many times over.
const MIN_BLOCK: usize = 4096;
/// Free blocks kept for reuse at most.
const MAX_FREE: usize = 16;

/// One page-locked host allocation.
struct PinnedBlock {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the block is plain host memory owned by this value; the driver calls on it
// bind the context first.
unsafe impl Send for PinnedBlock {}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        let freed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: allocated by `cuMemHostAlloc` and no copy into it is pending (a
            // read returns its block only after the copy's event).
            unsafe { result::free_host(self.ptr.cast()) }
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}

/// Free page-locked blocks, reused by later reads: allocating page-locked memory costs
/// far more than copying a few bytes.
#[derive(Default)]
pub(crate) struct PinnedPool {
    free: Mutex<Vec<PinnedBlock>>,
}

impl PinnedPool {
    /// A free block of at least `bytes`, or a new one (`ctx` must be current).
    fn take(&self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedBlock, NvidiaError> {
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = free.iter().position(|b| b.bytes >= bytes) {
                return Ok(free.swap_remove(i));
            }
        }
        let size = bytes.max(MIN_BLOCK).next_power_of_two();
        // SAFETY: the context is current; the block is only read after a copy wrote it.
        let ptr = unsafe { result::malloc_host(size, 0) }
            .map_err(|e| NvidiaError::driver("cuMemHostAlloc", e))?;
        Ok(PinnedBlock {
            ctx: Arc::clone(ctx),
            ptr: ptr.cast(),
            bytes: size,
        })
    }

    fn put(&self, block: PinnedBlock) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < MAX_FREE {
            free.push(block);
        }
    }
}

/// A device-to-host copy queued by [`Gpu::read_async`].
pub struct PendingRead {
    gpu: Arc<Gpu>,
    block: Option<PinnedBlock>,
    len: usize,
    done: CudaEvent,
}

impl std::fmt::Debug for PendingRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingRead")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl PendingRead {
    /// Waits for the copy (and the work queued before it) and returns the bytes.
    pub fn wait(mut self) -> Result<Vec<u8>, NvidiaError> {
        self.done
            .synchronize()
            .map_err(|e| NvidiaError::driver("cuEventSynchronize", e))?;
        let block = self
            .block
            .take()
            .ok_or_else(|| NvidiaError::Invalid("a read was waited for twice".into()))?;
        // SAFETY: the copy of `len <= block.bytes` bytes into the block is done.
        let out = unsafe { std::slice::from_raw_parts(block.ptr, self.len) }.to_vec();
        self.gpu.pinned().put(block);
        Ok(out)
    }
}

impl Drop for PendingRead {
    fn drop(&mut self) {
        // A read dropped unwaited: its block is reused only after the copy landed.
        if let Some(block) = self.block.take() {
            if self.done.synchronize().is_ok() {
                self.gpu.pinned().put(block);
            }
        }
    }
}

/// Queues a copy of the first `len` bytes of `src` into page-locked memory on `gpu`'s
/// stream, behind the work queued so far (see [`Gpu::read_async`]).
pub(crate) fn read_async(
    gpu: &Arc<Gpu>,
    src: &DeviceBlock,
    len: usize,
) -> Result<PendingRead, NvidiaError> {
    check_read(src, len)?;
    gpu.bind()?;
    let block = gpu.pinned().take(gpu.context(), len)?;
    let stream = gpu.stream();
    // SAFETY: the block holds at least `len` bytes and stays allocated until the copy's
    // event completed (`PendingRead::wait` or its drop); `src` holds `len` bytes.
    unsafe { sys::cuMemcpyDtoHAsync_v2(block.ptr.cast(), src.ptr(), len, stream.cu_stream()) }
        .result()
        .map_err(|e| NvidiaError::driver("cuMemcpyDtoHAsync", e))?;
    let done = gpu
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(|e| NvidiaError::driver("cuEventCreate", e))?;
    done.record(stream)
        .map_err(|e| NvidiaError::driver("cuEventRecord", e))?;
    Ok(PendingRead {
        gpu: Arc::clone(gpu),
        block: Some(block),
        len,
        done,
    })
}
