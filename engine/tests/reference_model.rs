//! The engine's forward pass against a naive dense reference, over synthetic models of every
//! architecture variant cleave supports but has no checkpoint of here: Llama with GQA/MQA/MHA,
//! tied and untied embeddings, q/k/v bias (Qwen2, or Llama with `attention_bias`), per-head q/k
//! RMSNorm with `head_dim * num_heads != hidden_size` (Qwen3), `rope_scaling` `linear` and
//! `llama3`, the Mistral architecture name, and f32/bf16/f16 safetensors.
//!
//! A variant is a `synth::write_model` output post-processed here: `config.json` edited, the
//! extra tensors (biases, q/k norms) appended to `model.safetensors` in the file's dtype.
//!
//! The reference ([`RefModel`]) shares nothing with the engine but the naive ops of
//! `cleave_kernels::reference`: it parses `config.json` and the safetensors bytes itself, derives
//! RoPE frequencies from Hugging Face's formulas in f64, keeps K/V contiguous and recomputes the
//! whole sequence with full causal attention (`reference::dense_attention`) for every position.
//! The engine runs paged, chunked and batched: prefill chunks over scrambled block tables, decode
//! steps, several sequences packed into one forward, and `EngineCore` end to end.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use cleave_engine::model::synth::{self, SynthDtype, SynthSpec};
use cleave_engine::model::{ForwardBatch, KvSpec, KvStorage, Model, ModelFiles};
use cleave_engine::EngineConfig;
use cleave_kernels::{cpu::CpuBackend, reference, AttnSeq, AttnShape};
use cleave_protocol::SamplingParams;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};

/// Largest `max |engine - reference| / max(1, max |reference|)` allowed over one row of logits.
const TOLERANCE: f64 = 1e-4;

// ---------------------------------------------------------------------------------------------
// Temp folders and variants
// ---------------------------------------------------------------------------------------------

/// A fresh folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cleave-refmodel-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One architecture variant: a synthetic spec plus what is changed after `write_model`.
#[derive(Clone)]
struct Variant {
    tag: &'static str,
    /// `architectures[0]` of `config.json`.
    architecture: &'static str,
    spec: SynthSpec,
    dtype: SynthDtype,
    /// The `attention_bias` key of `config.json`; None removes it (the architecture's default).
    attention_bias_key: Option<bool>,
    /// Append random q/k/v biases.
    write_bias: bool,
    /// Append random per-head q/k RMSNorm gains.
    write_qk_norm: bool,
    rope_scaling: Option<Value>,
}

fn base_spec() -> SynthSpec {
    SynthSpec {
        vocab_size: 512,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_word_embeddings: false,
    }
}

fn llama(tag: &'static str) -> Variant {
    Variant {
        tag,
        architecture: "LlamaForCausalLM",
        spec: base_spec(),
        dtype: SynthDtype::F32,
        attention_bias_key: Some(false),
        write_bias: false,
        write_qk_norm: false,
        rope_scaling: None,
    }
}

