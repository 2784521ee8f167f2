//! What the registry selects on the recorded devices (an MI250X die, an MI300X, an
//! RX 7900 XTX) as the ROCm backend presents them, and that every selection is one the
//! backend can launch there: an `amd.*` kernel of kpt's code objects is chosen only on a
//! processor its code object was built for (whatever code objects are shipped), GEMMs go
//! to rocBLAS where it is loaded and to the host reference where it is not, and every
//! chain ends at the host reference.

use kpt_amd::kernels::{every_launch, Planner};
use kpt_amd::{backend_device_info, recorded_device, recorded_devices, CodeObject, Libraries};
use kpt_core::graph::{Activation, AttentionParams, Op, TensorSpec};
use kpt_core::hardware::DeviceInfo;
use kpt_core::DType;
use kpt_kernels::artifacts::{hsaco_candidates, hsaco_targets};
use kpt_kernels::{KernelRegistry, CPU_REFERENCE};

fn t(shape: &[usize], dtype: DType) -> TensorSpec {
    TensorSpec::new(shape, dtype)
}

/// One call of each op the ROCm backend has a launcher for, in bf16, with the code
/// object its `amd.*` kernel launches from (`None`: rocBLAS or a device copy).
fn samples() -> Vec<(Op, Vec<TensorSpec>, Option<&'static str>)> {
    let bf = DType::BF16;
    let x = t(&[8, 4096], bf);
    let w = t(&[4096], bf);
    let att = AttentionParams::new(8, 2, 128, true);
    vec![
        (
            Op::RmsNorm { eps: 1e-6 },
            vec![x.clone(), w.clone()],
            Some("rms_norm"),
        ),
        (
            Op::LayerNorm { eps: 1e-6 },
            vec![x.clone(), w.clone(), w.clone()],
            Some("layer_norm"),
        ),
        (Op::Softmax, vec![x.clone()], Some("softmax")),
        (Op::ArgMax, vec![x.clone()], Some("softmax")),
        (
            Op::Activation {
                act: Activation::Silu,
            },
            vec![x.clone()],
            Some("elementwise"),
        ),
        (Op::Add, vec![x.clone(), w.clone()], Some("elementwise")),
        (
            Op::Cast { dtype: DType::F32 },
            vec![x.clone()],
            Some("elementwise"),
        ),
        (
            Op::Embedding,
            vec![t(&[8], DType::I64), t(&[32000, 4096], bf)],
            Some("embedding"),
        ),
        (
            Op::Attention(att),
            vec![
                t(&[1, 16, 1024], bf),
                t(&[1, 16, 256], bf),
                t(&[1, 16, 256], bf),
            ],
            Some("attention"),
        ),
        (
            Op::Linear { bias: true },
            vec![x.clone(), t(&[1024, 4096], bf), t(&[1024], bf)],
            None,
        ),
        (
            Op::Linear { bias: false },
            vec![x.clone(), t(&[1024, 4096], DType::F8E4M3)],
            None,
        ),
        (
            Op::MatMul,
            vec![t(&[4, 8, 64], bf), t(&[4, 64, 32], bf)],
            None,
        ),
        (Op::Concat { axis: 1 }, vec![x.clone(), x.clone()], None),
    ]
}

fn devices(rocblas: bool) -> Vec<(&'static str, DeviceInfo)> {
    let libraries = Libraries {
        rocblas,
        hipblaslt_fp8: rocblas,
    };
    recorded_devices()
        .into_iter()
        .map(|name| {
            let d = recorded_device(name).unwrap();
            (name, backend_device_info(&d, libraries))
        })
        .collect()
}

