//! Weights from a Hugging Face folder: `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped, converted to f32 tensor by tensor at load;
//! f16 and bf16 linear weights are kept in 16 bits ([`TensorSource::load_linear`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::{SafeTensorError, SafeTensors};

use cleave_kernels::{HalfFormat, HalfMatrix};

use super::{LinearWeight, TensorSource};
use crate::{EngineError, Result};

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (8-byte length prefix + header).
    data_start: usize,
    metadata: Metadata,
}

/// Memory-mapped safetensors shards of one model. The header of each shard is parsed once, when
/// the folder is opened; tensor data is read (and converted to f32) only when asked for.
pub struct SafetensorsSource {
    shards: Vec<Shard>,
    /// Tensor name -> index in `shards`.
    index: HashMap<String, usize>,
}

impl SafetensorsSource {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| EngineError::io(&index_path, e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| EngineError::ModelFile { path: index_path.clone(), detail: e.to_string() })?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| EngineError::ModelFile {
                path: index_path.clone(),
                detail: "no `weight_map` object".into(),
            })?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(EngineError::ModelFile {
                path: dir.to_path_buf(),
                detail: "no model.safetensors or model.safetensors.index.json in this folder".into(),
            });
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| EngineError::io(&path, e))?;
            // SAFETY: the file is opened read-only; cleave never writes model files, and a file
            // changed underneath a running server is outside what any engine can defend against.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap[..])
                .map_err(|e| EngineError::ModelFile { path: path.clone(), detail: header_detail(e, mmap.len()) })?;
            let data_start = 8 + header_len;
            let shard_idx = shards.len();
            for (name, info) in metadata.tensors() {
                let (start, end) = info.data_offsets;
                if data_start + end > mmap.len() || start > end {
                    return Err(EngineError::ModelFile {
                        path: path.clone(),
                        detail: format!(
                            "tensor `{name}` data [{start}, {end}) lies past the end of the file (truncated?)"
                        ),
                    });
                }
                index.insert(name, shard_idx);
            }
            shards.push(Shard { path, mmap, data_start, metadata });
        }
        Ok(Self { shards, index })
    }

    /// Names of every tensor in the folder.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

/// What a failed header read means for the file: the crate words a file cut short as a header
/// problem ("invalid header length", "incomplete metadata"), which sends users looking in the
/// wrong place.
fn header_detail(e: SafeTensorError, file_len: usize) -> String {
    match e {
        SafeTensorError::HeaderTooSmall => {
            format!("the file is {file_len} bytes, too short for the 8-byte header length (truncated?)")
        }
        SafeTensorError::InvalidHeaderLength => {
            format!("the file ({file_len} bytes) ends inside its header (truncated?)")
        }
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "the tensor data described by the header does not end where the file ends ({file_len} bytes): \
             truncated, or trailing bytes"
        ),
        e => format!("bad safetensors header: {e}"),
    }
}

impl TensorSource for SafetensorsSource {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (dtype, bytes) = self.tensor_bytes(name, shape)?;
        Ok(match dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            _ => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        })
    }

    fn load_linear(&self, name: &str, shape: [usize; 2]) -> Result<LinearWeight> {
        let (dtype, bytes) = self.tensor_bytes(name, &shape)?;
        let format = match dtype {
            Dtype::F16 => HalfFormat::F16,
            Dtype::BF16 => HalfFormat::Bf16,
            _ => return self.load(name, &shape).map(LinearWeight::F32),
        };
        let data = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        // `tensor_bytes` checked the byte count against the shape, so this cannot refuse it.
        Ok(LinearWeight::Half(HalfMatrix::new(format, shape[0], shape[1], data)?))
    }
}

impl SafetensorsSource {
    /// The dtype and raw bytes of tensor `name`, checked to have exactly `shape`, a dtype cleave
    /// reads (F32, F16, BF16) and the bytes those need.
    fn tensor_bytes(&self, name: &str, shape: &[usize]) -> Result<(Dtype, &[u8])> {
        let shard =
            &self.shards[*self.index.get(name).ok_or_else(|| EngineError::MissingTensor { name: name.into() })?];
        let info = shard.metadata.info(name).ok_or_else(|| EngineError::MissingTensor { name: name.into() })?;
        if info.shape != shape {
            return Err(EngineError::TensorShape {
                name: name.into(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        let (start, end) = info.data_offsets;
        let bytes = &shard.mmap[shard.data_start + start..shard.data_start + end];
        let numel: usize = shape.iter().product();
        let elem = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => return Err(EngineError::TensorDtype { name: name.into(), dtype: format!("{other:?}") }),
        };
        if bytes.len() != numel * elem {
            return Err(EngineError::ModelFile {
                path: shard.path.clone(),
                detail: format!(
                    "tensor `{name}` holds {} bytes, its shape {shape:?} and dtype need {}",
                    bytes.len(),
                    numel * elem
                ),
            });
        }
        Ok((info.dtype, bytes))
    }
}
