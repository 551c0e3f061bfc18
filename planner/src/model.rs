//! The performance model: predicted TTFT and TPOT at the target quantile for a configuration,
//! from demand (arrivals), work already on the nodes (queued prompt tokens, sequences in flight)
//! and a [`StepCosts`]. Formulas and assumptions are in the crate docs; this module is their
//! only implementation, shared by `tick`, `estimate` and the candidate search.
//!
//! All times here are seconds. An infinite prediction means unbounded: a pool at or past
//! saturation, a configuration that cannot serve (prefill nodes and no decode node), or KV that
//! does not fit.

use crate::costs::StepCosts;
use crate::queueing::{
    erlang_c, erlang_c_table, least_fixed_point, normal_quantile, poisson_quantile, poisson_upper, wait_quantile,
};
use crate::types::{ConfigPrediction, PoolTarget};

/// Quantiles probed when predicting attainment: a prediction within target at the upper end
/// counts as everyone, one past it at the lower end as no one.
const ATTAIN_Q: (f64, f64) = (0.01, 0.99);
/// Bisection steps: the share to within 0.98 / 2^7, under one percentage point.
const ATTAIN_STEPS: u32 = 7;

/// Demand and the work on the nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Load {
    /// Arrivals per second.
    pub lambda: f64,
    pub prompt: f64,
    pub prompt_sd: f64,
    /// Expected output tokens per request.
    pub output: f64,
    /// Prompt tokens queued on the nodes.
    pub backlog_tokens: f64,
    /// Sequences in flight (running + waiting) on decoding nodes.
    pub inflight_seqs: f64,
    /// Seconds of arrivals a prediction speaks for (the planner's window; 0: only the next
    /// arrival). A backlog that drains within a small part of it delays few of them.
    pub horizon_s: f64,
}

/// Wait at quantile `q` that a backlog of `backlog` tokens adds over the next `horizon_s` of
/// arrivals, on servers that prefill `capacity` tokens/s while `demand` tokens/s arrive.
///
/// An arrival now waits `backlog / capacity`; the backlog shrinks at `capacity - demand` and is
/// gone after `clear`, so arrivals spread over the horizon wait linearly less, down to 0. The
/// share waiting more than `x` is `clear (1 - x capacity / backlog) / horizon`; at `1 - q`:
/// `x = head (1 - (1 - q) horizon / clear)`, at least 0. A burst that clears within `(1 - q)`
/// of the horizon delays fewer than the quantile's tail; a backlog that does not clear
/// (`demand >= capacity`) delays all (the queueing part calls that pool unstable anyway).
fn backlog_wait(backlog: f64, capacity: f64, demand: f64, horizon_s: f64, q: f64) -> f64 {
    if backlog <= 0.0 || capacity <= 0.0 {
        return 0.0;
    }
    let head = backlog / capacity;
    let net = capacity - demand;
    if net <= 0.0 || horizon_s <= 0.0 {
        return head;
    }
    let clear = backlog / net;
    head * (1.0 - (1.0 - q) * horizon_s / clear).max(0.0)
}

/// A prediction before the observation correction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Raw {
    pub ttft: f64,
    /// What the queued backlog alone implies (no modelled queueing): the correction never
    /// scales a prediction below it, because the backlog is a measurement, not a model.
    pub ttft_floor: f64,
    pub tpot: f64,
    /// A lone decode step at the mean context: TPOT's floor. The correction scales only what a
    /// prediction adds above it (batching, prefill chunks), because the step's own speed is
    /// what the cost calibration already follows, and a factor learnt at the quantile's tail
    /// applied to the floor too pushed even a lone request past a target set near it.
    pub tpot_floor: f64,
    /// Busy share of the prefill servers.
    pub utilisation: f64,
    /// Mean sequences in flight per decoding node.
    pub batch: f64,
    /// Offered load over capacity of the most loaded pool (>= 1: that pool cannot keep up).
    /// Finite even where the latencies are not, so that overloaded configurations can still
    /// be ranked: the least overloaded one is the best use of the budget.
    pub stress: f64,
}

impl Raw {
    const UNSERVABLE: Raw = Raw::unbounded(f64::INFINITY);

    const fn unbounded(stress: f64) -> Raw {
        Raw {
            ttft: f64::INFINITY,
            ttft_floor: f64::INFINITY,
            tpot: f64::INFINITY,
            tpot_floor: 0.0,
            utilisation: 0.0,
            batch: 0.0,
            stress,
        }
    }

    /// The worse of two parts serving shares of the same demand.
    fn worst(self, o: Raw) -> Raw {
        Raw {
            ttft: self.ttft.max(o.ttft),
            ttft_floor: self.ttft_floor.max(o.ttft_floor),
            tpot: self.tpot.max(o.tpot),
            tpot_floor: self.tpot_floor.max(o.tpot_floor),
            utilisation: self.utilisation.max(o.utilisation),
            batch: self.batch.max(o.batch),
            stress: self.stress.max(o.stress),
        }
    }

    /// Applies the observed/predicted factors.
    pub fn corrected(self, f: Factors) -> Corrected {
        Corrected {
            ttft: (self.ttft * f.ttft).max(self.ttft_floor),
            tpot: correct_above(self.tpot, self.tpot_floor, f.tpot),
        }
    }

