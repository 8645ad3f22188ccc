//! The leader's FabricCheck objects: creating a check, collecting its members' answers,
//! deleting it with its answers, and sweeping the checks and answers no pending gang needs.

use super::state::State;
use super::watch::Stores;
use super::{CHECK_LABEL, CheckSettings, FIELD_MANAGER, RESERVATION_ANNOTATION};
use crate::error::{Error, Result};
use crate::node::fabriccheck::{self, CheckSpec, PairResult};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

/// The answers to `fc` among `objects`: one per member at most, each from the member it names
/// (the admission policy ties a result's node and name to its author's node claim), for this
/// check's uid. Anything else is ignored.
pub(super) fn answers(
    objects: Vec<Arc<DynamicObject>>,
    fc: &DynamicObject,
    spec: &CheckSpec,
) -> Vec<PairResult> {
    let uid = fc.uid().unwrap_or_default();
    let members: HashSet<&str> = spec.members.iter().map(|m| m.node.as_str()).collect();
    let mut by_node: BTreeMap<String, PairResult> = BTreeMap::new();
    for obj in objects {
        if obj.labels().get(fabriccheck::CHECK_UID_LABEL) != Some(&uid) {
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
    let results: Api<DynamicObject> = Api::namespaced_with(
        checks.clone().into_client(),
        checks.namespace().unwrap_or_default(),
        &fabriccheck::results(),
    );
    let lp = ListParams::default().labels(&format!("{}={uid}", fabriccheck::CHECK_UID_LABEL));
    let list = results.list(&lp).await.map_err(|e| Error::KubeObject {
        action: "list the answers to",
        object: format!("FabricCheck {}", fc.name_any()),
        source: Box::new(e),
    })?;
    Ok(list.items.into_iter().map(Arc::new).collect())
}

/// Create the FabricCheck; its uid, when the API returned it.
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
            .into_iter()
            // Each member's agent watches only the checks labelled for its Node.
            .chain(
                spec.members
                    .iter()
                    .map(|m| (fabriccheck::member_label(&m.node), "true".to_owned())),
            )
            .collect(),
        ),
        annotations: Some([(RESERVATION_ANNOTATION.to_owned(), reservation.to_owned())].into()),
        ..ObjectMeta::default()
    };
    obj.data = json!({ "spec": spec });
    let pp = PostParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    };
    match checks.create(&pp, &obj).await {
        Ok(created) => Ok(created.uid()),
        // Created by an earlier pass whose object the store has not shown yet.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(Error::KubeObject {
            action: "create",
            object: format!("FabricCheck {name}"),
            source: Box::new(e),
        }),
    }
}

pub(super) async fn delete_check(
    checks: &Api<DynamicObject>,
    fc: &DynamicObject,
    state: &mut State,
) {
    let name = fc.name_any();
    let mut dp = DeleteParams::default();
    if let Some(uid) = fc.uid() {
        dp = DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..dp
        };
    }
    match checks.delete(&name, &dp).await {
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
    let results: Api<DynamicObject> = Api::namespaced_with(
        checks.clone().into_client(),
        checks.namespace().unwrap_or_default(),
        &fabriccheck::results(),
    );
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
    let checks: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &s.config.gang.namespace,
        &fabriccheck::checks(),
    );
    let live: HashSet<String> = w.checks.state().iter().filter_map(|fc| fc.uid()).collect();
    state.deleted.retain(|uid| live.contains(uid));
    state.same_members.retain(|uid, _| live.contains(uid));
    let max_age = SignedDuration::try_from(s.config.gang.timeout * 2).unwrap_or_default();
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
    // Answers that outlived their check (created after it was deleted), once they are old
    // enough that the store cannot merely lag behind a new check.
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
