//! Hand-run: one decode step's paged attention at base-100m's shape (12 query heads, 4 KV heads,
//! head_dim 64, block size 16), `b` sequences of `ctx` tokens, all 12 layers' worth of calls.
//! Usage: `decode_attention B CTX REPS [f32|f16|bf16]` (the KV cache's element type).
use cleave_kernels::{AttnSeq, AttnShape, Backend, CacheDtype, CpuBackend};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let b: usize = args.next().map_or(Ok(32), |s| s.parse())?;
    let ctx: usize = args.next().map_or(Ok(128), |s| s.parse())?;
    let reps: usize = args.next().map_or(Ok(10), |s| s.parse())?;
    let dtype = match args.next().as_deref() {
        None | Some("f32") => CacheDtype::F32,
        Some("f16") => CacheDtype::F16,
        Some("bf16") => CacheDtype::Bf16,
        Some(other) => anyhow::bail!("unknown dtype `{other}` (f32, f16, bf16)"),
    };
    let backend = CpuBackend::new(None)?;
    let shape = AttnShape { num_heads: 12, num_kv_heads: 4, head_dim: 64, block_size: 16, scale: 0.125 };
    let kvw = shape.num_kv_heads * shape.head_dim;
    let blocks_per_seq = ctx.div_ceil(shape.block_size);
    let tables: Vec<Vec<u32>> = (0..b).map(|s| (0..blocks_per_seq).map(|i| (i * b + s) as u32).collect()).collect();
    let cache_len = b * blocks_per_seq * shape.block_size * kvw;
    let kc: Vec<f32> = (0..cache_len).map(|i| ((i % 97) as f32 - 48.0) * 1e-2).collect();
    let vc: Vec<f32> = (0..cache_len).map(|i| ((i % 89) as f32 - 44.0) * 1e-2).collect();
    let pool = |x: &[f32]| -> anyhow::Result<_> {
        let mut p = backend.alloc_kv(dtype, x.len())?;
        backend.write_kv_bytes(&mut p, 0, &cleave_kernels::reference::kv_encode(dtype, x))?;
        Ok(p)
    };
    let (kc, vc) = (pool(&kc)?, pool(&vc)?);
    let q: Vec<f32> = (0..b * 12 * 64).map(|i| ((i % 31) as f32 - 15.0) * 1e-2).collect();
    let mut out = vec![0f32; q.len()];
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| AttnSeq { q_start: i, q_len: 1, context_len: ctx, block_table: t })
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        for _layer in 0..12 {
            backend.paged_attention(&q, &kc, &vc, &seqs, shape, &mut out)?;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("decode attention b={b} ctx={ctx} kv {}: best step (12 layers) {:.2} ms", dtype.name(), best * 1e3);
    Ok(())
}
