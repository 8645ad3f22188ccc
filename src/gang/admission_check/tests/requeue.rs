//! After admission (`requeue.rs`): which Workloads are watched, what counts as a bad
//! member, the grace, the escalation and the breaker, table-tested without an API server.

use super::super::requeue::RequeueLedger;
use super::super::requeue::{
    self, AdmittedCheck, Cause, Members, PodIndex, TRANSPORT_CONDITION, Verdict,
    WORKLOAD_ANNOTATION,
};
use super::super::state::State;
use super::*;
use crate::gang::settings::GangSettings;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn ours() -> BTreeSet<String> {
    [OURS.to_owned()].into()
}

/// The Workload of `workload` on `hosts`, admitted: our check `Ready`.
fn admitted_wl(hosts: &[String]) -> DynamicObject {
    let mut wl = workload("5", hosts, Some(1));
    wl.data["status"]["admissionChecks"][0]["state"] = json!("Ready");
    wl.metadata.owner_references = Some(vec![owner()]);
    wl
}

fn owner() -> k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
    serde_json::from_value(
        json!({ "apiVersion": "batch/v1", "kind": "Job", "name": "j",
        "uid": "0b0b0b0b-0000-4000-8000-00000000000b", "controller": true }),
    )
    .unwrap()
}

fn pod(name: &str, node: &str, annotated: bool, transport: Option<(&str, &str)>) -> Pod {
    let mut p: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": NS, "uid": format!("uid-{name}") },
        "spec": { "nodeName": node, "containers": [] },
    }))
    .unwrap();
    if annotated {
        p.metadata.annotations = Some([(WORKLOAD_ANNOTATION.to_owned(), WL.to_owned())].into());
    } else {
        p.metadata.owner_references = Some(vec![owner()]);
    }
    if let Some((status, reason)) = transport {
        p.status = serde_json::from_value(json!({ "conditions": [{
            "type": TRANSPORT_CONDITION, "status": status, "reason": reason,
            "message": "0 data-path QPs; 41.0 GB over TCP with 3 peers in 60 s via ib0" }] }))
        .unwrap();
    }
    p
}

fn causes_of(wl: &DynamicObject, nodes: &[Node], pods: Vec<Pod>) -> Vec<Cause> {
    let admitted = requeue::admitted_check(wl, &ours()).expect("admitted");
    let pool: Vec<Arc<Node>> = nodes.iter().cloned().map(Arc::new).collect();
    let by_name = |name: &str| {
        pool.iter()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .cloned()
    };
    let index = PodIndex::new(pods.into_iter().map(Arc::new).collect());
    requeue::causes(&Members {
        wl,
        admitted: &admitted,
        node: &by_name,
        pool: &pool,
        pods: &index,
        label_prefix: "fabricgate.io/",
        taint_key: "fabricgate.io/unvalidated",
    })
}

fn gang(grace_secs: u64) -> GangSettings {
    GangSettings {
        requeue_grace: Duration::from_secs(grace_secs),
        ..GangSettings::default()
    }
}

#[test]
fn only_ready_checks_under_a_live_reservation_are_watched() {
    let wl = admitted_wl(&[host(0), host(1)]);
    let a: AdmittedCheck = requeue::admitted_check(&wl, &ours()).expect("watched");
    assert_eq!(
        (a.entries.as_slice(), a.retry_count),
        (&[OURS.to_owned()][..], 1)
    );
    // Still Pending (the pre-flight's), another controller's check, evicted, finished,
    // deactivated: not watched.
    assert!(requeue::admitted_check(&workload("5", &[host(0)], None), &ours()).is_none());
    assert!(requeue::admitted_check(&wl, &["other".to_owned()].into()).is_none());
    for (path, value) in [
        (
            "/status/conditions/1",
            json!({ "type": "Evicted", "status": "True" }),
        ),
        (
            "/status/conditions/1",
            json!({ "type": "Finished", "status": "True" }),
        ),
        ("/spec", json!({ "active": false })),
    ] {
        let mut v = serde_json::to_value(&wl).unwrap();
        let (parent, key) = path.rsplit_once('/').unwrap();
        let target = if parent.is_empty() {
            &mut v
        } else {
            v.pointer_mut(parent).unwrap()
        };
        match target {
            Value::Array(a) => a.push(value),
            Value::Object(o) => {
                o.insert(key.to_owned(), value);
            }
            _ => unreachable!(),
        }
        let changed: DynamicObject = serde_json::from_value(v).unwrap();
        assert!(
            requeue::admitted_check(&changed, &ours()).is_none(),
            "{path}"
        );
    }
}

