//! The engine core: one model on one backend, its KV storage, the scheduler and the per-request
//! output state (sampler, incremental detokenizer, stop strings). Plain state: [`EngineCore::step`]
//! takes `now` and returns the token events of that step; the thread that drives it lives in
//! [`crate::handle`]. The disaggregation hooks (prefill-only requests with layer-wise KV export,
//! KV import on the decode side) live in `disagg`.

mod disagg;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cleave_constrain::{Compiler, ConstrainError, ConstraintState, Mask};
use cleave_kernels::{AttnSeq, Backend};
use cleave_protocol::{FinishReason, KvDtype, RequestId, SamplingParams, StopConditions, TokenEvent};
use cleave_tokenizer::{IncrementalDecoder, StopMatcher, Tokenizer};

use crate::export::{ExportDone, ExportState, KvChunk, KvExportEvent};
use crate::import::Imports;
use crate::model::{ForwardBatch, KvSpec, KvStorage, LoadOptions, Model, ModelFiles, WeightBytes, Workspace};
use crate::sampler::{Sampler, SamplerScratch};
use crate::sched::{Scheduler, SchedulerConfig, SeqRequest, StepCosts};
use crate::{EngineError, Result};

/// Engine settings; defaults in one place.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// Bytes of K/V cache to allocate.
    pub kv_cache_memory: usize,
    /// What the K/V cache stores: f32, or f16/bf16 (half the memory per block, so twice the
    /// blocks for the same `kv_cache_memory`, and half the bytes on every handoff). Writes
    /// round to nearest even; attention reads widen to f32. Part of the KV layout that two
    /// engines must share to exchange K/V.
    pub kv_dtype: KvDtype,
    /// Most tokens fed per step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output); None: the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// Seeds the samplers of requests that bring no seed of their own.
    pub seed: u64,
    /// Dequantize block-quantized weights (GGUF Q4_1, Q8_0, ...) to f32 at load instead of
    /// multiplying them in their format ([`crate::model::LoadOptions::dequantize_weights`]).
    pub dequantize_weights: bool,
    /// Time per output token that prompt chunks beside running decodes are paced to
    /// ([`crate::sched::pacing`]); None: only `max_num_batched_tokens` limits them. Nodes get
    /// it from the coordinator's target.
    pub tpot_target: Option<std::time::Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_memory: 1 << 30,
            kv_dtype: KvDtype::F32,
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len: None,
            enable_prefix_caching: true,
            seed: 0,
            dequantize_weights: false,
            tpot_target: None,
        }
    }
}

/// One request as the engine takes it: token ids, validated parameters.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopConditions,
}

/// Output-side state of one live request.
struct SeqState {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    sampler: Sampler,
    detok: IncrementalDecoder,
    stop: StopMatcher,
    /// Prompt tokens served from the prefix cache (known after the first step that ran it).
    cached_tokens: u32,
    /// Set for a prefill-only request (see [`crate::export`]).
    export: Option<ExportState>,
    /// For an imported request: the prefill side's `cached_tokens`, reported instead of ours.
    cached_override: Option<u32>,
    /// Where the output stands in `params.constraint`'s language (None: unconstrained). Has
    /// consumed exactly `output`.
    constraint: Option<ConstraintState>,
}

/// Counters of what the engine has done (for benchmarks and metrics).
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// The last step's shape: prompt tokens it computed, and the decodes it carried with their
    /// context (what [`EngineCore::note_step_time`] files the step's time under).
    pub last_prefill_tokens: u64,
    pub last_decode_seqs: u64,
    pub last_decode_context: u64,
    /// Step timings, filed by [`EngineCore::note_step_time`].
    pub totals: cleave_protocol::control::StepTotals,
}

/// The engine's load at one moment, as nodes report it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineSnapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Unreferenced blocks kept for prefix reuse (evictable).
    pub kv_blocks_cached: usize,
    pub kv_blocks_in_use: usize,
    pub preemptions: u64,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Prompt tokens still to compute: waiting requests (whole prompt) and running ones still
    /// in prefill (what is left of it).
    pub queued_prefill_tokens: usize,
    /// KV import reservations not yet turned into running requests (including ones waiting
    /// for a sequence slot).
    pub import_reservations: usize,
    /// Blocks those reservations hold (counted in `kv_blocks_in_use` too).
    pub kv_blocks_reserved: usize,
    /// Most tokens per step now (see [`EngineCore::set_step_budget`]).
    pub step_budget: usize,
    /// Cumulative step timings.
    pub step_totals: cleave_protocol::control::StepTotals,
    /// Steps whose prompt tokens pacing held below the step budget.
    pub paced_steps: u64,
    /// The time per output token steps are paced to (None: not paced).
    pub tpot_target: Option<std::time::Duration>,
    /// Bytes of the KV cache in memory: the blocks ever used ([`crate::kv::BlockPool::num_touched`])
    /// times a block's bytes. Counted, not asked of the OS: `mincore` over a 1 GiB cache took
    /// 0.9 ms, a 64 GiB one would stall a step for tens of milliseconds at every report
    /// ([`KvStorage::resident_bytes`] asks, for tests).
    pub kv_resident_bytes: u64,
}

