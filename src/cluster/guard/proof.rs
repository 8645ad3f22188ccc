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
use k8s_openapi::api::core::v1::{Node, ObjectReference, Taint};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

/// Reason of the Event when the dry run is admitted.
pub const POLICY_ADMITS: &str = "GuardPolicyAdmitsTaint";
/// Reason of the Event when it is refused.
pub const POLICY_REFUSES: &str = "GuardPolicyRefusesTaint";
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
    let mut taints = node
        .spec
        .as_ref()
        .and_then(|sp| sp.taints.clone())
        .unwrap_or_default();
    taints.push(Taint {
        key,
        effect: s.config.node.taint_effect.as_str().to_owned(),
        ..Taint::default()
    });
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
    let result = nodes.patch(&name, &pp, &Patch::Json::<()>(patch)).await;
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
