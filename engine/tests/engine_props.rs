//! End-to-end properties of `EngineCore` on the real tiny-llama (CPU backend): what a request
//! produces must not depend on what else runs beside it, on how its prompt is chunked, on the
//! prefix cache, or on preemption; cancellation, stop strings, stop token ids and EOS end a
//! request exactly where they should; and no test leaves a KV block in use.
//!
//! Proptest runs few cases per property with a fixed seed and no persistence file, so the suite
//! is deterministic and stays well under a minute on two cores (about 15 s here).

mod common;

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Instant;

use cleave_engine::model::safetensors::SafetensorsSource;
use cleave_engine::model::{Model, ModelConfig, ModelFiles};
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::{FinishReason, RequestId, SamplingParams, StopConditions, TokenEvent};
use cleave_tokenizer::Tokenizer;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed};

/// Token ids drawn for prompts: past tiny-llama's specials (0..3), inside its 32000 ids.
const TOKENS: std::ops::Range<u32> = 3..32000;
/// KV bytes per block of tiny-llama at block size 1: K and V, 2 layers, 2 KV heads of 16, f32.
const KV_BYTES_PER_TOKEN: usize = 2 * 2 * 2 * 16 * 4;

fn proptest_config(cases: u32, seed: u64) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 32,
        ..ProptestConfig::default()
    }
}

/// An engine config with a KV cache of `blocks` blocks.
fn config(block_size: usize, blocks: usize, max_num_batched_tokens: usize, max_num_seqs: usize) -> EngineConfig {
    EngineConfig {
        block_size,
        kv_cache_memory: blocks * block_size * KV_BYTES_PER_TOKEN,
        max_num_batched_tokens,
        max_num_seqs,
        ..EngineConfig::default()
    }
}

/// A roomy default: 256 blocks of 16, 2048 tokens per step.
fn roomy() -> EngineConfig {
    config(16, 256, 2048, 64)
}

/// tiny-llama's config, tokenizer and EOS ids, read once: parsing the 1.8 MB `tokenizer.json`
/// is 90% of the cost of a fresh engine, and the tokenizer is immutable.
fn tiny_parts() -> &'static (ModelConfig, Tokenizer, Vec<u32>) {
    static PARTS: OnceLock<(ModelConfig, Tokenizer, Vec<u32>)> = OnceLock::new();
    PARTS.get_or_init(|| {
        let files = ModelFiles::open(&common::tiny_llama_dir()).unwrap();
        (files.config.clone(), files.tokenizer.clone(), files.eos_token_ids())
    })
}

/// A fresh tiny-llama engine (weights, KV cache and scheduler of its own).
fn tiny(cfg: EngineConfig) -> EngineCore<CpuBackend> {
    tiny_with_eos(cfg, tiny_parts().2.clone())
}

/// A fresh tiny-llama engine with EOS ids chosen by the test.
fn tiny_with_eos(cfg: EngineConfig, eos: Vec<u32>) -> EngineCore<CpuBackend> {
    let (config, tokenizer, _) = tiny_parts();
    let source = SafetensorsSource::open_dir(&common::tiny_llama_dir()).unwrap();
    let backend = CpuBackend::default();
    let model = Model::load(&backend, config.clone(), &source).unwrap();
    EngineCore::new(backend, model, tokenizer.clone(), eos, &cfg).unwrap()
}

fn request(id: u64, prompt: Vec<u32>, params: SamplingParams, stop: StopConditions) -> EngineRequest {
    EngineRequest { id: RequestId(id), prompt, params, stop }
}

/// Checks the shape of one request's stream (exactly one finish reason, on the last event, and
/// `completion_tokens` counting up) and returns its finish reason.
fn finish_of(id: u64, events: &[TokenEvent]) -> FinishReason {
    let last = events.last().unwrap_or_else(|| panic!("request {id}: no events"));
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.request_id, RequestId(id));
        assert_eq!(e.finish_reason.is_some(), i + 1 == events.len(), "request {id} event {i}: {e:?}");
    }
    let counts: Vec<u32> = events.iter().filter(|e| e.token_id.is_some()).map(|e| e.completion_tokens).collect();
    assert!(counts.iter().enumerate().all(|(i, &c)| c == i as u32 + 1), "request {id}: counts {counts:?}");
    last.finish_reason.unwrap()
}

