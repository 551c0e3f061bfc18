//! Requests are checked and tokenized once, here, into a [`ValidRequest`]; code past this
//! point never re-checks a range. Structured output and tools are read in
//! [`crate::structured`].

use cleave_constrain::tools::ToolFormat;
use cleave_protocol::{SamplingParams, StopConditions};
use cleave_tokenizer::{ChatOptions, TokenizerError};

use crate::api::{ChatRequest, CommonParams, CompletionRequest, InputMessage, PromptInput, StopInput};
use crate::error::CoordinatorError;
use crate::model::ModelInfo;
use crate::structured::{self, Requested, TemplateSupport, Tools};

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Which endpoint a request came from (decides the response shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// One tokenized prompt with the completion budget it may use.
///
/// Invariant: `ids` is non-empty, every id is in the vocabulary, and
/// `ids.len() + max_tokens <= context_len`, `max_tokens >= 1`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPrompt {
    pub ids: Vec<u32>,
    pub max_tokens: u32,
}

/// A request that passed every check. Choices are numbered prompt-major:
/// choice `p * n + j` is the `j`-th sample of prompt `p`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub endpoint: Endpoint,
    /// The served model's name, echoed in responses.
    pub model: String,
    pub prompts: Vec<ValidPrompt>,
    /// Samples per prompt, `>= 1`.
    pub n: u32,
    /// Passed [`SamplingParams::validate`].
    pub params: SamplingParams,
    /// Stop strings (applied by the edge), extra stop ids and `ignore_eos`;
    /// `max_tokens` is per prompt (see [`ValidPrompt`]).
    pub stop: StopConditions,
    pub stream: bool,
    pub include_usage: bool,
    /// A chat request that gave tools (and `tool_choice` other than `none`): the output is
    /// parsed for calls written in this format. When the choice forces a call,
    /// `params.constraint` holds the grammar that makes the output nothing but calls.
    pub tool_format: Option<ToolFormat>,
}

impl ValidRequest {
    /// Total number of choices (`prompts * n`).
    pub fn num_choices(&self) -> usize {
        self.prompts.len() * self.n as usize
    }
}

/// Limits the edge enforces, from the arguments and the model.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_choices: u32,
}

fn invalid(param: &str, message: impl Into<String>) -> CoordinatorError {
    CoordinatorError::InvalidParam { param: param.to_owned(), message: message.into() }
}

/// Checks `/v1/completions`.
pub fn validate_completion(
    req: CompletionRequest,
    model: &ModelInfo,
    limits: Limits,
) -> Result<ValidRequest, CoordinatorError> {
    if req.echo == Some(true) {
        return Err(invalid("echo", "echo is not supported"));
    }
    let asks_for_tools = |v: &Option<serde_json::Value>, harmless: &[&str]| match v {
        None => false,
        Some(serde_json::Value::Array(a)) => !a.is_empty(),
        Some(serde_json::Value::String(s)) => !harmless.contains(&s.as_str()),
        Some(_) => true,
    };
    for (field, value, harmless) in
        [("tools", &req.tools, &[][..]), ("tool_choice", &req.tool_choice, &["none", "auto"][..])]
    {
        if asks_for_tools(value, harmless) {
            return Err(invalid(field, "only supported on /v1/chat/completions"));
        }
    }
    let tok = &model.tokenizer;
    let prompts: Vec<Vec<u32>> = match req.prompt {
        PromptInput::Text(t) => vec![tok.encode(&t, true)?],
        PromptInput::Texts(ts) => ts.iter().map(|t| tok.encode(t, true)).collect::<Result<_, _>>()?,
        PromptInput::Ids(ids) => vec![ids],
        PromptInput::IdLists(lists) => lists,
    };
    validate_common(Endpoint::Completions, prompts, req.logprobs, req.common, model, limits, None)
}

/// Checks `/v1/chat/completions`, rendering the chat template.
pub fn validate_chat(req: ChatRequest, model: &ModelInfo, limits: Limits) -> Result<ValidRequest, CoordinatorError> {
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), top) => Some(top.unwrap_or(0)),
        (_, Some(top)) if top > 0 => return Err(invalid("top_logprobs", "top_logprobs requires logprobs: true")),
        _ => None,
    };
    let support = TemplateSupport::of(model.tokenizer.chat_template_source(None)?);
    let tools = structured::read_tools(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        support.format,
        model,
    )?;
    let agp = req.add_generation_prompt.unwrap_or(true);
    let ids = render_chat(model, &req.messages, agp, support, tools.as_ref())?;
    let mut common = req.common;
    if req.max_completion_tokens.is_some() {
        common.max_tokens = req.max_completion_tokens;
    }
    let extra = ChatExtra { forced: tools.as_ref().and_then(Tools::forced), tool_format: tools.map(|t| t.format) };
    validate_common(Endpoint::Chat, vec![ids], logprobs, common, model, limits, Some(extra))
}

/// What a chat request adds to the common checks.
struct ChatExtra {
    /// The constraint of a forced `tool_choice`.
    forced: Option<Requested>,
    tool_format: Option<ToolFormat>,
}

