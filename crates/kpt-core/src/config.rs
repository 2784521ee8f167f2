//! The framework configuration: one [`KptConfig`] with a section per subsystem.
//!
//! A configuration is built in layers by [`KptConfig::load_layered`]: built-in
//! defaults (which work on a CPU-only machine), then a TOML or JSON file, then
//! `KPT_*` environment variables. Unknown keys are errors at every layer, and
//! [`KptConfig::validate`] reports every problem at once, each with a fix hint.
//!
//! ```toml
//! [hardware]
//! backend = "cuda"
//! memory_fraction = 0.85
//!
//! [precision]
//! level = "aggressive"
//! compute_dtype = "bf16"
//! ```
//!
//! Environment variables are named `KPT_<SECTION>__<FIELD>` (a double underscore
//! between section and field), e.g. `KPT_HARDWARE__NUM_THREADS=4` or
//! `KPT_KERNEL__DISABLE=flash_attn,fused_mlp` for lists. The shorthands
//! `KPT_BACKEND`, `KPT_LEVEL` and `KPT_THREADS` set `hardware.backend`,
//! `precision.level` and `hardware.num_threads`; the long form wins when both are set.
//! A value of `none` (or an empty value) clears an optional field.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dtype::DType;
use crate::error::{ConfigIssue, KptError, Result};

/// Which backend executes kernels.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// The best backend available on this machine, falling back to the CPU.
    #[default]
    Auto,
    /// The host CPU.
    Cpu,
    /// NVIDIA GPUs through CUDA.
    Cuda,
    /// AMD GPUs through ROCm / HIP.
    Rocm,
    /// Google TPUs through a PJRT plugin.
    Tpu,
}

impl BackendChoice {
    /// Every choice, in a stable order.
    pub const ALL: [BackendChoice; 5] = [
        BackendChoice::Auto,
        BackendChoice::Cpu,
        BackendChoice::Cuda,
        BackendChoice::Rocm,
        BackendChoice::Tpu,
    ];

    /// Lower-case name, as used in configuration files.
    pub const fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
            BackendChoice::Rocm => "rocm",
            BackendChoice::Tpu => "tpu",
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendChoice {
    type Err = KptError;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let choice = match lower.as_str() {
            "auto" => BackendChoice::Auto,
            "cpu" => BackendChoice::Cpu,
            "cuda" | "nvidia" => BackendChoice::Cuda,
            "rocm" | "hip" | "amd" => BackendChoice::Rocm,
            "tpu" | "xla" => BackendChoice::Tpu,
            _ => {
                return Err(KptError::InvalidArgument(format!(
                    "unknown backend `{s}`; expected one of auto, cpu, cuda, rocm, tpu"
                )))
            }
        };
        Ok(choice)
    }
}

/// How aggressively the optimizer trades accuracy for speed.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum OptLevel {
    /// Keep the model's precision; only exact rewrites (fusion, layout).
    Conservative,
    /// Reduced precision where it is known to be safe (bf16/f16, fp8 on capable hardware).
    #[default]
    Balanced,
    /// Lowest precision the hardware supports (fp8, int8), within the validator's tolerance.
    Aggressive,
}

impl OptLevel {
    /// Every level, from most to least conservative.
    pub const ALL: [OptLevel; 3] = [
        OptLevel::Conservative,
        OptLevel::Balanced,
        OptLevel::Aggressive,
    ];

    /// Lower-case name, as used in configuration files.
    pub const fn name(self) -> &'static str {
        match self {
            OptLevel::Conservative => "conservative",
            OptLevel::Balanced => "balanced",
            OptLevel::Aggressive => "aggressive",
        }
    }
}

impl fmt::Display for OptLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OptLevel {
    type Err = KptError;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        OptLevel::ALL
            .into_iter()
            .find(|l| l.name() == lower)
            .ok_or_else(|| {
                KptError::InvalidArgument(format!(
                    "unknown optimization level `{s}`; expected one of conservative, balanced, aggressive"
                ))
            })
    }
}

/// Which hardware to run on and how much of it to use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HardwareConfig {
    /// Backend to execute on; `auto` picks the best one available.
    pub backend: BackendChoice,
    /// Index of the accelerator to use (0 for the CPU).
    pub device_id: usize,
    /// CPU worker threads; `None` uses every available core.
    pub num_threads: Option<usize>,
    /// Fraction of device memory kpt may allocate, in (0, 1].
    pub memory_fraction: f32,
    /// Prefer deterministic kernels (fixed reduction order) over faster ones.
    pub deterministic: bool,
}

impl Default for HardwareConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            device_id: 0,
            num_threads: None,
            memory_fraction: 0.9,
            deterministic: false,
        }
    }
}

/// NVIDIA GPU (CUDA) settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NvidiaConfig {
    /// Whether the CUDA backend may be used.
    pub enabled: bool,
    /// Lowest compute capability to use, as `"major.minor"` (e.g. `"8.0"`).
    pub min_compute_capability: String,
    /// Allow TF32 tensor-core math for f32 matmuls.
    pub allow_tf32: bool,
}

impl Default for NvidiaConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            min_compute_capability: "7.0".to_string(),
            allow_tf32: false,
        }
    }
}

impl NvidiaConfig {
    /// `min_compute_capability` as `(major, minor)`, or `None` when malformed.
    pub fn compute_capability(&self) -> Option<(u32, u32)> {
        parse_compute_capability(&self.min_compute_capability)
    }
}

/// The TPU generations kpt knows.
pub const TPU_VERSIONS: [&str; 4] = ["v4", "v5e", "v5p", "v6e"];

/// Google TPU settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TpuConfig {
    /// Whether the TPU backend may be used.
    pub enabled: bool,
    /// Path of the PJRT plugin (`libtpu.so`); `None` searches the usual places.
    pub plugin_path: Option<PathBuf>,
    /// Slice topology such as `"2x2x1"`; `None` uses the whole slice.
    pub topology: Option<String>,
    /// TPU generation (`v4`, `v5e`, `v5p`, `v6e`); `None` detects it.
    pub version: Option<String>,
}

impl Default for TpuConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            plugin_path: None,
            topology: None,
            version: None,
        }
    }
}

impl TpuConfig {
    /// `topology` as its dimensions, or `None` when unset or malformed.
    pub fn topology_dims(&self) -> Option<Vec<usize>> {
        self.topology.as_deref().and_then(parse_topology)
    }
}

