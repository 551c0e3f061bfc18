//! `cleave bench simulate`: a discrete-event simulator of a cleave cluster driven by a cost model
//! calibrated from `cleave bench profile`.
//!
//! - [`profile`]: the measured profile (plain JSON written by the binary, which owns the engine).
//! - [`cost`]: step times fitted from it.
//! - [`cluster`]: `XpYd` / `Kc` topologies and node limits.
//! - [`workload`]: seeded arrivals and lengths.
//! - [`trace`]: workloads whose rate and mix change over time (phases; `day`, `shift`).
//! - [`engine`]: the simulator itself, sans-IO and deterministic; nodes may change role, start
//!   and stop.
//! - [`planned`]: planner mode: cleave's SLO planner (crate `cleave-planner`) driving the
//!   simulated cluster, the way the coordinator drives a real one.
//! - [`baseline`]: the best static topology at a planner run's attainment.
//! - [`plan_report`]: planner mode's report (per-window attainment, nodes, actions per hour).
//! - [`search`]: summaries, goodput search and the recommendation.
//! - [`validate`]: predicted against measured, replaying a real sweep's arrivals.
//! - [`speed`]: a profile scaled to the speed a measured run's nodes really had.
//! - [`cli`]: the subcommand's flags and report.
//!
//! Dependencies: of cleave's, only the sans-IO planner crate (its types and its `Planner`); this
//! module never touches the engine or HTTP, and only `plan_report` reads the wall clock (to
//! report how long a run took).

pub mod baseline;
pub mod cli;
pub mod cluster;
pub mod cost;
pub mod engine;
pub mod plan_report;
pub mod planned;
pub mod profile;
pub mod search;
pub mod speed;
pub mod trace;
pub mod validate;
pub mod workload;

pub use cli::SimulateArgs;
pub use cluster::{ClusterConfig, NodeLimits, Topology};
pub use cost::{CostModel, HandoffCost};
pub use engine::{simulate, Life, SimRecord, Transition};
pub use planned::{simulate_planned, static_attainment, ActionCounts, DecisionRecord, PlannedRun, PlannedSpec};
pub use profile::{DecodePoint, MixedPoint, PrefillPoint, Profile};
pub use search::{
    compare, max_goodput, predict, recommend, search_space, summarize, Comparison, Dist, Goodput, PredictSummary,
    SearchSpec, Slo,
};
pub use trace::{Phase, Preset, Trace};
pub use workload::{SimRequest, WorkloadSpec};
