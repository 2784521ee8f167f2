//! [`XlaBackend`]: kpt's `Backend` on one PJRT device. Each op runs as a program that
//! XLA compiled for its shapes ([`stablehlo::emit_graph`] of a one-node graph, kept in a
//! [`CompileCache`]); `cpu.*` kernels (the registry's host fallback) run on the host
//! with copies over and back. Device memory is counted per backend, with an optional
//! limit that allocations and op outputs are checked against first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kpt_core::backend::{Backend, BufferMut, BufferRef, DeviceBuffer, MemoryStats};
use kpt_core::hardware::{DeviceInfo, DeviceKind};
use kpt_core::{DType, Graph, KptError, Op, Result, Tensor, TensorSpec};
use kpt_kernels::CpuBackend;

use crate::buffer::Buffer;
use crate::cache::{CacheStats, CompileCache};
use crate::client::{AttrValue, Client, Device, DeviceDescription, DeviceMemoryStats, Topology};
use crate::executable::Executable;
use crate::generation::TpuGeneration;
use crate::options::CompileOptions;
use crate::stablehlo::{self, Program};

/// Compiled programs kept per backend by default (generated code, bytes).
const CACHE_BYTES: usize = 256 << 20;

/// Device bytes held by a backend's buffers.
#[derive(Debug, Default)]
struct Memory {
    live: AtomicU64,
    peak: AtomicU64,
    limit: Option<u64>,
}

impl Memory {
    /// Fails when `bytes` more would pass the limit.
    fn check(&self, device: &str, bytes: u64) -> Result<()> {
        let live = self.live.load(Ordering::Relaxed);
        match self.limit {
            Some(limit) if live.saturating_add(bytes) > limit => Err(KptError::Backend {
                backend: device.into(),
                message: format!(
                    "out of device memory: {bytes} more bytes with {live} in use pass the limit of {limit}"
                ),
            }),
            _ => Ok(()),
        }
    }

    fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

/// A device buffer of the backend: the PJRT buffer, counted while it lives.
struct XlaBuf {
    buf: Buffer,
    bytes: u64,
    memory: Arc<Memory>,
}

impl Drop for XlaBuf {
    fn drop(&mut self) {
        self.memory.live.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What the plugin and Google's published chip facts say about one device, for its
/// [`DeviceInfo`].
#[derive(Debug)]
struct DeviceFacts {
    /// The TPU generation, on the `tpu` platform with a known device kind.
    generation: Option<TpuGeneration>,
    /// The plugin's memory statistics, or why there are none.
    memory: std::result::Result<DeviceMemoryStats, String>,
    /// The topology, or why there is none.
    topology: std::result::Result<Topology, String>,
    /// Devices on this device's chip: from the topology where the device gives its
    /// chip's `coords`, else `None` (taken as 1).
    devices_on_chip: Option<usize>,
}

impl DeviceFacts {
    fn gather(client: &Client, device: &Device, desc: &DeviceDescription, platform: &str) -> Self {
        let generation = if platform == "tpu" {
            TpuGeneration::from_device_kind(&desc.kind)
        } else {
            None
        };
        DeviceFacts::new(
            generation,
            device.memory_stats().map_err(|e| e.to_string()),
            client.topology().map_err(|e| e.to_string()),
            desc,
        )
    }

    fn new(
        generation: Option<TpuGeneration>,
        memory: std::result::Result<DeviceMemoryStats, String>,
        topology: std::result::Result<Topology, String>,
        desc: &DeviceDescription,
    ) -> Self {
        let devices_on_chip = match (&topology, desc.attribute("coords")) {
            (Ok(t), Some(AttrValue::Ints(c))) => Some(t.devices_on_chip(c).max(1)),
            _ => None,
        };
        DeviceFacts {
            generation,
            memory,
            topology,
            devices_on_chip,
        }
    }

    fn sharing(&self) -> usize {
        self.devices_on_chip.unwrap_or(1)
    }

    /// The device's memory: the plugin's limit, else its share of the chip's HBM.
    fn memory_bytes(&self) -> Option<u64> {
        let limit = self.memory.as_ref().ok().and_then(|m| m.bytes_limit);
        limit.or_else(|| {
            self.generation
                .map(|g| g.chip().hbm_bytes / self.sharing() as u64)
        })
    }

    /// The device's TensorCores: its share of the chip's.
    fn compute_units(&self) -> Option<usize> {
        self.generation
            .map(|g| (g.chip().tensorcores / self.sharing()).max(1))
    }

    /// Adds what is known as `DeviceInfo` properties.
    fn record(&self, properties: &mut std::collections::BTreeMap<String, String>) {
        if let Some(g) = self.generation {
            let chip = g.chip();
            properties.insert("tpu_generation".into(), g.name().into());
            properties.insert("tpu_chip_tensorcores".into(), chip.tensorcores.to_string());
            properties.insert(
                "tpu_chip_hbm_gib".into(),
                (chip.hbm_bytes >> 30).to_string(),
            );
            properties.insert(
                "tpu_chip_peak_bf16_tflops".into(),
                format!("{}", chip.peak_bf16_tflops),
            );
        }
        match &self.memory {
            Ok(m) => {
                properties.insert("memory_bytes_in_use".into(), m.bytes_in_use.to_string());
                if let Some(v) = m.peak_bytes_in_use {
                    properties.insert("memory_peak_bytes_in_use".into(), v.to_string());
                }
                if let Some(v) = m.bytes_limit {
                    properties.insert("memory_bytes_limit".into(), v.to_string());
                }
            }
            Err(e) => {
                properties.insert("memory_stats".into(), format!("not reported: {e}"));
            }
        }
        match &self.topology {
            Ok(t) => {
                properties.insert("topology_devices".into(), t.devices.len().to_string());
                if let Some(b) = t.chip_bounds_string() {
                    properties.insert("topology_chips".into(), format!("{} ({b})", t.chips()));
                }
                if let Some(n) = self.devices_on_chip {
                    properties.insert("topology_devices_per_chip".into(), n.to_string());
                }
            }
            Err(e) => {
                properties.insert("topology".into(), format!("not reported: {e}"));
            }
        }
    }
}

/// kpt's backend on one device of a PJRT plugin.
pub struct XlaBackend {
    client: Client,
    device: Device,
    info: DeviceInfo,
    name: String,
    cache: CompileCache,
    /// Programs by op and input specs, so that a repeated launch skips emission; their
    /// executables live in `cache` (within its size limit).
    programs: Mutex<HashMap<String, Program>>,
    /// What the platform's XLA offers (f64 or not).
    target: stablehlo::Target,
    memory: Arc<Memory>,
    host: CpuBackend,
}

impl std::fmt::Debug for XlaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XlaBackend")
            .field("name", &self.name)
            .field("device", &self.info.name)
            .finish()
    }
}

impl XlaBackend {
    /// Checks the index inputs of packed and paged attention on the host (a few ids), so
    /// that bad offsets, lengths or block ids are the reference's errors: in a program,
    /// XLA would clamp them.
    fn check_indices(&self, op: &Op, inputs: &[BufferRef<'_>]) -> Result<()> {
        let Op::Attention(p) = op else {
            return Ok(());
        };
        if !(p.varlen || p.paged) || inputs.len() < 5 {
            return Ok(());
        }
        let ids = |i: usize| -> Result<Vec<i64>> {
            let t = self.download(inputs[i].buffer, inputs[i].spec)?;
            Ok(t.to_f64_vec().into_iter().map(|x| x as i64).collect())
        };
        let (a, b) = (ids(3)?, ids(4)?);
        if p.varlen {
            let (q, k) = (inputs[0].spec, inputs[1].spec);
            kpt_kernels::cpu::varlen_segments(&a, &b, q.shape[1], k.shape[1])?;
        } else {
            let cache = &inputs[1].spec.shape;
            let paged = kpt_kernels::cpu::PagedKv {
                block_size: cache[1],
                num_blocks: cache[0],
                block_table: &a,
                seq_lens: &b,
            };
            for seq in 0..b.len() {
                paged.checked_len(seq)?;
            }
        }
        Ok(())
    }

    /// The backend on device `index` of `client`'s addressable devices.
    pub fn new(client: &Client, index: usize) -> Result<Self> {
        let devices = client.devices()?;
        let count = devices.len();
        let device = devices.into_iter().nth(index).ok_or_else(|| {
            KptError::InvalidArgument(format!("device {index} of {count} PJRT devices"))
        })?;
        let desc = device.description()?;
        let platform = client.platform_name()?;
        let mut properties = std::collections::BTreeMap::new();
        properties.insert("pjrt_platform".into(), platform.clone());
        properties.insert("pjrt_platform_version".into(), client.platform_version()?);
        let (major, minor) = client.plugin().api_version();
        properties.insert("pjrt_c_api".into(), format!("{major}.{minor}"));
        properties.insert(
            "pjrt_plugin".into(),
            client.plugin().path().display().to_string(),
        );
        for (k, v) in &desc.attributes {
            properties.insert(format!("attr.{k}"), format!("{v:?}"));
        }
        let name = if platform == "tpu" {
            format!("tpu:{index}")
        } else {
            format!("xla-{platform}:{index}")
        };
        let facts = DeviceFacts::gather(client, &device, &desc, &platform);
        facts.record(&mut properties);
        let info = DeviceInfo {
            kind: DeviceKind::Tpu,
            index,
            name: format!(
                "{} ({}, XLA {platform} plugin)",
                desc.kind, desc.debug_string
            ),
            memory_bytes: facts.memory_bytes(),
            compute_units: facts.compute_units(),
            arch: match facts.generation {
                Some(g) => Some(g.name().to_string()),
                None => (platform == "tpu").then(|| desc.kind.clone()),
            },
            features: vec!["xla".into()],
            properties,
        };
        Ok(XlaBackend {
            client: client.clone(),
            device,
            info,
            name,
            cache: CompileCache::new(client, CACHE_BYTES),
            programs: Mutex::new(HashMap::new()),
            target: stablehlo::Target::of_platform(&platform),
            memory: Arc::new(Memory::default()),
            host: CpuBackend::new()?,
        })
    }

    /// Limits the bytes this backend's buffers may hold; allocations and op outputs
    /// past it fail with an out-of-memory error instead of reaching the device.
    pub fn with_memory_limit(mut self, bytes: u64) -> Self {
        self.memory = Arc::new(Memory {
            limit: Some(bytes),
            ..Memory::default()
        });
        self
    }

    /// The compile cache's counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    fn wrap(&self, buf: Buffer, dtype: DType, len: usize, bytes: u64) -> DeviceBuffer {
        self.memory.add(bytes);
        let inner = XlaBuf {
            buf,
            bytes,
            memory: self.memory.clone(),
        };
        DeviceBuffer::new(dtype, len, Box::new(inner))
    }

