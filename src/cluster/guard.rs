//! `fabricgate guard`: the cluster-level half of failing closed. A dead or wedged agent
//! leaves its Node with its last verdict (the gate fails open); the guard, a Deployment of two
//! replicas of which only the holder of a `coordination.k8s.io` Lease acts, taints a pool Node
//! whose agent pod is missing or not Ready for `--stale-after`, with `FabricReady=False`
//! reason `AgentNotRunning`. It never untaints (the agent decides again when it is back), it
//! reads only what the kubelet already reports (pod readiness), writes only when it taints,
//! and it is subject to the same blast-radius breaker as the agent.
//!
//! The leader keeps a local cache of the pool's Nodes and the agent pods: one LIST of each
//! (from the watch cache) when it takes the Lease, then a WATCH of each from the list's
//! resourceVersion (with bookmarks), resumed from the last version seen when a watch ends and
//! listed again only on `410 Gone`. `sweep` judges that cache on every change, at the next
//! `--stale-after` deadline and every `--poll-interval`, with no API reads. A replica that does
//! not hold the Lease keeps no watches.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::policy::breaker::{self as failclosed, TaintDecision};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;
use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Reason of `FabricReady` the guard sets.
pub const AGENT_NOT_RUNNING: &str = "AgentNotRunning";
/// Field manager of the guard's condition writes (the agent takes the condition back).
pub const GUARD_FIELD_MANAGER: &str = "fabricgate-guard";

/// Everything `fabricgate guard` needs.
pub struct GuardSettings {
    pub config: Config,
    pub namespace: String,
    pub pod_selector: String,
    pub stale_after: Duration,
    pub poll_interval: Duration,
    pub lease_name: String,
    pub lease_duration: Duration,
    pub identity: String,
}

/// The server ends each watch after this long; the leader then re-watches from the last
/// resourceVersion (as the agent's watch of its own Node does).
const WATCH_TIMEOUT_SECS: u32 = 290;
/// Least time between two sweeps triggered by cache changes.
const MIN_SWEEP_GAP: Duration = Duration::from_millis(100);
/// First wait after a failed list or watch; doubled per failure up to [`max_backoff`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// Longest wait between retries of a failed list or watch: `--poll-interval`, within 1–30 s.
fn max_backoff(s: &GuardSettings) -> Duration {
    s.poll_interval
        .clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// Run the guard until `shutdown` completes. `requests` serves the Lease, the lists and the
/// writes; `watch` (a client with a read timeout above [`WATCH_TIMEOUT_SECS`]) the leader's
/// two watches.
///
/// # Errors
/// [`Error::Usage`] when `node.pool_selector` is empty (the guard must know the pool).
pub async fn run(
    requests: kube::Client,
    watch: kube::Client,
    s: GuardSettings,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    if s.config.node.pool_selector.is_empty() {
        return Err(Error::Usage {
            flag: "--config".into(),
            message: "node.pool_selector is empty: set it to the agent DaemonSet's nodeSelector \
                      (e.g. \"nvidia.com/gpu.present=true\")"
                .into(),
        });
    }
    let leases: Api<Lease> = Api::namespaced(requests.clone(), &s.namespace);
    let nodes: Api<Node> = Api::all(requests.clone());
    let mut unhealthy_since: HashMap<String, Instant> = HashMap::new();
    let mut leading = false;
    // The leader's watches and cache; `None` on a replica that does not hold the Lease.
    let mut watched: Option<Watched> = None;
    let mut last_renewed: Option<Instant> = None;
    let mut tick = tokio::time::interval(s.poll_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A change seen since the last sweep; sweeps on changes are at least MIN_SWEEP_GAP apart
    // (a burst of watch events costs one sweep).
    let mut changed = false;
    let mut last_sweep = tokio::time::Instant::now();
    // The next `--stale-after` deadline of a Node whose agent is not running: judged when due,
    // not only on the next tick.
    let mut due: Option<tokio::time::Instant> = None;
    tokio::pin!(shutdown);
    tracing::info!(identity = %s.identity, lease = %s.lease_name, "fabricgate guard started");
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = tick.tick() => {
                let lead = match try_lead(&leases, &s).await {
                    Ok(l) => {
                        last_renewed = l.then(Instant::now);
                        l
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "lease: cannot read or renew; not acting");
                        false
                    }
                };
                if lead != leading {
                    tracing::info!(identity = %s.identity, leader = lead, "leadership changed");
                    unhealthy_since.clear();
                    leading = lead;
                }
                // The watches live while this replica leads, and through a failed renewal as
                // long as its Lease cannot have passed to another replica yet (a short API
                // outage costs no new list).
                let keep = leading
                    || last_renewed.is_some_and(|t| t.elapsed() < s.lease_duration);
                if keep && watched.is_none() {
                    watched = Some(Watched::start(&requests, &watch, &s));
                } else if !keep && watched.take().is_some() {
                    tracing::info!("not leading: watches stopped, cache dropped");
                }
                if leading && let Some(w) = &mut watched {
                    w.sweep(&nodes, &s, &mut unhealthy_since).await;
                    changed = false;
                    last_sweep = tokio::time::Instant::now();
                    due = next_deadline(&unhealthy_since, s.stale_after);
                }
            }
            () = tokio::time::sleep_until(due.unwrap_or(last_sweep)), if due.is_some() && leading => {
                due = None;
                changed = true;
            }
            () = tokio::time::sleep_until(last_sweep + MIN_SWEEP_GAP), if changed && leading => {
                if let Some(w) = &mut watched {
                    w.sweep(&nodes, &s, &mut unhealthy_since).await;
                }
                changed = false;
                last_sweep = tokio::time::Instant::now();
                due = next_deadline(&unhealthy_since, s.stale_after);
            }
            Some(update) = next_update(&mut watched) => {
                let Some(w) = &mut watched else { continue };
                w.cache.apply(update);
                while let Ok(more) = w.rx.try_recv() {
                    w.cache.apply(more);
                }
                changed = true;
            }
        }
    }
    drop(watched);
    if leading {
        // Hand over at once: an expired lease lets the other replica take it.
        let _ = release(&leases, &s).await;
    }
    tracing::info!("fabricgate guard stopped");
    Ok(())
}

