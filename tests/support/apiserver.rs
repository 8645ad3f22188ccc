//! A Kubernetes API-server stand-in: a real HTTP/1.1 server on 127.0.0.1 that `kube::Client`
//! talks to unchanged (plain http, no auth), holding Node objects and Events.
//!
//! Implemented, following the Kubernetes API documentation, for what the agent uses:
//! - `GET /api/v1/nodes/{name}` (and a plain list of nodes);
//! - `PATCH` of a node and of `nodes/{name}/status` with
//!   * `application/json-patch+json` (RFC 6902: add, remove, replace, test, move, copy; a failed
//!     `test` is 422 Invalid, "the server rejected our request due to an error in our request"),
//!   * `application/merge-patch+json` (RFC 7386),
//!   * `application/strategic-merge-patch+json` (merge patch, with `status.conditions` merged by
//!     `type`; `spec.taints` has no strategy, so it is replaced whole),
//!   * `application/apply-patch+yaml` (server-side apply with field managers for
//!     `metadata.labels` and `status.conditions` keyed by `type`: applying removes what the
//!     manager applied before and no longer applies, unless another manager also owns it;
//!     without `force=true` a different value owned by another manager is a 409 conflict);
//! - `PUT` of a node or its status with `resourceVersion` preconditions (409 Conflict);
//! - a patch whose result carries a different `metadata.resourceVersion` is a 409 Conflict;
//! - `POST` of `events.k8s.io/v1` and core `v1` Events (with `generateName`);
//! - the main resource ignores changes to `status`, the status subresource ignores everything
//!   but `status`; `resourceVersion` increases on every change and not on a no-op;
//!   `managedFields` are returned (labels, taints, conditions).
//!
//! Fault injection: latency, 429 with `Retry-After`, 500, dropped connections, and a concurrent
//! writer that changes the Node right after a read (between the agent's read and its write).
//! Every request is logged with its Kubernetes verb (`get`, `list`, `watch`, `create`,
//! `update`, `patch`, `delete`).
//!
//! The server runs on its own thread and runtime, so sync and async tests use it alike; all
//! methods are synchronous. Dropping the [`ApiServer`] stops it.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A fault the server injects into matching requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// 429 Too Many Requests with `Retry-After: secs` (header and Status details).
    TooManyRequests { retry_after_secs: u32 },
    /// 429 as API Priority and Fairness sends it: `Retry-After` header, plain-text body.
    TooManyRequestsPlain { retry_after_secs: u32 },
    /// 500 Internal Server Error.
    InternalError,
    /// Close the connection without answering.
    DropConnection,
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub at: Instant,
    /// Kubernetes verb: get, list, watch, create, update, patch, delete.
    pub verb: String,
    pub method: String,
    pub path: String,
    pub content_type: Option<String>,
    pub field_manager: Option<String>,
    pub status: u16,
}

type Mutation = Box<dyn FnOnce(&mut Value) + Send>;

#[derive(Default)]
struct Owners {
    labels: BTreeSet<String>,
    conditions: BTreeSet<String>,
    taints: bool,
}

/// One managedFields entry: (manager, operation, subresource).
type OwnerKey = (String, String, String);

struct StoredNode {
    object: Value,
    owners: BTreeMap<OwnerKey, (Owners, String)>,
}

#[derive(Default)]
struct State {
    nodes: BTreeMap<String, StoredNode>,
    events: Vec<Value>,
    resource_version: u64,
    requests: Vec<RequestRecord>,
    latency: Duration,
    fault: Option<Fault>,
    /// Requests left that get `fault`; `None` = until cleared.
    fault_budget: Option<u32>,
    /// Applied to the named node right after the next GET of it.
    after_get: Option<(String, Mutation)>,
    next_uid: u64,
}

impl State {
    fn bump(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }
}

