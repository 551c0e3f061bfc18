//! Model definition and loading: Hugging Face folders (config.json + safetensors) and GGUF files.

pub mod config;
pub mod gguf;
mod gguf_source;
pub mod llama;
pub mod load;
pub mod safetensors;
pub mod storage;
pub mod synth;

pub use config::{Architecture, ModelConfig};
pub use llama::{ForwardBatch, Model, Workspace};
pub use load::ModelFiles;
pub use storage::{KvSpec, KvStorage};

/// A source of named f32 tensors in Hugging Face naming and layout. Two implementations exist:
/// safetensors folders and GGUF files.
pub trait TensorSource {
    /// Loads `name` as f32, checking it has exactly `shape`.
    fn load(&self, name: &str, shape: &[usize]) -> crate::Result<Vec<f32>>;
    /// Whether the source holds `name` (used for optional tensors such as `lm_head.weight`).
    fn contains(&self, name: &str) -> bool;
}
