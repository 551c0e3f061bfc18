//! The engine's one error type.

use std::path::PathBuf;

use cleave_protocol::RequestId;

/// Everything that can go wrong inside the engine, with the facts needed to act on it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("invalid model config {path}: {detail}")]
    Config { path: PathBuf, detail: String },
    #[error("unsupported model architecture `{arch}` (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)")]
    UnsupportedArchitecture { arch: String },
    #[error("model file {path} is invalid: {detail}")]
    ModelFile { path: PathBuf, detail: String },
    #[error("tensor `{name}` is missing from the model files")]
    MissingTensor { name: String },
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    TensorShape { name: String, expected: Vec<usize>, actual: Vec<usize> },
    #[error("tensor `{name}` has unsupported dtype {dtype} (supported: F32, BF16, F16)")]
    TensorDtype { name: String, dtype: String },
    #[error(transparent)]
    Tokenizer(#[from] cleave_tokenizer::TokenizerError),
    #[error(transparent)]
    Kernel(#[from] cleave_kernels::KernelError),
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    #[error(transparent)]
    Sched(#[from] crate::sched::SchedError),
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request's output constraint does not compile, refuses its history, or failed
    /// mid-generation (the request ends with this error; others are unaffected).
    #[error(transparent)]
    Constraint(#[from] cleave_constrain::ConstrainError),
    #[error("request rejected: {0}")]
    Rejected(String),
    #[error("the engine has stopped")]
    Stopped,
    #[error("no KV import is reserved for {id}")]
    UnknownImport { id: RequestId },
    #[error("{id} is already live in this engine (an import reservation or a running request)")]
    DuplicateImport { id: RequestId },
    #[error("cannot reserve KV for {id}: {num_tokens} tokens need {need} blocks, {available} available")]
    ImportRefused { id: RequestId, num_tokens: usize, need: usize, available: usize },
    #[error("bad KV chunk for {id} (layer {layer}, tokens from {token_start}): {detail}")]
    ImportChunk { id: RequestId, layer: u32, token_start: u32, detail: String },
    #[error("KV import of {id} is incomplete: layer {layer} has {have} of {need} tokens")]
    ImportIncomplete { id: RequestId, layer: u32, have: usize, need: usize },
    #[error("KV import of {id} reserved {reserved} tokens but the prompt has {prompt}")]
    ImportMismatch { id: RequestId, reserved: usize, prompt: usize },
    #[error("KV export of {id} failed: {source}")]
    KvExport { id: RequestId, source: crate::export::SinkError },
}

pub type Result<T> = std::result::Result<T, EngineError>;

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io { path: path.into(), source }
    }
}
