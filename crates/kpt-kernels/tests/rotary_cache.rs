//! `Op::SplitRotary` with `cache` (a split + rotary whose k and v the optimizer writes
//! straight into the caches) on the CPU backend, against the f64 reference of the ops it
//! replaces (the plain split + rotary, then one `CacheWrite` per cache): random shapes,
//! slots (negative ones skipped) and dtypes, with the caches written in place by the
//! executor or through copies, and device-resident caches kept in their buffers step
//! after step.

use std::sync::Arc;

use kpt_core::backend::{run_op, Backend};
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

/// The split + rotary of a decode step and its two cache writes.
struct Shapes {
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cache_rows: usize,
}

impl Shapes {
    fn plain(&self) -> Op {
        let (q, kv) = (self.q_heads * self.head_dim, self.kv_heads * self.head_dim);
        Op::SplitRotary {
            head_dim: self.head_dim,
            theta: 10_000.0,
            scaling: None,
            sizes: vec![q, kv, kv],
            cache: false,
        }
    }

    fn qkv(&self) -> [usize; 3] {
        let width = (self.q_heads + 2 * self.kv_heads) * self.head_dim;
        [1, self.tokens, width]
    }

    fn cache(&self) -> [usize; 2] {
        [self.cache_rows, self.kv_heads * self.head_dim]
    }
}

/// qkv, positions, k cache, v cache, slots -> split + rotary -> cache writes; outputs q
/// and both caches, and with `also_output_caches` the old caches too (so the executor
/// must write into copies).
fn graph(s: &Shapes, dtype: DType, also_output_caches: bool) -> Graph {
    let mut g = Graph::new();
    let qkv = g.input("qkv", dtype, &s.qkv());
    let pos = g.input("positions", DType::I64, &[s.tokens]);
    let kc = g.input("k_cache", dtype, &s.cache());
    let vc = g.input("v_cache", dtype, &s.cache());
    let slots = g.input("slots", DType::I64, &[s.tokens]);
    let parts = g.op_multi("rope", s.plain(), &[qkv, pos]).unwrap();
    let k = g
        .op("k_write", Op::CacheWrite, &[kc, parts[1], slots])
        .unwrap();
    let v = g
        .op("v_write", Op::CacheWrite, &[vc, parts[2], slots])
        .unwrap();
    for out in [parts[0], k, v] {
        g.output(out).unwrap();
    }
    if also_output_caches {
        g.output(kc).unwrap();
        g.output(vc).unwrap();
    }
    g
}

