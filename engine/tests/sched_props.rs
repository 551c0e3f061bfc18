//! End-to-end properties of the scheduler and the KV block manager, driven by a fake model.
//!
//! The fake model keeps its own "KV cache": one `(token, position)` per slot. Each step it
//! executes the batch's block copies, writes every fed token at the slot its item names, then,
//! for each sampled item, reads the whole context back *through the block table* and maps it
//! to the next token with a hash of all of it. So a wrong block table, slot, copy, prefix-cache
//! hit or preemption shows up as a different output than the naive reference (the same hash
//! applied to the request's own history, which is what the request would produce alone with an
//! unlimited pool).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cleave_engine::sched::{Batch, SchedError, Scheduler, SchedulerConfig, SeqRequest};
use cleave_protocol::FinishReason;
use proptest::prelude::*;

const VOCAB: u32 = 48;
const EOS: u32 = 0;

/// The fake model: next token of a context.
fn next_token(ctx: &[u32]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in ctx {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    ((h ^ (h >> 29)) % u64::from(VOCAB)) as u32
}

/// Naive reference: the request run alone.
fn reference(r: &SeqRequest) -> (Vec<u32>, FinishReason) {
    let mut ctx = r.prompt.clone();
    let mut out = Vec::new();
    loop {
        let t = next_token(&ctx);
        ctx.push(t);
        out.push(t);
        if r.stop_token_ids.contains(&t) || (!r.ignore_eos && r.eos_token_ids.contains(&t)) {
            return (out, FinishReason::Stop);
        }
        if out.len() >= r.max_tokens as usize {
            return (out, FinishReason::Length);
        }
    }
}

struct FakeModel {
    block_size: usize,
    slots: Vec<Option<(u32, usize)>>,
}

impl FakeModel {
    fn new(num_blocks: usize, block_size: usize) -> Self {
        Self { block_size, slots: vec![None; num_blocks * block_size] }
    }

    fn run(&mut self, batch: &Batch) -> Vec<(u64, u32)> {
        let bs = self.block_size;
        for &(src, dst) in &batch.copies {
            let (s, d) = (src as usize * bs, dst as usize * bs);
            for i in 0..bs {
                self.slots[d + i] = self.slots[s + i];
            }
        }
        for item in &batch.items {
            assert_eq!(item.block_table.len(), (item.start_pos + item.token_ids.len()).div_ceil(bs));
            for (j, slot) in item.slots(bs).enumerate() {
                self.slots[slot as usize] = Some((item.token_ids[j], item.start_pos + j));
            }
        }
        let mut out = Vec::new();
        for item in batch.items.iter().filter(|i| i.sample) {
            let ctx: Vec<u32> = (0..=item.last_pos())
                .map(|p| {
                    let slot = item.block_table[p / bs] as usize * bs + p % bs;
                    match self.slots[slot] {
                        Some((tok, pos)) if pos == p => tok,
                        other => panic!("seq {} position {p}: slot {slot} holds {other:?}", item.seq_id),
                    }
                })
                .collect();
            out.push((item.seq_id, next_token(&ctx)));
        }
        out
    }
}

/// A request of the random workload, with when it arrives and when (if ever) it is aborted.
#[derive(Debug, Clone)]
struct Arrival {
    req: SeqRequest,
    at_step: usize,
    abort_at: Option<usize>,
}

#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    first_cached: Option<usize>,
    rejected: Option<SchedError>,
}

#[derive(Debug, Default)]
struct Stats {
    preemptions: u64,
    steps: usize,
}

