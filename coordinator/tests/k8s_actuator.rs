//! The Kubernetes actuator against a local fake of the Kubernetes API (axum on 127.0.0.1:0) and
//! a real registry with fake nodes registered over plain TCP.
//!
//! The fake implements only the endpoints the actuator calls, and checks them as the API server
//! does: a bearer token (401 without), the PATCH content type (415 for anything but
//! `application/merge-patch+json`, the only patch type the actuator sends), JSON bodies (400),
//! annotation values that are strings (400), replicas that are integers >= 0 (422), and a
//! `metadata.resourceVersion` in a patch as a precondition (409 when stale). It records every
//! call, and for a pod PATCH also the node's registry lifecycle at that moment, which is how the
//! test knows the pod was marked only after the drain.

#![cfg(feature = "kubernetes")]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use cleave_coordinator::cluster::k8s::{
    ApiServer, Done, Job, K8sClient, K8sConfig, K8sError, KubernetesActuator, Report,
};
use cleave_coordinator::cluster::registry::RouteQuery;
use cleave_coordinator::cluster::{Actuator, ActuatorError, Cluster, ClusterConfig, ClusterHandle};
use cleave_coordinator::dispatch_channel;
use cleave_net::{Connector, Listener, NetConfig, NetKind};
use cleave_planner::{Action, Role};
use cleave_protocol::control::{read_msg, write_msg, ControlMsg, LoadReport, NodeRole, Register, RegisterReply};
use cleave_protocol::{KvDtype, KvLayout};
use serde_json::{json, Value};
use tokio::sync::{broadcast, oneshot};

const NS: &str = "serving";
const TOKEN: &str = "test-token";
/// Bound on every wait (never reached when things work).
const WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// The fake API server.

#[derive(Debug, Clone)]
struct Call {
    method: String,
    path: String,
    query: Option<String>,
    content_type: Option<String>,
    body: Option<Value>,
    /// For a pod PATCH: the lifecycle of the node of that name in the registry then.
    node_lifecycle: Option<String>,
}

struct FakeDeployment {
    replicas: i64,
    resource_version: u64,
    pod_template_hash: String,
}

struct FakePod {
    /// The ReplicaSet that controls it (`<deployment>-<hash>`), and the hash label.
    replica_set: String,
    hash: String,
    annotations: BTreeMap<String, String>,
    resource_version: u64,
}

#[derive(Default)]
struct Fake {
    deployments: HashMap<String, FakeDeployment>,
    pods: HashMap<String, FakePod>,
    calls: Vec<Call>,
    /// Paths that answer 403 (as without RBAC).
    forbidden: HashSet<String>,
    /// Scale PATCHes that find the resourceVersion changed first (a concurrent writer).
    conflicts_ahead: u32,
    /// The registry, to record a node's lifecycle when its pod is patched.
    cluster: Option<ClusterHandle>,
    /// Fired with the pod's name when a scale-down removes a marked pod (what the ReplicaSet
    /// controller and the kubelet would do: SIGTERM to that node).
    pod_deleted: HashMap<String, oneshot::Sender<()>>,
}

type Shared = Arc<Mutex<Fake>>;

impl Fake {
    fn deployment(&mut self, name: &str, replicas: i64, hash: &str) {
        self.deployments
            .insert(name.into(), FakeDeployment { replicas, resource_version: 1, pod_template_hash: hash.into() });
    }

    /// A pod of `deployment` (which must exist), named `<deployment>-<hash>-<suffix>`.
    fn pod(&mut self, deployment: &str, suffix: &str) -> String {
        let hash = self.deployments[deployment].pod_template_hash.clone();
        let name = format!("{deployment}-{hash}-{suffix}");
        self.pods.insert(
            name.clone(),
            FakePod {
                replica_set: format!("{deployment}-{hash}"),
                hash,
                annotations: BTreeMap::new(),
                resource_version: 1,
            },
        );
        name
    }

    fn calls_to(&self, method: &str, path_part: &str) -> Vec<Call> {
        self.calls.iter().filter(|c| c.method == method && c.path.contains(path_part)).cloned().collect()
    }
}

