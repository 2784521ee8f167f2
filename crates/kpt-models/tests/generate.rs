//! Generation on checkpoints written to disk: greedy tokens against an independent f64
//! forward pass, batched prompts against each prompt alone, stop conditions.

mod common;

use std::path::Path;

use common::{executor, gpt2_forward, llama_forward, LlamaSizes, Raw};
use kpt_core::validate::run_reference;
use kpt_core::{DType, OptLevel};
use kpt_kernels::CpuReference;
use kpt_models::generate::{
    argmax, last_logits, prefill_inputs, Generator, PlanRunner, ReferenceRunner, SamplingParams,
    StepOutput, StepRunner, StopCondition, StopReason,
};
use kpt_models::lower::{last_rows, pack_prompts, unpack};
use kpt_models::synthetic::{write_checkpoint, write_tokenizer, WriteOptions};
use kpt_models::{Checkpoint, Model, ModelConfig, Phase};
use serde_json::json;

fn llama_dir(dir: &Path, seed: u64) -> ModelConfig {
    let cfg = json!({
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "bos_token_id": 0,
        "eos_token_id": 1
    });
    let parsed = write_checkpoint(dir, &cfg, WriteOptions::seeded(seed)).unwrap();
    write_tokenizer(dir, 300).unwrap();
    parsed
}

/// Greedy continuation by re-running a full forward pass for every token.
fn greedy_by_forward(
    forward: impl Fn(&[i64]) -> Vec<Vec<f64>>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let mut seq: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let mut out = Vec::new();
    for _ in 0..n {
        let logits = forward(&seq);
        let last = logits.last().unwrap();
        let best = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        out.push(best as u32);
        seq.push(best as i64);
    }
    out
}

/// Optimized plans of `model` at `level` for the CPU, with a packed prefill.
fn plan_runner(model: &Model, level: OptLevel) -> PlanRunner {
    PlanRunner::new(
        executor(&model.graph(Phase::Prefill, 4).unwrap(), level),
        executor(&model.graph(Phase::Decode, 4).unwrap(), level),
    )
    .with_packed(executor(&model.graph_packed(8, 2).unwrap(), level))
}

/// Optimized plans of `model` at `level` whose decode step picks greedy tokens on its
/// device (`Phase::DecodeGreedy`): one greedy sequence decodes pipelined.
fn picking_runner(model: &Model, level: OptLevel) -> PlanRunner {
    PlanRunner::new(
        executor(&model.graph(Phase::Prefill, 4).unwrap(), level),
        executor(&model.graph(Phase::DecodeGreedy, 4).unwrap(), level),
    )
}

fn greedy(
    g: &mut Generator<impl kpt_models::generate::StepRunner>,
    prompts: &[&[u32]],
    n: usize,
) -> Vec<Vec<u32>> {
    g.generate(
        prompts,
        &SamplingParams::greedy(),
        &StopCondition::new(n),
        None,
        |_| Ok(()),
    )
    .unwrap()
    .outputs
    .into_iter()
    .map(|o| o.tokens)
    .collect()
}

const PROMPT: [u32; 6] = [0, 45, 170, 3, 99, 12];

#[test]
fn greedy_tokens_equal_the_independent_forward_pass() {
    let dir = tempfile::tempdir().unwrap();
    let parsed = llama_dir(dir.path(), 41);
    let raw = Raw::read(dir.path());
    let s = LlamaSizes::of(&parsed);
    let want = greedy_by_forward(|ids| llama_forward(&raw, &s, ids), &PROMPT, 8);

    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = ckpt.load_model(DType::F32).unwrap();
    let mut reference =
        Generator::for_model(ReferenceRunner::new(&model, &CpuReference).unwrap(), &model).unwrap();
    assert_eq!(
        greedy(&mut reference, &[&PROMPT], 8),
        std::slice::from_ref(&want)
    );
    let mut plans =
        Generator::for_model(plan_runner(&model, OptLevel::Conservative), &model).unwrap();
    assert_eq!(greedy(&mut plans, &[&PROMPT], 8), [want]);
}

