//! The breaker's API work (`node::breaker::PoolBreaker`) against a scripted API server: which
//! objects it reads to count the pool (the guard's Lease, else one list of the pool), the
//! ledger's compare-and-swap (method, URL and body), and what each API failure leaves it to
//! decide. The decisions themselves are `policy::breaker`'s, tested there; the real
//! kube-apiserver runs the same paths in tests/cluster/breaker.rs.

use super::reconciler::{
    EVENTS_PATH, NAME, NODE_PATH, assert_apply, assert_get, conditions, finish, labels, node,
    reconcile_against, reconciler_with,
};
use super::scripted::{self, Seen, Server, status};
use super::verdict;
use crate::config::{BreakerSettings, NodeSettings};
use crate::node::Outcome;
use crate::node::breaker::PoolBreaker;
use crate::observe::metrics::Metrics;
use crate::policy::breaker::{LEDGER, TaintDecision};
use http::Method;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::task::JoinHandle;

const SELECTOR: &str = "pool=a";
/// The agent's namespace, where the ledger and the guard's Lease live.
const NS: &str = "fabricgate";
const LEASE_PATH: &str =
    "/apis/coordination.k8s.io/v1/namespaces/fabricgate/leases/fabricgate-guard";
const LEDGER_PATH: &str = "/api/v1/namespaces/fabricgate/configmaps/fabricgate-breaker";

/// The pool `pool=a` under the shipped breaker, capped at `max_new` new taints a window.
fn settings(max_new: u32) -> NodeSettings {
    let defaults = NodeSettings::default();
    NodeSettings {
        pool_selector: SELECTOR.to_owned(),
        breaker: BreakerSettings {
            max_new_per_window: max_new,
            ..defaults.breaker.clone()
        },
        ..defaults
    }
}

/// A breaker of the Node `n` with its ledger in `NS`, the Nodes' API, and the server.
fn pool_breaker(settings: NodeSettings) -> (PoolBreaker, Api<Node>, Server) {
    let (client, server) = scripted::client();
    let mut breaker = PoolBreaker::new(NAME.to_owned(), settings, Arc::new(Metrics::new()));
    breaker.use_ledger(client.clone(), NS);
    (breaker, Api::all(client), server)
}

/// This agent's Node, in the pool, with `annotations`.
fn own_node(annotations: Value) -> Node {
    serde_json::from_value(json!({
        "metadata": { "name": NAME, "labels": { "pool": "a" }, "annotations": annotations },
    }))
    .expect("node")
}

/// `breaker.decide(..)` while `api` plays the server's side: the decision, what it cost, and
/// the server back.
async fn decide_against(
    breaker: &mut PoolBreaker,
    nodes: &Api<Node>,
    node: &Node,
    api: JoinHandle<Server>,
) -> (TaintDecision, Outcome, Server) {
    let mut outcome = Outcome::default();
    let decision = breaker.decide(nodes, node, &mut outcome).await;
    (decision, outcome, api.await.expect("the scripted server"))
}

/// The breaker is done: nothing was sent beyond the script.
async fn done(breaker: PoolBreaker, nodes: Api<Node>, server: Server) {
    drop((breaker, nodes));
    server.expect_no_more().await;
}

/// The guard's Lease, held and renewed just now, publishing `summary` of the pool.
fn guard_lease(summary: &Value) -> Value {
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("fabricgate-guard".to_owned()),
            namespace: Some(NS.to_owned()),
            annotations: Some([("fabricgate.io/pool".to_owned(), summary.to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("guard-0".to_owned()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..LeaseSpec::default()
        }),
    };
    serde_json::to_value(lease).expect("lease")
}

/// The summary of the 10-node pool `pool=a` with `tainted` (names) tainted long ago.
fn summary(tainted: &[&str]) -> Value {
    json!({ "selector": SELECTOR, "nodes": 10, "windowSeconds": 600, "taintedOld": tainted })
}

/// The ledger at resourceVersion `rv` with `data`.
fn ledger(rv: &str, data: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": { "name": LEDGER, "namespace": NS, "resourceVersion": rv },
        "data": data,
    })
}

/// A reservation made just now in this pool, as an agent writes it.
fn fresh_entry() -> String {
    format!("{} {SELECTOR}", Timestamp::now())
}

