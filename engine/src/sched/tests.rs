//! Unit tests of the scheduler's step protocol. The randomized end-to-end properties live in
//! `engine/tests/sched_props.rs`.

use std::time::{Duration, Instant};

use cleave_protocol::FinishReason;

use super::*;

fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 4,
        block_size,
        num_blocks,
        max_model_len: 256,
        enable_prefix_caching: true,
        long_prefill_threshold: None,
    }
}

fn req(id: u64, prompt_len: u32, max_tokens: u32, t0: Instant) -> SeqRequest {
    SeqRequest::new(id, (1..=prompt_len).collect(), max_tokens, t0 + Duration::from_millis(id))
}

/// Samples token 7 for every sampled item.
fn sevens(b: &Batch) -> Vec<(u64, u32)> {
    b.items.iter().filter(|i| i.sample).map(|i| (i.seq_id, 7)).collect()
}

#[test]
fn rejects_requests_that_can_never_run() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg(4, 4)).unwrap();
    assert_eq!(s.add(req(1, 0, 1, t0)), Err(SchedError::EmptyPrompt { id: 1 }));
    assert_eq!(s.add(req(1, 3, 0, t0)), Err(SchedError::ZeroMaxTokens { id: 1 }));
    assert_eq!(
        s.add(req(1, 300, 1, t0)),
        Err(SchedError::TooLong { id: 1, prompt_len: 300, max_tokens: 1, max_model_len: 256 })
    );
    assert_eq!(s.add(req(1, 10, 7, t0)), Err(SchedError::ExceedsKvCapacity { id: 1, need_blocks: 5, num_blocks: 4 }));
    s.add(req(1, 10, 6, t0)).unwrap();
    assert_eq!(s.add(req(1, 2, 2, t0)), Err(SchedError::DuplicateSeq { id: 1 }));
    assert!(Scheduler::new(SchedulerConfig { max_num_seqs: 0, ..cfg(4, 4) }).is_err());
    assert!(Scheduler::new(SchedulerConfig { max_num_batched_tokens: 2, ..cfg(4, 4) }).is_err());
    assert!(Scheduler::new(SchedulerConfig { num_blocks: 0, ..cfg(4, 4) }).is_err());
}

#[test]
fn prefill_then_decode_until_length() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg(8, 4)).unwrap();
    s.add(req(1, 5, 3, t0)).unwrap();
    let b = s.schedule(t0).unwrap();
    assert_eq!(b.items.len(), 1);
    let it = &b.items[0];
    assert_eq!((it.start_pos, it.token_ids.len(), it.sample), (0, 5, true));
    assert_eq!(it.block_table.len(), 2);
    let slots: Vec<u32> = it.slots(4).collect();
    assert_eq!(slots, vec![0, 1, 2, 3, 4]);
    assert_eq!(s.schedule(t0), Err(SchedError::BatchInFlight));
    let u = s.commit(&[(1, 7)], t0).unwrap();
    assert_eq!(u[0].token, 7);
    assert_eq!((u[0].num_generated, u[0].finish), (1, None));
    let b = s.schedule(t0).unwrap();
    assert_eq!((b.items[0].start_pos, b.items[0].token_ids.clone()), (5, vec![7]));
    s.commit(&sevens(&b), t0).unwrap();
    let b = s.schedule(t0).unwrap();
    let u = s.commit(&sevens(&b), t0).unwrap();
    assert_eq!((u[0].num_generated, u[0].finish), (3, Some(FinishReason::Length)));
    assert!(s.is_idle());
    assert_eq!(s.kv_free_blocks() + s.kv_cached_blocks(), 8);
    // Block 0 (tokens 1..=4) and block 1 (5, 7, 7, ...) : only block 0 filled before the end.
    assert_eq!(s.cached_hashes().count(), 1);
    assert!(s.schedule(t0).unwrap().is_empty());
}

#[test]
fn chunked_prefill_respects_budget_and_threshold() {
    let t0 = Instant::now();
    let c =
        SchedulerConfig { max_num_batched_tokens: 6, max_num_seqs: 2, long_prefill_threshold: Some(4), ..cfg(16, 4) };
    let mut s = Scheduler::new(c).unwrap();
    s.add(req(1, 10, 2, t0)).unwrap();
    s.add(req(2, 3, 2, t0)).unwrap();
    let b = s.schedule(t0).unwrap();
    let lens: Vec<(u64, usize, bool)> = b.items.iter().map(|i| (i.seq_id, i.token_ids.len(), i.sample)).collect();
    assert_eq!(lens, vec![(1, 4, false), (2, 2, false)]);
    assert_eq!(s.commit(&[(1, 7)], t0), Err(SchedError::UnexpectedOutput { id: 1 }));
    assert!(s.commit(&[], t0).unwrap().is_empty());
    // Next step: seq 2 has one token left, which is scheduled like a decode (first).
    let b = s.schedule(t0).unwrap();
    let lens: Vec<(u64, usize, bool)> = b.items.iter().map(|i| (i.seq_id, i.token_ids.len(), i.sample)).collect();
    assert_eq!(lens, vec![(2, 1, true), (1, 4, false)]);
    assert_eq!(s.commit(&[], t0), Err(SchedError::MissingOutput { id: 2 }));
    s.commit(&[(2, 9)], t0).unwrap();
    // Seq 2 decodes first, then seq 1 finishes its prefill.
    let b = s.schedule(t0).unwrap();
    let lens: Vec<(u64, usize, usize, bool)> =
        b.items.iter().map(|i| (i.seq_id, i.start_pos, i.token_ids.len(), i.sample)).collect();
    assert_eq!(lens, vec![(2, 3, 1, true), (1, 8, 2, true)]);
}

