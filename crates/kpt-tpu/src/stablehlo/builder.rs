//! Writes StableHLO as MLIR text: SSA values with their tensor types, one op per line
//! in MLIR's generic form (`"stablehlo.op"(operands) {attributes} : (types) -> type`),
//! which every StableHLO version parses the same way.

use std::fmt::Write;

use kpt_core::{DType, KptError, Result};

/// An SSA value of the function being written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Val {
    /// `%name`.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Element type; `None` for booleans (`i1`).
    pub dtype: Option<DType>,
}

impl Val {
    /// The MLIR tensor type.
    pub fn ty(&self) -> String {
        tensor_type(&self.shape, self.dtype)
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The float dtype (errors for booleans).
    pub fn float(&self) -> DType {
        self.dtype.unwrap_or(DType::F32)
    }
}

/// The MLIR element type of a kpt dtype (`None`: `i1`).
pub(crate) fn element(dtype: Option<DType>) -> &'static str {
    match dtype {
        None => "i1",
        Some(DType::F64) => "f64",
        Some(DType::F32) => "f32",
        Some(DType::F16) => "f16",
        Some(DType::BF16) => "bf16",
        Some(DType::F8E4M3) => "f8E4M3FN",
        Some(DType::F8E5M2) => "f8E5M2",
        Some(DType::I8) => "i8",
        Some(DType::I32) => "i32",
        Some(DType::I64) => "i64",
    }
}

/// `tensor<2x3xf32>`, or `tensor<f32>` for a scalar.
pub(crate) fn tensor_type(shape: &[usize], dtype: Option<DType>) -> String {
    let mut s = String::from("tensor<");
    for d in shape {
        let _ = write!(s, "{d}x");
    }
    s.push_str(element(dtype));
    s.push('>');
    s
}

/// `array<i64: 0, 1>`.
fn i64_array(v: &[usize]) -> String {
    let items: Vec<String> = v.iter().map(usize::to_string).collect();
    if items.is_empty() {
        "array<i64>".into()
    } else {
        format!("array<i64: {}>", items.join(", "))
    }
}

/// `[0, 1]`.
fn list(v: &[usize]) -> String {
    let items: Vec<String> = v.iter().map(usize::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// The bits of `x` in `dtype` as an MLIR hexadecimal float literal (exact).
fn float_literal(x: f64, dtype: DType) -> Result<String> {
    Ok(match dtype {
        DType::F64 => format!("0x{:016X}", x.to_bits()),
        DType::F32 => format!("0x{:08X}", (x as f32).to_bits()),
        DType::F16 => format!("0x{:04X}", half::f16::from_f64(x).to_bits()),
        DType::BF16 => format!("0x{:04X}", half::bf16::from_f64(x).to_bits()),
        other => {
            return Err(KptError::InvalidArgument(format!(
                "no float constant of dtype {other}"
            )))
        }
    })
}

/// Comparison directions of `stablehlo.compare`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    Gt,
    Ge,
    Lt,
    Le,
}

/// Reductions of [`Builder::reduce`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Reduce {
    Sum,
    Max,
    Min,
    Or,
}

/// One function's body under construction.
#[derive(Debug, Default)]
pub(crate) struct Builder {
    body: String,
    next: usize,
    /// The target has no f64 arithmetic (XLA:TPU): lowerings use f32 forms.
    pub no_f64: bool,
}

impl Builder {
    fn fresh(&mut self, shape: &[usize], dtype: Option<DType>) -> Val {
        let v = Val {
            name: format!("%v{}", self.next),
            shape: shape.to_vec(),
            dtype,
        };
        self.next += 1;
        v
    }

    /// Appends `%r = "stablehlo.<op>"(operands) {attrs} : (types) -> result`.
    fn op(
        &mut self,
        op: &str,
        operands: &[&Val],
        attrs: &str,
        shape: &[usize],
        dtype: Option<DType>,
    ) -> Val {
        let r = self.fresh(shape, dtype);
        let names: Vec<&str> = operands.iter().map(|v| v.name.as_str()).collect();
        let types: Vec<String> = operands.iter().map(|v| v.ty()).collect();
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        let _ = writeln!(
            self.body,
            "    {} = \"stablehlo.{op}\"({}){attrs} : ({}) -> {}",
            r.name,
            names.join(", "),
            types.join(", "),
            r.ty()
        );
        r
    }

