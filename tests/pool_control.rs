//! Pool control as processes on loopback: the admin API's token, a drain under load, a role
//! switch under load, and nodes that outlive their coordinator. Streams are checked against
//! Hugging Face transformers' greedy text (tiny-llama's golden.json); blocks against the nodes'
//! own reports.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// The golden cases, repeated to `n` requests: (prompt, transformers' 32-token greedy text).
fn load(n: usize) -> Vec<(String, String)> {
    let cases = golden();
    (0..n)
        .map(|i| {
            let c = &cases[i % cases.len()];
            (c["prompt"].as_str().unwrap().to_string(), c["text_incremental"].as_str().unwrap().to_string())
        })
        .collect()
}

/// Streams every request of `load` at once; returns when all ended, asserting each text.
async fn run_load(c: &TestCluster, load: Vec<(String, String)>) {
    let streams = load.into_iter().map(|(prompt, want)| async move {
        let (text, finish) = c.stream(greedy(&prompt, 32)).await;
        assert_eq!(text, want, "a stream's text changed (prompt {prompt:?})");
        assert_eq!(finish, "length");
    });
    futures::future::join_all(streams).await;
}

fn node_by_name<'a>(nodes: &'a [Value], name: &str) -> &'a Value {
    nodes.iter().find(|n| n["name"] == name).unwrap_or_else(|| panic!("no node {name} in {nodes:?}"))
}

