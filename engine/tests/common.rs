//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use cleave_engine::model::{ForwardBatch, KvSpec, KvStorage, Model, ModelFiles};
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
use cleave_kernels::AttnSeq;
use cleave_protocol::{KvDtype, RequestId, SamplingParams, StopConditions, TokenEvent};

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

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF at `$CLEAVE_SMOLLM2_GGUF` or in the usual places (as in `gguf_smollm2.rs`);
/// `None` with a message when absent, a panic when CLEAVE_REQUIRE_SMOLLM2 is set.
pub fn smollm2() -> Option<PathBuf> {
    let found = if let Some(p) = std::env::var_os("CLEAVE_SMOLLM2_GGUF") {
        Some(PathBuf::from(p))
    } else {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        [root.join("../models/smollm2"), root.join("models/smollm2"), PathBuf::from("/work/models/smollm2")]
            .into_iter()
            .map(|d| d.join(SMOLLM2))
            .find(|p| p.is_file())
    };
    if found.is_none() {
        assert!(
            std::env::var_os("CLEAVE_REQUIRE_SMOLLM2").is_none(),
            "CLEAVE_REQUIRE_SMOLLM2 is set but {SMOLLM2} is missing"
        );
        println!("SKIP: {SMOLLM2} not found; run scripts/peers/smollm2.sh models/smollm2 or set CLEAVE_SMOLLM2_GGUF");
    }
    found
}

/// A file of `tests/fixtures` as text.
pub fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Perplexity of `tokens` by teacher forcing through `Model::forward` with a cache of `dtype`:
/// the first half in prefill chunks of 64 (the tiled attention path; each chunk reads the
/// earlier chunks' K/V from the cache), the rest in chunks of 8 (the per-query path, as decode
/// steps read it). Every position's logits are kept; the perplexity is
/// `exp(-mean log p(token[i + 1] | token[..=i]))`.
pub fn perplexity(model: &Model<CpuBackend>, backend: &CpuBackend, tokens: &[u32], dtype: KvDtype) -> f64 {
    let block_size = 16;
    let blocks = tokens.len().div_ceil(block_size);
    let spec = KvSpec { num_blocks: blocks + 1, block_size, dtype };
    let mut kv = KvStorage::new(backend, &model.config, spec).unwrap();
    // A reversed block table, so the cache is read through real indirection.
    let table: Vec<u32> = (1..=blocks as u32).rev().collect();
    let vocab = model.config.vocab_size;
    let (mut done, mut nll) = (0, 0f64);
    while done < tokens.len() {
        let len = if done < tokens.len() / 2 { 64 } else { 8 }.min(tokens.len() - done);
        let positions: Vec<u32> = (done as u32..(done + len) as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| table[p as usize / block_size] * block_size as u32 + p % block_size as u32)
            .collect();
        let rows: Vec<u32> = (0..len as u32).collect();
        let seqs = [AttnSeq { q_start: 0, q_len: len, context_len: done + len, block_table: &table }];
        let batch = ForwardBatch {
            tokens: &tokens[done..done + len],
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logit_rows: &rows,
        };
        let logits = model.forward(backend, batch, &mut kv).unwrap();
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            if let Some(&next) = tokens.get(done + i + 1) {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                nll -= row[next as usize] as f64 - max - z.ln();
            }
        }
        done += len;
    }
    (nll / (tokens.len() - 1) as f64).exp()
}

/// Logits at the last prompt position, computed by one prefill over the whole prompt through a
/// scrambled block table (so the test also exercises indirection), on any backend.
pub fn last_logits<B: cleave_kernels::Backend>(model: &Model<B>, backend: &B, prompt: &[u32]) -> Vec<f32> {
    let block_size = 16;
    let blocks = prompt.len().div_ceil(block_size);
    let spec = KvSpec { num_blocks: blocks + 1, block_size, dtype: KvDtype::F32 };
    let mut kv = KvStorage::new(backend, &model.config, spec).unwrap();
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let slots: Vec<u32> =
        positions.iter().map(|&p| table[p as usize / block_size] * block_size as u32 + p % block_size as u32).collect();
    let seqs = [AttnSeq { q_start: 0, q_len: prompt.len(), context_len: prompt.len(), block_table: &table }];
    let rows = [prompt.len() as u32 - 1];
    let batch = ForwardBatch { tokens: prompt, positions: &positions, slots: &slots, seqs: &seqs, logit_rows: &rows };
    model.forward(backend, batch, &mut kv).unwrap()
}
