//! The admin API of the cluster: what an operator (and `cleave admin`) looks at and acts with.
//!
//! Every route requires `Authorization: Bearer <admin token>` (`--admin-token`, distinct from
//! the API key), or the dashboard's cookie that carries the same token (see
//! [`super::dashboard`]); without a configured token the admin API is closed and every route
//! answers 401 saying so. It can be served on its own listener (`--admin-listen`).
//!
//! - `GET /dashboard`: the built-in dashboard page; `GET /admin/dashboard`: its data.
//!
//! - `GET /admin/nodes`: every live node: role, lifecycle state, addresses, routed attempts,
//!   last load report. Node ids are the `id` field here.
//! - `GET /admin/pools`: per pool (prefill, decode, colocated): nodes, load, and the latency
//!   clients saw over the planner's window (TTFT/TPOT p50/p90, SLO attainment).
//! - `POST /admin/nodes/{id}/drain` (`{"then": "stay" | "leave"}`, default stay): stop routing
//!   to the node; its work completes on it.
//! - `POST /admin/nodes/{id}/role` (`{"role": "prefill" | "decode" | "both", "step_budget": n}`):
//!   switch roles without a restart (drains what the new role does not do first). Also undoes
//!   a drain.
//! - `DELETE /admin/nodes/{id}`: drain, then tell the node to leave (its process exits).
//! - `GET /admin/prometheus/targets`: the nodes' metrics endpoints in Prometheus's HTTP service
//!   discovery format, labelled `node`, `role`, `pool` and `state`.
//! - `GET /admin/planner`, `PUT /admin/planner` (any subset of the settings),
//!   `GET /admin/planner/decisions`.
//!
//! Statuses come from [`CoordinatorError`] only.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use cleave_protocol::control::NodeRole;
use serde::Deserialize;
use serde_json::{json, Value};

pub use super::admin_access::{node_json, AdminState};
use super::admin_access::{presented_token, same};
use super::dashboard;
use super::registry::{AfterDrain, NodeState, PoolSummary};
use super::{Cluster, NodeOp};
use crate::{router, AppState, CoordinatorError};

/// Routes of the admin API, behind the admin token, and the dashboard page (which checks the
/// token itself: it shows a sign-in form without it).
pub fn admin_router(state: AdminState) -> Router {
    let page = Router::new()
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/login", post(dashboard::login))
        .with_state(state.clone());
    Router::new()
        .route("/admin/dashboard", get(dashboard::data))
        .route("/admin/nodes", get(nodes))
        .route("/admin/nodes/{id}", axum::routing::delete(remove))
        .route("/admin/nodes/{id}/drain", post(drain))
        .route("/admin/nodes/{id}/role", post(set_role))
        .route("/admin/pools", get(pools))
        .route("/admin/prometheus/targets", get(prometheus_targets))
        .route("/admin/planner", get(planner_get).put(planner_put))
        .route("/admin/planner/decisions", get(decisions))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state)
        .merge(page)
}

/// Checks an admin token given on the command line: printable ASCII without spaces, `;` or `,`
/// (it travels in headers and in the dashboard's cookie), 8 to 256 characters.
pub fn validate_admin_token(s: &str) -> Result<String, String> {
    let ok = s.bytes().all(|b| b.is_ascii_graphic() && b != b';' && b != b',');
    if !ok || !(8..=256).contains(&s.len()) {
        return Err("an admin token is 8-256 printable ASCII characters without spaces, ';' or ','".into());
    }
    Ok(s.to_string())
}

async fn authorize(State(s): State<AdminState>, req: Request, next: Next) -> Result<Response, CoordinatorError> {
    let Some(token) = &s.token else {
        return Err(CoordinatorError::AdminUnauthorized {
            reason: "the admin API is closed: start the coordinator with --admin-token",
        });
    };
    match presented_token(&req) {
        None => Err(CoordinatorError::AdminUnauthorized { reason: "missing admin token (Authorization: Bearer ...)" }),
        Some(g) if !same(g.as_bytes(), token.as_bytes()) => {
            Err(CoordinatorError::AdminUnauthorized { reason: "wrong admin token" })
        }
        Some(_) => Ok(next.run(req).await),
    }
}

