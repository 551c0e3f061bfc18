//! /v1/completions against the scripted backend: streaming vs not, SSE framing, usage,
//! stop strings across token boundaries, n > 1, prompt shapes, logprobs, disconnects.

mod common;

use cleave_coordinator::ModelInfo;
use cleave_tokenizer::IncrementalDecoder;
use common::*;
use serde_json::{json, Value};

const GENERATED: &str = " Hello world! The café 日本語 sits here. END of the story, and more text after it.";

fn model() -> ModelInfo {
    ModelInfo::from_args(&args()).unwrap()
}

async fn read_stream(resp: reqwest::Response) -> (String, Vec<Value>) {
    assert_eq!(resp.status(), 200);
    let ct = resp.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let body = resp.text().await.unwrap();
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        assert!(frame.starts_with("data: ") || frame.starts_with(':'), "bad SSE frame {frame:?}");
    }
    let chunks = sse_chunks(&body);
    let text = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap().iter())
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect();
    (text, chunks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_equals_non_streamed_and_the_reference() {
    let m = model();
    let script = ids(&m, GENERATED);
    let mut h = start(args(), Mode::Script(script.clone())).await;
    let prompt = "The quick brown fox";
    let body = json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 100, "temperature": 0});
    let resp = h.post("/v1/completions", body.clone()).await;
    assert_eq!(resp.status(), 200);
    let full: Value = resp.json().await.unwrap();
    let seen = h.next_seen().await;
    assert_eq!(seen.prompt, m.tokenizer.encode(prompt, true).unwrap(), "prompt gets BOS");
    assert_eq!(seen.stop.max_tokens, 100);
    assert!(seen.stop.stop_strings.is_empty(), "stop strings stay in the coordinator");
    assert_eq!(seen.params.temperature, 0.0);
    let want = expected_text(&m, &seen.prompt, &script);
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["model"], "tiny-llama");
    assert_eq!(full["choices"][0]["text"], want.as_str());
    assert_eq!(full["choices"][0]["finish_reason"], "stop");
    assert!(full["choices"][0]["logprobs"].is_null());
    let usage = &full["usage"];
    assert_eq!(usage["prompt_tokens"], seen.prompt.len());
    assert_eq!(usage["completion_tokens"], script.len());
    assert_eq!(usage["total_tokens"], seen.prompt.len() + script.len());
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 3);

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (text, chunks) = read_stream(h.post("/v1/completions", streaming).await).await;
    assert_eq!(text, want);
    assert!(chunks.len() > 3, "streamed in pieces");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "no usage without include_usage");
    let finishes: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, vec![&json!("stop")]);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_usage_adds_a_final_usage_chunk_and_max_tokens_gives_length() {
    let m = model();
    let script = ids(&m, GENERATED);
    let h = start(args(), Mode::Script(script)).await;
    let body = json!({"prompt": "Hi", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}});
    let (_, chunks) = read_stream(h.post("/v1/completions", body).await).await;
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 5);
    assert_eq!(last["usage"]["prompt_tokens"], m.tokenizer.encode("Hi", true).unwrap().len());
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, "length");
}

