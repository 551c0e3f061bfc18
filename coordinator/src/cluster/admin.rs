//! The admin API of the cluster: what an operator (and the process-level tests) look at.
//!
//! `GET /admin/nodes`: every live node with its role, addresses and last load report.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use super::{Cluster, ClusterHandle};
use crate::{router, AppState, CoordinatorError};

/// Routes of the admin API (unauthenticated, like /metrics: bind the API to a trusted
/// interface or put it behind a proxy when that matters).
pub fn admin_router(cluster: ClusterHandle) -> Router {
    Router::new().route("/admin/nodes", get(nodes)).with_state(cluster)
}

async fn nodes(State(cluster): State<ClusterHandle>) -> Json<Value> {
    let states = cluster.node_states().await.unwrap_or_default();
    let nodes: Vec<Value> = states
        .iter()
        .map(|s| {
            let l = &s.load;
            json!({
                "id": s.node.id,
                "name": s.node.name,
                "role": s.node.role.as_str(),
                "rpc_addr": s.node.rpc_addr.to_string(),
                "model": s.model_name,
                "report_age_ms": s.report_age.as_millis() as u64,
                "cached_prefix_blocks": s.cached_prefix_blocks,
                "load": {
                    "queued_prefill_tokens": l.queued_prefill_tokens,
                    "waiting_seqs": l.waiting_seqs,
                    "running_seqs": l.running_seqs,
                    "free_blocks": l.free_blocks,
                    "cached_blocks": l.cached_blocks,
                    "total_blocks": l.total_blocks,
                },
            })
        })
        .collect();
    Json(json!({ "nodes": nodes }))
}

/// Serves the OpenAI API and the admin API until `shutdown` resolves.
pub async fn serve_with_cluster(
    listener: TcpListener,
    state: AppState,
    cluster: &Cluster,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CoordinatorError> {
    let app = router(state).merge(admin_router(cluster.handle().clone()));
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(CoordinatorError::Serve)
}
