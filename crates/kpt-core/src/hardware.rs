//! Hardware discovery: the host CPU (vendor, caches, SIMD features, memory) and the
//! [`HardwareDetector`] trait that accelerator backends implement.
//!
//! Detection never panics: anything that cannot be determined is reported as `None`,
//! `false` or `"unknown"`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

use crate::error::Result;

/// The kind of a compute device.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU driven through CUDA.
    Cuda,
    /// An AMD GPU driven through ROCm / HIP.
    Rocm,
    /// A Google TPU driven through a PJRT plugin.
    Tpu,
}

impl DeviceKind {
    /// Every device kind, in a stable order.
    pub const ALL: [DeviceKind; 4] = [
        DeviceKind::Cpu,
        DeviceKind::Cuda,
        DeviceKind::Rocm,
        DeviceKind::Tpu,
    ];

    /// Lower-case name, as used in serde and `Display`.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Rocm => "rocm",
            DeviceKind::Tpu => "tpu",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One level of the CPU cache hierarchy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheInfo {
    /// Cache level, starting at 1.
    pub level: u8,
    /// `"data"`, `"instruction"` or `"unified"`.
    pub kind: String,
    /// Capacity of one instance of this cache, in bytes.
    pub size_bytes: u64,
    /// Maximum number of logical processors sharing one instance, when known.
    pub shared_by: Option<usize>,
}

/// SIMD and matrix features of the host CPU that kernels can dispatch on.
///
/// A feature is `true` only when both the CPU and the operating system support it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct CpuFeatures {
    /// SSE 4.2.
    pub sse4_2: bool,
    /// AVX.
    pub avx: bool,
    /// AVX2.
    pub avx2: bool,
    /// Fused multiply-add (FMA3).
    pub fma: bool,
    /// Half-precision conversion instructions.
    pub f16c: bool,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// AVX-512 byte and word instructions.
    pub avx512bw: bool,
    /// AVX-512 vector length extensions.
    pub avx512vl: bool,
    /// AVX-512 bfloat16 instructions.
    pub avx512_bf16: bool,
    /// AVX-512 half-precision arithmetic.
    pub avx512_fp16: bool,
    /// AVX-512 vector neural network instructions (int8 dot products).
    pub avx512_vnni: bool,
    /// AMX tile architecture.
    pub amx_tile: bool,
    /// AMX bfloat16 tile multiply.
    pub amx_bf16: bool,
    /// AMX int8 tile multiply.
    pub amx_int8: bool,
    /// Arm Advanced SIMD (NEON).
    pub neon: bool,
}

impl CpuFeatures {
    /// Detects the features of the CPU this process runs on.
    pub fn detect() -> Self {
        detect_features()
    }

    /// Names of the features that are present, in declaration order.
    pub fn names(&self) -> Vec<&'static str> {
        let all = [
            (self.sse4_2, "sse4_2"),
            (self.avx, "avx"),
            (self.avx2, "avx2"),
            (self.fma, "fma"),
            (self.f16c, "f16c"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512vl, "avx512vl"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.avx512_fp16, "avx512_fp16"),
            (self.avx512_vnni, "avx512_vnni"),
            (self.amx_tile, "amx_tile"),
            (self.amx_bf16, "amx_bf16"),
            (self.amx_int8, "amx_int8"),
            (self.neon, "neon"),
        ];
        all.into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect()
    }
}

/// Everything kpt knows about the host CPU.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuInfo {
    /// Vendor string, e.g. `GenuineIntel`, `AuthenticAMD`; `unknown` if not found.
    pub vendor: String,
    /// Marketing name, e.g. `Intel(R) Xeon(R) Platinum 8480+`; `unknown` if not found.
    pub model_name: String,
    /// Logical processors this process may use (at least 1).
    pub logical_cores: usize,
    /// Physical cores of the machine, when they can be determined.
    pub physical_cores: Option<usize>,
    /// The cache hierarchy, lowest level first.
    pub caches: Vec<CacheInfo>,
    /// SIMD and matrix features.
    pub features: CpuFeatures,
    /// Total system memory in bytes (`MemTotal`), when known.
    pub memory_total_bytes: Option<u64>,
    /// Memory available for new allocations in bytes (`MemAvailable`), when known.
    pub memory_available_bytes: Option<u64>,
}

