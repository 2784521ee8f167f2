//! Text generation: sampling, stop conditions and the prefill/decode loop over a KV
//! cache, for one prompt or several of different lengths.
//!
//! [`Generator`] drives the loop: it checks the request, runs the prompts through one
//! prefill (several prompts packed without padding through [`crate::Model::graph_packed`]),
//! then picks each sequence's next token with its [`Sampler`] and runs one decode step
//! per sequence until a [`StopCondition`] holds, reporting every token as it comes
//! ([`TokenEvent`]) so that a caller can stream text. Running the graphs and keeping
//! the KV cache is the job of a [`StepRunner`]: [`PlanRunner`] runs optimized plans
//! through [`Executor`]s with the cache kept on their device, [`ReferenceRunner`] runs
//! the f64 reference with the cache on the host.
//!
//! Sampling applies, as Hugging Face's `generate` and vLLM do: temperature (logits
//! divided by it; 0 is greedy), then top-k (the `k` largest logits), then top-p (the
//! smallest set of the most likely remaining tokens whose probability reaches `p`), then
//! one draw from the renormalized distribution with a seeded [`SplitMix64`].
//!
//! ```no_run
//! use kpt_models::generate::{ReferenceRunner, Generator, SamplingParams, StopCondition};
//! use kpt_models::Checkpoint;
//!
//! # fn main() -> kpt_models::Result<()> {
//! let ckpt = Checkpoint::open(std::path::Path::new("models/tiny-llama"))?;
//! let model = ckpt.load_model(kpt_core::DType::F32)?;
//! let tokenizer = ckpt.tokenizer()?;
//! let prompt = tokenizer.encode("Hello", true)?;
//! // The f64 reference; an optimized `PlanRunner` takes executors of the same graphs.
//! let runner = ReferenceRunner::new(&model, &kpt_kernels::CpuReference)?;
//! let mut generator = Generator::for_model(runner, &model)?;
//! let stop = StopCondition::new(16).with_eos(&tokenizer.special_tokens().eos);
//! let mut text = tokenizer.stream(true);
//! let out = generator.generate(&[&prompt], &SamplingParams::greedy(), &stop, None, |event| {
//!     if let Some(piece) = text.step(event.token)? {
//!         print!("{piece}");
//!     }
//!     Ok(())
//! })?;
//! println!("\n{} tokens, {:.1} tokens/s", out.outputs[0].tokens.len(),
//!     out.stats.decode_tokens_per_second());
//! # Ok(())
//! # }
//! ```

use std::time::Instant;

use kpt_core::backend::{Backend, PendingDownload};
use kpt_core::exec::{DeviceTensor, Executor, RunTensor};
use kpt_core::rand::SplitMix64;
use kpt_core::validate::{run_reference, ReferenceOps};
use kpt_core::{Graph, Tensor, TensorSpec};

use crate::error::{ModelError, Result};
use crate::lower::{last_rows, pack_prompts, unpack, Phase, LAST_ROWS};
use crate::tokenizer::Tokenizer;
use crate::Model;

/// How the next token is chosen from the logits.
///
/// ```
/// use kpt_models::generate::SamplingParams;
/// let p = SamplingParams { temperature: 0.7, top_k: 40, top_p: 0.9, seed: 1 };
/// p.validate()?;
/// assert!(SamplingParams { top_p: 1.5, ..p }.validate().is_err());
/// assert!(SamplingParams::greedy().is_greedy());
/// # Ok::<(), kpt_models::ModelError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits before the softmax; 0 picks the most likely token (greedy).
    /// Must be finite and non-negative.
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`;
    /// in `(0, 1]`, 1 keeps all.
    pub top_p: f64,
    /// Seed of the random draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token (the lowest id among ties).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Whether the temperature is 0, so no random draw happens.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks the ranges: temperature finite and `>= 0`, `top_p` in `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::InvalidSampling {
                parameter: "temperature",
                message: format!(
                    "{} (must be a finite number >= 0; 0 is greedy)",
                    self.temperature
                ),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidSampling {
                parameter: "top_p",
                message: format!("{} (must be in (0, 1]; 1 keeps every token)", self.top_p),
            });
        }
        Ok(())
    }

    /// The distribution a draw is made from: `(token, probability)` pairs, most likely
    /// first, after temperature, top-k and top-p, renormalized to sum to 1; a single
    /// token with probability 1 when greedy. Tokens of probability 0 are left out.
    ///
    /// ```
    /// use kpt_models::generate::SamplingParams;
    /// let p = SamplingParams { temperature: 1.0, top_k: 2, top_p: 1.0, seed: 0 };
    /// let d = p.distribution(&[0.0, 2.0, 1.0, -1.0])?;
    /// assert_eq!(d.iter().map(|&(t, _)| t).collect::<Vec<_>>(), [1, 2]);
    /// assert!((d[0].1 - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-12);
    /// # Ok::<(), kpt_models::ModelError>(())
    /// ```
    pub fn distribution(&self, logits: &[f64]) -> Result<Vec<(u32, f64)>> {
        self.validate()?;
        check_logits(logits)?;
        if self.is_greedy() {
            return Ok(vec![(argmax(logits)?, 1.0)]);
        }
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        if self.top_k > 0 && self.top_k < order.len() {
            order.select_nth_unstable_by(self.top_k - 1, by_logit);
            order.truncate(self.top_k);
        }
        order.sort_unstable_by(by_logit);
        let t = self.temperature;
        let max = logits[order[0] as usize] / t;
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| (logits[i as usize] / t - max).exp())
            .collect();
        normalize(&mut probs);
        if self.top_p < 1.0 {
            // Keep token j while the probability before it is below top_p (HF removes
            // the tokens whose ascending cumulative probability is <= 1 - top_p).
            let mut before = 0.0;
            let mut keep = 0;
            for &p in &probs {
                if keep > 0 && before >= self.top_p {
                    break;
                }
                before += p;
                keep += 1;
            }
            probs.truncate(keep);
            normalize(&mut probs);
        }
        Ok(order
            .into_iter()
            .zip(probs)
            .filter(|&(_, p)| p > 0.0)
            .collect())
    }
}

fn normalize(p: &mut [f64]) {
    let z: f64 = p.iter().sum();
    for x in p {
        *x /= z;
    }
}

/// Logits must be non-empty, without NaN or `+inf`, and not all `-inf`.
fn check_logits(logits: &[f64]) -> Result<()> {
    if logits.is_empty() {
        return Err(ModelError::Generation("no logits to sample from".into()));
    }
    if let Some(i) = logits
        .iter()
        .position(|x| x.is_nan() || *x == f64::INFINITY)
    {
        return Err(ModelError::Generation(format!(
            "the model produced a non-finite logit ({} at token {i})",
            logits[i]
        )));
    }
    if logits.iter().all(|x| *x == f64::NEG_INFINITY) {
        return Err(ModelError::Generation(
            "every logit is -inf: no token can be sampled".into(),
        ));
    }
    Ok(())
}

/// The most likely token, the lowest id among ties (as `torch.argmax`).
///
/// ```
/// assert_eq!(kpt_models::generate::argmax(&[0.5, 2.0, 2.0, -1.0])?, 1);
/// # Ok::<(), kpt_models::ModelError>(())
/// ```
pub fn argmax(logits: &[f64]) -> Result<u32> {
    check_logits(logits)?;
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    Ok(best as u32)
}

/// Draws tokens from logits with [`SamplingParams`] and a seeded random stream: the
/// same seed and logits give the same tokens.
///
/// ```
/// use kpt_models::generate::{Sampler, SamplingParams};
/// let params = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.9, seed: 7 };
/// let logits = [1.0, 3.0, 0.5, 2.5];
/// let mut a = Sampler::new(params)?;
/// let mut b = Sampler::new(params)?;
/// for _ in 0..10 {
///     assert_eq!(a.sample(&logits)?, b.sample(&logits)?);
/// }
/// # Ok::<(), kpt_models::ModelError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler whose random stream starts at `params.seed`; fails on parameters out
    /// of range.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: SplitMix64::new(params.seed),
        })
    }

    /// Its parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token for `logits` (one per vocabulary entry). Greedy sampling uses no
    /// random number.
    pub fn sample(&mut self, logits: &[f64]) -> Result<u32> {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = self.params.distribution(logits)?;
        let u = self.rng.next_f64();
        let mut cum = 0.0;
        for &(token, p) in &dist {
            cum += p;
            if u < cum {
                return Ok(token);
            }
        }
        // Rounding left `cum` a hair below 1 and `u` above it: the last kept token.
        Ok(dist.last().map_or(0, |&(t, _)| t))
    }
}

/// When a sequence stops: after `max_new_tokens`, on an end-of-sequence id (which is
/// kept as the last token), or when the decoded text contains a stop string.
///
/// ```
/// use kpt_models::generate::StopCondition;
/// let stop = StopCondition::new(32).with_eos(&[2]).with_stop_strings(["\n\n"]);
/// assert_eq!(stop.max_new_tokens, 32);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCondition {
    /// Most tokens generated per sequence (at least 1).
    pub max_new_tokens: usize,
    /// End-of-sequence ids (the tokenizer's or config's, see
    /// [`Tokenizer::special_tokens`]).
    pub eos: Vec<u32>,
    /// Texts that end a sequence once its generated text contains one; checking them
    /// needs the tokenizer.
    pub stop_strings: Vec<String>,
}

impl StopCondition {
    /// Stops after `max_new_tokens` only.
    pub fn new(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            eos: Vec::new(),
            stop_strings: Vec::new(),
        }
    }

    /// Also stops on these end-of-sequence ids.
    pub fn with_eos(mut self, eos: &[u32]) -> Self {
        self.eos.extend_from_slice(eos);
        self
    }

    /// Also stops when the generated text contains one of `strings`.
    pub fn with_stop_strings<S: Into<String>>(
        mut self,
        strings: impl IntoIterator<Item = S>,
    ) -> Self {
        self.stop_strings
            .extend(strings.into_iter().map(Into::into));
        self
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// It generated this end-of-sequence id.
    Eos(u32),
    /// Its text contains this stop string.
    StopString(String),
    /// It reached `max_new_tokens`.
    MaxTokens,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::Eos(id) => write!(f, "end of sequence (token {id})"),
            StopReason::StopString(s) => write!(f, "stop string {s:?}"),
            StopReason::MaxTokens => write!(f, "max tokens"),
        }
    }
}

