//! `cleave bench engine`: prefill and decode throughput of the engine on one model, each printed
//! beside the limit this machine sets, measured in the same run:
//! - prefill against the GEMM library's peak (2 FLOPs per non-embedding weight per token, plus
//!   causal attention and one row of LM head);
//! - decode against the memory-bandwidth floor: the bytes a step reads (every layer's linear
//!   weights and the LM head once, in the format they are held in: a GGUF's Q4_1 blocks, or f32
//!   with `--dequantize-weights`; plus every sequence's K/V) over the read bandwidth measured at
//!   that working-set size; and, for batches, against batch 1.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
use cleave_kernels::measure;
use cleave_kernels::Backend;
use cleave_protocol::{RequestId, SamplingParams, StopConditions};

use super::EngineArgs;

#[derive(clap::Args, Debug)]
pub struct BenchEngineArgs {
    /// Model: a Hugging Face folder, a .gguf file, or a hub id (owner/name[@revision]).
    #[arg(long, env = "CLEAVE_MODEL")]
    model: PathBuf,
    /// Prompt lengths to measure prefill at.
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 512, 2048])]
    prefill: Vec<usize>,
    /// Batch sizes to measure decode at.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    decode: Vec<usize>,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 32)]
    decode_steps: u32,
    /// Context length of each sequence when decode is timed.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Also time every decode batch with each sequence under a JSON Schema (this file, or with
    /// `builtin` a schema of 64 records that no sequence completes within the timed steps),
    /// alternating free and constrained rounds, and time the masks alone on the constrained
    /// output: what constrained decoding adds to the time per output token.
    #[arg(long, value_name = "FILE|builtin")]
    json_schema: Option<String>,
    /// Free/constrained round pairs per batch size with `--json-schema` (the fastest of each
    /// kind is printed: the noise of a shared machine only ever adds time).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Deterministic pseudo-random prompt ids (no tokenizer involved; avoid the first 256 ids, which
/// are often special or byte tokens).
pub(super) fn prompt(len: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut s = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (256 + s % (vocab as u64 - 256).max(1)) as u32
        })
        .collect()
}

/// Records whose fields keep any model busy well past the timed steps: strings, numbers, enums
/// and nesting, the structure points where masks cost the most.
const BUILTIN_SCHEMA: &str = r#"{"type": "object", "properties": {"records": {"type": "array", "minItems": 64,
  "items": {"type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "integer"},
  "score": {"type": "number"}, "kind": {"enum": ["alpha", "beta", "gamma"]}, "tags": {"type": "array",
  "items": {"type": "string"}}}, "required": ["name", "id", "score", "kind", "tags"],
  "additionalProperties": false}}}, "required": ["records"], "additionalProperties": false}"#;

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt,
        params: SamplingParams::default(),
        stop: StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
    }
}

