//! A team of spinning helper threads for kpt's parallel loops: decode-sized loops in one
//! static part per thread, large loops and the GEMMs' tasks through
//! [`for_each_task`](super::par::for_each_task).
//!
//! A kernel that runs for tens of microseconds pays for every idle worker it wakes:
//! rayon's workers sleep soon after their queues empty, and waking a sleeping thread
//! (on a virtual machine, a halted vCPU) costs microseconds each. The team's helpers
//! instead spin for a while after each job, as OpenMP runtimes do, so back-to-back
//! kernels start at the cost of one cache-line write. Parts are handed out by a
//! static schedule: part `i` of every job runs on helper `i`, so a kernel that
//! splits the same weights the same way on every call finds its slice in that core's
//! private cache.
//!
//! A helper that the OS has not scheduled (a busy machine, a preempted virtual CPU)
//! must not stall the job: every part is claimed before it runs, by its helper or, once
//! the caller has finished its own part, by the caller, which then runs it in place.
//! The caller waits only for parts that a running helper has claimed.
//!
//! `KPT_CPU_TEAM=off` (or `0`) turns the team off (rayon runs every loop);
//! `KPT_CPU_SPIN_US` sets how long helpers spin before parking (default 1000).

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Small loops in a row after which a resting team wakes (see [`Team::awake`]).
const WAKE_AFTER: usize = 8;

/// Spins after which a caller waiting for a helper's part yields its core each round
/// (the helper may be waiting for one).
const YIELD_AFTER: u32 = 4096;

/// A job: calls part `i` for `i` in `0..parts`.
type Job = dyn Fn(usize) + Sync;

/// State shared by the caller and the helpers.
struct Shared {
    /// Bumped once per job; helpers run a job when they see it change.
    epoch: AtomicUsize,
    /// The current job and its part count. Written by the caller holding the team's
    /// lock before `epoch` is bumped (release), read by helpers after (acquire).
    job: UnsafeCell<(*const Job, usize)>,
    /// Per helper: its progress and sleep state, each on its own cache line.
    slots: Vec<Slot>,
    /// Set when a part panicked.
    panicked: AtomicBool,
    /// Set by [`rest`] when a loop starts on rayon's pool: spinning helpers park at
    /// once instead of taking cores from rayon's threads. Cleared by the next job.
    rest: AtomicBool,
    /// Small loops asked for since the team last rested (see [`Team::awake`]).
    streak: AtomicUsize,
    /// Set (before a last epoch bump) when the team is dropped: helpers exit.
    stop: AtomicBool,
    /// How long a helper spins for the next job before parking.
    spin: Duration,
}

/// One helper's state. Finishing a job writes only this line, so the caller's wait
/// costs no contended read-modify-write on a shared counter.
#[repr(align(128))]
struct Slot {
    /// The last epoch whose part of this slot was claimed, by the helper or by the
    /// caller (`fetch_max`: whoever raises it to the job's epoch runs the part).
    claim: AtomicUsize,
    /// The last epoch whose part the helper finished (parts the caller took are not
    /// recorded here).
    done: AtomicUsize,
    /// Whether the helper is parked (or about to park).
    parked: AtomicBool,
}

// SAFETY: `job` is written only by the lock holder while every helper is idle (each
// slot's `done` reached the previous epoch) and read by helpers only between the epoch
// bump and their store to `done`; the pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced while its job runs.
unsafe impl Send for Shared {}

/// The helpers and the lock that gives one caller at a time the team.
pub(crate) struct Team {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    lock: Mutex<()>,
}

