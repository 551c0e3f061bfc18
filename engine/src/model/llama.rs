//! The decoder of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, TinyLlama): one
//! forward pass over a packed batch of tokens from many sequences, reading and writing the paged
//! KV cache. Every operation goes through the [`Backend`], so the same code runs on any device.

use cleave_kernels::{AttnSeq, AttnShape, Backend, QuantMatrix, Rows};

use super::{KvStorage, LinearWeight, ModelConfig, TensorSource};
use crate::Result;

struct Layer<B: Backend> {
    input_norm: B::Buf,
    q: B::Linear,
    k: B::Linear,
    v: B::Linear,
    q_bias: Option<B::Buf>,
    k_bias: Option<B::Buf>,
    v_bias: Option<B::Buf>,
    q_norm: Option<B::Buf>,
    k_norm: Option<B::Buf>,
    o: B::Linear,
    post_norm: B::Buf,
    gate: B::Linear,
    up: B::Linear,
    down: B::Linear,
}

/// The token embeddings and the LM head. Tables are held as prepared linear weights, so they
/// keep the file's format (a bf16 checkpoint's table in 16 bits, a GGUF's Q4_K table in its
/// blocks: for a large vocabulary the table is a good share of the model), and lookups read rows
/// of them; a tied table is kept once.
enum Embeddings<B: Backend> {
    Tied(B::Linear),
    Untied { table: B::Linear, head: B::Linear },
}

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    embed: Embeddings<B>,
    layers: Vec<Layer<B>>,
    norm: B::Buf,
    /// RoPE's inverse frequencies. Each forward pass builds the cos|sin rows of its own tokens'
    /// positions from them (`Buffers::rope`) rather than the model keeping a table of every
    /// position: that table was `max_positions x head_dim` f32s, 2 MiB for SmolLM2's 8192
    /// positions and 64 MiB for a 131,072-position Llama 3.1, resident in every node, where a
    /// step's rows cost `tokens x head_dim/2` sines and cosines (0.4 us a token at a head of 64,
    /// 0.7 at 128, on the Xeon VM of BENCHMARKS.md's resident-memory rows).
    inv_freq: Vec<f32>,
    /// Positions at or past this are refused (the table used to end here).
    max_positions: usize,
    /// See [`Model::fingerprint`].
    fingerprint: u64,
    /// See [`Model::identity`].
    identity: u64,
}

/// How [`Model::load_with`] prepares the weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Dequantize block-quantized linear weights (a GGUF's Q4_1, say) to f32 at load, as cleave
    /// did before its quantized kernels, instead of multiplying them in their format: 4-8x the
    /// memory and the bytes per decode step, no 8-bit rounding of activations (for comparison).
    /// f16 and bf16 weights are widened to f32 likewise (2x the memory; the same products).
    pub dequantize_weights: bool,
}

/// What one decode step reads of the weights: every layer's linear weights and the LM head once,
/// in the format each is held in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightBytes {
    pub per_step: usize,
    /// Bytes per format ("f32", "Q4_1", ...), largest first.
    pub by_format: Vec<(&'static str, usize)>,
}

impl std::fmt::Display for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> =
            self.by_format.iter().map(|(name, b)| format!("{:.1} MB {name}", *b as f64 / 1e6)).collect();
        write!(f, "{:.1} MB ({})", self.per_step as f64 / 1e6, parts.join(" + "))
    }
}

/// One forward pass's inputs: tokens of several sequences packed together.
///
/// Invariants (checked by the kernels): `tokens`, `positions` and `slots` have one entry per
/// token; `seqs` cover the tokens in order; `logit_rows` index into the tokens.
#[derive(Debug, Clone, Copy)]
pub struct ForwardBatch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Flat KV slot (`block * block_size + row`) each token's K/V is written to.
    pub slots: &'a [u32],
    pub seqs: &'a [AttnSeq<'a>],
    /// Rows whose logits are wanted (the last token of each sequence that samples).
    pub logit_rows: &'a [u32],
}

