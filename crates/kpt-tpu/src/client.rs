//! A PJRT client: the devices of one plugin in this process, and the programs and
//! buffers on them.

use std::sync::Arc;

use crate::error::{PjrtError, Result};
use crate::plugin::{args, lossy, Plugin};
use crate::sys;

/// A client of one plugin (`PJRT_Client`): a shared handle, destroyed with its last
/// clone and with the last buffer or executable made from it.
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

struct ClientInner {
    plugin: Arc<Plugin>,
    raw: *mut sys::PJRT_Client,
}

// SAFETY: a PJRT client may be used from any thread (the C API is thread-safe).
unsafe impl Send for ClientInner {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("plugin", self.plugin())
            .field("platform", &self.platform_name().unwrap_or_default())
            .finish()
    }
}

impl Client {
    /// Creates a client with the plugin's default options.
    pub fn new(plugin: &Arc<Plugin>) -> Result<Client> {
        let mut a = args::<sys::PJRT_Client_Create_Args>();
        plugin.call(
            "PJRT_Client_Create",
            plugin.api().PJRT_Client_Create,
            &mut a,
        )?;
        if a.client.is_null() {
            return Err(PjrtError::Invalid(
                "PJRT_Client_Create returned no client".into(),
            ));
        }
        Ok(Client {
            inner: Arc::new(ClientInner {
                plugin: plugin.clone(),
                raw: a.client,
            }),
        })
    }

    /// The plugin this client runs on.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.plugin
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Client {
        self.inner.raw
    }

    /// The platform's name (`cpu`, `cuda`, `tpu`, ...).
    pub fn platform_name(&self) -> Result<String> {
        let mut a = args::<sys::PJRT_Client_PlatformName_Args>();
        a.client = self.raw();
        let api = self.plugin().api();
        self.plugin().call(
            "PJRT_Client_PlatformName",
            api.PJRT_Client_PlatformName,
            &mut a,
        )?;
        // SAFETY: the name is owned by the client and `platform_name_size` long.
        Ok(unsafe { lossy(a.platform_name, a.platform_name_size) })
    }

    /// The platform's version string (the plugin's build, driver or libtpu version).
    pub fn platform_version(&self) -> Result<String> {
        let mut a = args::<sys::PJRT_Client_PlatformVersion_Args>();
        a.client = self.raw();
        let api = self.plugin().api();
        self.plugin().call(
            "PJRT_Client_PlatformVersion",
            api.PJRT_Client_PlatformVersion,
            &mut a,
        )?;
        // SAFETY: as in `platform_name`.
        Ok(unsafe { lossy(a.platform_version, a.platform_version_size) })
    }

    /// The devices this process can run programs on, in the plugin's order.
    pub fn devices(&self) -> Result<Vec<Device>> {
        let mut a = args::<sys::PJRT_Client_AddressableDevices_Args>();
        a.client = self.raw();
        let api = self.plugin().api();
        self.plugin().call(
            "PJRT_Client_AddressableDevices",
            api.PJRT_Client_AddressableDevices,
            &mut a,
        )?;
        if a.num_addressable_devices == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the array is owned by the client and holds `num_addressable_devices`
        // device pointers that live as long as the client.
        let raw =
            unsafe { std::slice::from_raw_parts(a.addressable_devices, a.num_addressable_devices) };
        Ok(raw
            .iter()
            .map(|&raw| Device {
                client: self.clone(),
                raw,
            })
            .collect())
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut a = args::<sys::PJRT_Client_Destroy_Args>();
        a.client = self.raw;
        let api = self.plugin.api();
        if let Err(e) = self
            .plugin
            .call("PJRT_Client_Destroy", api.PJRT_Client_Destroy, &mut a)
        {
            tracing::warn!("{e}");
        }
    }
}

/// A device of a [`Client`].
#[derive(Clone)]
pub struct Device {
    client: Client,
    raw: *mut sys::PJRT_Device,
}

// SAFETY: a device handle is an immutable pointer owned by the client, usable from any
// thread.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.description() {
            Ok(d) => d.fmt(f),
            Err(e) => write!(f, "Device(<{e}>)"),
        }
    }
}

/// A value of a device attribute.
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    /// A string.
    String(String),
    /// An integer.
    Int(i64),
    /// A list of integers (coordinates, for one).
    Ints(Vec<i64>),
    /// A float.
    Float(f32),
    /// A boolean.
    Bool(bool),
}

