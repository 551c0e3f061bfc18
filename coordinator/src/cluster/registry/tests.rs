//! The registry's routing and lifecycle, deterministically (time passed in).

use super::*;
use cleave_net::tls::Roles;
use cleave_protocol::KvDtype;

fn layout(fp: u64) -> KvLayout {
    KvLayout { model_fingerprint: fp, dtype: KvDtype::F32, num_layers: 2, num_kv_heads: 2, head_dim: 8, block_size: 4 }
}

fn reg(name: &str, role: NodeRole, fp: u64, port: u16) -> Register {
    Register {
        role,
        name: name.into(),
        model_name: "m".into(),
        layout: layout(fp),
        kv_capacity_blocks: 100,
        max_model_len: 1024,
        rpc_addr: SocketAddr::from(([127, 0, 0, 1], port)),
        kv_addr: None,
        step_budget: None,
        metrics_addr: None,
        weights: Default::default(),
    }
}

fn q(len: usize) -> RouteQuery {
    RouteQuery { tokens: vec![7; len], max_tokens: 8, ..Default::default() }
}

#[test]
fn refuses_another_model_loudly() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), Some(1));
    let err = r.register(reg("p", NodeRole::Prefill, 2, 1), t).unwrap_err();
    assert!(err.0.contains("fingerprint"), "{err}");
    assert!(r.is_empty());
    // Without a coordinator layout the first node pins it.
    let mut r = Registry::new(RoutingConfig::default(), None);
    r.register(reg("a", NodeRole::Decode, 5, 1), t).unwrap();
    assert!(r.register(reg("b", NodeRole::Decode, 6, 2), t).is_err());
}

#[test]
fn refuses_another_kv_cache_dtype_loudly() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), Some(1));
    let mut bf16 = reg("p", NodeRole::Prefill, 1, 1);
    bf16.layout.dtype = KvDtype::Bf16;
    r.register(bf16, t).unwrap();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut other = reg("d", NodeRole::Decode, 1, 2);
        other.layout.dtype = dtype;
        let err = r.register(other, t).unwrap_err();
        assert!(err.0.contains("kv cache dtype") && err.0.contains("--kv-cache-dtype"), "{err}");
        assert!(err.0.contains("`d`") && err.0.contains("bf16"), "{err}");
    }
    assert_eq!(r.len(), 1);
    // The same dtype is welcome.
    let mut same = reg("d2", NodeRole::Decode, 1, 3);
    same.layout.dtype = KvDtype::Bf16;
    r.register(same, t).unwrap();
    assert_eq!(r.len(), 2);
}

#[test]
fn long_prompts_go_remote_short_ones_local() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    let (plan, _) = r.plan(&q(200)).unwrap();
    assert!(matches!(plan, Plan::Remote { ref prefill, ref decode } if prefill.id == p && decode.id == d), "{plan:?}");
    let (plan, _) = r.plan(&q(10)).unwrap();
    assert!(matches!(plan, Plan::Local { reason: LocalReason::ShortPrompt, .. }), "{plan:?}");
}

#[test]
fn colocated_nodes_prefill_locally_and_dead_nodes_are_not_routed() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let a = r.register(reg("a", NodeRole::Both, 1, 1), t).unwrap();
    let (plan, _) = r.plan(&q(200)).unwrap();
    assert_eq!(plan, Plan::Local { decode: r.nodes()[0].clone(), reason: LocalReason::Colocated });
    let later = t + Duration::from_secs(4);
    let dead = r.expire(later);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, a);
    assert!(r.plan(&q(200)).is_err());
}

#[test]
fn no_prefill_node_and_saturation_fall_back_to_local() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    let (plan, _) = r.plan(&q(200)).unwrap();
    assert!(matches!(plan, Plan::Local { reason: LocalReason::NoPrefillNode, .. }));
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    r.report(p, LoadReport { queued_prefill_tokens: 1 << 20, ..Default::default() }, t);
    let (plan, _) = r.plan(&q(200)).unwrap();
    assert!(matches!(plan, Plan::Local { reason: LocalReason::PrefillSaturated, .. }), "{plan:?}");
    // Excluding the failed prefill node also falls back.
    let mut qq = q(200);
    qq.exclude = vec![p];
    let (plan, _) = r.plan(&qq).unwrap();
    assert!(matches!(plan, Plan::Local { reason: LocalReason::NoPrefillNode, .. }));
}

