//! Keeps the Node's labels, taint and conditions equal to the verdict, writing only the
//! difference between what the Node shows and what the verdict wants.
//!
//! - labels: server-side apply (field manager `fabricgate`), so labels we stop setting are
//!   removed by the API server and labels of other owners are never touched;
//! - the taint: `spec.taints` is an atomic list, so a JSON patch guarded by a `test` on
//!   `metadata.resourceVersion`, retried on conflict, that changes only our key;
//! - conditions: server-side apply on the status subresource (the list is a map keyed by
//!   `type`, so we own just our types);
//! - an `events.k8s.io/v1` Event at each `FabricReady` transition.

use crate::config::NodeSettings;
use crate::error::{Error, Result};
use crate::observe::metrics::Metrics;
use crate::policy::breaker as failclosed;
use crate::policy::{self, Verdict};
use k8s_openapi::api::core::v1::{ConfigMap, Node, NodeCondition, ObjectReference, Taint};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Field manager of every write, and the owner name `kubectl get node -o yaml
/// --show-managed-fields` shows.
pub const FIELD_MANAGER: &str = "fabricgate";
/// `reportingController` of our Events.
pub const REPORTING_CONTROLLER: &str = "fabricgate.io/agent";
/// Node conditions fabricgate owns.
pub const CONDITION_TYPES: [&str; 4] =
    ["FabricReady", "RDMAReady", "LustreReady", "GPUDirectReady"];
/// Namespace of Events about Nodes (cluster-scoped objects), as the kubelet does.
pub const EVENT_NAMESPACE: &str = "default";
/// Attempts of the taint read-modify-write before giving up until the next retry.
const TAINT_ATTEMPTS: u32 = 5;

/// What must change on the Node; `None` fields are already right.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// The full set of labels fabricgate applies (SSA removes owned labels not in it).
    pub labels: Option<BTreeMap<String, String>>,
    /// The whole new `spec.taints` list.
    pub taints: Option<Vec<Taint>>,
    /// Our conditions, as applied.
    pub conditions: Option<Vec<NodeCondition>>,
    /// `FabricReady` changes status: an Event is due.
    pub transition: Option<Transition>,
}

/// A change of `FabricReady`, reported as an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub ready: bool,
    pub reason: String,
    pub message: String,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.labels.is_none() && self.taints.is_none() && self.conditions.is_none()
    }

    /// One human line per write, for `--dry-run` and logs.
    pub fn describe(&self, node: &Node, taint_key: &str) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(want) = &self.labels {
            let have = node.metadata.labels.clone().unwrap_or_default();
            let mut diffs = Vec::new();
            for (k, v) in want {
                match have.get(k) {
                    Some(old) if old == v => {}
                    Some(old) => diffs.push(format!("{k}: {old} -> {v}")),
                    None => diffs.push(format!("{k}: (none) -> {v}")),
                }
            }
            for k in owned_labels(node) {
                if !want.contains_key(&k) {
                    diffs.push(format!("{k}: removed"));
                }
            }
            out.push(format!("labels: {}", diffs.join(", ")));
        }
        if let Some(taints) = &self.taints {
            out.push(match taints.iter().find(|t| t.key == taint_key) {
                Some(t) => format!("taint: add {}:{}", t.key, t.effect),
                None => format!("taint: remove {taint_key}"),
            });
        }
        if let Some(conds) = &self.conditions {
            for c in conds {
                out.push(format!(
                    "condition {}={} reason={} message={:?}",
                    c.type_,
                    c.status,
                    c.reason.as_deref().unwrap_or(""),
                    c.message.as_deref().unwrap_or("")
                ));
            }
        }
        if let Some(t) = &self.transition {
            out.push(format!(
                "event: {} ({})",
                if t.ready {
                    "FabricReady"
                } else {
                    "FabricNotReady"
                },
                t.reason
            ));
        }
        out
    }
}

/// Labels fabricgate owns on the Node according to its managed fields (server-side apply).
pub fn owned_labels(node: &Node) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for entry in node.metadata.managed_fields.iter().flatten() {
        if entry.manager.as_deref() != Some(FIELD_MANAGER)
            || entry.operation.as_deref() != Some("Apply")
            || entry.subresource.as_deref().is_some_and(|s| !s.is_empty())
        {
            continue;
        }
        let labels = entry
            .fields_v1
            .as_ref()
            .and_then(|f| f.0.get("f:metadata"))
            .and_then(|m| m.get("f:labels"))
            .and_then(|l| l.as_object());
        for key in labels.into_iter().flat_map(|l| l.keys()) {
            if let Some(k) = key.strip_prefix("f:") {
                out.insert(k.to_owned());
            }
        }
    }
    out
}

