//! kpt-monitor: performance reports.
//!
//! Every performance claim of kpt is a [`Report`]: rows that compare kpt with the
//! strongest alternative measured in the same run, written as JSON (one schema for all
//! reports), a Markdown table and an SVG chart of the ratios.
//!
//! ```
//! use kpt_monitor::{Machine, Report, Row};
//!
//! let machine = Machine { device: "CPU".into(), driver: None, cpu: "x86_64".into(),
//!                         versions: Default::default() };
//! let mut report = Report::new("cpu", "cargo xtask bench-cpu", "abc1234", machine);
//! report.rows.push(
//!     Row::compared("gemm_f32_512", "GFLOP/s", true, 180.0, 150.0, "torch.matmul")
//!         .with_target_ratio(0.95),
//! );
//! assert!(report.rows[0].met);
//! assert!(report.to_markdown().contains("1.20x"));
//! ```

pub mod plot;
pub mod report;
mod time;

pub use report::{Machine, Report, Row};
