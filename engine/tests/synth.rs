//! `model::synth`: synthetic models written to disk and read back by the engine's own loaders.

use std::path::{Path, PathBuf};

use cleave_engine::model::safetensors::SafetensorsSource;
use cleave_engine::model::synth::{self, SynthDtype, SynthSpec};
use cleave_engine::model::{ModelConfig, TensorSource};

/// A fresh folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cleave-synth-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny() -> SynthSpec {
    synth::preset("tiny").unwrap()
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap()
}

const FILES: [&str; 5] =
    ["config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors"];

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let (a, b, c) = (TempDir::new("seed-a"), TempDir::new("seed-b"), TempDir::new("seed-c"));
    let summary = synth::write_model(&tiny(), 42, SynthDtype::F32, &a.0).unwrap();
    assert_eq!(summary.files.len(), FILES.len());
    assert_eq!(summary.num_parameters, tiny().num_parameters());
    synth::write_model(&tiny(), 42, SynthDtype::F32, &b.0).unwrap();
    synth::write_model(&tiny(), 43, SynthDtype::F32, &c.0).unwrap();
    for name in FILES {
        assert_eq!(read(&a.0, name), read(&b.0, name), "{name} differs between two writes with one seed");
    }
    assert_ne!(read(&a.0, "model.safetensors"), read(&c.0, "model.safetensors"));
    // Only the weights depend on the seed.
    assert_eq!(read(&a.0, "tokenizer.json"), read(&c.0, "tokenizer.json"));
}

#[test]
fn loaders_read_back_every_tensor_with_its_shape() {
    for (tag, dtype, tied) in
        [("f32", SynthDtype::F32, false), ("bf16", SynthDtype::BF16, true), ("f16", SynthDtype::F16, false)]
    {
        let dir = TempDir::new(tag);
        let spec = SynthSpec { tie_word_embeddings: tied, ..tiny() };
        synth::write_model(&spec, 1, dtype, &dir.0).unwrap();

        let c = ModelConfig::from_dir(&dir.0).unwrap();
        assert_eq!(c.vocab_size, 4096);
        assert_eq!((c.hidden_size, c.intermediate_size, c.num_layers), (64, 172, 2));
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
        assert_eq!(c.max_position_embeddings, 2048);
        assert_eq!(c.tie_word_embeddings, tied);
        assert_eq!(c.bos_token_id, Some(synth::ENDOFTEXT_ID));
        assert_eq!(c.eos_token_ids, vec![synth::ENDOFTEXT_ID, synth::IM_END_ID]);
        assert_eq!(c.num_parameters(), spec.num_parameters());

        let src = SafetensorsSource::open_dir(&dir.0).unwrap();
        let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qd, kvd) = (c.num_heads * c.head_dim, c.kv_width());
        let mut expected: Vec<(String, Vec<usize>)> =
            vec![("model.embed_tokens.weight".into(), vec![v, h]), ("model.norm.weight".into(), vec![h])];
        if !tied {
            expected.push(("lm_head.weight".into(), vec![v, h]));
        }
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            for (name, shape) in [
                ("input_layernorm", vec![h]),
                ("post_attention_layernorm", vec![h]),
                ("self_attn.q_proj", vec![qd, h]),
                ("self_attn.k_proj", vec![kvd, h]),
                ("self_attn.v_proj", vec![kvd, h]),
                ("self_attn.o_proj", vec![h, qd]),
                ("mlp.gate_proj", vec![i, h]),
                ("mlp.up_proj", vec![i, h]),
                ("mlp.down_proj", vec![h, i]),
            ] {
                expected.push((format!("{p}.{name}.weight"), shape));
            }
        }
        assert_eq!(src.names().count(), expected.len());
        for (name, shape) in &expected {
            let w = src.load(name, shape).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(w.iter().all(|x| x.is_finite()), "{name}");
            if name.ends_with("norm.weight") {
                assert!(w.iter().all(|&x| (0.59..=1.41).contains(&x)), "{name} gains out of U(0.6, 1.4)");
            } else {
                let rms = (w.iter().map(|&x| (x * x) as f64).sum::<f64>() / w.len() as f64).sqrt();
                assert!(rms > 0.01 && rms < 2.0, "{name} rms {rms}");
            }
        }
        assert_eq!(src.contains("lm_head.weight"), !tied);
    }
}

