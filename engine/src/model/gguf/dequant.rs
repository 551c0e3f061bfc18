//! ggml tensor types and their dequantization to f32.
//!
//! Block layouts follow ggml's `ggml-common.h` exactly (all little-endian, `f16` scales):
//! - `Q4_0` (32 values, 18 bytes): `d: f16, qs: [u8; 16]`; value j is `d * ((qs[j] & 15) - 8)`,
//!   value j+16 is `d * ((qs[j] >> 4) - 8)`.
//! - `Q4_1` (32 values, 20 bytes): `d: f16, m: f16, qs: [u8; 16]`; `d * q + m`, nibbles as Q4_0.
//! - `Q5_0` (32 values, 22 bytes): `d: f16, qh: u32, qs: [u8; 16]`; Q4_0's nibbles with bit j
//!   of `qh` as fifth bit of value j, `d * (q - 16)`. `Q5_1` (24 bytes) adds `m` after `d`:
//!   `d * q + m`.
//! - `Q8_0` (32 values, 34 bytes): `d: f16, qs: [i8; 32]`; `d * q`.
//! - `Q4_K` (256 values, 144 bytes): `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`; eight
//!   sub-blocks of 32 with 6-bit scale and min packed in `scales` (see [`scale_min_k4`]).
//! - `Q5_K` (256 values, 176 bytes): Q4_K with `qh: [u8; 32]` before `qs`: bit 2c (2c+1) of
//!   `qh[l]` is the fifth bit of value l of sub-block 2c (2c+1).
//! - `Q6_K` (256 values, 210 bytes): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`;
//!   sixteen sub-blocks of 16, 6-bit values `(low 4 bits | high 2 bits << 4) - 32`.
//!
//! Invariant: callers pass exactly `n / block_size * type_size` bytes for `n` values (checked
//! by [`dequantize`], which the reader calls only after validating the tensor's extent).

use half::{bf16, f16};
use rayon::prelude::*;

/// A ggml tensor type, with ggml's numbering (`enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

impl GgmlType {
    /// The type for ggml's numeric id; `None` for ids ggml never used or has removed.
    pub fn from_u32(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// ggml's numeric id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// `(values per block, bytes per block)` as in ggml's type traits.
    pub fn block_layout(self) -> (usize, usize) {
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 | IQ4_NL => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            MXFP4 => (32, 17),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            IQ2_XXS => (256, 66),
            IQ2_XS => (256, 74),
            IQ3_XXS => (256, 98),
            IQ1_S => (256, 50),
            IQ3_S => (256, 110),
            IQ2_S => (256, 82),
            IQ4_XS => (256, 136),
            IQ1_M => (256, 56),
            TQ1_0 => (256, 54),
            TQ2_0 => (256, 66),
        }
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K)
    }
}

/// Why [`dequantize`] refused its input (the caller adds the tensor's name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DequantError {
    Unsupported,
    /// `n` is not a multiple of the block size, or `bytes` is not `n / block * type_size`.
    BadLength {
        n: usize,
        bytes: usize,
    },
}

/// Blocks handed to one rayon task: big enough to amortize scheduling, small enough to balance.
const BLOCKS_PER_TASK: usize = 512;

/// Dequantizes `n` values of type `ty` from `bytes` into a new vector.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, DequantError> {
    if !ty.can_dequantize() {
        return Err(DequantError::Unsupported);
    }
    let (block, size) = ty.block_layout();
    if !n.is_multiple_of(block) || (n / block).checked_mul(size) != Some(bytes.len()) {
        return Err(DequantError::BadLength { n, bytes: bytes.len() });
    }
    let mut out = vec![0f32; n];
    let kernel: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, o| o[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::BF16 => |b, o| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q4_1 => block_q4_1,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q5_1 => block_q5_1,
        GgmlType::Q4_K => block_q4_k,
        GgmlType::Q5_K => block_q5_k,
        GgmlType::Q6_K => block_q6_k,
        _ => return Err(DequantError::Unsupported),
    };
    // Scalar types get larger tasks so that one task is not one value.
    let per_task = if block == 1 { 64 * 1024 } else { BLOCKS_PER_TASK };
    out.par_chunks_mut(block * per_task).zip(bytes.par_chunks(size * per_task)).for_each(|(o, b)| {
        for (ob, bb) in o.chunks_exact_mut(block).zip(b.chunks_exact(size)) {
            kernel(bb, ob);
        }
    });
    Ok(out)
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn block_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = d * f32::from(q as i8);
    }
}

fn block_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = d * (f32::from(q & 0x0F) - 8.0);
        hi[j] = d * (f32::from(q >> 4) - 8.0);
    }
}

fn block_q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        lo[j] = d * f32::from(q & 0x0F) + m;
        hi[j] = d * f32::from(q >> 4) + m;
    }
}

/// Q5_0/Q5_1 values before scaling: low nibbles from `qs`, fifth bits from `qh`.
fn q5_values(qh: u32, qs: &[u8], out: &mut [f32], d: f32, offset: f32, m: f32) {
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in qs.iter().enumerate() {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        lo[j] = d * (f32::from((q & 0x0F) | (h0 << 4)) - offset) + m;
        hi[j] = d * (f32::from((q >> 4) | (h1 << 4)) - offset) + m;
    }
}

fn block_q5_0(b: &[u8], out: &mut [f32]) {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    q5_values(qh, &b[6..22], out, f16_at(b, 0), 16.0, 0.0);
}

fn block_q5_1(b: &[u8], out: &mut [f32]) {
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    q5_values(qh, &b[8..24], out, f16_at(b, 0), 0.0, f16_at(b, 2));
}

/// Scale and min of sub-block `j` (0..8) from Q4_K/Q5_K's 12 packed bytes (ggml's
/// `get_scale_min_k4`): sub-blocks 0-3 use the low 6 bits of bytes j and j+4; sub-blocks 4-7 take
/// their low 4 bits from byte j+4 and their high 2 bits from the top of bytes j-4 and j.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn block_q4_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let (lo, hi) = o.split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * f32::from(q[l] & 0x0F) - m1;
            hi[l] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

fn block_q5_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let (lo, hi) = o.split_at_mut(32);
        for l in 0..32 {
            let h1 = ((qh[l] >> (2 * chunk)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
            lo[l] = d1 * f32::from((q[l] & 0x0F) | h1) - m1;
            hi[l] = d2 * f32::from((q[l] >> 4) | h2) - m2;
        }
    }
}

fn block_q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let o = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            o[l] = s(0) * q1 as f32;
            o[l + 32] = s(2) * q2 as f32;
            o[l + 64] = s(4) * q3 as f32;
            o[l + 96] = s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
#[path = "dequant_tests.rs"]
mod tests;
