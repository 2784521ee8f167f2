//! Packed operand panels that the parallel tasks of one call pack on first use.
//!
//! A GEMM packs its operands into micro-panels before multiplying them. Packing them in
//! a parallel phase of its own costs a second wake-up of the thread pool and a wait for
//! its slowest thread; on a 16-core VM that phase took 40% of a 512² f32 product. With
//! [`LazyPanels`] every task packs the panels it needs that no other task has claimed,
//! waits for the ones being packed elsewhere (one panel is a few microseconds of work),
//! and goes on: one parallel region, and the packing spreads over the threads the way
//! the tasks do.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};

/// Nobody has claimed the panel.
const EMPTY: u8 = 0;
/// A task is packing the panel.
const PACKING: u8 = 1;
/// The panel is packed.
const READY: u8 = 2;

/// Spins before a waiting task yields its core (the packer may have been descheduled).
const SPINS_BEFORE_YIELD: u32 = 1 << 10;

/// A panel's state, on a cache line of its own: a claim or a `READY` store by one task
/// does not take the line that tasks waiting for other panels are reading.
#[repr(align(64))]
struct State(AtomicU8);

/// A buffer of equal-sized panels, each packed once by the first task that asks for it.
pub(crate) struct LazyPanels<'a, T> {
    buf: *mut T,
    panel_len: usize,
    state: Box<[State]>,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: a panel's elements are written only by the one task that moved its state from
// EMPTY to PACKING, and read only after its state is READY (release / acquire), so the
// buffer is never written and read, or written twice, at the same time.
unsafe impl<T: Send + Sync> Sync for LazyPanels<'_, T> {}
// SAFETY: as above; the value owns a unique borrow of the buffer.
unsafe impl<T: Send> Send for LazyPanels<'_, T> {}

impl<'a, T> LazyPanels<'a, T> {
    /// Panels of `panel_len` elements over `buf` (`buf.len() / panel_len` of them), none
    /// packed yet.
    pub(crate) fn new(buf: &'a mut [T], panel_len: usize) -> Self {
        assert!(panel_len > 0, "panels must not be empty");
        let count = buf.len() / panel_len;
        LazyPanels {
            buf: buf.as_mut_ptr(),
            panel_len,
            state: (0..count).map(|_| State(AtomicU8::new(EMPTY))).collect(),
            _buf: PhantomData,
        }
    }

    /// Panels `range`, contiguous: packs those no task has claimed with `pack(i, panel)`,
    /// then waits for the ones other tasks are packing.
    pub(crate) fn get(&self, range: Range<usize>, pack: impl Fn(usize, &mut [T])) -> &[T] {
        assert!(range.end <= self.state.len() && range.start <= range.end);
        for i in range.clone() {
            let state = &self.state[i].0;
            // A claim only where the panel looks unclaimed: a compare-exchange takes the
            // line exclusively even when it fails, and most panels a task asks for are
            // already packed.
            let claimed = state.load(Ordering::Relaxed) == EMPTY
                && state
                    .compare_exchange(EMPTY, PACKING, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok();
            if claimed {
                // SAFETY: panel i lies in the buffer (i < count) and this task alone
                // holds its claim, so nothing else reads or writes it until READY.
                let panel = unsafe {
                    std::slice::from_raw_parts_mut(self.buf.add(i * self.panel_len), self.panel_len)
                };
                pack(i, panel);
                state.store(READY, Ordering::Release);
            }
        }
        for i in range.clone() {
            let mut spins = 0u32;
            while self.state[i].0.load(Ordering::Acquire) != READY {
                spins += 1;
                if spins < SPINS_BEFORE_YIELD {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        // SAFETY: every panel in `range` is READY: written once, never written again
        // while `self` lives; the range lies in the buffer.
        unsafe {
            std::slice::from_raw_parts(
                self.buf.add(range.start * self.panel_len),
                range.len() * self.panel_len,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn each_panel_is_packed_once_and_read_after_packing() {
        let mut buf = vec![0u32; 64 * 8];
        let packs = AtomicUsize::new(0);
        let panels = LazyPanels::new(&mut buf, 8);
        (0..200usize).into_par_iter().for_each(|t| {
            let range = (t * 7) % 60..(t * 7) % 60 + 4;
            let got = panels.get(range.clone(), |i, p| {
                packs.fetch_add(1, Ordering::Relaxed);
                p.fill(i as u32 + 1);
            });
            for (off, panel) in got.chunks(8).enumerate() {
                assert!(panel.iter().all(|&x| x as usize == range.start + off + 1));
            }
        });
        let touched = (0..200usize)
            .flat_map(|t| (t * 7) % 60..(t * 7) % 60 + 4)
            .collect::<std::collections::BTreeSet<_>>();
        assert_eq!(packs.load(Ordering::Relaxed), touched.len());
        drop(panels);
        assert_eq!(buf[62 * 8], 63, "panel 62 was packed");
        assert_eq!(buf[63 * 8], 0, "panel 63 was never asked for");
    }
}
