//! `cleave quantize` on a Hugging Face folder: the model as a GGUF in a block format, which
//! llama.cpp loads too, so that each pool's format can be made from one Hugging Face checkpoint.
//!
//! What is written, as llama.cpp's `convert_hf_to_gguf.py` writes it for these architectures:
//! - the config under `{arch}.*` keys (llama for Llama and Mistral, qwen2, qwen3);
//! - the tensors under GGUF names ([`super::model::gguf_name`]) with ggml's reversed dims; for
//!   llama, the rows of `q_proj` and `k_proj` (and their biases) permuted so that ggml's
//!   interleaved RoPE applies ([`permute_rows`], the inverse of the reader's un-permutation);
//!   matrices quantized as [`super::quantize::requantize`] does (llama.cpp's fallbacks for rows
//!   that are not whole blocks), vectors in f32;
//! - the vocabulary as a `gpt2` (byte-level BPE) vocabulary: every token by id, its type
//!   (control for special added tokens, user-defined for other added ones, unused for ids the
//!   tokenizer lacks below the embedding's row count), the merges, and `tokenizer.ggml.pre`;
//!   the chat template; BOS/EOS ids and whether BOS is added.
//!
//! `tokenizer.ggml.pre` names the pre-tokenizer's regexes; llama.cpp's converter picks it by
//! hashing the token ids of a probe text. Here every name cleave (and llama.cpp) knows is tried
//! against the checkpoint's own tokenizer on probe texts (digits, contractions, whitespace runs,
//! punctuation, non-Latin scripts), and the first whose tokens equal it on every probe is
//! written; none equal is an error, not a file that tokenizes differently.
//!
//! Not supported, each refused with a message: SentencePiece-style vocabularies (a BPE with byte
//! fallback, as Llama 2 and Mistral ship: GGUF's `llama` vocabulary needs per-token scores that
//! `tokenizer.json` does not carry), and Llama 3.1 RoPE scaling (llama.cpp writes it as a
//! `rope_freqs` tensor, which cleave does not read).

use std::path::Path;

use cleave_kernels::quant::QuantFormat;
use cleave_kernels::{HalfFormat, RopeScaling};
use cleave_tokenizer::gguf::{token_type, tokenizer_from_gguf, GgufTokenizerMeta};

use super::gguf::model::gguf_name;
use super::gguf::quantize::{encode, file_type, Requantized};
use super::gguf::writer::{strs, GgufWriter};
use super::gguf::{GgmlType, MetaValue};
use super::{Architecture, LinearWeight, ModelFiles};
use crate::{EngineError, Result};

/// `tokenizer.ggml.pre` names tried, most common first.
const PRE_NAMES: &[&str] = &["smollm", "gpt-2", "llama-bpe", "qwen2", "default"];

/// Texts the written vocabulary must tokenize exactly as the checkpoint's tokenizer does.
const PROBES: &[&str] = &[
    "Hello, world! What's the capital of France? It's Paris.",
    "In 2023, 1234567 people paid $3.14 each; 42 + 58 = 100.",
    "  leading spaces,\ttabs,\n\nnewlines and   runs of    spaces  ",
    "I'm sure they'll say we've done it, you'd think; I'D SAY IT'S FINE.",
    "def f(x):\n    return {\"key\": [1, 2, 3]}  # comment\n",
    "Ünïcödé: naïve café, Größe, 東京は日本の首都です。 Привет мир! 🙂👍",
    "a\r\nb\r\n\r\n  ...!!!???---___***",
];

/// Undoes [`super::model::unpermute_rows`]: HF row `h*hd + half*hd/2 + i` goes to GGUF row
/// `h*hd + 2*i + half`, as `convert_hf_to_gguf.py`'s `permute` moves them. Rows are moved whole.
/// `None` when the rows do not split into `heads` heads of even size.
pub fn permute_rows<T: Copy + Default>(data: &[T], rows: usize, heads: usize) -> Option<Vec<T>> {
    super::gguf::model::move_head_rows(data, rows, heads, true)
}

