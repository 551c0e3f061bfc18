//! A handoff reservation against a decode engine whose KV cache is full: it waits for blocks to
//! free (streams finishing) instead of failing the request, and one that the cache could never
//! hold is refused at once. The coordinator routes a handoff only to a node that reported room,
//! but reports are 200 ms apart: this is what keeps the gap between them from failing requests.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_decode_node::{EngineSink, RESERVE_WAIT};
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineThread};
use cleave_kernels::cpu::CpuBackend;
use cleave_kv_transfer::{Ask, KvSink};
use cleave_protocol::RequestId;

fn tiny_llama_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tiny-llama")
}

fn ask(id: u64, tokens: u32, first: u32) -> Ask {
    let prompt: Arc<[u32]> = (first..first + tokens).collect();
    Ask {
        request_id: RequestId(id),
        num_tokens: tokens,
        num_blocks: tokens.div_ceil(16) as usize,
        prompt: Some(prompt),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_waits_for_room_and_one_that_cannot_fit_is_refused_at_once() {
    let engine = EngineThread::spawn(|| {
        let files = ModelFiles::open(&tiny_llama_dir())?;
        // 4 blocks of 16 tokens (8 KiB each for tiny-llama's f32 K/V).
        let cfg = EngineConfig { kv_cache_memory: 32 << 10, ..Default::default() };
        EngineCore::load(CpuBackend::new(Some(1))?, files, &cfg)
    })
    .unwrap();
    assert_eq!(engine.handle().info().kv_blocks_total, 4);
    let mut sink = EngineSink::new(engine.handle());
    let first = sink.reserve(ask(1, 48, 100)).wait().await.unwrap();
    assert_eq!(first.blocks.len(), 3);
    // Two more blocks are needed where one is free: the reservation waits.
    let waiting = tokio::spawn(sink.reserve(ask(2, 32, 500)).wait());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "answered while the cache was full");
    sink.release(RequestId(1), &first.blocks);
    let second = tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap().unwrap();
    assert_eq!(second.blocks.len(), 2);
    // Five blocks exceed the whole cache: no wait.
    let t = Instant::now();
    let err = sink.reserve(ask(3, 80, 900)).wait().await.unwrap_err();
    assert!(t.elapsed() < RESERVE_WAIT / 4, "waited {:?}", t.elapsed());
    assert!(err.to_string().contains("cannot reserve KV"), "{err}");
    sink.release(RequestId(2), &second.blocks);
}
