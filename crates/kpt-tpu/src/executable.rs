//! Programs compiled by XLA for a client's devices, and their execution.

use crate::buffer::Buffer;
use crate::client::Client;
use crate::error::{PjrtError, Result};
use crate::options::CompileOptions;
use crate::plugin::args;
use crate::sys;

/// A compiled program loaded on a client's devices (`PJRT_LoadedExecutable`), freed on
/// drop.
pub struct Executable {
    client: Client,
    raw: *mut sys::PJRT_LoadedExecutable,
    num_outputs: usize,
}

// SAFETY: a loaded executable may be run and freed from any thread (the C API is
// thread-safe); the handle keeps its client alive.
unsafe impl Send for Executable {}
// SAFETY: as above.
unsafe impl Sync for Executable {}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executable")
            .field("num_outputs", &self.num_outputs)
            .finish()
    }
}

impl Client {
    /// Compiles a StableHLO (or MHLO) module, given as MLIR text or bytecode, with XLA.
    ///
    /// Errors: the plugin's message for a program that does not parse, verify or
    /// compile ([`PjrtError::Call`]).
    pub fn compile(&self, mlir: &[u8], options: &CompileOptions) -> Result<Executable> {
        const FORMAT: &str = "mlir";
        let plugin = self.plugin();
        let api = plugin.api();
        let mut program = args::<sys::PJRT_Program>();
        // The plugin only reads `code` when compiling.
        program.code = mlir.as_ptr().cast_mut().cast();
        program.code_size = mlir.len();
        program.format = FORMAT.as_ptr().cast();
        program.format_size = FORMAT.len();
        let opts = options.to_proto_bytes();
        let mut a = args::<sys::PJRT_Client_Compile_Args>();
        a.client = self.raw();
        a.program = &program;
        a.compile_options = opts.as_ptr().cast();
        a.compile_options_size = opts.len();
        plugin.call("PJRT_Client_Compile", api.PJRT_Client_Compile, &mut a)?;
        self.loaded(a.executable)
    }

    /// Loads a program [`Executable::serialize`] wrote (by a plugin of the same version
    /// for the same devices).
    pub fn deserialize(&self, bytes: &[u8]) -> Result<Executable> {
        let plugin = self.plugin();
        let mut a = args::<sys::PJRT_Executable_DeserializeAndLoad_Args>();
        a.client = self.raw();
        a.serialized_executable = bytes.as_ptr().cast();
        a.serialized_executable_size = bytes.len();
        let api = plugin.api();
        plugin.call(
            "PJRT_Executable_DeserializeAndLoad",
            api.PJRT_Executable_DeserializeAndLoad,
            &mut a,
        )?;
        self.loaded(a.loaded_executable)
    }

    fn loaded(&self, raw: *mut sys::PJRT_LoadedExecutable) -> Result<Executable> {
        if raw.is_null() {
            return Err(PjrtError::Invalid(
                "the plugin returned no executable".into(),
            ));
        }
        let mut exe = Executable {
            client: self.clone(),
            raw,
            num_outputs: 0,
        };
        exe.num_outputs = exe.query_num_outputs()?;
        Ok(exe)
    }
}

impl Executable {
    /// Outputs per execution (per device).
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    fn query_num_outputs(&self) -> Result<usize> {
        self.with_executable(|plugin, exe| {
            let mut n = args::<sys::PJRT_Executable_NumOutputs_Args>();
            n.executable = exe;
            let api = plugin.api();
            plugin.call(
                "PJRT_Executable_NumOutputs",
                api.PJRT_Executable_NumOutputs,
                &mut n,
            )?;
            Ok(n.num_outputs)
        })
    }

    /// Bytes of generated code, or `None` where the plugin does not say.
    pub fn code_size(&self) -> Option<usize> {
        self.with_executable(|plugin, exe| {
            let mut n = args::<sys::PJRT_Executable_SizeOfGeneratedCodeInBytes_Args>();
            n.executable = exe;
            let api = plugin.api();
            plugin.call(
                "PJRT_Executable_SizeOfGeneratedCodeInBytes",
                api.PJRT_Executable_SizeOfGeneratedCodeInBytes,
                &mut n,
            )?;
            Ok(usize::try_from(n.size_in_bytes).ok())
        })
        .ok()
        .flatten()
    }

