//! Parallel loops. Row loops run in place when the work is small, in one static part
//! per thread of the spinning [`team`] when it is decode-sized, and as tasks that the
//! team's threads take from each other ([`for_each_task`], also the GEMMs' task loops)
//! when it is large.
//!
//! [`team`]: super::team

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use super::team;

/// Total work (roughly, scalar operations) below which a kernel runs sequentially;
/// parallel tasks each get at least half of it, so that rayon's per-task overhead
/// (a few microseconds) stays small next to the task.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

/// Total work up to which a loop runs in one static part per thread (on the team when
/// it is awake); larger loops are cut into tasks that threads take from each other's
/// shares ([`for_each_task`]), which evens out threads that run at different speeds.
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
        let chunk = min_rows(cost);
        for_each_task(rows.div_ceil(chunk), &|t| {
            f(t * chunk..((t + 1) * chunk).min(rows))
        });
        return;
    }
    if let Some(team) = team::global().filter(|t| t.awake()) {
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

/// Runs `task(t)` for every `t` in `0..count` on all threads. On the team (when no
/// other caller holds it) each thread starts on its own contiguous share of the tasks,
/// so that neighbouring tasks, which share operands, run on one core, and then takes
/// tasks from the other shares, so that a thread the OS preempted does not hold up the
/// loop. Otherwise the tasks run on rayon's pool; inside a team job (a nested loop),
/// in place.
///
/// On the 16-core Xeon VM this ran the AMX bf16 GEMM 10-20% and the f32 GEMM about 6%
/// faster at 512² than rayon's pool, whose idle workers sleep between calls; equal
/// static shares without stealing were 20-45% slower (docs/decisions.md, "GEMM task
/// schedule").
pub(crate) fn for_each_task(count: usize, task: &(dyn Fn(usize) + Sync)) {
    if count <= 1 || team::in_job() {
        (0..count).for_each(task);
        return;
    }
    if let Some(team) = team::global() {
        let shares = Shares::new(count, team.size().min(count));
        if team.run(shares.len(), &|p| shares.run(p, task)) {
            return;
        }
    }
    team::rest();
    (0..count).into_par_iter().for_each(task);
}

/// The tasks `0..count` cut into contiguous shares, one per thread, each with a
/// cursor that its owner, and then the threads done with their own shares, advance.
struct Shares {
    count: usize,
    cursors: Box<[Cursor]>,
}

/// The next unclaimed task of a share, on a cache line of its own.
#[repr(align(128))]
struct Cursor(AtomicUsize);

impl Shares {
    fn new(count: usize, parts: usize) -> Self {
        let cursors = (0..parts)
            .map(|p| Cursor(AtomicUsize::new(count * p / parts)))
            .collect();
        Shares { count, cursors }
    }

    fn len(&self) -> usize {
        self.cursors.len()
    }

    /// Thread `p`: runs the tasks of share `p`, then those left in the others.
    fn run(&self, p: usize, task: &(dyn Fn(usize) + Sync)) {
        let parts = self.len();
        for q in (p..parts).chain(0..p) {
            let end = self.count * (q + 1) / parts;
            // Relaxed: each task index is taken once; the outputs of tasks are
            // published by the end of the team's job.
            loop {
                let t = self.cursors[q].0.fetch_add(1, Ordering::Relaxed);
                if t >= end {
                    break;
                }
                task(t);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    /// Runs `count` tasks over `parts` scoped threads; returns each task's run count
    /// and the thread it ran on. Task 0 (share 0's first) blocks its thread until
    /// another task of share 0 has run (or 10 s have passed), so share 0 is finished
    /// only if other threads take its tasks, however the OS schedules the threads.
    fn run_shares(count: usize, parts: usize) -> (Vec<usize>, Vec<usize>) {
        let shares = Shares::new(count, parts);
        let share0 = count / parts;
        let runs: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
        let owner: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
        let share0_moved = AtomicBool::new(false);
        std::thread::scope(|s| {
            for p in 0..parts {
                let (shares, runs, owner, moved) = (&shares, &runs, &owner, &share0_moved);
                s.spawn(move || {
                    shares.run(p, &|t| {
                        if t == 0 && share0 > 1 {
                            let start = Instant::now();
                            while !moved.load(Ordering::Acquire)
                                && start.elapsed() < Duration::from_secs(10)
                            {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        } else if t < share0 {
                            moved.store(true, Ordering::Release);
                        }
                        runs[t].fetch_add(1, Ordering::Relaxed);
                        owner[t].store(p, Ordering::Relaxed);
                    })
                });
            }
        });
        let get = |v: Vec<AtomicUsize>| v.into_iter().map(AtomicUsize::into_inner).collect();
        (get(runs), get(owner))
    }

    #[test]
    fn every_task_runs_once_and_idle_threads_take_a_slow_share() {
        for (count, parts) in [(1, 1), (2, 2), (7, 3), (64, 4), (1000, 4)] {
            let (runs, owner) = run_shares(count, parts);
            assert!(
                runs.iter().all(|&r| r == 1),
                "{count} over {parts}: {runs:?}"
            );
            let share0 = count / parts;
            if parts > 1 && share0 > 1 {
                assert!(
                    owner[1..share0].iter().any(|&p| p != owner[0]),
                    "{count} over {parts}: share 0 was not shared out: {owner:?}"
                );
            }
        }
    }

    #[test]
    fn for_each_task_runs_every_task_once() {
        for count in [0, 1, 2, 5, 33, 500] {
            let runs: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            for_each_task(count, &|t| {
                runs[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                "{count}"
            );
        }
    }
}
