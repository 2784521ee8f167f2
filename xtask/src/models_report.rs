//! `cargo xtask models-report`: the models issue asks for one report,
//! `docs/reports/models-latest.*`, with the GPU and the CPU comparisons. Each is measured
//! by its own run on its own machine (`kpt-bench-models`: `models-<gpu>-*` from the GPU
//! bundle, `models-cpu-*` from `cargo xtask bench-models`); this puts the newest of each
//! into one report with [`Report::combine`], rows labelled with the run they come from.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kpt_monitor::Report;

/// The name of the combined report (files `models-latest.*`).
const NAME: &str = "models";

/// Reads `<name>-latest.json` of `dir`.
fn read(dir: &Path, name: &str) -> Result<Report> {
    let path = dir.join(format!("{name}-latest.json"));
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Report::from_json(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The newest (by its `date`) `models-*-latest.json` of `dir` other than `cpu` and the
/// combined report itself: its name and the report.
fn newest_gpu(dir: &Path, cpu: &str) -> Result<(String, Report)> {
    let mut best: Option<(String, Report)> = None;
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let file = entry?.file_name().to_string_lossy().into_owned();
        let Some(name) = file.strip_suffix("-latest.json") else {
            continue;
        };
        if !name.starts_with("models-") || name == cpu || name == NAME {
            continue;
        }
        let report = read(dir, name)?;
        if best.as_ref().is_none_or(|(_, b)| report.date > b.date) {
            best = Some((name.to_string(), report));
        }
    }
    match best {
        Some(found) => Ok(found),
        None => bail!(
            "no GPU model report (models-<gpu>-latest.json) in {}",
            dir.display()
        ),
    }
}

/// Writes `models-latest.{json,md,svg}` (and the dated JSON) into `dir` from the GPU
/// report `gpu` (default: the newest) and the CPU report `cpu`.
pub fn write(dir: &Path, gpu: Option<&str>, cpu: &str) -> Result<()> {
    let (gpu, g) = match gpu {
        Some(name) => (name.to_string(), read(dir, name)?),
        None => newest_gpu(dir, cpu)?,
    };
    let label = |name: &str| name.strip_prefix("models-").unwrap_or(name).to_string();
    let c = read(dir, cpu)?;
    let (gl, cl) = (label(&gpu), label(cpu));
    let report = Report::combine(NAME, "cargo xtask models-report", &[(&gl, &g), (&cl, &c)]);
    let paths: Vec<PathBuf> = report.write(dir)?;
    append_misses(dir, &report, &[&gpu, cpu])?;
    for p in paths {
        println!("wrote {}", p.display());
    }
    println!(
        "{} of {} targets met",
        report.met_count(),
        report.rows.len()
    );
    Ok(())
}

/// Ends `models-latest.md` with the rows that missed their target and the notes of the
/// runs (`<name>-notes.md`, where `dir` has them), which state each miss's cause.
fn append_misses(dir: &Path, report: &Report, runs: &[&str]) -> Result<()> {
    let missed: Vec<&str> = report
        .rows
        .iter()
        .filter(|r| !r.met && (r.target_ratio.is_some() || r.target.is_some()))
        .map(|r| r.name.as_str())
        .collect();
    if missed.is_empty() {
        return Ok(());
    }
    let notes: Vec<String> = runs
        .iter()
        .map(|run| format!("{run}-notes.md"))
        .filter(|file| dir.join(file).is_file())
        .map(|file| format!("[{file}]({file})"))
        .collect();
    let mut text = format!("\nMissed: {}.", missed.join("; "));
    if !notes.is_empty() {
        text += &format!(
            " Each miss's cause, and what was tried, is stated in {}.",
            notes.join(" and ")
        );
    }
    let md = dir.join(format!("{NAME}-latest.md"));
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&md)
        .with_context(|| format!("appending to {}", md.display()))?;
    std::io::Write::write_all(&mut file, format!("{text}\n").as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kpt_monitor::{Machine, Row};

    fn report(dir: &Path, name: &str, date: &str) {
        let machine = Machine {
            device: name.into(),
            driver: None,
            cpu: "cpu".into(),
            versions: Default::default(),
        };
        let mut r = Report::new(name, "bench", "abc1234", machine);
        r.date = date.into();
        r.rows
            .push(Row::compared("decode", "tokens/s", true, 2.0, 1.0, "HF").with_target_ratio(1.0));
        std::fs::write(dir.join(format!("{name}-latest.json")), r.to_json()).unwrap();
    }

    #[test]
    fn combines_the_newest_gpu_report_with_the_cpu_one() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        report(d, "models-h100", "2026-11-26T22:40:00Z");
        report(d, "models-h200", "2026-11-28T14:30:00Z");
        report(d, "models-cpu", "2026-11-28T11:33:00Z");
        std::fs::write(d.join("cpu-latest.json"), "not a models report").unwrap();
        assert_eq!(newest_gpu(d, "models-cpu").unwrap().0, "models-h200");
        write(d, None, "models-cpu").unwrap();
        let both = read(d, NAME).unwrap();
        let names: Vec<&str> = both.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["h200: decode", "cpu: decode"]);
        let md = std::fs::read_to_string(d.join("models-latest.md")).unwrap();
        assert!(!md.contains("Missed:"), "{md}");
        // Written again, the combined report is not taken for a GPU one.
        assert_eq!(newest_gpu(d, "models-cpu").unwrap().0, "models-h200");
    }

    #[test]
    fn missed_rows_are_listed_with_the_notes_that_explain_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        report(d, "models-h200", "2026-11-28T14:30:00Z");
        let machine = Machine {
            device: "cpu".into(),
            driver: None,
            cpu: "cpu".into(),
            versions: Default::default(),
        };
        let mut cpu = Report::new("models-cpu", "bench", "abc1234", machine);
        cpu.rows
            .push(Row::compared("prefill", "ms", false, 2.0, 1.0, "HF").with_target_ratio(1.0));
        std::fs::write(d.join("models-cpu-latest.json"), cpu.to_json()).unwrap();
        std::fs::write(d.join("models-cpu-notes.md"), "# notes").unwrap();
        write(d, None, "models-cpu").unwrap();
        let md = std::fs::read_to_string(d.join("models-latest.md")).unwrap();
        assert!(
            md.contains(
                "Missed: cpu: prefill. Each miss's cause, and what was tried, is stated \
                         in [models-cpu-notes.md](models-cpu-notes.md)."
            ),
            "{md}"
        );
    }

    #[test]
    fn a_missing_report_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = write(dir.path(), Some("models-h200"), "models-cpu").unwrap_err();
        assert!(
            format!("{err:#}").contains("models-h200-latest.json"),
            "{err:#}"
        );
        assert!(newest_gpu(dir.path(), "models-cpu").is_err());
    }
}