fn assert_lease_read(seen: &Seen) {
    assert_eq!(seen.method, Method::GET);
    assert_eq!(seen.path, LEASE_PATH);
}

fn assert_ledger_read(seen: &Seen) {
    assert_eq!(seen.method, Method::GET);
    assert_eq!(seen.path, LEDGER_PATH);
}

/// A compare-and-swap of the ledger read at `rv`: every entry of `kept` as it was, and a fresh
/// entry for this Node in this pool.
fn assert_reservation(seen: &Seen, rv: &str, kept: &Value) {
    assert_eq!(seen.method, Method::PUT);
    assert_eq!(seen.path, LEDGER_PATH);
    assert_eq!(
        seen.body["metadata"]["resourceVersion"], rv,
        "{}",
        seen.body
    );
    let data = seen.body["data"].as_object().expect("the ledger's data");
    for (name, entry) in kept.as_object().expect("entries") {
        assert_eq!(data.get(name), Some(entry), "{name} kept as it was");
    }
    assert_eq!(data.len(), kept.as_object().map_or(0, |k| k.len()) + 1);
    let own = data.get(NAME).and_then(Value::as_str).expect("our entry");
    let (at, pool) = own.split_once(' ').expect("time and pool");
    assert_eq!(pool, SELECTOR);
    let at: Timestamp = at.parse().expect("an RFC 3339 time");
    let age = Timestamp::now().duration_since(at).as_secs_f64();
    assert!((0.0..5.0).contains(&age), "made just now: {own}");
}

fn held_because(decision: &TaintDecision, why: &str) {
    match decision {
        TaintDecision::BreakerOpen { message } => assert!(message.contains(why), "{message}"),
        TaintDecision::Taint => panic!("tainted; expected held: {why}"),
    }
}

#[tokio::test]
async fn the_guards_summary_and_one_compare_and_swap_decide_a_new_taint() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(20));
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(200, guard_lease(&summary(&["a-1"]))).await);
        let others = json!({ "a-2": fresh_entry(), "b-9": "2020-01-01T00:00:00Z pool=b" });
        assert_ledger_read(&server.answer(200, ledger("5", others.clone())).await);
        let seen = server.answer(200, ledger("6", json!({}))).await;
        assert_reservation(&seen, "5", &others);
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    assert_eq!(decision, TaintDecision::Taint);
    assert_eq!(
        outcome,
        Outcome {
            requests: 3,
            writes: 1
        }
    );
    done(breaker, nodes, server).await;
}

#[tokio::test]
async fn a_conflicting_reservation_rereads_the_ledger_and_retries_on_the_new_version() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(2));
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(200, guard_lease(&summary(&[]))).await);
        assert_ledger_read(&server.answer(200, ledger("5", json!({}))).await);
        let seen = server.answer(409, status(409, "Conflict")).await;
        assert_reservation(&seen, "5", &json!({}));
        // Another agent of the pool reserved meanwhile: one slot of two is left.
        let others = json!({ "a-2": fresh_entry() });
        assert_ledger_read(&server.answer(200, ledger("6", others.clone())).await);
        let seen = server.answer(200, ledger("7", json!({}))).await;
        assert_reservation(&seen, "6", &others);
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    assert_eq!(decision, TaintDecision::Taint);
    assert_eq!(
        outcome,
        Outcome {
            requests: 5,
            writes: 1
        }
    );
    done(breaker, nodes, server).await;
}

#[tokio::test]
async fn a_conflict_that_leaves_no_slot_holds_the_node_without_writing() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(2));
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(200, guard_lease(&summary(&[]))).await);
        assert_ledger_read(
            &server
                .answer(200, ledger("5", json!({ "a-2": fresh_entry() })))
                .await,
        );
        let seen = server.answer(409, status(409, "Conflict")).await;
        assert_eq!(seen.method, Method::PUT);
        // The winner of that race took the last slot: read, and nothing more.
        let full = json!({ "a-2": fresh_entry(), "a-3": fresh_entry() });
        assert_ledger_read(&server.answer(200, ledger("6", full)).await);
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    held_because(
        &decision,
        "2 nodes of the pool already failed within 10m (node.breaker.max_new_per_window 2)",
    );
    assert_eq!(
        outcome,
        Outcome {
            requests: 4,
            writes: 0
        }
    );
    done(breaker, nodes, server).await;
}

