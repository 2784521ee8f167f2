//! The kernel registry: which kernels exist, which of them can run an op on a
//! device, in what order they are tried (the fallback chain), and why.

use std::collections::BTreeMap;

use kpt_core::graph::{Op, OpKind, TensorSpec};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::optimize::{KernelChoice, KernelSelector};
use kpt_core::{DType, KptError, Result};
use serde::{Deserialize, Serialize};

/// Shape limits a kernel declares; `None` means unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeLimits {
    /// Largest attention head dimension.
    pub max_head_dim: Option<usize>,
    /// Attention head dimension must be a multiple of this.
    pub head_dim_multiple: Option<usize>,
    /// Largest reduction (K) dimension of a GEMM.
    pub max_k: Option<usize>,
    /// Largest row count (M, the product of every dim but the last of the activations)
    /// of a linear op: kernels built for decode-sized calls leave larger ones to GEMMs.
    #[serde(default)]
    pub max_rows: Option<usize>,
    /// Largest last dimension of a row-wise op (norms, softmax).
    pub max_row: Option<usize>,
    /// The last dimension of a row-wise op must be a multiple of this.
    pub row_multiple: Option<usize>,
    /// Takes variable-length (packed) attention batches.
    #[serde(default)]
    pub varlen: bool,
    /// Takes keys and values in a paged cache (block tables).
    #[serde(default)]
    pub paged: bool,
    /// Rejects sliding-window attention.
    #[serde(default)]
    pub no_window: bool,
    /// Takes the softmax log-sum-exp (`AttentionParams::lse`): gives it from the forward,
    /// uses it in the backward.
    #[serde(default)]
    pub lse: bool,
    /// Applies attention dropout (`AttentionParams::dropout`).
    #[serde(default)]
    pub dropout: bool,
}

/// What a kernel is and what it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelDef {
    /// Unique name, `backend.family.variant` (e.g. `cpu.linear.gemv`).
    pub name: String,
    /// The op it implements.
    pub op: OpKind,
    /// The backend that runs it.
    pub backend: DeviceKind,
    /// Accepted dtypes of the first input (activations).
    pub dtypes: Vec<DType>,
    /// Accepted weight dtypes for linear ops (second input); empty = any of `dtypes`.
    pub weight_dtypes: Vec<DType>,
    /// Minimum architecture, e.g. `sm_80` or `gfx90a`; `None` = any.
    pub min_arch: Option<String>,
    /// The exact architectures it was built for (AMD code objects load only on their
    /// own processor: `gfx90a`, `gfx940`, ...); empty = any.
    #[serde(default)]
    pub targets: Vec<String>,
    /// Device features it needs (e.g. `avx2`, `fp8`).
    pub features: Vec<String>,
    /// Shape limits.
    pub limits: ShapeLimits,
    /// Higher runs first.
    pub priority: i32,
    /// One line on how it works.
    pub description: String,
    /// A CPU kernel any backend may run on the host, copying the data over and back
    /// (the last step of every device's fallback chain).
    #[serde(default)]
    pub host_fallback: bool,
}

impl KernelDef {
    /// A kernel definition with no arch, feature or shape requirement.
    pub fn new(
        name: &str,
        op: OpKind,
        backend: DeviceKind,
        dtypes: &[DType],
        priority: i32,
        description: &str,
    ) -> Self {
        Self {
            name: name.to_string(),
            op,
            backend,
            dtypes: dtypes.to_vec(),
            weight_dtypes: Vec::new(),
            min_arch: None,
            targets: Vec::new(),
            features: Vec::new(),
            limits: ShapeLimits::default(),
            priority,
            description: description.to_string(),
            host_fallback: false,
        }
    }

    /// Sets the accepted weight dtypes.
    pub fn weights(mut self, dtypes: &[DType]) -> Self {
        self.weight_dtypes = dtypes.to_vec();
        self
    }

    /// Requires device features.
    pub fn needs(mut self, features: &[&str]) -> Self {
        self.features = features.iter().map(|f| f.to_string()).collect();
        self
    }

    /// Requires a minimum architecture.
    pub fn min_arch(mut self, arch: &str) -> Self {
        self.min_arch = Some(arch.to_string());
        self
    }

