//! End-to-end handoffs over every transport: reserve, push layer chunks as a prefill would,
//! finish, and check every byte landed in the leased blocks and nothing stays leased.

mod common;

use std::time::Duration;

use cleave_kv_transfer::{KvSender, SendConfig};
use cleave_protocol::{RequestId, TransportKind};
use common::{bounded, kv_bytes, layout, prefill_chunks, Pair, PairOptions, KINDS};

/// Pushes a whole request and checks the received blocks against the reference bytes.
async fn transfer(pair: &Pair, request: u64, num_tokens: u32, step: u32, streams: usize) {
    let l = layout();
    let res = bounded("reserve", pair.receiver.handle().reserve(RequestId(request), num_tokens, None)).await.unwrap();
    let ticket = res.ticket.clone();
    assert_eq!(ticket.transport, pair.kind);
    let cfg = SendConfig { streams, ..SendConfig::default() };
    let sender = bounded("start", KvSender::start(pair.transport.as_ref(), &ticket, &l, &cfg)).await.unwrap();
    for c in prefill_chunks(&l, num_tokens, step) {
        bounded("send", sender.send(c)).await.unwrap();
    }
    let report = bounded("finish", sender.finish(1234)).await.unwrap();
    let done = res.done.wait(common::WAIT).await.unwrap();
    assert_eq!(done.first_token, 1234);
    assert_eq!(done.blocks, ticket.block_ids);
    assert_eq!(report.bytes, (num_tokens as usize * l.bytes_per_token()) as u64);
    assert!(report.throughput_bytes_per_sec() > 0.0);
    for layer in 0..l.num_layers {
        let (k, v) = pair.pool.gather(&done.blocks, layer, 0, num_tokens);
        assert_eq!(k, kv_bytes(&l, 0, layer, 0, num_tokens), "{:?} layer {layer} K", pair.kind);
        assert_eq!(v, kv_bytes(&l, 1, layer, 0, num_tokens), "{:?} layer {layer} V", pair.kind);
    }
    // The decode request ends: its blocks go back.
    pair.pool.free_request(&done.blocks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_over_every_transport() {
    for kind in KINDS {
        let pair = Pair::new(kind, PairOptions::default()).await;
        // One stream, several streams, a prompt that is not a multiple of the block size.
        transfer(&pair, 1, 16, 4, 1).await;
        transfer(&pair, 2, 37, 5, 3).await;
        transfer(&pair, 3, 1, 1, 8).await;
        pair.assert_nothing_leased().await;
        let st = pair.receiver.handle().stats().await.unwrap();
        assert_eq!(st.completed, 3, "{kind:?}");
        assert_eq!(st.released, 0, "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_handoffs_share_connections() {
    for kind in [TransportKind::Quic, TransportKind::TcpPlain] {
        let pair = Pair::new(kind, PairOptions::default()).await;
        let mut joins = Vec::new();
        let pair = std::sync::Arc::new(pair);
        for r in 0..4u64 {
            let p = pair.clone();
            joins.push(tokio::spawn(async move { transfer(&p, 10 + r, 12, 4, 2).await }));
        }
        for j in joins {
            bounded("transfer", j).await.unwrap();
        }
        pair.assert_nothing_leased().await;
    }
}

/// The compute thread enqueues with `blocking_send` (outside the runtime) while the transfer
/// runs: transfer overlaps prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_thread_enqueues_with_blocking_send() {
    let pair = Pair::new(TransportKind::TcpPlain, PairOptions::default()).await;
    let l = layout();
    let res = pair.receiver.handle().reserve(RequestId(5), 40, None).await.unwrap();
    let cfg = SendConfig { streams: 2, queue_depth: 1, ..SendConfig::default() };
    let sender = bounded("start", KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &cfg)).await.unwrap();
    let chunks = sender.chunks();
    let lc = l.clone();
    let compute = std::thread::spawn(move || {
        for c in prefill_chunks(&lc, 40, 3) {
            chunks.blocking_send(c).unwrap();
        }
    });
    bounded("compute thread", tokio::task::spawn_blocking(move || compute.join().unwrap())).await.unwrap();
    let report = bounded("finish", sender.finish(7)).await.unwrap();
    assert_eq!(report.chunks, 14 * 3);
    let done = res.done.wait(Duration::from_secs(20)).await.unwrap();
    pair.pool.free_request(&done.blocks);
    pair.assert_nothing_leased().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_that_do_not_fit_the_ticket_fail_at_the_caller() {
    let pair = Pair::new(TransportKind::InProcess, PairOptions::default()).await;
    let l = layout();
    let res = pair.receiver.handle().reserve(RequestId(5), 8, None).await.unwrap();
    let sender = KvSender::start(pair.transport.as_ref(), &res.ticket, &l, &SendConfig::default()).await.unwrap();
    let mut bad = common::chunk(&l, 0, 6, 3);
    assert!(sender.send(bad.clone()).await.is_err(), "past the token count");
    bad = common::chunk(&l, 3, 0, 1);
    assert!(sender.send(bad).await.is_err(), "past the layer count");
    let mut short = common::chunk(&l, 0, 0, 2);
    short.k = short.k.slice(..8);
    assert!(sender.send(short).await.is_err(), "wrong byte length");
    drop(sender);
    let err = res.done.wait(common::WAIT).await.unwrap_err();
    assert!(matches!(err, cleave_kv_transfer::KvTransferError::SenderGone { .. }), "{err}");
    pair.assert_nothing_leased().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_is_chosen_per_ticket_without_fallback() {
    let pair = Pair::new(TransportKind::InProcess, PairOptions::default()).await;
    let set = cleave_kv_transfer::TransportSet::new().with(pair.transport.clone());
    let res = pair.receiver.handle().reserve(RequestId(1), 4, None).await.unwrap();
    assert_eq!(set.pick(&res.ticket).unwrap().kind(), TransportKind::InProcess);
    let mut t = res.ticket.clone();
    t.transport = TransportKind::Quic;
    assert!(set.pick(&t).is_err());
    pair.receiver.handle().cancel(res.ticket.lease_id).await.unwrap();
    pair.assert_nothing_leased().await;
}

/// A pool owned by "another thread": request 1's reservation is answered only when the test
/// opens the gate; every other request's at once.
struct GatedPool {
    pool: cleave_kv_transfer::MemoryPool,
    gate: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl cleave_kv_transfer::KvSink for GatedPool {
    fn reserve(&mut self, ask: cleave_kv_transfer::Ask) -> cleave_kv_transfer::Reserved {
        let pool = self.pool.clone();
        match (ask.request_id, self.gate.take()) {
            (RequestId(1), Some(gate)) => cleave_kv_transfer::Reserved::Later(Box::pin(async move {
                let _ = gate.await;
                pool.take_blocks(ask.num_blocks).map(cleave_kv_transfer::Grant::fresh)
            })),
            (_, gate) => {
                self.gate = gate;
                self.pool.reserve(ask)
            }
        }
    }
    fn write(&mut self, w: &cleave_kv_transfer::KvWrite) -> cleave_kv_transfer::Result<()> {
        self.pool.write(w)
    }
    fn release(&mut self, request_id: RequestId, blocks: &[u32]) {
        self.pool.release(request_id, blocks)
    }
}

/// A reservation the pool answers later (the engine's, mid-step) holds up nothing: another
/// request reserves, transfers and completes meanwhile; then the held one is granted and
/// completes too, and nothing stays leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_answered_later_does_not_block_other_leases() {
    use cleave_kv_transfer::{MemoryPool, ReceiverConfig, ReceiverService};
    let l = layout();
    let pool = MemoryPool::new(l.clone(), 64);
    let (open, gate) = tokio::sync::oneshot::channel();
    let mut cfg = ReceiverConfig::new(l.clone(), "127.0.0.1:1".parse().unwrap(), TransportKind::InProcess);
    cfg.command_timeout = common::WAIT;
    let receiver = ReceiverService::spawn(cfg, GatedPool { pool: pool.clone(), gate: Some(gate) }, None);
    let transport = receiver.handle().in_process();
    let h = receiver.handle().clone();
    let held = tokio::spawn(async move { h.reserve(RequestId(1), 16, None).await });
    // Request 2 goes all the way through while request 1 waits for its blocks.
    let res = bounded("reserve 2", receiver.handle().reserve(RequestId(2), 20, None)).await.unwrap();
    let sender =
        bounded("start 2", KvSender::start(&transport, &res.ticket, &l, &SendConfig::default())).await.unwrap();
    for c in prefill_chunks(&l, 20, 7) {
        bounded("send 2", sender.send(c)).await.unwrap();
    }
    bounded("finish 2", sender.finish(2)).await.unwrap();
    let done2 = res.done.wait(common::WAIT).await.unwrap();
    assert!(!held.is_finished(), "request 1's reservation was answered before the gate opened");
    open.send(()).unwrap();
    let res1 = bounded("reserve 1", held).await.unwrap().unwrap();
    assert_eq!(res1.ticket.block_ids.len(), 4);
    let sender =
        bounded("start 1", KvSender::start(&transport, &res1.ticket, &l, &SendConfig::default())).await.unwrap();
    for c in prefill_chunks(&l, 16, 16) {
        bounded("send 1", sender.send(c)).await.unwrap();
    }
    bounded("finish 1", sender.finish(1)).await.unwrap();
    let done1 = res1.done.wait(common::WAIT).await.unwrap();
    assert_eq!(done1.first_token, 1);
    for blocks in [&done1.blocks, &done2.blocks] {
        pool.free_request(blocks);
    }
    let st = receiver.handle().stats().await.unwrap();
    assert_eq!((st.completed, st.reserved_blocks), (2, 0));
    assert_eq!(pool.free_blocks(), 64);
}

/// A reservation whose requester went away while the pool made room (a decode node waits for
/// KV blocks to free; the client disconnected meanwhile): when the pool answers, its blocks go
/// straight back instead of opening a lease that nobody will use until its TTL expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_grant_nobody_waits_for_goes_back_to_the_pool() {
    use cleave_kv_transfer::{MemoryPool, ReceiverConfig, ReceiverService};
    let l = layout();
    let pool = MemoryPool::new(l.clone(), 64);
    let (open, gate) = tokio::sync::oneshot::channel();
    let mut cfg = ReceiverConfig::new(l.clone(), "127.0.0.1:1".parse().unwrap(), TransportKind::InProcess);
    cfg.command_timeout = common::WAIT;
    let receiver = ReceiverService::spawn(cfg, GatedPool { pool: pool.clone(), gate: Some(gate) }, None);
    let h = receiver.handle().clone();
    let waiter = tokio::spawn(async move { h.reserve(RequestId(1), 16, None).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    waiter.abort();
    let _ = waiter.await;
    open.send(()).unwrap();
    let deadline = std::time::Instant::now() + common::WAIT;
    while pool.free_blocks() != 64 {
        assert!(std::time::Instant::now() < deadline, "the late grant's blocks stayed taken");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = receiver.handle().stats().await.unwrap();
    assert_eq!(st.reserved_blocks, 0, "a lease was opened for nobody");
}

/// A pool with a prefix cache of one entry: blocks that already hold the K and V of `prefix`
/// (whole blocks). A reservation whose prompt starts with it (and goes on past it) gets those
/// blocks first, pinned: a release gives back only the fresh ones.
struct PrefixPool {
    pool: cleave_kv_transfer::MemoryPool,
    prefix: Vec<u32>,
    blocks: Vec<u32>,
}

impl cleave_kv_transfer::KvSink for PrefixPool {
    fn reserve(&mut self, ask: cleave_kv_transfer::Ask) -> cleave_kv_transfer::Reserved {
        let hit = ask.prompt.as_ref().is_some_and(|p| p.len() > self.prefix.len() && p.starts_with(&self.prefix));
        if !hit {
            return self.pool.reserve(ask);
        }
        let fresh = self.pool.take_blocks(ask.num_blocks - self.blocks.len());
        cleave_kv_transfer::Reserved::Now(fresh.map(|fresh| cleave_kv_transfer::Grant {
            blocks: self.blocks.iter().copied().chain(fresh).collect(),
            cached_tokens: self.prefix.len() as u32,
        }))
    }
    fn write(&mut self, w: &cleave_kv_transfer::KvWrite) -> cleave_kv_transfer::Result<()> {
        assert!(
            w.token_start >= self.prefix.len() as u32 || !w.blocks.starts_with(&self.blocks),
            "a cached block written"
        );
        self.pool.write(w)
    }
    fn release(&mut self, request_id: RequestId, blocks: &[u32]) {
        let fresh: Vec<u32> = blocks.iter().copied().filter(|b| !self.blocks.contains(b)).collect();
        self.pool.release(request_id, &fresh)
    }
}

/// A delta handoff over every stream transport: the receiver's pool holds the first 8 tokens of
/// the prompt, the ticket says so, the sender is given every token (as the prefill engine
/// exports them, in chunks that straddle the prefix's end) and moves only tokens 8..21; the
/// blocks then hold the whole prompt. A reservation without the prompt, or with another
/// prompt, moves everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_handoff_moves_only_what_the_receiver_lacks() {
    use cleave_kv_transfer::{KvWrite, MemoryPool};
    let l = layout();
    let row = l.bytes_per_token() as u64;
    for kind in [TransportKind::InProcess, TransportKind::TcpPlain, TransportKind::Quic] {
        let pool = MemoryPool::new(l.clone(), 64);
        // An earlier request left tokens 0..8 in two blocks.
        let held = pool.take_blocks(2).unwrap();
        for c in prefill_chunks(&l, 8, 8) {
            let w = KvWrite {
                lease: cleave_protocol::LeaseId(0),
                request_id: RequestId(0),
                blocks: held.clone().into(),
                layer: c.layer,
                token_start: 0,
                token_count: 8,
                k: c.k,
                v: c.v,
            };
            cleave_kv_transfer::KvSink::write(&mut pool.clone(), &w).unwrap();
        }
        let prompt: Vec<u32> = (100..121).collect();
        let sink = PrefixPool { pool: pool.clone(), prefix: prompt[..8].to_vec(), blocks: held.clone() };
        let (receiver, transport) = common::spawn_receiver_with(kind, sink).await;
        let cases: [(Option<Vec<u32>>, u32); 3] =
            [(Some(prompt.clone()), 8), (None, 0), (Some((200..221).collect()), 0)];
        for (i, (p, cached)) in cases.into_iter().enumerate() {
            let id = RequestId(1 + i as u64);
            let res = match p {
                Some(p) => receiver.handle().reserve_prompt(id, p.into(), None).await.unwrap(),
                None => receiver.handle().reserve(id, 21, None).await.unwrap(),
            };
            assert_eq!(res.ticket.cached_tokens, cached, "{kind:?} case {i}");
            let sender = bounded("start", KvSender::start(transport.as_ref(), &res.ticket, &l, &SendConfig::default()))
                .await
                .unwrap();
            for c in prefill_chunks(&l, 21, 5) {
                bounded("send", sender.send(c)).await.unwrap();
            }
            let report = bounded("finish", sender.finish(9)).await.unwrap();
            assert_eq!(
                report.bytes,
                u64::from(21 - cached) * row,
                "{kind:?} case {i}: only the uncached tokens travel"
            );
            let done = res.done.wait(common::WAIT).await.unwrap();
            assert_eq!(done.blocks[..2] == held[..], cached > 0, "{kind:?} case {i}");
            for layer in 0..l.num_layers {
                let (k, v) = pool.gather(&done.blocks, layer, 0, 21);
                assert_eq!(k, kv_bytes(&l, 0, layer, 0, 21), "{kind:?} case {i} layer {layer} K");
                assert_eq!(v, kv_bytes(&l, 1, layer, 0, 21), "{kind:?} case {i} layer {layer} V");
            }
            let fresh: Vec<u32> = done.blocks.iter().copied().filter(|b| !held.contains(b)).collect();
            pool.free_request(&fresh);
        }
        // A lease that fails gives back its fresh blocks and keeps the cached ones.
        let res = receiver.handle().reserve_prompt(RequestId(9), prompt.clone().into(), None).await.unwrap();
        receiver.handle().cancel(res.ticket.lease_id).await.unwrap();
        assert!(res.done.wait(common::WAIT).await.is_err());
        let st = receiver.handle().stats().await.unwrap();
        assert_eq!((st.completed, st.reserved_blocks), (3, 0), "{kind:?}");
        assert_eq!(pool.free_blocks(), 62, "{kind:?}: all but the two cached blocks");
    }
}