    /// The finished body lines.
    pub fn finish(self) -> String {
        self.body
    }

    /// A function argument (named `%argN` by the caller).
    pub fn arg(name: String, shape: &[usize], dtype: DType) -> Val {
        Val {
            name,
            shape: shape.to_vec(),
            dtype: Some(dtype),
        }
    }

    /// A float scalar constant of `dtype`, broadcast to `shape`.
    pub fn splat(&mut self, x: f64, shape: &[usize], dtype: DType) -> Result<Val> {
        let lit = float_literal(x, dtype)?;
        Ok(self.constant(&format!("dense<{lit}>"), shape, Some(dtype)))
    }

    /// An integer scalar constant of `dtype`, broadcast to `shape`.
    pub fn splat_int(&mut self, x: i64, shape: &[usize], dtype: DType) -> Val {
        self.constant(&format!("dense<{x}>"), shape, Some(dtype))
    }

    /// A float vector constant of `dtype` (`[values.len()]`).
    pub fn vector(&mut self, values: &[f64], dtype: DType) -> Result<Val> {
        let lits = values
            .iter()
            .map(|&x| float_literal(x, dtype))
            .collect::<Result<Vec<_>>>()?;
        let dense = format!("dense<[{}]>", lits.join(", "));
        Ok(self.constant(&dense, &[values.len()], Some(dtype)))
    }

    fn constant(&mut self, dense: &str, shape: &[usize], dtype: Option<DType>) -> Val {
        let r = self.fresh(shape, dtype);
        let ty = r.ty();
        let _ = writeln!(
            self.body,
            "    {} = \"stablehlo.constant\"() {{value = {dense} : {ty}}} : () -> {ty}",
            r.name
        );
        r
    }

    /// An element-wise op of two values of one shape and dtype.
    pub fn binary(&mut self, op: &str, a: &Val, b: &Val) -> Val {
        let (shape, dtype) = (a.shape.clone(), a.dtype);
        self.op(op, &[a, b], "", &shape, dtype)
    }

    /// An element-wise op of one value.
    pub fn unary(&mut self, op: &str, a: &Val) -> Val {
        let (shape, dtype) = (a.shape.clone(), a.dtype);
        self.op(op, &[a], "", &shape, dtype)
    }

    /// `chlo.<op>` of one value (ops StableHLO has no instruction for, such as `erf`;
    /// XLA expands them).
    pub fn chlo_unary(&mut self, op: &str, a: &Val) -> Val {
        let r = self.fresh(&a.shape, a.dtype);
        let _ = writeln!(
            self.body,
            "    {} = \"chlo.{op}\"({}) : ({}) -> {}",
            r.name,
            a.name,
            a.ty(),
            r.ty()
        );
        r
    }

    /// `a <dir> b` element-wise, as booleans.
    pub fn compare(&mut self, a: &Val, b: &Val, dir: Cmp) -> Val {
        let d = match dir {
            Cmp::Eq => "EQ",
            Cmp::Ne => "NE",
            Cmp::Gt => "GT",
            Cmp::Ge => "GE",
            Cmp::Lt => "LT",
            Cmp::Le => "LE",
        };
        let attrs = format!("comparison_direction = #stablehlo<comparison_direction {d}>");
        let shape = a.shape.clone();
        self.op("compare", &[a, b], &attrs, &shape, None)
    }

    /// `pred ? a : b` element-wise.
    pub fn select(&mut self, pred: &Val, a: &Val, b: &Val) -> Val {
        let (shape, dtype) = (a.shape.clone(), a.dtype);
        self.op("select", &[pred, a, b], "", &shape, dtype)
    }

    /// Element type conversion (a no-op when the dtype already matches).
    pub fn convert(&mut self, a: &Val, dtype: DType) -> Val {
        if a.dtype == Some(dtype) {
            return a.clone();
        }
        let shape = a.shape.clone();
        self.op("convert", &[a], "", &shape, Some(dtype))
    }

    /// Same elements, another shape (a no-op when the shape matches).
    pub fn reshape(&mut self, a: &Val, shape: &[usize]) -> Val {
        if a.shape == shape {
            return a.clone();
        }
        let dtype = a.dtype;
        self.op("reshape", &[a], "", shape, dtype)
    }

