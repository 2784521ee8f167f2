//! `XlaBackend` under kpt's manager and executor: a decoder block optimized at every
//! level, validated op by op against the f64 reference and run again, on XLA's CPU
//! plugin. Skipped (with a note) where no plugin is installed.

mod common;

use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::validate::{run_reference, validate_plan};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::{CpuReference, KernelRegistry};
use kpt_tpu::XlaBackend;

fn backend() -> Option<Arc<XlaBackend>> {
    common::client().map(|c| Arc::new(XlaBackend::new(&c, 0).expect("backend")))
}

#[test]
fn a_decoder_block_runs_on_xla_at_every_level() {
    let Some(backend) = backend() else {
        return;
    };
    let (graph, inputs) = common::decoder_block();
    let want = run_reference(&graph, &CpuReference, &inputs).unwrap();
    let registry = KernelRegistry::with_builtin();
    for level in OptLevel::ALL {
        let plan = auto_optimize(
            &graph,
            level,
            &PrecisionPolicy::default(),
            &registry,
            backend.device(),
        )
        .unwrap_or_else(|e| panic!("{level}: {e}"));
        let kernels: Vec<&str> = plan.kernels.iter().map(|k| k.kernel.as_str()).collect();
        let on_xla = kernels.iter().filter(|k| k.starts_with("xla.")).count();
        assert!(on_xla > 0, "{level}: {kernels:?}");
        // Every op of the block runs on XLA, the aggressive level's FP8 / int8 weights
        // included (dequantized in the programs).
        assert!(
            kernels.iter().all(|k| k.starts_with("xla.")),
            "{level}: {kernels:?}"
        );
        let dyn_backend: Arc<dyn Backend> = backend.clone();
        let mut exec = Executor::new(plan, dyn_backend).unwrap();
        let report = validate_plan(&mut exec, &graph, &CpuReference, &inputs, 1.0).unwrap();
        assert!(report.passed(), "{level}: {report:#?}");
        let got = exec.run(&inputs).unwrap();
        let (g, w) = (got[0].to_f64_vec(), want[0].to_f64_vec());
        let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
        let err = g
            .iter()
            .zip(&w)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        let budget = if level == OptLevel::Conservative {
            1e-4
        } else {
            5e-2
        };
        assert!(
            err <= budget * scale,
            "{level}: error {err:e} at scale {scale}"
        );
    }
    // One compile per distinct op and shapes, not per launch; the counters say so.
    let stats = backend.cache_stats();
    assert!(
        stats.misses > 0 && stats.entries as u64 == stats.misses && stats.hits > stats.misses,
        "{stats:?}"
    );
    let counters = backend.counters();
    let misses = counters
        .iter()
        .find(|(k, _)| k == "xla_compile_cache_misses")
        .map(|(_, v)| *v);
    assert_eq!(misses, Some(stats.misses), "{counters:?}");
}

#[test]
fn buffers_are_counted_and_a_limit_is_a_typed_error() {
    let Some(client) = common::client() else {
        return;
    };
    let backend = XlaBackend::new(&client, 0).unwrap().with_memory_limit(4096);
    let a = backend.allocate(DType::F32, 512).unwrap();
    assert_eq!(backend.memory_stats().allocated_bytes, 2048);
    let t = Tensor::from_f64(&[1.0; 256], &[16, 16], DType::F32).unwrap();
    let b = backend.upload(&t).unwrap();
    assert_eq!(backend.memory_stats().allocated_bytes, 3072);
    let e = backend.allocate(DType::F32, 512).unwrap_err();
    assert!(e.to_string().contains("out of device memory"), "{e}");
    drop(a);
    assert_eq!(backend.memory_stats().allocated_bytes, 1024);
    assert_eq!(backend.memory_stats().peak_bytes, 3072);
    let back = backend
        .download(&b, &kpt_core::TensorSpec::new(&[16, 16], DType::F32))
        .unwrap();
    assert_eq!(back.to_f64_vec(), t.to_f64_vec());
    assert!(
        backend.device().name.contains(" plugin)"),
        "{}",
        backend.device().name
    );
}

