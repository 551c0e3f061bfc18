//! ggml tensor types and their dequantization to f32.
//!
//! The block-quantized formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are the
//! kernels' [`QuantFormat`]s: their layouts and scalar dequantization live in
//! `cleave_kernels::quant`, which multiplies them without dequantizing; this module maps ggml's
//! type ids onto them and adds the float types (F32, F16, BF16).
//!
//! Invariant: callers pass exactly `n / block_size * type_size` bytes for `n` values (checked
//! by [`dequantize`], which the reader calls only after validating the tensor's extent).

use cleave_kernels::quant::QuantFormat;
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
        if let Some(f) = self.quant_format() {
            return (f.block_values(), f.block_bytes());
        }
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            IQ4_NL => (32, 18),
            Q8_1 => (32, 36),
            MXFP4 => (32, 17),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
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
            Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K => unreachable!("answered by quant_format above"),
        }
    }

    /// The kernels' block format of this type, for the types they multiply while quantized.
    pub fn quant_format(self) -> Option<QuantFormat> {
        use GgmlType::*;
        Some(match self {
            Q8_0 => QuantFormat::Q8_0,
            Q4_0 => QuantFormat::Q4_0,
            Q4_1 => QuantFormat::Q4_1,
            Q5_0 => QuantFormat::Q5_0,
            Q5_1 => QuantFormat::Q5_1,
            Q4_K => QuantFormat::Q4_K,
            Q5_K => QuantFormat::Q5_K,
            Q6_K => QuantFormat::Q6_K,
            _ => return None,
        })
    }

    /// The ggml type of a kernels' block format.
    pub fn of_quant(format: QuantFormat) -> Self {
        use GgmlType::*;
        match format {
            QuantFormat::Q8_0 => Q8_0,
            QuantFormat::Q4_0 => Q4_0,
            QuantFormat::Q4_1 => Q4_1,
            QuantFormat::Q5_0 => Q5_0,
            QuantFormat::Q5_1 => Q5_1,
            QuantFormat::Q4_K => Q4_K,
            QuantFormat::Q5_K => Q5_K,
            QuantFormat::Q6_K => Q6_K,
        }
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16) || self.quant_format().is_some()
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

/// Dequantizes one block (or one value of a float type).
type BlockFn = dyn Fn(&[u8], &mut [f32]) + Sync;

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
    let kernel: Box<BlockFn> = match (ty, ty.quant_format()) {
        (_, Some(format)) => Box::new(move |b, o| format.dequantize_block(b, o)),
        (GgmlType::F32, _) => Box::new(|b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        (GgmlType::F16, _) => Box::new(|b, o| o[0] = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        (GgmlType::BF16, _) => Box::new(|b, o| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
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

#[cfg(test)]
#[path = "dequant_tests.rs"]
mod tests;
