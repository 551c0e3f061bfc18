//! Every CPU op against the reference on seeded random shapes, for every instruction set the
//! machine has; and every op's size checks.

mod common;

use cleave_kernels::cpu::KvPool;
use cleave_kernels::quant::synthetic_blocks;
use cleave_kernels::{
    reference, rope_inv_freq, rope_table, AttnSeq, AttnShape, Backend, CacheDtype, HalfFormat, HalfMatrix, KernelError,
    QuantFormat, QuantMatrix, RopeScaling,
};
use common::{assert_close, backends, Rng};

/// Sentinel that fills the tail of output buffers longer than an op needs.
const SENTINEL: f32 = 12345.0;

fn padded(n: usize, pad: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.extend(std::iter::repeat_n(SENTINEL, pad));
    v
}

#[test]
fn linear_matches_reference() {
    let mut rng = Rng::new(1);
    for b in backends() {
        for &m in &[1, 2, 3, 5, 8, 9, 17, 40] {
            for &(k, n) in &[(1, 1), (7, 5), (16, 31), (33, 64), (100, 130), (256, 17)] {
                for with_bias in [false, true] {
                    let x = rng.vec(m * k);
                    let w = rng.vec(n * k);
                    let bias = with_bias.then(|| rng.vec(n));
                    let mut want = vec![0f32; m * n];
                    reference::linear(&x, &w, bias.as_deref(), m, k, n, &mut want).unwrap();
                    let mut got = padded(m * n, 3);
                    b.linear(&x, &w, bias.as_ref(), m, k, n, &mut got).unwrap();
                    assert_close(&got[..m * n], &want, 1e-5, 1e-5, &format!("{b:?} linear {m}x{k}x{n}"));
                    assert_eq!(&got[m * n..], &[SENTINEL; 3], "linear wrote past m*n");
                }
            }
        }
    }
}

#[test]
fn linear_large_paths_match_reference() {
    let mut rng = Rng::new(2);
    let b = &backends()[backends().len() - 1];
    for &(m, k, n) in &[(1, 1024, 700), (4, 576, 1536), (8, 333, 2049), (64, 200, 300)] {
        let x = rng.vec(m * k);
        let w = rng.vec(n * k);
        let mut want = vec![0f32; m * n];
        reference::linear(&x, &w, None, m, k, n, &mut want).unwrap();
        let mut got = vec![0f32; m * n];
        b.linear(&x, &w, None, m, k, n, &mut got).unwrap();
        assert_close(&got, &want, 1e-4, 1e-5, &format!("linear {m}x{k}x{n}"));
    }
}

#[test]
fn both_linear_kernels_match_reference_at_any_m() {
    let mut rng = Rng::new(8);
    for b in backends() {
        let kernels = [b.clone().with_skinny_max_m(usize::MAX), b.clone().with_skinny_max_m(0)];
        // Long k exercises the streaming kernel's k blocks; m > 8 its row groups.
        for &(m, k, n) in &[(1, 9000, 50), (13, 2500, 70), (8, 1030, 33), (20, 100, 3), (3, 17, 9)] {
            let x = rng.vec(m * k);
            let w = rng.vec(n * k);
            let bias = rng.vec(n);
            let mut want = vec![0f32; m * n];
            reference::linear(&x, &w, Some(&bias), m, k, n, &mut want).unwrap();
            for kernel in &kernels {
                let mut got = vec![0f32; m * n];
                kernel.linear(&x, &w, Some(&bias), m, k, n, &mut got).unwrap();
                assert_close(&got, &want, 1e-4, 1e-5, &format!("{kernel:?} linear {m}x{k}x{n}"));
            }
        }
    }
}

