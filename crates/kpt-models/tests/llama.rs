//! LLaMA-family checkpoints written to disk, loaded, lowered and run through kpt,
//! against an independent f64 forward pass of the raw weights.

mod common;

use std::path::Path;

use common::{
    budget, executor, inputs, llama_forward, rel_err, rows, run_ref, HfRope, LlamaSizes, Raw,
};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_models::llama::Llama;
use kpt_models::synthetic::{write_checkpoint, WriteOptions};
use kpt_models::{Checkpoint, ModelConfig, Phase};
use serde_json::{json, Value};

fn llama_config(model_type: &str) -> Value {
    json!({
        "model_type": model_type,
        "vocab_size": 61,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": false,
        "bos_token_id": 0,
        "eos_token_id": 1
    })
}

fn with(mut v: Value, key: &str, value: Value) -> Value {
    v[key] = value;
    v
}

/// [`LlamaSizes::of`] with the rotary parameters read from the config JSON itself, so the
/// reference's rope scaling does not go through kpt's parser.
fn sizes_json(cfg: &ModelConfig, json: &Value) -> LlamaSizes {
    LlamaSizes {
        rope: HfRope::from_config(json),
        ..LlamaSizes::of(cfg)
    }
}

fn load(dir: &Path, dtype: DType) -> (Checkpoint, Llama) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let ModelConfig::Llama(cfg) = &ckpt.config else {
        panic!("not a LLaMA config")
    };
    let model = Llama::load(cfg, &ckpt.weights, dtype).unwrap();
    (ckpt, model)
}

const PROMPT: [i64; 7] = [0, 5, 17, 60, 33, 2, 41];

/// Writes `config`, then checks kpt's f64 reference run of the lowered graph (f64
/// parameters) against the independent forward pass, and every optimization level's
/// CPU plan (f32 parameters) within that level's budget.
fn check_against_reference(config: Value, opts: WriteOptions) {
    let dir = tempfile::tempdir().unwrap();
    let parsed = write_checkpoint(dir.path(), &config, opts).unwrap();
    let want = llama_forward(
        &Raw::read(dir.path()),
        &sizes_json(&parsed, &config),
        &PROMPT,
    );

    let (_, model64) = load(dir.path(), DType::F64);
    let graph = model64.graph(Phase::Prefill, PROMPT.len()).unwrap();
    let got = &run_ref(&graph, &inputs(&PROMPT, 0, &[]))[0];
    assert_eq!(got.shape(), &[1, PROMPT.len(), 61]);
    let err = rel_err(got, &want);
    // Not 1e-15: the ops carry eps and the softmax scale as f32.
    assert!(
        err < 1e-7,
        "{}: f64 reference vs independent: {err:e}",
        parsed.model_type()
    );

    let (_, model32) = load(dir.path(), DType::F32);
    let graph = model32.graph(Phase::Prefill, PROMPT.len()).unwrap();
    let err = rel_err(&run_ref(&graph, &inputs(&PROMPT, 0, &[]))[0], &want);
    assert!(err < 1e-6, "f32 parameters on the reference: {err:e}");
    for level in OptLevel::ALL {
        let mut exec = executor(&graph, level);
        let out = exec.run(&inputs(&PROMPT, 0, &[])).unwrap();
        let err = rel_err(&out[0], &want);
        assert!(
            err < budget(level),
            "{} at {level}: {err:e} > {:e}",
            parsed.model_type(),
            budget(level)
        );
    }
}

#[test]
fn llama_gqa_matches_reference() {
    check_against_reference(llama_config("llama"), WriteOptions::default());
}

#[test]
fn llama_tied_embeddings_match_reference() {
    let cfg = with(llama_config("llama"), "tie_word_embeddings", json!(true));
    check_against_reference(cfg, WriteOptions::seeded(5));
}

#[test]
fn llama_bf16_checkpoint_matches_reference() {
    check_against_reference(
        llama_config("llama"),
        WriteOptions {
            seed: 9,
            dtype: DType::BF16,
            shards: 1,
        },
    );
}

