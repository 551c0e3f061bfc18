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
    vocab: Vocab,
    config: TokenizerConfig,
    templates: ChatTemplates,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// `hf.get_vocab_size(true)`, counted once: `tokenizers` answers it by building the whole
    /// token-to-id map (7 ms for a 49K vocabulary), and the edge asks on every request.
    vocab_size: usize,
}

/// What turns text into ids and back.
enum Vocab {
    /// The whole `tokenizers` tokenizer: encodes and decodes.
    Whole(tokenizers::Tokenizer),
    /// Only what decoding reads (see [`Tokenizer::for_decoding`]).
    Spelled(Spelling),
}

/// Every id's token string and the decoder: what `tokenizers`' `decode` reads, and nothing of
/// what encoding needs (the token-to-id map, the merges, the pre-tokenizer's regexes). A
/// SmolLM2 tokenizer holds 9.0 MiB of heap whole and 0.6 MiB so (glibc's `mallinfo2`).
///
/// Invariant: `ends.len() == known.len() + 1`; id `i`'s string is `text[ends[i]..ends[i + 1]]`
/// when `known[i]`, and is what `tokenizers::Tokenizer::id_to_token(i)` returns (an added
/// token's content, else the model's token); ids past `known` have none.
struct Spelling {
    text: String,
    ends: Vec<u32>,
    known: Vec<bool>,
    /// The contents of the added tokens marked special: `tokenizers` skips a token by its
    /// string, so these are strings too.
    special: std::collections::HashSet<String>,
    /// The same tokens by id, in id order.
    special_ids: Vec<(u32, String)>,
    decoder: Option<tokenizers::DecoderWrapper>,
}

impl Spelling {
    fn of(hf: &tokenizers::Tokenizer) -> Result<Self> {
        let ids = hf.get_vocab(true).into_values().max().map_or(0, |m| m as usize + 1);
        let (mut text, mut ends, mut known) = (String::new(), Vec::with_capacity(ids + 1), Vec::with_capacity(ids));
        ends.push(0);
        for id in 0..ids as u32 {
            let token = hf.id_to_token(id);
            known.push(token.is_some());
            text.push_str(token.as_deref().unwrap_or(""));
            let end = u32::try_from(text.len()).map_err(|_| TokenizerError::Decode {
                len: ids,
                reason: "the vocabulary's strings pass 4 GiB".into(),
            })?;
            ends.push(end);
        }
        text.shrink_to_fit();
        let special_ids = special_tokens_of(hf);
        let special = special_ids.iter().map(|(_, s)| s.clone()).collect();
        Ok(Self { text, ends, known, special, special_ids, decoder: hf.get_decoder().cloned() })
    }

    fn token(&self, id: u32) -> Option<&str> {
        let i = id as usize;
        (*self.known.get(i)?).then(|| &self.text[self.ends[i] as usize..self.ends[i + 1] as usize])
    }