/// The prepared (packed-panel) linear against the reference on every ISA: every `m` from 1 to 70
/// (row tiles of 1..6 and every split of `m` into tiles), and `n`, `k` on both sides of the
/// panel width and the row-block size (so partial panels and several row blocks run).
#[test]
fn prepared_linear_matches_reference() {
    let mut rng = Rng::new(9);
    let shapes = [(1, 1), (5, 7), (17, 63), (64, 64), (33, 65), (130, 129), (300, 100), (9, 4000)];
    for b in backends() {
        for m in 1..=70 {
            let (k, n) = shapes[rng.below(shapes.len())];
            let with_bias = m % 2 == 0;
            let x = rng.vec(m * k);
            let w = rng.vec(n * k);
            let bias = with_bias.then(|| rng.vec(n));
            let mut want = vec![0f32; m * n];
            reference::linear(&x, &w, bias.as_deref(), m, k, n, &mut want).unwrap();
            let packed = b.prepare_linear(&w, n, k).unwrap();
            assert_eq!((packed.n(), packed.k()), (n, k));
            let mut got = padded(m * n, 3);
            b.linear_prepared(&x, &packed, bias.as_ref(), m, &mut got).unwrap();
            let what = format!("{b:?} prepared linear {m}x{k}x{n} bias {with_bias}");
            assert_close(&got[..m * n], &want, 1e-4, 1e-5, &what);
            assert_eq!(&got[m * n..], &[SENTINEL; 3], "{what} wrote past m*n");
        }
    }
}

/// A row's product does not depend on the rows beside it: every row of an `m`-row call equals,
/// bit for bit, the same row alone (`m = 1`), for f32 and 16-bit panels, on every ISA. The
/// kernels take the panel in strips of different widths by tile height (the whole panel row for
/// one row, half of it for two, 16 columns for more) and `kk` in blocks, but each output column
/// sums its products in `kk` order in every case, so a decode step's logits do not change with
/// the batch it runs in.
#[test]
fn a_prepared_row_is_the_same_alone_and_in_a_batch() {
    let mut rng = Rng::new(21);
    for b in backends() {
        for &(k, n) in &[(100, 130), (576, 67), (700, 64)] {
            let w = rng.vec(n * k);
            let f = b.prepare_linear(&w, n, k).unwrap();
            let h = b.prepare_linear_half(HalfMatrix::from_f32(HalfFormat::Bf16, &w, n, k).unwrap()).unwrap();
            for m in [2, 3, 4, 7, 8, 13, 16] {
                let x = rng.vec(m * k);
                for (name, lin) in [("f32", &f), ("bf16", &h)] {
                    let mut all = vec![0f32; m * n];
                    b.linear_prepared(&x, lin, None, m, &mut all).unwrap();
                    for r in 0..m {
                        let mut one = vec![0f32; n];
                        b.linear_prepared(&x[r * k..(r + 1) * k].to_vec(), lin, None, 1, &mut one).unwrap();
                        assert_eq!(one[..], all[r * n..(r + 1) * n], "{b:?} {name} {m}x{k}x{n}: row {r}");
                    }
                }
            }
        }
    }
}

/// Several prepared products of one `x` in one call (q/k/v, gate/up) against the reference.
#[test]
fn prepared_linear_many_matches_reference() {
    let mut rng = Rng::new(12);
    for b in backends() {
        for &(m, k) in &[(1, 33), (7, 64), (32, 100), (70, 17), (130, 300)] {
            let ns = [65, 1, 130];
            let x = rng.vec(m * k);
            let ws: Vec<Vec<f32>> = ns.iter().map(|&n| rng.vec(n * k)).collect();
            let biases = [Some(rng.vec(ns[0])), None, Some(rng.vec(ns[2]))];
            let packed: Vec<_> = ws.iter().zip(&ns).map(|(w, &n)| b.prepare_linear(w, n, k).unwrap()).collect();
            let pairs: Vec<_> = packed.iter().zip(&biases).map(|(w, bias)| (w, bias.as_ref())).collect();
            let mut outs: Vec<Vec<f32>> = ns.iter().map(|&n| padded(m * n, 2)).collect();
            let mut refs: Vec<&mut Vec<f32>> = outs.iter_mut().collect();
            b.linear_prepared_many(&x, &pairs, m, &mut refs).unwrap();
            for (i, &n) in ns.iter().enumerate() {
                let mut want = vec![0f32; m * n];
                reference::linear(&x, &ws[i], biases[i].as_deref(), m, k, n, &mut want).unwrap();
                let what = format!("{b:?} prepared linear many #{i} {m}x{k}x{n}");
                assert_close(&outs[i][..m * n], &want, 1e-4, 1e-5, &what);
                assert_eq!(&outs[i][m * n..], &[SENTINEL; 2], "{what} wrote past m*n");
            }
        }
    }
}

