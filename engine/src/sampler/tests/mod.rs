//! Sampler tests: behaviour on hand-made logits, seeded statistical checks against the naive
//! reference in [`reference`], and a micro benchmark. All randomness is seeded, so a statistical
//! bound either always passes or always fails.

mod reference;

use cleave_protocol::TokenLogprob;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use self::reference::{reference_probs, surviving_set};
use super::*;

pub(super) fn sample_once(logits: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Sampled {
    Sampler::new(p, 7).sample(logits, p, prompt, output, &mut SamplerScratch::default()).unwrap()
}

fn params(temperature: f32) -> SamplingParams {
    SamplingParams { temperature, ..Default::default() }
}

fn random_logits(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() - 0.5) * scale).collect()
}

/// Draws `n` tokens at stream positions 0..n (no penalties, so the history is only a position)
/// and returns the count per token.
fn histogram(logits: &[f32], p: &SamplingParams, n: usize) -> Vec<usize> {
    let mut sampler = Sampler::new(p, 11);
    let mut scratch = SamplerScratch::default();
    let positions = vec![0u32; n];
    let mut counts = vec![0usize; logits.len()];
    for i in 0..n {
        counts[sampler.sample(logits, p, &[], &positions[..i], &mut scratch).unwrap().token as usize] += 1;
    }
    counts
}

/// Pearson's chi-square statistic of `counts` against `probs`; tokens with probability 0 must
/// never be drawn.
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    let mut chi = 0.0;
    for (&c, &pr) in counts.iter().zip(probs) {
        if pr == 0.0 {
            assert_eq!(c, 0, "drew a token of probability 0");
        } else {
            let e = pr * n as f64;
            chi += (c as f64 - e).powi(2) / e;
        }
    }
    chi
}

#[test]
fn empty_logits_is_an_error() {
    let p = params(1.0);
    let err = Sampler::new(&p, 0).sample(&[], &p, &[], &[], &mut SamplerScratch::default());
    assert_eq!(err, Err(SamplerError::EmptyLogits));
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for n in [1, 7, 64, 1000] {
        let logits = random_logits(&mut rng, n, 10.0);
        let want = logits.iter().enumerate().fold(0, |b, (i, &x)| if x > logits[b] { i } else { b });
        assert_eq!(sample_once(&logits, &params(0.0), &[], &[]).token, want as u32);
    }
    assert_eq!(sample_once(&[1.0, 3.0, 0.0, 3.0], &params(0.0), &[], &[]).token, 1);
}

#[test]
fn top_k_1_and_tiny_top_p_are_greedy() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (i, n) in [2, 50, 1000, 5000].into_iter().enumerate() {
        let logits = random_logits(&mut rng, n, 8.0);
        let greedy = sample_once(&logits, &params(0.0), &[], &[]).token;
        let top_k = SamplingParams { temperature: 1.5, top_k: 1, seed: Some(i as u64), ..Default::default() };
        let top_p = SamplingParams { temperature: 1.5, top_p: 1e-6, seed: Some(i as u64), ..Default::default() };
        for pos in 0..20 {
            let out = vec![0u32; pos];
            assert_eq!(sample_once(&logits, &top_k, &[], &out).token, greedy);
            assert_eq!(sample_once(&logits, &top_p, &[], &out).token, greedy);
        }
    }
}

#[test]
fn same_seed_same_tokens_and_a_resumed_sampler_continues_the_stream() {
    // A toy "model" whose logits depend on the history, so a divergence would compound.
    let model = |history: &[u32]| -> Vec<f32> {
        let last = history.last().copied().unwrap_or(0);
        (0..500u32)
            .map(|t| ((t.wrapping_mul(2_654_435_761) ^ last.wrapping_mul(40_503)) % 1000) as f32 / 250.0)
            .collect()
    };
    let p = SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(42), ..Default::default() };
    let generate = |p: &SamplingParams, start: &[u32], until: usize| {
        let mut sampler = Sampler::new(p, 0);
        let mut scratch = SamplerScratch::default();
        let mut out = start.to_vec();
        while out.len() < until {
            let logits = model(&out);
            out.push(sampler.sample(&logits, p, &[1, 2, 3], &out, &mut scratch).unwrap().token);
        }
        out
    };
    let a = generate(&p, &[], 200);
    assert_eq!(a, generate(&p, &[], 200));
    // A fresh sampler handed the seed and the first 120 tokens (a decode node) carries on.
    assert_eq!(a, generate(&p, &a[..120], 200));
    // The fallback seed is ignored when the request has one, and used when it has none.
    let unseeded = SamplingParams { seed: None, ..p.clone() };
    assert_eq!(Sampler::new(&p, 5).seed(), 42);
    assert_eq!(Sampler::new(&unseeded, 5).seed(), 5);
    let b = generate(&SamplingParams { seed: Some(43), ..p.clone() }, &[], 200);
    assert_ne!(a, b);
}

