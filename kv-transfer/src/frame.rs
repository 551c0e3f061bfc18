//! The frame codec of the handoff protocol.
//!
//! A frame on the wire is
//! `[u32 LE header_len][u32 LE payload_len][header: a flatbuffers `Frame`][payload]`.
//! Only [`Frame::Chunk`] carries a payload (K then V); every other frame has `payload_len == 0`.
//!
//! Invariants (checked by [`parse_prefix`] and [`parse_header`] before any payload is read or
//! allocated):
//! - `header_len <= MAX_HEADER_BYTES` and `payload_len <= Limits::max_payload`;
//! - the header verifies as a flatbuffer and its `version` is [`HANDOFF_VERSION`];
//! - a chunk's `k_len + v_len == payload_len`, `k_len == v_len`, and when a layout is known,
//!   `k_len == token_count * num_kv_heads * head_dim * dtype_size` and `layer < num_layers`;
//! - payloads are never copied after they are read: [`decode_frame`] splits them off the read
//!   buffer and `k`, `v` are slices of the same [`Bytes`].
//!
//! Every failure is an error value ([`KvTransferError::MalformedFrame`], `FrameTooLarge`,
//! `Truncated`, `VersionUnsupported`), never a panic: `tests/fuzz_frames.rs` holds the decoder to
//! that over arbitrary bytes and mutations of valid frames.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use cleave_protocol::{KvDtype, KvLayout, LeaseId, RequestId, HANDOFF_VERSION};
use flatbuffers::FlatBufferBuilder;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::generated::handoff_generated::cleave::kv::wire as fb;
use crate::{KvTransferError, Result};

/// Bytes of the length prefix before every header.
pub const PREFIX_BYTES: usize = 8;
/// Largest header accepted. Real headers are under 200 bytes; an Abort reason is cut to fit.
pub const MAX_HEADER_BYTES: usize = 2048;
/// Longest queue-pair metadata a link frame carries.
pub const MAX_LINK_METADATA_BYTES: usize = 1024;
/// Longest abort reason put on the wire (longer ones are truncated at a char boundary).
pub const MAX_REASON_BYTES: usize = 512;
/// Default bound on one chunk's payload (K and V together).
pub const DEFAULT_MAX_PAYLOAD: usize = 256 << 20;

/// Why a transfer was aborted, as carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortCode {
    Unknown,
    VersionUnsupported,
    LayoutMismatch,
    UnknownLease,
    LeaseExpired,
    Checksum,
    Gap,
    Malformed,
    Cancelled,
    SenderGone,
    OutOfBounds,
    Internal,
    UnknownLink,
}

impl AbortCode {
    fn to_wire(self) -> fb::AbortCode {
        match self {
            AbortCode::Unknown => fb::AbortCode::Unknown,
            AbortCode::VersionUnsupported => fb::AbortCode::VersionUnsupported,
            AbortCode::LayoutMismatch => fb::AbortCode::LayoutMismatch,
            AbortCode::UnknownLease => fb::AbortCode::UnknownLease,
            AbortCode::LeaseExpired => fb::AbortCode::LeaseExpired,
            AbortCode::Checksum => fb::AbortCode::Checksum,
            AbortCode::Gap => fb::AbortCode::Gap,
            AbortCode::Malformed => fb::AbortCode::Malformed,
            AbortCode::Cancelled => fb::AbortCode::Cancelled,
            AbortCode::SenderGone => fb::AbortCode::SenderGone,
            AbortCode::OutOfBounds => fb::AbortCode::OutOfBounds,
            AbortCode::Internal => fb::AbortCode::Internal,
            AbortCode::UnknownLink => fb::AbortCode::UnknownLink,
        }
    }

    fn from_wire(c: fb::AbortCode) -> Self {
        match c {
            fb::AbortCode::VersionUnsupported => AbortCode::VersionUnsupported,
            fb::AbortCode::LayoutMismatch => AbortCode::LayoutMismatch,
            fb::AbortCode::UnknownLease => AbortCode::UnknownLease,
            fb::AbortCode::LeaseExpired => AbortCode::LeaseExpired,
            fb::AbortCode::Checksum => AbortCode::Checksum,
            fb::AbortCode::Gap => AbortCode::Gap,
            fb::AbortCode::Malformed => AbortCode::Malformed,
            fb::AbortCode::Cancelled => AbortCode::Cancelled,
            fb::AbortCode::SenderGone => AbortCode::SenderGone,
            fb::AbortCode::OutOfBounds => AbortCode::OutOfBounds,
            fb::AbortCode::Internal => AbortCode::Internal,
            fb::AbortCode::UnknownLink => AbortCode::UnknownLink,
            _ => AbortCode::Unknown,
        }
    }

