//! The leader's proof that it can act: a server-side dry run of its taint on a pool Node, at
//! the start of each leadership and again while its writes are refused. The admission policy
//! of deploy/guard.yaml confines the guard to its pool, the key `pool-selector` of the
//! requirements ConfigMap (which also sets `node.pool_selector`); when that key is missing or
//! garbled, or the policy reads another ConfigMap than the guard mounts, every taint would be
//! refused, and the guard would find out
//! only at the first dead agent. It says so at once instead: `/readyz` fails,
//! `fabricgate_guard_blocked` is 1, and a Warning Event names both selectors.

use super::cache::Cache;
use super::metrics::{GuardMetrics, Outcome, WriteKind};
use super::{GUARD_FIELD_MANAGER, GuardSettings, record};
use crate::text::truncate;
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// Reason of the Event when the dry run is admitted.
pub const POLICY_ADMITS: &str = "GuardPolicyAdmitsTaint";
/// Reason of the Event when it is refused.
pub const POLICY_REFUSES: &str = "GuardPolicyRefusesTaint";
/// Reason of the Event when a dry run of the taint on a Node outside the pool is admitted.
pub const NOT_CONFINED: &str = "GuardNotConfined";
/// Reason of the Event when it is refused again after that.
pub const CONFINED: &str = "GuardConfined";
/// `reportingController` of the guard's Events.
const CONTROLLER: &str = "fabricgate.io/guard";

/// Dry-run the guard's taint on the first pool Node of `cache` that does not carry it yet.
/// `last`: what the previous proof of this leadership found. Returns what this one found:
/// `Some(true)` admitted, `Some(false)` refused, `last` when there was nothing to prove on (no
/// untainted pool Node) or the request failed (retried on the next turn). An Event tells each
/// change.
pub(super) async fn prove(
    nodes: &Api<Node>,
    events: &Api<Event>,
    cache: &Cache,
    s: &GuardSettings,
    m: &GuardMetrics,
    last: Option<bool>,
) -> Option<bool> {
    let key = s.config.node.taint_key();
    let pool = cache.nodes();
    let Some(node) = pool.iter().find(|n| {
        !n.spec
            .as_ref()
            .and_then(|sp| sp.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == key))
    }) else {
        return last;
    };
    let name = node.metadata.name.clone().unwrap_or_default();
    let result = dry_run_taint(nodes, node, s).await;
    let refusal = match &result {
        Err(kube::Error::Api(status)) => status.message.clone(),
        _ => String::new(),
    };
    let outcome = Outcome::of(&result);
    let _ = record(m, WriteKind::DryRun, "dry-run a taint on", &name, result);
    let admitted = match outcome {
        Outcome::Ok => true,
        Outcome::Refused(_) => false,
        Outcome::Failed => return last,
    };
    if last != Some(admitted) {
        let selector = &s.config.node.pool_selector;
        let (type_, reason, note) = if admitted {
            let note = format!(
                "a server-side dry run of the guard's taint on pool Node {name} was admitted: \
                 its admission policy's pool holds the Nodes of node.pool_selector \
                 \"{selector}\""
            );
            ("Normal", POLICY_ADMITS, note)
        } else {
            let note = format!(
                "the guard cannot taint pool Node {name}: its node.pool_selector \"{selector}\" \
                 selects it, but the API server refuses the guard's taint there: {refusal}. Make \
                 the pool of the guard's admission policy (ValidatingAdmissionPolicy \
                 fabricgate-guard-pool: the key pool-selector of the ConfigMap its binding \
                 names) select what node.pool_selector selects; until then a Node whose agent \
                 dies is not tainted"
            );
            ("Warning", POLICY_REFUSES, note)
        };
        emit(events, s, type_, reason, &note).await;
        // Logged once the Event is out: what follows is the guard's steady state.
        if admitted {
            tracing::info!(node = %name, selector = %selector, "{note}");
        } else {
            tracing::error!(node = %name, selector = %selector, "{note}");
        }
    }
    Some(admitted)
}

