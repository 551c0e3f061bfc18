//! Dequantization checked against tiny quantizers written here (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
//! round trips) and against K-quant blocks packed from logical values with ggml's
//! quantizer-side packing.

use super::*;

/// Dequantizes whole blocks into a new vector.
fn dequant(format: QuantFormat, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / format.block_bytes() * format.block_values()];
    dequantize(format, bytes, &mut out).unwrap();
    out
}

/// Deterministic values in [-scale, scale) (xorshift; no dependency, no global state).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

fn r16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = r16(amax / 127.0);
        out.extend(h(d));
        for v in blk {
            let q = if d == 0.0 { 0.0 } else { (v / d).round() };
            out.push(q.clamp(-127.0, 127.0) as i8 as u8);
        }
    }
    out
}

fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks(32) {
        // ggml: the value of largest magnitude, with its sign, maps to -8.
        let max = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
        let d = r16(max / -8.0);
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
        out.extend(h(d));
        for j in 0..16 {
            out.push(q(blk[j]) | (q(blk[j + 16]) << 4));
        }
    }
    out
}

fn quantize_q4_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks(32) {
        let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
        let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (d, m) = (r16((max - min) / 15.0), r16(min));
        let q = |v: f32| (((v - m) / d).round() as i32).clamp(0, 15) as u8;
        out.extend(h(d));
        out.extend(h(m));
        for j in 0..16 {
            out.push(q(blk[j]) | (q(blk[j + 16]) << 4));
        }
    }
    out
}

/// ggml-style Q5_0 (`with_min` false: d * (0..31 - 16)) or Q5_1 (`with_min`: d * 0..31 + m) quantizer.
fn quantize_q5(x: &[f32], with_min: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks(32) {
        let (d, m) = if with_min {
            let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
            let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (r16((max - min) / 31.0), r16(min))
        } else {
            let max = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
            (r16(max / -16.0), 0.0)
        };
        let q: Vec<u32> = blk
            .iter()
            .map(|&v| {
                let q = if d == 0.0 { 0.0 } else { ((v - m) / d).round() };
                (q + if with_min { 0.0 } else { 16.0 }).clamp(0.0, 31.0) as u32
            })
            .collect();
        out.extend(h(d));
        if with_min {
            out.extend(h(m));
        }
        let qh = q.iter().enumerate().fold(0u32, |acc, (j, &v)| acc | ((v >> 4) << j));
        out.extend(qh.to_le_bytes());
        for j in 0..16 {
            out.push((q[j] & 0x0F) as u8 | (((q[j + 16] & 0x0F) as u8) << 4));
        }
    }
    out
}

/// Largest |a - b| over the block of `i`, relative to the bound `tol(block)`.
fn assert_round_trip(x: &[f32], y: &[f32], tol: impl Fn(&[f32]) -> f32) {
    assert_eq!(x.len(), y.len());
    for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
        let t = tol(bx);
        for (a, b) in bx.iter().zip(by) {
            assert!((a - b).abs() <= t, "{a} vs {b} (tolerance {t})");
        }
    }
}

fn amax(b: &[f32]) -> f32 {
    b.iter().fold(0f32, |a, v| a.max(v.abs()))
}

#[test]
fn q8_0_round_trip() {
    let x = values(32 * 40, 1, 3.0);
    let y = dequant(QuantFormat::Q8_0, &quantize_q8_0(&x));
    // Half a quantization step, plus f16 rounding of the scale over 127 steps.
    assert_round_trip(&x, &y, |b| amax(b) / 127.0 * 0.5 + amax(b) * 1e-3);
}

#[test]
fn q4_0_round_trip_and_hand_block() {
    let x = values(32 * 40, 2, 1.5);
    let y = dequant(QuantFormat::Q4_0, &quantize_q4_0(&x));
    // The extreme value maps to -8 exactly; its opposite would need +8 and clamps to 7: one step.
    assert_round_trip(&x, &y, |b| amax(b) / 8.0 * 1.01);

    // d = 0.5; byte 0 = 0x3A: value 0 is 0.5 * (10 - 8) = 1, value 16 is 0.5 * (3 - 8) = -2.5.
    let mut blk = h(0.5).to_vec();
    blk.extend([0x3A]);
    blk.extend([0x88; 15]);
    let y = dequant(QuantFormat::Q4_0, &blk);
    assert_eq!((y[0], y[16], y[1], y[31]), (1.0, -2.5, 0.0, 0.0));
}

