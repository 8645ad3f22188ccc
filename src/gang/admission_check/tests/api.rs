//! A pass (`reconcile::pass`) against a scripted API server (`tower-test`): each test says,
//! request by request, the method, URL and body the pass must send and what the server
//! answers, and that nothing else is sent.

use super::*;
use crate::gang::admission_check::metrics::CheckMetrics;
use crate::gang::admission_check::reconcile::pass;
use crate::gang::admission_check::state::State;
use crate::node::tests::scripted::{self, Seen, Server, status};
use http::Method;

const WORKLOAD_STATUS: &str = "/apis/kueue.x-k8s.io/v1beta2/namespaces/team/workloads/train/status";
const CHECKS: &str = "/apis/fabricgate.io/v1alpha1/namespaces/fabricgate/fabricchecks";
const RESULTS: &str = "/apis/fabricgate.io/v1alpha1/namespaces/fabricgate/fabriccheckresults";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/team/events";
const FIELD_MANAGER: &str = "fabricgate-admission-check";

/// One pass over `stores` while `script` plays the server: what the pass returned, after
/// the server saw nothing beyond its script.
async fn pass_against<F>(
    stores: &Stores,
    state: &mut State,
    script: impl FnOnce(Server) -> F,
) -> Option<tokio::time::Instant>
where
    F: Future<Output = Server> + Send + 'static,
{
    let (client, server) = scripted::client();
    let api = tokio::spawn(script(server));
    let metrics = CheckMetrics::new();
    let due = tokio::time::timeout(
        SCRIPT_TIME,
        pass(&client, stores, &settings(), &metrics, state),
    )
    .await
    .expect("the pass waits for an answer its script does not give");
    // The script still waiting for a request fails once the client is gone.
    drop(client);
    let server = tokio::time::timeout(SCRIPT_TIME, api)
        .await
        .expect("the script ends")
        .expect("the scripted server");
    server.expect_no_more().await;
    due
}

/// Longest a pass or its script may take (both take milliseconds).
const SCRIPT_TIME: Duration = Duration::from_secs(10);

fn object(o: DynamicObject) -> Value {
    serde_json::to_value(o).expect("JSON")
}

/// A server-side apply of our field manager, forced, on `path`.
fn assert_apply(seen: &Seen, path: &str) {
    assert_eq!(seen.method, Method::PATCH);
    assert_eq!(seen.path, path);
    assert_eq!(seen.content_type, "application/apply-patch+yaml");
    assert_eq!(
        seen.query.get("fieldManager").map(String::as_str),
        Some(FIELD_MANAGER)
    );
    assert_eq!(seen.query.get("force").map(String::as_str), Some("true"));
}

/// Our entry's state as the pass applies it on the Workload's status, at version `rv`.
fn assert_state_written(seen: &Seen, rv: &str, state: &str) -> Value {
    assert_apply(seen, WORKLOAD_STATUS);
    assert_eq!(
        seen.body["metadata"],
        json!({ "name": WL, "namespace": NS, "resourceVersion": rv })
    );
    let entries = seen.body["status"]["admissionChecks"]
        .as_array()
        .expect("our entries");
    assert_eq!(entries.len(), 1, "{}", seen.body);
    assert_eq!(entries[0]["name"], OURS);
    assert_eq!(entries[0]["state"], state);
    entries[0].clone()
}

/// The check's deletion, guarded by its uid, then one deletecollection of its answers.
async fn expect_check_deleted(server: &mut Server) {
    let seen = server
        .answer(200, json!({ "kind": "Status", "status": "Success" }))
        .await;
    assert_eq!(seen.method, Method::DELETE);
    assert_eq!(seen.path, format!("{CHECKS}/{}", check_name()));
    assert_eq!(seen.body["preconditions"]["uid"], CHECK_UID);
    let seen = server
        .answer(
            200,
            json!({ "kind": "List", "apiVersion": "v1", "items": [] }),
        )
        .await;
    assert_eq!(seen.method, Method::DELETE);
    assert_eq!(seen.path, RESULTS);
    assert_eq!(
        seen.query.get("labelSelector").map(String::as_str),
        Some(format!("fabricgate.io/fabriccheck-uid={CHECK_UID}").as_str())
    );
}

/// The gang of `n` validated Nodes pending, with our AdmissionCheck `Active`.
fn gang(n: usize) -> Cache {
    Cache {
        workloads: vec![workload("7", &(0..n).map(host).collect::<Vec<_>>(), None)],
        nodes: (0..n).map(node).collect(),
        admission_checks: vec![admission_check(true)],
        ..Cache::default()
    }
}

#[tokio::test]
async fn an_admission_check_not_active_is_set_active_for_its_generation() {
    let stores = Cache {
        admission_checks: vec![admission_check(false)],
        ..Cache::default()
    }
    .stores();
    let due = pass_against(&stores, &mut State::default(), |mut server| async move {
        let seen = server.answer(200, object(admission_check(true))).await;
        assert_apply(
            &seen,
            "/apis/kueue.x-k8s.io/v1beta2/admissionchecks/fabric/status",
        );
        let c = &seen.body["status"]["conditions"][0];
        assert_eq!(
            (&c["type"], &c["status"], &c["observedGeneration"]),
            (&json!("Active"), &json!("True"), &json!(1))
        );
        server
    })
    .await;
    assert_eq!(due, None);
}