/// Prefill-sized products: many row blocks and tasks.
#[test]
fn prepared_linear_matches_reference_at_prefill_sizes() {
    let mut rng = Rng::new(10);
    for b in backends() {
        for &(m, k, n) in &[(200, 768, 70), (129, 2100, 65), (515, 40, 257)] {
            let x = rng.vec(m * k);
            let w = rng.vec(n * k);
            let bias = rng.vec(n);
            let mut want = vec![0f32; m * n];
            reference::linear(&x, &w, Some(&bias), m, k, n, &mut want).unwrap();
            let packed = b.prepare_linear(&w, n, k).unwrap();
            let mut got = vec![0f32; m * n];
            b.linear_prepared(&x, &packed, Some(&bias), m, &mut got).unwrap();
            assert_close(&got, &want, 1e-4, 1e-5, &format!("{b:?} prepared linear {m}x{k}x{n}"));
        }
    }
}

#[test]
fn prepared_embedding_matches_reference() {
    let mut rng = Rng::new(11);
    let b = &backends()[0];
    for &(vocab, dim) in &[(1, 1), (70, 9), (200, 130)] {
        let table = rng.vec(vocab * dim);
        let ids: Vec<u32> = (0..40).map(|_| rng.below(vocab) as u32).collect();
        let mut want = vec![0f32; ids.len() * dim];
        reference::embedding(&table, &ids, vocab, dim, &mut want).unwrap();
        let packed = b.prepare_linear(&table, vocab, dim).unwrap();
        let mut got = padded(ids.len() * dim, 2);
        b.embedding_prepared(&packed, &ids, &mut got).unwrap();
        assert_eq!(&got[..ids.len() * dim], &want[..], "{vocab}x{dim}");
        assert_eq!(&got[ids.len() * dim..], &[SENTINEL; 2]);
    }
}

/// Quantized weights through the backend (every ISA): `linear_prepared` alone and mixed with an
/// f32 weight in one `linear_prepared_many`, and `embedding_prepared` from a quantized table, all
/// against the reference on the dequantized weight. The tolerance covers the 8-bit rounding of
/// the activations in the integer kernels (`m <= QuantIsa::max_m`): 1% of the sum of the terms'
/// magnitudes is far above it for these sizes and far below any layout error; the kernels' own
/// tests (`cpu::quant::tests`) check every format and path against the exact bound.
#[test]
fn quantized_linear_and_embedding_match_reference() {
    let mut rng = Rng::new(13);
    for b in backends() {
        for format in QuantFormat::ALL {
            let k = 2 * format.block_values();
            for &(m, n) in &[(1, 3), (6, 70), (40, 9)] {
                let w =
                    QuantMatrix::new(format, n, k, synthetic_blocks(format, n * k / format.block_values(), 5)).unwrap();
                let wf = w.to_f32();
                let x = rng.vec(m * k);
                let bias = rng.vec(n);
                let (fw, fbias) = (rng.vec(n * k), rng.vec(n));
                let q = b.prepare_linear_quantized(w.clone()).unwrap();
                let f = b.prepare_linear(&fw, n, k).unwrap();
                let (mut o1, mut o2) = (padded(m * n, 2), padded(m * n, 2));
                b.linear_prepared_many(&x, &[(&q, Some(&bias)), (&f, Some(&fbias))], m, &mut [&mut o1, &mut o2])
                    .unwrap();
                let mut want = vec![0f32; m * n];
                reference::linear(&x, &wf, Some(&bias), m, k, n, &mut want).unwrap();
                let mag: Vec<f32> = (0..m * n)
                    .map(|i| (0..k).map(|p| (x[i / n * k + p] * wf[i % n * k + p]).abs()).sum::<f32>())
                    .collect();
                let what = format!("{b:?} {format} {m}x{k}x{n}");
                for (i, (&g, &w)) in o1.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 0.01 * mag[i] + 1e-5, "{what}: output {i}: got {g}, want {w}");
                }
                assert_eq!(&o1[m * n..], &[SENTINEL; 2], "{what} wrote past m*n");
                reference::linear(&x, &fw, Some(&fbias), m, k, n, &mut want).unwrap();
                assert_close(&o2[..m * n], &want, 1e-4, 1e-5, &format!("{what}: the f32 weight beside it"));
                let mut alone = padded(m * n, 0);
                b.linear_prepared(&x, &q, Some(&bias), m, &mut alone).unwrap();
                assert_eq!(alone, o1[..m * n], "{what}: alone and with another weight");

                let ids: Vec<u32> = (0..7).map(|_| rng.below(n) as u32).collect();
                let mut got = padded(ids.len() * k, 2);
                b.embedding_prepared(&q, &ids, &mut got).unwrap();
                let mut want = vec![0f32; ids.len() * k];
                reference::embedding(&wf, &ids, n, k, &mut want).unwrap();
                assert_eq!(&got[..ids.len() * k], &want[..], "{what}: embedding");
                assert_eq!(&got[ids.len() * k..], &[SENTINEL; 2]);
                assert!(is_shape(b.embedding_prepared(&q, &[n as u32], &mut got)), "row out of range");
                assert!(is_shape(b.linear_prepared(&x, &q, None, m + 1, &mut o1)), "x too short");
            }
        }
    }
}

