//! The cluster CA and node certificates. Every internal link (QUIC, TCP+TLS) is mutual TLS 1.3:
//! a node presents a certificate signed by the cluster CA and accepts only peers that do.
//!
//! - [`ClusterCa`] generates the CA (ECDSA P-256) and issues node certificates with rcgen. A node
//!   certificate names the node once, as a DNS subject alternative name, and is valid for both
//!   server and client authentication, so one identity serves both ends of every link.
//! - [`NodeIdentity`] is what a node loads at startup: its chain, its key and the CA it trusts.
//!   It builds the rustls configs: the server *requires* a client certificate from the cluster
//!   CA ([`WebPkiClientVerifier`]); the client verifies the server's chain against the cluster
//!   CA.
//! - On disk (see [`ClusterCa::write_dir`] and [`NodeIdentity::load`]): `ca.crt`, `ca.key`,
//!   `<name>.crt` (node certificate then CA), `<name>.key` (PKCS#8), all PEM.
//!
//! Authentication is membership: any holder of a certificate from the cluster CA is a peer. A
//! client dials by address, not by name, so it accepts any cluster member at that address and
//! reports the member's name, roles and certificate fingerprint ([`crate::PeerInfo`]) for the
//! caller to check.
//!
//! Authorization is by role ([`Roles`]): a certificate names what its holder may be (prefill,
//! decode, coordinator) as extra DNS names `ROLE.role.cleave.internal` beside the node's own
//! name (DNS names, so the standard verifiers carry them; nobody dials them). The coordinator
//! refuses a registration whose certificate does not allow the role it claims (or names
//! another node), or that is revoked; a node takes requests only from a coordinator's
//! certificate. A certificate that names no role (issued before roles existed) allows the node
//! roles, never the coordinator's.
//!
//! Allowed dependencies: rustls (ring provider, chosen explicitly so that a second provider
//! linked into the binary never makes config building ambiguous), rcgen, rustls-webpki.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};

use crate::{NetError, Result};

/// What a certificate allows its holder to be. A colocated node (`both`) needs prefill and
/// decode; a node whose roles the planner may switch needs both as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Roles(u8);

impl Roles {
    pub const PREFILL: Roles = Roles(1);
    pub const DECODE: Roles = Roles(2);
    pub const COORDINATOR: Roles = Roles(4);
    /// Every node role (what `cleave certs` issues by default, and what a certificate without
    /// roles allows).
    pub const NODE: Roles = Roles(1 | 2);
    const NAMES: [(&'static str, Roles); 3] =
        [("prefill", Roles::PREFILL), ("decode", Roles::DECODE), ("coordinator", Roles::COORDINATOR)];

    /// Whether every role of `other` is allowed here.
    pub fn contains(self, other: Roles) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn union(self, other: Roles) -> Roles {
        Roles(self.0 | other.0)
    }

    /// The roles' names, in a fixed order.
    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES.iter().filter(|(_, r)| self.contains(*r)).map(|(n, _)| *n).collect()
    }

    /// Roles from names (`prefill`, `decode`, `coordinator`, and `node` for the first two).
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Roles> {
        let mut roles = Roles(0);
        for n in names {
            roles =
                roles.union(match n.trim() {
                    "node" => Roles::NODE,
                    n => Self::NAMES.iter().find(|(name, _)| *name == n).map(|(_, r)| *r).ok_or_else(|| {
                        NetError::Tls(format!("unknown role `{n}` (prefill, decode, coordinator, node)"))
                    })?,
                });
        }
        if roles.0 == 0 {
            return Err(NetError::Tls("a certificate needs at least one role".into()));
        }
        Ok(roles)
    }

    fn san(name: &str) -> String {
        format!("{name}{ROLE_SUFFIX}")
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names().join(","))
    }
}

/// The DNS-name suffix of the role names in a certificate.
const ROLE_SUFFIX: &str = ".role.cleave.internal";

/// ALPN protocol of every cleave link; a peer speaking anything else is refused in the handshake.
pub const ALPN: &[u8] = b"cleave/1";

/// Common name of every cluster CA this module generates. Re-deriving a signer from `ca.key`
/// relies on it being constant (the issuer name of node certificates must match).
const CA_COMMON_NAME: &str = "cleave cluster CA";

