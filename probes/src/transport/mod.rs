//! Runtime facts per pod: which processes hold RDMA queue pairs, and which pod
//! each process belongs to. Pure parsers and thin readers; the agent joins them with the
//! pods it watches.
//!
//! - [`restrack`]: RDMA resource tracking over netlink → every QP with its owner.
//! - [`cgroup`]: `/proc/<pid>/cgroup` → pod UID and container ID ([`pod_of_pid`]).
//! - [`pod_hcas`]: the RDMA devices and ports in a pod's own network namespace (exclusive
//!   RDMA netns mode: an HCA a DRA driver moved there).
//! - [`ports`]: what an RDMA port moved over a window (IPoIB taken off on InfiniBand).
//! - [`PodTransportFacts`]: what one pod was seen doing, the input of the agent's per-pod
//!   verdict (`policy::transport`).

pub mod cgroup;
pub mod pod_hcas;
pub mod ports;
pub mod procs;
pub mod restrack;
pub mod sample;
pub mod tcp;

use crate::Roots;
use crate::error::{ProbeError, Result};
use cgroup::{CgroupOwner, PodCgroup};
use restrack::{QpEntry, QpOwner};
use serde::Serialize;
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::time::Duration;

/// What one pod was seen doing over one sampling window: the queue pairs its processes hold
/// and its TCP with other nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodTransportFacts {
    /// The pod's UID (dashes), as in its cgroup path and `metadata.uid`.
    pub pod_uid: String,
    /// The QPs owned by the pod's processes, or why they could not be listed.
    pub qps: Observed<Vec<QpEntry>>,
    /// Its TCP with other nodes over the window, or why it could not be measured.
    pub internode_tcp: Observed<InternodeTcp>,
    /// The ports its data-path QPs are on: what each carried over the window and who else
    /// holds data-path QPs there (empty when it holds none, or the QPs could not be listed).
    pub ports: Vec<ports::PortTraffic>,
}

/// A fact seen, or the reason it could not be (for `unknown` and its message: "the agent is
/// not in the host PID namespace; add hostPID: true (deploy/overlays/runtime-transport)").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Observed<T> {
    Seen(T),
    Unseen { reason: String },
}

/// A pod's TCP with its peers (the pods of its job on other nodes, at any of their addresses)
/// over one window, whatever interface carried it (IPoIB included), and apart from it the TCP
/// with any other address off the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct InternodeTcp {
    /// Bytes sent plus received with the peers over the window.
    pub bytes: u64,
    /// Bytes sent plus received with other addresses off the node (object storage, a dataset
    /// server, a pod of another job): reported, never deciding `sockets`.
    pub other_bytes: u64,
    /// How long the sample really covered.
    pub window: Duration,
    /// The distinct remote addresses (sorted) the bytes went to or came from.
    pub peers: Vec<IpAddr>,
    /// The local interfaces that carried them (`ib0`, `eth0`; sorted; empty when unknown).
    pub interfaces: Vec<String>,
}

/// Whose a queue pair is, once its owner's PID is looked up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum QpAttribution {
    Pod(PodCgroup),
    /// A process outside any pod.
    Host,
    /// A `kubepods` cgroup path of a shape not known.
    Unrecognized {
        path: String,
    },
    /// A kernel module's QP (`ib_core`).
    Kernel {
        name: String,
    },
    /// The owner's PID is not visible (another PID namespace).
    Hidden,
    /// The process exited between the QP dump and the read of its cgroup.
    ProcessGone,
    /// Its cgroup file could not be read (the error, for the message).
    Unreadable {
        error: String,
    },
}

/// A QP and its owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttributedQp {
    pub qp: QpEntry,
    pub owner: QpAttribution,
}

/// Attribute each QP to its pod, reading each owner PID's cgroup once however many QPs it
/// holds.
pub fn attribute(roots: &Roots, qps: Vec<QpEntry>) -> Vec<AttributedQp> {
    let mut by_pid: HashMap<u32, QpAttribution> = HashMap::new();
    qps.into_iter()
        .map(|qp| {
            let owner = match &qp.owner {
                QpOwner::Kernel(name) => QpAttribution::Kernel { name: name.clone() },
                QpOwner::Hidden => QpAttribution::Hidden,
                QpOwner::Pid(pid) => by_pid
                    .entry(*pid)
                    .or_insert_with(|| match pod_of_pid(roots, *pid) {
                        Ok(Some(CgroupOwner::Pod(pod))) => QpAttribution::Pod(pod),
                        Ok(Some(CgroupOwner::Host)) => QpAttribution::Host,
                        Ok(Some(CgroupOwner::Unrecognized { path })) => {
                            QpAttribution::Unrecognized { path }
                        }
                        Ok(None) => QpAttribution::ProcessGone,
                        Err(e) => QpAttribution::Unreadable {
                            error: e.to_string(),
                        },
                    })
                    .clone(),
            };
            AttributedQp { qp, owner }
        })
        .collect()
}

