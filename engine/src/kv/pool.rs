//! The block allocator: reference counts, a free list, and the prefix cache with its LRU.
//!
//! Every block is in exactly one of three states:
//! - **free**: refcount 0, on the free list, holds no cache key;
//! - **cached-evictable**: refcount 0, registered in the prefix cache and on the LRU list;
//! - **in use**: refcount > 0 (it may also be registered in the prefix cache).
//!
//! Invariant (debug-asserted, checked by [`BlockPool::check_invariants`]): a block's refcount
//! is 0 iff it is free or cached-evictable. A fresh block is taken from the free list first; only
//! when that is empty is the least recently released cached block evicted (its key dropped).

use std::collections::{BTreeMap, HashMap};

use super::hash::{block_hash, BuildIdentity};
use super::KvError;

/// Default number of token slots per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug, Clone)]
struct CacheEntry {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    refcount: u32,
    /// Set while the block is registered in the prefix cache.
    cached: Option<CacheEntry>,
    /// Set while the block is cached-evictable (refcount 0 and on the LRU list).
    lru_tick: Option<u64>,
}

/// A fixed set of `num_blocks` KV blocks of `block_size` token slots each, identified by
/// `u32` ids in `0..num_blocks`. Holds no K/V bytes: the model runner owns those and indexes
/// them by block id.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    prefix_caching: bool,
    meta: Vec<BlockMeta>,
    /// Stack of free blocks; the lowest ids are handed out first on a fresh pool.
    free: Vec<u32>,
    /// Prefix-cache key -> block id, for every registered block (in use or evictable).
    cache: HashMap<u64, u32, BuildIdentity>,
    /// Cached-evictable blocks by release tick; the first entry is evicted first.
    lru: BTreeMap<u64, u32>,
    tick: u64,
    /// One past the highest block id ever handed out. Fresh blocks go lowest id first and freed
    /// ones are reused before them (the free list is a stack), so the blocks ever used are
    /// exactly `0..high_water`: the part of the cache whose memory has been touched.
    high_water: u32,
}

