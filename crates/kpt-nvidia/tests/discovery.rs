//! Discovery on whatever machine runs the tests: with a driver it lists devices with
//! sane properties; without one it says so with a typed error, and the detector
//! reports no devices instead of failing.

use kpt_core::hardware::HardwareDetector;
use kpt_nvidia::{devices, devices_with_telemetry, driver_present, CudaDetector, NvidiaError};

#[test]
fn discovery_reports_devices_or_a_missing_driver() {
    match devices() {
        Ok(list) => {
            assert!(driver_present());
            for d in &list {
                assert!(!d.name.is_empty());
                assert!(d.compute_capability.0 >= 3 && d.sm_count > 0 && d.memory_bytes > 0);
            }
            assert_eq!(CudaDetector.detect().unwrap().len(), list.len());
        }
        Err(NvidiaError::NoDriver) => {
            assert!(!driver_present());
            assert!(NvidiaError::NoDriver.to_string().contains("no CUDA driver"));
            assert!(CudaDetector.detect().unwrap().is_empty());
        }
        Err(e) => panic!("unexpected driver error: {e}"),
    }
}

/// NVML readings land on the CUDA ordinal with the same PCI address. Without a driver
/// both listings fail alike; with `KPT_REQUIRE_GPU=1` (the GPU bundle) every device
/// must have telemetry, since NVML ships with the driver.
#[test]
fn telemetry_is_matched_to_cuda_ordinals_by_pci_address() {
    let plain = match devices() {
        Ok(list) => list,
        Err(NvidiaError::NoDriver) => {
            assert!(matches!(
                devices_with_telemetry(),
                Err(NvidiaError::NoDriver)
            ));
            return;
        }
        Err(e) => panic!("unexpected driver error: {e}"),
    };
    let read = devices_with_telemetry().expect("the devices were just listed");
    assert_eq!(read.len(), plain.len());
    let required = std::env::var("KPT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let mut addresses = Vec::new();
    for (p, r) in plain.iter().zip(&read) {
        assert!(p.telemetry.is_none(), "devices() reads no telemetry");
        assert_eq!((p.index, p.pci, &p.name), (r.index, r.pci, &r.name));
        addresses.push(r.pci);
        let info = r.device_info();
        assert_eq!(info.properties["pci_bus_id"], r.pci.to_string());
        eprintln!(
            "cuda:{} {} at {}: {:?}",
            r.index, r.name, r.pci, r.telemetry
        );
        let Some(t) = r.telemetry else {
            assert!(
                !required,
                "no NVML telemetry for cuda:{} ({})",
                r.index, r.pci
            );
            continue;
        };
        assert!(!t.is_empty());
        if let (Some(now), Some(max)) = (t.sm_clock_mhz, t.sm_clock_max_mhz) {
            assert!(max > 0 && now <= max, "SM clock {now} of {max} MHz");
        }
        if let (Some(now), Some(max)) = (t.memory_clock_mhz, t.memory_clock_max_mhz) {
            assert!(max > 0 && now <= max, "memory clock {now} of {max} MHz");
        }
        if let Some(c) = t.temperature_c {
            assert!((1..130).contains(&c), "{c} °C");
        }
        if let (Some(draw), Some(limit)) = (t.power_draw_mw, t.power_limit_mw) {
            assert!(limit > 0 && draw < 2 * limit, "{draw} mW of {limit} mW");
        }
        for (key, value) in t.properties() {
            assert_eq!(info.properties.get(key), Some(&value), "{key}");
        }
    }
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), read.len(), "PCI addresses are distinct");
}
