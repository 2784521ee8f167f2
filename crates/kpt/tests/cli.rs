//! The `kpt` binary: exit codes, output and error messages of its subcommands.
//!
//! Every command runs with the `KPT_*` variables of the test environment removed, so
//! that only the variables a test sets are seen.

use std::path::Path;
use std::process::{Command, Output};

/// A `kpt` command with a clean `KPT_*` environment.
fn kpt(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kpt"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("KPT_") {
            cmd.env_remove(&name);
        }
    }
    cmd.args(args);
    cmd
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("the kpt binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs and asserts success; returns stdout.
fn ok(cmd: &mut Command) -> String {
    let o = run(cmd);
    assert!(
        o.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// Runs and asserts failure with a non-zero exit code; returns stderr.
fn fails(cmd: &mut Command) -> String {
    let o = run(cmd);
    assert!(
        !o.status.success(),
        "{cmd:?} should fail:\nstdout:\n{}\nstderr:\n{}",
        stdout(&o),
        stderr(&o)
    );
    assert_ne!(o.status.code(), Some(0));
    assert!(
        o.status.code().is_some(),
        "{cmd:?} was killed by a signal: {}",
        o.status
    );
    stderr(&o)
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temp path")
}

#[test]
fn detect_prints_the_cpu() {
    let out = ok(&mut kpt(&["detect"]));
    assert!(out.starts_with("cpu 0: "), "{out}");
    assert!(out.contains("arch") && out.contains("features"), "{out}");
}

#[test]
fn detect_json_has_one_cpu() {
    let out = ok(&mut kpt(&["detect", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let devices = v.as_array().expect("a JSON array of devices");
    // The CPU comes first; a GPU machine lists its accelerators after it.
    assert_eq!(
        devices.iter().filter(|d| d["kind"] == "cpu").count(),
        1,
        "{out}"
    );
    assert_eq!(devices[0]["kind"], "cpu", "{out}");
    assert_eq!(devices[0]["index"], 0, "{out}");
    assert!(
        devices[0]["name"].as_str().is_some_and(|n| !n.is_empty()),
        "{out}"
    );
    assert!(devices[0]["features"].is_array(), "{out}");
}

#[test]
fn kernels_lists_the_catalog() {
    let out = ok(&mut kpt(&["kernels"]));
    for name in [
        "cpu.attention.flash",
        "cpu.linear.fused",
        "cpu.rms_norm",
        "cpu.reference",
    ] {
        assert!(out.contains(name), "{name} missing:\n{out}");
    }
    let out = ok(&mut kpt(&["kernels", "--op", "linear"]));
    assert!(
        out.contains("cpu.linear.fused") && !out.contains("cpu.attention.flash"),
        "{out}"
    );
}

#[test]
fn kernels_explain_shows_the_selection() {
    let out = ok(&mut kpt(&[
        "kernels",
        "--op",
        "attention",
        "--explain",
        "--device",
        "cpu",
    ]));
    assert!(out.contains("selected"), "{out}");
    assert!(out.contains("cpu.attention.flash"), "{out}");
    assert!(out.contains("fallback #1"), "{out}");
    // Explaining every op works too.
    let out = ok(&mut kpt(&["kernels", "--explain", "--device", "cpu"]));
    assert_eq!(
        out.matches("selected").count(),
        kpt_core::OpKind::ALL.len(),
        "one selection per op:\n{out}"
    );
}

#[test]
fn kernels_explain_reports_disabled_kernels_from_the_environment() {
    let out =
        ok(kpt(&["kernels", "--op", "softmax", "--explain"])
            .env("KPT_KERNEL__DISABLE", "cpu.softmax"));
    assert!(out.contains("disabled"), "{out}");
}

#[test]
fn kernels_of_an_unknown_op_fail() {
    let err = fails(&mut kpt(&["kernels", "--op", "convolution"]));
    assert!(err.contains("unknown op"), "{err}");
    assert!(err.contains("convolution"), "{err}");
}

#[test]
fn config_init_then_validate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kpt.toml");
    let out = ok(&mut kpt(&["config", "init", path_str(&path)]));
    assert!(out.contains("wrote"), "{out}");
    assert!(path.exists());
    let out = ok(&mut kpt(&[
        "--config",
        path_str(&path),
        "config",
        "validate",
    ]));
    assert!(out.contains("valid"), "{out}");
    let out = ok(&mut kpt(&["config", "validate", path_str(&path)]));
    assert!(out.contains("valid"), "{out}");
    // The file round-trips: `config show` with it prints the same settings.
    let shown = ok(&mut kpt(&["--config", path_str(&path), "config", "show"]));
    assert_eq!(shown, std::fs::read_to_string(&path).unwrap());
    // init refuses to overwrite without --force.
    let err = fails(&mut kpt(&["config", "init", path_str(&path)]));
    assert!(err.contains("--force"), "{err}");
    ok(&mut kpt(&["config", "init", "--force", path_str(&path)]));
    // JSON works as well.
    let json = dir.path().join("kpt.json");
    ok(&mut kpt(&["config", "init", path_str(&json)]));
    ok(&mut kpt(&[
        "--config",
        path_str(&json),
        "config",
        "validate",
    ]));
}

#[test]
fn config_validate_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[precision]\ncompute_dtype = \"i8\"\n[deploy]\nport = 0\n",
    )
    .unwrap();
    let err = fails(&mut kpt(&[
        "--config",
        path_str(&path),
        "config",
        "validate",
    ]));
    assert!(err.contains("precision.compute_dtype"), "{err}");
    assert!(err.contains("deploy.port"), "{err}");
    assert!(err.contains("2 problem"), "{err}");
    let err = fails(&mut kpt(&["config", "validate", path_str(&path)]));
    assert!(
        err.contains("precision.compute_dtype") && err.contains("deploy.port"),
        "{err}"
    );
    // Commands that need a valid configuration refuse it too.
    let err = fails(&mut kpt(&["--config", path_str(&path), "kernels"]));
    assert!(err.contains("deploy.port"), "{err}");
}

#[test]
fn config_file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let err = fails(&mut kpt(&[
        "--config",
        path_str(&missing),
        "config",
        "show",
    ]));
    assert!(err.contains("missing.toml"), "{err}");
    let unknown = dir.path().join("unknown.toml");
    std::fs::write(&unknown, "[precision]\nno_such_field = 1\n").unwrap();
    let err = fails(&mut kpt(&[
        "--config",
        path_str(&unknown),
        "config",
        "validate",
    ]));
    assert!(err.contains("no_such_field"), "{err}");
    let yaml = dir.path().join("kpt.yaml");
    std::fs::write(&yaml, "precision: {}\n").unwrap();
    let err = fails(&mut kpt(&["--config", path_str(&yaml), "config", "show"]));
    assert!(err.contains(".toml"), "{err}");
}

#[test]
fn a_bad_environment_variable_is_named() {
    let err = fails(kpt(&["config", "show"]).env("KPT_PRECISION__LEVEL", "bogus"));
    assert!(err.contains("KPT_PRECISION__LEVEL"), "{err}");
    assert!(err.contains("bogus"), "{err}");
}

#[test]
fn environment_variables_override_the_file() {
    let out = ok(kpt(&["config", "show", "--json"]).env("KPT_PRECISION__LEVEL", "aggressive"));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["precision"]["level"], "aggressive", "{out}");
}

#[test]
fn config_show_json_parses() {
    let out = ok(&mut kpt(&["config", "show", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let sections = v.as_object().expect("a JSON object");
    for s in ["precision", "deploy", "kernel", "hardware"] {
        assert!(sections.contains_key(s), "{s} missing: {out}");
    }
    assert_eq!(v["precision"]["compute_dtype"], "f32", "{out}");
}

#[test]
fn usage_errors_exit_non_zero() {
    let err = fails(&mut kpt(&["no-such-command"]));
    assert!(
        err.contains("no-such-command") || err.contains("unrecognized"),
        "{err}"
    );
    let out = ok(&mut kpt(&["--help"]));
    for cmd in [
        "detect", "config", "kernels", "validate", "bench", "demo", "run", "embed",
    ] {
        assert!(out.contains(cmd), "{cmd} missing from --help:\n{out}");
    }
}

/// `bench --quick` takes well under a second in a debug (opt-level 2) build.
#[test]
fn bench_quick_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.json");
    let start = std::time::Instant::now();
    let out = ok(&mut kpt(&[
        "bench",
        "--quick",
        "--iters",
        "2",
        "--device",
        "cpu",
        "--json",
        path_str(&path),
    ]));
    let elapsed = start.elapsed();
    assert!(
        out.contains("cpu.attention.flash") && out.contains("median"),
        "{out}"
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let results = v.as_array().expect("a JSON array of results");
    assert!(!results.is_empty(), "{text}");
    for r in results {
        assert!(
            r["name"].is_string() && r["kernel"].as_str().is_some_and(|k| k.starts_with("cpu.")),
            "{r}"
        );
        assert!(r["median_us"].as_f64().is_some_and(|t| t > 0.0), "{r}");
    }
    assert!(elapsed.as_secs() < 60, "bench --quick took {elapsed:?}");
}

/// Whether `kpt detect` sees a CUDA device on this machine.
fn cuda_present() -> bool {
    let out = ok(&mut kpt(&["detect", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    v.as_array()
        .expect("a JSON array of devices")
        .iter()
        .any(|d| d["kind"] == "cuda")
}

#[test]
fn device_cpu_runs_on_the_cpu_whatever_the_environment_says() {
    let out = ok(
        kpt(&["bench", "--quick", "--iters", "1", "--device", "cpu"])
            .env("KPT_BACKEND", "cuda")
            .env("KPT_HARDWARE__BACKEND", "tpu"),
    );
    assert!(out.contains("cpu.attention.flash"), "{out}");
    let out = ok(kpt(&["--device", "cpu", "validate"]).env("KPT_BACKEND", "rocm"));
    assert!(out.contains("within tolerance"), "{out}");
}

#[test]
fn device_wins_over_the_file_and_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kpt.toml");
    std::fs::write(&path, "[hardware]\nbackend = \"tpu\"\n").unwrap();
    let show = |extra: &[&str]| {
        let mut args = vec!["--config", path_str(&path), "config", "show", "--json"];
        args.extend_from_slice(extra);
        let out = ok(kpt(&args).env("KPT_BACKEND", "rocm"));
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        v["hardware"]["backend"].as_str().map(String::from)
    };
    assert_eq!(
        show(&[]).as_deref(),
        Some("rocm"),
        "the environment wins over the file"
    );
    assert_eq!(show(&["--device", "cpu"]).as_deref(), Some("cpu"));
    assert_eq!(show(&["--device", "CUDA"]).as_deref(), Some("cuda"));
}

/// `--device cuda` on a machine without a usable GPU: every command that runs work
/// fails at once, with the typed backend error that says why and what is present.
#[test]
fn device_cuda_without_a_gpu_fails_with_a_clear_error() {
    if cuda_present() {
        eprintln!("SKIPPED: a CUDA device is present, so --device cuda is not an error here");
        return;
    }
    for args in [
        &["demo", "--device", "cuda"][..],
        &["--device", "cuda", "validate"],
        &["bench", "--quick", "--iters", "1", "--device", "cuda"],
        &[
            "kernels",
            "--op",
            "softmax",
            "--explain",
            "--device",
            "cuda",
        ],
    ] {
        let o = run(&mut kpt(args));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}\n{err}", o.status);
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
        assert!(
            err.contains("error: backend cuda: no cuda device available"),
            "{args:?}:\n{err}"
        );
        assert!(
            err.contains("driver") || err.contains("`cuda` cargo feature"),
            "{args:?} does not name the cause:\n{err}"
        );
        assert!(err.contains("Devices present: cpu ("), "{args:?}:\n{err}");
        assert!(err.contains("kpt detect"), "{args:?}:\n{err}");
        assert!(stdout(&o).is_empty(), "{args:?} printed:\n{}", stdout(&o));
    }
}

/// `--device rocm` on a machine without an AMD GPU: the runtime is missing (here forced
/// with `KPT_HIP_LIBRARY`), or loaded and seeing no device (Debian's libamdhip64 without
/// a GPU), and either way the error says so.
#[test]
fn device_without_hardware_says_why() {
    if !cfg!(feature = "rocm") {
        let err = fails(&mut kpt(&["bench", "--quick", "--device", "rocm"]));
        assert!(err.contains("without the `rocm` cargo feature"), "{err}");
        return;
    }
    let err = fails(
        kpt(&["bench", "--quick", "--device", "rocm"])
            .env("KPT_HIP_LIBRARY", "/nonexistent/libamdhip64.so"),
    );
    assert!(err.contains("no ROCm runtime found ("), "{err}");
    assert!(err.contains("/nonexistent/libamdhip64.so"), "{err}");
    assert!(err.contains("Devices present: cpu ("), "{err}");
    let err = fails(&mut kpt(&["bench", "--quick", "--device", "rocm"]));
    assert!(
        err.contains("no ROCm runtime found (") || err.contains("sees no AMD GPU"),
        "{err}"
    );
    let err = fails(&mut kpt(&["--device", "tpu", "validate"]));
    assert!(err.contains("no PJRT plugin"), "{err}");
}

/// `kpt kernels --explain --on mi300x` shows what the ROCm backend would run on an
/// MI300X with rocBLAS: its GEMM for linear layers, the host reference for an op with no
/// code object for gfx942 until one is shipped.
#[test]
fn kernels_explain_on_a_recorded_mi300x() {
    if !cfg!(feature = "rocm") {
        return;
    }
    let out = ok(&mut kpt(&[
        "kernels",
        "--explain",
        "--on",
        "mi300x",
        "--op",
        "linear",
    ]));
    assert!(
        out.contains("AMD Instinct MI300X (gfx942, recorded"),
        "{out}"
    );
    let selected = out
        .lines()
        .find(|l| l.contains("selected"))
        .unwrap_or_else(|| panic!("nothing selected:\n{out}"));
    assert!(selected.contains("amd.linear.rocblas"), "{out}");
}

/// With a PJRT plugin named (XLA's CPU plugin under `cargo xtask test`), the demo model
/// validates on XLA.
#[test]
fn validate_runs_on_a_named_pjrt_plugin() {
    let Some(plugin) = std::env::var_os("KPT_PJRT_PLUGIN") else {
        eprintln!("skipped: KPT_PJRT_PLUGIN is not set");
        return;
    };
    let o = run(kpt(&["--device", "tpu", "validate"]).env("KPT_PJRT_PLUGIN", plugin));
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("xla.rms_norm"), "{out}");
}

/// `kpt detect` describes the devices of a named PJRT plugin: the topology's device
/// count in the table, and in JSON the same with the reason memory is not known (XLA's
/// CPU plugin keeps no memory statistics).
#[test]
fn detect_describes_the_devices_of_a_named_pjrt_plugin() {
    let Some(plugin) = std::env::var_os("KPT_PJRT_PLUGIN") else {
        eprintln!("skipped: KPT_PJRT_PLUGIN is not set");
        return;
    };
    let out = ok(kpt(&["detect"]).env("KPT_PJRT_PLUGIN", &plugin));
    assert!(out.contains("topology_devices"), "{out}");
    let out = ok(kpt(&["detect", "--json"]).env("KPT_PJRT_PLUGIN", &plugin));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let xla: Vec<_> = v
        .as_array()
        .expect("a JSON array of devices")
        .iter()
        .filter(|d| d["kind"] == "tpu")
        .collect();
    assert!(!xla.is_empty(), "{out}");
    for d in &xla {
        let p = &d["properties"];
        let n: usize = p["topology_devices"]
            .as_str()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no topology_devices: {d}"));
        assert!(n >= xla.len(), "{out}");
        if p["pjrt_platform"] == "cpu" {
            assert!(
                p["memory_stats"]
                    .as_str()
                    .is_some_and(|m| m.contains("UNIMPLEMENTED")),
                "{d}"
            );
            assert!(d["memory_bytes"].is_null(), "{d}");
        }
    }
}

/// The value of the sample `name` in OpenMetrics `text` (one backend, so one sample).
fn metric(text: &str, name: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"));
    assert!(line.contains("backend=\"xla-cpu:0\""), "{line}");
    line.rsplit_once(' ')
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no value in {line}"))
}

/// `kpt demo --metrics` on the XLA backend writes the compile cache's counters as
/// OpenMetrics text: the demo compiles each op's program once and reuses it, so there
/// are hits and misses, and the hit ratio is hits over both.
#[test]
fn demo_writes_compile_cache_metrics_on_a_named_pjrt_plugin() {
    let Some(plugin) = std::env::var_os("KPT_PJRT_PLUGIN") else {
        eprintln!("skipped: KPT_PJRT_PLUGIN is not set");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kpt.prom");
    let out = ok(kpt(&[
        "--device",
        "tpu",
        "demo",
        "--tokens",
        "3",
        "--level",
        "conservative",
        "--metrics",
        path_str(&path),
    ])
    .env("KPT_PJRT_PLUGIN", plugin));
    assert!(out.contains("xla_compile_cache_hits"), "{out}");
    let text = std::fs::read_to_string(&path).expect("the metrics file");
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.contains("# TYPE kpt_xla_compile_cache_hits counter"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE kpt_xla_compile_cache_entries gauge"),
        "{text}"
    );
    assert!(
        text.contains("# UNIT kpt_xla_compile_cache_bytes bytes"),
        "{text}"
    );
    let hits = metric(&text, "kpt_xla_compile_cache_hits_total");
    let misses = metric(&text, "kpt_xla_compile_cache_misses_total");
    assert!(hits > 0.0 && misses > 0.0, "{text}");
    assert!(
        metric(&text, "kpt_xla_compile_cache_entries") > 0.0,
        "{text}"
    );
    assert!(metric(&text, "kpt_xla_compile_cache_bytes") > 0.0, "{text}");
    assert!(metric(&text, "kpt_xla_programs") > 0.0, "{text}");
    let ratio = metric(&text, "kpt_xla_compile_cache_hit_ratio");
    assert!((ratio - hits / (hits + misses)).abs() < 1e-12, "{text}");
}

#[test]
fn an_unknown_device_is_a_usage_error() {
    let o = run(&mut kpt(&["demo", "--device", "gpu"]));
    assert_eq!(o.status.code(), Some(2), "{}", o.status);
    let err = stderr(&o);
    assert!(err.contains("'gpu'"), "{err}");
    for name in ["auto", "cpu", "cuda", "rocm", "tpu"] {
        assert!(err.contains(name), "{name} missing: {err}");
    }
}

#[test]
fn bench_profile_lists_every_kernel_that_ran() {
    let out = ok(&mut kpt(&[
        "--device",
        "cpu",
        "bench",
        "--quick",
        "--iters",
        "2",
        "--profile",
    ]));
    let profile = out
        .split("kernel profile on cpu")
        .nth(1)
        .unwrap_or_else(|| panic!("no profile in:\n{out}"));
    for kernel in ["cpu.attention.flash", "cpu.rms_norm", "cpu.softmax"] {
        let line = profile
            .lines()
            .find(|l| l.starts_with(kernel))
            .unwrap_or_else(|| panic!("{kernel} missing from:\n{profile}"));
        let calls: u64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert!(calls >= 2, "{line}");
    }
}

/// A small checkpoint with a trained tokenizer, written into `dir`.
fn checkpoint(dir: &Path, config: serde_json::Value) {
    use kpt_models::synthetic::{write_checkpoint, write_tokenizer, WriteOptions};
    write_checkpoint(dir, &config, WriteOptions::default()).expect("writes the checkpoint");
    write_tokenizer(dir, 300).expect("writes the tokenizer");
}

fn llama_checkpoint(dir: &Path) {
    checkpoint(
        dir,
        serde_json::json!({
            "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "bos_token_id": 0, "eos_token_id": 1
        }),
    );
}

fn bert_checkpoint(dir: &Path) {
    checkpoint(
        dir,
        serde_json::json!({
            "model_type": "bert", "vocab_size": 300, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
            "max_position_embeddings": 64, "type_vocab_size": 2
        }),
    );
}

#[test]
fn run_streams_text_and_reports_tokens_per_second() {
    let dir = tempfile::tempdir().unwrap();
    llama_checkpoint(dir.path());
    let model = path_str(dir.path());
    let args = [
        "run",
        "--model",
        model,
        "--prompt",
        "the quick brown fox",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--device",
        "cpu",
    ];
    let o = run(&mut kpt(&args));
    assert!(o.status.success(), "{}", stderr(&o));
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(out.ends_with('\n'), "{out:?}");
    assert!(err.contains("6 generated"), "{err}");
    assert!(err.contains("tokens/s") && err.contains("prefill"), "{err}");
    // Greedy is deterministic, and so is sampling with a seed.
    assert_eq!(ok(&mut kpt(&args)), out);
    let mut sampled = args.to_vec();
    sampled.extend([
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "7",
    ]);
    assert_eq!(ok(&mut kpt(&sampled)), ok(&mut kpt(&sampled)));
    // Several prompts run as one batch, one completion each.
    let out = ok(&mut kpt(&[
        "run",
        "--model",
        model,
        "--prompt",
        "the cat",
        "--prompt",
        "Hello world! Tokens",
        "--max-tokens",
        "3",
        "--level",
        "conservative",
    ]));
    assert!(
        out.contains("[0] the cat") && out.contains("[1] Hello world! Tokens"),
        "{out}"
    );
}

#[test]
fn run_rejects_bad_input_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    llama_checkpoint(dir.path());
    let model = path_str(dir.path());
    let check = |args: &[&str], want: &str| {
        let o = run(&mut kpt(args));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in\n{err}");
    };
    check(
        &["run", "--model", model, "--prompt", "x", "--top-p", "0"],
        "top_p",
    );
    check(
        &["run", "--model", model, "--prompt", "x", "--top-p", "1.5"],
        "top_p",
    );
    check(
        &["run", "--model", model, "--prompt", "x", "--temperature=-1"],
        "temperature",
    );
    check(
        &[
            "run",
            "--model",
            model,
            "--prompt",
            "x",
            "--max-tokens",
            "0",
        ],
        "max_new_tokens",
    );
    let missing = dir.path().join("no-such-model");
    check(
        &["run", "--model", path_str(&missing), "--prompt", "x"],
        "no such model directory",
    );
    let empty = tempfile::tempdir().unwrap();
    check(
        &["run", "--model", path_str(empty.path()), "--prompt", "x"],
        "no config.json",
    );
    check(
        &["bench", "model", "--model", path_str(empty.path())],
        "no config.json",
    );
    check(
        &["embed", "--model", path_str(&missing), "--text", "x"],
        "no such model directory",
    );
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    check(
        &["run", "--model", model, "--prompt", "x"],
        "tokenizer.json",
    );
    // An encoder cannot generate, a decoder cannot embed.
    let bert = tempfile::tempdir().unwrap();
    bert_checkpoint(bert.path());
    check(
        &["run", "--model", path_str(bert.path()), "--prompt", "x"],
        "kpt embed",
    );
    llama_checkpoint(dir.path());
    check(&["embed", "--model", model, "--text", "x"], "kpt run");
}

#[test]
fn embed_prints_sentence_embeddings() {
    let dir = tempfile::tempdir().unwrap();
    bert_checkpoint(dir.path());
    let model = path_str(dir.path());
    let out = ok(&mut kpt(&[
        "embed",
        "--model",
        model,
        "--text",
        "the quick brown fox",
        "--text",
        "hello",
        "--json",
        "--device",
        "cpu",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let items = v.as_array().expect("one object per text");
    assert_eq!(items.len(), 2, "{out}");
    assert_eq!(items[1]["text"], "hello");
    for item in items {
        let e = item["embedding"].as_array().expect("an embedding");
        assert_eq!(e.len(), 32);
        assert!(
            e.iter().all(|x| x.as_f64().is_some_and(f64::is_finite)),
            "{item}"
        );
    }
    assert_ne!(items[0]["embedding"], items[1]["embedding"]);
    let out = ok(&mut kpt(&["embed", "--model", model, "--text", "hello"]));
    assert!(out.contains("norm") && out.contains("hello"), "{out}");
}

#[test]
fn bench_model_prints_prefill_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    llama_checkpoint(dir.path());
    let model = path_str(dir.path());
    let base = [
        "bench",
        "model",
        "--model",
        model,
        "--prompt-tokens",
        "8",
        "--tokens",
        "4",
        "--iters",
        "2",
        "--device",
        "cpu",
    ];
    let out = ok(&mut kpt(&base));
    for col in [
        "level",
        "prefill ms",
        "prefill tok/s",
        "ms/token",
        "decode tok/s",
    ] {
        assert!(out.contains(col), "{col} missing:\n{out}");
    }
    for level in ["conservative", "balanced", "aggressive"] {
        assert!(
            out.lines().any(|l| l.starts_with(level)),
            "{level} missing:\n{out}"
        );
    }
    let mut json = base.to_vec();
    json.extend(["--json", "--level", "balanced"]);
    let out = ok(&mut kpt(&json));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let rows = v.as_array().expect("one row per level");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["level"], "balanced");
    assert_eq!(rows[0]["prompt_tokens"], 8);
    assert!(
        rows[0]["decode_tokens_per_s"]
            .as_f64()
            .is_some_and(|x| x > 0.0),
        "{out}"
    );
}

#[test]
fn validate_and_demo_take_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    llama_checkpoint(dir.path());
    let model = path_str(dir.path());
    let out = ok(&mut kpt(&[
        "validate", "--model", model, "--tokens", "4", "--device", "cpu",
    ]));
    assert!(out.contains("within tolerance"), "{out}");
    assert!(
        out.contains("= greedy tokens") && out.contains("logits max abs"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("conservative") && l.contains("4/4")),
        "{out}"
    );
    let out = ok(&mut kpt(&[
        "demo", "--model", model, "--tokens", "4", "--device", "cpu",
    ]));
    assert!(out.contains("llama decoder, 2 layers"), "{out}");
    assert!(out.contains("= ref tokens"), "{out}");
}

/// `--metrics` writes a valid (here empty: the CPU backend keeps no counters)
/// OpenMetrics file after `demo` (also with `--json`, whose stdout stays one JSON
/// document) and `validate`; an unwritable path is an error naming it.
#[test]
fn demo_and_validate_write_metrics() {
    let dir = tempfile::tempdir().unwrap();
    llama_checkpoint(dir.path());
    let model = path_str(dir.path());
    let path = dir.path().join("demo.prom");
    let out = ok(&mut kpt(&[
        "demo",
        "--model",
        model,
        "--tokens",
        "2",
        "--device",
        "cpu",
        "--level",
        "conservative",
        "--json",
        "--metrics",
        path_str(&path),
    ]));
    serde_json::from_str::<serde_json::Value>(&out).expect("stdout is one JSON document");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "# EOF\n");
    let path = dir.path().join("validate.prom");
    ok(&mut kpt(&[
        "validate",
        "--model",
        model,
        "--tokens",
        "2",
        "--device",
        "cpu",
        "--metrics",
        path_str(&path),
    ]));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "# EOF\n");
    let bad = dir.path().join("no-such-dir").join("x.prom");
    let err = fails(&mut kpt(&[
        "demo",
        "--model",
        model,
        "--tokens",
        "2",
        "--device",
        "cpu",
        "--level",
        "conservative",
        "--metrics",
        path_str(&bad),
    ]));
    assert!(err.contains("no-such-dir"), "{err}");
}
