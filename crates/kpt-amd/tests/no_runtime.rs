//! A machine without ROCm: with `KPT_HIP_LIBRARY` and `KPT_ROCBLAS_LIBRARY` pointing at
//! nothing (set before anything in this process loads a library), opening the backend is
//! the typed "no ROCm runtime found" error and rocBLAS is "no rocBLAS found", never a
//! panic. A test binary of its own: the libraries are loaded once per process.

use kpt_amd::{AmdError, Rocblas, RocmBackend, RocmOptions, LIBRARY_ENV, ROCBLAS_ENV};
use kpt_core::hardware::HardwareDetector;

#[test]
fn without_libraries_every_entry_point_is_a_typed_error() {
    std::env::set_var(LIBRARY_ENV, "/nonexistent/libamdhip64.so");
    std::env::set_var(ROCBLAS_ENV, "/nonexistent/librocblas.so");
    let e = RocmBackend::new(0, RocmOptions::default()).unwrap_err();
    assert!(matches!(e, AmdError::NoRuntime { .. }), "{e:?}");
    let m = e.to_string();
    assert!(m.starts_with("no ROCm runtime found ("), "{m}");
    assert!(m.contains("/nonexistent/libamdhip64.so"), "{m}");
    let k: kpt_core::KptError = e.into();
    assert!(k.to_string().contains("no ROCm runtime found"), "{k}");
    // Detection reports no device rather than failing.
    assert_eq!(kpt_amd::RocmDetector.detect().unwrap(), Vec::new());
    let e = Rocblas::global().unwrap_err();
    assert!(
        matches!(
            e,
            AmdError::NoLibrary {
                library: "rocBLAS",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("/nonexistent/librocblas.so"), "{e}");
    assert!(!kpt_amd::rocblas_present());
}
