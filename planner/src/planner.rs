//! The planner state machine: observations and time in ([`Planner::on_arrival`],
//! [`Planner::on_completion`], [`Planner::tick`]), decisions out. No clock, no I/O, no
//! randomness: the same inputs give the same decisions, which is what lets `cleave bench
//! simulate` run this very code.
//!
//! State kept between ticks, and why:
//! - the arrival and completion windows (demand and what clients experienced);
//! - the correction factors and the raw predictions made for the current configuration since
//!   it began (what observations are compared with);
//! - `pending` (a new target and how many ticks in a row wanted it: `confirm_ticks`),
//!   `last_change` (cooldown) and `last_target` (a target already decided is not decided
//!   again while it stays wanted: in advise mode nobody applies it);
//! - the bounded decision log.

use std::collections::VecDeque;
use std::time::Duration;

use crate::cluster::{plan_actions, ClusterView};
use crate::config::{Mode, PlannerConfig, PlannerUpdate};
use crate::costs::{StepCosts, StepStats};
use crate::error::PlannerError;
use crate::model::{Factors, Family, FamilyFactors, Load, Model, Raw};
use crate::search::{Candidate, Move, MoveKind, Policy, Search, SearchInput, ATTAIN_GAIN};
use crate::types::{Arrival, Completion, Decision, Estimate, Inputs, PoolTarget, Prediction, Reason, Snapshot};
use crate::window::{shifted, ArrivalWindow, CompletionStats, CompletionWindow};

/// Decisions kept in the log.
pub const DECISION_LOG: usize = 512;
/// Successful completions served under the current configuration before observations correct
/// the model.
pub const MIN_CORRECTION_SAMPLES: u32 = 10;
/// Successful completions before output lengths are taken from observation.
pub const MIN_OUTPUT_SAMPLES: u32 = 10;
/// Step timings the cost model is calibrated to: those of the nodes over this long.
pub const CALIBRATION_WINDOW: Duration = Duration::from_secs(60);
/// Share of the window's predictions for the current configuration that must be bounded (not
/// overloaded) for the correction factors to learn (see [`Planner::update_correction`]).
pub const MIN_FINITE_SHARE: f64 = 0.75;
/// Bounds of the observed/predicted correction factors.
pub const CORRECTION_RANGE: (f64, f64) = (0.5, 4.0);

/// Demand means that outlive an empty window (so that a quiet window still predicts what one
/// request would see).
#[derive(Debug, Clone, Copy, Default)]
struct Means {
    prompt: f64,
    prompt_sd: f64,
    max_tokens: f64,
}

/// Everything one tick (or estimate) derives from the windows and a snapshot.
struct Assessment {
    view: ClusterView,
    /// The current configuration with its step budget normalized.
    current: PoolTarget,
    load: Load,
    stats: CompletionStats,
    inputs: Inputs,
    means: Means,
    /// Every node paces its prompt chunks to the TPOT target (as nodes do unless started with
    /// `--no-pacing`): colocated configurations are predicted paced.
    paced: bool,
}

/// The SLO planner. See the crate docs for the model and the policy.
pub struct Planner {
    cfg: PlannerConfig,
    costs: Box<dyn StepCosts>,
    arrivals: ArrivalWindow,
    completions: CompletionWindow,
    first_seen: Option<Duration>,
    means: Means,
    factors: FamilyFactors,
    /// When each family's factors last moved (indexed by `Family as usize`).
    factors_at: [Option<Duration>; 2],
    /// (tick time, raw TTFT s, raw TPOT s, TPOT floor s) predicted for the current configuration
    /// (infinite where the model called it overloaded).
    history: VecDeque<(Duration, f64, f64, f64)>,
    /// What clients experienced under recent configurations: the worst ratio to target of each,
    /// judged once enough requests were served under it, and when (see [`Planner::tick`]).
    experienced: Vec<Experience>,
    config_since: Duration,
    last_current: Option<PoolTarget>,
    pending: Option<(PoolTarget, u32)>,
    /// Since when every tick has wanted to scale down (reset by any tick that does not).
    down_since: Option<Duration>,
    last_change: Option<Duration>,
    last_target: Option<PoolTarget>,
    log: VecDeque<Decision>,
    /// Nodes' step timings by when they were filed (the last [`CALIBRATION_WINDOW`]).
    step_parts: VecDeque<(Duration, StepStats)>,
}

impl std::fmt::Debug for Planner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planner")
            .field("cfg", &self.cfg)
            .field("factors", &self.factors)
            .field("pending", &self.pending)
            .field("last_target", &self.last_target)
            .field("decisions", &self.log.len())
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn probe(probe: &'static str, value: f64) -> Result<(), PlannerError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(PlannerError::InvalidCosts { probe, value })
    }
}

impl Planner {
    /// The TPOT colocated nodes pace their prompt chunks to (seconds: their hold), when the nodes
    /// say they pace (the coordinator sends its target to every node; a node started with
    /// `--no-pacing` ignores it).
    fn paced_s(&self, a: &Assessment) -> Option<f64> {
        a.paced.then(|| self.colocated_tpot_ms() / 1e3)
    }

