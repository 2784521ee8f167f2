//! Activation precision: on a GPU at the balanced and aggressive levels, a graph built
//! in f32 computes its activations in bf16 (PyTorch's `model.to(torch.bfloat16)`, what
//! vLLM serves by default), so that the registry picks the bf16 kernels (tensor-core
//! attention, half-width norms and element-wise ops) instead of their f32 versions.
//!
//! What converts: every f32 graph input gets a `Cast` right after it; every f32
//! parameter becomes a bf16 tensor (norm weights and biases, embedding tables, masks),
//! except the weights of linear layers, which the weight pass that runs next stores in
//! its own dtype (bf16, FP8 or int8, with their kernels now checked against bf16
//! activations); `Cast` and `Dequantize` nodes that produced f32 produce bf16 (a cast
//! that becomes a no-op is dropped). Integer values (ids, positions, `cu_seqlens`, block
//! tables) and quantized tensors are untouched; outputs that are f32 by an op's contract
//! (attention's log-sum-exp) stay f32.
//!
//! Graph outputs are cast back to the dtype the original graph declared, so callers see
//! the same logits, except the KV cache: an output that attention reads as keys or
//! values stays bf16, and a graph input that a `Concat` appends to or a `CacheWrite`
//! writes into before it (the keys and values of a decode step), or that a paged
//! attention reads as its block cache, is declared bf16 instead of being cast. A prefill plan then gives bf16 caches
//! and a decode plan takes and returns them, exactly, with no per-step conversion of
//! the whole cache, and the in-place append of the executor still applies. Callers
//! read each input's dtype from the plan's graph. (With `precision.activation_dtype =
//! "f16"`, read f16 for bf16 throughout.)
//!
//! A node for which the device has no kernel with the converted dtypes keeps its
//! original dtypes, with casts around it (reported), so the pass never makes a graph
//! unrunnable.

use std::collections::{HashMap, HashSet};

use crate::error::Result;
use crate::graph::{Graph, Node, Op, TensorSpec, ValueId, ValueSource};
use crate::hardware::{DeviceInfo, DeviceKind};
use crate::DType;

use super::{KernelSelector, OptLevel, PassReport, PrecisionPolicy};

/// The activation dtype a device computes in at the balanced and aggressive levels when
/// the config sets none: bf16 on GPUs (CUDA, ROCm), whose tensor cores and flash
/// attention kernels take bf16; `None` (the graph's own dtype) on the CPU, whose
/// kernels are memory-bound on weights and keep f32 activations, and on the TPU, whose
/// backend picks its own precision.
pub fn default_activation_dtype(device: &DeviceInfo) -> Option<DType> {
    match device.kind {
        DeviceKind::Cuda | DeviceKind::Rocm => Some(DType::BF16),
        DeviceKind::Cpu | DeviceKind::Tpu => None,
    }
}

impl PrecisionPolicy {
    /// The dtype f32 activations are converted to at `level` on `device`, or `None` when
    /// they stay as they are: never at the conservative level; otherwise the policy's
    /// `activation_dtype`, else [`default_activation_dtype`]. f32 (or f64) means no
    /// conversion.
    pub fn activation_target(&self, level: OptLevel, device: &DeviceInfo) -> Option<DType> {
        if level == OptLevel::Conservative {
            return None;
        }
        self.activation_dtype
            .or_else(|| default_activation_dtype(device))
            .filter(|d| matches!(d, DType::BF16 | DType::F16))
    }
}

/// Whether `v` is read only as the weight of linear layers (the weight pass owns it).
pub(crate) fn only_linear_weight(
    graph: &Graph,
    consumers: &[Vec<crate::graph::NodeId>],
    v: ValueId,
) -> bool {
    !consumers[v.0].is_empty()
        && consumers[v.0].iter().all(|c| {
            let n = &graph.nodes()[c.0];
            matches!(n.op, Op::Linear { .. } | Op::LinearAct { .. })
                && n.inputs[1] == v
                && !n.inputs[..1].contains(&v)
                && !n.inputs[2..].contains(&v)
        })
}

