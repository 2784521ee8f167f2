//! The HIP runtime, `libamdhip64`, opened with `dlopen` at run time: nothing links
//! against ROCm at build time, and on a machine without it every entry point returns
//! [`AmdError::NoRuntime`]. [`HipRuntime`] holds the functions kpt calls and turns their
//! `hipError_t` into [`AmdError::Hip`] (the result layer over [`crate::sys`]).

use std::ffi::{c_char, c_int, CStr};
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::sys::{self, HipError, PropsLayout};
use crate::AmdError;

/// Environment variable naming the HIP runtime library to load.
pub const LIBRARY_ENV: &str = "KPT_HIP_LIBRARY";

/// A HIP runtime version, as `hipRuntimeGetVersion` encodes it
/// (`major * 10_000_000 + minor * 100_000 + patch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HipVersion {
    /// Major version (ROCm 5, 6, 7).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch (a build number in ROCm 5, e.g. 21153).
    pub patch: u32,
}

impl HipVersion {
    /// Decodes `hipRuntimeGetVersion`'s integer; `None` for a negative value.
    pub fn from_encoded(v: i32) -> Option<HipVersion> {
        let v = u32::try_from(v).ok()?;
        Some(HipVersion {
            major: v / 10_000_000,
            minor: v / 100_000 % 100,
            patch: v % 100_000,
        })
    }
}

impl std::fmt::Display for HipVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The places kpt looks for the runtime, in order: `KPT_HIP_LIBRARY` if set (and then
/// only it), `$ROCM_PATH/lib`, `/opt/rocm/lib`, then the loader's search path by soname.
pub fn library_candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os(LIBRARY_ENV) {
        return vec![PathBuf::from(p)];
    }
    let mut out = Vec::new();
    if let Some(root) = std::env::var_os("ROCM_PATH") {
        out.push(PathBuf::from(root).join("lib/libamdhip64.so"));
    }
    out.push(PathBuf::from("/opt/rocm/lib/libamdhip64.so"));
    for name in [
        "libamdhip64.so",
        "libamdhip64.so.7",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
    ] {
        out.push(PathBuf::from(name));
    }
    out
}

/// The loaded HIP runtime and the functions kpt calls.
///
/// The library is never unloaded: the HIP runtime starts threads and keeps the device
/// state of the process, which do not survive `dlclose`.
pub struct HipRuntime {
    _lib: ManuallyDrop<libloading::Library>,
    path: PathBuf,
    version: Option<HipVersion>,
    init: sys::HipInit,
    get_device_count: sys::HipGetDeviceCount,
    device_get_name: sys::HipDeviceGetName,
    device_total_mem: sys::HipDeviceTotalMem,
    device_get_attribute: sys::HipDeviceGetAttribute,
    driver_get_version: sys::HipGetVersion,
    error_name: sys::HipErrorText,
    error_string: sys::HipErrorText,
    props: Option<(PropsLayout, sys::HipGetDeviceProperties)>,
    set_device: sys::HipSetDevice,
    malloc: sys::HipMalloc,
    free: sys::HipFree,
    mem_get_info: sys::HipMemGetInfo,
    stream_create: sys::HipStreamCreate,
    stream_synchronize: sys::HipHandleOp,
    stream_destroy: sys::HipHandleOp,
    memcpy_async: sys::HipMemcpyAsync,
    memcpy_2d_async: sys::HipMemcpy2DAsync,
    memset_async: sys::HipMemsetAsync,
    module_load_data: sys::HipModuleLoadData,
    module_get_function: sys::HipModuleGetFunction,
    module_unload: sys::HipHandleOp,
    module_launch_kernel: sys::HipModuleLaunchKernel,
}

/// A HIP stream, module or function handle (`hipStream_t`, `hipModule_t`,
/// `hipFunction_t`). A plain value: the owner of the object destroys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle(pub(crate) usize);

impl Handle {
    pub(crate) fn raw(self) -> sys::HipHandle {
        self.0 as sys::HipHandle
    }
}

