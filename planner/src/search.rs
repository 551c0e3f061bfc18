//! Candidate configurations and the choice among them (with hysteresis).
//!
//! Candidates are counts, never node subsets: every disaggregated split `(p, d)` and every
//! colocated `(k, step budget)` within the limits, the node budget and the node band (a fixed
//! total when nodes cannot be added). Mixed disaggregated + colocated candidates are not
//! generated (the current configuration may be mixed; the model predicts it all the same).
//!
//! Cost: predictions are monotone (non-increasing) in each pool's size, so for each decode
//! count `d` the smallest prefill count meeting a threshold is found by binary search over a
//! table of prefill predictions, and likewise the smallest colocated count per step budget.
//! One search is O(N log N) in the node budget N, with O(N) decode fixed points and
//! O(budgets x log N) colocated evaluations, never the O(N^2) pairs.
//!
//! Invariant: every candidate satisfies `min <= count <= max` for all three pools and
//! `nodes <= max_nodes`, and no pool is below the nodes already committed to it (starting or
//! switching nodes, which actions never touch), so every target is reachable.

use std::cmp::Ordering;
use std::collections::HashMap;

use crate::config::Limits;
use crate::model::{correct_above, Corrected, DecodePart, FamilyFactors, Model, PrefillPart, Raw};
use crate::types::PoolTarget;

/// Where nothing meets the targets, the least bad configuration replaces the current one only
/// when its worst ratio is at most this share of the current's. Small on purpose: near a target
/// the latency distributions are narrow (a request's TPOT averages its steps), so a few percent
/// of p90 latency is the difference between most requests meeting the target and most missing
/// it; flapping is held off by `confirm_ticks`, the cooldown, and the memory of what each
/// configuration was like to run, not by this gap.
pub(crate) const RELIEF_GAIN: f64 = 0.95;

/// Where nothing meets the targets and some configuration is predicted to keep at least
/// [`MIN_ATTAINMENT`] of requests within them, the choice is by predicted attainment, and a
/// move must gain this much of it (absolute share) over staying.
pub(crate) const ATTAIN_GAIN: f64 = 0.05;

/// How far above the attainment target a colocated configuration must be predicted for a
/// hedge into it; it is then kept while predicted at the target (the band between is the
/// hysteresis that keeps a hedge and a relief from trading places).
pub(crate) const HEDGE_BAND: f64 = 0.05;

/// Below this predicted attainment everywhere, nothing is kept within the targets worth the
/// name, and the least bad configuration is the one nearest them (worst ratio).
pub(crate) const MIN_ATTAINMENT: f64 = 0.05;

/// A configuration with its prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub target: PoolTarget,
    pub raw: Raw,
    pub corrected: Corrected,
    /// Worst of corrected prediction / target over TTFT and TPOT, and utilisation.
    pub ratio: f64,
}

impl Candidate {
    fn nodes(&self) -> u32 {
        self.target.nodes()
    }
}

/// What the search needs beside the model.
#[derive(Debug, Clone)]
pub(crate) struct SearchInput<'l> {
    pub limits: &'l Limits,
    /// Nodes starting or switching into each pool (per `Role::index`).
    pub pinned: [u32; 3],
    /// Inclusive range of node totals allowed (a single value when nodes cannot be added).
    pub band: (u32, u32),
    /// The current configuration, step budget normalized.
    pub current: PoolTarget,
    pub ttft_target_s: f64,
    pub tpot_target_s: f64,
    pub factors: FamilyFactors,
}

/// How the current configuration should be left, if at all.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    pub scale_up_margin: f64,
    pub scale_down_margin: f64,
    /// Whether configurations with fewer nodes than the current may be chosen (not during
    /// warm-up, nor while clients miss the attainment target).
    pub allow_fewer: bool,
    /// Share of requests within both targets the operator asks for (a hedge must keep it).
    pub attainment: f64,
    /// Whether hedges are made: only where the node count is fixed (see [`MoveKind::Hedge`]).
    pub hedge: bool,
    /// The share of requests within both targets clients saw in the window under the current
    /// configuration, where enough of them finished to tell (see [`Search::hedge`]).
    pub observed: Option<f64>,
}