    pub fn to_prediction(self, f: Factors) -> ConfigPrediction {
        let c = self.corrected(f);
        let ms = |s: f64| s.is_finite().then_some(s * 1e3);
        ConfigPrediction {
            ttft_ms: ms(c.ttft),
            tpot_ms: ms(c.tpot),
            prefill_utilisation: finite_or_zero(self.utilisation),
            decode_batch: finite_or_zero(self.batch),
            attainment: None,
        }
    }
}

/// `floor + factor * (x - floor)`: a correction of what `x` adds above its floor (see
/// [`Raw::tpot_floor`]); never below the floor, infinite stays infinite.
pub(crate) fn correct_above(x: f64, floor: f64, factor: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    let floor = floor.min(x).max(0.0);
    floor + factor * (x - floor)
}

fn finite_or_zero(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

/// Observed/predicted correction factors (1 = the model is right).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Factors {
    pub ttft: f64,
    pub tpot: f64,
}

impl Default for Factors {
    fn default() -> Self {
        Self { ttft: 1.0, tpot: 1.0 }
    }
}

/// Correction factors per family of configuration: disaggregated pools and colocated nodes
/// are predicted by different formulas, whose errors differ (the colocated one, built on the
/// prompts that overlap a sequence's life, errs on the safe side at the quantile; the decode
/// pool's on the other), so what clients showed of one says nothing of the other. One factor
/// for both carried the colocated pessimism over to the disaggregated split and made it look
/// better than it ran after every switch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct FamilyFactors {
    pub disaggregated: Factors,
    pub colocated: Factors,
}

/// A family of configurations: predicted by its own formula, corrected by its own factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Disaggregated = 0,
    Colocated = 1,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Disaggregated, Family::Colocated];

    /// `None` for a mixed (or empty) configuration, whose completions belong to both.
    pub fn of(t: &PoolTarget) -> Option<Family> {
        match (t.prefill + t.decode > 0, t.colocated > 0) {
            (true, false) => Some(Family::Disaggregated),
            (false, true) => Some(Family::Colocated),
            _ => None,
        }
    }
}

impl FamilyFactors {
    pub fn get(&self, f: Family) -> Factors {
        match f {
            Family::Disaggregated => self.disaggregated,
            Family::Colocated => self.colocated,
        }
    }

    pub fn get_mut(&mut self, f: Family) -> &mut Factors {
        match f {
            Family::Disaggregated => &mut self.disaggregated,
            Family::Colocated => &mut self.colocated,
        }
    }

    /// The factors that apply to `t`: its family's, or for a mixed configuration (only ever a
    /// transition) the larger of each.
    pub fn of(&self, t: &PoolTarget) -> Factors {
        Family::of(t).map_or(
            Factors {
                ttft: self.disaggregated.ttft.max(self.colocated.ttft),
                tpot: self.disaggregated.tpot.max(self.colocated.tpot),
            },
            |f| self.get(f),
        )
    }
}

/// A corrected prediction, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Corrected {
    pub ttft: f64,
    pub tpot: f64,
}

impl Corrected {
    /// The worse of the two prediction/target ratios.
    pub fn ratio(&self, ttft_target_s: f64, tpot_target_s: f64) -> f64 {
        (self.ttft / ttft_target_s).max(self.tpot / tpot_target_s)
    }
}

/// The prefill pool's part of TTFT (before the decode node's first step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PrefillPart {
    pub ttft: f64,
    pub floor: f64,
    pub utilisation: f64,
}

/// The decode pool's part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DecodePart {
    /// The decode node's first step, added to TTFT.
    pub first_step: f64,
    /// A lone decode step (TPOT's floor, [`Raw::tpot_floor`]).
    pub lone: f64,
    pub tpot: f64,
    pub batch: f64,
    /// `(lambda/m) * O * step(1 + K) / K` with `K` the KV limit in sequences: >= 1 means the
    /// batch grows past what the KV holds (for step costs linear in batch).
    pub stress: f64,
}

/// What a colocated node's steps come to at one mean batch ([`Model::colocated_steps`]).
#[derive(Debug, Clone, Copy)]
struct ColocatedSteps {
    /// Mean prefill of a prompt, seconds: [`Self::alone`] and [`Self::paced`] blended by
    /// [`Self::overlap`].
    service: f64,
    /// Prefill of a prompt with no decodes running, in prefill-only steps of up to the budget.
    alone: f64,
    /// Prefill of a prompt beside the decodes, in paced mixed steps.
    paced: f64,
    /// Most prompt tokens a paced mixed step carries.
    chunk: f64,
    /// Share of prompts prefilled beside decodes: the chance the node is decoding.
    overlap: f64,
    /// Share of the node's time spent prefilling.
    u: f64,
    /// A decode-only step.
    t_d: f64,
    /// A decoding sequence's mean time per token.
    tpot_mean: f64,
}

/// Per-prompt prefill service on a dedicated node, from the prompt-length distribution.
#[derive(Debug, Clone, Copy)]
struct PrefillService {
    s_mean: f64,
    /// Service of a prompt at the quantile of prompt length, plus its handoff.
    s_tail: f64,
    /// Squared coefficient of variation of service time.
    cs2: f64,
    /// Prompt tokens per second of one node.
    tokens_per_s: f64,
}

