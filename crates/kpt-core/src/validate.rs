//! Numeric validation: an optimized plan against the f64 reference.
//!
//! Two checks, both reported:
//! - **per op**: every node's output is compared with the f64 reference applied to
//!   the very inputs the node received (a residual add + norm's norm output also with
//!   the norm of the sum it stored, [`reference_outputs`]), so each kernel's own error
//!   is measured against a tolerance for its output dtype and reduction length;
//! - **end to end**: the plan's outputs are compared with the f64 reference of the
//!   original, unoptimized graph; this includes the error of lower-precision weights
//!   and is held to a budget per weight dtype.

use serde::{Deserialize, Serialize};

use crate::error::{KptError, Result};
use crate::exec::Executor;
use crate::graph::{Graph, Op, TensorSpec, ValueSource};
use crate::tensor::Tensor;
use crate::DType;

/// The f64 reference of every op (implemented in `kpt-kernels`).
pub trait ReferenceOps {
    /// Evaluates `op` in f64 on (dequantized) inputs; returns f64 tensors.
    fn eval(&self, op: &Op, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
}

/// The reference outputs of `op` on `inputs` that a kernel which returned `got` is held
/// to. A residual add + norm normalizes the sum it stores, rounded to its dtype, so its
/// norm output is the reference norm of `got`'s sum (for two nearly equal columns of a
/// 16-bit layer norm, that rounding alone moves the result past any tolerance); its sum,
/// and every other op's outputs, are the reference's on `inputs`.
pub fn reference_outputs(
    reference: &dyn ReferenceOps,
    op: &Op,
    inputs: &[Tensor],
    got: &[Tensor],
) -> Result<Vec<Tensor>> {
    let mut want = reference.eval(op, inputs)?;
    if let Some(norm) = norm_of_stored_sum(reference, op, inputs, got.first())? {
        let Some(out) = want.get_mut(1) else {
            return Err(KptError::InvalidArgument(format!(
                "{op}: the reference gave no norm output"
            )));
        };
        *out = norm;
    }
    Ok(want)
}

/// For a residual add + norm, the reference norm of `sum`, the sum its kernel stored
/// (with the op's weights from `inputs`); `None` for every other op.
fn norm_of_stored_sum(
    reference: &dyn ReferenceOps,
    op: &Op,
    inputs: &[Tensor],
    sum: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    let norm = match *op {
        Op::AddRmsNorm { eps } => Op::RmsNorm { eps },
        Op::AddLayerNorm { eps } => Op::LayerNorm { eps },
        _ => return Ok(None),
    };
    let Some(sum) = sum else {
        return Err(KptError::InvalidArgument(format!(
            "{op}: a stored sum and a norm output to compare"
        )));
    };
    let mut args = vec![sum.clone()];
    args.extend(inputs.iter().skip(2).cloned());
    Ok(Some(reference.eval(&norm, &args)?.remove(0)))
}

/// An `|got - want| <= abs + rel * |want|` bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    /// Absolute part, in units of the reference's largest magnitude.
    pub abs: f64,
    /// Relative part.
    pub rel: f64,
}

/// How many products a single output element of `op` accumulates.
pub fn reduction_len(op: &Op, inputs: &[TensorSpec]) -> usize {
    let last = |i: usize| {
        inputs
            .get(i)
            .and_then(|s| s.shape.last())
            .copied()
            .unwrap_or(1)
    };
    match op {
        Op::Linear { .. } | Op::LinearAct { .. } => last(0),
        Op::MatMul => inputs
            .get(1)
            .map_or(1, |b| b.shape[b.shape.len().saturating_sub(2)]),
        // Keys per sequence: the cache rows (for a paged cache, the table's capacity).
        Op::Attention(p) | Op::AttentionBackward(p) => {
            let keys = inputs.get(1).map_or(1, |k| k.shape[1]);
            let blocks = match (p.paged, inputs.get(3)) {
                (true, Some(table)) => table.shape.get(1).copied().unwrap_or(1),
                _ => 1,
            };
            p.head_dim + keys * blocks
        }
        Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::AddRmsNorm { .. }
        | Op::AddLayerNorm { .. }
        | Op::Softmax => last(0),
        _ => 1,
    }
    .max(1)
}