impl CpuInfo {
    /// Size in bytes of the cache at `level` of the given kind (`"data"`, `"instruction"`,
    /// `"unified"`); a `"data"` request also matches a unified cache.
    pub fn cache_size(&self, level: u8, kind: &str) -> Option<u64> {
        self.caches
            .iter()
            .find(|c| {
                c.level == level && (c.kind == kind || (kind == "data" && c.kind == "unified"))
            })
            .map(|c| c.size_bytes)
    }

    /// Short architecture tag, e.g. `x86_64-avx512`, `x86_64-avx2`, `aarch64-neon`.
    pub fn arch_tag(&self) -> String {
        let arch = std::env::consts::ARCH;
        let f = &self.features;
        let level = if f.avx512f && f.avx512bw && f.avx512vl {
            Some("avx512")
        } else if f.avx2 && f.fma {
            Some("avx2")
        } else if f.neon {
            Some("neon")
        } else {
            None
        };
        match level {
            Some(level) => format!("{arch}-{level}"),
            None => arch.to_string(),
        }
    }

    /// Detects the host CPU now, bypassing the cache used by [`cpu_info`].
    pub fn detect() -> Self {
        let logical_cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let cpuinfo = read_text("/proc/cpuinfo");
        let physical_cores = cpuinfo.as_deref().and_then(parse_physical_cores);
        let (memory_total_bytes, memory_available_bytes) = read_text("/proc/meminfo")
            .map(|t| parse_meminfo(&t))
            .unwrap_or((None, None));
        let (vendor, model_name, caches) = identify(cpuinfo.as_deref());
        let caches = if caches.is_empty() {
            sysfs_caches()
        } else {
            caches
        };
        CpuInfo {
            vendor,
            model_name,
            logical_cores,
            physical_cores,
            caches,
            features: detect_features(),
            memory_total_bytes,
            memory_available_bytes,
        }
    }
}

/// The host CPU, detected once per process and cached.
///
/// Memory figures are those at the first call; [`CpuDetector::detect`] re-reads the
/// available memory.
pub fn cpu_info() -> CpuInfo {
    static INFO: OnceLock<CpuInfo> = OnceLock::new();
    INFO.get_or_init(CpuInfo::detect).clone()
}

/// A device found by a [`HardwareDetector`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    /// Device kind.
    pub kind: DeviceKind,
    /// Index among the devices of this kind (0-based).
    pub index: usize,
    /// Human-readable name.
    pub name: String,
    /// Device (or, for the CPU, system) memory in bytes, when known.
    pub memory_bytes: Option<u64>,
    /// SMs, compute units, TensorCores or logical CPU cores, when known.
    pub compute_units: Option<usize>,
    /// Architecture tag, e.g. `sm_90`, `gfx942`, `v5e`, `x86_64-avx2`.
    pub arch: Option<String>,
    /// Feature names kernels can dispatch on.
    pub features: Vec<String>,
    /// Free-form extra facts (cache sizes, driver versions, ...).
    pub properties: BTreeMap<String, String>,
}

impl DeviceInfo {
    /// Whether `features` contains `name`.
    pub fn has_feature(&self, name: &str) -> bool {
        self.features.iter().any(|f| f == name)
    }
}

/// Finds the devices of one kind on this machine.
pub trait HardwareDetector: Send + Sync {
    /// The kind of device this detector looks for.
    fn kind(&self) -> DeviceKind;

    /// Lists the devices found; an empty list means none are present.
    fn detect(&self) -> Result<Vec<DeviceInfo>>;
}

/// Detects the host CPU as a single [`DeviceInfo`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuDetector;

