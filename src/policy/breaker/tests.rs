use super::*;
use k8s_openapi::api::core::v1::NodeStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;

const KEY: &str = "fabricgate.io/unvalidated";
const ANN: &str = "fabricgate.io/breaker-override";

fn pool_node(name: &str, tainted: bool, failed_secs_ago: Option<i64>) -> Node {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let now = Timestamp::now().as_second();
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: Some(if tainted {
                vec![Taint {
                    key: KEY.into(),
                    effect: "NoSchedule".into(),
                    ..Taint::default()
                }]
            } else {
                vec![]
            }),
            ..NodeSpec::default()
        }),
        status: Some(NodeStatus {
            conditions: failed_secs_ago.map(|ago| {
                vec![NodeCondition {
                    type_: "FabricReady".into(),
                    status: "False".into(),
                    last_transition_time: Some(Time(Timestamp::from_second(now - ago).unwrap())),
                    ..NodeCondition::default()
                }]
            }),
            ..NodeStatus::default()
        }),
    }
}

fn decide(pool: &PoolCount) -> TaintDecision {
    taint_decision(&BreakerSettings::default(), Some(pool), false, ANN)
}

#[test]
fn ten_nodes_at_one_half_the_sixth_is_not_tainted() {
    let mut nodes: Vec<Node> = (0..10)
        .map(|i| pool_node(&format!("n{i}"), i < 4, None))
        .collect();
    let now = Timestamp::now();
    let w = Duration::from_secs(600);
    // Four others tainted: the fifth may taint (5 of 10 = 0.5, not above).
    let c = count_pool(&nodes, "n9", KEY, w, &now);
    assert_eq!((c.nodes, c.tainted_others), (10, 4));
    assert_eq!(decide(&c), TaintDecision::Taint);
    // Five others tainted: the sixth may not.
    nodes[4] = pool_node("n4", true, None);
    let c = count_pool(&nodes, "n9", KEY, w, &now);
    let TaintDecision::BreakerOpen { message } = decide(&c) else {
        panic!("breaker should be open: {c:?}");
    };
    assert!(message.contains("6 of 10"), "{message}");
    assert!(message.contains(ANN), "{message}");
    // Overrides.
    assert_eq!(
        taint_decision(&BreakerSettings::default(), Some(&c), true, ANN),
        TaintDecision::Taint
    );
    let off = BreakerSettings {
        enabled: false,
        ..BreakerSettings::default()
    };
    assert_eq!(
        taint_decision(&off, Some(&c), false, ANN),
        TaintDecision::Taint
    );
    assert_eq!(
        taint_decision(&BreakerSettings::default(), None, false, ANN),
        TaintDecision::Taint
    );
    // A pool of one node can still fail closed.
    let alone = count_pool(&nodes[9..], "n9", KEY, w, &now);
    assert_eq!(alone.nodes, 1);
    assert_eq!(decide(&alone), TaintDecision::Taint);
}

#[test]
fn the_absolute_cap_counts_only_recent_failures() {
    let settings = BreakerSettings {
        max_new_per_window: 2,
        ..BreakerSettings::default()
    };
    let now = Timestamp::now();
    let w = Duration::from_secs(600);
    let mut nodes: Vec<Node> = (0..100)
        .map(|i| pool_node(&format!("n{i}"), false, None))
        .collect();
    nodes[0] = pool_node("n0", true, Some(30));
    nodes[1] = pool_node("n1", true, Some(3600));
    let c = count_pool(&nodes, "n99", KEY, w, &now);
    assert_eq!((c.tainted_others, c.new_in_window), (2, 1));
    assert_eq!(
        taint_decision(&settings, Some(&c), false, ANN),
        TaintDecision::Taint
    );
    nodes[2] = pool_node("n2", true, Some(60));
    let c = count_pool(&nodes, "n99", KEY, w, &now);
    assert!(matches!(
        taint_decision(&settings, Some(&c), false, ANN),
        TaintDecision::BreakerOpen { .. }
    ));
    // Tainted a moment ago, its conditions not written yet (FabricReady still True): new.
    nodes[2] = pool_node("n2", true, None);
    let conditions = nodes[2].status.as_mut().unwrap();
    conditions.conditions = Some(vec![k8s_openapi::api::core::v1::NodeCondition {
        type_: "FabricReady".into(),
        status: "True".into(),
        last_transition_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::from_second(0).unwrap(),
        )),
        ..Default::default()
    }]);
    let c = count_pool(&nodes, "n99", KEY, w, &now);
    assert_eq!(c.new_in_window, 2, "{c:?}");
    // Registered with the taint, never validated (no condition): not a failure.
    nodes[2] = pool_node("n2", true, None);
    let c = count_pool(&nodes, "n99", KEY, w, &now);
    assert_eq!(c.new_in_window, 1, "{c:?}");
}