/// The KV-cache values of `graph`: outputs that an attention node reads as keys or
/// values; inputs that a `Concat` or `CacheWrite` producing one of them updates, and
/// inputs that a paged attention reads as its key and value caches.
fn kv_cache_values(graph: &Graph) -> (HashSet<ValueId>, HashSet<ValueId>) {
    let mut read_as_kv = HashSet::new();
    let mut inputs = HashSet::new();
    for node in graph.nodes() {
        if let Op::Attention(p) = node.op {
            read_as_kv.extend(node.inputs[1..3].iter().copied());
            if p.paged {
                inputs.extend(
                    node.inputs[1..3]
                        .iter()
                        .copied()
                        .filter(|&v| matches!(graph.value(v).source, ValueSource::Input)),
                );
            }
        }
    }
    let outputs: HashSet<ValueId> = graph
        .outputs()
        .iter()
        .copied()
        .filter(|o| read_as_kv.contains(o))
        .collect();
    for node in graph.nodes() {
        if matches!(node.op, Op::Concat { .. } | Op::CacheWrite)
            && outputs.contains(&node.outputs[0])
        {
            let past = node.inputs[0];
            if matches!(graph.value(past).source, ValueSource::Input) {
                inputs.insert(past);
            }
        }
    }
    (inputs, outputs)
}

/// Builds the converted graph.
struct Converter<'a> {
    src: &'a Graph,
    dst: Graph,
    act: DType,
    /// Source value -> its value in `dst` (in whatever dtype it now has).
    map: HashMap<ValueId, ValueId>,
    /// (dst value, dtype) -> the cast of that value to that dtype.
    casts: HashMap<(ValueId, DType), ValueId>,
    /// Source param -> its converted copy in `dst`.
    converted: HashMap<ValueId, ValueId>,
    /// Source params the weight pass owns (linear weights).
    linear_weights: HashSet<ValueId>,
    report: PassReport,
}

