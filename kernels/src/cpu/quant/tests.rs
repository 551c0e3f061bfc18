//! Every format on every quantized path this CPU has, against dequantize-then-f32 (f64 sums),
//! for `m` from 1 to 70 on both the integer kernels and the wide path (whichever
//! [`QuantIsa::max_m`] picks for a given `m`), and a large `m`, with `n` and `k` that are not multiples of the tile sizes (`n` odd, `k` an odd
//! number of blocks where the format allows).
//!
//! Tolerances:
//! - **Integer path, exact check**: against the product with the *quantized activations*
//!   (`d · q`, from the portable quantizer, which every path matches byte for byte) the integer
//!   sums are exact, so the only difference is f32 rounding of the per-unit scaling and the
//!   sums: `|got - want| <= 2e-5 · Σ|w · x̂| + 1e-6`.
//! - **Accuracy against the f32 activations** (both paths): the activations' rounding moves each
//!   by at most `d_block / 2`, so `|got - want| <= Σ_blocks d / 2 · Σ_block |w| + 2e-5 · Σ|w · x|
//!   + 1e-6`, the bound stated in [`super::acts`]; the wide path only pays the f32 term.

use super::acts::QActs;
use super::*;
use crate::quant::{synthetic_blocks, QuantFormat};

/// Deterministic activations in [-1, 1), with an outlier now and then and an all-zero block at
/// the start of row 1 (a zero scale).
fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut x: Vec<f32> = (0..m * k)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 97 == 5 {
                8.0 * v
            } else {
                v
            }
        })
        .collect();
    if m > 1 {
        x[k..k + 32].fill(0.0);
    }
    x
}

/// `[m, n]` products in f64 of `x` with the f32 weight `w` (`[n, k]`), and the sums of the
/// magnitudes of the terms.
fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0f64; m * n];
    let mut mag = vec![0f64; m * n];
    for r in 0..m {
        for j in 0..n {
            let (xr, wj) = (&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]);
            y[r * n + j] = xr.iter().zip(wj).map(|(&a, &b)| a as f64 * b as f64).sum();
            mag[r * n + j] = xr.iter().zip(wj).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        }
    }
    (y, mag)
}

/// The activations' rounding bound of each output: `Σ_groups d / 2 · Σ_group |w|` (groups of
/// four values).
fn rounding_bound(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for r in 0..m {
        for j in 0..n {
            out[r * n + j] = (0..k / 4)
                .map(|g| {
                    let xg = &x[r * k + 4 * g..r * k + 4 * g + 4];
                    let d = xg.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                    let wabs: f64 = w[j * k + 4 * g..j * k + 4 * g + 4].iter().map(|v| v.abs() as f64).sum();
                    d / 2.0 * wabs
                })
                .sum();
        }
    }
    out
}

/// `x̂ = d · q`: the activations as the integer kernels see them.
fn dequantized_acts(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let mut a = QActs::default();
    a.quantize(QuantIsa::Portable, x, m, k);
    a.q.iter().enumerate().map(|(i, &q)| a.d[i / 4] * f32::from(q)).collect()
}

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()
}

/// `x · wᵀ (+ bias)` through [`linear_many`], with the integer kernels up to `max_m` rows.
fn run(
    pool: &rayon::ThreadPool,
    (qisa, max_m): (QuantIsa, usize),
    w: &QuantMatrix,
    x: &[f32],
    m: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let isa = match qisa {
        QuantIsa::Portable => Isa::Portable,
        QuantIsa::Avx2 => Isa::Avx2Fma,
        _ => Isa::Avx512,
    };
    let mut out = vec![f32::NAN; m * w.n() + 3];
    let (body, tail) = out.split_at_mut(m * w.n());
    let kernels = Kernels { isa, qisa, max_m };
    linear_many(pool, kernels, &x[..m * w.k()], m, &mut [Product { w, bias, out: body }]);
    assert!(tail.iter().all(|v| v.is_nan()), "wrote past m * n");
    out.truncate(m * w.n());
    out
}

