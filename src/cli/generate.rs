//! `cleave generate`: one prompt through the engine, completion text to stdout, numbers to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_protocol::{Constraint, RequestId, SamplingParams, StopConditions};
use cleave_tokenizer::ChatMessage;

use super::EngineArgs;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Model: a Hugging Face folder (config.json, safetensors, tokenizer.json), a .gguf file, or
    /// a hub id (owner/name[@revision]).
    #[arg(long, env = "CLEAVE_MODEL")]
    model: PathBuf,
    /// The prompt text.
    #[arg(long, required_unless_present = "messages")]
    prompt: Option<String>,
    /// A conversation instead of a prompt: a JSON file holding an array of chat messages
    /// (`{"role", "content"}`, as in the OpenAI API), rendered through the model's chat template
    /// with the assistant's turn opened; `-` reads standard input.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "chat"])]
    messages: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Wrap the prompt as one user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Constrain the output to JSON valid against the JSON Schema in this file.
    #[arg(long, value_name = "FILE", group = "constraint")]
    json_schema: Option<PathBuf>,
    /// Constrain the output to any JSON object.
    #[arg(long, group = "constraint")]
    json_object: bool,
    /// Constrain the output to match this regular expression.
    #[arg(long, value_name = "REGEX", group = "constraint")]
    regex: Option<String>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, value_name = "TEXT", group = "constraint")]
    choice: Vec<String>,
    /// Constrain the output to the Lark grammar (llguidance's dialect) in this file.
    #[arg(long, value_name = "FILE", group = "constraint")]
    grammar: Option<PathBuf>,
    /// Prefill the prompt on a second engine and hand its KV to the first, in this process, as
    /// a cluster's prefill node hands it to a decode node: this model file (another format of
    /// the same model: an f32 folder beside a Q4 GGUF, say) holds the prefill engine's weights.
    /// The output is what a cluster with those two formats serves, for the same seed.
    #[arg(long, value_name = "PATH")]
    prefill_model: Option<PathBuf>,
    /// With a handoff (implied by this flag), the prefill engine dequantizes its GGUF weights
    /// to f32 at load, as a prefill node started with --dequantize-weights does.
    #[arg(long)]
    prefill_dequantize_weights: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The output constraint the flags ask for (at most one: clap's group enforces it).
fn constraint(args: &GenerateArgs) -> anyhow::Result<Option<Constraint>> {
    let read = |p: &PathBuf| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    Ok(if let Some(p) = &args.json_schema {
        Some(Constraint::JsonSchema(read(p)?))
    } else if args.json_object {
        Some(Constraint::JsonObject)
    } else if let Some(rx) = &args.regex {
        Some(Constraint::Regex(rx.clone()))
    } else if !args.choice.is_empty() {
        Some(Constraint::Choice(args.choice.clone()))
    } else if let Some(p) = &args.grammar {
        Some(Constraint::Lark(read(p)?))
    } else {
        None
    })
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let t_load = Instant::now();
    let files = ModelFiles::open(&super::model_source::resolve_model(&args.model)?)
        .with_context(|| format!("opening model {}", args.model.display()))?;
    let tokenizer = files.tokenizer.clone();
    let messages = match (&args.messages, &args.prompt) {
        (Some(path), _) => {
            let text = if path.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading messages from standard input")?
            } else {
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
            };
            let m: Vec<ChatMessage> = serde_json::from_str(&text)
                .with_context(|| format!("{}: not a JSON array of chat messages", path.display()))?;
            anyhow::ensure!(!m.is_empty(), "{}: no messages", path.display());
            Some(m)
        }
        (None, Some(p)) if args.chat => Some(vec![ChatMessage::new("user", p)]),
        (None, _) => None,
    };
    let prompt = match (&messages, &args.prompt) {
        // The template renders special tokens (BOS) itself.
        (Some(m), _) => tokenizer.encode(&tokenizer.render_chat(m, true)?, false)?,
        (None, Some(p)) => tokenizer.encode(p, true)?,
        (None, None) => anyhow::bail!("give --prompt or --messages"),
    };
    let cfg: EngineConfig = args.engine.to_config();
    let engine = args.engine.clone();
    super::on_backend(&engine, Generate { args, files, cfg, prompt, t_load })
}

/// The rest of `generate`, on the backend `--device` picks.
struct Generate {
    args: GenerateArgs,
    files: ModelFiles,
    cfg: EngineConfig,
    prompt: Vec<u32>,
    t_load: Instant,
}

impl super::OnBackend for Generate {
    type Out = ();
    fn run<B: cleave_kernels::Backend>(self, make: &dyn Fn() -> anyhow::Result<B>) -> anyhow::Result<()> {
        generate_on(self, make)
    }
}