#[tokio::test]
async fn a_gang_of_validated_nodes_gets_its_fabric_check_and_no_state_yet() {
    let stores = gang(2).stores();
    let mut state = State::default();
    let before = tokio::time::Instant::now();
    let due = pass_against(&stores, &mut state, |mut server| async move {
        let created = check(&ring(2, "x"), RESERVED);
        let seen = server.answer(201, object(created)).await;
        assert_eq!(seen.method, Method::POST);
        assert_eq!(seen.path, CHECKS);
        assert_eq!(
            seen.query.get("fieldManager").map(String::as_str),
            Some(FIELD_MANAGER)
        );
        let meta = &seen.body["metadata"];
        assert_eq!(meta["name"], check_name().as_str());
        // Not yet labelled for its members' watches: no agent sees it before its answers.
        assert_eq!(
            meta["labels"],
            json!({ "app.kubernetes.io/name": "fabricgate", "fabricgate.io/check": "gang" })
        );
        assert_eq!(meta["annotations"][RESERVATION_ANNOTATION], RESERVED);
        let spec: CheckSpec = serde_json::from_value(seen.body["spec"].clone()).expect("a spec");
        assert_eq!(ring(2, &spec.deadline), spec);
        // Each member's empty answer, in any order.
        let mut answers = Vec::new();
        for _ in 0..2 {
            let seen = server.answer(201, json!({})).await;
            assert_eq!((seen.method, seen.path.as_str()), (Method::POST, RESULTS));
            assert_eq!(
                seen.query.get("fieldManager").map(String::as_str),
                Some(FIELD_MANAGER)
            );
            answers.push(seen.body);
        }
        answers.sort_by_key(|a| a["spec"]["node"].as_str().map(str::to_owned));
        for (i, a) in answers.iter().enumerate() {
            assert_eq!(a["metadata"]["name"], format!("{CHECK_UID}.gpu-{i}"));
            assert_eq!(
                a["metadata"]["labels"]["fabricgate.io/fabriccheck-uid"],
                CHECK_UID
            );
            assert_eq!(a["metadata"]["ownerReferences"][0]["uid"], CHECK_UID);
            assert_eq!(
                a["spec"],
                json!({ "check": check_name(), "checkUID": CHECK_UID,
                        "node": format!("gpu-{i}"), "peer": format!("gpu-{}", (i + 1) % 2) }),
                "empty: only the member's agent fills it"
            );
        }
        // Then labelled: the members are asked.
        let labelled = check(&ring(2, "x"), RESERVED);
        let seen = server.answer(200, object(labelled)).await;
        assert_eq!(seen.method, Method::PATCH);
        assert_eq!(seen.path, format!("{CHECKS}/{}", check_name()));
        assert_eq!(seen.content_type, "application/merge-patch+json");
        assert_eq!(
            seen.body,
            json!({ "metadata": { "labels": {
                fabriccheck::member_label("gpu-0"): "true",
                fabriccheck::member_label("gpu-1"): "true",
            } } })
        );
        server
    })
    .await;
    // Judged again at the deadline and its grace at the latest.
    let due = due.expect("a check in flight");
    assert!(due >= before + Duration::from_secs(22), "{due:?}");
    assert!(stores.created.lock().expect("lock").contains(CHECK_UID));
    assert!(state.decided.is_empty());
}

/// An answer the API refuses (the ResourceQuota full): the check is deleted again before any
/// member is asked (never labelled), and the pass retries.
#[tokio::test]
async fn a_check_whose_answers_cannot_be_created_is_deleted_unasked() {
    let stores = gang(2).stores();
    let mut state = State::default();
    let before = tokio::time::Instant::now();
    let due = pass_against(&stores, &mut state, |mut server| async move {
        let created = check(&ring(2, "x"), RESERVED);
        let seen = server.answer(201, object(created)).await;
        assert_eq!((seen.method, seen.path.as_str()), (Method::POST, CHECKS));
        let mut quota = status(403, "Forbidden");
        quota["message"] = json!("exceeded quota: fabricgate-fabriccheck-results");
        for _ in 0..2 {
            let seen = server.answer(403, quota.clone()).await;
            assert_eq!((seen.method, seen.path.as_str()), (Method::POST, RESULTS));
        }
        expect_check_deleted(&mut server).await;
        server
    })
    .await;
    // Tried again after the poll interval, not at the check's deadline.
    let due = due.expect("a retry");
    assert!(due < before + Duration::from_secs(20), "{due:?}");
    assert!(!stores.created.lock().expect("lock").contains(CHECK_UID));
}

