//! The caching device allocator every GPU backend uses (kpt-nvidia over the CUDA driver,
//! kpt-amd over the HIP runtime): one implementation of size-class pools, statistics,
//! [`estimate_bytes`], [`CachingAllocator::check_memory_available`] and the
//! out-of-memory protocol, over a backend's [`RawMemory`].
//!
//! Device allocation and release are slow and synchronize the device, so blocks are kept
//! in size-class pools and reused. Every block is used on the backend's one stream, so a
//! freed block can serve the next allocation at once: work queued later on the stream
//! runs after the work that used it (stream-ordered reuse). When the device runs out of
//! memory the cache is released (after the stream drains) and the allocation retried; if
//! it still fails the caller gets [`MemoryError::OutOfMemory`] with the numbers, in the
//! backend's error type.
//!
//! While a graph is being captured ([`CachingAllocator::begin_private`]) every block
//! freed goes to a private pool that serves that capture's later allocations and then
//! belongs to the captured graph ([`PrivateBlocks`]): the graph's launches keep using
//! those addresses on every replay, so no other allocation may get them until the graph
//! is dropped, as in PyTorch's graph-private memory pools.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::DType;

/// Blocks up to this size are rounded to 512 bytes; larger ones to a quarter of their
/// power of two (at most 25 % unused).
const SMALL_LIMIT: usize = 1 << 20;
const SMALL_STEP: usize = 512;

/// The size class (bytes actually reserved) of a request of `bytes`.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes <= SMALL_LIMIT {
        return bytes.div_ceil(SMALL_STEP) * SMALL_STEP;
    }
    let step = (1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 4;
    bytes.div_ceil(step) * step
}

/// Bytes a tensor of `shape` and `dtype` takes on the device, size class included.
pub fn estimate_bytes(shape: &[usize], dtype: DType) -> Result<usize, MemoryError> {
    shape
        .iter()
        .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
        .filter(|&b| b <= isize::MAX as usize)
        .map(size_class)
        .ok_or_else(|| MemoryError::Overflow {
            dtype,
            shape: shape.to_vec(),
        })
}

/// `1.50 GiB`-style size for messages.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// The message of an allocation the device cannot hold even after the cache was
/// released (the allocator's error and the backends' own say the same).
pub fn out_of_memory_message(requested: u64, free: u64, reserved: u64) -> String {
    format!(
        "out of GPU memory: asked for {} but only {} are free on the device \
         ({} reserved by kpt, cached blocks already released)",
        format_bytes(requested),
        format_bytes(free),
        format_bytes(reserved)
    )
}

/// What the allocator itself can fail with; a backend's error type converts it
/// ([`DeviceError`]) so that callers see one error type per backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The device could not hold an allocation even after the cache was released.
    #[error("{}", out_of_memory_message(*requested, *free, *reserved))]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the device reports free.
        free: u64,
        /// Bytes the allocator holds from the device.
        reserved: u64,
    },
    /// [`CachingAllocator::begin_private`] while a capture is already recording.
    #[error("a capture is already recording on this device")]
    CaptureActive,
    /// A tensor whose size in bytes does not fit in memory addresses.
    #[error("a {dtype} tensor of shape {shape:?} overflows")]
    Overflow {
        /// Its dtype.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
    },
}

/// A backend's error type, as the allocator needs it: it takes a [`MemoryError`] and
/// prints (implemented for every such type).
pub trait DeviceError:
    From<MemoryError> + std::fmt::Display + std::fmt::Debug + Send + Sync + 'static
{
}

impl<E> DeviceError for E where
    E: From<MemoryError> + std::fmt::Display + std::fmt::Debug + Send + Sync + 'static
{
}

/// Where the pool gets memory from: a device driver, or a test double.
pub trait RawMemory: Send + Sync + 'static {
    /// The backend's error type.
    type Error: DeviceError;
    /// A new allocation of `bytes`, `None` when the device is out of memory.
    fn alloc(&self, bytes: usize) -> Result<Option<u64>, Self::Error>;
    /// Returns an allocation to the device.
    fn free(&self, ptr: u64) -> Result<(), Self::Error>;
    /// Bytes the device has free.
    fn free_bytes(&self) -> Result<u64, Self::Error>;
    /// Waits until no queued work can still use a block.
    fn drain(&self) -> Result<(), Self::Error>;
}

