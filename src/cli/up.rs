//! `cleave up`: the whole system on one machine. Starts the coordinator and the nodes as child
//! processes of this binary on loopback, with a freshly generated cluster CA, waits until every
//! one is ready (each prints a `READY` line), prints the URL, and on Ctrl-C or SIGTERM stops
//! them all. Children watch their stdin, which this process holds, so they never outlive it
//! even if it is killed.
//!
//! Supervision: a coordinator that dies is started again on the same API and cluster
//! addresses (the nodes re-register with it on their own, and it rebuilds its table from
//! them); a node that dies is started again, each process at most `--restart-budget` times. A
//! node the coordinator told to leave (it drained) exits cleanly and is not restarted.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use cleave_engine::model::synth::{self, SynthDtype};
use cleave_net::tls::{CertFiles, Roles};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::serve::TransportArg;

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Model folder (Hugging Face layout), .gguf file or hub id (owner/name[@revision]).
    /// Default: a built-in random-weight model (preset `small`), written once into the cache
    /// folder, so that the first run needs no download (its text is meaningless; use a real
    /// model for real answers).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: Option<PathBuf>,
    /// HTTP port of the OpenAI-compatible API.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address the API binds.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Prefill nodes (disaggregated mode).
    #[arg(long, conflicts_with = "colocated")]
    pub prefill: Option<usize>,
    /// Decode nodes (disaggregated mode).
    #[arg(long, conflicts_with = "colocated")]
    pub decode: Option<usize>,
    /// Colocated nodes that prefill and decode their own requests (a conventional engine each).
    ///
    /// With no --prefill, --decode or --colocated: 1 prefill + 1 decode node, except with
    /// `--planner auto --pacing`, which starts 2 colocated nodes at a 128-token step budget
    /// (unless --node-arg sets one) and leaves the split to the planner.
    #[arg(long)]
    pub colocated: Option<usize>,
    /// KV cache per node (suffixes k, m, g).
    #[arg(long, default_value = "512m")]
    #[arg(value_parser = super::parse_bytes)]
    pub kv_cache_memory: usize,
    /// What every node's KV cache stores: f32, or f16/bf16 (half the memory per token and half
    /// the bytes per handoff).
    #[arg(long, value_enum, default_value_t = super::KvDtypeArg::F32)]
    pub kv_cache_dtype: super::KvDtypeArg,
    /// Every node dequantizes a GGUF's quantized weights (and widens 16-bit ones) to f32 at load
    /// instead of multiplying them in their format (for comparison; see `cleave node --help`).
    #[arg(long)]
    pub dequantize_weights: bool,
    /// The prefill nodes load this file instead of --model: another format of the same model
    /// (an f32 or bf16 folder beside a Q4 GGUF: GEMM throughput rules prefill). Nodes of
    /// different formats share a cluster when the model is the same (its config, vocabulary
    /// and norm weights); `GET /admin/nodes` shows each node's format. Nodes the planner starts
    /// later, and roles switched later, keep --model's and their own format.
    #[arg(long, value_name = "PATH")]
    pub prefill_model: Option<PathBuf>,
    /// The decode nodes load this file instead of --model (a Q4 GGUF: bytes rule decode).
    #[arg(long, value_name = "PATH")]
    pub decode_model: Option<PathBuf>,
    /// The prefill nodes dequantize a GGUF's weights to f32 at load (decode nodes keep them
    /// quantized): f32 GEMM for prefill and a quarter of the bytes per decode step, from one
    /// GGUF file.
    #[arg(long)]
    pub prefill_dequantize_weights: bool,
    /// Compute threads per node (default: the cores divided among the nodes).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Pin each node to cores of its own with taskset, as many as its compute threads (node i
    /// takes the next ones, modulo the cores), so nodes do not share cores. The default whenever
    /// there are no more nodes than cores (unpinned nodes on 2 cores decoded at 73 ms a token
    /// where pinned ones took 57).
    #[arg(long, conflicts_with = "no_pin")]
    pub pin: bool,
    /// Never pin nodes to cores.
    #[arg(long)]
    pub no_pin: bool,
    /// Token of the coordinator's admin API (`cleave admin`, `/admin/...`). Default: a random
    /// one, printed at start. 8-256 printable ASCII characters without spaces, `;` or `,`.
    #[arg(long, env = "CLEAVE_ADMIN_TOKEN", value_parser = cleave_coordinator::cluster::validate_admin_token)]
    pub admin_token: Option<String>,
    /// The planner: off, advise (decisions shown, nothing acted on) or auto (it switches node
    /// roles to keep the targets).
    #[arg(long, value_enum, default_value_t = super::serve::PlannerModeArg::Advise)]
    pub planner: super::serve::PlannerModeArg,
    /// The planner's time-to-first-token target (ms, p90).
    #[arg(long, default_value_t = 3000.0)]
    pub ttft_target_ms: f64,
    /// The planner's time-per-output-token target (ms, p90).
    #[arg(long, default_value_t = 100.0)]
    pub tpot_target_ms: f64,
    /// Colocated nodes held to this time per output token (ms) when tighter than the target
    /// (see `cleave coordinator --colocated-tpot-target-ms`).
    #[arg(long)]
    pub colocated_tpot_target_ms: Option<f64>,
    /// Nodes pace prompt chunks beside running decodes to the TPOT target (the coordinator
    /// sends it to every node; `cleave_engine::sched::pacing`). Off by default: pacing protects
    /// TPOT at the expense of TTFT and does not yet know the TTFT target, so it costs a load
    /// whose TTFT binds (BENCHMARKS.md, "Pacing").
    #[arg(long)]
    pub pacing: bool,
    /// SLO admission on the coordinator (see `cleave coordinator --slo-admission`): nodes take
    /// as many streams as keep the TPOT target, requests wait for a seat, and one that waited
    /// half the TTFT target is refused with 503.
    #[arg(long)]
    pub slo_admission: bool,
    /// The engine's cost profile the planner predicts with (`cleave bench profile` output; see
    /// `cleave coordinator --planner-profile`).
    #[arg(long)]
    pub planner_profile: Option<PathBuf>,
    /// Restarts allowed per process (a coordinator or node that dies is started again).
    #[arg(long, default_value_t = 5)]
    pub restart_budget: u32,
    /// Most nodes in all: with more than the nodes started, the planner (in auto mode) may
    /// start node processes up to this many, and stop them again.
    #[arg(long)]
    pub max_nodes: Option<usize>,
    /// Require this API key (Bearer) on the API routes.
    #[arg(long, env = "CLEAVE_API_KEY")]
    pub api_key: Option<String>,
    /// API keys with names and concurrent-request limits, one per line: `NAME KEY [MAX_CONCURRENT]`.
    #[arg(long, env = "CLEAVE_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Concurrent-request limit of a key that names none (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub api_key_max_concurrent: u32,
    /// Serve HTTPS with this certificate chain (PEM); needs `--tls-key` (`cleave certs --edge
    /// HOST` makes one signed by a local CA).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Internal transport between processes.
    #[arg(long, value_enum, default_value_t = TransportArg::Quic)]
    pub transport: TransportArg,
    /// Extra flags for every node (e.g. `--node-arg=--max-num-seqs=32`).
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    pub node_args: Vec<String>,
    /// Extra flags for the coordinator (e.g. `--coordinator-arg=--local-prefill-max-tokens=0`).
    #[arg(long = "coordinator-arg", allow_hyphen_values = true)]
    pub coordinator_args: Vec<String>,
    /// Seconds to wait for every process to be ready.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_secs: u64,
}

