//! Per-sequence block tables and the table-level operations of [`BlockPool`]: prefix lookup,
//! growth with copy-on-write, commit (prefix-cache registration), fork, free, and building a
//! table from blocks reserved for an incoming KV transfer.
//!
//! Invariants of a [`BlockTable`] `t` owned by a pool `p`:
//! - `t` holds one reference on each of `t.blocks()`;
//! - `t.num_tokens() <= t.blocks().len() * block_size`: the first `num_tokens` slots hold
//!   computed K/V;
//! - `t.hashes` are the prefix keys of the first `num_tokens / block_size` (full) blocks.
//!
//! A table must be handed back with [`BlockPool::free`]; the pool cannot see a dropped table.
//! (A `Drop`-based lease would need shared ownership of the pool; the scheduler is the single
//! owner of both instead, and the property tests check that nothing leaks.)

use super::hash::{block_hash, ROOT_HASH};
use super::{BlockPool, KvError};

/// The blocks of one sequence, in position order, and how many token slots hold K/V.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    hashes: Vec<u64>,
    num_tokens: usize,
}

impl BlockTable {
    /// Block ids in position order: token position `p` lives in `blocks()[p / block_size]`.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Token positions whose K/V is computed (committed).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Prefix-cache keys of the full committed blocks.
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Flat slot index (`block * block_size + offset`) of token position `pos`, if covered.
    pub fn slot(&self, pos: usize, block_size: usize) -> Option<u32> {
        let block = *self.blocks.get(pos / block_size)?;
        Some(block * block_size as u32 + (pos % block_size) as u32)
    }
}

/// Full blocks of a token sequence found in the prefix cache (a read-only lookup result;
/// [`BlockPool::adopt_prefix`] takes the references).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<u32>,
    pub hashes: Vec<u64>,
}

impl PrefixHit {
    /// Tokens covered by the hit blocks.
    pub fn num_tokens(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }
}

impl BlockPool {
    /// The longest run of leading full blocks of `tokens` present in the prefix cache.
    /// No side effects.
    pub fn find_prefix(&self, tokens: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        let mut parent = ROOT_HASH;
        for chunk in tokens.chunks_exact(self.block_size()) {
            let Some(block) = self.lookup(parent, chunk) else {
                break;
            };
            parent = block_hash(parent, chunk);
            hit.blocks.push(block);
            hit.hashes.push(parent);
        }
        hit
    }

    /// A table holding the first `num_tokens` tokens of `hit` (taking a reference on each of
    /// the `ceil(num_tokens / block_size)` blocks, reviving evictable ones). `num_tokens` may
    /// end inside the last hit block; writing after it then copies that block first (see
    /// [`BlockPool::prepare_write`]), since a cached block is never written.
    pub fn adopt_prefix(&mut self, hit: &PrefixHit, num_tokens: usize) -> Result<BlockTable, KvError> {
        let bs = self.block_size();
        let capacity = hit.num_tokens(bs);
        if num_tokens > capacity {
            return Err(KvError::TableOverflow { requested: num_tokens, capacity });
        }
        let n = num_tokens.div_ceil(bs);
        for (i, &b) in hit.blocks[..n].iter().enumerate() {
            if let Err(e) = self.retain(b) {
                for &done in hit.blocks[..i].iter().rev() {
                    let _ = self.release(done);
                }
                return Err(e);
            }
        }
        Ok(BlockTable { blocks: hit.blocks[..n].to_vec(), hashes: hit.hashes[..num_tokens / bs].to_vec(), num_tokens })
    }

    /// Makes `table` writable for token positions `table.num_tokens()..end`: every block those
    /// positions touch that is shared (refcount > 1) or registered in the prefix cache is
    /// replaced by a fresh copy, with `(src, dst)` pushed to `copies`, and fresh blocks are
    /// appended until `end` is covered. All or nothing: on `OutOfBlocks` nothing changed.
    ///
    /// The caller must execute the copies, in order, before any K/V is written in that step
    /// (`src` may be handed out again later in the same step).
    pub fn prepare_write(
        &mut self,
        table: &mut BlockTable,
        end: usize,
        copies: &mut Vec<(u32, u32)>,
    ) -> Result<(), KvError> {
        let bs = self.block_size();
        if end <= table.num_tokens {
            return Ok(());
        }
        let first = table.num_tokens / bs;
        let last = end.div_ceil(bs).min(table.blocks.len());
        let to_copy: Vec<usize> = (first..last)
            .filter(|&i| {
                let b = table.blocks[i];
                self.refcount(b).unwrap_or(0) > 1 || self.is_cached(b)
            })
            .collect();
        let grow = end.div_ceil(bs).saturating_sub(table.blocks.len());
        let need = to_copy.len() + grow;
        let available = self.num_available();
        if need > available {
            return Err(KvError::OutOfBlocks { need, available });
        }
        for i in to_copy {
            let src = table.blocks[i];
            let dst = self.allocate()?;
            self.release(src)?;
            table.blocks[i] = dst;
            copies.push((src, dst));
        }
        for _ in 0..grow {
            let b = self.allocate()?;
            table.blocks.push(b);
        }
        Ok(())
    }

