//! A compile cache: XLA compiles a program once per client; later requests for the same
//! program and options get the loaded executable back.
//!
//! Entries are keyed by the SHA-256 of the compile options and the program, and evicted
//! least recently used first once their generated code passes the size limit. With a
//! directory, compiled programs are also written there in the plugin's serialized form
//! (keyed as well by the platform and its version) and loaded from there by later
//! processes; plugins that cannot serialize just skip that step.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::client::Client;
use crate::error::Result;
use crate::executable::Executable;
use crate::options::CompileOptions;

/// What the cache has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served from memory.
    pub hits: u64,
    /// Requests that compiled (or loaded from disk).
    pub misses: u64,
    /// Misses served from the on-disk cache.
    pub disk_hits: u64,
    /// Entries dropped to stay under the size limit.
    pub evictions: u64,
    /// Entries held now.
    pub entries: usize,
    /// Their size now (generated code, or the program's length where the plugin does
    /// not report a size).
    pub bytes: usize,
}

impl CacheStats {
    /// Hits over requests (0 before the first request).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

struct Entry {
    exe: Arc<Executable>,
    bytes: usize,
    last_used: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<[u8; 32], Entry>,
    clock: u64,
    stats: CacheStats,
}

/// An LRU cache of compiled programs for one [`Client`].
pub struct CompileCache {
    client: Client,
    max_bytes: usize,
    dir: Option<PathBuf>,
    state: Mutex<State>,
}

impl std::fmt::Debug for CompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileCache")
            .field("max_bytes", &self.max_bytes)
            .field("dir", &self.dir)
            .field("stats", &self.stats())
            .finish()
    }
}

impl CompileCache {
    /// A cache of at most `max_bytes` of compiled programs (the most recently used one
    /// is kept even when it alone is larger).
    pub fn new(client: &Client, max_bytes: usize) -> Self {
        CompileCache {
            client: client.clone(),
            max_bytes,
            dir: None,
            state: Mutex::new(State::default()),
        }
    }

    /// Also keeps compiled programs in `dir` (created if missing).
    pub fn with_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// The executable of `program` compiled with `options`: from memory, from disk, or
    /// compiled now.
    pub fn get_or_compile(
        &self,
        program: &[u8],
        options: &CompileOptions,
    ) -> Result<Arc<Executable>> {
        let opts = options.to_proto_bytes();
        let key: [u8; 32] = Sha256::new()
            .chain_update((opts.len() as u64).to_le_bytes())
            .chain_update(&opts)
            .chain_update(program)
            .finalize()
            .into();
        {
            let mut st = self.lock();
            st.clock += 1;
            let now = st.clock;
            if let Some(e) = st.entries.get_mut(&key) {
                e.last_used = now;
                let exe = e.exe.clone();
                st.stats.hits += 1;
                return Ok(exe);
            }
        }
        // Compile outside the lock; two threads may compile the same program once each.
        let (exe, from_disk) = match self.load(&key) {
            Some(exe) => (exe, true),
            None => {
                let exe = self.client.compile(program, options)?;
                self.store(&key, &exe);
                (exe, false)
            }
        };
        let bytes = exe
            .code_size()
            .filter(|&n| n > 0)
            .unwrap_or(program.len())
            .max(1);
        let exe = Arc::new(exe);
        let mut st = self.lock();
        st.clock += 1;
        let now = st.clock;
        st.stats.misses += 1;
        st.stats.disk_hits += u64::from(from_disk);
        st.entries.insert(
            key,
            Entry {
                exe: exe.clone(),
                bytes,
                last_used: now,
            },
        );
        self.evict(&mut st, &key);
        Ok(exe)
    }

    /// Counters and sizes.
    pub fn stats(&self) -> CacheStats {
        let st = self.lock();
        CacheStats {
            entries: st.entries.len(),
            bytes: st.entries.values().map(|e| e.bytes).sum(),
            ..st.stats
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves the map consistent (each update is one
        // insert or remove), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops least recently used entries other than `keep` while over the limit.
    fn evict(&self, st: &mut State, keep: &[u8; 32]) {
        loop {
            let total: usize = st.entries.values().map(|e| e.bytes).sum();
            if total <= self.max_bytes {
                return;
            }
            let oldest = st
                .entries
                .iter()
                .filter(|(k, _)| *k != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| *k);
            match oldest {
                Some(k) => {
                    st.entries.remove(&k);
                    st.stats.evictions += 1;
                }
                None => return,
            }
        }
    }

    /// The file of `key` in the cache directory: the key, the platform and its version.
    fn path(&self, key: &[u8; 32]) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let platform = self.client.platform_name().ok()?;
        let version = self.client.platform_version().unwrap_or_default();
        let full: [u8; 32] = Sha256::new()
            .chain_update(key)
            .chain_update(platform.as_bytes())
            .chain_update([0])
            .chain_update(version.as_bytes())
            .finalize()
            .into();
        let hex: String = full.iter().map(|b| format!("{b:02x}")).collect();
        Some(dir.join(format!("{platform}-{hex}.xla")))
    }

    fn load(&self, key: &[u8; 32]) -> Option<Executable> {
        let path = self.path(key)?;
        let bytes = std::fs::read(&path).ok()?;
        match self.client.deserialize(&bytes) {
            Ok(exe) => Some(exe),
            Err(e) => {
                tracing::warn!(path = %path.display(), "ignoring a cached executable: {e}");
                None
            }
        }
    }

    fn store(&self, key: &[u8; 32], exe: &Executable) {
        let Some(path) = self.path(key) else {
            return;
        };
        let written = exe
            .serialize()
            .map_err(|e| e.to_string())
            .and_then(|bytes| write_atomically(&path, &bytes).map_err(|e| e.to_string()));
        if let Err(e) = written {
            tracing::debug!(path = %path.display(), "not cached on disk: {e}");
        }
    }
}

/// Writes `bytes` to a temporary file beside `path`, then renames it there, so that a
/// reader never sees a partial file.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
