//! Running a [`Plan`] on a [`Backend`]: parameters uploaded once, intermediate
//! buffers shared as the memory plan says, shapes re-inferred on every run.
//!
//! Inputs and outputs are host [`Tensor`]s ([`Executor::run`]) or, for values that stay
//! on the device between runs such as a KV cache, [`DeviceTensor`]s
//! ([`Executor::run_resident`]). A cache update runs in place when the cache is a graph
//! input that nothing else reads: [`Op::CacheWrite`] writes
//! its rows into the input's buffer ([`Backend::write_rows`]), an [`Op::SplitRotary`]
//! with `cache` its k and v rows into both caches' buffers
//! ([`Backend::split_rotary_into_caches`]), and an
//! [`Op::Concat`] that appends to a device-resident input with
//! room to spare (a cache allocated by [`DeviceTensor::with_capacity`]) copies only the
//! new rows. The output is then the input's buffer.
//!
//! With [`Executor::set_graphs`] a run that repeats the previous run's signature (input
//! specs, device input buffers, outputs kept on the device) is recorded once by
//! [`Backend::capture`] (a CUDA graph) and replayed: host inputs are written into
//! buffers the executor keeps for the capture ([`Backend::write`]), and so are device
//! inputs that no node updates in place ([`Backend::copy_into`]), such as the tokens an
//! earlier run picked; the backend then queues the whole run at once.
//!
//! [`Executor::enqueue`] queues a run without waiting for it, so that a caller can queue
//! the next decode step (fed the picked tokens on the device) before reading the tokens
//! of this one ([`Backend::download_async`]).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BufferMut, BufferRef, CapturedRun, DeviceBuffer, RotaryCaches};
use crate::error::{KptError, Result};
use crate::graph::{Graph, Node, Op, TensorSpec, ValueId, ValueSource};
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
        backend.copy_into(self.view(), &mut buffer, 0)?;
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

    /// A view of the value for [`Backend`] calls.
    pub fn view(&self) -> BufferRef<'_> {
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

/// Counts of the captured-run machinery of an [`Executor`] (see
/// [`Executor::set_graphs`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Runs recorded by [`Backend::capture`] (each then replayed once to run).
    pub captures: u64,
    /// Runs that replayed a capture made by an earlier run.
    pub replays: u64,
    /// Captures abandoned (a launch the backend cannot record); those runs and every
    /// later run of the same signature ran normally.
    pub failures: u64,
}

/// Where an output of a run goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Downloaded to the host.
    Host,
    /// Left on the device for the caller.
    Device,
    /// Not wanted: left in the executor's buffers (an output written into a device
    /// input's buffer in place still goes back to the caller, on the device).
    Drop,
}

impl Keep {
    /// Output `i` of `keep`, the host where it says nothing.
    fn of(keep: &[Keep], i: usize) -> Keep {
        keep.get(i).copied().unwrap_or(Keep::Host)
    }
}

/// Host inputs of at most this many bytes are remembered by a capture, so that a later
/// replay with the same contents does not write them again.
const REMEMBERED_INPUT_BYTES: usize = 4096;

/// What must not change between two runs for one captured run to serve both: every
/// input's shape and dtype, the address and size of the buffer of every device-resident
/// input that a node updates in place, and which outputs stay on the device. The
/// contents of the other inputs may change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    /// Per input: its spec, and for a device input updated in place the address and
    /// length of its buffer.
    inputs: Vec<(TensorSpec, Option<(u64, usize)>)>,
    /// Per graph output: where it goes.
    outputs: Vec<Keep>,
}

/// A run captured by the backend, with what it recorded.
struct Captured {
    run: Box<dyn CapturedRun>,
    /// The specs of every value (the run's inference, the same for every replay).
    specs: Vec<TensorSpec>,
    /// Per graph input staged for the capture (fed from the host, or from the device
    /// without an in-place update): the buffer the recorded launches read it from.
    staged_inputs: Vec<Option<DeviceBuffer>>,
    /// Per graph input: the small host tensor last written into its staged buffer, which
    /// a replay with the same contents does not write again.
    written: Vec<Option<Tensor>>,
    /// Node outputs written in place into a device input's buffer: (output, input).
    in_place: Vec<(ValueId, usize)>,
}

/// Signatures whose captured runs an executor keeps at once (the least recently run
/// one goes first): enough for a few sequences decoded in turn, each with its own caches.
const MAX_SIGNATURES: usize = 8;