/// One generated token, reported as soon as it is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenEvent {
    /// Which prompt it continues (index into the request's prompts).
    pub sequence: usize,
    /// Its index among that sequence's generated tokens.
    pub index: usize,
    /// The token id.
    pub token: u32,
}

/// The tokens generated for one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceOutput {
    /// Generated ids (the prompt not included; an end-of-sequence id that stopped it
    /// included).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
}

/// Counts and times of one [`Generator::generate`] call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationStats {
    /// Prompt tokens, all prompts together.
    pub prompt_tokens: usize,
    /// Generated tokens, all sequences together.
    pub generated_tokens: usize,
    /// Time of the prefill (all prompts) in ms.
    pub prefill_ms: f64,
    /// Time of each decode step in ms: one token of one sequence, or of each unfinished
    /// sequence where several decode together.
    pub decode_ms: Vec<f64>,
    /// Tokens the decode steps produced, all sequences together.
    pub decode_tokens: usize,
}

impl GenerationStats {
    /// Decoded tokens per second, all sequences together (0 when no decode step ran).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let total: f64 = self.decode_ms.iter().sum();
        if total > 0.0 {
            self.decode_tokens as f64 / (total / 1e3)
        } else {
            0.0
        }
    }

    /// Prompt tokens per second of the prefill.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        if self.prefill_ms > 0.0 {
            self.prompt_tokens as f64 / (self.prefill_ms / 1e3)
        } else {
            0.0
        }
    }
}

/// The result of [`Generator::generate`]: one output per prompt, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Per prompt.
    pub outputs: Vec<SequenceOutput>,
    /// Counts and times.
    pub stats: GenerationStats,
}

/// Runs a decoder's graphs and keeps each sequence's KV cache: the one place where
/// generation touches executors, so that where the cache lives (device buffers for
/// [`PlanRunner`], host tensors for [`ReferenceRunner`]) is this trait's implementor's
/// business alone.
pub trait StepRunner {
    /// One sequence's keys and values of every layer.
    type Cache;

    /// The caches of several sequences decoded together ([`StepRunner::decode_batch`]).
    type Batch;

    /// Runs the prefill of one prompt (positions from 0); returns the logits of its
    /// last position, `[vocab]`, and its cache.
    fn prefill(&mut self, prompt: &[i64]) -> Result<(Vec<f64>, Self::Cache)>;

    /// Runs several prompts; returns each one's last logits and cache, in order. The
    /// default runs them one by one; runners with a packed prefill graph run them in
    /// one pass without padding.
    fn prefill_many(&mut self, prompts: &[&[i64]]) -> Result<Vec<(Vec<f64>, Self::Cache)>> {
        prompts.iter().map(|p| self.prefill(p)).collect()
    }

    /// Runs one decode step of `token` at `position` (the cache's length), extending
    /// `cache`; returns the next logits, `[vocab]`.
    fn decode(&mut self, cache: &mut Self::Cache, token: i64, position: usize) -> Result<Vec<f64>>;

    /// Runs one decode step as [`StepRunner::decode`] does and returns the most likely
    /// next token (greedy decoding) instead of the logits. The default takes [`argmax`]
    /// of the logits on the host; a runner whose plan picks the token on the device
    /// ([`Phase::DecodeGreedy`]) downloads only the token.
    fn decode_greedy(
        &mut self,
        cache: &mut Self::Cache,
        token: i64,
        position: usize,
    ) -> Result<u32> {
        argmax(&self.decode(cache, token, position)?)
    }

    /// Greedy decoding of one sequence from `token` at `position`: calls `next` with
    /// each token picked, in order, until it returns `false` (the steps `next` saw
    /// extend `cache`). The default runs [`StepRunner::decode_greedy`] step by step; a
    /// runner may queue each step before the token of the step before reaches the host
    /// ([`decode_greedy_pipelined`]).
    fn decode_greedy_run(
        &mut self,
        cache: &mut Self::Cache,
        token: i64,
        position: usize,
        next: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        greedy_steps(self, cache, token, position, next)
    }

    /// Takes back the cache of a finished sequence, which a runner may reuse for a later
    /// one ([`PlanRunner`] keeps it in its [`CachePool`]). The default drops it.
    fn release(&mut self, cache: Self::Cache) {
        drop(cache);
    }

    /// Makes room in `cache` for `rows` positions before its decoding starts, so that a
    /// runner with caches of a fixed capacity allocates them once. The default does
    /// nothing.
    fn reserve(&mut self, cache: &mut Self::Cache, rows: usize) -> Result<()> {
        let _ = (cache, rows);
        Ok(())
    }

    /// Takes the caches of sequences that will decode together, in order (from
    /// [`StepRunner::prefill_many`]), with room for `rows` positions in each where the
    /// runner allocates ahead ([`StepRunner::reserve`]).
    fn batch(&mut self, caches: Vec<Self::Cache>, rows: usize) -> Result<Self::Batch>;

    /// One decode step of the batch's sequences `active` (indices into it, ascending),
    /// sequence `active[i]` fed `tokens[i]` at `positions[i]` (its length): returns each
    /// one's next logits, or with `greedy` its token where the plan picks it. Runners
    /// without a batched graph step them one at a time ([`decode_each`]); [`PlanRunner`]
    /// runs one `[active, 1]` step of its decode plan over paged caches.
    fn decode_batch(
        &mut self,
        batch: &mut Self::Batch,
        active: &[usize],
        tokens: &[i64],
        positions: &[usize],
        greedy: bool,
    ) -> Result<Vec<StepOutput>>;

    /// Takes back a batch whose sequences are finished. The default drops it.
    fn release_batch(&mut self, batch: Self::Batch) {
        drop(batch);
    }
}

/// [`StepRunner::decode_batch`] one sequence at a time, for runners whose batch is the
/// sequences' own caches.
pub fn decode_each<R: StepRunner + ?Sized>(
    runner: &mut R,
    caches: &mut [R::Cache],
    active: &[usize],
    tokens: &[i64],
    positions: &[usize],
    greedy: bool,
) -> Result<Vec<StepOutput>> {
    check_batch_step(caches.len(), active, tokens, positions)?;
    active
        .iter()
        .zip(tokens.iter().zip(positions))
        .map(|(&i, (&token, &position))| {
            let cache = &mut caches[i];
            Ok(if greedy {
                StepOutput::Token(runner.decode_greedy(cache, token, position)?)
            } else {
                StepOutput::Logits(runner.decode(cache, token, position)?)
            })
        })
        .collect()
}

/// Checks a batched step's arguments against a batch of `sequences`.
fn check_batch_step(
    sequences: usize,
    active: &[usize],
    tokens: &[i64],
    positions: &[usize],
) -> Result<()> {
    if tokens.len() != active.len() || positions.len() != active.len() {
        return Err(ModelError::Generation(format!(
            "a batched decode step of {} sequences got {} tokens and {} positions",
            active.len(),
            tokens.len(),
            positions.len()
        )));
    }
    if active.windows(2).any(|w| w[0] >= w[1]) || active.last().is_some_and(|&i| i >= sequences) {
        return Err(ModelError::Generation(format!(
            "sequences {active:?} of a batch of {sequences} (ascending indices needed)"
        )));
    }
    Ok(())
}

/// [`StepRunner::decode_greedy_run`] one [`StepRunner::decode_greedy`] at a time.
fn greedy_steps<R: StepRunner + ?Sized>(
    runner: &mut R,
    cache: &mut R::Cache,
    mut token: i64,
    mut position: usize,
    next: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    loop {
        let picked = runner.decode_greedy(cache, token, position)?;
        position += 1;
        if !next(picked)? {
            return Ok(());
        }
        token = i64::from(picked);
    }
}

/// The inputs of a prefill graph (see [`crate::lower::DecoderInputs`]): ids `[1, n]`
/// and positions `0..n`.
pub fn prefill_inputs(ids: &[i64]) -> Result<Vec<Tensor>> {
    let n = ids.len();
    Ok(vec![
        Tensor::from_vec(ids.to_vec(), &[1, n])?,
        Tensor::from_vec((0..n as i64).collect(), &[n])?,
    ])
}

/// The small inputs of a decode step (see [`crate::lower::DecoderInputs`]) for
/// `tokens.len()` sequences at `position`, sequence `b` owning block `b` of caches
/// `[sequences, capacity, kv_dim]`: ids and positions `[B, 1]`, slots `b * capacity +
/// position`, block table `[[b]]` and lengths `position + 1`. The caches follow them.
pub fn decode_inputs(tokens: &[i64], position: usize, capacity: usize) -> Result<Vec<Tensor>> {
    if position >= capacity {
        return Err(ModelError::Generation(format!(
            "position {position} does not fit a cache of {capacity} rows"
        )));
    }
    let b = tokens.len();
    let (pos, cap) = (position as i64, capacity as i64);
    Ok(vec![
        Tensor::from_vec(tokens.to_vec(), &[b, 1])?,
        Tensor::from_vec(vec![pos; b], &[b, 1])?,
        Tensor::from_vec((0..b as i64).map(|s| s * cap + pos).collect(), &[b])?,
        Tensor::from_vec((0..b as i64).collect(), &[b, 1])?,
        Tensor::from_vec(vec![pos + 1; b], &[b])?,
    ])
}

