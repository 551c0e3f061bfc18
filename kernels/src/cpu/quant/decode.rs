//! Weight blocks of every [`QuantFormat`] decoded into one canonical form that the integer dot
//! kernels ([`super::dot`]) multiply, whatever the format:
//!
//! - `q`: one byte per value, unsigned (`0..=63`), except Q8_0, whose bytes are its signed
//!   quants unchanged ([`signed`]);
//! - `ds`: one f32 scale per four consecutive values (the width of an `i32` lane after
//!   `maddubs` + `madd`, or `vpdpbusd`), so every format's per-16 or per-32 scale becomes a lane
//!   vector loaded as is;
//! - `wm`: one f32 offset per sixteen values, the coefficient of that group's activation sum.
//!
//! so that value `i` of the decoded run is `ds[i / 4] * q[i] + wm[i / 16]` (Q8_0: `ds[i / 4] *
//! q[i] as i8`, `wm` unused). Offsets turn every signed format but Q8_0 into unsigned quants:
//! Q4_0's `d * (q - 8)` is `d * q + (-8 d)`, Q6_K's `d * sc * (q - 32)` is `d * sc * q +
//! (-32 d sc)`; `maddubs` multiplies an unsigned by a signed byte, and a quant of at most 63
//! against an activation of at most 127 cannot saturate its `i16` pair sums.
//!
//! A portable decoder per format, and an AVX2 one (used by the AVX2 and AVX-512 paths alike:
//! decoding is a small part of a multiply with more than one activation row). Both write exactly
//! the same values.
//!
//! Invariant of [`decode`]: `blocks` is a whole number of blocks, and `q`, `ds`, `wm` hold at
//! least `values`, `values / 4` and `values / 16` elements for the `values` those blocks hold.

use half::f16;

use super::QuantIsa;
use crate::quant::{scale_min_k4, QuantFormat};

/// Whether the decoded quants of `format` are signed bytes (Q8_0) rather than unsigned ones.
pub(crate) fn signed(format: QuantFormat) -> bool {
    format == QuantFormat::Q8_0
}

