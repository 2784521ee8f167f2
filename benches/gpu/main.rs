//! `kpt-bench-cuda`: kpt's CUDA backend side by side with PyTorch on the same GPU, in
//! one run. For each case every device kernel the registry accepts is checked against
//! the f64 reference on its first rows; then repetitions alternate between kpt (the
//! registry's choice, then its other kernels) and the PyTorch variants, each timing
//! `inner` back-to-back calls between CUDA events, and the medians are compared. The
//! report (JSON, Markdown, SVG) follows docs/reports' schema.

#[path = "../compare/torch.rs"]
mod torch;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kpt_core::backend::{Backend, BufferMut, BufferRef, DeviceBuffer};
use kpt_core::graph::{Activation, Op, TensorSpec};
use kpt_core::rand::SplitMix64;
use kpt_core::tensor::Tensor;
use kpt_core::validate::{compare, reduction_len, tolerance, ReferenceOps};
use kpt_core::DType;
use kpt_kernels::{CpuReference, KernelRegistry};
use kpt_monitor::{median, Machine, Report, Row};
use kpt_nvidia::{CudaBackend, CudaOptions, Epilogue, GemmArgs, GemmShape, Layout};
use serde_json::{json, Value};

use torch::TorchWorker;

#[derive(Parser, Debug)]
#[command(about = "kpt CUDA backend vs PyTorch on the same GPU, same run")]
struct Args {
    /// Python interpreter with torch (CUDA) installed.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The PyTorch worker script.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/torch_cuda.py"))]
    script: PathBuf,
    /// Where the report goes.
    #[arg(long, default_value = "docs/reports")]
    out: PathBuf,
    /// Report name (files are NAME-latest.json etc.).
    #[arg(long, default_value = "nvidia-h100")]
    name: String,
    /// Only cases whose name contains this (or, comma-separated, any of these); a term
    /// ending in `$` must end the name.
    #[arg(long)]
    filter: Option<String>,
    /// Which cases: the backend's kernels (`core`, the nvidia-h100 report) or attention
    /// (`attention`, the attention-h100 report).
    #[arg(long, value_enum, default_value = "core")]
    suite: Suite,
    /// Timed repetitions per side.
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// Most blocks of the Hopper attention kernel's persistent grid (default: the SM
    /// count; a number at least the tile count gives every call a block per tile).
    #[arg(long)]
    attention_blocks: Option<usize>,
    /// Time only the kernel the registry picks, not every other device kernel it accepts
    /// (those are still checked against the reference).
    #[arg(long)]
    chosen_only: bool,
    /// The command recorded in the report.
    #[arg(long, default_value = "cargo xtask gpu-bundle (run.sh)")]
    command: String,
    /// Time only these of torch's SDPA backends (comma-separated; default all three), e.g.
    /// `cudnn` for quicker A/B runs of kpt's kernels: attention ratios are then to the
    /// backends timed, and targets named after another backend are left out.
    #[arg(long, value_delimiter = ',', value_parser = ["flash", "cudnn", "efficient"])]
    sdpa: Vec<String>,
}

/// The case lists `kpt-bench-cuda` can run.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Suite {
    Core,
    Attention,
}

/// Rows whose output is checked against the f64 reference.
const CHECK_ROWS: usize = 2;
/// The device kernels of `Op::Linear` timed on every linear case.
const LINEAR_KERNELS: [&str; 2] = ["cuda.linear.gemv", "cuda.linear.cublaslt"];
/// Bytes of the device-to-device copy whose bandwidth the bandwidth targets are
/// fractions of (large enough to stream from memory, not L2).
const COPY_BYTES: usize = 1 << 30;

/// What kpt runs for a case.
enum Work {
    /// A graph op through `Backend::execute` with the registry's kernel.
    Op(Op),
    /// FP8 e4m3 x e4m3 -> bf16 linear-layout GEMM through cuBLASLt, unit scales.
    Fp8Gemm,
    /// SwiGLU: `silu(x[:, :d]) * x[:, d:]`.
    SwiGlu,
}

struct Case {
    name: String,
    metric: &'static str,
    /// FLOPs or bytes moved per call.
    work: f64,
    kpt: Work,
    inputs: Vec<Tensor>,
    torch: Value,
    target: Target,
    note: &'static str,
}

/// A case's target (at most one).
enum Target {
    None,
    /// This ratio to the fastest torch variant.
    Ratio(f64),
    /// This absolute rate.
    Value(f64),
    /// This fraction of the device's copy bandwidth, measured in the run.
    OfCopy(f64),
    /// This factor times kpt's rate on the named case of the same run.
    VsCase(String, f64),
    /// This factor times the rate of the named torch variant in the same run, where the
    /// issue's target names one that is not the fastest.
    VsVariant(&'static str, f64),
}

fn random(rng: &mut SplitMix64, shape: &[usize], dtype: DType, lo: f32, hi: f32) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = rng.vec(n, lo, hi).into_iter().map(f64::from).collect();
    Tensor::from_f64(&v, shape, dtype).expect("shape matches")
}

/// Inputs of a bf16 attention backward case `[b, h, s, d]`: q, k, v, out and dout, then
/// with `lse` a placeholder log-sum-exp (kpt's forward writes both out and lse on the
/// device before timing).
fn backward_inputs(rng: &mut SplitMix64, [b, h, s, d]: [usize; 4], lse: bool) -> Vec<Tensor> {
    let mut inputs: Vec<Tensor> = (0..5)
        .map(|_| random(rng, &[b, s, h * d], DType::BF16, -2.0, 2.0))
        .collect();
    if lse {
        inputs.push(
            Tensor::from_f64(&vec![0.0; b * h * s], &[b, h, s], DType::F32).expect("shape matches"),
        );
    }
    inputs
}

