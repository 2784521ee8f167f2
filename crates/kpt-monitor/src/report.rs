//! The report schema shared by every benchmark report (docs/reports/*.json).
//!
//! `ratio` is kpt over baseline for higher-is-better metrics and baseline over kpt for
//! lower-is-better ones, so a ratio above 1 always means kpt is ahead. `met` is
//! `ratio >= target_ratio`, or `kpt` against `target` for absolute targets; a row with
//! no target is met when it ran. Rows that could not run keep their place with `null`
//! values, `met: false` and the reason in `notes`.

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
    /// GPU driver version, if any.
    pub driver: Option<String>,
    /// The host CPU.
    pub cpu: String,
    /// Software versions (`torch`, `kpt`, ...).
    pub versions: BTreeMap<String, String>,
}

/// One measured case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Case name, e.g. `gemm_bf16_4096`.
    pub name: String,
    /// Unit of `kpt` and `baseline`, e.g. `GFLOP/s` or `ms`.
    pub metric: String,
    /// Whether larger values of the metric are better.
    pub higher_is_better: bool,
    /// kpt's value (`None`: not run).
    pub kpt: Option<f64>,
    /// The baseline's value (`None`: none, or not run).
    pub baseline: Option<f64>,
    /// What the baseline is, e.g. `torch.matmul`.
    pub baseline_name: String,
    /// kpt relative to the baseline; above 1 means kpt is ahead.
    pub ratio: Option<f64>,
    /// The ratio to reach, if the target is relative.
    pub target_ratio: Option<f64>,
    /// The value of `kpt` to reach, if the target is absolute.
    pub target: Option<f64>,
    /// Whether the target is met.
    pub met: bool,
    /// Largest absolute error of kpt's result against the f64 reference.
    pub max_abs_err: Option<f64>,
    /// Anything a reader needs to interpret the row.
    pub notes: String,
}

impl Row {
    fn base(name: &str, metric: &str, higher_is_better: bool, baseline_name: &str) -> Self {
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
    pub fn compared(
        name: &str,
        metric: &str,
        higher_is_better: bool,
        kpt: f64,
        baseline: f64,
        baseline_name: impl Into<String>,
    ) -> Self {
        let mut row = Self::base(name, metric, higher_is_better, "");
        row.baseline_name = baseline_name.into();
        row.kpt = Some(kpt);
        row.baseline = Some(baseline);
        let ratio = if higher_is_better {
            kpt / baseline
        } else {
            baseline / kpt
        };
        row.ratio = (ratio.is_finite() && ratio >= 0.0).then_some(ratio);
        row.update_met();
        row
    }

    /// A kpt measurement with no baseline (an absolute target may follow).
    pub fn absolute(name: &str, metric: &str, higher_is_better: bool, kpt: f64) -> Self {
        let mut row = Self::base(name, metric, higher_is_better, "");
        row.kpt = Some(kpt);
        row.update_met();
        row
    }

    /// A case that could not run, and why.
    pub fn not_run(
        name: &str,
        metric: &str,
        higher_is_better: bool,
        baseline_name: &str,
        why: impl Into<String>,
    ) -> Self {
        Self::base(name, metric, higher_is_better, baseline_name).with_note(why)
    }

    /// Sets a relative target (`ratio >= target_ratio`).
    pub fn with_target_ratio(mut self, target_ratio: f64) -> Self {
        self.target_ratio = Some(target_ratio);
        self.update_met();
        self
    }

    /// Sets an absolute target on `kpt`.
    pub fn with_target(mut self, target: f64) -> Self {
        self.target = Some(target);
        self.update_met();
        self
    }

    /// Records the largest error against the reference.
    pub fn with_max_abs_err(mut self, err: f64) -> Self {
        self.max_abs_err = Some(err);
        self
    }

    /// Appends a note (separated by `; `).
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

    fn update_met(&mut self) {
        let Some(kpt) = self.kpt.filter(|v| v.is_finite()) else {
            self.met = false;
            return;
        };
        self.met = match (self.target_ratio, self.target) {
            (Some(t), _) => self.ratio.is_some_and(|r| r >= t),
            (None, Some(t)) if self.higher_is_better => kpt >= t,
            (None, Some(t)) => kpt <= t,
            (None, None) => true,
        };
    }
}

/// A benchmark report: one run, one machine, many rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Report name; files are `<report>-latest.json` etc.
    pub report: String,
    /// When it ran, RFC 3339 UTC.
    pub date: String,
    /// The command that produced it.
    pub command: String,
    /// The commit measured.
    pub git_commit: String,
    /// Where it ran.
    pub machine: Machine,
    /// The measurements.
    pub rows: Vec<Row>,
}

/// `v` with 4 significant digits (no exponent for everyday magnitudes).
fn num(v: f64) -> String {
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
        (3 - a.log10().floor().max(-3.0) as i32).clamp(0, 6) as usize
    };
    format!("{v:.decimals$}")
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "–".to_string(), f)
}

