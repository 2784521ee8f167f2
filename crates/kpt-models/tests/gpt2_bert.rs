//! GPT-2 and BERT checkpoints written to disk, loaded, lowered and run through kpt,
//! against independent f64 forward passes of the raw weights.

mod common;

use common::{
    bert_forward, budget, executor, gpt2_forward, inputs, rel_err, rename_tensors, renamed, rows,
    run_ref, Raw,
};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_models::bert::{mean_pool, Bert};
use kpt_models::gpt2::Gpt2;
use kpt_models::synthetic::{write_checkpoint, WriteOptions};
use kpt_models::{Checkpoint, ModelConfig, Phase};
use serde_json::json;

const PROMPT: [i64; 6] = [3, 0, 44, 17, 9, 30];

fn gpt2_dir(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 50, "n_embd": 32, "n_layer": 2, "n_head": 4,
        "n_positions": 16, "n_inner": null, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 0
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(seed)).unwrap();
    dir
}

fn load_gpt2(dir: &std::path::Path, dtype: DType) -> Gpt2 {
    let ckpt = Checkpoint::open(dir).unwrap();
    let ModelConfig::Gpt2(cfg) = &ckpt.config else {
        panic!("not gpt2")
    };
    Gpt2::load(cfg, &ckpt.weights, dtype).unwrap()
}

#[test]
fn gpt2_matches_reference_at_every_level() {
    let dir = gpt2_dir(2);
    let want = gpt2_forward(&Raw::read(dir.path()), 32, 2, 4, 50, &PROMPT);
    let ins = inputs(&PROMPT, 0, &[]);
    let m64 = load_gpt2(dir.path(), DType::F64);
    let got = &run_ref(&m64.graph(Phase::Prefill, PROMPT.len()).unwrap(), &ins)[0];
    assert_eq!(got.shape(), &[1, PROMPT.len(), 50]);
    // Not 1e-15: the ops carry eps and the softmax scale as f32.
    let err = rel_err(got, &want);
    assert!(err < 1e-7, "f64 reference vs independent: {err:e}");
    let graph = load_gpt2(dir.path(), DType::F32)
        .graph(Phase::Prefill, PROMPT.len())
        .unwrap();
    for level in OptLevel::ALL {
        let out = executor(&graph, level).run(&ins).unwrap();
        let err = rel_err(&out[0], &want);
        assert!(err < budget(level), "gpt2 at {level}: {err:e}");
    }
}

#[test]
fn gpt2_prefill_then_decode_equals_full_prefill() {
    let dir = gpt2_dir(7);
    let model = load_gpt2(dir.path(), DType::F32);
    let n = PROMPT.len();
    let full = run_ref(
        &model.graph(Phase::Prefill, n).unwrap(),
        &inputs(&PROMPT, 0, &[]),
    );
    let last = rows(&full[0]).pop().unwrap();
    let pre = run_ref(
        &model.graph(Phase::Prefill, n - 1).unwrap(),
        &inputs(&PROMPT[..n - 1], 0, &[]),
    );
    let cache: Vec<Tensor> = pre[1..]
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    let dec_graph = model.graph(Phase::Decode, n - 1).unwrap();
    let dec = run_ref(&dec_graph, &inputs(&PROMPT[n - 1..], n - 1, &cache));
    assert!(rel_err(&dec[0], std::slice::from_ref(&last)) < 1e-6);
    let mut exec = executor(&dec_graph, OptLevel::Conservative);
    let dec = exec.run(&inputs(&PROMPT[n - 1..], n - 1, &cache)).unwrap();
    assert!(rel_err(&dec[0], std::slice::from_ref(&last)) < budget(OptLevel::Conservative));
}

#[test]
fn gpt2_position_past_the_table_is_an_error() {
    let dir = gpt2_dir(1);
    let model = load_gpt2(dir.path(), DType::F32);
    let graph = model.graph(Phase::Prefill, 2).unwrap();
    // n_positions is 16: position 16 has no embedding.
    assert!(run_ref_result(&graph, &inputs(&[1, 2], 15, &[])).is_err());
}

fn run_ref_result(graph: &kpt_core::Graph, ins: &[Tensor]) -> kpt_core::Result<Vec<Tensor>> {
    kpt_core::validate::run_reference(graph, &kpt_kernels::CpuReference, ins)
}