impl<B: Backend> Model<B> {
    /// Loads every weight the config calls for from `source`, checking names and shapes; linear
    /// weights in a block-quantized format stay in it ([`LoadOptions::default`]).
    pub fn load(backend: &B, config: ModelConfig, source: &dyn TensorSource) -> Result<Self> {
        Self::load_with(backend, config, source, LoadOptions::default())
    }

    /// [`Model::load`] with options.
    pub fn load_with(backend: &B, config: ModelConfig, source: &dyn TensorSource, opts: LoadOptions) -> Result<Self> {
        let c = &config;
        let (h, i, qd, kvd, hd) =
            (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.kv_width(), c.head_dim);
        let fp = std::cell::Cell::new(c.fingerprint());
        let host = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let data = source.load(name, shape)?;
            fp.set(fingerprint_tensor(fp.get(), name, shape, |i| data[i]));
            Ok(data)
        };
        let get = |name: &str, shape: &[usize]| -> Result<B::Buf> { Ok(backend.upload(&host(name, shape)?)?) };
        // A linear weight `[n, k]`, prepared once for the backend's matmul. A quantized one
        // fingerprints as its dequantized values, so both ways of loading a file agree.
        let lin = |name: &str, shape: &[usize; 2]| -> Result<B::Linear> {
            let weight = match opts.dequantize_weights {
                true => LinearWeight::F32(source.load(name, shape)?),
                false => source.load_linear(name, *shape)?,
            };
            match weight {
                LinearWeight::F32(data) => {
                    fp.set(fingerprint_tensor(fp.get(), name, shape, |i| data[i]));
                    Ok(backend.prepare_linear(&data, shape[0], shape[1])?)
                }
                LinearWeight::Quantized(q) => {
                    fp.set(fingerprint_tensor(fp.get(), name, shape, |i| quant_value(&q, i)));
                    Ok(backend.prepare_linear_quantized(q)?)
                }
                LinearWeight::Half(w) => {
                    fp.set(fingerprint_tensor(fp.get(), name, shape, |i| w.value(i)));
                    Ok(backend.prepare_linear_half(w)?)
                }
            }
        };
        let opt = |cond: bool, name: &str, shape: &[usize]| -> Result<Option<B::Buf>> {
            if cond {
                get(name, shape).map(Some)
            } else {
                Ok(None)
            }
        };
        // Some checkpoints say tie_word_embeddings but still ship lm_head; prefer what is there.
        let tied = c.tie_word_embeddings && !source.contains("lm_head.weight");
        let (embed_name, vh) = ("model.embed_tokens.weight", [c.vocab_size, h]);
        let (tied_table, table) =
            if tied { (Some(lin(embed_name, &vh)?), None) } else { (None, Some(lin(embed_name, &vh)?)) };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_norm: get(&format!("{p}.input_layernorm.weight"), &[h])?,
                q: lin(&format!("{p}.self_attn.q_proj.weight"), &[qd, h])?,
                k: lin(&format!("{p}.self_attn.k_proj.weight"), &[kvd, h])?,
                v: lin(&format!("{p}.self_attn.v_proj.weight"), &[kvd, h])?,
                q_bias: opt(c.attention_bias, &format!("{p}.self_attn.q_proj.bias"), &[qd])?,
                k_bias: opt(c.attention_bias, &format!("{p}.self_attn.k_proj.bias"), &[kvd])?,
                v_bias: opt(c.attention_bias, &format!("{p}.self_attn.v_proj.bias"), &[kvd])?,
                q_norm: opt(c.qk_norm, &format!("{p}.self_attn.q_norm.weight"), &[hd])?,
                k_norm: opt(c.qk_norm, &format!("{p}.self_attn.k_norm.weight"), &[hd])?,
                o: lin(&format!("{p}.self_attn.o_proj.weight"), &[h, qd])?,
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                gate: lin(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                up: lin(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                down: lin(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
            });
        }
        let norm = get("model.norm.weight", &[h])?;
        let embed = match (tied_table, table) {
            (Some(tied), _) => Embeddings::Tied(tied),
            (None, Some(table)) if source.contains("lm_head.weight") => {
                Embeddings::Untied { table, head: lin("lm_head.weight", &vh)? }
            }
            _ => return Err(crate::EngineError::MissingTensor { name: "lm_head.weight".into() }),
        };
        let max_positions = c.max_position_embeddings.max(1);
        let inv_freq = cleave_kernels::rope_inv_freq(hd, c.rope_theta, &c.rope_scaling);
        let fingerprint = fp.get();
        let identity = super::identity::weights_identity(&config, source)?;
        Ok(Self { config, embed, layers, norm, inv_freq, max_positions, fingerprint, identity })
    }

    /// A stable 64-bit fingerprint of these weights: the config ([`ModelConfig::fingerprint`])
    /// and, for every tensor in load order, its name, shape and a sample of its values (the
    /// first and last 16 and 32 strided ones, as loaded f32 bits; a quantized tensor's
    /// dequantized, so both ways of loading one file agree). Another format of the same model
    /// has another one: nodes compare [`Model::identity`] instead, and report this beside it.
    /// Costs a few hundred reads per tensor at load.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The model apart from its storage format, without the vocabulary (see
    /// [`super::identity`]; the engine folds the tokenizer's in).
    pub fn identity(&self) -> u64 {
        self.identity
    }

    /// What a decode step reads of the weights (every layer's linear weights and the LM head),
    /// in the formats the backend holds them in.
    pub fn weight_bytes(&self, backend: &B) -> WeightBytes {
        let head = match &self.embed {
            Embeddings::Tied(head) | Embeddings::Untied { head, .. } => head,
        };
        let layers = self.layers.iter().flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]);
        let mut out = WeightBytes::default();
        for w in layers.chain([head]) {
            let info = backend.linear_info(w);
            out.per_step += info.bytes;
            match out.by_format.iter_mut().find(|(f, _)| *f == info.format) {
                Some((_, b)) => *b += info.bytes,
                None => out.by_format.push((info.format, info.bytes)),
            }
        }
        out.by_format.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
        out
    }

    /// Longest context the RoPE table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Runs the batch, writing its K/V into `kv`, and returns the logits of `logit_rows` as
    /// `[logit_rows.len(), vocab_size]` on the host.
    pub fn forward(&self, backend: &B, batch: ForwardBatch<'_>, kv: &mut KvStorage<B>) -> Result<Vec<f32>> {
        self.forward_with(backend, batch, kv, &mut Workspace::default())
    }

    /// [`Model::forward`] with activation buffers kept in `ws` between calls, so that steady-state
    /// steps allocate (and fault in) no memory.
    pub fn forward_with(
        &self,
        backend: &B,
        batch: ForwardBatch<'_>,
        kv: &mut KvStorage<B>,
        ws: &mut Workspace<B>,
    ) -> Result<Vec<f32>> {
        self.forward_hooked(backend, batch, kv, ws, &mut |_, _| Ok(()))
    }

    /// [`Model::forward_with`] that calls `on_kv(layer, kv)` right after each layer has written
    /// the batch's K/V into `kv`, before that layer's attention and the layers after it run
    /// (layer-wise KV export: the caller can ship layer `l` while `l + 1..` compute). An error
    /// from `on_kv` aborts the pass.
    pub fn forward_hooked(
        &self,
        backend: &B,
        batch: ForwardBatch<'_>,
        kv: &mut KvStorage<B>,
        ws: &mut Workspace<B>,
        on_kv: &mut (dyn FnMut(usize, &KvStorage<B>) -> Result<()> + Send),
    ) -> Result<Vec<f32>> {
        backend.run(|| self.forward_in(backend, batch, kv, ws, on_kv))
    }

    /// The body of [`Model::forward_hooked`], on the backend's own thread (see [`Backend::run`]).
    fn forward_in(
        &self,
        backend: &B,
        batch: ForwardBatch<'_>,
        kv: &mut KvStorage<B>,
        ws: &mut Workspace<B>,
        on_kv: &mut (dyn FnMut(usize, &KvStorage<B>) -> Result<()> + Send),
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let t = batch.tokens.len();
        let (h, i, qd, kvd, hd) =
            (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.kv_width(), c.head_dim);
        let shape = AttnShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: hd,
            block_size: kv.block_size(),
            scale: 1.0 / (hd as f32).sqrt(),
        };
        if let Some((n, &p)) = batch.positions.iter().enumerate().find(|(_, &p)| p as usize >= self.max_positions) {
            let detail = format!("position {p} of token {n} is past the model's {} positions", self.max_positions);
            return Err(cleave_kernels::KernelError::Shape { op: "rope", detail }.into());
        }
        let Buffers {
            x,
            normed,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            act,
            qk_tmp,
            logits,
            logit_rows,
            rope,
            rope_host,
            rows_in_order,
        } = ws.ensure(backend, c, t)?;
        // This step's cos|sin rows, row n for token n: the kernel reads them at positions 0..t.
        cleave_kernels::rope_rows(&self.inv_freq, batch.positions, rope_host);
        backend.write(rope, 0, rope_host)?;
        let rope_at = &rows_in_order[..t];
        // A decode step (one new token per sequence) tells the backend so: its rows may take
        // kernels a prompt's may not (see `Rows`).
        let rows = if batch.seqs.iter().all(|s| s.q_len == 1) { Rows::Decode } else { Rows::Prompt };
        match &self.embed {
            Embeddings::Tied(table) | Embeddings::Untied { table, .. } => {
                backend.embedding_prepared(table, batch.tokens, x)?
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            backend.rms_norm(x, &layer.input_norm, c.rms_norm_eps, t, h, normed)?;
            let qkv = [
                (&layer.q, layer.q_bias.as_ref()),
                (&layer.k, layer.k_bias.as_ref()),
                (&layer.v, layer.v_bias.as_ref()),
            ];
            backend.linear_prepared_rows(normed, &qkv, rows, t, &mut [&mut *q, &mut *k, &mut *v])?;
            if let (Some(qn), Some(kn), Some(tmp)) = (&layer.q_norm, &layer.k_norm, qk_tmp.as_mut()) {
                backend.copy(q, 0, tmp, 0, t * qd)?;
                backend.rms_norm(tmp, qn, c.rms_norm_eps, t * c.num_heads, hd, q)?;
                backend.copy(k, 0, tmp, 0, t * kvd)?;
                backend.rms_norm(tmp, kn, c.rms_norm_eps, t * c.num_kv_heads, hd, k)?;
            }
            backend.rope(q, rope_at, c.num_heads, hd, rope)?;
            backend.rope(k, rope_at, c.num_kv_heads, hd, rope)?;
            backend.write_kv(k, v, batch.slots, kvd, &mut kv.k[l], &mut kv.v[l])?;
            on_kv(l, kv)?;
            backend.paged_attention(q, &kv.k[l], &kv.v[l], batch.seqs, shape, attn)?;
            backend.linear_prepared_rows(attn, &[(&layer.o, None)], rows, t, &mut [&mut *proj])?;
            backend.add_assign(x, proj, t * h)?;
            backend.rms_norm(x, &layer.post_norm, c.rms_norm_eps, t, h, normed)?;
            backend.linear_prepared_rows(
                normed,
                &[(&layer.gate, None), (&layer.up, None)],
                rows,
                t,
                &mut [&mut *gate, &mut *up],
            )?;
            backend.silu_mul(gate, up, t * i, act)?;
            backend.linear_prepared_rows(act, &[(&layer.down, None)], rows, t, &mut [&mut *proj])?;
            backend.add_assign(x, proj, t * h)?;
        }
        let r = batch.logit_rows.len();
        if r == 0 {
            return Ok(Vec::new());
        }
        // The sampled rows (r <= t) go through `proj` and `normed`, which the layers are done with.
        backend.gather_rows(x, batch.logit_rows, h, proj)?;
        backend.rms_norm(proj, &self.norm, c.rms_norm_eps, r, h, normed)?;
        if r > *logit_rows {
            *logits = backend.alloc_zeros(r * c.vocab_size)?;
            *logit_rows = r;
        }
        let head = match &self.embed {
            Embeddings::Tied(head) | Embeddings::Untied { head, .. } => head,
        };
        backend.linear_prepared_rows(normed, &[(head, None)], rows, r, &mut [&mut *logits])?;
        Ok(backend.read(logits, 0, r * c.vocab_size)?)
    }
}

