//! Device memory of one ROCm device through kpt-core's shared caching allocator
//! ([`kpt_core::memory`]), the one kpt-nvidia uses: [`HipMemory`] is its [`RawMemory`]
//! (`hipMalloc`, `hipFree`, `hipMemGetInfo`, `hipStreamSynchronize`).

use kpt_core::memory::RawMemory;

use crate::runtime::{Handle, HipRuntime};
use crate::AmdError;

/// A size-class caching allocator over one ROCm device.
pub type CachingAllocator = kpt_core::memory::CachingAllocator<AmdError>;
/// A live allocation on a ROCm device; goes back to its pool when dropped.
pub type DeviceBlock = kpt_core::memory::DeviceBlock<AmdError>;

/// Memory straight from the HIP runtime for device `device`, whose work all goes to
/// `stream`.
#[derive(Debug)]
pub struct HipMemory {
    pub(crate) runtime: &'static HipRuntime,
    pub(crate) device: i32,
    pub(crate) stream: Handle,
}

impl RawMemory for HipMemory {
    type Error = AmdError;

    fn alloc(&self, bytes: usize) -> Result<Option<u64>, AmdError> {
        self.runtime.set_device(self.device)?;
        self.runtime.malloc(bytes)
    }

    fn free(&self, ptr: u64) -> Result<(), AmdError> {
        self.runtime.set_device(self.device)?;
        // SAFETY: the pool hands back only addresses `alloc` returned, after draining
        // the stream that used them.
        unsafe { self.runtime.free(ptr) }
    }

    fn free_bytes(&self) -> Result<u64, AmdError> {
        self.runtime.set_device(self.device)?;
        self.runtime.mem_get_info().map(|(free, _)| free)
    }

    fn drain(&self) -> Result<(), AmdError> {
        self.runtime.stream_synchronize(self.stream)
    }
}
