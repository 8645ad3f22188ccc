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
pub const LEDGER: &str = "fabricgate-breaker";

/// Entries of the ledger, other than `self_name`, for Nodes in `pool` and within `window` of
/// `now`.
pub fn ledger_recent(
    data: &std::collections::BTreeMap<String, String>,
    self_name: &str,
    pool: &std::collections::BTreeSet<&str>,
    window: Duration,
    now: &Timestamp,
) -> u32 {
    let recent = data
        .iter()
        .filter(|(node, _)| node.as_str() != self_name && pool.contains(node.as_str()))
        .filter(|(_, at)| within(at, window, now))
        .count();
    u32::try_from(recent).unwrap_or(u32::MAX)
}

/// The ledger with entries older than `window` (or unreadable) dropped and `self_name`
/// reserved at `now`.
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
        let pool: std::collections::BTreeSet<&str> =
            ["a", "b", "c", "me", "garbage"].into_iter().collect();
        let w = Duration::from_secs(600);
        // a and c: b is too old, other-pool is not ours, me is me, garbage is unreadable.
        assert_eq!(ledger_recent(&data, "me", &pool, w, &now), 2);
        let next = ledger_with(&data, "d", w, &now);
        assert!(!next.contains_key("b") && !next.contains_key("garbage"));
        assert_eq!(next.get("d"), Some(&now.to_string()));
        assert!(next.contains_key("a") && next.contains_key("other-pool"));
    }
}
