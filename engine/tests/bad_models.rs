//! Malformed model files give clear errors that name the tensor, key or file at fault, and never
//! a panic: through `ModelFiles::open` and `EngineCore::load`, as a server would load a model.
//!
//! Each case starts from a valid synthetic model (`synth::write_model`) and breaks one thing;
//! GGUF cases are written byte by byte here. Two proptests feed truncated and corrupted files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use cleave_engine::model::synth::{self, SynthDtype, SynthSpec};
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineError};
use cleave_kernels::cpu::CpuBackend;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

/// A fresh folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    /// `tag` is for the reader only: it is not part of the name, so that no assertion on an
    /// error message can be satisfied by the folder's name.
    fn new(_tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cleave-badmodel-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spec() -> SynthSpec {
    SynthSpec {
        vocab_size: 300,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_word_embeddings: false,
    }
}

/// A valid model folder.
fn good_model(tag: &str) -> TempDir {
    let dir = TempDir::new(tag);
    synth::write_model(&spec(), 3, SynthDtype::F32, &dir.0).unwrap();
    dir
}

/// Opens and loads `path` the way a server does; the error, or "loaded".
fn load(path: &Path) -> Result<(), EngineError> {
    let files = ModelFiles::open(path)?;
    let cfg = EngineConfig { kv_cache_memory: 1 << 20, ..EngineConfig::default() };
    EngineCore::load(CpuBackend::default(), files, &cfg).map(|_| ())
}

/// The error message of loading `path`, which must fail.
fn load_err(path: &Path) -> String {
    match load(path) {
        Ok(()) => panic!("{} loaded, but it is malformed", path.display()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("{}: {msg}", path.display());
            msg
        }
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error message {msg:?} does not mention {p:?}");
    }
}

/// One tensor, owned.
struct Owned {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Rewrites `dir/model.safetensors` after `edit` changed its tensor list.
fn edit_tensors(dir: &TempDir, edit: impl FnOnce(&mut Vec<Owned>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<Owned> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| Owned { name, dtype: t.dtype(), shape: t.shape().to_vec(), data: t.data().to_vec() })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|t| (t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap())).collect();
    std::fs::remove_file(&path).unwrap();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn edit_config(dir: &TempDir, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

#[test]
fn the_unbroken_model_loads() {
    let dir = good_model("good");
    load(&dir.0).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = good_model("missing");
    let name = "model.layers.1.mlp.up_proj.weight";
    edit_tensors(&dir, |t| t.retain(|t| t.name != name));
    assert_mentions(&load_err(&dir.0), &[name, "missing"]);
}

#[test]
fn missing_lm_head_of_an_untied_model_is_named() {
    let dir = good_model("no-lm-head");
    edit_tensors(&dir, |t| t.retain(|t| t.name != "lm_head.weight"));
    assert_mentions(&load_err(&dir.0), &["lm_head.weight"]);
}

#[test]
fn missing_bias_of_a_qwen2_model_is_named() {
    let dir = good_model("qwen2-no-bias");
    edit_config(&dir, |c| {
        c.insert("architectures".into(), serde_json::json!(["Qwen2ForCausalLM"]));
        c.remove("attention_bias");
    });
    assert_mentions(&load_err(&dir.0), &["model.layers.0.self_attn.q_proj.bias"]);
}

#[test]
fn wrong_shape_names_both_shapes() {
    let dir = good_model("shape");
    let name = "model.layers.0.self_attn.k_proj.weight";
    edit_tensors(&dir, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        assert_eq!(t.shape, vec![16, 32]);
        t.shape = vec![32, 16];
    });
    assert_mentions(&load_err(&dir.0), &[name, "[32, 16]", "[16, 32]"]);
}

#[test]
fn vocab_size_disagreeing_with_the_embeddings_is_a_shape_error() {
    let dir = good_model("vocab");
    edit_config(&dir, |c| {
        c.insert("vocab_size".into(), 301.into());
    });
    assert_mentions(&load_err(&dir.0), &["model.embed_tokens.weight", "[300, 32]", "[301, 32]"]);
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = good_model("dtype");
    let name = "model.layers.0.input_layernorm.weight";
    edit_tensors(&dir, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        t.dtype = Dtype::I32; // same element size as the F32 data it replaces
    });
    assert_mentions(&load_err(&dir.0), &[name, "I32"]);
}

#[test]
fn truncated_safetensors_is_an_error_naming_the_file() {
    let dir = good_model("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for keep in [bytes.len() - 1, bytes.len() / 2, 100, 9, 8, 3, 0] {
        std::fs::write(&path, &bytes[..keep]).unwrap();
        assert_mentions(&load_err(&dir.0), &["model.safetensors", "truncated"]);
    }
}

#[test]
fn absurd_safetensors_header_length_is_an_error() {
    let dir = good_model("header-len");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert_mentions(&load_err(&dir.0), &["model.safetensors"]);
}

#[test]
fn missing_weights_file_names_the_folder() {
    let dir = good_model("no-weights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert_mentions(&load_err(&dir.0), &["model.safetensors", dir.0.to_str().unwrap()]);
}

#[test]
fn shard_index_naming_a_missing_shard_names_it() {
    let dir = good_model("shards");
    let index = serde_json::json!({
        "metadata": {},
        "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                       "lm_head.weight": "model-00002-of-00002.safetensors"}
    });
    std::fs::rename(dir.join("model.safetensors"), dir.join("model-00001-of-00002.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_mentions(&load_err(&dir.0), &["model-00002-of-00002.safetensors"]);
    std::fs::write(dir.join("model.safetensors.index.json"), b"{ not json").unwrap();
    assert_mentions(&load_err(&dir.0), &["model.safetensors.index.json"]);
}

#[test]
fn garbage_config_names_the_file() {
    let dir = good_model("config");
    for garbage in [&b"{ this is not json"[..], b"", b"[1, 2, 3]", b"\xff\xfe\x00garbage", b"{}"] {
        std::fs::write(dir.join("config.json"), garbage).unwrap();
        assert_mentions(&load_err(&dir.0), &["config.json"]);
    }
}

#[test]
fn bad_config_values_are_named() {
    for (key, value, expect) in [
        ("num_key_value_heads", serde_json::json!(3), "num_key_value_heads"),
        ("hidden_size", serde_json::json!(0), "hidden_size"),
        ("head_dim", serde_json::json!(7), "head_dim"),
        ("hidden_size", serde_json::json!("sixty-four"), "config.json"),
        ("hidden_act", serde_json::json!("gelu"), "gelu"),
        ("rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 4.0}), "yarn"),
        ("rope_scaling", serde_json::json!({"rope_type": "linear"}), "factor"),
        ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
    ] {
        let dir = good_model("config-values");
        edit_config(&dir, |c| {
            c.insert(key.into(), value.clone());
        });
        let msg = load_err(&dir.0);
        assert_mentions(&msg, &[expect]);
    }
}

#[test]
fn missing_config_keys_are_named() {
    for key in ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "architectures"] {
        let dir = good_model("config-missing");
        edit_config(&dir, |c| {
            c.remove(key);
        });
        assert_mentions(&load_err(&dir.0), &[key]);
    }
}

#[test]
fn unknown_architecture_is_named() {
    let dir = good_model("arch");
    edit_config(&dir, |c| {
        c.insert("architectures".into(), serde_json::json!(["GPTNeoXForCausalLM"]));
    });
    assert_mentions(&load_err(&dir.0), &["GPTNeoXForCausalLM", "LlamaForCausalLM"]);
}

#[test]
fn missing_or_garbage_tokenizer_names_the_file() {
    let dir = good_model("tokenizer");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert_mentions(&load_err(&dir.0), &["tokenizer.json"]);
    std::fs::write(dir.join("tokenizer.json"), b"{\"model\": 42}").unwrap();
    assert_mentions(&load_err(&dir.0), &["tokenizer.json"]);
}

#[test]
fn nonexistent_path_is_named() {
    let dir = TempDir::new("nothing");
    let path = dir.join("no-such-model");
    assert_mentions(&load_err(&path), &["no-such-model"]);
}

#[test]
fn kv_budget_below_one_block_is_refused() {
    let dir = good_model("kv");
    let files = ModelFiles::open(&dir.0).unwrap();
    let cfg = EngineConfig { kv_cache_memory: 10, ..EngineConfig::default() };
    let msg = EngineCore::load(CpuBackend::default(), files, &cfg).err().expect("a 10-byte KV cache").to_string();
    assert_mentions(&msg, &["10 bytes"]);
}

// ---------------------------------------------------------------------------------------------
// GGUF
// ---------------------------------------------------------------------------------------------

/// A GGUF byte stream written by hand (little endian, version 3).
struct Gguf(Vec<u8>);

impl Gguf {
    fn header(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(tensors.to_le_bytes());
        b.extend(kvs.to_le_bytes());
        Gguf(b)
    }

    fn str(mut self, s: &str) -> Self {
        self.0.extend((s.len() as u64).to_le_bytes());
        self.0.extend(s.as_bytes());
        self
    }

    /// A metadata pair with a string value (type 8).
    fn kv_str(self, key: &str, value: &str) -> Self {
        let mut g = self.str(key);
        g.0.extend(8u32.to_le_bytes());
        g.str(value)
    }

    /// A metadata pair with a u32 value (type 4).
    fn kv_u32(self, key: &str, value: u32) -> Self {
        let mut g = self.str(key);
        g.0.extend(4u32.to_le_bytes());
        g.0.extend(value.to_le_bytes());
        g
    }

    fn raw(mut self, bytes: &[u8]) -> Self {
        self.0.extend(bytes);
        self
    }
}

/// A small but plausible llama GGUF header: the metadata a loader reads first, one tensor info
/// and its (32-aligned) data.
fn plausible_gguf() -> Vec<u8> {
    let g = Gguf::header(3, 1, 7)
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.embedding_length", 32)
        .kv_u32("llama.block_count", 2)
        .kv_u32("llama.feed_forward_length", 48)
        .kv_u32("llama.attention.head_count", 4)
        .kv_u32("llama.context_length", 64)
        .kv_str("tokenizer.ggml.model", "gpt2")
        .str("token_embd.weight")
        .raw(&2u32.to_le_bytes())
        .raw(&32u64.to_le_bytes())
        .raw(&4u64.to_le_bytes())
        .raw(&0u32.to_le_bytes()) // F32
        .raw(&0u64.to_le_bytes());
    let mut b = g.0;
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(vec![0u8; 32 * 4 * 4]);
    b
}

fn gguf_err(tag: &str, bytes: &[u8]) -> String {
    let dir = TempDir::new(tag);
    let path = dir.join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    load_err(&path)
}

#[test]
fn gguf_with_garbage_bytes_is_an_error_naming_the_file() {
    let garbage: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let msg = gguf_err("garbage", &garbage);
    assert_mentions(&msg, &["model.gguf", "GGUF"]);
    assert_mentions(&gguf_err("empty", b""), &["model.gguf"]);
    assert_mentions(&gguf_err("magic-only", b"GGUF"), &["model.gguf"]);
}

#[test]
fn gguf_bad_version_is_named() {
    let msg = gguf_err("version", &Gguf::header(1, 0, 0).0);
    assert_mentions(&msg, &["version 1"]);
    let msg = gguf_err("version", &Gguf::header(99, 0, 0).0);
    assert_mentions(&msg, &["version 99"]);
}

#[test]
fn gguf_absurd_counts_and_lengths_are_errors_not_allocations() {
    gguf_err("tensors", &Gguf::header(3, u64::MAX, 0).0);
    gguf_err("kvs", &Gguf::header(3, 0, u64::MAX).0);
    // A key whose length runs past the end of the file.
    let g = Gguf::header(3, 0, 1).raw(&u64::MAX.to_le_bytes()).raw(b"general.architecture");
    gguf_err("key-len", &g.0);
    // An array value claiming u64::MAX elements.
    let g = Gguf::header(3, 0, 1).str("tokenizer.ggml.tokens").raw(&9u32.to_le_bytes()).raw(&8u32.to_le_bytes());
    gguf_err("array-len", &g.raw(&u64::MAX.to_le_bytes()).0);
    // An unknown value type.
    let g = Gguf::header(3, 0, 1).str("general.architecture").raw(&77u32.to_le_bytes());
    gguf_err("value-type", &g.0);
}

#[test]
fn gguf_without_architecture_or_with_an_unknown_one_is_named() {
    let msg = gguf_err("no-arch", &Gguf::header(3, 0, 0).0);
    assert_mentions(&msg, &["general.architecture"]);
    let msg = gguf_err("arch", &Gguf::header(3, 0, 1).kv_str("general.architecture", "mamba").0);
    assert_mentions(&msg, &["mamba"]);
}

#[test]
fn plausible_gguf_missing_most_of_a_model_is_an_error() {
    // The tokenizer and most tensors are absent: whatever is checked first must be named.
    let msg = gguf_err("plausible", &plausible_gguf());
    assert_mentions(&msg, &["model.gguf"]);
}

fn proptest_config(cases: u32, seed: u64) -> ProptestConfig {
    ProptestConfig { cases, rng_seed: RngSeed::Fixed(seed), failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(proptest_config(48, 0xbad0_0001))]

    /// Truncations and byte flips of a hand-written GGUF never panic.
    #[test]
    fn corrupted_gguf_never_panics(
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
    ) {
        let mut bytes = plausible_gguf();
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let dir = TempDir::new("gguf-prop");
        let path = dir.join("model.gguf");
        std::fs::write(&path, &bytes).unwrap();
        prop_assert!(load(&path).is_err());
    }
}

proptest! {
    #![proptest_config(proptest_config(24, 0xbad0_0002))]

    /// Truncating `model.safetensors` anywhere, or flipping bytes of its header, is an error or
    /// (for a flip that leaves the header valid and the shapes right) a model that loads; never a
    /// panic.
    #[test]
    fn corrupted_safetensors_never_panics(
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        truncate in any::<bool>(),
    ) {
        let dir = good_model("st-prop");
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        } else {
            for (at, x) in flips {
                let i = at.index(header_end);
                bytes[i] ^= x;
            }
        }
        std::fs::write(&path, &bytes).unwrap();
        let result = load(&dir.0);
        if truncate {
            prop_assert!(result.is_err());
        }
    }
}

/// Non-finite weights are not a file-format error (checkpoints are not scanned), but running
/// such a model must not panic anywhere: forward, greedy and seeded sampling, logprobs, stop
/// strings. The engine either errors or streams well-formed events to a final one.
#[test]
fn non_finite_weights_never_panic() {
    use cleave_protocol::{RequestId, SamplingParams, StopConditions};
    for (tensor, value) in [
        ("lm_head.weight", f32::NAN),
        ("model.layers.0.mlp.down_proj.weight", f32::INFINITY),
        ("model.norm.weight", f32::NEG_INFINITY),
    ] {
        let dir = good_model("non-finite");
        edit_tensors(&dir, |ts| {
            let t = ts.iter_mut().find(|t| t.name == tensor).unwrap();
            // Poison every other element, so some logits stay finite and some do not.
            for (i, chunk) in t.data.chunks_exact_mut(4).enumerate() {
                if i % 2 == 0 {
                    chunk.copy_from_slice(&value.to_le_bytes());
                }
            }
        });
        let files = ModelFiles::open(&dir.0).unwrap();
        let cfg = EngineConfig {
            kv_cache_memory: 1 << 20,
            max_num_batched_tokens: 8,
            max_num_seqs: 4,
            ..EngineConfig::default()
        };
        let mut core = EngineCore::load(CpuBackend::default(), files, &cfg).unwrap();
        let params = [
            SamplingParams { logprobs: Some(3), ..SamplingParams::default() },
            SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 5, seed: Some(1), ..SamplingParams::default() },
            SamplingParams {
                temperature: 1.0,
                min_p: 0.1,
                repetition_penalty: 1.2,
                seed: Some(2),
                logprobs: Some(2),
                ..SamplingParams::default()
            },
        ];
        for (id, p) in params.into_iter().enumerate() {
            let stop = StopConditions { max_tokens: 5, stop_strings: vec!["ab".into()], ..Default::default() };
            let req = cleave_engine::EngineRequest {
                id: RequestId(id as u64),
                prompt: vec![7, 8, 9, 10, 11, 12, 13],
                params: p,
                stop,
            };
            core.add_request(req, std::time::Instant::now()).unwrap();
        }
        let (mut finals, mut failed) = (0, false);
        for _ in 0..100 {
            if !core.has_work() {
                break;
            }
            match core.step(std::time::Instant::now()) {
                Ok(events) => finals += events.iter().filter(|e| e.finish_reason.is_some()).count(),
                Err(e) => {
                    eprintln!("{tensor} = {value}: step failed cleanly: {e}");
                    failed = true;
                    break;
                }
            }
        }
        assert!(failed || finals == 3, "{tensor} = {value}: {finals} of 3 requests finished");
    }
}
