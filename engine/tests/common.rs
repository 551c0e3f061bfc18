//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Instant;

use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::{RequestId, SamplingParams, StopConditions, TokenEvent};

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
pub fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

pub fn tiny_llama_dir() -> PathBuf {
    testdata_dir().join("tiny-llama")
}

pub fn golden() -> serde_json::Value {
    let text = std::fs::read_to_string(tiny_llama_dir().join("golden.json")).expect("golden.json");
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn engine(dir: &std::path::Path, cfg: EngineConfig) -> EngineCore<CpuBackend> {
    let files = ModelFiles::open(dir).unwrap();
    EngineCore::load(CpuBackend::default(), files, &cfg).unwrap()
}

pub fn greedy_request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt,
        params: SamplingParams::default(),
        stop: StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
    }
}

/// Runs the engine until idle; returns every event grouped by request id, in order.
pub fn run_to_end(core: &mut EngineCore<CpuBackend>) -> std::collections::BTreeMap<u64, Vec<TokenEvent>> {
    let mut out: std::collections::BTreeMap<u64, Vec<TokenEvent>> = Default::default();
    let now = Instant::now();
    let mut steps = 0;
    while core.has_work() {
        for ev in core.step(now).unwrap() {
            out.entry(ev.request_id.0).or_default().push(ev);
        }
        steps += 1;
        assert!(steps < 100_000, "engine does not finish");
    }
    out
}

pub fn token_ids(events: &[TokenEvent]) -> Vec<u32> {
    events.iter().filter_map(|e| e.token_id).collect()
}

pub fn text(events: &[TokenEvent]) -> String {
    events.iter().map(|e| e.text.as_str()).collect()
}
