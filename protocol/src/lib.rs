//! Domain types shared by every crate of cleave: request ids, sampling parameters, token events,
//! finish reasons and the KV layout description.
//!
//! Allowed dependencies: serde, thiserror, flatbuffers (wire form of the control plane) and
//! tokio's I/O traits (framing of that wire form). This crate holds data, not behaviour:
//! anything with a clock, a socket or a model belongs elsewhere.

use serde::{Deserialize, Serialize};

// The generated flatbuffers code names `alloc::` paths; at the crate root this puts `alloc` in the
// extern prelude for every module.
extern crate alloc;

pub mod control;
mod generated;
pub mod prefix;

pub mod handoff;
pub use handoff::{HandoffTicket, LeaseId, TransportKind, HANDOFF_VERSION};

/// Identifies one request across every process of a cleave cluster.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{:016x}", self.0)
    }
}

/// How the next token is chosen. Validated once at the edge (see [`SamplingParams::validate`]);
/// code past that point trusts the ranges.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 disables it.
    pub top_k: u32,
    /// Drop tokens whose probability is below `min_p * p_max`; 0 disables it.
    pub min_p: f32,
    /// Multiplicative penalty (>1 discourages) on tokens seen in prompt or output; 1 disables it.
    pub repetition_penalty: f32,
    /// Subtracted from a logit once per earlier occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted from a logit once if the token occurred in the output.
    pub presence_penalty: f32,
    /// Per-request seed: the same seed, prompt and parameters give the same tokens.
    pub seed: Option<u64>,
    /// Return the log-probability of each chosen token and this many alternatives (None: none).
    pub logprobs: Option<u32>,
    /// Limits the text to a language (JSON, a schema, a regex, a choice, a grammar): tokens
    /// outside it are masked before sampling, on whichever node samples.
    pub constraint: Option<Constraint>,
}

/// The language a request's output must belong to. Carried with the request to every node that
/// samples for it (prefill node, decode node, the node a stream migrates to); each compiles it
/// against its own vocabulary and replays the tokens already generated, so the constraint state
/// itself never travels.
///
/// Validated for size here ([`Constraint::validate`]); whether the schema, regex or grammar
/// compiles is checked once at the edge, against the model's vocabulary (`cleave-constrain`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON Schema (its text).
    JsonSchema(String),
    /// Text matching this regular expression (whole output).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (it embeds JSON schemas with `%json { ... }`);
    /// tool calls are constrained with one.
    Lark(String),
}

/// Longest constraint text (schema, regex, grammar, all choices together) a request may bring.
pub const MAX_CONSTRAINT_BYTES: usize = 1 << 20;
/// Most entries of a [`Constraint::Choice`].
pub const MAX_CONSTRAINT_CHOICES: usize = 4096;

impl Constraint {
    /// The name of the request field it came from, for error messages and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Lark(_) => "grammar",
        }
    }

    /// Size limits only (see the type's doc).
    pub fn validate(&self) -> Result<(), ParamError> {
        let bad = |message: String| Err(ParamError { param: "constraint", message });
        let bytes = match self {
            Constraint::JsonObject => 0,
            Constraint::JsonSchema(t) | Constraint::Regex(t) | Constraint::Lark(t) => {
                if t.is_empty() {
                    return bad(format!("the {} is empty", self.kind()));
                }
                t.len()
            }
            Constraint::Choice(c) => {
                if c.is_empty() {
                    return bad("the choice list is empty".into());
                }
                if c.len() > MAX_CONSTRAINT_CHOICES {
                    return bad(format!("{} choices; at most {MAX_CONSTRAINT_CHOICES}", c.len()));
                }
                if c.iter().any(String::is_empty) {
                    return bad("a choice is the empty string".into());
                }
                c.iter().map(String::len).sum()
            }
        };
        if bytes > MAX_CONSTRAINT_BYTES {
            return bad(format!("the {} is {bytes} bytes; at most {MAX_CONSTRAINT_BYTES}", self.kind()));
        }
        Ok(())
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            logprobs: None,
            constraint: None,
        }
    }
}

