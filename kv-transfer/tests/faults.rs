//! Fault injection over real sockets (and in-process): connection loss, peer restart on the
//! same address, sender killed, lease expiry, out of blocks, duplicate and late chunks, corrupt
//! chunks, malformed and truncated frames, layout mismatch, cancellation. After each: clear
//! errors on both sides and zero leased blocks. No sleeps: every wait is on an event, bounded
//! (over RDMA, blocks held until no write can land are polled for, bounded).
//!
//! Both payload paths: every row runs over the stream transports and, with the `rdma` feature,
//! over the RDMA path (in-memory fabric, control streams over QUIC). Where the two differ by
//! design the RDMA row is a test of its own below: a duplicate notice is a gap, not dropped
//! (notices are numbered per layer), and a corrupt payload is caught once every write landed,
//! at `Complete`. Out of blocks is refused at reservation, before any path is chosen.

mod common;

use std::time::Duration;

#[cfg(feature = "rdma")]
use cleave_kv_transfer::frame::{checksum, Landed};
use cleave_kv_transfer::frame::{
    encode_chunk, read_frame, write_control, AbortCode, ChunkHeader, Control, Frame, Limits, Open,
};
use cleave_kv_transfer::{KvSender, KvTransferError, SendConfig};
use cleave_net::DuplexStream;
use cleave_protocol::{HandoffTicket, KvDtype, LeaseId, RequestId, TransportKind};
use common::{all_kinds, bounded, chunk_frame, layout, prefill_chunks, Pair, PairOptions, KINDS, WAIT};
use tokio::io::AsyncWriteExt;

fn cfg(streams: usize) -> SendConfig {
    SendConfig { streams, open_timeout: WAIT, io_timeout: WAIT, ack_timeout: WAIT, ..SendConfig::default() }
}

/// A hand-driven sender stream for injecting exact frames (over RDMA: the control stream of a
/// transfer over the pair's link, whose `Open`s name it).
struct Raw {
    s: DuplexStream,
    #[cfg(feature = "rdma")]
    rdma: Option<RawLink>,
}

#[cfg(feature = "rdma")]
struct RawLink {
    link: cleave_kv_transfer::rdma::LinkHandle,
    /// The lease this stream opened and its tag.
    lease: Option<(LeaseId, u16)>,
    /// Write groups posted per layer.
    chunks: Vec<u32>,
}

/// Like a sender that goes away: its writes are cancelled and the receiver told once they
/// drained (a completed lease's `Drained` changes nothing), so a failed raw lease's blocks come
/// back without a queue-pair reset.
#[cfg(feature = "rdma")]
impl Drop for RawLink {
    fn drop(&mut self) {
        if let Some((lease, tag)) = self.lease {
            self.link.abandon(lease, tag);
        }
    }
}

impl Raw {
    async fn open(pair: &Pair) -> Raw {
        let (s, _) = bounded("open", pair.transport.open(pair.addr)).await.unwrap();
        #[cfg(feature = "rdma")]
        if let Some(side) = &pair.rdma {
            let link = bounded("link", side.transport.link(pair.addr)).await.unwrap();
            let chunks = vec![0; layout().num_layers as usize];
            return Raw { s, rdma: Some(RawLink { link, lease: None, chunks }) };
        }
        Raw {
            s,
            #[cfg(feature = "rdma")]
            rdma: None,
        }
    }

    /// Over RDMA: writes K and V of `count` tokens of `layer` into the lease's blocks through
    /// the link and sends their notice, as a sender does.
    #[cfg(feature = "rdma")]
    async fn landed(&mut self, t: &HandoffTicket, layer: u32, start: u32, count: u32) {
        use cleave_kv_transfer::rdma::SendChunk;
        let r = self.rdma.as_mut().expect("an RDMA stream");
        let (_, tag) = r.lease.expect("an accepted lease");
        let c = common::chunk(&layout(), layer, start, count);
        let chunk = r.chunks[layer as usize];
        let write = SendChunk {
            blocks: t.block_ids.clone().into(),
            layer,
            tokens: start..start + count,
            tag,
            chunk,
            k: c.k.clone(),
            v: c.v.clone(),
        };
        bounded("post", r.link.driver.send(write)).await.unwrap();
        r.chunks[layer as usize] += 1;
        let crc32 = checksum(&c.k, &c.v);
        let n = Landed { lease_id: t.lease_id, layer, token_start: start, token_count: count, chunk, crc32 };
        self.send(&Control::Landed(n)).await;
    }

