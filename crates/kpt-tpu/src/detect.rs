//! Which PJRT plugin kpt uses, and the devices it offers.

use std::path::PathBuf;
use std::sync::Arc;

use kpt_core::backend::Backend;
use kpt_core::config::TpuConfig;
use kpt_core::hardware::{DeviceInfo, DeviceKind, HardwareDetector};
use kpt_core::{KptError, Result};

use crate::backend::XlaBackend;
use crate::client::Client;
use crate::locate::find_libtpu;
use crate::plugin::{Plugin, PLUGIN_ENV};

/// The plugin library kpt would load: `tpu.plugin_path`, else `KPT_PJRT_PLUGIN`, else
/// libtpu from a Python environment. `explicit` says whether it was named (any plugin:
/// XLA's CPU or CUDA plugin as well) rather than found (libtpu only).
pub fn plugin_path(config: &TpuConfig) -> Option<(PathBuf, bool)> {
    if let Some(p) = &config.plugin_path {
        return Some((p.clone(), true));
    }
    if let Some(p) = std::env::var_os(PLUGIN_ENV) {
        return Some((p.into(), true));
    }
    find_libtpu().map(|p| (p, false))
}

/// An [`XlaBackend`] for every device of the plugin [`plugin_path`] picks, or why there
/// is none. A plugin that was only found (libtpu) is used whenever it is there; one that
/// was named (`tpu.plugin_path`, `KPT_PJRT_PLUGIN`: XLA's CPU or CUDA plugin, say) only
/// when `requested`, that is when the configuration asks for the TPU backend, so that
/// such a plugin never takes the place of kpt's own CPU or CUDA backend on its own.
pub fn backends(
    config: &TpuConfig,
    requested: bool,
) -> std::result::Result<Vec<Arc<dyn Backend>>, String> {
    if !config.enabled {
        return Err(
            "the TPU backend is disabled in the configuration (tpu.enabled = false)".into(),
        );
    }
    let Some((path, named)) = plugin_path(config) else {
        return Err(format!(
            "no PJRT plugin: no libtpu in a Python environment (pip install libtpu on a TPU VM), and neither tpu.plugin_path nor {PLUGIN_ENV} names one"
        ));
    };
    if named && !requested {
        return Err(format!(
            "{} is used only when the TPU backend is asked for (--device tpu)",
            path.display()
        ));
    }
    let open = || -> Result<Vec<Arc<dyn Backend>>> {
        let plugin = Plugin::load(&path)?;
        let client = Client::new(&plugin)?;
        let n = client.devices()?.len();
        (0..n)
            .map(|i| Ok(Arc::new(XlaBackend::new(&client, i)?) as Arc<dyn Backend>))
            .collect()
    };
    match open() {
        Ok(found) if found.is_empty() => Err(format!("{} offers no device", path.display())),
        Ok(found) => Ok(found),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Lists the devices of the PJRT plugin kpt would use (see [`plugin_path`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct PjrtDetector;

impl HardwareDetector for PjrtDetector {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Tpu
    }

    fn detect(&self) -> Result<Vec<DeviceInfo>> {
        let config = TpuConfig::default();
        let Some((path, _)) = plugin_path(&config) else {
            return Ok(Vec::new());
        };
        let plugin = Plugin::load(&path).map_err(KptError::from)?;
        let client = Client::new(&plugin)?;
        let n = client.devices()?.len();
        (0..n)
            .map(|i| Ok(XlaBackend::new(&client, i)?.device().clone()))
            .collect()
    }
}
