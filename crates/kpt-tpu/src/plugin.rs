//! Loading a PJRT plugin (a shared library exporting `GetPjrtApi`) and calling its C
//! API: every call goes through [`Plugin::call`], which turns a returned `PJRT_Error`
//! into a [`PjrtError`] with the plugin's message and frees it.

use std::ffi::c_char;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{code_name, PjrtError, Result};
use crate::sys;

/// Environment variable naming the plugin library kpt loads by default.
pub const PLUGIN_ENV: &str = "KPT_PJRT_PLUGIN";

/// A loaded PJRT plugin: the library and its API table.
///
/// The library is never unloaded: XLA plugins keep threads and static state that do
/// not survive `dlclose`, so JAX and PyTorch/XLA keep them for the life of the process
/// as well.
pub struct Plugin {
    _lib: ManuallyDrop<libloading::Library>,
    api: *const sys::PJRT_Api,
    path: PathBuf,
}

// SAFETY: the PJRT C API is thread-safe (its functions may be called from any thread,
// as JAX does), and the table `api` points at is immutable and lives as long as the
// library, which is never unloaded.
unsafe impl Send for Plugin {}
// SAFETY: as above.
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.api_version();
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("api_version", &format_args!("{major}.{minor}"))
            .finish()
    }
}

/// Creates an argument struct of the C API: zeroed, with its `struct_size` set.
pub(crate) fn args<T: sys::Args>() -> T {
    // SAFETY: every argument struct of the C API is plain data (integers, pointers,
    // nullable function pointers) for which all-zero bytes are a valid value.
    let mut a: T = unsafe { std::mem::zeroed() };
    // SAFETY: every argument struct starts with `size_t struct_size`.
    unsafe { *(&mut a as *mut T).cast::<usize>() = T::STRUCT_SIZE };
    a
}

impl Plugin {
    /// Loads the plugin at `path`, checks that it implements the major version of the C
    /// API kpt is built for, and initializes it.
    pub fn load(path: impl AsRef<Path>) -> Result<Arc<Plugin>> {
        let path = path.as_ref().to_path_buf();
        let load_err = |reason: String| PjrtError::Load {
            path: path.clone(),
            reason,
        };
        // SAFETY: loading a library runs its initializers; a PJRT plugin is a library
        // built to be loaded this way (JAX dlopens the same files).
        let lib =
            unsafe { libloading::Library::new(&path) }.map_err(|e| load_err(e.to_string()))?;
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin
        // (`const PJRT_Api* GetPjrtApi()`).
        let api = unsafe {
            let get = lib
                .get::<unsafe extern "C" fn() -> *const sys::PJRT_Api>(b"GetPjrtApi\0")
                .map_err(|e| load_err(e.to_string()))?;
            get()
        };
        if api.is_null() {
            return Err(load_err("GetPjrtApi returned null".into()));
        }
        let plugin = Plugin {
            _lib: ManuallyDrop::new(lib),
            api,
            path,
        };
        let (major, minor) = plugin.api_version();
        if major != sys::API_MAJOR {
            return Err(PjrtError::Version {
                path: plugin.path.clone(),
                major,
                minor,
                want_major: sys::API_MAJOR,
            });
        }
        let mut init = args::<sys::PJRT_Plugin_Initialize_Args>();
        plugin.call(
            "PJRT_Plugin_Initialize",
            plugin.api().PJRT_Plugin_Initialize,
            &mut init,
        )?;
        tracing::debug!(path = %plugin.path.display(), major, minor, "loaded PJRT plugin");
        Ok(Arc::new(plugin))
    }

    /// Loads the plugin named by `KPT_PJRT_PLUGIN`, if it is set.
    pub fn from_env() -> Option<Result<Arc<Plugin>>> {
        std::env::var_os(PLUGIN_ENV).map(|p| Plugin::load(PathBuf::from(p)))
    }

    /// The plugin library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The C API version the plugin implements, `(major, minor)`.
    pub fn api_version(&self) -> (i32, i32) {
        let v = &self.api().pjrt_api_version;
        (v.major_version, v.minor_version)
    }

    /// The API table.
    pub(crate) fn api(&self) -> &sys::PJRT_Api {
        // SAFETY: `api` is non-null (checked in `load`) and lives as long as the library,
        // which is never unloaded.
        unsafe { &*self.api }
    }

    /// Whether the plugin's API table reaches the entry at byte `offset`
    /// (`std::mem::offset_of!(sys::PJRT_Api, ...)`): a plugin built for an earlier
    /// minor version of the C API has a shorter table, whose later entries must not be
    /// read.
    pub(crate) fn has_entry(&self, offset: usize) -> bool {
        self.api().struct_size >= offset + std::mem::size_of::<usize>()
    }

    /// Calls `func` (the table entry named `name`) with `args`, turning a returned error
    /// into [`PjrtError::Call`].
    pub(crate) fn call<A>(
        &self,
        name: &'static str,
        func: Option<unsafe extern "C" fn(*mut A) -> *mut sys::PJRT_Error>,
        args: &mut A,
    ) -> Result<()> {
        let f = func.ok_or(PjrtError::Missing(name))?;
        // SAFETY: `args` is the argument struct of `func` (the bindings pair them by
        // name), created by [`args`] with its `struct_size` and filled by the caller
        // with pointers that are valid for the call.
        let err = unsafe { f(args) };
        self.check(name, err)
    }

    /// Converts (and frees) an error returned by `name`.
    pub(crate) fn check(&self, name: &'static str, err: *mut sys::PJRT_Error) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let api = self.api();
        let mut msg = args::<sys::PJRT_Error_Message_Args>();
        msg.error = err;
        let mut message = String::from("(no message)");
        if let Some(f) = api.PJRT_Error_Message {
            // SAFETY: `err` is a live error returned by the plugin; the message it
            // returns is owned by the error and copied before the error is freed.
            unsafe {
                f(&mut msg);
                if !msg.message.is_null() {
                    message = lossy(msg.message, msg.message_size);
                }
            }
        }
        let mut code = args::<sys::PJRT_Error_GetCode_Args>();
        code.error = err;
        let mut code_str = "UNKNOWN";
        if let Some(f) = api.PJRT_Error_GetCode {
            // SAFETY: as above; GetCode returns no error of its own when given one.
            let e = unsafe { f(&mut code) };
            if e.is_null() {
                code_str = code_name(code.code);
            }
        }
        let mut destroy = args::<sys::PJRT_Error_Destroy_Args>();
        destroy.error = err;
        if let Some(f) = api.PJRT_Error_Destroy {
            // SAFETY: `err` is freed once, here, and not used afterwards.
            unsafe { f(&mut destroy) };
        }
        Err(PjrtError::Call {
            func: name,
            code: code_str,
            message,
        })
    }

    /// Waits for `event`, then frees it; an error the event carries is returned.
    pub(crate) fn await_event(
        &self,
        name: &'static str,
        event: *mut sys::PJRT_Event,
    ) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut wait = args::<sys::PJRT_Event_Await_Args>();
        wait.event = event;
        let waited = self.call(name, self.api().PJRT_Event_Await, &mut wait);
        let mut destroy = args::<sys::PJRT_Event_Destroy_Args>();
        destroy.event = event;
        let destroyed = self.call(
            "PJRT_Event_Destroy",
            self.api().PJRT_Event_Destroy,
            &mut destroy,
        );
        waited.and(destroyed)
    }
}

/// A `(pointer, length)` string from the plugin, copied.
///
/// # Safety
/// `ptr` points at `len` readable bytes (or is null).
pub(crate) unsafe fn lossy(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: per the function contract.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}
