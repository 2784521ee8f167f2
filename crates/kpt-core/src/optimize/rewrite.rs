//! Rebuilding a graph node by node: the tool every rewriting pass uses.

use std::collections::HashMap;

use crate::error::Result;
use crate::graph::{Graph, Op, ValueId, ValueSource};
use crate::tensor::Tensor;

/// Copies values from a source graph into a new graph on demand, keeping a map of ids.
pub(crate) struct Rewriter<'a> {
    pub src: &'a Graph,
    pub dst: Graph,
    map: HashMap<ValueId, ValueId>,
}

impl<'a> Rewriter<'a> {
    /// Starts a new graph with the same inputs as `src`.
    pub fn new(src: &'a Graph) -> Self {
        let mut dst = Graph::new();
        let mut map = HashMap::new();
        for &i in src.inputs() {
            let v = src.value(i);
            map.insert(i, dst.input(v.name.clone(), v.spec.dtype, &v.spec.shape));
        }
        Self { src, dst, map }
    }

    /// The new id of a source value; parameters are copied on first use.
    pub fn get(&mut self, v: ValueId) -> ValueId {
        if let Some(&n) = self.map.get(&v) {
            return n;
        }
        let value = self.src.value(v);
        let n = match &value.source {
            ValueSource::Param(t) => self.dst.param(value.name.clone(), t.clone()),
            // Inputs are mapped in `new` and node outputs when their node is copied; a
            // topologically ordered source graph never reaches here with either.
            _ => unreachable!("value `{}` used before it was defined", value.name),
        };
        self.map.insert(v, n);
        n
    }

    /// Adds a node with source-graph inputs and maps its outputs to `outputs` (source ids).
    pub fn emit(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[ValueId],
        outputs: &[ValueId],
    ) -> Result<Vec<ValueId>> {
        let ins: Vec<ValueId> = inputs.iter().map(|&v| self.get(v)).collect();
        self.emit_new(name, op, &ins, outputs)
    }

    /// Adds a parameter that the source graph does not have; returns its new id.
    pub fn param(&mut self, name: String, tensor: Tensor) -> ValueId {
        self.dst.param(name, tensor)
    }

    /// Like [`Rewriter::emit`], with inputs that are already new-graph ids; outputs
    /// beyond `outputs` are new values that no source value maps to.
    pub fn emit_new(
        &mut self,
        name: &str,
        op: Op,
        ins: &[ValueId],
        outputs: &[ValueId],
    ) -> Result<Vec<ValueId>> {
        let outs = self.dst.op_multi(name, op, ins)?;
        for (&o, &n) in outputs.iter().zip(&outs) {
            self.map.insert(o, n);
        }
        Ok(outs)
    }

    /// Copies a source node unchanged.
    pub fn copy_node(&mut self, index: usize) -> Result<()> {
        let node = &self.src.nodes()[index];
        self.emit(
            &node.name,
            node.op.clone(),
            &node.inputs.clone(),
            &node.outputs.clone(),
        )
        .map(|_| ())
    }

    /// Finishes: marks the mapped outputs and returns the new graph.
    pub fn finish(mut self) -> Result<Graph> {
        for &o in self.src.outputs() {
            let n = self.get(o);
            self.dst.output(n)?;
        }
        Ok(self.dst)
    }
}
