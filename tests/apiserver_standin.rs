//! The API-server stand-in answers `kube::Client` as the Kubernetes API documents: these tests
//! pin the semantics the agent (and the VM tests) rely on.

mod support;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::apiserver::{ApiServer, Fault};

const NODE: &str = "n1";

async fn client(api: &ApiServer) -> kube::Client {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    api.write_kubeconfig(&path);
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.default_retry = false;
    kube::Client::try_from(config).unwrap()
}

fn rv(node: &Node) -> u64 {
    node.metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

fn condition_types(node: Node) -> Vec<String> {
    node.status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .map(|c| c.type_)
        .collect()
}

fn code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("not an API error: {other}"),
    }
}

fn apply_labels(labels: Value) -> Value {
    json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": NODE, "labels": labels } })
}

#[tokio::test]
async fn get_and_not_found() {
    let api = ApiServer::start();
    api.seed_node(ApiServer::kubelet_node(NODE));
    let nodes: Api<Node> = Api::all(client(&api).await);
    let n = nodes.get(NODE).await.unwrap();
    assert_eq!(n.metadata.name.as_deref(), Some(NODE));
    assert!(n.metadata.uid.is_some());
    assert_eq!(code(nodes.get("nope").await.unwrap_err()), 404);
    assert!(nodes.get_opt("nope").await.unwrap().is_none());
    assert_eq!(api.count("get"), 3);
}

#[tokio::test]
async fn server_side_apply_owns_labels_per_manager() {
    let api = ApiServer::start();
    api.seed_node(ApiServer::kubelet_node(NODE));
    let nodes: Api<Node> = Api::all(client(&api).await);
    let ssa = PatchParams::apply("fabricgate").force();
    let n = nodes
        .patch(
            NODE,
            &ssa,
            &Patch::Apply(apply_labels(json!({"a": "1", "b": "2"}))),
        )
        .await
        .unwrap();
    let labels = n.metadata.labels.clone().unwrap();
    assert_eq!(labels["a"], "1");
    assert_eq!(
        labels["kubernetes.io/hostname"], NODE,
        "kubelet's label kept"
    );
    let before = rv(&n);

    // Same config again: a no-op, no new resourceVersion.
    let n = nodes
        .patch(
            NODE,
            &ssa,
            &Patch::Apply(apply_labels(json!({"a": "1", "b": "2"}))),
        )
        .await
        .unwrap();
    assert_eq!(rv(&n), before);

    // Dropping `b` from the config removes it; other managers' labels stay.
    let n = nodes
        .patch(NODE, &ssa, &Patch::Apply(apply_labels(json!({"a": "1"}))))
        .await
        .unwrap();
    let labels = n.metadata.labels.clone().unwrap();
    assert!(!labels.contains_key("b"));
    assert!(labels.contains_key("kubernetes.io/os"));
    assert!(rv(&n) > before);
    let owned = n
        .metadata
        .managed_fields
        .unwrap()
        .into_iter()
        .find(|m| m.manager.as_deref() == Some("fabricgate"))
        .unwrap();
    assert_eq!(owned.operation.as_deref(), Some("Apply"));
    assert_eq!(
        owned.fields_v1.unwrap().0,
        json!({"f:metadata": {"f:labels": {"f:a": {}}}})
    );

    // Without force, a different value of another manager's label is a conflict.
    let no_force = PatchParams::apply("someone");
    let e = nodes
        .patch(
            NODE,
            &no_force,
            &Patch::Apply(apply_labels(json!({"kubernetes.io/os": "plan9"}))),
        )
        .await
        .unwrap_err();
    assert_eq!(code(e), 409);
}

#[tokio::test]
async fn status_apply_merges_conditions_by_type() {
    let api = ApiServer::start();
    api.seed_node(ApiServer::kubelet_node(NODE));
    let nodes: Api<Node> = Api::all(client(&api).await);
    let ssa = PatchParams::apply("fabricgate").force();
    let body = |types: &[&str]| {
        let conds: Vec<Value> = types
            .iter()
            .map(|t| json!({"type": t, "status": "False", "reason": "PortDown", "message": "m"}))
            .collect();
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "status": {"conditions": conds}})
    };
    let n = nodes
        .patch_status(
            NODE,
            &ssa,
            &Patch::Apply(body(&["FabricReady", "RDMAReady"])),
        )
        .await
        .unwrap();
    let types = condition_types(n);
    assert_eq!(types, ["Ready", "FabricReady", "RDMAReady"]);
    let n = nodes
        .patch_status(NODE, &ssa, &Patch::Apply(body(&["FabricReady"])))
        .await
        .unwrap();
    let types = condition_types(n);
    assert_eq!(
        types,
        ["Ready", "FabricReady"],
        "our dropped type goes, kubelet's stays"
    );
    // A status apply cannot change labels, and the main resource ignores status.
    let e = nodes
        .patch_status(
            NODE,
            &PatchParams::apply("labeler"),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"x": "y"}}, "status": {}})),
        )
        .await;
    if let Ok(n) = e {
        assert!(!n.metadata.labels.unwrap().contains_key("x"));
    }
    let n = nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": []}})),
        )
        .await
        .unwrap();
    assert_eq!(n.status.unwrap().conditions.unwrap().len(), 2);
}

