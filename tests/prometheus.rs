//! deploy/prometheus and deploy/grafana against a live cluster and a real Prometheus (Debian's
//! `prometheus` package): the shipped scrape config (coordinator plus the nodes found through the
//! coordinator's HTTP service discovery), its recording rules, and every query of the Grafana
//! dashboard each return data once the cluster has served a little load.
//!
//! Skipped with a message when `prometheus` is not on PATH, unless CLEAVE_REQUIRE_PROMETHEUS is
//! set (CI installs it and sets it).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

struct Prometheus {
    child: Child,
    url: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The recording rules of deploy/prometheus/rules.yml: (name, expression). Every `expr:` there
/// is one line.
fn rules() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("deploy/prometheus/rules.yml")).unwrap();
    let mut out = Vec::new();
    let mut record = None;
    for line in text.lines().map(str::trim) {
        if let Some(r) = line.strip_prefix("- record:") {
            record = Some(r.trim().to_string());
        } else if let Some(e) = line.strip_prefix("expr:") {
            let e = e.trim();
            assert!(!e.is_empty() && e != "|", "rules.yml: keep each expr on one line");
            out.push((record.take().expect("expr without record"), e.to_string()));
        }
    }
    assert!(out.len() >= 8, "{out:?}");
    out
}

/// Every panel query of deploy/grafana/cleave.json, and its annotation queries (these need only
/// be valid: they return data only when the planner has decided something).
fn dashboard_queries() -> (Vec<String>, Vec<String>) {
    let d: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("deploy/grafana/cleave.json")).unwrap()).unwrap();
    assert!(d["schemaVersion"].as_u64().unwrap() >= 39, "Grafana's current dashboard schema");
    let mut panels: Vec<String> = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    panels.sort();
    panels.dedup();
    let annotations =
        d["annotations"]["list"].as_array().unwrap().iter().map(|a| a["expr"].as_str().unwrap().to_string()).collect();
    (panels, annotations)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// deploy/prometheus with the coordinator's address, a 1-s scrape interval and the admin token.
fn start_prometheus(dir: &Path, coordinator: &str) -> Prometheus {
    let config = std::fs::read_to_string(repo().join("deploy/prometheus/prometheus.yml"))
        .unwrap()
        .replace("127.0.0.1:8000", coordinator)
        .replace("5s", "1s");
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    std::fs::copy(repo().join("deploy/prometheus/rules.yml"), dir.join("rules.yml")).unwrap();
    std::fs::write(dir.join("admin-token"), ADMIN_TOKEN).unwrap();
    if have("promtool") {
        let out = Command::new("promtool").arg("check").arg("config").arg(dir.join("prometheus.yml")).output().unwrap();
        assert!(
            out.status.success(),
            "promtool: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let port = free_port();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn()
        .expect("starting prometheus");
    Prometheus { child, url: format!("http://127.0.0.1:{port}") }
}

async fn query(client: &reqwest::Client, p: &Prometheus, q: &str) -> Result<Vec<Value>, String> {
    let r =
        client.get(format!("{}/api/v1/query", p.url)).query(&[("query", q)]).send().await.map_err(|e| e.to_string())?;
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if v["status"] != "success" {
        return Err(format!("{v}"));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

#[test]
fn the_shipped_prometheus_rules_and_grafana_queries_return_data_from_a_live_cluster() {
    let what = "prometheus is not on PATH";
    if !available(have("prometheus"), "CLEAVE_REQUIRE_PROMETHEUS", what, "apt-get install prometheus") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = three_pool_cluster();
    let dir = std::env::temp_dir().join(format!("cleave-prometheus-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prom = start_prometheus(&dir, c.http.trim_start_matches("http://"));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        c.wait_nodes(3).await;
        let (stop, load) = spawn_load(&c, 3);
        let client = reqwest::Client::new();
        let up = Instant::now() + Duration::from_secs(60);
        while !client.get(format!("{}/-/ready", prom.url)).send().await.is_ok_and(|r| r.status().is_success()) {
            assert!(
                Instant::now() < up,
                "prometheus not ready in 60 s: {}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let mut wanted: Vec<String> = rules().iter().flat_map(|(name, expr)| [name.clone(), expr.clone()]).collect();
        let (panels, annotations) = dashboard_queries();
        assert!(panels.len() >= 30, "{panels:?}");
        wanted.extend(panels);
        for q in &annotations {
            query(&client, &prom, q).await.unwrap_or_else(|e| panic!("annotation query {q}: {e}"));
        }
        wanted.push(r#"up{job="cleave-nodes", node="node-0", role="prefill", pool="prefill"} == 1"#.into());
        wanted.push(r#"up{job="cleave-nodes", node="node-2", role="both", pool="colocated"} == 1"#.into());
        wanted.push(r#"up{job="cleave-coordinator"} == 1"#.into());
        let deadline = Instant::now() + Duration::from_secs(150);
        let mut missing = wanted.clone();
        while !missing.is_empty() && Instant::now() < deadline {
            let mut still = Vec::new();
            for q in missing {
                match query(&client, &prom, &q).await {
                    Ok(r) if !r.is_empty() => {}
                    Ok(_) => still.push(q),
                    Err(e) => panic!("query {q} failed: {e}"),
                }
            }
            missing = still;
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        stop.store(true, Ordering::Relaxed);
        for t in load {
            let _ = t.await;
        }
        let log = std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default();
        assert!(
            missing.is_empty(),
            "no data in 150 s for:\n{}\n\nprometheus log tail:\n{}",
            missing.join("\n"),
            log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
    });
    drop(prom);
    let _ = std::fs::remove_dir_all(&dir);
}