#[test]
fn redteam_the_ledger_keeps_others_entries_and_prunes_only_past_its_bound() {
    let now = Timestamp::from_second(1_000_000).unwrap();
    let at = |ago: i64| Timestamp::from_second(1_000_000 - ago).unwrap().to_string();
    let data: BTreeMap<String, String> = [
        ("a", at(10)),
        ("b", at(700)),
        ("c", at(5)),
        ("other-pool", at(5)),
        ("me", at(1)),
        ("garbage", "yesterday".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    // a, b, c, me and garbage are failing Nodes of the pool; other-pool is not in it.
    let nodes: Vec<Node> = ["a", "b", "c", "me", "garbage"]
        .into_iter()
        .map(|n| pool_node(n, true, Some(60)))
        .collect();
    let pool = PoolSummary::of(&nodes, KEY, Duration::from_secs(600), &now);
    let w = Duration::from_secs(600);
    // a and c: b is too old, other-pool is not ours, me is me, garbage is unreadable.
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 2);
    let next = ledger_with(&data, "d", "pool=a", w, &now);
    assert_eq!(next.get("d"), Some(&format!("{now} pool=a")));
    // Everyone else's entry is kept byte for byte, stale ones too (the admission policy
    // admits only that: a drop would lift a reservation).
    assert_eq!(next.len(), data.len() + 1);
    for (k, v) in &data {
        assert_eq!(next.get(k), Some(v), "{k} changed or dropped");
    }
    // Past LEDGER_PRUNE_AT entries, the stale and unreadable ones are pruned.
    let mut big = data.clone();
    for i in 0..LEDGER_PRUNE_AT {
        big.insert(format!("old-{i}"), "2000-01-01T00:00:00Z pool=a".to_owned());
    }
    let pruned = ledger_with(&big, "d", "pool=a", w, &now);
    assert!(!pruned.contains_key("b") && !pruned.contains_key("garbage"));
    assert!(!pruned.contains_key("old-0"));
    assert!(pruned.contains_key("a") && pruned.contains_key("other-pool"));
}

/// A reservation counts only while the Node it names shows the failure (past its first
/// moments in flight): fresh-looking entries forged for healthy Nodes, and the entries of
/// Nodes that recovered, count for nothing.
#[test]
fn an_entry_counts_only_while_its_node_shows_the_failure() {
    let w = Duration::from_secs(600);
    let nodes = vec![
        pool_node("failing", true, Some(60)),
        pool_node("healthy", false, None),
        pool_node("recovered", false, None),
        // Not tainted (held by the breaker, or the guard's condition before its taint),
        // but FabricReady=False: it shows the failure.
        pool_node("condition-only", false, Some(60)),
        pool_node("in-flight", false, None),
        pool_node("me", true, None),
    ];
    let now = Timestamp::now();
    let pool = PoolSummary::of(&nodes, KEY, w, &now);
    let failing: Vec<&str> = [
        "failing",
        "healthy",
        "recovered",
        "condition-only",
        "in-flight",
        "me",
    ]
    .into_iter()
    .filter(|n| pool.shows_failure(n) == Some(true))
    .collect();
    assert_eq!(failing, ["failing", "condition-only", "me"]);
    let at = |ago: i64| {
        Timestamp::from_second(now.as_second() - ago)
            .unwrap()
            .to_string()
    };
    let in_flight = i64::try_from(RESERVATION_IN_FLIGHT.as_secs()).unwrap();
    let mut pool = pool;
    pool.selector = "pool=a".into();
    let bare = at;
    let at = |ago: i64| format!("{} pool=a", bare(ago));
    let data: BTreeMap<String, String> = [
        ("failing", at(120)),
        ("healthy", at(in_flight + 1)),
        ("recovered", at(300)),
        ("condition-only", at(120)),
        ("in-flight", at(1)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    // failing, condition-only, and the fresh in-flight reservation.
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 3);
    // The in-flight entry stops counting once past RESERVATION_IN_FLIGHT with no failure.
    let later = Timestamp::from_second(now.as_second() + in_flight).unwrap();
    assert_eq!(ledger_recent(&data, "me", &pool, w, &later), 2);
    // A forger's fresh entries for every healthy Node: only within the in-flight moment,
    // and that moment is the node's own to claim (the admission policy).
    let forged: BTreeMap<String, String> = ["healthy", "recovered", "in-flight"]
        .into_iter()
        .map(|k| (k.to_owned(), at(in_flight + 5)))
        .collect();
    assert_eq!(ledger_recent(&forged, "me", &pool, w, &now), 0);
    // A window shorter than the in-flight time bounds it.
    let short = Duration::from_secs(1);
    let fresh: BTreeMap<String, String> = [("healthy".to_owned(), at(2))].into_iter().collect();
    assert_eq!(ledger_recent(&fresh, "me", &pool, short, &now), 0);
    // A fresh entry without a pool (an agent from before entries named theirs) counts
    // only once its Node shows the failure.
    let untagged: BTreeMap<String, String> = [("in-flight", 1), ("failing", 1)]
        .into_iter()
        .map(|(k, ago)| (k.to_owned(), bare(ago)))
        .collect();
    assert_eq!(ledger_recent(&untagged, "me", &pool, w, &now), 1);
}

/// The summary the guard publishes counts every Node of the pool exactly as a list of the
/// pool does, for every Node deciding (in the pool or not), and judges ledger entries of
/// the pool the same; only a Node outside the pool, unknown to it, counts as a healthy
/// member (its reservation counts while in flight).
#[test]
fn the_published_summary_counts_as_the_pool_list_does() {
    let w = Duration::from_secs(600);
    let now = Timestamp::now();
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..60 {
        let name = format!("n{i:02}");
        nodes.push(match i % 6 {
            0 => pool_node(&name, true, Some(30)),   // tainted, new
            1 => pool_node(&name, true, Some(3600)), // tainted, old
            2 => pool_node(&name, true, None),       // registered with the taint
            3 => pool_node(&name, false, Some(30)),  // held (FabricReady=False, no taint)
            _ => pool_node(&name, false, None),      // healthy
        });
    }
    // Tainted while FabricReady still says True: new.
    nodes[4] = pool_node("n04", true, None);
    nodes[4].status.as_mut().unwrap().conditions =
        Some(vec![k8s_openapi::api::core::v1::NodeCondition {
            type_: "FabricReady".into(),
            status: "True".into(),
            ..Default::default()
        }]);
    let listed = PoolSummary::of(&nodes, KEY, w, &now);
    let text = listed.annotation().expect("small enough to publish");
    let published = PoolSummary::parse(&text).unwrap();
    assert_eq!(published.nodes, 60);
    assert_eq!(published.window_seconds, 600);
    assert_eq!(published.tainted_new.len(), 11, "{text}");
    assert!(!text.contains("n05"), "healthy Nodes are not named: {text}");
    let data: BTreeMap<String, String> = nodes
        .iter()
        .map(|n| (n.metadata.name.clone().unwrap(), now.to_string()))
        .collect();
    for me in ["n00", "n01", "n03", "n04", "n05", "outside"] {
        let in_pool = me != "outside";
        assert_eq!(
            count_pool(&nodes, me, KEY, w, &now),
            published.count(me, in_pool),
            "{me}"
        );
        assert_eq!(
            ledger_recent(&data, me, &listed, w, &now),
            ledger_recent(&data, me, &published, w, &now),
            "{me}"
        );
    }
    // A fresh reservation in this pool by a Node it does not know: the list knows it is no
    // member, the summary (which names only failing Nodes) counts it while in flight.
    let stranger: BTreeMap<String, String> = [("elsewhere".to_owned(), format!("{now} "))]
        .into_iter()
        .collect();
    assert_eq!(ledger_recent(&stranger, "n05", &listed, w, &now), 0);
    assert_eq!(ledger_recent(&stranger, "n05", &published, w, &now), 1);
    // Unknown keys or a wrong shape are refused, not guessed at.
    assert!(PoolSummary::parse(r#"{"nodes":3,"windowSeconds":600,"extra":1}"#).is_err());
    assert!(PoolSummary::parse("nodes=3").is_err());
}

#[test]
fn a_summary_too_large_for_an_annotation_is_not_published() {
    let now = Timestamp::now();
    let nodes: Vec<Node> = (0..8000)
        .map(|i| pool_node(&format!("gpu-node-{i:05}.cluster.example"), true, Some(30)))
        .collect();
    let s = PoolSummary::of(&nodes, KEY, Duration::from_secs(600), &now);
    assert!(s.annotation().is_none());
    let s = PoolSummary::of(&nodes[..2000], KEY, Duration::from_secs(600), &now);
    assert!(
        s.annotation()
            .is_some_and(|a| a.len() <= MAX_PUBLISHED_BYTES)
    );
    // A fleet-wide start of 5,000 Nodes, all validated in the last seconds: their turns do not
    // fit, the rest of the summary is published without them.
    let started: Vec<Node> = (0..5000)
        .map(|i| validated_node(&format!("gpu-node-{i:05}.cluster.example"), now.as_second()))
        .collect();
    let s = PoolSummary::of(&started, KEY, Duration::from_secs(600), &now);
    assert_eq!(s.untainted_since.len(), 5000);
    let published = PoolSummary::parse(&s.annotation().unwrap()).unwrap();
    assert_eq!(published.nodes, 5000);
    assert!(published.untainted_since.is_empty());
}

#[test]
fn label_selectors_match_as_kubectl_reads_them() {
    let labels: BTreeMap<String, String> = [
        ("nvidia.com/gpu.present", "true"),
        ("pool", "a"),
        ("zone", "z1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    for (selector, want) in [
        ("nvidia.com/gpu.present=true", Some(true)),
        ("nvidia.com/gpu.present==true", Some(true)),
        ("pool=b", Some(false)),
        ("pool!=b", Some(true)),
        ("missing!=b", Some(true)),
        ("pool", Some(true)),
        ("!pool", Some(false)),
        ("!missing", Some(true)),
        ("pool in (a, b),zone", Some(true)),
        ("pool notin (a,b)", Some(false)),
        ("missing notin (a)", Some(true)),
        ("pool=a, zone=z2", Some(false)),
        ("", Some(true)),
        ("pool in (a", None),
        ("pool=a)", None),
        ("pool within (a)", None),
        ("bad key=1", None),
    ] {
        assert_eq!(selector_matches(selector, &labels), want, "{selector:?}");
    }
}

/// An agent decides from the guard's summary only while the guard's leader renews its
/// Lease, and only when the guard counted the same pool with the same window; every other
/// case is an error that says why (the agent lists the pool instead).
#[test]
fn a_summary_counts_only_while_fresh_and_for_the_same_pool() {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    let now = Timestamp::from_second(2_000_000).unwrap();
    let w = Duration::from_secs(600);
    let nodes = vec![pool_node("a", true, None), pool_node("b", false, None)];
    let mut summary = PoolSummary::of(&nodes, KEY, w, &now);
    summary.selector = "pool=a".into();
    let lease = |holder: Option<&str>, renewed_ago: i64, text: Option<String>| Lease {
        metadata: ObjectMeta {
            name: Some("fabricgate-guard".into()),
            annotations: text.map(|t| [("fabricgate.io/pool".to_owned(), t)].into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(
                Timestamp::from_second(2_000_000 - renewed_ago).unwrap(),
            )),
            ..LeaseSpec::default()
        }),
    };
    let published = summary.annotation();
    let judge = |l: &Lease, selector: &str, window: Duration| {
        published_summary(l, "fabricgate.io/", selector, window, &now)
    };
    let good = lease(Some("guard-a"), 3, published.clone());
    let got = judge(&good, "pool=a", w).unwrap();
    assert_eq!(got.count("b", true), summary.count("b", true));
    assert_eq!(got.count("b", true).tainted_others, 1);
    for (l, selector, window, why) in [
        (
            lease(Some("guard-a"), 16, published.clone()),
            "pool=a",
            w,
            "not renewed",
        ),
        (
            lease(Some("guard-a"), -16, published.clone()),
            "pool=a",
            w,
            "not renewed",
        ),
        (lease(None, 3, published.clone()), "pool=a", w, "no holder"),
        (
            lease(Some(""), 3, published.clone()),
            "pool=a",
            w,
            "no holder",
        ),
        (
            lease(Some("guard-a"), 3, None),
            "pool=a",
            w,
            "no fabricgate.io/pool",
        ),
        (
            lease(Some("guard-a"), 3, Some("{".into())),
            "pool=a",
            w,
            "not a pool summary",
        ),
        (
            lease(Some("guard-a"), 3, published.clone()),
            "pool=b",
            w,
            "node.pool_selector",
        ),
        (
            lease(Some("guard-a"), 3, published.clone()),
            "pool=a",
            Duration::from_secs(60),
            "node.breaker.window",
        ),
    ] {
        let e = judge(&l, selector, window).unwrap_err();
        assert!(e.contains(why), "{why}: {e}");
    }
}

/// One ledger serves every pool of the namespace: a fresh reservation counts only in the
/// pool it was made in, whether the pool is counted from a list or from the guard's
/// summary (which names only failing Nodes, so it cannot tell another pool's healthy Node
/// from its own).
#[test]
fn a_reservation_counts_only_in_its_own_pool() {
    let now = Timestamp::now();
    let w = Duration::from_secs(600);
    let nodes = vec![pool_node("a-0", false, None), pool_node("a-1", false, None)];
    let mut listed = PoolSummary::of(&nodes, KEY, w, &now);
    listed.selector = "pool=a".into();
    let mut published = PoolSummary::parse(&listed.annotation().unwrap()).unwrap();
    published.selector = "pool=a".into();
    // a-0 and b-0 reserve a moment apart, each in its own pool; an old agent's entry
    // carries no pool.
    let data = ledger_with(&BTreeMap::new(), "a-0", "pool=a", w, &now);
    let data = ledger_with(&data, "b-0", "pool=b", w, &now);
    let mut data = ledger_with(&data, "b-0", "pool=b", w, &now);
    data.insert("a-1".into(), now.to_string());
    assert!(data["b-0"].ends_with(" pool=b"), "{data:?}");
    for pool in [&listed, &published] {
        // a-0's counts in pool a while in flight; b-0's does not, nor a-1's without a
        // pool while its Node shows no failure.
        assert_eq!(ledger_recent(&data, "me", pool, w, &now), 1, "{data:?}");
    }
    let mut pool_b = published.clone();
    pool_b.selector = "pool=b".into();
    assert_eq!(ledger_recent(&data, "me", &pool_b, w, &now), 1);
}

/// A reservation made after the pool was observed cannot show in that view, however old
/// the view: it counts as in flight from `observed_at` on (a slow pool list once let a
/// 64-node leaf at 5,000 Nodes taint 58 with a cap of 20).
#[test]
fn a_reservation_newer_than_the_view_of_the_pool_counts_however_old_the_view() {
    let now = Timestamp::from_second(3_000_000).unwrap();
    let w = Duration::from_secs(600);
    let nodes = vec![pool_node("a-0", false, None), pool_node("a-1", false, None)];
    let mut pool = PoolSummary::of(&nodes, KEY, w, &now);
    pool.selector = "pool=a".into();
    let ago = |s: i64| Timestamp::from_second(3_000_000 - s).unwrap();
    let data: BTreeMap<String, String> = [
        ("a-0".to_owned(), format!("{} pool=a", ago(45))),
        ("a-1".to_owned(), format!("{} pool=a", ago(100))),
    ]
    .into_iter()
    .collect();
    // Seen now: a-0's reservation is 45 s old and its Node shows no failure: no longer
    // in flight.
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 0);
    // Seen 60 s ago (a slow list): a-0 reserved after that view was taken, a-1 40 s
    // before it: both may be in flight as far as that view can tell.
    pool.observed_at = Some(ago(60));
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 1);
    pool.observed_at = Some(ago(80));
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 2);
    // A view dated in the future (another clock) counts as seen now.
    pool.observed_at = Some(Timestamp::from_second(3_000_100).unwrap());
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 0);
}