#[test]
fn f16_sharded_checkpoint_matches_reference() {
    check_against_reference(
        llama_config("llama"),
        WriteOptions {
            seed: 10,
            dtype: DType::F16,
            shards: 2,
        },
    );
}

#[test]
fn qwen2_qkv_bias_matches_reference() {
    let cfg = with(llama_config("qwen2"), "tie_word_embeddings", json!(true));
    check_against_reference(cfg, WriteOptions::seeded(3));
}

/// A scaled checkpoint: kpt matches the independent forward pass (every level), the
/// scaling changes the logits (against the same weights unscaled), and, unless the
/// scaling follows the sequence length (dynamic), a decode step on the prefill's cache
/// matches the forward pass over the longer sequence.
fn check_rope_scaling(config: Value, seed: u64, decode: bool) {
    check_against_reference(config.clone(), WriteOptions::seeded(seed));
    let dir = tempfile::tempdir().unwrap();
    let opts = WriteOptions::seeded(seed);
    let parsed = write_checkpoint(dir.path(), &config, opts).unwrap();
    let ModelConfig::Llama(c) = &parsed else {
        panic!("not a LLaMA config")
    };
    assert!(c.rope_scaling.is_some());
    let raw = Raw::read(dir.path());
    let scaled = sizes_json(&parsed, &config);
    let (_, model) = load(dir.path(), DType::F64);
    let n = PROMPT.len();
    let got = &run_ref(
        &model.graph(Phase::Prefill, n).unwrap(),
        &inputs(&PROMPT, 0, &[]),
    )[0];
    let plain = llama_forward(&raw, &LlamaSizes::of(&parsed), &PROMPT);
    assert!(
        rel_err(got, &plain) > 1e-4,
        "the scaling must change the logits: {:e}",
        rel_err(got, &plain)
    );
    if decode {
        let pre = run_ref(
            &model.graph(Phase::Prefill, n - 1).unwrap(),
            &inputs(&PROMPT[..n - 1], 0, &[]),
        );
        let dec = run_ref(
            &model.graph(Phase::Decode, n - 1).unwrap(),
            &inputs(&PROMPT[n - 1..], n - 1, &pre[1..]),
        );
        let full = llama_forward(&raw, &scaled, &PROMPT);
        let err = rel_err(&dec[0], &full[n - 1..]);
        assert!(err < 1e-7, "decode: {err:e}");
    }
}

#[test]
fn llama3_rope_scaling_matches_reference() {
    // head_dim 8: wavelengths 2π·(1, 10, 100, 1000); with an original context of 64
    // the first pair is kept, the second smoothed, the last two divided by 8.
    let mut cfg = llama_config("llama");
    cfg["max_position_embeddings"] = json!(512);
    cfg["rope_scaling"] = json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64
    });
    check_rope_scaling(cfg, 21, true);
}

#[test]
fn linear_rope_scaling_matches_reference() {
    let cfg = with(
        llama_config("llama"),
        "rope_scaling",
        json!({"type": "linear", "factor": 2.0}),
    );
    check_rope_scaling(cfg, 22, true);
}

#[test]
fn yarn_rope_scaling_matches_reference() {
    // Qwen2's YaRN entry; head_dim 8, original 2048: the ramp runs over dimensions 1..3
    // (pair 0 extrapolated, 1 extrapolated, 2 half way, 3 interpolated), and cos/sin
    // carry 0.1 ln 4 + 1.
    let mut cfg = llama_config("qwen2");
    cfg["max_position_embeddings"] = json!(8192);
    cfg["rope_scaling"] = json!({
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048
    });
    check_rope_scaling(cfg, 23, true);
}

