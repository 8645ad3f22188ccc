//! Who a judged pod's peers are: the pods of the same job on other nodes, and every address
//! they can be reached at. Pure: a `Pod` in, its job and its addresses out; the runtime task's
//! peer watch (`transport::peers`) does the I/O.
//!
//! A job is the pods' common identity, tried in this order: the first of `runtime.job_labels`
//! and then [`BUILTIN_JOB_LABELS`] the pod carries (JobSet, the training operators,
//! LeaderWorkerSet, Kueue's and scheduler-plugins' pod groups, Volcano, a Job's own label),
//! the native gang (`spec.schedulingGroup.podGroupName`), the controller owner, and last the
//! pod itself (a bare pod is a job of one: it has no peer, so it is never `sockets`).

use crate::transport::bandwidth::JobId;
use crate::transport::settings::BUILTIN_JOB_LABELS;
use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::net::IpAddr;

/// Multus's record of every network attachment of a pod (the Network Plumbing WG's
/// multi-network specification): a JSON array of `{name, interface, ips, mac, default, ...}`.
pub const NETWORK_STATUS: &str = "k8s.v1.cni.cncf.io/network-status";

/// A job: the namespace and what names it (a label, the native gang, the controller owner, or
/// the pod itself).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobKey {
    pub namespace: String,
    pub by: JobBy,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum JobBy {
    /// The pods carrying `key=value`: a label selector finds them all.
    Label { key: String, value: String },
    /// The pods of the native gang `spec.schedulingGroup.podGroupName`.
    PodGroup(String),
    /// The pods with this controller owner (its UID; kind and name for a person).
    Owner {
        uid: String,
        kind: String,
        name: String,
    },
    /// A pod with none of the above (its UID): a job of one.
    Pod(String),
}

impl JobKey {
    /// For the metric label `job` and messages: `jobset.sigs.k8s.io/jobset-name=llm`,
    /// `PodGroup/llm`, `Job/llm`, `Pod/trainer-0`.
    pub fn name(&self) -> String {
        match &self.by {
            JobBy::Label { key, value } => format!("{key}={value}"),
            JobBy::PodGroup(name) => format!("PodGroup/{name}"),
            JobBy::Owner { kind, name, .. } => format!("{kind}/{name}"),
            JobBy::Pod(uid) => format!("Pod/{uid}"),
        }
    }

    /// The job as metrics and the port figures name it (`transport::bandwidth`).
    pub fn id(&self) -> JobId {
        JobId {
            namespace: self.namespace.clone(),
            job: self.name(),
        }
    }

    /// The label selector that lists the job's pods in its namespace; `None` when only a
    /// look at each pod of the namespace can tell (a native gang, a controller owner).
    pub fn label_selector(&self) -> Option<String> {
        match &self.by {
            JobBy::Label { key, value } => Some(format!("{key}={value}")),
            _ => None,
        }
    }
}

/// The job of `pod`; `None` without a namespace.
pub fn job_of(pod: &Pod, job_labels: &[String]) -> Option<JobKey> {
    let namespace = pod.metadata.namespace.clone()?;
    let labels = pod.metadata.labels.as_ref();
    let by_label = job_labels
        .iter()
        .map(String::as_str)
        .chain(BUILTIN_JOB_LABELS)
        .find_map(|key| {
            let value = labels?.get(key).filter(|v| !v.is_empty())?;
            Some(JobBy::Label {
                key: key.to_owned(),
                value: value.clone(),
            })
        });
    let by_group = || {
        pod.spec
            .as_ref()?
            .scheduling_group
            .as_ref()?
            .pod_group_name
            .clone()
            .filter(|n| !n.is_empty())
            .map(JobBy::PodGroup)
    };
    let by_owner = || {
        pod.metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| JobBy::Owner {
                uid: o.uid.clone(),
                kind: o.kind.clone(),
                name: o.name.clone(),
            })
    };
    let by = by_label
        .or_else(by_group)
        .or_else(by_owner)
        .or_else(|| pod.metadata.uid.clone().map(JobBy::Pod))?;
    Some(JobKey { namespace, by })
}

/// Every address `pod` can be reached at: `status.podIPs` (and `podIP`), the IPs of every
/// attachment in Multus's [`NETWORK_STATUS`] annotation (secondary networks: SR-IOV,
/// macvlan/ipvlan, IPoIB), and for a `hostNetwork` pod `status.hostIPs` (its Node's; the
/// caller adds the Node's own `status.addresses`). An annotation that does not read adds
/// nothing (a tenant writes it; it can only name addresses, never hide the pod's own).
pub fn pod_addresses(pod: &Pod) -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    let status = pod.status.as_ref();
    let parse = |s: &str| s.parse::<IpAddr>().ok();
    out.extend(status.and_then(|s| s.pod_ip.as_deref()).and_then(parse));
    out.extend(
        status
            .and_then(|s| s.pod_ips.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|p| parse(&p.ip)),
    );
    if is_host_network(pod) {
        out.extend(status.and_then(|s| s.host_ip.as_deref()).and_then(parse));
        out.extend(
            status
                .and_then(|s| s.host_ips.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|p| parse(&p.ip)),
        );
    }
    if let Some(text) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NETWORK_STATUS))
    {
        out.extend(network_status_ips(text));
    }
    out.retain(|ip| !ip.is_loopback() && !ip.is_unspecified());
    out
}

