//! `tokenizer_config.json` (and friends) as written by Hugging Face `transformers`.
//!
//! Only the fields cleave needs are read; everything else in the file is ignored.
//! Every field is optional: a model folder without a config still loads.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Result, TokenizerError};

/// Name of the template used when a model ships a single, unnamed one; HF uses the
/// same name for the entry of a named list that should be used by default.
pub const DEFAULT_TEMPLATE_NAME: &str = "default";

/// One chat template with its name (`"default"`, `"tool_use"`, `"rag"`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NamedTemplate {
    pub name: String,
    pub template: String,
}

/// The parts of `tokenizer_config.json` cleave uses.
///
/// Invariant: `chat_templates` names are unique (a later duplicate replaces an
/// earlier one while parsing).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// Chat templates; a single-string `chat_template` becomes one entry named
    /// [`DEFAULT_TEMPLATE_NAME`].
    pub chat_templates: Vec<NamedTemplate>,
    /// The BOS token's text (e.g. `<s>`), as the template variable `bos_token` sees it.
    pub bos_token: Option<String>,
    /// The EOS token's text (e.g. `</s>`), as the template variable `eos_token` sees it.
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    /// Whether HF's slow tokenizer would prepend BOS. Informational: `tokenizer.json`'s
    /// post-processor is what [`crate::Tokenizer::encode`] actually follows.
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
}

/// `"<s>"` or `{"content": "<s>", "lstrip": false, ...}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenSpec {
    Text(String),
    Object { content: String },
}

impl TokenSpec {
    fn into_text(self) -> String {
        match self {
            TokenSpec::Text(s) | TokenSpec::Object { content: s } => s,
        }
    }
}

/// `"{{ ... }}"` or `[{"name": "default", "template": "..."}, ...]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateSpec {
    Single(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    chat_template: Option<TemplateSpec>,
    #[serde(default)]
    bos_token: Option<TokenSpec>,
    #[serde(default)]
    eos_token: Option<TokenSpec>,
    #[serde(default)]
    unk_token: Option<TokenSpec>,
    #[serde(default)]
    pad_token: Option<TokenSpec>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    add_eos_token: Option<bool>,
}

impl TokenizerConfig {
    /// Parses the JSON text of a `tokenizer_config.json`; `origin` only names the
    /// source in errors.
    pub fn from_json_str(json: &str, origin: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(json)
            .map_err(|e| TokenizerError::InvalidConfig { path: origin.to_path_buf(), reason: e.to_string() })?;
        let mut config = TokenizerConfig {
            chat_templates: Vec::new(),
            bos_token: raw.bos_token.map(TokenSpec::into_text),
            eos_token: raw.eos_token.map(TokenSpec::into_text),
            unk_token: raw.unk_token.map(TokenSpec::into_text),
            pad_token: raw.pad_token.map(TokenSpec::into_text),
            add_bos_token: raw.add_bos_token,
            add_eos_token: raw.add_eos_token,
        };
        match raw.chat_template {
            None => {}
            Some(TemplateSpec::Single(template)) => config.set_chat_template(DEFAULT_TEMPLATE_NAME, template),
            Some(TemplateSpec::Named(list)) => {
                for t in list {
                    config.set_chat_template(&t.name, t.template);
                }
            }
        }
        Ok(config)
    }

    /// Reads and parses a `tokenizer_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_json_str(&read_text(path)?, path)
    }

    /// Adds or replaces the template called `name`.
    pub fn set_chat_template(&mut self, name: &str, template: String) {
        match self.chat_templates.iter_mut().find(|t| t.name == name) {
            Some(existing) => existing.template = template,
            None => self.chat_templates.push(NamedTemplate { name: name.to_owned(), template }),
        }
    }

    /// Fills special tokens this config lacks from a `special_tokens_map.json`
    /// (same `"<s>"` / `{"content": ...}` shapes). Tokens already set are kept.
    pub fn fill_from_special_tokens_map(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let other = Self::from_json_str(&read_text(path)?, path)?;
        let fill = |mine: &mut Option<String>, theirs: Option<String>| {
            if mine.is_none() {
                *mine = theirs;
            }
        };
        fill(&mut self.bos_token, other.bos_token);
        fill(&mut self.eos_token, other.eos_token);
        fill(&mut self.unk_token, other.unk_token);
        fill(&mut self.pad_token, other.pad_token);
        Ok(())
    }
}

/// Reads a UTF-8 file, naming it in the error.
pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: PathBuf::from(path), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> TokenizerConfig {
        TokenizerConfig::from_json_str(json, Path::new("test.json")).unwrap()
    }

    #[test]
    fn empty_object_is_all_none() {
        assert_eq!(parse("{}"), TokenizerConfig::default());
    }

    #[test]
    fn tokens_as_strings_or_objects() {
        let c = parse(
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                "pad_token": null, "add_bos_token": true}"#,
        );
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.pad_token, None);
        assert_eq!(c.add_bos_token, Some(true));
    }

    #[test]
    fn template_as_string_or_named_list() {
        let c = parse(r#"{"chat_template": "{{ x }}"}"#);
        assert_eq!(c.chat_templates, vec![NamedTemplate { name: "default".into(), template: "{{ x }}".into() }]);
        let c = parse(
            r#"{"chat_template": [{"name": "default", "template": "a"},
                                  {"name": "tool_use", "template": "b"},
                                  {"name": "default", "template": "c"}]}"#,
        );
        assert_eq!(c.chat_templates.len(), 2);
        assert_eq!(c.chat_templates[0].template, "c");
        assert_eq!(c.chat_templates[1].name, "tool_use");
    }

    #[test]
    fn bad_json_names_the_file() {
        let err = TokenizerConfig::from_json_str("{", Path::new("dir/tokenizer_config.json")).unwrap_err();
        assert!(err.to_string().contains("dir/tokenizer_config.json"), "{err}");
        let err = TokenizerConfig::from_json_str(r#"{"bos_token": 3}"#, Path::new("x.json")).unwrap_err();
        assert!(matches!(err, TokenizerError::InvalidConfig { .. }));
    }

    #[test]
    fn missing_file_names_the_file() {
        let err = TokenizerConfig::from_file("/nonexistent/tokenizer_config.json").unwrap_err();
        assert!(matches!(err, TokenizerError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/tokenizer_config.json"));
    }
}
