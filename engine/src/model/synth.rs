//! Synthetic models: random weights in Hugging Face format (like other engines' dummy weights),
//! for tests, benchmarks and a built-in default model.
//!
//! [`write_model`] writes `config.json` (LlamaForCausalLM), `generation_config.json`,
//! `model.safetensors`, `tokenizer.json` (a real byte-level BPE, see [`build_tokenizer`]) and
//! `tokenizer_config.json` (ChatML template) into a folder that [`super::ModelConfig::from_dir`]
//! and [`super::safetensors::SafetensorsSource::open_dir`] read back.
//!
//! Invariant: the files are a pure function of (spec, seed, dtype): writing twice gives
//! byte-identical files, whatever the thread count. The tokenizer depends on `vocab_size` only.
//!
//! Memory: tensors are generated one at a time while the safetensors file is written, so a
//! model of any size needs only its largest tensor in memory.

mod tokenizer;
mod weights;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use tokenizer::{build_tokenizer, MIN_VOCAB_SIZE, SPECIAL_TOKENS};

use crate::{EngineError, Result};

/// Id of `<|endoftext|>`: BOS, EOS and padding.
pub const ENDOFTEXT_ID: u32 = 0;
/// Id of `<|im_start|>`.
pub const IM_START_ID: u32 = 1;
/// Id of `<|im_end|>` (also an EOS id, via `generation_config.json`).
pub const IM_END_ID: u32 = 2;

/// ChatML, as in `tokenizer_config.json`.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The shape of a synthetic Llama model. Invariants (checked by [`SynthSpec::validate`]): every
/// size is > 0, `num_heads` is a multiple of `num_kv_heads`, `head_dim` is even, and
/// `vocab_size` ≥ [`MIN_VOCAB_SIZE`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub tie_word_embeddings: bool,
}

/// A named [`SynthSpec`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub spec: SynthSpec,
}

const fn llama(hidden: usize, layers: usize, heads: usize, kv_heads: usize, intermediate: usize) -> SynthSpec {
    SynthSpec {
        vocab_size: 32000,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_word_embeddings: false,
    }
}

/// The built-in shapes. `tiny` matches the repository's `testdata/tiny-llama` except for its vocabulary.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny",
        spec: SynthSpec { vocab_size: 4096, max_position_embeddings: 2048, ..llama(64, 2, 4, 2, 172) },
    },
    Preset {
        name: "small",
        spec: SynthSpec { vocab_size: 8192, max_position_embeddings: 2048, ..llama(256, 4, 8, 4, 688) },
    },
    Preset { name: "base-100m", spec: SynthSpec { tie_word_embeddings: true, ..llama(768, 12, 12, 4, 2048) } },
    Preset { name: "large-350m", spec: llama(1024, 24, 16, 8, 2816) },
];

/// The preset called `name`.
pub fn preset(name: &str) -> Option<SynthSpec> {
    PRESETS.iter().find(|p| p.name == name).map(|p| p.spec)
}

/// The preset called `name`, or an error that lists every preset.
pub fn preset_or_err(name: &str) -> Result<SynthSpec> {
    preset(name).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        EngineError::Config {
            path: PathBuf::from(format!("preset `{name}`")),
            detail: format!("no such model preset; the presets are: {}", names.join(", ")),
        }
    })
}

impl SynthSpec {
    /// Checks the invariants stated on the type.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| Err(EngineError::Config { path: "synthetic model spec".into(), detail });
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((key, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return bad(format!("`{key}` must be > 0"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim must be even, got {}", self.head_dim));
        }
        if self.vocab_size < MIN_VOCAB_SIZE {
            return bad(format!("vocab_size {} is below the minimum {MIN_VOCAB_SIZE}", self.vocab_size));
        }
        if !(self.rms_norm_eps.is_finite()
            && self.rms_norm_eps > 0.0
            && self.rope_theta.is_finite()
            && self.rope_theta > 0.0)
        {
            return bad(format!("rms_norm_eps {} and rope_theta {} must be > 0", self.rms_norm_eps, self.rope_theta));
        }
        Ok(())
    }

    /// Parameters in the weights (embeddings counted once when tied); equals the sum of the
    /// element counts of the tensors written.
    pub fn num_parameters(&self) -> usize {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        let per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h;
        let embed = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 };
        self.num_layers * per_layer + embed + h
    }

    /// One line for `--help` and logs.
    pub fn describe(&self) -> String {
        format!(
            "hidden {}, {} layers, {} heads ({} KV) of {}, intermediate {}, vocab {}, max positions {}{}; {:.1}M parameters",
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
            self.max_position_embeddings,
            if self.tie_word_embeddings { ", tied embeddings" } else { "" },
            self.num_parameters() as f64 / 1e6,
        )
    }
}

/// The storage dtype of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SynthDtype {
    #[default]
    F32,
    F16,
    BF16,
}

