//! Which devices of the configured DRA drivers the ResourceClaims of this node's pods hold
//! (docs/dra.md, "Exclusive RDMA network namespaces"). In RDMA netns mode
//! `exclusive` a DRA driver moves an allocated HCA into the pod's network namespace, where the
//! agent's probe no longer sees it: the claim says it is in use, not gone.
//!
//! The claims come from this node's pods (the runtime transport's pods watch: ResourceClaims
//! have no field selector for a node, and a cluster-wide claims watch would send every agent
//! every claim's changes): each claim a running pod names is read once (GET), once allocated,
//! and forgotten when no pod names it. What the claims mean is decided in
//! [`super::assess`]; this only reads them.

use super::assess::{ClaimPod, ClaimedDevice, DraFacts, PodNamespaceHcas};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::sync::watch;

/// A claim named by a pod but not (yet) allocated, or not readable, is asked for again after
/// this long (a pod change asks at once).
const RETRY: Duration = Duration::from_secs(10);

/// `(namespace, claim name)`.
type ClaimKey = (String, String);

/// One device of a claim's allocation: `(driver, pool, device)`.
type Allocated = (String, String, String);

/// The claims the running pods of `pods` name, each with those pods. A
/// claim is named by `status.resourceClaimStatuses` (claims made from a template) or by
/// `spec.resourceClaims[].resourceClaimName` (a claim made beforehand).
pub fn claim_refs<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
) -> BTreeMap<ClaimKey, Vec<ClaimPod>> {
    let mut out: BTreeMap<ClaimKey, Vec<ClaimPod>> = BTreeMap::new();
    for pod in pods {
        let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            continue;
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let status = pod.status.as_ref();
        let finished = status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed");
        if finished {
            continue;
        }
        let from_status = status
            .and_then(|s| s.resource_claim_statuses.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|c| c.resource_claim_name.clone());
        let from_spec = pod
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|c| c.resource_claim_name.clone());
        let names: BTreeSet<String> = from_status.chain(from_spec).collect();
        for claim in names {
            out.entry((ns.clone(), claim)).or_default().push(ClaimPod {
                name: format!("{ns}/{name}"),
                uid: uid.clone(),
            });
        }
    }
    out
}

/// The devices of `drivers` a claim's allocation holds; `None` while it is not allocated.
pub fn allocated(claim: &ResourceClaim, drivers: &BTreeSet<String>) -> Option<Vec<Allocated>> {
    let allocation = claim.status.as_ref()?.allocation.as_ref()?;
    let results = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    Some(
        results
            .iter()
            .filter(|r| drivers.contains(&r.driver))
            .map(|r| (r.driver.clone(), r.pool.clone(), r.device.clone()))
            .collect(),
    )
}

/// Every claimed device, each with its claim and the pods that name it.
pub fn claimed(
    refs: &BTreeMap<ClaimKey, Vec<ClaimPod>>,
    allocations: &BTreeMap<ClaimKey, Vec<Allocated>>,
) -> Vec<ClaimedDevice> {
    let mut out = Vec::new();
    for (key, pods) in refs {
        for (driver, pool, device) in allocations.get(key).into_iter().flatten() {
            out.push(ClaimedDevice {
                driver: driver.clone(),
                pool: pool.clone(),
                device: device.clone(),
                claim: format!("{}/{}", key.0, key.1),
                pods: pods.clone(),
            });
        }
    }
    out.sort();
    out
}

/// Follow the claims of this node's pods and send the devices they hold whenever that
/// changes. Ends when the pods watch does.
pub async fn follow_claims(
    client: kube::Client,
    drivers: BTreeSet<String>,
    mut pods: watch::Receiver<BTreeMap<String, Pod>>,
    tx: watch::Sender<Vec<ClaimedDevice>>,
) {
    let mut allocations: BTreeMap<ClaimKey, Vec<Allocated>> = BTreeMap::new();
    let mut told_forbidden = false;
    loop {
        let refs = claim_refs(pods.borrow_and_update().values());
        allocations.retain(|k, _| refs.contains_key(k));
        let mut pending = false;
        for key in refs.keys() {
            if allocations.contains_key(key) {
                continue;
            }
            let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &key.0);
            match api.get_opt(&key.1).await {
                Ok(Some(claim)) => match allocated(&claim, &drivers) {
                    Some(devices) => {
                        allocations.insert(key.clone(), devices);
                    }
                    None => pending = true,
                },
                Ok(None) => pending = true,
                Err(e) => {
                    pending = true;
                    let forbidden = matches!(&e, kube::Error::Api(s) if s.code == 403);
                    if forbidden && !told_forbidden {
                        told_forbidden = true;
                        tracing::warn!(claim = %format!("{}/{}", key.0, key.1), error = %e,
                            "the agent may not read ResourceClaims: an HCA moved into a pod \
                             counts as missing; grant resource.k8s.io resourceclaims get \
                             (deploy/overlays/runtime-transport)");
                    } else {
                        tracing::debug!(error = %e, "reading a ResourceClaim failed");
                    }
                }
            }
        }
        let now = claimed(&refs, &allocations);
        tx.send_if_modified(|held| {
            let changed = *held != now;
            *held = now;
            changed
        });
        let changed = if pending {
            tokio::select! {
                c = pods.changed() => c,
                () = tokio::time::sleep(RETRY) => Ok(()),
            }
        } else {
            pods.changed().await
        };
        if changed.is_err() {
            return;
        }
    }
}

