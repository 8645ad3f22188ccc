//! Cluster-level controllers: the guard (a Deployment that taints nodes whose agent is gone),
//! the Lease both it and the Kueue admission check (`crate::gang`) elect their leader with,
//! and the cleanup `helm uninstall` runs.

pub mod cleanup;
pub mod guard;
pub mod lease;

/// Objects per page of the controllers' lists (each page is deserialized whole before its
/// objects are slimmed for the cache).
pub(crate) const LIST_PAGE: u32 = 500;

/// Of a cached Node, what the controllers' decisions read: metadata (labels, annotations such
/// as the peers endpoint, resourceVersion) without managed fields, the spec (taints), and of
/// the status the conditions and addresses. A GPU Node's images, capacity, allocatable and
/// nodeInfo are most of its 10-15 kB, times the pool.
pub(crate) fn slim_node(node: &mut k8s_openapi::api::core::v1::Node) {
    node.metadata.managed_fields = None;
    node.status = node
        .status
        .take()
        .map(|s| k8s_openapi::api::core::v1::NodeStatus {
            conditions: s.conditions,
            addresses: s.addresses,
            ..Default::default()
        });
}
