//! Fixed topologies give bit-identical records across refactors of the engine: digests of every
//! record's bits for a spread of clusters, workloads and limits, recorded with the engine as it
//! was before planner mode (dynamic roles) was added. A change here is a change of the
//! simulator's behaviour, not a refactor.

use cleave_bench::sim::profile::PROFILE_VERSION;
use cleave_bench::sim::*;

fn synthetic() -> Profile {
    Profile {
        version: PROFILE_VERSION,
        model: "synthetic".into(),
        date: String::new(),
        threads: 1,
        block_size: 16,
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        kv_bytes_per_token: 100,
        kv_capacity_tokens: 4096,
        prefill: [(16, 0.002), (128, 0.0128), (1024, 0.1124), (4096, 0.6)]
            .iter()
            .map(|&(n, t)| PrefillPoint { tokens: n, cached_prefix: 0, seconds: t })
            .collect(),
        decode: [(1, 128, 0.01), (1, 2048, 0.012), (8, 128, 0.015), (8, 2048, 0.03)]
            .iter()
            .map(|&(b, c, t)| DecodePoint { batch: b, context: c, seconds: t })
            .collect(),
        mixed: vec![MixedPoint { prefill_tokens: 256, decode_batch: 4, context: 512, seconds: 0.05 }],
    }
}

fn measured() -> Profile {
    cleave_bench::sim::profile::load(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/base-100m-1thread.json"
    )))
    .unwrap()
}

/// FNV-1a over the bits of every field of every record.
fn digest(recs: &[SimRecord]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for r in recs {
        eat(r.id as u64);
        eat(r.arrival_s.to_bits());
        eat(r.input_len as u64);
        eat(r.output_len as u64);
        eat(r.ttft_s.to_bits());
        eat(r.tpot_s.to_bits());
        eat(r.e2el_s.to_bits());
        eat(r.prefill_node.map_or(u64::MAX, |p| p as u64));
        eat(r.decode_node as u64);
    }
    h
}

struct Case {
    profile: fn() -> Profile,
    topology: &'static str,
    local_prefill_below: usize,
    kv_capacity_tokens: Option<usize>,
    workload: WorkloadSpec,
    rate: f64,
}

fn cases() -> Vec<Case> {
    let w = |n, input, output, burstiness, seed| WorkloadSpec {
        num_requests: n,
        input_len: input,
        output_len: output,
        burstiness,
        seed,
    };
    vec![
        Case {
            profile: synthetic,
            topology: "1c",
            local_prefill_below: 0,
            kv_capacity_tokens: None,
            workload: w(400, (1, 1500), (1, 40), 0.7, 1),
            rate: 20.0,
        },
        Case {
            profile: synthetic,
            topology: "3c",
            local_prefill_below: 0,
            kv_capacity_tokens: Some(1 << 20),
            workload: w(800, (16, 2048), (1, 64), 1.0, 2),
            rate: 60.0,
        },
        Case {
            profile: synthetic,
            topology: "1p1d",
            local_prefill_below: 0,
            kv_capacity_tokens: None,
            workload: w(400, (1, 1500), (1, 40), 0.5, 3),
            rate: 15.0,
        },
        Case {
            profile: synthetic,
            topology: "2p3d",
            local_prefill_below: 200,
            kv_capacity_tokens: None,
            workload: w(1000, (1, 3000), (1, 80), 1.0, 4),
            rate: 40.0,
        },
        Case {
            profile: synthetic,
            topology: "3p2d",
            local_prefill_below: 0,
            kv_capacity_tokens: Some(2000),
            workload: w(600, (64, 1024), (2, 32), 2.0, 5),
            rate: f64::INFINITY,
        },
        Case {
            profile: measured,
            topology: "1p2d",
            local_prefill_below: 64,
            kv_capacity_tokens: None,
            workload: w(300, (16, 1024), (1, 128), 1.0, 6),
            rate: 0.3,
        },
        Case {
            profile: measured,
            topology: "4c",
            local_prefill_below: 0,
            kv_capacity_tokens: None,
            workload: w(300, (16, 1024), (1, 128), 1.0, 7),
            rate: 0.8,
        },
    ]
}

/// Recorded before planner mode existed (see the module docs), and re-recorded when a mixed step
/// became one pass over the weights (`CostModel::mixed_step_time`): the five cases with mixed
/// steps (colocated nodes, and decode nodes that prefill short prompts locally) changed; the two
/// pure prefill/decode cases kept their digests.
const GOLDEN: [u64; 7] = [
    0xe5b8da167833a8fd,
    0xb5355b72ea9a2f2f,
    0xf880832ef5872c49,
    0x7217fc86ed54b068,
    0x63e5360fcf29d938,
    0xfc5b14b69ccf92fe,
    0xef0d9ccf811a17ce,
];

#[test]
fn fixed_topologies_are_bit_identical_to_the_recorded_engine() {
    let got: Vec<u64> = cases()
        .iter()
        .map(|c| {
            let cost = CostModel::from_profile(&(c.profile)(), HandoffCost::default()).unwrap();
            let mut cfg = ClusterConfig::new(c.topology.parse().unwrap(), NodeLimits::from_cost(&cost));
            cfg.local_prefill_below = c.local_prefill_below;
            if let Some(k) = c.kv_capacity_tokens {
                cfg.limits.kv_capacity_tokens = k;
            }
            digest(&simulate(&cfg, &cost, &c.workload.generate(c.rate).unwrap()).unwrap())
        })
        .collect();
    assert_eq!(got, GOLDEN);
}