impl Converter<'_> {
    /// `v` (a dst value) in `dtype`, through a memoized `Cast`.
    fn cast(&mut self, v: ValueId, dtype: DType) -> Result<ValueId> {
        if self.dst.spec(v)?.dtype == dtype {
            return Ok(v);
        }
        if let Some(&c) = self.casts.get(&(v, dtype)) {
            return Ok(c);
        }
        let name = format!("{}.{dtype}", self.dst.value(v).name);
        let c = self.dst.op(name, Op::Cast { dtype }, &[v])?;
        self.casts.insert((v, dtype), c);
        Ok(c)
    }

    /// The dst value of source value `v` as it is (params copied unchanged).
    fn original(&mut self, v: ValueId) -> ValueId {
        if let Some(&n) = self.map.get(&v) {
            return n;
        }
        let value = self.src.value(v);
        let n = match &value.source {
            ValueSource::Param(t) => self.dst.param(value.name.clone(), t.clone()),
            _ => unreachable!("value `{}` used before it was defined", value.name),
        };
        self.map.insert(v, n);
        n
    }

    /// The dst value of source value `v` for a converted node: f32 params in the
    /// activation dtype (except linear weights), everything else as mapped.
    fn converted(&mut self, v: ValueId) -> Result<ValueId> {
        if let Some(&n) = self.converted.get(&v) {
            return Ok(n);
        }
        let value = self.src.value(v);
        match &value.source {
            ValueSource::Param(t)
                if t.dtype() == DType::F32 && !self.linear_weights.contains(&v) =>
            {
                let n = self.dst.param(value.name.clone(), t.to_dtype(self.act)?);
                self.report
                    .change(format!("param {}: f32 -> {}", value.name, self.act));
                self.converted.insert(v, n);
                Ok(n)
            }
            _ => Ok(self.original(v)),
        }
    }

    /// The op of `node` with f32 results retargeted to the activation dtype.
    fn converted_op(&self, op: &Op) -> Op {
        match op {
            Op::Cast { dtype: DType::F32 } => Op::Cast { dtype: self.act },
            Op::Dequantize { dtype: DType::F32 } => Op::Dequantize { dtype: self.act },
            _ => op.clone(),
        }
    }

    /// Whether `op` on dst values `ins` infers and has a kernel on `device`.
    fn runs(
        &self,
        op: &Op,
        ins: &[ValueId],
        selector: &dyn KernelSelector,
        device: &DeviceInfo,
    ) -> Result<std::result::Result<(), String>> {
        let specs: Vec<TensorSpec> = ins
            .iter()
            .map(|&v| self.dst.spec(v).cloned())
            .collect::<Result<_>>()?;
        if let Err(e) = op.infer(&specs) {
            return Ok(Err(e.to_string()));
        }
        let verdict = selector.select(op, &specs, device).map(|_| ());
        // A linear weight still f32 here is the weight pass's to convert; a kernel for
        // it in the activation dtype is enough.
        let linear = matches!(op, Op::Linear { .. } | Op::LinearAct { .. });
        if verdict.is_err() && linear && specs[1].dtype == DType::F32 {
            let mut converted = specs.clone();
            converted[1].dtype = self.act;
            if selector.select(op, &converted, device).is_ok() {
                return Ok(Ok(()));
            }
        }
        Ok(verdict.map_err(|e| e.to_string()))
    }

    /// Emits `node` in the activation dtype, or with its original dtypes when the device
    /// cannot run the converted node.
    fn node(
        &mut self,
        node: &Node,
        selector: &dyn KernelSelector,
        device: &DeviceInfo,
    ) -> Result<()> {
        let op = self.converted_op(&node.op);
        // As mapped: values that are f32 by contract (a log-sum-exp) stay f32.
        let mut ins = node
            .inputs
            .iter()
            .map(|&v| self.converted(v))
            .collect::<Result<Vec<_>>>()?;
        if let Op::Cast { dtype } = op {
            if self.dst.spec(ins[0])?.dtype == dtype {
                // A cast made a no-op by the conversion.
                self.map.insert(node.outputs[0], ins[0]);
                self.report
                    .change(format!("{}: dropped ({dtype} already)", node.name));
                return Ok(());
            }
        }
        let mut verdict = self.runs(&op, &ins, selector, device)?;
        if verdict.is_err() {
            // f32 activations coming out of a node kept in f32.
            for (i, &v) in node.inputs.iter().enumerate() {
                let src_dtype = self.src.spec(v)?.dtype;
                if src_dtype == DType::F32 && self.dst.spec(ins[i])?.dtype == DType::F32 {
                    ins[i] = self.cast(ins[i], self.act)?;
                }
            }
            verdict = self.runs(&op, &ins, selector, device)?;
        }
        match verdict {
            Ok(()) => {
                let outs = self.dst.op_multi(node.name.clone(), op, &ins)?;
                for (&o, &n) in node.outputs.iter().zip(&outs) {
                    self.map.insert(o, n);
                }
            }
            Err(why) => {
                let mut ins = Vec::with_capacity(node.inputs.len());
                for &v in &node.inputs {
                    let want = self.src.spec(v)?.dtype;
                    let n = match self.src.value(v).source {
                        ValueSource::Param(_) => self.original(v),
                        _ => {
                            let n = self.map[&v];
                            self.cast(n, want)?
                        }
                    };
                    ins.push(n);
                }
                let outs = self
                    .dst
                    .op_multi(node.name.clone(), node.op.clone(), &ins)?;
                for (&o, &n) in node.outputs.iter().zip(&outs) {
                    self.map.insert(o, n);
                }
                self.report.change(format!(
                    "{}: kept {} (no {} kernel: {why})",
                    node.name,
                    self.src.spec(node.outputs[0])?.dtype,
                    self.act
                ));
            }
        }
        Ok(())
    }
}

