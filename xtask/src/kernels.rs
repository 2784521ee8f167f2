//! `build-kernels` (compile `kernels/cuda/*.cu` with a pinned nvcc,
//! `kernels/triton/*.py` with a pinned Triton and `kernels/hip/*.hip` with a pinned hipcc
//! and a pinned clang into committed artifacts and their manifest) and `check-kernels`
//! (the committed artifacts match their sources and hashes; needs no toolchain, runs in
//! CI).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

#[path = "../../crates/kpt-kernels/src/artifacts/manifest.rs"]
mod manifest;

use manifest::{ArtifactEntry, EntryPoint, KernelEntry, Manifest};

use crate::{python_env, root};

/// The artifact targets of every CUDA kernel: cubins for Ampere and Hopper (`sm_90a`
/// enables wgmma/TMA) and PTX for Ampere and newer, JIT-compiled by the driver.
const CUDA_TARGETS: [(&str, &str, &[&str]); 3] = [
    (
        "sm_80",
        "cubin",
        &["-cubin", "-gencode=arch=compute_80,code=sm_80"],
    ),
    (
        "sm_90a",
        "cubin",
        &["-cubin", "-gencode=arch=compute_90a,code=sm_90a"],
    ),
    ("compute_80", "ptx", &["-ptx", "-arch=compute_80"]),
];

/// The PTX ISA of every PTX artifact: 8.0, which every CUDA 12.x and 13.x driver
/// JIT-compiles (nvcc 13.0 writes 9.0, which only CUDA 13 drivers accept).
const PTX_ISA: &str = "8.0";

fn artifacts_dir() -> PathBuf {
    root().join("crates/kpt-kernels/artifacts")
}

fn manifest_path() -> PathBuf {
    artifacts_dir().join("manifest.json")
}

