//! The discrete-event simulator. Pure and deterministic: the same config, cost model and requests
//! always give the same records. Time is `f64` seconds from 0.
//!
//! Rules (what the tests compute by hand):
//! - A prefill node runs a step whenever it has queued prompts: FIFO chunks up to its token
//!   budget, costed by [`CostModel::prefill_step_time`]. A prompt whose last chunk ran is handed
//!   off at the step's end to the decode node with the fewest outstanding requests; the KV lands
//!   `handoff_time(input_len)` later. The first token reaches the client when the decode node
//!   admits the request (a seat and KV reserved): at landing on a node with room (TTFT =
//!   queueing + prefill steps + handoff), else when room frees up.
//! - A decode or colocated node admits waiting requests in FIFO order while a seat
//!   (`max_num_seqs`) and KV (prompt + output reserved) are free: on a handoff's landing and at
//!   each step's start. It runs a step whenever it has admitted work: it plans every running
//!   sequence's decode token first and fills the rest of the token budget with prefill chunks
//!   (vLLM's chunked prefill). The step costs [`CostModel::mixed_step_time`]. At its end every
//!   decode emits a token, and a prompt whose last chunk ran emits its first token (TTFT on a
//!   colocated node: no handoff) and decodes from the next step on. Requests that arrive
//!   mid-step wait for the step's end; requests that arrive at the same instant on an idle node
//!   share its next step.
//! - Conditional disaggregation: a prompt shorter than `local_prefill_below` goes straight to a
//!   decode node and is prefilled there as above.
//! - TPOT = (finish − first token) / (output_len − 1), 0 for one-token outputs.
//! - The edge's own latency (`ClusterConfig::edge_s`) is added to every served request's TTFT
//!   and end-to-end latency; the nodes never see it.
//!
//! # SLO admission (`ClusterConfig::admission`)
//!
//! The coordinator's rules, from the same code ([`cleave_planner::admission`]): every decoding
//! node files its steps' totals as the engine does (a step that decoded, mixed or not, as time
//! its sequences waited; prompt tokens of prefill-only steps as the prompt rate) and "reports"
//! them at its first step end [`REPORT_S`] after the last, when its seat cap and prompt rate
//! are read. Routing then skips a node that holds its cap (its outstanding requests); a
//! request that goes to a prefill node needs a free seat in the pool it will decode in (the
//! caps left over the pool, net of prompts on their way to it: the coordinator books the seat
//! at routing, here the decode node is chosen at handoff, on the same count). A request with no
//! seat waits at the edge, in order, and is retried when a stream ends or a cap is read; once it
//! has waited `max_wait` since it was first told to, it is shed. A request whose prefill (on its
//! prefill node, or where it decodes) would wait behind more prompt work than the node's
//! prompt rate gets through before the TTFT target (counting the time it waited already) is
//! shed at once. A shed request is done at that instant, as a miss (`SimRecord::shed`).
//!
//! Routing keeps each role's active nodes in a `BTreeSet` keyed by load (O(log n)): prefill
//! nodes by queued prompt tokens, decode and colocated nodes by outstanding requests. A request
//! goes to the least-loaded decoding node (decode or colocated; a tie goes to the colocated
//! one): a colocated node serves it whole; a decode node prefills it itself when the prompt is
//! short or no prefill node is active, else the least-loaded prefill node prefills it and the
//! decode node is chosen when its KV leaves (decode nodes first, colocated ones when no decode
//! node is active). A fixed topology has one kind of decoding node, so this is the rule above.
//!
//! # Nodes that change (planner mode, see [`super::planned`])
//!
//! Each node has a role and a life: `Queued` (asked for, no slot in the node budget yet),
//! `Loading` (model load, `start_delay_s`), `Active` (routed), `Switching { to }`, `Stopping`,
//! `Gone`. Only active nodes are routed new work. Like the coordinator's registry, a switch
//! drains only the work the new role does not do: prefill work (prompts queued for handoff, and
//! a colocated node's prompts not yet prefilled) when the new role does not prefill (prefill or
//! colocated to decode), streams (waiting, admitted and landing requests) when it does not
//! decode (decode or colocated to prefill); a switch to colocated drains nothing and takes
//! effect at once. A node that became colocated with prompts still queued for handoff prefills
//! them in its mixed steps and hands them off. A stop drains everything, then frees the node's
//! slot, which a queued start takes. Requests no active node can take wait at the edge (and
//! handoffs with no decoding node wait with their KV) until a node becomes active.
//!
//! Invariants: every request is in exactly one place (the edge, a node's queue, a handoff in
//! flight, or done); nodes holding a machine (loading, active, switching, stopping) never
//! exceed the node budget; a node is in its role's routing set iff it is active.

use cleave_planner::admission::{PromptRate, Seats, StepTotals};
use cleave_planner::Role;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};

use super::cluster::{ClusterConfig, Topology};
use super::cost::CostModel;
use super::workload::SimRequest;
use crate::error::{BenchError, Result};

mod lifecycle;

pub(super) use lifecycle::Dynamics;
pub use lifecycle::{Life, Transition};

