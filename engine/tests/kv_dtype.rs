//! The KV cache in f16 and bf16 beside f32 (`EngineConfig::kv_dtype`):
//! - a 16-bit cache holds twice the blocks in the same memory and reports its dtype in the KV
//!   layout;
//! - greedy continuations of the tiny model's golden prompts with a 16-bit cache equal f32's;
//! - a handoff moves the cache's bytes as stored (half of f32's) and the decode side continues
//!   exactly as one engine with that cache would;
//! - on SmolLM2 (skipped with a message when its GGUF is absent, unless CLEAVE_REQUIRE_SMOLLM2
//!   is set), the perplexity of a fixed English text (`fixtures/perplexity_text.txt`) by
//!   teacher forcing is within 1% of f32's with either 16-bit cache.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_engine::model::{LoadOptions, Model, ModelFiles};
use cleave_engine::{EngineConfig, EngineCore, ImportStart, KvExport, KvExportEvent};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::{KvDtype, TokenEvent};
use common::*;

const DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

fn config(dtype: KvDtype) -> EngineConfig {
    EngineConfig { kv_cache_memory: 16 << 20, kv_dtype: dtype, ..Default::default() }
}

#[test]
fn a_16_bit_cache_holds_twice_the_blocks_and_says_so_in_its_layout() {
    let blocks: Vec<usize> =
        DTYPES.iter().map(|&d| engine(&tiny_llama_dir(), config(d)).snapshot().kv_blocks_total).collect();
    assert_eq!(blocks[1], 2 * blocks[0], "f16 vs f32 blocks");
    assert_eq!(blocks[2], 2 * blocks[0], "bf16 vs f32 blocks");
    for d in DTYPES {
        assert_eq!(engine(&tiny_llama_dir(), config(d)).kv_layout().dtype, d);
    }
}

/// A cache's pages cost memory once its blocks are first used, and the snapshot (what nodes
/// report as `kv_resident_bytes`) says how much: nothing before a request, the blocks requests
/// used after them, never the whole cache; and what it counts in blocks is what the OS says is
/// resident (`mincore`), within a page per pool (a block's bytes need not end on a page).
#[cfg(target_os = "linux")]
#[test]
fn the_snapshot_says_how_much_of_the_cache_is_resident() {
    let cases = golden()["cases"].as_array().unwrap().clone();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let mut core = engine(&tiny_llama_dir(), config(dtype));
        assert_eq!(core.snapshot().kv_resident_bytes, 0, "{dtype:?}: a fresh cache");
        assert_eq!(core.kv_resident_bytes_measured(), 0, "{dtype:?}: a fresh cache, as the OS says");
        for (i, case) in cases.iter().enumerate() {
            core.add_request(greedy_request(i as u64, ids(&case["prompt_ids"]), 8), Instant::now()).unwrap();
            run_to_end(&mut core);
            let (counted, measured) = (core.snapshot().kv_resident_bytes as usize, core.kv_resident_bytes_measured());
            assert!(counted > 0, "{dtype:?}: nothing resident after a request");
            assert!(counted < (4 << 20), "{dtype:?}: {counted} bytes of a 16 MiB cache after short requests");
            // A K and a V pool per layer (4 here), each backed to the end of the page its last
            // block ends in; twice that for good measure.
            let slack = 8 * 4096;
            assert!(counted.abs_diff(measured) <= slack, "{dtype:?}: counted {counted}, the OS says {measured}");
        }
    }
}

/// Greedy events of every golden prompt (32 tokens each, all in one engine, with the top-2
/// logprobs of every step).
fn golden_greedy(dtype: KvDtype) -> Vec<Vec<TokenEvent>> {
    let mut core = engine(&tiny_llama_dir(), config(dtype));
    let cases = golden()["cases"].as_array().unwrap().clone();
    for (i, case) in cases.iter().enumerate() {
        let mut req = greedy_request(i as u64, ids(&case["prompt_ids"]), 32);
        req.params.logprobs = Some(2);
        core.add_request(req, Instant::now()).unwrap();
    }
    let mut out = run_to_end(&mut core);
    assert_eq!(core.scheduler().kv().num_in_use(), 0, "blocks leaked");
    (0..cases.len()).map(|i| out.remove(&(i as u64)).unwrap()).collect()
}

/// Greedy continuations with 16-bit caches equal f32's (which is the transformers golden,
/// tests/golden.rs) wherever f32's choice is not a near-tie: the first token where a 16-bit run
/// differs must be f32's runner-up, within `NEAR_TIE` nats of its winner (the random-weight tiny
/// model has such ties; bf16's 8-bit mantissa flips one on the chat prompt, f16 none).
#[test]
fn greedy_text_of_the_golden_prompts_is_the_same_with_f16_and_bf16_caches_but_for_near_ties() {
    const NEAR_TIE: f32 = 0.01;
    let reference = golden_greedy(KvDtype::F32);
    let cases = golden()["cases"].as_array().unwrap().clone();
    for (events, case) in reference.iter().zip(&cases) {
        assert_eq!(token_ids(events), ids(&case["generated_ids"]), "f32 cache: case {}", case["name"]);
    }
    for dtype in [KvDtype::F16, KvDtype::Bf16] {
        let mut diverged = Vec::new();
        for ((want, got), case) in reference.iter().zip(golden_greedy(dtype)).zip(&cases) {
            let (w, g) = (token_ids(want), token_ids(&got));
            let Some(i) = w.iter().zip(&g).position(|(a, b)| a != b) else {
                assert_eq!(w, g, "{dtype:?}: case {}", case["name"]);
                continue;
            };
            let top = &want[i].logprobs.as_ref().expect("logprobs").top;
            let margin = top[0].logprob - top[1].logprob;
            println!("{dtype:?}: case {} differs at token {i}: f32 margin {margin:.5} nats", case["name"]);
            assert_eq!(g[i], top[1].token_id, "{dtype:?}: case {} token {i} is not f32's runner-up", case["name"]);
            assert!(margin < NEAR_TIE, "{dtype:?}: case {} token {i}: f32 margin {margin} nats", case["name"]);
            diverged.push(case["name"].as_str().unwrap().to_string());
        }
        assert!(diverged.len() <= 1, "{dtype:?}: cases {diverged:?} differ from f32");
    }
}