/// Waits (bounded) until node `name` is in `state`.
async fn wait_state(c: &TestCluster, name: &str, state: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let nodes = c.nodes_state().await;
        let n = node_by_name(&nodes, name).clone();
        if n["state"] == state {
            return n;
        }
        assert!(Instant::now() < deadline, "{name} never reached {state}: {n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) until node `name` has at least `min` routed decode streams.
async fn wait_busy(c: &TestCluster, name: &str, min: u64) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let nodes = c.nodes_state().await;
        let n = node_by_name(&nodes, name);
        if n["active"]["decode"].as_u64().unwrap() >= min {
            return n["id"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "{name} never got a stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Requests the coordinator has routed so far (its `cleave_route_decisions_total`).
async fn routed(c: &TestCluster) -> f64 {
    let text = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with("cleave_route_decisions_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn admin_routes_refuse_a_missing_or_wrong_token() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["decode"], &[]);
    runtime().block_on(async {
        c.wait_nodes(1).await;
        let routes = [
            (reqwest::Method::GET, "/admin/nodes"),
            (reqwest::Method::GET, "/admin/pools"),
            (reqwest::Method::GET, "/admin/prometheus/targets"),
            (reqwest::Method::GET, "/admin/planner"),
            (reqwest::Method::PUT, "/admin/planner"),
            (reqwest::Method::GET, "/admin/planner/decisions"),
            (reqwest::Method::POST, "/admin/nodes/1/drain"),
            (reqwest::Method::POST, "/admin/nodes/1/role"),
            (reqwest::Method::DELETE, "/admin/nodes/1"),
        ];
        for (m, path) in &routes {
            for token in [None, Some("wrong"), Some("test-admin-token-but-longer")] {
                let mut req = c.client.request(m.clone(), format!("{}{path}", c.http)).json(&json!({"role": "decode"}));
                if let Some(t) = token {
                    req = req.bearer_auth(t);
                }
                let r = req.send().await.unwrap();
                assert_eq!(r.status(), 401, "{m} {path} with {token:?}");
                let v: Value = r.json().await.unwrap();
                assert_eq!(v["error"]["type"], "authentication_error", "{v}");
            }
        }
        // The API key is not the admin token, and the right token works.
        let nodes = c.admin(reqwest::Method::GET, "/admin/nodes", None).await;
        assert_eq!(nodes["nodes"].as_array().unwrap().len(), 1);
        // Bad admin input is a clear 4xx, never a panic.
        let r =
            c.client.post(format!("{}/admin/nodes/999/drain", c.http)).bearer_auth(ADMIN_TOKEN).send().await.unwrap();
        assert_eq!(r.status(), 404);
        let id = nodes["nodes"][0]["id"].as_u64().unwrap();
        for body in [json!({"role": "sideways"}), json!({}), json!({"role": "decode", "extra": 1})] {
            let r = c
                .client
                .post(format!("{}/admin/nodes/{id}/role", c.http))
                .bearer_auth(ADMIN_TOKEN)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400, "{body}");
        }
        let r = c
            .client
            .put(format!("{}/admin/planner", c.http))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"mode": "sometimes"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
    });

    // A coordinator started without --admin-token keeps its admin API closed.
    let certs = certs_dir(&["coordinator".to_string()]);
    let args: Vec<String> = [
        "coordinator",
        "--model",
        tiny_llama().to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--cluster-listen",
        "127.0.0.1:0",
        "--certs",
        certs.to_str().unwrap(),
        "--exit-with-parent",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let closed = Proc::start("closed-coordinator", &args).unwrap();
    runtime().block_on(async {
        let r = reqwest::get(format!("http://{}/admin/nodes", closed.ready["http"])).await.unwrap();
        assert_eq!(r.status(), 401);
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("--admin-token"), "{v}");
    });
    let _ = std::fs::remove_dir_all(certs);
}

#[test]
fn a_drain_under_load_completes_every_stream_and_the_node_leaves_when_removed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = TestCluster::start(&tiny_llama(), &["prefill", "decode", "decode"], &["--local-prefill-max-tokens=0"]);
    runtime().block_on(async {
        c.wait_nodes(3).await;
        let load = load(12);
        let streams = run_load(&c, load.clone());
        let drain = async {
            // Drain a decode node while it streams: its streams finish on it.
            let id = wait_busy(&c, "node-1", 1).await;
            c.admin(reqwest::Method::POST, &format!("/admin/nodes/{id}/drain"), Some(json!({"then": "stay"}))).await;
            let n = node_by_name(&c.nodes_state().await, "node-1").clone();
            assert!(n["state"] == "draining" || n["state"] == "drained", "{n}");
            id
        };
        let ((), id) = tokio::join!(streams, drain);
        let parked = wait_state(&c, "node-1", "drained").await;
        assert_eq!(parked["active"]["decode"], 0);
        // A parked node takes no new work: everything decodes on node-2 now.
        run_load(&c, load[..4].to_vec()).await;
        let nodes = c.nodes_state().await;
        assert_eq!(node_by_name(&nodes, "node-1")["active"]["decode"], 0);
        c.wait_blocks_free().await;
        let pools = c.admin(reqwest::Method::GET, "/admin/pools", None).await;
        assert_eq!(pools["pools"]["decode"]["active_nodes"], 1, "{pools}");
        // Removing it: it leaves, and its process exits cleanly.
        c.admin(reqwest::Method::DELETE, &format!("/admin/nodes/{id}"), None).await;
        c.wait_nodes(2).await;
        id
    });
    let node = &mut c.nodes[1];
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = node.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the removed node did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "a node that leaves exits cleanly: {status}");
}

#[test]
fn a_role_switch_under_load_loses_no_request_and_keeps_greedy_text() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens=0"]);
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let nodes = c.nodes_state().await;
        let (p, d) = (node_by_name(&nodes, "node-0")["id"].clone(), node_by_name(&nodes, "node-1")["id"].clone());
        let load = load(10);
        let load_during = self::load(4);
        let streams = run_load(&c, load.clone());
        let switch = async {
            // Every request routed, and streams running on the decode node.
            let deadline = Instant::now() + WAIT;
            while routed(&c).await < 10.0 {
                assert!(Instant::now() < deadline, "the requests were never routed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let running = node_by_name(&c.nodes_state().await, "node-1")["active"]["decode"].clone();
            eprintln!("switching with {running} streams on the decode node");
            // Swap the roles while streams run: the decode node finishes its streams first.
            c.admin(reqwest::Method::POST, &format!("/admin/nodes/{d}/role"), Some(json!({"role": "prefill"}))).await;
            c.admin(reqwest::Method::POST, &format!("/admin/nodes/{p}/role"), Some(json!({"role": "decode"}))).await;
            // Requests that come while no node can decode them (the decode node drains its
            // streams before it prefills; node-0 decodes only once its switch is done) are held
            // at the edge until a switch completes, not failed.
            run_load(&c, load_during).await;
        };
        tokio::join!(streams, switch);
        let a = wait_state(&c, "node-0", "active").await;
        let b = wait_state(&c, "node-1", "active").await;
        assert_eq!((a["role"].as_str(), b["role"].as_str()), (Some("decode"), Some("prefill")));
        // The swapped cluster serves transformers' text, KV now flowing node-1 -> node-0.
        run_load(&c, load).await;
        // A stream's booking is handed back just after its last token reaches the client (the
        // release goes through the registry's queue): bounded wait, not an instant check.
        let deadline = Instant::now() + WAIT;
        while node_by_name(&c.nodes_state().await, "node-0")["active"]["decode"].as_u64().unwrap() != 0 {
            assert!(Instant::now() < deadline, "node-0 kept routed streams after they ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.wait_blocks_free().await;
        // And back to colocated with a step budget: both take their own requests.
        c.admin(
            reqwest::Method::POST,
            &format!("/admin/nodes/{p}/role"),
            Some(json!({"role": "both", "step_budget": 64})),
        )
        .await;
        let n = wait_state(&c, "node-0", "active").await;
        assert_eq!((n["role"].as_str(), n["step_budget"].as_u64()), (Some("both"), Some(64)));
        // A budget the node's engine refuses (below its 64 sequences) is not shown as taken:
        // the node's next reports say what it really runs.
        c.admin(
            reqwest::Method::POST,
            &format!("/admin/nodes/{p}/role"),
            Some(json!({"role": "both", "step_budget": 1})),
        )
        .await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let n = node_by_name(&c.nodes_state().await, "node-0").clone();
            if n["state"] == "active" && n["step_budget"] == 64 {
                break;
            }
            assert!(Instant::now() < deadline, "the refused budget is still shown: {n}");
        }
        check_golden(&c).await;
    });
}

#[test]
fn nodes_survive_a_coordinator_restart() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &["--local-prefill-max-tokens=0"]);
    runtime().block_on(c.wait_nodes(2));
    // Kill the coordinator; start a new one where the nodes look for it.
    let _ = c.coordinator.child.kill();
    let _ = c.coordinator.child.wait();
    let args: Vec<String> = [
        "coordinator",
        "--model",
        c.model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--cluster-listen",
        &c.cluster,
        "--name",
        "coordinator",
        "--certs",
        c.certs.to_str().unwrap(),
        "--exit-with-parent",
        "--admin-token",
        ADMIN_TOKEN,
        "--local-prefill-max-tokens=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let fresh = loop {
        // The old process's UDP port may take a moment to be free.
        match Proc::start("coordinator-2", &args) {
            Ok(p) => break p,
            Err(e) if Instant::now() < deadline => {
                eprintln!("restart: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("the coordinator did not come back: {e}"),
        }
    };
    c.http = format!("http://{}", fresh.ready["http"]);
    c.coordinator = fresh;
    runtime().block_on(async {
        // The nodes re-register on their own and the new coordinator routes to them.
        c.wait_nodes(2).await;
        let nodes = c.nodes_state().await;
        let roles: Vec<&str> = nodes.iter().map(|n| n["role"].as_str().unwrap()).collect();
        assert!(roles.contains(&"prefill") && roles.contains(&"decode"), "{roles:?}");
        check_golden(&c).await;
    });
}

#[test]
fn the_planner_in_auto_mode_moves_a_node_when_the_limits_say_so() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(
        &tiny_llama(),
        &["prefill", "decode"],
        &["--local-prefill-max-tokens=0", "--planner", "off"],
    );
    runtime().block_on(async {
        c.wait_nodes(2).await;
        // Off: nothing happens, whatever the limits.
        let cfg = c.admin(reqwest::Method::PUT, "/admin/planner", Some(json!({"limits": {"max_prefill": 0}}))).await;
        assert_eq!(cfg["mode"], "off");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(node_by_name(&c.nodes_state().await, "node-0")["role"], "prefill");
        let d = c.admin(reqwest::Method::GET, "/admin/planner/decisions", None).await;
        assert_eq!(d["decisions"].as_array().unwrap().len(), 0, "{d}");
        // Auto: the prefill pool may hold no node any more, so the planner switches node-0.
        c.admin(reqwest::Method::PUT, "/admin/planner", Some(json!({"mode": "auto", "cooldown_s": 0.0}))).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        let moved = loop {
            let nodes = c.nodes_state().await;
            let n = node_by_name(&nodes, "node-0").clone();
            if n["role"] != "prefill" && n["state"] == "active" {
                break n;
            }
            assert!(Instant::now() < deadline, "the planner did not move node-0: {n}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(moved["role"] == "decode" || moved["role"] == "both", "{moved}");
        let d = c.admin(reqwest::Method::GET, "/admin/planner/decisions", None).await;
        let last = d["decisions"].as_array().unwrap().last().cloned().unwrap();
        assert_eq!(last["applied"], true, "{last}");
        assert_eq!(last["target"]["prefill"], 0, "{last}");
        // The moved cluster still serves transformers' text.
        check_golden(&c).await;
    });
}

/// Prompt tokens of the long pacing prompt: words the tiny tokenizer splits into a few tokens each.
fn long_prompt() -> String {
    (0..120).map(|i| format!("word{i}")).collect::<Vec<_>>().join(" ")
}

#[test]
fn colocated_nodes_pace_prompt_chunks_to_the_tpot_target_without_changing_text() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["both"], &["--pacing"]);
    let c = &c;
    runtime().block_on(async {
        c.wait_nodes(1).await;
        // The node hears the coordinator's TPOT target (100 ms by default) once registered.
        let paced = |want: f64| async move {
            let deadline = Instant::now() + WAIT;
            loop {
                let n = node_by_name(&c.nodes_state().await, "node-0").clone();
                if n["pacing"]["tpot_target_ms"].as_f64() == Some(want) {
                    return n;
                }
                assert!(Instant::now() < deadline, "the node never paced to {want} ms: {n}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let n = paced(100.0).await;
        let paced_before = n["pacing"]["paced_steps"].as_u64().unwrap();
        // The tiny model runs a step in well under a millisecond: at 100 ms nothing is cut.
        let long = long_prompt();
        let unpaced = c.complete(greedy(&long, 32)).await["choices"][0]["text"].as_str().unwrap().to_string();
        // A target no step can meet: every chunk beside a decode is cut to the floor. Long
        // greedy streams decode while the long prompt comes; every text is what it was unpaced
        // (a long stream's starts with transformers' 32 tokens).
        c.admin(reqwest::Method::PUT, "/admin/planner", Some(json!({"targets": {"tpot_ms": 0.01}}))).await;
        paced(0.01).await;
        let background = load(3).into_iter().map(|(prompt, want)| async move {
            let (text, finish) = c.stream(greedy(&prompt, 1500)).await;
            assert!(text.starts_with(&want), "a paced stream's text changed (prompt {prompt:?}): {text:?}");
            assert_eq!(finish, "length");
        });
        let (long, unpaced) = (&long, &unpaced);
        let late = async move {
            let deadline = Instant::now() + WAIT;
            while node_by_name(&c.nodes_state().await, "node-0")["load"]["running_seqs"].as_u64() < Some(3) {
                assert!(Instant::now() < deadline, "the long streams never ran");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let (text, _) = c.stream(greedy(long, 32)).await;
            assert_eq!(&text, unpaced, "the paced prompt's text changed");
        };
        tokio::join!(futures::future::join_all(background), late);
        let deadline = Instant::now() + WAIT;
        loop {
            let n = node_by_name(&c.nodes_state().await, "node-0").clone();
            if n["pacing"]["paced_steps"].as_u64().unwrap() > paced_before {
                break;
            }
            assert!(Instant::now() < deadline, "no step was paced: {n}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        c.wait_blocks_free().await;
    });
}

/// `--colocated-tpot-target-ms`: a colocated node paces to its hold, a decode node to the
/// target; `PUT /admin/planner` moves the hold or clears it (0), and the nodes hear it at
/// once; text is unchanged.
#[test]
fn colocated_nodes_pace_to_their_hold_and_decode_nodes_to_the_target() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["both", "decode"], &["--pacing", "--colocated-tpot-target-ms", "40"]);
    let c = &c;
    runtime().block_on(async {
        c.wait_nodes(2).await;
        let paced = |both: f64, decode: f64| async move {
            let deadline = Instant::now() + WAIT;
            loop {
                let nodes = c.nodes_state().await;
                let got = ["node-0", "node-1"].map(|n| node_by_name(&nodes, n)["pacing"]["tpot_target_ms"].as_f64());
                if got == [Some(both), Some(decode)] {
                    return;
                }
                assert!(Instant::now() < deadline, "never paced to {both} / {decode} ms: {got:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        paced(40.0, 100.0).await;
        let cfg = c.admin(reqwest::Method::GET, "/admin/planner", None).await;
        assert_eq!(cfg["config"]["targets"]["colocated_tpot_ms"], 40.0, "{cfg}");
        check_golden(c).await;
        // `cleave admin planner`, its flag joined to the targets its --json names.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave"))
            .args(["admin", "--url", &c.http, "--admin-token", common::ADMIN_TOKEN, "planner"])
            .args(["--colocated-tpot-target-ms", "25", "--json", r#"{"targets": {"ttft_ms": 2500}}"#])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let cfg: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (cfg["targets"]["colocated_tpot_ms"].as_f64(), cfg["targets"]["ttft_ms"].as_f64()),
            (Some(25.0), Some(2500.0))
        );
        paced(25.0, 100.0).await;
        // Cleared: the target for every node.
        let cfg =
            c.admin(reqwest::Method::PUT, "/admin/planner", Some(json!({"targets": {"colocated_tpot_ms": 0}}))).await;
        assert!(cfg["targets"].get("colocated_tpot_ms").is_none(), "{cfg}");
        paced(100.0, 100.0).await;
        check_golden(c).await;
        c.wait_blocks_free().await;
    });
}

/// The coordinator's counter `name` (summed over its labels).
async fn counter(c: &TestCluster, name: &str) -> f64 {
    let text = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn slo_admission_caps_a_node_past_the_tpot_target_and_sheds_what_waited_too_long() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(&tiny_llama(), &["both"], &["--slo-admission"]);
    let c = &c;
    runtime().block_on(async {
        c.wait_nodes(1).await;
        assert_eq!(node_by_name(&c.nodes_state().await, "node-0")["seat_cap"], Value::Null, "no cap before any load");
        // A TPOT target no step can meet, and a TTFT target that lets a request wait 20 ms.
        c.admin(reqwest::Method::PUT, "/admin/planner", Some(json!({"targets": {"tpot_ms": 0.01, "ttft_ms": 40}})))
            .await;
        // One stream runs over it: once the node reports its steps, its cap falls to one seat.
        let (prompt, want) = load(1).remove(0);
        let deadline = Instant::now() + WAIT;
        loop {
            let (text, _) = c.stream(greedy(&prompt, 64)).await;
            assert!(text.starts_with(&want), "{text:?}");
            let n = node_by_name(&c.nodes_state().await, "node-0").clone();
            if n["seat_cap"] == json!(1) {
                break;
            }
            assert!(Instant::now() < deadline, "the seat cap never fell to 1: {n}");
        }
        // A burst of long streams: one takes the seat, the others wait 20 ms for it and are
        // refused with 503 and Retry-After (nothing was generated). What is served is whole.
        let shed_before = counter(c, "cleave_requests_shed_total").await;
        let burst = (0..6).map(|_| {
            let (prompt, want) = (prompt.clone(), want.clone());
            async move {
                let r = c.client.post(format!("{}/v1/completions", c.http)).json(&greedy(&prompt, 1500)).send().await;
                let r = r.unwrap();
                let status = r.status().as_u16();
                let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
                let v: Value = r.json().await.unwrap();
                match status {
                    200 => assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(&want), "{v}"),
                    503 => {
                        assert_eq!(retry.as_deref(), Some("1"), "{v}");
                        assert!(v["error"]["message"].as_str().unwrap().contains("SLO admission"), "{v}");
                    }
                    s => panic!("unexpected {s}: {v}"),
                }
                status
            }
        });
        let statuses = futures::future::join_all(burst).await;
        let served = statuses.iter().filter(|&&s| s == 200).count();
        assert!(served >= 1 && served < statuses.len(), "one seat, six long streams: {statuses:?}");
        let shed = counter(c, "cleave_requests_shed_total").await - shed_before;
        assert_eq!(shed as usize, statuses.len() - served, "{statuses:?}");
        assert!(counter(c, "cleave_requests_held_for_seat_total").await >= shed);
        c.wait_blocks_free().await;
        // Off again (a loose target): no cap binds, a burst is served whole.
        c.admin(
            reqwest::Method::PUT,
            "/admin/planner",
            Some(json!({"targets": {"tpot_ms": 100000, "ttft_ms": 100000}})),
        )
        .await;
        let deadline = Instant::now() + WAIT;
        loop {
            let (text, _) = c.stream(greedy(&prompt, 64)).await;
            assert!(text.starts_with(&want), "{text:?}");
            let n = node_by_name(&c.nodes_state().await, "node-0").clone();
            if n["seat_cap"].as_u64().is_none_or(|cap| cap > 1) {
                break;
            }
            assert!(Instant::now() < deadline, "the cap never let go: {n}");
        }
    });
}
