//! Structured output and tool calling at the edge, part of validation ([`crate::validate`]).
//!
//! - The fields that constrain the output (`response_format`, vLLM's `guided_json`,
//!   `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, and a forced
//!   `tool_choice`) are read into [`Requested`] constraints; [`settle`] refuses more than one,
//!   checks its size and compiles it against the model's vocabulary, once.
//! - `tools` and `tool_choice` are read into [`Tools`]: names unique and well-formed, parameter
//!   schemas that are object schemas and compile, a named choice that names a tool.
//! - What the chat template supports ([`TemplateSupport`], from its text) decides how tools and
//!   the history's calls reach it: through its own `tools`, `tool_calls` and `tool` role when it
//!   reads them, else as text in the family's form (a tools prompt in the first system or user
//!   message, calls in the assistant's content, results as a user turn), so that no role is
//!   added that the template may reject.
//!
//! Every refusal is a [`CoordinatorError::InvalidParam`] whose `param` is the field's path
//! (`tools[1].function.name`, `response_format.json_schema.schema`) and whose message says what
//! is wrong.

use cleave_constrain::tools::{call_grammar, Forced, ToolFormat, ToolSpec};
use cleave_constrain::ConstrainError;
use cleave_protocol::Constraint;
use cleave_tokenizer::{ChatFunctionCall, ChatMessage, ChatToolCall};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::api::{CommonParams, InputMessage, MessageContent};
use crate::error::CoordinatorError;
use crate::model::ModelInfo;

fn invalid(param: impl Into<String>, message: impl Into<String>) -> CoordinatorError {
    CoordinatorError::InvalidParam { param: param.into(), message: message.into() }
}

/// Reads `value` (the request field `field`) as a `T`; an error names the path inside it.
fn read<T: DeserializeOwned>(field: &str, value: &Value) -> Result<T, CoordinatorError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let param = match path.as_str() {
            "." => field.to_owned(),
            p if p.starts_with('[') => format!("{field}{p}"),
            p => format!("{field}.{p}"),
        };
        let message = e.inner().to_string();
        invalid(param, message)
    })
}

/// A constraint a request asks for, with the field that asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub field: String,
    pub constraint: Constraint,
}

