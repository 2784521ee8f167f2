//! Memory-mapped safetensors checkpoints, single-file or sharded.
//!
//! [`Weights::open`] maps `model.safetensors`, or every shard listed in
//! `model.safetensors.index.json`, and reads each header once. Tensor data is copied
//! out of the mapping only when a tensor is asked for ([`Weights::tensor`]), so a
//! lowering touches each weight once. Headers and offsets are checked when a file is
//! opened: a truncated file, a bad header or a bad index is a [`ModelError`], never a
//! panic.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use kpt_core::{DType, Storage, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped safetensors file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Where the data section starts (8 + header length).
    data_start: usize,
    metadata: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the mapping is read-only and private to this process; a checkpoint
        // file changed by another process while mapped is outside what kpt supports
        // (as for every memory-mapped loader: candle, safetensors, llama.cpp).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        let data_start = 8 + header_len;
        let data_len = mmap.len().saturating_sub(data_start);
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            if start > end || end > data_len {
                return Err(ModelError::Safetensors {
                    path: path.to_path_buf(),
                    message: format!(
                        "tensor `{name}` spans bytes {start}..{end} of a {data_len}-byte data section"
                    ),
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            data_start,
            metadata,
        })
    }

    fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let (start, end) = info.data_offsets;
        // In bounds: checked against the mapping's length in `open`.
        &self.mmap[self.data_start + start..self.data_start + end]
    }
}

/// Shape and dtype of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// The kpt dtype it loads as.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<usize>,
}

/// The tensors of a checkpoint directory.
pub struct Weights {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name -> shard index.
    location: HashMap<String, usize>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.location.len())
            .finish()
    }
}

impl Weights {
    /// Maps the checkpoint in `dir`: `model.safetensors.index.json` and its shards when
    /// the index exists, else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(dir, &index);
        }
        let single = dir.join(SINGLE_FILE);
        if !single.is_file() {
            return Err(ModelError::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("neither {SINGLE_FILE} nor {INDEX_FILE} exists"),
                ),
            ));
        }
        let shard = Shard::open(&single)?;
        let location = shard
            .metadata
            .tensors()
            .into_keys()
            .map(|name| (name, 0))
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            shards: vec![shard],
            location,
        })
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Self> {
        let bad = |message: String| ModelError::Safetensors {
            path: index.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: index.to_path_buf(),
            message: e.to_string(),
        })?;
        let Some(Value::Object(map)) = value.get("weight_map") else {
            return Err(bad("no `weight_map` object".into()));
        };
        // Shard file -> its tensors, in a stable order.
        let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let Value::String(file) = file else {
                return Err(bad(format!("`weight_map.{name}` is not a file name")));
            };
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(bad(format!(
                    "`weight_map.{name}` names `{file}`, outside the checkpoint directory"
                )));
            }
            files.entry(file.clone()).or_default().push(name.clone());
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut location = HashMap::new();
        for (i, (file, names)) in files.into_iter().enumerate() {
            let shard = Shard::open(&dir.join(&file))?;
            for name in names {
                if shard.info(&name).is_none() {
                    return Err(bad(format!(
                        "`{name}` is mapped to {file}, which does not contain it"
                    )));
                }
                location.insert(name, i);
            }
            shards.push(shard);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            location,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of mapped files.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.location.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Whether the checkpoint has a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    fn find(&self, name: &str) -> Result<(&Shard, &TensorInfo)> {
        let missing = || ModelError::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        };
        let shard = &self.shards[*self.location.get(name).ok_or_else(missing)?];
        let info = shard.info(name).ok_or_else(missing)?;
        Ok((shard, info))
    }

    /// Shape and dtype of `name`.
    pub fn stored(&self, name: &str) -> Result<StoredTensor> {
        let (shard, info) = self.find(name)?;
        Ok(StoredTensor {
            dtype: kpt_dtype(name, &shard.path, info.dtype)?,
            shape: info.shape.clone(),
        })
    }

    /// The tensor `name` in its stored dtype.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let (shard, info) = self.find(name)?;
        let dtype = kpt_dtype(name, &shard.path, info.dtype)?;
        Ok(Tensor::from_bytes(shard.bytes(info), dtype, &info.shape)?)
    }

    /// The tensor `name`, checked to have `shape` and converted to `dtype`.
    pub fn load(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let stored = self.stored(name)?;
        if stored.shape != shape {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: stored.shape,
            });
        }
        let (shard, info) = self.find(name)?;
        let storage = convert(shard.bytes(info), stored.dtype, dtype)?;
        Ok(Tensor::new(storage, shape)?)
    }
}

