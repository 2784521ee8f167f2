//! Every architecture kpt-models loads, against Hugging Face transformers on the same
//! checkpoint: LLaMA (grouped-query attention, and llama3 rope scaling), Mistral (a
//! sliding window shorter than the prompt), Qwen2 (q/k/v biases, YaRN), GPT-2 and BERT.
//! Each checkpoint is written by `kpt_models::synthetic` (random f32 weights, HF's tensor
//! names), loaded by kpt and by transformers (`benches/hf_models.py`, `load`), and
//! compared:
//!
//! - decoders: the prefill's logits at every position, one decode step's logits after a
//!   prefill of all but the last token, and the greedy tokens of two prompts of
//!   different lengths generated as `kpt run` generates them (packed prefill, decode
//!   graphs on the device);
//! - BERT: the last hidden states of two texts of different lengths packed into one
//!   pass without padding (HF: a padded batch with its attention mask), and their mean
//!   pooling.
//!
//! kpt's `conservative` level (fp32) must be within 1e-3 of HF's fp32 run (max abs
//! difference); the `balanced` level (bf16 on GPUs) within twice HF's own bf16 error
//! against its fp32 run, or 2e-2, whichever is larger. Greedy tokens must be equal; a
//! difference passes only where HF's fp32 logits of the two tokens are within 1e-3 (a
//! tie at fp32's precision), and the sequences are not compared past it.
//!
//! Runs on the CUDA device against transformers on CUDA; `KPT_HF_ORACLE_CPU=1` runs kpt's
//! CPU backend against transformers on the CPU instead. Needs a Python with torch and
//! transformers (`KPT_TORCH_PYTHON`, default `python3`; the worker from
//! `KPT_HF_MODELS_SCRIPT`, default the source tree's); skipped with a note otherwise, an
//! error with `KPT_REQUIRE_TORCH=1`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use kpt::core::config::BackendChoice;
use kpt::core::rand::SplitMix64;
use kpt::core::tensor::Tensor;
use kpt::core::{DType, KptConfig, OptLevel};
use kpt::model::plan_runner;
use kpt::models::bert;
use kpt::models::generate::{decode_step_inputs, Generator, SamplingParams, StopCondition};
use kpt::models::synthetic::{write_checkpoint, WriteOptions};
use kpt::models::{Checkpoint, Model, Phase};
use kpt::Runtime;
use serde_json::{json, Value};

/// The bound on fp32 logits against transformers (max abs difference).
const FP32_TOL: f64 = 1e-3;
/// The floor of the bf16 bound.
const BF16_FLOOR: f64 = 2e-2;
/// Prompt lengths: not multiples of any tile, one longer than Mistral's window.
const LONG: usize = 37;
const SHORT: usize = 20;
/// Greedy tokens compared per prompt.
const NEW_TOKENS: usize = 12;

fn note(msg: &str) {
    // Written to the terminal directly: the test harness captures `eprintln!`.
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// The transformers worker of `benches/hf_models.py`: one JSON request a line.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    /// Starts it, or `None` (with the reason) where the Python lacks torch or
    /// transformers, or (unless `cpu`) torch has no CUDA device.
    fn start(cpu: bool) -> Result<Self, String> {
        let python = std::env::var("KPT_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
        let probe = if cpu {
            "import torch, transformers"
        } else {
            "import torch, transformers; assert torch.cuda.is_available()"
        };
        let ok = Command::new(&python)
            .args(["-c", probe])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Err(format!(
                "{python} lacks torch or transformers{}",
                if cpu { "" } else { " on CUDA" }
            ));
        }
        let script = std::env::var("KPT_HF_MODELS_SCRIPT").map_or_else(
            |_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/hf_models.py"),
            PathBuf::from,
        );
        let mut child = Command::new(&python)
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", script.display()))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut env = String::new();
        stdout
            .read_line(&mut env)
            .map_err(|e| format!("reading the worker's first line: {e}"))?;
        note(&format!("transformers worker: {}", env.trim()));
        Ok(Self {
            child,
            stdin,
            stdout,
        })
    }

    fn call(&mut self, req: Value) -> Value {
        writeln!(self.stdin, "{req}").expect("writing to the worker");
        self.stdin.flush().expect("flushing the worker's stdin");
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("reading the worker's reply");
        let reply: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("worker reply {line:?} to {}: {e}", req["op"]));
        if let Some(err) = reply.get("error") {
            panic!("transformers failed on {}: {err}", req["op"]);
        }
        reply
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `[rows, cols]` JSON array as rows of f64.
fn matrix(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .expect("an array of rows")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("a row")
                .iter()
                .map(|x| x.as_f64().expect("a number"))
                .collect()
        })
        .collect()
}

