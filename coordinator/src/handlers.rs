//! `POST /v1/completions` and `POST /v1/chat/completions`: parse, validate, admit, then
//! answer with one JSON body or an SSE stream. Both endpoints share every step; only the
//! validation entry point and the response shapes differ.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};

use crate::api::{ChatRequest, CompletionRequest};
use crate::dispatch::Route;
use crate::error::CoordinatorError;
use crate::generate::{admit, ChoiceUpdate, Generation};
use crate::metrics as m;
use crate::model::ModelInfo;
use crate::respond::{full_response, Body, ChoiceAcc, ChunkWriter, ResponseMeta, UsageTally};
use crate::state::{parse_json, unix_now, AppState};
use crate::validate::{validate_chat, validate_completion, Endpoint, Limits, ValidRequest};

pub async fn completions(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let req: CompletionRequest = parse_json(body)?;
        let valid = off_runtime(&state, move |model, limits| validate_completion(req, model, limits)).await?;
        generate(&state, valid).await
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn chat_completions(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let req: ChatRequest = parse_json(body)?;
        let valid = off_runtime(&state, move |model, limits| validate_chat(req, model, limits)).await?;
        generate(&state, valid).await
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

/// Runs validation (tokenization, template rendering: CPU work proportional to the prompt)
/// on the blocking pool, so that a long prompt does not stall other requests' streams.
async fn off_runtime<F>(state: &AppState, f: F) -> Result<ValidRequest, CoordinatorError>
where
    F: FnOnce(&ModelInfo, Limits) -> Result<ValidRequest, CoordinatorError> + Send + 'static,
{
    let model = state.inner.model.clone();
    let limits = state.inner.limits;
    tokio::task::spawn_blocking(move || f(&model, limits))
        .await
        .map_err(|e| CoordinatorError::Internal { reason: format!("validation task failed: {e}") })?
}

/// Counts a request as running from admission until dropped (end of body or disconnect).
struct Running;

impl Running {
    fn start() -> Self {
        ::metrics::gauge!(m::REQUESTS_RUNNING).increment(1.0);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        ::metrics::gauge!(m::REQUESTS_RUNNING).decrement(1.0);
    }
}

async fn generate(state: &AppState, valid: ValidRequest) -> Result<Response, CoordinatorError> {
    let inner = &state.inner;
    let gen = admit(&valid, &inner.model.tokenizer, &inner.dispatch, &inner.ids, inner.admit)?;
    let running = Running::start();
    let queued = inner.dispatch.max_capacity().saturating_sub(inner.dispatch.capacity());
    ::metrics::gauge!(m::QUEUE_DEPTH).set(queued as f64);
    let prompt_tokens: usize = valid.prompts.iter().map(|p| p.ids.len()).sum();
    ::metrics::counter!(m::PROMPT_TOKENS_TOTAL).increment(prompt_tokens as u64);
    let prefix = match valid.endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let meta = ResponseMeta {
        id: format!("{prefix}-{:016x}", gen.id.0),
        created: unix_now(),
        model: valid.model.clone(),
        endpoint: valid.endpoint,
        logprobs: valid.params.logprobs.is_some(),
        tool_format: valid.tool_format,
    };
    tracing::debug!(request_id = %gen.id, choices = valid.num_choices(), prompt_tokens, stream = valid.stream, "admitted");
    if valid.stream {
        stream_response(state.clone(), gen, meta, valid.include_usage, running).await
    } else {
        full(state, gen, meta, running).await
    }
}

async fn full(
    state: &AppState,
    mut gen: Generation,
    meta: ResponseMeta,
    _running: Running,
) -> Result<Response, CoordinatorError> {
    let choices = gen.prompt_lens.len() * gen.n as usize;
    let mut accs = vec![ChoiceAcc::default(); choices];
    let mut routes: Vec<Option<Route>> = vec![None; choices];
    let mut tally = UsageTally::new(gen.prompt_lens.clone(), gen.n);
    while let Some(item) = gen.next().await {
        let mut update = item?;
        tally.record(&update);
        if let (Some(r), Some(slot)) = (update.route.take(), routes.get_mut(update.index as usize)) {
            *slot = Some(r);
        }
        if let Some(acc) = accs.get_mut(update.index as usize) {
            acc.push(update);
        }
    }
    let body = full_response(&meta, &state.inner.model.tokenizer, accs, tally.usage());
    let mut response = Json(body).into_response();
    set_route_header(&mut response, routes.iter().flatten());
    Ok(response)
}

/// `x-cleave-route`: how each choice was served, in choice order (the last route of a choice
/// that migrated), comma-separated; absent when the router said nothing.
fn set_route_header<'a>(response: &mut Response, routes: impl Iterator<Item = &'a Route>) {
    let value = routes.map(Route::header_value).collect::<Vec<_>>().join(", ");
    if value.is_empty() {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&value) {
        response.headers_mut().insert(ROUTE_HEADER, v);
    }
}

/// The response header that says how a request was served (see [`Route::header_value`]).
pub const ROUTE_HEADER: &str = "x-cleave-route";

fn sse_json(body: &Body) -> Event {
    Event::default().json_data(body).unwrap_or_else(|_| Event::default().data("{}"))
}

fn sse_done() -> Event {
    Event::default().data("[DONE]")
}

/// What the SSE body stream carries between polls.
struct SseState {
    gen: Generation,
    writer: ChunkWriter,
    tally: UsageTally,
    state: AppState,
    include_usage: bool,
    done: bool,
    _running: Running,
}

impl SseState {
    fn on_update(&mut self, u: &ChoiceUpdate) -> Vec<Event> {
        self.tally.record(u);
        self.writer.chunk(&self.state.inner.model.tokenizer, u).map(|b| sse_json(&b)).into_iter().collect()
    }

    fn finish(&mut self) -> Vec<Event> {
        self.done = true;
        let mut events = Vec::new();
        if self.include_usage {
            events.push(sse_json(&self.writer.usage_chunk(self.tally.usage())));
        }
        events.push(sse_done());
        events
    }
}

/// Waits for the first update before answering, so that a request no node can serve (or
/// that times out before its first token) gets a real HTTP status; after that, errors are
/// sent as an SSE `{"error": ...}` event followed by `[DONE]`.
async fn stream_response(
    state: AppState,
    mut gen: Generation,
    meta: ResponseMeta,
    include_usage: bool,
    running: Running,
) -> Result<Response, CoordinatorError> {
    let mut first = match gen.next().await {
        Some(Err(e)) => return Err(e),
        other => other,
    };
    // The header can only say how the first choice to produce a token is served: the others
    // (n > 1) are routed while the body streams.
    let route = match &mut first {
        Some(Ok(u)) => u.route.take(),
        _ => None,
    };
    let choices = gen.prompt_lens.len() * gen.n as usize;
    let writer = ChunkWriter::new(meta, choices);
    let tally = UsageTally::new(gen.prompt_lens.clone(), gen.n);
    let mut st = SseState { gen, writer, tally, state, include_usage, done: false, _running: running };
    let mut initial: Vec<Event> = st.writer.openers().iter().map(sse_json).collect();
    match first {
        Some(Ok(u)) => initial.extend(st.on_update(&u)),
        _ => initial.extend(st.finish()),
    }
    let rest = stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let events = match st.gen.next().await {
            Some(Ok(u)) => st.on_update(&u),
            Some(Err(e)) => {
                st.done = true;
                vec![sse_json_error(&e), sse_done()]
            }
            None => st.finish(),
        };
        Some((events, st))
    });
    let events = stream::iter(initial).chain(rest.flat_map(stream::iter)).map(Ok::<_, Infallible>);
    let mut response = Sse::new(events).keep_alive(KeepAlive::default()).into_response();
    set_route_header(&mut response, route.iter());
    Ok(response)
}

fn sse_json_error(e: &CoordinatorError) -> Event {
    tracing::warn!(error = %e, "stream failed");
    Event::default().json_data(e.to_response_body()).unwrap_or_else(|_| Event::default().data("{}"))
}
