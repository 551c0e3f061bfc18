//! Command-line / embedded configuration of the coordinator's HTTP edge.
//!
//! Defaults live here and only here (the `default_value_t`s); [`Default`] is derived from
//! them by parsing an empty command line, so the binary, tests and embedders agree.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// How the coordinator serves the OpenAI-compatible API.
#[derive(Debug, Clone, clap::Args, serde::Deserialize)]
pub struct CoordinatorArgs {
    /// Model: a Hugging Face folder (tokenizer.json, tokenizer_config.json, config.json,
    /// generation_config.json), a .gguf file, or a hub id (`owner/name`, from the Hugging Face
    /// cache). The coordinator reads the tokenizer and config-level facts, and the weights once
    /// to learn the model's fingerprint (which every node must match).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: Option<PathBuf>,

    /// Address the HTTP API listens on.
    #[arg(long, env = "CLEAVE_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,

    /// Name under which the model is served (`model` in requests and /v1/models); defaults to
    /// the model folder's name.
    #[arg(long, env = "CLEAVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,

    /// Context length override; defaults to config.json's `max_position_embeddings`.
    #[arg(long, env = "CLEAVE_MAX_MODEL_LEN")]
    pub max_model_len: Option<u32>,

    /// Require `Authorization: Bearer KEY` on the API routes (not /health, /metrics); the key is
    /// named `default` in logs and metrics.
    #[arg(long, env = "CLEAVE_API_KEY")]
    pub api_key: Option<String>,

    /// A file of API keys, one per line: `NAME KEY [MAX_CONCURRENT]` (`#` comments). Each key's
    /// name labels its requests in logs and in `cleave_api_key_*` metrics; a key past its
    /// concurrent-request limit is answered 429.
    #[arg(long, env = "CLEAVE_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,

    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs `--tls-key`.
    #[arg(long, env = "CLEAVE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key of `--tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "CLEAVE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// Concurrent-request limit of a key that names none (0: no limit).
    #[arg(long, env = "CLEAVE_API_KEY_MAX_CONCURRENT", default_value_t = 0)]
    pub api_key_max_concurrent: u32,

    /// Dispatches waiting for the router at once; one more is refused with 429.
    #[arg(long, env = "CLEAVE_MAX_QUEUED", default_value_t = 1024)]
    pub max_queued_requests: usize,

    /// Token events buffered per dispatch between the router and the HTTP task.
    #[arg(long, default_value_t = 64)]
    pub event_buffer: usize,

    /// Most choices one request may ask for (`n` times the number of prompts).
    #[arg(long, default_value_t = 16)]
    pub max_choices: u32,

    /// Seconds to wait for a request's first token before failing it.
    #[arg(long, default_value_t = 300.0)]
    pub first_token_timeout_secs: f64,

    /// Seconds to wait between two token events of a running request before failing it.
    #[arg(long, default_value_t = 60.0)]
    pub inter_token_timeout_secs: f64,

    /// Requests that take this many seconds or more end with an info-level `slow request` log
    /// line naming their route (path and nodes) and latencies.
    #[arg(long, default_value_t = 10.0)]
    pub slow_request_log_secs: f64,

    /// Value of the Retry-After header (seconds) on 429 responses.
    #[arg(long, default_value_t = 1)]
    pub retry_after_secs: u32,

    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
}

#[derive(Parser)]
struct DefaultsOnly {
    #[command(flatten)]
    args: CoordinatorArgs,
}

impl Default for CoordinatorArgs {
    fn default() -> Self {
        // An empty command line always parses: every field has a default or is optional.
        DefaultsOnly::try_parse_from(["cleave-coordinator"])
            .map(|d| d.args)
            .unwrap_or_else(|e| unreachable!("coordinator defaults must parse: {e}"))
    }
}

/// Timeouts (and the slow-request log threshold) as durations, read once from
/// [`CoordinatorArgs`].
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub first_token: Duration,
    pub inter_token: Duration,
    pub slow_request: Duration,
}

impl CoordinatorArgs {
    /// The configured timeouts; non-finite or negative seconds become the defaults' order of
    /// magnitude clamp (0.001 s .. one day), so a typo cannot turn into an unbounded wait.
    pub fn timeouts(&self) -> Timeouts {
        let clamp = |s: f64| Duration::from_secs_f64(if s.is_finite() { s.clamp(0.001, 86_400.0) } else { 60.0 });
        Timeouts {
            first_token: clamp(self.first_token_timeout_secs),
            inter_token: clamp(self.inter_token_timeout_secs),
            slow_request: clamp(self.slow_request_log_secs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse() {
        let a = CoordinatorArgs::default();
        assert_eq!(a.listen.port(), 8000);
        assert_eq!(a.max_queued_requests, 1024);
        assert!(a.api_key.is_none());
        assert_eq!(a.timeouts().inter_token, Duration::from_secs(60));
    }

    #[test]
    fn bad_timeouts_are_clamped() {
        let a = CoordinatorArgs {
            first_token_timeout_secs: f64::NAN,
            inter_token_timeout_secs: -1.0,
            ..Default::default()
        };
        let t = a.timeouts();
        assert_eq!(t.first_token, Duration::from_secs(60));
        assert_eq!(t.inter_token, Duration::from_millis(1));
    }
}
