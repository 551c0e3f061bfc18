//! [`Tokenizer`]: a `tokenizers::Tokenizer` plus the model's `tokenizer_config.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::chat::{ChatMessage, ChatOptions, ChatTemplates, TemplateTokens};
use crate::config::{read_text, TokenizerConfig, DEFAULT_TEMPLATE_NAME};
use crate::error::{Result, TokenizerError};

/// A loaded tokenizer. Cheap to clone (one `Arc`), `Send + Sync`.
///
/// Invariant: `bos_id`/`eos_id` are the vocabulary ids of the config's `bos_token`/
/// `eos_token` texts, or `None` when the text is unset or not in the vocabulary.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    hf: tokenizers::Tokenizer,
    config: TokenizerConfig,
    templates: ChatTemplates,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// `hf.get_vocab_size(true)`, counted once: `tokenizers` answers it by building the whole
    /// token-to-id map (7 ms for a 49K vocabulary), and the edge asks on every request.
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.inner.config.bos_token)
            .field("eos_token", &self.inner.config.eos_token)
            .field("templates", &self.inner.templates)
            .finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` alone: no chat template (the ChatML fallback is used),
    /// no BOS/EOS texts.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::from_hf(load_hf(path.as_ref())?, TokenizerConfig::default()))
    }

    /// Wraps an already-built `tokenizers::Tokenizer` (e.g. one assembled from GGUF
    /// metadata) with its config.
    pub fn from_hf(hf: tokenizers::Tokenizer, config: TokenizerConfig) -> Self {
        let bos_id = config.bos_token.as_deref().and_then(|t| hf.token_to_id(t));
        let eos_id = config.eos_token.as_deref().and_then(|t| hf.token_to_id(t));
        let templates = ChatTemplates::new(
            &config.chat_templates,
            TemplateTokens {
                bos: config.bos_token.clone(),
                eos: config.eos_token.clone(),
                unk: config.unk_token.clone(),
                pad: config.pad_token.clone(),
            },
        );
        let vocab_size = hf.get_vocab_size(true);
        Tokenizer { inner: Arc::new(Inner { hf, config, templates, bos_id, eos_id, vocab_size }) }
    }

    /// Loads a Hugging Face model folder: `tokenizer.json` (required),
    /// `tokenizer_config.json` (optional), `special_tokens_map.json` (optional, fills
    /// BOS/EOS/UNK/PAD the config lacks) and, when the config has no `chat_template`,
    /// `chat_template.jinja` or `chat_template.json` (newer `transformers` layouts).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let hf = load_hf(&dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        let mut config =
            if config_path.is_file() { TokenizerConfig::from_file(&config_path)? } else { TokenizerConfig::default() };
        let map_path = dir.join("special_tokens_map.json");
        if map_path.is_file() {
            config.fill_from_special_tokens_map(&map_path)?;
        }
        if config.chat_templates.is_empty() {
            let jinja = dir.join("chat_template.jinja");
            let json = dir.join("chat_template.json");
            if jinja.is_file() {
                config.set_chat_template(DEFAULT_TEMPLATE_NAME, read_text(&jinja)?);
            } else if json.is_file() {
                // Same shape as tokenizer_config.json's `chat_template` field.
                let other = TokenizerConfig::from_file(&json)?;
                config.chat_templates = other.chat_templates;
            }
        }
        Ok(Self::from_hf(hf, config))
    }

    /// Token ids of `text`. `add_special_tokens` applies `tokenizer.json`'s
    /// post-processor (e.g. prepends BOS for Llama); chat-rendered prompts already
    /// contain their special tokens and want `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .hf
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode { len_bytes: text.len(), reason: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, exactly as `tokenizers`' `decode` (ids outside the vocabulary are
    /// dropped, as HF does). Incomplete UTF-8 from byte-fallback tokens becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .hf
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode { len: ids.len(), reason: e.to_string() })
    }

    /// Number of ids, added tokens included (counted at construction).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.hf.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.hf.id_to_token(id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.inner.config.bos_token.as_deref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_id
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.inner.config.eos_token.as_deref()
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.inner.eos_id
    }

    pub fn config(&self) -> &TokenizerConfig {
        &self.inner.config
    }

    /// The underlying `tokenizers` object, for anything not wrapped here.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner.hf
    }

    /// Renders `messages` with the model's default chat template (or the ChatML
    /// fallback, see [`crate::CHATML_FALLBACK_TEMPLATE`]). `strftime_now` reads the
    /// system clock; use [`Tokenizer::render_chat_with`] to inject one.
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_chat_with(messages, &ChatOptions { add_generation_prompt, ..ChatOptions::default() })
    }

    /// Renders `messages` with full control over template choice and clock.
    pub fn render_chat_with(&self, messages: &[ChatMessage], opts: &ChatOptions) -> Result<String> {
        self.inner.templates.render(messages, opts)
    }

    /// The source text of the template a render with `template_name` would use (the ChatML
    /// fallback's when the model has none): what callers read to learn what a template
    /// supports (e.g. whether it mentions `tools`).
    pub fn chat_template_source(&self, template_name: Option<&str>) -> Result<&str> {
        self.inner.templates.source(template_name)
    }

    /// Names of the model's chat templates, in file order (the fallback's name when the
    /// model has none).
    pub fn chat_template_names(&self) -> &[String] {
        self.inner.templates.names()
    }

    /// False when the model ships no template and the ChatML fallback is used.
    pub fn has_chat_template(&self) -> bool {
        !self.inner.templates.is_fallback()
    }
}

/// Reads and parses a `tokenizer.json`, naming the file in every error.
fn load_hf(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io { path: PathBuf::from(path), source })?;
    tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| TokenizerError::InvalidTokenizerFile { path: PathBuf::from(path), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn tokenizer_is_send_sync() {
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<crate::IncrementalDecoder>();
    }

    #[test]
    fn missing_and_invalid_files_name_the_file() {
        let err = Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err();
        assert!(matches!(err, TokenizerError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/tokenizer.json"), "{err}");

        let dir = std::env::temp_dir().join(format!("cleave-tok-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("tokenizer.json");
        std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
        let err = Tokenizer::from_model_dir(&dir).unwrap_err();
        assert!(matches!(err, TokenizerError::InvalidTokenizerFile { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        let err = Tokenizer::from_model_dir(dir.join("missing")).unwrap_err();
        assert!(err.to_string().contains("missing/tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
