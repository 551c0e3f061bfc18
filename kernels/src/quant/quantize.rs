//! f32 to ggml blocks: the quantizers behind `cleave quantize`. Each writes blocks that
//! [`super::dequantize`] (ggml's layout, see the module docs) reads back, choosing scales as
//! llama.cpp's reference quantizers do: the round-to-nearest formats (`Q8_0`, `Q4_0`, `Q4_1`,
//! `Q5_0`, `Q5_1`) from each block's extremes; the K-quants from a search over candidate
//! scales per sub-block with a weighted least-squares refit (`Q4_K`, `Q5_K`: scale and min;
//! `Q6_K`: a signed scale), then the sub-block scales quantized to 6 or 8 bits against one
//! `f16` super-scale and the values requantized against those. Pure functions: no state, no
//! allocation beyond the output.

use half::f16;

use super::QuantFormat;

/// Appends the blocks of `x` in `format` to `out`. `x.len()` must be a multiple of
/// `format.block_values()` (the caller checks: a row that is not falls back to another format).
pub fn quantize(format: QuantFormat, x: &[f32], out: &mut Vec<u8>) {
    assert_eq!(x.len() % format.block_values(), 0, "{} needs whole blocks", format.name());
    for blk in x.chunks_exact(format.block_values()) {
        match format {
            QuantFormat::Q8_0 => q8_0(blk, out),
            QuantFormat::Q4_0 => q_sym(blk, 8, out),
            QuantFormat::Q5_0 => q_sym(blk, 16, out),
            QuantFormat::Q4_1 => q_min(blk, 15, out),
            QuantFormat::Q5_1 => q_min(blk, 31, out),
            QuantFormat::Q4_K => q45_k(blk, false, out),
            QuantFormat::Q5_K => q45_k(blk, true, out),
            QuantFormat::Q6_K => q6_k(blk, out),
        }
    }
}

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

fn r16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn nearest(x: f32) -> i32 {
    x.round() as i32
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    out.extend(h(d));
    out.extend(x.iter().map(|v| nearest(v * id).clamp(-127, 127) as i8 as u8));
}

/// Q4_0 (`half` 8) or Q5_0 (`half` 16): the value of largest magnitude, with its sign, maps to
/// `-half`; values are `d * (q - half)`.
fn q_sym(x: &[f32], half: i32, out: &mut Vec<u8>) {
    let max = x.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let d = max / -(half as f32);
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let top = 2 * half - 1;
    let q: Vec<u32> = x.iter().map(|&v| ((v * id + half as f32 + 0.5) as i32).clamp(0, top) as u32).collect();
    out.extend(h(d));
    if half == 16 {
        let qh = (0..16).fold(0u32, |acc, j| acc | ((q[j] >> 4) << j) | ((q[j + 16] >> 4) << (j + 16)));
        out.extend(qh.to_le_bytes());
    }
    out.extend((0..16).map(|j| ((q[j] & 15) | ((q[j + 16] & 15) << 4)) as u8));
}

/// Q4_1 (`top` 15) or Q5_1 (31): `d * q + m` from the block's minimum and maximum.
fn q_min(x: &[f32], top: i32, out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / top as f32;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let q: Vec<u32> = x.iter().map(|&v| (((v - min) * id + 0.5) as i32).clamp(0, top) as u32).collect();
    out.extend(h(d));
    out.extend(h(min));
    if top == 31 {
        let qh = (0..16).fold(0u32, |acc, j| acc | ((q[j] >> 4) << j) | ((q[j + 16] >> 4) << (j + 16)));
        out.extend(qh.to_le_bytes());
    }
    out.extend((0..16).map(|j| ((q[j] & 15) | ((q[j + 16] & 15) << 4)) as u8));
}