/// What a plugin says about one device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceDescription {
    /// The device's global id.
    pub id: i32,
    /// The process that owns it.
    pub process_index: i32,
    /// The kind of device (`cpu`, a GPU's name, `TPU v5 lite`, ...).
    pub kind: String,
    /// The plugin's one-line description.
    pub debug_string: String,
    /// Vendor attributes (a TPU's `coords` and `core_on_chip`, a GPU's
    /// `compute_capability`, ...).
    pub attributes: Vec<(String, AttrValue)>,
}

impl DeviceDescription {
    /// The attribute `name`, if the plugin gives it.
    pub fn attribute(&self, name: &str) -> Option<&AttrValue> {
        self.attributes
            .iter()
            .find_map(|(n, v)| (n == name).then_some(v))
    }
}

impl Device {
    pub(crate) fn raw(&self) -> *mut sys::PJRT_Device {
        self.raw
    }

    /// The client the device belongs to.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The device's description: id, kind and attributes.
    pub fn description(&self) -> Result<DeviceDescription> {
        let plugin = self.client.plugin();
        let mut g = args::<sys::PJRT_Device_GetDescription_Args>();
        g.device = self.raw;
        plugin.call(
            "PJRT_Device_GetDescription",
            plugin.api().PJRT_Device_GetDescription,
            &mut g,
        )?;
        // SAFETY: the description is owned by the device, which lives as long as the
        // client.
        unsafe { describe(plugin, g.device_description) }
    }

    /// The device's memory use as the plugin counts it (`PJRT_Device_MemoryStats`):
    /// libtpu and the CUDA plugin fill it from their allocators. A plugin that does not
    /// keep such statistics returns an error, `UNIMPLEMENTED` as a rule
    /// ([`PjrtError::Call`]), or [`PjrtError::Missing`] when its API table has no such
    /// entry.
    pub fn memory_stats(&self) -> Result<DeviceMemoryStats> {
        const NAME: &str = "PJRT_Device_MemoryStats";
        let plugin = self.client.plugin();
        if !plugin.has_entry(std::mem::offset_of!(sys::PJRT_Api, PJRT_Device_MemoryStats)) {
            return Err(PjrtError::Missing(NAME));
        }
        let mut a = args::<sys::PJRT_Device_MemoryStats_Args>();
        a.device = self.raw;
        plugin.call(NAME, plugin.api().PJRT_Device_MemoryStats, &mut a)?;
        let set = |value: i64, is_set: bool| {
            is_set
                .then(|| u64::try_from(value))
                .transpose()
                .map_err(|_| {
                    PjrtError::Invalid(format!("{NAME} returned a negative size ({value})"))
                })
        };
        Ok(DeviceMemoryStats {
            bytes_in_use: set(a.bytes_in_use, true)?.unwrap_or(0),
            peak_bytes_in_use: set(a.peak_bytes_in_use, a.peak_bytes_in_use_is_set)?,
            num_allocs: set(a.num_allocs, a.num_allocs_is_set)?,
            largest_alloc_size: set(a.largest_alloc_size, a.largest_alloc_size_is_set)?,
            bytes_limit: set(a.bytes_limit, a.bytes_limit_is_set)?,
            bytes_reserved: set(a.bytes_reserved, a.bytes_reserved_is_set)?,
        })
    }
}

/// A device's memory use as its plugin counts it ([`Device::memory_stats`]); a field
/// the plugin does not set is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceMemoryStats {
    /// Bytes allocated now.
    pub bytes_in_use: u64,
    /// The most bytes allocated at once.
    pub peak_bytes_in_use: Option<u64>,
    /// Allocations made.
    pub num_allocs: Option<u64>,
    /// The largest single allocation, bytes.
    pub largest_alloc_size: Option<u64>,
    /// The bytes the device's allocator may hand out (its memory, less what the runtime
    /// keeps).
    pub bytes_limit: Option<u64>,
    /// Bytes reserved by the allocator.
    pub bytes_reserved: Option<u64>,
}

/// The topology of a client's devices (`PJRT_Client_TopologyDescription`): every
/// device of the slice (not only those of this process), with the platform's name and
/// version and the plugin's topology attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// The platform (`cpu`, `cuda`, `tpu`, ...).
    pub platform_name: String,
    /// The topology's version string, as the plugin gives it (XLA's CUDA plugin: the
    /// device name; not always the client's `platform_version`).
    pub platform_version: String,
    /// Every device of the topology.
    pub devices: Vec<DeviceDescription>,
    /// The plugin's attributes of the topology, where it gives them.
    pub attributes: Vec<(String, AttrValue)>,
}

