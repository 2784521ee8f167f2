//! Statistics of repeated timings.

/// The median of `v` (the mean of the two middle values for an even count); `None` when
/// `v` is empty. NaNs sort last (`f64::total_cmp`).
///
/// ```
/// assert_eq!(kpt_monitor::median(&[3.0, 1.0, 2.0]), Some(2.0));
/// assert_eq!(kpt_monitor::median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
/// assert_eq!(kpt_monitor::median(&[]), None);
/// ```
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => None,
        n if n % 2 == 1 => Some(s[n / 2]),
        n => Some((s[n / 2 - 1] + s[n / 2]) / 2.0),
    }
}