impl std::fmt::Debug for HipRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipRuntime")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("props_layout", &self.props.map(|(l, _)| l))
            .finish()
    }
}

impl HipRuntime {
    /// The process's runtime, loaded on first use from [`library_candidates`]; the
    /// outcome (also a failure) is kept for the life of the process.
    pub fn global() -> Result<&'static HipRuntime, AmdError> {
        static RUNTIME: OnceLock<Result<HipRuntime, AmdError>> = OnceLock::new();
        RUNTIME
            .get_or_init(|| HipRuntime::load_first(&library_candidates()))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Whether a HIP runtime can be loaded on this machine.
    pub fn present() -> bool {
        HipRuntime::global().is_ok()
    }

    /// Loads the first of `candidates` that opens; [`AmdError::NoRuntime`] listing
    /// every attempt when none does.
    pub fn load_first(candidates: &[PathBuf]) -> Result<HipRuntime, AmdError> {
        let mut attempts = Vec::new();
        for path in candidates {
            // SAFETY: loading a library runs its initializers; libamdhip64 is built to
            // be loaded this way (PyTorch and the HIP Python bindings dlopen it).
            match unsafe { libloading::Library::new(path) } {
                Ok(lib) => return HipRuntime::from_library(lib, path.clone()),
                Err(e) => attempts.push(e.to_string()),
            }
        }
        Err(AmdError::NoRuntime {
            reason: if attempts.is_empty() {
                "no library to try".into()
            } else {
                attempts.join("; ")
            },
            env: LIBRARY_ENV,
        })
    }