impl Report {
    /// An empty report dated now.
    pub fn new(
        report: &str,
        command: &str,
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

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Parses a report; errors name what is wrong.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text)
            .map_err(|e| KptError::InvalidArgument(format!("not a kpt report: {e}")))
    }

    /// Rows whose target is met.
    pub fn met_count(&self) -> usize {
        self.rows.iter().filter(|r| r.met).count()
    }

    /// The date part (`YYYY-MM-DD`) of [`Report::date`].
    fn day(&self) -> &str {
        self.date.get(..10).unwrap_or("undated")
    }

    /// A header and an aligned Markdown table of the rows.
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
        let _ = writeln!(s, "- versions: {}\n", versions.join(", "));

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
        ];
        let rows: Vec<[String; 9]> = self
            .rows
            .iter()
            .map(|r| {
                let target = match (r.target_ratio, r.target) {
                    (Some(t), _) => format!(">= {t:.2}x"),
                    (None, Some(t)) if r.higher_is_better => format!(">= {}", num(t)),
                    (None, Some(t)) => format!("<= {}", num(t)),
                    (None, None) => "–".into(),
                };
                let baseline = match r.baseline {
                    Some(b) => format!("{} ({})", num(b), r.baseline_name),
                    None => "–".into(),
                };
                [
                    r.name.clone(),
                    r.metric.clone(),
                    opt(r.kpt, num),
                    baseline,
                    opt(r.ratio, |v| format!("{v:.2}x")),
                    target,
                    if r.met { "yes" } else { "NO" }.into(),
                    opt(r.max_abs_err, |v| format!("{v:.1e}")),
                    r.notes.clone(),
                ]
                .map(|c| c.replace('|', "\\|"))
            })
            .collect();
        let mut widths = header.map(str::len);
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        s.push_str(&line(&header.map(String::from)));
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        s.push_str(&format!("|-{}-|\n", rule.join("-|-")));
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

    /// Writes `<report>-latest.json`, `<report>-<YYYY-MM-DD>.json`, `<report>-latest.md`
    /// and `<report>-latest.svg` into `dir` (created if needed); returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).map_err(|e| KptError::io(dir, e))?;
        let json = self.to_json() + "\n";
        let files = [
            (format!("{}-latest.json", self.report), json.clone()),
            (format!("{}-{}.json", self.report, self.day()), json),
            (format!("{}-latest.md", self.report), self.to_markdown()),
            (
                format!("{}-latest.svg", self.report),
                crate::plot::ratio_chart_svg(self),
            ),
        ];
        let mut paths = Vec::new();
        for (name, text) in files {
            let path = dir.join(name);
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
    fn ratio_direction_follows_the_metric() {
        let fast = Row::compared("a", "GFLOP/s", true, 200.0, 100.0, "torch");
        assert_eq!(fast.ratio, Some(2.0));
        let time = Row::compared("b", "ms", false, 2.0, 4.0, "torch");
        assert_eq!(time.ratio, Some(2.0));
        let slow = Row::compared("c", "ms", false, 4.0, 2.0, "torch");
        assert_eq!(slow.ratio, Some(0.5));
        assert_eq!(Row::compared("d", "x", true, 1.0, 0.0, "t").ratio, None);
    }

    #[test]
    fn met_follows_the_target_kind() {
        let r = Row::compared("a", "GFLOP/s", true, 95.0, 100.0, "torch");
        assert!(r.met, "no target: met when it ran");
        assert!(r.clone().with_target_ratio(0.95).met);
        assert!(!r.clone().with_target_ratio(1.0).met);
        assert!(Row::absolute("b", "TB/s", true, 2.5).with_target(2.4).met);
        assert!(!Row::absolute("b", "TB/s", true, 2.3).with_target(2.4).met);
        assert!(Row::absolute("c", "ms", false, 8.0).with_target(9.0).met);
        assert!(!Row::absolute("c", "ms", false, 10.0).with_target(9.0).met);
        let not_run = Row::not_run("d", "ms", false, "torch", "no GPU").with_target_ratio(1.0);
        assert!(!not_run.met);
        assert_eq!(not_run.notes, "no GPU");
    }

    #[test]
    fn notes_accumulate() {
        let r = Row::absolute("a", "x", true, 1.0)
            .with_note("one")
            .with_note("")
            .with_note("two");
        assert_eq!(r.notes, "one; two");
    }

    #[test]
    fn json_round_trip_keeps_nulls() {
        let mut rep = Report::new("cpu", "cmd", "abc", machine());
        rep.rows
            .push(Row::compared("a", "GFLOP/s", true, 1.5, 1.0, "torch").with_max_abs_err(1e-6));
        rep.rows
            .push(Row::not_run("b", "ms", false, "torch", "why"));
        let json = rep.to_json();
        assert!(json.contains("\"baseline\": null"));
        assert!(json.contains("\"driver\": null"));
        assert_eq!(Report::from_json(&json).unwrap(), rep);
        let err = Report::from_json("{\"report\": 1}").unwrap_err();
        assert!(err.to_string().contains("not a kpt report"), "{err}");
    }

    #[test]
    fn markdown_is_aligned_and_counts_targets() {
        let mut rep = Report::new("cpu", "cmd", "abc", machine());
        rep.rows.push(
            Row::compared(
                "gemm_f32_2048",
                "GFLOP/s",
                true,
                171.2,
                168.4,
                "torch.matmul",
            )
            .with_target_ratio(0.95),
        );
        rep.rows.push(
            Row::compared("softmax", "GB/s", true, 5.0, 4.0, "torch|softmax")
                .with_target_ratio(3.0),
        );
        let md = rep.to_markdown();
        assert!(md.contains("1 of 2 targets met."), "{md}");
        assert!(md.contains("torch\\|softmax"));
        let table: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
        assert_eq!(table.len(), 4);
        let len = table[0].chars().count();
        assert!(table.iter().all(|l| l.chars().count() == len), "{md}");
        assert!(md.contains("| 1.02x ") && md.contains(">= 0.95x") && md.contains("| NO "));
    }

    #[test]
    fn numbers_keep_four_significant_digits() {
        assert_eq!(num(171.234), "171.2");
        assert_eq!(num(1.23456), "1.235");
        assert_eq!(num(12345.6), "12346");
        assert_eq!(num(0.012345), "0.01235");
        assert_eq!(num(2.5e-7), "2.500e-7");
        assert_eq!(num(0.0), "0.000");
    }
}