/// The model for one tick: costs, demand and the quantile.
pub(crate) struct Model<'a> {
    costs: &'a dyn StepCosts,
    load: Load,
    q: f64,
    z: f64,
    prefill: PrefillService,
    /// Budget assumed for colocated nodes that report none.
    largest_budget: u32,
    /// The longest step a colocated node runs beside decodes when it paces prompt chunks to the
    /// TPOT target (`cleave_engine::sched::pacing`: the target times its margin); None: the
    /// step budget alone sizes chunks.
    paced_step_s: Option<f64>,
}

/// What the engine's pacing aims a step beside decodes at: this share of the TPOT target
/// (`cleave_engine::sched::pacing::PACING_MARGIN`; the planner does not depend on the engine).
pub const PACING_MARGIN: f64 = 0.9;

/// The fewest prompt tokens a paced step carries (`cleave_engine::sched::pacing::MIN_PACED_CHUNK`).
pub const MIN_PACED_CHUNK: f64 = 4.0;

fn tokens(x: f64) -> usize {
    x.round().max(0.0) as usize
}

/// Time to run `n` tokens in chunks of at most `chunk`, a step of `step(c)` for `c` tokens:
/// the whole chunks, then the remainder's step (a 384-token prompt at budget 256 is a 256-token
/// and a 128-token step, not two of 256).
fn chunked(n: f64, chunk: f64, step: impl Fn(f64) -> f64) -> f64 {
    let chunk = chunk.max(1.0);
    let whole = (n / chunk).floor();
    let rest = n - whole * chunk;
    let rest = if rest >= 0.5 { step(rest) } else { 0.0 };
    whole * step(chunk) + rest
}

/// `f` at a real argument `x >= 0`, linearly interpolated between the integers around it.
fn interp(x: f64, f: impl Fn(usize) -> f64) -> f64 {
    let lo = x.floor();
    let frac = x - lo;
    let f0 = f(lo as usize);
    if frac < 1e-9 {
        f0
    } else {
        f0 + frac * (f(lo as usize + 1) - f0)
    }
}

impl<'a> Model<'a> {
    pub fn new(costs: &'a dyn StepCosts, load: Load, quantile: f64, largest_budget: u32) -> Self {
        let mut load = load;
        load.prompt = load.prompt.max(1.0);
        load.output = load.output.max(1.0);
        let z = normal_quantile(quantile);
        let p = load.prompt;
        let sd = load.prompt_sd.max(0.0);
        // Two-point quadrature: exact mean and first-order spread for a quadratic prefill_time.
        let t_lo = costs.prefill_time(tokens((p - sd).max(1.0)));
        let t_hi = costs.prefill_time(tokens(p + sd));
        let s_mean = 0.5 * (t_lo + t_hi);
        let cs2 = if s_mean > 0.0 { (0.5 * (t_hi - t_lo) / s_mean).powi(2) } else { 0.0 };
        let p_tail = (p + z * sd).max(1.0);
        let s_tail = costs.prefill_time(tokens(p_tail)) + costs.handoff_time(tokens(p_tail));
        let tokens_per_s = p / costs.prefill_time(tokens(p));
        let prefill = PrefillService { s_mean, s_tail, cs2, tokens_per_s };
        Self { costs, load, q: quantile, z, prefill, largest_budget, paced_step_s: None }
    }

    /// Colocated nodes pace prompt chunks to `tpot_target_s` (what nodes do unless started
    /// with `--no-pacing`): a chunk beside decodes is cut so that each decoding sequence's mean
    /// time per token stays within the target times [`PACING_MARGIN`], down to
    /// [`MIN_PACED_CHUNK`] tokens.
    pub fn paced(mut self, tpot_target_s: Option<f64>) -> Self {
        self.paced_step_s = tpot_target_s.filter(|t| t.is_finite() && *t > 0.0).map(|t| PACING_MARGIN * t);
        self
    }

    /// The step a paced node allows beside `x` decodes when prompts arrive at `lam` per
    /// second: the allowance of its freshest sequence, which binds. A sequence `n` steps old
    /// has banked `n (m T - t_d)` beyond the one step's `m T` it may always take; the freshest
    /// is on average one arrival gap old (`1 / lam`), `1 / (lam t_d)` steps, and no older than
    /// half the output on average (it may be the only sequence there is). Pacing therefore
    /// binds just after a sequence starts and hardly at all on a node whose sequences are old
    /// (modelling every step as a fresh sequence's, as first tried, starved the prefill of a
    /// loaded colocated node in the model, and the planner left colocation as a decode-heavy
    /// load began: BENCHMARKS.md).
    fn paced_limit(&self, x: f64, lam: f64) -> Option<f64> {
        let limit = self.paced_step_s?;
        let t_d = self.decode_step(x);
        let spare = (limit - t_d).max(0.0);
        // Steps since its first token: an arrival gap's worth, but no more than half a life.
        let age = if lam > 0.0 && t_d > 0.0 {
            (1.0 / (lam * t_d)).min(self.load.output / 2.0)
        } else {
            self.load.output / 2.0
        };
        let banked = age * spare;
        Some(limit + banked)
    }

