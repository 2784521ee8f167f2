//! `kpt-bench-cpu`: kpt's CPU kernels side by side with PyTorch on the CPU, in one run.
//!
//! For every case the kpt kernel and the PyTorch equivalent run in the same process tree
//! on the same cores, with the same number of threads, timed the same way (a clock
//! around each call, warm-up first, median of the calls), alternating kpt and torch in
//! short rounds so that drift of the host hits both. kpt's output is checked against the f64 reference
//! before it is timed. The report (JSON, Markdown, SVG) follows docs/reports' schema.
//! `cargo xtask bench-cpu` installs PyTorch and runs this binary.

mod cases;
mod torch;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kpt::demo::{run_demo, DemoOptions};
use kpt::Runtime;
use kpt_core::config::BackendChoice;
use kpt_core::hardware::cpu_info;
use kpt_core::{KptConfig, OptLevel};
use kpt_monitor::{median, Machine, Report, Row};

use cases::{Case, Workload};
use torch::TorchWorker;

#[derive(Parser, Debug)]
#[command(about = "kpt CPU kernels vs PyTorch on the same machine, same run")]
struct Args {
    /// Python interpreter with torch installed.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The PyTorch worker script.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/torch_cpu.py"))]
    script: PathBuf,
    /// Skip PyTorch (kpt timings and accuracy only; rows are marked not compared).
    #[arg(long)]
    no_torch: bool,
    /// Where the report goes.
    #[arg(long, default_value = "docs/reports")]
    out: PathBuf,
    /// Report name (files are NAME-latest.json etc.).
    #[arg(long, default_value = "cpu")]
    name: String,
    /// Small shapes: a fast smoke test of the harness, not a benchmark.
    #[arg(long)]
    quick: bool,
    /// Only cases whose name contains this (or, comma-separated, any of these); a term
    /// ending in `$` must end the name.
    #[arg(long)]
    filter: Option<String>,
    /// Seconds of timed calls per side and round.
    #[arg(long, default_value_t = 0.4)]
    budget_s: f64,
    /// Skip the demo row (conservative vs balanced per-token latency).
    #[arg(long)]
    no_demo: bool,
    /// The command recorded in the report.
    #[arg(long, default_value = "cargo xtask bench-cpu")]
    command: String,
}

/// Seed of every case's random inputs.
const SEED: u64 = 0x6b70;

/// Alternating kpt / torch rounds per case: the host's throughput drifts over minutes
/// (seen: up to 1.6x on the VM the reports come from), so many short rounds let the
/// drift hit both sides alike.
const ROUNDS: usize = 6;

/// Pause before each side's timed round, in milliseconds.
const IDLE_GAP_MS: u64 = 500;

/// See [`Timing::time`].
const SLOW_CALL_BUDGETS: f64 = 5.0;

/// Timing loop parameters shared by both sides.
#[derive(Clone, Copy)]
struct Timing {
    warmup: usize,
    min_reps: usize,
    max_reps: usize,
    budget_s: f64,
}

impl Timing {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"warmup": self.warmup, "min_reps": self.min_reps,
                           "max_reps": self.max_reps, "budget_s": self.budget_s,
                           "slow_call_budgets": SLOW_CALL_BUDGETS})
    }

    /// The same loop as `time_calls` in torch_cpu.py, run on a worker of rayon's pool
    /// as kpt's executor launches kernels (see docs/decisions.md, "Plan launches on a
    /// pool worker"), the way PyTorch's calls start on the thread that leads its OpenMP
    /// team. A first call longer than [`SLOW_CALL_BUDGETS`] budgets is itself the
    /// measurement (such a call dwarfs any warm-up effect, and repeating it would take
    /// minutes).
    fn time(&self, w: &mut dyn Workload) -> Result<Vec<f64>> {
        rayon::scope(|_| self.time_here(w))
    }

    fn time_here(&self, w: &mut dyn Workload) -> Result<Vec<f64>> {
        for i in 0..self.warmup {
            let t0 = Instant::now();
            w.run()?;
            let t = t0.elapsed().as_secs_f64();
            if i == 0 && t > SLOW_CALL_BUDGETS * self.budget_s {
                return Ok(vec![t]);
            }
        }
        let mut times = Vec::new();
        let start = Instant::now();
        while times.len() < self.max_reps
            && (times.len() < self.min_reps || start.elapsed().as_secs_f64() < self.budget_s)
        {
            let t0 = Instant::now();
            w.run()?;
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(times)
    }
}

