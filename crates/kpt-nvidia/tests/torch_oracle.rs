//! kpt's attention against PyTorch on the same inputs: each variant (full and causal,
//! head dims 64 to 256, GQA and MQA, an additive mask, a sliding window, a softmax scale
//! of the caller's, a cache longer than the queries, decode, a paged cache, a
//! variable-length batch, FP8 inputs, the backward pass) runs on the kernel the registry
//! picks for the CUDA device, and on `F.scaled_dot_product_attention` through
//! `benches/torch_attention_oracle.py`; both are held to twice the per-output tolerance
//! they each have against the f64 reference. Besides the fixed cases, seeded random ones
//! draw odd lengths, caches longer than the queries, group ratios, head dims, masks,
//! windows and scales.
//!
//! Needs a CUDA device and a Python with torch on CUDA (`KPT_TORCH_PYTHON`, default
//! `python3`; the script from `KPT_TORCH_ORACLE_SCRIPT`, default the source tree's);
//! skipped with a note otherwise, an error with `KPT_REQUIRE_TORCH=1`.
//! `KPT_TORCH_ORACLE_CPU=1` runs the same cases on kpt's CPU backend against torch on the
//! CPU instead.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{attention_mask, random};
use kpt_core::backend::{run_op, Backend};
use kpt_core::graph::{AttentionParams, Op, TensorSpec};
use kpt_core::rand::SplitMix64;
use kpt_core::tensor::Tensor;
use kpt_core::validate::{compare, output_tolerance, Tolerance};
use kpt_core::DType;
use kpt_kernels::{CpuBackend, KernelRegistry};
use kpt_nvidia::{CudaBackend, CudaOptions};
use serde_json::{json, Value};

/// One variant: the op, its inputs (named as the oracle reads them) and the oracle's
/// description of it; `torch` replaces the inputs on torch's side where kpt's layout is
/// not one torch takes (a paged cache, gathered).
struct Case {
    name: String,
    op: Op,
    inputs: Vec<(&'static str, Tensor)>,
    torch: Option<Vec<(&'static str, Tensor)>>,
    oracle: Value,
}

/// Sizes of one case: batch, queries, keys, query heads, kv heads, head dim.
struct Dims {
    b: usize,
    s: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
}

/// A dense forward (`backward` false) or backward case.
#[allow(clippy::too_many_arguments)]
fn case(
    name: &str,
    dt: DType,
    dims: Dims,
    causal: bool,
    window: Option<usize>,
    with_mask: bool,
    backward: bool,
    seed: u64,
) -> Case {
    let p = AttentionParams {
        window,
        mask: with_mask,
        ..AttentionParams::new(dims.h, dims.hkv, dims.d, causal)
    };
    case_with(name, dt, dims, p, backward, seed)
}

/// [`case`] with the attention's parameters given.
fn case_with(
    name: &str,
    dt: DType,
    Dims { b, s, t, h, hkv, d }: Dims,
    p: AttentionParams,
    backward: bool,
    seed: u64,
) -> Case {
    let mut rng = SplitMix64::new(seed);
    let (causal, window, with_mask) = (p.causal, p.window, p.mask);
    let mut inputs = vec![
        ("q", random(&mut rng, &[b, s, h * d], dt, -2.0, 2.0)),
        ("k", random(&mut rng, &[b, t, hkv * d], dt, -2.0, 2.0)),
        ("v", random(&mut rng, &[b, t, hkv * d], dt, -2.0, 2.0)),
    ];
    let kind = if backward {
        // The forward output is an input of the op; torch recomputes it, kpt's backward
        // reads it for D = rowsum(dout o out): give kpt the f64 reference's.
        let mut forward: Vec<Tensor> = inputs.iter().map(|(_, t)| t.clone()).collect();
        let m = with_mask.then(|| attention_mask(&mut rng, s, t));
        forward.extend(m.clone());
        let out = kpt_core::validate::ReferenceOps::eval(
            &kpt_kernels::CpuReference,
            &Op::Attention(p),
            &forward,
        )
        .unwrap()
        .remove(0)
        .to_dtype(dt)
        .unwrap();
        inputs.push(("out", out));
        inputs.push(("dout", random(&mut rng, &[b, s, h * d], dt, -2.0, 2.0)));
        inputs.extend(m.map(|m| ("mask", m)));
        "backward"
    } else {
        inputs.extend(with_mask.then(|| ("mask", attention_mask(&mut rng, s, t))));
        "forward"
    };
    let op = if backward {
        Op::AttentionBackward(p)
    } else {
        Op::Attention(p)
    };
    Case {
        name: name.into(),
        op,
        inputs,
        torch: None,
        oracle: json!({"kind": kind, "causal": causal, "window": window,
                       "heads": h, "kv_heads": hkv, "head_dim": d,
                       "scale": p.effective_scale(), "dtype": dtype_name(dt)}),
    }
}

fn dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F8E4M3 => "fp8",
        _ => "f32",
    }
}

