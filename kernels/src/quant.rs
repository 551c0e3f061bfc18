//! Quantized weight formats: ggml's block layouts, which the backends multiply without first
//! widening the weights to f32 ([`crate::Backend::prepare_linear_quantized`]), and their scalar
//! dequantization, the reference that every quantized kernel is tested against.
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
//!   sub-blocks of 32 with 6-bit scale and min packed in `scales` (see [`scale_min_k4`]); value
//!   `d * scale * q - dmin * min`. Bytes `32c..32c+32` of `qs` hold sub-block `2c` in their low
//!   nibbles and `2c+1` in their high ones.
//! - `Q5_K` (256 values, 176 bytes): Q4_K with `qh: [u8; 32]` before `qs`: bit 2c (2c+1) of
//!   `qh[l]` is the fifth bit of value l of sub-block 2c (2c+1).
//! - `Q6_K` (256 values, 210 bytes): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`;
//!   sixteen sub-blocks of 16 (value v of the block has scale `scales[v / 16]`), 6-bit values
//!   `(low 4 bits | high 2 bits << 4) - 32`.
//!
//! A weight matrix `[n, k]` (Hugging Face layout) is stored as ggml stores it: `n` rows, each
//! `k / block_values` consecutive blocks ([`QuantMatrix`]).

use bytes::Bytes;
use half::f16;

use crate::{check, Result};

/// A block-quantized format the kernels multiply directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl QuantFormat {
    /// Every format, in ggml's numbering order.
    pub const ALL: [QuantFormat; 8] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4_K,
        QuantFormat::Q5_K,
        QuantFormat::Q6_K,
    ];

    /// Values per block (32, or 256 for the K-quants).
    pub fn block_values(self) -> usize {
        match self {
            QuantFormat::Q4_K | QuantFormat::Q5_K | QuantFormat::Q6_K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q4_K => 144,
            QuantFormat::Q5_K => 176,
            QuantFormat::Q6_K => 210,
        }
    }

    /// ggml's name of the format ("Q4_1").
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "Q8_0",
            QuantFormat::Q4_0 => "Q4_0",
            QuantFormat::Q4_1 => "Q4_1",
            QuantFormat::Q5_0 => "Q5_0",
            QuantFormat::Q5_1 => "Q5_1",
            QuantFormat::Q4_K => "Q4_K",
            QuantFormat::Q5_K => "Q5_K",
            QuantFormat::Q6_K => "Q6_K",
        }
    }

    /// Bytes of one row of `k` values, or an error naming `op` when `k` is not a whole number
    /// of blocks (or the size overflows).
    pub fn row_bytes(self, op: &'static str, k: usize) -> Result<usize> {
        let bv = self.block_values();
        if !k.is_multiple_of(bv) {
            return Err(check::err(op, format!("{}: {k} values per row is not a multiple of {bv}", self.name())));
        }
        check::mul(op, k / bv, self.block_bytes())
    }

    /// Dequantizes one block: `block` holds exactly [`block_bytes`](Self::block_bytes) bytes and
    /// `out` receives [`block_values`](Self::block_values) values.
    ///
    /// # Panics
    /// If either length is wrong (callers slice whole blocks).
    pub fn dequantize_block(self, block: &[u8], out: &mut [f32]) {
        assert!(block.len() == self.block_bytes() && out.len() == self.block_values(), "one whole block");
        match self {
            QuantFormat::Q8_0 => block_q8_0(block, out),
            QuantFormat::Q4_0 => block_q4_0(block, out),
            QuantFormat::Q4_1 => block_q4_1(block, out),
            QuantFormat::Q5_0 => block_q5_0(block, out),
            QuantFormat::Q5_1 => block_q5_1(block, out),
            QuantFormat::Q4_K => block_q45_k(block, out, false),
            QuantFormat::Q5_K => block_q45_k(block, out, true),
            QuantFormat::Q6_K => block_q6_k(block, out),
        }
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantizes whole blocks of `format`: `bytes` must hold a whole number of blocks and `out`
/// exactly their values.
pub fn dequantize(format: QuantFormat, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let (bv, bb) = (format.block_values(), format.block_bytes());
    if !bytes.len().is_multiple_of(bb) || bytes.len() / bb * bv != out.len() {
        return Err(check::err(
            "dequantize",
            format!("{format}: {} bytes are not the blocks of {} values", bytes.len(), out.len()),
        ));
    }
    for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bv)) {
        format.dequantize_block(b, o);
    }
    Ok(())
}

