//! Runtime transport per pod (issue 42) on the real node: the agent from its image, composed
//! with `deploy/overlays/runtime-transport` (`deploy::runtime_transport`), its REAL sampler (`probes::runtime::sample::PodSampler`: no
//! test seam), real pods started by the kubelet and containerd on the CNI bridge (each its own
//! network namespace, 10.244.0.0/24, default route via `cni0`, no masquerade).
//!
//! "Another Node": a second Node object `realnode-2` (no kubelet, unschedulable) whose
//! `status.addresses` names 10.0.9.2, an address added to `fgnode0` inside the node's own
//! network namespace, where a sink (a thread of this test, entered into that namespace)
//! accepts and discards. Nothing leaves the node's namespace.
//!
//! The pods (namespace `rt-train`):
//! - Job `llm` (one pod, requests `rdma/hca_shared_devices_a`): pushes ~5 MB/s of TCP to the
//!   sink (bash `/dev/tcp`) → `sockets`: the condition, the Events on the pod and its Job, the
//!   metric; then, with `runtime.on_sockets: evict`, the guard's eviction held by a PDB
//!   (`TransportFallbackNotEvicted`) and done once the PDB is relaxed;
//! - pod `quiet` (requests the resource, moves nothing): judged, never `sockets`;
//! - pod `web` (no RDMA resource) pushing the same TCP: never judged (no condition, no series);
//! - the agent's own pod, which requests the RDMA resource too: never judged.
//!
//! Without RDMA in the kernel (no `CONFIG_INFINIBAND` here) no pod can hold a QP, so `rdma`
//! cannot be shown on this node; the Soft-RoCE VM test shows it.

use super::deploy;
use super::harness::{NODE_IP, RESOURCE, RealNode, condition as node_condition, wait_for};
use super::scenarios::{INTERVAL, agent_logs, agent_pod, wait_validated};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Read;
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const NS: &str = "rt-train";
const OTHER_NODE: &str = "realnode-2";
const OTHER_IP: &str = "10.0.9.2";
const SINK_PORT: u16 = 7100;
/// `runtime.window` of this scenario (the least allowed: 5 s).
const WINDOW: Duration = Duration::from_secs(5);
/// `runtime.evict_after` of this scenario (the least allowed: 10 s).
const EVICT_AFTER: Duration = Duration::from_secs(10);
/// `runtime.tcp_min_bytes_per_second`: 1 MB/s; the pushers move ~5 MB/s.
const TCP_MIN: u64 = 1_000_000;
/// What a sample's write, a watch event and a busy 2-core machine may add to a bound.
const SLACK: Duration = Duration::from_secs(10);
/// A DaemonSet or Deployment rollout: the old pod's grace, the new one Ready.
const ROLLOUT: Duration = Duration::from_secs(180);
const CONDITION: &str = "fabricgate.io/TransportReady";

fn runtime_settings() -> String {
    format!(
        "runtime:\n  enabled: true\n  window: {}s\n  tcp_min_bytes_per_second: {TCP_MIN}\n  \
         on_sockets: evict\n  evict_after: {}s\n",
        WINDOW.as_secs(),
        EVICT_AFTER.as_secs()
    )
}

/// ~5 MB/s to the sink, reconnecting if the connection drops.
fn push_command() -> Value {
    json!([
        "bash",
        "-c",
        format!(
            "while :; do exec 3<>/dev/tcp/{OTHER_IP}/{SINK_PORT} || {{ sleep 1; continue; }}; \
             while head -c 1000000 /dev/zero >&3; do sleep 0.2; done; exec 3>&-; done"
        )
    ])
}

fn container(command: Value, rdma: bool) -> Value {
    let mut c = json!({
        "name": "main",
        "image": "localhost/debian:bookworm",
        "imagePullPolicy": "Never",
        "command": command,
    });
    if rdma {
        c["resources"] = json!({ "limits": { RESOURCE: "1" } });
    }
    c
}

fn pod_spec(command: Value, rdma: bool) -> Value {
    json!({
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "nodeSelector": { "kubernetes.io/hostname": "realnode-1" },
        "containers": [container(command, rdma)],
    })
}

/// The sink on OTHER_IP:SINK_PORT in the node's network namespace: accepts, reads, counts
/// the bytes per peer address, until dropped.
struct Sink {
    stop: Arc<AtomicBool>,
    bytes: Arc<Mutex<BTreeMap<IpAddr, u64>>>,
    thread: Option<JoinHandle<()>>,
}

