//! The kernel registry: selection by device, dtype, architecture, shape limits,
//! configuration (disable / prefer) and measured timings, and the explanations.

use kpt_core::graph::{Activation, AttentionParams, Op, OpKind, TensorSpec};
use kpt_core::hardware::{CpuDetector, DeviceInfo, DeviceKind, HardwareDetector};
use kpt_core::optimize::KernelSelector;
use kpt_core::{DType, KptError};
use kpt_kernels::registry::arch_at_least;
use kpt_kernels::{KernelDef, KernelRegistry, ShapeLimits, CPU_REFERENCE};

fn cpu() -> DeviceInfo {
    CpuDetector.detect().expect("CPU detection").remove(0)
}

/// A made-up accelerator of `kind` with architecture `arch`.
fn fake_device(kind: DeviceKind, arch: &str) -> DeviceInfo {
    DeviceInfo {
        kind,
        index: 0,
        name: format!("fake {kind} {arch}"),
        memory_bytes: Some(80 << 30),
        compute_units: Some(132),
        arch: Some(arch.to_string()),
        features: vec![],
        properties: Default::default(),
    }
}

fn f32s(shape: &[usize]) -> TensorSpec {
    TensorSpec::new(shape, DType::F32)
}

fn linear_inputs(x: DType, w: DType) -> Vec<TensorSpec> {
    vec![TensorSpec::new(&[4, 64], x), TensorSpec::new(&[32, 64], w)]
}

fn strings(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn attention(head_dim: usize) -> (Op, Vec<TensorSpec>) {
    let p = AttentionParams::new(4, 2, head_dim, true);
    let op = Op::Attention(p);
    let inputs = vec![
        f32s(&[1, 8, 4 * head_dim]),
        f32s(&[1, 8, 2 * head_dim]),
        f32s(&[1, 8, 2 * head_dim]),
    ];
    (op, inputs)
}

/// A small valid f32 signature for every op kind.
fn sample(kind: OpKind) -> (Op, Vec<TensorSpec>) {
    let i64s = |s: &[usize]| TensorSpec::new(s, DType::I64);
    match kind {
        OpKind::Embedding => (Op::Embedding, vec![i64s(&[2, 3]), f32s(&[10, 8])]),
        OpKind::MatMul => (Op::MatMul, vec![f32s(&[2, 4, 8]), f32s(&[8, 5])]),
        OpKind::Linear => (
            Op::Linear { bias: true },
            vec![f32s(&[4, 8]), f32s(&[6, 8]), f32s(&[6])],
        ),
        OpKind::LinearAct => (
            Op::LinearAct {
                bias: false,
                act: Activation::Silu,
            },
            vec![f32s(&[4, 8]), f32s(&[6, 8])],
        ),
        OpKind::Activation => (
            Op::Activation {
                act: Activation::GeluTanh,
            },
            vec![f32s(&[4, 8])],
        ),
        OpKind::RmsNorm => (Op::RmsNorm { eps: 1e-5 }, vec![f32s(&[4, 8]), f32s(&[8])]),
        OpKind::LayerNorm => (
            Op::LayerNorm { eps: 1e-5 },
            vec![f32s(&[4, 8]), f32s(&[8]), f32s(&[8])],
        ),
        OpKind::AddRmsNorm => (
            Op::AddRmsNorm { eps: 1e-5 },
            vec![f32s(&[4, 8]), f32s(&[4, 8]), f32s(&[8])],
        ),
        OpKind::AddLayerNorm => (
            Op::AddLayerNorm { eps: 1e-5 },
            vec![f32s(&[4, 8]), f32s(&[4, 8]), f32s(&[8]), f32s(&[8])],
        ),
        OpKind::Rotary => (
            Op::Rotary {
                head_dim: 8,
                theta: 10000.0,
                scaling: None,
            },
            vec![f32s(&[1, 3, 16]), i64s(&[3])],
        ),
        OpKind::SplitRotary => (
            Op::SplitRotary {
                head_dim: 8,
                theta: 10000.0,
                scaling: None,
                sizes: vec![16, 8, 8],
                cache: false,
            },
            vec![f32s(&[1, 3, 32]), i64s(&[3])],
        ),
        OpKind::Softmax => (Op::Softmax, vec![f32s(&[4, 8])]),
        OpKind::ArgMax => (Op::ArgMax, vec![f32s(&[4, 1, 8])]),
        OpKind::Attention => attention(16),
        OpKind::AttentionBackward => {
            let (op, mut inputs) = attention(16);
            let Op::Attention(p) = op else {
                unreachable!("attention() builds an attention op")
            };
            inputs.extend([inputs[0].clone(), inputs[0].clone()]);
            (Op::AttentionBackward(p), inputs)
        }
        OpKind::Add => (Op::Add, vec![f32s(&[4, 8]), f32s(&[8])]),
        OpKind::Mul => (Op::Mul, vec![f32s(&[4, 8]), f32s(&[4, 8])]),
        OpKind::Quantize => (
            Op::Quantize {
                dtype: DType::F8E4M3,
                scale: 0.5,
            },
            vec![f32s(&[4, 8])],
        ),
        OpKind::Dequantize => (
            Op::Dequantize { dtype: DType::F32 },
            vec![TensorSpec::new(&[4, 8], DType::I8)],
        ),
        OpKind::Cast => (Op::Cast { dtype: DType::BF16 }, vec![f32s(&[4, 8])]),
        OpKind::Concat => (
            Op::Concat { axis: 1 },
            vec![f32s(&[1, 4, 8]), f32s(&[1, 1, 8])],
        ),
        OpKind::Split => (
            Op::Split {
                axis: 1,
                sizes: vec![3, 1],
            },
            vec![f32s(&[1, 4, 8])],
        ),
        OpKind::CacheWrite => (
            Op::CacheWrite,
            vec![f32s(&[2, 8, 8]), f32s(&[2, 1, 8]), i64s(&[2])],
        ),
        OpKind::ActAndMul => (
            Op::ActAndMul {
                act: Activation::Silu,
            },
            vec![f32s(&[4, 8])],
        ),
    }
}

#[test]
fn fused_linear_is_selected_for_every_weight_dtype() {
    let registry = KernelRegistry::with_builtin();
    let device = cpu();
    for w in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I8,
    ] {
        let inputs = linear_inputs(DType::F32, w);
        let op = Op::Linear { bias: false };
        op.infer(&inputs).expect("valid signature");
        let choice = registry
            .select(&op, &inputs, &device)
            .unwrap_or_else(|e| panic!("{w}: {e}"));
        assert_eq!(choice.kernel, "cpu.linear.fused", "weights {w}");
        assert_eq!(choice.backend, DeviceKind::Cpu);
        assert_eq!(
            registry.fallback_chain(&op, &inputs, &device),
            ["cpu.linear.fused", CPU_REFERENCE],
            "weights {w}"
        );
        // The fused linear+activation kernel accepts the same weights.
        let op = Op::LinearAct {
            bias: false,
            act: Activation::Relu,
        };
        assert_eq!(
            registry.select(&op, &inputs, &device).unwrap().kernel,
            "cpu.linear_act.fused",
            "weights {w}"
        );
    }
}

