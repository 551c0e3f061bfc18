//! Reader and model-mapping tests on synthetic files built with [`GgufWriter`].

use super::dequant::GgmlType;
use super::model::{gguf_name, hf_name, unpermute_rows};
use super::reader::{GgufFile, MetaValue};
use super::writer::{f32_bytes, strs, GgufWriter};
use super::{GgufError, GgufModel};

fn sample() -> GgufWriter {
    GgufWriter::new()
        .kv("general.architecture", MetaValue::String("llama".into()))
        .kv("a.u8", MetaValue::U8(7))
        .kv("a.i8", MetaValue::I8(-7))
        .kv("a.u16", MetaValue::U16(65000))
        .kv("a.i16", MetaValue::I16(-32000))
        .kv("a.u32", MetaValue::U32(4_000_000_000))
        .kv("a.i32", MetaValue::I32(-2_000_000_000))
        .kv("a.f32", MetaValue::F32(1.5))
        .kv("a.bool", MetaValue::Bool(true))
        .kv("a.u64", MetaValue::U64(u64::MAX))
        .kv("a.i64", MetaValue::I64(i64::MIN))
        .kv("a.f64", MetaValue::F64(-2.25))
        .kv("a.strs", strs(&["x", "", "ünï"]))
        .kv(
            "a.nested",
            MetaValue::Array {
                elem_type: 9,
                items: vec![
                    MetaValue::Array { elem_type: 4, items: vec![MetaValue::U32(1), MetaValue::U32(2)] },
                    MetaValue::Array { elem_type: 4, items: vec![] },
                ],
            },
        )
        .tensor("w", &[4, 2], GgmlType::F32, f32_bytes(&[0., 1., 2., 3., 4., 5., 6., 7.]))
        .tensor("v", &[3], GgmlType::F32, f32_bytes(&[9., 8., 7.]))
}

fn parse(w: &GgufWriter) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(w.build())
}

#[test]
fn every_value_type_round_trips() {
    let w = sample();
    let f = parse(&w).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    for (k, v) in &w.kvs {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.get_u64("a.u32").unwrap(), Some(4_000_000_000));
    assert!(f.get_u64("a.i64").is_err(), "negative is not a u64");
    assert_eq!(f.get_f32("a.f64").unwrap(), Some(-2.25));
    assert_eq!(f.get_bool("a.bool").unwrap(), Some(true));
    assert_eq!(f.get_u64("missing").unwrap(), None);
    let e = f.get_str("a.u8").unwrap_err();
    assert!(e.to_string().contains("a.u8") && e.to_string().contains("u8"), "{e}");
    let t = f.tensor("w").unwrap();
    assert_eq!((t.hf_shape(), t.n_elements, t.n_bytes), (vec![2, 4], 8, 32));
    assert_eq!(f.tensor_f32("w").unwrap(), vec![0., 1., 2., 3., 4., 5., 6., 7.]);
    assert_eq!(f.tensor_f32("v").unwrap(), vec![9., 8., 7.]);
    assert_eq!(f.tensor("v").unwrap().offset, 32);
}

#[test]
fn version_2_and_custom_alignment() {
    let mut w = sample().kv("general.alignment", MetaValue::U32(64));
    w.version = 2;
    w.alignment = 64;
    let f = parse(&w).unwrap();
    assert_eq!((f.version(), f.alignment()), (2, 64));
    assert_eq!(f.tensor("v").unwrap().offset, 64);
    assert_eq!(f.tensor_f32("v").unwrap(), vec![9., 8., 7.]);

    let e = parse(&sample().kv("general.alignment", MetaValue::U32(3))).unwrap_err();
    assert!(matches!(e, GgufError::BadAlignment { alignment: 3 }), "{e}");
}

#[test]
fn bad_magic_and_versions() {
    let mut b = sample().build();
    b[0] = b'X';
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    let mut w = sample();
    w.version = 1;
    let e = parse(&w).unwrap_err();
    assert!(e.to_string().contains("v1"), "{e}");
    w.version = 3u32.swap_bytes();
    assert!(parse(&w).unwrap_err().to_string().contains("big-endian"));
    assert!(matches!(GgufFile::from_bytes(b"GGU".to_vec()).unwrap_err(), GgufError::Truncated { .. }));
}