/// One constrained sequence's mask in the making during a step.
struct Masking {
    seq_id: u64,
    state: ConstraintState,
    mask: std::result::Result<Mask, ConstrainError>,
}

/// An imported request whose K/V is complete, waiting for a free sequence slot.
struct Parked {
    seq: SeqRequest,
    state: SeqState,
    blocks: Vec<u32>,
    first_token: u32,
}

pub struct EngineCore<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: KvStorage<B>,
    /// Activation buffers reused across steps.
    workspace: Workspace<B>,
    sched: Scheduler,
    tokenizer: Tokenizer,
    eos_token_ids: Vec<u32>,
    seqs: HashMap<u64, SeqState>,
    scratch: SamplerScratch,
    seed: u64,
    stats: EngineStats,
    imports: Imports,
    parked: VecDeque<Parked>,
    /// Events produced between steps (imports that ended at once, cancelled parked imports),
    /// returned by the next `step`.
    pending: Vec<TokenEvent>,
    /// Layers whose K/V has been written, over all forward passes (see
    /// [`EngineCore::kv_layers_written`]).
    kv_layers_written: Arc<AtomicU64>,
    /// Compiles request constraints against this model's vocabulary; the error says why this
    /// tokenizer cannot be constrained (requests with a constraint are then refused).
    ///
    /// Built when the first constrained request needs it, not at load (see
    /// [`ConstraintCompiler`]); shared with the engine's handles.
    compiler: Arc<ConstraintCompiler>,
    /// A logits row with a constraint's mask applied (reused).
    masked: Vec<f32>,
    /// The model's identity with this tokenizer's vocabulary (see
    /// [`crate::model::identity`]): the KV layout's fingerprint.
    identity: u64,
    /// Recent step costs, for pacing.
    costs: CostTracker,
}

/// A workspace for at most this many tokens is kept through idle spells ([`EngineCore::on_idle`]):
/// decode batches and short prompts reuse it without a page fault.
pub const IDLE_KEEP_ROWS: usize = 256;

/// The engine's constraint compiler, built once, when the first constrained request needs it.
///
/// Not at load: its token tries (most of them llguidance's slices for JSON strings) take 17 MB
/// for SmolLM2's 49K-token vocabulary, a sixth of that model's file, which a node that is never
/// asked for a constraint should not hold. Building it takes 130 ms for SmolLM2 on the Intel
/// Xeon VM; a node's request handler builds it off the engine thread
/// ([`crate::EngineHandle::prepare_constraints`]) before it submits the first constrained
/// request, so the engine's step does not wait for it. Whoever asks first builds it; the engine
/// thread does only when nothing prepared it (a caller that submits directly).
pub struct ConstraintCompiler {
    cell: std::sync::OnceLock<std::result::Result<Compiler, ConstrainError>>,
    tokenizer: Tokenizer,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
}

impl ConstraintCompiler {
    /// The compiler (or why this vocabulary cannot be constrained), built now if it was not:
    /// this blocks for as long as the build takes, or until another thread's build is done.
    pub fn get(&self) -> &std::result::Result<Compiler, ConstrainError> {
        self.cell.get_or_init(|| {
            let start = Instant::now();
            let compiler = Compiler::new(&self.tokenizer, self.vocab_size, &self.eos_token_ids);
            let took_ms = start.elapsed().as_secs_f64() * 1e3;
            match &compiler {
                Ok(_) => tracing::info!(took_ms, "constraint compiler built for the first constrained request"),
                Err(e) => tracing::warn!(error = %e, "requests that constrain their output will be refused"),
            }
            compiler
        })
    }

    /// Whether [`ConstraintCompiler::get`] would return at once.
    pub fn is_built(&self) -> bool {
        self.cell.get().is_some()
    }
}