/// The per-op tolerance for an output computed in `dtype` (the coarsest precision its
/// kernel rounds to) that accumulates `k` terms.
/// - f32 and f64: a few units of roundoff (f32 for f64 outputs of f32 math), growing
///   with `sqrt(k)` as rounding errors of a sum do.
/// - 16- and 8-bit floats: the sum accumulates in f32 (its `sqrt(k)` term), and the
///   kernel rounds a few values to `dtype` (its output; the probabilities of an
///   attention; the activations of a linear with 16-bit weights): each such rounding
///   errs by at most `eps` of what it rounds, `8 eps` of the largest output in all and
///   `2 eps` of each output. Their errors do not grow with `k`: a sum of `k` rounded
///   terms of random sign errs like one rounding of the sum.
/// - Conversions: two units of roundoff; int8 outputs within one step, other integer
///   outputs exactly.
pub fn tolerance(op: &Op, dtype: DType, k: usize) -> Tolerance {
    let conversion = matches!(
        op,
        Op::Quantize { .. }
            | Op::Dequantize { .. }
            | Op::Cast { .. }
            | Op::Concat { .. }
            | Op::Split { .. }
            | Op::Embedding
    );
    // Activations are evaluated in f32 with fast exp / tanh (kpt's kernels and
    // cuBLASLt's GELU epilogue alike): up to ~70 f32 ulps on top of the rounding.
    let act = match op {
        Op::Activation { .. } | Op::LinearAct { .. } | Op::ActAndMul { .. } => {
            128.0 * DType::F32.epsilon()
        }
        _ => 0.0,
    };
    let growth = (k as f64).sqrt().max(1.0);
    let (abs, rel) = match dtype {
        DType::I8 => (1.0 / 127.0, 1.0 / 127.0),
        d if !d.is_float() => (0.0, 0.0),
        d if conversion => (2.0 * d.epsilon(), 2.0 * d.epsilon()),
        DType::F64 | DType::F32 => {
            let t = 16.0 * dtype.epsilon() * growth + act;
            (t, t)
        }
        d => {
            let sum = 16.0 * DType::F32.epsilon() * growth + act;
            (sum + 8.0 * d.epsilon(), sum + 2.0 * d.epsilon())
        }
    };
    Tolerance { abs, rel }
}

/// The tolerance of output `index` of `op` on `inputs`, of `dtype`: [`tolerance`] for
/// the op's reduction length, with two allowances.
/// - An attention rounds its probabilities to its inputs' dtype, and a linear with
///   16-bit weights may round its activations to the weights' dtype before multiplying
///   (as `torch.autocast` does, and the CPU's bf16 products): their outputs are held to
///   the coarsest of `dtype` and those inputs' dtypes.
/// - A layer norm's absolute part is widened by its condition. Centering a row whose
///   values are nearly equal cancels digits: the mean's rounding in the compute
///   precision (f32, f64 for f64) is magnified by `max|x| / sqrt(var + eps)` of the
///   row, however exact the rest of the kernel is.
pub fn output_tolerance(op: &Op, inputs: &[Tensor], index: usize, dtype: DType) -> Tolerance {
    let specs: Vec<TensorSpec> = inputs
        .iter()
        .map(|t| TensorSpec::new(t.shape(), t.dtype()))
        .collect();
    // Attention rounds its probabilities to its inputs' dtype (FP8 inputs: e4m3 P); a
    // linear with 16-bit weights may round its activations to the weights' dtype.
    let coarser = |c: DType, d: DType| {
        if c.is_float() && d.is_float() && d.epsilon() > c.epsilon() {
            d
        } else {
            c
        }
    };
    let compute = match (op, inputs.get(1).map(Tensor::dtype)) {
        (Op::Attention(_) | Op::AttentionBackward(_), _) => {
            inputs.iter().map(Tensor::dtype).fold(dtype, coarser)
        }
        (Op::Linear { .. } | Op::LinearAct { .. }, Some(w @ (DType::BF16 | DType::F16))) => {
            coarser(dtype, w)
        }
        _ => dtype,
    };
    let mut tol = tolerance(op, compute, reduction_len(op, &specs));
    let centered = match (op, index) {
        (Op::LayerNorm { eps }, 0) => inputs.first().map(|x| (x.to_f64_vec(), *eps)),
        (Op::AddLayerNorm { eps }, 1) => inputs.get(..2).map(|xr| {
            let (x, r) = (xr[0].to_f64_vec(), xr[1].to_f64_vec());
            (x.iter().zip(&r).map(|(a, b)| a + b).collect(), *eps)
        }),
        _ => None,
    };
    let cols = inputs.first().and_then(|x| x.shape().last().copied());
    if let (Some((x, eps)), Some(cols @ 1..)) = (centered, cols) {
        let condition = x
            .chunks(cols)
            .map(|row| {
                let n = row.len() as f64;
                let mean = row.iter().sum::<f64>() / n;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
                let largest = row.iter().fold(0f64, |m, v| m.max(v.abs()));
                largest / (var + f64::from(eps)).sqrt()
            })
            .filter(|c| c.is_finite())
            .fold(0f64, f64::max);
        let compute_eps = if dtype == DType::F64 {
            DType::F64.epsilon()
        } else {
            DType::F32.epsilon()
        };
        tol.abs += 16.0 * compute_eps * condition;
    }
    tol
}

