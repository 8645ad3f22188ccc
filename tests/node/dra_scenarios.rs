//! The DRA scenarios on the real node: Kubernetes' own behaviour around a DRA driver in
//! DraNet's format (the `draplugin` of the test control plane, `dra.rs`): the slice, claims
//! allocated by the scheduler, `DeviceTaintRule`s (NoSchedule, NoExecute), the plugin killed
//! and the kubelet restarted. Each leaves the node as it found it: the slice published, no
//! rule, no DRA pod.

use super::dra::{
    self, DRIVER, NS, PLUGIN, WIPING_DELAY, allocated_devices, claim_pod, claim_template,
    compute_hcas, delete_pods, device_taint_rule, hca_device_name, pod, pool, rdma_devices_cel,
    wait_no_slice, wait_running, wait_slice,
};
use super::harness::{RealNode, wait_for};
use super::scenarios::{INTERVAL, RECOVER_AFTER, wait_validated};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// What a watch event, a kubectl round trip and a busy 2-core machine may add to a bound.
const SLACK: Duration = Duration::from_secs(10);
/// A pod's claim allocated, its sandbox and container started.
const POD_START: Duration = Duration::from_secs(120);
const TAINT_KEY: &str = "fabricgate.io/unvalidated";

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what()) }
}

/// The slice: one for the node, pool = node name, owned by the Node, the fixture's 10 HCAs
/// named and described as DraNet does, no taints. kube-controller-manager runs the
/// controllers DRA needs.
pub fn slice_in_dranet_format(node: &RealNode) -> Result<(), String> {
    for c in [
        "resourceclaim-controller",
        "device-taint-eviction-controller",
    ] {
        check(dra::controller_started(node, c), || {
            format!("kube-controller-manager did not start {c}")
        })?;
    }
    let slice = wait_slice(node, Duration::from_secs(60))?;
    let spec = &slice["spec"];
    check(spec["driver"] == DRIVER, || format!("driver: {spec}"))?;
    check(spec["nodeName"] == node.name.as_str(), || {
        format!("nodeName: {spec}")
    })?;
    check(pool(&slice) == node.name, || format!("pool: {spec}"))?;
    check(spec["pool"]["resourceSliceCount"] == 1, || {
        format!("pool: {spec}")
    })?;
    let owner = &slice["metadata"]["ownerReferences"][0];
    check(
        owner["kind"] == "Node" && owner["name"] == node.name.as_str(),
        || format!("owner: {owner}"),
    )?;
    let hcas = dra::fixture_hcas();
    let devices = dra::devices(&slice);
    check(hcas.len() == 10 && devices.len() == 10, || {
        format!("{} fixture HCAs, {} devices", hcas.len(), devices.len())
    })?;
    let mut names = Vec::new();
    for h in &hcas {
        let want = h.device_name();
        let d = devices
            .iter()
            .find(|d| d["name"] == want.as_str())
            .ok_or_else(|| format!("no device {want} for {} in the slice", h.name))?;
        let mut attrs = json!({
            "dra.net/rdma": {"bool": true},
            "dra.net/rdmaDevice": {"string": h.name},
            "dra.net/pciAddress": {"string": h.pci_address},
            "resource.kubernetes.io/pcieRoot": {"string": h.pcie_root},
        });
        if let Some(n) = h.numa_node {
            attrs["dra.net/numaNode"] = json!({"int": n});
            attrs["resource.kubernetes.io/numaNode"] = json!({"int": n});
        }
        if let Some(ifname) = &h.netdev {
            attrs["dra.net/ifName"] = json!({"string": ifname});
        }
        for (k, v) in attrs.as_object().into_iter().flatten() {
            check(dra::attr(d, k) == Some(v), || {
                format!(
                    "{want} ({}): {k} is {:?}, want {v}",
                    h.name,
                    dra::attr(d, k)
                )
            })?;
        }
        check(
            h.netdev.is_some() || dra::attr(d, "dra.net/ifName").is_none(),
            || format!("{want}: an IB-only HCA with dra.net/ifName: {d}"),
        )?;
        check(d.get("taints").is_none(), || {
            format!("{want} has taints: {d}")
        })?;
        names.push(format!("{}={want}", h.name));
    }
    check(compute_hcas().len() == 8, || {
        format!("compute HCAs: {:?}", compute_hcas())
    })?;
    println!("figure: dra.net slice devices: {}", names.join(" "));
    for h in hcas
        .iter()
        .filter(|h| h.name == "mlx5_3" || h.name == "mlx5_8")
    {
        let d = devices
            .iter()
            .find(|d| d["name"] == h.device_name().as_str());
        println!(
            "figure: {} = {}",
            h.name,
            d.map(|d| d.to_string()).unwrap_or_default()
        );
    }
    Ok(())
}

