//! The serving processes: `cleave coordinator`, `cleave prefill`, `cleave decode` and
//! `cleave node --role ...`. Each prints one `READY ...` line on stdout once it serves (what
//! `cleave up` waits for) and stops cleanly on SIGTERM, Ctrl-C, or (with `--exit-with-parent`)
//! when its stdin closes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use cleave_coordinator::cluster::registry::RoutingConfig;
use cleave_coordinator::cluster::{Cluster, ClusterConfig};
use cleave_coordinator::edge::EdgeListener;
use cleave_coordinator::{dispatch_channel, AppState, CoordinatorArgs, ModelInfo};
use cleave_engine::model::ModelFiles;
use cleave_engine::{EngineCore, EngineThread};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Listener, NetConfig, NetKind};
use cleave_node::{Exit, Node, NodeConfig};
use cleave_protocol::control::NodeRole;

use super::EngineArgs;

/// How a process reaches the rest of the cluster.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterNetArgs {
    /// Directory with the cluster CA (ca.crt) and this process's certificate and key
    /// (<name>.crt, <name>.key); see `cleave certs`.
    #[arg(long, env = "CLEAVE_CERTS")]
    pub certs: Option<PathBuf>,
    /// This process's name: its certificate's name, and how it appears in logs and metrics.
    #[arg(long)]
    pub name: Option<String>,
    /// Internal transport: quic (mutual TLS 1.3), tcp-tls, or tcp-plain (no encryption or
    /// authentication: only on a network you trust).
    #[arg(long, value_enum, default_value_t = TransportArg::Quic)]
    pub transport: TransportArg,
    /// Exit when stdin closes (set by `cleave up` so that children never outlive it).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportArg {
    Quic,
    TcpTls,
    TcpPlain,
}

impl ClusterNetArgs {
    fn net_config(&self, default_name: &str) -> anyhow::Result<(NetConfig, String)> {
        let name = self.name.clone().unwrap_or_else(|| default_name.to_string());
        let kind = match self.transport {
            TransportArg::Quic => NetKind::Quic,
            TransportArg::TcpTls => NetKind::TcpTls,
            TransportArg::TcpPlain => NetKind::TcpPlain,
        };
        let identity = match (&self.certs, kind) {
            (None, NetKind::TcpPlain) => None,
            (None, _) => anyhow::bail!(
                "--certs DIR is required with --transport {} (make one with `cleave certs --dir DIR --nodes {name}`)",
                kind.name()
            ),
            (Some(dir), _) => Some(
                NodeIdentity::load(dir, &name)
                    .with_context(|| format!("loading the certificate of `{name}` from {}", dir.display()))?,
            ),
        };
        Ok((NetConfig::new(kind, identity), name))
    }
}

/// `cleave coordinator`.
#[derive(clap::Args, Debug)]
pub struct CoordinatorCmd {
    #[command(flatten)]
    pub http: CoordinatorArgs,
    /// Revoked node certificates: one SHA-256 fingerprint (hex, of the certificate's DER; e.g.
    /// `openssl x509 -in n.crt -outform der | sha256sum`) per line, `#` comments. Read at each
    /// registration, so revoking takes no restart; a node already registered is not dropped.
    #[arg(long)]
    pub revoked_certs: Option<PathBuf>,
    /// Where nodes register (QUIC or TCP per --transport).
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub cluster_listen: SocketAddr,
    #[command(flatten)]
    pub net: ClusterNetArgs,
    /// Prefill on the decode node when at most this many prompt tokens are not in its prefix
    /// cache (conditional disaggregation).
    #[arg(long, default_value_t = 32)]
    pub local_prefill_max_tokens: usize,
    /// The prefill pool is saturated (requests prefill on decode nodes) when every prefill node
    /// has more than this many prompt tokens queued.
    #[arg(long, default_value_t = 65_536)]
    pub prefill_saturation_tokens: u64,
    /// Seconds without a load report after which a node is dead.
    #[arg(long, default_value_t = 3.0)]
    pub dead_after_secs: f64,
    /// Times a stream may move to another decode node when its node fails.
    #[arg(long, default_value_t = 2)]
    pub max_migrations: u32,
    /// Skip reading the model's identity (config, vocabulary and norm weights; no linear weight
    /// is loaded): nodes are then checked against the first node that registers.
    #[arg(long)]
    pub no_fingerprint: bool,
    /// Token the admin API (`/admin/...`) requires as `Authorization: Bearer`; distinct from
    /// the API key. Without it the admin API is closed (every admin route answers 401).
    /// 8-256 printable ASCII characters without spaces, `;` or `,`.
    #[arg(long, env = "CLEAVE_ADMIN_TOKEN", value_parser = cleave_coordinator::cluster::validate_admin_token)]
    pub admin_token: Option<String>,
    /// Serve the admin API on this address instead of the API's listener.
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
    /// Ask for new nodes with `LAUNCH role=...` lines on stdout (set by `cleave up --max-nodes`,
    /// which reads them and starts the processes).
    #[arg(long, hide = true)]
    pub launch_nodes_via_stdout: bool,
    /// How the planner adds and removes nodes on Kubernetes (feature `kubernetes`).
    #[cfg(feature = "kubernetes")]
    #[command(flatten)]
    pub k8s: cleave_coordinator::cluster::k8s::K8sArgs,
    #[command(flatten)]
    pub planner: PlannerArgs,
}

