//! The built-in kernels: every kernel kpt ships, declared for the registry.
//!
//! The CPU chain for every op ends in [`CPU_REFERENCE`], the f64 reference, so a
//! graph always has a (slow) kernel on the CPU whatever its dtypes.

use kpt_core::graph::OpKind;
use kpt_core::hardware::DeviceKind;
use kpt_core::DType;

use crate::registry::{KernelDef, KernelRegistry, ShapeLimits};

/// Name of the f64 reference kernel, the last fallback of every op on the CPU.
pub const CPU_REFERENCE: &str = "cpu.reference";

const F32: &[DType] = &[DType::F32];
const FLOATS: &[DType] = &[DType::F64, DType::F32, DType::F16, DType::BF16];
const LINEAR_WEIGHTS: &[DType] = &[
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F8E4M3,
    DType::F8E5M2,
    DType::I8,
];
const QUANTIZED: &[DType] = &[DType::F8E4M3, DType::F8E5M2, DType::I8];

/// The fast CPU kernels.
pub fn cpu_kernels() -> Vec<KernelDef> {
    use OpKind::*;
    let cpu = DeviceKind::Cpu;
    let k = |name: &str, op: OpKind, dtypes: &[DType], desc: &str| {
        KernelDef::new(name, op, cpu, dtypes, 100, desc)
    };
    vec![
        k("cpu.embedding", Embedding, F32, "row gather"),
        k(
            "cpu.matmul.gemm",
            MatMul,
            &[DType::F32, DType::BF16, DType::F16],
            "blocked SIMD GEMM (gemm crate), f32 accumulation",
        ),
        k(
            "cpu.linear.fused",
            Linear,
            F32,
            "GEMV for few rows, GEMM on dequantized weight tiles otherwise; bias fused",
        )
        .weights(LINEAR_WEIGHTS),
        k(
            "cpu.linear_act.fused",
            LinearAct,
            F32,
            "linear with bias and activation applied while the output tile is hot",
        )
        .weights(LINEAR_WEIGHTS),
        k(
            "cpu.activation",
            Activation,
            F32,
            "vectorized element-wise activation",
        ),
        k(
            "cpu.rms_norm",
            RmsNorm,
            F32,
            "one pass per row, rows in parallel",
        ),
        k(
            "cpu.layer_norm",
            LayerNorm,
            F32,
            "two passes per row, rows in parallel",
        ),
        k(
            "cpu.add_rms_norm",
            AddRmsNorm,
            F32,
            "residual add and RMS norm in one pass over the row",
        ),
        k(
            "cpu.add_layer_norm",
            AddLayerNorm,
            F32,
            "residual add and layer norm in one pass over the row",
        ),
        k(
            "cpu.rotary",
            Rotary,
            F32,
            "NeoX rotary with a per-call cos/sin table",
        ),
        k(
            "cpu.split_rotary",
            SplitRotary,
            F32,
            "q/k/v split and NeoX rotary of q and k with one cos/sin table",
        ),
        k(
            "cpu.softmax",
            Softmax,
            F32,
            "stable softmax, rows in parallel",
        ),
        k(
            "cpu.argmax",
            ArgMax,
            F32,
            "16-lane row maximum, then its first index",
        ),
        k(
            "cpu.attention.flash",
            Attention,
            F32,
            "blocked online-softmax attention; never builds the full score matrix; \
             variable-length batches and paged caches one sequence at a time; the \
             log-sum-exp by a second pass over the scores; dropout on the probabilities",
        )
        .limits(ANY_ATTENTION_DROPOUT),
        k(
            "cpu.attention_backward",
            AttentionBackward,
            F32,
            "dq, dk, dv with recomputed probabilities (from the forward's log-sum-exp when \
             given) and dropout decisions; (batch, kv head) tasks in parallel; \
             variable-length batches one sequence at a time",
        )
        .limits(ANY_ATTENTION_BACKWARD_VARLEN_DROPOUT),
        k("cpu.add", Add, F32, "broadcasting add"),
        k("cpu.mul", Mul, F32, "broadcasting multiply"),
        k(
            "cpu.quantize",
            Quantize,
            F32,
            "saturating round-to-nearest-even FP8/int8 quantization",
        )
        .weights(QUANTIZED),
        k(
            "cpu.dequantize",
            Dequantize,
            F32,
            "FP8/int8 to f32 with the tensor's scale",
        ),
        k(
            "cpu.cast",
            Cast,
            &[DType::F32, DType::BF16, DType::F16],
            "SIMD f32 <-> bf16/f16 conversion",
        ),
        k("cpu.concat", Concat, COPY_DTYPES, "block copies"),
        k("cpu.split", Split, COPY_DTYPES, "block copies"),
        k(
            "cpu.cache_write",
            CacheWrite,
            FLOATS,
            "row copies into the cache, in place when the executor owns it",
        ),
        k(
            "cpu.act_and_mul",
            ActAndMul,
            F32,
            "SIMD gated activation (SwiGLU/GeGLU), rows in parallel",
        ),
    ]
}