#[test]
fn bf16_activations_fall_back_to_the_reference() {
    let registry = KernelRegistry::with_builtin();
    let device = cpu();
    let op = Op::Linear { bias: false };
    let inputs = linear_inputs(DType::BF16, DType::BF16);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        [CPU_REFERENCE]
    );
    let choice = registry.select(&op, &inputs, &device).unwrap();
    assert_eq!(choice.kernel, CPU_REFERENCE);
    let fused = choice
        .skipped
        .iter()
        .find(|s| s.starts_with("cpu.linear.fused"))
        .expect("the fused kernel is listed as skipped");
    assert!(fused.contains("bf16"), "{fused}");
}

#[test]
fn disabled_kernels_are_skipped_and_explained() {
    let mut registry = KernelRegistry::with_builtin();
    let device = cpu();
    let op = Op::Linear { bias: false };
    let inputs = linear_inputs(DType::F32, DType::BF16);
    registry.set_disabled(&strings(&["cpu.linear.fused"]));
    assert_eq!(
        registry.select(&op, &inputs, &device).unwrap().kernel,
        CPU_REFERENCE
    );
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        [CPU_REFERENCE]
    );
    let explained = registry.explain(&op, &inputs, &device);
    let fused = explained
        .iter()
        .find(|c| c.kernel == "cpu.linear.fused")
        .expect("listed");
    assert_eq!(fused.rank, None);
    assert!(fused.reason.contains("disabled"), "{}", fused.reason);
    let reference = explained
        .iter()
        .find(|c| c.kernel == CPU_REFERENCE)
        .expect("listed");
    assert_eq!(reference.rank, Some(0));
    assert!(
        reference.reason.starts_with("selected"),
        "{}",
        reference.reason
    );

    // Disabling every kernel of the op leaves nothing: a typed error with the reasons.
    registry.set_disabled(&strings(&["cpu.linear.fused", CPU_REFERENCE]));
    match registry.select(&op, &inputs, &device) {
        Err(KptError::NoKernel { reasons, .. }) => {
            let disabled = reasons.iter().filter(|r| r.contains("disabled")).count();
            assert_eq!(disabled, 2, "{reasons:?}");
            assert!(
                reasons.iter().all(|r| r.contains("disabled")
                    || r.contains("runs on cuda")
                    || r.contains("runs on rocm")
                    || r.contains("runs on tpu")),
                "{reasons:?}"
            );
        }
        other => panic!("expected NoKernel, got {other:?}"),
    }
    // Re-enabling restores the default.
    registry.set_disabled(&[]);
    assert_eq!(
        registry.select(&op, &inputs, &device).unwrap().kernel,
        "cpu.linear.fused"
    );
}

#[test]
fn preferred_kernels_come_first() {
    let mut registry = KernelRegistry::with_builtin();
    let device = cpu();
    let op = Op::Softmax;
    let inputs = vec![f32s(&[4, 16])];
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        ["cpu.softmax", CPU_REFERENCE]
    );
    registry.set_preferred(&strings(&[CPU_REFERENCE]));
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        [CPU_REFERENCE, "cpu.softmax"]
    );
    let explained = registry.explain(&op, &inputs, &device);
    assert_eq!(explained[0].kernel, CPU_REFERENCE);
    assert!(
        explained[0].reason.contains("preferred"),
        "{}",
        explained[0].reason
    );
    assert!(
        explained[1].reason.starts_with("fallback #1"),
        "{}",
        explained[1].reason
    );
    // A preferred kernel that does not qualify is ignored.
    let mut registry = KernelRegistry::with_builtin();
    registry.set_preferred(&strings(&["cpu.linear.fused"]));
    let inputs = linear_inputs(DType::BF16, DType::BF16);
    assert_eq!(
        registry.fallback_chain(&Op::Linear { bias: false }, &inputs, &device),
        [CPU_REFERENCE]
    );
}