#[test]
fn max_num_seqs_limits_admission() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(SchedulerConfig { max_num_seqs: 2, ..cfg(32, 4) }).unwrap();
    for id in 1..=3 {
        s.add(req(id, 2, 4, t0)).unwrap();
    }
    let b = s.schedule(t0).unwrap();
    assert_eq!(b.items.len(), 2);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
}

#[test]
fn stop_eos_and_ignore_eos() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    let mut a = req(1, 2, 10, t0);
    a.eos_token_ids = vec![7];
    let mut b = req(2, 2, 10, t0);
    b.eos_token_ids = vec![7];
    b.ignore_eos = true;
    b.stop_token_ids = vec![8];
    s.add(a).unwrap();
    s.add(b).unwrap();
    let batch = s.schedule(t0).unwrap();
    let u = s.commit(&sevens(&batch), t0).unwrap();
    assert_eq!(u[0].finish, Some(FinishReason::Stop));
    assert_eq!(u[1].finish, None);
    s.schedule(t0).unwrap();
    let u = s.commit(&[(2, 8)], t0).unwrap();
    assert_eq!((u[0].token, u[0].finish, u[0].num_generated), (8, Some(FinishReason::Stop), 2));
    assert!(s.is_idle());
}

#[test]
fn finish_and_abort_apply_at_next_schedule() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg(32, 4)).unwrap();
    s.add(req(1, 6, 10, t0)).unwrap();
    s.add(req(2, 6, 10, t0)).unwrap();
    s.add(req(3, 6, 10, t0)).unwrap();
    let b = s.schedule(t0).unwrap();
    s.abort(1).unwrap();
    s.finish(2, FinishReason::Stop).unwrap();
    s.abort(2).unwrap(); // the first reason wins
                         // Tokens committed after the request are not appended or reported.
    let u = s.commit(&sevens(&b), t0).unwrap();
    assert_eq!(u.iter().map(|u| u.seq_id).collect::<Vec<_>>(), vec![3]);
    let b = s.schedule(t0).unwrap();
    assert_eq!(b.finished, vec![(1, FinishReason::Cancelled), (2, FinishReason::Stop)]);
    assert_eq!(b.items.len(), 1);
    assert_eq!(s.abort(1), Err(SchedError::UnknownSeq { id: 1 }));
    s.commit(&sevens(&b), t0).unwrap();
    s.abort(3).unwrap();
    let b = s.schedule(t0).unwrap();
    assert_eq!(b.finished, vec![(3, FinishReason::Cancelled)]);
    assert!(s.is_idle());
    assert_eq!(s.kv_free_blocks() + s.kv_cached_blocks(), 32);
    s.kv().check_invariants().unwrap();
}

#[test]
fn fully_cached_prompt_recomputes_last_token_with_copy() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg(8, 4)).unwrap();
    s.add(req(1, 8, 1, t0)).unwrap();
    let b = s.schedule(t0).unwrap();
    s.commit(&sevens(&b), t0).unwrap();
    assert_eq!(s.kv_cached_blocks(), 2);
    s.add(req(2, 8, 1, t0)).unwrap();
    let b = s.schedule(t0).unwrap();
    let it = &b.items[0];
    assert_eq!((it.start_pos, it.token_ids.clone(), it.cached_tokens, it.sample), (7, vec![8], 7, true));
    assert_eq!(b.copies.len(), 1);
    assert_eq!(b.copies[0].1, it.block_table[1]);
    let u = s.commit(&sevens(&b), t0).unwrap();
    assert_eq!(u[0].cached_tokens, 7);
    s.kv().check_invariants().unwrap();
    assert_eq!(s.kv_free_blocks() + s.kv_cached_blocks(), 8);
}

#[test]
fn youngest_is_preempted_and_resumes_with_its_tokens() {
    let t0 = Instant::now();
    // 4 blocks of 2: two sequences of 3 prompt tokens + 4 new tokens each need 4 blocks.
    let c = SchedulerConfig { enable_prefix_caching: false, ..cfg(4, 2) };
    let mut s = Scheduler::new(c).unwrap();
    s.add(req(1, 3, 4, t0)).unwrap();
    s.add(req(2, 3, 4, t0)).unwrap();
    let mut preempted = vec![];
    let mut out: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    for _ in 0..30 {
        let b = s.schedule(t0).unwrap();
        preempted.extend(b.preempted.iter().copied());
        for u in s.commit(&sevens(&b), t0).unwrap() {
            out.entry(u.seq_id).or_default().push(u.token);
        }
    }
    assert_eq!(preempted.first(), Some(&2));
    assert!(!preempted.contains(&1));
    assert_eq!(out[&1], vec![7; 4]);
    assert_eq!(out[&2], vec![7; 4]);
    assert!(s.is_idle());
    assert_eq!(s.kv_free_blocks(), 4);
}

