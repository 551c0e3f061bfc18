//! The Kubernetes actuator (feature `kubernetes`): the planner's node count changes become
//! changes of the node Deployments' `replicas`, through their `scale` subresource. Role switches
//! and step budgets of live nodes go to [`RoleSwitch`] as with the default actuator.
//!
//! What it assumes of the cluster (the Helm chart in `deploy/helm/cleave` sets it up): each
//! role's nodes run as one Deployment (`cleave prefill`, `cleave decode`, optionally colocated
//! `cleave node --role both`), every node's `--name` is its pod's name, and the coordinator's
//! service account may get/patch `deployments/scale` and get/patch pods in the namespace.
//!
//! # StartNode { role }
//! GET the role's Deployment's scale, then PATCH `spec.replicas` to one more (a JSON merge patch
//! that carries the `resourceVersion` it read: a concurrent change answers 409 and the pair is
//! retried, [`CONFLICT_ATTEMPTS`] times at most, so two scale-ups never collapse into one). The
//! new pod registers like any node. `Both` needs a colocated Deployment, else `apply` refuses.
//!
//! # StopNode { node }
//! 1. Drain the node in the registry and park it ([`AfterDrain::Stay`]): it takes no new work
//!    and finishes what it has.
//! 2. Poll the registry ([`ClusterHandle::node_states`], every `poll_interval`, at most
//!    `drain_timeout`) until the node is parked, or gone (its process ended).
//! 3. GET the pod named like the node and find its Deployment (the controlling ReplicaSet
//!    `<deployment>-<pod-template-hash>`); refuse a pod owned by none of the configured ones.
//! 4. PATCH the pod's annotation `controller.kubernetes.io/pod-deletion-cost: "-1000"`.
//! 5. Scale that Deployment down by one (as in StartNode): its ReplicaSet deletes the pod with
//!    the lowest deletion cost, this one; the kubelet sends SIGTERM; the parked node, idle,
//!    exits; its control stream ends and the registry removes it.
//! 6. Poll (at most `leave_timeout`) until the node has left the registry, and report.
//!
//! Why park rather than `AfterDrain::Leave` (what [`RoleSwitch`] does): a node told to leave
//! exits with status 0, and a Deployment's pod restarts its container (`restartPolicy: Always`)
//! at once, so the same pod would load the model again and re-register before the ReplicaSet
//! removed it. A parked node stays up, idle, until its pod is deleted.
//!
//! # Failure modes (every one is logged with its facts and sent to [`KubernetesActuator::subscribe`])
//! - The API refuses a call (403 without RBAC, 404 for a missing Deployment or pod, 422 for a
//!   bad patch): StartNode changes nothing; StopNode leaves the node parked (no work, visible
//!   as `drained` in `/admin/nodes`; a role switch brings it back).
//! - The drain does not finish within `drain_timeout` (a long request): nothing is changed in
//!   Kubernetes; the node parks later on its own and stays parked.
//! - The node is given a role again while draining (an operator, the planner): the stop is
//!   abandoned and the node left to its new role.
//! - The node is gone before step 3 (it died; its container may be restarting in the same
//!   pod): the pod is still annotated and removed, which is what the stop asked for.
//! - Kubernetes ranks pods before the deletion cost (pending before running, not ready before
//!   ready): if another pod of the Deployment is pending or not ready at step 5, the ReplicaSet
//!   deletes that one instead. The node then does not leave within `leave_timeout`; the report
//!   says so (`left: false`) and the node stays parked.
//! - Something else scales the Deployment (an HPA, `helm upgrade`, a person): the last writer
//!   wins; the conflict retry only keeps concurrent +1/-1 from being lost.
//! - Two StopNodes for one node: the second is refused while the first runs.
//!
//! Tasks: one actor owns the set of nodes being stopped and spawns one task per job; `apply`
//! only queues (bounded; a full queue is an error to the planner, never a wait).
//!
//! Allowed dependencies: kube / k8s-openapi (the API), the registry through [`ClusterHandle`].
//! Invariant: this module never scales a Deployment it was not configured with.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use cleave_planner::{Action, Role};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinSet;

