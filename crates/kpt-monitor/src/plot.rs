//! SVG chart of a report's ratios: one horizontal bar per row on a linear axis, a
//! dashed line at parity (1x), a tick at each row's target ratio, green bars for met
//! targets, red for missed ones and a grey hatched placeholder for rows with no ratio.

use std::fmt::Write as _;

use crate::report::{ratio_str, target_str, Report, Row};

/// Width of the chart in pixels.
const WIDTH: f64 = 900.0;
/// Width of the row-name column.
const LABEL_W: f64 = 340.0;
/// Room right of the axis for value labels.
const RIGHT: f64 = 80.0;
/// Height of one row.
const ROW_H: f64 = 22.0;
/// Height of the title block.
const TOP: f64 = 64.0;
/// Height of the axis labels below the rows.
const BOTTOM: f64 = 36.0;
/// Width of the placeholder of a row without a ratio.
const PLACEHOLDER_W: f64 = 48.0;

const GREEN: &str = "#2e9e44";
const RED: &str = "#d0342c";
const GREY: &str = "#888888";

/// Escapes text for SVG text content and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters other than tab and newline are not allowed in XML 1.0.
            c if c.is_control() && c != '\t' && c != '\n' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Smallest axis end at which far outliers are clipped (see [`axis_max`]).
const CLIP_FLOOR: f64 = 5.0;

/// The upper end of the ratio axis.
///
/// Normally 1.1 times the largest ratio or target ratio, and at least 1.5. When that
/// is more than twice `limit` = max([`CLIP_FLOOR`], 1.1 times the largest target
/// ratio), a few far outliers (e.g. 480x against an unoptimized baseline) would squash
/// every other bar against 0; the axis then ends at `limit` and longer bars are drawn
/// clipped, with a break mark and their true value.
fn axis_max(report: &Report) -> f64 {
    let largest = |values: &mut dyn Iterator<Item = Option<f64>>| {
        values
            .flatten()
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max)
    };
    let targets = largest(&mut report.rows.iter().map(|r| r.target_ratio));
    let ratios = largest(&mut report.rows.iter().map(|r| r.ratio));
    let full = (ratios.max(targets) * 1.1).max(1.5);
    let limit = (targets * 1.1).max(CLIP_FLOOR);
    if full > 2.0 * limit {
        limit
    } else {
        full
    }
}

/// `s`, cut to `n` characters with an ellipsis.
fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).chain(['…']).collect()
    }
}

/// A round tick spacing giving about six ticks on `0..max`.
fn tick_step(max: f64) -> f64 {
    let raw = max / 6.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude)
}

/// `1.5x`, `2x`, `0.25x`.
fn tick_label(v: f64) -> String {
    let s = format!("{v:.2}");
    format!("{}x", s.trim_end_matches('0').trim_end_matches('.'))
}

/// Longest row name shown in full; longer ones are cut (the hover title keeps them).
const NAME_CHARS: usize = 44;
/// Longest title shown in full.
const TITLE_CHARS: usize = 96;
/// Longest subtitle shown in full.
const SUBTITLE_CHARS: usize = 140;

/// The baseline names of the rows that have a baseline, in order of appearance.
fn baseline_names(report: &Report) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for r in &report.rows {
        let b = r.baseline_name.as_str();
        if !b.is_empty() && r.baseline.is_some() && !names.contains(&b) {
            names.push(b);
        }
    }
    names
}

/// The hover text of a row.
fn tooltip(row: &Row) -> String {
    let mut t = row.name.clone();
    if let Some(k) = row.kpt {
        let _ = write!(t, ": kpt {k} {}", row.metric);
    }
    if let Some(b) = row.baseline {
        let _ = write!(t, ", {} {b}", row.baseline_name);
    }
    let _ = write!(
        t,
        "; target {}; {}",
        target_str(row),
        if row.met { "met" } else { "not met" }
    );
    if !row.notes.is_empty() {
        let _ = write!(t, "; {}", row.notes);
    }
    t
}

