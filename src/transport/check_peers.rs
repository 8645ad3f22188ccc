//! `fabricgate check --pods` with a cluster to ask (`--kubeconfig`, or in a pod): the same
//! peer rule as the agent's — a pod's peers are the pods of its job on other nodes — and the
//! pods' names. Without one, or when the cluster cannot be read, it says so plainly and falls
//! back to "any address not on this node" (`RemoteScope::NotLocal`).

use crate::transport::bandwidth::JobId;
use crate::transport::jobs::{JobKey, job_of};
use crate::transport::peers::{JobPeers, NodeAddresses, members, peer_addresses};
use fabricgate_probes::transport::sample::RemoteScope;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

/// How long reading the cluster may take before `check` falls back.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(15);

/// Who each pod's peers are, the pods' names, and how that was found, for a person.
#[derive(Debug, Clone)]
pub struct ClusterPeers {
    pub scope: RemoteScope,
    /// Pod UID → (namespace, name), for the pods of this node the cluster lists.
    pub names: BTreeMap<String, (String, String)>,
    /// One line: what was asked, or why nothing was and what that means.
    pub note: String,
    /// Pod UID → its job, for the pods of this node the cluster lists (without a cluster each
    /// pod is a job of its own).
    pub jobs: BTreeMap<String, JobId>,
}

impl ClusterPeers {
    /// Without a cluster: any address not on this node is a peer.
    pub fn not_local(why: &str) -> Self {
        Self {
            scope: RemoteScope::NotLocal,
            names: BTreeMap::new(),
            jobs: BTreeMap::new(),
            note: format!(
                "{why}: a pod's peers are taken to be any address not on this node, so TCP with \
                 object storage or another job counts too; give --kubeconfig (or run in a pod) \
                 for the job's own peers"
            ),
        }
    }
}

/// This machine's host name (`<procfs>/sys/kernel/hostname`): the Node's name where the
/// kubelet names it so (the default); empty when unreadable.
pub fn host_name(roots: &fabricgate_probes::Roots) -> String {
    std::fs::read_to_string(roots.proc("sys/kernel/hostname"))
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// Whether `check` runs in a pod with a service account (the in-cluster configuration).
pub fn in_cluster() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        && Path::new("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()
}

/// Read this node's pods and their jobs' pods from the cluster (`kubeconfig`, else the
/// in-cluster configuration); any failure falls back to [`ClusterPeers::not_local`] naming it.
pub fn read(kubeconfig: Option<&Path>, node: &str, job_labels: &[String]) -> ClusterPeers {
    if kubeconfig.is_none() && !in_cluster() {
        return ClusterPeers::not_local("no cluster to ask (no --kubeconfig, not in a pod)");
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return ClusterPeers::not_local(&format!("cannot start a runtime: {e}")),
    };
    let asked = runtime.block_on(async {
        tokio::time::timeout(CLUSTER_TIMEOUT, ask(kubeconfig, node, job_labels)).await
    });
    match asked {
        Ok(Ok(peers)) => peers,
        Ok(Err(why)) => ClusterPeers::not_local(&format!("cannot read the cluster: {why}")),
        Err(_) => ClusterPeers::not_local(&format!(
            "the cluster did not answer within {}s",
            CLUSTER_TIMEOUT.as_secs()
        )),
    }
}

async fn ask(
    kubeconfig: Option<&Path>,
    node: &str,
    job_labels: &[String],
) -> Result<ClusterPeers, String> {
    let kube_config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => kube::Config::incluster().map_err(|e| e.to_string())?,
    };
    let client = kube::Client::try_from(kube_config).map_err(|e| e.to_string())?;
    let all: Api<Pod> = Api::all(client.clone());
    let here = all
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|e| format!("list the pods of node {node}: {e}"))?;
    let labels = job_labels;
    let mut names = BTreeMap::new();
    let mut jobs: BTreeMap<String, JobKey> = BTreeMap::new();
    for pod in &here.items {
        let m = &pod.metadata;
        let (Some(uid), Some(ns), Some(name)) = (&m.uid, &m.namespace, &m.name) else {
            continue;
        };
        names.insert(uid.clone(), (ns.clone(), name.clone()));
        if let Some(job) = job_of(pod, labels) {
            jobs.insert(uid.clone(), job);
        }
    }
    let mut peers = JobPeers::new();
    let nodes = NodeAddresses::default();
    let wanted: BTreeSet<&JobKey> = jobs.values().collect();
    for job in wanted {
        let api: Api<Pod> = Api::namespaced(client.clone(), &job.namespace);
        let mut params = ListParams::default();
        if let Some(selector) = job.label_selector() {
            params = params.labels(&selector);
        }
        let list = api
            .list(&params)
            .await
            .map_err(|e| format!("list the pods of {}: {e}", job.name()))?;
        let members = members(&client, job, labels, &list.items, &nodes).await;
        peers.insert(job.clone(), members);
    }
    let scope = jobs
        .iter()
        .map(|(uid, job)| (uid.clone(), peer_addresses(&peers, job, node)))
        .filter(|(_, a)| !a.is_empty())
        .collect();
    Ok(ClusterPeers {
        scope: RemoteScope::JobPeers(scope),
        note: format!(
            "peers from the cluster: the pods of each pod's job on other nodes ({} pods on node \
             {node}, {} jobs)",
            names.len(),
            jobs.values().collect::<BTreeSet<_>>().len()
        ),
        names,
        jobs: jobs.into_iter().map(|(uid, job)| (uid, job.id())).collect(),
    })
}
