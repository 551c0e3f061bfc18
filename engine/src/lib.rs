//! The inference engine of cleave: model loading, the paged KV cache, the continuous-batching
//! scheduler, the sampler, and the engine loop that ties them to a compute backend.
//!
//! Allowed dependencies: kernels, tokenizer, protocol. The core (kv, sched, sampler, runner's
//! step) is plain state with time passed in: no async runtime and no wall clock inside, so it is
//! tested deterministically. Only [`handle`] owns a thread.

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
pub use import::ImportStart;
pub use runner::{EngineConfig, EngineCore, EngineRequest, EngineSnapshot, EngineStats};
