//! Every ISA's kernels against scalar sums.
use super::*;

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 16) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            v.push(Isa::Avx2Fma);
        }
        if is_x86_feature_detected!("avx512f") {
            v.push(Isa::Avx512);
        }
    }
    v
}

#[test]
fn every_isa_matches_scalar_sums() {
    for isa in isas() {
        for n in [0, 1, 7, 8, 15, 16, 17, 63, 64, 65, 100, 257] {
            let (a, b, c) = (data(n, 1), data(n, 2), data(n, 3));
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(isa, &a, &b) as f64 - exact).abs() < 1e-4, "{isa:?} dot n={n}");
            let [[d0, d1, d2]] = dots(isa, &[&a, &c, &b], &[&b]);
            let [[e0], [e1]] = dots(isa, &[&b], &[&a, &b]);
            assert_eq!(e0, d0);
            assert!((e1 as f64 - d2 as f64).abs() < 1e-4);
            assert!((d0 as f64 - exact).abs() < 1e-4, "{isa:?} dots n={n}");
            let exact_cb: f64 = c.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((d1 as f64 - exact_cb).abs() < 1e-4);
            let exact_bb: f64 = b.iter().map(|x| *x as f64 * *x as f64).sum();
            assert!((d2 as f64 - exact_bb).abs() < 1e-4);
            let s: f64 = a.iter().map(|&x| x as f64).sum();
            assert!((sum(isa, &a) as f64 - s).abs() < 1e-4);
            let mut y = c.clone();
            axpy(isa, &mut y, 0.5, &a);
            for i in 0..n {
                assert!((y[i] - (c[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn attention_helpers_match_scalar_sums() {
    for isa in isas() {
        for d in [1, 7, 16, 64, 70, 128] {
            for nk in [1, 5, 16, 17, 40] {
                let q = data(d, 7);
                let keys: Vec<Vec<f32>> = (0..nk).map(|j| data(d + 3, 100 + j as u32)).collect();
                let refs: Vec<&[f32]> = keys.iter().map(|k| k.as_slice()).collect();
                let mut got = vec![f32::NAN; nk + 1];
                dot_keys(isa, &q, &refs, &mut got);
                for (j, k) in keys.iter().enumerate() {
                    let exact: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                    assert!((got[j] as f64 - exact).abs() < 1e-4, "{isa:?} dot_keys d={d} nk={nk} j={j}");
                }
                assert!(got[nk].is_nan(), "dot_keys wrote past its keys");

                for rows in [1, 3, 6, 7, 13] {
                    let stride = nk + 2;
                    let p = data(rows * stride, 9);
                    let mut out = data(rows * d + 1, 11);
                    let before = out.clone();
                    accumulate_rows(isa, &p, stride, rows, &refs, &mut out, d);
                    for r in 0..rows {
                        for i in 0..d {
                            let exact: f64 = before[r * d + i] as f64
                                + (0..nk).map(|j| p[r * stride + j] as f64 * keys[j][i] as f64).sum::<f64>();
                            assert!(
                                (out[r * d + i] as f64 - exact).abs() < 1e-4,
                                "{isa:?} accumulate_rows d={d} nk={nk} rows={rows}"
                            );
                        }
                    }
                    assert_eq!(out[rows * d], before[rows * d], "accumulate_rows wrote past its rows");
                }
            }
        }
        for n in [0, 1, 15, 16, 33] {
            let x: Vec<f32> = data(n, 5).iter().map(|v| v * 60.0).collect();
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(super::max(isa, &x), max, "{isa:?} max n={n}");
            let mut y = x.clone();
            let sum = exp_shifted(isa, &mut y, max);
            let exact: Vec<f64> = x.iter().map(|&v| (v as f64 - max as f64).exp()).collect();
            for (g, e) in y.iter().zip(&exact) {
                assert!((*g as f64 - e).abs() <= 1e-6 * e + 1e-30, "{isa:?} exp_shifted {g} vs {e}");
            }
            assert!((sum as f64 - exact.iter().sum::<f64>()).abs() <= 1e-5 * sum as f64, "{isa:?} exp sum");
        }
    }
}