#[test]
fn every_truncation_is_a_clean_error() {
    let full = sample().build();
    for cut in 0..full.len() {
        let e = GgufFile::from_bytes(full[..cut].to_vec()).unwrap_err();
        match e {
            GgufError::Truncated { .. } | GgufError::TooLarge { .. } => {}
            GgufError::TensorOutOfBounds { ref name, .. } => {
                assert!(name == "w" || name == "v", "{e}")
            }
            other => panic!("cut at {cut}: unexpected {other}"),
        }
    }
}

#[test]
fn absurd_counts_are_refused_before_allocating() {
    let mut b = sample().build();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(e, GgufError::TooLarge { .. }), "{e}");

    let mut b = sample().build();
    b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes()); // kv count
    assert!(matches!(GgufFile::from_bytes(b).unwrap_err(), GgufError::TooLarge { .. }));

    // An array claiming 2^62 strings, right after its header.
    let w = GgufWriter::new().kv("big.array", strs(&["a"]));
    let mut b = w.build();
    let len_at = 24 + 8 + "big.array".len() + 4 + 4;
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(e.to_string().contains("big.array"), "{e}");

    // A string claiming 2^63 bytes.
    let w = GgufWriter::new().kv("big.str", MetaValue::String("abc".into()));
    let mut b = w.build();
    let len_at = 24 + 8 + "big.str".len() + 4;
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 63).to_le_bytes());
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }) && e.to_string().contains("big.str"), "{e}");
}

#[test]
fn unknown_types_name_the_key_or_tensor() {
    let mut b = GgufWriter::new().kv("odd.key", MetaValue::U8(1)).build();
    let ty_at = 24 + 8 + "odd.key".len();
    b[ty_at..ty_at + 4].copy_from_slice(&77u32.to_le_bytes());
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(e, GgufError::UnknownValueType { ref key, ty: 77 } if key == "odd.key"), "{e}");

    let e = parse(&GgufWriter::new().tensor_raw("blk.0.odd", &[32], 99, vec![0; 64])).unwrap_err();
    assert!(e.to_string().contains("blk.0.odd") && e.to_string().contains("99"), "{e}");
    // Removed ggml ids (4, 5) are unknown too.
    assert!(parse(&GgufWriter::new().tensor_raw("t", &[32], 4, vec![0; 64])).is_err());

    let deep = (0..6).fold(MetaValue::U8(1), |inner, _| MetaValue::Array {
        elem_type: if matches!(inner, MetaValue::U8(_)) { 0 } else { 9 },
        items: vec![inner],
    });
    let e = parse(&GgufWriter::new().kv("deep", deep)).unwrap_err();
    assert!(matches!(e, GgufError::NestingTooDeep { .. }), "{e}");
}

#[test]
fn tensor_extents_are_checked() {
    let mut w = sample();
    w.offset_overrides.push((1, 1 << 20));
    let e = parse(&w).unwrap_err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { ref name, .. } if name == "v"), "{e}");

    let mut w = sample();
    w.offset_overrides.push((1, u64::MAX - 31));
    assert!(matches!(parse(&w).unwrap_err(), GgufError::TensorOutOfBounds { .. }));

    let mut w = sample();
    w.offset_overrides.push((1, 33));
    let e = parse(&w).unwrap_err();
    assert!(matches!(e, GgufError::MisalignedTensor { offset: 33, .. }), "{e}");

    let w = GgufWriter::new().tensor("q", &[16, 2], GgmlType::Q8_0, vec![0; 34]);
    let e = parse(&w).unwrap_err();
    assert!(e.to_string().contains("block of 32"), "{e}");

    let w = GgufWriter::new().tensor("r", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]);
    assert!(matches!(parse(&w).unwrap_err(), GgufError::BadShape { .. }));
    let w = GgufWriter::new().tensor("z", &[4, 0], GgmlType::F32, vec![]);
    assert!(matches!(parse(&w).unwrap_err(), GgufError::BadShape { .. }));
    let w = GgufWriter::new().tensor("o", &[1 << 40, 1 << 40], GgmlType::F32, vec![]);
    assert!(matches!(parse(&w).unwrap_err(), GgufError::BadShape { .. }));

    let w = sample().tensor("w", &[1], GgmlType::F32, vec![0; 4]);
    assert!(matches!(parse(&w).unwrap_err(), GgufError::DuplicateTensor { .. }));
    let w = sample().kv("a.u8", MetaValue::U8(1));
    assert!(matches!(parse(&w).unwrap_err(), GgufError::DuplicateKey { .. }));

    let f = parse(&GgufWriter::new().tensor("k3", &[256], GgmlType::Q3_K, vec![0; 110])).unwrap();
    let e = f.tensor_f32("k3").unwrap_err();
    assert!(e.to_string().contains("k3") && e.to_string().contains("Q3_K"), "{e}");
}

