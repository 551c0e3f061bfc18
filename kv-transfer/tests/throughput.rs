//! A quick loopback throughput probe of the handoff path (ignored by default; the real numbers
//! come from `cleave bench transfer`). `cargo test -p cleave-kv-transfer --release --test
//! throughput -- --ignored --nocapture`.

mod common;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use cleave_kv_transfer::{
    KvSender, LayerChunk, MemoryPool, NetTransport, ReceiverConfig, ReceiverService, SendConfig, Transport,
};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Listener, NetConfig, NetKind};
use cleave_protocol::{KvDtype, KvLayout, RequestId, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn loopback_throughput_llama8b_shape_2048_tokens() {
    // Llama-3-8B KV shape in f32 halves the token count for the same bytes; keep bf16 sizes.
    let layout = KvLayout {
        model_fingerprint: 1,
        dtype: KvDtype::Bf16,
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
    };
    let tokens = 2048u32;
    let step = 512u32;
    let per_run = cleave_kv_transfer::frame::run_bytes(&layout, step);
    let k = Bytes::from(vec![1u8; per_run]);
    let v = Bytes::from(vec![2u8; per_run]);
    let ids = NodeIdentity::generate_test_cluster(&["d", "p"]).unwrap();
    for kind in [TransportKind::InProcess, TransportKind::TcpPlain, TransportKind::TcpTls, TransportKind::Quic] {
        let pool = MemoryPool::new(layout.clone(), 200);
        let (svc, transport): (ReceiverService, Arc<dyn Transport>) = if kind == TransportKind::InProcess {
            let cfg = ReceiverConfig::new(layout.clone(), "127.0.0.1:1".parse().unwrap(), kind);
            let svc = ReceiverService::spawn(cfg, pool.clone(), None);
            let t = Arc::new(svc.handle().in_process());
            (svc, t)
        } else {
            let nk = match kind {
                TransportKind::Quic => NetKind::Quic,
                TransportKind::TcpTls => NetKind::TcpTls,
                _ => NetKind::TcpPlain,
            };
            let (a, b) =
                if nk == NetKind::TcpPlain { (None, None) } else { (Some(ids[0].clone()), Some(ids[1].clone())) };
            let l = Listener::bind(&NetConfig::new(nk, a), "127.0.0.1:0".parse().unwrap()).await.unwrap();
            let cfg = ReceiverConfig::new(layout.clone(), l.local_addr(), kind);
            let svc = ReceiverService::spawn(cfg, pool.clone(), Some(l));
            (svc, Arc::new(NetTransport::new(&NetConfig::new(nk, b)).unwrap()))
        };
        for streams in [1, 4] {
            for _ in 0..2 {
                let res = svc.handle().reserve(RequestId(1), tokens, None).await.unwrap();
                let t0 = Instant::now();
                let s = KvSender::start(
                    transport.as_ref(),
                    &res.ticket,
                    &layout,
                    &SendConfig { streams, ..Default::default() },
                )
                .await
                .unwrap();
                for start in (0..tokens).step_by(step as usize) {
                    for layer in 0..layout.num_layers {
                        s.send(LayerChunk { layer, token_start: start, token_count: step, k: k.clone(), v: v.clone() })
                            .await
                            .unwrap();
                    }
                }
                let rep = s.finish(1).await.unwrap();
                let done = res.done.wait(common::WAIT).await.unwrap();
                let dt = t0.elapsed();
                pool.free_request(&done.blocks);
                eprintln!(
                    "{kind:?} streams={streams}: {} MiB in {:?} = {:.2} GB/s",
                    rep.bytes >> 20,
                    dt,
                    rep.bytes as f64 / dt.as_secs_f64() / 1e9
                );
            }
        }
    }
}
