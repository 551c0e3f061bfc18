//! One request's journey through the cluster, carried out: the thin async shell around
//! [`Journey`] (the sans-IO machine in [`super::attempt`], which holds every decision: retries,
//! migration, early-token buffering, holding while nodes switch roles).
//!
//! The shell performs the machine's [`Action`]s in order (registry calls, node streams, events to
//! the edge, metrics) and feeds it [`Event`]s with the time: the answers to its questions first,
//! then whatever comes first of a cancellation, a node death, a message on a node stream, or the
//! machine's deadline. A cancellation that fires while an answer is awaited is told before that
//! answer. The request's span is attached with `.instrument`, never entered across an `.await`.
//!
//! Streams are read through a [`MsgReader`] each, which is cancel-safe, so a read interrupted
//! by another event loses nothing. Dropping a node stream ([`Action::CloseStreams`]) makes the node cancel the request
//! and free its KV (see the node crates).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_net::{Connector, DuplexStream, RecvHalf};
use cleave_protocol::control::{write_msg, ControlMsg, HandoffDone, MsgReader, WireError, Work};
use tokio::sync::broadcast;
use tracing::Instrument;

use super::attempt::{Action, AttemptError, Event, Journey, Limits, Metric, Side, Streams};
use super::registry::NodeRef;
use super::{metric, ClusterConfig, ClusterHandle};
use crate::dispatch::{Dispatch, DispatchEvent};

pub(super) async fn run(d: Dispatch, cluster: ClusterHandle, connector: Arc<Connector>, cfg: Arc<ClusterConfig>) {
    let span = tracing::info_span!("request", request_id = %d.id);
    let work = Work { id: d.id, prompt: d.prompt.clone(), params: d.params.clone(), stop: d.stop.clone() };
    let mut journey = Journey::new(work, Limits::of(&cfg), Instant::now());
    let mut shell = Shell { d, cluster, connector, decode: None, prefill: None, deaths: None, cancel_told: false };
    shell.drive(&mut journey).instrument(span).await;
    // What the client experienced, for the planner.
    if let Some(o) = journey.completion(Instant::now(), shell.d.cancel.is_cancelled()) {
        shell.cluster.observe(o);
    }
}

/// One open node stream: its writer, and its messages as they are read.
struct NodeStream {
    send: Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    /// None once the stream ended or failed: after an error it is out of step, and reads as
    /// ended from then on.
    reader: Option<MsgReader<RecvHalf>>,
}

impl NodeStream {
    fn new(s: DuplexStream) -> Self {
        Self { send: Box::pin(s.send), reader: Some(MsgReader::new(s.recv)) }
    }

    /// The next message; None at the end of the stream. Cancel-safe ([`MsgReader`] keeps a
    /// frame read halfway), so it may be raced in a `select!` against other events.
    async fn next(&mut self) -> Option<Result<ControlMsg, WireError>> {
        let r = self.reader.as_mut()?.next().await;
        if !matches!(r, Ok(Some(_))) {
            self.reader = None;
        }
        r.transpose()
    }
}

struct Shell {
    d: Dispatch,
    cluster: ClusterHandle,
    connector: Arc<Connector>,
    decode: Option<NodeStream>,
    prefill: Option<NodeStream>,
    /// Node removals, from the attempt's plan to its end.
    deaths: Option<broadcast::Receiver<u64>>,
    /// [`Event::Cancelled`] was fed.
    cancel_told: bool,
}

impl Shell {
    async fn drive(&mut self, m: &mut Journey) {
        let mut answers = VecDeque::new();
        let mut actions = m.start(Instant::now());
        loop {
            for a in actions {
                if let Some(answer) = self.perform(a).await {
                    answers.push_back(answer);
                }
            }
            if m.is_done() {
                return;
            }
            let event = if !self.cancel_told && self.d.cancel.is_cancelled() {
                self.cancel_told = true;
                Event::Cancelled
            } else if let Some(answer) = answers.pop_front() {
                answer
            } else {
                self.next_event(m).await
            };
            actions = m.handle(Instant::now(), event);
        }
    }

    /// Waits for whatever the machine listens to, first come (a cancellation first of all).
    async fn next_event(&mut self, m: &Journey) -> Event {
        let deadline = m.deadline().map(tokio::time::Instant::from_std);
        debug_assert!(deadline.is_some(), "the request machine waits without a deadline");
        let mut prefill = self.prefill.as_mut().filter(|_| m.reading(Side::Prefill));
        let mut decode = self.decode.as_mut().filter(|_| m.reading(Side::Decode));
        let listen_deaths = m.reading(Side::Decode);
        loop {
            tokio::select! {
                biased;
                () = self.d.cancel.cancelled(), if !self.cancel_told => {
                    self.cancel_told = true;
                    return Event::Cancelled;
                }
                id = death(self.deaths.as_mut()), if listen_deaths && self.deaths.is_some() => match id {
                    Some(id) => return Event::NodeDied(id),
                    None => self.deaths = None,
                },
                // The prefill stream carries a few messages; it goes first so that a busy decode
                // stream never starves the first token.
                r = read(prefill.as_deref_mut()), if prefill.is_some() => return stream_event(Side::Prefill, r),
                r = read(decode.as_deref_mut()), if decode.is_some() => return stream_event(Side::Decode, r),
                () = sleep_until(deadline) => return Event::Timer,
            }
        }
    }

