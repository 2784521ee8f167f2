//! Backend counters as OpenMetrics text, the format Prometheus scrapes and its
//! node exporter's textfile collector reads.
//!
//! A backend reports its own machinery through `Backend::counters` as `(name, value)`
//! pairs (an XLA backend: its compile cache). [`openmetrics`] turns those of one or
//! more backends into one exposition, written by the `prometheus-client` crate:
//!
//! - every name gets the `kpt_` prefix, and every sample the labels `backend` (the
//!   backend's name, `xla-cpu:0`, `tpu:0`, ...) and `device` (its device's name);
//! - events counted since the backend started are counters (`_total` is added, as
//!   OpenMetrics requires): names ending in `_hits`, `_misses`, `_evictions` or
//!   `_total` ([`MetricKind::of`]);
//! - every other value (entries held, bytes held, programs emitted) is a gauge; a name
//!   ending in `_bytes` is written with the unit `bytes`;
//! - for every pair `P_hits` / `P_misses` of one backend a gauge `P_hit_ratio`, hits
//!   over requests, is derived, once there was a request.
//!
//! ```
//! use kpt_monitor::metrics::{openmetrics, BackendCounters};
//!
//! let xla = BackendCounters {
//!     backend: "xla-cpu:0".into(),
//!     device: "cpu".into(),
//!     counters: vec![
//!         ("xla_compile_cache_hits".into(), 3),
//!         ("xla_compile_cache_misses".into(), 1),
//!         ("xla_compile_cache_bytes".into(), 4096),
//!     ],
//! };
//! let text = openmetrics(&[xla])?;
//! assert!(text.contains("# TYPE kpt_xla_compile_cache_hits counter"));
//! assert!(text.contains(r#"kpt_xla_compile_cache_hits_total{backend="xla-cpu:0",device="cpu"} 3"#));
//! assert!(text.contains(r#"kpt_xla_compile_cache_hit_ratio{backend="xla-cpu:0",device="cpu"} 0.75"#));
//! assert!(text.contains("# UNIT kpt_xla_compile_cache_bytes bytes"));
//! assert!(text.ends_with("# EOF\n"));
//! # Ok::<(), kpt_core::KptError>(())
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::AtomicU64;

use kpt_core::backend::Backend;
use kpt_core::{KptError, Result};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

/// The prefix of every metric name kpt exports.
pub const PREFIX: &str = "kpt";

/// How a backend counter is exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Events since the backend started; only ever grows.
    Counter,
    /// A value now (entries, bytes); may go down.
    Gauge,
}

impl MetricKind {
    /// The kind of the backend counter `name`: names ending in `_hits`, `_misses`,
    /// `_evictions` or `_total` count events and are counters; every other name (such
    /// as `_entries`, `_bytes`, `xla_programs`) is a size now and a gauge.
    pub fn of(name: &str) -> MetricKind {
        const EVENTS: [&str; 4] = ["_hits", "_misses", "_evictions", "_total"];
        if EVENTS.iter().any(|s| name.ends_with(s)) {
            MetricKind::Counter
        } else {
            MetricKind::Gauge
        }
    }
}

/// One backend's counters and the names that label them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendCounters {
    /// The backend's name (`cpu`, `cuda:0`, `xla-cpu:0`, `tpu:0`, ...): label `backend`.
    pub backend: String,
    /// Its device's name: label `device`.
    pub device: String,
    /// `(name, value)` pairs as `Backend::counters` gives them.
    pub counters: Vec<(String, u64)>,
}

impl BackendCounters {
    /// The counters of `backend` now.
    pub fn of(backend: &dyn Backend) -> BackendCounters {
        BackendCounters {
            backend: backend.name().to_string(),
            device: backend.device().name.clone(),
            counters: backend.counters(),
        }
    }
}