    /// The abort code that describes an error.
    pub fn of(err: &KvTransferError) -> Self {
        use KvTransferError as E;
        match err {
            E::VersionUnsupported { .. } => AbortCode::VersionUnsupported,
            E::LayoutMismatch { .. } => AbortCode::LayoutMismatch,
            E::UnknownLease { .. } => AbortCode::UnknownLease,
            E::LeaseExpired { .. } => AbortCode::LeaseExpired,
            E::ChecksumMismatch { .. } => AbortCode::Checksum,
            E::ChunkGap { .. } => AbortCode::Gap,
            E::MalformedFrame { .. } | E::FrameTooLarge { .. } | E::Truncated { .. } => AbortCode::Malformed,
            E::Protocol { .. } => AbortCode::Malformed,
            E::Cancelled { .. } => AbortCode::Cancelled,
            E::SenderGone { .. } => AbortCode::SenderGone,
            E::ChunkOutOfBounds { .. } => AbortCode::OutOfBounds,
            E::RdmaUnknownLink { .. } => AbortCode::UnknownLink,
            _ => AbortCode::Internal,
        }
    }
}

impl std::fmt::Display for AbortCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// First frame of every stream of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    pub request_id: RequestId,
    pub lease_id: LeaseId,
    pub layout: KvLayout,
    pub num_tokens: u32,
    pub stream_index: u16,
    pub stream_count: u16,
    /// The RDMA link the payload travels over (see [`Control::LinkAnswer`]); `None`: in
    /// [`Frame::Chunk`]s on the streams.
    pub rdma_link: Option<u64>,
}

/// An RDMA chunk notice: one layer of one prefill chunk was posted as one-sided writes into the
/// lease's blocks (the group whose immediate carries `chunk`). The receiver checks `crc32`
/// against the bytes in its pool once every group landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landed {
    pub lease_id: LeaseId,
    pub layer: u32,
    pub token_start: u32,
    pub token_count: u32,
    /// Index of the prefill chunk among this layer's chunks (0, 1, ...).
    pub chunk: u32,
    /// CRC-32 of K then V of these tokens ([`checksum`]).
    pub crc32: u32,
}

/// A frame without payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    Open(Open),
    /// `rdma_tag`: the lease's tag on the RDMA link the `Open` named.
    Accept {
        lease_id: LeaseId,
        rdma_tag: Option<u16>,
    },
    Complete {
        lease_id: LeaseId,
        first_token: u32,
    },
    Ack {
        lease_id: LeaseId,
    },
    Abort {
        lease_id: LeaseId,
        code: AbortCode,
        reason: String,
    },
    Landed(Landed),
    /// First frame of an RDMA link's setup stream: the sender's queue-pair metadata.
    LinkOffer {
        metadata: Vec<u8>,
    },
    /// The receiver's answer: the link's id and its queue-pair metadata (with the pool).
    LinkAnswer {
        link_id: u64,
        metadata: Vec<u8>,
    },
    /// On a link's setup stream: no write of `lease_id` (tagged `tag`) can still land.
    Drained {
        lease_id: LeaseId,
        tag: u16,
    },
}

/// Header of one run of tokens of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub lease_id: LeaseId,
    pub layer: u32,
    pub token_start: u32,
    pub token_count: u32,
    pub k_len: u32,
    pub v_len: u32,
    /// CRC-32 (IEEE) of K followed by V.
    pub crc32: u32,
}

/// A decoded header, before its payload is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Header {
    Control(Control),
    Chunk(ChunkHeader),
}

/// A whole frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Control(Control),
    Chunk { header: ChunkHeader, k: Bytes, v: Bytes },
}

/// Bounds the decoder enforces before allocating.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_payload: usize,
    /// When known (the receiver's layout), chunk lengths are checked against it.
    pub layout: Option<KvLayout>,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_payload: DEFAULT_MAX_PAYLOAD, layout: None }
    }
}

/// CRC-32 of K followed by V.
pub fn checksum(k: &[u8], v: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(k);
    h.update(v);
    h.finalize()
}

/// Bytes of K (or V) of `token_count` tokens of one layer.
pub fn run_bytes(layout: &KvLayout, token_count: u32) -> usize {
    token_count as usize * layout.num_kv_heads as usize * layout.head_dim as usize * layout.dtype.size_bytes()
}