/// The variants, for one float dtype of the backend (`bf16` and `f16` on CUDA, `f32` on
/// the CPU).
fn cases(dts: &[DType]) -> Vec<Case> {
    let dense = |b, s, t, h, hkv, d| Dims { b, s, t, h, hkv, d };
    let mut out = Vec::new();
    for (n, &dt) in dts.iter().enumerate() {
        let seed = 100 * n as u64;
        let tag = dtype_name(dt);
        out.extend([
            case(
                &format!("full_d128_{tag}"),
                dt,
                dense(2, 67, 67, 4, 4, 128),
                false,
                None,
                false,
                false,
                seed + 1,
            ),
            case(
                &format!("causal_d128_{tag}"),
                dt,
                dense(1, 130, 130, 4, 4, 128),
                true,
                None,
                false,
                false,
                seed + 2,
            ),
            case(
                &format!("gqa_causal_cache_d64_{tag}"),
                dt,
                dense(2, 50, 90, 8, 2, 64),
                true,
                None,
                false,
                false,
                seed + 3,
            ),
            case(
                &format!("mask_d64_{tag}"),
                dt,
                dense(1, 33, 77, 4, 2, 64),
                false,
                None,
                true,
                false,
                seed + 4,
            ),
            case(
                &format!("window_d128_{tag}"),
                dt,
                dense(1, 100, 100, 2, 2, 128),
                true,
                Some(20),
                false,
                false,
                seed + 5,
            ),
            case(
                &format!("decode_d128_{tag}"),
                dt,
                dense(4, 1, 1000, 32, 8, 128),
                false,
                None,
                false,
                false,
                seed + 6,
            ),
            case(
                &format!("backward_causal_d128_{tag}"),
                dt,
                dense(1, 96, 96, 4, 4, 128),
                true,
                None,
                false,
                true,
                seed + 7,
            ),
            case(
                &format!("backward_gqa_mask_d64_{tag}"),
                dt,
                dense(2, 40, 70, 4, 2, 64),
                false,
                None,
                true,
                true,
                seed + 8,
            ),
        ]);
        // A packed batch: three sequences, one of them without queries.
        let mut rng = SplitMix64::new(seed + 9);
        let (cu_q, cu_k) = (vec![0i64, 5, 5, 40], vec![0i64, 9, 20, 60]);
        let (h, hkv, d) = (4usize, 2usize, 64usize);
        let p = AttentionParams {
            varlen: true,
            ..AttentionParams::new(h, hkv, d, true)
        };
        let ids = |v: &[i64]| {
            let f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
            Tensor::from_f64(&f, &[v.len()], DType::I32).unwrap()
        };
        out.push(Case {
            name: format!("varlen_causal_d64_{tag}"),
            torch: None,
            op: Op::Attention(p),
            inputs: vec![
                ("q", random(&mut rng, &[1, 40, h * d], dt, -2.0, 2.0)),
                ("k", random(&mut rng, &[1, 60, hkv * d], dt, -2.0, 2.0)),
                ("v", random(&mut rng, &[1, 60, hkv * d], dt, -2.0, 2.0)),
                ("cu_seqlens_q", ids(&cu_q)),
                ("cu_seqlens_k", ids(&cu_k)),
            ],
            oracle: json!({"kind": "forward", "causal": true, "window": null, "heads": h,
                           "kv_heads": hkv, "head_dim": d, "scale": p.effective_scale(),
                           "dtype": tag, "cu_seqlens": [cu_q, cu_k]}),
        });
    }
    out
}

