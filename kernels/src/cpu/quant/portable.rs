//! The portable integer kernel, and the canonical form that every path decodes weights into.
//!
//! Each 32-value unit of a weight row, whatever its format, becomes:
//! - `q`: 32 bytes, unsigned (`0..=63`), except Q8_0, whose bytes are its signed quants unchanged
//!   ([`signed`]);
//! - `ds`: one f32 scale per four consecutive values (the width of an `i32` lane after `maddubs`
//!   + `madd`, or `vpdpbusd`), so a per-16 (Q6_K) or per-32 scale is one lane vector;
//! - `wm`: one f32 offset per sixteen values, the coefficient of that group's activation sum;
//!
//! so that value `i` is `ds[i / 4] * q[i] + wm[i / 16]` (Q8_0: `ds[i / 4] * q[i] as i8`, no
//! offset). Offsets make every signed format but Q8_0 unsigned: Q4_0's `d * (q - 8)` is
//! `d * q + (-8 d)`, Q6_K's `d * sc * (q - 32)` is `d * sc * q + (-32 d sc)`; `maddubs`
//! multiplies an unsigned by a signed byte, and a quant of at most 63 against an activation of
//! at most 127 cannot saturate its `i16` pair sums.
//!
//! Here the form is written to memory a chunk of a row at a time and multiplied by scalar code;
//! the x86 kernels ([`super::x86`]) decode the same form into registers.

use half::f16;

use super::acts::QActs;
use crate::quant::{scale_min_k4, QuantFormat, QuantMatrix};

/// Values of `k` decoded per chunk (a multiple of every block size).
const KC: usize = 4096;

/// Whether the decoded quants of `format` are signed bytes (Q8_0) rather than unsigned ones.
pub(crate) fn signed(format: QuantFormat) -> bool {
    format == QuantFormat::Q8_0
}

/// `res[r * width + (j - rows.start)] = x[r] · w[j]` for the stored weight rows `j` of `rows`
/// ([`QuantMatrix::stored_row`]) and every activation row `r < m`, without bias.
pub(super) fn rows_task(
    w: &QuantMatrix,
    acts: &QActs,
    m: usize,
    rows: std::ops::Range<usize>,
    res: &mut [f32],
    width: usize,
) {
    let (format, k) = (w.format(), w.k());
    let (bv, bb) = (format.block_values(), format.block_bytes());
    let kc = KC.min(k);
    let (mut q, mut ds, mut wm) = (vec![0u8; kc], vec![0f32; kc / 4], vec![0f32; kc / 16]);
    for j in rows.clone() {
        for k0 in (0..k).step_by(kc) {
            let k1 = (k0 + kc).min(k);
            decode(format, &w.stored_row(j)[k0 / bv * bb..k1 / bv * bb], &mut q, &mut ds, &mut wm);
            for r in 0..m {
                let x = acts.row(r);
                let mut acc = [0f32; 8];
                for u in 0..(k1 - k0) / 32 {
                    for (lane, acc) in acc.iter_mut().enumerate() {
                        let dx = x.d[k0 / 4 + 8 * u + lane];
                        let i = 32 * u + 4 * lane;
                        let p: i32 = (i..i + 4)
                            .map(|i| {
                                let wq = if signed(format) { i32::from(q[i] as i8) } else { i32::from(q[i]) };
                                wq * i32::from(x.q[k0 + i])
                            })
                            .sum();
                        *acc += p as f32 * (ds[8 * u + lane] * dx);
                    }
                }
                let mut v: f32 = acc.iter().sum();
                if !signed(format) {
                    v += wm[..(k1 - k0) / 16].iter().zip(&x.s16[k0 / 16..k1 / 16]).map(|(w, s)| w * s).sum::<f32>();
                }
                res[r * width + (j - rows.start)] += v;
            }
        }
    }
}

