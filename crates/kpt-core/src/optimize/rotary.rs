//! Split + rotary fusion: the last-axis `Split` of a merged QKV projection and the
//! `Rotary` ops on its q and k parts become one [`Op::SplitRotary`], so that a decode
//! step launches one kernel where it launched five (three copies and two rotations).
//!
//! Nothing computed changes: each element of q and k is the same rotation of the same
//! input element by the same angle, and v is the same copy.

use std::collections::HashMap;

use crate::error::Result;
use crate::graph::{Graph, Node, NodeId, Op, ValueId, ValueSource};

use super::rewrite::Rewriter;
use super::PassReport;

/// The only node reading `v`, when it is not a graph output.
fn only_reader(graph: &Graph, consumers: &[Vec<NodeId>], v: ValueId) -> Option<usize> {
    match consumers[v.0].as_slice() {
        [n] if !graph.outputs().contains(&v) => Some(n.0),
        _ => None,
    }
}

/// Whether `v` exists before node `at` runs (an input, a parameter or an earlier node's
/// output): a fused node is emitted where the first node it replaces was.
fn defined_before(graph: &Graph, v: ValueId, at: usize) -> bool {
    match graph.value(v).source {
        ValueSource::Node { node, .. } => node.0 < at,
        _ => true,
    }
}

/// A match at node `i`: the fused op that takes node `i`'s place, with its inputs and
/// the source values its outputs stand for, and the two later nodes it absorbs.
struct Found {
    absorbed: [usize; 2],
    op: Op,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

/// `graph` with each match's fused node where the first node it replaces was and the
/// nodes it absorbs left out; one change line per match, `first + a + b -> op`.
fn rebuild(graph: &Graph, pass: &str, fused: HashMap<usize, Found>) -> Result<(Graph, PassReport)> {
    let nodes = graph.nodes();
    let mut dropped = vec![false; nodes.len()];
    for f in fused.values() {
        for &a in &f.absorbed {
            dropped[a] = true;
        }
    }
    let mut report = PassReport::new(pass);
    let mut rw = Rewriter::new(graph);
    for (i, node) in nodes.iter().enumerate() {
        if let Some(f) = fused.get(&i) {
            let [a, b] = f.absorbed.map(|a| &nodes[a].name);
            report.change(format!("{} + {a} + {b} -> {}", node.name, f.op));
            rw.emit(&node.name, f.op.clone(), &f.inputs, &f.outputs)?;
        } else if !dropped[i] {
            rw.copy_node(i)?;
        }
    }
    Ok((rw.finish()?, report))
}

/// Fuses a three-way last-axis `Split` whose outputs 0 (q) and 1 (k) are each read only
/// by one `Rotary` (as its x), both with the same positions value and parameters, and are
/// not graph outputs, into one `SplitRotary` with the rotaries' outputs and the split's
/// third output (v). Runs after [`fuse_sibling_linears`](super::fuse_sibling_linears),
/// which makes these splits.
pub fn fuse_split_rotary(graph: &Graph) -> Result<(Graph, PassReport)> {
    let nodes = graph.nodes();
    let consumers = graph.consumers();
    let only_reader = |v: ValueId| only_reader(graph, &consumers, v);
    let matched = |i: usize, node: &Node| -> Result<Option<Found>> {
        let Op::Split { axis, sizes } = &node.op else {
            return Ok(None);
        };
        let rank = graph.spec(node.inputs[0])?.shape.len();
        if sizes.len() != 3 || *axis + 1 != rank {
            return Ok(None);
        }
        let (Some(q), Some(k)) = (only_reader(node.outputs[0]), only_reader(node.outputs[1]))
        else {
            return Ok(None);
        };
        let (qn, kn) = (&nodes[q], &nodes[k]);
        let Op::Rotary {
            head_dim,
            theta,
            scaling,
        } = &qn.op
        else {
            return Ok(None);
        };
        let positions = qn.inputs[1];
        let fits = q != k
            && qn.op == kn.op
            && qn.inputs[0] == node.outputs[0]
            && kn.inputs == [node.outputs[1], positions]
            && defined_before(graph, positions, i);
        if !fits {
            return Ok(None);
        }
        let op = Op::SplitRotary {
            head_dim: *head_dim,
            theta: *theta,
            scaling: *scaling,
            sizes: sizes.clone(),
            cache: false,
        };
        // The fused op must accept the shapes (e.g. head_dim dividing q and k).
        let specs = [
            graph.spec(node.inputs[0])?.clone(),
            graph.spec(positions)?.clone(),
        ];
        Ok(op.infer(&specs).is_ok().then(|| Found {
            absorbed: [q, k],
            op,
            inputs: vec![node.inputs[0], positions],
            outputs: vec![qn.outputs[0], kn.outputs[0], node.outputs[2]],
        }))
    };
    let mut fused = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        if let Some(found) = matched(i, node)? {
            fused.insert(i, found);
        }
    }
    rebuild(graph, "fuse_split_rotary", fused)
}