impl CpuDetector {
    /// Builds the [`DeviceInfo`] describing `info`.
    pub fn device_info(info: &CpuInfo) -> DeviceInfo {
        let mut properties = BTreeMap::new();
        properties.insert("vendor".to_string(), info.vendor.clone());
        properties.insert("logical_cores".to_string(), info.logical_cores.to_string());
        if let Some(p) = info.physical_cores {
            properties.insert("physical_cores".to_string(), p.to_string());
        }
        let cache_keys = [
            ("l1d", 1, "data"),
            ("l1i", 1, "instruction"),
            ("l2", 2, "unified"),
            ("l3", 3, "unified"),
        ];
        for (key, level, kind) in cache_keys {
            let size = if level == 1 {
                info.caches
                    .iter()
                    .find(|c| c.level == 1 && c.kind == kind)
                    .map(|c| c.size_bytes)
            } else {
                info.cache_size(level, kind)
            };
            if let Some(size) = size {
                properties.insert(key.to_string(), size.to_string());
            }
        }
        if let Some(avail) = info.memory_available_bytes {
            properties.insert("memory_available_bytes".to_string(), avail.to_string());
        }
        DeviceInfo {
            kind: DeviceKind::Cpu,
            index: 0,
            name: info.model_name.clone(),
            memory_bytes: info.memory_total_bytes,
            compute_units: Some(info.logical_cores),
            arch: Some(info.arch_tag()),
            features: info
                .features
                .names()
                .into_iter()
                .map(String::from)
                .collect(),
            properties,
        }
    }
}

impl HardwareDetector for CpuDetector {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn detect(&self) -> Result<Vec<DeviceInfo>> {
        let mut info = cpu_info();
        if let Some(text) = read_text("/proc/meminfo") {
            let (total, avail) = parse_meminfo(&text);
            info.memory_total_bytes = total.or(info.memory_total_bytes);
            info.memory_available_bytes = avail.or(info.memory_available_bytes);
        }
        Ok(vec![Self::device_info(&info)])
    }
}