#[test]
fn tokenizer_has_exactly_vocab_size_tokens_and_round_trips() {
    let dir = TempDir::new("tok");
    synth::write_model(&tiny(), 0, SynthDtype::F32, &dir.0).unwrap();
    let t = tokenizers::Tokenizer::from_file(dir.0.join("tokenizer.json")).unwrap();
    assert_eq!(t.get_vocab_size(true), 4096);
    let max_id = t.get_vocab(true).values().copied().max().unwrap();
    assert_eq!(max_id, 4095, "ids are dense");
    for text in
        ["The capital of France is Paris.", "héllo wörld ✓ — “quotes”", "🦀 + 🚀 = ❤️", "fn x() -> u32 { 42 }\n"]
    {
        let ids = t.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.iter().all(|&id| id < 4096));
        assert_eq!(t.decode(&ids, false).unwrap(), text);
    }
    let config: serde_json::Value = serde_json::from_slice(&read(&dir.0, "tokenizer_config.json")).unwrap();
    assert!(config["chat_template"].as_str().unwrap().contains("<|im_start|>"));
    assert_eq!(config["eos_token"], "<|endoftext|>");
    assert_eq!(config["bos_token"], "<|endoftext|>");
}

#[test]
fn unknown_preset_lists_the_presets() {
    assert!(synth::preset("huge").is_none());
    let e = synth::preset_or_err("huge").unwrap_err().to_string();
    assert!(e.contains("huge"), "{e}");
    for p in synth::PRESETS {
        assert!(e.contains(p.name), "{e}");
    }
}

#[test]
fn unwritable_output_is_a_clear_error() {
    let dir = TempDir::new("unwritable");
    let file = dir.0.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let out = file.join("model");
    let e = synth::write_model(&tiny(), 0, SynthDtype::F32, &out).unwrap_err().to_string();
    assert!(e.contains("cannot write") && e.contains("a-file"), "{e}");
}

/// The benchmark preset end to end: `cargo test -p cleave-engine --test synth -- --ignored --nocapture`.
#[test]
#[ignore = "writes ~400 MB; run by hand to time it"]
fn base_100m_writes_and_loads() {
    let dir = TempDir::new("base-100m");
    let spec = synth::preset("base-100m").unwrap();
    let start = std::time::Instant::now();
    let summary = synth::write_model(&spec, 0, SynthDtype::F32, &dir.0).unwrap();
    eprintln!(
        "base-100m: {} parameters, {} bytes in {:?}",
        summary.num_parameters,
        summary.weight_bytes,
        start.elapsed()
    );
    let bytes = read(&dir.0, "model.safetensors");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(bytes.len() as u64, summary.weight_bytes);
    assert_eq!(bytes.len(), 8 + header_len + summary.num_parameters * 4);
    let t = tokenizers::Tokenizer::from_file(dir.0.join("tokenizer.json")).unwrap();
    assert_eq!(t.get_vocab_size(true), 32000);
    let c = ModelConfig::from_dir(&dir.0).unwrap();
    assert!(c.tie_word_embeddings);
    assert_eq!(c.num_parameters(), summary.num_parameters);
}

#[cfg(unix)]
#[test]
fn weights_get_the_same_mode_as_the_other_files() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("mode");
    synth::write_model(&tiny(), 0, SynthDtype::F32, &dir.0).unwrap();
    let mode = |name: &str| std::fs::metadata(dir.0.join(name)).unwrap().permissions().mode();
    assert_eq!(mode("model.safetensors"), mode("config.json"));
}