#[test]
fn q4_1_round_trip_and_hand_block() {
    let x: Vec<f32> = values(32 * 40, 3, 2.0).iter().map(|v| v + 0.7).collect();
    let y = dequant(QuantFormat::Q4_1, &quantize_q4_1(&x));
    assert_round_trip(&x, &y, |b| {
        let min = b.iter().copied().fold(f32::INFINITY, f32::min);
        let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        (max - min) / 15.0 * 0.5 + (max.abs() + min.abs()) * 2e-3
    });

    // d = 0.25, m = -1; byte 5 = 0xF1: value 5 is 0.25 * 1 - 1, value 21 is 0.25 * 15 - 1.
    let mut blk = h(0.25).to_vec();
    blk.extend(h(-1.0));
    let mut qs = [0u8; 16];
    qs[5] = 0xF1;
    blk.extend(qs);
    let y = dequant(QuantFormat::Q4_1, &blk);
    assert_eq!((y[5], y[21], y[0]), (-0.75, 2.75, -1.0));
}

#[test]
fn q5_0_and_q5_1_round_trip() {
    let x = values(32 * 40, 4, 2.0);
    let y = dequant(QuantFormat::Q5_0, &quantize_q5(&x, false));
    assert_round_trip(&x, &y, |b| amax(b) / 16.0 * 1.01);
    let x: Vec<f32> = x.iter().map(|v| v - 0.4).collect();
    let y = dequant(QuantFormat::Q5_1, &quantize_q5(&x, true));
    assert_round_trip(&x, &y, |b| {
        let min = b.iter().copied().fold(f32::INFINITY, f32::min);
        let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        (max - min) / 31.0 * 0.5 + (max.abs() + min.abs()) * 2e-3
    });
    // By hand: Q5_0 with d = 1, qh bit 16 set, qs[0] = 0x2F: value 0 is 15 - 16, value 16 is
    // (2 | 16) - 16.
    let mut blk = h(1.0).to_vec();
    blk.extend((1u32 << 16).to_le_bytes());
    blk.push(0x2F);
    blk.extend([0u8; 15]);
    let y = dequant(QuantFormat::Q5_0, &blk);
    assert_eq!((y[0], y[16], y[1]), (-1.0, 2.0, -16.0));
}

/// ggml's `quantize_row_q4_K` packing of eight 6-bit (scale, min) pairs into 12 bytes.
fn pack_scales_k4(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = mn[j];
        } else {
            s[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (mn[j] >> 4) << 6;
        }
    }
    s
}