/// The FlashAttention issue's cases: prefill (bf16, full and causal, against the best of
/// torch's SDPA backends), its backward (bf16, head dim 128, against the backward of each
/// SDPA backend) and decode against long KV caches (one query per sequence, 32 query
/// heads over 8 kv heads, head dim 128, against copy bandwidth).
fn attention_cases() -> Vec<Case> {
    let mut rng = SplitMix64::new(0x6b71);
    let params = |heads, kv_heads, head_dim, causal| {
        Op::Attention(kpt_core::graph::AttentionParams::new(
            heads, kv_heads, head_dim, causal,
        ))
    };
    let mut out = Vec::new();
    for (b, h, s, d) in [
        (8usize, 16usize, 2048usize, 128usize),
        (1, 16, 16384, 128),
        (16, 16, 1024, 64),
    ] {
        for causal in [false, true] {
            let full = 4.0 * (b * h * s * s * d) as f64;
            let kind = if causal { "causal" } else { "full" };
            out.push(Case {
                name: format!("attention_prefill_bf16_b{b}_h{h}_s{s}_d{d}_{kind}"),
                metric: "TFLOP/s",
                work: if causal { full / 2.0 } else { full },
                kpt: Work::Op(params(h, h, d, causal)),
                inputs: (0..3)
                    .map(|_| random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0))
                    .collect(),
                torch: json!({"kind": "attention_prefill", "batch": b, "heads": h,
                              "head_dim": d, "seq": s, "causal": causal, "dtype": "bf16"}),
                target: Target::Ratio(1.0),
                note: "FLOPs = 4 b h s² d (half when causal)",
            });
        }
    }
    // Dropout (training) on the first shape: what applying it costs, against torch's SDPA
    // backends with the same `dropout_p` (their own random decisions). No target.
    let (b, h, s, d, p) = (8usize, 16usize, 2048usize, 128usize, 0.1f32);
    for causal in [false, true] {
        let full = 4.0 * (b * h * s * s * d) as f64;
        let kind = if causal { "causal" } else { "full" };
        out.push(Case {
            name: format!("attention_prefill_bf16_b{b}_h{h}_s{s}_d{d}_{kind}_dropout"),
            metric: "TFLOP/s",
            work: if causal { full / 2.0 } else { full },
            kpt: Work::Op(Op::Attention(kpt_core::graph::AttentionParams {
                dropout: Some(kpt_core::graph::AttentionDropout { p, seed: 7 }),
                ..kpt_core::graph::AttentionParams::new(h, h, d, causal)
            })),
            inputs: (0..3)
                .map(|_| random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0))
                .collect(),
            torch: json!({"kind": "attention_prefill", "batch": b, "heads": h,
                          "head_dim": d, "seq": s, "causal": causal, "dtype": "bf16",
                          "dropout": p}),
            target: Target::None,
            note: "dropout p = 0.1 (Philox decisions, checked against the reference's); \
                   torch with dropout_p = 0.1",
        });
    }
    // The attention of the 1.1B LLaMA-shaped model's prefill (models-* reports): grouped
    // query heads, head dim 64, one sequence. Tracked without a target of its own.
    let (b, h, hkv, s, d) = (1usize, 32usize, 4usize, 2048usize, 64usize);
    out.push(Case {
        name: format!("attention_prefill_bf16_b{b}_h{h}kv{hkv}_s{s}_d{d}_causal"),
        metric: "TFLOP/s",
        work: 2.0 * (b * h * s * s * d) as f64,
        kpt: Work::Op(params(h, hkv, d, true)),
        inputs: vec![
            random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0),
            random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
            random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
        ],
        torch: json!({"kind": "attention_prefill", "batch": b, "heads": h, "kv_heads": hkv,
                      "head_dim": d, "seq": s, "causal": true, "dtype": "bf16"}),
        target: Target::None,
        note: "FLOPs = 4 b h s² d / 2; the 1.1B model's prefill attention, no target",
    });
    // A sliding window of 4096 keys (Mistral's heads: 32 query heads, 8 kv heads, head
    // dim 128) over 8192 causal keys. Tracked without a target.
    let (b, h, hkv, s, d, w) = (2usize, 32usize, 8usize, 8192usize, 128usize, 4096usize);
    let pairs = w * (w + 1) / 2 + (s - w) * w; // visible (query, key) pairs of a head
    out.push(Case {
        name: format!("attention_prefill_bf16_b{b}_h{h}kv{hkv}_s{s}_d{d}_causal_window{w}"),
        metric: "TFLOP/s",
        work: 4.0 * (b * h * pairs * d) as f64,
        kpt: Work::Op(Op::Attention(kpt_core::graph::AttentionParams {
            window: Some(w),
            ..kpt_core::graph::AttentionParams::new(h, hkv, d, true)
        })),
        inputs: vec![
            random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0),
            random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
            random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
        ],
        torch: json!({"kind": "attention_prefill", "batch": b, "heads": h, "kv_heads": hkv,
                      "head_dim": d, "seq": s, "causal": true, "window": w, "dtype": "bf16"}),
        target: Target::None,
        note: "FLOPs = 4 b h d x the visible (query, key) pairs; torch: SDPA with a boolean \
               window mask, FlexAttention with a sliding-window block mask",
    });
    // Variable-length batches (sequences packed into one call with cu_seqlens, as
    // FlashAttention's and vLLM's varlen calls take them): an LLM prefill of 16 prompts
    // (causal, head dim 128) and an encoder batch of 64 short sequences (BERT-base heads,
    // full). torch: SDPA on nested (jagged) tensors, FlexAttention with a document mask.
    // Tracked without a target. They run last (drawn here, so the other rows keep their
    // inputs): torch's compiled FlexAttention forwards of them before the windowed backward
    // row make its compiled backward refuse the repeated calls it is timed with.
    let mut varlen = Vec::new();
    for (tag, n, (lo, hi), h, d, causal) in [
        ("prefill", 16usize, (64f32, 2048.0), 16usize, 128usize, true),
        ("encoder", 64, (32.0, 384.0), 12, 64, false),
    ] {
        let lens: Vec<usize> = rng.vec(n, lo, hi).into_iter().map(|l| l as usize).collect();
        let total: usize = lens.iter().sum();
        let pairs: usize = lens.iter().map(|l| l * l).sum();
        let cu: Vec<f64> = std::iter::once(0.0)
            .chain(lens.iter().scan(0.0, |t, &l| {
                *t += l as f64;
                Some(*t)
            }))
            .collect();
        let offsets = Tensor::from_f64(&cu, &[n + 1], DType::I32).expect("shape matches");
        let kind = if causal { "causal" } else { "full" };
        varlen.push(Case {
            name: format!("attention_varlen_{tag}_bf16_n{n}_t{total}_h{h}_d{d}_{kind}"),
            metric: "TFLOP/s",
            work: 4.0 * (h * pairs * d) as f64 / if causal { 2.0 } else { 1.0 },
            kpt: Work::Op(Op::Attention(kpt_core::graph::AttentionParams {
                varlen: true,
                ..kpt_core::graph::AttentionParams::new(h, h, d, causal)
            })),
            inputs: vec![
                random(&mut rng, &[1, total, h * d], DType::BF16, -2.0, 2.0),
                random(&mut rng, &[1, total, h * d], DType::BF16, -2.0, 2.0),
                random(&mut rng, &[1, total, h * d], DType::BF16, -2.0, 2.0),
                offsets.clone(),
                offsets,
            ],
            torch: json!({"kind": "attention_varlen", "lens": lens, "heads": h,
                          "head_dim": d, "causal": causal, "dtype": "bf16"}),
            target: Target::None,
            note: "FLOPs = 4 h d x the sum of squared lengths (half when causal); torch: SDPA \
                   on nested (jagged) tensors, FlexAttention with a document mask",
        });
    }
    // Head dim 256 (Gemma-style heads): the mma.sync kernel with Q in shared memory.
    // Tracked without a target.
    let (b, h, s, d) = (4usize, 8usize, 2048usize, 256usize);
    for causal in [false, true] {
        let kind = if causal { "causal" } else { "full" };
        let work = 4.0 * (b * h * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
        out.push(Case {
            name: format!("attention_prefill_bf16_b{b}_h{h}_s{s}_d{d}_{kind}"),
            metric: "TFLOP/s",
            work,
            kpt: Work::Op(params(h, h, d, causal)),
            inputs: vec![
                random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0),
                random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0),
                random(&mut rng, &[b, s, h * d], DType::BF16, -2.0, 2.0),
            ],
            torch: json!({"kind": "attention_prefill", "batch": b, "heads": h,
                          "head_dim": d, "seq": s, "causal": causal, "dtype": "bf16"}),
            target: Target::None,
            note: "FLOPs = 4 b h s² d (halved when causal); head dim 256, no target",
        });
    }
    // FP8 e4m3 against kpt's own bf16 kernel on the same shape (and both against torch's
    // bf16 SDPA backends; torch has no FP8 attention).
    let (b, h, s, d) = (4usize, 16usize, 4096usize, 128usize);
    for causal in [false, true] {
        let full = 4.0 * (b * h * s * s * d) as f64;
        let kind = if causal { "causal" } else { "full" };
        let bf16_name = format!("attention_prefill_bf16_b{b}_h{h}_s{s}_d{d}_{kind}");
        let torch = json!({"kind": "attention_prefill", "batch": b, "heads": h,
                           "head_dim": d, "seq": s, "causal": causal, "dtype": "bf16"});
        for dt in [DType::BF16, DType::F8E4M3] {
            let fp8 = dt == DType::F8E4M3;
            out.push(Case {
                name: if fp8 {
                    format!("attention_prefill_fp8_e4m3_b{b}_h{h}_s{s}_d{d}_{kind}")
                } else {
                    bf16_name.clone()
                },
                metric: "TFLOP/s",
                work: if causal { full / 2.0 } else { full },
                kpt: Work::Op(params(h, h, d, causal)),
                inputs: (0..3)
                    .map(|_| random(&mut rng, &[b, s, h * d], dt, -2.0, 2.0))
                    .collect(),
                torch: torch.clone(),
                target: if fp8 {
                    Target::VsCase(bf16_name.clone(), 1.3)
                } else {
                    Target::None
                },
                note: if fp8 {
                    "e4m3 q, k, v with per-tensor scales, bf16 output; torch runs bf16"
                } else {
                    "FLOPs = 4 b h s² d (half when causal)"
                },
            });
        }
    }
    // Gradients (q, k, v, the forward output and its gradient in; dq, dk, dv out). The
    // main rows give kpt's backward the forward's log-sum-exp, as torch's backward gets
    // the one its forward saved: `out` and `lse` are written by kpt's forward on the
    // device before timing (the uploaded `out` and `lse` are placeholders), and only the
    // backward is timed. The `_no_lse` rows time the backward without it (the kernel
    // recomputes the softmax statistics), for comparison.
    let (b, h, s, d) = (8usize, 16usize, 2048usize, 128usize);
    for causal in [false, true] {
        for lse in [true, false] {
            let full = 2.5 * 4.0 * (b * h * s * s * d) as f64;
            let kind = if causal { "causal" } else { "full" };
            let suffix = if lse { "" } else { "_no_lse" };
            let inputs = backward_inputs(&mut rng, [b, h, s, d], lse);
            out.push(Case {
                name: format!("attention_backward_bf16_b{b}_h{h}_s{s}_d{d}_{kind}{suffix}"),
                metric: "TFLOP/s",
                work: if causal { full / 2.0 } else { full },
                kpt: Work::Op(Op::AttentionBackward(kpt_core::graph::AttentionParams {
                    lse,
                    ..kpt_core::graph::AttentionParams::new(h, h, d, causal)
                })),
                inputs,
                torch: json!({"kind": "attention_backward", "batch": b, "heads": h,
                              "head_dim": d, "seq": s, "causal": causal, "dtype": "bf16"}),
                // The backward target is torch's flash backend (the rows still
                // show the fastest backend, cuDNN, as their baseline).
                target: if lse {
                    Target::VsVariant("SDPA flash", 1.0)
                } else {
                    Target::None
                },
                note: if lse {
                    "FLOPs = 2.5 x the forward's (half when causal); out and lse from kpt's \
                     forward (not timed), as torch's backward gets its saved out and LSE; dq \
                     checked"
                } else {
                    "FLOPs = 2.5 x the forward's (half when causal); no log-sum-exp given \
                     (recomputed in the dq pass); dq checked"
                },
            });
        }
    }
    // The backward with dropout (p = 0.1; out and lse from kpt's forward with the same
    // dropout), against torch's backward of SDPA with the same `dropout_p`. No target.
    let p = 0.1f32;
    for causal in [false, true] {
        let full = 2.5 * 4.0 * (b * h * s * s * d) as f64;
        let kind = if causal { "causal" } else { "full" };
        let inputs = backward_inputs(&mut rng, [b, h, s, d], true);
        out.push(Case {
            name: format!("attention_backward_bf16_b{b}_h{h}_s{s}_d{d}_{kind}_dropout"),
            metric: "TFLOP/s",
            work: if causal { full / 2.0 } else { full },
            kpt: Work::Op(Op::AttentionBackward(kpt_core::graph::AttentionParams {
                lse: true,
                dropout: Some(kpt_core::graph::AttentionDropout { p, seed: 7 }),
                ..kpt_core::graph::AttentionParams::new(h, h, d, causal)
            })),
            inputs,
            torch: json!({"kind": "attention_backward", "batch": b, "heads": h,
                          "head_dim": d, "seq": s, "causal": causal, "dtype": "bf16",
                          "dropout": p}),
            target: Target::None,
            note: "dropout p = 0.1 (dq checked against the reference's decisions); out and \
                   lse from kpt's forward with the same dropout; torch's backward of SDPA with \
                   dropout_p = 0.1",
        });
    }
    // The backward under a sliding window of 4096 keys over 8192 causal keys (16 heads,
    // head dim 128). Tracked without a target.
    let (b, h, s, d, w) = (2usize, 16usize, 8192usize, 128usize, 4096usize);
    let pairs = w * (w + 1) / 2 + (s - w) * w; // visible (query, key) pairs of a head
    out.push(Case {
        name: format!("attention_backward_bf16_b{b}_h{h}_s{s}_d{d}_causal_window{w}"),
        metric: "TFLOP/s",
        work: 2.5 * 4.0 * (b * h * pairs * d) as f64,
        kpt: Work::Op(Op::AttentionBackward(kpt_core::graph::AttentionParams {
            lse: true,
            window: Some(w),
            ..kpt_core::graph::AttentionParams::new(h, h, d, true)
        })),
        inputs: backward_inputs(&mut rng, [b, h, s, d], true),
        torch: json!({"kind": "attention_backward", "batch": b, "heads": h, "head_dim": d,
                      "seq": s, "causal": true, "window": w, "dtype": "bf16"}),
        target: Target::None,
        note: "FLOPs = 2.5 x the forward's over the visible pairs; out and lse from kpt's \
               forward; torch: the backward of SDPA with a boolean window mask and of \
               FlexAttention with a sliding-window block mask",
    });
    // The backward at head dim 256 (a block per half of the head dim), causal, tracked
    // without a target against torch's backends.
    let (b, h, s, d) = (4usize, 8usize, 2048usize, 256usize);
    out.push(Case {
        name: format!("attention_backward_bf16_b{b}_h{h}_s{s}_d{d}_causal"),
        metric: "TFLOP/s",
        work: 2.5 * 4.0 * (b * h * s * s * d) as f64 / 2.0,
        kpt: Work::Op(Op::AttentionBackward(kpt_core::graph::AttentionParams {
            lse: true,
            ..kpt_core::graph::AttentionParams::new(h, h, d, true)
        })),
        inputs: backward_inputs(&mut rng, [b, h, s, d], true),
        torch: json!({"kind": "attention_backward", "batch": b, "heads": h, "head_dim": d,
                      "seq": s, "causal": true, "dtype": "bf16"}),
        target: Target::None,
        note: "FLOPs = 2.5 x the forward's (half when causal); out and lse from kpt's \
               forward (not timed); head dim 256: each block accumulates half of the head \
               dim's columns and recomputes S and dP",
    });
    // The decode attention of the 1.1B LLaMA-shaped model (models-* reports) at one and
    // 32 sequences over 512 keys: tracked without a target of its own.
    for b in [1usize, 32] {
        let (hq, hkv, d, s) = (32usize, 4usize, 64usize, 512usize);
        out.push(Case {
            name: format!("attention_decode_bf16_b{b}_h{hq}kv{hkv}_d{d}_kv{s}"),
            metric: "TB/s",
            work: (2 * b * s * hkv * d * 2) as f64,
            kpt: Work::Op(params(hq, hkv, d, false)),
            inputs: vec![
                random(&mut rng, &[b, 1, hq * d], DType::BF16, -2.0, 2.0),
                random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
                random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
            ],
            torch: json!({"kind": "attention_decode", "batch": b, "heads": hq,
                          "kv_heads": hkv, "head_dim": d, "seq_kv": s, "dtype": "bf16"}),
            target: Target::None,
            note: "bytes = K and V read once; split-KV kernel",
        });
    }
    let (b, hq, hkv, d) = (8usize, 32usize, 8usize, 128usize);
    for s in [8192usize, 32768] {
        let inputs = vec![
            random(&mut rng, &[b, 1, hq * d], DType::BF16, -2.0, 2.0),
            random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
            random(&mut rng, &[b, s, hkv * d], DType::BF16, -2.0, 2.0),
        ];
        let kv = (inputs[1].clone(), inputs[2].clone());
        let torch = json!({"kind": "attention_decode", "batch": b, "heads": hq,
                           "kv_heads": hkv, "head_dim": d, "seq_kv": s, "dtype": "bf16"});
        // The same sizes over a paged cache (vLLM's layout): blocks of 16 rows, the
        // sequences' blocks scattered over the cache by a seeded shuffle, the block table
        // and lengths read on the device. The dense K and V, cut into blocks, are the
        // cache.
        let block = 16usize;
        let (per_seq, blocks) = (s / block, b * s / block);
        let mut ids: Vec<usize> = (0..blocks).collect();
        for i in (1..blocks).rev() {
            ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let table: Vec<f64> = ids.iter().map(|&i| i as f64).collect();
        let cache = |t: &Tensor| t.reshape(&[blocks, block, hkv * d]).expect("same elements");
        let order: Vec<f64> = (0..blocks).map(|i| i as f64).collect();
        let table_of =
            |ids: &[f64]| Tensor::from_f64(ids, &[b, per_seq], DType::I32).expect("shape matches");
        let paged_inputs = vec![
            inputs[0].clone(),
            cache(&inputs[1]),
            cache(&inputs[2]),
            table_of(&table),
            Tensor::from_f64(&vec![s as f64; b], &[b], DType::I32).expect("shape matches"),
        ];
        let paged = Op::Attention(kpt_core::graph::AttentionParams {
            paged: true,
            ..kpt_core::graph::AttentionParams::new(hq, hkv, d, false)
        });
        out.push(Case {
            name: format!("attention_decode_bf16_b{b}_h{hq}kv{hkv}_d{d}_kv{s}"),
            metric: "TB/s",
            work: (2 * b * s * hkv * d * 2) as f64,
            kpt: Work::Op(params(hq, hkv, d, false)),
            inputs,
            torch: torch.clone(),
            target: Target::OfCopy(0.8),
            note: "bytes = K and V read once; split-KV kernel",
        });
        if s == 8192 {
            // 16 queries a sequence (a speculative-decoding draft verified at once): 64
            // query rows a kv group, the split-KV kernel's wide entries.
            let sq = 16usize;
            out.push(Case {
                name: format!("attention_decode_q{sq}_bf16_b{b}_h{hq}kv{hkv}_d{d}_kv{s}"),
                metric: "TB/s",
                work: (2 * b * s * hkv * d * 2) as f64,
                kpt: Work::Op(params(hq, hkv, d, false)),
                inputs: vec![
                    random(&mut rng, &[b, sq, hq * d], DType::BF16, -2.0, 2.0),
                    kv.0.clone(),
                    kv.1.clone(),
                ],
                torch: json!({"kind": "attention_decode", "batch": b, "heads": hq,
                              "kv_heads": hkv, "head_dim": d, "seq_kv": s, "seq_q": sq,
                              "dtype": "bf16"}),
                target: Target::None,
                note: "bytes = K and V read once; 16 queries a sequence (no mask), split-KV \
                       kernel's wide entries (64 query rows a kv group)",
            });
            // The same cache with every sequence's blocks in order (the dense layout read
            // through the table): what the table costs apart from the scattering.
            let mut ordered = paged_inputs.clone();
            ordered[3] = table_of(&order);
            out.push(Case {
                name: format!(
                    "attention_decode_paged_ordered_bf16_b{b}_h{hq}kv{hkv}_d{d}_kv{s}_block{block}"
                ),
                metric: "TB/s",
                work: (2 * b * s * hkv * d * 2) as f64,
                kpt: Work::Op(paged.clone()),
                inputs: ordered,
                torch: torch.clone(),
                target: Target::None,
                note: "bytes = K and V read once; paged cache, blocks of 16 in order (each \
                       sequence's blocks contiguous, as in the dense cache), split-KV kernel \
                       reading the block table and lengths on the device",
            });
        }
        out.push(Case {
            name: format!("attention_decode_paged_bf16_b{b}_h{hq}kv{hkv}_d{d}_kv{s}_block{block}"),
            metric: "TB/s",
            work: (2 * b * s * hkv * d * 2) as f64,
            kpt: Work::Op(paged),
            inputs: paged_inputs,
            torch,
            target: Target::OfCopy(0.8),
            note: "bytes = K and V read once; paged cache, blocks of 16 scattered, split-KV \
                   kernel reading the block table and lengths on the device (no host \
                   readback); torch: dense SDPA of the same sizes (it has no paged attention)",
        });
    }
    out.extend(varlen);
    out
}

