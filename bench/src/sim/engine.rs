//! The discrete-event simulator. Pure and deterministic: the same config, cost model and requests
//! always give the same records. Time is `f64` seconds from 0.
//!
//! Rules (what the tests compute by hand):
//! - A prefill node runs a step whenever it has queued prompts: FIFO chunks up to
//!   `max_num_batched_tokens` tokens, costed by [`CostModel::prefill_step_time`]. A prompt whose
//!   last chunk ran is handed off at the step's end to the decode node with the fewest
//!   outstanding requests; the KV lands `handoff_time(input_len)` later. The first token reaches
//!   the client when the decode node admits the request (a seat and KV reserved): at landing on
//!   a node with room (TTFT = queueing + prefill steps + handoff), else when room frees up.
//! - A decode or colocated node admits waiting requests in FIFO order while a seat
//!   (`max_num_seqs`) and KV (prompt + output reserved) are free: on a handoff's landing and at
//!   each step's start. It runs a step whenever it has admitted work: it plans every running sequence's decode token first and fills the
//!   rest of the token budget with prefill chunks (vLLM's chunked prefill). The step costs
//!   [`CostModel::mixed_step_time`]. At its end every decode emits a token, and a prompt whose
//!   last chunk ran emits its first token (TTFT on a colocated node: no handoff) and decodes from
//!   the next step on. Requests that arrive mid-step wait for the step's end; requests that
//!   arrive at the same instant on an idle node share its next step.
//! - Conditional disaggregation: a prompt shorter than `local_prefill_below` goes straight to a
//!   decode node and is prefilled there as above.
//! - TPOT = (finish − first token) / (output_len − 1), 0 for one-token outputs.
//!
//! Routing keeps each pool's nodes in a `BTreeSet` keyed by load (O(log n)): prefill nodes by
//! queued prompt tokens, decode and colocated nodes by outstanding requests.

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};

use serde::{Deserialize, Serialize};

use super::cluster::{ClusterConfig, Topology};
use super::cost::CostModel;
use super::workload::SimRequest;
use crate::error::{BenchError, Result};

/// Shortest step, seconds: keeps time moving if a cost model extrapolates to 0.
const MIN_STEP_S: f64 = 1e-9;

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
    /// reaches a decode node). Nodes are numbered prefill first, then decode.
    pub decode_node: usize,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrival(usize),
    StepDone(usize),
    HandoffDone(usize),
    /// Start a step on an idle node, after everything else due at the same instant.
    Kick(usize),
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

/// Nodes of one role, ordered by load, then by least recent assignment (round robin among
/// equals). Invariant: `set` holds `(load[i], stamp[i], i)` for every node.
struct Pool {
    first: usize,
    load: Vec<u64>,
    stamp: Vec<u64>,
    clock: u64,
    set: BTreeSet<(u64, u64, usize)>,
}

impl Pool {
    fn new(first: usize, n: usize) -> Self {
        Self { first, load: vec![0; n], stamp: vec![0; n], clock: 0, set: (0..n).map(|i| (0, 0, i)).collect() }
    }
    /// The least-loaded node's global id.
    fn pick(&self) -> usize {
        self.first + self.set.first().map_or(0, |&(_, _, i)| i)
    }
    /// Adds `delta` to a node's load; `assigned` marks it as the most recently chosen.
    fn adjust(&mut self, node: usize, delta: i64, assigned: bool) {
        let i = node - self.first;
        self.set.remove(&(self.load[i], self.stamp[i], i));
        self.load[i] = self.load[i].saturating_add_signed(delta);
        if assigned {
            self.clock += 1;
            self.stamp[i] = self.clock;
        }
        self.set.insert((self.load[i], self.stamp[i], i));
    }
}

#[derive(Default)]
struct Node {
    /// Prefill-only node (hands off) or decode/colocated (keeps decoding).
    prefill_only: bool,
    busy: bool,
    /// A `Kick` is queued.
    kicked: bool,
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
    chunks: Vec<(usize, usize)>,
    decodes: usize,
}

