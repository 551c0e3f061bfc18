//! A decode node's RDMA path, in one process: a prefill engine exports each layer as it is
//! computed, a [`KvSender`] writes it one-sided (the in-memory fabric stands in for the device)
//! into the decode node's registered landing pool, the [`LandingSink`] checks it, and
//! [`land_into_engine`] moves it into the decode engine, which then generates. For every golden
//! case of the tiny model the tokens and text are Hugging Face's, as for the stream transports,
//! and afterwards no landing block, lease or engine reservation is left.
#![cfg(feature = "rdma")]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cleave_decode_node::{land_into_engine, LandingSink};
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineRequest, EngineThread, ImportStart, KvExport, KvExportEvent};
use cleave_kernels::cpu::CpuBackend;
use cleave_kv_transfer::rdma::sim::SimFabric;
use cleave_kv_transfer::rdma::{
    DriverConfig, RdmaReceive, RdmaSendConfig, RdmaTransport, SendLinkConfig, SignalPolicy,
};
use cleave_kv_transfer::{KvSender, LayerChunk, MemoryPool, ReceiverConfig, ReceiverService, SendConfig};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Listener, NetConfig, NetKind};
use cleave_protocol::{RequestId, SamplingParams, StopConditions, TransportKind};
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(30);
const LANDING_BLOCKS: usize = 256;