/// One signature's captured-run state.
struct Entry {
    signature: Signature,
    /// Runs of this signature so far, this one included.
    runs: u64,
    /// A capture of this signature failed: run it normally.
    refused: bool,
    captured: Option<Captured>,
    /// [`Graphs::epoch`] when the capture was made.
    epoch: u64,
    /// A replay of the capture was queued by [`Executor::enqueue`] and its deferred
    /// checks ([`CapturedRun::check`]) have not run yet.
    unchecked: bool,
}

/// The executor's captured-run state: the signatures run lately, the most recent last.
#[derive(Default)]
struct Graphs {
    enabled: bool,
    entries: Vec<Entry>,
    /// Bumped whenever a slot's buffer is replaced or handed to the caller: a capture
    /// made at an older epoch reads buffers that are gone, so it is made again.
    epoch: u64,
    stats: GraphStats,
    /// Captured runs dropped from their entries while a queued replay's checks were
    /// pending: kept until those checks run.
    retired: Vec<Captured>,
}

impl Graphs {
    /// Forgets every signature and drops their captured runs.
    fn reset(&mut self) {
        for mut e in std::mem::take(&mut self.entries) {
            Self::retire(&mut self.retired, &mut e);
        }
    }

    /// Drops `entry`'s captured run, keeping it in `retired` while its checks are
    /// pending.
    fn retire(retired: &mut Vec<Captured>, entry: &mut Entry) {
        let captured = entry.captured.take();
        if std::mem::take(&mut entry.unchecked) {
            retired.extend(captured);
        }
    }

    /// The entry of the run in progress (the last one [`Executor::mode`] touched).
    fn current(&mut self) -> Result<&mut Entry> {
        self.entries
            .last_mut()
            .ok_or_else(|| KptError::Graph("a captured run has no signature".into()))
    }
}

/// How a run launches its kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One launch per node.
    Plain,
    /// Launches recorded by the backend, then replayed once.
    Capture,
    /// An earlier capture replayed.
    Replay,
}

/// Executes a plan on one backend; reuses its buffers across runs.
pub struct Executor {
    plan: Plan,
    backend: Arc<dyn Backend>,
    params: Vec<Option<DeviceBuffer>>,
    slots: Vec<Option<DeviceBuffer>>,
    /// Per node: the graph inputs it may update in place.
    updates: Vec<Vec<InPlace>>,
    /// Per graph input: whether some node may update it in place.
    in_place_inputs: Vec<bool>,
    /// Host time of the last run up to its final wait for the backend.
    last_launch: Duration,
    graphs: Graphs,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("nodes", &self.plan.graph.nodes().len())
            .field("graphs", &self.graphs.enabled)
            .finish_non_exhaustive()
    }
}

/// A node output that may take over the buffer of a graph input the node updates:
/// indices of the output and the input in the node, and of the input in the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct InPlace {
    output: usize,
    input: usize,
    graph_input: usize,
}