#[allow(clippy::too_many_arguments)]
fn check(what: &str, got: &[f32], want: &[f64], mag: &[f64], extra: Option<&[f64]>, bias: Option<&[f32]>, n: usize) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let w = w + bias.map_or(0.0, |b| b[i % n] as f64);
        let tol = 2e-5 * mag[i] + 1e-6 + extra.map_or(0.0, |e| e[i]);
        assert!(((g as f64) - w).abs() <= tol, "{what}: output {i}: got {g}, want {w} (tolerance {tol:e})");
    }
}

/// Shapes `(n, k)` per format: `n` odd (a lone last weight row, ragged tasks), `k` one block
/// and an odd number of them (an odd unit count for the AVX-512 pairs, several K chunks).
fn shapes(format: QuantFormat) -> Vec<(usize, usize)> {
    let bv = format.block_values();
    if bv == 256 {
        vec![(1, 256), (67, 768)]
    } else {
        vec![(1, 32), (3, 96), (67, 544)]
    }
}

#[test]
fn every_format_and_path_matches_dequantize_then_f32() {
    let pool = pool();
    for format in QuantFormat::ALL {
        for (si, &(n, k)) in shapes(format).iter().enumerate() {
            let seed = 100 * si as u64 + format.block_bytes() as u64;
            let blocks = synthetic_blocks(format, n * k / format.block_values(), seed);
            let w = QuantMatrix::new(format, n, k, blocks).unwrap();
            let wf = w.to_f32();
            let mmax = 70;
            let x = activations(mmax, k, seed + 1);
            let (want, mag) = reference(&x, &wf, mmax, n, k);
            let bound = rounding_bound(&x, &wf, mmax, n, k);
            let xq = dequantized_acts(&x, mmax, k);
            let (want_q, mag_q) = reference(&xq, &wf, mmax, n, k);
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
            for qisa in QuantIsa::available() {
                for m in 1..=mmax {
                    let b = (m % 3 == 0).then_some(&bias[..]);
                    let rows = m * n;
                    let what = format!("{format} {} n={n} k={k} m={m}", qisa.name());
                    let int = run(&pool, (qisa, usize::MAX), &w, &x, m, b);
                    check(&format!("{what} integer"), &int, &want_q[..rows], &mag_q[..rows], None, b, n);
                    check(&format!("{what} integer"), &int, &want[..rows], &mag[..rows], Some(&bound[..rows]), b, n);
                    let wide = run(&pool, (qisa, 0), &w, &x, m, b);
                    check(&format!("{what} wide"), &wide, &want[..rows], &mag[..rows], None, b, n);
                }
            }
        }
    }
}

#[test]
fn large_batches_and_long_rows_take_the_wide_path() {
    let pool = pool();
    // Long rows: one row block of x per few row tiles, so every panel is decoded once per block.
    for format in [QuantFormat::Q4_1, QuantFormat::Q6_K] {
        let (n, k, m) = (2100, 2048, 40);
        let w = QuantMatrix::new(format, n, k, synthetic_blocks(format, n * k / format.block_values(), 7)).unwrap();
        let x = activations(m, k, 8);
        let (want, mag) = reference(&x, &w.to_f32(), m, n, k);
        let got = run(&pool, (QuantIsa::for_isa(Isa::detect()), 0), &w, &x, m, None);
        check(&format!("{format} wide"), &got, &want, &mag, None, None, n);
    }
    let m = 300;
    let (n, k) = (65, 256);
    let w = QuantMatrix::new(QuantFormat::Q4_K, n, k, synthetic_blocks(QuantFormat::Q4_K, n, 9)).unwrap();
    let x = activations(m, k, 10);
    let (want, mag) = reference(&x, &w.to_f32(), m, n, k);
    for qisa in QuantIsa::available() {
        let got = run(&pool, (qisa, qisa.max_m(Rows::Prompt, QuantFormat::Q4_K)), &w, &x, m, None);
        check(&format!("Q4_K {} m={m}", qisa.name()), &got, &want, &mag, None, None, n);
    }
}

