//! `kpt demo`: a small LLaMA-shaped checkpoint, written to disk in the Hugging Face
//! formats and loaded through kpt-models, optimized at every level, validated against
//! the f64 reference, and timed on greedy generation with a KV cache.

use std::path::{Path, PathBuf};

use kpt_core::exec::Executor;
use kpt_core::graph::Graph;
use kpt_core::validate::{validate_plan, ValidationReport};
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::CpuReference;
use kpt_models::generate::{
    decode_step_inputs, prefill_inputs, prefill_inputs_for, Generation, Generator, PlanRunner,
    ReferenceRunner, SamplingParams, StepRunner, StopCondition,
};
use kpt_models::synthetic::{write_checkpoint, write_tokenizer, WriteOptions};
use kpt_models::{ModelError, Phase, Result};
use serde::Serialize;

use crate::model::{
    describe, load, plan_runner, prompt_ids, require_decoder, weight_dtype, SAMPLE_TEXT,
};
use crate::Runtime;

/// Sizes of the demo checkpoint (LLaMA layout: RMS norm, rotary, grouped-query
/// attention, SwiGLU MLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemoConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub dim: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA).
    pub kv_heads: usize,
    /// MLP hidden size (SwiGLU).
    pub ffn: usize,
    /// Weight seed.
    pub seed: u64,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            vocab: 1024,
            dim: 512,
            layers: 4,
            heads: 8,
            kv_heads: 2,
            ffn: 1376,
            seed: 42,
        }
    }
}

impl DemoConfig {
    /// Width of the key/value projections.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.dim / self.heads.max(1)
    }

    /// Number of weights.
    pub fn num_params(&self) -> usize {
        let attn = self.dim * self.dim * 2 + self.dim * self.kv_dim() * 2;
        let mlp = 3 * self.dim * self.ffn;
        self.vocab * self.dim * 2 + self.layers * (attn + mlp + 2 * self.dim) + self.dim
    }

    /// The checkpoint's `config.json`: a LLaMA model with untied embeddings, `<s>` (0)
    /// as BOS and `</s>` (1) as EOS.
    pub fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": false,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "float32"
        })
    }
}

/// The demo checkpoint of `cfg` in `root`: written once into a directory named after
/// the sizes and seed (config.json, model.safetensors with deterministic random f32
/// weights, a byte-level BPE tokenizer.json), reused afterwards. The files are written
/// into a temporary directory and renamed, so concurrent runs never see half a
/// checkpoint.
pub fn demo_checkpoint(root: &Path, cfg: &DemoConfig) -> Result<PathBuf> {
    let name = format!(
        "kpt-demo-v1-v{}-d{}-l{}-h{}-kv{}-f{}-s{}",
        cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.seed
    );
    let dir = root.join(name);
    let complete = |d: &Path| {
        ["config.json", "model.safetensors", "tokenizer.json"]
            .iter()
            .all(|f| d.join(f).is_file())
    };
    if complete(&dir) {
        return Ok(dir);
    }
    let io = |path: &Path, e: std::io::Error| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    std::fs::create_dir_all(root).map_err(|e| io(root, e))?;
    let tmp = root.join(format!(
        ".{}.tmp-{}",
        dir.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("kpt-demo"),
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    let written = write_checkpoint(
        &tmp,
        &cfg.config_json(),
        WriteOptions {
            seed: cfg.seed,
            dtype: DType::F32,
            shards: 1,
        },
    )
    .and_then(|_| write_tokenizer(&tmp, cfg.vocab));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process finished first; its copy is identical.
        let _ = std::fs::remove_dir_all(&tmp);
        if !complete(&dir) {
            return Err(ModelError::Io {
                path: dir.clone(),
                source: std::io::Error::other("could not place the demo checkpoint"),
            });
        }
    }
    Ok(dir)
}

/// Where the demo checkpoint is kept by default: `kpt-demo` (`kpt-demo-$USER` when the
/// user is known, so that users of one machine do not share it) under the system's
/// temporary directory.
pub fn default_demo_root() -> PathBuf {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("USERNAME"))
        .unwrap_or_default();
    let user: String = user
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
        .collect();
    let name = if user.is_empty() {
        "kpt-demo".to_string()
    } else {
        format!("kpt-demo-{user}")
    };
    std::env::temp_dir().join(name)
}

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Sizes of the demo checkpoint (when `model_dir` is not given).
    pub model: DemoConfig,
    /// A checkpoint directory to run instead of the demo checkpoint.
    pub model_dir: Option<PathBuf>,
    /// Where the demo checkpoint is written ([`default_demo_root`] when `None`).
    pub demo_root: Option<PathBuf>,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens generated after the prompt.
    pub new_tokens: usize,
    /// Levels to run.
    pub levels: Vec<OptLevel>,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            model: DemoConfig::default(),
            model_dir: None,
            demo_root: None,
            prompt_len: 32,
            new_tokens: 32,
            levels: OptLevel::ALL.to_vec(),
        }
    }
}

