//! `CachePool`: released cache sets taken over by later sequences (same buffers, the
//! new prefix copied in), host caches written into released sets, and the bound on kept
//! sets. Generation on reused caches is in `generate.rs`.

use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::DeviceTensor;
use kpt_core::Tensor;
use kpt_kernels::CpuBackend;
use kpt_models::generate::{cache_capacity, CachePool};

fn backend() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new().unwrap())
}

/// Caches `[1, len, width]` of `layers` layers, filled with `fill + layer`.
fn caches(
    b: &dyn Backend,
    layers: usize,
    len: usize,
    width: usize,
    fill: f32,
) -> Vec<DeviceTensor> {
    (0..layers)
        .map(|l| {
            let t = Tensor::from_vec(vec![fill + l as f32; len * width], &[1, len, width]).unwrap();
            DeviceTensor::upload(b, &t).unwrap()
        })
        .collect()
}

fn addresses(b: &dyn Backend, set: &[DeviceTensor]) -> Vec<Option<u64>> {
    set.iter().map(|c| b.buffer_address(&c.buffer)).collect()
}

#[test]
fn a_released_set_is_taken_over_with_the_new_prefix() {
    let b = backend();
    let mut pool = CachePool::default();
    let first = pool
        .with_room(caches(b.as_ref(), 3, 5, 4, 1.0), 5, b.as_ref())
        .unwrap();
    assert_eq!(first[0].spec.shape, [1, cache_capacity(5), 4]);
    let kept = addresses(b.as_ref(), &first);
    pool.release(first);
    assert_eq!(pool.len(), 1);
    // A prompt of 7 tokens needs the same capacity: the released buffers come back.
    let second = pool
        .with_room(caches(b.as_ref(), 3, 7, 4, 10.0), 7, b.as_ref())
        .unwrap();
    assert!(pool.is_empty());
    assert_eq!(addresses(b.as_ref(), &second), kept);
    for (l, c) in second.iter().enumerate() {
        let v = c.download(b.as_ref()).unwrap().to_f64_vec();
        assert_eq!(v.len(), cache_capacity(7) * 4);
        assert!(
            v[..7 * 4].iter().all(|&x| x == 10.0 + l as f64),
            "layer {l}"
        );
    }
    // Caches with room are returned as they are; another capacity takes new buffers.
    let same = pool.with_room(second, 7, b.as_ref()).unwrap();
    assert_eq!(addresses(b.as_ref(), &same), kept);
    pool.release(same);
    let longer = pool
        .with_room(caches(b.as_ref(), 3, 40, 4, 0.0), 40, b.as_ref())
        .unwrap();
    assert_eq!(longer[0].spec.shape, [1, cache_capacity(40), 4]);
    assert_eq!(pool.len(), 1, "the set of the other capacity stays");
}

#[test]
fn host_caches_are_written_into_a_released_set_and_the_pool_is_bounded() {
    let b = backend();
    let mut pool = CachePool::default();
    let host = |fill: f32| vec![Tensor::from_vec(vec![fill; 2 * 8 * 3], &[2, 8, 3]).unwrap()];
    let set = pool.upload(host(1.0), b.as_ref()).unwrap();
    let kept = addresses(b.as_ref(), &set);
    pool.release(set);
    let again = pool.upload(host(2.0), b.as_ref()).unwrap();
    assert_eq!(addresses(b.as_ref(), &again), kept);
    assert_eq!(again[0].download(b.as_ref()).unwrap(), host(2.0)[0]);
    for i in 0..10 {
        pool.release(caches(b.as_ref(), 1, 4, 2, i as f32));
    }
    assert_eq!(pool.len(), 4);
    pool.release(Vec::new());
    assert_eq!(pool.len(), 4, "an empty set is not kept");
}
