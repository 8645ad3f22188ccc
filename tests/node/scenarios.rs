//! The scenarios on the real node, in the order they run. Each starts from a validated node
//! (label `fabricgate.io/ready=true`, no taint) and leaves one behind. Figures are printed as
//! `figure: ...` lines (docs/testing.md records them, with this command).

use super::deploy;
use super::dra_agent;
use super::dra_scenarios;
use super::harness::{
    RESOURCE, RealNode, STATUS_SYNC, StartError, condition, has_taint, label, wait_for,
};
use super::images;
use super::runtime_transport;
use serde_json::Value;
use std::time::{Duration, Instant};

pub const TAINT: &str = "fabricgate.io/unvalidated";
/// The shipped DaemonSet's `--interval`.
pub const INTERVAL: Duration = Duration::from_secs(10);
/// The shipped `node.recover_after`.
pub const RECOVER_AFTER: u32 = 3;
/// The shipped guard's `--stale-after`.
pub const STALE_AFTER: Duration = Duration::from_secs(60);
/// What a probe, its write and a watch event may add to a bound, on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(5);

type Scenario = fn(&RealNode) -> Result<(), String>;

pub const ALL: &[(&str, Scenario)] = &[
    (
        "device_plugin_killed_is_unavailable_within_sync_plus_interval_and_recovers",
        plugin_killed,
    ),
    (
        "devices_unhealthy_are_unavailable_and_recover",
        devices_unhealthy,
    ),
    ("kubelet_restart_while_plugins_reregister", kubelet_restart),
    (
        "kubelet_restart_without_the_plugin_fails_after_plugin_grace",
        kubelet_restart_plugin_frozen,
    ),
    (
        "guard_taints_agent_not_running_for_a_broken_image",
        guard_taints_a_broken_agent,
    ),
    (
        "preflight_init_container_stops_a_pod_without_rdma",
        preflight_stops_a_pod_without_rdma,
    ),
    (
        "rolling_upgrade_between_two_tags_does_not_flap",
        rolling_upgrade_does_not_flap,
    ),
    // DRA (dra_scenarios.rs): Kubernetes' own behaviour with a driver in DraNet's format.
    (
        "dra_slice_publishes_the_fixture_hcas_in_dranet_format",
        dra_scenarios::slice_in_dranet_format,
    ),
    (
        "dra_claim_templates_allocate_one_hca_per_pod",
        dra_scenarios::claims_allocate_one_hca_per_pod,
    ),
    (
        "dra_noschedule_device_taint_rule_steers_allocation_and_blocks_a_full_claim",
        dra_scenarios::noschedule_rule_steers_allocation,
    ),
    (
        "dra_noexecute_device_taint_rule_evicts_the_pod_holding_the_device",
        dra_scenarios::noexecute_rule_evicts_the_pod,
    ),
    (
        "dra_plugin_killed_slice_wiped_after_the_delay_and_back_on_restart",
        dra_scenarios::plugin_killed_slice_wiped_and_back,
    ),
    (
        "dra_kubelet_restart_wipes_the_slice_and_the_plugin_republishes",
        dra_scenarios::kubelet_restart_wipes_and_republishes,
    ),
    // fabricgate's own DRA path (dra_agent.rs): the agent with kubernetes.dra.
    (
        "dra_agent_rule_on_the_bad_hca_evicts_its_pod_and_claims_go_around_it",
        dra_agent::agent_rule_evicts_and_steers,
    ),
    (
        "dra_agent_plugin_killed_is_dra_driver_unavailable_and_recovers",
        dra_agent::agent_plugin_killed,
    ),
    (
        "dra_agent_kubelet_restart_marks_nothing",
        dra_agent::agent_kubelet_restart,
    ),
    // Runtime transport per pod (runtime_transport.rs): the agent with the component.
    (
        "runtime_transport_sockets_pod_judged_then_evicted_past_its_pdb",
        runtime_transport::sockets_pod_is_judged_and_evicted,
    ),
    // Last: they uninstall.
    (
        "cleanup_nodes_after_uninstall_leaves_no_mark",
        cleanup_nodes_leaves_no_mark,
    ),
    // Helm (helm.rs): install, upgrade with runtime transport, uninstall with the cleanup.
    (
        "helm_install_validates_upgrade_keeps_it_validated_uninstall_leaves_no_mark",
        super::helm::install_upgrade_uninstall,
    ),
];

