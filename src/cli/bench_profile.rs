//! `cleave bench profile`: measures the engine's cost profile for `cleave bench simulate`: prefill
//! wall time against prompt length (cold, and after a cached prefix), decode step time against
//! batch × context, and steps that mix one prefill chunk with decodes. Drives `EngineCore`
//! directly with token-id prompts (as `bench engine` does), so no tokenizer or HTTP is timed.
//!
//! Decode cells share one long prompt prefix through the prefix cache (each sequence gets its own
//! 8-token tail), so filling a batch of 32 × 2048 costs one 2048-token prefill rather than 32.
//! The KV the decode step reads is then partly shared, which can flatter the attention part of
//! large cells on a CPU whose cache holds the shared blocks; the weights dominate at these sizes.
//!
//! Cost of the default grid with 1 thread on the ~100M base-100m: 209 s before the grid was
//! trimmed (a second cached-prefix point, mixed steps at batch 16, a fifth timed decode step);
//! about 175 s then, more since prefill and mixed points are medians of three. Prefill at 4096
//! alone takes ~40 s of it.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Instant, SystemTime};

use anyhow::{bail, Context};
use cleave_bench::sim::profile::{DecodePoint, MixedPoint, PrefillPoint, Profile, PROFILE_VERSION};
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
use cleave_protocol::{RequestId, SamplingParams, StopConditions};

use super::EngineArgs;

/// Tokens of each decode sequence's own tail after the shared prefix.
const TAIL: usize = 8;

#[derive(clap::Args, Debug)]
pub struct BenchProfileArgs {
    /// Model: a Hugging Face folder, a .gguf file, or a hub id (owner/name[@revision]).
    #[arg(long, env = "CLEAVE_MODEL")]
    model: PathBuf,
    /// Where to write the profile JSON.
    #[arg(long, default_value = "profile.json")]
    output: PathBuf,
    /// A tiny grid (seconds on any model), for tests.
    #[arg(long)]
    quick: bool,
    /// Cold prompt lengths to time prefill at (clamped below the model's length limit).
    #[arg(long, value_delimiter = ',', default_values_t = [16usize, 64, 256, 512, 1024, 2048, 4096])]
    prefill: Vec<usize>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8, 16, 32])]
    batches: Vec<usize>,
    /// Decode context lengths (tokens per sequence).
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 512, 1024, 2048])]
    contexts: Vec<usize>,
    /// Decode steps timed per cell (their median is recorded).
    #[arg(long, default_value_t = 4)]
    decode_steps: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

struct Bench {
    core: EngineCore<CpuBackend>,
    vocab: usize,
    next_id: u64,
}

impl Bench {
    fn add(&mut self, prompt: Vec<u32>, max_tokens: u32) -> anyhow::Result<u64> {
        self.next_id += 1;
        let req = EngineRequest {
            id: RequestId(self.next_id),
            prompt,
            params: SamplingParams::default(),
            stop: StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
        };
        self.core.add_request(req, Instant::now())?;
        Ok(self.next_id)
    }

    fn drain(&mut self) -> anyhow::Result<()> {
        while self.core.has_work() {
            self.core.step(Instant::now())?;
        }
        Ok(())
    }

    fn fresh(&mut self, len: usize) -> Vec<u32> {
        super::bench_engine::prompt(len, self.vocab, 1_000_003 + self.next_id)
    }