    /// Restricts the kernel to the architectures it was built for (see
    /// [`KernelDef::targets`]).
    pub fn targets(mut self, targets: &[&str]) -> Self {
        self.targets = targets.iter().map(|t| t.to_string()).collect();
        self
    }

    /// Lets every backend run this CPU kernel on the host (see
    /// [`KernelDef::host_fallback`]).
    pub fn host_fallback(mut self) -> Self {
        self.host_fallback = true;
        self
    }

    /// Sets the priority (higher is tried first among unmeasured kernels).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Sets shape limits.
    pub fn limits(mut self, limits: ShapeLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Why this kernel cannot run `op` with `inputs` on `device`, or `None` if it can.
    pub fn rejection(&self, op: &Op, inputs: &[TensorSpec], device: &DeviceInfo) -> Option<String> {
        let on_host = self.host_fallback && self.backend == DeviceKind::Cpu;
        if self.backend != device.kind && !on_host {
            return Some(format!(
                "runs on {}, device is {}",
                self.backend, device.kind
            ));
        }
        if self.op != op.kind() {
            return Some(format!("implements {}, not {}", self.op, op.kind()));
        }
        let first = inputs.first()?;
        // Ops whose first input is an index tensor are keyed by their second input.
        let data = if first.dtype.is_index() {
            inputs.get(1).unwrap_or(first)
        } else {
            first
        };
        let data_dtype = match op {
            Op::Dequantize { dtype } => *dtype,
            _ => data.dtype,
        };
        if !self.dtypes.contains(&data_dtype) {
            return Some(format!(
                "no {data_dtype} support (has {})",
                names(&self.dtypes)
            ));
        }
        if matches!(op, Op::Linear { .. } | Op::LinearAct { .. }) {
            if let Some(w) = inputs.get(1) {
                let allowed = if self.weight_dtypes.is_empty() {
                    &self.dtypes
                } else {
                    &self.weight_dtypes
                };
                if !allowed.contains(&w.dtype) {
                    return Some(format!("no {} weights (has {})", w.dtype, names(allowed)));
                }
            }
        }
        if let Op::Quantize { dtype, .. } = op {
            if !self.weight_dtypes.is_empty() && !self.weight_dtypes.contains(dtype) {
                return Some(format!("cannot produce {dtype}"));
            }
        }
        if let Some(min) = &self.min_arch {
            match device.arch.as_deref() {
                Some(arch) if arch_at_least(arch, min) => {}
                Some(arch) => return Some(format!("needs {min}, device is {arch}")),
                None => return Some(format!("needs {min}, device arch unknown")),
            }
        }
        if !self.targets.is_empty() {
            let built = self.targets.join("/");
            match device.arch.as_deref() {
                Some(arch) if self.targets.iter().any(|t| t == arch) => {}
                Some(arch) => return Some(format!("built for {built} only, device is {arch}")),
                None => return Some(format!("built for {built} only, device arch unknown")),
            }
        }
        if let Some(f) = self.features.iter().find(|f| !device.features.contains(f)) {
            return Some(format!("needs CPU/device feature {f}"));
        }
        if let Op::Attention(p) | Op::AttentionBackward(p) = op {
            if p.window.is_some() && self.limits.no_window {
                return Some("no sliding window".into());
            }
            if p.varlen && !self.limits.varlen {
                return Some("no variable-length sequences".into());
            }
            if p.paged && !self.limits.paged {
                return Some("no paged KV cache".into());
            }
            if p.lse && !self.limits.lse {
                return Some("no log-sum-exp".into());
            }
            if p.dropout.is_some() && !self.limits.dropout {
                return Some("no dropout".into());
            }
            if let Some(max) = self.limits.max_head_dim.filter(|&m| p.head_dim > m) {
                return Some(format!("head_dim {} > {max}", p.head_dim));
            }
            if let Some(m) = self
                .limits
                .head_dim_multiple
                .filter(|&m| p.head_dim % m != 0)
            {
                return Some(format!("head_dim {} not a multiple of {m}", p.head_dim));
            }
        }
        if matches!(
            op,
            Op::RmsNorm { .. }
                | Op::AddRmsNorm { .. }
                | Op::LayerNorm { .. }
                | Op::AddLayerNorm { .. }
                | Op::Softmax
        ) {
            let row = first.shape.last().copied().unwrap_or(1);
            if let Some(max) = self.limits.max_row.filter(|&m| row > m) {
                return Some(format!("row length {row} > {max}"));
            }
            if let Some(m) = self.limits.row_multiple.filter(|&m| row % m != 0) {
                return Some(format!("row length {row} not a multiple of {m}"));
            }
        }
        if let (Some(max), Op::Linear { .. } | Op::LinearAct { .. } | Op::MatMul) =
            (self.limits.max_k, op)
        {
            let k = first.shape.last().copied().unwrap_or(0);
            if k > max {
                return Some(format!("K = {k} > {max}"));
            }
        }
        if let (Some(max), Op::Linear { .. } | Op::LinearAct { .. }) = (self.limits.max_rows, op) {
            let k = first.shape.last().copied().unwrap_or(1).max(1);
            let rows = first.numel() / k;
            if rows > max {
                return Some(format!("M = {rows} > {max}"));
            }
        }
        None
    }
}

fn names(d: &[DType]) -> String {
    d.iter().map(|d| d.name()).collect::<Vec<_>>().join("/")
}

/// Compares architecture names of one family: `sm_90a >= sm_80`, `gfx942 >= gfx90a`.
/// Names of different families never compare as at-least.
pub fn arch_at_least(arch: &str, min: &str) -> bool {
    fn split(a: &str) -> Option<(&str, u32)> {
        let a = a.trim();
        let (family, rest) = if let Some(r) = a.strip_prefix("sm_") {
            ("sm", r)
        } else if let Some(r) = a.strip_prefix("gfx") {
            ("gfx", r)
        } else if let Some(r) = a.strip_prefix('v') {
            ("tpu", r)
        } else {
            return None;
        };
        // gfx numbers are hexadecimal (gfx90a); sm and TPU numbers are decimal with an
        // optional letter suffix (sm_90a, v5e) that does not change the order.
        let radix = if family == "gfx" { 16 } else { 10 };
        let digits: String = rest.chars().take_while(|c| c.is_digit(radix)).collect();
        u32::from_str_radix(&digits, radix)
            .ok()
            .map(|n| (family, n))
    }
    match (split(arch), split(min)) {
        (Some((fa, a)), Some((fb, b))) => fa == fb && a >= b,
        _ => false,
    }
}

/// One line of [`KernelRegistry::explain`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// Kernel name.
    pub kernel: String,
    /// Its declared priority.
    pub priority: i32,
    /// Measured time in microseconds from the autotune cache, if any.
    pub measured_us: Option<u64>,
    /// Position in the fallback chain (0 = chosen), or `None` if rejected.
    pub rank: Option<usize>,
    /// Why it was chosen, kept as a fallback, or rejected.
    pub reason: String,
}

