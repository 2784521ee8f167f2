//! Running a [`Plan`] on a [`Backend`]: parameters uploaded once, intermediate
//! buffers shared as the memory plan says, shapes re-inferred on every run.

use std::sync::Arc;

use crate::backend::{Backend, BufferMut, BufferRef, DeviceBuffer};
use crate::error::{KptError, Result};
use crate::graph::{TensorSpec, ValueId, ValueSource};
use crate::optimize::Plan;
use crate::tensor::Tensor;

/// Executes a plan on one backend; reuses its buffers across runs.
pub struct Executor {
    plan: Plan,
    backend: Arc<dyn Backend>,
    params: Vec<Option<DeviceBuffer>>,
    slots: Vec<Option<DeviceBuffer>>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("nodes", &self.plan.graph.nodes().len())
            .finish_non_exhaustive()
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
                ValueSource::Param(t) => backend.upload(t).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let slots = (0..plan.memory.num_slots()).map(|_| None).collect();
        Ok(Self {
            plan,
            backend,
            params,
            slots,
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
        self.run_inner(inputs, false).map(|(outs, _)| outs)
    }

    /// Runs the plan and also returns every value (inputs, parameters and each
    /// node output, downloaded right after its node ran), indexed by value id.
    pub fn run_traced(&mut self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, Vec<Option<Tensor>>)> {
        self.run_inner(inputs, true)
    }

    fn run_inner(
        &mut self,
        inputs: &[Tensor],
        trace: bool,
    ) -> Result<(Vec<Tensor>, Vec<Option<Tensor>>)> {
        let Self {
            plan,
            backend,
            params,
            slots,
        } = self;
        let graph = &plan.graph;
        let slot_of = &plan.memory.slot_of;
        let input_specs: Vec<TensorSpec> = inputs
            .iter()
            .map(|t| TensorSpec::new(t.shape(), t.dtype()))
            .collect();
        let specs = graph.infer_specs(&input_specs)?;
        let caps = plan.memory.slot_capacities(&specs);
        for (slot, &cap) in caps.iter().enumerate() {
            let ok = slots[slot].as_ref().is_some_and(|b| b.len() >= cap);
            if !ok {
                slots[slot] = Some(backend.allocate(plan.memory.slot_dtypes[slot], cap)?);
            }
        }
        let input_bufs = inputs
            .iter()
            .map(|t| backend.upload(t))
            .collect::<Result<Vec<_>>>()?;
        let mut traced: Vec<Option<Tensor>> =
            vec![None; if trace { graph.values().len() } else { 0 }];
        if trace {
            for (&id, t) in graph.inputs().iter().zip(inputs) {
                traced[id.0] = Some(t.clone());
            }
            for (i, v) in graph.values().iter().enumerate() {
                if let ValueSource::Param(t) = &v.source {
                    traced[i] = Some(t.clone());
                }
            }
        }
        backend.run_launches(&mut || {
            for (node, choice) in graph.nodes().iter().zip(&plan.kernels) {
                let _span =
                    tracing::trace_span!("launch", node = %node.name, kernel = %choice.kernel)
                        .entered();
                let mut outs = node
                    .outputs
                    .iter()
                    .map(|o| {
                        slot_of[o.0].and_then(|s| slots[s].take()).ok_or_else(|| {
                            KptError::Graph(format!(
                                "value `{}` has no free buffer",
                                graph.value(*o).name
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let result = {
                    let lookup = |v: ValueId| -> Result<&DeviceBuffer> {
                        match &graph.value(v).source {
                            ValueSource::Input => {
                                let pos = graph.inputs().iter().position(|&i| i == v);
                                pos.map(|p| &input_bufs[p])
                            }
                            ValueSource::Param(_) => params[v.0].as_ref(),
                            ValueSource::Node { .. } => {
                                slot_of[v.0].and_then(|s| slots[s].as_ref())
                            }
                        }
                        .ok_or_else(|| {
                            KptError::Graph(format!(
                                "value `{}` has no buffer",
                                graph.value(v).name
                            ))
                        })
                    };
                    let in_refs = node
                        .inputs
                        .iter()
                        .map(|&v| {
                            lookup(v).map(|buffer| BufferRef {
                                buffer,
                                spec: &specs[v.0],
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
                    backend.execute(&choice.kernel, &node.op, &in_refs, &mut out_refs)
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
        let outputs = graph
            .outputs()
            .iter()
            .map(|&o| match &graph.value(o).source {
                ValueSource::Input => graph
                    .inputs()
                    .iter()
                    .position(|&i| i == o)
                    .map(|p| inputs[p].clone())
                    .ok_or_else(|| KptError::Graph("output input not found".into())),
                ValueSource::Param(t) => Ok(t.clone()),
                ValueSource::Node { .. } => {
                    let slot = slot_of[o.0]
                        .and_then(|s| slots[s].as_ref())
                        .ok_or_else(|| KptError::Graph("output has no buffer".into()))?;
                    backend.download(slot, &specs[o.0])
                }
            })
            .collect::<Result<Vec<_>>>()?;
        backend.synchronize()?;
        Ok((outputs, traced))
    }
}
