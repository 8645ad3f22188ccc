//! Keeps the Node's labels, taint and conditions equal to the verdict, writing only the
//! difference between what the Node shows and what the verdict wants.
//!
//! - labels: server-side apply (field manager `fabricgate`), so labels we stop setting are
//!   removed by the API server and labels of other owners are never touched;
//! - the taint: `spec.taints` is an atomic list, so a JSON patch guarded by a `test` on
//!   `metadata.resourceVersion`, retried on conflict, that changes only our key;
//! - conditions: server-side apply on the status subresource (the list is a map keyed by
//!   `type`, so we own just our types);
//! - an `events.k8s.io/v1` Event at each `FabricReady` transition.
//!
//! `plan` decides what to write (pure), `reconciler` writes it (asking `breaker`, the
//! blast-radius breaker's reads and ledger, before a new taint), `watch` follows the Node and
//! `client` builds the two API clients the agent uses.

pub(crate) mod breaker;
mod client;
mod plan;
pub mod pods_watch;
mod reconciler;
mod watch;

pub(crate) use client::is_watch;
pub use client::{Clients, RetryAfter, WATCH_TIMEOUT_SECS, client, clients_from};
pub use plan::{Plan, Transition, owned_labels, plan};
pub use reconciler::Reconciler;
pub(crate) use reconciler::patch_taints;
pub use watch::watch_node;
pub(crate) use watch::{FIRST_BACKOFF, WatchBackoff};

/// Field manager of every write, and the owner name `kubectl get node -o yaml
/// --show-managed-fields` shows.
pub const FIELD_MANAGER: &str = "fabricgate";
/// `reportingController` of our Events.
pub const REPORTING_CONTROLLER: &str = "fabricgate.io/agent";
/// Node conditions fabricgate owns.
pub const CONDITION_TYPES: [&str; 4] =
    ["FabricReady", "RDMAReady", "LustreReady", "GPUDirectReady"];
/// Namespace of Events about Nodes (cluster-scoped objects), as the kubelet does.
pub const EVENT_NAMESPACE: &str = "default";

/// What a reconcile did (the breaker's reads and ledger write included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Requests made (reads and writes).
    pub requests: u32,
    /// Writes made.
    pub writes: u32,
}

#[cfg(test)]
pub(crate) mod tests;