#[test]
fn bursts_spread_over_the_pool_and_prefix_overlap_attracts() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p1 = r.register(reg("p1", NodeRole::Prefill, 1, 1), t).unwrap();
    let p2 = r.register(reg("p2", NodeRole::Prefill, 1, 2), t).unwrap();
    let d1 = r.register(reg("d1", NodeRole::Decode, 1, 3), t).unwrap();
    let d2 = r.register(reg("d2", NodeRole::Decode, 1, 4), t).unwrap();
    let mut seen_p = HashSet::new();
    let mut seen_d = HashSet::new();
    for _ in 0..4 {
        let (plan, _) = r.plan(&q(200)).unwrap();
        let Plan::Remote { prefill, decode } = plan else { panic!("{plan:?}") };
        seen_p.insert(prefill.id);
        seen_d.insert(decode.id);
    }
    assert_eq!(seen_p, HashSet::from([p1, p2]));
    assert_eq!(seen_d, HashSet::from([d1, d2]));
    // After fresh (equal) reports, the prefill node holding the prompt's prefix wins.
    let hashes: Vec<u64> = cleave_protocol::prefix::hash_chain(&q(200).tokens, 4).collect();
    r.report(p1, LoadReport { queued_prefill_tokens: 50, ..Default::default() }, t);
    r.report(p2, LoadReport { queued_prefill_tokens: 50, prefix_hashes: hashes, ..Default::default() }, t);
    for d in [d1, d2] {
        r.report(d, busy(2), t);
    }
    let (plan, a) = r.plan(&q(200)).unwrap();
    let Plan::Remote { prefill, .. } = plan else { panic!() };
    assert_eq!(prefill.id, p2);
    r.release(&a, t);
}

fn busy(running: u32) -> LoadReport {
    LoadReport { running_seqs: running, total_blocks: 100, free_blocks: 100, ..Default::default() }
}

#[test]
fn a_drained_decode_node_takes_no_work_and_parks_once_its_streams_end() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let d1 = r.register(reg("d1", NodeRole::Decode, 1, 1), t).unwrap();
    let d2 = r.register(reg("d2", NodeRole::Decode, 1, 2), t).unwrap();
    // A stream runs on d1.
    let mut qq = q(10);
    qq.exclude = vec![d2];
    let (plan, a) = r.plan(&qq).unwrap();
    assert!(matches!(plan, Plan::Local { ref decode, .. } if decode.id == d1));
    r.drain(d1, AfterDrain::Stay, t).unwrap();
    // New work goes elsewhere only.
    for _ in 0..5 {
        let (plan, b) = r.plan(&q(10)).unwrap();
        assert!(matches!(plan, Plan::Local { ref decode, .. } if decode.id == d2), "{plan:?}");
        r.release(&b, t);
    }
    // Still streaming: nothing happens, however many reports.
    r.report(d1, busy(1), t + Duration::from_millis(200));
    assert!(r.lifecycle().is_empty());
    assert!(matches!(r.node_states(t)[0].lifecycle, Lifecycle::Draining { .. }));
    // The stream ends; the engine must confirm it let go (a report after the release).
    r.release(&a, t + Duration::from_millis(300));
    r.lifecycle();
    assert!(matches!(r.node_states(t)[0].lifecycle, Lifecycle::Draining { .. }), "not confirmed yet");
    r.report(d1, busy(0), t + Duration::from_millis(400));
    assert!(r.lifecycle().is_empty(), "parking tells the node nothing");
    assert_eq!(r.node_states(t)[0].lifecycle, Lifecycle::Drained);
    // Nothing routes to a parked node; giving it a role again brings it back.
    let mut only = q(10);
    only.exclude = vec![d2];
    assert!(r.plan(&only).is_err());
    r.set_role(d1, NodeRole::Decode, None, t + Duration::from_millis(500)).unwrap();
    assert_eq!(r.lifecycle(), vec![Effect::SetRole { node: d1, role: NodeRole::Decode, step_budget: None }]);
    assert!(r.plan(&only).is_ok());
}