/// Decodes `blocks` (whole blocks of `format`) into `q`, `ds` and `wm` (see the module docs).
///
/// # Panics
/// If `blocks` is not a whole number of blocks or an output is too short.
pub(crate) fn decode(isa: QuantIsa, format: QuantFormat, blocks: &[u8], q: &mut [u8], ds: &mut [f32], wm: &mut [f32]) {
    let (bv, bb) = (format.block_values(), format.block_bytes());
    assert!(blocks.len().is_multiple_of(bb));
    let values = blocks.len() / bb * bv;
    let (q, ds, wm) = (&mut q[..values], &mut ds[..values / 4], &mut wm[..values / 16]);
    match isa {
        // SAFETY: `QuantIsa` other than Portable is only chosen when AVX2, FMA and F16C are
        // present; the lengths were sliced to exactly what the blocks hold above.
        #[cfg(target_arch = "x86_64")]
        QuantIsa::Avx2 | QuantIsa::Avx512Bw | QuantIsa::Avx512Vnni => unsafe {
            avx2::decode(format, blocks, q, ds, wm)
        },
        _ => portable::decode(format, blocks, q, ds, wm),
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

mod portable {
    use super::*;

    pub fn decode(format: QuantFormat, blocks: &[u8], q: &mut [u8], ds: &mut [f32], wm: &mut [f32]) {
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
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2, FMA and F16C available; `q`, `ds`, `wm` hold exactly the values of `blocks` (a
    /// whole number of blocks), a quarter and a sixteenth of them.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn decode(format: QuantFormat, blocks: &[u8], q: &mut [u8], ds: &mut [f32], wm: &mut [f32]) {
        let (bv, bb) = (format.block_values(), format.block_bytes());
        let (qp, dp, mp) = (q.as_mut_ptr(), ds.as_mut_ptr(), wm.as_mut_ptr());
        for (i, b) in blocks.chunks_exact(bb).enumerate() {
            // SAFETY: block `i` of `bv` values owns q[i*bv..][..bv], ds[i*bv/4..][..bv/4] and
            // wm[i*bv/16..][..bv/16], inside the slices by the caller's contract; every read of
            // `b` stays inside its `bb` bytes (the offsets below are the layouts of quant.rs).
            unsafe {
                let (q, ds, wm) = (qp.add(i * bv), dp.add(i * bv / 4), mp.add(i * bv / 16));
                match format {
                    QuantFormat::Q8_0 => {
                        _mm256_storeu_si256(q as *mut __m256i, _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i));
                        _mm256_storeu_ps(ds, _mm256_set1_ps(half_at(b, 0)));
                    }
                    QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                        let (qs, qh) = match format {
                            QuantFormat::Q4_0 => (2, None),
                            QuantFormat::Q4_1 => (4, None),
                            QuantFormat::Q5_0 => (6, Some(2)),
                            _ => (8, Some(4)),
                        };
                        let mut v = nibbles(b.as_ptr().add(qs));
                        if let Some(h) = qh {
                            v = _mm256_or_si256(
                                v,
                                fifth_bits(std::ptr::read_unaligned(b.as_ptr().add(h) as *const u32)),
                            );
                        }
                        _mm256_storeu_si256(q as *mut __m256i, v);
                        let (s, m) = (half_at(b, 0), small_scale(format, b).1);
                        _mm256_storeu_ps(ds, _mm256_set1_ps(s));
                        *wm = m;
                        *wm.add(1) = m;
                    }
                    QuantFormat::Q4_K | QuantFormat::Q5_K => {
                        let five = format == QuantFormat::Q5_K;
                        let qs = b.as_ptr().add(if five { 48 } else { 16 });
                        let qh = _mm256_loadu_si256(b.as_ptr().add(16) as *const __m256i);
                        let m4 = _mm256_set1_epi8(0x0F);
                        for c in 0..4 {
                            let raw = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                            let mut lo = _mm256_and_si256(raw, m4);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                            if five {
                                lo = _mm256_or_si256(lo, bit_to_16(qh, 2 * c as i32));
                                hi = _mm256_or_si256(hi, bit_to_16(qh, 2 * c as i32 + 1));
                            }
                            _mm256_storeu_si256(q.add(64 * c) as *mut __m256i, lo);
                            _mm256_storeu_si256(q.add(64 * c + 32) as *mut __m256i, hi);
                        }
                        store_k_scales(format, b, ds, wm);
                    }
                    QuantFormat::Q6_K => {
                        let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
                        for h in 0..2 {
                            let ql0 = _mm256_loadu_si256(b.as_ptr().add(64 * h) as *const __m256i);
                            let ql1 = _mm256_loadu_si256(b.as_ptr().add(64 * h + 32) as *const __m256i);
                            let qh = _mm256_loadu_si256(b.as_ptr().add(128 + 32 * h) as *const __m256i);
                            let g = [
                                _mm256_or_si256(
                                    _mm256_and_si256(ql0, m4),
                                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m3),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(ql1, m4),
                                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m3),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                                    _mm256_and_si256(qh, m3),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3),
                                ),
                            ];
                            for (j, v) in g.into_iter().enumerate() {
                                _mm256_storeu_si256(q.add(128 * h + 32 * j) as *mut __m256i, v);
                            }
                        }
                        store_k_scales(format, b, ds, wm);
                    }
                }
            }
        }
    }

    /// The f16 at `b[i..i + 2]` as f32 (F16C).
    ///
    /// # Safety
    /// F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn half_at(b: &[u8], i: usize) -> f32 {
        let bits = u16::from_le_bytes([b[i], b[i + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// The 32 nibbles of 16 bytes at `p`: low nibbles first, then high ones.
    ///
    /// # Safety
    /// AVX2 available; `p` valid for 16 reads.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller vouches for 16 readable bytes.
        let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// Byte `j` is 16 where bit `j` of `qh` is set, else 0.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fifth_bits(qh: u32) -> __m256i {
        // Byte j takes byte j / 8 of qh (shuffles stay within 128-bit lanes, and every 4 bytes
        // of the broadcast hold all of qh), then tests its bit j % 8.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(16))
    }

    /// Byte `l` is 16 where bit `u` of byte `l` of `qh` is set, else 0.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bit_to_16(qh: __m256i, u: i32) -> __m256i {
        let shifted = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(u));
        _mm256_slli_epi16::<4>(_mm256_and_si256(shifted, _mm256_set1_epi8(1)))
    }

    /// A K-quant block's 16 group scales as lane vectors (`ds`: 4 lanes a group) and its 16
    /// offsets.
    ///
    /// # Safety
    /// AVX2 available; `ds` valid for 64 writes, `wm` for 16.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_k_scales(format: QuantFormat, b: &[u8], ds: *mut f32, wm: *mut f32) {
        for (g, (s, m)) in k_scales(format, b).into_iter().enumerate() {
            // SAFETY: g < 16: inside the 64 and 16 elements the caller vouches for.
            unsafe {
                _mm_storeu_ps(ds.add(4 * g), _mm_set1_ps(s));
                *wm.add(g) = m;
            }
        }
    }
}