/// Shortest step, seconds: keeps time moving if a cost model extrapolates to 0.
const MIN_STEP_S: f64 = 1e-9;
/// Seconds between a node's load reports (the node's `report_interval`): SLO admission reads
/// its step totals no more often.
pub const REPORT_S: f64 = 0.2;

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimRecord {
    /// Index into the input slice.
    pub id: usize,
    pub arrival_s: f64,
    pub input_len: usize,
    pub output_len: usize,
    pub ttft_s: f64,
    pub tpot_s: f64,
    pub e2el_s: f64,
    /// The prefill node (None: prefilled where it decoded).
    pub prefill_node: Option<usize>,
    /// The decode or colocated node (the prefill node for a one-token output, which never
    /// reaches a decode node). Nodes are numbered prefill first, then decode, then in the
    /// order they were started.
    pub decode_node: usize,
    /// SLO admission shed it (a 503 at `arrival_s + ttft_s`, nothing generated): it met no
    /// target, and its latencies are not a served request's.
    #[serde(default)]
    pub shed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrival(usize),
    StepDone(usize),
    HandoffDone(usize),
    /// Start a step on an idle node, after everything else due at the same instant.
    Kick(usize),
    /// A one-token remote request's token reaches the client (planner mode only).
    Finished(usize),
    /// A started node has loaded its model.
    Ready(usize),
    /// The controller's turn (planner mode only).
    Tick,
    /// A request held for a seat has waited as long as SLO admission allows.
    SeatDeadline(usize),
}

struct Timed {
    t: f64,
    seq: u64,
    ev: Event,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    /// Reversed, so that `BinaryHeap` pops the earliest event (ties: the first pushed).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

fn pool_of(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Both => 2,
    }
}

/// Active nodes of one role, ordered by load, then by least recent assignment (round robin
/// among equals), then by id. Invariant: `set` holds `(load, stamp, id)` of exactly the active
/// nodes of the role, with their current load and stamp.
#[derive(Default)]
struct Pool {
    clock: u64,
    set: BTreeSet<(u64, u64, usize)>,
}

impl Pool {
    /// The least-loaded node: `(load, id)`.
    fn first(&self) -> Option<(u64, usize)> {
        self.set.first().map(|&(l, _, i)| (l, i))
    }
}

/// Which load counter an adjustment is to.
#[derive(Clone, Copy, PartialEq)]
enum Counter {
    /// Prompt tokens queued for handoff (a prefill node's routing load).
    Queued,
    /// Requests assigned to decode here and not finished (a decoding node's routing load).
    Outstanding,
}

#[derive(Clone, Copy, PartialEq)]
enum StepKind {
    Prefill,
    Mixed,
}

struct Node {
    role: Role,
    life: Life,
    /// Tokens per step.
    budget: usize,
    busy: bool,
    /// A `Kick` is queued.
    kicked: bool,
    step: StepKind,
    /// Prompts to prefill here and hand off (FIFO).
    remote: VecDeque<usize>,
    /// Not yet admitted (FIFO).
    waiting: VecDeque<usize>,
    /// Admitted with its KV landed, joins `running` at the next step's start.
    ready: Vec<usize>,
    /// Admitted, prompt not fully computed (FIFO).
    prefilling: VecDeque<usize>,
    /// Decoding.
    running: Vec<usize>,
    /// KV tokens reserved by admitted requests.
    reserved: usize,
    /// Σ (input + generated) over `running`.
    context: usize,
    /// Chunks `(request, tokens)` of the step in flight; `running` at its start decodes.
    /// Chunks from `remote_from` on are of `remote` prompts.
    chunks: Vec<(usize, usize)>,
    remote_from: usize,
    decodes: usize,
    /// Handoffs in flight to this node.
    inbound: usize,
    /// Routing loads (see [`Counter`]) and the pool stamp.
    queued: u64,
    outstanding: u64,
    stamp: u64,
    /// Prompt tokens of requests decoding here not yet prefilled.
    unprefilled_local: u64,
    /// When the step in flight started.
    step_started: f64,
    /// SLO admission: the node's cumulative step totals, when they were last read, its seat
    /// cap and prompt rate as read from them.
    totals: StepTotals,
    reported_s: f64,
    seats: Seats,
    prompts: PromptRate,
}

impl Node {
    fn new(role: Role, life: Life, budget: usize) -> Self {
        Self {
            role,
            life,
            budget,
            busy: false,
            kicked: false,
            step: StepKind::Mixed,
            remote: VecDeque::new(),
            waiting: VecDeque::new(),
            ready: Vec::new(),
            prefilling: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            context: 0,
            chunks: Vec::new(),
            remote_from: 0,
            decodes: 0,
            inbound: 0,
            queued: 0,
            outstanding: 0,
            stamp: 0,
            unprefilled_local: 0,
            step_started: 0.0,
            totals: StepTotals::default(),
            reported_s: 0.0,
            seats: Seats::default(),
            prompts: PromptRate::default(),
        }
    }

    fn prefill_work(&self) -> bool {
        !self.remote.is_empty() || self.unprefilled_local > 0
    }

    fn stream_work(&self) -> bool {
        !self.waiting.is_empty()
            || !self.ready.is_empty()
            || !self.prefilling.is_empty()
            || !self.running.is_empty()
            || self.inbound > 0
    }
}

