//! Running a [`Plan`] on a [`Backend`]: parameters uploaded once, intermediate
//! buffers shared as the memory plan says, shapes re-inferred on every run.
//!
//! Inputs and outputs are host [`Tensor`]s ([`Executor::run`]) or, for values that stay
//! on the device between runs such as a KV cache, [`DeviceTensor`]s
//! ([`Executor::run_resident`]). A cache update runs in place when the cache is a graph
//! input that nothing else reads: [`Op::CacheWrite`](crate::graph::Op::CacheWrite) writes
//! its rows into the input's buffer ([`Backend::write_rows`]), and an
//! [`Op::Concat`](crate::graph::Op::Concat) that appends to a device-resident input with
//! room to spare (a cache allocated by [`DeviceTensor::with_capacity`]) copies only the
//! new rows. The output is then the input's buffer.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BufferMut, BufferRef, DeviceBuffer};
use crate::error::{KptError, Result};
use crate::graph::{Graph, Op, TensorSpec, ValueId, ValueSource};
use crate::optimize::Plan;
use crate::tensor::Tensor;

/// A value held in a backend buffer between runs. The buffer may be larger than the
/// value, which is its first `spec.numel()` elements.
#[derive(Debug)]
pub struct DeviceTensor {
    /// The buffer.
    pub buffer: DeviceBuffer,
    /// Shape and dtype of the value.
    pub spec: TensorSpec,
}

impl DeviceTensor {
    /// Copies `tensor` to `backend`.
    pub fn upload(backend: &dyn Backend, tensor: &Tensor) -> Result<Self> {
        Ok(Self {
            buffer: backend.upload(tensor)?,
            spec: TensorSpec::new(tensor.shape(), tensor.dtype()),
        })
    }

    /// The value in a new buffer of `capacity` elements (at least the value's), so that
    /// appending to it runs in place.
    pub fn with_capacity(&self, backend: &dyn Backend, capacity: usize) -> Result<Self> {
        let mut buffer = backend.allocate(self.spec.dtype, capacity.max(self.spec.numel()))?;
        backend.copy_into(self.as_ref(), &mut buffer, 0)?;
        buffer.scale = self.buffer.scale;
        Ok(Self {
            buffer,
            spec: self.spec.clone(),
        })
    }

    /// Copies the value back to the host.
    pub fn download(&self, backend: &dyn Backend) -> Result<Tensor> {
        backend.download(&self.buffer, &self.spec)
    }

    fn as_ref(&self) -> BufferRef<'_> {
        BufferRef {
            buffer: &self.buffer,
            spec: &self.spec,
        }
    }
}

/// An input or output of [`Executor::run_resident`].
#[derive(Debug)]
pub enum RunTensor {
    /// On the host; uploaded for the run (inputs) or downloaded after it (outputs).
    Host(Tensor),
    /// Already on the executor's backend.
    Device(DeviceTensor),
}

impl RunTensor {
    /// Shape and dtype.
    pub fn spec(&self) -> TensorSpec {
        match self {
            RunTensor::Host(t) => TensorSpec::new(t.shape(), t.dtype()),
            RunTensor::Device(d) => d.spec.clone(),
        }
    }

    /// The value on the host (downloaded when on the device).
    pub fn into_host(self, backend: &dyn Backend) -> Result<Tensor> {
        match self {
            RunTensor::Host(t) => Ok(t),
            RunTensor::Device(d) => d.download(backend),
        }
    }

    /// The value on `backend` (uploaded when on the host).
    pub fn into_device(self, backend: &dyn Backend) -> Result<DeviceTensor> {
        match self {
            RunTensor::Host(t) => DeviceTensor::upload(backend, &t),
            RunTensor::Device(d) => Ok(d),
        }
    }
}

/// An input of a run: borrowed from the caller of [`Executor::run`] (uploaded without a
/// host copy) or handed over with [`Executor::run_resident`].
enum Feed<'a> {
    Host(Cow<'a, Tensor>),
    Device(DeviceTensor),
}

impl Feed<'_> {
    fn spec(&self) -> TensorSpec {
        match self {
            Feed::Host(t) => TensorSpec::new(t.shape(), t.dtype()),
            Feed::Device(d) => d.spec.clone(),
        }
    }

    fn into_buffer(self, backend: &dyn Backend) -> Result<DeviceBuffer> {
        match self {
            Feed::Host(t) => backend.upload(&t),
            Feed::Device(d) => Ok(d.buffer),
        }
    }
}