#[test]
fn q4_k_matches_logical_block() {
    let sc: [u8; 8] = [1, 17, 63, 32, 5, 48, 33, 62];
    let mn: [u8; 8] = [0, 63, 16, 9, 47, 2, 31, 60];
    let q: Vec<u8> = (0..256).map(|i| ((i * 7 + i / 13) % 16) as u8).collect();
    let (d, dmin) = (0.125f32, 0.0625f32);
    let mut blk = h(d).to_vec();
    blk.extend(h(dmin));
    blk.extend(pack_scales_k4(&sc, &mn));
    for c in 0..4 {
        for l in 0..32 {
            blk.push(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
        }
    }
    assert_eq!(blk.len(), 144);
    for j in 0..8 {
        assert_eq!(scale_min_k4(j, &blk[4..16]), (sc[j], mn[j]), "sub-block {j}");
    }
    let y = dequant(QuantFormat::Q4_K, &blk);
    for k in 0..256 {
        let s = k / 32;
        let want = d * f32::from(sc[s]) * f32::from(q[k]) - dmin * f32::from(mn[s]);
        assert_eq!(y[k], want, "value {k}");
    }
    // By hand: value 200 is in sub-block 6 (scale 33, min 31), q[200] = (1400 + 15) % 16 = 7:
    // 0.125 * 33 * 7 - 0.0625 * 31 = 28.875 - 1.9375.
    assert_eq!(y[200], 26.9375);
}

#[test]
fn q5_k_matches_logical_block() {
    let sc: [u8; 8] = [3, 60, 1, 45, 22, 7, 63, 31];
    let mn: [u8; 8] = [63, 0, 12, 33, 5, 50, 18, 2];
    let q: Vec<u8> = (0..256).map(|i| ((i * 13 + i / 5) % 32) as u8).collect();
    let (d, dmin) = (0.25f32, 0.125f32);
    let mut blk = h(d).to_vec();
    blk.extend(h(dmin));
    blk.extend(pack_scales_k4(&sc, &mn));
    let mut qh = [0u8; 32];
    let mut qs = Vec::new();
    for c in 0..4 {
        for l in 0..32 {
            let (a, b) = (q[64 * c + l], q[64 * c + 32 + l]);
            qs.push((a & 0x0F) | ((b & 0x0F) << 4));
            qh[l] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
        }
    }
    blk.extend(qh);
    blk.extend(qs);
    assert_eq!(blk.len(), 176);
    let y = dequant(QuantFormat::Q5_K, &blk);
    for k in 0..256 {
        let s = k / 32;
        let want = d * f32::from(sc[s]) * f32::from(q[k]) - dmin * f32::from(mn[s]);
        assert_eq!(y[k], want, "value {k}");
    }
    // By hand: value 100 is in sub-block 3 (scale 45, min 33); q[100] = (1300 + 20) % 32 = 8:
    // 0.25 * 45 * 8 - 0.125 * 33.
    assert_eq!(y[100], 85.875);
}

#[test]
fn q6_k_matches_logical_block() {
    let scales: [i8; 16] = [1, -2, 3, -4, 127, -128, 0, 9, 10, -11, 12, 13, -14, 15, 16, -17];
    let l: Vec<u8> = (0..256).map(|i| ((i * 11 + i / 7) % 64) as u8).collect();
    let d = 0.03125f32;
    let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
    for (half, j) in [0usize, 128].into_iter().enumerate() {
        for i in 0..32 {
            let q = |k: usize| l[j + i + k];
            ql[64 * half + i] = (q(0) & 0x0F) | ((q(64) & 0x0F) << 4);
            ql[64 * half + i + 32] = (q(32) & 0x0F) | ((q(96) & 0x0F) << 4);
            qh[32 * half + i] = (q(0) >> 4) | ((q(32) >> 4) << 2) | ((q(64) >> 4) << 4) | ((q(96) >> 4) << 6);
        }
    }
    let mut blk = ql;
    blk.extend(qh);
    blk.extend(scales.iter().map(|&s| s as u8));
    blk.extend(h(d));
    assert_eq!(blk.len(), 210);
    let y = dequant(QuantFormat::Q6_K, &blk);
    for k in 0..256 {
        let want = d * f32::from(scales[k / 16]) * (i32::from(l[k]) - 32) as f32;
        assert_eq!(y[k], want, "value {k}");
    }
    // By hand: value 77 is in sub-block 4 (scale 127); l[77] = (847 + 11) % 64 = 26: 127 * -6 / 32.
    assert_eq!(y[77], -23.8125);
}

#[test]
fn bad_lengths_are_refused() {
    assert!(dequantize(QuantFormat::Q8_0, &[0; 33], &mut [0f32; 32]).is_err());
    assert!(dequantize(QuantFormat::Q8_0, &[0; 34], &mut [0f32; 31]).is_err());
    assert!(dequantize(QuantFormat::Q6_K, &[0; 210], &mut [0f32; 256]).is_ok());
    // k not a multiple of the block, a truncated row, one byte too many.
    assert!(QuantMatrix::new(QuantFormat::Q4_K, 2, 128, vec![0; 144]).is_err());
    assert!(QuantMatrix::new(QuantFormat::Q4_1, 3, 64, vec![0; 3 * 40 - 1]).is_err());
    assert!(QuantMatrix::new(QuantFormat::Q4_1, 3, 64, vec![0; 3 * 40 + 1]).is_err());
    let m = QuantMatrix::new(QuantFormat::Q4_1, 3, 64, vec![0; 3 * 40]).unwrap();
    assert_eq!((m.n(), m.k(), m.row_bytes(), m.row(2).len()), (3, 64, 40, 40));
    assert_eq!(
        QuantMatrix::new(QuantFormat::Q5_K, usize::MAX, 256, vec![]).err().map(|e| e.to_string().contains("overflows")),
        Some(true)
    );
}

#[test]
fn a_matrix_dequantizes_row_by_row_as_its_blocks() {
    for format in QuantFormat::ALL {
        let (n, k) = (3, 2 * format.block_values());
        let bytes: Vec<u8> = (0..n * k / format.block_values() * format.block_bytes())
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3] & 0x3B)
            .collect();
        let m = QuantMatrix::new(format, n, k, bytes.clone()).unwrap();
        assert_eq!(m.to_f32(), dequant(format, &bytes), "{format}");
    }
}