fn read_text(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Parses `MemTotal` and `MemAvailable` (in kB) from `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let mut total = None;
    let mut available = None;
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let Some(value) = parts.next().and_then(|v| v.parse::<u64>().ok()) else {
            continue;
        };
        let scale = match parts.next() {
            Some(unit) if unit.eq_ignore_ascii_case("kb") => 1024,
            Some(unit) if unit.eq_ignore_ascii_case("mb") => 1024 * 1024,
            Some(unit) if unit.eq_ignore_ascii_case("gb") => 1024 * 1024 * 1024,
            _ => 1,
        };
        let bytes = value.checked_mul(scale);
        match key.trim() {
            "MemTotal" => total = bytes,
            "MemAvailable" => available = bytes,
            _ => {}
        }
    }
    (total, available)
}

/// Counts physical cores from `/proc/cpuinfo` text: distinct (`physical id`, `core id`)
/// pairs, else `cpu cores` times the number of packages.
fn parse_physical_cores(text: &str) -> Option<usize> {
    use std::collections::BTreeSet;
    let mut pairs = BTreeSet::new();
    let mut packages = BTreeSet::new();
    let mut cores_per_package = None;
    let mut physical_id = None;
    let mut core_id = None;
    let mut flush = |physical_id: &mut Option<String>, core_id: &mut Option<String>| {
        if let Some(core) = core_id.take() {
            pairs.insert((physical_id.clone().unwrap_or_default(), core));
        }
        if let Some(p) = physical_id.take() {
            packages.insert(p);
        }
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            flush(&mut physical_id, &mut core_id);
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim().to_string();
        match key.trim() {
            "physical id" => physical_id = Some(value),
            "core id" => core_id = Some(value),
            "cpu cores" => cores_per_package = value.parse::<usize>().ok().or(cores_per_package),
            _ => {}
        }
    }
    flush(&mut physical_id, &mut core_id);
    if !pairs.is_empty() {
        return Some(pairs.len());
    }
    cores_per_package
        .filter(|&c| c > 0)
        .map(|c| c * packages.len().max(1))
}

/// Value of the first `key : value` line in `/proc/cpuinfo` text.
fn cpuinfo_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key)
            .then(|| v.trim())
            .filter(|v| !v.is_empty())
    })
}

/// Vendor, model name and caches from CPUID.
#[cfg(target_arch = "x86_64")]
fn identify(cpuinfo: Option<&str>) -> (String, String, Vec<CacheInfo>) {
    let cpuid = raw_cpuid::CpuId::new();
    let vendor = cpuid
        .get_vendor_info()
        .map(|v| v.as_str().trim().to_string())
        .filter(|v| !v.is_empty())
        .or_else(|| {
            cpuinfo
                .and_then(|t| cpuinfo_field(t, "vendor_id"))
                .map(String::from)
        })
        .unwrap_or_else(|| "unknown".to_string());
    let model_name = cpuid
        .get_processor_brand_string()
        .map(|b| b.as_str().trim().to_string())
        .filter(|b| !b.is_empty())
        .or_else(|| {
            cpuinfo
                .and_then(|t| cpuinfo_field(t, "model name"))
                .map(String::from)
        })
        .unwrap_or_else(|| "unknown".to_string());
    (vendor, model_name, cpuid_caches(&cpuid))
}

/// Vendor and model name from `/proc/cpuinfo`; caches come from sysfs.
#[cfg(not(target_arch = "x86_64"))]
fn identify(cpuinfo: Option<&str>) -> (String, String, Vec<CacheInfo>) {
    let field = |keys: &[&str]| {
        cpuinfo
            .and_then(|t| keys.iter().find_map(|k| cpuinfo_field(t, k)))
            .map(String::from)
            .unwrap_or_else(|| "unknown".to_string())
    };
    let vendor = field(&["vendor_id", "CPU implementer"]);
    let model_name = field(&["model name", "Model", "Hardware", "cpu model"]);
    (vendor, model_name, Vec::new())
}

#[cfg(target_arch = "x86_64")]
fn cpuid_caches(cpuid: &raw_cpuid::CpuId<raw_cpuid::CpuIdReaderNative>) -> Vec<CacheInfo> {
    use raw_cpuid::CacheType;
    let mut caches = Vec::new();
    if let Some(params) = cpuid.get_cache_parameters() {
        for p in params {
            let kind = match p.cache_type() {
                CacheType::Data => "data",
                CacheType::Instruction => "instruction",
                CacheType::Unified => "unified",
                _ => continue,
            };
            let size = (p.associativity() as u64)
                .saturating_mul(p.physical_line_partitions() as u64)
                .saturating_mul(p.coherency_line_size() as u64)
                .saturating_mul(p.sets() as u64);
            if size == 0 || p.level() == 0 {
                continue;
            }
            caches.push(CacheInfo {
                level: p.level(),
                kind: kind.to_string(),
                size_bytes: size,
                shared_by: Some(p.max_cores_for_cache()),
            });
        }
    }
    if caches.is_empty() {
        // AMD's (and most hypervisors') extended leaves 0x8000_0005 / 0x8000_0006.
        if let Some(l1) = cpuid.get_l1_cache_and_tlb_info() {
            for (kind, kb) in [
                ("data", l1.dcache_size()),
                ("instruction", l1.icache_size()),
            ] {
                if kb > 0 {
                    caches.push(CacheInfo {
                        level: 1,
                        kind: kind.to_string(),
                        size_bytes: u64::from(kb) * 1024,
                        shared_by: None,
                    });
                }
            }
        }
        if let Some(l23) = cpuid.get_l2_l3_cache_and_tlb_info() {
            let l2 = u64::from(l23.l2cache_size()) * 1024;
            let l3 = u64::from(l23.l3cache_size()) * 512 * 1024;
            for (level, size) in [(2u8, l2), (3u8, l3)] {
                if size > 0 {
                    caches.push(CacheInfo {
                        level,
                        kind: "unified".to_string(),
                        size_bytes: size,
                        shared_by: None,
                    });
                }
            }
        }
    }
    caches.sort_by(|a, b| (a.level, &a.kind).cmp(&(b.level, &b.kind)));
    caches
}

/// Caches from `/sys/devices/system/cpu/cpu0/cache` (Linux, any architecture).
fn sysfs_caches() -> Vec<CacheInfo> {
    let mut caches = Vec::new();
    for index in 0..16 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{index}");
        let Some(level) = read_text(&format!("{dir}/level")) else {
            break;
        };
        let level = level.trim().parse::<u8>().ok();
        let kind = read_text(&format!("{dir}/type")).map(|t| t.trim().to_ascii_lowercase());
        let size = read_text(&format!("{dir}/size")).and_then(|s| parse_size(&s));
        let shared_by =
            read_text(&format!("{dir}/shared_cpu_list")).and_then(|s| count_cpu_list(&s));
        if let (Some(level), Some(kind), Some(size)) = (level, kind, size) {
            if ["data", "instruction", "unified"].contains(&kind.as_str()) && size > 0 {
                caches.push(CacheInfo {
                    level,
                    kind,
                    size_bytes: size,
                    shared_by,
                });
            }
        }
    }
    caches.sort_by(|a, b| (a.level, &a.kind).cmp(&(b.level, &b.kind)));
    caches
}

/// Parses sysfs sizes like `48K`, `2048K`, `32M`.
fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (digits, scale) = match t.chars().last()? {
        'K' | 'k' => (&t[..t.len() - 1], 1024),
        'M' | 'm' => (&t[..t.len() - 1], 1024 * 1024),
        'G' | 'g' => (&t[..t.len() - 1], 1024 * 1024 * 1024),
        _ => (t, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(scale)
}

/// Counts the CPUs in a list like `0-3,8-11,16`.
fn count_cpu_list(text: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.trim().parse().ok()?;
                let b: usize = b.trim().parse().ok()?;
                n += b.checked_sub(a)? + 1;
            }
            None => {
                part.trim().parse::<usize>().ok()?;
                n += 1;
            }
        }
    }
    (n > 0).then_some(n)
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> CpuFeatures {
    let cpuid = raw_cpuid::CpuId::new();
    let ext = cpuid.get_extended_feature_info();
    let avx512f = std::is_x86_feature_detected!("avx512f");
    // AMX needs kernel support for the tile state; Linux hides the `amx_*` flags in
    // /proc/cpuinfo when it is missing. Off Linux, trust CPUID.
    let os_flags = read_text("/proc/cpuinfo").and_then(|t| {
        cpuinfo_field(&t, "flags")
            .map(|f| f.split_whitespace().map(String::from).collect::<Vec<_>>())
    });
    let os_has = |flag: &str| {
        os_flags
            .as_ref()
            .is_none_or(|f| f.iter().any(|x| x == flag))
    };
    let amx_tile = ext.as_ref().is_some_and(|e| e.has_amx_tile()) && os_has("amx_tile");
    CpuFeatures {
        sse4_2: std::is_x86_feature_detected!("sse4.2"),
        avx: std::is_x86_feature_detected!("avx"),
        avx2: std::is_x86_feature_detected!("avx2"),
        fma: std::is_x86_feature_detected!("fma"),
        f16c: std::is_x86_feature_detected!("f16c"),
        avx512f,
        avx512bw: std::is_x86_feature_detected!("avx512bw"),
        avx512vl: std::is_x86_feature_detected!("avx512vl"),
        avx512_bf16: std::is_x86_feature_detected!("avx512bf16"),
        avx512_fp16: avx512f && ext.as_ref().is_some_and(|e| e.has_avx512_fp16()),
        avx512_vnni: std::is_x86_feature_detected!("avx512vnni"),
        amx_tile,
        amx_bf16: amx_tile && ext.as_ref().is_some_and(|e| e.has_amx_bf16()) && os_has("amx_bf16"),
        amx_int8: amx_tile && ext.as_ref().is_some_and(|e| e.has_amx_int8()) && os_has("amx_int8"),
        neon: false,
    }
}

#[cfg(target_arch = "aarch64")]
fn detect_features() -> CpuFeatures {
    CpuFeatures {
        neon: std::arch::is_aarch64_feature_detected!("neon"),
        ..CpuFeatures::default()
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect_features() -> CpuFeatures {
    CpuFeatures::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_detector_finds_one_cpu() {
        let devices = CpuDetector.detect().unwrap();
        assert_eq!(devices.len(), 1);
        let d = &devices[0];
        assert_eq!(d.kind, DeviceKind::Cpu);
        assert_eq!(d.index, 0);
        assert!(d.compute_units.unwrap() >= 1);
        assert_eq!(CpuDetector.kind(), DeviceKind::Cpu);
        let info = cpu_info();
        assert!(info.logical_cores >= 1);
        assert!(!info.vendor.is_empty());
        assert!(!info.model_name.is_empty());
        if let Some(p) = info.physical_cores {
            assert!(p >= 1);
        }
        for c in &info.caches {
            assert!((1..=4).contains(&c.level), "{c:?}");
            assert!(c.size_bytes > 0);
        }
    }

    #[test]
    fn features_are_consistent() {
        let f = cpu_info().features;
        if f.avx2 {
            assert!(f.avx);
        }
        if f.avx {
            assert!(f.sse4_2);
        }
        for sub in [
            f.avx512bw,
            f.avx512vl,
            f.avx512_bf16,
            f.avx512_fp16,
            f.avx512_vnni,
        ] {
            if sub {
                assert!(f.avx512f);
            }
        }
        if f.amx_bf16 || f.amx_int8 {
            assert!(f.amx_tile);
        }
        #[cfg(target_arch = "x86_64")]
        assert!(!f.neon);
        let names = f.names();
        assert_eq!(names.contains(&"avx2"), f.avx2);
        let device = &CpuDetector.detect().unwrap()[0];
        assert_eq!(device.has_feature("avx"), f.avx);
    }

    #[test]
    fn feature_names_are_in_order() {
        let f = CpuFeatures {
            avx: true,
            avx2: true,
            amx_int8: true,
            ..CpuFeatures::default()
        };
        assert_eq!(f.names(), vec!["avx", "avx2", "amx_int8"]);
        assert!(CpuFeatures::default().names().is_empty());
    }

    #[test]
    fn meminfo_parses_sample() {
        let sample = "MemTotal:       65742392 kB\nMemFree:        1234 kB\n\
                      MemAvailable:   50000000 kB\nBuffers:  1 kB\nHugePages_Total:       0\n";
        assert_eq!(
            parse_meminfo(sample),
            (Some(65742392 * 1024), Some(50000000 * 1024))
        );
        assert_eq!(parse_meminfo("garbage\nMemTotal: x kB\n"), (None, None));
        assert_eq!(parse_meminfo(""), (None, None));
    }

    #[test]
    fn physical_cores_parse_sample() {
        let two_packages = "processor\t: 0\nphysical id\t: 0\ncore id\t: 0\ncpu cores\t: 2\n\n\
                            processor\t: 1\nphysical id\t: 0\ncore id\t: 0\ncpu cores\t: 2\n\n\
                            processor\t: 2\nphysical id\t: 0\ncore id\t: 1\ncpu cores\t: 2\n\n\
                            processor\t: 3\nphysical id\t: 1\ncore id\t: 0\ncpu cores\t: 2\n";
        assert_eq!(parse_physical_cores(two_packages), Some(3));
        let only_counts = "processor: 0\ncpu cores: 4\n\nprocessor: 1\ncpu cores: 4\n";
        assert_eq!(parse_physical_cores(only_counts), Some(4));
        assert_eq!(parse_physical_cores("processor: 0\n"), None);
    }

    #[test]
    fn sysfs_helpers_parse() {
        assert_eq!(parse_size("48K\n"), Some(48 * 1024));
        assert_eq!(parse_size("32M"), Some(32 * 1024 * 1024));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(count_cpu_list("0-3,8-11,16\n"), Some(9));
        assert_eq!(count_cpu_list("5"), Some(1));
        assert_eq!(count_cpu_list("3-1"), None);
    }

    #[test]
    fn device_info_serde_round_trip() {
        let mut d = CpuDetector.detect().unwrap().remove(0);
        d.properties.insert("driver".into(), "535.1".into());
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(serde_json::from_str::<DeviceInfo>(&json).unwrap(), d);
        assert!(json.contains("\"kind\":\"cpu\""));
        let gpu = DeviceInfo {
            kind: DeviceKind::Cuda,
            index: 1,
            name: "NVIDIA H100".into(),
            memory_bytes: Some(80 << 30),
            compute_units: Some(132),
            arch: Some("sm_90".into()),
            features: vec!["fp8".into()],
            properties: BTreeMap::new(),
        };
        let json = serde_json::to_string(&gpu).unwrap();
        assert_eq!(serde_json::from_str::<DeviceInfo>(&json).unwrap(), gpu);
        let info = cpu_info();
        let json = serde_json::to_string(&info).unwrap();
        assert_eq!(serde_json::from_str::<CpuInfo>(&json).unwrap(), info);
    }

    #[test]
    fn device_kind_names() {
        for k in DeviceKind::ALL {
            assert_eq!(k.to_string(), k.name());
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.name()));
        }
    }
}
