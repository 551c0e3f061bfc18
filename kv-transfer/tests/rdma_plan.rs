//! RDMA write plans against a byte-by-byte reference, and queue-pair metadata round trips and
//! arbitrary bytes; no device needed.
#![cfg(feature = "rdma")]

use cleave_kv_transfer::rdma::*;
use cleave_protocol::{KvDtype, KvLayout};
use proptest::prelude::*;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    }
}

/// Applies `writes` to a simulated remote region (what the NIC would do).
fn apply(region: &RemoteRegion, remote: &mut [u8], src: &[u8], writes: &[RdmaWrite]) {
    for w in writes {
        let at = (w.remote_addr - region.addr) as usize;
        let from = w.src_offset as usize;
        remote[at..at + w.len as usize].copy_from_slice(&src[from..from + w.len as usize]);
    }
}

/// The reference: every byte of every token of both halves, one at a time.
fn naive(region: &RemoteRegion, remote: &mut [u8], src: &[u8], blocks: &[u32], layer: u32, start: u32, end: u32) {
    let l = &region.layout;
    let n = (end - start) as usize;
    let tb = l.token_bytes as usize;
    for (h, half) in Half::BOTH.into_iter().enumerate() {
        for p in start..end {
            let off = l.offset(layer, half, blocks[(p / l.block_size) as usize], p % l.block_size).unwrap() as usize;
            for i in 0..tb {
                remote[off + i] = src[h * n * tb + (p - start) as usize * tb + i];
            }
        }
    }
}