#[derive(Default, Clone, Copy)]
struct ReqState {
    prefilled: usize,
    generated: usize,
    first_token_s: f64,
    finish_s: f64,
    prefill_node: Option<usize>,
    decode_node: usize,
    /// Waiting at the edge (in `Sim::edge`).
    at_edge: bool,
    /// SLO admission: shed, and when it was first told to wait for a seat.
    shed: bool,
    seat_wait_since: Option<f64>,
}

/// Where a request went when routed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Routed {
    Yes,
    /// No active node can take it: it waits at the edge.
    NoNode,
    /// SLO admission: every decoding node holds its seat cap; it waits at the edge.
    NoSeat,
    /// SLO admission: its prefill would start past the TTFT target.
    Shed,
}

/// The simulator's caller in planner mode: it sees arrivals and completions and gets a turn at
/// every `Tick`.
pub(super) trait Control {
    /// A request arrived (before it is routed).
    fn arrival(&mut self, req: &SimRequest, t: f64);
    /// A request's last token reached its client. False stops the run.
    fn completion(&mut self, rec: &SimRecord, t: f64) -> bool;
    /// The controller's turn; returns when its next turn is (`None`: no more).
    fn tick(&mut self, sim: &mut Sim<'_>, t: f64) -> Result<Option<f64>>;
}

pub(super) struct Sim<'a> {
    cfg: &'a ClusterConfig,
    cost: &'a CostModel,
    reqs: &'a [SimRequest],
    state: Vec<ReqState>,
    nodes: Vec<Node>,
    pools: [Pool; 3],
    heap: BinaryHeap<Timed>,
    seq: u64,
    /// Request ids by (arrival, id), and the next to arrive. Arrivals are not kept in the heap
    /// (a day's trace holds millions); they merge with it as if pushed first, in id order
    /// (sequence numbers 1..=n), which is the order the heap would give them.
    arrivals: Vec<usize>,
    next_arrival: usize,
    /// Planner mode: completions are reported, transitions logged, the node budget enforced.
    dynamics: Option<Dynamics>,
    /// Finished since the controller last heard (planner mode).
    completed: Vec<usize>,
    done: usize,
    /// Arrivals no active node could take, in order.
    edge: VecDeque<usize>,
    /// Handoffs with no decoding node to go to: (request, KV ready at).
    parked: VecDeque<(usize, f64)>,
    /// Nodes asked for that wait for a slot, in order.
    queued_starts: VecDeque<usize>,
    holding: usize,
    /// One-token requests whose token is on its way (a `Finished` event queued).
    landing: usize,
    /// Which requests finished (planner mode; a request finishes once).
    finished: Vec<bool>,
    pub(super) peak_holding: usize,
    /// Requests that waited at the edge (arrivals and handoffs).
    pub(super) held_at_edge: usize,
    /// Requests SLO admission shed.
    pub(super) shed: usize,
    /// Prompts routed to a prefill node and not yet handed off (SLO admission counts their
    /// seats as taken in the pool they will decode in).
    pending_remote: u64,
    pub(super) transitions: Vec<Transition>,
    /// The TPOT colocated nodes are held to when their hold is below the target
    /// ([`Sim::set_colocated_hold`]).
    colocated_hold_s: Option<f64>,
}

/// Runs the requests through the cluster and returns one record per request, in input order.
pub fn simulate(cfg: &ClusterConfig, cost: &CostModel, requests: &[SimRequest]) -> Result<Vec<SimRecord>> {
    let mut sim = Sim::new(cfg, cost, requests, None)?;
    sim.run(None)?;
    Ok(sim.records())
}

impl<'a> Sim<'a> {
    /// A cluster of `cfg.topology` with every request's arrival queued. With `dynamics` (planner
    /// mode) completions are reported to the controller and nodes may change.
    pub(super) fn new(
        cfg: &'a ClusterConfig,
        cost: &'a CostModel,
        requests: &'a [SimRequest],
        dynamics: Option<Dynamics>,
    ) -> Result<Self> {
        let l = &cfg.limits;
        if l.max_num_batched_tokens == 0 || l.max_num_seqs == 0 || cfg.topology.nodes() == 0 {
            return Err(BenchError::InvalidArg(format!(
                "cluster {}: limits and node counts must be positive",
                cfg.topology
            )));
        }
        if let Topology::Disaggregated { prefill: 0, .. } | Topology::Disaggregated { decode: 0, .. } = cfg.topology {
            return Err(BenchError::InvalidArg(format!("cluster {}: needs prefill and decode nodes", cfg.topology)));
        }
        for (i, r) in requests.iter().enumerate() {
            if r.input_len == 0 || r.output_len == 0 || !r.arrival_s.is_finite() || r.arrival_s < 0.0 {
                return Err(BenchError::InvalidArg(format!(
                    "request {i}: needs a prompt, an output and a finite arrival ≥ 0 (got {r:?})"
                )));
            }
        }
        let (np, nd, decoder) = match cfg.topology {
            Topology::Disaggregated { prefill, decode } => (prefill, decode, Role::Decode),
            Topology::Colocated { nodes } => (0, nodes, Role::Both),
        };
        if let Some(d) = dynamics {
            if np + nd > d.max_nodes {
                return Err(BenchError::InvalidArg(format!(
                    "initial cluster {} has more than the {} nodes of the budget",
                    cfg.topology, d.max_nodes
                )));
            }
        }
        let budget = l.max_num_batched_tokens;
        let nodes: Vec<Node> = (0..np + nd)
            .map(|i| Node::new(if i < np { Role::Prefill } else { decoder }, Life::Active, budget))
            .collect();
        let mut sim = Sim {
            cfg,
            cost,
            reqs: requests,
            state: vec![ReqState::default(); requests.len()],
            nodes,
            pools: Default::default(),
            heap: BinaryHeap::with_capacity(np + nd),
            seq: requests.len() as u64,
            arrivals: (0..requests.len()).collect(),
            next_arrival: 0,
            dynamics,
            completed: Vec::new(),
            done: 0,
            edge: VecDeque::new(),
            parked: VecDeque::new(),
            queued_starts: VecDeque::new(),
            holding: np + nd,
            landing: 0,
            finished: if dynamics.is_some() { vec![false; requests.len()] } else { Vec::new() },
            peak_holding: np + nd,
            held_at_edge: 0,
            shed: 0,
            pending_remote: 0,
            transitions: Vec::new(),
            colocated_hold_s: None,
        };
        for n in 0..np + nd {
            sim.join(n);
            sim.log(n, 0.0);
        }
        sim.arrivals.sort_by(|&a, &b| requests[a].arrival_s.total_cmp(&requests[b].arrival_s).then(a.cmp(&b)));
        Ok(sim)
    }