    /// Over RDMA: `Complete` once every write of the lease completed.
    #[cfg(feature = "rdma")]
    async fn complete(&mut self, t: &HandoffTicket, first_token: u32) {
        let r = self.rdma.as_ref().expect("an RDMA stream");
        let (_, tag) = r.lease.expect("an accepted lease");
        bounded("drain", r.link.driver.finish(tag)).await.unwrap();
        self.send(&Control::Complete { lease_id: t.lease_id, first_token }).await;
    }

    /// The link `Open`s on this stream name (None on the stream path).
    fn link(&self) -> Option<u64> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            return Some(r.link.link_id);
        }
        None
    }

    async fn send(&mut self, msg: &Control) {
        bounded("write", write_control(&mut self.s.send, msg)).await.unwrap();
    }

    async fn bytes(&mut self, b: &[u8]) {
        bounded("write", async {
            self.s.send.write_all(b).await.unwrap();
            self.s.send.flush().await.unwrap();
        })
        .await;
    }

    async fn chunk(&mut self, lease: LeaseId, layer: u32, start: u32, count: u32) {
        let Frame::Chunk { header, k, v } = chunk_frame(&layout(), lease, layer, start, count) else { unreachable!() };
        self.bytes(&encode_chunk(&header, &k, &v)).await;
    }

    /// The next control frame from the receiver (`None` at end of stream or on an error).
    async fn recv(&mut self) -> Option<Control> {
        match bounded("read", read_frame(&mut self.s.recv, &Limits { max_payload: 0, layout: None })).await {
            Ok(Some(Frame::Control(c))) => Some(c),
            _ => None,
        }
    }

    async fn open_lease(&mut self, t: &HandoffTicket) {
        self.send(&Control::Open(Open {
            request_id: t.request_id,
            lease_id: t.lease_id,
            layout: t.layout.clone(),
            num_tokens: t.num_tokens,
            stream_index: 0,
            stream_count: 1,
            rdma_link: self.link(),
        }))
        .await;
        let accept = self.recv().await;
        #[cfg(feature = "rdma")]
        if let Some(r) = &mut self.rdma {
            let Some(Control::Accept { lease_id, rdma_tag: Some(tag) }) = accept else {
                panic!("expected an Accept with a tag, got {accept:?}")
            };
            assert_eq!(lease_id, t.lease_id);
            r.lease = Some((lease_id, tag));
            let expires = std::time::Instant::now() + t.lease_ttl;
            bounded("open tag", r.link.driver.open(tag, expires)).await.unwrap();
            return;
        }
        assert_eq!(accept, Some(Control::Accept { lease_id: t.lease_id, rdma_tag: None }));
    }
}

