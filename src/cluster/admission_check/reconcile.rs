//! One pass of the leader over its stores: AdmissionChecks kept `Active`, every Workload whose
//! check of ours is `Pending` after quota reservation moved on (nodes judged, FabricCheck
//! created, its answers collected, state written), stale FabricChecks and answers deleted.

use super::decide::{self, Assigned, Verdict, judge, list, node_problem};
use super::model::{self, WorkloadStatus};
use super::objects::{answers, cleanup, create_check, delete_check, listed_answers};
use super::watch::Watched;
use super::{CONTROLLER_NAME, CheckMetrics, CheckSettings, FIELD_MANAGER, RESERVATION_ANNOTATION};
use crate::error::{Error, Result};
use crate::node::fabriccheck::{self, CheckSpec, ENDPOINT_ANNOTATION, Member, WorkloadRef};
use crate::text::truncate;
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the leader remembers between passes (dropped when leadership changes: everything
/// durable is in the API objects).
#[derive(Default)]
pub(super) struct State {
    /// Workload uid -> the resourceVersion a state was written over: skipped while the
    /// store still shows that version (the write's echo has not arrived).
    decided: HashMap<String, String>,
    /// FabricChecks deleted (by uid), treated as gone while the store still shows them.
    pub(super) deleted: HashSet<String>,
    /// (Workload uid, reservation) -> when a pass first saw its check Pending.
    first_seen: HashMap<(String, String), Instant>,
    /// FabricCheck uid -> (the Workload's resourceVersion, whether the check's members are
    /// its assigned nodes at that version): matching domains to Nodes once per version, not
    /// on every pass while the check is in flight.
    pub(super) same_members: HashMap<String, (String, bool)>,
}

/// A state for our entries of one Workload.
struct Decision {
    state: &'static str,
    message: String,
    failed_pairs: usize,
    /// `requeueAfterSeconds` of a `Retry`.
    requeue_after: Option<u32>,
}

impl Decision {
    fn retry(message: String) -> Self {
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
    /// once `gang.max_attempts` failures are reached (issue 36, item 2).
    fn escalate(mut self, retry_count: u32, gang: &crate::config::gang::GangSettings) -> Self {
        use crate::config::gang::Escalation;
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

/// One pass; returns when the next one is due at the latest (a deadline of a check in flight).
pub(super) async fn pass(
    client: &kube::Client,
    w: &Watched,
    s: &CheckSettings,
    metrics: &CheckMetrics,
    state: &mut State,
) -> Option<tokio::time::Instant> {
    let ours = our_checks(client, w, s).await;
    let mut due: Option<tokio::time::Instant> = None;
    let mut in_flight = 0usize;
    let mut pending_uids = HashSet::new();
    let nodes = w.nodes.state();
    for wl in w.workloads.state() {
        match workload(client, w, s, metrics, state, &ours, &wl, &nodes).await {
            Ok(Step::Idle) => {}
            Ok(Step::Waiting(at)) => {
                in_flight += 1;
                pending_uids.insert(wl.uid().unwrap_or_default());
                due = Some(due.map_or(at, |d| d.min(at)));
            }
            Ok(Step::Pending) => {
                pending_uids.insert(wl.uid().unwrap_or_default());
            }
            Err(e) => {
                pending_uids.insert(wl.uid().unwrap_or_default());
                tracing::warn!(error = %e, workload = %key(&wl), "admission check step failed; retrying");
                let retry = tokio::time::Instant::now() + s.poll_interval;
                due = Some(due.map_or(retry, |d| d.min(retry)));
            }
        }
    }
    metrics.set_in_flight(in_flight);
    metrics.set_answers_cached(w.results.state().len());
    state
        .first_seen
        .retain(|(uid, _), _| pending_uids.contains(uid));
    cleanup(client, w, s, state, &pending_uids).await;
    due
}

enum Step {
    /// Nothing of ours to do on this Workload.
    Idle,
    /// Our check is Pending and handled (a FabricCheck created, a state written).
    Pending,
    /// A FabricCheck in flight; judge again at this instant at the latest.
    Waiting(tokio::time::Instant),
}

fn key(o: &DynamicObject) -> String {
    format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())
}

/// The names of the AdmissionChecks served by this controller; each one not yet `Active`
/// for its generation is made so.
async fn our_checks(client: &kube::Client, w: &Watched, s: &CheckSettings) -> BTreeSet<String> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &model::admission_checks());
    let mut ours = BTreeSet::new();
    for ac in w.admission_checks.state() {
        if ac.data["spec"]["controllerName"].as_str() != Some(CONTROLLER_NAME) {
            continue;
        }
        let name = ac.name_any();
        ours.insert(name.clone());
        let generation = ac.metadata.generation.unwrap_or(0);
        let active = ac.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| {
                c["type"] == "Active"
                    && c["status"] == "True"
                    && c["observedGeneration"].as_i64() == Some(generation)
            });
        if active {
            continue;
        }
        let body = json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
            "metadata": { "name": name },
            "status": { "conditions": [{
                "type": "Active", "status": "True", "reason": "Active",
                "message": format!("fabricgate admission-check ({}) serves {CONTROLLER_NAME}", s.identity),
                "observedGeneration": generation,
                "lastTransitionTime": Timestamp::now().round(k8s_openapi::jiff::Unit::Second)
                    .map_or_else(|_| Timestamp::now().to_string(), |t| t.to_string()),
            }]},
        });
        match api
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
        {
            Ok(_) => tracing::info!(check = %name, "AdmissionCheck set Active"),
            Err(e) => {
                tracing::warn!(check = %name, error = %e, "cannot set the AdmissionCheck Active")
            }
        }
    }
    ours
}