    /// The TPOT (ms) colocated nodes are held to, in every mode (like the target, it is the
    /// operator's): [`crate::Targets::colocated_tpot_ms`], at most the TPOT target. Prefill and
    /// decode nodes are held to the target.
    pub fn colocated_tpot_ms(&self) -> f64 {
        self.cfg.targets.colocated_ms()
    }

    /// A planner with validated settings and a usable cost model.
    pub fn new(cfg: PlannerConfig, costs: Box<dyn StepCosts>) -> Result<Self, PlannerError> {
        cfg.validate()?;
        probe("prefill_time(1)", costs.prefill_time(1))?;
        probe("decode_step_time(1, 1)", costs.decode_step_time(1, 1))?;
        probe("mixed_step_time(1, 1, 1)", costs.mixed_step_time(1, 1, 1))?;
        probe("kv_capacity_tokens()", costs.kv_capacity_tokens() as f64)?;
        let completions = CompletionWindow::new(cfg.targets.ttft_ms / 1e3, cfg.targets.tpot_ms / 1e3);
        Ok(Self {
            cfg,
            costs,
            arrivals: ArrivalWindow::default(),
            completions,
            first_seen: None,
            means: Means::default(),
            factors: FamilyFactors::default(),
            factors_at: [None; 2],
            history: VecDeque::new(),
            experienced: Vec::new(),
            config_since: Duration::ZERO,
            last_current: None,
            pending: None,
            down_since: None,
            last_change: None,
            last_target: None,
            log: VecDeque::new(),
            step_parts: VecDeque::new(),
        })
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// The cost model as calibrated so far.
    pub fn costs(&self) -> &dyn StepCosts {
        &*self.costs
    }

    /// Applies a partial update (validated as a whole; on error nothing changes). A pending
    /// target is dropped: it was wanted under the old settings.
    pub fn update(&mut self, u: &PlannerUpdate) -> Result<(), PlannerError> {
        self.cfg.apply(u)?;
        let t = &self.cfg.targets;
        self.completions.configure(self.config_since, t.ttft_ms / 1e3, t.tpot_ms / 1e3);
        self.pending = None;
        self.last_target = None;
        Ok(())
    }

    /// Files nodes' step timings measured up to `now` (the part since the last call) and
    /// re-scales the cost model to their sum over the last [`CALIBRATION_WINDOW`] (see
    /// [`StepCosts::calibrate`]).
    ///
    /// Why a window and not each call's part alone: one tick holds one or two steps, and a
    /// single slow one (a node's first prefill, with its weights still paging in; a step that
    /// shared the core with the load generator) would set the model alone until the next.
    pub fn calibrate(&mut self, now: Duration, part: &StepStats) {
        if *part != StepStats::default() {
            self.step_parts.push_back((now, *part));
        }
        while self.step_parts.front().is_some_and(|(at, _)| now.saturating_sub(*at) > CALIBRATION_WINDOW) {
            self.step_parts.pop_front();
        }
        let sum = self.step_parts.iter().fold(StepStats::default(), |a, (_, p)| a.plus(p));
        if sum != StepStats::default() {
            self.costs.calibrate(&sum);
        }
    }

    /// Prompt tokens a prefill node may have queued and still start a new prompt within the
    /// TTFT target: its prefill rate (at the mean prompt seen) times what the target leaves
    /// after one prompt's own prefill, at least one mean prompt. The coordinator uses it as the
    /// line past which a prefill node counts as saturated and decode nodes prefill locally: the
    /// bridge that holds TTFT while capacity moves between the pools.
    pub fn saturation_tokens(&self) -> u64 {
        let p = if self.means.prompt > 0.0 { self.means.prompt } else { 512.0 };
        let t = self.costs.prefill_time(p.round().max(1.0) as usize);
        if !(t.is_finite() && t > 0.0) {
            return u64::MAX;
        }
        let budget = self.cfg.targets.ttft_ms / 1e3 - t;
        ((p / t) * budget).max(p).round() as u64
    }

    /// A request arrived at the edge.
    pub fn on_arrival(&mut self, a: Arrival) {
        self.see(a.at);
        self.arrivals.push(a);
        self.arrivals.prune(a.at.checked_sub(self.cfg.window));
    }

    /// A request ended.
    pub fn on_completion(&mut self, c: Completion) {
        self.completions.push(c);
        self.completions.prune(c.at.checked_sub(self.cfg.window));
    }

    fn see(&mut self, at: Duration) {
        self.first_seen = Some(self.first_seen.map_or(at, |f| f.min(at)));
    }

    /// The last decisions, oldest first (at most [`DECISION_LOG`]).
    pub fn decisions(&self) -> impl Iterator<Item = &Decision> {
        self.log.iter()
    }

    /// Window statistics and the predictions for the current configuration, in every mode.
    pub fn estimate(&self, snap: &Snapshot) -> Estimate {
        let a = self.assess(snap);
        let model = Model::new(&*self.costs, a.load, self.cfg.targets.quantile, self.cfg.limits.largest_step_budget())
            .paced(self.paced_s(&a));
        let raw = model.predict(&a.current);
        let f = self.live_factors(snap.now).of(&a.current);
        Estimate {
            at_ms: ms(snap.now),
            mode: self.cfg.mode,
            current: a.view.current,
            live_nodes: a.view.live,
            inputs: a.inputs,
            predicted: raw.to_prediction(f).with_attainment(Some(model.attainment(
                &a.current,
                f,
                self.cfg.targets.ttft_ms / 1e3,
                self.cfg.targets.tpot_ms / 1e3,
            ))),
            ttft_correction: f.ttft,
            tpot_correction: f.tpot,
        }
    }

    fn assess(&self, snap: &Snapshot) -> Assessment {
        let now = snap.now;
        let cfg = &self.cfg;
        let cutoff = now.checked_sub(cfg.window);
        let view = ClusterView::new(snap);
        let current = view.normalized(cfg.limits.largest_step_budget());
        let t = &cfg.targets;
        let stats = self.completions.stats(cutoff, t.quantile);
        // Demand over the window, or over its recent half when that half differs from the
        // older one by more than noise (the mix moved, or the rate stepped up): a window that
        // straddles a shift averages two regimes and describes neither, and reacting a half
        // window sooner is most of the time to recover. Only once a whole window was observed.
        // The rate is over the window, or over the time observed so far when shorter, but
        // never over less than a third of the window: a rate from a few seconds of arrivals is
        // too noisy to act on. Right after start-up this under-reads demand (the backlog still
        // counts).
        let first = self.first_seen.map_or(now, |f| f.min(now));
        let full = self.arrivals.stats(cutoff);
        let half = cfg.window / 2;
        let recent = self.arrivals.stats(now.checked_sub(half));
        let (arr, span) = if now - first >= cfg.window && shifted(&full.without(&recent), &recent) {
            (recent, half)
        } else {
            (full, (now - first).clamp(cfg.window / 3, cfg.window))
        };
        let means = if arr.count > 0 {
            Means { prompt: arr.mean_prompt, prompt_sd: arr.sd_prompt, max_tokens: arr.mean_max_tokens }
        } else {
            self.means
        };
        // Outputs as the share of max_tokens that completions used, applied to what arrives
        // now (the completions may belong to the mix before a shift).
        let output = match (stats.output_share, stats.mean_output) {
            (Some(share), _) if stats.ok >= MIN_OUTPUT_SAMPLES && means.max_tokens > 0.0 => means.max_tokens * share,
            (_, Some(o)) if stats.ok >= MIN_OUTPUT_SAMPLES && means.max_tokens <= 0.0 => o,
            _ => means.max_tokens,
        };
        let lambda = arr.count as f64 / span.as_secs_f64();
        let load = Load {
            lambda,
            prompt: means.prompt,
            prompt_sd: means.prompt_sd,
            output,
            backlog_tokens: view.backlog_tokens as f64,
            inflight_seqs: view.inflight_seqs as f64,
            horizon_s: cfg.window.as_secs_f64(),
        };
        let inputs = Inputs {
            arrival_rate: lambda,
            mean_prompt_tokens: means.prompt,
            mean_output_tokens: output,
            demand_span_s: span.as_secs_f64(),
            queued_prefill_tokens: view.backlog_tokens,
            running_seqs: view.running_seqs,
            observed_ttft_ms: stats.ttft_q.map(|s| s * 1e3),
            observed_tpot_ms: stats.tpot_q.map(|s| s * 1e3),
            attainment: stats.attainment,
            completions: stats.count,
        };
        let paced = !snap.nodes.is_empty() && snap.nodes.iter().all(|n| n.paced);
        Assessment { view, current, load, stats, inputs, means, paced }
    }

    /// Moves the correction factors toward observed/predicted for the current configuration:
    /// observed = the quantile over successful completions that started under it, once the old
    /// configuration's queue had cleared (at least
    /// [`MIN_CORRECTION_SAMPLES`]), predicted = the mean raw prediction made for it over the
    /// same window, where at least [`MIN_FINITE_SHARE`] of those were bounded. An EWMA with
    /// time constant window / 3, ratios clamped to [`CORRECTION_RANGE`]. Factors persist
    /// across configuration changes within a family (the model's bias is a property of the
    /// formula and the workload, not of the pool sizes), and each family keeps its own
    /// ([`FamilyFactors`]); a mixed configuration corrects neither.
    fn update_correction(&mut self, now: Duration, current: &PoolTarget, stats: &CompletionStats, raw: &Raw) {
        let cutoff = now.checked_sub(self.cfg.window);
        // Predictions made while the old configuration's queue still held requests back are
        // compared with nothing (their requests are not counted either: `CompletionWindow::settle`).
        let since = self.completions.since();
        while self.history.front().is_some_and(|h| cutoff.is_some_and(|c| h.0 <= c) || h.0 < since) {
            self.history.pop_front();
        }
        // Nor are those made before a whole window of demand was seen: a rate read over the
        // first seconds is a handful of arrivals (5 in 6.7 s read as 0.75 req/s where the load
        // ran at 0.6), its queueing predictions run to many seconds, and a factor learnt from
        // them sat at 0.58 for a minute afterwards, making one prefill node look fit for a load
        // that kept its p90 TTFT at 5 s.
        if self.warm(now) {
            self.history.push_back((now, raw.ttft, raw.tpot, raw.tpot_floor));
        }
        // Only where the model could say what the window's clients would see: if it called the
        // configuration overloaded for more than a share of the window, the clients lived
        // through what it has no figure for, and comparing them with the figures of the calmer
        // readings alone learnt the overload as a bias (a colocated TTFT factor of 2-3.5 from a
        // decode-heavy phase past capacity, where admission's seat waits are part of TTFT, then
        // predicted 7 s for the next phase's prompts and sent the cluster back to a split).
        let finite = || self.history.iter().filter(|h| h.1.is_finite() && h.2.is_finite());
        let n = finite().count();
        if n == 0 || (n as f64) < MIN_FINITE_SHARE * self.history.len() as f64 {
            return;
        }
        let n = n as f64;
        let pred_ttft = finite().map(|h| h.1).sum::<f64>() / n;
        let pred_tpot = finite().map(|h| h.2).sum::<f64>() / n;
        let floor = finite().map(|h| h.3).sum::<f64>() / n;
        let Some(family) = Family::of(current) else { return };
        let slot = family as usize;
        let window = self.cfg.window.as_secs_f64();
        let tau = window / 3.0;
        let (lo, hi) = CORRECTION_RANGE;
        let factors = self.factors.get_mut(family);
        if self.factors_at[slot].is_some_and(|at| now.saturating_sub(at) > self.cfg.window * EXPERIENCE_WINDOWS) {
            // What clients showed long ago says little now: start again from the model.
            self.factors_at[slot] = None;
            *factors = Factors::default();
        }
        let dt = self.factors_at[slot].map_or(tau, |t| now.saturating_sub(t).as_secs_f64()).min(window);
        let alpha = 1.0 - (-dt / tau).exp();
        let mut moved = false;
        if let (true, Some(obs)) = (stats.since_count >= MIN_CORRECTION_SAMPLES, stats.since_ttft_q) {
            let r = (obs / pred_ttft).clamp(lo, hi);
            factors.ttft += alpha * (r - factors.ttft);
            moved = true;
        }
        if let (true, Some(obs)) = (stats.since_tpot_count >= MIN_CORRECTION_SAMPLES, stats.since_tpot_q) {
            // Of what the prediction adds above the lone step (see `Raw::tpot_floor`); a
            // prediction at the floor still learns, against a tenth of the floor.
            let r = ((obs - floor) / (pred_tpot - floor).max(0.1 * floor)).clamp(lo, hi);
            factors.tpot += alpha * (r - factors.tpot);
            moved = true;
        }
        if moved {
            self.factors_at[slot] = Some(now);
        }
    }

    /// The correction factors predictions use at `now`: each family's own while clients
    /// corrected it within [`EXPERIENCE_WINDOWS`] windows. A family without such a correction
    /// (never run, or left long ago under another workload) is predicted with the current
    /// family's TTFT factor where that is above 1, else uncorrected: a model nobody checked is
    /// assumed no less wrong than the one clients are checking, so that the current family's
    /// errors never make the other look better than it is (the grass is not greener for
    /// being unobserved), and no better than the model says (a colocated factor at its 0.5
    /// floor from a start-up storm made colocation look twice as good hours later, and
    /// colocated pessimism carried over to a 1p1d split made it look better than it ran).
    fn live_factors(&self, now: Duration) -> FamilyFactors {
        let horizon = self.cfg.window * EXPERIENCE_WINDOWS;
        let fresh = |f: Family| self.factors_at[f as usize].is_some_and(|at| now.saturating_sub(at) <= horizon);
        let seen = self
            .last_current
            .and_then(|c| Family::of(&c))
            .filter(|f| fresh(*f))
            .map_or(Factors::default(), |f| self.factors.get(f));
        // TTFT only: the two families' TPOT formulas differ in kind (a decode-only step against
        // a paced mixed step), and a factor learnt on one's few milliseconds above the lone step
        // scaled the other's seventy: a 1p1d's TPOT factor of 4 (22 ms seen against 17 predicted
        // over a 16-ms step) predicted paced colocated nodes at 300 ms a token, and kept a 1p1d
        // that clients saw at 67-75% for a minute (BENCHMARKS.md, "Paced, every SLO").
        let prior = Factors { ttft: seen.ttft.max(1.0), tpot: 1.0 };
        let mut out = self.factors;
        for f in Family::ALL.into_iter().filter(|f| !fresh(*f)) {
            *out.get_mut(f) = prior;
        }
        out
    }

    /// One planning step. `None` when mode is off or no new target is decided.
    pub fn tick(&mut self, snap: &Snapshot) -> Option<Decision> {
        let now = snap.now;
        let cutoff = now.checked_sub(self.cfg.window);
        self.arrivals.prune(cutoff);
        self.completions.prune(cutoff);
        if self.cfg.mode == Mode::Off {
            return None;
        }
        self.see(now);
        self.completions.settle();
        let mut a = self.assess(snap);
        self.means = a.means;
        if self.last_current != Some(a.current) {
            self.last_current = Some(a.current);
            self.config_since = now;
            self.history.clear();
            let t = &self.cfg.targets;
            self.completions.configure(now, t.ttft_ms / 1e3, t.tpot_ms / 1e3);
            a.stats = self.completions.stats(cutoff, t.quantile);
        }
        let cfg = self.cfg.clone();
        let t = &cfg.targets;
        let largest = cfg.limits.largest_step_budget();
        let raw_current =
            Model::new(&*self.costs, a.load, t.quantile, largest).paced(self.paced_s(&a)).predict(&a.current);
        self.update_correction(now, &a.current, &a.stats, &raw_current);
        let model = Model::new(&*self.costs, a.load, t.quantile, largest).paced(self.paced_s(&a));

        let mut search = Search::new(&model, search_input(&cfg, &a, self.live_factors(now)));
        let current = search.evaluate(&a.current);
        let warm = self.warm(now);
        let clients_ok = a.stats.attainment.is_none_or(|x| a.stats.count < MIN_CORRECTION_SAMPLES || x >= t.attainment);
        let policy = Policy {
            scale_up_margin: cfg.scale_up_margin,
            scale_down_margin: cfg.scale_down_margin,
            allow_fewer: warm && clients_ok,
            attainment: t.attainment,
            hedge: !cfg.can_add_nodes,
            observed: self.observed(&a, now),
        };
        let in_limits = within_limits(&a.current, &cfg);
        // Memory of experience: the current configuration's ratio, corrected by what clients
        // saw and computed with the queues it really built, is what it was like to run it. A move
        // back to a configuration left within the last two windows must beat what was seen
        // there, not only what the model predicts for it: otherwise two configurations that
        // both miss the targets trade places forever, each predicted better than the other
        // measured.
        let demand = Demand {
            means: [a.inputs.arrival_rate, a.inputs.mean_prompt_tokens, a.inputs.mean_output_tokens],
            rate_var: a.inputs.arrival_rate / a.inputs.demand_span_s.max(1e-9),
        };
        let horizon = cfg.window * EXPERIENCE_WINDOWS;
        self.experienced
            .retain(|e| now.saturating_sub(e.at) <= horizon && e.target != a.current && similar(&e.demand, &demand));
        // Judged once enough requests finished under it, or once it has run a third of a
        // window (its queues and the nodes' load are then its own, whatever the completions).
        // Attainment only matters (and is only computed) where the targets are at risk.
        let attained = (current.ratio > cfg.scale_up_margin).then(|| search.attainment(&a.current));
        if a.stats.since_count >= MIN_CORRECTION_SAMPLES || now.saturating_sub(self.config_since) >= cfg.window / 3 {
            self.experienced.push(Experience { target: a.current, at: now, ratio: current.ratio, attained, demand });
        }
        let decided = search.decide(&current, in_limits, policy);
        // Judged as the move was chosen: by predicted attainment (it must have kept more
        // there than is predicted here now), else by worst ratio.
        let seen_worse = |mv: &Move| {
            self.experienced.iter().filter(|e| e.target == mv.to.target).any(|e| match mv.attainment {
                Some([here, _]) => e.attained.is_some_and(|there| there < here + ATTAIN_GAIN),
                None => e.ratio.is_nan() || e.ratio > current.ratio * cfg.scale_up_margin,
            })
        };
        let decided = decided.filter(|mv| !matches!(mv.kind, MoveKind::Relieve | MoveKind::Hedge) || !seen_worse(mv));
        // A re-split (a relief that adds no node) waits for one window of observation: before
        // that the costs rest on a few steps (a node's first ones, with weights still paging
        // in, are the slowest it will run) and no client has corrected them, and a re-split
        // costs the streams it drains. Adding capacity does not wait.
        let decided =
            decided.filter(|mv| warm || !is_resplit_kind(mv.kind) || mv.to.target.nodes() > a.current.nodes());
        // A re-split must not rest on the rate's noise (see [`Planner::holds_across_rate_noise`]).
        let decided = decided.filter(|mv| {
            let resplit = is_resplit_kind(mv.kind)
                && mv.to.target.nodes() <= a.current.nodes()
                && changes_roles(&a.current, &mv.to.target);
            !resplit || self.holds_across_rate_noise(&a, mv, now)
        });
        let Some(mv) = decided else {
            self.pending = None;
            self.last_target = None;
            self.down_since = None;
            return None;
        };
        // Scale-down stabilization: removing capacity from a configuration that meets its
        // targets must be wanted for a whole window (on top of the rate itself being a window
        // average), so a dip in demand does not undo the last scale-up.
        let stable_down = if mv.kind == MoveKind::ScaleDown {
            let since = *self.down_since.get_or_insert(now);
            now.saturating_sub(since) >= cfg.window
        } else {
            self.down_since = None;
            true
        };
        let target = mv.to.target;
        if self.last_target == Some(target) {
            self.pending = None;
            return None;
        }
        let wanted = match self.pending {
            Some((p, n)) if p == target => n + 1,
            _ => 1,
        };
        self.pending = Some((target, wanted));
        let cooling = self.last_change.is_some_and(|t| now < t + cfg.cooldown);
        if wanted < cfg.confirm_ticks || cooling || !stable_down {
            return None;
        }
        let decision = self.decision(snap, &a, &current, &mv);
        self.pending = None;
        self.down_since = None;
        self.last_change = Some(now);
        self.last_target = Some(target);
        if self.log.len() == DECISION_LOG {
            self.log.pop_front();
        }
        self.log.push_back(decision.clone());
        Some(decision)
    }

    /// Whether a whole window of demand has been seen.
    fn warm(&self, now: Duration) -> bool {
        self.first_seen.is_some_and(|f| now.saturating_sub(f) >= self.cfg.window)
    }

    /// What clients saw of the current configuration: the window's attainment, once the whole
    /// window ran under it and enough requests finished to tell.
    fn observed(&self, a: &Assessment, now: Duration) -> Option<f64> {
        a.stats.attainment.filter(|_| {
            a.stats.count >= MIN_CORRECTION_SAMPLES && now.saturating_sub(self.config_since) >= self.cfg.window
        })
    }

    /// Whether a re-split is still no worse than staying when the arrival rate is one standard
    /// error away from its reading, on either side.
    ///
    /// Why: the rate is counted over a window of a few dozen arrivals (a 20-s window at 1 req/s
    /// holds ~20, so a Poisson count reads +-22% around the truth), and near the point where two
    /// shapes trade places that noise alone picks the winner. A re-split costs the work it
    /// drains, and the next reading picks the other shape: measured, four changes of shape
    /// in two minutes of a steady prefill-heavy phase (BENCHMARKS.md, "The planner on the
    /// quantized engine"). So a move that changes roles must win (by the measure it was chosen
    /// by: predicted attainment, else the worst ratio to target) not only at the reading but at
    /// `lambda (1 -+ RATE_NOISE_Z / sqrt(n))` too, for `n` arrivals counted; else the current
    /// shape stays. This only ever holds a move back, never makes one; adding nodes, step budget
    /// changes and moves back inside the limits are not held (they drain nothing), nor are
    /// scale-downs (they must already be wanted for a whole window). An earlier
    /// try averaged attainment over the same three rates instead, which gave a failing shape
    /// partial credit for the low reading and kept it (rejected, same chapter).
    fn holds_across_rate_noise(&self, a: &Assessment, mv: &Move, now: Duration) -> bool {
        let n = a.inputs.arrival_rate * a.inputs.demand_span_s;
        if n < 1.0 {
            return true;
        }
        let cfg = &self.cfg;
        let largest = cfg.limits.largest_step_budget();
        let factors = self.live_factors(now);
        let spread = RATE_NOISE_Z / n.sqrt();
        // The current configuration as the choice judged it (what clients saw bounds it).
        let observed = self.observed(a, now);
        [1.0 - spread, 1.0 + spread].into_iter().filter(|f| *f > 0.0).all(|f| {
            let load = Load { lambda: a.load.lambda * f, ..a.load };
            let model = Model::new(&*self.costs, load, cfg.targets.quantile, largest).paced(self.paced_s(a));
            let mut s = Search::new(&model, search_input(cfg, a, factors));
            if mv.kind == MoveKind::Hedge {
                return s.attainment(&mv.to.target) >= cfg.targets.attainment;
            }
            match mv.attainment {
                Some(_) => s.attainment(&mv.to.target) + 1e-9 >= s.judged(&a.current, observed),
                None => {
                    let (to, cur) = (s.evaluate(&mv.to.target), s.evaluate(&a.current));
                    to.ratio <= cur.ratio || !cur.ratio.is_finite()
                }
            }
        })
    }

    fn decision(&self, snap: &Snapshot, a: &Assessment, current: &Candidate, mv: &Move) -> Decision {
        let target = mv.to.target;
        let reason = reason(&a.current, current, mv, &a.inputs, &self.cfg);
        let t = &self.cfg.targets;
        let live = self.live_factors(snap.now);
        let model =
            Model::new(&*self.costs, a.load, t.quantile, self.cfg.limits.largest_step_budget()).paced(self.paced_s(a));
        let attain = |p: &PoolTarget| model.attainment(p, live.of(p), t.ttft_ms / 1e3, t.tpot_ms / 1e3);
        let (f_cur, f_to) = (live.of(&a.current), live.of(&target));
        let [cur_attain, to_attain] = mv.attainment.unwrap_or_else(|| [attain(&a.current), attain(&target)]);
        let predicted = Prediction {
            current: current.raw.to_prediction(f_cur).with_attainment(Some(cur_attain)),
            target: mv.to.raw.to_prediction(f_to).with_attainment(Some(to_attain)),
            ttft_correction: f_cur.ttft,
            tpot_correction: f_cur.tpot,
        };
        Decision {
            at_ms: ms(snap.now),
            mode: self.cfg.mode,
            current: a.view.current,
            target,
            actions: plan_actions(snap, &target, self.cfg.can_add_nodes),
            applied: self.cfg.mode == Mode::Auto,
            reason,
            why: why(reason, binding(current, &self.cfg), mv, &a.current, &predicted, &a.inputs, &self.cfg),
            inputs: a.inputs.clone(),
            predicted,
        }
    }
}

/// What a search over `a`'s cluster needs beside the model: limits, the nodes committed to each
/// pool, the node band (the live count when nodes cannot be added), the current configuration,
/// the targets and the correction factors.
fn search_input<'c>(cfg: &'c PlannerConfig, a: &Assessment, factors: FamilyFactors) -> SearchInput<'c> {
    let band = if cfg.can_add_nodes { (0, cfg.limits.max_nodes) } else { (a.view.live, a.view.live) };
    SearchInput {
        limits: &cfg.limits,
        pinned: a.view.pinned,
        band,
        current: a.current,
        ttft_target_s: cfg.targets.ttft_ms / 1e3,
        tpot_target_s: cfg.targets.tpot_ms / 1e3,
        factors,
    }
}