fn bert_inputs(ids: &[i64], types: &[i64]) -> Vec<Tensor> {
    let n = ids.len();
    vec![
        Tensor::from_vec(ids.to_vec(), &[1, n]).unwrap(),
        Tensor::from_vec(types.to_vec(), &[1, n]).unwrap(),
        Tensor::from_vec((0..n as i64).collect::<Vec<_>>(), &[n]).unwrap(),
    ]
}

#[test]
fn bert_matches_reference_and_pools() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "bert", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 16,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
        "pad_token_id": 0
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(13)).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let ModelConfig::Bert(c) = &ckpt.config else {
        panic!("not bert")
    };
    let types = [0, 0, 0, 1, 1, 1];
    let want = bert_forward(&Raw::read(dir.path()), 32, 2, 4, 1e-12, &PROMPT, &types);
    let ins = bert_inputs(&PROMPT, &types);

    assert!(!ckpt.load_model(DType::F32).unwrap().is_decoder());
    let m64 = Bert::load(c, &ckpt.weights, DType::F64).unwrap();
    let got = &run_ref(&m64.graph(PROMPT.len()).unwrap(), &ins)[0];
    assert_eq!(got.shape(), &[1, PROMPT.len(), 32]);
    let err = rel_err(got, &want);
    assert!(err < 1e-7, "f64 reference vs independent: {err:e}");

    let graph = Bert::load(c, &ckpt.weights, DType::F32)
        .unwrap()
        .graph(PROMPT.len())
        .unwrap();
    for level in OptLevel::ALL {
        let out = executor(&graph, level).run(&ins).unwrap();
        let err = rel_err(&out[0], &want);
        assert!(err < budget(level), "bert at {level}: {err:e}");
    }

    // Mean pooling against the mean of the reference rows, with and without a mask.
    let pooled = mean_pool(got, None).unwrap();
    for (j, p) in pooled.iter().enumerate() {
        let mean = want.iter().map(|r| r[j]).sum::<f64>() / want.len() as f64;
        assert!((f64::from(*p) - mean).abs() < 1e-5, "dim {j}");
    }
    let mask = [1, 1, 0, 1, 0, 0];
    let pooled = mean_pool(got, Some(&mask)).unwrap();
    let mean0 = (want[0][0] + want[1][0] + want[3][0]) / 3.0;
    assert!((f64::from(pooled[0]) - mean0).abs() < 1e-5);
    assert!(mean_pool(got, Some(&[0; 6])).is_err());
    assert!(mean_pool(got, Some(&[1; 5])).is_err());
}

/// `GPT2LMHeadModel` state dicts prefix every name with `transformer.`.
#[test]
fn gpt2_transformer_prefix_loads() {
    let dir = gpt2_dir(4);
    let want = gpt2_forward(&Raw::read(dir.path()), 32, 2, 4, 50, &PROMPT);
    rename_tensors(dir.path(), |n| format!("transformer.{n}"));
    let model = load_gpt2(dir.path(), DType::F64);
    let got = &run_ref(
        &model.graph(Phase::Prefill, PROMPT.len()).unwrap(),
        &inputs(&PROMPT, 0, &[]),
    )[0];
    assert!(rel_err(got, &want) < 1e-7);
}

/// Task-head state dicts prefix names with `bert.`, and TensorFlow conversions call the
/// layer norm parameters `gamma` and `beta`.
#[test]
fn bert_prefix_and_gamma_beta_names_load() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "bert", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 8
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(17)).unwrap();
    let raw = Raw::read(dir.path());
    let types = [0i64; 4];
    let ids = [4i64, 9, 0, 31];
    let want = bert_forward(&raw, 16, 1, 2, 1e-12, &ids, &types);
    let tf_name = |n: &str| {
        let n = format!("bert.{n}");
        if n.contains("LayerNorm") {
            n.replace(".weight", ".gamma").replace(".bias", ".beta")
        } else {
            n
        }
    };
    rename_tensors(dir.path(), tf_name);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert!(ckpt.weights.contains("bert.embeddings.LayerNorm.gamma"));
    let kpt_models::Model::Bert(model) = ckpt.load_model(DType::F64).unwrap() else {
        panic!("not bert")
    };
    let got = &run_ref(&model.graph(ids.len()).unwrap(), &bert_inputs(&ids, &types))[0];
    assert!(rel_err(got, &want) < 1e-7);
    // The independent reference reads the renamed file the same way.
    let again = renamed(Raw::read(dir.path()), |n| {
        n.trim_start_matches("bert.")
            .replace(".gamma", ".weight")
            .replace(".beta", ".bias")
    });
    assert_eq!(bert_forward(&again, 16, 1, 2, 1e-12, &ids, &types), want);
}

