//! Helpers shared by the kv-transfer integration tests.
#![allow(dead_code)]

use bytes::Bytes;
use cleave_kv_transfer::frame::{checksum, run_bytes, ChunkHeader, Frame};
use cleave_kv_transfer::LayerChunk;
use cleave_protocol::{KvDtype, KvLayout, LeaseId};

/// A small layout: 3 layers, 2 KV heads, head dim 4, f32, 4 tokens per block (32 B per token
/// per layer for K).
pub fn layout() -> KvLayout {
    KvLayout {
        model_fingerprint: 0xC1EA_7E00,
        dtype: KvDtype::F32,
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 4,
    }
}

/// Deterministic K (or V, `which` = 1) bytes of tokens `start..start+count` of `layer`:
/// f32 values that encode (which, layer, token, element), little-endian.
pub fn kv_bytes(layout: &KvLayout, which: u32, layer: u32, start: u32, count: u32) -> Bytes {
    let per_tok = (layout.num_kv_heads * layout.head_dim) as usize;
    let mut out = Vec::with_capacity(run_bytes(layout, count));
    for t in start..start + count {
        for e in 0..per_tok {
            let x = (which * 1_000_000 + layer * 10_000 + t * 10 + e as u32 % 10) as f32 + e as f32 / 1024.0;
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    Bytes::from(out)
}

pub fn chunk(layout: &KvLayout, layer: u32, start: u32, count: u32) -> LayerChunk {
    LayerChunk {
        layer,
        token_start: start,
        token_count: count,
        k: kv_bytes(layout, 0, layer, start, count),
        v: kv_bytes(layout, 1, layer, start, count),
    }
}

/// A chunk frame as the receiver decodes it.
pub fn chunk_frame(layout: &KvLayout, lease: LeaseId, layer: u32, start: u32, count: u32) -> Frame {
    let c = chunk(layout, layer, start, count);
    let header = ChunkHeader {
        lease_id: lease,
        layer,
        token_start: start,
        token_count: count,
        k_len: c.k.len() as u32,
        v_len: c.v.len() as u32,
        crc32: checksum(&c.k, &c.v),
    };
    Frame::Chunk { header, k: c.k, v: c.v }
}

/// The chunks of a prefill of `num_tokens` tokens done in prefill chunks of `step` tokens:
/// for each prefill chunk, every layer in order.
pub fn prefill_chunks(layout: &KvLayout, num_tokens: u32, step: u32) -> Vec<LayerChunk> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < num_tokens {
        let n = step.min(num_tokens - start);
        for layer in 0..layout.num_layers {
            out.push(chunk(layout, layer, start, n));
        }
        start += n;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A receiver and a sender-side transport over a real (or in-process) transport.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cleave_kv_transfer::{MemoryPool, NetTransport, ReceiverConfig, ReceiverService, Transport};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Listener, NetConfig, NetKind};
use cleave_protocol::TransportKind;

/// Upper bound of any single wait in these tests; far above what each step needs.
pub const WAIT: Duration = Duration::from_secs(20);

pub async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f).await.unwrap_or_else(|_| panic!("{what} did not finish within {WAIT:?}"))
}

/// The transports every end-to-end and fault test runs over.
pub const KINDS: [TransportKind; 4] =
    [TransportKind::InProcess, TransportKind::TcpPlain, TransportKind::TcpTls, TransportKind::Quic];

fn net_kind(kind: TransportKind) -> NetKind {
    match kind {
        TransportKind::Quic => NetKind::Quic,
        TransportKind::TcpTls => NetKind::TcpTls,
        TransportKind::TcpPlain => NetKind::TcpPlain,
        other => panic!("{other:?} is not a network transport"),
    }
}

/// One decode-side receiver (with its pool) and one prefill-side transport to it.
pub struct Pair {
    pub kind: TransportKind,
    pub receiver: ReceiverService,
    pub pool: MemoryPool,
    pub transport: Arc<dyn Transport>,
    pub addr: SocketAddr,
    /// The receiver's identity and config, to restart it on the same address.
    receiver_net: Option<NetConfig>,
}

