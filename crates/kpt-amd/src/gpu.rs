//! [`AmdGpu`]: one ROCm device in use: its properties, the one stream all its work goes
//! to, the shared caching allocator over it, copies, and the kernels' code objects loaded
//! from `kpt_kernels::artifacts` for its processor, or compiled by hiprtc for it when none
//! was shipped (checked by [`CodeObject`] first).
//!
//! Written against the HIP runtime API; no AMD GPU was available, so on the machines kpt
//! is tested on, opening a device returns [`AmdError::NoRuntime`] or
//! [`AmdError::NoDevice`].

use std::collections::HashMap;
use std::sync::Mutex;

use kpt_core::memory::MemoryStatistics;
use kpt_kernels::artifacts::{self, EntryPoint, Format};

use crate::device::{devices_of, AmdDevice};
use crate::fp8;
use crate::hsaco::CodeObject;
use crate::kernels::Launch;
use crate::memory::{CachingAllocator, DeviceBlock, HipMemory};
use crate::rtc::{CompileCache, Hiprtc};
use crate::runtime::{Handle, HipRuntime};
use crate::AmdError;

/// A loaded code object.
#[derive(Clone)]
struct Module {
    entries: &'static [EntryPoint],
    module: Handle,
    args: HashMap<String, Vec<(u32, u32)>>,
}

/// A kernel function ready to launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// The `hipFunction_t`.
    pub handle: Handle,
    /// Threads per block (the manifest's launch block).
    pub block: u32,
    /// Dynamic LDS bytes.
    pub shared_bytes: u32,
    /// `(offset, size)` of each explicit argument, from the code object's metadata.
    pub args: Vec<(u32, u32)>,
}

/// One ROCm device in use.
pub struct AmdGpu {
    runtime: &'static HipRuntime,
    device: AmdDevice,
    stream: Handle,
    memory: CachingAllocator,
    /// Loaded code objects by kernel name: its entry points, its module, and each
    /// kernel's explicit arguments `(offset, size)` from its metadata.
    modules: Mutex<HashMap<String, Module>>,
    /// Code objects compiled at run time for a processor nothing was shipped for.
    cache: CompileCache,
}

impl std::fmt::Debug for AmdGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmdGpu")
            .field("device", &self.device.properties.name)
            .field("arch", &self.device.arch.to_string())
            .field("memory", &self.memory)
            .finish()
    }
}

impl AmdGpu {
    /// Opens device `index` of the process's HIP runtime: [`AmdError::NoRuntime`]
    /// without one, [`AmdError::NoDevice`] when it has no such device.
    pub fn new(index: usize) -> Result<AmdGpu, AmdError> {
        let runtime = HipRuntime::global()?;
        let found = devices_of(runtime)?;
        let count = found.len();
        let device = found.into_iter().nth(index).ok_or(AmdError::NoDevice {
            index,
            found: count,
        })?;
        let ordinal = i32::try_from(index).map_err(|_| AmdError::NoDevice { index, found: 0 })?;
        runtime.set_device(ordinal)?;
        let stream = runtime.stream_create()?;
        let memory = CachingAllocator::new(Box::new(HipMemory {
            runtime,
            device: ordinal,
            stream,
        }));
        tracing::info!(index, name = %device.properties.name, arch = %device.arch, "opened ROCm device");
        Ok(AmdGpu {
            runtime,
            device,
            stream,
            memory,
            modules: Mutex::new(HashMap::new()),
            cache: CompileCache::from_env(),
        })
    }

    /// The device's properties and architecture.
    pub fn device(&self) -> &AmdDevice {
        &self.device
    }

