//! The whole system as processes: `cleave coordinator` and `cleave node` children talking QUIC
//! with mutual TLS on loopback, driven through the OpenAI HTTP API with a real HTTP client.
//!
//! References: greedy text from `cleave generate` (single process) and golden text from
//! Hugging Face transformers (tiny-llama's golden.json).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

/// Cluster tests start several processes each; on a 2-core machine they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const WAIT: Duration = Duration::from_secs(120);

fn shared_dir() -> PathBuf {
    std::env::var_os("CLEAVE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared"))
}

fn tiny_llama() -> PathBuf {
    shared_dir().join("models/tiny-llama")
}

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_cleave")
}

/// A child process that announced itself with a `READY k=v ...` line. Killed on drop.
struct Proc {
    name: String,
    child: Child,
    ready: HashMap<String, String>,
    _stdin: Option<ChildStdin>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn start(name: &str, args: &[String]) -> Result<Proc, String> {
        let mut child = Command::new(exe())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {name}: {e}"))?;
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("READY ") {
                    let kv: HashMap<String, String> = rest
                        .split_whitespace()
                        .filter_map(|w| w.split_once('='))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect();
                    let _ = tx.send(kv);
                }
            }
        });
        let tag = name.to_string();
        let errlog = std::sync::Arc::new(Mutex::new(String::new()));
        let sink = errlog.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[{tag}] {line}");
                sink.lock().unwrap().push_str(&line);
                sink.lock().unwrap().push('\n');
            }
        });
        let stdin = child.stdin.take();
        let mut p = Proc { name: name.into(), child, ready: HashMap::new(), _stdin: stdin };
        let deadline = Instant::now() + WAIT;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(kv) => {
                    p.ready = kv;
                    return Ok(p);
                }
                Err(_) if Instant::now() > deadline => return Err(format!("{name} not ready in time")),
                Err(_) => {
                    if let Ok(Some(status)) = p.child.try_wait() {
                        // Let the stderr thread drain.
                        std::thread::sleep(Duration::from_millis(200));
                        return Err(format!("{name} exited ({status}): {}", errlog.lock().unwrap()));
                    }
                }
            }
        }
    }
}

struct TestCluster {
    http: String,
    cluster: String,
    certs: PathBuf,
    model: PathBuf,
    /// Held so that the process lives as long as the cluster (killed on drop).
    _coordinator: Proc,
    nodes: Vec<Proc>,
    client: reqwest::Client,
}

