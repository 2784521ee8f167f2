//! The HIP runtime as this machine has it: absent (the typed error, no panic), or
//! present (ROCm's libamdhip64, with or without a GPU), in which case kpt must read its
//! version, pick the `hipDeviceProp_t` layout of that version and list its devices
//! (none without a GPU) without an error.

use std::path::PathBuf;

use kpt_amd::sys::PropsLayout;
use kpt_amd::{devices_of, AmdError, HipRuntime, RocmDetector};
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
