//! The caching device allocator over the CUDA driver: kpt-core's shared allocator
//! ([`kpt_core::memory`]: size-class pools, stream-ordered reuse, statistics, OOM
//! recovery, graph-private pools) with [`NvidiaError`] as its error type; `gpu.rs`'s
//! `DriverMemory` is its [`RawMemory`] (`cuMemAlloc`, `cuMemFree`, `cuMemGetInfo`).

use kpt_core::DType;

pub use kpt_core::memory::{size_class, MemoryStatistics, RawMemory};

use crate::NvidiaError;

/// A size-class caching allocator over one CUDA device.
pub type CachingAllocator = kpt_core::memory::CachingAllocator<NvidiaError>;
/// A live device allocation; goes back to its pool when dropped.
pub type DeviceBlock = kpt_core::memory::DeviceBlock<NvidiaError>;
/// The blocks of a capture's private pool; returned to the shared pool when dropped.
pub type PrivateBlocks = kpt_core::memory::PrivateBlocks<NvidiaError>;

/// Bytes a tensor of `shape` and `dtype` takes on the device, size class included.
pub fn estimate_bytes(shape: &[usize], dtype: DType) -> Result<usize, NvidiaError> {
    kpt_core::memory::estimate_bytes(shape, dtype).map_err(NvidiaError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_bytes_is_the_shared_one_in_nvidia_errors() {
        assert_eq!(estimate_bytes(&[1024, 1024], DType::BF16).unwrap(), 2 << 20);
        match estimate_bytes(&[usize::MAX, 2], DType::F32) {
            Err(NvidiaError::Invalid(m)) => assert!(m.contains("overflows"), "{m}"),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }
}
