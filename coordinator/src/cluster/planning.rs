//! The planner's shell: one actor task that owns the sans-IO [`cleave_planner::Planner`], feeds
//! it what the edge and the request tasks observe (arrivals as they come in, what each client
//! experienced) and what the registry knows (every node's role, state and load), ticks it, and
//! in auto mode hands its actions to the [`Actuator`].
//!
//! It also keeps the latency clients saw per pool over the planner's window, for
//! `GET /admin/pools`: a remote request's TTFT counts for the prefill pool and its TPOT for the
//! decode pool; a request prefilled on its decode node counts for the decode pool (both), a
//! colocated node's for the colocated pool.
//!
//! Time: the planner's clock is `Instant - start` of this task, passed in at every call.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use cleave_planner::{
    Arrival, Completion, LinearCosts, Mode, NodeObs, NodeState as PlanState, Planner, PlannerConfig, PlannerUpdate,
    Role, Snapshot, StepStats,
};
use cleave_protocol::control::{NodeRole, StepTotals};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::actuate::Actuator;
use super::history::History;
use super::registry::{Admission, AfterDrain, Lifecycle, NodeState};
use super::{ClusterHandle, Observation};

/// Requests of the admin API to the planner actor.
enum Cmd {
    Config(oneshot::Sender<PlannerConfig>),
    Update(Box<PlannerUpdate>, oneshot::Sender<Result<PlannerConfig, String>>),
    Decisions(oneshot::Sender<Value>),
    Status(oneshot::Sender<Value>),
    PoolLatency(oneshot::Sender<HashMap<String, Value>>),
    History(oneshot::Sender<Value>),
}

/// Cheap, cloneable access to the planner actor.
#[derive(Clone)]
pub struct PlannerHandle {
    tx: mpsc::Sender<Cmd>,
}

impl PlannerHandle {
    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).await.ok()?;
        rx.await.ok()
    }

    pub async fn config(&self) -> Option<PlannerConfig> {
        self.call(Cmd::Config).await
    }

    /// Applies a partial update; the new settings, or why they were refused.
    pub async fn update(&self, u: PlannerUpdate) -> Option<Result<PlannerConfig, String>> {
        self.call(|tx| Cmd::Update(Box::new(u), tx)).await
    }

    pub async fn decisions(&self) -> Option<Value> {
        self.call(Cmd::Decisions).await
    }

    /// Settings, the window's statistics and the predictions for the current configuration.
    pub async fn status(&self) -> Option<Value> {
        self.call(Cmd::Status).await
    }

    /// The dashboard's samples, oldest first (see [`super::history`]).
    pub async fn history(&self) -> Option<Value> {
        self.call(Cmd::History).await
    }

    /// Latency clients saw per pool (`prefill`, `decode`, `colocated`, `overall`).
    pub async fn pool_latency(&self) -> Option<HashMap<String, Value>> {
        self.call(Cmd::PoolLatency).await
    }
}

/// How often the planner looks.
pub const TICK: Duration = Duration::from_secs(1);

/// Starts the planner actor. `observations` come from the router and the request tasks.
pub(super) fn spawn(
    cfg: PlannerConfig,
    profile: Option<&cleave_planner::Profile>,
    pacing: bool,
    admission: bool,
    cluster: ClusterHandle,
    observations: mpsc::Receiver<Observation>,
    actuator: Box<dyn Actuator>,
) -> Result<(PlannerHandle, tokio::task::JoinHandle<()>), cleave_planner::PlannerError> {
    let mut cfg = cfg;
    cfg.can_add_nodes = actuator.can_add_nodes();
    let costs: Box<dyn cleave_planner::StepCosts> = match profile {
        Some(p) => Box::new(cleave_planner::CostModel::from_profile(p, cleave_planner::HandoffCost::default())?),
        None => Box::new(LinearCosts::default()),
    };
    let planner = Planner::new(cfg, costs)?;
    let (tx, rx) = mpsc::channel(64);
    let actor = Actor {
        planner,
        cluster,
        actuator,
        latency: LatencyWindow::default(),
        history: History::default(),
        decided: false,
        totals: HashMap::new(),
        bridge: None,
        pace: pacing,
        pacing: None,
        admit: admission,
        admission: None,
    };
    let task = tokio::spawn(run(actor, observations, rx));
    Ok((PlannerHandle { tx }, task))
}