#[test]
fn prefilled_sequences_join_running_and_decode() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(SchedulerConfig { max_num_seqs: 1, ..cfg(8, 4) }).unwrap();
    let blocks = s.reserve_blocks(6).unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(s.kv_free_blocks(), 6);
    let r = req(1, 6, 3, t0);
    assert_eq!(s.add_prefilled(r.clone(), &blocks, 9).unwrap(), None);
    assert_eq!(s.block_ids(1), Some(&blocks[..]));
    assert_eq!(s.cached_hashes().count(), 1);
    // No free sequence slot: the caller keeps its blocks.
    let more = s.reserve_blocks(2).unwrap();
    assert_eq!(s.add_prefilled(req(2, 2, 3, t0), &more, 9), Err(SchedError::NoSeqSlot { max_num_seqs: 1 }));
    s.release_reserved(&more).unwrap();
    let b = s.schedule(t0).unwrap();
    let it = &b.items[0];
    assert_eq!((it.start_pos, it.token_ids.clone(), it.sample), (6, vec![9], true));
    assert_eq!(it.block_table, blocks);
    s.commit(&sevens(&b), t0).unwrap();
    let b = s.schedule(t0).unwrap();
    let u = s.commit(&sevens(&b), t0).unwrap();
    assert_eq!((u[0].num_generated, u[0].finish), (3, Some(FinishReason::Length)));
    // A first token that already ends the sequence: not added, blocks released.
    let blocks = s.reserve_blocks(2).unwrap();
    let mut r = req(3, 2, 3, t0);
    r.stop_token_ids = vec![9];
    assert_eq!(s.add_prefilled(r, &blocks, 9).unwrap(), Some(FinishReason::Stop));
    assert!(s.is_idle());
    assert_eq!(s.kv_free_blocks() + s.kv_cached_blocks(), 8);
    s.kv().check_invariants().unwrap();
}

/// Prompt tokens of a batch, per sequence.
fn prompt_tokens(b: &Batch, id: u64) -> usize {
    b.items.iter().filter(|i| i.seq_id == id).map(|i| i.token_ids.len()).sum()
}

#[test]
fn pacing_cuts_chunks_beside_decodes_to_their_slack_and_never_stalls_prompts() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(SchedulerConfig { max_num_batched_tokens: 128, ..cfg(64, 16) }).unwrap();
    s.set_tpot_target(Some(Duration::from_millis(100))).unwrap();
    // 2 ms a prompt token, 20 ms a decode step.
    let two_ms = Some(Duration::from_millis(2));
    s.set_step_costs(StepCosts { decode_step: Duration::from_millis(20), prompt_token: [two_ms; 7] });
    // Alone, a prompt gets the whole budget: no decode to protect.
    s.add(req(1, 100, 50, t0)).unwrap();
    let b = s.schedule(t0).unwrap();
    assert_eq!(prompt_tokens(&b, 1), 100);
    // Sequence 1's first token: committed as its step began (t0), out when the next begins.
    s.commit(&sevens(&b), t0).unwrap();
    // A prompt sharing no block with the first (no prefix-cache hit).
    s.add(SeqRequest::new(2, (1000..1200).collect(), 4, t0)).unwrap();
    // Beside a fresh decode: 90 ms allowance from the token's release (the 50 ms of the step
    // that sampled it not counted), 20 for the decode, 2 ms a token: 35 tokens.
    let out = t0 + Duration::from_millis(50);
    let b = s.schedule(out).unwrap();
    assert_eq!((prompt_tokens(&b, 1), prompt_tokens(&b, 2)), (1, 35));
    assert_eq!(s.num_paced_steps(), 1);
    // The step ran 100 ms (over the estimate): one interval at 100 ms, the next step's
    // allowance is 180 - 100 = 80 ms: 30 tokens.
    let t1 = out + Duration::from_millis(100);
    s.commit(&sevens(&b), t1).unwrap();
    let b = s.schedule(t1).unwrap();
    assert_eq!(prompt_tokens(&b, 2), 30);
    // Far behind (2 intervals in 10 s): the floor keeps the prompt moving.
    let t2 = t0 + Duration::from_secs(10);
    s.commit(&sevens(&b), t2).unwrap();
    let b = s.schedule(t2).unwrap();
    assert_eq!(prompt_tokens(&b, 2), crate::sched::pacing::MIN_PACED_CHUNK);
    s.commit(&sevens(&b), t2).unwrap();
    // Without a target only the budget (less the decode) limits it.
    s.set_tpot_target(None).unwrap();
    let b = s.schedule(t2).unwrap();
    assert_eq!(prompt_tokens(&b, 2), 127);
    assert_eq!(
        s.set_tpot_target(Some(Duration::ZERO)),
        Err(SchedError::InvalidConfig { what: "the time per output token target must be above 0" })
    );
}
