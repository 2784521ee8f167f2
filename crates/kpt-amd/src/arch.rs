//! AMD GPU targets: the `gcnArchName` a device reports (`gfx90a:sramecc+:xnack-`), the
//! family it belongs to, what its hardware has (wave size, LDS, matrix cores, FP8), and
//! the per-architecture tuning kpt launches its kernels with.
//!
//! Facts per processor are from LLVM's AMDGPU processor table (`AMDGPUUsage`: wave size,
//! LDS per workgroup, `xnack` / `sramecc` target features) and AMD's CDNA2, CDNA3 and
//! RDNA3 instruction set references (MFMA, WMMA and FP8 instructions).

use std::fmt;

use crate::AmdError;

/// A target feature's setting in a target ID (`sramecc+`, `xnack-`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FeatureSetting {
    /// `+`: on.
    On,
    /// `-`: off.
    Off,
}

/// An AMD GPU family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// GCN 5 (Vega: MI25, MI50/MI60, Radeon VII): gfx900, gfx906, ...
    Gcn5,
    /// CDNA (MI100): gfx908.
    Cdna1,
    /// CDNA 2 (MI210, MI250, MI250X): gfx90a.
    Cdna2,
    /// CDNA 3 (MI300A, MI300X, MI325X): gfx940, gfx941, gfx942.
    Cdna3,
    /// CDNA 4 (MI350X, MI355X): gfx950.
    Cdna4,
    /// RDNA (RX 5000): gfx1010 to gfx1013.
    Rdna1,
    /// RDNA 2 (RX 6000, W6800): gfx1030 to gfx1036.
    Rdna2,
    /// RDNA 3 and 3.5 (RX 7000, W7900, Strix APUs): gfx1100 to gfx1103, gfx1150, gfx1151.
    Rdna3,
    /// RDNA 4 (RX 9000): gfx1200, gfx1201.
    Rdna4,
    /// A processor kpt has no table for (older GCN, future parts).
    Other,
}

impl Family {
    /// Upper-case name as AMD writes it (`CDNA3`, `RDNA3`, `GCN5`, `other`).
    pub const fn name(self) -> &'static str {
        match self {
            Family::Gcn5 => "GCN5",
            Family::Cdna1 => "CDNA1",
            Family::Cdna2 => "CDNA2",
            Family::Cdna3 => "CDNA3",
            Family::Cdna4 => "CDNA4",
            Family::Rdna1 => "RDNA1",
            Family::Rdna2 => "RDNA2",
            Family::Rdna3 => "RDNA3",
            Family::Rdna4 => "RDNA4",
            Family::Other => "other",
        }
    }

    /// Whether this is a compute (Instinct) family: CDNA, and GCN 5 before it.
    pub const fn is_cdna(self) -> bool {
        matches!(
            self,
            Family::Gcn5 | Family::Cdna1 | Family::Cdna2 | Family::Cdna3 | Family::Cdna4
        )
    }

    /// Whether this is a graphics (Radeon) family.
    pub const fn is_rdna(self) -> bool {
        matches!(
            self,
            Family::Rdna1 | Family::Rdna2 | Family::Rdna3 | Family::Rdna4
        )
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The matrix instructions of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatrixCores {
    /// None (GCN 5, RDNA 1 and 2 compute matrix products on the vector ALUs).
    None,
    /// MFMA (matrix fused multiply-add) on CDNA's matrix cores.
    Mfma,
    /// WMMA (wave matrix multiply-accumulate) on RDNA 3 and 4.
    Wmma,
}

/// The FP8 encoding a device's matrix instructions take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// `e4m3fnuz` / `e5m2fnuz` (one NaN, no negative zero, exponent bias one higher
    /// than OCP's): CDNA 3's MFMA.
    Fnuz,
    /// OCP `e4m3fn` / `e5m2` (what kpt's FP8 dtypes and NVIDIA's hardware use): CDNA 4
    /// and RDNA 4.
    Ocp,
}

/// A parsed target ID: processor and explicit target features.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GcnArch {
    processor: String,
    features: Vec<(String, FeatureSetting)>,
}