#[allow(clippy::too_many_arguments)]
async fn workload(
    client: &kube::Client,
    w: &Watched,
    s: &CheckSettings,
    metrics: &CheckMetrics,
    state: &mut State,
    ours: &BTreeSet<String>,
    wl: &DynamicObject,
    nodes: &[Arc<Node>],
) -> Result<Step> {
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
        return Ok(Step::Idle);
    }
    let retry_count = status
        .admission_checks
        .iter()
        .filter(|c| entries.contains(&c.name))
        .filter_map(|c| c.retry_count)
        .max()
        .map_or(0, |n| u32::try_from(n).unwrap_or(0));
    let Some(reservation) = status.reservation().map(str::to_owned) else {
        return Ok(Step::Idle);
    };
    let uid = wl.uid().unwrap_or_default();
    let rv = wl.resource_version().unwrap_or_default();
    if state.decided.get(&uid) == Some(&rv) {
        return Ok(Step::Pending);
    }
    let first = *state
        .first_seen
        .entry((uid.clone(), reservation.clone()))
        .or_insert_with(Instant::now);
    let ns = wl.namespace().unwrap_or_default();
    let name = wl.name_any();
    let gang_ns = &s.config.gang.namespace;
    let fc_name = model::fabric_check_name(&ns, &name, &uid);
    let checks: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), gang_ns, &fabriccheck::checks());
    let existing = w
        .checks
        .get(&ObjectRef::new_with(&fc_name, fabriccheck::checks()).within(gang_ns))
        .filter(|fc| !state.deleted.contains(&fc.uid().unwrap_or_default()));
    if let Some(fc) = existing {
        let spec: CheckSpec = serde_json::from_value(fc.data["spec"].clone()).unwrap_or_default();
        // The same Workload, the same reservation, and the same nodes: a reservation's
        // time is only to the second, so a gang placed again within it on other nodes would
        // otherwise be released on the old nodes' answers (issue 36, item 6).
        let same = spec.workload.uid == uid
            && fc.annotations().get(RESERVATION_ANNOTATION) == Some(&reservation)
            && {
                let fc_uid = fc.uid().unwrap_or_default();
                match state.same_members.get(&fc_uid) {
                    Some((at, same)) if *at == rv => *same,
                    _ => {
                        let same = same_members(&spec, &status, nodes);
                        state.same_members.insert(fc_uid, (rv.clone(), same));
                        same
                    }
                }
            };
        if same {
            let mut results = answers(w.results.state(), &fc, &spec);
            let deadline: Option<Timestamp> = spec.deadline.parse().ok();
            let grace = SignedDuration::try_from(s.grace()).unwrap_or_default();
            let judge_at = deadline.and_then(|d| d.checked_add(grace).ok());
            let past = judge_at.is_none_or(|t| Timestamp::now() >= t);
            if past && results.len() < spec.members.len() {
                // The cache keeps only answers to checks it knew of when they arrived; before
                // a member counts as silent, its answer is looked for once in the API.
                results = answers(listed_answers(&checks, &fc).await?, &fc, &spec);
            }
            let verdict = judge(
                &spec,
                &results,
                past,
                s.config.gang.require_rdma,
                s.config.gang.timeout,
            );
            // A member that stopped being validated while its agents measured (its agent saw a
            // port go down, the guard found it gone) fails the check whatever the answers say
            // (issue 36, item 7).
            let verdict = match member_problems(&spec, w, s) {
                Some(message) => Verdict::Retry {
                    message,
                    failed_pairs: 0,
                },
                None => verdict,
            };
            let decision = match verdict {
                Verdict::Waiting => {
                    let wait = judge_at
                        .and_then(|t| Duration::try_from(t.duration_since(Timestamp::now())).ok())
                        .unwrap_or(Duration::ZERO);
                    return Ok(Step::Waiting(tokio::time::Instant::now() + wait));
                }
                Verdict::Ready(m) => Decision::ready(m),
                Verdict::Retry {
                    message,
                    failed_pairs,
                } => Decision {
                    state: "Retry",
                    message,
                    failed_pairs,
                    requeue_after: None,
                },
            };
            let decision = decision.escalate(retry_count, &s.config.gang);
            write_state(client, wl, &entries, &decision, s).await?;
            record(metrics, state, &decision, &uid, &rv, first, wl, client, s).await;
            delete_check(&checks, &fc, state).await;
            return Ok(Step::Pending);
        }
        // Left from an earlier reservation or an earlier Workload of that name.
        delete_check(&checks, &fc, state).await;
    }
    let decision = match prepare(w, s, wl, &status, &reservation, nodes) {
        Ok(Prepared::Decided(d)) => d,
        Ok(Prepared::Ring(spec)) => {
            if let Some(uid) = create_check(&checks, &fc_name, &reservation, &spec).await? {
                w.created(uid);
            }
            tracing::info!(workload = %key(wl), members = spec.members.len(), check = %fc_name,
                "gang pre-flight started");
            return Ok(Step::Waiting(
                tokio::time::Instant::now() + s.config.gang.timeout + s.grace(),
            ));
        }
        Err(d) => d,
    };
    let decision = decision.escalate(retry_count, &s.config.gang);
    write_state(client, wl, &entries, &decision, s).await?;
    record(metrics, state, &decision, &uid, &rv, first, wl, client, s).await;
    Ok(Step::Pending)
}

