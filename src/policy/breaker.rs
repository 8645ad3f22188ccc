//! The blast-radius breaker: the one decision "taint this node now?" ([`taint_decision`]),
//! so that a fleet-wide failure (a bad requirements rollout, a broken agent image) cannot taint
//! a whole pool. Pure: the Node writer reads the pool and the ledger and asks here.

use crate::config::BreakerSettings;
use crate::policy::Verdict;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// `reason` of `FabricReady` when the breaker kept the agent from tainting.
pub const BREAKER_OPEN: &str = "BreakerOpen";

/// What the pool (`node.pool_selector`) looks like to the breaker of one Node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCount {
    /// Nodes in the pool, this one included.
    pub nodes: u32,
    /// Other Nodes of the pool carrying the taint.
    pub tainted_others: u32,
    /// Other Nodes of the pool whose `FabricReady` turned `False` within the window.
    pub new_in_window: u32,
}

/// The pool as the breaker reads it: its size, and by name the Nodes that show a failure,
/// sorted by how the breaker counts them. Its size does not grow with the pool, only with its
/// failures: the guard's leader, which watches the pool anyway, publishes it on its Lease
/// ([`PoolSummary::annotation`]) so that a newly failing agent reads one small object instead
/// of listing thousands of Nodes. Made from a list of the pool's Nodes ([`PoolSummary::of`]),
/// it also knows every member by name.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSummary {
    /// The pool's label selector (`node.pool_selector`) it counted.
    #[serde(default)]
    pub selector: String,
    /// Nodes in the pool.
    pub nodes: u32,
    /// `node.breaker.window` it was counted with, in seconds.
    pub window_seconds: u64,
    /// Tainted, and turned not ready within the window (or tainted while `FabricReady` is
    /// still `True`: a transition in progress, the taint is written before the conditions).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub tainted_new: BTreeSet<String>,
    /// Tainted earlier, or registered with the taint and never validated (no condition).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub tainted_old: BTreeSet<String>,
    /// `FabricReady=False` without our taint (held by the breaker, or the guard's condition
    /// written before its taint).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub not_ready: BTreeSet<String>,
    /// Every member's name, when made from a list (not published: it grows with the pool).
    #[serde(skip)]
    members: Option<BTreeSet<String>>,
    /// When the Nodes were seen as counted here (the list's request, the guard's renewal):
    /// a reservation made after it, or shortly before, cannot show in it yet.
    #[serde(skip)]
    pub observed_at: Option<Timestamp>,
}

/// Largest summary the guard publishes: annotations of one object may hold 256 KiB in all.
/// Names only, so this holds the failures of a pool of several thousand Nodes; past it the
/// guard publishes nothing and the agents list the pool.
pub const MAX_PUBLISHED_BYTES: usize = 200 * 1024;

impl PoolSummary {
    /// Count the pool from its Nodes (the state lives on the Nodes, so it survives restarts).
    pub fn of<'a>(
        nodes: impl IntoIterator<Item = &'a Node>,
        taint_key: &str,
        window: Duration,
        now: &Timestamp,
    ) -> Self {
        let mut s = PoolSummary {
            window_seconds: window.as_secs(),
            members: Some(BTreeSet::new()),
            ..PoolSummary::default()
        };
        for n in nodes {
            s.nodes = s.nodes.saturating_add(1);
            let Some(name) = n.metadata.name.clone() else {
                continue;
            };
            let tainted = has_taint(n, taint_key);
            let fabric = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "FabricReady"));
            if tainted {
                let recent = match fabric {
                    // Turned not ready within the window.
                    Some(c) if c.status == "False" => {
                        c.last_transition_time.as_ref().is_some_and(|t| {
                            now.duration_since(t.0)
                                .try_into()
                                .is_ok_and(|age: Duration| age <= window)
                        })
                    }
                    // Tainted while the condition still says ready: a transition in progress
                    // (the taint is written before the conditions), so it is new. In a
                    // correlated burst most of the others are caught here, between their two
                    // writes.
                    Some(c) if c.status == "True" => true,
                    // No condition yet: registered with the taint, never validated; not a
                    // failure.
                    _ => false,
                };
                if recent {
                    s.tainted_new.insert(name.clone());
                } else {
                    s.tainted_old.insert(name.clone());
                }
            } else if fabric.is_some_and(|c| c.status == "False") {
                s.not_ready.insert(name.clone());
            }
            if let Some(m) = s.members.as_mut() {
                m.insert(name);
            }
        }
        s
    }

    /// A pool that could not be seen (its list failed): no Node counted, none known to fail;
    /// only the ledger's reservations in flight (made in `selector`) count against the cap.
    pub fn unseen(selector: &str, window: Duration, at: Timestamp) -> Self {
        PoolSummary {
            selector: selector.to_owned(),
            window_seconds: window.as_secs(),
            observed_at: Some(at),
            ..PoolSummary::default()
        }
    }

    /// What the breaker of `self_name` counts; `self_in_pool`: whether that Node is one of
    /// [`PoolSummary::nodes`] (one that lacks the pool's labels is counted anyway: it is
    /// what the breaker would taint).
    pub fn count(&self, self_name: &str, self_in_pool: bool) -> PoolCount {
        let others = |set: &BTreeSet<String>| {
            let n = set.iter().filter(|n| n.as_str() != self_name).count();
            u32::try_from(n).unwrap_or(u32::MAX)
        };
        let new = others(&self.tainted_new);
        PoolCount {
            nodes: self.nodes.saturating_add(u32::from(!self_in_pool)),
            tainted_others: new.saturating_add(others(&self.tainted_old)),
            new_in_window: new,
        }
    }

    /// Whether the Node `name` shows a failure ([`shows_failure`]): `None` when it is not in
    /// the pool. A published summary names only failures, so to it every other Node is a
    /// member that does not show one.
    pub fn shows_failure(&self, name: &str) -> Option<bool> {
        if self.tainted_new.contains(name)
            || self.tainted_old.contains(name)
            || self.not_ready.contains(name)
        {
            return Some(true);
        }
        match &self.members {
            Some(members) => members.contains(name).then_some(false),
            None => Some(false),
        }
    }

    /// Whether `name` is one of the Nodes counted (a published summary cannot tell for a
    /// Node that shows no failure: `None`).
    pub fn has_member(&self, name: &str) -> Option<bool> {
        match &self.members {
            Some(members) => Some(members.contains(name)),
            None => self.shows_failure(name).filter(|f| *f),
        }
    }

    /// The summary as the guard publishes it (JSON), or `None` when it is larger than
    /// [`MAX_PUBLISHED_BYTES`].
    pub fn annotation(&self) -> Option<String> {
        serde_json::to_string(self)
            .ok()
            .filter(|s| s.len() <= MAX_PUBLISHED_BYTES)
    }

    /// Read a published summary.
    ///
    /// # Errors
    /// What is wrong with `text` (not JSON, or not this shape).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// `<label_prefix>pool`: the annotation of the guard's Lease that holds its [`PoolSummary`].