#[test]
fn a_role_switch_drains_only_what_the_new_role_does_not_do() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    let (plan, mut a) = r.plan(&q(200)).unwrap();
    assert!(matches!(plan, Plan::Remote { .. }));
    // Decode -> both: nothing to drain (its streams are colocated work too): at once.
    r.set_role(d, NodeRole::Both, Some(128), ms(1)).unwrap();
    assert_eq!(r.lifecycle(), vec![Effect::SetRole { node: d, role: NodeRole::Both, step_budget: Some(128) }]);
    assert_eq!(r.node_states(t)[1].step_budget, Some(128));
    // Prefill -> decode waits for its prefill, not for the stream's decode.
    r.set_role(p, NodeRole::Decode, None, ms(2)).unwrap();
    r.report(p, busy(1), ms(3));
    assert!(r.lifecycle().is_empty());
    r.release_prefill(&mut a, ms(4));
    assert!(a.prefill.is_none(), "the booking forgets its prefill part");
    r.report(p, busy(0), ms(5));
    assert_eq!(r.lifecycle(), vec![Effect::SetRole { node: p, role: NodeRole::Decode, step_budget: None }]);
    // Releasing the whole attempt later does not count the prefill twice.
    r.release(&a, ms(6));
    let s = r.node_states(t);
    assert_eq!((s[0].active_prefill, s[0].active_decode, s[1].active_decode), (0, 0, 0));
    // Both -> prefill must drain the colocated node's streams.
    let (_, b) = r.plan(&q(10)).unwrap();
    let holder = if b.decode.unwrap().0 == d { d } else { p };
    r.set_role(holder, NodeRole::Prefill, None, ms(7)).unwrap();
    r.report(holder, busy(0), ms(8));
    assert!(r.lifecycle().is_empty(), "a routed stream is still running there");
    r.release(&b, ms(9));
    r.report(holder, busy(0), ms(10));
    assert_eq!(r.lifecycle().len(), 1);
}

/// Switching 1 prefill + 1 decode to 2 colocated under load (what the planner does when the
/// load turns decode-heavy) and back: at no moment may a request find no node, and a node
/// keeps the work its old and new roles share while it switches.
#[test]
fn a_switching_node_keeps_the_work_both_roles_do() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    // Both switches start before the registry's next lifecycle pass.
    r.set_role(p, NodeRole::Both, None, ms(1)).unwrap();
    r.set_role(d, NodeRole::Both, None, ms(1)).unwrap();
    let (plan, a) = r.plan(&q(200)).expect("a request routes mid-switch");
    assert!(matches!(plan, Plan::Remote { .. }), "p keeps prefilling, d keeps decoding: {plan:?}");
    r.lifecycle();
    r.release(&a, ms(2));
    // Colocated now; one stream on each node.
    let (_, a) = r.plan(&q(200)).unwrap();
    let (_, b) = r.plan(&q(200)).unwrap();
    assert_ne!(a.decode.unwrap().0, b.decode.unwrap().0);
    // Back: both -> decode keeps decoding, both -> prefill keeps prefilling, while p drains
    // its stream.
    r.set_role(p, NodeRole::Prefill, None, ms(3)).unwrap();
    r.set_role(d, NodeRole::Decode, None, ms(3)).unwrap();
    let (plan, c) = r.plan(&q(200)).expect("a request routes mid-switch");
    match plan {
        Plan::Remote { prefill, decode } => assert_eq!((prefill.id, decode.id), (p, d)),
        other => panic!("want p -> d, got {other:?}"),
    }
    // d's switch waits only for its queued prefill, not its running streams (it keeps them,
    // and takes new ones).
    r.report(d, LoadReport { running_seqs: 2, total_blocks: 100, free_blocks: 90, ..Default::default() }, ms(4));
    let done = r.lifecycle();
    assert_eq!(done, vec![Effect::SetRole { node: d, role: NodeRole::Decode, step_budget: None }]);
    // p drains its colocated stream before it is a prefill node.
    let p_stream = if a.decode.unwrap().0 == p { &a } else { &b };
    r.report(p, busy(1), ms(5));
    assert!(r.lifecycle().is_empty());
    r.release(p_stream, ms(6));
    r.report(p, busy(0), ms(7));
    assert_eq!(r.lifecycle(), vec![Effect::SetRole { node: p, role: NodeRole::Prefill, step_budget: None }]);
    r.release(&c, ms(8));
}

