//! The whole system as processes: `cleave coordinator` and `cleave node` children talking QUIC
//! with mutual TLS on loopback, driven through the OpenAI HTTP API with a real HTTP client.
//!
//! References: greedy text from `cleave generate` (single process) and golden text from
//! Hugging Face transformers (tiny-llama's golden.json).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

#[test]
fn one_prefill_one_decode_matches_transformers() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Every prompt goes through the prefill node and the KV handoff.
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "0"]);
    runtime().block_on(async {
        check_golden(&c).await;
        let m = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
        assert!(m.contains("cleave_route_decisions_total{path=\"remote\""), "no remote prefill recorded:\n{m}");
        assert!(!m.contains("path=\"local\""), "a request was prefilled locally:\n{m}");
        assert!(m.contains("cleave_handoff_transfer_bytes"), "{m}");
        // Each node serves its own metrics: load gauges, and its side of the handoffs.
        for (node, want) in
            [(&c.nodes[0], "cleave_node_handoff_transfer_seconds"), (&c.nodes[1], "cleave_node_kv_wait_seconds")]
        {
            let url = format!("http://{}/metrics", node.ready["metrics"]);
            let m = c.client.get(url).send().await.unwrap().text().await.unwrap();
            for name in ["cleave_node_kv_blocks", "cleave_kv_transfer_handoffs_total", want] {
                assert!(m.contains(name), "{} lacks {name}:\n{m}", node.name);
            }
        }
    });
}

/// Sum of the samples of `name` (a counter, or a histogram's `_sum`/`_count`) whose labels
/// include every `labels` pair, in Prometheus text.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every response says how it was served (`x-cleave-route`), the latency histograms carry the
/// same pool and path, and the handoff metrics agree with a request of known size on all three
/// processes (bytes are the prompt's KV: 2 layers x K and V x 2 heads x 16 x 4 bytes a token).
#[test]
fn responses_say_how_they_were_served_and_the_metrics_agree() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "8"]);
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let post = |body: Value| {
            let r = c.client.post(format!("{}/v1/completions", c.http)).json(&body).send();
            async move {
                let r = r.await.unwrap();
                assert!(r.status().is_success(), "{}", r.status());
                let route = r.headers().get("x-cleave-route").map(|v| v.to_str().unwrap().to_string());
                (route, r.text().await.unwrap())
            }
        };
        let long = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire";
        let (route, body) = post(greedy(long, 4)).await;
        assert_eq!(route.as_deref(), Some("remote; prefill=node-0; decode=node-1"), "{body}");
        let prompt_tokens = serde_json::from_str::<Value>(&body).unwrap()["usage"]["prompt_tokens"].as_u64().unwrap();
        let (route, _) = post(greedy("Hi", 4)).await;
        assert_eq!(route.as_deref(), Some("local; reason=short_prompt; decode=node-1"));
        let mut streamed = greedy("Hello", 4);
        streamed["stream"] = json!(true);
        let (route, _) = post(streamed).await;
        assert_eq!(route.as_deref(), Some("local; reason=short_prompt; decode=node-1"), "streamed responses too");

        let get = |url: String| {
            let r = c.client.get(url).send();
            async move { r.await.unwrap().text().await.unwrap() }
        };
        // The prefill node's handoff report can arrive after a short response has ended (the
        // coordinator then reads it in the background): wait for it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let m = loop {
            let m = get(format!("{}/metrics", c.http)).await;
            if sample(&m, "cleave_handoff_queue_seconds_count", &[]) >= 1.0 || std::time::Instant::now() > deadline {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if sample(&m, "cleave_handoff_queue_seconds_count", &[]) < 1.0 {
            // Say what each process saw of the handoff, not the whole text (CI shows a part).
            let pm = get(format!("http://{}/metrics", c.nodes[0].ready["metrics"])).await;
            let dm = get(format!("http://{}/metrics", c.nodes[1].ready["metrics"])).await;
            let seen = |t: &str| {
                t.lines()
                    .filter(|l| !l.starts_with('#') && !l.contains("_bucket{"))
                    .filter(|l| ["handoff", "migrat", "kv_transfer", "failure", "requests_total"].iter().any(|k| l.contains(k)))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            panic!(
                "no handoff report in 10 s\n-- coordinator\n{}\n-- prefill node\n{}\n-- decode node\n{}",
                seen(&m),
                seen(&pm),
                seen(&dm)
            );
        }
        let ttft = "cleave_time_to_first_token_seconds_count";
        assert_eq!(sample(&m, ttft, &[("pool", "prefill"), ("path", "remote")]), 1.0, "{m}");
        assert_eq!(sample(&m, ttft, &[("pool", "decode"), ("path", "local"), ("local_reason", "short_prompt")]), 2.0, "{m}");
        let tpot = "cleave_time_per_output_token_seconds_count";
        assert_eq!(sample(&m, tpot, &[("pool", "decode"), ("path", "remote")]), 1.0, "{m}");
        // TPOT buckets resolve a 70 ms target.
        assert!(
            m.contains("cleave_time_per_output_token_seconds_bucket{pool=\"decode\",path=\"remote\",local_reason=\"none\",le=\"0.07\"}"),
            "{m}"
        );
        let kv = prompt_tokens as f64 * 512.0;
        assert_eq!(sample(&m, "cleave_handoff_transfer_bytes_sum", &[]), kv, "{m}");
        assert_eq!(sample(&m, "cleave_handoff_queue_seconds_count", &[]), 1.0, "{m}");
        let queue = sample(&m, "cleave_handoff_queue_seconds_sum", &[]);
        assert!(queue > 0.0 && queue < 10.0, "queue {queue} s");
        let pm = get(format!("http://{}/metrics", c.nodes[0].ready["metrics"])).await;
        assert_eq!(sample(&pm, "cleave_kv_transfer_bytes_total", &[("side", "sender")]), kv, "{pm}");
        assert_eq!(sample(&pm, "cleave_node_prefill_queue_seconds_count", &[]), 1.0, "{pm}");
        let dm = get(format!("http://{}/metrics", c.nodes[1].ready["metrics"])).await;
        assert_eq!(sample(&dm, "cleave_kv_transfer_bytes_total", &[("side", "receiver")]), kv, "{dm}");
        let done = [("side", "receiver"), ("outcome", "completed")];
        assert_eq!(sample(&dm, "cleave_kv_transfer_handoffs_total", &done), 1.0, "{dm}");
    });
}