    /// The compiled program in the plugin's serialized form, for
    /// [`Client::deserialize`] (an on-disk compile cache).
    ///
    /// Errors: plugins that cannot serialize ([`PjrtError::Call`], `UNIMPLEMENTED`).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        self.with_executable(|plugin, exe| {
            let mut a = args::<sys::PJRT_Executable_Serialize_Args>();
            a.executable = exe;
            let api = plugin.api();
            plugin.call(
                "PJRT_Executable_Serialize",
                api.PJRT_Executable_Serialize,
                &mut a,
            )?;
            let bytes = if a.serialized_bytes.is_null() {
                Vec::new()
            } else {
                // SAFETY: the bytes are backed by `serialized_executable` until its
                // deleter runs, below.
                unsafe {
                    std::slice::from_raw_parts(
                        a.serialized_bytes.cast::<u8>(),
                        a.serialized_bytes_size,
                    )
                }
                .to_vec()
            };
            if let Some(delete) = a.serialized_executable_deleter {
                // SAFETY: the deleter frees the serialized executable once; the bytes were
                // copied above.
                unsafe { delete(a.serialized_executable) };
            }
            Ok(bytes)
        })
    }

    /// Runs `f` on this program's `PJRT_Executable`, freed afterwards.
    fn with_executable<T>(
        &self,
        f: impl FnOnce(&crate::Plugin, *mut sys::PJRT_Executable) -> Result<T>,
    ) -> Result<T> {
        let plugin = self.client.plugin();
        let api = plugin.api();
        let mut g = args::<sys::PJRT_LoadedExecutable_GetExecutable_Args>();
        g.loaded_executable = self.raw;
        plugin.call(
            "PJRT_LoadedExecutable_GetExecutable",
            api.PJRT_LoadedExecutable_GetExecutable,
            &mut g,
        )?;
        let out = f(plugin, g.executable);
        let mut d = args::<sys::PJRT_Executable_Destroy_Args>();
        d.executable = g.executable;
        plugin.call(
            "PJRT_Executable_Destroy",
            api.PJRT_Executable_Destroy,
            &mut d,
        )?;
        out
    }

    /// Runs the program once on its device with `inputs` (in the order of the main
    /// function's parameters) and waits for it; returns its outputs.
    ///
    /// Errors: the plugin's message for inputs that do not match the program's
    /// parameters, or a failed run ([`PjrtError::Call`]).
    pub fn execute(&self, inputs: &[&Buffer]) -> Result<Vec<Buffer>> {
        Ok(self.execute_on_devices(&[inputs.to_vec()])?.remove(0))
    }

    /// Runs a program compiled for several devices (`num_replicas` or
    /// `num_partitions` in its [`CompileOptions`]) once: `inputs[d]` are the arguments
    /// on device `d` of the compiled device assignment (each on that device; sharded
    /// parameters take that device's shard), and the result holds each device's
    /// outputs. Collectives in the program (all-reduce, and those the SPMD partitioner
    /// inserts) run between the devices.
    pub fn execute_on_devices(&self, inputs: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        let devices = inputs.len();
        let num_args = inputs.first().map_or(0, Vec::len);
        if devices == 0 || inputs.iter().any(|a| a.len() != num_args) {
            return Err(PjrtError::Invalid(format!(
                "every device needs the same number of arguments, got {:?}",
                inputs.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let plugin = self.client.plugin();
        let api = plugin.api();
        let arg_ptrs: Vec<Vec<*mut sys::PJRT_Buffer>> = inputs
            .iter()
            .map(|a| a.iter().map(|b| b.raw()).collect())
            .collect();
        let arg_lists: Vec<*const *mut sys::PJRT_Buffer> =
            arg_ptrs.iter().map(|a| a.as_ptr()).collect();
        let mut outs: Vec<Vec<*mut sys::PJRT_Buffer>> =
            vec![vec![std::ptr::null_mut(); self.num_outputs]; devices];
        let out_lists: Vec<*mut *mut sys::PJRT_Buffer> =
            outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
        let mut done = vec![std::ptr::null_mut::<sys::PJRT_Event>(); devices];
        let mut options = args::<sys::PJRT_ExecuteOptions>();
        let mut a = args::<sys::PJRT_LoadedExecutable_Execute_Args>();
        a.executable = self.raw;
        a.options = &mut options;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = devices;
        a.num_args = num_args;
        a.output_lists = out_lists.as_ptr();
        a.device_complete_events = done.as_mut_ptr();
        plugin.call(
            "PJRT_LoadedExecutable_Execute",
            api.PJRT_LoadedExecutable_Execute,
            &mut a,
        )?;
        // Own the outputs first, so that they are freed even if the run failed.
        let outputs: Vec<Vec<Buffer>> = outs
            .iter()
            .map(|o| {
                o.iter()
                    .filter(|p| !p.is_null())
                    .map(|&p| Buffer::from_raw(&self.client, p))
                    .collect()
            })
            .collect();
        let mut waited = Ok(());
        for &event in &done {
            let r = plugin.await_event("PJRT_LoadedExecutable_Execute", event);
            waited = waited.and(r);
        }
        waited?;
        if let Some(short) = outputs.iter().find(|o| o.len() != self.num_outputs) {
            return Err(PjrtError::Invalid(format!(
                "the program returned {} of its {} outputs",
                short.len(),
                self.num_outputs
            )));
        }
        Ok(outputs)
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let plugin = self.client.plugin();
        let mut a = args::<sys::PJRT_LoadedExecutable_Destroy_Args>();
        a.executable = self.raw;
        let api = plugin.api();
        if let Err(e) = plugin.call(
            "PJRT_LoadedExecutable_Destroy",
            api.PJRT_LoadedExecutable_Destroy,
            &mut a,
        ) {
            tracing::warn!("{e}");
        }
    }
}