fn tls_err(e: impl fmt::Display) -> NetError {
    NetError::Tls(e.to_string())
}

pub(crate) fn cert_err(path: &Path, e: impl fmt::Display) -> NetError {
    NetError::Cert { path: path.display().to_string(), reason: e.to_string() }
}

/// The crypto provider of every config here (ring), TLS 1.3 suites only, AES-128-GCM first:
/// it does 10 AES rounds per block against AES-256's 14, and bulk KV bytes are what these links
/// carry (both are 128-bit-secure against everything but a quantum adversary).
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite as cs;
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites =
        vec![cs::TLS13_AES_128_GCM_SHA256, cs::TLS13_AES_256_GCM_SHA384, cs::TLS13_CHACHA20_POLY1305_SHA256];
    Arc::new(p)
}

/// Checks that `name` can be a node name: a DNS name (letters, digits, `-`, `.`), which is what
/// goes into the certificate's subject alternative name.
pub fn validate_node_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
        && !name.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(NetError::Tls(format!("node name `{name}` is not a DNS name (letters, digits, '-', '.')")))
    }
}

/// The cluster certificate authority: signs node certificates.
pub struct ClusterCa {
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    key: KeyPair,
    /// A certificate with the CA's name and key, used only as the issuer when signing (rcgen
    /// needs one); equal to the CA certificate in everything a verifier checks.
    signer: rcgen::Certificate,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

fn ca_params() -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

impl ClusterCa {
    /// A fresh CA with a new P-256 key.
    pub fn generate() -> Result<Self> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = ca_params()?.self_signed(&key).map_err(tls_err)?;
        Ok(Self {
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            signer: ca_params()?.self_signed(&key).map_err(tls_err)?,
            key,
        })
    }

    /// A CA from its PEM certificate and key (as written by [`ClusterCa::write_dir`]).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem).map_err(tls_err)?;
        let cert_der = parse_certs(cert_pem.as_bytes(), Path::new("ca.crt"))?
            .into_iter()
            .next()
            .ok_or_else(|| tls_err("CA PEM holds no certificate"))?;
        Ok(Self {
            cert_der,
            cert_pem: cert_pem.to_string(),
            signer: ca_params()?.self_signed(&key).map_err(tls_err)?,
            key,
        })
    }

    /// Reads `ca.crt` and `ca.key` from `dir`.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let cert_pem = read_string(&dir.join("ca.crt"))?;
        let key_path = dir.join("ca.key");
        let key_pem = read_string(&key_path)?;
        Self::from_pem(&cert_pem, &key_pem).map_err(|e| cert_err(&key_path, e))
    }

    /// Writes `ca.crt` and `ca.key` into `dir` (created if missing).
    pub fn write_dir(&self, dir: &Path) -> Result<()> {
        create_dir(dir)?;
        write_file(&dir.join("ca.crt"), self.cert_pem.as_bytes(), false)?;
        write_file(&dir.join("ca.key"), self.key.serialize_pem().as_bytes(), true)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate for node `name` with every node role ([`ClusterCa::issue_with`]).
    pub fn issue(&self, name: &str) -> Result<NodeIdentity> {
        self.issue_with(name, Roles::NODE)
    }

    /// Issues a certificate for `name` (new P-256 key), valid for server and client auth,
    /// allowing `roles`.
    pub fn issue_with(&self, name: &str, roles: Roles) -> Result<NodeIdentity> {
        validate_node_name(name)?;
        if name.ends_with(ROLE_SUFFIX) {
            return Err(NetError::Tls(format!("node name `{name}` ends with the reserved `{ROLE_SUFFIX}`")));
        }
        let mut sans = vec![name.to_string()];
        sans.extend(roles.names().into_iter().map(Roles::san));
        let mut params = CertificateParams::new(sans).map_err(tls_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = params.signed_by(&key, &self.signer, &self.key).map_err(tls_err)?;
        Ok(NodeIdentity {
            name: name.to_string(),
            chain: vec![cert.der().clone(), self.cert_der.clone()],
            key: Arc::new(PrivatePkcs8KeyDer::from(key.serialize_der())),
            ca: self.cert_der.clone(),
        })
    }
}

impl ClusterCa {
    /// A server certificate for the HTTP edge, naming `hosts` (an IP address becomes an IP
    /// subject alternative name, anything else a DNS one), valid for server authentication
    /// only. Returns the chain (leaf, then this CA) and the PKCS#8 key, both PEM. For internal
    /// deployments and tests; a public edge takes its certificate from a public CA.
    pub fn issue_edge(&self, hosts: &[String]) -> Result<(String, String)> {
        if hosts.is_empty() {
            return Err(tls_err("an edge certificate needs at least one host name or address"));
        }
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
        for h in hosts {
            params.subject_alt_names.push(match h.parse::<std::net::IpAddr>() {
                Ok(ip) => rcgen::SanType::IpAddress(ip),
                Err(_) => {
                    validate_node_name(h)?;
                    rcgen::SanType::DnsName(h.clone().try_into().map_err(tls_err)?)
                }
            });
        }
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, hosts[0].as_str());
        params.distinguished_name = dn;
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = params.signed_by(&key, &self.signer, &self.key).map_err(tls_err)?;
        Ok((format!("{}{}", cert.pem(), self.cert_pem), key.serialize_pem()))
    }
}