/// The SLO planner's settings at start (`PUT /admin/planner` changes them live).
#[derive(clap::Args, Debug, Clone)]
pub struct PlannerArgs {
    /// off: no planning; advise: decisions logged and shown, nothing acted on; auto: the
    /// planner switches node roles (and step budgets) to keep the targets.
    #[arg(long, value_enum, default_value_t = PlannerModeArg::Advise)]
    pub planner: PlannerModeArg,
    /// Time-to-first-token target (ms, at the planner's quantile, p90 by default).
    #[arg(long, default_value_t = 3000.0)]
    pub ttft_target_ms: f64,
    /// Time-per-output-token target (ms).
    #[arg(long, default_value_t = 100.0)]
    pub tpot_target_ms: f64,
    /// The time per output token (ms) colocated nodes are held to when tighter than
    /// `--tpot-target-ms`: their pacing target and their SLO admission seats (fewer, faster
    /// streams beside the prompts they prefill). Default: the TPOT target. Which is best
    /// depends on the machine and the load: measure (BENCHMARKS.md, "Holding colocated nodes
    /// below the TPOT target").
    #[arg(long)]
    pub colocated_tpot_target_ms: Option<f64>,
    /// Most nodes the planner may use in all (default: the live nodes).
    #[arg(long)]
    pub max_nodes: Option<u32>,
    /// Seconds between the planner's changes (its cooldown).
    #[arg(long, default_value_t = 15.0)]
    pub planner_cooldown_secs: f64,
    /// Seconds of arrivals and latencies the planner looks at.
    #[arg(long, default_value_t = 20.0)]
    pub planner_window_secs: f64,
    /// The engine's cost profile (`cleave bench profile --output FILE`, measured on the nodes'
    /// machine) the planner predicts with; the nodes' own step timings re-level it as they
    /// run. Without it the planner starts from a generic linear model levelled by those
    /// timings alone.
    #[arg(long)]
    pub planner_profile: Option<std::path::PathBuf>,
    /// Nodes pace prompt chunks beside running decodes to the TPOT target (the coordinator
    /// sends it to every node; `cleave_engine::sched::pacing`). Off by default: pacing protects
    /// TPOT at the expense of TTFT and does not yet know the TTFT target, so it costs a load
    /// whose TTFT binds (BENCHMARKS.md, "Pacing").
    #[arg(long)]
    pub pacing: bool,
    /// SLO admission: each node takes at most as many streams as keep its time per output
    /// token within the TPOT target (measured from its steps, once it runs over it); requests
    /// wait at the edge for a seat, and one that waited half the TTFT target is refused with
    /// 503 and Retry-After instead of being served late, as is at once a prompt that would
    /// queue past the TTFT target behind its prefill node's queued prompt work. Under a load past the cluster's
    /// capacity it serves what it can within the targets instead of missing them for everyone.
    #[arg(long)]
    pub slo_admission: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlannerModeArg {
    Off,
    Advise,
    Auto,
}

impl PlannerArgs {
    pub fn to_config(&self) -> anyhow::Result<cleave_planner::PlannerConfig> {
        let mode = match self.planner {
            PlannerModeArg::Off => cleave_planner::Mode::Off,
            PlannerModeArg::Advise => cleave_planner::Mode::Advise,
            PlannerModeArg::Auto => cleave_planner::Mode::Auto,
        };
        let mut c = cleave_planner::PlannerConfig { mode, ..Default::default() };
        c.targets.ttft_ms = self.ttft_target_ms;
        c.targets.tpot_ms = self.tpot_target_ms;
        c.targets.colocated_tpot_ms = self.colocated_tpot_target_ms;
        if let Some(n) = self.max_nodes {
            c.limits.max_nodes = n;
        }
        anyhow::ensure!(
            self.planner_cooldown_secs.is_finite() && self.planner_cooldown_secs >= 0.0,
            "--planner-cooldown-secs must be a number of seconds >= 0"
        );
        anyhow::ensure!(
            self.planner_window_secs.is_finite() && self.planner_window_secs > 0.0,
            "--planner-window-secs must be a number of seconds > 0"
        );
        c.cooldown = Duration::from_secs_f64(self.planner_cooldown_secs);
        c.window = Duration::from_secs_f64(self.planner_window_secs);
        c.validate().map_err(|e| anyhow::anyhow!("planner settings: {e}"))?;
        Ok(c)
    }