/// Standard errors of the counted rate a re-split must hold across
/// ([`Planner::holds_across_rate_noise`]).
pub const RATE_NOISE_Z: f64 = 1.0;

/// Whether `to` gives any node another role than `from` does (pool counts differ).
fn changes_roles(from: &PoolTarget, to: &PoolTarget) -> bool {
    (from.prefill, from.decode, from.colocated) != (to.prefill, to.decode, to.colocated)
}

/// How long (in windows) a configuration's experience counts, at most.
const EXPERIENCE_WINDOWS: u32 = 10;

/// What running a configuration was like: its worst ratio to target, its predicted
/// attainment where the targets were at risk, and the demand then.
#[derive(Debug, Clone, Copy)]
struct Experience {
    target: PoolTarget,
    at: Duration,
    ratio: f64,
    attained: Option<f64>,
    demand: Demand,
}

/// The demand a configuration ran under.
#[derive(Debug, Clone, Copy)]
struct Demand {
    /// Arrival rate, mean prompt and mean output tokens.
    means: [f64; 3],
    /// Variance of the rate reading: a Poisson count over the span, `rate / span`.
    rate_var: f64,
}

/// Demand within 25% on every mean, or for the rate within two standard errors of the two
/// readings' difference: experience under it still says something. The rate's own noise is
/// allowed for because a 20-s window of a steady 0.84 req/s reads anywhere from 0.5 to 1.35;
/// judged by 25% alone, each shape's bad experience was forgotten at the next reading, and
/// two shapes that both fail were traded back and forth every cooldown (the simulator's
/// replay of the steady run in BENCHMARKS.md: 20 role changes in 300 s).
fn similar(a: &Demand, b: &Demand) -> bool {
    let close = |x: f64, y: f64| (x - y).abs() <= 0.25 * x.abs().max(y.abs()).max(1e-9);
    let rate_close = {
        let (x, y) = (a.means[0], b.means[0]);
        close(x, y) || (x - y).abs() <= 2.0 * (a.rate_var + b.rate_var).sqrt()
    };
    rate_close && close(a.means[1], b.means[1]) && close(a.means[2], b.means[2])
}

