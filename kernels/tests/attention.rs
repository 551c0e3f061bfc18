//! Paged attention: CPU == reference == dense attention, over random GQA shapes, block sizes,
//! permuted block tables, prefix contexts longer than the query chunk, and decode steps; with
//! f32, f16 and bf16 pools (the reference reads the same values rounded by the `half` crate).

mod common;

use cleave_kernels::cpu::KvPool;
use cleave_kernels::{reference, AttnSeq, AttnShape, Backend, CacheDtype, CpuBackend};
use common::{assert_close, backends, Rng};
use proptest::prelude::*;

/// One sequence of a generated case: its contiguous K/V and its place in the batch.
struct SeqCase {
    q_len: usize,
    context_len: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    block_table: Vec<u32>,
    q_start: usize,
}

struct Case {
    shape: AttnShape,
    seqs: Vec<SeqCase>,
    q: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
}

/// Builds a batch: each sequence's K/V written through a shuffled block table into shared pools
/// (with spare blocks), queries packed with an optional gap of unused rows between sequences.
fn build(seed: u64, shape: AttnShape, lens: &[(usize, usize)]) -> Case {
    let mut rng = Rng::new(seed);
    let bs = shape.block_size;
    let kv_width = shape.num_kv_heads * shape.head_dim;
    let q_width = shape.num_heads * shape.head_dim;
    let total_blocks: usize = lens.iter().map(|&(_, ctx)| ctx.div_ceil(bs)).sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let mut k_cache = rng.vec(total_blocks * bs * kv_width);
    let mut v_cache = rng.vec(total_blocks * bs * kv_width);
    let mut seqs = Vec::new();
    let mut next_block = 0;
    let mut row = 0;
    for &(q_len, context_len) in lens {
        let n = context_len.div_ceil(bs);
        let block_table = ids[next_block..next_block + n].to_vec();
        next_block += n;
        let (k, v) = (rng.vec(context_len * kv_width), rng.vec(context_len * kv_width));
        let slots: Vec<u32> = (0..context_len).map(|t| block_table[t / bs] * bs as u32 + (t % bs) as u32).collect();
        reference::write_kv(&k, &v, &slots, kv_width, &mut k_cache, &mut v_cache).unwrap();
        row += rng.below(2);
        seqs.push(SeqCase { q_len, context_len, k, v, block_table, q_start: row });
        row += q_len;
    }
    let q = rng.vec(row * q_width);
    Case { shape, seqs, q, k_cache, v_cache }
}

const DTYPES: [CacheDtype; 3] = [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16];

/// `x` as a cache of `dtype` keeps it.
fn rounded(dtype: CacheDtype, x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| reference::kv_round(dtype, v)).collect()
}

/// A pool of `dtype` holding `x` (rounded), filled through the byte interface.
fn pool(b: &CpuBackend, dtype: CacheDtype, x: &[f32]) -> KvPool {
    let mut p = b.alloc_kv(dtype, x.len()).unwrap();
    b.write_kv_bytes(&mut p, 0, &reference::kv_encode(dtype, x)).unwrap();
    p
}

fn check(case: &Case) {
    let attn: Vec<AttnSeq<'_>> = case
        .seqs
        .iter()
        .map(|s| AttnSeq {
            q_start: s.q_start,
            q_len: s.q_len,
            context_len: s.context_len,
            block_table: &s.block_table,
        })
        .collect();
    let q_width = case.shape.num_heads * case.shape.head_dim;
    for dtype in DTYPES {
        let (kc, vc) = (rounded(dtype, &case.k_cache), rounded(dtype, &case.v_cache));
        let mut want = vec![0f32; case.q.len()];
        reference::paged_attention(&case.q, &kc, &vc, &attn, case.shape, &mut want).unwrap();

        for s in &case.seqs {
            let rows = s.q_start * q_width..(s.q_start + s.q_len) * q_width;
            let (k, v) = (rounded(dtype, &s.k), rounded(dtype, &s.v));
            let dense =
                reference::dense_attention(&case.q[rows.clone()], &k, &v, s.q_len, s.context_len, case.shape).unwrap();
            assert_close(&want[rows], &dense, 1e-6, 1e-6, "paged reference vs dense");
        }
        for b in backends() {
            let (kp, vp) = (pool(&b, dtype, &case.k_cache), pool(&b, dtype, &case.v_cache));
            let mut got = vec![0f32; case.q.len()];
            b.paged_attention(&case.q, &kp, &vp, &attn, case.shape, &mut got).unwrap();
            assert_close(&got, &want, 1e-5, 1e-5, &format!("{b:?} {} paged attention", dtype.name()));
        }
    }
}

fn shape_strategy() -> impl Strategy<Value = AttnShape> {
    (1usize..=3, 1usize..=4, prop::sample::select(vec![1usize, 2, 3, 8, 16, 17, 32, 64]), 1usize..=17).prop_map(
        |(kv, group, head_dim, block_size)| AttnShape {
            num_heads: kv * group,
            num_kv_heads: kv,
            head_dim,
            block_size,
            scale: 1.0 / (head_dim as f32).sqrt(),
        },
    )
}

/// `(q_len, context_len)` with prefixes: decode steps (q_len 1), full prefills and chunks over a
/// cached prefix.
fn seq_strategy() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        (1usize..=70).prop_map(|ctx| (1, ctx)),
        (1usize..=40).prop_map(|q| (q, q)),
        (1usize..=40, 1usize..=50).prop_map(|(q, prefix)| (q, q + prefix)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn paged_attention_matches_references(
        shape in shape_strategy(),
        lens in prop::collection::vec(seq_strategy(), 1..=4),
        seed in any::<u64>(),
    ) {
        check(&build(seed, shape, &lens));
    }
}

#[test]
fn long_prefill_chunk_over_prefix() {
    let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16, scale: 0.125 };
    check(&build(11, shape, &[(150, 400), (1, 333), (37, 37)]));
}

#[test]
fn empty_batch_and_zero_length_queries_are_fine() {
    let shape = AttnShape { num_heads: 2, num_kv_heads: 1, head_dim: 4, block_size: 4, scale: 0.5 };
    let b = &backends()[0];
    let mut out = vec![7f32; 8];
    let (q, cache) = (vec![0f32; 8], KvPool::from(vec![0f32; 16]));
    b.paged_attention(&q, &cache, &cache, &[], shape, &mut out).unwrap();
    let idle = AttnSeq { q_start: 0, q_len: 0, context_len: 3, block_table: &[0] };
    b.paged_attention(&q, &cache, &cache, &[idle], shape, &mut out).unwrap();
    assert_eq!(out, vec![7f32; 8]);
}