    /// The `--planner-profile` file, read and checked.
    pub fn profile(&self) -> anyhow::Result<Option<cleave_planner::Profile>> {
        let Some(path) = &self.planner_profile else { return Ok(None) };
        let p =
            cleave_bench::sim::profile::load(path).with_context(|| format!("--planner-profile {}", path.display()))?;
        Ok(Some(p))
    }
}

/// `cleave prefill`, `cleave decode`, `cleave node`.
#[derive(clap::Args, Debug)]
pub struct NodeCmd {
    /// Model folder (Hugging Face layout), .gguf file or hub id (owner/name[@revision]).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: PathBuf,
    /// The coordinator's cluster address (its --cluster-listen).
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub coordinator: SocketAddr,
    /// Where the coordinator's request streams arrive.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub rpc_listen: SocketAddr,
    /// Where prefill nodes push KV (decode and colocated nodes).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub kv_listen: SocketAddr,
    /// The address the coordinator is told to reach --rpc-listen at, when peers see this node
    /// at another address (NAT, a proxy, a Service). Default: the bound address, with an
    /// unspecified IP (0.0.0.0) replaced by this host's address on the route to the coordinator.
    #[arg(long)]
    pub rpc_advertise: Option<SocketAddr>,
    /// The address put in KV tickets for --kv-listen, likewise.
    #[arg(long)]
    pub kv_advertise: Option<SocketAddr>,
    /// Name of the served model (must match the coordinator's).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Where this node serves its Prometheus metrics (`GET /metrics`).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub metrics_listen: SocketAddr,
    /// Size prompt chunks by the step budget alone, even when the coordinator sends a TPOT
    /// target to pace to (`cleave coordinator --pacing`). A node sent a target that prefills
    /// beside running decodes (colocated, or a decode node prefilling a short prompt) cuts the
    /// chunk so that no running sequence's time per output token goes over it, down to 4
    /// tokens a step.
    #[arg(long)]
    pub no_pacing: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub net: ClusterNetArgs,
    /// Move KV by one-sided RDMA writes through this device (`ibv_devices` lists them): a
    /// prefill node sends that way, a decode node receives into a landing pool registered at
    /// start. Control streams stay on QUIC. Builds with the `rdma` feature only.
    #[cfg(feature = "rdma")]
    #[arg(long)]
    pub rdma_device: Option<String>,
    /// Blocks of a decode node's RDMA landing pool (default: a quarter of the engine's blocks).
    #[cfg(feature = "rdma")]
    #[arg(long, requires = "rdma_device", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub rdma_landing_blocks: Option<usize>,
    /// Port of the RDMA device the queue pairs use (ports count from 1; `ibv_devinfo` lists
    /// them).
    #[cfg(feature = "rdma")]
    #[arg(long, env = "CLEAVE_RDMA_PORT", default_value_t = 1, requires = "rdma_device",
          value_parser = clap::value_parser!(u8).range(1..))]
    pub rdma_port: u8,
    /// GID table index of the port's address for RoCE (`show_gids` or `ibv_devinfo -v` list the
    /// table; every node of a cluster needs a GID of the same kind, RoCE v2 to cross subnets).
    /// Default: on an Ethernet (RoCE) port its first RoCE v2 GID, IPv4-mapped ones first; on
    /// InfiniBand none (queue pairs address each other by LID, and by GID when the peer sent one).
    #[cfg(feature = "rdma")]
    #[arg(long, env = "CLEAVE_RDMA_GID_INDEX", requires = "rdma_device")]
    pub rdma_gid_index: Option<u8>,
}