#[test]
fn dynamic_rope_scaling_matches_reference() {
    // A trained length of 4 below the prompt's 7 positions, so the base grows.
    let mut cfg = llama_config("llama");
    cfg["max_position_embeddings"] = json!(4);
    cfg["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0});
    check_rope_scaling(cfg, 24, false);
}

#[test]
fn mistral_sliding_window_matches_reference() {
    // A window shorter than the prompt, so it changes the result.
    let cfg = with(llama_config("mistral"), "sliding_window", json!(3));
    check_against_reference(cfg.clone(), WriteOptions::seeded(4));
    // And it does change it: the same weights without the window differ.
    let dir = tempfile::tempdir().unwrap();
    let parsed = write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(4)).unwrap();
    let raw = Raw::read(dir.path());
    let mut no_window = LlamaSizes::of(&parsed);
    no_window.windows = vec![None; no_window.layers];
    let (_, model) = load(dir.path(), DType::F64);
    let got = &run_ref(
        &model.graph(Phase::Prefill, PROMPT.len()).unwrap(),
        &inputs(&PROMPT, 0, &[]),
    )[0];
    assert!(rel_err(got, &llama_forward(&raw, &no_window, &PROMPT)) > 1e-3);
}

#[test]
fn qwen2_window_on_later_layers_matches_reference() {
    // Layer 0 attends fully, layer 1 through a window of 2.
    let mut cfg = llama_config("qwen2");
    cfg["sliding_window"] = json!(2);
    cfg["use_sliding_window"] = json!(true);
    cfg["max_window_layers"] = json!(1);
    check_against_reference(cfg, WriteOptions::seeded(8));
}

#[test]
fn head_dim_wider_than_hidden_over_heads() {
    // Qwen3/Gemma-style explicit head_dim: q_dim (4 * 16 = 64) differs from hidden (32).
    let cfg = with(llama_config("llama"), "head_dim", json!(16));
    check_against_reference(cfg, WriteOptions::seeded(6));
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let single = tempfile::tempdir().unwrap();
    let sharded = tempfile::tempdir().unwrap();
    let opts = WriteOptions::seeded(11);
    write_checkpoint(single.path(), &llama_config("llama"), opts).unwrap();
    write_checkpoint(
        sharded.path(),
        &llama_config("llama"),
        WriteOptions { shards: 3, ..opts },
    )
    .unwrap();
    assert!(sharded
        .path()
        .join("model.safetensors.index.json")
        .is_file());
    assert!(!sharded.path().join("model.safetensors").exists());
    let (a, ma) = load(single.path(), DType::F32);
    let (b, mb) = load(sharded.path(), DType::F32);
    assert_eq!((a.weights.num_shards(), b.weights.num_shards()), (1, 3));
    assert_eq!(a.weights.names(), b.weights.names());
    let ins = inputs(&PROMPT, 0, &[]);
    let ya = run_ref(&ma.graph(Phase::Prefill, PROMPT.len()).unwrap(), &ins);
    let yb = run_ref(&mb.graph(Phase::Prefill, PROMPT.len()).unwrap(), &ins);
    assert_eq!(ya[0], yb[0]);
}

/// Prefill of the first `n - 1` tokens then one decode step gives the last row of a
/// prefill of all `n` tokens, and the extended cache equals the full prefill's.
#[test]
fn prefill_then_decode_equals_full_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = with(llama_config("mistral"), "sliding_window", json!(4));
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(21)).unwrap();
    let (_, model) = load(dir.path(), DType::F32);
    let n = PROMPT.len();
    let layers = model.config.num_hidden_layers;
    let full_graph = model.graph(Phase::Prefill, n).unwrap();
    let pre_graph = model.graph(Phase::Prefill, n - 1).unwrap();
    let dec_graph = model.graph(Phase::Decode, n - 1).unwrap();
    // ids, positions, slots, block table, lengths, then the caches.
    assert_eq!(dec_graph.inputs().len(), 5 + 2 * layers);
    assert_eq!(dec_graph.outputs().len(), 1 + 2 * layers);

    let full = run_ref(&full_graph, &inputs(&PROMPT, 0, &[]));
    let last_row = rows(&full[0]).pop().unwrap();
    let pre = run_ref(&pre_graph, &inputs(&PROMPT[..n - 1], 0, &[]));
    let cache: Vec<Tensor> = pre[1..]
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let dec = run_ref(&dec_graph, &inputs(&PROMPT[n - 1..], n - 1, &cache));
    assert!(rel_err(&dec[0], std::slice::from_ref(&last_row)) < 1e-6);
    for (a, b) in dec[1..].iter().zip(&full[1..]) {
        // The step wrote row n - 1 of a cache grown to its capacity; the rest is zero.
        let cap = kpt_models::generate::cache_capacity(n - 1);
        assert_eq!(a.shape(), &[1, cap, model.config.kv_dim()]);
        let written = a.narrow(1, 0, n).unwrap().contiguous();
        assert!(rel_err(&written, &rows(b)) < 1e-6);
        let rest = a.narrow(1, n, cap - n).unwrap().to_f64_vec();
        assert!(rest.iter().all(|&x| x == 0.0));
    }

    // The same through the optimized CPU plans at each level, cache fed from plan to plan.
    for level in OptLevel::ALL {
        let mut pre_exec = executor(&pre_graph, level);
        let mut dec_exec = executor(&dec_graph, level);
        let pre = pre_exec.run(&inputs(&PROMPT[..n - 1], 0, &[])).unwrap();
        let dec = dec_exec
            .run(&inputs(&PROMPT[n - 1..], n - 1, &pre[1..]))
            .unwrap();
        let err = rel_err(&dec[0], std::slice::from_ref(&last_row));
        assert!(err < budget(level), "decode at {level}: {err:e}");
    }
}

