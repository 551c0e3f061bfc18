//! Disaggregated serving on the engine: engine A runs prefill-only requests that export their
//! K/V layer by layer, engine B imports it and decodes. The greedy output of A's first token
//! plus B's tokens equals a single engine's; chunks are per layer, in order, exactly once, and
//! leave the forward pass while later layers still compute; every reserved block is freed on
//! every path; bad imports are errors.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cleave_engine::model::synth::{self, SynthDtype, SynthSpec};
use cleave_engine::{
    EngineConfig, EngineCore, EngineError, EngineRequest, ExportDone, ImportStart, KvChunk, KvExport, KvExportEvent,
    SinkError,
};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::{Constraint, FinishReason, RequestId, SamplingParams, TokenEvent};
use common::*;
use tokio::sync::mpsc;

type Core = EngineCore<CpuBackend>;

// ---------------------------------------------------------------------------------------------
// Models
// ---------------------------------------------------------------------------------------------

/// A fresh folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cleave-disagg-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn small_spec(num_layers: usize, num_kv_heads: usize) -> SynthSpec {
    SynthSpec { num_layers, num_kv_heads, ..synth::preset("tiny").unwrap() }
}

/// A synthetic Llama model (GQA when `num_kv_heads < 4`).
fn write_llama(tag: &str, spec: SynthSpec) -> TempDir {
    let dir = TempDir::new(tag);
    synth::write_model(&spec, 7, SynthDtype::F32, &dir.0).unwrap();
    dir
}

/// A synthetic Qwen2 model: q/k/v projections with biases.
fn write_qwen2(tag: &str, spec: SynthSpec) -> TempDir {
    use safetensors::tensor::{Dtype, SafeTensors, TensorView};
    let dir = write_llama(tag, spec);
    let config_path = dir.0.join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    let obj = config.as_object_mut().unwrap();
    obj.insert("architectures".into(), serde_json::json!(["Qwen2ForCausalLM"]));
    obj.insert("model_type".into(), serde_json::json!("qwen2"));
    obj.remove("attention_bias");
    std::fs::write(&config_path, serde_json::to_string(&config).unwrap()).unwrap();
    let path = dir.0.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (qd, kvd) = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim);
    let mut extra: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut x = 0x5eedu64;
    for l in 0..spec.num_layers {
        for (name, n) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
            let data: Vec<u8> = (0..n)
                .flat_map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5).to_le_bytes()
                })
                .collect();
            extra.push((format!("model.layers.{l}.self_attn.{name}.bias"), vec![n], data));
        }
    }
    let mut views: Vec<(String, TensorView<'_>)> = st.tensors();
    for (name, shape, data) in &extra {
        views.push((name.clone(), TensorView::new(Dtype::F32, shape.clone(), data).unwrap()));
    }
    let out = dir.0.join("model.safetensors.tmp");
    safetensors::serialize_to_file(views, None, &out).unwrap();
    std::fs::rename(&out, &path).unwrap();
    dir
}

fn config(block_size: usize, max_num_batched_tokens: usize) -> EngineConfig {
    EngineConfig { block_size, max_num_batched_tokens, max_num_seqs: 8, kv_cache_memory: 8 << 20, ..Default::default() }
}

/// Deterministic pseudo-random prompt tokens in `3..vocab`.
fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (3 + x % (vocab as u64 - 3)) as u32
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The handoff driver
// ---------------------------------------------------------------------------------------------

/// A sink that records every event with the value of A's layer counter when it was emitted.
fn recording_sink(log: Arc<Mutex<Vec<(KvExportEvent, u64)>>>, progress: Arc<AtomicU64>) -> KvExport {
    KvExport::new(move |ev| {
        log.lock().unwrap().push((ev, progress.load(Ordering::SeqCst)));
        Ok(())
    })
}

/// Checks that the chunks of one request cover `0..prompt_len` of every layer exactly once, in
/// position order per layer, then a single `Done` last; returns the `Done`.
fn check_stream(events: &[KvExportEvent], layout_layers: usize, prompt_len: usize, kv_width: usize) -> ExportDone {
    let mut next = vec![0usize; layout_layers];
    let (last, chunks) = events.split_last().expect("events");
    for ev in chunks {
        let KvExportEvent::Chunk(c) = ev else { panic!("Done before the last event") };
        let l = c.layer as usize;
        assert_eq!(c.token_start as usize, next[l], "layer {l}: chunks out of order or overlapping");
        assert!(c.token_count > 0);
        assert_eq!(c.k.len(), c.token_count as usize * kv_width * 4);
        assert_eq!(c.v.len(), c.k.len());
        next[l] += c.token_count as usize;
    }
    assert!(next.iter().all(|&n| n == prompt_len), "coverage {next:?} of {prompt_len}");
    match last {
        KvExportEvent::Done(d) => d.clone(),
        other => panic!("last event is not Done: {other:?}"),
    }
}

/// Disaggregated run: every request of `handoff` is prefilled on `a` (prefill-only) and decoded
/// on `b`; `others_a` and `others_b` run as plain requests on each side at the same time.
/// Chunks are imported into `b` as they appear, between `b`'s own steps. Returns the token ids
/// of every request (A's first token + B's tokens for handed-off ones) and the `Done`s.
fn run_disagg(
    a: &mut Core,
    b: &mut Core,
    handoff: &[EngineRequest],
    others_a: &[EngineRequest],
    others_b: &[EngineRequest],
) -> (BTreeMap<u64, Vec<u32>>, HashMap<u64, ExportDone>) {
    let run = run_disagg_with(a, b, handoff, others_a, others_b);
    (run.got, run.done)
}

