//! `cleave quantize` on a GGUF file: the same model in another block format, as a GGUF that
//! llama.cpp loads too. Every metadata key is copied (architecture, hyperparameters, tokenizer,
//! chat template) except `general.file_type`, which names the new format; every matrix is
//! dequantized and quantized again row by row; vectors (norms, biases) stay f32, as llama.cpp
//! keeps them.
//!
//! A matrix whose rows are not whole blocks of the target takes llama.cpp's fallback for it
//! (the K-quants need rows of 256: Q4_K falls back to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), and
//! f16 when even 32 does not divide them. SmolLM2's rows of 576 are such a case: its Q4_K file
//! is Q4_K only in the MLP's down projection (rows of 1536), Q5_0 elsewhere.
//!
//! Quantizing an already quantized file compounds the two roundings: from a Q4_1 file, a
//! Q8_0 output holds Q4_1's values to 8 bits, not the original weights. Start from the
//! highest-precision file there is.

use cleave_kernels::quant::{quantize, QuantFormat};
use rayon::prelude::*;

use super::dequant::GgmlType;
use super::reader::{GgufFile, MetaValue};
use super::writer::GgufWriter;
use super::GgufError;

/// What one tensor became.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requantized {
    pub name: String,
    pub from: GgmlType,
    pub to: GgmlType,
}

/// llama.cpp's `general.file_type` for a file mostly in `format` (`LLAMA_FTYPE_MOSTLY_*`; the
/// K-quants as their `_S` variants, which quantize every matrix alike).
pub fn file_type(format: QuantFormat) -> u32 {
    match format {
        QuantFormat::Q4_0 => 2,
        QuantFormat::Q4_1 => 3,
        QuantFormat::Q8_0 => 7,
        QuantFormat::Q5_0 => 8,
        QuantFormat::Q5_1 => 9,
        QuantFormat::Q4_K => 14,
        QuantFormat::Q5_K => 16,
        QuantFormat::Q6_K => 18,
    }
}

/// The format a matrix with rows of `k` values gets when `target` is asked for.
pub fn format_for(target: QuantFormat, k: usize) -> Option<QuantFormat> {
    let fallback = match target {
        QuantFormat::Q4_K => QuantFormat::Q5_0,
        QuantFormat::Q5_K => QuantFormat::Q5_1,
        QuantFormat::Q6_K => QuantFormat::Q8_0,
        other => other,
    };
    [target, fallback].into_iter().find(|f| k.is_multiple_of(f.block_values()))
}

/// A tensor's ggml type and bytes in a file whose matrices are in `target`: a matrix (rows of
/// `k` values) in `target` or its fallback ([`format_for`]), f16 when even that does not fit its
/// rows; vectors, and an empty matrix (no row to quantize), in f32.
pub fn encode(values: &[f32], k: usize, matrix: bool, target: QuantFormat) -> (GgmlType, Vec<u8>) {
    let format = (matrix && k > 0 && !values.is_empty()).then(|| format_for(target, k)).flatten();
    match format {
        Some(f) => {
            let rows: Vec<Vec<u8>> = values
                .par_chunks(k)
                .map(|row| {
                    let mut out = Vec::with_capacity(k / f.block_values() * f.block_bytes());
                    quantize(f, row, &mut out);
                    out
                })
                .collect();
            (GgmlType::of_quant(f), rows.concat())
        }
        None if matrix && !values.is_empty() => {
            (GgmlType::F16, values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect())
        }
        None => (GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

/// The GGUF image of `input` with its matrices in `target`, and what each tensor became.
pub fn requantize(input: &GgufFile, target: QuantFormat) -> Result<(Vec<u8>, Vec<Requantized>), GgufError> {
    let mut w = GgufWriter::new();
    w.alignment = input.alignment();
    for (key, value) in input.metadata() {
        if key != "general.file_type" {
            w = w.kv(key, value.clone());
        }
    }
    w = w.kv("general.file_type", MetaValue::U32(file_type(target)));
    if input.get("general.quantization_version").is_none() {
        w = w.kv("general.quantization_version", MetaValue::U32(2));
    }
    let mut report = Vec::with_capacity(input.tensors().len());
    for t in input.tensors() {
        let values = input.tensor_f32(&t.name)?;
        let k = t.dims.first().copied().unwrap_or(1) as usize;
        let (ty, data) = encode(&values, k, t.dims.len() == 2, target);
        report.push(Requantized { name: t.name.clone(), from: t.ggml_type, to: ty });
        w = w.tensor(&t.name, &t.dims, ty, data);
    }
    Ok((w.build(), report))
}
