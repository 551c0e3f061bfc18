//! (4) Limits and the node budget always hold, and actions only ever name active nodes
//! (proptest over random limits, clusters and demand); (8) the search over counts finds what
//! brute force over every split finds, and a 400-node cluster plans in one tick.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use cleave_planner::{
    Action, Arrival, Completion, Limits, Mode, NodeObs, NodeState, Planner, PlannerConfig, PoolTarget, Role, Snapshot,
    StepCosts, Targets,
};
use proptest::prelude::*;

use common::{cpu_costs, node};

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Prefill), Just(Role::Decode), Just(Role::Both)]
}

fn state() -> impl Strategy<Value = NodeState> {
    prop_oneof![
        6 => Just(NodeState::Active),
        1 => Just(NodeState::Draining),
        1 => Just(NodeState::Starting),
        1 => role().prop_map(|to| NodeState::Switching { to }),
    ]
}

fn nodes() -> impl Strategy<Value = Vec<NodeObs>> {
    prop::collection::vec(
        (
            role(),
            state(),
            0u32..80,
            0u32..20,
            0u64..20_000,
            prop::option::of(prop::sample::select(vec![64u32, 256, 2048])),
        ),
        0..14,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (role, state, running, waiting, queued, budget))| NodeObs {
                id: 100 + i as u64,
                role,
                state,
                queued_prefill_tokens: queued,
                waiting_seqs: waiting,
                running_seqs: running,
                kv_used_ratio: 0.5,
                step_budget: budget,
                paced: i % 2 == 0,
            })
            .collect()
    })
}

fn small_min() -> impl Strategy<Value = u32> {
    prop_oneof![3 => Just(0u32), 1 => 1u32..3]
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        small_min(),
        small_min(),
        small_min(),
        0u32..5,
        0u32..5,
        0u32..5,
        1u32..14,
        prop::sample::subsequence(vec![32u32, 64, 128, 256, 512, 2048], 1..4),
    )
        .prop_map(|(min_p, min_d, min_c, ep, ed, ec, max_nodes, step_budgets)| Limits {
            min_prefill: min_p,
            max_prefill: min_p + ep,
            min_decode: min_d,
            max_decode: min_d + ed,
            min_colocated: min_c,
            max_colocated: min_c + ec,
            max_nodes,
            step_budgets,
        })
}

fn counts(snap: &Snapshot) -> [u32; 3] {
    let mut c = [0u32; 3];
    for n in &snap.nodes {
        if let Some(r) = n.effective_role() {
            c[idx(r)] += 1;
        }
    }
    c
}

fn idx(r: Role) -> usize {
    match r {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Both => 2,
    }
}

fn check_target(t: &PoolTarget, l: &Limits) -> Result<(), TestCaseError> {
    for (v, lo, hi, name) in [
        (t.prefill, l.min_prefill, l.max_prefill, "prefill"),
        (t.decode, l.min_decode, l.max_decode, "decode"),
        (t.colocated, l.min_colocated, l.max_colocated, "colocated"),
    ] {
        prop_assert!(lo <= v && v <= hi, "{name} {v} outside {lo}..={hi}: {t:?}");
    }
    prop_assert!(t.nodes() <= l.max_nodes, "{t:?} over the budget {}", l.max_nodes);
    prop_assert!(t.nodes() >= 1);
    match t.step_budget {
        Some(b) => prop_assert!(t.colocated > 0 && l.step_budgets.contains(&b), "{t:?}"),
        None => prop_assert_eq!(t.colocated, 0),
    }
    Ok(())
}

