//! Every AMD code object kpt ships is a valid AMDGPU ELF for its processor, with every
//! entry point its manifest names (function symbol, kernel descriptor, metadata) and sane
//! resources: the checks that can be made without an AMD GPU.

use kpt_amd::{CodeObject, FeatureFlag, GcnArch};
use kpt_kernels::artifacts::{embedded, Artifact, Format};

fn hsaco() -> Vec<&'static Artifact> {
    embedded()
        .iter()
        .filter(|a| a.format == Format::Hsaco)
        .collect()
}

#[test]
fn every_code_object_is_valid_for_its_processor() {
    let all = hsaco();
    assert!(!all.is_empty(), "no HSACO artifact is embedded");
    for a in all {
        let what = format!("{} {}", a.kernel, a.target);
        let co = CodeObject::parse(a.bytes).unwrap_or_else(|e| panic!("{what}: {e}"));
        let arch = GcnArch::parse(a.target).unwrap();
        assert_eq!(co.processor, a.target, "{what}: e_flags");
        // hipcc 5.2 writes code object v4; clang 19 (gfx942 and gfx1100 of the shared
        // sources) and Triton 3.6 write v5.
        let version = if a.source.starts_with("kernels/triton/")
            || matches!(a.target, "gfx942" | "gfx1100")
        {
            5
        } else {
            4
        };
        assert_eq!(co.code_object_version, version, "{what}");
        assert_eq!(co.metadata_version.first(), Some(&1), "{what}");
        assert_eq!(
            co.target.as_deref(),
            Some(format!("amdgcn-amd-amdhsa--{}", a.target).as_str()),
            "{what}"
        );
        // xnack and sramecc: built for either setting where the processor has them.
        let (xnack, sramecc) = match a.target {
            "gfx90a" | "gfx940" | "gfx942" => (FeatureFlag::Any, FeatureFlag::Any),
            "gfx1030" | "gfx1100" => (FeatureFlag::Unsupported, FeatureFlag::Unsupported),
            other => panic!("unexpected target {other}"),
        };
        assert_eq!((co.xnack, co.sramecc), (xnack, sramecc), "{what}");
        let entries: Vec<(&str, u32, u32)> = a
            .entry_points
            .iter()
            .map(|e| (e.name, e.block, e.shared_bytes))
            .collect();
        co.check(
            a.target,
            arch.wave_size(),
            arch.lds_bytes_per_workgroup(),
            &entries,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        // Every kernel in the object is one the manifest lists: nothing unaccounted for.
        for k in &co.kernels {
            assert!(
                a.entry_points.iter().any(|e| e.name == k.name),
                "{what}: kernel {} is not in the manifest",
                k.name
            );
        }
    }
}

#[test]
fn the_shared_row_kernels_are_built_for_every_amd_target() {
    for kernel in [
        "rms_norm",
        "layer_norm",
        "softmax",
        "rotary",
        "elementwise",
        "embedding",
        "attention",
        "quantize",
    ] {
        let targets: Vec<_> = hsaco()
            .into_iter()
            .filter(|a| a.kernel == kernel)
            .map(|a| a.target)
            .collect();
        // hipcc 5.2 builds the first three, clang 19 MI300X's and RDNA 3's.
        assert_eq!(
            targets,
            ["gfx90a", "gfx940", "gfx1030", "gfx942", "gfx1100"],
            "{kernel}"
        );
        // The AMD build has the same entry points as the CUDA one: same source.
        let cuda = embedded()
            .iter()
            .find(|a| a.kernel == kernel && a.format == Format::Cubin)
            .unwrap_or_else(|| panic!("{kernel}: no cubin"));
        for amd in hsaco().into_iter().filter(|a| a.kernel == kernel) {
            assert_eq!(cuda.entry_points, amd.entry_points, "{kernel}");
            assert_eq!(
                amd.source,
                format!("kernels/hip/{kernel}.hip"),
                "{kernel}: source"
            );
        }
    }
}

#[test]
fn mi300_and_rdna3_objects_of_the_shared_sources_come_from_clang_19() {
    // The compiler's `llvm.ident` stays in the object's `.comment`: clang 19 built the
    // gfx942 and gfx1100 objects of `kernels/hip`, hipcc 5.2's clang 15 the others.
    let has = |bytes: &[u8], text: &str| bytes.windows(text.len()).any(|w| w == text.as_bytes());
    let shared: Vec<_> = hsaco()
        .into_iter()
        .filter(|a| a.source.starts_with("kernels/hip/"))
        .collect();
    assert_eq!(shared.len(), 8 * 5);
    for a in shared {
        let what = format!("{} {}", a.kernel, a.target);
        let clang19 = matches!(a.target, "gfx942" | "gfx1100");
        assert_eq!(has(a.bytes, "clang version 19.1.7"), clang19, "{what}");
        assert_eq!(has(a.bytes, "clang version 15.0.6"), !clang19, "{what}");
    }
}

#[test]
fn metadata_shows_the_wave_size_and_launch_bounds() {
    let get = |kernel: &str, target: &str, entry: &str| {
        let a = hsaco()
            .into_iter()
            .find(|a| a.kernel == kernel && a.target == target)
            .unwrap_or_else(|| panic!("no {kernel} {target}"));
        CodeObject::parse(a.bytes)
            .unwrap()
            .kernel(entry)
            .cloned()
            .unwrap_or_else(|| panic!("no {entry}"))
    };
    // CDNA builds are wave64, RDNA builds wave32, from one source.
    let cdna = get("rms_norm", "gfx90a", "kpt_rms_norm_f32");
    let rdna = get("rms_norm", "gfx1030", "kpt_rms_norm_f32");
    let mi300 = get("rms_norm", "gfx942", "kpt_rms_norm_f32");
    let rdna3 = get("rms_norm", "gfx1100", "kpt_rms_norm_f32");
    assert_eq!((cdna.wavefront_size, rdna.wavefront_size), (64, 32));
    assert_eq!((mi300.wavefront_size, rdna3.wavefront_size), (64, 32));
    // `__launch_bounds__(kBlock)` reaches the metadata as the largest workgroup.
    let sm = get("softmax", "gfx90a", "kpt_softmax_bf16");
    assert!(sm.max_flat_workgroup_size <= 1024 && sm.max_flat_workgroup_size >= 128);
    // block_sum's partials are the f32 kernel's only static LDS: one float per 32-lane
    // group of its 128-thread block, on wave64 and wave32 alike.
    let block = embedded()
        .iter()
        .find(|a| a.kernel == "rms_norm" && a.target == "gfx90a")
        .and_then(|a| a.entry_points.iter().find(|e| e.name == "kpt_rms_norm_f32"))
        .unwrap()
        .block;
    for k in [&cdna, &rdna, &mi300, &rdna3] {
        assert_eq!(k.max_flat_workgroup_size, block);
        assert_eq!(k.group_segment_fixed_size, block / 32 * 4);
    }
    // gfx90a and gfx942 report AGPRs separately (unified register file); RDNA has none.
    assert!(cdna.agpr_count.is_some());
    assert!(mi300.agpr_count.is_some());
}

#[test]
fn attention_keeps_its_query_tile_in_static_lds() {
    // kWarps = 4 warps of 32 lanes, each with a query row of up to 256 f32 in LDS: 4 KiB,
    // the same on wave64 and wave32 (one CUDA warp is 32 lanes of a wave).
    for target in ["gfx90a", "gfx940", "gfx1030", "gfx942", "gfx1100"] {
        let a = hsaco()
            .into_iter()
            .find(|a| a.kernel == "attention" && a.target == target)
            .unwrap_or_else(|| panic!("no attention for {target}"));
        let co = CodeObject::parse(a.bytes).unwrap();
        for name in [
            "kpt_attention_f32",
            "kpt_attention_bf16",
            "kpt_attention_f16",
        ] {
            let k = co.kernel(name).unwrap();
            assert_eq!(k.group_segment_fixed_size, 4 * 256 * 4, "{target} {name}");
            assert_eq!(k.max_flat_workgroup_size, 128, "{target} {name}");
        }
    }
}

#[test]
fn triton_norms_are_built_for_mi200_mi300_and_rdna3() {
    let targets = |kernel: &str| -> Vec<(&str, u32)> {
        hsaco()
            .into_iter()
            .filter(|a| a.kernel == kernel)
            .map(|a| (a.target, a.entry_points[0].block))
            .collect()
    };
    // 8 waves per program: 512 threads on wave64 CDNA, 256 on wave32 RDNA 3.
    assert_eq!(
        targets("triton_rms_norm_bf16_4096"),
        [("gfx90a", 512), ("gfx942", 512), ("gfx1100", 256)]
    );
    let a = hsaco()
        .into_iter()
        .find(|a| a.kernel == "triton_add_rms_norm_f16_8192" && a.target == "gfx942")
        .unwrap();
    let co = CodeObject::parse(a.bytes).unwrap();
    let k = co.kernel("kpt_add_rms_norm").unwrap();
    assert_eq!(k.wavefront_size, 64);
    assert_eq!(k.max_flat_workgroup_size, a.entry_points[0].block);
    // Triton's reduction scratch is dynamic LDS, given at launch.
    assert_eq!(k.group_segment_fixed_size, 0);
    assert!(a.entry_points[0].shared_bytes > 0);
}

#[test]
fn a_corrupted_code_object_is_rejected_with_a_reason() {
    let a = hsaco()[0];
    let mut bytes = a.bytes.to_vec();
    // EF_AMDGPU_MACH (low byte of e_flags at offset 48) set to an unknown processor.
    bytes[48] = 0x01;
    let err = CodeObject::parse(&bytes).unwrap_err();
    assert!(err.to_string().contains("EF_AMDGPU_MACH 0x1"), "{err}");
    // The HSA OS/ABI byte.
    let mut bytes = a.bytes.to_vec();
    bytes[7] = 0;
    let err = CodeObject::parse(&bytes).unwrap_err();
    assert!(err.to_string().contains("OS/ABI"), "{err}");
    // A truncated file.
    assert!(CodeObject::parse(&a.bytes[..200]).is_err());
    // The check names a missing entry point and a wrong processor.
    let co = CodeObject::parse(a.bytes).unwrap();
    let err = co
        .check("gfx942", 64, 65536, &[("kpt_no_such_kernel", 256, 0)])
        .unwrap_err();
    let m = err.to_string();
    assert!(m.contains("not gfx942"), "{m}");
    assert!(m.contains("no symbol kpt_no_such_kernel"), "{m}");
    assert!(
        m.contains("no kernel descriptor kpt_no_such_kernel.kd"),
        "{m}"
    );
}