/// Error budget of whole-model outputs, relative to the largest reference magnitude,
/// for the most compact weight dtype in the plan.
pub fn end_to_end_budget(weight_dtype: DType) -> f64 {
    match weight_dtype {
        DType::F64 | DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        DType::BF16 => 5e-2,
        DType::I8 => 1e-1,
        _ => 2.5e-1,
    }
}

/// Errors of one tensor against its reference.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ErrorStats {
    /// Largest absolute difference.
    pub max_abs: f64,
    /// Largest `|got - want| / |want|` over elements with `|want|` above 1e-3 of the max.
    pub max_rel: f64,
    /// Largest reference magnitude.
    pub ref_max: f64,
    /// Whether every element is within the tolerance.
    pub within: bool,
}

/// Compares `got` with the reference `want` under `tol`.
pub fn compare(got: &Tensor, want: &Tensor, tol: Tolerance) -> Result<ErrorStats> {
    if got.shape() != want.shape() {
        return Err(KptError::shape(
            "compare",
            format!("result {:?} vs reference {:?}", got.shape(), want.shape()),
        ));
    }
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    // Infinities (e.g. the +inf log-sum-exp of a fully masked attention row) must match
    // exactly and do not count towards the magnitude.
    let ref_max = w
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()));
    let (mut max_abs, mut max_rel, mut within) = (0f64, 0f64, true);
    for (a, b) in g.iter().zip(&w) {
        if a == b {
            continue;
        }
        let d = (a - b).abs();
        if !(d.is_finite() || a.is_nan() && b.is_nan()) {
            within = false;
            max_abs = f64::INFINITY;
            continue;
        }
        max_abs = max_abs.max(d);
        if b.abs() > 1e-3 * ref_max {
            max_rel = max_rel.max(d / b.abs());
        }
        if d > tol.abs * ref_max.max(1e-30) + tol.rel * b.abs() {
            within = false;
        }
    }
    Ok(ErrorStats {
        max_abs,
        max_rel,
        ref_max,
        within,
    })
}

/// The per-op line of a validation report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpValidation {
    /// Node name.
    pub node: String,
    /// Op, e.g. `linear_act(silu)`.
    pub op: String,
    /// Kernel that ran.
    pub kernel: String,
    /// Output dtype.
    pub dtype: DType,
    /// The bound used.
    pub tolerance: Tolerance,
    /// The errors found (worst output of the node).
    pub error: ErrorStats,
}

/// The end-to-end line of a validation report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputValidation {
    /// Output value name.
    pub output: String,
    /// Budget relative to the largest reference magnitude.
    pub budget: f64,
    /// The errors found.
    pub error: ErrorStats,
}

/// Result of [`validate_plan`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationReport {
    /// One line per node of the optimized graph.
    pub ops: Vec<OpValidation>,
    /// One line per graph output.
    pub outputs: Vec<OutputValidation>,
}

impl ValidationReport {
    /// Whether every op and every output is within bounds.
    pub fn passed(&self) -> bool {
        self.ops.iter().all(|o| o.error.within) && self.outputs.iter().all(|o| o.error.within)
    }

    /// Largest end-to-end error relative to the reference magnitude.
    pub fn max_output_rel_error(&self) -> f64 {
        self.outputs
            .iter()
            .map(|o| o.error.max_abs / o.error.ref_max.max(1e-30))
            .fold(0.0, f64::max)
    }

    /// Turns a failed report into a [`KptError::Validation`] naming the worst offenders.
    pub fn into_result(self) -> Result<Self> {
        if self.passed() {
            return Ok(self);
        }
        let mut bad: Vec<String> = self
            .ops
            .iter()
            .filter(|o| !o.error.within)
            .map(|o| {
                format!(
                    "{} ({} via {}): max abs {:.3e}",
                    o.node, o.op, o.kernel, o.error.max_abs
                )
            })
            .collect();
        bad.extend(self.outputs.iter().filter(|o| !o.error.within).map(|o| {
            format!(
                "output {}: max abs {:.3e} over budget {:.1e}",
                o.output, o.error.max_abs, o.budget
            )
        }));
        Err(KptError::Validation(bad.join("; ")))
    }
}

