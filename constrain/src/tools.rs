//! Tool calling as text: the form a model family writes function calls in ([`ToolFormat`]),
//! the grammar that makes a model call a function ([`call_grammar`], for `tool_choice:
//! "required"` or a named function), the prompt that describes tools to a template that cannot
//! ([`ToolFormat::tools_prompt`]), and a sans-IO parser that turns generated text into content
//! and calls as it arrives ([`ToolCallParser`]).
//!
//! Formats:
//! - [`ToolFormat::Hermes`] (Qwen, Hermes, and the default): each call is
//!   `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`; text around calls is
//!   content.
//! - [`ToolFormat::Llama3Json`] (a template that mentions `<|python_tag|>` or `ipython`): the
//!   whole output is `{"name": "f", "parameters": {...}}`, optionally after `<|python_tag|>`,
//!   several calls separated by `;`.
//!
//! Parser invariants (tested by splitting texts at every boundary):
//! - the events depend only on the text, never on how it was split into pieces;
//! - a call's `Call` event comes before its `Arguments` events, and the concatenation of its
//!   `Arguments` texts is the JSON text of its arguments (an object for a well-formed call);
//! - text that may still turn out to be the start of a call is held back, never emitted as
//!   content; whitespace at the end of content is held until more content follows, and dropped
//!   if a call follows or the output ends with calls in it;
//! - a `<tool_call>` block that is not a call (no name, or not JSON) is given back as content,
//!   tags included.
//!
//! Allowed dependencies: protocol (the [`Constraint`] a grammar is), serde_json. No I/O.