impl Topology {
    /// The chip coordinates of every device that gives them (a TPU's `coords`
    /// attribute), in device order.
    fn chip_coords(&self) -> Vec<&[i64]> {
        self.devices
            .iter()
            .filter_map(|d| match d.attribute("coords") {
                Some(AttrValue::Ints(c)) if !c.is_empty() => Some(c.as_slice()),
                _ => None,
            })
            .collect()
    }

    /// The number of chips along each axis (one more than the largest coordinate), as
    /// TPU slices are named (`2x2x1` for a v4-8 or a v5p-8): `None` when no device gives
    /// its chip's `coords`, or when devices give coordinates of different lengths or
    /// negative ones.
    pub fn chip_bounds(&self) -> Option<Vec<i64>> {
        let coords = self.chip_coords();
        let rank = coords.first()?.len();
        let mut bounds = vec![0i64; rank];
        for c in &coords {
            if c.len() != rank || c.iter().any(|&x| x < 0) {
                return None;
            }
            for (b, &x) in bounds.iter_mut().zip(c.iter()) {
                *b = (*b).max(x.saturating_add(1));
            }
        }
        Some(bounds)
    }

    /// The bounds of [`Topology::chip_bounds`] written as TPU slices are (`2x2x1`).
    pub fn chip_bounds_string(&self) -> Option<String> {
        let b = self.chip_bounds()?;
        Some(b.iter().map(i64::to_string).collect::<Vec<_>>().join("x"))
    }

    /// The number of distinct chips among the devices that give `coords` (0 when none
    /// does).
    pub fn chips(&self) -> usize {
        self.chip_coords()
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    }

    /// How many devices share the chip at `coords` (several where each TensorCore of a
    /// chip is its own device, as on v2 and v3).
    pub fn devices_on_chip(&self, coords: &[i64]) -> usize {
        self.chip_coords()
            .into_iter()
            .filter(|c| *c == coords)
            .count()
    }
}

impl Client {
    /// The topology of this client's devices. Owned by the client (not freed here).
    /// A plugin without topology support returns an error ([`PjrtError::Call`]), or
    /// [`PjrtError::Missing`] when its API table lacks the functions.
    pub fn topology(&self) -> Result<Topology> {
        let plugin = self.plugin();
        let api = plugin.api();
        let entries = [
            (
                "PJRT_Client_TopologyDescription",
                std::mem::offset_of!(sys::PJRT_Api, PJRT_Client_TopologyDescription),
            ),
            (
                "PJRT_TopologyDescription_GetDeviceDescriptions",
                std::mem::offset_of!(
                    sys::PJRT_Api,
                    PJRT_TopologyDescription_GetDeviceDescriptions
                ),
            ),
            (
                "PJRT_TopologyDescription_Attributes",
                std::mem::offset_of!(sys::PJRT_Api, PJRT_TopologyDescription_Attributes),
            ),
        ];
        if let Some((name, _)) = entries.iter().find(|(_, o)| !plugin.has_entry(*o)) {
            return Err(PjrtError::Missing(name));
        }
        let mut t = args::<sys::PJRT_Client_TopologyDescription_Args>();
        t.client = self.raw();
        plugin.call(
            "PJRT_Client_TopologyDescription",
            api.PJRT_Client_TopologyDescription,
            &mut t,
        )?;
        let topo = t.topology;
        if topo.is_null() {
            return Err(PjrtError::Invalid(
                "PJRT_Client_TopologyDescription returned no topology".into(),
            ));
        }
        let mut name = args::<sys::PJRT_TopologyDescription_PlatformName_Args>();
        name.topology = topo;
        plugin.call(
            "PJRT_TopologyDescription_PlatformName",
            api.PJRT_TopologyDescription_PlatformName,
            &mut name,
        )?;
        let mut version = args::<sys::PJRT_TopologyDescription_PlatformVersion_Args>();
        version.topology = topo;
        plugin.call(
            "PJRT_TopologyDescription_PlatformVersion",
            api.PJRT_TopologyDescription_PlatformVersion,
            &mut version,
        )?;
        let mut descs = args::<sys::PJRT_TopologyDescription_GetDeviceDescriptions_Args>();
        descs.topology = topo;
        plugin.call(
            "PJRT_TopologyDescription_GetDeviceDescriptions",
            api.PJRT_TopologyDescription_GetDeviceDescriptions,
            &mut descs,
        )?;
        let devices = if descs.num_descriptions == 0 || descs.descriptions.is_null() {
            Vec::new()
        } else {
            // SAFETY: the array is owned by the topology (which the client owns) and
            // `num_descriptions` long.
            let raw =
                unsafe { std::slice::from_raw_parts(descs.descriptions, descs.num_descriptions) };
            raw.iter()
                // SAFETY: each description is owned by the topology.
                .map(|&d| unsafe { describe(plugin, d) })
                .collect::<Result<Vec<_>>>()?
        };
        let mut attrs = args::<sys::PJRT_TopologyDescription_Attributes_Args>();
        attrs.topology = topo;
        plugin.call(
            "PJRT_TopologyDescription_Attributes",
            api.PJRT_TopologyDescription_Attributes,
            &mut attrs,
        )?;
        // SAFETY: the attributes are owned by the topology, `num_attributes` long.
        let attributes = unsafe { named_values(attrs.attributes, attrs.num_attributes) };
        Ok(Topology {
            // SAFETY: both strings are owned by the topology, of the given lengths.
            platform_name: unsafe { lossy(name.platform_name, name.platform_name_size) },
            platform_version: unsafe {
                lossy(version.platform_version, version.platform_version_size)
            },
            devices,
            attributes,
        })
    }
}