#[test]
fn several_products_share_one_region() {
    let pool = pool();
    let k = 512;
    let ws: Vec<QuantMatrix> = [(QuantFormat::Q8_0, 33), (QuantFormat::Q4_K, 5), (QuantFormat::Q5_0, 64)]
        .iter()
        .map(|&(f, n)| QuantMatrix::new(f, n, k, synthetic_blocks(f, n * k / f.block_values(), n as u64)).unwrap())
        .collect();
    for m in [1, 7, 33] {
        let x = activations(m, k, 3);
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.n()]).collect();
        let qisa = QuantIsa::for_isa(Isa::detect());
        let isa = Isa::detect();
        let mut products: Vec<Product<'_>> =
            ws.iter().zip(outs.iter_mut()).map(|(w, out)| Product { w, bias: None, out }).collect();
        linear_many(
            &pool,
            Kernels { isa, qisa, max_m: qisa.max_m(Rows::Prompt, QuantFormat::Q4_1) },
            &x,
            m,
            &mut products,
        );
        for (w, got) in ws.iter().zip(&outs) {
            assert_eq!(
                got,
                &run(&pool, (qisa, qisa.max_m(Rows::Prompt, QuantFormat::Q4_1)), w, &x, m, None),
                "{} m={m}",
                w.format()
            );
        }
    }
}

#[test]
fn activation_quantization_is_the_same_on_every_path() {
    let k = 320;
    let x = activations(3, k, 11);
    let mut want = QActs::default();
    want.quantize(QuantIsa::Portable, &x, 3, k);
    assert!(want.q.iter().all(|&q| q != i8::MIN));
    // The all-zero block of row 1 has zero scales and zero quants.
    assert_eq!((&want.d[k / 4..k / 4 + 8], want.s[k / 16]), (&[0.0; 8][..], 0.0));
    for qisa in QuantIsa::available() {
        let mut got = QActs::default();
        got.quantize(qisa, &x, 3, k);
        assert_eq!((&got.q, &got.d, &got.s), (&want.q, &want.d, &want.s), "{}", qisa.name());
    }
}

#[test]
fn the_canonical_form_decodes_to_the_dequantized_values() {
    for format in QuantFormat::ALL {
        let nb = 3;
        let blocks = synthetic_blocks(format, nb, 5);
        let values = nb * format.block_values();
        let mut want = vec![0f32; values];
        crate::quant::dequantize(format, &blocks, &mut want).unwrap();
        let (mut q, mut ds, mut wm) = (vec![0u8; values], vec![0f32; values / 4], vec![0f32; values / 16]);
        portable::decode(format, &blocks, &mut q, &mut ds, &mut wm);
        for i in 0..values {
            let signed = portable::signed(format);
            let qv = if signed { f32::from(q[i] as i8) } else { f32::from(q[i]) };
            let v = ds[i / 4] * qv + if signed { 0.0 } else { wm[i / 16] };
            assert!((v - want[i]).abs() <= 1e-6 * want[i].abs().max(1e-3), "{format} value {i}: {v} vs {}", want[i]);
        }
        // The x86 unit decoders widened to f32 (the wide path's panels) give the same values.
        #[cfg(target_arch = "x86_64")]
        for qisa in QuantIsa::available().into_iter().filter(|&q| q != QuantIsa::Portable) {
            let w = QuantMatrix::new(format, 1, values, blocks.clone()).unwrap();
            let mut got = vec![0f32; values];
            x86::dequantize_row(qisa, &w, 0, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "{format} {}: value {i}: {g} vs {w}", qisa.name());
            }
        }
    }
}