/// The leader's proof that its admission policy confines it to the pool: a server-side dry
/// run of its taint on a Node *outside* the pool must be refused. The pool proof above shows
/// the guard can act; this one that a token leaked from it cannot act elsewhere. The policy
/// reads the pool from the requirements ConfigMap, and admits every Node while that ConfigMap
/// is missing (so that its absence does not refuse the kubelets' writes): deleting or renaming
/// it, or editing the policy, lifts the limit without a word. Proven at each leadership and
/// every `--prove-every` after; admitted outside the pool: a Warning Event, `/readyz` fails,
/// `fabricgate_guard_confined` 0 (alert `FabricgateGuardNotConfined`).
pub(super) struct Confinement {
    /// What the last proof found (`None`: not proven).
    last: Option<bool>,
    /// When the last proof ran (`None`: due now).
    at: Option<tokio::time::Instant>,
    /// When this leadership began.
    since: tokio::time::Instant,
}

impl Default for Confinement {
    fn default() -> Self {
        Self {
            last: None,
            at: None,
            since: tokio::time::Instant::now(),
        }
    }
}

/// How long after a leadership begins a guard not confined proves again on every turn: an
/// admission policy just applied (an install, an upgrade) takes the API server a moment to
/// enforce, and the guard should not stay unready for a whole `--prove-every` because of it.
const EAGER_AFTER_LEADING: std::time::Duration = std::time::Duration::from_secs(20);

impl Confinement {
    /// Whether to prove again: every `every`, and on every turn while not confined in the
    /// first seconds of a leadership.
    pub(super) fn due(&self, every: std::time::Duration) -> bool {
        let eager = self.last == Some(false) && self.since.elapsed() < EAGER_AFTER_LEADING;
        eager || self.at.is_none_or(|at| at.elapsed() >= every)
    }

    pub(super) async fn prove(
        &mut self,
        nodes: &Api<Node>,
        events: &Api<Event>,
        s: &GuardSettings,
        m: &GuardMetrics,
    ) {
        self.at = Some(tokio::time::Instant::now());
        let candidates = outside_nodes(nodes, s).await;
        if candidates.is_empty() {
            // Every Node is in the pool (or none could be listed): nothing to prove on.
            if self.last.is_none() {
                tracing::info!("no Node outside the pool to prove the guard's confinement on");
                m.set_confined(None, "");
            }
            return;
        }
        // The first that answers about the policy: a Node deleted meanwhile (404) says
        // nothing, nor does a server away (next time).
        let mut answer = None;
        for node in &candidates {
            match dry_run_taint(nodes, node, s).await {
                Ok(_) => answer = Some((node, true)),
                Err(kube::Error::Api(status)) if status.code == 403 || status.code == 422 => {
                    answer = Some((node, false));
                }
                Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                    continue;
                }
                Err(_) => {}
            }
            break;
        }
        let Some((node, admitted)) = answer else {
            self.at = None;
            return;
        };
        let name = node.metadata.name.clone().unwrap_or_default();
        let selector = &s.config.node.pool_selector;
        let why = format!(
            "the guard is not confined to its pool: a dry run of its taint on Node {name}, \
             outside node.pool_selector \"{selector}\", was admitted. Its admission policy \
             (ValidatingAdmissionPolicy fabricgate-guard-pool) has no pool: the requirements \
             ConfigMap its binding names is missing or renamed, or the policy or its binding was \
             changed. Restore them (deploy/guard.yaml, daemonset.yaml); until then a leaked \
             guard token can taint any Node"
        );
        if self.last != Some(!admitted) {
            if admitted {
                emit(events, s, "Warning", NOT_CONFINED, &why).await;
                tracing::error!(node = %name, selector = %selector, "{why}");
            } else {
                let note = format!(
                    "the guard is confined to its pool: a dry run of its taint on Node {name}, \
                     outside node.pool_selector \"{selector}\", was refused"
                );
                // An Event only when it was not confined before: the steady state says nothing.
                if self.last == Some(false) {
                    emit(events, s, "Normal", CONFINED, &note).await;
                }
                tracing::info!(node = %name, "{note}");
            }
        }
        // Said in the metric and `/readyz` once the Event is out.
        m.set_confined(Some(!admitted), &why);
        self.last = Some(!admitted);
    }
}

