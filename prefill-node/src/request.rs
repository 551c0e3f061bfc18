//! The sans-IO core of one prefill request: what the node does with the decode node's ticket,
//! the engine's first event, the shipper's outcome and the coordinator's messages. The async
//! shell that runs the engine stream, the shipper and the rpc stream is `prefill()` in the
//! crate root.
//!
//! No tokio, no clock: every input carries `now`; every output is an [`Action`].
//!
//! Invariants (checked by the tests below):
//! - the shipper gets at most one ticket: the request's own, or the first `Ticket` message;
//! - the coordinator hears one of: a failed event (the engine refused the request or stopped
//!   before its first event); the first event alone (it ended the request, or the rpc stream
//!   went away); the first event, then exactly one `HandoffDone` (once both the first event was
//!   sent and the shipper finished, whichever comes last);
//! - [`Action::SendFirst`] is the last action of its batch, answered by [`Event::Sent`] or
//!   [`Event::Lost`]; [`Action::Finish`] ends every run exactly once (the shell then drops the
//!   engine stream and the shipper: the engine cancels the request, the sender aborts the
//!   transfer and the decode node frees its lease).

use std::time::{Duration, Instant};

use cleave_protocol::control::{ControlMsg, HandoffDone};
use cleave_protocol::{HandoffTicket, RequestId, TokenEvent};

use crate::NodeError;

/// What the shipper reports when the KV has landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shipped {
    pub ticket_wait: Duration,
    pub bytes: u64,
    pub transfer: Duration,
    /// First token sampled (every chunk computed) to the receiver's Ack.
    pub tail: Duration,
}

/// An input.
#[derive(Debug)]
pub enum Event {
    /// A ticket: the request's own, or a `Ticket` message.
    Ticket(HandoffTicket),
    /// The engine's next event (`None`: its stream ended); `computing`: when the request's first
    /// layer of KV left the engine, if it has.
    Engine { event: Option<TokenEvent>, computing: Option<Instant> },
    /// The answer to [`Action::SendFirst`]: the event went out.
    Sent,
    /// The shipper finished.
    Shipped(Result<Shipped, NodeError>),
    /// A message from the coordinator.
    Message(ControlMsg),
    /// The rpc stream ended or broke (or [`Action::SendFirst`] could not be written).
    Lost,
}

/// An output, for the shell to carry out in order.
#[derive(Debug)]
pub enum Action {
    /// Hand the ticket to the shipper.
    GiveTicket(HandoffTicket),
    /// Write the engine's first event; answer [`Event::Sent`] or [`Event::Lost`].
    SendFirst(TokenEvent),
    /// Write this (a failure is ignored: the request ends after it).
    Send(ControlMsg),
    Record(Metric),
    /// The request is over here: drop the engine stream and the shipper.
    Finish,
}

/// A metric (names in [`crate::metric`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Metric {
    /// `cleave_node_handoffs_total{outcome}`.
    Handoff {
        outcome: &'static str,
    },
    PrefillQueue(Duration),
    Prefill(Duration),
    TicketWait(Duration),
    Transfer(Duration),
    TransferTail(Duration),
    TransferBytes(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the engine's first event.
    Prefilling,
    /// [`Action::SendFirst`] is out; `ends`: the event ended the request.
    Sending {
        ends: bool,
    },
    /// The first event went out; waiting for the shipper.
    HandedOff,
    Done,
}

/// One prefill request on this node.
#[derive(Debug)]
pub struct Request {
    id: RequestId,
    prompt_tokens: u32,
    submitted: Instant,
    phase: Phase,
    ticket_given: bool,
    /// The engine's wait (submit to the first layer out) and submit to the first event.
    timing: Option<(Duration, Duration)>,
    shipped: Option<Result<Shipped, NodeError>>,
}

