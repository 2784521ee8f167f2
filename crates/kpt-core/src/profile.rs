//! Per-kernel profiles: how often each kernel ran, its total device time, and the bytes
//! and FLOPs it moved and did, from which the achieved bandwidth and FLOP rate follow.
//! Backends record with a [`ProfileTotals`] and hand out [`KernelProfile`]s through
//! [`crate::backend::Backend::profile`].

use std::collections::BTreeMap;

use serde::Serialize;

use crate::graph::{Op, TensorSpec};

/// One kernel's totals over the calls a profiler recorded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KernelProfile {
    /// Kernel name from the registry.
    pub kernel: String,
    /// The op kind it ran (e.g. `rms_norm`).
    pub op: String,
    /// Calls recorded.
    pub calls: u64,
    /// Total time in seconds (device time where the backend measures it there).
    pub seconds: f64,
    /// Bytes of every input read once and every output written once, over all calls.
    pub bytes: f64,
    /// Floating-point operations over all calls (0 for ops that only move data).
    pub flops: f64,
}

impl KernelProfile {
    /// Mean seconds per call.
    pub fn mean_seconds(&self) -> f64 {
        self.seconds / self.calls.max(1) as f64
    }

    /// Achieved bandwidth in bytes per second.
    pub fn bytes_per_second(&self) -> f64 {
        rate(self.bytes, self.seconds)
    }

    /// Achieved FLOP rate per second.
    pub fn flops_per_second(&self) -> f64 {
        rate(self.flops, self.seconds)
    }
}

fn rate(amount: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        amount / seconds
    } else {
        0.0
    }
}

/// Bytes an op must move at least: every input read once, every output written once.
pub fn bytes_moved(inputs: &[TensorSpec], outputs: &[TensorSpec]) -> f64 {
    inputs
        .iter()
        .chain(outputs)
        .map(|s| (s.numel() * s.dtype.size_in_bytes()) as f64)
        .sum()
}

/// Running totals per (kernel, op kind).
#[derive(Debug, Clone, Default)]
pub struct ProfileTotals {
    totals: BTreeMap<(String, String), KernelProfile>,
}

impl ProfileTotals {
    /// Adds one call of `kernel` running `op` on `inputs` into `outputs`.
    pub fn add(
        &mut self,
        kernel: &str,
        op: &Op,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
        seconds: f64,
    ) {
        let op_name = op.kind().to_string();
        let entry = self
            .totals
            .entry((kernel.to_string(), op_name.clone()))
            .or_insert_with(|| KernelProfile {
                kernel: kernel.to_string(),
                op: op_name,
                calls: 0,
                seconds: 0.0,
                bytes: 0.0,
                flops: 0.0,
            });
        entry.calls += 1;
        entry.seconds += seconds;
        entry.bytes += bytes_moved(inputs, outputs);
        entry.flops += op.flops(inputs);
    }

    /// Every kernel's totals, the most time first.
    pub fn report(&self) -> Vec<KernelProfile> {
        let mut out: Vec<_> = self.totals.values().cloned().collect();
        out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn totals_add_up_per_kernel_and_rates_follow() {
        let mut t = ProfileTotals::default();
        let x = TensorSpec::new(&[4, 8], DType::F32);
        let w = TensorSpec::new(&[8], DType::F32);
        let op = Op::RmsNorm { eps: 1e-5 };
        t.add(
            "k.norm",
            &op,
            &[x.clone(), w.clone()],
            std::slice::from_ref(&x),
            1e-6,
        );
        t.add(
            "k.norm",
            &op,
            &[x.clone(), w.clone()],
            std::slice::from_ref(&x),
            3e-6,
        );
        let a = TensorSpec::new(&[2, 8], DType::F32);
        let b = TensorSpec::new(&[8, 3], DType::F32);
        let mm = TensorSpec::new(&[2, 3], DType::F32);
        t.add("k.mm", &Op::MatMul, &[a, b], &[mm], 1e-6);
        let r = t.report();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].kernel.as_str(), r[0].calls), ("k.norm", 2));
        assert!((r[0].mean_seconds() - 2e-6).abs() < 1e-12);
        // (32 + 8 + 32) f32 per call, two calls.
        assert_eq!(r[0].bytes, 2.0 * 72.0 * 4.0);
        assert!((r[0].bytes_per_second() - 576.0 / 4e-6).abs() < 1e-3);
        assert_eq!(r[1].flops, 2.0 * 2.0 * 8.0 * 3.0);
        assert_eq!(
            KernelProfile {
                seconds: 0.0,
                ..r[1].clone()
            }
            .flops_per_second(),
            0.0
        );
    }
}
