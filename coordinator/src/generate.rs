//! From admitted dispatches to a stream of per-choice updates.
//!
//! [`ChoiceState`] is the sans-IO core: it turns the router's token events for one choice
//! into released text (incremental detokenization, then stop strings) and a finish reason.
//! [`admit`] sends the dispatches; [`Generation`] merges the choices' event streams with
//! every wait bounded by a timeout, and cancels everything it started when dropped (client
//! gone) unless it ran to completion.
//!
//! Invariants: a choice yields at most one update with `finish` set and nothing after it;
//! the concatenation of a choice's `text`s is `decode(prompt + tokens)[decode(prompt).len()..]`
//! truncated before the first stop string.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cleave_protocol::{FinishReason, Logprobs, RequestId, StopConditions, TokenEvent};
use cleave_tokenizer::{IncrementalDecoder, StopMatcher, Tokenizer};
use futures::stream::{self, SelectAll, Stream, StreamExt};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::config::Timeouts;
use crate::dispatch::{Dispatch, DispatchEvent, DispatchSender, Route};
use crate::error::CoordinatorError;
use crate::metrics as m;
use crate::validate::{Endpoint, ValidRequest};

/// One generated token as the response layer needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    pub id: u32,
    pub logprobs: Option<Logprobs>,
    /// Text the detokenizer produced for this token, before stop strings (for offsets).
    pub piece_len: usize,
}

/// What one event changed for one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceUpdate {
    pub index: u32,
    /// Text that became final (may be empty).
    pub text: String,
    /// The token this event carried, if any (at most one).
    pub token: Option<TokenOut>,
    pub finish: Option<FinishReason>,
    /// Prompt tokens the node served from its prefix cache (highest reported so far).
    pub cached_tokens: u32,
    /// How the choice is served, on the first update after the router said so (and again after
    /// it changed: a migration).
    pub route: Option<Route>,
}

/// Sans-IO detokenization and stop-string state of one choice.
#[derive(Debug)]
pub struct ChoiceState {
    index: u32,
    request_id: RequestId,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    completion_tokens: u32,
    cached_tokens: u32,
    finished: bool,
    /// The router sent its final event (so there is nothing to cancel).
    router_finished: bool,
    /// The router's latest [`Route`], and whether an update has carried it yet.
    route: Option<Route>,
    route_told: bool,
}

impl ChoiceState {
    pub fn new(index: u32, request_id: RequestId, tokenizer: &Tokenizer, prompt: &[u32], stops: &[String]) -> Self {
        ChoiceState {
            index,
            request_id,
            decoder: IncrementalDecoder::new(tokenizer.clone(), prompt),
            stop: StopMatcher::new(stops.iter().cloned()),
            completion_tokens: 0,
            cached_tokens: 0,
            finished: false,
            router_finished: false,
            route: None,
            route_told: false,
        }
    }

    /// The router's latest word on how this choice is served.
    pub fn route(&self) -> Option<&Route> {
        self.route.as_ref()
    }

    /// Records a [`DispatchEvent::Routed`]; the next update with a token carries it.
    pub fn on_route(&mut self, route: Route) {
        self.route = Some(route);
        self.route_told = false;
    }

