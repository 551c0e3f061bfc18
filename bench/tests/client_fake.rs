//! `run_benchmark` end to end against a scripted OpenAI-style server on port 0: the request body,
//! usage-based token counts, ITLs, and every error kind counted without aborting the run.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cleave_bench::metrics::ErrorKind;
use cleave_bench::serve::{run_benchmark, DatasetName, ServeArgs};
use cleave_tokenizer::Tokenizer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

type Seen = Arc<Mutex<Vec<(String, serde_json::Value)>>>;

/// Reads one HTTP/1.1 request: (request line, headers lowercased, body).
async fn read_request(s: &mut TcpStream) -> Option<(String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let len: usize =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap_or(0));
    while buf.len() < head_end + len {
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let line = head.lines().next().unwrap_or_default().to_string();
    Some((line, head, buf[head_end..head_end + len].to_vec()))
}

fn chunk(text: &str, finish: Option<&str>) -> String {
    let v = serde_json::json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}]});
    format!("data: {v}\n\n")
}

async fn serve_one(mut s: TcpStream, seen: Seen) {
    let Some((line, head, body)) = read_request(&mut s).await else { return };
    if line.starts_with("get /v1/models") {
        let b = r#"{"object":"list","data":[{"id":"fake-model","object":"model"}]}"#;
        let r = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{b}",
            b.len()
        );
        let _ = s.write_all(r.as_bytes()).await;
        return;
    }
    let req: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let auth = head.lines().find_map(|l| l.strip_prefix("authorization:")).unwrap_or("").trim().to_string();
    seen.lock().unwrap().push((auth, req.clone()));
    let prompt = req["prompt"].as_str().unwrap_or_default();
    let sse_head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    if prompt.contains("servererror") {
        let _ = s
            .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\nconnection: close\r\n\r\noops")
            .await;
    } else if prompt.contains("cutshort") {
        let _ = s.write_all(format!("{sse_head}{}", chunk("a", None)).as_bytes()).await;
    } else if prompt.contains("hangforever") {
        let _ = s.write_all(sse_head.as_bytes()).await;
        // Holds the connection open; the client's --request-timeout ends the request.
        std::future::pending::<()>().await;
    } else {
        // Three text chunks, written separately, then usage (7 tokens: the server's count wins).
        let _ = s.write_all(sse_head.as_bytes()).await;
        for part in [chunk("Hello", None), chunk(" wor", None), chunk("ld", Some("length"))] {
            let _ = s.write_all(part.as_bytes()).await;
            let _ = s.flush().await;
        }
        let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7,"total_tokens":16}}"#;
        let _ = s.write_all(format!("{usage}\n\ndata: [DONE]\n\n").as_bytes()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_by_kind_and_usage_counts_tokens() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(serve_one(s, seen2.clone()));
        }
    });

    let dir = tempfile::tempdir().unwrap();
    let answer = "a fairly long answer with more than four tokens in it";
    let convs: Vec<serde_json::Value> = [
        "okay please answer",
        "servererror please answer",
        "cutshort please answer",
        "hangforever please answer",
    ]
    .iter()
    .map(|p| serde_json::json!({"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": answer}]}))
    .collect();
    let data = dir.path().join("sg.json");
    std::fs::write(&data, serde_json::to_string(&convs).unwrap()).unwrap();

    let tok = Tokenizer::from_model_dir(testdata_dir().join("tiny-llama")).unwrap();
    let mut args = ServeArgs::default();
    args.base_url = Some(format!("http://{addr}/"));
    args.dataset_name = DatasetName::Sharegpt;
    args.dataset_path = Some(data);
    args.sharegpt_output_len = Some(5);
    args.num_prompts = Some(4);
    args.max_concurrency = Some(2);
    args.api_key = Some("sekrit".into());
    args.request_timeout = 0.5;
    args.goodput = vec!["e2el:100000".into()];
    args.disable_tqdm = true;
    let out = run_benchmark(&args, &tok).await.unwrap();

    let s = &out.summary;
    assert_eq!((s.completed, s.failed), (1, 3), "{:?}", out.records);
    assert_eq!(s.errors_by_kind, vec![(ErrorKind::Http5xx, 1), (ErrorKind::Timeout, 1), (ErrorKind::Truncated, 1)]);
    let ok = out.records.iter().find(|r| r.success).unwrap();
    assert_eq!(ok.generated_text, "Hello world");
    assert_eq!(ok.output_tokens, 7);
    assert_eq!(ok.itls_s.len(), 2);
    let (ttft, e2el) = (ok.ttft_s.unwrap(), ok.e2el_s.unwrap());
    assert!(ttft <= e2el);
    assert!((ok.tpot_s.unwrap() - (e2el - ttft) / 6.0).abs() < 1e-12);
    assert_eq!(s.request_goodput, Some(1.0 / s.duration_s));
    assert_eq!(s.slo_attainment, Some(0.25));
    assert_eq!(out.info.model_id, "fake-model", "the model comes from /v1/models");

    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 4);
    for (auth, body) in seen.iter() {
        assert_eq!(auth, "bearer sekrit");
        assert_eq!(body["model"], "fake-model");
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["temperature"], 0.0);
    }
}

#[tokio::test]
async fn connection_refused_is_a_connection_error() {
    // Bind then drop: nothing listens on this port during the run.
    let addr = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let tok = Tokenizer::from_model_dir(testdata_dir().join("tiny-llama")).unwrap();
    let mut args = ServeArgs::default();
    args.base_url = Some(format!("http://{addr}"));
    args.model = Some("m".into());
    args.num_prompts = Some(2);
    args.random_input_len = 8;
    args.random_output_len = 2;
    args.disable_tqdm = true;
    let out = run_benchmark(&args, &tok).await.unwrap();
    assert_eq!(out.summary.failed, 2);
    assert_eq!(out.summary.errors_by_kind, vec![(ErrorKind::Connection, 2)]);
}