/// Why the current configuration is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoveKind {
    /// It breaks the limits.
    Bounds,
    /// It meets the targets, and fewer nodes meet them with margin.
    ScaleDown,
    /// It is predicted to miss the targets (or already does).
    Relieve,
    /// It meets the targets disaggregated, and as many colocated nodes meet them too: colocated
    /// nodes serve any mix, so a shift of the mix finds capacity on every node instead of
    /// overloading one pool until the planner sees it (on the recorded shifting load, a 1p1d
    /// caught by a decode-heavy phase lost 10-35 points of that phase to the 6 s before the
    /// switch: BENCHMARKS.md). Disaggregation is chosen only where colocation misses. Only
    /// where the nodes are fixed: where the actuator starts nodes, a shift is met with new
    /// ones, and re-splitting a whole large cluster to hedge cost thousands of role changes a
    /// day in the simulated 400-node day (3471 against 513).
    Hedge,
}

/// A chosen move.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Move {
    pub to: Candidate,
    pub kind: MoveKind,
    /// Predicted attainment of the current configuration and of the target, when the move was
    /// chosen by it (nothing meets the targets at the quantile).
    pub attainment: Option<[f64; 2]>,
}

struct Disagg {
    p: (u32, u32),
    d: (u32, u32),
    pre: Vec<PrefillPart>,
    /// Decode pools, computed on first use (a fixed point each); indexed by `d - self.d.0`.
    dec: Vec<Option<DecodePart>>,
}

struct Coloc {
    k: (u32, u32),
    budgets: Vec<u32>,
}

/// One tick's search space.
pub(crate) struct Search<'a, 'm> {
    model: &'a Model<'m>,
    input: SearchInput<'a>,
    dis: Option<Disagg>,
    col: Option<Coloc>,
    memo: HashMap<(u32, u32), Raw>,
    /// Predicted attainment per configuration (see [`Model::attainment`]).
    attained: HashMap<PoolTarget, f64>,
    /// Configurations evaluated so far (for the complexity test).
    pub evaluated: usize,
}