    /// `tokenizers::Tokenizer::decode`, step for step: each id's string (ids without one
    /// dropped), special ones left out when asked, then the decoder (or a space between
    /// tokens when there is none).
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> tokenizers::Result<String> {
        use tokenizers::Decoder;
        let tokens: Vec<String> = ids
            .iter()
            .filter_map(|&id| self.token(id))
            .filter(|t| !skip_special_tokens || !self.special.contains(*t))
            .map(str::to_string)
            .collect();
        match &self.decoder {
            Some(d) => d.decode(tokens),
            None => Ok(tokens.join(" ")),
        }
    }
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
        let templates = templates_of(&config);
        let vocab_size = hf.get_vocab_size(true);
        let vocab = Vocab::Whole(hf);
        Tokenizer { inner: Arc::new(Inner { vocab, config, templates, bos_id, eos_id, vocab_size }) }
    }

    /// A copy that decodes exactly as this one does and cannot encode: it keeps each id's
    /// string and the decoder, not the token-to-id map, the merges or the pre-tokenizer. For
    /// a node, which gets token ids and only turns them into text (stop strings, the
    /// constraint compiler's trie, the model identity's vocabulary part); the edge encodes.
    /// SmolLM2's tokenizer is 9.0 MiB of heap whole and 0.6 MiB so.
    pub fn for_decoding(&self) -> Result<Tokenizer> {
        let vocab = match &self.inner.vocab {
            Vocab::Whole(hf) => Vocab::Spelled(Spelling::of(hf)?),
            Vocab::Spelled(_) => return Ok(self.clone()),
        };
        let i = &self.inner;
        let inner = Inner {
            vocab,
            config: i.config.clone(),
            templates: templates_of(&i.config),
            bos_id: i.bos_id,
            eos_id: i.eos_id,
            vocab_size: i.vocab_size,
        };
        Ok(Tokenizer { inner: Arc::new(inner) })
    }

    /// False for a tokenizer made by [`Tokenizer::for_decoding`].
    pub fn can_encode(&self) -> bool {
        matches!(self.inner.vocab, Vocab::Whole(_))
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
        let Vocab::Whole(hf) = &self.inner.vocab else {
            let reason = "this tokenizer keeps only what decoding needs (Tokenizer::for_decoding)".into();
            return Err(TokenizerError::Encode { len_bytes: text.len(), reason });
        };
        let encoding = hf
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode { len_bytes: text.len(), reason: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, exactly as `tokenizers`' `decode` (ids outside the vocabulary are
    /// dropped, as HF does). Incomplete UTF-8 from byte-fallback tokens becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match &self.inner.vocab {
            Vocab::Whole(hf) => hf.decode(ids, skip_special_tokens),
            Vocab::Spelled(s) => s.decode(ids, skip_special_tokens),
        }
        .map_err(|e| TokenizerError::Decode { len: ids.len(), reason: e.to_string() })
    }

    /// Number of ids, added tokens included (counted at construction).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The id of `token`. A decode-only tokenizer tries the special tokens, then searches its
    /// strings for the lowest id spelled so (a model's ids are looked up by string at
    /// construction, not per request).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner.vocab {
            Vocab::Whole(hf) => hf.token_to_id(token),
            Vocab::Spelled(s) => {
                let added = s.special_ids.iter().find(|(_, t)| t == token).map(|&(id, _)| id);
                added.or_else(|| (0..s.known.len() as u32).find(|&id| s.token(id) == Some(token)))
            }
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner.vocab {
            Vocab::Whole(hf) => hf.id_to_token(id),
            Vocab::Spelled(s) => s.token(id).map(str::to_string),
        }
    }

    /// The decoder of `tokenizer.json`, if it has one: how token strings spell bytes.
    pub fn decoder(&self) -> Option<&tokenizers::DecoderWrapper> {
        match &self.inner.vocab {
            Vocab::Whole(hf) => hf.get_decoder(),
            Vocab::Spelled(s) => s.decoder.as_ref(),
        }
    }

    /// The added tokens marked special, by id, in id order.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        match &self.inner.vocab {
            Vocab::Whole(hf) => special_tokens_of(hf),
            Vocab::Spelled(s) => s.special_ids.clone(),
        }
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

    /// The underlying `tokenizers` object, for anything not wrapped here; `None` for a
    /// tokenizer made by [`Tokenizer::for_decoding`].
    pub fn hf(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.inner.vocab {
            Vocab::Whole(hf) => Some(hf),
            Vocab::Spelled(_) => None,
        }
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

/// The chat templates of `config`, compiled.
fn templates_of(config: &TokenizerConfig) -> ChatTemplates {
    let tokens = TemplateTokens {
        bos: config.bos_token.clone(),
        eos: config.eos_token.clone(),
        unk: config.unk_token.clone(),
        pad: config.pad_token.clone(),
    };
    ChatTemplates::new(&config.chat_templates, tokens)
}

/// The added tokens of `hf` marked special, by id, in id order.
fn special_tokens_of(hf: &tokenizers::Tokenizer) -> Vec<(u32, String)> {
    let mut v: Vec<(u32, String)> =
        hf.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, t)| (id, t.content)).collect();
    v.sort_unstable();
    v
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