/// A linear weight `[n, k]` (Hugging Face layout) in a block-quantized format: `n` rows of
/// `k / block_values` blocks each, as a GGUF file stores it.
///
/// Invariant: `k` is a multiple of the format's block size and `data` holds exactly
/// `n * k / block_values * block_bytes` bytes (checked by [`QuantMatrix::new`]).
///
/// The blocks are a [`Bytes`]: either owned, or a slice of a memory-mapped model file that the
/// matrix keeps mapped. A GGUF weight whose layout needs no change is multiplied where it lies in
/// the map, so its bytes are the page cache's (shared by every process that maps the file, and
/// never copied through the heap).
///
/// Rows may be stored in another order than their output features ([`QuantMatrix::with_row_order`]):
/// llama.cpp stores a llama model's q and k projections with each head's rows interleaved for
/// its RoPE, and moving them back would copy them out of the map. The kernels then multiply
/// the stored rows in place and write each result to its row's output feature. Everything
/// that speaks of a row by its output feature ([`QuantMatrix::row`],
/// [`QuantMatrix::dequantize_row`], [`QuantMatrix::to_f32`]) sees the Hugging Face order;
/// [`QuantMatrix::stored_row`] and [`QuantMatrix::bytes`] see the stored one.
#[derive(Clone)]
pub struct QuantMatrix {
    format: QuantFormat,
    n: usize,
    k: usize,
    row_bytes: usize,
    data: Bytes,
    /// `None`: stored row `j` is output feature `j`.
    order: Option<std::sync::Arc<RowOrder>>,
}

/// A permutation of a matrix's rows, both ways (a few bytes a row).
#[derive(Debug)]
struct RowOrder {
    /// `feature_of[stored] = output feature`.
    feature_of: Vec<u32>,
    /// `stored_of[feature] = stored row`.
    stored_of: Vec<u32>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix").field("format", &self.format).field("n", &self.n).field("k", &self.k).finish()
    }
}

impl QuantMatrix {
    /// Wraps the blocks of an `[n, k]` weight, refusing a `k` that is not a whole number of
    /// blocks and data that is not exactly `n` rows of them (a truncated tensor).
    pub fn new(format: QuantFormat, n: usize, k: usize, data: impl Into<Bytes>) -> Result<Self> {
        let data = data.into();
        const OP: &str = "prepare_linear_quantized";
        let row_bytes = format.row_bytes(OP, k)?;
        let need = check::mul(OP, n, row_bytes)?;
        if data.len() != need {
            return Err(check::err(OP, format!("{format} weight [{n}, {k}] needs {need} bytes, has {}", data.len())));
        }
        Ok(Self { format, n, k, row_bytes, data, order: None })
    }

    /// The same blocks, with stored row `s` taken as output feature `feature_of[s]` (see the
    /// type's doc). Refuses a `feature_of` that is not a permutation of `0..n`.
    pub fn with_row_order(mut self, feature_of: Vec<u32>) -> Result<Self> {
        const OP: &str = "QuantMatrix::with_row_order";
        if feature_of.len() != self.n {
            return Err(check::err(OP, format!("{} entries for {} rows", feature_of.len(), self.n)));
        }
        let mut stored_of = vec![u32::MAX; self.n];
        for (s, &f) in feature_of.iter().enumerate() {
            match stored_of.get_mut(f as usize) {
                Some(slot) if *slot == u32::MAX => *slot = s as u32,
                _ => return Err(check::err(OP, format!("feature {f} is out of range or repeated: not a permutation"))),
            }
        }
        let identity = feature_of.iter().enumerate().all(|(s, &f)| s == f as usize);
        self.order = (!identity).then(|| std::sync::Arc::new(RowOrder { feature_of, stored_of }));
        Ok(self)
    }

    /// Whether the rows are stored in another order than their output features.
    pub fn is_reordered(&self) -> bool {
        self.order.is_some()
    }