/// Pods claiming one compute HCA each through a ResourceClaimTemplate: allocated by the
/// scheduler (distinct devices of the node's pool), prepared by the plugin, running.
pub fn claims_allocate_one_hca_per_pod(node: &RealNode) -> Result<(), String> {
    let slice = wait_slice(node, Duration::from_secs(60))?;
    let compute: Vec<String> = compute_hcas()
        .iter()
        .filter_map(|h| hca_device_name(&slice, h))
        .map(|d| format!("{}/{d}", node.name))
        .collect();
    node.apply(&claim_template(
        "one-hca",
        1,
        &rdma_devices_cel(&compute_hcas()),
    ))?;
    let t0 = Instant::now();
    let pods = ["dra-one-0", "dra-one-1", "dra-one-2"];
    for p in pods {
        node.apply(&claim_pod(p, "one-hca"))?;
    }
    for p in pods {
        wait_running(node, p, POD_START)?;
    }
    println!(
        "figure: 3 pods with one-HCA claims created -> all Running {}",
        dra::secs(t0)
    );
    let mut seen = Vec::new();
    for p in pods {
        let got = allocated_devices(node, p);
        check(got.len() == 1 && compute.contains(&got[0]), || {
            format!("{p} allocated {got:?}, want one of {compute:?}")
        })?;
        check(!seen.contains(&got[0]), || {
            format!("{} allocated twice ({seen:?})", got[0])
        })?;
        seen.push(got[0].clone());
    }
    let log = std::fs::read_to_string(node.logs.join("draplugin.log")).unwrap_or_default();
    check(log.matches("prepare dra/").count() >= pods.len(), || {
        format!(
            "the plugin prepared fewer than {} claims:\n{log}",
            pods.len()
        )
    })?;
    delete_pods(node)
}

fn rule_name(device: &str) -> String {
    format!("fg-test-{device}")
}

fn delete_rule(node: &RealNode, name: &str) -> Result<(), String> {
    node.kubectl(&["delete", "devicetaintrule", name, "--ignore-not-found"])
        .map(|_| ())
}

