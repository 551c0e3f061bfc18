//! `cleave bench serve`: the load generator. Builds the dataset ([`crate::dataset`]) and the
//! arrival schedule ([`crate::schedule`]), sends each request at its offset through
//! [`crate::client`] (capped by `--max-concurrency`), and summarizes ([`crate::metrics`]).
//!
//! Flags follow vLLM's `vllm bench serve` where they exist. The schedule is fixed before the
//! first send, so two runs with the same arguments send the same requests at the same offsets.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use cleave_tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Deserialize;

use crate::client::{self, RequestSpec};
use crate::dataset::{self, DatasetSpec, SampleRequest};
use crate::metrics::{self, RequestRecord, Slo};
use crate::mix::Shape;
use crate::outcome::ErrorContract;
use crate::result::{self, RunInfo};
use crate::schedule::{self, Arrival, Arrivals, Length, Ramp, RampStrategy};
use crate::{BenchError, Result};

/// Which dataset `--dataset-name` picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetName {
    Random,
    Sharegpt,
    Mooncake,
}

/// `cleave bench serve` flags. Prompt lengths are counted as a completions prompt; on the chat
/// endpoint the server's chat template adds its own tokens on top.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Server base URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT).
    #[arg(long, alias = "url")]
    pub base_url: Option<String>,
    /// Server host when --base-url is not given.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Server port when --base-url is not given.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// API path: /v1/completions or /v1/chat/completions (the prompt becomes one user message).
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Recorded in the result file; requests are always OpenAI-style.
    #[arg(long, default_value = "openai")]
    pub backend: String,
    /// Model name sent in requests (default, and when this is a local path: the first of
    /// GET /v1/models). Also the tokenizer when it is a path or hub id and --tokenizer is not
    /// given.
    #[arg(long)]
    pub model: Option<String>,
    /// Name sent in requests when it differs from --model.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Tokenizer: HF folder, .gguf file, or hub id (default: --model).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Bearer token.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// ShareGPT JSON or Mooncake JSONL file.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Number of requests (default 1000; a trace's line count for mooncake).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Generate arrivals until this many seconds instead of a fixed count. --num-prompts, if
    /// given, still caps the count; in a closed loop (no --request-rate) it is the cap, 1000 by
    /// default, and no request starts after the duration.
    #[arg(long)]
    pub duration: Option<f64>,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Lengths are uniform in [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Tokens of a prefix shared by every random prompt (on top of --random-input-len).
    #[arg(long, default_value_t = 0)]
    pub random_prefix_len: usize,
    /// Fixed output length for ShareGPT (default: the gpt turn's token count).
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    /// Tokens per Mooncake hash id.
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Replay a trace this many times faster.
    #[arg(long, default_value_t = 1.0)]
    pub trace_time_scale: f64,

    /// Requests per second (inf = all at once).
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// Gamma shape of the gaps: 1.0 = Poisson, lower is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    #[arg(long, value_enum, requires_all = ["ramp_up_start_rps", "ramp_up_end_rps"])]
    pub ramp_up_strategy: Option<RampStrategy>,
    #[arg(long)]
    pub ramp_up_start_rps: Option<f64>,
    #[arg(long)]
    pub ramp_up_end_rps: Option<f64>,
    /// At most this many requests in flight (with no rate: a closed loop).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Let the model stop at EOS instead of generating exactly the output length.
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Seconds before a request counts as a timeout.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,

    /// SLOs for goodput, e.g. `--goodput ttft:500 tpot:50` (any of ttft, tpot, e2el, in ms).
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Percentiles to report.
    #[arg(long, default_value = "90,99")]
    pub metric_percentiles: String,
    /// No progress bar.
    #[arg(long)]
    pub disable_tqdm: bool,
    /// Write the result JSON to --result-dir/--result-filename.
    #[arg(long)]
    pub save_result: bool,
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    #[arg(long)]
    pub result_filename: Option<String>,
    /// Write the result JSON here (implies --save-result).
    #[arg(long)]
    pub result_file: Option<PathBuf>,
    /// Plot the latency CDFs (TTFT, TPOT, ITL, E2EL, with the --goodput SLOs marked) to
    /// STEM.png and STEM.svg.
    #[arg(long, value_name = "STEM")]
    pub plot: Option<PathBuf>,
    /// A load that changes while it runs: phases `DURATION_S:RATE:INPUT_LEN:OUTPUT_LEN`,
    /// comma-separated, one after another (random dataset; replaces --request-rate, the lengths
    /// and --num-prompts). Prints the SLO attainment over time and how long it took to recover
    /// after each phase boundary.
    #[arg(long, value_parser = crate::timeline::phases_arg)]
    pub phases: Option<crate::timeline::Phases>,
    /// Window of the attainment timeline, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub timeline_window: f64,
    /// Share of a window's requests that must meet the SLOs for it to count as recovered.
    #[arg(long, default_value_t = 0.9)]
    pub timeline_target: f64,

    /// A mixed load: each arrival draws a shape by weight, `SHAPE=WEIGHT,...` with shapes
    /// stream, full (not streamed), chat_stream, chat (not streamed), multi (n > 1),
    /// disconnect (the client leaves mid-stream) and burst (--burst-size streams at once).
    /// Completions go to /v1/completions and chat to /v1/chat/completions (--endpoint is not
    /// used). The result counts every outcome by kind.
    #[arg(long, value_parser = crate::mix::mix_arg)]
    pub mix: Option<crate::mix::Mix>,
    /// Choices (`n`) of a `multi` request.
    #[arg(long, default_value_t = 2)]
    pub mix_choices: u32,
    /// Text chunks a `disconnect` client reads before it drops the stream.
    #[arg(long, default_value_t = 3)]
    pub disconnect_after: usize,
    /// Requests a `burst` arrival sends at once.
    #[arg(long, default_value_t = 32)]
    pub burst_size: usize,
    /// Check every outcome against the errors the server's OpenAPI document lists
    /// (`GET /openapi.json`): per path the statuses answered with its `Error` schema, the
    /// documented error types, and `error` events in streams. A timeout, a broken connection
    /// or a truncated stream is never documented. The count is in the table and result file.
    #[arg(long)]
    pub check_documented_errors: bool,
}

