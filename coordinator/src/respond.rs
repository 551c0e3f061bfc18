//! Shapes [`ChoiceUpdate`]s into OpenAI responses: one JSON body, or SSE chunks. Both paths
//! go through the same per-update conversion, so streamed chunks concatenate to the
//! non-streamed text by construction.
//!
//! A chat request with tools has its output read by the tool-call parser
//! (`cleave_constrain::tools`): calls become `tool_calls` (streamed as OpenAI streams them: the
//! id, type and name first, then pieces of the arguments), the rest is content, and a choice
//! that stopped after making calls finishes with `"tool_calls"`. The parser's events do not
//! depend on how the text was cut, so the stream and the whole answer agree.

use std::collections::BTreeMap;

use cleave_constrain::tools::{Collected, ToolCallParser, ToolEvent, ToolFormat};
use cleave_protocol::{FinishReason, Logprobs};
use cleave_tokenizer::Tokenizer;

use crate::api::{
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatResponse, ChatTokenLogprob,
    CompletionChoice, CompletionLogprobs, CompletionResponse, FunctionCall, FunctionDelta, PromptTokensDetails,
    ToolCall, ToolCallDelta, TopLogprob, Usage,
};
use crate::generate::{ChoiceUpdate, TokenOut};
use crate::validate::Endpoint;

/// Fixed facts of one response.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub logprobs: bool,
    /// Chat with tools: parse calls written in this format.
    pub tool_format: Option<ToolFormat>,
}

impl ResponseMeta {
    /// The id of call `index` of choice `choice`: unique per response (and responses' ids are
    /// unique), the same in the stream and the whole answer.
    fn call_id(&self, choice: u32, index: usize) -> String {
        let tail = self.id.rsplit('-').next().unwrap_or(&self.id);
        format!("call_{tail}{choice:02x}{index:02x}")
    }
}

/// A serializable response piece (a full body or one SSE chunk).
#[derive(Debug, Clone, serde::Serialize)]
#[serde(untagged)]
pub enum Body {
    Completion(CompletionResponse),
    ChatChunk(ChatChunk),
    Chat(ChatResponse),
}

/// Usage totals, from per-choice counts.
#[derive(Debug, Clone, Default)]
pub struct UsageTally {
    /// Prompt length per prompt.
    pub prompt_lens: Vec<u32>,
    pub n: u32,
    /// Per choice: completion tokens, highest cached-token count.
    pub completion: Vec<u32>,
    pub cached: Vec<u32>,
}

impl UsageTally {
    pub fn new(prompt_lens: Vec<u32>, n: u32) -> Self {
        let choices = prompt_lens.len() * n as usize;
        UsageTally { prompt_lens, n, completion: vec![0; choices], cached: vec![0; choices] }
    }

    pub fn record(&mut self, u: &ChoiceUpdate) {
        let i = u.index as usize;
        if let (Some(c), Some(k)) = (self.completion.get_mut(i), self.cached.get_mut(i)) {
            *c += u32::from(u.token.is_some());
            *k = (*k).max(u.cached_tokens);
        }
    }