/// What [`run_disagg_with`] saw.
struct Run {
    got: BTreeMap<u64, Vec<u32>>,
    done: HashMap<u64, ExportDone>,
    /// Per handed-off request: prompt tokens B already held (its reservation's cached prefix).
    b_cached: HashMap<u64, usize>,
    /// Token rows (per layer) imported into B, over all requests.
    imported_rows: usize,
}

/// [`run_disagg`], with B reserving by prompt (`reserve_import_prompt`): a prefix B holds in
/// its prefix cache is not imported again, and A's chunks are cut to what B lacks as the
/// node's sender cuts them.
fn run_disagg_with(
    a: &mut Core,
    b: &mut Core,
    handoff: &[EngineRequest],
    others_a: &[EngineRequest],
    others_b: &[EngineRequest],
) -> Run {
    let now = Instant::now();
    let log = Arc::new(Mutex::new(Vec::new()));
    for r in others_a {
        a.add_request(r.clone(), now).unwrap();
    }
    for r in others_b {
        b.add_request(r.clone(), now).unwrap();
    }
    let mut b_cached = HashMap::new();
    for r in handoff {
        a.add_prefill_only(r.clone(), recording_sink(log.clone(), a.kv_layers_written()), now).unwrap();
        let grant = b.reserve_import_prompt(r.id, &r.prompt).unwrap();
        assert_eq!(grant.blocks.len(), r.prompt.len().div_ceil(b.kv_layout().block_size as usize));
        b_cached.insert(r.id.0, grant.cached_tokens);
    }
    let row = b.kv_layout().bytes_per_token() / b.kv_layout().num_layers as usize / 2;
    let mut imported_rows = 0;
    let reqs: HashMap<u64, &EngineRequest> = handoff.iter().map(|r| (r.id.0, r)).collect();
    let mut out: BTreeMap<u64, Vec<TokenEvent>> = BTreeMap::new();
    let mut streams: HashMap<u64, Vec<KvExportEvent>> = HashMap::new();
    let mut done = HashMap::new();
    let mut steps = 0;
    while a.has_work() || b.has_work() || !log.lock().unwrap().is_empty() {
        if a.has_work() {
            for ev in a.step(now).unwrap() {
                out.entry(ev.request_id.0).or_default().push(ev);
            }
        }
        for (ev, _) in log.lock().unwrap().drain(..) {
            match &ev {
                KvExportEvent::Chunk(c) => {
                    let cached = b_cached[&c.request_id.0];
                    let (start, end) = (c.token_start as usize, (c.token_start + c.token_count) as usize);
                    if end > cached {
                        let from = start.max(cached);
                        let at = (from - start) * row;
                        b.import_kv(c.request_id, c.layer, from as u32, &c.k[at..], &c.v[at..]).unwrap();
                        imported_rows += end - from;
                    }
                }
                KvExportEvent::Done(d) => {
                    assert_eq!(d.finish, None, "handed-off requests must not finish on A");
                    let req = reqs[&d.request_id.0].clone();
                    let start = ImportStart {
                        first_token: d.first_token,
                        sampler_seed: Some(d.sampler_seed),
                        cached_tokens: d.cached_tokens,
                    };
                    b.add_imported(req, start, now).unwrap();
                    done.insert(d.request_id.0, d.clone());
                }
            }
            let id = match &ev {
                KvExportEvent::Chunk(c) => c.request_id.0,
                KvExportEvent::Done(d) => d.request_id.0,
            };
            streams.entry(id).or_default().push(ev);
        }
        if b.has_work() {
            for ev in b.step(now).unwrap() {
                out.entry(ev.request_id.0).or_default().push(ev);
            }
        }
        steps += 1;
        assert!(steps < 10_000, "disaggregated run does not finish");
    }
    let layers = a.model().config.num_layers;
    let kv_width = a.model().config.kv_width();
    for r in handoff {
        let d = check_stream(&streams[&r.id.0], layers, r.prompt.len(), kv_width);
        assert_eq!(&d, &done[&r.id.0]);
        // A's one event: the first token, not finished; then B's, the last one finished.
        let evs = &out[&r.id.0];
        assert_eq!(evs[0].token_id, Some(d.first_token));
        assert_eq!(evs[0].finish_reason, None);
        assert_eq!(evs[0].completion_tokens, 1);
        let last = evs.last().unwrap();
        assert!(last.finish_reason.is_some());
        if r.params.constraint.is_none() {
            assert_eq!(last.completion_tokens, r.stop.max_tokens, "completion_tokens counts the first token");
        }
        assert_eq!(last.cached_tokens, d.cached_tokens, "B reports A's prefix-cache hit");
        for (i, ev) in evs.iter().enumerate() {
            assert_eq!(ev.completion_tokens as usize, i + 1);
            assert_eq!(ev.prompt_tokens as usize, r.prompt.len());
        }
    }
    assert_no_blocks_in_use(a);
    assert_no_blocks_in_use(b);
    let got = out.into_iter().map(|(id, evs)| (id, token_ids(&evs))).collect();
    Run { got, done, b_cached, imported_rows }
}

fn assert_no_blocks_in_use(core: &Core) {
    let snap = core.snapshot();
    assert_eq!((snap.kv_blocks_in_use, snap.kv_blocks_reserved, snap.import_reservations), (0, 0, 0), "{snap:?}");
    core.scheduler().kv().check_invariants().unwrap();
}

/// Every request alone through one engine (batched together), greedy.
fn single_engine(dir: &Path, cfg: &EngineConfig, reqs: &[EngineRequest]) -> BTreeMap<u64, Vec<u32>> {
    let mut core = engine(dir, cfg.clone());
    for r in reqs {
        core.add_request(r.clone(), Instant::now()).unwrap();
    }
    run_to_end(&mut core).into_iter().map(|(id, evs)| (id, token_ids(&evs))).collect()
}

