//! Inputs of the cache-writing tests (`cache_write.rs`, `rotary_cache.rs`): random float
//! tensors and distinct cache slots, some negative (skipped).

use kpt_core::rand::SplitMix64 as Rng;
use kpt_core::{DType, Tensor};

/// Values in -2..2 of `dtype`.
pub fn random(rng: &mut Rng, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = rng.vec(n, -2.0, 2.0).into_iter().map(f64::from).collect();
    Tensor::from_f64(&v, shape, dtype).unwrap()
}

/// `n` distinct slots below `rows`, every third one negative (skipped).
pub fn slots(rng: &mut Rng, n: usize, rows: usize) -> Tensor {
    let mut all: Vec<i64> = (0..rows as i64).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i + 1));
    }
    let v = all[..n]
        .iter()
        .enumerate()
        .map(|(i, &s)| if i % 3 == 2 { -1 } else { s })
        .collect();
    Tensor::from_vec(v, &[n]).unwrap()
}