#[test]
fn generation_config_and_tokenizer_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    // Byte-level BPE: 256 bytes, 3 special tokens, then merges.
    let cfg = with(llama_config("llama"), "vocab_size", json!(300));
    write_checkpoint(dir.path(), &cfg, WriteOptions::default()).unwrap();
    let vocab = kpt_models::synthetic::write_tokenizer(dir.path(), 300).unwrap();
    assert!(vocab > 259 && vocab <= 300, "vocab {vocab}");
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"bos_token_id": 0, "eos_token_id": [1, 2]}"#,
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let tok = ckpt.tokenizer().unwrap();
    assert_eq!(
        tok.special_tokens().eos,
        vec![1, 2],
        "generation_config wins"
    );
    assert!(tok.is_eos(2) && !tok.is_eos(3));
    let text = "the quick brown fox";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids[0], 0, "<s> first");
    assert!(ids.iter().all(|&i| (i as usize) < vocab));
    assert_eq!(tok.decode(&ids, true).unwrap(), text);
    // Streaming: multi-byte characters span several byte-level tokens.
    let text = "naïve café ✓ done";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() > text.chars().count() / 2);
    let mut stream = tok.stream(true);
    let mut streamed = String::new();
    let mut pieces = 0;
    for &id in &ids {
        if let Some(piece) = stream.step(id).unwrap() {
            streamed.push_str(&piece);
            pieces += 1;
        }
    }
    assert_eq!(streamed, text);
    assert!(pieces > 1);
    // The ids run through the model.
    let ids = tok.encode("the quick brown fox", true).unwrap();
    let model = ckpt.load_model(DType::F32).unwrap();
    assert!(model.is_decoder());
    let ids: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
    let out = run_ref(
        &model.graph(Phase::Prefill, ids.len()).unwrap(),
        &inputs(&ids, 0, &[]),
    );
    assert_eq!(out[0].shape(), &[1, ids.len(), 300]);
}

/// Parameters and activations in bf16 (the checkpoint's own dtype): kpt's reference and
/// every level's plan stay within the bf16 budget of the f64 forward pass.
#[test]
fn bf16_compute_dtype_within_budget() {
    let dir = tempfile::tempdir().unwrap();
    let opts = WriteOptions {
        seed: 12,
        dtype: DType::BF16,
        shards: 1,
    };
    let parsed = write_checkpoint(dir.path(), &llama_config("llama"), opts).unwrap();
    let want = llama_forward(&Raw::read(dir.path()), &LlamaSizes::of(&parsed), &PROMPT);
    let (_, model) = load(dir.path(), DType::BF16);
    let graph = model.graph(Phase::Prefill, PROMPT.len()).unwrap();
    let ins = inputs(&PROMPT, 0, &[]);
    let err = rel_err(&run_ref(&graph, &ins)[0], &want);
    assert!(err < budget(OptLevel::Balanced), "bf16 reference: {err:e}");
    for level in OptLevel::ALL {
        let out = executor(&graph, level).run(&ins).unwrap();
        assert_eq!(out[0].dtype(), DType::BF16);
        let err = rel_err(&out[0], &want);
        assert!(
            err < budget(OptLevel::Balanced).max(budget(level)),
            "bf16 at {level}: {err:e}"
        );
    }
}

