//! What should happen to one Workload, without API calls: from the Workload, the cached Nodes
//! and ResourceFlavors, its FabricCheck in flight and the answers to it, the clock and the
//! settings, a [`Plan`] that `reconcile.rs` carries out against the API.

use super::decide::{self, Assigned, list, node_problem};
use super::model::{self, WorkloadStatus};
use super::objects::answers;
use super::ring::{RingOutcome, assess_ring};
use super::state::State;
use super::watch::Stores;
use super::{CheckSettings, RESERVATION_ANNOTATION};
use crate::gang::fabriccheck::{self, CheckSpec, ENDPOINT_ANNOTATION, Member, WorkloadRef};
use crate::gang::settings::{Escalation, GangSettings};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// Our entries of a Workload that are `Pending` under a quota reservation.
#[derive(Debug)]
pub(super) struct PendingCheck {
    pub status: WorkloadStatus,
    /// Our AdmissionChecks' names whose entry is `Pending`.
    pub entries: Vec<String>,
    /// How many times Kueue moved those entries to `Retry` before (the most of them).
    pub retry_count: u32,
    /// The quota reservation (the `QuotaReserved` condition's transition time).
    pub reservation: String,
}

/// Our entries of `wl` to move on, or `None`: no entry of one of `ours` is `Pending`, or its
/// quota is not reserved (or is being released).
pub(super) fn pending_check(wl: &DynamicObject, ours: &BTreeSet<String>) -> Option<PendingCheck> {
    let status: WorkloadStatus =
        serde_json::from_value(wl.data.get("status").cloned().unwrap_or(Value::Null))
            .unwrap_or_default();
    let entries: Vec<String> = status
        .admission_checks
        .iter()
        .filter(|c| c.state == "Pending" && ours.contains(&c.name))
        .map(|c| c.name.clone())
        .collect();
    if entries.is_empty() {
        return None;
    }
    let retry_count = status
        .admission_checks
        .iter()
        .filter(|c| entries.contains(&c.name))
        .filter_map(|c| c.retry_count)
        .max()
        .map_or(0, |n| u32::try_from(n).unwrap_or(0));
    let reservation = status.reservation()?.to_owned();
    Some(PendingCheck {
        status,
        entries,
        retry_count,
        reservation,
    })
}

/// A state for our entries of one Workload.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Decision {
    /// `Ready`, `Retry` or `Rejected`.
    pub state: &'static str,
    pub message: String,
    pub failed_pairs: usize,
    /// `requeueAfterSeconds` of a `Retry`.
    pub requeue_after: Option<u32>,
}

impl Decision {
    pub(super) fn retry(message: String) -> Self {
        Self {
            state: "Retry",
            message,
            failed_pairs: 0,
            requeue_after: None,
        }
    }

    fn ready(message: String) -> Self {
        Self {
            state: "Ready",
            message,
            failed_pairs: 0,
            requeue_after: None,
        }
    }

    /// A `Retry` of a Workload whose check was retried `retry_count` times before: with
    /// `gang.retry_backoff` doubled per earlier retry as `requeueAfterSeconds`, or `Rejected`
    /// once `gang.max_attempts` failures are reached.
    pub(super) fn escalate(mut self, retry_count: u32, gang: &GangSettings) -> Self {
        if self.state != "Retry" {
            return self;
        }
        match gang.escalate(retry_count) {
            Escalation::Retry {
                after_secs,
                attempt,
            } => {
                self.requeue_after = Some(after_secs);
                self.message = format!(
                    "{}; attempt {attempt} of gang.max_attempts {}: Kueue reserves again in \
                     {after_secs} s at the earliest",
                    self.message, gang.max_attempts
                );
            }
            Escalation::Reject { attempt } => {
                self.state = "Rejected";
                self.message = format!(
                    "the gang pre-flight failed {attempt} times (gang.max_attempts {}): \
                     rejected; last failure: {}",
                    gang.max_attempts, self.message
                );
            }
        }
        self
    }
}

/// What to do about one Workload whose check of ours is pending.
#[derive(Debug)]
pub(super) struct Plan {
    /// A FabricCheck of the Workload's name left from an earlier reservation, other nodes or
    /// an earlier Workload of that name: deleted (with its answers) before the action.
    pub stale: Option<Arc<DynamicObject>>,
    pub action: Action,
}

