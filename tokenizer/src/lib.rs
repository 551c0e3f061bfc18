//! Tokenizer shared by the engine and the coordinator.
//!
//! Wraps the Hugging Face `tokenizers` crate (encode/decode exactly as `tokenizer.json`
//! says) and adds what serving needs around it: chat template rendering with
//! `transformers`' Jinja conventions ([`chat`]), streaming detokenization that never
//! emits broken UTF-8 ([`IncrementalDecoder`]) and stop-string matching over a text
//! stream ([`StopMatcher`]).
//!
//! Allowed dependencies: `tokenizers`, `minijinja`(-contrib), serde. Never the engine or
//! kernels: the HTTP coordinator links this crate. No I/O beyond loading files in the
//! constructors; no clock unless a caller leaves [`ChatOptions::now_unix_secs`] unset.

pub mod chat;
pub mod config;
pub mod error;
pub mod gguf;
pub mod incremental;
pub mod stop;
mod strftime;
mod tokenizer;

pub use chat::{ChatFunctionCall, ChatMessage, ChatOptions, ChatToolCall, CHATML_FALLBACK_TEMPLATE};
pub use config::{NamedTemplate, TokenizerConfig, DEFAULT_TEMPLATE_NAME};
pub use error::{Result, TokenizerError};
pub use incremental::IncrementalDecoder;
pub use stop::{StopMatcher, StopOutput};
pub use tokenizer::Tokenizer;
