//! The cost model the simulator runs on: step times fitted from a profile. It lives in the
//! planner crate (`cleave_planner::profiled`), so that the coordinator's planner predicts with
//! the very model the simulator runs.

pub use cleave_planner::profiled::{CostModel, HandoffCost};
