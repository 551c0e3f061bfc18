//! Chat template rendering, compatible with Hugging Face `transformers`' conventions.
//!
//! HF renders `tokenizer_config.json`'s `chat_template` with Jinja2 configured as
//! `trim_blocks=True, lstrip_blocks=True` plus the `loopcontrols` extension, and exposes
//! `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that behaves like
//! Python's `json.dumps(..., ensure_ascii=False)`. Templates are written against Python
//! objects, so they call string/dict methods (`.strip()`, `.items()`); minijinja-contrib's
//! `pycompat` callback provides those. The context has `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, `unk_token`, `pad_token`, and `tools` when the caller gives
//! some ([`ChatOptions::tools`]; undefined otherwise, as in transformers); `documents` is left
//! undefined. A message carries `tool_calls` (with each call's `arguments` as a JSON value, as
//! transformers' templates expect), `tool_call_id` and `name` only when set.
//!
//! No wall clock is read unless the caller leaves [`ChatOptions::now_unix_secs`] unset.
//! A template that fails to compile does not prevent the tokenizer from loading: the
//! error is kept and returned by every render that selects that template.
//!
//! Rendering is bounded. A template comes with a model file (GGUF metadata,
//! `tokenizer_config.json`) and is code we did not write, run on every chat request; Jinja has
//! loops over ranges and recursive macros, so a careless or hostile template could otherwise
//! hang a request, fill memory or overflow a stack. One render executes at most
//! [`RENDER_FUEL`] instructions and outputs at most [`MAX_RENDERED_BYTES`]; `tojson` nests at
//! most [`MAX_TOJSON_DEPTH`] deep with an indent of at most [`MAX_TOJSON_INDENT`]; past any of
//! them the render fails with [`TokenizerError::TemplateLimit`]. Macro calls nest at most
//! minijinja's 500 deep (a render error). The render runs on a thread of its own whose stack
//! ([`RENDER_STACK_BYTES`]) holds the deepest value the fuel can build. What these bounds do
//! not make is a memory quota: within the fuel a template can still concatenate a string to a
//! few GB (minijinja caps one repetition, `'x' * n`, at 100 MB, but not `s ~ s` doubled in a
//! loop); that takes a template written to do it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};

use crate::config::{NamedTemplate, DEFAULT_TEMPLATE_NAME};
use crate::error::{Result, TokenizerError};

/// The template used when a model ships none: ChatML, as used by SmolLM2 and Qwen
/// (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` when a generation prompt is asked for). No BOS is emitted.
pub const CHATML_FALLBACK_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Name under which [`CHATML_FALLBACK_TEMPLATE`] is registered when a model has no template.
pub const FALLBACK_TEMPLATE_NAME: &str = "cleave_chatml_fallback";

/// Instructions one render may execute. Measured: SmolLM2's template, the Llama 3 style one of
/// `tests/golden.rs` and the tiny model's each spend 20 to 23 per turn, so 40,000 turns fit
/// (`long_conversations_fit_the_render_budget` holds 5,000 to it); a runaway loop stops within
/// a fraction of a second.
pub const RENDER_FUEL: u64 = 1_000_000;

/// Stack of the thread each render runs on. A template can nest a value one level deeper per
/// instruction (`{% set ns.x = [[[ns.x]]] %}` in a loop), and dropping, printing or comparing
/// that value recurses once per level: 140 to 280 bytes of stack each in an optimised build
/// (measured: 8 MiB overflowed between 30,000 and 60,000 levels), so a render on the caller's
/// thread (2 MiB on a tokio worker) could overflow it and abort the process. This stack holds
/// the levels [`RENDER_FUEL`] can build. It is address space, not memory: only the pages a
/// render touches are ever backed.
pub const RENDER_STACK_BYTES: usize = 256 << 20;

