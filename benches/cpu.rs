//! Criterion benchmarks of the CPU kernels (`cargo bench -p kpt-benches --bench cpu`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use kpt_core::dtype::f32_to_f8e4m3;
use kpt_kernels::cpu::{self, Act, AttentionShape, WeightsRef};

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                / (1u32 << 24) as f32)
                - 0.5
        })
        .collect()
}

fn linear(c: &mut Criterion) {
    let (k, n) = (2048, 2048);
    let w = data(n * k, 1);
    let w_bf16: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
    let w_f8: Vec<u8> = w.iter().map(|&x| f32_to_f8e4m3(x * 800.0)).collect();
    let mut g = c.benchmark_group("cpu/linear_silu");
    g.sample_size(20);
    for m in [1usize, 32] {
        let x = data(m * k, 2);
        let mut out = vec![0f32; m * n];
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        let cases: [(&str, WeightsRef<'_>); 3] = [
            ("f32", WeightsRef::F32(&w)),
            ("bf16", WeightsRef::BF16(&w_bf16)),
            (
                "f8e4m3",
                WeightsRef::F8E4M3 {
                    bits: &w_f8,
                    scale: 1.0 / 800.0,
                },
            ),
        ];
        for (name, weights) in cases {
            g.bench_function(BenchmarkId::new(name, format!("m{m}_{k}x{n}")), |b| {
                b.iter(|| cpu::linear(&x, weights, None, Some(Act::Silu), &mut out, m, k, n))
            });
        }
    }
    g.finish();
}

fn matmul(c: &mut Criterion) {
    let s = 512;
    let (a, b) = (data(s * s, 3), data(s * s, 4));
    let (ab, bb): (Vec<bf16>, Vec<bf16>) = (
        a.iter().map(|&x| bf16::from_f32(x)).collect(),
        b.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    let mut g = c.benchmark_group("cpu/matmul");
    g.sample_size(20);
    g.throughput(Throughput::Elements((2 * s * s * s) as u64));
    let mut out = vec![0f32; s * s];
    g.bench_function(BenchmarkId::new("f32", s), |bch| {
        bch.iter(|| cpu::matmul_f32(&a, &b, &mut out, s, s, s))
    });
    let mut outb = vec![bf16::ZERO; s * s];
    g.bench_function(BenchmarkId::new("bf16", s), |bch| {
        bch.iter(|| cpu::matmul_bf16(&ab, &bb, &mut outb, s, s, s))
    });
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu/attention");
    g.sample_size(10);
    for (seq, causal) in [(512usize, true), (512, false)] {
        let shape = AttentionShape::new(1, seq, seq, 8, 2, 64, causal);
        let q = data(seq * 8 * 64, 5);
        let kv = data(seq * 2 * 64, 6);
        let mut out = vec![0f32; q.len()];
        g.bench_function(
            BenchmarkId::new(
                if causal { "causal" } else { "full" },
                format!("s{seq}_h8_kv2_d64"),
            ),
            |b| b.iter(|| cpu::attention(&q, &kv, &kv, None, &mut out, &shape, 64, 64)),
        );
    }
    g.finish();
}

fn norms(c: &mut Criterion) {
    let (rows, dim) = (256, 4096);
    let x = data(rows * dim, 7);
    let w = vec![1f32; dim];
    let mut out = vec![0f32; x.len()];
    let mut g = c.benchmark_group("cpu/rowwise");
    g.throughput(Throughput::Bytes((2 * x.len() * 4) as u64));
    g.bench_function("rms_norm_256x4096", |b| {
        b.iter(|| cpu::rms_norm(&x, &w, &mut out, rows, dim, 1e-5))
    });
    g.bench_function("softmax_256x4096", |b| {
        b.iter(|| cpu::softmax(&x, &mut out, rows, dim))
    });
    let pos: Vec<i64> = (0..rows as i64).collect();
    g.bench_function("rotary_256x32x128", |b| {
        b.iter(|| cpu::rotary(&x, &pos, &mut out, 1, rows, 32, 128, 10000.0, None))
    });
    g.finish();
}

criterion_group!(benches, linear, matmul, attention, norms);
criterion_main!(benches);
