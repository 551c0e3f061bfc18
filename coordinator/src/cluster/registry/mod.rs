//! The node table and the routing policy: sans-IO (time passed in), owned by one actor task
//! ([`super::ClusterHandle`]) and tested deterministically.
//!
//! Invariants:
//! - every live node's model fingerprint equals the coordinator's (when it knows its model's)
//!   and every live node's KV layout equals the first registered node's; a node with another is
//!   refused at registration, loudly;
//! - a node that has not reported for `dead_after` is removed by [`Registry::expire`], as is a
//!   node whose control stream ended; routing never picks a removed node;
//! - `inflight_*` counts work assigned since the node's last report that the report cannot
//!   know about yet, so that a burst of requests between two reports spreads over the pool
//!   instead of piling onto the node that looked emptiest;
//! - `active_*` counts attempts routed to a node that have not ended (never reset by reports):
//!   a drain is over only when they are 0 and a report sent after that shows the engine idle
//!   for the drained kind of work;
//! - only [`Lifecycle::Active`] nodes are routed new work. A draining node finishes what it
//!   has (its streams complete on it, its leases close); then it stays parked
//!   ([`Lifecycle::Drained`]), is told to leave, or takes its new role. A role switch drains
//!   only the work the new role does not do (a decode node's streams before it prefills;
//!   nothing before it becomes colocated), and the node keeps its process and weights.
//!
//! Lifecycle changes that the node must hear of come out of [`Registry::lifecycle`] as
//! [`Effect`]s; the actor sends them on the node's control stream.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cleave_net::tls::Roles;
use cleave_protocol::control::{LoadReport, NodeRole, Register};
use cleave_protocol::KvLayout;

mod seats;
mod state;
pub use cleave_planner::admission::Admission;
use cleave_planner::admission::{PromptRate, Seats};
pub use state::{NodeState, PoolLoad, PoolSummary};

/// Routing thresholds (conditional disaggregation).
#[derive(Debug, Clone)]
pub struct RoutingConfig {
    /// Prefill locally on the decode node when at most this many prompt tokens are not
    /// already in its prefix cache (a remote prefill's handoff would cost more than it saves).
    pub local_prefill_max_tokens: usize,
    /// The prefill pool counts as saturated when every prefill node has more than this many
    /// prompt tokens queued; requests then prefill locally on decode nodes.
    pub prefill_saturation_tokens: u64,
    /// A node missing reports for this long is dead.
    pub dead_after: Duration,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self { local_prefill_max_tokens: 32, prefill_saturation_tokens: 65_536, dead_after: Duration::from_secs(3) }
    }
}

/// What the request path needs to reach a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRef {
    pub id: u64,
    pub name: String,
    pub role: NodeRole,
    pub rpc_addr: SocketAddr,
}

/// Why a request prefills on its decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalReason {
    /// The node prefills and decodes everything (`--role both`).
    Colocated,
    /// The uncached part of the prompt is short.
    ShortPrompt,
    /// No prefill node is alive (or every one was excluded after failing this request).
    NoPrefillNode,
    /// Every prefill node is saturated.
    PrefillSaturated,
    /// The request resumes after a decode node died (prompt plus tokens already sent).
    Migration,
}

impl LocalReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            LocalReason::Colocated => "colocated",
            LocalReason::ShortPrompt => "short_prompt",
            LocalReason::NoPrefillNode => "no_prefill_node",
            LocalReason::PrefillSaturated => "prefill_saturated",
            LocalReason::Migration => "migration",
        }
    }
}

/// Where one attempt of a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Remote { prefill: NodeRef, decode: NodeRef },
    Local { decode: NodeRef, reason: LocalReason },
}

/// A request's routing facts.
#[derive(Debug, Clone, Default)]
pub struct RouteQuery {
    /// The tokens to prefill (the prompt, plus tokens already sent after a migration).
    pub tokens: Vec<u32>,
    /// Tokens the request will generate at most (KV it will need on the decode node).
    pub max_tokens: usize,
    /// Nodes that already failed this request.
    pub exclude: Vec<u64>,
    /// Resume on a decode node with local prefill (migration).
    pub force_local: bool,
    /// How long the request has waited for its first token so far (SLO admission predicts its
    /// time to first token from it).
    pub waited: Duration,
}

/// Where a node is in its life, as the coordinator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Routed new work of its role.
    Active,
    /// Takes no new work; when what it has is done, `then` happens.
    Draining { then: AfterDrain, since: Instant },
    /// Drained and parked: takes no work until given a role again.
    Drained,
    /// Told to leave; removed when its control stream ends.
    Leaving,
}

