//! The cluster CA and node certificates. Every internal link (QUIC, TCP+TLS) is mutual TLS 1.3:
//! a node presents a certificate signed by the cluster CA and accepts only peers that do.

/// A node's certificate chain and key, plus the cluster CA it trusts.
#[derive(Clone)]
pub struct NodeIdentity {
    _private: (),
}