    fn from_library(lib: libloading::Library, path: PathBuf) -> Result<HipRuntime, AmdError> {
        let library = path.display().to_string();
        let missing = |symbol: &'static str, e: libloading::Error| AmdError::MissingSymbol {
            library: library.clone(),
            symbol,
            reason: e.to_string(),
        };
        macro_rules! load {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol is a function of the HIP runtime whose C signature
                // is `$ty` (see `sys`, written from hip_runtime_api.h).
                let f = unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| missing($name, e))?;
                *f
            }};
        }
        let runtime_get_version = load!("hipRuntimeGetVersion", sys::HipGetVersion);
        let mut encoded: c_int = 0;
        // SAFETY: the pointer is to a local.
        let version = if unsafe { runtime_get_version(&mut encoded) } == sys::HIP_SUCCESS {
            HipVersion::from_encoded(encoded)
        } else {
            None
        };
        // SAFETY (both lookups): `HipGetDeviceProperties` is the signature of both
        // functions; each fills the layout it is paired with.
        let r0600 =
            unsafe { lib.get::<sys::HipGetDeviceProperties>(b"hipGetDevicePropertiesR0600\0") }
                .ok()
                .map(|f| (PropsLayout::R0600, *f));
        let props = r0600.or_else(|| {
            // Only a ROCm 5 runtime fills the R0000 struct through this name; a newer
            // one without the R0600 symbol is not a runtime kpt knows.
            let rocm5 = version.is_some_and(|v| v.major == 5);
            // SAFETY: as above.
            unsafe { lib.get::<sys::HipGetDeviceProperties>(b"hipGetDeviceProperties\0") }
                .ok()
                .filter(|_| rocm5)
                .map(|f| (PropsLayout::R0000, *f))
        });
        let runtime = HipRuntime {
            init: load!("hipInit", sys::HipInit),
            get_device_count: load!("hipGetDeviceCount", sys::HipGetDeviceCount),
            device_get_name: load!("hipDeviceGetName", sys::HipDeviceGetName),
            device_total_mem: load!("hipDeviceTotalMem", sys::HipDeviceTotalMem),
            device_get_attribute: load!("hipDeviceGetAttribute", sys::HipDeviceGetAttribute),
            driver_get_version: load!("hipDriverGetVersion", sys::HipGetVersion),
            error_name: load!("hipGetErrorName", sys::HipErrorText),
            error_string: load!("hipGetErrorString", sys::HipErrorText),
            props,
            set_device: load!("hipSetDevice", sys::HipSetDevice),
            malloc: load!("hipMalloc", sys::HipMalloc),
            free: load!("hipFree", sys::HipFree),
            mem_get_info: load!("hipMemGetInfo", sys::HipMemGetInfo),
            stream_create: load!("hipStreamCreate", sys::HipStreamCreate),
            stream_synchronize: load!("hipStreamSynchronize", sys::HipHandleOp),
            stream_destroy: load!("hipStreamDestroy", sys::HipHandleOp),
            memcpy_async: load!("hipMemcpyAsync", sys::HipMemcpyAsync),
            memcpy_2d_async: load!("hipMemcpy2DAsync", sys::HipMemcpy2DAsync),
            memset_async: load!("hipMemsetAsync", sys::HipMemsetAsync),
            module_load_data: load!("hipModuleLoadData", sys::HipModuleLoadData),
            module_get_function: load!("hipModuleGetFunction", sys::HipModuleGetFunction),
            module_unload: load!("hipModuleUnload", sys::HipHandleOp),
            module_launch_kernel: load!("hipModuleLaunchKernel", sys::HipModuleLaunchKernel),
            version,
            path,
            _lib: ManuallyDrop::new(lib),
        };
        tracing::debug!(
            path = %runtime.path.display(),
            version = ?runtime.version,
            props = ?runtime.props.map(|(l, _)| l),
            "loaded the HIP runtime"
        );
        Ok(runtime)
    }

    /// The loaded library (hiprtc's functions are in it up to ROCm 5).
    pub(crate) fn library(&self) -> &libloading::Library {
        &self._lib
    }

    /// The library that was loaded.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// `hipRuntimeGetVersion`, when the runtime reported one.
    pub fn version(&self) -> Option<HipVersion> {
        self.version
    }

    /// The `hipDeviceProp_t` layout this runtime fills, if kpt knows it.
    pub fn props_layout(&self) -> Option<PropsLayout> {
        self.props.map(|(l, _)| l)
    }

    fn text(&self, f: sys::HipErrorText, code: HipError) -> String {
        // SAFETY: both functions return a pointer to a static string (or null) for any
        // code.
        let p = unsafe { f(code) };
        if p.is_null() {
            return format!("hipError {code}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `hipSuccess`, else [`AmdError::Hip`] naming `call`.
    pub fn check(&self, call: &'static str, code: HipError) -> Result<(), AmdError> {
        if code == sys::HIP_SUCCESS {
            return Ok(());
        }
        Err(AmdError::Hip {
            call,
            code,
            name: self.text(self.error_name, code),
            message: self.text(self.error_string, code),
        })
    }

    /// `hipInit(0)`.
    pub fn init(&self) -> Result<(), AmdError> {
        // SAFETY: no pointer arguments.
        self.check("hipInit", unsafe { (self.init)(0) })
    }

    /// `hipGetDeviceCount`.
    pub fn device_count(&self) -> Result<usize, AmdError> {
        let mut n: c_int = 0;
        // SAFETY: the pointer is to a local.
        self.check("hipGetDeviceCount", unsafe {
            (self.get_device_count)(&mut n)
        })?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// `hipDriverGetVersion`.
    pub fn driver_version(&self) -> Result<i32, AmdError> {
        let mut v: c_int = 0;
        // SAFETY: the pointer is to a local.
        self.check("hipDriverGetVersion", unsafe {
            (self.driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// `hipDeviceGetName`.
    pub fn device_name(&self, device: i32) -> Result<String, AmdError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` bytes; HIP writes a NUL-terminated string of at
        // most `len` bytes.
        self.check("hipDeviceGetName", unsafe {
            (self.device_get_name)(buf.as_mut_ptr(), buf.len() as c_int - 1, device)
        })?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `hipDeviceTotalMem`.
    pub fn device_total_mem(&self, device: i32) -> Result<u64, AmdError> {
        let mut bytes = 0usize;
        // SAFETY: the pointer is to a local.
        self.check("hipDeviceTotalMem", unsafe {
            (self.device_total_mem)(&mut bytes, device)
        })?;
        Ok(bytes as u64)
    }

    /// `hipDeviceGetAttribute` for one of [`sys::attr`].
    pub fn attribute(&self, device: i32, attr: c_int) -> Result<i32, AmdError> {
        let mut v: c_int = 0;
        // SAFETY: the pointer is to a local; an unknown attribute is an error code.
        self.check("hipDeviceGetAttribute", unsafe {
            (self.device_get_attribute)(&mut v, attr, device)
        })?;
        Ok(v)
    }

    /// `hipSetDevice`: the device later calls of this thread use.
    pub fn set_device(&self, device: i32) -> Result<(), AmdError> {
        // SAFETY: no pointer arguments.
        self.check("hipSetDevice", unsafe { (self.set_device)(device) })
    }

    /// `hipMalloc` of `bytes` on the current device: `None` when the device is out of
    /// memory (`hipErrorOutOfMemory`).
    pub fn malloc(&self, bytes: usize) -> Result<Option<u64>, AmdError> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: the pointer is to a local.
        match unsafe { (self.malloc)(&mut ptr, bytes) } {
            sys::HIP_ERROR_OUT_OF_MEMORY => Ok(None),
            code => self.check("hipMalloc", code).map(|()| Some(ptr as u64)),
        }
    }

    /// `hipFree`.
    ///
    /// # Safety
    /// `ptr` came from [`HipRuntime::malloc`] and no queued work uses it any more.
    pub unsafe fn free(&self, ptr: u64) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipFree", unsafe { (self.free)(ptr as *mut _) })
    }

    /// `hipMemGetInfo`: `(free, total)` bytes of the current device.
    pub fn mem_get_info(&self) -> Result<(u64, u64), AmdError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the pointers are to locals.
        self.check("hipMemGetInfo", unsafe {
            (self.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// `hipStreamCreate` on the current device.
    pub fn stream_create(&self) -> Result<Handle, AmdError> {
        let mut stream = std::ptr::null_mut();
        // SAFETY: the pointer is to a local.
        self.check("hipStreamCreate", unsafe {
            (self.stream_create)(&mut stream)
        })?;
        Ok(Handle(stream as usize))
    }

    /// `hipStreamSynchronize`.
    pub fn stream_synchronize(&self, stream: Handle) -> Result<(), AmdError> {
        // SAFETY: a stream handle (an invalid one is an error code, not undefined).
        self.check("hipStreamSynchronize", unsafe {
            (self.stream_synchronize)(stream.raw())
        })
    }

    /// `hipStreamDestroy`.
    ///
    /// # Safety
    /// `stream` came from [`HipRuntime::stream_create`] and is not used afterwards.
    pub unsafe fn stream_destroy(&self, stream: Handle) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipStreamDestroy", unsafe {
            (self.stream_destroy)(stream.raw())
        })
    }

    /// `hipMemcpyAsync` of `src` to device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` is a device allocation of at least `src.len()` bytes, and `src` stays
    /// alive and unchanged until `stream` has run the copy.
    pub unsafe fn copy_to_device(
        &self,
        dst: u64,
        src: &[u8],
        stream: Handle,
    ) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipMemcpyAsync", unsafe {
            (self.memcpy_async)(
                dst as *mut _,
                src.as_ptr().cast(),
                src.len(),
                sys::HIP_MEMCPY_HOST_TO_DEVICE,
                stream.raw(),
            )
        })
    }

    /// `hipMemcpyAsync` of device address `src` to `dst` on `stream`, then
    /// `hipStreamSynchronize`: `dst` holds the bytes when this returns.
    ///
    /// # Safety
    /// `src` is a device allocation of at least `dst.len()` bytes.
    pub unsafe fn copy_to_host(
        &self,
        dst: &mut [u8],
        src: u64,
        stream: Handle,
    ) -> Result<(), AmdError> {
        // SAFETY: the caller's contract; `dst` is borrowed until the stream drained.
        self.check("hipMemcpyAsync", unsafe {
            (self.memcpy_async)(
                dst.as_mut_ptr().cast(),
                src as *const _,
                dst.len(),
                sys::HIP_MEMCPY_DEVICE_TO_HOST,
                stream.raw(),
            )
        })?;
        self.stream_synchronize(stream)
    }

    /// `hipMemcpyAsync` of `bytes` from device address `src` to device address `dst`,
    /// queued on `stream`.
    ///
    /// # Safety
    /// Both are device allocations holding at least `bytes` from the given addresses,
    /// alive until `stream` has run the copy.
    pub unsafe fn copy_on_device(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: Handle,
    ) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipMemcpyAsync", unsafe {
            (self.memcpy_async)(
                dst as *mut _,
                src as *const _,
                bytes,
                sys::HIP_MEMCPY_DEVICE_TO_DEVICE,
                stream.raw(),
            )
        })
    }

    /// `hipMemcpy2DAsync` on the device: `height` rows of `width` bytes from rows
    /// `src_pitch` apart to rows `dst_pitch` apart, queued on `stream`.
    ///
    /// # Safety
    /// Both regions lie inside device allocations alive until `stream` has run the copy.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_2d_on_device(
        &self,
        (dst, dst_pitch): (u64, usize),
        (src, src_pitch): (u64, usize),
        width: usize,
        height: usize,
        stream: Handle,
    ) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipMemcpy2DAsync", unsafe {
            (self.memcpy_2d_async)(
                dst as *mut _,
                dst_pitch,
                src as *const _,
                src_pitch,
                width,
                height,
                sys::HIP_MEMCPY_DEVICE_TO_DEVICE,
                stream.raw(),
            )
        })
    }

    /// `hipMemsetAsync`: `bytes` bytes at device address `dst` set to `value`, queued
    /// on `stream`.
    ///
    /// # Safety
    /// `dst` is a device allocation of at least `bytes` bytes, alive until `stream` has
    /// run the fill.
    pub unsafe fn memset(
        &self,
        dst: u64,
        value: u8,
        bytes: usize,
        stream: Handle,
    ) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipMemsetAsync", unsafe {
            (self.memset_async)(dst as *mut _, c_int::from(value), bytes, stream.raw())
        })
    }

    /// `hipModuleLoadData`: a code object loaded on the current device.
    pub fn module_load(&self, image: &[u8]) -> Result<Handle, AmdError> {
        if !image.starts_with(b"\x7fELF") {
            return Err(AmdError::CodeObject(
                "hipModuleLoadData takes an ELF code object".into(),
            ));
        }
        let mut module = std::ptr::null_mut();
        // SAFETY: `image` is a whole ELF file in host memory, read during the call.
        self.check("hipModuleLoadData", unsafe {
            (self.module_load_data)(&mut module, image.as_ptr().cast())
        })?;
        Ok(Handle(module as usize))
    }

    /// `hipModuleGetFunction`.
    pub fn module_function(&self, module: Handle, name: &str) -> Result<Handle, AmdError> {
        let name = std::ffi::CString::new(name)
            .map_err(|_| AmdError::CodeObject(format!("kernel name {name:?} has a NUL")))?;
        let mut function = std::ptr::null_mut();
        // SAFETY: the pointers are to a local and to a NUL-terminated string.
        self.check("hipModuleGetFunction", unsafe {
            (self.module_get_function)(&mut function, module.raw(), name.as_ptr())
        })?;
        Ok(Handle(function as usize))
    }

    /// `hipModuleUnload`.
    ///
    /// # Safety
    /// `module` came from [`HipRuntime::module_load`], and no launch of its functions is
    /// queued or follows.
    pub unsafe fn module_unload(&self, module: Handle) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipModuleUnload", unsafe {
            (self.module_unload)(module.raw())
        })
    }

    /// `hipModuleLaunchKernel` of `function` on `stream` with `params` (one pointer per
    /// kernel argument, to the argument's value).
    ///
    /// # Safety
    /// `params` match the kernel's parameters in number, order and type, every device
    /// address among them is valid for what the kernel does with it, and the pointed-to
    /// values live until the call returns.
    pub unsafe fn launch(
        &self,
        function: Handle,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        stream: Handle,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), AmdError> {
        // SAFETY: the caller's contract.
        self.check("hipModuleLaunchKernel", unsafe {
            (self.module_launch_kernel)(
                function.raw(),
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared_bytes,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// The device's `gcnArchName` (e.g. `gfx942:sramecc+:xnack-`) from
    /// `hipGetDeviceProperties*`, after checking that the struct has the layout kpt
    /// reads it with (its `name` and `totalGlobalMem` agree with `hipDeviceGetName` and
    /// `hipDeviceTotalMem`).
    pub fn gcn_arch_name(&self, device: i32) -> Result<String, AmdError> {
        let runtime = self
            .version
            .map_or_else(|| "of unknown version".to_string(), |v| v.to_string());
        let Some((layout, get)) = self.props else {
            return Err(AmdError::PropertiesLayout {
                runtime,
                layout: "R0600",
                detail: "the runtime exports neither hipGetDevicePropertiesR0600 nor \
                         (ROCm 5) hipGetDeviceProperties"
                    .into(),
            });
        };
        let mut buf = vec![0u8; sys::PROPS_BUFFER];
        // SAFETY: `buf` is larger than either layout of the struct (`PROPS_BUFFER`), and
        // `get` is the function that fills `layout`.
        self.check(layout.symbol(), unsafe {
            get(buf.as_mut_ptr().cast(), device)
        })?;
        let name = self.device_name(device)?;
        let total = self.device_total_mem(device)?;
        let struct_name = sys::c_string_at(&buf, 0, 256);
        let struct_total = sys::usize_at(&buf, layout.total_global_mem_offset()).unwrap_or(0);
        if struct_name != name || struct_total as u64 != total {
            return Err(AmdError::PropertiesLayout {
                runtime,
                layout: layout.name(),
                detail: format!(
                    "name {struct_name:?} and totalGlobalMem {struct_total} in the struct, \
                     {name:?} and {total} from hipDeviceGetName / hipDeviceTotalMem"
                ),
            });
        }
        Ok(sys::c_string_at(&buf, layout.gcn_arch_name_offset(), 256))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_as_hip_encodes_them() {
        // HIP_VERSION of ROCm 5.2.3 (Debian 12): 5 * 10^7 + 2 * 10^5 + 21153.
        let v = HipVersion::from_encoded(50_221_153).unwrap();
        assert_eq!((v.major, v.minor, v.patch), (5, 2, 21153));
        assert_eq!(v.to_string(), "5.2.21153");
        let v = HipVersion::from_encoded(60_443_483).unwrap();
        assert_eq!((v.major, v.minor, v.patch), (6, 4, 43483));
        assert!(HipVersion::from_encoded(-1).is_none());
    }

    #[test]
    fn a_missing_library_is_no_runtime_not_a_panic() {
        let err =
            HipRuntime::load_first(&[PathBuf::from("/nonexistent/libamdhip64.so")]).unwrap_err();
        match &err {
            AmdError::NoRuntime { reason, env } => {
                assert!(reason.contains("/nonexistent/libamdhip64.so"), "{reason}");
                assert_eq!(*env, LIBRARY_ENV);
            }
            other => panic!("expected NoRuntime, got {other:?}"),
        }
        assert!(err.to_string().starts_with("no ROCm runtime found ("));
        assert!(matches!(
            HipRuntime::load_first(&[]),
            Err(AmdError::NoRuntime { .. })
        ));
    }

    #[test]
    fn a_library_without_hip_lacks_its_symbols() {
        // libc opens everywhere kpt builds, and has no HIP functions.
        let err = HipRuntime::load_first(&[PathBuf::from("libc.so.6")]).unwrap_err();
        assert!(
            matches!(
                err,
                AmdError::MissingSymbol {
                    symbol: "hipRuntimeGetVersion",
                    ..
                }
            ),
            "{err:?}"
        );
    }
}