    /// Runs events until none is left or the controller stops the run; false when stopped.
    pub(super) fn run(&mut self, mut ctl: Option<&mut dyn Control>) -> Result<bool> {
        while let Some((t, ev)) = self.pop() {
            match ev {
                Event::Arrival(r) => {
                    if let Some(c) = ctl.as_deref_mut() {
                        c.arrival(&self.reqs[r], t);
                    }
                    match self.route(r, t) {
                        Routed::Yes => {}
                        Routed::Shed => self.shed(r, t),
                        wait => {
                            if wait == Routed::NoSeat {
                                self.wait_for_seat(r, t);
                            }
                            self.state[r].at_edge = true;
                            self.edge.push_back(r);
                            self.held_at_edge += 1;
                        }
                    }
                }
                Event::SeatDeadline(r) => {
                    if self.state[r].at_edge {
                        if let Some(i) = self.edge.iter().position(|&x| x == r) {
                            self.edge.remove(i);
                        }
                        self.state[r].at_edge = false;
                        self.shed(r, t);
                        // It may have held up the requests behind it.
                        self.flush(t);
                    }
                }
                Event::StepDone(n) => self.step_done(n, t),
                Event::HandoffDone(r) => {
                    let node = self.state[r].decode_node;
                    self.nodes[node].inbound -= 1;
                    self.nodes[node].waiting.push_back(r);
                    self.admit(node, t);
                    self.kick(node, t);
                }
                Event::Kick(n) => {
                    self.nodes[n].kicked = false;
                    self.try_start(n, t);
                }
                Event::Finished(r) => {
                    self.landing -= 1;
                    self.finish(r);
                }
                Event::Ready(n) => {
                    self.nodes[n].life = Life::Active;
                    self.activate(n, t);
                }
                Event::Tick => {
                    if let Some(c) = ctl.as_deref_mut() {
                        if let Some(next) = c.tick(self, t)? {
                            self.push(next, Event::Tick);
                        }
                    }
                }
            }
            if !self.completed.is_empty() {
                let done = std::mem::take(&mut self.completed);
                if let Some(c) = ctl.as_deref_mut() {
                    for &r in &done {
                        if !c.completion(&self.record(r), t) {
                            return Ok(false);
                        }
                    }
                }
                self.completed = done;
                self.completed.clear();
            }
        }
        Ok(true)
    }

    /// Requests not finished yet (planner mode).
    pub(super) fn unfinished(&self) -> usize {
        self.reqs.len() - self.done
    }

    pub(super) fn push_tick(&mut self, t: f64) {
        self.push(t, Event::Tick);
    }

    /// The earliest event: the heap's or the next arrival (sequence number id + 1).
    fn pop(&mut self) -> Option<(f64, Event)> {
        let arrival = self.arrivals.get(self.next_arrival).map(|&i| (self.reqs[i].arrival_s, i as u64 + 1, i));
        match (arrival, self.heap.peek()) {
            (Some((t, seq, _)), Some(top)) if top.t.total_cmp(&t).then(top.seq.cmp(&seq)) == Ordering::Less => {
                self.heap.pop().map(|e| (e.t, e.ev))
            }
            (Some((t, _, i)), _) => {
                self.next_arrival += 1;
                Some((t, Event::Arrival(i)))
            }
            (None, _) => self.heap.pop().map(|e| (e.t, e.ev)),
        }
    }

    fn push(&mut self, t: f64, ev: Event) {
        self.seq += 1;
        self.heap.push(Timed { t, seq: self.seq, ev });
    }