/// `max |a - b|` over equally shaped rows.
fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len(), "row count");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "row length");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

/// The last axis of `t` as rows.
fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    let cols = *t.shape().last().expect("a tensor of rank 1 or more");
    t.to_f64_vec().chunks(cols).map(<[f64]>::to_vec).collect()
}

/// Checks kpt's fp32 and bf16 results against HF's: returns a line for the log.
fn check_levels(what: &str, f32_err: f64, bf16_err: f64, hf_bf16_err: f64) -> String {
    assert!(
        f32_err <= FP32_TOL,
        "{what}: conservative (fp32) differs from transformers' fp32 by {f32_err:.3e} > {FP32_TOL:e}"
    );
    let bound = (2.0 * hf_bf16_err).max(BF16_FLOOR);
    assert!(
        bf16_err <= bound,
        "{what}: balanced differs from transformers' fp32 by {bf16_err:.3e} > {bound:.3e} \
         (transformers' bf16: {hf_bf16_err:.3e})"
    );
    format!(
        "{what}: fp32 {f32_err:.2e}, balanced {bf16_err:.2e} (transformers bf16 {hf_bf16_err:.2e})"
    )
}

fn runtime(cpu: bool) -> Option<Runtime> {
    let mut config = KptConfig::default();
    config.hardware.backend = if cpu {
        BackendChoice::Cpu
    } else {
        BackendChoice::Cuda
    };
    let rt = Runtime::new(config).expect("the default configuration is valid");
    match rt.backend() {
        Ok(_) => Some(rt),
        Err(e) => {
            let required = std::env::var("KPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "KPT_REQUIRE_GPU=1 but {e}");
            note(&format!("hf oracle SKIPPED: {e}"));
            None
        }
    }
}

fn llama_family(model_type: &str) -> Value {
    json!({
        "model_type": model_type, "vocab_size": 397, "hidden_size": 256,
        "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": false,
        "bos_token_id": 0, "eos_token_id": 1
    })
}

/// The decoders compared: a name and a config.
fn decoders() -> Vec<(&'static str, Value)> {
    let mut llama3 = llama_family("llama");
    llama3["rope_scaling"] = json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16
    });
    llama3["num_key_value_heads"] = json!(1);
    let mut mistral = llama_family("mistral");
    mistral["sliding_window"] = json!(16);
    let mut qwen2 = llama_family("qwen2");
    qwen2["rope_scaling"] = json!({
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64
    });
    vec![
        ("llama (GQA 2:1)", llama_family("llama")),
        ("llama3 rope scaling (MQA)", llama3),
        ("mistral (window 16)", mistral),
        ("qwen2 (q/k/v bias, yarn)", qwen2),
        (
            "gpt2",
            json!({
                "model_type": "gpt2", "vocab_size": 397, "n_embd": 256, "n_layer": 2,
                "n_head": 4, "n_positions": 128, "n_inner": null,
                "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "bos_token_id": 0, "eos_token_id": 0
            }),
        ),
    ]
}

/// `len` token ids in `3..vocab` (above the special tokens).
fn prompt(rng: &mut SplitMix64, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| 3 + (rng.next_u64() % (vocab as u64 - 3)) as u32)
        .collect()
}

fn ids_tensor(ids: &[u32], start: usize) -> Vec<Tensor> {
    let n = ids.len();
    vec![
        Tensor::from_vec(ids.iter().map(|&t| i64::from(t)).collect(), &[1, n]).unwrap(),
        Tensor::from_vec((start..start + n).map(|p| p as i64).collect(), &[n]).unwrap(),
    ]
}