    /// A block of at least `bytes` of device memory (contents undefined).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBlock, AmdError> {
        self.memory.allocate(bytes)
    }

    /// A block holding `bytes`.
    pub fn upload(&self, bytes: &[u8]) -> Result<DeviceBlock, AmdError> {
        let block = self.alloc(bytes.len())?;
        if bytes.is_empty() {
            return Ok(block);
        }
        // SAFETY: the block holds `bytes.len()` bytes; the copy is waited for below, so
        // `bytes` outlives it.
        unsafe {
            self.runtime
                .copy_to_device(block.ptr(), bytes, self.stream)?
        };
        self.runtime.stream_synchronize(self.stream)?;
        Ok(block)
    }

    /// The first `out.len()` bytes of `block`, after the work queued before.
    pub fn download(&self, block: &DeviceBlock, out: &mut [u8]) -> Result<(), AmdError> {
        if out.len() > block.bytes() {
            return Err(AmdError::Invalid(format!(
                "reading {} bytes from a block of {}",
                out.len(),
                block.bytes()
            )));
        }
        if out.is_empty() {
            return self.runtime.stream_synchronize(self.stream);
        }
        // SAFETY: the block holds at least `out.len()` bytes (checked above).
        unsafe { self.runtime.copy_to_host(out, block.ptr(), self.stream) }
    }

    /// The allocator's statistics.
    pub fn memory_statistics(&self) -> MemoryStatistics {
        self.memory.statistics()
    }

    /// Fails with [`AmdError::OutOfMemory`] unless `bytes` more can be allocated now.
    pub fn check_memory_available(&self, bytes: usize) -> Result<(), AmdError> {
        self.memory.check_memory_available(bytes)
    }

    /// The function `entry` of `kernel`'s code object for this device's processor, with
    /// its launch block and dynamic LDS bytes: the shipped one built for the processor,
    /// else one hiprtc compiles from `kernels/hip` (through the compile cache; a
    /// processor the installed ROCm cannot build for is [`AmdError::Unsupported`]).
    /// Either is loaded after [`CodeObject::check`] accepts it.
    pub fn function(&self, kernel: &str, entry: &str) -> Result<(Handle, u32, u32), AmdError> {
        let f = self.kernel_function(kernel, entry)?;
        Ok((f.handle, f.block, f.shared_bytes))
    }

    /// [`AmdGpu::function`] with the entry point's argument layout from the code
    /// object's metadata.
    pub fn kernel_function(&self, kernel: &str, entry: &str) -> Result<Function, AmdError> {
        let processor = self.device.arch.processor();
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let loaded = match modules.get(kernel) {
            Some(loaded) => loaded.clone(),
            None => {
                let shipped = artifacts::hsaco_candidates(kernel, processor)
                    .into_iter()
                    .next();
                let (entries, compiled);
                let bytes: &[u8] = match shipped {
                    Some(a) => {
                        entries = a.entry_points;
                        a.bytes
                    }
                    // kpt-amd's own run-time kernel (FP8 OCP -> FNUZ), never shipped.
                    None if kernel == fp8::KERNEL => {
                        entries = &fp8::ENTRY_POINTS;
                        compiled = self.cache.code_object_of_source(
                            Hiprtc::global()?,
                            kernel,
                            fp8::SOURCE,
                            processor,
                        )?;
                        &compiled
                    }
                    None => {
                        entries = artifacts::embedded()
                            .iter()
                            .find(|a| {
                                a.kernel == kernel
                                    && a.format == Format::Hsaco
                                    && a.source.starts_with("kernels/hip/")
                            })
                            .map(|a| a.entry_points)
                            .ok_or_else(|| {
                                AmdError::CodeObject(format!(
                                    "no HIP build of {kernel} (built: {})",
                                    artifacts::hsaco_targets(kernel).join(", ")
                                ))
                            })?;
                        compiled = self
                            .cache
                            .code_object(Hiprtc::global()?, kernel, processor)?;
                        &compiled
                    }
                };
                let launch: Vec<(&str, u32, u32)> = entries
                    .iter()
                    .map(|e| (e.name, e.block, e.shared_bytes))
                    .collect();
                let tuning = self.device.tuning();
                let object = CodeObject::parse(bytes)?;
                object.check(processor, tuning.wave_size, tuning.lds_bytes, &launch)?;
                self.runtime.set_device(self.ordinal())?;
                let module = self.runtime.module_load(bytes)?;
                let args = object
                    .kernels
                    .iter()
                    .map(|k| (k.name.clone(), k.explicit_args()))
                    .collect();
                let loaded = Module {
                    entries,
                    module,
                    args,
                };
                modules.insert(kernel.to_string(), loaded.clone());
                loaded
            }
        };
        let ep = loaded
            .entries
            .iter()
            .find(|e| e.name == entry)
            .ok_or_else(|| AmdError::CodeObject(format!("{kernel} has no entry point {entry}")))?;
        let args = loaded.args.get(entry).cloned().ok_or_else(|| {
            AmdError::CodeObject(format!("{kernel}: no metadata for entry point {entry}"))
        })?;
        let handle = self.runtime.module_function(loaded.module, entry)?;
        Ok(Function {
            handle,
            block: ep.block,
            shared_bytes: ep.shared_bytes,
            args,
        })
    }

    /// Queues `launch` on the device's stream: the entry point of the code object for
    /// this processor, with the manifest's block and dynamic LDS, after checking the
    /// launch's argument layout against the code object's metadata (a code object whose
    /// kernel takes other arguments is an error, not a launch).
    pub fn launch(&self, launch: &Launch) -> Result<(), AmdError> {
        let f = self.kernel_function(&launch.kernel, &launch.entry)?;
        let ours = launch.layout();
        if ours != f.args {
            return Err(AmdError::CodeObject(format!(
                "{} of {}: the launcher passes arguments at (offset, size) {ours:?}, the code \
                 object declares {:?}",
                launch.entry, launch.kernel, f.args
            )));
        }
        let mut params = launch.params();
        tracing::trace!(kernel = %launch.kernel, entry = %launch.entry, grid = launch.grid, "launch");
        // SAFETY: the arguments match the entry point's metadata in number, offset and
        // size (checked above); `params` points into `launch`, which outlives the call
        // (HIP copies the values when the launch is queued); the backend checked every
        // buffer against the sizes passed.
        unsafe {
            self.runtime.launch(
                f.handle,
                [launch.grid, 1, 1],
                [f.block, 1, 1],
                f.shared_bytes,
                self.stream,
                &mut params,
            )
        }
    }

    /// A zeroed block of at least `bytes`.
    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBlock, AmdError> {
        let block = self.alloc(bytes)?;
        // SAFETY: the block holds at least `bytes`; it lives until the caller drops it,
        // and the allocator drains the stream before reusing its memory.
        unsafe { self.runtime.memset(block.ptr(), 0, bytes, self.stream)? };
        Ok(block)
    }

    /// Queues zeroing `bytes` at device address `dst`, which must lie in a live block of
    /// this device holding `bytes` from there (the backend checks buffer sizes).
    pub(crate) fn zero(&self, dst: u64, bytes: usize) -> Result<(), AmdError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: see above.
        unsafe { self.runtime.memset(dst, 0, bytes, self.stream) }
    }

    /// Queues a copy of `bytes` from device address `src` to `dst`.
    ///
    /// Both addresses must lie in live blocks of this device holding `bytes` from there;
    /// the backend checks buffer sizes before it calls this.
    pub(crate) fn copy(&self, src: u64, dst: u64, bytes: usize) -> Result<(), AmdError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: see above.
        unsafe { self.runtime.copy_on_device(dst, src, bytes, self.stream) }
    }

    /// Queues `rows` copies of `width` bytes between rows `pitch` apart on each side.
    pub(crate) fn copy_2d(
        &self,
        (src, src_pitch): (u64, usize),
        (dst, dst_pitch): (u64, usize),
        width: usize,
        rows: usize,
    ) -> Result<(), AmdError> {
        if width == 0 || rows == 0 {
            return Ok(());
        }
        // SAFETY: the backend computed both regions from buffers it checked.
        unsafe {
            self.runtime.copy_2d_on_device(
                (dst, dst_pitch),
                (src, src_pitch),
                width,
                rows,
                self.stream,
            )
        }
    }

    /// Copies `bytes` into the start of `block` and waits for the copy.
    pub fn write(&self, block: &DeviceBlock, bytes: &[u8]) -> Result<(), AmdError> {
        if bytes.len() > block.bytes() {
            return Err(AmdError::Invalid(format!(
                "writing {} bytes into a block of {}",
                bytes.len(),
                block.bytes()
            )));
        }
        if !bytes.is_empty() {
            // SAFETY: the block holds `bytes.len()` bytes; the copy is waited for below.
            unsafe {
                self.runtime
                    .copy_to_device(block.ptr(), bytes, self.stream)?
            };
        }
        self.runtime.stream_synchronize(self.stream)
    }

    /// Waits for the work queued on the stream.
    pub fn synchronize(&self) -> Result<(), AmdError> {
        self.runtime.stream_synchronize(self.stream)
    }

    /// The stream all of this device's work goes to.
    pub fn stream(&self) -> Handle {
        self.stream
    }

    /// The HIP runtime.
    pub fn runtime(&self) -> &'static HipRuntime {
        self.runtime
    }

    /// The run-time compile cache's statistics.
    pub fn compile_stats(&self) -> crate::rtc::CacheStats {
        self.cache.stats()
    }

    fn ordinal(&self) -> i32 {
        i32::try_from(self.device.index).unwrap_or(i32::MAX)
    }
}

impl Drop for AmdGpu {
    fn drop(&mut self) {
        if let Err(e) = self.runtime.stream_synchronize(self.stream) {
            tracing::warn!(error = %e, "could not drain the ROCm stream");
        }
        let modules = self.modules.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, Module { module, .. }) in modules.drain() {
            // SAFETY: the stream is drained and the module's functions are not used again.
            if let Err(e) = unsafe { self.runtime.module_unload(module) } {
                tracing::warn!(error = %e, "could not unload a ROCm module");
            }
        }
        // The allocator's cache is released when its last block is dropped; the stream
        // stays valid for that (HIP destroys it with the process otherwise).
    }
}
