//! The planner's settings, their JSON form and their validation.
//!
//! `PlannerConfig` is validated as a whole ([`PlannerConfig::validate`]) on construction and on
//! every [`PlannerUpdate`]; a refused update leaves the configuration as it was. Durations are
//! written as seconds (`window_s`, `cooldown_s`), enums as lowercase strings.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::PlannerError;

/// How far the planner may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No planning: `tick` returns nothing and records nothing (`estimate` still works).
    #[default]
    Off,
    /// Decisions are computed and recorded with `applied = false`; nobody acts on them.
    Advise,
    /// Decisions are recorded with `applied = true`; the caller carries their actions out.
    Auto,
}

impl Mode {
    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Advise => "advise",
            Mode::Auto => "auto",
        }
    }
}

/// What a node does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefills prompts and hands the KV cache to a decode node.
    Prefill,
    /// Decodes sequences whose KV it received.
    Decode,
    /// Colocated: prefills (in chunks of at most its step budget) and decodes its own requests.
    Both,
}

impl Role {
    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// The three roles in a fixed order (the order of per-role arrays in this crate).
    pub const ALL: [Role; 3] = [Role::Prefill, Role::Decode, Role::Both];

    pub(crate) fn index(self) -> usize {
        match self {
            Role::Prefill => 0,
            Role::Decode => 1,
            Role::Both => 2,
        }
    }
}

/// The service-level objectives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    /// Time to first token, milliseconds, at `quantile`.
    pub ttft_ms: f64,
    /// Time per output token (mean inter-token gap of a request), milliseconds, at `quantile`.
    pub tpot_ms: f64,
    /// The quantile the latency targets apply to, in (0, 1), e.g. 0.9.
    pub quantile: f64,
    /// Share of requests that must meet both targets, in (0, 1). The planner refuses to remove
    /// nodes while the observed share is below it.
    pub attainment: f64,
    /// The time per output token (ms) colocated nodes are held to, when tighter than
    /// `tpot_ms`: their pacing target and the time per token their admission seats are sized
    /// to (prefill and decode nodes keep `tpot_ms`). None: `tpot_ms`. A colocated node's
    /// streams share its steps with the prompts it prefills, and fewer, faster streams leave
    /// less for a burst of long prompts to queue behind; whether that wins depends on the
    /// machine and the load (on one machine a 150-ms SLO was served best held to 70 ms, on
    /// a 2.2x faster one with twice the load held to 150: BENCHMARKS.md, "Holding colocated
    /// nodes below the TPOT target"), so it is the operator's to set, from measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub colocated_tpot_ms: Option<f64>,
}

impl Default for Targets {
    fn default() -> Self {
        Self { ttft_ms: 3000.0, tpot_ms: 100.0, quantile: 0.9, attainment: 0.9, colocated_tpot_ms: None }
    }
}

impl Targets {
    /// What colocated nodes are held to (ms): `colocated_tpot_ms`, at most `tpot_ms`.
    pub fn colocated_ms(&self) -> f64 {
        self.colocated_tpot_ms.map_or(self.tpot_ms, |c| c.min(self.tpot_ms))
    }
}

/// Bounds every target and every action set respects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub min_prefill: u32,
    pub max_prefill: u32,
    pub min_decode: u32,
    pub max_decode: u32,
    pub min_colocated: u32,
    /// 0 disables colocation.
    pub max_colocated: u32,
    /// Most nodes in all (the node budget).
    pub max_nodes: u32,
    /// Step budgets (tokens per engine step) a colocated node may be given, e.g.
    /// `[64, 128, 256, 512, 2048]`.
    pub step_budgets: Vec<u32>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            min_prefill: 0,
            max_prefill: 8,
            min_decode: 0,
            max_decode: 8,
            min_colocated: 0,
            max_colocated: 8,
            max_nodes: 8,
            step_budgets: vec![64, 128, 256, 512, 2048],
        }
    }
}

impl Limits {
    /// `[min, max]` of a role's pool.
    pub fn range(&self, role: Role) -> (u32, u32) {
        match role {
            Role::Prefill => (self.min_prefill, self.max_prefill),
            Role::Decode => (self.min_decode, self.max_decode),
            Role::Both => (self.min_colocated, self.max_colocated),
        }
    }

    /// Whether purely disaggregated configurations (prefill + decode, no colocated node) exist.
    pub fn allows_disaggregated(&self) -> bool {
        self.min_colocated == 0
            && self.max_prefill >= 1
            && self.max_decode >= 1
            && u64::from(self.min_prefill.max(1)) + u64::from(self.min_decode.max(1)) <= u64::from(self.max_nodes)
    }