/// A node's certificate chain and key, plus the cluster CA it trusts.
///
/// Invariant: `chain[0]` is the node's certificate, naming `name`, issued by `ca`.
#[derive(Clone)]
pub struct NodeIdentity {
    name: String,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivatePkcs8KeyDer<'static>>,
    ca: CertificateDer<'static>,
}

impl fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeIdentity").field("name", &self.name).finish_non_exhaustive()
    }
}

impl NodeIdentity {
    /// A fresh in-memory cluster (new CA) with one identity per name, in order. For tests and
    /// benchmarks.
    pub fn generate_test_cluster(names: &[&str]) -> Result<Vec<NodeIdentity>> {
        let ca = ClusterCa::generate()?;
        names.iter().map(|n| ca.issue(n)).collect()
    }

    /// The node name of this identity's certificate.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What this identity's certificate allows ([`cert_roles`]).
    pub fn roles(&self) -> Roles {
        cert_roles(&self.chain[0])
    }

    /// SHA-256 of this identity's certificate ([`fingerprint`]).
    pub fn fingerprint(&self) -> [u8; 32] {
        fingerprint(&self.chain[0])
    }

    /// Reads `<name>.crt`, `<name>.key` and `ca.crt` from `dir`, checking that the certificate
    /// names `name` and was issued by the CA there.
    pub fn load(dir: &Path, name: &str) -> Result<Self> {
        validate_node_name(name)?;
        let crt_path = dir.join(format!("{name}.crt"));
        let key_path = dir.join(format!("{name}.key"));
        let ca_path = dir.join("ca.crt");
        let chain = parse_certs(read_string(&crt_path)?.as_bytes(), &crt_path)?;
        let ca = parse_certs(read_string(&ca_path)?.as_bytes(), &ca_path)?
            .into_iter()
            .next()
            .ok_or_else(|| cert_err(&ca_path, "no certificate in file"))?;
        let key = match rustls_pemfile::private_key(&mut read_string(&key_path)?.as_bytes()) {
            Ok(Some(PrivateKeyDer::Pkcs8(k))) => k.clone_key(),
            Ok(Some(_)) => return Err(cert_err(&key_path, "key is not PKCS#8")),
            Ok(None) => return Err(cert_err(&key_path, "no private key in file")),
            Err(e) => return Err(cert_err(&key_path, e)),
        };
        let Some(leaf) = chain.first() else {
            return Err(cert_err(&crt_path, "no certificate in file"));
        };
        if cert_name(leaf).as_deref() != Some(name) {
            return Err(cert_err(&crt_path, format!("certificate does not name `{name}`")));
        }
        let id = Self { name: name.to_string(), chain, key: Arc::new(key), ca };
        // Verify the chain against the CA now, so a wrong file fails at startup, not at the
        // first handshake.
        id.client_verifier_check().map_err(|e| cert_err(&crt_path, e))?;
        Ok(id)
    }