/// AMD GPU (ROCm / HIP) settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmdConfig {
    /// Whether the ROCm backend may be used.
    pub enabled: bool,
    /// GPU architecture such as `"gfx942"`; `None` detects it.
    pub gfx_arch: Option<String>,
    /// Use hipBLASLt for matmuls.
    pub use_hipblaslt: bool,
    /// Directory with precompiled kernels (code objects); `None` uses the built-in ones.
    pub kernel_dir: Option<PathBuf>,
}

impl Default for AmdConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            gfx_arch: None,
            use_hipblaslt: true,
            kernel_dir: None,
        }
    }
}

/// Kernel selection and autotuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KernelConfig {
    /// Time the candidate algorithms of each GEMM problem on its first use and keep the
    /// fastest (cuBLASLt on CUDA); `false` takes the library heuristic's first.
    pub autotune: bool,
    /// File of the autotuner's picks, read at start and written on each new pick, so
    /// that later processes run the same algorithms without timing them again (and
    /// round alike); `None` keeps them in memory only.
    pub autotune_cache: Option<PathBuf>,
    /// Timed calls per candidate in the autotuner's first round (at least 1); its fastest
    /// four are timed again over about 2 ms each.
    pub autotune_iters: usize,
    /// Untimed calls per candidate before its timed ones.
    pub autotune_warmup: usize,
    /// Kernel names to prefer over the default choice when they apply.
    pub prefer: Vec<String>,
    /// Kernel names never to use.
    pub disable: Vec<String>,
    /// Query rows per attention tile (power of two, 8..=512).
    pub attention_block_q: usize,
    /// Key/value rows per attention tile (power of two, 8..=512).
    pub attention_block_kv: usize,
}

impl Default for KernelConfig {
    fn default() -> Self {
        Self {
            autotune: true,
            autotune_cache: None,
            autotune_iters: 3,
            autotune_warmup: 1,
            prefer: Vec::new(),
            disable: Vec::new(),
            attention_block_q: 64,
            attention_block_kv: 256,
        }
    }
}

/// Numeric precision policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionConfig {
    /// Optimization level.
    pub level: OptLevel,
    /// Dtype of activations and accumulation (f64, f32, f16 or bf16).
    pub compute_dtype: DType,
    /// Dtype weights are stored in (a float or i8) at the balanced and aggressive levels;
    /// `None` lets `level` choose. The conservative level keeps f32 weights.
    pub weight_dtype: Option<DType>,
    /// Dtype of the attention KV cache (a float or i8); `None` uses `compute_dtype`.
    pub kv_cache_dtype: Option<DType>,
    /// Dtype f32 activations compute in at the balanced and aggressive levels (f32,
    /// bf16 or f16); `None` takes the device's default: bf16 on GPUs, f32 on the CPU.
    /// The KV cache of a converted graph follows it.
    pub activation_dtype: Option<DType>,
    /// Whether FP8 (e4m3 / e5m2) may be used.
    pub allow_fp8: bool,
    /// Whether int8 quantization may be used.
    pub allow_int8: bool,
    /// Multiplier on the validator's per-dtype error tolerances (> 0).
    pub tolerance_scale: f64,
}

impl Default for PrecisionConfig {
    fn default() -> Self {
        Self {
            level: OptLevel::Balanced,
            compute_dtype: DType::F32,
            weight_dtype: None,
            kv_cache_dtype: None,
            activation_dtype: None,
            allow_fp8: true,
            allow_int8: true,
            tolerance_scale: 1.0,
        }
    }
}

/// Performance monitoring and regression detection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorConfig {
    /// Whether metrics are collected and served.
    pub enabled: bool,
    /// Port of the Prometheus metrics endpoint.
    pub metrics_port: u16,
    /// Database file holding benchmark history.
    pub history_db: PathBuf,
    /// Interval between metric samples, in milliseconds (at least 1).
    pub sample_interval_ms: u64,
    /// Relative slowdown reported as a minor regression, in (0, 1).
    pub regression_threshold_minor: f64,
    /// Relative slowdown reported as a major regression, in (0, 1).
    pub regression_threshold_major: f64,
    /// Relative slowdown reported as a critical regression, in (0, 1).
    pub regression_threshold_critical: f64,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            metrics_port: 9090,
            history_db: PathBuf::from("kpt-history.sqlite"),
            sample_interval_ms: 1000,
            regression_threshold_minor: 0.05,
            regression_threshold_major: 0.15,
            regression_threshold_critical: 0.30,
        }
    }
}

/// Serving and export settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeployConfig {
    /// Address the server binds to.
    pub host: String,
    /// Port the server listens on (not 0).
    pub port: u16,
    /// Largest number of requests batched together (at least 1).
    pub max_batch_size: usize,
    /// How long to wait for a batch to fill, in milliseconds.
    pub batch_timeout_ms: u64,
    /// Longest sequence (prompt plus generated tokens) served (at least 1).
    pub max_seq_len: usize,
    /// Directory exported models are written to.
    pub export_dir: PathBuf,
}

impl Default for DeployConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_string(),
            port: 8000,
            max_batch_size: 32,
            batch_timeout_ms: 10,
            max_seq_len: 4096,
            export_dir: PathBuf::from("kpt-export"),
        }
    }
}

/// The whole kpt configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KptConfig {
    /// Backend and resource selection.
    pub hardware: HardwareConfig,
    /// NVIDIA GPU settings.
    pub nvidia: NvidiaConfig,
    /// Google TPU settings.
    pub tpu: TpuConfig,
    /// AMD GPU settings.
    pub amd: AmdConfig,
    /// Kernel selection and autotuning.
    pub kernel: KernelConfig,
    /// Numeric precision policy.
    pub precision: PrecisionConfig,
    /// Monitoring and regression detection.
    pub monitor: MonitorConfig,
    /// Serving and export.
    pub deploy: DeployConfig,
}

/// File formats a configuration can be stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Toml,
    Json,
}