/// Runs `graph` entirely with the f64 reference.
pub fn run_reference(
    graph: &Graph,
    reference: &dyn ReferenceOps,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>> {
    if inputs.len() != graph.inputs().len() {
        return Err(KptError::InvalidArgument(format!(
            "graph takes {} input(s), got {}",
            graph.inputs().len(),
            inputs.len()
        )));
    }
    let mut values: Vec<Option<Tensor>> = graph
        .values()
        .iter()
        .map(|v| match &v.source {
            ValueSource::Param(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    for (&id, t) in graph.inputs().iter().zip(inputs) {
        values[id.0] = Some(t.clone());
    }
    for node in graph.nodes() {
        let ins = node
            .inputs
            .iter()
            .map(|v| {
                values[v.0]
                    .clone()
                    .ok_or_else(|| KptError::Graph(format!("value {} missing", v.0)))
            })
            .collect::<Result<Vec<_>>>()?;
        let outs = reference.eval(&node.op, &ins)?;
        for (o, t) in node.outputs.iter().zip(outs) {
            values[o.0] = Some(t);
        }
    }
    graph
        .outputs()
        .iter()
        .map(|o| {
            values[o.0]
                .clone()
                .ok_or_else(|| KptError::Graph("output missing".into()))
        })
        .collect()
}

/// Validates the plan inside `exec` against the reference (see the module docs).
/// `original` is the graph before optimization and `inputs` are in its dtypes; a float
/// input that the plan declares in another float dtype (a KV cache kept in bf16, see
/// [`crate::optimize::apply_activation_precision`]) is converted for the plan's run.
/// `tolerance_scale` multiplies every bound.
pub fn validate_plan(
    exec: &mut Executor,
    original: &Graph,
    reference: &dyn ReferenceOps,
    inputs: &[Tensor],
    tolerance_scale: f64,
) -> Result<ValidationReport> {
    let _span = tracing::info_span!("validate_plan").entered();
    let plan_inputs = inputs
        .iter()
        .zip(exec.plan().graph.inputs())
        .map(|(t, &id)| {
            let want = exec.plan().graph.value(id).spec.dtype;
            let float = |d: DType| d.is_float() && !d.is_quantized();
            if t.dtype() != want && float(t.dtype()) && float(want) {
                t.to_dtype(want)
            } else {
                Ok(t.clone())
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let (outputs, values) = exec.run_traced(&plan_inputs)?;
    let plan = exec.plan();
    let graph = &plan.graph;
    let mut ops = Vec::with_capacity(graph.nodes().len());
    for (node, choice) in graph.nodes().iter().zip(&plan.kernels) {
        let ins = node
            .inputs
            .iter()
            .map(|v| {
                values[v.0]
                    .clone()
                    .ok_or_else(|| KptError::Graph(format!("value {} not traced", v.0)))
            })
            .collect::<Result<Vec<_>>>()?;
        let got = node
            .outputs
            .iter()
            .map(|o| {
                values[o.0]
                    .as_ref()
                    .ok_or_else(|| KptError::Graph("output not traced".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        let want = reference.eval(&node.op, &ins)?;
        // A residual add + norm may normalize its sum before or after rounding it to its
        // dtype (the f64 reference kernel does the former, the fused CPU, GPU and XLA
        // kernels the latter): its norm output (1) is held to the closer of the two
        // references.
        let stored_norm = norm_of_stored_sum(reference, &node.op, &ins, got.first().copied())?;
        let mut worst: Option<(DType, Tolerance, ErrorStats)> = None;
        for (i, (got, w)) in got.iter().zip(&want).enumerate() {
            let mut tol = output_tolerance(&node.op, &ins, i, got.dtype());
            tol.abs *= tolerance_scale;
            tol.rel *= tolerance_scale;
            let mut e = compare(got, w, tol)?;
            if let Some(alt) = stored_norm.as_ref().filter(|_| i == 1) {
                let e2 = compare(got, alt, tol)?;
                if e2.within && !e.within || e2.within == e.within && e2.max_abs < e.max_abs {
                    e = e2;
                }
            }
            if worst.is_none_or(|(_, _, we)| !e.within || e.max_abs > we.max_abs && we.within) {
                worst = Some((got.dtype(), tol, e));
            }
        }
        if let Some((dtype, tolerance, error)) = worst {
            ops.push(OpValidation {
                node: node.name.clone(),
                op: node.op.to_string(),
                kernel: choice.kernel.clone(),
                dtype,
                tolerance,
                error,
            });
        }
    }
    let reference_outputs = run_reference(original, reference, inputs)?;
    // The loosest budget of any parameter or output dtype: a bf16 graph or FP8
    // weights cannot be held to the f32 budget.
    let budget = graph
        .values()
        .iter()
        .filter(|v| matches!(v.source, ValueSource::Param(_)))
        .map(|v| v.spec.dtype)
        .chain(graph.outputs().iter().map(|&o| graph.value(o).spec.dtype))
        .filter(|d| d.is_float() || *d == DType::I8)
        .map(end_to_end_budget)
        .fold(end_to_end_budget(DType::F32), f64::max)
        * tolerance_scale;
    let outputs = outputs
        .iter()
        .zip(&reference_outputs)
        .zip(original.outputs())
        .map(|((got, want), &id)| {
            compare(
                got,
                want,
                Tolerance {
                    abs: budget,
                    rel: 0.0,
                },
            )
            .map(|error| OutputValidation {
                output: original.value(id).name.clone(),
                budget,
                error,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ValidationReport { ops, outputs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::AttentionParams;

    fn t(v: &[f64]) -> Tensor {
        Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
    }

    /// A reference whose residual add + norm returns (x + r, x + r) and whose norm
    /// returns its input doubled, so the test can tell which sum a norm output came from.
    struct Doubling;

    impl ReferenceOps for Doubling {
        fn eval(&self, op: &Op, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
            let v = |t: &Tensor| t.to_f64_vec();
            match op {
                Op::AddRmsNorm { .. } => {
                    let s: Vec<f64> = v(&inputs[0])
                        .iter()
                        .zip(v(&inputs[1]))
                        .map(|(a, b)| a + b)
                        .collect();
                    Ok(vec![t(&s), t(&s)])
                }
                Op::RmsNorm { .. } => Ok(vec![t(&v(&inputs[0])
                    .iter()
                    .map(|x| 2.0 * x)
                    .collect::<Vec<_>>())]),
                _ => Ok(inputs.to_vec()),
            }
        }
    }

    #[test]
    fn an_add_norms_norm_output_is_held_to_the_norm_of_its_stored_sum() {
        let (x, r, w) = (t(&[1.0, 2.0]), t(&[0.5, 0.25]), t(&[1.0, 1.0]));
        let op = Op::AddRmsNorm { eps: 1e-5 };
        let stored = t(&[1.5, 2.5]);
        let want = reference_outputs(&Doubling, &op, &[x.clone(), r, w], &[stored]).unwrap();
        assert_eq!(
            want[0].to_f64_vec(),
            [1.5, 2.25],
            "the sum: the reference's"
        );
        assert_eq!(
            want[1].to_f64_vec(),
            [3.0, 5.0],
            "the norm: of the stored sum"
        );
        // Other ops: the reference's outputs on the inputs, whatever the kernel returned.
        let want = reference_outputs(&Doubling, &Op::Add, std::slice::from_ref(&x), &[]).unwrap();
        assert_eq!(want[0].to_f64_vec(), x.to_f64_vec());
        // An add + norm without a stored sum to normalize is an error, not a panic.
        assert!(reference_outputs(&Doubling, &op, &[x.clone(), x.clone(), x], &[]).is_err());
    }

    #[test]
    fn compare_measures_abs_and_rel_error() {
        let tol = Tolerance {
            abs: 1e-3,
            rel: 0.0,
        };
        let e = compare(&t(&[1.0, 2.0, -4.0]), &t(&[1.0, 2.001, -4.0]), tol).unwrap();
        assert!((e.max_abs - 1e-3).abs() < 1e-12);
        assert!((e.max_rel - 1e-3 / 2.001).abs() < 1e-9);
        assert_eq!(e.ref_max, 4.0);
        assert!(e.within, "1e-3 <= 1e-3 * 4");
        let e = compare(&t(&[1.0, 2.1]), &t(&[1.0, 2.0]), tol).unwrap();
        assert!(!e.within);
        let e = compare(&t(&[f64::NAN]), &t(&[1.0]), tol).unwrap();
        assert!(!e.within, "NaN must fail");
        assert!(compare(&t(&[1.0]), &t(&[1.0, 2.0]), tol).is_err());
        // Matching infinities pass and leave the magnitude to the finite values.
        let inf = f64::INFINITY;
        let e = compare(&t(&[inf, 2.0005]), &t(&[inf, 2.0]), tol).unwrap();
        assert!(e.within, "{e:?}");
        assert_eq!(e.ref_max, 2.0);
        assert!(
            !compare(&t(&[1.0, 2.0]), &t(&[inf, 2.0]), tol)
                .unwrap()
                .within
        );
        assert!(!compare(&t(&[-inf]), &t(&[inf]), tol).unwrap().within);
    }

    #[test]
    fn a_layer_norm_of_a_nearly_constant_row_is_held_to_its_condition() {
        let t = |v: &[f64], shape: &[usize]| Tensor::from_f64(v, shape, DType::F32).unwrap();
        let (w, b) = (t(&[1.0, 1.0], &[2]), t(&[0.0, 0.0], &[2]));
        let op = Op::LayerNorm { eps: 1e-6 };
        let spread = output_tolerance(
            &op,
            &[t(&[-1.0, 1.0], &[1, 2]), w.clone(), b.clone()],
            0,
            DType::F32,
        );
        let flat = output_tolerance(
            &op,
            &[t(&[1.0, 1.001], &[1, 2]), w.clone(), b.clone()],
            0,
            DType::F32,
        );
        let base = tolerance(&op, DType::F32, 2);
        assert!(spread.abs < 3.0 * base.abs, "{spread:?} vs {base:?}");
        assert!(flat.abs > 100.0 * base.abs, "{flat:?} vs {base:?}");
        assert_eq!(flat.rel, base.rel);
        // The sum of an add + norm is not centered; its norm is, on x + residual.
        let add = Op::AddLayerNorm { eps: 1e-6 };
        let ins = [t(&[1.0, 0.5], &[1, 2]), t(&[0.0, 0.501], &[1, 2]), w, b];
        assert_eq!(
            output_tolerance(&add, &ins, 0, DType::F32),
            tolerance(&add, DType::F32, 2)
        );
        assert!(output_tolerance(&add, &ins, 1, DType::F32).abs > 100.0 * base.abs);
    }

    #[test]
    fn a_linear_with_16_bit_weights_is_held_to_their_dtype() {
        let x = Tensor::from_f64(&[0.5; 8], &[2, 4], DType::F32).unwrap();
        let w32 = Tensor::from_f64(&[0.25; 12], &[3, 4], DType::F32).unwrap();
        let w16 = w32.to_dtype(DType::BF16).unwrap();
        let op = Op::Linear { bias: false };
        let f32_tol = tolerance(&op, DType::F32, 4);
        assert_eq!(
            output_tolerance(&op, &[x.clone(), w32], 0, DType::F32),
            f32_tol
        );
        let mixed = output_tolerance(&op, &[x.clone(), w16], 0, DType::F32);
        assert_eq!(mixed, tolerance(&op, DType::BF16, 4));
        // Other ops keep their output's dtype.
        assert_eq!(
            output_tolerance(&Op::Add, &[x.clone(), x], 0, DType::F32),
            tolerance(&Op::Add, DType::F32, 1)
        );
    }

    #[test]
    fn tolerances_grow_with_precision_and_reduction() {
        let op = Op::Linear { bias: false };
        let f32_small = tolerance(&op, DType::F32, 16);
        let f32_big = tolerance(&op, DType::F32, 4096);
        let bf16 = tolerance(&op, DType::BF16, 16);
        assert!(f32_small.abs < f32_big.abs);
        assert!(f32_small.abs < bf16.abs);
        assert!(tolerance(&Op::Cast { dtype: DType::BF16 }, DType::BF16, 1).abs < bf16.abs);
        // An output of zeros never passes: abs + rel < 1 of the largest magnitude, also
        // for long reductions in 16-bit and e4m3 math.
        let attn = Op::Attention(AttentionParams::new(1, 1, 64, false));
        for d in [DType::BF16, DType::F16, DType::F8E4M3] {
            let t = tolerance(&attn, d, 1 << 16);
            assert!(t.abs + t.rel < 1.0, "{d}: {t:?}");
        }
        assert!(end_to_end_budget(DType::F32) < end_to_end_budget(DType::BF16));
        assert!(end_to_end_budget(DType::BF16) < end_to_end_budget(DType::F8E4M3));
    }
}
