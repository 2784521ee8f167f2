//! TPU generations, told apart by the device kind libtpu reports, and what Google
//! publishes about each generation's chip.

/// A generation of Google TPU, as libtpu names its devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TpuGeneration {
    /// TPU v2.
    V2,
    /// TPU v3.
    V3,
    /// TPU v4.
    V4,
    /// TPU v5e ("v5 lite"), the inference and small-training chip of the fifth
    /// generation.
    V5e,
    /// TPU v5p, the training chip of the fifth generation.
    V5p,
    /// TPU v6e (Trillium; "v6 lite").
    V6e,
    /// TPU7x (Ironwood), the first chip of the seventh generation.
    Tpu7x,
}

/// What Google publishes about one chip of a generation (Cloud TPU documentation:
/// the system architecture page and the v2, v3, v4, v5e, v5p, v6e and TPU7x pages).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TpuChipSpecs {
    /// TensorCores per chip.
    pub tensorcores: usize,
    /// High-bandwidth memory per chip, bytes.
    pub hbm_bytes: u64,
    /// Peak dense bf16 compute per chip, TFLOP/s.
    pub peak_bf16_tflops: f64,
}

const GIB: u64 = 1 << 30;

impl TpuGeneration {
    /// Every generation kpt knows, oldest first.
    pub const ALL: [TpuGeneration; 7] = [
        TpuGeneration::V2,
        TpuGeneration::V3,
        TpuGeneration::V4,
        TpuGeneration::V5e,
        TpuGeneration::V5p,
        TpuGeneration::V6e,
        TpuGeneration::Tpu7x,
    ];

    /// The generation of a PJRT device kind (`PJRT_DeviceDescription_Kind`, JAX's
    /// `device.device_kind`), or `None` for any other kind (a CPU or GPU, a TPU kpt does
    /// not know, such as the inference chip "TPU v4 lite", whose specifications Google
    /// does not publish).
    ///
    /// libtpu's kinds are "TPU v2", "TPU v3", "TPU v4", "TPU v5 lite" (v5e), "TPU v5"
    /// (v5p), "TPU v6 lite" (v6e) and "TPU7x": JAX's Pallas test
    /// `tests/pallas/tpu_info_test.py` (jax-ml/jax) maps exactly these to its chip
    /// versions, and XLA's `GetDeviceMemoryInBytes` (`xla/python/ifrt/ir/utils.cc`,
    /// openxla/xla) matches "TPU v2" ... "TPU v6 lite", with "TPU v5p" and "TPU v5e"
    /// as other spellings, which are accepted here as well ("TPU v6e" too). Case and
    /// runs of spaces are ignored.
    pub fn from_device_kind(kind: &str) -> Option<TpuGeneration> {
        let norm = kind
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_ascii_lowercase();
        Some(match norm.as_str() {
            "tpu v2" => TpuGeneration::V2,
            "tpu v3" => TpuGeneration::V3,
            "tpu v4" => TpuGeneration::V4,
            "tpu v5 lite" | "tpu v5e" => TpuGeneration::V5e,
            "tpu v5" | "tpu v5p" => TpuGeneration::V5p,
            "tpu v6 lite" | "tpu v6e" => TpuGeneration::V6e,
            "tpu7x" | "tpu 7x" => TpuGeneration::Tpu7x,
            _ => return None,
        })
    }

