//! A model's identity, apart from the format its weights are stored in: what nodes compare
//! before they exchange KV ([`cleave_protocol::KvLayout::model_fingerprint`]).
//!
//! Two files of one model in different formats (a Hugging Face folder in f32 or bf16, a GGUF in
//! Q4_1 or Q8_0) must agree, so that a prefill pool in f32 and a decode pool in Q4 can share a
//! cluster; two different models must not. The identity folds in what does not change with the
//! format:
//! - the config fields that shape the KV cache and the logits (layers, heads, widths, RoPE,
//!   norm epsilon, vocabulary size; Llama and Mistral count as one architecture, as GGUF files
//!   name both `llama`);
//! - the vocabulary, as the text each token id decodes to;
//! - every RMSNorm weight vector, rounded to bf16: llama.cpp's quantizers keep 1-D tensors in
//!   f32, and a bf16 checkpoint's norms widen to f32 exactly, so every format agrees on them,
//!   while two models trained apart never do.
//!
//! What it cannot tell apart: a fine-tune that left the norms and the vocabulary as they were (a
//! LoRA merged into the linear weights, say) has its base model's identity. The weights
//! fingerprint ([`super::Model::fingerprint`], reported beside it) does differ, and the
//! coordinator shows it per node; it differs across formats too, so it cannot be the check.
//!
//! Reading it costs the config, the tokenizer and the norm vectors (a few KB): no linear weight
//! is read, so the coordinator learns it without loading the model.

use cleave_tokenizer::Tokenizer;

use super::config::{Architecture, ModelConfig};
use super::TensorSource;
use crate::Result;

/// FNV-1a, 64 bits: stable across processes and builds.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn eat(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn u64(&mut self, x: u64) {
        self.eat(&x.to_le_bytes());
    }

    fn f32(&mut self, x: f32) {
        self.eat(&x.to_bits().to_le_bytes());
    }
}

/// The norm vectors of a model, in a fixed order: `(HF name, length)`.
fn norm_tensors(c: &ModelConfig) -> Vec<(String, usize)> {
    let h = c.hidden_size;
    let mut out = Vec::with_capacity(c.num_layers * 4 + 1);
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), h));
        out.push((format!("{p}.post_attention_layernorm.weight"), h));
        if c.qk_norm {
            out.push((format!("{p}.self_attn.q_norm.weight"), c.head_dim));
            out.push((format!("{p}.self_attn.k_norm.weight"), c.head_dim));
        }
    }
    out.push(("model.norm.weight".into(), h));
    out
}

/// `x` rounded to the nearest bf16 (ties to even), as f32: what every storage format of a norm
/// weight agrees on.
fn bf16_rounded(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// The identity's config and norm part (no tokenizer): read from `source` (norm vectors only).
pub fn weights_identity(c: &ModelConfig, source: &dyn TensorSource) -> Result<u64> {
    let mut h = Fnv::new();
    let arch = match c.architecture {
        Architecture::Llama | Architecture::Mistral => "llama",
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
    };
    h.eat(arch.as_bytes());
    for x in [c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim] {
        h.u64(x as u64);
    }
    h.f32(c.rms_norm_eps);
    h.f32(c.rope_theta);
    h.eat(format!("{:?}", c.rope_scaling).as_bytes());
    h.u64(u64::from(c.attention_bias) | u64::from(c.qk_norm) << 1);
    for (name, len) in norm_tensors(c) {
        h.eat(name.as_bytes());
        for x in source.load(&name, &[len])? {
            h.f32(bf16_rounded(x));
        }
    }
    Ok(h.0)
}

/// Folds the vocabulary (each id's text, special tokens included) into `identity`.
pub fn with_vocabulary(identity: u64, tokenizer: &Tokenizer) -> u64 {
    let mut h = Fnv(identity);
    let n = tokenizer.vocab_size();
    h.u64(n as u64);
    for id in 0..n as u32 {
        // An id the tokenizer cannot decode folds in as a marker, the same in every format.
        match tokenizer.decode(&[id], false) {
            Ok(text) => h.eat(text.as_bytes()),
            Err(_) => h.eat(&[0xff]),
        }
        h.eat(&[0]);
    }
    h.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_agrees_across_formats_and_keeps_exact_values() {
        for x in [1.0f32, -0.5, 0.0, 3.140625, 1e-3] {
            let b = bf16_rounded(x);
            assert_eq!(bf16_rounded(b), b, "idempotent on {x}");
        }
        // A bf16 value widened to f32 is kept exactly; f32 noise below bf16's precision goes.
        assert_eq!(bf16_rounded(1.5), 1.5);
        assert_eq!(bf16_rounded(1.5 + 1e-6), 1.5);
        assert_ne!(bf16_rounded(1.5), bf16_rounded(1.52));
        assert!(bf16_rounded(f32::NAN).is_nan());
    }
}