/// Allocator statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStatistics {
    /// Bytes in live blocks (size classes).
    pub allocated_bytes: u64,
    /// Bytes the live blocks were asked for.
    pub requested_bytes: u64,
    /// Bytes held from the driver (live + cached).
    pub reserved_bytes: u64,
    /// Highest `allocated_bytes` seen.
    pub peak_allocated_bytes: u64,
    /// Highest `reserved_bytes` seen.
    pub peak_reserved_bytes: u64,
    /// Allocations served.
    pub allocations: u64,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Times the cache was released to satisfy an allocation.
    pub cache_flushes: u64,
}

impl MemoryStatistics {
    /// Bytes held but not asked for (cached blocks and size-class rounding), as a
    /// fraction of the reserved bytes.
    pub fn fragmentation(&self) -> f64 {
        if self.reserved_bytes == 0 {
            0.0
        } else {
            (self.reserved_bytes - self.requested_bytes) as f64 / self.reserved_bytes as f64
        }
    }

    /// Bytes in cached (free) blocks.
    pub fn cached_bytes(&self) -> u64 {
        self.reserved_bytes - self.allocated_bytes
    }
}

struct Pool {
    /// Size class -> cached block addresses.
    free: BTreeMap<usize, Vec<u64>>,
    /// While a capture records: the blocks freed since it began, by size class.
    private: Option<BTreeMap<usize, Vec<u64>>>,
    stats: MemoryStatistics,
}

struct Shared<E: DeviceError> {
    raw: Box<dyn RawMemory<Error = E>>,
    pool: Mutex<Pool>,
}

impl<E: DeviceError> Shared<E> {
    fn pool(&self) -> MutexGuard<'_, Pool> {
        // A panic while holding the lock cannot leave the pool inconsistent (every
        // update is a single assignment), so a poisoned lock is still usable.
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns every cached block to the driver.
    fn release_cached(&self, pool: &mut Pool) -> Result<u64, E> {
        self.raw.drain()?;
        let mut released = 0u64;
        for (class, ptrs) in std::mem::take(&mut pool.free) {
            for ptr in ptrs {
                self.raw.free(ptr)?;
                released += class as u64;
            }
        }
        pool.stats.reserved_bytes -= released;
        Ok(released)
    }
}

impl<E: DeviceError> Drop for Shared<E> {
    fn drop(&mut self) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = self.release_cached(&mut pool) {
            tracing::warn!(error = %e, "could not release cached GPU memory");
        }
    }
}

/// A size-class caching allocator over one device, failing with the backend's error `E`.
pub struct CachingAllocator<E: DeviceError> {
    shared: Arc<Shared<E>>,
}

impl<E: DeviceError> Clone for CachingAllocator<E> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<E: DeviceError> std::fmt::Debug for CachingAllocator<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("stats", &self.statistics())
            .finish()
    }
}

impl<E: DeviceError> CachingAllocator<E> {
    /// An allocator over `raw`, with an empty cache.
    pub fn new(raw: Box<dyn RawMemory<Error = E>>) -> Self {
        Self {
            shared: Arc::new(Shared {
                raw,
                pool: Mutex::new(Pool {
                    free: BTreeMap::new(),
                    private: None,
                    stats: MemoryStatistics::default(),
                }),
            }),
        }
    }

