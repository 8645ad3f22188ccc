//! What the leader remembers between passes (dropped when leadership changes: everything
//! durable is in the API objects, the requeue breaker's count on the Lease). Read by the decisions (`step.rs`), kept by the passes
//! (`reconcile.rs`) and the FabricCheck objects' upkeep (`objects.rs`).

use k8s_openapi::jiff::Timestamp;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use std::time::Instant;

#[derive(Default)]
pub(super) struct State {
    /// Workload uid -> the resourceVersion a state was written over: skipped while the
    /// store still shows that version (the write's echo has not arrived).
    pub(super) decided: HashMap<String, String>,
    /// FabricChecks deleted (by uid), treated as gone while the store still shows them.
    pub(super) deleted: HashSet<String>,
    /// FabricChecks this leader finished making (uid -> when): in flight even while a store
    /// lagging behind the label patch shows them without their member labels. One neither
    /// here nor labelled for its members was left half-made by a leader that died making it.
    pub(super) made: HashMap<String, Instant>,
    /// (Workload uid, reservation) -> when a pass first saw its check Pending.
    pub(super) first_seen: HashMap<(String, String), Instant>,
    /// FabricCheck uid -> (the Workload's resourceVersion, whether the check's members are
    /// its assigned nodes at that version): matching domains to Nodes once per version, not
    /// on every pass while the check is in flight.
    pub(super) same_members: HashMap<String, (String, bool)>,
    /// (Workload uid, cause: `node/<name>` or `pod/<uid>`) -> when a pass first saw that
    /// member of an admitted gang bad (`requeue.rs`). A new leader starts the grace afresh:
    /// a requeue later, never earlier.
    pub(super) bad_since: HashMap<(String, String), Instant>,
    /// The admitted gangs requeued (or rejected) within `gang.requeue_window`: the requeue
    /// breaker's count, published on the Lease and read back by each new leader (`None`
    /// until read: no requeue meanwhile).
    pub(super) requeues: Option<RequeueLedger>,
    /// The count changed since it was last published.
    pub(super) requeues_changed: bool,
    /// Workload uids held by the breaker and reported (their Event recorded once).
    pub(super) held: HashSet<String>,
}

/// The requeue breaker's count: each admitted gang requeued (or rejected) within
/// `gang.requeue_window`, by namespace and time. It rides on the controller's Lease
/// ([`requeues_annotation`]) so that a new leader goes on counting where the last one
/// stopped: a failover never resets the window.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequeueLedger {
    #[serde(default)]
    pub requeues: Vec<RequeueEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequeueEntry {
    /// The Workload's namespace.
    pub namespace: String,
    pub at: Timestamp,
}

/// `<label_prefix>requeues`: the annotation of the admission check's Lease that holds its
/// [`RequeueLedger`].
pub fn requeues_annotation(label_prefix: &str) -> String {
    format!("{label_prefix}requeues")
}

impl RequeueLedger {
    /// The ledger as published.
    pub fn annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{\"requeues\":[]}".to_owned())
    }

    /// # Errors
    /// What is wrong with `text` (not JSON, or not this shape).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Drop the entries past `window` (a clock far ahead of `now` counts as now).
    pub(super) fn forget_past(&mut self, now: Timestamp, window: Duration) {
        self.requeues.retain(|e| age(e.at, now) < window);
    }
}

pub(super) fn age(at: Timestamp, now: Timestamp) -> Duration {
    now.duration_since(at).try_into().unwrap_or(Duration::ZERO)
}