    /// Writes `<name>.crt` (chain) and `<name>.key` into `dir`; `ca.crt` too if missing.
    pub fn write_dir(&self, dir: &Path) -> Result<()> {
        create_dir(dir)?;
        let chain_pem: String = self.chain.iter().map(|c| pem_cert(c)).collect();
        write_file(&dir.join(format!("{}.crt", self.name)), chain_pem.as_bytes(), false)?;
        let key_pem = pem_block("PRIVATE KEY", self.key.secret_pkcs8_der());
        write_file(&dir.join(format!("{}.key", self.name)), key_pem.as_bytes(), true)?;
        let ca_path = dir.join("ca.crt");
        if !ca_path.exists() {
            write_file(&ca_path, pem_cert(&self.ca).as_bytes(), false)?;
        }
        Ok(())
    }

    /// Bytes that are secret and stable for this identity (a digest of the private key): the
    /// QUIC stateless-reset key is derived from them, so a node restarted with the same identity
    /// can reset the connections of its previous life and peers notice at once.
    pub(crate) fn secret_digest(&self) -> [u8; 32] {
        let d = ring::digest::digest(&ring::digest::SHA256, self.key.secret_pkcs8_der());
        let mut out = [0u8; 32];
        out.copy_from_slice(d.as_ref());
        out
    }

    fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(tls_err)?;
        Ok(Arc::new(roots))
    }

    fn client_verifier_check(&self) -> Result<()> {
        let verifier = ClusterServerVerifier::new(self.roots()?)?;
        verifier
            .verify_server_cert(&self.chain[0], &self.chain[1..], &placeholder_name(), &[], now())
            .map(|_| ())
            .map_err(tls_err)
    }

    /// TLS 1.3 server config: presents this identity, requires a client certificate from the
    /// cluster CA, offers ALPN [`ALPN`].
    pub fn server_config(&self) -> Result<rustls::ServerConfig> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots()?, provider()).build().map_err(tls_err)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), PrivateKeyDer::Pkcs8(self.key.clone_key()))
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// TLS 1.3 client config: presents this identity, accepts a server whose chain leads to the
    /// cluster CA (any node name; see the module docs), offers ALPN [`ALPN`].
    pub fn client_config(&self) -> Result<rustls::ClientConfig> {
        let verifier = Arc::new(ClusterServerVerifier::new(self.roots()?)?);
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(self.chain.clone(), PrivateKeyDer::Pkcs8(self.key.clone_key()))
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }
}

impl NodeIdentity {
    /// A client config that trusts the cluster CA like [`NodeIdentity::client_config`] but
    /// presents no certificate: only for tests that check servers refuse such a client.
    #[doc(hidden)]
    pub fn anonymous_client_config(&self) -> Result<rustls::ClientConfig> {
        let verifier = Arc::new(ClusterServerVerifier::new(self.roots()?)?);
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }
}

/// The name a client passes to the handshake (SNI). Servers ignore it; the verifier checks the
/// chain with the name the certificate itself carries.
pub(crate) fn placeholder_name() -> ServerName<'static> {
    ServerName::try_from("cleave-node").expect("static DNS name")
}

fn now() -> UnixTime {
    UnixTime::now()
}

/// The node name (first DNS subject alternative name) of a DER certificate.
pub fn cert_name(cert: &CertificateDer<'_>) -> Option<String> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    let name = ee.valid_dns_names().find(|n| !n.ends_with(ROLE_SUFFIX)).map(str::to_string);
    name
}

/// The roles a certificate allows: those it names, or [`Roles::NODE`] when it names none.
pub fn cert_roles(cert: &CertificateDer<'_>) -> Roles {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else { return Roles::NODE };
    let named: Vec<&str> = ee.valid_dns_names().filter_map(|n| n.strip_suffix(ROLE_SUFFIX)).collect();
    if named.is_empty() {
        return Roles::NODE;
    }
    // An unknown role name (from a newer release) allows nothing more.
    named.into_iter().filter_map(|n| Roles::parse([n]).ok()).fold(Roles(0), Roles::union)
}

/// SHA-256 of a certificate's DER: what a revocation list names, in hex.
pub fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// A fingerprint as lowercase hex.
pub fn fingerprint_hex(f: &[u8; 32]) -> String {
    f.iter().map(|b| format!("{b:02x}")).collect()
}