/// One row of the demo table.
#[derive(Debug, Clone, Serialize)]
pub struct DemoRow {
    /// Optimization level.
    pub level: String,
    /// Dtype of the linear weights after the precision pass.
    pub weights: String,
    /// Nodes before and after optimization.
    pub nodes: (usize, usize),
    /// Weight bytes after optimization.
    pub weight_bytes: usize,
    /// Prompt processing time.
    pub prefill_ms: f64,
    /// Median time of one decode step.
    pub ms_per_token: f64,
    /// Largest per-op error relative to the op's tolerance (<= 1 passes).
    pub worst_op_ratio: f64,
    /// Largest error of the logits, relative to the largest reference logit.
    pub max_rel_error: f64,
    /// Largest absolute error of the logits.
    pub max_abs_error: f64,
    /// Generated tokens equal to the f64 reference's greedy tokens, before the first
    /// difference.
    pub tokens_matching: usize,
    /// Whether validation passed.
    pub passed: bool,
}

/// The result of [`run_demo`].
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// The checkpoint directory that ran.
    pub model_dir: PathBuf,
    /// Architecture and sizes.
    pub description: String,
    /// Number of weights.
    pub params: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated per level.
    pub new_tokens: usize,
    /// The prompt's text.
    pub prompt: String,
    /// The reference's greedy continuation.
    pub reference_text: String,
    /// One row per level.
    pub rows: Vec<DemoRow>,
}

fn greedy<R: StepRunner>(g: &mut Generator<R>, prompt: &[u32], n: usize) -> Result<Generation> {
    g.generate(
        &[prompt],
        &SamplingParams::greedy(),
        &StopCondition::new(n),
        None,
        |_| Ok(()),
    )
}