/// Per node, the graph inputs it can update in place: the cache operand of a `Concat`
/// or `CacheWrite` (output 0 from input 0), both caches of a `SplitRotary` with `cache`
/// (outputs 1 and 2 from inputs 2 and 3), each when it is a graph input read by no other
/// node and not itself a graph output. All of a node's caches or none.
fn in_place_updates(graph: &Graph) -> Vec<Vec<InPlace>> {
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
        .map(|node| {
            let pairs: &[(usize, usize)] = match node.op {
                Op::Concat { .. } | Op::CacheWrite => &[(0, 0)],
                Op::SplitRotary { cache: true, .. } => &[(1, 2), (2, 3)],
                _ => &[],
            };
            let found: Vec<InPlace> = pairs
                .iter()
                .filter_map(|&(output, input)| {
                    let v = *node.inputs.get(input)?;
                    let graph_input = graph.inputs().iter().position(|&i| i == v)?;
                    (uses[v.0] == 1).then_some(InPlace {
                        output,
                        input,
                        graph_input,
                    })
                })
                .collect();
            if found.len() == pairs.len() {
                found
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// A run's graph outputs (`None` where dropped, [`Keep::Drop`]) and, when traced, every
/// value by id.
type RunOutputs = (Vec<Option<RunTensor>>, Vec<Option<Tensor>>);

/// A slot whose own buffer was set aside while an in-place update put a device
/// input's buffer there: (slot, its own buffer, the input's index, the output value).
type Displaced = Vec<(usize, Option<DeviceBuffer>, usize, ValueId)>;

/// Everything the launches of one run read and write.
struct Launch<'a> {
    graph: &'a Graph,
    plan: &'a Plan,
    backend: &'a dyn Backend,
    params: &'a [Option<DeviceBuffer>],
    updates: &'a [Vec<InPlace>],
    specs: &'a [TensorSpec],
}

impl Launch<'_> {
    /// Launches every node in order. On an error the device inputs that were moved into
    /// slots for in-place updates are back in `device_inputs` and the slots hold their
    /// own buffers again, so the same launches can run again.
    fn run(
        &self,
        slots: &mut [Option<DeviceBuffer>],
        device_inputs: &mut [Option<DeviceBuffer>],
        displaced: &mut Displaced,
        traced: &mut [Option<Tensor>],
    ) -> Result<()> {
        let result = self.nodes(slots, device_inputs, displaced, traced);
        if result.is_err() {
            for (s, own, p, _) in displaced.drain(..).rev() {
                device_inputs[p] = std::mem::replace(&mut slots[s], own);
            }
        }
        result
    }

    /// Runs `node` on the buffers of the device inputs it updates (`update`), which
    /// become its outputs' buffers. `false`: a buffer cannot hold its output (too small,
    /// another dtype, quantized), nothing ran and the inputs are where they were.
    fn update_in_place(
        &self,
        node: &Node,
        kernel: &str,
        update: &[InPlace],
        slots: &mut [Option<DeviceBuffer>],
        device_inputs: &mut [Option<DeviceBuffer>],
        displaced: &mut Displaced,
    ) -> Result<bool> {
        let Self {
            graph,
            plan,
            backend,
            params,
            specs,
            ..
        } = *self;
        let slot_of = &plan.memory.slot_of;
        let mut caches: Vec<DeviceBuffer> = Vec::with_capacity(update.len());
        for u in update {
            let fits = |b: &DeviceBuffer| appendable(b, specs, node, u);
            match device_inputs[u.graph_input].take_if(|b| fits(b)) {
                Some(b) => caches.push(b),
                None => {
                    for (u, b) in update.iter().zip(caches) {
                        device_inputs[u.graph_input] = Some(b);
                    }
                    return Ok(false);
                }
            }
        }
        // A split + rotary also writes q into its own slot.
        let q = node.outputs[0];
        let mut q_buffer = match node.op {
            Op::SplitRotary { .. } => slot_of[q.0].and_then(|s| slots[s].take()),
            _ => None,
        };
        let written = {
            let operand = |i: usize| -> Result<BufferRef<'_>> {
                let v = node.inputs[i];
                Ok(BufferRef {
                    buffer: lookup(graph, device_inputs, params, slots, slot_of, v)?,
                    spec: &specs[v.0],
                })
            };
            let out = |i: usize| &specs[node.outputs[i].0];
            match (&node.op, caches.as_mut_slice()) {
                (Op::CacheWrite, [cache]) => operand(1).and_then(|rows| {
                    let cache = BufferMut {
                        buffer: cache,
                        spec: out(0),
                    };
                    backend.write_rows(rows, operand(2)?, cache)
                }),
                (Op::Concat { .. }, [cache]) => {
                    let old = specs[node.inputs[0].0].numel();
                    operand(1).and_then(|new| backend.copy_into(new, cache, old))
                }
                (Op::SplitRotary { .. }, [k, v]) => q_buffer
                    .as_mut()
                    .ok_or_else(|| no_buffer(graph, q))
                    .and_then(|q_buffer| {
                        let io = RotaryCaches {
                            qkv: operand(0)?,
                            positions: operand(1)?,
                            slots: operand(4)?,
                            q: BufferMut {
                                buffer: q_buffer,
                                spec: out(0),
                            },
                            k_cache: BufferMut {
                                buffer: k,
                                spec: out(1),
                            },
                            v_cache: BufferMut {
                                buffer: v,
                                spec: out(2),
                            },
                        };
                        backend.split_rotary_into_caches(kernel, &node.op, io)
                    }),
                _ => Err(KptError::Graph(format!(
                    "node `{}` ({}) cannot update its inputs in place",
                    node.name, node.op
                ))),
            }
        };
        if let Some(b) = q_buffer {
            if let Some(s) = slot_of[q.0] {
                slots[s] = Some(b);
            }
        }
        for (u, cache) in update.iter().zip(caches) {
            let out = node.outputs[u.output];
            let Some(s) = slot_of[out.0] else {
                device_inputs[u.graph_input] = Some(cache);
                return Err(no_buffer(graph, out));
            };
            displaced.push((s, slots[s].replace(cache), u.graph_input, out));
        }
        written?;
        Ok(true)
    }

    fn nodes(
        &self,
        slots: &mut [Option<DeviceBuffer>],
        device_inputs: &mut [Option<DeviceBuffer>],
        displaced: &mut Displaced,
        traced: &mut [Option<Tensor>],
    ) -> Result<()> {
        let Self {
            graph,
            plan,
            backend,
            updates,
            specs,
            ..
        } = *self;
        let slot_of = &plan.memory.slot_of;
        for ((node, choice), update) in graph.nodes().iter().zip(&plan.kernels).zip(updates) {
            let _span = tracing::trace_span!("launch", node = %node.name, kernel = %choice.kernel)
                .entered();
            let in_place = !update.is_empty()
                && self.update_in_place(
                    node,
                    &choice.kernel,
                    update,
                    slots,
                    device_inputs,
                    displaced,
                )?;
            if !in_place {
                self.execute(node, &choice.kernel, slots, device_inputs)?;
            }
            if !traced.is_empty() {
                for &o in &node.outputs {
                    let s = slot_of[o.0].ok_or_else(|| no_buffer(graph, o))?;
                    let buf = slots[s].as_ref().ok_or_else(|| no_buffer(graph, o))?;
                    traced[o.0] = Some(backend.download(buf, &specs[o.0])?);
                }
            }
        }
        Ok(())
    }

    /// Runs `node` on `kernel` into its outputs' slots.
    fn execute(
        &self,
        node: &Node,
        kernel: &str,
        slots: &mut [Option<DeviceBuffer>],
        device_inputs: &[Option<DeviceBuffer>],
    ) -> Result<()> {
        let Self {
            graph,
            plan,
            backend,
            params,
            specs,
            ..
        } = *self;
        let slot_of = &plan.memory.slot_of;
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
                    lookup(graph, device_inputs, params, slots, slot_of, v).map(|buffer| {
                        BufferRef {
                            buffer,
                            spec: &specs[v.0],
                        }
                    })
                })
                .collect::<Result<Vec<_>>>();
            in_refs.and_then(|in_refs| {
                let mut out_refs: Vec<BufferMut<'_>> = outs
                    .iter_mut()
                    .zip(&node.outputs)
                    .map(|(buffer, o)| BufferMut {
                        buffer,
                        spec: &specs[o.0],
                    })
                    .collect();
                // `specs` came from `graph.infer_specs` for this run's inputs, and
                // the slots were sized for them.
                backend.execute_inferred(kernel, &node.op, &in_refs, &mut out_refs)
            })
        };
        for (o, buf) in node.outputs.iter().zip(outs) {
            if let Some(s) = slot_of[o.0] {
                slots[s] = Some(buf);
            }
        }
        result.map_err(|e| match e {
            KptError::Backend { backend, message } => KptError::Backend {
                backend,
                message: format!("node `{}` ({kernel}): {message}", node.name),
            },
            other => other,
        })
    }
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
                ValueSource::Param(t) => backend.upload(t).map(|mut b| {
                    // The executor owns its parameters and no node writes them.
                    b.mark_constant();
                    Some(b)
                }),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let slots = (0..plan.memory.num_slots()).map(|_| None).collect();
        let updates = in_place_updates(&plan.graph);
        let mut in_place_inputs = vec![false; plan.graph.inputs().len()];
        for u in updates.iter().flatten() {
            in_place_inputs[u.graph_input] = true;
        }
        Ok(Self {
            plan,
            backend,
            params,
            slots,
            updates,
            in_place_inputs,
            last_launch: Duration::ZERO,
            graphs: Graphs::default(),
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

    /// Turns captured runs (CUDA graphs) on or off; off by default. When on, runs whose
    /// signature (every input's shape and dtype, the buffer of every device-resident
    /// input that a node updates in place, which outputs stay on the device) equals the
    /// previous run's are served by one capture: the first run of a signature runs
    /// normally (it loads modules, tunes GEMMs, sizes buffers), the second is recorded by
    /// [`Backend::capture`] and replayed, and later ones copy their other inputs (from
    /// the host, or from device buffers anywhere) into the buffers the capture reads and
    /// replay it, which saves the host the launch work of every node. Captures
    /// of up to 8 signatures are kept (the least recently run dropped first), so that
    /// sequences decoded in turn, each with its own caches, all replay. A backend that cannot
    /// capture, or a run whose launches cannot be recorded (one that waits for the
    /// device or reads a value back to the host), runs normally with the same results.
    /// [`Executor::run_traced`] never captures. Turning it off drops the capture.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.enabled = on;
        if !on {
            self.graphs.reset();
        }
    }

    /// Whether captured runs are on ([`Executor::set_graphs`]).
    pub fn graphs(&self) -> bool {
        self.graphs.enabled
    }

    /// Whether a captured run is held now (the next run of its signature replays it).
    pub fn captured(&self) -> bool {
        self.graphs.entries.iter().any(|e| e.captured.is_some())
    }

    /// Captures, replays and failed captures so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    /// Runs the plan and returns the graph outputs.
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let inputs = inputs
            .iter()
            .map(|t| Feed::Host(Cow::Borrowed(t)))
            .collect();
        let (outs, _) = self.run_inner(inputs, &[], false, true)?;
        outs.into_iter()
            .flatten()
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
        let (outs, mut traced) = self.run_inner(host, &[], true, true)?;
        for (&id, t) in self.plan.graph.inputs().iter().zip(inputs) {
            traced[id.0] = Some(t.clone());
        }
        let outs = outs
            .into_iter()
            .flatten()
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
        let keep: Vec<Keep> = on_device
            .iter()
            .map(|&d| if d { Keep::Device } else { Keep::Host })
            .collect();
        let (outs, _) = self.run_inner(inputs, &keep, false, true)?;
        outs.into_iter()
            .map(|o| o.ok_or_else(|| KptError::Graph("a run dropped an output".into())))
            .collect()
    }

    /// Queues a run of the plan and returns at once: output `i` is left on the device
    /// when `wanted[i]` is true (missing entries mean true), and `None` otherwise (not
    /// copied out of the executor's buffers; an output written in place into a device
    /// input's buffer always comes back). Nothing waits for the backend, so the caller
    /// may queue more work behind it (the next decode step, fed this one's outputs) and
    /// read outputs with [`Backend::download_async`]. Inputs are consumed as in
    /// [`Executor::run_resident`]. Errors that kernels report after the launch (an id
    /// outside an embedding table, found by a replay's deferred checks) surface at the
    /// next run that waits, or at [`Executor::finish`].
    pub fn enqueue(
        &mut self,
        inputs: Vec<RunTensor>,
        wanted: &[bool],
    ) -> Result<Vec<Option<DeviceTensor>>> {
        let inputs = inputs.into_iter().map(Feed::from).collect();
        let keep: Vec<Keep> = (0..self.plan.graph.outputs().len())
            .map(|i| match wanted.get(i) {
                Some(false) => Keep::Drop,
                _ => Keep::Device,
            })
            .collect();
        let (outs, _) = self.run_inner(inputs, &keep, false, false)?;
        outs.into_iter()
            .map(|o| match o {
                Some(RunTensor::Device(d)) => Ok(Some(d)),
                None => Ok(None),
                Some(RunTensor::Host(_)) => Err(KptError::Graph(
                    "a queued run returned an output on the host".into(),
                )),
            })
            .collect()
    }

    /// Waits for the runs queued so far (by [`Executor::enqueue`]) and runs the checks
    /// their kernels deferred; an error there drops the captured runs, as a failed run
    /// does. Every other run ends with it.
    pub fn finish(&mut self) -> Result<()> {
        let checked = self
            .backend
            .synchronize()
            .and_then(|()| self.check_queued());
        if checked.is_err() {
            self.graphs.reset();
        }
        checked
    }

    /// Runs the deferred checks of every captured run replayed since the last check
    /// (call it after the backend synchronized).
    fn check_queued(&mut self) -> Result<()> {
        let g = &mut self.graphs;
        for c in std::mem::take(&mut g.retired) {
            c.run.check()?;
        }
        for e in &mut g.entries {
            if std::mem::take(&mut e.unchecked) {
                if let Some(c) = &e.captured {
                    c.run.check()?;
                }
            }
        }
        Ok(())
    }

    /// The host's time in the last run up to its final wait for the backend: preparing
    /// the inputs and launching every kernel (on an asynchronous backend the kernels run
    /// meanwhile; a download of an output kept on the host waits for them too). Where it
    /// is close to the whole run's time, the host's launch work bounds the run.
    pub fn last_launch_seconds(&self) -> f64 {
        self.last_launch.as_secs_f64()
    }

    /// The signature of a run, `None` when it cannot be captured (an input the backend
    /// has no address for, or a quantized input, whose scale launchers take by value).
    fn signature(&self, inputs: &[Feed<'_>], keep: &[Keep]) -> Option<Signature> {
        let inputs = inputs
            .iter()
            .zip(&self.in_place_inputs)
            .map(|(f, &in_place)| {
                let spec = f.spec();
                if spec.dtype.is_quantized() {
                    return None;
                }
                let at = match f {
                    Feed::Device(d) if in_place => {
                        Some((self.backend.buffer_address(&d.buffer)?, d.buffer.len()))
                    }
                    _ => None,
                };
                Some((spec, at))
            })
            .collect::<Option<Vec<_>>>()?;
        let outputs = self.plan.graph.outputs().len();
        let outputs = (0..outputs).map(|i| Keep::of(keep, i)).collect();
        Some(Signature { inputs, outputs })
    }

    /// How this run launches: counts the run against its signature.
    fn mode(&mut self, inputs: &[Feed<'_>], keep: &[Keep], trace: bool) -> Mode {
        if trace || !self.graphs.enabled {
            return Mode::Plain;
        }
        let Some(sig) = self.signature(inputs, keep) else {
            self.graphs.reset();
            return Mode::Plain;
        };
        let g = &mut self.graphs;
        let entry = match g.entries.iter().position(|e| e.signature == sig) {
            Some(i) => g.entries.remove(i),
            None => {
                if g.entries.len() == MAX_SIGNATURES {
                    let mut oldest = g.entries.remove(0);
                    Graphs::retire(&mut g.retired, &mut oldest);
                }
                Entry {
                    signature: sig,
                    runs: 0,
                    refused: false,
                    captured: None,
                    epoch: 0,
                    unchecked: false,
                }
            }
        };
        g.entries.push(entry);
        let epoch = g.epoch;
        let Some(e) = g.entries.last_mut() else {
            return Mode::Plain;
        };
        e.runs += 1;
        if e.captured.is_some() && e.epoch != epoch {
            // Another signature's run replaced a slot this capture reads: record again.
            Graphs::retire(&mut g.retired, e);
        }
        if e.refused {
            Mode::Plain
        } else if e.captured.is_some() {
            Mode::Replay
        } else if e.runs >= 2 {
            Mode::Capture
        } else {
            Mode::Plain
        }
    }

    fn run_inner(
        &mut self,
        inputs: Vec<Feed<'_>>,
        keep: &[Keep],
        trace: bool,
        wait: bool,
    ) -> Result<RunOutputs> {
        let started = Instant::now();
        let mode = self.mode(&inputs, keep, trace);
        let result = self.run_mode(mode, inputs, keep, trace, started);
        if result.is_err() && mode != Mode::Plain {
            // The capture's buffers may be gone with the error: start over.
            self.graphs.reset();
        }
        let outputs = result?;
        if wait {
            self.finish()?;
        }
        Ok(outputs)
    }

    fn run_mode(
        &mut self,
        mut mode: Mode,
        inputs: Vec<Feed<'_>>,
        keep: &[Keep],
        trace: bool,
        started: Instant,
    ) -> Result<RunOutputs> {
        let Self {
            plan,
            backend,
            params,
            slots,
            updates,
            in_place_inputs,
            last_launch,
            graphs,
        } = self;
        let backend = backend.as_ref();
        let graph = &plan.graph;
        let slot_of = &plan.memory.slot_of;
        // A replay's specs are those of its capture.
        let mut held = match mode {
            Mode::Replay => graphs.current()?.captured.take(),
            _ => None,
        };
        let specs = match &mut held {
            Some(c) => std::mem::take(&mut c.specs),
            None => {
                let input_specs: Vec<TensorSpec> = inputs.iter().map(Feed::spec).collect();
                graph.infer_specs(&input_specs)?
            }
        };
        if mode != Mode::Replay {
            let caps = plan.memory.slot_capacities(&specs);
            for (slot, &cap) in caps.iter().enumerate() {
                let have = slots[slot].as_ref().map_or(0, DeviceBuffer::len);
                if have < cap {
                    // Grow by half at least, so a cache that gains a row per run does
                    // not reallocate on every run.
                    let len = if have == 0 {
                        cap
                    } else {
                        cap.max(have + have / 2)
                    };
                    slots[slot] = Some(backend.allocate(plan.memory.slot_dtypes[slot], len)?);
                    graphs.epoch += 1;
                }
            }
        }
        // Inputs: host ones uploaded (plain runs); in captured runs, every input but
        // the device ones updated in place is staged: written or copied into the
        // buffers the capture reads.
        let staged: Vec<bool> = inputs
            .iter()
            .zip(in_place_inputs.iter())
            .map(|(f, &in_place)| !(in_place && matches!(f, Feed::Device(_))))
            .collect();
        let mut device_inputs = Vec::with_capacity(inputs.len());
        let mut written = vec![None; inputs.len()];
        for (p, input) in inputs.into_iter().enumerate() {
            // A buffer that no node writes holds what was staged into it last.
            let remember = !in_place_inputs[p];
            let buffer = match (mode, input) {
                (Mode::Plain, input) => input.into_buffer(backend)?,
                (_, Feed::Device(d)) if !staged[p] => d.buffer,
                (Mode::Capture, input) => {
                    let spec = input.spec();
                    let mut b = backend.allocate(spec.dtype, spec.numel())?;
                    written[p] = stage(backend, input, &mut b, None, remember)?;
                    b
                }
                (Mode::Replay, input) => {
                    let c = held.as_mut().ok_or_else(no_capture)?;
                    let mut b = c.staged_inputs[p].take().ok_or_else(no_capture)?;
                    let last = c.written.get_mut(p).and_then(Option::take);
                    written[p] = stage(backend, input, &mut b, last, remember)?;
                    b
                }
            };
            device_inputs.push(Some(buffer));
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
        let mut displaced: Displaced = Vec::new();
        let launch = Launch {
            graph,
            plan,
            backend,
            params,
            updates,
            specs: &specs,
        };
        if mode == Mode::Capture {
            let captured = backend
                .capture(&mut || launch.run(slots, &mut device_inputs, &mut displaced, &mut []));
            match captured {
                Ok(Some(mut run)) => {
                    if !run.replay()? {
                        // Nothing ran yet: the same launches run one by one.
                        for (s, own, p, _) in displaced.drain(..).rev() {
                            device_inputs[p] = std::mem::replace(&mut slots[s], own);
                        }
                        backend.run_launches(&mut || {
                            launch.run(slots, &mut device_inputs, &mut displaced, &mut [])
                        })?;
                    }
                    graphs.stats.captures += 1;
                    let in_place = displaced.iter().map(|&(_, _, p, out)| (out, p)).collect();
                    held = Some(Captured {
                        run,
                        specs: Vec::new(),
                        staged_inputs: Vec::new(),
                        written: Vec::new(),
                        in_place,
                    });
                }
                Ok(None) => {
                    mode = Mode::Plain;
                    backend.run_launches(&mut || {
                        launch.run(slots, &mut device_inputs, &mut displaced, &mut traced)
                    })?;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "the run could not be captured; it runs normally");
                    graphs.stats.failures += 1;
                    graphs.current()?.refused = true;
                    mode = Mode::Plain;
                    backend.run_launches(&mut || {
                        launch.run(slots, &mut device_inputs, &mut displaced, &mut traced)
                    })?;
                }
            }
        } else if let Some(c) = &mut held {
            if c.run.replay()? {
                graphs.stats.replays += 1;
                // The in-place outputs are the device inputs' buffers, as in the
                // captured run.
                for &(out, p) in &c.in_place {
                    let s = slot_of[out.0].ok_or_else(|| no_buffer(graph, out))?;
                    let cache = device_inputs[p].take().ok_or_else(no_capture)?;
                    displaced.push((s, slots[s].replace(cache), p, out));
                }
            } else {
                // The same launches on the same buffers, one by one.
                backend.run_launches(&mut || {
                    launch.run(slots, &mut device_inputs, &mut displaced, &mut traced)
                })?;
            }
        } else {
            backend.run_launches(&mut || {
                launch.run(slots, &mut device_inputs, &mut displaced, &mut traced)
            })?;
        }
        // In captured runs the slots and the host inputs' buffers stay where the capture
        // recorded them: outputs kept on the device are copies.
        let captured = mode != Mode::Plain;
        let copy = |b: &DeviceBuffer, spec: &TensorSpec| -> Result<DeviceBuffer> {
            let mut out = backend.allocate(spec.dtype, spec.numel())?;
            backend.copy_into(BufferRef { buffer: b, spec }, &mut out, 0)?;
            out.scale = b.scale;
            Ok(out)
        };
        let mut outputs = Vec::with_capacity(graph.outputs().len());
        for (i, &o) in graph.outputs().iter().enumerate() {
            let in_place = displaced.iter().any(|d| d.3 == o);
            let keep = match Keep::of(keep, i) {
                Keep::Drop if !in_place => {
                    outputs.push(None);
                    continue;
                }
                Keep::Host => false,
                Keep::Device | Keep::Drop => true,
            };
            let spec = specs[o.0].clone();
            let buffer = match &graph.value(o).source {
                ValueSource::Input => {
                    let p = graph.inputs().iter().position(|&v| v == o);
                    match p {
                        Some(p) if captured && staged[p] => {
                            let b = device_inputs[p]
                                .as_ref()
                                .ok_or_else(|| no_buffer(graph, o))?;
                            outputs.push(Some(if keep {
                                RunTensor::Device(DeviceTensor {
                                    buffer: copy(b, &spec)?,
                                    spec,
                                })
                            } else {
                                RunTensor::Host(backend.download(b, &spec)?)
                            }));
                            continue;
                        }
                        _ => p.and_then(|p| device_inputs[p].take()),
                    }
                }
                ValueSource::Param(t) if !keep => {
                    outputs.push(Some(RunTensor::Host(t.clone())));
                    continue;
                }
                ValueSource::Param(t) => Some(backend.upload(t)?),
                ValueSource::Node { .. } => {
                    let s = slot_of[o.0];
                    let own = s.is_some_and(|s| !displaced.iter().any(|d| d.0 == s));
                    match s {
                        Some(s) if captured && keep && own => {
                            let b = slots[s].as_ref().ok_or_else(|| no_buffer(graph, o))?;
                            outputs.push(Some(RunTensor::Device(DeviceTensor {
                                buffer: copy(b, &spec)?,
                                spec,
                            })));
                            continue;
                        }
                        _ => {
                            if keep && own {
                                // The slot's buffer goes to the caller.
                                graphs.epoch += 1;
                            }
                            s.and_then(|s| slots[s].take())
                        }
                    }
                }
            }
            .ok_or_else(|| {
                KptError::Graph(format!(
                    "output `{}` is listed twice or has no buffer",
                    graph.value(o).name
                ))
            })?;
            let tensor = DeviceTensor { buffer, spec };
            if keep {
                outputs.push(Some(RunTensor::Device(tensor)));
            } else {
                outputs.push(Some(RunTensor::Host(tensor.download(backend)?)));
                // A slot's buffer serves the next run.
                if let Some(s) = slot_of[o.0] {
                    slots[s].get_or_insert(tensor.buffer);
                }
            }
        }
        for (s, own, _, _) in displaced {
            slots[s] = own;
        }
        let replayed = if let Some(mut c) = held {
            c.specs = specs;
            c.written = written;
            c.staged_inputs = device_inputs
                .iter_mut()
                .zip(&staged)
                .map(|(b, &h)| if h { b.take() } else { None })
                .collect();
            let epoch = graphs.epoch;
            let entry = graphs.current()?;
            entry.captured = Some(c);
            entry.epoch = epoch;
            true
        } else {
            false
        };
        *last_launch = started.elapsed();
        if replayed {
            graphs.current()?.unchecked = true;
        }
        Ok((outputs, traced))
    }
}

/// Writes (from the host) or copies (on the device) a run's input into `dst`, the buffer
/// a captured run reads it from, unless `last` (the host tensor written there last, when
/// `remember`: no node writes the buffer) has the same contents. Returns the host tensor
/// to remember, if it is small enough.
fn stage(
    backend: &dyn Backend,
    input: Feed<'_>,
    dst: &mut DeviceBuffer,
    last: Option<Tensor>,
    remember: bool,
) -> Result<Option<Tensor>> {
    match input {
        Feed::Host(t) => {
            if let Some(last) = last.filter(|l| remember && same_contents(l, &t)) {
                return Ok(Some(last));
            }
            backend.write(&t, dst)?;
            let small = t.numel() * t.dtype().size_in_bytes() <= REMEMBERED_INPUT_BYTES;
            Ok((remember && small).then(|| t.into_owned()))
        }
        Feed::Device(d) => {
            backend.copy_into(d.view(), dst, 0)?;
            dst.scale = d.buffer.scale;
            Ok(None)
        }
    }
}

/// Whether two host tensors hold the same bytes (and dtype, shape and scale).
fn same_contents(a: &Tensor, b: &Tensor) -> bool {
    if a.dtype() != b.dtype()
        || a.shape() != b.shape()
        || a.scale().to_bits() != b.scale().to_bits()
    {
        return false;
    }
    let (a, b) = (a.contiguous(), b.contiguous());
    matches!((a.as_bytes(), b.as_bytes()), (Ok(x), Ok(y)) if x == y)
}

fn no_capture() -> KptError {
    KptError::Graph("the captured run lost an input buffer".into())
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

/// Whether the device input's `buffer` can hold the node's output `u` in place: it has
/// room and the output's dtype, which is not quantized (the output keeps the buffer's
/// scale), and a `Concat` appends after `old` inside it (every dim before the axis is 1,
/// so that `old` is a prefix of the output). `CacheWrite` and a split + rotary write rows
/// over the cache, whose shape is the output's.
fn appendable(buffer: &DeviceBuffer, specs: &[TensorSpec], node: &Node, u: &InPlace) -> bool {
    let out = &specs[node.outputs[u.output].0];
    // The operand whose rows are written: the new part, the rows, or qkv.
    let (prefix, data) = match node.op {
        Op::Concat { axis } => (out.shape.iter().take(axis).all(|&d| d == 1), 1),
        Op::SplitRotary { .. } => (true, 0),
        _ => (true, 1),
    };
    prefix
        && buffer.len() >= out.numel()
        && buffer.dtype() == out.dtype
        && specs[node.inputs[u.input].0].dtype == out.dtype
        && node
            .inputs
            .get(data)
            .is_some_and(|v| specs[v.0].dtype == out.dtype)
        && !out.dtype.is_quantized()
}