/// A decode -> prefill switch of the only decode node leaves no node to decode until another
/// switches in: the refusal says so (transient), so the request is held, not failed.
#[test]
fn no_route_during_a_switch_is_transient() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    r.set_role(d, NodeRole::Prefill, None, t).unwrap();
    r.set_role(p, NodeRole::Decode, None, t).unwrap();
    let e = r.plan(&q(200)).unwrap_err();
    assert_eq!(e.wait, Some(Wait::Switch), "{e}");
    r.report(p, busy(0), t + Duration::from_millis(1));
    r.report(d, busy(0), t + Duration::from_millis(1));
    assert_eq!(r.lifecycle().len(), 2);
    assert!(r.plan(&q(200)).is_ok());
    // With nothing switching, no route is final.
    let mut only = q(200);
    only.exclude = vec![p];
    let e = r.plan(&only).unwrap_err();
    assert_eq!(e.wait, None, "{e}");
}

#[test]
fn leaving_nodes_are_told_once_and_refuse_further_operations() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let d = r.register(reg("d", NodeRole::Decode, 1, 1), t).unwrap();
    r.drain(d, AfterDrain::Leave, t).unwrap();
    r.report(d, busy(0), t + Duration::from_millis(1));
    assert!(matches!(r.lifecycle()[..], [Effect::Leave { node, .. }] if node == d));
    assert!(r.lifecycle().is_empty());
    assert_eq!(r.drain(d, AfterDrain::Stay, t), Err(NodeOpError::Leaving { id: d }));
    assert_eq!(r.set_role(99, NodeRole::Decode, None, t), Err(NodeOpError::UnknownNode(99)));
    assert_eq!(r.pools().decode.nodes, 0, "a leaving node is not counted as routable");
}

#[test]
fn the_planner_s_saturation_line_replaces_the_configured_one_and_restores_it() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    r.report(p, LoadReport { queued_prefill_tokens: 5_000, ..Default::default() }, t);
    let (plan, a) = r.plan(&q(200)).unwrap();
    assert!(matches!(plan, Plan::Remote { .. }), "5000 queued tokens are under the configured 65536: {plan:?}");
    r.release(&a, t);
    r.set_bridge(Some(4_000));
    let (plan, a) = r.plan(&q(200)).unwrap();
    assert!(matches!(plan, Plan::Local { reason: LocalReason::PrefillSaturated, .. }), "{plan:?}");
    r.release(&a, t);
    r.set_bridge(None);
    assert_eq!(r.saturation_tokens(), 65_536);
    assert!(matches!(r.plan(&q(200)).unwrap().0, Plan::Remote { .. }));
}

#[test]
fn a_node_is_never_given_a_role_its_certificate_does_not_allow() {
    let mut r = Registry::new(RoutingConfig::default(), None);
    let t = Instant::now();
    let refused = r.register_with(reg("p", NodeRole::Decode, 1, 1), Roles::PREFILL, t).unwrap_err();
    assert!(refused.0.contains("allows prefill"), "{}", refused.0);
    let id = r.register_with(reg("p", NodeRole::Prefill, 1, 1), Roles::PREFILL, t).unwrap();
    for role in [NodeRole::Decode, NodeRole::Both] {
        let e = r.set_role(id, role, None, t).unwrap_err();
        assert!(matches!(e, NodeOpError::RoleNotAllowed { id: i, .. } if i == id), "{e}");
    }
    r.set_role(id, NodeRole::Prefill, Some(64), t).unwrap();
    let any = r.register(reg("a", NodeRole::Decode, 1, 2), t).unwrap();
    r.set_role(any, NodeRole::Both, None, t).unwrap();
}