/// The writes that make `node` show `verdict`. Pure: `now` stamps changed conditions.
pub fn plan(node: &Node, verdict: &Verdict, taint_key: &str, now: &Timestamp) -> Plan {
    let mut plan = Plan::default();

    let have = node.metadata.labels.clone().unwrap_or_default();
    let labels_differ = verdict.labels.iter().any(|(k, v)| have.get(k) != Some(v))
        || owned_labels(node)
            .iter()
            .any(|k| !verdict.labels.contains_key(k));
    if labels_differ {
        plan.labels = Some(verdict.labels.clone());
    }

    plan.taints = plan_taints(node, verdict, taint_key, now);

    let observed: Vec<NodeCondition> = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let find = |t: &str| observed.iter().find(|c| c.type_ == t);
    let conditions_differ = verdict.conditions.iter().any(|want| {
        find(&want.type_).is_none_or(|have| {
            have.status != want.status
                || have.reason.as_deref() != Some(want.reason.as_str())
                || have.message.as_deref() != Some(want.message.as_str())
        })
    });
    if conditions_differ {
        plan.conditions = Some(
            verdict
                .conditions
                .iter()
                .map(|want| {
                    let since = find(&want.type_)
                        .filter(|have| have.status == want.status)
                        .and_then(|have| have.last_transition_time.clone())
                        .unwrap_or(Time(*now));
                    NodeCondition {
                        type_: want.type_.clone(),
                        status: want.status.clone(),
                        reason: Some(want.reason.clone()),
                        message: Some(want.message.clone()),
                        last_transition_time: Some(since),
                        // Stamped only when we write, so it never causes a write by itself.
                        last_heartbeat_time: Some(Time(*now)),
                    }
                })
                .collect(),
        );
    }

    if let Some(fabric) = verdict.conditions.iter().find(|c| c.type_ == "FabricReady") {
        let before = find("FabricReady").map(|c| c.status.as_str());
        let first_wait = before.is_none() && fabric.reason == policy::AWAITING_VALIDATION;
        // Entering an agent error is worth one Event even when FabricReady was already False.
        let agent_error = fabric.reason == crate::policy::agent_fault::REASON
            && find("FabricReady").and_then(|c| c.reason.as_deref())
                != Some(crate::policy::agent_fault::REASON);
        if (before != Some(fabric.status.as_str()) || agent_error) && !first_wait {
            plan.transition = Some(Transition {
                ready: fabric.status == "True",
                reason: fabric.reason.clone(),
                message: fabric.message.clone(),
            });
        }
    }
    plan
}

/// The new taint list, or `None` when ours is already right. Taints of other owners keep their
/// place; ours replaces our first one in place or goes last.
fn plan_taints(
    node: &Node,
    verdict: &Verdict,
    taint_key: &str,
    now: &Timestamp,
) -> Option<Vec<Taint>> {
    let current: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    if verdict.keep_taint {
        // An agent error under `node.on_agent_error: keep`: our taint stays as it is.
        return None;
    }
    let want = verdict.taints.iter().find(|t| t.key == taint_key);
    let ours: Vec<&Taint> = current.iter().filter(|t| t.key == taint_key).collect();
    let already = match (want, ours.as_slice()) {
        (None, []) => true,
        (Some(w), [have]) => {
            have.effect == w.effect
                && have.value.as_deref().unwrap_or("") == w.value.as_deref().unwrap_or("")
        }
        _ => false,
    };
    if already {
        return None;
    }
    let ours_new = want.map(|w| Taint {
        key: w.key.clone(),
        value: w.value.clone(),
        effect: w.effect.clone(),
        // kubectl stamps NoExecute taints; tolerationSeconds count from it.
        time_added: (w.effect == "NoExecute").then_some(Time(*now)),
    });
    let mut out = Vec::with_capacity(current.len() + 1);
    let mut placed = false;
    for t in current {
        if t.key != taint_key {
            out.push(t);
        } else if !placed {
            placed = true;
            out.extend(ours_new.clone());
        }
    }
    if !placed {
        out.extend(ours_new);
    }
    Some(out)
}

/// `Retry-After` of the last 429 the client saw, filled in by a layer of the HTTP stack
/// (kube's error type keeps the body, not the headers).
#[derive(Debug, Clone, Default)]
pub struct RetryAfter(Arc<Mutex<Option<Duration>>>);

impl RetryAfter {
    pub fn set(&self, d: Duration) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(d);
        }
    }

    pub fn take(&self) -> Option<Duration> {
        self.0.lock().ok().and_then(|mut slot| slot.take())
    }
}

/// Read timeout of the client that watches the Node: above [`WATCH_TIMEOUT_SECS`], so only
/// a connection that really went quiet times out (a watch sends nothing while nothing changes).
const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(WATCH_TIMEOUT_SECS as u64 + 30);
/// The server ends each watch after this long; the agent then re-watches from the last
/// resourceVersion (one request per 5 minutes at steady state).
const WATCH_TIMEOUT_SECS: u32 = 290;

/// The two clients of the agent: one for reads and writes (15 s timeouts), one for the
/// long-lived watch of its own Node.
pub struct Clients {
    pub requests: kube::Client,
    /// `None`: no watch; the Node is re-read every resync interval instead.
    pub watch: Option<kube::Client>,
}

/// Build the clients from in-cluster config or `KUBECONFIG`, with our own retry handling:
/// kube's default retry would wait up to 15 times inside one request, hiding the outage from us.
///
/// # Errors
/// [`Error::KubeConfig`] when no configuration is found or it is unusable.
pub async fn client(retry_after: RetryAfter) -> Result<Clients> {
    let config = kube::Config::infer().await.map_err(|e| Error::KubeConfig {
        message: format!(
            "{e}; run in a pod with a service account, set KUBECONFIG, or use --dry-run"
        ),
    })?;
    clients_from(config, retry_after)
}

