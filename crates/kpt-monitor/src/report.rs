//! The report schema shared by every benchmark report (`docs/reports/*.json`).
//!
//! ```json
//! {
//!   "report": "cpu",
//!   "date": "2026-11-23T12:00:00Z",
//!   "command": "cargo xtask bench-cpu",
//!   "git_commit": "abc1234",
//!   "machine": {"device": "AMD EPYC (2 cores)", "driver": null, "cpu": "...",
//!               "versions": {"torch": "2.11.0", "kpt": "0.1.0"}},
//!   "rows": [
//!     {"name": "gemm_f32_512", "metric": "GFLOP/s", "higher_is_better": true,
//!      "kpt": 812.4, "baseline": 755.1, "baseline_name": "torch.matmul",
//!      "ratio": 1.076, "target_ratio": 1.03, "target": null, "met": true,
//!      "max_abs_err": 0.0039, "notes": ""}
//!   ]
//! }
//! ```
//!
//! Rules:
//!
//! - `ratio` is `kpt / baseline` for higher-is-better metrics and `baseline / kpt` for
//!   lower-is-better ones (times), so a ratio above 1 always means kpt is ahead. It is
//!   `null` when either value is missing or the division is not finite.
//! - `met` is `ratio >= target_ratio` when `target_ratio` is set, and `kpt >= target`
//!   (higher is better) or `kpt <= target` (lower is better) when the absolute `target`
//!   is set; when both are set, both must hold. A row with no target at all is met when
//!   it ran (`kpt` is a finite number).
//! - Rows that could not run keep their place with `null` values, `met: false` and the
//!   reason in `notes`; they are never dropped.
//! - [`Report::write`] keeps `NAME-latest.json` for the newest run and a date-stamped
//!   copy `NAME-YYYY-MM-DD.json` for history.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kpt_core::{KptError, Result};
use serde::{Deserialize, Serialize};

/// Where a report was measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// The device measured (GPU name, or the CPU for CPU reports).
    pub device: String,
    /// GPU driver version, if any (`null` for CPU reports).
    pub driver: Option<String>,
    /// The host CPU.
    pub cpu: String,
    /// Software versions (`torch`, `kpt`, ...).
    pub versions: BTreeMap<String, String>,
}

/// One measured case of a [`Report`].
///
/// Build rows with [`Row::compared`], [`Row::absolute`] or [`Row::not_run`] and the
/// `with_*` methods, which keep `ratio` and `met` consistent with the rules of the
/// [module documentation](self). The fields stay public so that a caller can record
/// what the rules cannot know (e.g. `met = false` after a failed accuracy check); such
/// an override must come after the last `with_target*` call, which recomputes `met`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Case name, e.g. `gemm_bf16_4096`.
    pub name: String,
    /// Unit of `kpt` and `baseline`, e.g. `GFLOP/s` or `ms`.
    pub metric: String,
    /// Whether larger values of the metric are better (`false` for times).
    pub higher_is_better: bool,
    /// kpt's value (`None`: not run).
    pub kpt: Option<f64>,
    /// The baseline's value (`None`: no baseline, or not run).
    pub baseline: Option<f64>,
    /// What the baseline is, e.g. `torch.matmul` (empty when there is none).
    pub baseline_name: String,
    /// kpt relative to the baseline; above 1 means kpt is ahead.
    pub ratio: Option<f64>,
    /// The ratio to reach, if the target is relative.
    pub target_ratio: Option<f64>,
    /// The value of `kpt` to reach, if the target is absolute.
    pub target: Option<f64>,
    /// Whether the target is met (see the [module documentation](self)).
    pub met: bool,
    /// Largest absolute error of kpt's result against the reference.
    pub max_abs_err: Option<f64>,
    /// Anything a reader needs to interpret the row; why it did not run.
    pub notes: String,
}

/// `Some(v)` for finite `v`.
fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

