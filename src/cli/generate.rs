//! `cleave generate`: one prompt through the engine, completion text to stdout, numbers to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineConfig, EngineCore, EngineRequest};
use cleave_kernels::cpu::CpuBackend;
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
    let mut core = EngineCore::load(CpuBackend::new(args.engine.threads)?, files, &cfg)?;
    eprintln!("loaded {} in {:.2}s", args.model.display(), t_load.elapsed().as_secs_f64());
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
    core.add_request(req, start)?;
    let mut first_token = None;
    let mut generated = 0u32;
    let mut stdout = std::io::stdout().lock();
    while core.has_work() {
        for ev in core.step(Instant::now())? {
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