fn malformed(reason: impl Into<String>) -> KvTransferError {
    KvTransferError::MalformedFrame { reason: reason.into() }
}

fn dtype_to_wire(d: KvDtype) -> fb::Dtype {
    match d {
        KvDtype::F32 => fb::Dtype::F32,
        KvDtype::F16 => fb::Dtype::F16,
        KvDtype::Bf16 => fb::Dtype::Bf16,
    }
}

fn dtype_from_wire(d: fb::Dtype) -> Result<KvDtype> {
    match d {
        fb::Dtype::F32 => Ok(KvDtype::F32),
        fb::Dtype::F16 => Ok(KvDtype::F16),
        fb::Dtype::Bf16 => Ok(KvDtype::Bf16),
        other => Err(malformed(format!("unknown dtype {}", other.0))),
    }
}

fn finish_with_prefix(
    mut fbb: FlatBufferBuilder<'_>,
    body_type: fb::Body,
    body: flatbuffers::WIPOffset<flatbuffers::UnionWIPOffset>,
    payload_len: usize,
) -> BytesMut {
    let frame = fb::Frame::create(&mut fbb, &fb::FrameArgs { version: HANDOFF_VERSION, body_type, body: Some(body) });
    fbb.finish(frame, None);
    let data = fbb.finished_data();
    let mut out = BytesMut::with_capacity(PREFIX_BYTES + data.len());
    out.put_u32_le(data.len() as u32);
    out.put_u32_le(payload_len as u32);
    out.put_slice(data);
    out
}

/// Encodes a control frame (prefix and header; no payload).
pub fn encode_control(msg: &Control) -> Bytes {
    let mut fbb = FlatBufferBuilder::with_capacity(128);
    let (ty, body) = match msg {
        Control::Open(o) => {
            let l = &o.layout;
            let layout = fb::Layout::new(
                l.model_fingerprint,
                l.num_layers,
                l.num_kv_heads,
                l.head_dim,
                l.block_size,
                dtype_to_wire(l.dtype),
            );
            let t = fb::Open::create(
                &mut fbb,
                &fb::OpenArgs {
                    request_id: o.request_id.0,
                    lease_id: o.lease_id.0,
                    layout: Some(&layout),
                    num_tokens: o.num_tokens,
                    stream_index: o.stream_index,
                    stream_count: o.stream_count,
                    rdma_link: o.rdma_link.unwrap_or(0),
                },
            );
            (fb::Body::Open, t.as_union_value())
        }
        Control::Accept { lease_id, rdma_tag } => {
            let t = fb::Accept::create(&mut fbb, &fb::AcceptArgs { lease_id: lease_id.0, rdma_tag: *rdma_tag });
            (fb::Body::Accept, t.as_union_value())
        }
        Control::Landed(l) => {
            let t = fb::Landed::create(
                &mut fbb,
                &fb::LandedArgs {
                    lease_id: l.lease_id.0,
                    layer: l.layer,
                    token_start: l.token_start,
                    token_count: l.token_count,
                    chunk: l.chunk,
                    crc32: l.crc32,
                },
            );
            (fb::Body::Landed, t.as_union_value())
        }
        Control::LinkOffer { metadata } => {
            let m = fbb.create_vector(metadata);
            let t = fb::LinkOffer::create(&mut fbb, &fb::LinkOfferArgs { metadata: Some(m) });
            (fb::Body::LinkOffer, t.as_union_value())
        }
        Control::LinkAnswer { link_id, metadata } => {
            let m = fbb.create_vector(metadata);
            let t = fb::LinkAnswer::create(&mut fbb, &fb::LinkAnswerArgs { link_id: *link_id, metadata: Some(m) });
            (fb::Body::LinkAnswer, t.as_union_value())
        }
        Control::Drained { lease_id, tag } => {
            let t = fb::Drained::create(&mut fbb, &fb::DrainedArgs { lease_id: lease_id.0, tag: *tag });
            (fb::Body::Drained, t.as_union_value())
        }
        Control::Complete { lease_id, first_token } => {
            let t =
                fb::Complete::create(&mut fbb, &fb::CompleteArgs { lease_id: lease_id.0, first_token: *first_token });
            (fb::Body::Complete, t.as_union_value())
        }
        Control::Ack { lease_id } => {
            let t = fb::Ack::create(&mut fbb, &fb::AckArgs { lease_id: lease_id.0 });
            (fb::Body::Ack, t.as_union_value())
        }
        Control::Abort { lease_id, code, reason } => {
            let mut cut = reason.len().min(MAX_REASON_BYTES);
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            let r = fbb.create_string(&reason[..cut]);
            let t = fb::Abort::create(
                &mut fbb,
                &fb::AbortArgs { lease_id: lease_id.0, code: code.to_wire(), reason: Some(r) },
            );
            (fb::Body::Abort, t.as_union_value())
        }
    };
    finish_with_prefix(fbb, ty, body, 0).freeze()
}

