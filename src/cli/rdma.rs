//! RDMA for the serving processes (feature `rdma`): the prefill side's transport and the decode
//! side's registered landing pool, both on one port of one device opened by name. Queue pairs
//! carry the port's GID at the chosen index in their metadata (RoCE: the only address a port
//! has), and connect to the peer's GID through a global route when it sent one.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cleave_decode_node::RdmaLanding;
use cleave_engine::EngineInfo;
use cleave_kv_transfer::frame::run_bytes;
use cleave_kv_transfer::rdma::verbs::{
    Context as VerbsContext, MemoryRegion, ProtectionDomain, QpConfig, VerbsProvider,
};
use cleave_kv_transfer::rdma::{DriverConfig, PoolLayout, RdmaReceive, RdmaSendConfig, RdmaTransport};
use cleave_kv_transfer::rdma::{SendLinkConfig, SignalPolicy};
use cleave_kv_transfer::{MemoryPool, Transport};
use cleave_net::{NetConfig, NetKind};

/// Staging slots of a sender: chunks of one link in flight at once.
const SLOTS: usize = 4;

/// Where a node's queue pairs live (`--rdma-device`, `--rdma-port`, `--rdma-gid-index`).
pub struct Device<'a> {
    pub name: &'a str,
    pub port: u8,
    /// `None`: the port's default ([`QpConfig::for_port`]).
    pub gid_index: Option<u8>,
}

/// The device's protection domain and the queue-pair settings of its port.
fn domain(dev: &Device<'_>) -> anyhow::Result<(Arc<ProtectionDomain>, QpConfig)> {
    let ctx = VerbsContext::open(Some(dev.name)).with_context(|| format!("opening RDMA device {}", dev.name))?;
    let qp = QpConfig::for_port(&ctx, dev.port, dev.gid_index)
        .with_context(|| format!("port {} of RDMA device {}", dev.port, dev.name))?;
    tracing::info!(device = dev.name, port = qp.port, gid_index = ?qp.gid_index, "rdma queue pairs");
    Ok((ProtectionDomain::new(&ctx)?, qp))
}

fn need_quic(net: &NetConfig) -> anyhow::Result<()> {
    anyhow::ensure!(net.kind == NetKind::Quic, "--rdma-device needs --transport quic (its control streams)");
    Ok(())
}

/// A prefill node's RDMA transport. One write group carries at most `max_tokens` tokens of one
/// layer (longer chunks are split), which sizes the registered staging slots.
pub fn sender(
    device: &Device<'_>,
    net: &NetConfig,
    info: &EngineInfo,
    max_tokens: usize,
) -> anyhow::Result<Arc<dyn Transport>> {
    need_quic(net)?;
    let slot_bytes = 2 * run_bytes(&info.kv_layout, max_tokens as u32) as u64;
    let (pd, qp) = domain(device)?;
    let provider = VerbsProvider {
        pd,
        qp,
        cq_depth: 4096,
        pool: None,
        staging_len: SLOTS * slot_bytes as usize,
        max_write_bytes: 1 << 20,
    };
    let cfg = RdmaSendConfig {
        link: SendLinkConfig { slots: SLOTS, slot_bytes, sq_depth: 1024, policy: SignalPolicy::default() },
        driver: DriverConfig::default(),
        setup_timeout: Duration::from_secs(10),
        write_timeout: Duration::from_secs(10),
    };
    Ok(Arc::new(RdmaTransport::new(net, provider, cfg)?))
}

/// A decode node's landing pool of `blocks` blocks (default: a quarter of the engine's),
/// registered once with the device.
pub fn landing(
    device: &Device<'_>,
    net: &NetConfig,
    info: &EngineInfo,
    blocks: Option<usize>,
) -> anyhow::Result<RdmaLanding> {
    need_quic(net)?;
    let blocks = blocks.unwrap_or((info.kv_blocks_total / 4).max(1));
    let pool = MemoryPool::new(info.kv_layout.clone(), blocks);
    let (pd, qp) = domain(device)?;
    let mr = MemoryRegion::register_pool(&pd, &pool).context("registering the landing pool")?;
    let layout = PoolLayout::block_major(&info.kv_layout, blocks as u32)?;
    let provider = VerbsProvider {
        pd,
        qp,
        cq_depth: 4096,
        pool: Some((Arc::new(mr), layout)),
        staging_len: 0,
        max_write_bytes: 1 << 20,
    };
    Ok(RdmaLanding { pool, receive: RdmaReceive::new(Arc::new(provider)) })
}