#[test]
fn different_seeds_give_different_streams_on_a_flat_distribution() {
    let logits = vec![0.0f32; 1000];
    let streams: Vec<Vec<u32>> = (0..5u64)
        .map(|seed| {
            let p = SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() };
            let mut sampler = Sampler::new(&p, 0);
            let mut scratch = SamplerScratch::default();
            let mut out = Vec::new();
            for _ in 0..32 {
                out.push(sampler.sample(&logits, &p, &[], &out, &mut scratch).unwrap().token);
            }
            out
        })
        .collect();
    for (i, a) in streams.iter().enumerate() {
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() >= 28, "seed {i}: only {} distinct of 32", distinct.len());
        for b in &streams[i + 1..] {
            let same = a.iter().zip(b).filter(|(x, y)| x == y).count();
            assert!(same <= 2, "two seeds agree on {same} of 32 positions");
        }
    }
}

#[test]
fn temperature_sampling_matches_softmax() {
    let logits = [1.0f32, 0.5, 0.0, -0.5, -1.0];
    for t in [0.7f32, 1.0, 2.0] {
        let p = params(t);
        let probs = reference_probs(&logits, &p, &[], &[]).unwrap();
        let counts = histogram(&logits, &p, 20_000);
        // 4 degrees of freedom: P(chi2 > 25) is about 5e-5.
        let chi = chi_square(&counts, &probs);
        assert!(chi < 25.0, "temperature {t}: chi-square {chi}, counts {counts:?}");
    }
}

#[test]
fn truncated_sampling_matches_the_reference_distribution() {
    let logits = [2.0f32, 1.5, 1.2, 1.0, 0.3, 0.0, -1.0, f32::NAN];
    let cases = [
        SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() },
        SamplingParams { temperature: 1.0, top_p: 0.8, ..Default::default() },
        SamplingParams { temperature: 0.8, min_p: 0.3, ..Default::default() },
        SamplingParams { temperature: 1.3, top_k: 5, top_p: 0.9, min_p: 0.2, ..Default::default() },
    ];
    for p in cases {
        let probs = reference_probs(&logits, &p, &[], &[]).unwrap();
        let counts = histogram(&logits, &p, 20_000);
        let dof = probs.iter().filter(|&&x| x > 0.0).count() - 1;
        let chi = chi_square(&counts, &probs);
        // Far above the 99.99th percentile for up to 6 degrees of freedom (about 27.9).
        assert!(chi < 30.0, "{p:?}: chi-square {chi} with {dof} dof, counts {counts:?}");
    }
}

#[test]
fn min_p_keeps_only_tokens_near_the_top() {
    // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps the first two (ratio 1 and 0.6).
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = SamplingParams { temperature: 1.0, min_p: 0.5, ..Default::default() };
    assert_eq!(surviving_set(&logits, &p, &[], &[]), vec![0, 1]);
    let counts = histogram(&logits, &p, 2000);
    assert!(counts[0] > 0 && counts[1] > 0 && counts[2] == 0 && counts[3] == 0, "{counts:?}");
}

#[test]
fn penalties_change_the_greedy_choice() {
    let logits = [2.0f32, 1.9, -5.0];
    let greedy = |p: SamplingParams, prompt: &[u32], output: &[u32]| sample_once(&logits, &p, prompt, output).token;
    let rep = SamplingParams { repetition_penalty: 1.2, ..Default::default() };
    assert_eq!(greedy(rep.clone(), &[], &[]), 0);
    assert_eq!(greedy(rep.clone(), &[0], &[]), 1, "2.0 / 1.2 < 1.9");
    assert_eq!(greedy(rep.clone(), &[0, 0, 0], &[0]), 1, "applied once, not per occurrence");
    // Negative logits are multiplied.
    let neg = [-1.0f32, -1.1];
    assert_eq!(sample_once(&neg, &rep, &[0], &[]).token, 1, "-1.0 * 1.2 < -1.1");
    let freq = SamplingParams { frequency_penalty: 0.06, ..Default::default() };
    assert_eq!(greedy(freq.clone(), &[], &[0]), 0, "2.0 - 0.06 > 1.9");
    assert_eq!(greedy(freq.clone(), &[], &[0, 0]), 1, "2.0 - 0.12 < 1.9");
    assert_eq!(greedy(freq.clone(), &[0, 0, 0], &[]), 0, "prompt tokens are not counted");
    let pres = SamplingParams { presence_penalty: 0.05, ..Default::default() };
    assert_eq!(greedy(pres.clone(), &[], &[0, 0, 0, 0]), 0, "presence does not scale with count");
    let pres = SamplingParams { presence_penalty: 0.2, ..Default::default() };
    assert_eq!(greedy(pres.clone(), &[], &[0]), 1);
    // A negative presence penalty encourages repeats.
    let pres = SamplingParams { presence_penalty: -0.2, ..Default::default() };
    assert_eq!(greedy(pres, &[], &[1]), 1);
    // Ids outside the vocabulary are ignored.
    assert_eq!(greedy(SamplingParams { frequency_penalty: 1.0, ..rep }, &[99], &[1000, 7]), 0);
}