/// A pool in one of three memory orders, with some padding between blocks.
fn layout_strategy() -> impl Strategy<Value = RemoteRegion> {
    (1u32..4, 1u32..12, 1u32..5, 1u32..3, 0u32..3, 0u64..2, 0usize..3).prop_map(
        |(num_layers, num_blocks, block_size, heads, dtype, pad, order)| {
            let dtype = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16][dtype as usize];
            let kv = KvLayout { model_fingerprint: 0, dtype, num_layers, num_kv_heads: heads, head_dim: 2, block_size };
            let mut layout = PoolLayout::dense(&kv, num_blocks).unwrap();
            let half = layout.half_block_bytes();
            match order {
                // [layer][half][block], padded blocks (runs of blocks are then not adjacent).
                0 => {
                    layout.block_stride = half + pad * 8;
                    layout.half_stride = layout.block_stride * num_blocks as u64;
                    layout.layer_stride = 2 * layout.half_stride;
                }
                // [block][layer][half]
                1 => {
                    layout.half_stride = half;
                    layout.layer_stride = 2 * half;
                    layout.block_stride = 2 * half * num_layers as u64 + pad * 8;
                }
                // [half][layer][block]
                _ => {
                    layout.block_stride = half;
                    layout.layer_stride = half * num_blocks as u64 + pad * 8;
                    layout.half_stride = layout.layer_stride * num_layers as u64;
                }
            }
            RemoteRegion { addr: 0x10_0000, len: layout.extent().unwrap() + pad * 16, rkey: 1, layout }
        },
    )
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn plans_match_the_byte_by_byte_reference(
        region in layout_strategy(),
        seed in any::<u64>(),
        max_write in prop_oneof![Just(u32::MAX), 1u32..64],
        every in 1u32..5,
    ) {
        prop_assert!(region.validate().is_ok());
        let l = region.layout;
        let mut x = seed | 1;
        let mut next = move || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
        // A lease: a random selection of distinct blocks, sometimes consecutive.
        let count = 1 + (next() % l.num_blocks as u64) as usize;
        let mut ids: Vec<u32> = (0..l.num_blocks).collect();
        if next() % 2 == 0 {
            for i in (1..ids.len()).rev() { ids.swap(i, (next() % (i as u64 + 1)) as usize); }
        }
        let blocks = &ids[..count];
        let cap = count as u32 * l.block_size;
        let start = (next() % cap as u64) as u32;
        let end = start + 1 + (next() % (cap - start) as u64) as u32;
        let layer = (next() % l.num_layers as u64) as u32;
        let src: Vec<u8> = (0..source_len(end - start, l.token_bytes)).map(|_| next() as u8).collect();

        let chunk = ChunkWrite { blocks, layer, tokens: start..end, tag: 3, chunk: 9 };
        let writes = plan_chunk(&region, &chunk, max_write, SignalPolicy { every }).unwrap();

        let mut got = vec![0u8; region.len as usize];
        let mut want = vec![0u8; region.len as usize];
        apply(&region, &mut got, &src, &writes);
        naive(&region, &mut want, &src, blocks, layer, start, end);
        prop_assert!(got == want, "plan differs from the reference: {:?}", writes);

        // Every source byte exactly once; remote ranges inside the region and disjoint.
        prop_assert_eq!(writes.iter().map(|w| w.len as u64).sum::<u64>(), src.len() as u64);
        let mut spans: Vec<(u64, u64)> = writes.iter().map(|w| (w.remote_addr, w.remote_addr + w.len as u64)).collect();
        spans.sort_unstable();
        for pair in spans.windows(2) { prop_assert!(pair[0].1 <= pair[1].0); }
        prop_assert!(spans.iter().all(|&(a, b)| a >= region.addr && b <= region.addr + region.len));
        // Immediate and signalling policy.
        prop_assert!(writes.iter().all(|w| w.len <= max_write && w.len > 0));
        prop_assert_eq!(writes.iter().filter(|w| w.imm.is_some()).count(), 1);
        let last = writes.last().unwrap();
        prop_assert_eq!(last.imm, Some(Imm::new(3, layer, 9).unwrap()));
        prop_assert!(last.signaled);
        let mut run = 0;
        for w in &writes { run = if w.signaled { 0 } else { run + 1 }; prop_assert!(run < every); }
        // Merging: with no split, no two consecutive writes could have been one.
        if max_write == u32::MAX {
            for p in writes.windows(2) {
                let contiguous = p[0].remote_addr + p[0].len as u64 == p[1].remote_addr
                    && p[0].src_offset + p[0].len as u64 == p[1].src_offset;
                prop_assert!(!contiguous, "unmerged run {:?}", p);
            }
        }
    }

    #[test]
    fn dense_pools_write_consecutive_blocks_as_one_run_per_half(
        num_blocks in 2u32..64, first in 0u32..32, len in 1u32..32, layer in 0u32..4,
    ) {
        let kv = KvLayout { model_fingerprint: 0, dtype: KvDtype::Bf16, num_layers: 4, num_kv_heads: 8, head_dim: 128, block_size: 16 };
        let layout = PoolLayout::dense(&kv, num_blocks + 64).unwrap();
        let region = RemoteRegion { addr: 1 << 40, len: layout.extent().unwrap(), rkey: 5, layout };
        let blocks: Vec<u32> = (first..first + len).collect();
        let chunk = ChunkWrite { blocks: &blocks, layer, tokens: 0..len * 16, tag: 0, chunk: 0 };
        let w = plan_chunk(&region, &chunk, u32::MAX, SignalPolicy::default()).unwrap();
        prop_assert_eq!(w.len(), 2);
    }

    #[test]
    fn metadata_round_trips(
        qp_num in 0u32..1 << 24, lid in any::<u16>(), gid in any::<[u8; 16]>(), psn in 0u32..1 << 24,
        mtu in 1u32..6, max_write_bytes in 1u32.., region in proptest::option::of(layout_strategy()),
        rkey in any::<u32>(),
    ) {
        let m = QpMetadata {
            qp_num, lid, gid, psn, mtu: PathMtu::from_verbs(mtu).unwrap(), max_write_bytes,
            region: region.map(|r| RemoteRegion { rkey, ..r }),
        };
        let buf = m.encode().unwrap();
        prop_assert_eq!(QpMetadata::decode(&buf).unwrap(), m);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_metadata_decoder(buf in proptest::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(m) = QpMetadata::decode(&buf) {
            // Whatever decodes is valid and re-encodes to the same value.
            prop_assert!(m.validate().is_ok());
            prop_assert_eq!(QpMetadata::decode(&m.encode().unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn mutated_metadata_never_panics_and_stays_valid_when_accepted(
        pos in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>(),
    ) {
        let kv = KvLayout { model_fingerprint: 0, dtype: KvDtype::F16, num_layers: 2, num_kv_heads: 1, head_dim: 4, block_size: 2 };
        let layout = PoolLayout::dense(&kv, 8).unwrap();
        let m = QpMetadata {
            qp_num: 77, lid: 1, gid: [9; 16], psn: 5, mtu: PathMtu::Mtu1024, max_write_bytes: 4096,
            region: Some(RemoteRegion { addr: 4096, len: layout.extent().unwrap(), rkey: 3, layout }),
        };
        let mut buf = m.encode().unwrap();
        let i = pos.index(buf.len());
        buf[i] = byte;
        let n = cut.index(buf.len() + 1);
        for b in [&buf[..], &buf[..n]] {
            if let Ok(d) = QpMetadata::decode(b) { prop_assert!(d.validate().is_ok()); }
        }
    }
}