/// `cleave node --role`.
#[derive(clap::Args, Debug)]
pub struct NodeRoleCmd {
    /// prefill, decode, or both (a colocated node that prefills and decodes its requests).
    #[arg(long, value_enum)]
    pub role: RoleArg,
    #[command(flatten)]
    pub node: NodeCmd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleArg {
    Prefill,
    Decode,
    Both,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    // Two workers at least: the decode node's KV sink blocks a worker for one engine step
    // (`block_in_place`) while it reserves blocks.
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// Resolves on SIGTERM, Ctrl-C, or stdin closing when `with_parent`.
async fn shutdown_signal(with_parent: bool) {
    let parent = async move {
        if !with_parent {
            return std::future::pending::<()>().await;
        }
        // A blocking read on a thread: the parent holds the pipe's other end until it exits.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            use std::io::Read;
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
            let _ = tx.send(());
        });
        let _ = rx.await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
        () = parent => {}
    }
}

fn model_name(path: &Path, given: Option<&String>) -> String {
    given
        .cloned()
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into()))
}

pub fn run_coordinator(cmd: CoordinatorCmd) -> anyhow::Result<()> {
    let path = cmd.http.model.clone().context("--model is required")?;
    let model = if path.is_file() {
        // A GGUF file: the engine's reader gives the tokenizer and the config facts.
        let files = ModelFiles::open(&path).with_context(|| format!("opening model {}", path.display()))?;
        let mut eos = files.config.eos_token_ids.clone();
        eos.extend(files.tokenizer.eos_token_id());
        eos.dedup();
        ModelInfo {
            name: model_name(&path, cmd.http.served_model_name.as_ref()),
            context_len: cmd.http.max_model_len.unwrap_or(files.config.max_position_embeddings as u32).max(1),
            compiler: ModelInfo::compiler_for(&files.tokenizer, files.config.vocab_size, &eos),
            eos_token_ids: eos,
            tokenizer: files.tokenizer,
            defaults: Default::default(),
        }
    } else {
        ModelInfo::from_args(&cmd.http).context("loading the model's tokenizer and config")?
    };
    let fingerprint = if cmd.no_fingerprint { None } else { Some(fingerprint_of(&path)?) };
    let (net, _name) = cmd.net.net_config("coordinator")?;
    let planner = cmd.planner.to_config()?;
    let planner_profile = cmd.planner.profile()?;
    let rt = runtime()?;
    rt.block_on(async move {
        let http = tokio::net::TcpListener::bind(cmd.http.listen)
            .await
            .with_context(|| format!("binding the HTTP API on {}", cmd.http.listen))?;
        let control = Listener::bind(&net, cmd.cluster_listen)
            .await
            .with_context(|| format!("binding the cluster address {}", cmd.cluster_listen))?;
        let (dispatch, dispatches) = dispatch_channel(cmd.http.max_queued_requests);
        let mut cfg = ClusterConfig::new(net);
        cfg.routing = RoutingConfig {
            local_prefill_max_tokens: cmd.local_prefill_max_tokens,
            prefill_saturation_tokens: cmd.prefill_saturation_tokens,
            dead_after: Duration::from_secs_f64(cmd.dead_after_secs.clamp(0.1, 3600.0)),
        };
        cfg.max_migrations = cmd.max_migrations;
        cfg.revoked_certs = cmd.revoked_certs.clone();
        cfg.planner = planner;
        cfg.planner_profile = planner_profile;
        cfg.pacing = cmd.planner.pacing;
        cfg.admission = cmd.planner.slo_admission;
        let admin = match cmd.admin_listen {
            Some(a) => {
                let l =
                    tokio::net::TcpListener::bind(a).await.with_context(|| format!("binding the admin API on {a}"))?;
                Some(EdgeListener::from_args(l, &cmd.http)?)
            }
            None => None,
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr_or_unspecified());
        let launch = cmd.launch_nodes_via_stdout;
        #[cfg(feature = "kubernetes")]
        let k8s = cleave_coordinator::cluster::k8s::client_from_args(&cmd.k8s)
            .await
            .context("connecting to the Kubernetes API")?;
        let cluster = Cluster::start_with(cfg, fingerprint, control, dispatches, move |h| {
            #[cfg(feature = "kubernetes")]
            if let Some(k) = k8s {
                return Box::new(k.into_actuator(h));
            }
            if launch {
                Box::new(cleave_coordinator::cluster::LocalProcesses::new(h))
            } else {
                Box::new(cleave_coordinator::cluster::RoleSwitch::new(h))
            }
        })?;
        let state = AppState::new(&cmd.http, model, dispatch)?.with_readiness(cluster.readiness());
        let http_addr = http.local_addr()?;
        let http = EdgeListener::from_args(http, &cmd.http)?;
        tracing::info!(addr = %http_addr, tls = http.is_tls(), "HTTP edge listening");
        let admin_addr = admin_addr.map_or(String::new(), |a| format!(" admin={a}"));
        println!("READY coordinator http={http_addr} cluster={}{admin_addr}", cluster.control_addr());
        cleave_coordinator::cluster::serve_with_cluster(
            http,
            admin,
            state,
            &cluster,
            cmd.admin_token.clone(),
            shutdown_signal(cmd.net.exit_with_parent),
        )
        .await?;
        drop(cluster);
        Ok(())
    })
}

