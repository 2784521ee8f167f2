//! Integration tests of `KptConfig`: files, layering, environment and round trips.

use std::path::PathBuf;

use kpt_core::config::{
    AmdConfig, BackendChoice, DeployConfig, HardwareConfig, KernelConfig, MonitorConfig,
    NvidiaConfig, PrecisionConfig, TpuConfig, TPU_VERSIONS,
};
use kpt_core::{DType, KptConfig, KptError, OptLevel};
use proptest::prelude::*;

fn non_default() -> KptConfig {
    let mut c = KptConfig::default();
    c.hardware.backend = BackendChoice::Cuda;
    c.hardware.device_id = 2;
    c.hardware.num_threads = Some(12);
    c.hardware.memory_fraction = 0.75;
    c.nvidia.min_compute_capability = "9.0".into();
    c.nvidia.allow_tf32 = true;
    c.tpu.topology = Some("2x2x1".into());
    c.tpu.version = Some("v5p".into());
    c.tpu.plugin_path = Some(PathBuf::from("/usr/lib/libtpu.so"));
    c.amd.gfx_arch = Some("gfx942".into());
    c.kernel.prefer = vec!["flash_attention".into(), "gemm_avx2".into()];
    c.kernel.disable = vec!["naive_matmul".into()];
    c.kernel.attention_block_q = 128;
    c.kernel.autotune_cache = Some(PathBuf::from("cache/autotune.json"));
    c.precision.level = OptLevel::Aggressive;
    c.precision.compute_dtype = DType::BF16;
    c.precision.weight_dtype = Some(DType::F8E4M3);
    c.precision.tolerance_scale = 2.5;
    c.monitor.enabled = true;
    c.monitor.regression_threshold_critical = 0.5;
    c.deploy.host = "0.0.0.0".into();
    c.deploy.port = 8080;
    c.deploy.max_batch_size = 64;
    c
}

#[test]
fn non_default_config_is_valid_and_round_trips() {
    let c = non_default();
    c.validate().unwrap();
    assert_ne!(c, KptConfig::default());
    let toml_text = c.to_toml_string().unwrap();
    assert_eq!(KptConfig::from_toml_str(&toml_text).unwrap(), c);
    let json_text = c.to_json_string().unwrap();
    assert_eq!(KptConfig::from_json_str(&json_text).unwrap(), c);
}

#[test]
fn save_and_load_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["kpt.toml", "kpt.json", "KPT.TOML"] {
        let path = dir.path().join(name);
        let c = non_default();
        c.save(&path).unwrap();
        assert_eq!(KptConfig::load(&path).unwrap(), c, "{name}");
    }
    let text = std::fs::read_to_string(dir.path().join("kpt.toml")).unwrap();
    assert!(text.contains("[precision]"), "{text}");
    let text = std::fs::read_to_string(dir.path().join("kpt.json")).unwrap();
    assert!(text.contains("\"precision\""), "{text}");
}

