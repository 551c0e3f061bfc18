//! The sans-IO core of one request's journey through the cluster: plan, prefill on one node, KV
//! handoff, decode on another, and what happens when a node fails along the way. The thin async
//! shell that carries out its [`Action`]s and feeds it [`Event`]s is [`super::request`].
//!
//! No tokio, no sockets, no clock: every input carries `now`, every output is an [`Action`].
//! Tracing stays in here (it is not I/O; the shell runs the machine inside the request's span).
//!
//! Attempts: each attempt asks the registry for a [`Plan`] and books load on the chosen nodes
//! (returned when the attempt ends). Outcomes:
//! - the stream finished (or the client went away, or cancelled): done;
//! - the prefill node failed before the first token: exclude it and try again — another prefill
//!   node, or a local prefill on a decode node — invisibly to the client, at most
//!   `max_prefill_retries` times;
//! - the decode node failed before the first token: the same, counted as a prefill retry; a node
//!   that said so itself (an error event, e.g. no blocks) is not excluded and, since it may be
//!   chosen again while it still frees the failed attempt's reservation, the next attempt waits
//!   [`RETRY_BACKOFF`] times the retry's number;
//! - the decode node failed after the first token (its stream broke, went silent, or ended with
//!   an error, including a failed handoff): migrate — another decode node prefills the prompt
//!   plus every token already sent and continues the same stream, at most `max_migrations`
//!   times; after that the stream ends with an error event. A stream whose every token was sent
//!   ends with [`FinishReason::Length`] instead of another attempt.
//!
//! The decode request and the prefill request go out together; the decode node's ticket is
//! forwarded to the prefill node when it arrives, so the lease costs no serial round trip before
//! the prefill starts. Decode events that overtake the prefill node's first token (separate
//! streams) are held and sent right after it, in arrival order. While no node can take the
//! request only because nodes switch roles, the request is held (asking again every
//! [`HOLD_POLL`], up to [`HOLD_LIMIT`]) instead of refused.
//!
//! Invariants (checked on every test of `attempt/tests.rs`):
//! - an attempt's booking leaves the machine exactly once: its prefill part in at most one
//!   [`Action::ReleasePrefill`] (the prefill node's part is over while the stream goes on), the
//!   rest in exactly one [`Action::Release`], after [`Action::CloseStreams`] and before the next
//!   [`Action::Plan`] or [`Action::Finish`];
//! - [`Action::Emit`], [`Action::Plan`] and [`Action::Open`] are the last action of their batch,
//!   and the shell answers each ([`Event::Delivered`]/[`Event::ClientGone`], [`Event::Planned`],
//!   [`Event::Opened`]) before any other event but [`Event::Cancelled`];
//! - the client hears, per attempt, one `Routed` first; then tokens in generation order; then at
//!   most one final event (or one `Refused` instead of anything else, only when no token was
//!   sent: the edge answers 503, naming an earlier attempt's failure if there was one); nothing after [`Action::Finish`], which ends every run exactly once;
//! - while the machine waits on the outside world (streams, a backoff, a hold), it has a
//!   [`Journey::deadline`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use cleave_protocol::control::{ControlMsg, DecodeRequest, PrefillRequest, Work};
use cleave_protocol::{FinishReason, TokenEvent};

use super::registry::{Assignment, LocalReason, NoRoute, NodeRef, Plan, RouteQuery, Wait};
use super::Observation;
use crate::dispatch::{DispatchEvent, Route};

mod vocab;

pub use vocab::*;

/// Pause before retrying on a decode node that failed an attempt but lives, times the retry's
/// number.
pub const RETRY_BACKOFF: Duration = Duration::from_millis(100);
/// How long a request is held at the edge while no node can take it yet: nodes are switching
/// roles (a switch that drains streams lasts as long as the longest of them), or every decode
/// node's KV cache is too full for its handoff (running streams free blocks as they finish).
/// Past it the request is refused (503: nothing was sent, the client may retry).
pub const HOLD_LIMIT: Duration = Duration::from_secs(60);
/// How often a held request asks again.
pub const HOLD_POLL: Duration = Duration::from_millis(50);

/// What the shell does with an [`Action::Emit`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// A decode node's event sent straight on.
    Decode { last: bool },
    /// The prefill node's first token.
    First { last: bool },
    /// A held decode event sent after the first token.
    Early { last: bool },
}

