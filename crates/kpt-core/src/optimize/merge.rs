//! Projection merging: linears that read the same input become one wider linear, so
//! that a decode step launches one GEMV where it launched several (LLaMA's q/k/v and
//! gate/up projections).
//!
//! Neither pass changes what is computed: each output element is the same dot product
//! of the same row and weights. Only weights of one float dtype (scale 1) are merged;
//! the precision pass that runs later converts the merged weight as one tensor.

use std::collections::{BTreeMap, HashMap};

use crate::error::Result;
use crate::graph::{Graph, Node, Op, ValueId, ValueSource};
use crate::tensor::Tensor;
use crate::DType;

use super::rewrite::Rewriter;
use super::PassReport;

/// Merges `Linear` nodes with the same input, bias flag and weight dtype into one
/// `Linear` on the row-stacked weights followed by a `Split` into the original outputs
/// (the fused QKV projection of vLLM and TensorRT-LLM).
pub fn fuse_sibling_linears(graph: &Graph) -> Result<(Graph, PassReport)> {
    let nodes = graph.nodes();
    let mut groups: BTreeMap<(ValueId, bool, Vec<usize>, DType), Vec<usize>> = BTreeMap::new();
    for (i, node) in nodes.iter().enumerate() {
        if let (Op::Linear { bias }, Some(w)) = (&node.op, linear_weights(graph, node)) {
            let key = (node.inputs[0], *bias, w.shape()[1..].to_vec(), w.dtype());
            groups.entry(key).or_default().push(i);
        }
    }
    // The first node of each group emits the merged pair; the others are dropped.
    let mut lead: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut merged = vec![false; nodes.len()];
    for members in groups.into_values().filter(|m| m.len() > 1) {
        for &m in &members {
            merged[m] = true;
        }
        lead.insert(members[0], members);
    }
    let mut report = PassReport::new("fuse_sibling_linears");
    let mut rw = Rewriter::new(graph);
    for (i, node) in nodes.iter().enumerate() {
        match lead.get(&i) {
            Some(members) => {
                let parts: Vec<&Node> = members.iter().map(|&m| &nodes[m]).collect();
                let name = joined_name(parts.iter().map(|n| n.name.as_str()));
                report.change(format!("{} -> linear + split", name));
                let merged = emit_merged_linear(&mut rw, graph, &name, &parts)?;
                let sizes = parts
                    .iter()
                    .map(|n| graph.spec(n.inputs[1]).map(|w| w.shape[0]))
                    .collect::<Result<Vec<_>>>()?;
                let axis = graph.spec(node.inputs[0])?.shape.len() - 1;
                let outputs: Vec<ValueId> = parts.iter().map(|n| n.outputs[0]).collect();
                rw.emit_new(
                    &format!("{name}.split"),
                    Op::Split { axis, sizes },
                    &[merged],
                    &outputs,
                )?;
            }
            None if merged[i] => {}
            None => rw.copy_node(i)?,
        }
    }
    Ok((rw.finish()?, report))
}

/// Merges the gated MLP `Mul(act(Linear(x, w_gate)), Linear(x, w_up))` into one
/// `Linear` on `[w_gate; w_up]` and an `ActAndMul` (SwiGLU, GeGLU), when the gate, its
/// activation and the up projection feed nothing else.
pub fn fuse_gated_mlp(graph: &Graph) -> Result<(Graph, PassReport)> {
    let nodes = graph.nodes();
    let consumers = graph.consumers();
    let producer = |v: ValueId| match graph.value(v).source {
        ValueSource::Node { node, .. } => Some(node.0),
        _ => None,
    };
    // Whether value `v` is read by node `user` only and is not a graph output.
    let only_for = |v: ValueId, user: usize| {
        consumers[v.0].len() == 1 && consumers[v.0][0].0 == user && !graph.outputs().contains(&v)
    };
    // The (gate linear, activation, up linear) of a gated Mul at index `m`.
    let pattern = |m: usize, gated: ValueId, up: ValueId| -> Option<(usize, usize, usize)> {
        let act = producer(gated)?;
        let Op::Activation { .. } = nodes[act].op else {
            return None;
        };
        let (gate, up) = (producer(nodes[act].inputs[0])?, producer(up)?);
        let (g, u) = (&nodes[gate], &nodes[up]);
        let (wg, wu) = (linear_weights(graph, g)?, linear_weights(graph, u)?);
        let fits = g.op == u.op
            && g.inputs[0] == u.inputs[0]
            && wg.shape() == wu.shape()
            && wg.dtype() == wu.dtype()
            && only_for(g.outputs[0], act)
            && only_for(nodes[act].outputs[0], m)
            && only_for(u.outputs[0], m);
        fits.then_some((gate, act, up))
    };
    let mut fused: HashMap<usize, (usize, usize, usize)> = HashMap::new();
    let mut dropped = vec![false; nodes.len()];
    for (m, node) in nodes.iter().enumerate() {
        if !matches!(node.op, Op::Mul) {
            continue;
        }
        let (a, b) = (node.inputs[0], node.inputs[1]);
        if let Some(found) = pattern(m, a, b).or_else(|| pattern(m, b, a)) {
            let (gate, act, up) = found;
            dropped[gate] = true;
            dropped[act] = true;
            dropped[up] = true;
            fused.insert(m, found);
        }
    }
    let mut report = PassReport::new("fuse_gated_mlp");
    let mut rw = Rewriter::new(graph);
    for (i, node) in nodes.iter().enumerate() {
        if let Some(&(gate, act, up)) = fused.get(&i) {
            let Op::Activation { act: f } = nodes[act].op else {
                unreachable!("matched as an activation")
            };
            let parts = [&nodes[gate], &nodes[up]];
            let name = joined_name(parts.iter().map(|n| n.name.as_str()));
            report.change(format!(
                "{name} + {} + {} -> linear + act_and_mul({})",
                nodes[act].name,
                node.name,
                f.name()
            ));
            let merged = emit_merged_linear(&mut rw, graph, &name, &parts)?;
            rw.emit_new(
                &node.name,
                Op::ActAndMul { act: f },
                &[merged],
                &node.outputs,
            )?;
        } else if !dropped[i] {
            rw.copy_node(i)?;
        }
    }
    Ok((rw.finish()?, report))
}

