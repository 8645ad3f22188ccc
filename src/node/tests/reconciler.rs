//! The Reconciler against a scripted API server (`tower-test`): each test says, request by
//! request, the method, URL and body the Reconciler must send and what the server answers.
//! The real kube-apiserver runs the same paths in tests/cluster/agent.rs; these pin down the
//! exact requests, including the failure paths a real server rarely takes on cue.

use super::scripted::{self, Seen, Server, status};
use super::{KEY, verdict};
use crate::config::NodeSettings;
use crate::error::Error;
use crate::node::{Outcome, Reconciler};
use crate::observe::metrics::Metrics;
use crate::policy::Verdict;
use http::Method;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};
use std::sync::Arc;

pub(super) const NAME: &str = "n";
pub(super) const NODE_PATH: &str = "/api/v1/nodes/n";
pub(super) const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

fn reconciler() -> (Reconciler, Server) {
    reconciler_with(NodeSettings::default())
}

/// A Reconciler of the Node `n` with `settings`, and the server that answers it.
pub(super) fn reconciler_with(settings: NodeSettings) -> (Reconciler, Server) {
    let (client, server) = scripted::client();
    let rec = Reconciler::new(
        NAME.to_owned(),
        settings,
        Some(client),
        false,
        Arc::new(Metrics::new()),
    );
    (rec, server)
}

/// `rec.reconcile(verdict)` while `api` plays the server's side of it: the outcome, and the
/// server back for what follows.
pub(super) async fn reconcile_against(
    rec: &mut Reconciler,
    verdict: &Verdict,
    api: tokio::task::JoinHandle<Server>,
) -> (Outcome, Server) {
    let outcome = rec.reconcile(verdict).await.expect("reconcile");
    (outcome, api.await.expect("the scripted server"))
}

/// The Reconciler is done: the server saw no request beyond its script.
pub(super) async fn finish(rec: Reconciler, server: Server) {
    drop(rec);
    server.expect_no_more().await;
}

/// The Node as the server shows it at resourceVersion `rv`.
pub(super) fn node(rv: &str, labels: Value, taints: Value, conditions: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": NAME, "uid": "uid-n", "resourceVersion": rv, "labels": labels },
        "spec": { "taints": taints },
        "status": { "conditions": conditions },
    })
}

pub(super) fn our_taint() -> Value {
    json!({ "key": KEY, "effect": "NoSchedule" })
}

/// The conditions `verdict(ready)` writes, as the server returns them.
pub(super) fn conditions(ready: bool) -> Value {
    let v = verdict(ready);
    Value::Array(
        v.conditions
            .iter()
            .map(|c| {
                json!({
                    "type": c.type_, "status": c.status, "reason": c.reason,
                    "message": c.message, "lastTransitionTime": "2024-01-01T00:00:00Z",
                })
            })
            .collect(),
    )
}

pub(super) fn labels(ready: bool) -> Value {
    json!({ "fabricgate.io/ready": ready.to_string() })
}

pub(super) fn assert_taint_patch(seen: &Seen, rv: &str, taints: Value) {
    assert_eq!(seen.method, Method::PATCH);
    assert_eq!(seen.path, NODE_PATH);
    assert_eq!(seen.content_type, "application/json-patch+json");
    assert_eq!(
        seen.query.get("fieldManager").map(String::as_str),
        Some("fabricgate")
    );
    assert_eq!(
        seen.body,
        json!([
            { "op": "test", "path": "/metadata/resourceVersion", "value": rv },
            { "op": "add", "path": "/spec/taints", "value": taints },
        ])
    );
}

pub(super) fn assert_apply(seen: &Seen, path: &str) {
    assert_eq!(seen.method, Method::PATCH);
    assert_eq!(seen.path, path);
    assert_eq!(seen.content_type, "application/apply-patch+yaml");
    assert_eq!(
        seen.query.get("fieldManager").map(String::as_str),
        Some("fabricgate")
    );
    assert_eq!(seen.query.get("force").map(String::as_str), Some("true"));
}

pub(super) fn assert_get(seen: &Seen) {
    assert_eq!(seen.method, Method::GET);
    assert_eq!(seen.path, NODE_PATH);
}

