//! SVG chart of a report's ratios: one horizontal bar per row, a line at parity (1x)
//! and a marker at each row's target.

use std::fmt::Write as _;

use crate::report::Report;

const WIDTH: f64 = 900.0;
const LABEL_W: f64 = 330.0;
const ROW_H: f64 = 22.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 36.0;

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A self-contained SVG bar chart of every row's ratio (green: target met, red: missed,
/// grey outline: not run).
pub fn ratio_chart_svg(report: &Report) -> String {
    let max = report
        .rows
        .iter()
        .flat_map(|r| [r.ratio, r.target_ratio])
        .flatten()
        .filter(|v| v.is_finite())
        .fold(1.5f64, f64::max)
        * 1.1;
    let plot_w = WIDTH - LABEL_W - 70.0;
    let x = |v: f64| LABEL_W + plot_w * (v / max).clamp(0.0, 1.0);
    let height = TOP + BOTTOM + ROW_H * report.rows.len() as f64;
    let mut baselines: Vec<&str> = report
        .rows
        .iter()
        .map(|r| r.baseline_name.as_str())
        .filter(|b| !b.is_empty())
        .collect();
    baselines.sort_unstable();
    baselines.dedup();
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="15" font-weight="bold">{}: kpt vs {}</text>"#,
        esc(&report.report),
        esc(&baselines.join(", "))
    );
    let _ = writeln!(
        s,
        r##"<text x="10" y="38" fill="#555">{} · {} · ratio &gt; 1: kpt ahead; tick: target</text>"##,
        esc(&report.date),
        esc(&report.machine.device)
    );
    for (i, row) in report.rows.iter().enumerate() {
        let y = TOP + ROW_H * i as f64;
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LABEL_W - 8.0,
            y + 15.0,
            esc(&row.name)
        );
        match row.ratio {
            Some(r) => {
                let color = if row.met { "#2e9e44" } else { "#d0342c" };
                let _ = writeln!(
                    s,
                    r#"<rect x="{LABEL_W}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
                    y + 3.0,
                    x(r) - LABEL_W,
                    ROW_H - 6.0
                );
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}">{r:.2}x</text>"#,
                    x(r) + 4.0,
                    y + 15.0
                );
            }
            None => {
                let label = if row.kpt.is_some() {
                    "no baseline"
                } else {
                    "not run"
                };
                let _ = writeln!(
                    s,
                    r##"<text x="{:.1}" y="{:.1}" fill="#888">{label}</text>"##,
                    LABEL_W + 4.0,
                    y + 15.0
                );
            }
        }
        if let Some(t) = row.target_ratio {
            let _ = writeln!(
                s,
                r#"<line x1="{0:.1}" x2="{0:.1}" y1="{1:.1}" y2="{2:.1}" stroke="black" stroke-width="2"/>"#,
                x(t),
                y + 1.0,
                y + ROW_H - 1.0
            );
        }
    }
    let bottom = TOP + ROW_H * report.rows.len() as f64;
    let _ = writeln!(
        s,
        r##"<line x1="{0:.1}" x2="{0:.1}" y1="{TOP}" y2="{bottom:.1}" stroke="#444" stroke-dasharray="4 3"/>"##,
        x(1.0)
    );
    let mut tick = 0.0;
    while tick <= max {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{tick:.1}x</text>"##,
            x(tick),
            bottom + 18.0
        );
        tick += if max > 8.0 { 2.0 } else { 0.5 };
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Machine, Row};

    #[test]
    fn one_bar_per_row_that_ran_and_escaped_text() {
        let machine = Machine {
            device: "CPU <test>".into(),
            driver: None,
            cpu: String::new(),
            versions: Default::default(),
        };
        let mut rep = Report::new("cpu & co", "cmd", "abc", machine);
        rep.rows
            .push(Row::compared("a<b", "GB/s", true, 3.0, 1.0, "torch").with_target_ratio(3.0));
        rep.rows
            .push(Row::compared("c", "GB/s", true, 1.0, 2.0, "torch").with_target_ratio(1.0));
        rep.rows
            .push(Row::not_run("d", "GB/s", true, "torch", "why"));
        let svg = ratio_chart_svg(&rep);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // Background + 2 bars.
        assert_eq!(svg.matches("<rect").count(), 3);
        assert!(svg.contains("a&lt;b") && svg.contains("cpu &amp; co") && svg.contains("not run"));
        assert!(!svg.contains("a<b"));
        assert!(svg.contains("#2e9e44") && svg.contains("#d0342c"));
    }
}