/// Every input of a decode step of one sequence at `position` with the host caches
/// `[1, len, kv_dim]` of each layer (from a prefill or an earlier step), grown by
/// [`host_cache_with_room`] where they are full.
pub fn decode_step_inputs(token: i64, position: usize, caches: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let caches = caches
        .into_iter()
        .map(|c| host_cache_with_room(c, position))
        .collect::<Result<Vec<_>>>()?;
    let capacity = caches.first().map_or(position + 1, |c| c.shape()[1]);
    let mut inputs = decode_inputs(&[token], position, capacity)?;
    inputs.extend(caches);
    Ok(inputs)
}

/// The capacity a cache is grown to when a decode step at `position` does not fit it:
/// the next power of two above the position, at least 16 rows, so that a generation
/// reallocates (and a captured decode step changes shape) a logarithmic number of times.
pub fn cache_capacity(position: usize) -> usize {
    (position + 1).next_power_of_two().max(16)
}

/// `cache` `[B, len, kv_dim]` (host) with room for a decode step at `position`: itself
/// when `len > position`, else zero-padded to [`cache_capacity`] rows.
pub fn host_cache_with_room(cache: Tensor, position: usize) -> Result<Tensor> {
    let shape = cache.shape().to_vec();
    let &[b, len, width] = shape.as_slice() else {
        return Err(ModelError::Generation(format!(
            "a cache must be [sequences, len, kv_dim], got {shape:?}"
        )));
    };
    if len > position {
        return Ok(cache);
    }
    let cap = cache_capacity(position);
    let (from, size) = (cache.contiguous(), cache.dtype().size_in_bytes());
    let (src, row) = (from.as_bytes()?, len * width * size);
    let mut bytes = vec![0u8; b * cap * width * size];
    for s in 0..b {
        bytes[s * cap * width * size..][..row].copy_from_slice(&src[s * row..][..row]);
    }
    Ok(Tensor::from_bytes(&bytes, cache.dtype(), &[b, cap, width])?.with_scale(cache.scale()))
}

/// `cache` `[B, len, kv_dim]` (on the device) with room for a decode step at
/// `position`, grown as [`host_cache_with_room`] does (one sequence per cache).
pub fn device_cache_with_room(
    cache: DeviceTensor,
    position: usize,
    backend: &dyn kpt_core::backend::Backend,
) -> Result<DeviceTensor> {
    let shape = &cache.spec.shape;
    let &[1, len, width] = shape.as_slice() else {
        return Err(ModelError::Generation(format!(
            "a device cache must be [1, len, kv_dim], got {shape:?}"
        )));
    };
    if len > position {
        return Ok(cache);
    }
    let cap = cache_capacity(position);
    let mut grown = cache.with_capacity(backend, cap * width)?;
    grown.spec.shape = vec![1, cap, width];
    Ok(grown)
}

/// Cache sets of finished sequences, kept for later ones. A decode executor captures
/// its runs keyed by the device addresses of its inputs ([`Executor::set_graphs`]), so a
/// sequence whose caches take over a released set replays the capture of an earlier
/// sequence instead of running its first step node by node and recording its own, as
/// vLLM keeps its KV cache blocks allocated across requests. A set is one sequence's
/// caches of every layer, in order.
#[derive(Debug, Default)]
pub struct CachePool {
    sets: Vec<Vec<DeviceTensor>>,
}

/// Released sets a [`CachePool`] keeps (the oldest goes first).
const SPARE_SETS: usize = 4;

impl CachePool {
    /// `caches` (`[1, len, kv_dim]` each) with room for a decode step at `position`:
    /// themselves while every one has room; else copied into the most recently released
    /// set of [`cache_capacity`] rows with the same widths and dtypes, or into new
    /// buffers ([`device_cache_with_room`]) when none is kept.
    pub fn with_room(
        &mut self,
        caches: Vec<DeviceTensor>,
        position: usize,
        backend: &dyn kpt_core::backend::Backend,
    ) -> Result<Vec<DeviceTensor>> {
        if caches
            .iter()
            .all(|c| c.spec.shape.get(1).is_some_and(|&len| len > position))
        {
            return Ok(caches);
        }
        let grown = |c: &DeviceTensor| -> Vec<usize> {
            vec![
                1,
                cache_capacity(position),
                c.spec.shape.last().copied().unwrap_or(0),
            ]
        };
        let fits = |set: &Vec<DeviceTensor>| {
            set.len() == caches.len()
                && set.iter().zip(&caches).all(|(s, c)| {
                    s.spec.dtype == c.spec.dtype
                        && s.spec.shape == grown(c)
                        && c.spec.shape.len() == 3
                        && c.spec.shape[0] == 1
                })
        };
        let Some(i) = self.sets.iter().rposition(fits) else {
            return caches
                .into_iter()
                .map(|c| device_cache_with_room(c, position, backend))
                .collect();
        };
        let mut set = self.sets.remove(i);
        for (to, from) in set.iter_mut().zip(&caches) {
            backend.copy_into(from.view(), &mut to.buffer, 0)?;
            to.buffer.scale = from.buffer.scale;
        }
        Ok(set)
    }

    /// Host caches on the device: written into the most recently released set of the
    /// same shapes and dtypes, or uploaded to new buffers when none is kept.
    pub fn upload(
        &mut self,
        caches: Vec<Tensor>,
        backend: &dyn kpt_core::backend::Backend,
    ) -> Result<Vec<DeviceTensor>> {
        let fits = |set: &Vec<DeviceTensor>| {
            set.len() == caches.len()
                && set
                    .iter()
                    .zip(&caches)
                    .all(|(s, t)| s.spec.dtype == t.dtype() && s.spec.shape == t.shape())
        };
        let Some(i) = self.sets.iter().rposition(fits) else {
            return caches
                .iter()
                .map(|t| Ok(DeviceTensor::upload(backend, t)?))
                .collect();
        };
        let mut set = self.sets.remove(i);
        for (to, from) in set.iter_mut().zip(&caches) {
            backend.write(from, &mut to.buffer)?;
        }
        Ok(set)
    }

    /// Keeps a finished sequence's caches for a later one.
    pub fn release(&mut self, caches: Vec<DeviceTensor>) {
        if caches.is_empty() {
            return;
        }
        if self.sets.len() == SPARE_SETS {
            self.sets.remove(0);
        }
        self.sets.push(caches);
    }

    /// How many released sets are kept.
    pub fn len(&self) -> usize {
        self.sets.len()
    }

    /// Whether no set is kept.
    pub fn is_empty(&self) -> bool {
        self.sets.is_empty()
    }
}

/// The last row of logits `[1, S, vocab]`.
pub fn last_logits(logits: &Tensor) -> Result<Vec<f64>> {
    let vocab = match logits.shape() {
        &[1, s, v] if s > 0 => v,
        other => {
            return Err(ModelError::Generation(format!(
                "logits must be [1, seq, vocab], got {other:?}"
            )))
        }
    };
    let all = logits.to_f64_vec();
    Ok(all[all.len() - vocab..].to_vec())
}

/// Checks a decoder graph's outputs (logits then 2 per layer) and splits them.
fn split_outputs(mut outs: Vec<Tensor>) -> Result<(Tensor, Vec<Tensor>)> {
    if outs.is_empty() || outs.len().is_multiple_of(2) {
        return Err(ModelError::Generation(format!(
            "a decoder graph returns logits and a key and a value per layer, got {} outputs",
            outs.len()
        )));
    }
    let cache = outs.split_off(1);
    let logits = outs
        .pop()
        .ok_or_else(|| ModelError::Generation("a decoder graph returned no logits".into()))?;
    Ok((logits, cache))
}

/// Cuts packed prefill outputs per prompt: last logits and cache of each. The logits
/// are `[1, total, vocab]`, or `[1, prompts, vocab]` when `last_only`
/// ([`Phase::PrefillLast`]).
fn unpack_outputs(
    outs: Vec<Tensor>,
    cu_seqlens: &[i64],
    last_only: bool,
) -> Result<Vec<(Vec<f64>, Vec<Tensor>)>> {
    let (logits, cache) = split_outputs(outs)?;
    let caches = cache
        .iter()
        .map(|t| unpack(t, cu_seqlens))
        .collect::<Result<Vec<_>>>()?;
    let rows = if last_only {
        let prompts = cu_seqlens.len().saturating_sub(1);
        let vocab = match logits.shape() {
            &[1, n, vocab] if n == prompts => vocab.max(1),
            other => {
                return Err(ModelError::Generation(format!(
                    "logits of {prompts} prompts' last tokens must be [1, {prompts}, vocab], \
                     got {other:?}"
                )))
            }
        };
        let all = logits.to_f64_vec();
        all.chunks(vocab).map(<[f64]>::to_vec).collect()
    } else {
        unpack(&logits, cu_seqlens)?
            .iter()
            .map(last_logits)
            .collect::<Result<Vec<_>>>()?
    };
    Ok(rows
        .into_iter()
        .enumerate()
        .map(|(i, l)| (l, caches.iter().map(|c| c[i].clone()).collect()))
        .collect())
}

/// Whether a prefill graph takes the [`LAST_ROWS`] input ([`Phase::PrefillLast`]).
pub fn takes_last_rows(graph: &Graph) -> bool {
    graph
        .inputs()
        .iter()
        .any(|&v| graph.value(v).name == LAST_ROWS)
}

/// Prefill inputs of one prompt for `graph`: [`prefill_inputs`], and the [`LAST_ROWS`]
/// input where the graph takes it ([`Phase::PrefillLast`]).
pub fn prefill_inputs_for(graph: &Graph, prompt: &[i64]) -> Result<Vec<Tensor>> {
    let mut inputs = prefill_inputs(prompt)?;
    if takes_last_rows(graph) {
        inputs.push(last_rows(&[0, prompt.len() as i64])?);
    }
    Ok(inputs)
}