/// Fuses a plain `SplitRotary` whose k and v outputs are each read only by one
/// `CacheWrite` (as its rows), both with the same slots, and are not graph outputs, into
/// one `SplitRotary` with `cache` that takes the caches and slots and gives the
/// `CacheWrite`s' outputs: a decode step launches one kernel where it launched three.
/// Runs after [`apply_activation_precision`](super::apply_activation_precision), so the
/// caches already have their final dtype (a cast between k and its cache leaves the
/// pattern unfused).
pub fn fuse_rotary_cache_writes(graph: &Graph) -> Result<(Graph, PassReport)> {
    let nodes = graph.nodes();
    let consumers = graph.consumers();
    let only_reader = |v: ValueId| only_reader(graph, &consumers, v);
    let matched = |i: usize, node: &Node| -> Result<Option<Found>> {
        let op @ Op::SplitRotary { cache: false, .. } = &node.op else {
            return Ok(None);
        };
        let (Some(kw), Some(vw)) = (only_reader(node.outputs[1]), only_reader(node.outputs[2]))
        else {
            return Ok(None);
        };
        let (kn, vn) = (&nodes[kw], &nodes[vw]);
        let fits = kw != vw
            && kn.op == Op::CacheWrite
            && vn.op == Op::CacheWrite
            && kn.inputs[1] == node.outputs[1]
            && vn.inputs[1] == node.outputs[2]
            && kn.inputs[2] == vn.inputs[2]
            && kn.inputs[0] != vn.inputs[0]
            && [kn.inputs[0], vn.inputs[0], kn.inputs[2]]
                .iter()
                .all(|&v| defined_before(graph, v, i));
        if !fits {
            return Ok(None);
        }
        let fused = op.split_rotary_with_cache(true)?;
        let inputs = vec![
            node.inputs[0],
            node.inputs[1],
            kn.inputs[0],
            vn.inputs[0],
            kn.inputs[2],
        ];
        let specs = inputs
            .iter()
            .map(|&v| graph.spec(v).cloned())
            .collect::<Result<Vec<_>>>()?;
        Ok(fused.infer(&specs).is_ok().then(|| Found {
            absorbed: [kw, vw],
            op: fused,
            inputs,
            outputs: vec![node.outputs[0], kn.outputs[0], vn.outputs[0]],
        }))
    };
    let mut fused = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        if let Some(found) = matched(i, node)? {
            fused.insert(i, found);
        }
    }
    rebuild(graph, "fuse_rotary_cache_writes", fused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::RopeScaling;
    use crate::DType;

    fn rope(theta: f32) -> Op {
        Op::Rotary {
            head_dim: 4,
            theta,
            scaling: None,
        }
    }

    /// qkv `[2, 3, 16]` -> split [8, 4, 4] -> rotary on q and k -> attention-like sum.
    /// `variant` breaks the pattern in one way (0: none).
    fn graph(variant: u8) -> Graph {
        let mut g = Graph::new();
        let qkv = g.input("qkv", DType::F32, &[2, 3, 16]);
        let pos = g.input("pos", DType::I64, &[3]);
        let pos2 = g.input("pos2", DType::I64, &[2, 3]);
        let sizes = if variant == 1 {
            vec![8, 8]
        } else {
            vec![8, 4, 4]
        };
        let axis = if variant == 2 { 1 } else { 2 };
        let (qkv, sizes) = if variant == 2 {
            (g.input("qkv_t", DType::F32, &[1, 16, 3, 4]), vec![8, 4, 4])
        } else {
            (qkv, sizes)
        };
        let parts = g
            .op_multi("attn.qkv.split", Op::Split { axis, sizes }, &[qkv])
            .unwrap();
        let q_pos = if variant == 3 { pos2 } else { pos };
        let k_op = if variant == 4 {
            rope(500.0)
        } else {
            rope(10000.0)
        };
        let q = g
            .op("attn.q_rope", rope(10000.0), &[parts[0], q_pos])
            .unwrap();
        let k = if variant == 5 {
            parts[1]
        } else {
            g.op("attn.k_rope", k_op, &[parts[1], pos]).unwrap()
        };
        if variant == 6 {
            // The unrotated q is read by a second node.
            let extra = g.op("leak", Op::Softmax, &[parts[0]]).unwrap();
            g.output(extra).unwrap();
        }
        if variant == 7 {
            g.output(parts[1]).unwrap();
        }
        for v in parts.iter().skip(2) {
            g.output(*v).unwrap();
        }
        g.output(q).unwrap();
        g.output(k).unwrap();
        g
    }

    fn kinds(g: &Graph) -> Vec<String> {
        g.nodes().iter().map(|n| n.op.kind().to_string()).collect()
    }

    #[test]
    fn split_and_two_rotaries_become_one_op() {
        let src = graph(0);
        let (g, report) = fuse_split_rotary(&src).unwrap();
        assert_eq!(
            report.changes,
            ["attn.qkv.split + attn.q_rope + attn.k_rope -> split_rotary"]
        );
        assert_eq!(kinds(&g), ["split_rotary"]);
        let node = &g.nodes()[0];
        assert_eq!(
            node.op,
            Op::SplitRotary {
                head_dim: 4,
                theta: 10000.0,
                scaling: None,
                sizes: vec![8, 4, 4],
                cache: false,
            }
        );
        assert_eq!(g.value(node.inputs[1]).name, "pos");
        // Outputs: v (the split's third part), then q and k rotated, as declared.
        assert_eq!(
            g.outputs(),
            [node.outputs[2], node.outputs[0], node.outputs[1]]
        );
        let shapes: Vec<Vec<usize>> = g
            .outputs()
            .iter()
            .map(|&o| g.spec(o).unwrap().shape.clone())
            .collect();
        assert_eq!(shapes, [vec![2, 3, 4], vec![2, 3, 8], vec![2, 3, 4]]);
        // Idempotent.
        let (again, report) = fuse_split_rotary(&g).unwrap();
        assert!(report.changes.is_empty());
        assert_eq!(again, g);
    }

    #[test]
    fn other_shapes_of_the_pattern_stay() {
        // 1: two parts; 2: not the last axis; 3: different positions; 4: different
        // params; 5: k not rotated; 6: q read elsewhere too; 7: k a graph output.
        for variant in 1..=7 {
            let src = graph(variant);
            let (g, report) = fuse_split_rotary(&src).unwrap();
            assert!(report.changes.is_empty(), "variant {variant}: {report:?}");
            assert_eq!(g, src, "variant {variant}");
        }
    }

    #[test]
    fn positions_computed_after_the_split_are_not_moved() {
        // The positions come out of a second split that runs after the qkv split: the
        // fused node, emitted where the qkv split is, could not read them.
        let build = |pos_first: bool| {
            let mut g = Graph::new();
            let qkv = g.input("qkv", DType::F32, &[1, 3, 16]);
            let pair = g.input("pair", DType::I64, &[6]);
            let cut = |g: &mut Graph| {
                let op = Op::Split {
                    axis: 0,
                    sizes: vec![3, 3],
                };
                g.op_multi("pos.split", op, &[pair]).unwrap()[0]
            };
            let early = pos_first.then(|| cut(&mut g));
            let op = Op::Split {
                axis: 2,
                sizes: vec![8, 4, 4],
            };
            let parts = g.op_multi("split", op, &[qkv]).unwrap();
            let pos = early.unwrap_or_else(|| cut(&mut g));
            let q = g.op("q", rope(10000.0), &[parts[0], pos]).unwrap();
            let k = g.op("k", rope(10000.0), &[parts[1], pos]).unwrap();
            for v in [q, k, parts[2]] {
                g.output(v).unwrap();
            }
            g
        };
        let late = build(false);
        let (g, report) = fuse_split_rotary(&late).unwrap();
        assert!(report.changes.is_empty());
        assert_eq!(g, late);
        let (g, report) = fuse_split_rotary(&build(true)).unwrap();
        assert_eq!(report.changes.len(), 1);
        assert_eq!(kinds(&g), ["split", "split_rotary"]);
    }

    #[test]
    fn scaling_is_carried() {
        let scaling = Some(RopeScaling::Linear { factor: 2.0 });
        let op = Op::Rotary {
            head_dim: 4,
            theta: 10000.0,
            scaling,
        };
        let mut g = Graph::new();
        let qkv = g.input("qkv", DType::BF16, &[1, 1, 12]);
        let pos = g.input("pos", DType::I32, &[1, 1]);
        let parts = g
            .op_multi(
                "split",
                Op::Split {
                    axis: 2,
                    sizes: vec![4, 4, 4],
                },
                &[qkv],
            )
            .unwrap();
        let q = g.op("q", op.clone(), &[parts[0], pos]).unwrap();
        let k = g.op("k", op, &[parts[1], pos]).unwrap();
        let a = g.op("sum", Op::Add, &[q, k]).unwrap();
        let a = g.op("sum2", Op::Add, &[a, parts[2]]).unwrap();
        g.output(a).unwrap();
        let (fused, _) = fuse_split_rotary(&g).unwrap();
        assert_eq!(kinds(&fused), ["split_rotary", "add", "add"]);
        assert!(matches!(
            fused.nodes()[0].op,
            Op::SplitRotary {
                scaling: Some(RopeScaling::Linear { .. }),
                ..
            }
        ));
    }

    /// qkv `[1, 2, 16]` -> split_rotary [8, 4, 4] -> k and v written into caches at
    /// `slots` -> an op reading q and both caches. `variant` breaks the pattern in one way
    /// (0: none).
    fn decode_graph(variant: u8) -> Graph {
        let mut g = Graph::new();
        let qkv = g.input("qkv", DType::BF16, &[1, 2, 16]);
        let pos = g.input("pos", DType::I64, &[2]);
        let kc = g.input("kc", DType::BF16, &[2, 8, 4]);
        let vc = g.input("vc", DType::BF16, &[2, 8, 4]);
        let slots = g.input("slots", DType::I64, &[2]);
        let slots2 = g.input("slots2", DType::I64, &[2]);
        let op = Op::SplitRotary {
            head_dim: 4,
            theta: 10000.0,
            scaling: None,
            sizes: vec![8, 4, 4],
            cache: false,
        };
        let parts = g.op_multi("rope", op, &[qkv, pos]).unwrap();
        let v_slots = if variant == 1 { slots2 } else { slots };
        let v_cache = if variant == 2 { kc } else { vc };
        let k = g.op("kw", Op::CacheWrite, &[kc, parts[1], slots]).unwrap();
        let v = g
            .op("vw", Op::CacheWrite, &[v_cache, parts[2], v_slots])
            .unwrap();
        if variant == 3 {
            g.output(parts[1]).unwrap();
        }
        if variant == 4 {
            let leak = g.op("leak", Op::Softmax, &[parts[2]]).unwrap();
            g.output(leak).unwrap();
        }
        let out = g.op("use", Op::Concat { axis: 2 }, &[k, v]).unwrap();
        g.output(parts[0]).unwrap();
        g.output(out).unwrap();
        g.output(k).unwrap();
        g
    }

    #[test]
    fn cache_writes_join_the_split_rotary() {
        let src = decode_graph(0);
        let (g, report) = fuse_rotary_cache_writes(&src).unwrap();
        assert_eq!(report.changes, ["rope + kw + vw -> split_rotary(cache)"]);
        assert_eq!(kinds(&g), ["split_rotary", "concat"]);
        let node = &g.nodes()[0];
        assert!(matches!(node.op, Op::SplitRotary { cache: true, .. }));
        let names: Vec<&str> = node
            .inputs
            .iter()
            .map(|&v| g.value(v).name.as_str())
            .collect();
        assert_eq!(names, ["qkv", "pos", "kc", "vc", "slots"]);
        // The outputs keep their places: q, the concat, the k cache.
        assert_eq!(
            g.outputs(),
            [node.outputs[0], g.nodes()[1].outputs[0], node.outputs[1]]
        );
        assert_eq!(g.spec(node.outputs[2]).unwrap().shape, [2, 8, 4]);
        let (again, report) = fuse_rotary_cache_writes(&g).unwrap();
        assert!(report.changes.is_empty());
        assert_eq!(again, g);
    }

    #[test]
    fn other_cache_writes_stay() {
        // 1: different slots; 2: one cache for both; 3: k a graph output; 4: v read
        // elsewhere too.
        for variant in 1..=4 {
            let src = decode_graph(variant);
            let (g, report) = fuse_rotary_cache_writes(&src).unwrap();
            assert!(report.changes.is_empty(), "variant {variant}: {report:?}");
            assert_eq!(g, src, "variant {variant}");
        }
    }
}
