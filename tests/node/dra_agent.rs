//! fabricgate's own DRA path on the real node: the agent of `daemonset.yaml` with
//! the `deploy/overlays/dra` registry mount and `kubernetes.dra` (DraNet's `dra.net`,
//! `taint_effect: NoExecute`, 7 of the 8 compute ports required, `taint_scope` at its default
//! `device`), against the real kubelet, kube-scheduler, kube-controller-manager and the DRA
//! kubelet plugin in DraNet's format (`dra.rs`). Each scenario turns that configuration on
//! (a rollout), and off again at its end, so the node is left as it was found.

use super::dra::{
    self, NS, PLUGIN, WIPING_DELAY, allocated_devices, claim_pod, claim_template, delete_pods,
    hca_device_name, pod, pool, rdma_devices_cel, wait_no_slice, wait_running, wait_slice,
};
use super::harness::{RealNode, has_taint, wait_for};
use super::scenarios::{
    INTERVAL, RECOVER_AFTER, TAINT, agent_logs, agent_pod, audit_mark, fabric_reason,
    patch_daemonset, pod_ready, validated, wait_validated,
};
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

/// What a probe's write, a watch event and a busy 2-core machine may add to a bound.
const SLACK: Duration = Duration::from_secs(10);
/// A pod's claim allocated, its sandbox and container started.
const POD_START: Duration = Duration::from_secs(120);
/// The rollout of a changed agent: the old pod's grace (15 s), the new one Ready, validated.
const ROLLOUT: Duration = Duration::from_secs(180);
const REGISTRY: &str = "/var/lib/kubelet/plugins_registry";
const VOLUME: &str = "plugins-registry";

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what()) }
}

fn replace_once(text: &str, from: &str, to: &str) -> Result<String, String> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(format!(
            "requirements.yaml: `{from}` occurs {n} times (want 1)"
        )),
    }
}

/// The requirements of `daemonset.yaml` with the DRA settings docs/dra.md gives.
fn dra_requirements(shipped: &str) -> Result<String, String> {
    let t = replace_once(
        shipped,
        "  min_active_ports: 8\n",
        "  min_active_ports: 7\n",
    )?;
    replace_once(
        &t,
        "kubernetes:\n  rdma_resources: [\"rdma/hca_shared_devices_a\"]\n",
        "kubernetes:\n  rdma_resources: [\"rdma/hca_shared_devices_a\"]\n  dra:\n    \
         drivers: [{name: dra.net}]\n    registry_dir: /var/lib/kubelet/plugins_registry\n    \
         taint_effect: NoExecute\n",
    )
}

fn requirements(node: &RealNode) -> Result<String, String> {
    node.get_json(&["configmap", "fabricgate-requirements", "-n", "fabricgate"])
        .and_then(|c| c["data"]["requirements.yaml"].as_str().map(str::to_owned))
        .ok_or_else(|| "no ConfigMap fabricgate-requirements".into())
}

/// The ConfigMap's requirements.yaml replaced; its other keys (the pool, `pool-selector`) kept:
/// a server-side apply that left one out would delete it.
fn set_requirements(node: &RealNode, text: &str) -> Result<(), String> {
    let mut data = node
        .get_json(&["configmap", "fabricgate-requirements", "-n", "fabricgate"])
        .map(|c| c["data"].clone())
        .ok_or("no ConfigMap fabricgate-requirements")?;
    data["requirements.yaml"] = json!(text);
    let cm = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": { "name": "fabricgate-requirements", "namespace": "fabricgate" },
        "data": data,
    });
    node.apply(&cm.to_string()).map(|_| ())
}

fn daemonset(node: &RealNode) -> Result<Value, String> {
    node.get_json(&["daemonset", "fabricgate", "-n", "fabricgate"])
        .ok_or_else(|| "no DaemonSet fabricgate".into())
}