#[test]
fn gpt2_greedy_tokens_equal_the_independent_forward_pass() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "gpt2",
        "vocab_size": 300,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 16,
        "bos_token_id": 0,
        "eos_token_id": 1
    });
    write_checkpoint(dir.path(), &cfg, WriteOptions::default()).unwrap();
    let raw = Raw::read(dir.path());
    let want = greedy_by_forward(|ids| gpt2_forward(&raw, 32, 2, 4, 300, ids), &PROMPT, 6);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let mut g = Generator::for_model(plan_runner(&model, OptLevel::Conservative), &model).unwrap();
    assert_eq!(greedy(&mut g, &[&PROMPT], 6), [want]);
    // 6 prompt tokens + 11 new need 16 positions: the learned table has 16.
    assert_eq!(greedy(&mut g, &[&PROMPT], 11)[0].len(), 11);
    let e = g
        .generate(
            &[&PROMPT],
            &SamplingParams::greedy(),
            &StopCondition::new(12),
            None,
            |_| Ok(()),
        )
        .unwrap_err();
    assert!(e.to_string().contains("the model has 16"), "{e}");
}

/// Prompts of different lengths in one packed prefill give what each gives alone,
/// greedy and sampled (sequence `i` alone seeded with `seed + i`).
#[test]
fn batched_prompts_equal_each_prompt_alone() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 42);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let prompts: [&[u32]; 3] = [&[0, 7, 19, 200, 5], &[0], &[0, 250, 3, 3, 81, 9, 14, 60]];
    for level in [OptLevel::Conservative, OptLevel::Balanced] {
        let mut g = Generator::for_model(plan_runner(&model, level), &model).unwrap();
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 50,
            top_p: 0.95,
            seed: 5,
        };
        for params in [SamplingParams::greedy(), sampled] {
            let stop = StopCondition::new(6);
            let run = |g: &mut Generator<PlanRunner>, ps: &[&[u32]], seed: u64| {
                let p = SamplingParams { seed, ..params };
                g.generate(ps, &p, &stop, None, |_| Ok(()))
                    .unwrap()
                    .outputs
                    .into_iter()
                    .map(|o| o.tokens)
                    .collect::<Vec<_>>()
            };
            let batched = run(&mut g, &prompts, params.seed);
            assert_eq!(batched.len(), 3);
            for (i, p) in prompts.iter().enumerate() {
                let alone = run(&mut g, &[p], params.seed + i as u64);
                assert_eq!(batched[i], alone[0], "{level} {params:?} prompt {i}");
            }
        }
    }
    // The f64 reference agrees with itself batched and alone too.
    let mut r =
        Generator::for_model(ReferenceRunner::new(&model, &CpuReference).unwrap(), &model).unwrap();
    let batched = greedy(&mut r, &prompts, 4);
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(batched[i], greedy(&mut r, &[p], 4)[0], "prompt {i}");
    }
}

/// A decode plan that picks greedy tokens on its device (`Phase::DecodeGreedy`) gives the
/// tokens of the plan whose logits are picked from on the host, and still samples.
#[test]
fn greedy_picks_in_the_plan_equal_picks_on_the_host() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 43);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let prompts: [&[u32]; 2] = [&[0, 7, 19, 200, 5], &[0, 250, 3]];
    let sampled = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.9,
        seed: 3,
    };
    for level in [OptLevel::Conservative, OptLevel::Balanced] {
        let mut on_plan = Generator::for_model(picking_runner(&model, level), &model).unwrap();
        let mut on_host = Generator::for_model(plan_runner(&model, level), &model).unwrap();
        for params in [SamplingParams::greedy(), sampled] {
            let stop = StopCondition::new(7);
            let tokens = |g: &mut Generator<PlanRunner>| {
                g.generate(&prompts, &params, &stop, None, |_| Ok(()))
                    .unwrap()
                    .outputs
                    .into_iter()
                    .map(|o| o.tokens)
                    .collect::<Vec<_>>()
            };
            let want = tokens(&mut on_host);
            assert_eq!(want[0].len(), 7);
            assert_eq!(tokens(&mut on_plan), want, "{level:?} {params:?}");
        }
    }
}