fn variants() -> Vec<Variant> {
    let base = base_spec();
    vec![
        llama("llama-gqa-untied-f32"),
        Variant {
            spec: SynthSpec { tie_word_embeddings: true, ..base },
            dtype: SynthDtype::BF16,
            ..llama("llama-tied-bf16")
        },
        Variant { spec: SynthSpec { num_kv_heads: 4, ..base }, dtype: SynthDtype::F16, ..llama("llama-mha-f16") },
        Variant { attention_bias_key: Some(true), write_bias: true, ..llama("llama-attention-bias") },
        Variant {
            architecture: "Qwen2ForCausalLM",
            attention_bias_key: None,
            write_bias: true,
            spec: SynthSpec { tie_word_embeddings: true, rope_theta: 1_000_000.0, ..base },
            dtype: SynthDtype::BF16,
            ..llama("qwen2-bias-tied-bf16")
        },
        Variant {
            architecture: "Qwen3ForCausalLM",
            attention_bias_key: None,
            write_qk_norm: true,
            // q width 4 * 32 = 128 != hidden 64, as in real Qwen3 checkpoints.
            spec: SynthSpec { head_dim: 32, rms_norm_eps: 1e-6, ..base },
            dtype: SynthDtype::BF16,
            ..llama("qwen3-qk-norm-bf16")
        },
        Variant {
            // With theta 500000, original_max_position_embeddings 64 puts the 8 frequencies of
            // head_dim 16 in all three llama3 bands (high: wavelength < 16, i = 0; medium:
            // 16..64, i = 1; low: > 64, the rest); `llama3_variant_covers_every_band` checks it.
            rope_scaling: Some(json!({
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64
            })),
            spec: SynthSpec { rope_theta: 500_000.0, ..base },
            ..llama("llama3-rope")
        },
        Variant {
            rope_scaling: Some(json!({"type": "linear", "factor": 4.0})),
            spec: SynthSpec { num_kv_heads: 1, ..base },
            dtype: SynthDtype::F16,
            ..llama("linear-rope-mqa-f16")
        },
        Variant { architecture: "MistralForCausalLM", dtype: SynthDtype::F16, ..llama("mistral-f16") },
    ]
}

/// SplitMix64: the test's own deterministic randomness.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn safetensors_dtype(d: SynthDtype) -> Dtype {
    match d {
        SynthDtype::F32 => Dtype::F32,
        SynthDtype::F16 => Dtype::F16,
        SynthDtype::BF16 => Dtype::BF16,
    }
}

fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        other => panic!("no encoder for {other:?}"),
    }
}

fn decode(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        other => panic!("no decoder for {other:?}"),
    }
}

/// Writes `v` into a fresh temp folder.
fn write_variant(v: &Variant, seed: u64) -> TempDir {
    let dir = TempDir::new(v.tag);
    synth::write_model(&v.spec, seed, v.dtype, &dir.0).unwrap();

    let config_path = dir.0.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    let obj = config.as_object_mut().unwrap();
    obj.insert("architectures".into(), json!([v.architecture]));
    let model_type = v.architecture.trim_end_matches("ForCausalLM").to_lowercase();
    obj.insert("model_type".into(), json!(model_type));
    match v.attention_bias_key {
        Some(b) => obj.insert("attention_bias".into(), json!(b)),
        None => obj.remove("attention_bias"),
    };
    obj.insert("rope_scaling".into(), v.rope_scaling.clone().unwrap_or(Value::Null));
    std::fs::write(&config_path, serde_json::to_string_pretty(&config).unwrap()).unwrap();

    if v.write_bias || v.write_qk_norm {
        let path = dir.0.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let dtype = safetensors_dtype(v.dtype);
        let s = &v.spec;
        let (qd, kvd) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let mut rng = Rng(seed ^ 0x5eed);
        let mut extra: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for l in 0..s.num_layers {
            let p = format!("model.layers.{l}.self_attn");
            if v.write_bias {
                for (name, n) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
                    let values: Vec<f32> = (0..n).map(|_| rng.uniform(-0.5, 0.5)).collect();
                    extra.push((format!("{p}.{name}.bias"), vec![n], encode(dtype, &values)));
                }
            }
            if v.write_qk_norm {
                for name in ["q_norm", "k_norm"] {
                    let values: Vec<f32> = (0..s.head_dim).map(|_| rng.uniform(0.5, 1.5)).collect();
                    extra.push((format!("{p}.{name}.weight"), vec![s.head_dim], encode(dtype, &values)));
                }
            }
        }
        let mut views: Vec<(String, TensorView<'_>)> = st.tensors();
        for (name, shape, data) in &extra {
            views.push((name.clone(), TensorView::new(dtype, shape.clone(), data).unwrap()));
        }
        let out = dir.0.join("model.safetensors.tmp");
        safetensors::serialize_to_file(views, None, &out).unwrap();
        std::fs::rename(&out, &path).unwrap();
    }
    dir
}

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

/// A dense, unbatched, uncached forward pass read straight from the files.
struct RefModel {
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    bias: bool,
    qk_norm: bool,
    /// RoPE inverse frequencies, `head_dim / 2` of them, in f64.
    inv_freq: Vec<f64>,
    w: HashMap<String, Vec<f32>>,
}