thread_local! {
    /// Whether this thread is running a part of a team job (nested loops run in place).
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is inside a team job.
pub(crate) fn in_job() -> bool {
    IN_JOB.with(Cell::get)
}

/// The process-wide team (see [`global`]).
static TEAM: OnceLock<Option<Team>> = OnceLock::new();

/// Tells spinning helpers to park now: called before a loop starts on rayon's pool,
/// whose threads need every core. Costs one load when the helpers already rest.
pub(crate) fn rest() {
    if let Some(Some(team)) = TEAM.get() {
        team.rest();
    }
}

/// The process-wide team, sized to rayon's pool at first use; `None` when turned off
/// or when there is nothing to share (one thread).
pub(crate) fn global() -> Option<&'static Team> {
    TEAM.get_or_init(|| {
        let off = std::env::var("KPT_CPU_TEAM").is_ok_and(|v| v == "off" || v == "0");
        let size = rayon::current_num_threads();
        if off || size < 2 {
            return None;
        }
        let spin_us = std::env::var("KPT_CPU_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        Team::new(size - 1, Duration::from_micros(spin_us))
    })
    .as_ref()
}

impl Team {
    /// Starts `helpers` threads; `None` if the OS refuses a thread.
    fn new(helpers: usize, spin: Duration) -> Option<Self> {
        Self::with_start(helpers, spin, Arc::new(|| {}))
    }

    /// [`Team::new`] whose helpers each call `start` before they take part in jobs.
    fn with_start(
        helpers: usize,
        spin: Duration,
        start: Arc<dyn Fn() + Send + Sync>,
    ) -> Option<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new((std::ptr::null::<fn(usize)>() as *const Job, 0)),
            slots: (0..helpers)
                .map(|_| Slot {
                    claim: AtomicUsize::new(0),
                    done: AtomicUsize::new(0),
                    parked: AtomicBool::new(false),
                })
                .collect(),
            panicked: AtomicBool::new(false),
            rest: AtomicBool::new(true),
            streak: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            spin,
        });
        let mut team = Self {
            shared,
            threads: Vec::with_capacity(helpers),
            lock: Mutex::new(()),
        };
        for h in 0..helpers {
            let s = Arc::clone(&team.shared);
            let start = Arc::clone(&start);
            // On failure, dropping `team` stops the helpers already started.
            let handle = std::thread::Builder::new()
                .name(format!("kpt-team-{}", h + 1))
                .spawn(move || {
                    start();
                    helper_loop(&s, h)
                })
                .ok()?;
            team.threads.push(handle);
        }
        Some(team)
    }

    /// Makes spinning helpers park (see [`rest`]).
    fn rest(&self) {
        let s = &*self.shared;
        if !s.rest.load(Ordering::Relaxed) {
            s.rest.store(true, Ordering::Relaxed);
        }
        if s.streak.load(Ordering::Relaxed) != 0 {
            s.streak.store(0, Ordering::Relaxed);
        }
    }

    /// Whether a small loop should run on the team. Yes while the helpers spin; while
    /// they rest, only after [`WAKE_AFTER`] small loops in a row. Waking parked
    /// helpers costs a wake-up per helper (tens of microseconds each for an idle
    /// virtual CPU), and a job waits for all of them, so a resting team stays out of
    /// the way of calls that run one small loop next to large ones (a GEMM's packing
    /// phase), and takes over runs of small loops (a decode step).
    pub(crate) fn awake(&self) -> bool {
        let s = &*self.shared;
        !s.rest.load(Ordering::Relaxed)
            || s.streak.fetch_add(1, Ordering::Relaxed) + 1 >= WAKE_AFTER
    }

    /// Threads a job can use: the helpers and the caller.
    pub(crate) fn size(&self) -> usize {
        self.threads.len() + 1
    }

    /// Runs `f(i)` for `i` in `0..parts` (at most [`Team::size`]): part 0 on the
    /// caller, part `i` on helper `i`. Returns `false` without running anything when
    /// another thread holds the team. A panicking part is re-raised here after every
    /// part has finished.
    pub(crate) fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync + '_)) -> bool {
        assert!(
            parts <= self.size(),
            "{parts} parts for a team of {}",
            self.size()
        );
        let Ok(guard) = self.lock.try_lock() else {
            return false;
        };
        let s = &*self.shared;
        // SAFETY: no helper reads the job now: a helper reads it only after winning
        // the claim of a job's epoch and until it stores that epoch to `done`, and the
        // previous caller settled every slot's claim (and waited for `done` where a
        // helper won) before releasing the lock. This function does the same below, so
        // `f` outlives every use.
        unsafe {
            // Erases the lifetime only.
            let f = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(f);
            *s.job.get() = (f, parts);
        }
        if s.rest.load(Ordering::Relaxed) {
            s.rest.store(false, Ordering::Relaxed);
        }
        let epoch = s.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        for (t, slot) in self.threads.iter().zip(&s.slots) {
            if slot.parked.load(Ordering::SeqCst) {
                t.thread().unpark();
            }
        }
        let own = run_part(f, 0);
        for (h, slot) in s.slots.iter().enumerate() {
            if slot.done.load(Ordering::Acquire) == epoch {
                continue;
            }
            if claim(slot, epoch) {
                // The helper has not reached this job (not scheduled, or still waking):
                // its part runs here, and the helper skips the job when it gets there.
                if h + 1 < parts && run_part(f, h + 1).is_err() {
                    s.panicked.store(true, Ordering::Relaxed);
                }
                continue;
            }
            // The helper runs its part; if the OS takes its core meanwhile, let it back.
            let mut spins = 0u32;
            while slot.done.load(Ordering::Acquire) != epoch {
                std::hint::spin_loop();
                spins = spins.saturating_add(1);
                if spins >= YIELD_AFTER {
                    std::thread::yield_now();
                }
            }
        }
        let helper_panicked = s.panicked.swap(false, Ordering::Relaxed);
        // Released before a panic is raised, so that the lock is not poisoned.
        drop(guard);
        if let Err(payload) = own {
            resume_unwind(payload);
        }
        if helper_panicked {
            panic!("a kernel task panicked on a kpt team thread");
        }
        true
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, Ordering::Release);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        for t in &self.threads {
            t.thread().unpark();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Claims `slot`'s part of job `epoch`; true for the one caller that raised the claim.
/// Every slot is claimed (by its helper or by the job's caller) before the job ends, so
/// a helper that wakes late finds a claim at or past the epoch it saw and skips it.
fn claim(slot: &Slot, epoch: usize) -> bool {
    slot.claim.load(Ordering::Acquire) < epoch
        && slot.claim.fetch_max(epoch, Ordering::AcqRel) < epoch
}

/// Runs one part with the nested-loop flag set.
fn run_part(f: &(dyn Fn(usize) + Sync + '_), part: usize) -> std::thread::Result<()> {
    IN_JOB.with(|c| c.set(true));
    let r = catch_unwind(AssertUnwindSafe(|| f(part)));
    IN_JOB.with(|c| c.set(false));
    r
}

/// A helper: waits for each new epoch (spinning, then parked), runs its part.
fn helper_loop(s: &Shared, h: usize) {
    // The epoch the team was made with, not a load here: the first job may bump it
    // before this thread starts.
    let mut seen = 0;
    let slot = &s.slots[h];
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256)
                && (s.rest.load(Ordering::Relaxed) || start.elapsed() >= s.spin)
            {
                slot.parked.store(true, Ordering::SeqCst);
                if s.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park();
                }
                slot.parked.store(false, Ordering::SeqCst);
                break;
            }
        }
        let now = s.epoch.load(Ordering::Acquire);
        if now == seen {
            continue; // woke from park without a job: spin again
        }
        seen = now;
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        if !claim(slot, seen) {
            continue; // the caller ran this part (or the job is long over)
        }
        // SAFETY: read after winning the claim of the current epoch: the caller keeps
        // the job alive until this helper stores the epoch to `done`.
        let (job, parts) = unsafe { *s.job.get() };
        if h + 1 < parts {
            // SAFETY: as above.
            if run_part(unsafe { &*job }, h + 1).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        slot.done.store(seen, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once() {
        let team = Team::new(3, Duration::from_micros(50)).unwrap();
        for round in 0..200 {
            let parts = 1 + round % team.size();
            let hits: Vec<AtomicUsize> = (0..team.size()).map(|_| AtomicUsize::new(0)).collect();
            let names: Vec<Mutex<String>> = (0..team.size()).map(|_| Mutex::default()).collect();
            assert!(team.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                *names[i].lock().unwrap() = std::thread::current().name().unwrap_or("").into();
            }));
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(
                    h.load(Ordering::Relaxed),
                    usize::from(i < parts),
                    "part {i}"
                );
            }
            // A part runs on its helper, or on the caller when the helper was late.
            let caller = std::thread::current().name().unwrap_or("").to_string();
            for (i, n) in names.iter().enumerate().take(parts).skip(1) {
                let n = n.lock().unwrap();
                assert!(
                    *n == format!("kpt-team-{i}") || *n == caller,
                    "part {i} on {n}"
                );
            }
            if round % 50 == 0 {
                // Long enough for the helpers to park: the next job must wake them.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    #[test]
    fn jobs_finish_without_helpers_that_do_not_run_and_late_helpers_skip_them() {
        // Helpers held at their start stand for threads the OS does not schedule: the
        // caller runs their parts, and once they run, they must not run those again.
        let gate = Arc::new(std::sync::Barrier::new(4));
        let g = Arc::clone(&gate);
        let team = Team::with_start(
            3,
            Duration::from_secs(1),
            Arc::new(move || {
                g.wait();
            }),
        )
        .unwrap();
        let me = std::thread::current().id();
        let runs: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..50 {
            assert!(team.run(4, &|i| {
                assert_eq!(std::thread::current().id(), me);
                runs[i].fetch_add(1, Ordering::Relaxed);
            }));
        }
        gate.wait();
        let on_helper = AtomicBool::new(false);
        let t = Instant::now();
        let mut jobs = 50;
        while !on_helper.load(Ordering::Relaxed) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "helpers never ran a part"
            );
            assert!(team.run(4, &|i| {
                if std::thread::current().id() != me {
                    on_helper.store(true, Ordering::Relaxed);
                }
                runs[i].fetch_add(1, Ordering::Relaxed);
            }));
            jobs += 1;
        }
        for (i, r) in runs.iter().enumerate() {
            assert_eq!(r.load(Ordering::Relaxed), jobs, "part {i}");
        }
    }

    #[test]
    fn a_job_started_before_the_helpers_run_is_seen() {
        // Helpers that read the epoch when they start would miss a job posted first
        // and leave the caller waiting: run on a fresh team at once, many times.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..100 {
                let team = Team::new(2, Duration::from_micros(50)).unwrap();
                let n = AtomicUsize::new(0);
                assert!(team.run(3, &|_| {
                    n.fetch_add(1, Ordering::Relaxed);
                }));
                tx.send(n.load(Ordering::Relaxed)).unwrap();
            }
        });
        for _ in 0..100 {
            let n = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("a job on a fresh team never finished");
            assert_eq!(n, 3);
        }
    }

    #[test]
    fn a_panicking_part_is_raised_after_all_parts_finish() {
        let team = Team::new(2, Duration::from_micros(50)).unwrap();
        let done = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(3, &|i| {
                if i == 1 {
                    panic!("part 1");
                }
                done.fetch_add(1, Ordering::Relaxed);
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(Ordering::Relaxed), 2);
        // The team still works afterwards.
        let n = AtomicUsize::new(0);
        assert!(team.run(3, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(n.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn resting_helpers_park_and_wake_for_the_next_job() {
        let team = Team::new(3, Duration::from_secs(60)).unwrap();
        let parked = |team: &Team| {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(10) {
                if team
                    .shared
                    .slots
                    .iter()
                    .all(|s| s.parked.load(Ordering::SeqCst))
                {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            false
        };
        for _ in 0..20 {
            let n = AtomicUsize::new(0);
            assert!(team.run(4, &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            }));
            assert_eq!(n.load(Ordering::Relaxed), 4);
            // Spinning for a minute unless told to rest.
            team.rest();
            assert!(parked(&team), "helpers still spin after rest()");
        }
    }

    #[test]
    fn a_resting_team_wakes_after_a_run_of_small_loops() {
        let team = Team::new(1, Duration::from_secs(60)).unwrap();
        for _ in 0..3 {
            for _ in 1..WAKE_AFTER {
                assert!(!team.awake());
            }
            assert!(team.awake());
            assert!(team.run(2, &|_| {}));
            assert!(team.awake(), "a team that just ran a job is awake");
            team.rest();
        }
    }

    #[test]
    fn a_busy_team_refuses() {
        let team = Team::new(1, Duration::from_micros(50)).unwrap();
        let inner = AtomicBool::new(true);
        assert!(team.run(1, &|_| inner.store(team.run(1, &|_| {}), Ordering::Relaxed)));
        assert!(!inner.load(Ordering::Relaxed));
    }
}
