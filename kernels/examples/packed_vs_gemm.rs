//! Hand-run: the packed f32 `linear` (weights packed once, as a node holds them) against the
//! `gemm` crate on the same product, at SmolLM2-135M's prefill shapes and at 1024^3, best of 20
//! calls each, two threads. Prints GFLOP/s for both and their largest difference.
//!
//! Usage: `cargo run --release -p cleave-kernels --example packed_vs_gemm`.
use std::time::Instant;

use cleave_kernels::{Backend, CpuBackend};

fn main() {
    let backend = CpuBackend::new(Some(2)).expect("a CPU backend");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
    // (rows, out features, in features): gate/up, q/o, down, k/v at a 256-token prompt; other
    // row counts around the activation blocking; the square reference.
    let shapes = [
        (113, 1536, 576),
        (128, 1536, 576),
        (226, 1536, 576),
        (256, 1536, 576),
        (256, 576, 576),
        (256, 576, 1536),
        (256, 192, 576),
        (512, 1536, 576),
        (1024, 1024, 1024),
    ];
    for (m, n, k) in shapes {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 104_729) % 1000) as f32 * 1e-3 - 0.5).collect();
        let lin = backend.prepare_linear(&w, n, k).expect("packed");
        let flops = 2.0 * (m * n * k) as f64;
        let best = |f: &mut dyn FnMut()| {
            (0..20)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min)
        };
        let mut ours = vec![0f32; m * n];
        let t_ours = best(&mut || backend.linear_prepared(&x, &lin, None, m, &mut ours).expect("linear"));
        let mut theirs = vec![0f32; m * n];
        // out[m, n] = x[m, k] · wᵀ, w row-major [n, k] read as a column-major [k, n].
        let t_gemm = best(&mut || {
            pool.install(|| {
                // SAFETY: every pointer covers its matrix at the strides given.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        theirs.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        x.as_ptr(),
                        1,
                        k as isize,
                        w.as_ptr(),
                        k as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(2),
                    )
                }
            })
        });
        let diff = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!(
            "m={m:5} n={n:5} k={k:5}: packed {:6.1} GFLOP/s, gemm crate {:6.1} GFLOP/s (largest difference {diff:.1e})",
            flops / t_ours / 1e9,
            flops / t_gemm / 1e9
        );
    }
}
