//! Invariants of the simulator over random workloads and clusters.

use cleave_bench::sim::profile::PROFILE_VERSION;
use cleave_bench::sim::*;
use proptest::prelude::*;

/// Prefill linear through the origin (so chunking a prompt costs what the whole does, and an
/// idle node's prefill time is a true lower bound on TTFT); decode rises with batch and context.
fn cost() -> CostModel {
    let profile = Profile {
        version: PROFILE_VERSION,
        model: "synthetic".into(),
        date: String::new(),
        threads: 1,
        block_size: 16,
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        kv_bytes_per_token: 100,
        kv_capacity_tokens: 4096,
        prefill: [(16, 0.0016), (128, 0.0128), (1024, 0.1024)]
            .iter()
            .map(|&(n, t)| PrefillPoint { tokens: n, cached_prefix: 0, seconds: t })
            .collect(),
        decode: [(1, 128, 0.01), (1, 2048, 0.012), (8, 128, 0.015), (8, 2048, 0.03)]
            .iter()
            .map(|&(b, c, t)| DecodePoint { batch: b, context: c, seconds: t })
            .collect(),
        mixed: vec![],
    };
    CostModel::from_profile(&profile, HandoffCost::default()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_request_finishes_in_order_of_its_phases(
        p in 1usize..4, d in 1usize..4, colocated in any::<bool>(), local in 0usize..300,
        n in 1usize..120, rate in 0.5f64..200.0, seed in 0u64..1000,
    ) {
        let c = cost();
        let topology = if colocated { Topology::Colocated { nodes: p + d } } else { Topology::Disaggregated { prefill: p, decode: d } };
        let mut cfg = ClusterConfig::new(topology, NodeLimits::from_cost(&c));
        cfg.local_prefill_below = local;
        let w = WorkloadSpec { num_requests: n, input_len: (1, 1500), output_len: (1, 40), burstiness: 0.7, seed };
        let reqs = w.generate(rate).unwrap();
        let recs = simulate(&cfg, &c, &reqs).unwrap();
        prop_assert_eq!(recs.len(), n);
        for (r, q) in recs.iter().zip(&reqs) {
            // No request beats its own prefill on an idle node, nor decodes faster than batch 1.
            prop_assert!(r.ttft_s >= c.prefill_time(q.input_len, 0) - 1e-12, "{r:?}");
            prop_assert!(r.e2el_s >= r.ttft_s);
            if q.output_len > 1 {
                prop_assert!(r.tpot_s >= 0.01 - 1e-12, "{r:?}");
            }
            prop_assert!(r.decode_node < p + d);
            if colocated || q.input_len < local {
                prop_assert_eq!(r.prefill_node, None);
            } else {
                prop_assert!(r.prefill_node.is_some_and(|x| x < p));
                prop_assert!(r.ttft_s >= c.prefill_time(q.input_len, 0) + c.handoff_time(q.input_len) - 1e-12);
            }
        }
    }
}

#[test]
fn one_seed_gives_the_same_requests_at_every_rate() {
    let w = WorkloadSpec { num_requests: 50, input_len: (10, 20), output_len: (1, 5), burstiness: 1.0, seed: 9 };
    let slow = w.generate(1.0).unwrap();
    let fast = w.generate(4.0).unwrap();
    for (s, f) in slow.iter().zip(&fast) {
        assert_eq!((s.input_len, s.output_len), (f.input_len, f.output_len));
        assert!((s.arrival_s - 4.0 * f.arrival_s).abs() < 1e-9);
    }
    // Poisson at rate 1: the mean gap is about 1 s.
    let many = WorkloadSpec { num_requests: 20_000, ..w }.generate(1.0).unwrap();
    let mean_gap = many.last().unwrap().arrival_s / 19_999.0;
    assert!((mean_gap - 1.0).abs() < 0.03, "{mean_gap}");
    assert!(WorkloadSpec { input_len: (5, 4), ..w }.generate(1.0).is_err());
    assert!(w.generate(0.0).is_err());
}

#[test]
fn bad_requests_are_errors() {
    let c = cost();
    let cfg = ClusterConfig::new(Topology::Colocated { nodes: 1 }, NodeLimits::from_cost(&c));
    let bad = [SimRequest { arrival_s: f64::NAN, input_len: 1, output_len: 1 }];
    assert!(simulate(&cfg, &c, &bad).is_err());
    let empty = [SimRequest { arrival_s: 0.0, input_len: 0, output_len: 1 }];
    assert!(simulate(&cfg, &c, &empty).is_err());
    let zero = ClusterConfig::new(Topology::Disaggregated { prefill: 0, decode: 1 }, NodeLimits::from_cost(&c));
    assert!(simulate(&zero, &c, &[]).is_err());
}
