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
    /// Untainted Nodes whose `FabricReady` turned within [`RESERVATION_IN_FLIGHT`] of the
    /// count, with that time (seconds since the epoch, the condition's own precision): such a
    /// Node is shown as it was after any reservation made before it turned, so that
    /// reservation is no longer in flight ([`PoolSummary::shown_untainted_after`]). Older
    /// turns are left out: they cannot date a reservation still in flight.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub untainted_since: BTreeMap<String, i64>,
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
            } else {
                if fabric.is_some_and(|c| c.status == "False") {
                    s.not_ready.insert(name.clone());
                }
                let turned = fabric.and_then(|c| c.last_transition_time.as_ref());
                if let Some(t) = turned.filter(|t| within_in_flight(&t.0, window, now)) {
                    s.untainted_since.insert(name.clone(), t.0.as_second());
                }
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

    /// Whether this view shows the Node `name` untainted in a state it turned to after `t`
    /// (its `FabricReady` turned later): a reservation made at `t` was followed by that state,
    /// so its taint is not in flight (it was lifted, or never written). The condition's time
    /// has whole seconds: one in the same second as `t` does not count as later, so a Node
    /// that recovered within a second of its reservation is counted in flight a little longer
    /// rather than too short.
    pub fn shown_untainted_after(&self, name: &str, t: &Timestamp) -> bool {
        !self.shows_taint(name)
            && self
                .untainted_since
                .get(name)
                .and_then(|s| Timestamp::from_second(*s).ok())
                .is_some_and(|turned| turned > *t)
    }

    /// Whether the Node `name` carries our taint, as counted here.
    pub fn shows_taint(&self, name: &str) -> bool {
        self.tainted_new.contains(name) || self.tainted_old.contains(name)
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
    /// [`MAX_PUBLISHED_BYTES`] even without its recent turns.
    pub fn annotation(&self) -> Option<String> {
        let fits = |s: &PoolSummary| {
            serde_json::to_string(s)
                .ok()
                .filter(|text| text.len() <= MAX_PUBLISHED_BYTES)
        };
        fits(self).or_else(|| {
            // Without the recent turns (a fleet-wide start): agents then count the
            // reservations of those Nodes in flight a little longer, never fewer.
            let failures_only = PoolSummary {
                untainted_since: BTreeMap::new(),
                ..self.clone()
            };
            fits(&failures_only)
        })
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

/// Selectors whose Nodes together are every Node `selector` does not select: one per
/// requirement of it, that requirement negated (`k=v` → `k!=v`, `k` → `!k`, `k in (a,b)` →
/// `k notin (a,b)`, and back). `None` when it cannot be read; empty for the empty selector
/// (it selects everything).
pub fn selector_complement(selector: &str) -> Option<Vec<String>> {
    selector_matches(selector, &BTreeMap::new())?;
    let mut requirements = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, ch) in selector.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                requirements.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    requirements.push(&selector[start..]);
    let mut out = Vec::new();
    for r in requirements
        .into_iter()
        .map(str::trim)
        .filter(|r| !r.is_empty())
    {
        let negated = if let Some(key) = r.strip_prefix('!') {
            key.trim().to_owned()
        } else if let Some((k, v)) = r.split_once("!=") {
            format!("{}={}", k.trim(), v.trim())
        } else if let Some((k, v)) = r.split_once("==").or_else(|| r.split_once('=')) {
            format!("{}!={}", k.trim(), v.trim())
        } else if let Some(open) = r.find('(') {
            let mut head = r[..open].split_whitespace();
            let (key, op) = (head.next()?, head.next()?);
            let op = match op {
                "in" => "notin",
                "notin" => "in",
                _ => return None,
            };
            format!("{key} {op} {}", &r[open..])
        } else {
            format!("!{r}")
        };
        out.push(negated);
    }
    Some(out)
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
/// agent add or change only the entry of its own token's node claim (the others' must stay as
/// they are; dropped only past [`LEDGER_PRUNE_AT`] entries), and [`ledger_recent`] counts an entry only while the Node it
/// names itself shows the failure ([`shows_failure`]), or for [`RESERVATION_IN_FLIGHT`] after
/// it was made (the reserving agent writes its taint right after its compare-and-swap).
pub const LEDGER: &str = "fabricgate-breaker";

/// Others' stale entries are pruned only from a ledger holding more than this many (the
/// admission policy admits dropping another node's entry only then: a drop lifts a
/// reservation). One entry per node name that ever reserved, about 100
/// bytes each: far below a ConfigMap's 1 MiB.
pub const LEDGER_PRUNE_AT: usize = 4096;

/// How long a fresh reservation counts at most although the view of the pool does not show
/// its Node failing yet: the time between a compare-and-swap and its taint reaching the view
/// (one write, and the watch cache's lag); a view that shows the Node as it turned after the
/// reservation ends it sooner. Only the node itself (or the guard's leader, for a Node whose
/// agent is gone) writes its entry, so this is never more than the one slot every node has
/// anyway (its own taint counts the same).
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
/// shows the failure now ([`PoolSummary::shows_failure`]) or in flight: made in this pool
/// (`pool.selector`) at most [`RESERVATION_IN_FLIGHT`] before `pool` was observed
/// (`observed_at`, else `now`), and not followed by a state `pool` shows
/// ([`PoolSummary::shown_untainted_after`]). A reservation counts until a view newer than it
/// shows its Node: tainted (then as a taint), or untainted again; a view older than the taint
/// that follows it cannot show it yet, however old the view (a guard's summary between
/// renewals, a pool list that takes tens of seconds at 5,000 Nodes). A forged entry for a
/// healthy Node, or the entry of a Node that recovered, counts for nothing past that.
pub fn ledger_recent(
    data: &BTreeMap<String, String>,
    self_name: &str,
    pool: &PoolSummary,
    window: Duration,
    now: &Timestamp,
) -> u32 {
    let in_flight_since = in_flight_since(pool, window, now);
    let in_flight = |node: &str, entry: &str| {
        entry_time(entry)
            .is_some_and(|t| t >= in_flight_since && !pool.shown_untainted_after(node, &t))
    };
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
                Some(false) => ours && within(entry, window, now) && in_flight(node, entry),
            }
        })
        .count();
    u32::try_from(recent).unwrap_or(u32::MAX)
}

