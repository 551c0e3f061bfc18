//! Opening a model by path: a Hugging Face folder or a single GGUF file.

use std::path::{Path, PathBuf};

use cleave_tokenizer::Tokenizer;

use super::{ModelConfig, TensorSource};
use crate::{EngineError, Result};

/// Everything needed to build a model, before any weight is on a backend.
pub struct ModelFiles {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub source: Box<dyn TensorSource + Send + Sync>,
}

impl ModelFiles {
    /// Opens `path`: a folder with `config.json`, safetensors and `tokenizer.json`, or a `.gguf`
    /// file. Nothing is dequantized or copied yet beyond headers and the tokenizer.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let config = ModelConfig::from_dir(path)?;
            let tokenizer = Tokenizer::from_model_dir(path)?;
            let source = super::safetensors::SafetensorsSource::open_dir(path)?;
            Ok(Self { path: path.to_path_buf(), config, tokenizer, source: Box::new(source) })
        } else if path.is_file() {
            super::gguf_source::open_gguf(path)
        } else {
            Err(EngineError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such model folder or GGUF file"),
            ))
        }
    }

    /// A GGUF image held in memory, loaded exactly as [`ModelFiles::open`] loads a `.gguf` file
    /// (the fuzzer's entry point, and for callers that already hold the bytes). `name` stands
    /// for the path in errors and in [`ModelFiles::path`].
    pub fn from_gguf_bytes(name: &Path, bytes: Vec<u8>) -> Result<Self> {
        super::gguf_source::gguf_from_bytes(name, bytes)
    }

    /// The model's identity, what nodes compare before they exchange KV (see
    /// [`super::identity`]): read from the config, the tokenizer and the norm vectors, without
    /// loading a linear weight.
    pub fn identity(&self) -> Result<u64> {
        let weights = super::identity::weights_identity(&self.config, self.source.as_ref())?;
        Ok(super::identity::with_vocabulary(weights, &self.tokenizer))
    }

    /// The model's EOS ids: from the config, or the tokenizer's EOS token when the config has none.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.config.eos_token_ids.clone();
        if let Some(id) = self.tokenizer.eos_token_id() {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }
}