/// Why members of `spec` are not validated now (a message for `Retry`), or `None`.
fn member_problems(spec: &CheckSpec, w: &Watched, s: &CheckSettings) -> Option<String> {
    let prefix = &s.config.node.label_prefix;
    let taint = s.config.node.taint_key();
    let problems: Vec<String> = spec
        .members
        .iter()
        .filter_map(|m| match w.nodes.get(&ObjectRef::new(&m.node)) {
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
fn prepare(
    w: &Watched,
    s: &CheckSettings,
    wl: &DynamicObject,
    status: &WorkloadStatus,
    reservation: &str,
    nodes: &[Arc<Node>],
) -> std::result::Result<Prepared, Decision> {
    let _ = reservation;
    let prefix = &s.config.node.label_prefix;
    let taint = s.config.node.taint_key();
    let assigned: Assigned =
        decide::assigned_nodes(status, nodes.iter().map(AsRef::as_ref)).map_err(Decision::retry)?;
    let by_name: BTreeMap<&str, &Node> = nodes
        .iter()
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n.as_ref())))
        .collect();
    // Without a topology assignment there are no nodes to ring-test: not Ready unless the
    // operator allows node validation alone (issue 36, item 9).
    if s.config.gang.require_topology
        && let Some(message) = untopological_refusal(&assigned)
    {
        return Err(Decision::retry(message));
    }
    let mut notes = Vec::new();
    for (podset, flavors, count) in &assigned.untopological {
        notes.push(flavor_nodes(w, s, podset, flavors, *count, nodes)?);
    }
    let gang = &assigned.nodes;
    if gang.len() > s.config.gang.max_nodes {
        return Err(Decision {
            state: "Rejected",
            message: format!(
                "the gang has {} nodes, more than gang.max_nodes ({}): the pre-flight cannot \
                 run on it; raise gang.max_nodes or split the job",
                gang.len(),
                s.config.gang.max_nodes
            ),
            failed_pairs: 0,
            requeue_after: None,
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
    let mut members = Vec::with_capacity(gang.len());
    let mut no_endpoint = Vec::new();
    let mut foreign = Vec::new();
    let port = s.config.peers.port();
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
                    // The ports its responder may give (its own agent's word, issue 36 item 4).
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
    // the Workload's status (issue 36, item 10).
    if !foreign.is_empty() {
        return Err(Decision::retry(format!(
            "{} assigned nodes publish a peers endpoint (Node annotation \
             {ENDPOINT_ANNOTATION}) that is not one of the Node's status.addresses at the \
             peers port {port}: {}",
            foreign.len(),
            list(&foreign)
        )));
    }
    let deadline = deadline_after(s.config.gang.timeout);
    Ok(Prepared::Ring(CheckSpec {
        workload: WorkloadRef {
            namespace: wl.namespace().unwrap_or_default(),
            name: wl.name_any(),
            uid: wl.uid().unwrap_or_default(),
        },
        members,
        min_bandwidth_gbps: s.config.gang.min_bandwidth_gbps,
        max_rtt_micros: s.config.gang.max_rtt_micros,
        deadline,
    }))
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
    w: &Watched,
    s: &CheckSettings,
    podset: &str,
    flavors: &BTreeSet<String>,
    count: i64,
    nodes: &[Arc<Node>],
) -> std::result::Result<String, Decision> {
    let mut labels = BTreeMap::new();
    for f in flavors {
        let flavor = w
            .flavors
            .get(&ObjectRef::new_with(f, model::resource_flavors()))
            .ok_or_else(|| {
                Decision::retry(format!("pod set {podset}: ResourceFlavor {f} not found"))
            })?;
        if let Some(m) = flavor.data["spec"]["nodeLabels"].as_object() {
            for (k, v) in m {
                labels.insert(k.clone(), v.as_str().unwrap_or_default().to_owned());
            }
        }
    }
    let prefix = &s.config.node.label_prefix;
    let taint = s.config.node.taint_key();
    let of_flavor: Vec<&Node> = nodes
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

/// `timeout` from now, rounded up to a whole second (RFC 3339).
fn deadline_after(timeout: Duration) -> String {
    let now = Timestamp::now();
    let secs = now
        .as_second()
        .saturating_add(i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX / 2))
        .saturating_add(i64::from(
            timeout.subsec_nanos() > 0 || now.subsec_nanosecond() > 0,
        ));
    Timestamp::from_second(secs).map_or_else(|_| now.to_string(), |t| t.to_string())
}

/// Server-side apply of our entries' state on the Workload's status, guarded by the
/// resourceVersion the decision was made on (a conflict is judged again on the next pass).
async fn write_state(
    client: &kube::Client,
    wl: &DynamicObject,
    entries: &[String],
    d: &Decision,
    _s: &CheckSettings,
) -> Result<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &wl.namespace().unwrap_or_default(),
        &model::workloads(),
    );
    let now = Timestamp::now();
    let now = now
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap_or(now)
        .to_string();
    let message = truncate(&d.message, 32_000);
    let checks: Vec<Value> = entries
        .iter()
        .map(|name| {
            let mut entry = json!({ "name": name, "state": d.state, "message": message,
                                    "lastTransitionTime": now });
            // Kueue requeues no sooner than lastTransitionTime + this (KEP 3258); without
            // it, at once, and TAS would pick the same failing nodes again.
            if let (Some(after), Some(e)) = (d.requeue_after, entry.as_object_mut()) {
                e.insert("requeueAfterSeconds".to_owned(), json!(after));
            }
            entry
        })
        .collect();
    let body = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": wl.name_any(), "namespace": wl.namespace(),
                      "resourceVersion": wl.resource_version() },
        "status": { "admissionChecks": checks },
    });
    api.patch_status(
        &wl.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|e| Error::KubeObject {
        action: "write the admission check state of",
        object: format!("Workload {}", key(wl)),
        source: Box::new(e),
    })?;
    tracing::info!(workload = %key(wl), state = d.state, message = %d.message, "admission check decided");
    Ok(())
}