/// Renders `messages` with the model's chat template and tokenizes the result (the
/// template emits its own special tokens, so none are added).
pub fn chat_prompt_ids(
    model: &ModelInfo,
    messages: &[InputMessage],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, CoordinatorError> {
    let support = TemplateSupport::of(model.tokenizer.chat_template_source(None)?);
    render_chat(model, messages, add_generation_prompt, support, None)
}

fn render_chat(
    model: &ModelInfo,
    messages: &[InputMessage],
    add_generation_prompt: bool,
    support: TemplateSupport,
    tools: Option<&Tools>,
) -> Result<Vec<u32>, CoordinatorError> {
    if messages.is_empty() {
        return Err(invalid("messages", "at least one message is required"));
    }
    let messages = structured::chat_messages(messages, support, tools)?;
    let opts = ChatOptions {
        add_generation_prompt,
        tools: tools.filter(|_| support.tools).map(|t| t.definitions.clone()),
        ..ChatOptions::default()
    };
    let text = model.tokenizer.render_chat_with(&messages, &opts).map_err(|e| match e {
        TokenizerError::TemplateException { message, .. } => CoordinatorError::ChatTemplate { message },
        other => CoordinatorError::Tokenizer(other),
    })?;
    Ok(model.tokenizer.encode(&text, false)?)
}

fn validate_common(
    endpoint: Endpoint,
    prompts: Vec<Vec<u32>>,
    logprobs: Option<u32>,
    c: CommonParams,
    model: &ModelInfo,
    limits: Limits,
    chat: Option<ChatExtra>,
) -> Result<ValidRequest, CoordinatorError> {
    if let Some((param, message)) = c.unimplemented.first() {
        return Err(invalid(param, message));
    }
    // Read now (cheap), compiled after the other checks (the costly part).
    let mut constraints = structured::requested(&c)?;
    if let Some(requested) = c.model {
        if requested != model.name {
            return Err(CoordinatorError::UnknownModel { requested, served: model.name.clone() });
        }
    }
    let n = c.n.unwrap_or(1);
    if n == 0 || n > limits.max_choices {
        return Err(invalid("n", format!("must be in [1, {}], got {n}", limits.max_choices)));
    }
    if prompts.is_empty() {
        return Err(invalid("prompt", "at least one prompt is required"));
    }
    if prompts.len().saturating_mul(n as usize) > limits.max_choices as usize {
        return Err(invalid(
            "n",
            format!("{} prompts times n={n} exceeds the limit of {} choices", prompts.len(), limits.max_choices),
        ));
    }
    if c.max_tokens == Some(0) {
        return Err(invalid("max_tokens", "must be at least 1"));
    }
    let vocab = model.tokenizer.vocab_size();
    let mut valid_prompts = Vec::with_capacity(prompts.len());
    for ids in prompts {
        if ids.is_empty() {
            return Err(invalid("prompt", "the prompt is empty"));
        }
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(invalid("prompt", format!("token id {bad} is outside the vocabulary (size {vocab})")));
        }
        let room = (model.context_len as usize).saturating_sub(ids.len());
        let max_tokens = match c.max_tokens {
            Some(m) if m as usize <= room => m,
            None if room >= 1 => u32::try_from(room).unwrap_or(u32::MAX),
            requested => {
                return Err(CoordinatorError::ContextLength {
                    prompt_tokens: ids.len(),
                    max_tokens: requested.unwrap_or(1),
                    context_len: model.context_len,
                })
            }
        };
        valid_prompts.push(ValidPrompt { ids, max_tokens });
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => return Err(invalid("top_k", format!("must be -1, 0 or positive, got {k}"))),
    };
    let (forced, tool_format) = chat.map_or((None, None), |x| (x.forced, x.tool_format));
    constraints.extend(forced);
    let constraint = structured::settle(constraints, model)?;
    let defaults = SamplingParams::default();
    let model_defaults = model.defaults;
    let params = SamplingParams {
        temperature: c.temperature.unwrap_or(model_defaults.temperature),
        top_p: c.top_p.unwrap_or(model_defaults.top_p),
        top_k: if c.top_k.is_some() { top_k } else { model_defaults.top_k },
        min_p: c.min_p.unwrap_or(model_defaults.min_p),
        repetition_penalty: c.repetition_penalty.unwrap_or(model_defaults.repetition_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(defaults.frequency_penalty),
        presence_penalty: c.presence_penalty.unwrap_or(defaults.presence_penalty),
        // Negative seeds are accepted as their two's-complement bits.
        seed: c.seed.map(|s| s as u64),
        logprobs,
        constraint,
    };
    params.validate().map_err(|e| invalid(e.param, e.message))?;
    let stop_strings = match c.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s],
        Some(StopInput::Many(v)) => v,
    };
    if stop_strings.len() > MAX_STOP_STRINGS {
        return Err(invalid("stop", format!("at most {MAX_STOP_STRINGS} stop strings, got {}", stop_strings.len())));
    }
    let stop_token_ids = c.stop_token_ids.unwrap_or_default();
    if let Some(bad) = stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(invalid("stop_token_ids", format!("token id {bad} is outside the vocabulary (size {vocab})")));
    }
    let stop =
        StopConditions { max_tokens: 0, stop_strings, stop_token_ids, ignore_eos: c.ignore_eos.unwrap_or(false) };
    let stream = c.stream.unwrap_or(false);
    let include_usage = c.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    Ok(ValidRequest {
        endpoint,
        model: model.name.clone(),
        prompts: valid_prompts,
        n,
        params,
        stop,
        stream,
        include_usage,
        tool_format,
    })
}