    fn finish(&mut self, r: usize) {
        if self.dynamics.is_some() {
            debug_assert!(!self.finished[r], "request {r} finished twice");
            self.finished[r] = true;
            self.completed.push(r);
            self.done += 1;
        }
    }

    fn log(&mut self, n: usize, t: f64) {
        if self.dynamics.is_some() {
            let node = &self.nodes[n];
            self.transitions.push(Transition { t, node: n, life: node.life, role: node.role });
        }
    }

    // ---- routing ----

    fn join(&mut self, n: usize) {
        let node = &self.nodes[n];
        let load = if node.role == Role::Prefill { node.queued } else { node.outstanding };
        self.pools[pool_of(node.role)].set.insert((load, node.stamp, n));
    }

    fn leave(&mut self, n: usize) {
        let node = &self.nodes[n];
        let load = if node.role == Role::Prefill { node.queued } else { node.outstanding };
        self.pools[pool_of(node.role)].set.remove(&(load, node.stamp, n));
    }

    /// Adds `delta` to one of a node's loads, re-keying it in its pool when the pool orders by
    /// that load; `assigned` marks it as the pool's most recently chosen.
    fn adjust(&mut self, n: usize, counter: Counter, delta: i64, assigned: bool) {
        let node = &self.nodes[n];
        let keyed = node.life == Life::Active && (counter == Counter::Queued) == (node.role == Role::Prefill);
        if keyed {
            self.leave(n);
        }
        let pool = &mut self.pools[pool_of(self.nodes[n].role)];
        let node = &mut self.nodes[n];
        let c = match counter {
            Counter::Queued => &mut node.queued,
            Counter::Outstanding => &mut node.outstanding,
        };
        *c = c.saturating_add_signed(delta);
        if assigned && keyed {
            pool.clock += 1;
            node.stamp = pool.clock;
        }
        if keyed {
            self.join(n);
        }
    }

    /// Whether SLO admission keeps node `n` from taking a new stream (it holds its seat cap).
    fn full(&self, n: usize) -> bool {
        self.cfg.admission.is_some()
            && self.nodes[n].seats.is_full(u32::try_from(self.nodes[n].outstanding).unwrap_or(u32::MAX))
    }

    /// The least-loaded node of decoding pool `i` that has a seat (under SLO admission).
    fn seated(&self, i: usize) -> Option<(u64, usize)> {
        if self.cfg.admission.is_none() {
            return self.pools[i].first();
        }
        self.pools[i].set.iter().map(|&(l, _, n)| (l, n)).find(|&(_, n)| !self.full(n))
    }

    /// SLO admission: whether the pool a handoff decodes in has a seat left for one more
    /// prompt, counting those on their way to it. True when no decoding node is active (the
    /// handoff will wait for one, as without admission).
    fn remote_seat(&self) -> bool {
        if self.cfg.admission.is_none() {
            return true;
        }
        let pool = if self.pools[1].set.is_empty() { &self.pools[2] } else { &self.pools[1] };
        if pool.set.is_empty() {
            return true;
        }
        let mut free = 0u64;
        for &(load, _, n) in &pool.set {
            match self.nodes[n].seats.cap() {
                None => return true,
                Some(c) => free += u64::from(c).saturating_sub(load),
            }
        }
        free > self.pending_remote
    }

    /// SLO admission's TTFT half: whether request `r`'s prefill on node `n` would start past
    /// the TTFT target (its wait so far, plus the prompt work queued there and its own, at the
    /// node's prompt rate once one was read).
    fn past_ttft(&self, r: usize, n: usize, t: f64) -> bool {
        let (Some(a), Some(rate)) = (self.cfg.admission, self.nodes[n].prompts.tokens_per_s()) else {
            return false;
        };
        let node = &self.nodes[n];
        let queued = node.queued + node.unprefilled_local + self.reqs[r].input_len as u64;
        (t - self.reqs[r].arrival_s) + queued as f64 / rate > a.ttft_target.as_secs_f64()
    }

    /// Sends an arrival to a node (see [`Routed`]).
    fn route(&mut self, r: usize, t: f64) -> Routed {
        let len = self.reqs[r].input_len;
        let local = len < self.cfg.local_prefill_below;
        let decoder = match (self.seated(1), self.seated(2)) {
            (Some(d), Some(b)) => Some(if b.0 <= d.0 { b.1 } else { d.1 }),
            (d, b) => d.or(b).map(|x| x.1),
        };
        let prefill = self.pools[0].first().map(|x| x.1);
        let local_on = decoder.filter(|&n| self.nodes[n].role == Role::Both || local || prefill.is_none());
        let any_decoder = !self.pools[1].set.is_empty() || !self.pools[2].set.is_empty();
        match (local_on, prefill) {
            (Some(n), _) => {
                if self.past_ttft(r, n, t) {
                    return Routed::Shed;
                }
                self.adjust(n, Counter::Outstanding, 1, true);
                self.state[r].decode_node = n;
                self.nodes[n].unprefilled_local += len as u64;
                self.nodes[n].waiting.push_back(r);
                self.kick(n, t);
            }
            (None, Some(p)) => {
                // Every decoding node holds its cap (the coordinator books a decode seat for
                // every request, prefilled where it may be), or the pool's seats are all
                // promised to prompts on their way.
                if (any_decoder && decoder.is_none()) || !self.remote_seat() {
                    return Routed::NoSeat;
                }
                if self.past_ttft(r, p, t) {
                    return Routed::Shed;
                }
                self.adjust(p, Counter::Queued, len as i64, true);
                self.state[r].prefill_node = Some(p);
                self.nodes[p].remote.push_back(r);
                if self.cfg.admission.is_some() {
                    self.pending_remote += 1;
                }
                self.kick(p, t);
            }
            (None, None) if any_decoder => return Routed::NoSeat,
            (None, None) => return Routed::NoNode,
        }
        Routed::Yes
    }

