//! What should happen to a Workload (`step::next`), from the Workload, the cached objects,
//! the clock and the settings alone.

use super::*;
use crate::gang::admission_check::state::State;
use crate::gang::admission_check::step::{
    self, Action, Decision, Facts, Plan, deadline_after, pending_check,
};
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeSet;
use std::sync::Arc;

fn ours() -> BTreeSet<String> {
    [OURS.to_owned()].into()
}

fn at(text: &str) -> Timestamp {
    text.parse().expect("a timestamp")
}

/// Ten seconds into the reservation.
fn now() -> Timestamp {
    at("2026-12-02T03:00:10Z")
}

fn hosts(n: usize) -> Vec<String> {
    (0..n).map(host).collect()
}

/// `step::next` over `cache` for its one Workload.
fn plan_with(
    cache: Cache,
    s: &CheckSettings,
    state: &mut State,
    now: Timestamp,
    listed: Option<Vec<DynamicObject>>,
) -> Plan {
    let stores = cache.stores();
    let wl = stores.workloads.state().pop().expect("a Workload");
    let pending = pending_check(&wl, &ours()).expect("our check pending");
    let pool = stores.nodes.state();
    let facts = Facts {
        wl: &wl,
        pending: &pending,
        stores: &stores,
        pool: &pool,
        settings: s,
        now,
    };
    step::next(
        &facts,
        state,
        listed.map(|l| l.into_iter().map(Arc::new).collect()),
    )
}

fn plan(cache: Cache) -> Plan {
    plan_with(cache, &settings(), &mut State::default(), now(), None)
}

/// The state `plan` writes with no FabricCheck involved.
fn written(plan: Plan) -> Decision {
    match plan.action {
        Action::Write(d) => d,
        a => panic!("not a state written: {a:?}"),
    }
}

fn concluded(plan: Plan) -> Decision {
    match plan.action {
        Action::Conclude(d, fc) => {
            assert_eq!(fc.metadata.uid.as_deref(), Some(CHECK_UID));
            d
        }
        a => panic!("not a check concluded: {a:?}"),
    }
}

/// A gang of `n` validated Nodes, its Workload at version `rv`.
fn gang(n: usize, rv: &str) -> Cache {
    Cache {
        workloads: vec![workload(rv, &hosts(n), None)],
        nodes: (0..n).map(node).collect(),
        ..Cache::default()
    }
}

#[test]
fn only_our_pending_entries_under_a_reservation_are_moved_on() {
    let base = workload("1", &hosts(2), Some(3));
    let pending = pending_check(&base, &ours()).expect("pending");
    assert_eq!(pending.entries, [OURS]);
    assert_eq!(pending.retry_count, 3);
    assert_eq!(pending.reservation, RESERVED);
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut wl = base.clone();
        f(&mut wl.data["status"]);
        wl
    };
    let cases: [(&str, DynamicObject); 4] = [
        (
            "another controller's check",
            edit(&|s| s["admissionChecks"][0]["name"] = json!("other")),
        ),
        (
            "decided already",
            edit(&|s| s["admissionChecks"][0]["state"] = json!("Ready")),
        ),
        (
            "no quota reserved",
            edit(&|s| s["conditions"][0]["status"] = json!("False")),
        ),
        (
            "being evicted",
            edit(&|s| {
                s["conditions"]
                    .as_array_mut()
                    .expect("conditions")
                    .push(json!({ "type": "Evicted", "status": "True" }));
            }),
        ),
    ];
    for (why, wl) in cases {
        assert!(pending_check(&wl, &ours()).is_none(), "{why}");
    }
}

