//! TLS on the HTTP edge: the server configuration for clients of the OpenAI API, from an
//! operator's certificate chain and key (PEM files). Unlike the cluster's internal links
//! ([`crate::tls`]) the edge asks no client certificate (clients authenticate with API keys),
//! accepts TLS 1.2 as well as 1.3 (clients are whatever the operator's users run), and speaks
//! HTTP/1.1 (ALPN `http/1.1`).

use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::PrivateKeyDer;

use crate::tls::{cert_err, parse_certs, read_string};
use crate::Result;

/// The edge's rustls server configuration from `cert` (the chain, leaf first) and `key` (PKCS#8,
/// PKCS#1 or SEC1). Checked now: a key that does not match the certificate fails at startup.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>> {
    let chain = parse_certs(read_string(cert)?.as_bytes(), cert)?;
    if chain.is_empty() {
        return Err(cert_err(cert, "no certificate in file"));
    }
    let key_der: PrivateKeyDer<'static> = match rustls_pemfile::private_key(&mut read_string(key)?.as_bytes()) {
        Ok(Some(k)) => k,
        Ok(None) => return Err(cert_err(key, "no private key in file")),
        Err(e) => return Err(cert_err(key, e)),
    };
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| cert_err(cert, e))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| cert_err(key, format!("does not fit the certificate: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{CertFiles, ClusterCa};

    #[test]
    fn an_edge_certificate_from_the_cluster_ca_loads_and_a_foreign_key_is_refused() {
        let dir = std::env::temp_dir().join(format!("cleave-edge-{}", std::process::id()));
        let files = CertFiles { dir: dir.clone() };
        files.generate_edge(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        let cfg = server_config(&dir.join("edge.crt"), &dir.join("edge.key")).unwrap();
        assert_eq!(cfg.alpn_protocols, vec![b"http/1.1".to_vec()]);
        // Another certificate's key does not fit.
        let (_, other_key) = ClusterCa::generate().unwrap().issue_edge(&["localhost".into()]).unwrap();
        std::fs::write(dir.join("other.key"), other_key).unwrap();
        let e = server_config(&dir.join("edge.crt"), &dir.join("other.key")).unwrap_err().to_string();
        assert!(e.contains("other.key") && e.contains("does not fit"), "{e}");
        let e = server_config(&dir.join("missing.crt"), &dir.join("edge.key")).unwrap_err().to_string();
        assert!(e.contains("missing.crt"), "{e}");
        assert!(ClusterCa::generate().unwrap().issue_edge(&[]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
