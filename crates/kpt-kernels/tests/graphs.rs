//! `Executor::set_graphs`: which runs are captured, replayed or run normally, checked
//! with a CPU backend whose captures are recorded (the launches run while "recorded",
//! and a replay only counts), and the plain CPU backend, which cannot capture.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use kpt_core::backend::{Backend, BufferMut, BufferRef, CapturedRun, DeviceBuffer, MemoryStats};
use kpt_core::exec::{DeviceTensor, Executor, GraphStats, RunTensor};
use kpt_core::graph::{Graph, Op, TensorSpec};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::{DType, KptError, OptLevel, Result, Tensor};
use kpt_kernels::{CpuBackend, KernelRegistry};

const ROWS: usize = 6;
const D: usize = 4;

/// The CPU backend with recorded captures.
struct Recording {
    cpu: CpuBackend,
    capturing: AtomicBool,
    /// Captures fail at the softmax (after the in-place cache write ran).
    fail: AtomicBool,
    captures: AtomicUsize,
    replays: Arc<AtomicUsize>,
    writes: AtomicUsize,
    copies: AtomicUsize,
    /// What the captured runs' deferred checks find: a kernel reported bad input.
    bad: Arc<AtomicBool>,
}

impl Recording {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            cpu: CpuBackend::new().unwrap(),
            capturing: AtomicBool::new(false),
            fail: AtomicBool::new(false),
            captures: AtomicUsize::new(0),
            replays: Arc::default(),
            writes: AtomicUsize::new(0),
            copies: AtomicUsize::new(0),
            bad: Arc::default(),
        })
    }
}

struct Replay {
    replays: Arc<AtomicUsize>,
    bad: Arc<AtomicBool>,
}

