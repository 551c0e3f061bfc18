//! The boundary between the HTTP edge and whatever routes requests to nodes.
//!
//! The edge validates and tokenizes a request, then sends one [`Dispatch`] per choice on a
//! bounded `mpsc::Sender<Dispatch>` (the router is an actor that owns that channel's
//! receiver). A full channel is answered 429 by the edge; a closed one 503.
//!
//! Contract for the router (the receiver side):
//! * send [`DispatchEvent::Token`] events in generation order on `events`, the last one
//!   with `finish_reason` set, and nothing after it;
//! * or, before any token, a single [`DispatchEvent::Refused`] when no node can serve the
//!   request (the edge answers 503);
//! * stop generating and free the request's resources when `cancel` fires (client gone, a
//!   stop string matched); sending after that is allowed and ignored, and a failed send
//!   (the edge dropped the receiver) means the same as `cancel`;
//! * only `token_id`, `logprobs`, `finish_reason`, `cached_tokens` and `error` of a
//!   [`TokenEvent`] are read: detokenization and stop strings happen in the edge, because
//!   only the edge sees the whole stream (the first token comes from a prefill node, the
//!   rest from a decode node, possibly a different one after a migration).

use cleave_protocol::{RequestId, SamplingParams, StopConditions, TokenEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// One sequence to generate: a prompt, how to sample, when to stop, and where to send tokens.
///
/// Invariant: `params` passed [`SamplingParams::validate`]; `prompt` is non-empty and
/// `prompt.len() + stop.max_tokens` fits the model's context; `stop.stop_strings` is empty
/// (stop strings are the edge's job); `stop.max_tokens >= 1`.
#[derive(Debug)]
pub struct Dispatch {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
    /// Where the router sends this dispatch's events (bounded).
    pub events: mpsc::Sender<DispatchEvent>,
    /// Fires when the edge no longer wants tokens for this dispatch.
    pub cancel: CancellationToken,
}

/// What the router sends back for a dispatch.
#[derive(Debug, Clone, PartialEq)]
pub enum DispatchEvent {
    /// A generated token, or a final event (see [`TokenEvent::finish_reason`]).
    Token(TokenEvent),
    /// No node can serve this request; sent instead of any token. The edge answers 503.
    Refused { reason: String },
}

/// The sending half the edge holds; cloneable, one per server.
pub type DispatchSender = mpsc::Sender<Dispatch>;

/// A bounded dispatch channel with room for `capacity` queued dispatches (at least 1).
pub fn dispatch_channel(capacity: usize) -> (DispatchSender, mpsc::Receiver<Dispatch>) {
    mpsc::channel(capacity.max(1))
}
