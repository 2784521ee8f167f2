//! Run-time compilation with hiprtc, and [`CompileCache`], the ROCm compile cache: code
//! objects of kpt's HIP kernels for a processor no shipped code object was built for
//! (an MI300X, gfx942, on a machine whose ROCm knows it), compiled once per source,
//! options and compiler, kept in memory and optionally in a directory.
//!
//! The sources are `kernels/hip/*.hip` as single translation units (`build.rs` inlines
//! their includes; hiprtc has no include path). hiprtc lives in `libamdhip64` up to ROCm
//! 5 and in `libhiprtc` from ROCm 6.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use sha2::Digest;

use crate::hsaco::CodeObject;
use crate::runtime::HipRuntime;
use crate::AmdError;

include!(concat!(env!("OUT_DIR"), "/rtc_sources.rs"));

/// The kernels hiprtc can compile: `kernels/hip/*.hip` stems.
pub fn rtc_kernels() -> Vec<&'static str> {
    SOURCES.iter().map(|(k, _)| *k).collect()
}

/// The translation unit of `kernel` (`rms_norm`, ...).
pub fn rtc_source(kernel: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(k, _)| *k == kernel).map(|(_, s)| *s)
}

type Program = *mut std::ffi::c_void;
type CreateProgram = unsafe extern "C" fn(
    prog: *mut Program,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> c_int;
type CompileProgram =
    unsafe extern "C" fn(prog: Program, num_options: c_int, options: *const *const c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(prog: *mut Program) -> c_int;
type GetSize = unsafe extern "C" fn(prog: Program, size: *mut usize) -> c_int;
type GetBytes = unsafe extern "C" fn(prog: Program, out: *mut c_char) -> c_int;
type ErrorString = unsafe extern "C" fn(result: c_int) -> *const c_char;

/// hiprtc's functions.
pub struct Hiprtc {
    _lib: Option<ManuallyDrop<libloading::Library>>,
    origin: String,
    compiler: String,
    version: Option<crate::runtime::HipVersion>,
    create: CreateProgram,
    compile: CompileProgram,
    destroy: DestroyProgram,
    code_size: GetSize,
    code: GetBytes,
    log_size: GetSize,
    log: GetBytes,
    error_string: ErrorString,
}

impl std::fmt::Debug for Hiprtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hiprtc")
            .field("origin", &self.origin)
            .field("compiler", &self.compiler)
            .finish()
    }
}

macro_rules! symbols {
    ($lib:expr, $origin:expr) => {{
        let lib: &libloading::Library = $lib;
        let missing = |symbol: &'static str, e: libloading::Error| AmdError::MissingSymbol {
            library: $origin.to_string(),
            symbol,
            reason: e.to_string(),
        };
        macro_rules! load {
            ($name:literal, $ty:ty) => {{
                // SAFETY: a hiprtc function whose C signature is `$ty` (hiprtc.h).
                let f = unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| missing($name, e))?;
                *f
            }};
        }
        (
            load!("hiprtcCreateProgram", CreateProgram),
            load!("hiprtcCompileProgram", CompileProgram),
            load!("hiprtcDestroyProgram", DestroyProgram),
            load!("hiprtcGetCodeSize", GetSize),
            load!("hiprtcGetCode", GetBytes),
            load!("hiprtcGetProgramLogSize", GetSize),
            load!("hiprtcGetProgramLog", GetBytes),
            load!("hiprtcGetErrorString", ErrorString),
        )
    }};
}

