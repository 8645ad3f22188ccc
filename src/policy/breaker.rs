//! The blast-radius breaker: the one decision "taint this node now?" ([`taint_decision`]),
//! so that a fleet-wide failure (a bad requirements rollout, a broken agent image) cannot taint
//! a whole pool. Pure: the Node writer reads the pool and the ledger and asks here.

use crate::config::BreakerSettings;
use crate::policy::Verdict;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

/// `reason` of `FabricReady` when the breaker kept the agent from tainting.
pub const BREAKER_OPEN: &str = "BreakerOpen";

/// What the pool (`node.pool_selector`) looks like, counted from one list of its Nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCount {
    /// Nodes in the pool, this one included.
    pub nodes: u32,
    /// Other Nodes of the pool carrying the taint.
    pub tainted_others: u32,
    /// Other Nodes of the pool whose `FabricReady` turned `False` within the window.
    pub new_in_window: u32,
}

/// Count the pool from its Nodes (the state lives on the Nodes, so it survives restarts).
pub fn count_pool(
    nodes: &[Node],
    self_name: &str,
    taint_key: &str,
    window: Duration,
    now: &Timestamp,
) -> PoolCount {
    let mut c = PoolCount::default();
    let mut seen_self = false;
    for n in nodes {
        c.nodes += 1;
        if n.metadata.name.as_deref() == Some(self_name) {
            seen_self = true;
            continue;
        }
        let tainted = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == taint_key));
        if !tainted {
            continue;
        }
        c.tainted_others += 1;
        let fabric = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "FabricReady"));
        let recent = match fabric {
            // Turned not ready within the window.
            Some(c) if c.status == "False" => c.last_transition_time.as_ref().is_some_and(|t| {
                now.duration_since(t.0)
                    .try_into()
                    .is_ok_and(|age: Duration| age <= window)
            }),
            // Tainted while the condition still says ready: a transition in progress (the
            // taint is written before the conditions), so it is new. In a correlated burst
            // most of the others are caught here, between their two writes.
            Some(c) if c.status == "True" => true,
            // No condition yet: registered with the taint, never validated; not a failure.
            _ => false,
        };
        if recent {
            c.new_in_window += 1;
        }
    }
    if !seen_self {
        // Our own Node lacks the pool's labels: count it anyway, it is what we would taint.
        c.nodes += 1;
    }
    c
}

/// `<label_prefix>breaker-override` and whether the Node carries it as `"true"` (the
/// operator's override of the breaker for this one Node).
pub fn breaker_override(node: &Node, label_prefix: &str) -> (String, bool) {
    let annotation = format!("{label_prefix}breaker-override");
    let overridden = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(&annotation))
        .is_some_and(|v| v == "true");
    (annotation, overridden)
}

/// The ConfigMap (in the agent's namespace) where agents reserve their new taints: the
/// ledger of `node.breaker.max_new_per_window`. Agents that fail in the same instant cannot
/// see each other's taints in a list (a burst overshoots the cap by everyone deciding within
/// one list latency); a reservation is a compare-and-swap on this one object, so the cap holds
/// exactly. `data`: node name → RFC 3339 time of its new taint.
///
/// No single agent can forge it: the admission policy `fabricgate-breaker-ledger` lets an
/// agent add or change only the entry of its own token's node claim (the others' may only stay
/// as they are or be dropped), and [`ledger_recent`] counts an entry only while the Node it
/// names itself shows the failure ([`shows_failure`]), or for [`RESERVATION_IN_FLIGHT`] after
/// it was made (the reserving agent writes its taint right after its compare-and-swap).
pub const LEDGER: &str = "fabricgate-breaker";

/// How long a fresh reservation counts although the pool list does not show its Node failing
/// yet: the time between an agent's compare-and-swap and its taint reaching the list (one
/// write, and the watch cache's lag). Only the node itself can write its entry, so this is
/// never more than the one slot every node has anyway (its own taint counts the same).
pub const RESERVATION_IN_FLIGHT: Duration = Duration::from_secs(30);

/// Whether `node` itself shows a failure: our taint, or `FabricReady=False` (from its own
/// agent or the guard). What a ledger entry needs, past its first moments, to count.
pub fn shows_failure(node: &Node, taint_key: &str) -> bool {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == taint_key));
    tainted
        || node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "FabricReady" && c.status == "False")
            })
}

/// The pool as the ledger is judged against: each Node's name and whether it
/// [`shows_failure`].
pub fn ledger_pool<'a>(
    nodes: &'a [Node],
    taint_key: &str,
) -> std::collections::BTreeMap<&'a str, bool> {
    nodes
        .iter()
        .filter_map(|n| {
            n.metadata
                .name
                .as_deref()
                .map(|name| (name, shows_failure(n, taint_key)))
        })
        .collect()
}

/// Entries of the ledger that count against the cap: other than `self_name`, for Nodes in
/// `pool` ([`ledger_pool`]), within `window` of `now`, and either made within
/// [`RESERVATION_IN_FLIGHT`] or for a Node that shows the failure now. A forged entry for a
/// healthy Node, or the entry of a Node that recovered, counts for nothing.
pub fn ledger_recent(
    data: &std::collections::BTreeMap<String, String>,
    self_name: &str,
    pool: &std::collections::BTreeMap<&str, bool>,
    window: Duration,
    now: &Timestamp,
) -> u32 {
    let in_flight = RESERVATION_IN_FLIGHT.min(window);
    let recent = data
        .iter()
        .filter(|(node, _)| node.as_str() != self_name)
        .filter(|(node, at)| match pool.get(node.as_str()) {
            None => false,
            Some(true) => within(at, window, now),
            Some(false) => within(at, in_flight, now),
        })
        .count();
    u32::try_from(recent).unwrap_or(u32::MAX)
}

