//! Constrained decoding: a request's [`Constraint`] (JSON, a JSON Schema, a regex, a choice, a
//! Lark grammar) compiled against the model's vocabulary, and per sequence the state that says
//! which tokens may come next.
//!
//! Built on `llguidance` (what vLLM and SGLang use): an Earley parser over a lazily built
//! lexer, whose masks cost tens of microseconds on 50k-token vocabularies once warm, and whose
//! limits (lexer fuel, Earley items per mask, grammar size) bound what a hostile schema can
//! cost. Compared with `outlines-core` (regex to a precompiled token automaton: compile time
//! and memory grow with the schema, minutes for large ones) it needs no up-front compilation;
//! with xgrammar it has no Rust crate.
//!
//! Who uses it: the coordinator compiles each constraint once to refuse a bad one with a 400
//! ([`Compiler::check`]); every node that samples for the request compiles it again against
//! its own vocabulary and replays the tokens generated so far ([`Compiler::start`]), so the
//! parser state never travels on the wire (only the constraint and the tokens, which already
//! do).
//!
//! Allowed dependencies: protocol, tokenizer, llguidance/toktrie. No engine, no I/O.

pub mod tools;
mod vocab;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cleave_protocol::Constraint;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{ApproximateTokEnv, SimpleVob, TokEnv};

pub use vocab::token_trie;

/// Everything that can go wrong in this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstrainError {
    /// The tokenizer's vocabulary cannot be read as bytes (the model cannot be constrained).
    #[error("constrained decoding is unavailable for this tokenizer: {0}")]
    Vocabulary(String),
    /// The schema, regex or grammar of a request does not compile (the client's fault).
    #[error("invalid {kind}: {reason}")]
    Invalid { kind: &'static str, reason: String },
    /// A token the constraint does not allow was fed to it (a replayed history that does not
    /// belong to the language, or a sampler that ignored the mask).
    #[error("token {token} is not allowed by the {kind} constraint here: {reason}")]
    Rejected { kind: &'static str, token: u32, reason: String },
    /// The parser failed while computing a mask (a limit hit mid-generation).
    #[error("the {kind} constraint failed: {reason}")]
    Failed { kind: &'static str, reason: String },
}

/// Compiles constraints against one vocabulary. Cheap to clone (shared factory and cache);
/// `Send + Sync`.
#[derive(Clone)]
pub struct Compiler {
    factory: Arc<ParserFactory>,
    /// Fresh matchers by constraint: a repeated constraint (the same tools on every turn of an
    /// agent, one schema for a pipeline) clones a compiled parser instead of compiling again.
    cache: Arc<Mutex<HashMap<Constraint, Matcher>>>,
    vocab_size: usize,
}

impl std::fmt::Debug for Compiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiler").field("vocab_size", &self.vocab_size).finish()
    }
}

/// Compiled constraints kept for reuse (each a few hundred KB at most, lexer caches included).
const CACHE_ENTRIES: usize = 64;

impl Compiler {
    /// For a model with `model_vocab` logits per row, whose end-of-sequence ids are `eos`
    /// (a constraint that is complete allows exactly these; see [`ConstraintState::is_done`]).
    pub fn new(
        tokenizer: &cleave_tokenizer::Tokenizer,
        model_vocab: usize,
        eos: &[u32],
    ) -> Result<Self, ConstrainError> {
        let trie = token_trie(tokenizer, model_vocab, eos)?;
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstrainError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory: Arc::new(factory), cache: Arc::default(), vocab_size: model_vocab })
    }

    /// Logits per row this compiler's masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether `c` compiles (and its first mask can be computed): what the edge checks once.
    pub fn check(&self, c: &Constraint) -> Result<(), ConstrainError> {
        let mut state = self.start(c, &[])?;
        let mut mask = Mask::default();
        state.fill_mask(&mut mask)
    }

    /// A fresh state for `c` that has consumed `history` (tokens already generated, e.g. the
    /// first token a prefill node sampled, or a migrated stream's output).
    pub fn start(&self, c: &Constraint, history: &[u32]) -> Result<ConstraintState, ConstrainError> {
        let kind = c.kind();
        let cached = self.cache.lock().ok().and_then(|m| m.get(c).cloned());
        let matcher = match cached {
            Some(m) => m,
            None => {
                let grammar = grammar(c)?;
                let parser = self
                    .factory
                    .create_parser(grammar)
                    .map_err(|e| ConstrainError::Invalid { kind, reason: e.to_string() })?;
                let m = Matcher::new(Ok(parser));
                if let Some(e) = m.get_error() {
                    return Err(ConstrainError::Invalid { kind, reason: e });
                }
                if let Ok(mut cache) = self.cache.lock() {
                    if cache.len() >= CACHE_ENTRIES {
                        cache.clear();
                    }
                    cache.insert(c.clone(), m.clone());
                }
                m
            }
        };
        let mut state = ConstraintState { matcher, kind };
        for &t in history {
            state.commit(t)?;
        }
        Ok(state)
    }
}