/// The weight of a `Linear` node when it and its bias are float parameters with scale 1.
fn linear_weights<'g>(graph: &'g Graph, node: &Node) -> Option<&'g Tensor> {
    if !matches!(node.op, Op::Linear { .. }) {
        return None;
    }
    let w = graph.param_tensor(node.inputs[1])?;
    let float = matches!(
        w.dtype(),
        DType::F64 | DType::F32 | DType::F16 | DType::BF16
    );
    let params = node.inputs[2..]
        .iter()
        .all(|&v| graph.param_tensor(v).is_some());
    (float && params && w.scale() == 1.0 && w.rank() == 2).then_some(w)
}

/// Emits `Linear` over the row-stacked weights (and biases) of `parts`, which share
/// their input; returns the new value of its output.
fn emit_merged_linear(
    rw: &mut Rewriter<'_>,
    graph: &Graph,
    name: &str,
    parts: &[&Node],
) -> Result<ValueId> {
    let first = parts[0];
    let mut inputs = vec![rw.get(first.inputs[0])];
    // Weight, then bias when there is one: the same input slot of every part.
    for slot in 1..first.inputs.len() {
        let values: Vec<ValueId> = parts.iter().map(|n| n.inputs[slot]).collect();
        let tensors: Vec<&Tensor> = values
            .iter()
            .filter_map(|&v| graph.param_tensor(v))
            .collect();
        let stacked = stack_rows(&tensors)?;
        let param_name = joined_name(values.iter().map(|&v| graph.value(v).name.as_str()));
        inputs.push(rw.param(param_name, stacked));
    }
    let outs = rw.emit_new(name, first.op.clone(), &inputs, &[])?;
    Ok(outs[0])
}

/// Concatenates tensors of one dtype along their first dimension.
fn stack_rows(tensors: &[&Tensor]) -> Result<Tensor> {
    let first = tensors[0];
    let mut shape = first.shape().to_vec();
    shape[0] = tensors.iter().map(|t| t.shape()[0]).sum();
    let mut bytes = Vec::new();
    for t in tensors {
        bytes.extend_from_slice(t.contiguous().as_bytes()?);
    }
    Tensor::from_bytes(&bytes, first.dtype(), &shape)
}

/// `a.b.q`, `a.b.k`, `a.b.v` -> `a.b.q+k+v`: the common dotted prefix once, then the
/// distinct rests joined by `+`.
fn joined_name<'a>(names: impl Iterator<Item = &'a str> + Clone) -> String {
    let first = names.clone().next().unwrap_or_default();
    let mut prefix = first.rfind('.').map_or(0, |p| p + 1);
    for n in names.clone() {
        while !n.starts_with(&first[..prefix]) {
            prefix = first[..prefix - 1].rfind('.').map_or(0, |p| p + 1);
        }
    }
    let rests: Vec<&str> = names.map(|n| &n[prefix..]).collect();
    format!("{}{}", &first[..prefix], rests.join("+"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_names_keep_the_common_prefix() {
        let names = ["layers.0.q", "layers.0.k", "layers.0.v"];
        assert_eq!(joined_name(names.into_iter()), "layers.0.q+k+v");
        let names = ["a.x.gate", "a.y.up"];
        assert_eq!(joined_name(names.into_iter()), "a.x.gate+y.up");
        let names = ["gate", "up"];
        assert_eq!(joined_name(names.into_iter()), "gate+up");
    }

    #[test]
    fn stacked_rows_keep_dtype_and_order() {
        let a = Tensor::from_vec(vec![1f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let b = Tensor::from_vec(vec![5f32, 6.0], &[1, 2]).unwrap();
        let s = stack_rows(&[&a, &b]).unwrap();
        assert_eq!(s.shape(), [3, 2]);
        assert_eq!(s.to_f64_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }
}
