//! Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts, per-sequence
//! block tables, copy-on-write, and automatic prefix caching keyed by hash chains.
//!
//! Allowed dependencies: std and thiserror. This module deals in block ids and token ids only;
//! the K/V bytes live in the model runner, which executes the `(src, dst)` block copies this
//! module asks for and writes K/V at the slots a block table names.
//!
//! Invariants:
//! - a block's refcount is 0 iff it is free or cached-evictable (see [`pool`]);
//! - a block is registered in the prefix cache only after its K/V has been computed
//!   ([`BlockPool::commit`]), never at allocation;
//! - a registered (cached) block is never written again: writers copy it first.

pub mod hash;
pub mod pool;
pub mod table;

pub use hash::{block_hash, hash_chain, ROOT_HASH};
pub use pool::{BlockPool, DEFAULT_BLOCK_SIZE};
pub use table::{BlockTable, PrefixHit};

/// What can go wrong in the block manager.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("kv pool exhausted: need {need} blocks, {available} available")]
    OutOfBlocks { need: usize, available: usize },
    #[error("invalid kv pool config: {what}")]
    InvalidConfig { what: &'static str },
    #[error("block {block} does not exist (the pool has {num_blocks})")]
    UnknownBlock { block: u32, num_blocks: usize },
    #[error("block {block} is not allocated")]
    NotAllocated { block: u32 },
    #[error("block table holds {capacity} token slots, asked for {requested}")]
    TableOverflow { requested: usize, capacity: usize },
    #[error("kv invariant violated at block {block}: {detail}")]
    Invariant { block: u32, detail: &'static str },
}
