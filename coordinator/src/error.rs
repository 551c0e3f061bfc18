//! The crate's one error type, and the one place where HTTP status codes are chosen
//! (`impl IntoResponse for CoordinatorError`). Everything else returns a variant with the
//! facts in its fields.

use std::path::PathBuf;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cleave_protocol::RequestId;
use cleave_tokenizer::TokenizerError;
use serde::Serialize;

/// Everything that can go wrong in the coordinator, from loading the model folder to a
/// request the router could not serve.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// No model folder was given.
    #[error("no model folder given (--model)")]
    NoModel,
    /// config.json or generation_config.json is unreadable or not the JSON we expect.
    #[error("invalid model config {path}: {reason}")]
    ModelConfig { path: PathBuf, reason: String },
    /// Loading the tokenizer, encoding or decoding failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The listener failed.
    #[error("serving HTTP failed: {0}")]
    Serve(#[source] std::io::Error),
    /// The request body is not the JSON this endpoint expects.
    #[error("malformed request body: {reason}")]
    MalformedJson { reason: String },
    /// The request body could not be read (too large, connection broke).
    #[error("request body rejected: {reason}")]
    BodyRejected { reason: String, too_large: bool },
    /// A parameter is missing or out of range.
    #[error("invalid parameter `{param}`: {message}")]
    InvalidParam { param: String, message: String },
    /// The request names a model this coordinator does not serve.
    #[error("model {requested:?} does not exist; this server serves {served:?}")]
    UnknownModel { requested: String, served: String },
    /// The chat template refused the conversation (e.g. a role the model does not support).
    #[error("the chat template rejected the messages: {message}")]
    ChatTemplate { message: String },
    /// Prompt plus requested completion do not fit the model's context.
    #[error(
        "this model's maximum context length is {context_len} tokens; the request has {prompt_tokens} prompt \
         tokens and asks for {max_tokens} completion tokens"
    )]
    ContextLength { prompt_tokens: usize, max_tokens: u32, context_len: u32 },
    /// Missing or wrong `Authorization: Bearer` key.
    #[error("invalid or missing API key")]
    Unauthorized,
    /// The API key already has its most requests in flight.
    #[error("API key {key:?} has {limit} requests in flight, its limit; retry when one ends")]
    KeyLimit { key: String, limit: u32 },
    /// `--tls-cert` / `--tls-key` cannot be used.
    #[error("edge TLS: {reason}")]
    EdgeTls { reason: String },
    /// `--api-keys-file` cannot be used.
    #[error("api keys file {path}: {reason}")]
    KeysFile { path: String, reason: String },
    /// The admission queue is full.
    #[error("the server is at capacity ({capacity} queued requests); retry after {retry_after_secs} s")]
    QueueFull { capacity: usize, retry_after_secs: u32 },
    /// The router has stopped (shutting down).
    #[error("the request router is not running")]
    RouterGone,
    /// No node can serve the request (the router said so).
    #[error("no node can serve the request: {reason}")]
    Unavailable { request_id: RequestId, reason: String },
    /// The node serving the request reported an error.
    #[error("{request_id} failed: {reason}")]
    BackendFailed { request_id: RequestId, reason: String },
    /// The router dropped the request's event stream without a final event.
    #[error("{request_id}: the router dropped the request after {tokens} tokens")]
    BackendGone { request_id: RequestId, tokens: u32 },
    /// No event arrived in time.
    #[error("{request_id}: no token event within {waited_ms} ms (after {tokens} tokens)")]
    Timeout { request_id: RequestId, waited_ms: u64, tokens: u32 },
    /// A bug or a panicked helper task; the message says which.
    #[error("internal error: {reason}")]
    Internal { reason: String },
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The router is not ready (no node registered yet, or shutting down).
    #[error("not ready: {reason}")]
    NotReady { reason: String },
    /// No such route.
    #[error("no route for {path}")]
    NotFound { path: String },
    /// Missing or wrong admin token (`Authorization: Bearer`), or no admin token configured.
    #[error("{reason}")]
    AdminUnauthorized { reason: &'static str },
    /// An admin operation on a node that cannot be done (unknown node, leaving, bad budget).
    #[error(transparent)]
    NodeOp(#[from] crate::cluster::registry::NodeOpError),
    /// A planner setting refused.
    #[error("invalid planner setting: {0}")]
    Planner(String),
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

impl CoordinatorError {
    /// The HTTP status of this error. The only place statuses are chosen.
    pub fn status(&self) -> StatusCode {
        use CoordinatorError as E;
        match self {
            E::MalformedJson { .. }
            | E::InvalidParam { .. }
            | E::UnknownModel { .. }
            | E::ChatTemplate { .. }
            | E::ContextLength { .. } => StatusCode::BAD_REQUEST,
            E::BodyRejected { too_large: true, .. } => StatusCode::PAYLOAD_TOO_LARGE,
            E::BodyRejected { too_large: false, .. } => StatusCode::BAD_REQUEST,
            E::Unauthorized | E::AdminUnauthorized { .. } => StatusCode::UNAUTHORIZED,
            E::NodeOp(crate::cluster::registry::NodeOpError::UnknownNode(_)) => StatusCode::NOT_FOUND,
            E::NodeOp(
                crate::cluster::registry::NodeOpError::Leaving { .. }
                | crate::cluster::registry::NodeOpError::RoleNotAllowed { .. },
            ) => StatusCode::CONFLICT,
            E::NodeOp(crate::cluster::registry::NodeOpError::BadStepBudget { .. }) | E::Planner(_) => {
                StatusCode::BAD_REQUEST
            }
            E::NodeOp(crate::cluster::registry::NodeOpError::ShuttingDown) => StatusCode::SERVICE_UNAVAILABLE,
            E::NotFound { .. } => StatusCode::NOT_FOUND,
            E::QueueFull { .. } | E::KeyLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            E::RouterGone | E::Unavailable { .. } | E::NotReady { .. } => StatusCode::SERVICE_UNAVAILABLE,
            E::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            E::NoModel
            | E::Internal { .. }
            | E::Bind { .. }
            | E::KeysFile { .. }
            | E::EdgeTls { .. }
            | E::ModelConfig { .. }
            | E::Tokenizer(_)
            | E::Serve(_)
            | E::BackendFailed { .. }
            | E::BackendGone { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI-shaped body of this error.
    pub fn to_response_body(&self) -> ErrorResponse {
        use CoordinatorError as E;
        let kind = match self.status() {
            StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND | StatusCode::PAYLOAD_TOO_LARGE | StatusCode::CONFLICT => {
                "invalid_request_error"
            }
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            _ => "server_error",
        };
        let (param, code) = match self {
            E::InvalidParam { param, .. } => (Some(param.clone()), None),
            E::UnknownModel { .. } => (Some("model".to_owned()), Some("model_not_found")),
            E::ContextLength { .. } => (Some("max_tokens".to_owned()), Some("context_length_exceeded")),
            E::ChatTemplate { .. } => (Some("messages".to_owned()), None),
            E::Unauthorized => (None, Some("invalid_api_key")),
            E::QueueFull { .. } | E::KeyLimit { .. } => (None, Some("rate_limit_exceeded")),
            E::Timeout { .. } => (None, Some("timeout")),
            _ => (None, None),
        };
        ErrorResponse {
            error: ErrorBody { message: self.to_string(), kind: kind.to_owned(), param, code: code.map(str::to_owned) },
        }
    }
}

impl IntoResponse for CoordinatorError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(error = %self, status = status.as_u16(), "request failed");
        } else {
            tracing::debug!(error = %self, status = status.as_u16(), "request refused");
        }
        let mut response = (status, Json(self.to_response_body())).into_response();
        let headers = response.headers_mut();
        match &self {
            CoordinatorError::QueueFull { retry_after_secs, .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_secs));
            }
            // Nothing was generated (no node could take it now, or SLO admission shed it):
            // the same request may succeed a moment later.
            CoordinatorError::KeyLimit { .. } | CoordinatorError::Unavailable { .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            CoordinatorError::Unauthorized | CoordinatorError::AdminUnauthorized { .. } => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_statuses() {
        let e = CoordinatorError::QueueFull { capacity: 3, retry_after_secs: 2 };
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let e = CoordinatorError::InvalidParam { param: "top_p".into(), message: "x".into() };
        let b = e.to_response_body();
        assert_eq!((b.error.kind.as_str(), b.error.param.as_deref()), ("invalid_request_error", Some("top_p")));
        let json = serde_json::to_value(&b).unwrap();
        assert!(json["error"]["code"].is_null());
        assert_eq!(json["error"]["type"], "invalid_request_error");
    }

    /// The OpenAPI document lists every error `type` (clients and the soak check answers
    /// against it): a status mapped to a new type must be documented there too.
    #[test]
    fn every_error_type_is_in_the_openapi_document() {
        use crate::cluster::registry::NodeOpError;
        let doc: serde_json::Value = serde_json::from_str(crate::server::OPENAPI).unwrap();
        let documented: Vec<&str> = doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["type"]
            ["enum"]
            .as_array()
            .expect("Error.type has an enum")
            .iter()
            .filter_map(serde_json::Value::as_str)
            .collect();
        let id = RequestId(1);
        let errors = [
            CoordinatorError::MalformedJson { reason: String::new() },
            CoordinatorError::BodyRejected { reason: String::new(), too_large: true },
            CoordinatorError::Unauthorized,
            CoordinatorError::NodeOp(NodeOpError::UnknownNode(1)),
            CoordinatorError::NodeOp(NodeOpError::ShuttingDown),
            CoordinatorError::QueueFull { capacity: 1, retry_after_secs: 1 },
            CoordinatorError::Unavailable { request_id: id, reason: String::new() },
            CoordinatorError::Timeout { request_id: id, waited_ms: 1, tokens: 0 },
            CoordinatorError::BackendFailed { request_id: id, reason: String::new() },
            CoordinatorError::Internal { reason: String::new() },
        ];
        let mut seen = Vec::new();
        for e in &errors {
            let kind = e.to_response_body().error.kind;
            assert!(documented.contains(&kind.as_str()), "{e}: type {kind} is not in openapi.json's enum");
            seen.push(kind);
        }
        // Every documented type is one some error has (the list is not padded).
        for d in &documented {
            assert!(seen.iter().any(|k| k == d), "openapi.json documents the type {d}, which no error has");
        }
    }
}