#[test]
fn amd_kernels_are_chosen_exactly_where_their_code_objects_were_built() {
    let registry = KernelRegistry::with_builtin();
    for (name, info) in devices(true) {
        let processor = info.arch.clone().unwrap();
        for (op, specs, object) in samples() {
            let chain = registry.fallback_chain(&op, &specs, &info);
            assert_eq!(
                chain.last().map(String::as_str),
                Some(CPU_REFERENCE),
                "{name} {op}: {chain:?}"
            );
            let first = &chain[0];
            match object {
                Some(object) => {
                    let hip = hsaco_targets(object).contains(&processor.as_str());
                    // The RMSNorm also has Triton's build (one specialization per row
                    // block and dtype; this sample's is bf16 with rows up to 4096).
                    let triton = object == "rms_norm"
                        && hsaco_targets("triton_rms_norm_bf16_4096").contains(&processor.as_str());
                    assert_eq!(
                        first.starts_with("amd."),
                        hip || triton,
                        "{name} ({processor}) {op}: chose {first}; {object} built for {:?}",
                        hsaco_targets(object)
                    );
                    if first.starts_with("amd.triton.") {
                        assert!(triton, "{name} {op}: {first}");
                    } else if first.starts_with("amd.") {
                        assert!(hip, "{name} {op}: {first}");
                    }
                }
                None => assert!(
                    first.starts_with("amd.") && !first.starts_with("amd.triton."),
                    "{name} {op}: chose {first}"
                ),
            }
        }
    }
}

#[test]
fn without_rocblas_gemms_fall_back_to_the_host_reference() {
    let registry = KernelRegistry::with_builtin();
    for (name, info) in devices(false) {
        assert!(!info.has_feature("rocblas"), "{name}");
        for (op, specs, _) in samples() {
            if !matches!(op, Op::Linear { .. } | Op::MatMul) {
                continue;
            }
            let explained = registry.explain(&op, &specs, &info);
            let rocblas = explained
                .iter()
                .find(|c| c.kernel.ends_with(".rocblas"))
                .unwrap();
            assert_eq!(rocblas.reason, "needs CPU/device feature rocblas", "{name}");
            assert_eq!(
                registry.fallback_chain(&op, &specs, &info),
                [CPU_REFERENCE],
                "{name} {op}"
            );
        }
    }
}

#[test]
fn recorded_devices_select_as_documented() {
    let registry = KernelRegistry::with_builtin();
    let bf = DType::BF16;
    let linear = (
        Op::Linear { bias: true },
        vec![t(&[8, 4096], bf), t(&[1024, 4096], bf), t(&[1024], bf)],
    );
    for (name, info) in devices(true) {
        assert!(info.has_feature("rocblas"), "{name}");
        assert_eq!(
            registry.fallback_chain(&linear.0, &linear.1, &info),
            ["amd.linear.rocblas", CPU_REFERENCE],
            "{name}"
        );
    }
    // The RMSNorm of Triton is built for gfx90a, gfx942 and gfx1100: first on all three.
    let norm = Op::RmsNorm { eps: 1e-6 };
    let specs = [t(&[8, 4096], bf), t(&[4096], bf)];
    for (name, info) in devices(true) {
        let chain = registry.fallback_chain(&norm, &specs, &info);
        assert_eq!(chain[0], "amd.triton.rms_norm", "{name}");
    }
}

/// Every entry point a selected `amd.*` kernel launches on a recorded device exists in
/// the code object shipped for that device's processor, with the argument layout the
/// launcher passes.
#[test]
fn selected_kernels_launch_code_objects_of_the_device() {
    let registry = KernelRegistry::with_builtin();
    for (name, info) in devices(true) {
        let processor = info.arch.clone().unwrap();
        let planner = Planner {
            compute_units: info.compute_units.unwrap() as u32,
        };
        let launches = every_launch(&planner).unwrap();
        for (op, specs, object) in samples() {
            let Some(object) = object else { continue };
            let chain = registry.fallback_chain(&op, &specs, &info);
            if !chain[0].starts_with("amd.") || chain[0].starts_with("amd.triton.") {
                continue;
            }
            let shipped = hsaco_candidates(object, &processor);
            assert_eq!(shipped.len(), 1, "{name} {object}");
            let co = CodeObject::parse(shipped[0].bytes).unwrap();
            let mine: Vec<_> = launches.iter().filter(|l| l.kernel == object).collect();
            assert!(!mine.is_empty(), "{object}");
            for l in mine {
                let k = co.kernel(&l.entry).unwrap_or_else(|| {
                    panic!("{name}: {object} for {processor} lacks {}", l.entry)
                });
                l.check_layout(k).unwrap();
            }
        }
    }
}