/// The NVIDIA kernels whose sources are also compiled for AMD GPUs: the kernel, an
/// embedded artifact that holds it (every specialization of a source is built for the same
/// processors) and how it was built.
const AMD_SHARED: &[(&str, &str, &str)] = &[
    ("cuda.rms_norm", "rms_norm", HIPCC_RMS),
    ("cuda.add_rms_norm", "rms_norm", HIPCC_RMS),
    (
        "cuda.layer_norm",
        "layer_norm",
        "kernels/cuda/layer_norm.cu built by hipcc",
    ),
    (
        "cuda.add_layer_norm",
        "layer_norm",
        "kernels/cuda/layer_norm.cu built by hipcc",
    ),
    (
        "cuda.softmax",
        "softmax",
        "kernels/cuda/softmax.cu built by hipcc",
    ),
    (
        "cuda.argmax",
        "softmax",
        "kernels/cuda/softmax.cu built by hipcc",
    ),
    (
        "cuda.rotary",
        "rotary",
        "kernels/cuda/rotary.cu built by hipcc",
    ),
    (
        "cuda.split_rotary",
        "rotary",
        "kernels/cuda/rotary.cu built by hipcc",
    ),
    ("cuda.activation", "elementwise", HIPCC_ELEMENTWISE),
    ("cuda.act_and_mul", "elementwise", HIPCC_ELEMENTWISE),
    ("cuda.add", "elementwise", HIPCC_ELEMENTWISE),
    ("cuda.mul", "elementwise", HIPCC_ELEMENTWISE),
    ("cuda.cast", "elementwise", HIPCC_ELEMENTWISE),
    (
        "cuda.embedding",
        "embedding",
        "kernels/cuda/embedding.cu built by hipcc",
    ),
    (
        "cuda.attention",
        "attention",
        "kernels/cuda/attention.cu built by hipcc",
    ),
    ("cuda.quantize", "quantize", HIPCC_QUANTIZE),
    ("cuda.dequantize", "quantize", HIPCC_QUANTIZE),
    ("triton.rms_norm", "triton_rms_norm_f32_1024", TRITON_RMS),
    (
        "triton.add_rms_norm",
        "triton_add_rms_norm_f32_1024",
        TRITON_RMS,
    ),
];
const HIPCC_RMS: &str = "kernels/cuda/rms_norm.cu built by hipcc";
const HIPCC_ELEMENTWISE: &str = "kernels/cuda/elementwise.cu built by hipcc";
const HIPCC_QUANTIZE: &str = "kernels/cuda/quantize.cu built by hipcc";
const TRITON_RMS: &str = "kernels/triton/rms_norm.py built by Triton";