/// A multi-turn chat through one prefill and one decode node: from the second turn on, the
/// decode node holds the conversation so far (earlier prompts and answers) in its prefix cache,
/// reserves the turn with those blocks, and the prefill node sends only the rest: the handoff
/// bytes (coordinator and both nodes' metrics) are the uncached tokens' 512 bytes each. Every
/// turn's greedy text equals `cleave generate --messages` on the same conversation.
#[test]
fn a_multi_turn_chat_hands_off_only_what_the_decode_node_lacks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "0"]);
    let dir = std::env::temp_dir().join(format!("cleave-turns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let get = |url: String| async move { reqwest::get(url).await.unwrap().text().await.unwrap() };
        let dm_url = format!("http://{}/metrics", c.nodes[1].ready["metrics"]);
        let users = ["Tell me a story about a dragon.", "And then what happened?", "How does it end?"];
        let mut messages = Vec::new();
        let (mut sent_before, mut cached_before, mut prev_prompt) = (0.0, 0.0, 0.0f64);
        for (turn, user) in users.iter().enumerate() {
            messages.push(json!({"role": "user", "content": user}));
            let body = json!({"model": "tiny-llama", "messages": messages, "max_tokens": 20, "temperature": 0});
            let v: Value = c
                .client
                .post(format!("{}/v1/chat/completions", c.http))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let text = v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{v}")).to_string();
            let prompt_tokens = v["usage"]["prompt_tokens"].as_f64().unwrap();
            let m = get(format!("{}/metrics", c.http)).await;
            let sent = sample(&m, "cleave_handoff_transfer_bytes_sum", &[]);
            let cached = sample(&get(dm_url.clone()).await, "cleave_node_handoff_cached_tokens_total", &[]);
            let (sent_now, cached_now) = (sent - sent_before, cached - cached_before);
            (sent_before, cached_before) = (sent, cached);
            assert_eq!(sent_now, (prompt_tokens - cached_now) * 512.0, "turn {turn}: only uncached tokens travel");
            if turn == 0 {
                assert_eq!(cached_now, 0.0);
            } else {
                // At least the previous turn's prompt, in full blocks of 16 tokens.
                let floor = 16.0 * (prev_prompt / 16.0).floor();
                assert!(cached_now >= floor, "turn {turn}: {cached_now} of {prompt_tokens} cached, want {floor}");
            }
            prev_prompt = prompt_tokens;
            let pm = get(format!("http://{}/metrics", c.nodes[0].ready["metrics"])).await;
            assert_eq!(sample(&pm, "cleave_kv_transfer_bytes_total", &[("side", "sender")]), sent, "{pm}");
            let file = dir.join(format!("turn{turn}.json"));
            std::fs::write(&file, serde_json::to_string(&messages).unwrap()).unwrap();
            let out = Command::new(exe())
                .args(["generate", "--model", tiny_llama().to_str().unwrap(), "--max-tokens", "20", "--messages"])
                .arg(&file)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let want = String::from_utf8(out.stdout).unwrap();
            assert_eq!(text, want.strip_suffix('\n').unwrap_or(&want), "turn {turn}");
            messages.push(json!({"role": "assistant", "content": text}));
        }
        assert!(cached_before > 0.0, "no turn found its prefix on the decode node");
        c.wait_blocks_free().await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_prefill_two_decode_and_two_colocated_match_transformers() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "prefill", "decode", "decode"], &[]);
    runtime().block_on(check_golden(&c));
    drop(c);
    let c = TestCluster::start(&tiny_llama(), &["both", "both"], &[]);
    runtime().block_on(check_golden(&c));
}