impl CapturedRun for Replay {
    fn replay(&mut self) -> Result<bool> {
        self.replays.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    fn check(&self) -> Result<()> {
        match self.bad.load(Ordering::SeqCst) {
            true => Err(KptError::InvalidArgument("a kernel saw bad input".into())),
            false => Ok(()),
        }
    }
}

impl Backend for Recording {
    fn name(&self) -> &str {
        "cpu"
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn device(&self) -> &DeviceInfo {
        self.cpu.device()
    }
    fn allocate(&self, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        self.cpu.allocate(dtype, len)
    }
    fn upload(&self, tensor: &Tensor) -> Result<DeviceBuffer> {
        self.cpu.upload(tensor)
    }
    fn download(&self, buffer: &DeviceBuffer, spec: &TensorSpec) -> Result<Tensor> {
        self.cpu.download(buffer, spec)
    }
    fn copy_into(&self, src: BufferRef<'_>, dst: &mut DeviceBuffer, at: usize) -> Result<()> {
        self.copies.fetch_add(1, Ordering::SeqCst);
        self.cpu.copy_into(src, dst, at)
    }
    fn write_rows(
        &self,
        rows: BufferRef<'_>,
        slots: BufferRef<'_>,
        cache: BufferMut<'_>,
    ) -> Result<()> {
        self.cpu.write_rows(rows, slots, cache)
    }
    fn execute(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        if self.capturing.load(Ordering::SeqCst)
            && self.fail.load(Ordering::SeqCst)
            && *op == Op::Softmax
        {
            return Err(KptError::InvalidArgument("cannot be recorded".into()));
        }
        self.cpu.execute(kernel, op, inputs, outputs)
    }
    fn write(&self, tensor: &Tensor, dst: &mut DeviceBuffer) -> Result<()> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.cpu.write(tensor, dst)
    }
    fn buffer_address(&self, buffer: &DeviceBuffer) -> Option<u64> {
        self.cpu.buffer_address(buffer)
    }
    fn capture(
        &self,
        work: &mut (dyn FnMut() -> Result<()> + Send),
    ) -> Result<Option<Box<dyn CapturedRun>>> {
        self.captures.fetch_add(1, Ordering::SeqCst);
        self.capturing.store(true, Ordering::SeqCst);
        let r = work();
        self.capturing.store(false, Ordering::SeqCst);
        r?;
        Ok(Some(Box::new(Replay {
            replays: Arc::clone(&self.replays),
            bad: Arc::clone(&self.bad),
        })))
    }
    fn synchronize(&self) -> Result<()> {
        self.cpu.synchronize()
    }
    fn memory_stats(&self) -> MemoryStats {
        self.cpu.memory_stats()
    }
}

/// `CacheWrite(cache [ROWS, D], row [1, D], slot [1])` -> the cache (kept on the
/// device), `softmax(row)` (on the host) and `row + row` (on the device).
fn decode_graph() -> Graph {
    let mut g = Graph::new();
    let cache = g.input("cache", DType::F32, &[ROWS, D]);
    let row = g.input("row", DType::F32, &[1, D]);
    let slot = g.input("slot", DType::I64, &[1]);
    let written = g.op("write", Op::CacheWrite, &[cache, row, slot]).unwrap();
    let probs = g.op("softmax", Op::Softmax, &[row]).unwrap();
    let twice = g.op("twice", Op::Add, &[row, row]).unwrap();
    g.output(written).unwrap();
    g.output(probs).unwrap();
    g.output(twice).unwrap();
    g
}

fn executor(backend: Arc<dyn Backend>) -> Executor {
    let plan = auto_optimize(
        &decode_graph(),
        OptLevel::Conservative,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap();
    Executor::new(plan, backend).unwrap()
}

fn row(step: usize) -> Tensor {
    let v: Vec<f32> = (0..D).map(|i| (step * D + i) as f32 * 0.25).collect();
    Tensor::from_vec(v, &[1, D]).unwrap()
}

/// A decode step's inputs: the cache, the row (on the host or the device) and the slot.
fn step_inputs(cache: DeviceTensor, row: RunTensor, slot: i64) -> Vec<RunTensor> {
    vec![
        RunTensor::Device(cache),
        row,
        RunTensor::Host(Tensor::from_vec(vec![slot], &[1]).unwrap()),
    ]
}

/// The recording backend, an executor on it with captured runs on, and a zero cache.
fn recorded() -> (Arc<Recording>, Executor, DeviceTensor) {
    let rec = Recording::new();
    let backend: Arc<dyn Backend> = rec.clone();
    let mut exec = executor(backend.clone());
    exec.set_graphs(true);
    let cache = zero_cache(backend.as_ref());
    (rec, exec, cache)
}

/// One decode step: writes `row` at `slot`; returns the cache and the host outputs.
fn step(
    exec: &mut Executor,
    cache: DeviceTensor,
    row: &Tensor,
    slot: i64,
) -> (DeviceTensor, Tensor, Tensor) {
    let backend = exec.backend().clone();
    let inputs = step_inputs(cache, RunTensor::Host(row.clone()), slot);
    let mut out = exec
        .run_resident(inputs, &[true, false, true])
        .unwrap()
        .into_iter();
    let (Some(RunTensor::Device(cache)), Some(RunTensor::Host(probs)), Some(twice)) =
        (out.next(), out.next(), out.next())
    else {
        panic!("cache and `twice` on the device, softmax on the host");
    };
    let twice = twice.into_host(backend.as_ref()).unwrap();
    (cache, probs, twice)
}

fn zero_cache(backend: &dyn Backend) -> DeviceTensor {
    DeviceTensor::upload(backend, &Tensor::zeros(DType::F32, &[ROWS, D])).unwrap()
}

#[test]
fn the_second_run_of_a_signature_is_captured_and_later_ones_replay() {
    let (rec, mut exec, mut cache) = recorded();
    let backend: Arc<dyn Backend> = rec.clone();
    let address = backend.buffer_address(&cache.buffer);
    let r = row(1);
    let mut first = None;
    for s in 0..5 {
        let (c, probs, twice) = step(&mut exec, cache, &r, 2);
        cache = c;
        assert_eq!(
            backend.buffer_address(&cache.buffer),
            address,
            "written in place"
        );
        let got = (probs, twice, cache.download(backend.as_ref()).unwrap());
        assert_eq!(first.get_or_insert_with(|| got.clone()), &got, "step {s}");
        assert_eq!(exec.captured(), s >= 1, "step {s}");
    }
    assert_eq!(rec.captures.load(Ordering::SeqCst), 1);
    assert_eq!(
        rec.replays.load(Ordering::SeqCst),
        4,
        "the capture's own replay too"
    );
    assert_eq!(
        exec.graph_stats(),
        GraphStats {
            captures: 1,
            replays: 3,
            failures: 0
        }
    );
    // Two host inputs written into the capture's buffers by the capture; the replays'
    // inputs held the same contents, so they were not written again.
    assert_eq!(rec.writes.load(Ordering::SeqCst), 2);
    // A new row is written (the slot, the same, is not), and so is the old one after it.
    let (c, ..) = step(&mut exec, cache, &row(2), 2);
    cache = c;
    assert_eq!(rec.writes.load(Ordering::SeqCst), 3);
    let (c, ..) = step(&mut exec, cache, &r, 2);
    cache = c;
    assert_eq!(rec.writes.load(Ordering::SeqCst), 4);

    // Another cache buffer is another signature: a normal run, then its own capture.
    let other = zero_cache(backend.as_ref());
    let (other, ..) = step(&mut exec, other, &r, 3);
    assert_eq!(exec.graph_stats().captures, 1);
    let (mut other, ..) = step(&mut exec, other, &r, 3);
    assert_eq!(exec.graph_stats().captures, 2);
    let want: Vec<f64> = (0..ROWS * D)
        .map(|i| {
            if i / D == 3 {
                0.25 * (D + i % D) as f64
            } else {
                0.0
            }
        })
        .collect();
    assert_eq!(other.download(backend.as_ref()).unwrap().to_f64_vec(), want);

    // Both signatures in turn keep their captures. The first records once more: the
    // other's normal run handed a slot it reads (`twice`, kept on the device) to the
    // caller. Then both replay.
    let (c, ..) = step(&mut exec, cache, &r, 2);
    cache = c;
    assert_eq!(exec.graph_stats().captures, 3);
    let replays = exec.graph_stats().replays;
    for _ in 0..3 {
        let (c, probs, twice) = step(&mut exec, cache, &r, 2);
        cache = c;
        let got = (probs, twice, cache.download(backend.as_ref()).unwrap());
        assert_eq!(first.as_ref(), Some(&got));
        other = step(&mut exec, other, &r, 3).0;
    }
    assert_eq!(exec.graph_stats().captures, 3);
    assert_eq!(exec.graph_stats().replays, replays + 6);
    assert_eq!(other.download(backend.as_ref()).unwrap().to_f64_vec(), want);

    // Turning graphs off drops the capture; runs are normal again.
    exec.set_graphs(false);
    assert!(!exec.captured());
    step(&mut exec, other, &r, 3);
    assert_eq!(rec.captures.load(Ordering::SeqCst), 3);
}

#[test]
fn a_failed_capture_runs_normally_and_is_not_tried_again() {
    let (rec, mut exec, mut cache) = recorded();
    rec.fail.store(true, Ordering::SeqCst);
    let backend: Arc<dyn Backend> = rec.clone();
    let mut plain = executor(Arc::new(CpuBackend::new().unwrap()));
    let mut want_cache = zero_cache(plain.backend().as_ref());
    for s in 0..4 {
        let r = row(s);
        let slot = s as i64;
        let (c, probs, twice) = step(&mut exec, cache, &r, slot);
        let (w, want_probs, want_twice) = step(&mut plain, want_cache, &r, slot);
        assert_eq!((&probs, &twice), (&want_probs, &want_twice), "step {s}");
        assert_eq!(
            c.download(backend.as_ref()).unwrap(),
            w.download(plain.backend().as_ref()).unwrap(),
            "step {s}: the cache is the caller's again after the failed capture"
        );
        (cache, want_cache) = (c, w);
        assert!(!exec.captured());
    }
    assert_eq!(
        rec.captures.load(Ordering::SeqCst),
        1,
        "refused after one failure"
    );
    assert_eq!(exec.graph_stats().failures, 1);
    assert_eq!(rec.replays.load(Ordering::SeqCst), 0);
}

#[test]
fn the_cpu_backend_cannot_capture_and_runs_normally() {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let mut on = executor(backend.clone());
    on.set_graphs(true);
    assert!(on.graphs());
    let mut off = executor(backend.clone());
    let (mut a, mut b) = (zero_cache(backend.as_ref()), zero_cache(backend.as_ref()));
    for s in 0..4 {
        let r = row(s);
        let (ca, pa, ta) = step(&mut on, a, &r, s as i64);
        let (cb, pb, tb) = step(&mut off, b, &r, s as i64);
        assert_eq!((pa, ta), (pb, tb));
        assert_eq!(
            ca.download(backend.as_ref()).unwrap(),
            cb.download(backend.as_ref()).unwrap()
        );
        (a, b) = (ca, cb);
    }
    assert!(!on.captured());
    assert_eq!(on.graph_stats(), GraphStats::default());
    // `run` with host inputs only: the same.
    let inputs = [
        Tensor::zeros(DType::F32, &[ROWS, D]),
        row(2),
        Tensor::from_vec(vec![1i64], &[1]).unwrap(),
    ];
    for _ in 0..3 {
        assert_eq!(on.run(&inputs).unwrap(), off.run(&inputs).unwrap());
    }
}

#[test]
fn device_inputs_read_in_place_are_staged_so_new_buffers_still_replay() {
    let (rec, mut exec, mut cache) = recorded();
    for s in 0..5 {
        // A new buffer each run for the row, which no node updates in place.
        let r = DeviceTensor::upload(rec.as_ref(), &row(s)).unwrap();
        let copies = rec.copies.load(Ordering::SeqCst);
        let inputs = step_inputs(cache, RunTensor::Device(r), 1);
        let mut out = exec.enqueue(inputs, &[]).unwrap().into_iter().flatten();
        cache = out.next().unwrap();
        assert_eq!(exec.captured(), s >= 1, "step {s}");
        if s >= 1 {
            // Staged: the row copied into the capture's buffer, and the two outputs kept
            // on the device copied out of the capture's slots.
            assert_eq!(rec.copies.load(Ordering::SeqCst) - copies, 3, "step {s}");
        }
    }
    exec.finish().unwrap();
    assert_eq!(
        exec.graph_stats(),
        GraphStats {
            captures: 1,
            replays: 3,
            failures: 0
        }
    );
}

#[test]
fn queued_replays_report_their_deferred_checks_when_finished() {
    let (rec, mut exec, mut cache) = recorded();
    let inputs = |cache| step_inputs(cache, RunTensor::Host(row(1)), 0);
    for _ in 0..3 {
        cache = exec.enqueue(inputs(cache), &[]).unwrap().remove(0).unwrap();
    }
    exec.finish().unwrap();
    assert!(exec.captured());
    // The kernels of the next replay report bad input: not at the launch, at the wait.
    rec.bad.store(true, Ordering::SeqCst);
    cache = exec.enqueue(inputs(cache), &[]).unwrap().remove(0).unwrap();
    let err = exec.finish().unwrap_err().to_string();
    assert!(err.contains("bad input"), "{err}");
    assert!(!exec.captured(), "the captures are dropped after the error");
    // A run that waits checks too; after the error nothing is pending.
    rec.bad.store(false, Ordering::SeqCst);
    let (cache, ..) = step(&mut exec, cache, &row(1), 0);
    exec.finish().unwrap();
    drop(cache);
}

#[test]
fn outputs_not_wanted_by_a_queued_run_are_not_copied_out() {
    let (rec, mut exec, mut cache) = recorded();
    let address = rec.buffer_address(&cache.buffer);
    for s in 0..4 {
        let inputs = step_inputs(cache, RunTensor::Host(row(s)), 1);
        let copies = rec.copies.load(Ordering::SeqCst);
        // Nothing wanted: the cache, written in place, still comes back.
        let out = exec.enqueue(inputs, &[false, false, false]).unwrap();
        assert!(out[1].is_none() && out[2].is_none(), "step {s}");
        cache = out
            .into_iter()
            .next()
            .flatten()
            .expect("the cache comes back");
        assert_eq!(rec.buffer_address(&cache.buffer), address, "step {s}");
        if s >= 1 {
            assert_eq!(
                rec.copies.load(Ordering::SeqCst),
                copies,
                "step {s}: no copy out"
            );
        }
    }
    exec.finish().unwrap();
    assert_eq!(exec.graph_stats().replays, 2);
}