/// bf16 residual add + RMSNorm of `rows x dim`.
fn add_rms_norm_case(rng: &mut SplitMix64, rows: usize, dim: usize, target: Target) -> Case {
    let bf = DType::BF16;
    Case {
        name: format!("add_rms_norm_bf16_{rows}x{dim}"),
        metric: "TB/s",
        work: (4 * rows * dim * 2) as f64,
        kpt: Work::Op(Op::AddRmsNorm { eps: 1e-5 }),
        inputs: vec![
            random(rng, &[rows, dim], bf, -2.0, 2.0),
            random(rng, &[rows, dim], bf, -2.0, 2.0),
            random(rng, &[dim], bf, 0.5, 1.5),
        ],
        torch: json!({"kind": "add_rms_norm", "rows": rows, "dim": dim, "dtype": "bf16"}),
        target,
        note: "bytes = read x, residual + write sum, out",
    }
}

/// bf16 SwiGLU of `rows x 2d` into `rows x d`.
fn swiglu_case(rng: &mut SplitMix64, rows: usize, d: usize, target: Target) -> Case {
    Case {
        name: format!("swiglu_bf16_{rows}x{d}"),
        metric: "TB/s",
        work: (rows * 3 * d * 2) as f64,
        kpt: Work::SwiGlu,
        inputs: vec![random(rng, &[rows, 2 * d], DType::BF16, -3.0, 3.0)],
        torch: json!({"kind": "swiglu", "rows": rows, "d": d, "dtype": "bf16"}),
        target,
        note: "",
    }
}