struct Actor {
    /// Its cost model is calibrated from the nodes' step timings as they come in.
    planner: Planner,
    cluster: ClusterHandle,
    actuator: Box<dyn Actuator>,
    latency: LatencyWindow,
    history: History,
    /// The planner has made a decision (its target gauges say the decision's target since).
    decided: bool,
    /// Each node's last step totals (their differences calibrate the costs).
    totals: HashMap<u64, StepTotals>,
    /// The saturation line last sent to the registry.
    bridge: Option<u64>,
    /// Nodes are told to pace to the TPOT target (`--pacing`).
    pace: bool,
    /// The pacing targets last sent to the registry.
    pacing: Option<super::Pacing>,
    /// SLO admission is on (`--slo-admission`), and the settings last sent to the registry.
    admit: bool,
    admission: Option<Admission>,
}

async fn run(mut a: Actor, mut observations: mpsc::Receiver<Observation>, mut cmds: mpsc::Receiver<Cmd>) {
    let start = Instant::now();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            o = observations.recv() => {
                let Some(o) = o else { return };
                let now = start.elapsed();
                a.observe(o, now);
            }
            c = cmds.recv() => {
                let Some(c) = c else { return };
                let now = start.elapsed();
                a.command(c, now).await;
            }
            _ = tick.tick() => {
                let Some(states) = a.cluster.node_states().await else { return };
                a.tick(&states, start.elapsed());
                a.bridge().await;
                a.pacing().await;
                a.admission().await;
            }
        }
    }
}

impl Actor {
    fn observe(&mut self, o: Observation, now: Duration) {
        match o {
            Observation::Arrival { prompt_tokens, max_tokens } => {
                self.planner.on_arrival(Arrival { at: now, prompt_tokens, max_tokens });
            }
            Observation::Completion { ttft, tpot, output_tokens, max_tokens, ok, path } => {
                self.latency.push(now, path, ttft, tpot, ok);
                self.history.on_completion(path);
                self.planner.on_completion(Completion { at: now, ttft, tpot, output_tokens, max_tokens, ok });
            }
            Observation::Handoff { bytes, tail } => self.history.on_handoff(bytes, tail),
        }
    }

    async fn command(&mut self, c: Cmd, now: Duration) {
        match c {
            Cmd::Config(reply) => {
                let _ = reply.send(self.planner.config().clone());
            }
            Cmd::Update(mut u, reply) => {
                // Whether nodes can be added is the actuator's to say, not a setting.
                u.can_add_nodes = None;
                let r = self.planner.update(&u).map(|()| self.planner.config().clone()).map_err(|e| e.to_string());
                if r.is_ok() {
                    tracing::info!(update = ?serde_json::to_value(&*u).ok(), "planner settings changed");
                }
                let _ = reply.send(r);
            }
            Cmd::Decisions(reply) => {
                let d: Vec<_> = self.planner.decisions().cloned().collect();
                let _ = reply.send(serde_json::to_value(d).unwrap_or(Value::Null));
            }
            Cmd::Status(reply) => {
                let states = self.cluster.node_states().await.unwrap_or_default();
                let snap = snapshot(&states, now);
                let est = self.planner.estimate(&snap);
                let _ = reply.send(json!({
                    "config": self.planner.config(),
                    "actuator": self.actuator.name(),
                    "estimate": est,
                }));
            }
            Cmd::History(reply) => {
                let samples: Vec<_> = self.history.samples().collect();
                let _ = reply.send(serde_json::to_value(samples).unwrap_or(Value::Null));
            }
            Cmd::PoolLatency(reply) => {
                let c = self.planner.config();
                let _ = reply.send(self.latency.summary(now, c.window, c.targets.ttft_ms, c.targets.tpot_ms));
            }
        }
    }