#[test]
fn bad_members_are_unvalidated_or_gone_nodes_and_pods_on_sockets() {
    let wl = admitted_wl(&[host(0), host(1), host(2)]);
    assert!(causes_of(&wl, &[node(0), node(1), node(2)], vec![]).is_empty());
    // gpu-1 unvalidated, gpu-2 deleted.
    let c = causes_of(&wl, &[node(0), unvalidated(1)], vec![]);
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(c[0].key, "node/gpu-1");
    assert!(
        c[0].message
            .starts_with("gpu-1: FabricReady=False (PortDown: mlx5_0 port 1 is DOWN)")
    );
    assert_eq!(c[1].message, "gpu-2: the Node is gone");
    // A member pod on sockets (its agent's condition); one on RDMA or without it is fine.
    let pods = vec![
        pod("w-0", &host(0), true, Some(("False", "SocketsFallback"))),
        pod("w-1", &host(1), true, Some(("True", "DataPathQueuePairs"))),
        pod("w-2", &host(2), true, None),
    ];
    let c = causes_of(&wl, &[node(0), node(1), node(2)], pods);
    assert_eq!(c.len(), 1, "{c:?}");
    // An idle queue pair beside bulk TCP to the peers is sockets too.
    let beside_idle = vec![pod(
        "w-1",
        &host(1),
        true,
        Some(("False", "SocketsBesideIdleQueuePairs")),
    )];
    let c2 = causes_of(&wl, &[node(0), node(1), node(2)], beside_idle);
    assert_eq!(c2.len(), 1, "{c2:?}");
    assert!(
        c2[0]
            .message
            .contains("=False (SocketsBesideIdleQueuePairs: "),
        "{}",
        c2[0].message
    );
    assert_eq!(c[0].key, "pod/uid-w-0");
    assert!(
        c[0].message.starts_with(
            "pod team/w-0 on gpu-0: fabricgate.io/TransportReady=False (SocketsFallback: 0 data-path QPs"
        ),
        "{}",
        c[0].message
    );
    // Without a topology assignment the members are the nodes its pods are bound to (pods
    // found by their owner, the Workload's: no TAS, no annotation).
    let no_tas = {
        let mut w = admitted_wl(&[]);
        w.data["status"]["admission"]["podSetAssignments"] =
            json!([{ "name": "main", "count": 1, "flavors": { "cpu": "default" } }]);
        w
    };
    assert!(causes_of(&no_tas, &[unvalidated(3)], vec![]).is_empty());
    let c = causes_of(
        &no_tas,
        &[unvalidated(3)],
        vec![pod("w-0", &host(3), false, None)],
    );
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(c[0].key, "node/gpu-3");
}

#[test]
fn a_member_bad_past_the_grace_requeues_and_a_shorter_flap_does_nothing() {
    let g = gang(60);
    let mut state = State::default();
    let t0 = Instant::now();
    let bad = vec![Cause {
        key: "node/gpu-1".into(),
        message: "gpu-1: FabricReady=False (PortDown: down)".into(),
    }];
    let uid = WL_UID;
    assert_eq!(
        requeue::judge(uid, &[], 0, &mut state, t0, &g),
        Verdict::Healthy
    );
    assert_eq!(
        requeue::judge(uid, &bad, 0, &mut state, t0, &g),
        Verdict::Waiting(Duration::from_secs(60))
    );
    assert_eq!(
        requeue::judge(uid, &bad, 0, &mut state, t0 + Duration::from_secs(45), &g),
        Verdict::Waiting(Duration::from_secs(15))
    );
    // Good again before the grace: forgotten; bad again starts the grace afresh.
    let t1 = t0 + Duration::from_secs(50);
    assert_eq!(
        requeue::judge(uid, &[], 0, &mut state, t1, &g),
        Verdict::Healthy
    );
    assert!(state.bad_since.is_empty());
    assert_eq!(
        requeue::judge(uid, &bad, 0, &mut state, t1 + Duration::from_secs(20), &g),
        Verdict::Waiting(Duration::from_secs(60))
    );
    let Verdict::Requeue(d) =
        requeue::judge(uid, &bad, 0, &mut state, t1 + Duration::from_secs(81), &g)
    else {
        panic!("requeued past the grace");
    };
    assert_eq!(d.state, "Retry");
    assert_eq!(d.requeue_after, Some(5), "the existing back-off");
    assert!(
        d.message.starts_with(
            "admitted gang requeued: 1 member is bad for longer than gang.requeue_grace 1m: \
             gpu-1: FabricReady=False (PortDown: down) (for 61.0 s); attempt 1 of \
             gang.max_attempts 10"
        ),
        "{}",
        d.message
    );
    // gang.max_attempts still ends in Rejected.
    let Verdict::Requeue(d) =
        requeue::judge(uid, &bad, 9, &mut state, t1 + Duration::from_secs(90), &g)
    else {
        panic!("past the grace");
    };
    assert_eq!(d.state, "Rejected", "{}", d.message);
}

