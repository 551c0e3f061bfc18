//! Hugging Face checkpoints in bf16 and f16 (the tiny reference model with every tensor rounded
//! to 16 bits, written as a real safetensors folder) keep their linear weights in 16 bits: half
//! the bytes a decode step reads of the f32 load, and, because the kernels widen each weight to
//! f32 exactly and sum in the f32 kernel's order, logits bit for bit those of the same file
//! widened to f32 at load (`dequantize_weights`), over prefill chunks (the widened-panel path)
//! and small batches (the in-register path) alike.

mod common;

use std::path::{Path, PathBuf};

use cleave_engine::model::{LoadOptions, Model, ModelFiles};
use cleave_engine::{EngineConfig, EngineCore};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::KvDtype;
use common::{fixture, perplexity, tiny_llama_dir};
use safetensors::tensor::{Dtype, TensorView};

/// A copy of the tiny model's folder in `dir` with every tensor stored as `dtype` (rounded to
/// nearest, as `torch.to(dtype)` does).
fn write_16_bit_copy(dir: &Path, dtype: Dtype) {
    std::fs::create_dir_all(dir).unwrap();
    let src = tiny_llama_dir();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let data: Vec<u8> = view
            .data()
            .chunks_exact(4)
            .flat_map(|b| {
                let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                match dtype {
                    Dtype::BF16 => half::bf16::from_f32(x).to_le_bytes(),
                    _ => half::f16::from_f32(x).to_le_bytes(),
                }
            })
            .collect();
        tensors.push((name, view.shape().to_vec(), data));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| (name.clone(), TensorView::new(dtype, shape.clone(), data).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cleave-half-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn a_16_bit_checkpoint_stays_in_16_bits_and_computes_as_its_widened_self() {
    let backend = CpuBackend::new(Some(2)).unwrap();
    let original = ModelFiles::open(&tiny_llama_dir()).unwrap();
    let f32_bytes = {
        let m = Model::load_with(&backend, original.config.clone(), original.source.as_ref(), LoadOptions::default())
            .unwrap();
        m.weight_bytes(&backend).per_step
    };
    let tokens = original.tokenizer.encode(&fixture("perplexity_text.txt"), true).unwrap();
    let tokens = &tokens[..tokens.len().min(200)];
    for (dtype, name) in [(Dtype::BF16, "bf16"), (Dtype::F16, "f16")] {
        let dir = scratch(name);
        write_16_bit_copy(&dir, dtype);
        let files = ModelFiles::open(&dir).unwrap();
        let load = |dequantize_weights| {
            Model::load_with(&backend, files.config.clone(), files.source.as_ref(), LoadOptions { dequantize_weights })
                .unwrap()
        };
        let (half, widened) = (load(false), load(true));
        let bytes = half.weight_bytes(&backend);
        assert_eq!(bytes.by_format, vec![(name, bytes.per_step)], "{name}: every linear weight in 16 bits");
        assert_eq!(2 * bytes.per_step, f32_bytes, "{name}: half the bytes of the f32 checkpoint");
        assert_eq!(widened.weight_bytes(&backend).per_step, f32_bytes, "{name}: --dequantize-weights widens");
        assert_eq!(half.fingerprint(), widened.fingerprint(), "{name}: the same values either way");
        assert_eq!(half.identity(), widened.identity(), "{name}");
        // Teacher-forced perplexity keeps every position's logits: chunks of 64 tokens (widened
        // panels) and of 8 (weights widened in registers), through a paged cache.
        let (p_half, p_widened) =
            (perplexity(&half, &backend, tokens, KvDtype::F32), perplexity(&widened, &backend, tokens, KvDtype::F32));
        println!("{name}: perplexity {p_half} in 16 bits, {p_widened} widened to f32");
        assert_eq!(p_half.to_bits(), p_widened.to_bits(), "{name}: logits bit for bit");
        // The engine reports the format to the cluster.
        let cfg = EngineConfig { kv_cache_memory: 1 << 20, ..Default::default() };
        let core = EngineCore::load(backend.clone(), ModelFiles::open(&dir).unwrap(), &cfg).unwrap();
        assert_eq!(core.weights().format, name);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A bf16 checkpoint is the same model as its f32 original to the cluster (nodes holding either
/// may exchange KV): the identity rounds norms to bf16 and ignores the weights' format.
#[test]
fn a_bf16_checkpoint_has_the_identity_of_its_f32_original() {
    let dir = scratch("identity");
    write_16_bit_copy(&dir, Dtype::BF16);
    let (original, copy) = (ModelFiles::open(&tiny_llama_dir()).unwrap(), ModelFiles::open(&dir).unwrap());
    assert_eq!(copy.identity().unwrap(), original.identity().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}