fn assert_no_leak(core: &EngineCore<CpuBackend>) {
    assert!(!core.has_work());
    assert_eq!(core.scheduler().kv().num_in_use(), 0, "KV blocks still in use after every request ended");
    core.scheduler().kv().check_invariants().unwrap();
}

fn submit_all(core: &mut EngineCore<CpuBackend>, reqs: &[EngineRequest]) {
    for r in reqs {
        core.add_request(r.clone(), Instant::now()).unwrap();
    }
}

/// Runs `req` alone in a fresh engine with a roomy config.
fn alone(req: &EngineRequest) -> Vec<TokenEvent> {
    let mut core = tiny(roomy());
    core.add_request(req.clone(), Instant::now()).unwrap();
    let mut out = common::run_to_end(&mut core);
    assert_no_leak(&core);
    out.remove(&req.id.0).unwrap()
}

/// `n` prompts, some of them continuing a prefix of an earlier one.
fn prompts(n: std::ops::Range<usize>, len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec((prop::collection::vec(TOKENS, len), any::<Option<(usize, usize)>>()), n).prop_map(|raw| {
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(raw.len());
        for (own, share) in raw {
            let prompt = match share {
                Some((parent, cut)) if !out.is_empty() => {
                    let parent = &out[parent % out.len()];
                    let mut p = parent[..cut % (parent.len() + 1)].to_vec();
                    p.extend(own);
                    p
                }
                _ => own,
            };
            out.push(prompt);
        }
        out
    })
}

fn greedy(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    common::greedy_request(id, prompt, max_tokens)
}

fn sampled(id: u64, prompt: Vec<u32>, max_tokens: u32, params: SamplingParams) -> EngineRequest {
    request(id, prompt, params, StopConditions { max_tokens, ignore_eos: true, ..Default::default() })
}

/// Temperature 0.8, top_p 0.9, a seed, and sometimes the other filters and penalties (which read
/// the request's own prompt and output, so batching must not leak into them either).
fn sampling_params() -> impl Strategy<Value = SamplingParams> {
    (
        any::<u64>(),
        prop::sample::select(vec![0u32, 5, 50]),
        prop::sample::select(vec![0.0f32, 0.05]),
        prop::sample::select(vec![1.0f32, 1.3]),
        prop::sample::select(vec![0.0f32, 0.5]),
        prop::sample::select(vec![0.0f32, -0.5]),
    )
        .prop_map(|(seed, top_k, min_p, repetition_penalty, frequency_penalty, presence_penalty)| SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            top_k,
            min_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            seed: Some(seed),
            logprobs: None,
            constraint: None,
        })
}