    /// Dimensions permuted: result dim `i` is `a`'s dim `perm[i]`.
    pub fn transpose(&mut self, a: &Val, perm: &[usize]) -> Val {
        let shape: Vec<usize> = perm.iter().map(|&p| a.shape[p]).collect();
        let attrs = format!("permutation = {}", i64_array(perm));
        let dtype = a.dtype;
        self.op("transpose", &[a], &attrs, &shape, dtype)
    }

    /// `a` with the order of its elements along `dims` reversed.
    pub fn reverse(&mut self, a: &Val, dims: &[usize]) -> Val {
        let attrs = format!("dimensions = {}", i64_array(dims));
        let (shape, dtype) = (a.shape.clone(), a.dtype);
        self.op("reverse", &[a], &attrs, &shape, dtype)
    }

    /// `a` broadcast to `shape`, its dim `i` becoming dim `dims[i]` of the result.
    pub fn broadcast(&mut self, a: &Val, shape: &[usize], dims: &[usize]) -> Val {
        if a.shape == shape {
            return a.clone();
        }
        let attrs = format!("broadcast_dimensions = {}", i64_array(dims));
        let dtype = a.dtype;
        self.op("broadcast_in_dim", &[a], &attrs, shape, dtype)
    }

    /// `a` broadcast to `shape` along its trailing dims (NumPy-style, leading dims
    /// added).
    pub fn broadcast_trailing(&mut self, a: &Val, shape: &[usize]) -> Val {
        let skip = shape.len() - a.rank();
        let dims: Vec<usize> = (skip..shape.len()).collect();
        self.broadcast(a, shape, &dims)
    }

    /// `a` reduced over its last dim, then broadcast back to `a`'s shape.
    pub fn reduce_last_keep(&mut self, a: &Val, kind: Reduce) -> Result<Val> {
        let r = self.reduce(a, &[a.rank() - 1], kind)?;
        let dims: Vec<usize> = (0..a.rank() - 1).collect();
        Ok(self.broadcast(&r, &a.shape, &dims))
    }

    /// `a` reduced over `dims`.
    pub fn reduce(&mut self, a: &Val, dims: &[usize], kind: Reduce) -> Result<Val> {
        let elem = a.dtype;
        let init = match (kind, elem) {
            (Reduce::Or, None) => self.constant("dense<false>", &[], None),
            (Reduce::Or, Some(_)) => {
                return Err(KptError::InvalidArgument(
                    "or-reduce of a non-boolean".into(),
                ))
            }
            (_, None) => {
                return Err(KptError::InvalidArgument(
                    "arithmetic reduce of booleans".into(),
                ))
            }
            (Reduce::Sum, Some(d)) if d.is_float() => self.splat(0.0, &[], d)?,
            (Reduce::Max, Some(d)) if d.is_float() => self.splat(f64::NEG_INFINITY, &[], d)?,
            (Reduce::Min, Some(d)) if d.is_float() => self.splat(f64::INFINITY, &[], d)?,
            (Reduce::Sum, Some(d)) => self.splat_int(0, &[], d),
            (Reduce::Max, Some(d)) => self.splat_int(i64::from(i32::MIN), &[], d),
            (Reduce::Min, Some(d)) => self.splat_int(i64::from(i32::MAX), &[], d),
        };
        let body_op = match kind {
            Reduce::Sum => "add",
            Reduce::Max => "maximum",
            Reduce::Min => "minimum",
            Reduce::Or => "or",
        };
        let shape: Vec<usize> = (0..a.rank())
            .filter(|i| !dims.contains(i))
            .map(|i| a.shape[i])
            .collect();
        let r = self.fresh(&shape, elem);
        let st = tensor_type(&[], elem);
        let _ = writeln!(
            self.body,
            "    {r} = \"stablehlo.reduce\"({a}, {init}) ({{\n    ^bb0(%lhs: {st}, %rhs: {st}):\n      %red = \"stablehlo.{body_op}\"(%lhs, %rhs) : ({st}, {st}) -> {st}\n      \"stablehlo.return\"(%red) : ({st}) -> ()\n    }}) {{dimensions = {dims}}} : ({aty}, {st}) -> {rty}",
            r = r.name,
            a = a.name,
            init = init.name,
            dims = i64_array(dims),
            aty = a.ty(),
            rty = r.ty(),
        );
        Ok(r)
    }

    /// Integer indices along `dim` of a tensor of `shape`.
    pub fn iota(&mut self, shape: &[usize], dim: usize, dtype: DType) -> Val {
        let attrs = format!("iota_dimension = {dim} : i64");
        self.op("iota", &[], &attrs, shape, Some(dtype))
    }