/// Verifies a server's chain against the cluster CA with rustls' own WebPKI verifier, using as
/// the expected name the one the certificate carries: chain, validity, key usage and signature
/// checks are the standard ones; only "which member" is left to the caller.
#[derive(Debug)]
struct ClusterServerVerifier {
    inner: Arc<WebPkiServerVerifier>,
}

impl ClusterServerVerifier {
    fn new(roots: Arc<RootCertStore>) -> Result<Self> {
        let inner = WebPkiServerVerifier::builder_with_provider(roots, provider()).build().map_err(tls_err)?;
        Ok(Self { inner })
    }
}

impl ServerCertVerifier for ClusterServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let name =
            cert_name(end_entity).ok_or(rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding))?;
        let name = ServerName::try_from(name)
            .map_err(|_| rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding))?;
        self.inner.verify_server_cert(end_entity, intermediates, &name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

pub(crate) fn parse_certs(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let mut rd = pem;
    rustls_pemfile::certs(&mut rd).collect::<std::result::Result<Vec<_>, _>>().map_err(|e| cert_err(path, e))
}

fn pem_block(label: &str, der: &[u8]) -> String {
    pem_encode(label, der)
}

fn pem_cert(c: &CertificateDer<'_>) -> String {
    pem_encode("CERTIFICATE", c.as_ref())
}

/// PEM armour (RFC 7468): base64 in lines of 64.
fn pem_encode(label: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len() * 4 / 3 + 4);
    for chunk in der.chunks(3) {
        let n = chunk.len();
        let v = (chunk[0] as u32) << 16
            | (chunk.get(1).copied().unwrap_or(0) as u32) << 8
            | chunk.get(2).copied().unwrap_or(0) as u32;
        for i in 0..4 {
            if i <= n {
                b64.push(ALPHABET[(v >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ascii"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

pub(crate) fn read_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| cert_err(path, e))
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| cert_err(dir, e))
}

/// Writes a file; a key file is created with mode 0600 on Unix.
fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut f = opts.open(path).map_err(|e| cert_err(path, e))?;
    f.write_all(bytes).map_err(|e| cert_err(path, e))
}

/// Where `cleave certs` writes: the files of a CA and its nodes in one directory.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub dir: PathBuf,
}

impl CertFiles {
    /// The CA in `dir`, created (and written) if there is none; `written` gets the new files.
    fn ca(&self, written: &mut Vec<PathBuf>) -> Result<ClusterCa> {
        if self.dir.join("ca.key").exists() {
            return ClusterCa::load_dir(&self.dir);
        }
        let ca = ClusterCa::generate()?;
        ca.write_dir(&self.dir)?;
        written.push(self.dir.join("ca.crt"));
        written.push(self.dir.join("ca.key"));
        Ok(ca)
    }

    /// Issues `edge.crt` (chain) and `edge.key` for the HTTP edge naming `hosts`
    /// ([`ClusterCa::issue_edge`]), with the CA of `dir` (created if missing). Returns the paths
    /// written.
    pub fn generate_edge(&self, hosts: &[String]) -> Result<Vec<PathBuf>> {
        let mut written = Vec::new();
        let ca = self.ca(&mut written)?;
        let (chain, key) = ca.issue_edge(hosts)?;
        write_file(&self.dir.join("edge.crt"), chain.as_bytes(), false)?;
        write_file(&self.dir.join("edge.key"), key.as_bytes(), true)?;
        written.extend([self.dir.join("edge.crt"), self.dir.join("edge.key")]);
        Ok(written)
    }

    /// Creates the CA in `dir` if it has none (else reuses it), then issues a certificate for
    /// each name with every node role, replacing an existing one. Returns the paths written.
    pub fn generate(&self, names: &[String]) -> Result<Vec<PathBuf>> {
        self.generate_with(names, Roles::NODE)
    }

    /// [`CertFiles::generate`] with `roles` for every name.
    pub fn generate_with(&self, names: &[String], roles: Roles) -> Result<Vec<PathBuf>> {
        // Every name is checked before anything is written.
        names.iter().try_for_each(|n| validate_node_name(n))?;
        let mut written = Vec::new();
        let ca = self.ca(&mut written)?;
        for name in names {
            ca.issue_with(name, roles)?.write_dir(&self.dir)?;
            written.push(self.dir.join(format!("{name}.crt")));
            written.push(self.dir.join(format!("{name}.key")));
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_round_trips_through_rustls_pemfile() {
        for len in 0..10 {
            let der: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37)).collect();
            let pem = pem_encode("CERTIFICATE", &der);
            let got = rustls_pemfile::certs(&mut pem.as_bytes()).next();
            if len == 0 {
                // An empty block parses as an empty certificate or nothing; either is fine.
                continue;
            }
            assert_eq!(got.unwrap().unwrap().as_ref(), &der[..], "len {len}");
        }
    }

    #[test]
    fn node_names_are_dns_names() {
        for ok in ["prefill-0", "decode.a", "n1"] {
            validate_node_name(ok).unwrap();
        }
        for bad in ["", "-a", "a..b", "a b", "10.0.0.1", "é"] {
            assert!(validate_node_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn issued_identity_names_itself_and_builds_configs() {
        let ids = NodeIdentity::generate_test_cluster(&["a", "b"]).unwrap();
        assert_eq!(ids[0].name(), "a");
        assert_eq!(cert_name(&ids[1].chain[0]).as_deref(), Some("b"));
        ids[0].server_config().unwrap();
        ids[0].client_config().unwrap();
        ids[0].client_verifier_check().unwrap();
    }

    #[test]
    fn files_round_trip_and_ca_is_reused() {
        let dir = std::env::temp_dir().join(format!("cleave-certs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = CertFiles { dir: dir.clone() };
        files.generate(&["p0".into()]).unwrap();
        let ca_before = std::fs::read(dir.join("ca.crt")).unwrap();
        // A second run issues a new node with the existing CA.
        files.generate(&["d0".into()]).unwrap();
        assert_eq!(std::fs::read(dir.join("ca.crt")).unwrap(), ca_before);
        let p0 = NodeIdentity::load(&dir, "p0").unwrap();
        let d0 = NodeIdentity::load(&dir, "d0").unwrap();
        assert_eq!(p0.ca, d0.ca);
        assert!(NodeIdentity::load(&dir, "nobody").is_err());
        // A certificate of another CA does not load against this directory's CA.
        let other = NodeIdentity::generate_test_cluster(&["x"]).unwrap().remove(0);
        let odir = dir.join("other");
        other.write_dir(&odir).unwrap();
        std::fs::copy(dir.join("ca.crt"), odir.join("ca.crt")).unwrap();
        assert!(NodeIdentity::load(&odir, "x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_certificate_names_its_roles_beside_its_name() {
        let ca = ClusterCa::generate().unwrap();
        for (roles, want) in [
            (Roles::PREFILL, "prefill"),
            (Roles::NODE, "prefill,decode"),
            (Roles::COORDINATOR, "coordinator"),
            (Roles::parse(["decode", "coordinator"]).unwrap(), "decode,coordinator"),
        ] {
            let id = ca.issue_with("n-1", roles).unwrap();
            assert_eq!(cert_name(&id.chain[0]).as_deref(), Some("n-1"));
            assert_eq!(cert_roles(&id.chain[0]), roles);
            assert_eq!(roles.to_string(), want);
            // The chain still verifies as the node's own name.
            id.client_verifier_check().unwrap();
        }
        assert!(Roles::NODE.contains(Roles::PREFILL) && !Roles::NODE.contains(Roles::COORDINATOR));
        assert!(Roles::parse(["wizard"]).is_err() && Roles::parse([]).is_err());
        assert!(ca.issue_with("x.role.cleave.internal", Roles::NODE).is_err());
        // A certificate without role names (issued before roles) allows the node roles only.
        let mut params = CertificateParams::new(vec!["old".to_string()]).unwrap();
        params.is_ca = IsCa::NoCa;
        let key = KeyPair::generate().unwrap();
        let old = params.signed_by(&key, &ca.signer, &ca.key).unwrap();
        assert_eq!(cert_roles(old.der()), Roles::NODE);
        assert_eq!(cert_name(old.der()).as_deref(), Some("old"));
        let (a, b) = (fingerprint(old.der()), fingerprint(&ca.issue("old").unwrap().chain[0]));
        assert_ne!(a, b);
        assert_eq!(fingerprint_hex(&a).len(), 64);
    }
}