/// FP8 e4m3 inputs with per-tensor scales (bf16 output); torch gets the dequantized
/// values in bf16.
fn fp8_cases() -> Vec<Case> {
    let mut rng = SplitMix64::new(77);
    let (b, s, h, d) = (2usize, 200usize, 4usize, 128usize);
    let p = AttentionParams::new(h, h, d, false);
    // e4m3 with an amax-based per-tensor scale (`Tensor::from_f64`).
    let fp8 = |rng: &mut SplitMix64| random(rng, &[b, s, h * d], DType::F8E4M3, -2.0, 2.0);
    vec![Case {
        name: "fp8_full_d128".into(),
        torch: None,
        op: Op::Attention(p),
        inputs: vec![
            ("q", fp8(&mut rng)),
            ("k", fp8(&mut rng)),
            ("v", fp8(&mut rng)),
        ],
        oracle: json!({"kind": "forward", "causal": false, "window": null, "heads": h,
                       "kv_heads": h, "head_dim": d, "scale": p.effective_scale(),
                       "dtype": "fp8"}),
    }]
}

/// Seeded random dense cases: odd query lengths (1 to 300), caches as long or longer (a
/// few decode-shaped: 1 to 16 queries against up to 2000 keys), 1 to 4 kv heads times
/// groups of 1, 2, 4 or 8, head dims 64 to 256, and a causal mask, an additive mask, a
/// sliding window, a scale of the caller's and the backward pass each drawn at random
/// (the backward at head dims 64 and 128, where kpt has gradient kernels).
fn random_cases(dts: &[DType], per_dtype: usize, seed: u64) -> Vec<Case> {
    let mut rng = SplitMix64::new(seed);
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    let mut out = Vec::new();
    for &dt in dts {
        for i in 0..per_dtype {
            let decode = pick(4) == 0;
            let s = if decode {
                1 + pick(16)
            } else {
                1 + 2 * pick(150)
            };
            let t = if decode {
                s + pick(2000)
            } else {
                s + [0, pick(200)][pick(2)]
            };
            let hkv = [1, 2, 4][pick(3)];
            let h = hkv * [1, 2, 4, 8][pick(4)];
            let d = [64, 128, 192, 256][pick(4)];
            let backward = d <= 128 && !decode && pick(4) == 0;
            let p = AttentionParams {
                window: (!backward && pick(4) == 0).then(|| 1 + pick(t)),
                mask: pick(4) == 0,
                scale: (pick(3) == 0).then(|| 0.05 + 0.01 * pick(25) as f32),
                ..AttentionParams::new(h, hkv, d, pick(2) == 0)
            };
            let b = 1 + pick(2);
            let name = format!(
                "random{i}_{}b{b}_s{s}_t{t}_h{h}kv{hkv}_d{d}{}{}{}{}_{}",
                if backward { "backward_" } else { "" },
                if p.causal { "_causal" } else { "" },
                p.window.map_or(String::new(), |w| format!("_window{w}")),
                if p.mask { "_mask" } else { "" },
                p.scale.map_or(String::new(), |c| format!("_scale{c}")),
                dtype_name(dt)
            );
            let seed = rng_seed(seed, i as u64, dt);
            out.push(case_with(
                &name,
                dt,
                Dims { b, s, t, h, hkv, d },
                p,
                backward,
                seed,
            ));
        }
    }
    out
}

fn rng_seed(seed: u64, i: u64, dt: DType) -> u64 {
    seed ^ (i << 8) ^ dt.size_in_bytes() as u64
}