/// Prefill-only on `a`, every chunk imported into `b`, decoded there. Returns the token ids (the
/// first from `a`) and the K and V bytes the handoff moved.
fn handoff(a: &mut EngineCore<CpuBackend>, b: &mut EngineCore<CpuBackend>, prompt: Vec<u32>) -> (Vec<u32>, usize) {
    let now = Instant::now();
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    let req = greedy_request(1, prompt, 24);
    a.add_prefill_only(
        req.clone(),
        KvExport::new(move |ev| {
            sink.lock().unwrap().push(ev);
            Ok(())
        }),
        now,
    )
    .unwrap();
    b.reserve_import(req.id, req.prompt.len()).unwrap();
    run_to_end(a);
    let (mut bytes, mut first) = (0, None);
    let row = b.kv_layout().bytes_per_token() / b.kv_layout().num_layers as usize / 2;
    for ev in log.lock().unwrap().drain(..) {
        match ev {
            KvExportEvent::Chunk(c) => {
                assert_eq!(c.k.len(), c.token_count as usize * row, "chunk bytes are the cache's rows as stored");
                bytes += c.k.len() + c.v.len();
                b.import_kv(c.request_id, c.layer, c.token_start, &c.k, &c.v).unwrap();
            }
            KvExportEvent::Done(d) => {
                let start = ImportStart {
                    first_token: d.first_token,
                    sampler_seed: Some(d.sampler_seed),
                    cached_tokens: d.cached_tokens,
                };
                b.add_imported(req.clone(), start, now).unwrap();
                first = Some(d.first_token);
            }
        }
    }
    let mut ids = vec![first.expect("Done")];
    ids.extend(token_ids(&run_to_end(b)[&1]));
    (ids, bytes)
}

#[test]
fn a_16_bit_handoff_moves_half_the_bytes_and_decodes_as_one_engine() {
    let case = golden()["cases"].as_array().unwrap().iter().find(|c| c["name"] == "long").unwrap().clone();
    let prompt = ids(&case["prompt_ids"]);
    let mut f32_bytes = 0;
    for dtype in DTYPES {
        let (mut a, mut b) = (engine(&tiny_llama_dir(), config(dtype)), engine(&tiny_llama_dir(), config(dtype)));
        assert_eq!(a.kv_layout(), b.kv_layout());
        let (ids, bytes) = handoff(&mut a, &mut b, prompt.clone());
        let layout = a.kv_layout();
        assert_eq!(bytes, prompt.len() * layout.bytes_per_token(), "{dtype:?}");
        if dtype == KvDtype::F32 {
            f32_bytes = bytes;
        } else {
            assert_eq!(2 * bytes, f32_bytes, "{dtype:?} handoff moves half of f32's bytes");
        }
        let mut single = engine(&tiny_llama_dir(), config(dtype));
        single.add_request(greedy_request(1, prompt.clone(), 24), Instant::now()).unwrap();
        assert_eq!(ids, token_ids(&run_to_end(&mut single)[&1]), "{dtype:?}: handoff vs one engine");
        assert_eq!(b.scheduler().kv().num_in_use(), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Perplexity on SmolLM2
// ---------------------------------------------------------------------------------------------

#[test]
fn smollm2_perplexity_with_16_bit_caches_is_within_one_percent_of_f32() {
    let Some(path) = smollm2() else { return };
    let files = ModelFiles::open(&path).unwrap();
    let tokens = files.tokenizer.encode(&fixture("perplexity_text.txt"), true).unwrap();
    assert!(tokens.len() > 300, "the text has {} tokens", tokens.len());
    let backend = CpuBackend::default();
    let opts = LoadOptions { dequantize_weights: true };
    let model = Model::load_with(&backend, files.config.clone(), files.source.as_ref(), opts).unwrap();
    let t = Instant::now();
    let ppl: Vec<f64> = DTYPES.iter().map(|&d| perplexity(&model, &backend, &tokens, d)).collect();
    println!(
        "SmolLM2-135M-Instruct Q4_1 (weights dequantized to f32), {} tokens: perplexity with an f32 KV cache \
         {:.5}, f16 {:.5} ({:+.4}%), bf16 {:.5} ({:+.4}%) ({:.1?})",
        tokens.len(),
        ppl[0],
        ppl[1],
        100.0 * (ppl[1] / ppl[0] - 1.0),
        ppl[2],
        100.0 * (ppl[2] / ppl[0] - 1.0),
        t.elapsed()
    );
    // An English text a small instruct model reads with some confidence (a broken cache gives
    // perplexities in the thousands).
    assert!(ppl[0] > 1.0 && ppl[0] < 50.0, "f32 perplexity {}", ppl[0]);
    for (d, p) in DTYPES.iter().zip(&ppl).skip(1) {
        assert!((p / ppl[0] - 1.0).abs() < 0.01, "{d:?} perplexity {p} vs f32 {}", ppl[0]);
    }
}