impl GcnArch {
    /// Parses a `gcnArchName` / target ID: `gfx` and a version (`90a`, `942`, `1100`),
    /// then any number of `:feature+` or `:feature-`.
    pub fn parse(text: &str) -> Result<GcnArch, AmdError> {
        let bad = |reason: &str| AmdError::InvalidArch {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let mut parts = text.trim().split(':');
        let processor = parts.next().unwrap_or_default();
        let version = processor
            .strip_prefix("gfx")
            .ok_or_else(|| bad("the processor does not start with `gfx`"))?;
        if !(3..=4).contains(&version.len())
            || !version
                .bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
            || !version.as_bytes()[0].is_ascii_digit()
        {
            return Err(bad(
                "the processor version is not 3 or 4 digits (the last two may be hex), \
                 e.g. gfx90a, gfx942, gfx1100",
            ));
        }
        if !version[..version.len() - 2]
            .bytes()
            .all(|b| b.is_ascii_digit())
            || !version[version.len() - 2..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit())
        {
            return Err(bad(
                "the major version must be decimal and minor / stepping hex digits",
            ));
        }
        let mut features = Vec::new();
        for f in parts {
            let (name, setting) = if let Some(n) = f.strip_suffix('+') {
                (n, FeatureSetting::On)
            } else if let Some(n) = f.strip_suffix('-') {
                (n, FeatureSetting::Off)
            } else {
                return Err(bad(&format!("feature `{f}` does not end with + or -")));
            };
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(bad(&format!("feature `{f}` has no name")));
            }
            if features.iter().any(|(n, _)| n == name) {
                return Err(bad(&format!("feature `{name}` is given twice")));
            }
            features.push((name.to_string(), setting));
        }
        Ok(GcnArch {
            processor: processor.to_string(),
            features,
        })
    }

    /// The processor, e.g. `gfx942`: what code objects are built for and selected by.
    pub fn processor(&self) -> &str {
        &self.processor
    }

    /// The explicit target features, in the order given.
    pub fn features(&self) -> &[(String, FeatureSetting)] {
        &self.features
    }

    /// The setting of `feature` (`xnack`, `sramecc`), if the target ID gives one.
    pub fn feature(&self, feature: &str) -> Option<FeatureSetting> {
        self.features
            .iter()
            .find(|(n, _)| n == feature)
            .map(|&(_, s)| s)
    }

    /// `(major, minor, stepping)` of the ISA version: `gfx90a` is (9, 0, 10), `gfx942`
    /// (9, 4, 2), `gfx1100` (11, 0, 0).
    pub fn version(&self) -> (u32, u32, u32) {
        let v = &self.processor[3..];
        let (major, rest) = v.split_at(v.len() - 2);
        let hex = |c: u8| char::from(c).to_digit(16).unwrap_or(0);
        // `parse` checked that `major` is decimal and `rest` two hex digits.
        (
            major.parse().unwrap_or(0),
            hex(rest.as_bytes()[0]),
            hex(rest.as_bytes()[1]),
        )
    }

    /// The family of the processor.
    pub fn family(&self) -> Family {
        match self.processor.as_str() {
            "gfx900" | "gfx902" | "gfx904" | "gfx906" | "gfx909" | "gfx90c" => Family::Gcn5,
            "gfx908" => Family::Cdna1,
            "gfx90a" => Family::Cdna2,
            "gfx940" | "gfx941" | "gfx942" => Family::Cdna3,
            "gfx950" => Family::Cdna4,
            "gfx1010" | "gfx1011" | "gfx1012" | "gfx1013" => Family::Rdna1,
            "gfx1030" | "gfx1031" | "gfx1032" | "gfx1033" | "gfx1034" | "gfx1035" | "gfx1036" => {
                Family::Rdna2
            }
            "gfx1100" | "gfx1101" | "gfx1102" | "gfx1103" | "gfx1150" | "gfx1151" => Family::Rdna3,
            "gfx1200" | "gfx1201" => Family::Rdna4,
            _ => Family::Other,
        }
    }

    /// Threads per wavefront that HIP compiles for by default: 64 on GCN and CDNA, 32 on
    /// RDNA (which can also run wave64, but HIP's default and ROCm's libraries use
    /// wave32). For an unknown processor, by ISA major version (10 and later: 32).
    pub fn wave_size(&self) -> u32 {
        let family = self.family();
        if family.is_rdna() || (family == Family::Other && self.version().0 >= 10) {
            32
        } else {
            64
        }
    }

    /// LDS (shared memory) one workgroup may use: 64 KiB, except 160 KiB on gfx950.
    pub fn lds_bytes_per_workgroup(&self) -> u32 {
        match self.family() {
            Family::Cdna4 => 160 * 1024,
            _ => 64 * 1024,
        }
    }

    /// The matrix instructions of the family.
    pub fn matrix_cores(&self) -> MatrixCores {
        match self.family() {
            Family::Cdna1 | Family::Cdna2 | Family::Cdna3 | Family::Cdna4 => MatrixCores::Mfma,
            Family::Rdna3 | Family::Rdna4 => MatrixCores::Wmma,
            _ => MatrixCores::None,
        }
    }