/// The earliest `--stale-after` deadline still ahead among the Nodes whose agent is not
/// running (those past it were judged already).
fn next_deadline(
    since: &HashMap<String, Instant>,
    stale_after: Duration,
) -> Option<tokio::time::Instant> {
    let now = Instant::now();
    since
        .values()
        .filter_map(|first| first.checked_add(stale_after))
        .filter(|d| *d > now)
        .min()
        .map(tokio::time::Instant::from_std)
}

/// The next change from the leader's watches; never, while there are none.
async fn next_update(watched: &mut Option<Watched>) -> Option<Update> {
    match watched {
        Some(w) => w.rx.recv().await,
        None => std::future::pending().await,
    }
}

/// What one of the leader's watches reports.
#[derive(Debug)]
enum Change<K> {
    /// A fresh LIST: everything there is (replaces the cache).
    Listed(Vec<K>),
    Applied(Box<K>),
    Deleted(Box<K>),
    /// The watch is established (again): the cache follows the server.
    Up,
    /// The watch broke or cannot be established: the cache may be behind.
    Down,
}

#[derive(Debug)]
enum Update {
    Node(Change<Node>),
    Pod(Change<Pod>),
}

/// The leader's two watches and the cache they feed. Dropping it stops the watches.
struct Watched {
    rx: mpsc::Receiver<Update>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    cache: Cache,
}

impl Watched {
    fn start(requests: &kube::Client, watch: &kube::Client, s: &GuardSettings) -> Watched {
        let (tx, rx) = mpsc::channel(1024);
        let backoff = max_backoff(s);
        let nodes = tokio::spawn(reflect(
            Api::<Node>::all(requests.clone()),
            Api::<Node>::all(watch.clone()),
            s.config.node.pool_selector.clone(),
            "the pool's Nodes",
            tx.clone(),
            Update::Node,
            backoff,
        ));
        let pods = tokio::spawn(reflect(
            Api::<Pod>::namespaced(requests.clone(), &s.namespace),
            Api::<Pod>::namespaced(watch.clone(), &s.namespace),
            s.pod_selector.clone(),
            "the agent pods",
            tx,
            Update::Pod,
            backoff,
        ));
        Watched {
            rx,
            tasks: vec![nodes, pods],
            cache: Cache::default(),
        }
    }

