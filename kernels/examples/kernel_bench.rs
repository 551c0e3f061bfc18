//! Hand-run kernel benchmark: `cargo run --release -p cleave-kernels --example kernel_bench [threads]`.
//!
//! Prints each result beside its limit: GEMM GFLOP/s, matvec GB/s against the measured read
//! bandwidth, and a simulated batch-1 decode step of a SmolLM2-135M-shaped model (f32 weights)
//! against its bytes / bandwidth floor.

use cleave_kernels::measure::{gemm_peak_gflops, matvec_gbps, memory_bandwidth_gbps_on, BANDWIDTH_BYTES};
use cleave_kernels::{Backend, CpuBackend};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let threads = std::env::args().nth(1).map(|s| s.parse()).transpose()?;
    let b = CpuBackend::new(threads)?;
    println!("backend: {b:?}");
    let bw = memory_bandwidth_gbps_on(&b, BANDWIDTH_BYTES);
    println!("read bandwidth (1 GiB, parallel sum): {bw:.1} GB/s");

    for (m, k, n) in [(1024, 1024, 1024), (16, 4096, 4096), (64, 576, 1536), (512, 576, 1536)] {
        println!("linear m={m} k={k} n={n}: {:.1} GFLOP/s", gemm_peak_gflops(&b, m, k, n));
    }
    for (m, k, n) in [(1, 4096, 4096), (1, 4096, 32768)] {
        let g = matvec_gbps(&b, m, k, n);
        let mb = (n * k * 4) >> 20;
        println!(
            "matvec m={m} k={k} n={n} ({mb} MiB of weights): {g:.1} GB/s = {:.0}% of read bandwidth",
            100.0 * g / bw
        );
    }
    let streaming = b.clone().with_skinny_max_m(usize::MAX);
    let gemm = b.clone().with_skinny_max_m(0);
    for (k, n) in [(4096, 4096), (576, 1536)] {
        println!("weight-streaming kernel vs gemm, k={k} n={n}, ms per call:");
        for m in [1, 2, 4, 8, 12, 16, 24, 32, 48] {
            let ms = |be: &CpuBackend| 2.0 * (m * k * n) as f64 / gemm_peak_gflops(be, m, k, n) / 1e6;
            println!("  m={m:2}: streaming {:.3} ms, gemm {:.3} ms", ms(&streaming), ms(&gemm));
        }
    }
    for m in [1, 4, 8, 16] {
        decode_step(&b, bw, m)?;
    }
    Ok(())
}

/// All linears of one batch-1 decode step of SmolLM2-135M (30 layers, hidden 576, MLP 1536,
/// 9 q heads / 3 kv heads of 64, vocab 49152 tied head), each layer with its own weights.
fn decode_step(b: &CpuBackend, bw: f64, m: usize) -> anyhow::Result<()> {
    let (hidden, inter, kv, vocab, layers) = (576, 1536, 192, 49152, 30);
    let shapes = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ];
    let mut weights = Vec::new();
    for l in 0..layers {
        for (i, &(n, k)) in shapes.iter().enumerate() {
            weights.push((n, k, vec![((l * 7 + i) % 13) as f32 * 1e-3; n * k]));
        }
    }
    weights.push((vocab, hidden, vec![1e-3; vocab * hidden]));
    let bytes: usize = weights.iter().map(|w| w.2.len() * 4).sum();
    let x = vec![0.5f32; m * inter];
    let mut out = vec![0f32; m * vocab];
    let mut step = || -> anyhow::Result<f64> {
        let t = Instant::now();
        for (n, k, w) in &weights {
            b.linear(&x, w, None, m, *k, *n, &mut out)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    step()?;
    let best = (0..5).map(|_| step()).collect::<anyhow::Result<Vec<f64>>>()?.into_iter().fold(f64::INFINITY, f64::min);
    let floor = bytes as f64 / (bw * 1e9);
    println!(
        "decode step linears, batch {m} (SmolLM2-135M shape, {} MiB f32): {:.2} ms; bandwidth floor {:.2} ms; ratio {:.2}x",
        bytes >> 20,
        best * 1e3,
        floor * 1e3,
        best / floor
    );
    Ok(())
}