/// Bytes one render may output: far more than any prompt a model's context holds (and than the
/// API accepts as a request body), small enough that a runaway template cannot exhaust memory
/// through its output.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// Deepest value `tojson` writes (Python's `json.dumps` stops at its recursion limit too); a
/// deeper value is refused rather than overflowing the stack.
pub const MAX_TOJSON_DEPTH: usize = 128;

/// Largest `tojson` indent, in spaces (templates use 2 or 4).
pub const MAX_TOJSON_INDENT: usize = 64;

/// Context variable carrying the render's clock for `strftime_now`. Reserved: a
/// template reading it gets seconds since the Unix epoch.
const NOW_VAR: &str = "__cleave_now_unix_secs";

/// One turn of a conversation. The optional fields are absent from the template's message
/// when unset (templates test `'tool_calls' in message` or `message.tool_calls is defined`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The function calls of an assistant turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
    /// The call a `tool` turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The function a `tool` turn answers (some templates print it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One function call of an assistant turn, shaped as transformers' templates read it:
/// `tool_call.id`, `tool_call.type`, `tool_call.function.name`, `tool_call.function.arguments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ChatFunctionCall,
}

/// A call's function: its name and its arguments as a JSON value (an object, not the JSON text
/// the OpenAI API carries: templates `tojson` it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatFunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// How to render a conversation. `Default` = no generation prompt, the model's default
/// template, the system clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatOptions {
    /// Append the header that starts the assistant's turn.
    pub add_generation_prompt: bool,
    /// Template to use; `None` picks `"default"` if present, else the model's first one.
    pub template_name: Option<String>,
    /// What `strftime_now` formats (UTC, seconds since the Unix epoch); `None` reads the
    /// system clock when rendering.
    pub now_unix_secs: Option<i64>,
    /// The template's `tools`: function definitions as the OpenAI API gives them
    /// (`{"type": "function", "function": {"name", "description", "parameters"}}`); `None`
    /// leaves `tools` undefined.
    pub tools: Option<Vec<serde_json::Value>>,
}

/// Special-token texts exposed to templates as variables.
#[derive(Debug, Clone, Default)]
pub(crate) struct TemplateTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub pad: Option<String>,
}

/// A model's compiled chat templates.
///
/// Invariant: every name in `names` is either compiled in `env` or has an entry in
/// `broken`; `names` is never empty (the fallback is registered when the model has none).
pub(crate) struct ChatTemplates {
    env: Environment<'static>,
    names: Vec<String>,
    /// Each template's source, by name (same order as `names`).
    sources: Vec<String>,
    broken: BTreeMap<String, String>,
    tokens: TemplateTokens,
}

impl std::fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplates")
            .field("names", &self.names)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

/// Marker attached to the minijinja error produced by `raise_exception`, so that a
/// deliberate rejection can be told apart from a template bug.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// Marker attached to the minijinja error of a render stopped by one of this module's bounds.
#[derive(Debug)]
struct LimitExceeded {
    what: &'static str,
    limit: u64,
}

impl std::fmt::Display for LimitExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "more than {} {}", self.limit, self.what)
    }
}

impl std::error::Error for LimitExceeded {}

impl LimitExceeded {
    fn into_error(self) -> minijinja::Error {
        minijinja::Error::new(ErrorKind::InvalidOperation, "template exceeded a rendering limit").with_source(self)
    }
}