/// A report that misses a middle block's key still counts the blocks up to the last key it
/// has (a key names its whole prefix), and the decode node holding the prompt's prefix wins
/// over an equal one (a delta handoff then moves only the rest).
#[test]
fn a_missing_middle_key_does_not_hide_the_rest_of_a_match() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let _p = r.register(reg("p1", NodeRole::Prefill, 1, 1), t).unwrap();
    let d1 = r.register(reg("d1", NodeRole::Decode, 1, 2), t).unwrap();
    let d2 = r.register(reg("d2", NodeRole::Decode, 1, 3), t).unwrap();
    let mut hashes: Vec<u64> = cleave_protocol::prefix::hash_chain(&q(200).tokens, 4).collect();
    assert!(hashes.len() >= 40);
    hashes.truncate(40);
    let full = |prefix_hashes| LoadReport { total_blocks: 100, free_blocks: 100, prefix_hashes, ..Default::default() };
    // d2 reports the first 40 blocks but one in the middle; d1 the first 10, all of them.
    let mut gap = hashes.clone();
    gap.remove(20);
    r.report(d1, full(hashes[..10].to_vec()), t);
    r.report(d2, full(gap), t);
    assert_eq!(r.nodes[&d2].overlap(&hashes), 40);
    assert_eq!(r.nodes[&d1].overlap(&hashes), 10);
    let (plan, a) = r.plan(&q(200)).unwrap();
    let Plan::Remote { decode, .. } = plan else { panic!("{plan:?}") };
    assert_eq!(decode.id, d2, "the node holding more of the prompt decodes it");
    r.release(&a, t);
}

/// A handoff needs the prompt's blocks reserved on the decode node at once: while no decode
/// node has them, the request is held (not sent to a node that would refuse it), and goes once
/// a node reports room. Short prompts prefilled locally are not held (the engine queues them).
#[test]
fn a_handoff_waits_for_room_on_a_decode_node() {
    let t = Instant::now();
    let ms = |n| t + Duration::from_millis(n);
    let mut r = Registry::new(RoutingConfig::default(), None);
    r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    // 200 tokens are 50 blocks: two reservations fit the 100 free blocks, a third does not,
    // even before the node reports them.
    for _ in 0..2 {
        assert!(matches!(r.plan(&q(200)).unwrap().0, Plan::Remote { .. }));
    }
    let e = r.plan(&q(200)).unwrap_err();
    assert_eq!(e.wait, Some(Wait::DecodeKv), "{e}");
    assert!(e.reason.contains("needs 50 blocks") && e.reason.contains("0 free of 100"), "{e}");
    // The node's report counts them: still no room.
    let full = LoadReport { running_seqs: 2, total_blocks: 100, free_blocks: 0, ..Default::default() };
    r.report(d, full.clone(), ms(1));
    assert_eq!(r.plan(&q(200)).unwrap_err().wait, Some(Wait::DecodeKv));
    // A short prompt prefills on the decode node, whose engine queues it.
    assert!(matches!(r.plan(&q(8)).unwrap().0, Plan::Local { reason: LocalReason::ShortPrompt, .. }));
    // Evictable cached blocks are room: one stream ended, its prompt blocks stay cached.
    r.report(d, LoadReport { running_seqs: 1, cached_blocks: 30, free_blocks: 20, ..full }, ms(2));
    assert!(matches!(r.plan(&q(200)).unwrap().0, Plan::Remote { .. }));
    assert_eq!(r.plan(&q(200)).unwrap_err().wait, Some(Wait::DecodeKv), "that booking took the room");
    // A prompt no decode node could ever hold is not held: the answer is final.
    let e = r.plan(&q(404)).unwrap_err();
    assert_eq!(e.wait, None, "{e}");
    assert!(e.reason.contains("needs 101 blocks"), "{e}");
}

/// A report of a node that ran `steps` decode steps of `batch` sequences, `step_ms` each, on
/// top of `t` (its running totals).
fn ran(t: &mut cleave_protocol::control::StepTotals, steps: u64, batch: u64, step_ms: u64) -> LoadReport {
    t.decode_steps += steps;
    t.decode_seqs += steps * batch;
    t.decode_us += steps * step_ms * 1000;
    LoadReport { free_blocks: 100, total_blocks: 100, steps: *t, ..Default::default() }
}