/// Moving averages of what a step costs, from [`EngineCore::note_step_time`]: a decode-only step
/// at the recent batch, and the marginal time of a prompt token per chunk size
/// ([`crate::sched::pacing::CHUNK_BUCKETS`]). Averages rather than totals: pacing needs the
/// machine's speed now (shared machines drift), and the decode step's cost moves with the batch.
#[derive(Debug, Clone, Copy, Default)]
struct CostTracker {
    decode_step_s: Option<f64>,
    prompt_token_s: [Option<f64>; crate::sched::pacing::CHUNK_BUCKETS.len()],
}

impl CostTracker {
    /// Weight of the newest step.
    const ALPHA: f64 = 0.2;

    fn ewma(slot: &mut Option<f64>, x: f64) {
        *slot = Some(slot.map_or(x, |v| v + Self::ALPHA * (x - v)));
    }

    /// Files a step that computed `prompt` prompt tokens beside `decodes` decodes in `took_s`.
    /// A chunk below the smallest bucket is not filed (its step's fixed cost dominates); a
    /// mixed step is, less the decode step's cost; a prompt-only step whole (its fixed cost in
    /// the per-token figure: pessimistic where it is used beside decodes, which carry theirs).
    fn observe(&mut self, prompt: u64, decodes: u64, took_s: f64) {
        if prompt == 0 {
            if decodes > 0 {
                Self::ewma(&mut self.decode_step_s, took_s);
            }
            return;
        }
        let Some(bucket) = crate::sched::pacing::chunk_bucket(prompt as usize) else { return };
        let beside = match (decodes, self.decode_step_s) {
            (0, _) => 0.0,
            (_, Some(d)) => d,
            (_, None) => return,
        };
        let per_token = (took_s - beside).max(0.0) / prompt as f64;
        if per_token > 0.0 {
            Self::ewma(&mut self.prompt_token_s[bucket], per_token);
        }
    }

    fn costs(&self) -> StepCosts {
        let d = |s: f64| std::time::Duration::from_secs_f64(s);
        StepCosts {
            decode_step: d(self.decode_step_s.unwrap_or(0.0)),
            prompt_token: self.prompt_token_s.map(|p| p.map(d)),
        }
    }
}

impl<B: Backend> EngineCore<B> {
    /// Loads the weights of `files` onto `backend` and sizes the KV cache from `cfg`.
    pub fn load(backend: B, files: ModelFiles, cfg: &EngineConfig) -> Result<Self> {
        let eos_token_ids = files.eos_token_ids();
        let opts = LoadOptions { dequantize_weights: cfg.dequantize_weights };
        let model = Model::load_with(&backend, files.config.clone(), files.source.as_ref(), opts)?;
        tracing::info!(model = %files.path.display(), weights = %model.weight_bytes(&backend), "model loaded: weights a decode step reads");
        Self::new(backend, model, files.tokenizer, eos_token_ids, cfg)
    }