#[derive(Parser)]
struct DefaultsOnly {
    #[command(flatten)]
    args: ServeArgs,
}

impl Default for ServeArgs {
    /// The flags' defaults (one place: the `#[arg]` attributes).
    fn default() -> Self {
        DefaultsOnly::parse_from(["serve"]).args
    }
}

impl ServeArgs {
    pub fn base_url(&self) -> String {
        let url = self.base_url.clone().unwrap_or_else(|| format!("http://{}:{}", self.host, self.port));
        url.trim_end_matches('/').to_string()
    }

    fn dataset_spec(&self) -> Result<DatasetSpec> {
        let path = || {
            self.dataset_path.clone().ok_or_else(|| {
                BenchError::InvalidArg(format!("--dataset-name {:?} needs --dataset-path", self.dataset_name))
            })
        };
        Ok(match self.dataset_name {
            DatasetName::Random => DatasetSpec::Random {
                input_len: self.random_input_len,
                output_len: self.random_output_len,
                range_ratio: self.random_range_ratio,
                prefix_len: self.random_prefix_len,
            },
            DatasetName::Sharegpt => DatasetSpec::ShareGpt { path: path()?, output_len: self.sharegpt_output_len },
            DatasetName::Mooncake => DatasetSpec::Mooncake { path: path()?, block_size: self.trace_block_size },
        })
    }

