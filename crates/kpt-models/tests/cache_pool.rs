//! `CachePool`: released cache sets taken over by later sequences (same buffers, the
//! new prefix copied in), host caches written into released sets, the bound on kept
//! sets, and generation that reuses a longer sequence's caches giving the tokens a
//! fresh runner gives.

mod common;

use std::sync::Arc;

use common::executor;
use kpt_core::backend::Backend;
use kpt_core::exec::DeviceTensor;
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::CpuBackend;
use kpt_models::generate::{
    cache_capacity, CachePool, Generator, PlanRunner, SamplingParams, StopCondition,
};
use kpt_models::synthetic::{write_checkpoint, write_tokenizer, WriteOptions};
use kpt_models::{Checkpoint, Phase};
use serde_json::json;

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

#[test]
fn generation_on_reused_caches_equals_a_fresh_runner() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(9)).unwrap();
    write_tokenizer(dir.path(), 300).unwrap();
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let runner = || {
        let level = OptLevel::Balanced;
        PlanRunner::new(
            executor(&model.graph(Phase::Prefill, 4).unwrap(), level),
            executor(&model.graph(Phase::DecodeGreedy, 4).unwrap(), level),
        )
    };
    let run = |g: &mut Generator<PlanRunner>, prompt: &[u32], n: usize| {
        g.generate(
            &[prompt],
            &SamplingParams::greedy(),
            &StopCondition::new(n),
            None,
            |_| Ok(()),
        )
        .unwrap()
        .outputs
        .remove(0)
        .tokens
    };
    let (long, short): (&[u32], &[u32]) = (&[5, 9, 2, 7, 11, 3, 8, 4, 6, 10], &[12, 7, 3, 9, 5]);
    // The long sequence leaves its caches (with rows past the short one's length) to the
    // short one, whose first step needs the same capacity.
    let mut reused = Generator::for_model(runner(), &model).unwrap();
    run(&mut reused, long, 4);
    let got = run(&mut reused, short, 9);
    let mut fresh = Generator::for_model(runner(), &model).unwrap();
    assert_eq!(got, run(&mut fresh, short, 9));
}
