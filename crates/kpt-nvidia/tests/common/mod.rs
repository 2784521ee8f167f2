//! Test data shared by kpt-nvidia's integration tests.

use kpt_core::rand::SplitMix64;
use kpt_core::tensor::Tensor;
use kpt_core::DType;

/// Values uniform in `[lo, hi)`, rounded to `dtype` (FP8: with an amax-based scale).
pub fn random(rng: &mut SplitMix64, shape: &[usize], dtype: DType, lo: f32, hi: f32) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = rng.vec(n, lo, hi).into_iter().map(f64::from).collect();
    Tensor::from_f64(&v, shape, dtype).unwrap()
}

/// An additive f32 attention mask `[seq_q, seq_kv]`, with whole masked-out keys (-inf)
/// now and then.
pub fn attention_mask(rng: &mut SplitMix64, seq_q: usize, seq_kv: usize) -> Tensor {
    let m: Vec<f64> = (0..seq_q * seq_kv)
        .map(|_| {
            let u = rng.next_f64();
            if u < 0.1 {
                f64::NEG_INFINITY
            } else {
                -2.0 * u
            }
        })
        .collect();
    Tensor::from_f64(&m, &[seq_q, seq_kv], DType::F32).unwrap()
}
