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
        assert!(d.join("models-latest.md").is_file());
        // Written again, the combined report is not taken for a GPU one.
        assert_eq!(newest_gpu(d, "models-cpu").unwrap().0, "models-h200");
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