/// The AMD kernels: each of `AMD_SHARED`'s kernels for the ROCm backend (`cuda.x` as
/// `amd.x`, `triton.x` as `amd.triton.x`), with the NVIDIA kernel's dtypes and limits,
/// restricted to the processors its embedded code objects were built for
/// (`artifacts::hsaco_targets`), so that a device of another processor passes over it.
pub fn amd_kernels() -> Vec<KernelDef> {
    cuda_kernels()
        .into_iter()
        .filter_map(|def| {
            let &(_, artifact, how) = AMD_SHARED.iter().find(|(name, _, _)| *name == def.name)?;
            let targets = crate::artifacts::hsaco_targets(artifact);
            if targets.is_empty() {
                return None;
            }
            let name = match def.name.strip_prefix("cuda.") {
                Some(rest) => format!("amd.{rest}"),
                None => format!("amd.{}", def.name),
            };
            let description = format!("{} ({how} for AMD)", def.description);
            let mut amd = KernelDef {
                name,
                backend: DeviceKind::Rocm,
                min_arch: None,
                description,
                ..def
            }
            .targets(&targets);
            if amd.op == OpKind::Attention {
                // What the CUDA backend adds around the kernel (FP8 inputs dequantized,
                // variable-length batches one sequence per launch, paged caches gathered)
                // has no ROCm counterpart yet: the kernel alone, on dense batches.
                amd.dtypes.retain(|d| *d != DType::F8E4M3);
                amd.limits.varlen = false;
                amd.limits.paged = false;
            }
            Some(amd)
        })
        .chain(amd_device_kernels())
        .collect()
}

/// The AMD kernels that launch no code object of kpt's: rocBLAS GEMMs (on every
/// processor where the backend loaded rocBLAS, its `rocblas` feature) and device copies.
fn amd_device_kernels() -> Vec<KernelDef> {
    use OpKind::*;
    const AMD_FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];
    const COPY: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64];
    let k = |name: &str, op: OpKind, dtypes: &[DType], desc: &str| {
        KernelDef::new(name, op, DeviceKind::Rocm, dtypes, 100, desc)
    };
    let gemm = |name: &str, op: OpKind, desc: &str| {
        k(name, op, AMD_FLOATS, desc)
            .needs(&["rocblas"])
            .weights(LINEAR_WEIGHTS)
    };
    vec![
        gemm(
            "amd.matmul.rocblas",
            MatMul,
            "rocBLAS gemm_ex / gemm_strided_batched_ex, f32 compute",
        )
        .weights(AMD_FLOATS),
        gemm(
            "amd.linear.rocblas",
            Linear,
            "rocBLAS gemm_ex, f32 compute; the bias as a rank-1 update (a second GEMM); \
             weights of another dtype converted (FP8 and int8 dequantized) by amd.cast / \
             amd.dequantize where the processor has them, else on the host",
        ),
        k(
            "amd.linear.hipblaslt_fp8",
            Linear,
            AMD_FLOATS,
            "hipBLASLt FP8 GEMM on MI300's matrix cores (FNUZ e4m3, f32 compute): \
             activations quantized on the device with their amax scale, both operands \
             converted from OCP to FNUZ (a kernel hiprtc builds), bias in the epilogue",
        )
        .with_priority(110)
        .weights(&[DType::F8E4M3])
        .targets(&["gfx940", "gfx941", "gfx942"])
        .needs(&["hipblaslt_fp8"]),
        gemm(
            "amd.linear_act.rocblas",
            LinearAct,
            "amd.linear.rocblas, then amd.activation (on the host where the processor \
             has no elementwise code object)",
        ),
        k(
            "amd.concat",
            Concat,
            COPY,
            "one strided 2D device copy per input (hipMemcpy2DAsync)",
        ),
        k(
            "amd.split",
            Split,
            COPY,
            "one strided 2D device copy per output (hipMemcpy2DAsync)",
        ),
        k(
            "amd.cache_write",
            CacheWrite,
            AMD_FLOATS,
            "slots read on the host, one device copy per written row, in place when the \
             executor owns the cache",
        ),
    ]
}