#[derive(Default, Clone, Copy)]
struct ReqState {
    prefilled: usize,
    generated: usize,
    first_token_s: f64,
    finish_s: f64,
    prefill_node: Option<usize>,
    decode_node: usize,
}

struct Sim<'a> {
    cfg: &'a ClusterConfig,
    cost: &'a CostModel,
    reqs: &'a [SimRequest],
    state: Vec<ReqState>,
    nodes: Vec<Node>,
    prefill_pool: Option<Pool>,
    decode_pool: Pool,
    heap: BinaryHeap<Timed>,
    seq: u64,
}

/// Runs the requests through the cluster and returns one record per request, in input order.
pub fn simulate(cfg: &ClusterConfig, cost: &CostModel, requests: &[SimRequest]) -> Result<Vec<SimRecord>> {
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
    let (np, nd) = match cfg.topology {
        Topology::Disaggregated { prefill, decode } => (prefill, decode),
        Topology::Colocated { nodes } => (0, nodes),
    };
    let mut nodes: Vec<Node> = (0..np + nd).map(|_| Node::default()).collect();
    for n in &mut nodes[..np] {
        n.prefill_only = true;
    }
    let mut sim = Sim {
        cfg,
        cost,
        reqs: requests,
        state: vec![ReqState::default(); requests.len()],
        nodes,
        prefill_pool: (np > 0).then(|| Pool::new(0, np)),
        decode_pool: Pool::new(np, nd),
        heap: BinaryHeap::with_capacity(requests.len() + np + nd),
        seq: 0,
    };
    for (i, r) in requests.iter().enumerate() {
        sim.push(r.arrival_s, Event::Arrival(i));
    }
    while let Some(Timed { t, ev, .. }) = sim.heap.pop() {
        match ev {
            Event::Arrival(r) => sim.arrive(r, t),
            Event::StepDone(n) => sim.step_done(n, t),
            Event::HandoffDone(r) => {
                let node = sim.state[r].decode_node;
                sim.nodes[node].waiting.push_back(r);
                sim.admit(node, t);
                sim.kick(node, t);
            }
            Event::Kick(n) => {
                sim.nodes[n].kicked = false;
                sim.try_start(n, t);
            }
        }
    }
    Ok(sim.records())
}

