//! Size validation shared by [`crate::reference`] and every backend, so that all of them accept
//! and reject exactly the same calls.
//!
//! Each function takes buffer lengths plus the op's size arguments and returns
//! [`KernelError::Shape`] naming the op and the offending fact. Products of sizes are computed with
//! overflow checks, so absurd sizes are an error rather than a panic.

use crate::{AttnSeq, AttnShape, KernelError, Result};

pub(crate) fn err(op: &'static str, detail: String) -> KernelError {
    KernelError::Shape { op, detail }
}

/// `a * b`, or a shape error when it overflows.
pub(crate) fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| err(op, format!("size {a} x {b} overflows")))
}

/// Requires `off .. off + count` to lie inside a buffer of `len` elements called `what`.
pub(crate) fn range(op: &'static str, what: &str, len: usize, off: usize, count: usize) -> Result<()> {
    let end = off.checked_add(count).ok_or_else(|| err(op, format!("{what} range overflows")))?;
    if end > len {
        return Err(err(op, format!("{what} range {off}..{end} exceeds buffer of {len}")));
    }
    Ok(())
}

/// Requires `len >= need` for the buffer called `what`.
pub(crate) fn at_least(op: &'static str, what: &str, len: usize, need: usize) -> Result<()> {
    if len < need {
        return Err(err(op, format!("{what} has {len} elements, needs at least {need}")));
    }
    Ok(())
}

pub(crate) fn linear(
    x: usize,
    w: usize,
    bias: Option<usize>,
    (m, k, n): (usize, usize, usize),
    out: usize,
) -> Result<()> {
    const OP: &str = "linear";
    at_least(OP, "x", x, mul(OP, m, k)?)?;
    at_least(OP, "w", w, mul(OP, n, k)?)?;
    if let Some(b) = bias {
        at_least(OP, "bias", b, n)?;
    }
    at_least(OP, "out", out, mul(OP, m, n)?)
}

/// Several weights `(n, k)` (with an optional bias length) on one `x` with `m` rows, each
/// writing an output of the given length: the same `k` for all, each a valid [`linear`].
/// Returns that `k` (`None` for no weights).
pub(crate) fn linear_many(
    x: usize,
    ws: impl ExactSizeIterator<Item = ((usize, usize), Option<usize>)>,
    m: usize,
    outs: impl ExactSizeIterator<Item = usize>,
) -> Result<Option<usize>> {
    const OP: &str = "linear_prepared_many";
    if ws.len() != outs.len() {
        return Err(err(OP, format!("{} weights but {} outputs", ws.len(), outs.len())));
    }
    let mut k0 = None;
    for (i, (((n, k), bias), out)) in ws.zip(outs).enumerate() {
        let k0 = *k0.get_or_insert(k);
        if k != k0 {
            return Err(err(OP, format!("weight {i} has k = {k}, weight 0 has k = {k0}")));
        }
        linear(x, n * k, bias, (m, k, n), out)?;
    }
    Ok(k0)
}

pub(crate) fn rms_norm(x: usize, weight: usize, rows: usize, dim: usize, out: usize) -> Result<()> {
    const OP: &str = "rms_norm";
    let total = mul(OP, rows, dim)?;
    at_least(OP, "x", x, total)?;
    at_least(OP, "weight", weight, dim)?;
    at_least(OP, "out", out, total)
}

pub(crate) fn rope(x: usize, positions: &[u32], num_heads: usize, head_dim: usize, table: usize) -> Result<()> {
    const OP: &str = "rope";
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(err(OP, format!("head_dim {head_dim} must be even and positive")));
    }
    let width = mul(OP, num_heads, head_dim)?;
    at_least(OP, "x", x, mul(OP, positions.len(), width)?)?;
    let max_positions = table / head_dim;
    if let Some((t, &p)) = positions.iter().enumerate().find(|(_, &p)| p as usize >= max_positions) {
        return Err(err(
            OP,
            format!("position {p} of token {t} is outside the cos/sin table of {max_positions} positions"),
        ));
    }
    Ok(())
}

pub(crate) fn silu_mul(gate: usize, up: usize, len: usize, out: usize) -> Result<()> {
    const OP: &str = "silu_mul";
    at_least(OP, "gate", gate, len)?;
    at_least(OP, "up", up, len)?;
    at_least(OP, "out", out, len)
}

pub(crate) fn add_assign(x: usize, y: usize, len: usize) -> Result<()> {
    const OP: &str = "add_assign";
    at_least(OP, "x", x, len)?;
    at_least(OP, "y", y, len)
}