/// The running stand-in.
pub struct ApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ApiServer {
    /// Start on 127.0.0.1 with an OS-chosen port.
    pub fn start() -> Self {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Start on `addr` (port 0 picks one).
    pub fn start_on(addr: SocketAddr) -> Self {
        let std_listener = std::net::TcpListener::bind(addr).expect("bind the stand-in");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State {
            resource_version: 1000,
            ..State::default()
        }));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let st = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("apiserver-standin".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("stand-in runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(std_listener).expect("tokio listener");
                    let accept = async {
                        loop {
                            let Ok((stream, _)) = listener.accept().await else {
                                continue;
                            };
                            let st = Arc::clone(&st);
                            tokio::spawn(serve_connection(stream, st));
                        }
                    };
                    tokio::select! {
                        () = accept => {}
                        _ = stop_rx => {}
                    }
                });
                rt.shutdown_timeout(Duration::from_millis(100));
            })
            .expect("spawn stand-in thread");
        Self {
            addr,
            state,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Write a kubeconfig pointing at this server (plain http, no credentials).
    pub fn write_kubeconfig(&self, path: &Path) {
        write_kubeconfig(path, &self.url());
    }

    /// Store a Node (a JSON object with at least `metadata.name`), as if a kubelet created it.
    /// Labels and taints present are owned by `kubelet` (Update), conditions likewise.
    pub fn seed_node(&self, mut node: Value) {
        let mut st = self.lock();
        let name = node["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        st.next_uid += 1;
        node["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{:012}", st.next_uid));
        node["metadata"]["creationTimestamp"] = json!(now_rfc3339());
        let rv = st.bump();
        node["metadata"]["resourceVersion"] = json!(rv);
        let mut stored = StoredNode {
            object: node,
            owners: BTreeMap::new(),
        };
        let before = json!({});
        record_update(&mut stored, &before, "kubelet", "");
        st.nodes.insert(name, stored);
    }

    /// A minimal Node as a kubelet registers it, with the `Ready` condition set.
    pub fn kubelet_node(name: &str) -> Value {
        json!({
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                },
            },
            "spec": {},
            "status": {
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now_rfc3339(),
                    "lastTransitionTime": now_rfc3339(),
                }],
            },
        })
    }

    /// The stored Node, with `managedFields`.
    pub fn node(&self, name: &str) -> Option<Value> {
        self.lock().nodes.get(name).map(render)
    }

    /// Change a Node as another writer would (an Update by `manager`), bumping the
    /// resourceVersion when something changed.
    pub fn modify_node(&self, name: &str, manager: &str, f: impl FnOnce(&mut Value)) {
        let mut st = self.lock();
        let Some(mut stored) = st.nodes.remove(name) else {
            panic!("no node {name}");
        };
        let before = stored.object.clone();
        f(&mut stored.object);
        if stored.object != before {
            let rv = st.bump();
            stored.object["metadata"]["resourceVersion"] = json!(rv);
            record_update(&mut stored, &before, manager, "");
            record_update(&mut stored, &before, manager, "status");
        }
        st.nodes.insert(name.to_owned(), stored);
    }

    /// After the next GET of `name` is answered, change the Node as another writer (manager
    /// `other-controller`) — i.e. between the agent's read and its write.
    pub fn after_next_get(&self, name: &str, f: impl FnOnce(&mut Value) + Send + 'static) {
        self.lock().after_get = Some((name.to_owned(), Box::new(f)));
    }

    /// Events created so far (both API groups), in order.
    pub fn events(&self) -> Vec<Value> {
        self.lock().events.clone()
    }

    /// Delay every answer by `d`.
    pub fn set_latency(&self, d: Duration) {
        self.lock().latency = d;
    }

    /// Inject `fault` into every request until [`ApiServer::clear_fault`].
    pub fn set_fault(&self, fault: Fault) {
        let mut st = self.lock();
        st.fault = Some(fault);
        st.fault_budget = None;
    }

    /// Inject `fault` into the next `n` requests only.
    pub fn set_fault_for(&self, fault: Fault, n: u32) {
        let mut st = self.lock();
        st.fault = Some(fault);
        st.fault_budget = Some(n);
    }

    pub fn clear_fault(&self) {
        let mut st = self.lock();
        st.fault = None;
        st.fault_budget = None;
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.lock().requests.clone()
    }

    /// Requests so far with this Kubernetes verb (including faulted ones).
    pub fn count(&self, verb: &str) -> usize {
        self.lock()
            .requests
            .iter()
            .filter(|r| r.verb == verb)
            .count()
    }

    /// Requests by verb.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for r in &self.lock().requests {
            *out.entry(r.verb.clone()).or_insert(0) += 1;
        }
        out
    }

    /// Write requests (create, update, patch, delete) so far.
    pub fn writes(&self) -> usize {
        self.lock()
            .requests
            .iter()
            .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
            .count()
    }

    pub fn reset_requests(&self) {
        self.lock().requests.clear();
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Write a kubeconfig for `server` (e.g. `http://10.0.2.2:PORT` for a qemu guest).
pub fn write_kubeconfig(path: &Path, server: &str) {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: {server}\n\
         contexts:\n- name: standin\n  context:\n    cluster: standin\n    user: standin\n\
         current-context: standin\nusers:\n- name: standin\n  user: {{}}\n"
    );
    std::fs::write(path, text).expect("write kubeconfig");
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// HTTP plumbing

async fn serve_connection(stream: tokio::net::TcpStream, state: Arc<Mutex<State>>) {
    let io = hyper_util::rt::TokioIo::new(stream);
    let svc = hyper::service::service_fn(move |req| {
        let state = Arc::clone(&state);
        async move { handle(req, state).await }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, svc)
        .await;
}

/// Errors the handler ends in: either an HTTP answer or a dropped connection.
enum Outcome {
    Answer(Response<Full<Bytes>>),
    Drop,
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<Mutex<State>>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = parse_query(req.uri().query().unwrap_or(""));
    let content_type = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or(s).trim().to_owned());
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let verb = verb_of(&method, &path, &query);

    let (latency, fault) = {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let fault = st.fault.clone();
        if fault.is_some()
            && let Some(n) = st.fault_budget.as_mut()
        {
            *n -= 1;
            if *n == 0 {
                st.fault = None;
                st.fault_budget = None;
            }
        }
        (st.latency, fault)
    };
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let outcome = match fault {
        Some(Fault::DropConnection) => Outcome::Drop,
        Some(Fault::TooManyRequests { retry_after_secs }) => {
            let mut r = status_response(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.",
                Some(json!({ "retryAfterSeconds": retry_after_secs })),
            );
            r.headers_mut().insert(
                hyper::header::RETRY_AFTER,
                hyper::header::HeaderValue::from(retry_after_secs),
            );
            Outcome::Answer(r)
        }
        Some(Fault::TooManyRequestsPlain { retry_after_secs }) => {
            let mut r = Response::new(Full::new(Bytes::from_static(
                b"Too many requests, please try again later.\n",
            )));
            *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            let h = r.headers_mut();
            h.insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            h.insert(
                hyper::header::RETRY_AFTER,
                hyper::header::HeaderValue::from(retry_after_secs),
            );
            Outcome::Answer(r)
        }
        Some(Fault::InternalError) => Outcome::Answer(status_response(
            500,
            "InternalError",
            "Internal error occurred: injected fault",
            None,
        )),
        None => {
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            Outcome::Answer(route(
                &mut st,
                &method,
                &path,
                &query,
                content_type.as_deref(),
                &body,
            ))
        }
    };
    let status = match &outcome {
        Outcome::Answer(r) => r.status().as_u16(),
        Outcome::Drop => 0,
    };
    {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.requests.push(RequestRecord {
            at: Instant::now(),
            verb: verb.to_owned(),
            method: method.to_string(),
            path: path.clone(),
            content_type,
            field_manager: query.get("fieldManager").cloned(),
            status,
        });
    }
    match outcome {
        Outcome::Answer(r) => Ok(r),
        // An error from the service makes hyper close the connection without a response.
        Outcome::Drop => Err(std::io::Error::other("injected dropped connection")),
    }
}

fn parse_query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (k.to_owned(), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn verb_of(method: &Method, path: &str, query: &BTreeMap<String, String>) -> &'static str {
    let collection = path.ends_with("/nodes") || path.ends_with("/events");
    match *method {
        Method::GET if query.get("watch").is_some_and(|w| w == "true" || w == "1") => "watch",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "other",
    }
}

fn json_response(code: u16, v: &Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn status_response(
    code: u16,
    reason: &str,
    message: &str,
    details: Option<Value>,
) -> Response<Full<Bytes>> {
    let mut v = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if let Some(d) = details {
        v["details"] = d;
    }
    json_response(code, &v)
}

fn not_found(name: &str) -> Response<Full<Bytes>> {
    status_response(
        404,
        "NotFound",
        &format!("nodes \"{name}\" not found"),
        Some(json!({ "name": name, "kind": "nodes" })),
    )
}

fn conflict(name: &str) -> Response<Full<Bytes>> {
    status_response(
        409,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on nodes \"{name}\": the object has been modified; \
             please apply your changes to the latest version and try again"
        ),
        Some(json!({ "name": name, "kind": "nodes" })),
    )
}

fn bad_request(message: &str) -> Response<Full<Bytes>> {
    status_response(400, "BadRequest", message, None)
}

fn route(
    st: &mut State,
    method: &Method,
    path: &str,
    query: &BTreeMap<String, String>,
    content_type: Option<&str>,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, parts.as_slice()) {
        (&Method::GET, ["api", "v1", "nodes"]) => {
            if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
                return status_response(
                    405,
                    "MethodNotAllowed",
                    "stand-in: watch is not implemented",
                    None,
                );
            }
            let items: Vec<Value> = st.nodes.values().map(render).collect();
            json_response(
                200,
                &json!({
                    "kind": "NodeList", "apiVersion": "v1",
                    "metadata": { "resourceVersion": st.resource_version.to_string() },
                    "items": items,
                }),
            )
        }
        (&Method::GET, ["api", "v1", "nodes", name] | ["api", "v1", "nodes", name, "status"]) => {
            let Some(stored) = st.nodes.get(*name) else {
                return not_found(name);
            };
            let answer = json_response(200, &render(stored));
            if st.after_get.as_ref().is_some_and(|(n, _)| n == name)
                && let Some((n, f)) = st.after_get.take()
            {
                let rv = st.bump();
                if let Some(stored) = st.nodes.get_mut(&n) {
                    let before = stored.object.clone();
                    f(&mut stored.object);
                    stored.object["metadata"]["resourceVersion"] = json!(rv);
                    record_update(stored, &before, "other-controller", "");
                    record_update(stored, &before, "other-controller", "status");
                }
            }
            answer
        }
        (&Method::PATCH, ["api", "v1", "nodes", name]) => {
            patch_node(st, name, "", query, content_type, body)
        }
        (&Method::PATCH, ["api", "v1", "nodes", name, "status"]) => {
            patch_node(st, name, "status", query, content_type, body)
        }
        (&Method::PUT, ["api", "v1", "nodes", name]) => update_node(st, name, "", query, body),
        (&Method::PUT, ["api", "v1", "nodes", name, "status"]) => {
            update_node(st, name, "status", query, body)
        }
        (&Method::POST, ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"]) => {
            create_event(st, ns, "events.k8s.io/v1", body)
        }
        (&Method::POST, ["api", "v1", "namespaces", ns, "events"]) => {
            create_event(st, ns, "v1", body)
        }
        (&Method::GET, ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"]) => {
            let items: Vec<Value> = st
                .events
                .iter()
                .filter(|e| e["metadata"]["namespace"] == json!(ns))
                .cloned()
                .collect();
            json_response(
                200,
                &json!({ "kind": "EventList", "apiVersion": "events.k8s.io/v1", "metadata": {}, "items": items }),
            )
        }
        _ => status_response(
            404,
            "NotFound",
            &format!("the server could not find the requested resource ({method} {path})"),
            None,
        ),
    }
}