/// Decode against a paged cache (blocks of 16 handed out in a shuffled order, each
/// sequence its own length) with GQA; torch gets each sequence's keys gathered and packed
/// as a variable-length batch.
fn paged_case(name: &str, dt: DType, lens: &[usize], causal: bool, seed: u64) -> Case {
    let mut rng = SplitMix64::new(seed);
    let (s, h, hkv, d, block) = (2usize, 16usize, 4usize, 128usize, 16usize);
    let b = lens.len();
    let per_seq: Vec<usize> = lens.iter().map(|l| l.div_ceil(block)).collect();
    let blocks: usize = per_seq.iter().sum::<usize>() + 3;
    let mut order: Vec<usize> = (0..blocks).collect();
    for i in (1..blocks).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let width = per_seq.iter().copied().max().unwrap_or(1).max(1);
    let mut table = vec![0i64; b * width];
    let mut next = order.into_iter();
    for (i, &n) in per_seq.iter().enumerate() {
        for j in 0..n {
            table[i * width + j] = next.next().unwrap() as i64;
        }
    }
    let row = hkv * d;
    let q = random(&mut rng, &[b, s, h * d], dt, -2.0, 2.0);
    let kp = random(&mut rng, &[blocks, block, row], dt, -2.0, 2.0);
    let vp = random(&mut rng, &[blocks, block, row], dt, -2.0, 2.0);
    // Each sequence's keys in order, packed.
    let gather = |pool: &Tensor| {
        let v = pool.to_f64_vec();
        let mut packed = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            for j in 0..len {
                let blk = table[i * width + j / block] as usize;
                let at = (blk * block + j % block) * row;
                packed.extend_from_slice(&v[at..at + row]);
            }
        }
        let total: usize = lens.iter().sum();
        Tensor::from_f64(&packed, &[1, total, row], dt).unwrap()
    };
    let (kt, vt) = (gather(&kp), gather(&vp));
    let qt = Tensor::from_f64(&q.to_f64_vec(), &[1, b * s, h * d], dt).unwrap();
    let cu_q: Vec<usize> = (0..=b).map(|i| i * s).collect();
    let cu_k: Vec<usize> = std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l;
            Some(*acc)
        }))
        .collect();
    let p = AttentionParams {
        paged: true,
        ..AttentionParams::new(h, hkv, d, causal)
    };
    let ids = |v: Vec<i64>, shape: &[usize]| Tensor::from_vec(v, shape).unwrap();
    Case {
        name: name.into(),
        op: Op::Attention(p),
        inputs: vec![
            ("q", q),
            ("k", kp),
            ("v", vp),
            ("block_table", ids(table, &[b, width])),
            (
                "seq_lens",
                ids(lens.iter().map(|&l| l as i64).collect(), &[b]),
            ),
        ],
        torch: Some(vec![("q", qt), ("k", kt), ("v", vt)]),
        oracle: json!({"kind": "forward", "causal": causal, "window": null, "heads": h,
                       "kv_heads": hkv, "head_dim": d, "scale": p.effective_scale(),
                       "dtype": dtype_name(dt), "cu_seqlens": [cu_q, cu_k]}),
    }
}

/// FP8 under a causal mask, with GQA and odd lengths.
fn fp8_causal_case() -> Case {
    let mut rng = SplitMix64::new(78);
    let (b, s, t, h, hkv, d) = (1usize, 131usize, 301usize, 8usize, 2usize, 128usize);
    let p = AttentionParams::new(h, hkv, d, true);
    let mut fp8 = |shape: &[usize]| random(&mut rng, shape, DType::F8E4M3, -2.0, 2.0);
    Case {
        name: "fp8_gqa_causal_cache_d128".into(),
        op: Op::Attention(p),
        inputs: vec![
            ("q", fp8(&[b, s, h * d])),
            ("k", fp8(&[b, t, hkv * d])),
            ("v", fp8(&[b, t, hkv * d])),
        ],
        torch: None,
        oracle: json!({"kind": "forward", "causal": true, "window": null, "heads": h,
                       "kv_heads": hkv, "head_dim": d, "scale": p.effective_scale(),
                       "dtype": "fp8"}),
    }
}