fn cases() -> Vec<Case> {
    let mut rng = SplitMix64::new(0x6b70);
    let bf = DType::BF16;
    let mut out = Vec::new();
    for n in [4096usize, 8192] {
        out.push(Case {
            name: format!("gemm_bf16_{n}"),
            metric: "TFLOP/s",
            work: 2.0 * (n * n * n) as f64,
            kpt: Work::Op(Op::MatMul),
            inputs: vec![
                random(&mut rng, &[n, n], bf, -1.0, 1.0),
                random(&mut rng, &[n, n], bf, -1.0, 1.0),
            ],
            torch: json!({"kind": "gemm", "m": n, "k": n, "n": n, "dtype": "bf16"}),
            target: Target::Ratio(1.03),
            note: "cuBLASLt, autotuned algorithm",
        });
    }
    let (m, k, n) = (16384usize, 4096usize, 4096usize);
    out.push(Case {
        name: "linear_gelu_bf16_16384x4096x4096".into(),
        metric: "TFLOP/s",
        work: 2.0 * (m * k * n) as f64,
        kpt: Work::Op(Op::LinearAct {
            bias: true,
            act: Activation::GeluTanh,
        }),
        inputs: vec![
            random(&mut rng, &[m, k], bf, -1.0, 1.0),
            random(&mut rng, &[n, k], bf, -0.02, 0.02),
            random(&mut rng, &[n], bf, -1.0, 1.0),
        ],
        torch: json!({"kind": "linear_gelu", "m": m, "k": k, "n": n, "dtype": "bf16"}),
        target: Target::Ratio(1.1),
        note: "bias + GELU(tanh) in the cuBLASLt epilogue",
    });
    for n in [4096usize, 8192] {
        out.push(Case {
            name: format!("gemm_fp8_e4m3_{n}"),
            metric: "TFLOP/s",
            work: 2.0 * (n * n * n) as f64,
            kpt: Work::Fp8Gemm,
            inputs: vec![
                random(&mut rng, &[n, n], DType::F8E4M3, -1.0, 1.0),
                random(&mut rng, &[n, n], DType::F8E4M3, -1.0, 1.0),
            ],
            torch: json!({"kind": "fp8_gemm", "m": n, "k": n, "n": n}),
            target: Target::Ratio(1.0),
            note: "e4m3 x e4m3 -> bf16, per-tensor scales, no fast accumulation (torch's default)",
        });
    }
    // Decode-sized linears of the 1.1B LLaMA: merged q/k/v, gate/up, down and lm_head,
    // bound by reading the weights once; one token (M = 1), and 2 to 32 sequences
    // decoded together (torch.compile only at M = 1: it calls the same GEMM).
    for m in [1usize, 2, 4, 8, 16, 32] {
        for (k, n) in [
            (2048usize, 2560usize),
            (2048, 11264),
            (5632, 2048),
            (2048, 32000),
        ] {
            out.push(Case {
                name: format!("linear_bf16_m{m}_{k}x{n}"),
                metric: "TB/s",
                work: ((n * k + m * k + m * n) * 2) as f64,
                kpt: Work::Op(Op::Linear { bias: false }),
                inputs: vec![
                    random(&mut rng, &[m, k], bf, -1.0, 1.0),
                    random(&mut rng, &[n, k], bf, -0.05, 0.05),
                ],
                torch: json!({"kind": "linear", "m": m, "k": k, "n": n, "dtype": "bf16",
                              "compile": m == 1}),
                target: Target::Value(2.5),
                note: "bytes = read weights, x + write out; cuda.linear.gemv and \
                       cuda.linear.cublaslt both timed",
            });
        }
    }
    // Prefill-sized linears of the 1.1B LLaMA at B1 S2048 (2048 rows): merged q/k/v,
    // gate/up, down and the LM head whose rows a last-token prefill skips.
    for (k, n) in [
        (2048usize, 2560usize),
        (2048, 11264),
        (5632, 2048),
        (2048, 32000),
    ] {
        let m = 2048usize;
        out.push(Case {
            name: format!("linear_bf16_m{m}_{k}x{n}"),
            metric: "TFLOP/s",
            work: 2.0 * (m * k * n) as f64,
            kpt: Work::Op(Op::Linear { bias: false }),
            inputs: vec![
                random(&mut rng, &[m, k], bf, -1.0, 1.0),
                random(&mut rng, &[n, k], bf, -0.05, 0.05),
            ],
            torch: json!({"kind": "linear", "m": m, "k": k, "n": n, "dtype": "bf16",
                          "compile": false}),
            target: Target::None,
            note: "the 1.1B model's prefill linears (models-* reports), no target",
        });
    }
    // f32 runs the GEMV's CUDA-core loop at every row count (no tensor cores): against
    // cuBLASLt.
    let (k, n) = (2048usize, 2560usize);
    for m in [8usize, 16, 32] {
        out.push(Case {
            name: format!("linear_f32_m{m}_{k}x{n}"),
            metric: "TB/s",
            work: ((n * k + m * k + m * n) * 4) as f64,
            kpt: Work::Op(Op::Linear { bias: false }),
            inputs: vec![
                random(&mut rng, &[m, k], DType::F32, -1.0, 1.0),
                random(&mut rng, &[n, k], DType::F32, -0.05, 0.05),
            ],
            torch: json!({"kind": "linear", "m": m, "k": k, "n": n, "dtype": "f32",
                      "compile": false}),
            target: Target::None,
            note: "bytes = read weights, x + write out; no target: the f32 GEMV against \
               cuBLASLt (no TF32)",
        });
    }
    let (rows, dim) = (32768usize, 4096usize);
    let bytes = (rows * dim * 2) as f64;
    out.push(Case {
        name: "rms_norm_bf16_32768x4096".into(),
        metric: "TB/s",
        work: 2.0 * bytes,
        kpt: Work::Op(Op::RmsNorm { eps: 1e-5 }),
        inputs: vec![
            random(&mut rng, &[rows, dim], bf, -2.0, 2.0),
            random(&mut rng, &[dim], bf, 0.5, 1.5),
        ],
        torch: json!({"kind": "rms_norm", "rows": rows, "dim": dim, "dtype": "bf16"}),
        target: Target::Value(2.8),
        note: "bytes = read x + write out",
    });
    out.push(add_rms_norm_case(&mut rng, rows, dim, Target::Ratio(1.2)));
    out.push(Case {
        name: "softmax_bf16_32768x4096".into(),
        metric: "TB/s",
        work: 2.0 * bytes,
        kpt: Work::Op(Op::Softmax),
        inputs: vec![random(&mut rng, &[rows, dim], bf, -4.0, 4.0)],
        torch: json!({"kind": "softmax", "rows": rows, "dim": dim, "dtype": "bf16"}),
        target: Target::OfCopy(0.85),
        note: "",
    });
    let (b, s, h, d) = (4usize, 4096usize, 32usize, 128usize);
    let positions: Vec<f64> = (0..s).map(|p| p as f64).collect();
    out.push(Case {
        name: "rotary_bf16_4x4096x32x128".into(),
        metric: "TB/s",
        work: 2.0 * (b * s * h * d * 2) as f64,
        kpt: Work::Op(Op::Rotary {
            head_dim: d,
            theta: 10_000.0,
            scaling: None,
        }),
        inputs: vec![
            random(&mut rng, &[b, s, h * d], bf, -2.0, 2.0),
            Tensor::from_f64(&positions, &[s], DType::I64).expect("shape matches"),
        ],
        torch: json!({"kind": "rotary", "batch": b, "seq": s, "heads": h, "head_dim": d, "dtype": "bf16"}),
        target: Target::OfCopy(0.85),
        note: "torch uses a precomputed cos/sin table; kpt computes it per row",
    });
    out.push(swiglu_case(&mut rng, 16384, 11008, Target::OfCopy(0.85)));
    // The memory-bound ops of the 1.1B LLaMA's prefill at B1 S2048 (2048 tokens, hidden
    // 2048, 32 query / 4 kv heads of 64, intermediate 5632), where a call moves 8-70 MB.
    let (tokens, hidden, ffn) = (2048usize, 2048usize, 5632usize);
    out.push(add_rms_norm_case(
        &mut rng,
        tokens,
        hidden,
        Target::Ratio(1.0),
    ));
    out.push(swiglu_case(&mut rng, tokens, ffn, Target::Ratio(1.0)));
    let (heads, kv_heads, d) = (32usize, 4usize, 64usize);
    let sizes = vec![heads * d, kv_heads * d, kv_heads * d];
    let width: usize = sizes.iter().sum();
    let positions: Vec<f64> = (0..tokens).map(|p| p as f64).collect();
    out.push(Case {
        name: format!("split_rotary_bf16_{tokens}x{width}_d{d}"),
        metric: "TB/s",
        work: (2 * tokens * width * 2) as f64,
        kpt: Work::Op(Op::SplitRotary {
            head_dim: d,
            theta: 10_000.0,
            scaling: None,
            sizes,
            cache: false,
        }),
        inputs: vec![
            random(&mut rng, &[tokens, width], bf, -2.0, 2.0),
            Tensor::from_f64(&positions, &[tokens], DType::I32).expect("shape matches"),
        ],
        torch: json!({"kind": "split_rotary", "tokens": tokens, "heads": heads,
                      "kv_heads": kv_heads, "head_dim": d, "dtype": "bf16"}),
        target: Target::Ratio(1.0),
        note: "bytes = read q/k/v + write q, k, v; torch: split, rotary of q and k from a \
               precomputed cos/sin table, v made contiguous",
    });
    let n = 16384 * 4096;
    out.push(Case {
        name: "quantize_bf16_to_e4m3_67M".into(),
        metric: "TB/s",
        work: (n * 3) as f64,
        kpt: Work::Op(Op::Quantize {
            dtype: DType::F8E4M3,
            scale: 10.0 / 448.0,
        }),
        inputs: vec![random(&mut rng, &[n], bf, -10.0, 10.0)],
        torch: json!({"kind": "quantize", "n": n, "dtype": "bf16"}),
        target: Target::OfCopy(0.85),
        note: "static per-tensor scale",
    });
    out
}