pub fn is_host_network(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
}

#[derive(Deserialize)]
struct Attachment {
    #[serde(default)]
    ips: Vec<String>,
}

/// The IPs of a `network-status` annotation (`"ips": ["10.56.217.5", "fd00::5"]` per
/// attachment; an address written with its prefix length, as some plugins do, is read without
/// it). Not JSON, or not this shape: none.
pub fn network_status_ips(text: &str) -> BTreeSet<IpAddr> {
    let Ok(attachments) = serde_json::from_str::<Vec<Attachment>>(text) else {
        return BTreeSet::new();
    };
    attachments
        .iter()
        .flat_map(|a| &a.ips)
        .filter_map(|ip| ip.split('/').next()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_job_is_named_by_its_label_its_gang_its_owner_or_itself() {
        let jobset = pod(
            json!({"metadata": {"namespace": "ml", "uid": "u1", "labels": {
            "batch.kubernetes.io/job-name": "llm-workers-0",
            "jobset.sigs.k8s.io/jobset-name": "llm"}}}),
        );
        // A JobSet's Jobs each have their own name: the JobSet's label comes first.
        assert_eq!(
            job_of(&jobset, &[]).unwrap().name(),
            "jobset.sigs.k8s.io/jobset-name=llm"
        );
        // A label the operator names comes before the built-in ones.
        let mine = pod(
            json!({"metadata": {"namespace": "ml", "uid": "u1", "labels": {
            "example.com/run": "r7", "jobset.sigs.k8s.io/jobset-name": "llm"}}}),
        );
        let key = job_of(&mine, &["example.com/run".to_owned()]).unwrap();
        assert_eq!(key.label_selector().as_deref(), Some("example.com/run=r7"));
        let gang = pod(json!({"metadata": {"namespace": "ml", "uid": "u1"},
            "spec": {"containers": [], "schedulingGroup": {"podGroupName": "g"}}}));
        assert_eq!(job_of(&gang, &[]).unwrap().name(), "PodGroup/g");
        assert_eq!(job_of(&gang, &[]).unwrap().label_selector(), None);
        let owned = pod(
            json!({"metadata": {"namespace": "ml", "uid": "u1", "ownerReferences": [
            {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "pt",
             "uid": "o1", "controller": true}]}}),
        );
        assert_eq!(job_of(&owned, &[]).unwrap().name(), "PyTorchJob/pt");
        let bare = pod(json!({"metadata": {"namespace": "ml", "uid": "u1"}}));
        assert_eq!(job_of(&bare, &[]).unwrap().by, JobBy::Pod("u1".into()));
        // Two pods of two namespaces with the same label are two jobs.
        let other = pod(
            json!({"metadata": {"namespace": "b", "uid": "u2", "labels": {
            "jobset.sigs.k8s.io/jobset-name": "llm"}}}),
        );
        assert_ne!(job_of(&other, &[]), job_of(&jobset, &[]));
    }

    /// The annotation exactly as Multus writes it: the cluster network and a macvlan
    /// attachment whose address is in no podCIDR and not in `status.podIPs`.
    #[test]
    fn addresses_from_pod_ips_multus_and_a_host_network_pods_node() {
        let status = r#"[{
    "name": "cbr0",
    "interface": "eth0",
    "ips": [
        "10.88.0.7"
    ],
    "mac": "3e:1d:c5:60:1f:41",
    "default": true,
    "dns": {}
},{
    "name": "ml/fabric-macvlan",
    "interface": "net1",
    "ips": [
        "192.168.50.7",
        "fd50::7"
    ],
    "mac": "aa:3d:09:a1:22:10",
    "dns": {}
}]"#;
        let p = pod(json!({"metadata": {"namespace": "ml", "annotations": {
                NETWORK_STATUS: status}},
            "status": {"podIP": "10.88.0.7", "podIPs": [{"ip": "10.88.0.7"}],
                "hostIP": "10.0.0.1"}}));
        let got: Vec<String> = pod_addresses(&p).iter().map(ToString::to_string).collect();
        assert_eq!(got, ["10.88.0.7", "192.168.50.7", "fd50::7"]);
        let host = pod(json!({"metadata": {"namespace": "ml"},
            "spec": {"containers": [], "hostNetwork": true},
            "status": {"podIPs": [{"ip": "10.0.0.1"}], "hostIPs": [{"ip": "10.0.0.1"},
                {"ip": "fd00::1"}]}}));
        let got: Vec<String> = pod_addresses(&host)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["10.0.0.1", "fd00::1"]);
        assert!(network_status_ips("not json").is_empty());
        assert!(network_status_ips(r#"{"ips": ["10.0.0.1"]}"#).is_empty());
        assert_eq!(
            network_status_ips(r#"[{"ips": ["10.1.0.2/24", "x"]}]"#).len(),
            1
        );
    }
}