/// The key property on one model: handoff requests (chunked prefill, a prefix-cache hit on A,
/// batched with plain requests on both sides) give the single engine's greedy tokens.
fn check_model(dir: &Path, vocab: usize) {
    let cfg = config(4, 16);
    let shared = tokens(1, 13, vocab);
    let handoff = vec![
        greedy_request(1, tokens(2, 40, vocab), 8), // longer than the chunk budget
        greedy_request(2, [shared.clone(), tokens(3, 6, vocab)].concat(), 6),
        greedy_request(3, tokens(4, 3, vocab), 5),
    ];
    let others_a = vec![greedy_request(10, [shared.clone(), tokens(5, 9, vocab)].concat(), 4)];
    let others_b = vec![greedy_request(20, tokens(6, 21, vocab), 12), greedy_request(21, tokens(7, 2, vocab), 9)];
    let mut a = engine(dir, cfg.clone());
    let mut b = engine(dir, cfg.clone());
    assert_eq!(a.kv_layout(), b.kv_layout());
    // Warm A's prefix cache with the shared prefix (request 2 then hits it).
    a.add_request(greedy_request(99, [shared.clone(), tokens(8, 3, vocab)].concat(), 1), Instant::now()).unwrap();
    run_to_end(&mut a);
    let (got, done) = run_disagg(&mut a, &mut b, &handoff, &others_a, &others_b);
    assert!(done[&2].cached_tokens >= 12, "request 2 must hit A's prefix cache: {:?}", done[&2]);
    let all: Vec<EngineRequest> = handoff.iter().chain(&others_a).chain(&others_b).cloned().collect();
    let want = single_engine(dir, &cfg, &all);
    assert_eq!(got, want);
}

#[test]
fn handoff_matches_single_engine_on_tiny_llama() {
    check_model(&tiny_llama_dir(), 32000);
}

#[test]
fn handoff_matches_single_engine_on_synthetic_gqa() {
    let dir = write_llama("gqa", small_spec(3, 1));
    check_model(&dir.0, 4096);
}

#[test]
fn handoff_matches_single_engine_on_synthetic_qwen2_bias() {
    let dir = write_qwen2("qwen2", small_spec(2, 2));
    let a = engine(&dir.0, config(4, 16));
    assert!(a.model().config.attention_bias);
    check_model(&dir.0, 4096);
}

/// A conversation handed off turn by turn (prompt of turn 2 = turn 1's prompt, its answer and
/// a new message): B reserves turn 2 with the blocks its prefix cache kept of turn 1 (prompt
/// and answer), so only the new part is imported, and the tokens equal one engine's. A turn
/// that shares nothing with B's cache imports everything; a released reservation leaves the
/// cached prefix cached and unpinned.
#[test]
fn a_later_turn_imports_only_what_the_decode_engine_lacks() {
    let dir = tiny_llama_dir();
    let cfg = config(4, 16);
    let (mut a, mut b) = (engine(&dir, cfg.clone()), engine(&dir, cfg.clone()));
    let turn1 = greedy_request(1, tokens(31, 22, 32000), 9);
    let run1 = run_disagg_with(&mut a, &mut b, std::slice::from_ref(&turn1), &[], &[]);
    assert_eq!(run1.b_cached[&1], 0);
    let layers = b.model().config.num_layers;
    assert_eq!(run1.imported_rows, layers * 22, "the first turn imports every row of every layer");
    let answer = run1.got[&1].clone();
    let turn2 = greedy_request(2, [turn1.prompt.clone(), answer.clone(), tokens(32, 7, 32000)].concat(), 8);
    let stranger = greedy_request(3, tokens(33, 19, 32000), 5);
    let run2 = run_disagg_with(&mut a, &mut b, &[turn2.clone(), stranger.clone()], &[], &[]);
    // Turn 1's prompt and the answer's full blocks are in B's cache (the last answer token's
    // K/V was never computed on B: it was sampled last).
    let held = (turn1.prompt.len() + answer.len() - 1) / 4 * 4;
    assert_eq!(run2.b_cached[&2], held, "{:?}", run2.b_cached);
    assert_eq!(run2.b_cached[&3], 0);
    assert_eq!(run2.imported_rows, layers * (turn2.prompt.len() - held + stranger.prompt.len()));
    let want = single_engine(&dir, &cfg, &[turn2.clone(), stranger.clone()]);
    assert_eq!(run2.got, want, "a delta handoff changes no token");

    let g = b.reserve_import_prompt(RequestId(4), &turn2.prompt).unwrap();
    assert!(g.cached_tokens >= held);
    let pinned = g.blocks[0];
    assert_eq!(b.scheduler().kv().refcount(pinned), Some(1), "a cached block is pinned while reserved");
    b.release_import(RequestId(4)).unwrap();
    assert_eq!(b.scheduler().kv().refcount(pinned), Some(0));
    assert!(b.scheduler().kv().is_cached(pinned), "released, the prefix stays cached");
    assert_no_blocks_in_use(&b);
}

#[test]
fn seeded_sampling_continues_the_prefill_sides_stream() {
    let dir = tiny_llama_dir();
    let params = SamplingParams { temperature: 0.9, top_k: 50, ..Default::default() };
    let mut with_seed = greedy_request(1, tokens(11, 23, 32000), 12);
    with_seed.params = SamplingParams { seed: Some(1234), ..params.clone() };
    // No seed of its own: A derives one from its engine seed; B must use A's.
    let mut without = greedy_request(2, tokens(12, 9, 32000), 12);
    without.params = params;
    let cfg_a = EngineConfig { seed: 5, ..config(4, 16) };
    let cfg_b = EngineConfig { seed: 6, ..config(4, 16) };
    let (mut a, mut b) = (engine(&dir, cfg_a.clone()), engine(&dir, cfg_b));
    let reqs = [with_seed, without];
    let (got, _) = run_disagg(&mut a, &mut b, &reqs, &[], &[]);
    assert_eq!(got, single_engine(&dir, &cfg_a, &reqs));
}