    fn ramp(&self) -> Option<Ramp> {
        Some(Ramp {
            strategy: self.ramp_up_strategy?,
            start_rps: self.ramp_up_start_rps?,
            end_rps: self.ramp_up_end_rps?,
        })
    }
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct BenchOutcome {
    /// One per request sent, in schedule order.
    pub records: Vec<RequestRecord>,
    pub summary: metrics::Summary,
    pub info: RunInfo,
    /// The benchmark's start as Unix time in seconds (the records' times are offsets from it).
    pub t0_unix: f64,
}

/// The dataset and the schedule of sends into it (`Arrival::index` indexes the dataset).
pub fn plan(args: &ServeArgs, tok: &Tokenizer) -> Result<(Vec<SampleRequest>, Vec<Arrival>)> {
    if let Some(phases) = &args.phases {
        return plan_phases(args, &phases.0, tok);
    }
    let spec = args.dataset_spec()?;
    if spec.is_trace() {
        let data = dataset::load(&spec, args.num_prompts, args.seed, tok)?;
        let ts: Vec<f64> = data.iter().map(|d| d.timestamp_s.unwrap_or(0.0)).collect();
        let mut sched = schedule::from_timestamps(&ts, args.trace_time_scale)?;
        if let Some(d) = args.duration {
            sched.retain(|a| a.offset_s < d);
        }
        return Ok((data, sched));
    }
    let length = match args.duration {
        Some(secs) => Length::Duration {
            secs,
            max_count: args.num_prompts.unwrap_or(if args.request_rate.is_finite() { usize::MAX } else { 1000 }),
        },
        None => Length::Count(args.num_prompts.unwrap_or(1000)),
    };
    let arrivals =
        Arrivals { rate: args.request_rate, burstiness: args.burstiness, ramp: args.ramp(), seed: args.seed, length };
    let sched = schedule::open_loop(&arrivals)?;
    let data = match spec {
        DatasetSpec::Random { .. } => dataset::load(&spec, Some(sched.len()), args.seed, tok)?,
        _ => dataset::load(&spec, args.num_prompts, args.seed, tok)?,
    };
    // A smaller ShareGPT set than the schedule (duration mode) is cycled.
    let sched = sched.into_iter().map(|a| Arrival { index: a.index % data.len().max(1), ..a }).collect();
    Ok((data, sched))
}

/// Each phase's Poisson (or bursty) arrivals over its duration with its own random prompts,
/// one after another; phase `i` is seeded `seed + i`.
fn plan_phases(
    args: &ServeArgs,
    phases: &[crate::timeline::Phase],
    tok: &Tokenizer,
) -> Result<(Vec<SampleRequest>, Vec<Arrival>)> {
    if args.dataset_name != DatasetName::Random {
        return Err(BenchError::InvalidArg("--phases needs the random dataset".into()));
    }
    let (mut data, mut sched) = (Vec::new(), Vec::new());
    let mut start = 0.0;
    for (i, p) in phases.iter().enumerate() {
        let seed = args.seed.wrapping_add(i as u64);
        let arrivals = Arrivals {
            rate: p.rate,
            burstiness: args.burstiness,
            ramp: None,
            seed,
            length: Length::Duration { secs: p.duration_s, max_count: usize::MAX },
        };
        let part = schedule::open_loop(&arrivals)?;
        let spec = DatasetSpec::Random {
            input_len: p.input_len,
            output_len: p.output_len,
            range_ratio: args.random_range_ratio,
            prefix_len: args.random_prefix_len,
        };
        let first = data.len();
        data.extend(dataset::load(&spec, Some(part.len()), seed, tok)?);
        sched.extend(part.into_iter().map(|a| Arrival { offset_s: start + a.offset_s, index: first + a.index }));
        start += p.duration_s;
    }
    Ok((data, sched))
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// The first model the server lists (GET /v1/models).
pub async fn first_served_model(http: &reqwest::Client, base_url: &str, api_key: Option<&str>) -> Result<String> {
    let url = format!("{base_url}/v1/models");
    let mut req = http.get(&url).timeout(Duration::from_secs(30));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|e| BenchError::Http(format!("GET {url}: {}", client::error_chain(&e))))?;
    if !resp.status().is_success() {
        return Err(BenchError::Server(format!("GET {url}: HTTP {}", resp.status())));
    }
    let list: ModelList = resp.json().await.map_err(|e| BenchError::Http(format!("GET {url}: {e}")))?;
    list.data.into_iter().next().map(|m| m.id).ok_or_else(|| BenchError::Server(format!("{url} lists no model")))
}

/// Runs the benchmark against the server (no printing, no saving).
pub async fn run_benchmark(args: &ServeArgs, tokenizer: &Tokenizer) -> Result<BenchOutcome> {
    let slo = Slo::parse(&args.goodput)?;
    let percentiles = metrics::parse_percentiles(&args.metric_percentiles)?;
    if !(args.request_timeout > 0.0 && args.request_timeout.is_finite()) {
        return Err(BenchError::InvalidArg(format!(
            "--request-timeout must be positive, got {}",
            args.request_timeout
        )));
    }
    if args.max_concurrency == Some(0) {
        return Err(BenchError::InvalidArg("--max-concurrency must be at least 1".into()));
    }
    let (data, sched) = plan(args, tokenizer)?;
    let base = args.base_url();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.max_concurrency.unwrap_or(1024))
        .build()
        .map_err(|e| BenchError::Http(client::error_chain(&e)))?;
    // A --model that is a local path names the tokenizer, not the served model (servers started
    // from a path usually serve it under another name): ask the server then.
    let named =
        args.served_model_name.clone().or_else(|| args.model.clone().filter(|m| !std::path::Path::new(m).exists()));
    let model = match named {
        Some(m) => m,
        None => first_served_model(&http, &base, args.api_key.as_deref()).await?,
    };
    let endpoint = if args.endpoint.starts_with('/') { args.endpoint.clone() } else { format!("/{}", args.endpoint) };
    if args.mix.is_some() && args.mix_choices < 2 {
        return Err(BenchError::InvalidArg(format!("--mix-choices must be at least 2, got {}", args.mix_choices)));
    }
    let contract = match args.check_documented_errors {
        true => Some(Arc::new(fetch_contract(&http, &base).await?)),
        false => None,
    };
    let shapes = args.mix.as_ref().map(|m| m.assign(sched.len(), args.seed));
    let template = RequestSpec {
        url: format!("{base}{endpoint}"),
        chat: endpoint.contains("chat"),
        model: model.clone(),
        prompt: String::new(),
        prompt_len: 0,
        output_len: 0,
        ignore_eos: !args.no_ignore_eos,
        temperature: args.temperature,
        api_key: args.api_key.clone(),
        timeout: Duration::from_secs_f64(args.request_timeout),
        stream: true,
        n: 1,
        disconnect_after: None,
    };

