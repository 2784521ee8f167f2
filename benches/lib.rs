//! Criterion benchmarks for kpt (see the `[[bench]]` targets), and what the side-by-side
//! harnesses share.

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
