//! Criterion benchmarks for kpt (see the `[[bench]]` targets), and what the side-by-side
//! harnesses share.

/// Whether case `name` passes the harnesses' `--filter`: no filter, or any of its
/// comma-separated terms contained in the name; a term ending in `$` must end the name
/// (`prefill_bf16_b8_h16_s2048_d128_full$` leaves out the `_full_dropout` case).
pub fn filter_matches(filter: Option<&str>, name: &str) -> bool {
    filter.is_none_or(|f| {
        f.split(',').any(|term| match term.strip_suffix('$') {
            Some(end) => name.ends_with(end),
            None => name.contains(term),
        })
    })
}

/// The commit measured: `KPT_GIT_COMMIT` (set where the binary runs away from its
/// checkout), else `git rev-parse`.
pub fn git_commit() -> String {
    if let Ok(c) = std::env::var("KPT_GIT_COMMIT") {
        return c;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::filter_matches;

    #[test]
    fn filters_match_substrings_and_anchored_ends() {
        let full = "attention_prefill_bf16_b8_h16_s2048_d128_full";
        let dropout = "attention_prefill_bf16_b8_h16_s2048_d128_full_dropout";
        assert!(filter_matches(None, full));
        assert!(filter_matches(Some("s2048_d128_full"), dropout));
        assert!(filter_matches(Some("d128_full$"), full));
        assert!(!filter_matches(Some("d128_full$"), dropout));
        assert!(filter_matches(Some("nothing,d128_full$"), full));
        assert!(!filter_matches(Some("nothing,else"), full));
    }
}
