//! Stable 64-bit hashes that key full KV blocks in the prefix cache. They live here, not in the
//! engine, because the coordinator computes the same keys to route requests by prefix-cache
//! overlap without depending on the engine.
//!
//! A block's key is `block_hash(parent, tokens)`, where `parent` is the key of the block before
//! it ([`ROOT_HASH`] for the first block), so one key names a whole prefix. The function is fixed
//! (FxHash-style word mixing plus the murmur3 finaliser, constant seed) so that every process of
//! a cluster computes the same keys: the coordinator routes on them. It is not cryptographic;
//! the pool therefore also stores each block's parent key and token ids and compares them on a
//! hit.

/// The parent key of a sequence's first block.
pub const ROOT_HASH: u64 = 0xcbf2_9ce4_8422_2325;

const SEED: u64 = 0x9e37_79b9_7f4a_7c15;
const MUL: u64 = 0x517c_c1b7_2722_0a95;

#[inline]
fn mix(h: u64, word: u64) -> u64 {
    (h.rotate_left(5) ^ word).wrapping_mul(MUL)
}

#[inline]
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// Key of a block holding `tokens` whose preceding prefix has key `parent`.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(mix(SEED, parent), tokens.len() as u64);
    for pair in tokens.chunks(2) {
        let hi = pair.get(1).map_or(0, |&t| u64::from(t) << 32);
        h = mix(h, u64::from(pair[0]) | hi);
    }
    fmix64(h)
}

/// Keys of every *full* block of `tokens` (a trailing partial block has none), in order.
pub fn hash_chain(tokens: &[u32], block_size: usize) -> impl Iterator<Item = u64> + '_ {
    tokens.chunks_exact(block_size.max(1)).scan(ROOT_HASH, |parent, chunk| {
        *parent = block_hash(*parent, chunk);
        Some(*parent)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_golden_values() {
        // Pinned: other processes (and the coordinator) must compute the same keys.
        let h = block_hash(ROOT_HASH, &[1, 2, 3, 4]);
        assert_eq!(h, block_hash(ROOT_HASH, &[1, 2, 3, 4]));
        assert_eq!(format!("{h:016x}"), GOLDEN);
    }
    const GOLDEN: &str = "76158950a67cbe08";

    #[test]
    fn distinguishes_order_parent_and_length() {
        let a = block_hash(ROOT_HASH, &[1, 2, 3, 4]);
        assert_ne!(a, block_hash(ROOT_HASH, &[2, 1, 3, 4]));
        assert_ne!(a, block_hash(ROOT_HASH ^ 1, &[1, 2, 3, 4]));
        assert_ne!(block_hash(ROOT_HASH, &[1, 0]), block_hash(ROOT_HASH, &[1]));
        assert_ne!(block_hash(ROOT_HASH, &[0]), block_hash(ROOT_HASH, &[]));
    }

    #[test]
    fn chain_covers_full_blocks_only() {
        let toks: Vec<u32> = (0..10).collect();
        let chain: Vec<u64> = hash_chain(&toks, 4).collect();
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[0], block_hash(ROOT_HASH, &toks[0..4]));
        assert_eq!(chain[1], block_hash(chain[0], &toks[4..8]));
    }
}