/// A pool whose list failed: nothing counted but the ledger's reservations in flight in
/// this pool, so a burst stays capped and anything else taints (fail closed).
#[test]
fn an_unseen_pool_counts_only_the_reservations_in_flight() {
    let now = Timestamp::from_second(4_000_000).unwrap();
    let w = Duration::from_secs(600);
    let pool = PoolSummary::unseen("pool=a", w, now);
    let count = pool.count("me", true);
    assert_eq!(count, PoolCount::default());
    assert_eq!(
        taint_decision(&BreakerSettings::default(), Some(&count), false, ANN),
        TaintDecision::Taint
    );
    let ago = |s: i64| Timestamp::from_second(4_000_000 - s).unwrap();
    let data: BTreeMap<String, String> = [
        ("x".to_owned(), format!("{} pool=a", ago(5))),
        ("y".to_owned(), format!("{} pool=a", ago(10))),
        ("z".to_owned(), format!("{} pool=a", ago(40))),
        ("other".to_owned(), format!("{} pool=b", ago(1))),
        ("old-agent".to_owned(), ago(1).to_string()),
    ]
    .into_iter()
    .collect();
    assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 2);
}

/// The fraction cap is exact under the ledger. Two tainted, three reserved a moment
/// ago (their taints not yet in the guard's summary), a sixth decides: it counts five tainted
/// others, not two, and is held at 6 of 10. A reservation its view already shows tainted
/// counts once; one of another pool, one made before the view for a Node it shows healthy
/// (recovered: the slot is free again), and its own count for nothing.
#[test]
fn the_fraction_counts_the_taints_in_flight_under_the_ledger() {
    let now = Timestamp::from_second(5_000_000).unwrap();
    let ago = |s: i64| Timestamp::from_second(5_000_000 - s).unwrap();
    let w = Duration::from_secs(600);
    let published = json_summary(&["a-0", "a-1"], 10);
    let mut pool = PoolSummary::parse(&published).unwrap();
    pool.observed_at = Some(ago(3));
    let entry = |s: i64, p: &str| format!("{} {p}", ago(s));
    let data: BTreeMap<String, String> = [
        ("a-1".to_owned(), entry(2, "pool=a")),
        ("a-2".to_owned(), entry(2, "pool=a")),
        ("a-3".to_owned(), entry(1, "pool=a")),
        ("a-4".to_owned(), entry(1, "pool=a")),
        ("a-5".to_owned(), entry(1, "pool=a")),
        ("a-6".to_owned(), entry(120, "pool=a")),
        ("b-0".to_owned(), entry(1, "pool=b")),
    ]
    .into_iter()
    .collect();
    let count = pool.count("a-5", true);
    assert_eq!(count.tainted_others, 2, "the summary alone");
    assert_eq!(ledger_in_flight(&data, "a-5", &pool, w, &now), 3);
    let exact = count_with_ledger(count, &data, "a-5", &pool, w, &now);
    assert_eq!(
        exact,
        PoolCount {
            nodes: 10,
            tainted_others: 5,
            new_in_window: 4,
        }
    );
    match decide(&exact) {
        TaintDecision::BreakerOpen { message } => {
            assert!(message.contains("6 of 10"), "{message}");
        }
        TaintDecision::Taint => panic!("the sixth of ten tainted"),
    }
    // The fifth, deciding a moment earlier (a-5's entry not there yet), took the last slot.
    let mut before = data.clone();
    before.remove("a-5");
    let fifth = count_with_ledger(pool.count("a-4", true), &before, "a-4", &pool, w, &now);
    assert_eq!(fifth.tainted_others, 4);
    assert_eq!(decide(&fifth), TaintDecision::Taint);
    // Once the view shows those taints, each counts once.
    let mut later =
        PoolSummary::parse(&json_summary(&["a-0", "a-1", "a-2", "a-3", "a-4"], 10)).unwrap();
    later.observed_at = Some(now);
    let shown = count_with_ledger(later.count("a-5", true), &data, "a-5", &later, w, &now);
    assert_eq!(shown.tainted_others, 5);
}