proptest! {
    #![proptest_config(proptest_config(10, 0xc1ea_0001))]

    /// Requests submitted together, with a token budget small enough to chunk prompts and share
    /// steps, produce exactly what each produces alone.
    #[test]
    fn batched_equals_one_by_one(
        prompts in prompts(2..6, 1..40),
        max_tokens in prop::collection::vec(1u32..8, 6),
        budget in 4usize..24,
        block_size in prop::sample::select(vec![1usize, 4, 16]),
    ) {
        let reqs: Vec<EngineRequest> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = greedy(i as u64, p.clone(), max_tokens[i]);
                r.params.logprobs = Some(2);
                r
            })
            .collect();
        let mut core = tiny(config(block_size, 4096 / block_size, budget, budget.min(4)));
        submit_all(&mut core, &reqs);
        let together = common::run_to_end(&mut core);
        assert_no_leak(&core);
        for r in &reqs {
            let evs = &together[&r.id.0];
            let solo = alone(r);
            prop_assert_eq!(finish_of(r.id.0, evs), FinishReason::Length);
            prop_assert_eq!(common::token_ids(evs), common::token_ids(&solo), "request {}", r.id.0);
            // The logits themselves agree, not just their argmax.
            for (a, b) in evs.iter().zip(&solo) {
                let (a, b) = (&a.logprobs.as_ref().unwrap().chosen, &b.logprobs.as_ref().unwrap().chosen);
                prop_assert!((a.logprob - b.logprob).abs() <= 1e-4, "request {}: {:?} vs {:?}", r.id.0, a, b);
            }
        }
    }

    /// Seeded sampling (temperature 0.8, top_p 0.9, see [`sampling_params`]) repeats exactly,
    /// alone or batched.
    #[test]
    fn seeded_sampling_is_reproducible_and_batch_independent(
        prompts in prompts(2..5, 1..30),
        params in prop::collection::vec(sampling_params(), 5),
        budget in 4usize..16,
    ) {
        let reqs: Vec<EngineRequest> =
            prompts.iter().enumerate().map(|(i, p)| sampled(i as u64, p.clone(), 8, params[i].clone())).collect();
        let mut core = tiny(config(4, 1024, budget, budget.min(4)));
        submit_all(&mut core, &reqs);
        let together = common::run_to_end(&mut core);
        assert_no_leak(&core);
        for r in &reqs {
            let first = common::token_ids(&alone(r));
            prop_assert_eq!(&first, &common::token_ids(&alone(r)), "request {} alone twice", r.id.0);
            prop_assert_eq!(&first, &common::token_ids(&together[&r.id.0]), "request {} batched", r.id.0);
        }
    }

    /// A prompt served from the prefix cache gives the same tokens and logprobs as computed in
    /// full, and so does an engine without prefix caching.
    #[test]
    fn prefix_cache_hit_equals_miss(
        prompt in prop::collection::vec(TOKENS, 1..40),
        block_size in prop::sample::select(vec![1usize, 4, 16]),
        budget in 8usize..64,
        whole_blocks in any::<bool>(),
    ) {
        // A prompt of whole blocks is a full hit: its last block must be copied on write.
        let mut prompt = prompt;
        if whole_blocks && prompt.len() >= block_size {
            prompt.truncate(prompt.len() / block_size * block_size);
        }
        let params = SamplingParams { logprobs: Some(3), ..SamplingParams::default() };
        let stop = StopConditions { max_tokens: 5, ignore_eos: true, ..Default::default() };
        let mut core = tiny(config(block_size, 4096 / block_size, budget, 4));
        let mut runs = Vec::new();
        for id in 0..2 {
            core.add_request(request(id, prompt.clone(), params.clone(), stop.clone()), Instant::now()).unwrap();
            let mut out = common::run_to_end(&mut core);
            assert_no_leak(&core);
            runs.push(out.remove(&id).unwrap());
        }
        let mut plain = tiny(EngineConfig { enable_prefix_caching: false, ..config(block_size, 4096 / block_size, budget, 4) });
        plain.add_request(request(2, prompt.clone(), params.clone(), stop.clone()), Instant::now()).unwrap();
        runs.push(common::run_to_end(&mut plain).remove(&2).unwrap());
        assert_no_leak(&plain);

        let full_blocks = (prompt.len() / block_size) * block_size;
        prop_assert_eq!(runs[0][0].cached_tokens, 0);
        prop_assert_eq!(runs[1][0].cached_tokens as usize, full_blocks.min(prompt.len() - 1));
        prop_assert_eq!(runs[2][0].cached_tokens, 0);
        for run in &runs[1..] {
            prop_assert_eq!(common::token_ids(run), common::token_ids(&runs[0]));
            // Bitwise equal on this machine's kernels; a tolerance keeps the property about the
            // cache rather than about how a kernel's summation order depends on the batch size.
            for (a, b) in run.iter().zip(&runs[0]) {
                let (a, b) = (a.logprobs.as_ref().unwrap(), b.logprobs.as_ref().unwrap());
                prop_assert_eq!(a.chosen.token_id, b.chosen.token_id);
                let ids = |l: &cleave_protocol::Logprobs| l.top.iter().map(|t| t.token_id).collect::<Vec<_>>();
                prop_assert_eq!(ids(a), ids(b));
                for (x, y) in std::iter::once((&a.chosen, &b.chosen)).chain(a.top.iter().zip(&b.top)) {
                    prop_assert!((x.logprob - y.logprob).abs() <= 1e-5, "{:?} vs {:?}", a, b);
                }
            }
        }
    }

    /// With a KV cache of 12 blocks of 4 and four prompts of 9..=12 tokens, all four are
    /// admitted and then cannot all grow: the scheduler must preempt, and the greedy outputs stay
    /// those of each request alone.
    #[test]
    fn preemption_keeps_greedy_outputs(
        prompts in prop::collection::vec(prop::collection::vec(TOKENS, 9..=12), 4),
        max_tokens in prop::collection::vec(5u32..20, 4),
        prefix_caching in any::<bool>(),
    ) {
        let reqs: Vec<EngineRequest> =
            prompts.iter().enumerate().map(|(i, p)| greedy(i as u64, p.clone(), max_tokens[i])).collect();
        let mut core = tiny(EngineConfig { enable_prefix_caching: prefix_caching, ..config(4, 12, 64, 4) });
        submit_all(&mut core, &reqs);
        let together = common::run_to_end(&mut core);
        assert_no_leak(&core);
        prop_assert!(core.scheduler().num_preemptions() > 0, "the pool was meant to force a preemption");
        for r in &reqs {
            let evs = &together[&r.id.0];
            prop_assert_eq!(finish_of(r.id.0, evs), FinishReason::Length);
            prop_assert_eq!(common::token_ids(evs), common::token_ids(&alone(r)), "request {}", r.id.0);
        }
    }

    /// Aborting a request after any number of steps ends it with one final `Cancelled` event
    /// (unless it had already finished), frees its blocks and leaves the others untouched.
    #[test]
    fn cancellation_frees_and_reports(
        prompts in prompts(3..4, 1..30),
        steps_before in 0usize..12,
        victim in 0u64..3,
    ) {
        let reqs: Vec<EngineRequest> =
            prompts.iter().enumerate().map(|(i, p)| greedy(i as u64, p.clone(), 8)).collect();
        let mut core = tiny(config(4, 256, 8, 4));
        submit_all(&mut core, &reqs);
        let mut events: BTreeMap<u64, Vec<TokenEvent>> = BTreeMap::new();
        let now = Instant::now();
        for _ in 0..steps_before {
            for e in core.step(now).unwrap() {
                events.entry(e.request_id.0).or_default().push(e);
            }
        }
        let finished_before = events.get(&victim).is_some_and(|v| v.iter().any(|e| e.finish_reason.is_some()));
        core.abort(RequestId(victim));
        // Aborting twice, or an unknown id, is harmless.
        core.abort(RequestId(victim));
        core.abort(RequestId(999));
        for (id, evs) in common::run_to_end(&mut core) {
            events.entry(id).or_default().extend(evs);
        }
        assert_no_leak(&core);
        let evs = &events[&victim];
        let reason = finish_of(victim, evs);
        if finished_before {
            prop_assert_eq!(reason, FinishReason::Length);
        } else {
            prop_assert_eq!(reason, FinishReason::Cancelled);
            let last = evs.last().unwrap();
            prop_assert_eq!(last.token_id, None);
            prop_assert!(last.text.is_empty());
            prop_assert!(evs.len() <= 8, "at most max_tokens tokens, then the final event");
        }
        let full = common::token_ids(&alone(&reqs[victim as usize]));
        prop_assert!(full.starts_with(&common::token_ids(evs)), "tokens before the abort are the real ones");
        for r in reqs.iter().filter(|r| r.id.0 != victim) {
            let evs = &events[&r.id.0];
            prop_assert_eq!(finish_of(r.id.0, evs), FinishReason::Length);
            prop_assert_eq!(common::token_ids(evs), common::token_ids(&alone(r)));
        }
    }
}