/// The CUDA kernels: cuBLASLt GEMMs and kpt's own kernels (`kernels/cuda/`), all
/// built for sm_80 and newer.
pub fn cuda_kernels() -> Vec<KernelDef> {
    use OpKind::*;
    const CUDA_FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];
    let k = |name: &str, op: OpKind, dtypes: &[DType], desc: &str| {
        KernelDef::new(name, op, DeviceKind::Cuda, dtypes, 100, desc).min_arch("sm_80")
    };
    let gemm = |name: &str, op: OpKind, desc: &str| {
        k(name, op, CUDA_FLOATS, desc)
            .needs(&["cublaslt"])
            .weights(LINEAR_WEIGHTS)
    };
    vec![
        gemm(
            "cuda.matmul.cublaslt",
            MatMul,
            "cuBLASLt GEMM, autotuned algorithm per shape; TF32 only if allowed",
        )
        .weights(CUDA_FLOATS),
        gemm(
            "cuda.linear.cublaslt",
            Linear,
            "cuBLASLt GEMM with the bias fused in the epilogue",
        ),
        k(
            "cuda.linear.gemv",
            Linear,
            CUDA_FLOATS,
            "bandwidth-bound GEMV for decode: two warps per weight row (bf16/f16 at 5-32 \
             rows: tensor-core tiles of 16 weight rows), 16-byte streaming loads, f32 \
             accumulation, bias fused; weights of another dtype go to cuBLASLt",
        )
        .weights(CUDA_FLOATS)
        .with_priority(GEMV_PRIORITY)
        .limits(ShapeLimits {
            max_rows: Some(GEMV_MAX_ROWS),
            ..ShapeLimits::default()
        }),
        gemm(
            "cuda.linear_act.cublaslt",
            LinearAct,
            "cuBLASLt GEMM, bias and ReLU/GELU(tanh) fused in the epilogue",
        ),
        k(
            "cuda.rms_norm",
            RmsNorm,
            CUDA_FLOATS,
            "one block per row, row held in registers",
        ),
        k(
            "cuda.add_rms_norm",
            AddRmsNorm,
            CUDA_FLOATS,
            "residual add and RMS norm in one pass, row in registers",
        ),
        k(
            "cuda.layer_norm",
            LayerNorm,
            CUDA_FLOATS,
            "one block per row, two-pass statistics from registers",
        ),
        k(
            "cuda.add_layer_norm",
            AddLayerNorm,
            CUDA_FLOATS,
            "residual add and layer norm in one pass, row in registers",
        ),
        k(
            "cuda.softmax",
            Softmax,
            CUDA_FLOATS,
            "one block per row, row in registers",
        ),
        k(
            "cuda.argmax",
            ArgMax,
            CUDA_FLOATS,
            "one block per row, (value, index) pairs reduced by warp shuffles",
        ),
        k(
            "cuda.rotary",
            Rotary,
            CUDA_FLOATS,
            "NeoX rotary, f64 angles per row in shared memory",
        ),
        k(
            "cuda.split_rotary",
            SplitRotary,
            CUDA_FLOATS,
            "q/k/v split and NeoX rotary of q and k in one launch: one block per token, \
             f64 angles in shared memory, 16-byte loads",
        ),
        k(
            "cuda.activation",
            Activation,
            CUDA_FLOATS,
            "vectorized element-wise activation",
        ),
        k("cuda.add", Add, CUDA_FLOATS, "vectorized broadcasting add"),
        k(
            "cuda.mul",
            Mul,
            CUDA_FLOATS,
            "vectorized broadcasting multiply",
        ),
        k(
            "cuda.embedding",
            Embedding,
            CUDA_FLOATS,
            "one block per id, 16-byte row copies",
        ),
        k(
            "cuda.quantize",
            Quantize,
            CUDA_FLOATS,
            "f64 x/scale rounded once to FP8/int8, saturating",
        )
        .weights(QUANTIZED),
        k(
            "cuda.dequantize",
            Dequantize,
            CUDA_FLOATS,
            "FP8/int8 times the tensor's scale",
        ),
        k(
            "cuda.cast",
            Cast,
            CUDA_FLOATS,
            "element-wise float conversion",
        ),
        k(
            "cuda.attention",
            Attention,
            &[DType::F32, DType::BF16, DType::F16, DType::F8E4M3],
            "one warp per query row, online softmax, P·V in registers (f32 math); \
             variable-length batches one sequence per launch; FP8 inputs dequantized to \
             bf16 for the bf16 kernels",
        )
        .limits(ShapeLimits {
            max_head_dim: Some(256),
            varlen: true,
            paged: true,
            ..ShapeLimits::default()
        }),
        KernelDef::new(
            "cuda.attention.flash_sm90",
            Attention,
            DeviceKind::Cuda,
            &[DType::BF16, DType::F16],
            120,
            "FlashAttention-3 style for Hopper: wgmma on shared-memory operands, a producer \
             warpgroup feeding a TMA/mbarrier ring, ping-pong consumer warpgroups, dropout \
             from Philox in registers, sliding windows from each tile's first visible key \
             tile; decode shapes go to split-KV (unless the log-sum-exp or dropout is asked \
             for), windows with a mask or dropout to cuda.attention.flash",
        )
        .min_arch("sm_90")
        .limits(ShapeLimits {
            max_head_dim: Some(128),
            head_dim_multiple: Some(64),
            varlen: true,
            paged: true,
            lse: true,
            dropout: true,
            ..ShapeLimits::default()
        }),
        KernelDef::new(
            "cuda.attention.fp8_sm90",
            Attention,
            DeviceKind::Cuda,
            &[DType::F8E4M3],
            130,
            "FP8 e4m3 FlashAttention-3 style for Hopper (bf16 output, per-tensor scales): \
             wgmma k32 on e4m3 Q, K and a transposed V, P as e4m3 from registers; decode \
             shapes and sliding windows go to cuda.attention",
        )
        .min_arch("sm_90")
        .limits(ShapeLimits {
            max_head_dim: Some(128),
            head_dim_multiple: Some(128),
            ..ShapeLimits::default()
        }),
        k(
            "cuda.attention.flash",
            Attention,
            &[DType::BF16, DType::F16],
            "FlashAttention-2 style: mma.sync tensor cores, K/V tiles by cp.async, \
             online softmax in registers, dropout from Philox in registers, head dims 64 to \
             256 (Q in shared memory above 128); decode shapes go to split-KV (unless the \
             log-sum-exp or dropout is asked for)",
        )
        .with_priority(110)
        .limits(ShapeLimits {
            max_head_dim: Some(256),
            head_dim_multiple: Some(64),
            varlen: true,
            paged: true,
            lse: true,
            dropout: true,
            ..ShapeLimits::default()
        }),
        k(
            "cuda.attention_backward.flash",
            AttentionBackward,
            &[DType::BF16, DType::F16],
            "FlashAttention-2 style gradients on mma.sync tensor cores, no atomics: dq per \
             query tile (probabilities from the forward's log-sum-exp when given, else an \
             online softmax that leaves it), then dk and dv per key tile in registers \
             (on Hopper both on wgmma where they apply; head dims 192 and 256 a block per \
             half of the head dim); sliding windows walk only the tiles inside them; \
             dropout's decisions recomputed; variable-length batches one sequence per launch",
        )
        .with_priority(110)
        .limits(ShapeLimits {
            max_head_dim: Some(256),
            head_dim_multiple: Some(64),
            varlen: true,
            lse: true,
            dropout: true,
            ..ShapeLimits::default()
        }),
        k(
            "cuda.concat",
            Concat,
            &[DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64],
            "one strided 2D device copy per input",
        ),
        k(
            "cuda.cache_write",
            CacheWrite,
            CUDA_FLOATS,
            "one thread per 16-byte unit of each row, in place when the executor owns \
             the cache (slots stay on the device)",
        ),
        k(
            "cuda.split",
            Split,
            &[DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64],
            "one strided 2D device copy per output",
        ),
        k(
            "cuda.act_and_mul",
            ActAndMul,
            CUDA_FLOATS,
            "vectorized gated activation (SwiGLU/GeGLU)",
        ),
        k(
            "triton.rms_norm",
            RmsNorm,
            CUDA_FLOATS,
            "Triton, one program per row, row in registers (block = next power of two)",
        )
        .with_priority(TRITON_NORM_PRIORITY)
        .limits(TRITON_ROWS),
        k(
            "triton.add_rms_norm",
            AddRmsNorm,
            CUDA_FLOATS,
            "Triton, residual add and RMS norm in one pass, row in registers",
        )
        .with_priority(TRITON_NORM_PRIORITY)
        .limits(TRITON_ROWS),
    ]
}

