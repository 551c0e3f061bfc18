//! The engine loop on its own thread, driven from async code: concurrent streams, cancellation
//! by dropping a stream, errors for bad requests, and no leaked blocks afterwards.

mod common;

use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineThread};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::FinishReason;
use common::*;

fn spawn() -> EngineThread {
    EngineThread::spawn(|| {
        let files = ModelFiles::open(&tiny_llama_dir())?;
        EngineCore::load(
            CpuBackend::default(),
            files,
            &EngineConfig { kv_cache_memory: 16 << 20, ..Default::default() },
        )
    })
    .unwrap()
}

/// A node's handler builds the constraint compiler off the engine thread before its first
/// constrained request; the request then runs on it.
#[tokio::test(flavor = "current_thread")]
async fn prepare_constraints_builds_the_compiler_before_the_request() {
    let engine = spawn();
    let handle = engine.handle();
    assert!(!handle.constraints_built(), "built at load");
    handle.prepare_constraints().await;
    assert!(handle.constraints_built());
    handle.prepare_constraints().await; // built: returns at once
    let mut req = greedy_request(7, vec![1, 450, 4996], 8);
    req.params.constraint = Some(cleave_protocol::Constraint::JsonObject);
    let mut stream = handle.submit(req).unwrap();
    let mut tokens = 0;
    while let Some(ev) = stream.next().await {
        assert!(ev.error.is_none(), "{ev:?}");
        tokens += usize::from(ev.token_id.is_some());
    }
    assert!(tokens > 0);
    engine.shutdown().unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_streams_match_golden_and_drop_cancels() {
    let engine = spawn();
    let handle = engine.handle();
    let cases = golden()["cases"].as_array().unwrap().clone();
    let mut streams: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| handle.submit(greedy_request(i as u64, ids(&c["prompt_ids"]), 32)).unwrap())
        .collect();
    // A long request we abandon after two tokens: dropping the stream cancels it.
    let mut doomed = handle.submit(greedy_request(100, ids(&cases[0]["prompt_ids"]), 1000)).unwrap();
    assert!(doomed.next().await.unwrap().token_id.is_some());
    assert!(doomed.next().await.unwrap().token_id.is_some());
    drop(doomed);
    for (case, stream) in cases.iter().zip(streams.iter_mut()) {
        let mut events = Vec::new();
        while let Some(ev) = stream.next().await {
            events.push(ev);
        }
        assert_eq!(token_ids(&events), ids(&case["generated_ids"]), "case {}", case["name"]);
        assert_eq!(text(&events), case["text_incremental"].as_str().unwrap());
        assert_eq!(events.last().unwrap().finish_reason, Some(FinishReason::Length));
    }
    // The cancel is processed between steps; poll the snapshot until the engine is idle.
    let mut snap = handle.snapshot().unwrap().await.unwrap();
    for _ in 0..1000 {
        if snap.running == 0 && snap.waiting == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        snap = handle.snapshot().unwrap().await.unwrap();
    }
    assert_eq!((snap.running, snap.waiting, snap.kv_blocks_in_use), (0, 0, 0), "{snap:?}");
    assert!(snap.kv_blocks_cached > 0, "finished prompts stay in the prefix cache");
    engine.shutdown().unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn bad_requests_get_an_error_event() {
    let engine = spawn();
    let handle = engine.handle();
    // Token id outside the vocabulary.
    let mut s = handle.submit(greedy_request(1, vec![1, 999_999], 4)).unwrap();
    let ev = s.next().await.unwrap();
    assert_eq!(ev.finish_reason, Some(FinishReason::Error));
    assert!(ev.error.unwrap().contains("999999"));
    // Longer than the context.
    let mut s = handle.submit(greedy_request(2, vec![1; 10], 100_000)).unwrap();
    let ev = s.next().await.unwrap();
    assert_eq!(ev.finish_reason, Some(FinishReason::Error));
    assert!(ev.error.unwrap().contains("max_model_len"));
    // The engine still serves.
    let mut s = handle.submit(greedy_request(3, vec![1, 2, 3], 3)).unwrap();
    let mut n = 0;
    while let Some(ev) = s.next().await {
        n += ev.token_id.is_some() as usize;
    }
    assert_eq!(n, 3);
}

#[test]
fn a_failing_model_load_is_reported_not_hung() {
    let err = EngineThread::spawn(|| {
        let files = ModelFiles::open(std::path::Path::new("/nonexistent"))?;
        EngineCore::load(CpuBackend::default(), files, &EngineConfig::default())
    })
    .err()
    .expect("load must fail");
    assert!(err.to_string().contains("/nonexistent"), "{err}");
}