    /// A block of at least `bytes` (contents undefined).
    pub fn allocate(&self, bytes: usize) -> Result<DeviceBlock<E>, E> {
        let class = size_class(bytes);
        let shared = &self.shared;
        let mut pool = shared.pool();
        pool.stats.allocations += 1;
        let private = pool
            .private
            .as_mut()
            .and_then(|p| p.get_mut(&class))
            .and_then(Vec::pop);
        let cached = private.or_else(|| pool.free.get_mut(&class).and_then(Vec::pop));
        let ptr = match cached {
            Some(ptr) => {
                pool.stats.cache_hits += 1;
                ptr
            }
            None => {
                let ptr = match shared.raw.alloc(class)? {
                    Some(ptr) => ptr,
                    None => {
                        let released = shared.release_cached(&mut pool)?;
                        pool.stats.cache_flushes += 1;
                        tracing::warn!(
                            requested = class,
                            released,
                            "GPU allocation failed; released the cache and retrying"
                        );
                        match shared.raw.alloc(class)? {
                            Some(ptr) => ptr,
                            None => {
                                return Err(MemoryError::OutOfMemory {
                                    requested: bytes as u64,
                                    free: shared.raw.free_bytes()?,
                                    reserved: pool.stats.reserved_bytes,
                                }
                                .into())
                            }
                        }
                    }
                };
                let s = &mut pool.stats;
                s.reserved_bytes += class as u64;
                s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
                ptr
            }
        };
        let s = &mut pool.stats;
        s.allocated_bytes += class as u64;
        s.requested_bytes += bytes as u64;
        s.peak_allocated_bytes = s.peak_allocated_bytes.max(s.allocated_bytes);
        Ok(DeviceBlock {
            ptr,
            class,
            requested: bytes,
            owner: Arc::clone(shared),
        })
    }

    /// Fails with [`MemoryError::OutOfMemory`] unless `bytes` more can be allocated
    /// now (from the device's free memory plus the cache).
    pub fn check_memory_available(&self, bytes: usize) -> Result<(), E> {
        let free = self.shared.raw.free_bytes()?;
        let stats = self.statistics();
        let need = size_class(bytes) as u64;
        if need <= free + stats.cached_bytes() {
            Ok(())
        } else {
            Err(MemoryError::OutOfMemory {
                requested: bytes as u64,
                free,
                reserved: stats.reserved_bytes,
            }
            .into())
        }
    }

    /// Returns every cached block to the driver; returns the bytes released.
    pub fn empty_cache(&self) -> Result<u64, E> {
        let mut pool = self.shared.pool();
        self.shared.release_cached(&mut pool)
    }

    /// Starts a private pool for a capture: until [`CachingAllocator::end_private`],
    /// every block freed is kept for the capture (and serves its later allocations of
    /// the same size class) instead of returning to the shared pool.
    pub fn begin_private(&self) -> Result<(), E> {
        let mut pool = self.shared.pool();
        if pool.private.is_some() {
            return Err(MemoryError::CaptureActive.into());
        }
        pool.private = Some(BTreeMap::new());
        Ok(())
    }

    /// Ends the private pool: its blocks, which the captured launches may use, go back
    /// to the shared pool when the returned holder is dropped.
    pub fn end_private(&self) -> PrivateBlocks<E> {
        let blocks = self.shared.pool().private.take().unwrap_or_default();
        PrivateBlocks {
            blocks,
            owner: Arc::clone(&self.shared),
        }
    }

    /// Current statistics.
    pub fn statistics(&self) -> MemoryStatistics {
        self.shared.pool().stats
    }

    /// Bytes the device has free (outside kpt's cache).
    pub fn device_free_bytes(&self) -> Result<u64, E> {
        self.shared.raw.free_bytes()
    }
}

/// A live device allocation; goes back to its pool when dropped.
pub struct DeviceBlock<E: DeviceError> {
    ptr: u64,
    class: usize,
    requested: usize,
    owner: Arc<Shared<E>>,
}

impl<E: DeviceError> std::fmt::Debug for DeviceBlock<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBlock({:#x}, {} bytes)", self.ptr, self.requested)
    }
}

impl<E: DeviceError> DeviceBlock<E> {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes asked for (the usable size).
    pub fn bytes(&self) -> usize {
        self.requested
    }
}

/// The blocks of a capture's private pool; returned to the shared pool when dropped
/// (drop it after the graph that uses them).
pub struct PrivateBlocks<E: DeviceError> {
    blocks: BTreeMap<usize, Vec<u64>>,
    owner: Arc<Shared<E>>,
}

impl<E: DeviceError> std::fmt::Debug for PrivateBlocks<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrivateBlocks({} bytes)", self.bytes())
    }
}

