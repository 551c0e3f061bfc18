//! `cleave bench sweep`: [`crate::serve`] over request rates for several system configurations,
//! each started as its own `cleave up`, compared in one table, one JSON file and plots.
//!
//! Each measured point gets a fresh `cleave up` (unless `--reuse-server`): a point never inherits
//! another's prefix cache, queue or KV state, and a crashed configuration costs one point, not the
//! sweep. The server is stopped with SIGTERM (then killed after a grace period); `cleave up` itself
//! guarantees that its nodes do not outlive it.
//!
//! A configuration's *goodput* here is DistServe's: the highest request rate whose SLO attainment
//! is at least the target (`--attainment`, default 0.9). With `--request-rates` it is the highest
//! measured rate that meets the target (a lower bound); with `--search` it is found by bisection.
//! Each point also reports its own request goodput (requests per second meeting every SLO).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cleave_tokenizer::Tokenizer;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::error::{BenchError, Result};
use crate::metrics::{self, RequestRecord, Slo};
use crate::plot::{self, CdfPanel, Series};
use crate::result;
use crate::serve::{self, ServeArgs};

/// `cleave bench sweep` flags. The `serve` flags (dataset, SLOs via `--goodput`, seed, ...) apply to
/// every point; `--model` is also what each `cleave up` serves.
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {
    /// A system configuration, `NAME=FLAGS`: FLAGS are given to `cleave up` (split on
    /// whitespace), e.g. `--config "1p1d=--prefill 1 --decode 1 --pin"`. Repeat for each.
    #[arg(long = "config", required_unless_present = "reanalyze")]
    pub configs: Vec<String>,
    /// Request rates (req/s) to measure each configuration at, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub request_rates: Vec<f64>,
    /// Search each configuration's goodput by bisection between --search-min-rate and
    /// --search-max-rate instead of (or after) the listed rates.
    #[arg(long)]
    pub search: bool,
    #[arg(long, default_value_t = 0.05)]
    pub search_min_rate: f64,
    #[arg(long, default_value_t = 2.0)]
    pub search_max_rate: f64,
    /// Bisection steps per configuration.
    #[arg(long, default_value_t = 5)]
    pub search_steps: u32,
    /// SLO attainment a rate must reach to count toward goodput.
    #[arg(long, default_value_t = 0.9)]
    pub attainment: f64,
    /// Configuration the others are compared against (default: the last --config).
    #[arg(long)]
    pub baseline: Option<String>,
    /// Flags given to every `cleave up` (before each configuration's own), e.g.
    /// `--up-arg=--kv-cache-memory=1g`.
    #[arg(long = "up-arg", allow_hyphen_values = true)]
    pub up_args: Vec<String>,
    /// Keep one `cleave up` per configuration for all its rates.
    #[arg(long)]
    pub reuse_server: bool,
    /// Seconds to wait for `cleave up` to print its URL.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout: u64,
    /// Folder for sweep.json, each point's result file and the plots.
    #[arg(long, default_value = "sweep-results")]
    pub output_dir: PathBuf,
    /// Add this sweep's points to the sweep already in --output-dir (same configuration names),
    /// so more rates can be measured later; a point measured again replaces the old one.
    #[arg(long)]
    pub append: bool,
    /// Measure nothing: re-read the sweep in this folder (its sweep.json and result files) and
    /// report it under the --goodput SLOs and --attainment given now, into --output-dir.
    #[arg(long, value_name = "DIR")]
    pub reanalyze: Option<PathBuf>,
    /// The `cleave` binary to start (default: this one).
    #[arg(long)]
    pub cleave_bin: Option<PathBuf>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// One configuration under test.
#[derive(Debug, Clone, Serialize)]
pub struct SystemConfig {
    pub name: String,
    pub flags: Vec<String>,
}

impl SystemConfig {
    /// Parses `NAME=FLAGS`.
    pub fn parse(s: &str) -> Result<Self> {
        let (name, flags) =
            s.split_once('=').ok_or_else(|| BenchError::InvalidArg(format!("--config {s:?}: expected NAME=FLAGS")))?;
        let name = name.trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(BenchError::InvalidArg(format!(
                "--config {s:?}: the name must be non-empty letters, digits, '-', '_' or '.' (it names files)"
            )));
        }
        Ok(Self { name: name.to_string(), flags: flags.split_whitespace().map(str::to_string).collect() })
    }
}