#[derive(Debug)]
pub(super) enum Action {
    /// A state was written over the Workload's version the store still shows (the write's
    /// echo has not arrived): nothing to do.
    AlreadyWritten,
    /// The check in flight is past its deadline with answers missing from the cache (which
    /// keeps only answers to checks it knew of when they arrived): list its answers in the
    /// API and decide again with them.
    ListAnswers(Arc<DynamicObject>),
    /// The check in flight waits for answers: decide again after this long at the latest.
    Wait(Duration),
    /// Start the gang's pre-flight: create this FabricCheck.
    Create { name: String, spec: CheckSpec },
    /// Write this state on our entries (no FabricCheck involved).
    Write(Decision),
    /// Write this state on our entries, then delete the FabricCheck it judged.
    Conclude(Decision, Arc<DynamicObject>),
}

/// What a decision about one Workload reads.
pub(super) struct Facts<'a> {
    pub wl: &'a DynamicObject,
    pub pending: &'a PendingCheck,
    /// The leader's stores (Nodes, FabricChecks and their answers, ResourceFlavors).
    pub stores: &'a Stores,
    /// The pool's Nodes, as the Node store held them at the start of the pass.
    pub pool: &'a [Arc<Node>],
    pub settings: &'a CheckSettings,
    pub now: Timestamp,
}

/// What should happen to the Workload of `f` next. `listed`: the answers to its check in
/// flight as the API lists them, after [`Action::ListAnswers`]. `state` is read, and its
/// memo of checks' members (`same_members`) kept.
pub(super) fn next(
    f: &Facts<'_>,
    state: &mut State,
    listed: Option<Vec<Arc<DynamicObject>>>,
) -> Plan {
    let uid = f.wl.uid().unwrap_or_default();
    let rv = f.wl.resource_version().unwrap_or_default();
    if state.decided.get(&uid) == Some(&rv) {
        return Plan {
            stale: None,
            action: Action::AlreadyWritten,
        };
    }
    let gang_ns = &f.settings.gang.namespace;
    let fc_name = model::fabric_check_name(
        &f.wl.namespace().unwrap_or_default(),
        &f.wl.name_any(),
        &uid,
    );
    let existing = f
        .stores
        .checks
        .get(&ObjectRef::new_with(&fc_name, fabriccheck::checks()).within(gang_ns))
        .filter(|fc| !state.deleted.contains(&fc.uid().unwrap_or_default()));
    let mut stale = None;
    if let Some(fc) = existing {
        let spec: CheckSpec = serde_json::from_value(fc.data["spec"].clone()).unwrap_or_default();
        if same_check(f, state, &fc, &spec) {
            let fc_uid = fc.uid().unwrap_or_default();
            if asks_every_member(&fc, &spec) || state.made.contains_key(&fc_uid) {
                return Plan {
                    stale: None,
                    action: in_flight(f, fc, &spec, listed),
                };
            }
            // Left half-made by a leader that stopped between creating it and labelling it
            // for its members: no agent was asked, so it is made again, with a whole
            // gang.timeout (its deadline, in the immutable spec, was running out meanwhile).
            tracing::info!(check = %fc.name_any(), uid = %fc_uid,
                "a FabricCheck whose members were never asked (its maker stopped before \
                 labelling it) is made again");
        }
        // Left from an earlier reservation or an earlier Workload of that name, or half-made.
        stale = Some(fc);
    }
    let action = match prepare(f) {
        Ok(Prepared::Decided(d)) => {
            Action::Write(d.escalate(f.pending.retry_count, &f.settings.gang))
        }
        Ok(Prepared::Ring(spec)) => Action::Create {
            name: fc_name,
            spec,
        },
        Err(d) => Action::Write(d.escalate(f.pending.retry_count, &f.settings.gang)),
    };
    Plan { stale, action }
}

/// Whether `fc` tests this Workload's reservation on its nodes: the same Workload, the same
/// reservation, and the same nodes. A reservation's time is only to the second, so a gang
/// placed again within it on other nodes would otherwise be released on the old nodes'
/// answers.
fn same_check(f: &Facts<'_>, state: &mut State, fc: &DynamicObject, spec: &CheckSpec) -> bool {
    let uid = f.wl.uid().unwrap_or_default();
    let rv = f.wl.resource_version().unwrap_or_default();
    if spec.workload.uid != uid
        || fc.annotations().get(RESERVATION_ANNOTATION) != Some(&f.pending.reservation)
    {
        return false;
    }
    let fc_uid = fc.uid().unwrap_or_default();
    match state.same_members.get(&fc_uid) {
        Some((at, same)) if *at == rv => *same,
        _ => {
            let same = same_members(spec, &f.pending.status, f.pool);
            state.same_members.insert(fc_uid, (rv, same));
            same
        }
    }
}