#[test]
fn layer_chunks_leave_before_later_layers_compute() {
    let dir = write_llama("overlap", small_spec(4, 2));
    let mut a = engine(&dir.0, config(4, 8));
    let log = Arc::new(Mutex::new(Vec::new()));
    let progress = a.kv_layers_written();
    let prompt = tokens(21, 30, 4096);
    a.add_prefill_only(greedy_request(1, prompt.clone(), 4), recording_sink(log.clone(), progress), Instant::now())
        .unwrap();
    run_to_end(&mut a);
    let log = log.lock().unwrap();
    let chunks: Vec<(&KvChunk, u64)> = log
        .iter()
        .filter_map(|(ev, p)| match ev {
            KvExportEvent::Chunk(c) => Some((c, *p)),
            _ => None,
        })
        .collect();
    // 30 tokens in chunks of 8: 4 forward passes, 4 layers each.
    assert_eq!(chunks.len(), 16);
    for pass in chunks.chunks(4) {
        let base = pass[0].1;
        for (l, (c, p)) in pass.iter().enumerate() {
            assert_eq!(c.layer as usize, l);
            assert_eq!(c.token_start, pass[0].0.token_start);
            // Emitted right after layer l wrote its K/V: layers l+1.. had not run yet.
            assert_eq!(*p, base + l as u64, "layer {l} of the chunk at {}", c.token_start);
        }
    }
    let events: Vec<KvExportEvent> = log.iter().map(|(e, _)| e.clone()).collect();
    check_stream(&events, 4, prompt.len(), a.model().config.kv_width());
}

#[test]
fn exported_bytes_are_the_cache_rows() {
    // What B holds after the import equals what A computed: re-export from B's blocks by
    // prefilling the same prompt on B with a prefix-cache hit on the imported blocks.
    // 17 tokens: the 16 of the full blocks come from the cache. 16 tokens: the whole prompt is
    // cached, so the last block is copied (copy-on-write) and its last token recomputed.
    for len in [17, 16] {
        exported_bytes_match(len);
    }
}

fn exported_bytes_match(len: usize) {
    let dir = tiny_llama_dir();
    let (mut a, mut b) = (engine(&dir, config(4, 64)), engine(&dir, config(4, 64)));
    let prompt = tokens(31, len, 32000);
    let req = greedy_request(1, prompt.clone(), 2);
    let (_, done) = run_disagg(&mut a, &mut b, std::slice::from_ref(&req), &[], &[]);
    assert_eq!(done[&1].cached_tokens, 0);
    let export = |core: &mut Core, id: u64| {
        let log = Arc::new(Mutex::new(Vec::new()));
        core.add_prefill_only(
            greedy_request(id, prompt.clone(), 2),
            recording_sink(log.clone(), Arc::default()),
            Instant::now(),
        )
        .unwrap();
        run_to_end(core);
        let mut by_layer: BTreeMap<u32, (Vec<u8>, Vec<u8>)> = BTreeMap::new();
        for (ev, _) in log.lock().unwrap().iter() {
            if let KvExportEvent::Chunk(c) = ev {
                let e = by_layer.entry(c.layer).or_default();
                e.0.extend_from_slice(&c.k);
                e.1.extend_from_slice(&c.v);
            }
        }
        by_layer
    };
    // Both now serve the 16 full-block tokens from their caches (B's from imported blocks).
    let from_a = export(&mut a, 2);
    let from_b = export(&mut b, 2);
    assert_eq!(from_a.len(), 2);
    assert!(from_a.values().all(|(k, v)| k.len() == len * 32 * 4 && v.len() == k.len()));
    assert_eq!(from_a, from_b);
}

#[test]
fn a_preempted_prefill_only_request_exports_each_token_once() {
    // 10 blocks of 4 tokens: a decoding request (older) grows until the prefill-only one,
    // mid-prefill, is preempted; it recomputes later and must not resend what it sent.
    let dir = tiny_llama_dir();
    let per_block = 2 * 2 * 4 * 32 * 4;
    let tight = EngineConfig { kv_cache_memory: 10 * per_block, ..config(4, 8) };
    let (mut a, mut b) = (engine(&dir, tight), engine(&dir, config(4, 16)));
    let older = greedy_request(1, tokens(91, 8, 32000), 24);
    let handoff = greedy_request(2, tokens(92, 30, 32000), 6);
    let (got, _) = run_disagg(&mut a, &mut b, std::slice::from_ref(&handoff), std::slice::from_ref(&older), &[]);
    assert!(a.snapshot().preemptions >= 1, "the scenario must preempt: {:?}", a.snapshot());
    assert_eq!(got, single_engine(&dir, &config(4, 16), &[older, handoff]));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 12,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0xd15a_6601),
        failure_persistence: None,
        max_shrink_iters: 32,
        ..Default::default()
    })]

    /// Random block sizes, chunk budgets, prompt lengths and shared prefixes (prefix-cache hits
    /// on A, including whole-prompt hits) keep the handoff equal to a single engine.
    #[test]
    fn handoff_equals_single_engine_for_random_shapes(
        block_size in proptest::sample::select(vec![1usize, 2, 4, 8, 16]),
        budget in 8usize..40,
        lens in proptest::collection::vec(1usize..48, 1..4),
        shared in 0usize..24,
        seed in 0u64..1000,
    ) {
        let dir = tiny_llama_dir();
        let cfg = config(block_size, budget);
        let prefix = tokens(seed, shared, 32000);
        let reqs: Vec<EngineRequest> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| greedy_request(i as u64, [prefix.clone(), tokens(seed + 1 + i as u64, n, 32000)].concat(), 4))
            .collect();
        let (mut a, mut b) = (engine(&dir, cfg.clone()), engine(&dir, cfg.clone()));
        // Warm A's prefix cache with the first prompt in full (a whole-prompt hit for it).
        a.add_request(greedy_request(999, reqs[0].prompt.clone(), 1), Instant::now()).unwrap();
        run_to_end(&mut a);
        let (got, _) = run_disagg(&mut a, &mut b, &reqs, &[], &[]);
        proptest::prop_assert_eq!(got, single_engine(&dir, &cfg, &reqs));
    }
}

