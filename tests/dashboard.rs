//! The built-in dashboard in a real browser: Debian's `chromium`, driven through `chromedriver`'s
//! WebDriver API (plain HTTP and JSON), against a live three-node cluster (one node per pool)
//! under load. The page must load with no console error, draw data in every chart and list every
//! node, and a Drain clicked in the page must drain the node. The screenshot goes to
//! `target/dashboard.png` (and to `CLEAVE_DASHBOARD_SCREENSHOT` when set).
//!
//! Skipped with a message when chromium or chromedriver is missing, unless CLEAVE_REQUIRE_BROWSER
//! is set (CI installs both and sets it).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";

/// A chromedriver process and one browser session in it; both end on drop.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    async fn start(log: &Path) -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("starting chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready =
                async { http.get(format!("{base}/status")).send().await.ok()?.json::<Value>().await.ok() }.await;
            if ready.is_some_and(|v| v["value"]["ready"] == true) {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not come up");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,2600"]},
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let v: Value = http.post(format!("{base}/session")).json(&caps).send().await.unwrap().json().await.unwrap();
        let session = v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {v}")).to_string();
        let mut b = Browser { driver, base, session, http };
        b.cmd(reqwest::Method::POST, "timeouts", json!({"script": 30000, "pageLoad": 30000})).await;
        b
    }

    /// One WebDriver command of this session; its `value`.
    async fn cmd(&mut self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}/{path}", self.base, self.session);
        let mut req = self.http.request(method.clone(), url);
        if method != reqwest::Method::GET {
            req = req.json(&body);
        }
        let v: Value = req.send().await.unwrap().json().await.unwrap();
        assert!(v["value"].get("error").is_none(), "webdriver {path}: {v}");
        v["value"].clone()
    }

    async fn goto(&mut self, url: &str) {
        self.cmd(reqwest::Method::POST, "url", json!({"url": url})).await;
    }

    async fn js(&mut self, script: &str) -> Value {
        self.cmd(reqwest::Method::POST, "execute/sync", json!({"script": script, "args": []})).await
    }

    async fn click(&mut self, css: &str) {
        let e = self.cmd(reqwest::Method::POST, "element", json!({"using": "css selector", "value": css})).await;
        let id = e.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap().to_string();
        self.cmd(reqwest::Method::POST, &format!("element/{id}/click"), json!({})).await;
    }

    async fn type_into(&mut self, css: &str, text: &str) {
        let e = self.cmd(reqwest::Method::POST, "element", json!({"using": "css selector", "value": css})).await;
        let id = e.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap().to_string();
        self.cmd(reqwest::Method::POST, &format!("element/{id}/value"), json!({"text": text})).await;
    }

    /// The browser's console since the last call (chromedriver's log extension).
    async fn console(&mut self) -> Vec<Value> {
        self.cmd(reqwest::Method::POST, "se/log", json!({"type": "browser"}))
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    async fn screenshot(&mut self) -> Vec<u8> {
        let b64 = self.cmd(reqwest::Method::GET, "screenshot", Value::Null).await;
        base64::engine::general_purpose::STANDARD.decode(b64.as_str().unwrap()).unwrap()
    }
}

#[test]
fn the_dashboard_shows_every_pool_live_and_drains_a_node_from_the_page() {
    let what = format!("{CHROMIUM} or chromedriver is missing");
    let browser = have(CHROMIUM) && have("chromedriver");
    if !available(browser, "CLEAVE_REQUIRE_BROWSER", &what, "apt-get install chromium chromium-driver") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = three_pool_cluster();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        c.wait_nodes(3).await;
        // Without the token: the sign-in form, no data.
        let anon = c.client.get(format!("{}/dashboard", c.http)).send().await.unwrap().text().await.unwrap();
        assert!(anon.contains("admin token") && !anon.contains("chart-"), "{anon}");
        let wrong = c.client.post(format!("{}/dashboard/login", c.http)).json(&json!({"token": "not-the-token"})).send().await.unwrap();
        assert_eq!(wrong.status(), 401);

        let (stop, load) = spawn_load(&c, 3);
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let mut b = Browser::start(&out.join("chromedriver.log")).await;
        b.goto(&format!("{}/dashboard", c.http)).await;
        b.type_into("#token", ADMIN_TOKEN).await;
        b.click("#signin").await;
        // Every chart has data, every node is listed, and there are 30 s of history (15 samples of
        // the two lines of a nodes chart) for the screenshot.
        let deadline = Instant::now() + Duration::from_secs(150);
        let empty = loop {
            let v = b
                .js("const empty = [...document.querySelectorAll('.chart')].filter(c => c.dataset.points === '0').map(c => c.id);
                     return {charts: document.querySelectorAll('.chart').length, empty,
                             history: Number(document.getElementById('chart-decode-nodes').dataset.points),
                             rows: document.querySelectorAll('#nodes tbody tr').length};")
                .await;
            let empty: Vec<String> = serde_json::from_value(v["empty"].clone()).unwrap_or_default();
            let history = v["history"].as_u64().unwrap_or(0);
            if v["charts"].as_u64().unwrap_or(0) >= 20 && empty.is_empty() && v["rows"] == 3 && history >= 30 {
                break empty;
            }
            if Instant::now() > deadline {
                break empty;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        };
        let png = b.screenshot().await;
        std::fs::write(out.join("dashboard.png"), &png).unwrap();
        if let Some(p) = std::env::var_os("CLEAVE_DASHBOARD_SCREENSHOT") {
            std::fs::write(p, &png).unwrap();
        }
        assert!(empty.is_empty(), "charts without data after 150 s: {empty:?} (screenshot in {})", out.display());
        let errors: Vec<Value> = b.console().await.into_iter().filter(|e| e["level"] == "SEVERE").collect();
        assert!(errors.is_empty(), "console errors: {errors:#?}");

        // A drain clicked in the page drains the node.
        b.click("button.drain[data-node=\"node-1\"]").await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let nodes = c.nodes_state().await;
            let state = nodes.iter().find(|n| n["name"] == "node-1").map(|n| n["state"].clone());
            if matches!(state.as_ref().and_then(Value::as_str), Some("draining" | "drained")) {
                break;
            }
            assert!(Instant::now() < deadline, "node-1 not drained after the click: {state:?}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let errors: Vec<Value> = b.console().await.into_iter().filter(|e| e["level"] == "SEVERE").collect();
        assert!(errors.is_empty(), "console errors after the drain: {errors:#?}");
        stop.store(true, Ordering::Relaxed);
        for t in load {
            let _ = t.await;
        }
    });
}