/// Drives schedule/commit until every request has ended; checks the per-step limits and the
/// pool invariants on the way, and the no-leak property at the end.
fn drive(cfg: &SchedulerConfig, arrivals: &[Arrival]) -> (HashMap<u64, Outcome>, Stats) {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(cfg.num_blocks, cfg.block_size);
    let mut outcomes: HashMap<u64, Outcome> = HashMap::new();
    let mut stats = Stats::default();
    let last_arrival = arrivals.iter().map(|a| a.at_step).max().unwrap_or(0);
    let mut step = 0;
    loop {
        let now = t0 + Duration::from_millis(step as u64);
        for a in arrivals.iter().filter(|a| a.at_step == step) {
            let o = outcomes.entry(a.req.id).or_default();
            if let Err(e) = s.add(a.req.clone()) {
                o.rejected = Some(e);
            }
        }
        for a in arrivals.iter().filter(|a| a.abort_at == Some(step)) {
            // The request may have ended already or been rejected: that is fine.
            let _ = s.abort(a.req.id);
        }
        let batch = s.schedule(now).unwrap();
        assert!(batch.items.len() <= cfg.max_num_seqs);
        assert!(batch.num_tokens() <= cfg.max_num_batched_tokens);
        assert!(s.num_running() <= cfg.max_num_seqs);
        let mut ids: Vec<u64> = batch.items.iter().map(|i| i.seq_id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), batch.items.len(), "a sequence scheduled twice in one step");
        // Write isolation: every block written this step is private and not in the prefix cache.
        for item in &batch.items {
            for slot in item.slots(cfg.block_size) {
                let b = slot / cfg.block_size as u32;
                assert_eq!(s.kv().refcount(b), Some(1), "seq {} writes shared block {b}", item.seq_id);
                assert!(!s.kv().is_cached(b), "seq {} writes cached block {b}", item.seq_id);
            }
        }
        stats.preemptions += batch.preempted.len() as u64;
        for &(id, reason) in &batch.finished {
            let o = outcomes.get_mut(&id).unwrap();
            assert!(o.finish.is_none(), "seq {id} ended twice");
            o.finish = Some(reason);
        }
        for item in &batch.items {
            let o = outcomes.get_mut(&item.seq_id).unwrap();
            o.first_cached.get_or_insert(item.cached_tokens);
        }
        let outputs = model.run(&batch);
        for u in s.commit(&outputs, now).unwrap() {
            let o = outcomes.get_mut(&u.seq_id).unwrap();
            assert!(o.finish.is_none(), "token for ended seq {}", u.seq_id);
            o.tokens.push(u.token);
            assert_eq!(u.num_generated as usize, o.tokens.len());
            o.finish = u.finish;
        }
        s.kv().check_invariants().unwrap();
        if batch.is_empty() && batch.finished.is_empty() {
            assert!(s.is_idle(), "stalled at step {step}: {} waiting, {} running", s.num_waiting(), s.num_running());
        }
        step += 1;
        if step > last_arrival && s.is_idle() {
            break;
        }
        assert!(step < 100_000, "no progress");
    }
    // No leak: every block is free or cached-evictable with refcount 0.
    let kv = s.kv();
    assert_eq!(kv.num_free() + kv.num_cached(), kv.num_blocks());
    assert!((0..kv.num_blocks() as u32).all(|b| kv.refcount(b) == Some(0)));
    assert_eq!(s.num_preemptions(), stats.preemptions);
    stats.steps = step;
    (outcomes, stats)
}

/// Every request either was rejected for a stated reason, or finished with exactly its
/// reference output, or was aborted with a prefix of it.
fn check_outcomes(cfg: &SchedulerConfig, arrivals: &[Arrival], outcomes: &HashMap<u64, Outcome>) {
    for a in arrivals {
        let o = &outcomes[&a.req.id];
        if let Some(e) = &o.rejected {
            let total = a.req.prompt.len() + a.req.max_tokens as usize;
            assert!(
                total > cfg.max_model_len || total.div_ceil(cfg.block_size) > cfg.num_blocks,
                "seq {} wrongly rejected: {e}",
                a.req.id
            );
            continue;
        }
        let (want, why) = reference(&a.req);
        match o.finish {
            Some(FinishReason::Cancelled) => {
                assert!(a.abort_at.is_some());
                assert!(want.starts_with(&o.tokens), "seq {}: {:?} not a prefix of {want:?}", a.req.id, o.tokens);
            }
            Some(reason) => {
                assert_eq!(o.tokens, want, "seq {} output differs from running alone", a.req.id);
                assert_eq!(reason, why, "seq {}", a.req.id);
            }
            None => panic!("seq {} never ended", a.req.id),
        }
    }
}

fn arrivals_strategy() -> impl Strategy<Value = Vec<Arrival>> {
    // Prompts share prefixes: a few bases, cut at random lengths, plus a random tail.
    let base = proptest::collection::vec(1..VOCAB, 40);
    let one = (
        0usize..3,
        0usize..40,
        proptest::collection::vec(1..VOCAB, 0..6),
        1u32..16,
        0usize..20,
        proptest::option::weighted(0.15, 0usize..40),
        any::<bool>(),
        proptest::option::of(1..VOCAB),
    );
    (proptest::collection::vec(base, 3), proptest::collection::vec(one, 1..12)).prop_map(|(bases, reqs)| {
        reqs.into_iter()
            .enumerate()
            .map(|(i, (b, cut, tail, max_tokens, at_step, abort_at, ignore_eos, stop))| {
                let mut prompt = bases[b][..cut].to_vec();
                prompt.extend(tail);
                if prompt.is_empty() {
                    prompt.push(1);
                }
                let mut req = SeqRequest::new(i as u64, prompt, max_tokens, Instant::now());
                req.eos_token_ids = vec![EOS];
                req.ignore_eos = ignore_eos;
                req.stop_token_ids = stop.into_iter().collect();
                Arrival { req, at_step, abort_at: abort_at.map(|d| at_step + d) }
            })
            .collect()
    })
}