    /// [`sweep`] over the cache, once both watches have listed and are up; the Nodes the
    /// guard wrote go back into the cache.
    async fn sweep(
        &mut self,
        nodes: &Api<Node>,
        s: &GuardSettings,
        since: &mut HashMap<String, Instant>,
    ) {
        if !self.cache.ready() {
            return;
        }
        let mut wrote = Vec::new();
        if let Err(e) = sweep(nodes, &self.cache, s, since, &mut wrote).await {
            tracing::warn!(error = %e, "guard sweep failed; retrying");
        }
        for node in wrote {
            self.cache.wrote(node);
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// LIST `selector` once (from the watch cache), then WATCH from the list's resourceVersion
/// with bookmarks, resuming from the last version seen when a watch ends or breaks, and
/// listing again only on `410 Gone`. Failures back off from [`FIRST_BACKOFF`], doubling up to
/// `max_backoff`. Ends when `tx` is closed.
async fn reflect<K>(
    lists: Api<K>,
    watches: Api<K>,
    selector: String,
    what: &'static str,
    tx: mpsc::Sender<Update>,
    wrap: fn(Change<K>) -> Update,
    max_backoff: Duration,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt;
    let lp = ListParams::default().labels(&selector).match_any();
    let wp = WatchParams::default()
        .labels(&selector)
        .timeout(WATCH_TIMEOUT_SECS);
    let mut delay = FIRST_BACKOFF;
    let backoff = |delay: &mut Duration| {
        let now = *delay;
        *delay = (*delay * 2).min(max_backoff);
        now
    };
    let mut listed_at: Option<Instant> = None;
    'list: loop {
        // Listing again within a second of the last list (its version expired at once):
        // back off, never a tight loop.
        if listed_at.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            tokio::time::sleep(backoff(&mut delay)).await;
        }
        let list = match lists.list(&lp).await {
            Ok(l) => l,
            Err(e) => {
                let wait = backoff(&mut delay);
                tracing::warn!(error = %e, retry_in = ?wait, "cannot list {what}");
                if tx.send(wrap(Change::Down)).await.is_err() {
                    return;
                }
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        let mut version = list
            .metadata
            .resource_version
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "0".to_owned());
        listed_at = Some(Instant::now());
        tracing::info!(objects = list.items.len(), version = %version, "listed {what}");
        if tx.send(wrap(Change::Listed(list.items))).await.is_err() {
            return;
        }
        loop {
            let broke = match watches.watch(&wp, &version).await {
                Ok(stream) => {
                    if tx.send(wrap(Change::Up)).await.is_err() {
                        return;
                    }
                    let mut stream = stream.boxed();
                    let opened = Instant::now();
                    let mut broke = false;
                    while let Some(event) = stream.next().await {
                        let change = match event {
                            Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                                Change::Applied(Box::new(o))
                            }
                            Ok(WatchEvent::Deleted(o)) => Change::Deleted(Box::new(o)),
                            Ok(WatchEvent::Bookmark(b)) => {
                                version = b.metadata.resource_version;
                                continue;
                            }
                            Ok(WatchEvent::Error(e)) if e.code == 410 => {
                                tracing::info!(error = %e.message, "watch of {what} expired; listing again");
                                continue 'list;
                            }
                            Ok(WatchEvent::Error(e)) => {
                                tracing::warn!(error = %e.message, "watch of {what} failed");
                                broke = true;
                                break;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "watch of {what} broke");
                                broke = true;
                                break;
                            }
                        };
                        if let Some(v) = resource_version(&change) {
                            version = v;
                        }
                        delay = FIRST_BACKOFF;
                        if tx.send(wrap(change)).await.is_err() {
                            return;
                        }
                    }
                    // The server ends a watch after WATCH_TIMEOUT_SECS: re-watch at once. One
                    // that ends within a second is treated as broken (no tight loop).
                    broke || opened.elapsed() < Duration::from_secs(1)
                }
                Err(kube::Error::Api(e)) if e.code == 410 => {
                    tracing::info!(error = %e.message, "watch of {what} expired; listing again");
                    continue 'list;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch {what}");
                    true
                }
            };
            if broke {
                if tx.send(wrap(Change::Down)).await.is_err() {
                    return;
                }
                tokio::time::sleep(backoff(&mut delay)).await;
            }
        }
    }
}

fn resource_version<K: kube::Resource>(change: &Change<K>) -> Option<String> {
    match change {
        Change::Applied(o) | Change::Deleted(o) => o.meta().resource_version.clone(),
        _ => None,
    }
}

