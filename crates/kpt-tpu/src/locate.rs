//! Where PJRT plugins live when they come from Python packages.

use std::path::{Path, PathBuf};

/// The plugins kpt knows by package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    /// XLA's CPU plugin (PyPI `xla-cpu-pjrt`).
    Cpu,
    /// XLA's CUDA plugin (PyPI `jax-cuda12-pjrt` / `jax-cuda13-pjrt`).
    Cuda,
    /// libtpu (PyPI `libtpu`), on TPU VMs.
    Tpu,
}

impl PluginKind {
    /// Library paths relative to `site-packages`, in order of preference.
    fn candidates(self) -> &'static [&'static str] {
        match self {
            PluginKind::Cpu => &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"],
            PluginKind::Cuda => &[
                "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
                "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
            ],
            PluginKind::Tpu => &["libtpu/libtpu.so"],
        }
    }
}

/// The plugin library of `kind` installed in the Python environment at `env` (a
/// virtual environment or a prefix: `env/lib/python3*/{site,dist}-packages/...`), if
/// any.
pub fn find_plugin(env: &Path, kind: PluginKind) -> Option<PathBuf> {
    let lib = std::fs::read_dir(env.join("lib")).ok()?;
    let mut site: Vec<PathBuf> = lib
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .flat_map(|e| {
            [
                e.path().join("site-packages"),
                e.path().join("dist-packages"),
            ]
        })
        .collect();
    site.sort();
    site.iter()
        .flat_map(|s| kind.candidates().iter().map(move |c| s.join(c)))
        .find(|p| p.is_file())
}

/// libtpu where pip puts it: the active virtual environment, the user's and the
/// system's Python prefixes.
pub fn find_libtpu() -> Option<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.push(v.into());
    }
    if let Some(h) = std::env::var_os("HOME") {
        prefixes.push(Path::new(&h).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    prefixes
        .iter()
        .find_map(|p| find_plugin(p, PluginKind::Tpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_plugin_in_a_virtual_environment() {
        let dir = std::env::temp_dir().join(format!("kpt-tpu-locate-{}", std::process::id()));
        let pkg = dir.join("lib/python3.11/site-packages/xla_plugins/xla_cpu_pjrt");
        std::fs::create_dir_all(&pkg).unwrap();
        assert_eq!(find_plugin(&dir, PluginKind::Cpu), None);
        std::fs::write(pkg.join("xla_cpu_pjrt.so"), b"").unwrap();
        assert_eq!(
            find_plugin(&dir, PluginKind::Cpu),
            Some(pkg.join("xla_cpu_pjrt.so"))
        );
        assert_eq!(find_plugin(&dir, PluginKind::Tpu), None);
        assert_eq!(find_plugin(&dir.join("missing"), PluginKind::Cpu), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
