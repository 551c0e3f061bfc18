//! Hand-run: quantized `linear` at SmolLM2-135M's shapes (hidden 576, MLP 1536, kv 192, vocab
//! 49152; 30 layers, each with its own weights so they stream from memory as in a real step),
//! `m` activation rows per product, best of `REPS` steps:
//!
//! - `int`: the integer kernels (activations quantized to 8 bits per 32, byte dot products);
//! - `wide`: the same weights dequantized into f32 panels per call (the prefill path);
//! - `f32`: the weights dequantized once at load (`--dequantize-weights`);
//! - `reg` (Q4_1 and Q8_0 on AVX2, m <= 4): the alternative design, weights widened to f32 in
//!   registers and multiplied by f32 activations (a prototype written here, not in the crate).
//!
//! Usage: `quant_shapes FORMAT THREADS REPS M...` (e.g. `quant_shapes Q4_1 2 20 1 2 4 8 16 32 64`).
use std::time::Instant;

use cleave_kernels::cpu::{CpuLinear, Isa, QuantIsa};
use cleave_kernels::quant::synthetic_blocks;
use cleave_kernels::{Backend, CpuBackend, QuantFormat, QuantMatrix};

/// Wall time; with QS_CPU_TIME set, the CPU time of the calling thread instead (with one
/// pool thread, timed from inside the pool, that is the kernels' own cost on a machine busy with
/// other work).
struct Clock {
    wall: Instant,
    cpu: u64,
}

impl Clock {
    fn start() -> Self {
        Clock { wall: Instant::now(), cpu: thread_cpu_ns() }
    }

    fn secs(&self) -> f64 {
        if std::env::var_os("QS_CPU_TIME").is_some() {
            (thread_cpu_ns() - self.cpu) as f64 / 1e9
        } else {
            self.wall.elapsed().as_secs_f64()
        }
    }
}

/// Nanoseconds this thread has run (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`, Linux).
fn thread_cpu_ns() -> u64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec; the C library fills it or returns an error.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    if rc == 0 {
        t.sec as u64 * 1_000_000_000 + t.nsec as u64
    } else {
        0
    }
}

/// The fastest of `reps` runs of `step`, the whole of each inside the pool (with one thread,
/// every op runs on this worker).
fn best_step<E: Send>(b: &CpuBackend, reps: usize, mut step: impl FnMut() -> Result<(), E> + Send) -> Result<f64, E> {
    b.install(|| {
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Clock::start();
            step()?;
            best = best.min(t.secs());
        }
        Ok(best)
    })
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "Q4_1".into());
    let format =
        QuantFormat::ALL.into_iter().find(|f| f.name() == name).ok_or_else(|| anyhow::anyhow!("format {name}"))?;
    let threads: usize = args.next().map_or(Ok(2), |s| s.parse())?;
    let reps: usize = args.next().map_or(Ok(10), |s| s.parse())?;
    let ms: Vec<usize> = args.map(|s| s.parse()).collect::<Result<_, _>>()?;
    let ms = if ms.is_empty() { vec![1, 2, 4, 8, 16, 32, 64] } else { ms };
    let mut b = CpuBackend::new(Some(threads))?;
    // QS_ISA restricts the quantized kernels (portable, avx2, avx512bw, avx512-vnni).
    if let Ok(name) = std::env::var("QS_ISA") {
        let all = [QuantIsa::Portable, QuantIsa::Avx2, QuantIsa::Avx512Bw, QuantIsa::Avx512Vnni];
        let qisa = all.into_iter().find(|q| q.name() == name).ok_or_else(|| anyhow::anyhow!("isa {name}"))?;
        // AVX2 (or portable) quantized kernels come with the f32 kernels of the same ISA, as on
        // a CPU without AVX-512.
        b = match qisa {
            QuantIsa::Avx2 => b.with_isa(Isa::Avx2Fma),
            QuantIsa::Portable => b.with_isa(Isa::Portable),
            _ => b,
        }
        .with_quant_isa(qisa);
    }
    println!("{format}, {threads} threads, quantized path {}", b.quant_isa().name());
    let layer = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)];
    let mut shapes: Vec<(usize, usize)> = (0..30).flat_map(|_| layer).collect();
    shapes.push((49152, 576));
    let mats: Vec<QuantMatrix> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| {
            QuantMatrix::new(format, n, k, synthetic_blocks(format, n * k / format.block_values(), i as u64))
        })
        .collect::<Result<_, _>>()?;
    let bytes: usize = mats.iter().map(|m| m.bytes().len()).sum();
    let params: usize = shapes.iter().map(|(n, k)| n * k).sum();
    let quant: Vec<CpuLinear> = mats.iter().map(|m| b.prepare_linear_quantized(m.clone())).collect::<Result<_, _>>()?;
    println!("{:.1} MB quantized, {:.1} MB f32", bytes as f64 / 1e6, params as f64 * 4.0 / 1e6);
    let time = |b: &CpuBackend, ws: &[CpuLinear], m: usize| -> anyhow::Result<f64> {
        let x: Vec<f32> = (0..m * 1536).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut out = vec![0f32; m * 49152];
        Ok(best_step(b, reps, || ws.iter().try_for_each(|w| b.linear_prepared(&x, w, None, m, &mut out)))?)
    };
    println!(
        "{:>4} {:>10} {:>10} {:>10} {:>10}   (ms per step; GB/s of the quantized bytes)",
        "m", "int", "wide", "f32", "reg"
    );
    // QS_MODES picks the columns to time (default all): a comma-separated subset of int,wide,f32,reg.
    let modes = std::env::var("QS_MODES").unwrap_or_else(|_| "int,wide,f32,reg".into());
    let on = |mode: &str| modes.split(',').any(|m| m == mode);
    let f32s: Vec<CpuLinear> = if on("f32") {
        mats.iter().map(|m| b.prepare_linear(&m.to_f32(), m.n(), m.k())).collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    for &m in &ms {
        let int = if on("int") { time(&b.clone().with_quant_max_m(usize::MAX), &quant, m)? } else { f64::NAN };
        let wide = if on("wide") { time(&b.clone().with_quant_max_m(0), &quant, m)? } else { f64::NAN };
        let f = if on("f32") { time(&b, &f32s, m)? } else { f64::NAN };
        let reg = if on("reg") && m <= 4 && b.quant_isa() != QuantIsa::Portable {
            register::time(&b, &mats, m, reps)
        } else {
            None
        };
        let cell = |t: f64| format!("{:.2} {:>4.1}", t * 1e3, bytes as f64 / t / 1e9);
        println!(
            "{m:>4} {:>10} {:>10} {:>10} {:>10}",
            cell(int),
            cell(wide),
            format!("{:.2}", f * 1e3),
            reg.map_or("-".into(), cell)
        );
    }
    Ok(())
}

