//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can stop a benchmark. Per-request failures are not errors of the run: they are
/// recorded in the request's record and counted by kind.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid argument: {0}")]
    InvalidArg(String),
    #[error("dataset {path}: {msg}")]
    Dataset { path: PathBuf, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] cleave_tokenizer::TokenizerError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("http: {0}")]
    Http(String),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("plot {path}: {msg}")]
    Plot { path: PathBuf, msg: String },
    #[error("server: {0}")]
    Server(String),
    #[error("profile: {0}")]
    Profile(String),
    #[error("a request task of the benchmark panicked or was cancelled: {0}")]
    Task(String),
    #[error("planner: {0}")]
    Planner(#[from] cleave_planner::PlannerError),
    #[error(
        "simulation stalled at {at_s:.0} s: {unfinished} requests unfinished {since_last_arrival_s:.0} s after the \
         last arrival (no node left that can serve them?)"
    )]
    Stalled { at_s: f64, unfinished: usize, since_last_arrival_s: f64 },
    #[error("{0} failed (ring)")]
    Crypto(&'static str),
    #[error("transfer: {0}")]
    Net(#[from] cleave_net::NetError),
    #[error("transfer: {0}")]
    Transfer(#[from] cleave_kv_transfer::KvTransferError),
}

pub type Result<T> = std::result::Result<T, BenchError>;

impl BenchError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}