    fn tick(&mut self, states: &[NodeState], now: Duration) {
        self.calibrate(states, now);
        let snap = snapshot(states, now);
        let est = self.planner.estimate(&snap);
        if let Some(a) = est.inputs.attainment {
            metrics::gauge!(super::metric::PLANNER_SLO_ATTAINMENT).set(a);
        }
        if let Some(a) = est.predicted.attainment {
            metrics::gauge!(super::metric::PLANNER_PREDICTED_SLO_ATTAINMENT).set(a);
        }
        let t = &self.planner.config().targets;
        metrics::gauge!(super::metric::PLANNER_TARGET_SECONDS, "slo" => "ttft").set(t.ttft_ms / 1e3);
        metrics::gauge!(super::metric::PLANNER_TARGET_SECONDS, "slo" => "tpot").set(t.tpot_ms / 1e3);
        let (window, ttft_ms, tpot_ms) = (self.planner.config().window, t.ttft_ms, t.tpot_ms);
        let latency = self.latency.summary(now, window, ttft_ms, tpot_ms);
        for (pool, s) in &latency {
            if let Some(a) = s["slo_attainment"].as_f64() {
                metrics::gauge!(super::metric::POOL_SLO_ATTAINMENT, "pool" => pool.clone()).set(a);
            }
        }
        if self.history.due(now) {
            self.history.sample(now, states, &latency);
        }
        // What the planner sets (auto) or would set (advise, off) as the local-prefill line.
        let line = self.planner.saturation_tokens();
        if line != u64::MAX {
            metrics::gauge!(super::metric::PLANNER_SATURATION_TOKENS).set(line as f64);
        }
        if !self.decided {
            // No decision yet: the planner's target is what runs now.
            for (pool, role) in
                [("prefill", NodeRole::Prefill), ("decode", NodeRole::Decode), ("colocated", NodeRole::Both)]
            {
                let n = states.iter().filter(|s| s.node.role == role && s.lifecycle.as_str() == "active").count();
                metrics::gauge!(super::metric::PLANNER_DESIRED_NODES, "pool" => pool).set(n as f64);
            }
        }
        let Some(decision) = self.planner.tick(&snap) else { return };
        tracing::info!(
            reason = decision.reason.as_str(),
            why = %decision.why,
            applied = decision.applied,
            actions = decision.actions.len(),
            "planner decision"
        );
        metrics::counter!(super::metric::PLANNER_DECISIONS_TOTAL, "reason" => decision.reason.as_str()).increment(1);
        self.decided = true;
        for (pool, n) in [
            ("prefill", decision.target.prefill),
            ("decode", decision.target.decode),
            ("colocated", decision.target.colocated),
        ] {
            metrics::gauge!(super::metric::PLANNER_DESIRED_NODES, "pool" => pool).set(f64::from(n));
        }
        if !decision.applied {
            return;
        }
        for action in &decision.actions {
            if let Err(e) = self.actuator.apply(action) {
                tracing::warn!(?action, error = %e, "planner action not carried out");
            }
        }
    }

    /// In auto mode, keeps the registry's prefill saturation line at what the TTFT target
    /// allows (decode nodes prefill locally past it while capacity moves); otherwise the
    /// configured line.
    async fn bridge(&mut self) {
        let want = (self.planner.config().mode == Mode::Auto).then(|| self.planner.saturation_tokens());
        let changed = match (want, self.bridge) {
            (Some(w), Some(b)) => w.abs_diff(b) * 10 > b,
            (w, b) => w != b,
        };
        if changed {
            self.bridge = want;
            self.cluster.set_bridge(want).await;
        }
    }

