//! Captured runs (CUDA graphs) of `Executor::set_graphs` on a real GPU: a fixed-shape,
//! decode-like graph (embedding, M = 1 linears on the GEMV kernel, RMS norm, rotary with
//! host positions, `CacheWrite` into device-resident caches at host slots, split-KV
//! attention over a fixed dense k/v, SwiGLU, residual adds) run step after step with
//! graphs on and off: the same bits every step, the same caches, a recapture after the
//! caches change, and the deferred embedding check after a replay.
//!
//! Without a CUDA device every test returns after printing one `SKIPPED` line; with
//! `KPT_REQUIRE_GPU=1` a missing device fails instead.

use std::io::Write;
use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::exec::{DeviceTensor, Executor, GraphStats, RunTensor};
use kpt_core::graph::{Activation, AttentionParams, Graph, Op};
use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
use kpt_core::rand::SplitMix64;
use kpt_core::{DType, OptLevel, Tensor};
use kpt_kernels::KernelRegistry;
use kpt_nvidia::{CudaBackend, CudaOptions};

const DT: DType = DType::BF16;
const HIDDEN: usize = 256;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const KV: usize = KV_HEADS * HEAD_DIM;
const FFN: usize = 512;
const VOCAB: usize = 300;
const LAYERS: usize = 2;
/// Rows of each KV cache (written at the step's slot).
const CAPACITY: usize = 64;
/// Keys of the fixed dense k/v that attention reads (split-KV at this length).
const KEYS: usize = 256;

fn backend() -> Option<Arc<dyn Backend>> {
    let required = std::env::var("KPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let found = kpt_nvidia::devices().map(|d| d.len()).unwrap_or(0);
    if found == 0 {
        assert!(!required, "KPT_REQUIRE_GPU=1 but no CUDA device is visible");
        let _ = writeln!(
            std::io::stderr(),
            "kpt-nvidia graph tests SKIPPED: no CUDA device"
        );
        return None;
    }
    Some(Arc::new(
        CudaBackend::new(0, CudaOptions::default()).expect("CUDA backend on device 0"),
    ))
}

fn random(rng: &mut SplitMix64, shape: &[usize], scale: f32) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = rng
        .vec(n, -scale, scale)
        .into_iter()
        .map(f64::from)
        .collect();
    Tensor::from_f64(&v, shape, DT).unwrap()
}