impl Requested {
    fn new(field: impl Into<String>, constraint: Constraint) -> Self {
        Requested { field: field.into(), constraint }
    }
}

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`. `name`, `description` and `strict` are read (a wrong type is
/// refused) and change nothing: the schema is always enforced.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct JsonSchemaFormat {
    name: Option<String>,
    description: Option<String>,
    strict: Option<bool>,
    schema: Option<Value>,
}

/// vLLM's `structured_outputs` (fields it has that cleave does not are refused).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StructuredOutputs {
    json: Option<Value>,
    regex: Option<String>,
    choice: Option<Vec<String>>,
    grammar: Option<String>,
    json_object: Option<bool>,
}

/// A JSON Schema given as an object (or boolean) or as its text.
fn schema_text(field: &str, v: &Value) -> Result<String, CoordinatorError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Object(_) | Value::Bool(_) => Ok(v.to_string()),
        other => Err(invalid(field, format!("must be a JSON Schema (an object), got {other}"))),
    }
}

/// The output constraints `c` asks for, in field order (none, one, or several: [`settle`]
/// refuses several).
pub fn requested(c: &CommonParams) -> Result<Vec<Requested>, CoordinatorError> {
    let mut out = Vec::new();
    if let Some(v) = &c.response_format {
        match read::<ResponseFormat>("response_format", v)? {
            ResponseFormat::Text => {}
            ResponseFormat::JsonObject => out.push(Requested::new("response_format", Constraint::JsonObject)),
            ResponseFormat::JsonSchema { json_schema } => {
                let field = "response_format.json_schema.schema";
                let schema = json_schema.schema.ok_or_else(|| invalid(field, "is required with type json_schema"))?;
                out.push(Requested::new(field, Constraint::JsonSchema(schema_text(field, &schema)?)));
            }
        }
    }
    if let Some(v) = &c.guided_json {
        out.push(Requested::new("guided_json", Constraint::JsonSchema(schema_text("guided_json", v)?)));
    }
    if let Some(v) = &c.guided_regex {
        out.push(Requested::new("guided_regex", Constraint::Regex(read("guided_regex", v)?)));
    }
    if let Some(v) = &c.guided_choice {
        out.push(Requested::new("guided_choice", Constraint::Choice(read("guided_choice", v)?)));
    }
    if let Some(v) = &c.guided_grammar {
        out.push(Requested::new("guided_grammar", Constraint::Lark(read("guided_grammar", v)?)));
    }
    if let Some(v) = &c.structured_outputs {
        let s: StructuredOutputs = read("structured_outputs", v)?;
        let mut given = Vec::new();
        if let Some(v) = &s.json {
            given.push(Requested::new(
                "structured_outputs.json",
                Constraint::JsonSchema(schema_text("structured_outputs.json", v)?),
            ));
        }
        if let Some(rx) = s.regex {
            given.push(Requested::new("structured_outputs.regex", Constraint::Regex(rx)));
        }
        if let Some(choices) = s.choice {
            given.push(Requested::new("structured_outputs.choice", Constraint::Choice(choices)));
        }
        if let Some(g) = s.grammar {
            given.push(Requested::new("structured_outputs.grammar", Constraint::Lark(g)));
        }
        if s.json_object == Some(true) {
            given.push(Requested::new("structured_outputs.json_object", Constraint::JsonObject));
        }
        out.extend(given);
    }
    Ok(out)
}

/// The one constraint of a request, checked for size and compiled against the model's
/// vocabulary; `None` when nothing constrains the output.
pub fn settle(requested: Vec<Requested>, model: &ModelInfo) -> Result<Option<Constraint>, CoordinatorError> {
    let mut it = requested.into_iter();
    let Some(first) = it.next() else { return Ok(None) };
    if let Some(second) = it.next() {
        return Err(invalid(
            second.field.clone(),
            format!(
                "`{}` and `{}` both constrain the output; a request may give at most one",
                first.field, second.field
            ),
        ));
    }
    check(&first.field, &first.constraint, model)?;
    Ok(Some(first.constraint))
}

/// Size limits, then a compile against the vocabulary, with errors naming `field`.
fn check(field: &str, c: &Constraint, model: &ModelInfo) -> Result<(), CoordinatorError> {
    c.validate().map_err(|e| invalid(field, e.message))?;
    let compiler = model
        .compiler
        .as_ref()
        .map_err(|e| invalid(field, format!("constrained decoding is unavailable for this model ({e})")))?;
    compiler.check(c).map_err(|e| match e {
        ConstrainError::Invalid { kind, reason } => invalid(field, format!("not a valid {kind}: {reason}")),
        other => invalid(field, other.to_string()),
    })
}

/// What a model's chat template does with tools, read from its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateSupport {
    /// It reads `tools`.
    pub tools: bool,
    /// It reads an assistant message's `tool_calls`.
    pub tool_calls: bool,
    /// It renders messages of role `tool`.
    pub tool_role: bool,
    /// How the model writes calls.
    pub format: ToolFormat,
}

impl TemplateSupport {
    pub fn of(source: &str) -> Self {
        TemplateSupport {
            tools: source.contains("tools"),
            tool_calls: source.contains("tool_calls"),
            tool_role: source.contains("'tool'") || source.contains("\"tool\""),
            format: ToolFormat::for_template(source),
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tools of a request that uses them (`tool_choice` other than `none`, at least one tool).
///
/// Invariant: names are unique and match `^[a-zA-Z0-9_-]{1,64}$`; every parameter schema is an
/// object schema that compiled; a [`ToolChoice::Named`] names one of them; `choice` is never
/// [`ToolChoice::None`].
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// As the template's `tools` reads them: `{"type": "function", "function": {...}}`.
    pub definitions: Vec<Value>,
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// `required` may make several calls.
    pub parallel: bool,
    pub format: ToolFormat,
}

impl Tools {
    /// The constraint a forced choice needs (`required` or a named function): the output is
    /// calls, in the model's format, with arguments its schema accepts.
    pub fn forced(&self) -> Option<Requested> {
        let forced = match &self.choice {
            ToolChoice::Required => Forced::Required { parallel: self.parallel },
            ToolChoice::Named(name) => Forced::Named(name),
            ToolChoice::None | ToolChoice::Auto => return None,
        };
        Some(Requested::new("tool_choice", call_grammar(self.format, &self.specs, forced)))
    }
}

#[derive(Debug, Deserialize)]
struct ToolIn {
    #[serde(rename = "type")]
    kind: String,
    function: FunctionIn,
}

#[derive(Debug, Deserialize)]
struct FunctionIn {
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
    /// Read (a wrong type is refused); a forced call is always strict.
    #[allow(dead_code)]
    strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct NamedChoice {
    #[serde(rename = "type")]
    kind: String,
    function: NamedFunction,
}

#[derive(Debug, Deserialize)]
struct NamedFunction {
    name: String,
}

/// OpenAI's rule for function names.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when the request does not
/// use tools (none given, or `tool_choice: "none"`). The tools are checked even then.
pub fn read_tools(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: Option<bool>,
    format: ToolFormat,
    model: &ModelInfo,
) -> Result<Option<Tools>, CoordinatorError> {
    let given: Vec<ToolIn> = match tools {
        Some(v) => read("tools", v)?,
        None => Vec::new(),
    };
    let mut definitions = Vec::with_capacity(given.len());
    let mut specs: Vec<ToolSpec> = Vec::with_capacity(given.len());
    for (i, t) in given.into_iter().enumerate() {
        if t.kind != "function" {
            let param = format!("tools[{i}].type");
            return Err(invalid(param, format!("must be \"function\", got {:?}", t.kind)));
        }
        let f = t.function;
        let param = format!("tools[{i}].function.name");
        if !valid_name(&f.name) {
            return Err(invalid(param.clone(), format!("must match ^[a-zA-Z0-9_-]{{1,64}}$, got {:?}", f.name)));
        }
        if specs.iter().any(|s| s.name == f.name) {
            return Err(invalid(param.clone(), format!("two tools are named {:?}", f.name)));
        }
        let param = format!("tools[{i}].function.parameters");
        let parameters = f.parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
        let is_object_schema = parameters.as_object().is_some_and(|o| match o.get("type") {
            None => true,
            Some(Value::String(t)) => t == "object",
            Some(_) => false,
        });
        if !is_object_schema {
            return Err(invalid(
                param.clone(),
                format!("must be a JSON Schema of an object (`{{\"type\": \"object\", ...}}`), got {parameters}"),
            ));
        }
        check(&param, &Constraint::JsonSchema(parameters.to_string()), model)?;
        let mut function = serde_json::Map::new();
        function.insert("name".into(), Value::from(f.name.clone()));
        if let Some(d) = f.description {
            function.insert("description".into(), Value::from(d));
        }
        function.insert("parameters".into(), parameters.clone());
        definitions.push(serde_json::json!({"type": "function", "function": function}));
        specs.push(ToolSpec { name: f.name, parameters });
    }
    let choice = match tool_choice {
        None => {
            if specs.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!("must be \"none\", \"auto\", \"required\" or a function, got {other:?}"),
                ))
            }
        },
        Some(v) => {
            let named: NamedChoice = read("tool_choice", v)?;
            if named.kind != "function" {
                return Err(invalid("tool_choice.type", format!("must be \"function\", got {:?}", named.kind)));
            }
            if !specs.iter().any(|s| s.name == named.function.name) {
                return Err(invalid(
                    "tool_choice.function.name",
                    format!("`tool_choice` names the function {:?}, which is not in `tools`", named.function.name),
                ));
            }
            ToolChoice::Named(named.function.name)
        }
    };
    if specs.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(invalid("tool_choice", "asks for a call, but `tools` gives no function")),
        };
    }
    if choice == ToolChoice::None {
        return Ok(None);
    }
    Ok(Some(Tools { definitions, specs, choice, parallel: parallel.unwrap_or(true), format }))
}