fn certs_dir(names: &[String]) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "cleave-test-certs-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let out = Command::new(exe())
        .args(["certs", "--dir", dir.to_str().unwrap(), "--nodes", &names.join(",")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

impl TestCluster {
    /// `roles`: "prefill", "decode" or "both" per node.
    fn start(model: &Path, roles: &[&str], coordinator_args: &[&str]) -> TestCluster {
        let mut names: Vec<String> = vec!["coordinator".into()];
        names.extend((0..roles.len()).map(|i| format!("node-{i}")));
        names.push("intruder".into());
        let certs = certs_dir(&names);
        let mut args: Vec<String> = [
            "coordinator",
            "--model",
            model.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--cluster-listen",
            "127.0.0.1:0",
            "--name",
            "coordinator",
            "--certs",
            certs.to_str().unwrap(),
            "--exit-with-parent",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(coordinator_args.iter().map(|s| s.to_string()));
        let coordinator = Proc::start("coordinator", &args).unwrap();
        let http = format!("http://{}", coordinator.ready["http"]);
        let cluster = coordinator.ready["cluster"].clone();
        let mut c = TestCluster {
            http,
            cluster,
            certs,
            model: model.to_path_buf(),
            _coordinator: coordinator,
            nodes: Vec::new(),
            client: reqwest::Client::builder().timeout(WAIT).build().unwrap(),
        };
        for (i, role) in roles.iter().enumerate() {
            let p = c.node(&format!("node-{i}"), role, None).unwrap();
            c.nodes.push(p);
        }
        c
    }

    fn node(&self, name: &str, role: &str, model: Option<&Path>) -> Result<Proc, String> {
        let model = model.unwrap_or(&self.model);
        let args: Vec<String> = [
            "node",
            "--role",
            role,
            "--model",
            model.to_str().unwrap(),
            "--coordinator",
            &self.cluster,
            "--name",
            name,
            "--certs",
            self.certs.to_str().unwrap(),
            "--threads",
            "1",
            "--kv-cache-memory",
            "64m",
            "--exit-with-parent",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Proc::start(name, &args)
    }

    async fn complete(&self, body: Value) -> Value {
        let r = self.client.post(format!("{}/v1/completions", self.http)).json(&body).send().await.unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{status}: {v}");
        v
    }

    /// Streams a completion; returns the concatenated text and the finish reason.
    async fn stream(&self, mut body: Value) -> (String, String) {
        body["stream"] = json!(true);
        let r = self.client.post(format!("{}/v1/completions", self.http)).json(&body).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        let mut text = String::new();
        let mut finish = String::new();
        let mut buf = String::new();
        let mut done = false;
        let mut bytes = r.bytes_stream();
        while let Some(chunk) = bytes.next().await {
            buf.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
            while let Some(i) = buf.find("\n\n") {
                let event: String = buf.drain(..i + 2).collect();
                let Some(data) = sse_data(&event) else { continue };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(&data).unwrap();
                assert!(v.get("error").is_none(), "stream error: {v}");
                for c in v["choices"].as_array().unwrap() {
                    text.push_str(c["text"].as_str().unwrap_or(""));
                    if let Some(f) = c["finish_reason"].as_str() {
                        finish = f.to_string();
                    }
                }
            }
        }
        assert!(done, "stream ended without [DONE]");
        (text, finish)
    }

    async fn nodes_state(&self) -> Vec<Value> {
        let v: Value =
            self.client.get(format!("{}/admin/nodes", self.http)).send().await.unwrap().json().await.unwrap();
        v["nodes"].as_array().unwrap().clone()
    }

    /// Waits (bounded) until `n` nodes are registered.
    async fn wait_nodes(&self, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.nodes_state().await.len() != n {
            assert!(Instant::now() < deadline, "expected {n} nodes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (bounded) until every node reports no KV block in use.
    async fn wait_blocks_free(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let nodes = self.nodes_state().await;
            let in_use: Vec<(String, u64)> = nodes
                .iter()
                .map(|n| {
                    let l = &n["load"];
                    let used = l["total_blocks"].as_u64().unwrap()
                        - l["free_blocks"].as_u64().unwrap()
                        - l["cached_blocks"].as_u64().unwrap();
                    (n["name"].as_str().unwrap().to_string(), used)
                })
                .collect();
            if in_use.iter().all(|(_, u)| *u == 0) {
                return;
            }
            assert!(Instant::now() < deadline, "KV blocks still in use: {in_use:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.certs);
    }
}

/// The data of one SSE event; `None` for a comment (keep-alive).
fn sse_data(event: &str) -> Option<String> {
    let mut data = None;
    for line in event.lines() {
        if line.starts_with(':') || line.is_empty() {
            continue;
        }
        let d = line.strip_prefix("data: ").unwrap_or_else(|| panic!("unexpected SSE line {line:?}"));
        data = Some(d.to_string());
    }
    data
}

fn golden() -> Vec<Value> {
    let text = std::fs::read_to_string(tiny_llama().join("golden.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().iter().filter(|c| c["name"] != "chat").cloned().collect()
}

fn greedy(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// Every golden case through the cluster, streamed and not: equal to transformers' text.
async fn check_golden(c: &TestCluster) {
    c.wait_nodes(c.nodes.len()).await;
    for case in golden() {
        let prompt = case["prompt"].as_str().unwrap();
        let want = case["text_incremental"].as_str().unwrap();
        let v = c.complete(greedy(prompt, 32)).await;
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "case {}", case["name"]);
        assert_eq!(v["usage"]["completion_tokens"], 32);
        let (text, finish) = c.stream(greedy(prompt, 32)).await;
        assert_eq!(text, want, "streamed case {}", case["name"]);
        assert_eq!(finish, "length");
    }
    c.wait_blocks_free().await;
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

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

/// The text `cleave generate` (one process, no cluster) produces greedily.
fn generate_text(model: &Path, prompt: &str, max_tokens: u32) -> String {
    let out = Command::new(exe())
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", prompt, "--ignore-eos"])
        .args(["--max-tokens", &max_tokens.to_string()])
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

#[test]
fn killing_a_decode_node_mid_stream_migrates_the_stream() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = "Once upon a time, in a land far away, there lived a";
    let max_tokens = 400;
    let want = generate_text(&tiny_llama(), prompt, max_tokens);
    // Two idle decode nodes with equal loads: the registry picks the first registered (node-1).
    let mut c =
        TestCluster::start(&tiny_llama(), &["prefill", "decode", "decode"], &["--local-prefill-max-tokens", "0"]);
    let rt = runtime();
    rt.block_on(async {
        c.wait_nodes(3).await;
        let mut body = greedy(prompt, max_tokens);
        body["stream"] = json!(true);
        let r = c.client.post(format!("{}/v1/completions", c.http)).json(&body).send().await.unwrap();
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
                if events == 5 && !killed {
                    killed = true;
                    let victim = c.nodes.remove(1);
                    assert_eq!(victim.ready.get("name").map(String::as_str), Some("node-1"));
                    drop(victim); // SIGKILL
                }
            }
        }
        assert!(killed, "the stream ended before the kill");
        assert_eq!(finish, "length");
        assert_eq!(text, want, "the migrated stream differs from a single process");
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
    if !has_openai {
        assert!(
            std::env::var_os("CLEAVE_REQUIRE_OPENAI").is_none(),
            "CLEAVE_REQUIRE_OPENAI is set but `import openai` fails"
        );
        eprintln!("SKIPPED the_official_openai_client_streams_completions_and_chat: python3 cannot import openai (pip install openai)");
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
