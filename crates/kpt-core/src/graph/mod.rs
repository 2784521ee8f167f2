//! The graph IR: values (inputs, parameters, op results) and nodes in topological order.
//!
//! Graphs are built with [`Graph::input`], [`Graph::param`] and [`Graph::op`]; each
//! `op` call infers and checks its output shapes at once, so a graph that was built
//! is well-formed. Input shapes given at build time are example shapes: a plan runs
//! with any input shapes the ops accept (e.g. a growing KV cache).

mod op;
mod rope;

pub use op::{lse_dtype, Activation, AttentionDropout, AttentionParams, Op, OpKind, TensorSpec};
pub use rope::{rope_frequencies, rope_seq_len, RopeFrequencies, RopeScaling, RopeScalingError};

use std::collections::BTreeMap;

use crate::error::{KptError, Result};
use crate::tensor::Tensor;
use crate::DType;

/// Index of a value in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub usize);

/// Index of a node in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

/// Where a value comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueSource {
    /// Supplied by the caller at run time.
    Input,
    /// A constant (weights), owned by the graph.
    Param(Tensor),
    /// Output `index` of node `node`.
    Node {
        /// Producing node.
        node: NodeId,
        /// Which of its outputs.
        index: usize,
    },
}

/// A value: a named tensor with a spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    /// Readable name (unique names are not required).
    pub name: String,
    /// Shape and dtype (example shape for inputs).
    pub spec: TensorSpec,
    /// Producer.
    pub source: ValueSource,
}

/// One op application.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Readable name, e.g. `layers.0.mlp.up`.
    pub name: String,
    /// The op.
    pub op: Op,
    /// Input values, in the op's order.
    pub inputs: Vec<ValueId>,
    /// Output values.
    pub outputs: Vec<ValueId>,
}

/// A dataflow graph of ops in topological order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Graph {
    values: Vec<Value>,
    nodes: Vec<Node>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    fn push_value(&mut self, name: String, spec: TensorSpec, source: ValueSource) -> ValueId {
        self.values.push(Value { name, spec, source });
        ValueId(self.values.len() - 1)
    }

    /// Declares a run-time input with an example shape.
    pub fn input(&mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) -> ValueId {
        let id = self.push_value(
            name.into(),
            TensorSpec::new(shape, dtype),
            ValueSource::Input,
        );
        self.inputs.push(id);
        id
    }

    /// Adds a constant tensor (made contiguous).
    pub fn param(&mut self, name: impl Into<String>, tensor: Tensor) -> ValueId {
        let spec = TensorSpec::new(tensor.shape(), tensor.dtype());
        self.push_value(name.into(), spec, ValueSource::Param(tensor.contiguous()))
    }

    /// Applies an op; checks the inputs and returns every output value.
    pub fn op_multi(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: &[ValueId],
    ) -> Result<Vec<ValueId>> {
        let name = name.into();
        let specs = inputs
            .iter()
            .map(|&v| self.spec(v).cloned())
            .collect::<Result<Vec<_>>>()?;
        let out_specs = op.infer(&specs).map_err(|e| annotate(e, &name))?;
        let node = NodeId(self.nodes.len());
        let outputs = out_specs
            .into_iter()
            .enumerate()
            .map(|(index, spec)| {
                let vname = if index == 0 {
                    name.clone()
                } else {
                    format!("{name}.{index}")
                };
                self.push_value(vname, spec, ValueSource::Node { node, index })
            })
            .collect::<Vec<_>>();
        self.nodes.push(Node {
            name,
            op,
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
        });
        Ok(outputs)
    }

    /// Applies a single-output op and returns its output.
    pub fn op(&mut self, name: impl Into<String>, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let name = name.into();
        let outs = self.op_multi(name.clone(), op, inputs)?;
        match outs.as_slice() {
            [one] => Ok(*one),
            _ => Err(KptError::Graph(format!(
                "{name} has {} outputs; use op_multi",
                outs.len()
            ))),
        }
    }

    /// Marks a value as a graph output.
    pub fn output(&mut self, v: ValueId) -> Result<()> {
        self.spec(v)?;
        self.outputs.push(v);
        Ok(())
    }

    /// The spec of a value.
    pub fn spec(&self, v: ValueId) -> Result<&TensorSpec> {
        self.values
            .get(v.0)
            .map(|x| &x.spec)
            .ok_or_else(|| KptError::Graph(format!("value {} does not exist", v.0)))
    }

    /// A value by id.
    pub fn value(&self, v: ValueId) -> &Value {
        &self.values[v.0]
    }

    /// Every value.
    pub fn values(&self) -> &[Value] {
        &self.values
    }

    /// Nodes in topological order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Run-time inputs in declaration order.
    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    /// Graph outputs in declaration order.
    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    /// The parameter tensor of a value, if it is a parameter.
    pub fn param_tensor(&self, v: ValueId) -> Option<&Tensor> {
        match &self.values[v.0].source {
            ValueSource::Param(t) => Some(t),
            _ => None,
        }
    }

    /// Replaces the tensor of a parameter (e.g. with a converted copy) and updates its spec.
    pub fn set_param(&mut self, v: ValueId, tensor: Tensor) -> Result<()> {
        let value = self
            .values
            .get_mut(v.0)
            .ok_or_else(|| KptError::Graph(format!("value {} does not exist", v.0)))?;
        if !matches!(value.source, ValueSource::Param(_)) {
            return Err(KptError::Graph(format!(
                "value `{}` is not a parameter",
                value.name
            )));
        }
        if tensor.shape() != value.spec.shape.as_slice() {
            return Err(KptError::shape(
                "set_param",
                format!(
                    "`{}` is {:?}, new tensor is {:?}",
                    value.name,
                    value.spec.shape,
                    tensor.shape()
                ),
            ));
        }
        value.spec.dtype = tensor.dtype();
        value.source = ValueSource::Param(tensor.contiguous());
        Ok(())
    }

    /// For each value, the nodes that read it.
    pub fn consumers(&self) -> Vec<Vec<NodeId>> {
        let mut users = vec![Vec::new(); self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for v in &n.inputs {
                users[v.0].push(NodeId(i));
            }
        }
        users
    }

    /// Total bytes of parameters.
    pub fn param_bytes(&self) -> usize {
        self.values
            .iter()
            .filter(|v| matches!(v.source, ValueSource::Param(_)))
            .map(|v| v.spec.bytes())
            .sum()
    }

    /// Number of nodes per op kind.
    pub fn op_histogram(&self) -> BTreeMap<OpKind, usize> {
        let mut h = BTreeMap::new();
        for n in &self.nodes {
            *h.entry(n.op.kind()).or_insert(0) += 1;
        }
        h
    }

    /// Re-infers every value spec from the given run-time input specs.
    pub fn infer_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        if inputs.len() != self.inputs.len() {
            return Err(KptError::InvalidArgument(format!(
                "graph takes {} input(s), got {}",
                self.inputs.len(),
                inputs.len()
            )));
        }
        let mut specs: Vec<TensorSpec> = self.values.iter().map(|v| v.spec.clone()).collect();
        for (&id, given) in self.inputs.iter().zip(inputs) {
            let declared = &self.values[id.0];
            if declared.spec.dtype != given.dtype || declared.spec.shape.len() != given.shape.len()
            {
                return Err(KptError::InvalidArgument(format!(
                    "input `{}` must be {} with rank {}, got {given}",
                    declared.name,
                    declared.spec.dtype,
                    declared.spec.shape.len()
                )));
            }
            specs[id.0] = given.clone();
        }
        for n in &self.nodes {
            let ins: Vec<TensorSpec> = n.inputs.iter().map(|v| specs[v.0].clone()).collect();
            let outs = n.op.infer(&ins).map_err(|e| annotate(e, &n.name))?;
            for (v, s) in n.outputs.iter().zip(outs) {
                specs[v.0] = s;
            }
        }
        Ok(specs)
    }
}