impl RefModel {
    fn load(dir: &Path) -> Self {
        let c: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config key {k}")) as usize;
        let arch = c["architectures"][0].as_str().unwrap();
        let (hidden, heads) = (u("hidden_size"), u("num_attention_heads"));
        let head_dim = c["head_dim"].as_u64().map_or(hidden / heads, |d| d as usize);
        let theta = c["rope_theta"].as_f64().unwrap();
        let bias = c["attention_bias"].as_bool().unwrap_or(arch == "Qwen2ForCausalLM");
        let inv_freq = hf_inv_freq(head_dim, theta, &c["rope_scaling"]);

        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let w = st.tensors().into_iter().map(|(name, t)| (name, decode(t.dtype(), t.data()))).collect();
        RefModel {
            vocab: u("vocab_size"),
            hidden,
            inter: u("intermediate_size"),
            layers: u("num_hidden_layers"),
            heads,
            kv_heads: u("num_key_value_heads"),
            head_dim,
            eps: c["rms_norm_eps"].as_f64().unwrap() as f32,
            bias,
            qk_norm: arch == "Qwen3ForCausalLM",
            inv_freq,
            w,
        }
    }

    fn t(&self, name: &str) -> &[f32] {
        self.w.get(name).unwrap_or_else(|| panic!("reference: no tensor {name}"))
    }

    /// Rotate-half RoPE in f64 on `x: [positions, n_heads, head_dim]`, positions `0..`.
    fn rope(&self, x: &mut [f32], n_heads: usize) {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        for (i, v) in x.chunks_exact_mut(d).enumerate() {
            let pos = (i / n_heads) as f64;
            for j in 0..half {
                let (sin, cos) = (pos * self.inv_freq[j]).sin_cos();
                let (a, b) = (v[j] as f64, v[j + half] as f64);
                v[j] = (a * cos - b * sin) as f32;
                v[j + half] = (b * cos + a * sin) as f32;
            }
        }
    }

    /// Logits `[tokens.len(), vocab]` of every position.
    fn logits(&self, tokens: &[u32]) -> Vec<f32> {
        self.logits_from(tokens, 0)
    }