/// A pool whose list failed has no size to take a fraction of: its reservations in flight
/// count against `max_new_per_window` only (a failed list fails closed, as before).
#[test]
fn an_unseen_pool_keeps_no_fraction_under_the_ledger() {
    let now = Timestamp::from_second(6_000_000).unwrap();
    let w = Duration::from_secs(600);
    let pool = PoolSummary::unseen("pool=a", w, now);
    let data: BTreeMap<String, String> = [
        ("x".to_owned(), format!("{now} pool=a")),
        ("y".to_owned(), format!("{now} pool=a")),
    ]
    .into_iter()
    .collect();
    let exact = count_with_ledger(pool.count("me", true), &data, "me", &pool, w, &now);
    assert_eq!(exact.tainted_others, 0);
    assert_eq!(exact.new_in_window, 2);
    assert_eq!(decide(&exact), TaintDecision::Taint, "20 new a window");
}

#[test]
fn the_ledger_is_skipped_only_where_neither_cap_can_bind() {
    let on = BreakerSettings::default();
    assert!(uses_ledger(&on));
    let fraction_only = BreakerSettings {
        max_new_per_window: 0,
        ..on.clone()
    };
    assert!(uses_ledger(&fraction_only), "the fraction needs it too");
    let neither = BreakerSettings {
        max_unvalidated_fraction: 1.0,
        ..fraction_only
    };
    assert!(!uses_ledger(&neither));
    match contended_decision(20, ANN) {
        TaintDecision::BreakerOpen { message } => {
            assert!(message.contains("stayed contended for 20"), "{message}");
            assert!(message.contains(ANN), "{message}");
        }
        TaintDecision::Taint => panic!("a contended ledger fails safe"),
    }
}