// ---------------------------------------------------------------------------------------------
// Ends of a prefill-only request
// ---------------------------------------------------------------------------------------------

#[test]
fn a_first_token_that_ends_the_request_is_not_handed_off() {
    let dir = tiny_llama_dir();
    let mut a = engine(&dir, config(4, 16));
    let (tx, mut rx) = mpsc::unbounded_channel();
    a.add_prefill_only(greedy_request(1, tokens(41, 10, 32000), 1), KvExport::unbounded(tx), Instant::now()).unwrap();
    let evs = &run_to_end(&mut a)[&1];
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].finish_reason, Some(FinishReason::Length));
    let mut last = None;
    while let Ok(ev) = rx.try_recv() {
        last = Some(ev);
    }
    let Some(KvExportEvent::Done(d)) = last else { panic!("no Done") };
    assert_eq!(d.finish, Some(FinishReason::Length));
    assert_no_blocks_in_use(&a);
}

#[test]
fn a_failing_sink_fails_only_its_request_and_frees_its_blocks() {
    let dir = tiny_llama_dir();
    let mut a = engine(&dir, config(4, 16));
    // Room for one chunk: the second layer's chunk of the first pass finds it full.
    let (tx, _rx) = mpsc::channel(1);
    a.add_prefill_only(greedy_request(1, tokens(51, 30, 32000), 4), KvExport::bounded(tx), Instant::now()).unwrap();
    // A closed sink.
    let (tx, rx) = mpsc::unbounded_channel();
    drop(rx);
    a.add_prefill_only(greedy_request(2, tokens(52, 5, 32000), 4), KvExport::unbounded(tx), Instant::now()).unwrap();
    a.add_request(greedy_request(3, tokens(53, 12, 32000), 5), Instant::now()).unwrap();
    let out = run_to_end(&mut a);
    for (id, reason) in [(1, SinkError::Full), (2, SinkError::Closed)] {
        let evs = &out[&id];
        assert_eq!(evs.len(), 1, "request {id}: {evs:?}");
        assert_eq!(evs[0].finish_reason, Some(FinishReason::Error));
        assert!(evs[0].error.as_ref().unwrap().contains(&reason.to_string()), "{evs:?}");
    }
    assert_eq!(token_ids(&out[&3]).len(), 5);
    assert_no_blocks_in_use(&a);
}

// ---------------------------------------------------------------------------------------------
// Import errors and release paths
// ---------------------------------------------------------------------------------------------

fn chunk_bytes(core: &Core, n: usize) -> Vec<u8> {
    vec![0u8; n * core.model().config.kv_width() * 4]
}