/// [`client`] from an explicit configuration (one process running many agents, in tests).
///
/// # Errors
/// [`Error::KubeConfig`] when the configuration is unusable.
pub fn clients_from(mut config: kube::Config, retry_after: RetryAfter) -> Result<Clients> {
    config.default_retry = false;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(15));
    config.write_timeout = Some(Duration::from_secs(15));
    let mut watch_config = config.clone();
    watch_config.read_timeout = Some(WATCH_READ_TIMEOUT);
    let layer = tower::ServiceBuilder::new().map_response(
        move |res: http::Response<Box<kube::client::DynBody>>| {
            if res.status() == http::StatusCode::TOO_MANY_REQUESTS
                && let Some(secs) = res
                    .headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
            {
                retry_after.set(Duration::from_secs(secs));
            }
            res
        },
    );
    let build = |config: kube::Config| {
        kube::client::ClientBuilder::try_from(config).map_err(|e| Error::KubeConfig {
            message: format!("cannot build the Kubernetes client: {e}"),
        })
    };
    Ok(Clients {
        requests: build(config)?.with_layer(&layer).build(),
        watch: Some(build(watch_config)?.build()),
    })
}

/// Watch this agent's own Node (a field selector on its name) and send every version of it
/// the server reports (`None` when the watch broke, so the reconciler reads again until it is
/// back), until `tx` is closed. Re-watches from the last resourceVersion when
/// the server ends a watch, from scratch when that version is too old (410 Gone), and backs
/// off (capped at `max_backoff`) while the server fails. A watch means drift (a hand-removed
/// taint, a changed allocatable) is seen at once, and steady state costs no periodic reads.
pub async fn watch_node(
    client: kube::Client,
    node_name: String,
    tx: tokio::sync::mpsc::Sender<Option<Node>>,
    max_backoff: Duration,
) {
    use futures::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    let nodes: Api<Node> = Api::all(client);
    let params = WatchParams::default()
        .fields(&format!("metadata.name={node_name}"))
        .timeout(WATCH_TIMEOUT_SECS)
        .disable_bookmarks();
    let mut version = "0".to_owned();
    let mut delay = Duration::from_millis(200);
    loop {
        match nodes.watch(&params, &version).await {
            Ok(stream) => {
                let mut stream = stream.boxed();
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(WatchEvent::Added(node) | WatchEvent::Modified(node)) => {
                            delay = Duration::from_millis(200);
                            if let Some(rv) = &node.metadata.resource_version {
                                version.clone_from(rv);
                            }
                            if tx.send(Some(node)).await.is_err() {
                                return;
                            }
                        }
                        Ok(WatchEvent::Bookmark(b)) => {
                            version = b.metadata.resource_version;
                        }
                        Ok(WatchEvent::Deleted(_)) => {}
                        Ok(WatchEvent::Error(e)) if e.code == 410 => {
                            version = "0".to_owned();
                            let _ = tx.send(None).await;
                            break;
                        }
                        Ok(WatchEvent::Error(e)) => {
                            tracing::debug!(node = %node_name, error = %e.message, "watch error");
                            let _ = tx.send(None).await;
                            break;
                        }
                        Err(e) => {
                            tracing::debug!(node = %node_name, error = %e, "watch stream ended");
                            let _ = tx.send(None).await;
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(node = %node_name, error = %e, retry_in = ?delay, "cannot watch the Node");
                if tx.send(None).await.is_err() {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(max_backoff.max(Duration::from_millis(200)));
            }
        }
        if tx.is_closed() {
            return;
        }
    }
}

/// Whether `verdict` adds our taint to a Node that does not carry it (the only write the
/// breaker may hold back).
fn wants_new_taint(node: &Node, verdict: &Verdict, taint_key: &str) -> bool {
    let has = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == taint_key));
    !has && verdict.taints.iter().any(|t| t.key == taint_key)
}

/// Replace the Node's taints with `taints` by JSON patch, guarded by a `test` on the
/// resourceVersion they were computed from (a 409/422 means someone else wrote meanwhile).
pub(crate) async fn patch_taints(
    nodes: &Api<Node>,
    node: &Node,
    taints: &[Taint],
    field_manager: &str,
) -> std::result::Result<Node, kube::Error> {
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    let patch = json_patch::Patch(vec![
        json_patch::PatchOperation::Test(json_patch::TestOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["metadata", "resourceVersion"]),
            value: json!(rv),
        }),
        json_patch::PatchOperation::Add(json_patch::AddOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["spec", "taints"]),
            value: json!(taints),
        }),
    ]);
    let pp = PatchParams {
        field_manager: Some(field_manager.to_owned()),
        ..PatchParams::default()
    };
    let name = node.metadata.name.clone().unwrap_or_default();
    nodes.patch(&name, &pp, &Patch::Json::<()>(patch)).await
}

/// A few milliseconds that differ between nodes and rounds, so that contending reservations
/// spread out.
fn jitter_ms(node: &str, round: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain(round.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h % 20
}

/// What [`Reconciler::apply`] writes by server-side apply.
#[derive(Clone, Copy)]
enum Apply<'a> {
    Labels(&'a BTreeMap<String, String>),
    Conditions(&'a [NodeCondition]),
}

impl Apply<'_> {
    /// For the error message: "cannot {action} Node {name}".
    fn action(self) -> &'static str {
        match self {
            Self::Labels(_) => "apply labels on",
            Self::Conditions(_) => "apply conditions on",
        }
    }
}

