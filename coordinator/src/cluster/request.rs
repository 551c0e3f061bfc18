//! One request's journey through the cluster: plan, prefill, handoff, decode, and what happens
//! when a node fails along the way.
//!
//! Attempts: each attempt asks the registry for a [`Plan`] and books load on the chosen nodes
//! (returned when the attempt ends). Outcomes:
//! - the stream finished (or the client went away): done;
//! - the prefill node failed before the first token: exclude it and try again — another prefill
//!   node, or a local prefill on a decode node — invisibly to the client, at most
//!   `max_prefill_retries` times;
//! - the decode node failed (its stream broke, went silent, or ended with an error, including a
//!   failed handoff after the first token was sent): migrate — another decode node prefills the
//!   prompt plus every token already sent and continues the same stream, at most
//!   `max_migrations` times; after that the stream ends with an error event.
//!
//! The decode request and the prefill request go out together; the decode node's ticket is
//! forwarded to the prefill node when it arrives, so the lease costs no serial round trip
//! before the prefill starts. Dropping a node stream (any early return here) makes the node
//! cancel the request and free its KV (see the node crates).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_net::{Connector, DuplexStream};
use cleave_protocol::control::{read_msg, write_msg, ControlMsg, DecodeRequest, HandoffDone, PrefillRequest, Work};
use cleave_protocol::{FinishReason, TokenEvent};
use tokio::sync::broadcast;
use tracing::Instrument;

use super::registry::{Assignment, LocalReason, NoRoute, NodeRef, Plan, RouteQuery};
use super::{metric, ClusterConfig, ClusterHandle};
use crate::dispatch::{Dispatch, DispatchEvent, Route};

/// How an attempt ended.
enum Outcome {
    /// Final event delivered, or the client is gone.
    Finished,
    /// The prefill node failed before the first token.
    PrefillFailed { node: NodeRef, error: String },
    /// The decode node failed; tokens sent so far stay sent. `alive`: it said so itself (an
    /// error event, e.g. a broken handoff), so it may serve the retry.
    DecodeFailed { node: NodeRef, error: String, alive: bool },
}

/// What the client has received so far.
struct Progress {
    prompt_tokens: u32,
    cached_tokens: u32,
    generated: Vec<u32>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// How the last attempt was routed (`remote`, or the local reason).
    path: &'static str,
    /// The request ended with an error event (or was refused).
    failed: bool,
}

pub(super) async fn run(d: Dispatch, cluster: ClusterHandle, connector: Arc<Connector>, cfg: Arc<ClusterConfig>) {
    let span = tracing::info_span!("request", request_id = %d.id);
    let started = Instant::now();
    let mut p = Progress {
        prompt_tokens: d.prompt.len() as u32,
        cached_tokens: 0,
        generated: Vec::new(),
        first_token_at: None,
        last_token_at: None,
        path: "none",
        failed: false,
    };
    let cancelled = d.cancel.clone();
    let max_tokens = d.stop.max_tokens;
    drive(d, &mut p, &cluster, connector, cfg).instrument(span).await;
    // What the client experienced, for the planner (a client that left early before its first
    // token tells nothing about latency).
    let n = p.generated.len() as u32;
    let ttft = match p.first_token_at {
        Some(f) => f.duration_since(started),
        None if p.failed => started.elapsed(),
        None => return,
    };
    let tpot = match (p.first_token_at, p.last_token_at) {
        (Some(f), Some(l)) if n > 1 => Some(l.duration_since(f) / (n - 1)),
        _ => None,
    };
    cluster.observe(super::Observation::Completion {
        ttft,
        tpot,
        output_tokens: n,
        max_tokens,
        ok: !p.failed || cancelled.is_cancelled(),
        path: p.path,
    });
}

