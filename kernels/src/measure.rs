//! Machine limits and kernel throughput, for benchmarks that print the limit beside the result
//! (`cleave bench engine`).
//!
//! Each measurement warms up once, then repeats until it has run for about `MIN_SECS` (at least
//! `MIN_REPS` times) and reports the best repetition. Nothing here prints.

use crate::cpu::{simd, CpuBackend};
use crate::Backend;
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Instant;

const MIN_REPS: usize = 3;
const MAX_REPS: usize = 200;
const MIN_SECS: f64 = 0.3;

/// Default array size of [`memory_bandwidth_gbps`]: larger than any L3 this runs on (the dev
/// VM reports a 300 MiB L3), so the reads come from DRAM.
pub const BANDWIDTH_BYTES: usize = 1 << 30;

/// Seconds of the fastest of several runs of `f`.
fn best_secs(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut best = f64::INFINITY;
    let mut reps = 0;
    while reps < MAX_REPS && (reps < MIN_REPS || start.elapsed().as_secs_f64() < MIN_SECS) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        reps += 1;
    }
    best
}

/// Deterministic values in [-1, 1).
fn filled(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Read bandwidth in GB/s (1e9 bytes/s) of a parallel sum over a [`BANDWIDTH_BYTES`] array with
/// `threads` threads (`None`: all cores). `NaN` if the thread pool cannot start.
pub fn memory_bandwidth_gbps(threads: Option<usize>) -> f64 {
    match CpuBackend::new(threads) {
        Ok(b) => memory_bandwidth_gbps_on(&b, BANDWIDTH_BYTES),
        Err(_) => f64::NAN,
    }
}

/// Read bandwidth in GB/s of a parallel sum over `bytes` bytes on `backend`'s pool.
pub fn memory_bandwidth_gbps_on(backend: &CpuBackend, bytes: usize) -> f64 {
    let len = (bytes / 4).max(1 << 16);
    let isa = backend.isa();
    let chunk = (len / (backend.threads() * 16)).max(1 << 14);
    // Touch every page from the pool so first-touch placement matches the readers.
    let data: Vec<f32> = backend.install(|| (0..len).into_par_iter().map(|i| (i % 7) as f32).collect());
    let secs = best_secs(|| {
        let s: f32 = backend.install(|| data.par_chunks(chunk).map(|c| simd::sum(isa, c)).sum());
        black_box(s);
    });
    (len * 4) as f64 / secs / 1e9
}

/// GFLOP/s (`2·m·k·n` per call) of [`Backend::linear`] with `x: [m, k]`, `w: [n, k]`.
pub fn gemm_peak_gflops(backend: &CpuBackend, m: usize, k: usize, n: usize) -> f64 {
    let secs = time_linear(backend, m, k, n);
    2.0 * (m * k * n) as f64 / secs / 1e9
}

/// Effective GB/s of [`Backend::linear`] counted as the bytes it must move at least once:
/// the weights, activations and output (`4·(n·k + m·k + m·n)`). For small `m` this is the
/// weight-streaming rate of decode, comparable to [`memory_bandwidth_gbps`].
pub fn matvec_gbps(backend: &CpuBackend, m: usize, k: usize, n: usize) -> f64 {
    let secs = time_linear(backend, m, k, n);
    (4 * (n * k + m * k + m * n)) as f64 / secs / 1e9
}

/// Best seconds of one `linear` call; `NaN` if the call is rejected.
fn time_linear(backend: &CpuBackend, m: usize, k: usize, n: usize) -> f64 {
    let x = filled(m * k, 1);
    let w = filled(n * k, 2);
    let mut out = vec![0f32; m * n];
    if backend.linear(&x, &w, None, m, k, n, &mut out).is_err() {
        return f64::NAN;
    }
    best_secs(|| {
        // Sizes were accepted above; the result is checked only to keep the call observable.
        let r = backend.linear(&x, &w, None, m, k, n, &mut out);
        black_box((r.is_ok(), &out));
    })
}
