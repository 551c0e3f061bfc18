//! A small llama GGUF in each block format the kernels multiply (every linear weight and the
//! tied embedding in that format), loaded with its weights kept quantized and dequantized to f32
//! at load: same fingerprint, bytes per step as the formats say, and logits that agree: a
//! prefill of 20 tokens (the f32 micro-kernel on decoded panels: f32 rounding apart) and a
//! decode step (the integer kernels: within the 8-bit activations' noise), with the q/k rows
//! un-permuted alike on both paths (the file holds them in llama.cpp's order).

use cleave_kernels::cpu::CpuBackend;
use cleave_kernels::quant::synthetic_blocks;
use cleave_kernels::{AttnSeq, QuantFormat};

use super::gguf::reader::MetaValue;
use super::gguf::writer::{strs, GgufWriter};
use super::gguf::GgmlType;
use super::{ForwardBatch, KvSpec, KvStorage, LoadOptions, Model, ModelFiles};

const HIDDEN: usize = 256;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const FF: usize = 512;
const LAYERS: usize = 2;

fn vocab() -> Vec<String> {
    let mut v: Vec<String> = vec!["<|end|>".into()];
    v.extend(('!'..='~').map(String::from));
    v.push("he".into());
    v
}

fn ggml_type(format: QuantFormat) -> GgmlType {
    (0..40).filter_map(GgmlType::from_u32).find(|t| t.quant_format() == Some(format)).expect("a ggml type")
}

/// A llama GGUF whose linear weights and tied embedding are random blocks of `format`.
fn model(format: QuantFormat) -> Vec<u8> {
    model_with(format, 1.0)
}

