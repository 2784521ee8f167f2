//! Criterion benchmarks of kpt-tpu on the PJRT plugin that `KPT_PJRT_PLUGIN` names, or
//! XLA's CPU plugin in `target/pjrt-venv` (`cargo xtask pjrt-plugin`):
//! `cargo bench -p kpt-benches --bench xla`. Without a plugin it says so and measures
//! nothing.
//!
//! - `xla/compile`: a decoder-sized program compiled by XLA (`miss`), served by the
//!   compile cache from memory (`hit`, the "second compile" under 1 ms) and
//!   from its directory of serialized executables (`disk`).

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use kpt_tpu::{find_plugin, Client, CompileCache, CompileOptions, Plugin, PluginKind};

fn client() -> Option<Client> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/pjrt-venv");
    let plugin =
        Plugin::from_env().or_else(|| find_plugin(&venv, PluginKind::Cpu).map(Plugin::load));
    match plugin {
        Some(p) => Some(Client::new(&p.expect("the PJRT plugin loads")).expect("client")),
        None => {
            eprintln!("xla benches skipped: no PJRT plugin (run `cargo xtask pjrt-plugin`)");
            None
        }
    }
}

/// A program of a decoder layer's shape: RMSNorm, a [512, 2048] projection, SiLU.
fn program() -> String {
    let (m, k, n) = (32, 512, 2048);
    format!(
        "module @layer {{
  func.func public @main(%x: tensor<{m}x{k}xf32>, %w: tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32> {{
    %sq = \"stablehlo.multiply\"(%x, %x) : (tensor<{m}x{k}xf32>, tensor<{m}x{k}xf32>) -> tensor<{m}x{k}xf32>
    %y = \"stablehlo.dot_general\"(%sq, %w) {{dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>}} : (tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32>
    %s = \"stablehlo.logistic\"(%y) : (tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
    %z = \"stablehlo.multiply\"(%y, %s) : (tensor<{m}x{n}xf32>, tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
    \"func.return\"(%z) : (tensor<{m}x{n}xf32>) -> ()
  }}
}}"
    )
}

fn compile(c: &mut Criterion) {
    let Some(client) = client() else {
        return;
    };
    let text = program();
    let opts = CompileOptions::default();
    let mut g = c.benchmark_group("xla/compile");
    g.sample_size(10);
    g.bench_function("miss", |b| {
        b.iter(|| {
            let cache = CompileCache::new(&client, usize::MAX);
            cache.get_or_compile(text.as_bytes(), &opts).unwrap()
        })
    });
    let warm = CompileCache::new(&client, usize::MAX);
    warm.get_or_compile(text.as_bytes(), &opts).unwrap();
    g.bench_function("hit", |b| {
        b.iter(|| warm.get_or_compile(text.as_bytes(), &opts).unwrap())
    });
    let dir = std::env::temp_dir().join(format!("kpt-xla-bench-{}", std::process::id()));
    CompileCache::new(&client, usize::MAX)
        .with_dir(&dir)
        .get_or_compile(text.as_bytes(), &opts)
        .unwrap();
    g.bench_function("disk", |b| {
        b.iter(|| {
            let cache = CompileCache::new(&client, usize::MAX).with_dir(&dir);
            cache.get_or_compile(text.as_bytes(), &opts).unwrap()
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, compile);
criterion_main!(benches);
