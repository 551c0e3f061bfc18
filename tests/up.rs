//! `cleave up`, the README's first command, as a user runs it: it starts the whole system, serves
//! the same greedy text as `cleave generate`, and stops every process on SIGTERM.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

/// Kills `cleave up` if the test panics first, so a failing assertion never leaves a cluster
/// running (its nodes exit with it: they watch its stdin).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn up_serves_generate_s_text_and_stops_cleanly() {
    let model = testdata_dir().join("tiny-llama");
    let exe = env!("CARGO_BIN_EXE_cleave");
    let prompt = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find";
    let out = Command::new(exe)
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--ignore-eos",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let want = String::from_utf8(out.stdout).unwrap().trim_end_matches('\n').to_string();

    let mut up = Command::new(exe)
        .args(["up", "--model", model.to_str().unwrap(), "--port", "0", "--prefill", "1", "--decode", "1"])
        .args(["--kv-cache-memory", "64m", "--threads", "1", "--coordinator-arg=--local-prefill-max-tokens=0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = up.stdout.take().unwrap();
    let mut up = KillOnDrop(up);
    let up = &mut up.0;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split(" at http://").nth(1) {
                let _ = tx.send(rest.split("/v1").next().unwrap().to_string());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(120)).expect("cleave up did not print its URL");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let body = serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let v: serde_json::Value = rt.block_on(async {
        client.post(format!("http://{addr}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap()
    });
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{v}");
    let health = rt.block_on(async { client.get(format!("http://{addr}/health")).send().await.unwrap().status() });
    assert!(health.is_success(), "{health}");

    // SIGTERM: every process stops, the API goes away, `up` exits cleanly.
    let ok = Command::new("kill").args(["-TERM", &up.id().to_string()]).status().unwrap().success();
    assert!(ok);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "cleave up did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let gone = rt.block_on(async { client.get(format!("http://{addr}/health")).send().await.is_err() });
    assert!(gone, "the coordinator still answers after cleave up stopped");
}

/// Children of `pid` whose command line has `word` as its first argument.
fn children(pid: u32, word: &str) -> Vec<u32> {
    let out = Command::new("pgrep").args(["-P", &pid.to_string()]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            cmd.split(|b| *b == 0).nth(1) == Some(word.as_bytes())
        })
        .collect()
}

/// Starts `cleave up` on the tiny model with `args` (after the common ones) and waits for the URL
/// it prints; the process is killed on drop.
fn start_up(args: &[&str]) -> (KillOnDrop, String) {
    let (up, addr, _) = start_up_scheme(args);
    (up, addr)
}

/// [`start_up`], also saying whether it serves `http` or `https`.
fn start_up_scheme(args: &[&str]) -> (KillOnDrop, String, String) {
    let model = testdata_dir().join("tiny-llama");
    let mut up = Command::new(env!("CARGO_BIN_EXE_cleave"))
        .args(["up", "--model", model.to_str().unwrap(), "--port", "0", "--prefill", "1", "--decode", "1"])
        .args(["--kv-cache-memory", "64m", "--threads", "1"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = up.stdout.take().unwrap();
    let up = KillOnDrop(up);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            for scheme in ["http", "https"] {
                if let Some(rest) = line.split(&format!(" at {scheme}://")).nth(1) {
                    let _ = tx.send((rest.split("/v1").next().unwrap().to_string(), scheme.to_string()));
                }
            }
        }
    });
    let (addr, scheme) = rx.recv_timeout(Duration::from_secs(120)).expect("cleave up did not print its URL");
    (up, addr, scheme)
}

/// `cleave up --kv-cache-dtype bf16` starts its nodes with that cache: a remotely prefilled
/// request hands off 2 bytes per element (256 a token for the tiny model, half of f32's), and its
/// text is `cleave generate --kv-cache-dtype bf16`'s.
#[test]
fn up_passes_the_kv_cache_dtype_to_its_nodes() {
    let model = testdata_dir().join("tiny-llama");
    let exe = env!("CARGO_BIN_EXE_cleave");
    let prompt = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find";
    let out = Command::new(exe)
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", prompt, "--max-tokens", "8"])
        .args(["--ignore-eos", "--kv-cache-dtype", "bf16"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let want = String::from_utf8(out.stdout).unwrap().trim_end_matches('\n').to_string();
    let (_up, addr) = start_up(&["--kv-cache-dtype", "bf16", "--coordinator-arg=--local-prefill-max-tokens=0"]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let body = serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    rt.block_on(async {
        let v: serde_json::Value = client
            .post(format!("http://{addr}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{v}");
        let tokens = v["usage"]["prompt_tokens"].as_f64().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = client.get(format!("http://{addr}/metrics")).send().await.unwrap().text().await.unwrap();
            let bytes: f64 = m
                .lines()
                .filter(|l| l.starts_with("cleave_handoff_transfer_bytes_sum"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            if bytes > 0.0 {
                assert_eq!(bytes, tokens * 256.0, "{m}");
                break;
            }
            assert!(Instant::now() < deadline, "no handoff reported:\n{m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// `cleave up` with an edge certificate from `cleave certs --edge` serves HTTPS: a client that
/// trusts the CA gets the same greedy text as over plain HTTP, the official `openai` client works
/// against it, and plain HTTP on that port gets no answer.
#[test]
fn up_serves_https_with_an_edge_certificate() {
    let dir = std::env::temp_dir().join(format!("cleave-edge-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_cleave"))
        .args(["certs", "--dir", dir.to_str().unwrap(), "--edge", "localhost,127.0.0.1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (cert, key, ca) = (dir.join("edge.crt"), dir.join("edge.key"), dir.join("ca.crt"));
    let (_up, addr, scheme) = start_up_scheme(&[
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--coordinator-arg=--local-prefill-max-tokens=0",
    ]);
    assert_eq!(scheme, "https");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ca_cert = reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap();
    let client =
        reqwest::Client::builder().add_root_certificate(ca_cert).timeout(Duration::from_secs(60)).build().unwrap();
    let body = serde_json::json!({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0});
    let v: serde_json::Value = rt.block_on(async {
        let r = client.post(format!("https://{addr}/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    });
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    // Plain HTTP on the TLS port is not served; a client that does not trust the CA refuses.
    let plain = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let r = rt.block_on(async { plain.get(format!("http://{addr}/health")).send().await });
    assert!(r.as_ref().map_or(true, |r| !r.status().is_success()), "plain HTTP answered: {r:?}");
    let r = rt.block_on(async { plain.get(format!("https://{addr}/health")).send().await });
    assert!(r.is_err(), "a client without the CA connected: {r:?}");
    let has_openai = Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    if has_openai || std::env::var_os("CLEAVE_REQUIRE_OPENAI").is_some() {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
        let out = Command::new("python3")
            .arg(script)
            .arg(format!("https://{addr}/v1"))
            .arg("tiny-llama")
            .arg(&ca)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "openai client over https failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        eprintln!("skipping the openai client over https: python3 cannot import openai (pip install openai)");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn up_restarts_a_coordinator_and_a_node_that_die() {
    let (up, addr) = start_up(&["--coordinator-arg=--local-prefill-max-tokens=0"]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let prompt = "The quick brown fox jumps over the lazy dog";
    let body = serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    // Serves once the cluster is whole again (bounded).
    let complete = |what: &str| -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got: Option<String> = rt.block_on(async {
                let r = client.post(format!("http://{addr}/v1/completions")).json(&body).send().await.ok()?;
                if !r.status().is_success() {
                    return None;
                }
                let v: serde_json::Value = r.json().await.ok()?;
                v["choices"][0]["text"].as_str().map(str::to_string)
            });
            if let Some(t) = got {
                return t;
            }
            assert!(Instant::now() < deadline, "the cluster did not serve again after {what}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let want = complete("start");
    let pid = up.0.id();

    for (who, word) in [("the coordinator", "coordinator"), ("a node", "node")] {
        let victims = children(pid, word);
        assert!(!victims.is_empty(), "no {word} child of cleave up");
        let victim = victims[0];
        assert!(Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
        // A new process takes its place and the same greedy text comes back.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !children(pid, word).iter().any(|p| *p != victim) || children(pid, word).contains(&victim) {
            assert!(Instant::now() < deadline, "{who} was not restarted");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(complete(who), want, "after restarting {who}");
    }
}

#[test]
fn up_starts_a_node_the_planner_asks_for_within_the_budget() {
    let (_up, addr) = start_up(&["--max-nodes", "3", "--planner", "auto", "--admin-token", "up-test-token"]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let admin = |m: reqwest::Method, path: &str, body: Option<serde_json::Value>| -> serde_json::Value {
        rt.block_on(async {
            let mut r = client.request(m, format!("http://{addr}{path}")).bearer_auth("up-test-token");
            if let Some(b) = body {
                r = r.json(&b);
            }
            let r = r.send().await.unwrap();
            assert!(r.status().is_success(), "{path}: {}", r.status());
            r.json().await.unwrap()
        })
    };
    let nodes = |admin: &dyn Fn(reqwest::Method, &str, Option<serde_json::Value>) -> serde_json::Value| {
        admin(reqwest::Method::GET, "/admin/nodes", None)["nodes"].as_array().unwrap().clone()
    };
    assert_eq!(nodes(&admin).len(), 2);
    // A prefill node and two decode nodes at least, room for three: the planner asks for one
    // more node (switching the prefill node would break min_prefill).
    admin(
        reqwest::Method::PUT,
        "/admin/planner",
        Some(serde_json::json!({"limits": {"min_prefill": 1, "min_decode": 2}, "cooldown_s": 0.0})),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let n = nodes(&admin);
        let decoders = n.iter().filter(|x| x["role"] == "decode" && x["state"] == "active").count();
        if n.len() == 3 && decoders >= 2 {
            assert!(n.iter().any(|x| x["name"] == "extra-0"), "{n:?}");
            break;
        }
        assert!(Instant::now() < deadline, "no node was started for the planner: {n:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // `cleave up`'s budget holds: a planner allowed four nodes asks for a fourth, and nothing
    // more is started.
    admin(
        reqwest::Method::PUT,
        "/admin/planner",
        Some(serde_json::json!({"limits": {"max_nodes": 4, "min_decode": 3}})),
    );
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(nodes(&admin).len(), 3);
}