/// Help texts of the counters kpt's backends report; others get a generic one.
fn help(name: &str) -> String {
    let known = match name {
        "xla_compile_cache_hits" => "XLA compile requests served from the in-memory cache",
        "xla_compile_cache_misses" => {
            "XLA compile requests that compiled a program or loaded it from disk"
        }
        "xla_compile_cache_disk_hits" => {
            "XLA compile cache misses served from the on-disk cache of serialized executables"
        }
        "xla_compile_cache_evictions" => {
            "XLA executables dropped to keep the compile cache under its size limit"
        }
        "xla_compile_cache_entries" => "XLA executables held in the compile cache",
        "xla_compile_cache_bytes" => {
            "Size of the XLA executables held in the compile cache (generated code)"
        }
        "xla_programs" => {
            "StableHLO programs emitted by the XLA backend (one per op and input shapes)"
        }
        _ => return format!("Backend counter {name}"),
    };
    known.to_string()
}

/// Whether `name` is a valid OpenMetrics metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`).
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

type Labels = Vec<(String, String)>;
type U64Gauge = Gauge<u64, AtomicU64>;
type F64Gauge = Gauge<f64, AtomicU64>;

/// The metric families of one exposition, by exported name (without prefix and
/// suffixes), so that every backend's sample of a name lands in one family.
#[derive(Default)]
struct Families {
    counters: BTreeMap<String, Family<Labels, Counter>>,
    gauges: BTreeMap<String, Family<Labels, U64Gauge>>,
    ratios: BTreeMap<String, Family<Labels, F64Gauge>>,
}

/// The OpenMetrics text (ending in `# EOF`) of the counters of `backends`; see the
/// [module](self) for names, kinds and labels.
///
/// Fails with [`KptError::InvalidArgument`] on a counter name that is no valid
/// metric name, on a name given twice by one backend, on a name that is a derived
/// `_hit_ratio` gauge as well, on names that would export a counter and a gauge of one
/// name (`x_total` and `x`), and on two backends with the same name and device.
pub fn openmetrics(backends: &[BackendCounters]) -> Result<String> {
    let mut families = Families::default();
    let mut seen_labels = BTreeSet::new();
    for b in backends {
        let labels: Labels = vec![
            ("backend".to_string(), b.backend.clone()),
            ("device".to_string(), b.device.clone()),
        ];
        if !seen_labels.insert(labels.clone()) {
            return Err(KptError::InvalidArgument(format!(
                "backend {} on {} is given twice",
                b.backend, b.device
            )));
        }
        let mut values = BTreeMap::new();
        for (name, value) in &b.counters {
            if !valid_name(name) {
                return Err(KptError::InvalidArgument(format!(
                    "backend {}: counter name {name:?} is no metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)",
                    b.backend
                )));
            }
            if values.insert(name.as_str(), *value).is_some() {
                return Err(KptError::InvalidArgument(format!(
                    "backend {}: counter {name} is given twice",
                    b.backend
                )));
            }
        }
        for (&name, &value) in &values {
            match MetricKind::of(name) {
                MetricKind::Counter => {
                    // OpenMetrics adds `_total` to a counter; a name that has it already
                    // is exported once with it, not `_total_total`.
                    let base = name.strip_suffix("_total").unwrap_or(name);
                    families
                        .counters
                        .entry(base.to_string())
                        .or_default()
                        .get_or_create(&labels)
                        .inc_by(value);
                }
                MetricKind::Gauge => {
                    families
                        .gauges
                        .entry(name.to_string())
                        .or_default()
                        .get_or_create(&labels)
                        .set(value);
                }
            }
        }
        for (&name, &hits) in &values {
            let Some(prefix) = name.strip_suffix("_hits") else {
                continue;
            };
            let Some(&misses) = values.get(format!("{prefix}_misses").as_str()) else {
                continue;
            };
            let ratio = format!("{prefix}_hit_ratio");
            if values.contains_key(ratio.as_str()) {
                return Err(KptError::InvalidArgument(format!(
                    "backend {}: counter {ratio} clashes with the hit ratio kpt derives",
                    b.backend
                )));
            }
            let requests = hits.saturating_add(misses);
            if requests > 0 {
                families
                    .ratios
                    .entry(ratio)
                    .or_default()
                    .get_or_create(&labels)
                    .set(hits as f64 / requests as f64);
            }
        }
    }
    // One family per exported name: a counter `x_total` and a gauge `x` (or a gauge
    // and another backend's derived ratio) would be two families of one name.
    let mut names = BTreeSet::new();
    for name in families
        .counters
        .keys()
        .chain(families.gauges.keys())
        .chain(families.ratios.keys())
    {
        if !names.insert(name) {
            return Err(KptError::InvalidArgument(format!(
                "counters export two metrics named {PREFIX}_{name} (a counter and a gauge)"
            )));
        }
    }
    let mut registry = Registry::with_prefix(PREFIX);
    for (name, family) in families.counters {
        let help = help(&name);
        registry.register(name, help, family);
    }
    for (name, family) in families.gauges {
        let help = help(&name);
        match name.strip_suffix("_bytes") {
            Some(base) if !base.is_empty() => {
                registry.register_with_unit(base.to_string(), help, Unit::Bytes, family)
            }
            _ => registry.register(name, help, family),
        }
    }
    for (name, family) in families.ratios {
        let requests = name.strip_suffix("_hit_ratio").unwrap_or(&name);
        let help = format!("Hits over requests of {requests} (hits / (hits + misses))");
        registry.register(name, help, family);
    }
    let mut text = String::new();
    encode(&mut text, &registry)
        .map_err(|e| KptError::InvalidArgument(format!("encoding OpenMetrics text: {e}")))?;
    Ok(text)
}

