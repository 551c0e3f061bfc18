//! RDMA tests that need a device: open it, register memory, write a chunk through a loopback
//! pair of queue pairs and compare with the reference. On a machine where
//! `ibv_get_device_list` finds no device they print why and return (skipped, not failed); the
//! tests that check error paths run everywhere.
#![cfg(feature = "rdma")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_kv_transfer::rdma::verbs::*;
use cleave_kv_transfer::rdma::*;
use cleave_kv_transfer::KvTransferError;
use cleave_protocol::{KvDtype, KvLayout};

/// The first device, or `None` after printing why the calling test is skipped.
fn device_or_skip(test: &str) -> Option<Arc<Context>> {
    let names = device_names().expect("ibv_get_device_list");
    if names.is_empty() {
        // Straight to stderr, past libtest's capture, so the skip shows in every run.
        let msg = format!("SKIPPED {test}: no RDMA device (ibv_get_device_list returned 0 devices)\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), msg.as_bytes());
        return None;
    }
    Some(Context::open(None).expect("open the first RDMA device"))
}

/// What the serving CLI picks without `--rdma-gid-index`: LID routing on InfiniBand; on RoCE
/// the port's RoCE v2 GID (the queue pairs then connect through a global route to it).
fn qp_config(ctx: &Context) -> QpConfig {
    let cfg = QpConfig::for_port(ctx, 1, None).expect("port 1 and its default GID index");
    let port = ctx.port(cfg.port).expect("ibv_query_port");
    println!("port 1: ethernet {}, lid {}, gid index {:?}", port.ethernet, port.lid, cfg.gid_index);
    assert!(!port.ethernet || cfg.gid_index.is_some(), "a RoCE port needs a GID");
    cfg
}

#[test]
fn device_list_answers_on_every_machine() {
    let names = device_names().unwrap();
    println!("rdma devices: {names:?}");
}

#[test]
fn opening_a_missing_device_is_a_clear_error() {
    let e = Context::open(Some("cleave-no-such-device")).err().expect("no device has that name");
    match &e {
        KvTransferError::RdmaNoDevice { wanted, .. } => assert_eq!(wanted, "cleave-no-such-device"),
        other => panic!("unexpected error {other}"),
    }
    println!("{e}");
}

#[test]
fn open_device_and_register_the_pool() {
    let Some(ctx) = device_or_skip("open_device_and_register_the_pool") else { return };
    let port = ctx.port(1).unwrap();
    println!("device {} port 1: {port:?}", ctx.name());
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let pool = OwnedRegion::new(&pd, 1 << 20, Access::RemoteWrite).unwrap();
    assert_eq!(pool.region().len(), 1 << 20);
    assert_eq!(pool.region().addr(), pool.bytes().as_ptr() as u64);
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let qp = QueuePair::new_rc(&pd, &cq, &cq, qp_config(&ctx)).unwrap();
    let layout = PoolLayout {
        num_layers: 1,
        num_blocks: 1,
        block_size: 1,
        token_bytes: 1 << 19,
        block_stride: 0,
        half_stride: 1 << 19,
        layer_stride: 0,
    };
    let region = RemoteRegion { addr: pool.region().addr(), len: 1 << 20, rkey: pool.region().rkey(), layout };
    let meta = qp.local_metadata(42, port.max_msg_sz.max(1), Some(region)).unwrap();
    assert_eq!(QpMetadata::decode(&meta.encode().unwrap()).unwrap(), meta);
    // Drop order does not matter: every object holds what it was made from.
    drop(pd);
    drop(cq);
    drop(ctx);
    drop(pool);
    drop(qp);
}

#[test]
fn loopback_write_with_immediate_lands_in_the_leased_blocks() {
    let Some(ctx) = device_or_skip("loopback_write_with_immediate_lands_in_the_leased_blocks") else { return };
    let cfg = qp_config(&ctx);
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let kv = KvLayout {
        model_fingerprint: 0,
        dtype: KvDtype::Bf16,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 4,
    };
    let layout = PoolLayout::dense(&kv, 16).unwrap();
    let pool = OwnedRegion::new(&pd, layout.extent().unwrap() as usize, Access::RemoteWrite).unwrap();
    let tokens = 0..10u32;
    let mut staging = OwnedRegion::new(&pd, source_len(10, layout.token_bytes) as usize, Access::LocalOnly).unwrap();
    for (i, b) in staging.bytes_mut().iter_mut().enumerate() {
        *b = (i * 7 + 1) as u8;
    }

    let send_cq = CompletionQueue::new(&ctx, 256).unwrap();
    let recv_cq = CompletionQueue::new(&ctx, 256).unwrap();
    let sender = QueuePair::new_rc(&pd, &send_cq, &send_cq, cfg).unwrap();
    let receiver = QueuePair::new_rc(&pd, &recv_cq, &recv_cq, cfg).unwrap();
    let region =
        RemoteRegion { addr: pool.region().addr(), len: pool.region().len(), rkey: pool.region().rkey(), layout };
    // The metadata goes through the wire format, as over the control stream.
    let s_meta = QpMetadata::decode(&sender.local_metadata(100, 1 << 30, None).unwrap().encode().unwrap()).unwrap();
    let r_meta =
        QpMetadata::decode(&receiver.local_metadata(200, 1 << 30, Some(region)).unwrap().encode().unwrap()).unwrap();
    receiver.connect(200, &s_meta).unwrap();
    sender.connect(100, &r_meta).unwrap();

    let deadline = Instant::now() + Duration::from_secs(10);
    let mut rt = RecvTracker::new();
    rt.open(1, 2, deadline).unwrap();
    receiver.post_recvs(&[1, 2]).unwrap();
    let mut st = SendTracker::new(cfg.max_send_wr);
    st.open(1, deadline).unwrap();
    let blocks = [5u32, 6, 2];
    let remote = r_meta.region.unwrap();
    for layer in 0..2 {
        let chunk = ChunkWrite { blocks: &blocks, layer, tokens: tokens.clone(), tag: 1, chunk: 0 };
        let writes = plan_chunk(&remote, &chunk, r_meta.max_write_bytes, SignalPolicy::default()).unwrap();
        let ids = st.post(1, &writes).unwrap();
        sender.post_writes(staging.region(), 0, remote.rkey, &writes, &ids).unwrap();
    }
    assert_eq!(st.finish(1).unwrap(), None);
    assert_eq!(rt.set_chunks(1, 1).unwrap(), None);

    let (mut sent, mut received) = (None, None);
    let mut wcs = Vec::new();
    while sent.is_none() || received.is_none() {
        assert!(Instant::now() < deadline, "no completion within 10 s (sent {sent:?}, received {received:?})");
        wcs.clear();
        send_cq.poll(16, &mut wcs).unwrap();
        for wc in wcs.drain(..) {
            sent = st.on_completion(wc.to_send()).unwrap().pop().or(sent);
        }
        recv_cq.poll(16, &mut wcs).unwrap();
        for wc in wcs.drain(..) {
            received = rt.on_recv(wc.to_recv()).unwrap().pop().or(received);
        }
        std::thread::yield_now();
    }
    assert_eq!(sent.unwrap().outcome, Outcome::Done);
    assert_eq!(received.unwrap().outcome, Outcome::Done);

    // Every byte where the reference copy puts it.
    let n = 10usize;
    let tb = layout.token_bytes as usize;
    for layer in 0..2u32 {
        for (h, half) in Half::BOTH.into_iter().enumerate() {
            for p in 0..n as u32 {
                let off = layout.offset(layer, half, blocks[(p / 4) as usize], p % 4).unwrap() as usize;
                let src = h * n * tb + p as usize * tb;
                assert_eq!(
                    &pool.bytes()[off..off + tb],
                    &staging.bytes()[src..src + tb],
                    "layer {layer} {half:?} token {p}"
                );
            }
        }
    }
}