fn kube_err(action: &'static str, what: &str, source: kube::Error) -> Error {
    Error::Kube {
        action,
        node: what.to_owned(),
        source: Box::new(source),
    }
}

/// Acquire or renew the Lease; `true` while this replica holds it. Optimistic concurrency
/// (`resourceVersion`) decides between replicas racing for an expired Lease.
async fn try_lead(leases: &Api<Lease>, s: &GuardSettings) -> Result<bool> {
    let now = Timestamp::now();
    let secs = i32::try_from(s.lease_duration.as_secs())
        .unwrap_or(i32::MAX)
        .max(1);
    let current = leases
        .get_opt(&s.lease_name)
        .await
        .map_err(|e| kube_err("read", &s.lease_name, e))?;
    let Some(mut lease) = current else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(s.lease_name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(s.identity.clone()),
                lease_duration_seconds: Some(secs),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(kube_err("create", &s.lease_name, e)),
        };
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let mine = spec.holder_identity.as_deref() == Some(s.identity.as_str());
    let duration = Duration::from_secs(
        u64::try_from(spec.lease_duration_seconds.unwrap_or(secs)).unwrap_or(0),
    );
    let expired = spec.renew_time.as_ref().is_none_or(|t| {
        now.duration_since(t.0)
            .try_into()
            .is_ok_and(|age: Duration| age > duration)
    }) || spec.holder_identity.as_deref().is_none_or(str::is_empty);
    if !mine && !expired {
        return Ok(false);
    }
    let mut new_spec = spec.clone();
    new_spec.holder_identity = Some(s.identity.clone());
    new_spec.lease_duration_seconds = Some(secs);
    new_spec.renew_time = Some(MicroTime(now));
    if !mine {
        new_spec.acquire_time = Some(MicroTime(now));
        new_spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    lease.spec = Some(new_spec);
    match leases
        .replace(&s.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => {
            if !mine {
                tracing::info!(identity = %s.identity, "acquired the lease");
            }
            Ok(true)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(kube_err("renew", &s.lease_name, e)),
    }
}

async fn release(leases: &Api<Lease>, s: &GuardSettings) -> Result<()> {
    let patch = json!({ "spec": { "holderIdentity": null, "renewTime": null } });
    leases
        .patch(
            &s.lease_name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|e| kube_err("release", &s.lease_name, e))?;
    Ok(())
}

/// Why a Node's agent counts as not running, or `None` when its pod is Ready.
pub fn agent_problem(node: &str, pods: &[Pod]) -> Option<String> {
    let on_node: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    if on_node.is_empty() {
        return Some(format!("no fabricgate agent pod runs on {node}"));
    }
    let ready = on_node.iter().any(|p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    });
    if ready {
        None
    } else {
        let name = on_node[0].metadata.name.as_deref().unwrap_or("?");
        Some(format!(
            "the fabricgate agent pod {name} on {node} is not Ready (probe loop stalled, \
             crashing or not started)"
        ))
    }
}

/// The leader's copy of the pool's Nodes and the agent pods, fed by its watches.
#[derive(Default)]
struct Cache {
    /// The pool's Nodes (a slice, as `failclosed::count_pool` takes it) and where each is.
    nodes: Vec<Node>,
    node_at: HashMap<String, usize>,
    /// The agent pods by the Node they are bound to (`""`: not bound yet), and each pod's Node.
    pods: HashMap<String, Vec<Pod>>,
    pod_node: HashMap<String, String>,
    /// Both watches have listed, and are up.
    nodes_listed: bool,
    pods_listed: bool,
    nodes_up: bool,
    pods_up: bool,
    /// Nodes the guard wrote: the resourceVersion of its last write, which the Node watch
    /// echoes back. Until it does, older versions of that Node from the watch are ignored (a
    /// sweep in between must not act on the Node as it was before the write).
    echo: HashMap<String, String>,
}

/// Drop what no decision reads from a cached Node: its managed fields and its list of container
/// images (together often most of a GPU Node's bytes). Kept: metadata (labels, annotations,
/// resourceVersion), `spec.taints`, `status.conditions` and the rest of the status.
fn slim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    if let Some(status) = node.status.as_mut() {
        status.images = None;
    }
}

/// Keep of a cached agent pod what [`agent_problem`] reads: its metadata (without managed
/// fields), `spec.nodeName` and `status.conditions`.
fn slim_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        node_name: pod.spec.as_mut().and_then(|sp| sp.node_name.take()),
        ..Default::default()
    });
    pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
        conditions: pod.status.as_mut().and_then(|st| st.conditions.take()),
        ..Default::default()
    });
}