    /// The output feature of stored row `s`.
    ///
    /// # Panics
    /// If `s >= n`.
    #[inline]
    pub fn feature_of(&self, s: usize) -> usize {
        match &self.order {
            Some(o) => o.feature_of[s] as usize,
            None => {
                assert!(s < self.n, "row {s} of {}", self.n);
                s
            }
        }
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Output features (rows).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (values per row).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All blocks, row after row, in the stored order.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The blocks of output feature `j` (wherever its row is stored).
    ///
    /// # Panics
    /// If `j >= n`.
    pub fn row(&self, j: usize) -> &[u8] {
        let s = match &self.order {
            Some(o) => o.stored_of[j] as usize,
            None => j,
        };
        self.stored_row(s)
    }

    /// The blocks of stored row `s` (output feature [`QuantMatrix::feature_of`]`(s)`); stored
    /// rows lie `row_bytes` apart, which is what the kernels stride over.
    ///
    /// # Panics
    /// If `s >= n`.
    pub fn stored_row(&self, s: usize) -> &[u8] {
        &self.data[s * self.row_bytes..(s + 1) * self.row_bytes]
    }

    /// Output feature `j`'s row dequantized into `out[..k]`.
    ///
    /// # Panics
    /// If `j >= n` or `out` is shorter than `k`.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let (bv, bb) = (self.format.block_values(), self.format.block_bytes());
        for (b, o) in self.row(j).chunks_exact(bb).zip(out[..self.k].chunks_exact_mut(bv)) {
            self.format.dequantize_block(b, o);
        }
    }

    /// The whole weight as f32 `[n, k]`, rows in output-feature order.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for (j, row) in out.chunks_exact_mut(self.k.max(1)).enumerate().take(self.n) {
            self.dequantize_row(j, row);
        }
        out
    }
}

/// `blocks` blocks of `format` with random quants and scales of the size real weights have
/// (f16 `d` around 1e-2 for the 32-value formats, sub-block scales of a few hundredths for the
/// K-quants, mins near the bottom of a block's range, some negative scales): for tests and
/// benchmarks of the kernels, and test models. Deterministic in `seed`.
pub fn synthetic_blocks(format: QuantFormat, blocks: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    // Uniform in [lo, hi) from random bits, as f16 little-endian bytes.
    fn uniform(bits: u64, lo: f32, hi: f32) -> [u8; 2] {
        let u = (bits >> 40) as f32 / (1u64 << 24) as f32;
        f16::from_f32(lo + (hi - lo) * u).to_le_bytes()
    }
    let mut out = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        let start = out.len();
        out.extend((0..format.block_bytes()).map(|_| next() as u8));
        let b = &mut out[start..];
        let sign = if next() % 5 == 0 { -1.0 } else { 1.0 };
        match format {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 => {
                b[..2].copy_from_slice(&uniform(next(), 0.002 * sign, 0.03 * sign));
                if format == QuantFormat::Q8_0 {
                    // ggml's quants stay in -127..=127; one block in eight also holds -128.
                    let keep = next() % 8 == 0;
                    b[2..].iter_mut().filter(|q| **q == 0x80 && !keep).for_each(|q| *q = 0x81);
                }
            }
            QuantFormat::Q4_1 | QuantFormat::Q5_1 => {
                let d = uniform(next(), 0.002, 0.03);
                let levels = if format == QuantFormat::Q4_1 { 8.0 } else { 16.0 };
                let dv = f16::from_le_bytes(d).to_f32();
                b[..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&uniform(next(), -dv * levels * 1.2, -dv * levels * 0.8));
            }
            QuantFormat::Q4_K | QuantFormat::Q5_K => {
                b[..2].copy_from_slice(&uniform(next(), 0.0002, 0.002));
                b[2..4].copy_from_slice(&uniform(next(), 0.0002, 0.002));
            }
            QuantFormat::Q6_K => {
                b[208..210].copy_from_slice(&uniform(next(), 0.0001, 0.001));
            }
        }
    }
    out
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

/// Q4_K (`five` false) or Q5_K: Q5_K has `qh` at bytes 16..48 and its quants after them.
fn block_q45_k(b: &[u8], out: &mut [f32], five: bool) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = if five { &b[48..176] } else { &b[16..144] };
    for (chunk, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let (lo, hi) = o.split_at_mut(32);
        for l in 0..32 {
            let (h1, h2) = match five {
                true => (((b[16 + l] >> (2 * chunk)) & 1) << 4, ((b[16 + l] >> (2 * chunk + 1)) & 1) << 4),
                false => (0, 0),
            };
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

#[path = "quant/quantize.rs"]
mod quantize;
pub use quantize::quantize;

#[cfg(test)]
#[path = "quant/tests.rs"]
mod tests;