    let bar = ProgressBar::new(sched.len() as u64);
    if args.disable_tqdm || !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} requests [{elapsed_precise}<{eta_precise}]") {
        bar.set_style(style);
    }
    let limit = args.max_concurrency.map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
    let stop_after = args.duration.filter(|_| !args.request_rate.is_finite()).map(Duration::from_secs_f64);
    let t0 = Instant::now();
    let t0_wall = std::time::SystemTime::now();
    let mut tasks = Vec::with_capacity(sched.len());
    for (k, a) in sched.iter().enumerate() {
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(a.offset_s)).into()).await;
        // The permit is taken here, in schedule order: a request waiting for a slot could not
        // be sent earlier anyway, and the order stays the schedule's.
        let permit = match &limit {
            Some(s) => Some(s.clone().acquire_owned().await.map_err(|e| BenchError::Task(e.to_string()))?),
            None => None,
        };
        // The request's start: decided here, before the end of a --duration run.
        let sent = Instant::now();
        if stop_after.is_some_and(|d| sent.duration_since(t0) >= d) {
            break; // closed loop with --duration: no new sends after the end.
        }
        let d = &data[a.index];
        let spec = RequestSpec {
            prompt: d.prompt.clone(),
            prompt_len: d.prompt_len,
            output_len: d.output_len,
            ..template.clone()
        };
        let shape = shapes.as_ref().map(|s| s[k]);
        let (spec, copies) = match shape {
            Some(shape) => shaped(spec, shape, &base, args),
            None => (spec, 1),
        };
        bar.inc_length(copies as u64 - 1);
        let path = spec.url.strip_prefix(&base).unwrap_or(&spec.url).to_string();
        // A burst's copies share the arrival's concurrency slot: it frees when the last ends.
        let permit = Arc::new(permit);
        for _ in 0..copies {
            let (http, bar, offset, spec) = (http.clone(), bar.clone(), a.offset_s, spec.clone());
            let (contract, path, permit) = (contract.clone(), path.clone(), permit.clone());
            tasks.push(tokio::spawn(async move {
                let mut rec = client::send(&http, &spec, k, t0, offset, sent).await;
                drop(permit);
                rec.shape = shape;
                rec.documented = contract.map(|c| c.allows(&path, &rec.outcome));
                bar.inc(1);
                rec
            }));
        }
    }
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        records.push(t.await.map_err(|e| BenchError::Task(e.to_string()))?);
    }
    let duration_s = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let t0_unix = t0_wall.duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let summary = metrics::summarize(&records, duration_s, &slo, &percentiles);
    let info = RunInfo {
        date: date_string(std::time::SystemTime::now()),
        backend: args.backend.clone(),
        model_id: model,
        tokenizer_id: args.tokenizer.clone().or_else(|| args.model.clone()).unwrap_or_default(),
        num_prompts: records.len(),
        request_rate: if args.request_rate.is_finite() { args.request_rate.into() } else { "inf".into() },
        burstiness: args.burstiness,
        max_concurrency: args.max_concurrency,
        ramp_up_strategy: args.ramp_up_strategy,
        ramp_up_start_rps: args.ramp_up_start_rps,
        ramp_up_end_rps: args.ramp_up_end_rps,
        seed: args.seed,
        slo,
    };
    Ok(BenchOutcome { records, summary, info, t0_unix })
}

