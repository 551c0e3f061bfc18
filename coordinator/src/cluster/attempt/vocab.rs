//! The request machine's vocabulary: what goes in ([`Event`]), what comes out ([`Action`],
//! [`Metric`]), and why a node failed an attempt or a request ended in error ([`AttemptError`],
//! [`NodeFailure`], [`RequestError`]: the machine's own terms, rendered into the final event's
//! text; not crate errors).

use std::time::Duration;

use cleave_protocol::control::{ControlMsg, HandoffDone, WireError};
use cleave_protocol::{HandoffTicket, TokenEvent};

use crate::cluster::registry::{Assignment, NoRoute, NodeRef, Plan, RouteQuery};
use crate::cluster::ClusterConfig;
use crate::dispatch::DispatchEvent;

/// What opening a stream to a node fails with ([`cleave_net::Connector::open`]'s error).
pub type ConnectError = cleave_net::NetError;

/// The cluster settings the machine decides with.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Times a stream may move to another decode node after its node failed.
    pub max_migrations: u32,
    /// Attempts after a node failed before the first token.
    pub max_prefill_retries: u32,
    /// A node that sends nothing on a request's stream for this long has failed it.
    pub node_silence_timeout: Duration,
}

impl Limits {
    pub fn of(cfg: &ClusterConfig) -> Self {
        Self {
            max_migrations: cfg.max_migrations,
            max_prefill_retries: cfg.max_prefill_retries,
            node_silence_timeout: cfg.node_silence_timeout,
        }
    }
}

/// Which node stream of an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Prefill,
    Decode,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// Why a node failed an attempt (the machine's vocabulary; the client reads it rendered, inside
/// the request's final error event).
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    /// The registry removed the node (it stopped reporting, or its control stream ended).
    #[error("the node died")]
    NodeDied,
    /// The node ended the request's stream.
    #[error("the node closed the stream")]
    StreamClosed,
    /// The request's stream broke (i/o error, or a frame that is not a control message).
    #[error(transparent)]
    StreamBroken(WireError),
    /// Nothing on the request's streams for the node silence timeout.
    #[error("the node sent nothing for {} s", .silence.as_secs())]
    Silent { silence: Duration },
    /// The node ended the request with an error event.
    #[error("{message}")]
    NodeError { message: String },
    /// No stream to the node could be opened.
    #[error(transparent)]
    Connect(ConnectError),
    /// The request could not be written on a new stream.
    #[error(transparent)]
    Send(WireError),
    /// The decode node's ticket could not be forwarded to the prefill node.
    #[error("stream lost while sending the ticket")]
    TicketNotSent,
}

/// The last node failure of a request, as the client reads it: `prefill node p0: the node died`.
#[derive(Debug, thiserror::Error)]
#[error("{side} node {node}: {cause}")]
pub struct NodeFailure {
    pub side: Side,
    pub node: String,
    pub cause: AttemptError,
}

/// Why a request ended with an error event (or was refused: [`RequestError::NoRoute`] before
/// anything was sent or failed).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("gave up after {attempts} prefill attempts: {last}")]
    PrefillAttempts { attempts: u32, last: NodeFailure },
    /// A decode node failed before the first token once too often.
    #[error("gave up after {attempts} attempts: {last}")]
    Attempts { attempts: u32, last: NodeFailure },
    #[error("gave up after {migrations} migrations: {last}")]
    Migrations { migrations: u32, last: NodeFailure },
    #[error("{last}; then {no_route}")]
    NoRouteAfter { last: NodeFailure, no_route: NoRoute },
    #[error("{0}")]
    NoRoute(NoRoute),
}

