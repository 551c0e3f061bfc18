//! `config.json` of a Hugging Face model, validated once into [`ModelConfig`].

use std::path::Path;

use cleave_kernels::RopeScaling;
use serde::Deserialize;

use crate::{EngineError, Result};

/// The decoder families cleave runs. They share one forward pass; the differences are flags on
/// [`ModelConfig`] (attention bias, q/k norm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub fn from_hf_name(name: &str) -> Result<Self> {
        match name {
            "LlamaForCausalLM" => Ok(Architecture::Llama),
            "MistralForCausalLM" => Ok(Architecture::Mistral),
            "Qwen2ForCausalLM" => Ok(Architecture::Qwen2),
            "Qwen3ForCausalLM" => Ok(Architecture::Qwen3),
            other => Err(EngineError::UnsupportedArchitecture { arch: other.to_string() }),
        }
    }
}

/// A validated model configuration. Invariants: every size is > 0, `num_heads` is a multiple of
/// `num_kv_heads`, `head_dim` is even.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or `attention_bias: true`).
    pub attention_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(x) => vec![x],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
struct RawRopeScaling {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<u32>,
}

#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    hidden_act: Option<String>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRopeScaling>,
    /// transformers 5 spells rope settings this way.
    rope_parameters: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

#[derive(Deserialize)]
struct RawGenerationConfig {
    eos_token_id: Option<OneOrMany>,
}

impl ModelConfig {
    /// Reads `config.json` (and `generation_config.json` for EOS ids, when present) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let mut cfg = Self::from_json(&text).map_err(|detail| match detail {
            EngineError::Config { detail, .. } => EngineError::Config { path: path.clone(), detail },
            other => other,
        })?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|e| EngineError::io(&gen_path, e))?;
            let gen: RawGenerationConfig = serde_json::from_str(&text)
                .map_err(|e| EngineError::Config { path: gen_path.clone(), detail: e.to_string() })?;
            if let Some(eos) = gen.eos_token_id {
                for id in eos.into_vec() {
                    if !cfg.eos_token_ids.contains(&id) {
                        cfg.eos_token_ids.push(id);
                    }
                }
            }
        }
        Ok(cfg)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let bad = |detail: String| EngineError::Config { path: "config.json".into(), detail };
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .ok_or_else(|| bad("`architectures` is missing".into()))?;
        let architecture = Architecture::from_hf_name(&arch_name)?;
        let need = |v: Option<usize>, key: &str| -> Result<usize> {
            match v {
                Some(0) => Err(bad(format!("`{key}` must be > 0"))),
                Some(x) => Ok(x),
                None => Err(bad(format!("`{key}` is missing"))),
            }
        };
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = need(raw.num_key_value_heads.or(Some(num_heads)), "num_key_value_heads")?;
        if num_heads % num_kv_heads != 0 {
            return Err(bad(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(bad(format!(
                    "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
                )))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!("head_dim must be even and > 0, got {head_dim}")));
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(bad(format!("hidden_act `{act}` is not supported (only silu)")));
            }
        }
        if raw.mlp_bias == Some(true) {
            return Err(bad("mlp_bias = true is not supported".into()));
        }
        let rope_theta = raw
            .rope_theta
            .or_else(|| raw.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(|v| v.as_f64()))
            .unwrap_or(10000.0) as f32;
        let rope_scaling = match raw.rope_scaling {
            Some(rs) => parse_rope_scaling(rs).map_err(bad)?,
            None => match raw.rope_parameters.as_ref() {
                Some(p) if p.get("rope_type").and_then(|t| t.as_str()).is_some_and(|t| t != "default") => {
                    let rs: RawRopeScaling = serde_json::from_value(p.clone()).map_err(|e| bad(e.to_string()))?;
                    parse_rope_scaling(rs).map_err(bad)?
                }
                _ => RopeScaling::None,
            },
        };
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6) as f32;
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(bad(format!("rms_norm_eps must be > 0, got {rms_norm_eps}")));
        }
        Ok(ModelConfig {
            architecture,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: raw.attention_bias.unwrap_or(architecture == Architecture::Qwen2),
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: raw.eos_token_id.map(OneOrMany::into_vec).unwrap_or_default(),
        })
    }

    /// Width of K (or V) of one token in one layer.
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameters in the weights (embeddings counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let (h, i, q, kv) = (self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.kv_width());
        let attn = h * q * 2 + h * kv * 2;
        let mlp = 3 * h * i;
        let per_layer = attn + mlp + 2 * h;
        let embed = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 };
        self.num_layers * per_layer + embed + h
    }

    /// A stable fingerprint of everything that shapes the KV cache and the logits: nodes refuse to
    /// exchange KV with a peer whose fingerprint differs.
    pub fn fingerprint(&self) -> u64 {
        // FNV-1a over the debug rendering: stable across runs and processes of one build.
        let text = format!("{self:?}");
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
    }
}

fn parse_rope_scaling(rs: RawRopeScaling) -> std::result::Result<RopeScaling, String> {
    let kind = rs.rope_type.as_deref().unwrap_or("default");
    let factor = || {
        rs.factor
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| format!("rope_scaling `{kind}` needs a positive `factor`"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: rs.low_freq_factor.unwrap_or(1.0),
            high_freq_factor: rs.high_freq_factor.unwrap_or(4.0),
            original_max_position_embeddings: rs.original_max_position_embeddings.unwrap_or(8192),
        }),
        other => Err(format!("rope_scaling type `{other}` is not supported (supported: linear, llama3)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":32000,"hidden_size":64,
        "intermediate_size":172,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "head_dim":16,"rms_norm_eps":1e-5,"rope_theta":10000.0,"eos_token_id":2,"bos_token_id":1}"#;

    #[test]
    fn parses_llama() {
        let c = ModelConfig::from_json(TINY).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
        assert_eq!(c.eos_token_ids, vec![2]);
        assert!(!c.attention_bias && !c.qk_norm);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let e = ModelConfig::from_json(&TINY.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap_err();
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
    }

    #[test]
    fn llama3_rope_scaling_and_eos_list() {
        let text = TINY.replace(
            "\"eos_token_id\":2",
            "\"eos_token_id\":[128001,128009],\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":32.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192}",
        );
        let c = ModelConfig::from_json(&text).unwrap();
        assert_eq!(c.eos_token_ids, vec![128001, 128009]);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
    }

    #[test]
    fn bad_sizes_are_clear_errors() {
        let e = ModelConfig::from_json(&TINY.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3"))
            .unwrap_err();
        assert!(e.to_string().contains("multiple"), "{e}");
        let e = ModelConfig::from_json(&TINY.replace("\"hidden_size\":64,", "")).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        assert!(ModelConfig::from_json("{not json").is_err());
    }

    #[test]
    fn qwen_flags() {
        let c = ModelConfig::from_json(&TINY.replace("LlamaForCausalLM", "Qwen2ForCausalLM")).unwrap();
        assert!(c.attention_bias && !c.qk_norm);
        let c = ModelConfig::from_json(&TINY.replace("LlamaForCausalLM", "Qwen3ForCausalLM")).unwrap();
        assert!(!c.attention_bias && c.qk_norm);
    }
}
