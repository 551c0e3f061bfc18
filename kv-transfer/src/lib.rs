//! kv-transfer: moves the KV cache of a request from the node that prefilled it into blocks that
//! another node leased for it. It moves bytes described by a [`cleave_protocol::KvLayout`] and
//! never sees engine types (see STYLE.md).
//!
//! The streams it sends on are `cleave_net`'s (QUIC, TLS-TCP or plain TCP, authenticated by the
//! cluster CA); this crate adds the handoff protocol on top of them.
//!
//! Modules:
//! - [`frame`]: the wire format (length-prefixed flatbuffers headers + `Bytes` payloads);
//! - [`receiver`]: the sans-IO lease and coverage state machine of a decode node;
//! - [`actor`]: the receiver's async driver, the in-process transport;
//! - [`sender`]: the prefill side, layer chunks over several streams;
//! - [`sink`]: the block-pool interface the receiver writes through;
//! - [`transport`]: the per-peer transport trait, which also gives each transfer its payload
//!   path;
//! - [`payload`]: the payload path as traits, [`payload::SendPath`] / [`payload::PayloadWriter`]
//!   on the sender, [`payload::RecvPath`] on the receiver's actor and [`payload::LeasePayload`]
//!   per lease in its state machine, with the stream implementations ([`payload::StreamPath`],
//!   [`payload::StreamLease`]: chunk frames on the streams);
//! - `rdma` (feature `rdma`): the RDMA implementation, one-sided RDMA WRITE WITH IMMEDIATE into
//!   leased blocks over links (`rdma::RdmaTransport`, `ReceiverService::spawn_rdma`,
//!   `rdma::RdmaLease`), the path a ticket naming `TransportKind::Rdma` takes.
//!
//! # Payload paths
//!
//! The handoff below is one protocol whatever carries the payload; the payload path is chosen
//! per ticket (its [`cleave_protocol::TransportKind`] picks the sender's transport, which gives
//! the path). The stream path sends chunk frames through the receiver, which checks each and
//! writes it ([`sink::KvSink::write`]); the RDMA path writes the leased blocks one-sided and
//! sends `Landed` notices the receiver checks against its pool. The sender, the actor and the
//! transports talk to a path only through the [`payload`] traits and hold no RDMA branch; the
//! RDMA code lives in `rdma/` behind the feature, and depends on the generic modules, never the
//! reverse. The receiver's state machine ([`receiver`]) holds each lease's payload as a
//! [`payload::LeasePayload`], chosen at the lease's `Open`: an `Open` that names no link gets a
//! [`payload::StreamLease`] (chunk frames checked for bounds, order and CRC, written through
//! `Effect::Write`); one that names a link gets the payload the receiver's
//! [`payload::RecvPath`] gives when it binds the lease to that link (over RDMA,
//! `rdma::RdmaLease`: `Landed` notices in order, their checksums checked once the link says
//! every write landed). The state machine's core (leases, expiry, cancel, completion, the one
//! release) has no branch on the path. What concerns the link itself (binding a lease to a tag,
//! polling completions, quarantine, `Drained`, unknown links, which peer owns a link) is the
//! RDMA module's [`payload::RecvPath`]. A build without the feature has no RDMA code, and its
//! receiver refuses, loudly, an `Open` naming a link (`RdmaLink`: "this receiver takes no RDMA
//! links", since it has no path to bind it) and a link offer (`Abort`).
//!
//! # The handoff
//!
//! 1. The decode node reserves blocks ([`actor::ReceiverHandle::reserve`]) and gets a
//!    [`cleave_protocol::HandoffTicket`] plus a [`actor::LeaseWaiter`]. Out of blocks: refused
//!    here, before any prefill work is done. The pool may answer later ([`sink::Reserved`]: the
//!    engine answers between its steps); the actor does not wait for it, and opens the lease
//!    when the answer comes back to it as a message.
//! 2. The prefill node starts a [`sender::KvSender`] from the ticket: layout checked locally,
//!    streams opened, `Open` sent on each; the receiver checks version, lease, request and layout
//!    and answers `Accept` (or `Abort`) before any KV byte moves.
//! 3. As each layer of each prefill chunk is computed, its K and V go out as one chunk frame
//!    (layer `l` on stream `l % streams`). The receiver checks bounds, order and CRC-32 and
//!    writes the run into the leased blocks (one write per contiguous run).
//! 4. `finish(first_token)` sends `Complete`; once every layer holds every token the receiver
//!    answers `Ack` and the waiter resolves with the blocks and the first token.
//!
//! # Who owns the blocks
//!
//! ```text
//!              reserve (sink.reserve)              Open accepted
//!   [Free] ───────────────────────────▶ [Leased] ────────────────▶ [Receiving]
//!     ▲                                   │  │                        │   │
//!     │ sink.release (Effect::Released)   │  │ all layers + Complete  │   │
//!     └───────────────────────────────────┘  └───────────┬────────────┘   │
//!     ▲                                                  ▼                │
//!     │                                        [Adopted by the request]   │
//!     └───────────────────────────────────────────────────────────────────┘
//!                     sink.release (Effect::Released)
//! ```
//!
//! - **Free**: on the pool's free list; owned by the pool.
//! - **Leased / Receiving**: owned by the receiver's lease table (one entry, with an expiry).
//!   The sender never owns destination blocks; it only writes through the receiver.
//! - **Adopted**: after `Completed` the blocks belong to the decode request; the receiver
//!   forgets them and the engine frees them when the request ends.
//!
//! Every edge out of Leased/Receiving other than completion ends in exactly one
//! `Effect::Released`, which the actor turns into `sink.release(blocks)` and an error on the
//! lease's waiter; the sender is told with an `Abort` frame where a stream is still open:
//!
//! | event                                        | who frees        | receiver error    | sender error            |
//! |----------------------------------------------|------------------|-------------------|-------------------------|
//! | sender dies / drops its `KvSender` (stream ends or breaks) | receiver | `SenderGone` / `Truncated` / `Io` | (gone) |
//! | connection lost mid-transfer                 | receiver         | `SenderGone`/`Io` | `ConnectionLost`        |
//! | receiver dies                                | nobody: its pool dies with it | —    | `ConnectionLost`/`Timeout` |
//! | lease expires (timer, or `Open` after expiry)| receiver         | `LeaseExpired`    | `PeerAborted(LeaseExpired)` |
//! | request cancelled (`ReceiverHandle::cancel`) | receiver         | `Cancelled`       | `PeerAborted(Cancelled)` |
//! | corrupt chunk (CRC mismatch)                 | receiver         | `ChecksumMismatch`| `PeerAborted(Checksum)` |
//! | gap, out-of-bounds chunk, malformed frame    | receiver         | `ChunkGap` / `ChunkOutOfBounds` / `MalformedFrame` | `PeerAborted(..)` |
//! | layout, request or token-count mismatch at `Open` | receiver    | `LayoutMismatch` / `InvalidRequest` | `PeerAborted(LayoutMismatch)` |
//! | block write fails (`sink.write`)             | receiver         | `SinkWrite`       | `PeerAborted(Internal)` |
//!
//! Over RDMA (`rdma::send` and `rdma::handoff`, feature `rdma`) the payload never passes
//! through the receiver:
//! the sender writes it one-sided into the leased blocks and sends a `Landed` notice (with the
//! CRC-32) per write group, and the receiver checks the notices against its pool once every
//! group's immediate arrived. Every row above holds, with one more rule: a failed lease's
//! blocks go back to the pool only once no write of it can land any more: at once when the link
//! itself failed the lease (an error completion), else after the sender's `Drained` (it cancels
//! and waits for its writes first), a queue-pair reset when that does not come within the
//! quarantine, or the link's stream ending (the receiver then drops the queue pair). Until
//! then they count in `reserved_blocks`. An `Open` naming a link the receiver does not know (it
//! restarted, or dropped the link) is refused with `UnknownLink` and the lease kept: the sender
//! sets up a new link and opens again, once. A link serves only the peer (certificate name)
//! that set it up.
//!
//! A duplicate chunk (tokens already received) is dropped and reported, not an error; a chunk
//! or notice for a lease that already ended is late: dropped and reported. Over RDMA a
//! duplicate notice is a gap (notices are numbered per layer) and a corrupt payload is found at
//! `Complete`, once every write landed (`rdma::RdmaLease`, notice by notice in
//! `tests/rdma_lease.rs`). A sender whose layout differs from the ticket refuses
//! locally in [`sender::KvSender::start`] and never opens a stream.
//!
//! Invariant checked by every fault test (`tests/faults.rs`, over every stream transport and,
//! with the feature, the RDMA path; `tests/rdma_handoff.rs` for the RDMA-only rows): after the
//! dust settles both sides hold zero leased blocks (`ReceiverStats::reserved_blocks == 0`, the
//! pool's free count back where it started minus adopted blocks).

pub mod actor;
pub mod error;
pub mod frame;
#[allow(clippy::all)]
pub mod generated;
pub mod metrics;
pub mod payload;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod receiver;
pub mod sender;
pub mod sink;
pub mod transport;

pub use actor::{
    Completed, InProcessTransport, LeaseWaiter, ReceiverConfig, ReceiverHandle, ReceiverService, Reservation,
};
pub use error::{KvTransferError, Result};
pub use payload::KvWrite;
pub use receiver::ReceiverStats;
pub use sender::{ChunkSender, KvSender, LayerChunk, SendConfig, TransferReport};
pub use sink::{Ask, Grant, KvSink, MemoryPool, Reserved};
pub use transport::{NetTransport, Transport, TransportSet};