/// Moves that may re-split the same nodes (and so wait for a window, and must hold across the
/// rate's noise).
fn is_resplit_kind(k: MoveKind) -> bool {
    matches!(k, MoveKind::Relieve | MoveKind::Hedge)
}

fn within_limits(t: &PoolTarget, cfg: &PlannerConfig) -> bool {
    let l = &cfg.limits;
    let within = |v: u32, (lo, hi): (u32, u32)| lo <= v && v <= hi;
    within(t.prefill, (l.min_prefill, l.max_prefill))
        && within(t.decode, (l.min_decode, l.max_decode))
        && within(t.colocated, (l.min_colocated, l.max_colocated))
        && t.nodes() <= l.max_nodes
}

fn reason(cur: &PoolTarget, current: &Candidate, mv: &Move, inputs: &Inputs, cfg: &PlannerConfig) -> Reason {
    let to = &mv.to.target;
    if mv.kind == MoveKind::Bounds {
        return Reason::Bounds;
    }
    if to.colocated > 0 && cur.prefill + cur.decode > 0 {
        return Reason::Colocate;
    }
    if to.colocated == 0 && cur.colocated > 0 {
        return Reason::Disaggregate;
    }
    if to.counts() == cur.counts() {
        return Reason::StepBudget;
    }
    if mv.kind == MoveKind::ScaleDown {
        return Reason::Overprovisioned;
    }
    if binding(current, cfg).is_prefill() {
        if inputs.observed_ttft_ms.is_some_and(|o| o > cfg.targets.ttft_ms) {
            Reason::TtftBreach
        } else {
            Reason::TtftRisk
        }
    } else if inputs.observed_tpot_ms.is_some_and(|o| o > cfg.targets.tpot_ms) {
        Reason::TpotBreach
    } else {
        Reason::TpotRisk
    }
}