/// Above cuBLASLt (100) for the row counts it takes (see [`GEMV_MAX_ROWS`]).
const GEMV_PRIORITY: i32 = 110;

/// The most activation rows for which the registry picks `cuda.linear.gemv`: the measured
/// crossover with cuBLASLt on the H100 (docs/reports/gemv-h100-m32-latest.md, the 1.1B
/// LLaMA's decode linears). The kernel takes up to 32 rows (tensor cores for bf16/f16
/// from 5), but from 4 rows on cuBLASLt is faster on three of the four shapes and over a
/// decode step's linears; asked for by name it still runs every class.
const GEMV_MAX_ROWS: usize = 2;

/// Above the CUDA norms (100): faster on the H100 (docs/reports/nvidia-h100-latest.md).
const TRITON_NORM_PRIORITY: i32 = 110;

/// Rows the Triton norm specializations take: compiled for row blocks up to 8192, with
/// the row length hinted divisible by 16 (aligned 16-byte loads of every row).
const TRITON_ROWS: ShapeLimits = ShapeLimits {
    max_head_dim: None,
    head_dim_multiple: None,
    max_k: None,
    max_rows: None,
    max_row: Some(8192),
    row_multiple: Some(16),
    varlen: false,
    paged: false,
    no_window: false,
    lse: false,
    dropout: false,
};