/// A case's buffers on the device and the call that runs it.
struct Prepared<'a> {
    backend: &'a CudaBackend,
    /// The registry's kernel, for graph ops.
    kernel: Option<String>,
    /// The other device kernels the registry accepts for the op, in its order.
    alternatives: Vec<String>,
    inputs: Vec<(DeviceBuffer, TensorSpec)>,
    outputs: Vec<(DeviceBuffer, TensorSpec)>,
    scales: Option<(kpt_nvidia::DeviceBlock, kpt_nvidia::DeviceBlock)>,
}

impl Prepared<'_> {
    fn call(&mut self, work: &Work) -> Result<()> {
        let refs: Vec<_> = self
            .inputs
            .iter()
            .map(|(buffer, spec)| BufferRef { buffer, spec })
            .collect();
        let mut muts: Vec<_> = self
            .outputs
            .iter_mut()
            .map(|(buffer, spec)| BufferMut { buffer, spec })
            .collect();
        match work {
            Work::Op(op) => {
                let kernel = self.kernel.as_deref().context("no kernel selected")?;
                self.backend.execute(kernel, op, &refs, &mut muts)?
            }
            Work::SwiGlu => {
                let out = muts.pop().context("output")?;
                self.backend.act_and_mul(refs[0], out, Activation::Silu)?
            }
            Work::Fp8Gemm => {
                let (x, w) = (refs[0].spec, refs[1].spec);
                let shape = GemmShape {
                    m: x.shape[0],
                    n: w.shape[0],
                    k: x.shape[1],
                    batch: 1,
                    layout: Layout::Linear,
                    a: DType::F8E4M3,
                    b: DType::F8E4M3,
                    out: DType::BF16,
                    bias: false,
                    epilogue: Epilogue::None,
                };
                let ptr = |b: &DeviceBuffer| {
                    b.inner::<kpt_nvidia::DeviceBlock>()
                        .map(|b| b.ptr())
                        .context("a CUDA buffer")
                };
                let (sa, sb) = self.scales.as_ref().context("scales")?;
                let args = GemmArgs {
                    a: ptr(refs[0].buffer)?,
                    b: ptr(refs[1].buffer)?,
                    out: ptr(muts[0].buffer)?,
                    bias: 0,
                    a_scale: sa.ptr(),
                    b_scale: sb.ptr(),
                };
                let blas = self.backend.blas().context("cuBLASLt")?;
                blas.gemm(self.backend.gpu(), &shape, &args)?;
            }
        }
        Ok(())
    }
}

