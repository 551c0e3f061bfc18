//! Linear weights held in 16 bits (IEEE f16 or bf16), as Hugging Face checkpoints and F16/BF16
//! GGUF files store them: half the memory of f32 and half the bytes a decode step reads, with
//! values that widen to f32 exactly, so a product over them equals the f32 product over the
//! widened weights (no accuracy cost beyond the checkpoint's own rounding).

use crate::{check, Result};

/// The 16-bit format of a [`HalfMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HalfFormat {
    /// IEEE half precision (5-bit exponent, 10-bit mantissa).
    F16,
    /// bfloat16 (f32's 8-bit exponent, 7-bit mantissa).
    Bf16,
}

impl HalfFormat {
    pub fn name(self) -> &'static str {
        match self {
            HalfFormat::F16 => "f16",
            HalfFormat::Bf16 => "bf16",
        }
    }

    /// The f32 value of one element (exact).
    pub fn widen(self, bits: u16) -> f32 {
        match self {
            HalfFormat::F16 => crate::cpu::half_widen::<false>(bits),
            HalfFormat::Bf16 => crate::cpu::half_widen::<true>(bits),
        }
    }

    /// `x` rounded to this format (to nearest, ties to even).
    pub fn narrow(self, x: f32) -> u16 {
        match self {
            HalfFormat::F16 => crate::cpu::half_narrow::<false>(x),
            HalfFormat::Bf16 => crate::cpu::half_narrow::<true>(x),
        }
    }
}

impl std::fmt::Display for HalfFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A linear weight `[n, k]` (Hugging Face layout, row-major) of 16-bit elements.
///
/// Invariant: `data.len() == n * k` (checked by [`HalfMatrix::new`]).
#[derive(Clone)]
pub struct HalfMatrix {
    format: HalfFormat,
    n: usize,
    k: usize,
    data: Vec<u16>,
}

impl std::fmt::Debug for HalfMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HalfMatrix").field("format", &self.format).field("n", &self.n).field("k", &self.k).finish()
    }
}

impl HalfMatrix {
    /// Wraps the elements (raw bits) of an `[n, k]` weight, refusing data that is not exactly
    /// `n * k` elements.
    pub fn new(format: HalfFormat, n: usize, k: usize, data: Vec<u16>) -> Result<Self> {
        const OP: &str = "prepare_linear_half";
        let need = check::mul(OP, n, k)?;
        if data.len() != need {
            return Err(check::err(
                OP,
                format!("{format} weight [{n}, {k}] needs {need} elements, has {}", data.len()),
            ));
        }
        Ok(Self { format, n, k, data })
    }

    /// Rounds an f32 `[n, k]` weight to `format` (for tests and test models).
    pub fn from_f32(format: HalfFormat, w: &[f32], n: usize, k: usize) -> Result<Self> {
        Self::new(format, n, k, w.iter().take(n * k).map(|&v| format.narrow(v)).collect())
    }

    pub fn format(&self) -> HalfFormat {
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

    /// The elements, row after row.
    pub fn data(&self) -> &[u16] {
        &self.data
    }

    /// Element `i` of the row-major data, widened.
    ///
    /// # Panics
    /// If `i >= n * k`.
    pub fn value(&self, i: usize) -> f32 {
        self.format.widen(self.data[i])
    }

    /// The whole weight as f32 `[n, k]` (exact).
    pub fn to_f32(&self) -> Vec<f32> {
        self.data.iter().map(|&h| self.format.widen(h)).collect()
    }
}