impl SynthDtype {
    pub fn size_bytes(self) -> usize {
        match self {
            SynthDtype::F32 => 4,
            SynthDtype::F16 | SynthDtype::BF16 => 2,
        }
    }

    /// The name `config.json`'s `torch_dtype` uses.
    pub fn torch_name(self) -> &'static str {
        match self {
            SynthDtype::F32 => "float32",
            SynthDtype::F16 => "float16",
            SynthDtype::BF16 => "bfloat16",
        }
    }
}

/// What [`write_model`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSummary {
    pub num_parameters: usize,
    /// Size of `model.safetensors`.
    pub weight_bytes: u64,
    /// Every file written, in the order written.
    pub files: Vec<PathBuf>,
}

/// Writes a model of shape `spec` with weights drawn from `seed` into `out` (created if
/// missing; files already there with the same names are replaced).
pub fn write_model(spec: &SynthSpec, seed: u64, dtype: SynthDtype, out: &Path) -> Result<SynthSummary> {
    spec.validate()?;
    std::fs::create_dir_all(out).map_err(|e| write_error(out, e))?;
    let mut files = Vec::new();
    write_json(&out.join("config.json"), &HfConfig::new(spec, dtype), &mut files)?;
    let generation = GenerationConfig { bos_token_id: ENDOFTEXT_ID, eos_token_id: [ENDOFTEXT_ID, IM_END_ID] };
    write_json(&out.join("generation_config.json"), &generation, &mut files)?;
    write_json(&out.join("tokenizer_config.json"), &TokenizerConfigJson::new(spec), &mut files)?;

    let tokenizer = build_tokenizer(spec.vocab_size)?;
    let path = out.join("tokenizer.json");
    tokenizer.save(&path, true).map_err(|e| write_error(&path, std::io::Error::other(e.to_string())))?;
    files.push(path);

    let path = out.join("model.safetensors");
    let tensors = weights::tensors(spec, seed, dtype);
    debug_assert_eq!(tensors.iter().map(|t| t.numel()).sum::<usize>(), spec.num_parameters());
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    ::safetensors::serialize_to_file(tensors.into_iter().map(|t| (t.name.clone(), t)), Some(metadata), &path)
        .map_err(|e| write_error(&path, std::io::Error::other(e.to_string())))?;
    // The writer goes through a 0600 temp file; give the weights the mode the other files got.
    let config_path = out.join("config.json");
    let mode = std::fs::metadata(&config_path).map_err(|e| EngineError::io(&config_path, e))?.permissions();
    std::fs::set_permissions(&path, mode).map_err(|e| write_error(&path, e))?;
    let weight_bytes = std::fs::metadata(&path).map_err(|e| EngineError::io(&path, e))?.len();
    files.push(path);
    Ok(SynthSummary { num_parameters: spec.num_parameters(), weight_bytes, files })
}

// TODO(lead): a dedicated `EngineError::Write { path, source }` ("cannot write {path}: {source}")
// would read better; until then writes report through `ModelFile`.
fn write_error(path: &Path, e: std::io::Error) -> EngineError {
    EngineError::Write { path: path.to_path_buf(), source: e }
}

/// Writes `value` as pretty JSON (with a final newline) to `path` and records the path.
fn write_json(path: &Path, value: &impl Serialize, files: &mut Vec<PathBuf>) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| write_error(path, std::io::Error::other(e)))?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| write_error(path, e))?;
    files.push(path.to_path_buf());
    Ok(())
}

