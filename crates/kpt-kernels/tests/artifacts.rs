//! The embedded GPU artifacts match the committed manifest, are well-formed cubins and
//! PTX with their entry points, and the per-device choice follows CUDA's compatibility
//! rules.

use kpt_kernels::artifacts::manifest::Manifest;
use kpt_kernels::artifacts::{
    cuda_candidates, embedded, hsaco_candidates, hsaco_targets, select_cuda, Format,
};
use sha2::Digest;

fn manifest() -> Manifest {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/artifacts/manifest.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn embedded_artifacts_are_the_manifest() {
    let m = manifest();
    let listed: Vec<_> = m
        .kernels
        .iter()
        .flat_map(|k| k.artifacts.iter().map(move |a| (k.name.as_str(), a)))
        .collect();
    assert_eq!(listed.len(), embedded().len());
    assert!(!listed.is_empty(), "the manifest lists no artifact");
    for (kernel, a) in listed {
        let e = embedded()
            .iter()
            .find(|e| e.kernel == kernel && e.target == a.target)
            .unwrap_or_else(|| panic!("{} not embedded", a.path));
        let digest: String = sha2::Sha256::digest(e.bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            digest, a.sha256,
            "{}: bytes differ from the manifest",
            a.path
        );
        assert!(e.toolchain.contains("nvcc "), "{}", e.toolchain);
        if e.format == Format::Hsaco {
            assert!(e.toolchain.contains("hipcc "), "{}", e.toolchain);
        }
    }
}

#[test]
fn artifacts_are_well_formed_with_their_entry_points() {
    for a in embedded() {
        assert!(!a.entry_points.is_empty());
        match a.format {
            Format::Cubin | Format::Hsaco => {
                assert_eq!(&a.bytes[..4], b"\x7fELF", "{} {}", a.kernel, a.target)
            }
            Format::Ptx => {
                let text = std::str::from_utf8(a.bytes).unwrap();
                // CUDA 13.0 drivers JIT PTX up to ISA 9.0 (nvcc 13.0 writes 9.0,
                // Triton 3.6 8.7).
                let isa = text
                    .lines()
                    .find_map(|l| l.trim().strip_prefix(".version "))
                    .and_then(|v| v.split_once('.'))
                    .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)))
                    .unwrap_or_else(|| panic!("{}: no PTX .version", a.kernel));
                assert!(isa <= (9u32, 0u32), "{}: PTX ISA {isa:?} > 9.0", a.kernel);
                assert!(text.contains(&format!(".target {}", a.target.replace("compute", "sm"))));
            }
        }
        for ep in a.entry_points {
            let name = ep.name.as_bytes();
            assert!(
                a.bytes.windows(name.len()).any(|w| w == name),
                "{} {}: no symbol {}",
                a.kernel,
                a.target,
                ep.name
            );
            assert!(ep.block > 0 && ep.block <= 1024 && !ep.grid.is_empty());
        }
    }
}

#[test]
fn selection_prefers_exact_cubins_then_ptx() {
    let pick = |major, minor| select_cuda("rms_norm", major, minor).map(|a| a.target);
    assert_eq!(pick(9, 0), Some("sm_90a")); // H100, H200
    assert_eq!(pick(8, 0), Some("sm_80")); // A100
    assert_eq!(pick(8, 9), Some("sm_80")); // L4, RTX 40xx: sm_80 cubins run on 8.x
    assert_eq!(pick(10, 0), Some("compute_80")); // Blackwell: JIT from PTX
    assert_eq!(pick(12, 0), Some("compute_80"));
    assert_eq!(pick(7, 5), None); // Turing: nothing fits, fall back
    assert_eq!(select_cuda("no_such_kernel", 9, 0).map(|a| a.target), None);
}

#[test]
fn candidates_go_from_cubins_to_ptx() {
    let targets = |major, minor| -> Vec<_> {
        cuda_candidates("rms_norm", major, minor)
            .iter()
            .map(|a| a.target)
            .collect()
    };
    assert_eq!(targets(9, 0), ["sm_90a", "compute_80"]);
    assert_eq!(targets(8, 6), ["sm_80", "compute_80"]);
    assert!(targets(7, 5).is_empty());
}

