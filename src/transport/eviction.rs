//! Which pods on sockets `fabricgate guard` evicts now (`runtime.on_sockets: evict`).
//! Pure: the pods as the guard's cache holds them, the settings, the ledger of its recent
//! evictions and the time in; a [`Plan`] out. The guard's evictor does the API work.
//!
//! A pod is due when its condition `fabricgate.io/TransportReady` (written by its node's
//! agent) is `False` with reason `SocketsFallback` and has been so for `runtime.evict_after`,
//! it runs on a Node of the pool (`node.pool_selector`: the agents run only there), it is not
//! terminating, and the guard has not evicted it already. The blast-radius breaker's
//! `node.breaker.max_new_per_window` caps the evictions within `node.breaker.window` (a fleet
//! on sockets at once is more likely a broken fabric or a bad rollout than broken jobs:
//! evicting all of them would only restart them into the same fault); `node.breaker.enabled:
//! false` or a cap of 0 lifts it. `max_unvalidated_fraction` is about Nodes and does not apply.

use crate::config::BreakerSettings;
use crate::transport::settings::{OnSockets, RuntimeSettings};
use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Duration;

/// The pod condition the agents write.
pub const TRANSPORT_READY: &str = "fabricgate.io/TransportReady";
/// Reason of the condition on sockets ([`crate::transport::verdict::REASON_SOCKETS`]).
pub use crate::transport::verdict::REASON_SOCKETS as SOCKETS_FALLBACK;
/// Reason of the guard's Event on a pod it evicted (the agent's own Event is
/// `TransportFallback`).
pub const EVICTED: &str = "TransportFallbackEvicted";
/// Reason of the guard's Event on a due pod it did not evict (a PodDisruptionBudget refused,
/// or the breaker held it back): once per pod and cause.
pub const NOT_EVICTED: &str = "TransportFallbackNotEvicted";

/// Most entries the ledger keeps (when no cap bounds it): the newest.
pub const LEDGER_MAX: usize = 1000;

/// The guard's evictions within the breaker's window, newest last: what counts against the
/// cap, and which pods (by UID) it already evicted. The leader publishes it on its Lease
/// (annotation `<label_prefix>evictions`) so that the next leader keeps the same count.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Ledger {
    pub entries: Vec<LedgerEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerEntry {
    /// When the Eviction was admitted.
    pub at: Timestamp,
    /// `namespace/name`, for a person reading the Lease.
    pub pod: String,
    pub uid: String,
}

fn age(now: &Timestamp, then: &Timestamp) -> Option<Duration> {
    now.duration_since(*then).try_into().ok()
}

impl Ledger {
    /// Evictions within `window` of `now` (one dated in the future counts: a clock step back
    /// must not reopen the cap).
    pub fn recent(&self, window: Duration, now: &Timestamp) -> usize {
        self.entries
            .iter()
            .filter(|e| age(now, &e.at).is_none_or(|a| a <= window))
            .count()
    }

    pub fn evicted(&self, uid: &str) -> bool {
        self.entries.iter().any(|e| e.uid == uid)
    }

    /// Add an eviction, and drop those past `window` (beyond [`LEDGER_MAX`], the oldest).
    pub fn record(&mut self, entry: LedgerEntry, window: Duration) {
        let now = entry.at;
        self.entries.push(entry);
        self.entries
            .retain(|e| age(&now, &e.at).is_none_or(|a| a <= window));
        self.entries.sort_by_key(|e| e.at);
        let over = self.entries.len().saturating_sub(LEDGER_MAX);
        self.entries.drain(..over);
    }

    /// When the oldest eviction within the window leaves it (the cap then has room again).
    fn room_at(&self, window: Duration, now: &Timestamp) -> Option<Timestamp> {
        let span = SignedDuration::try_from(window).ok()?;
        self.entries
            .iter()
            .filter(|e| age(now, &e.at).is_none_or(|a| a <= window))
            .map(|e| e.at)
            .min()
            .and_then(|t| t.checked_add(span).ok())
    }

    /// The ledger as the Lease annotation holds it (JSON).
    pub fn annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{\"entries\":[]}".to_owned())
    }

    /// # Errors
    /// What is wrong with `text` (not JSON, or not this shape).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// `<label_prefix>evictions`: the annotation of the guard's Lease that holds its [`Ledger`].
pub fn ledger_annotation(label_prefix: &str) -> String {
    format!("{label_prefix}evictions")
}