/// Whether `fc` is labelled for each of its members' watches: its maker finished it, and the
/// agents were asked.
fn asks_every_member(fc: &DynamicObject, spec: &CheckSpec) -> bool {
    let labels = fc.labels();
    spec.members.iter().all(|m| {
        labels
            .get(&fabriccheck::member_label(&m.node))
            .is_some_and(|v| v == "true")
    })
}

/// The check in flight `fc`: wait for its answers, look them up in the API once past its
/// deadline, or conclude it.
fn in_flight(
    f: &Facts<'_>,
    fc: Arc<DynamicObject>,
    spec: &CheckSpec,
    listed: Option<Vec<Arc<DynamicObject>>>,
) -> Action {
    let gang = &f.settings.gang;
    let deadline: Option<Timestamp> = spec.deadline.parse().ok();
    let grace = SignedDuration::try_from(f.settings.grace()).unwrap_or_default();
    let decide_at = deadline.and_then(|d| d.checked_add(grace).ok());
    let past = decide_at.is_none_or(|t| f.now >= t);
    let from_api = listed.is_some();
    let results = answers(
        listed.unwrap_or_else(|| f.stores.results.state()),
        &fc,
        spec,
    );
    if past && results.len() < spec.members.len() && !from_api {
        // Before a member counts as silent, its answer is looked for once in the API.
        return Action::ListAnswers(fc);
    }
    let outcome = assess_ring(spec, &results, past, gang.require_rdma, gang.timeout);
    // A member that stopped being validated while its agents measured (its agent saw a port
    // go down, the guard found it gone) fails the check whatever the answers say.
    let outcome = match member_problems(spec, f) {
        Some(message) => RingOutcome::Failed {
            message,
            failed_pairs: 0,
        },
        None => outcome,
    };
    let decision = match outcome {
        RingOutcome::Waiting => {
            let wait = decide_at
                .and_then(|t| Duration::try_from(t.duration_since(f.now)).ok())
                .unwrap_or(Duration::ZERO);
            return Action::Wait(wait);
        }
        RingOutcome::Passed(m) => Decision::ready(m),
        RingOutcome::Failed {
            message,
            failed_pairs,
        } => Decision {
            failed_pairs,
            ..Decision::retry(message)
        },
    };
    Action::Conclude(decision.escalate(f.pending.retry_count, gang), fc)
}

/// Why members of `spec` are not validated now (a message for `Retry`), or `None`.
fn member_problems(spec: &CheckSpec, f: &Facts<'_>) -> Option<String> {
    let prefix = &f.settings.config.node.label_prefix;
    let taint = f.settings.config.node.taint_key();
    let problems: Vec<String> = spec
        .members
        .iter()
        .filter_map(|m| match f.stores.nodes.get(&ObjectRef::new(&m.node)) {
            Some(node) => node_problem(&node, prefix, &taint),
            None => Some(format!("{}: the Node is gone", m.node)),
        })
        .collect();
    (!problems.is_empty()).then(|| {
        format!(
            "{} of {} members are no longer validated during the gang pre-flight: {}",
            problems.len(),
            spec.members.len(),
            list(&problems)
        )
    })
}

/// Whether `spec`'s members are exactly the Nodes the Workload is assigned now.
fn same_members(spec: &CheckSpec, status: &WorkloadStatus, nodes: &[Arc<Node>]) -> bool {
    let Ok(assigned) = decide::assigned_nodes(status, nodes.iter().map(AsRef::as_ref)) else {
        return false;
    };
    let members: BTreeSet<&str> = spec.members.iter().map(|m| m.node.as_str()).collect();
    let now: BTreeSet<&str> = assigned.nodes.iter().map(String::as_str).collect();
    members == now && members.len() == spec.members.len()
}

enum Prepared {
    Decided(Decision),
    Ring(CheckSpec),
}

