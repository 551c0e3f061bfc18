//! OpenAI (and vLLM) wire types: what clients send and what the edge answers. Plain serde
//! data; validation lives in [`crate::validate`], shaping in [`crate::respond`].
//!
//! Unknown request fields are ignored (third-party clients send many), but a known field of
//! the wrong type is a 400, and so is an OpenAI or vLLM field that asks for something cleave
//! does not do ([`Unimplemented`]): a client that sends `tools` or `response_format` must not
//! get free text with status 200.

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
    #[serde(flatten)]
    pub unimplemented: Unimplemented,
}

/// Request fields of the OpenAI API (and vLLM's extensions) that change what the answer must
/// be and that cleave does not implement. Taken as any JSON so that the answer names the field
/// whatever its type; `null` and the values that ask for nothing (an empty `tools` list,
/// `tool_choice: "none"`, `response_format: {"type": "text"}`, an empty `logit_bias`,
/// `best_of: 1`, an empty `suffix`) are accepted.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Unimplemented {
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<serde_json::Value>,
    pub response_format: Option<serde_json::Value>,
    pub logit_bias: Option<serde_json::Value>,
    pub suffix: Option<serde_json::Value>,
    pub best_of: Option<serde_json::Value>,
    pub audio: Option<serde_json::Value>,
    pub modalities: Option<serde_json::Value>,
    pub prediction: Option<serde_json::Value>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<serde_json::Value>,
    pub guided_choice: Option<serde_json::Value>,
    pub guided_grammar: Option<serde_json::Value>,
    pub structured_outputs: Option<serde_json::Value>,
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
        let checks: [Check<'_>; 17] = [
            ("tools", &self.tools, empty),
            ("tool_choice", &self.tool_choice, none_or_auto),
            ("functions", &self.functions, empty),
            ("function_call", &self.function_call, none_or_auto),
            ("parallel_tool_calls", &self.parallel_tool_calls, |v| v.is_boolean()),
            ("response_format", &self.response_format, |v| v.get("type").is_some_and(|t| t == "text")),
            ("logit_bias", &self.logit_bias, empty),
            ("suffix", &self.suffix, empty),
            ("best_of", &self.best_of, |v| v.as_u64() == Some(1)),
            ("audio", &self.audio, never),
            ("modalities", &self.modalities, |v| v.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))),
            ("prediction", &self.prediction, never),
            ("guided_json", &self.guided_json, never),
            ("guided_regex", &self.guided_regex, never),
            ("guided_choice", &self.guided_choice, never),
            ("guided_grammar", &self.guided_grammar, never),
            ("structured_outputs", &self.structured_outputs, never),
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

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AssistantMessage {
    pub role: String,
    pub content: String,
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
