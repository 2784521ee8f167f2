//! `Executor::run_resident` on the CPU backend: values kept on the device between runs,
//! and a cache appended to in place when its buffer has room.

use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::{DeviceTensor, Executor, RunTensor};
use kpt_core::graph::{Graph, Op};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::{CpuBackend, KernelRegistry};

const D: usize = 4;

fn executor(graph: &Graph, backend: &Arc<dyn Backend>) -> Executor {
    let plan = auto_optimize(
        graph,
        OptLevel::Conservative,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .expect("plan");
    Executor::new(plan, backend.clone()).expect("executor")
}

/// cache `[1, T, D]` ++ row `[1, 1, D]` -> (softmax of the result, the result);
/// `also_read` makes a second node read the old cache, which forbids appending in place.
fn decode_graph(also_read: bool) -> Graph {
    let mut g = Graph::new();
    let past = g.input("past", DType::F32, &[1, 2, D]);
    let row = g.input("row", DType::F32, &[1, 1, D]);
    let cache = g
        .op("append", Op::Concat { axis: 1 }, &[past, row])
        .unwrap();
    let probs = g.op("softmax", Op::Softmax, &[cache]).unwrap();
    g.output(probs).unwrap();
    g.output(cache).unwrap();
    if also_read {
        let twice = g.op("twice", Op::Add, &[past, past]).unwrap();
        g.output(twice).unwrap();
    }
    g
}

fn row(step: usize) -> Tensor {
    let v = (0..D).map(|i| (step * D + i) as f32 * 0.25 - 1.0).collect();
    Tensor::from_vec(v, &[1, 1, D]).unwrap()
}

/// Feeds the cache back on the device for `steps` runs and checks every output against
/// the same graph run on host tensors; returns the cache buffer's length after each run.
fn run_steps(also_read: bool, capacity: usize, steps: usize) -> Vec<usize> {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let graph = decode_graph(also_read);
    let (mut resident, mut host) = (executor(&graph, &backend), executor(&graph, &backend));
    let start = Tensor::from_vec((0..2 * D).map(|i| i as f32 * 0.1).collect(), &[1, 2, D]).unwrap();
    let mut cache = DeviceTensor::upload(backend.as_ref(), &start)
        .unwrap()
        .with_capacity(backend.as_ref(), capacity)
        .unwrap();
    let mut host_cache = start;
    let mut lens = Vec::new();
    for step in 0..steps {
        let inputs = vec![RunTensor::Device(cache), RunTensor::Host(row(step))];
        let mut outs = resident.run_resident(inputs, &[false, true]).unwrap();
        let want = host.run(&[host_cache.clone(), row(step)]).unwrap();
        let RunTensor::Device(next) = outs.remove(1) else {
            panic!("the cache should stay on the device");
        };
        assert_eq!(next.spec.shape, vec![1, 3 + step, D]);
        assert_eq!(
            next.download(backend.as_ref()).unwrap(),
            want[1],
            "cache at step {step}"
        );
        let probs = outs.remove(0).into_host(backend.as_ref()).unwrap();
        assert_eq!(probs, want[0], "softmax at step {step}");
        if also_read {
            let twice = outs.remove(0).into_host(backend.as_ref()).unwrap();
            assert_eq!(twice, want[2], "second reader at step {step}");
        }
        lens.push(next.buffer.len());
        host_cache = want[1].clone();
        cache = next;
    }
    lens
}

#[test]
fn a_cache_with_room_is_appended_in_place() {
    // 2 rows + 5 appended fit 8 rows: the buffer allocated up front is kept every step.
    let lens = run_steps(false, 8 * D, 5);
    assert_eq!(lens, vec![8 * D; 5]);
}

#[test]
fn a_full_cache_falls_back_to_a_copy() {
    // Past 4 rows the appends need new buffers; the values stay right.
    let lens = run_steps(false, 4 * D, 5);
    assert_eq!(&lens[..2], &[4 * D, 4 * D]);
    assert!(lens[2..]
        .iter()
        .zip(3 + 2..)
        .all(|(&l, rows)| l >= rows * D));
}

#[test]
fn a_cache_read_twice_is_not_overwritten() {
    // The second reader sees the old cache, so the append must not run in place.
    let lens = run_steps(true, 8 * D, 3);
    assert!(lens.iter().zip(3..).all(|(&l, rows)| l >= rows * D));
}

#[test]
fn host_and_device_inputs_mix() {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let graph = decode_graph(false);
    let mut exec = executor(&graph, &backend);
    let past = Tensor::from_vec(vec![0.5f32; 2 * D], &[1, 2, D]).unwrap();
    let outs = exec
        .run_resident(
            vec![RunTensor::Host(past.clone()), RunTensor::Host(row(0))],
            &[],
        )
        .unwrap();
    assert!(outs.iter().all(|o| matches!(o, RunTensor::Host(_))));
    let want = exec.run(&[past, row(0)]).unwrap();
    let got: Vec<Tensor> = outs
        .into_iter()
        .map(|o| o.into_host(backend.as_ref()).unwrap())
        .collect();
    assert_eq!(got, want);
}

#[test]
fn copy_into_checks_its_bounds() {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let src = DeviceTensor::upload(backend.as_ref(), &row(0)).unwrap();
    let mut small = backend.allocate(DType::F32, D + 1).unwrap();
    assert!(backend
        .copy_into(
            kpt_core::backend::BufferRef {
                buffer: &src.buffer,
                spec: &src.spec
            },
            &mut small,
            2
        )
        .is_err());
    let mut wrong = backend.allocate(DType::F16, 2 * D).unwrap();
    assert!(src.with_capacity(backend.as_ref(), 0).is_ok());
    assert!(backend
        .copy_into(
            kpt_core::backend::BufferRef {
                buffer: &src.buffer,
                spec: &src.spec
            },
            &mut wrong,
            0
        )
        .is_err());
}