impl Format {
    fn of(path: &Path) -> Result<Self> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("toml") => Ok(Format::Toml),
            Some("json") => Ok(Format::Json),
            other => Err(KptError::ConfigParse {
                source_name: path.display().to_string(),
                message: format!(
                    "unsupported configuration format ({}); use a file ending in `.toml` or `.json`",
                    match other {
                        Some(ext) => format!("extension `.{ext}`"),
                        None => "no file extension".to_string(),
                    }
                ),
            }),
        }
    }
}

fn parse_error(source_name: impl Into<String>, message: impl fmt::Display) -> KptError {
    KptError::ConfigParse {
        source_name: source_name.into(),
        message: message.to_string(),
    }
}

fn serialize_error(format: &str, e: impl fmt::Display) -> KptError {
    KptError::InvalidArgument(format!("cannot write configuration as {format}: {e}"))
}

impl KptConfig {
    /// Parses a TOML document; missing keys keep their defaults.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        Self::parse(text, Format::Toml, "TOML input")
    }

    /// Parses a JSON document; missing keys keep their defaults.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::parse(text, Format::Json, "JSON input")
    }

    fn parse(text: &str, format: Format, source_name: &str) -> Result<Self> {
        match format {
            Format::Toml => toml::from_str(text).map_err(|e| parse_error(source_name, e)),
            Format::Json => serde_json::from_str(text).map_err(|e| parse_error(source_name, e)),
        }
    }

    /// Serializes to TOML (every field, optional ones only when set).
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| serialize_error("TOML", e))
    }

    /// Serializes to pretty-printed JSON (unset optional fields are `null`).
    pub fn to_json_string(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| serialize_error("JSON", e))
    }

    /// Reads a `.toml` or `.json` file (chosen by extension).
    pub fn load(path: &Path) -> Result<Self> {
        let format = Format::of(path)?;
        let text = std::fs::read_to_string(path).map_err(|e| KptError::io(path, e))?;
        Self::parse(&text, format, &path.display().to_string())
    }

    /// Writes a `.toml` or `.json` file (chosen by extension), replacing it if present.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = match Format::of(path)? {
            Format::Toml => self.to_toml_string()?,
            Format::Json => self.to_json_string()?,
        };
        std::fs::write(path, text).map_err(|e| KptError::io(path, e))
    }

    /// Defaults, then `path` if given, then the `KPT_*` environment variables.
    ///
    /// The result is not validated; call [`KptConfig::validate`].
    pub fn load_layered(path: Option<&Path>) -> Result<Self> {
        let mut config = Self::load_file_layer(path)?;
        config.apply_env()?;
        Ok(config)
    }

    /// [`KptConfig::load_layered`] with the given variables instead of the process environment.
    pub fn load_layered_from<I, K, V>(path: Option<&Path>, vars: I) -> Result<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut config = Self::load_file_layer(path)?;
        config.apply_env_from(vars)?;
        Ok(config)
    }

    fn load_file_layer(path: Option<&Path>) -> Result<Self> {
        match path {
            Some(path) => Self::load(path),
            None => Ok(Self::default()),
        }
    }

    /// Applies the `KPT_*` variables of the process environment (see the module docs).
    pub fn apply_env(&mut self) -> Result<()> {
        let mut vars = Vec::new();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str() else {
                continue;
            };
            if env_target(name).is_none() {
                continue;
            }
            match value.into_string() {
                Ok(value) => vars.push((name.to_string(), value)),
                Err(_) => {
                    return Err(parse_error(
                        format!("environment variable {name}"),
                        "value is not valid UTF-8",
                    ))
                }
            }
        }
        self.apply_env_from(vars)
    }

    /// Applies `KPT_*` overrides from `vars` (name, value); other names are ignored.
    ///
    /// Shorthands (`KPT_BACKEND`, `KPT_LEVEL`, `KPT_THREADS`) are applied before the
    /// `KPT_<SECTION>__<FIELD>` forms. On error `self` is left unchanged.
    pub fn apply_env_from<I, K, V>(&mut self, vars: I) -> Result<()>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut overrides: Vec<(u8, String, Vec<String>, String)> = vars
            .into_iter()
            .filter_map(|(name, value)| {
                let name = name.as_ref();
                env_target(name)
                    .map(|(rank, path)| (rank, name.to_string(), path, value.as_ref().to_string()))
            })
            .collect();
        if overrides.is_empty() {
            return Ok(());
        }
        overrides.sort();
        let mut tree = serde_json::to_value(&*self).map_err(|e| serialize_error("JSON", e))?;
        let mut config = None;
        for (_, name, path, raw) in &overrides {
            config = Some(apply_override(&mut tree, name, path, raw)?);
        }
        if let Some(config) = config {
            *self = config;
        }
        Ok(())
    }

    /// Checks every field; `Err(KptError::InvalidConfig)` lists all problems found.
    pub fn validate(&self) -> Result<()> {
        let issues = self.issues();
        if issues.is_empty() {
            Ok(())
        } else {
            Err(KptError::InvalidConfig(issues))
        }
    }

    /// Every problem in this configuration, in section order; empty when valid.
    pub fn issues(&self) -> Vec<ConfigIssue> {
        let mut out = Vec::new();
        self.hardware_issues(&mut out);
        self.nvidia_issues(&mut out);
        self.tpu_issues(&mut out);
        self.amd_issues(&mut out);
        self.kernel_issues(&mut out);
        self.precision_issues(&mut out);
        self.monitor_issues(&mut out);
        self.deploy_issues(&mut out);
        out
    }

    fn hardware_issues(&self, out: &mut Vec<ConfigIssue>) {
        let hw = &self.hardware;
        if !(hw.memory_fraction > 0.0 && hw.memory_fraction <= 1.0) {
            out.push(issue(
                "hardware.memory_fraction",
                format!("must be in (0, 1], got {}", hw.memory_fraction),
                "use a fraction of device memory such as 0.9",
            ));
        }
        if hw.num_threads == Some(0) {
            out.push(issue(
                "hardware.num_threads",
                "must be at least 1",
                "leave it unset to use every core",
            ));
        }
        if hw.backend == BackendChoice::Cpu && hw.device_id != 0 {
            out.push(issue(
                "hardware.device_id",
                format!("the CPU backend has only device 0, got {}", hw.device_id),
                "set device_id = 0 or choose an accelerator backend",
            ));
        }
        let disabled = match hw.backend {
            BackendChoice::Cuda if !self.nvidia.enabled => Some("nvidia"),
            BackendChoice::Rocm if !self.amd.enabled => Some("amd"),
            BackendChoice::Tpu if !self.tpu.enabled => Some("tpu"),
            _ => None,
        };
        if let Some(section) = disabled {
            out.push(issue(
                "hardware.backend",
                format!("backend is `{}` but {section}.enabled is false", hw.backend),
                format!("set {section}.enabled = true, or choose another backend (e.g. `auto`)"),
            ));
        }
    }

    fn nvidia_issues(&self, out: &mut Vec<ConfigIssue>) {
        let nv = &self.nvidia;
        if nv.compute_capability().is_none() {
            out.push(issue(
                "nvidia.min_compute_capability",
                format!(
                    "`{}` is not a compute capability of the form major.minor",
                    nv.min_compute_capability
                ),
                "write it like \"8.0\" (A100) or \"9.0\" (H100)",
            ));
        }
    }

    fn tpu_issues(&self, out: &mut Vec<ConfigIssue>) {
        let tpu = &self.tpu;
        check_path(out, "tpu.plugin_path", tpu.plugin_path.as_deref());
        if let Some(topology) = &tpu.topology {
            if parse_topology(topology).is_none() {
                out.push(issue(
                    "tpu.topology",
                    format!("`{topology}` is not a topology of 2 or 3 positive dimensions"),
                    "write it like \"2x2\" or \"2x2x1\", or leave it unset to use the whole slice",
                ));
            }
        }
        if let Some(version) = &tpu.version {
            if !TPU_VERSIONS.contains(&version.as_str()) {
                out.push(issue(
                    "tpu.version",
                    format!("unknown TPU version `{version}`"),
                    format!(
                        "use one of {}, or leave it unset to detect it",
                        TPU_VERSIONS.join(", ")
                    ),
                ));
            }
        }
    }

    fn amd_issues(&self, out: &mut Vec<ConfigIssue>) {
        let amd = &self.amd;
        if let Some(arch) = &amd.gfx_arch {
            if !is_gfx_arch(arch) {
                out.push(issue(
                    "amd.gfx_arch",
                    format!("`{arch}` is not an AMD GPU architecture name"),
                    "write it like \"gfx90a\", \"gfx942\" or \"gfx1100\" (see `rocminfo`), or leave it unset",
                ));
            }
        }
        check_path(out, "amd.kernel_dir", amd.kernel_dir.as_deref());
    }

    fn kernel_issues(&self, out: &mut Vec<ConfigIssue>) {
        let k = &self.kernel;
        check_path(out, "kernel.autotune_cache", k.autotune_cache.as_deref());
        if k.autotune_iters == 0 {
            out.push(issue(
                "kernel.autotune_iters",
                "must be at least 1",
                "use 3 or more (the fastest candidates are timed again), or set autotune = false",
            ));
        }
        for (field, value) in [
            ("kernel.attention_block_q", k.attention_block_q),
            ("kernel.attention_block_kv", k.attention_block_kv),
        ] {
            if !(value.is_power_of_two() && (8..=512).contains(&value)) {
                out.push(issue(
                    field,
                    format!("must be a power of two in 8..=512, got {value}"),
                    "use 32, 64 or 128",
                ));
            }
        }
        for (field, list) in [("kernel.prefer", &k.prefer), ("kernel.disable", &k.disable)] {
            for (i, name) in list.iter().enumerate() {
                if name.trim().is_empty() {
                    out.push(issue(
                        format!("{field}[{i}]"),
                        "kernel name is empty",
                        "remove the entry; `kpt kernels` lists the kernel names",
                    ));
                }
            }
        }
        for name in k.prefer.iter().filter(|n| !n.trim().is_empty()) {
            if k.disable.contains(name) {
                out.push(issue(
                    "kernel.disable",
                    format!("kernel `{name}` is both preferred and disabled"),
                    "remove it from one of kernel.prefer and kernel.disable",
                ));
            }
        }
    }

    fn precision_issues(&self, out: &mut Vec<ConfigIssue>) {
        let p = &self.precision;
        let c = p.compute_dtype;
        if !c.is_float() || c.is_quantized() {
            out.push(issue(
                "precision.compute_dtype",
                format!("`{c}` cannot be a compute dtype; it must be f64, f32, f16 or bf16"),
                "use f32, or bf16 / f16 for speed; fp8 and int8 are set through weight_dtype",
            ));
        }
        if let Some(a) = p.activation_dtype {
            if !matches!(a, DType::F32 | DType::BF16 | DType::F16) {
                out.push(issue(
                    "precision.activation_dtype",
                    format!("`{a}` cannot be an activation dtype; it must be f32, bf16 or f16"),
                    "use bf16 (or f16) for reduced-precision activations, f32 to keep them, \
                     or leave it unset for the device's default",
                ));
            }
        }
        for (field, dtype) in [
            ("precision.weight_dtype", p.weight_dtype),
            ("precision.kv_cache_dtype", p.kv_cache_dtype),
        ] {
            let Some(d) = dtype else {
                continue;
            };
            if !(d.is_float() || d == DType::I8) {
                out.push(issue(
                    field,
                    format!("`{d}` is not a storage dtype; it must be a float type or i8"),
                    "use bf16, f16, f8e4m3 or i8, or leave it unset",
                ));
            } else if matches!(d, DType::F8E4M3 | DType::F8E5M2) && !p.allow_fp8 {
                out.push(issue(
                    field,
                    format!("`{d}` is FP8 but precision.allow_fp8 is false"),
                    "set precision.allow_fp8 = true or choose a non-FP8 dtype",
                ));
            } else if d == DType::I8 && !p.allow_int8 {
                out.push(issue(
                    field,
                    "`i8` requires precision.allow_int8 = true",
                    "set precision.allow_int8 = true or choose a float dtype",
                ));
            }
        }
        if !(p.tolerance_scale > 0.0 && p.tolerance_scale.is_finite()) {
            out.push(issue(
                "precision.tolerance_scale",
                format!("must be a finite number > 0, got {}", p.tolerance_scale),
                "use 1.0 for the default tolerances, larger to loosen them",
            ));
        }
    }

    fn monitor_issues(&self, out: &mut Vec<ConfigIssue>) {
        let m = &self.monitor;
        if m.enabled && m.metrics_port == 0 {
            out.push(issue(
                "monitor.metrics_port",
                "port 0 is not allowed while monitoring is enabled",
                "use a free port such as 9090",
            ));
        }
        if m.enabled && m.metrics_port != 0 && m.metrics_port == self.deploy.port {
            out.push(issue(
                "monitor.metrics_port",
                format!("port {} is also deploy.port", m.metrics_port),
                "give the metrics endpoint and the server different ports",
            ));
        }
        if m.history_db.as_os_str().is_empty() {
            out.push(issue(
                "monitor.history_db",
                "path is empty",
                "use a file name such as \"kpt-history.sqlite\"",
            ));
        }
        if m.sample_interval_ms == 0 {
            out.push(issue(
                "monitor.sample_interval_ms",
                "must be at least 1",
                "use 1000 for one sample per second",
            ));
        }
        let thresholds = [
            (
                "monitor.regression_threshold_minor",
                m.regression_threshold_minor,
            ),
            (
                "monitor.regression_threshold_major",
                m.regression_threshold_major,
            ),
            (
                "monitor.regression_threshold_critical",
                m.regression_threshold_critical,
            ),
        ];
        let mut in_range = true;
        for (field, t) in thresholds {
            if !(t > 0.0 && t < 1.0) {
                in_range = false;
                out.push(issue(
                    field,
                    format!("must be a fraction in (0, 1), got {t}"),
                    "write a relative slowdown, e.g. 0.15 for 15%",
                ));
            }
        }
        if in_range {
            for pair in thresholds.windows(2) {
                let ((lower_name, lower), (field, value)) = (pair[0], pair[1]);
                if value <= lower {
                    out.push(issue(
                        field,
                        format!("must be greater than {lower_name} ({lower}), got {value}"),
                        "order the thresholds minor < major < critical (defaults 0.05, 0.15, 0.30)",
                    ));
                }
            }
        }
    }

    fn deploy_issues(&self, out: &mut Vec<ConfigIssue>) {
        let d = &self.deploy;
        if d.host.trim().is_empty() || d.host.chars().any(char::is_whitespace) {
            out.push(issue(
                "deploy.host",
                format!("`{}` is not a host name or address", d.host),
                "use \"127.0.0.1\" for local access or \"0.0.0.0\" for all interfaces",
            ));
        }
        if d.port == 0 {
            out.push(issue(
                "deploy.port",
                "port must not be 0",
                "use a free port such as 8000",
            ));
        }
        if d.max_batch_size == 0 {
            out.push(issue(
                "deploy.max_batch_size",
                "must be at least 1",
                "use 1 to disable batching",
            ));
        }
        if d.max_seq_len == 0 {
            out.push(issue(
                "deploy.max_seq_len",
                "must be at least 1",
                "use the model's context length, e.g. 4096",
            ));
        }
        if d.export_dir.as_os_str().is_empty() {
            out.push(issue(
                "deploy.export_dir",
                "path is empty",
                "use a directory such as \"kpt-export\"",
            ));
        }
    }
}