    /// Whether the matrix instructions take bf16 (MFMA on CDNA, WMMA on RDNA 3 and 4).
    pub fn has_bf16_matrix(&self) -> bool {
        self.matrix_cores() != MatrixCores::None
    }

    /// The FP8 encoding of the matrix instructions, or `None` without FP8: CDNA 3
    /// (gfx940, gfx941, gfx942) takes the FNUZ variants; CDNA 4 and RDNA 4 take OCP.
    pub fn fp8(&self) -> Option<Fp8Format> {
        match self.family() {
            Family::Cdna3 => Some(Fp8Format::Fnuz),
            Family::Cdna4 | Family::Rdna4 => Some(Fp8Format::Ocp),
            _ => None,
        }
    }

    /// The tuning table of this processor.
    pub fn tuning(&self) -> Tuning {
        Tuning::for_arch(self)
    }
}

impl fmt::Display for GcnArch {
    /// The target ID as parsed, e.g. `gfx90a:sramecc+:xnack-`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.processor)?;
        for (name, setting) in &self.features {
            let sign = match setting {
                FeatureSetting::On => '+',
                FeatureSetting::Off => '-',
            };
            write!(f, ":{name}{sign}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for GcnArch {
    type Err = AmdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GcnArch::parse(s)
    }
}

/// How kpt sizes launches on one architecture.
///
/// kpt's row kernels (norms, softmax, rotary, SwiGLU) are written for blocks of 128 or
/// 256 threads whose reductions combine 32-lane groups, so they run unchanged on waves
/// of 32 and 64; this table says what a block costs on the device and how many fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Threads per wavefront the code objects are built for.
    pub wave_size: u32,
    /// LDS per workgroup in bytes.
    pub lds_bytes: u32,
    /// SIMD units per compute unit: 4 on GCN / CDNA, 2 on RDNA (per CU; a WGP has 4).
    pub simds_per_cu: u32,
    /// Waves resident per SIMD at most: 8 on CDNA 2 and 3, 10 on GCN 5 and CDNA 1,
    /// 16 on RDNA.
    pub max_waves_per_simd: u32,
    /// Threads per block of the row kernels (`// kpt:launch block=`).
    pub row_block: u32,
    /// Largest workgroup in threads.
    pub max_workgroup: u32,
}

impl Tuning {
    /// The table of `arch`'s family.
    pub fn for_arch(arch: &GcnArch) -> Tuning {
        let family = arch.family();
        let rdna = arch.wave_size() == 32;
        Tuning {
            wave_size: arch.wave_size(),
            lds_bytes: arch.lds_bytes_per_workgroup(),
            simds_per_cu: if rdna { 2 } else { 4 },
            max_waves_per_simd: match family {
                Family::Cdna2 | Family::Cdna3 | Family::Cdna4 => 8,
                _ if rdna => 16,
                _ => 10,
            },
            row_block: 256,
            max_workgroup: 1024,
        }
    }

    /// Waves resident per compute unit at most.
    pub fn max_waves_per_cu(&self) -> u32 {
        self.simds_per_cu * self.max_waves_per_simd
    }

    /// Waves in a block of `threads`.
    pub fn waves_per_block(&self, threads: u32) -> u32 {
        threads.div_ceil(self.wave_size)
    }