/// What a reconcile did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Requests made (reads and writes).
    pub requests: u32,
    /// Writes made.
    pub writes: u32,
}

/// Keeps one Node in line with the latest verdict.
pub struct Reconciler {
    node_name: String,
    settings: NodeSettings,
    nodes: Option<Api<Node>>,
    events: Option<Api<Event>>,
    dry_run: bool,
    metrics: Arc<Metrics>,
    /// The verdict last confirmed on the Node (read back or written): lets a tick whose
    /// verdict did not change skip even the read.
    confirmed: Option<Verdict>,
    /// An Event owed for a transition whose writes went through but whose Event did not.
    pending_event: Option<Transition>,
    /// Dry-run: what was last logged, so an unchanged verdict logs nothing.
    logged: Option<Vec<String>>,
    /// The newest Node the watch delivered (or our write returned while it is live), used
    /// instead of a GET while the watch is live.
    observed: Option<Node>,
    /// The watch delivered the Node and has not broken since.
    watch_live: bool,
    /// resourceVersions our own writes produced (newest last): the watch echoes them back,
    /// and an echo of our own write is nothing to react to.
    own_versions: std::collections::VecDeque<String>,
    /// `placement.required_labels`: keys the Node must carry (checked on each Node read).
    required_labels: Vec<String>,
    /// The breaker's ledger ([`failclosed::LEDGER`]) in the agent's namespace.
    ledger: Option<Api<ConfigMap>>,
}

