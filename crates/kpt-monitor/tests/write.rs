//! Writing a report to disk and reading it back.

use kpt_monitor::{Machine, Report, Row};

#[test]
fn report_files_round_trip() {
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
    rep.rows.push(Row::not_run(
        "attention",
        "GFLOP/s",
        true,
        "sdpa",
        "no torch",
    ));
    let dir = tempfile::tempdir().unwrap();
    let paths = rep.write(dir.path()).unwrap();
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
    let back = Report::from_json(&std::fs::read_to_string(&paths[0]).unwrap()).unwrap();
    assert_eq!(back, rep);
    let md = std::fs::read_to_string(&paths[2]).unwrap();
    assert!(md.contains("1 of 2 targets met."));
}