pub fn pool_annotation(label_prefix: &str) -> String {
    format!("{label_prefix}pool")
}

/// The pool summary the guard's leader published on `lease`, if it is one to decide from:
/// the Lease is held and renewed within its duration (a dead guard's summary goes stale with
/// it), and the summary was counted over this agent's pool selector and `window`. `Err` says why not (the agent
/// then lists the pool).
///
/// # Errors
/// Why the Lease holds no summary to use, for the agent's log.
pub fn published_summary(
    lease: &Lease,
    label_prefix: &str,
    pool_selector: &str,
    window: Duration,
    now: &Timestamp,
) -> Result<PoolSummary, String> {
    let name = lease.metadata.name.as_deref().unwrap_or("?");
    let spec = lease.spec.as_ref();
    if spec
        .and_then(|s| s.holder_identity.as_deref())
        .is_none_or(str::is_empty)
    {
        return Err(format!("the guard's Lease {name} has no holder"));
    }
    let duration = spec
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|d| u64::try_from(d).ok())
        .map_or(Duration::ZERO, Duration::from_secs);
    let renewed = spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0);
    // Either way of the clock: an agent whose clock runs ahead or behind the guard's by more
    // than the Lease duration lists the pool rather than trust what it cannot date.
    let fresh = renewed.is_some_and(|t| {
        let age = now.duration_since(t).unsigned_abs();
        age <= duration
    });
    if !fresh {
        return Err(format!(
            "the guard's Lease {name} was not renewed within its duration ({}s)",
            duration.as_secs()
        ));
    }
    let key = pool_annotation(label_prefix);
    let Some(text) = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(&key))
    else {
        return Err(format!(
            "the guard's Lease {name} has no {key} annotation (its leader has not counted the \
             pool yet, or the pool's failures are too many to publish)"
        ));
    };
    let mut summary = PoolSummary::parse(text)
        .map_err(|e| format!("the guard's Lease {name}: {key} is not a pool summary: {e}"))?;
    summary.observed_at = renewed;
    if summary.selector != pool_selector {
        return Err(format!(
            "the guard counted the pool {:?}, this agent's node.pool_selector is {:?}; give \
             both the same requirements",
            summary.selector, pool_selector
        ));
    }
    if summary.window_seconds != window.as_secs() {
        return Err(format!(
            "the guard counted the pool with node.breaker.window {}s, this agent's is {}s; \
             give both the same requirements",
            summary.window_seconds,
            window.as_secs()
        ));
    }
    Ok(summary)
}

fn has_taint(node: &Node, taint_key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == taint_key))
}

/// Count the pool from its Nodes, one of which may be `self_name`.
pub fn count_pool(
    nodes: &[Node],
    self_name: &str,
    taint_key: &str,
    window: Duration,
    now: &Timestamp,
) -> PoolCount {
    let s = PoolSummary::of(nodes, taint_key, window, now);
    let seen_self = s.has_member(self_name) == Some(true);
    s.count(self_name, seen_self)
}