    /// Carries out one action; returns the machine's answer when the action asks for one.
    async fn perform(&mut self, a: Action) -> Option<Event> {
        match a {
            Action::Plan(q) => {
                let r = self.cluster.plan(q).await;
                if r.is_ok() {
                    // Deaths from here on reach the attempt.
                    self.deaths = Some(self.cluster.deaths());
                }
                Some(Event::Planned(r))
            }
            Action::Tell(ev) => {
                let _ = self.d.events.send(ev).await;
                None
            }
            Action::Record(m) => {
                record(m);
                None
            }
            Action::Open(streams) => {
                let Streams { decode: (dnode, dmsg), prefill } = *streams;
                let connector = &self.connector;
                let (ds, ps) = tokio::join!(open(connector, &dnode, &dmsg), async {
                    match &prefill {
                        Some((pnode, pmsg)) => Some(open(connector, pnode, pmsg).await),
                        None => None,
                    }
                });
                let decode = ds.map(|s| self.decode = Some(NodeStream::new(s)));
                let prefill = ps.map(|r| r.map(|s| self.prefill = Some(NodeStream::new(s))));
                Some(Event::Opened { decode, prefill })
            }
            Action::ForwardTicket(t) => {
                let sent = match self.prefill.as_mut() {
                    Some(s) => write_msg(&mut s.send, &ControlMsg::Ticket(t)).await.is_ok(),
                    None => false,
                };
                (!sent).then_some(Event::TicketNotSent)
            }
            Action::Cancel(side) => {
                let s = match side {
                    Side::Prefill => self.prefill.as_mut(),
                    Side::Decode => self.decode.as_mut(),
                };
                if let Some(s) = s {
                    let _ = write_msg(&mut s.send, &ControlMsg::Cancel(self.d.id)).await;
                }
                None
            }
            Action::Emit(ev) => Some(match self.d.events.send(DispatchEvent::Token(ev)).await {
                Ok(()) => Event::Delivered,
                Err(_) => Event::ClientGone,
            }),
            Action::Handoff { report, node, dispatched } => {
                record_handoff(&report, &node, dispatched, &self.cluster);
                None
            }
            Action::ReportLater { node, dispatched } => {
                if let Some(s) = self.prefill.take() {
                    report_later(s, node, dispatched, self.cluster.clone());
                }
                None
            }
            Action::ReleasePrefill(mut part) => {
                self.cluster.release_prefill(&mut part);
                None
            }
            Action::CloseStreams => {
                self.decode = None;
                self.prefill = None;
                self.deaths = None;
                None
            }
            Action::Release(booking) => {
                self.cluster.release(booking);
                None
            }
            Action::Finish => None,
        }
    }
}

async fn open(connector: &Connector, node: &NodeRef, msg: &ControlMsg) -> Result<DuplexStream, AttemptError> {
    let mut s = connector.open(node.rpc_addr).await.map_err(AttemptError::Connect)?;
    write_msg(&mut s.send, msg).await.map_err(AttemptError::Send)?;
    Ok(s)
}

async fn read(s: Option<&mut NodeStream>) -> Option<Result<ControlMsg, WireError>> {
    match s {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

fn stream_event(side: Side, r: Option<Result<ControlMsg, WireError>>) -> Event {
    match r {
        Some(Ok(msg)) => Event::Message { side, msg },
        Some(Err(e)) => Event::Lost { side, cause: AttemptError::StreamBroken(e) },
        None => Event::Lost { side, cause: AttemptError::StreamClosed },
    }
}

/// The next node removed from the registry; `None` once the registry is gone.
async fn death(deaths: Option<&mut broadcast::Receiver<u64>>) -> Option<u64> {
    let Some(deaths) = deaths else { return std::future::pending().await };
    loop {
        match deaths.recv().await {
            Ok(id) => return Some(id),
            Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => return None,
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn record(m: Metric) {
    match m {
        Metric::RouteDecision { path, reason } => {
            metrics::counter!(metric::ROUTE_DECISIONS_TOTAL, "path" => path, "reason" => reason).increment(1)
        }
        Metric::PrefillRetry { node } => metrics::counter!(metric::PREFILL_RETRIES_TOTAL, "node" => node).increment(1),
        Metric::Migration { node } => metrics::counter!(metric::MIGRATIONS_TOTAL, "node" => node).increment(1),
        Metric::HeldForSwitch => metrics::counter!(metric::HELD_FOR_SWITCH_TOTAL).increment(1),
        Metric::HeldForDecodeKv => metrics::counter!(metric::HELD_FOR_DECODE_KV_TOTAL).increment(1),
        Metric::HeldForSeat => metrics::counter!(metric::HELD_FOR_SEAT_TOTAL).increment(1),
        Metric::Shed => metrics::counter!(metric::SHED_TOTAL).increment(1),
        Metric::Reservation { node, waited } => {
            metrics::histogram!(metric::HANDOFF_RESERVATION_SECONDS, "pool" => "decode", "node" => node)
                .record(waited.as_secs_f64())
        }
        Metric::DecodeFirstStep { node, after } => {
            metrics::histogram!(metric::HANDOFF_DECODE_FIRST_STEP_SECONDS, "pool" => "decode", "node" => node)
                .record(after.as_secs_f64())
        }
    }
}

/// How long a finished request's handoff report is waited for.
const REPORT_WAIT: Duration = Duration::from_secs(5);

/// A short output can end before the prefill node's handoff report arrives (it follows the
/// receiver's Ack, and the decode node starts at that Ack): read the report in the background,
/// for at most [`REPORT_WAIT`] a message, so that the handoff metrics count every request.
fn report_later(mut ps: NodeStream, pnode: NodeRef, dispatched: Duration, cluster: ClusterHandle) {
    tokio::spawn(
        async move {
            while let Ok(Some(Ok(msg))) = tokio::time::timeout(REPORT_WAIT, ps.next()).await {
                if let ControlMsg::HandoffDone(h) = msg {
                    return record_handoff(&h, &pnode, dispatched, &cluster);
                }
            }
        }
        .in_current_span(),
    );
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