#[test]
fn a_gang_of_validated_nodes_gets_a_fabric_check_due_after_the_timeout() {
    let now = at("2026-12-02T03:00:10.250Z");
    let p = plan_with(gang(3, "1"), &settings(), &mut State::default(), now, None);
    assert!(p.stale.is_none());
    match p.action {
        Action::Create { name, spec } => {
            assert_eq!(name, check_name());
            // gang.timeout (20 s) after now, rounded up to the second.
            assert_eq!(spec, ring(3, "2026-12-02T03:00:31Z"));
        }
        a => panic!("{a:?}"),
    }
    assert_eq!(
        deadline_after(at("2026-12-02T03:00:10Z"), Duration::from_secs(20)),
        "2026-12-02T03:00:30Z"
    );
}

#[test]
fn nodes_not_ready_for_a_ring_are_a_retry_requeued_after_the_backoff() {
    let mut no_endpoint = node(1);
    no_endpoint.metadata.annotations = None;
    let mut foreign = node(1);
    foreign
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(ENDPOINT_ANNOTATION.into(), "169.254.169.254:9465".into());
    let cases = [
        (
            vec![node(0), unvalidated(1)],
            "1 of 2 assigned nodes are not validated now: gpu-1: FabricReady=False (PortDown: \
             mlx5_0 port 1 is DOWN); tainted fabricgate.io/unvalidated",
        ),
        (
            vec![node(0), no_endpoint],
            "1 assigned nodes publish no peers endpoint (Node annotation \
             fabricgate.io/peers-endpoint, written by the agent with peers enabled): gpu-1",
        ),
        (
            vec![node(0), foreign],
            "1 assigned nodes publish a peers endpoint (Node annotation \
             fabricgate.io/peers-endpoint) that is not one of the Node's status.addresses at \
             the peers port 9465: gpu-1",
        ),
        (
            vec![node(0)],
            "pod set main: the assigned domain kubernetes.io/hostname=gpu-1 matches no Node",
        ),
    ];
    for (nodes, why) in cases {
        let d = written(plan(Cache {
            workloads: vec![workload("1", &hosts(2), None)],
            nodes,
            ..Cache::default()
        }));
        assert_eq!(
            d,
            Decision {
                state: "Retry",
                message: format!(
                    "{why}; attempt 1 of gang.max_attempts 10: Kueue reserves again in 5 s at \
                     the earliest"
                ),
                failed_pairs: 0,
                requeue_after: Some(5),
            }
        );
    }
}

#[test]
fn the_last_attempt_and_a_gang_over_max_nodes_are_rejected() {
    // The tenth failure of gang.max_attempts 10.
    let last = Cache {
        workloads: vec![workload("1", &hosts(2), Some(9))],
        nodes: vec![node(0), unvalidated(1)],
        ..Cache::default()
    };
    let d = written(plan(last));
    assert_eq!((d.state, d.requeue_after), ("Rejected", None));
    assert!(
        d.message.starts_with(
            "the gang pre-flight failed 10 times (gang.max_attempts 10): rejected; last \
             failure: 1 of 2 assigned nodes are not validated now"
        ),
        "{}",
        d.message
    );
    // The backoff doubles per earlier retry.
    let third = Cache {
        workloads: vec![workload("1", &hosts(2), Some(2))],
        nodes: vec![node(0), unvalidated(1)],
        ..Cache::default()
    };
    assert_eq!(written(plan(third)).requeue_after, Some(20));

    let mut s = settings();
    s.gang.max_nodes = 2;
    let d = written(plan_with(
        gang(3, "1"),
        &s,
        &mut State::default(),
        now(),
        None,
    ));
    assert_eq!((d.state, d.requeue_after), ("Rejected", None));
    assert!(
        d.message
            .starts_with("the gang has 3 nodes, more than gang.max_nodes (2)"),
        "{}",
        d.message
    );
}

#[test]
fn one_node_is_ready_without_a_ring() {
    assert_eq!(
        written(plan(gang(1, "1"))),
        Decision {
            state: "Ready",
            message: "the one assigned node gpu-0 is validated; no pair to test".to_owned(),
            failed_pairs: 0,
            requeue_after: None,
        }
    );
}