use super::registry::{AfterDrain, Lifecycle, NodeState};
use super::{Actuator, ActuatorError, ClusterHandle, NodeOp, RoleSwitch};

/// The annotation the ReplicaSet controller ranks pods by when it scales down (lowest first).
pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
/// The cost given to a pod whose node is being stopped.
pub const STOPPING_COST: &str = "-1000";
/// The field manager named on every patch (shows in `managedFields`).
pub const FIELD_MANAGER: &str = "cleave-coordinator";
/// GET+PATCH pairs tried on a scale before a run of 409 Conflicts is an error.
pub const CONFLICT_ATTEMPTS: u32 = 5;
/// StartNode/StopNode jobs queued at once; one more is refused.
const QUEUE: usize = 64;

/// How the coordinator carries out the planner's actions (flatten into the coordinator's CLI).
#[derive(clap::Args, Debug, Clone)]
pub struct K8sArgs {
    /// role-switch: switch roles of live nodes only (nodes cannot be added); kubernetes: also
    /// add and remove nodes by scaling the node Deployments through the Kubernetes API
    /// (in-cluster service account, or the kubeconfig).
    #[arg(long, value_enum, default_value_t = ActuatorKind::RoleSwitch)]
    pub actuator: ActuatorKind,
    /// Namespace of the node Deployments (default: the service account's, or the kubeconfig's).
    #[arg(long, env = "CLEAVE_K8S_NAMESPACE")]
    pub k8s_namespace: Option<String>,
    /// Deployment of the prefill nodes.
    #[arg(long, env = "CLEAVE_K8S_PREFILL_DEPLOYMENT", default_value = "cleave-prefill")]
    pub k8s_prefill_deployment: String,
    /// Deployment of the decode nodes.
    #[arg(long, env = "CLEAVE_K8S_DECODE_DEPLOYMENT", default_value = "cleave-decode")]
    pub k8s_decode_deployment: String,
    /// Deployment of colocated nodes (`cleave node --role both`); without it the planner's
    /// requests to start colocated nodes are refused.
    #[arg(long, env = "CLEAVE_K8S_COLOCATED_DEPLOYMENT")]
    pub k8s_colocated_deployment: Option<String>,
    /// Seconds a stopping node may take to finish its work before the stop is abandoned.
    #[arg(long, default_value_t = 600.0)]
    pub k8s_drain_timeout_secs: f64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActuatorKind {
    RoleSwitch,
    Kubernetes,
}

impl K8sArgs {
    /// The actuator's settings; None when `--actuator role-switch`.
    pub fn to_config(&self) -> Result<Option<K8sConfig>, K8sError> {
        if self.actuator == ActuatorKind::RoleSwitch {
            return Ok(None);
        }
        if !(self.k8s_drain_timeout_secs.is_finite() && self.k8s_drain_timeout_secs > 0.0) {
            return Err(K8sError::Config { reason: "--k8s-drain-timeout-secs must be a number of seconds > 0".into() });
        }
        Ok(Some(K8sConfig {
            namespace: self.k8s_namespace.clone(),
            prefill_deployment: self.k8s_prefill_deployment.clone(),
            decode_deployment: self.k8s_decode_deployment.clone(),
            colocated_deployment: self.k8s_colocated_deployment.clone(),
            drain_timeout: Duration::from_secs_f64(self.k8s_drain_timeout_secs),
            ..K8sConfig::default()
        }))
    }
}

/// The Kubernetes client for `--actuator kubernetes` (None for `role-switch`), connected before
/// the cluster starts; the cluster then builds the actuator from it:
///
/// ```ignore
/// let cluster = match k8s::client_from_args(&args).await? {
///     Some(k) => Cluster::start_with(cfg, fingerprint, control, dispatches, |h| Box::new(k.into_actuator(h))),
///     None => Cluster::start(cfg, fingerprint, control, dispatches),
/// }?;
/// ```
pub async fn client_from_args(args: &K8sArgs) -> Result<Option<K8sClient>, K8sError> {
    match args.to_config()? {
        Some(cfg) => Ok(Some(K8sClient::connect(cfg).await?)),
        None => Ok(None),
    }
}

/// Settings of [`KubernetesActuator`].
#[derive(Debug, Clone)]
pub struct K8sConfig {
    /// Namespace of the Deployments and pods; None: the client configuration's default (the
    /// service account's namespace in a pod).
    pub namespace: Option<String>,
    pub prefill_deployment: String,
    pub decode_deployment: String,
    /// Where `StartNode { role: Both }` goes; None refuses it.
    pub colocated_deployment: Option<String>,
    /// An explicit API server (tests, or outside a cluster without a kubeconfig); None:
    /// `kube::Config::infer()` (kubeconfig, else the in-cluster service account).
    pub api: Option<ApiServer>,
    /// Bound on a StopNode's drain.
    pub drain_timeout: Duration,
    /// Bound on the wait for a stopped node to leave after the scale-down.
    pub leave_timeout: Duration,
    /// How often the registry is polled during a stop.
    pub poll_interval: Duration,
    /// Bound on each API call's response.
    pub request_timeout: Duration,
}

impl Default for K8sConfig {
    fn default() -> Self {
        Self {
            namespace: None,
            prefill_deployment: "cleave-prefill".into(),
            decode_deployment: "cleave-decode".into(),
            colocated_deployment: None,
            api: None,
            drain_timeout: Duration::from_secs(600),
            leave_timeout: Duration::from_secs(120),
            poll_interval: Duration::from_millis(500),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// An API server given explicitly.
#[derive(Clone)]
pub struct ApiServer {
    /// `https://host:port` (or `http://` for a local fake).
    pub url: String,
    /// Sent as `Authorization: Bearer`.
    pub token: Option<String>,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer").field("url", &self.url).field("token", &self.token.as_ref().map(|_| "…")).finish()
    }
}

/// Why a Kubernetes action failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum K8sError {
    #[error("kubernetes client configuration: {reason}")]
    Config { reason: String },
    #[error("{request}: the API server answered {code} {reason}: {message}")]
    Api { request: String, code: u16, reason: String, message: String },
    #[error("{request}: {reason}")]
    Request { request: String, reason: String },
    #[error("{request}: {attempts} attempts in a row lost to concurrent changes (409 Conflict)")]
    Conflict { request: String, attempts: u32 },
    #[error("deployment {deployment} has no replicas to remove")]
    NoReplicas { deployment: String },
    #[error("no Deployment is configured for {role} nodes")]
    NoDeployment { role: &'static str },
    #[error("node {node} is not in the registry")]
    UnknownNode { node: u64 },
    #[error("node {node} is already being stopped")]
    AlreadyStopping { node: u64 },
    #[error("node {node}: the registry refused the drain: {reason}")]
    Drain { node: u64, reason: String },
    #[error("node {node} ({name}) did not drain within {secs} s; nothing was changed in Kubernetes")]
    DrainTimeout { node: u64, name: String, secs: u64 },
    #[error("node {node} ({name}) became {lifecycle} while being stopped; the stop is abandoned")]
    Superseded { node: u64, name: String, lifecycle: &'static str },
    #[error("pod {pod} is owned by {owner}, not by one of the Deployments {deployments:?}; not scaled")]
    NotOwned { pod: String, owner: String, deployments: Vec<String> },
    #[error("the coordinator is shutting down")]
    ShuttingDown,
}

impl K8sError {
    fn from_kube(request: String, e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => K8sError::Api { request, code: s.code, reason: s.reason, message: s.message },
            other => K8sError::Request { request, reason: other.to_string() },
        }
    }

    fn is_conflict(&self) -> bool {
        matches!(self, K8sError::Api { code: 409, .. })
    }
}

/// A capacity change carried out through Kubernetes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    StartNode { role: Role },
    StopNode { node: u64 },
}

/// What a job did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Done {
    /// `deployment`'s replicas went from `from` to `to`.
    Scaled { deployment: String, from: i32, to: i32 },
    /// The node drained, its pod was marked and its Deployment scaled down; `left`: the node
    /// left the registry within the leave timeout (else another pod was removed, see the
    /// module docs, and the node stays parked).
    Stopped { node: u64, pod: String, deployment: String, from: i32, to: i32, left: bool },
}

/// The outcome of one job, as sent to [`KubernetesActuator::subscribe`]rs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub job: Job,
    pub outcome: Result<Done, K8sError>,
}