/// The fraction cap is decided under the compare-and-swap too. Two of ten are
/// tainted in the guard's summary, two more reserved a moment ago (not in it yet): this one
/// may be the fifth and swaps, but a third agent got in first; the re-read counts six of ten
/// with this one, and it is held without writing.
#[tokio::test]
async fn the_last_slot_of_the_fraction_goes_to_one_agent_only() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(20));
    let api = tokio::spawn(async move {
        assert_lease_read(
            &server
                .answer(200, guard_lease(&summary(&["a-1", "a-2"])))
                .await,
        );
        let in_flight = json!({ "a-3": fresh_entry(), "a-4": fresh_entry() });
        assert_ledger_read(&server.answer(200, ledger("5", in_flight.clone())).await);
        let seen = server.answer(409, status(409, "Conflict")).await;
        assert_reservation(&seen, "5", &in_flight);
        let taken = json!({ "a-3": fresh_entry(), "a-4": fresh_entry(), "a-5": fresh_entry() });
        assert_ledger_read(&server.answer(200, ledger("6", taken)).await);
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    held_because(
        &decision,
        "would make 6 of 10 nodes of the pool tainted (60%",
    );
    assert_eq!(
        outcome,
        Outcome {
            requests: 4,
            writes: 0
        }
    );
    done(breaker, nodes, server).await;
}

#[tokio::test]
async fn without_a_guard_summary_the_pool_is_listed_once_from_the_watch_cache() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(20));
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(404, status(404, "NotFound")).await);
        let member = |name: &str, tainted: bool| {
            let taints = if tainted {
                json!([{ "key": "fabricgate.io/unvalidated", "effect": "NoSchedule" }])
            } else {
                json!([])
            };
            json!({ "metadata": { "name": name, "labels": { "pool": "a" } },
                    "spec": { "taints": taints } })
        };
        let list = json!({
            "apiVersion": "v1", "kind": "NodeList", "metadata": { "resourceVersion": "9" },
            "items": [member("a-1", true), member("a-2", true), member("a-3", false),
                      member(NAME, false)],
        });
        let seen = server.answer(200, list).await;
        assert_eq!(seen.method, Method::GET);
        assert_eq!(seen.path, "/api/v1/nodes");
        assert_eq!(
            seen.query.get("labelSelector").map(String::as_str),
            Some("pool=a")
        );
        assert_eq!(
            seen.query.get("resourceVersion").map(String::as_str),
            Some("0"),
            "served from the watch cache"
        );
        // 3 of 4 tainted is above one half: held before the ledger is read.
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    held_because(
        &decision,
        "would make 3 of 4 nodes of the pool tainted (75%",
    );
    assert_eq!(
        outcome,
        Outcome {
            requests: 2,
            writes: 0
        }
    );
    done(breaker, nodes, server).await;
}

#[tokio::test]
async fn a_failed_pool_list_decides_from_the_ledgers_reservations_in_flight() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(2));
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(500, status(500, "InternalError")).await);
        let seen = server.answer(500, status(500, "InternalError")).await;
        assert_eq!(seen.path, "/api/v1/nodes");
        let in_flight = json!({ "a-2": fresh_entry(), "a-3": fresh_entry() });
        assert_ledger_read(&server.answer(200, ledger("5", in_flight)).await);
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    held_because(&decision, "2 nodes of the pool already failed");
    assert_eq!(
        outcome,
        Outcome {
            requests: 3,
            writes: 0
        }
    );
    done(breaker, nodes, server).await;
}

#[tokio::test]
async fn a_ledger_error_leaves_the_pools_count_to_decide() {
    let (mut breaker, nodes, mut server) = pool_breaker(settings(20));
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(200, guard_lease(&summary(&["a-1"]))).await);
        assert_ledger_read(&server.answer(403, status(403, "Forbidden")).await);
        server
    });
    let node = own_node(json!({}));
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    assert_eq!(decision, TaintDecision::Taint, "2 of 10 is within the cap");
    assert_eq!(
        outcome,
        Outcome {
            requests: 2,
            writes: 0
        }
    );

    // A refused compare-and-swap (not a conflict) is the same: the pool's count stands.
    let mut server = server;
    let api = tokio::spawn(async move {
        assert_lease_read(&server.answer(200, guard_lease(&summary(&[]))).await);
        assert_ledger_read(&server.answer(200, ledger("5", json!({}))).await);
        let seen = server.answer(403, status(403, "Forbidden")).await;
        assert_reservation(&seen, "5", &json!({}));
        server
    });
    let (decision, outcome, server) = decide_against(&mut breaker, &nodes, &node, api).await;
    assert_eq!(decision, TaintDecision::Taint);
    assert_eq!(
        outcome,
        Outcome {
            requests: 3,
            writes: 0
        }
    );
    done(breaker, nodes, server).await;
}

