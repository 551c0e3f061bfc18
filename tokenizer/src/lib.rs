//! Tokenizer shared by the engine and the coordinator.

pub mod gguf;