fn prepare<'a>(backend: &'a CudaBackend, case: &Case) -> Result<Prepared<'a>> {
    let specs: Vec<TensorSpec> = case
        .inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let (kernels, out_specs) = match &case.kpt {
        Work::Op(op) => {
            let registry = KernelRegistry::with_builtin();
            let chain = registry.fallback_chain(op, &specs, backend.device());
            let mut device: Vec<String> = chain.into_iter().take_while(|k| on_device(k)).collect();
            if device.is_empty() {
                bail!("{}: the registry chose no device kernel", case.name);
            }
            // Both linear kernels are timed, also where the registry's row limit leaves
            // one out, so that the report shows the GEMV / cuBLASLt crossover.
            if matches!(op, Op::Linear { .. }) {
                for k in LINEAR_KERNELS {
                    if !device.iter().any(|d| d == k) {
                        device.push(k.to_string());
                    }
                }
            }
            (device, op.infer(&specs)?)
        }
        Work::SwiGlu => {
            let s = &specs[0].shape;
            (
                Vec::new(),
                vec![TensorSpec::new(&[s[0], s[1] / 2], specs[0].dtype)],
            )
        }
        Work::Fp8Gemm => (
            Vec::new(),
            vec![TensorSpec::new(
                &[specs[0].shape[0], specs[1].shape[0]],
                DType::BF16,
            )],
        ),
    };
    let inputs = case
        .inputs
        .iter()
        .zip(specs)
        .map(|(t, s)| Ok((backend.upload(t)?, s)))
        .collect::<Result<Vec<_>>>()?;
    let mut inputs = inputs;
    if let Work::Op(Op::AttentionBackward(ap)) = &case.kpt {
        if ap.lse {
            forward_for_backward(backend, ap, &mut inputs)?;
        }
    }
    let outputs = out_specs
        .into_iter()
        .map(|s| Ok((backend.allocate(s.dtype, s.numel())?, s)))
        .collect::<Result<Vec<_>>>()?;
    let scales = match case.kpt {
        Work::Fp8Gemm => Some((
            backend
                .gpu()
                .upload(&case.inputs[0].scale().to_le_bytes())?,
            backend
                .gpu()
                .upload(&case.inputs[1].scale().to_le_bytes())?,
        )),
        _ => None,
    };
    Ok(Prepared {
        backend,
        kernel: kernels.first().cloned(),
        alternatives: kernels.into_iter().skip(1).collect(),
        inputs,
        outputs,
        scales,
    })
}

/// Runs kpt's forward attention (the registry's device kernel) on the uploaded q, k, v
/// (and mask) of a backward case, writing its output and log-sum-exp into the case's
/// `out` and `lse` inputs, so that the backward gets what a training step would hand it.
fn forward_for_backward(
    backend: &CudaBackend,
    ap: &kpt_core::graph::AttentionParams,
    inputs: &mut [(DeviceBuffer, TensorSpec)],
) -> Result<()> {
    let op = Op::Attention(*ap);
    let (qkv, rest) = inputs.split_at_mut(3);
    let (out_dout, tail) = rest.split_at_mut(2);
    let (mask, lse) = tail.split_at_mut(tail.len().saturating_sub(1));
    let mut refs: Vec<_> = qkv
        .iter()
        .map(|(buffer, spec)| BufferRef { buffer, spec })
        .collect();
    refs.extend(mask.iter().map(|(buffer, spec)| BufferRef { buffer, spec }));
    let specs: Vec<TensorSpec> = refs.iter().map(|r| r.spec.clone()).collect();
    let kernel = KernelRegistry::with_builtin()
        .fallback_chain(&op, &specs, backend.device())
        .into_iter()
        .find(|k| on_device(k))
        .context("no device kernel gives the attention log-sum-exp")?;
    let (out, lse) = (&mut out_dout[0], lse.first_mut().context("lse input")?);
    let mut muts = [
        BufferMut {
            buffer: &mut out.0,
            spec: &out.1,
        },
        BufferMut {
            buffer: &mut lse.0,
            spec: &lse.1,
        },
    ];
    backend.execute(&kernel, &op, &refs, &mut muts)?;
    Ok(())
}

/// Whether a kernel runs on the GPU (rather than on host copies).
fn on_device(kernel: &str) -> bool {
    kernel.starts_with("cuda.") || kernel.starts_with("triton.")
}

/// The first rows of a row-major tensor.
fn head(t: &Tensor, rows: usize) -> Result<Tensor> {
    Ok(t.narrow(0, 0, rows.min(t.shape()[0]))?.contiguous())
}

/// The last [`CHECK_ROWS`] queries of the first sequence of an attention tensor
/// `[batch, seq, width]`: with the whole cache they keep their causal visibility
/// (bottom-right aligned), so their reference costs a few rows, not `seq`.
fn last_queries(t: &Tensor) -> Result<Tensor> {
    let s = t.shape()[1];
    let r = CHECK_ROWS.min(s);
    Ok(t.narrow(0, 0, 1)?.narrow(1, s - r, r)?.contiguous())
}

