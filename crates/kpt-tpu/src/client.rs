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
        let api = plugin.api();
        let mut g = args::<sys::PJRT_Device_GetDescription_Args>();
        g.device = self.raw;
        plugin.call(
            "PJRT_Device_GetDescription",
            api.PJRT_Device_GetDescription,
            &mut g,
        )?;
        let desc = g.device_description;
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
        let attributes = if attrs.num_attributes == 0 {
            Vec::new()
        } else {
            // SAFETY: the attributes are owned by the description (which lives as long as
            // the client) and `num_attributes` long.
            let raw = unsafe { std::slice::from_raw_parts(attrs.attributes, attrs.num_attributes) };
            raw.iter().map(|v| unsafe { named_value(v) }).collect()
        };
        Ok(DeviceDescription {
            id: id.id,
            process_index: proc_.process_index,
            // SAFETY: both strings are owned by the description, of the given lengths.
            kind: unsafe { lossy(kind.device_kind, kind.device_kind_size) },
            debug_string: unsafe { lossy(dbg.debug_string, dbg.debug_string_size) },
            attributes,
        })
    }
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
