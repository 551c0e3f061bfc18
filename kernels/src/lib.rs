//! Compute kernels of cleave behind one [`Backend`] trait.
//!
//! The model code in `engine` calls a `Backend` for every operation on activations, weights and
//! the KV cache, so a second backend (CUDA through cudarc, feature `cuda`) slots in without
//! touching the model. Every op also has a naive, obviously-correct implementation in
//! [`reference`] that tests compare backends against.
//!
//! Allowed dependencies: none of cleave's other crates. Buffers hold f32, except the KV cache
//! pools ([`Backend::KvBuf`]), which hold elements of a [`CacheDtype`]; layouts are row-major.
//!
//! Layout conventions (shared by every backend):
//! - Activations of a batch are packed token-major: `[num_tokens, width]`.
//! - Linear weights use Hugging Face's layout `[out_features, in_features]`. A backend may keep
//!   its own layout for weights it prepares once ([`Backend::prepare_linear`]). Weights in a
//!   block-quantized format ([`quant`]) may stay in it ([`Backend::prepare_linear_quantized`]),
//!   and 16-bit ones in 16 bits ([`Backend::prepare_linear_half`]).
//! - A KV cache pool of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]`, one pool
//!   for K and one for V. Token `t` of a sequence lives in block `block_table[t / block_size]`
//!   at row `t % block_size`. A pool stores f32, f16 or bf16 ([`CacheDtype`]): writes round f32
//!   to the pool's type (to nearest, ties to even), attention converts back to f32 as it reads;
//!   everything else about the op is the same. Offsets and lengths of pools count elements.
//! - Buffers may be longer than a call needs: an op reads and writes only the leading elements
//!   its size arguments describe (so the engine can reuse max-size workspaces). Every op checks
//!   sizes, token ids, positions, slots and block ids first and returns [`KernelError::Shape`]
//!   without touching its outputs when one is out of range.

mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod half;
pub mod measure;
pub mod quant;
pub mod reference;

pub use cpu::CpuBackend;
pub use half::{HalfFormat, HalfMatrix};
pub use quant::{QuantFormat, QuantMatrix};

/// Errors of the kernels crate.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("backend out of memory allocating {bytes} bytes")]
    OutOfMemory { bytes: usize },
    #[error("backend `{backend}` failed: {detail}")]
    Device { backend: &'static str, detail: String },
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// What the rows of a `linear` call are ([`Backend::linear_prepared_rows`]).
///
/// Why a backend cares: the CPU backend's integer kernels for quantized weights round the
/// activations to 8 bits. On a prompt that noise reaches the K/V and the hidden state the first
/// answer token is sampled from (it had flipped SmolLM2's first answer token on a near-tie), so
/// prompt rows beyond a handful take the f32 path. A decode row is rounded the same way alone
/// (batch 1 always takes the integer kernels) as in a batch, so decode batches cost no accuracy
/// on them and keep them for as long as they are the faster kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every row is one sequence's next token (a decode step).
    Decode,
    /// Prompt tokens among them (a prefill chunk, or a step mixing prefill and decode).
    Prompt,
}

/// The element type of a KV cache pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheDtype {
    F32,
    /// IEEE half precision (5-bit exponent, 10-bit mantissa).
    F16,
    /// bfloat16 (f32's 8-bit exponent, 7-bit mantissa).
    Bf16,
}

impl CacheDtype {
    /// Bytes of one element.
    pub fn size_bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::F16 | CacheDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::F16 => "f16",
            CacheDtype::Bf16 => "bf16",
        }
    }
}

/// How RoPE frequencies are derived (Hugging Face `rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: u32,
    },
}

/// What a prepared linear weight is ([`Backend::linear_info`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearInfo {
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Bytes one multiply reads of the weight as the backend holds it.
    pub bytes: usize,
    /// "f32", or the name of the quantized format it is held in ("Q4_1").
    pub format: &'static str,
}

/// One sequence's share of a batched paged-attention call.
///
/// The sequence's queries are rows `q_start .. q_start + q_len` of the packed query tensor; they
/// are the *last* `q_len` tokens of a context of `context_len` tokens whose K/V (new tokens
/// included) are already written to the cache. Query `i` is at position `context_len - q_len + i`
/// and attends causally to keys `0 ..= that position`. A decode step is `q_len == 1`; a prefill
/// chunk over a cached prefix has `context_len > q_len`.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub q_start: usize,
    pub q_len: usize,
    pub context_len: usize,
    pub block_table: &'a [u32],
}