    /// SLO admission: request `r` waits for a seat, at most `max_wait` from the first time.
    fn wait_for_seat(&mut self, r: usize, t: f64) {
        let Some(a) = self.cfg.admission else { return };
        if self.state[r].seat_wait_since.is_none() {
            self.state[r].seat_wait_since = Some(t);
            self.push(t + a.max_wait.as_secs_f64().min(1e12), Event::SeatDeadline(r));
        }
    }

    /// SLO admission sheds request `r` at `t`: a miss, done now.
    fn shed(&mut self, r: usize, t: f64) {
        let s = &mut self.state[r];
        s.shed = true;
        s.first_token_s = t;
        s.finish_s = t;
        self.shed += 1;
        self.finish(r);
    }

    /// Where a prefilled request decodes: decode nodes first, then colocated ones (under SLO
    /// admission one with a seat first).
    fn handoff_target(&self) -> Option<usize> {
        self.seated(1).or(self.seated(2)).or(self.pools[1].first()).or(self.pools[2].first()).map(|x| x.1)
    }

    fn send_handoff(&mut self, r: usize, d: usize, land: f64) {
        self.adjust(d, Counter::Outstanding, 1, true);
        self.state[r].decode_node = d;
        self.nodes[d].inbound += 1;
        self.push(land, Event::HandoffDone(r));
    }

    /// A remote prompt's last chunk ran on node `n` at `t`: its KV leaves for a decoding node.
    fn hand_off(&mut self, r: usize, n: usize, t: f64) {
        self.state[r].generated = 1;
        if self.cfg.admission.is_some() {
            self.pending_remote -= 1;
        }
        let land = t + self.cost.handoff_time(self.reqs[r].input_len);
        if self.reqs[r].output_len == 1 {
            self.state[r].first_token_s = land;
            self.state[r].finish_s = land;
            self.state[r].decode_node = n;
            if self.dynamics.is_some() {
                self.landing += 1;
                self.push(land, Event::Finished(r));
            }
        } else {
            match self.handoff_target() {
                Some(d) => self.send_handoff(r, d, land),
                None => {
                    self.parked.push_back((r, land));
                    self.held_at_edge += 1;
                }
            }
        }
    }

    /// Work that waited for an active node goes out now.
    fn flush(&mut self, t: f64) {
        while let Some(&(r, land)) = self.parked.front() {
            let Some(d) = self.handoff_target() else { break };
            self.parked.pop_front();
            self.send_handoff(r, d, land.max(t));
        }
        while let Some(&r) = self.edge.front() {
            match self.route(r, t) {
                Routed::Yes => {}
                Routed::Shed => self.shed(r, t),
                Routed::NoSeat => {
                    self.wait_for_seat(r, t);
                    break;
                }
                Routed::NoNode => break,
            }
            self.edge.pop_front();
            self.state[r].at_edge = false;
        }
    }

    // ---- steps ----

    /// Schedules a step start on an idle node once every event due now has run, so that requests
    /// arriving at the same instant share the step.
    fn kick(&mut self, n: usize, now: f64) {
        if !self.nodes[n].busy && !self.nodes[n].kicked {
            self.nodes[n].kicked = true;
            self.push(now, Event::Kick(n));
        }
    }

    fn try_start(&mut self, n: usize, now: f64) {
        let node = &self.nodes[n];
        if node.busy || matches!(node.life, Life::Queued | Life::Loading | Life::Gone) {
            return;
        }
        let (kind, dur) = if node.role == Role::Prefill {
            (StepKind::Prefill, self.plan_prefill(n))
        } else {
            (StepKind::Mixed, self.plan_mixed(n, now))
        };
        if let Some(d) = dur {
            self.nodes[n].busy = true;
            self.nodes[n].step = kind;
            self.nodes[n].step_started = now;
            self.push(now + d.max(MIN_STEP_S), Event::StepDone(n));
        }
    }

    /// FIFO chunks from the queue up to the token budget; None when idle.
    fn plan_prefill(&mut self, n: usize) -> Option<f64> {
        let node = &mut self.nodes[n];
        let budget = node.budget;
        node.chunks.clear();
        let mut used = 0;
        for &r in &node.remote {
            if used == budget {
                break;
            }
            let left = self.reqs[r].input_len - self.state[r].prefilled;
            let take = left.min(budget - used);
            node.chunks.push((r, take));
            used += take;
        }
        if node.chunks.is_empty() {
            return None;
        }
        let st = &self.state;
        Some(self.cost.prefill_step_time(node.chunks.iter().map(|&(r, k)| (k, st[r].prefilled))))
    }