    /// Logits `[tokens.len() - from, vocab]` of positions `from..` (the whole sequence is still
    /// recomputed; only the output head is skipped for earlier rows).
    fn logits_from(&self, tokens: &[u32], from: usize) -> Vec<f32> {
        let n = tokens.len();
        let (h, i, hd) = (self.hidden, self.inter, self.head_dim);
        let (qd, kvd) = (self.heads * hd, self.kv_heads * hd);
        let linear = |x: &[f32], name: &str, bias: Option<&str>, k: usize, out_dim: usize| {
            let mut out = vec![0f32; n * out_dim];
            reference::linear(x, self.t(name), bias.map(|b| self.t(b)), n, k, out_dim, &mut out).unwrap();
            out
        };
        let norm = |x: &[f32], name: &str, rows: usize, dim: usize| {
            let mut out = vec![0f32; rows * dim];
            reference::rms_norm(x, self.t(name), self.eps, rows, dim, &mut out).unwrap();
            out
        };
        let mut x = vec![0f32; n * h];
        reference::embedding(self.t("model.embed_tokens.weight"), tokens, self.vocab, h, &mut x).unwrap();
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            let normed = norm(&x, &format!("{p}.input_layernorm.weight"), n, h);
            let proj = |name: &str, dim: usize| {
                let bias = format!("{p}.self_attn.{name}.bias");
                linear(&normed, &format!("{p}.self_attn.{name}.weight"), self.bias.then_some(bias.as_str()), h, dim)
            };
            let (mut q, mut k, v) = (proj("q_proj", qd), proj("k_proj", kvd), proj("v_proj", kvd));
            if self.qk_norm {
                q = norm(&q, &format!("{p}.self_attn.q_norm.weight"), n * self.heads, hd);
                k = norm(&k, &format!("{p}.self_attn.k_norm.weight"), n * self.kv_heads, hd);
            }
            self.rope(&mut q, self.heads);
            self.rope(&mut k, self.kv_heads);
            let shape = AttnShape {
                num_heads: self.heads,
                num_kv_heads: self.kv_heads,
                head_dim: hd,
                block_size: 1,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let attn = reference::dense_attention(&q, &k, &v, n, n, shape).unwrap();
            let o = linear(&attn, &format!("{p}.self_attn.o_proj.weight"), None, qd, h);
            reference::add_assign(&mut x, &o, n * h).unwrap();
            let normed = norm(&x, &format!("{p}.post_attention_layernorm.weight"), n, h);
            let gate = {
                let mut out = vec![0f32; n * i];
                reference::linear(&normed, self.t(&format!("{p}.mlp.gate_proj.weight")), None, n, h, i, &mut out)
                    .unwrap();
                out
            };
            let mut up = vec![0f32; n * i];
            reference::linear(&normed, self.t(&format!("{p}.mlp.up_proj.weight")), None, n, h, i, &mut up).unwrap();
            let mut act = vec![0f32; n * i];
            reference::silu_mul(&gate, &up, n * i, &mut act).unwrap();
            let down = linear(&act, &format!("{p}.mlp.down_proj.weight"), None, i, h);
            reference::add_assign(&mut x, &down, n * h).unwrap();
        }
        let rows = n - from;
        let normed = norm(&x[from * h..], "model.norm.weight", rows, h);
        let head = if self.w.contains_key("lm_head.weight") { "lm_head.weight" } else { "model.embed_tokens.weight" };
        let mut out = vec![0f32; rows * self.vocab];
        reference::linear(&normed, self.t(head), None, rows, h, self.vocab, &mut out).unwrap();
        out
    }

    /// Greedy continuation of `prompt` by full recomputation, with the logits of each step.
    fn greedy(&self, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
        let mut seq = prompt.to_vec();
        let mut rows = Vec::new();
        for _ in 0..n {
            let last = self.logits_from(&seq, seq.len() - 1);
            seq.push(argmax(&last) as u32);
            rows.push(last);
        }
        (seq[prompt.len()..].to_vec(), rows)
    }
}

/// Hugging Face's `_compute_default_rope_parameters` and its `linear` and `llama3` variants, in f64.
fn hf_inv_freq(head_dim: usize, theta: f64, scaling: &Value) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
    let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str);
    let f = |k: &str| scaling[k].as_f64().unwrap();
    match kind {
        None => base,
        Some("linear") => base.iter().map(|x| x / f("factor")).collect(),
        Some("llama3") => {
            let (factor, low, high, old) =
                (f("factor"), f("low_freq_factor"), f("high_freq_factor"), f("original_max_position_embeddings"));
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            base.iter()
                .map(|&inv| {
                    let wavelen = 2.0 * std::f64::consts::PI / inv;
                    if wavelen < high_wavelen {
                        inv
                    } else if wavelen > low_wavelen {
                        inv / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * inv / factor + smooth * inv
                    }
                })
                .collect()
        }
        Some(other) => panic!("reference: rope type {other}"),
    }
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
}

fn log_softmax_at(row: &[f32], token: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row[token] as f64 - max - z.ln()
}

/// The relative error of one row; panics with the position when it exceeds [`TOLERANCE`].
fn assert_row_close(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: row lengths");
    let scale = want.iter().fold(1f64, |m, &x| m.max((x as f64).abs()));
    let err = got.iter().zip(want).map(|(&a, &b)| (a as f64 - b as f64).abs()).fold(0.0, f64::max) / scale;
    assert!(err <= TOLERANCE, "{what}: relative logit error {err:.2e} > {TOLERANCE:.0e}");
    err
}

// ---------------------------------------------------------------------------------------------
// The engine side
// ---------------------------------------------------------------------------------------------

/// One sequence of a simulated schedule: its full token list, the first `prefill_len` fed in
/// chunks of `chunk`, the rest one per step (decode).
struct SimSeq {
    tokens: Vec<u32>,
    prefill_len: usize,
    chunk: usize,
}