/// The GGUF image of the Hugging Face folder `dir` with its matrices in `target`, and what each
/// tensor became (`from`: the checkpoint's dtype for matrices; vectors are read as f32).
pub fn convert_hf(dir: &Path, target: QuantFormat) -> Result<(Vec<u8>, Vec<Requantized>)> {
    let err = |detail: String| EngineError::ModelFile { path: dir.to_path_buf(), detail };
    let files = ModelFiles::open(dir)?;
    let c = &files.config;
    let arch = match c.architecture {
        Architecture::Llama | Architecture::Mistral => "llama",
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
    };
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let mut w = GgufWriter::new()
        .kv("general.architecture", MetaValue::String(arch.into()))
        .kv("general.name", MetaValue::String(name))
        .kv("general.file_type", MetaValue::U32(file_type(target)))
        .kv("general.quantization_version", MetaValue::U32(2))
        .kv(&k("context_length"), MetaValue::U32(u32_of(c.max_position_embeddings, "max_position_embeddings", &err)?))
        .kv(&k("embedding_length"), MetaValue::U32(u32_of(c.hidden_size, "hidden_size", &err)?))
        .kv(&k("feed_forward_length"), MetaValue::U32(u32_of(c.intermediate_size, "intermediate_size", &err)?))
        .kv(&k("block_count"), MetaValue::U32(u32_of(c.num_layers, "num_hidden_layers", &err)?))
        .kv(&k("attention.head_count"), MetaValue::U32(u32_of(c.num_heads, "num_attention_heads", &err)?))
        .kv(&k("attention.head_count_kv"), MetaValue::U32(u32_of(c.num_kv_heads, "num_key_value_heads", &err)?))
        .kv(&k("attention.key_length"), MetaValue::U32(u32_of(c.head_dim, "head_dim", &err)?))
        .kv(&k("attention.value_length"), MetaValue::U32(u32_of(c.head_dim, "head_dim", &err)?))
        .kv(&k("attention.layer_norm_rms_epsilon"), MetaValue::F32(c.rms_norm_eps))
        .kv(&k("rope.freq_base"), MetaValue::F32(c.rope_theta))
        .kv(&k("rope.dimension_count"), MetaValue::U32(u32_of(c.head_dim, "head_dim", &err)?))
        .kv(&k("vocab_size"), MetaValue::U32(u32_of(c.vocab_size, "vocab_size", &err)?));
    match &c.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            w = w
                .kv(&k("rope.scaling.type"), MetaValue::String("linear".into()))
                .kv(&k("rope.scaling.factor"), MetaValue::F32(*factor));
        }
        RopeScaling::Llama3 { .. } => {
            return Err(err("llama3 rope scaling is written to GGUF as a `rope_freqs` tensor, which cleave does not \
                 read yet: convert this model with llama.cpp's convert_hf_to_gguf.py"
                .into()))
        }
    }
    for (key, value) in vocabulary(dir, &files)? {
        w = w.kv(&key, value);
    }

    let (h, hd) = (c.hidden_size, c.head_dim);
    let (qd, kvd, ff, vocab) = (c.num_heads * hd, c.kv_width(), c.intermediate_size, c.vocab_size);
    let mut names: Vec<(String, Vec<usize>)> = vec![("model.embed_tokens.weight".into(), vec![vocab, h])];
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        let layer: [(&str, Vec<usize>); 14] = [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![qd, h]),
            ("self_attn.k_proj.weight", vec![kvd, h]),
            ("self_attn.v_proj.weight", vec![kvd, h]),
            ("self_attn.q_proj.bias", vec![qd]),
            ("self_attn.k_proj.bias", vec![kvd]),
            ("self_attn.v_proj.bias", vec![kvd]),
            ("self_attn.q_norm.weight", vec![hd]),
            ("self_attn.k_norm.weight", vec![hd]),
            ("self_attn.o_proj.weight", vec![h, qd]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![ff, h]),
            ("mlp.up_proj.weight", vec![ff, h]),
            ("mlp.down_proj.weight", vec![h, ff]),
        ];
        names.extend(layer.into_iter().map(|(s, shape)| (format!("{p}.{s}"), shape)));
    }
    names.push(("model.norm.weight".into(), vec![h]));
    // A tied head is the embedding (no `output.weight`, as llama.cpp reads it).
    let tied = c.tie_word_embeddings && !files.source.contains("lm_head.weight");
    if !tied {
        names.push(("lm_head.weight".into(), vec![vocab, h]));
    }
    let mut report = Vec::with_capacity(names.len());
    for (hf, shape) in names {
        if !files.source.contains(&hf) {
            // Optional tensors (biases, q/k norms) only where the config has them; a required
            // one missing was already refused when the folder's config was checked against it.
            continue;
        }
        let gguf = gguf_name(&hf).ok_or_else(|| err(format!("no GGUF name for tensor `{hf}`")))?;
        // Matrices through `load_linear`, to report the checkpoint's own dtype.
        let (from, mut values) = match shape[..] {
            [n, k] => match files.source.load_linear(&hf, [n, k])? {
                LinearWeight::F32(v) => (GgmlType::F32, v),
                LinearWeight::Half(h) if h.format() == HalfFormat::Bf16 => (GgmlType::BF16, h.to_f32()),
                LinearWeight::Half(h) => (GgmlType::F16, h.to_f32()),
                LinearWeight::Quantized(q) => (GgmlType::of_quant(q.format()), q.to_f32()),
            },
            _ => (GgmlType::F32, files.source.load(&hf, &shape)?),
        };
        let heads = match hf.rsplit('.').nth(1) {
            Some("q_proj") if arch == "llama" => Some(c.num_heads),
            Some("k_proj") if arch == "llama" => Some(c.num_kv_heads),
            _ => None,
        };
        if let Some(heads) = heads {
            values = permute_rows(&values, shape[0], heads)
                .ok_or_else(|| err(format!("`{hf}`: {} rows do not split into {heads} heads", shape[0])))?;
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let (ty, data) = encode(&values, shape.last().copied().unwrap_or(1), shape.len() == 2, target);
        report.push(Requantized { name: gguf.clone(), from, to: ty });
        w = w.tensor(&gguf, &dims, ty, data);
    }
    Ok((w.build(), report))
}