/// An API client and the actuator's settings: what [`KubernetesActuator`] is made of once the
/// cluster exists (its configuration is found asynchronously; the cluster's actuator factory is
/// synchronous).
pub struct K8sClient {
    kube: Kube,
    cfg: K8sConfig,
}

impl K8sClient {
    /// Reads the client configuration (`cfg.api`, else kubeconfig or service account) and
    /// builds the client. Nothing is sent to the API server yet.
    pub async fn connect(cfg: K8sConfig) -> Result<Self, K8sError> {
        let mut kube_cfg = match &cfg.api {
            Some(api) => {
                let url =
                    api.url.parse().map_err(|e| K8sError::Config { reason: format!("API URL `{}`: {e}", api.url) })?;
                let mut c = kube::Config::new(url);
                c.auth_info.token = api.token.clone().map(Into::into);
                c
            }
            None => kube::Config::infer().await.map_err(|e| K8sError::Config {
                reason: format!("no kubeconfig and not in a pod with a service account: {e}"),
            })?,
        };
        kube_cfg.read_timeout = Some(cfg.request_timeout);
        let namespace = cfg.namespace.clone().unwrap_or_else(|| kube_cfg.default_namespace.clone());
        let client = kube::Client::try_from(kube_cfg).map_err(|e| K8sError::Config { reason: e.to_string() })?;
        let kube = Kube {
            pods: Api::namespaced(client.clone(), &namespace),
            deployments: Api::namespaced(client, &namespace),
            namespace,
        };
        Ok(Self { kube, cfg })
    }