struct Proc {
    name: String,
    child: Child,
    /// How to start it again.
    args: Vec<String>,
    /// The cores it is pinned to (a taskset list), when pinning.
    pin: Option<String>,
    restarts: u32,
    /// Exited for good (left the cluster, or out of restarts).
    done: bool,
    /// Where its `LAUNCH` lines go (the coordinator's).
    launches: Option<tokio::sync::mpsc::UnboundedSender<String>>,
}

/// Starts the nodes the planner asks for (`LAUNCH role=...` lines of the coordinator).
struct Launcher {
    /// A node's arguments, with `NAME` and `ROLE` to fill in.
    template: Vec<String>,
    /// Names (with certificates) not used yet.
    spare: std::collections::VecDeque<String>,
    /// The machine's cores and each node's threads, when pinning.
    pin: Option<(usize, usize)>,
    max_nodes: usize,
    requests: tokio::sync::mpsc::UnboundedReceiver<String>,
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    // A bad profile is said here, before any process starts, not by a coordinator that exits.
    if let Some(p) = &args.planner_profile {
        cleave_bench::sim::profile::load(p).with_context(|| format!("--planner-profile {}", p.display()))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(up(args))
}

/// The cache folder for the built-in model.
fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CLEAVE_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("cleave");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("cleave"),
        None => std::env::temp_dir().join("cleave-cache"),
    }
}