impl Reconciler {
    /// `client` is `None` only for `--dry-run` without a cluster.
    pub fn new(
        node_name: String,
        settings: NodeSettings,
        client: Option<kube::Client>,
        dry_run: bool,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            node_name,
            settings,
            nodes: client.clone().map(Api::all),
            events: client.map(|c| Api::namespaced(c, EVENT_NAMESPACE)),
            dry_run,
            metrics,
            confirmed: None,
            pending_event: None,
            logged: None,
            observed: None,
            watch_live: false,
            own_versions: std::collections::VecDeque::new(),
            required_labels: Vec::new(),
            ledger: None,
        }
    }

    /// Reserve new taints in the breaker's ledger in `namespace` (the agent's own).
    pub fn with_breaker_ledger(mut self, namespace: &str) -> Self {
        self.ledger = self
            .nodes
            .as_ref()
            .map(|n| Api::namespaced(n.clone().into_client(), namespace));
        self
    }

    /// A version of the Node from the watch. `true` when it needs a reconcile: someone else
    /// changed it (not an echo of our own writes).
    pub fn observe(&mut self, node: Node) -> bool {
        self.watch_live = true;
        let rv = node.metadata.resource_version.clone().unwrap_or_default();
        let echo = !rv.is_empty() && self.own_versions.contains(&rv);
        if echo {
            // Older echoes must not replace the result of our newer write.
            if self.own_versions.back() == Some(&rv) {
                self.observed = Some(node);
            }
            return false;
        }
        self.observed = Some(node);
        self.confirmed = None;
        true
    }

    /// A write based on what the watch showed failed: read the Node before the next one.
    pub fn distrust_observed(&mut self) {
        self.observed = None;
    }

    /// The watch is down: read the Node again until it is back.
    pub fn forget_observed(&mut self) {
        self.observed = None;
        self.watch_live = false;
    }

    fn remember_own(&mut self, node: &Node) {
        if let Some(rv) = &node.metadata.resource_version {
            if self.own_versions.len() >= 16 {
                self.own_versions.pop_front();
            }
            self.own_versions.push_back(rv.clone());
        }
        if self.watch_live {
            self.observed = Some(node.clone());
        }
    }

    /// Check `placement.required_labels` against the Node on every reconcile: a missing key
    /// makes the written verdict not ready (see [`policy::apply_placement`]).
    #[must_use]
    pub fn with_required_labels(mut self, keys: Vec<String>) -> Self {
        self.required_labels = keys;
        self
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// Whether the Node shows a validation by an earlier run: `FabricReady=True` and not our
    /// taint. `false` when it cannot be read (the safe start: not validated).
    pub async fn validated_on_node(&self) -> bool {
        let Some(nodes) = &self.nodes else {
            return false;
        };
        let Ok(Ok(Some(node))) =
            tokio::time::timeout(Duration::from_secs(3), nodes.get_opt(&self.node_name)).await
        else {
            return false;
        };
        let key = self.settings.taint_key();
        let tainted = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == key));
        let fabric_ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "FabricReady" && c.status == "True")
            });
        fabric_ready && !tainted
    }

    /// Forget what was confirmed, so the next reconcile reads the Node (periodic resync).
    pub fn invalidate(&mut self) {
        self.confirmed = None;
    }

    /// Make the Node show `verdict`.
    ///
    /// # Errors
    /// [`Error::NodeNotFound`] and [`Error::Kube`] for API failures; the caller backs off and
    /// calls again (nothing is left half-written: each write is one atomic request).
    pub async fn reconcile(&mut self, verdict: &Verdict) -> Result<Outcome> {
        let taint_key = self.settings.taint_key();
        let Some(nodes) = self.nodes.clone() else {
            self.log_dry_run_without_cluster(verdict, &taint_key);
            return Ok(Outcome::default());
        };
        if self.confirmed.as_ref() == Some(verdict) && self.pending_event.is_none() {
            return Ok(Outcome::default());
        }
        let mut outcome = Outcome::default();
        let mut node = match self.observed.clone().filter(|_| self.watch_live) {
            Some(node) => node,
            None => self.get(&nodes, &mut outcome).await?,
        };
        // What is confirmed is the probe's verdict; what is written also reflects the Node's
        // placement labels, as the watch (or a read) shows them now.
        let probed = verdict;
        let placed;
        let verdict = if self.required_labels.is_empty() {
            verdict
        } else {
            let labels = node.metadata.labels.clone().unwrap_or_default();
            placed =
                policy::apply_placement(verdict, &labels, &self.required_labels, &self.settings);
            &placed
        };
        let gated;
        let verdict = if wants_new_taint(&node, verdict, &taint_key) {
            match self.breaker(&nodes, &node, &mut outcome).await {
                failclosed::TaintDecision::Taint => {
                    self.metrics.set_breaker_open(false);
                    verdict
                }
                failclosed::TaintDecision::BreakerOpen { message } => {
                    self.metrics.set_breaker_open(true);
                    tracing::error!(
                        node = %self.node_name,
                        reasons = %verdict.reasons().join("; "),
                        "BLAST-RADIUS BREAKER OPEN: {message}"
                    );
                    gated = failclosed::breaker_verdict(verdict, &taint_key, &message);
                    &gated
                }
            }
        } else {
            if verdict.ready {
                self.metrics.set_breaker_open(false);
            }
            verdict
        };
        let now = Timestamp::now();
        let plan = plan(&node, verdict, &taint_key, &now);
        if let Some(t) = &plan.transition {
            self.pending_event = Some(t.clone());
        }

        if self.dry_run {
            let lines = plan.describe(&node, &taint_key);
            if !lines.is_empty() && self.logged.as_ref() != Some(&lines) {
                for line in &lines {
                    tracing::info!(node = %self.node_name, dry_run = true, "would write {line}");
                }
            }
            self.logged = Some(lines);
            self.pending_event = None;
            self.confirmed = Some(probed.clone());
            return Ok(outcome);
        }

        // Going bad: taint first, so nothing new lands while we describe why. Going good:
        // describe first, untaint last.
        let taint_first = !verdict.ready;
        if taint_first && plan.taints.is_some() {
            node = self
                .write_taint(&nodes, node, verdict, &taint_key, &mut outcome)
                .await?;
            self.remember_own(&node);
        }
        if let Some(labels) = &plan.labels {
            node = self
                .apply(&nodes, Apply::Labels(labels), &mut outcome)
                .await?;
            self.remember_own(&node);
        }
        if let Some(conditions) = &plan.conditions {
            node = self
                .apply(&nodes, Apply::Conditions(conditions), &mut outcome)
                .await?;
            self.remember_own(&node);
        }
        if !taint_first && plan.taints.is_some() {
            node = self
                .write_taint(&nodes, node, verdict, &taint_key, &mut outcome)
                .await?;
            self.remember_own(&node);
        }
        if let Some(t) = self.pending_event.clone() {
            self.emit_event(&node, &t, &mut outcome).await?;
            self.pending_event = None;
        }
        self.confirmed = Some(probed.clone());
        Ok(outcome)
    }

    /// The breaker's answer for newly tainting this Node: one list of the pool's Nodes, served
    /// from the API server's watch cache (`resourceVersion=0`), only when a taint is due.
    /// A failed list taints (fail closed) with a warning.
    async fn breaker(
        &self,
        nodes: &Api<Node>,
        node: &Node,
        outcome: &mut Outcome,
    ) -> failclosed::TaintDecision {
        let settings = &self.settings.breaker;
        let (annotation, overridden) =
            failclosed::breaker_override(node, &self.settings.label_prefix);
        if self.settings.pool_selector.is_empty() || !settings.enabled || overridden {
            return failclosed::taint_decision(settings, None, overridden, &annotation);
        }
        outcome.requests += 1;
        let params = ListParams::default()
            .labels(&self.settings.pool_selector)
            .match_any();
        let started = std::time::Instant::now();
        let list = match nodes.list(&params).await {
            Ok(list) => list,
            Err(e) => {
                tracing::warn!(
                    node = %self.node_name,
                    selector = %self.settings.pool_selector,
                    error = %e,
                    "cannot list the pool's Nodes for the breaker; tainting (fail closed)"
                );
                return failclosed::TaintDecision::Taint;
            }
        };
        let pool = failclosed::count_pool(
            &list.items,
            &self.node_name,
            &self.settings.taint_key(),
            settings.window,
            &Timestamp::now(),
        );
        tracing::info!(
            node = %self.node_name,
            pool_nodes = pool.nodes,
            tainted_others = pool.tainted_others,
            new_in_window = pool.new_in_window,
            list_ms = started.elapsed().as_millis() as u64,
            "breaker: counted the pool before tainting"
        );
        let decision = failclosed::taint_decision(settings, Some(&pool), false, &annotation);
        if decision != failclosed::TaintDecision::Taint || settings.max_new_per_window == 0 {
            return decision;
        }
        let names: BTreeSet<&str> = list
            .items
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        match self.reserve(&names, outcome).await {
            Ok(None) => failclosed::TaintDecision::Taint,
            Ok(Some(reserved_by_others)) => {
                let pool = failclosed::PoolCount {
                    new_in_window: pool.new_in_window.max(reserved_by_others),
                    ..pool
                };
                failclosed::taint_decision(settings, Some(&pool), false, &annotation)
            }
            Err(e) => {
                // Without the ledger the list's count stands (a burst may overshoot the cap).
                tracing::warn!(
                    node = %self.node_name,
                    error = %e,
                    "cannot use the breaker's ledger ConfigMap {}; deciding from the pool list \
                     alone",
                    failclosed::LEDGER
                );
                decision
            }
        }
    }

    /// Reserve this node's new taint in the ledger by compare-and-swap: `Ok(None)` reserved;
    /// `Ok(Some(n))`: the cap is reached, `n` others of the pool reserved within the window.
    async fn reserve(
        &self,
        pool: &BTreeSet<&str>,
        outcome: &mut Outcome,
    ) -> std::result::Result<Option<u32>, kube::Error> {
        let Some(ledger) = &self.ledger else {
            return Ok(None);
        };
        let settings = &self.settings.breaker;
        // Conflicts mean others reserved meanwhile: each retry reads their entries.
        for round in 0..20 {
            outcome.requests += 1;
            let mut cm = ledger.get(failclosed::LEDGER).await?;
            let now = Timestamp::now();
            let data = cm.data.clone().unwrap_or_default();
            let others =
                failclosed::ledger_recent(&data, &self.node_name, pool, settings.window, &now);
            if others + 1 > settings.max_new_per_window {
                return Ok(Some(others));
            }
            cm.data = Some(failclosed::ledger_with(
                &data,
                &self.node_name,
                settings.window,
                &now,
            ));
            match ledger
                .replace(failclosed::LEDGER, &PostParams::default(), &cm)
                .await
            {
                Ok(_) => {
                    self.wrote("ledger", outcome);
                    return Ok(None);
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    let pause = 5 + jitter_ms(&self.node_name, round);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                Err(e) => return Err(e),
            }
        }
        // Still contended after 20 rounds: the burst is large; hold back (fail safe).
        Ok(Some(settings.max_new_per_window))
    }

    fn log_dry_run_without_cluster(&mut self, verdict: &Verdict, taint_key: &str) {
        let taint = verdict
            .taints
            .iter()
            .find(|t| t.key == taint_key)
            .map_or_else(|| "none".to_owned(), |t| format!("{}:{}", t.key, t.effect));
        let labels: Vec<String> = verdict
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let conditions: Vec<String> = verdict
            .conditions
            .iter()
            .map(|c| format!("{}={} ({}: {})", c.type_, c.status, c.reason, c.message))
            .collect();
        let lines = vec![
            format!("labels {}", labels.join(",")),
            format!("taint {taint}"),
            format!("conditions {}", conditions.join("; ")),
        ];
        if self.logged.as_ref() == Some(&lines) {
            return;
        }
        for line in &lines {
            tracing::info!(node = %self.node_name, dry_run = true, "would set {line}");
        }
        self.logged = Some(lines);
    }

    async fn get(&self, nodes: &Api<Node>, outcome: &mut Outcome) -> Result<Node> {
        outcome.requests += 1;
        match nodes.get_opt(&self.node_name).await {
            Ok(Some(node)) => Ok(node),
            Ok(None) => Err(Error::NodeNotFound {
                node: self.node_name.clone(),
            }),
            Err(source) => Err(self.kube_err("read", source)),
        }
    }

    fn kube_err(&self, action: &'static str, source: kube::Error) -> Error {
        Error::Kube {
            action,
            node: self.node_name.clone(),
            source: Box::new(source),
        }
    }

    fn wrote(&self, kind: &'static str, outcome: &mut Outcome) {
        outcome.requests += 1;
        outcome.writes += 1;
        self.metrics.record_node_write(kind);
    }

    /// Server-side apply (field manager `fabricgate`, forced) of our labels on the Node, or of
    /// our conditions on its status subresource: one request, counted as one write.
    async fn apply(
        &self,
        nodes: &Api<Node>,
        what: Apply<'_>,
        outcome: &mut Outcome,
    ) -> Result<Node> {
        let name = &self.node_name;
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let (kind, res) = match what {
            Apply::Labels(labels) => {
                let body = json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": { "name": name, "labels": labels },
                });
                let res = nodes.patch(name, &pp, &Patch::Apply(&body)).await;
                ("labels", res)
            }
            Apply::Conditions(conditions) => {
                let body = json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": { "name": name },
                    "status": { "conditions": conditions },
                });
                let res = nodes.patch_status(name, &pp, &Patch::Apply(&body)).await;
                ("conditions", res)
            }
        };
        let node = res.map_err(|e| self.kube_err(what.action(), e))?;
        self.wrote(kind, outcome);
        match what {
            Apply::Labels(labels) => {
                let shown: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                tracing::info!(node = %name, labels = %shown.join(","), "applied labels");
            }
            Apply::Conditions(conditions) => {
                let shown: Vec<String> = conditions
                    .iter()
                    .map(|c| {
                        let reason = c.reason.as_deref().unwrap_or("");
                        format!("{}={}({reason})", c.type_, c.status)
                    })
                    .collect();
                tracing::info!(node = %name, conditions = %shown.join(","), "applied conditions");
            }
        }
        Ok(node)
    }

    /// Read-modify-write of `spec.taints`, guarded by the resourceVersion it was computed from;
    /// a conflict (another writer got in between) re-reads and recomputes.
    async fn write_taint(
        &self,
        nodes: &Api<Node>,
        mut node: Node,
        verdict: &Verdict,
        taint_key: &str,
        outcome: &mut Outcome,
    ) -> Result<Node> {
        for attempt in 1..=TAINT_ATTEMPTS {
            let Some(taints) = plan_taints(&node, verdict, taint_key, &Timestamp::now()) else {
                return Ok(node);
            };
            match patch_taints(nodes, &node, &taints, FIELD_MANAGER).await {
                Ok(new) => {
                    self.wrote("taint", outcome);
                    let on = taints.iter().any(|t| t.key == taint_key);
                    tracing::info!(
                        node = %self.node_name,
                        taint = %taint_key,
                        effect = %self.settings.taint_effect.as_str(),
                        "{}",
                        if on { "added taint" } else { "removed taint" }
                    );
                    return Ok(new);
                }
                // A failed `test` is 422; a resourceVersion conflict is 409.
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 422 => {
                    outcome.requests += 1;
                    tracing::debug!(node = %self.node_name, attempt, "taint write conflicted; re-reading");
                    node = self.get(nodes, outcome).await?;
                }
                Err(e) => return Err(self.kube_err("write the taint on", e)),
            }
        }
        Err(Error::Conflict {
            node: self.node_name.clone(),
            attempts: TAINT_ATTEMPTS,
        })
    }

    async fn emit_event(&self, node: &Node, t: &Transition, outcome: &mut Outcome) -> Result<()> {
        let Some(events) = &self.events else {
            return Ok(());
        };
        let now = Timestamp::now();
        let event = Event {
            metadata: ObjectMeta {
                // A generateName may not end in a dot (the real apiserver refuses it).
                generate_name: Some(format!("{}-", self.node_name)),
                namespace: Some(EVENT_NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(if t.ready { "Validated" } else { "Invalidated" }.to_owned()),
            reason: Some(
                if t.ready {
                    "FabricReady"
                } else if t.reason == crate::policy::agent_fault::REASON {
                    // The agent's own trouble, told apart from a fabric fault at a glance.
                    crate::policy::agent_fault::REASON
                } else {
                    "FabricNotReady"
                }
                .to_owned(),
            ),
            note: Some(truncate(&format!("{}: {}", t.reason, t.message), 1024)),
            type_: Some(if t.ready { "Normal" } else { "Warning" }.to_owned()),
            regarding: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(self.node_name.clone()),
                uid: node.metadata.uid.clone(),
                ..ObjectReference::default()
            }),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(truncate(&format!("fabricgate-{}", self.node_name), 128)),
            ..Event::default()
        };
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        events
            .create(&pp, &event)
            .await
            .map_err(|e| self.kube_err("create an event for", e))?;
        self.wrote("event", outcome);
        tracing::info!(
            node = %self.node_name,
            ready = t.ready,
            reason = %t.reason,
            "recorded event"
        );
        Ok(())
    }
}

