//! Hand-run, for `perf stat`: `linear` at base-100m's decode shapes (hidden 768, MLP 2048, kv 256,
//! vocab 32000), `m` activation rows, each of 12 layers with its own weights (so they stream from
//! memory as in a real step), `reps` times, with the weights prepared once (packed panels) and,
//! for comparison, in the plain layout. Usage: `decode_shapes M REPS`.
use cleave_kernels::{Backend, CpuBackend};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let m: usize = args.next().map_or(Ok(32), |s| s.parse())?;
    let reps: usize = args.next().map_or(Ok(10), |s| s.parse())?;
    let b = CpuBackend::new(None)?;
    let shapes = [(768, 768), (256, 768), (256, 768), (768, 768), (2048, 768), (2048, 768), (768, 2048)];
    let mut ws: Vec<(usize, usize, Vec<f32>)> = Vec::new();
    for l in 0..12 {
        for (i, &(n, k)) in shapes.iter().enumerate() {
            ws.push((n, k, vec![((l * 7 + i) % 13) as f32 * 1e-3; n * k]));
        }
    }
    ws.push((32000, 768, vec![1e-3; 32000 * 768]));
    let flops: usize = ws.iter().map(|(n, k, _)| 2 * m * n * k).sum();
    let x = vec![0.5f32; m * 2048];
    let mut out = vec![0f32; m * 32000];
    let packed = ws.iter().map(|(n, k, w)| b.prepare_linear(w, *n, *k)).collect::<Result<Vec<_>, _>>()?;
    let mut best = [f64::INFINITY; 2];
    for _ in 0..reps {
        let t = Instant::now();
        for w in &packed {
            b.linear_prepared(&x, w, None, m, &mut out)?;
        }
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (n, k, w) in &ws {
            b.linear(&x, w, None, m, *k, *n, &mut out)?;
        }
        best[1] = best[1].min(t.elapsed().as_secs_f64());
    }
    for (name, best) in ["prepared", "plain"].iter().zip(best) {
        println!("m={m} {name}: best step {:.1} ms, {:.1} GFLOP/s", best * 1e3, flops as f64 / best / 1e9);
    }
    Ok(())
}