impl Row {
    fn base(
        name: impl Into<String>,
        metric: impl Into<String>,
        higher_is_better: bool,
        baseline_name: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            metric: metric.into(),
            higher_is_better,
            kpt: None,
            baseline: None,
            baseline_name: baseline_name.into(),
            ratio: None,
            target_ratio: None,
            target: None,
            met: false,
            max_abs_err: None,
            notes: String::new(),
        }
    }

    /// kpt against a baseline measured in the same run.
    ///
    /// `ratio` is `kpt / baseline` when `higher_is_better`, else `baseline / kpt`; it is
    /// `None` when the division is not finite (a zero or non-finite operand). A
    /// non-finite `kpt` or `baseline` is recorded as `None`.
    pub fn compared(
        name: impl Into<String>,
        metric: impl Into<String>,
        higher_is_better: bool,
        kpt: f64,
        baseline: f64,
        baseline_name: impl Into<String>,
    ) -> Self {
        let mut row = Self::base(name, metric, higher_is_better, baseline_name);
        row.kpt = finite(kpt);
        row.baseline = finite(baseline);
        if let (Some(k), Some(b)) = (row.kpt, row.baseline) {
            let ratio = if higher_is_better { k / b } else { b / k };
            row.ratio = finite(ratio).filter(|r| *r >= 0.0);
        }
        row.update_met();
        row
    }

    /// A kpt measurement with no baseline; an absolute target may follow
    /// ([`Row::with_target`]).
    pub fn absolute(
        name: impl Into<String>,
        metric: impl Into<String>,
        higher_is_better: bool,
        kpt: f64,
    ) -> Self {
        let mut row = Self::base(name, metric, higher_is_better, "");
        row.kpt = finite(kpt);
        row.update_met();
        row
    }

    /// A case that could not run: `null` values, `met: false` and `why` in the notes.
    pub fn not_run(
        name: impl Into<String>,
        metric: impl Into<String>,
        higher_is_better: bool,
        baseline_name: impl Into<String>,
        why: impl Into<String>,
    ) -> Self {
        Self::base(name, metric, higher_is_better, baseline_name).with_note(why)
    }

    /// Sets a relative target (`ratio >= target_ratio`) and recomputes `met`.
    pub fn with_target_ratio(mut self, target_ratio: f64) -> Self {
        self.target_ratio = Some(target_ratio);
        self.update_met();
        self
    }

    /// Sets an absolute target on `kpt` (`>=` when higher is better, else `<=`) and
    /// recomputes `met`.
    pub fn with_target(mut self, target: f64) -> Self {
        self.target = Some(target);
        self.update_met();
        self
    }

    /// Records the largest absolute error against the reference. `met` is left as it
    /// is: it does not depend on the error.
    pub fn with_max_abs_err(mut self, err: f64) -> Self {
        self.max_abs_err = Some(err);
        self
    }

    /// Appends a note, separated from earlier ones by `; ` (empty notes are skipped).
    /// `met` is left as it is: it does not depend on the notes.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        let note = note.into();
        if !note.is_empty() {
            if !self.notes.is_empty() {
                self.notes.push_str("; ");
            }
            self.notes.push_str(&note);
        }
        self
    }

    /// Whether the row ran: `kpt` holds a finite number.
    pub fn ran(&self) -> bool {
        self.kpt.is_some_and(f64::is_finite)
    }

    /// `met` by the rules of the [module documentation](self).
    fn update_met(&mut self) {
        let Some(kpt) = self.kpt.filter(|v| v.is_finite()) else {
            self.met = false;
            return;
        };
        let relative = self
            .target_ratio
            .map(|t| self.ratio.is_some_and(|r| r >= t));
        let absolute = self.target.map(|t| {
            if self.higher_is_better {
                kpt >= t
            } else {
                kpt <= t
            }
        });
        self.met = relative.unwrap_or(true) && absolute.unwrap_or(true);
    }
}

