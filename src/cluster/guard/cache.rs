//! The leader's cache of the pool's Nodes and the agent pods (and, with `runtime.on_sockets:
//! evict`, the pods on sockets): `kube::runtime` reflector stores, fed by the guard's loop (not by `reflector()` on the streams) so that it can hold
//! back stale versions of a Node it just wrote and tell when each watch is live.

use crate::cluster::slim_node;
use crate::transport::eviction::TRANSPORT_READY;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::{ObjectRef, store::Writer};
use kube::runtime::watcher::{self, Event};
use std::collections::HashMap;
use std::sync::Arc;

/// What the leader's watches report.
#[derive(Debug)]
pub(super) enum Update {
    /// Boxed: a Node or pod is kilobytes, the markers are nothing.
    Node(Box<watcher::Result<Event<Node>>>),
    Pod(Box<watcher::Result<Event<Pod>>>),
    /// The server accepted a watch request (again): after an error, the cache follows it
    /// again even while nothing changes (a watch that resumes quietly yields no event).
    NodesWatching,
    PodsWatching,
    /// The watch of running pods (`runtime.on_sockets: evict`).
    Transport(Box<watcher::Result<Event<Pod>>>),
    TransportWatching,
}

/// The leader's copy of the pool's Nodes and the agent pods, fed by its watches.
#[derive(Default)]
pub(super) struct Cache {
    nodes: Writer<Node>,
    pods: Writer<Pod>,
    nodes_watch: WatchState,
    pods_watch: WatchState,
    /// Of the running pods, only those whose `fabricgate.io/TransportReady` is `False` (slimmed
    /// by [`slim_transport_pod`]): the others are dropped as they arrive.
    transport: Writer<Pod>,
    transport_watch: WatchState,
    /// Nodes the guard wrote: the resourceVersion of its last write, which the Node watch
    /// echoes back. Until it does, older versions of that Node from the watch are ignored (a
    /// sweep in between must not act on the Node as it was before the write).
    echo: HashMap<String, String>,
}

/// Where one watch stands.
#[derive(Default)]
struct WatchState {
    /// A list has completed: the store holds everything there was.
    listed: bool,
    /// The watch follows the server (no error since it was last established).
    up: bool,
    /// Between a list's start and its end: the store still shows what was there before.
    listing: bool,
}

impl WatchState {
    /// Book one event of the watch, once applied to the store (`objects`: what it holds now);
    /// `what` names the watch in the logs.
    fn event<K>(&mut self, event: &watcher::Result<Event<K>>, what: &str, objects: usize) {
        match event {
            Ok(Event::Init) => self.listing = true,
            Ok(Event::InitApply(_)) => {}
            Ok(Event::InitDone) => {
                self.listing = false;
                self.listed = true;
                self.up = true;
                tracing::info!(objects, "listed {what}");
            }
            Ok(Event::Apply(_) | Event::Delete(_)) => self.up = true,
            // The watcher lists again: until then the cache follows what it had (as it did
            // before the version expired).
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                tracing::info!(error = %status.message, "watch of {what} expired; listing again");
            }
            Err(e) => {
                self.up = false;
                match e {
                    watcher::Error::InitialListFailed(e) => {
                        tracing::warn!(error = %e, "cannot list {what}");
                    }
                    watcher::Error::WatchStartFailed(e) => {
                        tracing::warn!(error = %e, "cannot watch {what}");
                    }
                    watcher::Error::WatchError(status) => {
                        tracing::warn!(error = %status.message, "watch of {what} failed");
                    }
                    e => tracing::warn!(error = %e, "watch of {what} broke"),
                }
            }
        }
    }

    /// The server accepted a watch request: live again, unless a list is still under way.
    fn watching(&mut self) {
        if self.listed && !self.listing {
            self.up = true;
        }
    }
}

/// Keep of a cached agent pod what [`super::agent_problem`] reads: its metadata (without
/// managed fields), `spec.nodeName` and `status.conditions`.
pub(super) fn slim_pod(pod: &mut Pod) {
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

/// Keep of a running pod what the eviction decision reads
/// ([`crate::transport::eviction::plan`]): name, namespace, UID, resourceVersion, deletion
/// timestamp, `spec.nodeName` and the `fabricgate.io/TransportReady` condition.
pub(super) fn slim_transport_pod(pod: &mut Pod) {
    let m = std::mem::take(&mut pod.metadata);
    pod.metadata = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        deletion_timestamp: m.deletion_timestamp,
        ..Default::default()
    };
    pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        node_name: pod.spec.as_mut().and_then(|sp| sp.node_name.take()),
        ..Default::default()
    });
    let conditions = pod
        .status
        .as_mut()
        .and_then(|st| st.conditions.take())
        .map(|cs| {
            cs.into_iter()
                .filter(|c| c.type_ == TRANSPORT_READY)
                .collect::<Vec<_>>()
        })
        .filter(|cs| !cs.is_empty());
    pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
        conditions,
        ..Default::default()
    });
}

