//! Fusion passes: linear + activation, and residual add + RMS norm.

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
    let consumers = graph.consumers();
    let nodes = graph.nodes();
    let mut report = PassReport::new("fuse_add_rms_norm");
    let mut rw = Rewriter::new(graph);
    let mut skip = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        if skip[i] {
            continue;
        }
        let mut fused = false;
        if matches!(node.op, Op::Add) {
            let (a, b) = (node.inputs[0], node.inputs[1]);
            let same_shape = graph.spec(a)?.shape == graph.spec(b)?.shape;
            let sum = node.outputs[0];
            let norm = consumers[sum.0].iter().copied().find(|n| {
                matches!(nodes[n.0].op, Op::RmsNorm { .. }) && nodes[n.0].inputs[0] == sum
            });
            let weight_is_param = |n: usize| {
                matches!(
                    graph.value(nodes[n].inputs[1]).source,
                    ValueSource::Param(_)
                )
            };
            if let (true, Some(n)) = (same_shape, norm) {
                // The norm must be emitted where the add is: its weight must not be a
                // value computed between the two nodes.
                if weight_is_param(n.0) {
                    let norm_node = &nodes[n.0];
                    let Op::RmsNorm { eps } = norm_node.op else {
                        unreachable!("filtered to RmsNorm above")
                    };
                    report.change(format!(
                        "{} + {} -> add_rms_norm",
                        node.name, norm_node.name
                    ));
                    rw.emit(
                        &norm_node.name,
                        Op::AddRmsNorm { eps },
                        &[a, b, norm_node.inputs[1]],
                        &[sum, norm_node.outputs[0]],
                    )?;
                    skip[n.0] = true;
                    fused = true;
                }
            }
        }
        if !fused {
            rw.copy_node(i)?;
        }
    }
    Ok((rw.finish()?, report))
}