/// Largest error of kpt's first output rows against the f64 reference, and whether it
/// is within the op's tolerance.
fn check(case: &Case, p: &Prepared<'_>) -> Result<(f64, bool)> {
    let first = |t: &Tensor| head(t, CHECK_ROWS);
    let (op, inputs): (Op, Vec<Tensor>) = match &case.kpt {
        Work::Op(op @ (Op::MatMul | Op::Linear { .. } | Op::LinearAct { .. })) => {
            let mut v = vec![first(&case.inputs[0])?];
            v.extend(case.inputs[1..].iter().cloned());
            (op.clone(), v)
        }
        Work::Op(
            op @ (Op::RmsNorm { .. } | Op::Softmax | Op::Quantize { .. } | Op::Rotary { .. }),
        ) => {
            let mut v = vec![first(&case.inputs[0])?];
            v.extend(case.inputs[1..].iter().cloned());
            (op.clone(), v)
        }
        Work::Op(op @ Op::SplitRotary { .. }) => (
            op.clone(),
            vec![first(&case.inputs[0])?, first(&case.inputs[1])?],
        ),
        Work::Op(op @ Op::AddRmsNorm { .. }) => (
            op.clone(),
            vec![
                first(&case.inputs[0])?,
                first(&case.inputs[1])?,
                case.inputs[2].clone(),
            ],
        ),
        // Paged: the first sequence's rows gathered through its row of the block table,
        // then dense attention.
        Work::Op(Op::Attention(ap)) if ap.paged => {
            let (kc, vc) = (&case.inputs[1], &case.inputs[2]);
            let (block, row) = (kc.shape()[1], kc.shape()[2]);
            let table = case.inputs[3].to_f64_vec();
            let len = case.inputs[4].to_f64_vec()[0] as usize;
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for &id in &table[..len.div_ceil(block)] {
                k.extend(kc.narrow(0, id as usize, 1)?.to_f64_vec());
                v.extend(vc.narrow(0, id as usize, 1)?.to_f64_vec());
            }
            k.truncate(len * row);
            v.truncate(len * row);
            let f64_tensor = |x: &[f64], shape: &[usize]| Tensor::from_f64(x, shape, DType::F64);
            let q = last_queries(&case.inputs[0])?;
            (
                Op::Attention(kpt_core::graph::AttentionParams {
                    paged: false,
                    ..*ap
                }),
                vec![
                    f64_tensor(&q.to_f64_vec(), q.shape())?,
                    f64_tensor(&k, &[1, len, row])?,
                    f64_tensor(&v, &[1, len, row])?,
                ],
            )
        }
        // Variable-length: the last sequence's last queries against its keys, as a dense
        // call.
        Work::Op(Op::Attention(ap)) if ap.varlen => {
            let cu_k = case.inputs[4].to_f64_vec();
            let start = cu_k[cu_k.len() - 2] as usize;
            let keys = |t: &Tensor| -> Result<Tensor> {
                Ok(t.narrow(1, start, t.shape()[1] - start)?.contiguous())
            };
            (
                Op::Attention(kpt_core::graph::AttentionParams {
                    varlen: false,
                    ..*ap
                }),
                vec![
                    last_queries(&case.inputs[0])?,
                    keys(&case.inputs[1])?,
                    keys(&case.inputs[2])?,
                ],
            )
        }
        Work::Op(op @ Op::Attention(_)) => (
            op.clone(),
            vec![
                last_queries(&case.inputs[0])?,
                head(&case.inputs[1], 1)?,
                head(&case.inputs[2], 1)?,
            ],
        ),
        // The last queries' dq needs only their rows of q, out and dout (their dk and dv
        // contributions are partial sums, so only dq is compared). With the log-sum-exp,
        // `out` and `lse` are the forward's, read back from the device.
        Work::Op(op @ Op::AttentionBackward(ap)) => {
            let mut v = vec![
                last_queries(&case.inputs[0])?,
                head(&case.inputs[1], 1)?,
                head(&case.inputs[2], 1)?,
                last_queries(&case.inputs[3])?,
                last_queries(&case.inputs[4])?,
            ];
            if ap.lse {
                let (out, out_spec) = &p.inputs[3];
                v[3] = last_queries(&p.backend.download(out, out_spec)?)?;
                let (lse, lse_spec) = p.inputs.last().context("lse input")?;
                let lse = p.backend.download(lse, lse_spec)?;
                let s = lse.shape()[2];
                let r = CHECK_ROWS.min(s);
                v.push(lse.narrow(0, 0, 1)?.narrow(2, s - r, r)?.contiguous());
            }
            (op.clone(), v)
        }
        Work::Op(op) => bail!("no accuracy check for {op}"),
        Work::SwiGlu => {
            let x = first(&case.inputs[0])?.to_f64_vec();
            let d = case.inputs[0].shape()[1] / 2;
            let rows = x.len() / (2 * d);
            let gate: Vec<f64> = (0..rows * d).map(|i| x[i / d * 2 * d + i % d]).collect();
            let up: Vec<f64> = (0..rows * d)
                .map(|i| x[i / d * 2 * d + d + i % d])
                .collect();
            (
                Op::Mul,
                vec![
                    CpuReference
                        .eval(
                            &Op::Activation {
                                act: Activation::Silu,
                            },
                            &[Tensor::from_f64(&gate, &[rows, d], DType::F64)?],
                        )?
                        .remove(0),
                    Tensor::from_f64(&up, &[rows, d], DType::F64)?,
                ],
            )
        }
        Work::Fp8Gemm => {
            let x = first(&case.inputs[0])?;
            let w = case.inputs[1].transpose(0, 1)?.contiguous();
            (Op::MatMul, vec![x, w])
        }
    };
    let seq = case.inputs[0].shape()[1];
    let want = match &op {
        Op::Attention(ap) if ap.dropout.is_some() => vec![dropout_reference(ap, &inputs, seq)?],
        Op::AttentionBackward(ap) if ap.dropout.is_some() => {
            vec![dropout_backward_reference(ap, &inputs, seq)?]
        }
        _ => CpuReference.eval(&op, &inputs)?,
    };
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    let k = reduction_len(&op, &specs);
    let mut worst = (0f64, true);
    let compared = if matches!(op, Op::AttentionBackward(_)) {
        1
    } else {
        want.len()
    };
    for ((buffer, full), w) in p.outputs.iter().zip(&want).take(compared) {
        let got = if matches!(op, Op::Attention(_) | Op::AttentionBackward(_)) {
            last_queries(&p.backend.download(buffer, full)?)?
        } else {
            p.backend
                .download(buffer, &TensorSpec::new(w.shape(), full.dtype))?
        };
        let stats = compare(&got, w, tolerance(&op, full.dtype, k))?;
        worst = (worst.0.max(stats.max_abs), worst.1 && stats.within);
    }
    Ok(worst)
}

/// The shape of the last queries of a call with dropout (`inputs` as [`check`] slices
/// them, from a call of `seq` queries): a shorter call whose queries take the decisions of
/// their positions in the whole call.
fn dropout_shape(
    ap: &kpt_core::graph::AttentionParams,
    inputs: &[Tensor],
    seq: usize,
) -> kpt_kernels::cpu::AttentionShape {
    use kpt_kernels::cpu::{AttentionShape, ShapeDropout};
    let (q, k) = (inputs[0].shape(), inputs[1].shape());
    AttentionShape {
        scale: f64::from(ap.effective_scale()),
        dropout: ap.dropout.map(|mask| ShapeDropout {
            mask,
            first_batch: 0,
            first_query: seq - q[1],
        }),
        ..AttentionShape::new(
            1,
            q[1],
            k[1],
            ap.num_heads,
            ap.num_kv_heads,
            ap.head_dim,
            ap.causal,
        )
    }
}

/// The reference output of the last queries of a forward call with dropout.
fn dropout_reference(
    ap: &kpt_core::graph::AttentionParams,
    inputs: &[Tensor],
    seq: usize,
) -> Result<Tensor> {
    let shape = dropout_shape(ap, inputs, seq);
    let [q, k, v] = [0, 1, 2].map(|i| inputs[i].to_f64_vec());
    let mut out = vec![0.0; shape.q_len()];
    kpt_kernels::cpu::reference::attention(&q, &k, &v, None, &mut out, &shape)?;
    Ok(Tensor::from_f64(&out, inputs[0].shape(), DType::F64)?)
}

/// The reference dq of the last queries of a backward call with dropout and the forward's
/// log-sum-exp (`inputs`: q, k, v, out, dout, lse as [`check`] slices them).
fn dropout_backward_reference(
    ap: &kpt_core::graph::AttentionParams,
    inputs: &[Tensor],
    seq: usize,
) -> Result<Tensor> {
    let shape = dropout_shape(ap, inputs, seq);
    let [q, k, v, out, dout, lse] = [0, 1, 2, 3, 4, 5].map(|i| inputs[i].to_f64_vec());
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    kpt_kernels::cpu::reference::attention_backward(
        (&q, &k, &v, None),
        (&out, &dout, Some(&lse)),
        (&mut dq, &mut dk, &mut dv),
        &shape,
    )?;
    Ok(Tensor::from_f64(&dq, inputs[0].shape(), DType::F64)?)
}

/// Back-to-back calls per timed repetition: enough for about 5 ms.
fn inner_calls(seconds_per_call: f64) -> usize {
    ((5e-3 / seconds_per_call.max(1e-7)).ceil() as usize).clamp(1, 1000)
}

