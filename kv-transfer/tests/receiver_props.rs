//! Random interleavings of every input the receiver state machine takes (opens, good, bad,
//! duplicate and corrupt chunks, completes, stream deaths, cancels, time), checked against the
//! invariants of its module docs after every step.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use cleave_kv_transfer::frame::{Control, Frame, Open};
use cleave_kv_transfer::receiver::{Effect, LeaseSpec, Receiver, StreamId};
use cleave_protocol::{KvDtype, LeaseId, RequestId};
use common::{chunk_frame, layout};
use proptest::prelude::*;

const LEASES: usize = 3;
const STREAMS: u64 = 3;

#[derive(Debug, Clone)]
enum Ev {
    Open {
        stream: u64,
        lease: usize,
        bad_layout: bool,
    },
    /// `next`: start at the next expected token of the layer (progress); else `start`.
    Chunk {
        stream: u64,
        lease: usize,
        layer: u32,
        next: bool,
        start: u32,
        count: u32,
        corrupt: bool,
    },
    Complete {
        stream: u64,
        lease: usize,
    },
    Close {
        stream: u64,
    },
    Cancel {
        lease: usize,
    },
    Advance {
        ms: u64,
    },
}

/// Mostly the lease's own stream (slot = lease index), sometimes a stray one.
fn stream() -> impl Strategy<Value = (bool, u64)> {
    (prop::bool::weighted(0.05), 0..STREAMS)
}

fn pick(stray: bool, s: u64, lease: usize) -> u64 {
    if stray {
        s
    } else {
        lease as u64 % STREAMS
    }
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        1 => (stream(), 0..LEASES, prop::bool::weighted(0.05))
            .prop_map(|((stray, s), lease, bad_layout)| Ev::Open { stream: pick(stray, s, lease), lease, bad_layout }),
        24 => (stream(), 0..LEASES, 0u32..3, prop::bool::weighted(0.9), 0u32..12, 1u32..8, prop::bool::weighted(0.02))
            .prop_map(|((stray, s), lease, layer, next, start, count, corrupt)| Ev::Chunk { stream: pick(stray, s, lease), lease, layer, next, start, count, corrupt }),
        2 => (stream(), 0..LEASES).prop_map(|((stray, s), lease)| Ev::Complete { stream: pick(stray, s, lease), lease }),
        1 => (0..STREAMS).prop_map(|stream| Ev::Close { stream }),
        1 => (0..LEASES).prop_map(|lease| Ev::Cancel { lease }),
        1 => (0u64..2000).prop_map(|ms| Ev::Advance { ms }),
    ]
}

struct Model {
    ids: Vec<LeaseId>,
    tokens: Vec<u32>,
    blocks: HashMap<LeaseId, usize>,
    /// Next token per (lease, layer), from the Write effects seen.
    next: HashMap<(LeaseId, u32), u32>,
    ended: HashSet<LeaseId>,
    /// Stream slot -> current stream id (a closed stream is replaced by a fresh id).
    streams: Vec<StreamId>,
}