/// Encodes a chunk's prefix and header; K and V follow it on the wire unchanged.
pub fn encode_chunk_header(h: &ChunkHeader) -> Bytes {
    let mut fbb = FlatBufferBuilder::with_capacity(96);
    let t = fb::Chunk::create(
        &mut fbb,
        &fb::ChunkArgs {
            lease_id: h.lease_id.0,
            layer: h.layer,
            token_start: h.token_start,
            token_count: h.token_count,
            k_len: h.k_len,
            v_len: h.v_len,
            crc32: h.crc32,
        },
    );
    finish_with_prefix(fbb, fb::Body::Chunk, t.as_union_value(), h.k_len as usize + h.v_len as usize).freeze()
}

/// Encodes a whole chunk frame into one buffer (copies K and V; for tests and small frames).
pub fn encode_chunk(h: &ChunkHeader, k: &[u8], v: &[u8]) -> Bytes {
    let head = encode_chunk_header(h);
    let mut out = BytesMut::with_capacity(head.len() + k.len() + v.len());
    out.put_slice(&head);
    out.put_slice(k);
    out.put_slice(v);
    out.freeze()
}

/// Reads the length prefix; refuses lengths over the limits before anything is allocated.
pub fn parse_prefix(prefix: [u8; PREFIX_BYTES], limits: &Limits) -> Result<(usize, usize)> {
    let header_len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    let payload_len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
    if header_len == 0 {
        return Err(malformed("empty header"));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(KvTransferError::FrameTooLarge { what: "header", len: header_len, max: MAX_HEADER_BYTES });
    }
    if payload_len > limits.max_payload {
        return Err(KvTransferError::FrameTooLarge { what: "payload", len: payload_len, max: limits.max_payload });
    }
    Ok((header_len, payload_len))
}

