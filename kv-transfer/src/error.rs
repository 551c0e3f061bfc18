//! The one error type of this crate. Variants carry the facts (addresses, ids, sizes) so that
//! both sides of a failed handoff can say what went wrong.
//!
//! Several modules add variants here: add, do not rename.

use std::net::SocketAddr;

pub type Result<T, E = KvTransferError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum KvTransferError {
    #[error("i/o error on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Opening or using a stream failed below the handoff (connect, TLS, QUIC).
    #[error(transparent)]
    Net(#[from] cleave_net::NetError),
    #[error("connection to {addr} lost: {reason}")]
    ConnectionLost { addr: SocketAddr, reason: String },
    #[error("timed out after {ms} ms waiting for {what}")]
    Timeout { what: String, ms: u64 },

    // --- handoff protocol (frame codec, receiver state machine, sender) ---
    #[error("malformed frame: {reason}")]
    MalformedFrame { reason: String },
    #[error("frame {what} of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { what: &'static str, len: usize, max: usize },
    #[error("frame truncated: stream ended after {got} of {expected} bytes")]
    Truncated { expected: usize, got: usize },
    #[error("handoff protocol version {got} not supported (this node speaks {supported})")]
    VersionUnsupported { got: u16, supported: u16 },
    #[error("kv layout mismatch on {field}: ours {ours}, theirs {theirs}")]
    LayoutMismatch { field: &'static str, ours: String, theirs: String },
    #[error("unknown lease {lease}")]
    UnknownLease { lease: cleave_protocol::LeaseId },
    #[error("lease {lease} expired")]
    LeaseExpired { lease: cleave_protocol::LeaseId },
    #[error("lease {lease} cancelled")]
    Cancelled { lease: cleave_protocol::LeaseId },
    #[error("checksum mismatch on {lease} layer {layer} tokens {token_start}+{token_count}: header {expected:#010x}, payload {got:#010x}")]
    ChecksumMismatch {
        lease: cleave_protocol::LeaseId,
        layer: u32,
        token_start: u32,
        token_count: u32,
        expected: u32,
        got: u32,
    },
    #[error("gap in {lease} layer {layer}: expected token {expected}, chunk starts at {got}")]
    ChunkGap { lease: cleave_protocol::LeaseId, layer: u32, expected: u32, got: u32 },
    #[error("chunk out of bounds on {lease}: {reason}")]
    ChunkOutOfBounds { lease: cleave_protocol::LeaseId, reason: String },
    #[error("out of kv blocks: need {need}, {free} free")]
    OutOfBlocks { need: usize, free: usize },
    #[error("invalid handoff request: {reason}")]
    InvalidRequest { reason: String },
    #[error("peer aborted {lease}: {code}: {reason}")]
    PeerAborted { lease: cleave_protocol::LeaseId, code: String, reason: String },
    #[error("sender of {lease} went away: {reason}")]
    SenderGone { lease: cleave_protocol::LeaseId, reason: String },
    #[error("protocol violation: {reason}")]
    Protocol { reason: String },
    #[error("block pool write failed on {lease}: {reason}")]
    SinkWrite { lease: cleave_protocol::LeaseId, reason: String },
    #[error("{what} is shut down")]
    Closed { what: &'static str },
    /// The peer at a ticket's address is not the receiver the ticket names (or may not
    /// receive KV at all): nothing was sent.
    #[error("refusing to send KV to {addr}: {reason}")]
    WrongReceiver { addr: SocketAddr, reason: String },

    // --- rdma transport (feature `rdma`; the variants exist in every build) ---
    #[error("rdma: {call} failed: errno {errno} ({message})")]
    RdmaVerbs { call: &'static str, errno: i32, message: String },
    #[error("rdma: no device {wanted} (devices present: [{found}])")]
    RdmaNoDevice { wanted: String, found: String },
    #[error("rdma: bad pool layout: {reason}")]
    RdmaLayout { reason: String },
    #[error("rdma: bad write plan: {reason}")]
    RdmaPlan { reason: String },
    #[error("rdma: bad queue-pair metadata: {reason}")]
    RdmaMetadata { reason: String },
    #[error("rdma: work request {wr_id} of lease tag {tag} completed with {status} (vendor error {vendor_err:#x})")]
    RdmaCompletion { wr_id: u64, tag: u16, status: String, vendor_err: u32 },
    #[error("rdma: completion tracking: {reason}")]
    RdmaTracker { reason: String },
    #[error("rdma: link {link} failed: {reason}")]
    RdmaLink { link: u64, reason: String },
    #[error("rdma: no link {link} on this receiver (it restarted or dropped the link)")]
    RdmaUnknownLink { link: u64 },
}