/// Converts the f32 activations of `graph` to the policy's activation dtype for
/// `device` at `level` (see the module docs); a no-op where
/// [`PrecisionPolicy::activation_target`] is `None` or the graph has no f32 value.
pub fn apply_activation_precision(
    graph: &Graph,
    level: OptLevel,
    policy: &PrecisionPolicy,
    selector: &dyn KernelSelector,
    device: &DeviceInfo,
) -> Result<(Graph, PassReport)> {
    let report = PassReport::new("activation_precision");
    let Some(act) = policy.activation_target(level, device) else {
        return Ok((graph.clone(), report));
    };
    let has_f32 = graph
        .values()
        .iter()
        .any(|v| v.spec.dtype == DType::F32 && !matches!(v.source, ValueSource::Node { .. }))
        || graph.nodes().iter().any(|n| {
            matches!(
                n.op,
                Op::Cast { dtype: DType::F32 } | Op::Dequantize { dtype: DType::F32 }
            )
        });
    if !has_f32 {
        return Ok((graph.clone(), report));
    }
    let consumers = graph.consumers();
    let linear_weights = graph
        .values()
        .iter()
        .enumerate()
        .map(|(i, _)| ValueId(i))
        .filter(|&v| {
            matches!(graph.value(v).source, ValueSource::Param(_))
                && only_linear_weight(graph, &consumers, v)
        })
        .collect();
    let (cache_inputs, cache_outputs) = kv_cache_values(graph);
    let mut cv = Converter {
        src: graph,
        dst: Graph::new(),
        act,
        map: HashMap::new(),
        casts: HashMap::new(),
        converted: HashMap::new(),
        linear_weights,
        report,
    };
    for &i in graph.inputs() {
        let v = graph.value(i);
        let (dtype, shape) = (v.spec.dtype, v.spec.shape.clone());
        if dtype != DType::F32 {
            let n = cv.dst.input(v.name.clone(), dtype, &shape);
            cv.map.insert(i, n);
        } else if cache_inputs.contains(&i) {
            let n = cv.dst.input(v.name.clone(), act, &shape);
            cv.map.insert(i, n);
            cv.report
                .change(format!("input {}: KV cache declared {act}", v.name));
        } else {
            let n = cv.dst.input(v.name.clone(), dtype, &shape);
            let c = cv.cast(n, act)?;
            cv.map.insert(i, c);
            cv.report
                .change(format!("input {}: f32 -> cast to {act}", v.name));
        }
    }
    for node in graph.nodes() {
        cv.node(node, selector, device)?;
    }
    for &o in graph.outputs() {
        let n = cv.original(o);
        let want = graph.spec(o)?.dtype;
        let have = cv.dst.spec(n)?.dtype;
        let out = if have == want || cache_outputs.contains(&o) {
            if have != want {
                cv.report.change(format!(
                    "output {}: KV cache kept in {have}",
                    graph.value(o).name
                ));
            }
            n
        } else {
            let name = graph.value(o).name.clone();
            let c = match cv.casts.get(&(n, want)) {
                Some(&c) => c,
                None => {
                    let c = cv.dst.op(name.clone(), Op::Cast { dtype: want }, &[n])?;
                    cv.casts.insert((n, want), c);
                    c
                }
            };
            cv.report
                .change(format!("output {name}: cast {have} -> {want}"));
            c
        };
        cv.dst.output(out)?;
    }
    Ok((cv.dst, cv.report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::AttentionParams;
    use crate::optimize::{apply_precision, KernelChoice};
    use crate::tensor::Tensor;
    use crate::KptError;

    /// Accepts every op except those of `reject` with a first float input in `dtype`.
    struct Selector {
        reject: Vec<(&'static str, DType)>,
    }

    impl KernelSelector for Selector {
        fn select(
            &self,
            op: &Op,
            inputs: &[TensorSpec],
            device: &DeviceInfo,
        ) -> Result<KernelChoice> {
            let kind = op.kind().name();
            if self
                .reject
                .iter()
                .any(|&(k, d)| k == kind && inputs[0].dtype == d)
            {
                return Err(KptError::NoKernel {
                    op: op.to_string(),
                    backend: device.name.clone(),
                    reasons: vec![],
                });
            }
            Ok(KernelChoice {
                kernel: format!("test.{kind}"),
                backend: device.kind,
                skipped: vec![],
            })
        }
    }

    fn any() -> Selector {
        Selector { reject: vec![] }
    }

    fn device(kind: DeviceKind) -> DeviceInfo {
        DeviceInfo {
            kind,
            index: 0,
            name: format!("test {kind}"),
            memory_bytes: None,
            compute_units: Some(1),
            arch: Some("sm_90".into()),
            features: vec![],
            properties: Default::default(),
        }
    }

    fn weight(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) / 7.0).collect();
        Tensor::from_vec(data, shape).unwrap()
    }

    /// A one-layer decoder step: embedding (tied to the output layer), RMS norm, q/k/v
    /// with bias on q, rotary, cache append, attention, output projection, logits.
    /// Outputs: logits, then the extended keys and values.
    fn decoder(decode: bool) -> Graph {
        let (d, kvd, vocab) = (16, 8, 11);
        let mut g = Graph::new();
        let ids = g.input("ids", DType::I64, &[1, 2]);
        let pos = g.input("pos", DType::I64, &[2]);
        let past = decode.then(|| {
            (
                g.input("past.0.k", DType::F32, &[1, 3, kvd]),
                g.input("past.0.v", DType::F32, &[1, 3, kvd]),
            )
        });
        let table = g.param("embed", weight(&[vocab, d]));
        let norm = g.param("norm", Tensor::from_vec(vec![1f32; d], &[d]).unwrap());
        let (wq, bq) = (g.param("wq", weight(&[d, d])), g.param("bq", weight(&[d])));
        let wk = g.param("wk", weight(&[kvd, d]));
        let wv = g.param("wv", weight(&[kvd, d]));
        let wo = g.param("wo", weight(&[d, d]));
        let x = g.op("embed", Op::Embedding, &[ids, table]).unwrap();
        let h = g.op("norm", Op::RmsNorm { eps: 1e-5 }, &[x, norm]).unwrap();
        let q = g.op("q", Op::Linear { bias: true }, &[h, wq, bq]).unwrap();
        let k = g.op("k", Op::Linear { bias: false }, &[h, wk]).unwrap();
        let v = g.op("v", Op::Linear { bias: false }, &[h, wv]).unwrap();
        let rot = Op::Rotary {
            head_dim: 8,
            theta: 10000.0,
            scaling: None,
        };
        let q = g.op("q_rot", rot.clone(), &[q, pos]).unwrap();
        let mut k = g.op("k_rot", rot, &[k, pos]).unwrap();
        let mut v = v;
        if let Some((pk, pv)) = past {
            k = g.op("k_cache", Op::Concat { axis: 1 }, &[pk, k]).unwrap();
            v = g.op("v_cache", Op::Concat { axis: 1 }, &[pv, v]).unwrap();
        }
        let p = AttentionParams::new(2, 1, 8, true);
        let a = g.op("attn", Op::Attention(p), &[q, k, v]).unwrap();
        let o = g.op("o", Op::Linear { bias: false }, &[a, wo]).unwrap();
        let r = g.op("residual", Op::Add, &[x, o]).unwrap();
        let logits = g
            .op("lm_head", Op::Linear { bias: false }, &[r, table])
            .unwrap();
        g.output(logits).unwrap();
        g.output(k).unwrap();
        g.output(v).unwrap();
        g
    }

    fn convert(g: &Graph, level: OptLevel, kind: DeviceKind) -> (Graph, PassReport) {
        let policy = PrecisionPolicy::default();
        apply_activation_precision(g, level, &policy, &any(), &device(kind)).unwrap()
    }

    fn dtype_of(g: &Graph, name: &str) -> DType {
        g.values()
            .iter()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("no value {name}"))
            .spec
            .dtype
    }

    fn input_dtypes(g: &Graph) -> Vec<DType> {
        g.inputs()
            .iter()
            .map(|&i| g.spec(i).unwrap().dtype)
            .collect()
    }

    fn output_dtypes(g: &Graph) -> Vec<DType> {
        g.outputs()
            .iter()
            .map(|&o| g.spec(o).unwrap().dtype)
            .collect()
    }

    /// The op kinds and output dtypes of every node, in order (names aside).
    fn shape_of(g: &Graph) -> Vec<(String, Vec<DType>)> {
        g.nodes()
            .iter()
            .map(|n| {
                let d = n.outputs.iter().map(|&o| g.spec(o).unwrap().dtype);
                (n.op.to_string(), d.collect())
            })
            .collect()
    }

    #[test]
    fn gpus_compute_in_bf16_and_the_cpu_keeps_f32() {
        let cpu = device(DeviceKind::Cpu);
        let gpu = device(DeviceKind::Cuda);
        let p = PrecisionPolicy::default();
        assert_eq!(p.activation_target(OptLevel::Balanced, &cpu), None);
        assert_eq!(
            p.activation_target(OptLevel::Balanced, &gpu),
            Some(DType::BF16)
        );
        assert_eq!(
            p.activation_target(OptLevel::Aggressive, &gpu),
            Some(DType::BF16)
        );
        assert_eq!(p.activation_target(OptLevel::Conservative, &gpu), None);
        let forced = PrecisionPolicy {
            activation_dtype: Some(DType::F16),
            ..p.clone()
        };
        assert_eq!(
            forced.activation_target(OptLevel::Balanced, &cpu),
            Some(DType::F16)
        );
        assert_eq!(forced.activation_target(OptLevel::Conservative, &cpu), None);
        let f32 = PrecisionPolicy {
            activation_dtype: Some(DType::F32),
            ..p
        };
        assert_eq!(f32.activation_target(OptLevel::Balanced, &gpu), None);
    }

    #[test]
    fn decode_graph_converts_with_bf16_caches() {
        let src = decoder(true);
        let (g, report) = convert(&src, OptLevel::Balanced, DeviceKind::Cuda);
        // Integer inputs untouched, the caches declared bf16, logits back in f32.
        assert_eq!(
            input_dtypes(&g),
            vec![DType::I64, DType::I64, DType::BF16, DType::BF16]
        );
        assert_eq!(
            output_dtypes(&g),
            vec![DType::F32, DType::BF16, DType::BF16]
        );
        assert_eq!(g.value(g.outputs()[0]).name, "lm_head");
        // Every param but the linear weights is bf16; those are the weight pass's.
        for name in ["embed", "norm", "bq"] {
            assert_eq!(dtype_of(&g, name), DType::BF16, "{name}");
        }
        for name in ["wq", "wk", "wv", "wo"] {
            assert_eq!(dtype_of(&g, name), DType::F32, "{name}");
        }
        // Attention and the norm run in bf16; one cast, at the logits.
        for name in ["attn", "norm", "k_cache", "q_rot", "residual"] {
            let node = g.nodes().iter().find(|n| n.name == name).unwrap();
            assert_eq!(
                g.spec(node.outputs[0]).unwrap().dtype,
                DType::BF16,
                "{name}"
            );
        }
        let casts: Vec<&str> = g
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Cast { .. }))
            .map(|n| n.name.as_str())
            .collect();
        assert_eq!(casts, vec!["lm_head"]);
        assert!(
            report.changes.iter().any(|c| c.contains("KV cache")),
            "{report:?}"
        );
        assert!(report.changes.iter().any(|c| c.contains("param embed")));
        // The cache is appended to in place: the concat reads the input directly.
        let concat = g.nodes().iter().find(|n| n.name == "k_cache").unwrap();
        assert_eq!(concat.inputs[0], g.inputs()[2]);
    }

    #[test]
    fn prefill_caches_match_decode_inputs() {
        let (pre, _) = convert(&decoder(false), OptLevel::Balanced, DeviceKind::Cuda);
        let (dec, _) = convert(&decoder(true), OptLevel::Balanced, DeviceKind::Cuda);
        assert_eq!(output_dtypes(&pre)[1..], input_dtypes(&dec)[2..]);
        assert_eq!(output_dtypes(&pre)[1..], output_dtypes(&dec)[1..]);
    }

    #[test]
    fn float_inputs_are_cast_after_them_and_outputs_back() {
        let mut src = Graph::new();
        let x = src.input("x", DType::F32, &[3, 8]);
        let nw = src.param("nw", weight(&[8]));
        let w = src.param("w", weight(&[4, 8]));
        let h = src.op("norm", Op::RmsNorm { eps: 1e-6 }, &[x, nw]).unwrap();
        let y = src.op("proj", Op::Linear { bias: false }, &[h, w]).unwrap();
        src.output(y).unwrap();
        src.output(h).unwrap();
        let (g, _) = convert(&src, OptLevel::Aggressive, DeviceKind::Cuda);
        assert_eq!(input_dtypes(&g), vec![DType::F32]);
        assert_eq!(output_dtypes(&g), vec![DType::F32, DType::F32]);
        let first = &g.nodes()[0];
        assert_eq!(first.op, Op::Cast { dtype: DType::BF16 });
        assert_eq!(first.inputs, vec![g.inputs()[0]]);
        let out_names: Vec<&str> = g
            .outputs()
            .iter()
            .map(|&o| g.value(o).name.as_str())
            .collect();
        assert_eq!(out_names, vec!["proj", "norm"]);
    }

    #[test]
    fn paged_caches_are_declared_bf16() {
        let mut src = Graph::new();
        let q = src.input("q", DType::F32, &[2, 1, 16]);
        let kc = src.input("k_cache", DType::F32, &[4, 8, 8]);
        let vc = src.input("v_cache", DType::F32, &[4, 8, 8]);
        let table = src.input("block_table", DType::I32, &[2, 2]);
        let lens = src.input("seq_lens", DType::I32, &[2]);
        let mut p = AttentionParams::new(2, 1, 8, true);
        p.paged = true;
        let o = src
            .op("attn", Op::Attention(p), &[q, kc, vc, table, lens])
            .unwrap();
        src.output(o).unwrap();
        let (g, _) = convert(&src, OptLevel::Balanced, DeviceKind::Cuda);
        assert_eq!(
            input_dtypes(&g),
            vec![DType::F32, DType::BF16, DType::BF16, DType::I32, DType::I32]
        );
        let attn = g.nodes().iter().find(|n| n.name == "attn").unwrap();
        assert_eq!(attn.inputs[1..3], g.inputs()[1..3]);
        assert_eq!(output_dtypes(&g), vec![DType::F32]);
    }

    #[test]
    fn cpu_and_conservative_are_no_ops() {
        let src = decoder(true);
        for (level, kind) in [
            (OptLevel::Balanced, DeviceKind::Cpu),
            (OptLevel::Aggressive, DeviceKind::Cpu),
            (OptLevel::Conservative, DeviceKind::Cuda),
        ] {
            let (g, report) = convert(&src, level, kind);
            assert_eq!(g, src, "{level} on {kind}");
            assert!(report.changes.is_empty());
        }
    }

    #[test]
    fn converting_twice_changes_nothing_more() {
        let (once, _) = convert(&decoder(true), OptLevel::Balanced, DeviceKind::Cuda);
        let (twice, _) = convert(&once, OptLevel::Balanced, DeviceKind::Cuda);
        assert_eq!(shape_of(&twice), shape_of(&once));
        assert_eq!(input_dtypes(&twice), input_dtypes(&once));
        assert_eq!(output_dtypes(&twice), output_dtypes(&once));
        assert_eq!(twice.param_bytes(), once.param_bytes());
    }

    #[test]
    fn nodes_without_a_converted_kernel_keep_f32_between_casts() {
        let src = decoder(true);
        let sel = Selector {
            reject: vec![("rms_norm", DType::BF16)],
        };
        let policy = PrecisionPolicy::default();
        let (g, report) = apply_activation_precision(
            &src,
            OptLevel::Balanced,
            &policy,
            &sel,
            &device(DeviceKind::Cuda),
        )
        .unwrap();
        let norm = g.nodes().iter().find(|n| n.name == "norm").unwrap();
        assert_eq!(g.spec(norm.outputs[0]).unwrap().dtype, DType::F32);
        assert_eq!(g.spec(norm.inputs[1]).unwrap().dtype, DType::F32);
        assert!(
            report
                .changes
                .iter()
                .any(|c| c.starts_with("norm: kept f32")),
            "{report:?}"
        );
        // The rest still runs in bf16.
        let attn = g.nodes().iter().find(|n| n.name == "attn").unwrap();
        assert_eq!(g.spec(attn.outputs[0]).unwrap().dtype, DType::BF16);
        for node in g.nodes() {
            let specs: Vec<TensorSpec> = node
                .inputs
                .iter()
                .map(|&v| g.spec(v).unwrap().clone())
                .collect();
            sel.select(&node.op, &specs, &device(DeviceKind::Cuda))
                .unwrap();
        }
    }

    #[test]
    fn the_weight_pass_then_picks_weights_for_bf16_activations() {
        let gpu = device(DeviceKind::Cuda);
        let policy = PrecisionPolicy::default();
        let (g, _) = convert(&decoder(true), OptLevel::Aggressive, DeviceKind::Cuda);
        let (g, report) = apply_precision(&g, OptLevel::Aggressive, &policy, &any(), &gpu).unwrap();
        for name in ["wq", "wk", "wv", "wo"] {
            assert_eq!(dtype_of(&g, name), DType::F8E4M3, "{name}");
        }
        // The tied table is an embedding too: bf16, like the activations.
        assert_eq!(dtype_of(&g, "embed"), DType::BF16);
        assert!(
            report
                .changes
                .iter()
                .any(|c| c == "lm_head: kept bf16 weight (shared with another op)"),
            "{report:?}"
        );
    }

    #[test]
    fn dequantize_and_cast_to_f32_follow_the_activation_dtype() {
        let mut src = Graph::new();
        let x = src.input("x", DType::F32, &[2, 4]);
        let q = src.param("q", weight(&[2, 4]).to_dtype(DType::I8).unwrap());
        let d = src
            .op("deq", Op::Dequantize { dtype: DType::F32 }, &[q])
            .unwrap();
        let s = src.op("sum", Op::Add, &[x, d]).unwrap();
        let c = src.op("up", Op::Cast { dtype: DType::F32 }, &[s]).unwrap();
        src.output(c).unwrap();
        let (g, report) = convert(&src, OptLevel::Balanced, DeviceKind::Cuda);
        let deq = g.nodes().iter().find(|n| n.name == "deq").unwrap();
        assert_eq!(deq.op, Op::Dequantize { dtype: DType::BF16 });
        assert_eq!(dtype_of(&g, "q"), DType::I8);
        assert!(report.changes.iter().any(|c| c.starts_with("up: dropped")));
        assert_eq!(output_dtypes(&g), vec![DType::F32]);
    }
}
