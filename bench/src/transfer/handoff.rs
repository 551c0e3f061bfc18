//! Handoff rows of `cleave bench transfer`: real handoffs (reserve, [`KvSender`] pushing layer
//! chunks as a chunked prefill would, `finish`, the receiver's `Ack`) into a [`MemoryPool`], over
//! each transport and in-process. Latency is per request, from `reserve` to the lease waiter's
//! `Completed`; throughput is payload bytes over that latency. Chunks are built before the clock
//! starts (slices of one payload, no copies), so the number is the transfer layer's alone.
//!
//! With the `rdma` feature one more row runs the RDMA handoff over [`cleave_kv_transfer::rdma::sim`]'s
//! in-memory fabric: what it measures is this side of the NIC (staging copy, CRC on both ends,
//! completion handling, control stream), since a device's DMA replaces the fabric's copy.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_protocol::{KvDtype, KvLayout, RequestId, TransportKind};

use crate::transfer::{Measurement, TransferBenchConfig};
use cleave_kv_transfer::frame::run_bytes;
use cleave_kv_transfer::{
    KvSender, KvTransferError, LayerChunk, MemoryPool, NetTransport, ReceiverConfig, ReceiverService,
};
use cleave_kv_transfer::{SendConfig, Transport};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Listener, NetConfig, NetKind};

use crate::{BenchError, Result};

/// Tokens per prefill chunk: each layer of each chunk goes out as one [`LayerChunk`].
pub const PREFILL_STEP: u32 = 512;
/// Tokens per KV block of the benchmark pool.
const BLOCK_SIZE: u32 = 16;

pub(crate) fn layout(cfg: &TransferBenchConfig) -> Result<KvLayout> {
    let dtype = match cfg.dtype_bytes {
        2 => KvDtype::Bf16,
        4 => KvDtype::F32,
        n => return Err(BenchError::InvalidArg(format!("handoff rows need 2- or 4-byte elements, not {n}"))),
    };
    Ok(KvLayout {
        model_fingerprint: 0xBE4C_0000,
        dtype,
        num_layers: cfg.layers as u32,
        num_kv_heads: cfg.kv_heads as u32,
        head_dim: cfg.head_dim as u32,
        block_size: BLOCK_SIZE,
    })
}

fn net_kind(kind: TransportKind) -> Option<NetKind> {
    match kind {
        TransportKind::Quic => Some(NetKind::Quic),
        TransportKind::TcpTls => Some(NetKind::TcpTls),
        TransportKind::TcpPlain => Some(NetKind::TcpPlain),
        _ => None,
    }
}

/// The chunks of a `tokens`-token prefill, every layer of every prefill step, as slices of
/// `payload` (which holds at least one layer's K+V of the longest chunk).
fn chunks(layout: &KvLayout, tokens: u32, payload: &Bytes) -> Vec<LayerChunk> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < tokens {
        let n = PREFILL_STEP.min(tokens - start);
        let len = run_bytes(layout, n);
        for layer in 0..layout.num_layers {
            out.push(LayerChunk {
                layer,
                token_start: start,
                token_count: n,
                k: payload.slice(0..len),
                v: payload.slice(len..2 * len),
            });
        }
        start += n;
    }
    out
}

