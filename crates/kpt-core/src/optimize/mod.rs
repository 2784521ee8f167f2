//! The manager: `auto_optimize` turns a graph into an executable [`Plan`] by running
//! deterministic passes, each of which reports what it changed.
//!
//! | level        | fusion | activations        | weights                              | kernels  | memory |
//! |--------------|--------|--------------------|--------------------------------------|----------|--------|
//! | conservative | yes    | as built           | f32 (numerics change only by fp32 rounding) | registry | reuse |
//! | balanced     | yes    | bf16 on GPUs       | bf16                                 | registry | reuse  |
//! | aggressive   | yes    | bf16 on GPUs       | fp8 e4m3 (else int8, else bf16)      | registry | reuse  |
//!
//! Activations follow [`default_activation_dtype`] unless the config's
//! `precision.activation_dtype` says otherwise (see [`apply_activation_precision`]).
//!
//! Kernel choice goes through a [`KernelSelector`] (the kernel registry of
//! `kpt-kernels` implements it); kpt-core itself knows no kernel.

mod activation;
mod fusion;
mod memory;
mod merge;
mod precision;
mod rewrite;
mod rotary;

pub use activation::{apply_activation_precision, default_activation_dtype};
pub use fusion::{fuse_add_layer_norm, fuse_add_rms_norm, fuse_linear_activation};
pub use memory::{plan_memory, MemoryPlan};
pub use merge::{fuse_gated_mlp, fuse_sibling_linears};
pub use precision::apply_precision;
pub use rotary::{fuse_rotary_cache_writes, fuse_split_rotary};

use serde::{Deserialize, Serialize};

use crate::config::KptConfig;
pub use crate::config::OptLevel;
use crate::error::Result;
use crate::graph::{Graph, Op, TensorSpec};
use crate::hardware::{DeviceInfo, DeviceKind};
use crate::DType;

/// What one pass changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassReport {
    /// Pass name.
    pub pass: String,
    /// One line per change.
    pub changes: Vec<String>,
}

impl PassReport {
    /// An empty report for `pass`.
    pub fn new(pass: &str) -> Self {
        Self {
            pass: pass.to_string(),
            changes: Vec::new(),
        }
    }

    /// Records a change.
    pub fn change(&mut self, what: String) {
        self.changes.push(what);
    }
}

/// The kernel picked for one node, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelChoice {
    /// Registry name of the kernel.
    pub kernel: String,
    /// Backend that runs it.
    pub backend: DeviceKind,
    /// Why other candidates were skipped.
    pub skipped: Vec<String>,
}

/// Picks a kernel for an op on a device (implemented by the kernel registry).
pub trait KernelSelector {
    /// The best kernel for `op` with inputs `inputs` on `device`, or a
    /// [`crate::KptError::NoKernel`] that lists why every candidate was rejected.
    fn select(&self, op: &Op, inputs: &[TensorSpec], device: &DeviceInfo) -> Result<KernelChoice>;
}

/// Precision choices that the config can override.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrecisionPolicy {
    /// Forces one weight dtype for linear layers at every level but conservative.
    pub weight_dtype: Option<DType>,
    /// Whether FP8 weights may be chosen.
    pub allow_fp8: bool,
    /// Whether int8 weights may be chosen.
    pub allow_int8: bool,
    /// The dtype f32 activations compute in at every level but conservative; `None`
    /// takes the device's default ([`default_activation_dtype`]: bf16 on GPUs, f32 on
    /// the CPU), `Some(F32)` keeps f32 everywhere.
    pub activation_dtype: Option<DType>,
}

impl Default for PrecisionPolicy {
    fn default() -> Self {
        Self {
            weight_dtype: None,
            allow_fp8: true,
            allow_int8: true,
            activation_dtype: None,
        }
    }
}

impl PrecisionPolicy {
    /// The policy from the `precision` section of a config.
    pub fn from_config(config: &KptConfig) -> Self {
        Self {
            weight_dtype: config.precision.weight_dtype,
            allow_fp8: config.precision.allow_fp8,
            allow_int8: config.precision.allow_int8,
            activation_dtype: config.precision.activation_dtype,
        }
    }
}

/// An optimized graph with a kernel per node and a memory plan: ready to execute.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The level it was optimized at.
    pub level: OptLevel,
    /// The optimized graph.
    pub graph: Graph,
    /// The kernel of each node, in node order.
    pub kernels: Vec<KernelChoice>,
    /// Buffer reuse.
    pub memory: MemoryPlan,
    /// What every pass did, in order.
    pub reports: Vec<PassReport>,
}

/// Chooses kernels for every node of `graph`.
pub fn select_kernels(
    graph: &Graph,
    selector: &dyn KernelSelector,
    device: &DeviceInfo,
) -> Result<(Vec<KernelChoice>, PassReport)> {
    let mut report = PassReport::new("kernel_selection");
    let mut choices = Vec::with_capacity(graph.nodes().len());
    for node in graph.nodes() {
        let specs: Vec<TensorSpec> = node
            .inputs
            .iter()
            .map(|&v| graph.spec(v).cloned())
            .collect::<Result<_>>()?;
        let choice = selector.select(&node.op, &specs, device)?;
        report.change(format!("{}: {} -> {}", node.name, node.op, choice.kernel));
        choices.push(choice);
    }
    Ok((choices, report))
}

/// Runs every pass of `level` on `graph` and returns the plan.
pub fn auto_optimize(
    graph: &Graph,
    level: OptLevel,
    policy: &PrecisionPolicy,
    selector: &dyn KernelSelector,
    device: &DeviceInfo,
) -> Result<Plan> {
    let _span = tracing::info_span!("auto_optimize", level = level.name()).entered();
    let mut reports = Vec::new();
    let (g, r) = fuse_gated_mlp(graph)?;
    reports.push(r);
    let (g, r) = fuse_linear_activation(&g)?;
    reports.push(r);
    let (g, r) = fuse_sibling_linears(&g)?;
    reports.push(r);
    let (g, r) = fuse_split_rotary(&g)?;
    reports.push(r);
    let (g, r) = fuse_add_rms_norm(&g)?;
    reports.push(r);
    let (g, r) = fuse_add_layer_norm(&g)?;
    reports.push(r);
    let (g, r) = apply_activation_precision(&g, level, policy, selector, device)?;
    reports.push(r);
    let (g, r) = fuse_rotary_cache_writes(&g)?;
    reports.push(r);
    let (g, r) = apply_precision(&g, level, policy, selector, device)?;
    reports.push(r);
    let (kernels, r) = select_kernels(&g, selector, device)?;
    reports.push(r);
    let memory = plan_memory(&g);
    let mut r = PassReport::new("memory_plan");
    r.change(format!(
        "{} intermediate buffers -> {} slots, {} -> {} bytes",
        memory.slot_of.iter().filter(|s| s.is_some()).count(),
        memory.num_slots(),
        memory.naive_bytes,
        memory.planned_bytes
    ));
    reports.push(r);
    for r in &reports {
        tracing::debug!(pass = %r.pass, changes = r.changes.len(), "pass done");
    }
    Ok(Plan {
        level,
        graph: g,
        kernels,
        memory,
        reports,
    })
}
