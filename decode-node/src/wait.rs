//! The sans-IO core of a remote decode request from its reservation to its first decode step:
//! answer the ticket, wait for the KV or a cancellation, and decide what each outcome means. The
//! async shell (`remote()` in the crate root) holds the receiver's reservation and the
//! coordinator's stream and feeds [`Event`]s with the time.
//!
//! Invariants (checked by the tests below):
//! - a granted lease ends exactly one way: the KV landed ([`Action::Start`]), the handoff failed
//!   (the receiver released it; [`Action::Fail`]), or [`Action::CancelLease`] (the ticket could
//!   not be sent, the coordinator cancelled, or its stream ended), after which the shell also
//!   gives back a lease that completed meanwhile;
//! - the coordinator hears an error event only for a refused reservation or a failed handoff (a
//!   cancelled request, or one whose stream is gone, gets nothing);
//! - [`Action::SendTicket`] is the last action of its batch, answered by [`Event::TicketSent`] or
//!   [`Event::TicketNotSent`]; [`Action::Finish`] ends every run exactly once.

use std::time::{Duration, Instant};

use cleave_kv_transfer::{Completed, KvTransferError};
use cleave_protocol::control::{ControlMsg, WireError};

use crate::NodeError;

/// An input.
#[derive(Debug)]
pub enum Event {
    /// The receiver's answer to the reservation.
    Reserved(Result<(), KvTransferError>),
    TicketSent,
    TicketNotSent,
    /// The lease's outcome.
    Landed(Result<Completed, KvTransferError>),
    /// A message from the coordinator.
    Message(Box<ControlMsg>),
    /// The coordinator's stream ended (`None`) or broke.
    Lost(Option<WireError>),
}

/// An output, for the shell to carry out in order.
#[derive(Debug)]
pub enum Action {
    /// Write the ticket to the coordinator; answer [`Event::TicketSent`] or
    /// [`Event::TicketNotSent`].
    SendTicket,
    /// Cancel the lease; `release_completed`: then wait for its outcome and give back its blocks
    /// if it completed meanwhile (once the ticket went out, the KV may have landed).
    CancelLease {
        release_completed: bool,
    },
    /// Tell the coordinator the request failed.
    Fail(NodeError),
    /// The KV landed: start decoding.
    Start(Completed),
    Record(Metric),
    Finish,
}

/// A metric (names in [`crate::metric`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Metric {
    /// `cleave_node_decode_requests_total{path="remote"}`.
    RemoteRequest,
    Reservation(Duration),
    KvWait(Duration),
    HandoffFailure,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Reserving,
    /// The ticket is being written (the KV wait is counted from `since`).
    SendingTicket {
        since: Instant,
    },
    Waiting {
        since: Instant,
    },
    Done,
}

/// One remote decode request, until its KV is in.
#[derive(Debug)]
pub struct KvWait {
    started: Instant,
    phase: Phase,
}

impl KvWait {
    /// A request whose reservation was asked for at `started`.
    pub fn new(started: Instant) -> Self {
        Self { started, phase: Phase::Reserving }
    }

    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match (self.phase, event) {
            (Phase::Reserving, Event::Reserved(Ok(()))) => {
                out.push(Action::Record(Metric::RemoteRequest));
                out.push(Action::Record(Metric::Reservation(now.saturating_duration_since(self.started))));
                out.push(Action::SendTicket);
                self.phase = Phase::SendingTicket { since: now };
            }
            (Phase::Reserving, Event::Reserved(Err(e))) => self.end(Action::Fail(NodeError::Transfer(e)), &mut out),
            (Phase::SendingTicket { since }, Event::TicketSent) => self.phase = Phase::Waiting { since },
            (Phase::SendingTicket { .. }, Event::TicketNotSent) => {
                tracing::warn!("the ticket did not go out; releasing the lease");
                self.end(Action::CancelLease { release_completed: false }, &mut out);
            }
            (Phase::Waiting { since }, Event::Landed(Ok(c))) => {
                out.push(Action::Record(Metric::KvWait(now.saturating_duration_since(since))));
                self.end(Action::Start(c), &mut out);
            }
            (Phase::Waiting { .. }, Event::Landed(Err(e))) => {
                out.push(Action::Record(Metric::HandoffFailure));
                self.end(Action::Fail(NodeError::HandoffFailed(e)), &mut out);
            }
            (Phase::Waiting { .. }, Event::Message(m)) if matches!(*m, ControlMsg::Cancel(_)) => {
                tracing::debug!("cancelled while waiting for kv");
                self.end(Action::CancelLease { release_completed: true }, &mut out);
            }
            (Phase::Waiting { .. }, Event::Lost(None)) => {
                tracing::debug!("the coordinator's stream ended while waiting for kv");
                self.end(Action::CancelLease { release_completed: true }, &mut out);
            }
            (Phase::Waiting { .. }, Event::Lost(Some(error))) => {
                tracing::warn!(%error, "rpc stream broke while waiting for kv");
                self.end(Action::CancelLease { release_completed: true }, &mut out);
            }
            (Phase::Waiting { .. }, Event::Message(other)) => {
                tracing::debug!(message = other.name(), "ignored while waiting for kv")
            }
            (phase, event) => tracing::debug!(?phase, ?event, "ignored"),
        }
        out
    }

    fn end(&mut self, last: Action, out: &mut Vec<Action>) {
        out.push(last);
        out.push(Action::Finish);
        self.phase = Phase::Done;
    }
}