    /// Admits waiting requests in FIFO order while a seat and KV are free (an empty node admits
    /// its head regardless of KV). A request that arrives prefilled (a handoff) gets its first
    /// token now, and joins `running` at the next step's start.
    fn admit(&mut self, n: usize, now: f64) {
        let l = self.cfg.limits;
        let node = &mut self.nodes[n];
        while let Some(&r) = node.waiting.front() {
            let admitted = node.prefilling.len() + node.running.len() + node.ready.len();
            let need = self.reqs[r].input_len + self.reqs[r].output_len;
            let fits = node.reserved.saturating_add(need) <= l.kv_capacity_tokens;
            if admitted >= l.max_num_seqs || (!fits && admitted > 0) {
                break;
            }
            node.waiting.pop_front();
            node.reserved += need;
            if self.state[r].prefilled < self.reqs[r].input_len {
                node.prefilling.push_back(r);
            } else {
                self.state[r].first_token_s = now;
                node.ready.push(r);
            }
        }
    }

    /// Admission, then decodes first and prefill chunks (its own prompts, then any queued for
    /// handoff) in the remaining budget; None when idle.
    fn plan_mixed(&mut self, n: usize, now: f64) -> Option<f64> {
        self.admit(n, now);
        let paced = self.cfg.pacing_tpot_s.map(|t| self.held_tpot(n, t));
        let node = &mut self.nodes[n];
        for r in node.ready.drain(..) {
            node.context += self.reqs[r].input_len + self.state[r].generated;
            node.running.push(r);
        }
        node.decodes = node.running.len();
        node.chunks.clear();
        let mut budget = node.budget.saturating_sub(node.decodes);
        if let Some(tpot) = paced {
            let waiting = !node.prefilling.is_empty() || !node.remote.is_empty();
            if node.decodes > 0 && waiting {
                budget = self.paced_budget(n, tpot, budget, now);
            }
        }
        let node = &mut self.nodes[n];
        for &r in node.prefilling.iter() {
            if budget == 0 {
                break;
            }
            let take = (self.reqs[r].input_len - self.state[r].prefilled).min(budget);
            node.chunks.push((r, take));
            budget -= take;
        }
        node.remote_from = node.chunks.len();
        for &r in node.remote.iter() {
            if budget == 0 {
                break;
            }
            let take = (self.reqs[r].input_len - self.state[r].prefilled).min(budget);
            node.chunks.push((r, take));
            budget -= take;
        }
        if node.decodes == 0 && node.chunks.is_empty() {
            return None;
        }
        let st = &self.state;
        Some(self.cost.mixed_step_time(
            node.chunks.iter().map(|&(r, k)| (k, st[r].prefilled)),
            node.decodes,
            node.context,
        ))
    }

    /// The TPOT node `n` is held to where the cluster's target is `target_s`: a colocated
    /// node's hold (`targets.colocated_tpot_ms`, from the planner) when below it.
    fn held_tpot(&self, n: usize, target_s: f64) -> f64 {
        match self.colocated_hold_s {
            Some(h) if self.nodes[n].role == Role::Both => h.min(target_s),
            _ => target_s,
        }
    }