/// The backend picks the integer kernels or the f32 panels by the call's [`Rows`] and the
/// weight's format ([`QuantIsa::max_m`]): each call below equals, bit for bit, the same call
/// with that path forced, and differs from the other path (the 8-bit activations show).
#[test]
fn decode_rows_keep_the_integer_kernels_longer_than_prompt_rows() {
    use crate::{Backend, CpuBackend};
    let backend = CpuBackend::new(Some(2)).unwrap();
    let (int, wide) = (backend.clone().with_quant_max_m(usize::MAX), backend.clone().with_quant_max_m(0));
    for (format, (n, k), limit) in [(QuantFormat::Q4_1, (37, 544), 48), (QuantFormat::Q4_K, (37, 512), 32)] {
        let w = QuantMatrix::new(format, n, k, synthetic_blocks(format, n * k / format.block_values(), 3)).unwrap();
        let qisa = backend.quant_isa();
        assert_eq!(qisa.max_m(Rows::Decode, format), limit, "{format}");
        assert_eq!(qisa.max_m(Rows::Prompt, format), 16, "{format}");
        let lin = backend.prepare_linear_quantized(w).unwrap();
        for m in [1, 16, 17, 32, 33, 48, 49] {
            let x = activations(m, k, m as u64);
            let call = |b: &CpuBackend, rows: Rows| {
                let mut out = vec![0f32; m * n];
                b.linear_prepared_rows(&x, &[(&lin, None)], rows, m, &mut [&mut out]).unwrap();
                out
            };
            let (by_int, by_wide) = (call(&int, Rows::Prompt), call(&wide, Rows::Prompt));
            assert_ne!(by_int, by_wide, "{format} m={m}: the two paths should differ in rounding");
            for (rows, max) in [(Rows::Decode, limit), (Rows::Prompt, 16)] {
                let want = if m <= max { &by_int } else { &by_wide };
                assert_eq!(&call(&backend, rows), want, "{format} {rows:?} m={m}");
            }
            // The old entry point is a prompt call.
            let mut out = vec![0f32; m * n];
            backend.linear_prepared_many(&x, &[(&lin, None)], m, &mut [&mut out]).unwrap();
            assert_eq!(&out, if m <= 16 { &by_int } else { &by_wide }, "{format} m={m}");
        }
    }
}

/// Rows stored out of order (llama.cpp's q/k layout, multiplied in place) give every path the
/// same outputs, bit for bit, as the same rows stored in output order, bias included; the
/// accessors by output feature see the output order.
#[test]
fn rows_stored_out_of_order_give_the_outputs_of_rows_in_order() {
    let pool = pool();
    for format in [QuantFormat::Q4_1, QuantFormat::Q8_0, QuantFormat::Q6_K] {
        let (n, k) = (24, 2 * 256);
        let bb = format.block_bytes() * k / format.block_values();
        let stored = synthetic_blocks(format, n * k / format.block_values(), 9);
        // Two heads of 12 rows, each head's halves interleaved (stored row h*12 + 2i + half is
        // feature h*12 + half*6 + i), as convert_hf_to_gguf.py stores q and k.
        let feature_of: Vec<u32> = (0..n).map(|s| ((s / 12) * 12 + (s % 12 % 2) * 6 + (s % 12) / 2) as u32).collect();
        let mut in_order = vec![0u8; stored.len()];
        for (s, &f) in feature_of.iter().enumerate() {
            in_order[f as usize * bb..(f as usize + 1) * bb].copy_from_slice(&stored[s * bb..(s + 1) * bb]);
        }
        let plain = QuantMatrix::new(format, n, k, in_order).unwrap();
        let moved = QuantMatrix::new(format, n, k, stored).unwrap().with_row_order(feature_of.clone()).unwrap();
        assert!(moved.is_reordered() && !plain.is_reordered());
        assert_eq!(moved.to_f32(), plain.to_f32(), "{format}");
        for j in 0..n {
            assert_eq!(moved.row(j), plain.row(j), "{format} feature {j}");
            assert_eq!(moved.stored_row(j), moved.row(moved.feature_of(j)), "{format} stored row {j}");
        }
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.5 - 3.0).collect();
        for qisa in QuantIsa::available() {
            for m in [1, 2, 5, 8, 19] {
                let x = activations(m, k, m as u64);
                for (max_m, path) in [(usize::MAX, "integer"), (0, "wide")] {
                    for b in [None, Some(&bias[..])] {
                        let what = format!("{format} {} m={m} {path} bias={}", qisa.name(), b.is_some());
                        assert_eq!(
                            run(&pool, (qisa, max_m), &moved, &x, m, b),
                            run(&pool, (qisa, max_m), &plain, &x, m, b),
                            "{what}"
                        );
                    }
                }
            }
        }
    }
    // Not a permutation: refused.
    let w = || QuantMatrix::new(QuantFormat::Q8_0, 3, 32, synthetic_blocks(QuantFormat::Q8_0, 3, 1)).unwrap();
    assert!(w().with_row_order(vec![0, 1]).is_err());
    assert!(w().with_row_order(vec![0, 1, 1]).is_err());
    assert!(w().with_row_order(vec![0, 1, 3]).is_err());
    assert!(!w().with_row_order(vec![0, 1, 2]).unwrap().is_reordered());
}
