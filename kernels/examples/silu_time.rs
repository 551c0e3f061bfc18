//! Hand-run: the MLP's `silu(gate) · up` of a 256-token f32 prefill of SmolLM2-135M (30 layers
//! of 256 × 1536 values), on one thread: the scalar reference (`expf` per value) against the
//! backend's kernel (AVX2 with the Cephes exponential where the CPU has it).
//!
//! Usage: `silu_time`.
use cleave_kernels::{reference, Backend, CpuBackend};
use std::time::Instant;
fn main() {
    let n = 256 * 1536;
    let gate: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2000) as f32 / 250.0 - 4.0).collect();
    let up: Vec<f32> = (0..n).map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0).collect();
    let mut out = vec![0f32; n];
    let b = CpuBackend::new(Some(1)).unwrap();
    for round in 0..3 {
        let t = Instant::now();
        for _ in 0..30 {
            reference::silu_mul(&gate, &up, n, &mut out).unwrap();
        }
        let s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..30 {
            b.silu_mul(&gate, &up, n, &mut out).unwrap();
        }
        let v = t.elapsed().as_secs_f64();
        println!("round {round}: 30 layers x 256 tokens x 1536: scalar {:.1} ms, backend {:.1} ms", s * 1e3, v * 1e3);
    }
}