/// Runs `seqs` through `Model::forward` the way a continuous-batching engine would: every step
/// packs the next piece of every unfinished sequence into one batch; blocks are handed out from
/// one pool interleaved between the sequences, in descending order (so no table is the identity).
/// Returns the logits of every position of every sequence.
fn paged_logits(model: &Model<CpuBackend>, backend: &CpuBackend, seqs: &[SimSeq], block_size: usize) -> Vec<Vec<f32>> {
    let vocab = model.config.vocab_size;
    let per_seq: Vec<usize> = seqs.iter().map(|s| s.tokens.len().div_ceil(block_size)).collect();
    let total: usize = per_seq.iter().sum();
    let spec = KvSpec { num_blocks: total + 2, block_size, dtype: cleave_protocol::KvDtype::F32 };
    let mut kv = KvStorage::new(backend, &model.config, spec).unwrap();
    let mut free: Vec<u32> = (1..=total as u32 + 1).collect(); // block 0 is never used
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    for round in 0..*per_seq.iter().max().unwrap_or(&0) {
        for (s, table) in tables.iter_mut().enumerate() {
            if round < per_seq[s] {
                table.push(free.pop().unwrap());
            }
        }
    }
    let mut done = vec![0usize; seqs.len()];
    let mut out: Vec<Vec<f32>> = seqs.iter().map(|s| Vec::with_capacity(s.tokens.len() * vocab)).collect();
    while done.iter().zip(seqs).any(|(&d, s)| d < s.tokens.len()) {
        let (mut tokens, mut positions, mut slots, mut rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut pieces = Vec::new();
        for (s, seq) in seqs.iter().enumerate() {
            let start = done[s];
            if start == seq.tokens.len() {
                continue;
            }
            let len = if start < seq.prefill_len { seq.chunk.min(seq.prefill_len - start) } else { 1 };
            pieces.push((s, tokens.len(), len));
            for p in start..start + len {
                tokens.push(seq.tokens[p]);
                positions.push(p as u32);
                slots.push(tables[s][p / block_size] * block_size as u32 + (p % block_size) as u32);
                rows.push(rows.len() as u32);
            }
            done[s] += len;
        }
        let attn: Vec<AttnSeq<'_>> = pieces
            .iter()
            .map(|&(s, q_start, q_len)| AttnSeq { q_start, q_len, context_len: done[s], block_table: &tables[s] })
            .collect();
        let batch =
            ForwardBatch { tokens: &tokens, positions: &positions, slots: &slots, seqs: &attn, logit_rows: &rows };
        let logits = model.forward(backend, batch, &mut kv).unwrap();
        for &(s, q_start, q_len) in &pieces {
            out[s].extend_from_slice(&logits[q_start * vocab..(q_start + q_len) * vocab]);
        }
    }
    out
}

fn load_model(dir: &Path) -> (CpuBackend, Model<CpuBackend>) {
    let backend = CpuBackend::default();
    let files = ModelFiles::open(dir).unwrap();
    let model = Model::load(&backend, files.config.clone(), files.source.as_ref()).unwrap();
    (backend, model)
}

fn random_tokens(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| (3 + rng.below(vocab - 3)) as u32).collect()
}

/// Every position's logits of three sequences (one sharing a prefix with another), run with
/// different chunkings packed together, match the reference.
fn check_paged_forward(v: &Variant, dir: &Path) -> f64 {
    let (backend, model) = load_model(dir);
    let reference = RefModel::load(dir);
    let vocab = v.spec.vocab_size;
    let mut rng = Rng(17);
    let a = random_tokens(&mut rng, vocab, 37);
    let mut b = a[..20].to_vec();
    b.extend(random_tokens(&mut rng, vocab, 9));
    let c = random_tokens(&mut rng, vocab, 11);
    let seqs = [
        SimSeq { tokens: a, prefill_len: 30, chunk: 7 },
        SimSeq { tokens: b, prefill_len: 29, chunk: 29 },
        SimSeq { tokens: c, prefill_len: 3, chunk: 1 },
    ];
    let mut worst = 0f64;
    for block_size in [4, 16] {
        let got = paged_logits(&model, &backend, &seqs, block_size);
        for (s, seq) in seqs.iter().enumerate() {
            let want = reference.logits(&seq.tokens);
            for p in 0..seq.tokens.len() {
                let what = format!("{} seq {s} pos {p} block_size {block_size}", v.tag);
                let row = p * vocab..(p + 1) * vocab;
                worst = worst.max(assert_row_close(&what, &got[s][row.clone()], &want[row]));
            }
        }
    }
    worst
}