/// Nodes outside the pool without our taint, a few: listed by each requirement of
/// `node.pool_selector` negated (`policy::breaker::selector_complement`), at most 20 a list,
/// until one list finds some.
async fn outside_nodes(nodes: &Api<Node>, s: &GuardSettings) -> Vec<Node> {
    let selector = &s.config.node.pool_selector;
    let key = s.config.node.taint_key();
    for complement in crate::policy::breaker::selector_complement(selector).unwrap_or_default() {
        let params = ListParams::default().labels(&complement).limit(20);
        let Ok(list) = nodes.list(&params).await else {
            continue;
        };
        let untainted: Vec<Node> = list
            .items
            .into_iter()
            .filter(|n| {
                !n.spec
                    .as_ref()
                    .and_then(|sp| sp.taints.as_ref())
                    .is_some_and(|ts| ts.iter().any(|t| t.key == key))
            })
            .collect();
        if !untainted.is_empty() {
            return untainted;
        }
    }
    Vec::new()
}

/// The guard's taint added to `node`, as a server-side dry run (nothing is written).
async fn dry_run_taint(
    nodes: &Api<Node>,
    node: &Node,
    s: &GuardSettings,
) -> std::result::Result<Node, kube::Error> {
    let taints = super::sweep::with_our_taint(node, s);
    let patch = json_patch::Patch(vec![json_patch::PatchOperation::Add(
        json_patch::AddOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["spec", "taints"]),
            value: json!(taints),
        },
    )]);
    let pp = PatchParams {
        dry_run: true,
        field_manager: Some(GUARD_FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let name = node.metadata.name.clone().unwrap_or_default();
    nodes.patch(&name, &pp, &Patch::Json::<()>(patch)).await
}

/// This replica's own pod (`--identity`), in the guard's namespace.
fn own_pod(s: &GuardSettings) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Pod".to_owned()),
        name: Some(s.identity.clone()),
        namespace: Some(s.namespace.clone()),
        ..ObjectReference::default()
    }
}

/// A dry run's Event, about this replica.
async fn emit(events: &Api<Event>, s: &GuardSettings, type_: &str, reason: &str, note: &str) {
    let about = Regarding {
        object: own_pod(s),
        action: "DryRunTaint",
    };
    record_event(events, s, &about, type_, reason, note).await;
}

/// What an Event is about, and the guard's action on it.
pub(super) struct Regarding {
    pub(super) object: ObjectReference,
    pub(super) action: &'static str,
}

/// An Event about `about.object` (in its namespace: `events` must be namespaced there); a
/// failure is logged, never retried.
pub(super) async fn record_event(
    events: &Api<Event>,
    s: &GuardSettings,
    about: &Regarding,
    type_: &str,
    reason: &str,
    note: &str,
) {
    let name = about.object.name.clone().unwrap_or_default();
    let event = Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-", truncate(&name, 200))),
            namespace: about.object.namespace.clone(),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        action: Some(about.action.to_owned()),
        reason: Some(reason.to_owned()),
        note: Some(truncate(note, 1024)),
        type_: Some(type_.to_owned()),
        regarding: Some(about.object.clone()),
        reporting_controller: Some(CONTROLLER.to_owned()),
        reporting_instance: Some(truncate(&s.identity, 128)),
        ..Event::default()
    };
    let pp = PostParams {
        field_manager: Some(GUARD_FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    };
    if let Err(e) = events.create(&pp, &event).await {
        tracing::warn!(error = %e, reason, object = %name, "cannot record the Event");
    }
}