    /// With `--pacing`, keeps the nodes' pacing at the TPOT target, whatever the mode: a
    /// colocated node's prompt chunks are sized to keep its running decodes within it
    /// (`cleave_engine::sched::pacing`), which is the operator's target whether or not the
    /// planner moves nodes. Colocated nodes pace to their hold instead
    /// ([`Planner::colocated_tpot_ms`]: `targets.colocated_tpot_ms`, at most the target).
    async fn pacing(&mut self) {
        if !self.pace {
            return;
        }
        let us = |ms: f64| (ms.is_finite() && ms > 0.0).then(|| (ms * 1e3).round().min(f64::from(u32::MAX)) as u32);
        // `colocated_tpot_ms` is at most the target (`Targets::colocated_ms`).
        let want = us(self.planner.config().targets.tpot_ms).map(|tpot_us| super::Pacing {
            tpot_us,
            colocated_us: us(self.planner.colocated_tpot_ms()).unwrap_or(tpot_us),
        });
        if want != self.pacing && want.is_some() {
            self.pacing = want;
            self.cluster.set_pacing(want).await;
        }
    }

    /// With `--slo-admission`, keeps the registry's seat caps on the targets, whatever the
    /// mode (they are the operator's targets whether or not the planner moves nodes); a
    /// colocated node's seats on its hold ([`Planner::colocated_tpot_ms`]).
    async fn admission(&mut self) {
        if !self.admit {
            return;
        }
        let t = &self.planner.config().targets;
        let hold = Duration::try_from_secs_f64(self.planner.colocated_tpot_ms() / 1e3).ok();
        let a = Admission::from_target_ms(t.ttft_ms, t.tpot_ms);
        let want = Some(match hold {
            Some(h) => a.holding_colocated(h),
            None => a,
        });
        if want != self.admission {
            self.admission = want;
            self.cluster.set_admission(want).await;
        }
    }

    /// Folds the nodes' step timings since the last tick into the cost model.
    fn calibrate(&mut self, states: &[NodeState], now: Duration) {
        let mut s = StepStats::default();
        for n in states {
            let t = n.load.steps;
            let prev = self.totals.insert(n.node.id, t).unwrap_or(t);
            let d = |a: u64, b: u64| a.saturating_sub(b);
            s.prefill_tokens += d(t.prefill_tokens, prev.prefill_tokens);
            s.prefill_seconds += d(t.prefill_us, prev.prefill_us) as f64 / 1e6;
            s.decode_steps += d(t.decode_steps, prev.decode_steps);
            s.decode_seqs += d(t.decode_seqs, prev.decode_seqs);
            s.decode_context_tokens += d(t.decode_context, prev.decode_context);
            s.decode_seconds += d(t.decode_us, prev.decode_us) as f64 / 1e6;
        }
        self.totals.retain(|id, _| states.iter().any(|n| n.node.id == *id));
        self.planner.calibrate(now, &s);
    }
}

fn role(r: NodeRole) -> Role {
    match r {
        NodeRole::Prefill => Role::Prefill,
        NodeRole::Decode => Role::Decode,
        NodeRole::Both => Role::Both,
    }
}