/// Prefixes a shape/dtype error with the node name so users can find it.
fn annotate(e: KptError, node: &str) -> KptError {
    match e {
        KptError::Shape { op, message } => KptError::Shape {
            op: format!("{op} `{node}`"),
            message,
        },
        KptError::DTypeMismatch { op, expected, got } => KptError::DTypeMismatch {
            op: format!("{op} `{node}`"),
            expected,
            got,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_and_reinfer() {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, &[2, 4]);
        let w = g.param("w", Tensor::zeros(DType::F32, &[3, 4]));
        let y = g.op("fc", Op::Linear { bias: false }, &[x, w]).unwrap();
        let z = g
            .op(
                "act",
                Op::Activation {
                    act: Activation::Relu,
                },
                &[y],
            )
            .unwrap();
        g.output(z).unwrap();
        assert_eq!(g.spec(z).unwrap().shape, vec![2, 3]);
        let specs = g
            .infer_specs(&[TensorSpec::new(&[7, 4], DType::F32)])
            .unwrap();
        assert_eq!(specs[z.0].shape, vec![7, 3]);
        let err = g
            .infer_specs(&[TensorSpec::new(&[7, 5], DType::F32)])
            .unwrap_err();
        assert!(err.to_string().contains("`fc`"), "{err}");
        assert_eq!(g.consumers()[y.0], vec![NodeId(1)]);
    }

    #[test]
    fn bad_graphs_are_errors() {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, &[2, 4]);
        assert!(g.op("bad", Op::Add, &[x, ValueId(99)]).is_err());
        let w = g.param("w", Tensor::zeros(DType::F32, &[4]));
        let outs = g
            .op_multi("n", Op::AddRmsNorm { eps: 1e-5 }, &[x, x, w])
            .unwrap();
        assert_eq!(outs.len(), 2);
        assert!(g
            .op("n2", Op::AddRmsNorm { eps: 1e-5 }, &[x, x, w])
            .is_err());
        assert!(g.set_param(x, Tensor::zeros(DType::F32, &[2, 4])).is_err());
        assert!(g.set_param(w, Tensor::zeros(DType::F32, &[5])).is_err());
    }
}