#[test]
fn sixty_four_concurrent_streams_complete_correctly() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode", "decode"], &["--local-prefill-max-tokens", "8"]);
    runtime().block_on(async {
        c.wait_nodes(3).await;
        let cases = golden();
        let reqs = (0..64).map(|i| {
            let case = &cases[i % cases.len()];
            let c = &c;
            async move {
                let (text, finish) = c.stream(greedy(case["prompt"].as_str().unwrap(), 32)).await;
                (case["text_incremental"].as_str().unwrap().to_string(), text, finish)
            }
        });
        for (want, got, finish) in futures::future::join_all(reqs).await {
            assert_eq!(got, want);
            assert_eq!(finish, "length");
        }
        c.wait_blocks_free().await;
    });
}

/// More handoffs than the decode node's KV cache can take at once: the coordinator holds what
/// does not fit (`cleave_requests_held_for_decode_kv_total`) until running streams free blocks,
/// instead of sending reservations the node refuses (each request used to fail with a 500
/// after three refused attempts). Every request completes whole; every block is freed.
#[test]
fn handoffs_beyond_the_decode_nodes_kv_wait_for_room_instead_of_failing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // 1 MiB of tiny-llama KV is 128 blocks of 16 tokens: room for the prompts (~660 tokens,
    // 42 blocks) of 3 of the 12 requests at once.
    let c = TestCluster::start_with(
        &tiny_llama(),
        &["prefill", "decode"],
        &["--local-prefill-max-tokens", "0"],
        &["--kv-cache-memory", "1m"],
    );
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let prompt = "the quick brown fox jumps over the lazy dog ".repeat(60);
        let reqs = (0..12).map(|i| {
            let body = greedy(&format!("{i} {prompt}"), 200);
            let c = &c;
            async move {
                let r = c.client.post(format!("{}/v1/completions", c.http)).json(&body).send().await.unwrap();
                (r.status(), r.json::<Value>().await.unwrap())
            }
        });
        for (status, v) in futures::future::join_all(reqs).await {
            assert!(status.is_success(), "{status}: {v}");
            assert_eq!(v["usage"]["completion_tokens"], 200, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        }
        assert!(metric(&c, "cleave_requests_held_for_decode_kv_total").await >= 1.0, "nothing waited for room");
        c.wait_blocks_free().await;
    });
}

#[test]
fn client_disconnect_frees_every_block() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "0"]);
    runtime().block_on(async {
        c.wait_nodes(2).await;
        for _ in 0..3 {
            let mut body = greedy("Tell me a very long story about a dragon and a knight.", 1500);
            body["stream"] = json!(true);
            let r = c.client.post(format!("{}/v1/completions", c.http)).json(&body).send().await.unwrap();
            let mut s = r.bytes_stream();
            // Read a few events, then hang up mid-stream.
            let mut got = 0;
            while got < 3 {
                let chunk = s.next().await.unwrap().unwrap();
                got += chunk.iter().filter(|&&b| b == b'\n').count() / 2;
            }
            drop(s);
        }
        c.wait_blocks_free().await;
    });
}