fn create_event(st: &mut State, ns: &str, api_version: &str, body: &[u8]) -> Response<Full<Bytes>> {
    let Ok(mut ev) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the body is not JSON");
    };
    let meta = &ev["metadata"];
    let name = match (meta["name"].as_str(), meta["generateName"].as_str()) {
        (Some(n), _) if !n.is_empty() => n.to_owned(),
        (_, Some(g)) => format!("{g}{:05x}", st.events.len() + 1),
        _ => {
            return status_response(
                422,
                "Invalid",
                "Event is invalid: metadata.name: Required value: name or generateName is required",
                None,
            );
        }
    };
    if api_version == "events.k8s.io/v1" {
        for field in [
            "eventTime",
            "reportingController",
            "reportingInstance",
            "action",
            "reason",
        ] {
            if ev.get(field).is_none_or(Value::is_null) {
                return status_response(
                    422,
                    "Invalid",
                    &format!("Event.events.k8s.io \"{name}\" is invalid: {field}: Required value"),
                    None,
                );
            }
        }
    }
    if ev["metadata"]["namespace"]
        .as_str()
        .is_some_and(|n| n != ns)
    {
        return bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        );
    }
    ev["apiVersion"] = json!(api_version);
    ev["kind"] = json!("Event");
    ev["metadata"]["name"] = json!(name);
    ev["metadata"]["namespace"] = json!(ns);
    st.next_uid += 1;
    ev["metadata"]["uid"] = json!(format!("00000000-0000-4000-9000-{:012}", st.next_uid));
    ev["metadata"]["resourceVersion"] = json!(st.bump());
    ev["metadata"]["creationTimestamp"] = json!(now_rfc3339());
    st.events.push(ev.clone());
    json_response(201, &ev)
}

