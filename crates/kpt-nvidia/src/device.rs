//! CUDA device discovery: what `kpt detect` shows and what kernel selection needs.

use std::collections::BTreeMap;

use cudarc::driver::result;
use cudarc::driver::sys::CUdevice_attribute as Attr;
use kpt_core::hardware::{DeviceInfo, DeviceKind, HardwareDetector};

use crate::NvidiaError;

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; no symbol is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The properties of one CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProperties {
    /// Device ordinal.
    pub index: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// L2 cache in bytes.
    pub l2_bytes: u64,
    /// Driver version as CUDA encodes it (e.g. 13000 for 13.0).
    pub driver_version: i32,
}

impl GpuProperties {
    /// `sm_XY`.
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }

    /// Tensor-core bf16 (Ampere, compute capability 8.0, and later).
    pub fn has_bf16(&self) -> bool {
        self.compute_capability >= (8, 0)
    }

    /// Tensor-core FP8 e4m3/e5m2 (Ada 8.9, Hopper 9.0 and later).
    pub fn has_fp8(&self) -> bool {
        self.compute_capability >= (8, 9)
    }

    /// The device as `kpt detect` and the kernel registry see it.
    pub fn device_info(&self) -> DeviceInfo {
        let mut features = vec!["fp32".to_string(), "fp16".to_string()];
        if self.has_bf16() {
            features.push("bf16".into());
        }
        if self.has_fp8() {
            features.push("fp8".into());
        }
        let (major, minor) = self.compute_capability;
        let mut properties = BTreeMap::new();
        properties.insert("compute_capability".into(), format!("{major}.{minor}"));
        properties.insert("l2".into(), self.l2_bytes.to_string());
        properties.insert(
            "driver".into(),
            format!(
                "{}.{}",
                self.driver_version / 1000,
                self.driver_version % 1000 / 10
            ),
        );
        DeviceInfo {
            kind: DeviceKind::Cuda,
            index: self.index,
            name: self.name.clone(),
            memory_bytes: Some(self.memory_bytes),
            compute_units: Some(self.sm_count as usize),
            arch: Some(self.arch()),
            features,
            properties,
        }
    }
}

/// Every CUDA device: empty when the driver sees none, [`NvidiaError::NoDriver`]
/// when there is no driver.
pub fn devices() -> Result<Vec<GpuProperties>, NvidiaError> {
    if !driver_present() {
        return Err(NvidiaError::NoDriver);
    }
    result::init().map_err(|e| NvidiaError::driver("cuInit", e))?;
    let mut version = 0;
    // SAFETY: the driver is loaded and initialized; the pointer is to a local.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| NvidiaError::driver("cuDriverGetVersion", e))?;
    let count =
        result::device::get_count().map_err(|e| NvidiaError::driver("cuDeviceGetCount", e))?;
    let mut out = Vec::new();
    for ordinal in 0..count {
        let dev =
            result::device::get(ordinal).map_err(|e| NvidiaError::driver("cuDeviceGet", e))?;
        let attr = |a: Attr| {
            // SAFETY: `dev` came from `cuDeviceGet`.
            unsafe { result::device::get_attribute(dev, a) }
                .map(|v| v.max(0) as u32)
                .map_err(|e| NvidiaError::driver("cuDeviceGetAttribute", e))
        };
        out.push(GpuProperties {
            index: ordinal as usize,
            name: result::device::get_name(dev)
                .map_err(|e| NvidiaError::driver("cuDeviceGetName", e))?,
            compute_capability: (
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            // SAFETY: `dev` came from `cuDeviceGet`.
            memory_bytes: unsafe { result::device::total_mem(dev) }
                .map_err(|e| NvidiaError::driver("cuDeviceTotalMem", e))?
                as u64,
            l2_bytes: u64::from(attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?),
            driver_version: version,
        });
    }
    tracing::debug!(count = out.len(), "CUDA devices found");
    Ok(out)
}

/// Finds CUDA devices for `kpt detect`; none (not an error) without a driver.
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaDetector;

impl HardwareDetector for CudaDetector {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn detect(&self) -> kpt_core::Result<Vec<DeviceInfo>> {
        match devices() {
            Ok(d) => Ok(d.iter().map(GpuProperties::device_info).collect()),
            Err(NvidiaError::NoDriver) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> GpuProperties {
        GpuProperties {
            index: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            memory_bytes: 85_031_714_816,
            l2_bytes: 52_428_800,
            driver_version: 13000,
        }
    }

    #[test]
    fn properties_map_to_device_info() {
        let d = h100().device_info();
        assert_eq!(d.kind, DeviceKind::Cuda);
        assert_eq!(d.arch.as_deref(), Some("sm_90"));
        assert_eq!(d.compute_units, Some(132));
        assert!(d.has_feature("bf16") && d.has_feature("fp8"));
        assert_eq!(d.properties["driver"], "13.0");
        assert_eq!(d.properties["compute_capability"], "9.0");
        let a100 = GpuProperties {
            compute_capability: (8, 0),
            ..h100()
        };
        assert!(a100.has_bf16() && !a100.has_fp8());
        let t4 = GpuProperties {
            compute_capability: (7, 5),
            ..h100()
        };
        assert!(!t4.device_info().has_feature("bf16"));
    }
}
