//! The crate's one error type. Every variant carries the facts needed to act on it
//! (which file, which template, which id) rather than a bare message.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or
/// rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read (missing, permissions, ...).
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` exists but the `tokenizers` library rejected it.
    #[error("invalid tokenizer file {path}: {reason}")]
    InvalidTokenizerFile { path: PathBuf, reason: String },
    /// `tokenizer_config.json` / `special_tokens_map.json` is not the JSON we expect.
    #[error("invalid tokenizer config {path}: {reason}")]
    InvalidConfig { path: PathBuf, reason: String },
    /// The `tokenizers` library failed to encode a text of `len_bytes` bytes.
    #[error("encoding {len_bytes} bytes of text failed: {reason}")]
    Encode { len_bytes: usize, reason: String },
    /// The `tokenizers` library failed to decode `len` ids.
    #[error("decoding {len} token ids failed: {reason}")]
    Decode { len: usize, reason: String },
    /// A chat template does not parse.
    #[error("chat template {name:?} does not compile: {reason}")]
    TemplateSyntax { name: String, reason: String },
    /// A chat template failed while rendering (type error, unknown filter, ...).
    #[error("chat template {name:?} failed to render: {reason}")]
    TemplateRender { name: String, reason: String },
    /// The template itself called `raise_exception(message)`: usually the request
    /// is malformed for this model (e.g. a `system` role the model does not support).
    #[error("chat template {name:?} rejected the conversation: {message}")]
    TemplateException { name: String, message: String },
    /// Rendering ran past one of the bounds that keep a template (a model file, not
    /// client input, but still untrusted) from hanging a request or exhausting memory: the
    /// instructions one render may execute, the bytes it may output, or how deep `tojson` nests.
    #[error("chat template {name:?} exceeded its limit of {limit} {what}")]
    TemplateLimit { name: String, what: &'static str, limit: u64 },
    /// A template was requested by name but the model has no template of that name.
    #[error("no chat template named {name:?}; available: {available:?}")]
    UnknownTemplate { name: String, available: Vec<String> },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
