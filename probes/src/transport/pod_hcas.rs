//! The RDMA devices in a pod's own network namespace (docs/dra.md, "Exclusive
//! RDMA network namespaces"). In RDMA netns mode `exclusive` a DRA driver moves an allocated
//! HCA into the pod's namespace: the node's sysfs, its netlink and libibverbs no longer list
//! it. Only RDMA netlink from a socket opened in the pod's namespace does: one of the pod's
//! processes names the namespace (`/proc/<pid>/ns/net`), a short-lived thread enters it and
//! opens the socket ([`Socket::open_in_netns`]), and the device and port dumps
//! ([`restrack::read_ports`]) list what the pod holds, with each port's state.

use super::Observed;
use super::procs;
use super::restrack::{self, NetlinkPort};
use crate::Roots;
use crate::error::{ProbeError, Result};
use crate::netlink::{Protocol, Socket};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::Path;

/// What one pod's network namespace holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodHcas {
    pub pod_uid: String,
    /// The process whose namespace was entered.
    pub pid: Option<u32>,
    /// Every port of every RDMA device its namespace lists; or why it could not be looked at.
    pub ports: Observed<Vec<NetlinkPort>>,
}

/// Why a pod's namespace was not looked at: no process of it is visible here.
pub const NO_PROCESS: &str = "no process of the pod is visible on this node (not started, \
     or the agent is not in the host PID namespace: hostPID: true, \
     deploy/overlays/runtime-transport)";
/// Why a pod's namespace was not looked at: it is the agent's own (a `hostNetwork` pod), whose
/// devices the node's probe already lists.
pub const SHARES_AGENT_NETNS: &str = "the pod shares the agent's network namespace \
     (hostNetwork): its RDMA devices are the node's";

/// RDMA netlink in a network namespace: the live kernel ([`LiveNamespaces`]) or recorded
/// replies in tests.
pub trait NamespaceRdma: std::fmt::Debug + Send {
    /// Every port of every RDMA device the namespace `ns` (`<procfs>/<pid>/ns/net`) lists.
    ///
    /// # Errors
    /// [`ProbeError::Netns`] when it cannot be entered, `Read` with `NotFound` when its
    /// process exited, [`ProbeError::RdmaNetlinkUnavailable`] without RDMA netlink, `Netlink`
    /// for bad replies.
    fn ports(&mut self, ns: &Path) -> Result<Vec<NetlinkPort>>;
}

/// The running kernel.
#[derive(Debug, Default)]
pub struct LiveNamespaces;

impl NamespaceRdma for LiveNamespaces {
    fn ports(&mut self, ns: &Path) -> Result<Vec<NetlinkPort>> {
        let mut socket = Socket::open_in_netns(Protocol::RDMA, ns).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ProbeError::read(ns, e),
            _ if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) => restrack::io_error(e),
            _ => ProbeError::Netns {
                path: ns.to_owned(),
                source: e,
            },
        })?;
        restrack::read_ports(&mut socket)
    }
}

/// Look into the network namespace of each pod of `wanted` (pod UIDs): `pods` are the pods'
/// processes by UID (`procs::pod_processes`); the first process whose namespace can be named
/// is the way in. One dump per namespace, whatever number of pods share it.
pub fn look(
    roots: &Roots,
    pods: &BTreeMap<String, Vec<u32>>,
    wanted: &BTreeSet<String>,
    rdma: &mut dyn NamespaceRdma,
) -> Vec<PodHcas> {
    let own = procs::netns_id(roots, "self").ok();
    let mut dumps: HashMap<u64, Observed<Vec<NetlinkPort>>> = HashMap::new();
    let mut out = Vec::new();
    for uid in wanted {
        let found = pods.get(uid).into_iter().flatten().find_map(|&pid| {
            let netns = procs::netns_id(roots, &pid.to_string()).ok()?;
            Some((pid, netns))
        });
        let Some((pid, netns)) = found else {
            out.push(PodHcas {
                pod_uid: uid.clone(),
                pid: None,
                ports: Observed::Unseen {
                    reason: NO_PROCESS.to_owned(),
                },
            });
            continue;
        };
        let ports = if Some(netns) == own {
            Observed::Unseen {
                reason: SHARES_AGENT_NETNS.to_owned(),
            }
        } else {
            dumps
                .entry(netns)
                .or_insert_with(
                    || match rdma.ports(&procs::netns_path(roots, &pid.to_string())) {
                        Ok(ports) => Observed::Seen(ports),
                        Err(e) => Observed::Unseen {
                            reason: e.to_string(),
                        },
                    },
                )
                .clone()
        };
        out.push(PodHcas {
            pod_uid: uid.clone(),
            pid: Some(pid),
            ports,
        });
    }
    out
}

#[cfg(test)]
mod tests;