/// Folds one tensor's name, shape and a sample of its values (`value(i)` is element `i` of the
/// row-major tensor, as f32) into a fingerprint (FNV-1a).
fn fingerprint_tensor(mut h: u64, name: &str, shape: &[usize], value: impl Fn(usize) -> f32) -> u64 {
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    };
    eat(name.as_bytes());
    for &d in shape {
        eat(&(d as u64).to_le_bytes());
    }
    let n: usize = shape.iter().product();
    let stride = (n / 32).max(1);
    let sample = (0..n.min(16)).chain(n.saturating_sub(16)..n).chain((0..n).step_by(stride));
    for i in sample {
        eat(&value(i).to_bits().to_le_bytes());
    }
    h
}

/// Element `i` of a quantized matrix, dequantized (its block alone).
fn quant_value(q: &QuantMatrix, i: usize) -> f32 {
    let (format, k) = (q.format(), q.k());
    let (bv, bb) = (format.block_values(), format.block_bytes());
    let (row, col) = (i / k, i % k);
    let mut block = [0f32; 256];
    format.dequantize_block(&q.row(row)[col / bv * bb..(col / bv + 1) * bb], &mut block[..bv]);
    block[col % bv]
}

/// Activation buffers of [`Model::forward_with`], grown to the largest batch seen and reused.
/// Kernels touch only the leading elements a call describes, so longer buffers are fine.
pub struct Workspace<B: Backend> {
    tokens: usize,
    bufs: Option<Buffers<B>>,
}