#[test]
fn measured_kernels_come_first() {
    let mut registry = KernelRegistry::with_builtin();
    let device = cpu();
    let op = Op::Linear { bias: false };
    let inputs = linear_inputs(DType::F32, DType::F32);
    registry.record_timing(CPU_REFERENCE, &op, &inputs, 7);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        [CPU_REFERENCE, "cpu.linear.fused"]
    );
    let explained = registry.explain(&op, &inputs, &device);
    assert_eq!(explained[0].measured_us, Some(7));
    assert!(
        explained[0].reason.contains("measured 7"),
        "{}",
        explained[0].reason
    );
    // With both measured, the faster one wins.
    registry.record_timing("cpu.linear.fused", &op, &inputs, 3);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        ["cpu.linear.fused", CPU_REFERENCE]
    );
    // Timings are per signature: another shape keeps the priority order.
    let other = vec![f32s(&[9, 64]), f32s(&[32, 64])];
    registry.record_timing("cpu.linear.fused", &op, &inputs, 100);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        [CPU_REFERENCE, "cpu.linear.fused"]
    );
    assert_eq!(
        registry.fallback_chain(&op, &other, &device),
        ["cpu.linear.fused", CPU_REFERENCE]
    );
}

#[test]
fn a_device_without_kernels_falls_back_to_the_host_reference() {
    let mut registry = KernelRegistry::with_builtin();
    let device = fake_device(DeviceKind::Rocm, "gfx942");
    let op = Op::Linear { bias: false };
    let inputs = linear_inputs(DType::F32, DType::BF16);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &device),
        [CPU_REFERENCE],
        "only the host reference runs on a ROCm device without rocBLAS or hipBLASLt"
    );
    registry.set_disabled(&strings(&[CPU_REFERENCE]));
    let err = registry.select(&op, &inputs, &device).unwrap_err();
    match &err {
        KptError::NoKernel {
            backend, reasons, ..
        } => {
            assert_eq!(backend, &device.name);
            assert!(
                reasons.iter().all(|r| r.contains("runs on")
                    || r.contains("disabled")
                    || r.contains("needs CPU/device feature rocblas")
                    || r.contains("no bf16 weights (has f8e4m3)")),
                "{reasons:?}"
            );
        }
        other => panic!("expected NoKernel, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("cpu.linear.fused") && msg.contains(CPU_REFERENCE),
        "{msg}"
    );
    assert!(msg.contains("device is rocm"), "{msg}");
    assert!(registry.fallback_chain(&op, &inputs, &device).is_empty());
}

#[test]
fn an_empty_registry_says_no_kernel_is_registered() {
    let registry = KernelRegistry::new();
    let err = registry
        .select(&Op::Softmax, &[f32s(&[2, 2])], &cpu())
        .unwrap_err();
    assert!(matches!(err, KptError::NoKernel { .. }), "{err}");
    assert!(
        err.to_string().contains("no kernel registered for softmax"),
        "{err}"
    );
}

#[test]
fn minimum_architecture_is_enforced() {
    let mut registry = KernelRegistry::new();
    let def = KernelDef::new(
        "cuda.linear.fp8",
        OpKind::Linear,
        DeviceKind::Cuda,
        &[DType::F32],
        100,
        "test",
    )
    .weights(&[DType::F8E4M3])
    .min_arch("sm_90");
    registry.register(def);
    let op = Op::Linear { bias: false };
    let inputs = linear_inputs(DType::F32, DType::F8E4M3);

    let ampere = fake_device(DeviceKind::Cuda, "sm_80");
    let err = registry.select(&op, &inputs, &ampere).unwrap_err();
    assert!(matches!(err, KptError::NoKernel { .. }), "{err}");
    assert!(
        err.to_string().contains("needs sm_90, device is sm_80"),
        "{err}"
    );

    let hopper = fake_device(DeviceKind::Cuda, "sm_90");
    let choice = registry.select(&op, &inputs, &hopper).unwrap();
    assert_eq!(choice.kernel, "cuda.linear.fp8");
    assert_eq!(choice.backend, DeviceKind::Cuda);
    let blackwell = fake_device(DeviceKind::Cuda, "sm_100");
    assert_eq!(
        registry.select(&op, &inputs, &blackwell).unwrap().kernel,
        "cuda.linear.fp8"
    );

    let mut unknown = fake_device(DeviceKind::Cuda, "sm_90");
    unknown.arch = None;
    let err = registry.select(&op, &inputs, &unknown).unwrap_err();
    assert!(err.to_string().contains("device arch unknown"), "{err}");

    // The weight dtype is checked too.
    let bf16 = linear_inputs(DType::F32, DType::BF16);
    let err = registry.select(&op, &bf16, &hopper).unwrap_err();
    assert!(err.to_string().contains("no bf16 weights"), "{err}");
}

