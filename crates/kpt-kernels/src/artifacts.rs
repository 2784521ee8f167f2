//! Compiled GPU kernels shipped inside the crate: the cubins, PTX and AMD code objects
//! (HSACO) that `cargo xtask build-kernels` wrote under `crates/kpt-kernels/artifacts/`
//! (listed in its `manifest.json`), embedded at build time, and the choice of the
//! artifact that fits a device: for CUDA an exact cubin first, then PTX for the driver to
//! JIT; for AMD the code object built for the device's processor.

pub mod manifest;

/// The binary format of an artifact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Machine code for one GPU architecture.
    Cubin,
    /// PTX, compiled by the driver for the device at load time.
    Ptx,
    /// An AMDGPU ELF code object for one processor (`gfx90a`), for `hipModuleLoadData`.
    Hsaco,
}

/// How to launch one entry point of an artifact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoint {
    /// Symbol name.
    pub name: &'static str,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
    /// What the grid spans (e.g. `rows`).
    pub grid: &'static str,
}

/// One embedded artifact.
#[derive(Debug, Clone, Copy)]
pub struct Artifact {
    /// Kernel name (its source's file stem).
    pub kernel: &'static str,
    /// Its source, relative to the repository root (`kernels/cuda/rms_norm.cu`).
    pub source: &'static str,
    /// `sm_XY` / `sm_XYa` (cubin), `compute_XY` (PTX) or an AMD processor such as
    /// `gfx90a` (HSACO).
    pub target: &'static str,
    /// Cubin, PTX or HSACO.
    pub format: Format,
    /// sha256 of `bytes`, as the manifest records it.
    pub sha256: &'static str,
    /// The toolchain versions that built it (e.g. `nvcc 13.0.88`).
    pub toolchain: &'static str,
    /// Its entry points.
    pub entry_points: &'static [EntryPoint],
    /// The cubin or PTX text.
    pub bytes: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/artifacts.rs"));

/// `(major, minor, arch-specific)` of a target such as `sm_90a` or `compute_80`.
fn parse_target(target: &str) -> Option<(u32, u32, bool)> {
    let digits = target
        .strip_prefix("sm_")
        .or_else(|| target.strip_prefix("compute_"))?;
    let (digits, specific) = match digits.strip_suffix('a') {
        Some(d) => (d, true),
        None => (digits, false),
    };
    let n: u32 = digits.parse().ok()?;
    Some((n / 10, n % 10, specific))
}

impl Artifact {
    /// Whether this artifact runs on a CUDA device of compute capability `major.minor`: a
    /// cubin for `sm_XY` on X.Y and later minors of X, one for `sm_XYa` only on X.Y; PTX
    /// for `compute_XY` on X.Y and every newer device; an AMD code object never.
    pub fn runs_on(&self, major: u32, minor: u32) -> bool {
        let Some((m, n, specific)) = parse_target(self.target) else {
            return false;
        };
        match self.format {
            Format::Cubin if specific => (m, n) == (major, minor),
            Format::Cubin => m == major && n <= minor,
            Format::Ptx => (m, n) <= (major, minor),
            Format::Hsaco => false,
        }
    }

    /// Whether this artifact's entry points wait for the previous kernel on the stream
    /// (`kpt::wait_for_producer` in `kernels/cuda/common.cuh`), so that they may be
    /// launched with programmatic stream serialization: kpt's CUDA C++ kernels compiled
    /// for sm_90 or newer. Not their PTX for `compute_80` (compiled without the wait, also
    /// when the driver JIT-compiles it for a newer GPU), nor Triton's kernels.
    pub fn waits_for_producer(&self) -> bool {
        self.source.starts_with("kernels/cuda/")
            && parse_target(self.target).is_some_and(|(major, _, _)| major >= 9)
    }
}

/// Every embedded artifact.
pub fn embedded() -> &'static [Artifact] {
    EMBEDDED
}

/// The artifacts of `kernel` that can run on a device of compute capability
/// `major.minor`, in the order to try them: cubins of the newest fitting architecture
/// first, then PTX (newest first) for the driver to JIT; cubins are left out when
/// `KPT_CUDA_JIT=1` (to exercise the path a GPU newer than every cubin takes). The
/// loader moves down the list when the driver refuses an image.
pub fn cuda_candidates(kernel: &str, major: u32, minor: u32) -> Vec<&'static Artifact> {
    let jit_only = std::env::var("KPT_CUDA_JIT").is_ok_and(|v| v == "1");
    let mut fits: Vec<&'static Artifact> = EMBEDDED
        .iter()
        .filter(|a| a.kernel == kernel && a.runs_on(major, minor))
        .filter(|a| !(jit_only && a.format == Format::Cubin))
        .collect();
    fits.sort_by_key(|a| {
        (
            a.format == Format::Ptx,
            std::cmp::Reverse(parse_target(a.target)),
        )
    });
    if fits.is_empty() {
        tracing::debug!(kernel, major, minor, "no CUDA artifact fits this device");
    }
    fits
}

/// The first of [`cuda_candidates`], or `None` (the caller falls back to the next
/// kernel of the chain).
pub fn select_cuda(kernel: &str, major: u32, minor: u32) -> Option<&'static Artifact> {
    let chosen = cuda_candidates(kernel, major, minor).into_iter().next();
    if let Some(a) = chosen {
        tracing::debug!(kernel, target = a.target, "selected CUDA artifact");
    }
    chosen
}

/// The AMD code objects of `kernel` that load on a device whose processor is
/// `processor` (`gfx90a`, the part of `gcnArchName` before the first `:`). A code object
/// runs only on the processor it was built for (gfx940 code does not load on a gfx942),
/// so at most one fits.
pub fn hsaco_candidates(kernel: &str, processor: &str) -> Vec<&'static Artifact> {
    let fits: Vec<&'static Artifact> = EMBEDDED
        .iter()
        .filter(|a| a.kernel == kernel && a.format == Format::Hsaco && a.target == processor)
        .collect();
    if fits.is_empty() {
        tracing::debug!(kernel, processor, "no AMD code object fits this device");
    }
    fits
}

/// The processors `kernel` has AMD code objects for, in the manifest's order.
pub fn hsaco_targets(kernel: &str) -> Vec<&'static str> {
    EMBEDDED
        .iter()
        .filter(|a| a.kernel == kernel && a.format == Format::Hsaco)
        .map(|a| a.target)
        .collect()
}