impl Sink {
    fn start(node: &RealNode) -> Result<Sink, String> {
        let path = node.netns_path();
        let ns = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let bytes = Arc::new(Mutex::new(BTreeMap::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop2, bytes2) = (stop.clone(), bytes.clone());
        let thread = std::thread::spawn(move || {
            // This thread only: the namespace holds the socket after the thread ends.
            let bound = rustix::thread::move_into_link_name_space(
                std::os::fd::AsFd::as_fd(&ns),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .map_err(std::io::Error::from)
            .and_then(|()| TcpListener::bind((OTHER_IP, SINK_PORT)))
            .and_then(|l| l.set_nonblocking(true).map(|()| l));
            let listener = match bound {
                Ok(l) => {
                    let _ = tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx.send(Err(format!("sink on {OTHER_IP}:{SINK_PORT}: {e}")));
                    return;
                }
            };
            let mut readers = Vec::new();
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        let (stop, bytes) = (stop2.clone(), bytes2.clone());
                        readers.push(std::thread::spawn(move || {
                            drain(stream, peer.ip(), &stop, &bytes)
                        }));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
            for r in readers {
                let _ = r.join();
            }
        });
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|e| format!("sink thread: {e}"))??;
        Ok(Sink {
            stop,
            bytes,
            thread: Some(thread),
        })
    }

    fn from(&self, peer: IpAddr) -> u64 {
        self.bytes
            .lock()
            .map(|b| b.get(&peer).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

fn drain(
    mut stream: TcpStream,
    peer: IpAddr,
    stop: &AtomicBool,
    bytes: &Mutex<BTreeMap<IpAddr, u64>>,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = vec![0u8; 256 * 1024];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Ok(mut b) = bytes.lock() {
                    *b.entry(peer).or_default() += n as u64;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pod(node: &RealNode, name: &str) -> Option<Value> {
    node.get_json(&["pod", name, "-n", NS])
}

/// The Job's pod (not being deleted).
fn job_pod(node: &RealNode) -> Option<Value> {
    node.get_json(&["pods", "-n", NS, "-l", "batch.kubernetes.io/job-name=llm"])?["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null())
        .cloned()
}

fn name_of(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap_or("").to_owned()
}

/// The pod's `fabricgate.io/TransportReady` as (status, reason, message).
fn transport_condition(pod: &Value) -> Option<(String, String, String)> {
    node_condition(pod, CONDITION).map(|c| {
        let s = |k: &str| c[k].as_str().unwrap_or("").to_owned();
        (s("status"), s("reason"), s("message"))
    })
}

fn running(pod: &Value) -> bool {
    pod.pointer("/status/containerStatuses/0/state/running")
        .is_some()
}

/// The events.k8s.io Events of `reason` about `kind`/`name` in NS.
fn events(node: &RealNode, reason: &str, kind: &str, name: &str) -> Vec<Value> {
    node.get_json(&["events.v1.events.k8s.io", "-n", NS])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| {
            e["reason"] == reason
                && e["regarding"]["kind"] == kind
                && e["regarding"]["name"] == name
        })
        .collect()
}

/// The agent's /metrics (the agent is on the node's network, 10.0.9.1:9464).
fn agent_metrics(node: &RealNode) -> Result<String, String> {
    let out = node
        .nsenter("curl")
        .args([
            "-sS",
            "--max-time",
            "5",
            &format!("http://{NODE_IP}:9464/metrics"),
        ])
        .output()
        .map_err(|e| format!("curl: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "curl /metrics: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn series(metrics: &str, pod: &str) -> Vec<String> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(&format!("pod=\"{pod}\"")))
        .map(str::to_owned)
        .collect()
}

fn ip_addr(node: &RealNode, verb: &str) -> Result<(), String> {
    let out = node
        .nsenter("ip")
        .args(["addr", verb, &format!("{OTHER_IP}/32"), "dev", "fgnode0"])
        .output()
        .map_err(|e| format!("ip addr {verb}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip addr {verb} {OTHER_IP}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn current_agent_image(node: &RealNode) -> Result<String, String> {
    node.get_json(&["daemonset", "fabricgate", "-n", "fabricgate"])
        .and_then(|d| {
            d.pointer("/spec/template/spec/containers/0/image")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .ok_or_else(|| "no DaemonSet fabricgate".into())
}

fn rollout(node: &RealNode, what: &str) -> Result<(), String> {
    node.kubectl(&[
        "rollout",
        "status",
        what,
        "-n",
        "fabricgate",
        &format!("--timeout={}s", ROLLOUT.as_secs()),
    ])
    .map(|_| ())
}

/// The agent container's effective capabilities (`CapEff` of its process, read from the
/// host), for the record of what the component really grants.
fn agent_cap_eff(node: &RealNode) -> Option<String> {
    let pod = agent_pod(node)?;
    let id = pod
        .pointer("/status/containerStatuses/0/containerID")?
        .as_str()?
        .strip_prefix("containerd://")?
        .to_owned();
    let tasks = node.ctr(&["tasks", "ls"]).ok()?;
    let pid = tasks
        .lines()
        .find(|l| l.starts_with(&id))?
        .split_whitespace()
        .nth(1)?
        .to_owned();
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("CapEff:"))
        .map(|l| l.trim_start_matches("CapEff:").trim().to_owned())
}

/// The whole scenario; the node is put back (agent as shipped, guard as found, the second
/// Node, the address and the namespace gone) whatever the outcome.
pub fn sockets_pod_is_judged_and_evicted(node: &RealNode) -> Result<(), String> {
    let image = current_agent_image(node)?;
    let had_guard = node
        .get_json(&["deployment", "fabricgate-guard", "-n", "fabricgate"])
        .is_some();
    let result = scenario(node, &image);
    let restored = restore(node, &image, had_guard);
    result.and(restored)
}

fn scenario(node: &RealNode, image: &str) -> Result<(), String> {
    let mark = node.audit_mark();
    // The agent with the component, from its image.
    let t = Instant::now();
    node.apply(&deploy::runtime_transport(
        node,
        image,
        &runtime_settings(),
    )?)?;
    rollout(node, "daemonset/fabricgate").map_err(|e| format!("{e}\n{}", agent_logs(node)))?;
    let agent = agent_pod(node).ok_or("no agent pod")?;
    if agent.pointer("/spec/hostPID") != Some(&json!(true)) {
        return Err(format!(
            "the agent pod after the rollout has no hostPID: {}",
            agent["spec"]
        ));
    }
    wait_validated(node, ROLLOUT)?;
    println!(
        "figure: agent with deploy/overlays/runtime-transport rolled out, node validated: {:?}; agent CapEff {:?}",
        t.elapsed(),
        agent_cap_eff(node)
    );
    // The guard reads runtime.on_sockets at its start: (re)start it on these requirements.
    node.apply(&deploy::guard(image)?)?;
    node.kubectl(&[
        "rollout",
        "restart",
        "deployment/fabricgate-guard",
        "-n",
        "fabricgate",
    ])?;
    rollout(node, "deployment/fabricgate-guard")?;

    // Another Node whose address is in this node's namespace, and a sink there.
    ip_addr(node, "add")?;
    let sink = Sink::start(node)?;
    let other = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": OTHER_NODE },
        "spec": { "unschedulable": true },
        "status": { "addresses": [{ "type": "InternalIP", "address": OTHER_IP }] },
    });
    node.kubectl_stdin(&["create", "-f", "-"], Some(&other.to_string()))?;

    let objects = [
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NS } }),
        // Blocks any eviction of the Job's pod until relaxed below.
        json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": { "name": "llm", "namespace": NS },
            "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "llm" } } },
        }),
        json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": { "name": "llm", "namespace": NS },
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": { "labels": { "app": "llm" } },
                    "spec": pod_spec(push_command(), true),
                },
            },
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "quiet", "namespace": NS },
            "spec": pod_spec(json!(["sleep", "3600"]), true),
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "web", "namespace": NS },
            "spec": pod_spec(push_command(), false),
        }),
    ];
    let manifest = objects
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n---\n");
    // The namespace's default ServiceAccount comes from kube-controller-manager a moment later.
    let mut last = String::new();
    wait_for("the pods created", Duration::from_secs(30), || {
        node.apply(&manifest).map_err(|e| last = e).is_ok()
    })
    .map_err(|e| format!("{e}: {last}"))?;
    wait_for(
        "the Job's pod, quiet and web running",
        Duration::from_secs(120),
        || {
            job_pod(node).is_some_and(|p| running(&p))
                && pod(node, "quiet").is_some_and(|p| running(&p))
                && pod(node, "web").is_some_and(|p| running(&p))
        },
    )?;
    let started = Instant::now();
    let trainer = job_pod(node).ok_or("no Job pod")?;
    let trainer_name = name_of(&trainer);
    let web_ip: IpAddr = pod(node, "web")
        .and_then(|p| p.pointer("/status/podIP")?.as_str()?.parse().ok())
        .ok_or("web has no pod IP")?;
    let trainer_ip: IpAddr = trainer
        .pointer("/status/podIP")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
        .ok_or("the Job's pod has no pod IP")?;

    // sockets within the window + one probe interval.
    let bound = WINDOW + INTERVAL + SLACK;
    let took = wait_for("the Job's pod False/SocketsFallback", bound, || {
        pod(node, &trainer_name)
            .and_then(|p| transport_condition(&p))
            .is_some_and(|(s, r, _)| s == "False" && r == "SocketsFallback")
    })
    .map_err(|e| {
        format!(
            "{e}: condition {:?}, sink got {} bytes from it\n{}",
            pod(node, &trainer_name).and_then(|p| transport_condition(&p)),
            sink.from(trainer_ip),
            agent_logs(node)
        )
    })?;
    println!(
        "figure: real pod pushing TCP to another Node's address -> fabricgate.io/TransportReady False/SocketsFallback {took:?} after it ran (window {WINDOW:?}, interval {INTERVAL:?})"
    );
    let (_, _, message) = pod(node, &trainer_name)
        .and_then(|p| transport_condition(&p))
        .ok_or("the condition went away")?;
    println!("figure: condition message: {message}");
    for needle in ["0 data-path QPs", "over TCP to 1 node", "via eth0"] {
        if !message.contains(needle) {
            return Err(format!(
                "the condition's message does not say {needle:?}: {message}"
            ));
        }
    }

    // The Event on the pod and on its Job.
    wait_for("TransportFallback on the pod and on the Job", SLACK, || {
        events(node, "TransportFallback", "Pod", &trainer_name).len() == 1
            && events(node, "TransportFallback", "Job", "llm").len() == 1
    })?;
    let note = events(node, "TransportFallback", "Job", "llm")[0]["note"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    if !note.starts_with(&format!("pod {NS}/{trainer_name} is on sockets: ")) {
        return Err(format!("the Job's Event does not name its pod: {note}"));
    }

    // The metric; the quiet pod judged and not on sockets; the unrelated pod never judged.
    // Two more windows first, so the quiet pod and web have had their chances.
    std::thread::sleep(WINDOW * 2);
    let metrics = agent_metrics(node)?;
    let want = format!(
        "fabricgate_pod_transport{{namespace=\"{NS}\",pod=\"{trainer_name}\",transport=\"sockets\"}} 1"
    );
    if !metrics.lines().any(|l| l == want) {
        return Err(format!(
            "no `{want}` on the agent's /metrics: {:?}",
            series(&metrics, &trainer_name)
        ));
    }
    let owner = format!(
        "fabricgate_pod_owner_info{{namespace=\"{NS}\",pod=\"{trainer_name}\",owner_kind=\"Job\",owner_name=\"llm\"}} 1"
    );
    if !metrics.lines().any(|l| l == owner) {
        return Err(format!("no `{owner}` on the agent's /metrics"));
    }
    let quiet = series(&metrics, "quiet");
    let quiet_sockets = format!(
        "fabricgate_pod_transport{{namespace=\"{NS}\",pod=\"quiet\",transport=\"sockets\"}} 1"
    );
    if quiet.is_empty() || quiet.contains(&quiet_sockets) {
        return Err(format!(
            "the quiet pod (requests the resource, moves nothing) is not judged, or is on sockets: {quiet:?}"
        ));
    }
    let quiet_condition = pod(node, "quiet").and_then(|p| transport_condition(&p));
    if quiet_condition
        .as_ref()
        .is_some_and(|(_, r, _)| r == "SocketsFallback")
    {
        return Err(format!("the quiet pod's condition: {quiet_condition:?}"));
    }
    println!(
        "figure: quiet pod: {:?}, condition {quiet_condition:?}",
        quiet
            .iter()
            .filter(|l| l.starts_with("fabricgate_pod_transport") && l.ends_with(" 1"))
            .collect::<Vec<_>>()
    );
    let web_bytes = sink.from(web_ip);
    if web_bytes < TCP_MIN * WINDOW.as_secs() {
        return Err(format!(
            "the unrelated pod pushed only {web_bytes} bytes: it would not show it is ignored"
        ));
    }
    let web = series(&metrics, "web");
    let web_condition = pod(node, "web").and_then(|p| transport_condition(&p));
    if !web.is_empty() || web_condition.is_some() {
        return Err(format!(
            "the unrelated pod (no RDMA resource, {web_bytes} bytes pushed) was judged: {web:?} {web_condition:?}"
        ));
    }
    // The agent's own pod requests the RDMA resource too (the shipped daemonset.yaml): never
    // judged, so the guard could never evict it.
    let agent_name = agent_pod(node).map(|p| name_of(&p)).ok_or("no agent pod")?;
    let agent_condition = node
        .get_json(&["pod", &agent_name, "-n", "fabricgate"])
        .and_then(|p| transport_condition(&p));
    if !series(&metrics, &agent_name).is_empty() || agent_condition.is_some() {
        return Err(format!(
            "the agent's own pod was judged: {:?} {agent_condition:?}",
            series(&metrics, &agent_name)
        ));
    }
    println!(
        "figure: sink received {} bytes from the Job's pod, {web_bytes} from the unrelated pod (never judged)",
        sink.from(trainer_ip)
    );

    // runtime.on_sockets: evict: the guard evicts through the Eviction API; the PDB holds it.
    let held = wait_for(
        "TransportFallbackNotEvicted (the PDB)",
        EVICT_AFTER + Duration::from_secs(60),
        || !events(node, "TransportFallbackNotEvicted", "Pod", &trainer_name).is_empty(),
    )
    .map_err(|e| format!("{e}\n{}", node.guard_logs()))?;
    let still = pod(node, &trainer_name).ok_or("the Job's pod is gone while its PDB blocks")?;
    if !still["metadata"]["deletionTimestamp"].is_null() {
        return Err("the Job's pod is being deleted while its PDB blocks".into());
    }
    println!(
        "figure: guard eviction refused by the PDB -> TransportFallbackNotEvicted {:?} after the pod ran (evict_after {EVICT_AFTER:?})",
        started.elapsed()
    );
    let _ = held;
    node.kubectl(&[
        "patch",
        "pdb",
        "llm",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"spec":{"minAvailable":0}}"#,
    ])?;
    let relaxed = Instant::now();
    wait_for(
        "the guard evicts the Job's pod",
        Duration::from_secs(60),
        || {
            pod(node, &trainer_name).is_none_or(|p| !p["metadata"]["deletionTimestamp"].is_null())
                && !events(node, "TransportFallbackEvicted", "Pod", &trainer_name).is_empty()
        },
    )
    .map_err(|e| format!("{e}\n{}", node.guard_logs()))?;
    println!(
        "figure: PDB relaxed -> evicted by the guard {:?}",
        relaxed.elapsed()
    );
    let evictions = node
        .audit_events(mark)
        .into_iter()
        .filter(|e| {
            e["objectRef"]["subresource"] == "eviction"
                && e["objectRef"]["name"] == trainer_name.as_str()
                && e["verb"] == "create"
        })
        .map(|e| {
            format!(
                "{} {}",
                e["user"]["username"].as_str().unwrap_or(""),
                e["responseStatus"]["code"]
            )
        })
        .collect::<Vec<_>>();
    if !evictions.iter().any(|e| {
        e.starts_with("system:serviceaccount:fabricgate:fabricgate-guard ") && e.ends_with(" 201")
    }) {
        return Err(format!(
            "no eviction by the guard's account in the audit log: {evictions:?}"
        ));
    }
    println!("figure: eviction requests (user, code): {evictions:?}");
    drop(sink);
    Ok(())
}