#[test]
fn bad_imports_are_errors_that_keep_the_reservation() {
    let mut b = engine(&tiny_llama_dir(), config(4, 16));
    let id = RequestId(7);
    let blocks = b.reserve_import(id, 10).unwrap();
    assert_eq!(blocks.len(), 3);
    let one = chunk_bytes(&b, 1);
    let two = chunk_bytes(&b, 2);
    type Case = (RequestId, u32, u32, Vec<u8>, Vec<u8>, &'static str);
    let cases: Vec<Case> = vec![
        (RequestId(8), 0, 0, one.clone(), one.clone(), "no KV import"),
        (id, 2, 0, one.clone(), one.clone(), "2 layers"),
        (id, 0, 0, one.clone(), two.clone(), "equal"),
        (id, 0, 0, one[..5].to_vec(), one[..5].to_vec(), "multiples"),
        (id, 0, 0, Vec::new(), Vec::new(), "non-zero"),
        (id, 0, 9, two.clone(), two.clone(), "past the 10 reserved"),
    ];
    for (rid, layer, start, k, v, want) in cases {
        let e = b.import_kv(rid, layer, start, &k, &v).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
    b.import_kv(id, 0, 8, &two, &two).unwrap();
    // Duplicate ids are refused.
    assert!(matches!(b.reserve_import(id, 4), Err(EngineError::DuplicateImport { .. })));
    assert_eq!(b.snapshot().kv_blocks_reserved, 3);
    // Incomplete: add_imported refuses and releases.
    let req = greedy_request(7, tokens(61, 10, 32000), 4);
    let start = ImportStart { first_token: 5, sampler_seed: None, cached_tokens: 0 };
    let e = b.add_imported(req.clone(), start, Instant::now()).unwrap_err();
    assert!(matches!(e, EngineError::ImportIncomplete { layer: 0, have: 2, need: 10, .. }), "{e}");
    assert_no_blocks_in_use(&b);
    assert!(matches!(b.add_imported(req, start, Instant::now()), Err(EngineError::UnknownImport { .. })));
    assert!(matches!(b.release_import(id), Err(EngineError::UnknownImport { .. })));
    // Mismatched prompt length.
    b.reserve_import(id, 10).unwrap();
    let e = b.add_imported(greedy_request(7, tokens(61, 11, 32000), 4), start, Instant::now()).unwrap_err();
    assert!(matches!(e, EngineError::ImportMismatch { reserved: 10, prompt: 11, .. }), "{e}");
    assert_no_blocks_in_use(&b);
    // Zero tokens and too long.
    assert!(b.reserve_import(id, 0).is_err());
    assert!(b.reserve_import(id, 1 << 20).is_err());
    assert_no_blocks_in_use(&b);
}

#[test]
fn reservation_refused_up_front_when_out_of_blocks() {
    // 8 blocks of 4 tokens.
    let dir = tiny_llama_dir();
    let per_block = 2 * 2 * 4 * 32 * 4; // layers * (k, v) * block_size * kv_width * f32
    let cfg = EngineConfig { kv_cache_memory: 8 * per_block, ..config(4, 16) };
    let mut b = engine(&dir, cfg);
    assert_eq!(b.snapshot().kv_blocks_total, 8);
    let first = b.reserve_import(RequestId(1), 20).unwrap();
    assert_eq!(first.len(), 5);
    let e = b.reserve_import(RequestId(2), 13).unwrap_err();
    assert!(matches!(e, EngineError::ImportRefused { need: 4, available: 3, .. }), "{e}");
    assert_eq!(b.snapshot().kv_blocks_reserved, 5);
    b.release_import(RequestId(1)).unwrap();
    assert_no_blocks_in_use(&b);
}

#[test]
fn abort_shutdown_and_parking_free_every_block() {
    let dir = tiny_llama_dir();
    let cfg = EngineConfig { max_num_seqs: 1, ..config(4, 16) };
    let mut b = engine(&dir, cfg);
    let now = Instant::now();
    // abort() releases a reservation.
    b.reserve_import(RequestId(1), 9).unwrap();
    b.abort(RequestId(1));
    assert_no_blocks_in_use(&b);
    // release_all_imports (engine shutdown) releases reservations.
    b.reserve_import(RequestId(2), 9).unwrap();
    b.reserve_import(RequestId(3), 5).unwrap();
    b.release_all_imports().unwrap();
    assert_no_blocks_in_use(&b);
    // With the only slot taken, a complete import waits (parked) holding its blocks, and starts
    // when the slot frees; a parked import that is cancelled reports Cancelled.
    b.add_request(greedy_request(10, tokens(71, 5, 32000), 3), now).unwrap();
    b.step(now).unwrap();
    let fill = |b: &mut Core, id: u64, n: usize| {
        b.reserve_import(RequestId(id), n).unwrap();
        let rows = chunk_bytes(b, n);
        for layer in 0..2 {
            b.import_kv(RequestId(id), layer, 0, &rows, &rows).unwrap();
        }
    };
    let start = ImportStart { first_token: 5, sampler_seed: None, cached_tokens: 0 };
    fill(&mut b, 4, 6);
    b.add_imported(greedy_request(4, tokens(72, 6, 32000), 3), start, now).unwrap();
    fill(&mut b, 5, 7);
    b.add_imported(greedy_request(5, tokens(73, 7, 32000), 3), start, now).unwrap();
    assert_eq!(b.snapshot().import_reservations, 2);
    b.abort(RequestId(5));
    let out = run_to_end(&mut b);
    assert_eq!(out[&5].len(), 1);
    assert_eq!(out[&5][0].finish_reason, Some(FinishReason::Cancelled));
    assert_eq!(token_ids(&out[&4]).len(), 2, "the parked import ran after the slot freed");
    assert_eq!(out[&4].last().unwrap().completion_tokens, 3);
    assert_eq!(token_ids(&out[&10]).len(), 2, "its first token came from the step above");
    assert_no_blocks_in_use(&b);
    // An imported request whose first token already ends it: one final event, no token.
    fill(&mut b, 6, 4);
    b.add_imported(greedy_request(6, tokens(74, 4, 32000), 1), start, now).unwrap();
    let out = run_to_end(&mut b);
    assert_eq!(out[&6].len(), 1);
    assert_eq!((out[&6][0].token_id, out[&6][0].finish_reason), (None, Some(FinishReason::Length)));
    assert_eq!(out[&6][0].completion_tokens, 1);
    assert_no_blocks_in_use(&b);
    // Aborting an imported request mid-decode frees its blocks.
    fill(&mut b, 7, 9);
    b.add_imported(greedy_request(7, tokens(75, 9, 32000), 50), start, now).unwrap();
    b.step(now).unwrap();
    b.abort(RequestId(7));
    let out = run_to_end(&mut b);
    assert_eq!(out[&7].last().unwrap().finish_reason, Some(FinishReason::Cancelled));
    assert_no_blocks_in_use(&b);
}

#[test]
fn fingerprint_and_layout() {
    let tiny = engine(&tiny_llama_dir(), config(4, 16));
    let again = engine(&tiny_llama_dir(), config(8, 16));
    let (l1, l2) = (tiny.kv_layout(), again.kv_layout());
    assert_eq!(l1.model_fingerprint, l2.model_fingerprint, "stable across loads");
    assert_eq!((l1.num_layers, l1.num_kv_heads, l1.head_dim, l1.block_size), (2, 2, 16, 4));
    assert_eq!(l2.block_size, 8);
    let d1 = write_llama("fp-a", small_spec(2, 2));
    let other = TempDir::new("fp-b");
    synth::write_model(&small_spec(2, 2), 8, SynthDtype::F32, &other.0).unwrap();
    let fa = engine(&d1.0, config(4, 16)).kv_layout().model_fingerprint;
    let fb = engine(&other.0, config(4, 16)).kv_layout().model_fingerprint;
    assert_ne!(fa, fb, "same shapes, other weights");
    assert_ne!(fa, l1.model_fingerprint);
}

// ---------------------------------------------------------------------------------------------
// Through the engine threads
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn handoff_between_two_engine_threads_matches_golden() {
    use cleave_engine::model::ModelFiles;
    use cleave_engine::EngineThread;
    let spawn = || {
        EngineThread::spawn(|| {
            let files = ModelFiles::open(&tiny_llama_dir())?;
            EngineCore::load(CpuBackend::default(), files, &config(16, 32))
        })
        .unwrap()
    };
    let (ta, tb) = (spawn(), spawn());
    let (a, b) = (ta.handle(), tb.handle());
    assert_eq!(a.info().kv_layout, b.info().kv_layout);
    let cases = golden()["cases"].as_array().unwrap().clone();
    for (i, case) in cases.iter().enumerate() {
        let req = greedy_request(i as u64, ids(&case["prompt_ids"]), 32);
        b.reserve_import(req.id, req.prompt.len()).unwrap().await.unwrap().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut first = a.submit_prefill_only(req.clone(), KvExport::unbounded(tx)).unwrap();
        let ev = first.next().await.unwrap();
        assert_eq!(ev.finish_reason, None);
        assert!(first.next().await.is_none(), "a prefill-only stream ends after the first token");
        let mut replies = Vec::new();
        let mut done = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                KvExportEvent::Chunk(c) => {
                    replies.push(b.import_kv(c.request_id, c.layer, c.token_start, c.k, c.v).unwrap())
                }
                KvExportEvent::Done(d) => done = Some(d),
            }
        }
        let d = done.expect("Done");
        let start = ImportStart { first_token: d.first_token, sampler_seed: Some(d.sampler_seed), cached_tokens: 0 };
        let mut stream = b.submit_imported(req, start).unwrap();
        for r in replies {
            r.await.unwrap().unwrap();
        }
        let mut got = vec![ev.token_id.unwrap()];
        let mut text = ev.text.clone();
        while let Some(ev) = stream.next().await {
            assert!(ev.error.is_none(), "{ev:?}");
            got.extend(ev.token_id);
            text.push_str(&ev.text);
        }
        assert_eq!(got, ids(&case["generated_ids"]), "case {}", case["name"]);
        assert_eq!(text, case["text_incremental"].as_str().unwrap(), "case {}", case["name"]);
    }
    // A reservation released through the handle, and one left for shutdown.
    b.reserve_import(RequestId(100), 8).unwrap().await.unwrap().unwrap();
    b.release_import(RequestId(100)).unwrap().await.unwrap().unwrap();
    b.reserve_import(RequestId(101), 8).unwrap().await.unwrap().unwrap();
    let snap = b.snapshot().unwrap().await.unwrap();
    assert_eq!((snap.running, snap.kv_blocks_reserved, snap.import_reservations), (0, 1, 1), "{snap:?}");
    assert!(!b.prefix_hashes().unwrap().await.unwrap().is_empty(), "imported prompts are in B's prefix cache");
    let snap = a.snapshot().unwrap().await.unwrap();
    assert_eq!(snap.kv_blocks_in_use, 0, "{snap:?}");
    ta.shutdown().unwrap();
    tb.shutdown().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Migration: resuming a stream on another engine
// ---------------------------------------------------------------------------------------------

#[test]
fn a_resumed_request_continues_the_same_tokens() {
    let dir = tiny_llama_dir();
    let cfg = config(4, 16);
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(77), ..Default::default() };
    for (id, params) in [(1u64, SamplingParams::default()), (2, sampled)] {
        let mut req = greedy_request(id, tokens(80 + id, 19, 32000), 14);
        req.params = params;
        let want = single_engine(&dir, &cfg, std::slice::from_ref(&req))[&id].clone();
        for k in [1usize, 5, 13] {
            let mut b = engine(&dir, cfg.clone());
            b.add_resumed(req.clone(), want[..k].to_vec(), None, Instant::now()).unwrap();
            let evs = &run_to_end(&mut b)[&id];
            assert_eq!(token_ids(evs), want[k..], "resumed after {k}");
            assert_eq!(evs[0].completion_tokens as usize, k + 1);
            assert_eq!(evs.last().unwrap().completion_tokens, 14);
            assert_no_blocks_in_use(&b);
        }
        let mut b = engine(&dir, cfg.clone());
        let e = b.add_resumed(req.clone(), want.clone(), None, Instant::now()).unwrap_err();
        assert!(e.to_string().contains("max_tokens"), "{e}");
    }
}