#[test]
fn a_node_with_another_model_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["decode"], &[]);
    let other = std::env::temp_dir().join(format!("cleave-test-other-model-{}", std::process::id()));
    let out = Command::new(exe())
        .args(["make-model", "--preset", "tiny", "--out", other.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = match c.node("intruder", "decode", Some(&other)) {
        Ok(p) => panic!("{} was accepted", p.name),
        Err(e) => e,
    };
    assert!(err.contains("fingerprint"), "{err}");
    runtime().block_on(async { assert_eq!(c.nodes_state().await.len(), 1) });
    let _ = std::fs::remove_dir_all(&other);
}

/// A cluster whose nodes keep their KV cache in bf16 (`--kv-cache-dtype bf16`): every prompt,
/// prefilled on the prefill node and handed off in bf16 (half of f32's bytes: 256 a token for
/// the tiny model), gives the text of `cleave generate --kv-cache-dtype bf16`; a node with
/// another dtype is refused at registration, saying so.
#[test]
fn a_bf16_kv_cache_cluster_matches_generate_and_refuses_another_dtype() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bf16 = ["--kv-cache-dtype", "bf16"];
    let c = TestCluster::start_with(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "0"], &bf16);
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let mut prompt_tokens = 0;
        for case in golden() {
            let prompt = case["prompt"].as_str().unwrap();
            let want = generate_text_with(&tiny_llama(), prompt, 32, &bf16);
            let v = c.complete(greedy(prompt, 32)).await;
            assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "case {}", case["name"]);
            prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
            let (text, _) = c.stream(greedy(prompt, 32)).await;
            assert_eq!(text, want, "streamed case {}", case["name"]);
            prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
        }
        // Every request was handed off (reports may trail the responses: wait for them).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let want = 2.0 * golden().len() as f64;
        while metric(&c, "cleave_handoff_transfer_bytes_count").await < want {
            assert!(std::time::Instant::now() < deadline, "handoff reports missing");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // 2 layers x K and V x 2 heads x 16 x 2 bytes, for every token the decode node lacked
        // (each prompt went twice: the second time its full blocks were in the decode node's
        // prefix cache, and stayed there).
        let dm = reqwest::get(format!("http://{}/metrics", c.nodes[1].ready["metrics"])).await.unwrap();
        let cached = sample(&dm.text().await.unwrap(), "cleave_node_handoff_cached_tokens_total", &[]);
        assert!(cached >= 16.0, "a repeated prompt found none of its blocks on the decode node");
        let sent = metric(&c, "cleave_handoff_transfer_bytes_sum").await;
        assert_eq!(sent, (prompt_tokens as f64 - cached) * 256.0);
        c.wait_blocks_free().await;
    });
    for (dtype, extra) in [("f32", &[][..]), ("f16", &["--kv-cache-dtype", "f16"][..])] {
        let err = match c.node_with("intruder", "decode", None, extra) {
            Ok(p) => panic!("{} with a {dtype} cache was accepted", p.name),
            Err(e) => e,
        };
        assert!(err.contains("kv cache dtype") && err.contains("--kv-cache-dtype"), "{dtype}: {err}");
    }
    runtime().block_on(async { assert_eq!(c.nodes_state().await.len(), 2) });
}

