//! ROCm device discovery: what `kpt detect` shows and what kernel selection needs.
//!
//! [`DeviceProperties`] is what the HIP runtime reports about one device, read by
//! [`devices`] (`hipDeviceGetAttribute` per field, `hipDeviceGetName`,
//! `hipDeviceTotalMem`, and `gcnArchName` from `hipGetDeviceProperties*`); it is plain
//! data with serde, so recorded property tables of real devices drive the same code in
//! tests. [`AmdDevice`] adds the parsed [`GcnArch`].

use std::collections::BTreeMap;

use kpt_core::hardware::{DeviceInfo, DeviceKind, HardwareDetector};
use serde::{Deserialize, Serialize};

use crate::arch::{Fp8Format, GcnArch, MatrixCores, Tuning};
use crate::runtime::{HipRuntime, HipVersion};
use crate::sys::{self, attr};
use crate::AmdError;

/// What the HIP runtime reports about one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceProperties {
    /// Marketing name, e.g. `AMD Instinct MI300X`.
    pub name: String,
    /// Target ID with features, e.g. `gfx942:sramecc+:xnack-`.
    pub gcn_arch_name: String,
    /// Compute units (on RDNA in WGP mode some runtimes report work-group processors).
    pub compute_units: u32,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Peak engine clock in kHz.
    pub clock_khz: u32,
    /// Peak memory clock in kHz.
    pub memory_clock_khz: u32,
    /// Memory bus width in bits.
    pub memory_bus_width: u32,
    /// L2 cache in bytes.
    pub l2_bytes: u64,
    /// LDS per block in bytes.
    pub lds_per_block: u32,
    /// LDS per compute unit in bytes.
    pub lds_per_cu: u64,
    /// Threads per wavefront.
    pub warp_size: u32,
    /// Largest block in threads.
    pub max_threads_per_block: u32,
    /// Resident threads per compute unit at most.
    pub max_threads_per_cu: u32,
    /// An APU sharing memory with the CPU.
    pub integrated: bool,
    /// PCI `(domain, bus, device)`.
    pub pci: (u32, u32, u32),
}

/// One ROCm device: its properties and its parsed architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmdDevice {
    /// HIP device ordinal.
    pub index: usize,
    /// What the runtime reported.
    pub properties: DeviceProperties,
    /// `gcnArchName`, parsed.
    pub arch: GcnArch,
    /// The HIP runtime's version, when read from a runtime.
    pub runtime_version: Option<HipVersion>,
}

impl AmdDevice {
    /// Parses the architecture of `properties`; [`AmdError::InvalidArch`] when its
    /// `gcn_arch_name` is not a target ID.
    pub fn new(index: usize, properties: DeviceProperties) -> Result<AmdDevice, AmdError> {
        let arch = GcnArch::parse(&properties.gcn_arch_name)?;
        if properties.warp_size != arch.wave_size() {
            tracing::warn!(
                device = index,
                arch = %arch,
                reported = properties.warp_size,
                expected = arch.wave_size(),
                "the device reports a wave size its architecture does not default to"
            );
        }
        Ok(AmdDevice {
            index,
            properties,
            arch,
            runtime_version: None,
        })
    }

    /// The tuning table of the device's architecture.
    pub fn tuning(&self) -> Tuning {
        self.arch.tuning()
    }

