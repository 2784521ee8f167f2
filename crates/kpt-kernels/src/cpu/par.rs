//! Row-parallel loops: in place when the work is small, on the spinning [`team`]
//! when it is decode-sized, on rayon's pool otherwise.
//!
//! [`team`]: super::team

use std::ops::Range;

use rayon::prelude::*;

use super::team;

/// Total work (roughly, scalar operations) below which a kernel runs sequentially;
/// parallel tasks each get at least half of it, so that rayon's per-task overhead
/// (a few microseconds) stays small next to the task.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

/// Total work up to which a loop runs on the team (one static part per thread);
/// larger loops go to rayon, whose dynamic schedule evens out threads that run at
/// different speeds.
const TEAM_MAX_WORK: usize = 1 << 24;

/// Minimum number of rows per rayon task for rows costing `cost` each.
fn min_rows(cost: usize) -> usize {
    (PAR_THRESHOLD / 2 / cost.max(1)).max(1)
}

/// Whether `rows` rows of `cost` each are worth spreading over threads.
pub(crate) fn worth_parallel(rows: usize, cost: usize) -> bool {
    rows >= 2 && rows.saturating_mul(cost.max(1)) >= PAR_THRESHOLD
}

/// Calls `f` on disjoint row ranges covering `0..rows`, from as many threads as the
/// work is worth.
fn run_rows(rows: usize, cost: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    if !worth_parallel(rows, cost) || team::in_job() {
        f(0..rows);
        return;
    }
    if rows.saturating_mul(cost.max(1)) >= TEAM_MAX_WORK {
        team::rest();
    } else if let Some(team) = team::global().filter(|t| t.awake()) {
        let parts = rows.min(team.size()).min(rayon::current_num_threads());
        if parts < 2 {
            f(0..rows);
            return;
        }
        if team.run(parts, &|p| f(rows * p / parts..rows * (p + 1) / parts)) {
            return;
        }
    }
    (0..rows)
        .into_par_iter()
        .with_min_len(min_rows(cost))
        .for_each(|r| f(r..r + 1));
}

/// A slice cut into rows that threads may borrow disjoint ranges of.
struct Rows<T> {
    ptr: *mut T,
    len: usize,
    row_len: usize,
}

// SAFETY: `Rows` hands out only disjoint ranges (see `range`) of a slice of `Send`
// elements it exclusively borrows for the duration of one loop.
unsafe impl<T: Send> Sync for Rows<T> {}

impl<T> Rows<T> {
    fn new(s: &mut [T], row_len: usize) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            row_len,
        }
    }

    /// The elements of rows `r` (the last row may be short).
    ///
    /// # Safety
    /// Ranges borrowed at the same time must not overlap, and the slice `self` was
    /// made from must outlive the borrow.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, r: &Range<usize>) -> &mut [T] {
        let start = (r.start * self.row_len).min(self.len);
        let end = (r.end * self.row_len).min(self.len);
        // SAFETY: in bounds of the original slice; disjointness is the caller's.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), end - start) }
    }
}

/// Calls `f(i, row)` for each `row_len`-element chunk `row` of `out` (the last one may be
/// shorter), in parallel when the rows are worth it. `cost` is the work per row.
pub(crate) fn for_each_row<T, F>(out: &mut [T], row_len: usize, cost: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    if row_len == 0 || out.is_empty() {
        return;
    }
    let rows = out.len().div_ceil(row_len);
    let out = Rows::new(out, row_len);
    run_rows(rows, cost, &|r| {
        // SAFETY: `run_rows` passes disjoint ranges; `out` lives through the loop.
        let s = unsafe { out.range(&r) };
        for (i, row) in s.chunks_mut(row_len).enumerate() {
            f(r.start + i, row);
        }
    });
}

/// Like [`for_each_row`] over two outputs chunked in lockstep (`a` by `len_a`, `b` by
/// `len_b`; both must have the same number of chunks).
pub(crate) fn for_each_row2<A, B, F>(
    a: &mut [A],
    len_a: usize,
    b: &mut [B],
    len_b: usize,
    cost: usize,
    f: F,
) where
    A: Send,
    B: Send,
    F: Fn(usize, &mut [A], &mut [B]) + Sync + Send,
{
    if len_a == 0 || len_b == 0 || a.is_empty() {
        return;
    }
    let rows = a.len().div_ceil(len_a).min(b.len().div_ceil(len_b));
    let (a, b) = (Rows::new(a, len_a), Rows::new(b, len_b));
    run_rows(rows, cost, &|r| {
        // SAFETY: as in `for_each_row`.
        let (sa, sb) = unsafe { (a.range(&r), b.range(&r)) };
        for (i, (ra, rb)) in sa.chunks_mut(len_a).zip(sb.chunks_mut(len_b)).enumerate() {
            f(r.start + i, ra, rb);
        }
    });
}
