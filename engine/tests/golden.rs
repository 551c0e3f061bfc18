//! The engine against Hugging Face transformers' outputs for `testdata/tiny-llama`:
//! token ids, last-position logits, greedy continuations and streamed text.

mod common;

use cleave_engine::model::{Model, ModelFiles};
use cleave_engine::EngineConfig;
use cleave_kernels::cpu::CpuBackend;
use common::*;

#[test]
fn prompt_ids_match_transformers() {
    let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
    for case in golden()["cases"].as_array().unwrap() {
        if case["name"] == "chat" {
            continue;
        }
        let add = case["add_special_tokens"].as_bool().unwrap();
        let got = files.tokenizer.encode(case["prompt"].as_str().unwrap(), add).unwrap();
        assert_eq!(got, ids(&case["prompt_ids"]), "case {}", case["name"]);
    }
}

#[test]
fn chat_template_renders_and_tokenizes_like_transformers() {
    let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
    let case = golden()["cases"].as_array().unwrap().iter().find(|c| c["name"] == "chat").unwrap().clone();
    let messages: Vec<cleave_tokenizer::ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let rendered = files.tokenizer.render_chat(&messages, true).unwrap();
    assert_eq!(rendered, case["rendered_prompt"].as_str().unwrap());
    assert_eq!(files.tokenizer.encode(&rendered, false).unwrap(), ids(&case["prompt_ids"]));
}

#[test]
fn last_logits_match_transformers() {
    let backend = CpuBackend::default();
    let files = ModelFiles::open(&tiny_llama_dir()).unwrap();
    let model = Model::load(&backend, files.config.clone(), files.source.as_ref()).unwrap();
    for case in golden()["cases"].as_array().unwrap() {
        let logits = last_logits(&model, &backend, &ids(&case["prompt_ids"]));
        let top = &case["last_logits_top5"];
        let want_ids = ids(&top["ids"]);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let got_ids: Vec<u32> = order[..5].iter().map(|&i| i as u32).collect();
        assert_eq!(got_ids, want_ids, "case {}: top-5 ids", case["name"]);
        for (id, want) in want_ids.iter().zip(top["values"].as_array().unwrap()) {
            let (got, want) = (logits[*id as usize], want.as_f64().unwrap() as f32);
            assert!(((got - want) / want).abs() < 1e-4, "case {}: logit of {id}: {got} vs {want}", case["name"]);
        }
    }
}

#[test]
fn greedy_continuations_and_text_match_transformers() {
    let mut core = engine(&tiny_llama_dir(), EngineConfig { kv_cache_memory: 64 << 20, ..Default::default() });
    let cases = golden()["cases"].as_array().unwrap().clone();
    for (i, case) in cases.iter().enumerate() {
        core.add_request(greedy_request(i as u64, ids(&case["prompt_ids"]), 32), std::time::Instant::now()).unwrap();
    }
    let out = run_to_end(&mut core);
    for (i, case) in cases.iter().enumerate() {
        let events = &out[&(i as u64)];
        assert_eq!(token_ids(events), ids(&case["generated_ids"]), "case {}", case["name"]);
        assert_eq!(text(events), case["text_incremental"].as_str().unwrap(), "case {}", case["name"]);
        assert_eq!(events.last().unwrap().finish_reason, Some(cleave_protocol::FinishReason::Length));
    }
    assert_eq!(core.scheduler().kv().num_in_use(), 0, "blocks leaked");
}