pub struct PairOptions {
    pub blocks: usize,
    pub lease_ttl: Duration,
}

impl Default for PairOptions {
    fn default() -> Self {
        Self { blocks: 64, lease_ttl: Duration::from_secs(60) }
    }
}

fn receiver_cfg(kind: TransportKind, addr: SocketAddr, opts: &PairOptions) -> ReceiverConfig {
    let mut cfg = ReceiverConfig::new(layout(), addr, kind);
    cfg.lease_ttl = opts.lease_ttl;
    cfg.stream_idle_timeout = WAIT;
    cfg.command_timeout = WAIT;
    cfg
}

impl Pair {
    pub async fn new(kind: TransportKind, opts: PairOptions) -> Pair {
        let pool = MemoryPool::new(layout(), opts.blocks);
        if kind == TransportKind::InProcess {
            let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
            let receiver = ReceiverService::spawn(receiver_cfg(kind, addr, &opts), pool.clone(), None);
            let transport = Arc::new(receiver.handle().in_process());
            return Pair { kind, receiver, pool, transport, addr, receiver_net: None };
        }
        let ids = NodeIdentity::generate_test_cluster(&["decode-0", "prefill-0"]).unwrap();
        let nk = net_kind(kind);
        let (rid, sid) =
            if nk == NetKind::TcpPlain { (None, None) } else { (Some(ids[0].clone()), Some(ids[1].clone())) };
        let mut rnet = NetConfig::new(nk, rid);
        rnet.connect_timeout = Duration::from_secs(5);
        let listener = Listener::bind(&rnet, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr();
        let receiver = ReceiverService::spawn(receiver_cfg(kind, addr, &opts), pool.clone(), Some(listener));
        let mut snet = NetConfig::new(nk, sid);
        snet.connect_timeout = Duration::from_secs(5);
        let transport = Arc::new(NetTransport::new(&snet).unwrap());
        Pair { kind, receiver, pool, transport, addr, receiver_net: Some(rnet) }
    }

    /// Stops the receiver and starts a fresh one (new pool, new lease ids) on the same address;
    /// the sender keeps its transport (and whatever stale connection it cached).
    pub async fn restart_receiver(&mut self, opts: PairOptions) {
        let old = std::mem::replace(
            &mut self.receiver,
            ReceiverService::spawn(receiver_cfg(self.kind, self.addr, &opts), MemoryPool::new(layout(), 1), None),
        );
        old.shutdown(WAIT).await;
        self.pool = MemoryPool::new(layout(), opts.blocks);
        match &self.receiver_net {
            None => {
                self.receiver =
                    ReceiverService::spawn(receiver_cfg(self.kind, self.addr, &opts), self.pool.clone(), None);
                self.transport = Arc::new(self.receiver.handle().in_process());
            }
            Some(rnet) => {
                let listener = bounded("rebind", rebind(rnet, self.addr)).await;
                self.receiver = ReceiverService::spawn(
                    receiver_cfg(self.kind, self.addr, &opts),
                    self.pool.clone(),
                    Some(listener),
                );
            }
        }
    }

    /// Both sides hold nothing: no live lease, every block back in the pool.
    pub async fn assert_nothing_leased(&self) {
        let st = bounded("stats", self.receiver.handle().stats()).await.unwrap();
        assert_eq!(st.reserved_blocks, 0, "{:?}: receiver still holds blocks: {st:?}", self.kind);
        assert_eq!(st.live_leases, 0, "{:?}: {st:?}", self.kind);
        assert_eq!(self.pool.free_blocks(), self.pool.total_blocks(), "{:?}: pool lost blocks", self.kind);
    }
}

/// Binds `addr` again once the previous listener let go of it (a dropped listener's socket is
/// closed by its task, which the runtime runs shortly; the wait is bounded).
pub async fn rebind(cfg: &NetConfig, addr: SocketAddr) -> Listener {
    let mut last = None;
    for _ in 0..10_000 {
        match Listener::bind(cfg, addr).await {
            Ok(l) => return l,
            Err(e) => last = Some(e),
        }
        tokio::task::yield_now().await;
    }
    panic!("could not rebind {addr}: {last:?}");
}