#[test]
fn slo_admission_holds_requests_for_a_seat_once_every_node_runs_over_the_tpot_target() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let a = r.register(reg("a", NodeRole::Both, 1, 1), t).unwrap();
    let b = r.register(reg("b", NodeRole::Both, 1, 2), t).unwrap();
    r.set_admission(Some(Admission::from_targets(Duration::from_secs(2), Duration::from_millis(100))));
    let (mut ta, mut tb) = Default::default();
    r.report(a, ran(&mut ta, 0, 0, 0), t);
    r.report(b, ran(&mut tb, 0, 0, 0), t);
    // Within the target: no cap, every request is routed.
    r.report(a, ran(&mut ta, 20, 4, 60), t);
    let booked: Vec<_> = (0..10).map(|_| r.plan(&q(10)).unwrap().1).collect();
    assert!(r.node_states(t).iter().all(|s| s.seat_cap.is_none()));
    for x in &booked {
        r.release(x, t);
    }
    // Both run over it: 8 sequences at 160 ms a step is a cap of 8 x 85 / 160 = 4.25: 4 each.
    r.report(a, ran(&mut ta, 20, 8, 160), t);
    r.report(b, ran(&mut tb, 20, 8, 160), t);
    assert!(r.node_states(t).iter().all(|s| s.seat_cap == Some(4)), "{:?}", r.node_states(t));
    let booked: Vec<_> = (0..8).map(|_| r.plan(&q(10)).expect("a free seat").1).collect();
    let err = r.plan(&q(10)).unwrap_err();
    assert_eq!(err.wait, Some(Wait::Seats { max_wait: Duration::from_secs(1) }), "{err}");
    assert!(err.reason.contains("100 ms TPOT target"), "{err}");
    // A stream that moves after its node failed keeps its seat wherever it lands.
    let moved = RouteQuery { force_local: true, ..q(10) };
    let (_, m) = r.plan(&moved).expect("a migration is not held for a seat");
    r.release(&m, t);
    // A stream ends: its seat frees.
    r.release(&booked[0], t);
    r.plan(&q(10)).expect("the freed seat");
    // Off: every cap is forgotten.
    r.set_admission(None);
    r.plan(&q(10)).expect("no admission");
    assert!(r.node_states(t).iter().all(|s| s.seat_cap.is_none()));
}

/// A colocated node's seats follow its hold; a decode node's stay on the target.
#[test]
fn a_colocated_nodes_seats_follow_the_hold_and_a_decode_nodes_the_target() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let c = r.register(reg("c", NodeRole::Both, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    let a = Admission::from_targets(Duration::from_secs(2), Duration::from_millis(100))
        .holding_colocated(Duration::from_millis(50));
    r.set_admission(Some(a));
    let (mut tc, mut td) = Default::default();
    r.report(c, ran(&mut tc, 0, 0, 0), t);
    r.report(d, ran(&mut td, 0, 0, 0), t);
    // Both run 8 sequences at 80 ms a step: within the target (85 ms), past the hold (42.5 ms).
    r.report(c, ran(&mut tc, 20, 8, 80), t);
    r.report(d, ran(&mut td, 20, 8, 80), t);
    let cap = |id: u64| r.node_states(t).into_iter().find(|s| s.node.id == id).unwrap().seat_cap;
    // 8 x 42.5 / 80 = 4.25.
    assert_eq!((cap(c), cap(d)), (Some(4), None));
    // A hold above the target is the target.
    let loose = Admission::from_targets(Duration::from_secs(2), Duration::from_millis(100))
        .holding_colocated(Duration::from_millis(500));
    assert_eq!(loose.tpot_target_for(true), Duration::from_millis(100));
}

#[test]
fn a_seat_cap_that_turned_requests_away_grows_while_the_node_keeps_up() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let a = r.register(reg("a", NodeRole::Both, 1, 1), t).unwrap();
    r.set_admission(Some(Admission::from_targets(Duration::from_secs(2), Duration::from_millis(100))));
    let mut ta = Default::default();
    r.report(a, ran(&mut ta, 0, 0, 0), t);
    r.report(a, ran(&mut ta, 20, 2, 340), t);
    assert_eq!(r.node_states(t)[0].seat_cap, Some(1));
    let (_, one) = r.plan(&q(10)).unwrap();
    assert!(r.plan(&q(10)).is_err());
    // The node now keeps up easily: a cap that turned requests away grows.
    r.report(a, ran(&mut ta, 20, 1, 20), t);
    assert!(r.node_states(t)[0].seat_cap.unwrap() >= 2, "{:?}", r.node_states(t)[0].seat_cap);
    r.plan(&q(10)).expect("a new seat");
    r.release(&one, t);
}