impl Lifecycle {
    pub fn as_str(&self) -> &'static str {
        match self {
            Lifecycle::Active => "active",
            Lifecycle::Draining { then: AfterDrain::Role { .. }, .. } => "switching",
            Lifecycle::Draining { .. } => "draining",
            Lifecycle::Drained => "drained",
            Lifecycle::Leaving => "leaving",
        }
    }
}

/// What a drain ends in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDrain {
    /// Park the node ([`Lifecycle::Drained`]).
    Stay,
    /// Tell the node to leave (its process exits).
    Leave,
    /// Take this role (and step budget).
    Role { role: NodeRole, step_budget: Option<u32> },
}

/// What the node must be told (the actor writes it on the node's control stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    SetRole { node: u64, role: NodeRole, step_budget: Option<u32> },
    Leave { node: u64, reason: String },
}

/// An admin operation on a node that cannot be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeOpError {
    #[error("no live node has id {0}")]
    UnknownNode(u64),
    #[error("node {id} is leaving the cluster")]
    Leaving { id: u64 },
    #[error("step budget {tokens} is not allowed (at least 1)")]
    BadStepBudget { tokens: u32 },
    #[error("the coordinator is shutting down")]
    ShuttingDown,
    #[error("node {id}'s certificate allows {allowed}, not the {role} role")]
    RoleNotAllowed { id: u64, role: &'static str, allowed: Roles },
}

/// The certificate roles a node needs to take `role` (colocated: both node roles).
pub fn roles_needed(role: NodeRole) -> Roles {
    match role {
        NodeRole::Prefill => Roles::PREFILL,
        NodeRole::Decode => Roles::DECODE,
        NodeRole::Both => Roles::NODE,
    }
}

/// The kinds of work a node does, for drains: a prefill node's remote prefills, and streams
/// decoding on a node (remote or local prefill).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kinds {
    prefill: bool,
    decode: bool,
}

impl Kinds {
    fn of(role: NodeRole) -> Self {
        match role {
            NodeRole::Prefill => Kinds { prefill: true, decode: false },
            NodeRole::Decode => Kinds { prefill: false, decode: true },
            NodeRole::Both => Kinds { prefill: true, decode: true },
        }
    }
}

struct Node {
    reg: Register,
    /// The roles the node's certificate allows (all node roles over plain TCP).
    allowed: Roles,
    lifecycle: Lifecycle,
    /// Attempts routed here that have not ended: remote prefills, and decoding streams.
    active_prefill: u32,
    active_decode: u32,
    /// When the drained kinds of work last reached zero (a report after it must confirm).
    quiet_since: Option<Instant>,
    last_report: Instant,
    load: LoadReport,
    prefix: HashSet<u64>,
    inflight_prefill_tokens: u64,
    /// Prompt tokens of the remote prefills routed here whose prefill has not ended: unlike the
    /// in-flight estimate, not reset by a report (one snapshotted before a prompt arrived would
    /// otherwise hide it), so a floor under the queue a prefill node holds.
    open_prefill_tokens: u64,
    inflight_seqs: u32,
    inflight_blocks: u64,
    /// Blocks the remote attempts booked here since the last report reserve at once (their
    /// prompts' blocks): what the node's reservations take from the free blocks it reported.
    /// Not returned when an attempt ends (by then the node's own report counts the
    /// reservation, or its release): only a report resets it.
    inflight_reserve: u64,
    /// SLO admission's cap on the streams it decodes at once, and the rate it prefills at (see
    /// [`cleave_planner::admission`]).
    seats: Seats,
    prompts: PromptRate,
}

impl Node {
    fn node_ref(&self, id: u64) -> NodeRef {
        NodeRef { id, name: self.reg.name.clone(), role: self.reg.role, rpc_addr: self.reg.rpc_addr }
    }

    /// Leading prompt blocks this node holds in its prefix cache: up to the last block whose
    /// key it reported. A block's key chains every block before it (`prefix::block_hash`), so
    /// that key alone names the whole prefix; a middle key missing from a bounded report does
    /// not hide the rest of the match.
    fn overlap(&self, hashes: &[u64]) -> usize {
        hashes.iter().rposition(|h| self.prefix.contains(h)).map_or(0, |i| i + 1)
    }