/// An assistant turn's call in the history.
#[derive(Debug, Deserialize)]
struct CallIn {
    id: Option<String>,
    /// `"function"` (read so that a wrong type is refused).
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: Option<String>,
    function: CallFunctionIn,
}

#[derive(Debug, Deserialize)]
struct CallFunctionIn {
    name: String,
    /// JSON text (OpenAI), or the object itself (some clients).
    arguments: Value,
}

/// The conversation as the template will see it (see the module doc for what a template that
/// does not read tools gets instead); `tools` given and unread by the template are described in
/// the first system message, else the first user message.
pub fn chat_messages(
    messages: &[InputMessage],
    support: TemplateSupport,
    tools: Option<&Tools>,
) -> Result<Vec<ChatMessage>, CoordinatorError> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !crate::api::CHAT_ROLES.contains(&m.role.as_str()) {
            return Err(invalid(
                "messages",
                format!("role {:?} is not one of {}", m.role, crate::api::CHAT_ROLES.join(", ")),
            ));
        }
        let content = text_of(m)?;
        let calls = match &m.tool_calls {
            Some(Value::Null) | None => Vec::new(),
            Some(v) if m.role == "assistant" => history_calls(i, v)?,
            Some(_) => {
                let param = format!("messages[{i}].tool_calls");
                return Err(invalid(param, "is only allowed on assistant messages"));
            }
        };
        if m.role == "tool" && !support.tool_role {
            // As Hermes-style templates render results: inside the user turn that follows.
            let block = format!("<tool_response>\n{content}\n</tool_response>");
            match out.last_mut() {
                Some(prev) if prev.role == "user" && prev.content.ends_with("</tool_response>") => {
                    prev.content.push('\n');
                    prev.content.push_str(&block);
                }
                _ => out.push(ChatMessage::user(block)),
            }
            continue;
        }
        let mut msg = ChatMessage::new(m.role.clone(), content);
        msg.tool_call_id = m.tool_call_id.clone();
        msg.name = m.name.clone();
        if support.tool_calls {
            msg.tool_calls = calls;
        } else if !calls.is_empty() {
            let text =
                support.format.render_calls(calls.iter().map(|c| (c.function.name.as_str(), &c.function.arguments)));
            if !msg.content.is_empty() {
                msg.content.push('\n');
            }
            msg.content.push_str(&text);
        }
        out.push(msg);
    }
    if let Some(tools) = tools {
        if !support.tools {
            let prompt = support.format.tools_prompt(&tools.definitions);
            let at = out.iter().position(|m| m.role == "system").or_else(|| out.iter().position(|m| m.role == "user"));
            if let Some(m) = at.and_then(|i| out.get_mut(i)) {
                m.content = if m.content.is_empty() { prompt } else { format!("{prompt}\n\n{}", m.content) };
            }
        }
    }
    Ok(out)
}

