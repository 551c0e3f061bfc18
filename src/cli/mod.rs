//! Command-line interface: argument structs (their doc comments are the `--help` text) and the
//! dispatch to each subcommand's module.

mod admin;
mod bench_engine;
mod bench_profile;
mod bench_serve;
mod bench_simulate;
mod bench_sweep;
mod bench_transfer;
mod certs;
mod generate;
mod make_model;
mod model_source;
mod quantize;
#[cfg(feature = "rdma")]
mod rdma;
mod serve;
mod up;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "cleave",
    version,
    about = "Disaggregated LLM serving: prefill and decode pools exchanging paged KV cache"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a completion for one prompt, printing only the completion text to stdout.
    Generate(generate::GenerateArgs),
    /// Write a random-weight model in Hugging Face format (config, safetensors, tokenizer.json).
    MakeModel(make_model::MakeModelArgs),
    /// Write a Hugging Face folder's or a GGUF file's model in a block format (Q8_0, Q4_K, ...),
    /// as a GGUF that llama.cpp loads too: each pool's format from one checkpoint.
    Quantize(quantize::QuantizeArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Generate a cluster CA and node certificates (mutual TLS between nodes) into a directory.
    Certs(certs::CertsArgs),
    /// Start the whole system on this machine: a coordinator and prefill/decode (or colocated)
    /// nodes as child processes, serving the OpenAI API.
    Up(up::UpArgs),
    /// Run the coordinator: the OpenAI-compatible HTTP API, node registry and request router.
    Coordinator(serve::CoordinatorCmd),
    /// Run a prefill node.
    Prefill(serve::NodeCmd),
    /// Run a decode node.
    Decode(serve::NodeCmd),
    /// Run a node with an explicit role (prefill, decode, or both = colocated).
    Node(serve::NodeRoleCmd),
    /// Operate a running cluster through the coordinator's admin API (needs --admin-token).
    Admin(admin::AdminArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Prefill and decode throughput of the engine, printed beside this machine's limits.
    Engine(bench_engine::BenchEngineArgs),
    /// KV-cache transfer throughput over QUIC, TCP+TLS and plain TCP, beside raw TCP and memcpy.
    Transfer(bench_transfer::BenchTransferArgs),
    /// Load-test an OpenAI-compatible streaming server (cleave, vLLM, SGLang, llama.cpp):
    /// TTFT, TPOT, ITL, E2EL, throughput and goodput under SLOs.
    Serve(cleave_bench::serve::ServeArgs),
    /// Run `bench serve` over request rates for several `cleave up` configurations and compare
    /// their goodput.
    Sweep(cleave_bench::sweep::SweepArgs),
    /// Simulate a cleave cluster (xPyD or colocated) from a measured profile: predicted
    /// TTFT/TPOT, goodput, and the configuration with the most goodput per node; with
    /// `--planner auto`, the coordinator's planner resizing the pools over a trace whose mix and
    /// rate change, against the best static configuration.
    Simulate(cleave_bench::sim::SimulateArgs),
    /// Judge phased `bench serve --phases` runs (one per configuration, same requests) under one
    /// SLO: attainment over time (table and plot), per phase, recovery after each shift, goodput.
    Timeline(cleave_bench::compare::TimelineArgs),
    /// Measure this machine's engine cost profile (prefill time against tokens, decode step time
    /// against batch and context) for `bench simulate`.
    Profile(bench_profile::BenchProfileArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::MakeModel(args) => make_model::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine::run(args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_transfer::run(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run(args),
        Command::Bench(BenchCommand::Sweep(args)) => bench_sweep::run(args),
        Command::Bench(BenchCommand::Simulate(args)) => bench_simulate::run(args),
        Command::Bench(BenchCommand::Profile(args)) => bench_profile::run(args),
        Command::Bench(BenchCommand::Timeline(args)) => {
            cleave_bench::compare::run(&args)?;
            Ok(())
        }
        Command::Certs(args) => certs::run(args),
        Command::Admin(args) => admin::run(args),
        // A hub id is fetched once here; the children find it in the cache and keep its name.
        Command::Up(args) => {
            if let Some(model) = &args.model {
                model_source::resolve_model(model)?;
            }
            up::run(args)
        }
        Command::Coordinator(mut args) => {
            if let Some(model) = args.http.model.as_mut() {
                model_source::resolve_named(model, &mut args.http.served_model_name)?;
            }
            serve::run_coordinator(args)
        }
        Command::Prefill(mut args) => {
            model_source::resolve_named(&mut args.model, &mut args.served_model_name)?;
            serve::run_node(serve::RoleArg::Prefill, args)
        }
        Command::Decode(mut args) => {
            model_source::resolve_named(&mut args.model, &mut args.served_model_name)?;
            serve::run_node(serve::RoleArg::Decode, args)
        }
        Command::Node(mut args) => {
            model_source::resolve_named(&mut args.node.model, &mut args.node.served_model_name)?;
            serve::run_node(args.role, args.node)
        }
    }
}

/// Engine settings shared by every subcommand that runs a model.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Bytes of KV cache to allocate (suffixes k, m, g accepted: 512m, 2g).
    #[arg(long, env = "CLEAVE_KV_CACHE_MEMORY", default_value = "1g", value_parser = parse_bytes)]
    pub kv_cache_memory: usize,
    /// What the KV cache stores: f32, or f16/bf16 (half the memory per token, so twice the
    /// tokens in --kv-cache-memory, and half the bytes on every prefill-to-decode handoff).
    /// Every node of a cluster must use the same.
    #[arg(long, env = "CLEAVE_KV_CACHE_DTYPE", value_enum, default_value_t = KvDtypeArg::F32)]
    pub kv_cache_dtype: KvDtypeArg,
    /// Dequantize a GGUF's quantized weights (Q4_1, Q8_0, Q4_K, ...) to f32 at load, as cleave
    /// did before it multiplied them in their format: 4-8x the memory and bytes read per decode
    /// step, and no 8-bit rounding of activations (for comparison). bf16 and f16 weights (a
    /// Hugging Face checkpoint's, or an F16 GGUF's) are widened to f32 likewise: twice the
    /// memory and bytes, the same results (without it they are widened in registers).
    #[arg(long, env = "CLEAVE_DEQUANTIZE_WEIGHTS")]
    pub dequantize_weights: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub block_size: u32,
    /// Most tokens fed per engine step (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output); default: the model's max_position_embeddings.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Turn off automatic prefix caching.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Compute threads (default: all cores).
    #[arg(long, env = "CLEAVE_THREADS")]
    pub threads: Option<usize>,
    /// Where the engine runs: `cpu`, or `cuda` / `cuda:N` for GPU N (a binary built with
    /// `--features cuda`; the CUDA driver, NVRTC and cuBLAS are loaded at start).
    #[arg(long, env = "CLEAVE_DEVICE", default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// What a GPU holds linear weights as: bf16 (tensor-core GEMM, f32 accumulation; f16
    /// checkpoints stay f16) or f32 (exact f32 products, no TF32).
    #[arg(long, env = "CLEAVE_GPU_WEIGHTS", value_enum, default_value_t = GpuWeightsArg::Bf16)]
    pub gpu_weights: GpuWeightsArg,
}

/// The device an engine runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

pub fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(format!("`{s}` is not a device: use cpu, cuda or cuda:N")),
        },
    }
}