/// A benchmark report: one run, one machine, many rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Report name; the files are `<report>-latest.json` etc.
    pub report: String,
    /// When it ran, RFC 3339 UTC (`2026-11-23T12:00:00Z`).
    pub date: String,
    /// The command that produced it.
    pub command: String,
    /// The commit measured.
    pub git_commit: String,
    /// Where it ran.
    pub machine: Machine,
    /// The measurements, including the rows that could not run.
    pub rows: Vec<Row>,
}

/// `v` with 4 significant digits (an exponent outside `1e-3..1e6`).
pub(crate) fn num(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e6).contains(&a) {
        return format!("{v:.3e}");
    }
    let decimals = if a >= 1000.0 {
        0
    } else if a == 0.0 {
        3
    } else {
        (3 - a.log10().floor() as i32).clamp(0, 6) as usize
    };
    format!("{v:.decimals$}")
}

/// `s` without trailing zeros after the decimal point (`2.500e-7` -> `2.5e-7`).
fn trim_zeros(s: &str) -> String {
    let (mantissa, exp) = s.split_at(s.find('e').unwrap_or(s.len()));
    let mantissa = if mantissa.contains('.') {
        mantissa.trim_end_matches('0').trim_end_matches('.')
    } else {
        mantissa
    };
    format!("{mantissa}{exp}")
}

/// A ratio: `1.08x`; small ratios keep 4 significant digits (`0.01235x`).
pub(crate) fn ratio_str(v: f64) -> String {
    if v == 0.0 || v.abs() >= 0.1 {
        format!("{v:.2}x")
    } else {
        format!("{}x", num(v))
    }
}

/// A target ratio: `0.95x`, or all its significant digits if two decimals would round.
pub(crate) fn target_ratio_str(t: f64) -> String {
    let two = format!("{t:.2}");
    if two.parse::<f64>() == Ok(t) {
        format!("{two}x")
    } else {
        format!("{}x", trim_zeros(&num(t)))
    }
}

/// The target column: `>= 0.95x`, `>= 123`, `<= 9.5`, both, or `–`.
pub(crate) fn target_str(row: &Row) -> String {
    let mut parts = Vec::new();
    if let Some(t) = row.target_ratio {
        parts.push(format!(">= {}", target_ratio_str(t)));
    }
    if let Some(t) = row.target {
        let op = if row.higher_is_better { ">=" } else { "<=" };
        parts.push(format!("{op} {}", trim_zeros(&num(t))));
    }
    if parts.is_empty() {
        "–".into()
    } else {
        parts.join(", ")
    }
}

/// `–` for a missing value.
fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "–".to_string(), f)
}

/// Text made safe for one Markdown table cell.
fn cell(s: &str) -> String {
    s.replace(['\r', '\n'], " ").replace('|', "\\|")
}

/// Whether `s` is `YYYY-MM-DD`.
fn is_day(s: &str) -> bool {
    s.len() == 10
        && s.bytes().enumerate().all(|(i, b)| match i {
            4 | 7 => b == b'-',
            _ => b.is_ascii_digit(),
        })
}

impl Report {
    /// An empty report dated now (RFC 3339 UTC).
    pub fn new(
        report: impl Into<String>,
        command: impl Into<String>,
        git_commit: impl Into<String>,
        machine: Machine,
    ) -> Self {
        Self {
            report: report.into(),
            date: crate::time::now_rfc3339(),
            command: command.into(),
            git_commit: git_commit.into(),
            machine,
            rows: Vec::new(),
        }
    }