/// Applies the actions to the pool counts one by one: each must name an active node in the
/// role it claims, none twice, and move one count toward the target.
fn check_actions(
    snap: &Snapshot,
    t: &PoolTarget,
    actions: &[Action],
    l: &Limits,
    can_add: bool,
) -> Result<(), TestCaseError> {
    let mut c = counts(snap);
    let start = c;
    let goal = [t.prefill, t.decode, t.colocated];
    let start_total: u32 = start.iter().sum();
    let mut moved = HashSet::new();
    let active = |id: u64| snap.nodes.iter().find(|n| n.id == id && n.state == NodeState::Active);
    for a in actions {
        match *a {
            Action::SwitchRole { node, from, to } => {
                let n = active(node)
                    .ok_or_else(|| TestCaseError::fail(format!("{a:?} names a node that is not active")))?;
                prop_assert_eq!(n.role, from);
                prop_assert!(from != to);
                prop_assert!(moved.insert(node), "{node} moved twice");
                c[idx(from)] -= 1;
                c[idx(to)] += 1;
            }
            Action::StopNode { node } => {
                prop_assert!(can_add, "{a:?} without an actuator");
                let n = active(node)
                    .ok_or_else(|| TestCaseError::fail(format!("{a:?} names a node that is not active")))?;
                prop_assert!(moved.insert(node), "{node} moved twice");
                c[idx(n.role)] -= 1;
            }
            Action::StartNode { role } => {
                prop_assert!(can_add, "{a:?} without an actuator");
                c[idx(role)] += 1;
            }
            Action::SetStepBudget { node, tokens } => {
                prop_assert!(active(node).is_some(), "{a:?} names a node that is not active");
                prop_assert!(l.step_budgets.contains(&tokens));
                prop_assert_eq!(Some(tokens), t.step_budget);
            }
        }
        for i in 0..3 {
            let (lo, hi) = (start[i].min(goal[i]), start[i].max(goal[i]));
            prop_assert!(lo <= c[i] && c[i] <= hi, "pool {i} at {} outside {lo}..={hi} after {a:?}", c[i]);
        }
        let total: u32 = c.iter().sum();
        prop_assert!(total <= start_total.max(l.max_nodes), "total {total} after {a:?}");
    }
    prop_assert_eq!(c, goal, "actions {:?} do not reach the target from {:?}", actions, start);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn targets_and_actions_respect_limits_and_name_only_active_nodes(
        l in limits(),
        nodes in nodes(),
        can_add in any::<bool>(),
        rate in 0.0f64..12.0,
        prompt in 1u32..3000,
        max_tokens in 1u32..600,
        ttft_ms in 100.0f64..10_000.0,
        tpot_ms in 20.0f64..400.0,
        slow in 0.2f64..3.0,
    ) {
        let cfg = PlannerConfig {
            mode: Mode::Auto,
            targets: Targets { ttft_ms, tpot_ms, quantile: 0.9, attainment: 0.9, colocated_tpot_ms: None },
            limits: l.clone(),
            window: Duration::from_secs(20),
            cooldown: Duration::ZERO,
            confirm_ticks: 1,
            scale_up_margin: 0.9,
            scale_down_margin: 0.7,
            can_add_nodes: can_add,
        };
        prop_assume!(cfg.validate().is_ok());
        let mut p = Planner::new(cfg, Box::new(cpu_costs())).unwrap();
        let mut acc = 0.0;
        for s in 0..60u64 {
            let now = Duration::from_secs(s);
            acc += rate;
            while acc >= 1.0 {
                acc -= 1.0;
                p.on_arrival(Arrival { at: now, prompt_tokens: prompt, max_tokens });
                let ttft = Duration::from_secs_f64(0.1 * slow * f64::from(prompt).sqrt());
                p.on_completion(Completion { at: now, ttft, tpot: Some(Duration::from_millis((60.0 * slow) as u64)), output_tokens: max_tokens / 2, max_tokens, ok: s % 7 != 0 });
            }
            // The queue and the batches move over time; the node set does not.
            let mut snap = Snapshot { now, nodes: nodes.clone() };
            for n in &mut snap.nodes {
                n.queued_prefill_tokens = n.queued_prefill_tokens * (s % 5) / 4;
            }
            let e = p.estimate(&snap);
            prop_assert!(e.ttft_correction >= 0.5 && e.ttft_correction <= 4.0);
            if let Some(d) = p.tick(&snap) {
                check_target(&d.target, &l)?;
                check_actions(&snap, &d.target, &d.actions, &l, can_add)?;
                prop_assert!(d.applied);
                prop_assert!(!d.why.is_empty());
                if !can_add {
                    prop_assert_eq!(d.target.nodes(), counts(&snap).iter().sum::<u32>());
                }
            }
        }
    }
}

fn cluster(p: u32, d: u32, now: Duration) -> Snapshot {
    let mut nodes = Vec::new();
    for i in 0..p {
        nodes.push(node(u64::from(i), Role::Prefill));
    }
    for i in 0..d {
        nodes.push(node(u64::from(p + i), Role::Decode));
    }
    Snapshot { now, nodes }
}

