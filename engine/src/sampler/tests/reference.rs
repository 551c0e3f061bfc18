//! A naive reference sampler (f64 softmax, full sort, HF-style filters with ties kept) and the
//! randomised comparison of the sampler's surviving set against it.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::super::*;
use super::{random_logits, sample_once};

/// The reference distribution after penalties, temperature and truncation, or `None` when an
/// f32-vs-f64 rounding difference could move a filter boundary (a near-tie at top-k, a
/// cumulative mass within 1e-5 of top-p's target, a ratio within 1e-5 of min-p).
pub(super) fn reference_probs(logits: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Option<Vec<f64>> {
    reference(logits, p, prompt, output).map(|(probs, _)| probs)
}

/// [`reference_probs`] and the relative weights `e^(s_i - max)` before truncation.
fn reference(logits: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Option<(Vec<f64>, Vec<f64>)> {
    let clean = |x: f32| {
        if x.is_nan() {
            f64::NEG_INFINITY
        } else {
            f64::from(x.min(f32::MAX))
        }
    };
    let mut s: Vec<f64> = logits.iter().map(|&x| clean(x)).collect();
    let mut seen: Vec<u32> = prompt.iter().chain(output).copied().filter(|&t| (t as usize) < s.len()).collect();
    seen.sort_unstable();
    seen.dedup();
    for &t in &seen {
        let x = s[t as usize];
        let r = f64::from(p.repetition_penalty);
        s[t as usize] = if x < 0.0 { x * r } else { x / r };
    }
    let mut counts: HashMap<u32, f64> = HashMap::new();
    for &t in output.iter().filter(|&&t| (t as usize) < s.len()) {
        *counts.entry(t).or_default() += 1.0;
    }
    for (&t, &c) in &counts {
        s[t as usize] -= c * f64::from(p.frequency_penalty) + f64::from(p.presence_penalty);
    }
    let mut probs = vec![0.0; s.len()];
    if p.temperature == 0.0 {
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        probs[s.iter().position(|&x| x == m).unwrap()] = 1.0;
        return Some((probs.clone(), probs));
    }
    let s: Vec<f64> = s.iter().map(|&x| x / f64::from(p.temperature)).collect();
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    for (pr, &x) in probs.iter_mut().zip(&s) {
        *pr = (x - m).exp();
    }
    let weights = probs.clone();
    let mut order: Vec<usize> = (0..s.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let near = |a: f64, b: f64| (a - b).abs() <= 1e-5 * a.abs().max(b.abs());
    // Near-ties at a threshold are ambiguous unless they are exact and untouched by penalties
    // (the sampler applies penalties in f32 after scaling, so those ties can split by an ulp).
    let penalised = p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
    let touched = |i: usize| penalised && seen.binary_search(&(i as u32)).is_ok();
    let blurred = |theta: f64| {
        let close: Vec<usize> = (0..weights.len()).filter(|&i| near(weights[i], theta)).collect();
        close.len() > 1 && close.iter().any(|&i| weights[i] != theta || touched(i))
    };
    if p.top_k > 0 && (p.top_k as usize) < s.len() {
        let k = p.top_k as usize;
        let kth = probs[order[k - 1]];
        if blurred(kth) {
            return None;
        }
        probs.iter_mut().filter(|pr| **pr < kth).for_each(|pr| *pr = 0.0);
    }
    if p.top_p < 1.0 {
        let target = f64::from(p.top_p) * probs.iter().sum::<f64>();
        let mut acc = 0.0;
        let mut theta = 0.0;
        for &i in &order {
            acc += probs[i];
            if near(acc, target) {
                return None;
            }
            if acc >= target {
                theta = probs[i];
                break;
            }
        }
        if blurred(theta) {
            return None;
        }
        probs.iter_mut().filter(|pr| **pr < theta).for_each(|pr| *pr = 0.0);
    }
    if p.min_p > 0.0 {
        let min_p = f64::from(p.min_p);
        // Weight 1 (the maximum) is exact on both sides unless a penalty produced it.
        let exact = |i: usize| probs[i] == 1.0 && !touched(i);
        if (0..probs.len()).any(|i| probs[i] > 0.0 && near(probs[i], min_p) && !exact(i)) {
            return None;
        }
        probs.iter_mut().filter(|pr| **pr < min_p).for_each(|pr| *pr = 0.0);
    }
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|pr| *pr /= z);
    Some((probs, weights))
}

/// The set of tokens the sampler may draw from (temperature > 0), read from its internals.
pub(super) fn surviving_set(logits: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Vec<u32> {
    let mut s = SamplerScratch::default();
    s.penalised(logits, &Penalties::new(p), History { prompt, output }, 1.0 / p.temperature);
    let m = math::max(&s.work);
    let total = math::exp_weights(&mut s.work, m, &mut s.chunk_sums);
    let f = Filters::new(p.top_k, p.top_p, p.min_p, logits.len());
    if !f.any() {
        return (0..logits.len() as u32).filter(|&i| s.work[i as usize] > 0.0).collect();
    }
    math::chunk_maxima(&s.work, &mut s.chunk_max);
    let w = Weights { w: &s.work, chunk_max: &s.chunk_max, total };
    let theta = filter::threshold(&w, &f, &mut s.threshold);
    (0..logits.len() as u32).filter(|&i| s.work[i as usize] >= theta && s.work[i as usize] > 0.0).collect()
}

/// Randomised comparison of the surviving set with the naive reference, over vocabulary sizes,
/// logit shapes (spread, peaked, flat, quantised with ties, masked entries) and filter mixes.
#[test]
fn surviving_set_matches_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(20_240_601);
    let (mut checked, mut ambiguous) = (0, 0);
    for case in 0..600 {
        let vocab = [1, 2, 5, 37, 64, 65, 200, 1000, 5000][rng.random_range(0..9)];
        let vocab = if case % 150 == 0 { 150_000 } else { vocab };
        let scale = [0.5, 4.0, 12.0, 40.0][rng.random_range(0..4)];
        let mut logits = random_logits(&mut rng, vocab, scale);
        match rng.random_range(0..4) {
            0 => logits.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0),
            1 => logits[rng.random_range(0..vocab)] += 15.0,
            2 => {
                for _ in 0..vocab / 10 {
                    logits[rng.random_range(0..vocab)] = if rng.random() { f32::NAN } else { f32::NEG_INFINITY };
                }
            }
            _ => {}
        }
        let p = SamplingParams {
            temperature: [0.3f32, 0.7, 1.0, 1.5][rng.random_range(0..4)],
            top_k: [0u32, 0, 1, 2, 5, 50, vocab as u32 - 1, vocab as u32 + 3][rng.random_range(0..8)],
            top_p: [1.0f32, 1.0, 0.999, 0.9, 0.5, 0.1, 1e-6][rng.random_range(0..7)],
            min_p: [0.0f32, 0.0, 1e-4, 0.01, 0.1, 0.5, 1.0][rng.random_range(0..7)],
            repetition_penalty: [1.0f32, 1.17][rng.random_range(0..2)],
            frequency_penalty: [0.0f32, 0.37][rng.random_range(0..2)],
            presence_penalty: [0.0f32, -0.61][rng.random_range(0..2)],
            ..Default::default()
        };
        let prompt: Vec<u32> = (0..5).map(|_| rng.random_range(0..vocab as u32 + 2)).collect();
        let output: Vec<u32> = (0..8).map(|_| rng.random_range(0..vocab as u32)).collect();
        let Some((probs, weights)) = reference(&logits, &p, &prompt, &output) else {
            ambiguous += 1;
            continue;
        };
        // Tokens below e^-87 of the top underflow to weight 0 in f32 and cannot be drawn:
        // compare only tokens well above that.
        let visible = |i: &u32| weights[*i as usize] > 1e-36;
        let want: Vec<u32> = (0..vocab as u32).filter(|&i| probs[i as usize] > 0.0).filter(visible).collect();
        let got: Vec<u32> = surviving_set(&logits, &p, &prompt, &output).into_iter().filter(visible).collect();
        assert_eq!(got, want, "case {case}: vocab {vocab}, {p:?}");
        let token = sample_once(&logits, &p, &prompt, &output).token;
        assert!(probs[token as usize] > 0.0, "case {case}: drew {token} of probability 0");
        checked += 1;
    }
    assert!(checked > 500, "only {checked} cases checked, {ambiguous} ambiguous");
}
