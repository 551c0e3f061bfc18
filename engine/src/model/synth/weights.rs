//! Seeded random tensors of a synthetic model, generated lazily, one tensor at a time, while the
//! safetensors file is written.
//!
//! Invariant: the bytes of a tensor depend only on (seed, tensor name, shape, init, dtype), never
//! on the thread count: the tensor is cut into fixed [`CHUNK`]-element chunks, and each chunk
//! draws from its own ChaCha8 stream seeded from (seed, name, chunk index).

use std::borrow::Cow;

use ::safetensors::tensor::{Dtype, View};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::{SynthDtype, SynthSpec};

/// Elements per independently seeded chunk. Part of the output format: changing it changes every
/// weight of every seed.
const CHUNK: usize = 1 << 16;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Init {
    /// N(0, std²).
    Normal { std: f64 },
    /// U(lo, hi).
    Uniform { lo: f64, hi: f64 },
}

/// One tensor of the model; its data is generated when the writer asks for it.
#[derive(Debug, Clone)]
pub(crate) struct SynthTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    seed: u64,
    dtype: SynthDtype,
}

impl SynthTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's values as f32 (before conversion to the storage dtype).
    #[cfg(test)]
    pub fn values(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| self.fill_chunk(i, chunk));
        out
    }

    fn fill_chunk(&self, chunk_index: usize, out: &mut [f32]) {
        let mut rng = ChaCha8Rng::from_seed(chunk_seed(self.seed, &self.name, chunk_index as u64));
        match self.init {
            Init::Normal { std } => fill_normal(&mut rng, std, out),
            Init::Uniform { lo, hi } => {
                for x in out.iter_mut() {
                    *x = (lo + (hi - lo) * unit_open_closed(rng.next_u32())) as f32;
                }
            }
        }
    }
}

impl View for SynthTensor {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            SynthDtype::F32 => Dtype::F32,
            SynthDtype::F16 => Dtype::F16,
            SynthDtype::BF16 => Dtype::BF16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Generates the tensor. Only this tensor's bytes (plus one chunk of f32 per thread) are held.
    fn data(&self) -> Cow<'_, [u8]> {
        let size = self.dtype.size_bytes();
        let mut bytes = vec![0u8; self.numel() * size];
        bytes.par_chunks_mut(CHUNK * size).enumerate().for_each(|(i, out)| {
            let mut values = vec![0f32; out.len() / size];
            self.fill_chunk(i, &mut values);
            encode(self.dtype, &values, out);
        });
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
}