impl Request {
    /// A request submitted to the engine at `submitted`.
    pub fn new(id: RequestId, prompt_tokens: u32, submitted: Instant) -> Self {
        Self {
            id,
            prompt_tokens,
            submitted,
            phase: Phase::Prefilling,
            ticket_given: false,
            timing: None,
            shipped: None,
        }
    }

    /// The engine refused the request.
    pub fn refused(&mut self, error: NodeError) -> Vec<Action> {
        let mut out = Vec::new();
        self.fail(error, &mut out);
        out
    }

    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Whether the shell should read the engine's stream (until its first event).
    pub fn reading_engine(&self) -> bool {
        self.phase == Phase::Prefilling
    }

    /// Whether the shell should poll the shipper.
    pub fn shipping(&self) -> bool {
        self.phase != Phase::Done && self.shipped.is_none()
    }

    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        if self.is_done() {
            return out;
        }
        match event {
            Event::Ticket(t) => self.ticket(t, &mut out),
            Event::Message(ControlMsg::Ticket(t)) => self.ticket(t, &mut out),
            Event::Message(ControlMsg::Cancel(_)) | Event::Lost => self.finish(&mut out),
            Event::Message(other) => tracing::debug!(message = other.name(), "ignored"),
            Event::Engine { event, computing } if self.phase == Phase::Prefilling => match event {
                None => self.fail(NodeError::EngineStopped, &mut out),
                Some(ev) => {
                    let queued = computing.map_or(Duration::ZERO, |t| t.saturating_duration_since(self.submitted));
                    self.timing = Some((queued, now.saturating_duration_since(self.submitted)));
                    self.phase = Phase::Sending { ends: ev.finish_reason.is_some() };
                    out.push(Action::SendFirst(ev));
                }
            },
            Event::Engine { .. } => tracing::debug!("engine event after the first ignored"),
            Event::Sent => match self.phase {
                Phase::Sending { ends: true } => {
                    // Nothing to hand off (the first token ended it, or it failed).
                    out.push(Action::Record(Metric::Handoff { outcome: "not_needed" }));
                    self.finish(&mut out);
                }
                Phase::Sending { ends: false } => {
                    self.phase = Phase::HandedOff;
                    self.report(&mut out);
                }
                _ => tracing::debug!("Sent answered to nothing"),
            },
            Event::Shipped(r) => {
                self.shipped = Some(r);
                self.report(&mut out);
            }
        }
        out
    }

    fn ticket(&mut self, t: HandoffTicket, out: &mut Vec<Action>) {
        if !std::mem::replace(&mut self.ticket_given, true) {
            out.push(Action::GiveTicket(t));
        }
    }

    /// Once the first event is out and the shipper finished: the telemetry, the report, the end.
    fn report(&mut self, out: &mut Vec<Action>) {
        if self.phase != Phase::HandedOff {
            return;
        }
        let Some(r) = self.shipped.take() else { return };
        let (queued, first) = self.timing.unwrap_or_default();
        let prefill = first.saturating_sub(queued);
        out.push(Action::Record(Metric::PrefillQueue(queued)));
        out.push(Action::Record(Metric::Prefill(prefill)));
        out.push(Action::Record(Metric::Handoff { outcome: if r.is_ok() { "ok" } else { "failed" } }));
        let done = match r {
            Ok(sh) => {
                out.push(Action::Record(Metric::TicketWait(sh.ticket_wait)));
                out.push(Action::Record(Metric::Transfer(sh.transfer)));
                out.push(Action::Record(Metric::TransferTail(sh.tail)));
                out.push(Action::Record(Metric::TransferBytes(sh.bytes)));
                HandoffDone {
                    request_id: self.id,
                    error: None,
                    queue_us: queued.as_micros() as u64,
                    prefill_us: prefill.as_micros() as u64,
                    ticket_wait_us: sh.ticket_wait.as_micros() as u64,
                    transfer_bytes: sh.bytes,
                    transfer_us: sh.transfer.as_micros() as u64,
                    tail_us: sh.tail.as_micros() as u64,
                }
            }
            Err(e) => HandoffDone { request_id: self.id, error: Some(e.to_string()), ..Default::default() },
        };
        out.push(Action::Send(ControlMsg::HandoffDone(done)));
        self.finish(out);
    }

    fn fail(&mut self, error: NodeError, out: &mut Vec<Action>) {
        let ev = TokenEvent::failed(self.id, self.prompt_tokens, 0, error.to_string());
        out.push(Action::Send(ControlMsg::Token(ev)));
        self.finish(out);
    }

    fn finish(&mut self, out: &mut Vec<Action>) {
        self.phase = Phase::Done;
        out.push(Action::Finish);
    }
}