/// Several sentences packed without padding (variable-length attention) give each
/// sentence's own hidden states and mean pooling, on the reference and on every level.
#[test]
fn bert_packed_batch_equals_one_sequence_at_a_time() {
    use kpt_models::bert::{mean_pool_packed, pack};
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "bert", "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": 12
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(23)).unwrap();
    let raw = Raw::read(dir.path());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let kpt_models::Model::Bert(model) = ckpt.load_model(DType::F32).unwrap() else {
        panic!("not bert")
    };
    let seqs: [(&[i64], &[i64]); 3] = [
        (&[1, 5, 9, 2], &[0, 0, 1, 1]),
        (&[3, 3, 7, 11, 39, 0], &[0; 6]),
        (&[8, 4], &[1, 1]),
    ];
    let want: Vec<Vec<Vec<f64>>> = seqs
        .iter()
        .map(|(ids, types)| bert_forward(&raw, 32, 2, 4, 1e-12, ids, types))
        .collect();
    let ins = pack(&seqs).unwrap();
    let cu: Vec<i64> = ins[3].as_slice::<i64>().unwrap().to_vec();
    assert_eq!(cu, vec![0, 4, 10, 12]);
    let graph = model.graph_packed(12, 3).unwrap();
    let flat: Vec<Vec<f64>> = want.iter().flatten().cloned().collect();
    let got = &run_ref(&graph, &ins)[0];
    assert!(rel_err(got, &flat) < 1e-6);
    for level in OptLevel::ALL {
        let out = executor(&graph, level).run(&ins).unwrap();
        let err = rel_err(&out[0], &flat);
        assert!(err < budget(level), "packed bert at {level}: {err:e}");
    }
    let pooled = mean_pool_packed(got, &cu).unwrap();
    for (p, w) in pooled.iter().zip(&want) {
        let mean = w.iter().map(|r| r[0]).sum::<f64>() / w.len() as f64;
        assert!((f64::from(p[0]) - mean).abs() < 1e-5);
    }
    assert!(mean_pool_packed(got, &[0, 4, 11]).is_err());
    assert!(mean_pool_packed(got, &[0, 4, 4, 12]).is_err());
    assert!(pack(&[(&[1, 2], &[0])]).is_err());
}

#[test]
fn gpt2_packed_prefill_equals_separate_prompts() {
    let dir = gpt2_dir(29);
    let raw = Raw::read(dir.path());
    let model = load_gpt2(dir.path(), DType::F32);
    let prompts: [&[i64]; 2] = [&[5, 6, 7], &[1, 2, 3, 4, 5, 6, 7, 8]];
    let ins = kpt_models::lower::pack_prompts(&prompts).unwrap();
    let want: Vec<Vec<f64>> = prompts
        .iter()
        .flat_map(|p| gpt2_forward(&raw, 32, 2, 4, 50, p))
        .collect();
    let graph = model.graph_packed(11, 2).unwrap();
    assert!(rel_err(&run_ref(&graph, &ins)[0], &want) < 1e-6);
    let out = executor(&graph, OptLevel::Conservative).run(&ins).unwrap();
    assert!(rel_err(&out[0], &want) < budget(OptLevel::Conservative));
}

/// `scale_attn_by_inverse_layer_idx` divides layer `l`'s scores by `l + 1`.
#[test]
fn gpt2_inverse_layer_scaling_matches_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 50, "n_embd": 32, "n_layer": 3, "n_head": 4,
        "n_positions": 16, "scale_attn_by_inverse_layer_idx": true
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(41)).unwrap();
    let raw = Raw::read(dir.path());
    let want = common::gpt2_forward_scaled(&raw, (32, 3, 4, 50), &PROMPT, true);
    let model = load_gpt2(dir.path(), DType::F64);
    let got = &run_ref(
        &model.graph(Phase::Prefill, PROMPT.len()).unwrap(),
        &inputs(&PROMPT, 0, &[]),
    )[0];
    assert!(rel_err(got, &want) < 1e-7);
    let unscaled = common::gpt2_forward_scaled(&raw, (32, 3, 4, 50), &PROMPT, false);
    assert!(rel_err(got, &unscaled) > 1e-4, "the option must matter");
}