#[derive(Debug)]
struct Hold {
    query: RouteQuery,
    /// Until when a transient "no route" holds the request.
    deadline: Instant,
    /// Until when it may wait for a seat (SLO admission), from the first time it was told to.
    seat_deadline: Option<Instant>,
    /// The hold was counted.
    held: bool,
}

impl Hold {
    /// The hold's query asked again, with the time waited so far.
    fn ask(&self, now: Instant, started: Instant) -> RouteQuery {
        RouteQuery { waited: now.saturating_duration_since(started), ..self.query.clone() }
    }

    /// Until when a "no route" that says `wait` holds the request: the hold's limit, or for a
    /// seat the wait SLO admission allows from the first time it was told to wait for one.
    fn until(&mut self, wait: Wait, now: Instant) -> Instant {
        match wait {
            Wait::Seats { max_wait } => {
                let deadline = self.deadline;
                deadline.min(*self.seat_deadline.get_or_insert_with(|| now.checked_add(max_wait).unwrap_or(deadline)))
            }
            Wait::Switch | Wait::DecodeKv => self.deadline,
        }
    }
}

#[derive(Debug)]
enum Phase {
    /// [`Action::Plan`] is out.
    Planning(Hold),
    /// No node can take the request while nodes switch roles: ask again at `until`.
    Holding {
        hold: Hold,
        until: Instant,
    },
    /// [`Action::Open`] is out.
    Opening,
    /// The streams are open: reading node messages.
    Running,
    /// [`Action::Emit`] is out.
    Delivering(Delivery),
    /// A decode node failed before the first token but lives: the next attempt starts at `until`.
    Backoff {
        until: Instant,
    },
    Done,
}

/// The attempt under way. Present exactly in the phases `Opening`, `Running`, `Delivering`.
#[derive(Debug)]
struct Attempt {
    decode: NodeRef,
    remote: Option<Remote>,
    booking: Assignment,
    /// When its streams were asked for.
    started: Instant,
    /// When the machine last went back to reading its streams: the silence timer runs from here.
    active_at: Instant,
}

/// The prefill side of a remote attempt.
#[derive(Debug)]
struct Remote {
    prefill: NodeRef,
    /// Opening both streams took this long.
    dispatched: Duration,
    /// The prefill stream is read (until its handoff report, its error, or its end).
    prefill_open: bool,
    /// When the prefill node's first token arrived.
    first_at: Option<Instant>,
    /// Decode events that overtook the first token.
    early: VecDeque<TokenEvent>,
    /// A decode event arrived after the first token: the decode node has the KV it needed.
    first_step_recorded: bool,
    /// The prefill node said how its handoff ended (its report, or an error event after the
    /// first token, which the decode node's lease hears of too).
    handoff_settled: bool,
}

/// How an attempt ended.
enum Outcome {
    /// Final event delivered, the client is gone, or the request was cancelled.
    Finished,
    /// The prefill node failed before the first token.
    PrefillFailed { node: NodeRef, cause: AttemptError },
    /// The decode node failed; tokens sent so far stay sent. `alive`: it said so itself, so it
    /// may serve the retry.
    DecodeFailed { node: NodeRef, cause: AttemptError, alive: bool },
    /// The prefill node died after its first token, before its handoff was settled and before
    /// the decode node showed it had the KV: the stream migrates (tokens sent stay sent).
    HandoffLost { node: NodeRef, cause: AttemptError },
}

/// One request, from its first plan to its final event.
#[derive(Debug)]
pub struct Journey {
    work: Work,
    limits: Limits,
    started: Instant,
    phase: Phase,
    attempt: Option<Attempt>,
    cancelled: bool,
    // What the client has received so far.
    generated: Vec<u32>,
    cached_tokens: u32,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// How the last attempt was routed (`remote`, or the local reason).
    path: &'static str,
    /// The request ended with an error event (or was refused).
    failed: bool,
    // Across attempts.
    exclude: Vec<u64>,
    prefill_retries: u32,
    migrations: u32,
    last_error: Option<NodeFailure>,
}

impl Journey {
    /// A request that arrived at `now`; [`Journey::start`] gives its first actions.
    pub fn new(work: Work, limits: Limits, now: Instant) -> Self {
        Self {
            work,
            limits,
            started: now,
            phase: Phase::Done,
            attempt: None,
            cancelled: false,
            generated: Vec::new(),
            cached_tokens: 0,
            first_token_at: None,
            last_token_at: None,
            path: "none",
            failed: false,
            exclude: Vec::new(),
            prefill_retries: 0,
            migrations: 0,
            last_error: None,
        }
    }