    /// One report holding the rows of several, each from its own run: row `r` of part
    /// `(label, report)` becomes `"{label}: {r.name}"`, its notes name the run it came
    /// from (report, date, commit), and the machine, commit and versions list every
    /// part's under its label. For an issue that asks for one report of comparisons made
    /// on different machines (the models report: GPU and CPU). Dated now.
    pub fn combine(
        report: impl Into<String>,
        command: impl Into<String>,
        parts: &[(&str, &Report)],
    ) -> Self {
        let joined = |f: &dyn Fn(&Report) -> String| {
            parts
                .iter()
                .map(|(label, r)| format!("{label}: {}", f(r)))
                .collect::<Vec<_>>()
                .join("; ")
        };
        let drivers: Vec<String> = parts
            .iter()
            .filter_map(|(label, r)| r.machine.driver.as_ref().map(|d| format!("{label}: {d}")))
            .collect();
        let mut versions = BTreeMap::new();
        for (label, r) in parts {
            for (k, v) in &r.machine.versions {
                versions.insert(format!("{label} {k}"), v.clone());
            }
        }
        let machine = Machine {
            device: joined(&|r| r.machine.device.clone()),
            driver: (!drivers.is_empty()).then(|| drivers.join("; ")),
            cpu: joined(&|r| r.machine.cpu.clone()),
            versions,
        };
        let mut out = Self::new(report, command, joined(&|r| r.git_commit.clone()), machine);
        for (label, r) in parts {
            for row in &r.rows {
                let mut row = row.clone();
                row.name = format!("{label}: {}", row.name);
                row = row.with_note(format!(
                    "from {} of {} at {}",
                    r.report, r.date, r.git_commit
                ));
                out.rows.push(row);
            }
        }
        out
    }

    /// Pretty-printed JSON (non-finite numbers become `null`).
    pub fn to_json(&self) -> String {
        // Serializing plain structs of strings, numbers and maps with string keys
        // cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Parses a report.
    ///
    /// # Errors
    ///
    /// [`KptError::InvalidArgument`] naming what is wrong and where (line, column) when
    /// `text` is not JSON or does not follow the schema.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text)
            .map_err(|e| KptError::InvalidArgument(format!("not a kpt report: {e}")))
    }

    /// How many rows meet their target.
    pub fn met_count(&self) -> usize {
        self.rows.iter().filter(|r| r.met).count()
    }

    /// The date part (`YYYY-MM-DD`) of [`Report::date`].
    fn day(&self) -> Result<&str> {
        self.date.get(..10).filter(|d| is_day(d)).ok_or_else(|| {
            KptError::InvalidArgument(format!(
                "report date `{}` does not start with YYYY-MM-DD",
                self.date
            ))
        })
    }

    /// A short header (name, date, command, commit, machine) and an aligned Markdown
    /// table of the rows, then `N of M targets met.`
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(s, "# {} report\n", self.report);
        let _ = writeln!(s, "- date: {}", self.date);
        let _ = writeln!(s, "- command: `{}`", self.command);
        let _ = writeln!(s, "- commit: {}", self.git_commit);
        let _ = writeln!(s, "- device: {}", m.device);
        if let Some(d) = &m.driver {
            let _ = writeln!(s, "- driver: {d}");
        }
        let _ = writeln!(s, "- cpu: {}", m.cpu);
        let versions: Vec<String> = m.versions.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let versions = if versions.is_empty() {
            "–".to_string()
        } else {
            versions.join(", ")
        };
        let _ = writeln!(s, "- versions: {versions}\n");