/// An input to the machine.
#[derive(Debug)]
pub enum Event {
    /// The registry's answer to [`Action::Plan`] (a plan comes with its booking).
    Planned(Result<(Plan, Assignment), NoRoute>),
    /// The answer to [`Action::Open`]: whether each stream opened and its request went out.
    Opened { decode: Result<(), AttemptError>, prefill: Option<Result<(), AttemptError>> },
    /// A message on a node stream.
    Message { side: Side, msg: ControlMsg },
    /// A node stream ended or broke ([`AttemptError::StreamClosed`] or
    /// [`AttemptError::StreamBroken`]).
    Lost { side: Side, cause: AttemptError },
    /// [`Action::ForwardTicket`] could not be written (the shell says nothing when it could).
    TicketNotSent,
    /// [`Action::Emit`] reached the edge.
    Delivered,
    /// [`Action::Emit`] failed: the edge dropped the request.
    ClientGone,
    /// The registry removed this node.
    NodeDied(u64),
    /// The edge no longer wants the request (told once).
    Cancelled,
    /// [`Journey::deadline`](super::Journey::deadline) passed.
    Timer,
}

/// An output of the machine, for the shell to carry out in order.
#[derive(Debug)]
pub enum Action {
    /// Ask the registry for a plan; answer with [`Event::Planned`].
    Plan(RouteQuery),
    /// Send this to the edge; a closed channel is ignored (the machine hears of a client gone
    /// from [`Action::Emit`]).
    Tell(DispatchEvent),
    /// Record a metric.
    Record(Metric),
    /// Open a stream to each node and write its message (concurrently); answer with
    /// [`Event::Opened`]. Read the streams while [`Journey::reading`](super::Journey::reading)
    /// says so.
    Open(Box<Streams>),
    /// Write the decode node's ticket on the prefill stream; on failure answer
    /// [`Event::TicketNotSent`].
    ForwardTicket(HandoffTicket),
    /// Write `Cancel` on that stream (a failure is ignored: the stream's close cancels too).
    Cancel(Side),
    /// Send this token event to the edge; answer [`Event::Delivered`] or [`Event::ClientGone`].
    Emit(TokenEvent),
    /// Record the prefill node's handoff report (`dispatched`: opening the attempt's streams).
    Handoff { report: HandoffDone, node: NodeRef, dispatched: Duration },
    /// The request ended before the prefill node's handoff report: read it from the prefill
    /// stream in the background (the stream goes with it) and record it as [`Action::Handoff`].
    ReportLater { node: NodeRef, dispatched: Duration },
    /// Return the prefill part of the attempt's booking (the stream goes on).
    ReleasePrefill(Assignment),
    /// Drop the attempt's streams (the nodes cancel whatever they still hold for it) and stop
    /// listening for node deaths.
    CloseStreams,
    /// Return the attempt's booking.
    Release(Assignment),
    /// The request is over; feed nothing more.
    Finish,
}

/// The streams of an attempt, each to a node with the request to write on it.
#[derive(Debug)]
pub struct Streams {
    pub decode: (NodeRef, ControlMsg),
    /// A remote attempt's.
    pub prefill: Option<(NodeRef, ControlMsg)>,
}

/// A metric the machine's decisions produce (names in [`crate::cluster::metric`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Metric {
    /// `cleave_route_decisions_total{path, reason}`.
    RouteDecision { path: &'static str, reason: &'static str },
    /// `cleave_prefill_retries_total{node}`: the prefill node failed before the first token.
    PrefillRetry { node: String },
    /// `cleave_migrations_total{node}`: the decode node failed after the first token.
    Migration { node: String },
    /// `cleave_requests_held_for_switch_total`.
    HeldForSwitch,
    /// `cleave_requests_held_for_decode_kv_total`.
    HeldForDecodeKv,
    /// `cleave_requests_held_for_seat_total`: SLO admission held it for a seat.
    HeldForSeat,
    /// `cleave_requests_shed_total`: refused after waiting its most for a seat.
    Shed,
    /// `cleave_handoff_reservation_seconds{pool="decode", node}`: streams opened to ticket.
    Reservation { node: String, waited: Duration },
    /// `cleave_handoff_decode_first_step_seconds{pool="decode", node}`: first token to the
    /// decode node's first event after it.
    DecodeFirstStep { node: String, after: Duration },
}
