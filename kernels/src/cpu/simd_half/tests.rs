//! The software conversions against the `half` crate (exhaustively over f16/bf16 values and
//! their rounding boundaries), and every ISA's kernels against them and against f64 sums.
use super::*;
use half::{bf16, f16};

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            v.push(Isa::Avx2Fma);
        }
        if is_x86_feature_detected!("avx512f") {
            v.push(Isa::Avx512);
        }
    }
    v
}

/// Both NaN, or the same bits.
fn same(a: u16, b: u16, bf: bool) -> bool {
    let nan = |h: u16| if bf { bf16::from_bits(h).is_nan() } else { f16::from_bits(h).is_nan() };
    a == b || (nan(a) && nan(b))
}

/// f32 values around every rounding boundary of the 16-bit format: each representable value, the
/// points halfway to its neighbour, and one f32 ulp either side of those.
fn boundary_values(bf: bool) -> Vec<f32> {
    let mut out = Vec::new();
    for h in 0..=u16::MAX {
        let (x, next) = if bf {
            (bf16::from_bits(h).to_f32(), bf16::from_bits(h.wrapping_add(1)).to_f32())
        } else {
            (f16::from_bits(h).to_f32(), f16::from_bits(h.wrapping_add(1)).to_f32())
        };
        out.push(x);
        if x.is_finite() && next.is_finite() && (x.is_sign_negative() == next.is_sign_negative()) {
            let mid = ((x as f64 + next as f64) / 2.0) as f32;
            out.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
        }
    }
    // Beyond the 16-bit range, f32 subnormals, and NaNs with payloads.
    out.extend([f32::MAX, -f32::MAX, 65520.0, 65519.99, 1e-8, -1e-8, 1e-40, f32::MIN_POSITIVE]);
    out.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffc1_2345)]);
    out
}

#[test]
fn software_widening_matches_the_half_crate_for_every_value() {
    for h in 0..=u16::MAX {
        let (a, b) = (portable::widen::<false>(h), f16::from_bits(h).to_f32());
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "f16 {h:#06x}: {a} vs {b}");
        let (a, b) = (portable::widen::<true>(h), bf16::from_bits(h).to_f32());
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "bf16 {h:#06x}: {a} vs {b}");
    }
}

#[test]
fn software_rounding_matches_the_half_crate_at_every_boundary() {
    for x in boundary_values(false) {
        let (a, b) = (portable::narrow::<false>(x), f16::from_f32(x).to_bits());
        assert!(same(a, b, false), "f16 of {x:e} ({:#010x}): {a:#06x} vs {b:#06x}", x.to_bits());
    }
    for x in boundary_values(true) {
        let (a, b) = (portable::narrow::<true>(x), bf16::from_f32(x).to_bits());
        assert!(same(a, b, true), "bf16 of {x:e} ({:#010x}): {a:#06x} vs {b:#06x}", x.to_bits());
    }
}

fn check_conversions<const BF: bool>(isa: Isa, values: &[f32]) {
    // Lengths that are not multiples of 8 or 16, at offsets that leave the slices unaligned.
    for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100] {
        for (c, chunk) in values.chunks(n.max(1)).take(4000).enumerate() {
            let src = &chunk[..n.min(chunk.len())];
            let mut got = vec![0xdeadu16; src.len() + 1];
            from_f32::<BF>(isa, src, &mut got[1..]);
            for (i, (&g, &x)) in got[1..].iter().zip(src).enumerate() {
                let want = portable::narrow::<BF>(x);
                assert!(same(g, want, BF), "{isa:?} bf={BF} n={n} chunk {c} [{i}] {x:e}: {g:#06x} vs {want:#06x}");
            }
            assert_eq!(got[0], 0xdead, "{isa:?}: wrote before the slice");
            let mut back = vec![-7f32; src.len() + 1];
            to_f32::<BF>(isa, &got[1..], &mut back[..src.len()]);
            for (i, (&b, &h)) in back.iter().zip(&got[1..]).enumerate() {
                let want = portable::widen::<BF>(h);
                assert!(b.to_bits() == want.to_bits() || (b.is_nan() && want.is_nan()), "{isa:?} widen [{i}]");
            }
            assert_eq!(back[src.len()], -7.0, "{isa:?}: wrote past the slice");
        }
    }
}

#[test]
fn every_isa_converts_like_the_software_path() {
    for isa in isas() {
        check_conversions::<false>(isa, &boundary_values(false));
        check_conversions::<true>(isa, &boundary_values(true));
    }
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 16) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

fn narrow_all<const BF: bool>(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| portable::narrow::<BF>(v)).collect()
}

fn check_attention_helpers<const BF: bool>(isa: Isa) {
    for d in [1, 7, 8, 9, 16, 17, 64, 70, 128] {
        for nk in [1, 3, 5, 16, 17, 40] {
            let q = data(d, 7);
            let keys: Vec<Vec<u16>> = (0..nk).map(|j| narrow_all::<BF>(&data(d + 3, 100 + j as u32))).collect();
            let refs: Vec<&[u16]> = keys.iter().map(|k| k.as_slice()).collect();
            let mut got = vec![f32::NAN; nk + 1];
            dot_keys::<BF>(isa, &q, &refs, &mut got);
            for (j, k) in keys.iter().enumerate() {
                let exact: f64 = q.iter().zip(k).map(|(&a, &h)| a as f64 * portable::widen::<BF>(h) as f64).sum();
                assert!((got[j] as f64 - exact).abs() < 1e-4, "{isa:?} bf={BF} dot_keys d={d} nk={nk} key {j}");
            }
            assert!(got[nk].is_nan(), "{isa:?}: wrote past the keys");

            for rows in [1, 2, 5, 6, 7, 13] {
                let stride = nk + 2;
                let p = data(rows * stride, 11);
                let init = data(rows * d, 13);
                let mut out = init.clone();
                out.push(99.0);
                accumulate_rows::<BF>(isa, &p, stride, rows, &refs, &mut out, d);
                for r in 0..rows {
                    for c in 0..d {
                        let exact: f64 = init[r * d + c] as f64
                            + (0..nk)
                                .map(|j| p[r * stride + j] as f64 * portable::widen::<BF>(keys[j][c]) as f64)
                                .sum::<f64>();
                        let g = out[r * d + c] as f64;
                        assert!(
                            (g - exact).abs() < 1e-4,
                            "{isa:?} bf={BF} accumulate d={d} nk={nk} rows={rows} ({r}, {c})"
                        );
                    }
                }
                assert_eq!(out[rows * d], 99.0, "{isa:?}: wrote past the rows");
            }
        }
    }
}

#[test]
fn every_isa_attention_helpers_match_f64_sums_of_the_widened_values() {
    for isa in isas() {
        check_attention_helpers::<false>(isa);
        check_attention_helpers::<true>(isa);
    }
}