#[test]
fn required_features_are_enforced() {
    let mut registry = KernelRegistry::new();
    registry.register(
        KernelDef::new(
            "rocm.softmax",
            OpKind::Softmax,
            DeviceKind::Rocm,
            &[DType::F32],
            1,
            "test",
        )
        .needs(&["wave64"]),
    );
    let mut device = fake_device(DeviceKind::Rocm, "gfx942");
    let inputs = [f32s(&[2, 8])];
    let err = registry.select(&Op::Softmax, &inputs, &device).unwrap_err();
    assert!(err.to_string().contains("wave64"), "{err}");
    device.features.push("wave64".into());
    assert_eq!(
        registry
            .select(&Op::Softmax, &inputs, &device)
            .unwrap()
            .kernel,
        "rocm.softmax"
    );
}

#[test]
fn arch_at_least_orders_within_a_family() {
    let cases = [
        ("sm_80", "sm_80", true),
        ("sm_90", "sm_80", true),
        ("sm_86", "sm_89", false),
        ("sm_100", "sm_90", true),
        ("gfx942", "gfx90a", true),
        ("gfx90a", "gfx942", false),
        ("gfx90a", "gfx908", true),
        ("gfx942", "gfx942", true),
        ("sm_90", "gfx90a", false),
        ("gfx942", "sm_80", false),
        ("v5e", "v4", true),
        ("v4", "v5e", false),
        ("v5p", "v5e", true),
        ("x86_64-avx2", "sm_80", false),
        ("sm_80", "x86_64-avx2", false),
    ];
    let wrong: Vec<String> = cases
        .iter()
        .filter(|&&(a, b, want)| arch_at_least(a, b) != want)
        .map(|&(a, b, want)| format!("arch_at_least({a:?}, {b:?}) should be {want}"))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Architecture names with a feature suffix (`sm_90a`, `sm_100a`) compare by number.
#[test]

fn arch_suffixes_compare_by_number() {
    let cases = [
        ("sm_90a", "sm_80", true),
        ("sm_90a", "sm_90", true),
        ("sm_90a", "sm_90a", true),
        ("sm_100a", "sm_90a", true),
        ("sm_80", "sm_90a", false),
    ];
    let wrong: Vec<String> = cases
        .iter()
        .filter(|&&(a, b, want)| arch_at_least(a, b) != want)
        .map(|&(a, b, want)| format!("arch_at_least({a:?}, {b:?}) should be {want}"))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");

    // So a kernel that needs sm_90 runs on an sm_90a device.
    let mut registry = KernelRegistry::new();
    registry.register(
        KernelDef::new(
            "cuda.linear.fp8",
            OpKind::Linear,
            DeviceKind::Cuda,
            &[DType::F32],
            100,
            "test",
        )
        .weights(&[DType::F8E4M3])
        .min_arch("sm_90"),
    );
    let inputs = linear_inputs(DType::F32, DType::F8E4M3);
    let hopper = fake_device(DeviceKind::Cuda, "sm_90a");
    let choice = registry
        .select(&Op::Linear { bias: false }, &inputs, &hopper)
        .unwrap_or_else(|e| panic!("sm_90a >= sm_90: {e}"));
    assert_eq!(choice.kernel, "cuda.linear.fp8");
}

#[test]
fn shape_limits_reject_large_head_dims() {
    let mut registry = KernelRegistry::with_builtin();
    let limits = ShapeLimits {
        max_head_dim: Some(128),
        head_dim_multiple: Some(16),
        ..ShapeLimits::default()
    };
    let def = KernelDef::new(
        "cpu.attention.small",
        OpKind::Attention,
        DeviceKind::Cpu,
        &[DType::F32],
        1000,
        "test",
    )
    .limits(limits);
    registry.register(def);
    let device = cpu();

    let (op, inputs) = attention(64);
    assert_eq!(
        registry.select(&op, &inputs, &device).unwrap().kernel,
        "cpu.attention.small"
    );

    let (op, inputs) = attention(256);
    op.infer(&inputs).expect("valid signature");
    let explained = registry.explain(&op, &inputs, &device);
    let small = explained
        .iter()
        .find(|c| c.kernel == "cpu.attention.small")
        .expect("listed");
    assert_eq!(small.rank, None);
    assert!(small.reason.contains("head_dim"), "{}", small.reason);
    assert!(
        small.reason.contains("256") && small.reason.contains("128"),
        "{}",
        small.reason
    );
    let choice = registry.select(&op, &inputs, &device).unwrap();
    assert_eq!(choice.kernel, "cpu.attention.flash");
    assert!(choice
        .skipped
        .iter()
        .any(|s| s.starts_with("cpu.attention.small") && s.contains("head_dim")));

    let (op, inputs) = attention(40);
    let small = registry
        .explain(&op, &inputs, &device)
        .into_iter()
        .find(|c| c.kernel == "cpu.attention.small");
    let reason = small.expect("listed").reason;
    assert!(reason.contains("not a multiple of 16"), "{reason}");
}

#[test]
fn registering_a_kernel_again_replaces_it() {
    let mut registry = KernelRegistry::with_builtin();
    let before = registry.kernels().len();
    registry.register(KernelDef::new(
        "cpu.softmax",
        OpKind::Softmax,
        DeviceKind::Cpu,
        &[DType::F32],
        -5,
        "slower",
    ));
    assert_eq!(registry.kernels().len(), before);
    assert_eq!(
        registry.for_op(OpKind::Softmax).count(),
        5,
        "cpu, cuda, amd, xla, reference"
    );
    let chain = registry.fallback_chain(&Op::Softmax, &[f32s(&[2, 4])], &cpu());
    assert_eq!(chain, [CPU_REFERENCE, "cpu.softmax"], "priority 0 beats -5");
}

#[test]
fn every_op_has_a_cpu_kernel_and_ends_in_the_reference() {
    let registry = KernelRegistry::with_builtin();
    let device = cpu();
    for kind in OpKind::ALL {
        assert!(
            registry
                .for_op(kind)
                .any(|k| k.backend == DeviceKind::Cpu && k.name != CPU_REFERENCE),
            "{kind}: no fast CPU kernel"
        );
        let (op, inputs) = sample(kind);
        assert_eq!(op.kind(), kind);
        op.infer(&inputs)
            .unwrap_or_else(|e| panic!("{kind}: sample does not infer: {e}"));
        let chain = registry.fallback_chain(&op, &inputs, &device);
        assert!(chain.len() >= 2, "{kind}: {chain:?}");
        assert_ne!(
            chain[0], CPU_REFERENCE,
            "{kind}: a fast kernel should be selected"
        );
        assert!(chain[0].starts_with("cpu."), "{kind}: {chain:?}");
        assert_eq!(
            chain.last().map(String::as_str),
            Some(CPU_REFERENCE),
            "{kind}: {chain:?}"
        );
        // explain lists every kernel of the op, the chain in rank order first.
        let explained = registry.explain(&op, &inputs, &device);
        assert_eq!(explained.len(), registry.for_op(kind).count(), "{kind}");
        for (i, c) in explained.iter().take(chain.len()).enumerate() {
            assert_eq!(c.rank, Some(i), "{kind}: {c:?}");
        }
        assert!(
            explained[0].reason.starts_with("selected"),
            "{kind}: {}",
            explained[0].reason
        );
    }
}

#[test]
fn the_reference_covers_low_precision_activations() {
    let registry = KernelRegistry::with_builtin();
    let device = cpu();
    for dtype in [DType::F64, DType::F16, DType::BF16] {
        let op = Op::Softmax;
        let inputs = [TensorSpec::new(&[2, 8], dtype)];
        let chain = registry.fallback_chain(&op, &inputs, &device);
        assert_eq!(
            chain.last().map(String::as_str),
            Some(CPU_REFERENCE),
            "{dtype}: {chain:?}"
        );
    }
}

#[test]
fn add_layer_norm_runs_on_cuda_for_every_float_and_on_the_cpu_in_f32() {
    let registry = KernelRegistry::with_builtin();
    let gpu = fake_device(DeviceKind::Cuda, "sm_80");
    let op = Op::AddLayerNorm { eps: 1e-5 };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = TensorSpec::new(&[8, 4100], dtype);
        let p = TensorSpec::new(&[4100], dtype);
        let inputs = [x.clone(), x, p.clone(), p];
        let choice = registry.select(&op, &inputs, &gpu).unwrap();
        assert_eq!(choice.kernel, "cuda.add_layer_norm", "{dtype}");
        let chain = registry.fallback_chain(&op, &inputs, &cpu());
        let want: &[&str] = if dtype == DType::F32 {
            &["cpu.add_layer_norm", CPU_REFERENCE]
        } else {
            &[CPU_REFERENCE]
        };
        assert_eq!(chain, strings(want), "{dtype}");
    }
}