#[test]
fn pod_sets_without_topology_are_a_retry_unless_allowed() {
    let untopological = || {
        workload_with(
            "1",
            json!([{ "name": "main", "count": 2, "flavors": { "nvidia.com/gpu": "gpu" } }]),
            None,
        )
    };
    let flavor: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
        "metadata": { "name": "gpu" }, "spec": { "nodeLabels": { "pool": "gpu" } },
    }))
    .expect("a flavor");
    let cache = |flavors: Vec<DynamicObject>, nodes: Vec<Node>| Cache {
        workloads: vec![untopological()],
        nodes,
        flavors,
        ..Cache::default()
    };
    let d = written(plan(cache(vec![flavor.clone()], vec![node(0), node(1)])));
    assert_eq!(d.state, "Retry");
    assert!(
        d.message.starts_with(
            "pod set main has no topology assignment: Kueue Topology Aware Scheduling did not \
             place it"
        ) && d.message.contains("gang.require_topology is true"),
        "{}",
        d.message
    );

    let mut allowed = settings();
    allowed.gang.require_topology = false;
    let with = |cache: Cache| {
        written(plan_with(
            cache,
            &allowed,
            &mut State::default(),
            now(),
            None,
        ))
    };
    let d = with(cache(vec![flavor.clone()], vec![node(0), node(1)]));
    assert_eq!(d.state, "Ready");
    assert!(
        d.message
            .starts_with("no topology assignment (Kueue Topology Aware Scheduling is not used")
            && d.message.contains(
                "pod set main: no topology assignment, only node validation checked (2 of 2 \
                 nodes of flavor gpu validated for 2 pods"
            ),
        "{}",
        d.message
    );
    let d = with(cache(vec![flavor], vec![node(0), unvalidated(1)]));
    assert_eq!(d.state, "Retry");
    assert!(
        d.message.starts_with(
            "no topology assignment for pod set main: only node validation can be checked; 1 \
             of the 2 nodes of flavor gpu are validated, 2 pods need them: gpu-1:"
        ),
        "{}",
        d.message
    );
    let d = with(cache(Vec::new(), vec![node(0), node(1)]));
    assert!(
        d.message
            .starts_with("pod set main: ResourceFlavor gpu not found"),
        "{}",
        d.message
    );
}

/// The gang of two with its check in flight (due at 03:00:30), and the answers given.
fn in_flight(answers: &[(usize, bool)]) -> Cache {
    let spec = ring(2, "2026-12-02T03:00:30Z");
    Cache {
        checks: vec![check(&spec, RESERVED)],
        results: answers
            .iter()
            .map(|&(i, ok)| answer(&spec, i, ok))
            .collect(),
        ..gang(2, "1")
    }
}

#[test]
fn a_check_in_flight_waits_for_its_answers_until_the_deadline_and_grace() {
    let p = plan(in_flight(&[(0, true)]));
    assert!(p.stale.is_none());
    // The deadline, 20 s away, and the grace of min(gang.timeout / 4, 2 s).
    assert!(
        matches!(p.action, Action::Wait(d) if d == Duration::from_secs(22)),
        "{p:?}"
    );
    // Past them, a silent member's answer is looked for in the API before it counts as silent.
    let late = at("2026-12-02T03:00:32Z");
    let mut state = State::default();
    let p = plan_with(in_flight(&[(0, true)]), &settings(), &mut state, late, None);
    assert!(
        matches!(p.action, Action::ListAnswers(ref fc) if fc.metadata.uid.as_deref() == Some(CHECK_UID))
    );
    let d = concluded(plan_with(
        in_flight(&[(0, true)]),
        &settings(),
        &mut state,
        late,
        Some(Vec::new()),
    ));
    assert_eq!(
        (d.state, d.failed_pairs, d.requeue_after),
        ("Retry", 0, Some(5))
    );
    assert!(
        d.message
            .starts_with("gang RDMA pre-flight timed out after 20s: no result from 2 of 2 members"),
        "{}",
        d.message
    );
    // What the API lists is what counts.
    let spec = ring(2, "2026-12-02T03:00:30Z");
    let listed = vec![answer(&spec, 0, true), answer(&spec, 1, true)];
    let d = concluded(plan_with(
        in_flight(&[(0, true)]),
        &settings(),
        &mut state,
        late,
        Some(listed),
    ));
    assert_eq!(d.state, "Ready");
}