    /// Blocks of `threads` using `lds` bytes each that one compute unit can hold at once,
    /// limited by waves and by LDS (64 KiB per CU on every family in the table; 160 KiB
    /// on gfx950); 0 when one block does not fit.
    pub fn blocks_per_cu(&self, threads: u32, lds: u32) -> u32 {
        if threads == 0 || threads > self.max_workgroup || lds > self.lds_bytes {
            return 0;
        }
        let by_waves = self.max_waves_per_cu() / self.waves_per_block(threads);
        let by_lds = self.lds_bytes.checked_div(lds).unwrap_or(u32::MAX);
        by_waves.min(by_lds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arch(s: &str) -> GcnArch {
        GcnArch::parse(s).unwrap()
    }

    #[test]
    fn target_ids_parse_with_their_features() {
        let a = arch("gfx90a:sramecc+:xnack-");
        assert_eq!(a.processor(), "gfx90a");
        assert_eq!(a.feature("sramecc"), Some(FeatureSetting::On));
        assert_eq!(a.feature("xnack"), Some(FeatureSetting::Off));
        assert_eq!(a.feature("tgsplit"), None);
        assert_eq!(a.to_string(), "gfx90a:sramecc+:xnack-");
        assert_eq!(a.version(), (9, 0, 10));
        assert_eq!(arch("gfx942:sramecc+:xnack-").version(), (9, 4, 2));
        let r = arch("gfx1100");
        assert_eq!((r.processor(), r.features().len()), ("gfx1100", 0));
        assert_eq!(r.version(), (11, 0, 0));
        assert_eq!("gfx1030".parse::<GcnArch>().unwrap().version(), (10, 3, 0));
    }

    #[test]
    fn bad_target_ids_are_typed_errors() {
        for bad in [
            "",
            "sm_90",
            "gfx",
            "gfx9",
            "gfx12345",
            "gfxa0a",
            "gfx9g0",
            "gfx90a:xnack",
            "gfx90a:+",
            "gfx90a:xnack+:xnack-",
            "GFX90A",
        ] {
            match GcnArch::parse(bad) {
                Err(AmdError::InvalidArch { text, .. }) => assert_eq!(text, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn families_and_hardware() {
        let cases = [
            // processor, family, wave, matrix, fp8
            ("gfx906", Family::Gcn5, 64, MatrixCores::None, None),
            ("gfx908", Family::Cdna1, 64, MatrixCores::Mfma, None),
            ("gfx90a", Family::Cdna2, 64, MatrixCores::Mfma, None),
            (
                "gfx940",
                Family::Cdna3,
                64,
                MatrixCores::Mfma,
                Some(Fp8Format::Fnuz),
            ),
            (
                "gfx942",
                Family::Cdna3,
                64,
                MatrixCores::Mfma,
                Some(Fp8Format::Fnuz),
            ),
            (
                "gfx950",
                Family::Cdna4,
                64,
                MatrixCores::Mfma,
                Some(Fp8Format::Ocp),
            ),
            ("gfx1030", Family::Rdna2, 32, MatrixCores::None, None),
            ("gfx1100", Family::Rdna3, 32, MatrixCores::Wmma, None),
            ("gfx1151", Family::Rdna3, 32, MatrixCores::Wmma, None),
            (
                "gfx1201",
                Family::Rdna4,
                32,
                MatrixCores::Wmma,
                Some(Fp8Format::Ocp),
            ),
            ("gfx1250", Family::Other, 32, MatrixCores::None, None),
            ("gfx803", Family::Other, 64, MatrixCores::None, None),
        ];
        for (p, family, wave, matrix, fp8) in cases {
            let a = arch(p);
            assert_eq!(a.family(), family, "{p}");
            assert_eq!(a.wave_size(), wave, "{p}");
            assert_eq!(a.matrix_cores(), matrix, "{p}");
            assert_eq!(a.fp8(), fp8, "{p}");
            assert_eq!(a.has_bf16_matrix(), matrix != MatrixCores::None, "{p}");
        }
        assert!(Family::Cdna3.is_cdna() && !Family::Cdna3.is_rdna());
        assert!(Family::Rdna3.is_rdna() && !Family::Rdna3.is_cdna());
        assert_eq!(Family::Cdna2.to_string(), "CDNA2");
    }

    #[test]
    fn tuning_tables_follow_the_family() {
        let mi300 = arch("gfx942").tuning();
        assert_eq!((mi300.wave_size, mi300.lds_bytes), (64, 65536));
        assert_eq!(mi300.max_waves_per_cu(), 32);
        // A 256-thread row block is 4 waves of 64: 8 blocks per CU by waves, 4 when each
        // takes 16 KiB of LDS.
        assert_eq!(mi300.waves_per_block(256), 4);
        assert_eq!(mi300.blocks_per_cu(256, 0), 8);
        assert_eq!(mi300.blocks_per_cu(256, 16 * 1024), 4);
        assert_eq!(mi300.blocks_per_cu(256, 65 * 1024), 0);
        assert_eq!(mi300.blocks_per_cu(2048, 0), 0);
        let navi31 = arch("gfx1100").tuning();
        assert_eq!((navi31.wave_size, navi31.simds_per_cu), (32, 2));
        assert_eq!(navi31.max_waves_per_cu(), 32);
        // The same block is 8 waves of 32 on RDNA 3: 4 per CU.
        assert_eq!(navi31.waves_per_block(256), 8);
        assert_eq!(navi31.blocks_per_cu(256, 0), 4);
        assert_eq!(arch("gfx950").tuning().lds_bytes, 160 * 1024);
        assert_eq!(arch("gfx906").tuning().max_waves_per_cu(), 40);
    }
}