/// The model's identity, as every node's KV layout carries it, in whatever format a node holds
/// the weights: read from the config, the tokenizer and the norm vectors, without loading a
/// linear weight (the coordinator's memory stays the tokenizer's).
fn fingerprint_of(path: &Path) -> anyhow::Result<u64> {
    let files = ModelFiles::open(path).with_context(|| format!("opening model {}", path.display()))?;
    files.identity().with_context(|| format!("reading the identity of model {}", path.display()))
}

/// Hands the heap pages freed while loading back to the kernel. glibc keeps what a thread frees
/// in that thread's arena, and the load's temporaries (the GGUF metadata's strings, the
/// tokenizer's build tables, q/k rows before they are un-permuted) leave whole pages free in the
/// middle of it: on SmolLM2-135M 22 MB of a node's resident memory until `malloc_trim` returns
/// them.
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own free lists; it is safe at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// How often a serving node hands its freed heap pages back ([`trim_heap_now_and_then`]).
const HEAP_TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// [`release_freed_heap`] every [`HEAP_TRIM_EVERY`], for the life of the node. Handoffs and
/// batches free buffers of hundreds of KB to MBs, which glibc keeps in its arenas once its
/// dynamic mmap threshold has risen past them. In the 5-minute soak every node's RSS less KV
/// came out 5.5-7.5 MiB lower with it; a SmolLM2 node after a first request 133 -> 129 MiB. It
/// runs on the blocking pool, off the runtime's threads (its cost was not measured).
async fn trim_heap_now_and_then() {
    let mut every = tokio::time::interval(HEAP_TRIM_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let _ = tokio::task::spawn_blocking(release_freed_heap).await;
    }
}