#[test]
fn slo_admission_refuses_a_prompt_that_would_wait_past_the_ttft_target() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    r.set_admission(Some(Admission::from_targets(Duration::from_secs(2), Duration::from_millis(100))));
    let mut tp = cleave_protocol::control::StepTotals::default();
    let prefill = |tp: &cleave_protocol::control::StepTotals, queued: u64| LoadReport {
        queued_prefill_tokens: queued,
        free_blocks: 100,
        total_blocks: 100,
        steps: *tp,
        ..Default::default()
    };
    r.report(p, prefill(&tp, 0), t);
    r.report(d, LoadReport { free_blocks: 100, total_blocks: 100, ..Default::default() }, t);
    // Unmeasured: nothing is refused for its TTFT.
    r.report(p, prefill(&tp, 100_000), t);
    let (_, a) = r.plan(&q(200)).expect("no rate measured yet");
    r.release(&a, t);
    // 1000 prompt tokens a second: 1500 queued and 200 more is 1.7 s, within 2 s; after 0.5 s
    // waited it is not.
    tp.prefill_tokens += 1000;
    tp.prefill_us += 1_000_000;
    r.report(p, prefill(&tp, 1500), t);
    let (_, a) = r.plan(&q(200)).expect("1.7 s to the first token");
    r.release(&a, t);
    r.report(p, prefill(&tp, 1500), t);
    let late = RouteQuery { waited: Duration::from_millis(500), ..q(200) };
    let err = r.plan(&late).unwrap_err();
    assert!(err.shed && err.wait.is_none(), "{err:?}");
    assert!(err.reason.contains("2.2 s") && err.reason.contains("1700 prompt tokens"), "{err}");
    // A migration is never refused for it.
    r.plan(&RouteQuery { force_local: true, ..late.clone() }).expect("a migration goes on");
    // A wild report (256 tokens in u64::MAX us) halves the rate read: still refused, no panic.
    tp.prefill_tokens += 256;
    tp.prefill_us = u64::MAX;
    r.report(p, prefill(&tp, 1500), t);
    r.report(p, prefill(&tp, 1500), t);
    assert!(r.plan(&q(200)).unwrap_err().shed);
}

#[test]
fn a_report_that_predates_a_stream_does_not_make_its_node_look_idle() {
    // Two idle colocated nodes; a prompt goes to the first. Its node's next report was
    // snapshotted before the prompt reached it (it says nothing runs): the next prompt must
    // still go to the other node, not queue behind the first.
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let a = r.register(reg("a", NodeRole::Both, 1, 1), t).unwrap();
    let b = r.register(reg("b", NodeRole::Both, 1, 2), t).unwrap();
    let idle = LoadReport { total_blocks: 100, free_blocks: 100, ..Default::default() };
    r.report(a, idle.clone(), t);
    r.report(b, idle.clone(), t);
    let (first, booked) = r.plan(&q(40)).unwrap();
    let Plan::Local { decode: ref d1, .. } = first else { panic!("{first:?}") };
    r.report(d1.id, idle.clone(), t + Duration::from_millis(200));
    let (second, _) = r.plan(&q(40)).unwrap();
    let Plan::Local { decode: ref d2, .. } = second else { panic!("{second:?}") };
    assert_ne!(d1.id, d2.id, "both prompts went to {}", d1.name);
    // Once the first stream ended, its node is as good as new.
    r.release(&booked, t + Duration::from_secs(1));
    r.report(d1.id, idle, t + Duration::from_secs(1));
    let (third, _) = r.plan(&q(40)).unwrap();
    let Plan::Local { decode: ref d3, .. } = third else { panic!("{third:?}") };
    assert_eq!(d3.id, d1.id, "the idle node takes the third");
}