    pub fn completion_tokens(&self) -> u32 {
        self.completion_tokens
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Finished before the router did (a stop string, or a failure): the dispatch must be
    /// cancelled so that the node frees the sequence.
    pub fn needs_cancel(&self) -> bool {
        self.finished && !self.router_finished
    }

    /// Applies one event. A stop string ends the choice with [`FinishReason::Stop`] even
    /// though the router has not finished (the caller cancels the dispatch). Events after
    /// the end are ignored (empty update).
    pub fn on_event(&mut self, event: DispatchEvent) -> Result<ChoiceUpdate, CoordinatorError> {
        let mut update = ChoiceUpdate {
            index: self.index,
            text: String::new(),
            token: None,
            finish: None,
            cached_tokens: self.cached_tokens,
            route: None,
        };
        if self.finished {
            return Ok(update);
        }
        let ev: TokenEvent = match event {
            DispatchEvent::Token(ev) => ev,
            DispatchEvent::Routed(r) => {
                self.on_route(r);
                return Ok(update);
            }
            DispatchEvent::Refused { reason } => {
                self.finished = true;
                return Err(if self.completion_tokens == 0 {
                    CoordinatorError::Unavailable { request_id: self.request_id, reason }
                } else {
                    CoordinatorError::BackendFailed { request_id: self.request_id, reason }
                });
            }
        };
        self.router_finished = ev.finish_reason.is_some();
        self.cached_tokens = self.cached_tokens.max(ev.cached_tokens);
        update.cached_tokens = self.cached_tokens;
        if ev.finish_reason == Some(FinishReason::Error) {
            self.finished = true;
            let reason = ev.error.unwrap_or_else(|| "the node reported an error".to_owned());
            return Err(CoordinatorError::BackendFailed { request_id: self.request_id, reason });
        }
        if let Some(id) = ev.token_id {
            if !self.route_told {
                self.route_told = true;
                update.route = self.route.clone();
            }
            self.completion_tokens += 1;
            let piece = self.decoder.push(id)?;
            update.token = Some(TokenOut { id, logprobs: ev.logprobs, piece_len: piece.len() });
            let out = self.stop.push(&piece);
            update.text = out.emit;
            if out.stopped {
                self.finished = true;
                update.finish = Some(FinishReason::Stop);
                return Ok(update);
            }
        }
        if let Some(reason) = ev.finish_reason {
            self.finished = true;
            let tail = self.decoder.finish()?;
            let out = self.stop.push(&tail);
            update.text.push_str(&out.emit);
            if out.stopped {
                update.finish = Some(FinishReason::Stop);
            } else {
                update.text.push_str(&self.stop.flush());
                update.finish = Some(reason);
            }
        }
        Ok(update)
    }
}

/// Allocates request ids: unique within one coordinator run, and unlikely to repeat across
/// restarts (the counter starts at the start time in microseconds).
#[derive(Debug)]
pub struct IdSource(AtomicU64);

impl IdSource {
    pub fn new(start: u64) -> Self {
        IdSource(AtomicU64::new(start))
    }
    pub fn next(&self) -> RequestId {
        RequestId(self.0.fetch_add(1, Ordering::Relaxed))
    }
}

/// How [`admit`] builds dispatches.
#[derive(Debug, Clone, Copy)]
pub struct AdmitConfig {
    pub event_buffer: usize,
    pub queue_capacity: usize,
    pub retry_after_secs: u32,
    pub timeouts: Timeouts,
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<ChoiceUpdate, CoordinatorError>> + Send>>;

/// The running choices of one request, merged. Dropping it cancels every dispatch that has
/// not finished.
pub struct Generation {
    /// First request id of the request (the response's id).
    pub id: RequestId,
    /// Prompt length of each prompt.
    pub prompt_lens: Vec<u32>,
    pub n: u32,
    pub endpoint: Endpoint,
    merged: SelectAll<UpdateStream>,
    guard: Option<DropGuard>,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation").field("id", &self.id).field("choices", &self.merged.len()).finish()
    }
}

impl Generation {
    /// The next update of any choice; `None` once every choice has finished, after which
    /// the dispatches are left alone (they ended by themselves).
    pub async fn next(&mut self) -> Option<Result<ChoiceUpdate, CoordinatorError>> {
        let item = self.merged.next().await;
        match &item {
            None => {
                if let Some(g) = self.guard.take() {
                    g.disarm();
                }
            }
            Some(Err(_)) => {
                // One failed choice fails the request: stop the others now.
                self.guard.take();
            }
            Some(Ok(_)) => {}
        }
        item
    }

    /// Into a stream of updates (same semantics as [`Generation::next`]).
    pub fn into_stream(self) -> impl Stream<Item = Result<ChoiceUpdate, CoordinatorError>> + Send {
        stream::unfold(self, |mut g| async move { g.next().await.map(|item| (item, g)) })
    }
}

/// Sends one dispatch per choice. On a full queue or a stopped router, the dispatches
/// already sent are cancelled and nothing is left running.
pub fn admit(
    req: &ValidRequest,
    tokenizer: &Tokenizer,
    sender: &DispatchSender,
    ids: &IdSource,
    cfg: AdmitConfig,
) -> Result<Generation, CoordinatorError> {
    let parent = CancellationToken::new();
    let guard = parent.clone().drop_guard();
    let mut merged = SelectAll::new();
    let mut first_id = None;
    for (p, prompt) in req.prompts.iter().enumerate() {
        for j in 0..req.n {
            let id = ids.next();
            first_id.get_or_insert(id);
            let index = p as u32 * req.n + j;
            let cancel = parent.child_token();
            let (tx, rx) = mpsc::channel(cfg.event_buffer.max(1));
            let mut params = req.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(u64::from(j)));
            let stop = StopConditions {
                max_tokens: prompt.max_tokens,
                stop_strings: Vec::new(),
                stop_token_ids: req.stop.stop_token_ids.clone(),
                ignore_eos: req.stop.ignore_eos,
            };
            let dispatch =
                Dispatch { id, prompt: prompt.ids.clone(), params, stop, events: tx, cancel: cancel.clone() };
            sender.try_send(dispatch).map_err(|e| match e {
                TrySendError::Full(_) => {
                    ::metrics::counter!(m::ADMISSION_REJECTED_TOTAL).increment(1);
                    CoordinatorError::QueueFull { capacity: cfg.queue_capacity, retry_after_secs: cfg.retry_after_secs }
                }
                TrySendError::Closed(_) => CoordinatorError::RouterGone,
            })?;
            let state = ChoiceState::new(index, id, tokenizer, &prompt.ids, &req.stop.stop_strings);
            merged.push(choice_stream(state, rx, cancel, cfg.timeouts));
        }
    }
    Ok(Generation {
        id: first_id.unwrap_or(RequestId(0)),
        prompt_lens: req.prompts.iter().map(|p| p.ids.len() as u32).collect(),
        n: req.n,
        endpoint: req.endpoint,
        merged,
        guard: Some(guard),
    })
}

