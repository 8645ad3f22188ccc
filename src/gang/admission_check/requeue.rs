//! After admission, without API calls: a Workload whose check of ours is `Ready`
//! and whose quota is still reserved is watched; a member Node that stops being validated
//! (or is gone), or a member pod whose agent found it on sockets (the pod condition
//! `fabricgate.io/TransportReady=False`, reason `SocketsFallback`), for `gang.requeue_grace`
//! turns the check `Retry`: Kueue evicts the gang whole and queues it again. The breaker
//! (`gang.max_requeues_per_window` per `gang.requeue_window`) holds the rest of a fleet-wide
//! event. Read from the stores only: no request while nothing is wrong.

use super::decide::{list, node_problem};
use super::model::{HOSTNAME_LABEL, WorkloadStatus};
pub(super) use super::model::{TRANSPORT_CONDITION, WORKLOAD_ANNOTATION};
use super::state::State;
use super::step::Decision;
use crate::gang::settings::GangSettings;
use crate::transport::verdict::is_sockets_reason;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Our entries of an admitted Workload, all `Ready`, its quota reserved.
#[derive(Debug)]
pub(super) struct AdmittedCheck {
    pub status: WorkloadStatus,
    pub entries: Vec<String>,
    /// Kueue's `retryCount` of our entries (the most of them): `gang.max_attempts` applies.
    pub retry_count: u32,
}

/// `wl`'s entries of `ours` when every one of them is `Ready` under a quota reservation
/// (not being evicted, not finished); `None` otherwise.
pub(super) fn admitted_check(wl: &DynamicObject, ours: &BTreeSet<String>) -> Option<AdmittedCheck> {
    let status: WorkloadStatus =
        serde_json::from_value(wl.data.get("status").cloned().unwrap_or(Value::Null))
            .unwrap_or_default();
    let mine: Vec<_> = status
        .admission_checks
        .iter()
        .filter(|c| ours.contains(&c.name))
        .collect();
    if mine.is_empty() || mine.iter().any(|c| c.state != "Ready") {
        return None;
    }
    let finished = status
        .condition("Finished")
        .is_some_and(|c| c.status == "True");
    if finished || wl.data["spec"]["active"] == Value::Bool(false) {
        return None;
    }
    status.reservation()?;
    let entries = mine.iter().map(|c| c.name.clone()).collect();
    let retry_count = mine
        .iter()
        .filter_map(|c| c.retry_count)
        .max()
        .map_or(0, |n| u32::try_from(n).unwrap_or(0));
    Some(AdmittedCheck {
        status,
        entries,
        retry_count,
    })
}

/// One bad member: its key in the grace memo, and what the check's message says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Cause {
    pub key: String,
    pub message: String,
}

/// The pods of the admitted Workloads, by Workload (Kueue's annotation) and by controller
/// owner (a Job's pods without TAS carry no annotation; the Workload shares their owner).
#[derive(Default)]
pub(super) struct PodIndex {
    by_workload: HashMap<(String, String), Vec<Arc<Pod>>>,
    by_owner: HashMap<String, Vec<Arc<Pod>>>,
}

impl PodIndex {
    pub(super) fn new(pods: Vec<Arc<Pod>>) -> Self {
        let mut index = Self::default();
        for pod in pods {
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let ns = pod.namespace().unwrap_or_default();
            if let Some(name) = pod.annotations().get(WORKLOAD_ANNOTATION) {
                index
                    .by_workload
                    .entry((ns, name.clone()))
                    .or_default()
                    .push(Arc::clone(&pod));
            } else if let Some(owner) = controller_uid(pod.owner_references()) {
                index.by_owner.entry(owner).or_default().push(pod);
            }
        }
        index
    }

    /// The live pods of `wl`.
    fn of(&self, wl: &DynamicObject) -> Vec<&Arc<Pod>> {
        let key = (wl.namespace().unwrap_or_default(), wl.name_any());
        let mut out: Vec<&Arc<Pod>> = self.by_workload.get(&key).into_iter().flatten().collect();
        if let Some(owner) = controller_uid(wl.owner_references()) {
            out.extend(
                self.by_owner
                    .get(&owner)
                    .into_iter()
                    .flatten()
                    .filter(|p| p.namespace() == wl.namespace()),
            );
        }
        out
    }
}

