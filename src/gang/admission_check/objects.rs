//! The leader's FabricCheck objects: creating a check with its members' empty answers,
//! collecting the answers filled, deleting it with its answers, and sweeping the checks and
//! answers no pending gang needs.

use super::state::State;
use super::watch::Stores;
use super::{CHECK_LABEL, CheckSettings, FIELD_MANAGER, RESERVATION_ANNOTATION};
use crate::error::{Error, Result};
use crate::gang::fabriccheck::{self, CheckSpec, FabricCheck, PairResult};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

/// Empty answers created at once: a gang of `gang.max_nodes` gets its answers in moments.
const CREATE_CONCURRENCY: usize = 16;

/// The answers to `fc` among `objects`: one per member at most, each filled by the member it
/// names (the controller created each member's empty answer, and the admission policy lets
/// only the agent of the node it names fill it, once), for this check's uid. Anything else,
/// and an answer not filled yet, is ignored.
pub(super) fn answers(
    objects: Vec<Arc<DynamicObject>>,
    fc: &DynamicObject,
    spec: &CheckSpec,
) -> Vec<PairResult> {
    let uid = fc.uid().unwrap_or_default();
    let members: HashSet<&str> = spec.members.iter().map(|m| m.node.as_str()).collect();
    let mut by_node: BTreeMap<String, PairResult> = BTreeMap::new();
    for obj in objects {
        if obj.labels().get(fabriccheck::CHECK_UID_LABEL) != Some(&uid)
            || !fabriccheck::is_answered(&obj)
        {
            continue;
        }
        let Some(answer) = fabriccheck::result_from_dynamic(&obj) else {
            continue;
        };
        let node = &answer.result.node;
        if answer.check_uid != uid
            || !members.contains(node.as_str())
            || obj.name_any() != fabriccheck::result_name(&uid, node)
        {
            continue;
        }
        by_node.insert(node.clone(), answer.result);
    }
    by_node.into_values().collect()
}

/// The answers to `fc` in the API (one LIST by its uid label, at most the members' count
/// matter).
pub(super) async fn listed_answers(
    checks: &Api<DynamicObject>,
    fc: &DynamicObject,
) -> Result<Vec<Arc<DynamicObject>>> {
    let uid = fc.uid().unwrap_or_default();
    let results = results_beside(checks);
    let lp = ListParams::default().labels(&format!("{}={uid}", fabriccheck::CHECK_UID_LABEL));
    let list = results.list(&lp).await.map_err(|e| Error::KubeObject {
        action: "list the answers to",
        object: format!("FabricCheck {}", fc.name_any()),
        source: Box::new(e),
    })?;
    Ok(list.items.into_iter().map(Arc::new).collect())
}

