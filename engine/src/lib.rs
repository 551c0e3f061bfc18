//! The inference engine of cleave: model loading, the paged KV cache, the continuous-batching
//! scheduler, the sampler, and the engine loop that ties them to a compute backend.
//!
//! Allowed dependencies: kernels, tokenizer, protocol. The core (kv, sched, sampler, runner's
//! step) is plain state with time passed in: no async runtime and no wall clock inside, so it is
//! tested deterministically. Only [`handle`] owns a thread.
//!
//! Disaggregated serving: a prefill node runs prefill-only requests whose K/V leaves layer by
//! layer during the forward pass ([`export`]); a decode node reserves blocks, writes the
//! received K/V into them and decodes from the token after the first ([`import`]). A migrated
//! stream resumes on another engine with [`EngineCore::add_resumed`]. [`EngineCore::kv_layout`]
//! carries the model fingerprint both sides compare before any byte moves.

pub mod error;
pub mod export;
pub mod handle;
pub mod import;
pub mod kv;
pub mod model;
pub mod runner;
pub mod sampler;
pub mod sched;

pub use error::{EngineError, Result};
pub use export::{ExportDone, KvChunk, KvExport, KvExportEvent, SinkError};
pub use handle::{EngineHandle, EngineInfo, EngineThread, TokenStream};
pub use import::{ImportGrant, ImportStart};
pub use runner::{ConstraintCompiler, EngineConfig, EngineCore, EngineRequest, EngineSnapshot, EngineStats};