fn config_strategy() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
        2usize..40,
        1usize..6,
        0usize..40,
        proptest::option::of(1usize..12),
        any::<bool>(),
    )
        .prop_map(|(block_size, num_blocks, max_num_seqs, extra, chunk, caching)| SchedulerConfig {
            max_num_batched_tokens: max_num_seqs + extra,
            max_num_seqs,
            block_size,
            num_blocks,
            max_model_len: 60,
            enable_prefix_caching: caching,
            long_prefill_threshold: chunk,
        })
}

/// Fixes each request's arrival instant to its arrival step (the strategy cannot know t0).
fn with_arrival_times(mut arrivals: Vec<Arrival>) -> Vec<Arrival> {
    let t0 = Instant::now();
    for a in &mut arrivals {
        a.req.arrival = t0 + Duration::from_millis(a.at_step as u64);
    }
    arrivals
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// (1) outputs equal running alone, (2) limits respected every step, (3) no leak.
    #[test]
    fn random_workloads_match_reference(cfg in config_strategy(), arrivals in arrivals_strategy()) {
        let arrivals = with_arrival_times(arrivals);
        let (outcomes, _) = drive(&cfg, &arrivals);
        check_outcomes(&cfg, &arrivals, &outcomes);
    }
}

fn workload(n: u64, prompt_len: usize, max_tokens: u32) -> Vec<Arrival> {
    let t0 = Instant::now();
    (0..n)
        .map(|i| {
            let prompt =
                (0..prompt_len).map(|j| 1 + ((i as usize * 7 + j * 3) % (VOCAB as usize - 1)) as u32).collect();
            let req = SeqRequest::new(i, prompt, max_tokens, t0 + Duration::from_millis(i));
            Arrival { req, at_step: i as usize / 2, abort_at: None }
        })
        .collect()
}

/// (4) With a tiny pool preemption actually happens, and outputs are still exact.
#[test]
fn tiny_pool_preempts_without_corruption() {
    for caching in [false, true] {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 16,
            max_num_seqs: 4,
            block_size: 2,
            num_blocks: 12,
            max_model_len: 64,
            enable_prefix_caching: caching,
            long_prefill_threshold: Some(5),
        };
        let arrivals = workload(8, 9, 12);
        let (outcomes, stats) = drive(&cfg, &arrivals);
        check_outcomes(&cfg, &arrivals, &outcomes);
        assert!(stats.preemptions > 0, "preemption was not exercised (caching {caching})");
        assert!(arrivals.iter().all(|a| outcomes[&a.req.id].finish.is_some()));
    }
}

/// (5) A second request with the same prompt hits the prefix cache and gets the same output.
#[test]
fn prefix_cache_hit_gives_same_output() {
    let cfg = SchedulerConfig { block_size: 4, num_blocks: 32, ..SchedulerConfig::default() };
    let t0 = Instant::now();
    let prompt: Vec<u32> = (1..=18).collect();
    let first = Arrival { req: SeqRequest::new(1, prompt.clone(), 5, t0), at_step: 0, abort_at: None };
    let second =
        Arrival { req: SeqRequest::new(2, prompt, 5, t0 + Duration::from_millis(20)), at_step: 20, abort_at: None };
    let arrivals = vec![first, second];
    let (outcomes, _) = drive(&cfg, &arrivals);
    check_outcomes(&cfg, &arrivals, &outcomes);
    assert_eq!(outcomes[&1].first_cached, Some(0));
    assert_eq!(outcomes[&2].first_cached, Some(16));
    assert_eq!(outcomes[&1].tokens, outcomes[&2].tokens);
}

/// A prompt that is exactly whole blocks and fully cached recomputes its last token through a
/// copy-on-write copy; requests arriving together share blocks in flight.
#[test]
fn fully_cached_prompts_and_concurrent_sharers() {
    let cfg = SchedulerConfig { block_size: 4, num_blocks: 40, max_num_seqs: 8, ..SchedulerConfig::default() };
    let t0 = Instant::now();
    let prompt: Vec<u32> = (1..=16).collect();
    let arrivals: Vec<Arrival> = (0..6)
        .map(|i| Arrival {
            req: SeqRequest::new(i, prompt.clone(), 6, t0 + Duration::from_millis(i / 2 * 3)),
            at_step: (i / 2 * 3) as usize,
            abort_at: None,
        })
        .collect();
    let (outcomes, _) = drive(&cfg, &arrivals);
    check_outcomes(&cfg, &arrivals, &outcomes);
    assert!(outcomes.values().any(|o| o.first_cached == Some(15)));
}