async fn nodes(State(s): State<AdminState>) -> Json<Value> {
    let states = s.cluster.node_states().await.unwrap_or_default();
    Json(json!({ "nodes": states.iter().map(node_json).collect::<Vec<_>>() }))
}

/// Prometheus HTTP service discovery (`http_sd_configs`): one target group per node that said
/// where it serves metrics, labelled with its name, role, pool and state. Prometheus re-reads it
/// every refresh interval, so a role switch relabels the node's series from then on. An
/// unspecified metrics address (`0.0.0.0`) is given the node's RPC host.
async fn prometheus_targets(State(s): State<AdminState>) -> Json<Value> {
    let states = s.cluster.node_states().await.unwrap_or_default();
    let groups: Vec<Value> = states
        .iter()
        .filter_map(|n| {
            let mut addr = n.metrics_addr?;
            if addr.ip().is_unspecified() {
                addr.set_ip(n.node.rpc_addr.ip());
            }
            let pool = match n.node.role {
                NodeRole::Prefill => "prefill",
                NodeRole::Decode => "decode",
                NodeRole::Both => "colocated",
            };
            Some(json!({
                "targets": [addr.to_string()],
                "labels": {
                    "node": n.node.name,
                    "role": n.node.role.as_str(),
                    "pool": pool,
                    "state": n.lifecycle.as_str(),
                },
            }))
        })
        .collect();
    Json(Value::Array(groups))
}

async fn pools(State(s): State<AdminState>) -> Result<Json<Value>, CoordinatorError> {
    let states = s.cluster.node_states().await.unwrap_or_default();
    let latency = s.planner.pool_latency().await.unwrap_or_default();
    let mut out = serde_json::Map::new();
    let summary = PoolSummary::of_states(&states);
    let roles = [NodeRole::Prefill, NodeRole::Decode, NodeRole::Both];
    for ((pool, load), role) in summary.named().into_iter().zip(roles) {
        let members: Vec<&NodeState> = states.iter().filter(|n| n.node.role == role).collect();
        out.insert(
            pool.into(),
            json!({
                "nodes": members.iter().map(|n| json!({"id": n.node.id, "name": n.node.name, "state": n.lifecycle.as_str()})).collect::<Vec<_>>(),
                "active_nodes": load.nodes,
                "queued_prefill_tokens": load.queued_prefill_tokens,
                "running_seqs": load.running_seqs,
                "waiting_seqs": load.waiting_seqs,
                "kv_usage_ratio": load.kv_usage(),
                "latency": latency.get(pool).cloned().unwrap_or(Value::Null),
            }),
        );
    }
    let targets = s.planner.config().await.map(|c| json!({"ttft_ms": c.targets.ttft_ms, "tpot_ms": c.targets.tpot_ms}));
    Ok(Json(json!({ "pools": out, "targets": targets, "overall": latency.get("overall").cloned() })))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    #[serde(default)]
    then: Option<String>,
}

fn parse_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, CoordinatorError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| CoordinatorError::MalformedJson { reason: e.to_string() })
}