/// 16-bit weights through the backend (every ISA, f16 and bf16): for every `m` from 1 to 70 (the
/// in-register path for one or two row tiles, the widened-panel path above) and shapes that are
/// not multiples of the panel width, `linear_prepared` equals the f32 weight of the widened values
/// bit for bit (same products, same order: the kernel's claim), alone and beside another weight in
/// one `linear_prepared_many`, and matches the reference; the tied-embedding lookup returns the
/// widened rows; a decode step reads 2 bytes per value.
#[test]
fn half_linear_equals_the_f32_weight_it_widens_to() {
    let mut rng = Rng::new(17);
    for b in backends() {
        for format in [HalfFormat::F16, HalfFormat::Bf16] {
            for &(k, n) in &[(1, 1), (7, 5), (33, 64), (100, 130), (576, 67)] {
                let w = HalfMatrix::from_f32(format, &rng.vec(n * k), n, k).unwrap();
                let wf = w.to_f32();
                let h = b.prepare_linear_half(w.clone()).unwrap();
                let f = b.prepare_linear(&wf, n, k).unwrap();
                let info = b.linear_info(&h);
                assert_eq!((info.n, info.k, info.bytes, info.format), (n, k, 2 * n * k, format.name()));
                for m in (1..=14).chain([17, 31, 40, 70]) {
                    let what = format!("{b:?} {format} {m}x{k}x{n}");
                    let x = rng.vec(m * k);
                    let bias = rng.vec(n);
                    let (mut got, mut other, mut want) = (padded(m * n, 2), padded(m * n, 0), vec![0f32; m * n]);
                    b.linear_prepared_many(&x, &[(&h, Some(&bias)), (&f, None)], m, &mut [&mut got, &mut other])
                        .unwrap();
                    b.linear_prepared(&x, &f, Some(&bias), m, &mut want).unwrap();
                    assert_eq!(got[..m * n], want[..], "{what}: against the widened f32 weight");
                    assert_eq!(&got[m * n..], &[SENTINEL; 2], "{what} wrote past m*n");
                    let mut alone = vec![0f32; m * n];
                    b.linear_prepared(&x, &h, Some(&bias), m, &mut alone).unwrap();
                    assert_eq!(alone, got[..m * n], "{what}: alone and with another weight");
                    reference::linear(&x, &wf, Some(&bias), m, k, n, &mut want).unwrap();
                    assert_close(&got[..m * n], &want, 1e-4, 1e-5, &format!("{what}: reference"));
                }
                let ids: Vec<u32> = (0..5).map(|_| rng.below(n) as u32).collect();
                let mut got = padded(ids.len() * k, 2);
                b.embedding_prepared(&h, &ids, &mut got).unwrap();
                let mut want = vec![0f32; ids.len() * k];
                reference::embedding(&wf, &ids, n, k, &mut want).unwrap();
                assert_eq!(&got[..ids.len() * k], &want[..], "{b:?} {format}: embedding");
                assert!(is_shape(b.embedding_prepared(&h, &[n as u32], &mut got)), "row out of range");
            }
        }
    }
    assert!(HalfMatrix::new(HalfFormat::Bf16, 3, 4, vec![0; 11]).is_err(), "a short tensor is refused");
}