fn name_of(meta: &ObjectMeta) -> Option<String> {
    meta.name.clone()
}

fn pod_node_name(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|sp| sp.node_name.clone())
        .unwrap_or_default()
}

impl Cache {
    /// Both watches have listed and are up: a sweep may act.
    fn ready(&self) -> bool {
        self.nodes_listed && self.pods_listed && self.nodes_up && self.pods_up
    }

    fn apply(&mut self, update: Update) {
        match update {
            Update::Node(Change::Listed(nodes)) => {
                self.nodes.clear();
                self.node_at.clear();
                self.echo.clear();
                for n in nodes {
                    self.put_node(n);
                }
                self.nodes_listed = true;
                self.nodes_up = true;
            }
            Update::Node(Change::Applied(n)) => {
                let Some(name) = name_of(&n.metadata) else {
                    return;
                };
                if let Some(awaited) = self.echo.get(&name) {
                    if n.metadata.resource_version.as_ref() != Some(awaited) {
                        return;
                    }
                    self.echo.remove(&name);
                }
                self.put_node(*n);
            }
            Update::Node(Change::Deleted(n)) => {
                if let Some(name) = name_of(&n.metadata) {
                    self.echo.remove(&name);
                    self.remove_node(&name);
                }
            }
            Update::Node(Change::Up) => self.nodes_up = true,
            Update::Node(Change::Down) => self.nodes_up = false,
            Update::Pod(Change::Listed(pods)) => {
                self.pods.clear();
                self.pod_node.clear();
                for p in pods {
                    self.put_pod(p);
                }
                self.pods_listed = true;
                self.pods_up = true;
            }
            Update::Pod(Change::Applied(p)) => self.put_pod(*p),
            Update::Pod(Change::Deleted(p)) => {
                if let Some(name) = name_of(&p.metadata) {
                    self.remove_pod(&name);
                }
            }
            Update::Pod(Change::Up) => self.pods_up = true,
            Update::Pod(Change::Down) => self.pods_up = false,
        }
    }

    /// A Node as the guard's own write returned it (newer than what the watch showed so far).
    fn wrote(&mut self, node: Node) {
        if let (Some(name), Some(rv)) = (
            name_of(&node.metadata),
            node.metadata.resource_version.clone(),
        ) {
            self.echo.insert(name, rv);
        }
        self.put_node(node);
    }

    fn put_node(&mut self, mut node: Node) {
        let Some(name) = name_of(&node.metadata) else {
            return;
        };
        slim_node(&mut node);
        if let Some(&i) = self.node_at.get(&name) {
            self.nodes[i] = node;
        } else {
            self.node_at.insert(name, self.nodes.len());
            self.nodes.push(node);
        }
    }

    fn remove_node(&mut self, name: &str) {
        let Some(i) = self.node_at.remove(name) else {
            return;
        };
        self.nodes.swap_remove(i);
        if let Some(moved) = self.nodes.get(i).and_then(|n| name_of(&n.metadata)) {
            self.node_at.insert(moved, i);
        }
    }

    fn put_pod(&mut self, mut pod: Pod) {
        let Some(name) = name_of(&pod.metadata) else {
            return;
        };
        slim_pod(&mut pod);
        self.remove_pod(&name);
        let node = pod_node_name(&pod);
        self.pod_node.insert(name, node.clone());
        self.pods.entry(node).or_default().push(pod);
    }

    fn remove_pod(&mut self, name: &str) {
        let Some(node) = self.pod_node.remove(name) else {
            return;
        };
        if let Some(list) = self.pods.get_mut(&node) {
            list.retain(|p| p.metadata.name.as_deref() != Some(name));
            if list.is_empty() {
                self.pods.remove(&node);
            }
        }
    }

    /// The agent pods bound to `node`.
    fn pods_on(&self, node: &str) -> &[Pod] {
        self.pods.get(node).map_or(&[], Vec::as_slice)
    }
}