impl From<RunTensor> for Feed<'_> {
    fn from(t: RunTensor) -> Self {
        match t {
            RunTensor::Host(t) => Feed::Host(Cow::Owned(t)),
            RunTensor::Device(d) => Feed::Device(d),
        }
    }
}

/// Executes a plan on one backend; reuses its buffers across runs.
pub struct Executor {
    plan: Plan,
    backend: Arc<dyn Backend>,
    params: Vec<Option<DeviceBuffer>>,
    slots: Vec<Option<DeviceBuffer>>,
    /// Per node: the graph-input index of the cache a `Concat` or `CacheWrite` may
    /// update in place.
    appends: Vec<Option<usize>>,
    /// Host time of the last run up to its final wait for the backend.
    last_launch: Duration,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("nodes", &self.plan.graph.nodes().len())
            .finish_non_exhaustive()
    }
}

/// Per node, the graph input a `Concat` or `CacheWrite` can update in place: its first
/// operand, when that is a graph input read by no other node and not itself a graph
/// output.
fn in_place_appends(graph: &Graph) -> Vec<Option<usize>> {
    let mut uses = vec![0usize; graph.values().len()];
    for node in graph.nodes() {
        for v in &node.inputs {
            uses[v.0] += 1;
        }
    }
    for v in graph.outputs() {
        uses[v.0] += 1;
    }
    graph
        .nodes()
        .iter()
        .map(|node| match (&node.op, node.inputs.first()) {
            (Op::Concat { .. } | Op::CacheWrite, Some(&first)) if uses[first.0] == 1 => {
                graph.inputs().iter().position(|&i| i == first)
            }
            _ => None,
        })
        .collect()
}