/// Packed prefill inputs for `graph` and their `cu_seqlens`.
fn packed_inputs(graph: &Graph, prompts: &[&[i64]]) -> Result<(Vec<Tensor>, Vec<i64>)> {
    let mut inputs = pack_prompts(prompts)?;
    let cu = inputs[2].as_slice::<i64>()?.to_vec();
    if takes_last_rows(graph) {
        inputs.push(last_rows(&cu)?);
    }
    Ok((inputs, cu))
}

/// A [`StepRunner`] over optimized plans: one executor for the prefill, one for decode
/// steps and, optionally, one for packed prefills of several prompts. The cache (key
/// then value of each layer) stays in the backend's memory between steps
/// ([`Executor::run_resident`]) at a fixed capacity, so that each decode step writes its
/// row in place and has the shapes of the step before. The prefill and decode executors
/// run on one backend.
///
/// ```no_run
/// use std::sync::Arc;
/// use kpt_core::backend::Backend;
/// use kpt_core::exec::Executor;
/// use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
/// use kpt_core::{Graph, OptLevel};
/// use kpt_kernels::{CpuBackend, KernelRegistry};
/// use kpt_models::generate::{Generator, PlanRunner, SamplingParams, StopCondition};
/// use kpt_models::{Checkpoint, Phase};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let ckpt = Checkpoint::open(std::path::Path::new("models/tiny-llama"))?;
/// let model = ckpt.load_model(kpt_core::DType::F32)?;
/// let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new()?);
/// let registry = KernelRegistry::with_builtin();
/// let plan = |g: &Graph| -> kpt_core::Result<Executor> {
///     let p = auto_optimize(g, OptLevel::Balanced, &PrecisionPolicy::default(), &registry,
///         backend.device())?;
///     Executor::new(p, backend.clone())
/// };
/// let runner = PlanRunner::new(plan(&model.graph(Phase::Prefill, 16)?)?,
///     plan(&model.graph(Phase::Decode, 16)?)?)
///     .with_packed(plan(&model.graph_packed(32, 2)?)?);
/// let mut generator = Generator::for_model(runner, &model)?;
/// let sampling = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 1 };
/// let out = generator.generate(&[&[0, 5, 9], &[0, 7]], &sampling, &StopCondition::new(8),
///     None, |_| Ok(()))?;
/// assert_eq!(out.outputs.len(), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct PlanRunner {
    prefill: Executor,
    decode: Executor,
    packed: Option<Executor>,
    pool: CachePool,
}

impl PlanRunner {
    /// Runs prompts through `prefill` (a plan of [`Model::graph`] with
    /// [`Phase::Prefill`]) and tokens through `decode` (of [`Phase::Decode`]). Decode
    /// steps are captured and replayed where the backend can
    /// ([`Executor::set_graphs`]): every step of a sequence has one shape.
    pub fn new(prefill: Executor, mut decode: Executor) -> Self {
        decode.set_graphs(true);
        Self {
            prefill,
            decode,
            packed: None,
            pool: CachePool::default(),
        }
    }

    /// Runs several prompts at once through `packed` (a plan of [`Model::graph_packed`]).
    pub fn with_packed(mut self, packed: Executor) -> Self {
        self.packed = Some(packed);
        self
    }

    /// The prefill executor.
    pub fn prefill_executor(&mut self) -> &mut Executor {
        &mut self.prefill
    }

    /// The decode executor.
    pub fn decode_executor(&mut self) -> &mut Executor {
        &mut self.decode
    }

    /// The packed prefill executor, if there is one.
    pub fn packed_executor(&mut self) -> Option<&mut Executor> {
        self.packed.as_mut()
    }
}

/// What a decoder step gives the next choice: logits to sample from, or the token the
/// plan already picked on its device.
/// What a decode step gives a sequence: its next logits, or, where the step picked the
/// token itself (greedy decoding on a [`Phase::DecodeGreedy`] plan), the token.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    /// The logits of the next token, `[vocab]`.
    Logits(Vec<f64>),
    /// The next token.
    Token(u32),
}

impl StepOutput {
    fn logits(self) -> Result<Vec<f64>> {
        match self {
            StepOutput::Logits(l) => Ok(l),
            StepOutput::Token(_) => Err(ModelError::Generation(
                "a step picked a token, not logits".into(),
            )),
        }
    }
}

/// Whether a decoder graph outputs greedy next tokens after its logits
/// ([`Phase::DecodeGreedy`]).
pub fn picks_tokens(graph: &Graph) -> bool {
    graph
        .outputs()
        .get(1)
        .and_then(|&v| graph.spec(v).ok())
        .is_some_and(|s| s.dtype.is_index())
}

impl PlanRunner {
    /// Runs a decoder plan on host inputs followed by device-resident caches; returns the
    /// last logits (or, when `greedy`, the token the plan picked, whose logits then stay
    /// on the device) and the caches, left on the device.
    fn run(
        exec: &mut Executor,
        inputs: Vec<Tensor>,
        cache: Vec<DeviceTensor>,
        greedy: bool,
    ) -> Result<(StepOutput, Vec<DeviceTensor>)> {
        let mut feed: Vec<RunTensor> = inputs.into_iter().map(RunTensor::Host).collect();
        feed.extend(cache.into_iter().map(RunTensor::Device));
        let outputs = exec.plan().graph.outputs().len();
        let tokens = picks_tokens(&exec.plan().graph);
        let first_cache = 1 + usize::from(tokens);
        if outputs < first_cache || !(outputs - first_cache).is_multiple_of(2) || greedy && !tokens
        {
            return Err(ModelError::Generation(format!(
                "a decoder graph returns logits{} and a key and a value per layer, got \
                 {outputs} outputs",
                if greedy { ", next tokens" } else { "" }
            )));
        }
        let keep = resident_outputs(&exec.plan().graph, greedy);
        let mut outs = exec.run_resident(feed, &keep)?.into_iter();
        let logits = outs.next();
        let picked = if tokens { outs.next() } else { None };
        let next = match (greedy, logits, picked) {
            (false, Some(RunTensor::Host(t)), _) => StepOutput::Logits(last_logits(&t)?),
            (true, _, Some(RunTensor::Host(t))) => StepOutput::Token(single_token(&t)?),
            _ => {
                return Err(ModelError::Generation(
                    "a decoder plan kept its logits or tokens on the device".into(),
                ))
            }
        };
        let backend = exec.backend().clone();
        let cache = outs
            .map(|o| Ok(o.into_device(backend.as_ref())?))
            .collect::<Result<Vec<_>>>()?;
        Ok((next, cache))
    }

    /// One decode step of one sequence (see [`StepRunner::decode`]).
    fn step(
        &mut self,
        cache_out: &mut Vec<DeviceTensor>,
        token: i64,
        position: usize,
        greedy: bool,
    ) -> Result<StepOutput> {
        let backend = self.decode.backend().clone();
        let cache = self
            .pool
            .with_room(std::mem::take(cache_out), position, backend.as_ref())?;
        let capacity = cache.first().map_or(position + 1, |c| c.spec.shape[1]);
        let (next, cache) = Self::run(
            &mut self.decode,
            decode_inputs(&[token], position, capacity)?,
            cache,
            greedy,
        )?;
        *cache_out = cache;
        Ok(next)
    }
}

/// The tokens a [`Phase::DecodeGreedy`] step picked, one per sequence; -1 (a NaN among
/// a sequence's logits) is an error.
pub fn picked_tokens(t: &Tensor) -> Result<Vec<u32>> {
    t.to_f64_vec()
        .into_iter()
        .map(|id| {
            if id >= 0.0 {
                Ok(id as u32)
            } else {
                Err(ModelError::Generation(
                    "the model produced a NaN logit (greedy pick on the device)".into(),
                ))
            }
        })
        .collect()
}

/// Which outputs of a decoder plan stay on the device in a run: the caches always, the
/// logits when `greedy` (the plan's picked tokens come to the host instead).
pub fn resident_outputs(graph: &Graph, greedy: bool) -> Vec<bool> {
    let first_cache = 1 + usize::from(picks_tokens(graph));
    (0..graph.outputs().len())
        .map(|i| if i == 0 { greedy } else { i >= first_cache })
        .collect()
}

/// The token of a greedy pick of one sequence `[1, 1]`.
fn single_token(t: &Tensor) -> Result<u32> {
    match picked_tokens(t)?[..] {
        [id] => Ok(id),
        _ => Err(ModelError::Generation(format!(
            "a greedy step of one sequence picked {:?} tokens",
            t.shape()
        ))),
    }
}

/// Greedy decoding of one sequence on a [`Phase::DecodeGreedy`] plan with every step
/// queued before the token of the step before reaches the host, as vLLM's asynchronous
/// scheduling does: step `n + 1` reads step `n`'s picked token on the device, and the
/// host reads step `n`'s token ([`kpt_core::backend::Backend::download_async`], into
/// page-locked memory on CUDA) while step `n + 1` runs, so the device does not wait for
/// the host between steps. `next` gets each token, in order, until it returns `false`;
/// the step queued after that one ran without its token being used (it wrote the cache
/// row past the sequence's end, which is not read and is overwritten by the next step
/// at that position). `cache` holds one sequence's caches (grown through `pool` as they
/// fill). Returns once every queued step is done.
pub fn decode_greedy_pipelined(
    exec: &mut Executor,
    pool: &mut CachePool,
    cache: &mut Vec<DeviceTensor>,
    token: i64,
    position: usize,
    next: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    if !picks_tokens(&exec.plan().graph) {
        return Err(ModelError::Generation(
            "pipelined greedy decoding needs a plan that picks its tokens \
             (Phase::DecodeGreedy)"
                .into(),
        ));
    }
    let steps = pipelined_steps(exec, pool, cache, token, position, next);
    // The step queued past the last token, and the checks of every replay.
    let finished = exec.finish().map_err(ModelError::from);
    steps.and(finished)
}

