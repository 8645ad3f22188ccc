//! The HCAs the claims of this node's pods hold, seen from inside the pods' network namespaces
//! (issue 42 item 6; docs/dra.md, "Exclusive RDMA network namespaces"). In RDMA netns mode
//! `exclusive` an HCA a DRA driver moved into a pod is gone from the node's probe; RDMA
//! netlink from a socket opened in the pod's namespace still lists it with its ports
//! (`fabricgate_probes::runtime::pod_hcas`). Every probe interval, and whenever the claims
//! change, each pod that names a claim is looked into once; what each shows is merged into
//! the DRA facts and judged in [`crate::policy::dra`].
//!
//! TEST SEAM, never set in a deployment: `FABRICGATE_TEST_POD_NAMESPACES=<file>` makes each
//! look read what the pods' namespaces list from a file instead of entering them, so the
//! cluster tests can show the shipped agent an HCA inside a pod (no RDMA device there; the
//! real look is tested on the Soft-RoCE VM, tests/vm/netns_vm.rs). One line per port:
//! `<pod uid> <device> <port> <state code> <physical state code>` (`4 5`: ACTIVE, LinkUp); a
//! pod with no line has no process here. Everything after the look (merge, judgment, rules)
//! is the real path.

use crate::policy::dra::{ClaimedDevice, PodNamespaceHcas};
use fabricgate_probes::Roots;
use fabricgate_probes::rdma::types::{PhysState, PortState};
use fabricgate_probes::runtime::Observed;
use fabricgate_probes::runtime::pod_hcas::{self, LiveNamespaces};
use fabricgate_probes::runtime::procs;
use fabricgate_probes::runtime::restrack::NetlinkPort;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::sync::watch;

/// Look into the namespaces of the pods the claims name, every `interval` and on each change
/// of the claims, and send what each shows when that changes. Ends when the claims do.
pub async fn look_into_claims(
    roots: Roots,
    interval: Duration,
    mut claims: watch::Receiver<Vec<ClaimedDevice>>,
    tx: watch::Sender<Vec<PodNamespaceHcas>>,
) {
    loop {
        let pods = claim_pods(&claims.borrow_and_update());
        let views = if pods.is_empty() {
            Vec::new()
        } else {
            let roots = roots.clone();
            match tokio::task::spawn_blocking(move || look(&roots, &pods)).await {
                Ok(views) => views,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => {
                    tracing::warn!(error = %e, "looking into the claims' pods failed; next interval");
                    Vec::new()
                }
            }
        };
        tx.send_if_modified(|seen| {
            let changed = *seen != views;
            *seen = views;
            changed
        });
        tokio::select! {
            c = claims.changed() => if c.is_err() { return },
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// The pods the claims name: UID → `namespace/name` (a pod without a UID cannot be found).
pub fn claim_pods(claims: &[ClaimedDevice]) -> BTreeMap<String, String> {
    claims
        .iter()
        .flat_map(|c| c.pod_uids.iter().zip(&c.pods))
        .filter(|(uid, _)| !uid.is_empty())
        .map(|(uid, name)| (uid.clone(), name.clone()))
        .collect()
}

pub const ENV: &str = "FABRICGATE_TEST_POD_NAMESPACES";

/// One look: the pods' processes from procfs, then each pod's namespace.
fn look(roots: &Roots, pods: &BTreeMap<String, String>) -> Vec<PodNamespaceHcas> {
    if let Some(path) = std::env::var_os(ENV) {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        return from_lines(&text, pods);
    }
    let (processes, _) = procs::pod_processes(roots);
    let wanted: BTreeSet<String> = pods.keys().cloned().collect();
    pod_hcas::look(roots, &processes, &wanted, &mut LiveNamespaces)
        .into_iter()
        .filter_map(|seen| {
            Some(PodNamespaceHcas {
                pod: pods.get(&seen.pod_uid)?.clone(),
                ports: seen.ports,
            })
        })
        .collect()
}

/// The test seam's file, read as the look would have seen it.
fn from_lines(text: &str, pods: &BTreeMap<String, String>) -> Vec<PodNamespaceHcas> {
    let mut ports: BTreeMap<&str, Vec<NetlinkPort>> = BTreeMap::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let [uid, device, port, state, phys] = w.as_slice() else {
            continue;
        };
        let (Ok(port), Ok(state), Ok(phys)) = (port.parse(), state.parse(), phys.parse()) else {
            continue;
        };
        ports.entry(uid).or_default().push(NetlinkPort {
            device: (*device).to_owned(),
            port,
            state: Some(PortState::from_code(state)),
            physical_state: Some(PhysState::from_code(phys)),
            netdev: None,
        });
    }
    pods.iter()
        .map(|(uid, pod)| PodNamespaceHcas {
            pod: pod.clone(),
            ports: match ports.remove(uid.as_str()) {
                Some(ports) => Observed::Seen(ports),
                None => Observed::Unseen {
                    reason: pod_hcas::NO_PROCESS.to_owned(),
                },
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seams_lines_read_as_a_look_and_bad_lines_are_skipped() {
        let pods: BTreeMap<String, String> = [
            ("u1".to_owned(), "train/w-0".to_owned()),
            ("u2".to_owned(), "train/w-1".to_owned()),
        ]
        .into();
        let seen = from_lines("u1 mlx5_3 1 1 3\nu1 mlx5_3 x 4 5\ngarbage\n", &pods);
        assert_eq!(seen.len(), 2);
        let Observed::Seen(ports) = &seen[0].ports else {
            panic!("{seen:?}")
        };
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].state, Some(PortState::Down));
        assert_eq!(ports[0].physical_state, Some(PhysState::Disabled));
        assert!(matches!(&seen[1].ports, Observed::Unseen { .. }));
    }

    #[test]
    fn the_claims_pods_are_found_by_uid_and_a_pod_not_on_this_node_says_so() {
        let held = ClaimedDevice {
            driver: "dra.net".into(),
            pool: "node-a".into(),
            device: "pci-0000-1b-00-0".into(),
            claim: "train/w-0-rdma".into(),
            pods: vec!["train/w-0".into(), "train/nouid".into()],
            pod_uids: vec!["uid-w-0".into(), String::new()],
        };
        let pods = claim_pods(&[held]);
        assert_eq!(
            pods,
            [("uid-w-0".to_owned(), "train/w-0".to_owned())].into()
        );
        // An empty procfs: no process of the pod, said as such.
        let dir = tempfile::tempdir().unwrap();
        let roots = Roots::new(dir.path().join("sys"), dir.path().join("proc"));
        let views = look(&roots, &pods);
        assert_eq!(views.len(), 1);
        assert_eq!(views[0].pod, "train/w-0");
        assert!(
            matches!(&views[0].ports, Observed::Unseen { reason } if reason == pod_hcas::NO_PROCESS)
        );
    }
}