#[cfg(test)]
mod tests {
    use cleave_protocol::{LeaseId, RequestId};

    use super::*;

    fn kinds(out: &[Action]) -> Vec<String> {
        out.iter()
            .map(|a| match a {
                Action::Fail(e) => format!("Fail({e})"),
                Action::Start(c) => format!("Start({})", c.first_token),
                Action::Record(m) => format!("{m:?}").split('(').next().unwrap().to_string(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn completed() -> Completed {
        Completed { lease: LeaseId(3), request_id: RequestId(1), blocks: vec![4], first_token: 77 }
    }

    /// A wait whose reservation was granted 2 ms after `t0` and whose ticket went out.
    fn waiting(t0: Instant) -> KvWait {
        let mut w = KvWait::new(t0);
        let out = w.handle(t0 + Duration::from_millis(2), Event::Reserved(Ok(())));
        assert_eq!(kinds(&out), ["RemoteRequest", "Reservation", "SendTicket"]);
        assert!(matches!(out[1], Action::Record(Metric::Reservation(d)) if d == Duration::from_millis(2)));
        assert!(w.handle(t0 + Duration::from_millis(3), Event::TicketSent).is_empty());
        w
    }

    #[test]
    fn landed_kv_starts_decoding() {
        let t0 = Instant::now();
        let mut w = waiting(t0);
        let out = w.handle(t0 + Duration::from_millis(10), Event::Landed(Ok(completed())));
        assert_eq!(kinds(&out), ["KvWait", "Start(77)", "Finish"]);
        assert!(
            matches!(out[0], Action::Record(Metric::KvWait(d)) if d == Duration::from_millis(8)),
            "from the ticket"
        );
        assert!(w.handle(t0, Event::Message(Box::new(ControlMsg::Cancel(RequestId(1))))).is_empty());
    }

    #[test]
    fn a_failed_handoff_is_an_error_event_and_a_refused_reservation_too() {
        let t0 = Instant::now();
        let mut w = waiting(t0);
        let e = KvTransferError::LeaseExpired { lease: LeaseId(3) };
        let out = w.handle(t0, Event::Landed(Err(e)));
        assert_eq!(
            kinds(&out),
            ["HandoffFailure", "Fail(kv handoff failed: lease lease-0000000000000003 expired)", "Finish"]
        );
        let mut w = KvWait::new(t0);
        let out = w.handle(t0, Event::Reserved(Err(KvTransferError::OutOfBlocks { need: 4, free: 1 })));
        assert_eq!(kinds(&out), ["Fail(out of kv blocks: need 4, 1 free)", "Finish"]);
    }

    #[test]
    fn a_cancel_a_closed_or_broken_stream_or_an_unsent_ticket_cancels_the_lease_quietly() {
        let t0 = Instant::now();
        for end in [
            Event::Message(Box::new(ControlMsg::Cancel(RequestId(1)))),
            Event::Lost(None),
            Event::Lost(Some(WireError::Closed)),
        ] {
            let mut w = waiting(t0);
            assert!(w.handle(t0, Event::Message(Box::new(ControlMsg::Leave("x".into())))).is_empty(), "ignored");
            assert_eq!(kinds(&w.handle(t0, end)), ["CancelLease { release_completed: true }", "Finish"]);
            assert!(w.handle(t0, Event::Landed(Ok(completed()))).is_empty(), "the shell gives it back");
        }
        let mut w = KvWait::new(t0);
        w.handle(t0, Event::Reserved(Ok(())));
        let out = w.handle(t0, Event::TicketNotSent);
        assert_eq!(kinds(&out), ["CancelLease { release_completed: false }", "Finish"], "nothing can have landed");
    }
}