    /// The kinds of new work routed here: its role's when active; while it switches, what the
    /// old and the new role both do (decode -> both keeps decoding, both -> prefill keeps
    /// prefilling), so that a switch never leaves a pool without a routable node for work the
    /// node goes on doing anyway; nothing while it drains to leave or park.
    fn takes(&self) -> Kinds {
        match self.lifecycle {
            Lifecycle::Active => Kinds::of(self.reg.role),
            Lifecycle::Draining { then: AfterDrain::Role { role, .. }, .. } => {
                let (old, new) = (Kinds::of(self.reg.role), Kinds::of(role));
                Kinds { prefill: old.prefill && new.prefill, decode: old.decode && new.decode }
            }
            _ => Kinds { prefill: false, decode: false },
        }
    }

    fn decodes(&self) -> bool {
        self.takes().decode
    }

    /// Takes remote prefills: prefill-only work (a node that also decodes prefills its own).
    fn prefills(&self) -> bool {
        let k = self.takes();
        k.prefill && !k.decode
    }

    /// Prefills what it decodes (colocated).
    fn colocated(&self) -> bool {
        let k = self.takes();
        k.prefill && k.decode
    }

    /// Switching into a role.
    fn switching(&self) -> bool {
        matches!(self.lifecycle, Lifecycle::Draining { then: AfterDrain::Role { .. }, .. })
    }

    /// The work a drain in progress waits for (none when not draining).
    fn drain_kinds(&self) -> Kinds {
        match self.lifecycle {
            Lifecycle::Draining { then: AfterDrain::Role { role, .. }, .. } => {
                let (old, new) = (Kinds::of(self.reg.role), Kinds::of(role));
                Kinds { prefill: old.prefill && !new.prefill, decode: old.decode && !new.decode }
            }
            Lifecycle::Draining { .. } => Kinds { prefill: true, decode: true },
            _ => Kinds { prefill: false, decode: false },
        }
    }

    /// No attempt of the drained kinds is routed here any more.
    fn routed_quiet(&self, k: Kinds) -> bool {
        !(k.prefill && self.active_prefill > 0 || k.decode && self.active_decode > 0)
    }

    /// The engine, as last reported, holds no work of the drained kinds.
    ///
    /// A node that keeps decoding through its switch (both -> decode) has running sequences
    /// that are not drained work: for it, prefill is done when nothing waits or is queued.
    fn engine_quiet(&self, k: Kinds) -> bool {
        let l = &self.load;
        let seqs = l.running_seqs + l.waiting_seqs;
        let prefill_left = if self.takes().decode {
            l.queued_prefill_tokens > 0 || l.waiting_seqs > 0
        } else {
            l.queued_prefill_tokens > 0 || seqs > 0
        };
        !(k.decode && seqs > 0 || k.prefill && prefill_left)
    }

    /// Blocks a handoff reservation could take now: free and evictable cached blocks, as last
    /// reported, less what the reservations routed here since will take.
    fn room_now(&self) -> u64 {
        u64::from(self.load.free_blocks + self.load.cached_blocks).saturating_sub(self.inflight_reserve)
    }

    /// Prompt tokens queued here as routing counts them: the last report's, plus those routed
    /// since, and at least those of the remote prefills routed here and not ended.
    fn queued_prefill(&self) -> u64 {
        (self.load.queued_prefill_tokens + self.inflight_prefill_tokens).max(self.open_prefill_tokens)
    }

    /// Sequences here as routing counts them: the last report's running and waiting ones plus
    /// those routed since, and at least the streams routed here and not ended (a report
    /// snapshotted before a stream reached the node resets the in-flight count without
    /// counting it).
    fn routed_seqs(&self) -> u32 {
        let reported = self.load.running_seqs.saturating_add(self.load.waiting_seqs).saturating_add(self.inflight_seqs);
        reported.max(self.active_decode)
    }
}

fn or_unsaid(format: &str) -> &str {
    if format.is_empty() {
        "unsaid"
    } else {
        format
    }
}

/// A registration refused, with the reason told to the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// No node can serve a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no node can serve this request: {reason}")]
pub struct NoRoute {
    pub reason: String,
    /// Why a node may take the request soon, so that the caller should hold it a moment rather
    /// than fail it; None: no node will (the answer is final).
    pub wait: Option<Wait>,
    /// SLO admission refused it: it could not make its TTFT target (counted as shed).
    pub shed: bool,
}

/// What a held request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// A node is switching roles: one may take the request once the switch completes.
    Switch,
    /// Every decode node's KV cache is too full to reserve the prompt's blocks for a handoff
    /// now; running streams free blocks as they finish.
    DecodeKv,
    /// SLO admission: every decode node holds as many streams as keep the TPOT target; a seat
    /// frees when a stream ends. A request held longer than `max_wait` is refused (it could no
    /// longer make its TTFT target).
    Seats { max_wait: Duration },
}

