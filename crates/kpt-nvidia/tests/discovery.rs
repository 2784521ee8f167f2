//! Discovery on whatever machine runs the tests: with a driver it lists devices with
//! sane properties; without one it says so with a typed error, and the detector
//! reports no devices instead of failing.

use kpt_core::hardware::HardwareDetector;
use kpt_nvidia::{devices, driver_present, CudaDetector, NvidiaError};

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