#[test]
fn penalties_apply_before_temperature_and_filters() {
    let logits = [2.0f32, 1.9, 1.0];
    let p = SamplingParams { temperature: 0.5, top_k: 1, repetition_penalty: 1.2, ..Default::default() };
    assert_eq!(sample_once(&logits, &p, &[0], &[]).token, 1);
    let probs = reference_probs(&logits, &SamplingParams { top_k: 0, ..p.clone() }, &[0], &[]).unwrap();
    // e^((1.9 - 2/1.2) / 0.5) etc., renormalised.
    let s = [2.0 / 1.2 / 0.5, 1.9 / 0.5, 1.0 / 0.5f64];
    let z: f64 = s.iter().map(|x| x.exp()).sum();
    for (pr, x) in probs.iter().zip(s) {
        assert!((pr - x.exp() / z).abs() < 1e-6);
    }
}

#[test]
fn logprobs_are_log_softmax_of_raw_logits() {
    let logits = [1.0f32, 3.0, 0.5, 3.0, -2.0, f32::NAN];
    let m = 3.0f64;
    let log_z = m + logits[..5].iter().map(|&x| (f64::from(x) - m).exp()).sum::<f64>().ln();
    let want = |i: usize| (f64::from(logits[i]) - log_z) as f32;
    // Penalties and temperature change the draw but not the reported logprobs.
    let p = SamplingParams {
        temperature: 0.9,
        repetition_penalty: 1.5,
        logprobs: Some(3),
        seed: Some(3),
        ..Default::default()
    };
    let s = sample_once(&logits, &p, &[1], &[]);
    let lp = s.logprobs.unwrap();
    assert_eq!(lp.chosen.token_id, s.token);
    assert!((lp.chosen.logprob - want(s.token as usize)).abs() < 1e-5);
    let top: Vec<u32> = lp.top.iter().map(|t| t.token_id).collect();
    assert_eq!(top, vec![1, 3, 0], "sorted by logprob, lowest id first on ties");
    for t in &lp.top {
        assert!((t.logprob - want(t.token_id as usize)).abs() < 1e-5, "{t:?}");
    }
    // Asking for more than the vocabulary returns it all; the NaN token comes last at -inf.
    let all = sample_once(&logits, &SamplingParams { logprobs: Some(20), ..Default::default() }, &[], &[]);
    let all = all.logprobs.unwrap();
    assert_eq!(all.top.len(), 6);
    assert_eq!(all.top[5], TokenLogprob { token_id: 5, logprob: f32::NEG_INFINITY });
    let none = sample_once(&logits, &SamplingParams { logprobs: Some(0), ..Default::default() }, &[], &[]);
    assert!(none.logprobs.unwrap().top.is_empty());
    assert!(sample_once(&logits, &params(0.0), &[], &[]).logprobs.is_none());
}

#[test]
fn degenerate_logits_do_not_panic() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let ninf = f32::NEG_INFINITY;
    let with_lp =
        |t: f32| SamplingParams { temperature: t, top_p: 0.9, top_k: 2, logprobs: Some(2), ..Default::default() };
    for t in [0.0, 1.0] {
        // NaN is never chosen, +inf always wins, all-masked falls back to token 0.
        assert_eq!(sample_once(&[nan, 1.0, nan], &with_lp(t), &[], &[]).token, 1);
        assert_eq!(sample_once(&[1.0, inf, 2.0], &with_lp(t), &[], &[]).token, 1);
        let all_nan = sample_once(&[nan, nan, nan], &with_lp(t), &[], &[]);
        assert_eq!(all_nan.token, 0);
        let lp = all_nan.logprobs.unwrap();
        assert!((lp.chosen.logprob - -(3f32.ln())).abs() < 1e-6, "uniform when nothing is finite");
        assert_eq!(sample_once(&[ninf, ninf], &with_lp(t), &[], &[]).token, 0);
        // A penalty cannot resurrect a masked token.
        let pen = SamplingParams { repetition_penalty: 2.0, presence_penalty: -2.0, ..with_lp(t) };
        assert_eq!(sample_once(&[ninf, 0.0], &pen, &[0], &[0]).token, 1);
    }
    // Two +inf tokens share the mass.
    let logits = [inf, 0.0, inf, 5.0];
    let counts = histogram(&logits, &params(1.0), 400);
    assert!(counts[0] > 100 && counts[2] > 100 && counts[1] + counts[3] == 0, "{counts:?}");
    // Out-of-range parameters (refused by validation) still give a token.
    let wild = SamplingParams {
        temperature: f32::INFINITY,
        top_p: -1.0,
        min_p: 7.0,
        repetition_penalty: -1.0,
        frequency_penalty: nan,
        ..Default::default()
    };
    sample_once(&[1.0, 2.0, ninf], &wild, &[0], &[1]);
    sample_once(&[1.0, 2.0], &SamplingParams { temperature: nan, ..Default::default() }, &[], &[]);
    sample_once(&[1e30, -1e30], &SamplingParams { temperature: 1e-30, ..Default::default() }, &[], &[]);
}