    /// The generation's short name, as Google Cloud writes it: `v2`, `v3`, `v4`, `v5e`,
    /// `v5p`, `v6e`, `tpu7x`. It is the `arch` of a TPU's `DeviceInfo`.
    pub fn name(self) -> &'static str {
        match self {
            TpuGeneration::V2 => "v2",
            TpuGeneration::V3 => "v3",
            TpuGeneration::V4 => "v4",
            TpuGeneration::V5e => "v5e",
            TpuGeneration::V5p => "v5p",
            TpuGeneration::V6e => "v6e",
            TpuGeneration::Tpu7x => "tpu7x",
        }
    }

    /// The published facts of one chip of this generation.
    ///
    /// From the Cloud TPU pages of each version ("Each v4 chip contains two
    /// TensorCores", "Peak compute per chip (bf16)", "HBM capacity"): v3 2 cores,
    /// 32 GiB, 123 TFLOP/s; v4 2, 32 GiB, 275; v5e 1, 16 GiB, 197; v5p 2, 95 GiB, 459;
    /// v6e 1, 32 GiB, 918; TPU7x 2, 192 GiB, 2307 (the TPU7x page's table). The v2 page
    /// no longer lists per-chip values: two TensorCores with 8 GiB of HBM each (XLA's
    /// `GetDeviceMemoryInBytes` gives 8 GiB per "TPU v2" device, one per core), and
    /// 45 TFLOP/s, a quarter of the 180 TFLOP/s Google gave for a four-chip Cloud TPU
    /// v2 board.
    pub fn chip(self) -> TpuChipSpecs {
        let (tensorcores, hbm_gib, peak_bf16_tflops) = match self {
            TpuGeneration::V2 => (2, 16, 45.0),
            TpuGeneration::V3 => (2, 32, 123.0),
            TpuGeneration::V4 => (2, 32, 275.0),
            TpuGeneration::V5e => (1, 16, 197.0),
            TpuGeneration::V5p => (2, 95, 459.0),
            TpuGeneration::V6e => (1, 32, 918.0),
            TpuGeneration::Tpu7x => (2, 192, 2307.0),
        };
        TpuChipSpecs {
            tensorcores,
            hbm_bytes: hbm_gib * GIB,
            peak_bf16_tflops,
        }
    }
}

impl std::fmt::Display for TpuGeneration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtpu_device_kinds_parse() {
        for (kind, want) in [
            ("TPU v2", TpuGeneration::V2),
            ("TPU v3", TpuGeneration::V3),
            ("TPU v4", TpuGeneration::V4),
            ("TPU v5 lite", TpuGeneration::V5e),
            ("TPU v5e", TpuGeneration::V5e),
            ("TPU v5", TpuGeneration::V5p),
            ("TPU v5p", TpuGeneration::V5p),
            ("TPU v6 lite", TpuGeneration::V6e),
            ("TPU v6e", TpuGeneration::V6e),
            ("TPU7x", TpuGeneration::Tpu7x),
            // Case and spacing do not matter.
            ("tpu  V5 LITE", TpuGeneration::V5e),
            ("  TPU v4\n", TpuGeneration::V4),
        ] {
            assert_eq!(
                TpuGeneration::from_device_kind(kind),
                Some(want),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn other_kinds_are_none() {
        for kind in [
            "",
            " ",
            "cpu",
            "NVIDIA H100 80GB HBM3",
            "TPU",
            "TPU v4 lite",
            "TPU v1",
            "TPU v5 lite extra",
            "TPU v55",
            "TPUv4",
            "TPU v8",
            "\u{0}TPU v4",
            "TPU v4\u{301}",
        ] {
            assert_eq!(TpuGeneration::from_device_kind(kind), None, "{kind:?}");
        }
    }

    #[test]
    fn names_are_distinct_and_shown() {
        let names: std::collections::BTreeSet<_> =
            TpuGeneration::ALL.iter().map(|g| g.name()).collect();
        assert_eq!(names.len(), TpuGeneration::ALL.len());
        assert_eq!(TpuGeneration::V5e.to_string(), "v5e");
        assert_eq!(TpuGeneration::Tpu7x.to_string(), "tpu7x");
    }

    #[test]
    fn published_chip_facts() {
        let v5e = TpuGeneration::V5e.chip();
        assert_eq!(v5e.tensorcores, 1);
        assert_eq!(v5e.hbm_bytes, 16 << 30);
        assert_eq!(v5e.peak_bf16_tflops, 197.0);
        let v5p = TpuGeneration::V5p.chip();
        assert_eq!((v5p.tensorcores, v5p.hbm_bytes), (2, 95 << 30));
        assert_eq!(TpuGeneration::V6e.chip().peak_bf16_tflops, 918.0);
        assert_eq!(TpuGeneration::Tpu7x.chip().hbm_bytes, 192 << 30);
        // Each generation is faster per chip than the one before it, except v5e (the
        // cost-efficient chip) against v4.
        for pair in TpuGeneration::ALL.windows(2) {
            let (a, b) = (pair[0].chip(), pair[1].chip());
            if pair[1] != TpuGeneration::V5e {
                assert!(b.peak_bf16_tflops > a.peak_bf16_tflops, "{pair:?}");
            }
            assert!(b.tensorcores >= 1 && b.hbm_bytes >= 16 << 30);
        }
    }
}
