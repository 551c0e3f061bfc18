//! Keys of full KV blocks in the prefix cache: the functions live in
//! [`cleave_protocol::prefix`] (the coordinator computes the same keys to route by prefix-cache
//! overlap); this module adds the pass-through hasher for maps keyed by them.

use std::hash::{BuildHasherDefault, Hasher};

pub use cleave_protocol::prefix::{block_hash, hash_chain, ROOT_HASH};

/// A pass-through hasher for maps keyed by [`block_hash`] values, which are already mixed.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// `BuildHasher` for [`IdentityHasher`].
pub type BuildIdentity = BuildHasherDefault<IdentityHasher>;