fn pipelined_steps(
    exec: &mut Executor,
    pool: &mut CachePool,
    cache: &mut Vec<DeviceTensor>,
    token: i64,
    mut position: usize,
    next: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<()> {
    let backend = exec.backend().clone();
    // The token of the step before, on the device (the first step takes `token`).
    let mut fed: Option<DeviceTensor> = None;
    let mut pending: Option<Box<dyn PendingDownload>> = None;
    loop {
        let caches = pool.with_room(std::mem::take(cache), position, backend.as_ref())?;
        let caches_len = caches.len();
        let capacity = caches.first().map_or(position + 1, |c| c.spec.shape[1]);
        let mut inputs: Vec<RunTensor> = decode_inputs(&[token], position, capacity)?
            .into_iter()
            .map(RunTensor::Host)
            .collect();
        if let Some(ids) = fed.take() {
            inputs[0] = RunTensor::Device(ids);
        }
        inputs.extend(caches.into_iter().map(RunTensor::Device));
        // Logits (not wanted), the picked token, then the caches (updated in place).
        let mut outs = exec.enqueue(inputs, &[false])?.into_iter().skip(1);
        let mut next_out = || {
            outs.next().flatten().ok_or_else(|| {
                ModelError::Generation("a greedy decode step returned too few outputs".into())
            })
        };
        let picked = next_out()?;
        *cache = (0..caches_len).map(|_| next_out()).collect::<Result<_>>()?;
        let read = backend.download_async(&picked.buffer, &picked.spec)?;
        fed = Some(picked);
        position += 1;
        if let Some(token) = pending.replace(read) {
            if !next(single_token(&token.wait()?)?)? {
                return Ok(());
            }
        }
    }
}

/// The caches of sequences that a [`PlanRunner`] decodes together: per layer one pool of
/// blocks `[blocks, block_size, kv_dim]` (paged attention's layout, vLLM's), sequence `i`
/// owning the blocks of `tables[i]` in order. A sequence that fills its blocks gets the
/// next free one; a pool without a free block doubles (copied whole, so block numbers
/// stay).
#[derive(Debug)]
pub struct PagedBatch {
    pools: Vec<DeviceTensor>,
    block_size: usize,
    tables: Vec<Vec<i64>>,
    used: usize,
}

impl PagedBatch {
    /// The sequences' caches `[1, capacity, kv_dim]` of every layer, copied into pools
    /// of one block per sequence: blocks of the largest capacity, or of
    /// [`cache_capacity`] rows for `rows` positions where that is more.
    fn new(caches: &[Vec<DeviceTensor>], rows: usize, backend: &dyn Backend) -> Result<Self> {
        let first = caches
            .first()
            .ok_or_else(|| ModelError::Generation("a batch of no sequence".into()))?;
        let shape_err = |what: String| ModelError::Generation(format!("batched caches: {what}"));
        let mut block_size = if rows > 1 {
            cache_capacity(rows - 1)
        } else {
            1
        };
        for (i, c) in caches.iter().enumerate() {
            if c.len() != first.len() {
                return Err(shape_err(format!(
                    "sequence {i} has {} caches, sequence 0 {}",
                    c.len(),
                    first.len()
                )));
            }
            for (t, f) in c.iter().zip(first) {
                match t.spec.shape[..] {
                    [1, cap, w]
                        if Some(&w) == f.spec.shape.last() && t.spec.dtype == f.spec.dtype =>
                    {
                        block_size = block_size.max(cap);
                    }
                    _ => {
                        return Err(shape_err(format!(
                            "sequence {i}'s cache {} does not match sequence 0's {}",
                            t.spec, f.spec
                        )))
                    }
                }
                if t.buffer.scale != f.buffer.scale {
                    return Err(shape_err(format!(
                        "sequence {i}'s cache has another quantization scale"
                    )));
                }
            }
        }
        let n = caches.len();
        let pools = (0..first.len())
            .map(|layer| {
                let f = &first[layer];
                let width = f.spec.shape[2];
                let mut buffer = backend.allocate(f.spec.dtype, n * block_size * width)?;
                buffer.scale = f.buffer.scale;
                for (b, c) in caches.iter().enumerate() {
                    backend.copy_into(c[layer].view(), &mut buffer, b * block_size * width)?;
                }
                Ok(DeviceTensor {
                    buffer,
                    spec: TensorSpec::new(&[n, block_size, width], f.spec.dtype),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            pools,
            block_size,
            tables: (0..n as i64).map(|b| vec![b]).collect(),
            used: n,
        })
    }

    /// Gives sequence `i` the blocks that `position` needs, doubling the pools when none
    /// is free.
    fn room_for(&mut self, i: usize, position: usize, backend: &dyn Backend) -> Result<()> {
        while self.tables[i].len() <= position / self.block_size {
            let blocks = self.pools.first().map_or(0, |p| p.spec.shape[0]);
            if self.used == blocks {
                for pool in &mut self.pools {
                    let mut grown = pool.with_capacity(backend, 2 * pool.spec.numel())?;
                    grown.spec.shape[0] = 2 * blocks;
                    *pool = grown;
                }
            }
            self.tables[i].push(self.used as i64);
            self.used += 1;
        }
        Ok(())
    }

    /// The small inputs of a step of sequences `active` (see [`crate::lower::DecoderInputs`]):
    /// ids and positions `[A, 1]` (one position per sequence), the cache rows, the block
    /// table `[A, most blocks]` (short rows padded with their last block, never read) and
    /// the lengths with the new token.
    fn step_inputs(
        &self,
        active: &[usize],
        tokens: &[i64],
        positions: &[usize],
    ) -> Result<Vec<Tensor>> {
        let a = active.len();
        let bs = self.block_size;
        let width = active
            .iter()
            .map(|&i| self.tables[i].len())
            .max()
            .unwrap_or(1);
        let mut table = Vec::with_capacity(a * width);
        for &i in active {
            let row = &self.tables[i];
            table.extend((0..width).map(|j| row[j.min(row.len() - 1)]));
        }
        let slots = active
            .iter()
            .zip(positions)
            .map(|(&i, &p)| self.tables[i][p / bs] * bs as i64 + (p % bs) as i64)
            .collect();
        let pos: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        Ok(vec![
            Tensor::from_vec(tokens.to_vec(), &[a, 1])?,
            Tensor::from_vec(pos.clone(), &[a, 1])?,
            Tensor::from_vec(slots, &[a])?,
            Tensor::from_vec(table, &[a, width])?,
            Tensor::from_vec(pos.iter().map(|p| p + 1).collect(), &[a])?,
        ])
    }
}

impl StepRunner for PlanRunner {
    /// Keys and values `[1, capacity, kv_dim]` of every layer in the decode backend's
    /// memory (the first `position` rows valid): a decode step writes its row in place,
    /// and a full cache grows to [`cache_capacity`].
    type Cache = Vec<DeviceTensor>;
    type Batch = PagedBatch;

    fn reserve(&mut self, cache: &mut Vec<DeviceTensor>, rows: usize) -> Result<()> {
        let backend = self.decode.backend().clone();
        let position = rows.saturating_sub(1);
        *cache = self
            .pool
            .with_room(std::mem::take(cache), position, backend.as_ref())?;
        Ok(())
    }

    fn batch(&mut self, caches: Vec<Vec<DeviceTensor>>, rows: usize) -> Result<PagedBatch> {
        let batch = PagedBatch::new(&caches, rows, self.decode.backend().as_ref())?;
        for cache in caches {
            self.pool.release(cache);
        }
        Ok(batch)
    }

    fn decode_batch(
        &mut self,
        batch: &mut PagedBatch,
        active: &[usize],
        tokens: &[i64],
        positions: &[usize],
        greedy: bool,
    ) -> Result<Vec<StepOutput>> {
        check_batch_step(batch.tables.len(), active, tokens, positions)?;
        let backend = self.decode.backend().clone();
        for (&i, &p) in active.iter().zip(positions) {
            batch.room_for(i, p, backend.as_ref())?;
        }
        let graph = &self.decode.plan().graph;
        let has_tokens = picks_tokens(graph);
        let picks = greedy && has_tokens;
        let keep = resident_outputs(graph, picks);
        let mut feed: Vec<RunTensor> = batch
            .step_inputs(active, tokens, positions)?
            .into_iter()
            .map(RunTensor::Host)
            .collect();
        feed.extend(
            std::mem::take(&mut batch.pools)
                .into_iter()
                .map(RunTensor::Device),
        );
        let mut outs = self.decode.run_resident(feed, &keep)?.into_iter();
        let logits = outs.next();
        let picked = if has_tokens { outs.next() } else { None };
        batch.pools = outs
            .map(|o| Ok(o.into_device(backend.as_ref())?))
            .collect::<Result<Vec<_>>>()?;
        let next: Vec<StepOutput> = match (picks, logits, picked) {
            (true, _, Some(RunTensor::Host(t))) => picked_tokens(&t)?
                .into_iter()
                .map(StepOutput::Token)
                .collect(),
            (false, Some(RunTensor::Host(t)), _) => {
                let vocab = t.shape().last().copied().unwrap_or(0).max(1);
                t.to_f64_vec()
                    .chunks(vocab)
                    .map(|row| {
                        Ok(if greedy {
                            StepOutput::Token(argmax(row)?)
                        } else {
                            StepOutput::Logits(row.to_vec())
                        })
                    })
                    .collect::<Result<_>>()?
            }
            _ => {
                return Err(ModelError::Generation(
                    "a decoder plan kept its logits or tokens on the device".into(),
                ))
            }
        };
        if next.len() != active.len() {
            return Err(ModelError::Generation(format!(
                "a batched decode step of {} sequences returned {} results",
                active.len(),
                next.len()
            )));
        }
        Ok(next)
    }

    fn release(&mut self, cache: Vec<DeviceTensor>) {
        self.pool.release(cache);
    }

    fn prefill(&mut self, prompt: &[i64]) -> Result<(Vec<f64>, Vec<DeviceTensor>)> {
        let inputs = prefill_inputs_for(&self.prefill.plan().graph, prompt)?;
        let (next, cache) = Self::run(&mut self.prefill, inputs, Vec::new(), false)?;
        Ok((next.logits()?, cache))
    }

    fn prefill_many(&mut self, prompts: &[&[i64]]) -> Result<Vec<(Vec<f64>, Vec<DeviceTensor>)>> {
        match &mut self.packed {
            Some(exec) if prompts.len() > 1 => {
                let graph = &exec.plan().graph;
                let last_only = takes_last_rows(graph);
                let (inputs, cu) = packed_inputs(graph, prompts)?;
                let backend = self.decode.backend().clone();
                unpack_outputs(exec.run(&inputs)?, &cu, last_only)?
                    .into_iter()
                    .map(|(logits, cache)| {
                        let cache = cache
                            .iter()
                            .map(|t| Ok(DeviceTensor::upload(backend.as_ref(), t)?))
                            .collect::<Result<Vec<_>>>()?;
                        Ok((logits, cache))
                    })
                    .collect()
            }
            _ => prompts.iter().map(|p| self.prefill(p)).collect(),
        }
    }

    fn decode(
        &mut self,
        cache: &mut Vec<DeviceTensor>,
        token: i64,
        position: usize,
    ) -> Result<Vec<f64>> {
        self.step(cache, token, position, false)?.logits()
    }

    fn decode_greedy(
        &mut self,
        cache: &mut Vec<DeviceTensor>,
        token: i64,
        position: usize,
    ) -> Result<u32> {
        if !picks_tokens(&self.decode.plan().graph) {
            return argmax(&self.decode(cache, token, position)?);
        }
        match self.step(cache, token, position, true)? {
            StepOutput::Token(t) => Ok(t),
            StepOutput::Logits(l) => argmax(&l),
        }
    }

    fn decode_greedy_run(
        &mut self,
        cache: &mut Vec<DeviceTensor>,
        token: i64,
        position: usize,
        next: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<()> {
        if picks_tokens(&self.decode.plan().graph) {
            let (exec, pool) = (&mut self.decode, &mut self.pool);
            decode_greedy_pipelined(exec, pool, cache, token, position, next)
        } else {
            greedy_steps(self, cache, token, position, next)
        }
    }
}

/// A [`StepRunner`] that runs a model's graphs on an f64 reference (every op evaluated
/// by `reference`, no optimization): what optimized plans are compared with.
pub struct ReferenceRunner<'a> {
    prefill: Graph,
    decode: Graph,
    packed: Graph,
    reference: &'a dyn ReferenceOps,
}

impl std::fmt::Debug for ReferenceRunner<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceRunner")
            .field("prefill_nodes", &self.prefill.nodes().len())
            .finish_non_exhaustive()
    }
}

impl<'a> ReferenceRunner<'a> {
    /// Builds the prefill, decode and packed graphs of `model` (a decoder).
    pub fn new(model: &Model, reference: &'a dyn ReferenceOps) -> Result<Self> {
        require_decoder(model)?;
        Ok(Self {
            prefill: model.graph(Phase::Prefill, 1)?,
            decode: model.graph(Phase::Decode, 1)?,
            packed: model.graph_packed(2, 2)?,
            reference,
        })
    }
}

impl StepRunner for ReferenceRunner<'_> {
    type Cache = Vec<Tensor>;
    type Batch = Vec<Vec<Tensor>>;

    fn batch(&mut self, caches: Vec<Vec<Tensor>>, _rows: usize) -> Result<Vec<Vec<Tensor>>> {
        Ok(caches)
    }

    fn decode_batch(
        &mut self,
        batch: &mut Vec<Vec<Tensor>>,
        active: &[usize],
        tokens: &[i64],
        positions: &[usize],
        greedy: bool,
    ) -> Result<Vec<StepOutput>> {
        decode_each(self, batch, active, tokens, positions, greedy)
    }

    fn prefill(&mut self, prompt: &[i64]) -> Result<(Vec<f64>, Vec<Tensor>)> {
        let outs = run_reference(&self.prefill, self.reference, &prefill_inputs(prompt)?)?;
        let (logits, cache) = split_outputs(outs)?;
        Ok((last_logits(&logits)?, cache))
    }

    fn prefill_many(&mut self, prompts: &[&[i64]]) -> Result<Vec<(Vec<f64>, Vec<Tensor>)>> {
        if prompts.len() < 2 {
            return prompts.iter().map(|p| self.prefill(p)).collect();
        }
        let (inputs, cu) = packed_inputs(&self.packed, prompts)?;
        let last_only = takes_last_rows(&self.packed);
        unpack_outputs(
            run_reference(&self.packed, self.reference, &inputs)?,
            &cu,
            last_only,
        )
    }

    fn decode(&mut self, cache: &mut Vec<Tensor>, token: i64, position: usize) -> Result<Vec<f64>> {
        let inputs = decode_step_inputs(token, position, std::mem::take(cache))?;
        let outs = run_reference(&self.decode, self.reference, &inputs)?;
        let (logits, next) = split_outputs(outs)?;
        *cache = next;
        last_logits(&logits)
    }
}