/// One model in two formats in one cluster: the prefill node holds SmolLM2's weights in f32
/// (`--dequantize-weights`: GEMM throughput rules prefill), the decode node in the GGUF's Q4_1
/// (bytes rule decode). Both register with the model's identity (which the coordinator read
/// without loading weights); `/admin/nodes` shows each node's format and weights fingerprint;
/// greedy text through the OpenAI API equals `cleave generate --prefill-dequantize-weights`
/// (the same two formats, handed off in one process).
#[test]
fn a_prefill_node_in_f32_and_a_decode_node_in_q4_serve_one_model() {
    let Some(gguf) = smollm2() else { return };
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start_nodes(
        &gguf,
        &[("prefill", &["--dequantize-weights"]), ("decode", &[])],
        &["--local-prefill-max-tokens", "0"],
    );
    let prompts = ["The capital of France is", "Here is a short poem about the sea:"];
    let want: Vec<String> = prompts
        .iter()
        .map(|p| generate_text_with(&gguf, p, 24, &["--prefill-dequantize-weights", "--threads", "1"]))
        .collect();
    assert!(want[0].contains("Paris"), "{}", want[0]);
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let nodes = c.nodes_state().await;
        let format = |name: &str| {
            let n = nodes.iter().find(|n| n["name"] == name).unwrap();
            (n["weights"]["format"].as_str().unwrap().to_string(), n["weights"]["fingerprint"].clone())
        };
        let ((pf, pfp), (df, dfp)) = (format("node-0"), format("node-1"));
        assert_eq!(pf, "f32", "{nodes:?}");
        assert!(df.starts_with("Q4_1"), "{nodes:?}");
        assert!(pfp.as_str().unwrap().len() == 16 && dfp.as_str().unwrap().len() == 16, "{nodes:?}");
        let model = gguf.file_stem().unwrap().to_str().unwrap();
        for (prompt, want) in prompts.iter().zip(&want) {
            let mut body = greedy(prompt, 24);
            body["model"] = json!(model);
            let v = c.complete(body).await;
            assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "{prompt}");
        }
        let m = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
        assert!(sample(&m, "cleave_route_decisions_total", &[("path", "remote")]) >= 2.0, "{m}");
        c.wait_blocks_free().await;
    });
}

/// The text `cleave generate` (one process, no cluster) produces greedily.
fn generate_text(model: &Path, prompt: &str, max_tokens: u32) -> String {
    generate_text_with(model, prompt, max_tokens, &[])
}

/// [`generate_text`] with `extra` arguments.
fn generate_text_with(model: &Path, prompt: &str, max_tokens: u32, extra: &[&str]) -> String {
    let out = Command::new(exe())
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", prompt, "--ignore-eos"])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = String::from_utf8(out.stdout).unwrap();
    s.strip_suffix('\n').unwrap_or(&s).to_string()
}

async fn metric(c: &TestCluster, prefix: &str) -> f64 {
    let m = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
    m.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

/// Streams a completion; after its `kill_at`-th event kills the node at `c.nodes[1]` (SIGKILL).
/// Returns the text, the finish reason and whether the kill happened.
async fn stream_killing(c: &mut TestCluster, body: &Value, kill_at: usize) -> (String, String, bool) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = c.client.post(format!("{}/v1/completions", c.http)).json(&body).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    // Kill the node the router chose (its loads may differ from what the test expects).
    let route = r.headers().get("x-cleave-route").expect("a streamed response names its route").to_str().unwrap();
    let decode = route.split("; ").find_map(|p| p.strip_prefix("decode=")).expect(route).to_string();
    let mut bytes = r.bytes_stream();
    let (mut buf, mut text, mut finish, mut events) = (String::new(), String::new(), String::new(), 0);
    let mut killed = false;
    while let Some(chunk) = bytes.next().await {
        buf.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            let Some(data) = sse_data(&event) else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(&data).unwrap();
            assert!(v.get("error").is_none(), "stream error: {v}");
            let ch = &v["choices"][0];
            text.push_str(ch["text"].as_str().unwrap_or(""));
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = f.to_string();
            }
            events += 1;
            if events == kill_at && !killed {
                killed = true;
                let i = c.nodes.iter().position(|n| n.ready.get("name") == Some(&decode)).expect(&decode);
                drop(c.nodes.remove(i)); // SIGKILL
            }
        }
    }
    (text, finish, killed)
}