fn read_manifest() -> Result<Manifest> {
    let path = manifest_path();
    if !path.exists() {
        return Ok(Manifest::default());
    }
    let text = std::fs::read_to_string(&path)?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn sha256_hex(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(hex_digest(&bytes))
}

fn hex_digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// sha256 of a kernel source followed by every local header it includes
/// (`#include "x.cuh"`, next to it), so a header change also marks its kernels stale.
/// A `.hip` source hashes as [`hip_sources`] lists it.
fn source_sha256(src: &Path) -> Result<String> {
    if src.extension().and_then(|e| e.to_str()) == Some("hip") {
        let mut all = Vec::new();
        for path in hip_sources(src)? {
            all.extend(
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
            );
        }
        return Ok(hex_digest(&all));
    }
    let text = std::fs::read(src).with_context(|| format!("reading {}", src.display()))?;
    let mut all = text.clone();
    let dir = src.parent().context("kernel source has no folder")?;
    for line in String::from_utf8_lossy(&text).lines() {
        let Some(rest) = line.trim().strip_prefix("#include \"") else {
            continue;
        };
        let header = rest.split('"').next().unwrap_or_default();
        let path = dir.join(header);
        all.extend(
            std::fs::read(&path).with_context(|| {
                format!("{}: reading included {}", src.display(), path.display())
            })?,
        );
    }
    Ok(hex_digest(&all))
}

/// The files a `kernels/hip/*.hip` source is compiled from, in a fixed order: the source,
/// the local files it includes (`#include "path"`, relative to the including file, followed
/// recursively: the CUDA source and its headers), then every header of
/// `kernels/hip/include/` (the dialect and the `cuda_*.h` shims that CUDA's
/// `#include <cuda_bf16.h>` resolves to through `-I`).
fn hip_sources(src: &Path) -> Result<Vec<PathBuf>> {
    fn walk(path: &Path, seen: &mut BTreeSet<PathBuf>, out: &mut Vec<PathBuf>) -> Result<()> {
        let canonical = path
            .canonicalize()
            .with_context(|| format!("reading {}", path.display()))?;
        if !seen.insert(canonical.clone()) {
            return Ok(());
        }
        out.push(canonical.clone());
        let text = std::fs::read_to_string(&canonical)?;
        let dir = canonical.parent().context("kernel source has no folder")?;
        for line in text.lines() {
            if let Some(rest) = line.trim().strip_prefix("#include \"") {
                let header = rest.split('"').next().unwrap_or_default();
                walk(&dir.join(header), seen, out)?;
            }
        }
        Ok(())
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    walk(src, &mut seen, &mut out)?;
    let include = root().join("kernels/hip/include");
    let mut headers: Vec<PathBuf> = std::fs::read_dir(&include)
        .with_context(|| format!("reading {}", include.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    headers.retain(|p| p.extension().and_then(|e| e.to_str()) == Some("h"));
    headers.sort();
    for h in headers {
        let h = h.canonicalize()?;
        if seen.insert(h.clone()) {
            out.push(h);
        }
    }
    Ok(out)
}

/// `path` relative to the repository root, with `/` separators.
fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .to_string_lossy()
        .replace('\\', "/")
}

/// Kernel sources (`.cu`, `.cuh`, `.py`, `.hip`) under `dir`, sorted.
fn list_sources(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if !dir.exists() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(list_sources(&path)?);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh" | "py" | "hip")
        ) {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// The `// kpt:launch NAME block=N shared=N grid=WHAT` lines of a source.
fn launch_lines(source: &str, path: &str) -> Result<Vec<EntryPoint>> {
    let mut out = Vec::new();
    for line in source.lines() {
        let Some(rest) = line.trim().strip_prefix("// kpt:launch ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let name = words
            .next()
            .context("kpt:launch without a name")?
            .to_string();
        let mut fields = BTreeMap::new();
        for w in words {
            let (k, v) = w
                .split_once('=')
                .with_context(|| format!("{path}: `{w}` is not key=value"))?;
            fields.insert(k, v);
        }
        let get = |k: &str| {
            fields
                .get(k)
                .copied()
                .with_context(|| format!("{path}: kpt:launch {name} lacks `{k}=`"))
        };
        out.push(EntryPoint {
            block: get("block")?.parse().context("block")?,
            shared_bytes: get("shared")?.parse().context("shared")?,
            grid: get("grid")?.to_string(),
            name,
        });
    }
    if out.is_empty() {
        bail!("{path}: no `// kpt:launch` line names an entry point");
    }
    Ok(out)
}

/// The kernel toolchains' virtual environment (`kernels/requirements.txt`).
fn toolchain_python() -> Result<PathBuf> {
    python_env("kernels-venv", "kernels/requirements.txt")
}

/// The kernels venv's site-packages folder.
fn site_packages(python: &Path) -> Result<PathBuf> {
    let out = Command::new(python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .context("asking the kernels venv for its site-packages")?;
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The pinned nvcc and its version.
fn nvcc(python: &Path) -> Result<(PathBuf, String)> {
    let nvcc = site_packages(python)?.join("nvidia/cu13/bin/nvcc");
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", nvcc.display()))?;
    let text = String::from_utf8_lossy(&version.stdout);
    let v = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix('V'))
        .with_context(|| format!("no version in `nvcc --version`: {text}"))?
        .to_string();
    Ok((nvcc, v))
}

/// The CUDA 12.0 assembler of the kernels venv (`nvidia-cuda-nvcc-cu12`).
fn ptxas12(python: &Path) -> Result<PathBuf> {
    Ok(site_packages(python)?.join("nvidia/cuda_nvcc/bin/ptxas"))
}

/// Sets the `.version` of the PTX in `file` to [`PTX_ISA`] and has the CUDA 12.0
/// assembler `ptxas` compile it for `sm_80`, so that a PTX using anything newer than
/// that ISA fails the build instead of a user's JIT.
fn lower_ptx(ptxas: &Path, file: &Path) -> Result<()> {
    let text = std::fs::read_to_string(file)?;
    let mut lowered = String::with_capacity(text.len());
    let mut found = false;
    for line in text.lines() {
        if !found && line.trim_start().starts_with(".version ") {
            lowered.push_str(&format!(".version {PTX_ISA}"));
            found = true;
        } else {
            lowered.push_str(line);
        }
        lowered.push('\n');
    }
    if !found {
        bail!("{}: no .version directive", rel(file));
    }
    std::fs::write(file, lowered)?;
    let out = Command::new(ptxas)
        .args(["-arch=sm_80", "-o", "/dev/null"])
        .arg(file)
        .output()
        .with_context(|| format!("running {}", ptxas.display()))?;
    if !out.status.success() {
        bail!(
            "{}: the CUDA 12.0 assembler rejects it at PTX ISA {PTX_ISA}:\n{}",
            rel(file),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Checks that `file` holds the symbol `name` and returns its manifest entry.
fn artifact(
    file: &Path,
    target: &str,
    format: &str,
    entries: &[EntryPoint],
) -> Result<ArtifactEntry> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    for ep in entries {
        if !bytes
            .windows(ep.name.len())
            .any(|w| w == ep.name.as_bytes())
        {
            bail!("{}: entry point {} not found", rel(file), ep.name);
        }
    }
    eprintln!("built {} ({} bytes)", rel(file), bytes.len());
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .context("artifact name")?;
    let folder = file
        .parent()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .context("artifact folder")?;
    Ok(ArtifactEntry {
        path: format!("{folder}/{name}"),
        target: target.into(),
        format: format.into(),
        sha256: hex_digest(&bytes),
    })
}

/// The entries of `old` built from `source` when they are still current: the source (with
/// its headers) hashes as recorded, every artifact exists with its recorded hash and, with
/// `targets`, the artifacts are for exactly those targets. Reusing them keeps unchanged
/// artifacts byte-identical (nvcc's PTX symbol names differ per run).
/// Only the entries for AMD (`hip`, every artifact an HSACO) or only the others: a Triton
/// source has both, built by different steps.
fn current_entries(
    old: &Manifest,
    source: &Path,
    hip: bool,
    targets: Option<&[&str]>,
) -> Result<Option<Vec<KernelEntry>>> {
    let path = rel(source);
    let entries: Vec<_> = old
        .kernels
        .iter()
        .filter(|e| e.source == path && is_hip(e) == hip)
        .cloned()
        .collect();
    if entries.is_empty() {
        return Ok(None);
    }
    let sha = source_sha256(source)?;
    for e in &entries {
        if e.source_sha256 != sha {
            return Ok(None);
        }
        if targets.is_some_and(|t| {
            !e.artifacts
                .iter()
                .map(|a| a.target.as_str())
                .eq(t.iter().copied())
        }) {
            return Ok(None);
        }
        for a in &e.artifacts {
            let file = artifacts_dir().join(&a.path);
            if !file.exists() || sha256_hex(&file)? != a.sha256 {
                return Ok(None);
            }
        }
    }
    eprintln!("unchanged: {path}");
    Ok(Some(entries))
}

/// ptxas's C7511 remark in nvcc's diagnostics, if any: it serialized a kernel's wgmma
/// instructions (each waits for the one before) for want of registers, which costs a
/// Hopper attention kernel a quarter to a third of its speed without failing the build.
fn serialized_wgmma(diagnostics: &str) -> Option<&str> {
    diagnostics.lines().find(|l| l.contains("C7511"))
}

/// Compiles every `kernels/cuda/*.cu` for [`CUDA_TARGETS`] into `manifest`.
fn build_cuda(
    python: &Path,
    ptxas: &Path,
    old: Option<&Manifest>,
    manifest: &mut Manifest,
) -> Result<()> {
    let (nvcc, version) = nvcc(python)?;
    let include = nvcc
        .parent()
        .and_then(Path::parent)
        .map(|p| p.join("include"))
        .context("nvcc has no include folder")?;
    let out_dir = artifacts_dir().join("cuda");
    std::fs::create_dir_all(&out_dir)?;
    manifest.toolchains.insert("nvcc".into(), version);
    manifest.toolchains.insert(
        "ptx_isa".into(),
        format!("{PTX_ISA} (checked by ptxas 12.0)"),
    );
    for src in list_sources(&root().join("kernels/cuda"))? {
        if src.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        if let Some(entries) = old
            .map(|m| current_entries(m, &src, false, None))
            .transpose()?
            .flatten()
        {
            manifest.kernels.extend(entries);
            continue;
        }
        let name = src
            .file_stem()
            .and_then(|s| s.to_str())
            .context("kernel file name")?
            .to_string();
        let text = std::fs::read_to_string(&src)?;
        let entry_points = launch_lines(&text, &rel(&src))?;
        let mut artifacts = Vec::new();
        for (target, format, flags) in CUDA_TARGETS {
            let out = out_dir.join(format!("{name}.{target}.{format}"));
            let include_flag = format!("-I{}", include.display());
            let run = Command::new(&nvcc)
                .args(flags)
                .args(["-O3", "-std=c++17", "--use_fast_math", &include_flag, "-o"])
                .arg(&out)
                .arg(&src)
                .stdout(std::process::Stdio::inherit())
                .output()
                .with_context(|| format!("running {}", nvcc.display()))?;
            let diagnostics = String::from_utf8_lossy(&run.stderr);
            eprint!("{diagnostics}");
            if !run.status.success() {
                bail!("nvcc failed on {} for {target}", rel(&src));
            }
            if let Some(line) = serialized_wgmma(&diagnostics) {
                bail!("{} for {target}: {line}", rel(&src));
            }
            if format == "ptx" {
                lower_ptx(ptxas, &out)?;
            }
            artifacts.push(artifact(&out, target, format, &entry_points)?);
        }
        manifest.kernels.push(KernelEntry {
            name,
            source: rel(&src),
            source_sha256: source_sha256(&src)?,
            entry_points,
            artifacts,
        });
    }
    Ok(())
}

/// What `xtask/triton/aot.py` reports about one source.
#[derive(serde::Deserialize)]
struct TritonBuild {
    triton: String,
    kernels: Vec<TritonKernel>,
}

/// One compiled Triton specialization.
#[derive(serde::Deserialize)]
struct TritonKernel {
    kernel: String,
    entry: String,
    block: u32,
    shared: u32,
    grid: String,
    artifacts: Vec<TritonArtifact>,
}

#[derive(serde::Deserialize)]
struct TritonArtifact {
    target: String,
    format: String,
    file: String,
}

/// Compiles every specialization that `kernels/triton/*.py` lists into `manifest` (one
/// kernel entry per specialization, each with its cubins and PTX).
fn build_triton(
    python: &Path,
    ptxas: &Path,
    old: Option<&Manifest>,
    manifest: &mut Manifest,
) -> Result<()> {
    let out_dir = artifacts_dir().join("triton");
    std::fs::create_dir_all(&out_dir)?;
    let driver = root().join("xtask/triton/aot.py");
    for src in list_sources(&root().join("kernels/triton"))? {
        if let Some(entries) = old
            .map(|m| current_entries(m, &src, false, None))
            .transpose()?
            .flatten()
        {
            manifest.kernels.extend(entries);
            continue;
        }
        eprintln!("triton: compiling {}", rel(&src));
        let out = Command::new(python)
            .arg(&driver)
            .arg(&src)
            .arg(&out_dir)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running {}", driver.display()))?;
        if !out.status.success() {
            bail!("Triton failed on {}", rel(&src));
        }
        let build: TritonBuild = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("reading what {} reported", rel(&driver)))?;
        manifest.toolchains.insert("triton".into(), build.triton);
        let source_sha256 = source_sha256(&src)?;
        for k in build.kernels {
            let entry_points = vec![EntryPoint {
                name: k.entry,
                block: k.block,
                shared_bytes: k.shared,
                grid: k.grid,
            }];
            let artifacts = k
                .artifacts
                .iter()
                .map(|a| {
                    let file = out_dir.join(&a.file);
                    if a.format == "ptx" {
                        lower_ptx(ptxas, &file)?;
                    }
                    artifact(&file, &a.target, &a.format, &entry_points)
                })
                .collect::<Result<_>>()?;
            manifest.kernels.push(KernelEntry {
                name: k.kernel,
                source: rel(&src),
                source_sha256: source_sha256.clone(),
                entry_points,
                artifacts,
            });
        }
    }
    Ok(())
}

/// Debian 12's ROCm 5.2 packages whose hipcc (clang 15 with ROCm's device libraries)
/// builds the HSACO artifacts, pinned to the versions the committed artifacts came from.
const HIP_PACKAGES: [(&str, &str); 3] = [
    ("hipcc", "5.2.3-8"),
    ("libamdhip64-dev", "5.2.3-8"),
    ("rocm-device-libs", "5.2.3-2"),
];

/// The processors hipcc 5.2 compiles every `kernels/hip/*.hip` for: CDNA 2 (MI200), CDNA 3
/// as ROCm 5.2 names it (gfx940) and RDNA 2 (gfx1030). Its clang 15 does not know gfx942
/// (MI300X), and ROCm 5.2's device libraries have no gfx1100 (RDNA 3): see
/// [`CLANG_HIP_TARGETS`].
const HIP_TARGETS: [&str; 3] = ["gfx90a", "gfx940", "gfx1030"];

/// Debian 12's LLVM 19 (bookworm main): clang, the lld that links AMDGPU code objects,
/// and llvm-as. It builds the processors of [`CLANG_HIP_TARGETS`] from the same sources,
/// against the same HIP 5.2 headers and ROCm 5.2 device libraries as [`HIP_PACKAGES`].
const CLANG_PACKAGES: [(&str, &str); 3] = [
    ("clang-19", "1:19.1.7-3~deb12u1"),
    ("lld-19", "1:19.1.7-3~deb12u1"),
    ("llvm-19", "1:19.1.7-3~deb12u1"),
];

/// The folder of the pinned LLVM 19's programs.
const CLANG_BIN: &str = "/usr/lib/llvm-19/bin";

/// Where Debian's `rocm-device-libs` puts ROCm's device libraries (LLVM bitcode).
const DEVICE_LIBS: &str = "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode";

/// The processors that clang 19 compiles every `kernels/hip/*.hip` for, with the value of
/// ROCm's `__oclc_ISA_version` for each: CDNA 3 (MI300X, gfx942) and RDNA 3 (RX 7900,
/// gfx1100). ROCm 5.2's device libraries have no `oclc_isa_version_942.bc` or
/// `oclc_isa_version_1100.bc`, the one-constant library that tells ockl and ocml the
/// processor; [`device_libs`] writes them (major·1000 + minor·100 + stepping, the values
/// that later ROCm device libraries define for these processors).
const CLANG_HIP_TARGETS: [(&str, u32); 2] = [("gfx942", 9402), ("gfx1100", 11000)];

/// Every processor a `kernels/hip/*.hip` source is built for, in the manifest's order.
fn hip_targets() -> impl Iterator<Item = &'static str> {
    HIP_TARGETS
        .into_iter()
        .chain(CLANG_HIP_TARGETS.iter().map(|(t, _)| *t))
}

/// The installed version of Debian package `name`, if it is installed.
fn deb_version(name: &str) -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", name])
        .output()
        .ok()?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !v.is_empty()).then_some(v)
}

/// Installs the Debian `packages` at their pinned versions with apt-get when one is
/// missing or at another version.
fn apt_install(packages: &[(&str, &str)]) -> Result<()> {
    let pins: Vec<String> = packages.iter().map(|(p, v)| format!("{p}={v}")).collect();
    if packages
        .iter()
        .any(|(p, v)| deb_version(p).as_deref() != Some(*v))
    {
        eprintln!("build-kernels: installing {}", pins.join(" "));
        let status = Command::new("apt-get")
            .args([
                "install",
                "-y",
                "--no-install-recommends",
                "--allow-downgrades",
            ])
            .args(&pins)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get (the HIP toolchains come from Debian 12's packages)")?;
        if !status.success() {
            bail!(
                "could not install a HIP toolchain; on Debian 12 run as root: \
                 apt-get install {}",
                pins.join(" ")
            );
        }
    }
    for (p, v) in packages {
        let found = deb_version(p);
        if found.as_deref() != Some(*v) {
            bail!("{p} is at {found:?} after installing, not {v}");
        }
    }
    Ok(())
}

/// The first line of `program --version` that contains `clang version`.
fn clang_version(program: &Path) -> Result<String> {
    // stdout only: hipcc also runs rocm_agent_enumerator, which complains on stderr
    // when the machine has no GPU.
    let out = Command::new(program)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains("clang version"))
        .map(|l| l.trim().to_string())
        .with_context(|| format!("no clang version in `{} --version`", program.display()))
}

/// The pinned hipcc and the toolchain string the manifest records; installs
/// [`HIP_PACKAGES`] with apt-get first when one is missing or at another version.
fn hipcc() -> Result<(PathBuf, String)> {
    apt_install(&HIP_PACKAGES)?;
    let hipcc = PathBuf::from("/usr/bin/hipcc");
    let out = Command::new(&hipcc)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", hipcc.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let hip = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("HIP version:"))
        .map(str::trim)
        .context("no `HIP version:` in `hipcc --version`")?;
    let clang = clang_version(&hipcc)?;
    let version = format!(
        "{} (HIP {hip}, {clang}, rocm-device-libs {})",
        HIP_PACKAGES[0].1, HIP_PACKAGES[2].1
    );
    Ok((hipcc, version))
}

/// The pinned clang 19 and the toolchain string the manifest records; installs
/// [`HIP_PACKAGES`] (HIP headers, device libraries) and [`CLANG_PACKAGES`] first.
fn clang_hip() -> Result<(PathBuf, String)> {
    apt_install(&HIP_PACKAGES)?;
    apt_install(&CLANG_PACKAGES)?;
    let clang = Path::new(CLANG_BIN).join("clang++");
    let version = format!(
        "{} ({}, HIP headers of libamdhip64-dev {}, rocm-device-libs {} with \
         oclc_isa_version for {})",
        CLANG_PACKAGES[0].1,
        clang_version(&clang)?,
        HIP_PACKAGES[1].1,
        HIP_PACKAGES[2].1,
        CLANG_HIP_TARGETS
            .iter()
            .map(|(t, v)| format!("{t} = {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok((clang, version))
}

/// A device library folder for clang 19 in `target/hip-device-libs`: links to every
/// library of Debian's `rocm-device-libs` 5.2, plus the `oclc_isa_version_N.bc` of each
/// processor in [`CLANG_HIP_TARGETS`], assembled by llvm-as from the one constant that
/// ROCm's file of that name holds (laid out as 5.2's `oclc_isa_version_940.bc` is). In
/// kpt's kernels only `__ockl_wfred_or_i32` and `__ocml_exp_f32` read it, to choose
/// between code paths for gfx7, gfx8, gfx9 and gfx10+: gfx942 takes gfx940's and gfx1100
/// gfx1030's (`docs/backends/amd.md`).
fn device_libs() -> Result<PathBuf> {
    let dir = root().join("target/hip-device-libs");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    let mut libs: Vec<PathBuf> = std::fs::read_dir(DEVICE_LIBS)
        .with_context(|| format!("reading {DEVICE_LIBS}"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    libs.sort();
    for lib in libs {
        let name = lib.file_name().context("device library name")?;
        std::os::unix::fs::symlink(&lib, dir.join(name))?;
    }
    for (target, isa) in CLANG_HIP_TARGETS {
        let suffix = target.strip_prefix("gfx").context("processor name")?;
        let bc = dir.join(format!("oclc_isa_version_{suffix}.bc"));
        if bc.exists() {
            bail!("{DEVICE_LIBS} has its own {target} library, unlike ROCm 5.2's");
        }
        let ll = dir.join(format!("oclc_isa_version_{suffix}.ll"));
        std::fs::write(
            &ll,
            format!(
                "target datalayout = \"{AMDGPU_DATALAYOUT}\"\n\
                 target triple = \"amdgcn-amd-amdhsa\"\n\n\
                 @__oclc_ISA_version = linkonce_odr protected local_unnamed_addr \
                 addrspace(4) constant i32 {isa}, align 4\n"
            ),
        )?;
        let llvm_as = Path::new(CLANG_BIN).join("llvm-as");
        let status = Command::new(&llvm_as)
            .arg(&ll)
            .arg("-o")
            .arg(&bc)
            .status()
            .with_context(|| format!("running {}", llvm_as.display()))?;
        if !status.success() {
            bail!("llvm-as failed on {}", ll.display());
        }
    }
    Ok(dir)
}

/// The data layout of ROCm 5.2's device libraries (that of `oclc_isa_version_940.bc`).
const AMDGPU_DATALAYOUT: &str = "e-p:64:64-p1:64:64-p2:32:32-p3:32:32-p4:64:64-p5:32:32-\
     p6:32:32-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-\
     v1024:1024-v2048:2048-n32:64-S32-A5-G1-ni:7";

/// The command that compiles a `kernels/hip/*.hip` for `target` into a code object:
/// hipcc 5.2 for [`HIP_TARGETS`], clang 19 with the device libraries of `libs` for
/// [`CLANG_HIP_TARGETS`]. Both compile for the device only, into a plain ELF code object
/// (`--no-gpu-bundle-output`), at -O3 without fast-math.
fn hip_command(hipcc: &Path, clang: Option<&(PathBuf, PathBuf)>, target: &str) -> Result<Command> {
    let mut cmd;
    if HIP_TARGETS.contains(&target) {
        cmd = Command::new(hipcc);
        cmd.arg("--genco");
    } else {
        let (clang, libs) = clang.context("clang 19 is not set up")?;
        cmd = Command::new(clang);
        cmd.args(["-x", "hip", "--cuda-device-only"])
            // Debian's HIP 5.2 headers under /usr, as hipcc 5.2 passes, even where another
            // ROCm is installed in /opt/rocm.
            .arg("--rocm-path=/usr")
            .arg(format!("--rocm-device-lib-path={}", libs.display()))
            // Code object v5, as Triton's objects for the same processors; ROCm 5.2's
            // ockl reads v5's implicit kernel arguments when `__oclc_ABI_version` is 500.
            .arg("-mcode-object-version=5")
            // No `__hip_cuid_HASH` symbol whose hash depends on the source's path.
            .arg("-fuse-cuid=none")
            // What hipcc 5.2 passes to its clang: inline every device function into the
            // kernels, as in the hipcc builds (a call would need a stack in scratch).
            .args(["-mllvm", "-amdgpu-early-inline-all=true"])
            .args(["-mllvm", "-amdgpu-function-calls=false"]);
    }
    cmd.arg("--no-gpu-bundle-output")
        .arg(format!("--offload-arch={target}"))
        .args(["-O3", "-std=c++17"])
        .arg(format!(
            "-I{}",
            root().join("kernels/hip/include").display()
        ));
    Ok(cmd)
}

/// Compiles every `kernels/hip/*.hip` for [`HIP_TARGETS`] (hipcc 5.2) and
/// [`CLANG_HIP_TARGETS`] (clang 19) into `manifest` (unchanged sources keep their entries
/// when they have every target). A `.hip` source includes `include/hip_dialect.h` and then
/// a CUDA source of `kernels/cuda/`, whose `// kpt:launch` lines name its entry points.
fn build_hip(old: Option<&Manifest>, manifest: &mut Manifest) -> Result<()> {
    let sources: Vec<PathBuf> = list_sources(&root().join("kernels/hip"))?
        .into_iter()
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("hip"))
        .collect();
    let out_dir = artifacts_dir().join("hip");
    let mut hipcc_path = None;
    let mut clang = None;
    for src in sources {
        let targets: Vec<&str> = hip_targets().collect();
        if let Some(entries) = old
            .map(|m| current_entries(m, &src, true, Some(&targets)))
            .transpose()?
            .flatten()
        {
            manifest.kernels.extend(entries);
            continue;
        }
        if hipcc_path.is_none() {
            std::fs::create_dir_all(&out_dir)?;
            let (path, version) = hipcc()?;
            manifest.toolchains.insert("hipcc".into(), version);
            hipcc_path = Some(path);
            let (path, version) = clang_hip()?;
            manifest.toolchains.insert("hip-clang".into(), version);
            clang = Some((path, device_libs()?));
        }
        let hipcc = hipcc_path.as_ref().context("hipcc")?;
        let name = src
            .file_stem()
            .and_then(|s| s.to_str())
            .context("kernel file name")?
            .to_string();
        let mut text = String::new();
        for path in hip_sources(&src)? {
            text.push_str(&std::fs::read_to_string(&path)?);
            text.push('\n');
        }
        let entry_points = launch_lines(&text, &rel(&src))?;
        let mut artifacts = Vec::new();
        for target in hip_targets() {
            let out = out_dir.join(format!("{name}.{target}.hsaco"));
            let mut cmd = hip_command(hipcc, clang.as_ref(), target)?;
            let status = cmd
                .arg("-o")
                .arg(&out)
                .arg(&src)
                .status()
                .with_context(|| format!("running {:?}", cmd.get_program()))?;
            if !status.success() {
                bail!(
                    "{:?} failed on {} for {target}",
                    cmd.get_program(),
                    rel(&src)
                );
            }
            let bytes = std::fs::read(&out)?;
            if !bytes.starts_with(b"\x7fELF") {
                bail!("{}: not an ELF code object (an offload bundle?)", rel(&out));
            }
            artifacts.push(artifact(&out, target, "hsaco", &entry_points)?);
        }
        manifest.kernels.push(KernelEntry {
            name,
            source: rel(&src),
            source_sha256: source_sha256(&src)?,
            entry_points,
            artifacts,
        });
    }
    Ok(())
}

/// A kernel toolchain of `build-kernels`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Toolchain {
    /// nvcc: `kernels/cuda/*.cu`.
    Cuda,
    /// Triton: `kernels/triton/*.py`.
    Triton,
    /// AMD code objects: hipcc 5.2 and clang 19 for `kernels/hip/*.hip`, Triton for
    /// `kernels/triton/*.py`.
    Hip,
}

/// Whether `entry` is built for AMD GPUs (its artifacts are HSACO code objects).
fn is_hip(entry: &KernelEntry) -> bool {
    !entry.artifacts.is_empty() && entry.artifacts.iter().all(|a| a.format == "hsaco")
}

/// The entries of `old` whose source is under `prefix` and that are (`hip`) or are not
/// built for AMD GPUs, unchanged.
fn keep(old: &Manifest, prefix: &str, hip: bool, manifest: &mut Manifest) {
    manifest.kernels.extend(
        old.kernels
            .iter()
            .filter(|e| e.source.starts_with(prefix) && is_hip(e) == hip)
            .cloned(),
    );
}

/// Compiles the specializations of every `kernels/triton/*.py` for the AMD processors of
/// `xtask/triton/aot.py`'s `HIP_TARGETS` with the pinned Triton of
/// `kernels/requirements-hip.txt` (in `target/triton-hip-venv`): one entry per
/// specialization and processor, since the launch block is waves × wave size.
fn build_triton_hip(old: Option<&Manifest>, manifest: &mut Manifest) -> Result<()> {
    let out_dir = artifacts_dir().join("hip");
    let driver = root().join("xtask/triton/aot.py");
    let mut python = None;
    for src in list_sources(&root().join("kernels/triton"))? {
        if let Some(entries) = old
            .map(|m| current_entries(m, &src, true, None))
            .transpose()?
            .flatten()
        {
            manifest.kernels.extend(entries);
            continue;
        }
        if python.is_none() {
            python = Some(python_env(
                "triton-hip-venv",
                "kernels/requirements-hip.txt",
            )?);
            std::fs::create_dir_all(&out_dir)?;
        }
        let python = python.as_ref().context("python")?;
        eprintln!("triton (AMD): compiling {}", rel(&src));
        let out = Command::new(python)
            .arg(&driver)
            .arg(&src)
            .arg(&out_dir)
            .arg("hip")
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running {}", driver.display()))?;
        if !out.status.success() {
            bail!("Triton failed on {} for AMD", rel(&src));
        }
        let build: TritonBuild = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("reading what {} reported", rel(&driver)))?;
        manifest
            .toolchains
            .insert("triton".into(), build.triton.clone());
        let source_sha256 = source_sha256(&src)?;
        for k in build.kernels {
            let entry_points = vec![EntryPoint {
                name: k.entry,
                block: k.block,
                shared_bytes: k.shared,
                grid: k.grid,
            }];
            let artifacts = k
                .artifacts
                .iter()
                .map(|a| {
                    let file = out_dir.join(&a.file);
                    if !std::fs::read(&file)?.starts_with(b"\x7fELF") {
                        bail!("{}: not an ELF code object", rel(&file));
                    }
                    artifact(&file, &a.target, &a.format, &entry_points)
                })
                .collect::<Result<_>>()?;
            manifest.kernels.push(KernelEntry {
                name: k.kernel,
                source: rel(&src),
                source_sha256: source_sha256.clone(),
                entry_points,
                artifacts,
            });
        }
    }
    Ok(())
}

/// Compiles the kernels whose sources changed (every kernel with `force`) with every
/// toolchain, or only with `only` (the others' entries are kept as they are), and
/// rewrites the manifest.
pub fn build_kernels(force: bool, only: Option<Toolchain>) -> Result<()> {
    let previous = read_manifest()?;
    let old = (!force).then_some(&previous);
    let wants = |t: Toolchain| only.is_none_or(|o| o == t);
    let mut manifest = Manifest::default();
    if wants(Toolchain::Cuda) || wants(Toolchain::Triton) {
        let python = toolchain_python()?;
        let ptxas = ptxas12(&python)?;
        if wants(Toolchain::Cuda) {
            build_cuda(&python, &ptxas, old, &mut manifest)?;
        } else {
            keep(&previous, "kernels/cuda/", false, &mut manifest);
        }
        if wants(Toolchain::Triton) {
            build_triton(&python, &ptxas, old, &mut manifest)?;
        } else {
            keep(&previous, "kernels/triton/", false, &mut manifest);
        }
    } else {
        keep(&previous, "kernels/cuda/", false, &mut manifest);
        keep(&previous, "kernels/triton/", false, &mut manifest);
    }
    if wants(Toolchain::Hip) {
        build_hip(old, &mut manifest)?;
        build_triton_hip(old, &mut manifest)?;
    } else {
        keep(&previous, "kernels/", true, &mut manifest);
    }
    if !force || only.is_some() {
        // Toolchain versions of reused entries stay as recorded.
        for (k, v) in &previous.toolchains {
            manifest
                .toolchains
                .entry(k.clone())
                .or_insert_with(|| v.clone());
        }
    }
    let json = serde_json::to_string_pretty(&manifest)? + "\n";
    std::fs::write(manifest_path(), json)?;
    eprintln!(
        "build-kernels: {} kernel(s) with {}; wrote {}",
        manifest.kernels.len(),
        manifest
            .toolchains
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        rel(&manifest_path())
    );
    check_kernels()
}

/// Every kernel source under `kernels/` must be in the manifest with its current
/// sha256, and every artifact the manifest lists must exist with its hash.
pub fn check_kernels() -> Result<()> {
    let root = root();
    let sources = list_sources(&root.join("kernels"))?;
    let manifest = read_manifest()?;
    let mut problems = Vec::new();
    for src in &sources {
        let path = rel(src);
        // Headers are hashed into the kernels that include them.
        if src.extension().and_then(|e| e.to_str()) == Some("cuh") {
            continue;
        }
        // A Triton source has one entry per specialization.
        let entries: Vec<_> = manifest
            .kernels
            .iter()
            .filter(|e| e.source == path)
            .collect();
        let current = source_sha256(src)?;
        if entries.is_empty() {
            problems.push(format!(
                "{path}: not in the manifest (run `cargo xtask build-kernels`)"
            ));
        } else if entries.iter().any(|e| e.source_sha256 != current) {
            problems.push(format!(
                "{path}: changed since its artifacts were built (run `cargo xtask build-kernels`)"
            ));
        } else {
            let hip_source = src.extension().and_then(|e| e.to_str()) == Some("hip");
            for e in entries {
                // Every `.hip` source is built for every AMD processor of the build.
                if hip_source
                    && !e
                        .artifacts
                        .iter()
                        .map(|a| a.target.as_str())
                        .eq(hip_targets())
                {
                    problems.push(format!(
                        "{path}: built for {}, not for {} (run `cargo xtask build-kernels`)",
                        e.artifacts
                            .iter()
                            .map(|a| a.target.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        hip_targets().collect::<Vec<_>>().join(", ")
                    ));
                }
                for a in &e.artifacts {
                    let file = artifacts_dir().join(&a.path);
                    if !file.exists() {
                        problems.push(format!("{}: artifact missing", a.path));
                    } else if sha256_hex(&file)? != a.sha256 {
                        problems.push(format!(
                            "{}: artifact does not match its manifest hash",
                            a.path
                        ));
                    }
                }
            }
        }
    }
    for e in &manifest.kernels {
        if !root.join(&e.source).exists() {
            problems.push(format!(
                "{}: in the manifest but the source is gone",
                e.source
            ));
        }
    }
    if !problems.is_empty() {
        bail!(
            "check-kernels found {} problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    eprintln!(
        "check-kernels: {} kernel source(s), all artifacts current",
        sources.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amd_targets_and_their_isa_versions() {
        assert_eq!(
            hip_targets().collect::<Vec<_>>(),
            ["gfx90a", "gfx940", "gfx1030", "gfx942", "gfx1100"]
        );
        // `__oclc_ISA_version` is major·1000 + minor·100 + stepping, the last two
        // digits of the processor name in hex (gfx90a is 9.0.10).
        for (target, isa) in CLANG_HIP_TARGETS {
            let digits = target.strip_prefix("gfx").unwrap();
            let (major, rest) = digits.split_at(digits.len() - 2);
            let minor = u32::from_str_radix(&rest[..1], 16).unwrap();
            let stepping = u32::from_str_radix(&rest[1..], 16).unwrap();
            let major: u32 = major.parse().unwrap();
            assert_eq!(isa, major * 1000 + minor * 100 + stepping, "{target}");
        }
    }

    #[test]
    fn serialized_wgmma_is_found_in_nvcc_diagnostics() {
        let clean = "ptxas info    : Used 168 registers\nfa.cu(281): warning #177-D: unused\n";
        assert_eq!(serialized_wgmma(clean), None);
        let remark = "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async \
                      instructions are serialized due to insufficient register resources";
        let text = format!("{clean}{remark}\nptxas info    : Compiling entry\n");
        assert_eq!(serialized_wgmma(&text), Some(remark));
    }

    #[test]
    fn launch_lines_are_parsed_and_checked() {
        let src = "// kpt:launch k_a block=256 shared=0 grid=rows\n\
                   int x;\n  // kpt:launch k_b block=128 shared=4096 grid=tiles\n";
        let eps = launch_lines(src, "t.cu").unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!((eps[0].name.as_str(), eps[0].block), ("k_a", 256));
        assert_eq!((eps[1].shared_bytes, eps[1].grid.as_str()), (4096, "tiles"));
        let err = launch_lines("// kpt:launch k block=1 grid=rows", "t.cu").unwrap_err();
        assert!(err.to_string().contains("lacks `shared=`"), "{err}");
        assert!(launch_lines("int x;", "t.cu").is_err());
        assert!(launch_lines("// kpt:launch k block=x shared=0 grid=r", "t.cu").is_err());
    }
}
