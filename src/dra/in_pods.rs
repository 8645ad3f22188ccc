//! The HCAs the claims of this node's pods hold, seen from inside the pods' network namespaces
//! (docs/dra.md, "Exclusive RDMA network namespaces"). In RDMA netns mode
//! `exclusive` an HCA a DRA driver moved into a pod is gone from the node's probe; RDMA
//! netlink from a socket opened in the pod's namespace still lists it with its ports
//! (`fabricgate_probes::transport::pod_hcas`). Every probe interval, and whenever the claims
//! change, each pod that names a claim is looked into once; what each shows is merged into
//! the DRA facts and judged in [`super::assess`].
//!
//! Tested for real on the Soft-RoCE VM with the agent daemon and the real apiserver
//! (tests/vm/dra_netns_vm.rs).

use super::assess::{ClaimedDevice, PodNamespaceHcas};
use fabricgate_probes::Roots;
use fabricgate_probes::transport::pod_hcas::{self, LiveNamespaces};
use fabricgate_probes::transport::procs;
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
        .flat_map(|c| &c.pods)
        .filter(|p| !p.uid.is_empty())
        .map(|p| (p.uid.clone(), p.name.clone()))
        .collect()
}

/// One look: the pods' processes from procfs, then each pod's namespace.
fn look(roots: &Roots, pods: &BTreeMap<String, String>) -> Vec<PodNamespaceHcas> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::assess::ClaimPod;
    use fabricgate_probes::transport::Observed;

    #[test]
    fn the_claims_pods_are_found_by_uid_and_a_pod_not_on_this_node_says_so() {
        let held = ClaimedDevice {
            driver: "dra.net".into(),
            pool: "node-a".into(),
            device: "pci-0000-1b-00-0".into(),
            claim: "train/w-0-rdma".into(),
            pods: vec![
                ClaimPod {
                    name: "train/w-0".into(),
                    uid: "uid-w-0".into(),
                },
                ClaimPod {
                    name: "train/nouid".into(),
                    uid: String::new(),
                },
            ],
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
