//! Structured output and tool calling end to end: a real cluster (coordinator, a prefill and a
//! decode node, every prompt prefilled remotely so that the first token is sampled on the
//! prefill node and the rest on the decode node) driven by the official `openai` Python client
//! (`tests/openai_structured.py`): JSON Schema, JSON object, regex and choice constraints hold
//! on sampled output over several seeds, and forced tool calls (`required`, a named function)
//! come back as `tool_calls` the client parses, whole and streamed. On the tiny model (random
//! weights: only the constraint keeps the output in its language) and on SmolLM2 when present.
//!
//! Needs `openai` and `jsonschema` importable by python3 (CI installs both and sets
//! CLEAVE_REQUIRE_OPENAI).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn client_present() -> bool {
    let has = Command::new("python3").args(["-c", "import openai, jsonschema"]).status().is_ok_and(|s| s.success());
    available(
        has,
        "CLEAVE_REQUIRE_OPENAI",
        "python3 cannot import openai and jsonschema",
        "pip install openai jsonschema",
    )
}

fn drive(model: &Path, seeds: u32) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = TestCluster::start(model, &["prefill", "decode"], &["--local-prefill-max-tokens", "0"]);
    runtime().block_on(c.wait_nodes(2));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_structured.py");
    let out =
        Command::new("python3").arg(script).arg(format!("{}/v1", c.http)).arg(seeds.to_string()).output().unwrap();
    assert!(
        out.status.success(),
        "the openai client found a problem:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    runtime().block_on(c.wait_blocks_free());
}

#[test]
fn the_openai_client_gets_constrained_output_and_tool_calls_on_the_tiny_model() {
    if client_present() {
        drive(&tiny_llama(), 3);
    }
}

#[test]
fn the_openai_client_gets_constrained_output_and_tool_calls_on_smollm2() {
    let Some(gguf) = smollm2() else { return };
    if client_present() {
        // A real model at 135M parameters is slower on CPU than the tiny one: two seeds.
        drive(&gguf, 2);
    }
}