pub fn run_node(role: RoleArg, cmd: NodeCmd) -> anyhow::Result<()> {
    let default_name = match role {
        RoleArg::Prefill => "prefill",
        RoleArg::Decode => "decode",
        RoleArg::Both => "node",
    };
    let (net, name) = cmd.net.net_config(default_name)?;
    let mut files = ModelFiles::open(&cmd.model).with_context(|| format!("opening model {}", cmd.model.display()))?;
    // A node gets token ids and only turns them into text: it keeps what decoding reads
    // (SmolLM2's tokenizer is 9.0 MiB of heap whole, 0.6 MiB so). The whole one is dropped
    // here, before the weights load, and `release_freed_heap` after the load hands its pages
    // back.
    files.tokenizer = files.tokenizer.for_decoding().context("slimming the tokenizer for decoding")?;
    let cfg = cmd.engine.to_config();
    /// Starts the engine thread on the backend `--device` picks (the node above it is the same
    /// for every backend: it talks to the thread through its handle).
    struct Spawn(ModelFiles, cleave_engine::EngineConfig);
    impl super::OnBackend for Spawn {
        type Out = EngineThread;
        fn run<B: cleave_kernels::Backend>(self, make: &dyn Fn() -> anyhow::Result<B>) -> anyhow::Result<EngineThread> {
            let (files, cfg) = (self.0, self.1);
            let backend = make()?;
            Ok(EngineThread::spawn(move || EngineCore::load(backend, files, &cfg).inspect(|_| release_freed_heap()))?)
        }
    }
    let engine = super::on_backend(&cmd.engine, Spawn(files, cfg)).context("starting the engine")?;
    let model_name = model_name(&cmd.model, cmd.served_model_name.as_ref());
    let rt = runtime()?;
    let handle = engine.handle();
    let res = rt.block_on(async move {
        let shutdown = shutdown_signal(cmd.net.exit_with_parent);
        let metrics_addr = serve_metrics(cmd.metrics_listen).await?;
        tokio::spawn(trim_heap_now_and_then());
        let node_role = match role {
            RoleArg::Prefill => NodeRole::Prefill,
            RoleArg::Decode => NodeRole::Decode,
            RoleArg::Both => NodeRole::Both,
        };
        let mut cfg = NodeConfig::new(&name, node_role, cmd.coordinator, net);
        cfg.model_name = model_name;
        cfg.rpc_bind = cmd.rpc_listen;
        cfg.kv_bind = cmd.kv_listen;
        cfg.rpc_advertise = cmd.rpc_advertise;
        cfg.kv_advertise = cmd.kv_advertise;
        cfg.step_budget = u32::try_from(cmd.engine.max_num_batched_tokens).ok();
        cfg.metrics_addr = Some(metrics_addr);
        cfg.identity_dir = cmd.net.certs.clone();
        cfg.pacing = !cmd.no_pacing;
        #[cfg(feature = "rdma")]
        if let Some(name) = &cmd.rdma_device {
            let dev = super::rdma::Device { name, port: cmd.rdma_port, gid_index: cmd.rdma_gid_index };
            let t = super::rdma::sender(&dev, &cfg.net, handle.info(), cmd.engine.max_num_batched_tokens)?;
            cfg.extra_transports.push(t);
            cfg.rdma = Some(super::rdma::landing(&dev, &cfg.net, handle.info(), cmd.rdma_landing_blocks)?);
        }
        let mut node = Node::start(handle, cfg, shutdown).await?;
        let id = registered(node.registered.take()).await?;
        println!(
            "READY {} name={name} id={id} rpc={} kv={} metrics={metrics_addr}",
            role_str(role),
            node.rpc_addr,
            node.kv_addr
        );
        match node.wait().await? {
            Exit::Shutdown => {}
            Exit::Left(reason) => eprintln!("{name}: left the cluster ({reason})"),
        }
        anyhow::Ok(())
    });
    engine.shutdown()?;
    res
}

/// Serves this process's Prometheus metrics (the same recorder and buckets as the coordinator's).
async fn serve_metrics(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    let handle = cleave_coordinator::metrics::prometheus_handle().context("installing the metrics recorder")?;
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the metrics address {addr}"))?;
    let local = listener.local_addr()?;
    let app = axum::Router::new().route("/metrics", axum::routing::get(move || std::future::ready(handle.render())));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "metrics server stopped");
        }
    });
    Ok(local)
}

fn role_str(role: RoleArg) -> &'static str {
    match role {
        RoleArg::Prefill => "prefill",
        RoleArg::Decode => "decode",
        RoleArg::Both => "both",
    }
}

/// Waits for the first registration; a refusal (another model) or repeated failure is fatal.
async fn registered(
    rx: Option<tokio::sync::oneshot::Receiver<Result<u64, cleave_node::NodeError>>>,
) -> anyhow::Result<u64> {
    let rx = rx.context("registration already awaited")?;
    match tokio::time::timeout(Duration::from_secs(60), rx).await {
        Err(_) => anyhow::bail!("the coordinator did not accept this node within 60 s"),
        Ok(Err(_)) => anyhow::bail!("the node stopped before registering"),
        Ok(Ok(Err(e))) => Err(anyhow::anyhow!(e).context("registering with the coordinator")),
        Ok(Ok(Ok(id))) => Ok(id),
    }
}