/// Inputs: ids, positions, slots (host), then per layer its k and v caches (device).
/// Attention reads a fixed dense k/v (parameters). Outputs: logits, then the caches.
fn decode_graph(seed: u64) -> Graph {
    let mut rng = SplitMix64::new(seed);
    let mut g = Graph::new();
    let ids = g.input("ids", DType::I32, &[1, 1]);
    let pos = g.input("positions", DType::I32, &[1]);
    let slots = g.input("slots", DType::I64, &[1]);
    let caches: Vec<_> = (0..LAYERS)
        .map(|l| {
            (
                g.input(format!("k_cache{l}"), DT, &[CAPACITY, KV]),
                g.input(format!("v_cache{l}"), DT, &[CAPACITY, KV]),
            )
        })
        .collect();
    let mut param = |g: &mut Graph, name: &str, shape: &[usize], scale: f32| {
        g.param(name, random(&mut rng, shape, scale))
    };
    let k_fix = param(&mut g, "k_fixed", &[1, KEYS, KV], 1.0);
    let v_fix = param(&mut g, "v_fixed", &[1, KEYS, KV], 1.0);
    let table = param(&mut g, "embed", &[VOCAB, HIDDEN], 1.0);
    let mut x = g.op("embed", Op::Embedding, &[ids, table]).unwrap();
    let rotary = Op::Rotary {
        head_dim: HEAD_DIM,
        theta: 10000.0,
        scaling: None,
    };
    let lin = Op::Linear { bias: false };
    let norm = Op::RmsNorm { eps: 1e-5 };
    let mut written = Vec::new();
    for (l, &(kc, vc)) in caches.iter().enumerate() {
        let w = param(&mut g, &format!("n1.{l}"), &[HIDDEN], 1.0);
        let h = g.op(format!("n1.{l}"), norm.clone(), &[x, w]).unwrap();
        let wq = param(&mut g, &format!("q.{l}"), &[HIDDEN, HIDDEN], 0.06);
        let wk = param(&mut g, &format!("k.{l}"), &[KV, HIDDEN], 0.06);
        let wv = param(&mut g, &format!("v.{l}"), &[KV, HIDDEN], 0.06);
        let q = g.op(format!("q.{l}"), lin.clone(), &[h, wq]).unwrap();
        let k = g.op(format!("k.{l}"), lin.clone(), &[h, wk]).unwrap();
        let v = g.op(format!("v.{l}"), lin.clone(), &[h, wv]).unwrap();
        let q = g.op(format!("rq.{l}"), rotary.clone(), &[q, pos]).unwrap();
        let k = g.op(format!("rk.{l}"), rotary.clone(), &[k, pos]).unwrap();
        written.push(
            g.op(format!("kw.{l}"), Op::CacheWrite, &[kc, k, slots])
                .unwrap(),
        );
        written.push(
            g.op(format!("vw.{l}"), Op::CacheWrite, &[vc, v, slots])
                .unwrap(),
        );
        let attn = Op::Attention(AttentionParams::new(HEADS, KV_HEADS, HEAD_DIM, false));
        let a = g.op(format!("attn.{l}"), attn, &[q, k_fix, v_fix]).unwrap();
        let wo = param(&mut g, &format!("o.{l}"), &[HIDDEN, HIDDEN], 0.06);
        let o = g.op(format!("o.{l}"), lin.clone(), &[a, wo]).unwrap();
        x = g.op(format!("res1.{l}"), Op::Add, &[x, o]).unwrap();
        let w = param(&mut g, &format!("n2.{l}"), &[HIDDEN], 1.0);
        let h = g.op(format!("n2.{l}"), norm.clone(), &[x, w]).unwrap();
        let wgu = param(&mut g, &format!("gu.{l}"), &[2 * FFN, HIDDEN], 0.06);
        let gu = g.op(format!("gu.{l}"), lin.clone(), &[h, wgu]).unwrap();
        let act = Op::ActAndMul {
            act: Activation::Silu,
        };
        let a = g.op(format!("swiglu.{l}"), act, &[gu]).unwrap();
        let wd = param(&mut g, &format!("down.{l}"), &[HIDDEN, FFN], 0.04);
        let d = g.op(format!("down.{l}"), lin.clone(), &[a, wd]).unwrap();
        x = g.op(format!("res2.{l}"), Op::Add, &[x, d]).unwrap();
    }
    let w = param(&mut g, "norm", &[HIDDEN], 1.0);
    let h = g.op("norm", norm, &[x, w]).unwrap();
    let wl = param(&mut g, "lm_head", &[VOCAB, HIDDEN], 0.06);
    let logits = g.op("lm_head", lin, &[h, wl]).unwrap();
    g.output(logits).unwrap();
    for w in written {
        g.output(w).unwrap();
    }
    g
}