#[test]
fn bad_extension_and_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["kpt.yaml", "kpt"] {
        let path = dir.path().join(name);
        match KptConfig::default().save(&path) {
            Err(KptError::ConfigParse { message, .. }) => {
                assert!(
                    message.contains(".toml") && message.contains(".json"),
                    "{message}"
                )
            }
            other => panic!("{name}: {other:?}"),
        }
        assert!(!path.exists());
        assert!(matches!(
            KptConfig::load(&path),
            Err(KptError::ConfigParse { .. })
        ));
    }
    let missing = dir.path().join("missing.toml");
    match KptConfig::load(&missing) {
        Err(KptError::Io { path, .. }) => assert!(path.contains("missing.toml")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn parse_errors_name_the_file_and_position() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[hardware]\nmemory_fraction = \"lots\"\n").unwrap();
    match KptConfig::load(&path) {
        Err(KptError::ConfigParse {
            source_name,
            message,
        }) => {
            assert!(source_name.ends_with("bad.toml"), "{source_name}");
            assert!(message.contains("line 2"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let path = dir.path().join("bad.json");
    std::fs::write(&path, "{\"kernel\": {\"autotune\": 1}}").unwrap();
    match KptConfig::load(&path) {
        Err(KptError::ConfigParse { message, .. }) => {
            assert!(message.contains("line 1"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn layers_apply_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kpt.toml");
    std::fs::write(
        &path,
        "[hardware]\nbackend = \"cpu\"\nnum_threads = 3\n[deploy]\nport = 9000\n",
    )
    .unwrap();
    let vars = [
        ("KPT_HARDWARE__NUM_THREADS", "5"),
        ("KPT_LEVEL", "conservative"),
        ("KPT_LOG", "trace"),
    ];
    let c = KptConfig::load_layered_from(Some(&path), vars).unwrap();
    assert_eq!(c.hardware.backend, BackendChoice::Cpu); // file
    assert_eq!(c.hardware.num_threads, Some(5)); // env over file
    assert_eq!(c.deploy.port, 9000); // file
    assert_eq!(c.precision.level, OptLevel::Conservative); // env
    assert_eq!(c.deploy.host, "127.0.0.1"); // default
    let none: [(&str, &str); 0] = [];
    assert_eq!(
        KptConfig::load_layered_from(None, none).unwrap(),
        KptConfig::default()
    );
    let err = KptConfig::load_layered_from(None, [("KPT_THREADS", "many")]).unwrap_err();
    assert!(matches!(err, KptError::ConfigParse { .. }), "{err}");
    assert!(err.to_string().contains("KPT_THREADS"), "{err}");
}

#[test]
fn process_env_layer_reads_without_error() {
    // Only checks that reading the real environment works; CI sets no KPT_ variables.
    let has_kpt_vars = std::env::vars_os().any(|(k, _)| k.to_string_lossy().starts_with("KPT_"));
    if !has_kpt_vars {
        assert_eq!(KptConfig::load_layered(None).unwrap(), KptConfig::default());
    }
}

fn opt<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Option<T>> {
    prop::option::of(s)
}

fn path() -> impl Strategy<Value = PathBuf> {
    "[a-zA-Z0-9_][a-zA-Z0-9_./-]{0,30}".prop_map(PathBuf::from)
}

fn block() -> impl Strategy<Value = usize> {
    (3u32..=9).prop_map(|e| 1usize << e)
}

fn float_dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F64, DType::F32, DType::F16, DType::BF16])
}

fn storage_dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I8,
    ])
}

fn hardware() -> impl Strategy<Value = HardwareConfig> {
    (
        prop::sample::select(BackendChoice::ALL.to_vec()),
        0usize..16,
        opt(1usize..1024),
        (1u32..=1000).prop_map(|n| n as f32 / 1000.0),
        any::<bool>(),
    )
        .prop_map(
            |(backend, device_id, num_threads, memory_fraction, deterministic)| HardwareConfig {
                backend,
                device_id: if backend == BackendChoice::Cpu {
                    0
                } else {
                    device_id
                },
                num_threads,
                memory_fraction,
                deterministic,
            },
        )
}

fn nvidia() -> impl Strategy<Value = NvidiaConfig> {
    (1u32..=12, 0u32..=9, any::<[bool; 2]>()).prop_map(|(major, minor, b)| NvidiaConfig {
        enabled: b[0],
        min_compute_capability: format!("{major}.{minor}"),
        allow_tf32: b[1],
    })
}

fn tpu() -> impl Strategy<Value = TpuConfig> {
    (
        any::<bool>(),
        opt(path()),
        opt(prop::collection::vec(1usize..16, 2..=3)),
        opt(prop::sample::select(TPU_VERSIONS.to_vec())),
    )
        .prop_map(|(enabled, plugin_path, dims, version)| TpuConfig {
            enabled,
            plugin_path,
            topology: dims.map(|d| {
                d.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join("x")
            }),
            version: version.map(String::from),
        })
}

fn amd() -> impl Strategy<Value = AmdConfig> {
    (
        any::<bool>(),
        opt("gfx[0-9][0-9a-f]{1,3}"),
        any::<bool>(),
        opt(path()),
    )
        .prop_map(|(enabled, gfx_arch, use_hipblaslt, kernel_dir)| AmdConfig {
            enabled,
            gfx_arch,
            use_hipblaslt,
            kernel_dir,
        })
}

fn kernel() -> impl Strategy<Value = KernelConfig> {
    (
        any::<bool>(),
        opt(path()),
        1usize..100,
        0usize..10,
        prop::collection::vec("p_[a-z0-9_]{1,12}", 0..4),
        prop::collection::vec("d_[a-z0-9_]{1,12}", 0..4),
        block(),
        block(),
    )
        .prop_map(
            |(
                autotune,
                autotune_cache,
                autotune_iters,
                autotune_warmup,
                prefer,
                disable,
                q,
                kv,
            )| {
                KernelConfig {
                    autotune,
                    autotune_cache,
                    autotune_iters,
                    autotune_warmup,
                    prefer,
                    disable,
                    attention_block_q: q,
                    attention_block_kv: kv,
                }
            },
        )
}

fn precision() -> impl Strategy<Value = PrecisionConfig> {
    (
        prop::sample::select(OptLevel::ALL.to_vec()),
        float_dtype(),
        opt(storage_dtype()),
        opt(storage_dtype()),
        (1u32..=10_000).prop_map(|n| f64::from(n) / 100.0),
        opt(prop::sample::select(vec![
            DType::F32,
            DType::BF16,
            DType::F16,
        ])),
    )
        .prop_map(
            |(
                level,
                compute_dtype,
                weight_dtype,
                kv_cache_dtype,
                tolerance_scale,
                activation_dtype,
            )| {
                let uses = |pred: fn(DType) -> bool| {
                    weight_dtype.is_some_and(pred) || kv_cache_dtype.is_some_and(pred)
                };
                PrecisionConfig {
                    level,
                    compute_dtype,
                    weight_dtype,
                    kv_cache_dtype,
                    activation_dtype,
                    allow_fp8: uses(|d| matches!(d, DType::F8E4M3 | DType::F8E5M2))
                        || level != OptLevel::Conservative,
                    allow_int8: uses(|d| d == DType::I8) || level == OptLevel::Aggressive,
                    tolerance_scale,
                }
            },
        )
}

fn monitor() -> impl Strategy<Value = MonitorConfig> {
    (
        any::<bool>(),
        1u16..=u16::MAX,
        path(),
        1u64..100_000,
        1u32..3000,
        1u32..3000,
        1u32..3000,
    )
        .prop_map(
            |(enabled, port, history_db, interval, a, b, c)| MonitorConfig {
                enabled,
                // Keep clear of deploy.port, which is below 10000 in deploy().
                metrics_port: port.max(10_000),
                history_db,
                sample_interval_ms: interval,
                // Whole multiples of 1e-4, as people write them.
                regression_threshold_minor: f64::from(a) / 1e4,
                regression_threshold_major: f64::from(a + b) / 1e4,
                regression_threshold_critical: f64::from(a + b + c) / 1e4,
            },
        )
}

fn deploy() -> impl Strategy<Value = DeployConfig> {
    (
        "[a-z0-9][a-z0-9.-]{0,20}",
        1u16..10_000,
        1usize..1024,
        0u64..100_000,
        1usize..1_000_000,
        path(),
    )
        .prop_map(
            |(host, port, max_batch_size, batch_timeout_ms, max_seq_len, export_dir)| {
                DeployConfig {
                    host,
                    port,
                    max_batch_size,
                    batch_timeout_ms,
                    max_seq_len,
                    export_dir,
                }
            },
        )
}

fn config() -> impl Strategy<Value = KptConfig> {
    (
        hardware(),
        nvidia(),
        tpu(),
        amd(),
        kernel(),
        precision(),
        monitor(),
        deploy(),
    )
        .prop_map(
            |(hardware, nvidia, tpu, amd, kernel, precision, monitor, deploy)| {
                let mut c = KptConfig {
                    hardware,
                    nvidia,
                    tpu,
                    amd,
                    kernel,
                    precision,
                    monitor,
                    deploy,
                };
                // The selected backend must be enabled.
                match c.hardware.backend {
                    BackendChoice::Cuda => c.nvidia.enabled = true,
                    BackendChoice::Rocm => c.amd.enabled = true,
                    BackendChoice::Tpu => c.tpu.enabled = true,
                    BackendChoice::Auto | BackendChoice::Cpu => {}
                }
                c
            },
        )
}

/// Whether `a` and `b` are equal or adjacent doubles.
fn within_one_ulp(a: f64, b: f64) -> bool {
    a == b || (a.to_bits() as i64 - b.to_bits() as i64).abs() <= 1
}

proptest! {
    /// Values as people write them (short decimals) round-trip exactly in both formats.
    #[test]
    fn random_valid_configs_round_trip(c in config()) {
        prop_assert_eq!(c.issues(), vec![]);
        let toml_text = c.to_toml_string().unwrap();
        prop_assert_eq!(&KptConfig::from_toml_str(&toml_text).unwrap(), &c, "TOML:\n{}", toml_text);
        let json_text = c.to_json_string().unwrap();
        prop_assert_eq!(&KptConfig::from_json_str(&json_text).unwrap(), &c, "JSON:\n{}", json_text);
    }

    /// Arbitrary floats: TOML is exact; JSON is exact up to one ulp, because serde_json
    /// parses long decimals with a fast, not always correctly rounded, algorithm unless
    /// its `float_roundtrip` feature is enabled.
    #[test]
    fn arbitrary_floats_round_trip(
        mut c in config(),
        fraction in 0.001f32..=1.0,
        scale in 1e-6f64..1e6,
        t in (0.001f64..0.3, 0.001f64..0.3, 0.001f64..0.3),
    ) {
        c.hardware.memory_fraction = fraction;
        c.precision.tolerance_scale = scale;
        c.monitor.regression_threshold_minor = t.0;
        c.monitor.regression_threshold_major = t.0 + t.1;
        c.monitor.regression_threshold_critical = t.0 + t.1 + t.2;
        prop_assert_eq!(c.issues(), vec![]);
        let toml_text = c.to_toml_string().unwrap();
        prop_assert_eq!(&KptConfig::from_toml_str(&toml_text).unwrap(), &c, "TOML:\n{}", toml_text);

        let mut back = KptConfig::from_json_str(&c.to_json_string().unwrap()).unwrap();
        prop_assert_eq!(back.hardware.memory_fraction, c.hardware.memory_fraction);
        let pairs = [
            (&mut back.precision.tolerance_scale, c.precision.tolerance_scale),
            (&mut back.monitor.regression_threshold_minor, c.monitor.regression_threshold_minor),
            (&mut back.monitor.regression_threshold_major, c.monitor.regression_threshold_major),
            (&mut back.monitor.regression_threshold_critical, c.monitor.regression_threshold_critical),
        ];
        for (got, want) in pairs {
            prop_assert!(within_one_ulp(*got, want), "{} vs {}", got, want);
            *got = want;
        }
        prop_assert_eq!(&back, &c);
    }
}