#[test]
fn the_breaker_holds_requeues_past_the_window_limit() {
    let g = GangSettings {
        max_requeues_per_window: 10,
        max_requeues_per_namespace: 0,
        requeue_window: Duration::from_secs(600),
        ..GangSettings::default()
    };
    let mut ledger = RequeueLedger::default();
    let t0 = Timestamp::from_second(1_000_000).unwrap();
    let at = |s: i64| t0 + k8s_openapi::jiff::SignedDuration::from_secs(s);
    for i in 0..10 {
        assert!(requeue::breaker(&mut ledger, "ml", at(i), &g).is_ok());
    }
    assert!(requeue::breaker_open(&ledger, at(10), &g));
    let (why, reopen) =
        requeue::breaker(&mut ledger, "ml", at(100), &g).expect_err("the eleventh is held");
    assert!(
        why.starts_with(
            "BreakerOpen: breaker open, not requeueing: 10 admitted gangs already \
             requeued within 10m (gang.max_requeues_per_window 10)"
        ),
        "{why}"
    );
    assert_eq!(reopen, Duration::from_secs(500));
    // The window slides: the oldest requeue leaves it, one more is allowed.
    assert!(requeue::breaker(&mut ledger, "ml", at(600), &g).is_ok());
    assert!(requeue::breaker(&mut ledger, "ml", at(600), &g).is_err());
    assert!(!requeue::breaker_open(&ledger, at(2000), &g));
}

/// One tenant's many small gangs on sockets spent every requeue of the window, and the other
/// tenants' real requeues were held. Now one namespace gets at most
/// `gang.max_requeues_per_namespace` of them; the others go on being requeued, and the global
/// limit still binds. What the breaker counted survives a new leader: it is published as the
/// Lease's annotation and read back whole.
#[test]
fn redteam_one_namespace_cannot_spend_every_tenants_requeues() {
    let g = GangSettings {
        max_requeues_per_window: 6,
        max_requeues_per_namespace: 2,
        requeue_window: Duration::from_secs(600),
        ..GangSettings::default()
    };
    let t0 = Timestamp::from_second(2_000_000).unwrap();
    let at = |s: i64| t0 + k8s_openapi::jiff::SignedDuration::from_secs(s);
    let mut ledger = RequeueLedger::default();
    let mut noisy = Vec::new();
    for i in 0..10 {
        noisy.push(requeue::breaker(&mut ledger, "tenant-a", at(i), &g).is_ok());
    }
    assert_eq!(noisy.iter().filter(|ok| **ok).count(), 2, "{noisy:?}");
    let (why, _) = requeue::breaker(&mut ledger, "tenant-a", at(11), &g).unwrap_err();
    assert!(
        why.contains("2 admitted gangs of namespace tenant-a")
            && why.contains("gang.max_requeues_per_namespace 2"),
        "{why}"
    );
    // Another tenant's real failures are still requeued, up to the global limit.
    let others: Vec<bool> = ["b", "c", "d", "e", "f"]
        .iter()
        .map(|t| requeue::breaker(&mut ledger, &format!("tenant-{t}"), at(20), &g).is_ok())
        .collect();
    assert_eq!(others, [true, true, true, true, false], "6 in all");
    // A new leader reads the count back from the Lease's annotation: still open.
    let mut read = RequeueLedger::parse(&ledger.annotation()).unwrap();
    assert_eq!(read, ledger);
    assert!(requeue::breaker(&mut read, "tenant-g", at(30), &g).is_err());
    assert!(requeue::breaker(&mut read, "tenant-a", at(30), &g).is_err());
    // Past the window, both limits reopen.
    assert!(requeue::breaker(&mut read, "tenant-a", at(700), &g).is_ok());
}