#[tokio::test]
async fn a_first_publish_reads_the_node_then_taints_first_applies_and_records_an_event() {
    let (mut rec, mut server) = reconciler();
    let bad = verdict(false);
    let api = tokio::spawn(async move {
        // Registered without our marks; the watch has shown nothing yet: one read.
        let fresh = node(
            "1",
            json!({}),
            json!([{ "key": "other", "effect": "NoSchedule" }]),
            json!([]),
        );
        assert_get(&server.answer(200, fresh).await);
        // Going bad: the taint first, guarded by the version it was planned from, after the
        // other owner's taint.
        let tainted_taints = json!([{ "key": "other", "effect": "NoSchedule" }, our_taint()]);
        let seen = server
            .answer(200, node("2", json!({}), tainted_taints.clone(), json!([])))
            .await;
        assert_taint_patch(&seen, "1", tainted_taints.clone());
        // Our labels by server-side apply on the Node.
        let seen = server
            .answer(
                200,
                node("3", labels(false), tainted_taints.clone(), json!([])),
            )
            .await;
        assert_apply(&seen, NODE_PATH);
        assert_eq!(
            seen.body,
            json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": NAME, "labels": { "fabricgate.io/ready": "false" } },
            })
        );
        // Our conditions by server-side apply on the status subresource.
        let seen = server
            .answer(
                200,
                node("4", labels(false), tainted_taints, conditions(false)),
            )
            .await;
        assert_apply(&seen, "/api/v1/nodes/n/status");
        let applied = seen.body["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let types: Vec<&str> = applied.iter().filter_map(|c| c["type"].as_str()).collect();
        assert_eq!(types, ["FabricReady", "RDMAReady"]);
        assert_eq!(applied[0]["status"], "False");
        assert_eq!(applied[0]["reason"], "PortDown");
        assert_eq!(seen.body["metadata"], json!({ "name": NAME }));
        // One Event for the transition, about this Node.
        let seen = server.answer(201, json!({})).await;
        assert_eq!(seen.method, Method::POST);
        assert_eq!(seen.path, EVENTS_PATH);
        assert_eq!(
            seen.query.get("fieldManager").map(String::as_str),
            Some("fabricgate")
        );
        let e = &seen.body;
        assert_eq!(e["metadata"]["generateName"], "n-");
        assert_eq!(e["reason"], "FabricNotReady");
        assert_eq!(e["action"], "Invalidated");
        assert_eq!(e["type"], "Warning");
        assert_eq!(e["note"], "PortDown: mlx5_0 port 1 down");
        assert_eq!(e["reportingController"], "fabricgate.io/agent");
        assert_eq!(e["reportingInstance"], "fabricgate-n");
        assert_eq!(
            e["regarding"],
            json!({ "apiVersion": "v1", "kind": "Node", "name": NAME, "uid": "uid-n" })
        );
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &bad, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 5,
            writes: 4
        }
    );

    // The same verdict again: confirmed already, nothing is sent (not even a read).
    let again = rec.reconcile(&bad).await.expect("reconcile");
    assert_eq!(again, Outcome::default());
    finish(rec, server).await;
}

#[tokio::test]
async fn a_taint_change_alone_is_one_json_patch_that_keeps_other_owners_taints() {
    // Someone put our taint back by hand on a validated Node: only the taint is written.
    let (mut rec, mut server) = reconciler();
    let good = verdict(true);
    let api = tokio::spawn(async move {
        let shown = node(
            "7",
            labels(true),
            json!([our_taint(), { "key": "other", "effect": "NoExecute" }]),
            conditions(true),
        );
        assert_get(&server.answer(200, shown).await);
        let kept = json!([{ "key": "other", "effect": "NoExecute" }]);
        let seen = server
            .answer(200, node("8", labels(true), kept.clone(), conditions(true)))
            .await;
        assert_taint_patch(&seen, "7", kept);
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &good, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 2,
            writes: 1
        }
    );
    finish(rec, server).await;
}

#[tokio::test]
async fn a_conflicting_taint_write_rereads_and_retries_on_the_new_version() {
    let (mut rec, mut server) = reconciler();
    let bad = verdict(false);
    let api = tokio::spawn(async move {
        let untainted = |rv: &str| node(rv, labels(false), json!([]), conditions(false));
        assert_get(&server.answer(200, untainted("10")).await);
        // A failed `test` (another writer got in): 422, then the same for a 409.
        let seen = server.answer(422, status(422, "Invalid")).await;
        assert_taint_patch(&seen, "10", json!([our_taint()]));
        assert_get(&server.answer(200, untainted("11")).await);
        let seen = server.answer(409, status(409, "Conflict")).await;
        assert_taint_patch(&seen, "11", json!([our_taint()]));
        assert_get(&server.answer(200, untainted("12")).await);
        let seen = server
            .answer(
                200,
                node("13", labels(false), json!([our_taint()]), conditions(false)),
            )
            .await;
        assert_taint_patch(&seen, "12", json!([our_taint()]));
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &bad, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 6,
            writes: 1
        }
    );
    finish(rec, server).await;
}

