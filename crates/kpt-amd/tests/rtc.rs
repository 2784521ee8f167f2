//! Run-time compilation of kpt's HIP kernels with the hiprtc of this machine's ROCm (when
//! it has one), and the compile cache: the code object hiprtc writes passes the same
//! checks as the shipped ones, a second request is a hit, a new cache on the same
//! directory reads it back, and a processor the compiler does not know is a typed
//! error with the compiler's log.

use kpt_amd::{AmdError, CodeObject, CompileCache, GcnArch, HipRuntime, Hiprtc};
use kpt_kernels::artifacts::{embedded, Format};

fn rtc() -> Option<&'static Hiprtc> {
    match Hiprtc::global() {
        Ok(r) => Some(r),
        Err(AmdError::NoRuntime { .. }) => None,
        Err(e) => panic!("hiprtc is there but unusable: {e}"),
    }
}

/// The manifest's entry points of `kernel`'s hipcc build: (name, block, dynamic LDS).
fn entry_points(kernel: &str) -> Vec<(&'static str, u32, u32)> {
    embedded()
        .iter()
        .find(|a| {
            a.kernel == kernel && a.format == Format::Hsaco && a.source.starts_with("kernels/hip/")
        })
        .unwrap_or_else(|| panic!("no hipcc build of {kernel}"))
        .entry_points
        .iter()
        .map(|e| (e.name, e.block, e.shared_bytes))
        .collect()
}

#[test]
fn hiprtc_builds_checked_code_objects_and_the_cache_keeps_them() {
    let Some(rtc) = rtc() else {
        assert!(HipRuntime::global().is_err());
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cache = CompileCache::new(Some(dir.path().to_path_buf()));
    let code = cache.code_object(rtc, "rms_norm", "gfx90a").unwrap();
    let arch = GcnArch::parse("gfx90a").unwrap();
    CodeObject::parse(&code)
        .unwrap()
        .check(
            "gfx90a",
            arch.wave_size(),
            arch.lds_bytes_per_workgroup(),
            &entry_points("rms_norm"),
        )
        .unwrap();
    assert_eq!(cache.stats().misses, 1);
    let again = cache.code_object(rtc, "rms_norm", "gfx90a").unwrap();
    assert!(std::sync::Arc::ptr_eq(&code, &again));
    assert_eq!(cache.stats().hits, 1);
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(files.len(), 1, "one code object on disk");
    // Another process (a new cache) reads it back instead of compiling.
    let reopened = CompileCache::new(Some(dir.path().to_path_buf()));
    assert_eq!(
        *reopened.code_object(rtc, "rms_norm", "gfx90a").unwrap(),
        *code
    );
    assert_eq!(reopened.stats().disk_hits, 1);
    assert_eq!(reopened.stats().misses, 0);
    // A corrupted file is compiled again, not loaded.
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::write(&file, b"garbage").unwrap();
    let fresh = CompileCache::new(Some(dir.path().to_path_buf()));
    fresh.code_object(rtc, "rms_norm", "gfx90a").unwrap();
    assert_eq!((fresh.stats().disk_hits, fresh.stats().misses), (0, 1));
    // A syntax error is the compiler's log, typed.
    match rtc.compile(
        "extern \"C\" __global__ void k( {",
        "broken.hip",
        &CompileCache::options("gfx90a"),
    ) {
        Err(AmdError::Compile { kernel, log, .. }) => {
            assert_eq!(kernel, "broken.hip");
            assert!(log.contains("error"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    // An unknown kernel is an error, not a compile.
    assert!(matches!(
        cache.code_object(rtc, "no_such_kernel", "gfx90a"),
        Err(AmdError::Invalid(_))
    ));
}

#[test]
fn mi300x_kernels_compile_where_the_compiler_knows_gfx942() {
    let Some(rtc) = rtc() else { return };
    let rocm = HipRuntime::global().unwrap().version().unwrap();
    let cache = CompileCache::new(None);
    let result = cache.code_object(rtc, "softmax", "gfx942");
    if rocm.major < 6 {
        // ROCm 5.2's compiler (Debian 12) has no gfx942, and its hiprtc would abort the
        // process if asked: kpt refuses first.
        match result {
            Err(AmdError::Unsupported {
                processor, needs, ..
            }) => {
                assert_eq!(processor, "gfx942");
                assert_eq!(needs, "ROCm 6.0 or later");
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    } else {
        let code = result.unwrap();
        CodeObject::parse(&code)
            .unwrap()
            .check("gfx942", 64, 65536, &entry_points("softmax"))
            .unwrap();
    }
}

/// kpt-amd's own run-time kernel, the FP8 OCP -> FNUZ conversion of the MI300 FP8 path:
/// hiprtc builds it (here for gfx90a, the newest processor ROCm 5.2 knows; on a machine
/// with ROCm 6 for gfx942 as well), it passes the shipped objects' checks, and its
/// arguments are where `fp8::plan` puts them.
#[test]
fn hiprtc_builds_the_fp8_conversion_with_the_launchers_layout() {
    let Some(rtc) = rtc() else { return };
    let cache = CompileCache::new(None);
    let planner = kpt_amd::kernels::Planner { compute_units: 104 };
    for processor in ["gfx90a", "gfx942"] {
        let built =
            cache.code_object_of_source(rtc, kpt_amd::fp8::KERNEL, kpt_amd::fp8::SOURCE, processor);
        let code = match built {
            Ok(code) => code,
            // ROCm 5.2 does not know gfx942: refused before hiprtc is called.
            Err(AmdError::Unsupported { .. }) if processor == "gfx942" => continue,
            Err(e) => panic!("{processor}: {e}"),
        };
        let arch = GcnArch::parse(processor).unwrap();
        let entries: Vec<_> = kpt_amd::fp8::ENTRY_POINTS
            .iter()
            .map(|e| (e.name, e.block, e.shared_bytes))
            .collect();
        let co = CodeObject::parse(&code).unwrap();
        co.check(
            processor,
            arch.wave_size(),
            arch.lds_bytes_per_workgroup(),
            &entries,
        )
        .unwrap();
        for dtype in [kpt_core::DType::F8E4M3, kpt_core::DType::F8E5M2] {
            let l = kpt_amd::fp8::plan(&planner, dtype, [256, 512], 1000).unwrap();
            l.check_layout(co.kernel(&l.entry).unwrap()).unwrap();
        }
    }
}