/// The lowered graph is what the manager's passes expect: q/k/v and gate/up merge,
/// SwiGLU and residual + RMS norm fuse; and every level's plan passes kpt's validator
/// (per op and end to end against the f64 reference) on prefill and decode.
#[test]
fn manager_fuses_and_validator_passes_every_level() {
    use kpt_core::graph::OpKind;
    use kpt_core::validate::validate_plan;
    let dir = tempfile::tempdir().unwrap();
    let cfg = with(llama_config("qwen2"), "tie_word_embeddings", json!(true));
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(30)).unwrap();
    let (_, model) = load(dir.path(), DType::F32);
    let n = PROMPT.len();
    let prefill = model.graph(Phase::Prefill, n).unwrap();
    let decode = model.graph(Phase::Decode, n).unwrap();
    let pre_inputs = inputs(&PROMPT, 0, &[]);
    let cache: Vec<Tensor> = run_ref(&prefill, &pre_inputs)[1..]
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let dec_inputs = inputs(&[7], n, &cache);
    for level in OptLevel::ALL {
        for (graph, ins) in [(&prefill, &pre_inputs), (&decode, &dec_inputs)] {
            let mut exec = executor(graph, level);
            let optimized = exec.plan().graph.op_histogram();
            assert!(exec.plan().graph.nodes().len() < graph.nodes().len());
            for kind in [OpKind::ActAndMul, OpKind::AddRmsNorm, OpKind::SplitRotary] {
                assert!(
                    optimized.contains_key(&kind),
                    "{kind} missing at {level}: {optimized:?}"
                );
            }
            // The q/k/v split and both rotaries are one op per layer, which in a decode
            // step also writes k and v into the caches.
            for kind in [OpKind::Split, OpKind::Rotary, OpKind::CacheWrite] {
                assert!(
                    !optimized.contains_key(&kind),
                    "{kind} left at {level}: {optimized:?}"
                );
            }
            let into_caches = exec
                .plan()
                .graph
                .nodes()
                .iter()
                .filter(|n| matches!(n.op, kpt_core::graph::Op::SplitRotary { cache: true, .. }))
                .count();
            let decoding = std::ptr::eq(graph, &decode);
            assert_eq!(into_caches > 0, decoding, "{level}");
            let report =
                validate_plan(&mut exec, graph, &kpt_kernels::CpuReference, ins, 1.0).unwrap();
            assert!(report.passed(), "{level}: {report:?}");
        }
    }
}

