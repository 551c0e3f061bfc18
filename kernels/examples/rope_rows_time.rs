//! Hand-run: what building a step's RoPE rows costs (`rope_rows`, which the engine calls once
//! per forward pass instead of keeping a table of every position), per token, for heads of 64
//! and 128: 2048 positions, 50 times each.
//!
//! Usage: `cargo run --release -p cleave-kernels --example rope_rows_time`.
use cleave_kernels::{rope_inv_freq, rope_rows, RopeScaling};
use std::time::Instant;
fn main() {
    let positions: Vec<u32> = (1000..3048).collect();
    let mut out = Vec::new();
    for (head_dim, theta) in [(64, 100_000.0), (128, 500_000.0)] {
        let f = rope_inv_freq(head_dim, theta, &RopeScaling::None);
        let t = Instant::now();
        for _ in 0..50 {
            rope_rows(&f, &positions, &mut out);
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / 50.0 / positions.len() as f64;
        println!("head_dim {head_dim}: {us:.2} us a token (checksum {})", out.iter().sum::<f32>());
    }
}
