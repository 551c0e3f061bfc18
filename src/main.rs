//! The `cleave` binary: clap subcommands only; each one's logic lives in its own module.

mod cli;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    tune_malloc();
    let args = cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("CLEAVE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    cli::run(args)
}

/// Keeps freed memory in the process instead of handing it back to the kernel at once.
///
/// glibc's defaults return the top of the heap past 128 KiB free and serve every allocation over
/// 128 KiB-32 MiB (the threshold adapts) with its own mmap, so a loop that allocates and frees a
/// buffer per message pays a page fault and a page clear per 4 KiB every time. quinn allocates a
/// 64 KiB buffer per received datagram; KV chunks and activations are MiBs. Measured with
/// `cleave bench transfer --prompts 2048 --streams 1` (interleaved runs, same build): QUIC 49-54%
/// of raw TCP with glibc's defaults against 56-63% with these settings, a QUIC handoff 33-35%
/// against 45-46%, a plain-TCP handoff 65-72% against 82-89%, with less spread. The cost is
/// resident memory that is not returned after a peak (up to the trim threshold per arena).
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called first thing in main, before
    // other threads exist.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