impl Model {
    fn check(&mut self, r: &Receiver, fx: &[Effect]) {
        for e in fx {
            match e {
                Effect::Write(w) => {
                    assert!(!self.ended.contains(&w.lease), "write after the end of {}", w.lease);
                    let n = self.next.entry((w.lease, w.layer)).or_insert(0);
                    assert_eq!(w.token_start, *n, "writes of a layer are contiguous and in order");
                    *n += w.token_count;
                    let i = self.ids.iter().position(|id| *id == w.lease).unwrap();
                    assert!(*n <= self.tokens[i]);
                }
                Effect::Completed { lease, blocks, .. } => {
                    assert!(self.ended.insert(*lease), "{lease} ended twice");
                    assert_eq!(blocks.len(), self.blocks[lease]);
                    let i = self.ids.iter().position(|id| id == lease).unwrap();
                    for layer in 0..layout().num_layers {
                        assert_eq!(
                            self.next.get(&(*lease, layer)).copied().unwrap_or(0),
                            self.tokens[i],
                            "complete before layer {layer} arrived"
                        );
                    }
                }
                Effect::Released { lease, blocks, .. } => {
                    assert!(self.ended.insert(*lease), "{lease} ended twice");
                    assert_eq!(blocks.len(), self.blocks[lease]);
                }
                _ => {}
            }
        }
        let live: usize = self.ids.iter().filter(|id| !self.ended.contains(id)).map(|id| self.blocks[id]).sum();
        assert_eq!(r.reserved_blocks(), live, "reserved blocks == blocks of live leases");
        assert_eq!(r.stats().live_leases, self.ids.iter().filter(|id| !self.ended.contains(id)).count());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn every_lease_ends_exactly_once_and_blocks_balance(
        tokens in prop::collection::vec(1u32..12, LEASES),
        events in prop::collection::vec(ev(), 1..120),
    ) {
        let l = layout();
        let start = Instant::now();
        let mut now = start;
        let mut r = Receiver::new(l.clone(), 1000);
        let mut m = Model { ids: vec![], tokens: tokens.clone(), blocks: HashMap::new(), next: HashMap::new(), ended: HashSet::new(), streams: vec![] };
        let mut next_block = 0;
        for (i, &n) in tokens.iter().enumerate() {
            let nb = n.div_ceil(l.block_size) as usize;
            let blocks = (next_block..next_block + nb as u32).collect();
            next_block += nb as u32;
            let id = r.open_lease(now, LeaseSpec { request_id: RequestId(i as u64), blocks, num_tokens: n, cached_tokens: 0, ttl: Duration::from_secs(10) }).unwrap();
            m.ids.push(id);
            m.blocks.insert(id, nb);
        }
        for s in 0..STREAMS {
            r.stream_opened(s);
            m.streams.push(s);
        }
        // Each lease starts with its sender's Open on its own stream.
        for (i, &n) in tokens.iter().enumerate() {
            let f = Frame::Control(Control::Open(Open {
                request_id: RequestId(i as u64), lease_id: m.ids[i], layout: l.clone(),
                num_tokens: n, stream_index: 0, stream_count: 1,
                rdma_link: None,
            }));
            let fx = r.on_frame(now, i as u64 % STREAMS, f);
            m.check(&r, &fx);
        }
        let mut fresh = STREAMS;
        let mut completes = HashSet::new();
        for e in events {
            let fx = match e {
                Ev::Open { stream, lease, bad_layout } => {
                    let mut lay = l.clone();
                    if bad_layout { lay.dtype = KvDtype::Bf16; }
                    let f = Frame::Control(Control::Open(Open {
                        request_id: RequestId(lease as u64), lease_id: m.ids[lease], layout: lay,
                        num_tokens: tokens[lease], stream_index: 0, stream_count: 1,
                        rdma_link: None,
                    }));
                    r.on_frame(now, m.streams[stream as usize], f)
                }
                Ev::Chunk { stream, lease, layer, next, start: s0, count, corrupt } => {
                    let id = m.ids[lease];
                    let mut s = if next { m.next.get(&(id, layer)).copied().unwrap_or(0) } else { s0 };
                    if next && s >= tokens[lease] {
                        s = tokens[lease] - 1; // the layer is done: resend its last token (a duplicate)
                    }
                    let count = count.min(tokens[lease].saturating_sub(s)).max(1);
                    let mut f = chunk_frame(&l, id, layer, s, count);
                    if corrupt {
                        if let Frame::Chunk { header, .. } = &mut f { header.crc32 ^= 1; }
                    }
                    r.on_frame(now, m.streams[stream as usize], f)
                }
                Ev::Complete { stream, lease } => {
                    // A second Complete is a protocol error; send it only from a stray stream.
                    if !completes.insert(lease) && stream == lease as u64 % STREAMS {
                        continue;
                    }
                    r.on_frame(now, m.streams[stream as usize], Frame::Control(Control::Complete { lease_id: m.ids[lease], first_token: 1 }))
                }
                Ev::Close { stream } => {
                    let fx = r.on_stream_closed(now, m.streams[stream as usize]);
                    r.stream_opened(fresh);
                    m.streams[stream as usize] = fresh;
                    fresh += 1;
                    fx
                }
                Ev::Cancel { lease } => r.cancel(m.ids[lease]),
                Ev::Advance { ms } => {
                    now += Duration::from_millis(ms);
                    r.poll_expired(now)
                }
            };
            m.check(&r, &fx);
        }
        // Whatever happened, time ends every lease and nothing stays leased.
        let fx = r.poll_expired(start + Duration::from_secs(3600));
        m.check(&r, &fx);
        prop_assert_eq!(r.reserved_blocks(), 0);
        prop_assert_eq!(m.ended.len(), LEASES);
    }
}
