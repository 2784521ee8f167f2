//! GPU telemetry (clocks, temperature, power) through NVML, for `kpt detect`.
//!
//! NVML (`libnvidia-ml.so.1`, shipped with the NVIDIA driver) is loaded at run time by
//! [nvml-wrapper](https://docs.rs/nvml-wrapper); nothing links against it at build time.
//! Telemetry is best effort: where the library is missing, the driver is not running,
//! a device is unknown to NVML or one reading is not supported, that value is `None`.
//! Reading telemetry never fails and never panics.
//!
//! NVML numbers devices in PCI order and ignores `CUDA_VISIBLE_DEVICES`, CUDA numbers
//! them fastest first; devices are therefore matched by PCI address, never by index.

use std::ffi::OsStr;

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::device::PciAddress;

/// Live readings of one GPU from NVML; each is `None` where NVML cannot report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct GpuTelemetry {
    /// Current SM clock, in MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Highest SM clock the device supports, in MHz.
    pub sm_clock_max_mhz: Option<u32>,
    /// Current memory clock, in MHz.
    pub memory_clock_mhz: Option<u32>,
    /// Highest memory clock the device supports, in MHz.
    pub memory_clock_max_mhz: Option<u32>,
    /// Temperature of the GPU die, in degrees Celsius.
    pub temperature_c: Option<u32>,
    /// Power draw of the board, in milliwatts.
    pub power_draw_mw: Option<u32>,
    /// Power limit the driver enforces, in milliwatts.
    pub power_limit_mw: Option<u32>,
}

impl GpuTelemetry {
    /// Whether no reading is present.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The readings that are present as `(key, value)` pairs for
    /// [`DeviceInfo::properties`](kpt_core::hardware::DeviceInfo::properties): the key
    /// names the unit (`sm_clock_mhz`, `sm_clock_max_mhz`, `memory_clock_mhz`,
    /// `memory_clock_max_mhz`, `temperature_c`, `power_draw_w`, `power_limit_w`), the
    /// value is a plain number (watts with one decimal).
    pub fn properties(&self) -> Vec<(&'static str, String)> {
        let whole = |v: Option<u32>| v.map(|v| v.to_string());
        let watts = |v: Option<u32>| v.map(|mw| format!("{:.1}", f64::from(mw) / 1000.0));
        [
            ("sm_clock_mhz", whole(self.sm_clock_mhz)),
            ("sm_clock_max_mhz", whole(self.sm_clock_max_mhz)),
            ("memory_clock_mhz", whole(self.memory_clock_mhz)),
            ("memory_clock_max_mhz", whole(self.memory_clock_max_mhz)),
            ("temperature_c", whole(self.temperature_c)),
            ("power_draw_w", watts(self.power_draw_mw)),
            ("power_limit_w", watts(self.power_limit_mw)),
        ]
        .into_iter()
        .filter_map(|(key, value)| value.map(|v| (key, v)))
        .collect()
    }
}

/// Reads the telemetry of the GPUs at `addresses` through the system's NVML: one entry
/// per address, in order; `None` where NVML is absent or has no reading of that device.
pub fn telemetry(addresses: &[PciAddress]) -> Vec<Option<GpuTelemetry>> {
    read(None, addresses)
}

/// [`telemetry`] with NVML loaded from `library` (a file name or path), or from the
/// default `libnvidia-ml.so.1` when `None`.
fn read(library: Option<&OsStr>, addresses: &[PciAddress]) -> Vec<Option<GpuTelemetry>> {
    if addresses.is_empty() {
        return Vec::new();
    }
    let mut builder = Nvml::builder();
    if let Some(library) = library {
        builder.lib_path(library);
    }
    let nvml = match builder.init() {
        Ok(nvml) => nvml,
        Err(e) => {
            tracing::debug!(error = %e, "NVML not available; no GPU telemetry");
            return vec![None; addresses.len()];
        }
    };
    addresses.iter().map(|a| read_device(&nvml, *a)).collect()
}