impl Hiprtc {
    /// The process's hiprtc, found on first use next to the HIP runtime.
    pub fn global() -> Result<&'static Hiprtc, AmdError> {
        static RTC: OnceLock<Result<Hiprtc, AmdError>> = OnceLock::new();
        RTC.get_or_init(|| HipRuntime::global().and_then(Hiprtc::load))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// hiprtc of `runtime`: its own library's functions (ROCm 5), else `libhiprtc` next
    /// to it or on the loader's path (ROCm 6 and later).
    pub fn load(runtime: &HipRuntime) -> Result<Hiprtc, AmdError> {
        let compiler = runtime.version().map_or_else(
            || "hiprtc of an unknown HIP".into(),
            |v| format!("hiprtc {v}"),
        );
        if let Ok(f) = Self::from_library(runtime.library(), &runtime.path().display().to_string())
        {
            return Ok(Hiprtc {
                _lib: None,
                origin: runtime.path().display().to_string(),
                compiler,
                version: runtime.version(),
                ..f
            });
        }
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(dir) = runtime
            .path()
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            candidates.push(dir.join("libhiprtc.so"));
        }
        for name in ["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6"] {
            candidates.push(PathBuf::from(name));
        }
        let mut attempts = Vec::new();
        for path in candidates {
            // SAFETY: loading ROCm's hiprtc library runs its initializers, as for any user.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => {
                    let f = Self::from_library(&lib, &path.display().to_string())?;
                    return Ok(Hiprtc {
                        _lib: Some(ManuallyDrop::new(lib)),
                        origin: path.display().to_string(),
                        compiler,
                        version: runtime.version(),
                        ..f
                    });
                }
                Err(e) => attempts.push(e.to_string()),
            }
        }
        Err(AmdError::NoRuntime {
            reason: format!("no hiprtc: {}", attempts.join("; ")),
            env: crate::runtime::LIBRARY_ENV,
        })
    }

    fn from_library(lib: &libloading::Library, origin: &str) -> Result<Hiprtc, AmdError> {
        let (create, compile, destroy, code_size, code, log_size, log, error_string) =
            symbols!(lib, origin);
        Ok(Hiprtc {
            _lib: None,
            origin: origin.to_string(),
            compiler: String::new(),
            version: None,
            create,
            compile,
            destroy,
            code_size,
            code,
            log_size,
            log,
            error_string,
        })
    }

    /// The HIP version of the runtime hiprtc came with.
    pub fn version(&self) -> Option<crate::runtime::HipVersion> {
        self.version
    }

    /// What compiles: `hiprtc` and the HIP version (part of the cache key).
    pub fn compiler(&self) -> &str {
        &self.compiler
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<(), AmdError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: returns a static string for any code (or null).
        let p = unsafe { (self.error_string)(code) };
        let message = if p.is_null() {
            format!("hiprtc error {code}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(AmdError::Hip {
            call,
            code,
            name: message.clone(),
            message,
        })
    }

    /// Compiles `source` (named `name` in messages) with `options` into a code object;
    /// [`AmdError::Compile`] with the compiler's log when it does not compile.
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<Vec<u8>, AmdError> {
        let bad = |what: &str| AmdError::Invalid(format!("{what} holds a NUL byte"));
        let c_source = CString::new(source).map_err(|_| bad("the source"))?;
        let c_name = CString::new(name).map_err(|_| bad("the name"))?;
        let c_options = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| bad("an option")))
            .collect::<Result<Vec<_>, _>>()?;
        let option_ptrs: Vec<*const c_char> = c_options.iter().map(|o| o.as_ptr()).collect();
        // One compile at a time in the process: ROCm 5.2's hiprtc (through comgr) crashed
        // with SIGSEGV here when two threads compiled at once.
        static COMPILING: Mutex<()> = Mutex::new(());
        let _one = COMPILING.lock().unwrap_or_else(|p| p.into_inner());
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: the strings are NUL-terminated and outlive the call; no headers.
        self.check("hiprtcCreateProgram", unsafe {
            (self.create)(
                &mut prog,
                c_source.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        let result = self.compile_created(prog, name, options, &option_ptrs);
        // SAFETY: `prog` came from `hiprtcCreateProgram` and is not used afterwards.
        let destroyed = unsafe { (self.destroy)(&mut prog) };
        let code = result?;
        self.check("hiprtcDestroyProgram", destroyed)?;
        Ok(code)
    }

    fn compile_created(
        &self,
        prog: Program,
        name: &str,
        options: &[String],
        option_ptrs: &[*const c_char],
    ) -> Result<Vec<u8>, AmdError> {
        let read =
            |size: GetSize, get: GetBytes, what: &'static str| -> Result<Vec<u8>, AmdError> {
                let mut n = 0usize;
                // SAFETY: `prog` is a live program; the pointer is to a local.
                self.check(what, unsafe { size(prog, &mut n) })?;
                let mut buf = vec![0u8; n];
                if n > 0 {
                    // SAFETY: `buf` holds the `n` bytes hiprtc said it would write.
                    self.check(what, unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
                }
                Ok(buf)
            };
        // SAFETY: `prog` is live; `option_ptrs` point at NUL-terminated strings the
        // caller keeps alive.
        let compiled =
            unsafe { (self.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
        if compiled != 0 {
            let log = read(self.log_size, self.log, "hiprtcGetProgramLog")?;
            let log = String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .trim()
                .to_string();
            return Err(AmdError::Compile {
                kernel: name.to_string(),
                options: options.join(" "),
                log,
            });
        }
        read(self.code_size, self.code, "hiprtcGetCode")
    }
}

/// The first ROCm release whose compiler builds code for `processor`, as kpt knows it;
/// `None` for a processor not in kpt's table. hiprtc must not be asked for a processor it
/// does not know: ROCm 5.2's aborts the whole process (seen on Debian 12's
/// libamdhip64 5.2.3 asked for gfx942) instead of returning an error.
pub fn first_rocm_for(processor: &str) -> Option<(u32, u32)> {
    Some(match processor {
        "gfx900" | "gfx906" | "gfx908" | "gfx1010" | "gfx1011" | "gfx1012" | "gfx1030" => (4, 0),
        "gfx90a" => (4, 5),
        "gfx940" | "gfx941" => (5, 2),
        "gfx1100" | "gfx1101" | "gfx1102" => (5, 5),
        "gfx942" => (6, 0),
        "gfx1200" | "gfx1201" => (6, 4),
        "gfx950" => (7, 0),
        _ => return None,
    })
}

/// Hits and misses of a [`CompileCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Served from memory.
    pub hits: u64,
    /// Read from the cache directory.
    pub disk_hits: u64,
    /// Compiled.
    pub misses: u64,
}

/// The ROCm compile cache: code objects compiled by hiprtc, keyed by the SHA-256 of
/// source, options and compiler, in memory and, with a directory, on disk (one
/// `KEY.hsaco` file each, written atomically; a file that does not parse as a code
/// object for the processor is compiled again).
#[derive(Debug, Default)]
pub struct CompileCache {
    dir: Option<PathBuf>,
    entries: Mutex<HashMap<String, Arc<Vec<u8>>>>,
    stats: Mutex<CacheStats>,
}

/// Environment variable naming the cache directory of [`CompileCache::from_env`].
pub const CACHE_DIR_ENV: &str = "KPT_ROCM_CACHE_DIR";

impl CompileCache {
    /// A cache in memory, and in `dir` when given.
    pub fn new(dir: Option<PathBuf>) -> CompileCache {
        CompileCache {
            dir,
            ..CompileCache::default()
        }
    }

    /// A cache whose directory is `KPT_ROCM_CACHE_DIR`, if set.
    pub fn from_env() -> CompileCache {
        CompileCache::new(std::env::var_os(CACHE_DIR_ENV).map(PathBuf::from))
    }

    /// The hiprtc options kpt compiles with for `processor`: those of
    /// `cargo xtask build-kernels`' hipcc builds.
    pub fn options(processor: &str) -> Vec<String> {
        vec![
            format!("--offload-arch={processor}"),
            "-O3".into(),
            "-std=c++17".into(),
        ]
    }

    /// The key of `kernel` for `processor` with `compiler`.
    pub fn key(kernel_source: &str, processor: &str, compiler: &str) -> String {
        let mut h = sha2::Sha256::new();
        h.update(kernel_source.as_bytes());
        h.update([0]);
        h.update(Self::options(processor).join(" ").as_bytes());
        h.update([0]);
        h.update(compiler.as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The code object of `kernel` (a `kernels/hip` stem) for `processor`, compiled by
    /// `rtc` on a miss.
    pub fn code_object(
        &self,
        rtc: &Hiprtc,
        kernel: &str,
        processor: &str,
    ) -> Result<Arc<Vec<u8>>, AmdError> {
        let source = rtc_source(kernel).ok_or_else(|| {
            AmdError::Invalid(format!(
                "no HIP source for kernel {kernel} (have: {})",
                rtc_kernels().join(", ")
            ))
        })?;
        self.code_object_of_source(rtc, kernel, source, processor)
    }

    /// The code object of `source` (one translation unit, named `kernel` in messages)
    /// for `processor`, compiled by `rtc` on a miss; cached like [`CompileCache::code_object`].
    pub fn code_object_of_source(
        &self,
        rtc: &Hiprtc,
        kernel: &str,
        source: &str,
        processor: &str,
    ) -> Result<Arc<Vec<u8>>, AmdError> {
        let key = Self::key(source, processor, rtc.compiler());
        if let Some(code) = self.lock_entries().get(&key) {
            self.bump(|s| s.hits += 1);
            return Ok(Arc::clone(code));
        }
        let file = self.dir.as_ref().map(|d| d.join(format!("{key}.hsaco")));
        if let Some(code) = file.as_deref().and_then(|f| Self::read_valid(f, processor)) {
            self.bump(|s| s.disk_hits += 1);
            return Ok(self.keep(key, code));
        }
        let needs = first_rocm_for(processor);
        let has = rtc.version.map(|v| (v.major, v.minor));
        if needs.is_none() || has.is_none() || has < needs {
            return Err(AmdError::Unsupported {
                processor: processor.to_string(),
                compiler: rtc.compiler().to_string(),
                needs: needs.map_or_else(
                    || "a ROCm kpt knows to build it".into(),
                    |(major, minor)| format!("ROCm {major}.{minor} or later"),
                ),
            });
        }
        tracing::info!(
            kernel,
            processor,
            compiler = rtc.compiler(),
            "compiling with hiprtc"
        );
        let code = rtc.compile(source, &format!("{kernel}.hip"), &Self::options(processor))?;
        let parsed = CodeObject::parse(&code)?;
        if parsed.processor != processor {
            return Err(AmdError::CodeObject(format!(
                "hiprtc built {kernel} for {}, not {processor}",
                parsed.processor
            )));
        }
        self.bump(|s| s.misses += 1);
        if let Some(file) = &file {
            if let Err(e) = Self::write_atomically(file, &code) {
                tracing::warn!(file = %file.display(), error = %e, "could not write the ROCm compile cache");
            }
        }
        Ok(self.keep(key, code))
    }

    /// The statistics so far.
    pub fn stats(&self) -> CacheStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Vec<u8>>>> {
        // Every update is one insert: a poisoned map is still consistent.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self, f: impl FnOnce(&mut CacheStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn keep(&self, key: String, code: Vec<u8>) -> Arc<Vec<u8>> {
        let code = Arc::new(code);
        self.lock_entries().insert(key, Arc::clone(&code));
        code
    }

    fn read_valid(file: &Path, processor: &str) -> Option<Vec<u8>> {
        let code = std::fs::read(file).ok()?;
        match CodeObject::parse(&code) {
            Ok(c) if c.processor == processor => Some(code),
            _ => {
                tracing::warn!(file = %file.display(), "ignoring an invalid cached code object");
                None
            }
        }
    }

    fn write_atomically(file: &Path, code: &[u8]) -> std::io::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, code)?;
        std::fs::rename(&tmp, file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_single_translation_units() {
        let kernels = rtc_kernels();
        assert!(
            kernels.contains(&"rms_norm") && kernels.contains(&"quantize"),
            "{kernels:?}"
        );
        for k in kernels {
            let src = rtc_source(k).unwrap();
            assert!(!src.contains("#include \""), "{k}: a local include is left");
            assert!(
                !src.contains("#include <cuda_"),
                "{k}: a CUDA header is left"
            );
            assert!(src.contains("struct __nv_bfloat16"), "{k}: no dialect");
            assert!(src.contains("// kpt:launch"), "{k}: no CUDA source");
        }
        assert!(rtc_source("flash_attention_sm90").is_none());
    }

    #[test]
    fn processors_map_to_the_rocm_that_first_builds_them() {
        assert_eq!(first_rocm_for("gfx942"), Some((6, 0)));
        assert_eq!(first_rocm_for("gfx90a"), Some((4, 5)));
        assert!(first_rocm_for("gfx1100") > first_rocm_for("gfx1030"));
        assert_eq!(first_rocm_for("gfx803"), None);
    }

    #[test]
    fn keys_change_with_source_processor_and_compiler() {
        let a = CompileCache::key("x", "gfx942", "hiprtc 6.4.0");
        assert_eq!(a.len(), 64);
        assert_eq!(a, CompileCache::key("x", "gfx942", "hiprtc 6.4.0"));
        assert_ne!(a, CompileCache::key("y", "gfx942", "hiprtc 6.4.0"));
        assert_ne!(a, CompileCache::key("x", "gfx90a", "hiprtc 6.4.0"));
        assert_ne!(a, CompileCache::key("x", "gfx942", "hiprtc 7.0.0"));
    }
}