pub fn validated(node: &Value) -> bool {
    label(node, "fabricgate.io/ready").as_deref() == Some("true") && !has_taint(node, TAINT)
}

pub fn fabric_reason(node: &Value) -> String {
    condition(node, "FabricReady")
        .map(|c| {
            format!(
                "{}/{}",
                c["status"].as_str().unwrap_or(""),
                c["reason"].as_str().unwrap_or("")
            )
        })
        .unwrap_or_default()
}

pub fn wait_validated(node: &RealNode, limit: Duration) -> Result<Duration, String> {
    wait_for("the node validated", limit, || {
        node.node().is_some_and(|n| validated(&n))
    })
    .map_err(|e| {
        format!(
            "{e}; FabricReady {:?}\n{}",
            node.node().map(|n| fabric_reason(&n)),
            agent_logs(node)
        )
    })
}

/// The agent pod's name (the DaemonSet's one pod), if any.
pub fn agent_pod(node: &RealNode) -> Option<Value> {
    let pods = node.get_json(&[
        "pods",
        "-n",
        "fabricgate",
        "-l",
        "app.kubernetes.io/component=agent",
    ])?;
    pods["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null())
        .cloned()
}

pub fn agent_logs(node: &RealNode) -> String {
    match agent_pod(node).and_then(|p| p["metadata"]["name"].as_str().map(str::to_owned)) {
        Some(name) => node
            .kubectl(&["logs", "-n", "fabricgate", &name, "--tail=15"])
            .unwrap_or_else(|e| e),
        None => "(no agent pod)".into(),
    }
}

/// Images, fixture, daemonset.yaml and deploy/guard.yaml; returns once the agent has
/// validated the node.
pub fn deploy_agent(node: &RealNode) -> Result<String, StartError> {
    let image = images::prepare(node)?;
    let f = StartError::Failed;
    deploy::install_fixture(node, "ndr-8x400-healthy").map_err(f)?;
    let t = Instant::now();
    node.apply(&deploy::daemonset(node, images::AGENT).map_err(f)?)
        .map_err(f)?;
    let took = wait_validated(node, Duration::from_secs(180)).map_err(f)?;
    println!("figure: kubectl apply daemonset.yaml -> node validated: {took:?}");
    let _ = t;
    Ok(image)
}

fn plugin_killed(node: &RealNode) -> Result<(), String> {
    let t0 = Instant::now();
    node.signal("deviceplugin", "KILL")?;
    let alloc0 = wait_for("allocatable 0", STATUS_SYNC + SLACK, || {
        node.allocatable() == Some(0)
    })?;
    let bound = STATUS_SYNC + INTERVAL + SLACK;
    let tainted = wait_for("DevicePluginUnavailable", bound, || {
        node.node().is_some_and(|n| {
            has_taint(&n, TAINT) && fabric_reason(&n) == "False/DevicePluginUnavailable"
        })
    })
    .map_err(|e| format!("{e}: {:?}", node.node().map(|n| fabric_reason(&n))))?;
    let n = node.node().ok_or("no Node")?;
    let msg = condition(&n, "FabricReady")
        .map(|c| c["message"].to_string())
        .unwrap_or_default();
    if !msg.contains(RESOURCE) {
        return Err(format!(
            "FabricReady message does not name {RESOURCE}: {msg}"
        ));
    }
    println!(
        "figure: plugin kill -9 -> allocatable 0 on the Node {alloc0:?}, -> taint + DevicePluginUnavailable {:?} (bound: status sync {STATUS_SYNC:?} + interval {INTERVAL:?})",
        alloc0 + tainted
    );
    let _ = t0;
    let back = Instant::now();
    node.restart("deviceplugin")?;
    let took = wait_validated(
        node,
        STATUS_SYNC + INTERVAL * (RECOVER_AFTER + 1) + SLACK * 2,
    )?;
    let min = INTERVAL * (RECOVER_AFTER - 1) - INTERVAL / 5;
    if took < min {
        return Err(format!(
            "validated {took:?} after the plugin came back: sooner than recover_after allows ({min:?})"
        ));
    }
    println!(
        "figure: plugin back -> validated after {:?} (recover_after {RECOVER_AFTER}, interval {INTERVAL:?})",
        back.elapsed()
    );
    Ok(())
}

fn devices_unhealthy(node: &RealNode) -> Result<(), String> {
    let t0 = Instant::now();
    node.signal("deviceplugin", "USR1")?;
    wait_for(
        "DevicePluginUnavailable (unhealthy devices)",
        STATUS_SYNC + INTERVAL + SLACK,
        || {
            node.node().is_some_and(|n| {
                has_taint(&n, TAINT) && fabric_reason(&n) == "False/DevicePluginUnavailable"
            })
        },
    )
    .map_err(|e| {
        format!(
            "{e}: {:?}, allocatable {:?}",
            node.node().map(|n| fabric_reason(&n)),
            node.allocatable()
        )
    })?;
    println!(
        "figure: devices Unhealthy -> taint + DevicePluginUnavailable {:?}",
        t0.elapsed()
    );
    let back = Instant::now();
    node.signal("deviceplugin", "USR1")?;
    wait_validated(
        node,
        STATUS_SYNC + INTERVAL * (RECOVER_AFTER + 1) + SLACK * 2,
    )?;
    println!(
        "figure: devices Healthy again -> validated {:?}",
        back.elapsed()
    );
    Ok(())
}

/// The kubelet restarts (SIGTERM, started again 2 s later) and the device plugin registers
/// again a few seconds after it (held with SIGSTOP until the kubelet has posted the resource
/// as 0/0, as a plugin slower than this one's 200 ms inode poll does; without the hold the
/// re-registration sometimes beats the kubelet's first status and the scenario would test
/// nothing). Samples the Node every 200 ms for 60 s and counts the agent's writes in the
/// audit log: a healthy node must not be tainted (`kubernetes.plugin_grace`).
fn kubelet_restart(node: &RealNode) -> Result<(), String> {
    let audit = node.dir.join("logs/audit.log");
    let mark = std::fs::metadata(&audit).map(|m| m.len()).unwrap_or(0);
    node.signal("deviceplugin", "STOP")?;
    let t0 = Instant::now();
    node.signal("kubelet", "TERM")?;
    std::thread::sleep(Duration::from_secs(2));
    node.restart("kubelet")?;
    let zero = wait_for(
        "the kubelet's 0/0 after its restart",
        STATUS_SYNC + SLACK,
        || node.allocatable() == Some(0),
    );
    node.signal("deviceplugin", "CONT")?;
    let zero = zero.map(|z| Duration::from_secs(2) + z)?;
    println!(
        "figure: kubelet restart -> resources 0/0 on the Node at {zero:?}; plugin let go then"
    );
    let mut last = String::new();
    let mut timeline = Vec::new();
    let mut ever_tainted = None;
    while t0.elapsed() < Duration::from_secs(60) {
        if let Some(n) = node.node() {
            let state = format!(
                "allocatable {:?} taint {} FabricReady {}",
                n.pointer(&format!(
                    "/status/allocatable/{}",
                    RESOURCE.replace('/', "~1")
                ))
                .and_then(Value::as_str),
                has_taint(&n, TAINT),
                fabric_reason(&n)
            );
            if has_taint(&n, TAINT) && ever_tainted.is_none() {
                ever_tainted = Some(t0.elapsed());
            }
            if state != last {
                timeline.push(format!("{:>6.1}s {state}", t0.elapsed().as_secs_f64()));
                last = state;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read(&audit).unwrap_or_default();
    let writes = text
        .get(usize::try_from(mark).unwrap_or(0)..)
        .map(String::from_utf8_lossy)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| {
            e["user"]["username"] == "system:serviceaccount:fabricgate:fabricgate"
                && matches!(e["verb"].as_str(), Some("patch" | "update" | "create"))
        })
        .count();
    println!(
        "figure: kubelet restart timeline (agent writes {writes}, first taint {ever_tainted:?}):"
    );
    for line in &timeline {
        println!("figure:   {line}");
    }
    wait_validated(node, INTERVAL * (RECOVER_AFTER + 2) + SLACK)?;
    if let Some(at) = ever_tainted {
        return Err(format!(
            "a kubelet restart with a healthy plugin tainted the node at {at:?} ({writes} agent writes)"
        ));
    }
    Ok(())
}

/// The shipped `kubernetes.plugin_grace` (the default).
const PLUGIN_GRACE: Duration = Duration::from_secs(30);

/// A kubelet restart the plugin does not come back from (it is frozen with SIGSTOP, so it
/// cannot register again): the node fails once `kubernetes.plugin_grace` has passed, not
/// before; thawed, the plugin registers again and the node validates.
fn kubelet_restart_plugin_frozen(node: &RealNode) -> Result<(), String> {
    node.signal("deviceplugin", "STOP")?;
    let t0 = Instant::now();
    node.signal("kubelet", "TERM")?;
    std::thread::sleep(Duration::from_secs(2));
    node.restart("kubelet")?;
    let zero = wait_for("capacity and allocatable 0", STATUS_SYNC + SLACK, || {
        node.allocatable() == Some(0)
    })?;
    let result = wait_for(
        "DevicePluginUnavailable after the grace",
        PLUGIN_GRACE + STATUS_SYNC + SLACK * 2,
        || {
            node.node().is_some_and(|n| {
                has_taint(&n, TAINT) && fabric_reason(&n) == "False/DevicePluginUnavailable"
            })
        },
    );
    let tainted_at = t0.elapsed();
    node.signal("deviceplugin", "CONT")?;
    result?;
    println!(
        "figure: kubelet restart, plugin frozen -> resources 0/0 on the Node at {:?}, taint at {tainted_at:?} (plugin_grace {PLUGIN_GRACE:?})",
        Duration::from_secs(2) + zero
    );
    if tainted_at < PLUGIN_GRACE {
        return Err(format!(
            "tainted {tainted_at:?} after the kubelet restart: inside plugin_grace {PLUGIN_GRACE:?}"
        ));
    }
    let back = Instant::now();
    wait_validated(
        node,
        STATUS_SYNC + INTERVAL * (RECOVER_AFTER + 1) + SLACK * 2,
    )?;
    println!("figure: plugin thawed -> validated {:?}", back.elapsed());
    Ok(())
}

/// A JSON patch of the DaemonSet's agent image.
fn set_agent_image(node: &RealNode, image: &str) -> Result<(), String> {
    patch_daemonset(
        node,
        &serde_json::json!([
            { "op": "replace", "path": "/spec/template/spec/containers/0/image", "value": image },
        ]),
    )
}

/// A JSON patch to the agent's DaemonSet.
pub fn patch_daemonset(node: &RealNode, patch: &Value) -> Result<(), String> {
    node.kubectl(&[
        "patch",
        "daemonset",
        "fabricgate",
        "-n",
        "fabricgate",
        "--type=json",
        "-p",
        &patch.to_string(),
    ])
    .map(|_| ())
}

pub fn pod_ready(pod: &Value) -> bool {
    pod.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
}

fn wait_agent_ready(node: &RealNode, image: &str, limit: Duration) -> Result<Duration, String> {
    wait_for(&format!("an agent pod Ready on {image}"), limit, || {
        agent_pod(node).is_some_and(|p| {
            pod_ready(&p)
                && p.pointer("/spec/containers/0/image")
                    .and_then(Value::as_str)
                    == Some(image)
        })
    })
}

/// The agent's writes to Nodes in the audit log after byte offset `mark`.
pub fn agent_node_writes(node: &RealNode, mark: u64) -> Vec<String> {
    node.audit_events(mark)
        .into_iter()
        .filter(|e| {
            e["user"]["username"] == "system:serviceaccount:fabricgate:fabricgate"
                && e["objectRef"]["resource"] == "nodes"
                && matches!(e["verb"].as_str(), Some("patch" | "update" | "create"))
        })
        .map(|e| {
            format!(
                "{} {} {}/{}",
                e["stageTimestamp"].as_str().unwrap_or(""),
                e["verb"].as_str().unwrap_or(""),
                e["objectRef"]["resource"].as_str().unwrap_or(""),
                e["objectRef"]["subresource"].as_str().unwrap_or("")
            )
        })
        .collect()
}

pub fn audit_mark(node: &RealNode) -> u64 {
    node.audit_mark()
}

/// deploy/guard.yaml on the node; the agent container killed (kubelet restarts it: no taint,
/// it is back long before `--stale-after`), then an image that cannot start: the guard,
/// reading the pod's real readiness, taints `AgentNotRunning`; the good image back: the agent
/// validates again.
fn guard_taints_a_broken_agent(node: &RealNode) -> Result<(), String> {
    node.apply(&deploy::guard(images::AGENT)?)?;
    wait_for("two guard pods Ready", Duration::from_secs(120), || {
        node.get_json(&[
            "pods",
            "-n",
            "fabricgate",
            "-l",
            "app.kubernetes.io/name=fabricgate-guard",
        ])
        .and_then(|p| {
            p["items"]
                .as_array()
                .map(|i| i.iter().filter(|p| pod_ready(p)).count())
        }) == Some(2)
    })?;

    // The agent container killed by its pid's container: the kubelet restarts it.
    let pod = agent_pod(node).ok_or("no agent pod")?;
    let id = pod
        .pointer("/status/containerStatuses/0/containerID")
        .and_then(Value::as_str)
        .and_then(|s| s.strip_prefix("containerd://"))
        .ok_or("agent container has no containerd id")?
        .to_owned();
    let t0 = Instant::now();
    node.ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])?;
    let mut tainted = false;
    let back = wait_for(
        "the agent container restarted and Ready",
        Duration::from_secs(90),
        || {
            tainted |= node.node().is_some_and(|n| has_taint(&n, TAINT));
            agent_pod(node).is_some_and(|p| {
                pod_ready(&p)
                    && p.pointer("/status/containerStatuses/0/restartCount")
                        .and_then(Value::as_u64)
                        .unwrap_or(0)
                        >= 1
            })
        },
    )?;
    println!(
        "figure: agent container SIGKILL -> restarted and Ready {back:?} (tainted meanwhile: {tainted})"
    );
    if tainted {
        return Err(format!(
            "a killed agent container that came back in {back:?} tainted the node"
        ));
    }
    wait_validated(node, INTERVAL * (RECOVER_AFTER + 2))?;
    let _ = t0;

    // A broken image: the new pod never runs.
    let t1 = Instant::now();
    set_agent_image(node, images::BROKEN)?;
    let took = wait_for(
        "guard taint AgentNotRunning",
        STALE_AFTER + Duration::from_secs(60),
        || {
            node.node().is_some_and(|n| {
                has_taint(&n, TAINT) && fabric_reason(&n) == "False/AgentNotRunning"
            })
        },
    )
    .map_err(|e| {
        let guards = node.guard_logs();
        format!(
            "{e}: FabricReady {:?}\nguard logs:\n{guards}",
            node.node().map(|n| fabric_reason(&n))
        )
    })?;
    if took < STALE_AFTER - Duration::from_secs(5) {
        return Err(format!(
            "guard tainted after {took:?}: before --stale-after {STALE_AFTER:?}"
        ));
    }
    println!(
        "figure: broken agent image -> guard taint AgentNotRunning {:?} (--stale-after {STALE_AFTER:?})",
        t1.elapsed()
    );
    set_agent_image(node, images::AGENT)?;
    let t2 = Instant::now();
    wait_agent_ready(node, images::AGENT, Duration::from_secs(120))?;
    wait_validated(node, INTERVAL * (RECOVER_AFTER + 2) + SLACK)?;
    println!("figure: good image back -> validated {:?}", t2.elapsed());
    Ok(())
}

/// A DaemonSet rollout from one image tag to another on a healthy node: the taint never
/// appears, and the agents' Node writes during it are counted from the audit log.
fn rolling_upgrade_does_not_flap(node: &RealNode) -> Result<(), String> {
    let mark = audit_mark(node);
    let t0 = Instant::now();
    set_agent_image(node, images::AGENT_NEXT)?;
    let mut flap = None;
    let mut done = None;
    while t0.elapsed() < Duration::from_secs(120) {
        if let Some(n) = node.node()
            && !validated(&n)
        {
            flap.get_or_insert_with(|| {
                format!("{:?}: FabricReady {}", t0.elapsed(), fabric_reason(&n))
            });
        }
        if done.is_none()
            && agent_pod(node).is_some_and(|p| {
                pod_ready(&p)
                    && p.pointer("/spec/containers/0/image")
                        .and_then(Value::as_str)
                        == Some(images::AGENT_NEXT)
            })
        {
            done = Some(t0.elapsed());
        }
        // Watch one interval past the new pod's readiness: its first probes.
        if done.is_some_and(|d| t0.elapsed() > d + INTERVAL + SLACK) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let writes = agent_node_writes(node, mark);
    println!(
        "figure: rolling upgrade v1 -> v2: new pod Ready {done:?}, agent Node writes {} ({writes:?})",
        writes.len()
    );
    let done = done.ok_or("the v2 agent pod never became Ready")?;
    if let Some(f) = flap {
        return Err(format!(
            "the healthy node flapped during the rollout at {f}"
        ));
    }
    // The new agent on an already validated node: no write needed at all beyond at most one
    // reconcile of its own fields.
    if writes.len() > 2 {
        return Err(format!(
            "{} agent writes during a rollout on a healthy node: {writes:?}",
            writes.len()
        ));
    }
    let _ = done;
    Ok(())
}

const TRAINING_POD: &str = r#"apiVersion: v1
kind: Namespace
metadata:
  name: training
---
apiVersion: v1
kind: Pod
metadata:
  name: trainer
  namespace: training
  labels:
    fabricgate.io/preflight: "true"
spec:
  restartPolicy: Never
  containers:
  - name: trainer
    image: localhost/debian:bookworm
    imagePullPolicy: Never
    command: ["sleep", "3600"]
"#;

/// deploy/webhook.yaml on the node, reachable from the API server; a training pod opted in
/// through it, without the RDMA resource: its preflight init container runs in a real
/// container, finds no /dev/infiniband, and the main container never starts; `kubectl
/// describe pod` shows preflight's termination message.
fn preflight_stops_a_pod_without_rdma(node: &RealNode) -> Result<(), String> {
    let (cert, key, ca) = node.serving_cert(
        "webhook",
        &[
            "fabricgate-webhook.fabricgate.svc",
            "fabricgate-webhook.fabricgate.svc.cluster.local",
        ],
    )?;
    let indent = |pem: &str| {
        pem.lines()
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    };
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: fabricgate-webhook-tls\n  namespace: fabricgate\n\
         type: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
        indent(&cert),
        indent(&key)
    );
    node.apply(&secret)?;
    node.apply(&deploy::webhook(images::AGENT, &ca)?)?;
    wait_for("webhook endpoints", Duration::from_secs(120), || {
        node.get_json(&[
            "endpointslices",
            "-n",
            "fabricgate",
            "-l",
            "kubernetes.io/service-name=fabricgate-webhook",
        ])
        .and_then(|s| {
            s["items"].as_array().map(|i| {
                i.iter().any(|s| {
                    s["endpoints"]
                        .as_array()
                        .is_some_and(|e| e.iter().any(|e| e["conditions"]["ready"] == true))
                })
            })
        }) == Some(true)
    })?;
    let t0 = Instant::now();
    let mut last_err = String::new();
    // The first admission after the endpoints turn ready may still race the second replica.
    wait_for(
        "the training pod admitted",
        Duration::from_secs(30),
        || match node.apply(TRAINING_POD) {
            Ok(_) => true,
            Err(e) => {
                last_err = e;
                false
            }
        },
    )
    .map_err(|e| format!("{e}: {last_err}"))?;
    let admitted = t0.elapsed();
    let pod = node
        .get_json(&["pod", "trainer", "-n", "training"])
        .ok_or("no trainer pod")?;
    let init = pod
        .pointer("/spec/initContainers/0")
        .ok_or("the webhook added no init container")?;
    let args = init["args"].to_string();
    if !args.contains("preflight") && !init["command"].to_string().contains("preflight") {
        return Err(format!("first init container is not preflight: {init}"));
    }
    let verdict = wait_for("preflight's verdict", Duration::from_secs(120), || {
        node.get_json(&["pod", "trainer", "-n", "training"])
            .is_some_and(|p| {
                p.pointer("/status/initContainerStatuses/0/state/terminated")
                    .is_some()
            })
    })?;
    let pod = node
        .get_json(&["pod", "trainer", "-n", "training"])
        .ok_or("no trainer pod")?;
    let term = pod
        .pointer("/status/initContainerStatuses/0/state/terminated")
        .cloned()
        .unwrap_or_default();
    let code = term["exitCode"].as_i64().unwrap_or(0);
    let message = term["message"].as_str().unwrap_or("").to_owned();
    println!(
        "figure: training pod create -> admitted {admitted:?}, -> preflight verdict (exit {code}) {:?}",
        admitted + verdict
    );
    if code == 0 {
        return Err(format!(
            "preflight passed in a pod without RDMA devices: {term}"
        ));
    }
    if message.is_empty() {
        return Err(format!("preflight left no termination message: {term}"));
    }
    // The main container never ran.
    std::thread::sleep(Duration::from_secs(3));
    let pod = node
        .get_json(&["pod", "trainer", "-n", "training"])
        .ok_or("no trainer pod")?;
    let main = pod
        .pointer("/status/containerStatuses/0/state")
        .cloned()
        .unwrap_or_default();
    if main.get("running").is_some()
        || main
            .pointer("/terminated/startedAt")
            .is_some_and(|s| !s.is_null())
    {
        return Err(format!("the main container started: {main}"));
    }
    let describe = node.kubectl(&["describe", "pod", "trainer", "-n", "training"])?;
    let first_line = message.lines().next().unwrap_or("");
    let needle: String = first_line.chars().take(60).collect();
    if !describe.contains(&needle) {
        return Err(format!(
            "kubectl describe pod does not show preflight's message {needle:?}:\n{describe}"
        ));
    }
    println!("figure: preflight message: {first_line}");
    node.kubectl(&["delete", "namespace", "training", "--wait=false"])?;
    Ok(())
}

/// Uninstall (the manifests deleted), then deploy/cleanup-nodes.sh: no fabricgate label,
/// taint or condition is left on the Node (managedFields aside).
fn cleanup_nodes_leaves_no_mark(node: &RealNode) -> Result<(), String> {
    let mut all = deploy::webhook(images::AGENT, "x")?;
    all.push_str("\n---\n");
    all.push_str(&deploy::guard(images::AGENT)?);
    all.push_str("\n---\n");
    all.push_str(&deploy::daemonset(node, images::AGENT_NEXT)?);
    node.kubectl_stdin(
        &["delete", "--ignore-not-found", "--wait=true", "-f", "-"],
        Some(&all),
    )?;
    wait_for("no fabricgate pods", Duration::from_secs(120), || {
        node.get_json(&["pods", "-n", "fabricgate"])
            .is_none_or(|p| p["items"].as_array().is_none_or(Vec::is_empty))
    })?;
    let bin_dir = node.dir.join("kubectl-bin");
    std::fs::create_dir_all(&bin_dir).map_err(|e| e.to_string())?;
    let wrapper = bin_dir.join("kubectl");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec {} kubectl --kubeconfig={}/admin.kubeconfig \"$@\"\n",
            super::harness::binary(),
            node.dir.display()
        ),
    )
    .map_err(|e| e.to_string())?;
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .map_err(|e| e.to_string())?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/cleanup-nodes.sh");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = node
        .nsenter("bash")
        .arg(&script)
        .env("PATH", &path)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "cleanup-nodes.sh failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let (marks, n) = marks_left(node)?;
    if !marks.is_empty() {
        return Err(format!(
            "after uninstall + cleanup-nodes.sh the Node still has {marks:?}: {n:#}"
        ));
    }
    Ok(())
}

/// The fabricgate marks (label, annotation and taint keys, the conditions) the Node still
/// carries, and the Node as read: after a removal, there should be none. Its managed fields and
/// the images it holds are not marks of ours and are left out.
pub fn marks_left(node: &RealNode) -> Result<(Vec<&'static str>, Value), String> {
    let mut n = node.node().ok_or("no Node")?;
    if let Some(m) = n.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("managedFields");
    }
    if let Some(s) = n.get_mut("status").and_then(Value::as_object_mut) {
        s.remove("images");
    }
    let text = n.to_string();
    let marks = [
        "fabricgate",
        "FabricReady",
        "RDMAReady",
        "LustreReady",
        "GPUDirectReady",
    ]
    .into_iter()
    .filter(|m| text.contains(m))
    .collect();
    Ok((marks, n))
}