/// The built-in default model, written on first use.
pub fn default_model() -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join("default-model-small-seed0");
    if !dir.join("model.safetensors").exists() {
        let spec = synth::preset_or_err("small")?;
        let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
        synth::write_model(&spec, 0, SynthDtype::F32, &tmp)
            .with_context(|| format!("writing the built-in model to {}", tmp.display()))?;
        // Atomic from a concurrent `up`'s point of view.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        eprintln!("wrote the built-in default model (random weights, preset `small`) to {}", dir.display());
    }
    Ok(dir)
}

/// Step budget of the colocated nodes `cleave up --planner auto --pacing` starts with.
const PLANNER_START_BUDGET: usize = 128;

/// The nodes `cleave up` starts, and the step budget it gives its colocated nodes (None: the
/// node's default or what --node-arg says).
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    prefill: usize,
    decode: usize,
    colocated: usize,
    start_budget: Option<usize>,
}

/// The shape the flags ask for. With none given: 1 prefill + 1 decode node, except that the
/// planner in auto mode with paced nodes starts from 2 colocated nodes: they serve any mix
/// while the planner has no demand to go on, where a split's lone prefill core queues a
/// prompt-heavy start for the planner's whole first window (BENCHMARKS.md, "Step budgets by time").
/// Their budget, [`PLANNER_START_BUDGET`], is the one two paced colocated nodes served best at
/// every TPOT target measured (70, 100 and 150 ms: level with or above 256 and 2048 on the mean
/// of each, on both machines; BENCHMARKS.md, "The planner's starting budget"): chunks small
/// enough that a prompt arriving mid-step waits little, without whole-prompt steps that batch a
/// queue. The planner's model rates 128-512 about alike, so a start of 256 stayed at 256 and
/// trailed static 128; the planner moves the budget from here when its model predicts a gain.
fn start_shape(args: &UpArgs) -> Shape {
    let planner_start = args.planner == super::serve::PlannerModeArg::Auto
        && args.pacing
        && (args.prefill, args.decode, args.colocated) == (None, None, None);
    let (prefill, decode, colocated) = match (args.prefill, args.decode, args.colocated) {
        (_, _, Some(k)) => (0, 0, k),
        (None, None, None) if planner_start => (0, 0, 2),
        (None, None, None) => (1, 1, 0),
        (p, d, None) => (p.unwrap_or(1), d.unwrap_or(1), 0),
    };
    let budget_given = args.node_args.iter().any(|a| a.starts_with("--max-num-batched-tokens"));
    let start_budget = (planner_start && !budget_given).then_some(PLANNER_START_BUDGET);
    Shape { prefill, decode, colocated, start_budget }
}

