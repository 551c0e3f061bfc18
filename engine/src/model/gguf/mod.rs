//! Loading models from a single GGUF file (the llama.cpp / Ollama format).
//!
//! - [`reader`]: the container: header (v2/v3), typed metadata, tensor infos, alignment and a
//!   memory map of the data. Every length, count and offset is checked against the file before
//!   it is used, so a malformed file gives a [`GgufError`] naming the key or tensor at fault,
//!   never a panic or an allocation larger than the file.
//! - [`dequant`]: ggml types to f32 (F32, F16, BF16, and through `cleave_kernels::quant` Q8_0,
//!   Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, which [`GgufModel::tensor_quantized`] also hands
//!   out in their blocks for the quantized kernels).
//! - [`model`]: llama / qwen2 / qwen3 GGUFs seen as a Hugging Face model: a config, a tokenizer
//!   and tensors under their HF names and `[out, in]` shapes, with llama.cpp's q/k row
//!   permutation undone so that HF's rotate-half RoPE applies.
//!
//! Allowed dependencies: std, half, memmap2, rayon, thiserror, `cleave_tokenizer::gguf` and the
//! block formats of `cleave_kernels::quant`.
//! Nothing here knows the rest of the engine; [`GgufError`] is mapped into the engine's error
//! by the caller.

pub mod dequant;
pub mod model;
pub mod quantize;
pub mod reader;
pub mod writer;

#[cfg(test)]
mod tests;

pub use dequant::GgmlType;
pub use model::{GgufModel, GgufModelConfig, GgufRopeScaling};
pub use reader::{GgufFile, MetaValue, TensorInfo};

use cleave_tokenizer::gguf::GgufTokenizerError;

/// Everything that can go wrong reading a GGUF file. Each variant names the key, tensor or
/// offset at fault.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("reading GGUF file {path}: {source}")]
    Io { path: std::path::PathBuf, source: std::io::Error },
    #[error("not a GGUF file: magic bytes {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {version} is not supported (supported: 2, 3){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },
    #[error("GGUF file truncated reading {what}: needs {need} bytes at offset {offset}, file is {len} bytes")]
    Truncated { what: String, offset: u64, need: u64, len: u64 },
    #[error("GGUF {what} is {value}, more than the file can hold (at most {limit})")]
    TooLarge { what: String, value: u64, limit: u64 },
    #[error("GGUF metadata key {key:?}: unknown value type {ty}")]
    UnknownValueType { key: String, ty: u32 },
    #[error("GGUF metadata key {key:?}: arrays nested deeper than {limit}")]
    NestingTooDeep { key: String, limit: usize },
    #[error("GGUF {what}: invalid UTF-8")]
    BadUtf8 { what: String },
    #[error("GGUF metadata key {key:?} appears twice")]
    DuplicateKey { key: String },
    #[error("GGUF tensor {name:?} appears twice")]
    DuplicateTensor { name: String },
    #[error("GGUF general.alignment {alignment} is not a power of two")]
    BadAlignment { alignment: u64 },
    #[error("GGUF tensor {name:?}: unknown ggml type {ty}")]
    UnknownTensorType { name: String, ty: u32 },
    #[error("GGUF tensor {name:?}: bad shape {dims:?}: {reason}")]
    BadShape { name: String, dims: Vec<u64>, reason: String },
    #[error("GGUF tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor { name: String, offset: u64, alignment: u64 },
    #[error("GGUF tensor {name:?}: data [{start}, {end}) lies past the end of the file ({len} bytes)")]
    TensorOutOfBounds { name: String, start: u64, end: u64, len: u64 },
    #[error("GGUF tensor {name:?}: dequantizing ggml type {ty} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)")]
    UnsupportedTensorType { name: String, ty: GgmlType },
    #[error("GGUF metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("GGUF metadata key {key:?}: expected {expected}, found {found}")]
    WrongType { key: String, expected: &'static str, found: String },
    #[error("GGUF metadata key {key:?}: invalid value {value}: {reason}")]
    BadValue { key: String, value: String, reason: String },
    #[error("GGUF architecture {arch:?} is not supported (supported: llama, qwen2, qwen3)")]
    UnsupportedArchitecture { arch: String },
    #[error("GGUF model has no tensor {hf_name:?} (GGUF name {gguf_name:?})")]
    MissingTensor { hf_name: String, gguf_name: String },
    #[error("tensor name {name:?} does not map to a GGUF tensor of this model")]
    UnknownTensorName { name: String },
    #[error("GGUF tensor {name:?}: shape {found:?}, expected {expected:?}")]
    ShapeMismatch { name: String, found: Vec<usize>, expected: Vec<usize> },
    #[error("GGUF tokenizer: {0}")]
    Tokenizer(#[from] GgufTokenizerError),
}

/// Result with [`GgufError`].
pub type Result<T> = std::result::Result<T, GgufError>;
