//! Checkpoints on the command line: loading a model directory, optimized plan runners
//! for generation, sentence embeddings, and prefill/decode timing (`kpt run`, `kpt embed`,
//! `kpt bench model`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use kpt_core::graph::{Graph, OpKind};
use kpt_core::{DType, OptLevel};
use kpt_models::generate::{Generator, PlanRunner, SamplingParams, StepRunner, StopCondition};
use kpt_models::{bert, Checkpoint, Model, ModelConfig, ModelError, Phase, Result, Tokenizer};
use serde::Serialize;

use crate::Runtime;

/// A checkpoint directory loaded for running: config, weights in f32 and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// The directory.
    pub dir: PathBuf,
    /// `config.json`.
    pub config: ModelConfig,
    /// The weights, lowered per graph on demand.
    pub model: Model,
    /// `tokenizer.json` with the checkpoint's special ids.
    pub tokenizer: Tokenizer,
}

/// Loads `dir` (`config.json`, safetensors, `tokenizer.json`) with f32 weights; the
/// manager lowers precision per level. A missing directory or a directory without
/// `config.json` is an error that says so.
///
/// ```no_run
/// let m = kpt::model::load(std::path::Path::new("models/tiny-llama"))?;
/// println!("{}", kpt::model::describe(&m.config));
/// # Ok::<(), kpt_models::ModelError>(())
/// ```
pub fn load(dir: &Path) -> Result<LoadedModel> {
    let ckpt = Checkpoint::open(dir)?;
    let model = ckpt.load_model(DType::F32)?;
    let tokenizer = ckpt.tokenizer()?;
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        config: ckpt.config,
        model,
        tokenizer,
    })
}

/// One line about a config: architecture and sizes.
pub fn describe(config: &ModelConfig) -> String {
    match config {
        ModelConfig::Llama(c) => format!(
            "{} decoder, {} layers, hidden {}, {} heads ({} kv, head dim {}), ffn {}, vocab {}",
            c.family.model_type(),
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size
        ),
        ModelConfig::Gpt2(c) => format!(
            "gpt2 decoder, {} layers, hidden {}, {} heads, vocab {}, {} positions",
            c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.n_positions
        ),
        ModelConfig::Bert(c) => format!(
            "bert encoder, {} layers, hidden {}, {} heads, vocab {}",
            c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size
        ),
    }
}

/// An error unless `model` generates text.
pub fn require_decoder(model: &Model, command: &str) -> Result<()> {
    if model.is_decoder() {
        Ok(())
    } else {
        Err(ModelError::Unsupported(format!(
            "`{command}` needs a decoder (llama, mistral, qwen2, gpt2); this checkpoint is a \
             BERT encoder: use `kpt embed`"
        )))
    }
}

/// Prefill and decode plans of `model` at `level` on the runtime's backend (and a packed
/// prefill plan for several prompts when `packed`). The prefills compute the logits of
/// each prompt's last token only ([`Phase::PrefillLast`]); the decode plan is of `decode`
/// ([`Phase::DecodeGreedy`] picks greedy tokens on the device, [`Phase::Decode`] returns
/// logits only, as the graph a validator compares with).
pub fn plan_runner(
    rt: &Runtime,
    model: &Model,
    level: OptLevel,
    packed: bool,
    decode: Phase,
) -> Result<PlanRunner> {
    require_decoder(model, "generation")?;
    let exec = |g: &Graph| -> Result<kpt_core::exec::Executor> {
        Ok(rt.executor(rt.optimize(g, level)?)?)
    };
    let mut runner = PlanRunner::new(
        exec(&model.graph(Phase::PrefillLast, 16)?)?,
        exec(&model.graph(decode, 16)?)?,
    );
    if packed {
        runner = runner.with_packed(exec(&model.graph_packed_last(32, 2)?)?);
    }
    Ok(runner)
}

/// The most compact dtype of the linear weights of an optimized graph (f32 when none).
pub fn weight_dtype(graph: &Graph) -> DType {
    graph
        .nodes()
        .iter()
        .filter(|n| matches!(n.op.kind(), OpKind::Linear | OpKind::LinearAct))
        .filter_map(|n| graph.spec(n.inputs[1]).ok().map(|s| s.dtype))
        .min_by_key(|d| d.size_in_bytes())
        .unwrap_or(DType::F32)
}

/// The text prompts of the demo and the benchmarks are made of.
pub const SAMPLE_TEXT: &str =
    "The manager optimizes a graph, the validator proves it against a reference, \
     and a kernel registry picks the best kernel for each op on each device. ";

/// `len` prompt tokens: `text` encoded (with the tokenizer's special tokens, e.g. a
/// leading BOS), repeated as needed and cut to `len`.
pub fn prompt_ids(tokenizer: &Tokenizer, text: &str, len: usize) -> Result<Vec<u32>> {
    let first = tokenizer.encode(text, true)?;
    let more = tokenizer.encode(text, false)?;
    if first.is_empty() || (len > first.len() && more.is_empty()) {
        return Err(ModelError::Generation(format!(
            "the text {text:?} encodes to no token"
        )));
    }
    let mut ids = first;
    while ids.len() < len {
        ids.extend_from_slice(&more);
    }
    ids.truncate(len);
    Ok(ids)
}

