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
use crate::hsaco::CodeObject;
use crate::memory::{CachingAllocator, DeviceBlock, HipMemory};
use crate::rtc::{CompileCache, Hiprtc};
use crate::runtime::{Handle, HipRuntime};
use crate::AmdError;

/// One ROCm device in use.
pub struct AmdGpu {
    runtime: &'static HipRuntime,
    device: AmdDevice,
    stream: Handle,
    memory: CachingAllocator,
    /// Loaded code objects by kernel name: its entry points and its module.
    modules: Mutex<HashMap<String, (&'static [EntryPoint], Handle)>>,
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
        let processor = self.device.arch.processor();
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let (entries, module) = match modules.get(kernel) {
            Some(&loaded) => loaded,
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
                CodeObject::parse(bytes)?.check(
                    processor,
                    tuning.wave_size,
                    tuning.lds_bytes,
                    &launch,
                )?;
                self.runtime.set_device(self.ordinal())?;
                let module = self.runtime.module_load(bytes)?;
                modules.insert(kernel.to_string(), (entries, module));
                (entries, module)
            }
        };
        let ep = entries
            .iter()
            .find(|e| e.name == entry)
            .ok_or_else(|| AmdError::CodeObject(format!("{kernel} has no entry point {entry}")))?;
        let function = self.runtime.module_function(module, entry)?;
        Ok((function, ep.block, ep.shared_bytes))
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
        for (_, (_, module)) in modules.drain() {
            // SAFETY: the stream is drained and the module's functions are not used again.
            if let Err(e) = unsafe { self.runtime.module_unload(module) } {
                tracing::warn!(error = %e, "could not unload a ROCm module");
            }
        }
        // The allocator's cache is released when its last block is dropped; the stream
        // stays valid for that (HIP destroys it with the process otherwise).
    }
}
