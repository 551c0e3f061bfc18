//! Every error status and its OpenAI shape; API key; x-request-id; 429 and 503; timeouts.

mod common;

use common::*;
use serde_json::{json, Value};

async fn expect_error(resp: reqwest::Response, status: u16) -> Value {
    assert_eq!(resp.status(), status);
    let v: Value = resp.json().await.unwrap();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_in_openai_shape() {
    let h = start(args(), Mode::Script(vec![22557])).await;
    let raw =
        h.client.post(h.url("/v1/completions")).header("content-type", "application/json").body("{not json").send();
    let e = expect_error(raw.await.unwrap(), 400).await;
    assert_eq!(e["type"], "invalid_request_error");

    let e = expect_error(h.post("/v1/completions", json!({"prompt": "x", "temperature": "hot"})).await, 400).await;
    assert!(
        e["message"].as_str().unwrap().contains("temperature") || e["message"].as_str().unwrap().contains("malformed")
    );
    let e = expect_error(h.post("/v1/completions", json!({"model": "gpt-4", "prompt": "x"})).await, 400).await;
    assert_eq!((e["param"].as_str(), e["code"].as_str()), (Some("model"), Some("model_not_found")));
    for (field, value) in [
        ("temperature", json!(-1.0)),
        ("top_p", json!(0.0)),
        ("top_k", json!(-5)),
        ("min_p", json!(1.5)),
        ("presence_penalty", json!(3.0)),
        ("frequency_penalty", json!(-3.0)),
        ("repetition_penalty", json!(0.0)),
        ("n", json!(0)),
        ("n", json!(1000)),
        ("max_tokens", json!(0)),
        ("echo", json!(true)),
    ] {
        let mut body = json!({"prompt": "x"});
        body[field] = value.clone();
        let e = expect_error(h.post("/v1/completions", body).await, 400).await;
        assert_eq!(e["param"], field, "{field}={value}: {e}");
    }
    let e = expect_error(h.post("/v1/completions", json!({"prompt": "x", "logprobs": 21})).await, 400).await;
    assert_eq!(e["param"], "top_logprobs");
    let e = expect_error(h.post("/v1/completions", json!({"prompt": [1, 99999]})).await, 400).await;
    assert_eq!(e["param"], "prompt");
    let e = expect_error(h.post("/v1/completions", json!({"prompt": []})).await, 400).await;
    assert_eq!(e["param"], "prompt");
    let e = expect_error(h.post("/v1/completions", json!({"prompt": "x", "max_tokens": 5000})).await, 400).await;
    assert_eq!(e["code"], "context_length_exceeded");
    let long: Vec<u32> = vec![22557; 2048];
    let e = expect_error(h.post("/v1/completions", json!({"prompt": long})).await, 400).await;
    assert_eq!(e["code"], "context_length_exceeded", "a prompt that fills the context leaves no room");
    let e = expect_error(h.post("/v1/chat/completions", json!({"messages": []})).await, 400).await;
    assert_eq!(e["param"], "messages");
    let e = expect_error(
        h.post("/v1/chat/completions", json!({"messages": [{"role": "system", "content": "x"}]})).await,
        400,
    )
    .await;
    assert_eq!(e["param"], "messages", "the template's raise_exception is a 400");
    let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]});
    expect_error(h.post("/v1/chat/completions", image).await, 400).await;
    let e = expect_error(
        h.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}))
            .await,
        400,
    )
    .await;
    assert_eq!(e["param"], "top_logprobs");
    expect_error(h.post("/v1/completions", json!({"max_tokens": 3})).await, 400).await;
    // Fields that ask for what cleave does not do are refused by name, never ignored; the values
    // that ask for nothing pass.
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    for (field, value) in [
        ("functions", tool.clone()),
        ("function_call", json!({"name": "f"})),
        ("logit_bias", json!({"50256": -100})),
        ("modalities", json!(["text", "audio"])),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
    ] {
        let e = expect_error(h.post("/v1/chat/completions", chat(json!({ field: value.clone() }))).await, 400).await;
        assert_eq!(e["param"], field, "{field}={value}: {e}");
        assert!(e["message"].as_str().unwrap().contains(field), "{e}");
    }
    // Tools belong to chat: a completion that asks for them is refused by name.
    for (field, value) in [("tools", tool.clone()), ("tool_choice", json!("required"))] {
        let e = expect_error(h.post("/v1/completions", json!({"prompt": "x", field: value.clone()})).await, 400).await;
        assert_eq!(e["param"], field, "{field}={value}: {e}");
    }
    for (field, value) in [("suffix", json!("end")), ("best_of", json!(3)), ("logit_bias", json!({"1": 5}))] {
        let e = expect_error(h.post("/v1/completions", json!({"prompt": "x", field: value.clone()})).await, 400).await;
        assert_eq!(e["param"], field, "{field}={value}: {e}");
    }
    for harmless in [
        json!({"tools": [], "tool_choice": "none"}),
        json!({"tool_choice": "auto", "parallel_tool_calls": false}),
        json!({"response_format": {"type": "text"}, "logit_bias": {}, "tools": null}),
        json!({"guided_json": null, "structured_outputs": {}, "functions": [], "function_call": "auto"}),
        json!({"modalities": ["text"], "user": "u-1", "metadata": {"a": "b"}}),
    ] {
        let r = h.post("/v1/chat/completions", chat(harmless.clone())).await;
        assert_eq!(r.status(), 200, "{harmless}");
    }
    let r = h.post("/v1/completions", json!({"prompt": "x", "max_tokens": 1, "best_of": 1, "suffix": ""})).await;
    assert_eq!(r.status(), 200);
    // A role the API does not have is refused, naming it.
    let wizard = json!({"messages": [{"role": "wizard", "content": "x"}]});
    let e = expect_error(h.post("/v1/chat/completions", wizard).await, 400).await;
    assert_eq!(e["param"], "messages");
    assert!(e["message"].as_str().unwrap().contains("wizard"), "{e}");
    let e = expect_error(h.client.get(h.url("/v1/nothing")).send().await.unwrap(), 404).await;
    assert_eq!(e["type"], "invalid_request_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_api_routes_only() {
    let args = cleave_coordinator::CoordinatorArgs { api_key: Some("sekrit".into()), ..args() };
    let h = start(args, Mode::Script(vec![22557])).await;
    let e = expect_error(h.post("/v1/completions", json!({"prompt": "x"})).await, 401).await;
    assert_eq!(e["type"], "authentication_error");
    let wrong = h.client.post(h.url("/v1/completions")).bearer_auth("nope").json(&json!({"prompt": "x"})).send();
    expect_error(wrong.await.unwrap(), 401).await;
    let models = h.client.get(h.url("/v1/models")).send().await.unwrap();
    expect_error(models, 401).await;
    let right = h
        .client
        .post(h.url("/v1/completions"))
        .bearer_auth("sekrit")
        .json(&json!({"prompt": "x", "max_tokens": 1}))
        .send();
    assert_eq!(right.await.unwrap().status(), 200);
    assert_eq!(h.client.get(h.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(h.client.get(h.url("/metrics")).send().await.unwrap().status(), 200);
}

/// Several named keys from a file: each admits up to its concurrent-request limit (a stream
/// counts until it ends), one key's limit holds up no other key, and requests are counted by
/// key name in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_keys_each_hold_their_own_concurrency_limit() {
    let dir = std::env::temp_dir().join(format!("cleave-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys.txt");
    std::fs::write(&file, "# name key limit\nalpha sk-alpha 1\nbeta sk-beta\n").unwrap();
    let keyed = cleave_coordinator::CoordinatorArgs { api_keys_file: Some(file.clone()), ..args() };
    let h = start(keyed, Mode::Endless(vec![22557])).await;
    let stream = |key: &'static str| {
        let req = h.client.post(h.url("/v1/completions")).bearer_auth(key);
        async move {
            let body = json!({"prompt": "x", "max_tokens": 1000, "stream": true});
            tokio::time::timeout(WAIT, req.json(&body).send()).await.unwrap().unwrap()
        }
    };
    let mut first = stream("sk-alpha").await;
    assert_eq!(first.status(), 200);
    tokio::time::timeout(WAIT, first.chunk()).await.unwrap().unwrap().expect("a first chunk");
    // alpha is at its limit of 1 while its stream runs; beta is not held up by it.
    let e = expect_error(stream("sk-alpha").await, 429).await;
    assert_eq!((e["type"].as_str(), e["code"].as_str()), (Some("rate_limit_error"), Some("rate_limit_exceeded")));
    assert!(e["message"].as_str().unwrap().contains("alpha"), "{e}");
    let mut beta = stream("sk-beta").await;
    assert_eq!(beta.status(), 200);
    tokio::time::timeout(WAIT, beta.chunk()).await.unwrap().unwrap().expect("a first chunk");
    expect_error(stream("sk-gamma").await, 401).await;
    // The client leaves: alpha's place comes back.
    drop(first);
    let admitted = tokio::time::timeout(WAIT, async {
        loop {
            let r = stream("sk-alpha").await;
            if r.status() == 200 {
                return r;
            }
            assert_eq!(r.status(), 429);
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("alpha's place came back after its stream was dropped");
    drop((admitted, beta));
    let text = h.client.get(h.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for want in [
        "cleave_api_key_requests_total{key=\"alpha\",status=\"429\"}",
        "cleave_api_key_requests_total{key=\"beta\",status=\"200\"}",
    ] {
        assert!(text.contains(want), "{want} missing from /metrics");
    }
    // A file that cannot be used stops the server at start, naming the line.
    std::fs::write(&file, "alpha sk-a\nalpha sk-b\n").unwrap();
    let bad = cleave_coordinator::CoordinatorArgs { api_keys_file: Some(file), ..args() };
    let model = cleave_coordinator::model::ModelInfo::from_args(&bad).unwrap();
    let (tx, _rx) = cleave_coordinator::dispatch_channel(4);
    let e = cleave_coordinator::server::AppState::new(&bad, model, tx).unwrap_err().to_string();
    assert!(e.contains("line 2") && e.contains("twice"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_request_id_is_echoed_on_success_and_error() {
    let h = start(args(), Mode::Script(vec![22557])).await;
    for body in [json!({"prompt": "x", "max_tokens": 1}), json!({"prompt": "x", "top_p": 7})] {
        let resp =
            h.client.post(h.url("/v1/completions")).header("x-request-id", "abc-123").json(&body).send().await.unwrap();
        assert_eq!(resp.headers()["x-request-id"], "abc-123");
    }
    let resp = h.client.get(h.url("/health")).send().await.unwrap();
    assert!(resp.headers().get("x-request-id").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_429_with_retry_after() {
    let args = cleave_coordinator::CoordinatorArgs { max_queued_requests: 1, retry_after_secs: 3, ..args() };
    let h = start_parked(args).await;
    // The first request fills the queue (nobody drains it) and waits for its first token;
    // the second finds it full.
    let client = h.client.clone();
    let url = h.url("/v1/completions");
    let first =
        tokio::spawn(async move { client.post(url).json(&json!({"prompt": "x", "max_tokens": 1})).send().await });
    let parked = h.parked.as_ref().unwrap();
    tokio::time::timeout(WAIT, async {
        while parked.is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the first request is queued");
    let resp = h.post("/v1/completions", json!({"prompt": "y", "max_tokens": 1})).await;
    assert_eq!(resp.headers()["retry-after"], "3");
    let e = expect_error(resp, 429).await;
    assert_eq!(e["type"], "rate_limit_error");
    first.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_is_503_and_a_failed_node_is_500() {
    let h = start(args(), Mode::Refuse).await;
    for stream in [false, true] {
        let e = expect_error(h.post("/v1/completions", json!({"prompt": "x", "stream": stream})).await, 503).await;
        assert!(e["message"].as_str().unwrap().contains("no decode node"), "{e}");
    }
    let h = start(args(), Mode::FailAfterOne(22557)).await;
    expect_error(h.post("/v1/completions", json!({"prompt": "x"})).await, 500).await;
    // Streaming: the first token was sent, so the failure is an SSE error event then [DONE].
    let resp = h.post("/v1/completions", json!({"prompt": "x", "stream": true})).await;
    assert_eq!(resp.status(), 200);
    let data = sse_data(&resp.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("scripted failure"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_backend_times_out_and_is_cancelled() {
    let args = cleave_coordinator::CoordinatorArgs { first_token_timeout_secs: 0.2, ..args() };
    let mut h = start(args, Mode::Hang).await;
    let e = expect_error(h.post("/v1/completions", json!({"prompt": "x"})).await, 504).await;
    assert_eq!(e["code"], "timeout");
    let seen = h.next_seen().await;
    let cancelled = tokio::time::timeout(WAIT, h.cancelled.recv()).await.unwrap().unwrap();
    assert_eq!(cancelled, seen.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_readiness_signal() {
    use cleave_coordinator::{dispatch_channel, AppState, ModelInfo};
    let args = args();
    let model = ModelInfo::from_args(&args).unwrap();
    let (tx, _rx) = dispatch_channel(4);
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(Err("no decode node registered".to_owned()));
    let state = AppState::new(&args, model, tx).unwrap().with_readiness(ready_rx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/health", listener.local_addr().unwrap());
    tokio::spawn(cleave_coordinator::serve(cleave_coordinator::edge::EdgeListener::plain(listener).unwrap(), state));
    let client = reqwest::Client::new();
    let e = expect_error(client.get(&url).send().await.unwrap(), 503).await;
    assert!(e["message"].as_str().unwrap().contains("no decode node"), "{e}");
    ready_tx.send(Ok(())).unwrap();
    assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_413_in_openai_shape() {
    let args = cleave_coordinator::CoordinatorArgs { max_body_bytes: 64, ..args() };
    let h = start(args, Mode::Script(vec![22557])).await;
    let e = expect_error(h.post("/v1/completions", json!({"prompt": "x".repeat(200)})).await, 413).await;
    assert_eq!(e["type"], "invalid_request_error");
}
