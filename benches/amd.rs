//! Criterion benchmarks of the ROCm backend on AMD GPU 0
//! (`cargo bench -p kpt-benches --bench amd`): an RMSNorm, a softmax and a linear (rocBLAS)
//! in bf16 through `Backend::execute`, each on the kernel the registry selects for the
//! device, synchronized after every launch. Without a ROCm device it says why and
//! measures nothing. It has not run: no AMD GPU was available.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kpt_amd::{RocmBackend, RocmOptions};
use kpt_core::backend::{Backend, BufferMut, BufferRef};
use kpt_core::graph::{Op, TensorSpec};
use kpt_core::{DType, Tensor};
use kpt_kernels::KernelRegistry;

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut rng = kpt_core::rand::SplitMix64::new(seed);
    let v: Vec<f64> = (0..n).map(|_| rng.next_f64() - 0.5).collect();
    Tensor::from_f64(&v, shape, DType::BF16).expect("bf16 tensor")
}

/// Times `op` on `inputs` with the registry's first choice for the device.
fn bench_op(
    c: &mut Criterion,
    backend: &RocmBackend,
    name: &str,
    op: &Op,
    inputs: &[Tensor],
    flops: u64,
) {
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let registry = KernelRegistry::with_builtin();
    let Some(kernel) = registry
        .fallback_chain(op, &specs, backend.device())
        .into_iter()
        .next()
    else {
        eprintln!("amd bench {name}: no kernel");
        return;
    };
    let outs = op.infer(&specs).expect("valid op");
    let bufs: Vec<_> = inputs
        .iter()
        .map(|t| backend.upload(t).expect("upload"))
        .collect();
    let mut out_bufs: Vec<_> = outs
        .iter()
        .map(|s| backend.allocate(s.dtype, s.numel()).expect("allocate"))
        .collect();
    let mut g = c.benchmark_group("amd");
    g.throughput(Throughput::Elements(flops));
    g.bench_function(BenchmarkId::new(name, &kernel), |b| {
        b.iter(|| {
            let refs: Vec<_> = bufs
                .iter()
                .zip(&specs)
                .map(|(buffer, spec)| BufferRef { buffer, spec })
                .collect();
            let mut muts: Vec<_> = out_bufs
                .iter_mut()
                .zip(&outs)
                .map(|(buffer, spec)| BufferMut { buffer, spec })
                .collect();
            backend
                .execute(&kernel, op, &refs, &mut muts)
                .expect("execute");
            backend.synchronize().expect("synchronize");
        })
    });
    g.finish();
}

fn rocm(c: &mut Criterion) {
    let backend = match RocmBackend::new(0, RocmOptions::default()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("amd benches skipped: {e}");
            return;
        }
    };
    let (rows, dim) = (64, 4096);
    let x = tensor(&[rows, dim], 1);
    let w = tensor(&[dim], 2);
    bench_op(
        c,
        &backend,
        "rms_norm",
        &Op::RmsNorm { eps: 1e-6 },
        &[x.clone(), w],
        (rows * dim) as u64,
    );
    bench_op(
        c,
        &backend,
        "softmax",
        &Op::Softmax,
        std::slice::from_ref(&x),
        (rows * dim) as u64,
    );
    let n = 4096;
    let weights = tensor(&[n, dim], 3);
    bench_op(
        c,
        &backend,
        "linear",
        &Op::Linear { bias: false },
        &[x, weights],
        (2 * rows * n * dim) as u64,
    );
}

criterion_group!(benches, rocm);
criterion_main!(benches);