/// The ledger with entries older than `window` (or unreadable) dropped and `self_name`
/// reserved at `now`. Every other entry is kept as it was: the admission policy admits only
/// that (another node's entry unchanged or gone).
pub fn ledger_with(
    data: &std::collections::BTreeMap<String, String>,
    self_name: &str,
    window: Duration,
    now: &Timestamp,
) -> std::collections::BTreeMap<String, String> {
    let mut out: std::collections::BTreeMap<String, String> = data
        .iter()
        .filter(|(_, at)| within(at, window, now))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.insert(self_name.to_owned(), now.to_string());
    out
}

fn within(at: &str, window: Duration, now: &Timestamp) -> bool {
    at.parse::<Timestamp>().is_ok_and(|t| {
        now.duration_since(t)
            .try_into()
            .is_ok_and(|age: Duration| age <= window)
    })
}

/// The answer to "taint this node now?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaintDecision {
    Taint,
    /// Do not taint; the message says why and how to override.
    BreakerOpen {
        message: String,
    },
}

/// The one place that decides whether a node that is not tainted yet gets the taint: the
/// breaker (with its operator overrides). Untainting never comes here.
pub fn taint_decision(
    settings: &BreakerSettings,
    pool: Option<&PoolCount>,
    overridden: bool,
    override_annotation: &str,
) -> TaintDecision {
    let Some(pool) = pool else {
        return TaintDecision::Taint;
    };
    if !settings.enabled || overridden {
        return TaintDecision::Taint;
    }
    let after = pool.tainted_others + 1;
    let fraction = f64::from(after) / f64::from(pool.nodes.max(1));
    // The first tainted node of a pool is never a fleet-wide failure (and a pool of one node
    // must be able to fail closed).
    let why = if pool.tainted_others > 0 && fraction > settings.max_unvalidated_fraction {
        format!(
            "tainting this node would make {after} of {} nodes of the pool tainted ({:.0}%, \
             above node.breaker.max_unvalidated_fraction {})",
            pool.nodes,
            fraction * 100.0,
            settings.max_unvalidated_fraction
        )
    } else if settings.max_new_per_window > 0
        && pool.new_in_window + 1 > settings.max_new_per_window
    {
        format!(
            "{} nodes of the pool already failed within {} (node.breaker.max_new_per_window {})",
            pool.new_in_window,
            humantime::format_duration(settings.window),
            settings.max_new_per_window
        )
    } else {
        return TaintDecision::Taint;
    };
    TaintDecision::BreakerOpen {
        message: format!(
            "breaker open, not tainting: {why}; a fleet-wide failure is more likely a bad \
             requirements rollout or agent deployment than broken hardware; fix that, or \
             override: annotate the node {override_annotation}=true or set \
             node.breaker.enabled: false"
        ),
    }
}

/// `verdict` as applied while the breaker is open: still not ready (labels, conditions), but
/// without our taint, and `FabricReady`'s reason `BreakerOpen` with what would have tainted it.
pub fn breaker_verdict(verdict: &Verdict, taint_key: &str, message: &str) -> Verdict {
    let mut v = verdict.clone();
    v.taints.retain(|t| t.key != taint_key);
    for c in v.conditions.iter_mut().filter(|c| c.type_ == "FabricReady") {
        c.message = format!("{message}; would taint for {}: {}", c.reason, c.message);
        c.reason = BREAKER_OPEN.to_owned();
    }
    v
}

#[cfg(test)]
mod tests {
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
                        last_transition_time: Some(Time(
                            Timestamp::from_second(now - ago).unwrap(),
                        )),
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
    fn the_ledger_counts_recent_reservations_of_the_pool_and_drops_old_ones() {
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
        let pool: BTreeMap<&str, bool> = [
            ("a", true),
            ("b", true),
            ("c", true),
            ("me", true),
            ("garbage", true),
        ]
        .into_iter()
        .collect();
        let w = Duration::from_secs(600);
        // a and c: b is too old, other-pool is not ours, me is me, garbage is unreadable.
        assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 2);
        let next = ledger_with(&data, "d", w, &now);
        assert!(!next.contains_key("b") && !next.contains_key("garbage"));
        assert_eq!(next.get("d"), Some(&now.to_string()));
        assert!(next.contains_key("a") && next.contains_key("other-pool"));
        // Everyone else's entry is kept byte for byte (the admission policy admits only that).
        for (k, v) in &next {
            assert!(k == "d" || data.get(k) == Some(v), "{k} changed");
        }
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
        let pool = ledger_pool(&nodes, KEY);
        assert_eq!(
            pool.iter().filter(|(_, f)| **f).count(),
            3,
            "failing, condition-only, me: {pool:?}"
        );
        let now = Timestamp::now();
        let at = |ago: i64| {
            Timestamp::from_second(now.as_second() - ago)
                .unwrap()
                .to_string()
        };
        let in_flight = i64::try_from(RESERVATION_IN_FLIGHT.as_secs()).unwrap();
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
    }
}