struct ChoiceTask {
    state: ChoiceState,
    rx: mpsc::Receiver<DispatchEvent>,
    cancel: CancellationToken,
    timeouts: Timeouts,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    done: bool,
}

/// One choice's updates, each wait bounded (first token, then between tokens).
fn choice_stream(
    state: ChoiceState,
    rx: mpsc::Receiver<DispatchEvent>,
    cancel: CancellationToken,
    timeouts: Timeouts,
) -> UpdateStream {
    let task = ChoiceTask {
        state,
        rx,
        cancel,
        timeouts,
        started: Instant::now(),
        first_token: None,
        last_token: None,
        done: false,
    };
    Box::pin(stream::unfold(task, |mut t| async move {
        if t.done {
            return None;
        }
        let wait: Duration =
            if t.state.completion_tokens() == 0 { t.timeouts.first_token } else { t.timeouts.inter_token };
        let deadline = tokio::time::Instant::now() + wait;
        // Route events change no text: read on until a token event (or the end), within the
        // same deadline.
        let result = loop {
            match tokio::time::timeout_at(deadline, t.rx.recv()).await {
                Ok(Some(DispatchEvent::Routed(r))) => t.state.on_route(r),
                Ok(Some(event)) => break t.state.on_event(event),
                Ok(None) => {
                    break Err(CoordinatorError::BackendGone {
                        request_id: t.state.request_id,
                        tokens: t.state.completion_tokens(),
                    })
                }
                Err(_) => {
                    break Err(CoordinatorError::Timeout {
                        request_id: t.state.request_id,
                        waited_ms: wait.as_millis() as u64,
                        tokens: t.state.completion_tokens(),
                    })
                }
            }
        };
        // `local_reason`: why a `local` request prefilled on its decode node; `none` otherwise.
        let (path, local_reason, first_pool, decode_pool) = match t.state.route() {
            Some(r) => (r.path, r.reason.unwrap_or("none"), r.first_token_pool(), r.decode_pool),
            None => ("unknown", "none", "unknown", "unknown"),
        };
        match &result {
            Ok(update) => {
                if update.token.is_some() {
                    let now = Instant::now();
                    match t.last_token {
                        None => {
                            ::metrics::histogram!(m::TIME_TO_FIRST_TOKEN_SECONDS, "pool" => first_pool, "path" => path, "local_reason" => local_reason)
                                .record(now.duration_since(t.started).as_secs_f64())
                        }
                        Some(last) => {
                            ::metrics::histogram!(m::INTER_TOKEN_LATENCY_SECONDS, "pool" => decode_pool, "path" => path, "local_reason" => local_reason)
                                .record(now.duration_since(last).as_secs_f64())
                        }
                    }
                    t.first_token.get_or_insert(now);
                    t.last_token = Some(now);
                    ::metrics::counter!(m::GENERATION_TOKENS_TOTAL).increment(1);
                }
                if update.finish.is_some() {
                    t.done = true;
                    if t.state.needs_cancel() {
                        // A stop string matched while the node is still generating.
                        t.cancel.cancel();
                    }
                    let e2e = t.started.elapsed();
                    ::metrics::histogram!(m::E2E_LATENCY_SECONDS, "pool" => decode_pool, "path" => path, "local_reason" => local_reason)
                        .record(e2e.as_secs_f64());
                    let n = t.state.completion_tokens();
                    if let (Some(first), Some(last)) = (t.first_token, t.last_token) {
                        if n > 1 {
                            let decode = last.duration_since(first).as_secs_f64();
                            ::metrics::histogram!(m::TIME_PER_OUTPUT_TOKEN_SECONDS, "pool" => decode_pool, "path" => path, "local_reason" => local_reason)
                                .record(decode / f64::from(n - 1));
                        }
                    }
                    if e2e >= t.timeouts.slow_request {
                        let ttft_ms = t.first_token.map(|f| f.duration_since(t.started).as_millis() as u64);
                        tracing::info!(
                            request_id = %t.state.request_id,
                            route = t.state.route().map(Route::header_value).unwrap_or_default(),
                            ttft_ms,
                            e2e_ms = e2e.as_millis() as u64,
                            tokens = n,
                            "slow request"
                        );
                    }
                }
            }
            Err(e) => {
                t.done = true;
                t.cancel.cancel();
                ::metrics::counter!(m::REQUEST_FAILURES_TOTAL, "reason" => failure_label(e), "path" => path)
                    .increment(1);
            }
        }
        Some((result, t))
    }))
}

fn failure_label(e: &CoordinatorError) -> &'static str {
    match e {
        CoordinatorError::Timeout { .. } => "timeout",
        CoordinatorError::Unavailable { .. } => "unavailable",
        CoordinatorError::BackendGone { .. } => "router_dropped",
        _ => "backend_error",
    }
}