#[cfg(test)]
mod tests {
    use cleave_protocol::{FinishReason, KvDtype, KvLayout, LeaseId, TransportKind};

    use super::*;

    const ID: RequestId = RequestId(5);

    fn ticket(lease: u64) -> HandoffTicket {
        HandoffTicket {
            version: 1,
            request_id: ID,
            lease_id: LeaseId(lease),
            receiver_addr: ([127, 0, 0, 1], 9000).into(),
            transport: TransportKind::Quic,
            layout: KvLayout {
                model_fingerprint: 1,
                dtype: KvDtype::F32,
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 16,
                block_size: 4,
            },
            block_ids: vec![1],
            num_tokens: 3,
            lease_ttl: Duration::from_secs(5),
            receiver_name: None,
            cached_tokens: 0,
        }
    }

    fn first(finish: Option<FinishReason>) -> TokenEvent {
        TokenEvent { finish_reason: finish, ..TokenEvent::last(ID, FinishReason::Stop, 3, 1) }
    }

    fn shipped() -> Shipped {
        Shipped {
            ticket_wait: Duration::from_millis(1),
            bytes: 1536,
            transfer: Duration::from_millis(4),
            tail: Duration::from_millis(2),
        }
    }

    fn kinds(out: &[Action]) -> Vec<String> {
        out.iter()
            .map(|a| match a {
                Action::GiveTicket(t) => format!("GiveTicket({})", t.lease_id.0),
                Action::SendFirst(_) => "SendFirst".into(),
                Action::Send(ControlMsg::Token(ev)) => format!("Failed({})", ev.error.as_deref().unwrap_or("")),
                Action::Send(ControlMsg::HandoffDone(h)) => format!("HandoffDone({:?})", h.error),
                Action::Send(other) => other.name().into(),
                Action::Record(Metric::Handoff { outcome }) => format!("Handoff({outcome})"),
                Action::Record(_) => "Record".into(),
                Action::Finish => "Finish".into(),
            })
            .collect()
    }

    /// A request submitted at `t0`, its first event sampled 30 ms later (the first layer out at
    /// 10 ms) and sent.
    fn handed_off(t0: Instant) -> Request {
        let mut r = Request::new(ID, 3, t0);
        let computing = Some(t0 + Duration::from_millis(10));
        let out = r.handle(t0 + Duration::from_millis(30), Event::Engine { event: Some(first(None)), computing });
        assert_eq!(kinds(&out), ["SendFirst"]);
        r
    }

    #[test]
    fn the_shipper_gets_one_ticket_the_requests_own_or_the_first_message() {
        let t0 = Instant::now();
        let mut r = Request::new(ID, 3, t0);
        assert_eq!(kinds(&r.handle(t0, Event::Ticket(ticket(1)))), ["GiveTicket(1)"]);
        assert!(r.handle(t0, Event::Message(ControlMsg::Ticket(ticket(2)))).is_empty());
        let mut r = Request::new(ID, 3, t0);
        assert_eq!(kinds(&r.handle(t0, Event::Message(ControlMsg::Ticket(ticket(3))))), ["GiveTicket(3)"]);
        assert!(r.handle(t0, Event::Message(ControlMsg::Ticket(ticket(4)))).is_empty());
    }