fn has_registry(pod_or_template_spec: &Value) -> bool {
    pod_or_template_spec["volumes"]
        .as_array()
        .is_some_and(|v| v.iter().any(|v| v["name"] == VOLUME))
}

/// Waits for the agent pod of the new template (`with_registry`) Ready, then the node validated.
fn wait_rollout(node: &RealNode, with_registry: bool) -> Result<Duration, String> {
    let t = Instant::now();
    wait_for("the changed agent pod Ready", ROLLOUT, || {
        agent_pod(node).is_some_and(|p| has_registry(&p["spec"]) == with_registry && pod_ready(&p))
    })
    .map_err(|e| format!("{e}\n{}", agent_logs(node)))?;
    wait_validated(node, ROLLOUT)?;
    Ok(t.elapsed())
}

/// The agent with `kubernetes.dra` and the dra overlay's registry mount.
fn dra_on(node: &RealNode) -> Result<(), String> {
    let ds = daemonset(node)?;
    if has_registry(&ds["spec"]["template"]["spec"]) {
        return wait_validated(node, ROLLOUT).map(|_| ());
    }
    // The mount as the overlay ships it (checked, so that the two cannot drift apart).
    let overlay_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/overlays/dra/kustomization.yaml");
    let overlay = std::fs::read_to_string(&overlay_path).map_err(|e| e.to_string())?;
    for line in [
        format!("          mountPath: {REGISTRY}\n          readOnly: true\n"),
        format!("            path: {REGISTRY}\n            type: Directory\n"),
        format!("          name: {VOLUME}\n"),
    ] {
        check(overlay.contains(&line), || {
            format!("{}: no `{line}`", overlay_path.display())
        })?;
    }
    set_requirements(node, &dra_requirements(&requirements(node)?)?)?;
    let patch = json!([
        { "op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
          "value": { "name": VOLUME, "mountPath": REGISTRY, "readOnly": true } },
        { "op": "add", "path": "/spec/template/spec/volumes/-",
          "value": { "name": VOLUME, "hostPath": { "path": REGISTRY, "type": "Directory" } } },
    ]);
    patch_daemonset(node, &patch)?;
    let took = wait_rollout(node, true)?;
    println!("figure: agent with kubernetes.dra rolled out, node validated: {took:?}");
    Ok(())
}

/// The agent as `daemonset.yaml` ships it again.
fn dra_off(node: &RealNode) -> Result<(), String> {
    let ds = daemonset(node)?;
    let spec = &ds["spec"]["template"]["spec"];
    let index = |list: &Value| {
        list.as_array()
            .and_then(|l| l.iter().position(|v| v["name"] == VOLUME))
    };
    let (Some(mount), Some(volume)) = (
        index(&spec["containers"][0]["volumeMounts"]),
        index(&spec["volumes"]),
    ) else {
        return Ok(());
    };
    let shipped = requirements(node)?
        .replacen("  min_active_ports: 7\n", "  min_active_ports: 8\n", 1)
        .replacen(
            "  dra:\n    drivers: [{name: dra.net}]\n    registry_dir: /var/lib/kubelet/plugins_registry\n    \
             taint_effect: NoExecute\n",
            "",
            1,
        );
    set_requirements(node, &shipped)?;
    patch_daemonset(
        node,
        &json!([
            { "op": "remove", "path": format!("/spec/template/spec/containers/0/volumeMounts/{mount}") },
            { "op": "remove", "path": format!("/spec/template/spec/volumes/{volume}") },
        ]),
    )?;
    wait_rollout(node, false).map(|_| ())
}

/// Runs `scenario` with the DRA agent, then turns it off whatever the outcome.
fn with_dra_agent(
    node: &RealNode,
    scenario: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let result = dra_on(node).and_then(|()| scenario());
    let off = dra_off(node);
    result.and(off)
}