/// Judge every pool Node of the cache: taint one whose agent has been missing or not Ready
/// for `stale_after` (no API reads; the Nodes written go to `wrote`).
async fn sweep(
    nodes: &Api<Node>,
    cache: &Cache,
    s: &GuardSettings,
    since: &mut HashMap<String, Instant>,
    wrote: &mut Vec<Node>,
) -> Result<()> {
    let pool = &cache.nodes;
    let key = s.config.node.taint_key();
    let now = Instant::now();
    since.retain(|n, _| cache.node_at.contains_key(n));
    for node in pool {
        let Some(name) = node.metadata.name.clone() else {
            continue;
        };
        let Some(problem) = agent_problem(&name, cache.pods_on(&name)) else {
            since.remove(&name);
            continue;
        };
        let first = *since.entry(name.clone()).or_insert(now);
        if now.duration_since(first) < s.stale_after {
            continue;
        }
        let tainted = node
            .spec
            .as_ref()
            .and_then(|sp| sp.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == key));
        if tainted {
            continue;
        }
        let (annotation, overridden) =
            failclosed::breaker_override(node, &s.config.node.label_prefix);
        let counted = failclosed::count_pool(
            pool,
            &name,
            &key,
            s.config.node.breaker.window,
            &Timestamp::now(),
        );
        let message = format!(
            "{problem} for over {}; tainted by fabricgate guard until the agent validates \
             the node again",
            humantime::format_duration(s.stale_after)
        );
        match failclosed::taint_decision(
            &s.config.node.breaker,
            Some(&counted),
            overridden,
            &annotation,
        ) {
            TaintDecision::Taint => {
                wrote.push(taint(nodes, node, &key, s).await?);
                wrote.push(set_condition(nodes, &name, AGENT_NOT_RUNNING, &message).await?);
                tracing::warn!(node = %name, "{message}");
            }
            TaintDecision::BreakerOpen { message: why } => {
                let reason_now = fabric_reason(node);
                if reason_now.as_deref() != Some(failclosed::BREAKER_OPEN) {
                    let text = format!("{why}; would taint for {AGENT_NOT_RUNNING}: {message}");
                    wrote.push(set_condition(nodes, &name, failclosed::BREAKER_OPEN, &text).await?);
                    tracing::error!(node = %name, "BLAST-RADIUS BREAKER OPEN (guard): {why}");
                }
            }
        }
    }
    Ok(())
}

fn fabric_reason(node: &Node) -> Option<String> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "FabricReady")?
        .reason
        .clone()
}

/// Add our taint, guarded by the resourceVersion it was computed from (a conflict is retried
/// on the next sweep).
async fn taint(nodes: &Api<Node>, node: &Node, key: &str, s: &GuardSettings) -> Result<Node> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let mut taints = node
        .spec
        .as_ref()
        .and_then(|sp| sp.taints.clone())
        .unwrap_or_default();
    taints.push(k8s_openapi::api::core::v1::Taint {
        key: key.to_owned(),
        effect: s.config.node.taint_effect.as_str().to_owned(),
        ..Default::default()
    });
    crate::node::patch_taints(nodes, node, &taints, GUARD_FIELD_MANAGER)
        .await
        .map_err(|e| kube_err("taint", &name, e))
}

