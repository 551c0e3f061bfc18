//! Link setup: before any RDMA write, the two sides of a new link exchange their queue-pair
//! metadata over a control stream (a QUIC stream between the nodes, mutually authenticated like
//! every other), each connects its queue pair to the other's, and each gets its link end.
//!
//! On the stream, in order: the sender writes its [`QpMetadata`] (no region), the receiver
//! answers with its own, which carries the KV pool's [`super::RemoteRegion`]. Each message is a
//! 2-byte big-endian length and the flatbuffer ([`QpMetadata::encode`]); a length over
//! [`MAX_METADATA_BYTES`], a truncated message, an unknown version, invalid fields, a receiver
//! without a region, or a peer silent past the limit is a clear error on that side, and nothing
//! is left half set up: a queue pair not handed out is dropped (destroyed) with the error.
//!
//! Queue pairs come from a [`Provider`]: [`super::verbs`] on a device and [`super::sim`] in
//! memory are its two implementations.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::link::{RecvLink, RecvLinkConfig, RecvOps, SendLink, SendLinkConfig, SendOps};
use super::meta::{QpMetadata, MAX_METADATA_BYTES};
use crate::error::{KvTransferError, Result};
use crate::net::DuplexStream;

/// Where queue pairs come from. Creating one yields its metadata for the peer; connecting it to
/// the peer's metadata yields the link end's operations.
pub trait Provider: Send + Sync {
    type PendingSend: Send;
    type Send: SendOps + Send + 'static;
    type PendingRecv: Send;
    type Recv: RecvOps + Send + 'static;
    /// A sending queue pair (with its registered staging memory); its metadata has no region.
    fn create_send(&self) -> Result<(Self::PendingSend, QpMetadata)>;
    fn connect_send(&self, pending: Self::PendingSend, remote: &QpMetadata) -> Result<Self::Send>;
    /// A receiving queue pair; its metadata carries the registered KV pool.
    fn create_recv(&self) -> Result<(Self::PendingRecv, QpMetadata)>;
    fn connect_recv(&self, pending: Self::PendingRecv, remote: &QpMetadata) -> Result<Self::Recv>;
}

/// Writes one metadata message.
pub async fn write_metadata<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, m: &QpMetadata) -> Result<()> {
    let body = m.encode()?;
    let len = u16::try_from(body.len())
        .ok()
        .filter(|n| (*n as usize) <= MAX_METADATA_BYTES)
        .ok_or_else(|| KvTransferError::RdmaMetadata { reason: format!("{} bytes is too long to send", body.len()) })?;
    let io = |source| KvTransferError::Io { what: "rdma metadata".into(), source };
    w.write_all(&len.to_be_bytes()).await.map_err(io)?;
    w.write_all(&body).await.map_err(io)?;
    w.flush().await.map_err(io)
}

/// Reads one metadata message; it is validated (see [`QpMetadata::decode`]).
pub async fn read_metadata<R: AsyncRead + Unpin + ?Sized>(r: &mut R) -> Result<QpMetadata> {
    let mut prefix = [0u8; 2];
    read_exact(r, &mut prefix, 0).await?;
    let len = u16::from_be_bytes(prefix) as usize;
    if len == 0 || len > MAX_METADATA_BYTES {
        return Err(KvTransferError::RdmaMetadata {
            reason: format!("message of {len} bytes (1..={MAX_METADATA_BYTES} expected)"),
        });
    }
    let mut body = vec![0u8; len];
    read_exact(r, &mut body, 2).await?;
    QpMetadata::decode(&body)
}

async fn read_exact<R: AsyncRead + Unpin + ?Sized>(r: &mut R, buf: &mut [u8], before: usize) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = r
            .read(&mut buf[got..])
            .await
            .map_err(|source| KvTransferError::Io { what: "rdma metadata".into(), source })?;
        if n == 0 {
            return Err(KvTransferError::Truncated { expected: before + buf.len(), got: before + got });
        }
        got += n;
    }
    Ok(())
}

async fn bounded<T>(limit: Duration, what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| KvTransferError::Timeout { what: what.into(), ms: limit.as_millis() as u64 })?
}

/// The sending side (prefill node): sends its metadata, reads the receiver's, connects.
pub async fn connect<P: Provider>(
    stream: &mut DuplexStream,
    provider: &P,
    cfg: SendLinkConfig,
    limit: Duration,
) -> Result<SendLink<P::Send>> {
    let (pending, local) = provider.create_send()?;
    bounded(limit, "rdma link setup (sender)", async {
        write_metadata(&mut stream.send, &local).await?;
        let remote = read_metadata(&mut stream.recv).await?;
        if remote.region.is_none() {
            return Err(KvTransferError::RdmaMetadata {
                reason: "the receiver's metadata describes no memory region".into(),
            });
        }
        let ops = provider.connect_send(pending, &remote)?;
        SendLink::new(ops, &remote, cfg)
    })
    .await
}

/// The receiving side (decode node): reads the sender's metadata, answers with its own (and the
/// pool's region), connects.
pub async fn accept<P: Provider>(
    stream: &mut DuplexStream,
    provider: &P,
    cfg: RecvLinkConfig,
    limit: Duration,
) -> Result<RecvLink<P::Recv>> {
    bounded(limit, "rdma link setup (receiver)", async {
        let remote = read_metadata(&mut stream.recv).await?;
        let (pending, local) = provider.create_recv()?;
        write_metadata(&mut stream.send, &local).await?;
        let ops = provider.connect_recv(pending, &remote)?;
        RecvLink::new(ops, cfg)
    })
    .await
}