/// A NoSchedule `DeviceTaintRule` on mlx5_3's device: the scheduler allocates seven one-HCA
/// claims around it; a pod asking for all eight compute HCAs stays Pending (its events say
/// why); the rule deleted, it is scheduled with mlx5_3 among its devices.
pub fn noschedule_rule_steers_allocation(node: &RealNode) -> Result<(), String> {
    let slice = wait_slice(node, Duration::from_secs(60))?;
    let dev3 = hca_device_name(&slice, "mlx5_3").ok_or("no mlx5_3 in the slice")?;
    let tainted = format!("{}/{dev3}", node.name);
    let rule = rule_name(&dev3);
    node.apply(&device_taint_rule(
        &rule,
        &pool(&slice),
        &dev3,
        TAINT_KEY,
        "NoSchedule",
    ))?;
    let result = (|| {
        // The scheduler's informer sees the rule before the first claim is allocated.
        std::thread::sleep(Duration::from_secs(2));
        let events = dra::claims_go_around(node, "dra-around", &tainted, POD_START)?;
        std::thread::sleep(INTERVAL / 2);
        let p = pod(node, "dra-all").ok_or("no dra-all pod")?;
        check(
            p["status"]["phase"] == "Pending" && p["spec"]["nodeName"].is_null(),
            || {
                format!(
                    "the all-HCA pod was scheduled past the taint: {}",
                    p["status"]
                )
            },
        )?;
        let failed: Vec<&String> = events
            .iter()
            .filter(|e| e.starts_with("FailedScheduling"))
            .collect();
        println!("figure: all-8-HCA pod Pending, events: {failed:?}");
        check(
            failed
                .iter()
                .any(|e| e.contains("cannot allocate all claims")),
            || format!("FailedScheduling does not say the claim cannot be allocated: {failed:?}"),
        )?;
        let claims = node
            .get_json(&["resourceclaims", "-n", NS])
            .and_then(|l| l["items"].as_array().cloned())
            .unwrap_or_default();
        check(
            claims.len() == 1 && claims[0]["status"]["allocation"].is_null(),
            || format!("the all-HCA claim should exist, unallocated: {claims:?}"),
        )?;
        let t1 = Instant::now();
        delete_rule(node, &rule)?;
        wait_running(node, "dra-all", POD_START)?;
        println!(
            "figure: NoSchedule rule deleted -> the all-8-HCA pod Running {}",
            dra::secs(t1)
        );
        let got = allocated_devices(node, "dra-all");
        check(got.len() == 8 && got.contains(&tainted), || {
            format!("the all-HCA pod got {got:?}, want 8 with {tainted}")
        })?;
        Ok(())
    })();
    let _ = delete_rule(node, &rule);
    let cleaned = delete_pods(node);
    result.and(cleaned)
}