#[tokio::test]
async fn the_override_annotation_and_a_pool_without_selector_ask_the_api_nothing() {
    let (mut breaker, nodes, server) = pool_breaker(settings(20));
    let overridden = own_node(json!({ "fabricgate.io/breaker-override": "true" }));
    let mut outcome = Outcome::default();
    let decision = breaker.decide(&nodes, &overridden, &mut outcome).await;
    assert_eq!(decision, TaintDecision::Taint);
    assert_eq!(outcome, Outcome::default());
    done(breaker, nodes, server).await;

    let (mut breaker, nodes, server) = pool_breaker(NodeSettings::default());
    let decision = breaker
        .decide(&nodes, &own_node(json!({})), &mut outcome)
        .await;
    assert_eq!(decision, TaintDecision::Taint);
    assert_eq!(outcome, Outcome::default());
    done(breaker, nodes, server).await;
}

#[test]
fn conflict_pauses_grow_with_the_round_and_differ_between_nodes() {
    use crate::node::breaker::conflict_pause_ms;
    for round in 0..20 {
        let ceiling = 20u64 << round.min(5);
        let pause = conflict_pause_ms("a-1", round);
        assert!((5..5 + ceiling).contains(&pause), "round {round}: {pause}");
    }
    let first: Vec<u64> = (0..64)
        .map(|i| conflict_pause_ms(&format!("a-{i}"), 0))
        .collect();
    let distinct: std::collections::BTreeSet<&u64> = first.iter().collect();
    assert!(distinct.len() > 8, "spread, not in step: {first:?}");
}

/// Through the Reconciler: a Node held by the breaker is not tainted, says `BreakerOpen` with
/// what would have tainted it, and its Event says so; the ledger is not touched.
#[tokio::test]
async fn a_node_held_by_the_breaker_is_described_not_tainted() {
    let (rec, mut server) = reconciler_with(settings(20));
    let mut rec = rec.with_breaker_ledger(NS);
    let bad = verdict(false);
    let api = tokio::spawn(async move {
        let shown = node("1", json!({ "pool": "a" }), json!([]), conditions(true));
        assert_get(&server.answer(200, shown).await);
        let five = summary(&["a-1", "a-2", "a-3", "a-4", "a-5"]);
        assert_lease_read(&server.answer(200, guard_lease(&five)).await);
        // No taint patch: labels, then conditions, then the Event.
        let seen = server
            .answer(200, node("2", labels(false), json!([]), conditions(true)))
            .await;
        assert_apply(&seen, NODE_PATH);
        let seen = server
            .answer(200, node("3", labels(false), json!([]), json!([])))
            .await;
        assert_apply(&seen, "/api/v1/nodes/n/status");
        let fabric = &seen.body["status"]["conditions"][0];
        assert_eq!(fabric["type"], "FabricReady");
        assert_eq!(fabric["status"], "False");
        assert_eq!(fabric["reason"], "BreakerOpen");
        let message = fabric["message"].as_str().unwrap_or_default();
        assert!(message.contains("6 of 10"), "{message}");
        assert!(
            message.contains("would taint for PortDown: mlx5_0 port 1 down"),
            "{message}"
        );
        let seen = server.answer(201, json!({})).await;
        assert_eq!(seen.path, EVENTS_PATH);
        assert!(
            seen.body["note"]
                .as_str()
                .is_some_and(|n| n.starts_with("BreakerOpen: ")),
            "{}",
            seen.body
        );
        server
    });
    let (outcome, server) = reconcile_against(&mut rec, &bad, api).await;
    assert_eq!(
        outcome,
        Outcome {
            requests: 5,
            writes: 3
        }
    );
    finish(rec, server).await;
}
