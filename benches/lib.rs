//! Criterion benchmarks for kpt; see the `[[bench]]` targets.