impl<E: DeviceError> PrivateBlocks<E> {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(|(c, p)| c * p.len()).sum()
    }
}

impl<E: DeviceError> Drop for PrivateBlocks<E> {
    fn drop(&mut self) {
        let mut pool = self.owner.pool();
        for (class, ptrs) in std::mem::take(&mut self.blocks) {
            // Work queued later on the stream runs after the graph's last replay.
            let into = match pool.private.as_mut() {
                Some(p) => p,
                None => &mut pool.free,
            };
            into.entry(class).or_default().extend(ptrs);
        }
    }
}

impl<E: DeviceError> Drop for DeviceBlock<E> {
    fn drop(&mut self) {
        let mut pool = self.owner.pool();
        let into = match pool.private.as_mut() {
            Some(p) => p,
            None => &mut pool.free,
        };
        into.entry(self.class).or_default().push(self.ptr);
        pool.stats.allocated_bytes -= self.class as u64;
        pool.stats.requested_bytes -= self.requested as u64;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A device of `capacity` bytes that hands out fake addresses.
    struct FakeDevice {
        capacity: u64,
        used: Arc<AtomicU64>,
        next: AtomicU64,
        sizes: Mutex<BTreeMap<u64, u64>>,
    }

    impl FakeDevice {
        fn new(capacity: u64) -> (Self, Arc<AtomicU64>) {
            let used = Arc::new(AtomicU64::new(0));
            let dev = Self {
                capacity,
                used: Arc::clone(&used),
                next: AtomicU64::new(0x1000),
                sizes: Mutex::new(BTreeMap::new()),
            };
            (dev, used)
        }
    }

    impl RawMemory for FakeDevice {
        type Error = MemoryError;

        fn alloc(&self, bytes: usize) -> Result<Option<u64>, MemoryError> {
            let bytes = bytes as u64;
            if self.used.load(Ordering::SeqCst) + bytes > self.capacity {
                return Ok(None);
            }
            self.used.fetch_add(bytes, Ordering::SeqCst);
            let ptr = self.next.fetch_add(bytes, Ordering::SeqCst);
            self.sizes.lock().unwrap().insert(ptr, bytes);
            Ok(Some(ptr))
        }
        fn free(&self, ptr: u64) -> Result<(), MemoryError> {
            let bytes = self
                .sizes
                .lock()
                .unwrap()
                .remove(&ptr)
                .expect("double free");
            self.used.fetch_sub(bytes, Ordering::SeqCst);
            Ok(())
        }
        fn free_bytes(&self) -> Result<u64, MemoryError> {
            Ok(self.capacity - self.used.load(Ordering::SeqCst))
        }
        fn drain(&self) -> Result<(), MemoryError> {
            Ok(())
        }
    }

    fn allocator(capacity: u64) -> (CachingAllocator<MemoryError>, Arc<AtomicU64>) {
        let (dev, used) = FakeDevice::new(capacity);
        (CachingAllocator::new(Box::new(dev)), used)
    }

    #[test]
    fn size_classes_round_up_with_bounded_waste() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 18));
        assert_eq!(size_class(128 << 20), 128 << 20);
        for b in [1usize, 777, 65_537, 3 << 20, (5 << 20) + 3, 1 << 33] {
            let c = size_class(b);
            assert!(
                c >= b && (c - b) as f64 <= 0.25 * b as f64 + 512.0,
                "{b} -> {c}"
            );
        }
    }

    #[test]
    fn estimate_bytes_rounds_and_rejects_overflow() {
        assert_eq!(estimate_bytes(&[1024, 1024], DType::BF16).unwrap(), 2 << 20);
        assert_eq!(estimate_bytes(&[3], DType::F32).unwrap(), 512);
        assert!(matches!(
            estimate_bytes(&[usize::MAX, 2], DType::F32),
            Err(MemoryError::Overflow { .. })
        ));
    }

    #[test]
    fn freed_blocks_are_reused_and_counted() {
        let (a, used) = allocator(1 << 30);
        let b1 = a.allocate(1000).unwrap();
        let p1 = b1.ptr();
        drop(b1);
        let b2 = a.allocate(900).unwrap();
        assert_eq!(b2.ptr(), p1, "same size class reuses the cached block");
        let s = a.statistics();
        assert_eq!((s.allocations, s.cache_hits), (2, 1));
        assert_eq!(s.allocated_bytes, 1024);
        assert_eq!(s.requested_bytes, 900);
        assert_eq!(s.reserved_bytes, 1024);
        assert_eq!(used.load(Ordering::SeqCst), 1024);
        let _b3 = a.allocate(5000).unwrap();
        drop(b2);
        let s = a.statistics();
        assert_eq!(s.cached_bytes(), 1024);
        assert_eq!(s.peak_allocated_bytes, 1024 + 5120);
        assert!(s.fragmentation() > 0.0 && s.fragmentation() < 1.0);
        assert_eq!(a.empty_cache().unwrap(), 1024);
        assert_eq!(used.load(Ordering::SeqCst), 5120);
    }

    #[test]
    fn out_of_memory_releases_the_cache_then_reports() {
        let (a, used) = allocator(8 << 20);
        let keep = a.allocate(4 << 20).unwrap();
        drop(a.allocate(3 << 20).unwrap()); // cached, 3 MiB class
                                            // 4 MiB more does not fit next to 4 live + 3 cached, but does once the
                                            // cache is released.
        let second = a.allocate(4 << 20).unwrap();
        assert_eq!(a.statistics().cache_flushes, 1);
        assert_eq!(used.load(Ordering::SeqCst), 8 << 20);
        match a.allocate(1 << 20) {
            Err(MemoryError::OutOfMemory {
                requested,
                free,
                reserved,
            }) => {
                assert_eq!(requested, 1 << 20);
                assert_eq!(free, 0);
                assert_eq!(reserved, 8 << 20);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert!(a.check_memory_available(1).is_err());
        drop((keep, second));
        assert!(a.check_memory_available(8 << 20).is_ok());
        assert!(a.check_memory_available((8 << 20) + 1).is_err());
    }

    #[test]
    fn blocks_freed_during_a_capture_stay_private_until_it_is_dropped() {
        let (a, _) = allocator(1 << 30);
        let before = a.allocate(1000).unwrap();
        let p0 = before.ptr();
        drop(a.allocate(4000).unwrap()); // cached in the shared pool
        a.begin_private().unwrap();
        assert_eq!(
            a.begin_private(),
            Err(MemoryError::CaptureActive),
            "one capture at a time"
        );
        // Reuses the shared cache, then keeps what is freed for the capture.
        let scratch = a.allocate(4000).unwrap();
        let p1 = scratch.ptr();
        drop(scratch);
        drop(before);
        assert_eq!(
            a.allocate(3900).unwrap().ptr(),
            p1,
            "the capture reuses its own"
        );
        let private = a.end_private();
        assert_eq!(private.bytes(), 1024 + 4096);
        // Not handed out while the capture lives, nor released by `empty_cache`.
        let other = [a.allocate(1000).unwrap(), a.allocate(4000).unwrap()];
        assert!(other.iter().all(|b| b.ptr() != p0 && b.ptr() != p1));
        assert_eq!(a.empty_cache().unwrap(), 0);
        drop(private);
        assert_eq!(a.allocate(1000).unwrap().ptr(), p0);
    }

    #[test]
    fn out_of_memory_message_names_the_sizes() {
        let e = MemoryError::OutOfMemory {
            requested: 3 << 30,
            free: 512 << 20,
            reserved: 1536 << 20,
        };
        let m = e.to_string();
        assert!(
            m.contains("3.00 GiB") && m.contains("512.00 MiB") && m.contains("1.50 GiB"),
            "{m}"
        );
        assert_eq!(format_bytes(100), "100 B");
    }

    #[test]
    fn dropping_the_allocator_returns_cached_memory() {
        let (a, used) = allocator(1 << 30);
        let b = a.allocate(1 << 20).unwrap();
        drop(a);
        assert_eq!(
            used.load(Ordering::SeqCst),
            1 << 20,
            "live block still held"
        );
        drop(b);
        assert_eq!(used.load(Ordering::SeqCst), 0);
    }
}