fn u32_of(v: usize, what: &str, err: &impl Fn(String) -> EngineError) -> Result<u32> {
    u32::try_from(v).map_err(|_| err(format!("{what} = {v} does not fit GGUF's u32")))
}

/// The `tokenizer.*` keys of the folder's vocabulary (see the module docs).
fn vocabulary(dir: &Path, files: &ModelFiles) -> Result<Vec<(String, MetaValue)>> {
    let path = dir.join("tokenizer.json");
    let err = |detail: String| EngineError::ModelFile { path: path.clone(), detail };
    let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(err(format!(
            "the tokenizer model is {}, not BPE: only byte-level BPE vocabularies are written to GGUF",
            model["type"]
        )));
    }
    if model["byte_fallback"].as_bool() == Some(true) {
        return Err(err("a BPE with byte fallback (a SentencePiece vocabulary, as Llama 2 and Mistral ship): GGUF's \
             `llama` vocabulary needs per-token scores that tokenizer.json does not carry; convert this model \
             with llama.cpp's convert_hf_to_gguf.py"
            .into()));
    }
    let merges: Vec<String> = match model["merges"].as_array() {
        Some(list) => list
            .iter()
            .map(|m| match m {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(pair) if pair.len() == 2 => match (pair[0].as_str(), pair[1].as_str()) {
                    (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                    _ => Err(err(format!("merge {m} is not two strings"))),
                },
                other => Err(err(format!("merge {other} is neither \"a b\" nor [\"a\", \"b\"]"))),
            })
            .collect::<Result<_>>()?,
        None => return Err(err("the BPE model has no `merges` list".into())),
    };
    let hf = files.tokenizer.hf().ok_or_else(|| err("the tokenizer keeps only what decoding needs".into()))?;
    let n = files.config.vocab_size;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![token_type::NORMAL; n];
    for (tok, id) in hf.get_vocab(true) {
        let slot = tokens
            .get_mut(id as usize)
            .ok_or_else(|| err(format!("token {tok:?} has id {id}, outside the model's {n} embedding rows")))?;
        *slot = Some(tok);
    }
    for (id, added) in hf.get_added_tokens_decoder() {
        if let Some(t) = types.get_mut(id as usize) {
            *t = if added.special { token_type::CONTROL } else { token_type::USER_DEFINED };
        }
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            t.unwrap_or_else(|| {
                types[id] = token_type::UNUSED;
                format!("[PAD{id}]")
            })
        })
        .collect();
    let c = &files.config;
    let bos = c.bos_token_id;
    let eos = c.eos_token_ids.first().copied();
    let add_bos = match bos {
        Some(bos) => hf.encode("a", true).map(|e| e.get_ids().first() == Some(&bos)).unwrap_or(false),
        None => false,
    };
    let mut meta = GgufTokenizerMeta {
        model: "gpt2".into(),
        tokens: tokens.clone(),
        token_types: Some(types.clone()),
        merges: Some(merges.clone()),
        bos_token_id: bos,
        eos_token_id: eos,
        add_bos_token: Some(add_bos),
        ..Default::default()
    };
    let ids = |t: &cleave_tokenizer::gguf::HfTokenizer, s: &str| t.encode(s, false).map(|e| e.get_ids().to_vec()).ok();
    let pre = PRE_NAMES
        .iter()
        .find(|&&pre| {
            meta.pre = Some(pre.to_string());
            let Ok(built) = tokenizer_from_gguf(&meta) else { return false };
            PROBES.iter().all(|p| ids(&built, p).is_some() && ids(&built, p) == ids(hf, p))
        })
        .ok_or_else(|| {
            err(format!(
                "no GGUF pre-tokenizer ({}) splits text as this tokenizer does: it cannot be written as a GGUF \
                 vocabulary that tokenizes alike",
                PRE_NAMES.join(", ")
            ))
        })?;
    let mut out = vec![
        ("tokenizer.ggml.model".to_string(), MetaValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), MetaValue::String(pre.to_string())),
        ("tokenizer.ggml.tokens".to_string(), strs(&tokens)),
        (
            "tokenizer.ggml.token_type".to_string(),
            MetaValue::Array { elem_type: 5, items: types.iter().map(|&t| MetaValue::I32(t)).collect() },
        ),
        ("tokenizer.ggml.merges".to_string(), strs(&merges)),
        ("tokenizer.ggml.add_bos_token".to_string(), MetaValue::Bool(add_bos)),
    ];
    if let Some(bos) = bos {
        out.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(bos)));
    }
    if let Some(eos) = eos {
        out.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(eos)));
    }
    if let Ok(template) = files.tokenizer.chat_template_source(None) {
        out.push(("tokenizer.chat_template".into(), MetaValue::String(template.to_string())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::{preset, write_model, SynthDtype};
    use crate::model::{ForwardBatch, KvSpec, KvStorage, LoadOptions, Model};
    use cleave_kernels::cpu::CpuBackend;
    use cleave_kernels::AttnSeq;

    #[test]
    fn permute_inverts_unpermute() {
        let data: Vec<u32> = (0..8 * 3).collect();
        for heads in [1, 2] {
            let p = permute_rows(&data, 8, heads).unwrap();
            assert_ne!(p, data, "{heads} heads");
            assert_eq!(crate::model::gguf::model::unpermute_rows(&p, 8, heads).unwrap(), data);
        }
        assert!(permute_rows(&data, 8, 3).is_none());
    }

    /// Prefill logits of `tokens` (all positions).
    fn logits(model: &Model<CpuBackend>, backend: &CpuBackend, tokens: &[u32]) -> Vec<f32> {
        let spec = KvSpec { num_blocks: 4, block_size: 16, dtype: cleave_protocol::KvDtype::F32 };
        let mut kv = KvStorage::new(backend, &model.config, spec).unwrap();
        let n = tokens.len();
        let positions: Vec<u32> = (0..n as u32).collect();
        let table = [1u32, 2, 3];
        let slots: Vec<u32> = positions.iter().map(|&p| table[p as usize / 16] * 16 + p % 16).collect();
        let rows: Vec<u32> = (0..n as u32).collect();
        let seqs = [AttnSeq { q_start: 0, q_len: n, context_len: n, block_table: &table }];
        let batch = ForwardBatch { tokens, positions: &positions, slots: &slots, seqs: &seqs, logit_rows: &rows };
        model.forward(backend, batch, &mut kv).unwrap()
    }

    /// A Hugging Face folder (the synthetic `small` model: byte-level BPE, ChatML template, llama
    /// q/k to permute) written as a Q8_0 GGUF is the same model to cleave: the same identity
    /// (config, vocabulary by id, norms), the same tokens for every probe and chat prompt, the
    /// same chat template, every matrix in Q8_0, and prefill logits within Q8_0's rounding of the
    /// f32 folder's (a misplaced q/k row or tensor is O(1)).
    #[test]
    fn a_hugging_face_folder_becomes_the_same_model_as_a_gguf() {
        let dir = std::env::temp_dir().join(format!("cleave-to-gguf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_model(&preset("small").unwrap(), 3, SynthDtype::F32, &dir).unwrap();
        let (image, report) = convert_hf(&dir, QuantFormat::Q8_0).unwrap();
        let hf = ModelFiles::open(&dir).unwrap();
        let gguf = ModelFiles::from_gguf_bytes(Path::new("converted.gguf"), image).unwrap();
        // Matrices in Q8_0 but the MLP's down projection, whose rows of 688 are not whole blocks
        // of 32: f16, as llama.cpp falls back.
        for r in &report {
            let want = match &r.name {
                n if n.ends_with("norm.weight") => GgmlType::F32,
                n if n.ends_with("ffn_down.weight") => GgmlType::F16,
                _ => GgmlType::Q8_0,
            };
            assert_eq!(r.to, want, "{}", r.name);
        }
        assert_eq!(gguf.identity().unwrap(), hf.identity().unwrap());
        for p in PROBES.iter().chain(["<|im_start|>user\nHi<|im_end|>\n"].iter()) {
            assert_eq!(gguf.tokenizer.encode(p, true).unwrap(), hf.tokenizer.encode(p, true).unwrap(), "{p:?}");
        }
        assert_eq!(
            gguf.tokenizer.chat_template_source(None).unwrap(),
            hf.tokenizer.chat_template_source(None).unwrap()
        );

        let backend = CpuBackend::new(Some(2)).unwrap();
        let load = |f: &ModelFiles| {
            Model::load_with(&backend, f.config.clone(), f.source.as_ref(), LoadOptions { dequantize_weights: true })
                .unwrap()
        };
        let tokens = hf.tokenizer.encode(PROBES[0], true).unwrap();
        let (a, b) = (logits(&load(&gguf), &backend, &tokens), logits(&load(&hf), &backend, &tokens));
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
        assert!(diff < 2e-2, "logits differ by {diff} of the largest");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A vocabulary GGUF cannot express is refused with a reason, not written wrong.
    #[test]
    fn a_sentencepiece_vocabulary_is_refused_with_a_reason() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tiny-llama");
        let e = convert_hf(&dir, QuantFormat::Q8_0).unwrap_err().to_string();
        assert!(e.contains("byte fallback") && e.contains("convert_hf_to_gguf"), "{e}");
    }
}