fn issue(
    field: impl Into<String>,
    message: impl Into<String>,
    hint: impl Into<String>,
) -> ConfigIssue {
    ConfigIssue {
        field: field.into(),
        message: message.into(),
        hint: hint.into(),
    }
}

fn check_path(out: &mut Vec<ConfigIssue>, field: &str, path: Option<&Path>) {
    if path.is_some_and(|p| p.as_os_str().is_empty()) {
        out.push(issue(
            field,
            "path is empty",
            "give a path or leave the field unset",
        ));
    }
}

/// Parses `"major.minor"` with a one-digit minor, e.g. `"8.0"`, `"12.0"`.
fn parse_compute_capability(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.trim().split_once('.')?;
    let all_digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(major) || !all_digits(minor) || minor.len() != 1 || major.len() > 3 {
        return None;
    }
    let major: u32 = major.parse().ok()?;
    let minor: u32 = minor.parse().ok()?;
    (major >= 1).then_some((major, minor))
}

/// Parses `"AxB"` or `"AxBxC"` with positive dimensions.
fn parse_topology(s: &str) -> Option<Vec<usize>> {
    let dims = s
        .split('x')
        .map(|d| {
            if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            d.parse::<usize>().ok().filter(|&n| n > 0)
        })
        .collect::<Option<Vec<_>>>()?;
    (2..=3).contains(&dims.len()).then_some(dims)
}