/// The controller's empty answers are no answers: past the deadline, a
/// member whose answer is still empty is silent.
#[test]
fn an_empty_answer_is_not_an_answer() {
    let spec = ring(2, "2026-12-02T03:00:30Z");
    let check = FabricCheck {
        name: check_name(),
        uid: CHECK_UID.to_owned(),
        spec: spec.clone(),
    };
    let empty = |i: usize| -> DynamicObject {
        let mut obj: DynamicObject = serde_json::from_value(fabriccheck::empty_result_object(
            &check,
            &host(i),
            &host((i + 1) % 2),
        ))
        .expect("an empty answer");
        obj.metadata.namespace = Some(GANG_NS.to_owned());
        obj
    };
    let late = at("2026-12-02T03:00:32Z");
    let mut state = State::default();
    let cache = Cache {
        results: vec![answer(&spec, 0, true), empty(1)],
        ..in_flight(&[])
    };
    let p = plan_with(cache, &settings(), &mut state, late, None);
    assert!(matches!(p.action, Action::ListAnswers(_)), "{p:?}");
    let d = concluded(plan_with(
        in_flight(&[]),
        &settings(),
        &mut state,
        late,
        Some(vec![answer(&spec, 0, true), empty(1)]),
    ));
    assert_eq!(d.state, "Retry");
    assert!(
        d.message.contains("no result from 1 of 2 members: gpu-1"),
        "{}",
        d.message
    );
}

#[test]
fn a_check_in_flight_is_concluded_on_its_answers() {
    let d = concluded(plan(in_flight(&[(0, true), (1, true)])));
    assert_eq!(
        (d.state, d.failed_pairs, d.requeue_after),
        ("Ready", 0, None)
    );
    assert!(
        d.message.starts_with(
            "gang RDMA pre-flight passed: 2 pairs in a ring over 2 nodes, slowest median RTT 5.0 µs"
        ),
        "{}",
        d.message
    );
    let d = concluded(plan(in_flight(&[(0, true), (1, false)])));
    assert_eq!(
        (d.state, d.failed_pairs, d.requeue_after),
        ("Retry", 1, Some(5))
    );
    assert!(
        d.message.starts_with(
            "gang RDMA pre-flight failed on 1 of 2 pairs: gpu-1 -> gpu-0 (mlx5_0 port 1): \
             timeout: no completion"
        ),
        "{}",
        d.message
    );
}

#[test]
fn a_member_no_longer_validated_fails_its_check_whatever_the_answers() {
    let mut cache = in_flight(&[(0, true), (1, true)]);
    cache.nodes[1] = unvalidated(1);
    let d = concluded(plan(cache));
    assert_eq!((d.state, d.failed_pairs), ("Retry", 0));
    assert!(
        d.message.starts_with(
            "1 of 2 members are no longer validated during the gang pre-flight: gpu-1: \
             FabricReady=False"
        ),
        "{}",
        d.message
    );
    let mut gone = in_flight(&[(0, true), (1, true)]);
    gone.nodes.pop();
    // Its domain matches no Node now: not the check's nodes any more.
    let p = plan(gone);
    assert!(p.stale.is_some());
    assert!(
        written(p)
            .message
            .contains("kubernetes.io/hostname=gpu-1 matches no Node")
    );
}