/// The readings of the device at `address`; `None` when NVML does not know it or
/// reports nothing for it.
fn read_device(nvml: &Nvml, address: PciAddress) -> Option<GpuTelemetry> {
    let device = match nvml.device_by_pci_bus_id(address.to_string()) {
        Ok(device) => device,
        Err(e) => {
            tracing::debug!(pci = %address, error = %e, "NVML does not know this GPU");
            return None;
        }
    };
    let reading = |what: &'static str, r: Result<u32, NvmlError>| match r {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::debug!(pci = %address, reading = what, error = %e, "NVML reading unavailable");
            None
        }
    };
    let t = GpuTelemetry {
        sm_clock_mhz: reading("SM clock", device.clock_info(Clock::SM)),
        sm_clock_max_mhz: reading("max SM clock", device.max_clock_info(Clock::SM)),
        memory_clock_mhz: reading("memory clock", device.clock_info(Clock::Memory)),
        memory_clock_max_mhz: reading("max memory clock", device.max_clock_info(Clock::Memory)),
        temperature_c: reading("temperature", device.temperature(TemperatureSensor::Gpu)),
        power_draw_mw: reading("power draw", device.power_usage()),
        power_limit_mw: reading("power limit", device.enforced_power_limit()),
    };
    (!t.is_empty()).then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> GpuTelemetry {
        GpuTelemetry {
            sm_clock_mhz: Some(1755),
            sm_clock_max_mhz: Some(1980),
            memory_clock_mhz: Some(2619),
            memory_clock_max_mhz: Some(2619),
            temperature_c: Some(34),
            power_draw_mw: Some(71_234),
            power_limit_mw: Some(700_000),
        }
    }

    #[test]
    fn properties_name_their_units() {
        let p = h100().properties();
        let keys: Vec<&str> = p.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "sm_clock_mhz",
                "sm_clock_max_mhz",
                "memory_clock_mhz",
                "memory_clock_max_mhz",
                "temperature_c",
                "power_draw_w",
                "power_limit_w"
            ]
        );
        let value = |k: &str| p.iter().find(|(key, _)| *key == k).map(|(_, v)| v.as_str());
        assert_eq!(value("sm_clock_mhz"), Some("1755"));
        assert_eq!(value("temperature_c"), Some("34"));
        assert_eq!(value("power_draw_w"), Some("71.2"));
        assert_eq!(value("power_limit_w"), Some("700.0"));
    }

    #[test]
    fn missing_readings_are_left_out() {
        let t = GpuTelemetry {
            temperature_c: Some(40),
            ..GpuTelemetry::default()
        };
        assert!(!t.is_empty());
        assert_eq!(t.properties(), vec![("temperature_c", "40".to_string())]);
        assert!(GpuTelemetry::default().is_empty());
        assert!(GpuTelemetry::default().properties().is_empty());
    }

    #[test]
    fn an_absent_library_gives_no_telemetry() {
        let addresses = [
            PciAddress {
                domain: 0,
                bus: 0x65,
                device: 0,
            },
            PciAddress {
                domain: 1,
                bus: 0x3b,
                device: 0,
            },
        ];
        let found = read(
            Some(OsStr::new("libkpt-test-no-such-nvml.so.1")),
            &addresses,
        );
        assert_eq!(found, vec![None, None]);
        let found = read(
            Some(OsStr::new("/nonexistent/libnvidia-ml.so.1")),
            &addresses,
        );
        assert_eq!(found, vec![None, None]);
        assert!(read(Some(OsStr::new("libkpt-test-no-such-nvml.so.1")), &[]).is_empty());
    }

    /// The system NVML: absent on a machine without the driver, readings on a GPU
    /// machine; never a panic, and one entry per address either way.
    #[test]
    fn system_library_never_fails() {
        let addresses = [PciAddress {
            domain: 0xffff,
            bus: 0xff,
            device: 0x1f,
        }];
        let found = telemetry(&addresses);
        assert_eq!(found.len(), 1);
        // No GPU sits at that address.
        assert_eq!(found[0], None);
    }
}