async fn drive(
    d: Dispatch,
    p: &mut Progress,
    cluster: &ClusterHandle,
    connector: Arc<Connector>,
    cfg: Arc<ClusterConfig>,
) {
    let mut exclude = Vec::new();
    let (mut prefill_retries, mut migrations) = (0u32, 0u32);
    let mut last_error = String::new();
    loop {
        if d.cancel.is_cancelled() {
            return;
        }
        if p.generated.len() >= d.stop.max_tokens as usize {
            // Every token was sent but the node died before saying so: end it here.
            let ev = TokenEvent {
                cached_tokens: p.cached_tokens,
                ..TokenEvent::last(d.id, FinishReason::Length, p.prompt_tokens, p.generated.len() as u32)
            };
            let _ = d.events.send(DispatchEvent::Token(ev)).await;
            return;
        }
        let q = RouteQuery {
            tokens: [&d.prompt[..], &p.generated[..]].concat(),
            max_tokens: d.stop.max_tokens as usize - p.generated.len(),
            exclude: exclude.clone(),
            force_local: !p.generated.is_empty(),
        };
        let (plan, mut booking) = match plan_or_hold(cluster, q, &d).await {
            Ok(x) => x,
            Err(e) => {
                p.failed = true;
                if p.generated.is_empty() && last_error.is_empty() {
                    let _ = d.events.send(DispatchEvent::Refused { reason: e.to_string() }).await;
                } else {
                    let why = if last_error.is_empty() { e.to_string() } else { format!("{last_error}; then {e}") };
                    finish_with_error(&d, p, why).await;
                }
                return;
            }
        };
        let deaths = cluster.deaths();
        // The edge labels latencies with this and tells the client; a closed channel is the
        // client gone, which the attempt notices itself.
        let _ = d.events.send(DispatchEvent::Routed(route_of(&plan))).await;
        let outcome = match plan {
            Plan::Remote { prefill, decode } => {
                metrics::counter!(metric::ROUTE_DECISIONS_TOTAL, "path" => "remote", "reason" => "long_prompt")
                    .increment(1);
                tracing::debug!(prefill = %prefill.name, decode = %decode.name, "remote prefill");
                p.path = "remote";
                let nodes = Pair { prefill, decode };
                remote(&d, p, &connector, &cfg, deaths, nodes, (cluster, &mut booking)).await
            }
            Plan::Local { decode, reason } => {
                metrics::counter!(metric::ROUTE_DECISIONS_TOTAL, "path" => "local", "reason" => reason.as_str())
                    .increment(1);
                tracing::debug!(decode = %decode.name, reason = reason.as_str(), "local prefill");
                p.path = reason.as_str();
                local(&d, p, &connector, &cfg, deaths, decode).await
            }
        };
        cluster.release(booking);
        match outcome {
            Outcome::Finished => return,
            Outcome::PrefillFailed { node, error } => {
                tracing::warn!(node = %node.name, %error, "prefill failed before the first token; retrying");
                metrics::counter!(metric::PREFILL_RETRIES_TOTAL, "node" => node.name.clone()).increment(1);
                last_error = format!("prefill node {}: {error}", node.name);
                exclude.push(node.id);
                prefill_retries += 1;
                if prefill_retries > cfg.max_prefill_retries {
                    finish_with_error(&d, p, format!("gave up after {prefill_retries} prefill attempts: {last_error}"))
                        .await;
                    return;
                }
            }
            Outcome::DecodeFailed { node, error, alive } => {
                last_error = format!("decode node {}: {error}", node.name);
                if !alive {
                    exclude.push(node.id);
                }
                if p.generated.is_empty() {
                    // Nothing was sent yet: a plain retry elsewhere, like a failed prefill.
                    prefill_retries += 1;
                    if prefill_retries > cfg.max_prefill_retries {
                        finish_with_error(&d, p, format!("gave up after {prefill_retries} attempts: {last_error}"))
                            .await;
                        return;
                    }
                    tracing::warn!(node = %node.name, %error, "decode node failed before the first token; retrying");
                    if alive {
                        // The same node may be chosen again while it still holds the failed
                        // attempt's reservation (it frees it when it sees that attempt's stream
                        // close): give it a moment, longer at each retry.
                        tokio::select! {
                            () = tokio::time::sleep(RETRY_BACKOFF * prefill_retries) => {}
                            () = d.cancel.cancelled() => return,
                        }
                    }
                    continue;
                }
                migrations += 1;
                metrics::counter!(metric::MIGRATIONS_TOTAL, "node" => node.name.clone()).increment(1);
                if migrations > cfg.max_migrations {
                    finish_with_error(&d, p, format!("gave up after {} migrations: {last_error}", migrations - 1))
                        .await;
                    return;
                }
                tracing::warn!(node = %node.name, %error, sent = p.generated.len(), "decode node failed; migrating the stream");
            }
        }
    }
}

