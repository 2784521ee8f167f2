//! kpt-tpu against a real PJRT plugin: compilation and execution by XLA.
//!
//! The plugin comes from `KPT_PJRT_PLUGIN` (XLA's CPU plugin under `cargo xtask test`,
//! the CUDA plugin on the GPU machine) or from `target/pjrt-venv`. Without one each test
//! says it was skipped, unless `KPT_REQUIRE_PJRT=1` (set by `cargo xtask test`), which
//! makes that a failure.

mod common;

use std::sync::Arc;

use half::bf16;
use kpt_core::rand::SplitMix64;
use kpt_core::DType;
use kpt_tpu::{CompileOptions, PjrtError};
use proptest::prelude::*;

/// The client, or `None` (with a note on stderr) when no plugin is installed.
fn tensor(dims: &[usize], ty: &str) -> String {
    let d: Vec<String> = dims.iter().map(usize::to_string).collect();
    format!("tensor<{}x{ty}>", d.join("x"))
}

/// `a[m, k] · b[k, n]` as a StableHLO module.
fn matmul_program(m: usize, k: usize, n: usize, ty: &str) -> String {
    let (ta, tb, tc) = (
        tensor(&[m, k], ty),
        tensor(&[k, n], ty),
        tensor(&[m, n], ty),
    );
    // f32 at full precision: GPU plugins may otherwise run it on TF32 tensor cores.
    let precision = if ty == "f32" {
        ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
    } else {
        ""
    };
    format!(
        "module @matmul {{
  func.func @main(%a: {ta}, %b: {tb}) -> {tc} {{
    %c = \"stablehlo.dot_general\"(%a, %b) {{dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>{precision}}} : ({ta}, {tb}) -> {tc}
    return %c : {tc}
  }}
}}"
    )
}

#[test]
fn the_plugin_lists_its_devices() {
    let Some(client) = common::client() else {
        return;
    };
    let (major, minor) = client.plugin().api_version();
    assert_eq!(major, kpt_tpu::sys::API_MAJOR);
    assert!(minor >= 1);
    let platform = client.platform_name().unwrap();
    assert!(
        ["cpu", "cuda", "rocm", "tpu"].contains(&platform.as_str()),
        "{platform}"
    );
    let devices = client.devices().unwrap();
    assert!(!devices.is_empty());
    let d = devices[0].description().unwrap();
    assert!(!d.kind.is_empty() && !d.debug_string.is_empty(), "{d:?}");
    let ids: Vec<i32> = devices
        .iter()
        .map(|d| d.description().unwrap().id)
        .collect();
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!(ids, unique, "device ids are distinct");
}

#[test]
fn buffers_round_trip_every_dtype() {
    let Some(client) = common::client() else {
        return;
    };
    let device = client.devices().unwrap().remove(0);
    let f: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 3.0).collect();
    let b = client.buffer(&f, &[3, 4], &device).unwrap();
    assert_eq!(b.dims().unwrap(), [3, 4]);
    assert_eq!(b.dtype().unwrap(), DType::F32);
    assert_eq!(b.to_vec::<f32>().unwrap(), f);
    let h: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(
        client
            .buffer(&h, &[12], &device)
            .unwrap()
            .to_vec::<bf16>()
            .unwrap(),
        h
    );
    let i: Vec<i64> = (0..5).map(|x| x * 1_000_000_007).collect();
    assert_eq!(
        client
            .buffer(&i, &[5], &device)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        i
    );
    let s = client.buffer(&[7i32], &[], &device).unwrap();
    assert_eq!(
        (s.dims().unwrap(), s.to_vec::<i32>().unwrap()),
        (vec![], vec![7])
    );
    // Asking for another element type is a typed error, not a reinterpretation.
    assert!(matches!(b.to_vec::<i32>(), Err(PjrtError::Invalid(_))));
}

#[test]
fn bad_inputs_are_typed_errors_with_the_plugins_message() {
    let Some(client) = common::client() else {
        return;
    };
    let device = client.devices().unwrap().remove(0);
    // Wrong element count: caught before the plugin is called.
    let e = client.buffer(&[1.0f32; 5], &[2, 3], &device).unwrap_err();
    assert!(
        matches!(e, PjrtError::Invalid(ref m) if m.contains("24 bytes")),
        "{e}"
    );
    // A program that does not parse: XLA's own message.
    let e = client
        .compile(b"func.func @main( -> nonsense", &CompileOptions::default())
        .unwrap_err();
    match e {
        PjrtError::Call { func, message, .. } => {
            assert_eq!(func, "PJRT_Client_Compile");
            assert!(!message.is_empty());
        }
        other => panic!("expected a call error, got {other}"),
    }
    // Inputs that do not match the parameters.
    let exe = client
        .compile(
            matmul_program(2, 3, 4, "f32").as_bytes(),
            &CompileOptions::default(),
        )
        .unwrap();
    let a = client.buffer(&[0.0f32; 6], &[2, 3], &device).unwrap();
    assert!(exe.execute(&[&a]).is_err(), "one input of two");
    let b = client.buffer(&[0.0f32; 12], &[3, 4], &device).unwrap();
    assert_eq!(exe.execute(&[&a, &b]).unwrap().len(), 1);
}