/// A self-contained SVG horizontal bar chart of every row's `ratio`.
///
/// The linear axis runs from 0 to 1.1 times the largest ratio or target ratio (at
/// least 0 to 1.5), with a dashed line at parity (1x); far outliers are clipped with a
/// break mark instead of squashing the other bars (the rule is on `axis_max` in the
/// source: beyond twice max(5x, 1.1 times the largest target ratio)). Each row has its name on the left and a bar
/// (`<rect class="bar">`, green when its target is met, red when not) ending in its
/// value; a black tick marks its `target_ratio`. Rows without a ratio get a grey
/// hatched placeholder labelled `not run` (or `no baseline` with kpt's value for
/// absolute rows). The title is `<report>: kpt vs <baseline names>`, followed by the
/// date and device. All text is XML-escaped; rows carry their notes as hover titles.
pub fn ratio_chart_svg(report: &Report) -> String {
    let max = axis_max(report);
    let plot_w = WIDTH - LABEL_W - RIGHT;
    let x = |v: f64| LABEL_W + plot_w * (v / max).clamp(0.0, 1.0);
    let n = report.rows.len() as f64;
    let bottom = TOP + ROW_H * n;
    let height = bottom + BOTTOM;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r##"<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><path d="M0 0V6" stroke="{GREY}" stroke-width="2"/></pattern></defs>"##
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"#
    );

    let baselines = baseline_names(report);
    let versus = if baselines.is_empty() {
        "no baseline".to_string()
    } else {
        baselines.join(", ")
    };
    let _ = writeln!(
        s,
        r#"<text x="10" y="22" font-size="15" font-weight="bold">{}</text>"#,
        esc(&cut(
            &format!("{}: kpt vs {versus}", report.report),
            TITLE_CHARS
        ))
    );
    let _ = writeln!(
        s,
        r##"<text x="10" y="42" fill="#555555">{}</text>"##,
        esc(&cut(
            &format!(
                "{} · {} · {} of {} targets met · ratio > 1: kpt ahead · black tick: target",
                report.date,
                report.machine.device,
                report.met_count(),
                report.rows.len()
            ),
            SUBTITLE_CHARS
        ))
    );

    // Grid and axis labels.
    let step = tick_step(max);
    let mut i = 0u32;
    loop {
        let tick = f64::from(i) * step;
        if tick > max * (1.0 + 1e-9) {
            break;
        }
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{TOP}" y2="{bottom:.1}" stroke="#e4e4e4"/>"##,
            x(tick)
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555555">{}</text>"##,
            x(tick),
            bottom + 18.0,
            tick_label(tick)
        );
        i += 1;
    }

    for (i, row) in report.rows.iter().enumerate() {
        let y = TOP + ROW_H * i as f64;
        let text_y = y + 15.0;
        let _ = writeln!(s, "<g><title>{}</title>", esc(&tooltip(row)));
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{text_y:.1}" text-anchor="end">{}</text>"#,
            LABEL_W - 8.0,
            esc(&cut(&row.name, NAME_CHARS))
        );
        match row.ratio.filter(|r| r.is_finite()) {
            Some(r) => {
                let color = if row.met { GREEN } else { RED };
                // The value label goes right of the bar and of the target tick.
                let tick_x = row.target_ratio.filter(|t| t.is_finite()).map(x);
                let label_x = x(r).max(tick_x.unwrap_or(0.0)) + 5.0;
                let _ = writeln!(
                    s,
                    r#"<rect class="bar" x="{LABEL_W}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
                    y + 3.0,
                    x(r) - LABEL_W,
                    ROW_H - 6.0
                );
                if r > max {
                    // Clipped: a white double slash near the end marks the break.
                    let bx = x(max) - 14.0;
                    let _ = writeln!(
                        s,
                        r#"<path d="M{:.1} {:.1}l6 -{h:.1}M{:.1} {:.1}l6 -{h:.1}" stroke="white" stroke-width="2"/>"#,
                        bx,
                        y + ROW_H - 3.0,
                        bx + 5.0,
                        y + ROW_H - 3.0,
                        h = ROW_H - 6.0
                    );
                }
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{text_y:.1}">{}</text>"#,
                    label_x,
                    ratio_str(r)
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    r#"<path d="M{LABEL_W} {:.1}h{PLACEHOLDER_W}v{:.1}h-{PLACEHOLDER_W}Z" fill="url(#hatch)" stroke="{GREY}"/>"#,
                    y + 3.0,
                    ROW_H - 6.0
                );
                let (label, color) = match row.kpt {
                    Some(k) if row.ran() => (
                        format!(
                            "no baseline: {} {} (target {})",
                            crate::report::num(k),
                            row.metric,
                            target_str(row)
                        ),
                        if row.met { GREEN } else { RED },
                    ),
                    _ => ("not run".to_string(), GREY),
                };
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{text_y:.1}" fill="{color}">{}</text>"#,
                    LABEL_W + PLACEHOLDER_W + 6.0,
                    esc(&label)
                );
            }
        }
        if let Some(t) = row.target_ratio.filter(|t| t.is_finite()) {
            let _ = writeln!(
                s,
                r#"<line x1="{0:.1}" x2="{0:.1}" y1="{1:.1}" y2="{2:.1}" stroke="black" stroke-width="2"/>"#,
                x(t),
                y + 1.0,
                y + ROW_H - 1.0
            );
        }
        s.push_str("</g>\n");
    }

    // Parity line, drawn last so that it stays visible over the bars.
    let _ = writeln!(
        s,
        r##"<line x1="{0:.1}" x2="{0:.1}" y1="{1:.1}" y2="{bottom:.1}" stroke="#333333" stroke-dasharray="4 3"/>"##,
        x(1.0),
        TOP - 6.0
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#333333">parity</text>"##,
        x(1.0),
        TOP - 9.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Machine, Row};

    fn report(rows: Vec<Row>) -> Report {
        let machine = Machine {
            device: "CPU <test>".into(),
            driver: None,
            cpu: String::new(),
            versions: Default::default(),
        };
        let mut rep = Report::new("cpu & co", "cmd", "abc", machine);
        rep.rows = rows;
        rep
    }

    /// Checks that every tag is closed in order and that text holds no raw `<` or
    /// stray `&`.
    fn assert_well_formed(svg: &str) {
        let mut stack: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(open) = rest.find('<') {
            let text = &rest[..open];
            for (i, _) in text.match_indices('&') {
                let entity = &text[i..];
                assert!(
                    ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                        .iter()
                        .any(|e| entity.starts_with(e)),
                    "stray & in {text:?}"
                );
            }
            let close = rest[open..].find('>').expect("unclosed tag") + open;
            let tag = &rest[open + 1..close];
            assert!(!tag.contains('<'), "`<` inside tag {tag:?}");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop(), Some(name), "mismatched </{name}>");
            } else if !tag.ends_with('/') {
                stack.push(tag.split_whitespace().next().unwrap());
            }
            rest = &rest[close + 1..];
        }
        assert!(stack.is_empty(), "unclosed: {stack:?}");
        assert!(rest.trim().is_empty());
    }

    #[test]
    fn one_bar_per_row_that_ran_and_escaped_text() {
        let rep = report(vec![
            Row::compared("a<b", "GB/s", true, 3.0, 1.0, "torch & co").with_target_ratio(3.0),
            Row::compared("c", "GB/s", true, 1.0, 2.0, "torch").with_target_ratio(1.0),
            Row::not_run("d", "GB/s", true, "torch", "why <not>"),
            Row::absolute("e's", "x", true, 2.5).with_target(2.0),
        ]);
        let svg = ratio_chart_svg(&rep);
        assert_well_formed(&svg);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches(r#"<rect class="bar""#).count(), 2);
        // The background and the two bars.
        assert_eq!(svg.matches("<rect").count(), 3);
        assert!(svg.contains("a&lt;b") && svg.contains("cpu &amp; co"));
        assert!(svg.contains("CPU &lt;test&gt;") && svg.contains("why &lt;not&gt;"));
        assert!(svg.contains("e&apos;s") && !svg.contains("a<b"));
        assert!(svg.contains("cpu &amp; co: kpt vs torch &amp; co, torch</text>"));
        assert!(svg.contains(GREEN) && svg.contains(RED));
        assert!(svg.contains(">not run<") && svg.contains("no baseline: 2.500 x (target &gt;= 2)"));
        assert_eq!(svg.matches(r#"fill="url(#hatch)""#).count(), 2);
        assert!(svg.contains(">3.00x<") && svg.contains(">0.50x<"));
        assert!(svg.contains(&rep.date) && svg.contains("2 of 4 targets met"));
    }

    #[test]
    fn axis_covers_ratios_and_targets() {
        let small = report(vec![Row::compared("a", "x", true, 1.0, 1.0, "t")]);
        assert_eq!(axis_max(&small), 1.5);
        let big = report(vec![
            Row::compared("a", "x", true, 3.0, 1.0, "t").with_target_ratio(4.0)
        ]);
        assert!((axis_max(&big) - 4.4).abs() < 1e-12);
        assert_eq!(axis_max(&report(vec![])), 1.5);
        // Up to twice the clip limit the axis stays complete...
        let eight = report(vec![Row::compared("a", "x", true, 8.0, 1.0, "t")]);
        assert!((axis_max(&eight) - 8.8).abs() < 1e-12);
        // ...beyond it, far outliers are clipped at the limit.
        let far = report(vec![
            Row::compared("a", "x", true, 480.0, 1.0, "t").with_target_ratio(0.95),
            Row::compared("b", "x", true, 0.9, 1.0, "t").with_target_ratio(0.95),
        ]);
        assert_eq!(axis_max(&far), CLIP_FLOOR);
        let svg = ratio_chart_svg(&far);
        assert!(svg.contains(">480.00x<") && svg.contains(r#"stroke="white""#));
        assert_well_formed(&svg);
        let high_target = report(vec![
            Row::compared("a", "x", true, 480.0, 1.0, "t").with_target_ratio(8.0)
        ]);
        assert!((axis_max(&high_target) - 8.8).abs() < 1e-12);
        assert_eq!(tick_step(1.5), 0.25);
        assert_eq!(tick_step(4.4), 1.0);
        assert_eq!(tick_step(110.0), 20.0);
        assert_eq!(tick_label(0.25), "0.25x");
        assert_eq!(tick_label(2.0), "2x");
        assert_eq!(tick_label(0.0), "0x");
        assert_eq!(cut("gemm", NAME_CHARS), "gemm");
        let long = "x".repeat(60);
        assert_eq!(cut(&long, NAME_CHARS).chars().count(), NAME_CHARS);
        assert!(cut(&long, NAME_CHARS).ends_with('…'));
    }

    #[test]
    fn height_grows_with_rows_and_targets_are_marked() {
        let one = ratio_chart_svg(&report(vec![Row::compared("a", "x", true, 1.0, 1.0, "t")]));
        let rows = (0..10)
            .map(|i| {
                Row::compared(format!("r{i}"), "x", true, 1.0, 1.0, "t").with_target_ratio(0.9)
            })
            .collect();
        let ten = ratio_chart_svg(&report(rows));
        let height = |svg: &str| -> f64 {
            let start = svg.find("height=\"").unwrap() + 8;
            svg[start..].split('"').next().unwrap().parse().unwrap()
        };
        assert!(height(&ten) > height(&one) + 8.0 * ROW_H);
        assert_eq!(ten.matches(r#"stroke="black""#).count(), 10);
        assert_well_formed(&ten);
        let empty = ratio_chart_svg(&report(vec![]));
        assert_well_formed(&empty);
        assert!(empty.contains("kpt vs no baseline"));
    }
}
