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
//! * optionally, a [`DispatchEvent::Routed`] before each attempt's first event, saying which
//!   nodes serve it and why (the edge labels latencies with it and tells the client);
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

/// How a dispatch is being served: the path, and the nodes on it.
///
/// Invariants: `reason` is set exactly when `path` is `local`; `prefill_node` exactly when `path`
/// is `remote`. Every `&'static str` comes from a small fixed set (they become metric labels).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `remote` (a prefill node, then a handoff), `local` (the decode node prefilled it),
    /// `colocated` (a node of the colocated pool did both), or `migrated` (the stream moved to
    /// another node after its decode node failed; that node prefilled prompt and tokens sent).
    pub path: &'static str,
    /// Why a `local` request prefilled on its decode node: `short_prompt`, `no_prefill_node`
    /// or `prefill_saturated`.
    pub reason: Option<&'static str>,
    pub prefill_node: Option<String>,
    pub decode_node: String,
    /// Pool of the decode node: `decode` or `colocated`.
    pub decode_pool: &'static str,
}

impl Route {
    /// The pool whose node produced the first token: the prefill pool for a remote request,
    /// else the decode node's.
    pub fn first_token_pool(&self) -> &'static str {
        if self.path == "remote" {
            "prefill"
        } else {
            self.decode_pool
        }
    }

    /// The `x-cleave-route` header value: `remote; prefill=P; decode=D`,
    /// `local; reason=short_prompt; decode=D`, `colocated; decode=D`, `migrated; decode=D`. Node
    /// names are reduced to visible ASCII without `;` and `,` (a header must carry them).
    pub fn header_value(&self) -> String {
        let clean = |s: &str| -> String {
            s.chars().map(|c| if c.is_ascii_graphic() && c != ';' && c != ',' { c } else { '_' }).collect()
        };
        let mut v = self.path.to_owned();
        if let Some(r) = self.reason {
            v.push_str("; reason=");
            v.push_str(r);
        }
        if let Some(p) = &self.prefill_node {
            v.push_str("; prefill=");
            v.push_str(&clean(p));
        }
        v.push_str("; decode=");
        v.push_str(&clean(&self.decode_node));
        v
    }
}

/// What the router sends back for a dispatch.
#[derive(Debug, Clone, PartialEq)]
pub enum DispatchEvent {
    /// A generated token, or a final event (see [`TokenEvent::finish_reason`]).
    Token(TokenEvent),
    /// The attempt about to run goes this way (see [`Route`]).
    Routed(Route),
    /// No node can serve this request; sent instead of any token. The edge answers 503.
    Refused { reason: String },
}

/// The sending half the edge holds; cloneable, one per server.
pub type DispatchSender = mpsc::Sender<Dispatch>;

/// A bounded dispatch channel with room for `capacity` queued dispatches (at least 1).
pub fn dispatch_channel(capacity: usize) -> (DispatchSender, mpsc::Receiver<Dispatch>) {
    mpsc::channel(capacity.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_header_names_the_path_and_nodes_and_survives_odd_names() {
        let remote = Route {
            path: "remote",
            reason: None,
            prefill_node: Some("p0".into()),
            decode_node: "d 1;x,y\u{e9}".into(),
            decode_pool: "decode",
        };
        assert_eq!(remote.header_value(), "remote; prefill=p0; decode=d_1_x_y_");
        assert!(axum::http::HeaderValue::from_str(&remote.header_value()).is_ok());
        assert_eq!(remote.first_token_pool(), "prefill");
        let local = Route {
            path: "local",
            reason: Some("short_prompt"),
            prefill_node: None,
            decode_node: "d0".into(),
            decode_pool: "decode",
        };
        assert_eq!(local.header_value(), "local; reason=short_prompt; decode=d0");
        assert_eq!(local.first_token_pool(), "decode");
    }
}