impl NoRoute {
    pub fn new(reason: impl Into<String>) -> Self {
        Self { reason: reason.into(), wait: None, shed: false }
    }
}

/// Assignment bookkeeping a request hands back when an attempt ends (see [`Registry::release`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Assignment {
    pub prefill: Option<(u64, u64)>,
    pub decode: Option<(u64, u64)>,
    /// KV blocks booked on the decode node.
    pub blocks: u64,
}

pub struct Registry {
    cfg: RoutingConfig,
    /// The planner's saturation line (see [`Registry::set_bridge`]); the configured one when None.
    bridge: Option<u64>,
    /// SLO admission (see [`seats`]); None: every request is routed at once.
    admission: Option<Admission>,
    fingerprint: Option<u64>,
    layout: Option<KvLayout>,
    nodes: BTreeMap<u64, Node>,
    /// Ids of the nodes in [`Lifecycle::Draining`]: [`Registry::lifecycle`] runs after every
    /// command, and looks at these only (not at every node on every routed request).
    draining: std::collections::BTreeSet<u64>,
    next_id: u64,
}

impl Registry {
    /// `fingerprint`: the coordinator's model's, when it knows it.
    pub fn new(cfg: RoutingConfig, fingerprint: Option<u64>) -> Self {
        Self {
            cfg,
            bridge: None,
            admission: None,
            fingerprint,
            layout: None,
            nodes: BTreeMap::new(),
            draining: Default::default(),
            next_id: 1,
        }
    }

    pub fn config(&self) -> &RoutingConfig {
        &self.cfg
    }

    /// Queued prompt tokens past which every prefill node counts as saturated (requests then
    /// prefill on their decode node).
    pub fn saturation_tokens(&self) -> u64 {
        self.bridge.unwrap_or(self.cfg.prefill_saturation_tokens)
    }

    /// The planner (in auto mode) sets the saturation line from the TTFT target and the
    /// prefill rate, so that decode nodes take prompts a saturated prefill pool would serve too
    /// late while capacity moves; None restores the configured line.
    pub fn set_bridge(&mut self, tokens: Option<u64>) {
        self.bridge = tokens;
    }

    /// Turns SLO admission on (with its targets) or off (every seat cap is forgotten).
    pub fn set_admission(&mut self, admission: Option<Admission>) {
        if admission.is_none() {
            for n in self.nodes.values_mut() {
                n.seats = Default::default();
                n.prompts = Default::default();
            }
        }
        self.admission = admission;
    }