impl Sim<'_> {
    fn push(&mut self, t: f64, ev: Event) {
        self.seq += 1;
        self.heap.push(Timed { t, seq: self.seq, ev });
    }

    fn arrive(&mut self, r: usize, t: f64) {
        let len = self.reqs[r].input_len;
        let local = len < self.cfg.local_prefill_below;
        match self.prefill_pool.as_mut() {
            Some(pool) if !local => {
                let node = pool.pick();
                pool.adjust(node, len as i64, true);
                self.state[r].prefill_node = Some(node);
                self.nodes[node].waiting.push_back(r);
                self.kick(node, t);
            }
            _ => {
                let node = self.assign_decode(r);
                self.nodes[node].waiting.push_back(r);
                self.kick(node, t);
            }
        }
    }

    fn assign_decode(&mut self, r: usize) -> usize {
        let node = self.decode_pool.pick();
        self.decode_pool.adjust(node, 1, true);
        self.state[r].decode_node = node;
        node
    }

    /// Schedules a step start on an idle node once every event due now has run, so that requests
    /// arriving at the same instant share the step.
    fn kick(&mut self, n: usize, now: f64) {
        if !self.nodes[n].busy && !self.nodes[n].kicked {
            self.nodes[n].kicked = true;
            self.push(now, Event::Kick(n));
        }
    }

    fn try_start(&mut self, n: usize, now: f64) {
        if self.nodes[n].busy {
            return;
        }
        let dur = if self.nodes[n].prefill_only { self.plan_prefill(n) } else { self.plan_mixed(n, now) };
        if let Some(d) = dur {
            self.nodes[n].busy = true;
            self.push(now + d.max(MIN_STEP_S), Event::StepDone(n));
        }
    }

    /// FIFO chunks from the queue up to the token budget; None when idle.
    fn plan_prefill(&mut self, n: usize) -> Option<f64> {
        let budget = self.cfg.limits.max_num_batched_tokens;
        let node = &mut self.nodes[n];
        node.chunks.clear();
        let mut used = 0;
        for &r in &node.waiting {
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

    /// Admission, then decodes first and prefill chunks in the remaining budget; None when idle.
    fn plan_mixed(&mut self, n: usize, now: f64) -> Option<f64> {
        self.admit(n, now);
        let l = self.cfg.limits;
        let node = &mut self.nodes[n];
        for r in node.ready.drain(..) {
            node.context += self.reqs[r].input_len + self.state[r].generated;
            node.running.push(r);
        }
        node.decodes = node.running.len();
        node.chunks.clear();
        let mut budget = l.max_num_batched_tokens.saturating_sub(node.decodes);
        for &r in &node.prefilling {
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

    fn step_done(&mut self, n: usize, t: f64) {
        self.nodes[n].busy = false;
        if self.nodes[n].prefill_only {
            self.prefill_done(n, t);
        } else {
            self.mixed_done(n, t);
        }
        self.try_start(n, t);
    }

    fn prefill_done(&mut self, n: usize, t: f64) {
        let chunks = std::mem::take(&mut self.nodes[n].chunks);
        for &(r, k) in &chunks {
            self.state[r].prefilled += k;
            if let Some(pool) = self.prefill_pool.as_mut() {
                pool.adjust(n, -(k as i64), false);
            }
            if self.state[r].prefilled == self.reqs[r].input_len {
                // Completed chunks are always a prefix of the FIFO queue.
                self.nodes[n].waiting.pop_front();
                self.state[r].generated = 1;
                let land = t + self.cost.handoff_time(self.reqs[r].input_len);
                if self.reqs[r].output_len == 1 {
                    self.state[r].first_token_s = land;
                    self.state[r].finish_s = land;
                    self.state[r].decode_node = n;
                } else {
                    self.assign_decode(r);
                    self.push(land, Event::HandoffDone(r));
                }
            }
        }
        self.nodes[n].chunks = chunks;
    }

    fn mixed_done(&mut self, n: usize, t: f64) {
        let mut finished = Vec::new();
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
            for &(r, k) in &node.chunks {
                let s = &mut self.state[r];
                s.prefilled += k;
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
        }
        if finished.is_empty() {
            return;
        }
        let node = &mut self.nodes[n];
        for &r in &finished {
            node.reserved -= self.reqs[r].input_len + self.reqs[r].output_len;
            node.context -= self.reqs[r].input_len + self.state[r].generated;
        }
        let reqs = self.reqs;
        let state = &self.state;
        node.running.retain(|&r| state[r].generated < reqs[r].output_len);
        for _ in &finished {
            self.decode_pool.adjust(n, -1, false);
        }
    }

    fn records(&self) -> Vec<SimRecord> {
        self.reqs
            .iter()
            .zip(&self.state)
            .enumerate()
            .map(|(id, (r, s))| {
                let tpot_s =
                    if r.output_len > 1 { (s.finish_s - s.first_token_s) / (r.output_len - 1) as f64 } else { 0.0 };
                SimRecord {
                    id,
                    arrival_s: r.arrival_s,
                    input_len: r.input_len,
                    output_len: r.output_len,
                    ttft_s: s.first_token_s - r.arrival_s,
                    tpot_s,
                    e2el_s: s.finish_s - r.arrival_s,
                    prefill_node: s.prefill_node,
                    decode_node: s.decode_node,
                }
            })
            .collect()
    }
}