/// `cargo test -p cleave-engine --release sampler::tests::bench -- --ignored --nocapture`
/// Logits: a Gaussian bulk (sd 2.5) with five strong candidates, a sharper variant (bulk sd
/// 1.5) and all-equal logits (the worst case for top-p: the nucleus is 90% of the vocabulary).
#[test]
#[ignore = "micro benchmark; run explicitly"]
fn bench_150k_vocab() {
    use std::time::Instant;
    const VOCAB: usize = 151_936;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut logits: Vec<f32> = (0..VOCAB)
        .map(|_| {
            let (a, b): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
            2.5 * (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
        })
        .collect();
    for i in 0..5 {
        logits[rng.random_range(0..VOCAB)] = 14.0 - i as f32;
    }
    // Sharper: bulk sd 1.5, so the nucleus holds few tokens.
    let peaked: Vec<f32> = logits.iter().map(|&x| if x > 9.0 { x } else { x * 0.6 }).collect();
    let flat = vec![0.0f32; VOCAB];
    let prompt: Vec<u32> = (0..1000).map(|_| rng.random_range(0..VOCAB as u32)).collect();
    let cases: [(&str, &[f32], SamplingParams); 12] = [
        ("greedy", &logits, params(0.0)),
        (
            "greedy + repetition 1.1, 1000-token prompt",
            &logits,
            SamplingParams { repetition_penalty: 1.1, ..params(0.0) },
        ),
        ("greedy logprobs=5", &logits, SamplingParams { logprobs: Some(5), ..params(0.0) }),
        ("t=1", &logits, params(1.0)),
        ("t=1 min_p=0.05", &logits, SamplingParams { min_p: 0.05, ..params(1.0) }),
        ("t=1 top_p=0.9", &logits, SamplingParams { top_p: 0.9, ..params(1.0) }),
        ("t=1 top_k=50", &logits, SamplingParams { top_k: 50, ..params(1.0) }),
        (
            "t=0.7 top_k=50 top_p=0.95 min_p=0.05 logprobs=5",
            &logits,
            SamplingParams { top_k: 50, top_p: 0.95, min_p: 0.05, logprobs: Some(5), ..params(0.7) },
        ),
        ("peaked t=1 top_p=0.9", &peaked, SamplingParams { top_p: 0.9, ..params(1.0) }),
        ("peaked t=0.7 top_p=0.95 top_k=50", &peaked, SamplingParams { top_p: 0.95, top_k: 50, ..params(0.7) }),
        ("flat logits t=1 top_p=0.9 (worst case)", &flat, SamplingParams { top_p: 0.9, ..params(1.0) }),
        ("flat logits t=1 top_k=1000", &flat, SamplingParams { top_k: 1000, ..params(1.0) }),
    ];
    let iters = 300;
    let mut copy = vec![0.0f32; VOCAB];
    let start = Instant::now();
    for _ in 0..iters {
        copy.copy_from_slice(std::hint::black_box(&logits));
        std::hint::black_box(&copy);
    }
    let floor = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
    #[cfg(target_arch = "x86_64")]
    println!(
        "avx512f {}, avx2 {}",
        std::arch::is_x86_feature_detected!("avx512f"),
        std::arch::is_x86_feature_detected!("avx2")
    );
    println!("vocab {VOCAB}: one pass over the logits ({} KiB) copies in {floor:.1} us", VOCAB * 4 / 1024);
    let mut scratch = SamplerScratch::default();
    for (name, l, p) in cases {
        let mut sampler = Sampler::new(&p, 1);
        let out: Vec<u32> = vec![0; iters];
        sampler.sample(l, &p, &prompt, &[], &mut scratch).unwrap();
        let start = Instant::now();
        for i in 0..iters {
            std::hint::black_box(sampler.sample(l, &p, &prompt, &out[..i % 4], &mut scratch).unwrap());
        }
        let us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
        println!("{name:<50} {us:>8.1} us/sample  ({:.1} x one copy pass)", us / floor);
    }
}