fn feed(p: &mut Planner, rate: f64, seconds: u64) {
    let mut acc = 0.0;
    for s in 0..seconds {
        acc += rate;
        while acc >= 1.0 {
            acc -= 1.0;
            p.on_arrival(Arrival { at: Duration::from_secs(s), prompt_tokens: 300, max_tokens: 150 });
        }
    }
}

/// The search over counts (binary search per decode count) picks what checking every split
/// picks: the fewest nodes whose predictions meet target x scale_up_margin, most slack first.
#[test]
fn the_search_agrees_with_brute_force_over_every_split() {
    let n = 40u32;
    let l = Limits { max_prefill: n, max_decode: n, max_colocated: 0, max_nodes: n, ..common::limits(n, n, 0, n) };
    let cfg = PlannerConfig {
        mode: Mode::Auto,
        confirm_ticks: 1,
        can_add_nodes: true,
        ..common::config(Mode::Auto, 2000.0, 90.0, l, true)
    };
    let (ttft_s, tpot_s) = (2.0, 0.090);
    let rate = 12.0;
    let now = Duration::from_secs(40);
    let mut p = Planner::new(cfg.clone(), Box::new(cpu_costs())).unwrap();
    feed(&mut p, rate, 40);
    let d = p.tick(&cluster(1, 1, now)).expect("1p1d cannot carry 12 req/s");

    let mut best: Option<(u32, f64, u32, u32)> = None;
    for pp in 1..n {
        for dd in 1..=(n - pp) {
            let mut shadow =
                Planner::new(PlannerConfig { mode: Mode::Off, ..cfg.clone() }, Box::new(cpu_costs())).unwrap();
            feed(&mut shadow, rate, 40);
            let e = shadow.estimate(&cluster(pp, dd, now));
            let (Some(t), Some(o)) = (e.predicted.ttft_ms, e.predicted.tpot_ms) else { continue };
            let r = (t / 1e3 / ttft_s).max(o / 1e3 / tpot_s);
            if r > 0.9 {
                continue;
            }
            let key = (pp + dd, r);
            if best.is_none_or(|b| key.0 < b.0 || (key.0 == b.0 && key.1 < b.1)) {
                best = Some((key.0, key.1, pp, dd));
            }
        }
    }
    let (nodes, _, bp, bd) = best.expect("some split meets the targets");
    assert_eq!((d.target.prefill, d.target.decode), (bp, bd), "{} (brute force: {nodes} nodes)", d.why);
    assert!(nodes > 2);
}

/// (8) A 400-node cluster: one tick plans (the enumeration is over counts; its cost is
/// checked in the search's unit test) and the target is sane.
#[test]
fn a_400_node_cluster_plans_in_one_tick() {
    let cfg = PlannerConfig {
        confirm_ticks: 1,
        ..common::config(Mode::Auto, 3000.0, 150.0, common::limits(400, 400, 400, 400), true)
    };
    let mut p = Planner::new(cfg, Box::new(cpu_costs())).unwrap();
    feed(&mut p, 300.0, 40);
    let d = p.tick(&cluster(100, 300, Duration::from_secs(40))).expect("100p300d cannot carry this demand");
    let rate = d.inputs.arrival_rate;
    assert!((rate - 290.0).abs() < 1e-9, "{rate}"); // 29 s of arrivals in the 30 s window
    assert!(d.target.nodes() <= 400);
    assert!(matches!(d.reason, cleave_planner::Reason::TtftRisk), "{}", d.why);
    // 290 req/s x 0.61 s of prefill: 177 nodes busy; planned within the margin.
    let busy = rate * cpu_costs().prefill_time(300) / f64::from(d.target.prefill);
    assert!(busy <= 0.9, "prefill {} nodes {busy} busy", d.target.prefill);
    assert!(d.predicted.target.ttft_ms.is_some_and(|t| t <= 0.9 * 3000.0), "{:?}", d.predicted);
    assert!(d.predicted.target.tpot_ms.is_some_and(|t| t <= 0.9 * 150.0), "{:?}", d.predicted);
    let switches = d.actions.iter().filter(|a| matches!(a, Action::SwitchRole { .. })).count() as u32;
    assert_eq!(switches, d.target.prefill - 100, "prefill grows by switching decode nodes");
    let _ =
        Completion { at: Duration::ZERO, ttft: Duration::ZERO, tpot: None, output_tokens: 1, max_tokens: 1, ok: true };
}