fn condition(pod: &Value, kind: &str) -> Option<Value> {
    pod.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

/// A NoExecute `DeviceTaintRule` on the device a running pod holds: kube-controller-manager's
/// device-taint-eviction-controller marks the pod `DisruptionTarget`
/// (`DeletionByDeviceTaintManager`) and deletes it; the kubelet stops it.
pub fn noexecute_rule_evicts_the_pod(node: &RealNode) -> Result<(), String> {
    let slice = wait_slice(node, Duration::from_secs(60))?;
    let dev3 = hca_device_name(&slice, "mlx5_3").ok_or("no mlx5_3 in the slice")?;
    let held = format!("{}/{dev3}", node.name);
    node.apply(&claim_template(
        "mlx5-3",
        1,
        &rdma_devices_cel(&["mlx5_3".into()]),
    ))?;
    node.apply(&claim_pod("dra-victim", "mlx5-3"))?;
    wait_running(node, "dra-victim", POD_START)?;
    let got = allocated_devices(node, "dra-victim");
    check(got == [held.clone()], || {
        format!("dra-victim got {got:?}, want {held}")
    })?;
    let uid = pod(node, "dra-victim")
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
        .ok_or("no dra-victim uid")?;
    let rule = rule_name(&dev3);
    let t0 = Instant::now();
    node.apply(&device_taint_rule(
        &rule,
        &pool(&slice),
        &dev3,
        TAINT_KEY,
        "NoExecute",
    ))?;
    let result = (|| {
        let mut disruption: Option<(Duration, Value)> = None;
        let mut deleting = None;
        let gone = wait_for(
            "dra-victim evicted and gone",
            Duration::from_secs(90),
            || match pod(node, "dra-victim") {
                Some(p) if p["metadata"]["uid"] == uid.as_str() => {
                    if disruption.is_none()
                        && let Some(c) = condition(&p, "DisruptionTarget")
                    {
                        disruption = Some((t0.elapsed(), c));
                    }
                    if deleting.is_none() && !p["metadata"]["deletionTimestamp"].is_null() {
                        deleting = Some(t0.elapsed());
                    }
                    false
                }
                _ => node.get_json(&["pods", "-n", NS]).is_some(),
            },
        )?;
        let rule_status = node
            .get_json(&["devicetaintrule", &rule])
            .map(|r| r["status"].clone())
            .unwrap_or_default();
        println!(
            "figure: NoExecute rule on mlx5_3 -> DisruptionTarget {:?}, deletionTimestamp {deleting:?}, pod gone {gone:?}",
            disruption.as_ref().map(|d| d.0)
        );
        println!("figure: DeviceTaintRule status after the eviction: {rule_status}");
        let (_, c) = disruption.ok_or("no DisruptionTarget condition seen before the pod went")?;
        check(
            c["status"] == "True" && c["reason"] == "DeletionByDeviceTaintManager",
            || format!("DisruptionTarget: {c}"),
        )?;
        check(deleting.is_some(), || "no deletionTimestamp seen".into())?;
        Ok(())
    })();
    let _ = delete_rule(node, &rule);
    let cleaned = delete_pods(node);
    result.and(cleaned)
}

/// The plugin killed (`kill -9`): the kubelet deletes the driver's slice `defaultWipingDelay`
/// (30 s) after the connection ended, not before; the registration socket is left where it
/// was. Restarted, the plugin registers again and its slice is back.
pub fn plugin_killed_slice_wiped_and_back(node: &RealNode) -> Result<(), String> {
    wait_slice(node, Duration::from_secs(60))?;
    check(dra::registration_socket_exists(node), || {
        "no dra.net-reg.sock before the kill".into()
    })?;
    let mark = dra::audit_mark(node);
    let t0 = Instant::now();
    node.signal(PLUGIN, "KILL")?;
    let gone = wait_no_slice(node, WIPING_DELAY + SLACK * 2)?;
    let socket_after = dra::registration_socket_exists(node);
    let wipes = dra::kubelet_wipes(node, mark);
    println!(
        "figure: DRA plugin kill -9 -> slice deleted by the kubelet after {gone:?} (defaultWipingDelay {WIPING_DELAY:?}); registration socket still there: {socket_after}; kubelet deletecollection: {wipes:?}"
    );
    check(gone + Duration::from_secs(2) >= WIPING_DELAY, || {
        format!("the slice went {gone:?} after the kill: before the wiping delay")
    })?;
    check(
        wipes
            .iter()
            .any(|(_, uri)| uri.contains("spec.driver%3Ddra.net")),
        || format!("no kubelet deletecollection of the dra.net slices in the audit log: {wipes:?}"),
    )?;
    let t1 = Instant::now();
    node.restart(PLUGIN)?;
    wait_slice(node, Duration::from_secs(60))?;
    println!(
        "figure: DRA plugin restarted -> slice back {} (kill to back {})",
        dra::secs(t1),
        dra::secs(t0)
    );
    check(dra::registration_socket_exists(node), || {
        "no dra.net-reg.sock after the restart".into()
    })
}

/// The kubelet restarted (SIGTERM, started 2 s later): it deletes every slice of the node at
/// start; the running plugin's ResourceSlice controller publishes it again (after its sync
/// delay). The node is validated again afterwards.
pub fn kubelet_restart_wipes_and_republishes(node: &RealNode) -> Result<(), String> {
    wait_slice(node, Duration::from_secs(60))?;
    let mark = dra::audit_mark(node);
    let t0 = Instant::now();
    node.signal("kubelet", "TERM")?;
    std::thread::sleep(Duration::from_secs(2));
    node.restart("kubelet")?;
    wait_for(
        "the kubelet's start-up wipe",
        Duration::from_secs(60),
        || {
            dra::kubelet_wipes(node, mark)
                .iter()
                .any(|(_, uri)| !uri.contains("spec.driver"))
        },
    )?;
    let wiped = t0.elapsed();
    let gone = wait_no_slice(node, SLACK).ok().map(|_| t0.elapsed());
    let back = wait_slice(node, Duration::from_secs(30) + SLACK * 3).map(|_| t0.elapsed());
    println!(
        "figure: kubelet restart -> start-up wipe of the node's slices at {wiped:?}, no slice seen at {gone:?}, slice republished by the plugin at {back:?}"
    );
    back?;
    check(gone.is_some(), || "the slice was never seen deleted".into())?;
    wait_validated(node, INTERVAL * (RECOVER_AFTER + 2) + SLACK).map(|_| ())
}