async fn up(args: UpArgs) -> anyhow::Result<()> {
    let Shape { prefill, decode, colocated, start_budget } = start_shape(&args);
    anyhow::ensure!(prefill + decode + colocated > 0, "no node to start");
    anyhow::ensure!(decode + colocated > 0, "at least one decode or colocated node is needed to generate tokens");
    let model = match &args.model {
        Some(m) => m.clone(),
        None => default_model()?,
    };
    for (flag, path) in [("--prefill-model", &args.prefill_model), ("--decode-model", &args.decode_model)] {
        if let Some(p) = path {
            anyhow::ensure!(p.exists(), "{flag} {}: no such model folder or GGUF file", p.display());
        }
    }
    let exe = std::env::current_exe().context("locating the cleave binary")?;
    remove_stale_cert_dirs();
    let certs = std::env::temp_dir().join(format!("cleave-up-{}", std::process::id()));
    let mut names = vec!["coordinator".to_string()];
    let mut nodes = Vec::new();
    for i in 0..prefill {
        nodes.push((format!("prefill-{i}"), "prefill"));
    }
    for i in 0..decode {
        nodes.push((format!("decode-{i}"), "decode"));
    }
    for i in 0..colocated {
        nodes.push((format!("node-{i}"), "both"));
    }
    names.extend(nodes.iter().map(|(n, _)| n.clone()));
    let max_nodes = args.max_nodes.unwrap_or(nodes.len());
    anyhow::ensure!(
        max_nodes >= nodes.len(),
        "--max-nodes {max_nodes} is fewer than the {} nodes asked for",
        nodes.len()
    );
    // Names (and certificates) for the nodes the planner may add.
    let spare: std::collections::VecDeque<String> =
        (0..max_nodes - nodes.len()).map(|i| format!("extra-{i}")).collect();
    names.extend(spare.iter().cloned());
    if args.transport != TransportArg::TcpPlain {
        // The coordinator's certificate allows the coordinator's role alone; the nodes' every
        // node role (the planner switches them).
        let files = CertFiles { dir: certs.clone() };
        files.generate_with(&names[..1], Roles::COORDINATOR).context("generating the cluster CA and certificates")?;
        files.generate(&names[1..]).context("generating the node certificates")?;
    }
    let transport = match args.transport {
        TransportArg::Quic => "quic",
        TransportArg::TcpTls => "tcp-tls",
        TransportArg::TcpPlain => "tcp-plain",
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pin = args.pin || (!args.no_pin && max_nodes <= cores);
    let admin_token = args.admin_token.clone().unwrap_or_else(random_token);
    let threads = args.threads.unwrap_or_else(|| (cores / nodes.len().max(1)).max(1));
    let common = |name: &str| {
        let mut v = vec![
            "--name".to_string(),
            name.to_string(),
            "--transport".into(),
            transport.into(),
            "--exit-with-parent".into(),
        ];
        if args.transport != TransportArg::TcpPlain {
            v.extend(["--certs".to_string(), certs.display().to_string()]);
        }
        v
    };

    let mut procs: Vec<Proc> = Vec::new();
    let (launch_tx, launch_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let result = async {
        // The coordinator first: the nodes need its cluster address.
        let mut cargs = vec![
            "coordinator".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--listen".into(),
            std::net::SocketAddr::new(args.host, args.port).to_string(),
            "--cluster-listen".into(),
            "127.0.0.1:0".into(),
        ];
        if let Some(k) = &args.api_key {
            cargs.extend(["--api-key".to_string(), k.clone()]);
        }
        if let Some(f) = &args.api_keys_file {
            // The coordinator runs in another working directory only if told to; pass it whole.
            let f = std::path::absolute(f).unwrap_or_else(|_| f.clone());
            cargs.extend(["--api-keys-file".to_string(), f.display().to_string()]);
        }
        cargs.extend(["--api-key-max-concurrent".to_string(), args.api_key_max_concurrent.to_string()]);
        for (flag, path) in [("--tls-cert", &args.tls_cert), ("--tls-key", &args.tls_key)] {
            if let Some(p) = path {
                let p = std::path::absolute(p).unwrap_or_else(|_| p.clone());
                cargs.extend([flag.to_string(), p.display().to_string()]);
            }
        }
        let mode = match args.planner {
            super::serve::PlannerModeArg::Off => "off",
            super::serve::PlannerModeArg::Advise => "advise",
            super::serve::PlannerModeArg::Auto => "auto",
        };
        cargs.extend([
            "--admin-token".to_string(),
            admin_token.clone(),
            "--planner".into(),
            mode.into(),
            // `--flag=value`: a negative number passed apart reads as a flag of its own, and the
            // coordinator would answer "unexpected argument" instead of naming the bad value.
            format!("--ttft-target-ms={}", args.ttft_target_ms),
            format!("--tpot-target-ms={}", args.tpot_target_ms),
        ]);
        if let Some(p) = &args.planner_profile {
            cargs.extend(["--planner-profile".to_string(), p.display().to_string()]);
        }
        if let Some(ms) = args.colocated_tpot_target_ms {
            cargs.push(format!("--colocated-tpot-target-ms={ms}"));
        }
        if args.pacing {
            cargs.push("--pacing".into());
        }
        if args.slo_admission {
            cargs.push("--slo-admission".into());
        }
        if max_nodes > nodes.len() {
            cargs.extend(["--max-nodes".to_string(), max_nodes.to_string(), "--launch-nodes-via-stdout".into()]);
        }
        cargs.extend(common("coordinator"));
        cargs.extend(args.coordinator_args.iter().cloned());
        let (mut proc_, ready) =
            spawn(&exe, "coordinator", cargs, None, args.ready_timeout_secs, Some(launch_tx.clone())).await?;
        let cluster = ready.get("cluster").cloned().context("coordinator READY line without cluster=")?;
        let http = ready.get("http").cloned().context("coordinator READY line without http=")?;
        // A restarted coordinator must come back where the nodes and clients look for it.
        set_arg(&mut proc_.args, "--cluster-listen", &cluster);
        set_arg(&mut proc_.args, "--listen", &http);
        procs.push(proc_);

        // The nodes load their models in parallel.
        let node_args = |name: &str, role: &str| {
            let (node_model, dequantize) = match role {
                "prefill" => (
                    args.prefill_model.as_ref().unwrap_or(&model),
                    args.dequantize_weights || args.prefill_dequantize_weights,
                ),
                "decode" => (args.decode_model.as_ref().unwrap_or(&model), args.dequantize_weights),
                _ => (&model, args.dequantize_weights),
            };
            let mut nargs = vec![
                "node".to_string(),
                "--role".into(),
                role.to_string(),
                "--model".into(),
                node_model.display().to_string(),
                "--coordinator".into(),
                cluster.clone(),
                "--kv-cache-memory".into(),
                args.kv_cache_memory.to_string(),
                "--kv-cache-dtype".into(),
                args.kv_cache_dtype.to_string(),
                "--threads".into(),
                threads.to_string(),
            ];
            if dequantize {
                nargs.push("--dequantize-weights".into());
            }
            nargs.extend(common(name));
            if let (Some(b), "both") = (start_budget, role) {
                nargs.extend(["--max-num-batched-tokens".to_string(), b.to_string()]);
            }
            nargs.extend(args.node_args.iter().cloned());
            nargs
        };
        let mut pending = Vec::new();
        for (i, (name, role)) in nodes.iter().enumerate() {
            let pin = pin.then(|| pin_cores(i, threads, cores));
            pending.push(spawn(&exe, name, node_args(name, role), pin, args.ready_timeout_secs, None));
        }
        let template = node_args("NAME", "ROLE");
        for r in futures::future::join_all(pending).await {
            let (p, _) = r?;
            procs.push(p);
        }
        let shape = if colocated > 0 {
            format!("{colocated} colocated")
        } else {
            format!("{prefill} prefill + {decode} decode")
        };
        if args.admin_token.is_none() {
            println!("admin token (for `cleave admin` and /admin/...): {admin_token}");
        }
        let scheme = if args.tls_cert.is_some() { "https" } else { "http" };
        println!("dashboard: {scheme}://{http}/dashboard (sign in with the admin token)");
        println!("cleave is serving {} at {scheme}://{http}/v1 ({shape} nodes; Ctrl-C stops)", model.display());
        anyhow::Ok(template)
    }
    .await;

    let outcome = match result {
        Err(e) => Err(e),
        Ok(template) => {
            let launcher =
                Launcher { template, spare, pin: pin.then_some((cores, threads)), max_nodes, requests: launch_rx };
            supervise(&exe, &mut procs, launcher, args.restart_budget, args.ready_timeout_secs).await
        }
    };
    stop_all(&mut procs).await;
    let _ = std::fs::remove_dir_all(&certs);
    outcome
}

/// The cores node `i` is pinned to (a taskset list): as many as its `threads` (at most the
/// machine's `cores`), the next ones after node `i - 1`'s, modulo the cores. One core per node
/// would put every thread of a node on one core: `cleave up --colocated 1` on 2 cores ran its two
/// compute threads on core 0 and prefilled at half the engine's speed (a 256-token prompt's first
/// token after 1.05 s where `cleave bench engine` takes 0.56 s).
fn pin_cores(i: usize, threads: usize, cores: usize) -> String {
    let cores = cores.max(1);
    let n = threads.clamp(1, cores);
    (0..n).map(|j| ((i * n + j) % cores).to_string()).collect::<Vec<_>>().join(",")
}

/// The cores for a node the planner starts later (a taskset list): the `threads` (at most
/// `cores`) cores that the live nodes' pins use least, the lowest first among equals. Counting
/// the nodes started so far instead (as [`pin_cores`] does at start) put a node started after
/// another had left on a live node's cores while the departed node's stayed idle.
fn spare_cores<'a>(live: impl Iterator<Item = &'a str>, threads: usize, cores: usize) -> String {
    let cores = cores.max(1);
    let mut load = vec![0usize; cores];
    for core in live.flat_map(|list| list.split(',')).filter_map(|c| c.parse::<usize>().ok()) {
        if let Some(l) = load.get_mut(core) {
            *l += 1;
        }
    }
    let mut order: Vec<usize> = (0..cores).collect();
    order.sort_by_key(|&c| (load[c], c));
    let mut pick = order[..threads.clamp(1, cores)].to_vec();
    pick.sort_unstable();
    pick.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")
}

/// Starts one child and waits for its `READY key=value ...` line.
async fn spawn(
    exe: &std::path::Path,
    name: &str,
    args: Vec<String>,
    pin: Option<String>,
    timeout_secs: u64,
    launches: Option<tokio::sync::mpsc::UnboundedSender<String>>,
) -> anyhow::Result<(Proc, HashMap<String, String>)> {
    let mut cmd = match &pin {
        Some(cores) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cores).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(&args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).kill_on_drop(true);
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix("READY ") {
                let kv = rest.split_whitespace().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.into(), v.into()));
                return anyhow::Ok(Some(kv.collect::<HashMap<String, String>>()));
            }
            println!("[{name}] {line}");
        }
        Ok(None)
    };
    let ready = tokio::time::timeout(Duration::from_secs(timeout_secs), ready).await;
    let kv = match ready {
        Ok(Ok(Some(kv))) => kv,
        Ok(Ok(None)) => {
            let status = child.wait().await?;
            anyhow::bail!("{name} exited before it was ready ({status}); see its messages above");
        }
        Ok(Err(e)) => anyhow::bail!("reading {name}'s output: {e}"),
        Err(_) => anyhow::bail!("{name} was not ready after {timeout_secs} s"),
    };
    // Keep draining the child's stdout so it never blocks on a full pipe.
    let tag = name.to_string();
    let forward = launches.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            match (line.strip_prefix(cleave_coordinator::cluster::LAUNCH_PREFIX), &forward) {
                (Some(role), Some(tx)) => {
                    let _ = tx.send(role.trim().to_string());
                }
                _ => println!("[{tag}] {line}"),
            }
        }
    });
    Ok((Proc { name: name.to_string(), child, args, pin, restarts: 0, done: false, launches }, kv))
}