/// One decode round: `batch` sequences prefilled and stepped once untimed, then
/// `decode_steps` steps timed. Returns the seconds, the steps and the first sequence's tokens.
fn decode_round<B: Backend>(
    core: &mut EngineCore<B>,
    id: &mut u64,
    batch: usize,
    args: &BenchEngineArgs,
    vocab: usize,
    constraint: Option<&cleave_protocol::Constraint>,
) -> anyhow::Result<(f64, u32, Vec<u32>)> {
    let first = *id + 1;
    for _ in 0..batch {
        *id += 1;
        // Room to spare: while later prompts are still prefilled in chunks, earlier sequences
        // already decode.
        let mut req = request(*id, prompt(args.decode_context, vocab, *id), 2 * args.decode_steps + 8);
        req.params.constraint = constraint.cloned();
        core.add_request(req, Instant::now())?;
    }
    let mut out = Vec::new();
    let mut counts = std::collections::HashMap::<u64, usize>::new();
    let mut keep = |evs: Vec<cleave_protocol::TokenEvent>, counts: &mut std::collections::HashMap<u64, usize>| {
        let n = evs.iter().filter(|e| e.token_id.is_some()).count();
        for e in evs {
            if let Some(err) = e.error {
                anyhow::bail!("request {} failed: {err}", e.request_id);
            }
            if e.token_id.is_some() {
                *counts.entry(e.request_id.0).or_default() += 1;
            }
            if e.request_id.0 == first {
                out.extend(e.token_id);
            }
        }
        Ok(n)
    };
    // Prefill everyone and take a decode step untimed (every sequence has two tokens: no step
    // below carries a prompt chunk), then time the decode steps.
    while counts.len() < batch || counts.values().any(|&n| n < 2) {
        if !core.has_work() {
            anyhow::bail!("the engine went idle before every sequence was decoding");
        }
        keep(core.step(Instant::now())?, &mut counts)?;
    }
    let t = Instant::now();
    let mut steps = 0u32;
    let mut tokens = 0usize;
    while core.has_work() && steps < args.decode_steps {
        tokens += keep(core.step(Instant::now())?, &mut counts)?;
        steps += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    if tokens != steps as usize * batch {
        anyhow::bail!(
            "{tokens} tokens in {steps} steps of {batch}: sequences ended or were preempted inside the timed \
             steps (does the KV cache hold {batch} x {} tokens? see --kv-cache-memory, --kv-cache-dtype)",
            args.decode_context + 2 * args.decode_steps as usize + 8
        );
    }
    for i in first..=*id {
        core.abort(RequestId(i));
    }
    while core.has_work() {
        keep(core.step(Instant::now())?, &mut counts)?;
    }
    Ok((secs, steps.max(1), out))
}

fn core_eos<B: Backend>(core: &EngineCore<B>) -> Vec<u32> {
    core.tokenizer().eos_token_id().into_iter().collect()
}

/// Mean microseconds of one mask (and the commit after it) along `tokens` under `c`, computed
/// alone on this thread: what the masks would add to a step were they not computed beside it.
fn mask_cost_us(
    tok: &cleave_tokenizer::Tokenizer,
    vocab: usize,
    eos: &[u32],
    c: &cleave_protocol::Constraint,
    tokens: &[u32],
) -> anyhow::Result<f64> {
    let compiler = cleave_constrain::Compiler::new(tok, vocab, eos)?;
    let mut state = compiler.start(c, &[])?;
    let mut mask = cleave_constrain::Mask::default();
    let t = Instant::now();
    for &token in tokens {
        state.fill_mask(&mut mask)?;
        state.commit(token)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / tokens.len().max(1) as f64)
}

/// The limits a run is printed against, measured on the device it runs on.
struct Limits {
    /// "2 threads", or the GPU's name.
    what: String,
    /// Read bandwidth (GB/s) over a working set of the given bytes.
    bandwidth_at: Box<dyn Fn(usize) -> f64>,
    /// The same over a large array (1 GiB on the CPU).
    dram_bandwidth: f64,
    /// GEMM peak (GFLOP/s) and the shape it was measured on.
    gemm_peak: f64,
    gemm_shape: &'static str,
}

pub fn run(args: BenchEngineArgs) -> anyhow::Result<()> {
    match args.engine.device {
        super::Device::Cpu => {
            let backend = CpuBackend::new(args.engine.threads)?;
            let threads = backend.threads();
            eprintln!("measuring machine limits ({threads} threads)...");
            let dram_bandwidth = measure::memory_bandwidth_gbps_on(&backend, measure::BANDWIDTH_BYTES);
            let gemm_peak = measure::gemm_peak_gflops(&backend, 1024, 1024, 1024);
            let b = backend.clone();
            let limits = Limits {
                what: format!("{threads} threads"),
                bandwidth_at: Box::new(move |bytes| measure::memory_bandwidth_gbps_on(&b, bytes)),
                dram_bandwidth,
                gemm_peak,
                gemm_shape: "1024^3",
            };
            bench(args, backend, limits)
        }
        #[cfg(feature = "cuda")]
        super::Device::Cuda(n) => {
            use cleave_kernels::cuda::CudaBackend;
            let gemm = args.engine.gpu_weights.gemm();
            let backend = CudaBackend::new(n, gemm)?;
            eprintln!("measuring device limits on {}...", backend.device_name());
            // Copy bandwidth counts the bytes read and written; decode reads, so the floor uses it.
            let dram_bandwidth = backend.copy_bandwidth_gbps(1 << 30)?;
            let gemm_peak = backend.gemm_peak_gflops(8192)?;
            let what = format!("{} ({gemm:?} weights)", backend.device_name());
            let limits = Limits {
                what,
                bandwidth_at: Box::new(move |_| dram_bandwidth),
                dram_bandwidth,
                gemm_peak,
                gemm_shape: "8192^3, cuBLAS",
            };
            bench(args, backend, limits)
        }
        #[cfg(not(feature = "cuda"))]
        super::Device::Cuda(n) => {
            anyhow::bail!("--device cuda:{n}: this binary was built without the `cuda` feature")
        }
    }
}

fn bench<B: Backend>(args: BenchEngineArgs, backend: B, limits: Limits) -> anyhow::Result<()> {
    let Limits { what, bandwidth_at, dram_bandwidth, gemm_peak, gemm_shape } = limits;
    let files = ModelFiles::open(&super::model_source::resolve_model(&args.model)?)
        .with_context(|| format!("opening model {}", args.model.display()))?;
    let cfg = files.config.clone();
    let params = cfg.num_parameters();
    // What one forward pass really touches. The embedding table is gathered (a row per token), not
    // multiplied; the LM head multiplies only the rows that sample (one per prefill, one per
    // sequence in decode). With tied embeddings the head *is* the table, read once per decode step.
    let head = cfg.vocab_size * cfg.hidden_size;
    let embed_params = head * if cfg.tie_word_embeddings { 1 } else { 2 };
    let body_params = params - embed_params;
    // A prefill request asks for one token after its prompt, so it needs `len + 1` positions.
    let max_len = (args.prefill.iter().copied().max().unwrap_or(0) + 1)
        .max(args.decode_context + 2 * args.decode_steps as usize + 16);
    let mut ecfg: EngineConfig = args.engine.to_config();
    ecfg.enable_prefix_caching = false;
    ecfg.max_model_len = Some(max_len.max(ecfg.max_model_len.unwrap_or(0)));
    ecfg.max_num_batched_tokens = ecfg.max_num_batched_tokens.max(max_len);
    let mut core = EngineCore::load(backend, files, &ecfg)?;
    // Bytes a decode step streams of the weights: every layer's linear weights and the head, in
    // the format each is held in (a GGUF's blocks, or f32 when dequantized at load).
    let weights = core.weight_bytes();
    let weight_bytes = weights.per_step;
    // The floor is set by reading that many bytes over and over, as decode does: on a CPU with a
    // large L3 (this VM reports 300 MiB) part of a few-hundred-MB model stays cached between
    // steps, so the bandwidth that matters is the one measured at the same working-set size,
    // not the DRAM figure of a 1 GiB array (printed too).
    let bandwidth = bandwidth_at(weight_bytes);
    println!(
        "model: {} ({:.1}M parameters, {:.1}M outside the embeddings); a decode step reads {weights} of weights{}",
        args.model.display(),
        params as f64 / 1e6,
        body_params as f64 / 1e6,
        if ecfg.dequantize_weights { " (--dequantize-weights)" } else { "" },
    );
    println!(
        "machine: {what}, read bandwidth {bandwidth:.1} GB/s over {:.0} MB (the decode floor's), \
         {dram_bandwidth:.1} GB/s over 1 GiB, GEMM peak {gemm_peak:.1} GFLOP/s ({gemm_shape})",
        weight_bytes as f64 / 1e6
    );
    println!();
    println!("{:<22} {:>12} {:>14} {:>14} {:>8}", "phase", "tokens/s", "achieved", "limit", "ratio");
    let mut id = 0u64;
    for &len in &args.prefill {
        // Warm up once, then time a second prompt of the same length (no prefix reuse: caching is off).
        for timed in [false, true] {
            id += 1;
            core.add_request(request(id, prompt(len, cfg.vocab_size, id), 1), Instant::now())?;
            let t = Instant::now();
            while core.has_work() {
                core.step(Instant::now())?;
            }
            if timed {
                let secs = t.elapsed().as_secs_f64();
                let attn_flops = 2.0
                    * 2.0
                    * cfg.num_layers as f64
                    * (cfg.num_heads * cfg.head_dim) as f64
                    * (len as f64 * len as f64 / 2.0);
                let flops = 2.0 * body_params as f64 * len as f64 + 2.0 * head as f64 + attn_flops;
                let gflops = flops / secs / 1e9;
                println!(
                    "{:<22} {:>12.1} {:>9.1} GF/s {:>9.1} GF/s {:>7.0}%",
                    format!("prefill {len}"),
                    len as f64 / secs,
                    gflops,
                    gemm_peak,
                    100.0 * gflops / gemm_peak
                );
            }
        }
    }
    // What a handoff of each prompt moves: a prefill-only request whose exported K/V is counted
    // (the bytes a prefill node sends a decode node), beside the layout's size of that prompt.
    let layout = core.kv_layout();
    let snap = core.snapshot();
    println!();
    println!(
        "kv cache: {}, {} B per token (K+V, all layers), {} tokens in {} MiB",
        format!("{:?}", layout.dtype).to_lowercase(),
        layout.bytes_per_token(),
        snap.kv_blocks_total * layout.block_size as usize,
        args.engine.kv_cache_memory >> 20
    );
    for &len in &args.prefill {
        id += 1;
        let counted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sink = counted.clone();
        let export = cleave_engine::KvExport::new(move |ev| {
            if let cleave_engine::KvExportEvent::Chunk(c) = ev {
                sink.fetch_add(c.k.len() + c.v.len(), std::sync::atomic::Ordering::Relaxed);
            }
            Ok(())
        });
        core.add_prefill_only(request(id, prompt(len, cfg.vocab_size, id), 1), export, Instant::now())?;
        while core.has_work() {
            core.step(Instant::now())?;
        }
        let bytes = counted.load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "{:<22} {:>12} bytes exported ({:.2} MiB; layout says {})",
            format!("handoff {len}"),
            bytes,
            bytes as f64 / (1 << 20) as f64,
            len * layout.bytes_per_token()
        );
    }
    println!();
    let schema = match args.json_schema.as_deref() {
        None => None,
        Some("builtin") => Some(BUILTIN_SCHEMA.to_string()),
        Some(path) => Some(std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?),
    };
    let constraint = schema.map(cleave_protocol::Constraint::JsonSchema);
    // Each timed step reads every sequence's K/V: a context of `decode_context` tokens, plus the
    // two tokens taken before the clock starts and half the timed steps on average.
    let kv_context = args.decode_context + 2 + args.decode_steps as usize / 2;
    let mut batch1 = None;
    for &batch in &args.decode {
        let rounds = if constraint.is_some() { args.rounds.max(1) } else { 1 };
        let (mut free, mut constrained) = (f64::INFINITY, f64::INFINITY);
        let mut outputs = Vec::new();
        for _ in 0..rounds {
            let mut run = |c: Option<&cleave_protocol::Constraint>| -> anyhow::Result<(f64, u32, Vec<u32>)> {
                decode_round(&mut core, &mut id, batch, &args, cfg.vocab_size, c)
            };
            let (secs, steps, _) = run(None)?;
            free = free.min(secs / steps as f64);
            if let Some(c) = &constraint {
                let (secs, steps, out) = run(Some(c))?;
                constrained = constrained.min(secs / steps as f64);
                outputs = out;
            }
        }
        let step_bytes = weight_bytes + batch * kv_context * layout.bytes_per_token();
        let step_floor = step_bytes as f64 / (bandwidth * 1e9);
        let rate = batch as f64 / free;
        let limit = batch as f64 / step_floor;
        let achieved_gbps = step_bytes as f64 / free / 1e9;
        if batch == 1 {
            batch1 = Some(rate);
        }
        let vs1 = batch1.map(|b| format!(", {:.1}x batch 1", rate / b)).unwrap_or_default();
        println!(
            "{:<22} {:>12.1} {:>9.1} GB/s {:>9.1} GB/s {:>7.0}%  ({:.1} MB a step, floor {:.2} ms{vs1})",
            format!("decode batch {batch}"),
            rate,
            achieved_gbps,
            bandwidth,
            100.0 * rate / limit,
            step_bytes as f64 / 1e6,
            step_floor * 1e3,
        );
        if let Some(c) = &constraint {
            let mask_us = mask_cost_us(core.tokenizer(), cfg.vocab_size, &core_eos(&core), c, &outputs)?;
            println!(
                "{:<22} {:>12.1}   step {:.2} ms vs {:.2} ms free: {:+.1}% per output token; masks alone {:.0} us/token x {batch} = {:.2} ms/step",
                format!("  + json schema"),
                batch as f64 / constrained,
                constrained * 1e3,
                free * 1e3,
                100.0 * (constrained / free - 1.0),
                mask_us,
                mask_us * batch as f64 / 1e3,
            );
        }
    }
    println!();
    println!(
        "prefill limit: GEMM peak; decode limit: memory bandwidth (the weights read once per step, in their \
         format, plus every sequence's K/V)."
    );
    Ok(())
}
