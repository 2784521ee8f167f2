//! A LLaMA checkpoint loaded in f32 and optimized for an H100 (a recorded device
//! description, no GPU needed) computes in bf16 at the balanced and aggressive levels,
//! with bf16 FlashAttention; the converted graphs, given CPU kernels, stay within each
//! level's budget of the independent f64 forward pass, and generation's cache round
//! trip (prefill outputs fed to decode) is exact.

mod common;

use std::sync::Arc;

use common::{budget, inputs, llama_forward, rel_err, LlamaSizes, Raw};
use kpt_core::backend::Backend;
use kpt_core::exec::Executor;
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::optimize::{auto_optimize, plan_memory, select_kernels, Plan, PrecisionPolicy};
use kpt_core::{DType, OptLevel};
use kpt_kernels::{CpuBackend, KernelRegistry};
use kpt_models::llama::Llama;
use kpt_models::synthetic::{write_checkpoint, WriteOptions};
use kpt_models::{Checkpoint, ModelConfig, Phase};
use serde_json::json;

/// An H100 SXM as the CUDA backend describes it (sm_90, cuBLASLt present).
fn h100() -> DeviceInfo {
    DeviceInfo {
        kind: DeviceKind::Cuda,
        index: 0,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_bytes: Some(85_045_870_592),
        compute_units: Some(132),
        arch: Some("sm_90".into()),
        features: vec!["cublaslt".into()],
        properties: Default::default(),
    }
}

const PROMPT: [i64; 7] = [0, 5, 17, 60, 33, 2, 41];

/// A small LLaMA with head_dim 64 (the flash kernels' multiple), GQA, tied embeddings.
fn checkpoint(dir: &std::path::Path) -> (Llama, LlamaSizes, Raw) {
    let config = json!({
        "model_type": "llama",
        "vocab_size": 61,
        "hidden_size": 128,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": true,
    });
    let parsed = write_checkpoint(dir, &config, WriteOptions::default()).unwrap();
    let ModelConfig::Llama(c) = &parsed else {
        panic!("not a LLaMA config")
    };
    let sizes = LlamaSizes::of(&parsed);
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = Llama::load(c, &ckpt.weights, DType::F32).unwrap();
    (model, sizes, Raw::read(dir))
}

/// The plan for the H100, with CPU kernels chosen for its (converted) graph.
fn gpu_graph_on_cpu(plan: Plan, backend: &Arc<dyn Backend>) -> Executor {
    let (kernels, _) = select_kernels(
        &plan.graph,
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap();
    let memory = plan_memory(&plan.graph);
    Executor::new(
        Plan {
            kernels,
            memory,
            ..plan
        },
        backend.clone(),
    )
    .unwrap()
}

fn h100_plan(graph: &kpt_core::Graph, level: OptLevel) -> Plan {
    auto_optimize(
        graph,
        level,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        &h100(),
    )
    .unwrap()
}

#[test]
fn f32_llama_on_an_h100_computes_in_bf16_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (model, sizes, raw) = checkpoint(dir.path());
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new().unwrap());
    let n = PROMPT.len();
    let want = llama_forward(&raw, &sizes, &PROMPT);
    let next = 9;
    let mut longer = PROMPT.to_vec();
    longer.push(next);
    let want_next = llama_forward(&raw, &sizes, &longer);
    let prefill = model.graph(Phase::Prefill, n).unwrap();
    let decode = model.graph(Phase::Decode, n).unwrap();
    for level in [OptLevel::Balanced, OptLevel::Aggressive] {
        let (pre_plan, dec_plan) = (h100_plan(&prefill, level), h100_plan(&decode, level));
        for plan in [&pre_plan, &dec_plan] {
            for (node, choice) in plan.graph.nodes().iter().zip(&plan.kernels) {
                if node.op.kind().name() == "attention" {
                    assert_eq!(choice.kernel, "cuda.attention.flash_sm90", "{level}");
                }
            }
        }
        let mut pre = gpu_graph_on_cpu(pre_plan, &backend);
        let mut dec = gpu_graph_on_cpu(dec_plan, &backend);
        let outs = pre.run(&inputs(&PROMPT, 0, &[])).unwrap();
        assert_eq!(outs[0].dtype(), DType::F32, "{level}: logits as declared");
        assert!(
            outs[1..].iter().all(|c| c.dtype() == DType::BF16),
            "{level}"
        );
        let err = rel_err(&outs[0], &want);
        assert!(err < budget(level), "{level} prefill: {err:e}");
        let step = dec.run(&inputs(&[next], n, &outs[1..])).unwrap();
        let err = rel_err(&step[0], &want_next[n..]);
        assert!(err < budget(level), "{level} decode: {err:e}");
        // The extended cache keeps the prefill's rows bit for bit.
        for (old, new) in outs[1..].iter().zip(&step[1..]) {
            assert_eq!(new.dtype(), DType::BF16);
            let (old, new) = (old.to_f64_vec(), new.to_f64_vec());
            assert_eq!(old[..], new[..old.len()], "{level}");
        }
    }
}
