//! What the coordinator knows about the served model: its tokenizer and a few config-level
//! facts (name, context length, EOS ids), and the compiler that checks a request's output
//! constraint against its vocabulary. Never weights: those live on the nodes.
//!
//! Invariant: `context_len >= 1`; `eos_token_ids` lists every id the model's
//! generation_config.json / config.json / tokenizer call EOS, without duplicates.

use std::path::{Path, PathBuf};

use cleave_constrain::{Compiler, ConstrainError};
use cleave_tokenizer::Tokenizer;
use serde::Deserialize;

use crate::config::CoordinatorArgs;
use crate::error::CoordinatorError;

/// Context length used when neither the arguments nor config.json give one.
pub const FALLBACK_CONTEXT_LEN: u32 = 2048;

/// The served model as the HTTP edge sees it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `model` in requests and in /v1/models.
    pub name: String,
    pub tokenizer: Tokenizer,
    /// Most tokens (prompt plus generated) one sequence may hold.
    pub context_len: u32,
    /// Token ids that end generation unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Sampling defaults for fields a request leaves out, from generation_config.json
    /// (as vLLM does); OpenAI's defaults where the file says nothing.
    pub defaults: SamplingDefaults,
    /// Compiles output constraints against the vocabulary (built once, see
    /// [`ModelInfo::compiler_for`]); the error says why this model cannot be constrained, and
    /// every request that asks for a constraint gets it as a 400.
    pub compiler: Result<Compiler, ConstrainError>,
}

/// Defaults for omitted sampling fields. Validated like a request's values when used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    /// OpenAI's: temperature 1, no truncation, no penalty.
    fn default() -> Self {
        SamplingDefaults { temperature: 1.0, top_p: 1.0, top_k: 0, min_p: 0.0, repetition_penalty: 1.0 }
    }
}

/// `5` or `[5, 7]` in config.json / generation_config.json.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize, Default)]
struct ConfigFacts {
    #[serde(default)]
    max_position_embeddings: Option<u32>,
    #[serde(default)]
    n_positions: Option<u32>,
    #[serde(default)]
    max_seq_len: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    vocab_size: Option<usize>,
    #[serde(default)]
    do_sample: Option<bool>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
}

impl ConfigFacts {
    /// generation_config.json's sampling fields; `do_sample: false` (HF's greedy) makes the
    /// default temperature 0 unless a temperature is also given.
    fn sampling_defaults(&self) -> SamplingDefaults {
        let d = SamplingDefaults::default();
        let greedy = self.do_sample == Some(false);
        SamplingDefaults {
            temperature: self.temperature.unwrap_or(if greedy { 0.0 } else { d.temperature }),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.and_then(|k| u32::try_from(k).ok()).unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
        }
    }
}

impl ModelInfo {
    /// Loads the tokenizer and facts of a Hugging Face model folder. `config.json` and
    /// `generation_config.json` are optional; a malformed one is an error naming the file.
    pub fn from_args(args: &CoordinatorArgs) -> Result<Self, CoordinatorError> {
        let dir = args.model.as_deref().ok_or(CoordinatorError::NoModel)?;
        let tokenizer = Tokenizer::from_model_dir(dir)?;
        let config = read_facts(&dir.join("config.json"))?;
        let generation = read_facts(&dir.join("generation_config.json"))?;
        let name = args.served_model_name.clone().unwrap_or_else(|| default_name(dir));
        let context_len = args
            .max_model_len
            .or(config.max_position_embeddings)
            .or(config.n_positions)
            .or(config.max_seq_len)
            .unwrap_or(FALLBACK_CONTEXT_LEN)
            .max(1);
        let defaults = generation.sampling_defaults();
        let mut eos_token_ids = Vec::new();
        for ids in [generation.eos_token_id, config.eos_token_id].into_iter().flatten() {
            match ids {
                OneOrMany::One(id) => eos_token_ids.push(id),
                OneOrMany::Many(v) => eos_token_ids.extend(v),
            }
        }
        eos_token_ids.extend(tokenizer.eos_token_id());
        let mut seen = std::collections::HashSet::new();
        eos_token_ids.retain(|id| seen.insert(*id));
        let compiler = Self::compiler_for(&tokenizer, config.vocab_size.unwrap_or(0), &eos_token_ids);
        Ok(ModelInfo { name, tokenizer, context_len, eos_token_ids, defaults, compiler })
    }

    /// The constraint compiler of a model with `model_vocab` logits per row (the tokenizer's
    /// size when larger) and these EOS ids. Logs why when the vocabulary cannot be used.
    pub fn compiler_for(
        tokenizer: &Tokenizer,
        model_vocab: usize,
        eos_token_ids: &[u32],
    ) -> Result<Compiler, ConstrainError> {
        let vocab = model_vocab.max(tokenizer.vocab_size());
        let compiler = Compiler::new(tokenizer, vocab, eos_token_ids);
        if let Err(e) = &compiler {
            tracing::warn!(error = %e, "requests that constrain their output will be refused");
        }
        compiler
    }
}

/// The folder's last component (`/models/tiny-llama` -> `tiny-llama`).
fn default_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "cleave".into())
}

fn read_facts(path: &Path) -> Result<ConfigFacts, CoordinatorError> {
    if !path.is_file() {
        return Ok(ConfigFacts::default());
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| CoordinatorError::ModelConfig { path: PathBuf::from(path), reason: e.to_string() })?;
    serde_json::from_str(&text)
        .map_err(|e| CoordinatorError::ModelConfig { path: PathBuf::from(path), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(json: &str) -> ConfigFacts {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn generation_config_sampling_defaults() {
        assert_eq!(facts("{}").sampling_defaults(), SamplingDefaults::default());
        assert_eq!(facts(r#"{"do_sample": false}"#).sampling_defaults().temperature, 0.0);
        let d = facts(r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20}"#).sampling_defaults();
        assert_eq!((d.temperature, d.top_p, d.top_k), (0.6, 0.9, 20));
        assert_eq!(facts(r#"{"top_k": -1}"#).sampling_defaults().top_k, 0);
    }

    #[test]
    fn eos_ids_as_int_or_list() {
        assert!(matches!(facts(r#"{"eos_token_id": [2, 7]}"#).eos_token_id, Some(OneOrMany::Many(v)) if v == [2, 7]));
        assert!(matches!(facts(r#"{"eos_token_id": 2}"#).eos_token_id, Some(OneOrMany::One(2))));
    }
}