fn controller_uid(
    refs: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference],
) -> Option<String> {
    refs.iter()
        .find(|r| r.controller == Some(true))
        .map(|r| r.uid.clone())
}

/// What a judgement of one admitted Workload reads.
pub(super) struct Members<'a> {
    pub wl: &'a DynamicObject,
    pub admitted: &'a AdmittedCheck,
    /// A Node by its name, from the Node store.
    pub node: &'a dyn Fn(&str) -> Option<Arc<Node>>,
    /// The pool's Nodes (for a domain whose hostname is not a Node's name).
    pub pool: &'a [Arc<Node>],
    pub pods: &'a PodIndex,
    pub label_prefix: &'a str,
    pub taint_key: &'a str,
}

/// The Workload's member Nodes (its topology assignment's hostnames, and the nodes its pods
/// are bound to: a pod set without TAS has only those) and its member pods that are bad now.
pub(super) fn causes(m: &Members<'_>) -> Vec<Cause> {
    let pods = m.pods.of(m.wl);
    let mut hosts = assigned_hosts(&m.admitted.status);
    hosts.extend(
        pods.iter()
            .filter_map(|p| p.spec.as_ref()?.node_name.clone()),
    );
    let mut out = Vec::new();
    for host in hosts {
        let node = (m.node)(&host).or_else(|| {
            m.pool
                .iter()
                .find(|n| n.labels().get(HOSTNAME_LABEL) == Some(&host))
                .cloned()
        });
        let message = match node {
            Some(n) => node_problem(&n, m.label_prefix, m.taint_key),
            None => Some(format!("{host}: the Node is gone")),
        };
        if let Some(message) = message {
            out.push(Cause {
                key: format!("node/{host}"),
                message,
            });
        }
    }
    for pod in pods {
        let on_sockets = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == TRANSPORT_CONDITION))
            .filter(|c| c.status == "False" && c.reason.as_deref().is_some_and(is_sockets_reason));
        if let Some(c) = on_sockets {
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .unwrap_or("no node");
            out.push(Cause {
                key: format!("pod/{}", pod.uid().unwrap_or_else(|| pod.name_any())),
                message: format!(
                    "pod {}/{} on {node}: {TRANSPORT_CONDITION}=False ({}: {})",
                    pod.namespace().unwrap_or_default(),
                    pod.name_any(),
                    c.reason.as_deref().unwrap_or_default(),
                    crate::text::truncate(c.message.as_deref().unwrap_or(""), 256)
                ),
            });
        }
    }
    out
}

/// The hostnames of every pod set's topology assignment whose lowest level is the hostname
/// (sorted, once each); a malformed assignment gives none (its pods' nodes still count).
fn assigned_hosts(status: &WorkloadStatus) -> BTreeSet<String> {
    let mut hosts = BTreeSet::new();
    let psas = status.admission.iter().flat_map(|a| &a.pod_set_assignments);
    for ta in psas.filter_map(|p| p.topology_assignment.as_ref()) {
        if ta.levels.last().map(String::as_str) != Some(HOSTNAME_LABEL) {
            continue;
        }
        for domain in ta.domains().unwrap_or_default() {
            if let Some(h) = domain.get(HOSTNAME_LABEL) {
                hosts.insert(h.clone());
            }
        }
    }
    hosts
}

/// What to do about an admitted Workload.
#[derive(Debug, PartialEq)]
pub(super) enum Verdict {
    /// Nothing bad.
    Healthy,
    /// Something bad for less than the grace: look again after this long at the latest.
    Waiting(Duration),
    /// Bad past the grace: this state (`Retry`, or `Rejected` at `gang.max_attempts`).
    Requeue(Decision),
}