/// Whether the cache keeps a (slimmed) running pod: its transport condition is `False`.
fn keeps(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == TRANSPORT_READY && c.status == "False")
        })
}

impl Cache {
    /// Both watches have listed and are up: a sweep may act.
    pub(super) fn ready(&self) -> bool {
        self.nodes_watch.listed
            && self.pods_watch.listed
            && self.nodes_watch.up
            && self.pods_watch.up
    }

    pub(super) fn apply(&mut self, update: Update) {
        match update {
            Update::Node(event) => {
                if let Ok(e) = &*event
                    && self.takes(e)
                {
                    self.nodes.apply_watcher_event(e);
                }
                let objects = self.nodes.as_reader().len();
                self.nodes_watch.event(&event, "the pool's Nodes", objects);
            }
            Update::Pod(event) => {
                if let Ok(e) = &*event {
                    self.pods.apply_watcher_event(e);
                }
                let objects = self.pods.as_reader().len();
                self.pods_watch.event(&event, "the agent pods", objects);
            }
            Update::NodesWatching => self.nodes_watch.watching(),
            Update::PodsWatching => self.pods_watch.watching(),
            Update::Transport(event) => {
                match &*event {
                    // A pod that is not (or no longer) False leaves the store.
                    Ok(Event::Apply(p)) if !keeps(p) => {
                        self.transport
                            .apply_watcher_event(&Event::Delete(p.clone()));
                    }
                    Ok(Event::InitApply(p)) if !keeps(p) => {}
                    Ok(e) => self.transport.apply_watcher_event(e),
                    Err(_) => {}
                }
                let objects = self.transport.as_reader().len();
                self.transport_watch
                    .event(&event, "the running pods not on RDMA", objects);
            }
            Update::TransportWatching => self.transport_watch.watching(),
        }
    }

    /// The running pods whose transport condition is `False`, once their watch has listed
    /// and is up; `None` before (or without that watch).
    pub(super) fn transport_pods(&self) -> Option<Vec<Arc<Pod>>> {
        (self.transport_watch.listed && self.transport_watch.up)
            .then(|| self.transport.as_reader().state())
    }

    /// Whether a Node event goes into the store: not an older version of a Node the guard
    /// wrote, until the watch echoes that write.
    fn takes(&mut self, event: &Event<Node>) -> bool {
        match event {
            Event::Apply(n) => {
                let Some(name) = n.metadata.name.as_deref() else {
                    return false;
                };
                if let Some(awaited) = self.echo.get(name) {
                    if n.metadata.resource_version.as_ref() != Some(awaited) {
                        return false;
                    }
                    self.echo.remove(name);
                }
            }
            Event::Delete(n) => {
                if let Some(name) = n.metadata.name.as_deref() {
                    self.echo.remove(name);
                }
            }
            // A completed list replaces everything, versions awaited included.
            Event::InitDone => self.echo.clear(),
            Event::Init | Event::InitApply(_) => {}
        }
        true
    }

    /// A Node as the guard's own write returned it (newer than what the watch showed so far).
    pub(super) fn wrote(&mut self, mut node: Node) {
        let (Some(name), Some(rv)) = (
            node.metadata.name.clone(),
            node.metadata.resource_version.clone(),
        ) else {
            return;
        };
        slim_node(&mut node);
        self.echo.insert(name, rv);
        self.nodes.apply_watcher_event(&Event::Apply(node));
    }

    /// The pool's Nodes, by name (the order the apiserver lists them in).
    pub(super) fn nodes(&self) -> Vec<Arc<Node>> {
        let mut nodes = self.nodes.as_reader().state();
        nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        nodes
    }

    pub(super) fn has_node(&self, name: &str) -> bool {
        self.nodes.as_reader().get(&ObjectRef::new(name)).is_some()
    }

    /// The agent pods by the Node they are bound to (`""`: not bound yet).
    pub(super) fn pods_by_node(&self) -> HashMap<String, Vec<Arc<Pod>>> {
        let mut by_node: HashMap<String, Vec<Arc<Pod>>> = HashMap::new();
        for pod in self.pods.as_reader().state() {
            let node = pod
                .spec
                .as_ref()
                .and_then(|sp| sp.node_name.clone())
                .unwrap_or_default();
            by_node.entry(node).or_default().push(pod);
        }
        by_node
    }
}