    /// Most prompt tokens a step beside `x` decodes carries at arrival rate `lam`: `room`
    /// unpaced, else the largest chunk (at least the floor) whose mixed step fits the paced
    /// step.
    fn paced_room(&self, room: f64, x: f64, lam: f64) -> f64 {
        let Some(limit) = self.paced_limit(x, lam) else { return room };
        if room <= MIN_PACED_CHUNK || self.mixed_step(room, x) <= limit {
            return room;
        }
        let (mut lo, mut hi) = (MIN_PACED_CHUNK, room);
        if self.mixed_step(lo, x) > limit {
            return lo;
        }
        while hi - lo > 1.0 {
            let mid = ((lo + hi) / 2.0).floor();
            if self.mixed_step(mid, x) <= limit {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    pub fn load(&self) -> &Load {
        &self.load
    }

    /// Mean context per sequence while decoding: the prompt plus half the output.
    fn ctx_per_seq(&self) -> f64 {
        self.load.prompt + self.load.output / 2.0
    }

    /// Most sequences one node's KV holds at the mean context.
    fn kv_limit(&self) -> f64 {
        self.costs.kv_capacity_tokens() as f64 / self.ctx_per_seq()
    }

    /// A decode step of a real batch `x >= 1`.
    fn decode_step(&self, x: f64) -> f64 {
        let ctx = self.ctx_per_seq();
        interp(x, |b| self.costs.decode_step_time(b, tokens(b as f64 * ctx)))
    }

    /// A step carrying a prefill chunk of `chunk` tokens beside a real batch `x >= 1`.
    fn mixed_step(&self, chunk: f64, x: f64) -> f64 {
        let ctx = self.ctx_per_seq();
        let chunk = tokens(chunk).max(1);
        interp(x, |b| self.costs.mixed_step_time(chunk, b, tokens(b as f64 * ctx)))
    }

    /// Prefill pools of 0..=p_max nodes taking all the demand and the whole backlog.
    pub fn prefill_table(&self, p_max: u32) -> Vec<PrefillPart> {
        let a = self.load.lambda * self.prefill.s_mean;
        erlang_c_table(a, p_max)
            .into_iter()
            .enumerate()
            .map(|(n, c)| self.prefill_pool(n as u32, self.load.lambda, self.load.backlog_tokens, c))
            .collect()
    }

    /// A prefill pool of `n` nodes (M/G/n with Erlang probability of waiting `erlang_c`).
    ///
    /// TTFT part = max(queue wait at the quantile, backlog drain time) + service and handoff of
    /// a prompt at the quantile of prompt length. The backlog already queued on the nodes is
    /// drained by the pool's throughput; it is the same queue the model predicts in steady
    /// state, hence max, not a sum.
    fn prefill_pool(&self, n: u32, lambda: f64, backlog: f64, erlang_c: f64) -> PrefillPart {
        if n == 0 {
            return PrefillPart { ttft: f64::INFINITY, floor: f64::INFINITY, utilisation: 0.0 };
        }
        let s = &self.prefill;
        let a = lambda * s.s_mean;
        let wait = wait_quantile(n, a, erlang_c, s.s_mean, s.cs2, self.q);
        let capacity = f64::from(n) * s.tokens_per_s;
        let drain = backlog_wait(backlog, capacity, lambda * self.load.prompt, self.load.horizon_s, self.q);
        PrefillPart { ttft: wait.max(drain) + s.s_tail, floor: drain + s.s_tail, utilisation: a / f64::from(n) }
    }

    /// A decode pool of `m` nodes under continuous batching.
    ///
    /// Sequences in flight per node `B` (an M/G/inf population: each sequence stays for `O`
    /// steps) solve `B = (lambda / m) * O * step(1 + B)`, the step a member sees holding itself
    /// and the others; at least the sequences the nodes report now. TPOT at the quantile is the
    /// step at `1 + ` the quantile of the batch averaged over one life
    /// ([`Self::life_batch_upper`]). Unstable when no fixed point exists below the KV capacity.
    pub fn decode_pool(&self, m: u32, lambda: f64, inflight: f64) -> DecodePart {
        if m == 0 {
            return DecodePart {
                first_step: f64::INFINITY,
                lone: 0.0,
                tpot: f64::INFINITY,
                batch: 0.0,
                stress: f64::INFINITY,
            };
        }
        let lam = lambda / f64::from(m);
        let o = self.load.output;
        let limit = self.kv_limit();
        let stress = self.decode_stress(lam, limit);
        let lone = self.decode_step(1.0);
        let unstable = DecodePart { first_step: f64::INFINITY, lone, tpot: f64::INFINITY, batch: 0.0, stress };
        let Some(b) = least_fixed_point(|b| lam * o * self.decode_step(1.0 + b), limit) else {
            return unstable;
        };
        let b = b.max(inflight / f64::from(m));
        if 1.0 + b > limit {
            return unstable;
        }
        DecodePart {
            first_step: self.decode_step(1.0 + b),
            lone,
            tpot: self.decode_step(1.0 + self.life_batch_upper(b)),
            batch: b,
            stress,
        }
    }

    /// The batch of others a sequence sees over its life, at the quantile. TPOT averages the
    /// steps of a request's whole life, so what matters is the batch averaged over that life,
    /// not at one instant: for an M/G/inf population of mean `b` whose members stay one life
    /// `L`, the count's covariance at lag `u` is `b (1 - u/L)`, and its average over `[0, L]`
    /// has variance `2b/3`, not `b`. So the Poisson quantile with the spread scaled by
    /// `sqrt(2/3)`. (The instant quantile made every decode pool look a whole batch step
    /// slower at p90 than clients measured.)
    fn life_batch_upper(&self, b: f64) -> f64 {
        poisson_upper(b, self.z * (2.0f64 / 3.0).sqrt())
    }

    fn decode_stress(&self, lam: f64, limit: f64) -> f64 {
        if limit < 1.0 {
            return f64::INFINITY;
        }
        lam * self.load.output * self.decode_step(1.0 + limit) / limit
    }

    /// Disaggregated: prefill part, then the decode node's first step.
    pub fn combine(pre: &PrefillPart, dec: &DecodePart) -> Raw {
        Raw {
            ttft: pre.ttft + dec.first_step,
            ttft_floor: pre.floor + dec.first_step,
            tpot: dec.tpot,
            tpot_floor: dec.lone,
            utilisation: pre.utilisation,
            batch: dec.batch,
            stress: pre.utilisation.max(dec.stress),
        }
    }

    /// `k` colocated nodes with step budget `budget`, each taking `lambda / k` of the demand;
    /// `B` others decode beside a decoding sequence, solving `B = (lambda/k) O TPOT_mean`
    /// (steps from [`Self::colocated_steps`]). The formulas are in the crate docs ("`k`
    /// colocated nodes"): TTFT is an M/G/1 wait on the blended prefill service, plus the
    /// prompts that join a waiting prompt's step where the budget holds more than one, plus its
    /// own service; TPOT counts the paced mixed steps of the prompts that overlap a sequence's
    /// life at the quantile.
    pub fn colocated(&self, k: u32, budget: u32, lambda: f64, backlog: f64, inflight: f64) -> Raw {
        if k == 0 {
            return Raw::UNSERVABLE;
        }
        let lam = lambda / f64::from(k);
        let (p, o) = (self.load.prompt, self.load.output);
        let budget = f64::from(budget);
        let steps = |b: f64| self.colocated_steps(budget, b, lam);
        let limit = self.kv_limit();
        // Prefill share with no other sequence, and the decode side's KV pressure.
        let stress = {
            let prefill = lam * self.alone_service(p, budget);
            prefill.max(self.decode_stress(lam, limit))
        };
        let fixed = least_fixed_point(|b| steps(b).map_or(f64::INFINITY, |s| lam * o * s.tpot_mean), limit);
        let Some(b) = fixed.map(|b| b.max(inflight / f64::from(k))).filter(|b| 1.0 + b <= limit) else {
            return Raw::unbounded(stress);
        };
        let Some(s) = steps(b) else {
            return Raw::unbounded(stress);
        };
        let cs2 = self.prefill.cs2;
        let wait = wait_quantile(1, s.u, s.u, s.service, cs2, self.q);
        // Prompts that arrive while one waits for a node with no decodes join its step, as many
        // as the budget holds beside it (the scheduler admits FCFS while budget remains): its
        // first token then comes after theirs too. A large budget's whole-prompt steps cost
        // less per token but batch the queue, and this is where that shows (phase 3 of the
        // shifting load at TPOT 100, three runs at budget 2048 and two at 128: p50 TTFT 1.4-1.6
        // s against 1.5-1.9, p90 3.7-4.0 s against 3.1-3.4).
        let joiners = (lam * wait).min(((budget / p).floor() - 1.0).max(0.0));
        let batched = (1.0 - s.overlap) * joiners * s.alone;
        let capacity = f64::from(k) * p / s.service;
        let drain = backlog_wait(backlog, capacity, lambda * p, self.load.horizon_s, self.q);
        let p_tail = (p + self.z * self.load.prompt_sd.max(0.0)).max(1.0);
        let own = (1.0 - s.overlap) * self.alone_service(p_tail, budget)
            + s.overlap * self.paced_service(p_tail, s.chunk, 1.0 + b);
        let settle = own + s.t_d / 2.0;

        let x_q = 1.0 + self.life_batch_upper(b);
        // Prompts whose prefill overlaps the sequence's decoding: those arriving during its
        // life or up to one prompt's prefill before it.
        let overlapping = poisson_quantile(lam * (o * s.tpot_mean + s.paced), self.q);
        // The steps it shares with a prompt carry decodes: paced ones, where nodes pace.
        let chunk_q = self.paced_chunk(budget, x_q, lam).min(p);
        let mixed = (overlapping * (p / chunk_q).ceil()).min(o);
        let tpot = (mixed * self.mixed_step(chunk_q, x_q) + (o - mixed) * self.decode_step(x_q)) / o;
        // What pacing holds: every sequence's mean within the paced step, unless a decode
        // step with the floor chunk beside it is already longer.
        let tpot = match self.paced_step_s {
            Some(m) => tpot.min(m.max(self.mixed_step(MIN_PACED_CHUNK, x_q))),
            None => tpot,
        };
        Raw {
            ttft: (wait + batched).max(drain) + settle,
            ttft_floor: drain + settle,
            tpot,
            tpot_floor: self.decode_step(1.0),
            utilisation: s.u,
            batch: b,
            stress: stress.max(s.u),
        }
    }

    /// Prefill of an `n`-token prompt on a colocated node with no decodes running: chunks of
    /// up to the whole budget, each a prefill-only step.
    fn alone_service(&self, n: f64, budget: f64) -> f64 {
        chunked(n, budget, |c| self.costs.prefill_time(tokens(c)))
    }

    /// Most prompt tokens a step beside `x` decodes carries: what the budget leaves them (at
    /// least one), cut further where the node paces.
    fn paced_chunk(&self, budget: f64, x: f64, lam: f64) -> f64 {
        self.paced_room((budget - x).floor().max(1.0), x, lam)
    }

    /// Prefill of an `n`-token prompt beside `x` decodes in chunks of `chunk` (from
    /// [`Self::paced_chunk`]), each a mixed step.
    fn paced_service(&self, n: f64, chunk: f64, x: f64) -> f64 {
        chunked(n, chunk, |c| self.mixed_step(c, x))
    }

    /// A colocated node's steps when a decoding sequence shares it with `b` others on average
    /// (a Poisson population of mean `b`), prompts arriving at `lam`; None where prompts
    /// arrive faster than the node serves them.
    ///
    /// A prompt finds the node decoding with probability `1 - e^-b` and is then prefilled in
    /// mixed (paced) steps; otherwise in prefill-only steps of up to the whole budget. Its
    /// service is the blend of the two *times*: blending the chunk sizes instead (as first
    /// written) gave a 2048-token budget a one-step prefill whenever decodes ran less than
    /// all of the time, and the planner moved to 2048 in every burst. A decoding sequence
    /// itself only meets the paced steps: prompts that arrive during its life are prefilled
    /// beside it.
    fn colocated_steps(&self, budget: f64, b: f64, lam: f64) -> Option<ColocatedSteps> {
        let p = self.load.prompt;
        let x = 1.0 + b;
        if (budget - x).floor() < 1.0 {
            return None;
        }
        let overlap = 1.0 - (-b).exp();
        let chunk = self.paced_chunk(budget, x, lam);
        let paced = self.paced_service(p, chunk, x);
        let alone = self.alone_service(p, budget);
        let service = (1.0 - overlap) * alone + overlap * paced;
        let u = lam * service;
        // A decoding sequence's share of mixed steps: the paced prefill of the prompts that
        // arrive during its life.
        let mixed_share = lam * paced;
        if u >= 1.0 || mixed_share >= 1.0 {
            return None;
        }
        let t_m = self.mixed_step(chunk.min(p), x);
        let t_d = self.decode_step(x);
        let tpot_mean = 1.0 / (mixed_share / t_m + (1.0 - mixed_share) / t_d);
        Some(ColocatedSteps { service, alone, paced, chunk, overlap, u, t_d, tpot_mean })
    }

    /// Predicted share of requests that meet both targets: `P(TTFT <= ttft_s) * P(TPOT <=
    /// tpot_s)`, each the largest quantile whose corrected prediction stays within its target
    /// (bisection over the quantile; the predictions are non-decreasing in it). The product
    /// treats the two as independent, which under-states the share where both suffer from the
    /// same busy periods: a conservative, not an exact, figure.
    ///
    /// What it is for: where no configuration meets the targets at the quantile, the one that
    /// keeps the most requests within them is the best use of the nodes, and a worst-ratio at
    /// the quantile cannot see that (two decoders whose p90 TPOT is past the target may still
    /// keep twice the share under it as one). 0 for a configuration that cannot keep up.
    pub fn attainment(&self, t: &PoolTarget, f: Factors, ttft_s: f64, tpot_s: f64) -> f64 {
        // The steady state at the window's demand: the sequences in flight now are one instant
        // of the population the demand implies, and near a target the share under it swings
        // with every sequence that instant holds (two in flight on a decoder whose lone step
        // is at the target read as "nobody meets it"), which made the choice flap.
        let load = Load { inflight_seqs: 0.0, ..self.load };
        let at = |q: f64| {
            let m = Model { paced_step_s: self.paced_step_s, ..Model::new(self.costs, load, q, self.largest_budget) };
            m.predict(t).corrected(f)
        };
        let share = |within: &dyn Fn(&Corrected) -> bool| {
            let (mut lo, mut hi) = (ATTAIN_Q.0, ATTAIN_Q.1);
            if within(&at(hi)) {
                return 1.0;
            }
            if !within(&at(lo)) {
                return 0.0;
            }
            for _ in 0..ATTAIN_STEPS {
                let mid = 0.5 * (lo + hi);
                if within(&at(mid)) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            lo
        };
        let ttft = share(&|c: &Corrected| c.ttft <= ttft_s);
        if ttft == 0.0 {
            return 0.0;
        }
        ttft * share(&|c: &Corrected| c.tpot <= tpot_s)
    }

    /// Any configuration, mixed ones included: demand, backlog and sequences in flight are
    /// shared between the disaggregated part and the colocated part in proportion to their
    /// node counts (the router's share is not known here), and the worse part is reported.
    pub fn predict(&self, t: &PoolTarget) -> Raw {
        let l = &self.load;
        let dis = t.prefill + t.decode;
        let n = dis + t.colocated;
        if n == 0 {
            return Raw::UNSERVABLE;
        }
        let col_share = f64::from(t.colocated) / f64::from(n);
        let mut out: Option<Raw> = None;
        if dis > 0 {
            if t.prefill == 0 || t.decode == 0 {
                return Raw::UNSERVABLE;
            }
            let s = 1.0 - col_share;
            let lambda = l.lambda * s;
            let c = erlang_c(t.prefill, lambda * self.prefill.s_mean);
            let pre = self.prefill_pool(t.prefill, lambda, l.backlog_tokens * s, c);
            let dec = self.decode_pool(t.decode, lambda, l.inflight_seqs * s);
            out = Some(Self::combine(&pre, &dec));
        }
        if t.colocated > 0 {
            let budget = t.step_budget.unwrap_or(self.largest_budget);
            let col = self.colocated(
                t.colocated,
                budget,
                l.lambda * col_share,
                l.backlog_tokens * col_share,
                l.inflight_seqs * col_share,
            );
            out = Some(out.map_or(col, |o| o.worst(col)));
        }
        out.unwrap_or(Raw::UNSERVABLE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::LinearCosts;

    fn costs() -> LinearCosts {
        LinearCosts {
            prefill_fixed_s: 0.005,
            prefill_s_per_token: 0.002,
            decode_fixed_s: 0.020,
            decode_s_per_seq: 0.001,
            ..LinearCosts::default()
        }
    }

    fn load(lambda: f64) -> Load {
        Load {
            lambda,
            prompt: 200.0,
            prompt_sd: 0.0,
            output: 100.0,
            backlog_tokens: 0.0,
            inflight_seqs: 0.0,
            horizon_s: 0.0,
        }
    }

    /// [`load`] with other mean prompt and output lengths.
    fn shaped(lambda: f64, prompt: f64, output: f64) -> Load {
        Load { prompt, output, ..load(lambda) }
    }

    fn disagg(p: u32, d: u32) -> PoolTarget {
        PoolTarget { prefill: p, decode: d, colocated: 0, step_budget: None }
    }

    #[test]
    fn queueing_raises_ttft_far_above_service_time_near_saturation() {
        let c = costs();
        let service = c.prefill_time(200) + c.handoff_time(200);
        let light = Model::new(&c, load(0.2), 0.9, 2048).predict(&disagg(1, 1));
        let heavy = Model::new(&c, load(2.35), 0.9, 2048).predict(&disagg(1, 1)); // rho ~0.95
        assert!(light.ttft < 2.0 * service, "light {} vs service {service}", light.ttft);
        assert!(heavy.ttft > 10.0 * service, "heavy {} vs service {service}", heavy.ttft);
        let over = Model::new(&c, load(2.6), 0.9, 2048).predict(&disagg(1, 1));
        assert!(over.ttft.is_infinite());
        assert!(Model::new(&c, load(2.6), 0.9, 2048).predict(&disagg(2, 1)).ttft.is_finite());
    }

    #[test]
    fn a_backlog_raises_ttft_and_more_prefill_nodes_drain_it_faster() {
        let c = costs();
        let mut l = load(0.5);
        let none = Model::new(&c, l, 0.9, 2048).predict(&disagg(1, 1));
        l.backlog_tokens = 5000.0; // ~10 s of prefill on one node
        let one = Model::new(&c, l, 0.9, 2048).predict(&disagg(1, 1));
        let two = Model::new(&c, l, 0.9, 2048).predict(&disagg(2, 1));
        assert!(one.ttft > none.ttft + 9.0, "{} vs {}", one.ttft, none.ttft);
        assert!(two.ttft < one.ttft - 4.0);
        assert!(one.ttft_floor > 10.0 && one.ttft_floor <= one.ttft);
    }

    #[test]
    fn decode_batch_follows_littles_law_and_tpot_grows_with_it() {
        let c = costs();
        let m = Model::new(&c, load(2.0), 0.9, 2048);
        let one = m.decode_pool(1, 2.0, 0.0);
        // B = 2 * 100 * (0.020 + 0.001 * (1 + B)) -> B = 4.2 / 0.8 = 5.25
        assert!((one.batch - 5.25).abs() < 0.01, "{}", one.batch);
        let two = m.decode_pool(2, 2.0, 0.0);
        assert!(two.tpot < one.tpot && two.batch < one.batch);
        // Reported sequences in flight are a floor.
        let busy = m.decode_pool(1, 2.0, 40.0);
        assert!(busy.batch >= 40.0 && busy.tpot > 0.020 + 0.040);
        // Saturation: 0.001 * lambda * O >= 1.
        assert!(Model::new(&c, load(10.0), 0.9, 2048).decode_pool(1, 10.0, 0.0).tpot.is_infinite());
    }

    #[test]
    fn colocated_tpot_rises_with_the_step_budget_for_long_prompts() {
        let c = costs();
        // Long prompts, short outputs: one 2000-token step stalls a whole 10-token reply.
        let m = Model::new(&c, shaped(0.1, 2000.0, 10.0), 0.9, 2048);
        let small = m.colocated(1, 64, 0.1, 0.0, 0.0);
        let large = m.colocated(1, 2048, 0.1, 0.0, 0.0);
        assert!(small.tpot < large.tpot, "{} vs {}", small.tpot, large.tpot);
        assert!(small.ttft > large.ttft, "{} vs {}", small.ttft, large.ttft);
    }

    #[test]
    fn a_whole_prompt_budget_batches_the_queue_and_a_remainder_is_one_short_step() {
        let c = costs();
        // 384-token prompts, short replies: a node mostly prefills with no decodes running.
        let m = Model::new(&c, shaped(0.5, 384.0, 8.0), 0.9, 2048).paced(Some(0.1));
        let at = |budget| m.colocated(1, budget, 0.5, 0.0, 0.0);
        let (b128, b256, b512, b2048) = (at(128), at(256), at(512), at(2048));
        // One prompt a step at 512; at 2048 the prompts that queue meanwhile join its step.
        assert!(b2048.ttft > b512.ttft + 0.1, "{b2048:?} vs {b512:?}");
        assert!((b2048.utilisation - b512.utilisation).abs() < 1e-9, "the same steps' time");
        // 384 at 256 is a 256- and a 128-token step: the time of 384 tokens and one more
        // step's fixed cost, as three chunks of 128 less one.
        assert!(b256.utilisation < b128.utilisation && b256.utilisation > b512.utilisation);
        let one = |n: usize| c.prefill_time(n);
        assert!((m.alone_service(384.0, 256.0) - (one(256) + one(128))).abs() < 1e-12);
        assert!((m.alone_service(384.0, 128.0) - 3.0 * one(128)).abs() < 1e-12);
    }

    /// The budgets' ranking on the profile measured on the benchmark machine (BENCHMARKS.md,
    /// "Step budgets by time"), at the shifting load's prefill-heavy phase: 0.6 req/s of
    /// 384-token prompts with 8-token replies on 2 paced colocated nodes, TPOT target 100 ms.
    /// Run with `--nocapture` to see the figures BENCHMARKS.md quotes.
    #[test]
    fn on_the_measured_profile_a_whole_prompt_budget_is_rated_below_chunked_ones() {
        use crate::profiled::{CostModel, HandoffCost};
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/profiles/smollm2-q4_1-quantized-1thread-amd.json");
        let profile: crate::profile::Profile = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let c = CostModel::from_profile(&profile, HandoffCost::default()).unwrap();
        let m = Model::new(&c, Load { horizon_s: 20.0, ..shaped(0.6, 384.0, 8.0) }, 0.9, 2048).paced(Some(0.1));
        let ttft = |budget| {
            let t = m.colocated(2, budget, 0.6, 0.0, 0.0).ttft;
            println!("budget {budget}: p90 TTFT {t:.2} s");
            t
        };
        let (b128, b256, b512, b2048) = (ttft(128), ttft(256), ttft(512), ttft(2048));
        assert!(b2048 > b128 && b128 > b256.max(b512), "{b128} {b256} {b512} {b2048}");
        // 128 pays a few more steps' fixed costs than 256, not a whole extra chunk.
        assert!(b128 - b256 < 0.5, "{b128} vs {b256}");
    }

    #[test]
    fn mixed_and_broken_shapes() {
        let c = costs();
        let m = Model::new(&c, load(1.0), 0.9, 2048);
        assert!(m.predict(&disagg(2, 0)).ttft.is_infinite());
        assert!(m.predict(&PoolTarget::default()).ttft.is_infinite());
        let mixed = m.predict(&PoolTarget { prefill: 1, decode: 1, colocated: 1, step_budget: Some(256) });
        assert!(mixed.ttft.is_finite() && mixed.tpot.is_finite());
    }

    #[test]
    fn the_tpot_correction_scales_only_what_a_prediction_adds_above_a_lone_step() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(correct_above(0.100, 0.060, 2.0), 0.140));
        assert!(close(correct_above(0.100, 0.060, 0.5), 0.080));
        assert!(close(correct_above(0.060, 0.060, 3.0), 0.060), "a lone request stays one lone step");
        assert!(correct_above(f64::INFINITY, 0.060, 2.0).is_infinite());
        let c = costs();
        let r = Model::new(&c, load(0.2), 0.9, 2048).predict(&disagg(1, 1));
        // Context per sequence: 200 prompt + 100 / 2 output tokens.
        assert!(close(r.tpot_floor, c.decode_step_time(1, 250)), "{r:?}");
        let f = Factors { ttft: 1.0, tpot: 2.0 };
        assert!(close(r.corrected(f).tpot, r.tpot_floor + 2.0 * (r.tpot - r.tpot_floor)));
    }

    #[test]
    fn a_burst_that_clears_soon_delays_few_of_the_window_s_arrivals() {
        // 1000 tokens on 500 tok/s with 250 tok/s arriving: the head waits 2 s, clear in 4 s.
        assert_eq!(backlog_wait(1000.0, 500.0, 250.0, 0.0, 0.9), 2.0, "no horizon: the next arrival");
        // Over 30 s of arrivals, 4 s of backlog delays ~13% of them: p90 sees 2 s x (1 - 3/4).
        assert!((backlog_wait(1000.0, 500.0, 250.0, 30.0, 0.9) - 0.5).abs() < 1e-12);
        // Cleared within the 3 s tail: no delay at p90.
        assert_eq!(backlog_wait(500.0, 500.0, 250.0, 30.0, 0.9), 0.0);
        // Not draining: everyone waits at least the head.
        assert_eq!(backlog_wait(1000.0, 500.0, 600.0, 30.0, 0.9), 2.0);
        assert_eq!(backlog_wait(0.0, 500.0, 600.0, 30.0, 0.9), 0.0);
    }
}