// ---------------------------------------------------------------------------------------------
// Nodes: writes

fn update_node(
    st: &mut State,
    name: &str,
    subresource: &str,
    query: &BTreeMap<String, String>,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let Ok(new) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the body is not JSON");
    };
    let Some(stored) = st.nodes.get(name) else {
        return not_found(name);
    };
    let current_rv = stored.object["metadata"]["resourceVersion"].clone();
    match new["metadata"]["resourceVersion"].as_str() {
        // Nodes allow unconditional updates.
        None | Some("") => {}
        Some(rv) if json!(rv) == current_rv => {}
        Some(_) => return conflict(name),
    }
    let manager = query
        .get("fieldManager")
        .cloned()
        .unwrap_or_else(|| "unknown".into());
    commit(st, name, subresource, &manager, new)
}

fn patch_node(
    st: &mut State,
    name: &str,
    subresource: &str,
    query: &BTreeMap<String, String>,
    content_type: Option<&str>,
    body: &[u8],
) -> Response<Full<Bytes>> {
    let Some(stored) = st.nodes.get(name) else {
        return not_found(name);
    };
    let current = stored.object.clone();
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the body of the request was in an unknown format");
    };
    let manager = query.get("fieldManager").cloned();
    match content_type {
        Some("application/apply-patch+yaml") => {
            let Some(manager) = manager else {
                return bad_request(
                    "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                );
            };
            let force = query.get("force").is_some_and(|f| f == "true");
            apply(st, name, subresource, &manager, force, &patch)
        }
        Some(
            kind @ ("application/json-patch+json"
            | "application/merge-patch+json"
            | "application/strategic-merge-patch+json"),
        ) => {
            let mut doc = current.clone();
            match kind {
                "application/json-patch+json" => {
                    let Value::Array(ops) = patch else {
                        return bad_request(
                            "json: cannot unmarshal object into Go value of type jsonpatch.Patch",
                        );
                    };
                    if let Err(e) = json_patch_apply(&mut doc, &ops) {
                        return match e {
                            PatchError::Bad(m) => bad_request(&m),
                            PatchError::Unprocessable(m) => status_response(
                                422,
                                "Invalid",
                                "the server rejected our request due to an error in our request",
                                Some(
                                    json!({ "causes": [{ "reason": "UnexpectedServerResponse", "message": m }] }),
                                ),
                            ),
                        };
                    }
                }
                "application/merge-patch+json" => merge_patch(&mut doc, &patch),
                _ => strategic_merge(&mut doc, &patch),
            }
            // A patch that sets metadata.resourceVersion is an optimistic-concurrency guard.
            if doc["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
                return conflict(name);
            }
            commit(
                st,
                name,
                subresource,
                manager.as_deref().unwrap_or("unknown"),
                doc,
            )
        }
        other => status_response(
            415,
            "UnsupportedMediaType",
            &format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {other:?})"
            ),
            None,
        ),
    }
}