/// The [`Route`] the edge reports for a plan.
fn route_of(plan: &Plan) -> Route {
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

/// Pause before retrying on a decode node that failed an attempt but lives, times the retry's
/// number.
const RETRY_BACKOFF: Duration = Duration::from_millis(100);

/// How long a request is held at the edge while no node can take it because nodes are switching
/// roles (a switch that drains streams lasts as long as the longest of them).
const HOLD_FOR_SWITCH: Duration = Duration::from_secs(60);
/// How often a held request asks again.
const HOLD_POLL: Duration = Duration::from_millis(50);

/// Routes the request; while no node can take it only because nodes are switching roles, holds
/// it (up to [`HOLD_FOR_SWITCH`], or until the client leaves) instead of failing it: a planned
/// role change must not cost a request.
async fn plan_or_hold(cluster: &ClusterHandle, q: RouteQuery, d: &Dispatch) -> Result<(Plan, Assignment), NoRoute> {
    let deadline = tokio::time::Instant::now() + HOLD_FOR_SWITCH;
    let mut held = false;
    loop {
        match cluster.plan(q.clone()).await {
            Err(e) if e.transient && tokio::time::Instant::now() < deadline && !d.cancel.is_cancelled() => {
                if !held {
                    held = true;
                    metrics::counter!(metric::HELD_FOR_SWITCH_TOTAL).increment(1);
                    tracing::debug!(reason = %e.reason, "no node can take the request while nodes switch roles; holding it");
                }
                tokio::select! {
                    () = tokio::time::sleep(HOLD_POLL) => {}
                    () = d.cancel.cancelled() => {}
                }
            }
            r => return r,
        }
    }
}

fn work(d: &Dispatch) -> Work {
    Work { id: d.id, prompt: d.prompt.clone(), params: d.params.clone(), stop: d.stop.clone() }
}

async fn open(connector: &Connector, node: &NodeRef, msg: &ControlMsg) -> Result<DuplexStream, String> {
    let mut s = connector.open(node.rpc_addr).await.map_err(|e| e.to_string())?;
    write_msg(&mut s.send, msg).await.map_err(|e| e.to_string())?;
    Ok(s)
}

async fn finish_with_error(d: &Dispatch, p: &mut Progress, error: String) {
    tracing::warn!(%error, "request failed");
    p.failed = true;
    let ev = TokenEvent {
        cached_tokens: p.cached_tokens,
        ..TokenEvent::failed(d.id, p.prompt_tokens, p.generated.len() as u32, error)
    };
    let _ = d.events.send(DispatchEvent::Token(ev)).await;
}

/// Delivers one node event to the client with the request-level counts. Returns false when the
/// client is gone.
async fn emit(d: &Dispatch, p: &mut Progress, mut ev: TokenEvent) -> bool {
    if let Some(t) = ev.token_id {
        p.generated.push(t);
        let now = Instant::now();
        p.last_token_at = Some(now);
        if p.first_token_at.is_none() {
            p.first_token_at = Some(now);
            p.cached_tokens = ev.cached_tokens;
        }
    }
    if ev.finish_reason == Some(FinishReason::Error) {
        p.failed = true;
    }
    ev.request_id = d.id;
    ev.prompt_tokens = p.prompt_tokens;
    ev.cached_tokens = p.cached_tokens;
    ev.completion_tokens = p.generated.len() as u32;
    d.events.send(DispatchEvent::Token(ev)).await.is_ok()
}

enum Read {
    Msg(ControlMsg),
    /// The stream ended, broke, or went silent.
    Lost(String),
}

/// A short output can end before the prefill node's handoff report arrives (it follows the
/// receiver's Ack, and the decode node starts at that Ack): read the report in the background,
/// for at most [`REPORT_WAIT`], so that the handoff metrics count every request.
fn report_later(mut ps: DuplexStream, pnode: NodeRef, dispatched: Duration, cluster: ClusterHandle) {
    tokio::spawn(async move {
        loop {
            match next(&mut ps, REPORT_WAIT).await {
                Read::Msg(ControlMsg::HandoffDone(h)) => return record_handoff(&h, &pnode, dispatched, &cluster),
                Read::Msg(_) => {}
                Read::Lost(_) => return,
            }
        }
    });
}

/// How long a finished request's handoff report is waited for.
const REPORT_WAIT: Duration = Duration::from_secs(5);

async fn next(s: &mut DuplexStream, silence: Duration) -> Read {
    match tokio::time::timeout(silence, read_msg(&mut s.recv)).await {
        Ok(Ok(Some(m))) => Read::Msg(m),
        Ok(Ok(None)) => Read::Lost("the node closed the stream".into()),
        Ok(Err(e)) => Read::Lost(e.to_string()),
        Err(_) => Read::Lost(format!("the node sent nothing for {} s", silence.as_secs())),
    }
}

/// A node's final event that is an error means the node failed the request.
fn node_error(ev: &TokenEvent) -> Option<String> {
    (ev.finish_reason == Some(FinishReason::Error)).then(|| ev.error.clone().unwrap_or_else(|| "node error".into()))
}

/// Resolves when `node` is removed from the registry.
async fn died(deaths: &mut broadcast::Receiver<u64>, node: u64) {
    loop {
        match deaths.recv().await {
            Ok(id) if id == node => return,
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

async fn local(
    d: &Dispatch,
    p: &mut Progress,
    connector: &Connector,
    cfg: &ClusterConfig,
    mut deaths: broadcast::Receiver<u64>,
    node: NodeRef,
) -> Outcome {
    let msg =
        ControlMsg::DecodeRequest(DecodeRequest { work: work(d), local_prefill: true, generated: p.generated.clone() });
    let mut s = match open(connector, &node, &msg).await {
        Ok(s) => s,
        Err(error) => return Outcome::DecodeFailed { node, error, alive: false },
    };
    loop {
        tokio::select! {
            () = d.cancel.cancelled() => {
                let _ = write_msg(&mut s.send, &ControlMsg::Cancel(d.id)).await;
                return Outcome::Finished;
            }
            () = died(&mut deaths, node.id) => {
                return Outcome::DecodeFailed { node, error: "the node died".into(), alive: false };
            }
            r = next(&mut s, cfg.node_silence_timeout) => match r {
                Read::Msg(ControlMsg::Token(ev)) => {
                    if let Some(error) = node_error(&ev) {
                        return Outcome::DecodeFailed { node, error, alive: true };
                    }
                    let last = ev.finish_reason.is_some();
                    if !emit(d, p, ev).await || last {
                        return Outcome::Finished;
                    }
                }
                Read::Msg(other) => tracing::debug!(message = other.name(), "ignored from decode node"),
                Read::Lost(error) => return Outcome::DecodeFailed { node, error, alive: false },
            },
        }
    }
}

/// The two nodes of a remote attempt.
struct Pair {
    prefill: NodeRef,
    decode: NodeRef,
}

async fn remote(
    d: &Dispatch,
    p: &mut Progress,
    connector: &Connector,
    cfg: &ClusterConfig,
    mut deaths: broadcast::Receiver<u64>,
    nodes: Pair,
    (cluster, booking): (&ClusterHandle, &mut Assignment),
) -> Outcome {
    let Pair { prefill: pnode, decode: dnode } = nodes;
    let mut pdeaths = deaths.resubscribe();
    let t0 = Instant::now();
    let dmsg = ControlMsg::DecodeRequest(DecodeRequest { work: work(d), local_prefill: false, generated: Vec::new() });
    let pmsg = ControlMsg::PrefillRequest(PrefillRequest { work: work(d), ticket: None });
    let (ds, ps) = tokio::join!(open(connector, &dnode, &dmsg), open(connector, &pnode, &pmsg));
    let mut ds = match ds {
        Ok(s) => s,
        Err(error) => return Outcome::DecodeFailed { node: dnode, error, alive: false },
    };
    let mut ps = match ps {
        Ok(s) => s,
        Err(error) => return Outcome::PrefillFailed { node: pnode, error },
    };
    let dispatched = t0.elapsed();
    let mut prefill_open = true;
    let mut first_at: Option<Instant> = None;
    // Decode events that overtook the prefill node's first token (separate streams).
    let mut early: Vec<TokenEvent> = Vec::new();
    let mut decode_first_step_recorded = false;
    loop {
        tokio::select! {
            () = d.cancel.cancelled() => {
                let _ = write_msg(&mut ds.send, &ControlMsg::Cancel(d.id)).await;
                if prefill_open {
                    let _ = write_msg(&mut ps.send, &ControlMsg::Cancel(d.id)).await;
                }
                return Outcome::Finished;
            }
            () = died(&mut deaths, dnode.id) => {
                return Outcome::DecodeFailed { node: dnode, error: "the node died".into(), alive: false };
            }
            () = died(&mut pdeaths, pnode.id), if prefill_open && first_at.is_none() => {
                return Outcome::PrefillFailed { node: pnode, error: "the node died".into() };
            }
            r = next(&mut ds, cfg.node_silence_timeout) => match r {
                Read::Msg(ControlMsg::Ticket(t)) => {
                    metrics::histogram!(metric::HANDOFF_RESERVATION_SECONDS, "pool" => "decode", "node" => dnode.name.clone())
                        .record(t0.elapsed().as_secs_f64());
                    if prefill_open && write_msg(&mut ps.send, &ControlMsg::Ticket(t)).await.is_err() && first_at.is_none() {
                        return Outcome::PrefillFailed { node: pnode, error: "stream lost while sending the ticket".into() };
                    }
                }
                Read::Msg(ControlMsg::Token(ev)) => {
                    if let Some(error) = node_error(&ev) {
                        // Before the first token (e.g. no blocks) the request is retried;
                        // after it, the stream migrates.
                        return Outcome::DecodeFailed { node: dnode, error, alive: true };
                    }
                    if first_at.is_none() {
                        early.push(ev);
                        continue;
                    }
                    if !decode_first_step_recorded {
                        decode_first_step_recorded = true;
                        if let Some(f) = first_at {
                            metrics::histogram!(metric::HANDOFF_DECODE_FIRST_STEP_SECONDS, "pool" => "decode", "node" => dnode.name.clone())
                                .record(f.elapsed().as_secs_f64());
                        }
                    }
                    let last = ev.finish_reason.is_some();
                    if !emit(d, p, ev).await || last {
                        if last && prefill_open {
                            report_later(ps, pnode, dispatched, cluster.clone());
                        }
                        return Outcome::Finished;
                    }
                }
                Read::Msg(other) => tracing::debug!(message = other.name(), "ignored from decode node"),
                Read::Lost(error) => return Outcome::DecodeFailed { node: dnode, error, alive: false },
            },
            r = next(&mut ps, cfg.node_silence_timeout), if prefill_open => match r {
                Read::Msg(ControlMsg::Token(ev)) => {
                    if let Some(error) = node_error(&ev) {
                        if first_at.is_none() {
                            return Outcome::PrefillFailed { node: pnode, error };
                        }
                        prefill_open = false;
                        cluster.release_prefill(booking);
                        continue;
                    }
                    if first_at.is_some() {
                        tracing::debug!("second token event from the prefill node ignored");
                        continue;
                    }
                    first_at = Some(Instant::now());
                    let last = ev.finish_reason.is_some();
                    if !emit(d, p, ev).await {
                        return Outcome::Finished;
                    }
                    if last {
                        // The first token ended the request: the decode side's lease is
                        // cancelled when its stream drops.
                        let _ = write_msg(&mut ds.send, &ControlMsg::Cancel(d.id)).await;
                        return Outcome::Finished;
                    }
                    for ev in std::mem::take(&mut early) {
                        let last = ev.finish_reason.is_some();
                        if !emit(d, p, ev).await || last {
                            return Outcome::Finished;
                        }
                    }
                }
                Read::Msg(ControlMsg::HandoffDone(h)) => {
                    record_handoff(&h, &pnode, dispatched, cluster);
                    prefill_open = false;
                    // The prefill node's part is over (a drain of it need not wait for the
                    // stream's decode).
                    cluster.release_prefill(booking);
                }
                Read::Msg(other) => tracing::debug!(message = other.name(), "ignored from prefill node"),
                Read::Lost(error) => {
                    prefill_open = false;
                    cluster.release_prefill(booking);
                    if first_at.is_none() {
                        return Outcome::PrefillFailed { node: pnode, error };
                    }
                    // After the first token: the decode node learns of a broken handoff from
                    // its lease and fails the request, which migrates it.
                    tracing::debug!(%error, "prefill stream ended after the first token");
                }
            },
        }
    }
}

/// A prefill node's handoff report: into the metrics, and (a completed one) the dashboard's history.
fn record_handoff(h: &HandoffDone, node: &NodeRef, dispatched: Duration, cluster: &ClusterHandle) {
    if let Some(e) = &h.error {
        tracing::warn!(node = %node.name, error = %e, "handoff failed");
        metrics::counter!(metric::HANDOFF_FAILURES_TOTAL, "node" => node.name.clone()).increment(1);
        return;
    }
    let tail = Duration::from_micros(h.tail_us);
    cluster.observe(super::Observation::Handoff { bytes: h.transfer_bytes, tail });
    let labels = [("pool", "prefill".to_string()), ("node", node.name.clone())];
    let s = |us: u64| us as f64 / 1e6;
    metrics::histogram!(metric::HANDOFF_QUEUE_SECONDS, &labels).record(dispatched.as_secs_f64() + s(h.queue_us));
    metrics::histogram!(metric::HANDOFF_PREFILL_SECONDS, &labels).record(s(h.prefill_us));
    metrics::histogram!(metric::HANDOFF_TICKET_WAIT_SECONDS, &labels).record(s(h.ticket_wait_us));
    metrics::histogram!(metric::HANDOFF_TRANSFER_SECONDS, &labels).record(s(h.transfer_us));
    metrics::histogram!(metric::HANDOFF_TRANSFER_TAIL_SECONDS, &labels).record(s(h.tail_us));
    metrics::histogram!(metric::HANDOFF_TRANSFER_BYTES, &labels).record(h.transfer_bytes as f64);
    tracing::debug!(
        prefill_us = h.prefill_us,
        ticket_wait_us = h.ticket_wait_us,
        transfer_us = h.transfer_us,
        bytes = h.transfer_bytes,
        "handoff done"
    );
}