/// Writes [`openmetrics`] of `backends` to `path` (replacing it), for Prometheus'
/// textfile collector or any other reader of the format.
pub fn write_openmetrics(path: &Path, backends: &[BackendCounters]) -> Result<()> {
    let text = openmetrics(backends)?;
    std::fs::write(path, text).map_err(|source| KptError::Io {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sample line: name, labels, value.
    #[derive(Debug, PartialEq)]
    struct Sample {
        name: String,
        labels: BTreeMap<String, String>,
        value: f64,
    }

    /// A small parser of the OpenMetrics text format (enough for what kpt writes):
    /// `# TYPE` / `# HELP` / `# UNIT` lines, samples with labels, `# EOF` last. Checks
    /// that every sample belongs to the family declared before it.
    fn parse(
        text: &str,
    ) -> (
        BTreeMap<String, String>,
        BTreeMap<String, String>,
        Vec<Sample>,
    ) {
        let mut types = BTreeMap::new();
        let mut units = BTreeMap::new();
        let mut samples = Vec::new();
        let mut family = String::new();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.last(), Some(&"# EOF"), "{text}");
        assert!(text.ends_with('\n'));
        for line in &lines[..lines.len() - 1] {
            if let Some(rest) = line.strip_prefix("# ") {
                let mut parts = rest.splitn(3, ' ');
                let (kind, name, value) = (
                    parts.next().unwrap(),
                    parts.next().unwrap(),
                    parts.next().unwrap(),
                );
                assert!(valid_name(name), "{line}");
                match kind {
                    "TYPE" => {
                        assert!(["counter", "gauge"].contains(&value), "{line}");
                        assert!(types.insert(name.to_string(), value.to_string()).is_none());
                        family = name.to_string();
                    }
                    "UNIT" => {
                        assert!(name.ends_with(&format!("_{value}")), "{line}");
                        units.insert(name.to_string(), value.to_string());
                    }
                    "HELP" => assert!(!value.is_empty(), "{line}"),
                    _ => panic!("unexpected line {line}"),
                }
                continue;
            }
            let (head, value) = line.rsplit_once(' ').expect("name and value");
            let (name, labels) = match head.split_once('{') {
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("closing brace");
                    let labels = body
                        .split("\",")
                        .map(|kv| {
                            let (k, v) = kv.split_once("=\"").expect("label=\"value\"");
                            (k.to_string(), v.trim_end_matches('"').to_string())
                        })
                        .collect();
                    (name.to_string(), labels)
                }
                None => (head.to_string(), BTreeMap::new()),
            };
            let expected = match types.get(&family).map(String::as_str) {
                Some("counter") => format!("{family}_total"),
                _ => family.clone(),
            };
            assert_eq!(name, expected, "sample outside its family: {line}");
            samples.push(Sample {
                name,
                labels,
                value: value.parse().expect("a number"),
            });
        }
        (types, units, samples)
    }

    fn xla(backend: &str, hits: u64, misses: u64) -> BackendCounters {
        BackendCounters {
            backend: backend.into(),
            device: "cpu (XLA cpu plugin)".into(),
            counters: [
                ("xla_compile_cache_hits", hits),
                ("xla_compile_cache_misses", misses),
                ("xla_compile_cache_disk_hits", 0),
                ("xla_compile_cache_evictions", 2),
                ("xla_compile_cache_entries", 5),
                ("xla_compile_cache_bytes", 123_456),
                ("xla_programs", 7),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        }
    }

    fn value(samples: &[Sample], name: &str, backend: &str) -> f64 {
        samples
            .iter()
            .find(|s| s.name == name && s.labels["backend"] == backend)
            .unwrap_or_else(|| panic!("no {name} of {backend}"))
            .value
    }

    #[test]
    fn kinds_follow_the_names() {
        for name in [
            "xla_compile_cache_hits",
            "xla_compile_cache_misses",
            "xla_compile_cache_disk_hits",
            "xla_compile_cache_evictions",
            "launches_total",
        ] {
            assert_eq!(MetricKind::of(name), MetricKind::Counter, "{name}");
        }
        for name in [
            "xla_compile_cache_entries",
            "xla_compile_cache_bytes",
            "xla_programs",
        ] {
            assert_eq!(MetricKind::of(name), MetricKind::Gauge, "{name}");
        }
    }

    #[test]
    fn xla_counters_become_counters_gauges_and_a_hit_ratio() {
        let text = openmetrics(&[xla("xla-cpu:0", 9, 3)]).unwrap();
        let (types, units, samples) = parse(&text);
        for name in [
            "kpt_xla_compile_cache_hits",
            "kpt_xla_compile_cache_misses",
            "kpt_xla_compile_cache_disk_hits",
            "kpt_xla_compile_cache_evictions",
        ] {
            assert_eq!(types[name], "counter", "{name}");
        }
        for name in [
            "kpt_xla_compile_cache_entries",
            "kpt_xla_compile_cache_bytes",
            "kpt_xla_programs",
            "kpt_xla_compile_cache_hit_ratio",
        ] {
            assert_eq!(types[name], "gauge", "{name}");
        }
        assert_eq!(units["kpt_xla_compile_cache_bytes"], "bytes");
        assert_eq!(types.len(), 8, "{text}");
        assert_eq!(samples.len(), 8, "{text}");
        let b = "xla-cpu:0";
        assert_eq!(value(&samples, "kpt_xla_compile_cache_hits_total", b), 9.0);
        assert_eq!(
            value(&samples, "kpt_xla_compile_cache_misses_total", b),
            3.0
        );
        assert_eq!(
            value(&samples, "kpt_xla_compile_cache_evictions_total", b),
            2.0
        );
        assert_eq!(value(&samples, "kpt_xla_compile_cache_entries", b), 5.0);
        assert_eq!(value(&samples, "kpt_xla_compile_cache_bytes", b), 123_456.0);
        assert_eq!(value(&samples, "kpt_xla_programs", b), 7.0);
        assert_eq!(value(&samples, "kpt_xla_compile_cache_hit_ratio", b), 0.75);
        for s in &samples {
            assert_eq!(s.labels.len(), 2, "{s:?}");
            assert_eq!(s.labels["device"], "cpu (XLA cpu plugin)");
        }
        assert!(text.contains("# HELP kpt_xla_compile_cache_hits XLA compile requests served"));
    }

    #[test]
    fn several_backends_share_one_family_per_name() {
        let text = openmetrics(&[xla("xla-cpu:0", 1, 1), xla("xla-cpu:1", 0, 4)]).unwrap();
        let (types, _, samples) = parse(&text);
        assert_eq!(types.len(), 8);
        assert_eq!(samples.len(), 16);
        assert_eq!(
            value(&samples, "kpt_xla_compile_cache_hit_ratio", "xla-cpu:0"),
            0.5
        );
        assert_eq!(
            value(&samples, "kpt_xla_compile_cache_hit_ratio", "xla-cpu:1"),
            0.0
        );
        assert_eq!(
            value(&samples, "kpt_xla_compile_cache_misses_total", "xla-cpu:1"),
            4.0
        );
    }

    #[test]
    fn no_ratio_before_the_first_request() {
        let text = openmetrics(&[xla("xla-cpu:0", 0, 0)]).unwrap();
        let (types, _, samples) = parse(&text);
        assert!(
            !types.contains_key("kpt_xla_compile_cache_hit_ratio"),
            "{text}"
        );
        assert_eq!(samples.len(), 7);
    }

    #[test]
    fn a_backend_without_counters_gives_an_empty_exposition() {
        let cpu = BackendCounters {
            backend: "cpu".into(),
            device: "AMD EPYC".into(),
            counters: Vec::new(),
        };
        assert_eq!(openmetrics(&[cpu]).unwrap(), "# EOF\n");
        assert_eq!(openmetrics(&[]).unwrap(), "# EOF\n");
    }

    #[test]
    fn label_values_are_escaped() {
        let mut b = xla("xla-cpu:0", 1, 0);
        b.device = "a \"quoted\" name\\".into();
        let text = openmetrics(&[b]).unwrap();
        assert!(text.contains(r#"device="a \"quoted\" name\\""#), "{text}");
    }

    #[test]
    fn a_total_suffix_is_not_doubled() {
        let b = BackendCounters {
            backend: "x".into(),
            device: "d".into(),
            counters: vec![("launches_total".into(), 12)],
        };
        let text = openmetrics(&[b]).unwrap();
        let (types, _, samples) = parse(&text);
        assert_eq!(types["kpt_launches"], "counter");
        assert_eq!(value(&samples, "kpt_launches_total", "x"), 12.0);
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let bad = |counters: Vec<(&str, u64)>| BackendCounters {
            backend: "x".into(),
            device: "d".into(),
            counters: counters.into_iter().map(|(k, v)| (k.into(), v)).collect(),
        };
        for (counters, want) in [
            (vec![("bad name", 1)], "no metric name"),
            (vec![("", 1)], "no metric name"),
            (vec![("9lives", 1)], "no metric name"),
            (vec![("a", 1), ("a", 2)], "given twice"),
            (
                vec![("c_hits", 1), ("c_misses", 1), ("c_hit_ratio", 1)],
                "clashes",
            ),
        ] {
            match openmetrics(&[bad(counters.clone())]) {
                Err(KptError::InvalidArgument(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{counters:?}: {other:?}"),
            }
        }
        match openmetrics(&[bad(vec![("launches_total", 1), ("launches", 2)])]) {
            Err(KptError::InvalidArgument(m)) => assert!(m.contains("kpt_launches"), "{m}"),
            other => panic!("{other:?}"),
        }
        let mut other = bad(vec![("c_hit_ratio", 1)]);
        other.backend = "y".into();
        match openmetrics(&[bad(vec![("c_hits", 1), ("c_misses", 1)]), other]) {
            Err(KptError::InvalidArgument(m)) => assert!(m.contains("kpt_c_hit_ratio"), "{m}"),
            other => panic!("{other:?}"),
        }
        match openmetrics(&[bad(vec![]), bad(vec![])]) {
            Err(KptError::InvalidArgument(m)) => assert!(m.contains("given twice"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn write_replaces_the_file_and_reports_io_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kpt.prom");
        std::fs::write(&path, "old").unwrap();
        write_openmetrics(&path, &[xla("xla-cpu:0", 2, 2)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, openmetrics(&[xla("xla-cpu:0", 2, 2)]).unwrap());
        let missing = dir.path().join("no/such/dir/kpt.prom");
        match write_openmetrics(&missing, &[]) {
            Err(KptError::Io { path, .. }) => assert!(path.contains("no/such/dir")),
            other => panic!("{other:?}"),
        }
    }
}
