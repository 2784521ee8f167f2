//! A Python worker (`torch_cpu.py`, `torch_cuda.py`, `hf_models.py`) in a child process,
//! one JSON line per request.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

/// A running worker.
pub struct TorchWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// What the worker reported about itself (torch version, threads, CPU capability).
    pub info: Value,
}

impl TorchWorker {
    /// Starts `python script` with `threads` intra-op threads and the variables `env`
    /// set, and reads its greeting.
    pub fn start(
        python: &Path,
        script: &Path,
        threads: usize,
        env: &[(&str, String)],
    ) -> Result<Self> {
        let mut child = Command::new(python)
            .arg(script)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("KPT_BENCH_THREADS", threads.to_string())
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} {}", python.display(), script.display()))?;
        let stdin = child.stdin.take().context("worker stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("worker stdout")?);
        let mut worker = Self {
            child,
            stdin,
            stdout,
            info: Value::Null,
        };
        worker.info = worker
            .read()
            .context("the PyTorch worker did not start (is torch installed?)")?;
        Ok(worker)
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("the PyTorch worker exited");
        }
        serde_json::from_str(&line).with_context(|| format!("bad worker reply: {line}"))
    }

    /// Sends one request and returns the reply; a reply with `error` is an error.
    pub fn call(&mut self, request: &Value) -> Result<Value> {
        writeln!(self.stdin, "{request}")?;
        self.stdin.flush()?;
        let reply = self.read()?;
        if let Some(e) = reply.get("error") {
            bail!("worker: {}", e.as_str().unwrap_or("unknown error"));
        }
        Ok(reply)
    }

    /// Times every PyTorch variant of a case; returns per-call seconds by variant name.
    pub fn time(&mut self, request: &Value) -> Result<BTreeMap<String, Vec<f64>>> {
        let reply = self.call(request)?;
        serde_json::from_value(reply["variants"].clone())
            .map_err(|e| anyhow!("bad worker reply {reply}: {e}"))
    }
}

impl Drop for TorchWorker {
    fn drop(&mut self) {
        // Closing stdin ends the worker's loop; kill it if it does not go.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