/// Sets `flag value` in `args` (replacing the value when the flag is there).
fn set_arg(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_string(),
        _ => args.extend([flag.to_string(), value.to_string()]),
    }
}

/// 32 hex digits from the OS's randomness.
fn random_token() -> String {
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).is_err() {
        // No /dev/urandom: the clock and pid are a weak but unique-enough fallback.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b[..8].copy_from_slice(&(t.as_nanos() as u64).to_le_bytes());
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs until a signal; starts again a process that dies (each at most `budget` times), except
/// a node that left the cluster cleanly. Err when the coordinator is out of restarts.
async fn supervise(
    exe: &std::path::Path,
    procs: &mut Vec<Proc>,
    mut launcher: Launcher,
    budget: u32,
    ready_secs: u64,
) -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = term.recv() => return Ok(()),
            Some(role) = launcher.requests.recv() => {
                let live = procs.iter().skip(1).filter(|p| !p.done).count();
                if !matches!(role.as_str(), "prefill" | "decode" | "both") {
                    eprintln!("cleave up: the coordinator asked for a node of unknown role {role:?}");
                    continue;
                }
                if live >= launcher.max_nodes {
                    eprintln!("cleave up: the planner asked for a {role} node, but {live} of {} run", launcher.max_nodes);
                    continue;
                }
                let Some(name) = launcher.spare.pop_front() else {
                    eprintln!("cleave up: no spare node name left for a {role} node");
                    continue;
                };
                let args: Vec<String> = launcher
                    .template
                    .iter()
                    .map(|a| match a.as_str() { "NAME" => name.clone(), "ROLE" => role.clone(), _ => a.clone() })
                    .collect();
                let pin = launcher.pin.map(|(cores, threads)| {
                    let live = procs.iter().skip(1).filter(|p| !p.done).filter_map(|p| p.pin.as_deref());
                    spare_cores(live, threads, cores)
                });
                eprintln!("cleave up: starting {name} ({role}) for the planner");
                match spawn(exe, &name, args, pin, ready_secs, None).await {
                    Ok((p, _)) => procs.push(p),
                    Err(e) => {
                        eprintln!("cleave up: starting {name} failed: {e:#}");
                        launcher.spare.push_back(name);
                    }
                }
            }
            _ = tick.tick() => {
                for (i, p) in procs.iter_mut().enumerate() {
                    if p.done {
                        continue;
                    }
                    let Ok(Some(status)) = p.child.try_wait() else { continue };
                    if i > 0 && status.success() {
                        eprintln!("cleave up: {} left the cluster", p.name);
                        p.done = true;
                        continue;
                    }
                    if p.restarts >= budget {
                        p.done = true;
                        if i == 0 {
                            anyhow::bail!("the coordinator exited ({status}) and was restarted {budget} times; stopping every node");
                        }
                        eprintln!("cleave up: {} exited ({status}); out of restarts ({budget})", p.name);
                        continue;
                    }
                    eprintln!("cleave up: {} exited ({status}); starting it again", p.name);
                    match spawn(exe, &p.name, p.args.clone(), p.pin.clone(), ready_secs, p.launches.clone()).await {
                        Ok((mut fresh, _)) => {
                            fresh.restarts = p.restarts + 1;
                            *p = fresh;
                        }
                        Err(e) => {
                            p.restarts += 1;
                            eprintln!("cleave up: restarting {} failed: {e:#}", p.name);
                        }
                    }
                }
            }
        }
    }
}

