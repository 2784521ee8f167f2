//! The HIP runtime as this machine has it: absent (the typed error, no panic), or
//! present (ROCm's libamdhip64, with or without a GPU), in which case kpt must read its
//! version, pick the `hipDeviceProp_t` layout of that version and list its devices
//! (none without a GPU) without an error.

use std::path::PathBuf;

use kpt_amd::sys::PropsLayout;
use kpt_amd::{devices_of, AmdError, AmdGpu, HipRuntime, RocmDetector};
use kpt_core::hardware::HardwareDetector;

#[test]
fn the_runtime_of_this_machine_is_understood_or_reported_missing() {
    match HipRuntime::global() {
        Err(AmdError::NoRuntime { reason, .. }) => {
            assert!(!reason.is_empty());
            assert_eq!(RocmDetector.detect().unwrap(), Vec::new());
        }
        Err(e) => panic!("the HIP runtime loads but kpt cannot use it: {e}"),
        Ok(rt) => {
            let v = rt.version().expect("hipRuntimeGetVersion");
            assert!(v.major >= 5, "{v}");
            let layout = rt
                .props_layout()
                .expect("no hipGetDeviceProperties* kpt knows");
            assert_eq!(layout == PropsLayout::R0600, v.major >= 6, "{v} {layout:?}");
            let found = devices_of(rt).unwrap();
            assert_eq!(RocmDetector.detect().unwrap().len(), found.len());
            for d in found {
                assert_eq!(d.runtime_version, Some(v));
                assert_eq!(d.arch.wave_size(), d.properties.warp_size, "{}", d.arch);
            }
        }
    }
}

#[test]
fn an_explicit_library_that_is_not_there_is_no_runtime() {
    let err =
        HipRuntime::load_first(&[PathBuf::from("/opt/nowhere/libamdhip64.so.6")]).unwrap_err();
    assert!(
        matches!(&err, AmdError::NoRuntime { reason, .. } if reason.contains("/opt/nowhere")),
        "{err:?}"
    );
    let k: kpt_core::KptError = err.into();
    assert!(k.to_string().contains("no ROCm runtime found ("), "{k}");
}

/// Opening a device, memory, copies and module loading: typed errors where there is no
/// runtime or no device (this machine), a round trip and a loaded kernel where there is.
#[test]
fn devices_open_or_say_why_not() {
    let rt = match HipRuntime::global() {
        Ok(rt) => rt,
        Err(e) => {
            assert!(matches!(e, AmdError::NoRuntime { .. }), "{e}");
            assert!(matches!(AmdGpu::new(0), Err(AmdError::NoRuntime { .. })));
            return;
        }
    };
    let found = devices_of(rt).unwrap();
    if found.is_empty() {
        match AmdGpu::new(0) {
            Err(AmdError::NoDevice { index: 0, found: 0 }) => {}
            other => panic!("expected NoDevice, got {other:?}"),
        }
        // Every call the device path makes fails with the runtime's error code, typed.
        for err in [
            rt.malloc(1024).map(|_| ()).unwrap_err(),
            rt.mem_get_info().map(|_| ()).unwrap_err(),
            rt.stream_create().map(|_| ()).unwrap_err(),
            rt.set_device(0).unwrap_err(),
        ] {
            assert!(matches!(err, AmdError::Hip { .. }), "{err:?}");
        }
        let image = kpt_kernels::artifacts::embedded()
            .iter()
            .find(|a| a.format == kpt_kernels::artifacts::Format::Hsaco)
            .unwrap();
        assert!(matches!(
            rt.module_load(image.bytes),
            Err(AmdError::Hip {
                call: "hipModuleLoadData",
                ..
            })
        ));
        assert!(matches!(
            rt.module_load(b"not elf"),
            Err(AmdError::CodeObject(_))
        ));
        return;
    }
    // A machine with an AMD GPU: a round trip through device memory, and the kernels
    // built for its processor load.
    let gpu = AmdGpu::new(0).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let block = gpu.upload(&data).unwrap();
    let mut back = vec![0u8; data.len()];
    gpu.download(&block, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(gpu.memory_statistics().allocated_bytes >= data.len() as u64);
    let processor = gpu.device().arch.processor().to_string();
    if !kpt_kernels::artifacts::hsaco_candidates("rms_norm", &processor).is_empty() {
        let (_, block, _) = gpu.function("rms_norm", "kpt_rms_norm_f32").unwrap();
        assert!(block > 0);
    }
}