    /// The device as `kpt detect` and the kernel registry see it: `arch` is the
    /// processor (`gfx942`), which selects code objects. Features: `fp32`, `fp16`,
    /// `bf16` (matrix instructions that take it), `fp8` (with `fp8_fnuz` or
    /// `fp8_ocp` for the encoding), `mfma` or `wmma`, `wave64` or `wave32`.
    /// Properties: `gcn_arch_name`, `family`, `wave_size`, `lds_per_block`, `l2`,
    /// `clock_mhz`, `memory_clock_mhz`, `memory_bus_width`, `pci_bus_id`, and
    /// `hip_runtime` when known.
    pub fn device_info(&self) -> DeviceInfo {
        let p = &self.properties;
        let mut features = vec!["fp32".to_string(), "fp16".to_string()];
        if self.arch.has_bf16_matrix() {
            features.push("bf16".into());
        }
        match self.arch.fp8() {
            Some(Fp8Format::Fnuz) => features.extend(["fp8".into(), "fp8_fnuz".into()]),
            Some(Fp8Format::Ocp) => features.extend(["fp8".into(), "fp8_ocp".into()]),
            None => {}
        }
        match self.arch.matrix_cores() {
            MatrixCores::Mfma => features.push("mfma".into()),
            MatrixCores::Wmma => features.push("wmma".into()),
            MatrixCores::None => {}
        }
        features.push(format!("wave{}", p.warp_size));
        let mut properties = BTreeMap::new();
        properties.insert("gcn_arch_name".into(), p.gcn_arch_name.clone());
        properties.insert("family".into(), self.arch.family().name().into());
        properties.insert("wave_size".into(), p.warp_size.to_string());
        properties.insert("lds_per_block".into(), p.lds_per_block.to_string());
        properties.insert("l2".into(), p.l2_bytes.to_string());
        properties.insert("clock_mhz".into(), (p.clock_khz / 1000).to_string());
        properties.insert(
            "memory_clock_mhz".into(),
            (p.memory_clock_khz / 1000).to_string(),
        );
        properties.insert("memory_bus_width".into(), p.memory_bus_width.to_string());
        let (domain, bus, device) = p.pci;
        properties.insert(
            "pci_bus_id".into(),
            format!("{domain:04x}:{bus:02x}:{device:02x}.0"),
        );
        if let Some(v) = self.runtime_version {
            properties.insert("hip_runtime".into(), v.to_string());
        }
        DeviceInfo {
            kind: DeviceKind::Rocm,
            index: self.index,
            name: p.name.clone(),
            memory_bytes: Some(p.memory_bytes),
            compute_units: Some(p.compute_units as usize),
            arch: Some(self.arch.processor().to_string()),
            features,
            properties,
        }
    }
}

/// The recorded property tables (`crates/kpt-amd/devices/*.json`, each with the public
/// sources of its numbers): name and JSON.
const RECORDED: [(&str, &str); 3] = [
    ("mi250x", include_str!("../devices/mi250x.json")),
    ("mi300x", include_str!("../devices/mi300x.json")),
    ("rx7900xtx", include_str!("../devices/rx7900xtx.json")),
];

/// The names of the recorded devices: `mi250x` (one die of an Instinct MI250X),
/// `mi300x` (Instinct MI300X), `rx7900xtx` (Radeon RX 7900 XTX).
pub fn recorded_devices() -> Vec<&'static str> {
    RECORDED.iter().map(|(name, _)| *name).collect()
}

/// A recorded device as kpt would see it (what `kpt kernels --explain --on mi300x`
/// explains against); [`AmdError::Recorded`] for another name.
pub fn recorded_device(name: &str) -> Result<AmdDevice, AmdError> {
    #[derive(Deserialize)]
    struct Recorded {
        properties: DeviceProperties,
    }
    let known = recorded_devices().join(", ");
    let err = |reason: String| AmdError::Recorded {
        name: name.to_string(),
        reason,
        known: known.clone(),
    };
    let key = name.to_ascii_lowercase().replace([' ', '-', '_'], "");
    let (_, json) = RECORDED
        .iter()
        .find(|(n, _)| *n == key)
        .ok_or_else(|| err("not recorded".into()))?;
    let r: Recorded = serde_json::from_str(json).map_err(|e| err(e.to_string()))?;
    AmdDevice::new(0, r.properties)
}

/// Whether the HIP runtime library can be loaded on this machine.
pub fn runtime_present() -> bool {
    HipRuntime::present()
}