/// A failure as the API server answers it: a `Status` object.
struct ApiStatus {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

fn status(code: StatusCode, reason: &'static str, message: String) -> ApiStatus {
    ApiStatus { code, reason, message }
}

impl IntoResponse for ApiStatus {
    fn into_response(self) -> Response {
        let body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code.as_u16(),
        });
        (self.code, Json(body)).into_response()
    }
}

fn scale_json(name: &str, d: &FakeDeployment) -> Value {
    json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": d.resource_version.to_string(), "uid": format!("uid-{name}")},
        "spec": {"replicas": d.replicas},
        "status": {"replicas": d.replicas, "selector": format!("app={name}")},
    })
}

fn pod_json(name: &str, p: &FakePod) -> Value {
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": name, "namespace": NS, "resourceVersion": p.resource_version.to_string(), "uid": format!("uid-{name}"),
            "labels": {"pod-template-hash": p.hash},
            "annotations": p.annotations,
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": p.replica_set,
                "uid": format!("uid-{}", p.replica_set), "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": {"containers": [{"name": "node", "image": "cleave"}]},
        "status": {"phase": "Running"},
    })
}

/// Checks what every call must carry, records it, and answers the forbidden ones; Ok: go on.
fn admit(
    fake: &mut Fake,
    method: &Method,
    path: String,
    query: Option<String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Option<Value>, ApiStatus> {
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
    let parsed = if body.is_empty() { None } else { serde_json::from_slice::<Value>(body).ok() };
    fake.calls.push(Call {
        method: method.to_string(),
        path: path.clone(),
        query,
        content_type: content_type.clone(),
        body: parsed.clone(),
        node_lifecycle: None,
    });
    if auth != Some(&format!("Bearer {TOKEN}")) {
        return Err(status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized".into()));
    }
    if fake.forbidden.contains(&path) {
        return Err(status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("{path} is forbidden: User \"system:serviceaccount:{NS}:cleave\" cannot {method} it"),
        ));
    }
    if *method == Method::PATCH {
        // The API server's patch types; the fake implements only the merge patch the actuator sends.
        match content_type.as_deref() {
            Some("application/merge-patch+json") => {}
            Some(
                "application/json-patch+json"
                | "application/strategic-merge-patch+json"
                | "application/apply-patch+yaml",
            ) => {
                return Err(status(StatusCode::NOT_IMPLEMENTED, "NotImplemented", "the fake has merge patches only".into()))
            }
            other => {
                return Err(status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {other:?})"),
                ))
            }
        }
        match parsed {
            Some(v @ Value::Object(_)) => return Ok(Some(v)),
            _ => return Err(status(StatusCode::BAD_REQUEST, "BadRequest", "the patch is not a JSON object".into())),
        }
    }
    Ok(None)
}

/// `metadata.resourceVersion` in a patch is a precondition.
fn precondition(patch: &Value, current: u64, what: &str) -> Result<(), ApiStatus> {
    match patch.pointer("/metadata/resourceVersion") {
        None => Ok(()),
        Some(Value::String(rv)) if *rv == current.to_string() => Ok(()),
        Some(_) => Err(status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("Operation cannot be fulfilled on {what}: the object has been modified; please apply your changes to the latest version and try again"),
        )),
    }
}