#[test]
fn a_report_that_predates_a_prompt_does_not_empty_its_prefill_nodes_queue() {
    let t = Instant::now();
    let mut r = Registry::new(RoutingConfig::default(), None);
    let p1 = r.register(reg("p1", NodeRole::Prefill, 1, 1), t).unwrap();
    let p2 = r.register(reg("p2", NodeRole::Prefill, 1, 2), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 3), t).unwrap();
    r.report(d, LoadReport { total_blocks: 1000, free_blocks: 1000, ..Default::default() }, t);
    let (first, mut booked) = r.plan(&q(200)).unwrap();
    let Plan::Remote { prefill: ref a, .. } = first else { panic!("{first:?}") };
    // Its node's report says nothing is queued: it was taken before the prompt arrived.
    r.report(a.id, LoadReport::default(), t + Duration::from_millis(200));
    let (second, _) = r.plan(&q(200)).unwrap();
    let Plan::Remote { prefill: ref b, .. } = second else { panic!("{second:?}") };
    assert_ne!(a.id, b.id, "both prompts queued on {}", a.name);
    assert_eq!(HashSet::from([a.id, b.id]), HashSet::from([p1, p2]));
    // Its handoff done, the first node's queue is empty again.
    r.release_prefill(&mut booked, t + Duration::from_secs(1));
    let (third, _) = r.plan(&q(200)).unwrap();
    let Plan::Remote { prefill: ref c, .. } = third else { panic!("{third:?}") };
    assert_eq!(c.id, a.id);
}

#[test]
fn the_planner_sees_work_routed_since_a_report_that_predates_it() {
    // A stream on a colocated node and a prompt on a prefill node, each node's next report
    // snapshotted before its work arrived: the planner's snapshot still counts both, as
    // routing does (it read the reports alone, and saw the nodes idle).
    let t = Instant::now();
    let at = |d: u64| t + Duration::from_millis(d);
    let plan_view = |r: &Registry, now: Instant| crate::cluster::planning::snapshot(&r.node_states(now), now - t);
    let mut r = Registry::new(RoutingConfig::default(), None);
    let c = r.register(reg("c", NodeRole::Both, 1, 1), t).unwrap();
    let idle = LoadReport { total_blocks: 100, free_blocks: 100, ..Default::default() };
    r.report(c, idle.clone(), t);
    let (local, booked) = r.plan(&q(40)).unwrap();
    assert!(matches!(local, Plan::Local { .. }), "{local:?}");
    r.report(c, idle.clone(), at(200));
    let snap = plan_view(&r, at(200));
    assert_eq!(snap.nodes[0].running_seqs, 1, "{snap:?}");
    r.release(&booked, at(300));
    r.report(c, idle.clone(), at(300));
    assert_eq!(plan_view(&r, at(300)).nodes[0].running_seqs, 0);

    let mut r = Registry::new(RoutingConfig::default(), None);
    let p = r.register(reg("p", NodeRole::Prefill, 1, 1), t).unwrap();
    let d = r.register(reg("d", NodeRole::Decode, 1, 2), t).unwrap();
    r.report(d, LoadReport { total_blocks: 1000, free_blocks: 1000, ..Default::default() }, t);
    let (remote, mut booked) = r.plan(&q(200)).unwrap();
    assert!(matches!(remote, Plan::Remote { .. }), "{remote:?}");
    r.report(p, LoadReport::default(), at(200));
    let snap = plan_view(&r, at(200));
    let queued =
        |s: &cleave_planner::Snapshot, id: u64| s.nodes.iter().find(|n| n.id == id).unwrap().queued_prefill_tokens;
    assert_eq!(queued(&snap, p), 200, "{snap:?}");
    r.release_prefill(&mut booked, at(300));
    assert_eq!(queued(&plan_view(&r, at(300)), p), 0);
}