/// A constrained request handed off after its first token, or resumed after any prefix of its
/// output, continues exactly the tokens one engine generates (sampled, seeded), and that text
/// belongs to the constraint's language: the decode side rebuilt the constraint state from the
/// request and the tokens it was given.
#[test]
fn a_constraint_holds_across_the_handoff_and_a_resume() {
    let dir = tiny_llama_dir();
    let schema = r#"{"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 10}}, "required": ["id", "name"], "additionalProperties": false}"#;
    let constraints = [
        Constraint::JsonSchema(schema.into()),
        Constraint::Regex("[a-z]{3,8}(, [a-z]{3,8}){2}".into()),
        Constraint::Choice(vec!["alpha beta gamma".into(), "alpha delta".into()]),
    ];
    let reqs: Vec<EngineRequest> = constraints
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut r = greedy_request(i as u64 + 1, tokens(40 + i as u64, 21, 32000), 120);
            r.stop.ignore_eos = false;
            r.params = SamplingParams {
                temperature: 1.0,
                seed: Some(99 + i as u64),
                constraint: Some(c.clone()),
                ..Default::default()
            };
            r
        })
        .collect();
    let cfg = config(4, 16);
    let want = single_engine(&dir, &cfg, &reqs);
    let (mut a, mut b) = (engine(&dir, cfg.clone()), engine(&dir, cfg.clone()));
    let (got, _) = run_disagg(&mut a, &mut b, &reqs, &[], &[]);
    assert_eq!(got, want);
    let tok = a.tokenizer().clone();
    let text = |ids: &[u32]| tok.decode(ids, true).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text(&want[&1])).unwrap();
    assert!(v["id"].is_u64() && v["name"].is_string() && v.as_object().unwrap().len() == 2, "{v}");
    assert_eq!(text(&want[&2]).split(", ").count(), 3, "{}", text(&want[&2]));
    assert!(["alpha beta gamma", "alpha delta"].contains(&text(&want[&3]).as_str()), "{}", text(&want[&3]));
    for r in &reqs {
        let full = &want[&r.id.0];
        assert!(full.len() > 2, "{full:?}");
        for k in [1, full.len() / 2, full.len() - 1] {
            let mut b = engine(&dir, cfg.clone());
            b.add_resumed(r.clone(), full[..k].to_vec(), None, Instant::now()).unwrap();
            assert_eq!(token_ids(&run_to_end(&mut b)[&r.id.0]), full[k..], "{} resumed after {k}", r.id);
            assert_no_blocks_in_use(&b);
        }
        // A history the constraint does not allow is refused, holding nothing.
        let mut b = engine(&dir, cfg.clone());
        let bad = tok.encode("!!!", false).unwrap();
        let e = b.add_resumed(r.clone(), bad, None, Instant::now()).unwrap_err();
        assert!(matches!(e, EngineError::Constraint(_)), "{e}");
        assert!(!b.has_work());
        assert_no_blocks_in_use(&b);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn import_chunks_never_fill_the_command_queue_and_wake_an_idle_engine() {
    use cleave_engine::handle::COMMAND_QUEUE;
    use cleave_engine::model::ModelFiles;
    use cleave_engine::EngineThread;
    let thread = EngineThread::spawn(|| {
        let files = ModelFiles::open(&tiny_llama_dir())?;
        EngineCore::load(CpuBackend::default(), files, &config(16, 32))
    })
    .unwrap();
    let b = thread.handle();
    let id = RequestId(1);
    b.reserve_import(id, 2).unwrap().await.unwrap().unwrap();
    let row = bytes::Bytes::from(vec![0u8; 2 * 32 * 4]);
    // More chunks than the command queue holds, sent without waiting (rewrites are harmless).
    let replies: Vec<_> = (0..COMMAND_QUEUE + 100)
        .map(|i| b.import_kv(id, (i % 2) as u32, 0, row.clone(), row.clone()).unwrap())
        .collect();
    // The idle engine applies them without any other command arriving.
    for r in replies {
        tokio::time::timeout(std::time::Duration::from_secs(30), r).await.expect("reply in time").unwrap().unwrap();
    }
    let start = ImportStart { first_token: 5, sampler_seed: None, cached_tokens: 0 };
    let mut s = b.submit_imported(greedy_request(1, vec![1, 2], 3), start).unwrap();
    let mut n = 0;
    while let Some(ev) = s.next().await {
        assert!(ev.error.is_none(), "{ev:?}");
        n += ev.token_id.is_some() as usize;
    }
    assert_eq!(n, 2);
    let snap = b.snapshot().unwrap().await.unwrap();
    assert_eq!((snap.kv_blocks_in_use, snap.kv_blocks_reserved), (0, 0), "{snap:?}");
    thread.shutdown().unwrap();
}

#[test]
fn cancelling_a_prefill_only_request_closes_its_sink_without_done() {
    let dir = tiny_llama_dir();
    let mut a = engine(&dir, config(4, 8));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let now = Instant::now();
    a.add_prefill_only(greedy_request(1, tokens(101, 30, 32000), 4), KvExport::unbounded(tx), now).unwrap();
    a.add_request(greedy_request(2, tokens(102, 6, 32000), 3), now).unwrap();
    let snap = a.snapshot();
    assert_eq!((snap.waiting, snap.queued_prefill_tokens), (2, 36), "{snap:?}");
    a.step(now).unwrap();
    assert_eq!(a.snapshot().queued_prefill_tokens, 36 - 8);
    a.abort(RequestId(1));
    let out = run_to_end(&mut a);
    assert_eq!(out[&1].len(), 1);
    assert_eq!(out[&1][0].finish_reason, Some(FinishReason::Cancelled));
    let mut got = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        got.push(ev);
    }
    assert!(!got.is_empty() && got.iter().all(|e| matches!(e, KvExportEvent::Chunk(_))), "{got:?}");
    assert!(rx.is_closed(), "the sink is dropped with the request");
    assert_eq!(token_ids(&out[&2]).len(), 3);
    assert_no_blocks_in_use(&a);
}

