//! The file of cuBLASLt algorithm choices (`kernel.autotune_cache`): for each GEMM
//! problem on one device model and cuBLASLt version, the position of the autotuner's pick
//! among the heuristic's candidates. A later process with the same file runs the same
//! algorithm without timing the candidates again, so its GEMMs round as the first one's
//! did (the fastest candidate can differ between processes by a percent, and candidates
//! that split the k sum differently round 16-bit outputs differently).
//!
//! The file is JSON (`{"format": "kpt-cublaslt-autotune/1", "entries": {key: {"candidate":
//! i, "seconds": t}}}`). Each new choice is merged into what the file holds then and the
//! file is replaced in one rename, so processes sharing a file keep each other's entries.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::NvidiaError;

const FORMAT: &str = "kpt-cublaslt-autotune/1";

/// One problem's pick.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Position among the heuristic's candidates (as many as the autotuner asks for).
    pub candidate: usize,
    /// Seconds per call the autotuner measured for it.
    pub seconds: f64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheFile {
    format: String,
    entries: BTreeMap<String, Choice>,
}

/// The choices of one cache file, kept in memory and written back on every new one.
#[derive(Debug)]
pub struct AutotuneCache {
    path: PathBuf,
    entries: BTreeMap<String, Choice>,
}

impl AutotuneCache {
    /// Reads `path` (a missing file is an empty cache); a file that is not such a cache
    /// is an error naming it.
    pub fn open(path: &Path) -> Result<Self, NvidiaError> {
        Ok(Self {
            path: path.to_path_buf(),
            entries: read(path)?,
        })
    }

    /// The pick for `key`.
    pub fn get(&self, key: &str) -> Option<Choice> {
        self.entries.get(key).copied()
    }

    /// Number of problems in the cache.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache holds no problem.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records `choice` for `key` and writes the file: the entries it holds now (other
    /// processes' included) with this cache's on top, through a temporary file renamed
    /// over it.
    pub fn insert(&mut self, key: String, choice: Choice) -> Result<(), NvidiaError> {
        self.entries.insert(key, choice);
        let mut merged = read(&self.path)?;
        merged.extend(self.entries.iter().map(|(k, c)| (k.clone(), *c)));
        let file = CacheFile {
            format: FORMAT.into(),
            entries: merged,
        };
        let text = serde_json::to_string_pretty(&file)
            .map_err(|e| invalid(&self.path, format!("could not encode: {e}")))?;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| invalid(&self.path, e))?;
        }
        let tmp = self
            .path
            .with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| invalid(&tmp, e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| invalid(&self.path, e))?;
        self.entries = file.entries;
        Ok(())
    }
}

fn invalid(path: &Path, e: impl std::fmt::Display) -> NvidiaError {
    NvidiaError::Invalid(format!("autotune cache {}: {e}", path.display()))
}

fn read(path: &Path) -> Result<BTreeMap<String, Choice>, NvidiaError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(invalid(path, e)),
    };
    let file: CacheFile = serde_json::from_str(&text).map_err(|e| invalid(path, e))?;
    if file.format != FORMAT {
        return Err(invalid(
            path,
            format!("format {:?}, expected {FORMAT:?}", file.format),
        ));
    }
    Ok(file.entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(candidate: usize) -> Choice {
        Choice {
            candidate,
            seconds: 1e-4,
        }
    }

    #[test]
    fn choices_survive_a_reopen_and_merge_with_other_writers() {
        let dir = std::env::temp_dir().join(format!("kpt-autotune-{}", std::process::id()));
        let path = dir.join("nested").join("cublaslt.json");
        let _ = std::fs::remove_dir_all(&dir);
        let mut a = AutotuneCache::open(&path).unwrap();
        assert!(a.is_empty(), "a missing file is an empty cache");
        let mut b = AutotuneCache::open(&path).unwrap();
        a.insert("gemm 1".into(), choice(3)).unwrap();
        b.insert("gemm 2".into(), choice(0)).unwrap();
        // b wrote after a: the file has both, b's in-memory view too.
        assert_eq!(b.get("gemm 1"), Some(choice(3)));
        let reopened = AutotuneCache::open(&path).unwrap();
        assert_eq!(reopened.len(), 2);
        assert_eq!(reopened.get("gemm 2"), Some(choice(0)));
        assert_eq!(reopened.get("gemm 3"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_cache_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("kpt-autotune-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in [
            ("garbage.json", "not json"),
            (
                "other.json",
                r#"{"format": "something-else/1", "entries": {}}"#,
            ),
            (
                "negative.json",
                r#"{"format": "kpt-cublaslt-autotune/1", "entries": {"k": {"candidate": -1, "seconds": 0}}}"#,
            ),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            let e = AutotuneCache::open(&path).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