#[tokio::test]
async fn json_patch_test_failure_is_422_and_update_conflict_is_409() {
    let api = ApiServer::start();
    api.seed_node(ApiServer::kubelet_node(NODE));
    let nodes: Api<Node> = Api::all(client(&api).await);
    let n = nodes.get(NODE).await.unwrap();
    let stale = n.metadata.resource_version.clone().unwrap();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": stale},
        {"op": "add", "path": "/spec/taints", "value": [{"key": "k", "effect": "NoSchedule"}]},
    ]))
    .unwrap();
    let n2 = nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Json::<()>(patch.clone()),
        )
        .await
        .unwrap();
    assert!(rv(&n2) > rv(&n));
    assert_eq!(n2.spec.unwrap().taints.unwrap()[0].key, "k");
    // The same patch again: its test now fails.
    match nodes
        .patch(NODE, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .unwrap_err()
    {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 422);
            assert_eq!(s.reason, "Invalid");
            assert_eq!(
                s.message,
                "the server rejected our request due to an error in our request"
            );
        }
        other => panic!("{other}"),
    }
    // Update with the stale resourceVersion: 409.
    assert_eq!(
        code(
            nodes
                .replace(NODE, &PostParams::default(), &n)
                .await
                .unwrap_err()
        ),
        409
    );
    // Merge patch with a stale resourceVersion precondition: 409.
    let e = nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": stale, "labels": {"z": "1"}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(code(e), 409);
    // Strategic merge of a condition by type.
    let n = nodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "Ready", "reason": "Other"}]}}),
            ),
        )
        .await
        .unwrap();
    let c = &n.status.unwrap().conditions.unwrap()[0];
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("True", Some("Other"))
    );
    assert_eq!(api.count("patch"), 4);
    assert_eq!(api.count("update"), 1);
}

#[tokio::test]
async fn events_are_created_with_generated_names() {
    use k8s_openapi::api::events::v1::Event;
    let api = ApiServer::start();
    let events: Api<Event> = Api::namespaced(client(&api).await, "default");
    let mut ev: Event = serde_json::from_value(json!({
        "metadata": {"generateName": "n1."},
        "eventTime": "2026-11-29T16:00:00.000000Z",
        "reportingController": "fabricgate.io/agent",
        "reportingInstance": "fabricgate-n1",
        "action": "Invalidated",
        "reason": "FabricNotReady",
        "type": "Warning",
        "regarding": {"kind": "Node", "name": "n1"},
    }))
    .unwrap();
    let created = events.create(&PostParams::default(), &ev).await.unwrap();
    assert!(created.metadata.name.unwrap().starts_with("n1."));
    ev.action = None;
    assert_eq!(
        code(
            events
                .create(&PostParams::default(), &ev)
                .await
                .unwrap_err()
        ),
        422
    );
    assert_eq!(api.events().len(), 1);
    assert_eq!(api.count("create"), 2);
}

#[tokio::test]
async fn faults_are_injected() {
    let api = ApiServer::start();
    api.seed_node(ApiServer::kubelet_node(NODE));
    let nodes: Api<Node> = Api::all(client(&api).await);
    api.set_fault_for(
        Fault::TooManyRequests {
            retry_after_secs: 7,
        },
        1,
    );
    match nodes.get(NODE).await.unwrap_err() {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 429);
            assert_eq!(s.details.unwrap().retry_after_seconds, 7);
        }
        other => panic!("{other}"),
    }
    let header = api.requests().last().unwrap().status;
    assert_eq!(header, 429);
    api.set_fault_for(Fault::InternalError, 1);
    assert_eq!(code(nodes.get(NODE).await.unwrap_err()), 500);
    api.set_fault_for(Fault::DropConnection, 1);
    assert!(!matches!(
        nodes.get(NODE).await.unwrap_err(),
        kube::Error::Api(_)
    ));
    // The budget is spent: back to normal.
    nodes.get(NODE).await.unwrap();

    // Another writer between a read and a write.
    api.after_next_get(NODE, |n| n["metadata"]["labels"]["late"] = json!("1"));
    let before = nodes.get(NODE).await.unwrap();
    let after = nodes.get(NODE).await.unwrap();
    assert!(rv(&after) > rv(&before));
    assert_eq!(after.metadata.labels.unwrap()["late"], "1");
}