/// The request an arrival of `shape` sends, and how many copies of it (a burst's size).
fn shaped(spec: RequestSpec, shape: Shape, base: &str, args: &ServeArgs) -> (RequestSpec, usize) {
    let path = if shape.chat() { "/v1/chat/completions" } else { "/v1/completions" };
    let spec = RequestSpec {
        url: format!("{base}{path}"),
        chat: shape.chat(),
        stream: shape.streamed(),
        n: if shape == Shape::Multi { args.mix_choices } else { 1 },
        disconnect_after: (shape == Shape::Disconnect).then_some(args.disconnect_after),
        ..spec
    };
    (spec, if shape == Shape::Burst { args.burst_size.max(1) } else { 1 })
}

/// The server's documented errors, from its `GET /openapi.json`.
async fn fetch_contract(http: &reqwest::Client, base: &str) -> Result<ErrorContract> {
    let url = format!("{base}/openapi.json");
    let resp = http
        .get(&url)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .map_err(|e| BenchError::Http(format!("GET {url}: {}", client::error_chain(&e))))?;
    if !resp.status().is_success() {
        return Err(BenchError::Server(format!(
            "GET {url}: HTTP {} (--check-documented-errors needs the server's OpenAPI document)",
            resp.status()
        )));
    }
    let doc: serde_json::Value = resp.json().await.map_err(|e| BenchError::Http(format!("GET {url}: {e}")))?;
    ErrorContract::from_openapi(&doc)
}

/// Where the result file goes, if anywhere.
fn result_path(args: &ServeArgs, info: &RunInfo) -> Option<PathBuf> {
    if let Some(p) = &args.result_file {
        return Some(p.clone());
    }
    if !args.save_result {
        return None;
    }
    let name = args.result_filename.clone().unwrap_or_else(|| {
        let model = info.model_id.rsplit('/').next().unwrap_or("model");
        let rate = info.request_rate.as_f64().map_or("inf".to_string(), |r| format!("{r}"));
        let conc = info.max_concurrency.map_or(String::new(), |c| format!("-concurrency{c}"));
        format!("{}-{rate}qps{conc}-{model}-{}.json", info.backend, info.date)
    });
    Some(args.result_dir.clone().unwrap_or_default().join(name))
}