/// Reads a device description of the plugin.
///
/// # Safety
/// `desc` is a live `PJRT_DeviceDescription` of `plugin` that outlives this call.
unsafe fn describe(
    plugin: &Plugin,
    desc: *mut sys::PJRT_DeviceDescription,
) -> Result<DeviceDescription> {
    if desc.is_null() {
        return Err(PjrtError::Invalid(
            "the plugin returned no device description".into(),
        ));
    }
    let api = plugin.api();
    let mut id = args::<sys::PJRT_DeviceDescription_Id_Args>();
    id.device_description = desc;
    plugin.call(
        "PJRT_DeviceDescription_Id",
        api.PJRT_DeviceDescription_Id,
        &mut id,
    )?;
    let mut proc_ = args::<sys::PJRT_DeviceDescription_ProcessIndex_Args>();
    proc_.device_description = desc;
    plugin.call(
        "PJRT_DeviceDescription_ProcessIndex",
        api.PJRT_DeviceDescription_ProcessIndex,
        &mut proc_,
    )?;
    let mut kind = args::<sys::PJRT_DeviceDescription_Kind_Args>();
    kind.device_description = desc;
    plugin.call(
        "PJRT_DeviceDescription_Kind",
        api.PJRT_DeviceDescription_Kind,
        &mut kind,
    )?;
    let mut dbg = args::<sys::PJRT_DeviceDescription_DebugString_Args>();
    dbg.device_description = desc;
    plugin.call(
        "PJRT_DeviceDescription_DebugString",
        api.PJRT_DeviceDescription_DebugString,
        &mut dbg,
    )?;
    let mut attrs = args::<sys::PJRT_DeviceDescription_Attributes_Args>();
    attrs.device_description = desc;
    plugin.call(
        "PJRT_DeviceDescription_Attributes",
        api.PJRT_DeviceDescription_Attributes,
        &mut attrs,
    )?;
    // SAFETY: the attributes, the kind and the debug string are owned by the
    // description (per the function contract, alive), of the lengths given.
    unsafe {
        Ok(DeviceDescription {
            id: id.id,
            process_index: proc_.process_index,
            kind: lossy(kind.device_kind, kind.device_kind_size),
            debug_string: lossy(dbg.debug_string, dbg.debug_string_size),
            attributes: named_values(attrs.attributes, attrs.num_attributes),
        })
    }
}

/// Copies `n` named values.
///
/// # Safety
/// `values` points at `n` named values of the plugin (see [`named_value`]), or `n` is 0.
unsafe fn named_values(values: *const sys::PJRT_NamedValue, n: usize) -> Vec<(String, AttrValue)> {
    if n == 0 || values.is_null() {
        return Vec::new();
    }
    // SAFETY: per the function contract.
    let raw = unsafe { std::slice::from_raw_parts(values, n) };
    // SAFETY: as above.
    raw.iter().map(|v| unsafe { named_value(v) }).collect()
}