/// Prints what the layer-wise export adds to a prefill's wall time (not a pass/fail test:
/// `cargo test -p cleave-engine --test disagg export_overhead -- --ignored --nocapture`).
#[test]
#[ignore]
fn export_overhead() {
    let spec = synth::preset("small").unwrap();
    let dir = write_llama("overhead", spec);
    let cfg = EngineConfig { enable_prefix_caching: false, kv_cache_memory: 256 << 20, ..EngineConfig::default() };
    let prompt = tokens(5, 2040, spec.vocab_size);
    let mut core = engine(&dir.0, cfg);
    let mut time = |export: bool, id: u64| {
        let t = Instant::now();
        let req = greedy_request(id, prompt.clone(), 2);
        let (tx, rx) = mpsc::unbounded_channel();
        if export {
            core.add_prefill_only(req, KvExport::unbounded(tx), t).unwrap();
        } else {
            core.add_request(
                EngineRequest { stop: cleave_protocol::StopConditions { max_tokens: 1, ..req.stop }, ..req },
                t,
            )
            .unwrap();
        }
        run_to_end(&mut core);
        drop(rx);
        t.elapsed().as_secs_f64()
    };
    let (mut plain, mut with) = (f64::MAX, f64::MAX);
    for i in 0..3 {
        plain = plain.min(time(false, 2 * i));
        with = with.min(time(true, 2 * i + 1));
    }
    let bytes = 2040 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4 * 2;
    println!(
        "prefill 2040 tokens ({} layers, {} KiB of KV): plain {:.1} ms, with export {:.1} ms ({:+.1}%)",
        spec.num_layers,
        bytes / 1024,
        plain * 1e3,
        with * 1e3,
        (with / plain - 1.0) * 100.0
    );
}
