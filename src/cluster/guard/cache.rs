//! The leader's cache of the pool's Nodes and the agent pods.

use super::watch::{Change, Update};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::HashMap;

/// The leader's copy of the pool's Nodes and the agent pods, fed by its watches.
#[derive(Default)]
pub(super) struct Cache {
    /// The pool's Nodes (a slice, as `failclosed::count_pool` takes it) and where each is.
    pub(super) nodes: Vec<Node>,
    pub(super) node_at: HashMap<String, usize>,
    /// The agent pods by the Node they are bound to (`""`: not bound yet), and each pod's Node.
    pub(super) pods: HashMap<String, Vec<Pod>>,
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
    pub(super) fn ready(&self) -> bool {
        self.nodes_listed && self.pods_listed && self.nodes_up && self.pods_up
    }

    pub(super) fn apply(&mut self, update: Update) {
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
    pub(super) fn wrote(&mut self, node: Node) {
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
    pub(super) fn pods_on(&self, node: &str) -> &[Pod] {
        self.pods.get(node).map_or(&[], Vec::as_slice)
    }
}