/// The plan of `g`: one fused op, on kpt's CPU kernel for f32 (the reference else).
fn executor(g: &Graph, backend: &Arc<dyn Backend>) -> Executor {
    let plan = auto_optimize(
        g,
        OptLevel::Balanced,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap();
    let kinds: Vec<String> = plan
        .graph
        .nodes()
        .iter()
        .map(|n| n.op.to_string())
        .collect();
    assert_eq!(kinds, ["split_rotary(cache)"]);
    let f32 = g.value(g.inputs()[0]).spec.dtype == DType::F32;
    let kernel = if f32 {
        "cpu.split_rotary"
    } else {
        "cpu.reference"
    };
    assert_eq!(plan.kernels[0].kernel, kernel);
    Executor::new(plan, backend.clone()).unwrap()
}

/// The unfused ops on the f64 reference: q, then each cache with its rows written.
fn reference(s: &Shapes, inputs: &[Tensor; 5]) -> Vec<Tensor> {
    let [qkv, pos, kc, vc, slots] = inputs;
    let parts = CpuReference
        .eval(&s.plain(), &[qkv.clone(), pos.clone()])
        .unwrap();
    let mut want = vec![parts[0].clone()];
    for (cache, rows) in [(kc, &parts[1]), (vc, &parts[2])] {
        let written = CpuReference
            .eval(
                &Op::CacheWrite,
                &[cache.clone(), rows.clone(), slots.clone()],
            )
            .unwrap();
        want.extend(written);
    }
    want
}

/// Largest error of `got` against `want` relative to `1 + |want|`.
fn max_error(got: &Tensor, want: &Tensor) -> f64 {
    got.to_f64_vec()
        .iter()
        .zip(want.to_f64_vec())
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f64::max)
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

fn check(got: &[Tensor], want: &[Tensor], dtype: DType) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        prop_assert_eq!(g.shape(), w.shape());
        let err = max_error(g, w);
        prop_assert!(err <= tolerance(dtype), "output {i}: error {err}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn split_rotary_into_caches_matches_the_unfused_reference(
        tokens in 1usize..=5, q_heads in 1usize..=5, kv_heads in 1usize..=3,
        half in prop::sample::select(vec![1usize, 3, 4, 8, 32, 64]), spare in 0usize..=9,
        d in 0usize..4, copy in any::<bool>(), seed in any::<u64>(),
    ) {
        let dtype = DTYPES[d];
        let s = Shapes { tokens, q_heads, kv_heads, head_dim: 2 * half, cache_rows: tokens + spare };
        let mut rng = Rng::new(seed);
        let positions: Vec<i64> = (0..tokens).map(|_| rng.below(5000) as i64).collect();
        let inputs = [
            random(&mut rng, &s.qkv(), dtype),
            Tensor::from_vec(positions, &[tokens]).unwrap(),
            random(&mut rng, &s.cache(), dtype),
            random(&mut rng, &s.cache(), dtype),
            slots(&mut rng, tokens, s.cache_rows),
        ];
        let want = reference(&s, &inputs);
        let backend = backend();
        let got = executor(&graph(&s, dtype, copy), &backend).run(&inputs).unwrap();
        check(&got[..3], &want, dtype)?;
        if copy {
            prop_assert_eq!(&got[3], &inputs[2], "the input k cache is left as it was");
            prop_assert_eq!(&got[4], &inputs[3], "the input v cache is left as it was");
        }
        // The fused op on its own through `execute` (copies), as a backend runs it.
        let op = s.plain().split_rotary_with_cache(true).unwrap();
        let kernel = if dtype == DType::F32 { "cpu.split_rotary" } else { "cpu.reference" };
        let direct = run_op(backend.as_ref(), kernel, &op, &inputs).unwrap();
        check(&direct, &want, dtype)?;
    }
}

#[test]
fn resident_caches_are_written_in_place_step_after_step() {
    let backend = backend();
    let dtype = DType::F32;
    let s = Shapes {
        tokens: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        cache_rows: 8,
    };
    let mut exec = executor(&graph(&s, dtype, false), &backend);
    let mut rng = Rng::new(5);
    let mut host = [
        random(&mut rng, &s.cache(), dtype),
        random(&mut rng, &s.cache(), dtype),
    ];
    let upload = |t: &Tensor| RunTensor::Device(DeviceTensor::upload(backend.as_ref(), t).unwrap());
    let mut caches = [upload(&host[0]), upload(&host[1])];
    let address = |r: &RunTensor| match r {
        RunTensor::Device(d) => backend.buffer_address(&d.buffer),
        RunTensor::Host(_) => None,
    };
    let addresses = caches.each_ref().map(address);
    for step in 0..3i64 {
        let qkv = random(&mut rng, &s.qkv(), dtype);
        let positions = Tensor::from_vec(vec![10 + step, 20 + step], &[2]).unwrap();
        // Sequence b appends at position `step` of its half of the cache.
        let slots = Tensor::from_vec(vec![step, 4 + step], &[2]).unwrap();
        let [k, v] = host.clone();
        let want = reference(&s, &[qkv.clone(), positions.clone(), k, v, slots.clone()]);
        let [kc, vc] = caches;
        let inputs = vec![
            RunTensor::Host(qkv),
            RunTensor::Host(positions),
            kc,
            vc,
            RunTensor::Host(slots),
        ];
        let mut out = exec
            .run_resident(inputs, &[false, true, true])
            .unwrap()
            .into_iter();
        let (Some(RunTensor::Host(q)), Some(k), Some(v)) = (out.next(), out.next(), out.next())
        else {
            panic!("q on the host, the caches on the device");
        };
        assert_eq!(
            [address(&k), address(&v)],
            addresses,
            "step {step}: the caches stay in their buffers"
        );
        let download = |r: &RunTensor| match r {
            RunTensor::Device(d) => d.download(backend.as_ref()).unwrap(),
            RunTensor::Host(t) => t.clone(),
        };
        let got = [q, download(&k), download(&v)];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = max_error(g, w);
            assert!(err <= tolerance(dtype), "step {step}, output {i}: {err}");
        }
        host = [got[1].clone(), got[2].clone()];
        caches = [k, v];
    }
}