/// What binds the current configuration's worst ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Binding {
    Ttft,
    Tpot,
    /// Prefill servers' utilisation.
    PrefillBusy(f64),
    /// Decode KV pressure (offered sequences over what the KV holds).
    DecodeBusy(f64),
}

impl Binding {
    fn is_prefill(self) -> bool {
        matches!(self, Binding::Ttft | Binding::PrefillBusy(_))
    }
}

fn binding(current: &Candidate, cfg: &PlannerConfig) -> Binding {
    let t = &cfg.targets;
    let c = &current.corrected;
    let (ttft, tpot) = (c.ttft / (t.ttft_ms / 1e3), c.tpot / (t.tpot_ms / 1e3));
    let raw = &current.raw;
    if raw.stress > ttft.max(tpot) {
        if raw.stress <= raw.utilisation {
            Binding::PrefillBusy(raw.utilisation)
        } else {
            Binding::DecodeBusy(raw.stress)
        }
    } else if ttft >= tpot {
        Binding::Ttft
    } else {
        Binding::Tpot
    }
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "unbounded".to_string(), |v| format!("{v:.0} ms"))
}

/// "prefill 1 -> 2, decode 2 -> 1, step budget 2048 -> 256"
fn changes(cur: &PoolTarget, to: &PoolTarget) -> String {
    let mut parts = Vec::new();
    for (name, a, b) in [
        ("prefill", cur.prefill, to.prefill),
        ("decode", cur.decode, to.decode),
        ("colocated", cur.colocated, to.colocated),
    ] {
        if a != b {
            parts.push(format!("{name} {a} -> {b}"));
        }
    }
    if to.colocated > 0 && cur.step_budget != to.step_budget {
        let show = |b: Option<u32>| b.map_or_else(|| "none".to_string(), |b| b.to_string());
        parts.push(format!("step budget {} -> {}", show(cur.step_budget), show(to.step_budget)));
    }
    parts.join(", ")
}