    /// Whether purely colocated configurations exist.
    pub fn allows_colocated(&self) -> bool {
        self.min_prefill == 0
            && self.min_decode == 0
            && self.max_colocated >= 1
            && self.min_colocated.max(1) <= self.max_nodes
    }

    /// The largest allowed step budget (used for colocated nodes that report none).
    pub fn largest_step_budget(&self) -> u32 {
        self.step_budgets.iter().copied().max().unwrap_or(0)
    }
}

/// Everything the planner is told. See the crate docs for how each knob enters the decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    pub mode: Mode,
    pub targets: Targets,
    pub limits: Limits,
    /// Sliding window for arrivals and latency percentiles (20 s by default: on the recorded
    /// shifting load, BENCHMARKS.md, 30 s saw each shift 10 s later, and the batch built up
    /// meanwhile cost as long again to drain).
    #[serde(rename = "window_s", with = "secs")]
    pub window: Duration,
    /// No new target within this long after a change.
    #[serde(rename = "cooldown_s", with = "secs")]
    pub cooldown: Duration,
    /// A new target must be wanted this many ticks in a row before it is decided (>= 1).
    pub confirm_ticks: u32,
    /// Act when the current configuration's prediction exceeds target x this (0.9: act before
    /// a breach).
    pub scale_up_margin: f64,
    /// A move that does not add nodes is only made when the new configuration's predictions are
    /// <= target x this (0.7). Must be <= `scale_up_margin`: the gap is the hysteresis band.
    pub scale_down_margin: f64,
    /// An actuator can start (and stop) node processes. When false the node count is whatever
    /// is live and only roles and step budgets change.
    pub can_add_nodes: bool,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Off,
            targets: Targets::default(),
            limits: Limits::default(),
            window: Duration::from_secs(20),
            cooldown: Duration::from_secs(15),
            confirm_ticks: 2,
            scale_up_margin: 0.9,
            scale_down_margin: 0.7,
            can_add_nodes: false,
        }
    }
}

/// A partial change of [`PlannerConfig`]: only the fields present change. Unknown fields are
/// refused so that a typo in a `PUT` is an error, not a silent no-op.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<TargetsUpdate>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsUpdate>,
    #[serde(default, rename = "window_s", with = "opt_secs", skip_serializing_if = "Option::is_none")]
    pub window: Option<Duration>,
    #[serde(default, rename = "cooldown_s", with = "opt_secs", skip_serializing_if = "Option::is_none")]
    pub cooldown: Option<Duration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirm_ticks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_up_margin: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_margin: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub can_add_nodes: Option<bool>,
}

/// A partial change of [`Targets`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetsUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantile: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attainment: Option<f64>,
    /// Sets [`Targets::colocated_tpot_ms`]; 0 clears it (colocated nodes held to `tpot_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub colocated_tpot_ms: Option<f64>,
}

/// A partial change of [`Limits`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_prefill: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prefill: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_decode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_decode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_colocated: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_colocated: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nodes: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_budgets: Option<Vec<u32>>,
}

fn set<T: Clone>(slot: &mut T, value: &Option<T>) {
    if let Some(v) = value {
        *slot = v.clone();
    }
}

