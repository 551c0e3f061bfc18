//! The built-in dashboard: `GET /dashboard`, a page embedded in the binary (plain SVG charts, no
//! CDN), refreshing every 2 s from `GET /admin/dashboard` (JSON: the planner actor's history of
//! per-pool samples, see [`super::history`], the nodes, the targets and the planner's decisions).
//! Its controls (drain, role switch) call the admin API.
//!
//! Access is the admin token's: a browser cannot send a bearer header on navigation, so
//! `POST /dashboard/login` (`{"token": ...}`) checks the token and sets it as an HttpOnly,
//! SameSite=Strict cookie, which the admin routes accept like the header (SameSite=Strict keeps
//! other sites' pages from posting with it). Without a valid cookie `/dashboard` shows a sign-in
//! form and no data; with the admin API closed (no `--admin-token`) it says so.

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::admin_access::{node_json, token_matches, AdminState};
pub use super::admin_access::{presented_token, COOKIE};
use crate::CoordinatorError;

const PAGE: &str = include_str!("dashboard.html");

const SIGN_IN: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cleave dashboard: sign in</title><link rel="icon" href="data:,">
<style>body{font:14px system-ui,sans-serif;margin:60px auto;max-width:420px;color:#1d2330}
input,button{font:inherit;padding:6px}input{width:100%}#msg{color:#c0392b}</style></head>
<body><h1>cleave</h1><p>The dashboard needs the coordinator's admin token (<code>--admin-token</code>;
<code>cleave up</code> prints it).</p>
<form id="f"><input id="token" type="password" autocomplete="off" placeholder="admin token">
<p><button id="signin" type="submit">Open the dashboard</button></p></form><p id="msg"></p>
<script>
document.getElementById("f").onsubmit = async e => {
  e.preventDefault();
  const r = await fetch("/dashboard/login", {method: "POST", headers: {"content-type": "application/json"},
    credentials: "same-origin", body: JSON.stringify({token: document.getElementById("token").value})});
  if (r.ok) location.reload(); else document.getElementById("msg").textContent = (await r.json()).error.message;
};
</script></body></html>"#;

const CLOSED: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cleave dashboard</title><link rel="icon" href="data:,"></head>
<body style="font:14px system-ui,sans-serif;margin:60px auto;max-width:420px">
<h1>cleave</h1><p>The admin API is closed: start the coordinator with <code>--admin-token</code> to
use the dashboard.</p></body></html>"#;

/// `GET /dashboard`: the page for a valid token, else the sign-in form.
pub async fn page(State(s): State<AdminState>, req: Request) -> Response {
    let html = match &s.token {
        None => CLOSED,
        Some(t) if presented_token(&req).is_some_and(|g| token_matches(g, t)) => PAGE,
        Some(_) => SIGN_IN,
    };
    ([(header::CACHE_CONTROL, "no-store")], Html(html)).into_response()
}

#[derive(Deserialize)]
pub struct Login {
    token: String,
}

/// `POST /dashboard/login`: sets the cookie for a valid token (204), else 401.
pub async fn login(State(s): State<AdminState>, body: Json<Login>) -> Result<Response, CoordinatorError> {
    let Some(t) = &s.token else {
        return Err(CoordinatorError::AdminUnauthorized {
            reason: "the admin API is closed: start the coordinator with --admin-token",
        });
    };
    if !token_matches(body.token.trim(), t) {
        return Err(CoordinatorError::AdminUnauthorized { reason: "wrong admin token" });
    }
    // A token is printable ASCII without `;` (checked at start), so it is a valid cookie value.
    let cookie = format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict", body.token.trim());
    let value = HeaderValue::from_str(&cookie)
        .map_err(|_| CoordinatorError::AdminUnauthorized { reason: "the admin token cannot be a cookie" })?;
    Ok((StatusCode::NO_CONTENT, [(header::SET_COOKIE, value)]).into_response())
}

/// `GET /admin/dashboard`: everything the page draws.
pub async fn data(State(s): State<AdminState>) -> Json<Value> {
    let states = s.cluster.node_states().await.unwrap_or_default();
    let samples = s.planner.history().await.unwrap_or(Value::Array(Vec::new()));
    let decisions = s.planner.decisions().await.unwrap_or(Value::Array(Vec::new()));
    let config = s.planner.config().await;
    let recent: Vec<Value> = decisions
        .as_array()
        .map(|d| {
            d.iter()
                .rev()
                .take(100)
                .rev()
                .map(|x| json!({"at_ms": x["at_ms"], "reason": x["reason"], "why": x["why"], "applied": x["applied"]}))
                .collect()
        })
        .unwrap_or_default();
    Json(json!({
        "targets": config.as_ref().map(|c| json!({"ttft_ms": c.targets.ttft_ms, "tpot_ms": c.targets.tpot_ms})),
        "planner_mode": config.as_ref().map(|c| c.mode),
        "samples": samples,
        "nodes": states.iter().map(node_json).collect::<Vec<_>>(),
        "decisions": recent,
    }))
}
