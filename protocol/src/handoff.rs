//! The handoff ticket: what a decode node gives out when it has leased destination blocks for a
//! request, and what a prefill node needs to push that request's KV cache into them.
//!
//! Plain data shared by the nodes and the coordinator; the wire encoding of the transfer itself
//! lives in `cleave-kv-transfer`.
//!
//! Invariants of a ticket made by a receiver:
//! - `block_ids.len() == num_tokens.div_ceil(layout.block_size)`: block `i` holds tokens
//!   `[i * block_size, (i + 1) * block_size)` of the request;
//! - the lease is valid for `lease_ttl` from the moment the receiver issued the ticket; after
//!   that the receiver frees the blocks and refuses the transfer.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{KvLayout, RequestId};

/// Version of the handoff protocol spoken by this build. A receiver refuses any other.
pub const HANDOFF_VERSION: u16 = 1;

/// Identifies one lease of destination blocks on one receiver. Unique per receiver process
/// (a restarted receiver starts from a random base so stale tickets do not match new leases).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub u64);

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lease-{:016x}", self.0)
    }
}

/// How the KV bytes travel to the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransportKind {
    /// QUIC (quinn), mutual TLS 1.3, several streams per connection.
    Quic,
    /// TCP with mutual TLS (tokio-rustls).
    TcpTls,
    /// TCP without encryption: only on networks declared trusted.
    TcpPlain,
    /// Prefill and decode in the same process: a memory copy.
    InProcess,
    /// One-sided RDMA writes into the registered pool (feature `rdma`).
    Rdma,
}

/// Everything a sender needs to push one request's KV cache into leased blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoffTicket {
    /// [`HANDOFF_VERSION`] of the receiver that issued it.
    pub version: u16,
    pub request_id: RequestId,
    pub lease_id: LeaseId,
    /// Where the receiver accepts transfer streams.
    pub receiver_addr: SocketAddr,
    pub transport: TransportKind,
    /// The receiver's layout; a sender with any other layout refuses before moving a byte.
    pub layout: KvLayout,
    /// Destination blocks in position order (block `i` holds tokens `i*block_size..`).
    pub block_ids: Vec<u32>,
    /// Tokens whose K and V the sender must deliver for every layer.
    pub num_tokens: u32,
    /// How long the lease lives from issue; the sender should finish well within it.
    pub lease_ttl: Duration,
    /// The name in the receiver's certificate. A sender whose link is authenticated refuses a
    /// peer at `receiver_addr` that presents any other name (a redirected address, a stale
    /// ticket naming an address now held by another node). None where links are not
    /// authenticated (plain TCP, in-process).
    pub receiver_name: Option<String>,
    /// Leading tokens whose K and V the receiver already holds (a prefix of the prompt found in
    /// its prefix cache, pinned for the lease): the sender delivers tokens
    /// `cached_tokens..num_tokens` only. A multiple of the block size and below `num_tokens`
    /// (at least one token always travels), 0 when nothing is cached.
    #[serde(default)]
    pub cached_tokens: u32,
}

impl HandoffTicket {
    /// Blocks needed to hold `num_tokens` tokens with `block_size` tokens per block.
    pub fn blocks_for(num_tokens: u32, block_size: u32) -> usize {
        if block_size == 0 {
            return 0;
        }
        num_tokens.div_ceil(block_size) as usize
    }

    /// True when the block list matches the token count (see the module invariants).
    pub fn is_consistent(&self) -> bool {
        self.layout.block_size > 0
            && self.block_ids.len() == Self::blocks_for(self.num_tokens, self.layout.block_size)
            && self.cached_tokens < self.num_tokens
            && self.cached_tokens.is_multiple_of(self.layout.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    #[test]
    fn ticket_block_count_matches_tokens() {
        let layout = KvLayout {
            model_fingerprint: 1,
            dtype: KvDtype::F32,
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 16,
        };
        let mut t = HandoffTicket {
            version: HANDOFF_VERSION,
            request_id: RequestId(1),
            lease_id: LeaseId(2),
            receiver_addr: "127.0.0.1:1".parse().unwrap(),
            transport: TransportKind::TcpPlain,
            layout,
            block_ids: vec![0, 1],
            num_tokens: 17,
            lease_ttl: Duration::from_secs(1),
            receiver_name: None,
            cached_tokens: 16,
        };
        assert!(t.is_consistent());
        t.cached_tokens = 8;
        assert!(!t.is_consistent(), "not a whole block");
        t.cached_tokens = 0;
        t.num_tokens = 33;
        assert!(!t.is_consistent());
        t.num_tokens = 16;
        t.block_ids = vec![0];
        t.cached_tokens = 16;
        assert!(!t.is_consistent(), "every token cached: nothing would travel");
        assert_eq!(HandoffTicket::blocks_for(0, 16), 0);
    }
}