fn why(
    reason: Reason,
    binding: Binding,
    mv: &Move,
    cur: &PoolTarget,
    p: &Prediction,
    i: &Inputs,
    cfg: &PlannerConfig,
) -> String {
    let t = &cfg.targets;
    let q = (t.quantile * 100.0).round();
    let up = cfg.scale_up_margin;
    let rate = i.arrival_rate;
    let to = &mv.to.target;
    let change = changes(cur, to);
    let observed = |v: Option<f64>| v.map_or_else(|| "none yet".to_string(), |v| format!("{v:.0} ms"));
    let ttft_context =
        format!("observed {}, queue {} tokens, {rate:.2} req/s", observed(i.observed_ttft_ms), i.queued_prefill_tokens);
    let tpot_context = format!(
        "observed {}, {} seqs running, {:.1} per decoding node, {rate:.2} req/s",
        observed(i.observed_tpot_ms),
        i.running_seqs,
        p.current.decode_batch
    );
    let lead = match (reason, binding) {
        (Reason::TtftRisk | Reason::TtftBreach, Binding::PrefillBusy(u)) => format!(
            "prefill servers predicted {:.0}% busy > {:.0}% (p{q} TTFT {} vs {:.0} ms target; {ttft_context})",
            u * 100.0,
            up * 100.0,
            fmt_ms(p.current.ttft_ms),
            t.ttft_ms,
        ),
        (Reason::TtftRisk | Reason::TtftBreach, _) => format!(
            "predicted p{q} TTFT {} > {:.0} ms ({up} x {:.0} ms target; {ttft_context})",
            fmt_ms(p.current.ttft_ms),
            t.ttft_ms * up,
            t.ttft_ms,
        ),
        (Reason::TpotRisk | Reason::TpotBreach, Binding::DecodeBusy(s)) => format!(
            "decode KV predicted {:.0}% committed > {:.0}% (p{q} TPOT {} vs {:.0} ms target; {tpot_context})",
            s * 100.0,
            up * 100.0,
            fmt_ms(p.current.tpot_ms),
            t.tpot_ms,
        ),
        (Reason::TpotRisk | Reason::TpotBreach, _) => format!(
            "predicted p{q} TPOT {} > {:.0} ms ({up} x {:.0} ms target; {tpot_context})",
            fmt_ms(p.current.tpot_ms),
            t.tpot_ms * up,
            t.tpot_ms,
        ),
        (Reason::Bounds, _) => format!(
            "current configuration (prefill {}, decode {}, colocated {}) breaks the limits (max {} nodes)",
            cur.prefill, cur.decode, cur.colocated, cfg.limits.max_nodes
        ),
        _ => format!(
            "{} nodes predicted at p{q} TTFT {} and TPOT {} (targets {:.0} ms, {:.0} ms; now {} and {}) at {rate:.2} req/s",
            to.nodes(),
            fmt_ms(p.target.ttft_ms),
            fmt_ms(p.target.tpot_ms),
            t.ttft_ms,
            t.tpot_ms,
            fmt_ms(p.current.ttft_ms),
            fmt_ms(p.current.tpot_ms),
        ),
    };
    match mv.attainment {
        Some([here, there]) => format!(
            "{lead}; no configuration meets the targets at p{q}, and {} nodes are predicted to keep {:.0}% of \
             requests within both (now {:.0}%): {change}",
            to.nodes(),
            there * 100.0,
            here * 100.0
        ),
        None => format!("{lead}: {change}"),
    }
}