#[test]
fn triton_norms_take_rows_they_were_compiled_for_and_cuda_the_rest() {
    let registry = KernelRegistry::with_builtin();
    let gpu = fake_device(DeviceKind::Cuda, "sm_90a");
    let op = Op::RmsNorm { eps: 1e-5 };
    let chosen = |dim: usize| {
        let inputs = [
            TensorSpec::new(&[8, dim], DType::BF16),
            TensorSpec::new(&[dim], DType::BF16),
        ];
        registry
            .select(&op, &inputs, &gpu)
            .unwrap_or_else(|e| panic!("dim {dim}: {e}"))
            .kernel
    };
    assert_eq!(chosen(4096), "triton.rms_norm");
    assert_eq!(chosen(16), "triton.rms_norm");
    assert_eq!(chosen(4100), "cuda.rms_norm", "not a multiple of 16");
    assert_eq!(
        chosen(8192 + 16),
        "cuda.rms_norm",
        "beyond the largest block"
    );
    let inputs = [
        TensorSpec::new(&[8, 4100], DType::BF16),
        TensorSpec::new(&[4100], DType::BF16),
    ];
    let why = registry
        .explain(&op, &inputs, &gpu)
        .into_iter()
        .find(|c| c.kernel == "triton.rms_norm")
        .map(|c| c.reason)
        .unwrap_or_default();
    assert!(why.contains("not a multiple of 16"), "{why}");
}