    /// Seconds to prefill `p` (one step: the token budget holds it) and sample its first token.
    fn time_prefill(&mut self, p: Vec<u32>) -> anyhow::Result<f64> {
        self.add(p, 1)?;
        let t = Instant::now();
        self.drain()?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Starts `batch` sequences of `context` tokens sharing `base`'s prefix and steps until each
    /// has its first token. Returns their ids.
    fn start_decodes(
        &mut self,
        base: &[u32],
        batch: usize,
        context: usize,
        max_tokens: u32,
    ) -> anyhow::Result<Vec<u64>> {
        let mut ids = Vec::with_capacity(batch);
        for _ in 0..batch {
            let mut p = base[..context - TAIL].to_vec();
            p.extend(self.fresh(TAIL));
            ids.push(self.add(p, max_tokens)?);
        }
        let want: HashSet<u64> = ids.iter().copied().collect();
        let mut started = HashSet::new();
        while started.len() < batch {
            if !self.core.has_work() {
                bail!("engine went idle before {batch} sequences started");
            }
            for e in self.core.step(Instant::now())? {
                if e.token_id.is_some() && want.contains(&e.request_id.0) {
                    started.insert(e.request_id.0);
                }
            }
        }
        Ok(ids)
    }

    fn stop(&mut self, ids: &[u64]) -> anyhow::Result<()> {
        for &id in ids {
            self.core.abort(RequestId(id));
        }
        self.drain()
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

pub fn run(mut args: BenchProfileArgs) -> anyhow::Result<()> {
    if args.quick {
        args.prefill = vec![16, 64, 128];
        args.batches = vec![1, 2];
        args.contexts = vec![32, 64];
        args.decode_steps = 2;
    }
    if args.prefill.is_empty() || args.batches.is_empty() || args.contexts.is_empty() || args.decode_steps == 0 {
        bail!("--prefill, --batches, --contexts and --decode-steps must be non-empty");
    }
    if args.batches.contains(&0) || args.contexts.iter().any(|&c| c <= TAIL + 16) {
        bail!("batches must be positive and contexts above {} tokens", TAIL + 16);
    }
    anyhow::ensure!(
        args.engine.device == super::Device::Cpu,
        "cleave bench profile measures the CPU engine only (no --device)"
    );
    let backend = CpuBackend::new(args.engine.threads)?;
    let threads = backend.threads();
    let path = super::model_source::resolve_model(&args.model)?;
    let files = ModelFiles::open(&path).with_context(|| format!("opening model {}", args.model.display()))?;
    let mcfg = files.config.clone();
    let configured: EngineConfig = args.engine.to_config();
    let limit = configured.max_model_len.unwrap_or(mcfg.max_position_embeddings).min(mcfg.max_position_embeddings);
    // Prefill points leave room for the sampled token.
    let mut prefill_lens: Vec<usize> = args.prefill.iter().map(|&n| n.clamp(1, limit - 1)).collect();
    prefill_lens.sort_unstable();
    prefill_lens.dedup();
    let max_ctx = *args.contexts.iter().max().unwrap_or(&0);
    let max_batch = *args.batches.iter().max().unwrap_or(&1);
    if max_ctx + args.decode_steps + 4 > limit {
        bail!("context {max_ctx} plus {} steps exceeds the model's {limit} positions", args.decode_steps);
    }
    // Measure with a budget that fits every prompt in one step; record the configured limits.
    let mut ecfg = configured.clone();
    ecfg.enable_prefix_caching = true;
    ecfg.max_model_len = Some(limit);
    ecfg.max_num_batched_tokens = ecfg.max_num_batched_tokens.max(limit).max(max_batch * (TAIL + 16) + 4096);
    ecfg.max_num_seqs = ecfg.max_num_seqs.max(max_batch + 1);
    let core = EngineCore::load(backend, files, &ecfg)?;
    let snap = core.snapshot();
    let kv_bytes_per_token = (2 * mcfg.num_layers * mcfg.kv_width() * ecfg.kv_dtype.size_bytes()) as u64;
    let kv_capacity_tokens = snap.kv_blocks_total * ecfg.block_size;
    let mut b = Bench { core, vocab: mcfg.vocab_size, next_id: 0 };
    let name = path.file_name().map_or_else(|| args.model.display().to_string(), |s| s.to_string_lossy().into_owned());
    eprintln!("profiling {name} with {threads} threads ({kv_capacity_tokens} KV tokens)...");
    let started = Instant::now();

    // Warm-up: first-touch of the weights and workspace.
    let p = b.fresh(prefill_lens[0]);
    b.time_prefill(p)?;
    let mut prefill = Vec::new();
    for &n in &prefill_lens {
        // One timing is noisy on a shared machine: the median of three (one for a prompt over
        // 5 s, where noise is relatively small and repeats are dear).
        let mut ts = Vec::new();
        for _ in 0..3 {
            let p = b.fresh(n);
            ts.push(b.time_prefill(p)?);
            if ts[0] > 5.0 {
                break;
            }
        }
        prefill.push(PrefillPoint { tokens: n, cached_prefix: 0, seconds: median(ts) });
    }
    // After a cached prefix: prefill the prefix alone, then the whole prompt.
    let block = ecfg.block_size;
    let cached_pairs: Vec<(usize, usize)> = if args.quick { vec![(16, 64)] } else { vec![(256, 1024)] };
    for (n, c) in cached_pairs {
        let c = c / block * block;
        if c == 0 || n + c >= limit {
            continue;
        }
        let full = b.fresh(n + c);
        b.time_prefill(full[..c].to_vec())?;
        prefill.push(PrefillPoint { tokens: n, cached_prefix: c, seconds: b.time_prefill(full)? });
    }
    // Decode grid, and mixed steps at the smallest context above 256 (or the largest).
    let base = b.fresh(max_ctx);
    b.time_prefill(base.clone())?;
    let mut decode = Vec::new();
    let steps = args.decode_steps;
    for &ctx in &args.contexts {
        for &batch in &args.batches {
            let ids = b.start_decodes(&base, batch, ctx, (steps + 3) as u32)?;
            b.core.step(Instant::now())?; // untimed
            let mut ts = Vec::with_capacity(steps);
            for _ in 0..steps {
                let t = Instant::now();
                b.core.step(Instant::now())?;
                ts.push(t.elapsed().as_secs_f64());
            }
            b.stop(&ids)?;
            decode.push(DecodePoint { batch, context: ctx, seconds: median(ts) });
        }
    }
    let mix_ctx = args.contexts.iter().copied().filter(|&c| c >= 256).min().unwrap_or(max_ctx);
    // Chunks from the size of a tuned chunked-prefill budget (64-256, where colocated nodes
    // under decode-heavy load live) to a whole prompt; each the median of three steps.
    let (mix_batches, mix_chunks): (Vec<usize>, Vec<usize>) =
        if args.quick { (vec![2], vec![32]) } else { (vec![4, 16], vec![64, 256, 1024]) };
    let mut mixed = Vec::new();
    for &batch in mix_batches.iter().filter(|&&x| x <= max_batch.max(2)) {
        for &chunk in &mix_chunks {
            let mut ts = Vec::new();
            for _ in 0..if args.quick { 1 } else { 3 } {
                let ids = b.start_decodes(&base, batch, mix_ctx, 8)?;
                b.core.step(Instant::now())?;
                let p = b.fresh(chunk.min(limit - 1));
                b.add(p, 1)?;
                let t = Instant::now();
                b.core.step(Instant::now())?;
                ts.push(t.elapsed().as_secs_f64());
                b.stop(&ids)?;
            }
            mixed.push(MixedPoint {
                prefill_tokens: chunk,
                decode_batch: batch,
                context: mix_ctx,
                seconds: median(ts),
            });
        }
    }

    let profile = Profile {
        version: PROFILE_VERSION,
        model: name,
        date: cleave_bench::serve::rfc3339_utc(SystemTime::now()),
        threads,
        block_size: ecfg.block_size,
        max_num_batched_tokens: configured.max_num_batched_tokens,
        max_num_seqs: configured.max_num_seqs,
        kv_bytes_per_token,
        kv_capacity_tokens,
        prefill,
        decode,
        mixed,
    };
    profile.validate()?;
    cleave_bench::sim::profile::save(&profile, &args.output)?;
    print_table(&profile);
    println!("wrote {} ({:.0} s of measuring)", args.output.display(), started.elapsed().as_secs_f64());
    Ok(())
}

fn print_table(p: &Profile) {
    println!("{:<14} {:>7} {:>7} {:>9} {:>10}", "prefill", "tokens", "cached", "ms", "tokens/s");
    for x in &p.prefill {
        println!(
            "{:<14} {:>7} {:>7} {:>9.1} {:>10.0}",
            "",
            x.tokens,
            x.cached_prefix,
            x.seconds * 1e3,
            x.tokens as f64 / x.seconds
        );
    }
    let contexts: Vec<usize> = {
        let mut c: Vec<usize> = p.decode.iter().map(|d| d.context).collect();
        c.sort_unstable();
        c.dedup();
        c
    };
    print!("{:<14} {:>7}", "decode ms", "batch");
    for c in &contexts {
        print!(" {:>9}", format!("ctx {c}"));
    }
    println!();
    let mut batches: Vec<usize> = p.decode.iter().map(|d| d.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    for bb in batches {
        print!("{:<14} {bb:>7}", "");
        for &c in &contexts {
            let t = p.decode.iter().find(|d| d.batch == bb && d.context == c).map_or(f64::NAN, |d| d.seconds);
            print!(" {:>9.2}", t * 1e3);
        }
        println!();
    }
    for m in &p.mixed {
        println!(
            "mixed step: prefill {} + {} decodes at ctx {}: {:.1} ms",
            m.prefill_tokens,
            m.decode_batch,
            m.context,
            m.seconds * 1e3
        );
    }
    println!(
        "limits: max_num_batched_tokens {}, max_num_seqs {}, block {}, {} KV tokens, {} KV bytes/token, {} threads",
        p.max_num_batched_tokens, p.max_num_seqs, p.block_size, p.kv_capacity_tokens, p.kv_bytes_per_token, p.threads
    );
}