    /// The actuator acting on `cluster`; starts its task (must run inside a tokio runtime).
    pub fn into_actuator(self, cluster: ClusterHandle) -> KubernetesActuator {
        let (jobs_tx, jobs) = mpsc::channel(QUEUE);
        let (reports, _) = broadcast::channel(64);
        let colocated = self.cfg.colocated_deployment.is_some();
        tracing::info!(
            namespace = %self.kube.namespace,
            prefill = %self.cfg.prefill_deployment,
            decode = %self.cfg.decode_deployment,
            colocated = ?self.cfg.colocated_deployment,
            "kubernetes actuator ready"
        );
        let ctx = Arc::new(Ctx { kube: self.kube, cfg: self.cfg, cluster: cluster.clone() });
        tokio::spawn(run(ctx, jobs, reports.clone()));
        KubernetesActuator { jobs: jobs_tx, role_switch: RoleSwitch::new(cluster), colocated, reports }
    }
}

/// Carries out planner actions on Kubernetes (see the module docs).
pub struct KubernetesActuator {
    jobs: mpsc::Sender<Job>,
    role_switch: RoleSwitch,
    colocated: bool,
    reports: broadcast::Sender<Report>,
}

impl KubernetesActuator {
    /// Reports of the jobs that end from now on (successes and failures).
    pub fn subscribe(&self) -> broadcast::Receiver<Report> {
        self.reports.subscribe()
    }

    fn queue(&self, job: Job) -> Result<(), ActuatorError> {
        self.jobs.try_send(job).map_err(|e| ActuatorError::Failed {
            actuator: "kubernetes",
            reason: match e {
                mpsc::error::TrySendError::Full(_) => format!("{QUEUE} jobs already queued; {job:?} refused"),
                mpsc::error::TrySendError::Closed(_) => "the actuator task has stopped".into(),
            },
        })
    }
}

