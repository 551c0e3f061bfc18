//! Metric names of the KV handoff, all in one place (`cleave_kv_transfer_*`, units in the
//! name), and the helpers that record them. Recorded through the `metrics` facade: a node that
//! installs an exporter (Prometheus) publishes them; without one they cost a few atomic loads.
//!
//! Labels: `side` (`sender` | `receiver`), `transport` (`quic`, `tcp-tls`, `tcp-plain`,
//! `in-process`, `rdma`), `cause` (see [`cause`]), `outcome` (`completed` | `failed`).

use std::time::Duration;

use cleave_protocol::TransportKind;

use crate::KvTransferError;

/// Time a `reserve` call took from the decode node's request to the granted ticket (seconds).
pub const RESERVATION_WAIT_SECONDS: &str = "cleave_kv_transfer_reservation_wait_seconds";
/// Reservations refused, by cause (`out_of_blocks`, `invalid`, ...).
pub const RESERVATIONS_REFUSED_TOTAL: &str = "cleave_kv_transfer_reservations_refused_total";
/// Handoffs that ended, by side, transport and outcome.
pub const HANDOFFS_TOTAL: &str = "cleave_kv_transfer_handoffs_total";
/// Handoffs that failed, by side, transport and cause.
pub const FAILURES_TOTAL: &str = "cleave_kv_transfer_failures_total";
/// Payload bytes (K and V) moved, by side and transport: on the sender, those of completed
/// handoffs; on the receiver, those written into the block pool as they land (a lease that
/// fails later keeps its count: the bytes did move).
pub const BYTES_TOTAL: &str = "cleave_kv_transfer_bytes_total";
/// Wall time of a completed handoff on the sender, start to Ack (seconds), by transport.
pub const HANDOFF_SECONDS: &str = "cleave_kv_transfer_handoff_seconds";
/// Throughput of a completed handoff on the sender (bytes per second), by transport.
pub const THROUGHPUT_BYTES_PER_SECOND: &str = "cleave_kv_transfer_throughput_bytes_per_second";
/// Chunks dropped without being written, by reason (`duplicate` | `late`).
pub const CHUNKS_DROPPED_TOTAL: &str = "cleave_kv_transfer_chunks_dropped_total";
/// Streams refused at accept because the peer's certificate does not allow the prefill role.
pub const STREAMS_REFUSED_TOTAL: &str = "cleave_kv_transfer_streams_refused_total";
/// Blocks currently held by leases on this receiver.
pub const LEASED_BLOCKS: &str = "cleave_kv_transfer_leased_blocks";

pub fn transport_label(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Quic => "quic",
        TransportKind::TcpTls => "tcp-tls",
        TransportKind::TcpPlain => "tcp-plain",
        TransportKind::InProcess => "in-process",
        TransportKind::Rdma => "rdma",
    }
}

/// The `cause` label of an error: a short, bounded set of values.
pub fn cause(e: &KvTransferError) -> &'static str {
    use cleave_net::NetError;
    use KvTransferError as E;
    match e {
        E::Io { .. } => "io",
        E::Net(n) => match n {
            NetError::Io { .. } => "io",
            NetError::Tls(_) | NetError::Cert { .. } | NetError::UnknownKind(_) => "tls",
            NetError::Connect { .. } => "connect",
            NetError::ConnectionLost { .. } => "connection_lost",
            NetError::Timeout { .. } => "timeout",
        },
        E::ConnectionLost { .. } => "connection_lost",
        E::Timeout { .. } => "timeout",
        E::MalformedFrame { .. } | E::FrameTooLarge { .. } | E::Protocol { .. } => "malformed",
        E::Truncated { .. } => "truncated",
        E::VersionUnsupported { .. } => "version",
        E::LayoutMismatch { .. } => "layout_mismatch",
        E::UnknownLease { .. } => "unknown_lease",
        E::LeaseExpired { .. } => "lease_expired",
        E::Cancelled { .. } => "cancelled",
        E::ChecksumMismatch { .. } => "checksum",
        E::ChunkGap { .. } => "gap",
        E::ChunkOutOfBounds { .. } => "out_of_bounds",
        E::OutOfBlocks { .. } => "out_of_blocks",
        E::InvalidRequest { .. } => "invalid",
        E::PeerAborted { .. } => "peer_aborted",
        E::SenderGone { .. } => "sender_gone",
        E::SinkWrite { .. } => "sink_write",
        E::Closed { .. } => "closed",
        E::WrongReceiver { .. } => "wrong_receiver",
        E::RdmaLink { .. } | E::RdmaUnknownLink { .. } | E::RdmaCompletion { .. } | E::RdmaTracker { .. } => "rdma",
        _ => "other",
    }
}

pub(crate) fn record_failure(side: &'static str, transport: TransportKind, e: &KvTransferError) {
    let t = transport_label(transport);
    metrics::counter!(HANDOFFS_TOTAL, "side" => side, "transport" => t, "outcome" => "failed").increment(1);
    metrics::counter!(FAILURES_TOTAL, "side" => side, "transport" => t, "cause" => cause(e)).increment(1);
}

/// A completed handoff; `sent` (bytes and wall time) on the sender only: the receiver counts
/// its bytes as they land.
pub(crate) fn record_success(side: &'static str, transport: TransportKind, sent: Option<(u64, Duration)>) {
    let t = transport_label(transport);
    metrics::counter!(HANDOFFS_TOTAL, "side" => side, "transport" => t, "outcome" => "completed").increment(1);
    if let Some((bytes, d)) = sent {
        metrics::counter!(BYTES_TOTAL, "side" => side, "transport" => t).increment(bytes);
        metrics::histogram!(HANDOFF_SECONDS, "transport" => t).record(d.as_secs_f64());
        metrics::histogram!(THROUGHPUT_BYTES_PER_SECOND, "transport" => t)
            .record(bytes as f64 / d.as_secs_f64().max(1e-9));
    }
}
