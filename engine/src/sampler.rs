//! Chooses the next token of one sequence from the model's logits.
//!
//! Allowed dependencies: protocol (for [`SamplingParams`] and [`Logprobs`]), `rand` (traits) and
//! `rand_chacha`. Sans-IO and deterministic: no OS randomness, no clock. A sequence's randomness
//! comes from its [`Sampler`]; the vocabulary-sized buffers live in a [`SamplerScratch`] that one
//! engine thread reuses for every sequence, so per-sequence state is a few hundred bytes.
//!
//! Cost: a handful of vectorised passes over the vocabulary and no sort of it (see `filter` for
//! how top-k and top-p thresholds are found); the passes are compiled for AVX-512F, AVX2 and
//! the baseline and picked at run time, with bit-identical results (`math`). The only `unsafe`
//! is that dispatch.
//!
//! Processing order (vLLM / HF):
//! 1. penalties on the raw logits: repetition (HF: `l > 0 ? l / r : l * r`, once per distinct
//!    token of prompt + output), then frequency (`count_in_output * f`), then presence (`p` once
//!    if the token occurs in the output);
//! 2. `temperature == 0`: argmax, lowest id on ties; no randomness is consumed;
//! 3. otherwise: divide by the temperature, then top-k, top-p (nucleus over the top-k
//!    renormalised distribution, always keeping the most likely token), min-p (relative to the
//!    largest probability), then draw from the renormalised survivors. Exact ties at a top-k or
//!    top-p boundary are all kept (see `filter`).
//!
//! Reproducibility invariant: the draw for output position `i` (`output.len() == i`) uses the
//! `i`-th `u64` of the ChaCha12 stream of the sequence's seed, whatever happened before. So the
//! same seed, logits and history give the same token, and a decode node that receives the seed
//! and the tokens so far continues exactly the stream a prefill node started.
//!
//! Degenerate logits never panic: NaN counts as `-inf`, `+inf` as `f32::MAX`; when every
//! penalised logit is `-inf`, the token is the argmax of the raw logits, which is token 0 when
//! those are all NaN or `-inf` too. Token ids in `prompt`/`output` outside the vocabulary are
//! ignored by the penalties (there is no logit to penalise).

mod filter;
mod logprobs;
mod math;
#[cfg(test)]
mod tests;

use cleave_protocol::{Logprobs, SamplingParams};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;

use self::filter::{Filters, Weights};
use self::math::sanitize;

/// Why no token could be sampled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplerError {
    #[error("cannot sample from an empty logits vector")]
    EmptyLogits,
}

/// The chosen token and, when requested, its logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// `Some` iff `params.logprobs` was `Some`; computed from the raw logits (see `logprobs`).
    pub logprobs: Option<Logprobs>,
}

/// Vocabulary-sized buffers reused across calls (and across sequences) so that sampling does not
/// allocate once warm. Holds no state between calls: any scratch may serve any sequence.
#[derive(Debug, Default)]
pub struct SamplerScratch {
    /// Penalised, scaled logits, then weights `e^(s - max)`.
    work: Vec<f32>,
    /// Per-chunk sums of all weights, then of the surviving ones, and per-chunk maxima.
    chunk_sums: Vec<f64>,
    kept_sums: Vec<f64>,
    chunk_max: Vec<f32>,
    threshold: filter::ThresholdScratch,
    top: Vec<(f32, u32)>,
    maxima: Vec<f32>,
}

/// Per-sequence sampling state: the seed and its random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    seed: u64,
    rng: ChaCha12Rng,
}

impl Sampler {
    /// Seeds from `params.seed` when given, else from `fallback_seed`, which the engine derives
    /// deterministically (e.g. from its own seed and the request id); the sampler never reads
    /// OS randomness.
    pub fn new(params: &SamplingParams, fallback_seed: u64) -> Self {
        let seed = params.seed.unwrap_or(fallback_seed);
        Self { seed, rng: ChaCha12Rng::seed_from_u64(seed) }
    }