/// What a GPU holds linear weights as (`--gpu-weights`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuWeightsArg {
    Bf16,
    F32,
}

#[cfg(feature = "cuda")]
impl GpuWeightsArg {
    pub fn gemm(self) -> cleave_kernels::cuda::GemmDtype {
        match self {
            GpuWeightsArg::Bf16 => cleave_kernels::cuda::GemmDtype::Bf16,
            GpuWeightsArg::F32 => cleave_kernels::cuda::GemmDtype::F32,
        }
    }
}

/// Work that runs on whichever backend `--device` picks: `run` gets a maker of backends (a
/// second engine, such as `generate`'s prefill engine, takes a second backend).
pub trait OnBackend {
    type Out;
    fn run<B: cleave_kernels::Backend>(self, make: &dyn Fn() -> anyhow::Result<B>) -> anyhow::Result<Self::Out>;
}

/// Runs `w` on the backend the engine flags pick.
pub fn on_backend<W: OnBackend>(e: &EngineArgs, w: W) -> anyhow::Result<W::Out> {
    match e.device {
        Device::Cpu => {
            let threads = e.threads;
            w.run(&move || Ok(cleave_kernels::CpuBackend::new(threads)?))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            use cleave_kernels::cuda::CudaBackend;
            let gemm = e.gpu_weights.gemm();
            w.run(&move || {
                let b = CudaBackend::new(n, gemm).map_err(|e| anyhow::anyhow!("--device cuda:{n}: {e}"))?;
                eprintln!("engine on {} ({gemm:?} weights)", b.device_name());
                Ok(b)
            })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(n) => {
            let _ = w;
            anyhow::bail!("--device cuda:{n}: this binary was built without the `cuda` feature (cargo build --release --features cuda)")
        }
    }
}

impl EngineArgs {
    pub fn to_config(&self) -> cleave_engine::EngineConfig {
        cleave_engine::EngineConfig {
            block_size: self.block_size as usize,
            kv_cache_memory: self.kv_cache_memory,
            kv_dtype: self.kv_cache_dtype.into(),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_prefix_caching,
            seed: 0,
            dequantize_weights: self.dequantize_weights,
            tpot_target: None,
        }
    }
}

/// The element type of the KV cache, as flags spell it.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtypeArg {
    F32,
    F16,
    Bf16,
}

impl From<KvDtypeArg> for cleave_protocol::KvDtype {
    fn from(d: KvDtypeArg) -> Self {
        match d {
            KvDtypeArg::F32 => cleave_protocol::KvDtype::F32,
            KvDtypeArg::F16 => cleave_protocol::KvDtype::F16,
            KvDtypeArg::Bf16 => cleave_protocol::KvDtype::Bf16,
        }
    }
}

impl std::fmt::Display for KvDtypeArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use clap::ValueEnum;
        f.write_str(self.to_possible_value().expect("no skipped variants").get_name())
    }
}

/// Parses `1024`, `64k`, `512m`, `2g` (binary units).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mult) = match s.trim_end_matches('b').chars().last() {
        Some('k') => (&s[..s.trim_end_matches('b').len() - 1], 1usize << 10),
        Some('m') => (&s[..s.trim_end_matches('b').len() - 1], 1 << 20),
        Some('g') => (&s[..s.trim_end_matches('b').len() - 1], 1 << 30),
        _ => (s.trim_end_matches('b'), 1),
    };
    let n: f64 = num.trim().parse().map_err(|_| format!("`{s}` is not a size like 512m or 2g"))?;
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("`{s}` must be a positive size"));
    }
    Ok((n * mult as f64) as usize)
}