impl Actuator for KubernetesActuator {
    fn apply(&mut self, action: &Action) -> Result<(), ActuatorError> {
        match *action {
            Action::StartNode { role: Role::Both } if !self.colocated => Err(ActuatorError::Unsupported {
                actuator: self.name(),
                what: "start colocated nodes (no colocated Deployment is configured)",
            }),
            Action::StartNode { role } => self.queue(Job::StartNode { role }),
            Action::StopNode { node } => self.queue(Job::StopNode { node }),
            Action::SwitchRole { .. } | Action::SetStepBudget { .. } => self.role_switch.apply(action),
        }
    }

    fn can_add_nodes(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "kubernetes"
    }
}

/// The API objects the actuator touches, in its namespace.
struct Kube {
    namespace: String,
    deployments: Api<Deployment>,
    pods: Api<Pod>,
}

struct Ctx {
    kube: Kube,
    cfg: K8sConfig,
    cluster: ClusterHandle,
}

/// The actor: runs each job on a task of its own; owns the set of nodes being stopped. Ends
/// when the actuator is dropped and its jobs are done.
async fn run(ctx: Arc<Ctx>, mut jobs: mpsc::Receiver<Job>, reports: broadcast::Sender<Report>) {
    let mut stopping = HashSet::new();
    let mut tasks: JoinSet<Report> = JoinSet::new();
    // Which job each task runs, for a task that panics (it still ends its node's stop).
    let mut running = HashMap::new();
    let mut open = true;
    while open || !tasks.is_empty() {
        tokio::select! {
            job = jobs.recv(), if open => match job {
                None => open = false,
                Some(job) => {
                    if let Job::StopNode { node } = job {
                        if !stopping.insert(node) {
                            publish(&reports, Report { job, outcome: Err(K8sError::AlreadyStopping { node }) });
                            continue;
                        }
                    }
                    let ctx = ctx.clone();
                    let task = tasks.spawn(async move { Report { job, outcome: carry_out(&ctx, job).await } });
                    running.insert(task.id(), job);
                }
            },
            Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let (id, report) = match done {
                    Ok((id, report)) => (id, Some(report)),
                    Err(e) => {
                        tracing::error!(error = %e, "kubernetes actuator job panicked");
                        (e.id(), None)
                    }
                };
                if let Some(Job::StopNode { node }) = running.remove(&id) {
                    stopping.remove(&node);
                }
                if let Some(report) = report {
                    publish(&reports, report);
                }
            }
        }
    }
}

/// Logs a report with its facts and hands it to the subscribers.
fn publish(reports: &broadcast::Sender<Report>, report: Report) {
    match &report.outcome {
        Ok(Done::Stopped { left: false, node, pod, deployment, .. }) => tracing::warn!(
            job = ?report.job, node, %pod, %deployment,
            "deployment scaled down, but the node has not left: the ReplicaSet removed another pod \
             (one pending or not ready ranks before deletion cost); the node stays parked"
        ),
        Ok(done) => tracing::info!(job = ?report.job, ?done, "kubernetes action done"),
        Err(e) => tracing::error!(job = ?report.job, error = %e, "kubernetes action failed"),
    }
    let _ = reports.send(report);
}

async fn carry_out(ctx: &Ctx, job: Job) -> Result<Done, K8sError> {
    match job {
        Job::StartNode { role } => {
            let deployment = deployment_of(&ctx.cfg, role)?;
            let (from, to) = scale_by(&ctx.kube, deployment, 1).await?;
            Ok(Done::Scaled { deployment: deployment.to_string(), from, to })
        }
        Job::StopNode { node } => stop(ctx, node).await,
    }
}