/// One client action in [`random_interleavings_keep_every_promise`].
#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt: Vec<u32>,
        max_tokens: u32,
        seed: Option<u64>,
    },
    Steps(u8),
    /// Abort one of the requests added so far (any state: waiting, running, finished).
    Abort(prop::sample::Index),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    // Prompts continue one of two shared stems, so prefix hits happen between live requests.
    let stem: Vec<u32> = (0..16).map(|i| 1000 + 17 * i).collect();
    let add = (0usize..17, prop::collection::vec(TOKENS, 1..8), 1u32..8, prop::option::of(any::<u64>())).prop_map(
        move |(cut, own, max_tokens, seed)| {
            let prompt = [&stem[..cut], &own[..]].concat();
            Op::Add { prompt, max_tokens, seed }
        },
    );
    let op =
        prop_oneof![5 => add, 2 => (1u8..4).prop_map(Op::Steps), 1 => any::<prop::sample::Index>().prop_map(Op::Abort)];
    prop::collection::vec(op, 6..24)
}

proptest! {
    #![proptest_config(proptest_config(10, 0xc1ea_0003))]

    /// Adds, steps and aborts in any order, on a pool small enough to preempt, with or without
    /// prefix caching: every request gets exactly one final event; one never aborted (or
    /// aborted after it ended) produces what it produces alone; an aborted one ends `Cancelled`
    /// after a prefix of that; and no block stays in use.
    #[test]
    fn random_interleavings_keep_every_promise(
        ops in ops(),
        blocks in 8usize..14,
        budget in 6usize..32,
        prefix_caching in any::<bool>(),
    ) {
        let cfg = EngineConfig { enable_prefix_caching: prefix_caching, ..config(4, blocks, budget, 6) };
        let mut core = tiny(cfg);
        let now = Instant::now();
        let mut reqs: Vec<EngineRequest> = Vec::new();
        let mut aborted_live = std::collections::BTreeSet::new();
        let mut events: BTreeMap<u64, Vec<TokenEvent>> = BTreeMap::new();
        let record = |evs: Vec<TokenEvent>, events: &mut BTreeMap<u64, Vec<TokenEvent>>| {
            for e in evs {
                events.entry(e.request_id.0).or_default().push(e);
            }
        };
        for op in ops {
            match op {
                Op::Add { prompt, max_tokens, seed } => {
                    let id = reqs.len() as u64;
                    let req = match seed {
                        None => greedy(id, prompt, max_tokens),
                        Some(seed) => {
                            let params = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(seed), ..SamplingParams::default() };
                            sampled(id, prompt, max_tokens, params)
                        }
                    };
                    core.add_request(req.clone(), now).unwrap();
                    reqs.push(req);
                }
                Op::Steps(n) => {
                    for _ in 0..n {
                        record(core.step(now).unwrap(), &mut events);
                    }
                }
                Op::Abort(i) if !reqs.is_empty() => {
                    let id = reqs[i.index(reqs.len())].id.0;
                    let ended = events.get(&id).is_some_and(|v| v.iter().any(|e| e.finish_reason.is_some()));
                    if !ended {
                        aborted_live.insert(id);
                    }
                    core.abort(RequestId(id));
                }
                Op::Abort(_) => {}
            }
        }
        record(common::run_to_end(&mut core).into_values().flatten().collect(), &mut events);
        assert_no_leak(&core);
        for r in &reqs {
            let id = r.id.0;
            let evs = events.get(&id).map(Vec::as_slice).unwrap_or_default();
            let reason = finish_of(id, evs);
            let solo = common::token_ids(&alone(r));
            if aborted_live.contains(&id) {
                prop_assert_eq!(reason, FinishReason::Cancelled, "request {}", id);
                prop_assert!(solo.starts_with(&common::token_ids(evs)), "request {}", id);
            } else {
                prop_assert_eq!(reason, FinishReason::Length, "request {}", id);
                prop_assert_eq!(common::token_ids(evs), solo, "request {}", id);
            }
        }
    }
}