/// Runs one case on both sides and makes its report row.
fn run_case(
    case: &Case,
    torch: Option<&mut TorchWorker>,
    timing: Timing,
    pb: &ProgressBar,
) -> Result<Row> {
    let (metric, work) = case.metric();
    let rate = |secs: f64| work / secs / 1e9;
    pb.set_message(format!("{}: checking", case.name));
    let mut w = case.prepare(SEED);
    w.run()?;
    let check = w.check()?;
    let Some(torch) = torch else {
        pb.set_message(format!("{}: kpt", case.name));
        let kpt = median(&timing.time(w.as_mut())?).unwrap_or(f64::NAN);
        return Ok(Row::absolute(&case.name, metric, true, rate(kpt))
            .with_max_abs_err(check.max_abs_err)
            .with_note("PyTorch not run (--no-torch)"));
    };
    let mut request = case.torch_request();
    for (k, v) in timing.json().as_object().into_iter().flatten() {
        request[k] = v.clone();
    }
    let mut kpt_times = Vec::new();
    let mut torch_times: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    // Alternating rounds; one when a call of either side is too slow to repeat.
    // Each side starts after an idle gap: thread pools that spin-wait after their last
    // task (OpenMP's and rayon's) must not steal cores from the other side's timing.
    let settle = || std::thread::sleep(std::time::Duration::from_millis(IDLE_GAP_MS));
    for round in 1..=ROUNDS {
        pb.set_message(format!("{}: kpt (round {round})", case.name));
        settle();
        kpt_times.extend(timing.time(w.as_mut())?);
        pb.set_message(format!("{}: torch (round {round})", case.name));
        settle();
        for (name, t) in torch.time(&request)? {
            torch_times.entry(name).or_default().extend(t);
        }
        let slow = |t: &Vec<f64>| t.len() == 1;
        if slow(&kpt_times) || torch_times.values().any(slow) {
            break;
        }
    }
    // The strongest PyTorch variant is the baseline; the others go into the notes.
    let medians: Vec<(String, f64)> = torch_times
        .iter()
        .map(|(n, t)| (n.clone(), median(t).unwrap_or(f64::NAN)))
        .collect();
    let (best_name, best) = medians
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .context("the PyTorch worker timed nothing")?;
    let kpt = median(&kpt_times).unwrap_or(f64::NAN);
    let mut row = Row::compared(&case.name, metric, true, rate(kpt), rate(best), best_name)
        .with_target_ratio(case.target_ratio)
        .with_max_abs_err(check.max_abs_err);
    row = row.with_note(format!(
        "median of {} kpt / {} torch calls: {:.3} / {:.3} ms",
        kpt_times.len(),
        torch_times.values().map(Vec::len).max().unwrap_or(0),
        kpt * 1e3,
        best * 1e3
    ));
    for (name, t) in medians.iter().filter(|(_, t)| *t != best) {
        row = row.with_note(format!("{name}: {:.3} ms", t * 1e3));
    }
    if check.failures > 0 {
        row = row.with_note(format!(
            "ACCURACY: {} of {} checked outputs outside tolerance",
            check.failures, check.compared
        ));
        row.met = false;
    }
    Ok(row)
}

/// Rounds of the demo row: each runs both levels (in alternating order), so that drift
/// of the host hits both.
const DEMO_ROUNDS: usize = 5;