#[test]
fn rms_norm_matches_reference() {
    let mut rng = Rng::new(3);
    for b in backends() {
        for &(rows, dim) in &[(1, 1), (3, 64), (5, 576), (80, 1024)] {
            let x = rng.vec(rows * dim);
            let g = rng.vec(dim);
            let mut want = vec![0f32; rows * dim];
            reference::rms_norm(&x, &g, 1e-5, rows, dim, &mut want).unwrap();
            let mut got = padded(rows * dim, 2);
            b.rms_norm(&x, &g, 1e-5, rows, dim, &mut got).unwrap();
            assert_close(&got[..rows * dim], &want, 1e-6, 1e-6, "rms_norm");
            assert_eq!(&got[rows * dim..], &[SENTINEL; 2]);
        }
    }
}

#[test]
fn rope_is_bit_identical_to_reference() {
    let mut rng = Rng::new(4);
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };
    for b in backends() {
        for &(tokens, heads, hd) in &[(1, 1, 2), (3, 4, 16), (7, 9, 64), (300, 4, 64)] {
            let table = rope_table(&rope_inv_freq(hd, 10000.0, &scaling), 512);
            let positions: Vec<u32> = (0..tokens).map(|_| rng.below(512) as u32).collect();
            let x = rng.vec(tokens * heads * hd);
            let mut want = x.clone();
            reference::rope(&mut want, &positions, heads, hd, &table).unwrap();
            let mut got = x.clone();
            b.rope(&mut got, &positions, heads, hd, &table).unwrap();
            assert_eq!(got, want);
        }
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let mut rng = Rng::new(5);
    for b in backends() {
        for &len in &[0, 1, 17, 4096, 100_003] {
            let (gate, up) = (rng.vec(len), rng.vec(len));
            let mut want = vec![0f32; len];
            reference::silu_mul(&gate, &up, len, &mut want).unwrap();
            let mut got = padded(len, 1);
            b.silu_mul(&gate, &up, len, &mut got).unwrap();
            // The SIMD exponential is within a few ulp of the scalar one.
            for (i, (&g, &w)) in got[..len].iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 8.0 * f32::EPSILON * w.abs().max(1e-30),
                    "{}: silu_mul[{i}] {g} vs {w}",
                    b.name()
                );
            }
            assert_eq!(got[len], SENTINEL);

            // Gates where the exponential saturates or vanishes, on a length with a tail.
            let extreme: Vec<f32> =
                [-200.0, -103.5, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.0, 88.5, 103.5, 200.0]
                    .into_iter()
                    .cycle()
                    .take(19)
                    .collect();
            let ones = vec![1f32; extreme.len()];
            let mut want = vec![0f32; extreme.len()];
            reference::silu_mul(&extreme, &ones, extreme.len(), &mut want).unwrap();
            let mut got = vec![0f32; extreme.len()];
            b.silu_mul(&extreme, &ones, extreme.len(), &mut got).unwrap();
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.is_finite() && (g - w).abs() <= 8.0 * f32::EPSILON * w.abs().max(1e-30),
                    "{}: silu_mul({}) {g} vs {w}",
                    b.name(),
                    extreme[i]
                );
            }

            let mut want = gate.clone();
            reference::add_assign(&mut want, &up, len).unwrap();
            let mut got = gate.clone();
            b.add_assign(&mut got, &up, len).unwrap();
            assert_eq!(got, want);
        }
    }
}

#[test]
fn softmax_matches_reference() {
    let mut rng = Rng::new(6);
    for b in backends() {
        for &(rows, dim) in &[(1, 1), (2, 10), (3, 49152), (40, 1000)] {
            let x: Vec<f32> = rng.vec(rows * dim).iter().map(|v| v * 20.0).collect();
            let mut want = x.clone();
            reference::softmax(&mut want, rows, dim).unwrap();
            let mut got = x.clone();
            b.softmax(&mut got, rows, dim).unwrap();
            assert_close(&got, &want, 1e-7, 1e-5, "softmax");
        }
    }
}