/// Every known kernel, with selection by hardware, precision and preference.
#[derive(Debug, Clone, Default)]
pub struct KernelRegistry {
    kernels: Vec<KernelDef>,
    disabled: Vec<String>,
    preferred: Vec<String>,
    autotune: BTreeMap<String, u64>,
}

impl KernelRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a kernel; a kernel with the same name and op is replaced.
    pub fn register(&mut self, def: KernelDef) {
        self.kernels
            .retain(|k| !(k.name == def.name && k.op == def.op));
        self.kernels.push(def);
    }

    /// Every registered kernel.
    pub fn kernels(&self) -> &[KernelDef] {
        &self.kernels
    }

    /// Kernels of one op.
    pub fn for_op(&self, op: OpKind) -> impl Iterator<Item = &KernelDef> {
        self.kernels.iter().filter(move |k| k.op == op)
    }

    /// Never selects these kernels (the `kernel.disable` config).
    pub fn set_disabled(&mut self, names: &[String]) {
        self.disabled = names.to_vec();
    }

    /// Puts these kernels first when they qualify (the `kernel.prefer` config).
    pub fn set_preferred(&mut self, names: &[String]) {
        self.preferred = names.to_vec();
    }

    /// Records a measured time (µs) of a kernel for an op signature; measured kernels
    /// are ordered by time before unmeasured ones.
    pub fn record_timing(&mut self, kernel: &str, op: &Op, inputs: &[TensorSpec], micros: u64) {
        self.autotune.insert(tune_key(kernel, op, inputs), micros);
    }

    /// Every kernel of `op`'s kind with its rank in the fallback chain or why it was rejected.
    pub fn explain(&self, op: &Op, inputs: &[TensorSpec], device: &DeviceInfo) -> Vec<Candidate> {
        let mut accepted = Vec::new();
        let mut out = Vec::new();
        for k in self.for_op(op.kind()) {
            let measured_us = self.autotune.get(&tune_key(&k.name, op, inputs)).copied();
            let rejection = if self.disabled.contains(&k.name) {
                Some("disabled by kernel.disable".to_string())
            } else {
                k.rejection(op, inputs, device)
            };
            match rejection {
                Some(reason) => out.push(Candidate {
                    kernel: k.name.clone(),
                    priority: k.priority,
                    measured_us,
                    rank: None,
                    reason,
                }),
                None => accepted.push((k, measured_us)),
            }
        }
        let preferred = |k: &KernelDef| {
            self.preferred
                .iter()
                .position(|p| *p == k.name)
                .unwrap_or(usize::MAX)
        };
        accepted.sort_by(|(a, ta), (b, tb)| {
            preferred(a)
                .cmp(&preferred(b))
                .then_with(|| match (ta, tb) {
                    (Some(x), Some(y)) => x.cmp(y),
                    (Some(_), None) => std::cmp::Ordering::Less,
                    (None, Some(_)) => std::cmp::Ordering::Greater,
                    (None, None) => std::cmp::Ordering::Equal,
                })
                .then_with(|| b.priority.cmp(&a.priority))
                .then_with(|| a.name.cmp(&b.name))
        });
        let mut chain: Vec<Candidate> = accepted
            .into_iter()
            .enumerate()
            .map(|(rank, (k, measured_us))| {
                let why = if preferred(k) != usize::MAX {
                    "preferred by kernel.prefer".to_string()
                } else if let Some(t) = measured_us {
                    format!("measured {t} µs")
                } else {
                    format!("priority {}", k.priority)
                };
                let reason = if rank == 0 {
                    format!("selected: {why}")
                } else {
                    format!("fallback #{rank}: {why}")
                };
                Candidate {
                    kernel: k.name.clone(),
                    priority: k.priority,
                    measured_us,
                    rank: Some(rank),
                    reason,
                }
            })
            .collect();
        chain.extend(out);
        chain
    }

    /// The kernels that can run `op`, best first.
    pub fn fallback_chain(
        &self,
        op: &Op,
        inputs: &[TensorSpec],
        device: &DeviceInfo,
    ) -> Vec<String> {
        self.explain(op, inputs, device)
            .into_iter()
            .filter(|c| c.rank.is_some())
            .map(|c| c.kernel)
            .collect()
    }
}