pub(crate) fn softmax(x: usize, rows: usize, dim: usize) -> Result<()> {
    const OP: &str = "softmax";
    at_least(OP, "x", x, mul(OP, rows, dim)?)
}

pub(crate) fn embedding(table: usize, ids: &[u32], vocab: usize, dim: usize, out: usize) -> Result<()> {
    const OP: &str = "embedding";
    at_least(OP, "table", table, mul(OP, vocab, dim)?)?;
    at_least(OP, "out", out, mul(OP, ids.len(), dim)?)?;
    if let Some((t, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(err(OP, format!("token id {id} at index {t} is outside the vocabulary of {vocab}")));
    }
    Ok(())
}

pub(crate) fn gather_rows(x: usize, rows: &[u32], dim: usize, out: usize) -> Result<()> {
    const OP: &str = "gather_rows";
    at_least(OP, "out", out, mul(OP, rows.len(), dim)?)?;
    let available = x.checked_div(dim).unwrap_or(usize::MAX);
    if let Some((i, &r)) = rows.iter().enumerate().find(|(_, &r)| r as usize >= available) {
        return Err(err(OP, format!("row {r} at index {i} is outside x of {available} rows")));
    }
    Ok(())
}

pub(crate) fn write_kv(
    k: usize,
    v: usize,
    slots: &[u32],
    kv_width: usize,
    k_cache: usize,
    v_cache: usize,
) -> Result<()> {
    const OP: &str = "write_kv";
    let need = mul(OP, slots.len(), kv_width)?;
    at_least(OP, "k", k, need)?;
    at_least(OP, "v", v, need)?;
    let capacity = k_cache.min(v_cache).checked_div(kv_width).unwrap_or(usize::MAX);
    if let Some((t, &s)) = slots.iter().enumerate().find(|(_, &s)| s as usize >= capacity) {
        return Err(err(OP, format!("slot {s} of token {t} is outside the cache of {capacity} slots")));
    }
    Ok(())
}

/// Facts derived from a validated paged-attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    /// `num_heads / num_kv_heads`.
    pub group: usize,
    /// `num_kv_heads * head_dim`: the width of one cached token.
    pub kv_width: usize,
}

pub(crate) fn attn_shape(op: &'static str, shape: &AttnShape) -> Result<()> {
    let AttnShape { num_heads, num_kv_heads, head_dim, block_size, .. } = *shape;
    if num_heads == 0 || num_kv_heads == 0 || head_dim == 0 || block_size == 0 {
        return Err(err(op, format!("zero dimension in {shape:?}")));
    }
    if num_heads % num_kv_heads != 0 {
        return Err(err(op, format!("num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")));
    }
    Ok(())
}

pub(crate) fn paged_attention(
    q: usize,
    k_cache: usize,
    v_cache: usize,
    seqs: &[AttnSeq<'_>],
    shape: &AttnShape,
    out: usize,
) -> Result<AttnDims> {
    const OP: &str = "paged_attention";
    attn_shape(OP, shape)?;
    let kv_width = mul(OP, shape.num_kv_heads, shape.head_dim)?;
    let q_width = mul(OP, shape.num_heads, shape.head_dim)?;
    let num_blocks = k_cache.min(v_cache) / mul(OP, shape.block_size, kv_width)?;
    let mut ranges = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter().enumerate() {
        if s.q_len > s.context_len {
            return Err(err(OP, format!("seq {i}: q_len {} exceeds context_len {}", s.q_len, s.context_len)));
        }
        let end =
            s.q_start.checked_add(s.q_len).ok_or_else(|| err(OP, format!("seq {i}: q_start + q_len overflows")))?;
        let blocks_needed = s.context_len.div_ceil(shape.block_size);
        if s.block_table.len() < blocks_needed {
            return Err(err(
                OP,
                format!(
                    "seq {i}: block table has {} blocks, context of {} tokens needs {blocks_needed}",
                    s.block_table.len(),
                    s.context_len
                ),
            ));
        }
        if let Some(&b) = s.block_table[..blocks_needed].iter().find(|&&b| b as usize >= num_blocks) {
            return Err(err(OP, format!("seq {i}: block id {b} is outside the cache of {num_blocks} blocks")));
        }
        if s.q_len > 0 {
            ranges.push((s.q_start, end, i));
        }
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(err(OP, format!("query rows of seqs {} and {} overlap", pair[0].2, pair[1].2)));
        }
    }
    let num_tokens = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let need = mul(OP, num_tokens, q_width)?;
    at_least(OP, "q", q, need)?;
    at_least(OP, "out", out, need)?;
    Ok(AttnDims { group: shape.num_heads / shape.num_kv_heads, kv_width })
}
