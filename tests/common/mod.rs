//! What the process-level tests share: children that announce themselves with a `READY` line,
//! a cluster of `cleave coordinator` and `cleave node` processes on loopback, and the admin
//! and OpenAI calls the tests make.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub mod netns;
pub mod relay;

use futures::StreamExt;
use serde_json::{json, Value};

/// Cluster tests start several processes each; on a 2-core machine they run one at a time.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub const WAIT: Duration = Duration::from_secs(120);

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
pub fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

pub fn tiny_llama() -> PathBuf {
    testdata_dir().join("tiny-llama")
}

pub fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_cleave")
}

/// A child process that announced itself with a `READY k=v ...` line. Killed on drop.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub ready: HashMap<String, String>,
    pub stdin: Option<ChildStdin>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn start(name: &str, args: &[String]) -> Result<Proc, String> {
        let mut cmd = Command::new(exe());
        cmd.args(args);
        Self::start_cmd(name, cmd)
    }

    /// [`Proc::start`] inside network namespace `netns` (`ip netns exec` execs the command, so
    /// the child is cleave itself: killing it and `--exit-with-parent` work as outside).
    pub fn start_in(netns: &str, name: &str, args: &[String]) -> Result<Proc, String> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns, exe()]).args(args);
        Self::start_cmd(name, cmd)
    }

    fn start_cmd(name: &str, mut cmd: Command) -> Result<Proc, String> {
        let mut child = cmd
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
        let mut p = Proc { name: name.into(), child, ready: HashMap::new(), stdin };
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

pub struct TestCluster {
    pub http: String,
    pub cluster: String,
    pub certs: PathBuf,
    pub model: PathBuf,
    /// Held so that the process lives as long as the cluster (killed on drop).
    pub coordinator: Proc,
    pub nodes: Vec<Proc>,
    pub client: reqwest::Client,
}

/// The admin token every test coordinator runs with.
pub const ADMIN_TOKEN: &str = "test-admin-token";

pub fn certs_dir(names: &[String]) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "cleave-test-certs-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    // The coordinator's certificate allows the coordinator's role (nodes take requests from
    // it alone); every other name gets the node roles.
    let (coordinator, nodes): (Vec<&String>, Vec<&String>) = names.iter().partition(|n| *n == "coordinator");
    for (list, roles) in [(coordinator, "coordinator"), (nodes, "node")] {
        if list.is_empty() {
            continue;
        }
        let list: Vec<&str> = list.iter().map(|n| n.as_str()).collect();
        let out = Command::new(exe())
            .args(["certs", "--dir", dir.to_str().unwrap(), "--nodes", &list.join(","), "--roles", roles])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    dir
}

impl TestCluster {
    /// `roles`: "prefill", "decode" or "both" per node.
    pub fn start(model: &Path, roles: &[&str], coordinator_args: &[&str]) -> TestCluster {
        Self::start_with(model, roles, coordinator_args, &[])
    }

    /// [`TestCluster::start`] with `node_args` appended to every node's arguments.
    pub fn start_with(model: &Path, roles: &[&str], coordinator_args: &[&str], node_args: &[&str]) -> TestCluster {
        let nodes: Vec<(&str, &[&str])> = roles.iter().map(|&r| (r, node_args)).collect();
        Self::start_nodes(model, &nodes, coordinator_args)
    }

    /// A cluster whose node `i` (`node-{i}`) has role `nodes[i].0` and extra arguments
    /// `nodes[i].1`.
    pub fn start_nodes(model: &Path, nodes: &[(&str, &[&str])], coordinator_args: &[&str]) -> TestCluster {
        let mut names: Vec<String> = vec!["coordinator".into()];
        names.extend((0..nodes.len()).map(|i| format!("node-{i}")));
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
        args.extend(["--admin-token".to_string(), ADMIN_TOKEN.to_string()]);
        args.extend(coordinator_args.iter().map(|s| s.to_string()));
        let coordinator = Proc::start("coordinator", &args).unwrap();
        let http = format!("http://{}", coordinator.ready["http"]);
        let cluster = coordinator.ready["cluster"].clone();
        let mut c = TestCluster {
            http,
            cluster,
            certs,
            model: model.to_path_buf(),
            coordinator,
            nodes: Vec::new(),
            client: reqwest::Client::builder().timeout(WAIT).build().unwrap(),
        };
        for (i, (role, args)) in nodes.iter().enumerate() {
            let p = c.node_with(&format!("node-{i}"), role, None, args).unwrap();
            c.nodes.push(p);
        }
        c
    }

    pub fn node(&self, name: &str, role: &str, model: Option<&Path>) -> Result<Proc, String> {
        self.node_with(name, role, model, &[])
    }

    /// [`TestCluster::node`] with `extra` arguments last (a `--kv-cache-memory` among them
    /// replaces the default 64m).
    pub fn node_with(&self, name: &str, role: &str, model: Option<&Path>, extra: &[&str]) -> Result<Proc, String> {
        let model = model.unwrap_or(&self.model);
        let kv = if extra.contains(&"--kv-cache-memory") { &[][..] } else { &["--kv-cache-memory", "64m"][..] };
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
            "--exit-with-parent",
        ]
        .iter()
        .chain(kv)
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        Proc::start(name, &args)
    }

    pub async fn complete(&self, body: Value) -> Value {
        let r = self.client.post(format!("{}/v1/completions", self.http)).json(&body).send().await.unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{status}: {v}");
        v
    }

    /// Streams a completion; returns the concatenated text and the finish reason.
    pub async fn stream(&self, mut body: Value) -> (String, String) {
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

    pub async fn nodes_state(&self) -> Vec<Value> {
        let v: Value = self.admin(reqwest::Method::GET, "/admin/nodes", None).await;
        v["nodes"].as_array().unwrap().clone()
    }

    /// An admin call with the admin token; panics unless it succeeds.
    pub async fn admin(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.client.request(method, format!("{}{path}", self.http)).bearer_auth(ADMIN_TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert!(status.is_success(), "{path}: {status}: {v}");
        v
    }

    /// Waits (bounded) until `n` nodes are registered.
    pub async fn wait_nodes(&self, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.nodes_state().await.len() != n {
            assert!(Instant::now() < deadline, "expected {n} nodes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits (bounded) until every node reports no KV block in use.
    pub async fn wait_blocks_free(&self) {
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
pub fn sse_data(event: &str) -> Option<String> {
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

pub fn golden() -> Vec<Value> {
    let text = std::fs::read_to_string(tiny_llama().join("golden.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().iter().filter(|c| c["name"] != "chat").cloned().collect()
}

pub fn greedy(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// Every golden case through the cluster, streamed and not: equal to transformers' text.
pub async fn check_golden(c: &TestCluster) {
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

/// Background load until the returned flag is set: `workers` loops each sending completions one
/// after another, alternating a short prompt (prefilled on its decode node) and a long one, each
/// starting with a distinct number (so that prefix-cache overlap does not pin every request to
/// one node), a third of them streamed.
pub fn spawn_load(
    c: &TestCluster,
    workers: usize,
) -> (std::sync::Arc<std::sync::atomic::AtomicBool>, Vec<tokio::task::JoinHandle<()>>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let tasks = (0..workers)
        .map(|w| {
            let (client, url, stop) = (c.client.clone(), format!("{}/v1/completions", c.http), stop.clone());
            tokio::spawn(async move {
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let n = i * workers + w;
                    let prompt = if i.is_multiple_of(2) {
                        format!("{n} Hi")
                    } else {
                        format!("{n} Once upon a time, in a land far away, there lived a")
                    };
                    let body = json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                      "ignore_eos": true, "stream": n.is_multiple_of(3)});
                    if let Ok(r) = client.post(&url).json(&body).send().await {
                        let _ = r.bytes().await;
                    }
                    i += 1;
                }
            })
        })
        .collect();
    (stop, tasks)
}

/// Whether `bin --version` runs: a tool a test needs is installed.
pub fn have(bin: &str) -> bool {
    Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Whether a component a test needs (`what`) is here. When it is not, a failure if
/// `require_env` is set (CI installs it, and a test that skips there proves nothing), else a
/// SKIPPED line saying how to get it (`hint`) and `false`.
/// SmolLM2-135M-Instruct's Q4_1 GGUF (`CLEAVE_SMOLLM2_GGUF`, or models/smollm2/), when
/// present; a test skips without it unless `CLEAVE_REQUIRE_SMOLLM2` is set (CI sets it).
pub fn smollm2() -> Option<PathBuf> {
    let gguf = std::env::var_os("CLEAVE_SMOLLM2_GGUF").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    available(
        gguf.exists(),
        "CLEAVE_REQUIRE_SMOLLM2",
        "the SmolLM2 GGUF is missing",
        "scripts/peers/smollm2.sh models/smollm2",
    )
    .then_some(gguf)
}

pub fn available(present: bool, require_env: &str, what: &str, hint: &str) -> bool {
    if present {
        return true;
    }
    assert!(std::env::var_os(require_env).is_none(), "{require_env} is set but {what}");
    eprintln!("SKIPPED: {what} ({hint})");
    false
}

/// One node of each pool (prefill, decode, colocated), short prompts prefilled on their decode
/// node, and the planner in advise mode (it publishes targets, attainment, its saturation line and
/// its target sizes without moving anything): the cluster the observability tests watch.
pub fn three_pool_cluster() -> TestCluster {
    let args = ["--local-prefill-max-tokens", "6", "--planner", "advise", "--ttft-target-ms", "3000"];
    TestCluster::start(
        &tiny_llama(),
        &["prefill", "decode", "both"],
        &[&args[..], &["--tpot-target-ms", "100"]].concat(),
    )
}

/// A multi-threaded runtime for a test's async parts.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}