/// The greedy tokens kpt generates for `prompts` at the conservative level, as
/// `kpt run` does (packed prefill of the prompts, then the decode graph per step).
fn kpt_greedy(rt: &Runtime, model: &Model, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let runner = plan_runner(rt, model, OptLevel::Conservative, true, Phase::DecodeGreedy)
        .expect("plans of the conservative level");
    let mut generator = Generator::for_model(runner, model).expect("a decoder");
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let generation = generator
        .generate(
            &refs,
            &SamplingParams::greedy(),
            &StopCondition::new(NEW_TOKENS),
            None,
            |_| Ok(()),
        )
        .expect("greedy generation");
    generation.outputs.into_iter().map(|o| o.tokens).collect()
}

/// Compares greedy tokens: equal up to the end, or up to a tie of HF's fp32 logits.
fn check_greedy(what: &str, kpt: &[u32], hf: &[u32], hf_logits: &[Vec<f64>]) -> String {
    assert_eq!(kpt.len(), hf.len(), "{what}: greedy token count");
    match kpt.iter().zip(hf).position(|(a, b)| a != b) {
        None => format!("{what}: {} greedy tokens equal", kpt.len()),
        Some(i) => {
            let row = &hf_logits[i];
            let gap = (row[hf[i] as usize] - row[kpt[i] as usize]).abs();
            assert!(
                gap <= FP32_TOL,
                "{what}: greedy token {i}: kpt {} and transformers {}, whose fp32 logits differ \
                 by {gap:.3e} (kpt {kpt:?}, transformers {hf:?})",
                kpt[i],
                hf[i]
            );
            format!(
                "{what}: greedy tokens equal for {i}, then a tie of transformers' logits ({gap:.1e})"
            )
        }
    }
}

fn check_decoder(rt: &Runtime, hf: &mut Worker, device: &str, name: &str, config: &Value) {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), config, WriteOptions::seeded(41)).unwrap();
    hf.call(json!({"op": "load", "dir": dir.path(), "device": device}));
    let model = Checkpoint::open(dir.path())
        .and_then(|c| c.load_model(DType::F32))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = model.vocab_size();
    let mut rng = SplitMix64::new(7);
    let long = prompt(&mut rng, LONG, vocab);
    let short = prompt(&mut rng, SHORT, vocab);

    // The prefill's logits at every position.
    let mut hf_logits = |dtype: &str| {
        matrix(
            &hf.call(json!({"op": "logits", "dtype": dtype, "ids": long, "last": LONG}))["logits"],
        )
    };
    let (hf32, hf16) = (hf_logits("f32"), hf_logits("bf16"));
    let graph = model.graph(Phase::Prefill, LONG).unwrap();
    let run = |level: OptLevel| {
        let mut exec = rt.executor(rt.optimize(&graph, level).unwrap()).unwrap();
        rows(&exec.run(&ids_tensor(&long, 0)).unwrap()[0])
    };
    let line = check_levels(
        &format!("{name} prefill logits"),
        max_abs_diff(&run(OptLevel::Conservative), &hf32),
        max_abs_diff(&run(OptLevel::Balanced), &hf32),
        max_abs_diff(&hf16, &hf32),
    );
    note(&line);

    // One decode step after a prefill of the first LONG - 1 tokens.
    let pre = model.graph(Phase::Prefill, LONG - 1).unwrap();
    let mut exec = rt
        .executor(rt.optimize(&pre, OptLevel::Conservative).unwrap())
        .unwrap();
    let mut out = exec.run(&ids_tensor(&long[..LONG - 1], 0)).unwrap();
    let cache = out.split_off(1);
    let step = model.graph(Phase::Decode, LONG - 1).unwrap();
    let mut exec = rt
        .executor(rt.optimize(&step, OptLevel::Conservative).unwrap())
        .unwrap();
    let inputs = decode_step_inputs(i64::from(long[LONG - 1]), LONG - 1, cache).unwrap();
    let got = rows(&exec.run(&inputs).unwrap()[0]);
    let err = max_abs_diff(&got, &hf32[LONG - 1..]);
    assert!(
        err <= FP32_TOL,
        "{name}: a decode step's logits differ from transformers' by {err:.3e}"
    );
    note(&format!("{name} decode step logits: fp32 {err:.2e}"));

    // Greedy generation of two prompts of different lengths.
    let kpt = kpt_greedy(rt, &model, &[long.clone(), short.clone()]);
    for (p, got) in [&long, &short].into_iter().zip(&kpt) {
        let reply = hf.call(json!({
            "op": "greedy", "dtype": "f32", "ids": p, "new": NEW_TOKENS, "with_logits": true
        }));
        let want: Vec<u32> = serde_json::from_value(reply["tokens"].clone()).unwrap();
        let line = check_greedy(
            &format!("{name} prompt of {}", p.len()),
            got,
            &want,
            &matrix(&reply["logits"]),
        );
        note(&line);
    }
}