/// The render's output, refusing any write that would take it past `max` bytes (a refused
/// write appends nothing, so the buffer stays valid UTF-8: minijinja writes whole `str`s).
struct BoundedOutput {
    buf: Vec<u8>,
    max: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.max {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplates {
    pub(crate) fn new(templates: &[NamedTemplate], tokens: TemplateTokens) -> Self {
        let mut env = hf_environment();
        let mut names = Vec::new();
        let mut sources = Vec::new();
        let mut broken = BTreeMap::new();
        let fallback =
            [NamedTemplate { name: FALLBACK_TEMPLATE_NAME.to_owned(), template: CHATML_FALLBACK_TEMPLATE.to_owned() }];
        let templates = if templates.is_empty() { &fallback[..] } else { templates };
        for t in templates {
            if let Err(e) = env.add_template_owned(t.name.clone(), t.template.clone()) {
                broken.insert(t.name.clone(), e.to_string());
            }
            names.push(t.name.clone());
            sources.push(t.template.clone());
        }
        ChatTemplates { env, names, sources, broken, tokens }
    }

    /// The source of the template a render with `requested` would use.
    pub(crate) fn source(&self, requested: Option<&str>) -> Result<&str> {
        let name = self.resolve(requested)?;
        let i = self.names.iter().position(|n| n == name).unwrap_or(0);
        Ok(self.sources.get(i).map(String::as_str).unwrap_or_default())
    }

    /// Template names in the order the model lists them.
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether the model shipped no template and the ChatML fallback is in use.
    pub(crate) fn is_fallback(&self) -> bool {
        self.names == [FALLBACK_TEMPLATE_NAME]
    }

    fn resolve(&self, requested: Option<&str>) -> Result<&str> {
        match requested {
            Some(name) => self.names.iter().find(|n| *n == name).map(String::as_str).ok_or_else(|| {
                TokenizerError::UnknownTemplate { name: name.to_owned(), available: self.names.clone() }
            }),
            None => Ok(self.names.iter().find(|n| *n == DEFAULT_TEMPLATE_NAME).unwrap_or(&self.names[0])),
        }
    }

    pub(crate) fn render(&self, messages: &[ChatMessage], opts: &ChatOptions) -> Result<String> {
        let name = self.resolve(opts.template_name.as_deref())?;
        if let Some(reason) = self.broken.get(name) {
            return Err(TokenizerError::TemplateSyntax { name: name.to_owned(), reason: reason.clone() });
        }
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TokenizerError::TemplateSyntax { name: name.to_owned(), reason: e.to_string() })?;
        let now = opts.now_unix_secs.unwrap_or_else(system_now_unix_secs);
        let t = &self.tokens;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => opts.add_generation_prompt,
            bos_token => t.bos.as_deref().unwrap_or(""),
            eos_token => t.eos.as_deref().unwrap_or(""),
            unk_token => t.unk.as_deref(),
            pad_token => t.pad.as_deref(),
            __cleave_now_unix_secs => now,
        };
        let ctx = match &opts.tools {
            Some(tools) => minijinja::context! { tools => Value::from_serialize(tools), ..ctx },
            None => ctx,
        };
        // Everything the render builds is also dropped inside `run`, on the render thread.
        let run = move || {
            let mut out = BoundedOutput { buf: Vec::new(), max: MAX_RENDERED_BYTES, overflowed: false };
            match template.render_captured_to(ctx, &mut out) {
                Ok(_) => String::from_utf8(out.buf).map_err(|e| TokenizerError::TemplateRender {
                    name: name.to_owned(),
                    reason: format!("output is not UTF-8: {e}"),
                }),
                Err(_) if out.overflowed => Err(TokenizerError::TemplateLimit {
                    name: name.to_owned(),
                    what: "bytes of output",
                    limit: MAX_RENDERED_BYTES as u64,
                }),
                Err(e) => Err(classify(name, e)),
            }
        };
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, run)
                .map_err(|e| TokenizerError::TemplateRender {
                    name: name.to_owned(),
                    reason: format!("cannot start the render thread: {e}"),
                })?;
            thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

/// Turns a render error into ours, recognizing `raise_exception` and the render bounds.
fn classify(name: &str, err: minijinja::Error) -> TokenizerError {
    if err.kind() == ErrorKind::OutOfFuel {
        return TokenizerError::TemplateLimit { name: name.to_owned(), what: "instructions", limit: RENDER_FUEL };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TokenizerError::TemplateException { name: name.to_owned(), message: raised.0.clone() };
        }
        if let Some(limit) = e.downcast_ref::<LimitExceeded>() {
            return TokenizerError::TemplateLimit { name: name.to_owned(), what: limit.what, limit: limit.limit };
        }
        source = e.source();
    }
    TokenizerError::TemplateRender { name: name.to_owned(), reason: err.to_string() }
}