fn random(rng: &mut SplitMix64, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// `a · b` in f64.
fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = f64::from(a[i * k + p]);
            for j in 0..n {
                c[i * n + j] += x * f64::from(b[p * n + j]);
            }
        }
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// A matmul compiled by XLA against the f64 reference, f32 and bf16, over shapes
    /// with 1, odd and large sizes.
    #[test]
    fn xla_matmul_matches_the_f64_reference(
        m in prop_oneof![Just(1usize), 2usize..40, Just(257)],
        k in prop_oneof![Just(1usize), 2usize..70, Just(1024)],
        n in prop_oneof![Just(1usize), 2usize..40, Just(129)],
        seed in any::<u64>(),
    ) {
        let Some(client) = common::client() else {
            return Ok(());
        };
        let device = client.devices().unwrap().remove(0);
        let mut rng = SplitMix64::new(seed);
        let (a, b) = (random(&mut rng, m * k), random(&mut rng, k * n));
        let (ad, bd) = ([m as i64, k as i64], [k as i64, n as i64]);
        // f32: a few f32 roundings of a k-term sum.
        let exe = client.compile(matmul_program(m, k, n, "f32").as_bytes(), &CompileOptions::default()).unwrap();
        let out = exe
            .execute(&[&client.buffer(&a, &ad, &device).unwrap(), &client.buffer(&b, &bd, &device).unwrap()])
            .unwrap();
        prop_assert_eq!(out[0].dims().unwrap(), vec![m as i64, n as i64]);
        let got = out[0].to_vec::<f32>().unwrap();
        let want = reference(&a, &b, m, k, n);
        let tol = 16.0 * f64::from(f32::EPSILON) * (k as f64).sqrt();
        for (g, w) in got.iter().zip(&want) {
            prop_assert!((f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()), "f32 {m}x{k}x{n}: {g} vs {w}");
        }
        // bf16 inputs and output: the reference of the rounded inputs, one bf16 rounding.
        let ah: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
        let bh: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
        let exe = client.compile(matmul_program(m, k, n, "bf16").as_bytes(), &CompileOptions::default()).unwrap();
        let out = exe
            .execute(&[&client.buffer(&ah, &ad, &device).unwrap(), &client.buffer(&bh, &bd, &device).unwrap()])
            .unwrap();
        let got = out[0].to_vec::<bf16>().unwrap();
        let (af, bf): (Vec<f32>, Vec<f32>) = (ah.iter().map(|x| x.to_f32()).collect(), bh.iter().map(|x| x.to_f32()).collect());
        let want = reference(&af, &bf, m, k, n);
        let scale = want.iter().fold(1.0f64, |s, w| s.max(w.abs()));
        let tol = 16.0 * DType::BF16.epsilon() * (k as f64).sqrt() * scale;
        for (g, w) in got.iter().zip(&want) {
            prop_assert!((g.to_f64() - w).abs() <= tol, "bf16 {m}x{k}x{n}: {g} vs {w}");
        }
    }
}