/// Builds a runtime, runs the benchmark, prints the table to stdout and saves the result file.
pub fn run(args: ServeArgs, tokenizer: Tokenizer) -> Result<BenchOutcome> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::io("tokio runtime", e))?;
    let outcome = rt.block_on(run_benchmark(&args, &tokenizer))?;
    print!("{}", result::table(&outcome.info, &outcome.summary));
    let timeline = args.phases.as_ref().map(|phases| {
        crate::timeline::timeline(
            &outcome.records,
            &outcome.info.slo,
            &phases.0,
            args.timeline_window.max(1e-3),
            args.timeline_target,
        )
    });
    if let Some(t) = &timeline {
        print!("{}", crate::timeline::table(t));
    }
    if let Some(path) = result_path(&args, &outcome.info) {
        let mut json = result::result_json(&outcome.info, &outcome.summary, &outcome.records)?;
        if let Some(obj) = json.as_object_mut() {
            obj.insert("t0_unix".into(), outcome.t0_unix.into());
            if let Some(mix) = &args.mix {
                let weights = mix.weights().iter().map(|(k, w)| (k.as_str().to_string(), serde_json::Value::from(*w)));
                obj.insert("mix".into(), serde_json::Value::Object(weights.collect()));
            }
            if let Some(t) = &timeline {
                obj.insert("phases".into(), serde_json::to_value(&args.phases).unwrap_or_default());
                obj.insert("timeline".into(), serde_json::to_value(t).unwrap_or_default());
            }
        }
        result::save(&path, &json)?;
        eprintln!("result written to {}", path.display());
    }
    if let Some(stem) = &args.plot {
        let files = plot_cdfs(stem, &outcome.info.model_id, &outcome)?;
        eprintln!("plots written to {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "));
    }
    Ok(outcome)
}

/// The run's latency CDFs, one panel per metric, SLOs marked.
pub fn plot_cdfs(stem: &std::path::Path, label: &str, o: &BenchOutcome) -> Result<Vec<PathBuf>> {
    let ok: Vec<&RequestRecord> = o.records.iter().filter(|r| r.success).collect();
    let ms = |v: Vec<f64>| v.into_iter().map(|s| s * 1e3).collect::<Vec<f64>>();
    let panel = |metric: &str, v: Vec<f64>| crate::plot::CdfPanel {
        metric: metric.into(),
        runs: vec![(label.to_string(), ms(v))],
    };
    let panels = vec![
        panel("TTFT", ok.iter().filter_map(|r| r.ttft_s).collect()),
        panel("TPOT", ok.iter().filter_map(|r| r.tpot_s).collect()),
        panel("ITL", ok.iter().flat_map(|r| r.itls_s.iter().copied()).collect()),
        panel("E2EL", ok.iter().filter_map(|r| r.e2el_s).collect()),
    ];
    let slos: Vec<(String, f64)> =
        [("TTFT", o.info.slo.ttft_ms), ("TPOT", o.info.slo.tpot_ms), ("E2EL", o.info.slo.e2el_ms)]
            .into_iter()
            .filter_map(|(m, v)| v.map(|v| (m.to_string(), v)))
            .collect();
    let title = format!("Latency CDFs, {} requests", ok.len());
    crate::plot::latency_cdfs(stem, &title, &panels, &slos)
}

/// `YYYYMMDD-HHMMSS` in UTC (vLLM's result date format).
pub fn date_string(t: std::time::SystemTime) -> String {
    let (y, m, d, h, mi, sec) = utc_parts(t);
    format!("{y:04}{m:02}{d:02}-{h:02}{mi:02}{sec:02}")
}

/// RFC 3339 in UTC, `2026-11-30T08:00:00Z` (profile and report dates).
pub fn rfc3339_utc(t: std::time::SystemTime) -> String {
    let (y, m, d, h, mi, sec) = utc_parts(t);
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{sec:02}Z")
}

/// Year, month, day, hour, minute, second of `t` in UTC (no date crate for one format).
fn utc_parts(t: std::time::SystemTime) -> (i64, i64, i64, i64, i64, i64) {
    let secs = t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_date() {
        let a = ServeArgs::default();
        assert_eq!(a.endpoint, "/v1/completions");
        assert!(a.request_rate.is_infinite());
        assert_eq!(a.base_url(), "http://127.0.0.1:8000");
        let t = std::time::UNIX_EPOCH + Duration::from_secs(1_709_251_199); // 2024-02-29 23:59:59
        assert_eq!(date_string(t), "20240229-235959");
        assert_eq!(rfc3339_utc(t), "2024-02-29T23:59:59Z");
    }
}