/// One measured (configuration, rate) point.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    pub config: String,
    pub request_rate: f64,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub request_goodput: f64,
    pub slo_attainment: f64,
    pub median_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub median_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub median_e2el_ms: f64,
    pub result_file: PathBuf,
}

/// A configuration's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigResult {
    pub config: String,
    /// Highest measured rate with attainment >= the target; 0 when none.
    pub goodput_rate: f64,
    /// Highest per-point request goodput (req/s meeting every SLO).
    pub peak_request_goodput: f64,
    /// `goodput_rate` over the baseline's; None when the baseline's is 0.
    pub ratio_to_baseline: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SweepOutcome {
    pub slo: Slo,
    pub attainment_target: f64,
    pub baseline: String,
    pub configs: Vec<SystemConfig>,
    pub points: Vec<SweepPoint>,
    pub results: Vec<ConfigResult>,
}

/// A running `cleave up`, stopped on drop (SIGKILL there; [`UpServer::stop`] asks nicely first).
pub struct UpServer {
    child: Child,
    pub base_url: String,
}

impl UpServer {
    /// Starts `BIN up --model MODEL --port 0 FLAGS...` and waits for the line with its URL.
    pub async fn start(bin: &Path, model: &str, flags: &[String], ready_timeout: Duration) -> Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.arg("up").args(["--model", model, "--port", "0"]).args(flags);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| BenchError::io(bin, e))?;
        let stdout = child.stdout.take().ok_or_else(|| BenchError::Server("cleave up: no stdout".into()))?;
        let mut lines = BufReader::new(stdout).lines();
        let find = async {
            while let Some(line) = lines.next_line().await.map_err(|e| BenchError::io(bin, e))? {
                if let Some(rest) = line.split(" at http://").nth(1) {
                    let addr = rest.split("/v1").next().unwrap_or(rest).trim();
                    return Ok(format!("http://{addr}"));
                }
            }
            Err(BenchError::Server(format!("cleave up {} exited before printing its URL", flags.join(" "))))
        };
        let base_url = match tokio::time::timeout(ready_timeout, find).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(BenchError::Server(format!(
                    "cleave up {} printed no URL within {}s",
                    flags.join(" "),
                    ready_timeout.as_secs()
                )))
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, base_url })
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(mut self, grace: Duration) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
            if tokio::time::timeout(grace, self.child.wait()).await.is_ok() {
                return;
            }
        }
        let _ = self.child.kill().await;
    }
}

fn point_of(config: &str, rate: f64, s: &metrics::Summary, result_file: PathBuf) -> SweepPoint {
    let pct = |l: &crate::metrics::LatencyStats, p: f64| {
        l.percentiles_ms.iter().find(|(q, _)| (*q - p).abs() < 1e-9).map_or(f64::NAN, |x| x.1)
    };
    SweepPoint {
        config: config.to_string(),
        request_rate: rate,
        completed: s.completed,
        failed: s.failed,
        duration_s: s.duration_s,
        request_throughput: s.request_throughput,
        request_goodput: s.request_goodput.unwrap_or(0.0),
        slo_attainment: s.slo_attainment.unwrap_or(0.0),
        median_ttft_ms: s.ttft.median_ms,
        p99_ttft_ms: pct(&s.ttft, 99.0),
        median_tpot_ms: s.tpot.median_ms,
        p99_tpot_ms: pct(&s.tpot, 99.0),
        median_e2el_ms: s.e2el.median_ms,
        result_file,
    }
}