/// The alternative design: each weight block widened to f32 in registers (`d * q + m`) and
/// multiplied by f32 activations, `M` rows at a time. Q4_1 and Q8_0 on AVX2 only.
#[cfg(target_arch = "x86_64")]
mod register {
    use super::*;
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    pub fn time(b: &CpuBackend, mats: &[QuantMatrix], m: usize, reps: usize) -> Option<f64> {
        if !matches!(mats[0].format(), QuantFormat::Q4_1 | QuantFormat::Q8_0) {
            return None;
        }
        let x: Vec<f32> = (0..m * 1536).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut out = vec![0f32; m * 49152];
        best_step(b, reps, || {
            mats.iter().for_each(|w| linear(w, &x, m, &mut out));
            Ok::<(), std::convert::Infallible>(())
        })
        .ok()
    }

    /// `out[r, j] = x[r] · w[j]`, written transposed (`[n, m]`) for simplicity.
    fn linear(w: &QuantMatrix, x: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (w.n(), w.k());
        let rows = n.div_ceil(8 * rayon::current_num_threads()).max(1);
        out[..n * m].par_chunks_mut(rows * m).enumerate().for_each(|(c, o)| {
            for (jj, o) in o.chunks_exact_mut(m).enumerate() {
                let row = w.row(c * rows + jj);
                // SAFETY: AVX2/FMA/F16C checked by the caller's quant ISA; `row` holds k / 32
                // blocks and `x` m rows of k.
                unsafe {
                    match m {
                        1 => dot::<1>(w.format(), row, x, k, o),
                        2 => dot::<2>(w.format(), row, x, k, o),
                        3 => dot::<3>(w.format(), row, x, k, o),
                        _ => dot::<4>(w.format(), row, x, k, o),
                    }
                }
            }
        });
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot<const M: usize>(format: QuantFormat, row: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
        let mut acc = [_mm256_setzero_ps(); M];
        let bb = format.block_bytes();
        for (blk, b) in row.chunks_exact(bb).enumerate() {
            let p = b.as_ptr();
            // SAFETY: reads inside the block and inside x's rows.
            unsafe {
                let d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(*(p as *const u16))))));
                let mut w = [_mm256_setzero_ps(); 4];
                if format == QuantFormat::Q8_0 {
                    for (i, w) in w.iter_mut().enumerate() {
                        let q = _mm_loadl_epi64(p.add(2 + 8 * i) as *const __m128i);
                        *w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
                    }
                } else {
                    let mn = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
                        *(p.add(2) as *const u16),
                    )))));
                    let raw = _mm_loadu_si128(p.add(4) as *const __m128i);
                    let lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), _mm_set1_epi8(0x0F));
                    let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                    for (w, q) in w.iter_mut().zip(q) {
                        *w = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), mn);
                    }
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xp = x.as_ptr().add(r * k + 32 * blk);
                    for (i, w) in w.iter().enumerate() {
                        *acc = _mm256_fmadd_ps(*w, _mm256_loadu_ps(xp.add(8 * i)), *acc);
                    }
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            *o = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        }
    }
}