#[test]
fn cuda_attention_backward_takes_bf16_f16_at_64_and_128_with_or_without_windows() {
    let registry = KernelRegistry::with_builtin();
    let device = fake_device(DeviceKind::Cuda, "sm_80");
    let backward = |dtype: DType, head_dim: usize, window: Option<usize>| {
        let p = AttentionParams {
            window,
            ..AttentionParams::new(4, 2, head_dim, true)
        };
        let q = TensorSpec::new(&[1, 7, 4 * head_dim], dtype);
        let kv = TensorSpec::new(&[1, 9, 2 * head_dim], dtype);
        let inputs = vec![q.clone(), kv.clone(), kv, q.clone(), q];
        let op = Op::AttentionBackward(p);
        op.infer(&inputs).expect("valid signature");
        registry.fallback_chain(&op, &inputs, &device)
    };
    const FLASH: &str = "cuda.attention_backward.flash";
    for dtype in [DType::BF16, DType::F16] {
        for head_dim in [64, 128, 192, 256] {
            let chain = backward(dtype, head_dim, None);
            assert_eq!(chain.first().map(String::as_str), Some(FLASH), "{chain:?}");
            assert_eq!(chain.last().map(String::as_str), Some(CPU_REFERENCE));
            let windowed = backward(dtype, head_dim, Some(3));
            assert_eq!(
                windowed.first().map(String::as_str),
                Some(FLASH),
                "{windowed:?}"
            );
        }
        for head_dim in [32, 96, 320] {
            let chain = backward(dtype, head_dim, None);
            assert!(!chain.iter().any(|k| k == FLASH), "{chain:?}");
        }
    }
    let chain = backward(DType::F32, 64, None);
    assert!(!chain.iter().any(|k| k == FLASH), "{chain:?}");
}

#[test]
fn fp8_attention_takes_the_hopper_kernel_then_dequantizes() {
    let registry = KernelRegistry::with_builtin();
    let fp8 = |head_dim: usize| {
        let (op, inputs) = attention(head_dim);
        let inputs: Vec<_> = inputs
            .iter()
            .map(|s| TensorSpec::new(&s.shape, DType::F8E4M3))
            .collect();
        (op, inputs)
    };
    let (op, inputs) = fp8(128);
    let hopper = fake_device(DeviceKind::Cuda, "sm_90");
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &hopper),
        strings(&["cuda.attention.fp8_sm90", "cuda.attention", CPU_REFERENCE])
    );
    let ampere = fake_device(DeviceKind::Cuda, "sm_80");
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &ampere),
        strings(&["cuda.attention", CPU_REFERENCE])
    );
    let (op, inputs) = fp8(64);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &hopper),
        strings(&["cuda.attention", CPU_REFERENCE])
    );
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &cpu()),
        strings(&[CPU_REFERENCE])
    );
}

#[test]
fn the_log_sum_exp_goes_only_to_kernels_that_give_or_take_it() {
    let registry = KernelRegistry::with_builtin();
    let hopper = fake_device(DeviceKind::Cuda, "sm_90a");
    let p = AttentionParams {
        lse: true,
        ..AttentionParams::new(4, 2, 128, true)
    };
    let bf16 = |s: &[usize]| TensorSpec::new(s, DType::BF16);
    let (q, kv) = (bf16(&[1, 8, 512]), bf16(&[1, 8, 256]));
    // Forward: the tensor-core kernels, not the one-warp-per-row kernel, then the host
    // reference.
    let fwd = Op::Attention(p);
    let chain = registry.fallback_chain(&fwd, &[q.clone(), kv.clone(), kv.clone()], &hopper);
    assert_eq!(
        chain,
        strings(&[
            "cuda.attention.flash_sm90",
            "cuda.attention.flash",
            CPU_REFERENCE
        ])
    );
    let plain = Op::Attention(AttentionParams { lse: false, ..p });
    let chain = registry.fallback_chain(&plain, &[q.clone(), kv.clone(), kv.clone()], &hopper);
    assert!(chain.iter().any(|k| k == "cuda.attention"), "{chain:?}");
    // Backward with the log-sum-exp input: the flash backward, then the reference.
    let lse = TensorSpec::new(&[1, 4, 8], DType::F32);
    let bwd = Op::AttentionBackward(p);
    let ins = [q.clone(), kv.clone(), kv.clone(), q.clone(), q, lse];
    let chain = registry.fallback_chain(&bwd, &ins, &hopper);
    assert_eq!(
        chain,
        strings(&["cuda.attention_backward.flash", CPU_REFERENCE])
    );
    // On the CPU, both f32 kernels take it.
    let (op, inputs) = attention(16);
    let Op::Attention(p) = op else { unreachable!() };
    let fwd = Op::Attention(AttentionParams { lse: true, ..p });
    let chain = registry.fallback_chain(&fwd, &inputs, &cpu());
    assert_eq!(
        chain.first().map(String::as_str),
        Some("cpu.attention.flash")
    );
    // A kernel without `ShapeLimits::lse` says why it declines.
    let def = KernelDef::new(
        "cpu.attention.plain",
        OpKind::Attention,
        DeviceKind::Cpu,
        &[DType::F32],
        1000,
        "test",
    );
    let why = def.rejection(&fwd, &inputs, &cpu());
    assert_eq!(why.as_deref(), Some("no log-sum-exp"));
}

