//! The pods of this node judged at run time, and what the agent writes on them:
//! which pods are judged, the pod condition `fabricgate.io/TransportReady` (written only when
//! it changes, so steady state costs no API write) and the `TransportFallback` Event's text.
//! Pure: a `Pod` and the settings in, a decision out; the agent's runtime task does the I/O.

use crate::config::KubernetesRequirements;
use crate::policy::breaker::selector_matches;
use crate::transport::settings::RuntimeSettings;
use crate::transport::verdict::{PodVerdict, Transport};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// The pod condition the agents own (and only it: deploy/overlays/runtime-transport/pod-transport-policy.yaml).
pub const CONDITION_TYPE: &str = "fabricgate.io/TransportReady";
/// The Event on the pod and its controller owner when a pod goes to sockets.
pub const EVENT_REASON: &str = "TransportFallback";

/// A pod the runtime task judges, as its watch last showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JudgedPod {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub host_network: bool,
    /// The controller owner (`kind`, `name`), for the per-job alert and the owner's Event.
    pub owner: Option<Owner>,
    /// `fabricgate.io/TransportReady` as the pod shows it: (status, reason).
    pub condition: Option<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    pub uid: String,
}

/// Whether `pod` is one of fabricgate's own: in the agent's namespace (`own_namespace`) and
/// controlled by a DaemonSet there. Never by a label: any tenant can label a pod
/// `app.kubernetes.io/name: fabricgate`, or set an owner reference in its own namespace, but
/// only the cluster's admins create pods in fabricgate's namespace.
pub fn is_own_pod(pod: &Pod, own_namespace: &str) -> bool {
    !own_namespace.is_empty()
        && pod.metadata.namespace.as_deref() == Some(own_namespace)
        && pod.metadata.owner_references.iter().flatten().any(|o| {
            o.controller == Some(true) && o.kind == "DaemonSet" && o.api_version == "apps/v1"
        })
}

/// Why a pod is judged: it requests one of `kubernetes.rdma_resources` (requests or limits of
/// any container, init containers included), holds a resource claim while `claims` (DRA
/// drivers are configured, `kubernetes.dra.drivers`), or matches `runtime.pod_selector`. The DRA test is an
/// approximation: the pod's claims do not name their driver (the ResourceClaim does), so any
/// claim counts; judging one pod too many costs one metric series, never a write (an idle pod
/// gets no condition change). A finished pod is never judged, nor the agent's own pods
/// ([`is_own_pod`]): the agent requests the RDMA resource itself (for the devices it probes)
/// and its side channel talks TCP to other nodes, so judged it could be found "on sockets" and,
/// with `runtime.on_sockets: evict`, evicted by the guard.
pub fn is_judged(
    pod: &Pod,
    kube: &KubernetesRequirements,
    claims: bool,
    runtime: &RuntimeSettings,
    own_namespace: &str,
) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) || pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(spec) = &pod.spec else {
        return false;
    };
    if is_own_pod(pod, own_namespace) {
        return false;
    }
    let requests_rdma = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| r.requests.iter().flatten().chain(r.limits.iter().flatten()))
        .any(|(name, _)| kube.rdma_resources.iter().any(|r| r == name));
    let claims_dra = claims && spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty());
    let selected = !runtime.pod_selector.is_empty()
        && selector_matches(
            &runtime.pod_selector,
            pod.metadata.labels.as_ref().unwrap_or(&Default::default()),
        ) == Some(true);
    requests_rdma || claims_dra || selected
}

impl JudgedPod {
    /// The pod as the runtime task keeps it; `None` without a UID, namespace or name.
    pub fn of(pod: &Pod) -> Option<Self> {
        let m = &pod.metadata;
        let owner = m
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| Owner {
                api_version: o.api_version.clone(),
                kind: o.kind.clone(),
                name: o.name.clone(),
                uid: o.uid.clone(),
            });
        let condition = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == CONDITION_TYPE))
            .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()));
        Some(Self {
            uid: m.uid.clone()?,
            namespace: m.namespace.clone()?,
            name: m.name.clone()?,
            host_network: super::jobs::is_host_network(pod),
            owner,
            condition,
        })
    }
}

/// The condition a verdict wants: `rdma` True, `sockets` False/SocketsFallback, `unknown`
/// Unknown/TransportUnknown. `idle` (no data-path QP, little TCP: between steps, loading data,
/// before NCCL is up) wants nothing new: a pod that was on RDMA and pauses stays True, one on
/// sockets stays False (until `runtime.clear_after` of quiet: `PodVerdict::clears`), so the
/// condition never flaps with a job's rhythm; a pod with no condition yet, or one still
/// showing an earlier `unknown` (the agent sees it now), gets Unknown/NoInterNodeTraffic.
pub fn wanted_condition(
    verdict: &PodVerdict,
    current: Option<&(String, String)>,
) -> Option<(&'static str, &'static str)> {
    let status = match verdict.transport {
        Transport::Rdma => "True",
        Transport::Sockets => "False",
        Transport::Unknown => "Unknown",
        // Quiet for runtime.clear_after: a False (a recreated pod's, a finished warm-up's)
        // is not kept by inertia.
        Transport::Idle
            if verdict.clears && current.is_some_and(|(status, _)| status == "False") =>
        {
            "Unknown"
        }
        Transport::Idle if current.is_some_and(|(status, _)| status != "Unknown") => return None,
        Transport::Idle => "Unknown",
    };
    Some((status, verdict.reason))
}

/// The merge patch of `pods/status` that sets the condition, or `None` when the pod already
/// shows it (zero writes at steady state). `conditions` is a list merged by `type` under a
/// strategic merge patch, so only our entry is sent and the kubelet's stay as they are. The
/// pod's UID rides along as a precondition: a pod deleted and recreated under the same name
/// since the verdict refuses the patch (422, `metadata.uid` is immutable) rather than inherit
/// another pod's condition.
pub fn condition_patch(pod: &JudgedPod, verdict: &PodVerdict, now: &str) -> Option<Value> {
    let (status, reason) = wanted_condition(verdict, pod.condition.as_ref())?;
    if pod
        .condition
        .as_ref()
        .is_some_and(|(s, r)| s == status && r == reason)
    {
        return None;
    }
    Some(json!({
        "metadata": { "uid": pod.uid },
        "status": {
            "conditions": [{
                "type": CONDITION_TYPE,
                "status": status,
                "reason": reason,
                "message": verdict.why,
                "lastTransitionTime": now,
            }]
        }
    }))
}

/// Whether this verdict is a transition to sockets the Event reports (once per transition:
/// the pod did not already show False/SocketsFallback).
pub fn is_fallback_transition(pod: &JudgedPod, verdict: &PodVerdict) -> bool {
    verdict.transport == Transport::Sockets
        && pod
            .condition
            .as_ref()
            .is_none_or(|(s, r)| s != "False" || r != verdict.reason)
}

/// The Event's note: the facts that decided it, and on the owner which pod.
pub fn fallback_note(pod: &JudgedPod, verdict: &PodVerdict, on_owner: bool) -> String {
    let note = if on_owner {
        format!(
            "pod {}/{} is on sockets: {}",
            pod.namespace, pod.name, verdict.why
        )
    } else {
        format!("on sockets: {}", verdict.why)
    };
    // events.k8s.io/v1 caps the note at 1 kB.
    crate::text::truncate(&note, 1000)
}

#[cfg(test)]
mod tests;