/// Before any measurement: the Nodes given, each validated now, each with a peers endpoint.
fn prepare(f: &Facts<'_>) -> Result<Prepared, Decision> {
    let s = f.settings;
    let prefix = &s.config.node.label_prefix;
    let taint = s.config.node.taint_key();
    let assigned: Assigned =
        decide::assigned_nodes(&f.pending.status, f.pool.iter().map(AsRef::as_ref))
            .map_err(Decision::retry)?;
    let by_name: BTreeMap<&str, &Node> = f
        .pool
        .iter()
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n.as_ref())))
        .collect();
    // Without a topology assignment there are no nodes to ring-test: not Ready unless the
    // operator allows node validation alone.
    if s.gang.require_topology
        && let Some(message) = untopological_refusal(&assigned)
    {
        return Err(Decision::retry(message));
    }
    let mut notes = Vec::new();
    for (podset, flavors, count) in &assigned.untopological {
        notes.push(flavor_nodes(f, podset, flavors, *count)?);
    }
    let gang = &assigned.nodes;
    if gang.len() > s.gang.max_nodes {
        return Err(Decision {
            state: "Rejected",
            ..Decision::retry(format!(
                "the gang has {} nodes, more than gang.max_nodes ({}): the pre-flight cannot \
                 run on it; raise gang.max_nodes or split the job",
                gang.len(),
                s.gang.max_nodes
            ))
        });
    }
    let problems: Vec<String> = gang
        .iter()
        .filter_map(|n| {
            by_name
                .get(n.as_str())
                .and_then(|node| node_problem(node, prefix, &taint))
        })
        .collect();
    if !problems.is_empty() {
        return Err(Decision::retry(format!(
            "{} of {} assigned nodes are not validated now: {}",
            problems.len(),
            gang.len(),
            list(&problems)
        )));
    }
    if gang.len() < 2 {
        let mut message = match gang.first() {
            Some(n) => format!("the one assigned node {n} is validated; no pair to test"),
            None => "no topology assignment (Kueue Topology Aware Scheduling is not used for \
                     this Workload): only node validation can be checked, the gang RDMA \
                     pre-flight did not run"
                .to_owned(),
        };
        for n in notes {
            message.push_str("; ");
            message.push_str(&n);
        }
        return Ok(Prepared::Decided(Decision::ready(message)));
    }
    let members = ring_members(gang, &by_name, s.config.peers.port())?;
    Ok(Prepared::Ring(CheckSpec {
        workload: WorkloadRef {
            namespace: f.wl.namespace().unwrap_or_default(),
            name: f.wl.name_any(),
            uid: f.wl.uid().unwrap_or_default(),
        },
        members,
        min_bandwidth_gbps: s.gang.min_bandwidth_gbps,
        max_rtt_micros: s.gang.max_rtt_micros,
        deadline: deadline_after(f.now, s.gang.timeout),
    }))
}

/// The ring's members, in the gang's order, each with the peers endpoint its Node publishes
/// (one of its own addresses at `port`) and the ports its responder may give; a `Retry`
/// naming the Nodes without one.
fn ring_members(
    gang: &[String],
    by_name: &BTreeMap<&str, &Node>,
    port: u16,
) -> Result<Vec<Member>, Decision> {
    let mut members = Vec::with_capacity(gang.len());
    let mut no_endpoint = Vec::new();
    let mut foreign = Vec::new();
    for n in gang {
        let node = by_name.get(n.as_str());
        let endpoint = node
            .and_then(|node| node.metadata.annotations.as_ref())
            .and_then(|a| a.get(ENDPOINT_ANNOTATION))
            .filter(|e| !e.trim().is_empty());
        match (endpoint, node) {
            (Some(e), Some(node)) => match decide::own_endpoint(node, e, port) {
                Some(endpoint) => members.push(Member {
                    node: n.clone(),
                    endpoint,
                    // The ports its responder may give (its own agent's word).
                    gids: node
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(fabriccheck::GIDS_ANNOTATION))
                        .map(|v| fabriccheck::gids_entries(v))
                        .unwrap_or_default(),
                }),
                None => foreign.push(n.clone()),
            },
            _ => no_endpoint.push(n.clone()),
        }
    }
    if !no_endpoint.is_empty() {
        return Err(Decision::retry(format!(
            "{} assigned nodes publish no peers endpoint (Node annotation \
             {ENDPOINT_ANNOTATION}, written by the agent with peers enabled): {}",
            no_endpoint.len(),
            list(&no_endpoint)
        )));
    }
    // The annotation is written by whoever may patch the Node: the pre-flight dials only an
    // address of the Node itself at the configured port, and the value is never quoted into
    // the Workload's status.
    if !foreign.is_empty() {
        return Err(Decision::retry(format!(
            "{} assigned nodes publish a peers endpoint (Node annotation \
             {ENDPOINT_ANNOTATION}) that is not one of the Node's status.addresses at the \
             peers port {port}: {}",
            foreign.len(),
            list(&foreign)
        )));
    }
    Ok(members)
}

