//! Hand-run on a GPU (feature `cuda`; scripts/gpu-check runs it): paged decode attention's
//! effective bandwidth against the device's copy bandwidth, and the device-to-host staging of one
//! layer's K/V for a handoff.
//!
//! - Attention: one decode step (`q_len` 1) of `b` sequences of `ctx` tokens each, at SmolLM2's
//!   shape (9 query heads over 3 KV heads, head_dim 64) and Llama 3 8B's (32 over 8, head_dim
//!   128); bytes = every K and V row read once; best of REPS after a warm-up.
//! - Staging: `read_kv_bytes` of one layer's K and V for a prompt of `len` tokens (what a
//!   prefill node copies to the host per layer), as GB/s.
//!
//! Usage: `cuda_attention [REPS]`.
#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    use cleave_kernels::cuda::{CudaBackend, GemmDtype};
    use cleave_kernels::{AttnSeq, AttnShape, Backend, CacheDtype};
    use std::time::Instant;

    let reps: usize = std::env::args().nth(1).map_or(Ok(20), |s| s.parse())?;
    let b = CudaBackend::new(0, GemmDtype::Bf16)?;
    let copy = b.copy_bandwidth_gbps(1 << 30)?;
    println!("device: {}; copy bandwidth (read + write) {copy:.0} GB/s", b.device_name());
    println!("{:<34} {:>10} {:>12} {:>10}", "paged decode attention", "time", "effective", "of copy");
    let shapes = [("SmolLM2 9/3x64", 9, 3, 64), ("Llama-3-8B 32/8x128", 32, 8, 128)];
    for (name, nh, nkv, hd) in shapes {
        for dtype in [CacheDtype::Bf16, CacheDtype::F32] {
            for (batch, ctx) in [(1usize, 4096usize), (32, 1024), (128, 1024), (128, 4096)] {
                let shape = AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, block_size: 16, scale: 0.1 };
                let kvw = nkv * hd;
                let per_seq = ctx.div_ceil(16);
                // Interleaved block ids, as a busy cache hands them out.
                let tables: Vec<Vec<u32>> =
                    (0..batch).map(|s| (0..per_seq).map(|i| (i * batch + s) as u32).collect()).collect();
                let len = batch * per_seq * 16 * kvw;
                let (kc, vc) = (b.alloc_kv(dtype, len)?, b.alloc_kv(dtype, len)?);
                let q = b.upload(&vec![0.01f32; batch * nh * hd])?;
                let mut out = b.alloc_zeros(batch * nh * hd)?;
                let seqs: Vec<AttnSeq<'_>> = tables
                    .iter()
                    .enumerate()
                    .map(|(i, t)| AttnSeq { q_start: i, q_len: 1, context_len: ctx, block_table: t })
                    .collect();
                b.paged_attention(&q, &kc, &vc, &seqs, shape, &mut out)?;
                b.synchronize()?;
                let mut best = f64::INFINITY;
                for _ in 0..reps {
                    let t = Instant::now();
                    b.paged_attention(&q, &kc, &vc, &seqs, shape, &mut out)?;
                    b.synchronize()?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                let bytes = 2.0 * (batch * ctx * kvw * dtype.size_bytes()) as f64;
                let gbps = bytes / best / 1e9;
                println!(
                    "{:<34} {:>8.1}us {:>7.0} GB/s {:>9.0}%",
                    format!("{name} {} b{batch} ctx{ctx}", dtype.name()),
                    best * 1e6,
                    gbps,
                    100.0 * gbps / copy
                );
            }
        }
    }
    println!();
    println!("{:<34} {:>10} {:>12}", "handoff staging, one layer K+V", "time", "rate");
    for (name, nkv, hd) in [("SmolLM2 3x64", 3, 64), ("Llama-3-8B 8x128", 8, 128)] {
        for len in [512usize, 2048] {
            let dtype = CacheDtype::Bf16;
            let n = len * nkv * hd;
            let (kc, vc) = (b.alloc_kv(dtype, n)?, b.alloc_kv(dtype, n)?);
            let mut host = Vec::with_capacity(2 * n * dtype.size_bytes());
            let mut best = f64::INFINITY;
            for _ in 0..reps.max(2) {
                host.clear();
                let t = Instant::now();
                b.read_kv_bytes(&kc, 0, n, &mut host)?;
                b.read_kv_bytes(&vc, 0, n, &mut host)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{:<34} {:>8.1}us {:>7.1} GB/s",
                format!("{name} bf16 {len} tokens"),
                best * 1e6,
                host.len() as f64 / best / 1e9
            );
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("built without the `cuda` feature");
}