impl<B: Backend> Default for Workspace<B> {
    fn default() -> Self {
        Self { tokens: 0, bufs: None }
    }
}

struct Buffers<B: Backend> {
    x: B::Buf,
    normed: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
    proj: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    act: B::Buf,
    qk_tmp: Option<B::Buf>,
    /// `[logit_rows, vocab]`, grown to the most sampled rows seen.
    logits: B::Buf,
    logit_rows: usize,
    /// `[tokens, head_dim]`: the step's cos|sin rows (see [`Model`]'s `inv_freq`), built on the
    /// host in `rope_host` and written here.
    rope: B::Buf,
    rope_host: Vec<f32>,
    /// `0, 1, 2, ...`: the positions the kernel reads `rope` at.
    rows_in_order: Vec<u32>,
}

impl<B: Backend> Workspace<B> {
    /// Tokens the buffers are sized for (0 when none are allocated).
    pub fn tokens(&self) -> usize {
        if self.bufs.is_some() {
            self.tokens
        } else {
            0
        }
    }

    fn ensure(&mut self, backend: &B, c: &ModelConfig, t: usize) -> Result<&mut Buffers<B>> {
        if self.bufs.is_none() || t > self.tokens {
            let (h, i, qd, kvd) = (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.kv_width());
            let t = t.max(1);
            self.bufs = None; // free the old buffers before allocating the new ones
            self.bufs = Some(Buffers {
                x: backend.alloc_zeros(t * h)?,
                normed: backend.alloc_zeros(t * h)?,
                q: backend.alloc_zeros(t * qd)?,
                k: backend.alloc_zeros(t * kvd)?,
                v: backend.alloc_zeros(t * kvd)?,
                attn: backend.alloc_zeros(t * qd)?,
                proj: backend.alloc_zeros(t * h)?,
                gate: backend.alloc_zeros(t * i)?,
                up: backend.alloc_zeros(t * i)?,
                act: backend.alloc_zeros(t * i)?,
                qk_tmp: if c.qk_norm { Some(backend.alloc_zeros(t * qd)?) } else { None },
                logits: backend.alloc_zeros(0)?,
                logit_rows: 0,
                rope: backend.alloc_zeros(t * c.head_dim)?,
                rope_host: Vec::with_capacity(t * c.head_dim),
                rows_in_order: (0..t as u32).collect(),
            });
            self.tokens = t;
        }
        Ok(self.bufs.as_mut().expect("allocated above"))
    }
}
