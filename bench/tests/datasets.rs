//! Datasets built with the tiny Llama's real tokenizer: lengths, shared prefixes, determinism,
//! ShareGPT filters and Mooncake block sharing.

use std::path::PathBuf;

use cleave_bench::dataset::{self, DatasetSpec, RandomSpec};
use cleave_tokenizer::Tokenizer;

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn tok() -> Tokenizer {
    Tokenizer::from_model_dir(testdata_dir().join("tiny-llama")).unwrap()
}

fn tmp(name: &str, text: &str) -> PathBuf {
    let dir = tempfile::tempdir().unwrap().keep();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn random_prompts_hit_their_lengths_and_are_deterministic() {
    let tok = tok();
    let spec = RandomSpec { input_len: 64, output_len: 16, range_ratio: 0.25, prefix_len: 0 };
    let a = dataset::random(&spec, 20, 7, &tok).unwrap();
    assert_eq!(a, dataset::random(&spec, 20, 7, &tok).unwrap());
    assert_ne!(a, dataset::random(&spec, 20, 8, &tok).unwrap());
    let mut exact = 0;
    for r in &a {
        // The recorded length is the real count.
        assert_eq!(r.prompt_len, tok.encode(&r.prompt, true).unwrap().len());
        assert!((16 - 4..=16 + 4).contains(&r.output_len), "{}", r.output_len);
        assert!((48..=80 + 2).contains(&r.prompt_len), "{}", r.prompt_len);
        exact += usize::from((48..=80).contains(&r.prompt_len));
    }
    assert_eq!(exact, a.len(), "every prompt's length should be adjusted into range");
    // The lengths vary with a range ratio.
    assert!(a.iter().any(|r| r.output_len != a[0].output_len));
}

#[test]
fn random_prefix_is_shared() {
    let tok = tok();
    let spec = RandomSpec { input_len: 32, output_len: 4, range_ratio: 0.0, prefix_len: 48 };
    let a = dataset::random(&spec, 4, 1, &tok).unwrap();
    let common = a[0].prompt.chars().zip(a[1].prompt.chars()).take_while(|(x, y)| x == y).count();
    let prefix_tokens = tok.encode(&a[0].prompt.chars().take(common).collect::<String>(), true).unwrap().len();
    assert!(prefix_tokens >= 40, "only {prefix_tokens} tokens shared");
    assert!(a.iter().all(|r| r.prompt.starts_with(&a[0].prompt.chars().take(common).collect::<String>())));
    assert!(
        a.iter().all(|r| r.prompt_len.abs_diff(80) <= 2),
        "{:?}",
        a.iter().map(|r| r.prompt_len).collect::<Vec<_>>()
    );
}

#[test]
fn sharegpt_takes_first_turns_and_filters_like_vllm() {
    let tok = tok();
    let long = "word ".repeat(1500);
    let json = serde_json::json!([
        {"conversations": [{"from": "human", "value": "Tell me a story about a brave little toaster please"},
                           {"from": "gpt", "value": "Once upon a time there was a toaster who was very brave indeed"}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, how can I help you today?"}]},
        {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "That is a lot of words, is it not?"}]},
        {"conversations": [{"from": "human", "value": "Only a question with no answer"}]}
    ]);
    let p = tmp("sg.json", &json.to_string());
    let a = dataset::sharegpt(&p, 10, None, 0, &tok).unwrap();
    assert_eq!(a.len(), 1, "{a:?}");
    assert!(a[0].prompt.starts_with("Tell me"));
    let out = tok.encode("Once upon a time there was a toaster who was very brave indeed", false).unwrap().len();
    assert_eq!(a[0].output_len, out);
    let fixed = dataset::sharegpt(&p, 10, Some(3), 0, &tok).unwrap();
    assert_eq!(fixed[0].output_len, 3);
}

#[test]
fn mooncake_equal_hash_prefixes_give_equal_text_prefixes() {
    let tok = tok();
    let lines = [
        r#"{"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [7, 8, 9]}"#,
        r#"{"timestamp": 300, "input_length": 36, "output_length": 6, "hash_ids": [7, 8, 11]}"#,
        r#"{"timestamp": 600, "input_length": 50, "output_length": 7, "hash_ids": [1]}"#,
    ];
    let p = tmp("trace.jsonl", &lines.join("\n"));
    let spec = DatasetSpec::Mooncake { path: p, block_size: 16 };
    let a = dataset::load(&spec, None, 0, &tok).unwrap();
    assert_eq!(a.len(), 3);
    assert_eq!(a.iter().map(|r| r.timestamp_s.unwrap()).collect::<Vec<_>>(), vec![0.0, 0.3, 0.6]);
    assert_eq!(a.iter().map(|r| r.output_len).collect::<Vec<_>>(), vec![5, 6, 7]);
    let common = a[0].prompt.chars().zip(a[1].prompt.chars()).take_while(|(x, y)| x == y).count();
    let shared = tok.encode(&a[0].prompt.chars().take(common).collect::<String>(), false).unwrap().len();
    assert!(shared >= 28, "blocks 7 and 8 (32 tokens) should be shared, got {shared}");
    assert!(!a[2].prompt.starts_with(&a[0].prompt.chars().take(8).collect::<String>()));
    // Lengths are close to the trace's (blocks are decoded one by one, so a boundary may merge).
    for (r, want) in a.iter().zip([40usize, 36, 50]) {
        assert!(r.prompt_len.abs_diff(want) <= 6, "{} vs {want}", r.prompt_len);
    }
    assert_eq!(a, dataset::load(&spec, None, 99, &tok).unwrap(), "trace prompts depend on hash ids only");
}

#[test]
fn random_prompts_are_adjusted_to_the_exact_target() {
    let tok = tok();
    for input_len in [1usize, 7, 64, 300] {
        let spec = RandomSpec { input_len, output_len: 1, range_ratio: 0.0, prefix_len: 5 };
        let a = dataset::random(&spec, 20, 11, &tok).unwrap();
        let exact = a.iter().filter(|r| r.prompt_len == input_len + 5).count();
        assert!(
            exact >= 18,
            "input_len {input_len}: {exact}/20 exact: {:?}",
            a.iter().map(|r| r.prompt_len).collect::<Vec<_>>()
        );
    }
}