    /// Records that the K/V of `tokens[..num_tokens]` is now computed in `table`, and registers
    /// every newly completed full block in the prefix cache. Call only after the step that
    /// computed them has run.
    pub fn commit(&mut self, table: &mut BlockTable, tokens: &[u32], num_tokens: usize) -> Result<(), KvError> {
        let capacity = table.blocks.len() * self.block_size();
        if num_tokens > capacity || num_tokens > tokens.len() || num_tokens < table.num_tokens {
            return Err(KvError::TableOverflow { requested: num_tokens, capacity: capacity.min(tokens.len()) });
        }
        let bs = self.block_size();
        while table.hashes.len() < num_tokens / bs {
            let j = table.hashes.len();
            let parent = table.hashes.last().copied().unwrap_or(ROOT_HASH);
            let chunk = &tokens[j * bs..(j + 1) * bs];
            self.register(table.blocks[j], parent, chunk)?;
            table.hashes.push(block_hash(parent, chunk));
        }
        table.num_tokens = num_tokens;
        Ok(())
    }

    /// A second table sharing every block of `table` (for `n > 1` sampling). Either table
    /// writing into a shared block later copies it first.
    pub fn fork(&mut self, table: &BlockTable) -> Result<BlockTable, KvError> {
        for &b in &table.blocks {
            self.retain(b)?;
        }
        Ok(table.clone())
    }

    /// Drops the table's references, last block first, so that a sequence's tail blocks (the
    /// least likely to be shared) are evicted before its head.
    pub fn free(&mut self, table: BlockTable) -> Result<(), KvError> {
        self.release_blocks(&table.blocks)
    }

    /// Drops one reference on each block, last first (also for reserved blocks never used).
    /// Every block is released even if one fails; the first error is returned.
    pub fn release_blocks(&mut self, blocks: &[u32]) -> Result<(), KvError> {
        let mut result = Ok(());
        for &b in blocks.iter().rev() {
            if let Err(e) = self.release(b) {
                result = result.and(Err(e));
            }
        }
        result
    }

    /// Reserves `n` fresh blocks (refcount 1 each), all or nothing, e.g. for a sequence whose
    /// K/V arrives over the network.
    pub fn reserve(&mut self, n: usize) -> Result<Vec<u32>, KvError> {
        self.allocate_n(n)
    }

    /// A table from blocks the caller holds one reference on (typically from
    /// [`BlockPool::reserve`]) whose first `num_tokens` slots now hold the K/V of `tokens`;
    /// the references move into the table and full blocks are registered in the prefix cache.
    pub fn table_from_blocks(
        &mut self,
        blocks: Vec<u32>,
        tokens: &[u32],
        num_tokens: usize,
    ) -> Result<BlockTable, KvError> {
        for &b in &blocks {
            if self.refcount(b).ok_or(KvError::UnknownBlock { block: b, num_blocks: self.num_blocks() })? == 0 {
                return Err(KvError::NotAllocated { block: b });
            }
        }
        let mut table = BlockTable { blocks, hashes: Vec::new(), num_tokens: 0 };
        self.commit(&mut table, tokens, num_tokens)?;
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32) -> Vec<u32> {
        (100..100 + n).collect()
    }