/// SIGTERM to every child (nodes first), then SIGKILL after a grace period.
async fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter().rev() {
        if let Some(pid) = p.child.id() {
            let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        }
    }
    for p in procs.iter_mut().rev() {
        match tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                eprintln!("cleave up: {} did not stop within 10 s; killing it", p.name);
                let _ = p.child.kill().await;
            }
        }
    }
}

/// Removes the certificate directories (CA key included) of earlier `cleave up`s that were
/// killed before they could remove their own (`SIGKILL` leaves no chance): a `cleave-up-PID`
/// whose process is gone.
fn remove_stale_cert_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("cleave-up-")).and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_pinned_node_gets_a_core_per_thread() {
        // One node of two threads on two cores: both cores, not two threads on core 0.
        assert_eq!(pin_cores(0, 2, 2), "0,1");
        // One thread each: a core each, wrapping past the last.
        assert_eq!((0..3).map(|i| pin_cores(i, 1, 2)).collect::<Vec<_>>(), ["0", "1", "0"]);
        // Two nodes of two threads on four cores; more threads than cores take them all.
        assert_eq!([pin_cores(0, 2, 4), pin_cores(1, 2, 4)], ["0,1", "2,3"]);
        assert_eq!(pin_cores(1, 8, 2), "0,1");
        assert_eq!(pin_cores(0, 0, 0), "0");
    }

    #[test]
    fn a_node_started_later_takes_the_least_used_cores() {
        // Four cores, nodes of two threads: with only the node on 2,3 live (the one on 0,1 has
        // left), a new node takes 0,1; with 0,1 live, 2,3; with 0,1 twice and 2,3 once, 2,3.
        assert_eq!(spare_cores(["2,3"].into_iter(), 2, 4), "0,1");
        assert_eq!(spare_cores(["0,1"].into_iter(), 2, 4), "2,3");
        assert_eq!(spare_cores(["0,1", "2,3", "0,1"].into_iter(), 2, 4), "2,3");
        // One thread each on two cores: the idle core, then the lower of two equally used.
        assert_eq!(spare_cores(["0"].into_iter(), 1, 2), "1");
        assert_eq!(spare_cores(["0", "1"].into_iter(), 1, 2), "0");
        // No live node; more threads than cores; a pin past the cores is ignored.
        assert_eq!(spare_cores(std::iter::empty(), 2, 2), "0,1");
        assert_eq!(spare_cores(["0"].into_iter(), 8, 2), "0,1");
        assert_eq!(spare_cores(["7", "0"].into_iter(), 1, 2), "1");
        assert_eq!(spare_cores(std::iter::empty(), 0, 0), "0");
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    fn shape(flags: &[&str]) -> Shape {
        let args = Cli::try_parse_from(std::iter::once("up").chain(flags.iter().copied())).unwrap().up;
        start_shape(&args)
    }

    #[test]
    fn the_planner_with_paced_nodes_starts_colocated_and_explicit_shapes_win() {
        let split = Shape { prefill: 1, decode: 1, colocated: 0, start_budget: None };
        assert_eq!(shape(&[]), split);
        assert_eq!(shape(&["--planner", "auto"]), split, "unpaced colocation stalls decodes");
        assert_eq!(shape(&["--planner", "advise", "--pacing"]), split, "advise acts on nothing");
        let start = Shape { prefill: 0, decode: 0, colocated: 2, start_budget: Some(128) };
        assert_eq!(shape(&["--planner", "auto", "--pacing"]), start);
        let given = shape(&["--planner", "auto", "--pacing", "--node-arg=--max-num-batched-tokens=128"]);
        assert_eq!(given, Shape { start_budget: None, ..start });
        assert_eq!(shape(&["--planner", "auto", "--pacing", "--prefill", "2"]).prefill, 2);
        assert_eq!(shape(&["--planner", "auto", "--pacing", "--colocated", "3"]).start_budget, None);
    }
}