/// The llguidance grammar of a constraint.
fn grammar(c: &Constraint) -> Result<TopLevelGrammar, ConstrainError> {
    let kind = c.kind();
    Ok(match c {
        Constraint::JsonObject => {
            TopLevelGrammar::from_json_schema(bounded_whitespace(serde_json::json!({"type": "object"})))
        }
        Constraint::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| ConstrainError::Invalid { kind, reason: format!("the schema is not JSON: {e}") })?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(ConstrainError::Invalid { kind, reason: "a JSON Schema is an object or a boolean".into() });
            }
            TopLevelGrammar::from_json_schema(bounded_whitespace(schema))
        }
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(choices) => {
            let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
        Constraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    })
}

/// Most whitespace bytes between two JSON tokens. llguidance allows any run by default, and a
/// weak or confused model then loops on newlines until `max_tokens`, returning JSON that never
/// closes; 32 still fits pretty-printing fifteen levels deep. A schema's own `x-guidance`
/// options win.
pub const JSON_MAX_WHITESPACE: usize = 32;

fn bounded_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        if !obj.contains_key("x-guidance") {
            let pattern = format!(r"[\x20\x0A\x0D\x09]{{1,{JSON_MAX_WHITESPACE}}}");
            obj.insert("x-guidance".into(), serde_json::json!({ "whitespace_pattern": pattern }));
        }
    }
    schema
}

/// The allowed tokens at one position: a bit per vocabulary entry. Reused across steps.
#[derive(Debug, Default, Clone)]
pub struct Mask {
    bits: Option<SimpleVob>,
}

impl Mask {
    /// Sets every logit of a token the mask does not allow to `-inf`. `logits` is one row;
    /// entries past the mask (padding rows of the embedding) are masked too.
    pub fn apply(&self, logits: &mut [f32]) {
        let Some(bits) = &self.bits else { return };
        let words = bits.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let word = words.get(w).copied().unwrap_or(0);
            if word == u32::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if word & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Whether `token` is allowed.
    pub fn allows(&self, token: u32) -> bool {
        self.bits.as_ref().is_none_or(|b| (token as usize) < b.len() && b.is_allowed(token))
    }

    /// Allowed tokens.
    pub fn count(&self) -> usize {
        self.bits.as_ref().map_or(0, SimpleVob::num_set)
    }
}

/// One sequence's position in its constraint's language. `Send`: masks are computed on a
/// thread of their own while the forward pass runs.
#[derive(Clone)]
pub struct ConstraintState {
    matcher: Matcher,
    kind: &'static str,
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintState").field("kind", &self.kind).field("done", &self.is_done()).finish()
    }
}

impl ConstraintState {
    /// Which tokens may come next. Once the text is complete and nothing may follow, only the
    /// end-of-sequence tokens.
    pub fn fill_mask(&mut self, mask: &mut Mask) -> Result<(), ConstrainError> {
        let bits = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstrainError::Failed { kind: self.kind, reason: e.to_string() })?;
        if bits.is_zero() {
            return Err(ConstrainError::Failed { kind: self.kind, reason: "no token can continue the text".into() });
        }
        mask.bits = Some(bits);
        Ok(())
    }

    /// Advances past `token` (the sampled one).
    pub fn commit(&mut self, token: u32) -> Result<(), ConstrainError> {
        if self.is_done() {
            // An end-of-sequence token after a complete text (the stop the mask forced) or
            // anything a sequence that ignores EOS adds: the constraint has nothing more to say.
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| ConstrainError::Rejected {
            kind: self.kind,
            token,
            reason: e.to_string(),
        })
    }

    /// Whether the text is complete and nothing else may follow it (the sequence should stop).
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The constraint's kind (`Constraint::kind`).
    pub fn kind(&self) -> &'static str {
        self.kind
    }
}