/// Several sequences decode together, one `[active, 1]` step over paged caches, and
/// generate what each prompt generates alone; sequences that stop at EOS leave the batch
/// while the others go on. Greedy on the host and on the device.
#[test]
fn batched_decode_equals_each_prompt_alone() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 44);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let prompts: [&[u32]; 4] = [&[0, 7], &[0, 250, 3], &[0], &[0, 9, 9]];
    for picking in [false, true] {
        let mut g = Generator::for_model(batch_runner(&model, picking), &model).unwrap();
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| greedy(&mut g, &[p], 12).remove(0))
            .collect();
        assert_eq!(
            greedy(&mut g, &prompts, 12),
            alone,
            "picking on the device: {picking}"
        );
        // An EOS that one sequence reaches early: it stops there, the others go on.
        let eos = alone[1][4];
        let stop = StopCondition::new(12).with_eos(&[eos]);
        let out = g
            .generate(&prompts, &SamplingParams::greedy(), &stop, None, |_| Ok(()))
            .unwrap();
        for (o, want) in out.outputs.iter().zip(&alone) {
            let end = want.iter().position(|&t| t == eos).map_or(12, |i| i + 1);
            assert_eq!(o.tokens, want[..end], "picking on the device: {picking}");
        }
        assert_eq!(
            out.stats.decode_tokens,
            out.outputs
                .iter()
                .map(|o| o.tokens.len() - 1)
                .sum::<usize>()
        );
    }
}

/// A batch without room reserved (blocks of 3 rows, the longest prompt's cache) whose
/// sequences decode 12 tokens each: they take five blocks apiece, so the pools double
/// three times, and the steps still give what each prompt gives alone.
#[test]
fn batched_decode_takes_new_blocks_as_sequences_fill_them() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 45);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let prompts: [&[i64]; 3] = [&[0, 7], &[0, 250, 3], &[0]];
    for picking in [false, true] {
        let mut runner = batch_runner(&model, picking);
        let first = runner.prefill_many(&prompts).unwrap();
        let (logits, caches): (Vec<_>, Vec<_>) = first.into_iter().unzip();
        let mut batch = runner.batch(caches, 0).unwrap();
        let mut tokens: Vec<i64> = logits
            .iter()
            .map(|l| i64::from(argmax(l).unwrap()))
            .collect();
        let mut got: Vec<Vec<i64>> = tokens.iter().map(|&t| vec![t]).collect();
        for step in 0..11 {
            let positions: Vec<usize> = prompts.iter().map(|p| p.len() + step).collect();
            let next = runner
                .decode_batch(&mut batch, &[0, 1, 2], &tokens, &positions, true)
                .unwrap();
            for (i, n) in next.into_iter().enumerate() {
                let StepOutput::Token(t) = n else {
                    panic!("a greedy step gives tokens")
                };
                tokens[i] = i64::from(t);
                got[i].push(i64::from(t));
            }
        }
        runner.release_batch(batch);
        let mut g = Generator::for_model(runner, &model).unwrap();
        for (p, got) in prompts.iter().zip(&got) {
            let p: Vec<u32> = p.iter().map(|&t| t as u32).collect();
            let want: Vec<i64> = greedy(&mut g, &[&p], 12)[0]
                .iter()
                .map(|&t| i64::from(t))
                .collect();
            assert_eq!(got, &want, "picking on the device: {picking}");
        }
    }
}

/// Plans at the balanced level with a packed prefill; the decode plan picks greedy
/// tokens on the device when `picking`.
fn batch_runner(model: &Model, picking: bool) -> PlanRunner {
    let level = OptLevel::Balanced;
    let runner = if picking {
        picking_runner(model, level)
    } else {
        plan_runner(model, level)
    };
    runner.with_packed(executor(&model.graph_packed(8, 2).unwrap(), level))
}

