//! The peer watch of the runtime transport: for each job with a judged pod on this node, the
//! pods of that job on other nodes and their addresses (`transport::jobs`). One watch per job,
//! started when the job's first pod on this node is judged and stopped when its last one goes,
//! so an agent's watches carry the pods of its own jobs, never every pod of the cluster: a
//! label selector in the job's namespace where a label names the job (every built-in kind), or
//! the namespace's pods read and kept by their job where only the owner or the native gang
//! does.

use super::jobs::{JobKey, is_host_network, job_of, pod_addresses};
use crate::node::WATCH_TIMEOUT_SECS;
use crate::node::WatchBackoff;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A pod of a judged pod's job: where it runs and every address it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPod {
    pub node: String,
    pub addresses: BTreeSet<IpAddr>,
}

/// Per job, its pods by UID (on any node, this one included: the reader leaves out its own).
pub type JobPeers = BTreeMap<JobKey, BTreeMap<String, PeerPod>>;

/// The addresses of the pods of `job` on nodes other than `node`.
pub fn peer_addresses(peers: &JobPeers, job: &JobKey, node: &str) -> BTreeSet<IpAddr> {
    peers
        .get(job)
        .into_iter()
        .flat_map(BTreeMap::values)
        .filter(|p| p.node != node)
        .flat_map(|p| p.addresses.iter().copied())
        .collect()
}

/// How long a Node's addresses (for a `hostNetwork` peer) are used before being read again.
const NODE_ADDRESSES_TTL: Duration = Duration::from_secs(600);

/// The Nodes' addresses read for `hostNetwork` peers, shared by every job's watch.
pub(crate) type NodeAddresses = Arc<Mutex<HashMap<String, (Instant, BTreeSet<IpAddr>)>>>;

/// Follow the pods of every job in `wanted` and publish them on `tx`; a job leaving `wanted`
/// has its watch stopped and its pods dropped. Ends when `wanted`'s sender is gone.
pub async fn watch_job_peers(
    client: kube::Client,
    job_labels: Vec<String>,
    mut wanted: watch::Receiver<BTreeSet<JobKey>>,
    tx: watch::Sender<JobPeers>,
    max_backoff: Duration,
) {
    let mut running: BTreeMap<JobKey, JoinHandle<()>> = BTreeMap::new();
    let nodes: NodeAddresses = Arc::default();
    loop {
        let jobs = wanted.borrow_and_update().clone();
        running.retain(|key, task| {
            let keep = jobs.contains(key);
            if !keep {
                task.abort();
            }
            keep
        });
        tx.send_if_modified(|m| {
            let before = m.len();
            m.retain(|key, _| jobs.contains(key));
            m.len() != before
        });
        for key in jobs {
            if running.contains_key(&key) {
                continue;
            }
            let task = tokio::spawn(watch_one_job(
                client.clone(),
                key.clone(),
                job_labels.clone(),
                tx.clone(),
                Arc::clone(&nodes),
                max_backoff,
            ));
            running.insert(key, task);
        }
        if wanted.changed().await.is_err() {
            break;
        }
    }
    for task in running.values() {
        task.abort();
    }
}

/// One job's pods, kept whole on every event.
async fn watch_one_job(
    client: kube::Client,
    key: JobKey,
    job_labels: Vec<String>,
    tx: watch::Sender<JobPeers>,
    nodes: NodeAddresses,
    max_backoff: Duration,
) {
    let mut config = watcher::Config::default()
        .timeout(WATCH_TIMEOUT_SECS)
        .any_semantic();
    if let Some(selector) = key.label_selector() {
        config = config.labels(&selector);
    }
    let api: Api<Pod> = Api::namespaced(client.clone(), &key.namespace);
    let mut events = watcher(api, config)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    let mut pods: BTreeMap<String, Pod> = BTreeMap::new();
    let mut staged = BTreeMap::new();
    while let Some(event) = events.next().await {
        let mine = |p: &Pod| job_of(p, &job_labels).as_ref() == Some(&key);
        match event {
            Ok(WatchEvent::Init) => staged.clear(),
            Ok(WatchEvent::InitApply(p)) => {
                if let (Some(uid), true) = (p.metadata.uid.clone(), mine(&p)) {
                    staged.insert(uid, p);
                }
            }
            Ok(WatchEvent::InitDone) => pods = std::mem::take(&mut staged),
            Ok(WatchEvent::Apply(p)) => {
                if let Some(uid) = p.metadata.uid.clone() {
                    if mine(&p) {
                        pods.insert(uid, p);
                    } else {
                        pods.remove(&uid);
                    }
                }
            }
            Ok(WatchEvent::Delete(p)) => {
                if let Some(uid) = &p.metadata.uid {
                    pods.remove(uid);
                }
            }
            Err(e) => {
                tracing::debug!(job = %key.name(), error = %e, "watch of a job's pods broke");
                continue;
            }
        }
        let peers = members(&client, &key, &job_labels, pods.values(), &nodes).await;
        tx.send_if_modified(|m| {
            if m.get(&key) == Some(&peers) {
                return false;
            }
            m.insert(key.clone(), peers);
            true
        });
    }
}

/// The running pods of job `key` among `pods`, as peers by UID (the agent's watch and
/// `fabricgate check` alike).
pub(crate) async fn members<'a>(
    client: &kube::Client,
    key: &JobKey,
    job_labels: &[String],
    pods: impl IntoIterator<Item = &'a Pod>,
    nodes: &NodeAddresses,
) -> BTreeMap<String, PeerPod> {
    let mut peers = BTreeMap::new();
    for pod in pods {
        if job_of(pod, job_labels).as_ref() != Some(key) {
            continue;
        }
        if let (Some(uid), Some(peer)) = (&pod.metadata.uid, peer_of(client, pod, nodes).await) {
            peers.insert(uid.clone(), peer);
        }
    }
    peers
}

/// A running pod of the job as a peer: its node and addresses (a `hostNetwork` pod's Node's
/// addresses too); `None` for a pod not on a node yet, finished or being deleted.
async fn peer_of(client: &kube::Client, pod: &Pod, nodes: &NodeAddresses) -> Option<PeerPod> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let node = pod.spec.as_ref()?.node_name.clone()?;
    let mut addresses = pod_addresses(pod);
    if is_host_network(pod) {
        addresses.extend(node_addresses(client, &node, nodes).await);
    }
    Some(PeerPod { node, addresses })
}

/// A Node's `status.addresses`, read at most once per [`NODE_ADDRESSES_TTL`]; none when it
/// cannot be read (the peer's `hostIPs` still are).
async fn node_addresses(
    client: &kube::Client,
    node: &str,
    cache: &NodeAddresses,
) -> BTreeSet<IpAddr> {
    if let Ok(cache) = cache.lock()
        && let Some((at, addresses)) = cache.get(node)
        && at.elapsed() < NODE_ADDRESSES_TTL
    {
        return addresses.clone();
    }
    let addresses = match Api::<Node>::all(client.clone()).get(node).await {
        Ok(n) => n
            .status
            .and_then(|s| s.addresses)
            .into_iter()
            .flatten()
            .filter_map(|a| a.address.parse().ok())
            .collect(),
        Err(e) => {
            tracing::debug!(node, error = %e, "cannot read a peer's Node addresses");
            BTreeSet::new()
        }
    };
    if let Ok(mut cache) = cache.lock() {
        cache.insert(node.to_owned(), (Instant::now(), addresses.clone()));
    }
    addresses
}