/// The verdict on the Workload `uid` with `causes` now; `state.bad_since` keeps when each
/// cause was first seen (a cause gone is forgotten: a flap shorter than the grace is nothing).
pub(super) fn judge(
    uid: &str,
    causes: &[Cause],
    retry_count: u32,
    state: &mut State,
    now: Instant,
    gang: &GangSettings,
) -> Verdict {
    state
        .bad_since
        .retain(|(u, key), _| u != uid || causes.iter().any(|c| &c.key == key));
    if causes.is_empty() {
        return Verdict::Healthy;
    }
    let grace = gang.requeue_grace;
    let mut due = Vec::new();
    let mut wait = grace;
    for c in causes {
        let since = *state
            .bad_since
            .entry((uid.to_owned(), c.key.clone()))
            .or_insert(now);
        let bad_for = now.saturating_duration_since(since);
        if bad_for >= grace {
            due.push(format!(
                "{} (for {:.1} s)",
                c.message,
                bad_for.as_secs_f64()
            ));
        } else {
            wait = wait.min(grace - bad_for);
        }
    }
    if due.is_empty() {
        return Verdict::Waiting(wait);
    }
    let message = format!(
        "admitted gang requeued: {} member{} bad for longer than gang.requeue_grace {}: {}",
        due.len(),
        if due.len() == 1 { " is" } else { "s are" },
        humantime::format_duration(grace),
        list(&due)
    );
    Verdict::Requeue(Decision::retry(message).escalate(retry_count, gang))
}

use super::state::age;
pub use super::state::{RequeueEntry, RequeueLedger, requeues_annotation};

/// Whether one more admitted gang of `namespace` may be requeued (or rejected) now: `Ok`
/// (counted in `ledger`), or the breaker's `BreakerOpen` message and when to ask again. Two
/// limits per `gang.requeue_window`: `gang.max_requeues_per_window` in all, and
/// `gang.max_requeues_per_namespace` in one namespace, so that one tenant cannot spend every
/// other tenant's requeues.
pub(super) fn breaker(
    ledger: &mut RequeueLedger,
    namespace: &str,
    now: Timestamp,
    gang: &GangSettings,
) -> Result<(), (String, Duration)> {
    let window = gang.requeue_window;
    ledger.forget_past(now, window);
    let max = usize::try_from(gang.max_requeues_per_window).unwrap_or(usize::MAX);
    let per_namespace = usize::try_from(gang.max_requeues_per_namespace).unwrap_or(usize::MAX);
    let mine: Vec<Timestamp> = ledger
        .requeues
        .iter()
        .filter(|e| e.namespace == namespace)
        .map(|e| e.at)
        .collect();
    let namespace_full = per_namespace > 0 && mine.len() >= per_namespace;
    if ledger.requeues.len() < max && !namespace_full {
        ledger.requeues.push(RequeueEntry {
            namespace: namespace.to_owned(),
            at: now,
        });
        return Ok(());
    }
    let oldest = |ats: &mut dyn Iterator<Item = Timestamp>| {
        ats.min()
            .map_or(window, |t| window.saturating_sub(age(t, now)))
    };
    let (count, limit, reopen) = if ledger.requeues.len() >= max {
        (
            format!(
                "{} admitted gangs already requeued within {} (gang.max_requeues_per_window {})",
                ledger.requeues.len(),
                humantime::format_duration(window),
                gang.max_requeues_per_window
            ),
            "gang.max_requeues_per_window",
            oldest(&mut ledger.requeues.iter().map(|e| e.at)),
        )
    } else {
        (
            format!(
                "{} admitted gangs of namespace {namespace} already requeued within {} \
                 (gang.max_requeues_per_namespace {})",
                mine.len(),
                humantime::format_duration(window),
                gang.max_requeues_per_namespace
            ),
            "gang.max_requeues_per_namespace",
            oldest(&mut mine.iter().copied()),
        )
    };
    Err((
        format!(
            "BreakerOpen: breaker open, not requeueing: {count}; a fleet-wide failure is more \
             likely a bad requirements rollout or agent deployment than broken hardware; fix \
             that, or raise {limit}, or set gang.after_admission: ignore; the next requeue is \
             allowed in {} s",
            reopen.as_secs()
        ),
        reopen,
    ))
}

/// Whether the breaker is open now (the window full), for the metric.
pub(super) fn breaker_open(ledger: &RequeueLedger, now: Timestamp, gang: &GangSettings) -> bool {
    let recent = ledger
        .requeues
        .iter()
        .filter(|e| age(e.at, now) < gang.requeue_window)
        .count();
    recent >= usize::try_from(gang.max_requeues_per_window).unwrap_or(usize::MAX)
}