    /// Prompt tokens count once per prompt (not per sample); cached tokens are the most any
    /// sample of that prompt reported.
    pub fn usage(&self) -> Usage {
        let prompt_tokens: u32 = self.prompt_lens.iter().sum();
        let completion_tokens: u32 = self.completion.iter().sum();
        let n = self.n.max(1) as usize;
        let cached_tokens = self.cached.chunks(n).map(|c| c.iter().copied().max().unwrap_or(0)).sum();
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// One choice accumulated for a non-streaming answer.
#[derive(Debug, Clone, Default)]
pub struct ChoiceAcc {
    pub text: String,
    pub tokens: Vec<TokenOut>,
    pub finish: Option<FinishReason>,
}

impl ChoiceAcc {
    pub fn push(&mut self, u: ChoiceUpdate) {
        self.text.push_str(&u.text);
        self.tokens.extend(u.token);
        if u.finish.is_some() {
            self.finish = u.finish;
        }
    }
}

fn finish_str(f: Option<FinishReason>) -> Option<String> {
    f.map(|r| r.as_openai().to_owned())
}

/// A choice that stopped by itself after making calls finished to call them.
fn tool_finish(f: Option<FinishReason>, calls: usize) -> Option<String> {
    match f {
        Some(FinishReason::Stop) if calls > 0 => Some("tool_calls".to_owned()),
        other => finish_str(other),
    }
}

/// Display text of one token id (as vLLM's logprobs show it).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

fn completion_logprobs(tok: &Tokenizer, tokens: &[TokenOut], start_offset: usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut offset = start_offset;
    for t in tokens {
        out.tokens.push(token_text(tok, t.id));
        out.text_offset.push(offset);
        offset += t.piece_len;
        let (chosen, top) = match &t.logprobs {
            Some(Logprobs { chosen, top }) => (chosen.logprob, top.as_slice()),
            None => (0.0, &[][..]),
        };
        out.token_logprobs.push(chosen);
        let top: BTreeMap<String, f32> = top.iter().map(|l| (token_text(tok, l.token_id), l.logprob)).collect();
        out.top_logprobs.push(top);
    }
    out
}

fn chat_logprobs(tok: &Tokenizer, tokens: &[TokenOut]) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| {
        let token = token_text(tok, id);
        let bytes = token.as_bytes().to_vec();
        TopLogprob { token, logprob, bytes }
    };
    let content = tokens
        .iter()
        .map(|t| {
            let (chosen, top) = match &t.logprobs {
                Some(l) => (l.chosen.logprob, l.top.iter().map(|a| entry(a.token_id, a.logprob)).collect()),
                None => (0.0, Vec::new()),
            };
            let e = entry(t.id, chosen);
            ChatTokenLogprob { token: e.token, logprob: e.logprob, bytes: e.bytes, top_logprobs: top }
        })
        .collect();
    ChatLogprobs { content }
}

/// The complete non-streaming response.
pub fn full_response(meta: &ResponseMeta, tok: &Tokenizer, choices: Vec<ChoiceAcc>, usage: Usage) -> Body {
    match meta.endpoint {
        Endpoint::Completions => Body::Completion(CompletionResponse {
            id: meta.id.clone(),
            object: "text_completion".into(),
            created: meta.created,
            model: meta.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| CompletionChoice {
                    index: i as u32,
                    logprobs: meta.logprobs.then(|| completion_logprobs(tok, &c.tokens, 0)),
                    text: c.text,
                    finish_reason: finish_str(c.finish),
                })
                .collect(),
            usage: Some(usage),
        }),
        Endpoint::Chat => Body::Chat(ChatResponse {
            id: meta.id.clone(),
            object: "chat.completion".into(),
            created: meta.created,
            model: meta.model.clone(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let index = i as u32;
                    let logprobs = meta.logprobs.then(|| chat_logprobs(tok, &c.tokens));
                    let Some(format) = meta.tool_format else {
                        let message =
                            AssistantMessage { role: "assistant".into(), content: Some(c.text), tool_calls: None };
                        return ChatChoice { index, logprobs, message, finish_reason: finish_str(c.finish) };
                    };
                    let found = Collected::parse(format, &c.text);
                    let finish_reason = tool_finish(c.finish, found.calls.len());
                    let tool_calls: Vec<ToolCall> = found
                        .calls
                        .into_iter()
                        .enumerate()
                        .map(|(k, (name, arguments))| ToolCall {
                            id: meta.call_id(index, k),
                            kind: "function".into(),
                            function: FunctionCall { name, arguments },
                        })
                        .collect();
                    let content = match (found.content.is_empty(), tool_calls.is_empty()) {
                        (true, false) => None,
                        _ => Some(found.content),
                    };
                    let tool_calls = (!tool_calls.is_empty()).then_some(tool_calls);
                    let message = AssistantMessage { role: "assistant".into(), content, tool_calls };
                    ChatChoice { index, logprobs, message, finish_reason }
                })
                .collect(),
            usage,
        }),
    }
}

/// Streaming state: per-choice text offsets for completions' `text_offset`, and per-choice
/// tool-call parsers for chat with tools.
#[derive(Debug, Clone)]
pub struct ChunkWriter {
    pub meta: ResponseMeta,
    offsets: Vec<usize>,
    parsers: Vec<ToolCallParser>,
}

impl ChunkWriter {
    pub fn new(meta: ResponseMeta, choices: usize) -> Self {
        let parsers = match meta.tool_format {
            Some(f) if meta.endpoint == Endpoint::Chat => vec![ToolCallParser::new(f); choices],
            _ => Vec::new(),
        };
        ChunkWriter { meta, offsets: vec![0; choices], parsers }
    }