/// Create the FabricCheck and each member's empty answer; the check's uid, when the API
/// returned it. Only the controller creates answers: their number is the
/// members' of the checks in flight, whatever an agent does. The check is created without the
/// member labels each agent watches, which are added once every answer is there, so no agent
/// sees a check it cannot answer; when an answer or the labels cannot be written (the
/// ResourceQuota full, RBAC), the check is deleted again and the pass retries.
pub(super) async fn create_check(
    checks: &Api<DynamicObject>,
    name: &str,
    reservation: &str,
    spec: &CheckSpec,
) -> Result<Option<String>> {
    let mut obj = DynamicObject::new(name, &fabriccheck::checks());
    obj.metadata = ObjectMeta {
        name: Some(name.to_owned()),
        labels: Some(
            [
                ("app.kubernetes.io/name".to_owned(), "fabricgate".to_owned()),
                (CHECK_LABEL.0.to_owned(), CHECK_LABEL.1.to_owned()),
            ]
            .into(),
        ),
        annotations: Some([(RESERVATION_ANNOTATION.to_owned(), reservation.to_owned())].into()),
        ..ObjectMeta::default()
    };
    obj.data = json!({ "spec": spec });
    let pp = PostParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    };
    let uid = match checks.create(&pp, &obj).await {
        Ok(created) => created.uid(),
        // Created by an earlier pass whose object the store has not shown yet.
        Err(kube::Error::Api(e)) if e.code == 409 => return Ok(None),
        Err(e) => {
            return Err(Error::KubeObject {
                action: "create",
                object: format!("FabricCheck {name}"),
                source: Box::new(e),
            });
        }
    };
    let Some(uid) = uid else {
        tracing::warn!(check = %name, "the API returned the FabricCheck without its uid");
        return Ok(None);
    };
    let check = FabricCheck {
        name: name.to_owned(),
        uid: uid.clone(),
        spec: spec.clone(),
    };
    let ready = match create_answers(checks, &check).await {
        Ok(()) => label_members(checks, &check).await,
        Err(e) => Err(e),
    };
    if let Err(e) = ready {
        // Nobody was asked yet: gone again, with the answers made, and tried afresh.
        if let Err(d) = delete_exactly(checks, name, Some(&uid)).await {
            tracing::warn!(check = %name, error = %d, "cannot delete the unfinished FabricCheck");
        }
        delete_answers(checks, &uid).await;
        return Err(e);
    }
    Ok(Some(uid))
}

/// Create the empty answer of each member of `check` (one that exists already is an earlier
/// attempt's).
async fn create_answers(checks: &Api<DynamicObject>, check: &FabricCheck) -> Result<()> {
    let results = results_beside(checks);
    let pp = PostParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    };
    let mut empty = Vec::with_capacity(check.spec.members.len());
    for m in &check.spec.members {
        let Some(peer) = check.spec.next_after(&m.node) else {
            continue;
        };
        let value = fabriccheck::empty_result_object(check, &m.node, &peer.node);
        match serde_json::from_value::<DynamicObject>(value) {
            Ok(obj) => empty.push(obj),
            Err(e) => {
                tracing::error!(check = %check.name, node = %m.node, error = %e,
                    "cannot build a member's empty FabricCheckResult");
            }
        }
    }
    let mut creates = futures::stream::iter(empty)
        .map(|obj| {
            let (results, pp) = (results.clone(), pp.clone());
            async move {
                match results.create(&pp, &obj).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                    Err(e) => Err(Error::KubeObject {
                        action: "create the empty answer",
                        object: format!("FabricCheckResult {}", obj.name_any()),
                        source: Box::new(e),
                    }),
                }
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY);
    while let Some(created) = creates.next().await {
        created?;
    }
    Ok(())
}

/// Label `check` for each member's watch: the agents are asked now.
async fn label_members(checks: &Api<DynamicObject>, check: &FabricCheck) -> Result<()> {
    let labels: serde_json::Map<String, serde_json::Value> = check
        .spec
        .members
        .iter()
        .map(|m| (fabriccheck::member_label(&m.node), json!("true")))
        .collect();
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let patch = json!({ "metadata": { "labels": labels } });
    match checks.patch(&check.name, &pp, &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::KubeObject {
            action: "label the members of",
            object: format!("FabricCheck {}", check.name),
            source: Box::new(e),
        }),
    }
}

/// The FabricCheckResults beside `checks`: the same client and namespace.
fn results_beside(checks: &Api<DynamicObject>) -> Api<DynamicObject> {
    Api::namespaced_with(
        checks.clone().into_client(),
        checks.namespace().unwrap_or_default(),
        &fabriccheck::results(),
    )
}

