//! Profiles shared by the simulator's test files.
#![allow(dead_code)]

use cleave_bench::sim::{DecodePoint, PrefillPoint, Profile};

/// Prefill costs `prefill_per_token · n` (linear, so interpolation is exact); a decode step costs
/// `decode_s` at batch 1, twice that at batch 64, linear between, whatever the context. The
/// engine limits (2048-token steps, 64 sequences, 1000 B of KV a token, no mixed points) are
/// [`Profile::synthetic`]'s; the KV capacity is large enough never to bind.
pub fn linear_profile(prefill_per_token: f64, decode_s: f64) -> Profile {
    Profile {
        kv_capacity_tokens: 1 << 20,
        prefill: [8usize, 64, 256, 1024, 4096]
            .iter()
            .map(|&n| PrefillPoint { tokens: n, cached_prefix: 0, seconds: prefill_per_token * n as f64 })
            .collect(),
        decode: [1usize, 64]
            .iter()
            .flat_map(|&b| {
                [128usize, 8192].map(|c| DecodePoint { batch: b, context: c, seconds: decode_at(decode_s, b) })
            })
            .collect(),
        ..Profile::synthetic()
    }
}

/// The decode step of [`linear_profile`] at `batch`.
pub fn decode_at(decode_s: f64, batch: usize) -> f64 {
    decode_s * (1.0 + (batch - 1) as f64 / 63.0)
}
