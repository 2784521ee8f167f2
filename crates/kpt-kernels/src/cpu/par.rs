//! Row-parallel loops that stay on the calling thread when the work is small.

use rayon::prelude::*;

/// Total work (roughly, scalar operations) below which a kernel runs sequentially;
/// parallel tasks each get at least half of it, so that rayon's per-task overhead
/// (a few microseconds) stays small next to the task.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

/// Minimum number of rows per rayon task for rows costing `cost` each.
fn min_rows(cost: usize) -> usize {
    (PAR_THRESHOLD / 2 / cost.max(1)).max(1)
}

/// Whether `rows` rows of `cost` each are worth spreading over threads.
pub(crate) fn worth_parallel(rows: usize, cost: usize) -> bool {
    rows >= 2 && rows.saturating_mul(cost.max(1)) >= PAR_THRESHOLD
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
    if worth_parallel(rows, cost) {
        out.par_chunks_mut(row_len)
            .enumerate()
            .with_min_len(min_rows(cost))
            .for_each(|(i, r)| f(i, r));
    } else {
        out.chunks_mut(row_len)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    }
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
    let rows = a.len().div_ceil(len_a);
    if worth_parallel(rows, cost) {
        a.par_chunks_mut(len_a)
            .zip(b.par_chunks_mut(len_b))
            .enumerate()
            .with_min_len(min_rows(cost))
            .for_each(|(i, (ra, rb))| f(i, ra, rb));
    } else {
        a.chunks_mut(len_a)
            .zip(b.chunks_mut(len_b))
            .enumerate()
            .for_each(|(i, (ra, rb))| f(i, ra, rb));
    }
}
