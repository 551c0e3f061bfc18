//! RDMA for the serving processes (feature `rdma`): the prefill side's transport and the decode
//! side's registered landing pool, both on one device opened by name.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cleave_decode_node::RdmaLanding;
use cleave_engine::EngineInfo;
use cleave_kv_transfer::frame::run_bytes;
use cleave_kv_transfer::rdma::verbs::{Context as Device, MemoryRegion, ProtectionDomain, QpConfig, VerbsProvider};
use cleave_kv_transfer::rdma::{DriverConfig, PoolLayout, RdmaReceive, RdmaSendConfig, RdmaTransport};
use cleave_kv_transfer::rdma::{SendLinkConfig, SignalPolicy};
use cleave_kv_transfer::{MemoryPool, Transport};
use cleave_net::{NetConfig, NetKind};

/// Staging slots of a sender: chunks of one link in flight at once.
const SLOTS: usize = 4;

fn domain(device: &str) -> anyhow::Result<Arc<ProtectionDomain>> {
    let ctx = Device::open(Some(device)).with_context(|| format!("opening RDMA device {device}"))?;
    Ok(ProtectionDomain::new(&ctx)?)
}

fn need_quic(net: &NetConfig) -> anyhow::Result<()> {
    anyhow::ensure!(net.kind == NetKind::Quic, "--rdma-device needs --transport quic (its control streams)");
    Ok(())
}

/// A prefill node's RDMA transport. One write group carries at most `max_tokens` tokens of one
/// layer (longer chunks are split), which sizes the registered staging slots.
pub fn sender(
    device: &str,
    net: &NetConfig,
    info: &EngineInfo,
    max_tokens: usize,
) -> anyhow::Result<Arc<dyn Transport>> {
    need_quic(net)?;
    let slot_bytes = 2 * run_bytes(&info.kv_layout, max_tokens as u32) as u64;
    let provider = VerbsProvider {
        pd: domain(device)?,
        qp: QpConfig::default(),
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
pub fn landing(device: &str, net: &NetConfig, info: &EngineInfo, blocks: Option<usize>) -> anyhow::Result<RdmaLanding> {
    need_quic(net)?;
    let blocks = blocks.unwrap_or((info.kv_blocks_total / 4).max(1));
    let pool = MemoryPool::new(info.kv_layout.clone(), blocks);
    let pd = domain(device)?;
    let mr = MemoryRegion::register_pool(&pd, &pool).context("registering the landing pool")?;
    let layout = PoolLayout::block_major(&info.kv_layout, blocks as u32)?;
    let provider = VerbsProvider {
        pd,
        qp: QpConfig::default(),
        cq_depth: 4096,
        pool: Some((Arc::new(mr), layout)),
        staging_len: 0,
        max_write_bytes: 1 << 20,
    };
    Ok(RdmaLanding { pool, receive: RdmaReceive::new(Arc::new(provider)) })
}
