//! A llama / qwen2 / qwen3 GGUF seen as a Hugging Face model: config, tokenizer, and tensors
//! under HF names with HF `[out, in]` shapes.
//!
//! llama.cpp's `convert_hf_to_gguf.py` permutes the rows of llama's `q_proj` and `k_proj`
//! (`reshape(n_head, 2, head_dim / 2, in).swapaxes(1, 2)`) so that ggml's interleaved RoPE
//! rotates adjacent pairs. [`GgufModel::tensor_f32`] undoes it for `general.architecture` =
//! llama, so that HF's rotate-half RoPE applies; qwen2/qwen3 files are not permuted.
//!
//! Invariant: a [`GgufModel`] has been checked to hold every tensor its config implies
//! ([`GgufModel::expected_tensors`]) with the HF shape the config implies, so a later
//! `tensor_f32` of one of those fails only on an unsupported quantization type.

use std::path::Path;

use cleave_tokenizer::gguf::{tokenizer_from_gguf, GgufTokenizerMeta, HfTokenizer};

use cleave_kernels::{HalfFormat, HalfMatrix, QuantMatrix};

use super::reader::{GgufFile, MetaValue};
use super::{GgufError, Result};

/// RoPE scaling as a GGUF states it (`{arch}.rope.scaling.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufRopeScaling {
    /// "linear" or "yarn" (llama.cpp's names).
    pub kind: String,
    pub factor: f32,
    pub original_context_length: Option<usize>,
}

/// The model hyper-parameters of a GGUF, named as in the engine's `ModelConfig`.
/// Invariants: sizes are > 0, `num_heads % num_kv_heads == 0`, `head_dim` is even.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufModelConfig {
    /// `general.architecture`: "llama", "qwen2" or "qwen3".
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<GgufRopeScaling>,
    /// `{arch}.context_length`.
    pub max_position_embeddings: usize,
    /// True when the file has no `output.weight`: `lm_head` is `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (`blk.0.attn_q.bias` present; qwen2).
    pub attention_bias: bool,
    /// Per-head RMSNorm on q and k (`blk.0.attn_q_norm.weight` present; qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// A `rope_freqs.weight` tensor is present (llama3-style frequency factors), which this
    /// config does not express; the tensor is available from [`GgufModel::file`].
    pub has_rope_freqs: bool,
}

/// A GGUF model file opened for loading.
pub struct GgufModel {
    pub config: GgufModelConfig,
    pub tokenizer: HfTokenizer,
    /// `tokenizer.chat_template`, if the file has one.
    pub chat_template: Option<String>,
    file: GgufFile,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel").field("config", &self.config).field("file", &self.file).finish()
    }
}

/// Per-layer names: (HF suffix after `model.layers.N.`, GGUF suffix after `blk.N.`).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
];