fn main() -> Result<()> {
    let args = Args::parse();
    // Kernels are timed by name: the GEMV kernel on every row class it has.
    let options = CudaOptions {
        gemv_rows: 32,
        ..CudaOptions::default()
    };
    let backend = CudaBackend::new(0, options).context("opening CUDA device 0")?;
    backend.gpu().set_attention_blocks(args.attention_blocks);
    let mut worker = TorchWorker::start(
        &args.python,
        &args.script,
        1,
        &[("KPT_SDPA_BACKENDS", args.sdpa.join(","))],
    )?;
    let info = worker.info.clone();
    let text = |k: &str| info[k].as_str().unwrap_or("unknown").to_string();
    let mut versions = std::collections::BTreeMap::new();
    for k in ["torch", "cuda", "triton"] {
        versions.insert(k.to_string(), text(k));
    }
    versions.insert("kpt".into(), env!("CARGO_PKG_VERSION").into());
    let machine = Machine {
        device: backend.device().name.clone(),
        driver: Some(text("driver")),
        cpu: kpt_core::hardware::cpu_info().model_name,
        versions,
    };
    let git = std::env::var("KPT_GIT_COMMIT").unwrap_or_else(|_| "unknown".into());
    let mut report = Report::new(&args.name, &args.command, git, machine);
    let all = match args.suite {
        Suite::Core => cases(),
        Suite::Attention => attention_cases(),
    };
    let cases: Vec<Case> = all
        .into_iter()
        .filter(|c| kpt_benches::filter_matches(args.filter.as_deref(), &c.name))
        .collect();
    let copy_tbps = if cases.iter().any(|c| matches!(c.target, Target::OfCopy(_))) {
        copy_bandwidth(&backend)?
    } else {
        f64::NAN
    };
    let bar = ProgressBar::new(cases.len() as u64).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    for case in &cases {
        bar.set_message(case.name.clone());
        let row = run_case(&backend, &mut worker, case, &args, copy_tbps).unwrap_or_else(|e| {
            Row::not_run(&case.name, case.metric, true, "torch", format!("{e:#}"))
        });
        println!(
            "{:<36} kpt {:>9.1} {}  {} {:>9.1}  ratio {:.3}",
            row.name,
            row.kpt.unwrap_or(f64::NAN),
            row.metric,
            row.baseline_name,
            row.baseline.unwrap_or(f64::NAN),
            row.ratio.unwrap_or(f64::NAN)
        );
        report.rows.push(row);
        bar.inc(1);
    }
    bar.finish_and_clear();
    // Targets relative to another case of this run (FP8 vs kpt's bf16 kernel).
    for case in &cases {
        let Target::VsCase(other, factor) = &case.target else {
            continue;
        };
        let base = report
            .rows
            .iter()
            .find(|r| r.name == *other)
            .and_then(|r| r.kpt);
        if let (Some(base), Some(row)) =
            (base, report.rows.iter_mut().find(|r| r.name == case.name))
        {
            let target = factor * base;
            *row = row
                .clone()
                .with_target(target)
                .with_note(format!("target {factor}x kpt's {other} ({base:.1})"));
        }
    }
    for path in report.write(&args.out)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn run_case(
    backend: &CudaBackend,
    worker: &mut TorchWorker,
    case: &Case,
    args: &Args,
    copy_tbps: f64,
) -> Result<Row> {
    let reps = args.reps;
    let mut p = prepare(backend, case)?;
    // Every device kernel the registry accepts (its choice first), each checked first.
    let kernels: Vec<Option<String>> = std::iter::once(p.kernel.clone())
        .chain(std::mem::take(&mut p.alternatives).into_iter().map(Some))
        .collect();
    let mut checks = Vec::with_capacity(kernels.len());
    for kernel in &kernels {
        p.kernel = kernel.clone();
        p.call(&case.kpt)?;
        checks.push(check(case, &p)?);
    }
    p.kernel = kernels[0].clone();
    let (kernels, checks) = if args.chosen_only {
        (kernels[..1].to_vec(), checks[..1].to_vec())
    } else {
        (kernels, checks)
    };
    let inner = inner_calls(timed(&mut p, case, 3)?);
    let mut request = case.torch.clone();
    request["inner"] = json!(inner);
    request["reps"] = json!(1);
    // Repetitions interleave kpt and torch, so that clock and temperature drift during
    // the case weigh on both sides alike.
    let mut kpt_times = vec![Vec::with_capacity(reps); kernels.len()];
    let mut variants: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for _ in 0..reps {
        for (kernel, times) in kernels.iter().zip(&mut kpt_times) {
            p.kernel = kernel.clone();
            times.push(timed(&mut p, case, inner)?);
        }
        for (name, t) in worker.time(&request)? {
            variants.entry(name).or_default().extend(t);
        }
    }
    drop(p);
    backend.gpu().memory().empty_cache()?;
    // TFLOP/s from FLOPs, TB/s from bytes: both are work / seconds / 1e12.
    let rate = |t: &[f64]| median(t).map_or(f64::NAN, |t| case.work / t / 1e12);
    let kpt_rate = rate(&kpt_times[0]);
    let (err, within) = checks[0];
    let chosen = kernels[0].clone();
    let alternatives: Vec<String> = kernels[1..]
        .iter()
        .zip(&kpt_times[1..])
        .zip(&checks[1..])
        .map(|((k, t), (_, ok))| {
            let failed = if *ok { "" } else { " (ACCURACY CHECK FAILED)" };
            format!("kpt {} {:.3}{failed}", k.as_deref().unwrap_or("?"), rate(t))
        })
        .collect();
    let (best_name, best) = variants
        .iter()
        .map(|(n, t)| (n.clone(), rate(t)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .context("torch returned no variant")?;
    let others: Vec<String> = variants
        .iter()
        .filter(|(n, _)| **n != best_name)
        .map(|(n, t)| format!("{n} {:.1}", rate(t)))
        .collect();
    let mut row = Row::compared(&case.name, case.metric, true, kpt_rate, best, &best_name)
        .with_max_abs_err(err)
        .with_note(case.note)
        .with_note(chosen.map_or(String::new(), |k| format!("kernel {k}")))
        .with_note(if alternatives.is_empty() {
            String::new()
        } else {
            format!("other kernels: {}", alternatives.join(", "))
        })
        .with_note(if others.is_empty() {
            String::new()
        } else {
            format!("also {}", others.join(", "))
        });
    match case.target {
        Target::Ratio(r) => row = row.with_target_ratio(r),
        Target::Value(t) => row = row.with_target(t),
        Target::VsVariant(name, f) => match variants.get(name) {
            Some(t) => {
                row = row
                    .with_target(f * rate(t))
                    .with_note(format!("target {f}x {name} in this run"));
            }
            None if !args.sdpa.is_empty() => {
                row = row.with_note(format!("no target: {name} not timed (--sdpa)"));
            }
            None => bail!("torch returned no {name} timing for {}", case.name),
        },
        Target::OfCopy(f) => {
            row = row.with_target(f * copy_tbps).with_note(format!(
                "target {f} x the copy bandwidth measured in this run ({copy_tbps:.2} TB/s, \
                 bytes read + written)"
            ));
        }
        // Set once every case has run (see `main`).
        Target::VsCase(..) | Target::None => {}
    }
    if !within {
        row.met = false;
        row = row.with_note("ACCURACY CHECK FAILED on the first rows");
    }
    Ok(row)
}

/// Device-to-device copy bandwidth in TB/s (bytes read + written), the median of 9
/// timings of 10 back-to-back copies of [`COPY_BYTES`].
fn copy_bandwidth(backend: &CudaBackend) -> Result<f64> {
    let gpu = backend.gpu();
    let (src, dst) = (gpu.alloc_zeroed(COPY_BYTES)?, gpu.alloc(COPY_BYTES)?);
    let copy = || gpu.copy(src.ptr(), dst.ptr(), COPY_BYTES);
    copy()?;
    let times = (0..9)
        .map(|_| gpu.time_per_call(10, copy))
        .collect::<Result<Vec<_>, _>>()?;
    let t = median(&times).context("no copy timing")?;
    Ok(2.0 * COPY_BYTES as f64 / t / 1e12)
}

/// Seconds per call of the prepared work, over `calls` back-to-back calls.
fn timed(p: &mut Prepared<'_>, case: &Case, calls: usize) -> Result<f64> {
    let gpu = p.backend.gpu();
    Ok(gpu.time_per_call(calls, || {
        p.call(&case.kpt)
            .map_err(|e| kpt_nvidia::NvidiaError::Invalid(format!("{e:#}")))
    })?)
}