/// Verifies and decodes a header, checking it against the payload length and the layout.
pub fn parse_header(buf: &[u8], payload_len: usize, limits: &Limits) -> Result<Header> {
    let opts = flatbuffers::VerifierOptions {
        max_depth: 8,
        max_tables: 16,
        max_apparent_size: MAX_HEADER_BYTES * 2,
        ..Default::default()
    };
    let f = fb::root_as_frame_with_opts(&opts, buf).map_err(|e| malformed(format!("header does not verify: {e}")))?;
    if f.version() != HANDOFF_VERSION {
        return Err(KvTransferError::VersionUnsupported { got: f.version(), supported: HANDOFF_VERSION });
    }
    let no_payload = |h: Header| {
        if payload_len != 0 {
            Err(malformed(format!("control frame with a {payload_len}-byte payload")))
        } else {
            Ok(h)
        }
    };
    let missing = |what: &str| malformed(format!("{what} frame without a body"));
    match f.body_type() {
        fb::Body::Open => {
            let o = f.body_as_open().ok_or_else(|| missing("open"))?;
            let l = o.layout().ok_or_else(|| malformed("open frame without a layout"))?;
            no_payload(Header::Control(Control::Open(Open {
                request_id: RequestId(o.request_id()),
                lease_id: LeaseId(o.lease_id()),
                layout: KvLayout {
                    model_fingerprint: l.model_fingerprint(),
                    dtype: dtype_from_wire(l.dtype())?,
                    num_layers: l.num_layers(),
                    num_kv_heads: l.num_kv_heads(),
                    head_dim: l.head_dim(),
                    block_size: l.block_size(),
                },
                num_tokens: o.num_tokens(),
                stream_index: o.stream_index(),
                stream_count: o.stream_count(),
                rdma_link: Some(o.rdma_link()).filter(|l| *l != 0),
            })))
        }
        fb::Body::Accept => {
            let a = f.body_as_accept().ok_or_else(|| missing("accept"))?;
            no_payload(Header::Control(Control::Accept { lease_id: LeaseId(a.lease_id()), rdma_tag: a.rdma_tag() }))
        }
        fb::Body::Landed => {
            let l = f.body_as_landed().ok_or_else(|| missing("landed"))?;
            if l.token_count() == 0 || l.token_start().checked_add(l.token_count()).is_none() {
                return Err(malformed(format!("landed notice of tokens {}+{}", l.token_start(), l.token_count())));
            }
            if let Some(layout) = &limits.layout {
                if l.layer() >= layout.num_layers {
                    return Err(malformed(format!("landed notice for layer {} of {}", l.layer(), layout.num_layers)));
                }
            }
            no_payload(Header::Control(Control::Landed(Landed {
                lease_id: LeaseId(l.lease_id()),
                layer: l.layer(),
                token_start: l.token_start(),
                token_count: l.token_count(),
                chunk: l.chunk(),
                crc32: l.crc32(),
            })))
        }
        fb::Body::LinkOffer => {
            let o = f.body_as_link_offer().ok_or_else(|| missing("link offer"))?;
            let metadata = link_metadata(o.metadata())?;
            no_payload(Header::Control(Control::LinkOffer { metadata }))
        }
        fb::Body::LinkAnswer => {
            let a = f.body_as_link_answer().ok_or_else(|| missing("link answer"))?;
            if a.link_id() == 0 {
                return Err(malformed("link answer with link id 0"));
            }
            let metadata = link_metadata(a.metadata())?;
            no_payload(Header::Control(Control::LinkAnswer { link_id: a.link_id(), metadata }))
        }
        fb::Body::Drained => {
            let d = f.body_as_drained().ok_or_else(|| missing("drained"))?;
            no_payload(Header::Control(Control::Drained { lease_id: LeaseId(d.lease_id()), tag: d.tag() }))
        }
        fb::Body::Complete => {
            let c = f.body_as_complete().ok_or_else(|| missing("complete"))?;
            no_payload(Header::Control(Control::Complete {
                lease_id: LeaseId(c.lease_id()),
                first_token: c.first_token(),
            }))
        }
        fb::Body::Ack => {
            let a = f.body_as_ack().ok_or_else(|| missing("ack"))?;
            no_payload(Header::Control(Control::Ack { lease_id: LeaseId(a.lease_id()) }))
        }
        fb::Body::Abort => {
            let a = f.body_as_abort().ok_or_else(|| missing("abort"))?;
            no_payload(Header::Control(Control::Abort {
                lease_id: LeaseId(a.lease_id()),
                code: AbortCode::from_wire(a.code()),
                reason: a.reason().unwrap_or("").to_string(),
            }))
        }
        fb::Body::Chunk => {
            let c = f.body_as_chunk().ok_or_else(|| missing("chunk"))?;
            let h = ChunkHeader {
                lease_id: LeaseId(c.lease_id()),
                layer: c.layer(),
                token_start: c.token_start(),
                token_count: c.token_count(),
                k_len: c.k_len(),
                v_len: c.v_len(),
                crc32: c.crc32(),
            };
            check_chunk_lengths(&h, payload_len, limits.layout.as_ref())?;
            Ok(Header::Chunk(h))
        }
        other => Err(malformed(format!("unknown frame body type {}", other.0))),
    }
}

fn link_metadata(m: Option<flatbuffers::Vector<'_, u8>>) -> Result<Vec<u8>> {
    let m = m.ok_or_else(|| malformed("link frame without metadata"))?;
    if m.is_empty() || m.len() > MAX_LINK_METADATA_BYTES {
        return Err(malformed(format!("link metadata of {} bytes (1..={MAX_LINK_METADATA_BYTES})", m.len())));
    }
    Ok(m.bytes().to_vec())
}

/// Checks a chunk header's lengths against the payload and (when known) the layout.
pub fn check_chunk_lengths(h: &ChunkHeader, payload_len: usize, layout: Option<&KvLayout>) -> Result<()> {
    if h.k_len as usize + h.v_len as usize != payload_len {
        return Err(malformed(format!("chunk k_len {} + v_len {} != payload {payload_len}", h.k_len, h.v_len)));
    }
    if h.k_len != h.v_len {
        return Err(malformed(format!("chunk k_len {} != v_len {}", h.k_len, h.v_len)));
    }
    if h.token_count == 0 {
        return Err(malformed("chunk with zero tokens"));
    }
    if h.token_start.checked_add(h.token_count).is_none() {
        return Err(malformed("chunk token range overflows"));
    }
    if let Some(l) = layout {
        if h.layer >= l.num_layers {
            return Err(malformed(format!("chunk layer {} of {}", h.layer, l.num_layers)));
        }
        let want = run_bytes(l, h.token_count);
        if h.k_len as usize != want {
            return Err(malformed(format!(
                "chunk of {} tokens has k_len {}, layout needs {want}",
                h.token_count, h.k_len
            )));
        }
    }
    Ok(())
}