/// The pod's `fabricgate.io/TransportReady` condition when it says sockets (`False`,
/// `SocketsFallback` or `SocketsBesideIdleQueuePairs`).
pub fn sockets_condition(pod: &Pod) -> Option<&PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == TRANSPORT_READY)
        .filter(|c| {
            c.status == "False"
                && c.reason
                    .as_deref()
                    .is_some_and(crate::transport::verdict::is_sockets_reason)
        })
}

/// A due pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// Since when it is on sockets: the condition's `lastTransitionTime`, or when the guard
    /// first saw it so (none given, or one in the future of the guard's clock).
    pub since: Timestamp,
    /// The condition's message (the agent's facts: "0 data-path QPs; 41.0 GB over TCP ...").
    pub message: String,
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Evict these, in this order (longest on sockets first).
    pub evict: Vec<Candidate>,
    /// Due, but held back by the breaker.
    pub held: Vec<Candidate>,
    /// Why the breaker holds them (`None` when it holds none).
    pub held_because: Option<String>,
    /// When to decide again: the next pod that turns due, or the cap's next room.
    pub next: Option<Timestamp>,
}

/// What [`plan`] decides with besides the pods.
pub struct Inputs<'a> {
    pub runtime: &'a RuntimeSettings,
    pub breaker: &'a BreakerSettings,
    pub ledger: &'a Ledger,
    /// Whether a Node (the pod's `spec.nodeName`) is one of the pool's.
    pub in_pool: &'a dyn Fn(&str) -> bool,
    /// When the guard first saw each pod (by UID) on sockets.
    pub first_seen: &'a HashMap<String, Timestamp>,
    /// Pods (by UID) not to try before a later time (a PodDisruptionBudget refused, a failed
    /// request): neither evicted nor held now.
    pub waiting: &'a dyn Fn(&str) -> bool,
    pub now: Timestamp,
}

/// The pods of `pods` to evict now, those the breaker holds back, and when to look again.
pub fn plan<'a>(pods: impl IntoIterator<Item = &'a Pod>, i: &Inputs<'_>) -> Plan {
    let mut out = Plan::default();
    if i.runtime.on_sockets != OnSockets::Evict {
        return out;
    }
    let after = SignedDuration::try_from(i.runtime.evict_after).unwrap_or(SignedDuration::MAX);
    let mut due = Vec::new();
    for pod in pods {
        let Some(c) = candidate(pod, i) else { continue };
        match c.since.checked_add(after) {
            Ok(at) if at > i.now => {
                out.next = Some(out.next.map_or(at, |n| n.min(at)));
            }
            _ if (i.waiting)(&c.uid) => {}
            _ => due.push(c),
        }
    }
    due.sort_by(|a, b| (a.since, &a.namespace, &a.name).cmp(&(b.since, &b.namespace, &b.name)));
    let cap = i.breaker.max_new_per_window;
    if !i.breaker.enabled || cap == 0 {
        out.evict = due;
        return out;
    }
    let recent = i.ledger.recent(i.breaker.window, &i.now);
    let room = usize::try_from(cap)
        .unwrap_or(usize::MAX)
        .saturating_sub(recent);
    if due.len() > room {
        out.held = due.split_off(room);
        out.held_because = Some(format!(
            "the guard evicted {recent} pods on sockets within {} (node.breaker.max_new_per_window \
             {cap}); a fleet on sockets at once is more likely a broken fabric or a bad rollout \
             than broken jobs; fix that, or lift the cap: node.breaker.enabled: false",
            humantime::format_duration(i.breaker.window)
        ));
        if let Some(at) = i.ledger.room_at(i.breaker.window, &i.now) {
            out.next = Some(out.next.map_or(at, |n| n.min(at)));
        }
    }
    out.evict = due;
    out
}

/// `pod` as a candidate: on sockets, in the pool, not terminating, not evicted already.
fn candidate(pod: &Pod, i: &Inputs<'_>) -> Option<Candidate> {
    let meta = &pod.metadata;
    if meta.deletion_timestamp.is_some() {
        return None;
    }
    let uid = meta.uid.clone().filter(|u| !u.is_empty())?;
    if i.ledger.evicted(&uid) {
        return None;
    }
    let node = pod.spec.as_ref()?.node_name.as_deref()?;
    if !(i.in_pool)(node) {
        return None;
    }
    let c = sockets_condition(pod)?;
    let seen = i.first_seen.get(&uid).copied().unwrap_or(i.now);
    let since = c
        .last_transition_time
        .as_ref()
        .map(|t| t.0)
        .filter(|t| *t <= i.now)
        .unwrap_or(seen);
    Some(Candidate {
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        uid,
        since,
        message: c.message.clone().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests;