/// `config.json` in the classic LlamaForCausalLM key layout.
#[derive(Serialize)]
struct HfConfig {
    architectures: [&'static str; 1],
    model_type: &'static str,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    hidden_act: &'static str,
    max_position_embeddings: usize,
    rms_norm_eps: f32,
    rope_theta: f32,
    rope_scaling: Option<()>,
    attention_bias: bool,
    attention_dropout: f32,
    mlp_bias: bool,
    tie_word_embeddings: bool,
    bos_token_id: u32,
    eos_token_id: u32,
    initializer_range: f32,
    use_cache: bool,
    torch_dtype: &'static str,
}

impl HfConfig {
    fn new(s: &SynthSpec, dtype: SynthDtype) -> Self {
        HfConfig {
            architectures: ["LlamaForCausalLM"],
            model_type: "llama",
            vocab_size: s.vocab_size,
            hidden_size: s.hidden_size,
            intermediate_size: s.intermediate_size,
            num_hidden_layers: s.num_layers,
            num_attention_heads: s.num_heads,
            num_key_value_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            hidden_act: "silu",
            max_position_embeddings: s.max_position_embeddings,
            rms_norm_eps: s.rms_norm_eps,
            rope_theta: s.rope_theta,
            rope_scaling: None,
            attention_bias: false,
            attention_dropout: 0.0,
            mlp_bias: false,
            tie_word_embeddings: s.tie_word_embeddings,
            bos_token_id: ENDOFTEXT_ID,
            eos_token_id: ENDOFTEXT_ID,
            initializer_range: 0.02,
            use_cache: true,
            torch_dtype: dtype.torch_name(),
        }
    }
}

#[derive(Serialize)]
struct GenerationConfig {
    bos_token_id: u32,
    eos_token_id: [u32; 2],
}

#[derive(Serialize)]
struct AddedTokenJson {
    content: &'static str,
    lstrip: bool,
    normalized: bool,
    rstrip: bool,
    single_word: bool,
    special: bool,
}

#[derive(Serialize)]
struct TokenizerConfigJson {
    add_bos_token: bool,
    add_eos_token: bool,
    add_prefix_space: bool,
    added_tokens_decoder: BTreeMap<String, AddedTokenJson>,
    additional_special_tokens: [&'static str; 2],
    bos_token: &'static str,
    chat_template: &'static str,
    clean_up_tokenization_spaces: bool,
    eos_token: &'static str,
    model_max_length: usize,
    pad_token: &'static str,
    tokenizer_class: &'static str,
    unk_token: Option<&'static str>,
}

impl TokenizerConfigJson {
    fn new(s: &SynthSpec) -> Self {
        let added_tokens_decoder = SPECIAL_TOKENS
            .iter()
            .enumerate()
            .map(|(id, content)| {
                let token = AddedTokenJson {
                    content,
                    lstrip: false,
                    normalized: false,
                    rstrip: false,
                    single_word: false,
                    special: true,
                };
                (id.to_string(), token)
            })
            .collect();
        let name = |id: u32| SPECIAL_TOKENS[id as usize];
        TokenizerConfigJson {
            add_bos_token: false,
            add_eos_token: false,
            add_prefix_space: false,
            added_tokens_decoder,
            additional_special_tokens: [name(IM_START_ID), name(IM_END_ID)],
            bos_token: name(ENDOFTEXT_ID),
            chat_template: CHAT_TEMPLATE,
            clean_up_tokenization_spaces: false,
            eos_token: name(ENDOFTEXT_ID),
            model_max_length: s.max_position_embeddings,
            pad_token: name(ENDOFTEXT_ID),
            tokenizer_class: "PreTrainedTokenizerFast",
            unk_token: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_near_their_names() {
        for p in PRESETS {
            p.spec.validate().unwrap();
            let n = p.spec.num_parameters() as f64 / 1e6;
            let want = match p.name {
                "base-100m" => 100.0,
                "large-350m" => 350.0,
                _ => continue,
            };
            assert!((n - want).abs() / want < 0.05, "{} has {n}M parameters", p.name);
        }
        let tiny = preset("tiny").unwrap();
        assert_eq!(
            (tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim),
            (64, 2, 4, 2, 16)
        );
        assert_eq!((tiny.intermediate_size, tiny.vocab_size, tiny.max_position_embeddings), (172, 4096, 2048));
    }

    #[test]
    fn parameter_count_matches_the_tensors() {
        for p in PRESETS {
            let total: usize = weights::tensors(&p.spec, 0, SynthDtype::F32).iter().map(|t| t.numel()).sum();
            assert_eq!(total, p.spec.num_parameters(), "{}", p.name);
        }
    }

    #[test]
    fn bad_specs_are_named() {
        let tiny = preset("tiny").unwrap();
        let e = SynthSpec { num_kv_heads: 3, ..tiny }.validate().unwrap_err();
        assert!(e.to_string().contains("multiple"), "{e}");
        let e = SynthSpec { vocab_size: 10, ..tiny }.validate().unwrap_err();
        assert!(e.to_string().contains("vocab_size"), "{e}");
        let e = SynthSpec { num_layers: 0, ..tiny }.validate().unwrap_err();
        assert!(e.to_string().contains("num_layers"), "{e}");
    }
}