#[tokio::test]
async fn a_passed_ring_is_written_ready_then_its_check_and_answers_deleted() {
    let spec = ring(2, "2026-12-02T03:00:30Z");
    let stores = Cache {
        checks: vec![check(&spec, RESERVED)],
        results: vec![answer(&spec, 0, true), answer(&spec, 1, true)],
        ..gang(2)
    }
    .stores();
    let mut state = State::default();
    let due = pass_against(&stores, &mut state, |mut server| async move {
        let seen = server.answer(200, object(workload("8", &[], None))).await;
        let entry = assert_state_written(&seen, "7", "Ready");
        assert!(
            entry["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("gang RDMA pre-flight passed: 2 pairs")),
            "{entry}"
        );
        assert!(entry.get("requeueAfterSeconds").is_none(), "{entry}");
        // No Event for Ready.
        expect_check_deleted(&mut server).await;
        server
    })
    .await;
    assert_eq!(due, None);
    assert_eq!(state.decided.get(WL_UID).map(String::as_str), Some("7"));
    assert!(state.deleted.contains(CHECK_UID));
    // The next pass, before the write's echo: nothing is written or deleted again.
    let due = pass_against(&stores, &mut state, |server| async move { server }).await;
    assert_eq!(due, None);
}

#[tokio::test]
async fn a_retry_is_written_with_its_backoff_and_recorded_as_an_event() {
    let stores = Cache {
        nodes: vec![node(0), unvalidated(1)],
        ..gang(2)
    }
    .stores();
    pass_against(&stores, &mut State::default(), |mut server| async move {
        let seen = server.answer(200, object(workload("8", &[], None))).await;
        let entry = assert_state_written(&seen, "7", "Retry");
        assert_eq!(entry["requeueAfterSeconds"], 5);
        let event = server
            .answer(
                201,
                json!({ "metadata": { "name": "train-1", "namespace": NS },
                                 "eventTime": "2026-12-02T03:00:10.000000Z" }),
            )
            .await;
        assert_eq!(event.method, Method::POST);
        assert_eq!(event.path, EVENTS);
        assert_eq!(event.body["reason"], "FabricPreflightRetry");
        assert_eq!(event.body["type"], "Warning");
        assert_eq!(event.body["reportingController"], CONTROLLER_NAME);
        assert_eq!(
            event.body["regarding"],
            json!({ "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                    "name": WL, "namespace": NS, "uid": WL_UID })
        );
        assert!(
            event.body["note"]
                .as_str()
                .is_some_and(|n| n.starts_with("1 of 2 assigned nodes are not validated now")),
            "{}",
            event.body
        );
        server
    })
    .await;
}

#[tokio::test]
async fn a_conflict_on_the_state_leaves_the_check_to_be_judged_again_soon() {
    let spec = ring(2, "2026-12-02T03:00:30Z");
    let stores = Cache {
        checks: vec![check(&spec, RESERVED)],
        results: vec![answer(&spec, 0, true), answer(&spec, 1, true)],
        ..gang(2)
    }
    .stores();
    let mut state = State::default();
    let before = tokio::time::Instant::now();
    let due = pass_against(&stores, &mut state, |mut server| async move {
        let seen = server.answer(409, status(409, "Conflict")).await;
        assert_state_written(&seen, "7", "Ready");
        // Neither an Event nor the check's deletion follows.
        server
    })
    .await;
    // Again after the poll interval.
    let due = due.expect("a retry");
    assert!(due >= before + Duration::from_secs(1) && due < before + Duration::from_secs(5));
    assert!(state.decided.is_empty() && state.deleted.is_empty());
}

#[tokio::test]
async fn past_the_deadline_missing_answers_are_listed_in_the_api_once() {
    // Due long ago: the grace is over too.
    let spec = ring(2, "2020-01-01T00:00:00Z");
    let stores = Cache {
        checks: vec![check(&spec, RESERVED)],
        ..gang(2)
    }
    .stores();
    let listed = json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheckResultList",
        "metadata": { "resourceVersion": "9" },
        "items": [answer(&spec, 0, true), answer(&spec, 1, true)],
    });
    pass_against(&stores, &mut State::default(), |mut server| async move {
        let seen = server.answer(200, listed).await;
        assert_eq!(seen.method, Method::GET);
        assert_eq!(seen.path, RESULTS);
        assert_eq!(
            seen.query.get("labelSelector").map(String::as_str),
            Some(format!("fabricgate.io/fabriccheck-uid={CHECK_UID}").as_str())
        );
        let seen = server.answer(200, object(workload("8", &[], None))).await;
        assert_state_written(&seen, "7", "Ready");
        expect_check_deleted(&mut server).await;
        server
    })
    .await;
}

#[tokio::test]
async fn a_stale_check_is_deleted_before_the_new_one_is_created() {
    let stores = Cache {
        checks: vec![check(
            &ring(2, "2026-12-02T02:00:20Z"),
            "2026-12-02T02:00:00Z",
        )],
        ..gang(2)
    }
    .stores();
    pass_against(&stores, &mut State::default(), |mut server| async move {
        expect_check_deleted(&mut server).await;
        let seen = server.answer(409, status(409, "AlreadyExists")).await;
        assert_eq!((seen.method, seen.path.as_str()), (Method::POST, CHECKS));
        server
    })
    .await;
}
