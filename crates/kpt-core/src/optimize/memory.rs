//! Memory planning: intermediate values whose lifetimes do not overlap share a buffer.

use serde::{Deserialize, Serialize};

use crate::graph::{Graph, TensorSpec, ValueSource};
use crate::DType;

/// Which buffer slot each intermediate value lives in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// For each value of the graph, its slot (None for inputs and parameters).
    pub slot_of: Vec<Option<usize>>,
    /// The dtype of each slot.
    pub slot_dtypes: Vec<DType>,
    /// Bytes needed with one buffer per value, at the example shapes.
    pub naive_bytes: usize,
    /// Bytes needed with the shared slots, at the example shapes.
    pub planned_bytes: usize,
}

impl MemoryPlan {
    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.slot_dtypes.len()
    }

    /// Element capacity each slot needs for the given value specs.
    pub fn slot_capacities(&self, specs: &[TensorSpec]) -> Vec<usize> {
        let mut caps = vec![0; self.num_slots()];
        for (v, slot) in self.slot_of.iter().enumerate() {
            if let Some(s) = slot {
                caps[*s] = caps[*s].max(specs[v].numel());
            }
        }
        caps
    }
}

/// Assigns slots greedily in node order: a value takes a free slot of its dtype (the
/// one whose size is closest) or a new one, and frees its slot after its last use.
/// Graph outputs are never freed, so they survive to the end of a run.
pub fn plan_memory(graph: &Graph) -> MemoryPlan {
    let n_values = graph.values().len();
    let mut last_use = vec![None; n_values];
    for (i, node) in graph.nodes().iter().enumerate() {
        for v in &node.inputs {
            last_use[v.0] = Some(i);
        }
    }
    for o in graph.outputs() {
        last_use[o.0] = Some(usize::MAX);
    }
    let mut slot_of = vec![None; n_values];
    let mut slot_dtypes: Vec<DType> = Vec::new();
    let mut slot_bytes: Vec<usize> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut naive_bytes = 0;
    for (i, node) in graph.nodes().iter().enumerate() {
        for &o in &node.outputs {
            let spec = &graph.value(o).spec;
            naive_bytes += spec.bytes();
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, &s)| slot_dtypes[s] == spec.dtype)
                .min_by_key(|(_, &s)| slot_bytes[s].abs_diff(spec.bytes()))
                .map(|(k, _)| k);
            let slot = match best {
                Some(k) => free.swap_remove(k),
                None => {
                    slot_dtypes.push(spec.dtype);
                    slot_bytes.push(0);
                    slot_dtypes.len() - 1
                }
            };
            slot_bytes[slot] = slot_bytes[slot].max(spec.bytes());
            slot_of[o.0] = Some(slot);
            // An output nobody reads is dead at once (unless it is a graph output).
            if last_use[o.0].is_none() {
                last_use[o.0] = Some(i);
            }
        }
        let mut released = Vec::new();
        for v in node.inputs.iter().chain(&node.outputs) {
            if last_use[v.0] == Some(i) && !released.contains(&v.0) {
                released.push(v.0);
                if let (Some(s), ValueSource::Node { .. }) = (slot_of[v.0], &graph.value(*v).source)
                {
                    free.push(s);
                }
            }
        }
    }
    MemoryPlan {
        slot_of,
        slot_dtypes,
        naive_bytes,
        planned_bytes: slot_bytes.iter().sum(),
    }
}
