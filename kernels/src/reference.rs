//! Naive, obviously-correct implementations of every kernel, on plain slices.
//!
//! These are the ground truth that backends are tested against: loops written the way the math
//! reads, sums accumulated in f64, no blocking or parallelism. They validate sizes exactly like
//! the backends (through the shared `check` module) and return [`KernelError::Shape`] instead of
//! panicking.
//!
//! RoPE follows Hugging Face transformers bit for bit where it matters: the inverse frequencies,
//! their scaling and the `position * inv_freq` angles are computed in f32 in the same order as
//! torch, and the rotation is the rotate-half form without fused multiply-adds.

use crate::check;
use crate::{AttnSeq, AttnShape, CacheDtype, KernelError, Result, RopeScaling};
use half::{bf16, f16};

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`.
pub fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32]) -> Result<()> {
    check::linear(x.len(), w.len(), bias.map(<[f32]>::len), (m, k, n), out.len())?;
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            for p in 0..k {
                acc += x[i * k + p] as f64 * w[j * k + p] as f64;
            }
            let b = bias.map_or(0.0, |b| b[j]);
            out[i * n + j] = acc as f32 + b;
        }
    }
    Ok(())
}

/// Row-wise RMSNorm in Hugging Face's order: `weight * (x * rsqrt(mean(x²) + eps))`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, rows: usize, dim: usize, out: &mut [f32]) -> Result<()> {
    check::rms_norm(x.len(), weight.len(), rows, dim, out.len())?;
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let mean_sq = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim.max(1) as f64;
        let inv = 1.0 / (mean_sq as f32 + eps).sqrt();
        for (c, &v) in row.iter().enumerate() {
            out[r * dim + c] = weight[c] * (v * inv);
        }
    }
    Ok(())
}

/// Inverse frequencies of RoPE (`head_dim / 2` of them) with Hugging Face's scaling rules.
///
/// Mirrors `_compute_default_rope_parameters` (`1 / theta^(2i / head_dim)` in f32),
/// `_compute_linear_scaling_rope_parameters` (`inv_freq / factor`) and
/// `_compute_llama3_parameters`. Python-float constants are rounded to f32 where torch rounds them
/// (a scalar operand of an f32 tensor op), and `pow` is computed in f64 and rounded once, which is
/// the correctly-rounded f32 result torch's vectorized `pow` returns.
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f32> {
    let half = head_dim / 2;
    let default: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (2 * i) as f32 / head_dim as f32;
            let pow = (theta as f64).powf(exponent as f64) as f32;
            1.0f32 / pow
        })
        .collect();
    match *scaling {
        RopeScaling::None => default,
        RopeScaling::Linear { factor } => default.iter().map(|&f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let old = original_max_position_embeddings as f64;
            // Python floats, compared against f32 tensors: torch rounds them to f32.
            let low_freq_wavelen = (old / low_freq_factor as f64) as f32;
            let high_freq_wavelen = (old / high_freq_factor as f64) as f32;
            let factor_span = (high_freq_factor as f64 - low_freq_factor as f64) as f32;
            let two_pi = (2.0 * std::f64::consts::PI) as f32;
            default
                .iter()
                .map(|&inv_freq| {
                    let wavelen = two_pi / inv_freq;
                    let llama = if wavelen > low_freq_wavelen { inv_freq / factor } else { inv_freq };
                    // Written as torch's `~(wavelen < high) * ~(wavelen > low)`.
                    #[allow(clippy::neg_cmp_op_on_partial_ord)]
                    let medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
                    if medium {
                        let smooth = (old as f32 / wavelen - low_freq_factor) / factor_span;
                        (1.0 - smooth) * llama / factor + smooth * llama
                    } else {
                        llama
                    }
                })
                .collect()
        }
    }
}

/// The `[max_positions, head_dim]` table of [`crate::Backend::rope`]: row `p` holds
/// `cos(p * inv_freq[i])` for `i < head_dim/2`, then the matching sines.
///
/// The angle is the f32 product `(p as f32) * inv_freq[i]`, exactly what torch's
/// `inv_freq @ position_ids` produces; cos and sin are then correctly rounded to f32.
pub fn rope_table(inv_freq: &[f32], max_positions: usize) -> Vec<f32> {
    let half = inv_freq.len();
    let mut table = vec![0f32; max_positions * 2 * half];
    for (p, row) in table.chunks_exact_mut(2 * half).enumerate() {
        rope_row(inv_freq, p as u32, row);
    }
    table
}

/// The rows of [`rope_table`] for `positions` only, in their order, into `out` (cleared first):
/// row `r` of `out` is row `positions[r]` of the table, bit for bit.
pub fn rope_rows(inv_freq: &[f32], positions: &[u32], out: &mut Vec<f32>) {
    let width = 2 * inv_freq.len();
    out.clear();
    out.resize(positions.len() * width, 0.0);
    if width == 0 {
        return;
    }
    for (&p, row) in positions.iter().zip(out.chunks_exact_mut(width)) {
        rope_row(inv_freq, p, row);
    }
}

/// One row of [`rope_table`]: cos then sin of `p * inv_freq[i]`.
fn rope_row(inv_freq: &[f32], p: u32, row: &mut [f32]) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let angle = (p as f32 * f) as f64;
        row[i] = angle.cos() as f32;
        row[half + i] = angle.sin() as f32;
    }
}

/// In-place rotate-half RoPE on `x: [positions.len(), num_heads, head_dim]`:
/// `x * cos + rotate_half(x) * sin` with `rotate_half(x) = [-x[half..], x[..half]]`.
pub fn rope(x: &mut [f32], positions: &[u32], num_heads: usize, head_dim: usize, cos_sin: &[f32]) -> Result<()> {
    check::rope(x.len(), positions, num_heads, head_dim, cos_sin.len())?;
    let half = head_dim / 2;
    for (t, &p) in positions.iter().enumerate() {
        let row = &cos_sin[p as usize * head_dim..(p as usize + 1) * head_dim];
        let (cos, sin) = row.split_at(half);
        for h in 0..num_heads {
            let v = &mut x[(t * num_heads + h) * head_dim..(t * num_heads + h + 1) * head_dim];
            for i in 0..half {
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * cos[i] + -b * sin[i];
                v[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
    Ok(())
}

/// `silu(x) = x * sigmoid(x)`, computed as `x / (1 + exp(-x))`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `out[i] = silu(gate[i]) * up[i]` for `i < len`.
pub fn silu_mul(gate: &[f32], up: &[f32], len: usize, out: &mut [f32]) -> Result<()> {
    check::silu_mul(gate.len(), up.len(), len, out.len())?;
    for i in 0..len {
        out[i] = silu(gate[i]) * up[i];
    }
    Ok(())
}

/// `x[i] += y[i]` for `i < len`.
pub fn add_assign(x: &mut [f32], y: &[f32], len: usize) -> Result<()> {
    check::add_assign(x.len(), y.len(), len)?;
    for i in 0..len {
        x[i] += y[i];
    }
    Ok(())
}

/// Row-wise softmax in place (max-subtracted).
pub fn softmax(x: &mut [f32], rows: usize, dim: usize) -> Result<()> {
    check::softmax(x.len(), rows, dim)?;
    for r in 0..rows {
        let row = &mut x[r * dim..(r + 1) * dim];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
        for v in row.iter_mut() {
            *v = (((*v - max) as f64).exp() / sum) as f32;
        }
    }
    Ok(())
}

/// `out[t] = table[ids[t]]` for `table: [vocab, dim]`.
pub fn embedding(table: &[f32], ids: &[u32], vocab: usize, dim: usize, out: &mut [f32]) -> Result<()> {
    check::embedding(table.len(), ids, vocab, dim, out.len())?;
    for (t, &id) in ids.iter().enumerate() {
        out[t * dim..(t + 1) * dim].copy_from_slice(&table[id as usize * dim..(id as usize + 1) * dim]);
    }
    Ok(())
}

/// `out[i] = x[rows[i]]` for `x: [_, dim]`.
pub fn gather_rows(x: &[f32], rows: &[u32], dim: usize, out: &mut [f32]) -> Result<()> {
    check::gather_rows(x.len(), rows, dim, out.len())?;
    for (i, &r) in rows.iter().enumerate() {
        out[i * dim..(i + 1) * dim].copy_from_slice(&x[r as usize * dim..(r as usize + 1) * dim]);
    }
    Ok(())
}

/// Copies token `t` of `k, v: [slots.len(), kv_width]` to slot `slots[t]` of the cache pools.
pub fn write_kv(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    kv_width: usize,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
) -> Result<()> {
    check::write_kv(k.len(), v.len(), slots, kv_width, k_cache.len(), v_cache.len())?;
    for (t, &s) in slots.iter().enumerate() {
        let dst = s as usize * kv_width..(s as usize + 1) * kv_width;
        k_cache[dst.clone()].copy_from_slice(&k[t * kv_width..(t + 1) * kv_width]);
        v_cache[dst].copy_from_slice(&v[t * kv_width..(t + 1) * kv_width]);
    }
    Ok(())
}

/// What a KV cache of `dtype` keeps of `x`: `x` rounded to the element type (to nearest, ties to
/// even, by the `half` crate) and widened back to f32. A cache of that type is checked by writing
/// `kv_round`ed values with [`write_kv`] into an f32 pool and comparing.
pub fn kv_round(dtype: CacheDtype, x: f32) -> f32 {
    match dtype {
        CacheDtype::F32 => x,
        CacheDtype::F16 => f16::from_f32(x).to_f32(),
        CacheDtype::Bf16 => bf16::from_f32(x).to_f32(),
    }
}

/// The stored bytes of `x` in a cache of `dtype` (rounded as [`kv_round`], little-endian): the
/// layout of [`crate::Backend::read_kv_bytes`].
pub fn kv_encode(dtype: CacheDtype, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() * dtype.size_bytes());
    for &v in x {
        match dtype {
            CacheDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
            CacheDtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes()),
            CacheDtype::Bf16 => out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
        }
    }
    out
}

/// The f32 values of stored bytes of `dtype` (the inverse of [`kv_encode`] up to rounding).
/// Trailing bytes short of an element are ignored.
pub fn kv_decode(dtype: CacheDtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        CacheDtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        CacheDtype::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        CacheDtype::Bf16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
    }
}

/// Causal attention of one query row against keys/values fetched by `kv(t)` for `t <= pos`.
/// Two-pass softmax in f64.
fn attend_one<'a>(q: &[f32], pos: usize, scale: f32, kv: impl Fn(usize) -> (&'a [f32], &'a [f32]), out: &mut [f32]) {
    let scores: Vec<f64> = (0..=pos)
        .map(|t| {
            let k = kv(t).0;
            q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64
        })
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = weights.iter().sum();
    for (d, o) in out.iter_mut().enumerate() {
        let acc: f64 = weights.iter().enumerate().map(|(t, w)| w * kv(t).1[d] as f64).sum();
        *o = (acc / sum) as f32;
    }
}

/// Causal paged attention, the contract of [`crate::Backend::paged_attention`].
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    seqs: &[AttnSeq<'_>],
    shape: AttnShape,
    out: &mut [f32],
) -> Result<()> {
    let dims = check::paged_attention(q.len(), k_cache.len(), v_cache.len(), seqs, &shape, out.len())?;
    let (h, d, bs) = (shape.num_heads, shape.head_dim, shape.block_size);
    for s in seqs {
        for i in 0..s.q_len {
            let pos = s.context_len - s.q_len + i;
            let row = s.q_start + i;
            for head in 0..h {
                let kvh = head / dims.group;
                let kv = |t: usize| {
                    let slot = s.block_table[t / bs] as usize * bs + t % bs;
                    let off = slot * dims.kv_width + kvh * d;
                    (&k_cache[off..off + d], &v_cache[off..off + d])
                };
                let qo = (row * h + head) * d;
                attend_one(&q[qo..qo + d], pos, shape.scale, kv, &mut out[qo..qo + d]);
            }
        }
    }
    Ok(())
}

/// Causal GQA attention over contiguous K/V, the textbook form that [`paged_attention`] is checked
/// against. `q: [q_len, num_heads, head_dim]` holds the last `q_len` positions of a context whose
/// `k, v: [context_len, num_kv_heads, head_dim]` are given in full. `shape.block_size` is ignored.
/// Returns `[q_len, num_heads, head_dim]`.
pub fn dense_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_len: usize,
    context_len: usize,
    shape: AttnShape,
) -> Result<Vec<f32>> {
    const OP: &str = "dense_attention";
    check::attn_shape(OP, &AttnShape { block_size: 1, ..shape })?;
    let (h, kvh, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    if q_len > context_len {
        return Err(KernelError::Shape { op: OP, detail: format!("q_len {q_len} exceeds context_len {context_len}") });
    }
    let q_size = check::mul(OP, check::mul(OP, q_len, h)?, d)?;
    let kv_size = check::mul(OP, check::mul(OP, context_len, kvh)?, d)?;
    check::at_least(OP, "q", q.len(), q_size)?;
    check::at_least(OP, "k", k.len(), kv_size)?;
    check::at_least(OP, "v", v.len(), kv_size)?;
    let mut out = vec![0f32; q_size];
    for i in 0..q_len {
        let pos = context_len - q_len + i;
        for head in 0..h {
            let kv_head = head / (h / kvh);
            let kv = |t: usize| {
                let off = (t * kvh + kv_head) * d;
                (&k[off..off + d], &v[off..off + d])
            };
            let qo = (i * h + head) * d;
            attend_one(&q[qo..qo + d], pos, shape.scale, kv, &mut out[qo..qo + d]);
        }
    }
    Ok(out)
}