/// The Python that runs the oracle, if it has torch (on CUDA unless `cpu`).
fn torch_python(cpu: bool) -> Option<String> {
    let python = std::env::var("KPT_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = if cpu {
        "import torch"
    } else {
        "import torch; assert torch.cuda.is_available()"
    };
    let ok = Command::new(&python)
        .args(["-c", probe])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

fn write_f32(path: &Path, t: &Tensor) {
    let bytes: Vec<u8> = t
        .to_f64_vec()
        .into_iter()
        .flat_map(|x| (x as f32).to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

fn read_f32(path: &Path, shape: &[usize]) -> Tensor {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Vec<f64> = bytes
        .chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    Tensor::from_f64(&v, shape, DType::F32).unwrap()
}

fn note(msg: &str) {
    // Written to the terminal directly: the test harness captures `eprintln!`.
    let _ = writeln!(std::io::stderr(), "{msg}");
}

#[test]
fn attention_matches_torch() {
    let cpu = std::env::var("KPT_TORCH_ORACLE_CPU").is_ok_and(|v| v == "1");
    let required = std::env::var("KPT_REQUIRE_TORCH").is_ok_and(|v| v == "1");
    let backend: Box<dyn Backend> = if cpu {
        Box::new(CpuBackend::new().unwrap())
    } else if kpt_nvidia::devices().map(|d| d.len()).unwrap_or(0) > 0 {
        Box::new(CudaBackend::new(0, CudaOptions::default()).unwrap())
    } else {
        assert!(
            !required,
            "KPT_REQUIRE_TORCH=1 but no CUDA device is visible"
        );
        note("kpt-nvidia torch oracle SKIPPED: no CUDA device");
        return;
    };
    let Some(python) = torch_python(cpu) else {
        assert!(!required, "KPT_REQUIRE_TORCH=1 but no Python with torch");
        note("kpt-nvidia torch oracle SKIPPED: no Python with torch (KPT_TORCH_PYTHON)");
        return;
    };
    let mut all = if cpu {
        cases(&[DType::F32])
    } else {
        cases(&[DType::BF16, DType::F16])
    };
    let dts: &[DType] = if cpu {
        &[DType::F32]
    } else {
        &[DType::BF16, DType::F16]
    };
    all.extend(random_cases(dts, 12, 2026));
    for (n, &dt) in dts.iter().enumerate() {
        let tag = dtype_name(dt);
        let seed = 500 + n as u64;
        all.push(paged_case(
            &format!("paged_decode_{tag}"),
            dt,
            &[1, 200, 37],
            false,
            seed,
        ));
        all.push(paged_case(
            &format!("paged_causal_{tag}"),
            dt,
            &[70, 16],
            true,
            seed + 10,
        ));
    }
    if !cpu {
        all.extend(fp8_cases());
        all.push(fp8_causal_case());
    }
    let dir = std::env::temp_dir().join(format!("kpt-torch-oracle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let registry = KernelRegistry::with_builtin();
    let mut manifest = Vec::new();
    let mut kpt_outputs = Vec::new();
    for c in &all {
        let tensors: Vec<Tensor> = c.inputs.iter().map(|(_, t)| t.clone()).collect();
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec::new(t.shape(), t.dtype()))
            .collect();
        let chain = registry.fallback_chain(&c.op, &specs, backend.device());
        let kernel = chain.first().expect("a kernel").clone();
        let outs = run_op(backend.as_ref(), &kernel, &c.op, &tensors)
            .unwrap_or_else(|e| panic!("{}: {kernel}: {e}", c.name));
        let mut desc = c.oracle.clone();
        let mut shapes = serde_json::Map::new();
        let mut names = Vec::new();
        for (n, t) in c.torch.as_ref().unwrap_or(&c.inputs) {
            if n.starts_with("cu_seqlens") {
                continue;
            }
            write_f32(&dir.join(format!("{}.{n}.f32", c.name)), t);
            shapes.insert((*n).into(), json!(t.shape()));
            names.push(*n);
        }
        desc["name"] = json!(c.name);
        desc["shapes"] = Value::Object(shapes);
        desc["tensors"] = json!(names);
        manifest.push(desc);
        kpt_outputs.push((kernel, tensors, outs));
    }
    std::fs::write(
        dir.join("cases.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    let script = std::env::var_os("KPT_TORCH_ORACLE_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/torch_attention_oracle.py")
        });
    let device = if cpu { "cpu" } else { "cuda" };
    let run = Command::new(&python)
        .arg(&script)
        .arg(&dir)
        .arg(device)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&run.stderr)
    );
    let mut failures = Vec::new();
    for (c, (kernel, tensors, outs)) in all.iter().zip(&kpt_outputs) {
        let names: &[&str] = if matches!(c.op, Op::AttentionBackward(_)) {
            &["dq", "dk", "dv"]
        } else {
            &["out"]
        };
        for (i, (n, got)) in names.iter().zip(outs).enumerate() {
            let torch = read_f32(&dir.join(format!("{}.{n}.f32", c.name)), got.shape());
            let tol = output_tolerance(&c.op, tensors, i, got.dtype());
            let tol = Tolerance {
                abs: 2.0 * tol.abs,
                rel: 2.0 * tol.rel,
            };
            let stats = compare(got, &torch, tol).unwrap();
            if !stats.within {
                failures.push(format!("{} {n} ({kernel}): {stats:?} vs {tol:?}", c.name));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "kpt vs torch:\n{}",
        failures.join("\n")
    );
    let names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
    note(&format!(
        "kpt-nvidia torch oracle: {} cases on {device} agree with torch: {}",
        all.len(),
        names.join(", ")
    ));
}