/// Store `new` as the node (respecting the main-resource / status split), track ownership as an
/// Update by `manager`, bump the resourceVersion if anything changed.
fn commit(
    st: &mut State,
    name: &str,
    subresource: &str,
    manager: &str,
    mut new: Value,
) -> Response<Full<Bytes>> {
    let Some(stored) = st.nodes.get(name) else {
        return not_found(name);
    };
    let before = stored.object.clone();
    if new["metadata"]["name"] != before["metadata"]["name"] {
        return bad_request("the name of the object does not match the name on the URL");
    }
    if subresource == "status" {
        let status = new["status"].take();
        new = before.clone();
        new["status"] = status;
    } else {
        new["status"] = before["status"].clone();
    }
    // Server-owned metadata is not the client's to change.
    for k in [
        "uid",
        "creationTimestamp",
        "resourceVersion",
        "managedFields",
    ] {
        match before["metadata"].get(k) {
            Some(v) => new["metadata"][k] = v.clone(),
            None => {
                if let Some(m) = new["metadata"].as_object_mut() {
                    m.remove(k);
                }
            }
        }
    }
    normalize(&mut new);
    if new == before {
        return json_response(200, &render(&st.nodes[name]));
    }
    let rv = st.bump();
    let Some(stored) = st.nodes.get_mut(name) else {
        return not_found(name);
    };
    stored.object = new;
    stored.object["metadata"]["resourceVersion"] = json!(rv);
    record_update(stored, &before, manager, subresource);
    json_response(200, &render(stored))
}

/// Drop empty maps/lists the real server would omit (`omitempty`).
fn normalize(node: &mut Value) {
    if let Some(spec) = node.get_mut("spec").and_then(Value::as_object_mut)
        && spec
            .get("taints")
            .is_some_and(|t| t.as_array().is_some_and(Vec::is_empty) || t.is_null())
    {
        spec.remove("taints");
    }
    if let Some(meta) = node.get_mut("metadata").and_then(Value::as_object_mut)
        && meta
            .get("labels")
            .is_some_and(|l| l.as_object().is_some_and(Map::is_empty) || l.is_null())
    {
        meta.remove("labels");
    }
}

/// Ownership after an Update by `manager`: fields it changed become its own, and no longer
/// anybody else's.
fn record_update(stored: &mut StoredNode, before: &Value, manager: &str, subresource: &str) {
    let after = stored.object.clone();
    let key: OwnerKey = (
        manager.to_owned(),
        "Update".to_owned(),
        subresource.to_owned(),
    );
    let mut changed = Owners::default();
    if subresource.is_empty() {
        let lb = labels_of(before);
        for (k, v) in labels_of(&after) {
            if lb.get(&k) != Some(&v) {
                changed.labels.insert(k);
            }
        }
        changed.taints = before["spec"]["taints"] != after["spec"]["taints"];
    } else {
        let cb = conditions_of(before);
        for (t, c) in conditions_of(&after) {
            if cb.get(&t) != Some(&c) {
                changed.conditions.insert(t);
            }
        }
    }
    if changed.labels.is_empty() && changed.conditions.is_empty() && !changed.taints {
        return;
    }
    for (k, (o, _)) in stored.owners.iter_mut() {
        if *k != key {
            o.labels.retain(|l| !changed.labels.contains(l));
            o.conditions.retain(|c| !changed.conditions.contains(c));
            o.taints &= !changed.taints;
        }
    }
    let entry = stored
        .owners
        .entry(key)
        .or_insert_with(|| (Owners::default(), String::new()));
    entry.0.labels.extend(changed.labels);
    entry.0.conditions.extend(changed.conditions);
    entry.0.taints |= changed.taints;
    entry.1 = now_rfc3339();
    prune(stored);
}