    #[test]
    fn grow_commit_and_prefix_hit() {
        let mut p = BlockPool::new(8, 4).unwrap();
        let t10 = toks(10);
        let mut a = BlockTable::default();
        let mut copies = vec![];
        p.prepare_write(&mut a, 10, &mut copies).unwrap();
        assert_eq!(a.blocks().len(), 3);
        assert!(copies.is_empty());
        // Nothing registered before commit.
        assert_eq!(p.find_prefix(&t10).blocks.len(), 0);
        p.commit(&mut a, &t10, 10).unwrap();
        assert_eq!(a.hashes().len(), 2);
        let hit = p.find_prefix(&t10);
        assert_eq!(hit.blocks, a.blocks()[..2]);
        assert_eq!(hit.num_tokens(4), 8);
        // A different second block stops the hit after the first.
        let mut other = t10.clone();
        other[5] = 0;
        assert_eq!(p.find_prefix(&other).blocks, a.blocks()[..1]);
        let b = p.adopt_prefix(&hit, 8).unwrap();
        assert_eq!(p.refcount(a.blocks()[0]), Some(2));
        assert_eq!(b.num_tokens(), 8);
        assert_eq!(b.slot(5, 4), Some(a.blocks()[1] * 4 + 1));
        assert_eq!(b.slot(8, 4), None);
        p.free(a).unwrap();
        p.free(b).unwrap();
        assert_eq!(p.num_available(), 8);
        assert_eq!(p.num_cached(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn writing_into_a_cached_block_copies_it() {
        let mut p = BlockPool::new(8, 4).unwrap();
        let t8 = toks(8);
        let mut a = BlockTable::default();
        p.prepare_write(&mut a, 8, &mut vec![]).unwrap();
        p.commit(&mut a, &t8, 8).unwrap();
        let last = a.blocks()[1];
        p.free(a).unwrap();
        // Fully cached prompt: keep 7 tokens, recompute the last one.
        let hit = p.find_prefix(&t8);
        let mut b = p.adopt_prefix(&hit, 7).unwrap();
        assert_eq!(b.hashes().len(), 1);
        let mut copies = vec![];
        p.prepare_write(&mut b, 8, &mut copies).unwrap();
        assert_eq!(copies.len(), 1);
        assert_eq!(copies[0].0, last);
        assert_eq!(b.blocks()[1], copies[0].1);
        assert!(p.is_cached(last) && p.refcount(last) == Some(0));
        p.commit(&mut b, &t8, 8).unwrap();
        // The original stays the cached one; the copy is private.
        assert!(!p.is_cached(copies[0].1));
        p.free(b).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.num_available(), 8);
    }

    #[test]
    fn fork_shares_then_copies_on_write() {
        let mut p = BlockPool::new(8, 4).unwrap();
        let t6 = toks(6);
        let mut a = BlockTable::default();
        p.prepare_write(&mut a, 6, &mut vec![]).unwrap();
        p.commit(&mut a, &t6, 6).unwrap();
        let mut b = p.fork(&a).unwrap();
        assert_eq!(b.blocks(), a.blocks());
        assert!(a.blocks().iter().all(|&x| p.refcount(x) == Some(2)));
        let mut copies = vec![];
        p.prepare_write(&mut b, 7, &mut copies).unwrap();
        // Only the partially filled shared block is copied; the full one stays shared.
        assert_eq!(copies, vec![(a.blocks()[1], b.blocks()[1])]);
        assert_eq!(b.blocks()[0], a.blocks()[0]);
        assert_eq!(p.refcount(a.blocks()[1]), Some(1));
        // The other side can now write its own block without copying.
        copies.clear();
        p.prepare_write(&mut a, 7, &mut copies).unwrap();
        assert!(copies.is_empty());
        p.free(a).unwrap();
        p.free(b).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.num_free() + p.num_cached(), 8);
    }

    #[test]
    fn prepare_write_is_all_or_nothing() {
        let mut p = BlockPool::new(2, 4).unwrap();
        let mut a = BlockTable::default();
        let err = p.prepare_write(&mut a, 12, &mut vec![]).unwrap_err();
        assert_eq!(err, KvError::OutOfBlocks { need: 3, available: 2 });
        assert!(a.is_empty());
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn reserve_and_build_table() {
        let mut p = BlockPool::new(4, 4).unwrap();
        let t6 = toks(6);
        let blocks = p.reserve(2).unwrap();
        let t = p.table_from_blocks(blocks.clone(), &t6, 6).unwrap();
        assert_eq!(t.blocks(), blocks);
        assert_eq!(p.find_prefix(&t6).blocks, vec![blocks[0]]);
        assert!(p.table_from_blocks(vec![3], &t6, 4).is_err());
        assert!(matches!(
            p.table_from_blocks(vec![2], &t6, 6),
            Err(KvError::NotAllocated { .. }) | Err(KvError::TableOverflow { .. })
        ));
        p.free(t).unwrap();
        let spare = p.reserve(1).unwrap();
        p.release_blocks(&spare).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.num_available(), 4);
    }
}