/// The tiny reference model (`testdata/tiny-llama` in the repository: Hugging Face
/// files with transformers' golden outputs).
fn tiny_llama_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tiny-llama")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn spawn_engine() -> EngineThread {
    EngineThread::spawn(|| {
        let files = ModelFiles::open(&tiny_llama_dir())?;
        // Small prefill steps: a prompt goes out in several chunks per layer.
        let cfg = EngineConfig {
            block_size: 4,
            max_num_batched_tokens: 8,
            max_num_seqs: 8,
            kv_cache_memory: 8 << 20,
            ..Default::default()
        };
        EngineCore::load(CpuBackend::default(), files, &cfg)
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_landed_kv_decodes_to_the_golden_tokens() {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_llama_dir().join("golden.json")).unwrap()).unwrap();
    let (ta, tb) = (spawn_engine(), spawn_engine());
    let (a, b) = (ta.handle(), tb.handle());
    let layout = b.info().kv_layout.clone();

    // The decode side: landing pool, its fabric, a receiver over QUIC taking RDMA links.
    let ids_ = NodeIdentity::generate_test_cluster(&["decode", "prefill"]).unwrap();
    let net = |id: &NodeIdentity| NetConfig::new(NetKind::Quic, Some(id.clone()));
    let listener = Listener::bind(&net(&ids_[0]), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let landing = MemoryPool::new(layout.clone(), LANDING_BLOCKS);
    let token_bytes = cleave_kv_transfer::frame::run_bytes(&layout, 1) as u64;
    let slot = 2 * 8 * token_bytes;
    let fabric = SimFabric::over_pool(landing.clone(), &layout, 4 * slot as usize).unwrap();
    let rcfg = ReceiverConfig::new(layout.clone(), listener.local_addr(), TransportKind::Rdma);
    let sink = LandingSink::new(b.clone(), landing.clone());
    let receiver = ReceiverService::spawn_rdma(rcfg, sink, Some(listener), RdmaReceive::new(Arc::new(fabric.clone())));
    let handle = receiver.handle().clone();

    // The prefill side's transport.
    let scfg = RdmaSendConfig {
        link: SendLinkConfig { slots: 4, slot_bytes: slot, sq_depth: 512, policy: SignalPolicy::default() },
        driver: DriverConfig::default(),
        setup_timeout: WAIT,
        write_timeout: WAIT,
    };
    let transport = RdmaTransport::new(&net(&ids_[1]), fabric, scfg).unwrap();

    for (i, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
        let req = EngineRequest {
            id: RequestId(i as u64 + 1),
            prompt: ids(&case["prompt_ids"]),
            params: SamplingParams::default(),
            stop: StopConditions { max_tokens: 32, ignore_eos: true, ..Default::default() },
        };
        let n = req.prompt.len() as u32;
        let res = handle.reserve(req.id, n, None).await.unwrap();
        let sender = timeout(WAIT, KvSender::start(&transport, &res.ticket, &layout, &SendConfig::default()))
            .await
            .unwrap()
            .unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut first = a.submit_prefill_only(req.clone(), KvExport::unbounded(tx)).unwrap();
        let ev = first.next().await.unwrap();
        let mut done = None;
        while let Some(e) = rx.recv().await {
            match e {
                KvExportEvent::Chunk(c) => {
                    let c = LayerChunk {
                        layer: c.layer,
                        token_start: c.token_start,
                        token_count: c.token_count,
                        k: c.k,
                        v: c.v,
                    };
                    timeout(WAIT, sender.send(c)).await.unwrap().unwrap();
                }
                KvExportEvent::Done(d) => done = Some(d),
            }
        }
        let d = done.expect("the export ends with Done");
        let report = timeout(WAIT, sender.finish(d.first_token)).await.unwrap().unwrap();
        assert_eq!(report.transport, TransportKind::Rdma);
        let completed = res.done.wait(WAIT).await.unwrap();
        assert!(landing.free_blocks() < LANDING_BLOCKS, "the KV waits in the landing blocks");
        land_into_engine(&b, &landing, req.id, &completed.blocks, n).unwrap();
        assert_eq!(landing.free_blocks(), LANDING_BLOCKS, "landing blocks freed once copied");
        let start =
            ImportStart { first_token: completed.first_token, sampler_seed: Some(d.sampler_seed), cached_tokens: 0 };
        let mut stream = b.submit_imported(req, start).unwrap();
        let mut got = vec![ev.token_id.unwrap()];
        let mut text = ev.text.clone();
        while let Some(ev) = stream.next().await {
            assert!(ev.error.is_none(), "{ev:?}");
            got.extend(ev.token_id);
            text.push_str(&ev.text);
        }
        assert_eq!(got, ids(&case["generated_ids"]), "case {}", case["name"]);
        assert_eq!(text, case["text_incremental"].as_str().unwrap(), "case {}", case["name"]);
    }
    assert_eq!(handle.stats().await.unwrap().reserved_blocks, 0);
    let snap = b.snapshot().unwrap().await.unwrap();
    assert_eq!((snap.running, snap.import_reservations), (0, 0), "{snap:?}");
    drop(receiver);
    ta.shutdown().unwrap();
    tb.shutdown().unwrap();
}

/// A lease that fails gives back both its landing blocks and its engine reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_rdma_lease_frees_landing_and_engine_blocks() {
    let tb = spawn_engine();
    let b = tb.handle();
    let layout = b.info().kv_layout.clone();
    let ids_ = NodeIdentity::generate_test_cluster(&["decode"]).unwrap();
    let cfg = NetConfig::new(NetKind::Quic, Some(ids_[0].clone()));
    let listener = Listener::bind(&cfg, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let landing = MemoryPool::new(layout.clone(), 8);
    let fabric = SimFabric::over_pool(landing.clone(), &layout, 1 << 16).unwrap();
    let rcfg = ReceiverConfig::new(layout.clone(), listener.local_addr(), TransportKind::Rdma);
    let receiver = ReceiverService::spawn_rdma(
        rcfg,
        LandingSink::new(b.clone(), landing.clone()),
        Some(listener),
        RdmaReceive::new(Arc::new(fabric)),
    );
    let res = receiver.handle().reserve(RequestId(9), 30, None).await.unwrap();
    assert_eq!(landing.free_blocks(), 0);
    assert_eq!(b.snapshot().unwrap().await.unwrap().import_reservations, 1);
    // The engine has room, the landing pool has none: refused up front, and the engine's
    // reservation for it is given back.
    let e = receiver.handle().reserve(RequestId(10), 4, None).await.unwrap_err();
    assert!(matches!(e, cleave_kv_transfer::KvTransferError::OutOfBlocks { need: 1, free: 0 }), "{e}");
    assert!(receiver.handle().cancel(res.done.lease()).await.unwrap());
    assert!(res.done.wait(WAIT).await.is_err());
    assert_eq!(landing.free_blocks(), 8);
    let t0 = std::time::Instant::now();
    while b.snapshot().unwrap().await.unwrap().import_reservations != 0 {
        assert!(t0.elapsed() < WAIT, "the engine reservation was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(receiver);
    tb.shutdown().unwrap();
}