#[test]
fn cache_rows_are_written_in_place_and_a_slot_past_the_end_is_an_error() {
    let Some(client) = common::client() else {
        return;
    };
    use kpt_core::backend::{BufferMut, BufferRef};
    use kpt_core::TensorSpec;
    let backend = XlaBackend::new(&client, 0).unwrap();
    let cache_spec = TensorSpec::new(&[2, 3, 4], DType::F32);
    let rows_spec = TensorSpec::new(&[3, 4], DType::F32);
    let slots_spec = TensorSpec::new(&[3], DType::I64);
    let cache_vals: Vec<f64> = (0..24).map(f64::from).collect();
    let mut cache = backend
        .upload(&Tensor::from_f64(&cache_vals, &[2, 3, 4], DType::F32).unwrap())
        .unwrap();
    let rows = backend
        .upload(&Tensor::from_f64(&[-1.0; 12], &[3, 4], DType::F32).unwrap())
        .unwrap();
    let write = |cache: &mut kpt_core::backend::DeviceBuffer, slots: &[f64]| {
        let s = backend
            .upload(&Tensor::from_f64(slots, &[3], DType::I64).unwrap())
            .unwrap();
        backend.write_rows(
            BufferRef {
                buffer: &rows,
                spec: &rows_spec,
            },
            BufferRef {
                buffer: &s,
                spec: &slots_spec,
            },
            BufferMut {
                buffer: cache,
                spec: &cache_spec,
            },
        )
    };
    // Rows 4 and 0 of the six are replaced; -1 (padding) is skipped.
    write(&mut cache, &[4.0, -1.0, 0.0]).unwrap();
    let got = backend.download(&cache, &cache_spec).unwrap().to_f64_vec();
    for (r, row) in got.chunks(4).enumerate() {
        let want: Vec<f64> = if r == 4 || r == 0 {
            vec![-1.0; 4]
        } else {
            cache_vals[r * 4..r * 4 + 4].to_vec()
        };
        assert_eq!(row, want.as_slice(), "row {r}");
    }
    let e = write(&mut cache, &[6.0, 0.0, 1.0]).unwrap_err();
    assert!(e.to_string().contains("past the cache"), "{e}");
}

/// Packed and paged attention read their offsets, lengths and block ids on the host
/// first: a bad one is the reference's typed error, not a clamped index in XLA.
#[test]
fn bad_attention_indices_are_typed_errors() {
    let Some(client) = common::client() else {
        return;
    };
    use kpt_core::backend::{BufferMut, BufferRef};
    use kpt_core::graph::{AttentionParams, Op};
    use kpt_core::TensorSpec;
    let backend = XlaBackend::new(&client, 0).unwrap();
    let run = |p: AttentionParams, tensors: Vec<Tensor>| {
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec::new(t.shape(), t.dtype()))
            .collect();
        let bufs: Vec<_> = tensors.iter().map(|t| backend.upload(t).unwrap()).collect();
        let ins: Vec<BufferRef<'_>> = bufs
            .iter()
            .zip(&specs)
            .map(|(buffer, spec)| BufferRef { buffer, spec })
            .collect();
        let out_spec = Op::Attention(p).infer(&specs).unwrap().remove(0);
        let mut out = backend.allocate(out_spec.dtype, out_spec.numel()).unwrap();
        backend.execute(
            "xla.attention",
            &Op::Attention(p),
            &ins,
            &mut [BufferMut {
                buffer: &mut out,
                spec: &out_spec,
            }],
        )
    };
    let zeros = |shape: &[usize]| Tensor::zeros(DType::F32, shape);
    let ids = |v: &[f64]| Tensor::from_f64(v, &[v.len()], DType::I64).unwrap();
    let mut varlen = AttentionParams::new(2, 1, 8, true);
    varlen.varlen = true;
    let packed = |cu_q: &[f64]| {
        vec![
            zeros(&[1, 5, 16]),
            zeros(&[1, 5, 8]),
            zeros(&[1, 5, 8]),
            ids(cu_q),
            ids(&[0.0, 2.0, 5.0]),
        ]
    };
    run(varlen, packed(&[0.0, 2.0, 5.0])).unwrap();
    let e = run(varlen, packed(&[0.0, 3.0, 2.0])).unwrap_err();
    assert!(e.to_string().contains("decreases"), "{e}");
    let mut paged = AttentionParams::new(2, 1, 8, true);
    paged.paged = true;
    let cache = |table: &[f64], lens: &[f64]| {
        vec![
            zeros(&[2, 1, 16]),
            zeros(&[3, 2, 8]),
            zeros(&[3, 2, 8]),
            Tensor::from_f64(table, &[2, 2], DType::I64).unwrap(),
            ids(lens),
        ]
    };
    run(paged, cache(&[0.0, 1.0, 2.0, 0.0], &[4.0, 3.0])).unwrap();
    let e = run(paged, cache(&[0.0, 7.0, 2.0, 0.0], &[4.0, 3.0])).unwrap_err();
    assert!(e.to_string().contains("block_table[0][1] = 7"), "{e}");
    let e = run(paged, cache(&[0.0, 1.0, 2.0, 0.0], &[5.0, 3.0])).unwrap_err();
    assert!(e.to_string().contains("seq_lens[0] = 5"), "{e}");
}