/// The greedy output of `prompt` without stops: (tokens, text as streamed).
fn unstopped(prompt: &[u32], max_tokens: u32) -> (Vec<u32>, String) {
    let evs = alone(&greedy(0, prompt.to_vec(), max_tokens));
    (common::token_ids(&evs), common::text(&evs))
}

/// Byte offsets of the char boundaries of `s`, its length included.
fn boundaries(s: &str) -> Vec<usize> {
    s.char_indices().map(|(i, _)| i).chain([s.len()]).collect()
}

proptest! {
    #![proptest_config(proptest_config(12, 0xc1ea_0002))]

    /// A stop string cut from the unstopped output ends the request at its first occurrence:
    /// the streamed text is exactly the text before it (nothing of it leaks, nothing before it is
    /// lost), the tokens are a prefix of the unstopped ones, and the reason is `Stop`.
    #[test]
    fn stop_strings_end_at_the_first_match(
        prompt in prop::collection::vec(TOKENS, 1..20),
        start in any::<prop::sample::Index>(),
        len in 1usize..6,
    ) {
        let (tokens, text) = unstopped(&prompt, 16);
        let b = boundaries(&text);
        prop_assume!(b.len() > 1);
        let s = start.index(b.len() - 1);
        let e = b[(s + len).min(b.len() - 1)];
        let stop_str = text[b[s]..e].to_string();
        let cut = text.find(&stop_str).unwrap();

        let stop = StopConditions { max_tokens: 16, stop_strings: vec![stop_str.clone()], ignore_eos: true, ..Default::default() };
        let mut core = tiny(roomy());
        core.add_request(request(1, prompt.clone(), SamplingParams::default(), stop), Instant::now()).unwrap();
        let evs = common::run_to_end(&mut core).remove(&1).unwrap();
        assert_no_leak(&core);
        prop_assert_eq!(finish_of(1, &evs), FinishReason::Stop);
        prop_assert_eq!(common::text(&evs), &text[..cut], "stop string {:?}", stop_str);
        let got = common::token_ids(&evs);
        prop_assert!(tokens.starts_with(&got));
    }

    /// A stop string whose start matches the end of the output but which never completes is held
    /// back while it might match and released in full when the request ends by length.
    #[test]
    fn partial_stop_match_is_released_at_the_end(
        prompt in prop::collection::vec(TOKENS, 1..20),
        tail_chars in 1usize..4,
    ) {
        let (tokens, text) = unstopped(&prompt, 10);
        let b = boundaries(&text);
        prop_assume!(b.len() > 1);
        let tail = &text[b[b.len() - 1 - tail_chars.min(b.len() - 1)]..];
        let stop_str = format!("{tail}\u{1}never");
        let stop = StopConditions { max_tokens: 10, stop_strings: vec![stop_str], ignore_eos: true, ..Default::default() };
        let mut core = tiny(roomy());
        core.add_request(request(1, prompt.clone(), SamplingParams::default(), stop), Instant::now()).unwrap();
        let evs = common::run_to_end(&mut core).remove(&1).unwrap();
        assert_no_leak(&core);
        prop_assert_eq!(finish_of(1, &evs), FinishReason::Length);
        prop_assert_eq!(common::text(&evs), text);
        prop_assert_eq!(common::token_ids(&evs), tokens);
    }

    /// A stop token id ends the request right after its first occurrence (the token included);
    /// an EOS id does the same unless `ignore_eos`.
    #[test]
    fn stop_token_ids_and_eos(
        prompt in prop::collection::vec(TOKENS, 1..20),
        pick in any::<prop::sample::Index>(),
    ) {
        let (tokens, _) = unstopped(&prompt, 12);
        let token = tokens[pick.index(tokens.len())];
        let first = tokens.iter().position(|&t| t == token).unwrap();
        let base = StopConditions { max_tokens: 12, ..Default::default() };

        // As a stop token id (EOS ignored, the model's own EOS could otherwise end it early).
        let stop = StopConditions { stop_token_ids: vec![token], ignore_eos: true, ..base.clone() };
        let mut core = tiny(roomy());
        core.add_request(request(1, prompt.clone(), SamplingParams::default(), stop), Instant::now()).unwrap();
        let evs = common::run_to_end(&mut core).remove(&1).unwrap();
        assert_no_leak(&core);
        prop_assert_eq!(finish_of(1, &evs), FinishReason::Stop);
        prop_assert_eq!(common::token_ids(&evs), &tokens[..=first]);

        // As the model's only EOS id.
        for ignore_eos in [false, true] {
            let mut core = tiny_with_eos(roomy(), vec![token]);
            let stop = StopConditions { ignore_eos, ..base.clone() };
            core.add_request(request(2, prompt.clone(), SamplingParams::default(), stop), Instant::now()).unwrap();
            let evs = common::run_to_end(&mut core).remove(&2).unwrap();
            assert_no_leak(&core);
            if ignore_eos {
                prop_assert_eq!(finish_of(2, &evs), FinishReason::Length);
                prop_assert_eq!(common::token_ids(&evs), tokens.clone());
            } else {
                prop_assert_eq!(finish_of(2, &evs), FinishReason::Stop);
                prop_assert_eq!(common::token_ids(&evs), &tokens[..=first]);
            }
        }
    }
}

