//! Decoder graphs run on a dense batch of sequences of one length, and decode steps with
//! the KV cache kept on the device (written in place), against the same sequences run
//! one at a time with host tensors.

mod common;

use common::{executor, inputs};
use kpt_core::exec::{DeviceTensor, RunTensor};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_models::generate::{decode_inputs, device_cache_with_room, host_cache_with_room};
use kpt_models::synthetic::{write_checkpoint, WriteOptions};
use kpt_models::{Checkpoint, Model, Phase};
use serde_json::json;

const PROMPTS: [[i64; 5]; 2] = [[3, 5, 17, 60, 33], [40, 2, 41, 9, 0]];

fn model() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({
        "model_type": "llama", "vocab_size": 61, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 128, "tie_word_embeddings": false
    });
    write_checkpoint(dir.path(), &config, WriteOptions::default()).unwrap();
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    (dir, model)
}

/// Row `i` of a `[batch, ..]` tensor as a `[1, ..]` tensor.
fn row(t: &Tensor, i: usize) -> Tensor {
    let mut shape = t.shape().to_vec();
    let b = shape[0];
    shape[0] = 1;
    let v: Vec<f32> = t.to_f64_vec().iter().map(|&x| x as f32).collect();
    let n = v.len() / b;
    Tensor::from_vec(v[i * n..(i + 1) * n].to_vec(), &shape).unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let worst = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "{what}: max diff {worst}");
}

/// Rows `..len` of a cache `[1, capacity, kv_dim]`.
fn valid(t: &Tensor, len: usize) -> Tensor {
    t.narrow(1, 0, len).unwrap().contiguous()
}

#[test]
fn a_dense_batch_matches_each_sequence_alone() {
    let (_dir, model) = model();
    let s = PROMPTS[0].len();
    let mut prefill = executor(&model.graph(Phase::Prefill, s).unwrap(), OptLevel::Balanced);
    let mut decode = executor(&model.graph(Phase::Decode, s).unwrap(), OptLevel::Balanced);
    let ids = Tensor::from_vec(PROMPTS.concat(), &[2, s]).unwrap();
    let positions = Tensor::from_vec((0..s as i64).collect(), &[s]).unwrap();
    let batch = prefill.run(&[ids, positions]).unwrap();
    // Both sequences decode at position s, each in its own block of the batch's caches.
    let caches: Vec<Tensor> = batch[1..]
        .iter()
        .map(|c| host_cache_with_room(c.clone(), s).unwrap())
        .collect();
    let capacity = caches[0].shape()[1];
    let mut step = decode_inputs(&[7, 11], s, capacity).unwrap();
    step.extend(caches);
    let batch_step = decode.run(&step).unwrap();
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let alone = prefill.run(&inputs(prompt, 0, &[])).unwrap();
        for (j, (b, a)) in batch.iter().zip(&alone).enumerate() {
            assert_close(
                &row(b, i),
                a,
                &format!("prefill output {j} of sequence {i}"),
            );
        }
        let token = [7i64, 11][i];
        let alone_step = decode.run(&inputs(&[token], s, &alone[1..])).unwrap();
        assert_close(&row(&batch_step[0], i), &alone_step[0], "decode logits");
        for (j, (b, a)) in batch_step[1..].iter().zip(&alone_step[1..]).enumerate() {
            let what = format!("cache {j} of sequence {i}");
            assert_close(&valid(&row(b, i), s + 1), &valid(a, s + 1), &what);
        }
    }
}

#[test]
fn device_resident_decode_matches_host_decode() {
    let (_dir, model) = model();
    let prompt = &PROMPTS[0];
    let s = prompt.len();
    let steps = 6;
    let mut prefill = executor(&model.graph(Phase::Prefill, s).unwrap(), OptLevel::Balanced);
    let mut decode = executor(&model.graph(Phase::Decode, s).unwrap(), OptLevel::Balanced);
    let mut resident = executor(&model.graph(Phase::Decode, s).unwrap(), OptLevel::Balanced);
    let backend = resident.backend().clone();
    let first = prefill.run(&inputs(prompt, 0, &[])).unwrap();
    let mut host_cache = first[1..].to_vec();
    // The first step's capacity has room for every step: each write runs in place.
    let mut caches: Vec<DeviceTensor> = host_cache
        .iter()
        .map(|t| {
            let d = DeviceTensor::upload(backend.as_ref(), t).unwrap();
            device_cache_with_room(d, s, backend.as_ref()).unwrap()
        })
        .collect();
    let capacity = caches[0].spec.shape[1];
    assert!(capacity >= s + steps);
    for step in 0..steps {
        let token = [9i64, 4, 60, 1, 22, 35][step];
        let want = decode
            .run(&inputs(&[token], s + step, &host_cache))
            .unwrap();
        let mut feed: Vec<RunTensor> = decode_inputs(&[token], s + step, capacity)
            .unwrap()
            .into_iter()
            .map(RunTensor::Host)
            .collect();
        feed.extend(caches.drain(..).map(RunTensor::Device));
        let keep: Vec<bool> = (0..want.len()).map(|i| i > 0).collect();
        let mut outs = resident.run_resident(feed, &keep).unwrap().into_iter();
        let logits = outs.next().unwrap().into_host(backend.as_ref()).unwrap();
        assert_close(&logits, &want[0], &format!("logits at step {step}"));
        for (o, w) in outs.zip(&want[1..]) {
            let RunTensor::Device(d) = o else {
                panic!("the cache left the device")
            };
            assert_eq!(d.spec.shape, w.shape(), "the cache keeps its capacity");
            assert_close(&d.download(backend.as_ref()).unwrap(), w, "cache");
            caches.push(d);
        }
        host_cache = want[1..].to_vec();
    }
}