fn executor(backend: &Arc<dyn Backend>, graphs: bool) -> Executor {
    let plan = auto_optimize(
        &decode_graph(7),
        OptLevel::Conservative,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap();
    assert!(
        plan.kernels.iter().any(|k| k.kernel == "cuda.linear.gemv"),
        "M = 1 linears take the GEMV kernel: {:?}",
        plan.kernels.iter().map(|k| &k.kernel).collect::<Vec<_>>()
    );
    let mut exec = Executor::new(plan, backend.clone()).unwrap();
    exec.set_graphs(graphs);
    exec
}

/// The k and v caches of one executor, on the device.
struct State {
    caches: Vec<DeviceTensor>,
}

impl State {
    fn new(backend: &dyn Backend, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        Self {
            caches: (0..2 * LAYERS)
                .map(|_| {
                    let t = random(&mut rng, &[CAPACITY, KV], 1.0);
                    DeviceTensor::upload(backend, &t).unwrap()
                })
                .collect(),
        }
    }

    /// The inputs of the step at position `step` fed `ids` `[1, 1]`, with the caches.
    fn inputs(&mut self, step: usize, ids: RunTensor) -> Vec<RunTensor> {
        let mut inputs = vec![
            ids,
            RunTensor::Host(index(step, DType::I32, &[1])),
            RunTensor::Host(index(step % CAPACITY, DType::I64, &[1])),
        ];
        inputs.extend(
            std::mem::take(&mut self.caches)
                .into_iter()
                .map(RunTensor::Device),
        );
        inputs
    }

    /// One step at position `step` with token `id`; returns the logits.
    fn step(&mut self, exec: &mut Executor, step: usize, id: usize) -> Tensor {
        let inputs = self.inputs(step, RunTensor::Host(index(id, DType::I32, &[1, 1])));
        let mut keep = vec![false];
        keep.extend([true; 2 * LAYERS]);
        let addresses: Vec<_> = inputs[3..]
            .iter()
            .map(|i| match i {
                RunTensor::Device(d) => exec.backend().buffer_address(&d.buffer),
                RunTensor::Host(_) => None,
            })
            .collect();
        let mut out = exec.run_resident(inputs, &keep).unwrap().into_iter();
        let logits = out
            .next()
            .unwrap()
            .into_host(exec.backend().as_ref())
            .unwrap();
        self.caches = out
            .map(|o| match o {
                RunTensor::Device(d) => d,
                RunTensor::Host(_) => panic!("caches stay on the device"),
            })
            .collect();
        let back: Vec<_> = self
            .caches
            .iter()
            .map(|d| exec.backend().buffer_address(&d.buffer))
            .collect();
        assert_eq!(addresses, back, "the caches are written in place");
        logits
    }
}

/// A host tensor of one index.
fn index(v: usize, dt: DType, shape: &[usize]) -> Tensor {
    Tensor::from_f64(&[v as f64], shape, dt).unwrap()
}

fn token(step: usize) -> usize {
    (step * 37 + 11) % VOCAB
}

#[test]
fn captured_decode_steps_match_plain_ones_bit_for_bit() {
    let Some(backend) = backend() else { return };
    let b = backend.as_ref();
    let mut on = executor(&backend, true);
    let mut off = executor(&backend, false);
    let (mut s_on, mut s_off) = (State::new(b, 1), State::new(b, 1));
    let steps = 8;
    for step in 0..steps {
        let a = s_on.step(&mut on, step, token(step));
        let p = s_off.step(&mut off, step, token(step));
        assert_eq!(a, p, "logits of step {step}");
        assert!(a.to_f64_vec().iter().all(|x| x.is_finite()));
        assert_eq!(on.captured(), step >= 1, "step {step}");
    }
    for (c_on, c_off) in s_on.caches.iter().zip(&s_off.caches) {
        assert_eq!(c_on.download(b).unwrap(), c_off.download(b).unwrap());
    }
    assert_eq!(
        on.graph_stats(),
        GraphStats {
            captures: 1,
            replays: steps as u64 - 2,
            failures: 0
        }
    );
    assert_eq!(off.graph_stats(), GraphStats::default());

    // New cache buffers: another signature, a plain run, then a capture of its own (the
    // first signature's is kept).
    for state in [&mut s_on, &mut s_off] {
        state.caches = state
            .caches
            .iter()
            .map(|c| c.with_capacity(b, c.spec.numel()).unwrap())
            .collect();
    }
    for step in steps..steps + 4 {
        let a = s_on.step(&mut on, step, token(step));
        let p = s_off.step(&mut off, step, token(step));
        assert_eq!(a, p, "logits of step {step}");
        let captures = on.graph_stats().captures;
        assert_eq!(captures, 1 + u64::from(step > steps), "step {step}");
    }
    for (c_on, c_off) in s_on.caches.iter().zip(&s_off.caches) {
        assert_eq!(c_on.download(b).unwrap(), c_off.download(b).unwrap());
    }
    let stats = on.graph_stats();
    assert_eq!((stats.captures, stats.replays, stats.failures), (2, 8, 0));

    // An id outside the table is still an error in a replay (checked after it), and the
    // executor captures again afterwards.
    let mut caches = std::mem::take(&mut s_on.caches);
    let inputs = |caches: Vec<DeviceTensor>, id: i64| {
        let mut v = vec![
            RunTensor::Host(Tensor::from_f64(&[id as f64], &[1, 1], DType::I32).unwrap()),
            RunTensor::Host(Tensor::from_f64(&[1.0], &[1], DType::I32).unwrap()),
            RunTensor::Host(Tensor::from_f64(&[1.0], &[1], DType::I64).unwrap()),
        ];
        v.extend(caches.into_iter().map(RunTensor::Device));
        v
    };
    let keep = [false, true, true, true, true];
    for _ in 0..2 {
        let out = on.run_resident(inputs(caches, 3), &keep).unwrap();
        caches = out
            .into_iter()
            .skip(1)
            .map(|o| match o {
                RunTensor::Device(d) => d,
                RunTensor::Host(_) => panic!("caches stay on the device"),
            })
            .collect();
        assert!(on.captured());
    }
    let replays = on.graph_stats().replays;
    let err = on
        .run_resident(inputs(caches, VOCAB as i64), &keep)
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside the table"), "{err}");
    assert_eq!(
        on.graph_stats().replays,
        replays + 1,
        "the bad id was replayed"
    );
    assert!(!on.captured(), "the error dropped the capture");
}

#[test]
fn programmatic_launches_give_the_same_bits() {
    if backend().is_none() {
        return;
    }
    let cuda = Arc::new(CudaBackend::new(0, CudaOptions::default()).unwrap());
    let gpu = cuda.gpu();
    let (major, _) = gpu.properties().compute_capability;
    let jit = std::env::var("KPT_CUDA_JIT").is_ok_and(|v| v == "1");
    let disabled = std::env::var("KPT_CUDA_PDL").is_ok_and(|v| v == "0");
    assert_eq!(gpu.programmatic_launches(), major >= 9 && !disabled);
    // kpt's sm_90a cubins wait for their producer; the compute_80 PTX does not.
    let rms = gpu.function("rms_norm", "kpt_rms_norm_bf16").unwrap();
    assert_eq!(rms.waits_for_producer, major == 9 && !jit);
    let default = gpu.programmatic_launches();
    let backend: Arc<dyn Backend> = cuda.clone();
    let b = backend.as_ref();
    // Plain steps, a capture and replays, with and without programmatic launches.
    let mut logits = Vec::new();
    for programmatic in [true, false] {
        gpu.set_programmatic_launches(programmatic);
        let mut exec = executor(&backend, true);
        let mut state = State::new(b, 3);
        let steps: Vec<_> = (0..5)
            .map(|step| state.step(&mut exec, step, token(step)))
            .collect();
        assert_eq!(exec.graph_stats().replays, 3);
        let caches: Vec<_> = state
            .caches
            .iter()
            .map(|c| c.download(b).unwrap())
            .collect();
        logits.push((steps, caches));
    }
    gpu.set_programmatic_launches(default);
    assert!(
        logits[0] == logits[1],
        "programmatic launches changed the results"
    );
}

#[test]
fn profiling_runs_are_not_captured() {
    let Some(backend) = backend() else { return };
    let b = backend.as_ref();
    let mut on = executor(&backend, true);
    let mut off = executor(&backend, false);
    let (mut s_on, mut s_off) = (State::new(b, 2), State::new(b, 2));
    assert!(backend.set_profiling(true).unwrap());
    for step in 0..3 {
        let a = s_on.step(&mut on, step, token(step));
        let p = s_off.step(&mut off, step, token(step));
        assert_eq!(a, p);
        assert!(!on.captured());
    }
    assert!(!backend.profile().unwrap().is_empty());
    backend.set_profiling(false).unwrap();
    for step in 3..6 {
        let a = s_on.step(&mut on, step, token(step));
        let p = s_off.step(&mut off, step, token(step));
        assert_eq!(a, p);
    }
    assert!(on.captured());
}

/// Steps queued without waiting (`Executor::enqueue`), each fed its ids from a new device
/// buffer (staged into the capture's buffer, so they replay), with their logits read
/// through `download_async` after every step was queued: the bits of plain steps.
#[test]
fn queued_steps_fed_device_ids_match_plain_steps() {
    let Some(backend) = backend() else { return };
    let b = backend.as_ref();
    let mut queued = executor(&backend, true);
    let mut plain = executor(&backend, false);
    let (mut s_q, mut s_p) = (State::new(b, 4), State::new(b, 4));
    let steps = 6;
    let mut reads = Vec::new();
    for step in 0..steps {
        let ids = DeviceTensor::upload(b, &index(token(step), DType::I32, &[1, 1])).unwrap();
        let inputs = s_q.inputs(step, RunTensor::Device(ids));
        let mut outs = queued.enqueue(inputs, &[]).unwrap().into_iter().flatten();
        let logits = outs.next().unwrap();
        s_q.caches = outs.collect();
        // The logits' buffer is dropped at once; the read still sees this step's values.
        reads.push(b.download_async(&logits.buffer, &logits.spec).unwrap());
    }
    let got: Vec<Tensor> = reads.into_iter().map(|r| r.wait().unwrap()).collect();
    queued.finish().unwrap();
    for (step, got) in got.iter().enumerate() {
        assert_eq!(got, &s_p.step(&mut plain, step, token(step)), "step {step}");
    }
    assert_eq!(
        queued.graph_stats(),
        GraphStats {
            captures: 1,
            replays: steps as u64 - 2,
            failures: 0
        }
    );
    for (q, p) in s_q.caches.iter().zip(&s_p.caches) {
        assert_eq!(q.download(b).unwrap(), p.download(b).unwrap());
    }
}

/// A variable-length attention whose offsets are host inputs of a fixed shape: on Hopper,
/// where its kernel reads the offsets on the device, the runs after the first replay one
/// capture, and new offsets every step give the bits of plain runs (elsewhere the
/// offsets are read on the host and the runs are not captured, with the same results).
/// Invalid offsets are an error after their replay.
#[test]
fn varlen_attention_replays_with_new_offsets() {
    let Some(backend) = backend() else { return };
    let (heads, total) = (4, 300);
    let width = heads * HEAD_DIM;
    let mut g = Graph::new();
    let qkv: Vec<_> = ["q", "k", "v"]
        .iter()
        .map(|n| g.input(*n, DT, &[1, total, width]))
        .collect();
    let cu_q = g.input("cu_seqlens_q", DType::I32, &[3]);
    let cu_k = g.input("cu_seqlens_k", DType::I32, &[3]);
    let p = AttentionParams {
        varlen: true,
        ..AttentionParams::new(heads, heads, HEAD_DIM, true)
    };
    let a = g
        .op(
            "attn",
            Op::Attention(p),
            &[qkv[0], qkv[1], qkv[2], cu_q, cu_k],
        )
        .unwrap();
    g.output(a).unwrap();
    let plan = auto_optimize(
        &g,
        OptLevel::Conservative,
        &PrecisionPolicy::default(),
        &KernelRegistry::with_builtin(),
        backend.device(),
    )
    .unwrap();
    let hopper = backend.device().arch.as_deref() == Some("sm_90");
    let mut on = Executor::new(plan.clone(), backend.clone()).unwrap();
    on.set_graphs(true);
    let mut off = Executor::new(plan, backend.clone()).unwrap();
    let mut rng = SplitMix64::new(11);
    let rows: Vec<Tensor> = (0..3)
        .map(|_| random(&mut rng, &[1, total, width], 1.0))
        .collect();
    let inputs = |cu: [f64; 3]| {
        let mut v = rows.clone();
        let cu = Tensor::from_f64(&cu, &[3], DType::I32).unwrap();
        v.extend([cu.clone(), cu]);
        v
    };
    let offsets = [[0.0, 100.0, 300.0], [0.0, 250.0, 300.0], [0.0, 0.0, 300.0]];
    for (step, cu) in offsets.into_iter().cycle().take(5).enumerate() {
        let got = on.run(&inputs(cu)).unwrap();
        let want = off.run(&inputs(cu)).unwrap();
        assert_eq!(got, want, "step {step}, offsets {cu:?}");
        assert_eq!(on.captured(), hopper && step >= 1, "step {step}");
    }
    let err = on
        .run(&inputs([0.0, 350.0, 300.0]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("cu_seqlens"), "{err}");
}
