//! `cleave admin ...`: the admin API from the command line (for people who would rather not
//! curl). Prints the coordinator's JSON answer, pretty; a refusal exits non-zero with the
//! coordinator's message.

use anyhow::Context;
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub struct AdminArgs {
    /// The coordinator's admin address (its API address, or its --admin-listen).
    #[arg(long, default_value = "http://127.0.0.1:8000", env = "CLEAVE_ADMIN_URL")]
    pub url: String,
    /// The coordinator's --admin-token.
    #[arg(long, env = "CLEAVE_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    #[command(subcommand)]
    pub op: AdminOp,
}

#[derive(clap::Subcommand, Debug)]
pub enum AdminOp {
    /// Every live node: role, state, load.
    Nodes,
    /// Per pool: nodes, load, TTFT/TPOT percentiles and SLO attainment.
    Pools,
    /// Stop routing to a node; its work completes on it. Then it stays parked, or leaves.
    Drain {
        /// Node id (the `id` of `cleave admin nodes`).
        id: u64,
        /// Leave the cluster once drained (the node's process exits).
        #[arg(long)]
        leave: bool,
    },
    /// Switch a node's role without restarting it (prefill, decode, both).
    Role {
        id: u64,
        role: String,
        /// Most tokens per engine step (colocated nodes trade TTFT against TPOT with it).
        #[arg(long)]
        step_budget: Option<u32>,
    },
    /// Drain a node, then make it leave.
    Remove { id: u64 },
    /// The planner: settings, window statistics, predictions; with flags, change settings.
    Planner {
        /// off, advise or auto.
        #[arg(long)]
        mode: Option<String>,
        #[arg(long)]
        ttft_target_ms: Option<f64>,
        #[arg(long)]
        tpot_target_ms: Option<f64>,
        /// Colocated nodes held to this time per output token when tighter than the target
        /// (0: the target again).
        #[arg(long)]
        colocated_tpot_target_ms: Option<f64>,
        /// Any other settings, as the JSON of `PUT /admin/planner` (merged with the flags).
        #[arg(long)]
        json: Option<String>,
    },
    /// The planner's recent decisions, with their inputs, predictions and reasons.
    Decisions,
}

pub fn run(args: AdminArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let base = args.url.trim_end_matches('/').to_string();
        let client = reqwest::Client::new();
        let (method, path, body) = match args.op {
            AdminOp::Nodes => (reqwest::Method::GET, "/admin/nodes".to_string(), None),
            AdminOp::Pools => (reqwest::Method::GET, "/admin/pools".to_string(), None),
            AdminOp::Drain { id, leave } => (
                reqwest::Method::POST,
                format!("/admin/nodes/{id}/drain"),
                Some(json!({ "then": if leave { "leave" } else { "stay" } })),
            ),
            AdminOp::Role { id, role, step_budget } => {
                let mut b = json!({ "role": role });
                if let Some(t) = step_budget {
                    b["step_budget"] = json!(t);
                }
                (reqwest::Method::POST, format!("/admin/nodes/{id}/role"), Some(b))
            }
            AdminOp::Remove { id } => (reqwest::Method::DELETE, format!("/admin/nodes/{id}"), None),
            AdminOp::Planner { mode, ttft_target_ms, tpot_target_ms, colocated_tpot_target_ms, json } => {
                let mut b: Value = match json {
                    Some(j) => serde_json::from_str(&j).context("--json is not valid JSON")?,
                    None => json!({}),
                };
                let obj = b.as_object_mut().context("--json must be a JSON object")?;
                if let Some(m) = mode {
                    obj.insert("mode".into(), json!(m));
                }
                // The flags' targets join those the JSON names (a flag wins where both do).
                let mut targets = match obj.remove("targets") {
                    Some(Value::Object(t)) => t,
                    Some(_) => anyhow::bail!("--json: \"targets\" must be a JSON object"),
                    None => serde_json::Map::new(),
                };
                if let Some(t) = colocated_tpot_target_ms {
                    targets.insert("colocated_tpot_ms".into(), json!(t));
                }
                if let Some(t) = ttft_target_ms {
                    targets.insert("ttft_ms".into(), json!(t));
                }
                if let Some(t) = tpot_target_ms {
                    targets.insert("tpot_ms".into(), json!(t));
                }
                if !targets.is_empty() {
                    obj.insert("targets".into(), Value::Object(targets));
                }
                if obj.is_empty() {
                    (reqwest::Method::GET, "/admin/planner".to_string(), None)
                } else {
                    (reqwest::Method::PUT, "/admin/planner".to_string(), Some(b))
                }
            }
            AdminOp::Decisions => (reqwest::Method::GET, "/admin/planner/decisions".to_string(), None),
        };
        let mut req = client.request(method, format!("{base}{path}"));
        if let Some(t) = &args.admin_token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.with_context(|| format!("reaching the coordinator at {base}"))?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let shown = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or(text);
        if !status.is_success() {
            anyhow::bail!("the coordinator answered {status}: {shown}");
        }
        println!("{shown}");
        anyhow::Ok(())
    })
}
