//! CUDA device discovery: what `kpt detect` shows and what kernel selection needs.

use std::collections::BTreeMap;
use std::fmt;

use cudarc::driver::result;
use cudarc::driver::sys::CUdevice_attribute as Attr;
use kpt_core::hardware::{DeviceInfo, DeviceKind, HardwareDetector};

use crate::nvml::{self, GpuTelemetry};
use crate::NvidiaError;

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; no symbol is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Where a GPU sits on the PCI bus (function 0 of `domain:bus:device`): the key that
/// matches a CUDA ordinal to the same GPU in NVML, `nvidia-smi` and sysfs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    /// PCI domain (segment), 0 to 0xffff.
    pub domain: u32,
    /// Bus number, 0 to 0xff.
    pub bus: u32,
    /// Device number on the bus, 0 to 31.
    pub device: u32,
}

impl fmt::Display for PciAddress {
    /// `domain:bus:device.0` in hexadecimal, e.g. `0000:65:00.0` (the sysfs form,
    /// which NVML also accepts).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.0",
            self.domain, self.bus, self.device
        )
    }
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
    /// Position on the PCI bus.
    pub pci: PciAddress,
    /// Clocks, temperature and power from NVML; `None` where NVML is absent or knows
    /// nothing of the device, and always from [`devices`] (see
    /// [`devices_with_telemetry`]).
    pub telemetry: Option<GpuTelemetry>,
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

    /// The device as `kpt detect` and the kernel registry see it. Properties:
    /// `compute_capability`, `l2` (bytes), `driver`, `pci_bus_id`, and the
    /// [`GpuTelemetry::properties`] that were read.
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
        properties.insert("pci_bus_id".into(), self.pci.to_string());
        for (key, value) in self.telemetry.iter().flat_map(GpuTelemetry::properties) {
            properties.insert(key.into(), value);
        }
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

/// Every CUDA device, without telemetry: empty when the driver sees none,
/// [`NvidiaError::NoDriver`] when there is no driver.
pub fn devices() -> Result<Vec<GpuProperties>, NvidiaError> {
    if !driver_present() {
        return Err(NvidiaError::NoDriver);
    }
    match result::init() {
        Ok(()) => {}
        // The driver is there but sees no device (none installed, or all hidden by
        // `CUDA_VISIBLE_DEVICES`): an empty list, as for `cuDeviceGetCount` = 0.
        Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            tracing::debug!("the CUDA driver sees no device");
            return Ok(Vec::new());
        }
        Err(e) => return Err(NvidiaError::driver("cuInit", e)),
    }
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
            pci: PciAddress {
                domain: attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                bus: attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                device: attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
            },
            telemetry: None,
        });
    }
    tracing::debug!(count = out.len(), "CUDA devices found");
    Ok(out)
}

/// [`devices`] with [`GpuProperties::telemetry`] read from NVML, matched to each CUDA
/// ordinal by PCI address. A missing NVML leaves the telemetry `None`; it is never an
/// error. Loading NVML takes tens of milliseconds, so only `kpt detect` asks for it.
pub fn devices_with_telemetry() -> Result<Vec<GpuProperties>, NvidiaError> {
    let mut found = devices()?;
    let addresses: Vec<PciAddress> = found.iter().map(|d| d.pci).collect();
    for (device, telemetry) in found.iter_mut().zip(nvml::telemetry(&addresses)) {
        device.telemetry = telemetry;
    }
    Ok(found)
}

/// Finds CUDA devices for `kpt detect`, with NVML telemetry where NVML is present;
/// none (not an error) without a driver.
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaDetector;

impl HardwareDetector for CudaDetector {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn detect(&self) -> kpt_core::Result<Vec<DeviceInfo>> {
        match devices_with_telemetry() {
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
            pci: PciAddress {
                domain: 0,
                bus: 0x65,
                device: 0,
            },
            telemetry: None,
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

    #[test]
    fn pci_address_prints_in_sysfs_form() {
        assert_eq!(h100().pci.to_string(), "0000:65:00.0");
        let far = PciAddress {
            domain: 0x1a2b,
            bus: 0xff,
            device: 0x1f,
        };
        assert_eq!(far.to_string(), "1a2b:ff:1f.0");
        assert_eq!(
            h100().device_info().properties["pci_bus_id"],
            "0000:65:00.0"
        );
    }

    #[test]
    fn telemetry_shows_in_device_info_only_when_read() {
        let plain = h100().device_info();
        assert!(!plain.properties.contains_key("temperature_c"));
        assert!(!plain.properties.contains_key("sm_clock_mhz"));
        let read = GpuProperties {
            telemetry: Some(GpuTelemetry {
                sm_clock_mhz: Some(1980),
                sm_clock_max_mhz: Some(1980),
                temperature_c: Some(61),
                power_draw_mw: Some(512_300),
                power_limit_mw: Some(700_000),
                ..GpuTelemetry::default()
            }),
            ..h100()
        };
        let p = read.device_info().properties;
        assert_eq!(p["sm_clock_mhz"], "1980");
        assert_eq!(p["sm_clock_max_mhz"], "1980");
        assert_eq!(p["temperature_c"], "61");
        assert_eq!(p["power_draw_w"], "512.3");
        assert_eq!(p["power_limit_w"], "700.0");
        // A reading NVML did not give is left out, not shown as zero.
        assert!(!p.contains_key("memory_clock_mhz"));
    }

    /// Without a driver there is no device and no error; with one, every device has a
    /// PCI address and NVML (when present) matched by it.
    #[test]
    fn detector_never_fails_for_lack_of_a_driver() {
        let found = CudaDetector.detect();
        if driver_present() {
            if let Ok(found) = found {
                for d in found {
                    assert!(d.properties.contains_key("pci_bus_id"), "{d:?}");
                }
            }
        } else {
            assert_eq!(found.ok(), Some(Vec::new()));
            assert!(matches!(
                devices_with_telemetry(),
                Err(NvidiaError::NoDriver)
            ));
        }
    }
}