/// The first `x` in `[lo, hi]` with `pred(x)`, for `pred` false then true; `None` if `!pred(hi)`.
fn first_true(lo: u32, hi: u32, mut pred: impl FnMut(u32) -> bool) -> Option<u32> {
    if lo > hi || !pred(hi) {
        return None;
    }
    let (mut lo, mut hi) = (lo, hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

impl<'a, 'm> Search<'a, 'm> {
    pub fn new(model: &'a Model<'m>, input: SearchInput<'a>) -> Self {
        let l = input.limits;
        let [pin_p, pin_d, pin_c] = input.pinned;
        let (band_lo, band_hi) = (input.band.0, input.band.1.min(l.max_nodes));
        let dis = (l.allows_disaggregated() && pin_c == 0)
            .then(|| {
                let p = (l.min_prefill.max(pin_p).max(1), l.max_prefill.min(l.max_nodes - 1));
                let d_lo = l.min_decode.max(pin_d).max(1).max(band_lo.saturating_sub(p.1));
                let d_hi = l.max_decode.min(l.max_nodes - 1).min(band_hi.saturating_sub(p.0));
                (p.0 <= p.1 && d_lo <= d_hi && p.0 + d_lo <= band_hi).then(|| Disagg {
                    p,
                    d: (d_lo, d_hi),
                    pre: model.prefill_table(p.1),
                    dec: vec![None; (d_hi - d_lo + 1) as usize],
                })
            })
            .flatten();
        let col = (l.allows_colocated() && pin_p == 0 && pin_d == 0)
            .then(|| {
                let k = (l.min_colocated.max(pin_c).max(1).max(band_lo), l.max_colocated.min(band_hi));
                let mut budgets = l.step_budgets.clone();
                budgets.sort_unstable();
                budgets.dedup();
                (k.0 <= k.1).then_some(Coloc { k, budgets })
            })
            .flatten();
        let evaluated = dis.as_ref().map_or(0, |d| d.pre.len());
        Self { model, input, dis, col, memo: HashMap::new(), attained: HashMap::new(), evaluated }
    }

    /// The worst ratio counts utilisation (offered load / capacity of the busiest pool) as a
    /// third ratio to a target of 1: a large pool's queue stays short right up to saturation,
    /// so latency alone would plan it at 99% busy, where the few percent of error in a windowed
    /// rate estimate make it unstable. The margins then apply to utilisation too.
    fn candidate(&self, target: PoolTarget, raw: Raw) -> Candidate {
        let corrected = raw.corrected(self.input.factors.of(&target));
        let ratio = corrected.ratio(self.input.ttft_target_s, self.input.tpot_target_s).max(raw.stress);
        Candidate { target, raw, corrected, ratio }
    }

    /// Evaluates any configuration (the current one, typically).
    pub fn evaluate(&self, target: &PoolTarget) -> Candidate {
        self.candidate(*target, self.model.predict(target))
    }

    /// The decode pool of `d` nodes (memoized).
    fn decode(&mut self, d: u32) -> DecodePart {
        let load = *self.model.load();
        let model = self.model;
        let dis = self.dis.as_mut().expect("disaggregated family present");
        *dis.dec[(d - dis.d.0) as usize].get_or_insert_with(|| {
            self.evaluated += 1;
            model.decode_pool(d, load.lambda, load.inflight_seqs)
        })
    }

    fn disagg(&mut self, p: u32, d: u32) -> Candidate {
        self.evaluated += 1;
        let dec = self.decode(d);
        let dis = self.dis.as_ref().expect("disaggregated family present");
        let raw = Model::combine(&dis.pre[p as usize], &dec);
        self.candidate(PoolTarget { prefill: p, decode: d, colocated: 0, step_budget: None }, raw)
    }

    /// Whether the decode pool of `d` nodes alone stays within `margin` (TPOT and KV load):
    /// a necessary condition for any split with `d` decode nodes, monotone in `d`.
    fn decode_meets(&mut self, d: u32, margin: f64) -> bool {
        let dec = self.decode(d);
        let tpot = correct_above(dec.tpot, dec.lone, self.input.factors.disaggregated.tpot);
        tpot / self.input.tpot_target_s <= margin && dec.stress <= margin
    }

    /// Whether the prefill pool of `p` nodes alone (no decode first step) stays within
    /// `margin`: a necessary condition for any split with `p` prefill nodes, monotone in `p`.
    fn prefill_meets(&self, p: u32, margin: f64) -> bool {
        let Some(dis) = self.dis.as_ref() else { return false };
        let pre = &dis.pre[p as usize];
        let ttft = (pre.ttft * self.input.factors.disaggregated.ttft).max(pre.floor);
        ttft / self.input.ttft_target_s <= margin && pre.utilisation <= margin
    }

    fn coloc(&mut self, k: u32, budget: u32) -> Candidate {
        self.evaluated += 1;
        let load = *self.model.load();
        let model = self.model;
        let raw = *self
            .memo
            .entry((k, budget))
            .or_insert_with(|| model.colocated(k, budget, load.lambda, load.backlog_tokens, load.inflight_seqs));
        self.candidate(PoolTarget { prefill: 0, decode: 0, colocated: k, step_budget: Some(budget) }, raw)
    }

    fn changes(&self, t: &PoolTarget) -> u32 {
        let c = &self.input.current;
        t.prefill.abs_diff(c.prefill) + t.decode.abs_diff(c.decode) + t.colocated.abs_diff(c.colocated)
    }

    /// Fewest role changes, then a fixed order, for otherwise equal candidates.
    fn settle(&self, a: &Candidate, b: &Candidate) -> Ordering {
        let is_cur = |c: &Candidate| c.target != self.input.current;
        is_cur(a)
            .cmp(&is_cur(b))
            .then(self.changes(&a.target).cmp(&self.changes(&b.target)))
            .then(a.target.colocated.cmp(&b.target.colocated))
            .then(a.target.prefill.cmp(&b.target.prefill))
            .then(a.target.step_budget.cmp(&b.target.step_budget))
    }

    /// Fewest nodes, then most slack, then the current configuration, then fewest changes.
    fn cmp_fewest(&self, a: &Candidate, b: &Candidate) -> Ordering {
        a.nodes().cmp(&b.nodes()).then(a.ratio.total_cmp(&b.ratio)).then_with(|| self.settle(a, b))
    }

    /// Smallest worst ratio (then least stress, for overloaded ones), then fewest nodes.
    fn cmp_least(&self, a: &Candidate, b: &Candidate) -> Ordering {
        a.ratio
            .total_cmp(&b.ratio)
            .then(a.raw.stress.total_cmp(&b.raw.stress))
            .then(a.nodes().cmp(&b.nodes()))
            .then_with(|| self.settle(a, b))
    }

    fn keep_best(
        &self,
        best: &mut Option<Candidate>,
        c: Candidate,
        cmp: fn(&Self, &Candidate, &Candidate) -> Ordering,
    ) {
        if best.as_ref().is_none_or(|b| cmp(self, &c, b) == Ordering::Less) {
            *best = Some(c);
        }
    }

    /// Node totals allowed within `band` and the search's own band.
    fn nodes_within(&self, band: (u32, u32)) -> (u32, u32) {
        (band.0.max(self.input.band.0), band.1.min(self.input.band.1).min(self.input.limits.max_nodes))
    }

    /// Prefill counts allowed beside `d` decode nodes for totals in `nodes`.
    fn p_range(&self, d: u32, nodes: (u32, u32)) -> Option<(u32, u32)> {
        let p = self.dis.as_ref()?.p;
        let lo = p.0.max(nodes.0.saturating_sub(d));
        let hi = p.1.min(nodes.1.checked_sub(d)?);
        (lo <= hi).then_some((lo, hi))
    }

    fn k_range(&self, nodes: (u32, u32)) -> Option<(u32, u32)> {
        let k = self.col.as_ref()?.k;
        let (lo, hi) = (k.0.max(nodes.0), k.1.min(nodes.1));
        (lo <= hi).then_some((lo, hi))
    }

    /// Decode counts of the disaggregated family (none when it is absent).
    fn d_values(&self) -> impl Iterator<Item = u32> {
        self.dis.as_ref().map(|d| d.d.0..=d.d.1).into_iter().flatten()
    }

    fn budgets(&self) -> Vec<u32> {
        self.col.as_ref().map_or_else(Vec::new, |c| c.budgets.clone())
    }

    /// The best candidate (fewest nodes, most slack, ...) with `ratio <= margin` and a node
    /// total within `band`.
    ///
    /// Disaggregated: decode counts are scanned upward from the smallest whose decode pool
    /// alone meets the margin; for each, the smallest meeting prefill count is binary-searched.
    /// The scan stops once `d` plus the smallest prefill count that could ever meet (the pool
    /// alone, without the decode step) exceeds the best total found: no larger `d` can tie.
    pub fn best_meeting(&mut self, margin: f64, band: (u32, u32)) -> Option<Candidate> {
        let nodes = self.nodes_within(band);
        if nodes.0 > nodes.1 {
            return None;
        }
        let mut best: Option<Candidate> = None;
        if let Some((p_all, d_all)) = self.dis.as_ref().map(|d| (d.p, d.d)) {
            let d_start = first_true(d_all.0, d_all.1, |d| self.decode_meets(d, margin));
            let p_floor = first_true(p_all.0, p_all.1, |p| self.prefill_meets(p, margin));
            if let (Some(d_start), Some(p_floor)) = (d_start, p_floor) {
                for d in d_start..=d_all.1 {
                    if best.as_ref().is_some_and(|b| d + p_floor > b.nodes()) {
                        break;
                    }
                    let Some((lo, hi)) = self.p_range(d, nodes) else { continue };
                    if let Some(p) = first_true(lo.max(p_floor), hi, |p| self.disagg(p, d).ratio <= margin) {
                        let c = self.disagg(p, d);
                        self.keep_best(&mut best, c, Self::cmp_fewest);
                    }
                }
            }
        }
        if let Some((lo, hi)) = self.k_range(nodes) {
            for b in self.budgets() {
                if let Some(k) = first_true(lo, hi, |k| self.coloc(k, b).ratio <= margin) {
                    let c = self.coloc(k, b);
                    self.keep_best(&mut best, c, Self::cmp_fewest);
                }
            }
        }
        best
    }

    /// The candidate with the smallest worst ratio within `band` (the most capacity the budget
    /// buys, spent where it helps), with the fewest nodes among equals.
    ///
    /// The ratio falls with every pool's size, so for each decode count (and each step budget)
    /// the largest allowed prefill (colocated) count is the best; only the winners are then
    /// shrunk to the fewest nodes that do as well (binary search).
    pub fn least_ratio(&mut self, band: (u32, u32)) -> Option<Candidate> {
        let nodes = self.nodes_within(band);
        if nodes.0 > nodes.1 {
            return None;
        }
        let tops = self.tops(nodes);
        let top = |c: &Candidate| (c.ratio, c.raw.stress);
        let least = tops.iter().map(|(c, _)| top(c)).min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))?;
        let mut best = None;
        for (c, lo) in tops.into_iter().filter(|(c, _)| top(c) == least) {
            let t = c.target;
            let as_good = |x: &Candidate| x.ratio <= c.ratio && x.raw.stress <= c.raw.stress;
            let shrunk = self.shrink(&t, lo, |_, x| as_good(x));
            self.keep_best(&mut best, shrunk, Self::cmp_least);
        }
        best
    }

    /// For each decode count and each step budget, the configuration with the most nodes
    /// allowed in the searched pool (prefill, colocated), with the smallest count allowed.
    fn tops(&mut self, nodes: (u32, u32)) -> Vec<(Candidate, u32)> {
        let mut tops: Vec<(Candidate, u32)> = Vec::new();
        for d in self.d_values() {
            if let Some((lo, hi)) = self.p_range(d, nodes) {
                tops.push((self.disagg(hi, d), lo));
            }
        }
        if let Some((lo, hi)) = self.k_range(nodes) {
            for b in self.budgets() {
                tops.push((self.coloc(hi, b), lo));
            }
        }
        tops
    }

    /// The fewest nodes of `t`'s searched pool (prefill beside its decode count, or colocated
    /// at its budget), from `lo` up, for which `good` holds (binary search: `good` must be
    /// monotone in the count); `t` itself when none smaller does.
    fn shrink(&mut self, t: &PoolTarget, lo: u32, mut good: impl FnMut(&mut Self, &Candidate) -> bool) -> Candidate {
        if t.colocated > 0 {
            let b = t.step_budget.unwrap_or_default();
            let k = first_true(lo, t.colocated, |k| {
                let c = self.coloc(k, b);
                good(self, &c)
            });
            self.coloc(k.unwrap_or(t.colocated), b)
        } else {
            let p = first_true(lo, t.prefill, |p| {
                let c = self.disagg(p, t.decode);
                good(self, &c)
            });
            self.disagg(p.unwrap_or(t.prefill), t.decode)
        }
    }

    /// The current configuration's share as a move away from it is judged: the lower of its
    /// predicted and `observed` share. Where clients see it miss while its corrected prediction
    /// says it keeps most requests, the clients are right (measured: a 1p1d predicted at 94-98%
    /// while clients saw 80-89% kept the planner off colocated nodes that held 74-83%;
    /// BENCHMARKS.md, "SLO admission").
    pub fn judged(&mut self, current: &PoolTarget, observed: Option<f64>) -> f64 {
        self.attainment(current).min(observed.unwrap_or(1.0))
    }

    /// Predicted share of requests within both targets under `t` (memoized).
    pub fn attainment(&mut self, t: &PoolTarget) -> f64 {
        if let Some(a) = self.attained.get(t) {
            return *a;
        }
        let i = &self.input;
        let a = self.model.attainment(t, i.factors.of(t), i.ttft_target_s, i.tpot_target_s);
        self.attained.insert(*t, a);
        a
    }

    /// The candidate predicted to keep the most requests within the targets in `band`, with
    /// the fewest nodes that keep as many; among equals the smallest worst ratio. Attainment
    /// grows with every pool's size, so as in [`Self::least_ratio`] only the largest count per
    /// decode count and step budget is scored, then the winner is shrunk.
    pub fn most_attaining(&mut self, band: (u32, u32)) -> Option<(Candidate, f64)> {
        let nodes = self.nodes_within(band);
        if nodes.0 > nodes.1 {
            return None;
        }
        let scored: Vec<(Candidate, u32, f64)> =
            self.tops(nodes).into_iter().map(|(c, lo)| (c, lo, self.attainment(&c.target))).collect();
        let top = scored.iter().map(|x| x.2).fold(f64::NEG_INFINITY, f64::max);
        // Among those within a gain's worth of the most, the fewest role changes: a step budget
        // moves at once and drains nothing, a role switch drains streams, and predictions this
        // close do not tell the two apart (at a shift's onset the window mixes two loads).
        let mut best: Option<(Candidate, u32, f64)> = None;
        for (c, lo, a) in scored.into_iter().filter(|x| x.2 + ATTAIN_GAIN > top + 1e-9) {
            let better = best.as_ref().is_none_or(|(b, _, ba)| {
                let (cc, cb) = (self.changes(&c.target), self.changes(&b.target));
                cc < cb
                    || (cc == cb
                        && (a > ba + 1e-9 || ((a - ba).abs() <= 1e-9 && self.cmp_least(&c, b) == Ordering::Less)))
            });
            if better {
                best = Some((c, lo, a));
            }
        }
        let (c, lo, a) = best?;
        let shrunk = self.shrink(&c.target, lo, |s, x| s.attainment(&x.target) >= a - 1e-9);
        let a = self.attainment(&shrunk.target);
        Some((shrunk, a))
    }

    /// As many colocated nodes as `current` has, at the step budget predicted to keep the most
    /// requests within both targets, when `current` is disaggregated and that share is at
    /// least `attainment` and no less than the current one's (see [`MoveKind::Hedge`]). Judged
    /// by attainment rather than the worst ratio: pacing holds a colocated node's TPOT near its
    /// margin of the target by construction, so its ratio sits at the edge of "meets" while
    /// nearly every request is within both targets.
    ///
    /// The current configuration counts as [`Search::judged`].
    fn hedge(&mut self, current: &Candidate, attainment: f64, observed: Option<f64>) -> Option<Candidate> {
        let t = current.target;
        let n = t.nodes();
        if t.prefill + t.decode == 0 || n == 0 {
            return None;
        }
        let (lo, hi) = self.k_range((n, n))?;
        if lo > n || hi < n {
            return None;
        }
        let mut best: Option<(Candidate, f64)> = None;
        for b in self.budgets() {
            let c = self.coloc(n, b);
            if !c.ratio.is_finite() {
                continue;
            }
            let a = self.attainment(&c.target);
            if best.as_ref().is_none_or(|(x, ax)| a > *ax || (a == *ax && c.ratio < x.ratio)) {
                best = Some((c, a));
            }
        }
        let (c, a) = best?;
        // Entering needs a band above what staying needs (hysteresis against the relief).
        let enter = (attainment + HEDGE_BAND).min(1.0);
        let here = self.judged(&t, observed);
        (a + 1e-9 >= enter && a + 1e-9 >= here).then_some(c)
    }

    /// The hysteresis policy (see the crate docs, "Choosing"). `None`: keep the current one.
    pub fn decide(&mut self, current: &Candidate, in_limits: bool, policy: Policy) -> Option<Move> {
        let (up, down) = (policy.scale_up_margin, policy.scale_down_margin);
        let all = (0, u32::MAX);
        let n = current.nodes();
        let chosen = |to: Candidate, kind: MoveKind| {
            (to.target != current.target).then_some(Move { to, kind, attainment: None })
        };
        if !in_limits {
            let to = self.best_meeting(up, all).or_else(|| self.least_ratio(all))?;
            return chosen(to, MoveKind::Bounds);
        }
        // A paced colocated configuration holds its TPOT near the ratio's edge by construction
        // (see [`Search::hedge`]): it holds while its predicted attainment does.
        let paced_holds = || current.target.colocated > 0 && current.ratio.is_finite();
        if current.ratio <= up || (paced_holds() && self.attainment(&current.target) >= policy.attainment) {
            let fewer = if policy.allow_fewer && n > 0 { self.best_meeting(down, (0, n - 1)) } else { None };
            if let Some(to) = fewer {
                return chosen(to, MoveKind::ScaleDown);
            }
            if !policy.hedge {
                return None;
            }
            return self.hedge(current, policy.attainment, policy.observed).and_then(|to| chosen(to, MoveKind::Hedge));
        }
        // At risk or in breach: a move that does not add nodes must land clearly inside the
        // targets (the scale-down margin), one that adds nodes inside the scale-up margin.
        let same_or_fewer = (if policy.allow_fewer { 0 } else { n }, n);
        if let Some(to) = self.best_meeting(down, same_or_fewer).or_else(|| self.best_meeting(up, (n + 1, u32::MAX))) {
            return chosen(to, MoveKind::Relieve);
        }
        // Nothing meets: the one keeping the most requests within the targets, if it keeps
        // clearly more than staying; where nothing keeps a share worth the name, the one
        // nearest the targets, if clearly nearer.
        if let Some((to, a_to)) = self.most_attaining(all) {
            let a_cur = self.judged(&current.target, policy.observed);
            if a_to.max(a_cur) >= MIN_ATTAINMENT {
                let gain = a_to >= a_cur + ATTAIN_GAIN;
                return (gain && to.target != current.target).then_some(Move {
                    to,
                    kind: MoveKind::Relieve,
                    attainment: Some([a_cur, a_to]),
                });
            }
        }
        let to = self.least_ratio(all)?;
        let better = if to.ratio.is_finite() {
            !current.ratio.is_finite() || to.ratio <= current.ratio * RELIEF_GAIN
        } else {
            !current.ratio.is_finite() && to.raw.stress <= current.raw.stress * up
        };
        if better {
            chosen(to, MoveKind::Relieve)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::LinearCosts;
    use crate::model::Load;

    #[test]
    fn first_true_finds_the_boundary() {
        assert_eq!(first_true(1, 10, |x| x >= 7), Some(7));
        assert_eq!(first_true(1, 10, |x| x >= 11), None);
        assert_eq!(first_true(3, 3, |_| true), Some(3));
        assert_eq!(first_true(4, 3, |_| true), None);
    }

    fn limits(n: u32) -> Limits {
        Limits {
            min_prefill: 0,
            max_prefill: n,
            min_decode: 0,
            max_decode: n,
            min_colocated: 0,
            max_colocated: n,
            max_nodes: n,
            step_budgets: vec![64, 128, 256, 512, 2048],
        }
    }

    fn evaluations(n: u32) -> usize {
        let costs = LinearCosts { decode_fixed_s: 0.02, ..LinearCosts::default() };
        // Demand that needs about a quarter of the nodes.
        let lambda = f64::from(n) * 0.4;
        let load = Load {
            lambda,
            prompt: 200.0,
            prompt_sd: 50.0,
            output: 50.0,
            backlog_tokens: 0.0,
            inflight_seqs: 0.0,
            horizon_s: 0.0,
        };
        let model = Model::new(&costs, load, 0.9, 2048);
        let l = limits(n);
        let input = SearchInput {
            limits: &l,
            pinned: [0; 3],
            band: (0, n),
            current: PoolTarget { prefill: 1, decode: 1, colocated: 0, step_budget: None },
            ttft_target_s: 3.0,
            tpot_target_s: 0.1,
            factors: FamilyFactors::default(),
        };
        let mut s = Search::new(&model, input);
        let cur = s.evaluate(&PoolTarget { prefill: 1, decode: 1, colocated: 0, step_budget: None });
        let policy = Policy {
            scale_up_margin: 0.9,
            scale_down_margin: 0.7,
            allow_fewer: true,
            attainment: 0.9,
            hedge: true,
            observed: None,
        };
        let m = s.decide(&cur, true, policy).expect("1p1d cannot carry this load");
        assert!(m.to.ratio <= 0.9 && m.to.target.nodes() > 2);
        s.best_meeting(0.7, (0, n));
        s.least_ratio((0, n));
        s.evaluated
    }

    /// The search evaluates O(N log N) configurations, not the O(N^2) prefill/decode pairs.
    #[test]
    fn evaluations_grow_near_linearly_with_the_node_budget() {
        let (small, large) = (evaluations(100), evaluations(400));
        eprintln!("100 nodes: {small}, 400 nodes: {large}");
        let pairs_400 = 400 * 400 / 2;
        assert!(large < pairs_400 / 4, "{large} evaluations for 400 nodes");
        // 4x the nodes: 4 x log(400)/log(100) = 5.2x for N log N, 16x for N^2.
        assert!((large as f64) < 7.0 * small as f64, "100 nodes: {small}, 400 nodes: {large}");
    }
}