fn abort_code(c: Option<Control>) -> Option<AbortCode> {
    match c {
        Some(Control::Abort { code, .. }) => Some(code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_killed_mid_transfer_frees_the_lease() {
    for kind in all_kinds() {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let l = layout();
        let res = pair.receiver.handle().reserve(RequestId(1), 32, None).await.unwrap();
        let sender =
            bounded("start", KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg(3))).await.unwrap();
        let chunks = sender.chunks();
        for c in prefill_chunks(&l, 32, 4).into_iter().take(7) {
            bounded("send", sender.send(c)).await.unwrap();
        }
        drop(sender); // the prefill node dies / the request is dropped on the prefill side
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(
            matches!(
                err,
                KvTransferError::SenderGone { .. } | KvTransferError::Truncated { .. } | KvTransferError::Io { .. }
            ),
            "{kind:?}: {err}"
        );
        // The compute thread's handle now fails clearly.
        let e = chunks.send(common::chunk(&l, 0, 28, 4)).await.unwrap_err();
        assert!(matches!(e, KvTransferError::Closed { .. }), "{e}");
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_dies_mid_transfer_and_restarts_on_the_same_address() {
    for kind in all_kinds() {
        let mut pair = Pair::new(kind, PairOptions::default()).await;
        let l = layout();
        let res = pair.receiver.handle().reserve(RequestId(1), 32, None).await.unwrap();
        let stale = res.ticket.clone();
        let sender =
            bounded("start", KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg(2))).await.unwrap();
        for c in prefill_chunks(&l, 32, 4).into_iter().take(5) {
            bounded("send", sender.send(c)).await.unwrap();
        }
        pair.restart_receiver(PairOptions::default()).await;
        // The receiver's waiter ended with it: `Closed` when the actor went first, or the
        // stream error it saw while its listener closed the connections.
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(!matches!(err, KvTransferError::Timeout { .. }), "{kind:?}: {err}");
        // The sender learns it at its next step: a clear error, no hang.
        let mut err = None;
        for c in prefill_chunks(&l, 32, 4).into_iter().skip(5) {
            if let Err(e) = bounded("send", sender.send(c)).await {
                err = Some(e);
                break;
            }
        }
        let err = match err {
            Some(e) => e,
            None => bounded("finish", sender.finish(1)).await.unwrap_err(),
        };
        assert!(!err.to_string().is_empty(), "{kind:?}");
        // A stale ticket names no lease of the new life: refused, nothing leaked.
        let e = bounded("stale start", KvSender::start(pair.transport.as_ref(), &stale, &l, &cfg(1))).await;
        let Err(e) = e else { panic!("{kind:?}: stale ticket accepted") };
        assert!(
            matches!(
                &e,
                KvTransferError::PeerAborted { .. }
                    | KvTransferError::ConnectionLost { .. }
                    | KvTransferError::Net(
                        cleave_net::NetError::Connect { .. } | cleave_net::NetError::ConnectionLost { .. }
                    )
            ),
            "{kind:?}: {e}"
        );
        // The next transfer to the new receiver works (a stale cached connection may fail one
        // attempt, cleanly).
        let mut ok = false;
        for attempt in 0..3u64 {
            let res = pair.receiver.handle().reserve(RequestId(100 + attempt), 8, None).await.unwrap();
            let r = async {
                let s = KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg(2)).await?;
                for c in prefill_chunks(&l, 8, 4) {
                    s.send(c).await?;
                }
                s.finish(9).await
            };
            match bounded("transfer after restart", r).await {
                Ok(_) => {
                    let done = res.done.wait(WAIT).await.unwrap();
                    pair.pool.free_request(&done.blocks);
                    ok = true;
                    break;
                }
                Err(e) => {
                    eprintln!("{kind:?}: attempt {attempt} after restart failed: {e}");
                    // Whatever failed, the lease must not leak.
                    let _ = res.done.wait(WAIT).await;
                }
            }
        }
        assert!(ok, "{kind:?}: no transfer succeeded after the restart");
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_mid_transfer_aborts_the_sender() {
    for kind in all_kinds() {
        let pair = Pair::new(kind, PairOptions { blocks: 64, lease_ttl: Duration::from_millis(300) }).await;
        let l = layout();
        let res = pair.receiver.handle().reserve(RequestId(1), 16, None).await.unwrap();
        let sender =
            bounded("start", KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg(2))).await.unwrap();
        bounded("send", sender.send(common::chunk(&l, 0, 0, 4))).await.unwrap();
        // The prefill stalls; the lease runs out (the waiter is the event we wait on).
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::LeaseExpired { .. }), "{kind:?}: {err}");
        pair.assert_nothing_leased().await;
        let err = bounded("finish", sender.finish(1)).await.unwrap_err();
        assert!(
            matches!(&err, KvTransferError::PeerAborted { code, .. } if code == "LeaseExpired")
                || matches!(err, KvTransferError::ConnectionLost { .. } | KvTransferError::Closed { .. }),
            "{kind:?}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expired_before_the_sender_starts_is_refused() {
    let kinds = all_kinds().into_iter().filter(|k| matches!(k, TransportKind::TcpPlain | TransportKind::Rdma));
    for kind in kinds {
        let pair = Pair::new(kind, PairOptions { blocks: 8, lease_ttl: Duration::from_millis(50) }).await;
        let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
        let ticket = res.ticket.clone();
        assert!(matches!(res.done.wait(WAIT).await, Err(KvTransferError::LeaseExpired { .. })));
        let err = bounded("start", KvSender::start(pair.transport.as_ref(), &ticket, &layout(), &cfg(1)))
            .await
            .err()
            .unwrap();
        assert!(matches!(&err, KvTransferError::PeerAborted { code, .. } if code == "UnknownLease"), "{kind:?}: {err}");
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_blocks_is_refused_at_reservation() {
    let pair = Pair::new(TransportKind::TcpPlain, PairOptions { blocks: 4, lease_ttl: WAIT }).await;
    let err = pair.receiver.handle().reserve(RequestId(1), 17, None).await.unwrap_err();
    assert!(matches!(err, KvTransferError::OutOfBlocks { need: 5, free: 4 }), "{err}");
    let err = pair.receiver.handle().reserve(RequestId(1), 0, None).await.unwrap_err();
    assert!(matches!(err, KvTransferError::InvalidRequest { .. }), "{err}");
    // What fits is still granted.
    let res = pair.receiver.handle().reserve(RequestId(2), 16, None).await.unwrap();
    assert!(pair.receiver.handle().reserve(RequestId(3), 1, None).await.is_err());
    assert!(pair.receiver.handle().cancel(res.ticket.lease_id).await.unwrap());
    pair.assert_nothing_leased().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_and_late_chunks_are_dropped_and_counted() {
    for kind in KINDS {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
        let t = res.ticket.clone();
        let mut raw = Raw::open(&pair).await;
        raw.open_lease(&t).await;
        for layer in 0..3 {
            raw.chunk(t.lease_id, layer, 0, 2).await;
        }
        raw.chunk(t.lease_id, 1, 0, 2).await; // duplicate
        raw.send(&Control::Complete { lease_id: t.lease_id, first_token: 3 }).await;
        for layer in 0..3 {
            raw.chunk(t.lease_id, layer, 2, 2).await;
        }
        assert_eq!(raw.recv().await, Some(Control::Ack { lease_id: t.lease_id }), "{kind:?}");
        let done = res.done.wait(WAIT).await.unwrap();
        raw.chunk(t.lease_id, 0, 2, 2).await; // late: the lease completed
                                              // An Open for a lease that does not exist is answered in order, after the late chunk.
        raw.send(&Control::Open(Open {
            request_id: RequestId(1),
            lease_id: LeaseId(1),
            layout: layout(),
            num_tokens: 4,
            stream_index: 0,
            stream_count: 1,
            rdma_link: None,
        }))
        .await;
        assert_eq!(abort_code(raw.recv().await), Some(AbortCode::UnknownLease), "{kind:?}");
        let st = pair.receiver.handle().stats().await.unwrap();
        assert_eq!((st.duplicates_dropped, st.late_dropped, st.completed), (1, 1, 1), "{kind:?}");
        pair.pool.free_request(&done.blocks);
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_chunk_fails_both_sides() {
    for kind in KINDS {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
        let t = res.ticket.clone();
        let mut raw = Raw::open(&pair).await;
        raw.open_lease(&t).await;
        let Frame::Chunk { header, k, v } = chunk_frame(&layout(), t.lease_id, 0, 0, 4) else { unreachable!() };
        let mut k = k.to_vec();
        k[5] ^= 1; // one bit flipped in flight
        raw.bytes(&encode_chunk(&header, &k, &v)).await;
        assert_eq!(abort_code(raw.recv().await), Some(AbortCode::Checksum), "{kind:?}");
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::ChecksumMismatch { .. }), "{kind:?}: {err}");
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_truncated_frames_free_the_lease() {
    for kind in all_kinds() {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let handle = pair.receiver.handle();

        // Garbage after a good Open.
        let res = handle.reserve(RequestId(1), 4, None).await.unwrap();
        let mut raw = Raw::open(&pair).await;
        raw.open_lease(&res.ticket).await;
        raw.bytes(&[40, 0, 0, 0, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef]).await;
        raw.bytes(&[0u8; 36]).await;
        assert_eq!(abort_code(raw.recv().await), Some(AbortCode::Malformed), "{kind:?}");
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::MalformedFrame { .. }), "{kind:?}: {err}");

        // A chunk cut off by the end of the stream.
        let res = handle.reserve(RequestId(2), 4, None).await.unwrap();
        let mut raw = Raw::open(&pair).await;
        raw.open_lease(&res.ticket).await;
        let Frame::Chunk { header, k, v } = chunk_frame(&layout(), res.ticket.lease_id, 0, 0, 4) else {
            unreachable!()
        };
        let wire = encode_chunk(&header, &k, &v);
        raw.bytes(&wire[..wire.len() / 2]).await;
        bounded("shutdown", raw.s.send.shutdown()).await.unwrap();
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::Truncated { .. }), "{kind:?}: {err}");

        // A frame claiming a payload over the limit: refused before it is read.
        let res = handle.reserve(RequestId(3), 4, None).await.unwrap();
        let mut raw = Raw::open(&pair).await;
        raw.open_lease(&res.ticket).await;
        let huge = ChunkHeader { k_len: u32::MAX / 2, v_len: u32::MAX / 2, ..header };
        let head = cleave_kv_transfer::frame::encode_chunk_header(&huge);
        raw.bytes(&head).await;
        assert_eq!(abort_code(raw.recv().await), Some(AbortCode::Malformed), "{kind:?}");
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::FrameTooLarge { .. }), "{kind:?}: {err}");

        // Garbage on a fresh stream touches no lease.
        let res = handle.reserve(RequestId(4), 4, None).await.unwrap();
        let mut raw = Raw::open(&pair).await;
        raw.bytes(&[1, 0, 0, 0, 0, 0, 0, 0, 7]).await;
        assert_eq!(abort_code(raw.recv().await), Some(AbortCode::Malformed), "{kind:?}");
        assert_eq!(handle.stats().await.unwrap().live_leases, 1);
        assert!(handle.cancel(res.ticket.lease_id).await.unwrap());
        assert!(matches!(res.done.wait(WAIT).await, Err(KvTransferError::Cancelled { .. })));
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_mismatch_is_refused_before_any_byte_moves() {
    for kind in all_kinds() {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
        // Sender side: refused locally, no stream opened, the lease untouched.
        let mut other = layout();
        other.head_dim = 8;
        let err = KvSender::start(pair.transport.as_ref(), &res.ticket, &other, &cfg(1)).await.err().unwrap();
        assert!(matches!(err, KvTransferError::LayoutMismatch { field: "head_dim", .. }), "{err}");
        assert_eq!(pair.receiver.handle().stats().await.unwrap().live_leases, 1);
        // Receiver side: a sender that lies about its layout is refused at Open, lease freed.
        let mut raw = Raw::open(&pair).await;
        let mut wrong = layout();
        wrong.dtype = KvDtype::F16;
        raw.send(&Control::Open(Open {
            request_id: RequestId(1),
            lease_id: res.ticket.lease_id,
            layout: wrong,
            num_tokens: 4,
            stream_index: 0,
            stream_count: 1,
            rdma_link: raw.link(),
        }))
        .await;
        assert_eq!(abort_code(raw.recv().await), Some(AbortCode::LayoutMismatch), "{kind:?}");
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::LayoutMismatch { field: "dtype", .. }), "{kind:?}: {err}");
        assert_eq!(pair.receiver.handle().stats().await.unwrap().bytes_written, 0);
        pair.assert_nothing_leased().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_transfer_aborts_the_sender() {
    for kind in all_kinds() {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let l = layout();
        let res = pair.receiver.handle().reserve(RequestId(1), 16, None).await.unwrap();
        let sender =
            bounded("start", KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg(2))).await.unwrap();
        bounded("send", sender.send(common::chunk(&l, 0, 0, 4))).await.unwrap();
        assert!(pair.receiver.handle().cancel(res.ticket.lease_id).await.unwrap());
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(matches!(err, KvTransferError::Cancelled { .. }), "{err}");
        let err = bounded("finish", sender.finish(1)).await.unwrap_err();
        assert!(
            matches!(&err, KvTransferError::PeerAborted { code, .. } if code == "Cancelled")
                || matches!(err, KvTransferError::ConnectionLost { .. } | KvTransferError::Closed { .. }),
            "{kind:?}: {err}"
        );
        pair.assert_nothing_leased().await;
    }
}

/// Over RDMA, a notice for a lease that completed is late: dropped and counted, as a late chunk
/// is; a duplicate notice (tokens already noticed) is a gap that fails the lease, unlike a
/// duplicate chunk on a stream (notices are numbered per layer: the receiver cannot take one
/// twice).
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_late_notices_are_dropped_and_duplicates_fail_the_lease() {
    let pair = Pair::new(TransportKind::Rdma, PairOptions::default()).await;
    let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
    let t = res.ticket.clone();
    let mut raw = Raw::open(&pair).await;
    raw.open_lease(&t).await;
    for layer in 0..3 {
        raw.landed(&t, layer, 0, 2).await;
        raw.landed(&t, layer, 2, 2).await;
    }
    raw.complete(&t, 3).await;
    assert_eq!(raw.recv().await, Some(Control::Ack { lease_id: t.lease_id }));
    let done = res.done.wait(WAIT).await.unwrap();
    for layer in 0..3 {
        let (k, v) = pair.pool.gather(&done.blocks, layer, 0, 4);
        let c = common::chunk(&layout(), layer, 0, 4);
        assert!(k == c.k && v == c.v, "layer {layer} landed wrong");
    }
    // Late: the notice of a lease that completed (its writes long landed).
    let late = Landed { lease_id: t.lease_id, layer: 0, token_start: 2, token_count: 2, chunk: 1, crc32: 0 };
    raw.send(&Control::Landed(late)).await;
    raw.send(&Control::Open(Open {
        request_id: RequestId(1),
        lease_id: LeaseId(1),
        layout: layout(),
        num_tokens: 4,
        stream_index: 0,
        stream_count: 1,
        rdma_link: raw.link(),
    }))
    .await;
    assert_eq!(abort_code(raw.recv().await), Some(AbortCode::UnknownLease));
    let st = pair.receiver.handle().stats().await.unwrap();
    assert_eq!((st.duplicates_dropped, st.late_dropped, st.completed), (0, 1, 1));
    pair.pool.free_request(&done.blocks);

    // Duplicate: tokens 0..2 of layer 0 noticed twice.
    let res = pair.receiver.handle().reserve(RequestId(2), 4, None).await.unwrap();
    let t = res.ticket.clone();
    let mut raw = Raw::open(&pair).await;
    raw.open_lease(&t).await;
    raw.landed(&t, 0, 0, 2).await;
    let again = Landed { lease_id: t.lease_id, layer: 0, token_start: 0, token_count: 2, chunk: 1, crc32: 0 };
    raw.send(&Control::Landed(again)).await;
    assert_eq!(abort_code(raw.recv().await), Some(AbortCode::Gap));
    let err = res.done.wait(WAIT).await.unwrap_err();
    assert!(matches!(err, KvTransferError::ChunkGap { .. }), "{err}");
    drop(raw);
    pair.assert_nothing_leased().await;
}

/// Over RDMA a payload corrupted on its way into the pool is caught when every write landed:
/// the notices' CRC-32 against the pool. Both sides fail clearly, the blocks come back.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_corrupt_write_fails_both_sides() {
    let pair = Pair::new(TransportKind::Rdma, PairOptions::default()).await;
    let l = layout();
    let res = pair.receiver.handle().reserve(RequestId(1), 16, None).await.unwrap();
    let sender = bounded("start", KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg(1))).await.unwrap();
    let fabric = &pair.rdma.as_ref().unwrap().fabric;
    let net = (1..=8).find_map(|qp| fabric.net(qp)).expect("the receiving queue pair");
    net.corrupt_write(3); // one bit flipped in flight
    for c in prefill_chunks(&l, 16, 4) {
        bounded("send", sender.send(c)).await.unwrap();
    }
    let err = bounded("finish", sender.finish(1)).await.unwrap_err();
    assert!(matches!(&err, KvTransferError::PeerAborted { code, .. } if code == "Checksum"), "{err}");
    let err = res.done.wait(WAIT).await.unwrap_err();
    assert!(matches!(err, KvTransferError::ChecksumMismatch { .. }), "{err}");
    pair.assert_nothing_leased().await;
}

/// A receiver without an RDMA path (any build without the feature, or a node started without a
/// device) refuses loudly: a link offer gets an `Abort`, an `Open` naming a link frees its lease
/// with an error that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_without_rdma_refuses_links_and_opens_naming_one() {
    for kind in KINDS {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let mut raw = Raw::open(&pair).await;
        raw.send(&Control::LinkOffer { metadata: vec![1, 2, 3] }).await;
        match raw.recv().await {
            Some(Control::Abort { reason, .. }) => assert!(reason.contains("does not take RDMA links"), "{reason}"),
            other => panic!("{kind:?}: expected an abort, got {other:?}"),
        }
        let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
        let t = &res.ticket;
        let mut raw = Raw::open(&pair).await;
        raw.send(&Control::Open(Open {
            request_id: t.request_id,
            lease_id: t.lease_id,
            layout: layout(),
            num_tokens: 4,
            stream_index: 0,
            stream_count: 1,
            rdma_link: Some(7),
        }))
        .await;
        assert!(matches!(raw.recv().await, Some(Control::Abort { .. })), "{kind:?}");
        let err = res.done.wait(WAIT).await.unwrap_err();
        assert!(err.to_string().contains("takes no RDMA links"), "{kind:?}: {err}");
        pair.assert_nothing_leased().await;
    }
}