/// A server that holds each request until two are in flight or `total` have arrived (or 2 s
/// pass), recording the most it ever saw at once.
async fn gated_server(total: usize) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let inflight = Arc::new(tokio::sync::watch::channel((0usize, 0usize)).0);
    let max = Arc::new(AtomicUsize::new(0));
    let max2 = max.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (inflight, max) = (inflight.clone(), max2.clone());
            tokio::spawn(async move {
                if read_request(&mut s).await.is_none() {
                    return;
                }
                inflight.send_modify(|(n, seen)| {
                    *n += 1;
                    *seen += 1;
                });
                max.fetch_max(inflight.borrow().0, Ordering::SeqCst);
                let mut rx = inflight.subscribe();
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    rx.wait_for(|(n, seen)| *n >= 2 || *seen >= total),
                )
                .await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
                let body = format!("{head}{}data: [DONE]\n\n", chunk("x", Some("length")));
                inflight.send_modify(|(n, _)| *n -= 1);
                let _ = s.write_all(body.as_bytes()).await;
            });
        }
    });
    (addr, max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrency_caps_requests_in_flight() {
    let (addr, max) = gated_server(6).await;
    let tok = Tokenizer::from_model_dir(testdata_dir().join("tiny-llama")).unwrap();
    let mut args = ServeArgs::default();
    args.base_url = Some(format!("http://{addr}"));
    args.model = Some("m".into());
    args.num_prompts = Some(6);
    args.max_concurrency = Some(2);
    args.random_input_len = 8;
    args.random_output_len = 1;
    args.disable_tqdm = true;
    let out = run_benchmark(&args, &tok).await.unwrap();
    assert_eq!(out.summary.completed, 6, "{:?}", out.records);
    // All six arrive at offset 0 (rate inf): only the cap keeps the server at two.
    assert_eq!(max.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(out.records.iter().all(|r| r.tpot_s.is_none() && r.output_tokens == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_endpoint_sends_one_user_message_and_reads_deltas() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen2.clone();
            tokio::spawn(async move {
                let Some((line, _, body)) = read_request(&mut s).await else { return };
                seen.lock().unwrap().push((line, serde_json::from_slice(&body).unwrap_or_default()));
                let mut out =
                    String::from("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n");
                for d in [r#"{"role":"assistant"}"#, r#"{"content":"Hi"}"#, r#"{"content":" there"}"#] {
                    out.push_str(&format!(
                        "data: {{\"choices\":[{{\"index\":0,\"delta\":{d},\"finish_reason\":null}}]}}\n\n"
                    ));
                }
                out.push_str(
                    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n",
                );
                let _ = s.write_all(out.as_bytes()).await;
            });
        }
    });
    let tok = Tokenizer::from_model_dir(testdata_dir().join("tiny-llama")).unwrap();
    let mut args = ServeArgs::default();
    args.base_url = Some(format!("http://{addr}"));
    args.endpoint = "/v1/chat/completions".into();
    args.model = Some("m".into());
    args.num_prompts = Some(1);
    args.random_input_len = 8;
    args.random_output_len = 2;
    args.no_ignore_eos = true;
    args.disable_tqdm = true;
    let out = run_benchmark(&args, &tok).await.unwrap();
    let r = &out.records[0];
    assert!(r.success, "{r:?}");
    // No usage chunk: the two content deltas are the tokens (the role-only delta is not).
    assert_eq!((r.output_tokens, r.generated_text.as_str(), r.itls_s.len()), (2, "Hi there", 1));
    let seen = seen.lock().unwrap();
    let (line, body) = &seen[0];
    assert!(line.starts_with("post /v1/chat/completions"), "{line}");
    assert_eq!(body["messages"].as_array().unwrap().len(), 1);
    assert_eq!(body["messages"][0]["role"], "user");
    assert!(body["messages"][0]["content"].as_str().unwrap().len() > 4);
    assert!(body.get("prompt").is_none());
    assert_eq!(body["ignore_eos"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_with_duration_stops_sending_at_the_end() {
    // Each answer takes 2 ms, so that 0.3 s hold at most ~150 requests whatever the machine's
    // speed (an instant server answered all 5000 within the duration on a fast machine).
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_request(&mut s).await.is_none() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
                let body = format!("{head}{}data: [DONE]\n\n", chunk("x", Some("length")));
                let _ = s.write_all(body.as_bytes()).await;
            });
        }
    });
    let tok = Tokenizer::from_model_dir(testdata_dir().join("tiny-llama")).unwrap();
    let mut args = ServeArgs::default();
    args.base_url = Some(format!("http://{addr}"));
    args.model = Some("m".into());
    args.max_concurrency = Some(1);
    args.duration = Some(0.3);
    args.num_prompts = Some(5_000);
    args.random_input_len = 4;
    args.random_output_len = 1;
    args.disable_tqdm = true;
    let out = run_benchmark(&args, &tok).await.unwrap();
    let n = out.records.len();
    assert!((1..5_000).contains(&n), "{n} requests");
    for r in &out.records {
        assert!(r.start_s < 0.3, "request {} started at {:.4} s, after the 0.3 s duration", r.index, r.start_s);
        assert!(r.success, "{r:?}");
    }
    // Sequential: each request starts after the previous one ended.
    for w in out.records.windows(2) {
        assert!(w[1].start_s >= w[0].start_s + w[0].e2el_s.unwrap() - 1e-9);
    }
}
