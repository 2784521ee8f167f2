//! kpt graphs as StableHLO modules: one `@main` function per graph, so that XLA
//! compiles a whole graph (a transformer block, a model step) into one executable.
//!
//! The function takes the graph's inputs, then its parameters (weights stay device
//! buffers, not constants in the program), and returns the graph's outputs. Shapes are
//! static: a graph is emitted for one set of input shapes.

mod attention;
mod builder;
mod lower;

use kpt_core::graph::ValueSource;
use kpt_core::{Graph, KptError, Result, TensorSpec, ValueId};

pub(crate) use builder::tensor_type;
use builder::{Builder, Val};

/// A graph written as a StableHLO module.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The module as MLIR text.
    pub mlir: String,
    /// The values passed as the function's arguments, in order: the graph's inputs, then
    /// its parameters.
    pub args: Vec<ValueId>,
    /// The specs of the function's results (the graph's outputs).
    pub outputs: Vec<TensorSpec>,
}

/// Writes `graph`, with its inputs of `input_specs`, as a StableHLO module.
///
/// Errors: input specs the graph does not accept, or an op (or op variant) that is not
/// lowered yet ([`KptError::Backend`] naming it).
pub fn emit_graph(graph: &Graph, input_specs: &[TensorSpec]) -> Result<Program> {
    let specs = graph.infer_specs(input_specs)?;
    let mut args: Vec<ValueId> = graph.inputs().to_vec();
    args.extend(
        graph
            .values()
            .iter()
            .enumerate()
            .filter(|(_, v)| matches!(v.source, ValueSource::Param(_)))
            .map(|(i, _)| ValueId(i)),
    );
    let mut vals: Vec<Option<Val>> = vec![None; graph.values().len()];
    let mut params = Vec::with_capacity(args.len());
    for (i, &id) in args.iter().enumerate() {
        let s = &specs[id.0];
        let v = Builder::arg(format!("%arg{i}"), &s.shape, s.dtype);
        params.push(format!("{}: {}", v.name, v.ty()));
        vals[id.0] = Some(v);
    }
    let mut b = Builder::default();
    for node in graph.nodes() {
        let ins = node
            .inputs
            .iter()
            .map(|v| {
                vals[v.0]
                    .clone()
                    .ok_or_else(|| KptError::Graph(format!("value {} used before it is made", v.0)))
            })
            .collect::<Result<Vec<_>>>()?;
        let outs = lower::lower(&mut b, &node.op, &ins).map_err(|e| match e {
            KptError::Backend { backend, message } => KptError::Backend {
                backend,
                message: format!("node `{}`: {message}", node.name),
            },
            other => other,
        })?;
        for (&o, v) in node.outputs.iter().zip(outs) {
            let want = &specs[o.0];
            if v.shape != want.shape || v.dtype != Some(want.dtype) {
                return Err(KptError::Backend {
                    backend: "xla".into(),
                    message: format!(
                        "node `{}`: lowered to {}, the graph says {want}",
                        node.name,
                        v.ty()
                    ),
                });
            }
            vals[o.0] = Some(v);
        }
    }
    let results = graph
        .outputs()
        .iter()
        .map(|o| {
            vals[o.0]
                .clone()
                .ok_or_else(|| KptError::Graph("output missing".into()))
        })
        .collect::<Result<Vec<_>>>()?;
    let names: Vec<&str> = results.iter().map(|v| v.name.as_str()).collect();
    let types: Vec<String> = results.iter().map(Val::ty).collect();
    let outputs = graph.outputs().iter().map(|o| specs[o.0].clone()).collect();
    let mlir = format!(
        "module @kpt {{\n  func.func public @main({}) -> ({}) {{\n{}    \"func.return\"({}) : ({}) -> ()\n  }}\n}}\n",
        params.join(", "),
        types.join(", "),
        b.finish(),
        names.join(", "),
        types.join(", ")
    );
    Ok(Program {
        mlir,
        args,
        outputs,
    })
}

impl crate::Client {
    /// Compiles `program` and runs it once on the first device: `inputs` are the
    /// graph's inputs (in order), the parameters come from `graph`. Returns the outputs.
    pub fn run_program(
        &self,
        program: &Program,
        graph: &Graph,
        inputs: &[kpt_core::Tensor],
    ) -> Result<Vec<kpt_core::Tensor>> {
        let exe = self.compile(program.mlir.as_bytes(), &crate::CompileOptions::default())?;
        let devices = self.devices()?;
        let device = devices
            .first()
            .ok_or_else(|| KptError::InvalidArgument("the plugin has no device".into()))?;
        let n_in = graph.inputs().len();
        if inputs.len() != n_in {
            return Err(KptError::InvalidArgument(format!(
                "graph takes {n_in} input(s), got {}",
                inputs.len()
            )));
        }
        let mut buffers = Vec::with_capacity(program.args.len());
        for (i, &id) in program.args.iter().enumerate() {
            let t = if i < n_in {
                inputs[i].contiguous()
            } else {
                graph
                    .param_tensor(id)
                    .ok_or_else(|| KptError::Graph(format!("value {} is not a parameter", id.0)))?
                    .contiguous()
            };
            let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
            buffers.push(self.buffer_from_bytes(t.as_bytes()?, t.dtype(), &dims, device)?);
        }
        let refs: Vec<&crate::Buffer> = buffers.iter().collect();
        let outs = exe.execute(&refs)?;
        outs.iter()
            .zip(&program.outputs)
            .map(|(o, spec)| kpt_core::Tensor::from_bytes(&o.to_bytes()?, spec.dtype, &spec.shape))
            .collect()
    }
}