async fn scale(
    State(fake): State<Shared>,
    method: Method,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiStatus> {
    let path = format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale");
    let mut f = fake.lock().unwrap();
    let patch = admit(&mut f, &method, path, query, &headers, &body)?;
    if ns != NS || !f.deployments.contains_key(&name) {
        return Err(status(StatusCode::NOT_FOUND, "NotFound", format!("deployments.apps \"{name}\" not found")));
    }
    let Some(patch) = patch else {
        return Ok(Json(scale_json(&name, &f.deployments[&name])).into_response());
    };
    if f.conflicts_ahead > 0 {
        f.conflicts_ahead -= 1;
        f.deployments.get_mut(&name).unwrap().resource_version += 1;
    }
    let d = &f.deployments[&name];
    precondition(&patch, d.resource_version, &format!("deployments.apps \"{name}\""))?;
    let replicas = match patch.pointer("/spec/replicas") {
        None => d.replicas,
        Some(v) => match v.as_i64() {
            Some(n) if n >= 0 => n,
            _ => {
                return Err(status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    format!("Scale.autoscaling \"{name}\" is invalid: spec.replicas: Invalid value: {v}"),
                ))
            }
        },
    };
    let removed = d.replicas - replicas;
    let d = f.deployments.get_mut(&name).unwrap();
    d.replicas = replicas;
    d.resource_version += 1;
    let answer = scale_json(&name, d);
    // The ReplicaSet removes the pods with the lowest deletion cost first (all of them equally
    // ready here).
    for _ in 0..removed.max(0) {
        let prefix = format!("{name}-");
        let victim = f
            .pods
            .iter()
            .filter(|(n, _)| n.starts_with(&prefix))
            .min_by_key(|(_, p)| {
                p.annotations.get("controller.kubernetes.io/pod-deletion-cost").map_or(0, |c| c.parse::<i64>().unwrap())
            })
            .map(|(n, _)| n.clone());
        if let Some(v) = victim {
            f.pods.remove(&v);
            if let Some(tx) = f.pod_deleted.remove(&v) {
                let _ = tx.send(());
            }
        }
    }
    Ok(Json(answer).into_response())
}

async fn pod(
    State(fake): State<Shared>,
    method: Method,
    Path((ns, name)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiStatus> {
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}");
    // The registry's view of the node named like the pod, before taking the fake's lock.
    let cluster = fake.lock().unwrap().cluster.clone();
    let lifecycle = match (&method, cluster) {
        (&Method::PATCH, Some(c)) => c
            .node_states()
            .await
            .unwrap_or_default()
            .into_iter()
            .find(|s| s.node.name == name)
            .map(|s| s.lifecycle.as_str().to_string()),
        _ => None,
    };
    let mut f = fake.lock().unwrap();
    let patch = admit(&mut f, &method, path, query, &headers, &body)?;
    f.calls.last_mut().unwrap().node_lifecycle = lifecycle;
    if ns != NS || !f.pods.contains_key(&name) {
        return Err(status(StatusCode::NOT_FOUND, "NotFound", format!("pods \"{name}\" not found")));
    }
    if let Some(patch) = patch {
        precondition(&patch, f.pods[&name].resource_version, &format!("pods \"{name}\""))?;
        let mut annotations = f.pods[&name].annotations.clone();
        if let Some(a) = patch.pointer("/metadata/annotations") {
            let Some(a) = a.as_object() else {
                return Err(status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "metadata.annotations must be an object".into(),
                ));
            };
            for (k, v) in a {
                match v {
                    Value::String(s) => {
                        annotations.insert(k.clone(), s.clone());
                    }
                    Value::Null => {
                        annotations.remove(k);
                    }
                    other => {
                        return Err(status(
                            StatusCode::BAD_REQUEST,
                            "BadRequest",
                            format!("json: cannot unmarshal {other} into Go struct field ObjectMeta.metadata.annotations of type string"),
                        ))
                    }
                }
            }
        }
        let p = f.pods.get_mut(&name).unwrap();
        p.annotations = annotations;
        p.resource_version += 1;
    }
    Ok(Json(pod_json(&name, &f.pods[&name])).into_response())
}

async fn unimplemented(State(fake): State<Shared>, method: Method, uri: axum::http::Uri) -> ApiStatus {
    fake.lock().unwrap().calls.push(Call {
        method: method.to_string(),
        path: uri.path().to_string(),
        query: uri.query().map(str::to_string),
        content_type: None,
        body: None,
        node_lifecycle: None,
    });
    status(StatusCode::NOT_FOUND, "NotFound", format!("the fake does not serve {method} {uri}"))
}