    fn xla_buf<'a>(&self, b: &'a DeviceBuffer) -> Result<&'a XlaBuf> {
        b.inner::<XlaBuf>().ok_or_else(|| KptError::Backend {
            backend: self.name.clone(),
            message: "a buffer of another backend".into(),
        })
    }

    /// The program of `op` on inputs of `specs`, emitted once, and its executable from
    /// the compile cache.
    fn program(&self, op: &Op, specs: &[TensorSpec]) -> Result<(Arc<Executable>, Program)> {
        let key = format!("{op:?}|{specs:?}");
        let known = self
            .programs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned();
        let program = match known {
            Some(p) => p,
            None => {
                let mut g = Graph::new();
                let ids: Vec<_> = specs
                    .iter()
                    .enumerate()
                    .map(|(i, s)| g.input(format!("in{i}"), s.dtype, &s.shape))
                    .collect();
                for o in g.op_multi("op", op.clone(), &ids)? {
                    g.output(o)?;
                }
                let p = stablehlo::emit_graph_for(&g, specs, self.target)?;
                self.programs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key, p.clone());
                p
            }
        };
        let exe = self
            .cache
            .get_or_compile(program.mlir.as_bytes(), &CompileOptions::default())?;
        Ok((exe, program))
    }

    /// The buffer of `r` shaped as its spec: as stored, or a reshaped / leading slice of
    /// it (a buffer allocated larger than the value, or flat).
    fn shaped(&self, r: &BufferRef<'_>) -> Result<Option<Buffer>> {
        let buf = &self.xla_buf(r.buffer)?.buf;
        let dims = buf.dims()?;
        let want: Vec<i64> = r.spec.shape.iter().map(|&d| d as i64).collect();
        if dims == want {
            return Ok(None);
        }
        let have: i64 = dims.iter().product();
        let need = r.spec.numel() as i64;
        if have < need {
            return Err(KptError::Backend {
                backend: self.name.clone(),
                message: format!("a buffer of {have} elements holds no {}", r.spec),
            });
        }
        let ty = |d: &[i64]| {
            let s: Vec<usize> = d.iter().map(|&x| x as usize).collect();
            stablehlo::tensor_type(&s, Some(r.spec.dtype))
        };
        let (src, flat, out) = (ty(&dims), ty(&[have]), ty(&want));
        let part = ty(&[need]);
        let mlir = format!(
            "module @reshape {{\n  func.func public @main(%a: {src}) -> ({out}) {{\n    %f = \"stablehlo.reshape\"(%a) : ({src}) -> {flat}\n    %s = \"stablehlo.slice\"(%f) {{start_indices = array<i64: 0>, limit_indices = array<i64: {need}>, strides = array<i64: 1>}} : ({flat}) -> {part}\n    %r = \"stablehlo.reshape\"(%s) : ({part}) -> {out}\n    \"func.return\"(%r) : ({out}) -> ()\n  }}\n}}\n"
        );
        let exe = self
            .cache
            .get_or_compile(mlir.as_bytes(), &CompileOptions::default())?;
        Ok(exe.execute(&[buf])?.into_iter().next())
    }

    /// Runs `op`'s program on `inputs` (with `outputs` results expected); returns the
    /// result buffers and the program (whose `outputs` are their specs).
    fn run_op(
        &self,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: usize,
    ) -> Result<(Vec<Buffer>, Program)> {
        let specs: Vec<TensorSpec> = inputs.iter().map(|r| r.spec.clone()).collect();
        let (exe, program) = self.program(op, &specs)?;
        if program.outputs.len() != outputs {
            return Err(KptError::Backend {
                backend: self.name.clone(),
                message: format!(
                    "{op} gives {} outputs, {outputs} buffers given",
                    program.outputs.len()
                ),
            });
        }
        let need: u64 = program
            .outputs
            .iter()
            .map(|s| (s.numel() * s.dtype.size_in_bytes()) as u64)
            .sum();
        self.memory.check(&self.name, need)?;
        let adapted = inputs
            .iter()
            .map(|r| self.shaped(r))
            .collect::<Result<Vec<_>>>()?;
        // FP8 / int8 inputs pass their scale as a scalar after the arguments.
        let scales = program
            .scale_args
            .iter()
            .map(|&i| {
                Ok(self
                    .client
                    .buffer(&[inputs[i].buffer.scale], &[], &self.device)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let args: Vec<&Buffer> = inputs
            .iter()
            .zip(&adapted)
            .map(|(r, a)| match a {
                Some(b) => Ok(b),
                None => Ok(&self.xla_buf(r.buffer)?.buf),
            })
            .chain(scales.iter().map(Ok))
            .collect::<Result<Vec<_>>>()?;
        let results = exe.execute(&args)?;
        Ok((results, program))
    }

    fn run_on_host(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        self.host.run_for_device(
            kernel,
            op,
            inputs,
            outputs,
            |b, spec| self.download(b, spec),
            |t, m| self.write(t, m.buffer),
        )
    }

    /// Replaces the contents of `dst` with `buf`.
    fn replace(&self, dst: &mut DeviceBuffer, buf: Buffer, spec: &TensorSpec) -> Result<()> {
        let bytes = (spec.numel() * spec.dtype.size_in_bytes()) as u64;
        let old = self.xla_buf(dst)?.bytes;
        self.memory.check(&self.name, bytes.saturating_sub(old))?;
        self.memory.add(bytes);
        let slot = dst.inner_mut::<XlaBuf>().ok_or_else(|| KptError::Backend {
            backend: self.name.clone(),
            message: "a buffer of another backend".into(),
        })?;
        // The old buffer's bytes are released when it drops, here.
        *slot = XlaBuf {
            buf,
            bytes,
            memory: self.memory.clone(),
        };
        Ok(())
    }
}

impl Backend for XlaBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Tpu
    }

    fn device(&self) -> &DeviceInfo {
        &self.info
    }

    fn allocate(&self, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        let bytes = len * dtype.size_in_bytes();
        self.memory.check(&self.name, bytes as u64)?;
        let zeros = vec![0u8; bytes];
        let buf = self
            .client
            .buffer_from_bytes(&zeros, dtype, &[len as i64], &self.device)?;
        Ok(self.wrap(buf, dtype, len, bytes as u64))
    }

    fn upload(&self, tensor: &Tensor) -> Result<DeviceBuffer> {
        let t = tensor.contiguous();
        let bytes = t.as_bytes()?;
        self.memory.check(&self.name, bytes.len() as u64)?;
        let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let buf = self
            .client
            .buffer_from_bytes(bytes, t.dtype(), &dims, &self.device)?;
        let mut out = self.wrap(buf, t.dtype(), t.numel(), bytes.len() as u64);
        out.scale = t.scale();
        Ok(out)
    }

    fn download(&self, buffer: &DeviceBuffer, spec: &TensorSpec) -> Result<Tensor> {
        let bytes = self.xla_buf(buffer)?.buf.to_bytes()?;
        let n = spec.numel() * spec.dtype.size_in_bytes();
        if bytes.len() < n {
            return Err(KptError::Backend {
                backend: self.name.clone(),
                message: format!("a buffer of {} bytes holds no {spec}", bytes.len()),
            });
        }
        Ok(Tensor::from_bytes(&bytes[..n], spec.dtype, &spec.shape)?.with_scale(buffer.scale))
    }

    fn copy_into(
        &self,
        src: BufferRef<'_>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let (offset, len) = kpt_core::backend::copy_extent(src, dst, dst_offset)?;
        // Through the host: read both, splice, write the result back.
        let mut whole = self.xla_buf(dst)?.buf.to_bytes()?;
        let part = self.xla_buf(src.buffer)?.buf.to_bytes()?;
        whole[offset..offset + len].copy_from_slice(&part[..len]);
        let dims = self.xla_buf(dst)?.buf.dims()?;
        let dtype = dst.dtype();
        let buf = self
            .client
            .buffer_from_bytes(&whole, dtype, &dims, &self.device)?;
        let spec = TensorSpec::new(&dims.iter().map(|&d| d as usize).collect::<Vec<_>>(), dtype);
        self.replace(dst, buf, &spec)
    }

    fn write_rows(
        &self,
        rows: BufferRef<'_>,
        slots: BufferRef<'_>,
        cache: BufferMut<'_>,
    ) -> Result<()> {
        // The slots (a few ids) are checked on the host, so that one past the cache is
        // an error as everywhere else (XLA's scatter would skip it); the rows go into
        // the cache on the device, by the cache_write program.
        let extent = kpt_core::backend::row_write_extent(rows, slots, &cache)?;
        for slot in self.download(slots.buffer, slots.spec)?.to_f64_vec() {
            extent.cache_row(slot as i64)?;
        }
        let (mut results, program) = {
            let current = BufferRef {
                buffer: &*cache.buffer,
                spec: cache.spec,
            };
            self.run_op(&Op::CacheWrite, &[current, rows, slots], 1)?
        };
        let out = results.pop().ok_or_else(|| KptError::Backend {
            backend: self.name.clone(),
            message: "cache_write gave no output".into(),
        })?;
        self.replace(cache.buffer, out, &program.outputs[0])
    }

    fn execute(
        &self,
        kernel: &str,
        op: &Op,
        inputs: &[BufferRef<'_>],
        outputs: &mut [BufferMut<'_>],
    ) -> Result<()> {
        if kernel.starts_with("cpu.") {
            return self.run_on_host(kernel, op, inputs, outputs);
        }
        if !kernel.starts_with("xla.") {
            return Err(KptError::Backend {
                backend: self.name.clone(),
                message: format!("kernel {kernel} does not run on XLA"),
            });
        }
        self.check_indices(op, inputs)?;
        let (results, program) = self.run_op(op, inputs, outputs.len())?;
        for (((m, buf), spec), &scale) in outputs
            .iter_mut()
            .zip(results)
            .zip(&program.outputs)
            .zip(&program.output_scales)
        {
            self.replace(m.buffer, buf, spec)?;
            m.buffer.scale = scale;
        }
        Ok(())
    }

    fn write(&self, tensor: &Tensor, dst: &mut DeviceBuffer) -> Result<()> {
        let t = tensor.contiguous();
        let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let buf = self
            .client
            .buffer_from_bytes(t.as_bytes()?, t.dtype(), &dims, &self.device)?;
        self.replace(dst, buf, &TensorSpec::new(t.shape(), t.dtype()))?;
        dst.scale = t.scale();
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // Every call above waits for its program or copy.
        Ok(())
    }

    fn counters(&self) -> Vec<(String, u64)> {
        let s = self.cache.stats();
        [
            ("xla_compile_cache_hits", s.hits),
            ("xla_compile_cache_misses", s.misses),
            ("xla_compile_cache_disk_hits", s.disk_hits),
            ("xla_compile_cache_evictions", s.evictions),
            ("xla_compile_cache_entries", s.entries as u64),
            ("xla_compile_cache_bytes", s.bytes as u64),
            (
                "xla_programs",
                self.programs.lock().map_or(0, |p| p.len() as u64),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn memory_stats(&self) -> MemoryStats {
        MemoryStats {
            allocated_bytes: self.memory.live.load(Ordering::Relaxed),
            peak_bytes: self.memory.peak.load(Ordering::Relaxed),
            // The smaller of the backend's own limit and the device's memory.
            total_bytes: match (self.memory.limit, self.info.memory_bytes) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::tests::{topology, tpu_device};

    fn stats(limit: Option<u64>) -> std::result::Result<DeviceMemoryStats, String> {
        Ok(DeviceMemoryStats {
            bytes_in_use: 1 << 20,
            peak_bytes_in_use: Some(2 << 20),
            bytes_limit: limit,
            ..DeviceMemoryStats::default()
        })
    }

    #[test]
    fn a_megacore_chip_is_one_device_with_the_whole_chip() {
        let dev = tpu_device(0, "TPU v5", &[0, 0, 0], 0);
        let t = topology(vec![dev.clone(), tpu_device(1, "TPU v5", &[1, 0, 0], 0)]);
        let f = DeviceFacts::new(Some(TpuGeneration::V5p), stats(None), Ok(t), &dev);
        assert_eq!(f.compute_units(), Some(2));
        assert_eq!(f.memory_bytes(), Some(95 << 30));
        let mut p = std::collections::BTreeMap::new();
        f.record(&mut p);
        assert_eq!(p["tpu_generation"], "v5p");
        assert_eq!(p["tpu_chip_tensorcores"], "2");
        assert_eq!(p["tpu_chip_hbm_gib"], "95");
        assert_eq!(p["tpu_chip_peak_bf16_tflops"], "459");
        assert_eq!(p["memory_bytes_in_use"], "1048576");
        assert_eq!(p["memory_peak_bytes_in_use"], "2097152");
        assert!(!p.contains_key("memory_bytes_limit"));
        assert_eq!(p["topology_devices"], "2");
        assert_eq!(p["topology_chips"], "2 (2x1x1)");
        assert_eq!(p["topology_devices_per_chip"], "1");
    }

    #[test]
    fn devices_sharing_a_chip_get_their_share() {
        // v2: one device per TensorCore, two on each chip.
        let a = tpu_device(0, "TPU v2", &[0, 0, 0], 0);
        let b = tpu_device(1, "TPU v2", &[0, 0, 0], 1);
        let t = topology(vec![a.clone(), b]);
        let f = DeviceFacts::new(Some(TpuGeneration::V2), stats(None), Ok(t), &a);
        assert_eq!(f.compute_units(), Some(1));
        assert_eq!(f.memory_bytes(), Some(8 << 30));
    }

    #[test]
    fn the_plugins_limit_wins_over_the_chips_hbm() {
        let dev = tpu_device(0, "TPU v5 lite", &[0, 0, 0], 0);
        let t = topology(vec![dev.clone()]);
        let limit = 15_000_000_000;
        let f = DeviceFacts::new(Some(TpuGeneration::V5e), stats(Some(limit)), Ok(t), &dev);
        assert_eq!(f.memory_bytes(), Some(limit));
        assert_eq!(f.compute_units(), Some(1));
        let mut p = std::collections::BTreeMap::new();
        f.record(&mut p);
        assert_eq!(p["memory_bytes_limit"], limit.to_string());
    }

    #[test]
    fn without_a_generation_or_reports_nothing_is_made_up() {
        let cpu = DeviceDescription {
            id: 0,
            process_index: 0,
            kind: "cpu".into(),
            debug_string: "TFRT_CPU_0".into(),
            attributes: Vec::new(),
        };
        let f = DeviceFacts::new(
            None,
            Err("UNIMPLEMENTED".into()),
            Err("no topology".into()),
            &cpu,
        );
        assert_eq!(f.compute_units(), None);
        assert_eq!(f.memory_bytes(), None);
        let mut p = std::collections::BTreeMap::new();
        f.record(&mut p);
        assert_eq!(p["memory_stats"], "not reported: UNIMPLEMENTED");
        assert_eq!(p["topology"], "not reported: no topology");
        assert!(!p.contains_key("tpu_generation"));
        assert!(!p.contains_key("topology_devices_per_chip"));
        // A TPU of a generation kpt does not know gets the plugin's limit only.
        let f = DeviceFacts::new(None, stats(Some(1 << 30)), Err(String::new()), &cpu);
        assert_eq!(f.memory_bytes(), Some(1 << 30));
        assert_eq!(f.compute_units(), None);
    }
}