/// Decodes `blocks` (whole blocks of `format`) into `q`, `ds` and `wm` (see the module docs).
///
/// # Panics
/// If an output is shorter than the blocks' values (`q`), a quarter (`ds`) or a sixteenth
/// (`wm`) of them.
pub(crate) fn decode(format: QuantFormat, blocks: &[u8], q: &mut [u8], ds: &mut [f32], wm: &mut [f32]) {
    let (bv, bb) = (format.block_values(), format.block_bytes());
    for (i, b) in blocks.chunks_exact(bb).enumerate() {
        let q = &mut q[i * bv..(i + 1) * bv];
        let ds = &mut ds[i * bv / 4..(i + 1) * bv / 4];
        let wm = &mut wm[i * bv / 16..(i + 1) * bv / 16];
        if bv == 256 {
            quants_k(format, b, q);
            for (g, (s, m)) in k_scales(format, b).into_iter().enumerate() {
                ds[4 * g..4 * g + 4].fill(s);
                wm[g] = m;
            }
        } else {
            quants_small(format, b, q);
            let (s, m) = small_scale(format, b);
            ds.fill(s);
            wm.fill(m);
        }
    }
}

fn quants_small(format: QuantFormat, b: &[u8], q: &mut [u8]) {
    let (qh, qs) = match format {
        QuantFormat::Q8_0 => return q.copy_from_slice(&b[2..34]),
        QuantFormat::Q4_0 => (0, &b[2..18]),
        QuantFormat::Q4_1 => (0, &b[4..20]),
        QuantFormat::Q5_0 => (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
        _ => (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]),
    };
    for (j, &v) in qs.iter().enumerate() {
        q[j] = (v & 0x0F) | (((qh >> j) & 1) << 4) as u8;
        q[j + 16] = (v >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
    }
}

fn quants_k(format: QuantFormat, b: &[u8], q: &mut [u8]) {
    match format {
        QuantFormat::Q6_K => {
            for (v, q) in q.iter_mut().enumerate() {
                let (h, g, l) = (v / 128, v % 128 / 32, v % 32);
                let low = (b[64 * h + l + 32 * (g % 2)] >> (4 * (g / 2))) & 0x0F;
                let high = (b[128 + 32 * h + l] >> (2 * g)) & 3;
                *q = low | (high << 4);
            }
        }
        _ => {
            let five = format == QuantFormat::Q5_K;
            let qs = if five { &b[48..176] } else { &b[16..144] };
            for (v, q) in q.iter_mut().enumerate() {
                let (u, l) = (v / 32, v % 32);
                let low = (qs[32 * (u / 2) + l] >> (4 * (u % 2))) & 0x0F;
                let high = if five { ((b[16 + l] >> u) & 1) << 4 } else { 0 };
                *q = low | high;
            }
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The scales and offsets of one 256-value K-quant block: `(scale, offset)` of each of its 16
/// groups of 16 values.
fn k_scales(format: QuantFormat, b: &[u8]) -> [(f32, f32); 16] {
    let mut out = [(0f32, 0f32); 16];
    match format {
        QuantFormat::Q6_K => {
            let d = f16_at(b, 208);
            for (g, o) in out.iter_mut().enumerate() {
                let s = d * f32::from(b[192 + g] as i8);
                *o = (s, -32.0 * s);
            }
        }
        _ => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            for (g, o) in out.iter_mut().enumerate() {
                let (sc, mn) = scale_min_k4(g / 2, &b[4..16]);
                *o = (d * f32::from(sc), -dmin * f32::from(mn));
            }
        }
    }
    out
}

/// `(scale, offset)` of a 32-value block (the same for both of its groups of 16).
fn small_scale(format: QuantFormat, b: &[u8]) -> (f32, f32) {
    let d = f16_at(b, 0);
    match format {
        QuantFormat::Q4_0 => (d, -8.0 * d),
        QuantFormat::Q5_0 => (d, -16.0 * d),
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => (d, f16_at(b, 2)),
        _ => (d, 0.0),
    }
}