/// The library quantizers: every format reads back through [`dequantize`] close to its input
/// (relative RMS error under each format's bound, which a wrong bit layout would miss by far),
/// on rows with an outlier and on all-zero and constant blocks (no NaN from a zero scale).
#[test]
fn library_quantizers_round_trip_within_each_formats_error() {
    // RMS error over RMS value, on rows of many small values and a few large ones (products of
    // two uniforms): a level spacing of (block range) / 2^bits against a small RMS.
    let bound = |f: QuantFormat| match f {
        QuantFormat::Q8_0 => 0.015,
        QuantFormat::Q6_K => 0.04,
        QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::Q5_K => 0.09,
        QuantFormat::Q4_1 | QuantFormat::Q4_K => 0.15,
        // Symmetric: the sign of the largest value wastes half a level of the 16.
        QuantFormat::Q4_0 => 0.2,
    };
    for format in QuantFormat::ALL {
        let n = format.block_values() * 6;
        let mut x: Vec<f32> = values(n, 7, 0.05).iter().zip(values(n, 8, 1.0)).map(|(a, b)| a * (0.5 + b)).collect();
        x[3] = 0.4; // an outlier
        let mut q = Vec::new();
        quantize(format, &x, &mut q);
        assert_eq!(q.len(), n / format.block_values() * format.block_bytes(), "{format:?}");
        let y = dequant(format, &q);
        let rms = |v: &mut dyn Iterator<Item = f32>| (v.map(|e| e * e).sum::<f32>() / n as f32).sqrt();
        let err = rms(&mut x.iter().zip(&y).map(|(a, b)| a - b)) / rms(&mut x.iter().copied());
        eprintln!("{format:?}: relative RMS error {err:.4}");
        assert!(err < bound(format), "{format:?}: relative RMS error {err}");
        // The K-quants search their scales: never worse than the plain round-to-nearest
        // format of as many bits.
        for (flat, constant) in [(0.0f32, true), (0.25, true)] {
            let z = vec![flat; format.block_values()];
            let mut q = Vec::new();
            quantize(format, &z, &mut q);
            let back = dequant(format, &q);
            assert!(back.iter().all(|v| v.is_finite()), "{format:?}");
            if constant {
                let worst = back.iter().fold(0f32, |m, v| m.max((v - flat).abs()));
                assert!(worst <= flat * 0.07 + 1e-6, "{format:?} of constant {flat}: off by {worst}");
            }
        }
    }
}

/// Quantizing what a format already represents gives values close to it back (a recomputed
/// scale need not fall on the old grid: Q4_0 maps its largest value to -8 whatever its sign):
/// the packing is the dequantizer's inverse.
#[test]
fn requantizing_a_formats_own_values_is_nearly_exact() {
    for format in QuantFormat::ALL {
        let blocks = synthetic_blocks(format, 4, 11);
        let x = dequant(format, &blocks);
        let mut q = Vec::new();
        quantize(format, &x, &mut q);
        let y = dequant(format, &q);
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = x.iter().zip(&y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= scale * 0.1, "{format:?}: worst {worst} of {scale}");
    }
}
