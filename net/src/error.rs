//! The one error type of this crate: what can go wrong setting up, authenticating or using a
//! connection. Variants carry the facts (addresses, paths, what was being done) so that a log
//! line alone says which link failed and why.

use std::net::SocketAddr;

pub type Result<T, E = NetError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("i/o error on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A TLS or QUIC configuration could not be built, or a setting is invalid.
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
    #[error("unknown transport `{0}` (quic, tcp-tls, tcp-plain)")]
    UnknownKind(String),
}

/// Maps an I/O error of `what` into this crate's error.
pub fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Io { what, source }
}
