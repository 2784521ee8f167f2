//! Per-kernel device time for [`crate::CudaBackend`]: while profiling is on, every kernel
//! the backend runs is bracketed by two CUDA events on its stream; the events are
//! resolved into `kpt_core::profile` totals (time, bytes moved, FLOPs) on request, or
//! when many are pending, so recording never waits for the device per kernel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudarc::driver::CudaEvent;
use kpt_core::graph::{Op, TensorSpec};
use kpt_core::profile::{KernelProfile, ProfileTotals};

use crate::NvidiaError;

/// Pending records resolved at once (each holds two events).
const MAX_PENDING: usize = 4096;

/// One kernel call whose events may not have completed yet.
struct Pending {
    kernel: String,
    op: Op,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    start: CudaEvent,
    end: CudaEvent,
}

#[derive(Default)]
struct State {
    pending: Vec<Pending>,
    totals: ProfileTotals,
}

impl State {
    /// Waits for the pending events and adds their times to the totals.
    fn resolve(&mut self) -> Result<(), NvidiaError> {
        for p in self.pending.drain(..) {
            p.end
                .synchronize()
                .map_err(|e| NvidiaError::driver("cuEventSynchronize", e))?;
            let ms = p
                .start
                .elapsed_ms(&p.end)
                .map_err(|e| NvidiaError::driver("cuEventElapsedTime", e))?;
            self.totals
                .add(&p.kernel, &p.op, &p.inputs, &p.outputs, f64::from(ms) / 1e3);
        }
        Ok(())
    }
}

/// The recorder (off until started).
#[derive(Default)]
pub(crate) struct Profiler {
    on: AtomicBool,
    state: Mutex<State>,
}

impl Profiler {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether kernels are being recorded.
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Starts recording afresh, or stops (keeping what was recorded).
    pub(crate) fn set(&self, on: bool) {
        if on {
            *self.state() = State::default();
        }
        self.on.store(on, Ordering::Relaxed);
    }

    /// Records one kernel call between the events `start` and `end`.
    pub(crate) fn record(
        &self,
        kernel: &str,
        op: &Op,
        inputs: Vec<TensorSpec>,
        outputs: Vec<TensorSpec>,
        (start, end): (CudaEvent, CudaEvent),
    ) -> Result<(), NvidiaError> {
        let mut state = self.state();
        state.pending.push(Pending {
            kernel: kernel.to_string(),
            op: op.clone(),
            inputs,
            outputs,
            start,
            end,
        });
        if state.pending.len() >= MAX_PENDING {
            state.resolve()?;
        }
        Ok(())
    }

    /// Every kernel's totals so far, the most time first.
    pub(crate) fn report(&self) -> Result<Vec<KernelProfile>, NvidiaError> {
        let mut state = self.state();
        state.resolve()?;
        Ok(state.totals.report())
    }
}