/// The node as the scenario found it: the test's namespace, Node and address gone, the agent
/// as daemonset.yaml ships it (SSA drops hostPID and the capabilities), the composition's
/// extra objects deleted, the guard gone or restarted on the shipped requirements.
fn restore(node: &RealNode, image: &str, had_guard: bool) -> Result<(), String> {
    let mut results: Vec<Result<String, String>> = vec![
        node.kubectl(&[
            "delete",
            "namespace",
            NS,
            "--ignore-not-found",
            "--wait=false",
        ]),
        node.kubectl(&["delete", "node", OTHER_NODE, "--ignore-not-found"]),
    ];
    let _ = ip_addr(node, "del");
    results.push(deploy::daemonset(node, image).and_then(|m| node.apply(&m)));
    for (kind, name) in deploy::RUNTIME_TRANSPORT_EXTRA {
        results.push(node.kubectl(&["delete", kind, name, "--ignore-not-found"]));
    }
    if had_guard {
        results.push(node.kubectl(&[
            "rollout",
            "restart",
            "deployment/fabricgate-guard",
            "-n",
            "fabricgate",
        ]));
        results.push(rollout(node, "deployment/fabricgate-guard").map(|()| String::new()));
    } else {
        results.push(deploy::guard(image).and_then(|m| {
            node.kubectl_stdin(&["delete", "--ignore-not-found", "-f", "-"], Some(&m))
        }));
    }
    results.push(rollout(node, "daemonset/fabricgate").map(|()| String::new()));
    if agent_pod(node).is_some_and(|p| p.pointer("/spec/hostPID") == Some(&json!(true))) {
        results.push(Err("the agent still has hostPID after the restore".into()));
    }
    results.push(wait_validated(node, ROLLOUT).map(|_| String::new()));
    let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("restoring the node: {}", errors.join("; ")))
    }
}
