//! Log-probabilities reported to the client: `log_softmax` of the *raw* model logits, before
//! penalties, temperature and truncation (vLLM's default "raw logprobs" mode). They describe what
//! the model predicted, not the distribution the token was drawn from, so a token chosen under
//! top-k or a penalty can have a low reported logprob, and they do not change with the seed.

use cleave_protocol::{Logprobs, TokenLogprob};

use super::math::{chunk_maxima, max, sanitize, sum_exp, CHUNK};

/// Computes the chosen token's logprob and the `n` most likely alternatives (sorted by logprob
/// descending, lowest id first on ties) from raw `logits`.
///
/// Conventions for degenerate logits: a NaN logit counts as `-inf` (logprob `-inf`), a `+inf`
/// one as `f32::MAX` (so several `+inf` tokens share the mass equally); when no logit is finite
/// or `+inf`, the distribution is taken as uniform (`-ln(vocab)` for every token). `n` is capped
/// at the vocabulary size; `top` and `maxima` are scratch.
///
/// Precondition: `logits` is non-empty and `chosen < logits.len()`.
pub(super) fn raw_logprobs(
    logits: &[f32],
    chosen: u32,
    n: usize,
    top: &mut Vec<(f32, u32)>,
    maxima: &mut Vec<f32>,
) -> Logprobs {
    let m = sanitize(max(logits));
    let uniform = m == f32::NEG_INFINITY;
    let log_z = if uniform { 0.0 } else { sum_exp(logits, m).ln() };
    let logprob = |x: f32| -> f32 {
        if uniform {
            -(logits.len() as f64).ln() as f32
        } else {
            (f64::from(sanitize(x) - m) - log_z) as f32
        }
    };

    // Top-n by one scan, keeping `top` sorted (value descending, id ascending). Ids arrive in
    // ascending order, so a new value only displaces strictly smaller ones; a chunk whose
    // maximum cannot displace anything is skipped.
    let n = n.min(logits.len());
    let displaces = |top: &Vec<(f32, u32)>, v: f32| top.len() < n || top.last().is_some_and(|&(last, _)| v > last);
    top.clear();
    if n > 0 {
        chunk_maxima(logits, maxima);
        for (ci, (chunk, &cmax)) in logits.chunks(CHUNK).zip(maxima.iter()).enumerate() {
            if !displaces(top, sanitize(cmax)) {
                continue;
            }
            for (j, &x) in chunk.iter().enumerate() {
                let v = sanitize(x);
                if displaces(top, v) {
                    let at = top.iter().position(|&(t, _)| t < v).unwrap_or(top.len());
                    top.insert(at, (v, (ci * CHUNK + j) as u32));
                    top.truncate(n);
                }
            }
        }
    }

    Logprobs {
        chosen: TokenLogprob { token_id: chosen, logprob: logprob(logits[chosen as usize]) },
        top: top.iter().map(|&(v, id)| TokenLogprob { token_id: id, logprob: logprob(v) }).collect(),
    }
}
