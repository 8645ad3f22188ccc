//! The per-pod sampler (issue 42): one call lists the QPs of every pod and measures each pod's
//! TCP with other nodes since the previous call. Stateful (it keeps each pod's byte baseline),
//! never sleeps: the agent calls it once a `runtime.window`, `fabricgate check` twice
//! `--pods-window` apart.
//!
//! CONTRACT (the agent and `check` build on these names; the implementation behind them is
//! the probes' work): `PodSampler::new(roots)`, `PodSampler::sample(&mut self, &SampleRequest)`
//! → `Vec<PodTransportFacts>`, one per pod in the request that has a baseline from an earlier
//! call (a pod seen for the first time gets its baseline now and appears from the next call).

use super::PodTransportFacts;
use crate::Roots;
use std::collections::BTreeSet;
use std::net::IpAddr;

/// Which remote addresses are "other nodes".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteScope {
    /// Without a cluster (`fabricgate check`): any address not on this node (not loopback,
    /// not one of the node's own addresses, not in one of this node's pods' networks).
    NotLocal,
    /// With the cluster: the other Nodes' addresses (`status.addresses`) and the other Nodes'
    /// pod CIDRs (`spec.podCIDRs`).
    Nodes {
        addresses: BTreeSet<IpAddr>,
        /// (network address, prefix length)
        pod_cidrs: Vec<(IpAddr, u8)>,
    },
}

/// What to sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleRequest {
    /// The pods to sample by UID; `None`: every pod cgroup that holds QPs or moves TCP to a
    /// remote address (`fabricgate check` without a cluster).
    pub pod_uids: Option<BTreeSet<String>>,
    /// Pods that share the host's network namespace (`hostNetwork: true`): their own sockets
    /// are counted, not the namespace's.
    pub host_network: BTreeSet<String>,
    pub remote: RemoteScope,
}

/// The sampler and its baselines.
#[derive(Debug)]
pub struct PodSampler {
    roots: Roots,
}

impl PodSampler {
    pub fn new(roots: Roots) -> Self {
        Self { roots }
    }

    pub fn roots(&self) -> &Roots {
        &self.roots
    }

    /// One sample of the pods of `request`.
    pub fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts> {
        let _ = request;
        Vec::new()
    }
}