/// A stop string made of the end of one token's text and the start of the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_across_token_boundary_ends_and_cancels() {
    let m = model();
    let script = ids(&m, GENERATED);
    let mut dec = IncrementalDecoder::new(m.tokenizer.clone(), &[1]);
    let pieces: Vec<String> = script.iter().map(|&t| dec.push(t).unwrap()).collect();
    let k = pieces.iter().position(|p| p.contains("sits")).expect("script has 'sits'");
    let stop = format!("{}{}", &pieces[k][pieces[k].len() - 2..], &pieces[k + 1][..2]);
    let mut h = start(args(), Mode::Endless(script.clone())).await;
    for stream in [false, true] {
        let body = json!({"prompt": [1], "max_tokens": 1000, "stop": [stop.clone(), "never"], "stream": stream});
        let resp = h.post("/v1/completions", body).await;
        let text = if stream {
            let (text, chunks) = read_stream(resp).await;
            assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
            text
        } else {
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        };
        let full = expected_text(&m, &[1], &script);
        let want = &full[..full.find(&stop).unwrap()];
        assert_eq!(text, want, "stop {stop:?}");
        let seen = h.next_seen().await;
        let cancelled = tokio::time::timeout(WAIT, h.cancelled.recv()).await.unwrap().unwrap();
        assert_eq!(cancelled, seen.id, "the backend is told to stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_two_and_several_prompts_get_distinct_choices_and_seeds() {
    let m = model();
    let script = ids(&m, " a b c");
    let mut h = start(args(), Mode::Script(script.clone())).await;
    let body = json!({"prompt": ["one", "two words"], "n": 2, "seed": 7, "max_tokens": 10, "temperature": 0.8});
    let v: Value = h.post("/v1/completions", body).await.json().await.unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(h.next_seen().await);
    }
    seen.sort_by_key(|s| s.id);
    let seeds: Vec<Option<u64>> = seen.iter().map(|s| s.params.seed).collect();
    assert_eq!(seeds, vec![Some(7), Some(8), Some(7), Some(8)]);
    assert_eq!(seen[0].prompt, seen[1].prompt);
    assert_ne!(seen[0].prompt, seen[2].prompt);
    let prompt_tokens = seen[0].prompt.len() + seen[2].prompt.len();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "each prompt counted once");
    assert_eq!(v["usage"]["completion_tokens"], 4 * script.len());
    assert_eq!(choices[0]["text"], choices[1]["text"]);

    // Token-id prompts, one list and a list of lists.
    let v: Value =
        h.post("/v1/completions", json!({"prompt": [1, 22557], "max_tokens": 2})).await.json().await.unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(h.next_seen().await.prompt, vec![1, 22557]);
    let v: Value =
        h.post("/v1/completions", json!({"prompt": [[1, 22557], [1, 2]], "max_tokens": 2})).await.json().await.unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_logprobs_have_openai_shape() {
    let m = model();
    let script = ids(&m, " Hello world");
    let h = start(args(), Mode::Script(script.clone())).await;
    let v: Value =
        h.post("/v1/completions", json!({"prompt": "x", "logprobs": 2, "max_tokens": 50})).await.json().await.unwrap();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), script.len());
    assert_eq!(lp["token_logprobs"][0], -0.25);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"][0], 0);
    let streamed =
        h.post("/v1/completions", json!({"prompt": "x", "logprobs": 2, "max_tokens": 50, "stream": true})).await;
    let (_, chunks) = read_stream(streamed).await;
    let n_tokens: usize =
        chunks.iter().map(|c| c["choices"][0]["logprobs"]["tokens"].as_array().map_or(0, Vec::len)).sum();
    assert_eq!(n_tokens, script.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_dispatch() {
    let m = model();
    let mut h = start(args(), Mode::Endless(ids(&m, " la"))).await;
    let mut resp = h.post("/v1/completions", json!({"prompt": "sing", "max_tokens": 2000, "stream": true})).await;
    assert_eq!(resp.status(), 200);
    let first = tokio::time::timeout(WAIT, resp.chunk()).await.unwrap().unwrap();
    assert!(first.is_some());
    let seen = h.next_seen().await;
    drop(resp);
    let cancelled = tokio::time::timeout(WAIT, h.cancelled.recv()).await.expect("cancel fired").unwrap();
    assert_eq!(cancelled, seen.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_disconnect_cancels_too() {
    let mut h = start(args(), Mode::Hang).await;
    let client = h.client.clone();
    let url = h.url("/v1/completions");
    let request =
        tokio::spawn(async move { client.post(url).json(&json!({"prompt": "x", "max_tokens": 3})).send().await });
    let seen = h.next_seen().await;
    request.abort();
    let cancelled = tokio::time::timeout(WAIT, h.cancelled.recv()).await.expect("cancel fired").unwrap();
    assert_eq!(cancelled, seen.id);
}