fn deployment_of(cfg: &K8sConfig, role: Role) -> Result<&str, K8sError> {
    match role {
        Role::Prefill => Ok(&cfg.prefill_deployment),
        Role::Decode => Ok(&cfg.decode_deployment),
        Role::Both => cfg.colocated_deployment.as_deref().ok_or(K8sError::NoDeployment { role: "colocated" }),
    }
}

fn configured_deployments(cfg: &K8sConfig) -> Vec<String> {
    let mut d = vec![cfg.prefill_deployment.clone(), cfg.decode_deployment.clone()];
    d.extend(cfg.colocated_deployment.clone());
    d
}

/// The stop sequence of the module docs.
async fn stop(ctx: &Ctx, node: u64) -> Result<Done, K8sError> {
    let states = ctx.cluster.node_states().await.ok_or(K8sError::ShuttingDown)?;
    let name = states.iter().find(|s| s.node.id == node).ok_or(K8sError::UnknownNode { node })?.node.name.clone();
    ctx.cluster
        .node_op(NodeOp::Drain { node, then: AfterDrain::Stay })
        .await
        .map_err(|e| K8sError::Drain { node, reason: e.to_string() })?;
    let deadline = tokio::time::Instant::now() + ctx.cfg.drain_timeout;
    loop {
        let states = ctx.cluster.node_states().await.ok_or(K8sError::ShuttingDown)?;
        match drain_progress(states.iter().find(|s| s.node.id == node)) {
            DrainProgress::Parked | DrainProgress::Gone => break,
            DrainProgress::Draining => {}
            DrainProgress::Superseded(lifecycle) => return Err(K8sError::Superseded { node, name, lifecycle }),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(K8sError::DrainTimeout { node, name, secs: ctx.cfg.drain_timeout.as_secs() });
        }
        tokio::time::sleep(ctx.cfg.poll_interval).await;
    }

    let pod = ctx.kube.pods.get(&name).await.map_err(|e| K8sError::from_kube(pod_request(ctx, "GET", &name), e))?;
    let deployment = owner_deployment(&pod, &configured_deployments(&ctx.cfg)).map_err(|owner| K8sError::NotOwned {
        pod: name.clone(),
        owner,
        deployments: configured_deployments(&ctx.cfg),
    })?;
    let patch =
        PodPatch { metadata: PodPatchMeta { annotations: [(POD_DELETION_COST, STOPPING_COST)].into_iter().collect() } };
    ctx.kube
        .pods
        .patch(&name, &patch_params(), &Patch::Merge(&patch))
        .await
        .map_err(|e| K8sError::from_kube(pod_request(ctx, "PATCH", &name), e))?;
    let (from, to) = scale_by(&ctx.kube, &deployment, -1).await?;

    let deadline = tokio::time::Instant::now() + ctx.cfg.leave_timeout;
    let left = loop {
        let states = ctx.cluster.node_states().await.ok_or(K8sError::ShuttingDown)?;
        if !states.iter().any(|s| s.node.id == node) {
            break true;
        }
        if tokio::time::Instant::now() >= deadline {
            break false;
        }
        tokio::time::sleep(ctx.cfg.poll_interval).await;
    };
    Ok(Done::Stopped { node, pod: name, deployment, from, to, left })
}

/// Where a stopping node's drain stands, from its registry state (None: not registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrainProgress {
    Draining,
    Parked,
    Gone,
    /// It was given work or a role again (lifecycle named).
    Superseded(&'static str),
}

fn drain_progress(state: Option<&NodeState>) -> DrainProgress {
    let Some(s) = state else { return DrainProgress::Gone };
    match s.lifecycle {
        Lifecycle::Drained => DrainProgress::Parked,
        // Told to leave by someone else: its process exits, and the node is gone soon.
        Lifecycle::Draining { then: AfterDrain::Stay | AfterDrain::Leave, .. } | Lifecycle::Leaving => {
            DrainProgress::Draining
        }
        l @ (Lifecycle::Active | Lifecycle::Draining { then: AfterDrain::Role { .. }, .. }) => {
            DrainProgress::Superseded(l.as_str())
        }
    }
}