impl PlannerConfig {
    /// Applies the fields present in `u`, then validates the result. On error nothing changed.
    pub fn apply(&mut self, u: &PlannerUpdate) -> Result<(), PlannerError> {
        let mut next = self.clone();
        set(&mut next.mode, &u.mode);
        if let Some(t) = &u.targets {
            set(&mut next.targets.ttft_ms, &t.ttft_ms);
            set(&mut next.targets.tpot_ms, &t.tpot_ms);
            set(&mut next.targets.quantile, &t.quantile);
            set(&mut next.targets.attainment, &t.attainment);
            if let Some(c) = t.colocated_tpot_ms {
                next.targets.colocated_tpot_ms = (c != 0.0).then_some(c);
            }
        }
        if let Some(l) = &u.limits {
            let n = &mut next.limits;
            set(&mut n.min_prefill, &l.min_prefill);
            set(&mut n.max_prefill, &l.max_prefill);
            set(&mut n.min_decode, &l.min_decode);
            set(&mut n.max_decode, &l.max_decode);
            set(&mut n.min_colocated, &l.min_colocated);
            set(&mut n.max_colocated, &l.max_colocated);
            set(&mut n.max_nodes, &l.max_nodes);
            set(&mut n.step_budgets, &l.step_budgets);
        }
        set(&mut next.window, &u.window);
        set(&mut next.cooldown, &u.cooldown);
        set(&mut next.confirm_ticks, &u.confirm_ticks);
        set(&mut next.scale_up_margin, &u.scale_up_margin);
        set(&mut next.scale_down_margin, &u.scale_down_margin);
        set(&mut next.can_add_nodes, &u.can_add_nodes);
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Checks every setting; the first one out of range is named in the error.
    pub fn validate(&self) -> Result<(), PlannerError> {
        let t = &self.targets;
        positive("targets.ttft_ms", t.ttft_ms)?;
        positive("targets.tpot_ms", t.tpot_ms)?;
        open_unit("targets.quantile", t.quantile)?;
        open_unit("targets.attainment", t.attainment)?;
        if let Some(c) = t.colocated_tpot_ms {
            positive("targets.colocated_tpot_ms", c)?;
        }
        if self.window.is_zero() {
            return Err(invalid("window_s", 0.0, "must be > 0"));
        }
        if self.confirm_ticks == 0 {
            return Err(invalid("confirm_ticks", 0, "must be >= 1"));
        }
        positive("scale_up_margin", self.scale_up_margin)?;
        positive("scale_down_margin", self.scale_down_margin)?;
        if self.scale_down_margin > self.scale_up_margin {
            return Err(PlannerError::InvalidField {
                field: "scale_down_margin",
                value: format!("{} > scale_up_margin {}", self.scale_down_margin, self.scale_up_margin),
                reason: "must be <= scale_up_margin (the gap is the hysteresis band)",
            });
        }
        self.validate_limits()
    }

    fn validate_limits(&self) -> Result<(), PlannerError> {
        let l = &self.limits;
        let pairs = [
            ("limits.min_prefill", l.min_prefill, l.max_prefill),
            ("limits.min_decode", l.min_decode, l.max_decode),
            ("limits.min_colocated", l.min_colocated, l.max_colocated),
        ];
        for (field, min, max) in pairs {
            if min > max {
                return Err(PlannerError::InvalidField {
                    field,
                    value: format!("{min} > max {max}"),
                    reason: "the minimum must not exceed the maximum",
                });
            }
        }
        if l.max_nodes == 0 {
            return Err(invalid("limits.max_nodes", 0, "must be >= 1"));
        }
        let mins = u64::from(l.min_prefill) + u64::from(l.min_decode) + u64::from(l.min_colocated);
        if mins > u64::from(l.max_nodes) {
            return Err(PlannerError::InvalidField {
                field: "limits.max_nodes",
                value: format!("{} < sum of minimums {mins}", l.max_nodes),
                reason: "the minimums must fit the node budget",
            });
        }
        if l.step_budgets.is_empty() {
            return Err(invalid("limits.step_budgets", "[]", "must hold at least one budget"));
        }
        if let Some(bad) = l.step_budgets.iter().find(|&&b| b == 0) {
            return Err(invalid("limits.step_budgets", bad, "every budget must be > 0 tokens"));
        }
        if !l.allows_disaggregated() && !l.allows_colocated() {
            return Err(PlannerError::NoConfiguration {
                min_prefill: l.min_prefill,
                max_prefill: l.max_prefill,
                min_decode: l.min_decode,
                max_decode: l.max_decode,
                min_colocated: l.min_colocated,
                max_colocated: l.max_colocated,
                max_nodes: l.max_nodes,
            });
        }
        Ok(())
    }
}

fn invalid(field: &'static str, value: impl std::fmt::Display, reason: &'static str) -> PlannerError {
    PlannerError::InvalidField { field, value: value.to_string(), reason }
}

fn positive(field: &'static str, v: f64) -> Result<(), PlannerError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(invalid(field, v, "must be finite and > 0"))
    }
}

fn open_unit(field: &'static str, v: f64) -> Result<(), PlannerError> {
    if v > 0.0 && v < 1.0 {
        Ok(())
    } else {
        Err(invalid(field, v, "must be in (0, 1)"))
    }
}

/// `Duration` as a JSON number of seconds.
pub(crate) mod secs {
    use std::time::Duration;

    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(|e| D::Error::custom(format!("{v} seconds: {e}")))
    }
}

/// `Option<Duration>` as an optional JSON number of seconds.
pub(crate) mod opt_secs {
    use std::time::Duration;

    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<f64>::deserialize(d)? {
            None => Ok(None),
            Some(v) => {
                Duration::try_from_secs_f64(v).map(Some).map_err(|e| D::Error::custom(format!("{v} seconds: {e}")))
            }
        }
    }
}