/// Aborting a request still waiting for its first step reports `Cancelled` with no token.
#[test]
fn abort_before_the_first_step() {
    let mut core = tiny(roomy());
    core.add_request(greedy(5, vec![10, 20, 30], 4), Instant::now()).unwrap();
    core.abort(RequestId(5));
    let evs = common::run_to_end(&mut core).remove(&5).unwrap();
    assert_no_leak(&core);
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].finish_reason, Some(FinishReason::Cancelled));
    assert_eq!(evs[0].token_id, None);
    assert_eq!(evs[0].prompt_tokens, 3);
}

/// Bad requests are refused without side effects.
#[test]
fn bad_requests_are_refused_cleanly() {
    let mut core = tiny(roomy());
    let e = core.add_request(greedy(1, vec![5, 32000], 4), Instant::now()).unwrap_err();
    assert!(e.to_string().contains("32000"), "{e}");
    let bad = SamplingParams { top_p: 0.0, ..SamplingParams::default() };
    let e = core
        .add_request(request(2, vec![5], bad, StopConditions { max_tokens: 4, ..Default::default() }), Instant::now())
        .unwrap_err();
    assert!(e.to_string().contains("top_p"), "{e}");
    assert!(core.add_request(greedy(3, vec![], 4), Instant::now()).is_err(), "empty prompt");
    assert!(core.add_request(greedy(4, vec![5], 0), Instant::now()).is_err(), "max_tokens 0");
    assert!(!core.has_work());
    assert_no_leak(&core);

    // Longer than max_model_len, or than the whole KV cache.
    let mut core = tiny(EngineConfig { max_model_len: Some(20), ..config(4, 4, 64, 4) });
    let e = core.add_request(greedy(1, vec![5; 15], 6), Instant::now()).unwrap_err();
    assert!(e.to_string().contains("20"), "{e}");
    let e = core.add_request(greedy(2, vec![5; 15], 2), Instant::now()).unwrap_err();
    assert!(e.to_string().contains("block"), "{e}");
    assert!(!core.has_work());

    // A duplicate id is refused and the first request is unharmed.
    let mut core = tiny(roomy());
    let first = greedy(7, vec![11, 12, 13], 5);
    core.add_request(first.clone(), Instant::now()).unwrap();
    let dup = greedy(7, vec![99], 2);
    assert!(core.add_request(dup, Instant::now()).is_err(), "duplicate id");
    let evs = common::run_to_end(&mut core).remove(&7).unwrap();
    assert_no_leak(&core);
    assert_eq!(common::token_ids(&evs), common::token_ids(&alone(&first)));
}