/// The guard's summary of `pool=a`: `nodes` Nodes, `tainted` tainted long ago.
fn json_summary(tainted: &[&str], nodes: u32) -> String {
    let tainted: Vec<String> = tainted.iter().map(|n| format!("{n:?}")).collect();
    format!(
        r#"{{"selector":"pool=a","nodes":{nodes},"windowSeconds":600,"taintedOld":[{}]}}"#,
        tainted.join(",")
    )
}

/// A Node of the pool, untainted, whose `FabricReady` turned `True` at `turned` (seconds).
fn validated_node(name: &str, turned: i64) -> Node {
    use k8s_openapi::api::core::v1::NodeCondition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut node = pool_node(name, false, None);
    if let Some(status) = node.status.as_mut() {
        status.conditions = Some(vec![NodeCondition {
            type_: "FabricReady".into(),
            status: "True".into(),
            last_transition_time: Some(Time(Timestamp::from_second(turned).unwrap())),
            ..NodeCondition::default()
        }]);
    }
    node
}

/// Ten agents started together, each reserving its start-up taint; all validated since. A
/// fresh view shows each of them untainted in a state it turned to after its reservation: none
/// of those reservations is in flight, and a real failure right after is tainted at once. A
/// Node that turned within the same second as its reservation (the condition's time has whole
/// seconds) still counts, and so does one that reserved again after it turned.
#[test]
fn a_reservation_ends_when_a_view_shows_its_node_turned_since() {
    let start = 7_000_000;
    let now = Timestamp::from_second(start + 3).unwrap();
    let w = Duration::from_secs(600);
    let at = |s: i64, ms: i64| {
        Timestamp::from_millisecond(s * 1000 + ms)
            .unwrap()
            .to_string()
    };
    let mut nodes: Vec<Node> = (0..10)
        .map(|i| validated_node(&format!("n{i}"), start + 2))
        .collect();
    let mut data: BTreeMap<String, String> = (0..10)
        .map(|i| (format!("n{i}"), format!("{} pool=a", at(start, 300))))
        .collect();
    let mut view = PoolSummary::of(&nodes, KEY, w, &now);
    view.selector = "pool=a".into();
    view.observed_at = Some(now);
    let count = view.count("n5", true);
    assert_eq!((count.tainted_others, count.new_in_window), (0, 0));
    let exact = count_with_ledger(count, &data, "n5", &view, w, &now);
    assert_eq!(exact, count, "start-up reservations of validated Nodes");
    assert_eq!(decide(&exact), TaintDecision::Taint);

    // The same from the guard's summary of that view, as published and read back.
    let mut published = PoolSummary::parse(&view.annotation().unwrap()).unwrap();
    published.observed_at = Some(now);
    assert_eq!(published.untainted_since.len(), 10);
    assert_eq!(
        count_with_ledger(
            published.count("n5", true),
            &data,
            "n5",
            &published,
            w,
            &now
        ),
        count
    );

    // n1 turned in the same second as its reservation, n2 reserved again after it turned,
    // n3 has no condition yet: all three may still be on their way to the taint.
    nodes[1] = validated_node("n1", start);
    data.insert("n2".into(), format!("{} pool=a", at(start + 2, 500)));
    nodes[3] = pool_node("n3", false, None);
    let mut view = PoolSummary::of(&nodes, KEY, w, &now);
    view.selector = "pool=a".into();
    view.observed_at = Some(now);
    assert_eq!(ledger_in_flight(&data, "n5", &view, w, &now), 3);
    let exact = count_with_ledger(view.count("n5", true), &data, "n5", &view, w, &now);
    assert_eq!((exact.tainted_others, exact.new_in_window), (3, 3));
}

