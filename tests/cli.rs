//! The `cleave` binary as a user runs it: real processes, real model files.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

fn cleave(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cleave")).args(args).output().expect("run cleave")
}

fn golden_case(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(testdata_dir().join("tiny-llama/golden.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    golden["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap().clone()
}

#[test]
fn generate_prints_only_the_completion() {
    let model = testdata_dir().join("tiny-llama");
    for name in ["sentence", "unicode"] {
        let case = golden_case(name);
        let out = cleave(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            case["prompt"].as_str().unwrap(),
            "--max-tokens",
            "32",
            "--ignore-eos",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert_eq!(stdout.strip_suffix('\n').unwrap(), case["text_incremental"].as_str().unwrap());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("prompt tokens") && stderr.contains("time to first token"), "{stderr}");
    }
}

#[test]
fn generate_chat_uses_the_template() {
    let model = testdata_dir().join("tiny-llama");
    let case = golden_case("chat");
    let prompt = case["messages"][0]["content"].as_str().unwrap();
    let out = cleave(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--chat",
        "--max-tokens",
        "32",
        "--ignore-eos",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim_end_matches('\n'),
        case["text_incremental"].as_str().unwrap()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("prompt tokens: {}", case["prompt_len"])), "{stderr}");
}

#[test]
fn bad_input_gives_clear_errors() {
    let out = cleave(&["generate", "--model", "/nonexistent/model", "--prompt", "hi"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/model"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let model = testdata_dir().join("tiny-llama");
    let out = cleave(&["generate", "--model", model.to_str().unwrap(), "--prompt", "hi", "--top-p", "0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("top_p"), "{stderr}");

    let out = cleave(&["generate", "--model", model.to_str().unwrap(), "--prompt", "hi", "--kv-cache-memory", "lots"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("lots"));

    let out = cleave(&["generate", "--model", model.to_str().unwrap(), "--prompt", "hi", "--device", "gpu"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("use cpu, cuda or cuda:N"));

    // A bad planner target given to `cleave up` is named by the coordinator it starts (a
    // negative number once went over as a flag of its own: "unexpected argument '-1'").
    for flag in ["--colocated-tpot-target-ms=-1", "--tpot-target-ms=-5"] {
        let out = cleave(&["up", "--model", model.to_str().unwrap(), "--port", "0", flag]);
        assert!(!out.status.success(), "{flag}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let field = if flag.contains("colocated") { "targets.colocated_tpot_ms" } else { "targets.tpot_ms" };
        assert!(stderr.contains(field) && stderr.contains("must be finite and > 0"), "{flag}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("unexpected argument"), "{flag}: {stderr}");
    }
}

/// Asked for a GPU where there is none (or in a build without the CUDA backend), the binary says
/// which, and exits without a panic. With a GPU (CLEAVE_REQUIRE_GPU) it generates instead.
#[test]
fn a_gpu_asked_for_where_there_is_none_is_a_clear_error() {
    let model = testdata_dir().join("tiny-llama");
    let out = cleave(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--device",
        "cuda:0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if out.status.success() {
        assert!(stderr.contains("engine on"), "{stderr}");
        return;
    }
    assert!(std::env::var_os("CLEAVE_REQUIRE_GPU").is_none(), "CLEAVE_REQUIRE_GPU is set: {stderr}");
    assert!(
        stderr.contains("--device cuda:0")
            && (stderr.contains("no CUDA driver") || stderr.contains("built without the `cuda` feature")),
        "{stderr}"
    );
}

#[test]
fn make_model_then_generate() {
    let dir = std::env::temp_dir().join(format!("cleave-cli-make-model-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = cleave(&["make-model", "--preset", "tiny", "--out", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = || {
        cleave(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hello world",
            "--max-tokens",
            "8",
            "--ignore-eos",
        ])
    };
    let (a, b) = (run(), run());
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout, "greedy generation is deterministic");
    assert!(String::from_utf8_lossy(&a.stderr).contains("generated: 8"));
    let out = cleave(&["make-model", "--preset", "enormous", "--out", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tiny"), "lists the presets");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The real SmolLM2-135M-Instruct answers a chat question in English.
#[test]
fn smollm2_chat_answers_in_english() {
    let gguf = std::env::var_os("CLEAVE_SMOLLM2_GGUF").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    if !gguf.exists() {
        assert!(std::env::var_os("CLEAVE_REQUIRE_SMOLLM2").is_none(), "SmolLM2 required but missing at {gguf:?}");
        eprintln!("skipping: SmolLM2 GGUF not found at {gguf:?} (run scripts/peers/smollm2.sh models/smollm2)");
        return;
    }
    let out = cleave(&[
        "generate",
        "--model",
        gguf.to_str().unwrap(),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    let ascii_words = text.split_whitespace().filter(|w| w.is_ascii()).count();
    assert!(ascii_words * 10 >= text.split_whitespace().count() * 9, "not English: {text:?}");
}