/// The calls of assistant message `i`.
fn history_calls(i: usize, v: &Value) -> Result<Vec<ChatToolCall>, CoordinatorError> {
    let field = format!("messages[{i}].tool_calls");
    let calls: Vec<CallIn> = read(&field, v)?;
    calls
        .into_iter()
        .enumerate()
        .map(|(j, c)| {
            let arguments = match c.function.arguments {
                // No arguments, as some clients write a call of a function without parameters.
                Value::String(text) if text.trim().is_empty() => Value::Object(serde_json::Map::new()),
                Value::String(text) => serde_json::from_str(&text).map_err(|e| {
                    let param = format!("{field}[{j}].function.arguments");
                    invalid(param, format!("is not JSON: {e}"))
                })?,
                object @ Value::Object(_) => object,
                other => {
                    let param = format!("{field}[{j}].function.arguments");
                    return Err(invalid(param, format!("must be JSON text (a string) or an object, got {other}")));
                }
            };
            Ok(ChatToolCall {
                id: c.id.unwrap_or_else(|| format!("call_{i}_{j}")),
                kind: "function".into(),
                function: ChatFunctionCall { name: c.function.name, arguments },
            })
        })
        .collect()
}

/// A message's text; text parts are joined with newlines; null is "".
fn text_of(m: &InputMessage) -> Result<String, CoordinatorError> {
    Ok(match &m.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => texts.push(t.as_str()),
                    ("text", None) => return Err(invalid("messages", "a text part needs `text`")),
                    (other, _) => {
                        return Err(invalid("messages", format!("content parts of type {other:?} are not supported")))
                    }
                }
            }
            texts.join("\n")
        }
    })
}