/// Sans-IO decoder: takes one whole frame off the front of `buf`, or returns `Ok(None)` when
/// more bytes are needed. The payload is split off `buf` without copying.
pub fn decode_frame(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Frame>> {
    if buf.len() < PREFIX_BYTES {
        return Ok(None);
    }
    let mut prefix = [0u8; PREFIX_BYTES];
    prefix.copy_from_slice(&buf[..PREFIX_BYTES]);
    let (header_len, payload_len) = parse_prefix(prefix, limits)?;
    if buf.len() < PREFIX_BYTES + header_len {
        return Ok(None);
    }
    let header = parse_header(&buf[PREFIX_BYTES..PREFIX_BYTES + header_len], payload_len, limits)?;
    if buf.len() < PREFIX_BYTES + header_len + payload_len {
        return Ok(None);
    }
    buf.advance(PREFIX_BYTES + header_len);
    let payload = buf.split_to(payload_len).freeze();
    Ok(Some(assemble(header, payload)))
}

fn assemble(header: Header, payload: Bytes) -> Frame {
    match header {
        Header::Control(c) => Frame::Control(c),
        Header::Chunk(h) => {
            let k = payload.slice(..h.k_len as usize);
            let v = payload.slice(h.k_len as usize..);
            Frame::Chunk { header: h, k, v }
        }
    }
}

/// Reads one frame from a stream. `Ok(None)` on a clean end of stream at a frame boundary; an
/// end inside a frame is [`KvTransferError::Truncated`]. The payload is read straight into its
/// own buffer (one allocation, bounded by `limits` before it is made, no copy afterwards).
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized>(r: &mut R, limits: &Limits) -> Result<Option<Frame>> {
    read_frame_recycling(r, limits, &mut BytesMut::new()).await
}

/// Bytes a stream's receive buffer holds at least (several chunk frames).
const RECYCLE_BYTES: usize = 8 << 20;

/// [`read_frame`] for a loop over one stream: payloads are carved from `buf`, whose allocation
/// is reused once every payload carved from it has been dropped (a receiver drops a chunk's
/// payload as soon as it is written into the pool). A fresh multi-MiB allocation per frame
/// costs a page fault and a page clear per 4 KiB, about a tenth of a QUIC handoff's CPU time.
pub async fn read_frame_recycling<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    limits: &Limits,
    buf: &mut BytesMut,
) -> Result<Option<Frame>> {
    let mut prefix = [0u8; PREFIX_BYTES];
    let mut got = 0;
    while got < PREFIX_BYTES {
        let n = r.read(&mut prefix[got..]).await.map_err(io_err("frame prefix"))?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(KvTransferError::Truncated { expected: PREFIX_BYTES, got });
        }
        got += n;
    }
    let (header_len, payload_len) = parse_prefix(prefix, limits)?;
    let mut head = [0u8; MAX_HEADER_BYTES];
    read_exact_or_truncated(r, &mut head[..header_len], PREFIX_BYTES).await?;
    let header = parse_header(&head[..header_len], payload_len, limits)?;
    // Read straight into uninitialised capacity (no memset, no copy afterwards). `buf` is empty
    // here (every payload is split off whole); `reserve` reuses its allocation when no earlier
    // payload still points into it.
    buf.clear();
    if buf.capacity() < payload_len {
        buf.reserve(if payload_len > 0 { payload_len.max(RECYCLE_BYTES) } else { 0 });
    }
    let payload = buf;
    while payload.len() < payload_len {
        let want = (payload_len - payload.len()) as u64;
        let n = (&mut *r).take(want).read_buf(payload).await.map_err(io_err("frame payload"))?;
        if n == 0 {
            return Err(KvTransferError::Truncated {
                expected: PREFIX_BYTES + header_len + payload_len,
                got: PREFIX_BYTES + header_len + payload.len(),
            });
        }
    }
    Ok(Some(assemble(header, payload.split().freeze())))
}

async fn read_exact_or_truncated<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut [u8],
    before: usize,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = r.read(&mut buf[got..]).await.map_err(io_err("frame body"))?;
        if n == 0 {
            return Err(KvTransferError::Truncated { expected: before + buf.len(), got: before + got });
        }
        got += n;
    }
    Ok(())
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> KvTransferError {
    move |source| KvTransferError::Io { what: what.to_string(), source }
}

