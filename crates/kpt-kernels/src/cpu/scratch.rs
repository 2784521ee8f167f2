//! Reusable scratch buffers for the large temporaries of a kernel call (packed operands,
//! per-task outputs). Fresh allocations of many MiB come from the OS as untouched pages,
//! and faulting them in costs more than the kernel's own work on them (faults also
//! serialize across threads); a [`Scratch`] takes a buffer from the calling thread's
//! pool and gives it back on drop, so repeated calls reuse mapped memory.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// Buffers kept per thread and element type.
const POOL_LEN: usize = 8;
/// Largest buffer kept, in bytes.
const MAX_KEPT_BYTES: usize = 256 << 20;

/// Element types with a scratch pool.
pub(crate) trait Pooled: Copy + Default + 'static {
    /// This type's per-thread pool.
    fn pool() -> &'static LocalKey<RefCell<Vec<Vec<Self>>>>;
}

macro_rules! pooled {
    ($($t:ty),*) => {$(
        impl Pooled for $t {
            fn pool() -> &'static LocalKey<RefCell<Vec<Vec<Self>>>> {
                thread_local! {
                    static POOL: RefCell<Vec<Vec<$t>>> = const { RefCell::new(Vec::new()) };
                }
                &POOL
            }
        }
    )*};
}
pooled!(f32, u16);

/// A buffer of `len` elements from the pool. Its contents are unspecified (left over
/// from an earlier use, or zero): callers write every element they later read.
pub(crate) struct Scratch<T: Pooled> {
    v: Vec<T>,
}

impl<T: Pooled> Scratch<T> {
    /// A buffer of `len` elements with unspecified contents.
    pub(crate) fn new(len: usize) -> Self {
        let mut v = T::pool().with_borrow_mut(|p| p.pop()).unwrap_or_default();
        v.resize(len, T::default());
        Scratch { v }
    }
}

impl<T: Pooled> Deref for Scratch<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.v
    }
}

impl<T: Pooled> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.v
    }
}

impl<T: Pooled> Drop for Scratch<T> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        if v.capacity() * size_of::<T>() > MAX_KEPT_BYTES {
            return;
        }
        // `try_with`: the pool may already be gone while the thread exits.
        let _ = T::pool().try_with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < POOL_LEN {
                p.push(v);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_sized() {
        let ptr = {
            let mut a = Scratch::<f32>::new(1000);
            a[999] = 7.0;
            a.as_ptr()
        };
        let b = Scratch::<f32>::new(500);
        assert_eq!(b.len(), 500);
        assert_eq!(b.as_ptr(), ptr, "the dropped buffer is taken again");
        let c = Scratch::<f32>::new(2000);
        assert_eq!(c.len(), 2000);
    }
}
