//! `cleave bench simulate`: a discrete-event simulator of a cleave cluster driven by a cost model
//! calibrated from `cleave bench profile`.
//!
//! - [`profile`]: the measured profile (plain JSON written by the binary, which owns the engine).
//! - [`cost`]: step times fitted from it.
//! - [`cluster`]: `XpYd` / `Kc` topologies and node limits.
//! - [`workload`]: seeded arrivals and lengths.
//! - [`engine`]: the simulator itself, sans-IO and deterministic.
//! - [`search`]: summaries, goodput search and the recommendation.
//! - [`validate`]: predicted against measured, replaying a real sweep's arrivals.
//! - [`cli`]: the subcommand's flags and report.
//!
//! Dependencies: nothing of cleave's; this module never touches the engine, HTTP or the clock.

pub mod cli;
pub mod cluster;
pub mod cost;
pub mod engine;
pub mod profile;
pub mod search;
pub mod validate;
pub mod workload;

pub use cli::SimulateArgs;
pub use cluster::{ClusterConfig, NodeLimits, Topology};
pub use cost::{CostModel, HandoffCost};
pub use engine::{simulate, SimRecord};
pub use profile::{DecodePoint, MixedPoint, PrefillPoint, Profile};
pub use search::{
    compare, max_goodput, predict, recommend, search_space, summarize, Comparison, Dist, Goodput, PredictSummary,
    SearchSpec, Slo,
};
pub use workload::{SimRequest, WorkloadSpec};