/// `EngineCore` end to end (small token budget so prompts are chunked, shared prefixes, several
/// requests at once): greedy tokens and their logprobs match the reference's greedy decode.
fn check_engine_greedy(v: &Variant, dir: &Path) {
    let reference = RefModel::load(dir);
    let vocab = v.spec.vocab_size;
    let mut rng = Rng(99);
    let shared = random_tokens(&mut rng, vocab, 13);
    let prompts: Vec<Vec<u32>> = vec![
        random_tokens(&mut rng, vocab, 21),
        [shared.clone(), random_tokens(&mut rng, vocab, 5)].concat(),
        [shared, random_tokens(&mut rng, vocab, 3)].concat(),
        random_tokens(&mut rng, vocab, 2),
    ];
    let max_tokens = 6;
    let cfg = EngineConfig {
        block_size: 4,
        max_num_batched_tokens: 8,
        max_num_seqs: 4,
        kv_cache_memory: 64 * 4 * 2 * v.spec.num_layers * v.spec.num_kv_heads * v.spec.head_dim * 4,
        ..Default::default()
    };
    let mut core = common::engine(dir, cfg);
    for (i, p) in prompts.iter().enumerate() {
        let mut req = common::greedy_request(i as u64, p.clone(), max_tokens);
        req.params = SamplingParams { logprobs: Some(2), ..Default::default() };
        core.add_request(req, std::time::Instant::now()).unwrap();
    }
    let events = common::run_to_end(&mut core);
    assert_eq!(core.scheduler().kv().num_in_use(), 0, "{}: blocks leaked", v.tag);
    for (i, p) in prompts.iter().enumerate() {
        let evs = &events[&(i as u64)];
        let got = common::token_ids(evs);
        let (want, rows) = reference.greedy(p, max_tokens as usize);
        assert_eq!(got.len(), max_tokens as usize, "{} request {i}", v.tag);
        for (step, ((&g, &w), row)) in got.iter().zip(&want).zip(&rows).enumerate() {
            if g != w {
                // Only a near-tie may flip, and the sequences diverge after it.
                let gap = (row[w as usize] - row[g as usize]) as f64;
                assert!(gap < 1e-4, "{} request {i} step {step}: engine chose {g}, reference {w} (gap {gap})", v.tag);
                break;
            }
            let lp = evs[step].logprobs.as_ref().expect("logprobs requested");
            assert_eq!(lp.chosen.token_id, g);
            let want_lp = log_softmax_at(row, w as usize);
            assert!(
                (lp.chosen.logprob as f64 - want_lp).abs() <= 1e-4 * want_lp.abs().max(1.0),
                "{} request {i} step {step}: logprob {} vs reference {want_lp}",
                v.tag,
                lp.chosen.logprob
            );
            assert_eq!(lp.top.first().map(|t| t.token_id), Some(w), "{} request {i} step {step}: top-1", v.tag);
        }
    }
}

fn check_variant(v: &Variant) {
    let dir = write_variant(v, 7);
    let worst = check_paged_forward(v, &dir.0);
    check_engine_greedy(v, &dir.0);
    eprintln!("{}: worst relative logit error {worst:.2e}", v.tag);
}

fn variant(tag: &str) -> Variant {
    variants().into_iter().find(|v| v.tag == tag).unwrap()
}

#[test]
fn llama_gqa_untied_f32() {
    check_variant(&variant("llama-gqa-untied-f32"));
}

