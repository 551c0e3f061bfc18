//! Helpers shared by the kv-transfer integration tests.
#![allow(dead_code)]

use bytes::Bytes;
use cleave_kv_transfer::frame::{checksum, run_bytes, ChunkHeader, Frame};
use cleave_kv_transfer::LayerChunk;
use cleave_protocol::{KvDtype, KvLayout, LeaseId};

/// A small layout: 3 layers, 2 KV heads, head dim 4, f32, 4 tokens per block (32 B per token
/// per layer for K).
pub fn layout() -> KvLayout {
    KvLayout {
        model_fingerprint: 0xC1EA_7E00,
        dtype: KvDtype::F32,
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 4,
    }
}

/// Deterministic K (or V, `which` = 1) bytes of tokens `start..start+count` of `layer`:
/// f32 values that encode (which, layer, token, element), little-endian.
pub fn kv_bytes(layout: &KvLayout, which: u32, layer: u32, start: u32, count: u32) -> Bytes {
    let per_tok = (layout.num_kv_heads * layout.head_dim) as usize;
    let mut out = Vec::with_capacity(run_bytes(layout, count));
    for t in start..start + count {
        for e in 0..per_tok {
            let x = (which * 1_000_000 + layer * 10_000 + t * 10 + e as u32 % 10) as f32 + e as f32 / 1024.0;
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    Bytes::from(out)
}

pub fn chunk(layout: &KvLayout, layer: u32, start: u32, count: u32) -> LayerChunk {
    LayerChunk {
        layer,
        token_start: start,
        token_count: count,
        k: kv_bytes(layout, 0, layer, start, count),
        v: kv_bytes(layout, 1, layer, start, count),
    }
}

/// A chunk frame as the receiver decodes it.
pub fn chunk_frame(layout: &KvLayout, lease: LeaseId, layer: u32, start: u32, count: u32) -> Frame {
    let c = chunk(layout, layer, start, count);
    let header = ChunkHeader {
        lease_id: lease,
        layer,
        token_start: start,
        token_count: count,
        k_len: c.k.len() as u32,
        v_len: c.v.len() as u32,
        crc32: checksum(&c.k, &c.v),
    };
    Frame::Chunk { header, k: c.k, v: c.v }
}

/// The chunks of a prefill of `num_tokens` tokens done in prefill chunks of `step` tokens:
/// for each prefill chunk, every layer in order.
pub fn prefill_chunks(layout: &KvLayout, num_tokens: u32, step: u32) -> Vec<LayerChunk> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < num_tokens {
        let n = step.min(num_tokens - start);
        for layer in 0..layout.num_layers {
            out.push(chunk(layout, layer, start, n));
        }
        start += n;
    }
    out
}
