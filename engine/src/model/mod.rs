//! Model definition and loading: Hugging Face folders (config.json + safetensors) and GGUF files.

pub mod config;
pub mod gguf;
mod gguf_source;
pub mod identity;
pub mod llama;
pub mod load;
pub mod safetensors;
pub mod storage;
pub mod synth;
pub mod to_gguf;

#[cfg(test)]
mod quantized_tests;

pub use config::{Architecture, ModelConfig};
pub use llama::{ForwardBatch, LoadOptions, Model, WeightBytes, Workspace};
pub use load::ModelFiles;
pub use storage::{KvSpec, KvStorage};

/// A linear weight `[n, k]` as a [`TensorSource`] holds it.
#[derive(Debug)]
pub enum LinearWeight {
    /// Row-major f32.
    F32(Vec<f32>),
    /// Blocks of a format the kernels multiply as they are.
    Quantized(cleave_kernels::QuantMatrix),
    /// f16 or bf16 elements, row-major (a Hugging Face checkpoint's usual dtype).
    Half(cleave_kernels::HalfMatrix),
}

/// A source of named f32 tensors in Hugging Face naming and layout. Two implementations exist:
/// safetensors folders and GGUF files.
pub trait TensorSource {
    /// Loads `name` as f32, checking it has exactly `shape`.
    fn load(&self, name: &str, shape: &[usize]) -> crate::Result<Vec<f32>>;
    /// Loads the linear weight `name`, checking it has exactly the HF shape `shape` (`[n, k]`):
    /// in a block-quantized format when the source stores it in one the kernels multiply (a
    /// GGUF's Q4_1, say), in 16 bits when it stores f16 or bf16, else as f32 (this default).
    fn load_linear(&self, name: &str, shape: [usize; 2]) -> crate::Result<LinearWeight> {
        self.load(name, &shape).map(LinearWeight::F32)
    }
    /// Whether the source holds `name` (used for optional tensors such as `lm_head.weight`).
    fn contains(&self, name: &str) -> bool;
}