/// Per-token decode latency of the demo model, conservative vs balanced: the median
/// ms/token of each level over [`DEMO_ROUNDS`] rounds of the whole demo (32 greedy
/// tokens per level and round, each validated).
fn demo_row(pb: &ProgressBar) -> Result<Row> {
    const NAME: &str = "demo_decode_speedup_balanced_vs_conservative";
    const METRIC: &str = "x (ms/token ratio)";
    // The CPU, whatever else the machine has (`auto` would pick a GPU).
    let mut config = KptConfig::default();
    config.hardware.backend = BackendChoice::Cpu;
    let rt = Runtime::new(config)?;
    let (mut cons, mut bal, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut failed = None;
    for round in 0..DEMO_ROUNDS {
        let mut levels = vec![OptLevel::Conservative, OptLevel::Balanced];
        if round % 2 == 1 {
            levels.reverse();
        }
        let opts = DemoOptions {
            levels,
            ..DemoOptions::default()
        };
        let rows = run_demo(&rt, &opts, |m| {
            pb.set_message(format!("demo round {}/{DEMO_ROUNDS}: {m}", round + 1))
        })?
        .rows;
        let ms = |level: OptLevel| {
            rows.iter()
                .find(|r| r.level == level.to_string())
                .map(|r| r.ms_per_token)
                .with_context(|| format!("demo did not run level {level}"))
        };
        let (c, b) = (ms(OptLevel::Conservative)?, ms(OptLevel::Balanced)?);
        cons.push(c);
        bal.push(b);
        ratios.push(c / b);
        if let Some(bad) = rows.iter().find(|r| !r.passed) {
            failed = Some(bad.level.clone());
        }
    }
    let (c, b) = (
        median(&cons).context("no demo round")?,
        median(&bal).context("no demo round")?,
    );
    ratios.sort_by(f64::total_cmp);
    let mut row = Row::absolute(NAME, METRIC, true, c / b)
        .with_target(2.0)
        .with_note(format!(
            "median of {DEMO_ROUNDS} alternating rounds: conservative {c:.2} ms/token, \
             balanced {b:.2} ms/token; per-round ratios {:.2}-{:.2}",
            ratios[0],
            ratios[ratios.len() - 1]
        ));
    if let Some(level) = failed {
        row = row.with_note(format!("VALIDATION FAILED at level {level}"));
        row.met = false;
    }
    Ok(row)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let threads = rayon::current_num_threads();
    let cpu = cpu_info();
    let mut torch = if args.no_torch {
        None
    } else {
        Some(TorchWorker::start(
            &args.python,
            &args.script,
            threads,
            &[],
        )?)
    };
    let mut versions = std::collections::BTreeMap::new();
    versions.insert("kpt".to_string(), env!("CARGO_PKG_VERSION").to_string());
    if let Some(t) = &torch {
        let s = |k: &str| t.info[k].as_str().unwrap_or("?").to_string();
        versions.insert("torch".into(), s("torch_full"));
        versions.insert("torch_cpu_capability".into(), s("cpu_capability"));
        versions.insert("torch_threads".into(), t.info["threads"].to_string());
    }
    versions.insert("kpt_threads".into(), threads.to_string());
    let machine = Machine {
        device: format!(
            "CPU: {} ({} logical cores)",
            cpu.model_name, cpu.logical_cores
        ),
        driver: None,
        cpu: format!("{} [{}]", cpu.model_name, cpu.features.names().join(" ")),
        versions,
    };
    let mut report = Report::new(
        &args.name,
        &args.command,
        kpt_benches::git_commit(),
        machine,
    );

    let cases: Vec<Case> = cases::all(args.quick)
        .into_iter()
        .filter(|c| kpt_benches::filter_matches(args.filter.as_deref(), &c.name))
        .collect();
    let run_demo_row = !args.no_demo && !args.quick && args.filter.is_none();
    let pb = ProgressBar::new(cases.len() as u64 + run_demo_row as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}] {msg}")
            .context("progress template")?,
    );
    let timing = Timing {
        warmup: 1,
        min_reps: if args.quick { 2 } else { 3 },
        max_reps: 200,
        budget_s: if args.quick { 0.01 } else { args.budget_s },
    };
    for case in &cases {
        let row = run_case(case, torch.as_mut(), timing, &pb).unwrap_or_else(|e| {
            Row::not_run(&case.name, case.metric().0, true, "torch", format!("{e:#}"))
        });
        let line = format!(
            "{:<44} {:>10} {}",
            row.name,
            row.ratio.map_or("–".into(), |r| format!("{r:.2}x")),
            row.kpt
                .map_or("–".into(), |v| format!("{v:.1} {}", row.metric))
        );
        // A hidden bar (output not a terminal) drops `println`; keep the log.
        if pb.is_hidden() {
            eprintln!("{line}");
        } else {
            pb.println(line);
        }
        report.rows.push(row);
        pb.inc(1);
    }
    if run_demo_row {
        let row = demo_row(&pb).unwrap_or_else(|e| {
            Row::not_run(
                "demo_decode_speedup_balanced_vs_conservative",
                "x (ms/token ratio)",
                true,
                "kpt conservative level",
                format!("{e:#}"),
            )
        });
        report.rows.push(row);
        pb.inc(1);
    }
    pb.finish_and_clear();
    print!("{}", report.to_markdown());
    for path in report.write(&args.out)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}
