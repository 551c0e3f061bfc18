//! kv-transfer: moves the KV cache of a request from the node that prefilled it into blocks that
//! another node leased for it. It moves bytes described by a [`cleave_protocol::KvLayout`] and
//! never sees engine types (see STYLE.md).
//!
//! Modules:
//! - [`net`]: authenticated byte streams to peers over QUIC or TCP (TLS or plain);
//! - [`tls`]: the cluster CA and node certificates (mutual TLS on every internal link).

pub mod error;
pub mod net;
pub mod tls;

pub use error::{KvTransferError, Result};