fn require_decoder(model: &Model) -> Result<()> {
    if model.is_decoder() {
        Ok(())
    } else {
        Err(ModelError::Generation(
            "this model is an encoder (BERT): it makes embeddings, not text".into(),
        ))
    }
}

/// Generates text with a [`StepRunner`]: validation of the request, one prefill for all
/// prompts, then sampling and decode steps per sequence until each one stops.
#[derive(Debug)]
pub struct Generator<R: StepRunner> {
    runner: R,
    vocab: usize,
    max_positions: Option<usize>,
}

/// The state of one sequence during [`Generator::generate`].
/// The most cache rows a generation reserves before decoding (`StepRunner::reserve`);
/// longer ones grow their caches as they fill.
const MAX_RESERVED_ROWS: usize = 1 << 16;

struct Sequence {
    next: StepOutput,
    sampler: Sampler,
    position: usize,
    tokens: Vec<u32>,
    stop: Option<StopReason>,
}

impl<R: StepRunner> Generator<R> {
    /// A generator for a model of `vocab` tokens without a position limit.
    pub fn new(runner: R, vocab: usize) -> Self {
        Self {
            runner,
            vocab,
            max_positions: None,
        }
    }

    /// A generator for `model`: its vocabulary and position limit (GPT-2's learned
    /// position table). An encoder is an error.
    pub fn for_model(runner: R, model: &Model) -> Result<Self> {
        require_decoder(model)?;
        Ok(Self {
            runner,
            vocab: model.vocab_size(),
            max_positions: model.max_positions(),
        })
    }

    /// Refuses requests that need positions at or past `max`.
    pub fn with_max_positions(mut self, max: usize) -> Self {
        self.max_positions = Some(max);
        self
    }

    /// The runner.
    pub fn runner(&mut self) -> &mut R {
        &mut self.runner
    }

    /// Gives the runner back.
    pub fn into_runner(self) -> R {
        self.runner
    }

    fn check(
        &self,
        prompts: &[&[u32]],
        sampling: &SamplingParams,
        stop: &StopCondition,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<()> {
        sampling.validate()?;
        if prompts.is_empty() {
            return Err(ModelError::Generation("no prompt to continue".into()));
        }
        if stop.max_new_tokens == 0 {
            return Err(ModelError::Generation(
                "max_new_tokens is 0: nothing to generate".into(),
            ));
        }
        if !stop.stop_strings.is_empty() && tokenizer.is_none() {
            return Err(ModelError::Generation(
                "stop strings need the tokenizer to decode the generated text".into(),
            ));
        }
        if stop.stop_strings.iter().any(String::is_empty) {
            return Err(ModelError::Generation("a stop string is empty".into()));
        }
        for (i, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(ModelError::Generation(format!(
                    "prompt {i} has no token (an empty text without a BOS token)"
                )));
            }
            if let Some(&t) = p.iter().find(|&&t| t as usize >= self.vocab) {
                return Err(ModelError::Generation(format!(
                    "prompt {i} has token {t}, outside the model's vocabulary of {}",
                    self.vocab
                )));
            }
            // The last generated token is never fed back, so the positions used run to
            // len + max_new_tokens - 2.
            if let Some(max) = self.max_positions {
                let needed = p.len().saturating_add(stop.max_new_tokens - 1);
                if needed > max {
                    return Err(ModelError::Generation(format!(
                        "prompt {i} of {} tokens plus {} new tokens needs {needed} positions; \
                         the model has {max}",
                        p.len(),
                        stop.max_new_tokens
                    )));
                }
            }
        }
        Ok(())
    }