    pub fn new(
        backend: B,
        model: Model<B>,
        tokenizer: Tokenizer,
        eos_token_ids: Vec<u32>,
        cfg: &EngineConfig,
    ) -> Result<Self> {
        let num_blocks =
            KvStorage::<B>::blocks_for_budget(&model.config, cfg.block_size, cfg.kv_dtype, cfg.kv_cache_memory);
        if num_blocks == 0 {
            return Err(EngineError::Rejected(format!(
                "kv cache memory of {} bytes holds no block of {} bytes",
                cfg.kv_cache_memory,
                KvStorage::<B>::bytes_per_block(&model.config, cfg.block_size, cfg.kv_dtype)
            )));
        }
        let max_model_len =
            cfg.max_model_len.unwrap_or(model.config.max_position_embeddings).min(model.max_positions());
        let mut sched = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_num_seqs: cfg.max_num_seqs,
            block_size: cfg.block_size,
            num_blocks,
            max_model_len,
            enable_prefix_caching: cfg.enable_prefix_caching,
            long_prefill_threshold: None,
        })?;
        sched.set_tpot_target(cfg.tpot_target)?;
        let kv = KvStorage::new(
            &backend,
            &model.config,
            KvSpec { num_blocks, block_size: cfg.block_size, dtype: cfg.kv_dtype },
        )?;
        let identity = crate::model::identity::with_vocabulary(model.identity(), &tokenizer);
        let compiler = Arc::new(ConstraintCompiler {
            cell: std::sync::OnceLock::new(),
            tokenizer: tokenizer.clone(),
            vocab_size: model.config.vocab_size,
            eos_token_ids: eos_token_ids.clone(),
        });
        Ok(Self {
            backend,
            model,
            kv,
            workspace: Workspace::default(),
            sched,
            tokenizer,
            eos_token_ids,
            seqs: HashMap::new(),
            scratch: SamplerScratch::default(),
            seed: cfg.seed,
            stats: EngineStats::default(),
            imports: Imports::default(),
            parked: VecDeque::new(),
            pending: Vec::new(),
            kv_layers_written: Arc::default(),
            compiler,
            masked: Vec::new(),
            identity,
            costs: CostTracker::default(),
        })
    }

    /// The constraint compiler this core uses, for its handles.
    pub fn constraint_compiler(&self) -> Arc<ConstraintCompiler> {
        self.compiler.clone()
    }

    /// What the weights are: their fingerprint (differs between formats of one model, unlike
    /// the identity in [`EngineCore::kv_layout`]) and their formats, largest first.
    pub fn weights(&self) -> cleave_protocol::WeightsInfo {
        let bytes = self.model.weight_bytes(&self.backend);
        let formats: Vec<&str> = bytes.by_format.iter().map(|(f, _)| *f).collect();
        cleave_protocol::WeightsInfo { fingerprint: self.model.fingerprint(), format: formats.join("+") }
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// What a decode step reads of the model's weights, in the formats they are held in.
    pub fn weight_bytes(&self) -> WeightBytes {
        self.model.weight_bytes(&self.backend)
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Bytes of the KV cache resident in memory as the OS says ([`KvStorage::resident_bytes`]),
    /// which [`EngineSnapshot::kv_resident_bytes`] counts in blocks instead (for tests and tools:
    /// it walks every pool's page table).
    pub fn kv_resident_bytes_measured(&self) -> usize {
        self.kv.resident_bytes(&self.backend)
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        let kv = self.sched.kv();
        EngineSnapshot {
            waiting: self.sched.num_waiting(),
            running: self.sched.num_running(),
            kv_blocks_total: kv.num_blocks(),
            kv_blocks_free: kv.num_free(),
            kv_blocks_cached: kv.num_cached(),
            kv_blocks_in_use: kv.num_in_use(),
            preemptions: self.sched.num_preemptions(),
            steps: self.stats.steps,
            prefill_tokens: self.stats.prefill_tokens,
            decode_tokens: self.stats.decode_tokens,
            queued_prefill_tokens: self.sched.num_pending_prefill_tokens(),
            import_reservations: self.imports.len() + self.parked.len(),
            kv_blocks_reserved: self.imports.num_blocks() + self.parked.iter().map(|p| p.blocks.len()).sum::<usize>(),
            step_budget: self.sched.config().max_num_batched_tokens,
            step_totals: self.stats.totals,
            paced_steps: self.sched.num_paced_steps(),
            tpot_target: self.sched.tpot_target(),
            kv_resident_bytes: (kv.num_touched()
                * KvStorage::<B>::bytes_per_block(&self.model.config, self.kv.block_size(), self.kv.dtype()))
                as u64,
        }
    }

    /// Paces prompt chunks beside running decodes to `target` time per output token (None:
    /// the step budget alone limits them); takes effect at the next step.
    pub fn set_tpot_target(&mut self, target: Option<std::time::Duration>) -> Result<()> {
        self.sched.set_tpot_target(target).map_err(EngineError::from)
    }

    /// Changes the most tokens one step feeds (a colocated node trades time to first token for
    /// time per output token with it). Takes effect at the next step; running requests keep
    /// their progress.
    pub fn set_step_budget(&mut self, tokens: usize) -> Result<()> {
        self.sched.set_max_num_batched_tokens(tokens).map_err(EngineError::from)
    }

    /// Files the wall time of the step just run (measured by the caller, which owns the clock):
    /// a step of prompt tokens only as prefill time, a step of decodes only as decode time, a
    /// mixed step apart; an empty one is not counted.
    pub fn note_step_time(&mut self, took: std::time::Duration) {
        let us = took.as_micros() as u64;
        self.costs.observe(self.stats.last_prefill_tokens, self.stats.last_decode_seqs, took.as_secs_f64());
        self.sched.set_step_costs(self.costs.costs());
        let st = &mut self.stats;
        if st.last_prefill_tokens > 0 && st.last_decode_seqs > 0 {
            // A mixed step (a chunk beside decodes): its time is neither a prefill's nor a
            // decode step's, and filed as either it would skew the per-token or per-step cost
            // that planners calibrate from these totals; filed apart, as time the running
            // sequences waited for their tokens.
            st.totals.mixed_steps += 1;
            st.totals.mixed_seqs += st.last_decode_seqs;
            st.totals.mixed_us += us;
        } else if st.last_prefill_tokens > 0 {
            st.totals.prefill_tokens += st.last_prefill_tokens;
            st.totals.prefill_us += us;
        } else if st.last_decode_seqs > 0 {
            st.totals.decode_steps += 1;
            st.totals.decode_seqs += st.last_decode_seqs;
            st.totals.decode_context += st.last_decode_context;
            st.totals.decode_us += us;
        }
        st.last_prefill_tokens = 0;
        st.last_decode_seqs = 0;
        st.last_decode_context = 0;
    }

    /// Keys of the blocks in the prefix cache ([`crate::kv::hash_chain`] of a prompt with this
    /// engine's block size names the blocks a request could reuse), for routing.
    pub fn cached_prefix_hashes(&self) -> Vec<u64> {
        self.sched.cached_hashes().collect()
    }

    /// A counter of layers whose K/V a forward pass has written, bumped right after each
    /// layer's KV export hook: a sink that reads it sees how far the pass is (tests use it to
    /// prove that layer `l` is exported before layer `l + 1` runs).
    pub fn kv_layers_written(&self) -> Arc<AtomicU64> {
        self.kv_layers_written.clone()
    }

    pub fn max_model_len(&self) -> usize {
        self.sched.config().max_model_len
    }

    /// Called by the engine loop once it has been idle a while: gives back the activation
    /// workspace if it was grown past [`IDLE_KEEP_ROWS`] tokens. The workspace keeps the
    /// largest step's size (one 2048-token prefill step of SmolLM2: about 64 MB, most of it
    /// the MLP's three `tokens x 1536` buffers), which a node would otherwise hold for good
    /// after one long prompt. The next step that needs it pays its page faults again (not
    /// measured: 64 MB is 16K pages, beside a 2048-token SmolLM2 prefill of about 2 s at the
    /// ~1,000 tokens/s `cleave bench engine` gives for 256 tokens here).
    pub fn on_idle(&mut self) {
        let rows = self.workspace.tokens();
        if rows > IDLE_KEEP_ROWS {
            self.workspace = Workspace::default();
            tracing::debug!(rows, "idle: released the activation workspace");
        }
    }

    /// Tokens the activation workspace is sized for (0 when it holds nothing).
    pub fn workspace_rows(&self) -> usize {
        self.workspace.tokens()
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.sched.is_idle() || !self.pending.is_empty() || !self.parked.is_empty()
    }

    /// Queues a request. Rejects (without side effects) one that can never be served.
    pub fn add_request(&mut self, req: EngineRequest, now: Instant) -> Result<()> {
        self.check_request(&req)?;
        if self.imports.contains(req.id.0) || self.parked.iter().any(|p| p.seq.id == req.id.0) {
            return Err(EngineError::DuplicateImport { id: req.id });
        }
        let constraint = self.start_constraint(&req, &[])?;
        let id = req.id.0;
        let seq = self.seq_request(&req, now);
        self.sched.add(seq)?;
        let mut state = self.seq_state(req, None);
        state.constraint = constraint;
        self.seqs.insert(id, state);
        Ok(())
    }

    /// The constraint state of `req` after `history` (its output so far), when it has one.
    fn start_constraint(&self, req: &EngineRequest, history: &[u32]) -> Result<Option<ConstraintState>> {
        let Some(c) = &req.params.constraint else { return Ok(None) };
        let compiler = self.compiler.get().as_ref().map_err(|e| EngineError::Constraint(e.clone()))?;
        Ok(Some(compiler.start(c, history)?))
    }

    /// Checks what the scheduler cannot: sampling parameters and token ids.
    fn check_request(&self, req: &EngineRequest) -> Result<()> {
        req.params.validate().map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= self.model.config.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.model.config.vocab_size
            )));
        }
        Ok(())
    }

    fn seq_request(&self, req: &EngineRequest, now: Instant) -> SeqRequest {
        SeqRequest {
            id: req.id.0,
            prompt: req.prompt.clone(),
            max_tokens: req.stop.max_tokens,
            eos_token_ids: self.eos_token_ids.clone(),
            stop_token_ids: req.stop.stop_token_ids.clone(),
            ignore_eos: req.stop.ignore_eos,
            arrival: now,
        }
    }

    /// The output-side state of a new request; `seed` overrides the sampler's seed.
    fn seq_state(&self, req: EngineRequest, seed: Option<u64>) -> SeqState {
        // Requests without a seed get one derived from the engine seed and their id, so a run
        // is reproducible without every request repeating the same random stream.
        let fallback = self.seed ^ req.id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let params = match seed {
            Some(s) => SamplingParams { seed: Some(s), ..req.params.clone() },
            None => req.params.clone(),
        };
        SeqState {
            sampler: Sampler::new(&params, fallback),
            detok: IncrementalDecoder::new(self.tokenizer.clone(), &req.prompt),
            stop: StopMatcher::new(req.stop.stop_strings.iter().cloned()),
            params: req.params,
            prompt: req.prompt,
            output: Vec::new(),
            cached_tokens: 0,
            export: None,
            cached_override: None,
            constraint: None,
        }
    }

    /// Cancels a request; its blocks are freed at the next step, which reports it `Cancelled`.
    /// Also releases a KV import reservation of that id (see [`crate::import`]).
    pub fn abort(&mut self, id: RequestId) {
        // Unknown ids (already finished) are fine: cancellation races completion.
        let _ = self.sched.abort(id.0);
        self.abort_import(id);
    }

    /// The final event of a request that failed.
    pub fn error_event(&self, id: RequestId, err: &EngineError) -> TokenEvent {
        TokenEvent::failed(id, 0, 0, err.to_string())
    }

    /// Runs one iteration: schedule, forward, sample, commit. Returns the events it produced.
    pub fn step(&mut self, now: Instant) -> Result<Vec<TokenEvent>> {
        let mut events = std::mem::take(&mut self.pending);
        self.admit_parked(&mut events)?;
        let batch = self.sched.schedule(now)?;
        for &(id, reason) in &batch.finished {
            if let Some(seq) = self.seqs.remove(&id) {
                events.push(self.final_event(id, &seq, reason));
            }
        }
        for &(src, dst) in &batch.copies {
            self.kv.copy_block(&self.backend, src, dst)?;
        }
        if batch.items.is_empty() {
            return Ok(events);
        }
        self.stats.steps += 1;
        self.stats.last_prefill_tokens = 0;
        self.stats.last_decode_seqs = 0;
        self.stats.last_decode_context = 0;
        let block_size = self.kv.block_size();
        let mut tokens = Vec::with_capacity(batch.num_tokens());
        let mut positions = Vec::with_capacity(batch.num_tokens());
        let mut slots = Vec::with_capacity(batch.num_tokens());
        let mut logit_rows = Vec::new();
        let mut seqs = Vec::with_capacity(batch.items.len());
        for item in &batch.items {
            let q_start = tokens.len();
            tokens.extend_from_slice(&item.token_ids);
            positions.extend((item.start_pos..item.start_pos + item.token_ids.len()).map(|p| p as u32));
            slots.extend(item.slots(block_size));
            seqs.push(AttnSeq {
                q_start,
                q_len: item.token_ids.len(),
                context_len: item.start_pos + item.token_ids.len(),
                block_table: &item.block_table,
            });
            if item.sample {
                logit_rows.push((tokens.len() - 1) as u32);
            }
            if item.token_ids.len() == 1 && item.start_pos > 0 && item.sample {
                self.stats.decode_tokens += 1;
                self.stats.last_decode_seqs += 1;
                self.stats.last_decode_context += item.start_pos as u64 + 1;
            } else {
                self.stats.prefill_tokens += item.token_ids.len() as u64;
                self.stats.last_prefill_tokens += item.token_ids.len() as u64;
            }
        }
        let fwd = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logit_rows: &logit_rows,
        };
        let exports = self.export_cached(&batch)?;
        let mut masking = self.take_constraints(&batch);
        let (backend, seqs_state, written) = (&self.backend, &mut self.seqs, &self.kv_layers_written);
        let mut on_kv = |layer: usize, kv: &KvStorage<B>| -> Result<()> {
            for item in &exports {
                let Some(exp) = seqs_state.get_mut(&item.seq_id).and_then(|s| s.export.as_mut()) else { continue };
                let (k, v) = kv.export_rows(backend, layer, &item.block_table, item.from, item.to)?;
                exp.send(KvExportEvent::Chunk(KvChunk {
                    request_id: RequestId(item.seq_id),
                    layer: layer as u32,
                    token_start: item.from as u32,
                    token_count: (item.to - item.from) as u32,
                    k,
                    v,
                }));
            }
            written.fetch_add(1, Ordering::Relaxed);
            Ok(())
        };
        let (model, kv, workspace) = (&self.model, &mut self.kv, &mut self.workspace);
        let mut masks = HashMap::with_capacity(masking.len());
        let logits = if masking.is_empty() {
            model.forward_hooked(backend, fwd, kv, workspace, &mut on_kv)?
        } else {
            // The masks of constrained sequences are computed on a thread of their own while
            // the forward pass runs, so that they add to the step only what outlasts the pass.
            let ids: Vec<(u64, &'static str)> = masking.iter().map(|m| (m.seq_id, m.state.kind())).collect();
            let (logits, done) = std::thread::scope(|scope| {
                let worker = scope.spawn(move || {
                    for m in &mut masking {
                        let mut mask = Mask::default();
                        m.mask = m.state.fill_mask(&mut mask).map(|()| mask);
                    }
                    masking
                });
                let logits = model.forward_hooked(backend, fwd, kv, workspace, &mut on_kv);
                (logits, worker.join())
            });
            match done {
                Ok(masking) => {
                    for m in masking {
                        if let Some(seq) = self.seqs.get_mut(&m.seq_id) {
                            seq.constraint = Some(m.state);
                        }
                        masks.insert(m.seq_id, m.mask);
                    }
                }
                // fill_mask does not panic (llguidance catches its own panics); were it to,
                // its sequences fail below rather than go on unconstrained.
                Err(_) => {
                    for (id, kind) in ids {
                        masks.insert(
                            id,
                            Err(ConstrainError::Failed { kind, reason: "mask computation panicked".into() }),
                        );
                    }
                }
            }
            logits?
        };
        let mut failed = self.finish_exports(&exports, &mut events)?;
        let vocab = self.model.config.vocab_size;
        let mut outputs = Vec::with_capacity(logit_rows.len());
        let mut logprobs = HashMap::new();
        for (row, item) in batch.items.iter().filter(|i| i.sample).enumerate() {
            if failed.contains(&item.seq_id) {
                outputs.push((item.seq_id, 0)); // ignored: the sequence is finishing
                continue;
            }
            let seq = self
                .seqs
                .get_mut(&item.seq_id)
                .ok_or_else(|| EngineError::Rejected(format!("scheduled unknown sequence {}", item.seq_id)))?;
            let mut row_logits = &logits[row * vocab..(row + 1) * vocab];
            let mask = match masks.remove(&item.seq_id) {
                Some(Ok(mask)) => Some(mask),
                Some(Err(e)) => {
                    self.fail_seq(item.seq_id, e.into(), &mut events, &mut failed)?;
                    outputs.push((item.seq_id, 0)); // ignored: the sequence is finishing
                    continue;
                }
                None => None,
            };
            if let Some(mask) = &mask {
                // Tokens outside the language get -inf before any penalty or filter; the
                // logprobs reported are those of the constrained distribution.
                self.masked.clear();
                self.masked.extend_from_slice(row_logits);
                mask.apply(&mut self.masked);
                row_logits = &self.masked;
            }
            let sampled = seq.sampler.sample(row_logits, &seq.params, &seq.prompt, &seq.output, &mut self.scratch)?;
            if let Some(c) = seq.constraint.as_mut() {
                if let Err(e) = c.commit(sampled.token) {
                    self.fail_seq(item.seq_id, e.into(), &mut events, &mut failed)?;
                    outputs.push((item.seq_id, 0));
                    continue;
                }
            }
            outputs.push((item.seq_id, sampled.token));
            if let Some(lp) = sampled.logprobs {
                logprobs.insert(item.seq_id, lp);
            }
        }
        let updates = self.sched.commit(&outputs, now)?;
        let max_model_len = self.max_model_len();
        for upd in updates {
            let Some(seq) = self.seqs.get_mut(&upd.seq_id) else { continue };
            seq.output.push(upd.token);
            seq.cached_tokens = seq.cached_override.unwrap_or(upd.cached_tokens);
            let text = seq.detok.push(upd.token)?;
            // A prefill-only request is scheduled with max_tokens 1: tell a real end from a
            // handoff (None).
            let mut finish = match &seq.export {
                Some(exp) => disagg::handoff_finish(upd.finish, exp.max_tokens, seq.prompt.len() + 1 >= max_model_len),
                None => upd.finish,
            };
            if seq.constraint.as_ref().is_some_and(ConstraintState::is_done) && finish != Some(FinishReason::Stop) {
                // The text is complete and nothing may follow it: stop now rather than spend a
                // step on the end-of-sequence token the mask would force.
                if upd.finish.is_none() {
                    self.sched.finish(upd.seq_id, FinishReason::Stop)?;
                }
                finish = Some(FinishReason::Stop);
            }
            let mut out = seq.stop.push(&text);
            if out.stopped {
                if upd.finish.is_none() {
                    // Ended by a stop string, which the scheduler cannot see.
                    self.sched.finish(upd.seq_id, FinishReason::Stop)?;
                }
                finish = Some(FinishReason::Stop);
            } else if finish.is_some() {
                let tail = seq.detok.finish()?;
                let more = seq.stop.push(&tail);
                out.emit.push_str(&more.emit);
                if !more.stopped {
                    out.emit.push_str(&seq.stop.flush());
                }
            }
            let event = TokenEvent {
                request_id: RequestId(upd.seq_id),
                token_id: Some(upd.token),
                text: out.emit,
                logprobs: logprobs.remove(&upd.seq_id),
                finish_reason: finish,
                prompt_tokens: upd.prompt_tokens,
                cached_tokens: seq.cached_tokens,
                completion_tokens: upd.num_generated,
                error: None,
            };
            if let Some(exp) = seq.export.as_mut() {
                exp.send(KvExportEvent::Done(ExportDone {
                    request_id: RequestId(upd.seq_id),
                    first_token: upd.token,
                    finish,
                    prompt_tokens: upd.prompt_tokens,
                    cached_tokens: seq.cached_tokens,
                    sampler_seed: seq.sampler.seed(),
                }));
                let failed = exp.failed;
                // The engine is done with it either way; the scheduler already freed it.
                self.seqs.remove(&upd.seq_id);
                let id = RequestId(upd.seq_id);
                events.push(match failed {
                    Some(source) => self.error_event(id, &EngineError::KvExport { id, source }),
                    None => event,
                });
                continue;
            }
            events.push(event);
            if finish.is_some() {
                self.seqs.remove(&upd.seq_id);
            }
        }
        Ok(events)
    }

    /// Takes the constraint states of this step's sampling items out of their sequences, to
    /// compute their masks beside the forward pass (they are put back right after it).
    fn take_constraints(&mut self, batch: &crate::sched::Batch) -> Vec<Masking> {
        let mut out = Vec::new();
        for item in batch.items.iter().filter(|i| i.sample) {
            if let Some(state) = self.seqs.get_mut(&item.seq_id).and_then(|s| s.constraint.take()) {
                out.push(Masking { seq_id: item.seq_id, state, mask: Ok(Mask::default()) });
            }
        }
        out
    }

    /// Ends a running sequence with `err` mid-step: its error event now, its blocks freed by
    /// the scheduler, and its row ignored by `commit` (the id goes into `failed`).
    fn fail_seq(
        &mut self,
        id: u64,
        err: EngineError,
        events: &mut Vec<TokenEvent>,
        failed: &mut std::collections::HashSet<u64>,
    ) -> Result<()> {
        self.seqs.remove(&id);
        events.push(self.error_event(RequestId(id), &err));
        if self.sched.contains(id) {
            self.sched.finish(id, FinishReason::Error)?;
        }
        failed.insert(id);
        Ok(())
    }

    fn final_event(&self, id: u64, seq: &SeqState, reason: FinishReason) -> TokenEvent {
        TokenEvent {
            request_id: RequestId(id),
            token_id: None,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(reason),
            prompt_tokens: seq.prompt.len() as u32,
            cached_tokens: seq.cached_tokens,
            completion_tokens: seq.output.len() as u32,
            error: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CostTracker;

    #[test]
    fn step_costs_come_from_pure_and_mixed_steps_by_chunk_size_and_ignore_tiny_prompts() {
        let per_token = |c: &CostTracker, b: usize| c.costs().prompt_token[b].map(|d| d.as_secs_f64());
        let close = |x: Option<f64>, y: f64| x.is_some_and(|x| (x - y).abs() < 1e-9);
        let mut c = CostTracker::default();
        assert!(!c.costs().known(), "no prompt cost measured yet");
        // A mixed step before any decode-only one says nothing about a prompt token.
        c.observe(64, 2, 0.2);
        assert!(!c.costs().known());
        c.observe(0, 4, 0.02);
        c.observe(128, 0, 0.25);
        assert!(close(per_token(&c, 5), 0.25 / 128.0));
        assert!((c.costs().decode_step.as_secs_f64() - 0.02).abs() < 1e-9);
        // A mixed step with a 20-token chunk: (0.1 - 0.02) / 20 = 4 ms a token, in its own bucket.
        c.observe(20, 4, 0.1);
        assert!(close(per_token(&c, 2), 0.004));
        assert!(close(per_token(&c, 5), 0.25 / 128.0));
        // A 1-token prefill step (a prompt wholly in the prefix cache) is its fixed cost.
        c.observe(1, 0, 0.02);
        c.observe(2, 4, 0.03);
        assert!(close(per_token(&c, 2), 0.004));
        // A slower machine moves the average a fifth of the way per step.
        c.observe(20, 4, 0.12);
        assert!(close(per_token(&c, 2), 0.0042));
    }
}