/// Shape facts of a paged attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Usually `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// A compute backend. Methods take explicit sizes and check them against the buffers, returning
/// [`KernelError::Shape`] rather than panicking.
///
/// This trait is wider than STYLE.md's ~8 methods on purpose: it is the op set of a transformer,
/// one method per kernel, and splitting it would only scatter the same contract.
pub trait Backend: Send + Sync + 'static {
    /// A device buffer of f32.
    type Buf: Send + Sync;
    /// A linear layer's weight in the layout this backend multiplies fastest, made once at load by
    /// [`Backend::prepare_linear`] (the CPU packs it into column panels for its micro-kernel; a GPU
    /// backend could keep the plain layout or tile it for its tensor cores).
    type Linear: Send + Sync;
    /// One layer's K (or V) cache pool, holding elements of a [`CacheDtype`].
    type KvBuf: Send + Sync;

    fn name(&self) -> &'static str;

    fn alloc_zeros(&self, len: usize) -> Result<Self::Buf>;
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Copies `len` elements from `src[src_off..]` to `dst[dst_off..]`.
    fn copy(&self, src: &Self::Buf, src_off: usize, dst: &mut Self::Buf, dst_off: usize, len: usize) -> Result<()>;
    /// Writes host data into `dst[dst_off..]`.
    fn write(&self, dst: &mut Self::Buf, dst_off: usize, host: &[f32]) -> Result<()>;
    /// Reads `len` elements of `src[src_off..]` into host memory.
    fn read(&self, src: &Self::Buf, src_off: usize, len: usize) -> Result<Vec<f32>>;

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: Option<&Self::Buf>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// Prepares the linear weight `w: [n, k]` (Hugging Face layout, host memory) for
    /// [`Backend::linear_prepared`]. Called once per weight at load.
    fn prepare_linear(&self, w: &[f32], n: usize, k: usize) -> Result<Self::Linear>;
    /// Prepares a block-quantized linear weight `[n, k]` ([`QuantMatrix`]) for
    /// [`Backend::linear_prepared`]. A backend with kernels for the format keeps the weight in
    /// it (the CPU multiplies the blocks directly, so a decode step reads the quantized bytes);
    /// this default dequantizes it and calls [`Backend::prepare_linear`].
    fn prepare_linear_quantized(&self, w: QuantMatrix) -> Result<Self::Linear> {
        self.prepare_linear(&w.to_f32(), w.n(), w.k())
    }
    /// Prepares a 16-bit linear weight `[n, k]` ([`HalfMatrix`]: f16 or bf16) for
    /// [`Backend::linear_prepared`]. The CPU keeps it in 16 bits (half the bytes of f32 per
    /// decode step) and widens it to f32 in registers, so its products equal the f32 ones over
    /// the widened weights; this default widens it and calls [`Backend::prepare_linear`].
    fn prepare_linear_half(&self, w: HalfMatrix) -> Result<Self::Linear> {
        self.prepare_linear(&w.to_f32(), w.n(), w.k())
    }
    /// The shape, bytes and format of a prepared weight (what a decode step reads of it).
    fn linear_info(&self, w: &Self::Linear) -> LinearInfo;
    /// Runs `f` (a whole forward pass) where this backend's kernels fork from best. The CPU
    /// backend runs it on one of its pool's threads: each parallel kernel `f` calls then forks
    /// from a worker that takes part in the work, instead of waking the pool from outside and
    /// sleeping until it is done (two futex round trips per kernel, ~450 kernels a decode
    /// step). The default runs `f` where it is called.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    /// [`Backend::linear`] with a prepared weight: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`.
    fn linear_prepared(
        &self,
        x: &Self::Buf,
        w: &Self::Linear,
        bias: Option<&Self::Buf>,
        m: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// [`Backend::linear_prepared_many`] told what the `m` rows are ([`Rows`]), for a backend
    /// whose fastest kernel at some row counts is one it keeps for rows of one kind. This
    /// default ignores the kind.
    fn linear_prepared_rows(
        &self,
        x: &Self::Buf,
        ws: &[(&Self::Linear, Option<&Self::Buf>)],
        rows: Rows,
        m: usize,
        outs: &mut [&mut Self::Buf],
    ) -> Result<()> {
        let _ = rows;
        self.linear_prepared_many(x, ws, m, outs)
    }
    /// [`Backend::linear_prepared`] of several weights with the same `k` on the same `x` (q/k/v,
    /// gate/up): `outs[i] = x · ws[i].0ᵀ (+ ws[i].1)`. A backend may run them as one parallel
    /// region; this default runs them one after another.
    fn linear_prepared_many(
        &self,
        x: &Self::Buf,
        ws: &[(&Self::Linear, Option<&Self::Buf>)],
        m: usize,
        outs: &mut [&mut Self::Buf],
    ) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(KernelError::Shape {
                op: "linear_prepared_many",
                detail: format!("{} weights but {} outputs", ws.len(), outs.len()),
            });
        }
        for ((w, bias), out) in ws.iter().zip(outs.iter_mut()) {
            self.linear_prepared(x, w, *bias, m, out)?;
        }
        Ok(())
    }
    /// `out[t] = w[ids[t]]`: rows of a prepared weight `[n, k]` (an embedding table tied to the LM
    /// head, kept only in its prepared form).
    fn embedding_prepared(&self, w: &Self::Linear, ids: &[u32], out: &mut Self::Buf) -> Result<()>;
    /// Row-wise RMSNorm: `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// In-place RoPE in Hugging Face's rotate-half form on `x: [num_tokens, num_heads, head_dim]`.
    /// Token `t` rotates by row `positions[t]` of `cos_sin`, `[rows, head_dim]`: the first
    /// `head_dim/2` entries of a row are cos, the last `head_dim/2` are sin. The table of every
    /// position ([`rope_table`]) read at the tokens' positions, or a step's own rows
    /// ([`rope_rows`]) read at `0..num_tokens`, which is what the engine passes.
    fn rope(
        &self,
        x: &mut Self::Buf,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &Self::Buf,
    ) -> Result<()>;
    /// `out[t, i] = silu(gate[t, i]) * up[t, i]`.
    fn silu_mul(&self, gate: &Self::Buf, up: &Self::Buf, len: usize, out: &mut Self::Buf) -> Result<()>;
    /// `x += y` over the first `len` elements.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf, len: usize) -> Result<()>;
    /// Row-wise softmax of `x: [rows, dim]` in place.
    fn softmax(&self, x: &mut Self::Buf, rows: usize, dim: usize) -> Result<()>;
    /// `out[t] = table[ids[t]]` for a table `[vocab, dim]`.
    fn embedding(&self, table: &Self::Buf, ids: &[u32], vocab: usize, dim: usize, out: &mut Self::Buf) -> Result<()>;
    /// `out[i] = x[rows[i]]` for `x: [_, dim]`.
    fn gather_rows(&self, x: &Self::Buf, rows: &[u32], dim: usize, out: &mut Self::Buf) -> Result<()>;
    /// A zeroed KV cache pool of `len` elements of `dtype`.
    fn alloc_kv(&self, dtype: CacheDtype, len: usize) -> Result<Self::KvBuf>;
    /// A pool's element type and its length in elements.
    fn kv_info(&self, buf: &Self::KvBuf) -> (CacheDtype, usize);
    /// Bytes of a pool that occupy host memory now. A CPU pool's pages cost memory only once
    /// touched, so this grows with the blocks a node has used, up to the pool's size; it is what
    /// separates a node's bounded KV growth from a leak in its resident size.
    fn kv_resident_bytes(&self, buf: &Self::KvBuf) -> usize;
    /// Appends elements `off..off + len` of a pool to `out` as they are stored: little-endian,
    /// `size_bytes()` each, no conversion (the wire layout of a KV handoff).
    fn read_kv_bytes(&self, src: &Self::KvBuf, off: usize, len: usize, out: &mut Vec<u8>) -> Result<()>;
    /// Writes elements in the layout of [`Backend::read_kv_bytes`] to `dst[off..]` (their count is
    /// `bytes.len() / size_bytes()`, which must divide evenly).
    fn write_kv_bytes(&self, dst: &mut Self::KvBuf, off: usize, bytes: &[u8]) -> Result<()>;
    /// Copies `len` elements of a pool from `src_off` to `dst_off` (a copy-on-write block copy);
    /// the ranges must not overlap.
    fn copy_kv(&self, buf: &mut Self::KvBuf, src_off: usize, dst_off: usize, len: usize) -> Result<()>;
    /// Writes `k, v: [num_tokens, num_kv_heads, head_dim]` into the cache pools at the flat slots
    /// `slots[t] = block_id * block_size + row`, rounding to the pools' element type (to nearest,
    /// ties to even). Both pools must have the same type.
    fn write_kv(
        &self,
        k: &Self::Buf,
        v: &Self::Buf,
        slots: &[u32],
        kv_width: usize,
        k_cache: &mut Self::KvBuf,
        v_cache: &mut Self::KvBuf,
    ) -> Result<()>;
    /// Causal paged attention for a packed batch of sequences (prefill chunks and decode tokens
    /// alike). `q, out: [num_tokens, num_heads, head_dim]`; GQA maps query head `h` to KV head
    /// `h / (num_heads / num_kv_heads)`. Keys and values are read as f32 whatever the pools
    /// store (both pools must have the same type).
    fn paged_attention(
        &self,
        q: &Self::Buf,
        k_cache: &Self::KvBuf,
        v_cache: &Self::KvBuf,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
        out: &mut Self::Buf,
    ) -> Result<()>;
}

/// Inverse frequencies of RoPE for `head_dim`, with Hugging Face's scaling rules applied.
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f32> {
    reference::rope_inv_freq(head_dim, theta, scaling)
}

/// The `[max_positions, head_dim]` cos|sin table that [`Backend::rope`] reads.
pub fn rope_table(inv_freq: &[f32], max_positions: usize) -> Vec<f32> {
    reference::rope_table(inv_freq, max_positions)
}

/// The rows of [`rope_table`] for `positions` only, in their order (row `r` is position
/// `positions[r]`'s, bit for bit), into `out`: a step's table, which [`Backend::rope`] reads with
/// the positions `0..positions.len()`. A model keeps no table of every position: at 131,072
/// positions and a head of 128 that would be 64 MiB.
pub fn rope_rows(inv_freq: &[f32], positions: &[u32], out: &mut Vec<f32>) {
    reference::rope_rows(inv_freq, positions, out)
}