/// Converts little-endian float bytes of `from` to storage of `to` in one pass, without
/// the f64 copy of [`Tensor::to_dtype`] (a 128k x 4096 embedding would need 4 GiB for
/// it). Rounds to nearest even, as `Tensor::to_dtype` does.
fn convert(bytes: &[u8], from: DType, to: DType) -> Result<Storage> {
    if from == to {
        return Ok(Storage::from_bytes(from, bytes)?);
    }
    // Exact widening of every stored type but f64.
    let f32s = || -> Vec<f32> {
        match from {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => Vec::new(),
        }
    };
    let f64s = || -> Vec<f64> {
        bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect()
    };
    Ok(match (from, to) {
        (DType::F64, DType::F32) => Storage::F32(f64s().into_iter().map(|x| x as f32).collect()),
        (DType::F64, DType::F16) => Storage::F16(f64s().into_iter().map(f16::from_f64).collect()),
        (DType::F64, DType::BF16) => {
            Storage::BF16(f64s().into_iter().map(bf16::from_f64).collect())
        }
        (DType::F32 | DType::F16 | DType::BF16, DType::F64) => {
            Storage::F64(f32s().into_iter().map(f64::from).collect())
        }
        (DType::F32 | DType::F16 | DType::BF16, DType::F32) => Storage::F32(f32s()),
        (DType::F32 | DType::F16 | DType::BF16, DType::F16) => {
            Storage::F16(f32s().into_iter().map(f16::from_f32).collect())
        }
        (DType::F32 | DType::F16 | DType::BF16, DType::BF16) => {
            Storage::BF16(f32s().into_iter().map(bf16::from_f32).collect())
        }
        (from, to) => {
            return Err(ModelError::Unsupported(format!(
                "converting {from} weights to {to}"
            )))
        }
    })
}

/// The kpt dtype of a safetensors dtype, for the float types kpt loads.
fn kpt_dtype(name: &str, path: &Path, dtype: Dtype) -> Result<DType> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::F16 => Ok(DType::F16),
        Dtype::BF16 => Ok(DType::BF16),
        Dtype::F64 => Ok(DType::F64),
        other => Err(ModelError::UnsupportedDType {
            name: name.to_string(),
            path: path.to_path_buf(),
            dtype: format!("{other:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass conversion rounds exactly as kpt-core's `Tensor::to_dtype`.
    #[test]
    fn convert_matches_tensor_to_dtype() {
        let mut rng = kpt_core::rand::SplitMix64::new(3);
        let values: Vec<f64> = (0..257)
            .map(|i| match i {
                0 => 0.0,
                1 => -0.0,
                2 => 65504.0,
                3 => 1e-8,
                _ => (rng.next_f64() - 0.5) * 10f64.powi((i % 9) - 4),
            })
            .collect();
        let floats = [DType::F64, DType::F32, DType::F16, DType::BF16];
        for from in floats {
            let source = Tensor::from_f64(&values, &[values.len()], from).unwrap();
            let bytes = source.as_bytes().unwrap();
            for to in floats {
                let got = Tensor::new(convert(bytes, from, to).unwrap(), &[values.len()]).unwrap();
                assert_eq!(got, source.to_dtype(to).unwrap(), "{from} -> {to}");
            }
        }
        assert!(convert(&[0; 4], DType::I32, DType::F32).is_err());
    }
}