fn prune(stored: &mut StoredNode) {
    let labels = labels_of(&stored.object);
    let conds = conditions_of(&stored.object);
    let has_taints = stored.object["spec"]["taints"].is_array();
    stored.owners.retain(|_, (o, _)| {
        o.labels.retain(|l| labels.contains_key(l));
        o.conditions.retain(|c| conds.contains_key(c));
        o.taints &= has_taints;
        !(o.labels.is_empty() && o.conditions.is_empty() && !o.taints)
    });
}

fn labels_of(v: &Value) -> BTreeMap<String, Value> {
    v["metadata"]["labels"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
}

fn conditions_of(v: &Value) -> BTreeMap<String, Value> {
    v["status"]["conditions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| Some((c["type"].as_str()?.to_owned(), c.clone())))
                .collect()
        })
        .unwrap_or_default()
}

/// Server-side apply of `metadata.labels` (main resource) or `status.conditions` (status).
fn apply(
    st: &mut State,
    name: &str,
    subresource: &str,
    manager: &str,
    force: bool,
    config: &Value,
) -> Response<Full<Bytes>> {
    if config["apiVersion"] != json!("v1") || config["kind"] != json!("Node") {
        return bad_request("apply patches must specify apiVersion: v1 and kind: Node");
    }
    if config["metadata"]["name"]
        .as_str()
        .is_some_and(|n| n != name)
    {
        return bad_request("the name of the object does not match the name on the URL");
    }
    // Only what the stand-in tracks ownership of; anything else would be silently wrong.
    let allowed_meta = ["name", "labels"];
    if let Some(m) = config["metadata"].as_object()
        && let Some(k) = m.keys().find(|k| !allowed_meta.contains(&k.as_str()))
    {
        return bad_request(&format!(
            "stand-in: apply of metadata.{k} is not implemented"
        ));
    }
    let allowed_top: &[&str] = if subresource == "status" {
        &["apiVersion", "kind", "metadata", "status"]
    } else {
        &["apiVersion", "kind", "metadata"]
    };
    if let Some(k) = config
        .as_object()
        .and_then(|m| m.keys().find(|k| !allowed_top.contains(&k.as_str())))
    {
        return bad_request(&format!(
            "stand-in: apply of .{k} on {} is not implemented",
            if subresource.is_empty() {
                "nodes"
            } else {
                "nodes/status"
            }
        ));
    }
    let Some(stored) = st.nodes.get_mut(name) else {
        return not_found(name);
    };
    let before = stored.object.clone();
    let key: OwnerKey = (
        manager.to_owned(),
        "Apply".to_owned(),
        subresource.to_owned(),
    );

    if subresource.is_empty() {
        let want: BTreeMap<String, Value> = config["metadata"]["labels"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        if let Some((k, v)) = want.iter().find(|(_, v)| !v.is_string()) {
            return status_response(
                422,
                "Invalid",
                &format!(
                    "Node \"{name}\" is invalid: metadata.labels: Invalid value: {v}: label {k} must be a string"
                ),
                None,
            );
        }
        let have = labels_of(&before);
        if !force {
            let key = &key;
            let conflicts: Vec<String> = want
                .iter()
                .filter(|(k, v)| have.get(*k).is_some_and(|h| h != *v))
                .flat_map(|(k, _)| {
                    stored
                        .owners
                        .iter()
                        .filter(move |(ok, (o, _))| *ok != key && o.labels.contains(k))
                        .map(move |((m, _, _), _)| {
                            format!("conflict with \"{m}\": .metadata.labels.{k}")
                        })
                })
                .collect();
            if !conflicts.is_empty() {
                return status_response(
                    409,
                    "Conflict",
                    &format!(
                        "Apply failed with {} conflict{}: {}",
                        conflicts.len(),
                        if conflicts.len() == 1 { "" } else { "s" },
                        conflicts.join("\n")
                    ),
                    None,
                );
            }
        }
        let previously: BTreeSet<String> = stored
            .owners
            .get(&key)
            .map(|(o, _)| o.labels.clone())
            .unwrap_or_default();
        let mut labels: Map<String, Value> = before["metadata"]["labels"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        for (k, v) in &want {
            labels.insert(k.clone(), v.clone());
            if force {
                for (ok, (o, _)) in stored.owners.iter_mut() {
                    if *ok != key {
                        o.labels.remove(k);
                    }
                }
            }
        }
        for k in previously.iter().filter(|k| !want.contains_key(*k)) {
            let co_owned = stored
                .owners
                .iter()
                .any(|(ok, (o, _))| *ok != key && o.labels.contains(k));
            if !co_owned {
                labels.remove(k);
            }
        }
        stored.object["metadata"]["labels"] = Value::Object(labels);
        let entry = stored
            .owners
            .entry(key)
            .or_insert_with(|| (Owners::default(), String::new()));
        entry.0.labels = want.keys().cloned().collect();
    } else {
        let want: Vec<Value> = config["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for (i, c) in want.iter().enumerate() {
            if c["type"].as_str().is_none_or(str::is_empty)
                || c["status"].as_str().is_none_or(str::is_empty)
            {
                return status_response(
                    422,
                    "Invalid",
                    &format!(
                        "Node \"{name}\" is invalid: status.conditions[{i}]: Required value: type and status are required"
                    ),
                    None,
                );
            }
        }
        let want_types: BTreeSet<String> = want
            .iter()
            .filter_map(|c| c["type"].as_str().map(str::to_owned))
            .collect();
        let have = conditions_of(&before);
        if !force {
            for c in &want {
                let t = c["type"].as_str().unwrap_or_default();
                if have.get(t).is_some_and(|h| h != c)
                    && let Some(((m, _, _), _)) = stored
                        .owners
                        .iter()
                        .find(|(ok, (o, _))| **ok != key && o.conditions.contains(t))
                {
                    return status_response(
                        409,
                        "Conflict",
                        &format!(
                            "Apply failed with 1 conflict: conflict with \"{m}\": .status.conditions[type=\"{t}\"]"
                        ),
                        None,
                    );
                }
            }
        }
        let previously: BTreeSet<String> = stored
            .owners
            .get(&key)
            .map(|(o, _)| o.conditions.clone())
            .unwrap_or_default();
        let mut list: Vec<Value> = before["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for c in &want {
            let t = c["type"].as_str().unwrap_or_default();
            match list.iter_mut().find(|h| h["type"] == json!(t)) {
                Some(slot) => *slot = c.clone(),
                None => list.push(c.clone()),
            }
            if force {
                for (ok, (o, _)) in stored.owners.iter_mut() {
                    if *ok != key {
                        o.conditions.remove(t);
                    }
                }
            }
        }
        list.retain(|h| {
            let t = h["type"].as_str().unwrap_or_default();
            !(previously.contains(t)
                && !want_types.contains(t)
                && !stored
                    .owners
                    .iter()
                    .any(|(ok, (o, _))| *ok != key && o.conditions.contains(t)))
        });
        stored.object["status"]["conditions"] = Value::Array(list);
        let entry = stored
            .owners
            .entry(key)
            .or_insert_with(|| (Owners::default(), String::new()));
        entry.0.conditions = want_types;
    }
    normalize(&mut stored.object);
    let changed = stored.object != before;
    if changed
        && let Some(e) = stored.owners.get_mut(&(
            manager.to_owned(),
            "Apply".to_owned(),
            subresource.to_owned(),
        ))
    {
        e.1 = now_rfc3339();
    }
    prune(stored);
    if changed {
        let rv = st.bump();
        let Some(stored) = st.nodes.get_mut(name) else {
            return not_found(name);
        };
        stored.object["metadata"]["resourceVersion"] = json!(rv);
    }
    json_response(200, &render(&st.nodes[name]))
}

/// The object as the API returns it, with `managedFields`.
fn render(stored: &StoredNode) -> Value {
    let mut v = stored.object.clone();
    let mut entries = Vec::new();
    for ((manager, op, sub), (o, time)) in &stored.owners {
        let mut fields = json!({});
        if !o.labels.is_empty() {
            let labels: Map<String, Value> = o
                .labels
                .iter()
                .map(|l| (format!("f:{l}"), json!({})))
                .collect();
            fields["f:metadata"] = json!({ "f:labels": labels });
        }
        if o.taints {
            fields["f:spec"] = json!({ "f:taints": {} });
        }
        if !o.conditions.is_empty() {
            let conds: Map<String, Value> = o
                .conditions
                .iter()
                .map(|t| {
                    (
                        format!("k:{{\"type\":\"{t}\"}}"),
                        json!({ ".": {}, "f:type": {}, "f:status": {}, "f:reason": {}, "f:message": {}, "f:lastTransitionTime": {}, "f:lastHeartbeatTime": {} }),
                    )
                })
                .collect();
            fields["f:status"] = json!({ "f:conditions": conds });
        }
        let mut e = json!({
            "manager": manager, "operation": op, "apiVersion": "v1",
            "time": time, "fieldsType": "FieldsV1", "fieldsV1": fields,
        });
        if !sub.is_empty() {
            e["subresource"] = json!(sub);
        }
        entries.push(e);
    }
    if !entries.is_empty() {
        v["metadata"]["managedFields"] = Value::Array(entries);
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Patch formats

enum PatchError {
    Bad(String),
    Unprocessable(String),
}

fn pointer_parts(p: &str) -> Result<Vec<String>, PatchError> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = p.strip_prefix('/') else {
        return Err(PatchError::Unprocessable(format!(
            "invalid JSON pointer {p:?}"
        )));
    };
    Ok(rest
        .split('/')
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn get_path<'a>(doc: &'a Value, parts: &[String]) -> Option<&'a Value> {
    let mut cur = doc;
    for p in parts {
        cur = match cur {
            Value::Object(m) => m.get(p)?,
            Value::Array(a) => a.get(p.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

fn parent_mut<'a>(
    doc: &'a mut Value,
    parts: &[String],
) -> Result<(&'a mut Value, String), PatchError> {
    let Some((last, init)) = parts.split_last() else {
        return Err(PatchError::Unprocessable(
            "cannot operate on the whole document".into(),
        ));
    };
    let mut cur = doc;
    for p in init {
        cur = match cur {
            Value::Object(m) => m.get_mut(p),
            Value::Array(a) => p.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
            _ => None,
        }
        .ok_or_else(|| {
            PatchError::Unprocessable(format!("doc is missing path: /{}", parts.join("/")))
        })?;
    }
    Ok((cur, last.clone()))
}

fn op_add(doc: &mut Value, parts: &[String], value: Value) -> Result<(), PatchError> {
    let (parent, last) = parent_mut(doc, parts)?;
    match parent {
        Value::Object(m) => {
            m.insert(last, value);
            Ok(())
        }
        Value::Array(a) => {
            let idx = if last == "-" {
                a.len()
            } else {
                last.parse::<usize>()
                    .map_err(|_| PatchError::Unprocessable(format!("invalid array index {last}")))?
            };
            if idx > a.len() {
                return Err(PatchError::Unprocessable(format!(
                    "array index {idx} out of bounds"
                )));
            }
            a.insert(idx, value);
            Ok(())
        }
        _ => Err(PatchError::Unprocessable("doc is missing path".into())),
    }
}

fn op_remove(doc: &mut Value, parts: &[String]) -> Result<Value, PatchError> {
    let (parent, last) = parent_mut(doc, parts)?;
    let missing =
        || PatchError::Unprocessable(format!("doc is missing path: /{}", parts.join("/")));
    match parent {
        Value::Object(m) => m.remove(&last).ok_or_else(missing),
        Value::Array(a) => {
            let i = last.parse::<usize>().map_err(|_| missing())?;
            if i < a.len() {
                Ok(a.remove(i))
            } else {
                Err(missing())
            }
        }
        _ => Err(missing()),
    }
}

/// RFC 6902, atomically (the caller patches a copy).
fn json_patch_apply(doc: &mut Value, ops: &[Value]) -> Result<(), PatchError> {
    for op in ops {
        let kind = op["op"]
            .as_str()
            .ok_or_else(|| PatchError::Bad("op is missing".into()))?;
        let path = op["path"]
            .as_str()
            .ok_or_else(|| PatchError::Bad("path is missing".into()))?;
        let parts = pointer_parts(path)?;
        match kind {
            "add" => op_add(
                doc,
                &parts,
                op.get("value")
                    .cloned()
                    .ok_or_else(|| PatchError::Bad("value is missing".into()))?,
            )?,
            "remove" => {
                op_remove(doc, &parts)?;
            }
            "replace" => {
                op_remove(doc, &parts)?;
                op_add(
                    doc,
                    &parts,
                    op.get("value")
                        .cloned()
                        .ok_or_else(|| PatchError::Bad("value is missing".into()))?,
                )?;
            }
            "test" => {
                let want = op.get("value").cloned().unwrap_or(Value::Null);
                if get_path(doc, &parts) != Some(&want) {
                    return Err(PatchError::Unprocessable(format!(
                        "testing value {path} failed: test failed"
                    )));
                }
            }
            "move" | "copy" => {
                let from = pointer_parts(
                    op["from"]
                        .as_str()
                        .ok_or_else(|| PatchError::Bad("from is missing".into()))?,
                )?;
                let v = if kind == "move" {
                    op_remove(doc, &from)?
                } else {
                    get_path(doc, &from).cloned().ok_or_else(|| {
                        PatchError::Unprocessable("doc is missing from path".into())
                    })?
                };
                op_add(doc, &parts, v)?;
            }
            other => return Err(PatchError::Bad(format!("Unexpected kind: {other}"))),
        }
    }
    Ok(())
}

/// RFC 7386.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// Strategic merge patch for Nodes, limited to the merge keys that matter here:
/// `status.conditions` merges by `type`; every other list is replaced.
fn strategic_merge(target: &mut Value, patch: &Value) {
    let mut patch = patch.clone();
    let conds = patch
        .get_mut("status")
        .and_then(|s| s.as_object_mut())
        .and_then(|s| s.remove("conditions"));
    merge_patch(target, &patch);
    if let Some(Value::Array(items)) = conds {
        let list = target["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut list = list;
        for item in items {
            let t = item["type"].clone();
            match list.iter_mut().find(|c| c["type"] == t) {
                Some(slot) => merge_patch(slot, &item),
                None => list.push(item),
            }
        }
        target["status"]["conditions"] = Value::Array(list);
    }
}