    /// Chat streams open each choice with a `role` delta; completions have no opener.
    pub fn openers(&self) -> Vec<Body> {
        if self.meta.endpoint != Endpoint::Chat {
            return Vec::new();
        }
        (0..self.offsets.len() as u32)
            .map(|index| {
                let delta =
                    ChatDelta { role: Some("assistant".into()), content: Some(String::new()), tool_calls: None };
                self.chat_chunk(vec![ChatChunkChoice { index, delta, logprobs: None, finish_reason: None }], None)
            })
            .collect()
    }

    /// The chunk for one update, or `None` when it carries nothing a client would see.
    pub fn chunk(&mut self, tok: &Tokenizer, u: &ChoiceUpdate) -> Option<Body> {
        let has_logprobs = self.meta.logprobs && u.token.is_some();
        let tokens: Vec<TokenOut> = u.token.iter().cloned().collect();
        let offset = self.offsets.get(u.index as usize).copied().unwrap_or(0);
        if let Some(o) = self.offsets.get_mut(u.index as usize) {
            *o += tokens.iter().map(|t| t.piece_len).sum::<usize>();
        }
        if let Some(parser) = self.parsers.get_mut(u.index as usize) {
            let mut events = parser.push(&u.text);
            if u.finish.is_some() {
                events.extend(parser.finish());
            }
            let finish_reason = tool_finish(u.finish, parser.calls());
            let (content, tool_calls) = tool_delta(&self.meta, u.index, events);
            if content.is_empty() && tool_calls.is_empty() && finish_reason.is_none() && !has_logprobs {
                return None;
            }
            let delta = ChatDelta {
                role: None,
                content: (!content.is_empty()).then_some(content),
                tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
            };
            let logprobs = has_logprobs.then(|| chat_logprobs(tok, &tokens));
            return Some(
                self.chat_chunk(vec![ChatChunkChoice { index: u.index, delta, logprobs, finish_reason }], None),
            );
        }
        if u.text.is_empty() && u.finish.is_none() && !has_logprobs {
            return None;
        }
        Some(match self.meta.endpoint {
            Endpoint::Completions => Body::Completion(CompletionResponse {
                id: self.meta.id.clone(),
                object: "text_completion".into(),
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: vec![CompletionChoice {
                    index: u.index,
                    text: u.text.clone(),
                    logprobs: has_logprobs.then(|| completion_logprobs(tok, &tokens, offset)),
                    finish_reason: finish_str(u.finish),
                }],
                usage: None,
            }),
            Endpoint::Chat => {
                let delta = ChatDelta { role: None, content: Some(u.text.clone()), tool_calls: None };
                let logprobs = has_logprobs.then(|| chat_logprobs(tok, &tokens));
                self.chat_chunk(
                    vec![ChatChunkChoice { index: u.index, delta, logprobs, finish_reason: finish_str(u.finish) }],
                    None,
                )
            }
        })
    }

    /// The final usage chunk (`choices: []`), sent when `stream_options.include_usage`.
    pub fn usage_chunk(&self, usage: Usage) -> Body {
        match self.meta.endpoint {
            Endpoint::Completions => Body::Completion(CompletionResponse {
                id: self.meta.id.clone(),
                object: "text_completion".into(),
                created: self.meta.created,
                model: self.meta.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
            }),
            Endpoint::Chat => self.chat_chunk(Vec::new(), Some(usage)),
        }
    }

    fn chat_chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> Body {
        Body::ChatChunk(ChatChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        })
    }
}

/// The content and the `tool_calls` deltas of one chunk of choice `choice`: one entry per call
/// (a call's first carries its id, type and name), its arguments pieces joined.
fn tool_delta(meta: &ResponseMeta, choice: u32, events: Vec<ToolEvent>) -> (String, Vec<ToolCallDelta>) {
    let mut content = String::new();
    let mut calls: Vec<ToolCallDelta> = Vec::new();
    for ev in events {
        match ev {
            ToolEvent::Content(s) => content.push_str(&s),
            ToolEvent::Call { index, name } => calls.push(ToolCallDelta {
                index: index as u32,
                id: Some(meta.call_id(choice, index)),
                kind: Some("function".into()),
                function: FunctionDelta { name: Some(name), arguments: Some(String::new()) },
            }),
            ToolEvent::Arguments { index, text } => match calls.last_mut() {
                Some(last) if last.index == index as u32 => {
                    last.function.arguments.get_or_insert_default().push_str(&text)
                }
                _ => calls.push(ToolCallDelta {
                    index: index as u32,
                    id: None,
                    kind: None,
                    function: FunctionDelta { name: None, arguments: Some(text) },
                }),
            },
        }
    }
    (content, calls)
}
