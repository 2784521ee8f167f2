//! Writing a report to disk and reading it back.

use kpt_monitor::{plot::ratio_chart_svg, Machine, Report, Row};

fn report() -> Report {
    let machine = Machine {
        device: "CPU".into(),
        driver: None,
        cpu: "x86_64".into(),
        versions: [("kpt".to_string(), "0.1.0".to_string())].into(),
    };
    let mut rep = Report::new("unit", "cargo test", "abc1234", machine);
    rep.rows.push(
        Row::compared("gemm", "GFLOP/s", true, 180.0, 170.0, "torch.matmul")
            .with_target_ratio(0.95)
            .with_max_abs_err(2e-6),
    );
    rep.rows.push(
        Row::compared("softmax", "ms", false, 2.0, 1.0, "torch.softmax").with_target_ratio(1.0),
    );
    rep.rows.push(Row::not_run(
        "attention",
        "GFLOP/s",
        true,
        "sdpa",
        "no torch",
    ));
    rep
}

#[test]
fn report_files_round_trip() {
    let rep = report();
    let dir = tempfile::tempdir().unwrap();
    // A directory that does not exist yet is created.
    let out = dir.path().join("docs").join("reports");
    let paths = rep.write(&out).unwrap();
    let names: Vec<String> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let day = &rep.date[..10];
    assert_eq!(
        names,
        [
            "unit-latest.json".to_string(),
            format!("unit-{day}.json"),
            "unit-latest.md".to_string(),
            "unit-latest.svg".to_string(),
        ]
    );
    assert!(paths.iter().all(|p| p.parent() == Some(out.as_path())));
    for json in &paths[..2] {
        let back = Report::from_json(&std::fs::read_to_string(json).unwrap()).unwrap();
        assert_eq!(back, rep);
        assert!(back.rows[2].kpt.is_none() && !back.rows[2].met);
        assert_eq!(back.rows[2].notes, "no torch");
    }
    let md = std::fs::read_to_string(&paths[2]).unwrap();
    assert_eq!(md, rep.to_markdown());
    assert!(md.contains("1 of 3 targets met."));
    let svg = std::fs::read_to_string(&paths[3]).unwrap();
    assert_eq!(svg, ratio_chart_svg(&rep));
    assert!(svg.starts_with("<svg"));
}

#[test]
fn latest_is_replaced_and_history_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = report();
    first.date = "2026-11-22T08:00:00Z".into();
    first.write(dir.path()).unwrap();
    let mut second = report();
    second.date = "2026-11-23T12:00:00Z".into();
    second.rows.truncate(1);
    second.write(dir.path()).unwrap();

    let read = |name: &str| {
        Report::from_json(&std::fs::read_to_string(dir.path().join(name)).unwrap()).unwrap()
    };
    assert_eq!(read("unit-latest.json"), second);
    assert_eq!(read("unit-2026-11-23.json"), second);
    assert_eq!(read("unit-2026-11-22.json"), first);
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "unit-2026-11-22.json",
            "unit-2026-11-23.json",
            "unit-latest.json",
            "unit-latest.md",
            "unit-latest.svg"
        ]
    );
}

#[test]
fn write_reports_io_errors_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    // A file where the directory should be.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, "").unwrap();
    let err = report().write(&blocker.join("reports")).unwrap_err();
    assert!(matches!(err, kpt_core::KptError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("blocker"), "{err}");
}
