//! The crate's one error type. Every variant names the setting it is about and the value that
//! was refused, so that an operator's `PUT /admin/planner` answer says what to fix.

/// Everything the planner refuses. Planning itself cannot fail: a tick with no usable data
/// returns no decision rather than an error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlannerError {
    /// One setting is out of range (`field` is its JSON path, e.g. `targets.ttft_ms`).
    #[error("invalid planner setting {field} = {value}: {reason}")]
    InvalidField { field: &'static str, value: String, reason: &'static str },
    /// The limits hold no configuration the planner plans: neither a purely disaggregated one
    /// (which needs `min_colocated = 0`, a prefill and a decode node within `max_nodes`) nor a
    /// purely colocated one (which needs `min_prefill = min_decode = 0` and `max_colocated >= 1`).
    #[error(
        "planner limits admit no configuration: prefill {min_prefill}..={max_prefill}, decode \
         {min_decode}..={max_decode}, colocated {min_colocated}..={max_colocated}, max_nodes {max_nodes} \
         (mixed colocated + disaggregated pools are not planned)"
    )]
    NoConfiguration {
        min_prefill: u32,
        max_prefill: u32,
        min_decode: u32,
        max_decode: u32,
        min_colocated: u32,
        max_colocated: u32,
        max_nodes: u32,
    },
    /// The cost model answers something unusable (not finite, or not > 0) for a basic probe.
    #[error("step cost model is unusable: {probe} = {value} (must be finite and > 0)")]
    InvalidCosts { probe: &'static str, value: f64 },
    /// A cost profile (`cleave bench profile` output) that breaks its invariants.
    #[error("invalid cost profile: {0}")]
    InvalidProfile(String),
}