/// Reservations made since this time may not show in `pool` yet: [`RESERVATION_IN_FLIGHT`]
/// (at most the window) before the pool was observed (`observed_at`, else `now`).
fn in_flight_since(pool: &PoolSummary, window: Duration, now: &Timestamp) -> Timestamp {
    let in_flight = RESERVATION_IN_FLIGHT.min(window);
    let observed = pool.observed_at.filter(|t| t < now).unwrap_or(*now);
    observed
        .checked_sub(k8s_openapi::jiff::SignedDuration::try_from(in_flight).unwrap_or_default())
        .unwrap_or(observed)
}

/// Others' reservations that `pool` cannot show as taints yet: made in this pool
/// (`pool.selector`) within `window` and in flight (at most [`RESERVATION_IN_FLIGHT`] before
/// `pool` was observed), for a Node of the pool that it shows neither tainted nor untainted
/// in a state it turned to after the reservation ([`PoolSummary::shown_untainted_after`]).
/// Their agents taint right after their compare-and-swap: these are the pool's taints of the
/// last seconds, which a summary or a list taken before them cannot count; a view that shows
/// such a Node recovered (or never tainted) since does not count it again.
pub fn ledger_in_flight(
    data: &BTreeMap<String, String>,
    self_name: &str,
    pool: &PoolSummary,
    window: Duration,
    now: &Timestamp,
) -> u32 {
    let since = in_flight_since(pool, window, now);
    let in_flight = data
        .iter()
        .filter(|(node, _)| node.as_str() != self_name)
        .filter(|(node, _)| !pool.shows_taint(node) && pool.shows_failure(node).is_some())
        .filter(|(node, entry)| {
            entry_pool(entry) == Some(pool.selector.as_str())
                && within(entry, window, now)
                && entry_time(entry)
                    .is_some_and(|t| t >= since && !pool.shown_untainted_after(node, &t))
        })
        .count();
    u32::try_from(in_flight).unwrap_or(u32::MAX)
}

/// What the breaker of `self_name` counts under the ledger's compare-and-swap: `count` (the
/// pool as `pool` shows it) with what only the ledger knows yet. Reservations in flight
/// ([`ledger_in_flight`]) are Nodes tainted now, so the fraction cap counts them: two agents
/// can never both take its last slot, however stale `pool` is. [`ledger_recent`] raises the
/// newly failing ones (`max_new_per_window`). A pool that could not be seen (its list failed:
/// no Node counted) has no fraction to keep; only `max_new_per_window` binds there.
pub fn count_with_ledger(
    count: PoolCount,
    data: &BTreeMap<String, String>,
    self_name: &str,
    pool: &PoolSummary,
    window: Duration,
    now: &Timestamp,
) -> PoolCount {
    let in_flight = if pool.nodes == 0 {
        0
    } else {
        ledger_in_flight(data, self_name, pool, window, now)
    };
    PoolCount {
        tainted_others: count.tainted_others.saturating_add(in_flight),
        new_in_window: count
            .new_in_window
            .max(ledger_recent(data, self_name, pool, window, now)),
        ..count
    }
}

/// Whether a decision goes through the ledger: it keeps both caps exact, so it is skipped only
/// when neither can bind (no `max_new_per_window`, a `max_unvalidated_fraction` of 1 or more).
pub fn uses_ledger(settings: &BreakerSettings) -> bool {
    settings.max_new_per_window > 0 || settings.max_unvalidated_fraction < 1.0
}

/// The ledger with `self_name` reserved at `now` in the pool `pool_selector`. Every other
/// entry is kept as it was (the admission policy admits only that), except that a ledger of
/// more than [`LEDGER_PRUNE_AT`] entries drops those older than `window` (or unreadable).
pub fn ledger_with(
    data: &BTreeMap<String, String>,
    self_name: &str,
    pool_selector: &str,
    window: Duration,
    now: &Timestamp,
) -> BTreeMap<String, String> {
    let prune = data.len() > LEDGER_PRUNE_AT;
    let mut out: BTreeMap<String, String> = data
        .iter()
        .filter(|(_, at)| !prune || within(at, window, now))
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

/// Whether `t` is recent enough to date a reservation still in flight at `now`.
fn within_in_flight(t: &Timestamp, window: Duration, now: &Timestamp) -> bool {
    let in_flight = RESERVATION_IN_FLIGHT.min(window);
    now.duration_since(*t)
        .try_into()
        .is_ok_and(|age: Duration| age <= in_flight)
        || *t > *now
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

/// The answer when the ledger stayed contended for `rounds` compare-and-swaps: hold back (a
/// burst that large is what the breaker is for).
pub fn contended_decision(rounds: u32, override_annotation: &str) -> TaintDecision {
    TaintDecision::BreakerOpen {
        message: format!(
            "breaker open, not tainting: the ledger ConfigMap {LEDGER} stayed contended for \
             {rounds} compare-and-swaps (a burst of failures in the pool); a fleet-wide failure \
             is more likely a bad requirements rollout or agent deployment than broken \
             hardware; fix that, or override: annotate the node {override_annotation}=true or \
             set node.breaker.enabled: false"
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
mod tests;