    pub fn layout(&self) -> Option<&KvLayout> {
        self.layout.as_ref()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Admits a node whose certificate allows every node role ([`Registry::register_with`]).
    pub fn register(&mut self, reg: Register, now: Instant) -> Result<u64, Refusal> {
        self.register_with(reg, Roles::NODE, now)
    }

    /// Admits a node whose certificate allows `allowed` (it is never switched to a role outside
    /// them), or says loudly why not.
    pub fn register_with(&mut self, reg: Register, allowed: Roles, now: Instant) -> Result<u64, Refusal> {
        if !allowed.contains(roles_needed(reg.role)) {
            return Err(Refusal(format!(
                "node `{}` registers as {} but its certificate allows {allowed}",
                reg.name,
                reg.role.as_str()
            )));
        }
        let want = self.fingerprint.or(self.layout.as_ref().map(|l| l.model_fingerprint));
        if let Some(fp) = want {
            if fp != reg.layout.model_fingerprint {
                return Err(Refusal(format!(
                    "model fingerprint {:016x} of node `{}` (model `{}`) differs from the cluster's {fp:016x}: \
                     every node must serve the coordinator's model (in any format: the fingerprint \
                     is the model's config, vocabulary and norm weights, not its storage)",
                    reg.layout.model_fingerprint, reg.name, reg.model_name
                )));
            }
        }
        if let Some(l) = &self.layout {
            if l.dtype != reg.layout.dtype {
                return Err(Refusal(format!(
                    "kv cache dtype {} of node `{}` differs from the cluster's {}: every node must run \
                     with the same --kv-cache-dtype (K/V moves between nodes as stored)",
                    dtype_name(reg.layout.dtype),
                    reg.name,
                    dtype_name(l.dtype)
                )));
            }
            if *l != reg.layout {
                return Err(Refusal(format!(
                    "kv layout of node `{}` ({:?}) differs from the cluster's ({l:?})",
                    reg.name, reg.layout
                )));
            }
        } else {
            self.layout = Some(reg.layout.clone());
        }
        // Another format of the same model (f32 prefill beside Q4 decode) is welcome: said once
        // per node, and shown in `GET /admin/nodes`.
        if let Some(other) = self.nodes.values().find(|n| n.reg.weights != reg.weights) {
            tracing::info!(
                node = %reg.name,
                format = %reg.weights.format,
                weights = %format!("{:016x}", reg.weights.fingerprint),
                other = %other.reg.name,
                other_format = %other.reg.weights.format,
                "same model, another format: node {} holds {} weights, node {} holds {}",
                reg.name,
                or_unsaid(&reg.weights.format),
                other.reg.name,
                or_unsaid(&other.reg.weights.format),
            );
        }
        let id = self.next_id;
        self.next_id += 1;
        let load = LoadReport {
            free_blocks: reg.kv_capacity_blocks,
            total_blocks: reg.kv_capacity_blocks,
            ..LoadReport::default()
        };
        self.nodes.insert(
            id,
            Node {
                reg,
                allowed,
                lifecycle: Lifecycle::Active,
                active_prefill: 0,
                active_decode: 0,
                quiet_since: None,
                last_report: now,
                load,
                prefix: HashSet::new(),
                inflight_prefill_tokens: 0,
                open_prefill_tokens: 0,
                inflight_seqs: 0,
                inflight_blocks: 0,
                inflight_reserve: 0,
                seats: Default::default(),
                prompts: Default::default(),
            },
        );
        Ok(id)
    }

    /// A fresh report replaces the node's load; in-flight estimates reset (the report now
    /// includes that work).
    pub fn report(&mut self, id: u64, load: LoadReport, now: Instant) -> bool {
        let Some(n) = self.nodes.get_mut(&id) else { return false };
        n.prefix = load.prefix_hashes.iter().copied().collect();
        if let Some(a) = self.admission {
            let totals = seats::admission_totals(&load.steps);
            // A colocated node's seats are sized to its hold (`targets.colocated_tpot_ms`:
            // prompts prefill beside its streams), any other's to the target.
            n.seats.observe(&totals, a.tpot_target_for(n.reg.role == NodeRole::Both));
            n.prompts.observe(&totals);
        }
        // The node's own word on its step budget wins over what it was asked for.
        if load.step_budget.is_some() {
            n.reg.step_budget = load.step_budget;
        }
        n.load = load;
        n.last_report = now;
        n.inflight_prefill_tokens = 0;
        n.inflight_seqs = 0;
        n.inflight_blocks = 0;
        n.inflight_reserve = 0;
        true
    }

    pub fn remove(&mut self, id: u64) -> Option<NodeRef> {
        self.draining.remove(&id);
        self.nodes.remove(&id).map(|n| n.node_ref(id))
    }

    /// Removes nodes silent for `dead_after`; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<NodeRef> {
        let dead: Vec<u64> = self
            .nodes
            .iter()
            .filter(|(_, n)| now.saturating_duration_since(n.last_report) > self.cfg.dead_after)
            .map(|(&id, _)| id)
            .collect();
        dead.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Chooses where a request goes, and books its expected load on the chosen nodes.
    pub fn plan(&mut self, q: &RouteQuery) -> Result<(Plan, Assignment), NoRoute> {
        let block = self.layout.as_ref().map_or(16, |l| l.block_size.max(1) as usize);
        let prompt_len = q.tokens.len();
        let hashes: Vec<u64> = cleave_protocol::prefix::hash_chain(&q.tokens, block).collect();
        let need_blocks = (prompt_len + q.max_tokens).div_ceil(block) as u64;
        // What a decode node reserves at once for a handoff: the prompt's blocks.
        let reserve_blocks = prompt_len.div_ceil(block) as u64;
        let excluded = |id: &u64| q.exclude.contains(id);
        // SLO admission: a node holding its seat cap takes no new stream (a stream that moves
        // after its node failed is not new: it keeps its seat, wherever it lands).
        let seated = self.admission.filter(|_| !q.force_local);
        let mut full = Vec::new();

        // Decode side: room to reserve the prompt now, then most free KV after its in-flight
        // work, fewest sequences (those it reports, or the streams routed to it and not ended,
        // whichever is more), then prefix overlap (saved prefill), then the lowest id
        // (deterministic).
        let decode = self
            .nodes
            .iter()
            .filter(|(id, n)| n.decodes() && !excluded(id))
            .filter(|(_, n)| n.reg.max_model_len as usize >= prompt_len + q.max_tokens)
            .filter(|(&id, n)| {
                let is_full = seated.is_some() && n.seats.is_full(n.active_decode);
                if is_full {
                    full.push(id);
                }
                !is_full
            })
            .max_by_key(|(id, n)| {
                let free = u64::from(n.load.free_blocks + n.load.cached_blocks).saturating_sub(n.inflight_blocks);
                let fits = free >= need_blocks;
                let overlap = n.overlap(&hashes) as u64;
                // At least the streams routed here and not ended: a report snapshotted before a
                // stream reached the node resets the in-flight count without counting it, and
                // two nodes would then look equally idle (the lowest id took every prompt that
                // arrived while the other sat idle).
                let busy = u64::from(n.routed_seqs());
                // Score: fitting first, then free blocks net of load and the overlap's worth.
                let score = free as i64 + (overlap * 4) as i64 - (busy * need_blocks.max(1)) as i64;
                (n.room_now() >= reserve_blocks, fits, score, std::cmp::Reverse(**id))
            })
            .map(|(&id, _)| id);
        if let (None, Some(a)) = (decode, seated) {
            if !full.is_empty() {
                for id in &full {
                    if let Some(n) = self.nodes.get_mut(id) {
                        n.seats.turned_away();
                    }
                }
                return Err(NoRoute {
                    reason: {
                        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
                        let hold = if a.colocated_tpot_target < a.tpot_target {
                            format!("{} ms on colocated nodes, their hold; ", ms(a.colocated_tpot_target))
                        } else {
                            String::new()
                        };
                        format!(
                            "every decode node holds as many streams as keep the {} ms TPOT target \
                             ({hold}SLO admission)",
                            ms(a.tpot_target)
                        )
                    },
                    wait: Some(Wait::Seats { max_wait: a.max_wait }),
                    shed: false,
                });
            }
        }
        let Some(decode_id) = decode else {
            return Err(NoRoute {
                reason: if self.nodes.is_empty() {
                    "no node is registered".into()
                } else {
                    "no live decode node can hold this request".into()
                },
                wait: self.nodes.values().any(Node::switching).then_some(Wait::Switch),
                shed: false,
            });
        };
        let d = &self.nodes[&decode_id];
        let uncached_local = prompt_len.saturating_sub(d.overlap(&hashes) * block);

        let local = if q.force_local {
            Some(LocalReason::Migration)
        } else if d.colocated() {
            Some(LocalReason::Colocated)
        } else if uncached_local <= self.cfg.local_prefill_max_tokens {
            Some(LocalReason::ShortPrompt)
        } else {
            None
        };
        let prefill = if local.is_some() {
            None
        } else {
            // Prefill side: least queued prefill work net of what its cache already holds.
            self.nodes
                .iter()
                .filter(|(id, n)| n.prefills() && !excluded(id))
                .min_by_key(|(id, n)| {
                    let cached = (n.overlap(&hashes) * block) as u64;
                    let work = n.queued_prefill() + (prompt_len as u64).saturating_sub(cached);
                    (work, **id)
                })
                .map(|(&id, n)| (id, n.queued_prefill()))
        };
        let (plan, assignment) = match (local, prefill) {
            (Some(reason), _) => (
                Plan::Local { decode: d.node_ref(decode_id), reason },
                Assignment { prefill: None, decode: Some((decode_id, uncached_local as u64)), blocks: need_blocks },
            ),
            (None, None) => (
                Plan::Local { decode: d.node_ref(decode_id), reason: LocalReason::NoPrefillNode },
                Assignment { prefill: None, decode: Some((decode_id, uncached_local as u64)), blocks: need_blocks },
            ),
            (None, Some((_, queued))) if queued > self.saturation_tokens() => (
                Plan::Local { decode: d.node_ref(decode_id), reason: LocalReason::PrefillSaturated },
                Assignment { prefill: None, decode: Some((decode_id, uncached_local as u64)), blocks: need_blocks },
            ),
            (None, Some((pid, _))) => {
                let p = &self.nodes[&pid];
                let work = (prompt_len - p.overlap(&hashes) * block).max(1) as u64;
                (
                    Plan::Remote { prefill: p.node_ref(pid), decode: d.node_ref(decode_id) },
                    Assignment { prefill: Some((pid, work)), decode: Some((decode_id, 0)), blocks: need_blocks },
                )
            }
        };
        if matches!(plan, Plan::Remote { .. }) {
            // A handoff needs the prompt's blocks reserved on the decode node before the KV
            // can land; a node without them refuses the reservation, and the request would
            // fail. Hold it here until a decode node has room (the engine queues local
            // prefills itself, so those go on).
            let room = d.room_now();
            if room < reserve_blocks {
                let capacity = u64::from(d.load.total_blocks.max(d.reg.kv_capacity_blocks));
                return Err(NoRoute {
                    reason: format!(
                        "the decode nodes' KV caches are full: the prompt needs {reserve_blocks} blocks, \
                         the best decode node has {room} free of {capacity}"
                    ),
                    wait: (capacity >= reserve_blocks).then_some(Wait::DecodeKv),
                    shed: false,
                });
            }
        }
        if let Some(a) = seated {
            // The TTFT half of SLO admission: a prompt that would wait behind more prompt work
            // than its node gets through before the target is refused now (waiting at the edge
            // would not shorten that queue).
            let (node, work) = match assignment.prefill {
                Some((pid, work)) => (pid, work),
                None => (decode_id, uncached_local as u64),
            };
            let n = &self.nodes[&node];
            if let Some(rate) = n.prompts.tokens_per_s() {
                let queued = n.queued_prefill() + work;
                // Saturating: the rate comes from a node's report (a wild one must not panic).
                let wait = Duration::try_from_secs_f64(queued as f64 / rate).unwrap_or(Duration::MAX);
                let ttft = q.waited.saturating_add(wait);
                if ttft > a.ttft_target {
                    return Err(NoRoute {
                        reason: format!(
                            "its time to first token would be {:.1} s, past the {:.1} s target: \
                             {queued} prompt tokens are queued on {} at the {rate:.0} tokens/s it \
                             prefills (SLO admission)",
                            ttft.as_secs_f64(),
                            a.ttft_target.as_secs_f64(),
                            n.reg.name
                        ),
                        wait: None,
                        shed: true,
                    });
                }
            }
        }
        if let Some((pid, work)) = assignment.prefill {
            if let Some(p) = self.nodes.get_mut(&pid) {
                p.inflight_prefill_tokens += work;
                p.open_prefill_tokens += work;
                p.active_prefill += 1;
            }
        }
        if let Some((did, work)) = assignment.decode {
            if let Some(n) = self.nodes.get_mut(&did) {
                n.active_decode += 1;
                n.inflight_seqs += 1;
                n.inflight_blocks += need_blocks;
                if assignment.prefill.is_some() {
                    n.inflight_reserve += reserve_blocks;
                }
                n.inflight_prefill_tokens += work;
            }
        }
        Ok((plan, assignment))
    }

    /// The attempt that booked `a` ended (the stream finished or failed).
    pub fn release(&mut self, a: &Assignment, now: Instant) {
        let need_blocks = a.blocks;
        self.release_prefill(&mut a.clone(), now);
        if let Some((did, work)) = a.decode {
            if let Some(n) = self.nodes.get_mut(&did) {
                n.active_decode = n.active_decode.saturating_sub(1);
                if n.active_decode == 0 {
                    n.quiet_since = Some(now);
                }
                n.inflight_seqs = n.inflight_seqs.saturating_sub(1);
                n.inflight_blocks = n.inflight_blocks.saturating_sub(need_blocks);
                n.inflight_prefill_tokens = n.inflight_prefill_tokens.saturating_sub(work);
            }
        }
    }

    /// The prefill part of an attempt ended (its KV was handed off, or its stream closed) while
    /// the stream goes on decoding elsewhere; `a` forgets it, so [`Self::release`] does not
    /// count it twice.
    pub fn release_prefill(&mut self, a: &mut Assignment, now: Instant) {
        if let Some((pid, work)) = a.prefill.take() {
            if let Some(p) = self.nodes.get_mut(&pid) {
                p.inflight_prefill_tokens = p.inflight_prefill_tokens.saturating_sub(work);
                p.open_prefill_tokens = p.open_prefill_tokens.saturating_sub(work);
                p.active_prefill = p.active_prefill.saturating_sub(1);
                if p.active_prefill == 0 {
                    p.quiet_since = Some(now);
                }
            }
        }
    }

    /// Stops routing new work to node `id`; when its work is done, `then` happens (see
    /// [`Self::lifecycle`]). A drain of a node already draining replaces its `then`.
    pub fn drain(&mut self, id: u64, then: AfterDrain, now: Instant) -> Result<(), NodeOpError> {
        let n = self.nodes.get_mut(&id).ok_or(NodeOpError::UnknownNode(id))?;
        if n.lifecycle == Lifecycle::Leaving {
            return Err(NodeOpError::Leaving { id });
        }
        if let AfterDrain::Role { step_budget: Some(0), .. } = then {
            return Err(NodeOpError::BadStepBudget { tokens: 0 });
        }
        let since = match n.lifecycle {
            Lifecycle::Draining { since, .. } => since,
            _ => now,
        };
        n.lifecycle = Lifecycle::Draining { then, since };
        self.draining.insert(id);
        if n.quiet_since.is_none() {
            n.quiet_since = Some(now);
        }
        Ok(())
    }

    /// Gives node `id` a role (and step budget): at once when it holds no work the new role
    /// does not do, else after draining that work. A parked node takes it at once.
    pub fn set_role(
        &mut self,
        id: u64,
        role: NodeRole,
        step_budget: Option<u32>,
        now: Instant,
    ) -> Result<(), NodeOpError> {
        let n = self.nodes.get(&id).ok_or(NodeOpError::UnknownNode(id))?;
        if !n.allowed.contains(roles_needed(role)) {
            return Err(NodeOpError::RoleNotAllowed { id, role: role.as_str(), allowed: n.allowed });
        }
        if n.lifecycle == Lifecycle::Drained {
            let n = self.nodes.get_mut(&id).ok_or(NodeOpError::UnknownNode(id))?;
            n.lifecycle = Lifecycle::Draining { then: AfterDrain::Role { role, step_budget }, since: now };
            self.draining.insert(id);
            n.quiet_since = Some(now);
            return Ok(());
        }
        self.drain(id, AfterDrain::Role { role, step_budget }, now)
    }

    /// Lifecycle bookkeeping: every draining node whose work is done takes its next state.
    /// Returns what nodes must be told. Call after reports, releases and drains.
    pub fn lifecycle(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        let mut done = Vec::new();
        for &id in &self.draining {
            let Some(n) = self.nodes.get_mut(&id) else { continue };
            let Lifecycle::Draining { then, .. } = n.lifecycle else { continue };
            let k = n.drain_kinds();
            if !n.routed_quiet(k) {
                continue;
            }
            // Confirmed by a report sent after the last routed attempt ended (a switch that
            // drains nothing needs none).
            let drains_something = k.prefill || k.decode;
            let confirmed = n.quiet_since.is_some_and(|q| n.last_report > q) && n.engine_quiet(k);
            if drains_something && !confirmed {
                continue;
            }
            match then {
                AfterDrain::Stay => n.lifecycle = Lifecycle::Drained,
                AfterDrain::Leave => {
                    n.lifecycle = Lifecycle::Leaving;
                    out.push(Effect::Leave {
                        node: id,
                        reason: "drained at the operator's or planner's request".into(),
                    });
                }
                AfterDrain::Role { role, step_budget } => {
                    n.reg.role = role;
                    if step_budget.is_some() {
                        n.reg.step_budget = step_budget;
                    }
                    n.lifecycle = Lifecycle::Active;
                    out.push(Effect::SetRole { node: id, role, step_budget });
                }
            }
            n.quiet_since = None;
            done.push(id);
        }
        for id in done {
            self.draining.remove(&id);
        }
        out
    }

    /// Per-pool totals for metrics and `/health`.
    pub fn pools(&self) -> PoolSummary {
        let mut s = PoolSummary::default();
        for n in self.nodes.values() {
            s.add(n.reg.role, n.lifecycle == Lifecycle::Active, &n.load);
        }
        s
    }

    /// Every live node with its last load report, for the admin API.
    pub fn node_states(&self, now: Instant) -> Vec<NodeState> {
        self.nodes
            .iter()
            .map(|(&id, n)| NodeState {
                node: n.node_ref(id),
                lifecycle: n.lifecycle,
                active_prefill: n.active_prefill,
                active_decode: n.active_decode,
                seat_cap: n.seats.cap(),
                step_budget: n.reg.step_budget,
                model_name: n.reg.model_name.clone(),
                metrics_addr: n.reg.metrics_addr,
                weights: n.reg.weights.clone(),
                load: LoadReport { prefix_hashes: Vec::new(), ..n.load.clone() },
                queued_prefill: n.queued_prefill(),
                routed_seqs: n.routed_seqs(),
                cached_prefix_blocks: n.prefix.len(),
                report_age: now.saturating_duration_since(n.last_report),
            })
            .collect()
    }

    /// Names, roles and addresses of the live nodes.
    pub fn nodes(&self) -> Vec<NodeRef> {
        self.nodes.iter().map(|(&id, n)| n.node_ref(id)).collect()
    }
}

/// A KV dtype as `--kv-cache-dtype` spells it.
fn dtype_name(d: cleave_protocol::KvDtype) -> &'static str {
    match d {
        cleave_protocol::KvDtype::F32 => "f32",
        cleave_protocol::KvDtype::F16 => "f16",
        cleave_protocol::KvDtype::Bf16 => "bf16",
    }
}

#[cfg(test)]
mod tests;