#[test]
fn decode_sized_linears_take_the_gemv_kernel_and_larger_ones_cublaslt() {
    let registry = KernelRegistry::with_builtin();
    let mut h100 = fake_device(DeviceKind::Cuda, "sm_90");
    h100.features = vec!["cublaslt".to_string()];
    let op = Op::Linear { bias: false };
    let bf16 = |shape: &[usize]| TensorSpec::new(shape, DType::BF16);
    for rows in [1, 2] {
        let chain =
            registry.fallback_chain(&op, &[bf16(&[1, rows, 2048]), bf16(&[2560, 2048])], &h100);
        assert_eq!(
            chain[..2],
            ["cuda.linear.gemv", "cuda.linear.cublaslt"],
            "{rows} rows"
        );
    }
    // From 3 rows on cuBLASLt (the measured crossover, docs/reports/gemv-h100-m32-latest.md).
    for rows in [3, 16, 32, 33] {
        let chain =
            registry.fallback_chain(&op, &[bf16(&[rows, 2048]), bf16(&[2560, 2048])], &h100);
        assert_eq!(chain[0], "cuda.linear.cublaslt", "{rows} rows");
    }
    let why = registry.explain(&op, &[bf16(&[2, 9, 64]), bf16(&[8, 64])], &h100);
    let gemv = why.iter().find(|c| c.kernel == "cuda.linear.gemv").unwrap();
    assert!(
        gemv.rank.is_none() && gemv.reason.contains("M = 18 > 2"),
        "{gemv:?}"
    );
}

#[test]
fn amd_kernels_run_only_on_the_processors_they_were_built_for() {
    let registry = KernelRegistry::with_builtin();
    let inputs = [f32s(&[4, 4096])];
    // MI200: the CUDA softmax compiled for gfx90a, then the host reference.
    let mi200 = fake_device(DeviceKind::Rocm, "gfx90a");
    assert_eq!(
        registry.fallback_chain(&Op::Softmax, &inputs, &mi200),
        ["amd.softmax", CPU_REFERENCE]
    );
    let def = registry
        .for_op(OpKind::Softmax)
        .into_iter()
        .find(|k| k.name == "amd.softmax")
        .unwrap();
    assert_eq!(
        def.targets,
        ["gfx90a", "gfx940", "gfx1030", "gfx942", "gfx1100"]
    );
    assert_eq!(def.backend, DeviceKind::Rocm);
    // MI300X (gfx942) and RX 7900 XTX (gfx1100) have code objects of their own.
    for arch in ["gfx942", "gfx1100"] {
        let device = fake_device(DeviceKind::Rocm, arch);
        assert_eq!(
            registry.fallback_chain(&Op::Softmax, &inputs, &device),
            ["amd.softmax", CPU_REFERENCE],
            "{arch}"
        );
    }
    // RX 7800 XT (gfx1101) and MI100 (gfx908) have none, so the explanation says what it
    // was built for.
    for arch in ["gfx1101", "gfx908"] {
        let device = fake_device(DeviceKind::Rocm, arch);
        assert_eq!(
            registry.fallback_chain(&Op::Softmax, &inputs, &device),
            [CPU_REFERENCE],
            "{arch}"
        );
        let why = registry
            .explain(&Op::Softmax, &inputs, &device)
            .into_iter()
            .find(|c| c.kernel == "amd.softmax")
            .unwrap();
        assert_eq!(why.rank, None);
        assert_eq!(
            why.reason,
            format!("built for gfx90a/gfx940/gfx1030/gfx942/gfx1100 only, device is {arch}")
        );
    }
    // The AMD kernels never run on a CUDA device, nor the CUDA ones on AMD.
    let h100 = fake_device(DeviceKind::Cuda, "sm_90");
    let chain = registry.fallback_chain(&Op::Softmax, &inputs, &h100);
    assert!(chain.iter().all(|k| !k.starts_with("amd.")), "{chain:?}");
    // RMSNorm: the Triton build first (as on CUDA), then the CUDA source's.
    let norm = [f32s(&[4, 4096]), f32s(&[4096])];
    let op = Op::RmsNorm { eps: 1e-6 };
    assert_eq!(
        registry.fallback_chain(&op, &norm, &mi200),
        ["amd.triton.rms_norm", "amd.rms_norm", CPU_REFERENCE]
    );
    // MI300X has Triton's gfx942 build and clang 19's, RX 7900 XTX their gfx1100 ones.
    for arch in ["gfx942", "gfx1100"] {
        let device = fake_device(DeviceKind::Rocm, arch);
        assert_eq!(
            registry.fallback_chain(&op, &norm, &device),
            ["amd.triton.rms_norm", "amd.rms_norm", CPU_REFERENCE],
            "{arch}"
        );
    }
}

#[test]
fn exact_targets_are_enforced() {
    let mut registry = KernelRegistry::new();
    registry.register(
        KernelDef::new(
            "amd.softmax.test",
            OpKind::Softmax,
            DeviceKind::Rocm,
            &[DType::F32],
            1,
            "test",
        )
        .targets(&["gfx90a"]),
    );
    let inputs = [f32s(&[2, 8])];
    let ok = fake_device(DeviceKind::Rocm, "gfx90a");
    assert_eq!(
        registry.select(&Op::Softmax, &inputs, &ok).unwrap().kernel,
        "amd.softmax.test"
    );
    // A newer processor is not "at least" gfx90a for a code object.
    let newer = fake_device(DeviceKind::Rocm, "gfx942");
    let err = registry.select(&Op::Softmax, &inputs, &newer).unwrap_err();
    assert!(
        err.to_string()
            .contains("built for gfx90a only, device is gfx942"),
        "{err}"
    );
    let mut unknown = ok.clone();
    unknown.arch = None;
    let err = registry
        .select(&Op::Softmax, &inputs, &unknown)
        .unwrap_err();
    assert!(err.to_string().contains("device arch unknown"), "{err}");
}