use cleave_protocol::Constraint;
use serde_json::Value;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` per call.
    Hermes,
    /// `{"name": ..., "parameters": ...}` as the whole output (Llama 3.x).
    Llama3Json,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The family a chat template's text says: Llama 3 JSON when it mentions `<|python_tag|>`
    /// or `ipython`, Hermes otherwise.
    pub fn for_template(source: &str) -> Self {
        if source.contains(PYTHON_TAG) || source.contains("ipython") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The key a call's arguments go under.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3Json => "parameters",
        }
    }

    /// Calls written as the model writes them (for a history whose template does not render
    /// `tool_calls` itself): `(name, arguments)` pairs.
    pub fn render_calls<'a>(self, calls: impl IntoIterator<Item = (&'a str, &'a Value)>) -> String {
        let key = self.arguments_key();
        let each = calls.into_iter().map(|(name, args)| {
            let json = format!("{{\"name\": {}, \"{key}\": {}}}", json_str(name), args);
            match self {
                ToolFormat::Hermes => format!("{OPEN}\n{json}\n{CLOSE}"),
                ToolFormat::Llama3Json => json,
            }
        });
        let sep = match self {
            ToolFormat::Hermes => "\n",
            ToolFormat::Llama3Json => "; ",
        };
        each.collect::<Vec<_>>().join(sep)
    }

    /// Text that describes `tools` (each `{"type": "function", "function": {...}}`, as the
    /// request gave it) and how to call them, for a template that does not render `tools`.
    pub fn tools_prompt(self, tools: &[Value]) -> String {
        let listed: Vec<String> = tools.iter().map(Value::to_string).collect();
        match self {
            ToolFormat::Hermes => format!(
                "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
                 You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
                 For each function call, return a json object with function name and arguments within \
                 {OPEN}{CLOSE} XML tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}",
                listed.join("\n")
            ),
            ToolFormat::Llama3Json => format!(
                "You have access to the following functions. To call a function, respond with JSON for a \
                 function call in the format {{\"name\": function name, \"parameters\": dictionary of argument \
                 name and its value}}. Do not use variables.\n\n{}",
                listed.join("\n\n")
            ),
        }
    }
}

/// A tool the model may call: its name (`^[a-zA-Z0-9_-]{1,64}$`, checked by the caller) and
/// the JSON Schema of its arguments (an object schema).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

/// What a forced tool choice allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forced<'a> {
    /// Exactly one call, to this function.
    Named(&'a str),
    /// At least one call to any of the tools; more than one only if `parallel`.
    Required { parallel: bool },
}

/// The grammar (llguidance's Lark dialect) of output that is nothing but calls allowed by
/// `forced` among `tools`, in `format`: the arguments of each call match its tool's parameter
/// schema (as JSON on one line: `", "` and `": "` separators and no other whitespace, so that
/// a forced call cannot stall in whitespace), and the output ends after the calls.
///
/// Each tool's schema is a `%json` of its own, so its `$ref`s resolve against its own root.
/// `tools` must hold at least one tool (and the named one, for [`Forced::Named`]); otherwise
/// the grammar does not compile.
pub fn call_grammar(format: ToolFormat, tools: &[ToolSpec], forced: Forced<'_>) -> Constraint {
    let chosen: Vec<&ToolSpec> = match forced {
        Forced::Named(name) => tools.iter().filter(|t| t.name == name).collect(),
        Forced::Required { .. } => tools.iter().collect(),
    };
    let key = format.arguments_key();
    let mut rules = String::new();
    let mut alternatives = Vec::with_capacity(chosen.len());
    for (i, tool) in chosen.iter().enumerate() {
        let mut schema = tool.parameters.clone();
        if let Some(obj) = schema.as_object_mut() {
            obj.entry("x-guidance").or_insert_with(
                || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
        }
        let head = format!("{{\"name\": {}, \"{key}\": ", json_str(&tool.name));
        rules.push_str(&format!("fn{i}: {} %json {schema} \"}}\"\n", json_str(&head)));
        alternatives.push(format!("fn{i}"));
    }
    let call = match format {
        ToolFormat::Hermes => {
            format!("call: {} body {}\n", json_str(&format!("{OPEN}\n")), json_str(&format!("\n{CLOSE}")))
        }
        ToolFormat::Llama3Json => "call: body\n".to_owned(),
    };
    let sep = match format {
        ToolFormat::Hermes => "\n",
        ToolFormat::Llama3Json => "; ",
    };
    let start = match forced {
        Forced::Required { parallel: true } => format!("start: call ({} call)*\n", json_str(sep)),
        _ => "start: call\n".to_owned(),
    };
    Constraint::Lark(format!("{start}{call}body: {}\n{rules}", alternatives.join(" | ")))
}

/// `s` as a JSON string literal (also a valid Lark string literal).
fn json_str(s: &str) -> String {
    Value::from(s).to_string()
}

/// What the parser found in a piece of output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside calls.
    Content(String),
    /// A call begins: its position among the output's calls (from 0) and its function's name.
    Call { index: usize, name: String },
    /// More of call `index`'s arguments (JSON text).
    Arguments { index: usize, text: String },
}

/// Where the parser is.
#[derive(Debug, Clone)]
enum State {
    /// Outside calls (Hermes): content, watching for `<tool_call>`.
    Text,
    /// Llama: before a call (start of output, or after one), where whitespace, `;` and
    /// `<|python_tag|>` are skipped and `{` starts a call.
    Between,
    /// Llama: the output is plain content from here on.
    Plain,
    /// Inside a call.
    Call(CallScan),
}

/// The scan of one call's JSON (`{"name": "f", "arguments": ...}`), character by character.
#[derive(Debug, Clone, Default)]
struct CallScan {
    /// Everything read since the call began (after `<tool_call>`), for the fallback parse.
    raw: String,
    phase: Phase,
    /// A JSON string token being read (raw, quotes included).
    token: String,
    in_string: bool,
    escaped: bool,
    name: Option<String>,
    /// Announced (name and arguments key both seen).
    started: bool,
    /// The arguments value ended (streamed in full, or given whole).
    args_done: bool,
    /// Open brackets of the arguments value.
    depth: u32,
    /// Text after the call's JSON, while it may still be the closing tag.
    tail: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Phase {
    #[default]
    Open,
    NameKey,
    NameColon,
    NameValue,
    Comma,
    ArgsKey,
    ArgsColon,
    ArgsStart,
    /// An arguments object or array, streamed.
    Args,
    AfterArgs,
    /// The JSON object closed; waiting for the closing tag (Hermes only: a Llama call ends
    /// with its object).
    Closed,
    /// Not the expected shape: read to the closing tag (or the end), then parse it whole.
    Fallback,
}

/// What one character did to a call's scan.
#[derive(Debug, PartialEq)]
enum Step {
    Nothing,
    /// The name and the arguments key have been read: the call is announced.
    Start(String),
    /// A character of the arguments' JSON text.
    Arg(char),
    /// The arguments' JSON text whole (they were given as a string).
    Args(String),
    /// The call ended with this character (its closing tag; for Llama, its JSON's `}`).
    End,
    /// A call of unexpected shape ended with this character (its closing tag); `body` is
    /// what stood between the tags.
    EndFallback {
        body: String,
    },
}

impl CallScan {
    fn feed(&mut self, c: char, format: ToolFormat) -> Step {
        self.raw.push(c);
        match self.phase {
            Phase::Fallback => {
                if format == ToolFormat::Hermes {
                    if let Some(body) = self.raw.strip_suffix(CLOSE) {
                        return Step::EndFallback { body: body.to_owned() };
                    }
                }
                Step::Nothing
            }
            Phase::Args => self.feed_args(c),
            Phase::Closed => {
                self.tail.push(c);
                let t = self.tail.trim_start();
                if t == CLOSE {
                    return Step::End;
                }
                if !t.is_empty() && !CLOSE.starts_with(t) {
                    // Not the closing tag: read on to it.
                    self.phase = Phase::Fallback;
                }
                Step::Nothing
            }
            _ if self.in_string => self.feed_string(c, format),
            Phase::NameKey | Phase::NameValue | Phase::ArgsKey | Phase::ArgsStart if c == '"' => {
                self.in_string = true;
                self.token.push(c);
                Step::Nothing
            }
            _ if c.is_whitespace() => Step::Nothing,
            phase => {
                let (next, step) = match (phase, c) {
                    (Phase::Open, '{') => (Phase::NameKey, Step::Nothing),
                    (Phase::NameColon, ':') => (Phase::NameValue, Step::Nothing),
                    (Phase::Comma, ',') => (Phase::ArgsKey, Step::Nothing),
                    (Phase::ArgsColon, ':') => {
                        self.started = true;
                        (Phase::ArgsStart, Step::Start(self.name.clone().unwrap_or_default()))
                    }
                    (Phase::ArgsStart, '{' | '[') => {
                        self.depth = 1;
                        (Phase::Args, Step::Arg(c))
                    }
                    (Phase::AfterArgs, '}') => match format {
                        ToolFormat::Hermes => (Phase::Closed, Step::Nothing),
                        ToolFormat::Llama3Json => (Phase::Closed, Step::End),
                    },
                    _ => (Phase::Fallback, Step::Nothing),
                };
                self.phase = next;
                step
            }
        }
    }

    /// A character inside a JSON string token of the call's structure.
    fn feed_string(&mut self, c: char, format: ToolFormat) -> Step {
        self.token.push(c);
        if self.escaped {
            self.escaped = false;
            return Step::Nothing;
        }
        match c {
            '\\' => self.escaped = true,
            '"' => {
                self.in_string = false;
                let value: Option<String> = serde_json::from_str(&std::mem::take(&mut self.token)).ok();
                let key = format.arguments_key();
                let (next, step) = match (self.phase, value) {
                    (Phase::NameKey, Some(k)) if k == "name" => (Phase::NameColon, Step::Nothing),
                    (Phase::NameValue, Some(name)) => {
                        self.name = Some(name);
                        (Phase::Comma, Step::Nothing)
                    }
                    (Phase::ArgsKey, Some(k)) if k == key || k == "arguments" || k == "parameters" => {
                        (Phase::ArgsColon, Step::Nothing)
                    }
                    (Phase::ArgsStart, Some(text)) => {
                        self.args_done = true;
                        (Phase::AfterArgs, Step::Args(text))
                    }
                    _ => (Phase::Fallback, Step::Nothing),
                };
                self.phase = next;
                return step;
            }
            _ => {}
        }
        Step::Nothing
    }

    /// A character of a streamed arguments value.
    fn feed_args(&mut self, c: char) -> Step {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            }
            return Step::Arg(c);
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    self.args_done = true;
                    self.phase = Phase::AfterArgs;
                }
            }
            _ => {}
        }
        Step::Arg(c)
    }
}

/// Turns generated text into [`ToolEvent`]s as it arrives (see the module invariants).
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    format: ToolFormat,
    state: State,
    /// Text received but not yet classified.
    pending: String,
    /// Whitespace at the end of the content emitted so far.
    held_ws: String,
    /// Arguments text read but not yet emitted (of call `calls - 1`).
    args: String,
    calls: usize,
    out: Vec<ToolEvent>,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat) -> Self {
        let state = match format {
            ToolFormat::Hermes => State::Text,
            ToolFormat::Llama3Json => State::Between,
        };
        ToolCallParser {
            format,
            state,
            pending: String::new(),
            held_ws: String::new(),
            args: String::new(),
            calls: 0,
            out: Vec::new(),
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads `piece`, the next text of the output.
    pub fn push(&mut self, piece: &str) -> Vec<ToolEvent> {
        self.pending.push_str(piece);
        self.advance();
        self.take_events()
    }

    /// The output ended: what was held back is settled. Nothing may be pushed after.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.advance();
        let pending = std::mem::take(&mut self.pending);
        match std::mem::replace(&mut self.state, State::Plain) {
            // A partial `<tool_call>`, or a `<|python_tag|>` prefix that never completed.
            State::Text | State::Plain | State::Between => self.content(&pending),
            State::Call(scan) => {
                if !scan.started {
                    self.settle_fallback(&scan.raw, false);
                } else if !scan.args_done && scan.phase == Phase::Fallback {
                    self.parsed_args(&scan.raw);
                }
            }
        }
        if self.calls == 0 && !self.held_ws.is_empty() {
            let ws = std::mem::take(&mut self.held_ws);
            self.emit(ToolEvent::Content(ws));
        }
        self.take_events()
    }

    fn take_events(&mut self) -> Vec<ToolEvent> {
        self.flush_args();
        merge(self.out.drain(..))
    }

    fn flush_args(&mut self) {
        if !self.args.is_empty() {
            let text = std::mem::take(&mut self.args);
            self.out.push(ToolEvent::Arguments { index: self.calls.saturating_sub(1), text });
        }
    }

    fn emit(&mut self, ev: ToolEvent) {
        self.flush_args();
        self.out.push(ev);
    }

    /// Emits content, holding trailing whitespace back.
    fn content(&mut self, text: &str) {
        let body = text.trim_end();
        if body.is_empty() {
            self.held_ws.push_str(text);
            return;
        }
        let mut s = std::mem::take(&mut self.held_ws);
        s.push_str(body);
        self.held_ws = text[body.len()..].to_owned();
        self.emit(ToolEvent::Content(s));
    }

    fn start_call(&mut self) {
        self.held_ws.clear();
        self.state = State::Call(CallScan::default());
    }

    fn announce(&mut self, name: String) {
        self.flush_args(); // the previous call's
        self.calls += 1;
        let index = self.calls - 1;
        self.emit(ToolEvent::Call { index, name });
    }

    /// Processes `pending` as far as it can be classified.
    fn advance(&mut self) {
        loop {
            match &mut self.state {
                State::Plain => {
                    let text = std::mem::take(&mut self.pending);
                    self.content(&text);
                    return;
                }
                State::Text => {
                    if let Some(at) = self.pending.find(OPEN) {
                        let before: String = self.pending.drain(..at).collect();
                        self.pending.drain(..OPEN.len());
                        self.content(&before);
                        self.start_call();
                        continue;
                    }
                    let keep = partial_suffix(&self.pending, OPEN);
                    let emit: String = self.pending.drain(..self.pending.len() - keep).collect();
                    self.content(&emit);
                    return;
                }
                State::Between => {
                    let trimmed = self.pending.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
                    if trimmed.is_empty() {
                        return; // only separators so far: wait
                    }
                    let skipped = self.pending.len() - trimmed.len();
                    if trimmed.starts_with(PYTHON_TAG) {
                        self.pending.drain(..skipped + PYTHON_TAG.len());
                        continue;
                    }
                    if PYTHON_TAG.starts_with(trimmed) {
                        return; // may still be the tag
                    }
                    if trimmed.starts_with('{') {
                        self.pending.drain(..skipped);
                        self.start_call();
                        continue;
                    }
                    self.state = State::Plain;
                }
                State::Call(scan) => {
                    if self.pending.is_empty() {
                        return;
                    }
                    let mut scan = std::mem::take(scan);
                    let text = std::mem::take(&mut self.pending);
                    match self.scan(&mut scan, &text) {
                        Some(used) => {
                            self.pending = text[used..].to_owned();
                            self.state = match self.format {
                                ToolFormat::Hermes => State::Text,
                                ToolFormat::Llama3Json => State::Between,
                            };
                        }
                        None => self.state = State::Call(scan),
                    }
                }
            }
        }
    }

    /// Feeds `text` to a call's scan; `Some(bytes of text used)` when the call ended in it.
    fn scan(&mut self, scan: &mut CallScan, text: &str) -> Option<usize> {
        for (i, c) in text.char_indices() {
            match scan.feed(c, self.format) {
                Step::Nothing => {}
                Step::Start(name) => self.announce(name),
                Step::Arg(c) => self.args.push(c),
                Step::Args(text) => self.args.push_str(&text),
                Step::End => return Some(i + c.len_utf8()),
                Step::EndFallback { body } => {
                    if !scan.started {
                        self.settle_fallback(&body, true);
                    } else if !scan.args_done {
                        self.parsed_args(&body);
                    }
                    return Some(i + c.len_utf8());
                }
            }
        }
        None
    }

    /// A call of unexpected shape, read whole: a call if it parses as one, else content.
    fn settle_fallback(&mut self, body: &str, closed: bool) {
        if let Some((name, args)) = parse_call(body) {
            self.announce(name);
            self.emit(ToolEvent::Arguments { index: self.calls - 1, text: args });
            return;
        }
        let text = match (self.format, closed) {
            (ToolFormat::Hermes, true) => format!("{OPEN}{body}{CLOSE}"),
            (ToolFormat::Hermes, false) => format!("{OPEN}{body}"),
            (ToolFormat::Llama3Json, _) => body.to_owned(),
        };
        self.content(&text);
    }

    /// The arguments of an announced call whose arguments value was not streamed.
    fn parsed_args(&mut self, body: &str) {
        if let Some((_, args)) = parse_call(body) {
            self.emit(ToolEvent::Arguments { index: self.calls - 1, text: args });
        }
    }
}

/// `{"name": "f", "arguments": {...}}` (or `"parameters"`; arguments may be a string holding
/// their JSON text), keys in any order, `type` and `id` allowed beside: the name and the
/// arguments' JSON text.
fn parse_call(body: &str) -> Option<(String, String)> {
    let Value::Object(obj) = serde_json::from_str::<Value>(body.trim()).ok()? else { return None };
    let name = obj.get("name")?.as_str()?.to_owned();
    let mut args = None;
    for (k, v) in &obj {
        match k.as_str() {
            "name" | "type" | "id" => {}
            "arguments" | "parameters" if args.is_none() => {
                args = Some(match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
            }
            _ => return None,
        }
    }
    Some((name, args.unwrap_or_else(|| "{}".to_owned())))
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// `events` with neighbouring content pieces, and neighbouring argument pieces of one call,
/// joined (fewer, larger deltas; the same text).
fn merge(events: impl IntoIterator<Item = ToolEvent>) -> Vec<ToolEvent> {
    let mut merged: Vec<ToolEvent> = Vec::new();
    for ev in events {
        match (merged.last_mut(), ev) {
            (Some(ToolEvent::Content(a)), ToolEvent::Content(b)) => a.push_str(&b),
            (Some(ToolEvent::Arguments { index: i, text: a }), ToolEvent::Arguments { index: j, text: b })
                if *i == j =>
            {
                a.push_str(&b)
            }
            (_, ev) => merged.push(ev),
        }
    }
    merged
}

/// A whole output's content and calls, accumulated from [`ToolEvent`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    pub content: String,
    /// `(name, arguments JSON text)` per call, in order.
    pub calls: Vec<(String, String)>,
}

impl Collected {
    pub fn apply(&mut self, ev: ToolEvent) {
        match ev {
            ToolEvent::Content(s) => self.content.push_str(&s),
            ToolEvent::Call { name, .. } => self.calls.push((name, String::new())),
            ToolEvent::Arguments { index, text } => {
                if let Some(call) = self.calls.get_mut(index) {
                    call.1.push_str(&text);
                }
            }
        }
    }

    /// `text` parsed whole.
    pub fn parse(format: ToolFormat, text: &str) -> Self {
        let mut parser = ToolCallParser::new(format);
        let mut c = Collected::default();
        parser.push(text).into_iter().chain(parser.finish()).for_each(|e| c.apply(e));
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> (String, String) {
        (name.to_owned(), args.to_owned())
    }

    fn parsed(format: ToolFormat, text: &str) -> Collected {
        Collected::parse(format, text)
    }

    /// Events of `pieces` pushed in order, adjacent ones of a kind merged (how they were split
    /// is not part of the contract, their order is).
    fn events(format: ToolFormat, pieces: &[&str]) -> Vec<ToolEvent> {
        let mut p = ToolCallParser::new(format);
        let mut all: Vec<ToolEvent> = Vec::new();
        for piece in pieces {
            all.extend(p.push(piece));
        }
        all.extend(p.finish());
        merge(all)
    }

    const HERMES: &[&str] = &[
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>",
        "Let me look.\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b-2\", \"arguments\": {\"x\": {\"y\": \"}\"}}}\n</tool_call>\n",
        "Just text, with a < sign and <tool but no call.  ",
        "<tool_call>not json</tool_call> after",
        "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"rev\"}</tool_call>",
        "<tool_call>{\"name\": \"s\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
        "<tool_call>{\"name\":\"t\",\"arguments\":{\"s\":\"</tool_call> \\\" é🎉\"}}</tool_call>",
        "<tool_call>\n{\"name\": \"cut\", \"arguments\": {\"a\": 1",
        "<tool_call>\n{\"name\": \"cut\"",
        "café <tool_call>{\"name\": \"u\", \"arguments\": {\"k\": \"東京\"}} </tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}} trailing junk </tool_call>ok",
        "",
        "   ",
    ];

    const LLAMA: &[&str] = &[
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": [1, {\"b\": \"]\"}]}}",
        "  {\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {\"x\": 1}}",
        "Hello there",
        "{\"answer\": 42}",
        "<|python_ta",
        "{\"type\": \"function\", \"name\": \"h\", \"parameters\": {\"z\": true}}",
        "",
    ];

    #[test]
    fn hermes_calls_and_content() {
        let h = ToolFormat::Hermes;
        let c = parsed(h, HERMES[0]);
        assert_eq!(c.calls, [call("get_weather", "{\"city\": \"Paris\", \"days\": [1, 2]}")]);
        assert_eq!(c.content, "");
        let c = parsed(h, HERMES[1]);
        assert_eq!(c.content, "Let me look.");
        assert_eq!(c.calls, [call("a", "{}"), call("b-2", "{\"x\": {\"y\": \"}\"}}")]);
        let c = parsed(h, HERMES[2]);
        assert_eq!((c.content.as_str(), c.calls.len()), (HERMES[2], 0), "no call: the text whole");
        let c = parsed(h, HERMES[3]);
        assert_eq!((c.content.as_str(), c.calls.len()), (HERMES[3], 0), "a block that is not a call is content");
        assert_eq!(parsed(h, HERMES[4]).calls, [call("rev", "{\"a\":1}")], "keys in another order");
        assert_eq!(parsed(h, HERMES[5]).calls, [call("s", "{\"a\": 1}")], "arguments as a JSON string");
        assert_eq!(parsed(h, HERMES[6]).calls, [call("t", "{\"s\":\"</tool_call> \\\" é🎉\"}")]);
        let c = parsed(h, HERMES[7]);
        assert_eq!(c.calls, [call("cut", "{\"a\": 1")], "cut short: what arrived");
        let c = parsed(h, HERMES[8]);
        assert_eq!((c.content.as_str(), c.calls.len()), (HERMES[8], 0), "cut before the arguments: content");
        let c = parsed(h, HERMES[9]);
        assert_eq!((c.content.as_str(), &c.calls[..]), ("café", &[call("u", "{\"k\": \"東京\"}")][..]));
        let c = parsed(h, HERMES[10]);
        assert_eq!((c.content.as_str(), &c.calls[..]), ("ok", &[call("f", "{\"a\": 1}")][..]));
        assert_eq!(parsed(h, "   "), Collected { content: "   ".into(), calls: vec![] });
    }

    #[test]
    fn llama_json_calls_and_content() {
        let l = ToolFormat::Llama3Json;
        assert_eq!(parsed(l, LLAMA[0]).calls, [call("get_weather", "{\"city\": \"Paris\"}")]);
        assert_eq!(parsed(l, LLAMA[1]).calls, [call("f", "{\"a\": [1, {\"b\": \"]\"}]}")]);
        assert_eq!(parsed(l, LLAMA[2]).calls, [call("f", "{}"), call("g", "{\"x\": 1}")]);
        assert_eq!(parsed(l, LLAMA[3]), Collected { content: "Hello there".into(), calls: vec![] });
        assert_eq!(parsed(l, LLAMA[4]), Collected { content: LLAMA[4].into(), calls: vec![] }, "JSON, not a call");
        assert_eq!(parsed(l, LLAMA[5]).content, "<|python_ta");
        assert_eq!(parsed(l, LLAMA[6]).calls, [call("h", "{\"z\":true}")]);
    }

    /// The events do not depend on where the text was cut: every two-piece split, and one
    /// character at a time.
    #[test]
    fn pieces_split_at_every_boundary_give_the_same_events() {
        for (format, texts) in [(ToolFormat::Hermes, HERMES), (ToolFormat::Llama3Json, LLAMA)] {
            for text in texts {
                let whole = events(format, &[text]);
                for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                    let split = events(format, &[&text[..cut], &text[cut..]]);
                    assert_eq!(split, whole, "{format:?} {text:?} cut at {cut}");
                }
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let one_by_one: Vec<&str> = chars.iter().map(String::as_str).collect();
                assert_eq!(events(format, &one_by_one), whole, "{format:?} {text:?} char by char");
            }
        }
    }

    /// Streamed one character at a time: a call is announced as soon as its name and arguments
    /// key are known, its arguments follow as they arrive, and no piece of a tag ever shows as
    /// content.
    #[test]
    fn streaming_announces_early_and_never_leaks_a_tag() {
        let text =
            "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let mut p = ToolCallParser::new(ToolFormat::Hermes);
        let mut seen = String::new();
        let mut announced_at = None;
        let mut args_pieces = 0;
        for (i, c) in text.char_indices() {
            for ev in p.push(&c.to_string()) {
                match ev {
                    ToolEvent::Content(s) => {
                        assert!(!s.contains('<'), "a tag leaked into content: {s:?}");
                        seen.push_str(&s);
                    }
                    ToolEvent::Call { index, name } => {
                        assert_eq!((index, name.as_str()), (0, "get_weather"));
                        announced_at = Some(i);
                    }
                    ToolEvent::Arguments { index, .. } => {
                        assert_eq!(index, 0);
                        assert!(announced_at.is_some(), "arguments before the call");
                        args_pieces += 1;
                    }
                }
            }
        }
        assert!(p.finish().is_empty());
        assert_eq!(seen, "Sure.");
        assert_eq!(announced_at, text.find("\"arguments\":").map(|i| i + "\"arguments\":".len() - 1));
        assert_eq!(args_pieces, "{\"city\": \"Paris\"}".len(), "one piece per character pushed");
    }

    #[test]
    fn the_template_says_the_family() {
        assert_eq!(ToolFormat::for_template("{{ '<|python_tag|>' }}"), ToolFormat::Llama3Json);
        assert_eq!(ToolFormat::for_template("{% if m.role == 'ipython' %}"), ToolFormat::Llama3Json);
        assert_eq!(ToolFormat::for_template("<|im_start|>{{ tools }}"), ToolFormat::Hermes);
    }

    /// History rendered in a family's form parses back to the same calls.
    #[test]
    fn rendered_calls_parse_back() {
        let args = serde_json::json!({"city": "Paris", "n": [1, 2]});
        let empty = serde_json::json!({});
        for format in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
            let text = format.render_calls([("f", &args), ("g", &empty)]);
            let c = parsed(format, &text);
            assert_eq!(c.content, "", "{text}");
            let names: Vec<&str> = c.calls.iter().map(|c| c.0.as_str()).collect();
            assert_eq!(names, ["f", "g"], "{text}");
            let back: Value = serde_json::from_str(&c.calls[0].1).unwrap();
            assert_eq!(back, args);
        }
    }
}