/// After a state was written: metrics, the Event (Retry, Rejected), the Workload's version.
#[allow(clippy::too_many_arguments)]
async fn record(
    metrics: &CheckMetrics,
    state: &mut State,
    d: &Decision,
    uid: &str,
    rv: &str,
    first: Instant,
    wl: &DynamicObject,
    client: &kube::Client,
    s: &CheckSettings,
) {
    state.decided.insert(uid.to_owned(), rv.to_owned());
    metrics.decided(
        &d.state.to_ascii_lowercase(),
        Some(first.elapsed().as_secs_f64()),
    );
    metrics.pair_failures(d.failed_pairs);
    if d.state == "Ready" {
        return;
    }
    let ns = wl.namespace().unwrap_or_default();
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let event = Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-", truncate(&wl.name_any(), 200))),
            namespace: Some(ns.clone()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        action: Some("AdmissionCheck".to_owned()),
        reason: Some(format!("FabricPreflight{}", d.state)),
        note: Some(truncate(&d.message, 1024)),
        type_: Some("Warning".to_owned()),
        regarding: Some(ObjectReference {
            api_version: Some("kueue.x-k8s.io/v1beta2".to_owned()),
            kind: Some("Workload".to_owned()),
            name: Some(wl.name_any()),
            namespace: Some(ns),
            uid: wl.uid(),
            ..ObjectReference::default()
        }),
        reporting_controller: Some(CONTROLLER_NAME.to_owned()),
        reporting_instance: Some(truncate(&s.identity, 128)),
        ..Event::default()
    };
    let pp = PostParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    };
    if let Err(e) = events.create(&pp, &event).await {
        tracing::warn!(workload = %key(wl), error = %e, "cannot record the Event");
    }
}