    /// Prompt tokens node `n`'s next step may carry beside its decodes when it paces to `tpot`
    /// (the engine's rule, `cleave_engine::sched::pacing`): each decoding sequence may see the
    /// step last `margin * tpot * generated - (now - first token)` (its mean within the target
    /// were it to end after this step); the largest chunk whose step fits the least of those,
    /// at least the floor. The engine measures its costs; here they are the cost model's.
    fn paced_budget(&self, n: usize, tpot: f64, budget: usize, now: f64) -> usize {
        use cleave_planner::{MIN_PACED_CHUNK, PACING_MARGIN};
        let node = &self.nodes[n];
        let allowance = node.running[..node.decodes]
            .iter()
            .map(|&r| PACING_MARGIN * tpot * self.state[r].generated as f64 - (now - self.state[r].first_token_s))
            .fold(f64::INFINITY, f64::min);
        let step = |c: usize| self.cost.mixed_step_time([(c, 0)], node.decodes, node.context);
        let floor = (MIN_PACED_CHUNK as usize).min(budget);
        if budget <= floor || step(budget) <= allowance {
            return budget;
        }
        if step(floor) > allowance {
            return floor;
        }
        let (mut lo, mut hi) = (floor, budget);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if step(mid) <= allowance {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn step_done(&mut self, n: usize, t: f64) {
        self.nodes[n].busy = false;
        if self.cfg.admission.is_some() {
            self.file_step(n, t);
        }
        let ended = match self.nodes[n].step {
            StepKind::Prefill => {
                self.prefill_done(n, t);
                false
            }
            StepKind::Mixed => self.mixed_done(n, t),
        };
        if self.nodes[n].life != Life::Active {
            self.check_drain(n, t);
        }
        if self.cfg.admission.is_some() {
            let read = self.report(n, t);
            if (ended || read) && !self.edge.is_empty() {
                // A seat freed, or a cap was read: the requests waiting for one try again (and
                // may join this node's next step).
                self.flush(t);
            }
        }
        self.try_start(n, t);
    }

    /// Files the step just ended in node `n`'s totals as the engine does: a step that decoded
    /// (a chunk beside or not) as time its sequences waited, a prompt-only step as prompt rate.
    fn file_step(&mut self, n: usize, t: f64) {
        let node = &mut self.nodes[n];
        let us = ((t - node.step_started).max(0.0) * 1e6) as u64;
        let decodes = if node.step == StepKind::Mixed { node.decodes as u64 } else { 0 };
        let tokens: u64 = node.chunks.iter().map(|&(_, k)| k as u64).sum();
        let tot = &mut node.totals;
        if decodes > 0 {
            tot.decode_steps += 1;
            tot.decode_seqs += decodes;
            tot.decode_us += us;
        } else if tokens > 0 {
            tot.prefill_tokens += tokens;
            tot.prefill_us += us;
        }
    }

    /// Node `n` "reports" its totals if [`REPORT_S`] passed since its last report; true when
    /// it did.
    fn report(&mut self, n: usize, t: f64) -> bool {
        let Some(a) = self.cfg.admission else { return false };
        let a = match self.colocated_hold_s.and_then(|h| std::time::Duration::try_from_secs_f64(h).ok()) {
            Some(h) => a.holding_colocated(h),
            None => a,
        };
        let target = a.tpot_target_for(self.nodes[n].role == Role::Both);
        let node = &mut self.nodes[n];
        if t - node.reported_s < REPORT_S {
            return false;
        }
        node.reported_s = t;
        node.seats.observe(&node.totals, target);
        node.prompts.observe(&node.totals);
        true
    }

    fn prefill_done(&mut self, n: usize, t: f64) {
        let chunks = std::mem::take(&mut self.nodes[n].chunks);
        self.remote_chunks_done(n, &chunks, t);
        self.nodes[n].chunks = chunks;
    }

    /// Chunks of prompts queued for handoff ran on node `n`.
    fn remote_chunks_done(&mut self, n: usize, chunks: &[(usize, usize)], t: f64) {
        for &(r, k) in chunks {
            self.state[r].prefilled += k;
            self.adjust(n, Counter::Queued, -(k as i64), false);
            if self.state[r].prefilled == self.reqs[r].input_len {
                // Completed chunks are always a prefix of the FIFO queue.
                self.nodes[n].remote.pop_front();
                self.hand_off(r, n, t);
            }
        }
    }

    /// The mixed step on node `n` ended; true when a stream finished on it.
    fn mixed_done(&mut self, n: usize, t: f64) -> bool {
        let mut finished = Vec::new();
        let remote;
        {
            let node = &mut self.nodes[n];
            for &r in &node.running[..node.decodes] {
                let s = &mut self.state[r];
                s.generated += 1;
                node.context += 1;
                if s.generated == self.reqs[r].output_len {
                    s.finish_s = t;
                    finished.push(r);
                }
            }
            for &(r, k) in &node.chunks[..node.remote_from] {
                let s = &mut self.state[r];
                s.prefilled += k;
                node.unprefilled_local -= k as u64;
                if s.prefilled == self.reqs[r].input_len {
                    node.prefilling.pop_front();
                    s.generated = 1;
                    s.first_token_s = t;
                    node.context += self.reqs[r].input_len + 1;
                    node.running.push(r);
                    if self.reqs[r].output_len == 1 {
                        s.finish_s = t;
                        finished.push(r);
                    }
                }
            }
            remote = node.remote_from < node.chunks.len();
        }
        if remote {
            let chunks = std::mem::take(&mut self.nodes[n].chunks);
            let from = self.nodes[n].remote_from;
            self.remote_chunks_done(n, &chunks[from..], t);
            self.nodes[n].chunks = chunks;
        }
        if finished.is_empty() {
            return false;
        }
        let node = &mut self.nodes[n];
        for &r in &finished {
            node.reserved -= self.reqs[r].input_len + self.reqs[r].output_len;
            node.context -= self.reqs[r].input_len + self.state[r].generated;
        }
        let reqs = self.reqs;
        let state = &self.state;
        node.running.retain(|&r| state[r].generated < reqs[r].output_len);
        for &r in &finished {
            self.adjust(n, Counter::Outstanding, -1, false);
            self.finish(r);
        }
        true
    }

    // ---- results ----

    fn record(&self, id: usize) -> SimRecord {
        let (r, s) = (&self.reqs[id], &self.state[id]);
        let tpot_s =
            if r.output_len > 1 && !s.shed { (s.finish_s - s.first_token_s) / (r.output_len - 1) as f64 } else { 0.0 };
        // A shed request's answer is the edge's own 503: no trip through the nodes.
        let edge = if s.shed { 0.0 } else { self.cfg.edge_s };
        SimRecord {
            id,
            arrival_s: r.arrival_s,
            input_len: r.input_len,
            output_len: r.output_len,
            ttft_s: s.first_token_s - r.arrival_s + edge,
            tpot_s,
            e2el_s: s.finish_s - r.arrival_s + edge,
            prefill_node: s.prefill_node,
            decode_node: s.decode_node,
            shed: s.shed,
        }
    }

    pub(super) fn records(&self) -> Vec<SimRecord> {
        (0..self.reqs.len()).map(|i| self.record(i)).collect()
    }
}