/// The node's rules written by its agent (label `fabricgate.io/node`).
fn agent_rules(node: &RealNode) -> Vec<Value> {
    node.get_json(&[
        "devicetaintrules",
        "-l",
        &format!("fabricgate.io/node={}", node.name),
    ])
    .and_then(|l| l["items"].as_array().cloned())
    .unwrap_or_default()
}

/// Sets `hca`'s port 1 in the agent's fixture tree (the plugin publishes the repository's
/// copy, as DraNet would publish a NIC whatever its link).
fn set_port(node: &RealNode, hca: &str, up: bool) -> Result<(), String> {
    let dir = node
        .dir
        .join(format!("fixture/sys/class/infiniband/{hca}/ports/1"));
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let (state, phys) = if up {
        ("4: ACTIVE\n", "5: LinkUp\n")
    } else {
        ("1: DOWN\n", "3: Disabled\n")
    };
    for (file, text) in [("state", state), ("phys_state", phys)] {
        let tmp = dir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, dir.join(file)).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn condition(pod: &Value, kind: &str) -> Option<Value> {
    pod.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

/// mlx5_3's port goes down under a running pod that holds it: the agent keeps one
/// `DeviceTaintRule` on exactly that device (NoExecute, value `PortDown`) and no Node taint;
/// kube-controller-manager evicts the pod; seven one-HCA claims are allocated around the device
/// and a claim for all eight stays unallocated. The port back, the rule goes after
/// `recover_after` probes and the eight-HCA pod runs.
pub fn agent_rule_evicts_and_steers(node: &RealNode) -> Result<(), String> {
    with_dra_agent(node, || {
        let result = rule_evicts_and_steers(node);
        let repaired = set_port(node, "mlx5_3", true);
        let cleaned = delete_pods(node);
        let gone = wait_for("the agent's rules gone", ROLLOUT, || {
            agent_rules(node).is_empty()
        });
        result.and(repaired).and(cleaned).and(gone.map(|_| ()))
    })
}

fn rule_evicts_and_steers(node: &RealNode) -> Result<(), String> {
    let slice = wait_slice(node, Duration::from_secs(60))?;
    let dev3 = hca_device_name(&slice, "mlx5_3").ok_or("no mlx5_3 in the slice")?;
    let held = format!("{}/{dev3}", node.name);
    check(agent_rules(node).is_empty(), || {
        format!("rules on a healthy node: {:?}", agent_rules(node))
    })?;
    node.apply(&claim_template(
        "mlx5-3",
        1,
        &rdma_devices_cel(&["mlx5_3".into()]),
    ))?;
    node.apply(&claim_pod("dra-holder", "mlx5-3"))?;
    wait_running(node, "dra-holder", POD_START)?;
    let uid = pod(node, "dra-holder")
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
        .ok_or("no dra-holder uid")?;

    let down = Instant::now();
    set_port(node, "mlx5_3", false)?;
    let created = wait_for(
        "the agent's DeviceTaintRule on mlx5_3",
        INTERVAL + SLACK,
        || agent_rules(node).len() == 1,
    )
    .map_err(|e| format!("{e}: {:?}\n{}", agent_rules(node), agent_logs(node)))?;
    println!(
        "figure: real node: mlx5_3 port down -> the agent's DeviceTaintRule {created:?} (probe interval {INTERVAL:?})"
    );
    let rule = &agent_rules(node)[0];
    let (selector, taint) = (&rule["spec"]["deviceSelector"], &rule["spec"]["taint"]);
    check(
        selector["driver"] == "dra.net"
            && selector["pool"] == pool(&slice).as_str()
            && selector["device"] == dev3.as_str()
            && taint["key"] == TAINT
            && taint["value"] == "PortDown"
            && taint["effect"] == "NoExecute"
            && rule["metadata"]["annotations"]["fabricgate.io/hca"] == "mlx5_3",
        || format!("the rule does not select mlx5_3's device {dev3} NoExecute/PortDown: {rule}"),
    )?;
    let listed = node.kubectl(&["get", "devicetaintrules"])?;
    println!("figure: kubectl get devicetaintrules:\n{listed}");
    let n = node.node().ok_or("no Node")?;
    check(validated(&n), || {
        format!(
            "taint_scope device, 7 of 8 ports: the node itself should stay validated: {}",
            fabric_reason(&n)
        )
    })?;

    // kube-controller-manager evicts the pod holding the device.
    let mut disruption = None;
    let evicted = wait_for("dra-holder evicted", Duration::from_secs(90), || match pod(
        node,
        "dra-holder",
    ) {
        Some(p) if p["metadata"]["uid"] == uid.as_str() => {
            if disruption.is_none() {
                disruption = condition(&p, "DisruptionTarget");
            }
            false
        }
        _ => node.get_json(&["pods", "-n", NS]).is_some(),
    })?;
    println!(
        "figure: real node: the agent's NoExecute rule -> the pod holding mlx5_3 gone {evicted:?} later ({:?} after the port went down)",
        down.elapsed()
    );
    let c = disruption.ok_or("no DisruptionTarget seen on dra-holder before it went")?;
    check(c["reason"] == "DeletionByDeviceTaintManager", || {
        format!("DisruptionTarget: {c}")
    })?;

    // New claims are allocated around the device.
    dra::claims_go_around(node, "dra-agent", &held, POD_START)?;

    // Repaired: the rule goes after recover_after probes, and the eight-HCA pod runs.
    let up = Instant::now();
    set_port(node, "mlx5_3", true)?;
    let removed = wait_for(
        "the agent's rule removed",
        INTERVAL * (RECOVER_AFTER + 1) + SLACK,
        || agent_rules(node).is_empty(),
    )?;
    let min = INTERVAL * (RECOVER_AFTER - 1) - INTERVAL / 5;
    check(removed >= min, || {
        format!(
            "the rule went {removed:?} after the repair: sooner than recover_after allows ({min:?})"
        )
    })?;
    wait_running(node, "dra-all", POD_START)?;
    println!(
        "figure: real node: port up -> rule removed {removed:?} (recover_after {RECOVER_AFTER}, interval {INTERVAL:?}), the 8-HCA pod Running {}",
        dra::secs(up)
    );
    let got = allocated_devices(node, "dra-all");
    check(got.len() == 8 && got.contains(&held), || {
        format!("the all-HCA pod got {got:?}, want 8 with {held}")
    })
}

/// The DRA plugin killed (`kill -9`): its registration socket stays but answers nobody, and
/// the agent's next probe says `DraDriverUnavailable` (Node taint: a dead driver is node-wide);
/// the kubelet wipes the slice 30 s later. The plugin back: validated after `recover_after`.
pub fn agent_plugin_killed(node: &RealNode) -> Result<(), String> {
    with_dra_agent(node, || {
        wait_slice(node, Duration::from_secs(60))?;
        let t0 = Instant::now();
        node.signal(PLUGIN, "KILL")?;
        let result = (|| {
            let unavailable = wait_for("DraDriverUnavailable", INTERVAL + SLACK, || {
                node.node().is_some_and(|n| {
                    has_taint(&n, TAINT) && fabric_reason(&n) == "False/DraDriverUnavailable"
                })
            })
            .map_err(|e| {
                format!(
                    "{e}: {:?}\n{}",
                    node.node().map(|n| fabric_reason(&n)),
                    agent_logs(node)
                )
            })?;
            let wiped = wait_no_slice(node, WIPING_DELAY + SLACK * 2).map(|_| t0.elapsed());
            println!(
                "figure: real node: DRA plugin kill -9 -> DraDriverUnavailable + taint {unavailable:?} (interval {INTERVAL:?}; the kubelet wiped the slice at {wiped:?})"
            );
            Ok(())
        })();
        let back = Instant::now();
        let restarted = node.restart(PLUGIN);
        result.and(restarted)?;
        wait_slice(node, Duration::from_secs(60))?;
        let took = wait_validated(node, INTERVAL * (RECOVER_AFTER + 1) + SLACK * 2)?;
        let min = INTERVAL * (RECOVER_AFTER - 1) - INTERVAL / 5;
        check(back.elapsed() >= min, || {
            format!(
                "validated {took:?} after the plugin came back: sooner than recover_after allows ({min:?})"
            )
        })?;
        println!(
            "figure: real node: DRA plugin back -> validated {}",
            dra::secs(back)
        );
        Ok(())
    })
}

/// The agent's writes (Nodes, Events, DeviceTaintRules) in the audit log after `mark`.
fn agent_writes(node: &RealNode, mark: u64) -> Vec<String> {
    node.audit_events(mark)
        .into_iter()
        .filter(|e| {
            e["user"]["username"] == "system:serviceaccount:fabricgate:fabricgate"
                && matches!(
                    e["verb"].as_str(),
                    Some("patch" | "update" | "create" | "delete")
                )
                && e["stage"] == "ResponseComplete"
        })
        .map(|e| {
            format!(
                "{} {} {}",
                e["stageTimestamp"].as_str().unwrap_or(""),
                e["verb"].as_str().unwrap_or(""),
                e["objectRef"]["resource"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// The kubelet restarted: it wipes the node's slices at start and the plugin publishes again
/// ~27 s later (`dra_scenarios`), within `slice_grace` (45 s): no taint, no rule, no
/// condition change and at most the agent's own lease-free bookkeeping written, for a minute.
pub fn agent_kubelet_restart(node: &RealNode) -> Result<(), String> {
    with_dra_agent(node, || {
        let before = wait_slice(node, Duration::from_secs(60))?;
        // The kubelet's start-up wipe and the plugin's republish are told by the slice's UID:
        // a republish can follow the wipe faster than one poll (500 ms), never with the same
        // object.
        let first_uid = before["metadata"]["uid"].as_str().map(str::to_owned);
        let mark = audit_mark(node);
        let t0 = Instant::now();
        node.signal("kubelet", "TERM")?;
        std::thread::sleep(Duration::from_secs(2));
        node.restart("kubelet")?;
        let mut flap = None;
        let mut slice_gone = None;
        let mut slice_back = None;
        while t0.elapsed() < Duration::from_secs(60) {
            if let Some(n) = node.node()
                && !validated(&n)
            {
                flap.get_or_insert_with(|| format!("{:?}: {}", t0.elapsed(), fabric_reason(&n)));
            }
            if !agent_rules(node).is_empty() {
                flap.get_or_insert_with(|| format!("{:?}: a DeviceTaintRule", t0.elapsed()));
            }
            let uids: Vec<Option<String>> = dra::slices(node)
                .iter()
                .map(|s| s["metadata"]["uid"].as_str().map(str::to_owned))
                .collect();
            if !uids.contains(&first_uid) && slice_gone.is_none() {
                slice_gone = Some(t0.elapsed());
            }
            if uids.iter().any(|u| *u != first_uid) && slice_back.is_none() {
                slice_back = Some(t0.elapsed());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let writes = agent_writes(node, mark);
        println!(
            "figure: real node, DRA agent: kubelet restart -> slice gone at {slice_gone:?}, back at {slice_back:?}; agent writes in 60 s: {} {writes:?}",
            writes.len()
        );
        if let Some(f) = flap {
            return Err(format!(
                "the kubelet restart marked the node or a device: {f}"
            ));
        }
        check(slice_gone.is_some(), || {
            "the kubelet's restart did not wipe the plugin's slice within 60 s (same UID)".into()
        })?;
        check(slice_back.is_some(), || {
            "the plugin's slice did not come back within 60 s".into()
        })?;
        check(writes.len() <= 2, || {
            format!(
                "{} agent writes for a kubelet restart: {writes:?}",
                writes.len()
            )
        })
    })
}