/// Plans whose prefills compute only the last tokens' logits (`Phase::PrefillLast`, alone
/// and packed) generate what plans with every position's logits do, greedy and sampled,
/// for LLaMA and GPT-2; their logits are the full prefill's last rows.
#[test]
fn last_token_prefills_generate_what_full_prefills_do() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 44);
    let gpt2 = tempfile::tempdir().unwrap();
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 300, "n_embd": 32, "n_layer": 2, "n_head": 4,
        "n_positions": 32, "bos_token_id": 0, "eos_token_id": 1
    });
    write_checkpoint(gpt2.path(), &cfg, WriteOptions::default()).unwrap();
    let prompts: [&[u32]; 3] = [&[0, 7, 19, 200, 5], &[0], &[0, 250, 3, 3, 81, 9, 14, 60]];
    let ids: Vec<Vec<i64>> = prompts
        .iter()
        .map(|p| p.iter().map(|&t| i64::from(t)).collect())
        .collect();
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.95,
        seed: 9,
    };
    for path in [dir.path(), gpt2.path()] {
        let model = Checkpoint::open(path)
            .unwrap()
            .load_model(DType::F32)
            .unwrap();
        // The f64 graphs: the last rows of every position's logits, exactly.
        let last = model.graph(Phase::PrefillLast, 4).unwrap();
        let full = model.graph(Phase::Prefill, 4).unwrap();
        let mut inputs = prefill_inputs(&ids[0]).unwrap();
        let want = last_logits(&run_reference(&full, &CpuReference, &inputs).unwrap()[0]).unwrap();
        inputs.push(last_rows(&[0, ids[0].len() as i64]).unwrap());
        let got = run_reference(&last, &CpuReference, &inputs).unwrap();
        assert_eq!(got[0].shape(), [1, 1, 300]);
        assert_eq!(got[0].to_f64_vec(), want);
        let refs: Vec<&[i64]> = ids.iter().map(Vec::as_slice).collect();
        let mut packed = pack_prompts(&refs).unwrap();
        let cu = packed[2].as_slice::<i64>().unwrap().to_vec();
        let all =
            &run_reference(&model.graph_packed(4, 3).unwrap(), &CpuReference, &packed).unwrap()[0];
        packed.push(last_rows(&cu).unwrap());
        let got = &run_reference(
            &model.graph_packed_last(4, 3).unwrap(),
            &CpuReference,
            &packed,
        )
        .unwrap()[0];
        assert_eq!(got.shape(), [1, 3, 300]);
        for (i, t) in unpack(all, &cu).unwrap().iter().enumerate() {
            let row = &got.to_f64_vec()[i * 300..(i + 1) * 300];
            assert_eq!(row, last_logits(t).unwrap(), "packed prompt {i}");
        }

        for level in [OptLevel::Conservative, OptLevel::Balanced] {
            let last = PlanRunner::new(
                executor(&model.graph(Phase::PrefillLast, 4).unwrap(), level),
                executor(&model.graph(Phase::Decode, 4).unwrap(), level),
            )
            .with_packed(executor(&model.graph_packed_last(8, 2).unwrap(), level));
            let mut last = Generator::for_model(last, &model).unwrap();
            let mut full = Generator::for_model(plan_runner(&model, level), &model).unwrap();
            for params in [SamplingParams::greedy(), sampled] {
                let stop = StopCondition::new(6);
                let tokens = |g: &mut Generator<PlanRunner>, ps: &[&[u32]]| {
                    g.generate(ps, &params, &stop, None, |_| Ok(()))
                        .unwrap()
                        .outputs
                        .into_iter()
                        .map(|o| o.tokens)
                        .collect::<Vec<_>>()
                };
                for ps in [&prompts[..], &prompts[..1]] {
                    let want = tokens(&mut full, ps);
                    assert_eq!(tokens(&mut last, ps), want, "{path:?} {level} {params:?}");
                }
            }
        }
    }
}

#[test]
fn eos_tokens_and_stop_strings_stop() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 43);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let model = ckpt.load_model(DType::F32).unwrap();
    let tok = ckpt.tokenizer().unwrap();
    // Step by step (logits to the host), and pipelined (tokens picked on the device).
    for runner in [
        plan_runner(&model, OptLevel::Conservative),
        picking_runner(&model, OptLevel::Conservative),
    ] {
        stops_at_eos_and_stop_strings(Generator::for_model(runner, &model).unwrap(), &tok);
    }
    // The tokenizer's own eos id (config: 1) is what `with_eos` takes from it.
    assert_eq!(tok.special_tokens().eos, [1]);
    // An encoder cannot generate.
    let bert_dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        bert_dir.path(),
        &json!({
            "model_type": "bert", "vocab_size": 50, "hidden_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24,
            "max_position_embeddings": 32, "type_vocab_size": 2
        }),
        WriteOptions::default(),
    )
    .unwrap();
    let bert = Checkpoint::open(bert_dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let e = ReferenceRunner::new(&bert, &CpuReference).unwrap_err();
    assert!(e.to_string().contains("encoder"), "{e}");
}