/// The guard's summary lags a burst: it was counted before n3-n5 reserved, and before the guard
/// itself reserved and tainted n2. Every reservation made after it counts whatever it shows,
/// the guard's as the agents': the sixth failing Node of ten is held at exactly one half.
#[test]
fn reservations_newer_than_the_summary_count_whatever_it_shows() {
    let counted = 8_000_000;
    let now = Timestamp::from_second(counted + 4).unwrap();
    let w = Duration::from_secs(600);
    let nodes: Vec<Node> = (0..10)
        .map(|i| {
            if i == 1 {
                pool_node("n1", true, Some(120))
            } else {
                validated_node(&format!("n{i}"), counted - 3600)
            }
        })
        .collect();
    let mut summary = PoolSummary::of(&nodes, KEY, w, &Timestamp::from_second(counted).unwrap());
    summary.selector = "pool=a".into();
    let mut published = PoolSummary::parse(&summary.annotation().unwrap()).unwrap();
    published.observed_at = Some(Timestamp::from_second(counted).unwrap());
    assert!(
        published.untainted_since.is_empty(),
        "old turns are not published"
    );
    let entry = |s: i64| {
        format!(
            "{} pool=a",
            Timestamp::from_millisecond((counted + s) * 1000).unwrap()
        )
    };
    // The guard's reservation of n2, then n3-n5 together, then n6 a second later.
    let mut data = BTreeMap::new();
    let mut tainted = vec![];
    for (node, s) in [("n2", 1), ("n3", 2), ("n4", 2), ("n5", 2), ("n6", 3)] {
        let count = published.count(node, true);
        assert_eq!(count.tainted_others, 1, "the lagging summary shows n1 only");
        let exact = count_with_ledger(count, &data, node, &published, w, &now);
        if decide(&exact) == TaintDecision::Taint {
            data.insert(node.to_owned(), entry(s));
            tainted.push(node);
        }
    }
    assert_eq!(tainted, ["n2", "n3", "n4", "n5"], "5 of 10 with n1");
}