/// Logits of every position of `prompt` (one sequence, fresh KV cache).
fn all_logits(dir: &Path, prompt: &[u32]) -> (usize, Vec<f32>) {
    use cleave_engine::model::{ForwardBatch, KvSpec, KvStorage, Model};
    use cleave_kernels::{cpu::CpuBackend, AttnSeq};
    use cleave_protocol::KvDtype;
    let backend = CpuBackend::new(Some(1)).unwrap();
    let config = ModelConfig::from_dir(dir).unwrap();
    let vocab = config.vocab_size;
    let model = Model::load(&backend, config.clone(), &SafetensorsSource::open_dir(dir).unwrap()).unwrap();
    let block_size = 16;
    let blocks: Vec<u32> = (0..prompt.len().div_ceil(block_size) as u32).collect();
    let mut kv =
        KvStorage::new(&backend, &config, KvSpec { num_blocks: blocks.len(), block_size, dtype: KvDtype::F32 })
            .unwrap();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let seqs = [AttnSeq { q_start: 0, q_len: prompt.len(), context_len: prompt.len(), block_table: &blocks }];
    let batch =
        ForwardBatch { tokens: prompt, positions: &positions, slots: &positions, seqs: &seqs, logit_rows: &positions };
    (vocab, model.forward(&backend, batch, &mut kv).unwrap())
}

/// Per-row (std of the logits, top-1 softmax probability, argmax).
fn logit_stats(vocab: usize, logits: &[f32]) -> Vec<(f64, f64, usize)> {
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let n = vocab as f64;
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / n;
            let std = (row.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            let (argmax, max) =
                row.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
            let z: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
            (std, 1.0 / z, argmax)
        })
        .collect()
}

#[test]
fn logits_are_spread_and_depend_on_the_input() {
    for tied in [false, true] {
        let dir = TempDir::new(if tied { "logits-tied" } else { "logits" });
        synth::write_model(&SynthSpec { tie_word_embeddings: tied, ..tiny() }, 0, SynthDtype::F32, &dir.0).unwrap();
        let prompt: Vec<u32> = (0..24).map(|i| 100 + i * 37).collect();
        let (vocab, logits) = all_logits(&dir.0, &prompt);
        let stats = logit_stats(vocab, &logits);
        for &(std, top1, _) in &stats {
            assert!((1.0..10.0).contains(&std), "tied={tied}: logit std {std}");
            assert!(top1 < 0.99, "tied={tied}: top-1 probability {top1}");
        }
        let mut argmax: Vec<usize> = stats.iter().map(|s| s.2).collect();
        argmax.sort_unstable();
        argmax.dedup();
        assert!(argmax.len() >= 8, "tied={tied}: only {} distinct argmax over 24 positions", argmax.len());
    }
}

/// The model builds each step's RoPE rows from its positions (it keeps no table of every
/// position), and still refuses a position past `max_position_embeddings`, with the position
/// named, where the table used to end.
#[test]
fn a_position_past_the_models_positions_is_refused() {
    use cleave_engine::model::{ForwardBatch, KvSpec, KvStorage, Model};
    use cleave_kernels::{cpu::CpuBackend, AttnSeq};
    use cleave_protocol::KvDtype;
    let dir = TempDir::new("positions");
    synth::write_model(&tiny(), 1, SynthDtype::F32, &dir.0).unwrap();
    let backend = CpuBackend::new(Some(1)).unwrap();
    let config = ModelConfig::from_dir(&dir.0).unwrap();
    let max = config.max_position_embeddings as u32;
    let model = Model::load(&backend, config.clone(), &SafetensorsSource::open_dir(&dir.0).unwrap()).unwrap();
    let spec = KvSpec { num_blocks: 2, block_size: 16, dtype: KvDtype::F32 };
    let mut kv = KvStorage::new(&backend, &config, spec).unwrap();
    let table = [0u32, 1];
    let seqs = [AttnSeq { q_start: 0, q_len: 2, context_len: 2, block_table: &table }];
    let forward = |kv: &mut KvStorage<CpuBackend>, positions: &[u32]| {
        let batch = ForwardBatch { tokens: &[5, 6], positions, slots: &[0, 1], seqs: &seqs, logit_rows: &[1] };
        model.forward(&backend, batch, kv)
    };
    assert!(forward(&mut kv, &[max - 2, max - 1]).is_ok());
    let err = forward(&mut kv, &[max - 1, max]).unwrap_err().to_string();
    assert!(err.contains(&format!("position {max} of token 1")), "{err}");
}