#[test]
fn killing_a_decode_node_mid_stream_migrates_the_stream() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = "Once upon a time, in a land far away, there lived a";
    let max_tokens = 400;
    let want = generate_text(&tiny_llama(), prompt, max_tokens);
    let mut c =
        TestCluster::start(&tiny_llama(), &["prefill", "decode", "decode"], &["--local-prefill-max-tokens", "0"]);
    let rt = runtime();
    rt.block_on(async {
        c.wait_nodes(3).await;
        let (text, finish, killed) = stream_killing(&mut c, &greedy(prompt, max_tokens), 5).await;
        assert!(killed, "the stream ended before the kill");
        assert_eq!(finish, "length");
        assert_eq!(text, want, "the migrated stream differs from a single process");
        assert!(metric(&c, "cleave_migrations_total").await >= 1.0, "no migration recorded");
        let tpot = "cleave_time_per_output_token_seconds_count{pool=\"decode\",path=\"migrated\",";
        assert_eq!(metric(&c, tpot).await, 1.0, "the stream's TPOT is filed under its migration");
        c.wait_nodes(2).await;
        c.wait_blocks_free().await;
    });
}

/// A sampled request under a JSON Schema: handed off from the prefill node to a decode node,
/// and then again with that decode node killed mid-stream. Both times the text is what one
/// process generates with the same seed and schema (`cleave generate --json-schema`), and it
/// validates: the prefill node sampled the first token under the constraint, the decode node
/// rebuilt the constraint from it, and the node the stream migrated to rebuilt it from every
/// token sent so far.
#[test]
fn a_constrained_stream_keeps_its_constraint_across_the_handoff_and_a_migration() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let schema = json!({"type": "object", "properties": {
        "words": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 80, "maxItems": 80},
        "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["words", "n"], "additionalProperties": false});
    let file = std::env::temp_dir().join(format!("cleave-schema-{}.json", std::process::id()));
    std::fs::write(&file, schema.to_string()).unwrap();
    let prompt = "A list of words:";
    let (seed, max_tokens) = (11u64, 900u32);
    let out = Command::new(exe())
        .args(["generate", "--model", tiny_llama().to_str().unwrap(), "--prompt", prompt, "--temperature", "1"])
        .args(["--seed", &seed.to_string(), "--max-tokens", &max_tokens.to_string()])
        .arg("--json-schema")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = String::from_utf8(out.stdout).unwrap().trim_end_matches('\n').to_string();
    let v: Value = serde_json::from_str(&want).unwrap_or_else(|e| panic!("{want:?}: {e}"));
    assert_eq!(v["words"].as_array().map(Vec::len), Some(80), "{v}");
    let body = json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
        "seed": seed, "response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": schema}}});
    let mut c =
        TestCluster::start(&tiny_llama(), &["prefill", "decode", "decode"], &["--local-prefill-max-tokens", "0"]);
    runtime().block_on(async {
        c.wait_nodes(3).await;
        let r: Value =
            c.client.post(format!("{}/v1/completions", c.http)).json(&body).send().await.unwrap().json().await.unwrap();
        assert_eq!(r["choices"][0]["text"].as_str(), Some(want.as_str()), "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let (text, finish, killed) = stream_killing(&mut c, &body, 5).await;
        assert!(killed, "the stream ended before the kill");
        assert_eq!((text.as_str(), finish.as_str()), (want.as_str(), "stop"), "the migrated stream differs");
        assert!(metric(&c, "cleave_migrations_total").await >= 1.0, "no migration recorded");
        c.wait_nodes(2).await;
        c.wait_blocks_free().await;
    });
}

