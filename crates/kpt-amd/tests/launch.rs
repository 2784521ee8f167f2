//! The launchers' argument lists against the code objects kpt ships: every entry point
//! of every embedded HSACO is launched by some plan of `kpt_amd::kernels`, and each plan's
//! argument layout (offsets and sizes, C layout) equals the `.args` the compiler recorded
//! in the code object's metadata for that entry point. This is what
//! `hipModuleLaunchKernel` relies on, checked without a GPU.

use std::collections::BTreeSet;

use kpt_amd::kernels::{every_launch, Arg, Launch, Planner};
use kpt_amd::CodeObject;
use kpt_kernels::artifacts::{embedded, Artifact, Format};

fn hsaco() -> Vec<&'static Artifact> {
    embedded()
        .iter()
        .filter(|a| a.format == Format::Hsaco)
        .collect()
}

fn launches() -> Vec<Launch> {
    every_launch(&Planner { compute_units: 104 }).expect("every plan is valid")
}

#[test]
fn every_launch_matches_the_metadata_of_every_code_object_it_runs() {
    let launches = launches();
    let mut checked = 0;
    for a in hsaco() {
        let co =
            CodeObject::parse(a.bytes).unwrap_or_else(|e| panic!("{} {}: {e}", a.kernel, a.target));
        for l in launches.iter().filter(|l| l.kernel == a.kernel) {
            let k = co.kernel(&l.entry).unwrap_or_else(|| {
                panic!(
                    "{} {}: no kernel {} in the code object",
                    a.kernel, a.target, l.entry
                )
            });
            l.check_layout(k)
                .unwrap_or_else(|e| panic!("{} {}: {e}", a.kernel, a.target));
            // The argument segment the launch fills ends where the explicit arguments
            // end; hidden arguments (if any) follow.
            let end = l.layout().last().map_or(0, |&(o, s)| o + s);
            assert!(
                end <= k.kernarg_segment_size,
                "{} {}: {} bytes of arguments, segment of {}",
                a.kernel,
                a.target,
                end,
                k.kernarg_segment_size
            );
            checked += 1;
        }
    }
    // At least one launch per entry point of every code object launched from (the next
    // test says which entry point would lack one).
    let entries: usize = hsaco()
        .iter()
        .filter(|a| launches.iter().any(|l| l.kernel == a.kernel))
        .map(|a| a.entry_points.len())
        .sum();
    assert!(
        checked >= entries,
        "{checked} launches checked, {entries} entry points"
    );
}

/// Every entry point of every code object the launchers use (a source kpt launches from
/// on AMD) has a launcher; code objects of sources the backend does not launch yet are
/// not selected by the registry either.
#[test]
fn every_entry_point_of_every_code_object_has_a_launcher() {
    let launched: BTreeSet<(String, String)> = launches()
        .into_iter()
        .map(|l| (l.kernel, l.entry))
        .collect();
    let objects: BTreeSet<&str> = launched.iter().map(|(k, _)| k.as_str()).collect();
    for name in [
        "rms_norm",
        "layer_norm",
        "softmax",
        "rotary",
        "elementwise",
        "embedding",
    ] {
        assert!(objects.contains(name), "no launcher of {name}");
    }
    for name in ["attention", "quantize", "triton_rms_norm_bf16_4096"] {
        assert!(objects.contains(name), "no launcher of {name}");
    }
    for a in hsaco().into_iter().filter(|a| objects.contains(a.kernel)) {
        for e in a.entry_points {
            assert!(
                launched.contains(&(a.kernel.to_string(), e.name.to_string())),
                "{} {}: entry point {} has no launcher",
                a.kernel,
                a.target,
                e.name
            );
        }
    }
}

#[test]
fn a_wrong_argument_list_is_caught() {
    // One argument too few, a float where the kernel takes a pointer, and a double where
    // it takes an int: each differs from the metadata and is rejected.
    let a = hsaco()
        .into_iter()
        .find(|a| a.kernel == "rotary" && a.target == "gfx90a")
        .expect("rotary for gfx90a is shipped");
    let co = CodeObject::parse(a.bytes).unwrap();
    let good = launches()
        .into_iter()
        .find(|l| l.entry == "kpt_rotary_f32_i32")
        .unwrap();
    let k = co.kernel(&good.entry).unwrap();
    good.check_layout(k).unwrap();
    let mut short = good.clone();
    short.args.pop();
    let mut swapped = good.clone();
    swapped.args[7] = Arg::F32(0.0);
    let mut wide = good.clone();
    wide.args[3] = Arg::F64(4.0);
    for bad in [short, swapped, wide] {
        let e = bad.check_layout(k).unwrap_err().to_string();
        assert!(e.contains("kpt_rotary_f32_i32"), "{e}");
    }
}
