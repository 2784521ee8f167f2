//! kpt-monitor: performance reports, and backend counters as metrics.
//!
//! Every performance claim of kpt is a [`Report`]: rows that compare kpt with the
//! strongest alternative measured in the same run, written as JSON (one schema for all
//! reports, see [`report`]), an aligned Markdown table ([`Report::to_markdown`]) and an
//! SVG bar chart of the ratios ([`plot::ratio_chart_svg`]). [`Report::write`] stores
//! all of them as `<report>-latest.*` plus a date-stamped `<report>-YYYY-MM-DD.json`.
//!
//! A ratio above 1 always means kpt is ahead: it is kpt over the baseline for
//! higher-is-better metrics (throughput) and the baseline over kpt for
//! lower-is-better ones (times).
//!
//! [`metrics`] turns the counters a backend reports (`Backend::counters`: an XLA
//! backend's compile cache hits, misses and sizes) into OpenMetrics text, the format
//! Prometheus reads ([`metrics::openmetrics`], [`metrics::write_openmetrics`]).
//!
//! ```
//! use kpt_monitor::{Machine, Report, Row};
//!
//! let machine = Machine {
//!     device: "CPU: AMD EPYC (2 cores)".into(),
//!     driver: None,
//!     cpu: "AMD EPYC".into(),
//!     versions: [("kpt".to_string(), "0.1.0".to_string())].into(),
//! };
//! let mut report = Report::new("cpu", "cargo xtask bench-cpu", "abc1234", machine);
//! report.rows.push(
//!     Row::compared("gemm_f32_512", "GFLOP/s", true, 180.0, 150.0, "torch.matmul")
//!         .with_target_ratio(0.95)
//!         .with_max_abs_err(3.9e-3),
//! );
//! // Times: lower is better, so 4 ms against torch's 5 ms is a ratio of 1.25.
//! report.rows.push(Row::compared("softmax_4096", "ms", false, 4.0, 5.0, "torch.softmax"));
//! report.rows.push(Row::not_run("attention", "ms", false, "sdpa", "torch missing"));
//!
//! assert_eq!(report.rows[0].ratio, Some(1.2));
//! assert_eq!(report.rows[1].ratio, Some(1.25));
//! assert!(report.rows[0].met && report.rows[1].met && !report.rows[2].met);
//!
//! let md = report.to_markdown();
//! assert!(md.contains("1.20x") && md.contains(">= 0.95x"));
//! assert!(md.contains("2 of 3 targets met."));
//! assert!(kpt_monitor::plot::ratio_chart_svg(&report).starts_with("<svg"));
//!
//! let back = Report::from_json(&report.to_json())?;
//! assert_eq!(back, report);
//! # Ok::<(), kpt_core::KptError>(())
//! ```

pub mod metrics;
pub mod plot;
pub mod report;
mod stats;
mod time;

pub use plot::ratio_chart_svg;
pub use report::{Machine, Report, Row};
pub use stats::median;