fn encode(dtype: SynthDtype, values: &[f32], out: &mut [u8]) {
    match dtype {
        SynthDtype::F32 => {
            for (v, o) in values.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        SynthDtype::F16 => {
            for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        SynthDtype::BF16 => {
            for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

/// Every tensor `Model::load` needs for `spec`, in Hugging Face naming, with the recipe:
/// norm gains ~U(0.6, 1.4); projections ~N(0, 1/fan_in); the output head ~N(0, s²) with
/// s = 0.4·sqrt(64/hidden) (0.4 at hidden 64, as in tiny-llama; scaled so the logits keep a
/// standard deviation of about 3 at every width); input embeddings ~N(0, 1), or the head's
/// distribution when tied.
pub(crate) fn tensors(spec: &SynthSpec, seed: u64, dtype: SynthDtype) -> Vec<SynthTensor> {
    let (h, i, v) = (spec.hidden_size, spec.intermediate_size, spec.vocab_size);
    let (qd, kvd) = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim);
    let head_std = 0.4 * (64.0 / h as f64).sqrt();
    let gain = Init::Uniform { lo: 0.6, hi: 1.4 };
    let mut out = Vec::with_capacity(spec.num_layers * 9 + 3);
    let mut push =
        |name: String, shape: Vec<usize>, init: Init| out.push(SynthTensor { name, shape, init, seed, dtype });
    let matrix = |rows: usize, cols: usize| (vec![rows, cols], Init::Normal { std: 1.0 / (cols as f64).sqrt() });
    let embed_std = if spec.tie_word_embeddings { head_std } else { 1.0 };
    push("model.embed_tokens.weight".into(), vec![v, h], Init::Normal { std: embed_std });
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        push(format!("{p}.input_layernorm.weight"), vec![h], gain);
        push(format!("{p}.post_attention_layernorm.weight"), vec![h], gain);
        for (name, (shape, init)) in [
            ("self_attn.q_proj", matrix(qd, h)),
            ("self_attn.k_proj", matrix(kvd, h)),
            ("self_attn.v_proj", matrix(kvd, h)),
            ("self_attn.o_proj", matrix(h, qd)),
            ("mlp.gate_proj", matrix(i, h)),
            ("mlp.up_proj", matrix(i, h)),
            ("mlp.down_proj", matrix(h, i)),
        ] {
            push(format!("{p}.{name}.weight"), shape, init);
        }
    }
    push("model.norm.weight".into(), vec![h], gain);
    if !spec.tie_word_embeddings {
        push("lm_head.weight".into(), vec![v, h], Init::Normal { std: head_std });
    }
    out
}

/// A uniform in (0, 1] from 32 random bits.
fn unit_open_closed(bits: u32) -> f64 {
    (bits as f64 + 1.0) * (1.0 / 4_294_967_296.0)
}

/// Marsaglia's polar method in f64 (rounded to f32 at the end, so a last-bit difference between
/// platforms' `ln` almost never reaches the stored value); no trigonometry, two samples per
/// accepted pair of 32-bit uniforms (accepted with probability π/4).
fn fill_normal(rng: &mut ChaCha8Rng, std: f64, out: &mut [f32]) {
    const SCALE: f64 = 2.0 / 4_294_967_296.0;
    for pair in out.chunks_mut(2) {
        let (u, v, s) = loop {
            let bits = rng.next_u64();
            let u = (bits >> 32) as f64 * SCALE - 1.0;
            let v = (bits as u32) as f64 * SCALE - 1.0;
            let s = u * u + v * v;
            if s < 1.0 && s > 0.0 {
                break (u, v, s);
            }
        };
        let f = std * (-2.0 * s.ln() / s).sqrt();
        pair[0] = (u * f) as f32;
        if let Some(second) = pair.get_mut(1) {
            *second = (v * f) as f32;
        }
    }
}

/// SplitMix64's finalizer: a bijective mix of 64 bits.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The ChaCha8 key of one chunk: a function of (seed, name, chunk) only.
fn chunk_seed(seed: u64, name: &str, chunk: u64) -> [u8; 32] {
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let base = mix64(mix64(mix64(seed) ^ name_hash) ^ chunk);
    let mut key = [0u8; 32];
    for (k, word) in key.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(
            &mix64(base.wrapping_add((k as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))).to_le_bytes(),
        );
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(init: Init, numel: usize) -> SynthTensor {
        SynthTensor { name: "t".into(), shape: vec![numel], init, seed: 7, dtype: SynthDtype::F32 }
    }

    #[test]
    fn normal_has_the_asked_moments() {
        let v = tensor(Init::Normal { std: 0.5 }, 200_001).values();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
        assert!(v.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn uniform_stays_in_range() {
        let v = tensor(Init::Uniform { lo: 0.6, hi: 1.4 }, 100_000).values();
        assert!(v.iter().all(|&x| (0.6..=1.4).contains(&x)));
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn independent_of_thread_count() {
        let t = tensor(Init::Normal { std: 1.0 }, 3 * CHUNK + 17);
        let many = t.data().into_owned();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| t.data().into_owned());
        assert_eq!(many, one);
    }

    #[test]
    fn names_and_chunks_get_distinct_streams() {
        assert_ne!(chunk_seed(1, "a", 0), chunk_seed(1, "b", 0));
        assert_ne!(chunk_seed(1, "a", 0), chunk_seed(1, "a", 1));
        assert_ne!(chunk_seed(1, "a", 0), chunk_seed(2, "a", 0));
    }

    #[test]
    fn half_encodings_round_to_the_f32_values() {
        let t = tensor(Init::Normal { std: 1.0 }, 1000);
        let f32s = t.values();
        for dtype in [SynthDtype::F16, SynthDtype::BF16] {
            let t = SynthTensor { dtype, ..t.clone() };
            let bytes = t.data();
            for (v, b) in f32s.iter().zip(bytes.chunks_exact(2)) {
                let back = match dtype {
                    SynthDtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                };
                assert!((back - v).abs() <= v.abs() * 0.01 + 1e-4, "{v} -> {back}");
            }
        }
    }
}