async fn serve_fake(fake: Shared) -> SocketAddr {
    let app = Router::new()
        .route("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", get(scale).patch(scale))
        .route("/api/v1/namespaces/{ns}/pods/{name}", get(pod).patch(pod))
        .fallback(unimplemented)
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

// ---------------------------------------------------------------------------------------------
// The cluster: a real registry, nodes faked over the control protocol.

struct Harness {
    fake: Shared,
    cluster: Cluster,
    actuator: KubernetesActuator,
    reports: broadcast::Receiver<Report>,
}

async fn harness(setup: impl FnOnce(&mut Fake)) -> Harness {
    let fake: Shared = Arc::default();
    setup(&mut fake.lock().unwrap());
    let api = serve_fake(fake.clone()).await;
    let net = NetConfig::new(NetKind::TcpPlain, None);
    let control = Listener::bind(&net, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let (_dispatch, dispatches) = dispatch_channel(8);
    let mut cfg = ClusterConfig::new(net);
    // Nodes are expired only by silence; a loaded test machine must not do it.
    cfg.routing.dead_after = Duration::from_secs(60);
    // The planner (off) keeps its own role-switch actuator; the test drives a second one.
    let cluster = Cluster::start(cfg, None, control, dispatches).unwrap();
    fake.lock().unwrap().cluster = Some(cluster.handle().clone());
    let k8s = K8sConfig {
        namespace: Some(NS.into()),
        api: Some(ApiServer { url: format!("http://{api}"), token: Some(TOKEN.into()) }),
        poll_interval: Duration::from_millis(20),
        leave_timeout: WAIT,
        drain_timeout: WAIT,
        ..K8sConfig::default()
    };
    let actuator = K8sClient::connect(k8s).await.unwrap().into_actuator(cluster.handle().clone());
    let reports = actuator.subscribe();
    Harness { fake, cluster, actuator, reports }
}

impl Harness {
    async fn report(&mut self) -> Report {
        tokio::time::timeout(WAIT, self.reports.recv()).await.expect("a report in time").unwrap()
    }

    /// Waits until the node's registry lifecycle is `want` ("gone": not registered).
    async fn lifecycle_becomes(&self, node: u64, want: &str) {
        tokio::time::timeout(WAIT, async {
            loop {
                let states = self.cluster.handle().node_states().await.unwrap();
                let now = states.iter().find(|s| s.node.id == node).map_or("gone", |s| s.lifecycle.as_str());
                if now == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("node {node} never became {want}"));
    }
}

/// Registers a node named `name` and reports an idle engine every 20 ms until `deleted` fires
/// (its pod was removed) or the test ends. Returns its id.
async fn fake_node(addr: SocketAddr, name: &str, role: NodeRole, deleted: oneshot::Receiver<()>) -> u64 {
    let connector = Connector::new(&NetConfig::new(NetKind::TcpPlain, None)).unwrap();
    let mut s = connector.open(addr).await.unwrap();
    let reg = Register {
        role,
        name: name.into(),
        model_name: "m".into(),
        layout: KvLayout {
            model_fingerprint: 7,
            dtype: KvDtype::F32,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
        },
        kv_capacity_blocks: 100,
        max_model_len: 1024,
        rpc_addr: "127.0.0.1:9".parse().unwrap(),
        kv_addr: None,
        step_budget: None,
        metrics_addr: None,
        weights: Default::default(),
    };
    write_msg(&mut s.send, &ControlMsg::Register(reg)).await.unwrap();
    let id = match read_msg(&mut s.recv).await.unwrap() {
        Some(ControlMsg::RegisterReply(RegisterReply::Accepted { node_id })) => node_id,
        other => panic!("registration: {other:?}"),
    };
    tokio::spawn(async move {
        let idle = LoadReport { free_blocks: 100, total_blocks: 100, ..LoadReport::default() };
        let mut deleted = deleted;
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            tokio::select! {
                _ = &mut deleted => return,
                _ = tick.tick() => {
                    if write_msg(&mut s.send, &ControlMsg::LoadReport(idle.clone())).await.is_err() {
                        return;
                    }
                }
            }
        }
        // Dropping the stream ends the control link, as the node's exit would.
    });
    id
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_node_scales_the_role_deployment_up_by_one() {
    let mut h = harness(|f| {
        f.deployment("cleave-prefill", 1, "6b7c8d9f5");
        f.deployment("cleave-decode", 3, "5d8f7b9c4");
    })
    .await;
    h.actuator.apply(&Action::StartNode { role: Role::Prefill }).unwrap();
    let r = h.report().await;
    assert_eq!(r.job, Job::StartNode { role: Role::Prefill });
    assert_eq!(r.outcome, Ok(Done::Scaled { deployment: "cleave-prefill".into(), from: 1, to: 2 }));
    {
        let f = h.fake.lock().unwrap();
        assert_eq!(f.deployments["cleave-prefill"].replicas, 2);
        assert_eq!(f.deployments["cleave-decode"].replicas, 3, "only the prefill deployment changes");
        let calls: Vec<_> = f.calls.iter().map(|c| (c.method.as_str(), c.path.as_str())).collect();
        let scale = "/apis/apps/v1/namespaces/serving/deployments/cleave-prefill/scale";
        assert_eq!(calls, [("GET", scale), ("PATCH", scale)]);
        let patch = &f.calls[1];
        assert_eq!(patch.content_type.as_deref(), Some("application/merge-patch+json"));
        assert_eq!(patch.body, Some(json!({"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 2}})));
        assert!(patch.query.as_deref().unwrap_or("").contains("fieldManager=cleave-coordinator"), "{patch:?}");
    }

    // A concurrent writer between the GET and the PATCH: 409, and the pair is tried again
    // with what is there now (no lost update).
    h.fake.lock().unwrap().conflicts_ahead = 1;
    h.actuator.apply(&Action::StartNode { role: Role::Decode }).unwrap();
    let r = h.report().await;
    assert_eq!(r.outcome, Ok(Done::Scaled { deployment: "cleave-decode".into(), from: 3, to: 4 }));
    let f = h.fake.lock().unwrap();
    assert_eq!(f.deployments["cleave-decode"].replicas, 4);
    assert_eq!(f.calls_to("PATCH", "cleave-decode").len(), 2, "one 409, then the retry");
    assert!(f.calls.iter().all(|c| !c.path.contains("/pods/")), "a start touches no pod");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_node_marks_its_pod_and_scales_down_after_the_drain() {
    let mut pod_name = String::new();
    let (deleted_tx, deleted_rx) = oneshot::channel();
    let mut h = harness(|f| {
        f.deployment("cleave-prefill", 1, "6b7c8d9f5");
        f.deployment("cleave-decode", 2, "5d8f7b9c4");
        f.pod("cleave-prefill", "q7r2m");
        f.pod("cleave-decode", "a1b2c");
        pod_name = f.pod("cleave-decode", "x2x7k");
    })
    .await;
    h.fake.lock().unwrap().pod_deleted.insert(pod_name.clone(), deleted_tx);
    let node = fake_node(h.cluster.control_addr(), &pod_name, NodeRole::Decode, deleted_rx).await;

    // A request in flight on the node (the only one registered): the stop must wait for it.
    let cluster = h.cluster.handle().clone();
    let q = RouteQuery { tokens: vec![1; 4], max_tokens: 4, ..RouteQuery::default() };
    let (_plan, booked) = cluster.plan(q).await.unwrap();
    assert_eq!(booked.decode.map(|(n, _)| n), Some(node));

    h.actuator.apply(&Action::StopNode { node }).unwrap();
    h.lifecycle_becomes(node, "draining").await;
    assert!(h.fake.lock().unwrap().calls.is_empty(), "nothing happens in Kubernetes while the node drains");
    // A second stop of the same node while the first runs is refused.
    h.actuator.apply(&Action::StopNode { node }).unwrap();
    let r = h.report().await;
    assert_eq!(r.outcome, Err(K8sError::AlreadyStopping { node }));

    cluster.release(booked);
    let r = h.report().await;
    assert_eq!(r.job, Job::StopNode { node });
    assert_eq!(
        r.outcome,
        Ok(Done::Stopped {
            node,
            pod: pod_name.clone(),
            deployment: "cleave-decode".into(),
            from: 2,
            to: 1,
            left: true
        })
    );
    h.lifecycle_becomes(node, "gone").await;

    let f = h.fake.lock().unwrap();
    let pod_path = format!("/api/v1/namespaces/serving/pods/{pod_name}");
    let scale = "/apis/apps/v1/namespaces/serving/deployments/cleave-decode/scale";
    let calls: Vec<_> = f.calls.iter().map(|c| (c.method.as_str(), c.path.as_str())).collect();
    assert_eq!(calls, [("GET", pod_path.as_str()), ("PATCH", pod_path.as_str()), ("GET", scale), ("PATCH", scale)]);
    let mark = &f.calls[1];
    assert_eq!(mark.content_type.as_deref(), Some("application/merge-patch+json"));
    assert_eq!(
        mark.body,
        Some(json!({"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}}))
    );
    assert_eq!(mark.node_lifecycle.as_deref(), Some("drained"), "the pod is marked once the node has drained");
    assert_eq!(f.calls[3].body, Some(json!({"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 1}})));
    assert_eq!(f.deployments["cleave-decode"].replicas, 1);
    assert_eq!(f.deployments["cleave-prefill"].replicas, 1);
    // Exactly that pod went; its sibling and the prefill pod are untouched.
    assert!(!f.pods.contains_key(&pod_name));
    assert!(f.pods.contains_key("cleave-decode-5d8f7b9c4-a1b2c"));
    assert!(f.pods.values().all(|p| p.annotations.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_reported_and_the_actuator_goes_on() {
    let mut pod_name = String::new();
    let mut h = harness(|f| {
        f.deployment("cleave-prefill", 1, "6b7c8d9f5");
        f.deployment("cleave-decode", 1, "5d8f7b9c4");
        pod_name = f.pod("cleave-prefill", "q7r2m");
        f.forbidden.insert("/apis/apps/v1/namespaces/serving/deployments/cleave-prefill/scale".into());
    })
    .await;

    // 403 on the scale subresource (RBAC missing): reported with the facts.
    h.actuator.apply(&Action::StartNode { role: Role::Prefill }).unwrap();
    let r = h.report().await;
    match &r.outcome {
        Err(K8sError::Api { request, code: 403, reason, message }) => {
            assert_eq!(request, "GET namespaces/serving/deployments/cleave-prefill/scale");
            assert_eq!(reason, "Forbidden");
            assert!(message.contains("forbidden"), "{message}");
        }
        other => panic!("expected a 403, got {other:?}"),
    }
    assert_eq!(h.fake.lock().unwrap().deployments["cleave-prefill"].replicas, 1);

    // 403 on the pod: the node stays parked, nothing is scaled.
    let (_keep_tx, keep_rx) = oneshot::channel();
    let node = fake_node(h.cluster.control_addr(), &pod_name, NodeRole::Prefill, keep_rx).await;
    h.fake.lock().unwrap().forbidden.insert(format!("/api/v1/namespaces/serving/pods/{pod_name}"));
    h.actuator.apply(&Action::StopNode { node }).unwrap();
    let r = h.report().await;
    assert!(
        matches!(&r.outcome, Err(K8sError::Api { code: 403, request, .. }) if request.starts_with("GET namespaces/serving/pods/")),
        "{r:?}"
    );
    h.lifecycle_becomes(node, "drained").await;
    assert!(h.fake.lock().unwrap().calls_to("PATCH", "").is_empty());

    // A node the registry does not know, and a role without a Deployment.
    h.actuator.apply(&Action::StopNode { node: 999 }).unwrap();
    assert_eq!(h.report().await.outcome, Err(K8sError::UnknownNode { node: 999 }));
    assert!(matches!(
        h.actuator.apply(&Action::StartNode { role: Role::Both }),
        Err(ActuatorError::Unsupported { actuator: "kubernetes", .. })
    ));

    // A wrong token (a second actuator on the same fake): 401, reported too.
    let api = serve_fake(h.fake.clone()).await;
    let mut bad = K8sClient::connect(K8sConfig {
        namespace: Some(NS.into()),
        api: Some(ApiServer { url: format!("http://{api}"), token: Some("wrong".into()) }),
        ..K8sConfig::default()
    })
    .await
    .unwrap()
    .into_actuator(h.cluster.handle().clone());
    let mut bad_reports = bad.subscribe();
    bad.apply(&Action::StartNode { role: Role::Decode }).unwrap();
    let r = tokio::time::timeout(WAIT, bad_reports.recv()).await.unwrap().unwrap();
    assert!(matches!(r.outcome, Err(K8sError::Api { code: 401, .. })), "{r:?}");

    // The actuator still works after all that.
    h.actuator.apply(&Action::StartNode { role: Role::Decode }).unwrap();
    assert_eq!(h.report().await.outcome, Ok(Done::Scaled { deployment: "cleave-decode".into(), from: 1, to: 2 }));
}