/// Events' `note` is limited to 1 kB; cut on a character boundary.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::policy::{Condition, PartVerdict, RdmaVerdict};
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};

    const KEY: &str = "fabricgate.io/unvalidated";

    fn verdict(ready: bool) -> Verdict {
        let config = Config::default();
        let part = PartVerdict {
            ready,
            findings: Vec::new(),
            warnings: Vec::new(),
        };
        let cond = |t: &str, ok: &str| Condition {
            type_: t.into(),
            status: if ready { "True" } else { "False" }.into(),
            reason: if ready { ok.into() } else { "PortDown".into() },
            message: if ready {
                "ok".into()
            } else {
                "mlx5_0 port 1 down".into()
            },
        };
        Verdict {
            ready,
            rdma: RdmaVerdict {
                part: part.clone(),
                usable_ports: u32::from(ready),
                required_ports: 1,
                min_rate_gbps: None,
                link_layer: None,
            },
            lustre: part.clone(),
            gpudirect: policy::GpudirectVerdict::default(),
            placement: part,
            labels: [("fabricgate.io/ready".to_owned(), ready.to_string())].into(),
            taints: if ready {
                vec![]
            } else {
                vec![policy::unvalidated_taint(&config)]
            },
            conditions: vec![
                cond("FabricReady", "FabricValidated"),
                cond("RDMAReady", "RDMAPortsActive"),
            ],
            keep_taint: false,
        }
    }

    fn taint(key: &str) -> Taint {
        Taint {
            key: key.into(),
            effect: "NoSchedule".into(),
            ..Taint::default()
        }
    }

    fn node(labels: &[(&str, &str)], taints: Vec<Taint>, conds: Vec<NodeCondition>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).into(), (*v).into()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                taints: Some(taints),
                ..NodeSpec::default()
            }),
            status: Some(NodeStatus {
                conditions: Some(conds),
                ..NodeStatus::default()
            }),
        }
    }

    fn applied(v: &Verdict, now: &Timestamp) -> Vec<NodeCondition> {
        plan(&node(&[], vec![], vec![]), v, KEY, now)
            .conditions
            .unwrap()
    }

    #[test]
    fn keep_taint_leaves_our_taint_either_way_and_agent_error_is_one_transition() {
        let now = Timestamp::now();
        let mut v = verdict(false);
        v.keep_taint = true;
        for taints in [vec![], vec![taint(KEY)]] {
            let n = node(&[], taints, vec![]);
            assert_eq!(plan(&n, &v, KEY, &now).taints, None);
        }
        // Not ready for a port, then an agent error: still False, but an Event is due once.
        let before = verdict(false);
        let n = node(&[], vec![taint(KEY)], applied(&before, &now));
        let mut v = verdict(false);
        for c in &mut v.conditions {
            c.reason = crate::policy::agent_fault::REASON.into();
        }
        let p = plan(&n, &v, KEY, &now);
        assert_eq!(
            p.transition.map(|t| t.reason),
            Some(crate::policy::agent_fault::REASON.to_owned())
        );
        let n = node(&[], vec![taint(KEY)], applied(&v, &now));
        assert_eq!(plan(&n, &v, KEY, &now).transition, None, "only on entering");
    }

    #[test]
    fn a_node_that_matches_needs_no_write() {
        let now = Timestamp::now();
        let v = verdict(false);
        let n = node(
            &[("fabricgate.io/ready", "false"), ("team", "ml")],
            vec![taint("other"), taint(KEY)],
            applied(&v, &now),
        );
        let p = plan(&n, &v, KEY, &now);
        assert!(p.is_empty(), "{p:?}");
        assert_eq!(p.transition, None);
    }

    #[test]
    fn tainting_keeps_other_taints_in_place_and_untainting_removes_only_ours() {
        let now = Timestamp::now();
        let n = node(&[], vec![taint("a"), taint("b")], vec![]);
        let t = plan(&n, &verdict(false), KEY, &now).taints.unwrap();
        let keys: Vec<&str> = t.iter().map(|t| t.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", KEY]);

        let n = node(
            &[],
            vec![taint("a"), taint(KEY), taint("b"), taint(KEY)],
            vec![],
        );
        let t = plan(&n, &verdict(true), KEY, &now).taints.unwrap();
        let keys: Vec<&str> = t.iter().map(|t| t.key.as_str()).collect();
        assert_eq!(keys, ["a", "b"]);

        // Our key with the wrong effect is replaced where it stands.
        let mut wrong = taint(KEY);
        wrong.effect = "NoExecute".into();
        let n = node(&[], vec![taint("a"), wrong, taint("b")], vec![]);
        let t = plan(&n, &verdict(false), KEY, &now).taints.unwrap();
        assert_eq!(t[1].key, KEY);
        assert_eq!(t[1].effect, "NoSchedule");
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn last_transition_time_changes_only_with_the_status() {
        let then = Timestamp::from_second(1_700_000_000).unwrap();
        let now = Timestamp::now();
        let bad = verdict(false);
        let mut observed = applied(&bad, &then);
        // Same status, new message: rewritten, transition time kept.
        observed[0].message = Some("older message".into());
        let p = plan(&node(&[], vec![], observed.clone()), &bad, KEY, &now);
        let c = p.conditions.unwrap();
        assert_eq!(c[0].last_transition_time, Some(Time(then)));
        assert_eq!(p.transition, None, "no status change, no event");
        // Status flips: new transition time and an event.
        let p = plan(&node(&[], vec![], observed), &verdict(true), KEY, &now);
        let c = p.conditions.unwrap();
        assert_eq!(c[0].last_transition_time, Some(Time(now)));
        assert!(p.transition.unwrap().ready);
    }

    #[test]
    fn labels_we_owned_and_no_longer_set_trigger_an_apply() {
        let now = Timestamp::now();
        let v = verdict(true);
        let mut n = node(
            &[
                ("fabricgate.io/ready", "true"),
                ("fabricgate.io/rdma.rate-gbps", "400"),
            ],
            vec![],
            applied(&v, &now),
        );
        // Not ours (no managed fields): left alone.
        assert!(plan(&n, &v, KEY, &now).labels.is_none());
        n.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some(FIELD_MANAGER.into()),
            operation: Some("Apply".into()),
            fields_v1: Some(FieldsV1(json!({"f:metadata": {"f:labels": {
                "f:fabricgate.io/ready": {}, "f:fabricgate.io/rdma.rate-gbps": {}
            }}}))),
            ..ManagedFieldsEntry::default()
        }]);
        assert_eq!(
            owned_labels(&n),
            [
                "fabricgate.io/rdma.rate-gbps".to_owned(),
                "fabricgate.io/ready".to_owned()
            ]
            .into()
        );
        assert_eq!(plan(&n, &v, KEY, &now).labels, Some(v.labels.clone()));
    }
}