/// What the CPU copy ops (concat, split) take: every float and index dtype.
const COPY_DTYPES: &[DType] = &[
    DType::F64,
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::I64,
];

/// Limits of a kernel that takes every attention shape, variable-length batches, paged
/// caches and the log-sum-exp output included.
const ANY_ATTENTION: ShapeLimits = ShapeLimits {
    max_head_dim: None,
    head_dim_multiple: None,
    max_k: None,
    max_rows: None,
    max_row: None,
    row_multiple: None,
    varlen: true,
    paged: true,
    no_window: false,
    lse: true,
    dropout: false,
};

/// Limits of a backward kernel that takes every dense attention shape and the forward's
/// log-sum-exp.
const ANY_ATTENTION_BACKWARD: ShapeLimits = ShapeLimits {
    varlen: false,
    paged: false,
    ..ANY_ATTENTION
};

/// Every attention shape, with dropout (the reference, the CPU kernels and XLA).
const ANY_ATTENTION_DROPOUT: ShapeLimits = ShapeLimits {
    dropout: true,
    ..ANY_ATTENTION
};

/// Every dense attention backward shape, with dropout.
const ANY_ATTENTION_BACKWARD_DROPOUT: ShapeLimits = ShapeLimits {
    dropout: true,
    ..ANY_ATTENTION_BACKWARD
};

/// Every dense or variable-length attention backward shape, with dropout (the reference
/// and the CPU kernel, which run a variable-length batch one sequence at a time).
const ANY_ATTENTION_BACKWARD_VARLEN_DROPOUT: ShapeLimits = ShapeLimits {
    varlen: true,
    ..ANY_ATTENTION_BACKWARD_DROPOUT
};