impl BlockPool {
    /// A pool with every block free and prefix caching on.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return Err(KvError::InvalidConfig { what: "num_blocks must be in 1..=u32::MAX" });
        }
        if block_size == 0 {
            return Err(KvError::InvalidConfig { what: "block_size must be at least 1" });
        }
        Ok(Self {
            block_size,
            prefix_caching: true,
            meta: vec![BlockMeta::default(); num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            cache: HashMap::default(),
            lru: BTreeMap::new(),
            tick: 0,
            high_water: 0,
        })
    }

    /// Turns automatic prefix caching on or off (when off, nothing is ever registered).
    pub fn with_prefix_caching(mut self, enabled: bool) -> Self {
        self.prefix_caching = enabled;
        self
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks on the free list (refcount 0, not cached).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Cached-evictable blocks (refcount 0, still holding a reusable prefix).
    pub fn num_cached(&self) -> usize {
        self.lru.len()
    }

    /// Blocks registered in the prefix cache, in use or not.
    pub fn num_cached_total(&self) -> usize {
        self.cache.len()
    }

    /// Blocks a caller could obtain now: free plus cached-evictable.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks ever handed out (see `high_water`): what of the cache's memory has been written,
    /// which a CPU cache backs with pages on first use and keeps. It grows to the pool's size on
    /// a busy node and never shrinks.
    pub fn num_touched(&self) -> usize {
        self.high_water as usize
    }

    /// Blocks with refcount > 0.
    pub fn num_in_use(&self) -> usize {
        self.num_blocks() - self.num_available()
    }

    /// Fraction of blocks in use, in [0, 1].
    pub fn usage(&self) -> f32 {
        self.num_in_use() as f32 / self.num_blocks() as f32
    }

    /// Number of blocks needed to hold `num_tokens` token slots.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The reference count of `block`, or `None` when out of range.
    pub fn refcount(&self, block: u32) -> Option<u32> {
        self.meta.get(block as usize).map(|m| m.refcount)
    }

    /// Whether `block` is registered in the prefix cache.
    pub fn is_cached(&self, block: u32) -> bool {
        self.meta.get(block as usize).is_some_and(|m| m.cached.is_some())
    }

    /// Keys of every block registered in the prefix cache, most worth reporting first: the
    /// blocks live sequences hold (in use), then the evictable ones from the most recently
    /// released, which are the last to be evicted. A coordinator that takes only the first `n`
    /// (a bounded report) thereby gets the prefixes most likely to still be here when a request
    /// it routes arrives, not an arbitrary subset of the table.
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        let key = |b: u32| self.meta[b as usize].cached.as_ref().map(|e| e.hash);
        let in_use = self.cache.values().copied().filter(|&b| self.meta[b as usize].refcount > 0);
        in_use.chain(self.lru.values().rev().copied()).filter_map(key)
    }

    fn meta_mut(&mut self, block: u32) -> Result<&mut BlockMeta, KvError> {
        let num_blocks = self.meta.len();
        self.meta.get_mut(block as usize).ok_or(KvError::UnknownBlock { block, num_blocks })
    }

    /// Takes a fresh block (refcount 1): from the free list, else by evicting the least
    /// recently released cached block.
    pub fn allocate(&mut self) -> Result<u32, KvError> {
        let block = if let Some(b) = self.free.pop() {
            b
        } else if let Some((_, b)) = self.lru.pop_first() {
            let m = &mut self.meta[b as usize];
            m.lru_tick = None;
            if let Some(entry) = m.cached.take() {
                self.cache.remove(&entry.hash);
            }
            b
        } else {
            return Err(KvError::OutOfBlocks { need: 1, available: 0 });
        };
        let m = &mut self.meta[block as usize];
        debug_assert!(m.refcount == 0 && m.cached.is_none() && m.lru_tick.is_none());
        m.refcount = 1;
        self.high_water = self.high_water.max(block + 1);
        Ok(block)
    }

    /// Takes `n` fresh blocks, all or nothing.
    pub fn allocate_n(&mut self, n: usize) -> Result<Vec<u32>, KvError> {
        let available = self.num_available();
        if n > available {
            return Err(KvError::OutOfBlocks { need: n, available });
        }
        (0..n).map(|_| self.allocate()).collect()
    }

    /// Adds a reference to a block that is in use or cached-evictable (reviving the latter).
    pub fn retain(&mut self, block: u32) -> Result<(), KvError> {
        let m = self.meta_mut(block)?;
        if m.refcount == 0 {
            let Some(tick) = m.lru_tick.take() else {
                return Err(KvError::NotAllocated { block });
            };
            self.lru.remove(&tick);
        }
        self.meta[block as usize].refcount += 1;
        Ok(())
    }

    /// Drops a reference. At 0 the block becomes cached-evictable if it is registered in the
    /// prefix cache, free otherwise.
    pub fn release(&mut self, block: u32) -> Result<(), KvError> {
        let m = self.meta_mut(block)?;
        if m.refcount == 0 {
            return Err(KvError::NotAllocated { block });
        }
        m.refcount -= 1;
        if m.refcount == 0 {
            if m.cached.is_some() {
                self.tick += 1;
                let tick = self.tick;
                self.meta[block as usize].lru_tick = Some(tick);
                self.lru.insert(tick, block);
            } else {
                self.free.push(block);
            }
        }
        Ok(())
    }

    /// Registers an in-use block whose K/V has been computed for `tokens` (one full block)
    /// following the prefix keyed `parent`. Returns whether it was registered: not when prefix
    /// caching is off, the block is already registered, or another block holds that key
    /// (the first one computed wins; this one stays private and is freed normally).
    pub fn register(&mut self, block: u32, parent: u64, tokens: &[u32]) -> Result<bool, KvError> {
        let block_size = self.block_size;
        let prefix_caching = self.prefix_caching;
        let m = self.meta_mut(block)?;
        if m.refcount == 0 {
            return Err(KvError::NotAllocated { block });
        }
        if !prefix_caching || m.cached.is_some() || tokens.len() != block_size {
            return Ok(false);
        }
        let hash = block_hash(parent, tokens);
        if self.cache.contains_key(&hash) {
            return Ok(false);
        }
        self.cache.insert(hash, block);
        self.meta[block as usize].cached = Some(CacheEntry { hash, parent, tokens: tokens.into() });
        Ok(true)
    }

    /// The cached block holding `tokens` after the prefix keyed `parent`, if any. Compares the
    /// stored parent key and token ids, so a 64-bit collision is never returned as a hit.
    pub fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<u32> {
        if !self.prefix_caching {
            return None;
        }
        let hash = block_hash(parent, tokens);
        let &block = self.cache.get(&hash)?;
        let entry = self.meta[block as usize].cached.as_ref()?;
        (entry.parent == parent && *entry.tokens == *tokens).then_some(block)
    }

    /// Checks the state invariants of every block (O(num_blocks); for tests and debugging).
    pub fn check_invariants(&self) -> Result<(), KvError> {
        let bad = |block: u32, detail: &'static str| Err(KvError::Invariant { block, detail });
        let mut on_free = vec![false; self.meta.len()];
        for &b in &self.free {
            if std::mem::replace(&mut on_free[b as usize], true) {
                return bad(b, "twice on the free list");
            }
        }
        for (i, m) in self.meta.iter().enumerate() {
            let b = i as u32;
            let evictable = m.lru_tick.is_some();
            if (m.refcount == 0) != (on_free[i] ^ evictable) {
                return bad(b, "refcount 0 iff free or cached-evictable");
            }
            if on_free[i] && m.cached.is_some() {
                return bad(b, "free block still registered in the cache");
            }
            if let Some(t) = m.lru_tick {
                if m.cached.is_none() || self.lru.get(&t) != Some(&b) {
                    return bad(b, "evictable block not cached or not on the LRU list");
                }
            }
            if let Some(e) = &m.cached {
                if self.cache.get(&e.hash) != Some(&b) {
                    return bad(b, "cached block missing from the cache map");
                }
            }
        }
        for (&hash, &b) in &self.cache {
            if self.meta[b as usize].cached.as_ref().map(|e| e.hash) != Some(hash) {
                return bad(b, "cache map entry points at a block with another key");
            }
        }
        if self.lru.len() != self.meta.iter().filter(|m| m.lru_tick.is_some()).count() {
            return bad(u32::MAX, "LRU list holds a stale entry");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::hash::ROOT_HASH;
    use super::*;

    /// Freed blocks are reused before fresh ones, so the blocks ever used stay `0..touched`.
    #[test]
    fn touched_blocks_grow_only_when_no_freed_block_is_left() {
        let mut p = BlockPool::new(8, 4).unwrap();
        assert_eq!(p.num_touched(), 0);
        let a = p.allocate_n(3).unwrap();
        assert_eq!(p.num_touched(), 3);
        p.release(a[1]).unwrap();
        p.release(a[0]).unwrap();
        assert_eq!(p.allocate_n(2).unwrap(), vec![0, 1], "the freed blocks, last freed first");
        assert_eq!(p.num_touched(), 3);
        assert_eq!(p.allocate().unwrap(), 3);
        assert_eq!(p.num_touched(), 4);
    }

    #[test]
    fn allocate_release_and_exhaustion() {
        let mut p = BlockPool::new(3, 4).unwrap();
        let a = p.allocate_n(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.num_free(), 0);
        assert_eq!(p.allocate(), Err(KvError::OutOfBlocks { need: 1, available: 0 }));
        assert_eq!(p.allocate_n(1), Err(KvError::OutOfBlocks { need: 1, available: 0 }));
        p.retain(1).unwrap();
        p.release(1).unwrap();
        assert_eq!(p.refcount(1), Some(1));
        for b in a {
            p.release(b).unwrap();
        }
        assert_eq!(p.num_free(), 3);
        assert_eq!(p.release(0), Err(KvError::NotAllocated { block: 0 }));
        assert_eq!(p.retain(0), Err(KvError::NotAllocated { block: 0 }));
        assert!(matches!(p.retain(9), Err(KvError::UnknownBlock { block: 9, .. })));
        p.check_invariants().unwrap();
        assert!(BlockPool::new(0, 4).is_err());
        assert!(BlockPool::new(4, 0).is_err());
    }

    #[test]
    fn cached_hashes_come_in_use_first_then_most_recently_released() {
        let mut p = BlockPool::new(4, 2).unwrap();
        let blocks = p.allocate_n(4).unwrap();
        let hashes: Vec<u64> = blocks
            .iter()
            .map(|&b| {
                let tokens = [b * 10, b * 10 + 1];
                p.register(b, ROOT_HASH, &tokens).unwrap();
                block_hash(ROOT_HASH, &tokens)
            })
            .collect();
        // Released in the order 2, 0, 3; block 1 stays in use.
        for b in [2, 0, 3] {
            p.release(b).unwrap();
        }
        let got: Vec<u64> = p.cached_hashes().collect();
        assert_eq!(got, vec![hashes[1], hashes[3], hashes[0], hashes[2]]);
    }

    #[test]
    fn register_lookup_and_revive() {
        let mut p = BlockPool::new(4, 2).unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(b, ROOT_HASH, &[7, 8]).unwrap());
        assert_eq!(p.lookup(ROOT_HASH, &[7, 8]), Some(b));
        assert_eq!(p.lookup(ROOT_HASH, &[7, 9]), None);
        assert_eq!(p.lookup(1, &[7, 8]), None);
        // A second block with the same content is not registered.
        let c = p.allocate().unwrap();
        assert!(!p.register(c, ROOT_HASH, &[7, 8]).unwrap());
        // Partial blocks are never registered.
        assert!(!p.register(c, ROOT_HASH, &[7]).unwrap());
        p.release(b).unwrap();
        p.release(c).unwrap();
        assert_eq!((p.num_free(), p.num_cached()), (3, 1));
        p.retain(b).unwrap();
        assert_eq!((p.num_free(), p.num_cached(), p.refcount(b)), (3, 0, Some(1)));
        p.release(b).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.cached_hashes().collect::<Vec<_>>(), vec![block_hash(ROOT_HASH, &[7, 8])]);
    }

    #[test]
    fn lru_evicts_oldest_release_first_and_only_when_needed() {
        let mut p = BlockPool::new(3, 1).unwrap();
        let blocks = p.allocate_n(3).unwrap();
        for (i, &b) in blocks.iter().enumerate() {
            assert!(p.register(b, ROOT_HASH, &[i as u32]).unwrap());
        }
        // Release order 2, 0, 1: block 2 is the oldest.
        for b in [2, 0, 1] {
            p.release(b).unwrap();
        }
        assert_eq!((p.num_free(), p.num_cached(), p.num_available()), (0, 3, 3));
        // Touch block 2 again: now 0 is the oldest.
        p.retain(2).unwrap();
        p.release(2).unwrap();
        assert_eq!(p.allocate().unwrap(), 0);
        assert_eq!(p.lookup(ROOT_HASH, &[0]), None);
        assert_eq!(p.lookup(ROOT_HASH, &[1]), Some(1));
        assert_eq!(p.allocate().unwrap(), 1);
        assert_eq!(p.num_cached_total(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn free_blocks_preferred_over_eviction() {
        let mut p = BlockPool::new(2, 1).unwrap();
        let a = p.allocate().unwrap();
        p.register(a, ROOT_HASH, &[5]).unwrap();
        p.release(a).unwrap();
        let b = p.allocate().unwrap();
        assert_ne!(a, b);
        assert_eq!(p.lookup(ROOT_HASH, &[5]), Some(a));
    }

    #[test]
    fn prefix_caching_off_registers_nothing() {
        let mut p = BlockPool::new(2, 1).unwrap().with_prefix_caching(false);
        let a = p.allocate().unwrap();
        assert!(!p.register(a, ROOT_HASH, &[5]).unwrap());
        p.release(a).unwrap();
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.lookup(ROOT_HASH, &[5]), None);
    }
}