fn tune_key(kernel: &str, op: &Op, inputs: &[TensorSpec]) -> String {
    let specs: Vec<String> = inputs.iter().map(|s| s.to_string()).collect();
    format!("{kernel}|{op}|{}", specs.join(","))
}

impl KernelSelector for KernelRegistry {
    fn select(&self, op: &Op, inputs: &[TensorSpec], device: &DeviceInfo) -> Result<KernelChoice> {
        let candidates = self.explain(op, inputs, device);
        for c in &candidates {
            tracing::debug!(
                op = %op,
                device = %device.name,
                kernel = %c.kernel,
                rank = ?c.rank,
                reason = %c.reason,
                "kernel selection"
            );
        }
        match candidates.iter().find(|c| c.rank == Some(0)) {
            Some(best) => Ok(KernelChoice {
                kernel: best.kernel.clone(),
                backend: device.kind,
                skipped: candidates
                    .iter()
                    .filter(|c| c.rank != Some(0))
                    .map(|c| format!("{}: {}", c.kernel, c.reason))
                    .collect(),
            }),
            None => Err(KptError::NoKernel {
                op: format!(
                    "{op} with inputs [{}]",
                    inputs
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                backend: device.name.clone(),
                reasons: if candidates.is_empty() {
                    vec![format!("no kernel registered for {}", op.kind())]
                } else {
                    candidates
                        .iter()
                        .map(|c| format!("{}: {}", c.kernel, c.reason))
                        .collect()
                },
            }),
        }
    }
}