    /// Continues each of `prompts` (token ids) until `stop` holds for it, choosing
    /// tokens with `sampling` (sequence `i` draws from its own stream seeded with
    /// `sampling.seed + i`) and calling `on_token` with each token as it is chosen
    /// (an error from it ends the generation). Several prompts share one packed prefill
    /// when the runner has one; decode steps then run each sequence in turn.
    /// `tokenizer` is needed only for stop strings.
    pub fn generate(
        &mut self,
        prompts: &[&[u32]],
        sampling: &SamplingParams,
        stop: &StopCondition,
        tokenizer: Option<&Tokenizer>,
        mut on_token: impl FnMut(&TokenEvent) -> Result<()>,
    ) -> Result<Generation> {
        self.check(prompts, sampling, stop, tokenizer)?;
        let _span = tracing::info_span!("generate", prompts = prompts.len()).entered();
        let ids: Vec<Vec<i64>> = prompts
            .iter()
            .map(|p| p.iter().map(|&t| i64::from(t)).collect())
            .collect();
        let refs: Vec<&[i64]> = ids.iter().map(Vec::as_slice).collect();
        let mut stats = GenerationStats {
            prompt_tokens: refs.iter().map(|p| p.len()).sum(),
            ..Default::default()
        };
        let t0 = Instant::now();
        let first = if refs.len() == 1 {
            vec![self.runner.prefill(refs[0])?]
        } else {
            self.runner.prefill_many(&refs)?
        };
        stats.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        if first.len() != refs.len() {
            return Err(ModelError::Generation(format!(
                "the prefill returned {} sequences for {} prompts",
                first.len(),
                refs.len()
            )));
        }
        let (firsts, mut caches): (Vec<_>, Vec<_>) = first.into_iter().unzip();
        let mut seqs = firsts
            .into_iter()
            .zip(&refs)
            .enumerate()
            .map(|(i, (logits, p))| {
                Ok(Sequence {
                    next: StepOutput::Logits(logits),
                    sampler: Sampler::new(SamplingParams {
                        seed: sampling.seed.wrapping_add(i as u64),
                        ..*sampling
                    })?,
                    position: p.len(),
                    tokens: Vec::new(),
                    stop: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Greedy steps ask the runner for the token alone (picked on the device where its
        // plan can).
        let greedy = sampling.is_greedy();
        // Every position a sequence can reach: its prompt and all but its last new token
        // (at most MAX_RESERVED_ROWS ahead; caches grow past that as they fill).
        let rows = (refs.iter().map(|p| p.len()).max().unwrap_or(0))
            .saturating_add(stop.max_new_tokens - 1)
            .min(MAX_RESERVED_ROWS);
        if seqs.len() == 1 {
            let mut cache = caches.pop().expect("one prompt, one cache");
            self.runner.reserve(&mut cache, rows)?;
            let (cache, done) = self.decode_one(
                cache,
                &mut seqs[0],
                greedy,
                stop,
                tokenizer,
                &mut on_token,
                &mut stats,
            );
            self.runner.release(cache);
            done?;
        } else {
            // Several sequences step together, each step one token of every unfinished one.
            let mut batch = self.runner.batch(caches, rows)?;
            let done = self.decode_many(
                &mut batch,
                &mut seqs,
                greedy,
                stop,
                tokenizer,
                &mut on_token,
                &mut stats,
            );
            self.runner.release_batch(batch);
            done?;
        }
        stats.generated_tokens = seqs.iter().map(|s| s.tokens.len()).sum();
        let outputs = seqs
            .into_iter()
            .map(|s| SequenceOutput {
                tokens: s.tokens,
                stop: s.stop.unwrap_or(StopReason::MaxTokens),
            })
            .collect();
        Ok(Generation { outputs, stats })
    }

    /// Decodes one sequence until it stops; a greedy one runs its steps ahead of its
    /// tokens ([`StepRunner::decode_greedy_run`]). Gives its cache back, also on an error.
    #[allow(clippy::too_many_arguments)]
    fn decode_one(
        &mut self,
        mut cache: R::Cache,
        s: &mut Sequence,
        greedy: bool,
        stop: &StopCondition,
        tokenizer: Option<&Tokenizer>,
        on_token: &mut impl FnMut(&TokenEvent) -> Result<()>,
        stats: &mut GenerationStats,
    ) -> (R::Cache, Result<()>) {
        let mut run = || -> Result<()> {
            loop {
                let token = match &s.next {
                    StepOutput::Logits(logits) => s.sampler.sample(logits)?,
                    StepOutput::Token(t) => *t,
                };
                s.stop = Self::accept(&mut s.tokens, (0, token), stop, tokenizer, on_token)?;
                if s.stop.is_some() {
                    return Ok(());
                }
                let t = Instant::now();
                let id = i64::from(token);
                if greedy {
                    let (tokens, stopped, position) = (&mut s.tokens, &mut s.stop, &mut s.position);
                    let mut last = t;
                    self.runner
                        .decode_greedy_run(&mut cache, id, *position, &mut |token| {
                            let now = Instant::now();
                            stats.decode_ms.push((now - last).as_secs_f64() * 1e3);
                            stats.decode_tokens += 1;
                            last = now;
                            *position += 1;
                            *stopped = Self::accept(tokens, (0, token), stop, tokenizer, on_token)?;
                            Ok(stopped.is_none())
                        })?;
                    if s.stop.is_none() {
                        return Err(ModelError::Generation(
                            "greedy decoding ended before a stop condition held".into(),
                        ));
                    }
                    return Ok(());
                }
                s.next = StepOutput::Logits(self.runner.decode(&mut cache, id, s.position)?);
                stats.decode_ms.push(t.elapsed().as_secs_f64() * 1e3);
                stats.decode_tokens += 1;
                s.position += 1;
            }
        };
        let done = run();
        (cache, done)
    }

    /// Decodes several sequences together until every one stopped: each step samples
    /// (or takes) the next token of every unfinished sequence and runs one
    /// [`StepRunner::decode_batch`] for those that go on.
    #[allow(clippy::too_many_arguments)]
    fn decode_many(
        &mut self,
        batch: &mut R::Batch,
        seqs: &mut [Sequence],
        greedy: bool,
        stop: &StopCondition,
        tokenizer: Option<&Tokenizer>,
        on_token: &mut impl FnMut(&TokenEvent) -> Result<()>,
        stats: &mut GenerationStats,
    ) -> Result<()> {
        loop {
            let (mut active, mut tokens, mut positions) = (Vec::new(), Vec::new(), Vec::new());
            for (i, s) in seqs.iter_mut().enumerate() {
                if s.stop.is_some() {
                    continue;
                }
                let token = match &s.next {
                    StepOutput::Logits(logits) => s.sampler.sample(logits)?,
                    StepOutput::Token(t) => *t,
                };
                s.stop = Self::accept(&mut s.tokens, (i, token), stop, tokenizer, on_token)?;
                if s.stop.is_none() {
                    active.push(i);
                    tokens.push(i64::from(token));
                    positions.push(s.position);
                }
            }
            if active.is_empty() {
                return Ok(());
            }
            let t = Instant::now();
            let next = self
                .runner
                .decode_batch(batch, &active, &tokens, &positions, greedy)?;
            stats.decode_ms.push(t.elapsed().as_secs_f64() * 1e3);
            stats.decode_tokens += active.len();
            for (&i, out) in active.iter().zip(next) {
                seqs[i].next = out;
                seqs[i].position += 1;
            }
        }
    }

    /// Appends sequence `i`'s next `token`, reports it and says whether the sequence
    /// stops there.
    fn accept(
        tokens: &mut Vec<u32>,
        (i, token): (usize, u32),
        stop: &StopCondition,
        tokenizer: Option<&Tokenizer>,
        on_token: &mut impl FnMut(&TokenEvent) -> Result<()>,
    ) -> Result<Option<StopReason>> {
        tokens.push(token);
        on_token(&TokenEvent {
            sequence: i,
            index: tokens.len() - 1,
            token,
        })?;
        Self::stopped(tokens, token, stop, tokenizer)
    }

    fn stopped(
        tokens: &[u32],
        token: u32,
        stop: &StopCondition,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<Option<StopReason>> {
        if stop.eos.contains(&token) {
            return Ok(Some(StopReason::Eos(token)));
        }
        if let (false, Some(tok)) = (stop.stop_strings.is_empty(), tokenizer) {
            let text = tok.decode(tokens, true)?;
            if let Some(hit) = stop.stop_strings.iter().find(|m| text.contains(m.as_str())) {
                return Ok(Some(StopReason::StopString(hit.clone())));
            }
        }
        if tokens.len() >= stop.max_new_tokens {
            return Ok(Some(StopReason::MaxTokens));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_k: usize, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 42,
        }
    }

    fn softmax(x: &[f64]) -> Vec<f64> {
        let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    const LOGITS: [f64; 6] = [1.0, 3.0, -2.0, 2.0, 0.5, 2.0];

    #[test]
    fn ranges_are_checked() {
        for (p, name) in [
            (params(-0.1, 0, 1.0), "temperature"),
            (params(f64::NAN, 0, 1.0), "temperature"),
            (params(f64::INFINITY, 0, 1.0), "temperature"),
            (params(1.0, 0, 0.0), "top_p"),
            (params(1.0, 0, 1.01), "top_p"),
            (params(1.0, 0, f64::NAN), "top_p"),
        ] {
            match Sampler::new(p) {
                Err(ModelError::InvalidSampling { parameter, message }) => {
                    assert_eq!(parameter, name, "{message}");
                }
                other => panic!("{p:?}: {other:?}"),
            }
        }
        assert!(Sampler::new(params(0.0, 5, 1.0)).is_ok());
        let e = SamplingParams::greedy().distribution(&[]).unwrap_err();
        assert!(e.to_string().contains("no logits"), "{e}");
        let e = argmax(&[1.0, f64::NAN]).unwrap_err();
        assert!(e.to_string().contains("non-finite"), "{e}");
        assert!(argmax(&[f64::NEG_INFINITY; 3]).is_err());
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&LOGITS).unwrap(), 1);
        assert_eq!(s.sample(&[0.0, 5.0, 5.0]).unwrap(), 1);
        assert_eq!(s.sample(&[f64::NEG_INFINITY, -3.0]).unwrap(), 1);
        assert_eq!(
            SamplingParams::greedy().distribution(&LOGITS).unwrap(),
            vec![(1, 1.0)]
        );
    }

    #[test]
    fn temperature_scales_the_softmax() {
        for t in [0.5, 1.0, 2.0] {
            let d = params(t, 0, 1.0).distribution(&LOGITS).unwrap();
            let scaled: Vec<f64> = LOGITS.iter().map(|x| x / t).collect();
            let want = softmax(&scaled);
            assert_eq!(d.len(), LOGITS.len());
            for (tok, p) in d {
                assert!((p - want[tok as usize]).abs() < 1e-12, "t {t} token {tok}");
            }
        }
        // Sorted most likely first, ties by id: 1 (3.0), 3 and 5 (2.0), 0, 4, 2.
        let order: Vec<u32> = params(1.0, 0, 1.0)
            .distribution(&LOGITS)
            .unwrap()
            .iter()
            .map(|&(t, _)| t)
            .collect();
        assert_eq!(order, [1, 3, 5, 0, 4, 2]);
    }

    #[test]
    fn top_k_keeps_the_k_largest() {
        let d = params(1.0, 3, 1.0).distribution(&LOGITS).unwrap();
        let toks: Vec<u32> = d.iter().map(|&(t, _)| t).collect();
        assert_eq!(toks, [1, 3, 5]);
        let want = softmax(&[3.0, 2.0, 2.0]);
        for ((_, p), w) in d.iter().zip(want) {
            assert!((p - w).abs() < 1e-12);
        }
        // k = 1 is greedy; k past the vocabulary keeps everything.
        assert_eq!(
            params(1.0, 1, 1.0).distribution(&LOGITS).unwrap(),
            vec![(1, 1.0)]
        );
        assert_eq!(
            params(1.0, 100, 1.0).distribution(&LOGITS).unwrap().len(),
            6
        );
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 0.5, 0.3, 0.15, 0.05.
        let logits: Vec<f64> = [0.5f64, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let kept = |p: f64| -> Vec<u32> {
            params(1.0, 0, p)
                .distribution(&logits)
                .unwrap()
                .iter()
                .map(|&(t, _)| t)
                .collect()
        };
        assert_eq!(kept(0.4), [0]);
        assert_eq!(kept(0.49), [0]);
        assert_eq!(kept(0.6), [0, 1]);
        assert_eq!(kept(0.79), [0, 1]);
        assert_eq!(kept(0.81), [0, 1, 2]);
        assert_eq!(kept(0.96), [0, 1, 2, 3]);
        assert_eq!(kept(1.0), [0, 1, 2, 3]);
        let d = params(1.0, 0, 0.6).distribution(&logits).unwrap();
        assert!((d[0].1 - 0.625).abs() < 1e-12 && (d[1].1 - 0.375).abs() < 1e-12);
        // Top-p applies after top-k and temperature: of the top 2 at T = 1 (0.625,
        // 0.375), p = 0.7 keeps both.
        assert_eq!(params(1.0, 2, 0.7).distribution(&logits).unwrap().len(), 2);
        // Order: a high temperature flattens the distribution, so top-p keeps more.
        assert_eq!(params(10.0, 0, 0.6).distribution(&logits).unwrap().len(), 3);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let draw = |seed: u64| -> Vec<u32> {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params(1.0, 0, 1.0)
            })
            .unwrap();
            (0..50).map(|_| s.sample(&LOGITS).unwrap()).collect()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn draws_follow_the_distribution() {
        for p in [
            params(1.0, 0, 1.0),
            params(0.7, 4, 1.0),
            params(1.3, 0, 0.8),
        ] {
            let want = p.distribution(&LOGITS).unwrap();
            let mut s = Sampler::new(p).unwrap();
            let n = 40_000;
            let mut counts = [0usize; 6];
            for _ in 0..n {
                counts[s.sample(&LOGITS).unwrap() as usize] += 1;
            }
            for (tok, c) in counts.iter().enumerate() {
                let prob = want
                    .iter()
                    .find(|&&(t, _)| t as usize == tok)
                    .map_or(0.0, |&(_, p)| p);
                let freq = *c as f64 / n as f64;
                // 5 standard deviations of a binomial frequency.
                let sd = (prob * (1.0 - prob) / n as f64).sqrt();
                assert!(
                    (freq - prob).abs() <= 5.0 * sd + 1e-9,
                    "{p:?} token {tok}: frequency {freq} vs probability {prob}"
                );
                if prob == 0.0 {
                    assert_eq!(*c, 0, "{p:?}: masked token {tok} drawn");
                }
            }
        }
    }

    #[test]
    fn masked_logits_are_never_drawn() {
        let logits = [f64::NEG_INFINITY, 0.0, f64::NEG_INFINITY, 0.0];
        let d = params(1.0, 0, 1.0).distribution(&logits).unwrap();
        assert_eq!(d, vec![(1, 0.5), (3, 0.5)]);
    }

    /// A runner over a fixed table: the logits after token `t` favour `(t + 1) % V`.
    struct Cycle {
        vocab: usize,
        decodes: usize,
        batched_steps: usize,
    }

    impl StepRunner for Cycle {
        type Cache = Vec<i64>;
        type Batch = Vec<Vec<i64>>;

        fn batch(&mut self, caches: Vec<Vec<i64>>, _rows: usize) -> Result<Vec<Vec<i64>>> {
            Ok(caches)
        }

        fn decode_batch(
            &mut self,
            batch: &mut Vec<Vec<i64>>,
            active: &[usize],
            tokens: &[i64],
            positions: &[usize],
            greedy: bool,
        ) -> Result<Vec<StepOutput>> {
            self.batched_steps += 1;
            decode_each(self, batch, active, tokens, positions, greedy)
        }

        fn prefill(&mut self, prompt: &[i64]) -> Result<(Vec<f64>, Vec<i64>)> {
            let last = *prompt.last().unwrap();
            Ok((self.logits(last), prompt.to_vec()))
        }

        fn decode(
            &mut self,
            cache: &mut Vec<i64>,
            token: i64,
            position: usize,
        ) -> Result<Vec<f64>> {
            assert_eq!(position, cache.len());
            cache.push(token);
            self.decodes += 1;
            Ok(self.logits(token))
        }
    }

    impl Cycle {
        fn logits(&self, t: i64) -> Vec<f64> {
            let next = (t as usize + 1) % self.vocab;
            (0..self.vocab)
                .map(|i| if i == next { 1.0 } else { 0.0 })
                .collect()
        }
    }

    #[test]
    fn generator_stops_and_reports_every_token() {
        let mut g = Generator::new(
            Cycle {
                vocab: 8,
                decodes: 0,
                batched_steps: 0,
            },
            8,
        );
        let mut events = Vec::new();
        let out = g
            .generate(
                &[&[2, 3], &[6]],
                &SamplingParams::greedy(),
                &StopCondition::new(4).with_eos(&[0]),
                None,
                |e| {
                    events.push(*e);
                    Ok(())
                },
            )
            .unwrap();
        assert_eq!(out.outputs[0].tokens, [4, 5, 6, 7]);
        assert_eq!(out.outputs[0].stop, StopReason::MaxTokens);
        assert_eq!(out.outputs[1].tokens, [7, 0]);
        assert_eq!(out.outputs[1].stop, StopReason::Eos(0));
        assert_eq!(out.stats.generated_tokens, 6);
        assert_eq!(out.stats.prompt_tokens, 3);
        // No decode after a sequence's last token: 3 + 1 decodes, in 3 batched steps (two
        // sequences, then the first alone).
        assert_eq!(g.runner().decodes, 4);
        assert_eq!(g.runner().batched_steps, 3);
        // No token budget to speak of (nothing reserved past MAX_RESERVED_ROWS): EOS ends it.
        let open = g
            .generate(
                &[&[2], &[3]],
                &SamplingParams::greedy(),
                &StopCondition::new(usize::MAX).with_eos(&[6]),
                None,
                |_| Ok(()),
            )
            .unwrap();
        assert_eq!(open.outputs[0].tokens, [3, 4, 5, 6]);
        assert_eq!(open.outputs[1].tokens, [4, 5, 6]);
        assert_eq!(out.stats.decode_ms.len(), 3);
        assert_eq!(out.stats.decode_tokens, 4);
        assert_eq!(events.len(), 6);
        assert_eq!(
            events[..3],
            [
                TokenEvent {
                    sequence: 0,
                    index: 0,
                    token: 4
                },
                TokenEvent {
                    sequence: 1,
                    index: 0,
                    token: 7
                },
                TokenEvent {
                    sequence: 0,
                    index: 1,
                    token: 5
                },
            ]
        );
    }

    #[test]
    fn bad_requests_are_errors() {
        let mut g = Generator::new(
            Cycle {
                vocab: 8,
                decodes: 0,
                batched_steps: 0,
            },
            8,
        )
        .with_max_positions(5);
        let greedy = SamplingParams::greedy();
        let mut run = |prompts: &[&[u32]], stop: StopCondition| {
            g.generate(prompts, &greedy, &stop, None, |_| Ok(()))
                .unwrap_err()
                .to_string()
        };
        assert!(run(&[], StopCondition::new(2)).contains("no prompt"));
        assert!(run(&[&[1], &[]], StopCondition::new(2)).contains("prompt 1 has no token"));
        assert!(run(&[&[1, 9]], StopCondition::new(2)).contains("token 9, outside"));
        assert!(run(&[&[1]], StopCondition::new(0)).contains("max_new_tokens is 0"));
        assert!(run(&[&[1, 2, 3]], StopCondition::new(4)).contains("needs 6 positions"));
        let e = run(&[&[1, 2, 3]], StopCondition::new(usize::MAX));
        assert!(e.contains("positions"), "{e}");
        let e = run(&[&[1]], StopCondition::new(2).with_stop_strings(["x"]));
        assert!(e.contains("need the tokenizer"), "{e}");
        let bad = SamplingParams {
            top_p: 0.0,
            ..greedy
        };
        let e = g
            .generate(&[&[1]], &bad, &StopCondition::new(1), None, |_| Ok(()))
            .unwrap_err();
        assert!(matches!(
            e,
            ModelError::InvalidSampling {
                parameter: "top_p",
                ..
            }
        ));
        // An error of the callback ends the generation.
        let e = g
            .generate(&[&[1]], &greedy, &StopCondition::new(3), None, |_| {
                Err(ModelError::Generation("stop here".into()))
            })
            .unwrap_err();
        assert!(e.to_string().contains("stop here"));
        // Exactly at the limit is fine: 3 prompt tokens + 3 new use positions 0..5.
        let out = g
            .generate(&[&[1, 2, 3]], &greedy, &StopCondition::new(3), None, |_| {
                Ok(())
            })
            .unwrap();
        assert_eq!(out.outputs[0].tokens, [4, 5, 6]);
    }
}
