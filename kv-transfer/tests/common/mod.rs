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

/// The transports every end-to-end and fault test runs over (the stream payload path).
pub const KINDS: [TransportKind; 4] =
    [TransportKind::InProcess, TransportKind::TcpPlain, TransportKind::TcpTls, TransportKind::Quic];

/// Every payload path: the stream transports, and with the `rdma` feature the RDMA path (over
/// the in-memory fabric, control streams over QUIC).
pub fn all_kinds() -> Vec<TransportKind> {
    let mut kinds = KINDS.to_vec();
    if cfg!(feature = "rdma") {
        kinds.push(TransportKind::Rdma);
    }
    kinds
}

fn net_kind(kind: TransportKind) -> NetKind {
    match kind {
        TransportKind::Quic | TransportKind::Rdma => NetKind::Quic,
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
    /// Over RDMA: the fabric standing in for the device, and the sender's transport.
    #[cfg(feature = "rdma")]
    pub rdma: Option<RdmaSide>,
}

/// The RDMA side of a [`Pair`].
#[cfg(feature = "rdma")]
pub struct RdmaSide {
    pub fabric: cleave_kv_transfer::rdma::sim::SimFabric,
    pub transport: Arc<cleave_kv_transfer::rdma::RdmaTransport<cleave_kv_transfer::rdma::sim::SimFabric>>,
}

/// How long a released RDMA lease waits for the sender's `Drained` before the receiver resets
/// the queue pair (short: a raw test sender never drains).
#[cfg(feature = "rdma")]
pub const QUARANTINE: Duration = Duration::from_millis(300);

#[cfg(feature = "rdma")]
fn rdma_receive(fabric: &cleave_kv_transfer::rdma::sim::SimFabric) -> cleave_kv_transfer::rdma::RdmaReceive {
    let mut r = cleave_kv_transfer::rdma::RdmaReceive::new(Arc::new(fabric.clone()));
    r.link.quarantine = QUARANTINE;
    r
}

/// Four staging slots of 32 tokens' K and V each.
#[cfg(feature = "rdma")]
fn rdma_send_cfg() -> cleave_kv_transfer::rdma::RdmaSendConfig {
    use cleave_kv_transfer::rdma::{DriverConfig, RdmaSendConfig, SendLinkConfig, SignalPolicy};
    let slot_bytes = 2 * run_bytes(&layout(), 32) as u64;
    RdmaSendConfig {
        link: SendLinkConfig { slots: 4, slot_bytes, sq_depth: 256, policy: SignalPolicy::default() },
        driver: DriverConfig::default(),
        setup_timeout: WAIT,
        write_timeout: WAIT,
    }
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
            return Pair {
                kind,
                receiver,
                pool,
                transport,
                addr,
                receiver_net: None,
                #[cfg(feature = "rdma")]
                rdma: None,
            };
        }
        let ids = NodeIdentity::generate_test_cluster(&["decode-0", "prefill-0"]).unwrap();
        let nk = net_kind(kind);
        let (rid, sid) =
            if nk == NetKind::TcpPlain { (None, None) } else { (Some(ids[0].clone()), Some(ids[1].clone())) };
        let mut rnet = NetConfig::new(nk, rid);
        rnet.connect_timeout = Duration::from_secs(5);
        let listener = Listener::bind(&rnet, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr();
        let mut snet = NetConfig::new(nk, sid);
        snet.connect_timeout = Duration::from_secs(5);
        #[cfg(feature = "rdma")]
        if kind == TransportKind::Rdma {
            use cleave_kv_transfer::rdma::{sim::SimFabric, RdmaTransport};
            let fabric = SimFabric::over_pool(pool.clone(), &layout(), 4 * 2 * run_bytes(&layout(), 32)).unwrap();
            let cfg = receiver_cfg(kind, addr, &opts);
            let receiver = ReceiverService::spawn_rdma(cfg, pool.clone(), Some(listener), rdma_receive(&fabric));
            let rdma = Arc::new(RdmaTransport::new(&snet, fabric.clone(), rdma_send_cfg()).unwrap());
            let transport: Arc<dyn Transport> = rdma.clone();
            let side = RdmaSide { fabric, transport: rdma };
            return Pair { kind, receiver, pool, transport, addr, receiver_net: Some(rnet), rdma: Some(side) };
        }
        let receiver = ReceiverService::spawn(receiver_cfg(kind, addr, &opts), pool.clone(), Some(listener));
        let transport = Arc::new(NetTransport::new(&snet).unwrap());
        Pair {
            kind,
            receiver,
            pool,
            transport,
            addr,
            receiver_net: Some(rnet),
            #[cfg(feature = "rdma")]
            rdma: None,
        }
    }

    /// A receiver over `self.pool` listening on `listener` (over RDMA: its pool exposed on the
    /// same fabric, so the sender's transport reaches it).
    fn spawn_receiver(&mut self, opts: &PairOptions, listener: Listener) -> ReceiverService {
        let cfg = receiver_cfg(self.kind, self.addr, opts);
        #[cfg(feature = "rdma")]
        if let Some(side) = &mut self.rdma {
            side.fabric = side.fabric.with_pool(self.pool.clone()).unwrap();
            return ReceiverService::spawn_rdma(cfg, self.pool.clone(), Some(listener), rdma_receive(&side.fabric));
        }
        ReceiverService::spawn(cfg, self.pool.clone(), Some(listener))
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
        match self.receiver_net.clone() {
            None => {
                self.receiver =
                    ReceiverService::spawn(receiver_cfg(self.kind, self.addr, &opts), self.pool.clone(), None);
                self.transport = Arc::new(self.receiver.handle().in_process());
            }
            Some(rnet) => {
                let listener = bounded("rebind", rebind(&rnet, self.addr)).await;
                self.receiver = self.spawn_receiver(&opts, listener);
            }
        }
    }

    /// Both sides hold nothing: no live lease, every block back in the pool. Over RDMA a failed
    /// lease's blocks come back once no write can land (the sender's `Drained`, or a queue-pair
    /// reset after [`QUARANTINE`]), which no event here announces: polled, bounded.
    pub async fn assert_nothing_leased(&self) {
        if self.kind == TransportKind::Rdma {
            let t0 = std::time::Instant::now();
            while t0.elapsed() < WAIT {
                let st = bounded("stats", self.receiver.handle().stats()).await.unwrap();
                if st.reserved_blocks == 0 && self.pool.free_blocks() == self.pool.total_blocks() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
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

/// A receiver over `sink` (any pool, not only a [`MemoryPool`]) on a stream transport of
/// `kind`, and a sender-side transport to it.
pub async fn spawn_receiver_with<S: cleave_kv_transfer::KvSink>(
    kind: TransportKind,
    sink: S,
) -> (ReceiverService, Arc<dyn Transport>) {
    let opts = PairOptions::default();
    if kind == TransportKind::InProcess {
        let receiver = ReceiverService::spawn(receiver_cfg(kind, "127.0.0.1:1".parse().unwrap(), &opts), sink, None);
        let transport: Arc<dyn Transport> = Arc::new(receiver.handle().in_process());
        return (receiver, transport);
    }
    let ids = NodeIdentity::generate_test_cluster(&["decode-0", "prefill-0"]).unwrap();
    let nk = net_kind(kind);
    let (rid, sid) = if nk == NetKind::TcpPlain { (None, None) } else { (Some(ids[0].clone()), Some(ids[1].clone())) };
    let listener = Listener::bind(&NetConfig::new(nk, rid), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr();
    let receiver = ReceiverService::spawn(receiver_cfg(kind, addr, &opts), sink, Some(listener));
    (receiver, Arc::new(NetTransport::new(&NetConfig::new(nk, sid)).unwrap()))
}
