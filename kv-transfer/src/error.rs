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
    #[error("tls: {0}")]
    Tls(String),
    #[error("certificate {path}: {reason}")]
    Cert { path: String, reason: String },
    #[error("connect to {addr} failed: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("connection to {addr} lost: {reason}")]
    ConnectionLost { addr: SocketAddr, reason: String },
    #[error("timed out after {ms} ms waiting for {what}")]
    Timeout { what: String, ms: u64 },
}