/// A LLaMA decode step planned for an H100 at the balanced level: q/k/v merge into one
/// linear, and its split, the two rotaries and the two cache writes into one
/// `split_rotary(cache)` per layer on `cuda.split_rotary` (bf16 activations), so no
/// `rotary`, `split` or `cache_write` is left.
#[test]
fn balanced_gpu_decode_plan_has_split_rotary_and_no_rotary() {
    use kpt_core::graph::OpKind;
    use kpt_core::hardware::{DeviceInfo, DeviceKind};
    use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
    let dir = tempfile::tempdir().unwrap();
    let cfg = llama_config("llama");
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(31)).unwrap();
    let (_, model) = load(dir.path(), DType::F32);
    let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    let h100 = DeviceInfo {
        kind: DeviceKind::Cuda,
        index: 0,
        name: "H100".into(),
        memory_bytes: Some(80 << 30),
        compute_units: Some(132),
        arch: Some("sm_90".into()),
        features: vec!["cublaslt".into()],
        properties: Default::default(),
    };
    let decode = model.graph(Phase::Decode, 64).unwrap();
    let plan = auto_optimize(
        &decode,
        OptLevel::Balanced,
        &PrecisionPolicy::default(),
        &kpt_kernels::KernelRegistry::with_builtin(),
        &h100,
    )
    .unwrap();
    let hist = plan.graph.op_histogram();
    assert_eq!(hist.get(&OpKind::SplitRotary), Some(&layers), "{hist:?}");
    assert_eq!(hist.get(&OpKind::Rotary), None, "{hist:?}");
    assert_eq!(hist.get(&OpKind::Split), None, "{hist:?}");
    let fused = plan
        .reports
        .iter()
        .find(|r| r.pass == "fuse_split_rotary")
        .unwrap();
    assert_eq!(fused.changes.len(), layers, "{fused:?}");
    assert_eq!(hist.get(&OpKind::CacheWrite), None, "{hist:?}");
    for (node, choice) in plan.graph.nodes().iter().zip(&plan.kernels) {
        if node.op.kind() == OpKind::SplitRotary {
            assert!(matches!(
                node.op,
                kpt_core::graph::Op::SplitRotary { cache: true, .. }
            ));
            assert_eq!(choice.kernel, "cuda.split_rotary");
            let x = plan.graph.spec(node.inputs[0]).unwrap();
            assert_eq!(x.dtype, DType::BF16);
        }
    }
}

/// Prompts of different lengths packed into one prefill (variable-length attention)
/// give each prompt's own logits; the packed caches, cut per prompt, feed decode steps
/// that match a prefill of the longer prompt.
#[test]
fn packed_prefill_equals_separate_prompts() {
    use kpt_models::lower::{pack_prompts, unpack};
    let dir = tempfile::tempdir().unwrap();
    let cfg = with(llama_config("mistral"), "sliding_window", json!(3));
    let parsed = write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(31)).unwrap();
    let raw = Raw::read(dir.path());
    let (_, model) = load(dir.path(), DType::F32);
    let prompts: [&[i64]; 3] = [&[4, 8, 15, 16, 23], &[42], &[1, 2, 3, 5, 8, 13, 21]];
    let ins = pack_prompts(&prompts).unwrap();
    let cu = ins[2].as_slice::<i64>().unwrap().to_vec();
    let graph = model.graph_packed(13, 3).unwrap();
    let want: Vec<Vec<Vec<f64>>> = prompts
        .iter()
        .map(|p| llama_forward(&raw, &LlamaSizes::of(&parsed), p))
        .collect();
    let flat: Vec<Vec<f64>> = want.iter().flatten().cloned().collect();
    let out = run_ref(&graph, &ins);
    assert!(rel_err(&out[0], &flat) < 1e-6);
    for level in OptLevel::ALL {
        let got = executor(&graph, level).run(&ins).unwrap();
        let err = rel_err(&got[0], &flat);
        assert!(err < budget(level), "packed at {level}: {err:e}");
    }
    // Per-prompt logits and caches, then one decode step of each prompt.
    let logits = unpack(&out[0], &cu).unwrap();
    let caches: Vec<Vec<Tensor>> = out[1..]
        .iter()
        .map(|t| unpack(&t.to_dtype(DType::F32).unwrap(), &cu).unwrap())
        .collect();
    for (i, prompt) in prompts.iter().enumerate() {
        assert!(rel_err(&logits[i], &want[i]) < 1e-6);
        let n = prompt.len();
        let cache: Vec<Tensor> = caches.iter().map(|c| c[i].clone()).collect();
        let dec = run_ref(
            &model.graph(Phase::Decode, n).unwrap(),
            &inputs(&[9], n, &cache),
        );
        let mut longer = prompt.to_vec();
        longer.push(9);
        let full = llama_forward(&raw, &LlamaSizes::of(&parsed), &longer);
        assert!(rel_err(&dec[0], &full[n..]) < 1e-6, "prompt {i}");
    }
    assert!(unpack(&out[0], &[0, 5, 6]).is_err());
    assert!(pack_prompts(&[&[1], &[]]).is_err());
    let packed = kpt_models::Model::Llama(model).graph_packed(13, 3).unwrap();
    assert_eq!(packed.inputs().len(), 3);
}