#[test]
fn a_check_of_another_reservation_or_other_nodes_is_replaced() {
    let spec = ring(2, "2026-12-02T03:00:30Z");
    let earlier = Cache {
        checks: vec![check(&spec, "2026-12-02T02:00:00Z")],
        ..gang(2, "1")
    };
    let other_nodes = Cache {
        checks: vec![check(&ring(3, "2026-12-02T03:00:30Z"), RESERVED)],
        nodes: (0..3).map(node).collect(),
        ..gang(2, "1")
    };
    for cache in [earlier, other_nodes] {
        let p = plan(cache);
        let stale = p.stale.expect("the old check deleted first");
        assert_eq!(stale.metadata.uid.as_deref(), Some(CHECK_UID));
        assert!(matches!(p.action, Action::Create { ref spec, .. } if spec.members.len() == 2));
    }
    // One deleted already is gone, whatever the store still shows.
    let mut state = State::default();
    state.deleted.insert(CHECK_UID.to_owned());
    let p = plan_with(
        in_flight(&[(0, true)]),
        &settings(),
        &mut state,
        now(),
        None,
    );
    assert!(p.stale.is_none());
    assert!(matches!(p.action, Action::Create { .. }), "{p:?}");
}

/// A check its maker created but never labelled for its members (the leader died in between,
/// the Lease passed on) asks no agent: it is made again. The maker's own check, shown
/// unlabelled by a store behind the label patch, is in flight.
#[test]
fn a_check_whose_members_were_never_asked_is_made_again_unless_this_leader_made_it() {
    let spec = ring(2, "2026-12-02T03:00:30Z");
    let left = |fc: DynamicObject| Cache {
        checks: vec![fc],
        ..gang(2, "1")
    };
    // Ten seconds after it was made, the Lease passed on.
    let later = at("2026-12-02T03:00:20Z");
    let p = plan_with(
        left(half_made(&spec, RESERVED)),
        &settings(),
        &mut State::default(),
        later,
        None,
    );
    let stale = p.stale.expect("the half-made check deleted first");
    assert_eq!(stale.metadata.uid.as_deref(), Some(CHECK_UID));
    match p.action {
        // With a deadline a whole gang.timeout from now, not the half-made one's.
        Action::Create { name, spec } => {
            assert_eq!(name, check_name());
            assert_eq!(spec, ring(2, "2026-12-02T03:00:40Z"));
        }
        a => panic!("{a:?}"),
    }
    // Labelled for one member of two: not asked either.
    let mut one = half_made(&spec, RESERVED);
    kube::ResourceExt::labels_mut(&mut one)
        .insert(fabriccheck::member_label(&host(0)), "true".to_owned());
    assert!(plan(left(one)).stale.is_some());

    let mut state = State::default();
    state
        .made
        .insert(CHECK_UID.to_owned(), std::time::Instant::now());
    let p = plan_with(
        left(half_made(&spec, RESERVED)),
        &settings(),
        &mut state,
        now(),
        None,
    );
    assert!(p.stale.is_none(), "{p:?}");
    assert!(matches!(p.action, Action::Wait(_)), "{p:?}");
}

#[test]
fn members_are_matched_once_per_version_and_a_state_written_once() {
    let mut state = State::default();
    let p = plan_with(
        in_flight(&[(0, true)]),
        &settings(),
        &mut state,
        now(),
        None,
    );
    assert!(matches!(p.action, Action::Wait(_)));
    assert_eq!(
        state.same_members.get(CHECK_UID),
        Some(&("1".to_owned(), true))
    );
    // The memo is what counts at that version (the Nodes are not matched again).
    state
        .same_members
        .insert(CHECK_UID.to_owned(), ("1".to_owned(), false));
    let p = plan_with(
        in_flight(&[(0, true)]),
        &settings(),
        &mut state,
        now(),
        None,
    );
    assert!(p.stale.is_some());

    state.decided.insert(WL_UID.to_owned(), "1".to_owned());
    let p = plan_with(gang(2, "1"), &settings(), &mut state, now(), None);
    assert!(matches!(p.action, Action::AlreadyWritten), "{p:?}");
    // A new version of the Workload (the write's echo, or Kueue's change) is decided again.
    let p = plan_with(gang(2, "2"), &settings(), &mut state, now(), None);
    assert!(matches!(p.action, Action::Create { .. }), "{p:?}");
}
