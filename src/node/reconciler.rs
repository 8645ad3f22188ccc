//! [`Reconciler`]: makes one Node show the latest verdict, writing only the difference, in an
//! order that never opens a window, with the blast-radius breaker before a new taint.

use super::breaker::PoolBreaker;
use super::plan::{Plan, plan, plan_taints, wants_new_taint};
use super::{EVENT_NAMESPACE, FIELD_MANAGER, Outcome, REPORTING_CONTROLLER, Transition};
use crate::config::NodeSettings;
use crate::error::{Error, Result};
use crate::observe::metrics::Metrics;
use crate::policy::breaker;
use crate::policy::{self, Verdict};
use crate::text::truncate;
use k8s_openapi::api::core::v1::{Node, NodeCondition, ObjectReference, Taint};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Attempts of the taint read-modify-write before giving up until the next retry.
const TAINT_ATTEMPTS: u32 = 5;

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
    /// The blast-radius breaker's reads and ledger, asked before a new taint.
    breaker: PoolBreaker,
    /// Annotations the agent keeps on its Node (`fabricgate.io/peers-endpoint`), applied with
    /// the labels (one field manager, one request) and only when the Node differs.
    annotations: BTreeMap<String, String>,
    /// Annotations whose value another task keeps current (the peer agent's
    /// `fabricgate.io/peers-gids`, from each probe's usable ports), applied with
    /// `annotations`; an empty value is left out.
    shared_annotations: Vec<(String, Arc<std::sync::Mutex<String>>)>,
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
            breaker: PoolBreaker::new(node_name.clone(), settings.clone(), metrics.clone()),
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
            annotations: BTreeMap::new(),
            shared_annotations: Vec::new(),
        }
    }

    /// Keep `annotations` on the Node (written with the labels, only when they differ).
    #[must_use]
    pub fn with_annotations(mut self, annotations: BTreeMap<String, String>) -> Self {
        self.annotations = annotations;
        self
    }

    /// Also keep the annotation `key` with the value `value` holds at each write (none
    /// while it is empty).
    #[must_use]
    pub fn with_shared_annotation(
        mut self,
        key: &str,
        value: Arc<std::sync::Mutex<String>>,
    ) -> Self {
        self.shared_annotations.push((key.to_owned(), value));
        self
    }

    /// Every annotation we keep, as of now.
    fn all_annotations(&self) -> BTreeMap<String, String> {
        let mut all = self.annotations.clone();
        for (key, value) in &self.shared_annotations {
            let value = value.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if !value.is_empty() {
                all.insert(key.clone(), value);
            }
        }
        all
    }

    /// Whether the Node lacks one of our annotations, or shows another value.
    fn annotations_differ(&self, node: &Node) -> bool {
        let have = node.metadata.annotations.as_ref();
        self.all_annotations()
            .iter()
            .any(|(k, v)| have.and_then(|a| a.get(k)) != Some(v))
    }

    /// Reserve new taints in the breaker's ledger in `namespace` (the agent's own).
    pub fn with_breaker_ledger(mut self, namespace: &str) -> Self {
        if let Some(nodes) = &self.nodes {
            self.breaker
                .use_ledger(nodes.clone().into_client(), namespace);
        }
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
        if self.older_than_own_write(&rv) {
            // The watch can deliver a version from before our write after the write's answer
            // (its initial list races the first reconcile): planning on it would redo a
            // transition, one more Event. Resource versions of built-in types compare as
            // integers (KEP-5504); one that does not parse is taken as news.
            return false;
        }
        self.observed = Some(node);
        self.confirmed = None;
        true
    }

    fn older_than_own_write(&self, rv: &str) -> bool {
        let newest_own = self.own_versions.back().and_then(|v| v.parse::<u64>().ok());
        matches!((rv.parse::<u64>().ok(), newest_own), (Some(seen), Some(own)) if seen < own)
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
        let gated = self
            .gate(&nodes, &node, verdict, &taint_key, &mut outcome)
            .await;
        let verdict = gated.as_ref();
        let now = Timestamp::now();
        let mut plan = plan(&node, verdict, &taint_key, &now);
        if plan.labels.is_none() && self.annotations_differ(&node) {
            // The labels apply carries the annotations: the same labels, once more.
            plan.labels = Some(verdict.labels.clone());
        }
        if let Some(t) = &plan.transition {
            self.pending_event = Some(t.clone());
        }

        if self.dry_run {
            self.log_dry_run(&plan, &node, &taint_key);
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

    /// `verdict` as the breaker lets it be written: asked only when it would newly add the
    /// taint; held, it keeps the Node untainted and says why (`BreakerOpen`).
    async fn gate<'v>(
        &mut self,
        nodes: &Api<Node>,
        node: &Node,
        verdict: &'v Verdict,
        taint_key: &str,
        outcome: &mut Outcome,
    ) -> Cow<'v, Verdict> {
        if !wants_new_taint(node, verdict, taint_key) {
            if verdict.ready {
                self.metrics.set_breaker_open(false);
            }
            return Cow::Borrowed(verdict);
        }
        match self.breaker.decide(nodes, node, outcome).await {
            breaker::TaintDecision::Taint => {
                self.metrics.set_breaker_open(false);
                Cow::Borrowed(verdict)
            }
            breaker::TaintDecision::BreakerOpen { message } => {
                self.metrics.set_breaker_open(true);
                tracing::error!(
                    node = %self.node_name,
                    reasons = %verdict.reasons().join("; "),
                    "BLAST-RADIUS BREAKER OPEN: {message}"
                );
                Cow::Owned(breaker::breaker_verdict(verdict, taint_key, &message))
            }
        }
    }

    /// Dry-run: log what `plan` would write, once per change.
    fn log_dry_run(&mut self, plan: &Plan, node: &Node, taint_key: &str) {
        let lines = plan.describe(node, taint_key);
        if !lines.is_empty() && self.logged.as_ref() != Some(&lines) {
            for line in &lines {
                tracing::info!(node = %self.node_name, dry_run = true, "would write {line}");
            }
        }
        self.logged = Some(lines);
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
                let mut body = json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": { "name": name, "labels": labels },
                });
                let annotations = self.all_annotations();
                if !annotations.is_empty() {
                    body["metadata"]["annotations"] = json!(annotations);
                }
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