    #[test]
    fn the_report_follows_the_first_event_and_the_shipper_whichever_comes_last() {
        let t0 = Instant::now();
        // The shipper last.
        let mut r = handed_off(t0);
        assert!(!r.reading_engine(), "the engine's stream is read until its first event");
        assert!(r.handle(t0, Event::Sent).is_empty());
        assert!(r.shipping());
        let out = r.handle(t0, Event::Shipped(Ok(shipped())));
        assert_eq!(out.iter().filter(|a| matches!(a, Action::Record(_))).count(), 7);
        assert!(kinds(&out).iter().any(|k| k == "Handoff(ok)"));
        let Some(Action::Send(ControlMsg::HandoffDone(h))) = out.iter().rev().nth(1) else {
            panic!("{:?}", kinds(&out))
        };
        assert_eq!((h.queue_us, h.prefill_us, h.transfer_bytes, h.tail_us), (10_000, 20_000, 1536, 2_000));
        assert_eq!(kinds(&out).last().unwrap(), "Finish");
        assert!(r.is_done());
        assert!(r.handle(t0, Event::Lost).is_empty(), "nothing after Finish");
        // The shipper first (it failed before the first token, e.g. no ticket in time): the
        // report waits for the first event.
        let mut r = Request::new(ID, 3, t0);
        assert!(r.handle(t0, Event::Shipped(Err(NodeError::NoTicket))).is_empty());
        assert!(!r.shipping());
        r.handle(t0, Event::Engine { event: Some(first(None)), computing: None });
        let out = r.handle(t0, Event::Sent);
        assert_eq!(
            kinds(&out),
            [
                "Record",
                "Record",
                "Handoff(failed)",
                "HandoffDone(Some(\"no handoff ticket arrived in time\"))",
                "Finish"
            ]
        );
    }

    #[test]
    fn a_first_event_that_ends_the_request_needs_no_handoff() {
        let t0 = Instant::now();
        let mut r = Request::new(ID, 3, t0);
        r.handle(t0, Event::Engine { event: Some(first(Some(FinishReason::Length))), computing: None });
        assert_eq!(kinds(&r.handle(t0, Event::Sent)), ["Handoff(not_needed)", "Finish"]);
    }

    #[test]
    fn the_engine_refusing_or_stopping_is_a_failed_event() {
        let t0 = Instant::now();
        let mut r = Request::new(ID, 3, t0);
        assert_eq!(kinds(&r.refused(NodeError::Engine(cleave_engine::EngineError::Stopped))).len(), 2);
        let mut r = Request::new(ID, 3, t0);
        assert_eq!(
            kinds(&r.handle(t0, Event::Engine { event: None, computing: None })),
            ["Failed(engine stopped)", "Finish"]
        );
    }

    #[test]
    fn a_cancel_or_a_lost_stream_ends_it_without_a_report() {
        let t0 = Instant::now();
        for end in [Event::Message(ControlMsg::Cancel(ID)), Event::Lost] {
            let mut r = Request::new(ID, 3, t0);
            r.handle(t0, Event::Ticket(ticket(1)));
            assert_eq!(kinds(&r.handle(t0, end)), ["Finish"], "before the first event");
        }
        let mut r = handed_off(t0);
        r.handle(t0, Event::Sent);
        assert_eq!(kinds(&r.handle(t0, Event::Message(ControlMsg::Cancel(ID)))), ["Finish"], "after it");
        // The first event could not be written: no metric, no report.
        let mut r = handed_off(t0);
        assert_eq!(kinds(&r.handle(t0, Event::Lost)), ["Finish"]);
        // A message of no meaning here is ignored.
        let mut r = handed_off(t0);
        r.handle(t0, Event::Sent);
        assert!(r.handle(t0, Event::Message(ControlMsg::Leave("x".into()))).is_empty());
    }
}