#[test]
fn embedding_gather_and_write_kv_match_reference() {
    let mut rng = Rng::new(7);
    let b = &backends()[0];
    let (vocab, dim) = (50, 24);
    let table = rng.vec(vocab * dim);
    let ids: Vec<u32> = (0..2000).map(|_| rng.below(vocab) as u32).collect();
    let mut want = vec![0f32; ids.len() * dim];
    reference::embedding(&table, &ids, vocab, dim, &mut want).unwrap();
    let mut got = vec![0f32; ids.len() * dim];
    b.embedding(&table, &ids, vocab, dim, &mut got).unwrap();
    assert_eq!(got, want);

    let rows = [3u32, 0, 49, 3];
    let mut want = vec![0f32; rows.len() * dim];
    reference::gather_rows(&table, &rows, dim, &mut want).unwrap();
    let mut got = vec![0f32; rows.len() * dim];
    b.gather_rows(&table, &rows, dim, &mut got).unwrap();
    assert_eq!(got, want);
    assert_eq!(&got[dim..2 * dim], &table[..dim]);

    let kv_width = 12;
    let slots = [5u32, 0, 9];
    let (k, v) = (rng.vec(3 * kv_width), rng.vec(3 * kv_width));
    let (mut kc, mut vc) = (KvPool::from(vec![0f32; 10 * kv_width]), KvPool::from(vec![0f32; 10 * kv_width]));
    b.write_kv(&k, &v, &slots, kv_width, &mut kc, &mut vc).unwrap();
    assert_eq!(kc.to_f32(5 * kv_width, kv_width).unwrap(), &k[..kv_width]);
    assert_eq!(vc.to_f32(9 * kv_width, kv_width).unwrap(), &v[2 * kv_width..]);
}

/// Values that exercise rounding: random ones, ties at both parities in both formats, f16
/// subnormals and overflow, infinities and NaN.
fn rounding_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    let special = [
        1.0 + 1.0 / 2048.0, // f16 tie, rounds down to even
        1.0 + 3.0 / 2048.0, // f16 tie, rounds up to even
        1.0 + 1.0 / 256.0,  // bf16 tie, down
        1.0 + 3.0 / 256.0,  // bf16 tie, up
        -3.0e-6,            // f16 subnormal
        70000.0,            // f16 overflow
        f32::MAX,           // bf16 overflow when rounded up
        f32::INFINITY,
        f32::NAN,
        0.0,
        -0.0,
    ];
    (0..n).map(|i| if i % 7 == 3 { special[(i / 7) % special.len()] } else { rng.f32() * 100.0 }).collect()
}