/// With `gang.require_topology`: why the admission cannot be ring-tested (pod sets without a
/// topology assignment, or none with nodes), or `None`.
fn untopological_refusal(assigned: &Assigned) -> Option<String> {
    let names: Vec<&str> = assigned
        .untopological
        .iter()
        .map(|(name, _, _)| name.as_str())
        .collect();
    if names.is_empty() && !assigned.nodes.is_empty() {
        return None;
    }
    let which = match names.as_slice() {
        [] => "the admission has no pod set with a topology assignment".to_owned(),
        [one] => format!("pod set {one} has no topology assignment"),
        _ => format!(
            "{} pod sets have no topology assignment ({})",
            names.len(),
            list(&names)
        ),
    };
    Some(format!(
        "{which}: Kueue Topology Aware Scheduling did not place it, so its nodes are not \
         known and the gang RDMA pre-flight cannot run; gang.require_topology is true. Give \
         the ClusterQueue a ResourceFlavor with a topologyName (and the job a topology \
         request), or set gang.require_topology: false to admit such pod sets on node \
         validation alone"
    ))
}

/// Without a topology assignment: at least `count` Nodes of the pod set's flavors (all their
/// `nodeLabels`) are validated (its pods can land only on validated ones, the readiness
/// affinity keeps them off the others). A note for the message, or a `Retry`.
fn flavor_nodes(
    f: &Facts<'_>,
    podset: &str,
    flavors: &BTreeSet<String>,
    count: i64,
) -> Result<String, Decision> {
    let mut labels = BTreeMap::new();
    for name in flavors {
        let flavor = f
            .stores
            .flavors
            .get(&ObjectRef::new_with(name, model::resource_flavors()))
            .ok_or_else(|| {
                Decision::retry(format!("pod set {podset}: ResourceFlavor {name} not found"))
            })?;
        if let Some(m) = flavor.data["spec"]["nodeLabels"].as_object() {
            for (k, v) in m {
                labels.insert(k.clone(), v.as_str().unwrap_or_default().to_owned());
            }
        }
    }
    let prefix = &f.settings.config.node.label_prefix;
    let taint = f.settings.config.node.taint_key();
    let of_flavor: Vec<&Node> = f
        .pool
        .iter()
        .map(AsRef::as_ref)
        .filter(|n| decide::has_labels(n, &labels))
        .collect();
    let problems: Vec<String> = of_flavor
        .iter()
        .filter_map(|n| node_problem(n, prefix, &taint))
        .collect();
    let good = of_flavor.len() - problems.len();
    let flavor_names: Vec<&String> = flavors.iter().collect();
    if i64::try_from(good).unwrap_or(i64::MAX) < count {
        let mut message = format!(
            "no topology assignment for pod set {podset}: only node validation can be \
             checked; {good} of the {} nodes of flavor {} are validated, {count} pods need \
             them",
            of_flavor.len(),
            list(&flavor_names)
        );
        if !problems.is_empty() {
            message.push_str(": ");
            message.push_str(&list(&problems));
        }
        return Err(Decision::retry(message));
    }
    Ok(format!(
        "pod set {podset}: no topology assignment, only node validation checked ({good} of \
         {} nodes of flavor {} validated for {count} pods; the gang RDMA pre-flight did not run)",
        of_flavor.len(),
        list(&flavor_names)
    ))
}

/// `timeout` after `now`, rounded up to a whole second (RFC 3339).
pub(super) fn deadline_after(now: Timestamp, timeout: Duration) -> String {
    let secs = now
        .as_second()
        .saturating_add(i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX / 2))
        .saturating_add(i64::from(
            timeout.subsec_nanos() > 0 || now.subsec_nanosecond() > 0,
        ));
    Timestamp::from_second(secs).map_or_else(|_| now.to_string(), |t| t.to_string())
}