async fn drain(
    State(s): State<AdminState>,
    Path(id): Path<u64>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, CoordinatorError> {
    let b: DrainBody = parse_body(&body)?;
    let then = match b.then.as_deref() {
        None | Some("stay") => AfterDrain::Stay,
        Some("leave") => AfterDrain::Leave,
        Some(other) => {
            return Err(CoordinatorError::InvalidParam {
                param: "then".into(),
                message: format!("`{other}` is not one of stay, leave"),
            })
        }
    };
    s.cluster.node_op(NodeOp::Drain { node: id, then }).await?;
    Ok(Json(json!({ "id": id, "state": "draining", "then": b.then.as_deref().unwrap_or("stay") })))
}

async fn remove(State(s): State<AdminState>, Path(id): Path<u64>) -> Result<Json<Value>, CoordinatorError> {
    s.cluster.node_op(NodeOp::Drain { node: id, then: AfterDrain::Leave }).await?;
    Ok(Json(json!({ "id": id, "state": "draining", "then": "leave" })))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RoleBody {
    role: Option<String>,
    #[serde(default)]
    step_budget: Option<u32>,
}

/// `prefill`, `decode`, `both` (or `colocated`).
pub fn parse_role(s: &str) -> Option<NodeRole> {
    match s {
        "prefill" => Some(NodeRole::Prefill),
        "decode" => Some(NodeRole::Decode),
        "both" | "colocated" => Some(NodeRole::Both),
        _ => None,
    }
}

async fn set_role(
    State(s): State<AdminState>,
    Path(id): Path<u64>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, CoordinatorError> {
    let b: RoleBody = parse_body(&body)?;
    let given = b.role.ok_or_else(|| CoordinatorError::InvalidParam {
        param: "role".into(),
        message: "required: one of prefill, decode, both".into(),
    })?;
    let role = parse_role(&given).ok_or_else(|| CoordinatorError::InvalidParam {
        param: "role".into(),
        message: format!("`{given}` is not one of prefill, decode, both"),
    })?;
    s.cluster.node_op(NodeOp::SetRole { node: id, role, step_budget: b.step_budget }).await?;
    Ok(Json(json!({ "id": id, "role": role.as_str(), "step_budget": b.step_budget, "state": "switching" })))
}

async fn planner_get(State(s): State<AdminState>) -> Result<Json<Value>, CoordinatorError> {
    let status = s.planner.status().await.ok_or(CoordinatorError::RouterGone)?;
    Ok(Json(status))
}

async fn planner_put(State(s): State<AdminState>, body: axum::body::Bytes) -> Result<Json<Value>, CoordinatorError> {
    let update: cleave_planner::PlannerUpdate =
        serde_json::from_slice(&body).map_err(|e| CoordinatorError::MalformedJson { reason: e.to_string() })?;
    let cfg = s.planner.update(update).await.ok_or(CoordinatorError::RouterGone)?.map_err(CoordinatorError::Planner)?;
    Ok(Json(serde_json::to_value(cfg).unwrap_or(Value::Null)))
}

async fn decisions(State(s): State<AdminState>) -> Result<Json<Value>, CoordinatorError> {
    let d = s.planner.decisions().await.ok_or(CoordinatorError::RouterGone)?;
    Ok(Json(json!({ "decisions": d })))
}

/// Serves the OpenAI API and the admin API (on the same listener, or the admin API on
/// `admin_listener`) until `shutdown` resolves.
pub async fn serve_with_cluster(
    listener: crate::edge::EdgeListener,
    admin_listener: Option<crate::edge::EdgeListener>,
    state: AppState,
    cluster: &Cluster,
    admin_token: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CoordinatorError> {
    let admin = admin_router(AdminState {
        cluster: cluster.handle().clone(),
        planner: cluster.planner().clone(),
        token: admin_token.map(Arc::from),
    });
    match admin_listener {
        None => {
            let app = router(state).merge(admin);
            axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(CoordinatorError::Serve)
        }
        Some(al) => {
            let (tx, rx) = tokio::sync::watch::channel(false);
            let mut rx2 = rx.clone();
            let admin_srv = axum::serve(al, admin).with_graceful_shutdown(async move {
                let _ = rx2.wait_for(|v| *v).await;
            });
            let admin_task = tokio::spawn(async move { admin_srv.await });
            let mut rx1 = rx;
            let api = axum::serve(listener, router(state)).with_graceful_shutdown(async move {
                let _ = rx1.wait_for(|v| *v).await;
            });
            let stopper = tokio::spawn(async move {
                shutdown.await;
                let _ = tx.send(true);
            });
            let r = api.await.map_err(CoordinatorError::Serve);
            stopper.abort();
            let _ = admin_task.await;
            r
        }
    }
}
