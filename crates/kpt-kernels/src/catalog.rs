//! The built-in kernels: every kernel kpt ships, declared for the registry.
//!
//! The CPU chain for every op ends in [`CPU_REFERENCE`], the f64 reference, so a
//! graph always has a (slow) kernel on the CPU whatever its dtypes.

use kpt_core::graph::OpKind;
use kpt_core::hardware::DeviceKind;
use kpt_core::DType;

use crate::registry::{KernelDef, KernelRegistry};

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
            "cpu.rotary",
            Rotary,
            F32,
            "NeoX rotary with a per-call cos/sin table",
        ),
        k(
            "cpu.softmax",
            Softmax,
            F32,
            "stable softmax, rows in parallel",
        ),
        k(
            "cpu.attention.flash",
            Attention,
            F32,
            "blocked online-softmax attention; never builds the full score matrix",
        ),
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
        k(
            "cpu.concat",
            Concat,
            &[
                DType::F64,
                DType::F32,
                DType::F16,
                DType::BF16,
                DType::I32,
                DType::I64,
            ],
            "block copies",
        ),
    ]
}

/// The f64 reference declared for every op: correct for every float dtype, slow.
pub fn reference_kernels() -> Vec<KernelDef> {
    OpKind::ALL
        .into_iter()
        .map(|op| {
            let dtypes = if op == OpKind::Concat {
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
            );
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
            def
        })
        .collect()
}

impl KernelRegistry {
    /// A registry with every built-in kernel.
    pub fn with_builtin() -> Self {
        let mut r = Self::new();
        for def in cpu_kernels().into_iter().chain(reference_kernels()) {
            r.register(def);
        }
        r
    }
}