/// Writes a control frame and flushes it.
pub async fn write_control<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, msg: &Control) -> Result<()> {
    w.write_all(&encode_control(msg)).await.map_err(io_err("control frame"))?;
    w.flush().await.map_err(io_err("control frame"))
}

/// Writes a chunk frame: header, then K and V as they are (no copy into a frame buffer).
pub async fn write_chunk<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, h: &ChunkHeader, k: &[u8], v: &[u8]) -> Result<()> {
    w.write_all(&encode_chunk_header(h)).await.map_err(io_err("chunk header"))?;
    w.write_all(k).await.map_err(io_err("chunk payload"))?;
    w.write_all(v).await.map_err(io_err("chunk payload"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            model_fingerprint: 7,
            dtype: KvDtype::F32,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            block_size: 4,
        }
    }

    #[test]
    fn control_frames_round_trip() {
        let msgs = [
            Control::Open(Open {
                request_id: RequestId(9),
                lease_id: LeaseId(3),
                layout: layout(),
                num_tokens: 5,
                stream_index: 1,
                stream_count: 2,
                rdma_link: None,
            }),
            Control::Open(Open {
                request_id: RequestId(9),
                lease_id: LeaseId(3),
                layout: layout(),
                num_tokens: 5,
                stream_index: 0,
                stream_count: 1,
                rdma_link: Some(7),
            }),
            Control::Accept { lease_id: LeaseId(3), rdma_tag: None },
            Control::Accept { lease_id: LeaseId(3), rdma_tag: Some(0) },
            Control::Complete { lease_id: LeaseId(3), first_token: 42 },
            Control::Ack { lease_id: LeaseId(3) },
            Control::Abort { lease_id: LeaseId(3), code: AbortCode::Gap, reason: "x".into() },
            Control::Landed(Landed {
                lease_id: LeaseId(3),
                layer: 1,
                token_start: 4,
                token_count: 2,
                chunk: 1,
                crc32: 0xdead_beef,
            }),
            Control::LinkOffer { metadata: vec![1, 2, 3] },
            Control::LinkAnswer { link_id: 5, metadata: vec![4; 300] },
            Control::Drained { lease_id: LeaseId(3), tag: 4095 },
        ];
        let limits = Limits { layout: Some(layout()), ..Default::default() };
        for m in msgs {
            let mut buf = BytesMut::from(&encode_control(&m)[..]);
            let f = decode_frame(&mut buf, &limits).unwrap().unwrap();
            assert_eq!(f, Frame::Control(m));
            assert!(buf.is_empty());
        }
        // Link frames without usable metadata, and notices of no tokens, are refused.
        for bad in [
            Control::LinkOffer { metadata: vec![] },
            Control::LinkAnswer { link_id: 0, metadata: vec![1] },
            Control::LinkAnswer { link_id: 1, metadata: vec![0; MAX_LINK_METADATA_BYTES + 1] },
            Control::Landed(Landed {
                lease_id: LeaseId(3),
                layer: 0,
                token_start: 0,
                token_count: 0,
                chunk: 0,
                crc32: 0,
            }),
            Control::Landed(Landed {
                lease_id: LeaseId(3),
                layer: 2,
                token_start: 0,
                token_count: 1,
                chunk: 0,
                crc32: 0,
            }),
        ] {
            let mut buf = BytesMut::from(&encode_control(&bad)[..]);
            let r = decode_frame(&mut buf, &limits);
            assert!(matches!(r, Err(KvTransferError::MalformedFrame { .. })), "{bad:?} -> {r:?}");
        }
    }

    /// A recycled receive buffer must never overwrite a payload still held (here: every one),
    /// and must reuse its allocation once the payloads are dropped.
    #[test]
    fn recycled_reads_keep_held_payloads_intact_and_reuse_the_buffer() {
        let l = layout();
        let frame = |i: u8, tokens: u32| {
            let k = vec![i; run_bytes(&l, tokens)];
            let v = vec![i.wrapping_add(100); run_bytes(&l, tokens)];
            let h = ChunkHeader {
                lease_id: LeaseId(1),
                layer: 0,
                token_start: 0,
                token_count: tokens,
                k_len: k.len() as u32,
                v_len: v.len() as u32,
                crc32: checksum(&k, &v),
            };
            (h, encode_chunk(&h, &k, &v))
        };
        // Enough frames of varied sizes to wrap an 8 MiB buffer several times.
        let frames: Vec<_> = (0..40u8).map(|i| frame(i, 1 + (i as u32 * 7919) % 40_000)).collect();
        let wire: Vec<u8> = frames.iter().flat_map(|(_, w)| w.iter().copied()).collect();
        let limits = Limits { layout: Some(l.clone()), max_payload: 64 << 20 };
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let mut src = &wire[..];
            let mut buf = BytesMut::new();
            let mut held = Vec::new();
            while let Some(f) = read_frame_recycling(&mut src, &limits, &mut buf).await.unwrap() {
                held.push(f);
            }
            assert_eq!(held.len(), frames.len());
            for (f, (h, _)) in held.iter().zip(&frames) {
                let Frame::Chunk { header, k, v } = f else { panic!("not a chunk") };
                assert_eq!(header, h);
                assert_eq!(checksum(k, v), h.crc32, "payload of frame {} overwritten", h.token_count);
            }
            // Each payload dropped as soon as it is read (as the receiver does): once the
            // buffer is used up, the next payload starts at the first one's address again.
            drop(held);
            let one = &frames[39].1;
            let wire: Vec<u8> = (0..30).flat_map(|_| one.iter().copied()).collect();
            let mut src = &wire[..];
            let mut buf = BytesMut::new();
            let mut starts = Vec::new();
            while let Some(f) = read_frame_recycling(&mut src, &limits, &mut buf).await.unwrap() {
                let Frame::Chunk { k, .. } = f else { panic!("not a chunk") };
                starts.push(k.as_ptr() as usize);
            }
            assert_eq!(starts.len(), 30);
            assert!(starts[1..].contains(&starts[0]), "the allocation was never reused");
        });
    }

    #[test]
    fn chunk_round_trips_and_payload_is_not_copied() {
        let l = layout();
        let k = vec![1u8; run_bytes(&l, 3)];
        let v = vec![2u8; run_bytes(&l, 3)];
        let h = ChunkHeader {
            lease_id: LeaseId(1),
            layer: 1,
            token_start: 0,
            token_count: 3,
            k_len: k.len() as u32,
            v_len: v.len() as u32,
            crc32: checksum(&k, &v),
        };
        let wire = encode_chunk(&h, &k, &v);
        let mut buf = BytesMut::from(&wire[..]);
        let base = buf.as_ptr() as usize;
        let limits = Limits { layout: Some(l), ..Default::default() };
        let Frame::Chunk { header, k: k2, v: v2 } = decode_frame(&mut buf, &limits).unwrap().unwrap() else {
            panic!("not a chunk")
        };
        assert_eq!(header, h);
        assert_eq!(&k2[..], &k[..]);
        assert_eq!(&v2[..], &v[..]);
        // K points into the read buffer: no copy was made.
        let kp = k2.as_ptr() as usize;
        assert!(kp >= base && kp < base + wire.len());
    }

    #[test]
    fn wrong_version_and_lengths_are_refused() {
        let l = layout();
        let h = ChunkHeader {
            lease_id: LeaseId(1),
            layer: 0,
            token_start: 0,
            token_count: 2,
            k_len: 8,
            v_len: 8,
            crc32: 0,
        };
        let wire = encode_chunk(&h, &[0; 8], &[0; 8]);
        let limits = Limits { layout: Some(l), ..Default::default() };
        let err = decode_frame(&mut BytesMut::from(&wire[..]), &limits).unwrap_err();
        assert!(matches!(err, KvTransferError::MalformedFrame { .. }), "{err}");

        let mut fbb = FlatBufferBuilder::new();
        let t = fb::Ack::create(&mut fbb, &fb::AckArgs { lease_id: 1 });
        let f = fb::Frame::create(
            &mut fbb,
            &fb::FrameArgs { version: 99, body_type: fb::Body::Ack, body: Some(t.as_union_value()) },
        );
        fbb.finish(f, None);
        let mut buf = BytesMut::new();
        buf.put_u32_le(fbb.finished_data().len() as u32);
        buf.put_u32_le(0);
        buf.put_slice(fbb.finished_data());
        let err = decode_frame(&mut buf, &Limits::default()).unwrap_err();
        assert!(matches!(err, KvTransferError::VersionUnsupported { got: 99, .. }), "{err}");

        let mut big = BytesMut::new();
        big.put_u32_le(16);
        big.put_u32_le(u32::MAX);
        let err = decode_frame(&mut big, &Limits::default()).unwrap_err();
        assert!(matches!(err, KvTransferError::FrameTooLarge { what: "payload", .. }), "{err}");
    }
}
