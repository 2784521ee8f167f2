//! Fusion passes: linear + activation, and residual add + RMS norm or layer norm.

use crate::error::Result;
use crate::graph::{Graph, Op, ValueSource};

use super::rewrite::Rewriter;
use super::PassReport;

/// Fuses `Linear` followed by its only consumer `Activation` into `LinearAct`.
pub fn fuse_linear_activation(graph: &Graph) -> Result<(Graph, PassReport)> {
    let consumers = graph.consumers();
    let nodes = graph.nodes();
    let mut report = PassReport::new("fuse_linear_activation");
    let mut rw = Rewriter::new(graph);
    let mut skip = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        if skip[i] {
            continue;
        }
        let fused = match node.op {
            Op::Linear { bias } => {
                let out = node.outputs[0];
                match consumers[out.0].as_slice() {
                    [next] if !graph.outputs().contains(&out) => match nodes[next.0].op {
                        Op::Activation { act } => Some((next.0, Op::LinearAct { bias, act })),
                        _ => None,
                    },
                    _ => None,
                }
            }
            _ => None,
        };
        match fused {
            Some((j, op)) => {
                let act_node = &nodes[j];
                report.change(format!("{} + {} -> {op}", node.name, act_node.name));
                rw.emit(&node.name, op, &node.inputs, &act_node.outputs)?;
                skip[j] = true;
            }
            None => rw.copy_node(i)?,
        }
    }
    Ok((rw.finish()?, report))
}

/// Fuses `Add(x, r)` whose result feeds an `RmsNorm` into one `AddRmsNorm` with two
/// outputs (the sum, still available to other consumers, and the normalized sum).
pub fn fuse_add_rms_norm(graph: &Graph) -> Result<(Graph, PassReport)> {
    fuse_add_norm(graph, "fuse_add_rms_norm", |op| match *op {
        Op::RmsNorm { eps } => Some(Op::AddRmsNorm { eps }),
        _ => None,
    })
}

/// Fuses `Add(x, r)` whose result feeds a `LayerNorm` into one `AddLayerNorm` with two
/// outputs (the sum, still available to other consumers, and the normalized sum).
pub fn fuse_add_layer_norm(graph: &Graph) -> Result<(Graph, PassReport)> {
    fuse_add_norm(graph, "fuse_add_layer_norm", |op| match *op {
        Op::LayerNorm { eps } => Some(Op::AddLayerNorm { eps }),
        _ => None,
    })
}

/// Fuses `Add(x, r)` with a norm reading its sum, where `fused` maps the norm's op to
/// the fused op (inputs x, r, then the norm's parameters; outputs sum, normalized).
fn fuse_add_norm(
    graph: &Graph,
    pass: &str,
    fused: impl Fn(&Op) -> Option<Op>,
) -> Result<(Graph, PassReport)> {
    let consumers = graph.consumers();
    let nodes = graph.nodes();
    let mut report = PassReport::new(pass);
    let mut rw = Rewriter::new(graph);
    let mut skip = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        if skip[i] {
            continue;
        }
        let mut done = false;
        if matches!(node.op, Op::Add) {
            let (a, b) = (node.inputs[0], node.inputs[1]);
            let same_shape = graph.spec(a)?.shape == graph.spec(b)?.shape;
            let sum = node.outputs[0];
            let norm = consumers[sum.0].iter().find_map(|n| {
                let norm_node = &nodes[n.0];
                let op = fused(&norm_node.op)?;
                (norm_node.inputs[0] == sum).then_some((n.0, op))
            });
            // The norm must be emitted where the add is: its weight (and bias) must not
            // be values computed between the two nodes.
            let params_are_params = |n: usize| {
                nodes[n].inputs[1..]
                    .iter()
                    .all(|&v| matches!(graph.value(v).source, ValueSource::Param(_)))
            };
            if let (true, Some((n, op))) = (same_shape, norm) {
                if params_are_params(n) {
                    let norm_node = &nodes[n];
                    report.change(format!("{} + {} -> {op}", node.name, norm_node.name));
                    let mut inputs = vec![a, b];
                    inputs.extend_from_slice(&norm_node.inputs[1..]);
                    rw.emit(&norm_node.name, op, &inputs, &[sum, norm_node.outputs[0]])?;
                    skip[n] = true;
                    done = true;
                }
            }
        }
        if !done {
            rw.copy_node(i)?;
        }
    }
    Ok((rw.finish()?, report))
}