#[test]
fn llama_tied_bf16() {
    check_variant(&variant("llama-tied-bf16"));
}

#[test]
fn llama_mha_f16() {
    check_variant(&variant("llama-mha-f16"));
}

#[test]
fn llama_attention_bias() {
    check_variant(&variant("llama-attention-bias"));
}

#[test]
fn qwen2_bias_tied_bf16() {
    check_variant(&variant("qwen2-bias-tied-bf16"));
}

#[test]
fn qwen3_qk_norm_bf16() {
    check_variant(&variant("qwen3-qk-norm-bf16"));
}

#[test]
fn llama3_rope_scaling() {
    check_variant(&variant("llama3-rope"));
}

#[test]
fn linear_rope_scaling_mqa_f16() {
    check_variant(&variant("linear-rope-mqa-f16"));
}

#[test]
fn mistral_f16() {
    check_variant(&variant("mistral-f16"));
}

/// The variants really differ: a reference that ignored a feature would pass trivially, so check
/// that dropping each feature from the files changes the reference's logits.
#[test]
fn each_feature_changes_the_logits() {
    let prompt: Vec<u32> = (0..12).map(|i| 10 + i * 31).collect();
    let logits_of = |v: &Variant| {
        let dir = write_variant(v, 7);
        RefModel::load(&dir.0).logits(&prompt)
    };
    for v in variants().iter().filter(|v| v.write_bias || v.write_qk_norm || v.rope_scaling.is_some()) {
        let with = logits_of(v);
        let without = logits_of(&Variant {
            write_bias: false,
            write_qk_norm: false,
            attention_bias_key: Some(false),
            architecture: "LlamaForCausalLM",
            rope_scaling: None,
            ..v.clone()
        });
        let diff = with.iter().zip(&without).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff > 1e-2, "{}: its feature changes the logits by only {diff}", v.tag);
    }
}

/// The llama3 variant's settings put its frequencies in all three bands, so each branch of the
/// scaling rule is exercised.
#[test]
fn llama3_variant_covers_every_band() {
    let v = variant("llama3-rope");
    let scaled = hf_inv_freq(v.spec.head_dim, v.spec.rope_theta as f64, v.rope_scaling.as_ref().unwrap());
    let plain = hf_inv_freq(v.spec.head_dim, v.spec.rope_theta as f64, &Value::Null);
    let ratios: Vec<f64> = scaled.iter().zip(&plain).map(|(s, p)| s / p).collect();
    assert!(ratios.contains(&1.0), "a high-frequency band: {ratios:?}");
    assert!(ratios.iter().any(|&r| (r - 1.0 / 8.0).abs() < 1e-12), "a low-frequency band: {ratios:?}");
    assert!(ratios.iter().any(|&r| r > 1.0 / 8.0 + 1e-6 && r < 1.0 - 1e-6), "a medium band: {ratios:?}");
}

/// The reference itself against Hugging Face transformers (`golden.json` of tiny-llama): the
/// top-5 logits at the last prompt position and the first greedy steps. This is what makes its
/// verdict on the synthetic variants worth trusting.
#[test]
fn reference_matches_transformers_on_tiny_llama() {
    let reference = RefModel::load(&common::tiny_llama_dir());
    for case in common::golden()["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = common::ids(&case["prompt_ids"]);
        let last = reference.logits_from(&prompt, prompt.len() - 1);
        let top5 = &case["last_logits_top5"];
        for (id, value) in common::ids(&top5["ids"]).iter().zip(top5["values"].as_array().unwrap()) {
            let want = value.as_f64().unwrap();
            let got = last[*id as usize] as f64;
            assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "case {name} token {id}: {got} vs {want}");
        }
        let steps = case["steps"].as_array().unwrap();
        let (tokens, _) = reference.greedy(&prompt, 4);
        for (i, (&got, step)) in tokens.iter().zip(steps).enumerate() {
            assert_eq!(got as u64, step["id"].as_u64().unwrap(), "case {name} step {i}");
        }
    }
}