#[test]
fn the_compile_cache_hits_evicts_and_persists() {
    let Some(client) = common::client() else {
        return;
    };
    let opts = CompileOptions::default();
    let programs: Vec<String> = (1..=3).map(|n| matmul_program(n, 4, 2, "f32")).collect();
    let cache = kpt_tpu::CompileCache::new(&client, usize::MAX);
    let a = cache.get_or_compile(programs[0].as_bytes(), &opts).unwrap();
    let b = cache.get_or_compile(programs[0].as_bytes(), &opts).unwrap();
    assert!(
        Arc::ptr_eq(&a, &b),
        "the second request is the same executable"
    );
    let other = CompileOptions {
        num_replicas: 1,
        num_partitions: 1,
        use_spmd_partitioning: true,
    };
    let c = cache
        .get_or_compile(programs[0].as_bytes(), &other)
        .unwrap();
    assert!(!Arc::ptr_eq(&a, &c), "other options are another entry");
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.entries, s.evictions), (1, 2, 2, 0));
    assert!((s.hit_rate() - 1.0 / 3.0).abs() < 1e-12);

    // A limit that holds one program: each new one evicts the least recently used.
    let one = s.bytes / 2;
    let small = kpt_tpu::CompileCache::new(&client, one);
    for p in &programs {
        small.get_or_compile(p.as_bytes(), &opts).unwrap();
    }
    let s = small.stats();
    assert_eq!((s.misses, s.entries, s.evictions), (3, 1, 2), "{s:?}");
    small.get_or_compile(programs[2].as_bytes(), &opts).unwrap();
    assert_eq!(small.stats().hits, 1, "the most recent entry stayed");

    // On disk: a second cache (a later process) loads what the first one compiled.
    let dir = std::env::temp_dir().join(format!("kpt-xla-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = kpt_tpu::CompileCache::new(&client, usize::MAX).with_dir(&dir);
    let exe = first.get_or_compile(programs[1].as_bytes(), &opts).unwrap();
    let serializes = exe.serialize().is_ok();
    let files = std::fs::read_dir(&dir).map_or(0, |d| d.count());
    assert_eq!(files, usize::from(serializes));
    let second = kpt_tpu::CompileCache::new(&client, usize::MAX).with_dir(&dir);
    let loaded = second
        .get_or_compile(programs[1].as_bytes(), &opts)
        .unwrap();
    assert_eq!(second.stats().disk_hits, u64::from(serializes));
    let device = client.devices().unwrap().remove(0);
    let x = client
        .buffer(
            &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            &[2, 4],
            &device,
        )
        .unwrap();
    let w = client
        .buffer(
            &[1.0f32, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0],
            &[4, 2],
            &device,
        )
        .unwrap();
    let out = loaded.execute(&[&x, &w]).unwrap();
    assert_eq!(out[0].to_vec::<f32>().unwrap(), [4.0, 6.0, 12.0, 14.0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The topology holds every addressable device with the same description, and the
/// memory statistics are what the platform offers: none on XLA's CPU plugin (an
/// `UNIMPLEMENTED` error with its message), in-use within the limit elsewhere.
#[test]
fn topology_and_memory_describe_the_devices() {
    let Some(client) = common::client() else {
        return;
    };
    let platform = client.platform_name().unwrap();
    let topology = client.topology().unwrap();
    assert_eq!(topology.platform_name, platform);
    // Not always the client's version string: XLA's CUDA plugin gives the device name
    // ("NVIDIA H100 80GB HBM3") where the client says "cuda 13000".
    assert!(!topology.platform_version.is_empty(), "{topology:?}");
    let devices = client.devices().unwrap();
    assert!(topology.devices.len() >= devices.len(), "{topology:?}");
    for d in &devices {
        let desc = d.description().unwrap();
        let same = topology
            .devices
            .iter()
            .find(|t| t.id == desc.id)
            .unwrap_or_else(|| panic!("device {} is not in the topology", desc.id));
        assert_eq!(same.kind, desc.kind);
        assert_eq!(same.process_index, desc.process_index);
    }
    let has_coords = topology
        .devices
        .iter()
        .any(|d| d.attribute("coords").is_some());
    assert_eq!(topology.chip_bounds().is_some(), has_coords, "{topology:?}");
    for d in &devices {
        match (platform.as_str(), d.memory_stats()) {
            (
                "cpu",
                Err(PjrtError::Call {
                    func,
                    code,
                    message,
                }),
            ) => {
                assert_eq!(func, "PJRT_Device_MemoryStats");
                assert_eq!(code, "UNIMPLEMENTED");
                assert!(!message.is_empty());
            }
            ("cpu", other) => panic!("the CPU plugin now reports memory: {other:?}"),
            (_, Ok(m)) => {
                if let Some(limit) = m.bytes_limit {
                    assert!(m.bytes_in_use <= limit, "{m:?}");
                }
                if let Some(peak) = m.peak_bytes_in_use {
                    assert!(m.bytes_in_use <= peak, "{m:?}");
                }
            }
            (_, Err(e)) => panic!("{platform}: {e}"),
        }
    }
}

/// `XlaBackend`'s `DeviceInfo` carries the topology and says why memory is unknown
/// where the plugin keeps no statistics; a TPU gets its generation as `arch`.
#[test]
fn the_backends_device_info_describes_the_device() {
    use kpt_core::backend::Backend;
    let Some(client) = common::client() else {
        return;
    };
    let platform = client.platform_name().unwrap();
    let n = client.topology().unwrap().devices.len();
    for i in 0..client.devices().unwrap().len() {
        let b = kpt_tpu::XlaBackend::new(&client, i).unwrap();
        let info = b.device();
        let p = &info.properties;
        assert_eq!(p["topology_devices"], n.to_string(), "{info:?}");
        let desc = client.devices().unwrap()[i].description().unwrap();
        match platform.as_str() {
            "cpu" => {
                assert!(
                    p["memory_stats"].starts_with(
                        "not reported: PJRT_Device_MemoryStats failed (UNIMPLEMENTED)"
                    ),
                    "{info:?}"
                );
                assert_eq!(info.memory_bytes, None);
                assert_eq!(info.compute_units, None);
                assert_eq!(info.arch, None);
                assert!(!p.contains_key("tpu_generation"));
            }
            "tpu" => {
                let g = kpt_tpu::TpuGeneration::from_device_kind(&desc.kind);
                assert_eq!(
                    info.arch.as_deref(),
                    Some(g.map_or(desc.kind.as_str(), |g| g.name()))
                );
                assert!(info.memory_bytes.is_some() || g.is_none(), "{info:?}");
            }
            _ => assert!(p.contains_key("memory_bytes_in_use") || p.contains_key("memory_stats")),
        }
        // The backend's capacity is the device's memory where known.
        assert_eq!(b.memory_stats().total_bytes, info.memory_bytes);
    }
}