#[test]
fn write_kv_rounds_like_the_reference_on_every_isa_and_dtype() {
    let mut rng = Rng::new(8);
    for b in backends() {
        for dtype in [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16] {
            for kv_width in [1, 3, 12, 17, 64, 100] {
                let slots = [5u32, 0, 9, 2];
                let (k, v) = (rounding_values(&mut rng, 4 * kv_width), rounding_values(&mut rng, 4 * kv_width));
                let background = rng.vec(10 * kv_width);
                let (mut want_k, mut want_v) = (background.clone(), background.clone());
                reference::write_kv(&k, &v, &slots, kv_width, &mut want_k, &mut want_v).unwrap();
                let mut kc = b.alloc_kv(dtype, 10 * kv_width).unwrap();
                let mut vc = b.alloc_kv(dtype, 10 * kv_width).unwrap();
                assert_eq!(b.kv_info(&kc), (dtype, 10 * kv_width));
                let bg = reference::kv_encode(dtype, &background);
                b.write_kv_bytes(&mut kc, 0, &bg).unwrap();
                b.write_kv_bytes(&mut vc, 0, &bg).unwrap();
                b.write_kv(&k, &v, &slots, kv_width, &mut kc, &mut vc).unwrap();
                for (pool, want, what) in [(&kc, &want_k, "k"), (&vc, &want_v, "v")] {
                    let mut got = Vec::new();
                    b.read_kv_bytes(pool, 0, want.len(), &mut got).unwrap();
                    let want = reference::kv_encode(dtype, want);
                    // NaN payloads may differ between the crate and the hardware; NaN-ness may not.
                    let (g, w) = (reference::kv_decode(dtype, &got), reference::kv_decode(dtype, &want));
                    for (i, (x, y)) in g.iter().zip(&w).enumerate() {
                        assert!(
                            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                            "{b:?} {} width {kv_width} {what}[{i}]: {x} vs {y}",
                            dtype.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn kv_bytes_round_trip_and_copy_within_a_pool() {
    let mut rng = Rng::new(9);
    let b = &backends()[0];
    for dtype in [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16] {
        let x = rng.vec(40);
        let mut p = b.alloc_kv(dtype, 50).unwrap();
        b.write_kv_bytes(&mut p, 10, &reference::kv_encode(dtype, &x)).unwrap();
        let mut bytes = Vec::new();
        b.read_kv_bytes(&p, 10, 40, &mut bytes).unwrap();
        assert_eq!(bytes.len(), 40 * dtype.size_bytes());
        assert_eq!(bytes, reference::kv_encode(dtype, &x));
        b.copy_kv(&mut p, 10, 0, 10).unwrap();
        let mut head = Vec::new();
        b.read_kv_bytes(&p, 0, 10, &mut head).unwrap();
        assert_eq!(head, bytes[..10 * dtype.size_bytes()]);
        let want: Vec<f32> = x.iter().map(|&v| reference::kv_round(dtype, v)).collect();
        assert_eq!(p.to_f32(10, 40).unwrap(), want);
    }
}

fn is_shape<T: std::fmt::Debug>(r: Result<T, KernelError>) -> bool {
    matches!(r, Err(KernelError::Shape { .. }))
}

#[test]
fn bad_sizes_are_shape_errors() {
    let b = &backends()[0];
    let v = |n: usize| vec![1f32; n];
    let mut out = v(4);
    assert!(is_shape(b.linear(&v(5), &v(6), None, 2, 3, 2, &mut out)));
    assert!(is_shape(b.linear(&v(6), &v(6), Some(&v(1)), 2, 3, 2, &mut out)));
    assert!(is_shape(b.linear(&v(6), &v(6), None, 2, 3, 2, &mut v(3))));
    assert!(is_shape(b.linear(&v(6), &v(6), None, usize::MAX, 3, 2, &mut out)));
    assert!(is_shape(b.prepare_linear(&v(5), 2, 3)), "weight too short");
    let w = b.prepare_linear(&v(6), 2, 3).unwrap();
    assert!(is_shape(b.linear_prepared(&v(5), &w, None, 2, &mut out)));
    assert!(is_shape(b.linear_prepared(&v(6), &w, Some(&v(1)), 2, &mut out)));
    assert!(is_shape(b.linear_prepared(&v(6), &w, None, 2, &mut v(3))));
    assert!(is_shape(b.linear_prepared(&v(6), &w, None, usize::MAX, &mut out)));
    assert!(is_shape(b.embedding_prepared(&w, &[2], &mut out)), "row out of range");
    let w4 = b.prepare_linear(&v(8), 2, 4).unwrap();
    let (mut o1, mut o2) = (v(4), v(4));
    assert!(
        is_shape(b.linear_prepared_many(&v(8), &[(&w, None), (&w4, None)], 2, &mut [&mut o1, &mut o2])),
        "k differs"
    );
    assert!(is_shape(b.linear_prepared_many(&v(6), &[(&w, None)], 2, &mut [&mut o1, &mut o2])), "count differs");
    assert!(is_shape(b.linear_prepared_many(&v(6), &[(&w, None), (&w, None)], 2, &mut [&mut o1, &mut v(3)])));
    assert_eq!((o1, o2), (v(4), v(4)), "a rejected call must not write");
    assert_eq!(out, v(4), "a rejected call must not write");
    assert!(is_shape(b.rms_norm(&v(4), &v(1), 1e-5, 2, 2, &mut out)));
    assert!(is_shape(b.rope(&mut v(4), &[0], 1, 3, &v(6))), "odd head_dim");
    assert!(is_shape(b.rope(&mut v(4), &[2], 1, 4, &v(8))), "position beyond table");
    assert!(is_shape(b.rope(&mut v(4), &[0, 0], 1, 4, &v(8))), "x too short");
    assert!(is_shape(b.silu_mul(&v(3), &v(4), 4, &mut out)));
    assert!(is_shape(b.add_assign(&mut v(3), &v(4), 4)));
    assert!(is_shape(b.softmax(&mut v(3), 2, 2)));
    assert!(is_shape(b.embedding(&v(8), &[4], 4, 2, &mut out)), "token id out of range");
    assert!(is_shape(b.embedding(&v(7), &[0], 4, 2, &mut out)), "table too short");
    assert!(is_shape(b.gather_rows(&v(8), &[4], 2, &mut out)));
    let p = |n: usize| KvPool::from(v(n));
    assert!(is_shape(b.write_kv(&v(4), &v(4), &[0, 2], 2, &mut p(4), &mut p(4))), "slot beyond cache");
    assert!(is_shape(b.write_kv(&v(4), &v(3), &[0, 1], 2, &mut p(4), &mut p(4))));
    let mut half = b.alloc_kv(CacheDtype::F16, 4).unwrap();
    assert!(is_shape(b.write_kv(&v(4), &v(4), &[0, 1], 2, &mut p(4), &mut half)), "k and v pools differ in dtype");
    assert!(is_shape(b.write_kv_bytes(&mut half, 0, &[0; 3])), "not whole elements");
    assert!(is_shape(b.write_kv_bytes(&mut half, 3, &[0; 4])), "past the pool");
    assert!(is_shape(b.read_kv_bytes(&half, 2, 3, &mut Vec::new())));
    assert!(is_shape(b.copy_kv(&mut half, 0, 1, 2)), "overlapping copy");
    assert!(is_shape(b.copy_kv(&mut half, 0, 3, 2)));
    assert!(is_shape(b.copy(&v(4), 2, &mut out, 0, 3)));
    assert!(is_shape(b.copy(&v(4), 0, &mut out, usize::MAX, 3)));
    assert!(is_shape(b.write(&mut out, 3, &[1.0, 2.0])));
    assert!(is_shape(b.read(&out, 5, 0)));
}

#[test]
fn bad_attention_calls_are_shape_errors() {
    let b = &backends()[0];
    let shape = AttnShape { num_heads: 2, num_kv_heads: 1, head_dim: 4, block_size: 2, scale: 0.5 };
    // Cache of 3 blocks of 2 tokens x 1 kv head x 4.
    let host = vec![0f32; 3 * 2 * 4];
    let cache = KvPool::from(host.clone());
    let q = vec![0f32; 4 * 8];
    let mut out = vec![0f32; 4 * 8];
    let ok = AttnSeq { q_start: 0, q_len: 2, context_len: 5, block_table: &[2, 0, 1] };
    b.paged_attention(&q, &cache, &cache, &[ok], shape, &mut out).unwrap();
    let bad = [
        AttnSeq { block_table: &[2, 0, 3], ..ok },
        AttnSeq { block_table: &[2, 0], ..ok },
        AttnSeq { q_len: 6, context_len: 5, ..ok },
        AttnSeq { q_start: 3, ..ok },
    ];
    for s in bad {
        assert!(is_shape(b.paged_attention(&q, &cache, &cache, &[s], shape, &mut out)), "{s:?}");
        assert!(is_shape(reference::paged_attention(&q, &host, &host, &[s], shape, &mut out)), "{s:?}");
    }
    let overlap = [ok, AttnSeq { q_start: 1, ..ok }];
    assert!(is_shape(b.paged_attention(&q, &cache, &cache, &overlap, shape, &mut out)));
    let three_heads = AttnShape { num_heads: 3, num_kv_heads: 2, ..shape };
    assert!(is_shape(b.paged_attention(&q, &cache, &cache, &[ok], three_heads, &mut out)));
    let zero = AttnShape { block_size: 0, ..shape };
    assert!(is_shape(b.paged_attention(&q, &cache, &cache, &[ok], zero, &mut out)));
    let bf16 = b.alloc_kv(CacheDtype::Bf16, host.len()).unwrap();
    assert!(is_shape(b.paged_attention(&q, &cache, &bf16, &[ok], shape, &mut out)), "k and v pools differ in dtype");
}
