//! The SLO planner: sizes the prefill pool, the decode pool and colocated nodes so that TTFT
//! and TPOT stay inside their targets with the fewest nodes.
//!
//! Sans-IO: observations and time in, decisions out. Allowed dependencies: serde and
//! thiserror only; nothing reads a clock, a socket or a random source, so the coordinator and
//! `cleave bench simulate` run the same code and get the same decisions from the same inputs.
//!
//! ```text
//! on_arrival(Arrival) ──┐                      ┌─▶ Decision { target, actions, reason, why, inputs, predicted }
//! on_completion(..) ────┼─▶ Planner::tick(Snapshot) ──┘     (auto: applied = true; advise: false; off: none)
//! Snapshot (nodes) ─────┘   Planner::estimate(Snapshot) ──▶ Estimate (any mode)
//! ```
//!
//! Modules: [`admission`] (SLO admission's seat caps and prompt rates, which the coordinator
//! routes by and the simulator mirrors), [`config`] (settings, updates, validation), [`costs`] (the step-cost trait and a
//! linear model with calibration), [`profile`] (`cleave bench profile`'s measurements) and
//! [`profiled`] (the model fitted from them, which the simulator runs and the planner predicts
//! with when given a profile), [`types`] (observations and outputs), `window` (sliding
//! windows), `queueing` (Erlang C, Allen–Cunneen, fixed points), `model` (predictions),
//! `search` (candidates and the hysteresis policy), `cluster` (counting nodes, planning
//! actions), `planner` (the state machine).
//!
//! # Why not size pools from service times
//!
//! A planner that sizes pools from profiled service times alone misses queueing (clients wait
//! minutes while the estimate says hundreds of milliseconds), and one that measures demand as
//! completions per second sees a saturated cluster's own capacity and concludes it suffices.
//! Here demand is counted at the edge when requests arrive, TTFT includes queue wait and the
//! work already queued on the nodes, and what clients experienced corrects the model.
//!
//! # Demand (over the sliding `window`)
//!
//! - `lambda` = arrivals in the window / min(window, time since the first observation), that
//!   time taken as at least window / 3 (a rate from a few seconds of arrivals is noise; right
//!   after start-up this under-reads demand, and the backlog term still sees a queue).
//! - `P`, `sigma_P`: mean and standard deviation of prompt tokens of those arrivals.
//! - `O`: expected output tokens: the arrivals' mean `max_tokens` times the share of
//!   `max_tokens` that the window's successful completions used, once there are 10 (else the
//!   share is 1). A share, not the completions' mean, because completions belong to the mix
//!   of a while ago: after a shift from short to long outputs their mean says "short".
//! - A shift: once a whole window was observed, when the recent half of the window holds at
//!   least 4 arrivals and differs from the older half by more than noise (mean prompt or mean
//!   `max_tokens` half again apart, or clearly more arrivals: more than `older + 2 sqrt(older +
//!   1) + 1`), all of the above are taken from the recent half alone (its arrivals over half
//!   the window). A window straddling a shift averages two regimes and describes neither;
//!   seeing the new one half a window sooner is most of the time to recover from it. Fewer
//!   arrivals are not a shift: capacity is added on the recent half's evidence, removed on the
//!   whole window's. Decisions report the span used (`demand_span_s`).
//! - Work on the nodes: queued prompt tokens (`backlog`) and running + waiting sequences on
//!   decoding nodes (`inflight`), from the snapshot; draining nodes are left out.
//! - Costs: the nodes' step timings over the last [`CALIBRATION_WINDOW`] re-level the cost model
//!   ([`Planner::calibrate`]); a window, not the last tick, so that one cold or shared step
//!   does not set it.
//!
//! # Predictions at the target quantile `q` (`z` its normal score)
//!
//! Assumptions: Poisson arrivals (`ca^2 = 1`); the router spreads prompts over a pool as one
//! shared queue (M/G/c); a node runs one prompt's prefill at a time; step costs are
//! non-decreasing in tokens, batch and context; sequences stay resident for their `O` steps.
//!
//! **Prefill pool of `n` nodes.** Service `S(x) = prefill_time(x)`; mean and spread from the
//! two-point rule `E[S] = (S(P - sigma) + S(P + sigma)) / 2`, `cs^2 = ((S(P+sigma) -
//! S(P-sigma)) / 2 / E[S])^2` (exact for a quadratic `S`). Offered load `a = lambda E[S]`,
//! utilisation `rho = a / n` (`>= 1`: unbounded). Queue wait at `q` by Erlang C with the
//! Allen–Cunneen correction: `W_q = ln(C(n, a) / (1 - q)) * (1 + cs^2) / 2 * E[S] / (n - a)`
//! (0 when `C <= 1 - q`). Backlog wait `W_b`: a new arrival would wait `backlog / mu` (`mu =
//! n P / S(P)` tokens/s), the backlog clears after `c = backlog / (mu - lambda P)`, so over the
//! window's arrivals `W_b = backlog / mu * max(0, 1 - (1 - q) window / c)` (a burst that clears
//! within the quantile's tail delays no more than that tail; one that does not clear, all). Then
//! `TTFT = max(W_q, W_b) + S(P + z sigma) + handoff_time(P + z sigma) + first decode step`.
//! The backlog is the very queue the model predicts in steady state, so the two are combined
//! with max, not summed; a backlog larger than the model expects (a burst, demand growing)
//! raises the prediction before clients see it. The handoff counts in latency, not in the
//! node's busy time (layers stream out as they are computed).
//!
//! **Decode pool of `m` nodes.** Continuous batching holds an M/G/inf population per node:
//! `B = (lambda / m) * O * t(1 + B)` with `t(x) = decode_step_time(x, x (P + O/2))` (a member
//! sees itself plus the others), solved as the least fixed point, and at least `inflight / m`
//! (what nodes report now). No fixed point below the KV capacity (`kv_capacity_tokens / (P +
//! O/2)` sequences): unbounded. `TPOT_q = t(1 + B_q)` with `B_q = B + z' sqrt(B) + (z'^2 -
//! 1)/6`, `z' = z sqrt(2/3)`: the Cornish–Fisher upper quantile of a Poisson count, for the
//! batch averaged over one request's life (its TPOT averages its steps; that average's variance
//! is `2B/3` for a population whose members stay one life). The first decode step `t(1 + B)` is
//! part of TTFT.
//!
//! **`k` colocated nodes, step budget `T`.** Each node takes `lambda / k`, and a decoding
//! sequence shares its node with `B` others on average. A prompt finds the node decoding with
//! probability `w = 1 - e^-B` (the decoders are a Poisson population) and is then prefilled
//! beside them in mixed steps of `c` tokens: what `T - (1 + B)` leaves, cut further where the
//! nodes pace to their TPOT (the target, or the tighter `targets.colocated_tpot_ms` colocated
//! nodes are held to; the step a paced node allows its freshest sequence, see
//! `Model::paced_limit`); else in prefill-only steps of up to `T` tokens. Its service `S` blends
//! the two *times* (`S = (1 - w) S_alone + w S_paced`, whole chunks then the remainder's step),
//! and the node prefills `u = (lambda/k) S` of the time (`u >= 1`: unbounded). A decoding
//! sequence meets only the paced steps, a share `v = (lambda/k) S_paced` of its life: it sees
//! `v / t_m + (1 - v) / t_d` steps per second, `TPOT_mean` the inverse, and `B = (lambda/k) O
//! TPOT_mean`. TTFT = max(M/G/1 wait `W` at `q` with utilisation `u` and service `S`, plus the
//! prompts that arrive during `W` and join its step where `T` holds more than one prompt,
//! `(1 - w) min(lambda/k W, floor(T/P) - 1) S_alone`; the backlog wait as above at `P / S`
//! prompt tokens per second) + the service of a prompt of `P + z sigma` tokens + half a decode
//! step. TPOT at `q`: of a sequence's `O` steps, `min(O, n_q ceil(P/c))` are mixed, with `n_q`
//! the quantile of the Poisson count (mean `lambda/k (O TPOT_mean + S_paced)`) of prompts whose
//! prefill overlaps its life, its inverse CDF interpolated between the integers (at the small
//! means that matter most sequences see no prompt at all, which a normal approximation cannot
//! say); the rest are decode steps, both at the quantile batch `B_q`; where nodes pace, no more
//! than the paced step. So a small budget costs TTFT (more, dearer chunks), a large one TTFT
//! too once prompts queue (they share one long step), and unpaced a large one costs TPOT
//! (long mixed steps); loose TPOT targets with short prompts favour colocation (fewer nodes:
//! no separate prefill node), tight ones disaggregation.
//!
//! Mixed configurations (only ever the current one) share demand between their parts in
//! proportion to node counts and report the worse part.
//!
//! **Correction from observation.** Clients' percentiles come from log-bucketed histograms kept in
//! step with the window (1% resolution, O(1) per completion). Once the window holds 10 successful
//! completions that started under the current configuration (and after the last first token of a
//! request that started before it: those that arrived while the old configuration's queue drained
//! waited behind it), `observed quantile / mean raw prediction made for it over the window`, the
//! predictions counted from a whole window of demand on, and only while the model gave a bounded
//! figure for at least three quarters of the window (clamped to [0.5, 4]), feeds an EWMA (time
//! constant window / 3) per metric (for TPOT, of what the prediction adds above a lone decode step:
//! `(observed - lone) / (predicted - lone)`, applied as `lone + factor (predicted - lone)`; the
//! step's own speed is what the cost calibration follows, and a factor learnt at the tail applied
//! to the floor too made a lone request look past a target set near its step), one pair per family
//! (disaggregated pools, colocated nodes: different formulas with different errors; a mixed
//! configuration corrects neither); every candidate's TTFT and TPOT are multiplied by its family's
//! factors, recorded in each decision. A family that clients have not corrected within ten windows
//! is predicted with the current family's TTFT factor where that exceeds 1, else uncorrected (the
//! TPOT formulas of the two families differ in kind, and a split's factor learnt a few
//! milliseconds above a lone step made paced colocated nodes look four times slower): a factor
//! learnt hours ago under another workload, or the other family's, misled more than it helped (a
//! colocated factor at its 0.5 floor from a start-up storm made colocation look twice as good at
//! 07:00 of a simulated day; colocated pessimism carried over to a 1p1d split made it look better
//! than it ran), and an unchecked model must not look better than a checked one only because its
//! errors are unseen. TTFT is never scaled below what the backlog alone implies (the floor `W_b +
//! service`), because the backlog is measured, not modelled: a model that over-predicted in the
//! past must not hide a queue that is building now.
//!
//! # Choosing
//!
//! Candidates are counts, not node subsets: every split `(p, d)` (no colocated node), and when
//! `max_colocated > 0` every `(k, T)` (no disaggregated node), within min/max per pool,
//! `max_nodes`, and the nodes already committed to a pool (starting or switching nodes). When
//! nodes cannot be added the total is the live count. Predictions are monotone in pool sizes,
//! which makes the search O(N log N) (see `search`). With `r` = the worst of
//! prediction/target over TTFT and TPOT and of the busiest pool's utilisation (offered load /
//! capacity: a large pool's queue stays short almost up to saturation, so latency alone would
//! plan it at 99% busy, where a few percent of error in the rate estimate tip it over), `up` =
//! `scale_up_margin`, `down` = `scale_down_margin`:
//!
//! 1. Current configuration outside the limits: the best candidate (below), reason `bounds`.
//! 2. `r(current) <= up`: keep it, unless a configuration with fewer nodes has `r <= down`
//!    (then the one with the fewest nodes, most slack, fewest role changes). No configuration
//!    with fewer nodes is chosen before the planner has observed one full window, nor while
//!    the window's attainment is below `targets.attainment`.
//! 3. `r(current) > up` (risk, or breach): the fewest nodes among candidates that do not add
//!    nodes and reach `r <= down`, else among those adding nodes with `r <= up`; if none
//!    (nothing meets the targets), the candidate predicted to keep the most requests within
//!    both targets (attainment, below), with the fewest nodes that keep as many, adopted only
//!    when it keeps at least 5 points more than the current one; where no candidate is
//!    predicted to keep even 5%, the smallest `r` the budget allows (overloaded ones ranked by
//!    load/capacity), adopted only when `r <= 0.95 r(current)`. So a re-split that is not a last resort must land clearly inside the
//!    targets, a last resort must be predicted better, and the move back needs the reverse
//!    (with the memory of what each configuration was like to run): noise around a threshold
//!    does not flap. No re-split (a move that adds no node) before one window was observed.
//!    A re-split must also hold at the rate one standard error either side of its reading
//!    (`lambda (1 -+ 1/sqrt(n))`, `n` arrivals counted): no worse than staying there, by the
//!    measure it was chosen by; a window's Poisson count is that noisy, and near the rate
//!    where two shapes trade places the noise alone would pick the winner each time. The
//!    memory of a configuration counts under demand within 25% on every mean, or for the rate
//!    within two standard errors of the two readings' difference.
//! 4. A new target must be wanted `confirm_ticks` ticks in a row and not within `cooldown` of
//!    the last decision; a target already decided is not decided again while it stays wanted.
//!    A scale-down (case 2) must moreover be wanted on every tick for a whole window: remove
//!    capacity slowly, add it fast.
//!
//! Ties: most slack, then the current configuration, then fewest role changes.
//!
//! **Predicted attainment** (`Model::attainment`): the share of requests within both targets,
//! `P(TTFT <= target) * P(TPOT <= target)`, each the largest quantile whose corrected
//! prediction stays within its target (bisection over the quantile, under a point of
//! resolution), at the window's demand without the sequences in flight now (one instant of
//! the population the demand implies: two sequences on a decoder whose lone step is at the
//! target read as "nobody meets it", and the choice flapped with every such instant). Where
//! nothing meets the targets at the quantile, p90 ratios cannot rank the candidates: at a 70
//! ms TPOT with a lone decode step of 65 ms, one decoder and two colocated nodes are both past
//! the target at p90, but the colocated pair keeps every request that no prompt lands beside
//! within it, and measured twice the share. Reported in decisions and estimates
//! (`predicted.*.attainment`).
//!
//! # Actions
//!
//! Role switches of the least loaded `Active` nodes first (no new process), then starts and
//! stops for the rest when `can_add_nodes`, and step budgets for colocated nodes whose budget
//! differs; nodes draining, switching or starting are never named (see `cluster`).

pub mod admission;
pub mod config;
pub mod costs;
pub mod error;
pub mod profile;
pub mod profiled;
pub mod types;

mod cluster;
mod model;
mod planner;
mod queueing;
mod search;
mod window;

pub use config::{Limits, LimitsUpdate, Mode, PlannerConfig, PlannerUpdate, Role, Targets, TargetsUpdate};
pub use costs::{Calibration, LinearCosts, StepCosts, StepStats};
pub use error::PlannerError;
pub use model::{MIN_PACED_CHUNK, PACING_MARGIN};
pub use planner::{
    Planner, CALIBRATION_WINDOW, CORRECTION_RANGE, DECISION_LOG, MIN_CORRECTION_SAMPLES, MIN_OUTPUT_SAMPLES,
};
pub use profile::{DecodePoint, MixedPoint, PrefillPoint, Profile, PROFILE_VERSION};
pub use profiled::{CostModel, HandoffCost};
pub use types::{
    Action, Arrival, Completion, ConfigPrediction, Decision, Estimate, Inputs, NodeObs, NodeState, PoolTarget,
    Prediction, Reason, Snapshot,
};