impl Executor {
    /// Uploads the plan's parameters to `backend`.
    pub fn new(plan: Plan, backend: Arc<dyn Backend>) -> Result<Self> {
        let _span = tracing::info_span!("load_plan", backend = backend.name()).entered();
        if let Some(c) = plan.kernels.iter().find(|c| c.backend != backend.kind()) {
            return Err(KptError::Backend {
                backend: backend.name().to_string(),
                message: format!(
                    "plan was optimized for {} (kernel {}), not for this backend",
                    c.backend, c.kernel
                ),
            });
        }
        let params = plan
            .graph
            .values()
            .iter()
            .map(|v| match &v.source {
                ValueSource::Param(t) => backend.upload(t).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let slots = (0..plan.memory.num_slots()).map(|_| None).collect();
        let appends = in_place_appends(&plan.graph);
        Ok(Self {
            plan,
            backend,
            params,
            slots,
            appends,
            last_launch: Duration::ZERO,
        })
    }

    /// The plan being executed.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Runs the plan and returns the graph outputs.
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let inputs = inputs
            .iter()
            .map(|t| Feed::Host(Cow::Borrowed(t)))
            .collect();
        let (outs, _) = self.run_inner(inputs, &[], false)?;
        outs.into_iter()
            .map(|o| o.into_host(self.backend.as_ref()))
            .collect()
    }

    /// Runs the plan and also returns every value (inputs, parameters and each
    /// node output, downloaded right after its node ran), indexed by value id.
    pub fn run_traced(&mut self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, Vec<Option<Tensor>>)> {
        let host = inputs
            .iter()
            .map(|t| Feed::Host(Cow::Borrowed(t)))
            .collect();
        let (outs, mut traced) = self.run_inner(host, &[], true)?;
        for (&id, t) in self.plan.graph.inputs().iter().zip(inputs) {
            traced[id.0] = Some(t.clone());
        }
        let outs = outs
            .into_iter()
            .map(|o| o.into_host(self.backend.as_ref()))
            .collect::<Result<_>>()?;
        Ok((outs, traced))
    }

    /// Runs the plan on inputs that may already be on the device; output `i` stays on
    /// the device when `on_device[i]` is true (missing entries mean the host). Device
    /// inputs are consumed: a cache appended to in place comes back as the output.
    pub fn run_resident(
        &mut self,
        inputs: Vec<RunTensor>,
        on_device: &[bool],
    ) -> Result<Vec<RunTensor>> {
        let inputs = inputs.into_iter().map(Feed::from).collect();
        self.run_inner(inputs, on_device, false)
            .map(|(outs, _)| outs)
    }

    /// The host's time in the last run up to its final wait for the backend: preparing
    /// the inputs and launching every kernel (on an asynchronous backend the kernels run
    /// meanwhile; a download of an output kept on the host waits for them too). Where it
    /// is close to the whole run's time, the host's launch work bounds the run.
    pub fn last_launch_seconds(&self) -> f64 {
        self.last_launch.as_secs_f64()
    }

    fn run_inner(
        &mut self,
        inputs: Vec<Feed<'_>>,
        on_device: &[bool],
        trace: bool,
    ) -> Result<(Vec<RunTensor>, Vec<Option<Tensor>>)> {
        let started = Instant::now();
        let Self {
            plan,
            backend,
            params,
            slots,
            appends,
            last_launch,
        } = self;
        let graph = &plan.graph;
        let slot_of = &plan.memory.slot_of;
        let input_specs: Vec<TensorSpec> = inputs.iter().map(Feed::spec).collect();
        let specs = graph.infer_specs(&input_specs)?;
        let caps = plan.memory.slot_capacities(&specs);
        for (slot, &cap) in caps.iter().enumerate() {
            let have = slots[slot].as_ref().map_or(0, DeviceBuffer::len);
            if have < cap {
                // Grow by half at least, so a cache that gains a row per run does not
                // reallocate on every run.
                let len = if have == 0 {
                    cap
                } else {
                    cap.max(have + have / 2)
                };
                slots[slot] = Some(backend.allocate(plan.memory.slot_dtypes[slot], len)?);
            }
        }
        let mut device_inputs = Vec::with_capacity(inputs.len());
        for input in inputs {
            device_inputs.push(Some(input.into_buffer(backend.as_ref())?));
        }
        let mut traced: Vec<Option<Tensor>> =
            vec![None; if trace { graph.values().len() } else { 0 }];
        if trace {
            for (i, v) in graph.values().iter().enumerate() {
                if let ValueSource::Param(t) = &v.source {
                    traced[i] = Some(t.clone());
                }
            }
        }
        // Slots whose own buffer was set aside for an in-place append, restored at the end.
        let mut displaced: Vec<(usize, Option<DeviceBuffer>)> = Vec::new();
        backend.run_launches(&mut || {
            for ((node, choice), append) in graph.nodes().iter().zip(&plan.kernels).zip(&*appends) {
                let _span =
                    tracing::trace_span!("launch", node = %node.name, kernel = %choice.kernel)
                        .entered();
                let out = node.outputs[0];
                let cache = append.and_then(|p| {
                    let fits = |b: &DeviceBuffer| {
                        appendable(b, &specs, node.inputs[0], node.inputs[1], out, &node.op)
                    };
                    device_inputs[p].take_if(|b| fits(b))
                });
                if let Some(mut cache) = cache {
                    let operand = |i: usize| -> Result<BufferRef<'_>> {
                        let v = node.inputs[i];
                        Ok(BufferRef {
                            buffer: lookup(graph, &device_inputs, params, slots, slot_of, v)?,
                            spec: &specs[v.0],
                        })
                    };
                    if node.op == Op::CacheWrite {
                        let out = BufferMut {
                            buffer: &mut cache,
                            spec: &specs[out.0],
                        };
                        backend.write_rows(operand(1)?, operand(2)?, out)?;
                    } else {
                        let old = specs[node.inputs[0].0].numel();
                        backend.copy_into(operand(1)?, &mut cache, old)?;
                    }
                    let s = slot_of[out.0].ok_or_else(|| no_buffer(graph, out))?;
                    if trace {
                        traced[out.0] = Some(backend.download(&cache, &specs[out.0])?);
                    }
                    displaced.push((s, slots[s].replace(cache)));
                    continue;
                }
                let mut outs = node
                    .outputs
                    .iter()
                    .map(|o| {
                        slot_of[o.0]
                            .and_then(|s| slots[s].take())
                            .ok_or_else(|| no_buffer(graph, *o))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let result = {
                    let in_refs = node
                        .inputs
                        .iter()
                        .map(|&v| {
                            lookup(graph, &device_inputs, params, slots, slot_of, v).map(|buffer| {
                                BufferRef {
                                    buffer,
                                    spec: &specs[v.0],
                                }
                            })
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let mut out_refs: Vec<BufferMut<'_>> = outs
                        .iter_mut()
                        .zip(&node.outputs)
                        .map(|(buffer, o)| BufferMut {
                            buffer,
                            spec: &specs[o.0],
                        })
                        .collect();
                    // `specs` came from `graph.infer_specs` for this run's inputs, and
                    // the slots were sized for them above.
                    backend.execute_inferred(&choice.kernel, &node.op, &in_refs, &mut out_refs)
                };
                for (o, buf) in node.outputs.iter().zip(outs) {
                    if trace {
                        traced[o.0] = Some(backend.download(&buf, &specs[o.0])?);
                    }
                    if let Some(s) = slot_of[o.0] {
                        slots[s] = Some(buf);
                    }
                }
                result.map_err(|e| match e {
                    KptError::Backend { backend, message } => KptError::Backend {
                        backend,
                        message: format!("node `{}` ({}): {message}", node.name, choice.kernel),
                    },
                    other => other,
                })?;
            }
            Ok(())
        })?;
        let mut outputs = Vec::with_capacity(graph.outputs().len());
        for (i, &o) in graph.outputs().iter().enumerate() {
            let keep = on_device.get(i).copied().unwrap_or(false);
            let spec = specs[o.0].clone();
            let buffer = match &graph.value(o).source {
                ValueSource::Input => {
                    let p = graph.inputs().iter().position(|&v| v == o);
                    p.and_then(|p| device_inputs[p].take())
                }
                ValueSource::Param(t) if !keep => {
                    outputs.push(RunTensor::Host(t.clone()));
                    continue;
                }
                ValueSource::Param(t) => Some(backend.upload(t)?),
                ValueSource::Node { .. } => slot_of[o.0].and_then(|s| slots[s].take()),
            }
            .ok_or_else(|| {
                KptError::Graph(format!(
                    "output `{}` is listed twice or has no buffer",
                    graph.value(o).name
                ))
            })?;
            let tensor = DeviceTensor { buffer, spec };
            if keep {
                outputs.push(RunTensor::Device(tensor));
            } else {
                outputs.push(RunTensor::Host(tensor.download(backend.as_ref())?));
                // A slot's buffer serves the next run.
                if let Some(s) = slot_of[o.0] {
                    slots[s].get_or_insert(tensor.buffer);
                }
            }
        }
        for (s, own) in displaced {
            slots[s] = own;
        }
        *last_launch = started.elapsed();
        backend.synchronize()?;
        Ok((outputs, traced))
    }
}

/// The buffer of value `v` during a run.
fn lookup<'a>(
    graph: &Graph,
    inputs: &'a [Option<DeviceBuffer>],
    params: &'a [Option<DeviceBuffer>],
    slots: &'a [Option<DeviceBuffer>],
    slot_of: &[Option<usize>],
    v: ValueId,
) -> Result<&'a DeviceBuffer> {
    match &graph.value(v).source {
        ValueSource::Input => graph
            .inputs()
            .iter()
            .position(|&i| i == v)
            .and_then(|p| inputs[p].as_ref()),
        ValueSource::Param(_) => params[v.0].as_ref(),
        ValueSource::Node { .. } => slot_of[v.0].and_then(|s| slots[s].as_ref()),
    }
    .ok_or_else(|| no_buffer(graph, v))
}

fn no_buffer(graph: &Graph, v: ValueId) -> KptError {
    KptError::Graph(format!("value `{}` has no buffer", graph.value(v).name))
}

/// Whether `CacheWrite(cache, ..) -> out` can write into the cache's buffer (always, when
/// it holds the value), or `Concat(old, new) -> out` can write `new` after `old` inside
/// `old`'s buffer: every dim before the axis is 1 (so `old` is a prefix of `out`), the
/// buffer has room, and nothing is quantized (the output keeps the buffer's scale).
fn appendable(
    buffer: &DeviceBuffer,
    specs: &[TensorSpec],
    old: ValueId,
    new: ValueId,
    out: ValueId,
    op: &Op,
) -> bool {
    let axis = match op {
        Op::CacheWrite => 0,
        Op::Concat { axis } => *axis,
        _ => return false,
    };
    let out = &specs[out.0];
    out.shape.iter().take(axis).all(|&d| d == 1)
        && buffer.len() >= out.numel()
        && buffer.dtype() == out.dtype
        && specs[old.0].dtype == out.dtype
        && specs[new.0].dtype == out.dtype
        && !out.dtype.is_quantized()
}