#[tokio::test]
async fn five_conflicts_in_a_row_give_up_until_the_next_reconcile() {
    let (mut rec, mut server) = reconciler();
    let bad = verdict(false);
    let api = tokio::spawn(async move {
        let untainted =
            |rv: u32| node(&rv.to_string(), labels(false), json!([]), conditions(false));
        assert_get(&server.answer(200, untainted(20)).await);
        for attempt in 0..5 {
            let seen = server.answer(409, status(409, "Conflict")).await;
            assert_taint_patch(&seen, &(20 + attempt).to_string(), json!([our_taint()]));
            assert_get(&server.answer(200, untainted(21 + attempt)).await);
        }
        server
    });
    let err = rec.reconcile(&bad).await.expect_err("gives up");
    let mut server = api.await.expect("the scripted server");
    assert!(
        matches!(err, Error::Conflict { ref node, attempts: 5 } if node == NAME),
        "{err:?}"
    );
    // Nothing was confirmed: the next reconcile (the caller backs off first) starts over.
    let api = tokio::spawn(async move {
        let tainted = node("30", labels(false), json!([our_taint()]), conditions(false));
        assert_get(&server.answer(200, tainted).await);
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &bad, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 1,
            writes: 0
        }
    );
    finish(rec, server).await;
}

#[tokio::test]
async fn a_server_error_fails_the_reconcile_and_the_next_one_reads_and_writes_again() {
    let (mut rec, mut server) = reconciler();
    let good = verdict(true);
    let stale_labels = || node("40", labels(false), json!([]), conditions(true));
    let api = tokio::spawn(async move {
        assert_get(&server.answer(200, stale_labels()).await);
        let seen = server.answer(500, status(500, "InternalError")).await;
        assert_apply(&seen, NODE_PATH);
        server
    });
    let err = rec.reconcile(&good).await.expect_err("the apply failed");
    let mut server = api.await.expect("the scripted server");
    match &err {
        Error::Kube {
            action,
            node,
            source,
        } => {
            assert_eq!(*action, "apply labels on");
            assert_eq!(node, NAME);
            assert!(matches!(source.as_ref(), kube::Error::Api(s) if s.code == 500));
        }
        other => panic!("{other:?}"),
    }
    let api = tokio::spawn(async move {
        assert_get(&server.answer(200, stale_labels()).await);
        let seen = server
            .answer(200, node("41", labels(true), json!([]), conditions(true)))
            .await;
        assert_apply(&seen, NODE_PATH);
        assert_eq!(seen.body["metadata"]["labels"], labels(true));
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &good, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 2,
            writes: 1
        }
    );
    finish(rec, server).await;
}

#[tokio::test]
async fn with_the_watch_live_the_reconciler_plans_on_what_it_showed_and_ignores_its_echoes() {
    let (mut rec, mut server) = reconciler();
    let shown: Node = serde_json::from_value(node(
        "50",
        labels(true),
        json!([our_taint()]),
        conditions(true),
    ))
    .expect("node");
    assert!(rec.observe(shown), "a foreign version needs a reconcile");
    let good = verdict(true);
    let api = tokio::spawn(async move {
        // No read: the watch showed the Node. The hand-added taint goes.
        let seen = server
            .answer(200, node("51", labels(true), json!([]), conditions(true)))
            .await;
        assert_taint_patch(&seen, "50", json!([]));
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &good, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 1,
            writes: 1
        }
    );
    // The watch echoes our own write: nothing to do.
    let echo: Node = serde_json::from_value(node("51", labels(true), json!([]), conditions(true)))
        .expect("node");
    assert!(!rec.observe(echo));
    assert_eq!(
        rec.reconcile(&good).await.expect("reconcile"),
        Outcome::default()
    );
    // A version from before our write, delivered late (the watch's initial list racing the
    // first reconcile), is no news: planning on it would redo the write and its Event.
    let late: Node = serde_json::from_value(node(
        "50",
        labels(true),
        json!([our_taint()]),
        conditions(true),
    ))
    .expect("node");
    assert!(!rec.observe(late));
    assert_eq!(
        rec.reconcile(&good).await.expect("reconcile"),
        Outcome::default()
    );
    finish(rec, server).await;
}