/// The properties of device `device` as `runtime` reports them.
pub fn read_properties(runtime: &HipRuntime, device: i32) -> Result<DeviceProperties, AmdError> {
    let get = |a| runtime.attribute(device, a);
    let unsigned = |a| get(a).map(|v| u32::try_from(v).unwrap_or(0));
    Ok(DeviceProperties {
        name: runtime.device_name(device)?,
        gcn_arch_name: runtime.gcn_arch_name(device)?,
        compute_units: unsigned(attr::MULTIPROCESSOR_COUNT)?,
        memory_bytes: runtime.device_total_mem(device)?,
        clock_khz: unsigned(attr::CLOCK_RATE)?,
        memory_clock_khz: unsigned(attr::MEMORY_CLOCK_RATE)?,
        memory_bus_width: unsigned(attr::MEMORY_BUS_WIDTH)?,
        l2_bytes: u64::from(unsigned(attr::L2_CACHE_SIZE)?),
        lds_per_block: unsigned(attr::MAX_SHARED_MEMORY_PER_BLOCK)?,
        lds_per_cu: u64::from(unsigned(attr::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?),
        warp_size: unsigned(attr::WARP_SIZE)?,
        max_threads_per_block: unsigned(attr::MAX_THREADS_PER_BLOCK)?,
        max_threads_per_cu: unsigned(attr::MAX_THREADS_PER_MULTIPROCESSOR)?,
        integrated: get(attr::INTEGRATED)? != 0,
        pci: (
            unsigned(attr::PCI_DOMAIN_ID)?,
            unsigned(attr::PCI_BUS_ID)?,
            unsigned(attr::PCI_DEVICE_ID)?,
        ),
    })
}

/// Every ROCm device of `runtime`: empty when the runtime sees none (no GPU, no
/// `/dev/kfd`, or all hidden by `HIP_VISIBLE_DEVICES`): `hipInit` returning
/// `hipErrorNoDevice`, `hipErrorInsufficientDriver` or (ROCm 5.2 without `/dev/kfd`)
/// `hipErrorInvalidDevice`.
pub fn devices_of(runtime: &HipRuntime) -> Result<Vec<AmdDevice>, AmdError> {
    match runtime.init() {
        Ok(()) => {}
        Err(AmdError::Hip { code, .. })
            if [
                sys::HIP_ERROR_NO_DEVICE,
                sys::HIP_ERROR_INSUFFICIENT_DRIVER,
                sys::HIP_ERROR_INVALID_DEVICE,
            ]
            .contains(&code) =>
        {
            tracing::debug!(code, "the HIP runtime sees no device");
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    }
    let count = match runtime.device_count() {
        Ok(n) => n,
        Err(AmdError::Hip { code, .. }) if code == sys::HIP_ERROR_NO_DEVICE => 0,
        Err(e) => return Err(e),
    };
    let mut out = Vec::with_capacity(count);
    for index in 0..count {
        let ordinal = i32::try_from(index).unwrap_or(i32::MAX);
        let mut device = AmdDevice::new(index, read_properties(runtime, ordinal)?)?;
        device.runtime_version = runtime.version();
        out.push(device);
    }
    tracing::debug!(count = out.len(), "ROCm devices found");
    Ok(out)
}

/// Every ROCm device: [`AmdError::NoRuntime`] without a HIP runtime, empty when it
/// sees no device.
pub fn devices() -> Result<Vec<AmdDevice>, AmdError> {
    devices_of(HipRuntime::global()?)
}

/// Finds ROCm devices for `kpt detect`; none (not an error) without a runtime. Each is
/// shown as the backend presents it ([`crate::backend_device_info`]: with the `rocblas`
/// feature when rocBLAS loads), so that `kpt detect` and kernel selection agree.
#[derive(Debug, Clone, Copy, Default)]
pub struct RocmDetector;

impl HardwareDetector for RocmDetector {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Rocm
    }

    fn detect(&self) -> kpt_core::Result<Vec<DeviceInfo>> {
        match devices() {
            Ok(d) if d.is_empty() => Ok(Vec::new()),
            Ok(d) => {
                let rocblas = crate::blas::rocblas_present();
                let hipblaslt = crate::hipblaslt::hipblaslt_present();
                Ok(d.iter()
                    .map(|d| {
                        let libraries = crate::Libraries {
                            rocblas,
                            hipblaslt_fp8: hipblaslt
                                && crate::backend::hiprtc_builds(d.arch.processor()),
                        };
                        crate::backend_device_info(d, libraries)
                    })
                    .collect())
            }
            Err(AmdError::NoRuntime { .. }) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(gcn: &str, warp: u32) -> DeviceProperties {
        DeviceProperties {
            name: "test".into(),
            gcn_arch_name: gcn.into(),
            compute_units: 4,
            memory_bytes: 1 << 30,
            clock_khz: 1_000_000,
            memory_clock_khz: 500_000,
            memory_bus_width: 128,
            l2_bytes: 1 << 20,
            lds_per_block: 65536,
            lds_per_cu: 65536,
            warp_size: warp,
            max_threads_per_block: 1024,
            max_threads_per_cu: 2048,
            integrated: false,
            pci: (0, 0x2f, 0),
        }
    }

    #[test]
    fn recorded_devices_parse_and_unknown_names_are_errors() {
        for name in recorded_devices() {
            let d = recorded_device(name).unwrap();
            assert_eq!(d.properties.warp_size, d.arch.wave_size(), "{name}");
        }
        assert_eq!(
            recorded_device("MI300X").unwrap().arch.processor(),
            "gfx942"
        );
        assert_eq!(
            recorded_device("rx-7900-xtx").unwrap().arch.processor(),
            "gfx1100"
        );
        let err = recorded_device("mi100").unwrap_err();
        assert!(matches!(err, AmdError::Recorded { .. }), "{err:?}");
        assert!(
            err.to_string().contains("mi250x, mi300x, rx7900xtx"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_arch_name_is_an_error() {
        let err = AmdDevice::new(0, props("", 64)).unwrap_err();
        assert!(matches!(err, AmdError::InvalidArch { .. }), "{err:?}");
        let err = AmdDevice::new(0, props("amdgcn-amd-amdhsa--gfx90a", 64)).unwrap_err();
        assert!(matches!(err, AmdError::InvalidArch { .. }), "{err:?}");
    }

    #[test]
    fn device_info_names_arch_features_and_pci() {
        let d = AmdDevice::new(1, props("gfx1030", 32))
            .unwrap()
            .device_info();
        assert_eq!((d.kind, d.index), (DeviceKind::Rocm, 1));
        assert_eq!(d.arch.as_deref(), Some("gfx1030"));
        assert!(d.has_feature("wave32") && !d.has_feature("bf16") && !d.has_feature("wmma"));
        assert_eq!(d.properties["pci_bus_id"], "0000:2f:00.0");
        assert_eq!(d.properties["family"], "RDNA2");
        assert!(!d.properties.contains_key("hip_runtime"));
    }

    #[test]
    fn properties_round_trip_through_json() {
        let p = props("gfx90a:sramecc+:xnack-", 64);
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<DeviceProperties>(&text).unwrap(), p);
    }

    /// Without a runtime there is no device and no error; with one (this machine may
    /// have ROCm's libraries but no GPU), the detector still does not fail for lack of
    /// a device.
    #[test]
    fn detector_never_fails_for_lack_of_a_runtime_or_device() {
        match HipRuntime::global() {
            Err(AmdError::NoRuntime { .. }) => {
                assert_eq!(RocmDetector.detect().ok(), Some(Vec::new()));
                assert!(matches!(devices(), Err(AmdError::NoRuntime { .. })));
            }
            Err(e) => panic!("loading the HIP runtime failed: {e}"),
            Ok(rt) => {
                let found = devices_of(rt).unwrap();
                for d in &found {
                    assert!(!d.properties.gcn_arch_name.is_empty());
                    assert!(d.properties.memory_bytes > 0);
                }
                assert_eq!(RocmDetector.detect().unwrap().len(), found.len());
            }
        }
    }
}
