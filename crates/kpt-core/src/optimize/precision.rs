//! The precision policy: which dtype the weights of each linear layer are stored in.

use crate::error::Result;
use crate::graph::{Graph, Op, TensorSpec};
use crate::hardware::{DeviceInfo, DeviceKind};
use crate::DType;

use super::activation::only_linear_weight;
use super::{KernelSelector, OptLevel, PassReport, PrecisionPolicy};

impl PrecisionPolicy {
    /// The weight dtype candidates for a level on `device`, first choice first: none at
    /// `conservative` (f32 weights), else the policy's `weight_dtype`, else bf16 at
    /// `balanced`; at `aggressive` int8 weight-only on the CPU and FP8 e4m3 on
    /// accelerators (each the other's fallback where allowed), then bf16.
    pub fn weight_candidates(&self, level: OptLevel, device: &DeviceInfo) -> Vec<DType> {
        if level == OptLevel::Conservative {
            return vec![];
        }
        if let Some(d) = self.weight_dtype {
            return vec![d];
        }
        if level == OptLevel::Balanced {
            return vec![DType::BF16];
        }
        let fp8 = self.allow_fp8.then_some(DType::F8E4M3);
        let int8 = self.allow_int8.then_some(DType::I8);
        let compact = if device.kind == DeviceKind::Cpu {
            [int8, fp8]
        } else {
            [fp8, int8]
        };
        compact.into_iter().flatten().chain([DType::BF16]).collect()
    }
}

/// Converts the weights of linear layers to the policy's dtype, where a kernel for
/// the converted layer exists on the device; otherwise the layer is left as it is.
pub fn apply_precision(
    graph: &Graph,
    level: OptLevel,
    policy: &PrecisionPolicy,
    selector: &dyn KernelSelector,
    device: &DeviceInfo,
) -> Result<(Graph, PassReport)> {
    let mut report = PassReport::new("precision");
    let candidates = policy.weight_candidates(level, device);
    let mut out = graph.clone();
    if candidates.is_empty() {
        return Ok((out, report));
    }
    let consumers = graph.consumers();
    for node in graph.nodes() {
        if !matches!(node.op, Op::Linear { .. } | Op::LinearAct { .. }) {
            continue;
        }
        let w = node.inputs[1];
        let Some(tensor) = graph.param_tensor(w) else {
            continue;
        };
        // A weight shared with another use (e.g. an embedding table tied to the output
        // layer) keeps its dtype: only linear weight slots read compact weights.
        if !only_linear_weight(graph, &consumers, w) {
            report.change(format!(
                "{}: kept {} weight (shared with another op)",
                node.name,
                tensor.dtype()
            ));
            continue;
        }
        if tensor.dtype() != DType::F32 {
            continue;
        }
        let specs: Vec<TensorSpec> = node
            .inputs
            .iter()
            .map(|&v| graph.spec(v).cloned())
            .collect::<Result<_>>()?;
        let chosen = candidates.iter().copied().find(|&d| {
            let mut s = specs.clone();
            s[1].dtype = d;
            selector.select(&node.op, &s, device).is_ok()
        });
        match chosen {
            Some(d) => {
                out.set_param(w, tensor.to_dtype(d)?)?;
                report.change(format!("{}: weight f32 -> {d}", node.name));
            }
            None => report.change(format!(
                "{}: kept f32 weight (no kernel for {} weights on {})",
                node.name,
                candidates
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join("/"),
                device.name
            )),
        }
    }
    Ok((out, report))
}