    pub fn start(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        self.next_attempt(now, &mut out);
        out
    }

    /// [`Action::Finish`] was given.
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// When to feed [`Event::Timer`] (the silence timeout of a running attempt, the end of a
    /// backoff, the next ask of a hold).
    pub fn deadline(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Running => self.attempt.as_ref().map(|a| a.active_at + self.limits.node_silence_timeout),
            Phase::Holding { until, .. } | Phase::Backoff { until } => Some(*until),
            _ => None,
        }
    }

    /// Whether the shell should read that stream of the attempt now (and listen for deaths).
    pub fn reading(&self, side: Side) -> bool {
        if !matches!(self.phase, Phase::Running) {
            return false;
        }
        match (side, &self.attempt) {
            (Side::Decode, Some(_)) => true,
            (Side::Prefill, Some(a)) => a.remote.as_ref().is_some_and(|r| r.prefill_open),
            (_, None) => false,
        }
    }

    /// What the client experienced, for the planner, once the request is over (`cancelled`: the
    /// edge's token as the request ends). `None` for a client that left before its first token
    /// (it tells nothing about latency).
    pub fn completion(&self, now: Instant, cancelled: bool) -> Option<Observation> {
        let n = self.generated.len() as u32;
        let ttft = match self.first_token_at {
            Some(f) => f.duration_since(self.started),
            None if self.failed => now.duration_since(self.started),
            None => return None,
        };
        let tpot = match (self.first_token_at, self.last_token_at) {
            (Some(f), Some(l)) if n > 1 => Some(l.duration_since(f) / (n - 1)),
            _ => None,
        };
        Some(Observation::Completion {
            ttft,
            tpot,
            output_tokens: n,
            max_tokens: self.work.stop.max_tokens,
            ok: !self.failed || cancelled,
            path: self.path,
        })
    }

    /// Feeds one event; returns what to do, in order.
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Planned(r) => self.on_planned(now, r, &mut out),
            Event::Opened { decode, prefill } => self.on_opened(now, decode, prefill, &mut out),
            Event::Message { side, msg } if matches!(self.phase, Phase::Running) => match side {
                Side::Decode => self.on_decode(now, msg, &mut out),
                Side::Prefill => self.on_prefill(now, msg, &mut out),
            },
            Event::Lost { side, cause } if matches!(self.phase, Phase::Running) => {
                self.on_lost(now, side, cause, &mut out)
            }
            Event::TicketNotSent => self.on_ticket_not_sent(now, &mut out),
            Event::Delivered => self.on_delivery(now, true, &mut out),
            Event::ClientGone => self.on_delivery(now, false, &mut out),
            Event::NodeDied(id) if matches!(self.phase, Phase::Running) => self.on_died(now, id, &mut out),
            Event::Cancelled => self.on_cancelled(now, &mut out),
            Event::Timer => self.on_timer(now, &mut out),
            other => tracing::trace!(event = ?other, "ignored outside a running attempt"),
        }
        out
    }

    // ---- Between attempts --------------------------------------------------------------------

    /// The top of the retry loop: stop, end the stream, or ask for a plan.
    fn next_attempt(&mut self, now: Instant, out: &mut Vec<Action>) {
        if self.cancelled {
            return self.finish(out);
        }
        let max_tokens = self.work.stop.max_tokens as usize;
        if self.generated.len() >= max_tokens {
            // Every token was sent but the node died before saying so: end it here.
            let ev = TokenEvent {
                cached_tokens: self.cached_tokens,
                ..TokenEvent::last(self.work.id, FinishReason::Length, self.prompt_tokens(), self.sent())
            };
            out.push(Action::Tell(DispatchEvent::Token(ev)));
            return self.finish(out);
        }
        let query = RouteQuery {
            tokens: [&self.work.prompt[..], &self.generated[..]].concat(),
            max_tokens: max_tokens - self.generated.len(),
            exclude: self.exclude.clone(),
            force_local: !self.generated.is_empty(),
            waited: now.saturating_duration_since(self.started),
        };
        out.push(Action::Plan(query.clone()));
        self.phase = Phase::Planning(Hold { query, deadline: now + HOLD_LIMIT, seat_deadline: None, held: false });
    }

    fn on_planned(&mut self, now: Instant, r: Result<(Plan, Assignment), NoRoute>, out: &mut Vec<Action>) {
        let Phase::Planning(mut hold) = std::mem::replace(&mut self.phase, Phase::Done) else {
            unreachable_answer(&mut self.phase, "Planned");
            return;
        };
        match r {
            Ok((plan, booking)) => self.begin(now, plan, booking, out),
            Err(NoRoute { wait: Some(wait), reason, .. }) if now < hold.until(wait, now) && !self.cancelled => {
                if !hold.held {
                    hold.held = true;
                    out.push(Action::Record(match wait {
                        Wait::Switch => Metric::HeldForSwitch,
                        Wait::DecodeKv => Metric::HeldForDecodeKv,
                        Wait::Seats { .. } => Metric::HeldForSeat,
                    }));
                    tracing::debug!(%reason, "no node can take the request yet; holding it");
                }
                self.phase = Phase::Holding { hold, until: now + HOLD_POLL };
            }
            Err(e) => {
                self.failed = true;
                if (e.shed || matches!(e.wait, Some(Wait::Seats { .. }))) && !self.cancelled {
                    out.push(Action::Record(Metric::Shed));
                }
                // Nothing sent yet: the edge answers 503 (a client may retry), naming the
                // earlier attempt's failure too when there was one.
                match self.last_error.take() {
                    None if self.generated.is_empty() => {
                        // The edge's 503 says "no node can serve the request" itself.
                        out.push(Action::Tell(DispatchEvent::Refused { reason: e.reason }));
                        self.finish(out);
                    }
                    Some(last) if self.generated.is_empty() => {
                        let reason = RequestError::NoRouteAfter { last, no_route: e }.to_string();
                        out.push(Action::Tell(DispatchEvent::Refused { reason }));
                        self.finish(out);
                    }
                    None => self.fail(RequestError::NoRoute(e), out),
                    Some(last) => self.fail(RequestError::NoRouteAfter { last, no_route: e }, out),
                }
            }
        }
    }

    /// Starts an attempt on a plan: tell the edge, open the streams.
    fn begin(&mut self, now: Instant, plan: Plan, booking: Assignment, out: &mut Vec<Action>) {
        // The edge labels latencies with this and tells the client.
        out.push(Action::Tell(DispatchEvent::Routed(route_of(&plan))));
        let work = self.work.clone();
        let (decode, remote) = match plan {
            Plan::Remote { prefill, decode } => {
                out.push(Action::Record(Metric::RouteDecision { path: "remote", reason: "long_prompt" }));
                tracing::debug!(prefill = %prefill.name, decode = %decode.name, "remote prefill");
                self.path = "remote";
                let dmsg = DecodeRequest { work: work.clone(), local_prefill: false, generated: Vec::new() };
                let pmsg = PrefillRequest { work, ticket: None };
                out.push(Action::Open(Box::new(Streams {
                    decode: (decode.clone(), ControlMsg::DecodeRequest(dmsg)),
                    prefill: Some((prefill.clone(), ControlMsg::PrefillRequest(pmsg))),
                })));
                let remote = Remote {
                    prefill,
                    dispatched: Duration::ZERO,
                    prefill_open: true,
                    first_at: None,
                    early: VecDeque::new(),
                    first_step_recorded: false,
                    handoff_settled: false,
                };
                (decode, Some(remote))
            }
            Plan::Local { decode, reason } => {
                out.push(Action::Record(Metric::RouteDecision { path: "local", reason: reason.as_str() }));
                tracing::debug!(decode = %decode.name, reason = reason.as_str(), "local prefill");
                self.path = reason.as_str();
                let dmsg = DecodeRequest { work, local_prefill: true, generated: self.generated.clone() };
                let decode_req = (decode.clone(), ControlMsg::DecodeRequest(dmsg));
                out.push(Action::Open(Box::new(Streams { decode: decode_req, prefill: None })));
                (decode, None)
            }
        };
        self.attempt = Some(Attempt { decode, remote, booking, started: now, active_at: now });
        self.phase = Phase::Opening;
    }

    /// Ends the attempt under way: drop its streams, return its booking, then decide.
    fn end(&mut self, now: Instant, outcome: Outcome, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.take() else { return };
        out.push(Action::CloseStreams);
        out.push(Action::Release(a.booking));
        match outcome {
            Outcome::Finished => self.finish(out),
            Outcome::PrefillFailed { node, cause } => {
                tracing::warn!(node = %node.name, error = %cause, "prefill failed before the first token; retrying");
                out.push(Action::Record(Metric::PrefillRetry { node: node.name.clone() }));
                self.exclude.push(node.id);
                let last = NodeFailure { side: Side::Prefill, node: node.name, cause };
                self.prefill_retries += 1;
                if self.prefill_retries > self.limits.max_prefill_retries {
                    return self.fail(RequestError::PrefillAttempts { attempts: self.prefill_retries, last }, out);
                }
                self.last_error = Some(last);
                self.next_attempt(now, out);
            }
            Outcome::DecodeFailed { node, cause, alive } => {
                if !alive {
                    self.exclude.push(node.id);
                }
                let last = NodeFailure { side: Side::Decode, node: node.name.clone(), cause };
                if self.generated.is_empty() {
                    // Nothing was sent yet: a plain retry elsewhere, like a failed prefill.
                    self.prefill_retries += 1;
                    if self.prefill_retries > self.limits.max_prefill_retries {
                        return self.fail(RequestError::Attempts { attempts: self.prefill_retries, last }, out);
                    }
                    tracing::warn!(node = %node.name, error = %last.cause, "decode node failed before the first token; retrying");
                    self.last_error = Some(last);
                    if alive {
                        if self.cancelled {
                            return self.finish(out);
                        }
                        // The same node may be chosen again while it still holds the failed
                        // attempt's reservation (it frees it when it sees that attempt's stream
                        // close): give it a moment, longer at each retry.
                        self.phase = Phase::Backoff { until: now + RETRY_BACKOFF * self.prefill_retries };
                        return;
                    }
                    return self.next_attempt(now, out);
                }
                self.migrate(now, last, out);
            }
            Outcome::HandoffLost { node, cause } => {
                self.exclude.push(node.id);
                self.migrate(now, NodeFailure { side: Side::Prefill, node: node.name, cause }, out);
            }
        }
    }

    /// Continues a stream whose tokens so far were sent, on a new attempt, after `last`.
    fn migrate(&mut self, now: Instant, last: NodeFailure, out: &mut Vec<Action>) {
        self.migrations += 1;
        out.push(Action::Record(Metric::Migration { node: last.node.clone() }));
        if self.migrations > self.limits.max_migrations {
            let migrations = self.migrations - 1;
            return self.fail(RequestError::Migrations { migrations, last }, out);
        }
        tracing::warn!(node = %last.node, side = %last.side, error = %last.cause, sent = self.generated.len(), "node failed; migrating the stream");
        self.last_error = Some(last);
        self.next_attempt(now, out);
    }

    fn fail(&mut self, error: RequestError, out: &mut Vec<Action>) {
        tracing::warn!(%error, "request failed");
        self.failed = true;
        let ev = TokenEvent {
            cached_tokens: self.cached_tokens,
            ..TokenEvent::failed(self.work.id, self.prompt_tokens(), self.sent(), error.to_string())
        };
        out.push(Action::Tell(DispatchEvent::Token(ev)));
        self.finish(out);
    }

    fn finish(&mut self, out: &mut Vec<Action>) {
        self.phase = Phase::Done;
        out.push(Action::Finish);
    }

    // ---- A running attempt -------------------------------------------------------------------

    fn on_opened(
        &mut self,
        now: Instant,
        decode: Result<(), AttemptError>,
        prefill: Option<Result<(), AttemptError>>,
        out: &mut Vec<Action>,
    ) {
        if !matches!(self.phase, Phase::Opening) {
            return unreachable_answer(&mut self.phase, "Opened");
        }
        let Some(a) = self.attempt.as_mut() else { return };
        if let Err(cause) = decode {
            let node = a.decode.clone();
            return self.end(now, Outcome::DecodeFailed { node, cause, alive: false }, out);
        }
        if let Some(r) = a.remote.as_mut() {
            if let Some(Err(cause)) = prefill {
                let node = r.prefill.clone();
                return self.end(now, Outcome::PrefillFailed { node, cause }, out);
            }
            r.dispatched = now.saturating_duration_since(a.started);
        }
        self.resume(now, out);
    }

    /// Back to reading the streams (the silence timer restarts); a cancellation told meanwhile
    /// takes effect here.
    fn resume(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.phase = Phase::Running;
        let Some(a) = self.attempt.as_mut() else { return };
        a.active_at = now;
        if self.cancelled {
            self.cancel_attempt(now, out);
        }
    }

    fn cancel_attempt(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.as_ref() else { return };
        out.push(Action::Cancel(Side::Decode));
        if a.remote.as_ref().is_some_and(|r| r.prefill_open) {
            out.push(Action::Cancel(Side::Prefill));
        }
        self.end(now, Outcome::Finished, out);
    }

    fn on_decode(&mut self, now: Instant, msg: ControlMsg, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.as_mut() else { return };
        match msg {
            ControlMsg::Ticket(t) if a.remote.is_some() => {
                let waited = now.saturating_duration_since(a.started);
                out.push(Action::Record(Metric::Reservation { node: a.decode.name.clone(), waited }));
                if a.remote.as_ref().is_some_and(|r| r.prefill_open) {
                    out.push(Action::ForwardTicket(t));
                }
                self.resume(now, out);
            }
            ControlMsg::Token(ev) => {
                if let Some(message) = node_error(&ev) {
                    // Before the first token (e.g. no blocks) the request is retried; after
                    // it, the stream migrates.
                    let node = a.decode.clone();
                    let cause = AttemptError::NodeError { message };
                    return self.end(now, Outcome::DecodeFailed { node, cause, alive: true }, out);
                }
                if let Some(r) = a.remote.as_mut() {
                    match r.first_at {
                        None => {
                            r.early.push_back(ev);
                            return self.resume(now, out);
                        }
                        Some(f) if !r.first_step_recorded => {
                            r.first_step_recorded = true;
                            let after = now.saturating_duration_since(f);
                            out.push(Action::Record(Metric::DecodeFirstStep { node: a.decode.name.clone(), after }));
                        }
                        Some(_) => {}
                    }
                }
                let last = ev.finish_reason.is_some();
                self.emit(now, ev, Delivery::Decode { last }, out);
            }
            other => {
                tracing::debug!(message = other.name(), "ignored from decode node");
                self.resume(now, out);
            }
        }
    }

    fn on_prefill(&mut self, now: Instant, msg: ControlMsg, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.as_mut() else { return };
        let Some(r) = a.remote.as_mut().filter(|r| r.prefill_open) else {
            tracing::debug!(message = msg.name(), "ignored from a prefill stream no longer read");
            return;
        };
        match msg {
            ControlMsg::Token(ev) => {
                if let Some(message) = node_error(&ev) {
                    let cause = AttemptError::NodeError { message };
                    if r.first_at.is_none() {
                        let node = r.prefill.clone();
                        return self.end(now, Outcome::PrefillFailed { node, cause }, out);
                    }
                    tracing::debug!(error = %cause, "prefill node failed after the first token");
                    r.prefill_open = false;
                    r.handoff_settled = true;
                    release_prefill(&mut a.booking, out);
                    return self.resume(now, out);
                }
                if r.first_at.is_some() {
                    tracing::debug!("second token event from the prefill node ignored");
                    return self.resume(now, out);
                }
                r.first_at = Some(now);
                let last = ev.finish_reason.is_some();
                self.emit(now, ev, Delivery::First { last }, out);
            }
            ControlMsg::HandoffDone(report) => {
                out.push(Action::Handoff { report, node: r.prefill.clone(), dispatched: r.dispatched });
                r.prefill_open = false;
                r.handoff_settled = true;
                // The prefill node's part is over (a drain of it need not wait for the stream's
                // decode).
                release_prefill(&mut a.booking, out);
                self.resume(now, out);
            }
            other => {
                tracing::debug!(message = other.name(), "ignored from prefill node");
                self.resume(now, out);
            }
        }
    }

    fn on_lost(&mut self, now: Instant, side: Side, cause: AttemptError, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.as_mut() else { return };
        match side {
            Side::Decode => {
                let node = a.decode.clone();
                self.end(now, Outcome::DecodeFailed { node, cause, alive: false }, out);
            }
            Side::Prefill => {
                let Some(r) = a.remote.as_mut().filter(|r| r.prefill_open) else { return };
                r.prefill_open = false;
                release_prefill(&mut a.booking, out);
                if r.first_at.is_none() {
                    let node = r.prefill.clone();
                    return self.end(now, Outcome::PrefillFailed { node, cause }, out);
                }
                // After the first token: the decode node learns of a broken handoff from its
                // lease and fails the request, which migrates it.
                tracing::debug!(error = %cause, "prefill stream ended after the first token");
                self.resume(now, out);
            }
        }
    }

    fn on_ticket_not_sent(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.as_ref() else { return };
        let Some(r) = a.remote.as_ref() else { return };
        if r.first_at.is_none() {
            let node = r.prefill.clone();
            self.end(now, Outcome::PrefillFailed { node, cause: AttemptError::TicketNotSent }, out);
        }
    }

    /// A node of the registry died; only the attempt's decode node, or its prefill node while
    /// the first token is still to come or its handoff unsettled, matters (a death elsewhere
    /// does not restart the silence timer).
    ///
    /// A prefill node that dies after the first token may have sent all of the KV (its report
    /// lost with it) or none: the decode node cannot tell the second case from a slow sender
    /// until its lease expires (a minute), when no transfer connection was open to break. So
    /// unless the decode node has already produced a token (it had the KV), the stream migrates
    /// now; at worst that re-prefills a prompt whose handoff had in fact completed.
    fn on_died(&mut self, now: Instant, id: u64, out: &mut Vec<Action>) {
        let Some(a) = self.attempt.as_ref() else { return };
        if id == a.decode.id {
            let node = a.decode.clone();
            return self.end(now, Outcome::DecodeFailed { node, cause: AttemptError::NodeDied, alive: false }, out);
        }
        let Some(r) = a.remote.as_ref().filter(|r| r.prefill.id == id) else { return };
        let node = r.prefill.clone();
        let cause = AttemptError::NodeDied;
        if r.prefill_open && r.first_at.is_none() {
            self.end(now, Outcome::PrefillFailed { node, cause }, out);
        } else if r.first_at.is_some() && !r.handoff_settled && !r.first_step_recorded {
            self.end(now, Outcome::HandoffLost { node, cause }, out);
        }
    }

    fn on_cancelled(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.cancelled = true;
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Running => {
                self.phase = Phase::Running;
                self.cancel_attempt(now, out);
            }
            // A held request asks once more (and is refused unless a node can take it now).
            Phase::Holding { hold, .. } => {
                out.push(Action::Plan(hold.ask(now, self.started)));
                self.phase = Phase::Planning(hold);
            }
            Phase::Backoff { .. } => self.finish(out),
            // Answers are out: the cancellation takes effect at the next decision.
            phase => self.phase = phase,
        }
    }

    fn on_timer(&mut self, now: Instant, out: &mut Vec<Action>) {
        if self.deadline().is_none_or(|d| now < d) {
            return;
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Holding { hold, .. } => {
                out.push(Action::Plan(hold.ask(now, self.started)));
                self.phase = Phase::Planning(hold);
            }
            Phase::Backoff { .. } => self.next_attempt(now, out),
            Phase::Running => {
                self.phase = Phase::Running;
                let Some(a) = self.attempt.as_mut() else { return };
                let cause = AttemptError::Silent { silence: self.limits.node_silence_timeout };
                // Both streams were silent as long. Before the first token the prefill node is
                // the one owing it (the decode node waits for its KV); after it, the decode node.
                match a.remote.as_mut().filter(|r| r.prefill_open && r.first_at.is_none()) {
                    Some(r) => {
                        r.prefill_open = false;
                        let node = r.prefill.clone();
                        release_prefill(&mut a.booking, out);
                        self.end(now, Outcome::PrefillFailed { node, cause }, out);
                    }
                    None => {
                        let node = a.decode.clone();
                        self.end(now, Outcome::DecodeFailed { node, cause, alive: false }, out);
                    }
                }
            }
            phase => self.phase = phase,
        }
    }

    // ---- Sending to the client ---------------------------------------------------------------

    /// Sends one node event to the client with the request-level counts; the rest waits for the
    /// shell's answer.
    fn emit(&mut self, now: Instant, mut ev: TokenEvent, delivery: Delivery, out: &mut Vec<Action>) {
        if let Some(t) = ev.token_id {
            self.generated.push(t);
            self.last_token_at = Some(now);
            if self.first_token_at.is_none() {
                self.first_token_at = Some(now);
                self.cached_tokens = ev.cached_tokens;
            }
        }
        if ev.finish_reason == Some(FinishReason::Error) {
            self.failed = true;
        }
        ev.request_id = self.work.id;
        ev.prompt_tokens = self.prompt_tokens();
        ev.cached_tokens = self.cached_tokens;
        ev.completion_tokens = self.sent();
        out.push(Action::Emit(ev));
        self.phase = Phase::Delivering(delivery);
    }

    fn on_delivery(&mut self, now: Instant, delivered: bool, out: &mut Vec<Action>) {
        let Phase::Delivering(delivery) = self.phase else {
            return unreachable_answer(&mut self.phase, "delivery");
        };
        match delivery {
            Delivery::Decode { last } => {
                if delivered && !last {
                    return self.resume(now, out);
                }
                if last {
                    self.report_later(out);
                }
                self.end(now, Outcome::Finished, out);
            }
            Delivery::First { last: true } if delivered => {
                // The first token ended the request: the decode side's lease is cancelled when
                // its stream drops.
                out.push(Action::Cancel(Side::Decode));
                self.end(now, Outcome::Finished, out);
            }
            Delivery::First { last: false } | Delivery::Early { last: false } if delivered => self.flush(now, out),
            Delivery::Early { last: true } => {
                // Every decode event overtook the first token, and the prefill node's report
                // follows the first token: it has not been read yet.
                self.report_later(out);
                self.end(now, Outcome::Finished, out)
            }
            Delivery::First { .. } | Delivery::Early { .. } => self.end(now, Outcome::Finished, out),
        }
    }

    /// The output ended with the handoff's report still to come: read it after the end (before
    /// [`Action::CloseStreams`]), so that the handoff metrics count every handoff.
    fn report_later(&self, out: &mut Vec<Action>) {
        if let Some(r) = self.attempt.as_ref().and_then(|a| a.remote.as_ref()).filter(|r| r.prefill_open) {
            out.push(Action::ReportLater { node: r.prefill.clone(), dispatched: r.dispatched });
        }
    }

    /// Sends the next held decode event, or goes back to reading.
    fn flush(&mut self, now: Instant, out: &mut Vec<Action>) {
        let next = self.attempt.as_mut().and_then(|a| a.remote.as_mut()).and_then(|r| r.early.pop_front());
        match next {
            Some(ev) => {
                let last = ev.finish_reason.is_some();
                self.emit(now, ev, Delivery::Early { last }, out);
            }
            None => self.resume(now, out),
        }
    }

    fn prompt_tokens(&self) -> u32 {
        self.work.prompt.len() as u32
    }

    fn sent(&self) -> u32 {
        self.generated.len() as u32
    }
}