/// A sub-block's scale and min for `x ≈ scale * q - min`, `q` in `0..=nmax`, `min >= 0`: the
/// best of candidate scales around `(max - min) / nmax`, each refit by weighted least squares
/// (weights `|x| + rms(x)`, as llama.cpp weighs Q4_K/Q5_K). Returns `(scale, min)`.
fn scale_min(x: &[f32], nmax: i32) -> (f32, f32) {
    let lo = x.iter().copied().fold(0f32, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if hi <= lo {
        return (0.0, -lo);
    }
    let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
    let w: Vec<f32> = x.iter().map(|v| v.abs() + rms).collect();
    let err = |scale: f32, min: f32| -> f32 {
        let inv = if scale == 0.0 { 0.0 } else { 1.0 / scale };
        x.iter()
            .zip(&w)
            .map(|(&v, &wi)| {
                let q = nearest((v - min) * inv).clamp(0, nmax) as f32;
                let e = scale * q + min - v;
                wi * e * e
            })
            .sum()
    };
    let mut best = ((hi - lo) / nmax as f32, lo);
    let mut best_err = err(best.0, best.1);
    for step in 0..=20 {
        let iscale = (-1.0 + 0.1 * step as f32 + nmax as f32) / (hi - lo);
        let q: Vec<f32> = x.iter().map(|&v| nearest(iscale * (v - lo)).clamp(0, nmax) as f32).collect();
        let (mut sw, mut sl, mut sl2, mut sx, mut sxl) = (0f32, 0f32, 0f32, 0f32, 0f32);
        for ((&v, &wi), &l) in x.iter().zip(&w).zip(&q) {
            sw += wi;
            sl += wi * l;
            sl2 += wi * l * l;
            sx += wi * v;
            sxl += wi * v * l;
        }
        let det = sw * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let (mut scale, mut min) = ((sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det);
        if min > 0.0 {
            min = 0.0;
            scale = if sl2 > 0.0 { sxl / sl2 } else { 0.0 };
        }
        if scale <= 0.0 {
            continue;
        }
        let e = err(scale, min);
        if e < best_err {
            best = (scale, min);
            best_err = e;
        }
    }
    (best.0, -best.1)
}

/// Q4_K or Q5_K (`five`): eight sub-blocks of 32, each `d * sc * q - dmin * m` with 6-bit `sc`
/// and `m`.
fn q45_k(x: &[f32], five: bool, out: &mut Vec<u8>) {
    let nmax = if five { 31 } else { 15 };
    let sub: Vec<(f32, f32)> = x.chunks_exact(32).map(|s| scale_min(s, nmax)).collect();
    let max_scale = sub.iter().fold(0f32, |a, s| a.max(s.0));
    let max_min = sub.iter().fold(0f32, |a, s| a.max(s.1));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let mut scales = [0u8; 12];
    for j in 0..8 {
        ls[j] = nearest(inv_scale * sub[j].0).clamp(0, 63) as u8;
        lm[j] = nearest(inv_min * sub[j].1).clamp(0, 63) as u8;
        if j < 4 {
            scales[j] = ls[j];
            scales[j + 4] = lm[j];
        } else {
            scales[j + 4] = (ls[j] & 15) | ((lm[j] & 15) << 4);
            scales[j - 4] |= (ls[j] >> 4) << 6;
            scales[j] |= (lm[j] >> 4) << 6;
        }
    }
    let (d, dmin) = (r16(max_scale / 63.0), r16(max_min / 63.0));
    out.extend(h(d));
    out.extend(h(dmin));
    out.extend(scales);
    // The values against the scales as stored.
    let mut q = [0u8; 256];
    for j in 0..8 {
        let (dj, mj) = (d * f32::from(ls[j]), dmin * f32::from(lm[j]));
        for l in 0..32 {
            q[32 * j + l] = if dj == 0.0 { 0 } else { nearest((x[32 * j + l] + mj) / dj).clamp(0, nmax) as u8 };
        }
    }
    if five {
        let mut qh = [0u8; 32];
        for c in 0..4 {
            for l in 0..32 {
                qh[l] |= ((q[64 * c + l] >> 4) & 1) << (2 * c);
                qh[l] |= ((q[64 * c + 32 + l] >> 4) & 1) << (2 * c + 1);
            }
        }
        out.extend(qh);
    }
    for c in 0..4 {
        out.extend((0..32).map(|l| (q[64 * c + l] & 15) | ((q[64 * c + 32 + l] & 15) << 4)));
    }
}

/// A signed scale for `x ≈ scale * q`, `q` in `-nmax..nmax`: the best of candidates around
/// `-max / nmax` (the value of largest magnitude maps to `-nmax`), weights `x²`.
fn signed_scale(x: &[f32], nmax: i32) -> f32 {
    let max = x.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    if max == 0.0 {
        return 0.0;
    }
    let fit = |iscale: f32| -> (f32, f32) {
        let (mut sxl, mut sl2) = (0f32, 0f32);
        for &v in x {
            let l = nearest(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sxl += w * v * l;
            sl2 += w * l * l;
        }
        let scale = if sl2 > 0.0 { sxl / sl2 } else { 0.0 };
        // The weighted error of that fit, up to a constant: -sxl² / sl2.
        (scale, if sl2 > 0.0 { -sxl * sxl / sl2 } else { 0.0 })
    };
    let (mut best, mut best_err) = fit(-nmax as f32 / max);
    for step in -9..=9 {
        if step == 0 {
            continue;
        }
        let (s, e) = fit(-(nmax as f32 + 0.1 * step as f32) / max);
        if e < best_err {
            best = s;
            best_err = e;
        }
    }
    best
}

/// Q6_K: sixteen sub-blocks of 16, `d * sc * (q - 32)` with 8-bit signed `sc`.
fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let sub: Vec<f32> = x.chunks_exact(16).map(|s| signed_scale(s, 32)).collect();
    let max_scale = sub.iter().fold(0f32, |a, &s| if s.abs() > a.abs() { s } else { a });
    let iscale = if max_scale == 0.0 { 0.0 } else { -128.0 / max_scale };
    let sc: Vec<i8> = sub.iter().map(|&s| nearest(iscale * s).clamp(-128, 127) as i8).collect();
    let d = r16(if iscale == 0.0 { 0.0 } else { 1.0 / iscale });
    let mut q = [0u8; 256];
    for (j, &s) in sc.iter().enumerate() {
        let dj = d * f32::from(s);
        for l in 0..16 {
            let v = x[16 * j + l];
            q[16 * j + l] = if dj == 0.0 { 32 } else { (nearest(v / dj).clamp(-32, 31) + 32) as u8 };
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let q = &q[128 * half..128 * half + 128];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
            ql[64 * half + l] = (q1 & 15) | ((q3 & 15) << 4);
            ql[64 * half + l + 32] = (q2 & 15) | ((q4 & 15) << 4);
            qh[32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend(h(d));
}
