//! The guard's eviction decision: who is due, the breaker's cap, what is never evicted.

use super::*;
use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

/// Pod `name` on `node` whose condition turned `status`/`reason` at `since` (seconds).
fn pod(name: &str, node: &str, status: &str, reason: &str, since: Option<i64>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("train".into()),
            uid: Some(format!("uid-{name}")),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            conditions: Some(vec![PodCondition {
                type_: TRANSPORT_READY.into(),
                status: status.into(),
                reason: Some(reason.into()),
                message: Some(
                    "0 data-path QPs; 41.0 GB over TCP with 7 peers in 30 s via ib0".into(),
                ),
                last_transition_time: since.map(|s| Time(at(s))),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
    }
}

fn sockets(name: &str, since: i64) -> Pod {
    pod(name, "gpu-1", "False", SOCKETS_FALLBACK, Some(since))
}

struct World {
    runtime: RuntimeSettings,
    breaker: BreakerSettings,
    ledger: Ledger,
    first_seen: HashMap<String, Timestamp>,
    waiting: Vec<String>,
}

impl World {
    fn new() -> Self {
        World {
            runtime: RuntimeSettings {
                on_sockets: OnSockets::Evict,
                evict_after: Duration::from_secs(120),
                ..RuntimeSettings::default()
            },
            breaker: BreakerSettings {
                max_new_per_window: 2,
                window: Duration::from_secs(600),
                ..BreakerSettings::default()
            },
            ledger: Ledger::default(),
            first_seen: HashMap::new(),
            waiting: Vec::new(),
        }
    }

    fn plan(&self, pods: &[Pod], now: i64) -> Plan {
        let in_pool = |n: &str| n.starts_with("gpu-");
        let waiting = |uid: &str| self.waiting.iter().any(|w| w == uid);
        plan(
            pods,
            &Inputs {
                runtime: &self.runtime,
                breaker: &self.breaker,
                ledger: &self.ledger,
                in_pool: &in_pool,
                first_seen: &self.first_seen,
                waiting: &waiting,
                now: at(now),
            },
        )
    }
}

fn names(c: &[Candidate]) -> Vec<&str> {
    c.iter().map(|c| c.name.as_str()).collect()
}

#[test]
fn a_pod_is_due_once_its_condition_has_been_false_for_evict_after() {
    let w = World::new();
    let pods = [sockets("a", 0)];
    let early = w.plan(&pods, 119);
    assert!(early.evict.is_empty(), "{early:?}");
    assert_eq!(
        early.next,
        Some(at(120)),
        "the guard wakes when it turns due"
    );
    let due = w.plan(&pods, 120);
    assert_eq!(names(&due.evict), ["a"]);
    let c = &due.evict[0];
    assert_eq!((c.namespace.as_str(), c.uid.as_str()), ("train", "uid-a"));
    assert!(c.message.contains("41.0 GB over TCP"), "{c:?}");
    assert_eq!(c.since, at(0));
}

#[test]
fn record_never_evicts() {
    let mut w = World::new();
    w.runtime.on_sockets = OnSockets::Record;
    assert_eq!(w.plan(&[sockets("a", 0)], 10_000), Plan::default());
}

#[test]
fn only_false_with_reason_sockets_fallback_counts() {
    let w = World::new();
    let pods = [
        pod("rdma", "gpu-1", "True", "DataPathQueuePairs", Some(0)),
        pod("unknown", "gpu-1", "False", "TransportUnknown", Some(0)),
        pod("idle", "gpu-1", "False", "NoInterNodeTraffic", Some(0)),
        pod("other-node", "cpu-1", "False", SOCKETS_FALLBACK, Some(0)),
        sockets("yes", 0),
    ];
    let p = w.plan(&pods, 1000);
    assert_eq!(names(&p.evict), ["yes"], "{p:?}");
    assert!(p.held.is_empty());
}

#[test]
fn a_condition_that_flapped_back_to_false_counts_from_its_new_transition() {
    // True again before evict_after, then False anew: the agent's new lastTransitionTime.
    let w = World::new();
    let flapped = [sockets("a", 100)];
    assert!(w.plan(&flapped, 150).evict.is_empty());
    assert_eq!(w.plan(&flapped, 150).next, Some(at(220)));
    let back = [pod("a", "gpu-1", "True", "DataPathQueuePairs", Some(110))];
    assert_eq!(w.plan(&back, 1000), Plan::default());
}

#[test]
fn terminating_pods_and_pods_already_evicted_are_left_alone() {
    let mut w = World::new();
    let mut terminating = sockets("t", 0);
    terminating.metadata.deletion_timestamp = Some(Time(at(130)));
    w.ledger.record(
        LedgerEntry {
            at: at(130),
            pod: "train/e".into(),
            uid: "uid-e".into(),
        },
        w.breaker.window,
    );
    let p = w.plan(&[terminating, sockets("e", 0), sockets("n", 0)], 200);
    assert_eq!(names(&p.evict), ["n"], "{p:?}");
}

#[test]
fn the_breaker_caps_evictions_within_its_window_longest_on_sockets_first() {
    let mut w = World::new();
    let pods = [
        sockets("c", 20),
        sockets("a", 0),
        sockets("d", 30),
        sockets("b", 10),
    ];
    let p = w.plan(&pods, 200);
    assert_eq!(names(&p.evict), ["a", "b"]);
    assert_eq!(names(&p.held), ["c", "d"]);
    let why = p.held_because.unwrap();
    assert!(why.contains("node.breaker.max_new_per_window 2"), "{why}");
    for c in &p.evict {
        w.ledger.record(
            LedgerEntry {
                at: at(200),
                pod: format!("train/{}", c.name),
                uid: c.uid.clone(),
            },
            w.breaker.window,
        );
    }
    // The evicted ones are gone (or terminating); the cap is full until the window passes.
    let rest = [sockets("c", 20), sockets("d", 30)];
    let full = w.plan(&rest, 300);
    assert!(full.evict.is_empty());
    assert_eq!(names(&full.held), ["c", "d"]);
    assert_eq!(
        full.next,
        Some(at(800)),
        "room again when the window passes"
    );
    assert_eq!(names(&w.plan(&rest, 801).evict), ["c", "d"]);
    // Lifted: everything due goes.
    w.breaker.enabled = false;
    assert_eq!(names(&w.plan(&rest, 300).evict), ["c", "d"]);
    w.breaker.enabled = true;
    w.breaker.max_new_per_window = 0;
    assert_eq!(names(&w.plan(&rest, 300).evict), ["c", "d"]);
}

#[test]
fn pods_waiting_for_a_retry_are_neither_evicted_nor_held() {
    let mut w = World::new();
    w.waiting.push("uid-a".into());
    let p = w.plan(&[sockets("a", 0), sockets("b", 0)], 500);
    assert_eq!(names(&p.evict), ["b"]);
    assert!(p.held.is_empty());
}

#[test]
fn no_transition_time_or_one_in_the_future_counts_from_when_the_guard_saw_it() {
    let mut w = World::new();
    w.first_seen.insert("uid-a".into(), at(50));
    w.first_seen.insert("uid-f".into(), at(60));
    let pods = [
        pod("a", "gpu-1", "False", SOCKETS_FALLBACK, None),
        // The agent's clock runs ahead of the guard's.
        sockets("f", 10_000),
        // Not on sockets: never due.
        pod("r", "gpu-1", "True", "DataPathQueuePairs", None),
    ];
    assert_eq!(w.plan(&pods, 100).next, Some(at(170)));
    assert_eq!(names(&w.plan(&pods, 170).evict), ["a"]);
    assert_eq!(names(&w.plan(&pods, 180).evict), ["a", "f"]);
}

/// An idle queue pair beside bulk TCP to the job's peers is sockets for the guard as well.
#[test]
fn sockets_beside_idle_queue_pairs_is_due_like_sockets() {
    let w = World::new();
    let pods = [pod(
        "q",
        "gpu-1",
        "False",
        crate::transport::verdict::REASON_SOCKETS_BESIDE_IDLE,
        Some(0),
    )];
    assert_eq!(names(&w.plan(&pods, 1000).evict), ["q"]);
}

#[test]
fn a_pod_without_uid_or_node_is_never_a_candidate() {
    let w = World::new();
    let mut no_uid = sockets("u", 0);
    no_uid.metadata.uid = None;
    let mut unbound = sockets("n", 0);
    unbound.spec = Some(PodSpec::default());
    assert_eq!(w.plan(&[no_uid, unbound], 1000), Plan::default());
}

#[test]
fn the_ledger_keeps_its_window_and_reads_back_what_it_wrote() {
    let window = Duration::from_secs(60);
    let mut l = Ledger::default();
    for (i, s) in [0, 30, 90].into_iter().enumerate() {
        l.record(
            LedgerEntry {
                at: at(s),
                pod: format!("train/p{i}"),
                uid: format!("u{i}"),
            },
            window,
        );
    }
    assert_eq!(l.entries.len(), 2, "the one past the window is dropped");
    assert!(!l.evicted("u0") && l.evicted("u1") && l.evicted("u2"));
    assert_eq!(l.recent(window, &at(89)), 2);
    assert_eq!(l.recent(window, &at(100)), 1);
    // A clock stepped back: the entries still count.
    assert_eq!(l.recent(window, &at(0)), 2);
    let text = l.annotation();
    assert!(text.contains("\"pod\":\"train/p1\""), "{text}");
    assert_eq!(Ledger::parse(&text).unwrap(), l);
    assert!(Ledger::parse("{\"entries\":[{\"at\":\"x\"}]}").is_err());
    assert_eq!(
        ledger_annotation("fabricgate.io/"),
        "fabricgate.io/evictions"
    );
}

#[test]
fn the_ledger_is_bounded_when_no_cap_bounds_it() {
    let mut l = Ledger::default();
    for i in 0..(LEDGER_MAX + 5) {
        l.record(
            LedgerEntry {
                at: at(i64::try_from(i).unwrap()),
                pod: format!("train/p{i}"),
                uid: format!("u{i}"),
            },
            Duration::from_secs(86_400),
        );
    }
    assert_eq!(l.entries.len(), LEDGER_MAX);
    assert!(!l.evicted("u0") && l.evicted(&format!("u{}", LEDGER_MAX + 4)));
}
