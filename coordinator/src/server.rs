//! The axum application: routes, middleware (API key, x-request-id, request metrics) and the
//! small endpoints (/health, /metrics, /v1/models, /tokenize, /detokenize). The state the
//! handlers share is [`crate::state`]; the generation endpoints live in [`crate::handlers`].

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::net::TcpListener;

use crate::api::{DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse};
use crate::config::CoordinatorArgs;
use crate::edge::EdgeListener;
use crate::error::CoordinatorError;
use crate::handlers;
use crate::keys::KeyGuard;
use crate::metrics as m;
use crate::state::{check_model, parse_json};
pub use crate::state::{AppState, Readiness};
use crate::validate::chat_prompt_ids;

/// The `x-request-id` header, accepted and echoed.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The application's routes with their middleware.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(state.inner.max_body_bytes))
        .layer(middleware::from_fn(request_id_and_metrics))
        .with_state(state)
}

/// Binds `args.listen` (use port 0 in tests and read the address back from the listener).
pub async fn bind(args: &CoordinatorArgs) -> Result<TcpListener, CoordinatorError> {
    TcpListener::bind(args.listen).await.map_err(|source| CoordinatorError::Bind { addr: args.listen, source })
}

/// Serves `router(state)` on an already-bound listener until the listener fails.
pub async fn serve(listener: EdgeListener, state: AppState) -> Result<(), CoordinatorError> {
    tracing::info!(addr = %listener.local_addr_or_unspecified(), tls = listener.is_tls(), model = %state.inner.model.name, "coordinator HTTP edge listening");
    axum::serve(listener, router(state)).await.map_err(CoordinatorError::Serve)
}

/// Like [`serve`], stopping gracefully (in-flight requests finish) when `shutdown` resolves.
pub async fn serve_with_shutdown(
    listener: EdgeListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CoordinatorError> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await.map_err(CoordinatorError::Serve)
}

/// Admits an API request under its key (when keys are required): 401 without a known key, 429
/// past the key's concurrent-request limit. The key's place is held until the response body
/// is done (a stream until its end) and given back when it is dropped (a client that left).
async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let keys = &state.inner.keys;
    if !keys.required() {
        return next.run(req).await;
    }
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let guard = match keys.admit(bearer) {
        Ok(g) => g,
        Err(e) => {
            if let CoordinatorError::KeyLimit { key, .. } = &e {
                tracing::Span::current().record("key", key.as_str());
                ::metrics::counter!(crate::keys::metric::REQUESTS_TOTAL, "key" => key.clone(), "status" => "429")
                    .increment(1);
            }
            return e.into_response();
        }
    };
    tracing::Span::current().record("key", guard.name());
    let response = next.run(req).await;
    let labels = [("key", guard.name().to_owned()), ("status", response.status().as_str().to_owned())];
    ::metrics::counter!(crate::keys::metric::REQUESTS_TOTAL, &labels).increment(1);
    response.map(|body| axum::body::Body::new(Held { body, _guard: guard }))
}

/// A response body that holds its request's place under its API key until it ends or drops.
struct Held {
    body: axum::body::Body,
    _guard: KeyGuard,
}

impl axum::body::HttpBody for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Echoes `x-request-id`, counts responses by endpoint and status, and opens the request's
/// tracing span.
async fn request_id_and_metrics(req: Request, next: Next) -> Response {
    let request_id = req.headers().get(&X_REQUEST_ID).cloned();
    let endpoint = endpoint_label(req.uri().path());
    let span = tracing::debug_span!(
        "http",
        endpoint,
        request_id = ?request_id.as_ref().and_then(|v| v.to_str().ok()),
        key = tracing::field::Empty
    );
    let mut response = tracing::Instrument::instrument(next.run(req), span).await;
    if let Some(id) = request_id {
        response.headers_mut().insert(X_REQUEST_ID.clone(), id);
    }
    ::metrics::counter!(m::HTTP_REQUESTS_TOTAL, "endpoint" => endpoint, "status" => response.status().as_str().to_owned())
        .increment(1);
    response
}

/// A fixed label per route (unknown paths share one, so clients cannot grow the registry).
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "completions",
        "/v1/chat/completions" => "chat_completions",
        "/v1/models" => "models",
        "/tokenize" => "tokenize",
        "/detokenize" => "detokenize",
        "/health" => "health",
        "/metrics" => "metrics",
        _ => "other",
    }
}

async fn health(State(state): State<AppState>) -> Result<StatusCode, CoordinatorError> {
    match state.ready.as_ref().map(|r| r.borrow().clone()) {
        None | Some(Ok(())) => Ok(StatusCode::OK),
        Some(Err(reason)) => Err(CoordinatorError::NotReady { reason }),
    }
}

async fn not_found(uri: Uri) -> CoordinatorError {
    CoordinatorError::NotFound { path: uri.path().to_owned() }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let text = match &state.inner.metrics {
        Some(h) => {
            h.run_upkeep();
            h.render()
        }
        None => String::new(),
    };
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"))], text).into_response()
}

/// The OpenAPI document of the public and admin API (kept true by `tests/openapi.rs`).
pub const OPENAPI: &str = include_str!("../openapi.json");

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], OPENAPI).into_response()
}

async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let model = &state.inner.model;
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: model.name.clone(),
            object: "model".into(),
            created: state.inner.started_unix,
            owned_by: "cleave".into(),
            max_model_len: model.context_len,
        }],
    })
}

async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TokenizeResponse>, CoordinatorError> {
    let req: TokenizeRequest = parse_json(body)?;
    check_model(&state, req.model.as_ref())?;
    let model = &state.inner.model;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => model.tokenizer.encode(&prompt, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(messages)) => chat_prompt_ids(model, &messages, req.add_generation_prompt.unwrap_or(true))?,
        _ => {
            return Err(CoordinatorError::InvalidParam {
                param: "prompt".into(),
                message: "give exactly one of `prompt` and `messages`".into(),
            })
        }
    };
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: model.context_len, tokens }))
}

async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DetokenizeResponse>, CoordinatorError> {
    let req: DetokenizeRequest = parse_json(body)?;
    check_model(&state, req.model.as_ref())?;
    let model = &state.inner.model;
    let vocab = model.tokenizer.vocab_size();
    if let Some(bad) = req.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(CoordinatorError::InvalidParam {
            param: "tokens".into(),
            message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
        });
    }
    Ok(Json(DetokenizeResponse { prompt: model.tokenizer.decode(&req.tokens, true)? }))
}