/// A parameter outside its allowed range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid parameter `{param}`: {message}")]
pub struct ParamError {
    pub param: &'static str,
    pub message: String,
}

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl SamplingParams {
    /// Checks every range once; the engine relies on it afterwards.
    pub fn validate(&self) -> Result<(), ParamError> {
        let bad = |param: &'static str, message: String| Err(ParamError { param, message });
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return bad("temperature", format!("must be in [0, 100], got {}", self.temperature));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return bad("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return bad("repetition_penalty", format!("must be in (0, 10], got {}", self.repetition_penalty));
        }
        for (param, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return bad(param, format!("must be in [-2, 2], got {v}"));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_TOP_LOGPROBS {
                return bad("top_logprobs", format!("must be at most {MAX_TOP_LOGPROBS}, got {n}"));
            }
        }
        if let Some(c) = &self.constraint {
            c.validate()?;
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// When generation stops.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StopConditions {
    /// Most new tokens to generate.
    pub max_tokens: u32,
    /// Strings that end generation; the matched string is not returned.
    pub stop_strings: Vec<String>,
    /// Token ids that end generation (in addition to the model's EOS ids unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating through EOS (benchmarks need fixed output lengths).
    pub ignore_eos: bool,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// Hit max_tokens or the context length.
    Length,
    /// EOS, a stop token id or a stop string.
    Stop,
    /// The client went away or asked to cancel.
    Cancelled,
    /// The engine could not serve it (e.g. the prompt can never fit the KV cache).
    Error,
}

impl FinishReason {
    /// The OpenAI API's spelling.
    pub fn as_openai(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// Log-probability of one token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// Log-probabilities of a chosen token and its top alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

/// One generated token as it is streamed to whoever submitted the request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub request_id: RequestId,
    /// None for a final event that carries no token (e.g. cancellation).
    pub token_id: Option<u32>,
    /// Text that became final with this token (UTF-8 complete; held back stop-string prefixes
    /// are released later or dropped).
    pub text: String,
    pub logprobs: Option<Logprobs>,
    /// Set on the last event of a request, and only there.
    pub finish_reason: Option<FinishReason>,
    /// Number of prompt tokens (set on every event for convenience).
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// Tokens generated so far, this one included.
    pub completion_tokens: u32,
    /// Why the request failed, on a final event whose reason is [`FinishReason::Error`].
    pub error: Option<String>,
}

impl TokenEvent {
    /// The final event of a request that ended without a token: `reason` (an error carries
    /// `error`), with the counts so far.
    pub fn last(request_id: RequestId, reason: FinishReason, prompt_tokens: u32, completion_tokens: u32) -> Self {
        TokenEvent {
            request_id,
            token_id: None,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(reason),
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens,
            error: None,
        }
    }

    /// The final event of a request that failed.
    pub fn failed(request_id: RequestId, prompt_tokens: u32, completion_tokens: u32, error: String) -> Self {
        TokenEvent {
            error: Some(error),
            ..Self::last(request_id, FinishReason::Error, prompt_tokens, completion_tokens)
        }
    }
}

/// Describes the bytes of a KV cache block so that two processes can check they agree before
/// moving any. Blocks are laid out per layer as `[block_size, num_kv_heads, head_dim]` for K and
/// the same for V.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    pub model_fingerprint: u64,
    pub dtype: KvDtype,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
}

/// What a node's weights are, beside the model's identity (`KvLayout::model_fingerprint`):
/// nodes of one model may hold it in different formats (f32 for prefill, Q4 for decode), which
/// have different weights fingerprints and the same identity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightsInfo {
    /// A fingerprint of the weights as loaded (sampled values, dequantized).
    pub fingerprint: u64,
    /// The formats the linear weights are held in, largest first, `+`-joined ("Q4_1+Q8_0",
    /// "f32"); empty when not said.
    pub format: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
}

impl KvDtype {
    pub fn size_bytes(&self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

impl KvLayout {
    /// Bytes of K (or of V) of one block in one layer.
    pub fn half_block_bytes(&self) -> usize {
        self.block_size as usize * self.num_kv_heads as usize * self.head_dim as usize * self.dtype.size_bytes()
    }
    /// Bytes of K and V of one token across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers as usize * self.num_kv_heads as usize * self.head_dim as usize * self.dtype.size_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_params_are_valid_and_greedy() {
        let p = SamplingParams::default();
        p.validate().unwrap();
        assert!(p.is_greedy());
    }

    #[test]
    fn out_of_range_params_are_refused() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert_eq!(p.validate().unwrap_err().param, "top_p");
        let p = SamplingParams { temperature: f32::NAN, ..Default::default() };
        assert_eq!(p.validate().unwrap_err().param, "temperature");
        let p = SamplingParams { logprobs: Some(21), ..Default::default() };
        assert_eq!(p.validate().unwrap_err().param, "top_logprobs");
    }

    #[test]
    fn llama3_8b_layout_is_128_kib_per_token() {
        let l = KvLayout {
            model_fingerprint: 0,
            dtype: KvDtype::Bf16,
            num_layers: 32,
            num_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
        };
        assert_eq!(l.bytes_per_token(), 128 * 1024);
    }
}