/// Each configuration's goodput rate, peak goodput and ratio to the baseline.
pub fn verdicts(points: &[SweepPoint], configs: &[SystemConfig], target: f64, baseline: &str) -> Vec<ConfigResult> {
    let of = |name: &str| {
        let mine = points.iter().filter(|p| p.config == name);
        let goodput_rate =
            mine.clone().filter(|p| p.slo_attainment >= target).map(|p| p.request_rate).fold(0.0, f64::max);
        let peak = mine.map(|p| p.request_goodput).fold(0.0, f64::max);
        (goodput_rate, peak)
    };
    let (base, _) = of(baseline);
    configs
        .iter()
        .map(|c| {
            let (goodput_rate, peak_request_goodput) = of(&c.name);
            ConfigResult {
                config: c.name.clone(),
                goodput_rate,
                peak_request_goodput,
                ratio_to_baseline: (base > 0.0).then(|| goodput_rate / base),
            }
        })
        .collect()
}

/// The next rates a bisection probes: the midpoint of the highest passing and lowest failing
/// measured rates (or the bounds while one side is unknown).
pub fn next_search_rate(measured: &[(f64, f64)], target: f64, lo: f64, hi: f64) -> f64 {
    let pass = measured.iter().filter(|m| m.1 >= target).map(|m| m.0).fold(f64::NAN, f64::max);
    let fail = measured.iter().filter(|m| m.1 < target).map(|m| m.0).fold(f64::NAN, f64::min);
    match (pass.is_nan(), fail.is_nan()) {
        (true, true) => lo,
        (true, false) if fail <= lo => lo / 2.0,
        (true, false) => lo,
        (false, true) if pass >= hi => hi * 2.0,
        (false, true) => hi,
        (false, false) => (pass + fail) / 2.0,
    }
}