/// Every Node outside a pool is selected by one of the complement's selectors, and none of
/// the pool's: what the guard lists to prove its confinement.
#[test]
fn the_complement_of_a_pool_selects_exactly_the_nodes_outside_it() {
    let pool = "nvidia.com/gpu.present=true,zone in (a,b),!cordoned,team!=infra,rack";
    let complement = selector_complement(pool).unwrap();
    assert_eq!(complement.len(), 5, "{complement:?}");
    let nodes: Vec<BTreeMap<String, String>> = [
        vec![
            ("nvidia.com/gpu.present", "true"),
            ("zone", "a"),
            ("rack", "1"),
        ],
        vec![
            ("nvidia.com/gpu.present", "true"),
            ("zone", "c"),
            ("rack", "1"),
        ],
        vec![
            ("nvidia.com/gpu.present", "false"),
            ("zone", "a"),
            ("rack", "1"),
        ],
        vec![
            ("nvidia.com/gpu.present", "true"),
            ("zone", "b"),
            ("rack", "1"),
            ("cordoned", ""),
        ],
        vec![
            ("nvidia.com/gpu.present", "true"),
            ("zone", "b"),
            ("rack", "1"),
            ("team", "infra"),
        ],
        vec![("nvidia.com/gpu.present", "true"), ("zone", "b")],
        vec![],
    ]
    .into_iter()
    .map(|l| l.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    .collect();
    for labels in &nodes {
        let inside = selector_matches(pool, labels).unwrap();
        let outside = complement
            .iter()
            .any(|c| selector_matches(c, labels).unwrap());
        assert_ne!(inside, outside, "{labels:?} {complement:?}");
    }
    assert_eq!(selector_complement("a in (b"), None);
    assert_eq!(selector_complement(""), Some(vec![]));
}