/// Whole-model names: (HF, GGUF).
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// The GGUF name of a HF tensor name, or `None` if it names no tensor of these architectures.
pub fn gguf_name(hf_name: &str) -> Option<String> {
    if let Some(&(_, g)) = GLOBAL_NAMES.iter().find(|(h, _)| *h == hf_name) {
        return Some(g.to_string());
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (n, suffix) = rest.split_once('.')?;
    let n: usize = n.parse().ok()?;
    let &(_, g) = LAYER_NAMES.iter().find(|(h, _)| *h == suffix)?;
    Some(format!("blk.{n}.{g}"))
}

/// The HF name of a GGUF tensor name, or `None` for tensors without one (e.g. `rope_freqs`).
pub fn hf_name(gguf_name: &str) -> Option<String> {
    if let Some(&(h, _)) = GLOBAL_NAMES.iter().find(|(_, g)| *g == gguf_name) {
        return Some(h.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (n, suffix) = rest.split_once('.')?;
    let n: usize = n.parse().ok()?;
    let &(h, _) = LAYER_NAMES.iter().find(|(_, g)| *g == suffix)?;
    Some(format!("model.layers.{n}.{h}"))
}

fn require<T>(v: Option<T>, key: &str) -> Result<T> {
    v.ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
}

fn positive(file: &GgufFile, key: &str, default: Option<u64>) -> Result<usize> {
    let v = match file.get_u64(key)? {
        Some(v) => v,
        None => require(default, key)?,
    };
    match usize::try_from(v) {
        Ok(v) if v > 0 && v <= 1 << 40 => Ok(v),
        _ => Err(GgufError::BadValue {
            key: key.to_string(),
            value: v.to_string(),
            reason: "must be a positive size".into(),
        }),
    }
}

fn token_id(file: &GgufFile, key: &str) -> Result<Option<u32>> {
    match file.get_u64(key)? {
        None => Ok(None),
        Some(v) => u32::try_from(v).map(Some).map_err(|_| GgufError::BadValue {
            key: key.to_string(),
            value: v.to_string(),
            reason: "token id exceeds u32".into(),
        }),
    }
}

/// Copies the `tokenizer.ggml.*` keys into the tokenizer crate's plain struct.
pub fn tokenizer_meta(file: &GgufFile) -> Result<GgufTokenizerMeta> {
    let s = |v: &MetaValue| match v {
        MetaValue::String(s) => Some(s.clone()),
        _ => None,
    };
    let i32_of = |v: &MetaValue| v.as_int().and_then(|i| i32::try_from(i).ok());
    Ok(GgufTokenizerMeta {
        model: require(file.get_str("tokenizer.ggml.model")?, "tokenizer.ggml.model")?.to_string(),
        pre: file.get_str("tokenizer.ggml.pre")?.map(str::to_string),
        tokens: require(file.get_array("tokenizer.ggml.tokens", "array of strings", s)?, "tokenizer.ggml.tokens")?,
        scores: file.get_array("tokenizer.ggml.scores", "array of floats", MetaValue::as_f32)?,
        token_types: file.get_array("tokenizer.ggml.token_type", "array of i32", i32_of)?,
        merges: file.get_array("tokenizer.ggml.merges", "array of strings", s)?,
        bos_token_id: token_id(file, "tokenizer.ggml.bos_token_id")?,
        eos_token_id: token_id(file, "tokenizer.ggml.eos_token_id")?,
        unknown_token_id: token_id(file, "tokenizer.ggml.unknown_token_id")?,
        add_bos_token: file.get_bool("tokenizer.ggml.add_bos_token")?,
        add_eos_token: file.get_bool("tokenizer.ggml.add_eos_token")?,
        add_space_prefix: file.get_bool("tokenizer.ggml.add_space_prefix")?,
    })
}

/// Reads and validates the hyper-parameters of a llama / qwen2 / qwen3 GGUF.
pub fn model_config(file: &GgufFile) -> Result<GgufModelConfig> {
    let arch = require(file.get_str("general.architecture")?, "general.architecture")?;
    if !matches!(arch, "llama" | "qwen2" | "qwen3") {
        return Err(GgufError::UnsupportedArchitecture { arch: arch.to_string() });
    }
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let hidden_size = positive(file, &k("embedding_length"), None)?;
    let num_heads = positive(file, &k("attention.head_count"), None)?;
    let num_kv_heads = positive(file, &k("attention.head_count_kv"), Some(num_heads as u64))?;
    let bad = |key: String, value: usize, reason: &str| GgufError::BadValue {
        key,
        value: value.to_string(),
        reason: reason.to_string(),
    };
    if num_heads % num_kv_heads != 0 {
        return Err(bad(k("attention.head_count_kv"), num_kv_heads, "does not divide the head count"));
    }
    let head_dim = match file.get_u64(&k("attention.key_length"))? {
        Some(_) => positive(file, &k("attention.key_length"), None)?,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(bad(
                k("embedding_length"),
                hidden_size,
                "is not a multiple of the head count and no key_length is given",
            ))
        }
    };
    if head_dim % 2 != 0 {
        return Err(bad(k("attention.key_length"), head_dim, "RoPE needs an even head dim"));
    }
    let eps_key = k("attention.layer_norm_rms_epsilon");
    let rms_norm_eps = require(file.get_f32(&eps_key)?, &eps_key)?;
    let tokens_len = match file.get("tokenizer.ggml.tokens") {
        Some(MetaValue::Array { items, .. }) => Some(items.len() as u64),
        _ => None,
    };
    let embd_rows = file.tensor("token_embd.weight").and_then(|t| t.dims.get(1).copied());
    let vocab_size = positive(file, &k("vocab_size"), tokens_len.or(embd_rows))?;
    let num_layers = positive(file, &k("block_count"), None)?;
    // Each layer has at least 9 tensors: refuse a count the file cannot back before anything
    // is sized by it.
    let n_tensors = file.tensors().len();
    if num_layers > n_tensors / 9 {
        return Err(bad(k("block_count"), num_layers, &format!("the file has only {n_tensors} tensors")));
    }
    Ok(GgufModelConfig {
        architecture: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: positive(file, &k("feed_forward_length"), None)?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps,
        rope_theta: file.get_f32(&k("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_scaling: rope_scaling(file, arch)?,
        max_position_embeddings: positive(file, &k("context_length"), None)?,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        attention_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
        bos_token_id: token_id(file, "tokenizer.ggml.bos_token_id")?,
        eos_token_id: token_id(file, "tokenizer.ggml.eos_token_id")?,
        has_rope_freqs: file.tensor("rope_freqs.weight").is_some(),
    })
}

fn rope_scaling(file: &GgufFile, arch: &str) -> Result<Option<GgufRopeScaling>> {
    let k = |suffix: &str| format!("{arch}.rope.{suffix}");
    let original_context_length = match file.get_u64(&k("scaling.original_context_length"))? {
        Some(_) => Some(positive(file, &k("scaling.original_context_length"), None)?),
        None => None,
    };
    let (kind, factor) = match file.get_str(&k("scaling.type"))? {
        None | Some("none") => match file.get_f32(&k("scale_linear"))? {
            Some(f) if f != 1.0 => ("linear".to_string(), f),
            _ => return Ok(None),
        },
        Some(kind) => {
            let key = k("scaling.factor");
            (kind.to_string(), require(file.get_f32(&key)?, &key)?)
        }
    };
    if !(factor.is_finite() && factor > 0.0) {
        return Err(GgufError::BadValue {
            key: k("scaling.factor"),
            value: factor.to_string(),
            reason: "must be a positive number".into(),
        });
    }
    Ok(Some(GgufRopeScaling { kind, factor, original_context_length }))
}

/// Undoes `convert_hf_to_gguf.py`'s `permute` on the rows of a q or k projection (weight
/// `[heads * head_dim, in]` or bias `[heads * head_dim]`): GGUF row `h*hd + 2*i + half` holds
/// HF row `h*hd + half*hd/2 + i`. Rows are moved whole, so `data` may hold any element: f32
/// values, or the bytes of a quantized row's blocks.
pub fn unpermute_rows<T: Copy + Default>(data: &[T], rows: usize, heads: usize) -> Option<Vec<T>> {
    move_head_rows(data, rows, heads, false)
}

/// `convert_hf_to_gguf.py`'s `permute` (`to_gguf`: HF row `h*hd + half*hd/2 + i` to GGUF row
/// `h*hd + 2*i + half`) or its inverse, on whole rows. `None` when the rows do not split into
/// `heads` heads of even size.
pub fn move_head_rows<T: Copy + Default>(data: &[T], rows: usize, heads: usize, to_gguf: bool) -> Option<Vec<T>> {
    if heads == 0
        || !rows.is_multiple_of(heads)
        || !(rows / heads).is_multiple_of(2)
        || !data.len().is_multiple_of(rows.max(1))
    {
        return None;
    }
    let cols = data.len() / rows;
    let hd = rows / heads;
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for half in 0..2 {
                let (gguf, hf) = ((h * hd + 2 * i + half) * cols, (h * hd + half * hd / 2 + i) * cols);
                let (src, dst) = if to_gguf { (hf, gguf) } else { (gguf, hf) };
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    Some(out)
}

/// The inverse of a permutation given as `p[i] = j` (the caller's `p` is one).
fn invert(p: &[u32]) -> Vec<u32> {
    let mut inv = vec![0u32; p.len()];
    for (i, &j) in p.iter().enumerate() {
        inv[j as usize] = i as u32;
    }
    inv
}

impl GgufModel {
    /// Opens, maps and validates `path`; builds the tokenizer. Weights are not dequantized.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_file(GgufFile::open(path)?)
    }

    /// Validates a parsed file as a model.
    pub fn from_file(file: GgufFile) -> Result<Self> {
        let config = model_config(&file)?;
        let tokenizer = tokenizer_from_gguf(&tokenizer_meta(&file)?)?;
        let chat_template = file.get_str("tokenizer.chat_template")?.map(str::to_string);
        let model = Self { config, tokenizer, chat_template, file };
        for (name, expected) in model.expected_tensors() {
            let found = model.tensor_shape(&name)?;
            if found != expected {
                return Err(GgufError::ShapeMismatch { name, found, expected });
            }
        }
        Ok(model)
    }

    /// The underlying file (metadata, raw tensors).
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// Every tensor (HF name, HF shape) the config implies. `lm_head.weight` is listed only
    /// when embeddings are not tied.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let c = &self.config;
        let (h, q, kv, ff) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        let mut out = vec![
            ("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h]),
            ("model.norm.weight".to_string(), vec![h]),
        ];
        if !c.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
        }
        for l in 0..c.num_layers {
            let mut layer = vec![
                ("self_attn.q_proj.weight", vec![q, h]),
                ("self_attn.k_proj.weight", vec![kv, h]),
                ("self_attn.v_proj.weight", vec![kv, h]),
                ("self_attn.o_proj.weight", vec![h, q]),
                ("mlp.gate_proj.weight", vec![ff, h]),
                ("mlp.up_proj.weight", vec![ff, h]),
                ("mlp.down_proj.weight", vec![h, ff]),
                ("input_layernorm.weight", vec![h]),
                ("post_attention_layernorm.weight", vec![h]),
            ];
            if c.attention_bias {
                layer.push(("self_attn.q_proj.bias", vec![q]));
                layer.push(("self_attn.k_proj.bias", vec![kv]));
                layer.push(("self_attn.v_proj.bias", vec![kv]));
            }
            if c.qk_norm {
                layer.push(("self_attn.q_norm.weight", vec![c.head_dim]));
                layer.push(("self_attn.k_norm.weight", vec![c.head_dim]));
            }
            out.extend(layer.into_iter().map(|(n, s)| (format!("model.layers.{l}.{n}"), s)));
        }
        out
    }

    /// HF names of the file's tensors that have one, in file order.
    pub fn tensor_names(&self) -> Vec<String> {
        self.file.tensors().iter().filter_map(|t| hf_name(&t.name)).collect()
    }

    fn info(&self, hf: &str) -> Result<&super::TensorInfo> {
        let g = gguf_name(hf).ok_or_else(|| GgufError::UnknownTensorName { name: hf.to_string() })?;
        self.file.tensor(&g).ok_or(GgufError::MissingTensor { hf_name: hf.to_string(), gguf_name: g })
    }

    /// The HF shape (`[out, in]` for matrices) of tensor `hf_name`.
    pub fn tensor_shape(&self, hf_name: &str) -> Result<Vec<usize>> {
        Ok(self.info(hf_name)?.hf_shape())
    }

    /// The number of heads whose rows llama.cpp permuted in tensor `hf_name` (a llama q or k
    /// projection), if any.
    fn permuted_heads(&self, hf_name: &str) -> Option<usize> {
        match hf_name.rsplit('.').nth(1) {
            _ if self.config.architecture != "llama" => None,
            Some("q_proj") => Some(self.config.num_heads),
            Some("k_proj") => Some(self.config.num_kv_heads),
            _ => None,
        }
    }

    /// Rows of `data` (one tensor of `info`, `shape[0]` rows) with llama.cpp's permutation of
    /// `hf_name` undone, if it has one.
    fn unpermuted<T: Copy + Default>(
        &self,
        hf_name: &str,
        info: &super::TensorInfo,
        shape: &[usize],
        data: Vec<T>,
    ) -> Result<Vec<T>> {
        let Some(heads) = self.permuted_heads(hf_name) else {
            return Ok(data);
        };
        unpermute_rows(&data, shape[0], heads).ok_or_else(|| GgufError::BadShape {
            name: info.name.clone(),
            dims: info.dims.clone(),
            reason: format!("{} rows do not split into {heads} heads of even size", shape[0]),
        })
    }

    /// Tensor `hf_name` as f32 in HF layout: `(shape, row-major data)`. For llama files the
    /// q/k projections are un-permuted. A tied `lm_head.weight` is absent (MissingTensor):
    /// use `model.embed_tokens.weight` when `config.tie_word_embeddings`.
    pub fn tensor_f32(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self.info(hf_name)?;
        let shape = info.hf_shape();
        let data = self.file.tensor_f32(&info.name)?;
        let data = self.unpermuted(hf_name, info, &shape, data)?;
        Ok((shape, data))
    }

    /// Matrix `hf_name` (HF shape `[n, k]`) in 16 bits, rows un-permuted as
    /// [`GgufModel::tensor_f32`] does, when its ggml type is F16 or BF16; `None` for any other
    /// type. The elements are copied out of the file once.
    pub fn tensor_half(&self, hf_name: &str) -> Result<Option<HalfMatrix>> {
        let info = self.info(hf_name)?;
        let shape = info.hf_shape();
        let format = match info.ggml_type {
            super::GgmlType::F16 => HalfFormat::F16,
            super::GgmlType::BF16 => HalfFormat::Bf16,
            _ => return Ok(None),
        };
        let &[n, k] = &shape[..] else { return Ok(None) };
        let data: Vec<u16> =
            self.file.tensor_bytes(info).chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        let data = self.unpermuted(hf_name, info, &shape, data)?;
        HalfMatrix::new(format, n, k, data).map(Some).map_err(|e| GgufError::BadShape {
            name: info.name.clone(),
            dims: info.dims.clone(),
            reason: e.to_string(),
        })
    }

    /// Matrix `hf_name` (HF shape `[n, k]`) in its block-quantized format, when its ggml type
    /// is one the kernels multiply ([`super::GgmlType::quant_format`]); `None` for any other
    /// type (read it with `tensor_f32`). The blocks stay where they lie in the file's map, rows
    /// llama.cpp permuted included: those carry their order
    /// ([`QuantMatrix::with_row_order`]), so the matrix's rows by output feature are in Hugging
    /// Face order as [`GgufModel::tensor_f32`]'s are, without a copy (8.3 MB of SmolLM2-135M's
    /// q and k would otherwise sit on the heap beside the map's pages).
    pub fn tensor_quantized(&self, hf_name: &str) -> Result<Option<QuantMatrix>> {
        let info = self.info(hf_name)?;
        let shape = info.hf_shape();
        let (Some(format), &[n, k]) = (info.ggml_type.quant_format(), &shape[..]) else {
            return Ok(None);
        };
        let bad = |reason: String| GgufError::BadShape { name: info.name.clone(), dims: info.dims.clone(), reason };
        let w = QuantMatrix::new(format, n, k, self.file.tensor_shared(info)).map_err(|e| bad(e.to_string()))?;
        if self.permuted_heads(hf_name).is_none() {
            return Ok(Some(w));
        }
        // The un-permutation applied to the row indices themselves: `stored_of[feature]`.
        let stored_of = self.unpermuted(hf_name, info, &shape, (0..n as u32).collect())?;
        let feature_of = invert(&stored_of);
        w.with_row_order(feature_of).map(Some).map_err(|e| bad(e.to_string()))
    }
}