/// Prefill and decode speed of one level ([`bench_model`]).
#[derive(Debug, Clone, Serialize)]
pub struct ModelBenchRow {
    /// Optimization level.
    pub level: String,
    /// Dtype of the linear weights after the precision pass.
    pub weights: String,
    /// Prompt tokens per prefill.
    pub prompt_tokens: usize,
    /// Median prefill time in ms.
    pub prefill_ms: f64,
    /// Prompt tokens per second of the median prefill.
    pub prefill_tokens_per_s: f64,
    /// Tokens generated per run.
    pub new_tokens: usize,
    /// Median time of one decode step in ms.
    pub decode_ms_per_token: f64,
    /// Decode steps per second at the median.
    pub decode_tokens_per_s: f64,
}

/// What [`bench_model`] runs.
#[derive(Debug, Clone)]
pub struct ModelBenchOptions {
    /// Levels to time.
    pub levels: Vec<OptLevel>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens generated (decode steps + 1).
    pub new_tokens: usize,
    /// Timed prefills per level (after one warm-up).
    pub iters: usize,
}

/// Times the prefill (median of `iters` runs) and greedy decode steps (median step of a
/// generation of `new_tokens`, end-of-sequence ignored) at each level; `progress` is
/// called after each step.
pub fn bench_model(
    rt: &Runtime,
    m: &LoadedModel,
    opts: &ModelBenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<Vec<ModelBenchRow>> {
    require_decoder(&m.model, "bench model")?;
    let prompt = prompt_ids(&m.tokenizer, SAMPLE_TEXT, opts.prompt_tokens.max(1))?;
    let ids: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let mut rows = Vec::new();
    for &level in &opts.levels {
        progress(&format!("{level}: optimizing"));
        let mut runner = plan_runner(rt, &m.model, level, false, Phase::DecodeGreedy)?;
        let weights = weight_dtype(&runner.prefill_executor().plan().graph);
        runner.prefill(&ids)?;
        let mut times = Vec::new();
        for i in 0..opts.iters.max(1) {
            progress(&format!("{level}: prefill {}/{}", i + 1, opts.iters.max(1)));
            let t = Instant::now();
            runner.prefill(&ids)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let prefill_ms = kpt_monitor::median(&times).unwrap_or(0.0);
        progress(&format!("{level}: decoding"));
        let mut g = Generator::for_model(runner, &m.model)?;
        let out = g.generate(
            &[&prompt],
            &SamplingParams::greedy(),
            &StopCondition::new(opts.new_tokens.max(2)),
            None,
            |_| Ok(()),
        )?;
        let step = kpt_monitor::median(&out.stats.decode_ms).unwrap_or(0.0);
        let per_s = |n: usize, ms: f64| if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 };
        rows.push(ModelBenchRow {
            level: level.to_string(),
            weights: weights.to_string(),
            prompt_tokens: prompt.len(),
            prefill_ms,
            prefill_tokens_per_s: per_s(prompt.len(), prefill_ms),
            new_tokens: out.outputs[0].tokens.len(),
            decode_ms_per_token: step,
            decode_tokens_per_s: per_s(1, step),
        });
    }
    Ok(rows)
}

/// Sentence embeddings of `texts` by a BERT checkpoint: the texts encoded (with special
/// tokens), packed into one encoder pass without padding, and mean-pooled per text.
pub fn embed(
    rt: &Runtime,
    m: &LoadedModel,
    texts: &[String],
    level: OptLevel,
) -> Result<Vec<Vec<f32>>> {
    let Model::Bert(bert_model) = &m.model else {
        return Err(ModelError::Unsupported(format!(
            "`kpt embed` needs an encoder (bert); this checkpoint is a {} decoder: use `kpt run`",
            m.config.model_type()
        )));
    };
    if texts.is_empty() {
        return Err(ModelError::Generation("no text to embed".into()));
    }
    let max = bert_model.config.max_position_embeddings;
    let mut ids = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        let enc: Vec<i64> = m
            .tokenizer
            .encode(t, true)?
            .into_iter()
            .map(i64::from)
            .collect();
        if enc.is_empty() {
            return Err(ModelError::Generation(format!(
                "text {i} encodes to no token"
            )));
        }
        if enc.len() > max {
            return Err(ModelError::Generation(format!(
                "text {i} has {} tokens; the model has {max} positions",
                enc.len()
            )));
        }
        if let Some(&bad) = enc
            .iter()
            .find(|&&x| x as usize >= bert_model.config.vocab_size)
        {
            return Err(ModelError::Generation(format!(
                "text {i} has token {bad}, outside the model's vocabulary of {}",
                bert_model.config.vocab_size
            )));
        }
        ids.push(enc);
    }
    let types: Vec<Vec<i64>> = ids.iter().map(|s| vec![0; s.len()]).collect();
    let seqs: Vec<(&[i64], &[i64])> = ids
        .iter()
        .zip(&types)
        .map(|(a, b)| (a.as_slice(), b.as_slice()))
        .collect();
    let inputs = bert::pack(&seqs)?;
    let cu = inputs[3].as_slice::<i64>()?.to_vec();
    let total = *cu.last().unwrap_or(&0) as usize;
    let graph = bert_model.graph_packed(total, texts.len())?;
    let mut exec = rt.executor(rt.optimize(&graph, level)?)?;
    let out = exec.run(&inputs)?;
    let hidden = out
        .first()
        .ok_or_else(|| ModelError::Generation("the encoder returned no output".into()))?;
    bert::mean_pool_packed(hidden, &cu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_directories_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let e = load(&dir.path().join("nope")).unwrap_err().to_string();
        assert!(
            e.contains("no such model directory") && e.contains("nope"),
            "{e}"
        );
        let e = load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no config.json"), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let e = load(&file).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