fn check_bert(rt: &Runtime, hf: &mut Worker, device: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({
        "model_type": "bert", "vocab_size": 397, "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 512, "max_position_embeddings": 64,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
        "pad_token_id": 0
    });
    write_checkpoint(dir.path(), &config, WriteOptions::seeded(43)).unwrap();
    hf.call(json!({"op": "load", "dir": dir.path(), "device": device, "encoder": true}));
    let model = Checkpoint::open(dir.path())
        .and_then(|c| c.load_model(DType::F32))
        .unwrap();
    let Model::Bert(bert_model) = &model else {
        panic!("not bert")
    };
    let mut rng = SplitMix64::new(9);
    let seqs: Vec<Vec<i64>> = [LONG, SHORT]
        .iter()
        .map(|&n| {
            prompt(&mut rng, n, 397)
                .into_iter()
                .map(i64::from)
                .collect()
        })
        .collect();
    let types: Vec<Vec<i64>> = seqs.iter().map(|s| vec![0; s.len()]).collect();
    let pairs: Vec<(&[i64], &[i64])> = seqs
        .iter()
        .zip(&types)
        .map(|(a, b)| (a.as_slice(), b.as_slice()))
        .collect();
    let inputs = bert::pack(&pairs).unwrap();
    let cu = inputs[3].as_slice::<i64>().unwrap().to_vec();
    let graph = bert_model.graph_packed(LONG + SHORT, 2).unwrap();
    // (hidden states of both texts in order, pooled rows)
    let kpt = |level: OptLevel| {
        let mut exec = rt.executor(rt.optimize(&graph, level).unwrap()).unwrap();
        let hidden = exec.run(&inputs).unwrap().swap_remove(0);
        let pooled = bert::mean_pool_packed(&hidden, &cu).unwrap();
        let pooled: Vec<Vec<f64>> = pooled
            .iter()
            .map(|r| r.iter().map(|&x| f64::from(x)).collect())
            .collect();
        (rows(&hidden), pooled)
    };
    let mut hf_encode = |dtype: &str| {
        let reply = hf.call(json!({"op": "encode", "dtype": dtype, "seqs": seqs}));
        let hidden: Vec<Vec<f64>> = reply["hidden"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(matrix)
            .collect();
        (hidden, matrix(&reply["pooled"]))
    };
    let (hf32, hf16) = (hf_encode("f32"), hf_encode("bf16"));
    let (k32, k16) = (kpt(OptLevel::Conservative), kpt(OptLevel::Balanced));
    let line = check_levels(
        "bert hidden states (packed, two texts)",
        max_abs_diff(&k32.0, &hf32.0),
        max_abs_diff(&k16.0, &hf32.0),
        max_abs_diff(&hf16.0, &hf32.0),
    );
    note(&line);
    let line = check_levels(
        "bert mean pooling",
        max_abs_diff(&k32.1, &hf32.1),
        max_abs_diff(&k16.1, &hf32.1),
        max_abs_diff(&hf16.1, &hf32.1),
    );
    note(&line);
}

#[test]
fn every_architecture_matches_transformers() {
    let cpu = std::env::var("KPT_HF_ORACLE_CPU").is_ok_and(|v| v == "1");
    let Some(rt) = runtime(cpu) else {
        return;
    };
    let mut hf = match Worker::start(cpu) {
        Ok(w) => w,
        Err(why) => {
            let required = std::env::var("KPT_REQUIRE_TORCH").is_ok_and(|v| v == "1");
            assert!(!required, "KPT_REQUIRE_TORCH=1 but {why}");
            note(&format!("hf oracle SKIPPED: {why}"));
            return;
        }
    };
    let device = if cpu { "cpu" } else { "cuda" };
    for (name, config) in decoders() {
        check_decoder(&rt, &mut hf, device, name, &config);
    }
    check_bert(&rt, &mut hf, device);
}
