//! `Op::CacheWrite` on the CPU backend against the f64 reference: random caches, row
//! counts and slots (negative ones skipped), every float dtype, written in place by the
//! executor or through a copy, and the typed error for a slot past the cache.

use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::{DeviceTensor, Executor, RunTensor};
use kpt_core::graph::{Graph, Op};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::rand::SplitMix64 as Rng;
use kpt_core::validate::ReferenceOps;
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::{CpuBackend, CpuReference, KernelRegistry};
use proptest::prelude::*;

#[path = "support/caches.rs"]
mod caches;
use caches::{random, slots};

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

fn backend() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new().unwrap())
}

/// `CacheWrite(cache, rows, slots)`; with `also_output_cache` the old cache is a graph
/// output too, so the executor must write into a copy.
fn graph(cache: &[usize], rows: &[usize], dtype: DType, also_output_cache: bool) -> Graph {
    let mut g = Graph::new();
    let c = g.input("cache", dtype, cache);
    let r = g.input("rows", dtype, rows);
    let s = g.input(
        "slots",
        DType::I64,
        &[rows[..rows.len() - 1].iter().product()],
    );
    let out = g.op("write", Op::CacheWrite, &[c, r, s]).unwrap();
    g.output(out).unwrap();
    if also_output_cache {
        g.output(c).unwrap();
    }
    g
}

fn executor(g: &Graph, backend: &Arc<dyn Backend>) -> Executor {
    let plan = auto_optimize(
        g,
        OptLevel::Balanced,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap();
    assert_eq!(plan.kernels[0].kernel, "cpu.cache_write");
    Executor::new(plan, backend.clone()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn cache_write_matches_the_reference(
        blocks in 1usize..=4, block_size in 1usize..=17, row in 1usize..=40,
        fill in 0.0f64..=1.0, d in 0usize..4, copy in any::<bool>(), seed in any::<u64>(),
    ) {
        let dtype = DTYPES[d];
        let mut rng = Rng::new(seed);
        let cache_shape = [blocks, block_size, row];
        let n = (fill * (blocks * block_size) as f64) as usize;
        let rows_shape = [n, 1, row];
        let inputs = [
            random(&mut rng, &cache_shape, dtype),
            random(&mut rng, &rows_shape, dtype),
            slots(&mut rng, n, blocks * block_size),
        ];
        let want = CpuReference.eval(&Op::CacheWrite, &inputs).unwrap();
        let backend = backend();
        let g = graph(&cache_shape, &rows_shape, dtype, copy);
        let got = executor(&g, &backend).run(&inputs).unwrap();
        // Copies are exact: the reference's f64 values round back to the same elements.
        prop_assert_eq!(&got[0], &want[0].to_dtype(dtype).unwrap());
        if copy {
            prop_assert_eq!(&got[1], &inputs[0], "the input cache is left as it was");
        }
    }
}

#[test]
fn a_resident_cache_is_written_in_place_step_after_step() {
    let backend = backend();
    let (dtype, row) = (DType::BF16, 8);
    let g = graph(&[2, 4, row], &[2, 1, row], dtype, false);
    let mut exec = executor(&g, &backend);
    let mut rng = Rng::new(3);
    let start = random(&mut rng, &[2, 4, row], dtype);
    let mut host = start.clone();
    let mut cache = RunTensor::Device(DeviceTensor::upload(backend.as_ref(), &start).unwrap());
    for step in 0..4i64 {
        let rows = random(&mut rng, &[2, 1, row], dtype);
        // Sequence b appends at position `step` of its block b.
        let slots = Tensor::from_vec(vec![step, 4 + step], &[2]).unwrap();
        let want = CpuReference
            .eval(&Op::CacheWrite, &[host, rows.clone(), slots.clone()])
            .unwrap()
            .remove(0)
            .to_dtype(dtype)
            .unwrap();
        let inputs = vec![cache, RunTensor::Host(rows), RunTensor::Host(slots)];
        let out = exec.run_resident(inputs, &[true]).unwrap().remove(0);
        let RunTensor::Device(d) = &out else {
            panic!("the cache should stay on the device");
        };
        assert_eq!(d.download(backend.as_ref()).unwrap(), want, "step {step}");
        (cache, host) = (out, want);
    }
}

#[test]
fn a_slot_past_the_cache_is_a_typed_error() {
    let backend = backend();
    let g = graph(&[1, 4, 2], &[1, 1, 2], DType::F32, false);
    let inputs = [
        Tensor::zeros(DType::F32, &[1, 4, 2]),
        Tensor::zeros(DType::F32, &[1, 1, 2]),
        Tensor::from_vec(vec![4i64], &[1]).unwrap(),
    ];
    let err = executor(&g, &backend).run(&inputs).unwrap_err().to_string();
    assert!(err.contains("slot 4 is past the cache's 4 rows"), "{err}");
    let err = CpuReference
        .eval(&Op::CacheWrite, &inputs)
        .unwrap_err()
        .to_string();
    assert!(err.contains("slot 4"), "{err}");
}