/// `TTFT <= 500 ms, TPOT <= 50 ms` for the given SLOs.
pub fn describe(slo: &Slo) -> String {
    [("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2EL", slo.e2el_ms)]
        .into_iter()
        .filter_map(|(m, v)| v.map(|v| format!("{m} <= {v} ms")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn rate_tag(rate: f64) -> String {
    format!("{rate:.4}").trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Runs the sweep: prints progress to stderr and the table to stdout; writes sweep.json, each
/// point's result file, and the plots into `--output-dir`.
pub async fn run_sweep(args: &SweepArgs, tokenizer: Option<&Tokenizer>, cleave_bin: &Path) -> Result<SweepOutcome> {
    let configs: Vec<SystemConfig> = args.configs.iter().map(|c| SystemConfig::parse(c)).collect::<Result<_>>()?;
    let slo = Slo::parse(&args.serve.goodput)?;
    if slo.is_empty() {
        return Err(BenchError::InvalidArg("a sweep needs SLOs: --goodput ttft:MS tpot:MS [e2el:MS]".into()));
    }
    if args.request_rates.is_empty() && !args.search && args.reanalyze.is_none() {
        return Err(BenchError::InvalidArg("give --request-rates R1,R2,... or --search".into()));
    }
    if let Some(r) = args.request_rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        return Err(BenchError::InvalidArg(format!("--request-rates: {r} is not a positive finite rate")));
    }
    if !(0.0..=1.0).contains(&args.attainment) {
        return Err(BenchError::InvalidArg(format!("--attainment {} is not within [0, 1]", args.attainment)));
    }
    if args.search && !(args.search_min_rate > 0.0 && args.search_min_rate < args.search_max_rate) {
        return Err(BenchError::InvalidArg("--search needs 0 < --search-min-rate < --search-max-rate".into()));
    }
    if let Some(dir) = &args.reanalyze {
        return reanalyze(args, dir, slo);
    }
    let tokenizer = tokenizer.ok_or_else(|| BenchError::InvalidArg("measuring needs the model's tokenizer".into()))?;
    let model = args
        .serve
        .model
        .clone()
        .ok_or_else(|| BenchError::InvalidArg("--model: the model every `cleave up` serves".into()))?;
    std::fs::create_dir_all(&args.output_dir).map_err(|e| BenchError::io(&args.output_dir, e))?;
    let ready = Duration::from_secs(args.ready_timeout);

    let mut points = Vec::new();
    let mut outcomes: Vec<(String, f64, Vec<RequestRecord>)> = Vec::new();
    // The configurations measured now come first; an appended sweep's others follow.
    let to_measure = configs.clone();
    let mut configs = configs;
    let mut old_baseline = None;
    if args.append && args.output_dir.join("sweep.json").exists() {
        let old = load_sweep(&args.output_dir, &slo, &args.serve.metric_percentiles)?;
        let fresh: Vec<(String, f64)> =
            configs.iter().flat_map(|c| args.request_rates.iter().map(move |r| (c.name.clone(), *r))).collect();
        for (p, run) in old.points.into_iter().zip(old.runs) {
            if !fresh.iter().any(|(c, r)| *c == p.config && *r == p.request_rate) || args.search {
                points.push(p);
                outcomes.push(run);
            }
        }
        for c in old.configs {
            if !configs.iter().any(|x| x.name == c.name) {
                configs.push(c);
            }
        }
        old_baseline = old.baseline;
    }
    let baseline = args
        .baseline
        .clone()
        .or(old_baseline)
        .unwrap_or_else(|| configs.last().map(|c| c.name.clone()).unwrap_or_default());
    if !configs.iter().any(|c| c.name == baseline) {
        return Err(BenchError::InvalidArg(format!("--baseline {baseline}: no --config has that name")));
    }
    for cfg in &to_measure {
        let flags: Vec<String> = args.up_args.iter().chain(&cfg.flags).cloned().collect();
        let mut server: Option<UpServer> = None;
        let mut measured: Vec<(f64, f64)> = Vec::new();
        let steps = if args.search { args.search_steps as usize } else { 0 };
        for i in 0..args.request_rates.len() + steps {
            let rate = match args.request_rates.get(i) {
                Some(&r) => r,
                None => next_search_rate(&measured, args.attainment, args.search_min_rate, args.search_max_rate),
            };
            if server.is_none() {
                eprintln!("sweep: starting cleave up {} ({})", flags.join(" "), cfg.name);
                server = Some(UpServer::start(cleave_bin, &model, &flags, ready).await?);
            }
            let url = server.as_ref().map(|s| s.base_url.clone()).unwrap_or_default();
            let mut serve = args.serve.clone();
            serve.base_url = Some(url);
            serve.request_rate = rate;
            eprintln!("sweep: {} at {} req/s", cfg.name, rate_tag(rate));
            let outcome = serve::run_benchmark(&serve, tokenizer).await?;
            let file = args.output_dir.join(format!("{}-rate{}.json", cfg.name, rate_tag(rate)));
            result::save(&file, &result::result_json(&outcome.info, &outcome.summary, &outcome.records)?)?;
            let point = point_of(&cfg.name, rate, &outcome.summary, file);
            eprintln!(
                "sweep: {} at {} req/s: attainment {:.3}, goodput {:.3} req/s, median TTFT {:.0} ms, median TPOT {:.1} ms",
                cfg.name,
                rate_tag(rate),
                point.slo_attainment,
                point.request_goodput,
                point.median_ttft_ms,
                point.median_tpot_ms
            );
            measured.push((rate, point.slo_attainment));
            points.push(point);
            outcomes.push((cfg.name.clone(), rate, outcome.records));
            if !args.reuse_server {
                if let Some(s) = server.take() {
                    s.stop(Duration::from_secs(30)).await;
                }
            }
        }
        if let Some(s) = server.take() {
            s.stop(Duration::from_secs(30)).await;
        }
    }
    sort_points(&mut points, &configs);
    let results = verdicts(&points, &configs, args.attainment, &baseline);
    let outcome = SweepOutcome { slo, attainment_target: args.attainment, baseline, configs, points, results };
    write_outputs(args, &outcome, &outcomes)?;
    print!("{}", table(&outcome));
    Ok(outcome)
}

/// `--reanalyze`: the points of an earlier sweep under new SLOs.
fn reanalyze(args: &SweepArgs, dir: &Path, slo: Slo) -> Result<SweepOutcome> {
    let old = load_sweep(dir, &slo, &args.serve.metric_percentiles)?;
    let baseline = args.baseline.clone().or(old.baseline).unwrap_or_default();
    let mut points = old.points;
    sort_points(&mut points, &old.configs);
    let results = verdicts(&points, &old.configs, args.attainment, &baseline);
    let outcome =
        SweepOutcome { slo, attainment_target: args.attainment, baseline, configs: old.configs, points, results };
    std::fs::create_dir_all(&args.output_dir).map_err(|e| BenchError::io(&args.output_dir, e))?;
    write_outputs(args, &outcome, &old.runs)?;
    print!("{}", table(&outcome));
    Ok(outcome)
}

/// Configuration order, then rate (appended points land among their own configuration's).
fn sort_points(points: &mut [SweepPoint], configs: &[SystemConfig]) {
    let pos = |name: &str| configs.iter().position(|c| c.name == name).unwrap_or(usize::MAX);
    points.sort_by(|a, b| pos(&a.config).cmp(&pos(&b.config)).then(a.request_rate.total_cmp(&b.request_rate)));
}

/// An earlier sweep read back from its folder, its points judged by `slo`.
struct LoadedSweep {
    configs: Vec<SystemConfig>,
    baseline: Option<String>,
    points: Vec<SweepPoint>,
    runs: Vec<(String, f64, Vec<RequestRecord>)>,
}

fn load_sweep(dir: &Path, slo: &Slo, percentiles: &str) -> Result<LoadedSweep> {
    let path = dir.join("sweep.json");
    let text = std::fs::read_to_string(&path).map_err(|e| BenchError::io(&path, e))?;
    let old: serde_json::Value = serde_json::from_str(&text)?;
    let configs: Vec<SystemConfig> = old["configs"]
        .as_array()
        .ok_or_else(|| BenchError::InvalidArg(format!("{}: no configs", path.display())))?
        .iter()
        .map(|c| SystemConfig {
            name: c["name"].as_str().unwrap_or_default().to_string(),
            flags: c["flags"]
                .as_array()
                .map(|f| f.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
                .unwrap_or_default(),
        })
        .collect();
    let percentiles = metrics::parse_percentiles(percentiles)?;
    let mut points = Vec::new();
    let mut runs = Vec::new();
    for p in old["points"].as_array().into_iter().flatten() {
        let name = p["config"].as_str().unwrap_or_default().to_string();
        let rate = p["request_rate"].as_f64().unwrap_or(0.0);
        // Result files are named relative to where the sweep ran; look beside sweep.json too.
        let file = PathBuf::from(p["result_file"].as_str().unwrap_or_default());
        let file = if file.exists() { file } else { dir.join(file.file_name().unwrap_or_default()) };
        let text = std::fs::read_to_string(&file).map_err(|e| BenchError::io(&file, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let records = result::records_from_json(&v)?;
        let duration = v["duration"].as_f64().unwrap_or(0.0);
        let summary = metrics::summarize(&records, duration, slo, &percentiles);
        points.push(point_of(&name, rate, &summary, file));
        runs.push((name, rate, records));
    }
    Ok(LoadedSweep { configs, baseline: old["baseline"].as_str().map(str::to_string), points, runs })
}

/// The sweep table: one row per point, then each configuration's verdict.
pub fn table(o: &SweepOutcome) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "{:=^100}", " Sweep Result ");
    let _ = writeln!(s, "SLOs: {}  attainment target: {:.0}%", describe(&o.slo), o.attainment_target * 100.0);
    let _ = writeln!(
        s,
        "{:<12} {:>8} {:>6} {:>6} {:>10} {:>10} {:>11} {:>11} {:>11} {:>11}",
        "config", "rate", "ok", "fail", "attain", "goodput", "p50 TTFT", "p99 TTFT", "p50 TPOT", "p99 TPOT"
    );
    for p in &o.points {
        let _ = writeln!(
            s,
            "{:<12} {:>8} {:>6} {:>6} {:>9.1}% {:>10.3} {:>9.0}ms {:>9.0}ms {:>9.1}ms {:>9.1}ms",
            p.config,
            rate_tag(p.request_rate),
            p.completed,
            p.failed,
            p.slo_attainment * 100.0,
            p.request_goodput,
            p.median_ttft_ms,
            p.p99_ttft_ms,
            p.median_tpot_ms,
            p.p99_tpot_ms
        );
    }
    let _ = writeln!(s, "{:-^100}", "");
    for r in &o.results {
        let ratio = r.ratio_to_baseline.map_or("n/a".to_string(), |x| format!("{x:.2}x"));
        let _ = writeln!(
            s,
            "{:<12} goodput {:.3} req/s (highest rate at >= {:.0}% attainment), peak request goodput {:.3} req/s, vs {}: {}",
            r.config,
            r.goodput_rate,
            o.attainment_target * 100.0,
            r.peak_request_goodput,
            o.baseline,
            ratio
        );
    }
    let _ = writeln!(s, "{:=^100}", "");
    s
}

fn write_outputs(args: &SweepArgs, o: &SweepOutcome, runs: &[(String, f64, Vec<RequestRecord>)]) -> Result<()> {
    let dir = &args.output_dir;
    let json = serde_json::to_value(o)?;
    result::save(&dir.join("sweep.json"), &json)?;
    let series = |f: fn(&SweepPoint) -> f64| -> Vec<Series> {
        o.configs
            .iter()
            .map(|c| {
                let mut pts: Vec<(f64, f64)> =
                    o.points.iter().filter(|p| p.config == c.name).map(|p| (p.request_rate, f(p))).collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series { label: c.name.clone(), points: pts }
            })
            .collect()
    };
    let slo = describe(&o.slo);
    plot::lines(
        &dir.join("goodput"),
        &format!("Request goodput ({slo})"),
        "request rate (req/s)",
        "goodput (req/s)",
        &series(|p| p.request_goodput),
        None,
    )?;
    plot::lines(
        &dir.join("attainment"),
        &format!("SLO attainment ({slo})"),
        "request rate (req/s)",
        "fraction of requests meeting every SLO",
        &series(|p| p.slo_attainment),
        Some((o.attainment_target, "target")),
    )?;
    // Latency CDFs per rate, every configuration measured at that rate in one figure.
    let mut rates: Vec<f64> = runs.iter().map(|r| r.1).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    let slos: Vec<(String, f64)> = [("TTFT", o.slo.ttft_ms), ("TPOT", o.slo.tpot_ms), ("E2EL", o.slo.e2el_ms)]
        .into_iter()
        .filter_map(|(m, v)| v.map(|v| (m.to_string(), v)))
        .collect();
    for rate in rates {
        let at: Vec<&(String, f64, Vec<RequestRecord>)> = runs.iter().filter(|r| r.1 == rate).collect();
        let panel = |metric: &str, f: fn(&crate::metrics::RequestRecord) -> Vec<f64>| CdfPanel {
            metric: metric.to_string(),
            runs: at
                .iter()
                .map(|(name, _, records)| {
                    (name.clone(), records.iter().filter(|r| r.success).flat_map(f).map(|s| s * 1e3).collect())
                })
                .collect(),
        };
        let panels = vec![
            panel("TTFT", |r| r.ttft_s.into_iter().collect()),
            panel("TPOT", |r| r.tpot_s.into_iter().collect()),
            panel("ITL", |r| r.itls_s.clone()),
            panel("E2EL", |r| r.e2el_s.into_iter().collect()),
        ];
        plot::latency_cdfs(
            &dir.join(format!("cdf-rate{}", rate_tag(rate))),
            &format!("Latency CDFs at {} req/s", rate_tag(rate)),
            &panels,
            &slos,
        )?;
    }
    Ok(())
}

/// Builds a runtime and runs the sweep (`tokenizer` may be `None` with `--reanalyze`).
pub fn run(args: SweepArgs, tokenizer: Option<Tokenizer>, cleave_bin: PathBuf) -> Result<SweepOutcome> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::io("tokio runtime", e))?;
    rt.block_on(run_sweep(&args, tokenizer.as_ref(), &cleave_bin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parsing() {
        let c = SystemConfig::parse("1p1d=--prefill 1  --decode 1 --pin").unwrap();
        assert_eq!(c.name, "1p1d");
        assert_eq!(c.flags, ["--prefill", "1", "--decode", "1", "--pin"]);
        assert!(SystemConfig::parse("no-equals").is_err());
        assert!(SystemConfig::parse("a/b=--pin").is_err(), "names become file names");
        assert!(SystemConfig::parse("=--pin").is_err());
    }

    fn point(config: &str, rate: f64, attainment: f64, goodput: f64) -> SweepPoint {
        SweepPoint {
            config: config.into(),
            request_rate: rate,
            completed: 10,
            failed: 0,
            duration_s: 1.0,
            request_throughput: rate,
            request_goodput: goodput,
            slo_attainment: attainment,
            median_ttft_ms: 0.0,
            p99_ttft_ms: 0.0,
            median_tpot_ms: 0.0,
            p99_tpot_ms: 0.0,
            median_e2el_ms: 0.0,
            result_file: PathBuf::new(),
        }
    }

    #[test]
    fn verdict_is_the_highest_rate_meeting_the_target() {
        let configs = vec![SystemConfig::parse("d=--pin").unwrap(), SystemConfig::parse("c=--pin").unwrap()];
        let points = vec![
            point("d", 0.1, 1.0, 0.1),
            point("d", 0.2, 0.95, 0.19),
            point("d", 0.4, 0.5, 0.2),
            point("c", 0.1, 0.92, 0.092),
            point("c", 0.2, 0.6, 0.12),
            // A non-monotone blip above a failing rate still counts: it was measured passing.
            point("c", 0.05, 0.89, 0.04),
        ];
        let v = verdicts(&points, &configs, 0.9, "c");
        assert_eq!(v[0].goodput_rate, 0.2);
        assert_eq!(v[0].peak_request_goodput, 0.2);
        assert_eq!(v[1].goodput_rate, 0.1);
        assert_eq!(v[0].ratio_to_baseline, Some(2.0));
        assert_eq!(v[1].ratio_to_baseline, Some(1.0));
        let none = verdicts(&points[..3], &configs, 0.99, "c");
        assert_eq!(none[0].goodput_rate, 0.1);
        assert_eq!(none[0].ratio_to_baseline, None, "a baseline with no passing rate has no ratio");
    }

    #[test]
    fn bisection_narrows_between_pass_and_fail() {
        assert_eq!(next_search_rate(&[], 0.9, 0.1, 2.0), 0.1);
        assert_eq!(next_search_rate(&[(0.1, 0.95)], 0.9, 0.1, 2.0), 2.0);
        assert_eq!(next_search_rate(&[(0.1, 0.95), (2.0, 0.2)], 0.9, 0.1, 2.0), 1.05);
        assert_eq!(next_search_rate(&[(0.1, 0.5)], 0.9, 0.1, 2.0), 0.05, "below the floor: halve it");
        assert_eq!(next_search_rate(&[(0.1, 1.0), (2.0, 1.0)], 0.9, 0.1, 2.0), 4.0, "above the ceiling: double it");
    }
}