/// The same prompt many times, arriving while the first copies still prefill (small budget),
/// with a length that is a whole number of blocks (so a full hit must copy-on-write the last
/// block): each copy gives what it gives alone, and later copies hit the cache.
#[test]
fn identical_prompts_share_blocks_and_match_alone() {
    let prompt: Vec<u32> = (0..12).map(|i| 100 + 37 * i).collect();
    let mut core = tiny(config(4, 64, 6, 6));
    let mut reqs = Vec::new();
    let now = Instant::now();
    let mut events: BTreeMap<u64, Vec<TokenEvent>> = BTreeMap::new();
    for id in 0..6u64 {
        let req = if id % 2 == 0 {
            greedy(id, prompt.clone(), 6)
        } else {
            let params = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(id), ..SamplingParams::default() };
            sampled(id, prompt.clone(), 6, params)
        };
        core.add_request(req.clone(), now).unwrap();
        reqs.push(req);
        // Stagger arrivals: one or two steps between requests.
        for _ in 0..(1 + id % 2) {
            for e in core.step(now).unwrap() {
                events.entry(e.request_id.0).or_default().push(e);
            }
        }
    }
    for (id, evs) in common::run_to_end(&mut core) {
        events.entry(id).or_default().extend(evs);
    }
    assert_no_leak(&core);
    for r in &reqs {
        let evs = &events[&r.id.0];
        assert_eq!(finish_of(r.id.0, evs), FinishReason::Length);
        assert_eq!(common::token_ids(evs), common::token_ids(&alone(r)), "request {}", r.id.0);
    }
    let cached: Vec<u32> = reqs.iter().map(|r| events[&r.id.0][0].cached_tokens).collect();
    assert_eq!(cached[0], 0);
    assert!(cached.contains(&11), "a full hit (all but the last token): {cached:?}");
}
