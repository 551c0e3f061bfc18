//! Tokenizer shared by the engine and the coordinator.