/// Whether `labels` match the label selector `selector` (the syntax of `kubectl -l`:
/// `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, joined by commas);
/// `None` when it cannot be read.
pub fn selector_matches(selector: &str, labels: &BTreeMap<String, String>) -> Option<bool> {
    let mut requirements = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (i, ch) in selector.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                requirements.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return None;
    }
    requirements.push(&selector[start..]);
    let mut all = true;
    for r in requirements {
        let r = r.trim();
        if r.is_empty() {
            continue;
        }
        all &= requirement_matches(r, labels)?;
    }
    Some(all)
}

fn requirement_matches(r: &str, labels: &BTreeMap<String, String>) -> Option<bool> {
    let valid_key = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    };
    if let Some(key) = r.strip_prefix('!') {
        let key = key.trim();
        return valid_key(key).then(|| !labels.contains_key(key));
    }
    for (op, negate) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((k, v)) = r.split_once(op) {
            let (k, v) = (k.trim(), v.trim());
            if !valid_key(k) {
                return None;
            }
            let equal = labels.get(k).is_some_and(|have| have == v);
            return Some(equal != negate);
        }
    }
    if let Some(open) = r.find('(') {
        let close = r.rfind(')')?;
        let mut head = r[..open].split_whitespace();
        let (key, op) = (head.next()?, head.next()?);
        if head.next().is_some() || !valid_key(key) || !r[close + 1..].trim().is_empty() {
            return None;
        }
        let values: BTreeSet<&str> = r[open + 1..close].split(',').map(str::trim).collect();
        let have = labels.get(key).map(String::as_str);
        return match op {
            "in" => Some(have.is_some_and(|v| values.contains(v))),
            "notin" => Some(have.is_none_or(|v| !values.contains(v))),
            _ => None,
        };
    }
    valid_key(r).then(|| labels.contains_key(r))
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
/// exactly. `data`: node name → RFC 3339 time of its new taint, a space, and the pool's
/// selector (`node.pool_selector`): one ledger serves every pool of the namespace, and a
/// reservation counts only in its own pool (an entry without a selector, from an agent before
/// it, counts only once its Node shows the failure).
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
    has_taint(node, taint_key)
        || node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "FabricReady" && c.status == "False")
            })
}

/// Entries of the ledger that count against the cap: other than `self_name`, for Nodes of
/// `pool`, not made in another pool, within `window` of `now`, and either for a Node that
/// shows the failure now ([`PoolSummary::shows_failure`]) or made in this pool
/// (`pool.selector`) at most [`RESERVATION_IN_FLIGHT`] before `pool` was observed
/// (`observed_at`, else `now`): a view of the pool older than that cannot show the taint that
/// follows such a reservation yet (at 5,000 Nodes a pool list takes tens of seconds). A forged
/// entry for a healthy Node, or the entry of a Node that recovered, counts for nothing.
pub fn ledger_recent(
    data: &BTreeMap<String, String>,
    self_name: &str,
    pool: &PoolSummary,
    window: Duration,
    now: &Timestamp,
) -> u32 {
    let in_flight = RESERVATION_IN_FLIGHT.min(window);
    let observed = pool.observed_at.filter(|t| t < now).unwrap_or(*now);
    let in_flight_since = observed
        .checked_sub(k8s_openapi::jiff::SignedDuration::try_from(in_flight).unwrap_or_default())
        .unwrap_or(observed);
    let recent = data
        .iter()
        .filter(|(node, _)| node.as_str() != self_name)
        .filter(|(node, entry)| {
            let ours = match entry_pool(entry) {
                Some(p) if p != pool.selector => return false,
                Some(_) => true,
                None => false,
            };
            match pool.shows_failure(node) {
                None => false,
                Some(true) => within(entry, window, now),
                // In flight: only a reservation made in this pool (a summary cannot tell
                // another pool's healthy Node from its own).
                Some(false) => {
                    ours && within(entry, window, now)
                        && entry_time(entry).is_some_and(|t| t >= in_flight_since)
                }
            }
        })
        .count();
    u32::try_from(recent).unwrap_or(u32::MAX)
}

/// The ledger with entries older than `window` (or unreadable) dropped and `self_name`
/// reserved at `now` in the pool `pool_selector`. Every other entry is kept as it was: the
/// admission policy admits only that (another node's entry unchanged or gone).
pub fn ledger_with(
    data: &BTreeMap<String, String>,
    self_name: &str,
    pool_selector: &str,
    window: Duration,
    now: &Timestamp,
) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = data
        .iter()
        .filter(|(_, at)| within(at, window, now))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.insert(self_name.to_owned(), format!("{now} {pool_selector}"));
    out
}

/// The pool selector a ledger entry was made in (`None`: an entry without one).
fn entry_pool(entry: &str) -> Option<&str> {
    entry.split_once(' ').map(|(_, pool)| pool)
}

/// The time a ledger entry was made.
fn entry_time(entry: &str) -> Option<Timestamp> {
    let at = entry.split_once(' ').map_or(entry, |(at, _)| at);
    at.parse::<Timestamp>().ok()
}

fn within(entry: &str, window: Duration, now: &Timestamp) -> bool {
    entry_time(entry).is_some_and(|t| {
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
        assert!(!next.contains_key("b") && !next.contains_key("garbage"));
        assert_eq!(next.get("d"), Some(&format!("{now} pool=a")));
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
}
