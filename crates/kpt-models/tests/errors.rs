//! Bad checkpoints: every problem is a typed error naming what is wrong, never a panic.

use std::path::Path;

use kpt_core::DType;
use kpt_models::llama::Llama;
use kpt_models::synthetic::{write_checkpoint, WriteOptions};
use kpt_models::{Checkpoint, ModelConfig, ModelError, Weights};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

fn config() -> Value {
    json!({
        "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true
    })
}

fn checkpoint(dir: &Path, shards: usize) {
    write_checkpoint(
        dir,
        &config(),
        WriteOptions {
            shards,
            ..Default::default()
        },
    )
    .unwrap();
}

fn rewrite_config(dir: &Path, key: &str, value: Value) {
    let mut cfg = config();
    cfg[key] = value;
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

fn load_llama(dir: &Path) -> Result<Llama, ModelError> {
    let ckpt = Checkpoint::open(dir)?;
    let ModelConfig::Llama(cfg) = &ckpt.config else {
        panic!("not llama")
    };
    Llama::load(cfg, &ckpt.weights, DType::F32)
}

#[test]
fn unknown_model_type_names_it() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    rewrite_config(dir.path(), "model_type", json!("falcon"));
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, ModelError::UnknownArchitecture { .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("`falcon`") && msg.contains("config.json"),
        "{msg}"
    );
}

#[test]
fn missing_config_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, ModelError::NotACheckpoint { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("no config.json"), "{msg}");
    let missing = dir.path().join("absent");
    let msg = Checkpoint::open(&missing).unwrap_err().to_string();
    assert!(
        msg.contains("absent") && msg.contains("no such model directory"),
        "{msg}"
    );
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let msg = Checkpoint::open(&file).unwrap_err().to_string();
    assert!(msg.contains("not a directory"), "{msg}");
    std::fs::write(dir.path().join("config.json"), config().to_string()).unwrap();
    let msg = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn missing_tensor_names_it_and_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    // Untied: lm_head.weight is now required but was never written.
    rewrite_config(dir.path(), "tie_word_embeddings", json!(false));
    let err = load_llama(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::MissingTensor { .. }), "{err:?}");
    assert!(msg.contains("`lm_head.weight`"), "{msg}");
    assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    rewrite_config(dir.path(), "intermediate_size", json!(32));
    let err = load_llama(dir.path()).unwrap_err();
    match &err {
        ModelError::TensorShape {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, "model.layers.0.mlp.gate_proj.weight");
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[32, 16][..], &[24, 16][..])
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("[32, 16]"));
}

#[test]
fn unknown_rope_scaling_type_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    rewrite_config(
        dir.path(),
        "rope_scaling",
        json!({"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [1.0]}),
    );
    let err = load_llama(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::UnsupportedRopeType { rope_type, .. } if rope_type == "longrope"),
        "{err:?}"
    );
    assert!(err.to_string().contains("`longrope`"), "{err}");
    // A known type with a bad parameter names the field.
    rewrite_config(
        dir.path(),
        "rope_scaling",
        json!({"type": "linear", "factor": 0.5}),
    );
    let err = load_llama(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidField { field, .. } if field == "rope_scaling.factor"),
        "{err:?}"
    );
    // A scaled checkpoint loads.
    rewrite_config(
        dir.path(),
        "rope_scaling",
        json!({"type": "linear", "factor": 2.0}),
    );
    load_llama(dir.path()).unwrap();
}

#[test]
fn truncated_and_garbage_safetensors_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 4, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = Weights::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, ModelError::Safetensors { .. }),
            "cut {cut}: {err:?}"
        );
        assert!(err.to_string().contains("model.safetensors"));
    }
    // A header length far beyond the file.
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    std::fs::write(&path, &huge).unwrap();
    assert!(matches!(
        Weights::open(dir.path()),
        Err(ModelError::Safetensors { .. })
    ));
    // A header that is not JSON.
    let mut bad = 6u64.to_le_bytes().to_vec();
    bad.extend_from_slice(b"{nope]");
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(
        Weights::open(dir.path()),
        Err(ModelError::Safetensors { .. })
    ));
}

#[test]
fn bad_index_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 2);
    let index = dir.path().join("model.safetensors.index.json");
    let good = std::fs::read_to_string(&index).unwrap();
    assert_eq!(Weights::open(dir.path()).unwrap().num_shards(), 2);

    std::fs::write(&index, "{ not json").unwrap();
    assert!(matches!(
        Weights::open(dir.path()),
        Err(ModelError::Json { .. })
    ));

    std::fs::write(&index, r#"{"metadata": {}}"#).unwrap();
    let msg = Weights::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("weight_map"), "{msg}");

    std::fs::write(
        &index,
        r#"{"weight_map": {"x": "../elsewhere.safetensors"}}"#,
    )
    .unwrap();
    let msg = Weights::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("outside"), "{msg}");

    std::fs::write(&index, r#"{"weight_map": {"x": "missing.safetensors"}}"#).unwrap();
    let msg = Weights::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("missing.safetensors"), "{msg}");

    // A tensor mapped to the shard that does not hold it.
    let mut v: Value = serde_json::from_str(&good).unwrap();
    let map = v["weight_map"].as_object_mut().unwrap();
    let files: Vec<String> = map
        .values()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    let other = files.iter().find(|f| **f != files[0]).unwrap().clone();
    let first = map.keys().find(|k| map[*k] == files[0]).unwrap().clone();
    map.insert(first.clone(), Value::String(other));
    std::fs::write(&index, v.to_string()).unwrap();
    let msg = Weights::open(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains(&first) && msg.contains("does not contain"),
        "{msg}"
    );
}

#[test]
fn unsupported_dtype_names_tensor_and_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = [1i32, 2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::I32, vec![3], &data).unwrap();
    safetensors::serialize_to_file(
        vec![("ids", view)],
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    let w = Weights::open(dir.path()).unwrap();
    assert_eq!(w.names(), vec!["ids"]);
    let err = w.tensor("ids").unwrap_err();
    assert!(
        matches!(err, ModelError::UnsupportedDType { .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("`ids`") && msg.contains("I32"), "{msg}");
    assert!(matches!(
        w.tensor("nope"),
        Err(ModelError::MissingTensor { .. })
    ));
}

#[test]
fn bad_tokenizer_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let msg = ckpt.tokenizer().unwrap_err().to_string();
    assert!(msg.contains("tokenizer.json"), "{msg}");
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    assert!(matches!(
        ckpt.tokenizer(),
        Err(ModelError::Tokenizer { .. })
    ));
    kpt_models::synthetic::write_tokenizer(dir.path(), 270).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<none>"}"#,
    )
    .unwrap();
    let msg = ckpt.tokenizer().unwrap_err().to_string();
    assert!(msg.contains("eos_token") && msg.contains("<none>"), "{msg}");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>"}"#,
    )
    .unwrap();
    let tok = ckpt.tokenizer().unwrap();
    assert_eq!(tok.special_tokens().bos, Some(0));
    assert_eq!(tok.special_tokens().eos, vec![1]);
    assert_eq!(tok.special_tokens().pad, Some(2));
}

#[test]
fn huge_layer_count_is_a_missing_tensor_not_an_allocation() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), 1);
    rewrite_config(dir.path(), "num_hidden_layers", json!(1_000_000_000_000u64));
    let msg = load_llama(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("model.layers.1."), "{msg}");
}