/// Copies a `PJRT_NamedValue`.
///
/// # Safety
/// `v` is a named value from the plugin: its name and (per its type) its value point
/// at readable memory of the sizes it gives.
unsafe fn named_value(v: &sys::PJRT_NamedValue) -> (String, AttrValue) {
    // SAFETY: per the function contract.
    unsafe {
        let name = lossy(v.name, v.name_size);
        let value = match v.type_ {
            sys::PJRT_NamedValue_kString => {
                AttrValue::String(lossy(v.__bindgen_anon_1.string_value, v.value_size))
            }
            sys::PJRT_NamedValue_kInt64 => AttrValue::Int(v.__bindgen_anon_1.int64_value),
            sys::PJRT_NamedValue_kInt64List => {
                let p = v.__bindgen_anon_1.int64_array_value;
                AttrValue::Ints(if p.is_null() {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(p, v.value_size).to_vec()
                })
            }
            sys::PJRT_NamedValue_kFloat => AttrValue::Float(v.__bindgen_anon_1.float_value),
            sys::PJRT_NamedValue_kBool => AttrValue::Bool(v.__bindgen_anon_1.bool_value),
            other => AttrValue::String(format!("<value of type {other}>")),
        };
        (name, value)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A TPU device description as libtpu gives it: `coords` of its chip and the core's
    /// index on the chip.
    pub(crate) fn tpu_device(id: i32, kind: &str, coords: &[i64], core: i64) -> DeviceDescription {
        DeviceDescription {
            id,
            process_index: 0,
            kind: kind.into(),
            debug_string: format!("TPU_{id}"),
            attributes: vec![
                ("coords".into(), AttrValue::Ints(coords.to_vec())),
                ("core_on_chip".into(), AttrValue::Int(core)),
            ],
        }
    }

    pub(crate) fn topology(devices: Vec<DeviceDescription>) -> Topology {
        Topology {
            platform_name: "tpu".into(),
            platform_version: "test".into(),
            devices,
            attributes: Vec::new(),
        }
    }

    #[test]
    fn chip_bounds_of_a_2x2x1_slice() {
        // A v4-8: four chips of one core device each (megacore).
        let t = topology(
            [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
                .iter()
                .enumerate()
                .map(|(i, c)| tpu_device(i as i32, "TPU v4", c, 0))
                .collect(),
        );
        assert_eq!(t.chip_bounds(), Some(vec![2, 2, 1]));
        assert_eq!(t.chip_bounds_string().as_deref(), Some("2x2x1"));
        assert_eq!(t.chips(), 4);
        assert_eq!(t.devices_on_chip(&[1, 0, 0]), 1);
        assert_eq!(t.devices_on_chip(&[5, 5, 5]), 0);
    }

    #[test]
    fn devices_sharing_a_chip_are_counted() {
        // A v3-8: four chips, two TensorCores (devices) each.
        let mut devices = Vec::new();
        for (i, c) in [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
            .iter()
            .enumerate()
        {
            for core in 0..2 {
                devices.push(tpu_device((2 * i + core) as i32, "TPU v3", c, core as i64));
            }
        }
        let t = topology(devices);
        assert_eq!(t.chips(), 4);
        assert_eq!(t.devices.len(), 8);
        assert_eq!(t.devices_on_chip(&[0, 1, 0]), 2);
        assert_eq!(t.chip_bounds_string().as_deref(), Some("2x2x1"));
    }

    #[test]
    fn no_or_inconsistent_coords_give_no_bounds() {
        let cpu = DeviceDescription {
            id: 0,
            process_index: 0,
            kind: "cpu".into(),
            debug_string: "TFRT_CPU_0".into(),
            attributes: Vec::new(),
        };
        let t = topology(vec![cpu.clone(), cpu]);
        assert_eq!(t.chip_bounds(), None);
        assert_eq!(t.chip_bounds_string(), None);
        assert_eq!(t.chips(), 0);
        let mixed = topology(vec![
            tpu_device(0, "TPU v4", &[0, 0, 0], 0),
            tpu_device(1, "TPU v4", &[1, 0], 0),
        ]);
        assert_eq!(mixed.chip_bounds(), None);
        let negative = topology(vec![tpu_device(0, "TPU v4", &[0, -1, 0], 0)]);
        assert_eq!(negative.chip_bounds(), None);
        let huge = topology(vec![tpu_device(0, "TPU v4", &[i64::MAX, 0], 0)]);
        assert_eq!(huge.chip_bounds(), Some(vec![i64::MAX, 1]));
        assert!(topology(Vec::new()).chip_bounds().is_none());
    }
}