/// What the planner sees of the nodes: parked and leaving nodes are not capacity. Queues and
/// running sequences are counted as routing counts them ([`NodeState::queued_prefill`],
/// [`NodeState::routed_seqs`]): a report snapshotted before a prompt or a stream reached its
/// node would otherwise show a node just given work as idle.
pub(super) fn snapshot(states: &[NodeState], now: Duration) -> Snapshot {
    let nodes = states
        .iter()
        .filter_map(|n| {
            let state = match n.lifecycle {
                Lifecycle::Active => PlanState::Active,
                Lifecycle::Draining { then: AfterDrain::Role { role: to, .. }, .. } => {
                    PlanState::Switching { to: role(to) }
                }
                Lifecycle::Draining { .. } => PlanState::Draining,
                Lifecycle::Drained | Lifecycle::Leaving => return None,
            };
            let l = &n.load;
            let used = l.total_blocks.saturating_sub(l.free_blocks + l.cached_blocks);
            Some(NodeObs {
                id: n.node.id,
                role: role(n.node.role),
                state,
                queued_prefill_tokens: n.queued_prefill,
                waiting_seqs: l.waiting_seqs,
                running_seqs: n.routed_seqs.saturating_sub(l.waiting_seqs).max(l.running_seqs),
                kv_used_ratio: if l.total_blocks == 0 { 0.0 } else { f64::from(used) / f64::from(l.total_blocks) },
                step_budget: n.step_budget,
                paced: l.tpot_target_us.is_some(),
            })
        })
        .collect();
    Snapshot { now, nodes }
}

/// Completions in the window, by the path that served them.
#[derive(Default)]
struct LatencyWindow {
    entries: VecDeque<Entry>,
}

struct Entry {
    at: Duration,
    path: &'static str,
    ttft_ms: f64,
    tpot_ms: Option<f64>,
    ok: bool,
}

/// Which of a path's latencies count for a pool: (TTFT, TPOT).
type PathPick = fn(&str) -> (bool, bool);

/// Most completions kept (the window's time bound usually comes first).
const MAX_ENTRIES: usize = 100_000;

impl LatencyWindow {
    fn push(&mut self, at: Duration, path: &'static str, ttft: Duration, tpot: Option<Duration>, ok: bool) {
        if self.entries.len() == MAX_ENTRIES {
            self.entries.pop_front();
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.entries.push_back(Entry { at, path, ttft_ms: ms(ttft), tpot_ms: tpot.map(ms), ok });
    }

    fn summary(
        &mut self,
        now: Duration,
        window: Duration,
        ttft_target: f64,
        tpot_target: f64,
    ) -> HashMap<String, Value> {
        while self.entries.front().is_some_and(|e| now.saturating_sub(e.at) > window) {
            self.entries.pop_front();
        }
        let pools: [(&str, PathPick); 4] = [
            // (counts for TTFT, counts for TPOT)
            ("prefill", |p| (p == "remote", false)),
            ("decode", |p| (p != "remote" && p != "colocated", p != "colocated")),
            ("colocated", |p| (p == "colocated", p == "colocated")),
            ("overall", |_| (true, true)),
        ];
        let mut out = HashMap::new();
        for (pool, pick) in pools {
            let mut ttft: Vec<f64> = Vec::new();
            let mut tpot: Vec<f64> = Vec::new();
            let (mut n, mut met) = (0usize, 0usize);
            for e in &self.entries {
                let (t1, t2) = pick(e.path);
                if !(t1 || t2) {
                    continue;
                }
                n += 1;
                if t1 {
                    ttft.push(e.ttft_ms);
                }
                if let (true, Some(t)) = (t2, e.tpot_ms) {
                    tpot.push(t);
                }
                let ok_ttft = !t1 || e.ttft_ms <= ttft_target;
                let ok_tpot = !t2 || e.tpot_ms.is_none_or(|t| t <= tpot_target);
                if e.ok && ok_ttft && ok_tpot {
                    met += 1;
                }
            }
            out.insert(
                pool.to_string(),
                json!({
                    "requests": n,
                    "ttft_ms": { "p50": quantile(&mut ttft, 0.5), "p90": quantile(&mut ttft, 0.9) },
                    "tpot_ms": { "p50": quantile(&mut tpot, 0.5), "p90": quantile(&mut tpot, 0.9) },
                    "slo_attainment": if n == 0 { None } else { Some(met as f64 / n as f64) },
                    "window_s": window.as_secs_f64(),
                }),
            );
        }
        out
    }
}

/// Nearest-rank quantile; None when empty.
fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i])
}