/// The configured Deployment that owns `pod` (through its controlling ReplicaSet, named
/// `<deployment>-<pod-template-hash>`), or the owner it has instead.
fn owner_deployment(pod: &Pod, deployments: &[String]) -> Result<String, String> {
    let meta = &pod.metadata;
    let Some(rs) = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "ReplicaSet" && o.api_version == "apps/v1")
    else {
        return Err("no controlling ReplicaSet".into());
    };
    let hash = meta.labels.as_ref().and_then(|l| l.get("pod-template-hash"));
    let deployment = match hash {
        Some(h) => rs.name.strip_suffix(h.as_str()).and_then(|s| s.strip_suffix('-')),
        None => rs.name.rsplit_once('-').map(|(d, _)| d),
    };
    match deployment {
        Some(d) if deployments.iter().any(|c| c == d) => Ok(d.to_string()),
        _ => Err(format!("ReplicaSet {}", rs.name)),
    }
}

fn pod_request(ctx: &Ctx, verb: &str, name: &str) -> String {
    format!("{verb} namespaces/{}/pods/{name}", ctx.kube.namespace)
}

fn patch_params() -> PatchParams {
    PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() }
}

#[derive(Debug, Serialize)]
struct PodPatch {
    metadata: PodPatchMeta,
}

#[derive(Debug, Serialize)]
struct PodPatchMeta {
    annotations: std::collections::BTreeMap<&'static str, &'static str>,
}

