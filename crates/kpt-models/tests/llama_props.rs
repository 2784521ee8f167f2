//! Property test: random LLaMA-family shapes (heads, GQA groups, head sizes, biases,
//! tying, windows, lengths) lowered by kpt agree with the independent f64 forward pass,
//! and prefill-then-decode agrees with a longer prefill.

mod common;

use common::{inputs, llama_forward, rel_err, run_ref, HfRope, LlamaSizes, Raw};
use kpt_core::{DType, Tensor};
use kpt_models::synthetic::{write_checkpoint, WriteOptions};
use kpt_models::{Checkpoint, Model, ModelConfig, Phase};
use proptest::prelude::*;
use serde_json::json;

#[derive(Debug, Clone)]
struct Case {
    model_type: &'static str,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    layers: usize,
    ffn: usize,
    vocab: usize,
    tie: bool,
    window: Option<usize>,
    ids: Vec<i64>,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just("llama"), Just("mistral"), Just("qwen2")],
        1usize..=2,
        1usize..=3,
        prop_oneof![Just(2usize), Just(4), Just(8)],
        1usize..=2,
        1usize..=24,
        any::<bool>(),
        proptest::option::of(1usize..=4),
        proptest::collection::vec(0i64..20, 2..7),
        any::<u64>(),
    )
        .prop_map(
            |(model_type, kv_heads, group, head_dim, layers, ffn, tie, window, ids, seed)| Case {
                model_type,
                kv_heads,
                group,
                head_dim,
                layers,
                ffn,
                vocab: 20,
                tie,
                window: if model_type == "mistral" {
                    window
                } else {
                    None
                },
                ids,
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_llama_shapes_match_reference(c in case()) {
        let heads = c.kv_heads * c.group;
        // hidden_size need not equal heads * head_dim when head_dim is explicit.
        let hidden = heads * c.head_dim + if c.seed % 2 == 0 { 0 } else { 4 };
        let mut cfg = json!({
            "model_type": c.model_type, "vocab_size": c.vocab, "hidden_size": hidden,
            "intermediate_size": c.ffn, "num_hidden_layers": c.layers,
            "num_attention_heads": heads, "num_key_value_heads": c.kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": c.tie
        });
        if let Some(w) = c.window {
            cfg["sliding_window"] = json!(w);
        }
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path(), &cfg, WriteOptions::seeded(c.seed)).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let ModelConfig::Llama(lc) = &ckpt.config else { panic!("not llama") };
        let sizes = LlamaSizes {
            vocab: c.vocab,
            dim: hidden,
            layers: c.layers,
            heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            ffn: c.ffn,
            eps: 1e-6,
            rope: HfRope::plain(10000.0),
            windows: (0..c.layers).map(|i| lc.window(i)).collect(),
        };
        let want = llama_forward(&Raw::read(dir.path()), &sizes, &c.ids);
        let Model::Llama(model) = ckpt.load_model(DType::F64).unwrap() else { panic!() };
        let n = c.ids.len();
        let full = run_ref(&model.graph(Phase::Prefill, n).unwrap(), &inputs(&c.ids, 0, &[]));
        let err = rel_err(&full[0], &want);
        prop_assert!(err < 1e-6, "prefill: {err:e}");
        let pre = run_ref(&model.graph(Phase::Prefill, n - 1).unwrap(), &inputs(&c.ids[..n - 1], 0, &[]));
        let cache: Vec<Tensor> = pre[1..].to_vec();
        let dec = run_ref(&model.graph(Phase::Decode, n - 1).unwrap(), &inputs(&c.ids[n - 1..], n - 1, &cache));
        let err = rel_err(&dec[0], &want[n - 1..]);
        prop_assert!(err < 1e-6, "decode: {err:e}");
    }
}
