//! The GPU kernel artifact manifest, `crates/kpt-kernels/artifacts/manifest.json`:
//! written by `cargo xtask build-kernels`, verified by `cargo xtask check-kernels`, read
//! by kpt-kernels' build script to embed the artifacts. The three share this file (the
//! build script and xtask include it by path), so they cannot disagree on the format.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The whole manifest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Toolchain name -> exact version used for every artifact (e.g. `nvcc` -> `13.0.88`).
    pub toolchains: BTreeMap<String, String>,
    /// One entry per kernel source file.
    pub kernels: Vec<KernelEntry>,
}

/// The artifacts built from one kernel source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelEntry {
    /// Kernel name (the source's file stem), e.g. `rms_norm`.
    pub name: String,
    /// Source path relative to the repository root.
    pub source: String,
    /// sha256 of the source the artifacts were built from, followed by the local
    /// headers it includes.
    pub source_sha256: String,
    /// The `extern "C"` entry points and how to launch them.
    pub entry_points: Vec<EntryPoint>,
    /// One artifact per target.
    pub artifacts: Vec<ArtifactEntry>,
}

/// How to launch one entry point (from the source's `// kpt:launch` lines).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EntryPoint {
    /// Symbol name.
    pub name: String,
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
    /// What the grid spans (e.g. `rows`: one block per row).
    pub grid: String,
}

/// One compiled artifact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactEntry {
    /// Path relative to the manifest's folder.
    pub path: String,
    /// `sm_80`, `sm_90a` (cubin: that architecture), `compute_80` (PTX: JIT for it
    /// and newer) or an AMD processor such as `gfx90a` (HSACO: that processor only).
    pub target: String,
    /// `cubin`, `ptx` or `hsaco`.
    pub format: String,
    /// sha256 of the artifact.
    pub sha256: String,
}
