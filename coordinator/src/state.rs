//! What the HTTP handlers share: [`AppState`] (immutable after construction; the mutable state
//! is the router actor behind its dispatch channel), and the helpers every handler uses. Its own
//! module so that the handlers and the router that registers them do not import each other.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::config::CoordinatorArgs;
use crate::dispatch::DispatchSender;
use crate::error::CoordinatorError;
use crate::generate::{AdmitConfig, IdSource};
use crate::keys::ApiKeys;
use crate::metrics as m;
use crate::model::ModelInfo;
use crate::validate::Limits;

/// Everything the handlers share. Immutable after construction (the mutable state is the
/// router actor behind `dispatch`), cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    pub(crate) inner: Arc<Inner>,
    /// `Ok(())` while the backend can take requests; /health answers 503 with the reason
    /// otherwise. Always ready when no readiness signal was given.
    pub(crate) ready: Option<watch::Receiver<Readiness>>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub model: ModelInfo,
    pub dispatch: DispatchSender,
    pub admit: AdmitConfig,
    pub limits: Limits,
    pub keys: Arc<ApiKeys>,
    pub max_body_bytes: usize,
    pub ids: IdSource,
    pub metrics: Option<PrometheusHandle>,
    pub started_unix: u64,
}

/// What /health reports: `Ok(())`, or why requests cannot be served now.
pub type Readiness = Result<(), String>;

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl AppState {
    /// State for a server of `model` whose requests go to `dispatch` (a channel made with
    /// [`crate::dispatch_channel`] of capacity `args.max_queued_requests`). Fails only on an
    /// unusable `--api-keys-file`.
    pub fn new(args: &CoordinatorArgs, model: ModelInfo, dispatch: DispatchSender) -> Result<Self, CoordinatorError> {
        let text = match &args.api_keys_file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|e| CoordinatorError::KeysFile { path: p.display().to_string(), reason: e.to_string() })?,
            ),
            None => None,
        };
        let file = args.api_keys_file.as_deref().zip(text.as_deref());
        let keys = Arc::new(ApiKeys::new(args.api_key.as_deref(), file, args.api_key_max_concurrent)?);
        let micros = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(1);
        Ok(AppState {
            inner: Arc::new(Inner {
                model,
                dispatch,
                admit: AdmitConfig {
                    event_buffer: args.event_buffer,
                    queue_capacity: args.max_queued_requests,
                    retry_after_secs: args.retry_after_secs,
                    timeouts: args.timeouts(),
                },
                limits: Limits { max_choices: args.max_choices.max(1) },
                keys,
                max_body_bytes: args.max_body_bytes,
                ids: IdSource::new(micros),
                metrics: m::prometheus_handle(),
                started_unix: unix_now(),
            }),
            ready: None,
        })
    }

    /// The same state whose /health follows `ready` (e.g. the router's "at least one
    /// prefill-capable and one decode-capable node" signal). Call before serving.
    pub fn with_readiness(self, ready: watch::Receiver<Readiness>) -> Self {
        AppState { ready: Some(ready), ..self }
    }

    pub fn model(&self) -> &ModelInfo {
        &self.inner.model
    }
}

/// Parses a JSON body with OpenAI-shaped errors (axum's `Json` rejection is plain text).
pub(crate) fn parse_json<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, CoordinatorError> {
    let bytes = body.map_err(|e| CoordinatorError::BodyRejected {
        too_large: e.status() == StatusCode::PAYLOAD_TOO_LARGE,
        reason: e.body_text(),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| CoordinatorError::MalformedJson { reason: e.to_string() })
}

pub(crate) fn check_model(state: &AppState, requested: Option<&String>) -> Result<(), CoordinatorError> {
    match requested {
        Some(r) if *r != state.inner.model.name => {
            Err(CoordinatorError::UnknownModel { requested: r.clone(), served: state.inner.model.name.clone() })
        }
        _ => Ok(()),
    }
}