async fn set_condition(nodes: &Api<Node>, name: &str, reason: &str, message: &str) -> Result<Node> {
    let now = Timestamp::now();
    let body = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name },
        "status": { "conditions": [{
            "type": "FabricReady", "status": "False", "reason": reason, "message": message,
            "lastTransitionTime": now.to_string(), "lastHeartbeatTime": now.to_string(),
        }]},
    });
    nodes
        .patch_status(
            name,
            &PatchParams::apply(GUARD_FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(|e| kube_err("set FabricReady on", name, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};

    fn pod(node: &str, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("agent-{node}")),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    fn node(name: &str, rv: &str, tainted: bool) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                ..ObjectMeta::default()
            },
            spec: Some(k8s_openapi::api::core::v1::NodeSpec {
                taints: tainted.then(|| {
                    vec![k8s_openapi::api::core::v1::Taint {
                        key: "fabricgate.io/unvalidated".into(),
                        effect: "NoSchedule".into(),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Node::default()
        }
    }

    fn names(cache: &Cache) -> Vec<String> {
        let mut v: Vec<String> = cache
            .nodes
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        v.sort();
        v
    }

    fn rv_of(cache: &Cache, name: &str) -> Option<String> {
        let i = *cache.node_at.get(name)?;
        cache.nodes[i].metadata.resource_version.clone()
    }

    #[test]
    fn the_cache_follows_lists_and_watch_events_and_is_ready_only_while_both_watches_are_up() {
        let mut c = Cache::default();
        assert!(!c.ready());
        c.apply(Update::Node(Change::Listed(vec![
            node("a", "1", false),
            node("b", "1", false),
            node("c", "1", false),
        ])));
        assert!(!c.ready(), "the pods are not listed yet");
        c.apply(Update::Pod(Change::Listed(vec![pod("a", true)])));
        assert!(c.ready());
        // A delete in the middle keeps every other Node findable (swap_remove).
        c.apply(Update::Node(Change::Deleted(Box::new(node(
            "a", "2", false,
        )))));
        assert_eq!(names(&c), ["b", "c"]);
        for n in ["b", "c"] {
            assert_eq!(c.nodes[c.node_at[n]].metadata.name.as_deref(), Some(n));
        }
        c.apply(Update::Node(Change::Applied(Box::new(node(
            "d", "3", false,
        )))));
        c.apply(Update::Node(Change::Applied(Box::new(node(
            "b", "4", true,
        )))));
        assert_eq!(names(&c), ["b", "c", "d"]);
        assert_eq!(rv_of(&c, "b").as_deref(), Some("4"));
        c.apply(Update::Pod(Change::Down));
        assert!(!c.ready(), "a broken watch: no sweeps on what may be stale");
        c.apply(Update::Pod(Change::Up));
        assert!(c.ready());
        // A relist replaces everything.
        c.apply(Update::Node(Change::Listed(vec![node("z", "9", false)])));
        assert_eq!(names(&c), ["z"]);
    }

    #[test]
    fn pods_are_found_by_the_node_they_are_bound_to() {
        let mut c = Cache::default();
        let mut unbound = pod("x", false);
        unbound.spec = Some(PodSpec::default());
        c.apply(Update::Pod(Change::Listed(vec![unbound, pod("b", true)])));
        assert!(c.pods_on("x").is_empty());
        assert_eq!(agent_problem("b", c.pods_on("b")), None);
        // Bound to x now, then not Ready, then gone.
        c.apply(Update::Pod(Change::Applied(Box::new(pod("x", true)))));
        assert_eq!(agent_problem("x", c.pods_on("x")), None);
        assert_eq!(c.pods.get("").map(Vec::len), None, "moved, not copied");
        c.apply(Update::Pod(Change::Applied(Box::new(pod("x", false)))));
        assert!(
            agent_problem("x", c.pods_on("x"))
                .unwrap()
                .contains("not Ready")
        );
        c.apply(Update::Pod(Change::Deleted(Box::new(pod("x", false)))));
        assert!(
            agent_problem("x", c.pods_on("x"))
                .unwrap()
                .contains("no fabricgate agent pod")
        );
        assert_eq!(c.pods_on("b").len(), 1);
    }

    #[test]
    fn after_its_own_write_the_cache_ignores_older_versions_until_the_watch_echoes_it() {
        let mut c = Cache::default();
        c.apply(Update::Node(Change::Listed(vec![node("a", "5", false)])));
        c.wrote(node("a", "8", true));
        // The watch is still delivering versions older than the write: ignored.
        c.apply(Update::Node(Change::Applied(Box::new(node(
            "a", "6", false,
        )))));
        assert_eq!(rv_of(&c, "a").as_deref(), Some("8"));
        // The echo of the write, then anyone's later change, are taken.
        c.apply(Update::Node(Change::Applied(Box::new(node(
            "a", "8", true,
        )))));
        c.apply(Update::Node(Change::Applied(Box::new(node(
            "a", "9", false,
        )))));
        assert_eq!(rv_of(&c, "a").as_deref(), Some("9"));
        // A relist forgets what was awaited.
        c.wrote(node("a", "12", true));
        c.apply(Update::Node(Change::Listed(vec![node("a", "11", false)])));
        c.apply(Update::Node(Change::Applied(Box::new(node(
            "a", "13", false,
        )))));
        assert_eq!(rv_of(&c, "a").as_deref(), Some("13"));
    }

    #[test]
    fn missing_or_not_ready_agent_pods_are_problems() {
        let pods = vec![pod("a", true), pod("b", false)];
        assert_eq!(agent_problem("a", &pods), None);
        assert!(agent_problem("b", &pods).unwrap().contains("not Ready"));
        assert!(
            agent_problem("c", &pods)
                .unwrap()
                .contains("no fabricgate agent pod")
        );
    }
}
