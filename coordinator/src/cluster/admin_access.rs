//! What the admin API and the dashboard share: the state their routes act on, how a request
//! presents the admin token (bearer header, or the dashboard's cookie) and how it is checked,
//! and a node as JSON. Its own module so that the admin routes and the dashboard, which each
//! use the other's routes or checks, do not import each other.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::header;
use serde_json::{json, Value};

use super::planning::PlannerHandle;
use super::registry::NodeState;
use super::ClusterHandle;

/// The cookie that carries the admin token for the dashboard.
pub const COOKIE: &str = "cleave_admin";

/// What the admin routes act on.
#[derive(Clone)]
pub struct AdminState {
    pub cluster: ClusterHandle,
    pub planner: PlannerHandle,
    /// None: the admin API is closed.
    pub token: Option<Arc<str>>,
}

/// Whether `given` is the admin token.
pub fn token_matches(given: &str, token: &str) -> bool {
    same(given.as_bytes(), token.as_bytes())
}

/// Equal strings in time that does not depend on where they differ.
pub(super) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token a request presents: `Authorization: Bearer ...`, else the dashboard cookie.
pub fn presented_token(req: &Request) -> Option<&str> {
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    bearer.or_else(|| {
        req.headers()
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| *k == COOKIE)
            .map(|(_, v)| v)
    })
}

/// A node as the admin API and the dashboard show it.
pub fn node_json(s: &NodeState) -> Value {
    let l = &s.load;
    json!({
        "id": s.node.id,
        "name": s.node.name,
        "role": s.node.role.as_str(),
        "state": s.lifecycle.as_str(),
        "rpc_addr": s.node.rpc_addr.to_string(),
        "metrics_addr": s.metrics_addr.map(|a| a.to_string()),
        "model": s.model_name,
        // Nodes of one model may hold it in different formats (f32 prefill, Q4 decode): the
        // format and a fingerprint of the weights as loaded, per node.
        "weights": {
            "format": s.weights.format,
            "fingerprint": format!("{:016x}", s.weights.fingerprint),
        },
        "step_budget": s.step_budget,
        // Prompt chunks beside running decodes sized to keep them within this time per output
        // token (null: the step budget alone), and the steps it held below the budget.
        "pacing": {
            "tpot_target_ms": l.tpot_target_us.map(|us| f64::from(us) / 1e3),
            "paced_steps": l.paced_steps,
        },
        "report_age_ms": s.report_age.as_millis() as u64,
        "cached_prefix_blocks": s.cached_prefix_blocks,
        "active": { "prefill": s.active_prefill, "decode": s.active_decode },
        // SLO admission: the most streams it decodes at once to keep the TPOT target.
        "seat_cap": s.seat_cap,
        "load": {
            "queued_prefill_tokens": l.queued_prefill_tokens,
            "waiting_seqs": l.waiting_seqs,
            "running_seqs": l.running_seqs,
            "free_blocks": l.free_blocks,
            "cached_blocks": l.cached_blocks,
            "total_blocks": l.total_blocks,
            // Host memory the KV cache occupies now: it grows as blocks are first used, up to
            // the cache's size (so a node's resident size may grow by that much without a leak).
            "kv_resident_bytes": l.kv_resident_bytes,
        },
        // Cumulative engine step timings: how fast the node really runs (what the planner
        // calibrates its costs with, and what a simulator replay can be scaled by).
        "steps": {
            "prefill_tokens": l.steps.prefill_tokens,
            "prefill_us": l.steps.prefill_us,
            "decode_steps": l.steps.decode_steps,
            "decode_seqs": l.steps.decode_seqs,
            "decode_context": l.steps.decode_context,
            "decode_us": l.steps.decode_us,
            "mixed_steps": l.steps.mixed_steps,
            "mixed_seqs": l.steps.mixed_seqs,
            "mixed_us": l.steps.mixed_us,
        },
    })
}