fn generate_on<B: cleave_kernels::Backend>(g: Generate, make: &dyn Fn() -> anyhow::Result<B>) -> anyhow::Result<()> {
    let Generate { args, files, cfg, prompt, t_load } = g;
    let mut core = EngineCore::load(make()?, files, &cfg)?;
    eprintln!("loaded {} ({}) in {:.2}s", args.model.display(), core.weights().format, t_load.elapsed().as_secs_f64());
    let mut prefill = match (&args.prefill_model, args.prefill_dequantize_weights) {
        (None, false) => None,
        (path, dequantize_weights) => {
            let path = match path {
                Some(p) => super::model_source::resolve_model(p)?,
                None => super::model_source::resolve_model(&args.model)?,
            };
            let files = ModelFiles::open(&path).with_context(|| format!("opening model {}", path.display()))?;
            let p = EngineCore::load(make()?, files, &EngineConfig { dequantize_weights, ..cfg.clone() })?;
            anyhow::ensure!(
                p.kv_layout() == core.kv_layout(),
                "the prefill model {} cannot hand its KV to {}: its KV layout {:?} differs from {:?}",
                path.display(),
                args.model.display(),
                p.kv_layout(),
                core.kv_layout()
            );
            eprintln!("prefill engine: {} ({})", path.display(), p.weights().format);
            Some(p)
        }
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        constraint: constraint(&args)?,
        ..Default::default()
    };
    params.validate()?;
    let prompt_len = prompt.len();
    let req = EngineRequest {
        id: RequestId(0),
        prompt,
        params,
        stop: StopConditions {
            max_tokens: args.max_tokens,
            stop_strings: args.stop,
            stop_token_ids: vec![],
            ignore_eos: args.ignore_eos,
        },
    };
    let start = Instant::now();
    let mut first_token = None;
    let mut generated = 0u32;
    let mut stdout = std::io::stdout().lock();
    let mut events = Vec::new();
    match prefill.as_mut() {
        None => core.add_request(req, start)?,
        Some(p) => events = handoff(p, &mut core, req)?,
    }
    loop {
        if events.is_empty() {
            if !core.has_work() {
                break;
            }
            events = core.step(Instant::now())?;
        }
        for ev in events.drain(..) {
            if let Some(err) = &ev.error {
                anyhow::bail!("generation failed: {err}");
            }
            if ev.token_id.is_some() {
                first_token.get_or_insert_with(|| start.elapsed());
                generated = ev.completion_tokens;
            }
            stdout.write_all(ev.text.as_bytes())?;
            stdout.flush()?;
        }
    }
    writeln!(stdout)?;
    let total = start.elapsed().as_secs_f64();
    let ttft = first_token.map(|d| d.as_secs_f64()).unwrap_or(total);
    let decode_rate = if generated > 1 { (generated - 1) as f64 / (total - ttft).max(1e-9) } else { 0.0 };
    eprintln!(
        "prompt tokens: {prompt_len}, generated: {generated}, time to first token: {:.1} ms, decode: {decode_rate:.1} tokens/s",
        ttft * 1e3
    );
    Ok(())
}

/// Prefills `req` on `p` and hands its KV to `d` layer by layer, as a prefill node hands it to a
/// decode node; returns `p`'s events (its first token) once `d` holds the request.
fn handoff<B: cleave_kernels::Backend>(
    p: &mut EngineCore<B>,
    d: &mut EngineCore<B>,
    req: EngineRequest,
) -> anyhow::Result<Vec<cleave_protocol::TokenEvent>> {
    use cleave_engine::{ImportStart, KvExport, KvExportEvent, SinkError};
    let (tx, rx) = std::sync::mpsc::channel();
    let now = Instant::now();
    p.add_prefill_only(req.clone(), KvExport::new(move |ev| tx.send(ev).map_err(|_| SinkError::Closed)), now)?;
    let grant = d.reserve_import_prompt(req.id, &req.prompt)?;
    let row = d.kv_layout().bytes_per_token() / d.kv_layout().num_layers as usize / 2;
    let mut events = Vec::new();
    loop {
        if p.has_work() {
            events.extend(p.step(Instant::now())?);
        }
        if let Some(err) = events.iter().find_map(|e: &cleave_protocol::TokenEvent| e.error.clone()) {
            anyhow::bail!("prefill failed: {err}");
        }
        for ev in rx.try_iter() {
            match ev {
                KvExportEvent::Chunk(c) => {
                    let (from, end) =
                        ((c.token_start as usize).max(grant.cached_tokens), (c.token_start + c.token_count) as usize);
                    if end > from {
                        let at = (from - c.token_start as usize) * row;
                        d.import_kv(c.request_id, c.layer, from as u32, &c.k[at..], &c.v[at..])?;
                    }
                }
                KvExportEvent::Done(done) => {
                    if done.finish.is_some() {
                        // The first token ended the request: nothing to hand off.
                        d.release_import(req.id)?;
                        return Ok(events);
                    }
                    let start = ImportStart {
                        first_token: done.first_token,
                        sampler_seed: Some(done.sampler_seed),
                        cached_tokens: done.cached_tokens,
                    };
                    d.add_imported(req, start, Instant::now())?;
                    return Ok(events);
                }
            }
        }
        anyhow::ensure!(p.has_work(), "the prefill engine stopped without handing the request off");
    }
}