/// [`model`] with every norm weight `gain`.
fn model_with(format: QuantFormat, gain: f32) -> Vec<u8> {
    let n_vocab = vocab().len();
    let mut seed = 0;
    let mut quant = |w: GgufWriter, name: &str, [n, k]: [usize; 2]| {
        seed += 1;
        let blocks = synthetic_blocks(format, n * k / format.block_values(), seed);
        w.tensor(name, &[k as u64, n as u64], ggml_type(format), blocks)
    };
    let norm = |n: usize| vec![gain; n];
    let mut w = GgufWriter::new()
        .kv("general.architecture", MetaValue::String("llama".into()))
        .kv("llama.embedding_length", MetaValue::U32(HIDDEN as u32))
        .kv("llama.feed_forward_length", MetaValue::U32(FF as u32))
        .kv("llama.block_count", MetaValue::U32(LAYERS as u32))
        .kv("llama.attention.head_count", MetaValue::U32(HEADS as u32))
        .kv("llama.attention.head_count_kv", MetaValue::U32(KV_HEADS as u32))
        .kv("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5))
        .kv("llama.context_length", MetaValue::U32(64))
        .kv("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .kv("tokenizer.ggml.tokens", strs(&vocab()))
        .kv("tokenizer.ggml.merges", strs(&["h e"]))
        .kv("tokenizer.ggml.eos_token_id", MetaValue::U32(0))
        .f32_tensor("output_norm.weight", &[HIDDEN], &norm(HIDDEN));
    w = quant(w, "token_embd.weight", [n_vocab, HIDDEN]);
    for l in 0..LAYERS {
        let p = |s: &str| format!("blk.{l}.{s}");
        w = w.f32_tensor(&p("attn_norm.weight"), &[HIDDEN], &norm(HIDDEN));
        w = w.f32_tensor(&p("ffn_norm.weight"), &[HIDDEN], &norm(HIDDEN));
        for (name, shape) in [
            ("attn_q.weight", [HEADS * HEAD_DIM, HIDDEN]),
            ("attn_k.weight", [KV_HEADS * HEAD_DIM, HIDDEN]),
            ("attn_v.weight", [KV_HEADS * HEAD_DIM, HIDDEN]),
            ("attn_output.weight", [HIDDEN, HEADS * HEAD_DIM]),
            ("ffn_gate.weight", [FF, HIDDEN]),
            ("ffn_up.weight", [FF, HIDDEN]),
            ("ffn_down.weight", [HIDDEN, FF]),
        ] {
            w = quant(w, &p(name), shape);
        }
    }
    w.build()
}

/// Logits of a prefill of `tokens[..len - 1]` (every row) and of a decode step of the last.
fn logits(model: &Model<CpuBackend>, backend: &CpuBackend, tokens: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let spec = KvSpec { num_blocks: 4, block_size: 16, dtype: cleave_protocol::KvDtype::F32 };
    let mut kv = KvStorage::new(backend, &model.config, spec).unwrap();
    let table = [2u32, 0, 3];
    let mut run = |start: usize, end: usize| {
        let positions: Vec<u32> = (start as u32..end as u32).collect();
        let slots: Vec<u32> = positions.iter().map(|&p| table[p as usize / 16] * 16 + p % 16).collect();
        let rows: Vec<u32> = (0..(end - start) as u32).collect();
        let seqs = [AttnSeq { q_start: 0, q_len: end - start, context_len: end, block_table: &table }];
        let batch = ForwardBatch {
            tokens: &tokens[start..end],
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logit_rows: &rows,
        };
        model.forward(backend, batch, &mut kv).unwrap()
    };
    let prefill = run(0, tokens.len() - 1);
    (prefill, run(tokens.len() - 1, tokens.len()))
}

/// Largest |a - b| over the largest |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn every_format_loads_quantized_and_agrees_with_its_dequantized_self() {
    let backend = CpuBackend::new(Some(2)).unwrap();
    let tokens: Vec<u32> = (0..21).map(|i| 1 + (i * 7) % 90).collect();
    for format in QuantFormat::ALL {
        let files = ModelFiles::from_gguf_bytes(std::path::Path::new("test.gguf"), model(format)).unwrap();
        let load = |dequantize_weights| {
            let opts = LoadOptions { dequantize_weights };
            Model::load_with(&backend, files.config.clone(), files.source.as_ref(), opts).unwrap()
        };
        let (quantized, dequantized) = (load(false), load(true));
        assert_eq!(quantized.fingerprint(), dequantized.fingerprint(), "{format}");
        let per_layer = HEADS * HEAD_DIM * HIDDEN * 2 + KV_HEADS * HEAD_DIM * HIDDEN * 2 + 3 * FF * HIDDEN;
        let values = LAYERS * per_layer + vocab().len() * HIDDEN;
        let bytes = quantized.weight_bytes(&backend);
        assert_eq!(bytes.per_step, values / format.block_values() * format.block_bytes(), "{format}");
        assert_eq!(bytes.by_format, vec![(format.name(), bytes.per_step)]);
        assert_eq!(dequantized.weight_bytes(&backend).per_step, 4 * values);

        let (qp, qd) = logits(&quantized, &backend, &tokens);
        let (fp, fd) = logits(&dequantized, &backend, &tokens);
        let (prefill, decode) = (rel_diff(&qp, &fp), rel_diff(&qd, &fd));
        println!("{format}: logits differ by {prefill:.2e} (prefill) and {decode:.2e} (decode) of their largest");
        // Prefill: the same f32 values in the same kernel (0 here: dequantized block values are
        // exact in f32). Decode: the 8-bit activations' rounding through two layers of random
        // weights, 0.03-2.3% of the largest logit by format; a misplaced row or block is O(1).
        assert!(prefill < 1e-4, "{format}: prefill logits differ by {prefill} of the largest");
        assert!(decode < 5e-2, "{format}: decode logits differ by {decode} of the largest");
    }
}

/// What nodes compare before exchanging KV is the model's identity: the same for every format
/// of one model, read from the files without loading a linear weight (as the coordinator reads
/// it) and equal to what a loaded engine's KV layout carries; the weights fingerprint, reported
/// beside it, differs between formats; a model with other norm weights is another model.
#[test]
fn the_identity_is_the_same_in_every_format_and_differs_for_another_model() {
    let open = |bytes| ModelFiles::from_gguf_bytes(std::path::Path::new("test.gguf"), bytes).unwrap();
    let backend = CpuBackend::new(Some(1)).unwrap();
    let mut identities = Vec::new();
    let mut weights = Vec::new();
    for format in QuantFormat::ALL {
        let files = open(model(format));
        let identity = files.identity().unwrap();
        let cfg = crate::EngineConfig { kv_cache_memory: 1 << 20, ..Default::default() };
        let core = crate::EngineCore::load(backend.clone(), files, &cfg).unwrap();
        assert_eq!(core.kv_layout().model_fingerprint, identity, "{format}: the coordinator's reading");
        assert_eq!(core.weights().format, format.name());
        identities.push(identity);
        weights.push(core.weights().fingerprint);
    }
    assert!(identities.iter().all(|&i| i == identities[0]), "{identities:x?}");
    weights.sort_unstable();
    weights.dedup();
    assert_eq!(weights.len(), QuantFormat::ALL.len(), "every format has its own weights fingerprint");
    let other = open(model_with(QuantFormat::Q4_1, 1.01)).identity().unwrap();
    assert_ne!(other, identities[0], "other norm weights: another model");
}

/// `cleave quantize`'s core: a file requantized into every format keeps the model's identity
/// (config, vocabulary and norms copied), reads back as that format, norms bit for bit and every
/// matrix close to the source's values. (Logits are not compared: this random-weight model is
/// chaotic enough that Q8_0's own rounding moves them; tests/quantize.rs checks answers on
/// SmolLM2.)
#[test]
fn a_requantized_file_is_the_same_model_in_another_format() {
    use super::gguf::quantize::requantize;
    use super::gguf::GgufFile;
    let backend = CpuBackend::new(Some(1)).unwrap();
    let source_bytes = model(QuantFormat::Q8_0);
    let source = ModelFiles::from_gguf_bytes(std::path::Path::new("src.gguf"), source_bytes.clone()).unwrap();
    let file = GgufFile::from_bytes(source_bytes).unwrap();
    for format in QuantFormat::ALL {
        let (image, report) = requantize(&file, format).unwrap();
        let out = GgufFile::from_bytes(image.clone()).unwrap();
        for r in &report {
            let (a, b) = (file.tensor_f32(&r.name).unwrap(), out.tensor_f32(&r.name).unwrap());
            if r.name.ends_with("norm.weight") {
                assert_eq!((r.to, &a), (GgmlType::F32, &b), "{format}: {}", r.name);
            } else {
                // Rows of 256 (HIDDEN) and 512 (FF) take every format without a fallback.
                assert_eq!(r.to, GgmlType::of_quant(format), "{}", r.name);
                let bound = if matches!(format, QuantFormat::Q8_0 | QuantFormat::Q6_K) { 0.02 } else { 0.2 };
                assert!(rel_diff(&b, &a) < bound, "{format}: {} off by {}", r.name, rel_diff(&b, &a));
            }
        }
        let files = ModelFiles::from_gguf_bytes(std::path::Path::new("out.gguf"), image).unwrap();
        assert_eq!(files.identity().unwrap(), source.identity().unwrap(), "{format}");
        let m =
            Model::load_with(&backend, files.config.clone(), files.source.as_ref(), LoadOptions::default()).unwrap();
        assert_eq!(m.weight_bytes(&backend).by_format, vec![(format.name(), m.weight_bytes(&backend).per_step)]);
    }
}

/// A quantized weight opened from a file is multiplied where it lies in the file's map: its
/// bytes are the map's (no heap copy) and they outlive the parsed file. The q/k rows that
/// llama.cpp permuted stay in the map too, in the file's order, and read back by output
/// feature in Hugging Face order.
#[test]
fn quantized_weights_are_used_in_place_in_the_map_permuted_rows_too() {
    use super::gguf::GgufModel;
    let dir = std::env::temp_dir().join(format!("cleave-mapped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    std::fs::write(&path, model(QuantFormat::Q4_1)).unwrap();
    let gguf = GgufModel::open(&path).unwrap();
    let in_file = |hf: &str| {
        let info = gguf.file().tensor(&super::gguf::model::gguf_name(hf).unwrap()).unwrap().clone();
        let b = gguf.file().tensor_bytes(&info);
        (b.as_ptr() as usize, b.to_vec())
    };
    let (down, q) = ("model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight");
    let ((down_at, down_bytes), (q_at, q_bytes)) = (in_file(down), in_file(q));
    let (dq, qq) = (gguf.tensor_quantized(down).unwrap().unwrap(), gguf.tensor_quantized(q).unwrap().unwrap());
    assert_eq!(dq.bytes().as_ptr() as usize, down_at, "the down projection is the map's bytes");
    assert_eq!(qq.bytes().as_ptr() as usize, q_at, "the permuted q projection is the map's bytes too");
    assert!(!dq.is_reordered() && qq.is_reordered());
    drop(gguf);
    // The weights keep the map alive after the parsed file is gone.
    assert_eq!(dq.bytes(), &down_bytes[..]);
    assert_eq!(qq.bytes(), &q_bytes[..], "stored in the file's order");
    let by_feature: Vec<u8> = (0..qq.n()).flat_map(|j| qq.row(j).to_vec()).collect();
    let rows = super::gguf::model::move_head_rows(&by_feature, qq.n(), HEADS, true).unwrap();
    assert_eq!(rows, q_bytes, "re-permuting the rows by feature gives the file's rows");
    std::fs::remove_dir_all(&dir).ok();
}