#[test]
fn corrupted_bytes_never_panic() {
    let full = tiny_llama().build();
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..3000 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let mut b = full.clone();
        let at = (s as usize) % b.len().min(4096);
        b[at] ^= (s >> 32) as u8 | 1;
        if let Ok(f) = GgufFile::from_bytes(b) {
            let _ = GgufModel::from_file(f);
        }
    }
}

// ---- model mapping -------------------------------------------------------------------------

const HIDDEN: usize = 32;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 16;
const FF: usize = 64;

fn ramp(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * k).collect()
}

/// llama.cpp's `permute` (convert_hf_to_gguf.py), written forward for the test.
fn permute(w: &[f32], rows: usize, heads: usize) -> Vec<f32> {
    let cols = w.len() / rows;
    let hd = rows / heads;
    let mut out = vec![0.0; w.len()];
    // out[h][i][half] = w[h][half][i]  (reshape(heads, 2, hd/2, cols).swapaxes(1, 2))
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..hd / 2 {
                let src = (h * hd + half * (hd / 2) + i) * cols;
                let dst = (h * hd + i * 2 + half) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

fn vocab() -> Vec<String> {
    let mut v: Vec<String> = vec!["<|end|>".into(), "\u{120}".into()];
    v.extend(('!'..='~').map(String::from));
    v.push("he".into());
    v
}

fn tiny_llama() -> GgufWriter {
    let n_vocab = vocab().len();
    let q = ramp(HEADS * HEAD_DIM * HIDDEN, 0.01);
    let k = ramp(KV_HEADS * HEAD_DIM * HIDDEN, 0.02);
    let mut types = vec![3i32];
    types.extend(std::iter::repeat_n(1, n_vocab - 1));
    GgufWriter::new()
        .kv("general.architecture", MetaValue::String("llama".into()))
        .kv("llama.embedding_length", MetaValue::U32(HIDDEN as u32))
        .kv("llama.feed_forward_length", MetaValue::U32(FF as u32))
        .kv("llama.block_count", MetaValue::U32(1))
        .kv("llama.attention.head_count", MetaValue::U32(HEADS as u32))
        .kv("llama.attention.head_count_kv", MetaValue::U32(KV_HEADS as u32))
        .kv("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-6))
        .kv("llama.context_length", MetaValue::U32(128))
        .kv("llama.rope.scaling.type", MetaValue::String("linear".into()))
        .kv("llama.rope.scaling.factor", MetaValue::F32(2.0))
        .kv("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", MetaValue::String("smollm".into()))
        .kv("tokenizer.ggml.tokens", strs(&vocab()))
        .kv(
            "tokenizer.ggml.token_type",
            MetaValue::Array { elem_type: 5, items: types.into_iter().map(MetaValue::I32).collect() },
        )
        .kv("tokenizer.ggml.merges", strs(&["h e"]))
        .kv("tokenizer.ggml.eos_token_id", MetaValue::U32(0))
        .kv("tokenizer.chat_template", MetaValue::String("{{ x }}".into()))
        .f32_tensor("token_embd.weight", &[n_vocab, HIDDEN], &ramp(n_vocab * HIDDEN, 0.001))
        .f32_tensor("output_norm.weight", &[HIDDEN], &ramp(HIDDEN, 0.1))
        .f32_tensor("blk.0.attn_norm.weight", &[HIDDEN], &ramp(HIDDEN, 0.2))
        .f32_tensor("blk.0.ffn_norm.weight", &[HIDDEN], &ramp(HIDDEN, 0.3))
        .f32_tensor("blk.0.attn_q.weight", &[HEADS * HEAD_DIM, HIDDEN], &permute(&q, HEADS * HEAD_DIM, HEADS))
        .f32_tensor("blk.0.attn_k.weight", &[KV_HEADS * HEAD_DIM, HIDDEN], &permute(&k, KV_HEADS * HEAD_DIM, KV_HEADS))
        .f32_tensor("blk.0.attn_v.weight", &[KV_HEADS * HEAD_DIM, HIDDEN], &ramp(KV_HEADS * HEAD_DIM * HIDDEN, 0.03))
        .f32_tensor("blk.0.attn_output.weight", &[HIDDEN, HEADS * HEAD_DIM], &ramp(HIDDEN * HIDDEN, 0.04))
        .f32_tensor("blk.0.ffn_gate.weight", &[FF, HIDDEN], &ramp(FF * HIDDEN, 0.05))
        .f32_tensor("blk.0.ffn_up.weight", &[FF, HIDDEN], &ramp(FF * HIDDEN, 0.06))
        // Q8_0 with d = 0.5 and q = 2 everywhere: every value is 1.
        .tensor("blk.0.ffn_down.weight", &[FF as u64, HIDDEN as u64], GgmlType::Q8_0, {
            let blk: Vec<u8> = half::f16::from_f32(0.5).to_le_bytes().into_iter().chain([2u8; 32]).collect();
            blk.repeat(HIDDEN * FF / 32)
        })
}

#[test]
fn tiny_llama_maps_config_names_and_unpermutes_qk() {
    let m = GgufModel::from_file(parse(&tiny_llama()).unwrap()).unwrap();
    let c = &m.config;
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_layers), (HIDDEN, FF, 1));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (HEADS, KV_HEADS, HEAD_DIM));
    assert_eq!((c.rms_norm_eps, c.rope_theta, c.max_position_embeddings), (1e-6, 10_000.0, 128));
    assert_eq!(c.vocab_size, vocab().len());
    assert!(c.tie_word_embeddings && !c.attention_bias && !c.qk_norm && !c.has_rope_freqs);
    assert_eq!((c.bos_token_id, c.eos_token_id), (None, Some(0)));
    let rs = c.rope_scaling.as_ref().unwrap();
    assert_eq!((rs.kind.as_str(), rs.factor, rs.original_context_length), ("linear", 2.0, None));
    assert_eq!(m.chat_template.as_deref(), Some("{{ x }}"));

    let (shape, q) = m.tensor_f32("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!((shape, q), (vec![HEADS * HEAD_DIM, HIDDEN], ramp(HEADS * HEAD_DIM * HIDDEN, 0.01)));
    let (shape, k) = m.tensor_f32("model.layers.0.self_attn.k_proj.weight").unwrap();
    assert_eq!((shape, k), (vec![KV_HEADS * HEAD_DIM, HIDDEN], ramp(KV_HEADS * HEAD_DIM * HIDDEN, 0.02)));
    let (shape, v) = m.tensor_f32("model.layers.0.self_attn.v_proj.weight").unwrap();
    assert_eq!((shape, v), (vec![HEAD_DIM, HIDDEN], ramp(HEAD_DIM * HIDDEN, 0.03)));
    let (shape, d) = m.tensor_f32("model.layers.0.mlp.down_proj.weight").unwrap();
    assert_eq!(shape, vec![HIDDEN, FF]);
    assert!(d.iter().all(|&x| x == 1.0));
    let (shape, e) = m.tensor_f32("model.embed_tokens.weight").unwrap();
    assert_eq!((shape[0], e.len()), (vocab().len(), vocab().len() * HIDDEN));

    let e = m.tensor_f32("lm_head.weight").unwrap_err();
    assert!(matches!(e, GgufError::MissingTensor { ref gguf_name, .. } if gguf_name == "output.weight"), "{e}");
    let e = m.tensor_f32("model.layers.0.mlp.nonsense.weight").unwrap_err();
    assert!(matches!(e, GgufError::UnknownTensorName { .. }), "{e}");
    let names = m.tensor_names();
    assert_eq!(names.len(), 11);
    assert!(names.contains(&"model.layers.0.post_attention_layernorm.weight".to_string()));

    let ids = m.tokenizer.encode("<|end|>he !", false).unwrap().get_ids().to_vec();
    let v = vocab();
    let id = |t: &str| v.iter().position(|x| x == t).unwrap() as u32;
    assert_eq!(ids, vec![0, id("he"), id("\u{120}"), id("!")]);
}

#[test]
fn model_errors_name_what_is_wrong() {
    let arch = |a: &str| {
        let mut w = tiny_llama();
        w.kvs[0].1 = MetaValue::String(a.into());
        GgufModel::from_file(parse(&w).unwrap()).unwrap_err()
    };
    let e = arch("mamba");
    assert!(matches!(e, GgufError::UnsupportedArchitecture { ref arch } if arch == "mamba"), "{e}");

    let mut w = tiny_llama();
    w.kvs.retain(|(k, _)| k != "llama.block_count");
    let e = GgufModel::from_file(parse(&w).unwrap()).unwrap_err();
    assert!(matches!(e, GgufError::MissingKey { ref key } if key == "llama.block_count"), "{e}");

    let mut w = tiny_llama();
    w.tensors.retain(|t| t.0 != "blk.0.ffn_up.weight");
    let e = GgufModel::from_file(parse(&w).unwrap()).unwrap_err();
    assert!(e.to_string().contains("model.layers.0.mlp.up_proj.weight"), "{e}");

    let w = tiny_llama().kv("llama.feed_forward_length", MetaValue::U32(1));
    assert!(matches!(parse(&w).unwrap_err(), GgufError::DuplicateKey { .. }));
    let mut w = tiny_llama();
    for kv in &mut w.kvs {
        if kv.0 == "llama.feed_forward_length" {
            kv.1 = MetaValue::U32(32);
        }
    }
    let e = GgufModel::from_file(parse(&w).unwrap()).unwrap_err();
    assert!(matches!(e, GgufError::ShapeMismatch { .. }), "{e}");

    let mut w = tiny_llama();
    for kv in &mut w.kvs {
        if kv.0 == "llama.attention.head_count_kv" {
            kv.1 = MetaValue::String("one".into());
        }
    }
    let e = GgufModel::from_file(parse(&w).unwrap()).unwrap_err();
    assert!(e.to_string().contains("head_count_kv") && e.to_string().contains("string"), "{e}");
}

#[test]
fn name_mapping_round_trips_and_unpermute_inverts_permute() {
    for (hf, g) in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("lm_head.weight", "output.weight"),
        ("model.layers.12.self_attn.o_proj.weight", "blk.12.attn_output.weight"),
        ("model.layers.3.input_layernorm.weight", "blk.3.attn_norm.weight"),
        ("model.layers.0.self_attn.k_norm.weight", "blk.0.attn_k_norm.weight"),
        ("model.layers.7.self_attn.v_proj.bias", "blk.7.attn_v.bias"),
    ] {
        assert_eq!(gguf_name(hf).as_deref(), Some(g));
        assert_eq!(hf_name(g).as_deref(), Some(hf));
    }
    assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
    assert_eq!(hf_name("rope_freqs.weight"), None);
    let w = ramp(6 * 4 * 3, 1.0);
    for heads in [1, 2, 3] {
        let p = permute(&w, 24, heads);
        assert_ne!(p, w);
        assert_eq!(unpermute_rows(&p, 24, heads).unwrap(), w);
    }
    assert_eq!(unpermute_rows(&w, 24, 5), None);
    assert_eq!(unpermute_rows(&w, 24, 0), None);
}

/// Writes the seed corpus of the `gguf` fuzz target (`fuzz/`): the every-type sample and the
/// one-layer llama above (a whole model: config, tokenizer, chat template, F32 and Q8_0
/// tensors). Run by `scripts/fuzz --seeds`.
#[test]
#[ignore = "writes fuzz/corpus/gguf; run by scripts/fuzz --seeds"]
fn write_fuzz_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/gguf");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("seed-sample"), sample().build()).unwrap();
    std::fs::write(dir.join("seed-tiny-llama"), tiny_llama().build()).unwrap();
}