#[test]
fn killing_a_prefill_node_leaves_no_request_hanging() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "0"]);
    let rt = runtime();
    rt.block_on(async {
        c.wait_nodes(2).await;
        let cases = golden();
        let reqs: Vec<_> = (0..12)
            .map(|i| {
                let case = cases[i % cases.len()].clone();
                let client = c.client.clone();
                let url = format!("{}/v1/completions", c.http);
                tokio::spawn(async move {
                    let r = client.post(url).json(&greedy(case["prompt"].as_str().unwrap(), 32)).send().await.unwrap();
                    let v: Value = r.json().await.unwrap();
                    (case["text_incremental"].as_str().unwrap().to_string(), v)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(c.nodes.remove(0)); // SIGKILL the prefill node while requests are in flight
        for r in reqs {
            let (want, v) = tokio::time::timeout(Duration::from_secs(60), r).await.expect("a request hung").unwrap();
            assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{v}");
        }
        // The cluster keeps serving (prefill on the decode node now).
        c.wait_nodes(1).await;
        let v = c.complete(greedy("After the prefill node died", 8)).await;
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        c.wait_blocks_free().await;
    });
}

#[test]
fn the_official_openai_client_streams_completions_and_chat() {
    let has_openai = Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    if !available(has_openai, "CLEAVE_REQUIRE_OPENAI", "python3 cannot import openai", "pip install openai") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens", "0"]);
    runtime().block_on(c.wait_nodes(2));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new("python3").arg(script).arg(format!("{}/v1", c.http)).arg("tiny-llama").output().unwrap();
    assert!(
        out.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Node identities mean something: a certificate names the roles its holder may take, and the
/// coordinator refuses a registration outside them (and a switch to a role outside them); a
/// revoked certificate is refused at its next registration without a restart; a node takes
/// requests only from the coordinator's certificate, not from another member of the cluster.
#[test]
fn certificates_bind_roles_and_revocation_takes_effect_without_a_restart() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let revoked = std::env::temp_dir().join(format!("cleave-revoked-{}", std::process::id()));
    std::fs::write(&revoked, "# revoked node certificates\n").unwrap();
    let c = TestCluster::start(&tiny_llama(), &["both"], &["--revoked-certs", revoked.to_str().unwrap()]);
    let rt = runtime();
    rt.block_on(c.wait_nodes(1));
    let certs = |name: &str, roles: &str| {
        let dir = c.certs.to_str().unwrap();
        let out =
            Command::new(exe()).args(["certs", "--dir", dir, "--nodes", name, "--roles", roles]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    // A prefill-only certificate may not register as a decode node, but may as a prefill node.
    certs("pin-0", "prefill");
    let e = c.node("pin-0", "decode", None).err().expect("a prefill-only certificate registered as decode");
    assert!(e.contains("certificate allows prefill"), "{e}");
    let pinned = c.node("pin-0", "prefill", None).unwrap();
    rt.block_on(c.wait_nodes(2));
    let id = rt.block_on(c.nodes_state()).iter().find(|n| n["name"] == "pin-0").unwrap()["id"].as_u64().unwrap();
    let r = rt.block_on(async {
        c.client
            .post(format!("{}/admin/nodes/{id}/role", c.http))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"role": "decode"}))
            .send()
            .await
            .unwrap()
    });
    assert_eq!(r.status(), 409, "a switch outside the certificate's roles was accepted");
    // Another member of the cluster (a node's certificate) cannot make a node work for it.
    let rpc: std::net::SocketAddr = pinned.ready["rpc"].parse().unwrap();
    rt.block_on(async {
        use cleave_protocol::control::{read_msg, write_msg, ControlMsg, PrefillRequest, Work};
        let id = cleave_net::tls::NodeIdentity::load(&c.certs, "pin-0").unwrap();
        let connector =
            cleave_net::Connector::new(&cleave_net::NetConfig::new(cleave_net::NetKind::Quic, Some(id))).unwrap();
        let mut s = connector.open(rpc).await.unwrap();
        let work = Work {
            id: cleave_protocol::RequestId(7),
            prompt: vec![1, 2, 3],
            params: Default::default(),
            stop: cleave_protocol::StopConditions { max_tokens: 2, ..Default::default() },
        };
        write_msg(&mut s.send, &ControlMsg::PrefillRequest(PrefillRequest { work, ticket: None })).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(20), read_msg(&mut s.recv)).await.expect("no answer");
        assert!(!matches!(answer, Ok(Some(ControlMsg::Token(_)))), "a node served a non-coordinator: {answer:?}");
    });
    // Revocation: listed by fingerprint, refused at the next registration, no restart.
    certs("rev-0", "node");
    let out = Command::new(exe())
        .args(["certs", "--dir", c.certs.to_str().unwrap(), "--fingerprint", "rev-0"])
        .output()
        .unwrap();
    let line = String::from_utf8(out.stdout).unwrap();
    let fp = line.split_whitespace().next().unwrap().to_string();
    assert_eq!(fp.len(), 64, "{line}");
    std::fs::write(&revoked, format!("# revoked node certificates\n{fp}  # rev-0, lost laptop\n")).unwrap();
    let e = c.node("rev-0", "decode", None).err().expect("a revoked certificate registered");
    assert!(e.contains("revoked"), "{e}");
    // The cluster still serves.
    let v = rt.block_on(c.complete(greedy("Still serving", 4)));
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let _ = std::fs::remove_file(&revoked);
}