        let header = [
            "case",
            "metric",
            "kpt",
            "baseline",
            "ratio",
            "target",
            "met",
            "max abs err",
            "notes",
        ]
        .map(String::from);
        let rows: Vec<[String; 9]> = self
            .rows
            .iter()
            .map(|r| {
                let baseline = match (r.baseline, r.baseline_name.is_empty()) {
                    (Some(b), false) => format!("{} ({})", num(b), r.baseline_name),
                    (Some(b), true) => num(b),
                    (None, _) => "–".into(),
                };
                [
                    r.name.clone(),
                    r.metric.clone(),
                    opt(r.kpt, num),
                    baseline,
                    opt(r.ratio, ratio_str),
                    target_str(r),
                    if r.met { "yes" } else { "NO" }.into(),
                    opt(r.max_abs_err, |v| format!("{v:.1e}")),
                    r.notes.clone(),
                ]
                .map(|c| cell(&c))
            })
            .collect();
        let mut widths = [0usize; 9];
        for r in std::iter::once(&header).chain(&rows) {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String; 9]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        s.push_str(&line(&header));
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        let _ = writeln!(s, "|-{}-|", rule.join("-|-"));
        for r in &rows {
            s.push_str(&line(r));
        }
        let _ = writeln!(
            s,
            "\n{} of {} targets met.",
            self.met_count(),
            self.rows.len()
        );
        s
    }

    /// Writes `<report>-latest.json`, `<report>-<YYYY-MM-DD>.json` (the day of
    /// [`Report::date`]), `<report>-latest.md` ([`Report::to_markdown`]) and
    /// `<report>-latest.svg` ([`crate::plot::ratio_chart_svg`]) into `dir`, creating it
    /// if needed; returns the paths in that order.
    ///
    /// # Errors
    ///
    /// [`KptError::InvalidArgument`] when the report name is not a plain file name or
    /// the date does not start with `YYYY-MM-DD`; [`KptError::Io`] when a directory or
    /// file cannot be written.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let name = &self.report;
        if name.is_empty()
            || name == "."
            || name == ".."
            || name.contains(['/', '\\'])
            || name.chars().any(char::is_control)
        {
            return Err(KptError::InvalidArgument(format!(
                "report name `{name}` is not a plain file name"
            )));
        }
        let day = self.day()?;
        std::fs::create_dir_all(dir).map_err(|e| KptError::io(dir, e))?;
        let json = self.to_json() + "\n";
        let files = [
            (format!("{name}-latest.json"), json.clone()),
            (format!("{name}-{day}.json"), json),
            (format!("{name}-latest.md"), self.to_markdown()),
            (
                format!("{name}-latest.svg"),
                crate::plot::ratio_chart_svg(self),
            ),
        ];
        let mut paths = Vec::with_capacity(files.len());
        for (file, text) in files {
            let path = dir.join(file);
            std::fs::write(&path, text).map_err(|e| KptError::io(&path, e))?;
            paths.push(path);
        }
        Ok(paths)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Machine {
        Machine {
            device: "CPU".into(),
            driver: None,
            cpu: "test cpu".into(),
            versions: [("torch".to_string(), "2.11.0".to_string())].into(),
        }
    }

    #[test]
    fn combine_labels_rows_and_keeps_their_runs() {
        let mut gpu = Report::new("models-h200", "bench", "aaa1111", machine());
        gpu.machine.device = "NVIDIA H200".into();
        gpu.machine.driver = Some("580".into());
        gpu.rows
            .push(Row::compared("prefill", "ms", false, 9.3, 16.7, "HF").with_target(9.0));
        let mut cpu = Report::new("models-cpu", "bench", "bbb2222", machine());
        cpu.rows.push(
            Row::compared("decode", "tokens/s", true, 120.0, 100.0, "HF").with_target_ratio(1.0),
        );
        let both = Report::combine("models", "combine", &[("h200", &gpu), ("cpu", &cpu)]);
        assert_eq!(both.report, "models");
        assert_eq!(both.git_commit, "h200: aaa1111; cpu: bbb2222");
        assert_eq!(both.machine.device, "h200: NVIDIA H200; cpu: CPU");
        assert_eq!(both.machine.driver.as_deref(), Some("h200: 580"));
        assert_eq!(both.machine.versions["cpu torch"], "2.11.0");
        let names: Vec<&str> = both.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["h200: prefill", "cpu: decode"]);
        // Values, targets and verdicts are the parts' own.
        assert!(!both.rows[0].met);
        assert!(both.rows[1].met);
        assert_eq!(both.rows[1].ratio, Some(1.2));
        assert!(both.rows[0]
            .notes
            .ends_with(&format!("from models-h200 of {} at aaa1111", gpu.date)));
        assert_eq!(both.met_count(), 1);
    }

    #[test]
    fn ratio_direction_follows_the_metric() {
        let fast = Row::compared("a", "GFLOP/s", true, 200.0, 100.0, "torch");
        assert_eq!(fast.ratio, Some(2.0));
        let slow_rate = Row::compared("a", "GFLOP/s", true, 50.0, 100.0, "torch");
        assert_eq!(slow_rate.ratio, Some(0.5));
        let time = Row::compared("b", "ms", false, 2.0, 4.0, "torch");
        assert_eq!(time.ratio, Some(2.0));
        let slow = Row::compared("c", "ms", false, 4.0, 2.0, "torch");
        assert_eq!(slow.ratio, Some(0.5));
    }

    #[test]
    fn ratio_is_none_without_a_finite_quotient() {
        assert_eq!(Row::compared("d", "x", true, 1.0, 0.0, "t").ratio, None);
        assert_eq!(Row::compared("d", "ms", false, 0.0, 1.0, "t").ratio, None);
        assert_eq!(Row::compared("d", "x", true, 0.0, 0.0, "t").ratio, None);
        let nan = Row::compared("d", "x", true, f64::NAN, 1.0, "t");
        assert_eq!((nan.kpt, nan.ratio, nan.met), (None, None, false));
        let inf = Row::compared("d", "x", true, 1.0, f64::INFINITY, "t");
        assert_eq!((inf.baseline, inf.ratio), (None, None));
    }

    #[test]
    fn met_follows_the_target_kind() {
        let r = Row::compared("a", "GFLOP/s", true, 95.0, 100.0, "torch");
        assert!(r.met, "no target: met when it ran");
        assert!(r.clone().with_target_ratio(0.95).met);
        assert!(!r.clone().with_target_ratio(1.0).met);
        // Lower is better: 4 ms against 5 ms is a ratio of 1.25.
        let t = Row::compared("t", "ms", false, 4.0, 5.0, "torch");
        assert!(t.clone().with_target_ratio(1.25).met);
        assert!(!t.with_target_ratio(1.3).met);
        assert!(Row::absolute("b", "TB/s", true, 2.5).with_target(2.4).met);
        assert!(Row::absolute("b", "TB/s", true, 2.4).with_target(2.4).met);
        assert!(!Row::absolute("b", "TB/s", true, 2.3).with_target(2.4).met);
        assert!(Row::absolute("c", "ms", false, 8.0).with_target(9.0).met);
        assert!(!Row::absolute("c", "ms", false, 10.0).with_target(9.0).met);
        assert!(Row::absolute("e", "ms", false, 10.0).met, "no target: ran");
        // A relative target on a row without a baseline cannot be met.
        assert!(
            !Row::absolute("f", "x", true, 10.0)
                .with_target_ratio(1.0)
                .met
        );
        // Both targets: both must hold.
        let both = Row::compared("g", "GB/s", true, 120.0, 100.0, "torch");
        assert!(both.clone().with_target_ratio(1.1).with_target(110.0).met);
        assert!(!both.clone().with_target_ratio(1.1).with_target(130.0).met);
        assert!(!both.with_target(110.0).with_target_ratio(1.3).met);
    }

    #[test]
    fn not_run_rows_keep_their_place() {
        let r = Row::not_run("d", "ms", false, "torch", "no GPU");
        assert!(!r.met && !r.ran());
        assert_eq!((r.kpt, r.baseline, r.ratio), (None, None, None));
        assert_eq!(
            (r.notes.as_str(), r.baseline_name.as_str()),
            ("no GPU", "torch")
        );
        let r = r
            .with_target_ratio(1.0)
            .with_target(5.0)
            .with_note("retry later");
        assert!(!r.met);
        assert_eq!(r.notes, "no GPU; retry later");
    }

    #[test]
    fn notes_accumulate_and_keep_overrides() {
        let mut r = Row::absolute("a", "x", true, 1.0)
            .with_note("one")
            .with_note("")
            .with_note("two");
        assert_eq!(r.notes, "one; two");
        r.met = false;
        let r = r.with_note("accuracy failed").with_max_abs_err(0.5);
        assert!(!r.met, "notes and errors leave `met` alone");
    }

    #[test]
    fn json_follows_the_schema_and_round_trips_with_nulls() {
        let mut rep = Report::new("cpu", "cmd", "abc", machine());
        rep.rows.push(
            Row::compared("a", "GFLOP/s", true, 812.4, 755.1, "torch.matmul")
                .with_target_ratio(1.03)
                .with_max_abs_err(0.0039),
        );
        rep.rows
            .push(Row::not_run("b", "ms", false, "torch", "why"));
        let json = rep.to_json();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let keys: Vec<&str> = v["rows"][0]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut expected = [
            "name",
            "metric",
            "higher_is_better",
            "kpt",
            "baseline",
            "baseline_name",
            "ratio",
            "target_ratio",
            "target",
            "met",
            "max_abs_err",
            "notes",
        ];
        expected.sort_unstable();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(keys, expected);
        assert!(v["rows"][0]["target"].is_null());
        assert!(v["rows"][1]["kpt"].is_null() && v["rows"][1]["ratio"].is_null());
        assert_eq!(v["rows"][1]["met"], false);
        assert!(v["machine"]["driver"].is_null());
        assert_eq!(Report::from_json(&json).unwrap(), rep);
    }

    #[test]
    fn parses_the_documented_example() {
        let text = r#"{
          "report": "cpu", "date": "2026-11-23T12:00:00Z",
          "command": "cargo xtask bench-cpu", "git_commit": "abc1234",
          "machine": {"device": "AMD EPYC (2 cores)", "driver": null, "cpu": "...",
                      "versions": {"torch": "2.11.0", "kpt": "0.1.0"}},
          "rows": [{"name": "gemm_f32_512", "metric": "GFLOP/s", "higher_is_better": true,
                    "kpt": 812.4, "baseline": 755.1, "baseline_name": "torch.matmul",
                    "ratio": 1.076, "target_ratio": 1.03, "target": null, "met": true,
                    "max_abs_err": 0.0039, "notes": ""}]
        }"#;
        let rep = Report::from_json(text).unwrap();
        assert_eq!(rep.rows[0].ratio, Some(1.076));
        assert_eq!(rep.rows[0].target, None);
        assert_eq!(rep.machine.versions["kpt"], "0.1.0");
        assert_eq!(rep.met_count(), 1);
    }

    #[test]
    fn from_json_rejects_bad_input_clearly() {
        for bad in [
            "",
            "not json",
            "{\"report\": 1}",
            "{\"report\": \"cpu\"}",
            "[]",
        ] {
            let err = Report::from_json(bad).unwrap_err();
            assert!(matches!(err, KptError::InvalidArgument(_)), "{err:?}");
            assert!(err.to_string().contains("not a kpt report"), "{err}");
        }
        let err = Report::from_json("{\"report\": \"cpu\"}").unwrap_err();
        assert!(err.to_string().contains("missing field"), "{err}");
    }

    #[test]
    fn markdown_is_aligned_and_counts_targets() {
        let mut rep = Report::new("cpu", "cargo xtask bench-cpu", "abc1234", machine());
        rep.rows.push(
            Row::compared(
                "gemm_f32_2048",
                "GFLOP/s",
                true,
                171.2,
                168.4,
                "torch.matmul",
            )
            .with_target_ratio(0.95)
            .with_max_abs_err(3.9e-3),
        );
        rep.rows.push(
            Row::compared("softmax", "GB/s", true, 5.0, 4.0, "torch|softmax")
                .with_target_ratio(3.0)
                .with_note("line one\nline two"),
        );
        rep.rows
            .push(Row::absolute("decode", "x", true, 2.5).with_target(123.0));
        rep.rows
            .push(Row::not_run("attention", "ms", false, "sdpa", "no torch"));
        let md = rep.to_markdown();
        assert!(md.contains("# cpu report"), "{md}");
        assert!(md.contains("`cargo xtask bench-cpu`") && md.contains("abc1234"));
        assert!(md.contains("- device: CPU") && md.contains("torch 2.11.0"));
        assert!(md.contains("1 of 4 targets met."), "{md}");
        assert!(md.contains("torch\\|softmax") && md.contains("line one line two"));
        let table: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
        assert_eq!(table.len(), 6, "{md}");
        assert!(table[0].starts_with("| case ") && table[1].starts_with("|---"));
        let len = table[0].chars().count();
        assert!(table.iter().all(|l| l.chars().count() == len), "{md}");
        // Column separators line up on every line.
        let bars = |l: &str| -> Vec<usize> {
            l.chars()
                .enumerate()
                .filter(|&(i, c)| c == '|' && (i == 0 || l.chars().nth(i - 1) != Some('\\')))
                .map(|(i, _)| i)
                .collect()
        };
        assert!(table.iter().all(|l| bars(l) == bars(table[0])), "{md}");
        assert!(md.contains("| 1.02x ") && md.contains(">= 0.95x") && md.contains("| NO "));
        assert!(md.contains("168.4 (torch.matmul)") && md.contains("3.9e-3"));
        assert!(md.contains(">= 123 ") && md.contains("| yes "));
        let not_run = table[5];
        assert!(
            not_run.contains("| –") && not_run.contains("no torch"),
            "{md}"
        );
    }

    #[test]
    fn numbers_keep_four_significant_digits() {
        assert_eq!(num(171.234), "171.2");
        assert_eq!(num(1.23456), "1.235");
        assert_eq!(num(12345.6), "12346");
        assert_eq!(num(0.012345), "0.01235");
        assert_eq!(num(2.5e-7), "2.500e-7");
        assert_eq!(num(0.0), "0.000");
        assert_eq!(trim_zeros("123.0"), "123");
        assert_eq!(trim_zeros("2.500e-7"), "2.5e-7");
        assert_eq!(trim_zeros("12346"), "12346");
        assert_eq!(ratio_str(1.076), "1.08x");
        assert_eq!(ratio_str(0.012345), "0.01235x");
        assert_eq!(target_ratio_str(0.95), "0.95x");
        assert_eq!(target_ratio_str(1.0), "1.00x");
        assert_eq!(target_ratio_str(0.955), "0.955x");
        let lower = Row::absolute("t", "ms", false, 1.0).with_target(9.5);
        assert_eq!(target_str(&lower), "<= 9.5");
        let both = Row::compared("b", "GB/s", true, 2.0, 1.0, "t")
            .with_target_ratio(1.5)
            .with_target(2.0);
        assert_eq!(target_str(&both), ">= 1.50x, >= 2");
    }

    #[test]
    fn write_rejects_unsafe_names_and_dates() {
        let dir = std::env::temp_dir();
        let mut rep = Report::new("../escape", "cmd", "abc", machine());
        assert!(matches!(
            rep.write(&dir),
            Err(KptError::InvalidArgument(m)) if m.contains("not a plain file name")
        ));
        rep.report = "ok".into();
        rep.date = "yesterday".into();
        assert!(matches!(
            rep.write(&dir),
            Err(KptError::InvalidArgument(m)) if m.contains("YYYY-MM-DD")
        ));
        assert!(is_day("2026-11-23") && !is_day("2026/11/23") && !is_day("26-11-2023"));
    }
}