fn system_now_unix_secs() -> i64 {
    // Only reached when the caller did not inject a clock (see ChatOptions::now_unix_secs).
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// A minijinja environment configured like transformers' `_compile_jinja_template`.
fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(RENDER_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, "template raised an exception")
        .with_source(RaisedException(message)))
}

fn strftime_now(state: &State, format: &str) -> std::result::Result<String, minijinja::Error> {
    let now = state.lookup(NOW_VAR).and_then(|v| v.as_i64()).unwrap_or_else(system_now_unix_secs);
    Ok(crate::strftime::format_utc(format, now))
}

/// `json.dumps(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
/// with the same keyword arguments as HF's override (`indent` may also be positional).
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => {
                let n = usize::try_from(n).unwrap_or(0);
                if n > MAX_TOJSON_INDENT {
                    return Err(
                        LimitExceeded { what: "spaces of tojson indent", limit: MAX_TOJSON_INDENT as u64 }.into_error()
                    );
                }
                Some(" ".repeat(n))
            }
            (None, Some(s)) if s.len() > MAX_TOJSON_INDENT => {
                return Err(
                    LimitExceeded { what: "bytes of tojson indent", limit: MAX_TOJSON_INDENT as u64 }.into_error()
                )
            }
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(seps) if seps.len() == 2 => Some((seps[0].clone(), seps[1].clone())),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        None => None,
    };
    let (item_sep, key_sep) = separators.unwrap_or_else(|| {
        let item = if indent.is_some() { "," } else { ", " };
        (item.to_owned(), ": ".to_owned())
    });
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    style.write(&mut out, &value, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting options.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(unit) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(unit);
            }
        }
    }

    /// Writes `v` at nesting `depth`. Stops with [`LimitExceeded`] past [`MAX_TOJSON_DEPTH`]
    /// (recursion is one stack frame per level) and once `out` is past [`MAX_RENDERED_BYTES`]
    /// (checked before every value, so `out` outgrows the bound by at most one scalar or one
    /// indented newline).
    fn write(&self, out: &mut String, v: &Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
        if depth > MAX_TOJSON_DEPTH {
            return Err(LimitExceeded { what: "levels of tojson nesting", limit: MAX_TOJSON_DEPTH as u64 }.into_error());
        }
        if out.len() > MAX_RENDERED_BYTES {
            return Err(LimitExceeded { what: "bytes of output", limit: MAX_RENDERED_BYTES as u64 }.into_error());
        }
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                let s = v.to_string();
                out.push_str(match s.as_str() {
                    "inf" => "Infinity",
                    "-inf" => "-Infinity",
                    "NaN" | "nan" => "NaN",
                    other => other,
                });
            }
            ValueKind::String => self.write_str(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.write_container(out, '[', ']', items.len(), depth, |out, i| {
                    self.write(out, &items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.write_container(out, '{', '}', keys.len(), depth, |out, i| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => self.write_str(out, s),
                        None => self.write_str(out, &key.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(key)?, depth + 1)
                })?;
            }
            _ => self.write_str(out, &v.to_string()),
        }
        Ok(())
    }

    fn write_container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut String, usize) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            item(out, i)?;
        }
        self.newline(out, depth);
        out.push(close);
        Ok(())
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn templates(src: &str) -> ChatTemplates {
        ChatTemplates::new(
            &[NamedTemplate { name: "default".into(), template: src.into() }],
            TemplateTokens { bos: Some("<s>".into()), eos: Some("</s>".into()), ..Default::default() },
        )
    }

    fn render(src: &str) -> Result<String> {
        templates(src).render(
            &[ChatMessage::user("hi")],
            &ChatOptions {
                now_unix_secs: Some(1_721_865_600), // 2024-07-25 00:00:00 UTC
                ..Default::default()
            },
        )
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render(r#"{{ {"a": 1, "b": [true, none, "x\"é"], "c": {}} | tojson }}"#);
        assert_eq!(out.unwrap(), r#"{"a": 1, "b": [true, null, "x\"é"], "c": {}}"#);
        let out = render(r#"{{ {"b": [1, 2], "a": "<"} | tojson(indent=2) }}"#).unwrap();
        assert_eq!(out, "{\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": \"<\"\n}");
        let out = render(r#"{{ {"b": 1, "a": 2} | tojson(sort_keys=true, separators=[",", ":"]) }}"#);
        assert_eq!(out.unwrap(), r#"{"a":2,"b":1}"#);
        let out = render(r#"{{ "é🎉" | tojson(ensure_ascii=true) }}"#);
        assert_eq!(out.unwrap(), r#""\u00e9\ud83c\udf89""#);
    }

    #[test]
    fn strftime_now_uses_injected_clock() {
        let out = render(r#"{{ strftime_now("%d %b %Y") }}|{{ strftime_now("%Y-%m-%d %H:%M") }}"#);
        assert_eq!(out.unwrap(), "25 Jul 2024|2024-07-25 00:00");
    }

    #[test]
    fn pycompat_methods_and_loop_controls() {
        let out = render(
            "{% for m in messages %}{{ m['content'].upper() }}{{ '  x '.strip() }}{% endfor %}\
             {% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}\
             {% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}",
        );
        assert_eq!(out.unwrap(), "HIx1a=1");
    }

    #[test]
    fn tools_and_tool_calls_reach_the_template() {
        let src = "{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};{% endfor %}\
                   {% for m in messages %}{{ m.role }}{% if 'tool_calls' in m %}\
                   {% for c in m.tool_calls %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]\
                   {% endfor %}{% endif %}{% if m.tool_call_id is defined %}<{{ m.tool_call_id }}>{% endif %}|{% endfor %}";
        let tool = serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}});
        let mut call = ChatMessage::assistant("");
        call.tool_calls.push(ChatToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: ChatFunctionCall { name: "f".into(), arguments: serde_json::json!({"x": [1, "y"]}) },
        });
        let mut answer = ChatMessage::new("tool", "42");
        answer.tool_call_id = Some("call_1".into());
        let opts = ChatOptions { tools: Some(vec![tool]), ..Default::default() };
        let out = templates(src).render(&[ChatMessage::user("hi"), call, answer], &opts).unwrap();
        assert_eq!(out, "f:{\"b\": 1, \"a\": 2};user|assistant[call_1 f {\"x\": [1, \"y\"]}]|tool<call_1>|");
    }

    #[test]
    fn tools_is_undefined_and_tokens_are_set() {
        let out = render("{% if tools is defined %}T{% endif %}{{ bos_token }}{{ eos_token }}");
        assert_eq!(out.unwrap(), "<s></s>");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let out = render("{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}");
        assert_eq!(out.unwrap(), "user\n");
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let err =
            render("{% if messages[0].role == 'user' %}{{ raise_exception('no users here') }}{% endif %}").unwrap_err();
        match err {
            TokenizerError::TemplateException { name, message } => {
                assert_eq!(name, "default");
                assert_eq!(message, "no users here");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn broken_template_errors_at_render_not_load() {
        let err = render("{% for %}").unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateSyntax { .. }), "{err}");
        let err = render("{{ 1 | no_such_filter }}").unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateSyntax { .. } | TokenizerError::TemplateRender { .. }), "{err}");
    }

    #[test]
    fn unknown_template_name_lists_available() {
        let err = templates("x")
            .render(&[], &ChatOptions { template_name: Some("tool_use".into()), ..Default::default() })
            .unwrap_err();
        assert!(err.to_string().contains("tool_use") && err.to_string().contains("default"));
    }

    fn assert_limit(result: Result<String>, want_what: &str) {
        match result {
            Err(TokenizerError::TemplateLimit { name, what, .. }) => {
                assert_eq!(name, "default");
                assert_eq!(what, want_what);
            }
            other => panic!("expected a {want_what} limit, got {other:?}"),
        }
    }

    #[test]
    fn a_runaway_loop_runs_out_of_fuel() {
        // 10^10 iterations: without fuel this render would not end.
        let src = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        assert_limit(render(src), "instructions");
    }

    #[test]
    fn output_is_bounded() {
        // 100 x 10 MB: a gigabyte unless the output stops at MAX_RENDERED_BYTES.
        assert_limit(render("{% for i in range(100) %}{{ 'x' * 10000000 }}{% endfor %}"), "bytes of output");
    }

    #[test]
    fn deep_recursion_is_an_error_on_a_small_stack() {
        // Unbounded macro recursion ends at minijinja's limit, on the render thread's stack,
        // whatever the caller's (tokio's workers have 2 MiB).
        let out = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").map_err(|e| e.to_string()))
            .unwrap()
            .join()
            .expect("the render thread survives");
        let err = out.unwrap_err();
        assert!(err.contains("recursion"), "{err}");
    }

    #[test]
    fn a_deeply_nested_value_does_not_overflow_the_callers_stack() {
        // 200,000 levels of lists (10 per iteration, within the fuel): dropping them recurses
        // once per level, tens of MB of stack; the caller has tokio's 2 MiB.
        let src = "{% set ns = namespace(x=1) %}{% for i in range(20000) %}\
                   {% set ns.x = [[[[[[[[[[ns.x]]]]]]]]]] %}{% endfor %}{{ ns.x | length }}";
        let out = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || render(src).map_err(|e| e.to_string()))
            .unwrap()
            .join()
            .expect("the caller's thread survives");
        assert_eq!(out.unwrap(), "1");
        // And when the fuel runs out mid-way, the value built so far is dropped safely too.
        let src = "{% set ns = namespace(x=1) %}{% for i in range(1000) %}{% for j in range(1000) %}\
                   {% set ns.x = [[[[[[[[[[ns.x]]]]]]]]]] %}{% endfor %}{% endfor %}";
        let out = std::thread::Builder::new().stack_size(2 << 20).spawn(move || render(src)).unwrap().join();
        assert_limit(out.expect("the caller's thread survives"), "instructions");
    }

    #[test]
    fn tojson_is_bounded() {
        // A huge indent used to reach `" ".repeat(n)`: a capacity-overflow panic or an abort.
        assert_limit(render("{{ [1] | tojson(indent=1000000000000000000) }}"), "spaces of tojson indent");
        let long_indent = format!("{{{{ [1] | tojson(indent='{}') }}}}", " ".repeat(100));
        assert_limit(render(&long_indent), "bytes of tojson indent");
        // Nesting deeper than the limit is refused instead of recursing once per level.
        let deep = "{% set ns = namespace(x=1) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}\
                    {{ ns.x | tojson }}";
        assert_limit(render(deep), "levels of tojson nesting");
        // A shallow value still renders.
        let out = render("{{ [[1, [2]], {'a': [3]}] | tojson(indent=2) }}").unwrap();
        assert!(out.starts_with("[\n  [\n    1,"), "{out}");
    }

    #[test]
    fn fallback_is_chatml() {
        let t = ChatTemplates::new(&[], TemplateTokens::default());
        assert!(t.is_fallback());
        let out = t
            .render(
                &[ChatMessage::system("S"), ChatMessage::user("U")],
                &ChatOptions { add_generation_prompt: true, ..Default::default() },
            )
            .unwrap();
        assert_eq!(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
    }
}
