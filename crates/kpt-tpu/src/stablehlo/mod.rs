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
use kpt_core::{DType, Graph, KptError, Op, Result, TensorSpec, ValueId};

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
    /// The arguments (indices into `args`) holding FP8 / int8 values: the scale of each
    /// is passed too, as an f32 scalar argument after `args`, in this order.
    pub scale_args: Vec<usize>,
    /// The specs of the function's results (the graph's outputs).
    pub outputs: Vec<TensorSpec>,
    /// The quantization scale of each result (that of its `Quantize`; 1 for the rest).
    pub output_scales: Vec<f32>,
}

/// What the XLA backend that compiles a program offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Target {
    /// No f64 arithmetic (XLA:TPU): rotary angles are computed in f32 with an exact
    /// range reduction instead of in f64, and dynamic NTK rope scaling (its base computed
    /// from the positions) is not lowered.
    pub no_f64: bool,
}

impl Target {
    /// The target of a PJRT platform (`cpu`, `cuda`, `tpu`, ...): only TPUs lack f64.
    pub fn of_platform(platform: &str) -> Target {
        Target {
            no_f64: platform.eq_ignore_ascii_case("tpu"),
        }
    }
}

/// Writes `graph`, with its inputs of `input_specs`, as a StableHLO module for XLA's CPU
/// and GPU backends ([`emit_graph_for`] with the default [`Target`]).
///
/// Errors: input specs the graph does not accept, or an op (or op variant) that is not
/// lowered ([`KptError::Backend`] naming it).
pub fn emit_graph(graph: &Graph, input_specs: &[TensorSpec]) -> Result<Program> {
    emit_graph_for(graph, input_specs, Target::default())
}

/// Writes `graph`, with its inputs of `input_specs`, as a StableHLO module for `target`.
///
/// Errors: as [`emit_graph`].
pub fn emit_graph_for(
    graph: &Graph,
    input_specs: &[TensorSpec],
    target: Target,
) -> Result<Program> {
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
    let n = graph.values().len();
    let mut vals: Vec<Option<Val>> = vec![None; n];
    let mut params = Vec::with_capacity(args.len());
    for (i, &id) in args.iter().enumerate() {
        let s = &specs[id.0];
        let v = Builder::arg(format!("%arg{i}"), &s.shape, s.dtype);
        params.push(format!("{}: {}", v.name, v.ty()));
        vals[id.0] = Some(v);
    }
    // Scales of FP8 / int8 values: arguments for quantized inputs and parameters,
    // constants for the results of `Quantize`.
    let mut b = Builder::default();
    b.no_f64 = target.no_f64;
    let mut scales: Vec<Option<Val>> = vec![None; n];
    let mut known: Vec<Option<f32>> = vec![None; n];
    let scale_args: Vec<usize> = (0..args.len())
        .filter(|&i| specs[args[i].0].dtype.is_quantized())
        .collect();
    for &i in &scale_args {
        let v = Builder::arg(format!("%arg{}", params.len()), &[], DType::F32);
        params.push(format!("{}: {}", v.name, v.ty()));
        scales[args[i].0] = Some(v);
    }
    for node in graph.nodes() {
        let named = |e: KptError| match e {
            KptError::Backend { backend, message } => KptError::Backend {
                backend,
                message: format!("node `{}`: {message}", node.name),
            },
            other => other,
        };
        let mut ins = node
            .inputs
            .iter()
            .map(|v| {
                vals[v.0]
                    .clone()
                    .ok_or_else(|| KptError::Graph(format!("value {} used before it is made", v.0)))
            })
            .collect::<Result<Vec<_>>>()?;
        let scale_of = |v: ValueId| {
            scales[v.0].clone().ok_or_else(|| {
                named(KptError::Backend {
                    backend: "xla".into(),
                    message: format!("value {} is quantized but its scale is unknown", v.0),
                })
            })
        };
        match &node.op {
            Op::Dequantize { .. } => ins.push(scale_of(node.inputs[0])?),
            // FP8 / int8 weights are dequantized to the activations' dtype first.
            Op::Linear { .. } | Op::LinearAct { .. } if ins[1].float().is_quantized() => {
                let s = scale_of(node.inputs[1])?;
                ins[1] = lower::dequantize(&mut b, &ins[1], &s, ins[0].float());
            }
            Op::Quantize { .. } => {}
            op => {
                if let Some(i) = ins.iter().position(|v| v.float().is_quantized()) {
                    return Err(named(KptError::Backend {
                        backend: "xla".into(),
                        message: format!(
                            "{op} reads the {} input {i}; dequantize it first",
                            ins[i].float()
                        ),
                    }));
                }
            }
        }
        let outs = lower::lower(&mut b, &node.op, &ins).map_err(named)?;
        if let Op::Quantize { scale, .. } = node.op {
            let o = node.outputs[0].0;
            scales[o] = Some(b.splat(f64::from(scale), &[], DType::F32)?);
            known[o] = Some(scale);
        }
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
    let output_scales = graph
        .outputs()
        .iter()
        .map(|o| match known[o.0] {
            Some(scale) => Ok(scale),
            None if specs[o.0].dtype.is_quantized() => Err(KptError::Backend {
                backend: "xla".into(),
                message: format!(
                    "output value {} is quantized but not made by a quantize op",
                    o.0
                ),
            }),
            None => Ok(1.0),
        })
        .collect::<Result<Vec<_>>>()?;
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
        scale_args,
        outputs,
        output_scales,
    })
}

impl crate::Client {
    /// The argument buffers of `program` on `device`: the graph's `inputs` (in order),
    /// its parameters from `graph`, then the scale of each FP8 / int8 argument.
    pub fn program_arguments(
        &self,
        program: &Program,
        graph: &Graph,
        inputs: &[kpt_core::Tensor],
        device: &crate::Device,
    ) -> Result<Vec<crate::Buffer>> {
        let n_in = graph.inputs().len();
        if inputs.len() != n_in {
            return Err(KptError::InvalidArgument(format!(
                "graph takes {n_in} input(s), got {}",
                inputs.len()
            )));
        }
        let mut buffers = Vec::with_capacity(program.args.len() + program.scale_args.len());
        let mut scales = Vec::with_capacity(program.args.len());
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
            scales.push(t.scale());
        }
        for &i in &program.scale_args {
            buffers.push(self.buffer(&[scales[i]], &[], device)?);
        }
        Ok(buffers)
    }

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
        let buffers = self.program_arguments(program, graph, inputs, device)?;
        let refs: Vec<&crate::Buffer> = buffers.iter().collect();
        let outs = exe.execute(&refs)?;
        outs.iter()
            .zip(&program.outputs)
            .zip(&program.output_scales)
            .map(|((o, spec), &scale)| {
                Ok(
                    kpt_core::Tensor::from_bytes(&o.to_bytes()?, spec.dtype, &spec.shape)?
                        .with_scale(scale),
                )
            })
            .collect()
    }
}
