//! Device-family detection, tuning and kernel selection on the recorded property tables
//! of real devices (`devices/*.json`: an MI250X die, an MI300X and an RX 7900 XTX,
//! each with the public sources of its numbers), through the same code `kpt detect` runs
//! on what the HIP runtime reports.

use kpt_amd::{AmdDevice, DeviceProperties, Family, Fp8Format, MatrixCores};
use kpt_core::hardware::DeviceKind;
use kpt_kernels::artifacts::hsaco_candidates;

#[derive(serde::Deserialize)]
struct Fixture {
    sources: Vec<String>,
    properties: DeviceProperties,
}

fn device(file: &str) -> AmdDevice {
    let path = format!("{}/devices/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let f: Fixture = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(!f.sources.is_empty(), "{path}: no source");
    AmdDevice::new(0, f.properties).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The kernels compiled by hipcc from the CUDA sources for AMD.
const ROW_KERNELS: [&str; 8] = [
    "rms_norm",
    "layer_norm",
    "softmax",
    "rotary",
    "elementwise",
    "embedding",
    "attention",
    "quantize",
];

#[test]
fn mi250x_is_cdna2_wave64_with_mfma_and_no_fp8() {
    let d = device("mi250x.json");
    assert_eq!(d.arch.processor(), "gfx90a");
    assert_eq!(d.arch.family(), Family::Cdna2);
    assert_eq!(d.arch.wave_size(), d.properties.warp_size);
    assert_eq!(d.arch.matrix_cores(), MatrixCores::Mfma);
    assert_eq!(d.arch.fp8(), None);
    let info = d.device_info();
    assert_eq!(info.kind, DeviceKind::Rocm);
    assert_eq!(info.arch.as_deref(), Some("gfx90a"));
    assert_eq!(info.compute_units, Some(110));
    for f in ["bf16", "mfma", "wave64"] {
        assert!(info.has_feature(f), "{f}: {:?}", info.features);
    }
    assert!(!info.has_feature("fp8"));
    assert_eq!(info.properties["family"], "CDNA2");
    assert_eq!(info.properties["gcn_arch_name"], "gfx90a:sramecc+:xnack-");
    assert_eq!(info.properties["clock_mhz"], "1700");
}

#[test]
fn mi300x_is_cdna3_with_fnuz_fp8() {
    let d = device("mi300x.json");
    assert_eq!(d.arch.processor(), "gfx942");
    assert_eq!(d.arch.family(), Family::Cdna3);
    assert_eq!(d.arch.wave_size(), d.properties.warp_size);
    assert_eq!(d.arch.fp8(), Some(Fp8Format::Fnuz));
    let info = d.device_info();
    assert_eq!(info.compute_units, Some(304));
    for f in ["bf16", "fp8", "fp8_fnuz", "mfma", "wave64"] {
        assert!(info.has_feature(f), "{f}: {:?}", info.features);
    }
    assert!(!info.has_feature("fp8_ocp"));
    assert_eq!(info.properties["l2"], "4194304");
    assert!(info.memory_bytes.unwrap() > 190 << 30);
}

#[test]
fn rx7900xtx_is_rdna3_wave32_with_wmma() {
    let d = device("rx7900xtx.json");
    assert_eq!(d.arch.processor(), "gfx1100");
    assert_eq!(d.arch.family(), Family::Rdna3);
    assert_eq!(d.arch.wave_size(), 32);
    assert_eq!(d.arch.wave_size(), d.properties.warp_size);
    assert_eq!(d.arch.matrix_cores(), MatrixCores::Wmma);
    let info = d.device_info();
    for f in ["bf16", "wmma", "wave32"] {
        assert!(info.has_feature(f), "{f}: {:?}", info.features);
    }
    assert!(!info.has_feature("fp8") && !info.has_feature("mfma"));
}

#[test]
fn tuning_tables_agree_with_the_recorded_limits() {
    for file in ["mi250x.json", "mi300x.json", "rx7900xtx.json"] {
        let d = device(file);
        let p = &d.properties;
        let t = d.tuning();
        assert_eq!(t.wave_size, p.warp_size, "{file}");
        assert_eq!(u64::from(t.lds_bytes), p.lds_per_cu, "{file}");
        assert_eq!(t.lds_bytes, p.lds_per_block, "{file}");
        assert_eq!(t.max_workgroup, p.max_threads_per_block, "{file}");
        // rocminfo's "Max Waves Per CU" is 32 on all three.
        assert_eq!(t.max_waves_per_cu(), 32, "{file}");
        // Resident threads per CU: 32 waves of 64 on CDNA (2048), of 32 on RDNA 3 (1024).
        assert_eq!(
            t.max_waves_per_cu() * t.wave_size,
            p.max_threads_per_cu,
            "{file}"
        );
        // A row kernel's block fits, with its 16 bytes of static LDS.
        assert!(t.blocks_per_cu(t.row_block, 16) >= 4, "{file}");
    }
}

#[test]
fn kernel_selection_follows_the_processor() {
    let mi250x = device("mi250x.json");
    for kernel in ROW_KERNELS {
        let picked = hsaco_candidates(kernel, mi250x.arch.processor());
        assert_eq!(picked.len(), 1, "{kernel}");
        assert_eq!(picked[0].target, "gfx90a", "{kernel}");
    }
    // MI300X and RX 7900 XTX get the code objects built for exactly their processors
    // (clang 19's gfx942 and gfx1100 builds), never gfx940's or gfx1030's; Triton's
    // RMSNorm is built for both as well.
    for file in ["mi300x.json", "rx7900xtx.json"] {
        let d = device(file);
        let processor = d.arch.processor();
        for kernel in ROW_KERNELS {
            let picked = hsaco_candidates(kernel, processor);
            assert_eq!(picked.len(), 1, "{file} {kernel}");
            assert_eq!(picked[0].target, processor, "{file} {kernel}");
            assert_eq!(
                picked[0].source,
                format!("kernels/hip/{kernel}.hip"),
                "{file}"
            );
        }
        let triton = hsaco_candidates("triton_rms_norm_bf16_4096", processor);
        assert_eq!(triton.len(), 1, "{file}");
        assert_eq!(
            triton[0].entry_points[0].block,
            8 * d.arch.wave_size(),
            "{file}: 8 waves"
        );
    }
}

#[test]
fn the_registry_explains_what_would_run_on_each_recorded_device() {
    use kpt_core::graph::{Op, TensorSpec};
    use kpt_core::DType;
    use kpt_kernels::{KernelRegistry, CPU_REFERENCE};

    let registry = KernelRegistry::with_builtin();
    let inputs = [TensorSpec::new(&[8, 4096], DType::BF16)];
    let op = Op::RmsNorm { eps: 1e-6 };
    let mi250x = kpt_amd::recorded_device("mi250x").unwrap().device_info();
    assert_eq!(
        registry.fallback_chain(
            &op,
            &[inputs[0].clone(), TensorSpec::new(&[4096], DType::BF16)],
            &mi250x
        ),
        ["amd.triton.rms_norm", "amd.rms_norm", CPU_REFERENCE]
    );
    // MI300X and RX 7900 XTX: the same chain, from their own builds.
    for name in ["mi300x", "rx7900xtx"] {
        let d = kpt_amd::recorded_device(name).unwrap().device_info();
        assert_eq!(
            registry.fallback_chain(
                &op,
                &[inputs[0].clone(), TensorSpec::new(&[4096], DType::BF16)],
                &d
            ),
            ["amd.triton.rms_norm", "amd.rms_norm", CPU_REFERENCE],
            "{name}"
        );
        assert_eq!(
            registry.fallback_chain(&Op::Softmax, &inputs, &d),
            ["amd.softmax", CPU_REFERENCE],
            "{name}"
        );
    }
}
