//! `cleave bench transfer`: KV-cache transfer throughput over QUIC, TCP+TLS and plain TCP on
//! loopback for a model's KV shape, beside raw TCP and memcpy measured in the same run. The
//! measuring code is `cleave_bench::transfer`; this module only maps arguments.

use cleave_bench::transfer::{self as bench, TransferBenchConfig};
use cleave_net::{NetKind, QuicTuning};

#[derive(clap::Args, Debug)]
pub struct BenchTransferArgs {
    /// Prompt lengths (tokens) whose KV is moved.
    #[arg(long, value_delimiter = ',', default_values_t = [512usize, 2048, 8192])]
    prompts: Vec<usize>,
    /// Layers of the model (default: Llama-3-8B).
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// KV heads per layer.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Bytes per element (bf16: 2).
    #[arg(long, default_value_t = 2)]
    dtype_bytes: usize,
    /// Timed requests per row (after one warm-up).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Parallel streams per request; one row per value.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4])]
    streams: Vec<usize>,
    /// Transports: quic, tcp-tls, tcp-plain.
    #[arg(long, value_delimiter = ',', default_values_t = ["quic".to_string(), "tcp-tls".into(), "tcp-plain".into()])]
    transports: Vec<String>,
    /// Also run QUIC with quinn's default (untuned) parameters, for comparison.
    #[arg(long)]
    quic_naive: bool,
    /// Runtime worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Skip the rows that run real handoffs (sender -> receiver into a block pool).
    #[arg(long)]
    no_handoffs: bool,
    /// Runs of the whole set of rows; each figure is the median over rounds, and "% raw" the
    /// median of each round's share of raw TCP (robust to bursts of load on a shared machine).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Run the receiving side on the sender's runtime (by default it has its own, as on its own
    /// node; sharing one makes rows bimodal).
    #[arg(long)]
    shared_runtime: bool,
}

pub fn run(args: BenchTransferArgs) -> anyhow::Result<()> {
    let kinds = args.transports.iter().map(|s| s.parse::<NetKind>()).collect::<Result<Vec<_>, _>>()?;
    let mut quic_tunings = vec![("tuned".to_string(), QuicTuning::default())];
    if args.quic_naive {
        quic_tunings.insert(0, ("quinn defaults".to_string(), QuicTuning::naive()));
    }
    let cfg = TransferBenchConfig {
        prompts: args.prompts,
        layers: args.layers,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        dtype_bytes: args.dtype_bytes,
        repeats: args.repeats,
        streams: args.streams,
        kinds,
        quic_tunings,
        threads: args.threads,
        handoffs: !args.no_handoffs,
        rounds: args.rounds,
        shared_runtime: args.shared_runtime,
    };
    eprintln!(
        "KV of {} layers x {} KV heads x head dim {} x {} B = {} KiB per token",
        cfg.layers,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.dtype_bytes,
        cfg.bytes_per_token() / 1024
    );
    let rows = bench::run(&cfg, |m| eprintln!("  {} tokens, {}: {:.2} GB/s", m.tokens, m.label, m.gb_per_s()))?;
    print!("{}", bench::render(&rows));
    Ok(())
}