/// A merge patch of a scale subresource; `resourceVersion` makes it conditional on the GET.
#[derive(Debug, Serialize)]
struct ScalePatch {
    metadata: ScalePatchMeta,
    spec: ScalePatchSpec,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ScalePatchMeta {
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_version: Option<String>,
}

#[derive(Debug, Serialize)]
struct ScalePatchSpec {
    replicas: i32,
}

/// Adds `delta` to `deployment`'s replicas (GET, then a PATCH conditional on what was read;
/// a 409 repeats the pair). Returns (before, after).
async fn scale_by(kube: &Kube, deployment: &str, delta: i32) -> Result<(i32, i32), K8sError> {
    let request = |verb: &str| format!("{verb} namespaces/{}/deployments/{deployment}/scale", kube.namespace);
    for _ in 0..CONFLICT_ATTEMPTS {
        let scale = kube.deployments.get_scale(deployment).await.map_err(|e| K8sError::from_kube(request("GET"), e))?;
        let from = scale.spec.and_then(|s| s.replicas).unwrap_or(0);
        let to = from + delta;
        if to < 0 {
            return Err(K8sError::NoReplicas { deployment: deployment.to_string() });
        }
        let patch = ScalePatch {
            metadata: ScalePatchMeta { resource_version: scale.metadata.resource_version },
            spec: ScalePatchSpec { replicas: to },
        };
        match kube.deployments.patch_scale(deployment, &patch_params(), &Patch::Merge(&patch)).await {
            Ok(s) => return Ok((from, s.spec.and_then(|s| s.replicas).unwrap_or(to))),
            Err(e) => {
                let e = K8sError::from_kube(request("PATCH"), e);
                if !e.is_conflict() {
                    return Err(e);
                }
                tracing::debug!(%deployment, "scale changed between GET and PATCH; again");
            }
        }
    }
    Err(K8sError::Conflict { request: request("PATCH"), attempts: CONFLICT_ATTEMPTS })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn pod(owner: Option<(&str, &str)>, hash: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                owner_references: owner.map(|(kind, name)| {
                    vec![OwnerReference {
                        api_version: "apps/v1".into(),
                        kind: kind.into(),
                        name: name.into(),
                        uid: "u".into(),
                        controller: Some(true),
                        ..Default::default()
                    }]
                }),
                labels: hash.map(|h| [("pod-template-hash".to_string(), h.to_string())].into_iter().collect()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn owner_is_the_replicaset_name_without_its_hash() {
        let deps = vec!["cleave-prefill".to_string(), "cleave-prefill-big".to_string()];
        let p = pod(Some(("ReplicaSet", "cleave-prefill-big-7d9f8c6b5")), Some("7d9f8c6b5"));
        assert_eq!(owner_deployment(&p, &deps), Ok("cleave-prefill-big".into()));
        let p = pod(Some(("ReplicaSet", "cleave-prefill-7d9f8c6b5")), None);
        assert_eq!(owner_deployment(&p, &deps), Ok("cleave-prefill".into()));
        // Not one of ours, not a ReplicaSet, no owner: refused with what it is.
        let p = pod(Some(("ReplicaSet", "other-7d9f8c6b5")), Some("7d9f8c6b5"));
        assert_eq!(owner_deployment(&p, &deps), Err("ReplicaSet other-7d9f8c6b5".into()));
        assert!(owner_deployment(&pod(Some(("StatefulSet", "cleave-prefill")), None), &deps).is_err());
        assert!(owner_deployment(&pod(None, None), &deps).is_err());
    }

    #[test]
    fn a_stop_waits_for_parked_or_gone_and_yields_to_a_new_role() {
        use cleave_protocol::control::NodeRole;
        let state = |lifecycle| NodeState::for_test(1, NodeRole::Decode, lifecycle, Default::default());
        let since = std::time::Instant::now();
        let progress = |l| drain_progress(Some(&state(l)));
        assert_eq!(drain_progress(None), DrainProgress::Gone);
        assert_eq!(progress(Lifecycle::Drained), DrainProgress::Parked);
        assert_eq!(progress(Lifecycle::Draining { then: AfterDrain::Stay, since }), DrainProgress::Draining);
        assert_eq!(progress(Lifecycle::Draining { then: AfterDrain::Leave, since }), DrainProgress::Draining);
        assert_eq!(progress(Lifecycle::Leaving), DrainProgress::Draining);
        assert_eq!(progress(Lifecycle::Active), DrainProgress::Superseded("active"));
        let switching =
            Lifecycle::Draining { then: AfterDrain::Role { role: NodeRole::Both, step_budget: None }, since };
        assert_eq!(progress(switching), DrainProgress::Superseded("switching"));
    }

    #[test]
    fn only_config_with_kubernetes_actuator() {
        let args = K8sArgs {
            actuator: ActuatorKind::RoleSwitch,
            k8s_namespace: None,
            k8s_prefill_deployment: "p".into(),
            k8s_decode_deployment: "d".into(),
            k8s_colocated_deployment: None,
            k8s_drain_timeout_secs: 600.0,
        };
        assert!(args.to_config().unwrap().is_none());
        let k = K8sArgs { actuator: ActuatorKind::Kubernetes, ..args.clone() };
        let c = k.to_config().unwrap().unwrap();
        assert_eq!((c.prefill_deployment.as_str(), c.decode_deployment.as_str()), ("p", "d"));
        assert!(deployment_of(&c, Role::Both).is_err());
        let bad = K8sArgs { k8s_drain_timeout_secs: f64::NAN, ..k };
        assert!(bad.to_config().is_err());
    }

    #[test]
    fn flags_parse() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            k8s: K8sArgs,
        }
        let cli = Cli::try_parse_from([
            "x",
            "--actuator",
            "kubernetes",
            "--k8s-namespace",
            "serving",
            "--k8s-prefill-deployment",
            "a",
            "--k8s-decode-deployment",
            "b",
        ])
        .unwrap();
        assert_eq!(cli.k8s.actuator, ActuatorKind::Kubernetes);
        assert_eq!(cli.k8s.k8s_namespace.as_deref(), Some("serving"));
        assert!(Cli::try_parse_from(["x", "--actuator", "nope"]).is_err());
        assert_eq!(Cli::try_parse_from(["x"]).unwrap().k8s.actuator, ActuatorKind::RoleSwitch);
    }
}