/// The f64 reference declared for every op: correct for every float dtype, slow.
pub fn reference_kernels() -> Vec<KernelDef> {
    OpKind::ALL
        .into_iter()
        .map(|op| {
            let dtypes = if op == OpKind::Attention {
                &[
                    DType::F64,
                    DType::F32,
                    DType::F16,
                    DType::BF16,
                    DType::F8E4M3,
                ][..]
            } else if matches!(op, OpKind::Concat | OpKind::Split) {
                &[
                    DType::F64,
                    DType::F32,
                    DType::F16,
                    DType::BF16,
                    DType::I8,
                    DType::I32,
                    DType::I64,
                ][..]
            } else {
                FLOATS
            };
            let mut def = KernelDef::new(
                CPU_REFERENCE,
                op,
                DeviceKind::Cpu,
                dtypes,
                0,
                "f64 reference (naive loops), converted to the output dtype",
            )
            .host_fallback();
            if matches!(op, OpKind::Linear | OpKind::LinearAct) {
                def = def.weights(&[
                    DType::F64,
                    DType::F32,
                    DType::BF16,
                    DType::F16,
                    DType::F8E4M3,
                    DType::F8E5M2,
                    DType::I8,
                ]);
            }
            if op == OpKind::Attention {
                def = def.limits(ANY_ATTENTION_DROPOUT);
            } else if op == OpKind::AttentionBackward {
                def = def.limits(ANY_ATTENTION_BACKWARD_VARLEN_DROPOUT);
            }
            def
        })
        .collect()
}

/// The XLA kernels (kpt-tpu): each op compiled by XLA through a PJRT plugin (libtpu on
/// TPUs), one program per op and shapes, kept in the backend's compile cache.
pub fn xla_kernels() -> Vec<KernelDef> {
    use OpKind::*;
    const XLA_FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];
    let desc = "StableHLO compiled by XLA through the PJRT plugin (f32 arithmetic for \
                16-bit floats)";
    [
        (Embedding, "embedding"),
        (MatMul, "matmul"),
        (Linear, "linear"),
        (Activation, "activation"),
        (LinearAct, "linear_act"),
        (RmsNorm, "rms_norm"),
        (LayerNorm, "layer_norm"),
        (AddRmsNorm, "add_rms_norm"),
        (AddLayerNorm, "add_layer_norm"),
        (Rotary, "rotary"),
        (SplitRotary, "split_rotary"),
        (Softmax, "softmax"),
        (Attention, "attention"),
        (AttentionBackward, "attention_backward"),
        (Add, "add"),
        (Mul, "mul"),
        (Cast, "cast"),
        (Concat, "concat"),
        (Split, "split"),
        (ActAndMul, "act_and_mul"),
        (ArgMax, "argmax"),
        (Quantize, "quantize"),
        (Dequantize, "dequantize"),
    ]
    .into_iter()
    .map(|(op, name)| {
        let def = KernelDef::new(
            &format!("xla.{name}"),
            op,
            DeviceKind::Tpu,
            XLA_FLOATS,
            100,
            desc,
        );
        match op {
            Attention => def.limits(ANY_ATTENTION_DROPOUT),
            AttentionBackward => def.limits(ANY_ATTENTION_BACKWARD_DROPOUT),
            // FP8 / int8 weights are dequantized in the program (their scale an argument).
            Linear | LinearAct => def.weights(&[
                DType::F32,
                DType::BF16,
                DType::F16,
                DType::F8E4M3,
                DType::F8E5M2,
                DType::I8,
            ]),
            Quantize => def.weights(QUANTIZED),
            _ => def.weights(XLA_FLOATS),
        }
    })
    .collect()
}

impl KernelRegistry {
    /// A registry with every built-in kernel.
    pub fn with_builtin() -> Self {
        let mut r = Self::new();
        for def in cpu_kernels()
            .into_iter()
            .chain(cuda_kernels())
            .chain(amd_kernels())
            .chain(xla_kernels())
            .chain(reference_kernels())
        {
            r.register(def);
        }
        r
    }
}