/// The slices' facts with the claims' devices and what their pods' namespaces show in: what
/// the probe loop judges.
pub async fn merge_claims(
    mut slices: watch::Receiver<Option<DraFacts>>,
    mut claims: watch::Receiver<Vec<ClaimedDevice>>,
    mut in_pods: watch::Receiver<Vec<PodNamespaceHcas>>,
    out: watch::Sender<Option<DraFacts>>,
) {
    let mut slices_open = true;
    let mut claims_open = true;
    let mut in_pods_open = true;
    loop {
        let merged = slices.borrow_and_update().clone().map(|mut f| {
            f.claimed = claims.borrow_and_update().clone();
            f.in_pods = in_pods.borrow_and_update().clone();
            f
        });
        out.send_if_modified(|facts| {
            let changed = *facts != merged;
            *facts = merged;
            changed
        });
        tokio::select! {
            r = slices.changed(), if slices_open => slices_open = r.is_ok(),
            r = claims.changed(), if claims_open => claims_open = r.is_ok(),
            r = in_pods.changed(), if in_pods_open => in_pods_open = r.is_ok(),
            else => return,
        }
        if !slices_open {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, phase: &str, status_claims: &[&str], spec_claims: &[&str]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "train", "uid": format!("uid-{name}")},
            "spec": {"containers": [],
                "resourceClaims": spec_claims.iter().map(|c|
                    serde_json::json!({"name": "r", "resourceClaimName": c})).collect::<Vec<_>>()},
            "status": {"phase": phase,
                "resourceClaimStatuses": status_claims.iter().map(|c|
                    serde_json::json!({"name": "rdma", "resourceClaimName": c})).collect::<Vec<_>>()},
        }))
        .unwrap()
    }

    fn claim(results: Option<serde_json::Value>) -> ResourceClaim {
        let mut c = serde_json::json!({
            "metadata": {"name": "w-0-rdma", "namespace": "train"},
            "spec": {},
        });
        if let Some(r) = results {
            c["status"] = serde_json::json!({"allocation": {"devices": {"results": r}}});
        }
        serde_json::from_value(c).unwrap()
    }

    #[test]
    fn running_pods_name_their_claims_from_status_and_spec_finished_ones_do_not() {
        let pods = [
            pod("w-0", "Running", &["w-0-rdma"], &[]),
            pod("w-1", "Pending", &[], &["shared-rdma"]),
            pod("w-2", "Running", &["w-2-rdma"], &["shared-rdma"]),
            pod("done", "Succeeded", &["done-rdma"], &[]),
        ];
        let refs = claim_refs(&pods);
        let key = |c: &str| ("train".to_owned(), c.to_owned());
        assert_eq!(
            refs.keys().cloned().collect::<Vec<_>>(),
            vec![key("shared-rdma"), key("w-0-rdma"), key("w-2-rdma")]
        );
        let pod = |n: &str| ClaimPod {
            name: format!("train/{n}"),
            uid: format!("uid-{n}"),
        };
        assert_eq!(refs[&key("shared-rdma")], vec![pod("w-1"), pod("w-2")]);
        assert_eq!(refs[&key("w-0-rdma")], vec![pod("w-0")]);
    }

    #[test]
    fn only_an_allocated_claims_devices_of_the_configured_drivers_count() {
        let drivers: BTreeSet<String> = ["dra.net".to_owned()].into();
        assert_eq!(allocated(&claim(None), &drivers), None, "not allocated yet");
        let c = claim(Some(serde_json::json!([
            {"request": "r", "driver": "dra.net", "pool": "node-a", "device": "pci-0000-1b-00-0"},
            {"request": "g", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"},
        ])));
        let devices = allocated(&c, &drivers).unwrap();
        assert_eq!(
            devices,
            vec![(
                "dra.net".to_owned(),
                "node-a".to_owned(),
                "pci-0000-1b-00-0".to_owned()
            )]
        );
        let refs = claim_refs(&[pod("w-0", "Running", &["w-0-rdma"], &[])]);
        let allocations = [(("train".to_owned(), "w-0-rdma".to_owned()), devices)].into();
        let held = claimed(&refs, &allocations);
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].claim, "train/w-0-rdma");
        assert_eq!(
            held[0].pods,
            vec![ClaimPod {
                name: "train/w-0".into(),
                uid: "uid-w-0".into(),
            }]
        );
        assert_eq!(held[0].device, "pci-0000-1b-00-0");
    }
}