#[test]
fn amd_attention_takes_dense_batches_only() {
    let registry = KernelRegistry::with_builtin();
    let mi200 = fake_device(DeviceKind::Rocm, "gfx90a");
    let (op, inputs) = attention(64);
    assert_eq!(
        registry.fallback_chain(&op, &inputs, &mi200)[0],
        "amd.attention"
    );
    let def = registry
        .for_op(OpKind::Attention)
        .find(|k| k.name == "amd.attention")
        .unwrap();
    assert!(!def.dtypes.contains(&DType::F8E4M3), "{:?}", def.dtypes);
    assert!(!def.limits.varlen && !def.limits.paged);
    // The CUDA kernel it comes from takes both (its backend does the work around it).
    let cuda = registry
        .for_op(OpKind::Attention)
        .find(|k| k.name == "cuda.attention")
        .unwrap();
    assert!(cuda.limits.varlen && cuda.dtypes.contains(&DType::F8E4M3));
    let p = AttentionParams {
        varlen: true,
        ..AttentionParams::new(4, 2, 64, true)
    };
    let why = registry
        .explain(&Op::Attention(p), &inputs, &mi200)
        .into_iter()
        .find(|c| c.kernel == "amd.attention")
        .unwrap();
    assert_eq!(why.reason, "no variable-length sequences");
}

#[test]
fn amd_quantize_and_dequantize_come_from_the_cuda_source() {
    let registry = KernelRegistry::with_builtin();
    let mi200 = fake_device(DeviceKind::Rocm, "gfx90a");
    let mi300 = fake_device(DeviceKind::Rocm, "gfx942");
    for kind in [OpKind::Quantize, OpKind::Dequantize] {
        let (op, inputs) = sample(kind);
        assert_eq!(
            registry.fallback_chain(&op, &inputs, &mi200)[0],
            format!("amd.{kind}")
        );
        assert_eq!(
            registry.fallback_chain(&op, &inputs, &mi300)[0],
            format!("amd.{kind}"),
            "gfx942 build"
        );
    }
}

#[test]
fn wide_heads_take_the_mma_sync_flash_kernel_on_hopper() {
    let registry = KernelRegistry::with_builtin();
    let hopper = fake_device(DeviceKind::Cuda, "sm_90a");
    let chain = |dtype: DType, head_dim: usize| {
        let (op, inputs) = attention(head_dim);
        let inputs: Vec<_> = inputs
            .iter()
            .map(|s| TensorSpec::new(&s.shape, dtype))
            .collect();
        op.infer(&inputs).expect("valid signature");
        registry.fallback_chain(&op, &inputs, &hopper)
    };
    for dtype in [DType::BF16, DType::F16] {
        for head_dim in [192, 256] {
            assert_eq!(
                chain(dtype, head_dim),
                strings(&["cuda.attention.flash", "cuda.attention", CPU_REFERENCE]),
                "{dtype} head dim {head_dim}"
            );
        }
        assert_eq!(
            chain(dtype, 128).first().map(String::as_str),
            Some("cuda.attention.flash_sm90")
        );
        // Above the kernel's widest tile: not it.
        let wider = chain(dtype, 320);
        assert!(
            !wider.iter().any(|k| k == "cuda.attention.flash"),
            "{wider:?}"
        );
    }
}

#[test]
fn varlen_attention_backward_takes_the_cpu_or_cuda_kernel_or_the_reference() {
    let registry = KernelRegistry::with_builtin();
    let p = AttentionParams {
        varlen: true,
        ..AttentionParams::new(4, 2, 64, true)
    };
    let op = Op::AttentionBackward(p);
    let chain = |dtype: DType, device: &DeviceInfo| {
        let q = TensorSpec::new(&[1, 7, 4 * 64], dtype);
        let kv = TensorSpec::new(&[1, 9, 2 * 64], dtype);
        let cu = TensorSpec::new(&[3], DType::I64);
        let inputs = vec![q.clone(), kv.clone(), kv, q.clone(), q, cu.clone(), cu];
        op.infer(&inputs).expect("valid signature");
        registry.fallback_chain(&op, &inputs, device)
    };
    assert_eq!(
        chain(DType::F32, &cpu()),
        strings(&["cpu.attention_backward", CPU_REFERENCE])
    );
    // CUDA: the tensor-core backward, one sequence per launch; f32 and head dims it does
    // not take go to the host reference.
    let hopper = fake_device(DeviceKind::Cuda, "sm_90a");
    assert_eq!(
        chain(DType::BF16, &hopper),
        strings(&["cuda.attention_backward.flash", CPU_REFERENCE])
    );
    assert_eq!(chain(DType::F32, &hopper), strings(&[CPU_REFERENCE]));
}
