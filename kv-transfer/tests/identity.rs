//! Who may take part in a handoff, over both authenticated transports (QUIC, TLS over TCP):
//! a sender pushes KV only to the node its ticket names, and only to a certificate that allows
//! the decode role; a receiver takes KV only from a certificate that allows the prefill role.
//! Each refusal moves no byte, and every block leased for it comes back.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cleave_kv_transfer::{
    KvSender, KvTransferError, MemoryPool, NetTransport, ReceiverConfig, ReceiverService, SendConfig,
};
use cleave_net::tls::{ClusterCa, NodeIdentity, Roles};
use cleave_net::{Listener, NetConfig, NetKind};
use cleave_protocol::{RequestId, TransportKind};
use common::{bounded, layout, prefill_chunks, WAIT};

const AUTHENTICATED: [(TransportKind, NetKind); 2] =
    [(TransportKind::Quic, NetKind::Quic), (TransportKind::TcpTls, NetKind::TcpTls)];

/// A receiver with `id`'s certificate that names itself in its tickets, as a decode node does.
async fn receiver(kind: TransportKind, nk: NetKind, id: &NodeIdentity) -> (ReceiverService, MemoryPool, SocketAddr) {
    let net = NetConfig::new(nk, Some(id.clone()));
    let listener = Listener::bind(&net, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr();
    let mut cfg = ReceiverConfig::new(layout(), addr, kind);
    cfg.name = Some(id.name().to_string());
    cfg.command_timeout = WAIT;
    let pool = MemoryPool::new(layout(), 16);
    (ReceiverService::spawn(cfg, pool.clone(), Some(listener)), pool, addr)
}

fn sender_transport(nk: NetKind, id: &NodeIdentity) -> NetTransport {
    let mut net = NetConfig::new(nk, Some(id.clone()));
    net.connect_timeout = Duration::from_secs(5);
    NetTransport::new(&net).unwrap()
}

/// Pushes a whole 12-token request under `ticket`; the sender's first error, if any.
async fn push(t: &NetTransport, ticket: &cleave_protocol::HandoffTicket) -> Result<(), KvTransferError> {
    let l = layout();
    let sender = bounded("start", KvSender::start(t, ticket, &l, &SendConfig::default())).await?;
    for c in prefill_chunks(&l, ticket.num_tokens, 4) {
        bounded("send", sender.send(c)).await?;
    }
    bounded("finish", sender.finish(7)).await.map(|_| ())
}

async fn assert_idle(r: &ReceiverService, pool: &MemoryPool, what: &str) {
    let st = bounded("stats", r.handle().stats()).await.unwrap();
    assert_eq!((st.reserved_blocks, st.live_leases), (0, 0), "{what}: {st:?}");
    assert_eq!(pool.free_blocks(), pool.total_blocks(), "{what}: pool lost blocks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_pushes_only_to_the_node_its_ticket_names() {
    for (kind, nk) in AUTHENTICATED {
        let ca = ClusterCa::generate().unwrap();
        let (a_id, b_id) =
            (ca.issue_with("decode-a", Roles::DECODE).unwrap(), ca.issue_with("decode-b", Roles::DECODE).unwrap());
        let (a, a_pool, _) = receiver(kind, nk, &a_id).await;
        let (b, b_pool, b_addr) = receiver(kind, nk, &b_id).await;
        let t = sender_transport(nk, &ca.issue_with("prefill-0", Roles::PREFILL).unwrap());

        // decode-a's ticket, its address redirected to decode-b (a stale or rewritten address).
        let res = bounded("reserve", a.handle().reserve(RequestId(1), 12, None)).await.unwrap();
        assert_eq!(res.ticket.receiver_name.as_deref(), Some("decode-a"), "{kind:?}: tickets name their receiver");
        let mut redirected = res.ticket.clone();
        redirected.receiver_addr = b_addr;
        match push(&t, &redirected).await {
            Err(KvTransferError::WrongReceiver { addr, reason }) => {
                assert_eq!(addr, b_addr);
                assert!(reason.contains("decode-a") && reason.contains("decode-b"), "{kind:?}: {reason}");
            }
            other => panic!("{kind:?}: a redirected ticket must be refused, got {other:?}"),
        }
        let st = bounded("stats", b.handle().stats()).await.unwrap();
        assert_eq!((st.completed, st.reserved_blocks), (0, 0), "{kind:?}: nothing reached decode-b: {st:?}");

        // The same ticket at its own address goes through.
        push(&t, &res.ticket).await.unwrap();
        let done = res.done.wait(WAIT).await.unwrap();
        a_pool.free_request(&done.blocks);
        assert_idle(&a, &a_pool, "decode-a").await;
        assert_idle(&b, &b_pool, "decode-b").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_refuses_a_receiver_whose_certificate_does_not_allow_decode() {
    for (kind, nk) in AUTHENTICATED {
        let ca = ClusterCa::generate().unwrap();
        let (r, pool, _) = receiver(kind, nk, &ca.issue_with("prefill-x", Roles::PREFILL).unwrap()).await;
        let t = sender_transport(nk, &ca.issue_with("prefill-0", Roles::PREFILL).unwrap());
        let res = bounded("reserve", r.handle().reserve(RequestId(2), 12, None)).await.unwrap();
        match push(&t, &res.ticket).await {
            Err(KvTransferError::WrongReceiver { reason, .. }) => {
                assert!(reason.contains("decode role"), "{kind:?}: {reason}")
            }
            other => panic!("{kind:?}: a receiver without the decode role must be refused, got {other:?}"),
        }
        assert!(bounded("cancel", r.handle().cancel(res.ticket.lease_id)).await.unwrap());
        assert_idle(&r, &pool, "receiver").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_takes_kv_only_from_a_certificate_that_allows_prefill() {
    for (kind, nk) in AUTHENTICATED {
        let ca = ClusterCa::generate().unwrap();
        let (r, pool, _) = receiver(kind, nk, &ca.issue_with("decode-a", Roles::DECODE).unwrap()).await;
        // A decode-only certificate (another decode node, or its stolen key) may not write
        // into this node's blocks.
        let t = sender_transport(nk, &ca.issue_with("decode-b", Roles::DECODE).unwrap());
        let res = bounded("reserve", r.handle().reserve(RequestId(3), 12, None)).await.unwrap();
        let err = push(&t, &res.ticket).await.expect_err("a decode-only sender must be refused");
        let st = bounded("stats", r.handle().stats()).await.unwrap();
        assert_eq!(st.completed, 0, "{kind:?}: {err}: {st:?}");
        assert!(bounded("cancel", r.handle().cancel(res.ticket.lease_id)).await.unwrap(), "{kind:?}: lease still open");
        assert_idle(&r, &pool, "receiver").await;

        // The prefill certificate of the same cluster gets through.
        let t = sender_transport(nk, &ca.issue_with("prefill-0", Roles::PREFILL).unwrap());
        let res = bounded("reserve", r.handle().reserve(RequestId(4), 12, None)).await.unwrap();
        push(&t, &res.ticket).await.unwrap();
        pool.free_request(&res.done.wait(WAIT).await.unwrap().blocks);
        assert_idle(&r, &pool, "receiver").await;
    }
}