    /// `dot_general` with the given batch and contracting dims; the result is the batch
    /// dims, then `a`'s free dims, then `b`'s.
    pub fn dot_general(
        &mut self,
        a: &Val,
        b: &Val,
        (a_batch, b_batch): (&[usize], &[usize]),
        (a_contract, b_contract): (&[usize], &[usize]),
        out: DType,
    ) -> Val {
        let free = |v: &Val, batch: &[usize], contract: &[usize]| -> Vec<usize> {
            (0..v.rank())
                .filter(|i| !batch.contains(i) && !contract.contains(i))
                .map(|i| v.shape[i])
                .collect()
        };
        let mut shape: Vec<usize> = a_batch.iter().map(|&i| a.shape[i]).collect();
        shape.extend(free(a, a_batch, a_contract));
        shape.extend(free(b, b_batch, b_contract));
        // f32 / f64 products at full precision: XLA's GPU backend otherwise may run f32
        // dots on TF32 tensor cores (10-bit mantissas).
        let precision = if matches!(a.dtype, Some(DType::F32 | DType::F64)) {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        } else {
            ""
        };
        let attrs = format!(
            "dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = {}, rhs_batching_dimensions = {}, lhs_contracting_dimensions = {}, rhs_contracting_dimensions = {}>{precision}",
            list(a_batch),
            list(b_batch),
            list(a_contract),
            list(b_contract)
        );
        self.op("dot_general", &[a, b], &attrs, &shape, Some(out))
    }

    /// `a[start..limit]` per dim (unit strides).
    pub fn slice(&mut self, a: &Val, start: &[usize], limit: &[usize]) -> Val {
        let shape: Vec<usize> = start.iter().zip(limit).map(|(s, l)| l - s).collect();
        let strides = vec![1; start.len()];
        let attrs = format!(
            "start_indices = {}, limit_indices = {}, strides = {}",
            i64_array(start),
            i64_array(limit),
            i64_array(&strides)
        );
        let dtype = a.dtype;
        self.op("slice", &[a], &attrs, &shape, dtype)
    }

    /// `a` cut along `axis` at `[from, to)`.
    pub fn slice_axis(&mut self, a: &Val, axis: usize, from: usize, to: usize) -> Val {
        let mut start = vec![0; a.rank()];
        let mut limit = a.shape.clone();
        start[axis] = from;
        limit[axis] = to;
        self.slice(a, &start, &limit)
    }

    /// The values joined along `axis`.
    pub fn concatenate(&mut self, parts: &[&Val], axis: usize) -> Val {
        let mut shape = parts[0].shape.clone();
        shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
        let attrs = format!("dimension = {axis} : i64");
        let dtype = parts[0].dtype;
        self.op("concatenate", parts, &attrs, &shape, dtype)
    }

    /// `target` (`[c, r]`) with row `idx[i]` (`idx` `[n, 1]`, integer) replaced by row
    /// `i` of `rows` (`[n, r]`); XLA skips an index outside `0..c`.
    pub fn scatter_rows(&mut self, target: &Val, idx: &Val, rows: &Val) -> Val {
        let r = self.fresh(&target.shape, target.dtype);
        let st = tensor_type(&[], target.dtype);
        let _ = writeln!(
            self.body,
            "    {r} = \"stablehlo.scatter\"({t}, {i}, {u}) ({{\n    ^bb0(%old: {st}, %new: {st}):\n      \"stablehlo.return\"(%new) : ({st}) -> ()\n    }}) {{scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = false}} : ({tt}, {it}, {ut}) -> {rt}",
            r = r.name,
            t = target.name,
            i = idx.name,
            u = rows.name,
            tt = target.ty(),
            it = idx.ty(),
            ut = rows.ty(),
            rt = r.ty(),
        );
        r
    }

    /// Rows `ids` (`[n]`, integer) of `table` (`[v, d]`) -> `[n, d]`.
    pub fn gather_rows(&mut self, table: &Val, ids: &Val) -> Val {
        let (n, d) = (ids.shape[0], table.shape[1]);
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = {}, indices_are_sorted = false",
            i64_array(&[1, d])
        );
        let dtype = table.dtype;
        self.op("gather", &[table, ids], &attrs, &[n, d], dtype)
    }
}