/// EOS ids and stop strings end `g`'s greedy generation of `PROMPT` where they first
/// occur, keeping the token or text that matched; streamed tokens are the output's.
fn stops_at_eos_and_stop_strings(mut g: Generator<PlanRunner>, tok: &kpt_models::Tokenizer) {
    let free = greedy(&mut g, &[&PROMPT], 8).remove(0);
    // The third token as end-of-sequence: generation stops there and keeps it.
    let eos = free[2];
    let first = free.iter().position(|&t| t == eos).unwrap();
    let out = g
        .generate(
            &[&PROMPT],
            &SamplingParams::greedy(),
            &StopCondition::new(8).with_eos(&[eos]),
            None,
            |_| Ok(()),
        )
        .unwrap();
    assert_eq!(out.outputs[0].tokens, free[..=first]);
    assert_eq!(out.outputs[0].stop, StopReason::Eos(eos));
    // A stop string: the text of the first tokens.
    let text = tok.decode(&free[..4], true).unwrap();
    let needle: String = text
        .chars()
        .rev()
        .take(2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    assert!(!needle.is_empty());
    let mut streamed = Vec::new();
    let out = g
        .generate(
            &[&PROMPT],
            &SamplingParams::greedy(),
            &StopCondition::new(8).with_stop_strings([needle.clone()]),
            Some(tok),
            |e| {
                streamed.push(e.token);
                Ok(())
            },
        )
        .unwrap();
    let got = &out.outputs[0];
    assert_eq!(got.stop, StopReason::StopString(needle.clone()));
    assert!(got.tokens.len() <= 4, "{got:?}");
    assert!(tok.decode(&got.tokens, true).unwrap().contains(&needle));
    assert_eq!(streamed, got.tokens);
}

/// A runner keeps a finished sequence's caches for the next one: a long sequence leaves
/// its caches (with rows past the short one's length) to a short one whose first step
/// needs the same capacity, and the short one's tokens are a fresh runner's.
#[test]
fn generation_on_reused_caches_equals_a_fresh_runner() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 9);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let (long, short): (&[u32], &[u32]) = (&[5, 9, 2, 7, 11, 3, 8, 4, 6, 10], &[12, 7, 3, 9, 5]);
    let mut reused = Generator::for_model(plan_runner(&model, OptLevel::Balanced), &model).unwrap();
    greedy(&mut reused, &[long], 4);
    let mut fresh = Generator::for_model(plan_runner(&model, OptLevel::Balanced), &model).unwrap();
    assert_eq!(
        greedy(&mut reused, &[short], 9),
        greedy(&mut fresh, &[short], 9)
    );
}

/// One greedy sequence on a plan that picks its tokens runs each step ahead of its
/// token (`decode_greedy_pipelined`): the tokens are those of the reference, and a run
/// stopped after some tokens continues step by step as an uninterrupted run goes on.
#[test]
fn pipelined_greedy_decoding_equals_step_by_step_decoding() {
    let dir = tempfile::tempdir().unwrap();
    llama_dir(dir.path(), 47);
    let model = Checkpoint::open(dir.path())
        .unwrap()
        .load_model(DType::F32)
        .unwrap();
    let picking = || picking_runner(&model, OptLevel::Balanced);
    let mut reference =
        Generator::for_model(ReferenceRunner::new(&model, &CpuReference).unwrap(), &model).unwrap();
    let want = greedy(&mut reference, &[&PROMPT], 9).remove(0);
    let mut pipelined = Generator::for_model(picking(), &model).unwrap();
    assert_eq!(
        greedy(&mut pipelined, &[&PROMPT], 9),
        std::slice::from_ref(&want)
    );

    let ids: Vec<i64> = PROMPT.iter().map(|&t| i64::from(t)).collect();
    let mut runner = picking();
    let (logits, mut cache) = runner.prefill(&ids).unwrap();
    let first = argmax(&logits).unwrap();
    assert_eq!(first, want[0]);
    let mut got = vec![first];
    runner
        .decode_greedy_run(&mut cache, i64::from(first), ids.len(), &mut |t| {
            got.push(t);
            Ok(got.len() < 4)
        })
        .unwrap();
    assert_eq!(got, want[..4]);
    for _ in 4..9 {
        let (token, position) = (*got.last().unwrap(), ids.len() + got.len() - 1);
        got.push(
            runner
                .decode_greedy(&mut cache, i64::from(token), position)
                .unwrap(),
        );
    }
    assert_eq!(got, want);

    // An error from the callback ends the run and is returned.
    let (_, mut cache) = runner.prefill(&ids).unwrap();
    let err = runner
        .decode_greedy_run(&mut cache, i64::from(first), ids.len(), &mut |_| {
            Err(kpt_models::ModelError::Generation(
                "stopped by the caller".into(),
            ))
        })
        .unwrap_err();
    assert!(err.to_string().contains("stopped by the caller"), "{err}");
}