/// Whose cgroup process `pid` is in; `Ok(None)` when the process is gone (it exited between
/// the QP dump and this read: its QPs are gone with it).
///
/// # Errors
/// [`ProbeError::Read`] for any other failure to read `<procfs>/<pid>/cgroup`.
pub fn pod_of_pid(roots: &Roots, pid: u32) -> Result<Option<CgroupOwner>> {
    let path = roots.proc(format!("{pid}/cgroup"));
    match crate::sysfs_io::read_to_string(&path) {
        Ok(text) => Ok(Some(cgroup::parse_proc_cgroup(&text))),
        // ESRCH: the process became a zombie after the open.
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            Ok(None)
        }
        Err(e) => Err(ProbeError::read(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_read_through_roots_and_a_pid_gone() {
        let dir = tempfile::tempdir().unwrap();
        let proc = dir.path().join("proc");
        std::fs::create_dir_all(proc.join("120")).unwrap();
        std::fs::write(
            proc.join("120/cgroup"),
            "0::/kubepods/besteffort/pod5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f/abc\n",
        )
        .unwrap();
        let roots = Roots::new(dir.path().join("sys"), &proc);
        let Some(CgroupOwner::Pod(pod)) = pod_of_pid(&roots, 120).unwrap() else {
            panic!("pid 120 is in a pod");
        };
        assert_eq!(pod.pod_uid, "5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f");
        assert_eq!(pod.container_id.as_deref(), Some("abc"));
        // Exited between the dump and the read: gone, not an error.
        assert_eq!(pod_of_pid(&roots, 121).unwrap(), None);
    }

    /// The captured dump and cgroups of the Soft-RoCE VM: the RC server (pid 140) was moved
    /// into a kubepods cgroup, its client (150) was not, 162 has exited since, 171's cgroup
    /// file is a folder (unreadable); the GSI QP is the kernel's.
    #[test]
    fn captured_qps_attributed_to_the_pod_the_host_and_the_gone() {
        let dir = tempfile::tempdir().unwrap();
        let proc = dir.path().join("proc");
        let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/restrack");
        for pid in ["140", "150"] {
            std::fs::create_dir_all(proc.join(pid)).unwrap();
            std::fs::copy(
                format!("{fixtures}/cgroup-{pid}"),
                proc.join(pid).join("cgroup"),
            )
            .unwrap();
        }
        std::fs::create_dir_all(proc.join("171/cgroup")).unwrap();
        let reply = [
            std::fs::read(format!("{fixtures}/qp-0-00.bin")).unwrap(),
            std::fs::read(format!("{fixtures}/qp-0-01.bin")).unwrap(),
        ];
        let qps = restrack::parse_qp_dump(&reply).unwrap();
        let roots = Roots::new(dir.path().join("sys"), &proc);
        let owners: Vec<QpAttribution> = attribute(&roots, qps)
            .into_iter()
            .map(|a| a.owner)
            .collect();
        let QpAttribution::Pod(pod) = &owners[0] else {
            panic!("{:?}", owners[0]);
        };
        assert_eq!(pod.pod_uid, "5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f");
        assert_eq!(pod.qos.as_deref(), Some("besteffort"));
        assert_eq!(pod.runtime, Some(cgroup::Runtime::Containerd));
        assert_eq!(owners[1], QpAttribution::Host);
        assert_eq!(owners[2], QpAttribution::ProcessGone);
        assert!(
            matches!(&owners[3], QpAttribution::Unreadable { error } if error.contains("171")),
            "{:?}",
            owners[3]
        );
        assert_eq!(
            owners[4],
            QpAttribution::Kernel {
                name: "ib_core".into()
            }
        );
    }

    /// This test process is not in a pod (nor gone) on the live procfs.
    #[test]
    fn the_live_procfs_answers_for_this_process() {
        let roots = Roots::new("/sys", "/proc");
        let owner = pod_of_pid(&roots, std::process::id()).unwrap();
        assert!(owner.is_some());
    }
}