    /// The seed in use: hand it over with the sequence so that another node continues the same
    /// random stream.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Chooses the token that follows `prompt ++ output`, given the model's `logits` for that
    /// position (one per vocabulary entry). `params` should have passed
    /// [`SamplingParams::validate`]; out-of-range values do not panic but their tokens are
    /// unspecified (still deterministic).
    ///
    /// Allocation-free once `scratch` is warm, except for the returned logprobs. Errors only on
    /// empty `logits`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        prompt: &[u32],
        output: &[u32],
        scratch: &mut SamplerScratch,
    ) -> Result<Sampled, SamplerError> {
        if logits.is_empty() {
            return Err(SamplerError::EmptyLogits);
        }
        let penalties = Penalties::new(params);
        let token = if params.temperature > 0.0 {
            let u = self.uniform_at(output.len());
            sample_random(logits, params, &penalties, History { prompt, output }, u, scratch)
        } else if penalties.active() {
            scratch.penalised(logits, &penalties, History { prompt, output }, 1.0);
            if math::max(&scratch.work) == f32::NEG_INFINITY {
                math::argmax(logits) as u32
            } else {
                math::argmax(&scratch.work) as u32
            }
        } else {
            math::argmax(logits) as u32
        };
        let logprobs = params
            .logprobs
            .map(|n| logprobs::raw_logprobs(logits, token, n as usize, &mut scratch.top, &mut scratch.maxima));
        Ok(Sampled { token, logprobs })
    }

    /// The `position`-th uniform draw in `[0, 1)` of this sequence's stream.
    fn uniform_at(&mut self, position: usize) -> f64 {
        // Each draw is one u64, i.e. two 32-bit words of the ChaCha stream.
        self.rng.set_word_pos(2 * position as u128);
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The tokens before the position being sampled.
#[derive(Clone, Copy)]
struct History<'a> {
    prompt: &'a [u32],
    output: &'a [u32],
}

/// Temperature > 0: penalties, scaling, truncation, draw with uniform `u`.
fn sample_random(
    logits: &[f32],
    params: &SamplingParams,
    penalties: &Penalties,
    history: History<'_>,
    u: f64,
    s: &mut SamplerScratch,
) -> u32 {
    s.penalised(logits, penalties, history, 1.0 / params.temperature);
    let m = math::max(&s.work);
    if m == f32::NEG_INFINITY {
        return math::argmax(logits) as u32;
    }
    let total = math::exp_weights(&mut s.work, m, &mut s.chunk_sums);
    let filters = Filters::new(params.top_k, params.top_p, params.min_p, logits.len());
    if !filters.any() {
        return filter::draw(&s.work, &s.chunk_sums, total, 0.0, u);
    }
    math::chunk_maxima(&s.work, &mut s.chunk_max);
    let weights = Weights { w: &s.work, chunk_max: &s.chunk_max, total };
    let theta = filter::threshold(&weights, &filters, &mut s.threshold);
    let kept = math::masked_chunk_sums(&s.work, &s.chunk_max, theta, &mut s.kept_sums);
    filter::draw(&s.work, &s.kept_sums, kept, theta, u)
}

impl SamplerScratch {
    /// Fills `work` with the sanitized logits, penalised and multiplied by `inv_temperature`
    /// (penalties are computed on the unscaled values, then scaled).
    fn penalised(&mut self, logits: &[f32], pen: &Penalties, h: History<'_>, inv_temperature: f32) {
        math::scaled_into(&mut self.work, logits, inv_temperature);
        let vocab = logits.len();
        let raw = |id: u32| logits.get(id as usize).map(|&x| sanitize(x));
        if pen.repetition != 1.0 {
            for &id in h.prompt.iter().chain(h.output) {
                if let Some(x) = raw(id) {
                    self.work[id as usize] = sanitize(pen.repeat(x) * inv_temperature);
                }
            }
        }
        if pen.presence != 0.0 || pen.frequency != 0.0 {
            // Setting (not subtracting) makes presence count once per distinct token.
            for &id in h.output {
                if let Some(x) = raw(id) {
                    self.work[id as usize] = sanitize((pen.repeat(x) - pen.presence) * inv_temperature);
                }
            }
        }
        if pen.frequency != 0.0 {
            let step = pen.frequency * inv_temperature;
            for &id in h.output.iter().filter(|&&id| (id as usize) < vocab) {
                let w = &mut self.work[id as usize];
                *w = sanitize(*w - step);
            }
        }
    }
}

/// The penalty parameters, with 1 / 0 meaning off.
struct Penalties {
    repetition: f32,
    frequency: f32,
    presence: f32,
}

impl Penalties {
    fn new(p: &SamplingParams) -> Self {
        // A non-positive or NaN repetition penalty (refused by validation) is treated as off.
        let repetition = if p.repetition_penalty > 0.0 { p.repetition_penalty } else { 1.0 };
        let finite_or_zero = |v: f32| if v.is_finite() { v } else { 0.0 };
        Self {
            repetition,
            frequency: finite_or_zero(p.frequency_penalty),
            presence: finite_or_zero(p.presence_penalty),
        }
    }

    fn active(&self) -> bool {
        self.repetition != 1.0 || self.frequency != 0.0 || self.presence != 0.0
    }

    /// HF's repetition penalty: positive logits shrink, negative ones grow more negative.
    fn repeat(&self, x: f32) -> f32 {
        if x < 0.0 {
            x * self.repetition
        } else {
            x / self.repetition
        }
    }
}