/// Measures `repeats` handoffs of `tokens` tokens over `kind` with `streams` streams.
pub(crate) async fn measure(
    cfg: &TransferBenchConfig,
    rx: &tokio::runtime::Handle,
    kind: TransportKind,
    streams: usize,
    tokens: usize,
    ids: &[NodeIdentity],
) -> Result<Measurement> {
    let layout = layout(cfg)?;
    let tokens = tokens as u32;
    let blocks = tokens.div_ceil(BLOCK_SIZE) as usize;
    let pool = MemoryPool::new(layout.clone(), blocks);
    let mut rcfg = ReceiverConfig::new(layout.clone(), "127.0.0.1:1".parse().expect("literal"), kind);
    rcfg.stream_idle_timeout = Duration::from_secs(60);
    // The receiver (its actor, listener and stream tasks) lives on the receiving side's runtime.
    let (receiver, transport): (ReceiverService, Arc<dyn Transport>) = match net_kind(kind) {
        None if kind == TransportKind::InProcess => {
            let pool = pool.clone();
            let receiver = crate::transfer::on(rx, async move { ReceiverService::spawn(rcfg, pool, None) }).await?;
            let t = Arc::new(receiver.handle().in_process());
            (receiver, t)
        }
        #[cfg(feature = "rdma")]
        None if kind == TransportKind::Rdma => {
            // The payload lands in `pool` through the in-memory fabric (no device here); the
            // control streams are real QUIC.
            use cleave_kv_transfer::rdma::{sim::SimFabric, DriverConfig, RdmaReceive, RdmaSendConfig, RdmaTransport};
            use cleave_kv_transfer::rdma::{SendLinkConfig, SignalPolicy};
            let slot = 2 * run_bytes(&layout, PREFILL_STEP.min(tokens)) as u64;
            let fabric = SimFabric::over_pool(pool.clone(), &layout, 4 * slot as usize)?;
            let net = |id: &NodeIdentity| NetConfig::new(NetKind::Quic, Some(id.clone()));
            let local: SocketAddr = "127.0.0.1:0".parse().expect("literal");
            let (rnet, pool, rf) = (net(&ids[0]), pool.clone(), fabric.clone());
            let receiver = crate::transfer::on(rx, async move {
                let listener = Listener::bind(&rnet, local).await?;
                rcfg.advertise_addr = listener.local_addr();
                let rdma = RdmaReceive::new(Arc::new(rf));
                Ok::<_, KvTransferError>(ReceiverService::spawn_rdma(rcfg, pool, Some(listener), rdma))
            })
            .await??;
            let scfg = RdmaSendConfig {
                link: SendLinkConfig { slots: 4, slot_bytes: slot, sq_depth: 1024, policy: SignalPolicy::default() },
                driver: DriverConfig::default(),
                setup_timeout: Duration::from_secs(10),
                write_timeout: Duration::from_secs(10),
            };
            (receiver, Arc::new(RdmaTransport::new(&net(&ids[1]), fabric, scfg)?))
        }
        Some(nk) => {
            let net = |id: &NodeIdentity| NetConfig {
                kind: nk,
                identity: (nk != NetKind::TcpPlain).then(|| id.clone()),
                connect_timeout: Duration::from_secs(10),
            };
            let local: SocketAddr = "127.0.0.1:0".parse().expect("literal");
            let (rnet, pool) = (net(&ids[0]), pool.clone());
            let receiver = crate::transfer::on(rx, async move {
                let listener = Listener::bind(&rnet, local).await?;
                rcfg.advertise_addr = listener.local_addr();
                Ok::<_, KvTransferError>(ReceiverService::spawn(rcfg, pool, Some(listener)))
            })
            .await??;
            (receiver, Arc::new(NetTransport::new(&net(&ids[1]))?))
        }
        None => return Err(BenchError::InvalidArg(format!("no handoff rows over {kind:?} in this build"))),
    };
    let payload = crate::transfer::payload(2 * run_bytes(&layout, PREFILL_STEP.min(tokens)));
    let scfg = SendConfig { streams, ..SendConfig::default() };
    let mut times = Vec::new();
    let mut bytes = 0;
    let mut cpu0 = 0.0;
    for i in 0..=cfg.repeats {
        if i == 1 {
            cpu0 = crate::transfer::process_cpu_s();
        }
        let todo = chunks(&layout, tokens, &payload);
        let t = Instant::now();
        let res = receiver.handle().reserve(RequestId(i as u64), tokens, None).await?;
        let sender = KvSender::start(transport.as_ref(), &res.ticket, &layout, &scfg).await?;
        for c in todo {
            sender.send(c).await?;
        }
        let report = sender.finish(1).await?;
        let done = res.done.wait(Duration::from_secs(60)).await?;
        let elapsed = t.elapsed().as_secs_f64();
        pool.free_request(&done.blocks);
        bytes = report.bytes;
        if i > 0 {
            times.push(elapsed);
        }
    }
    let label = match net_kind(kind) {
        Some(nk) => format!("handoff {} x{streams}", nk.name()),
        None if kind == TransportKind::Rdma => "handoff rdma-sim x1".to_string(),
        None => format!("handoff in-process x{streams}"),
    };
    let m = Measurement::from_times(label, tokens as usize, bytes, times).with_cpu(cpu0, cfg.repeats);
    receiver.shutdown(Duration::from_secs(5)).await;
    Ok(m)
}
