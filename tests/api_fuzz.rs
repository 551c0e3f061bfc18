//! The public HTTP API against a fuzzer: schemathesis (PyPI) generates requests from the OpenAPI
//! document the coordinator serves (`/openapi.json`), valid and invalid, and sends them to a live
//! cluster (a prefill and a decode node on the tiny model). Pass: no 5xx, every response in
//! its documented schema and content type, invalid requests refused (4xx), no request slower
//! than 30 s. Bounded: 30 examples per operation and the run's own time limit. The admin API
//! and the dashboard are left out (they need the admin token and are not the clients' surface).
//!
//! Needs `schemathesis` on the PATH (`pip install schemathesis`); CI sets
//! CLEAVE_REQUIRE_SCHEMATHESIS so that a missing one fails instead of skipping.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn the_public_api_survives_schemathesis() {
    let present = Command::new("schemathesis").arg("--version").output().is_ok_and(|o| o.status.success());
    if !available(present, "CLEAVE_REQUIRE_SCHEMATHESIS", "schemathesis is not installed", "pip install schemathesis") {
        return;
    }
    let c = TestCluster::start(&tiny_llama(), &["prefill", "decode"], &[]);
    runtime().block_on(c.wait_nodes(2));
    let out = Command::new("timeout")
        .arg("900")
        .arg("schemathesis")
        .args(["run", &format!("{}/openapi.json", c.http)])
        .args(["--exclude-path-regex", "^/(admin|dashboard)"])
        // A completion without max_tokens generates to the end of the context (2048 tokens on
        // the tiny model, per prompt of a list): 12 s for three prompts on a 2-core machine busy
        // with other tests, past schemathesis's default 10 s read timeout, which it then reports
        // as a network error. The response-time check (30 s) is what judges slowness.
        .args(["--max-examples", "30", "--workers", "2", "--max-response-time", "30", "--request-timeout", "60"])
        .args(["--checks", "not_a_server_error,response_schema_conformance,content_type_conformance"])
        .args(["--checks", "status_code_conformance,negative_data_rejection"])
        .args(["--seed", "1"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "schemathesis found failures:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    // The cluster still serves, and every block came back.
    runtime().block_on(async {
        let v = c.complete(greedy("After the fuzzer", 4)).await;
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        tokio::time::timeout(Duration::from_secs(60), c.wait_blocks_free()).await.expect("blocks came back");
    });
}