/// Runs the demo (or, with `opts.model_dir`, the same on any decoder checkpoint),
/// calling `progress` with a message after each step: the f64 reference's greedy
/// generation, then per level the optimized plans, their validation (per op and end to
/// end, prefill and one decode step) and a timed greedy generation.
pub fn run_demo(
    rt: &Runtime,
    opts: &DemoOptions,
    mut progress: impl FnMut(&str),
) -> Result<DemoReport> {
    let dir = match &opts.model_dir {
        Some(d) => d.clone(),
        None => {
            progress("writing the demo checkpoint");
            let root = opts.demo_root.clone().unwrap_or_else(default_demo_root);
            demo_checkpoint(&root, &opts.model)?
        }
    };
    progress("loading the checkpoint");
    let m = load(&dir)?;
    require_decoder(&m.model, "demo")?;
    let prompt = prompt_ids(&m.tokenizer, SAMPLE_TEXT, opts.prompt_len.max(1))?;
    let ids: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let new_tokens = opts.new_tokens.max(1);
    // Generation's prefill: the logits of the prompt's last token only.
    let prefill = m.model.graph(Phase::PrefillLast, ids.len())?;
    let decode = m.model.graph(Phase::Decode, ids.len())?;

    progress("f64 reference generation");
    let mut reference =
        Generator::for_model(ReferenceRunner::new(&m.model, &CpuReference)?, &m.model)?;
    let want = greedy(&mut reference, &prompt, new_tokens)?;
    let want_tokens = &want.outputs[0].tokens;
    // The reference cache of the prompt, as the decode plan's validation input.
    let (_, cache) = reference.runner().prefill(&ids)?;
    let cache = cache
        .iter()
        .map(|t| t.to_dtype(m.model.dtype()))
        .collect::<kpt_core::Result<Vec<_>>>()?;
    let pre_inputs = prefill_inputs_for(&prefill, &ids)?;
    let dec_inputs = decode_step_inputs(ids[0], ids.len(), cache)?;

    let mut rows = Vec::new();
    for &level in &opts.levels {
        progress(&format!("{level}: optimizing"));
        // The decode plan of the graph it is validated against (logits only).
        let mut runner = plan_runner(rt, &m.model, level, false, Phase::Decode)?;
        progress(&format!("{level}: validating"));
        let scale = rt.config().precision.tolerance_scale;
        let report_pre = validate_plan(
            runner.prefill_executor(),
            &prefill,
            &CpuReference,
            &pre_inputs,
            scale,
        )?;
        let report_dec = validate_plan(
            runner.decode_executor(),
            &decode,
            &CpuReference,
            &dec_inputs,
            scale,
        )?;
        progress(&format!("{level}: generating"));
        let mut g = Generator::for_model(runner, &m.model)?;
        let got = greedy(&mut g, &prompt, new_tokens)?;
        let matching = got.outputs[0]
            .tokens
            .iter()
            .zip(want_tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let mut runner: PlanRunner = g.into_runner();
        rows.push(row(
            level,
            runner.prefill_executor(),
            &prefill,
            [&report_pre, &report_dec],
            &got,
            matching,
        ));
    }
    Ok(DemoReport {
        description: describe(&m.config),
        params: count_params(&prefill),
        prompt_tokens: prompt.len(),
        new_tokens,
        prompt: m.tokenizer.decode(&prompt, true)?,
        reference_text: m.tokenizer.decode(want_tokens, true)?,
        model_dir: dir,
        rows,
    })
}

/// Number of weights of a graph.
fn count_params(g: &Graph) -> usize {
    g.values()
        .iter()
        .filter_map(|v| match &v.source {
            kpt_core::graph::ValueSource::Param(t) => Some(t.numel()),
            _ => None,
        })
        .sum()
}

fn row(
    level: OptLevel,
    exec: &Executor,
    original: &Graph,
    reports: [&ValidationReport; 2],
    gen: &Generation,
    matching: usize,
) -> DemoRow {
    let graph = &exec.plan().graph;
    let worst_op_ratio = reports
        .iter()
        .flat_map(|r| &r.ops)
        .map(|o| o.error.max_abs / (o.tolerance.abs * o.error.ref_max).max(1e-30))
        .fold(0.0, f64::max);
    DemoRow {
        level: level.to_string(),
        weights: weight_dtype(graph).to_string(),
        nodes: (original.nodes().len(), graph.nodes().len()),
        weight_bytes: graph.param_bytes(),
        prefill_ms: gen.stats.prefill_ms,
        ms_per_token: kpt_monitor::median(&gen.stats.decode_ms).unwrap_or(0.0),
        worst_op_ratio,
        max_rel_error: reports
            .iter()
            .map(|r| r.max_output_rel_error())
            .fold(0.0, f64::max),
        max_abs_error: reports
            .iter()
            .filter_map(|r| r.outputs.first())
            .map(|o| o.error.max_abs)
            .fold(0.0, f64::max),
        tokens_matching: matching,
        passed: reports.iter().all(|r| r.passed()),
    }
}

/// The prefill inputs (ids, positions) of the demo prompt cut to `len` tokens.
pub fn prompt_inputs(tokenizer: &kpt_models::Tokenizer, len: usize) -> Result<Vec<Tensor>> {
    let ids: Vec<i64> = prompt_ids(tokenizer, SAMPLE_TEXT, len)?
        .into_iter()
        .map(i64::from)
        .collect();
    prefill_inputs(&ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_demo_runs_and_validates() {
        let root = tempfile::tempdir().unwrap();
        let rt = Runtime::new(kpt_core::KptConfig::default()).unwrap();
        let opts = DemoOptions {
            model: DemoConfig {
                vocab: 300,
                dim: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                ffn: 96,
                seed: 3,
            },
            demo_root: Some(root.path().to_path_buf()),
            prompt_len: 5,
            new_tokens: 4,
            ..DemoOptions::default()
        };
        let report = run_demo(&rt, &opts, |_| {}).unwrap();
        assert!(report.model_dir.join("model.safetensors").is_file());
        assert!(report.description.starts_with("llama decoder, 2 layers"));
        assert_eq!(report.params, opts.model.num_params());
        assert_eq!(report.prompt_tokens, 5);
        let rows = &report.rows;
        assert_eq!(rows.len(), 3);
        for r in rows {
            assert!(r.passed, "{r:?}");
            assert!(r.nodes.1 < r.nodes.0, "fusion removed no node: {r:?}");
        }
        assert_eq!(rows[0].weights, "f32");
        assert_eq!(
            rows[0].tokens_matching, 4,
            "conservative must match the reference"
        );
        assert_eq!(rows[1].weights, "bf16");
        // Aggressive: int8 weight-only on the CPU, FP8 on an accelerator.
        let cpu = rt.backend().unwrap().device().kind == kpt_core::hardware::DeviceKind::Cpu;
        assert_eq!(rows[2].weights, if cpu { "i8" } else { "f8e4m3" });
        assert!(
            rows[2].weight_bytes < rows[1].weight_bytes
                && rows[1].weight_bytes < rows[0].weight_bytes
        );
        // The checkpoint is reused, and `model_dir` runs the same checkpoint.
        let again = demo_checkpoint(root.path(), &opts.model).unwrap();
        assert_eq!(again, report.model_dir);
        let by_dir = run_demo(
            &rt,
            &DemoOptions {
                model_dir: Some(again),
                levels: vec![OptLevel::Conservative],
                ..opts.clone()
            },
            |_| {},
        )
        .unwrap();
        assert_eq!(by_dir.rows[0].tokens_matching, 4);
        assert_eq!(by_dir.reference_text, report.reference_text);
    }
}
