//! OpenAI (and vLLM) wire types: what clients send and what the edge answers. Plain serde
//! data; validation lives in [`crate::validate`] (structured output and tools in
//! [`crate::structured`]), shaping in [`crate::respond`].
//!
//! Unknown request fields are ignored (third-party clients send many), but a known field of
//! the wrong type is a 400, and so is an OpenAI or vLLM field that asks for something cleave
//! does not do ([`Unimplemented`]): a client must not get free text with status 200 when it
//! asked for something else. The fields of structured output and tools are taken as any JSON
//! here and read into their types during validation, so that an error names the field.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `prompt` of /v1/completions: a string, several strings, token ids, or several id lists.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling and stopping fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM spelling: -1 or 0 disables.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    /// vLLM extension: token ids that end generation.
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM: a JSON Schema (an object, or its text).
    pub guided_json: Option<serde_json::Value>,
    /// vLLM: a regular expression the whole output matches.
    pub guided_regex: Option<serde_json::Value>,
    /// vLLM: the output is one of these strings.
    pub guided_choice: Option<serde_json::Value>,
    /// vLLM: a grammar (here in llguidance's Lark dialect).
    pub guided_grammar: Option<serde_json::Value>,
    /// vLLM's newer form: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
    pub structured_outputs: Option<serde_json::Value>,
    #[serde(flatten)]
    pub unimplemented: Unimplemented,
}

/// Request fields of the OpenAI API (and vLLM's extensions) that change what the answer must
/// be and that cleave does not implement. Taken as any JSON so that the answer names the field
/// whatever its type; `null` and the values that ask for nothing (an empty `functions` list,
/// `function_call: "none"`, an empty `logit_bias`, `best_of: 1`, an empty `suffix`) are
/// accepted.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Unimplemented {
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    pub logit_bias: Option<serde_json::Value>,
    pub suffix: Option<serde_json::Value>,
    pub best_of: Option<serde_json::Value>,
    pub audio: Option<serde_json::Value>,
    pub modalities: Option<serde_json::Value>,
    pub prediction: Option<serde_json::Value>,
}

impl Unimplemented {
    /// The first field that asks for something cleave does not do, with why.
    pub fn first(&self) -> Option<(&'static str, String)> {
        use serde_json::Value as V;
        fn empty(v: &V) -> bool {
            match v {
                V::Array(a) => a.is_empty(),
                V::Object(o) => o.is_empty(),
                V::String(s) => s.is_empty(),
                _ => false,
            }
        }
        fn none_or_auto(v: &V) -> bool {
            v.as_str().is_some_and(|s| s == "none" || s == "auto")
        }
        fn never(_: &V) -> bool {
            false
        }
        type Check<'a> = (&'static str, &'a Option<V>, fn(&V) -> bool);
        let checks: [Check<'_>; 8] = [
            ("functions", &self.functions, empty),
            ("function_call", &self.function_call, none_or_auto),
            ("logit_bias", &self.logit_bias, empty),
            ("suffix", &self.suffix, empty),
            ("best_of", &self.best_of, |v| v.as_u64() == Some(1)),
            ("audio", &self.audio, never),
            ("modalities", &self.modalities, |v| v.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))),
            ("prediction", &self.prediction, never),
        ];
        checks.into_iter().find_map(|(name, value, harmless)| match value {
            Some(v) if !harmless(v) => {
                let mut got = v.to_string();
                if got.len() > 80 {
                    got = format!("{}...", &got[..got.floor_char_boundary(80)]);
                }
                Some((name, format!("`{name}` is not supported by this server (got {got})")))
            }
            _ => None,
        })
    }
}

/// The roles a chat message may have.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// Body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    /// Completions' logprobs: how many alternatives per token (0..=20).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    /// Chat only: refused here unless it asks for nothing (null, `[]`).
    pub tools: Option<serde_json::Value>,
    /// Chat only: refused here unless it asks for nothing (null, `"none"`, `"auto"`).
    pub tool_choice: Option<serde_json::Value>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// `content` of a chat message: a string or a list of typed parts.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct InputMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    /// An assistant turn's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments": JSON text}}]` (read in [`crate::structured`]).
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` turn answers.
    pub tool_call_id: Option<String>,
    /// The function a `tool` turn answers, or a participant's name.
    pub name: Option<String>,
}

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<InputMessage>,
    pub max_completion_tokens: Option<u32>,
    /// Chat's logprobs: whether to return them at all.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    /// vLLM extension; default true.
    pub add_generation_prompt: Option<bool>,
    /// Functions the model may call: `[{"type": "function", "function": {"name",
    /// "description", "parameters"}}]`.
    pub tools: Option<serde_json::Value>,
    /// `"none"`, `"auto"` (the default with tools), `"required"`, or
    /// `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<serde_json::Value>,
    /// Whether `"required"` may make several calls (default true).
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// Body of vLLM's `POST /tokenize`: a prompt, or chat messages.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<InputMessage>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Completions' logprobs: parallel lists, one entry per generated token.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    /// Byte offset of each token's text in the choice's text.
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// A /v1/completions response, or one chunk of its stream (same object).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// A chat answer's message: `content` is null when the answer is only tool calls.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AssistantMessage {
    pub role: String,
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One function call of an answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// A piece of a streamed call, as OpenAI streams them: the first carries `id`, `type` and the
/// name (with `arguments: ""`), the next ones more `arguments` text.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FunctionDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}
