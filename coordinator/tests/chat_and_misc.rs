//! /v1/chat/completions (template applied, stream shape, logprobs), /tokenize and
//! /detokenize with the tiny-llama tokenizer, /v1/models, /health, /metrics.

mod common;

use cleave_coordinator::ModelInfo;
use cleave_tokenizer::ChatMessage;
use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_applies_the_template_and_streams_like_openai() {
    let m = ModelInfo::from_args(&args()).unwrap();
    let script = ids(&m, " Sure, here you go.");
    let mut h = start(args(), Mode::Script(script.clone())).await;
    let messages = json!([
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}
    ]);
    let body = json!({"model": "tiny-llama", "messages": messages, "max_completion_tokens": 64, "max_tokens": 3});
    let v: Value = h.post("/v1/chat/completions", body.clone()).await.json().await.unwrap();
    let seen = h.next_seen().await;
    let rendered = m
        .tokenizer
        .render_chat(
            &[ChatMessage::user("Hi there"), ChatMessage::assistant("Hello."), ChatMessage::user("Tell me\na story")],
            true,
        )
        .unwrap();
    assert!(rendered.starts_with("<s>[INST] Hi there [/INST]Hello.</s>[INST] Tell me\na story [/INST]"), "{rendered}");
    assert_eq!(seen.prompt, m.tokenizer.encode(&rendered, false).unwrap());
    assert_eq!(seen.prompt[0], 1, "one BOS, from the template");
    assert_eq!(seen.prompt.iter().filter(|&&t| t == 1).count(), 1);
    assert_eq!(seen.stop.max_tokens, 64, "max_completion_tokens wins over max_tokens");
    assert_eq!(seen.params.temperature, 0.0, "generation_config.json says do_sample: false");
    assert_eq!(v["object"], "chat.completion");
    let want = expected_text(&m, &seen.prompt, &script);
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": want}));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], script.len());

    // The same through /tokenize.
    let t: Value = h.post("/tokenize", json!({"messages": messages})).await.json().await.unwrap();
    assert_eq!(t["tokens"], json!(seen.prompt));
    assert_eq!(t["count"], seen.prompt.len());
    assert_eq!(t["max_model_len"], 2048);

    let mut streaming = body;
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let resp = h.post("/v1/chat/completions", streaming).await;
    assert_eq!(resp.status(), 200);
    let chunks = sse_chunks(&resp.text().await.unwrap());
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"].get(0)).filter_map(|c| c["delta"]["content"].as_str()).collect();
    assert_eq!(text, want);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["total_tokens"], seen.prompt.len() + script.len());
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_have_openai_shape() {
    let m = ModelInfo::from_args(&args()).unwrap();
    let script = ids(&m, " Hello world");
    let h = start(args(), Mode::Script(script.clone())).await;
    let body = json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 3});
    let v: Value = h.post("/v1/chat/completions", body).await.json().await.unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), script.len());
    assert_eq!(content[0]["logprob"], -0.25);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    let token = content[1]["token"].as_str().unwrap();
    let bytes: Vec<u8> = content[1]["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
    assert_eq!(bytes, token.as_bytes());
    let v: Value = h
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}]}))
        .await
        .json()
        .await
        .unwrap();
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_round_trip_and_models() {
    let m = ModelInfo::from_args(&args()).unwrap();
    let h = start(args(), Mode::Script(vec![22557])).await;
    let text = "Hello world, café 日本語!";
    let t: Value = h.post("/tokenize", json!({"prompt": text})).await.json().await.unwrap();
    let tokens: Vec<u32> = serde_json::from_value(t["tokens"].clone()).unwrap();
    assert_eq!(tokens, m.tokenizer.encode(text, true).unwrap());
    assert_eq!(tokens[0], 1);
    assert_eq!(tokens[1], 22557, "▁Hello");
    let t2: Value =
        h.post("/tokenize", json!({"prompt": text, "add_special_tokens": false})).await.json().await.unwrap();
    assert_eq!(t2["count"], tokens.len() - 1);
    let d: Value = h.post("/detokenize", json!({"tokens": tokens})).await.json().await.unwrap();
    assert_eq!(d["prompt"], text);
    let bad = h.post("/detokenize", json!({"tokens": [1, 40000]})).await;
    assert_eq!(bad.status(), 400);
    let bad = h.post("/tokenize", json!({"prompt": "x", "messages": []})).await;
    assert_eq!(bad.status(), 400);

    let models: Value = h.client.get(h.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny-llama");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 2048);
    assert_eq!(m.eos_token_ids, vec![2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_prometheus_text_with_cleave_names() {
    let h = start(args(), Mode::Script(vec![22557, 3186])).await;
    let resp = h.post("/v1/completions", json!({"prompt": "x", "max_tokens": 5})).await;
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap();
    let text = h.client.get(h.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for name in [
        "cleave_http_requests_total",
        "cleave_time_to_first_token_seconds_bucket",
        "cleave_e2e_request_latency_seconds_bucket",
        "cleave_generation_tokens_total",
        "cleave_prompt_tokens_total",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    assert!(text.contains(r#"endpoint="completions""#), "{text}");
}