/// FP8 e4m3 weights: hipBLASLt's FP8 GEMM on the MI300X (FNUZ, gfx942) where hipBLASLt
/// is loaded, rocBLAS on dequantized weights elsewhere and without it.
#[test]
fn fp8_linears_take_hipblaslt_on_mi300_only() {
    let registry = KernelRegistry::with_builtin();
    let bf = DType::BF16;
    let op = Op::Linear { bias: true };
    let specs = [
        t(&[8, 4096], bf),
        t(&[1024, 4096], DType::F8E4M3),
        t(&[1024], bf),
    ];
    for (name, info) in devices(true) {
        let chain = registry.fallback_chain(&op, &specs, &info);
        if name == "mi300x" {
            assert!(info.has_feature("hipblaslt_fp8"));
            assert_eq!(
                chain,
                [
                    "amd.linear.hipblaslt_fp8",
                    "amd.linear.rocblas",
                    CPU_REFERENCE
                ]
            );
        } else {
            assert!(!info.has_feature("hipblaslt_fp8"), "{name}");
            assert_eq!(chain, ["amd.linear.rocblas", CPU_REFERENCE], "{name}");
        }
    }
    // Without hipBLASLt on the MI300X: rocBLAS on the dequantized weights.
    let d = recorded_device("mi300x").unwrap();
    let info = backend_device_info(
        &d,
        Libraries {
            rocblas: true,
            hipblaslt_fp8: false,
        },
    );
    let chain = registry.fallback_chain(&op, &specs, &info);
    assert_eq!(chain, ["amd.linear.rocblas", CPU_REFERENCE]);
    // e5m2 weights are not the FP8 GEMM's (its operands are e4m3).
    let e5m2 = [
        specs[0].clone(),
        t(&[1024, 4096], DType::F8E5M2),
        specs[2].clone(),
    ];
    let mi300x = devices(true)
        .into_iter()
        .find(|(n, _)| *n == "mi300x")
        .unwrap()
        .1;
    assert_eq!(
        registry.fallback_chain(&op, &e5m2, &mi300x)[0],
        "amd.linear.rocblas"
    );
}

#[allow(dead_code)]
#[path = "../../kpt-kernels/tests/support/decoder.rs"]
mod decoder;

/// Whole plans: a LLaMA-style decoder (prefill and decode) optimized at every level for
/// each recorded device, with and without the BLAS libraries, selects for every node a
/// kernel the backend launches on that processor with what kpt ships.
#[test]
fn every_planned_kernel_is_one_the_backend_launches_there() {
    use kpt_core::optimize::{auto_optimize, PrecisionPolicy};
    use kpt_core::OptLevel;

    let registry = KernelRegistry::with_builtin();
    for rocblas in [true, false] {
        for (name, info) in devices(rocblas) {
            let processor = info.arch.clone().unwrap();
            for graph in [decoder::decoder(false), decoder::decoder(true)] {
                for level in [
                    OptLevel::Conservative,
                    OptLevel::Balanced,
                    OptLevel::Aggressive,
                ] {
                    let plan =
                        auto_optimize(&graph, level, &PrecisionPolicy::default(), &registry, &info)
                            .unwrap_or_else(|e| panic!("{name} {level:?}: {e}"));
                    for (node, choice) in plan.graph.nodes().iter().zip(&plan.kernels) {
                        assert!(
                            kpt_amd::launches_on(&choice.kernel, &node.op, &processor),
                            "{name} ({processor}, rocBLAS {rocblas}) {level:?}: {} runs {} \
                             for {}",
                            node.name,
                            choice.kernel,
                            node.op
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn launches_on_follows_the_shipped_code_objects() {
    for p in ["gfx90a", "gfx940", "gfx942", "gfx1030", "gfx1100"] {
        assert_eq!(
            kpt_amd::launches_on("amd.softmax", &Op::Softmax, p),
            hsaco_targets("softmax").contains(&p),
            "{p}"
        );
        assert_eq!(
            kpt_amd::launches_on("amd.triton.rms_norm", &Op::RmsNorm { eps: 1e-6 }, p),
            hsaco_targets("triton_rms_norm_bf16_1024").contains(&p),
            "{p}"
        );
        assert!(kpt_amd::launches_on(
            "amd.linear.rocblas",
            &Op::Linear { bias: true },
            p
        ));
        assert!(kpt_amd::launches_on(CPU_REFERENCE, &Op::Softmax, p));
        assert!(!kpt_amd::launches_on("cuda.softmax", &Op::Softmax, p));
        assert!(!kpt_amd::launches_on(
            "amd.triton.rms_norm",
            &Op::Softmax,
            p
        ));
    }
}