/// `gfx` followed by a digit and lower-case letters, digits or `-` (e.g. `gfx90a`, `gfx9-generic`).
fn is_gfx_arch(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("gfx") else {
        return false;
    };
    rest.starts_with(|c: char| c.is_ascii_digit())
        && rest
            .chars()
            .all(|c| c.is_ascii_digit() || c.is_ascii_lowercase() || c == '-')
}

/// Maps an environment variable name to (rank, field path); `None` if kpt ignores it.
/// Shorthands have rank 0 so that the long forms (rank 1) override them.
fn env_target(name: &str) -> Option<(u8, Vec<String>)> {
    let rest = name.strip_prefix("KPT_")?;
    let shorthand = match rest.to_ascii_uppercase().as_str() {
        "BACKEND" => Some(["hardware", "backend"]),
        "LEVEL" => Some(["precision", "level"]),
        "THREADS" => Some(["hardware", "num_threads"]),
        _ => None,
    };
    if let Some(path) = shorthand {
        return Some((0, path.iter().map(|s| s.to_string()).collect()));
    }
    rest.contains("__").then(|| {
        (
            1,
            rest.split("__").map(|s| s.to_ascii_lowercase()).collect(),
        )
    })
}

/// Sets `path` in `tree` from the raw string `raw`, typed after the current value, and
/// returns the resulting configuration. `tree` is unchanged on error.
fn apply_override(tree: &mut Value, name: &str, path: &[String], raw: &str) -> Result<KptConfig> {
    let source = || format!("environment variable {name}");
    let [section, field] = path else {
        return Err(parse_error(
            source(),
            "expected KPT_<SECTION>__<FIELD> with one double underscore, e.g. KPT_HARDWARE__NUM_THREADS",
        ));
    };
    let Some(sections) = tree.as_object() else {
        return Err(parse_error(source(), "configuration is not a table"));
    };
    let Some(fields) = sections.get(section).and_then(Value::as_object) else {
        let known: Vec<&str> = sections.keys().map(String::as_str).collect();
        return Err(parse_error(
            source(),
            format!(
                "unknown section `{section}`; known sections: {}",
                known.join(", ")
            ),
        ));
    };
    let Some(current) = fields.get(field) else {
        let known: Vec<&str> = fields.keys().map(String::as_str).collect();
        return Err(parse_error(
            source(),
            format!(
                "unknown field `{field}` in section `{section}`; known fields: {}",
                known.join(", ")
            ),
        ));
    };
    let candidates = env_candidates(current, raw).map_err(|m| {
        parse_error(
            source(),
            format!("invalid value for {section}.{field}: {m}"),
        )
    })?;
    let mut first_error = None;
    for candidate in candidates {
        let mut next = tree.clone();
        if let Some(slot) = next
            .get_mut(section.as_str())
            .and_then(|s| s.get_mut(field.as_str()))
        {
            *slot = candidate;
        }
        match serde_json::from_value::<KptConfig>(next.clone()) {
            Ok(config) => {
                *tree = next;
                return Ok(config);
            }
            Err(e) => {
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    Err(parse_error(
        source(),
        format!(
            "invalid value `{raw}` for {section}.{field}: {}",
            first_error.unwrap_or_else(|| "no interpretation fits".to_string())
        ),
    ))
}

/// JSON values `raw` may stand for, given the field's current value, best guess first.
fn env_candidates(current: &Value, raw: &str) -> std::result::Result<Vec<Value>, String> {
    let trimmed = raw.trim();
    let is_none = trimmed.is_empty()
        || trimmed.eq_ignore_ascii_case("none")
        || trimmed.eq_ignore_ascii_case("null");
    let strings = || {
        let mut v = vec![Value::String(trimmed.to_string())];
        let lower = trimmed.to_ascii_lowercase();
        if lower != trimmed {
            v.push(Value::String(lower));
        }
        v
    };
    match current {
        // A set optional number (e.g. `num_threads = 4`) can be cleared with `none`.
        Value::Bool(_) | Value::Number(_) if is_none => Ok(vec![Value::Null]),
        Value::Bool(_) => parse_bool(trimmed)
            .map(|b| vec![Value::Bool(b)])
            .ok_or_else(|| {
                format!("expected a boolean (true/false, 1/0, yes/no, on/off), got `{raw}`")
            }),
        Value::Number(_) => parse_number(trimmed)
            .map(|n| vec![n])
            .ok_or_else(|| format!("expected a number, got `{raw}`")),
        Value::String(_) => {
            let mut v = Vec::new();
            if is_none {
                v.push(Value::Null);
            }
            v.extend(strings());
            Ok(v)
        }
        Value::Array(_) => Ok(vec![Value::Array(
            trimmed
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| Value::String(s.to_string()))
                .collect(),
        )]),
        Value::Null => {
            if is_none {
                return Ok(vec![Value::Null]);
            }
            let mut v = strings();
            if let Some(b) = parse_bool(trimmed) {
                v.push(Value::Bool(b));
            }
            if let Some(n) = parse_number(trimmed) {
                v.push(n);
            }
            Ok(v)
        }
        Value::Object(_) => Err("is a section, not a field".to_string()),
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn parse_number(s: &str) -> Option<Value> {
    if let Ok(u) = s.parse::<u64>() {
        return Some(Value::from(u));
    }
    if let Ok(i) = s.parse::<i64>() {
        return Some(Value::from(i));
    }
    let f = s.parse::<f64>().ok().filter(|f| f.is_finite())?;
    serde_json::Number::from_f64(f).map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(c: &KptConfig) -> Vec<String> {
        c.issues().into_iter().map(|i| i.field).collect()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_are_valid() {
        let c = KptConfig::default();
        assert_eq!(c.issues(), vec![]);
        c.validate().unwrap();
        assert_eq!(c.hardware.backend, BackendChoice::Auto);
        assert_eq!(c.precision.level, OptLevel::Balanced);
        assert_eq!(c.precision.compute_dtype, DType::F32);
        assert_eq!(c.nvidia.compute_capability(), Some((7, 0)));
    }

    #[test]
    fn opt_level_and_backend_names() {
        for l in OptLevel::ALL {
            assert_eq!(l.name().parse::<OptLevel>().unwrap(), l);
            assert_eq!(l.to_string(), l.name());
            assert_eq!(serde_json::to_string(&l).unwrap(), format!("\"{l}\""));
        }
        assert_eq!(
            "Aggressive".parse::<OptLevel>().unwrap(),
            OptLevel::Aggressive
        );
        assert!(matches!(
            "fast".parse::<OptLevel>(),
            Err(KptError::InvalidArgument(_))
        ));
        for b in BackendChoice::ALL {
            assert_eq!(b.name().parse::<BackendChoice>().unwrap(), b);
            assert_eq!(serde_json::to_string(&b).unwrap(), format!("\"{b}\""));
        }
        assert_eq!("HIP".parse::<BackendChoice>().unwrap(), BackendChoice::Rocm);
        assert!("metal".parse::<BackendChoice>().is_err());
        assert!(OptLevel::Conservative < OptLevel::Aggressive);
    }

    #[test]
    fn helpers_parse() {
        assert_eq!(parse_compute_capability("8.0"), Some((8, 0)));
        assert_eq!(parse_compute_capability("12.1"), Some((12, 1)));
        for bad in ["8", "8.", ".0", "8.10", "a.b", "0.5", "-8.0", "8.0.1", ""] {
            assert_eq!(parse_compute_capability(bad), None, "{bad}");
        }
        assert_eq!(parse_topology("2x2x1"), Some(vec![2, 2, 1]));
        assert_eq!(parse_topology("4x8"), Some(vec![4, 8]));
        for bad in ["2", "2x0", "2x2x2x2", "2X2", "x2", "2x-1", "2x+1", ""] {
            assert_eq!(parse_topology(bad), None, "{bad}");
        }
        for good in ["gfx90a", "gfx942", "gfx1100", "gfx9-generic"] {
            assert!(is_gfx_arch(good), "{good}");
        }
        for bad in ["gfx", "sm_90", "GFX942", "gfxabc", "gfx 942"] {
            assert!(!is_gfx_arch(bad), "{bad}");
        }
    }

    #[test]
    fn each_bad_field_is_reported_at_its_path() {
        type Breaker = fn(&mut KptConfig);
        let cases: Vec<(&str, Breaker)> = vec![
            ("hardware.memory_fraction", |c| {
                c.hardware.memory_fraction = 0.0
            }),
            ("hardware.memory_fraction", |c| {
                c.hardware.memory_fraction = 1.5
            }),
            ("hardware.memory_fraction", |c| {
                c.hardware.memory_fraction = f32::NAN
            }),
            ("hardware.num_threads", |c| c.hardware.num_threads = Some(0)),
            ("hardware.device_id", |c| {
                c.hardware.backend = BackendChoice::Cpu;
                c.hardware.device_id = 1;
            }),
            ("hardware.backend", |c| {
                c.hardware.backend = BackendChoice::Cuda;
                c.nvidia.enabled = false;
            }),
            ("hardware.backend", |c| {
                c.hardware.backend = BackendChoice::Tpu;
                c.tpu.enabled = false;
            }),
            ("hardware.backend", |c| {
                c.hardware.backend = BackendChoice::Rocm;
                c.amd.enabled = false;
            }),
            ("nvidia.min_compute_capability", |c| {
                c.nvidia.min_compute_capability = "sm80".into()
            }),
            ("tpu.topology", |c| c.tpu.topology = Some("2by2".into())),
            ("tpu.version", |c| c.tpu.version = Some("v3".into())),
            ("tpu.plugin_path", |c| {
                c.tpu.plugin_path = Some(PathBuf::new())
            }),
            ("amd.gfx_arch", |c| c.amd.gfx_arch = Some("mi300".into())),
            ("amd.kernel_dir", |c| {
                c.amd.kernel_dir = Some(PathBuf::new())
            }),
            ("kernel.attention_block_q", |c| {
                c.kernel.attention_block_q = 48
            }),
            ("kernel.attention_block_kv", |c| {
                c.kernel.attention_block_kv = 1024
            }),
            ("kernel.attention_block_kv", |c| {
                c.kernel.attention_block_kv = 4
            }),
            ("kernel.autotune_iters", |c| c.kernel.autotune_iters = 0),
            ("kernel.autotune_cache", |c| {
                c.kernel.autotune_cache = Some(PathBuf::new())
            }),
            ("kernel.prefer[1]", |c| {
                c.kernel.prefer = vec!["a".into(), " ".into()]
            }),
            ("kernel.disable[0]", |c| {
                c.kernel.disable = vec![String::new()]
            }),
            ("kernel.disable", |c| {
                c.kernel.prefer = vec!["flash".into()];
                c.kernel.disable = vec!["flash".into()];
            }),
            ("precision.compute_dtype", |c| {
                c.precision.compute_dtype = DType::I32
            }),
            ("precision.compute_dtype", |c| {
                c.precision.compute_dtype = DType::F8E4M3
            }),
            ("precision.weight_dtype", |c| {
                c.precision.weight_dtype = Some(DType::I64)
            }),
            ("precision.weight_dtype", |c| {
                c.precision.weight_dtype = Some(DType::F8E5M2);
                c.precision.allow_fp8 = false;
            }),
            ("precision.weight_dtype", |c| {
                c.precision.weight_dtype = Some(DType::I8);
                c.precision.allow_int8 = false;
            }),
            ("precision.kv_cache_dtype", |c| {
                c.precision.kv_cache_dtype = Some(DType::I32)
            }),
            ("precision.activation_dtype", |c| {
                c.precision.activation_dtype = Some(DType::F8E4M3)
            }),
            ("precision.activation_dtype", |c| {
                c.precision.activation_dtype = Some(DType::F64)
            }),
            ("precision.tolerance_scale", |c| {
                c.precision.tolerance_scale = 0.0
            }),
            ("precision.tolerance_scale", |c| {
                c.precision.tolerance_scale = f64::INFINITY
            }),
            ("monitor.metrics_port", |c| {
                c.monitor.enabled = true;
                c.monitor.metrics_port = 0;
            }),
            ("monitor.metrics_port", |c| {
                c.monitor.enabled = true;
                c.monitor.metrics_port = 8000;
            }),
            ("monitor.history_db", |c| {
                c.monitor.history_db = PathBuf::new()
            }),
            ("monitor.sample_interval_ms", |c| {
                c.monitor.sample_interval_ms = 0
            }),
            ("monitor.regression_threshold_minor", |c| {
                c.monitor.regression_threshold_minor = 0.0
            }),
            ("monitor.regression_threshold_critical", |c| {
                c.monitor.regression_threshold_critical = 1.0
            }),
            ("monitor.regression_threshold_major", |c| {
                c.monitor.regression_threshold_major = 0.01
            }),
            ("monitor.regression_threshold_critical", |c| {
                c.monitor.regression_threshold_critical = 0.15
            }),
            ("deploy.host", |c| c.deploy.host = String::new()),
            ("deploy.host", |c| c.deploy.host = "local host".into()),
            ("deploy.port", |c| c.deploy.port = 0),
            ("deploy.max_batch_size", |c| c.deploy.max_batch_size = 0),
            ("deploy.max_seq_len", |c| c.deploy.max_seq_len = 0),
            ("deploy.export_dir", |c| {
                c.deploy.export_dir = PathBuf::new()
            }),
        ];
        for (field, breaker) in cases {
            let mut c = KptConfig::default();
            breaker(&mut c);
            let issues = c.issues();
            assert_eq!(issues.len(), 1, "{field}: {issues:?}");
            assert_eq!(issues[0].field, field);
            assert!(!issues[0].message.is_empty() && !issues[0].hint.is_empty());
            match c.validate() {
                Err(KptError::InvalidConfig(v)) => assert_eq!(v, issues),
                other => panic!("{field}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn valid_non_defaults_pass() {
        let mut c = KptConfig::default();
        c.hardware.backend = BackendChoice::Cuda;
        c.hardware.device_id = 3;
        c.nvidia.min_compute_capability = "9.0".into();
        c.tpu.topology = Some("2x2x1".into());
        c.tpu.version = Some("v5e".into());
        c.amd.gfx_arch = Some("gfx942".into());
        c.kernel.attention_block_q = 128;
        c.kernel.attention_block_kv = 8;
        c.precision.compute_dtype = DType::BF16;
        c.precision.weight_dtype = Some(DType::F8E4M3);
        c.precision.kv_cache_dtype = Some(DType::I8);
        c.monitor.enabled = true;
        c.validate().unwrap();
        assert_eq!(c.tpu.topology_dims(), Some(vec![2, 2, 1]));
    }

    #[test]
    fn all_problems_are_listed() {
        let mut c = KptConfig::default();
        c.hardware.memory_fraction = 2.0;
        c.precision.compute_dtype = DType::I8;
        c.deploy.port = 0;
        c.kernel.attention_block_q = 3;
        assert_eq!(
            fields(&c),
            vec![
                "hardware.memory_fraction",
                "kernel.attention_block_q",
                "precision.compute_dtype",
                "deploy.port"
            ]
        );
        let err = c.validate().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("4 problem(s)"), "{text}");
        assert!(text.contains("precision.compute_dtype"), "{text}");
    }

    #[test]
    fn env_overrides_types_lists_and_shorthands() {
        let mut c = KptConfig::default();
        c.apply_env_from(env(&[
            ("KPT_HARDWARE__NUM_THREADS", "4"),
            ("KPT_PRECISION__LEVEL", "aggressive"),
            ("KPT_KERNEL__DISABLE", "a, b,,c"),
            ("KPT_NVIDIA__ALLOW_TF32", "on"),
            ("KPT_HARDWARE__MEMORY_FRACTION", "0.5"),
            ("KPT_PRECISION__WEIGHT_DTYPE", "BF16"),
            ("KPT_TPU__TOPOLOGY", "2x2x1"),
            ("KPT_MONITOR__HISTORY_DB", "/tmp/h.sqlite"),
            ("KPT_LOG", "debug"),
            ("PATH", "/bin"),
        ]))
        .unwrap();
        assert_eq!(c.hardware.num_threads, Some(4));
        assert_eq!(c.precision.level, OptLevel::Aggressive);
        assert_eq!(c.kernel.disable, vec!["a", "b", "c"]);
        assert!(c.nvidia.allow_tf32);
        assert_eq!(c.hardware.memory_fraction, 0.5);
        assert_eq!(c.precision.weight_dtype, Some(DType::BF16));
        assert_eq!(c.tpu.topology.as_deref(), Some("2x2x1"));
        assert_eq!(c.monitor.history_db, PathBuf::from("/tmp/h.sqlite"));

        c.apply_env_from(env(&[("KPT_HARDWARE__NUM_THREADS", "none")]))
            .unwrap();
        assert_eq!(c.hardware.num_threads, None);
        assert!(c
            .apply_env_from(env(&[("KPT_DEPLOY__PORT", "none")]))
            .is_err());

        c.apply_env_from(env(&[
            ("KPT_BACKEND", "CPU"),
            ("KPT_LEVEL", "conservative"),
            ("KPT_THREADS", "2"),
            ("KPT_PRECISION__WEIGHT_DTYPE", "none"),
        ]))
        .unwrap();
        assert_eq!(c.hardware.backend, BackendChoice::Cpu);
        assert_eq!(c.precision.level, OptLevel::Conservative);
        assert_eq!(c.hardware.num_threads, Some(2));
        assert_eq!(c.precision.weight_dtype, None);

        // The long form wins over the shorthand, whatever the order.
        c.apply_env_from(env(&[
            ("KPT_THREADS", "8"),
            ("KPT_HARDWARE__NUM_THREADS", "6"),
        ]))
        .unwrap();
        assert_eq!(c.hardware.num_threads, Some(6));
    }

    #[test]
    fn bad_env_values_are_typed_errors() {
        let cases = [
            ("KPT_HARDWARE__NUM_THREADS", "abc"),
            ("KPT_HARDWARE__DEVICE_ID", "-1"),
            ("KPT_NVIDIA__ENABLED", "maybe"),
            ("KPT_PRECISION__LEVEL", "fast"),
            ("KPT_DEPLOY__PORT", "70000"),
            ("KPT_NOPE__X", "1"),
            ("KPT_HARDWARE__NOPE", "1"),
            ("KPT_HARDWARE__", "1"),
            ("KPT_A__B__C", "1"),
            ("KPT_HARDWARE", "1"),
        ];
        for (name, value) in cases {
            let mut c = KptConfig::default();
            let before = c.clone();
            let result = c.apply_env_from(env(&[(name, value)]));
            if name == "KPT_HARDWARE" {
                // No double underscore: not an override, ignored.
                result.unwrap();
                continue;
            }
            match result {
                Err(KptError::ConfigParse {
                    source_name,
                    message,
                }) => {
                    assert!(source_name.contains(name), "{source_name}");
                    assert!(!message.is_empty());
                }
                other => panic!("{name}={value}: expected ConfigParse, got {other:?}"),
            }
            assert_eq!(c, before, "config must be unchanged on error");
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err =
            KptConfig::from_toml_str("[hardware]\nbackend = \"cpu\"\nbogus = 1\n").unwrap_err();
        match err {
            KptError::ConfigParse { message, .. } => {
                assert!(message.contains("bogus"), "{message}");
                assert!(message.contains("line 3"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert!(KptConfig::from_toml_str("[gpu]\nx = 1\n").is_err());
        assert!(KptConfig::from_json_str(r#"{"deploy": {"hots": "x"}}"#).is_err());
        let err = KptConfig::from_json_str("{\n\"hardware\": 3}").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }

    #[test]
    fn partial_documents_keep_defaults() {
        let c = KptConfig::from_toml_str("[precision]\nlevel = \"aggressive\"\n").unwrap();
        let mut want = KptConfig::default();
        want.precision.level = OptLevel::Aggressive;
        assert_eq!(c, want);
        assert_eq!(
            KptConfig::from_json_str("{}").unwrap(),
            KptConfig::default()
        );
        assert_eq!(KptConfig::from_toml_str("").unwrap(), KptConfig::default());
    }

    #[test]
    fn default_round_trips() {
        let c = KptConfig::default();
        let toml_text = c.to_toml_string().unwrap();
        assert!(toml_text.contains("memory_fraction = 0.9\n"), "{toml_text}");
        assert_eq!(KptConfig::from_toml_str(&toml_text).unwrap(), c);
        assert_eq!(
            KptConfig::from_json_str(&c.to_json_string().unwrap()).unwrap(),
            c
        );
    }
}