/// Delete check `name`, only while it is still the object with `uid` (when known): a check
/// made again under the same name by a later pass is not touched (409).
async fn delete_exactly(
    checks: &Api<DynamicObject>,
    name: &str,
    uid: Option<&str>,
) -> kube::Result<()> {
    let dp = DeleteParams {
        preconditions: uid.map(|uid| kube::api::Preconditions {
            uid: Some(uid.to_owned()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    checks.delete(name, &dp).await.map(|_| ())
}

pub(super) async fn delete_check(
    checks: &Api<DynamicObject>,
    fc: &DynamicObject,
    state: &mut State,
) {
    let name = fc.name_any();
    match delete_exactly(checks, &name, fc.uid().as_deref()).await {
        Ok(_) => {
            tracing::debug!(check = %name, "FabricCheck deleted");
            state.deleted.insert(fc.uid().unwrap_or_default());
        }
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {
            state.deleted.insert(fc.uid().unwrap_or_default());
        }
        Err(e) => tracing::warn!(check = %name, error = %e, "cannot delete the FabricCheck"),
    }
    if let Some(uid) = fc.uid() {
        delete_answers(checks, &uid).await;
    }
}

/// Delete every answer to the check `uid`, one request (the garbage collector would too,
/// through their owner reference, but only where kube-controller-manager runs it promptly).
pub(super) async fn delete_answers(checks: &Api<DynamicObject>, uid: &str) {
    let results = results_beside(checks);
    let lp = ListParams::default().labels(&format!("{}={uid}", fabriccheck::CHECK_UID_LABEL));
    if let Err(e) = results
        .delete_collection(&DeleteParams::default(), &lp)
        .await
    {
        tracing::warn!(check_uid = %uid, error = %e, "cannot delete the FabricCheckResults");
    }
}

/// Delete the FabricChecks that no Pending check of ours needs: their Workload is gone (or
/// another with its name), or the check was decided, or they are older than twice
/// `gang.timeout`.
pub(super) async fn cleanup(
    client: &kube::Client,
    w: &Stores,
    s: &CheckSettings,
    state: &mut State,
    pending: &HashSet<String>,
) {
    let checks: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &s.gang.namespace, &fabriccheck::checks());
    let live: HashSet<String> = w.checks.state().iter().filter_map(|fc| fc.uid()).collect();
    state.deleted.retain(|uid| live.contains(uid));
    state.same_members.retain(|uid, _| live.contains(uid));
    // Kept past a lagging store's view of it: a check is swept at twice gang.timeout anyway.
    let made_for = s.gang.timeout * 2;
    state.made.retain(|_, at| at.elapsed() <= made_for);
    let max_age = SignedDuration::try_from(s.gang.timeout * 2).unwrap_or_default();
    for fc in w.checks.state() {
        if state.deleted.contains(&fc.uid().unwrap_or_default()) {
            continue;
        }
        let of = &fc.data["spec"]["workload"];
        if s.workload_namespace
            .as_deref()
            .is_some_and(|ns| of["namespace"].as_str() != Some(ns))
        {
            continue;
        }
        let uid = of["uid"].as_str().unwrap_or_default();
        let old = fc
            .metadata
            .creation_timestamp
            .as_ref()
            .is_some_and(|t| Timestamp::now().duration_since(t.0) > max_age);
        if !pending.contains(uid) || old {
            delete_check(&checks, &fc, state).await;
        }
    }
    // Answers that outlived their check (its deletecollection failed, and the garbage
    // collector has not run), once they are old enough that the store cannot merely lag
    // behind a new check.
    let mut orphaned = BTreeSet::new();
    for r in w.results.state() {
        let Some(uid) = r.labels().get(fabriccheck::CHECK_UID_LABEL) else {
            continue;
        };
        let ours = s.workload_namespace.as_deref().is_none_or(|ns| {
            fabriccheck::result_from_dynamic(&r)
                .is_some_and(|a| a.check.starts_with(&format!("{ns}.")))
        });
        let old = r
            .metadata
            .creation_timestamp
            .as_ref()
            .is_some_and(|t| Timestamp::now().duration_since(t.0) > max_age);
        if ours && old && !live.contains(uid) {
            orphaned.insert(uid.clone());
        }
    }
    for uid in orphaned {
        delete_answers(&checks, &uid).await;
    }
}