/// An answer fed in a phase that asked for none: the shell broke the contract. Ignored (the
/// phase is kept).
fn unreachable_answer(phase: &mut Phase, what: &str) {
    tracing::error!(?phase, what, "answer to no question from the request shell; ignored");
    debug_assert!(false, "{what} answered in phase {phase:?}");
}

/// Moves the booking's prefill part into an [`Action::ReleasePrefill`] (once).
fn release_prefill(booking: &mut Assignment, out: &mut Vec<Action>) {
    if let Some(p) = booking.prefill.take() {
        out.push(Action::ReleasePrefill(Assignment { prefill: Some(p), decode: None, blocks: 0 }));
    }
}

/// A node's final event that is an error means the node failed the request.
fn node_error(ev: &TokenEvent) -> Option<String> {
    (ev.finish_reason == Some(FinishReason::Error)).then(|| ev.error.clone().unwrap_or_else(|| "node error".into()))
}

/// The [`Route`] the edge reports for a plan.
pub fn route_of(plan: &Plan) -> Route {
    let pool = |n: &NodeRef| match n.role {
        cleave_protocol::control::NodeRole::Both => "colocated",
        _ => "decode",
    };
    match plan {
        Plan::Remote { prefill, decode } => Route {
            path: "remote",
            reason: None,
            prefill_node: Some(prefill.name.clone()),
            decode_node: decode.name.clone(),
            decode_pool: pool(decode),
        },
        Plan::Local { decode, reason } => {
            let (path, reason) = match reason {
                LocalReason::Colocated => ("colocated", None),
                LocalReason::Migration => ("migrated", None),
                r => ("local", Some(r.as_str())),
            };
            Route { path, reason, prefill_node: None, decode_node: decode.name.clone(), decode_pool: pool(decode) }
        }
    }
}

#[cfg(test)]
mod tests;