#[test]
fn ptx_is_at_an_isa_cuda_12_drivers_jit() {
    // PTX ISA 8.0 is what CUDA 12.0 drivers accept; build-kernels lowers nvcc 13's 9.0
    // and checks the result with the CUDA 12.0 assembler.
    let ptx: Vec<_> = embedded()
        .iter()
        .filter(|a| a.format == Format::Ptx)
        .collect();
    assert!(!ptx.is_empty());
    for a in ptx {
        let text = std::str::from_utf8(a.bytes).unwrap();
        let version = text
            .lines()
            .find_map(|l| l.trim().strip_prefix(".version "))
            .unwrap_or_else(|| panic!("{} {}: no .version", a.kernel, a.target));
        assert_eq!(version.trim(), "8.0", "{} {}", a.kernel, a.target);
    }
}

#[test]
fn only_cuda_kernels_built_for_sm90_wait_for_their_producer() {
    let waits = |kernel: &str, target: &str| {
        embedded()
            .iter()
            .find(|a| a.kernel == kernel && a.target == target)
            .unwrap_or_else(|| panic!("no {kernel} {target}"))
            .waits_for_producer()
    };
    assert!(waits("rms_norm", "sm_90a"));
    assert!(waits("gemv", "sm_90a"));
    assert!(!waits("rms_norm", "sm_80"));
    // PTX for compute_80 was compiled without the wait, also when JIT-compiled for 9.0.
    assert!(!waits("rms_norm", "compute_80"));
    for a in embedded()
        .iter()
        .filter(|a| a.source.starts_with("kernels/triton/"))
    {
        assert!(!a.waits_for_producer(), "{} {}", a.kernel, a.target);
    }
}

#[test]
fn ptx_artifacts_have_no_grid_dependency_control() {
    // `griddepcontrol` needs sm_90; the compute_80 PTX must run without it.
    for a in embedded().iter().filter(|a| a.format == Format::Ptx) {
        let text = std::str::from_utf8(a.bytes).unwrap();
        assert!(
            !text.contains("griddepcontrol"),
            "{} {}",
            a.kernel,
            a.target
        );
    }
}

#[test]
fn every_cuda_entry_point_waits_for_its_producer_first() {
    // Kernels launched with programmatic stream serialization may start before the
    // previous kernel finished: each must wait before it touches global memory.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels/cuda");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (at, _) in text.match_indices("extern \"C\" __global__") {
            let body = &text[at..];
            let open = body.find('{').unwrap();
            let first = body[open + 1..]
                .split(';')
                .next()
                .unwrap()
                .replace(['\\', '\n', ' '], "");
            // The GEMV entries wait inside, after issuing loads of weights that no kernel
            // writes (`GemvDims::preload`); nothing else is read before the wait.
            let gemv = path.ends_with("gemv.cu")
                && ["gemv<", "gemv_tc<"].iter().any(|f| first.starts_with(f));
            assert!(
                first == "kpt::dependent_launch_prologue()" || gemv,
                "{}: an entry point does not start with the prologue: {}",
                path.display(),
                &body[..open]
            );
            checked += 1;
        }
    }
    assert!(checked >= 36, "only {checked} entry points found");
}

#[test]
fn amd_code_objects_are_chosen_by_exact_processor() {
    let pick = |p: &str| -> Vec<_> {
        hsaco_candidates("rms_norm", p)
            .iter()
            .map(|a| (a.target, a.format, a.source))
            .collect()
    };
    assert_eq!(
        pick("gfx90a"),
        [("gfx90a", Format::Hsaco, "kernels/hip/rms_norm.hip")]
    );
    assert_eq!(pick("gfx1030").len(), 1);
    // gfx940 code does not load on gfx942 (MI300X), nor gfx1030 code on gfx1100: each
    // gets the code object built for it.
    for p in ["gfx942", "gfx1100"] {
        assert_eq!(pick(p), [(p, Format::Hsaco, "kernels/hip/rms_norm.hip")]);
    }
    // No code object for RDNA 3's gfx1101 or MI200's gfx908.
    assert!(pick("gfx1101").is_empty());
    assert!(pick("gfx908").is_empty());
    assert!(pick("sm_90a").is_empty());
    assert_eq!(
        hsaco_targets("rms_norm"),
        ["gfx90a", "gfx940", "gfx1030", "gfx942", "gfx1100"]
    );
    // CUDA selection never hands out an AMD code object, nor AMD selection a cubin.
    for a in cuda_candidates("rms_norm", 9, 0) {
        assert_ne!(a.format, Format::Hsaco);
    }
    assert!(!embedded()
        .iter()
        .any(|a| a.format == Format::Hsaco && a.runs_on(9, 0)));
}
