//! Runtime transport per pod on the real node: the agent from its image, composed with
//! `deploy/overlays/runtime-transport` (`deploy::runtime_transport`), its REAL sampler
//! (`probes::transport::sample::PodSampler`: no test seam), real pods started by the kubelet and
//! containerd on the CNI bridge (each its own network namespace, host-local IPAM 10.244.0.0/24,
//! default route via `cni0`, no masquerade).
//!
//! The network is the shape Calico or Cilium cluster-pool IPAM gives: the pods' addresses come
//! from a pool that no Node's `spec.podCIDRs` holds. "Another node" is a second Node object
//! `realnode-2` (no kubelet, unschedulable, `spec.podCIDR` 10.245.0.0/24, `status.addresses`
//! 10.0.9.2) and pod objects bound to it whose `status.podIPs` the test writes as a kubelet
//! would; their addresses live in a network namespace of their own behind a veth from the
//! node's (`Remote`: not the node's own addresses, as on a real cluster), where threads of
//! this test play them. Nothing leaves the node's namespaces.
//!
//! The pods (namespace `rt-train`):
//! - Job `llm` (its pod requests `rdma/hca_shared_devices_a`) and its peer `llm-peer` on
//!   realnode-2 at 10.244.9.2 (outside every podCIDR): the Job's pod pushes ~5 MB/s of TCP to
//!   its peer (bash `/dev/tcp`) → `sockets` once `runtime.confirm_windows` windows in a row
//!   showed it: the condition, the Events on the pod and its Job, the metric; then, with
//!   `runtime.on_sockets: evict`, the guard's eviction held by a PDB
//!   (`TransportFallbackNotEvicted`) and done once the PDB is relaxed;
//! - job `ckpt` (label `training.kubeflow.org/job-name`, judged by `runtime.pod_selector`: the
//!   node's device plugin has 4 units): `listener` (listens on :29500) into which `intruder`, a pod of another job on realnode-2 at 10.245.0.3
//!   (inside realnode-2's podCIDR), streams ~5 MB/s; `reader`, pulling ~5 MB/s from a
//!   "storage" server at 10.0.9.2 (realnode-2's Node address); and their peer `ckpt-1` on
//!   realnode-2. Neither is ever `sockets`; both show their TCP as `other_tcp_bytes`;
//! - job `hnet`, `hostNetwork` (the node's own namespace, shared with the agent and every
//!   other host process): `hnet-0` pushes ~5 MB/s to its peer `hnet-1` on realnode-2, whose
//!   addresses are its Node's (10.0.9.2) → `sockets`; `hnet-quiet`, of the same job and the same
//!   namespace, moves nothing → never `sockets` (a host-network pod's TCP is its own
//!   processes' sockets, not its namespace's);
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
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const NS: &str = "rt-train";
const OTHER_NODE: &str = "realnode-2";
/// realnode-2's Node address, and the "storage" server the reader pulls from.
const OTHER_IP: &str = "10.0.9.2";
/// realnode-2's `spec.podCIDR`, which its pods' addresses (Calico-like) are not taken from.
const OTHER_POD_CIDR: &str = "10.245.0.0/24";
/// The Job's peer on realnode-2: outside every podCIDR.
const PEER_IP: &str = "10.244.9.2";
/// A pod of another job on realnode-2, inside its podCIDR (the old rule counted it).
const INTRUDER_IP: &str = "10.245.0.3";
/// The ckpt job's pod on realnode-2.
const CKPT_PEER_IP: &str = "10.244.9.4";
/// The secondary network (macvlan on `fgm0` in the node's namespace, as Multus would attach a
/// `NetworkAttachmentDefinition` on the RoCE netdev): the mnet job's pod here, and its peer's
/// address on it, in no podCIDR and not in its `status.podIPs`.
const SECONDARY_HERE: &str = "192.168.50.10";
const SECONDARY_PEER: &str = "192.168.50.2";
/// The mnet job's peer's primary address (never reached: its traffic is on the secondary).
const MNET_PEER_IP: &str = "10.244.9.6";
const SINK_PORT: u16 = 7100;
/// Where the hostNetwork job's pod pushes, on its peer's Node address.
const HOSTNET_PORT: u16 = 7300;
const STORAGE_PORT: u16 = 7200;
const LISTEN_PORT: u16 = 29500;
/// `runtime.window` of this scenario (the least allowed: 5 s).
const WINDOW: Duration = Duration::from_secs(5);
/// `runtime.confirm_windows` of this scenario (the default).
const CONFIRM: u32 = 2;
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
         on_sockets: evict\n  evict_after: {}s\n  confirm_windows: {CONFIRM}\n  \
         pod_selector: fabricgate-test/judge=yes\n",
        WINDOW.as_secs(),
        EVICT_AFTER.as_secs()
    )
}

/// ~5 MB/s to `ip:port`, reconnecting if the connection drops.
fn push_command(ip: &str, port: u16) -> Value {
    push_command_on(ip, port, None)
}

/// [`push_command`], once `interface` exists in the pod (when given).
fn push_command_on(ip: &str, port: u16, interface: Option<&str>) -> Value {
    let wait = interface.map_or(String::new(), |i| {
        format!("until [ -e /sys/class/net/{i} ]; do sleep 0.2; done; ")
    });
    json!([
        "bash",
        "-c",
        format!(
            "{wait}while :; do exec 3<>/dev/tcp/{ip}/{port} || {{ sleep 1; continue; }}; \
             while head -c 1000000 /dev/zero >&3; do sleep 0.2; done; exec 3>&-; done"
        )
    ])
}

/// Everything `ip:port` sends, read and dropped, reconnecting if the connection drops.
fn pull_command(ip: &str, port: u16) -> Value {
    json!([
        "bash",
        "-c",
        format!("while :; do cat </dev/tcp/{ip}/{port} >/dev/null || sleep 1; done")
    ])
}

/// Listens on LISTEN_PORT (a TCPStore's port) and reads whatever comes (perl-base's
/// IO::Socket::INET: the image is Debian minbase).
fn listen_command() -> Value {
    json!([
        "perl",
        "-MIO::Socket::INET",
        "-e",
        format!(
            "my $s = IO::Socket::INET->new(LocalPort => {LISTEN_PORT}, Listen => 5, \
             ReuseAddr => 1) or die \"listen: $!\"; \
             while (my $c = $s->accept) {{ my $b; while (sysread($c, $b, 1 << 20)) {{}} }}"
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

/// [`pod_spec`] on the node's own network.
fn host_network_spec(command: Value) -> Value {
    let mut spec = pod_spec(command, false);
    spec["hostNetwork"] = json!(true);
    spec
}

/// What a test thread in the remote network namespace does with its connections.
#[derive(Clone, Copy)]
enum Role {
    /// Accepts on the address, reads and counts what each peer sends.
    Sink,
    /// Accepts on the address and sends ~5 MB/s to each client (the storage server).
    Source,
    /// Connects from the address (bound) to a target and sends ~5 MB/s (the intruder).
    Stream { to: std::net::SocketAddr },
}

/// A test thread in the remote network namespace playing an address of "another node";
/// counts the bytes it moved per remote address, until dropped.
struct Player {
    stop: Arc<AtomicBool>,
    bytes: Arc<Mutex<BTreeMap<IpAddr, u64>>>,
    thread: Option<JoinHandle<()>>,
}

impl Player {
    fn start(netns: &std::path::Path, ip: &str, port: u16, role: Role) -> Result<Player, String> {
        let path = netns.to_path_buf();
        let ns = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let bytes = Arc::new(Mutex::new(BTreeMap::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop2, bytes2) = (stop.clone(), bytes.clone());
        let local: std::net::SocketAddr = format!("{ip}:{port}")
            .parse()
            .map_err(|e| format!("{ip}:{port}: {e}"))?;
        let thread = std::thread::spawn(move || {
            // This thread only: the namespace holds the socket after the thread ends.
            if let Err(e) = rustix::thread::move_into_link_name_space(
                std::os::fd::AsFd::as_fd(&ns),
                Some(rustix::thread::LinkNameSpaceType::Network),
            ) {
                let _ = tx.send(Err(format!("setns: {e}")));
                return;
            }
            if let Role::Stream { to } = role {
                let _ = tx.send(Ok(()));
                stream_from(local, to, &stop2, &bytes2);
                return;
            }
            let listener = match TcpListener::bind(local).and_then(|l| {
                l.set_nonblocking(true)?;
                Ok(l)
            }) {
                Ok(l) => {
                    let _ = tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx.send(Err(format!("listen on {local}: {e}")));
                    return;
                }
            };
            let mut workers = Vec::new();
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        let (stop, bytes) = (stop2.clone(), bytes2.clone());
                        workers.push(std::thread::spawn(move || match role {
                            Role::Source => send(stream, peer.ip(), &stop, &bytes),
                            _ => drain(stream, peer.ip(), &stop, &bytes),
                        }));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
            for w in workers {
                let _ = w.join();
            }
        });
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|e| format!("test thread for {ip}: {e}"))??;
        Ok(Player {
            stop,
            bytes,
            thread: Some(thread),
        })
    }

    fn with(&self, peer: IpAddr) -> u64 {
        self.bytes
            .lock()
            .map(|b| b.get(&peer).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    fn total(&self) -> u64 {
        self.bytes.lock().map(|b| b.values().sum()).unwrap_or(0)
    }
}

/// Whatever `peer` sends over `stream`, read and counted, until stopped or closed.
fn drain(stream: TcpStream, peer: IpAddr, stop: &AtomicBool, bytes: &Mutex<BTreeMap<IpAddr, u64>>) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = vec![0u8; 256 * 1024];
    pump(stream, peer, stop, bytes, |s| match s.read(&mut buf) {
        Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
        other => other,
    });
}

/// ~5 MB/s to `peer` over `stream` until stopped or closed.
fn send(stream: TcpStream, peer: IpAddr, stop: &AtomicBool, bytes: &Mutex<BTreeMap<IpAddr, u64>>) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
    let chunk = vec![0u8; 1_000_000];
    pump(stream, peer, stop, bytes, |s| {
        s.write_all(&chunk)?;
        std::thread::sleep(Duration::from_millis(200));
        Ok(chunk.len())
    });
}

/// `step` over `stream` (blocking, with its timeout) until stopped or the connection ends,
/// counting the bytes it moved with `peer`; a timeout is a step that moved nothing.
fn pump(
    mut stream: TcpStream,
    peer: IpAddr,
    stop: &AtomicBool,
    bytes: &Mutex<BTreeMap<IpAddr, u64>>,
    mut step: impl FnMut(&mut TcpStream) -> std::io::Result<usize>,
) {
    let _ = stream.set_nonblocking(false);
    while !stop.load(Ordering::Relaxed) {
        match step(&mut stream) {
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

/// Connect from `local` to `to` (again whenever it drops) and send ~5 MB/s.
fn stream_from(
    local: std::net::SocketAddr,
    to: std::net::SocketAddr,
    stop: &AtomicBool,
    bytes: &Mutex<BTreeMap<IpAddr, u64>>,
) {
    while !stop.load(Ordering::Relaxed) {
        let connected = rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            None,
        )
        .and_then(|fd| {
            rustix::net::bind(&fd, &local)?;
            rustix::net::connect(&fd, &to)?;
            Ok(fd)
        });
        let Ok(fd) = connected else {
            std::thread::sleep(Duration::from_millis(500));
            continue;
        };
        let socket = TcpStream::from(fd);
        send(socket, to.ip(), stop, bytes);
    }
}

impl Drop for Player {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// "Another node" off this one: a network namespace of its own (held by a `sleep`), behind a
/// veth from the node's namespace, holding realnode-2's address and its pods'; the node routes
/// to them. Its addresses are not the node's own, as on a real cluster.
struct Remote {
    holder: std::process::Child,
}

const REMOTE_IPS: [&str; 4] = [OTHER_IP, PEER_IP, INTRUDER_IP, CKPT_PEER_IP];

impl Remote {
    fn start(node: &RealNode) -> Result<Remote, String> {
        let holder = node
            .nsenter("unshare")
            .args(["--net", "--", "sleep", "infinity"])
            .spawn()
            .map_err(|e| format!("unshare --net: {e}"))?;
        let remote = Remote { holder };
        let node_ns = std::fs::read_link(node.netns_path()).map_err(|e| e.to_string())?;
        // Until the holder is `sleep`, it is still nsenter or unshare in another namespace.
        let comm = format!("/proc/{}/comm", remote.holder.id());
        wait_for("the remote namespace", Duration::from_secs(10), || {
            std::fs::read_to_string(&comm).is_ok_and(|c| c.trim() == "sleep")
                && std::fs::read_link(remote.netns()).is_ok_and(|ns| ns != node_ns)
        })?;
        let pid = remote.holder.id().to_string();
        let in_node = |args: &[&str]| run(node.nsenter(args[0]).args(&args[1..]));
        let in_remote = |args: &[&str]| remote.run_in(args);
        in_node(&[
            "ip", "link", "add", "fgr0", "type", "veth", "peer", "name", "fgr1", "netns", &pid,
        ])?;
        in_node(&["ip", "addr", "add", "10.0.8.1/30", "dev", "fgr0"])?;
        in_node(&["ip", "link", "set", "fgr0", "up"])?;
        in_node(&["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])?;
        in_remote(&["ip", "link", "set", "lo", "up"])?;
        in_remote(&["ip", "addr", "add", "10.0.8.2/30", "dev", "fgr1"])?;
        in_remote(&["ip", "link", "set", "fgr1", "up"])?;
        in_remote(&["ip", "route", "add", "default", "via", "10.0.8.1"])?;
        for ip in REMOTE_IPS {
            in_remote(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "fgr1"])?;
            in_node(&[
                "ip",
                "route",
                "add",
                &format!("{ip}/32"),
                "via",
                "10.0.8.2",
                "dev",
                "fgr0",
            ])?;
        }
        Ok(remote)
    }

    fn netns(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("/proc/{}/ns/net", self.holder.id()))
    }

    /// `args` run inside the remote namespace.
    fn run_in(&self, args: &[&str]) -> Result<(), String> {
        let mut c = std::process::Command::new("nsenter");
        c.arg(format!("--net={}", self.netns().display()))
            .arg("--")
            .args(args);
        run(&mut c)
    }
}

impl Drop for Remote {
    /// The namespace goes with its last holder, the veth pair and the node's routes with it.
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// A secondary network as Multus gives one: a veth end `fgm0` in the node's namespace as the
/// macvlan master (the "RoCE netdev"), the pod's `net1` from the reference macvlan plugin's
/// ADD (`/usr/lib/cni/macvlan`, static IPAM), the peer's macvlan on the same master in the
/// remote namespace, and both pods' `k8s.v1.cni.cncf.io/network-status` written as Multus
/// writes it.
struct Secondary<'a> {
    node: &'a RealNode,
}

impl<'a> Secondary<'a> {
    fn attach(node: &'a RealNode, remote: &Remote, pod_json: &Value) -> Result<Self, String> {
        let in_node = |args: &[&str]| run(node.nsenter(args[0]).args(&args[1..]));
        in_node(&[
            "ip", "link", "add", "fgm0", "type", "veth", "peer", "name", "fgm1",
        ])?;
        let secondary = Secondary { node };
        in_node(&["ip", "link", "set", "fgm0", "up"])?;
        in_node(&["ip", "link", "set", "fgm1", "up"])?;
        // The peer's attachment: a macvlan sibling on the same master, in the remote namespace.
        let holder = remote.holder.id().to_string();
        in_node(&[
            "ip", "link", "add", "link", "fgm0", "name", "fgpeer", "type", "macvlan", "mode",
            "bridge",
        ])?;
        in_node(&["ip", "link", "set", "fgpeer", "netns", &holder])?;
        let in_remote = |args: &[&str]| remote.run_in(args);
        in_remote(&[
            "ip",
            "addr",
            "add",
            &format!("{SECONDARY_PEER}/24"),
            "dev",
            "fgpeer",
        ])?;
        in_remote(&["ip", "link", "set", "fgpeer", "up"])?;
        // The pod's attachment: the plugin's ADD, in the node's namespaces, into the pod's.
        let pid = container_pid(node, pod_json).ok_or("rank-0's container has no PID")?;
        // The bare ID: CNI refuses `containerd://...` (not `[a-z0-9][a-z0-9_.-]*`).
        let id = pod_json
            .pointer("/status/containerStatuses/0/containerID")
            .and_then(Value::as_str)
            .and_then(|c| c.rsplit("://").next())
            .unwrap_or("rank-0");
        let config = json!({
            "cniVersion": "1.0.0", "name": "fabric-macvlan", "type": "macvlan",
            "master": "fgm0", "mode": "bridge",
            "ipam": { "type": "static", "addresses": [{ "address": format!("{SECONDARY_HERE}/24") }] },
        });
        let mut add = node.nsenter("/usr/lib/cni/macvlan");
        add.env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", id)
            .env("CNI_NETNS", format!("/proc/{pid}/ns/net"))
            .env("CNI_IFNAME", "net1")
            .env("CNI_PATH", "/usr/lib/cni")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = add.spawn().map_err(|e| format!("macvlan ADD: {e}"))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(config.to_string().as_bytes())
                .map_err(|e| format!("macvlan ADD stdin: {e}"))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| format!("macvlan ADD: {e}"))?;
        let result: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            format!(
                "macvlan ADD answered {e}: {} {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        if result.get("code").is_some() || !out.status.success() {
            return Err(format!("macvlan ADD failed: {result}"));
        }
        let mac = result
            .pointer("/interfaces/0/mac")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let primary = pod_json
            .pointer("/status/podIP")
            .and_then(Value::as_str)
            .unwrap_or("");
        let annotate = |name: &str, cluster_ip: &str, ip: &str, mac: &str| {
            let status = network_status(cluster_ip, ip, mac);
            node.kubectl(&[
                "annotate",
                "--overwrite",
                "pod",
                name,
                "-n",
                NS,
                "k8s.v1.cni.cncf.io/networks=fabric-macvlan",
                &format!("k8s.v1.cni.cncf.io/network-status={status}"),
            ])
        };
        annotate("rank-0", primary, SECONDARY_HERE, &mac)?;
        annotate("rank-1", MNET_PEER_IP, SECONDARY_PEER, "0a:58:c0:a8:32:02")?;
        Ok(secondary)
    }
}

impl Drop for Secondary<'_> {
    fn drop(&mut self) {
        let _ = run(self.node.nsenter("ip").args(["link", "del", "fgm0"]));
    }
}

/// The `k8s.v1.cni.cncf.io/network-status` annotation as Multus writes it (its indented JSON):
/// the cluster network first (`default: true`), then the attachment.
fn network_status(cluster_ip: &str, ip: &str, mac: &str) -> String {
    format!(
        r#"[{{
    "name": "realnode",
    "interface": "eth0",
    "ips": [
        "{cluster_ip}"
    ],
    "mac": "0a:58:0a:f4:00:0a",
    "default": true,
    "dns": {{}}
}},{{
    "name": "{NS}/fabric-macvlan",
    "interface": "net1",
    "ips": [
        "{ip}"
    ],
    "mac": "{mac}",
    "dns": {{}}
}}]"#
    )
}

/// The host PID of a pod's first container (containerd's task list).
fn container_pid(node: &RealNode, pod_json: &Value) -> Option<String> {
    let id = pod_json
        .pointer("/status/containerStatuses/0/containerID")?
        .as_str()?
        .strip_prefix("containerd://")?
        .to_owned();
    let tasks = node.ctr(&["tasks", "ls"]).ok()?;
    tasks
        .lines()
        .find(|l| l.starts_with(&id))?
        .split_whitespace()
        .nth(1)
        .map(str::to_owned)
}

fn run(c: &mut std::process::Command) -> Result<(), String> {
    let out = c.output().map_err(|e| format!("{c:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{c:?}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

fn pod(node: &RealNode, name: &str) -> Option<Value> {
    node.get_json(&["pod", name, "-n", NS])
}

/// The Job's pod (not being deleted).
fn job_pod(node: &RealNode) -> Option<Value> {
    node.get_json(&[
        "pods",
        "-n",
        NS,
        "-l",
        "batch.kubernetes.io/job-name=llm,app=llm",
    ])?["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null())
        .cloned()
}

fn name_of(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap_or("").to_owned()
}

/// A pod's `fabricgate.io/TransportReady` as (status, reason, message).
type TransportCondition = (String, String, String);

/// The pod's `fabricgate.io/TransportReady` as (status, reason, message).
fn transport_condition(pod: &Value) -> Option<TransportCondition> {
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

/// The series of pod `name` on the agent's `/metrics` and its condition, when it is judged
/// (it has series) and not on sockets (no `sockets` series, the condition not `False`);
/// otherwise what it shows, with `what` of the pod.
fn judged_not_sockets(
    node: &RealNode,
    metrics: &str,
    name: &str,
    what: &str,
) -> Result<(Vec<String>, Option<TransportCondition>), String> {
    let lines = series(metrics, name);
    let condition = pod(node, name).and_then(|p| transport_condition(&p));
    let sockets = format!(
        "fabricgate_pod_transport{{namespace=\"{NS}\",pod=\"{name}\",transport=\"sockets\"}} 1"
    );
    if lines.is_empty()
        || lines.contains(&sockets)
        || condition.as_ref().is_some_and(|(s, _, _)| s == "False")
    {
        return Err(format!(
            "{name} ({what}) judged sockets, or not judged: {lines:?} {condition:?}"
        ));
    }
    Ok((lines, condition))
}

fn series(metrics: &str, pod: &str) -> Vec<String> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(&format!("pod=\"{pod}\"")))
        .map(str::to_owned)
        .collect()
}

/// A pod bound to realnode-2 (no kubelet runs it; the test writes its status), tolerating its
/// node's not-ready taints so that nothing evicts it meanwhile.
fn remote_pod(name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": NS, "labels": labels },
        "spec": {
            "nodeName": OTHER_NODE,
            "tolerations": [{ "operator": "Exists" }],
            "containers": [container(json!(["sleep", "3600"]), false)],
        },
    })
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

    // "Another node": its Node object, its pods' addresses in this node's namespace, and the
    // test's threads playing them.
    let remote = Remote::start(node)?;
    let sink = Player::start(&remote.netns(), PEER_IP, SINK_PORT, Role::Sink)?;
    let storage = Player::start(&remote.netns(), OTHER_IP, STORAGE_PORT, Role::Source)?;
    let host_sink = Player::start(&remote.netns(), OTHER_IP, HOSTNET_PORT, Role::Sink)?;
    let other = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": OTHER_NODE },
        "spec": { "unschedulable": true, "podCIDR": OTHER_POD_CIDR, "podCIDRs": [OTHER_POD_CIDR] },
        "status": { "addresses": [{ "type": "InternalIP", "address": OTHER_IP }] },
    });
    node.kubectl_stdin(&["create", "-f", "-"], Some(&other.to_string()))?;

    let ckpt = json!({ "training.kubeflow.org/job-name": "ckpt", "fabricgate-test/judge": "yes" });
    let mnet = json!({ "training.kubeflow.org/job-name": "mnet", "fabricgate-test/judge": "yes" });
    let hnet = json!({ "training.kubeflow.org/job-name": "hnet", "fabricgate-test/judge": "yes" });
    let mut hnet_pusher = hnet.clone();
    hnet_pusher["app"] = json!("hnet-0");
    let mut hnet_peer = remote_pod("hnet-1", hnet.clone());
    hnet_peer["spec"]["hostNetwork"] = json!(true);
    let objects = [
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NS } }),
        // Blocks any eviction of the Job's pod until relaxed below.
        json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": { "name": "llm", "namespace": NS },
            "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "llm" } } },
        }),
        // Keeps hnet-0 (on sockets, evict_after later) for the looks below.
        json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": { "name": "hnet-0", "namespace": NS },
            "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "hnet-0" } } },
        }),
        json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": { "name": "llm", "namespace": NS },
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": { "labels": { "app": "llm" } },
                    "spec": pod_spec(push_command(PEER_IP, SINK_PORT), true),
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
            "spec": pod_spec(push_command(PEER_IP, SINK_PORT), false),
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "listener", "namespace": NS, "labels": ckpt },
            "spec": pod_spec(listen_command(), false),
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "reader", "namespace": NS, "labels": ckpt },
            "spec": pod_spec(pull_command(OTHER_IP, STORAGE_PORT), false),
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "rank-0", "namespace": NS, "labels": mnet },
            // Multus attaches before the container starts; here the test attaches it once the
            // pod runs, so the pod waits for its net1 (a connect routed elsewhere first would
            // hang in SYN retries for minutes).
            "spec": pod_spec(push_command_on(SECONDARY_PEER, SINK_PORT, Some("net1")), false),
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "hnet-0", "namespace": NS, "labels": hnet_pusher },
            "spec": host_network_spec(push_command(OTHER_IP, HOSTNET_PORT)),
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "hnet-quiet", "namespace": NS, "labels": hnet },
            "spec": host_network_spec(json!(["sleep", "3600"])),
        }),
        hnet_peer,
        remote_pod("llm-peer", json!({ "batch.kubernetes.io/job-name": "llm" })),
        remote_pod("ckpt-1", ckpt.clone()),
        remote_pod(
            "intruder",
            json!({ "training.kubeflow.org/job-name": "other" }),
        ),
        remote_pod("rank-1", mnet.clone()),
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
    // What realnode-2's kubelet would write: the pods running at their addresses.
    for (name, ip) in [
        ("llm-peer", PEER_IP),
        ("ckpt-1", CKPT_PEER_IP),
        ("intruder", INTRUDER_IP),
        ("rank-1", MNET_PEER_IP),
        // On its node's network: its address is the Node's.
        ("hnet-1", OTHER_IP),
    ] {
        let status = json!({ "status": { "phase": "Running", "podIP": ip,
            "podIPs": [{ "ip": ip }], "hostIP": OTHER_IP, "hostIPs": [{ "ip": OTHER_IP }] } });
        node.kubectl(&[
            "patch",
            "pod",
            name,
            "-n",
            NS,
            "--subresource=status",
            "--type=merge",
            "-p",
            &status.to_string(),
        ])?;
    }
    let here = [
        "quiet",
        "web",
        "listener",
        "reader",
        "rank-0",
        "hnet-0",
        "hnet-quiet",
    ];
    wait_for(
        "the Job's pod, quiet, web, listener, reader, rank-0, hnet-0 and hnet-quiet running",
        Duration::from_secs(120),
        || {
            job_pod(node).is_some_and(|p| running(&p))
                && here
                    .iter()
                    .all(|n| pod(node, n).is_some_and(|p| running(&p)))
        },
    )?;
    let started = Instant::now();
    let trainer = job_pod(node).ok_or("no Job pod")?;
    let trainer_name = name_of(&trainer);
    let ip_of = |p: Option<Value>, what: &str| -> Result<IpAddr, String> {
        p.and_then(|p| p.pointer("/status/podIP")?.as_str()?.parse().ok())
            .ok_or(format!("{what} has no pod IP"))
    };
    let web_ip = ip_of(pod(node, "web"), "web")?;
    let trainer_ip = ip_of(Some(trainer.clone()), "the Job's pod")?;
    let listener_ip = ip_of(pod(node, "listener"), "listener")?;
    let reader_ip = ip_of(pod(node, "reader"), "reader")?;
    let intruder = Player::start(
        &remote.netns(),
        INTRUDER_IP,
        0,
        Role::Stream {
            to: std::net::SocketAddr::new(listener_ip, LISTEN_PORT),
        },
    )?;

    // rank-0's second interface, as Multus attaches one: the reference macvlan plugin's ADD
    // into its namespace, then the annotations Multus writes; its peer rank-1's attachment on
    // the same network lives in the remote namespace.
    let secondary = Secondary::attach(node, &remote, &pod(node, "rank-0").ok_or("no rank-0")?)?;
    let secondary_sink = Player::start(&remote.netns(), SECONDARY_PEER, SINK_PORT, Role::Sink)?;

    // sockets within the confirmation windows + one probe interval.
    let bound = WINDOW * CONFIRM + INTERVAL + SLACK;
    let took = wait_for("the Job's pod False/SocketsFallback", bound, || {
        pod(node, &trainer_name)
            .and_then(|p| transport_condition(&p))
            .is_some_and(|(s, r, _)| s == "False" && r == "SocketsFallback")
    })
    .map_err(|e| {
        format!(
            "{e}: condition {:?}, its peer got {} bytes from it\n{}",
            pod(node, &trainer_name).and_then(|p| transport_condition(&p)),
            sink.with(trainer_ip),
            agent_logs(node)
        )
    })?;
    println!(
        "figure: real pod pushing TCP to its Job's peer at an address outside every podCIDR -> fabricgate.io/TransportReady False/SocketsFallback {took:?} after it ran (window {WINDOW:?}, confirm_windows {CONFIRM}, interval {INTERVAL:?})"
    );
    let (_, _, message) = pod(node, &trainer_name)
        .and_then(|p| transport_condition(&p))
        .ok_or("the condition went away")?;
    println!("figure: condition message: {message}");
    for needle in ["0 data-path QPs", "over TCP with 1 peer", "via eth0"] {
        if !message.contains(needle) {
            let routes = pod(node, &trainer_name)
                .and_then(|p| container_pid(node, &p))
                .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/net/route")).ok());
            return Err(format!(
                "the condition's message does not say {needle:?}: {message}; the pod's routes: {routes:?}\n{}",
                agent_logs(node)
            ));
        }
    }

    // Bulk TCP with its job's peer over the secondary network: sockets, via net1. (No PDB
    // holds rank-0: the guard evicts it evict_after later, so it is looked at now.)
    let rank0 = wait_for("rank-0 False/SocketsFallback via net1", bound, || {
        pod(node, "rank-0")
            .and_then(|p| transport_condition(&p))
            .is_some_and(|(s, r, m)| {
                s == "False" && r == "SocketsFallback" && m.contains("via net1")
            })
    });
    if let Err(e) = rank0 {
        let rank0 = pod(node, "rank-0");
        let addr_in = |netns: String| {
            std::process::Command::new("nsenter")
                .arg(format!("--net={netns}"))
                .args(["--", "ip", "-d", "addr"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        let pod_net = rank0
            .as_ref()
            .and_then(|p| container_pid(node, p))
            .map(|pid| addr_in(format!("/proc/{pid}/ns/net")))
            .unwrap_or_default();
        return Err(format!(
            "{e}: rank-0 moved {} bytes to its peer's Multus address {SECONDARY_PEER}; its condition {:?}\nits addresses: {pod_net}\n{}",
            secondary_sink.with(SECONDARY_HERE.parse().map_err(|e| format!("{e}"))?),
            rank0.as_ref().and_then(transport_condition),
            agent_logs(node)
        ));
    }
    let message = pod(node, "rank-0")
        .and_then(|p| transport_condition(&p))
        .map(|(_, _, m)| m)
        .unwrap_or_default();
    println!(
        "figure: rank-0 pushing TCP to its peer over a macvlan secondary network (network-status {SECONDARY_PEER}) -> False/SocketsFallback: {message}"
    );

    // hostNetwork: bulk TCP from the node's own namespace to its job's peer, a host-network
    // pod on realnode-2 (its addresses its Node's): sockets.
    wait_for("hnet-0 False/SocketsFallback", bound, || {
        pod(node, "hnet-0")
            .and_then(|p| transport_condition(&p))
            .is_some_and(|(s, r, _)| s == "False" && r == "SocketsFallback")
    })
    .map_err(|e| {
        format!(
            "{e}: hnet-0 (hostNetwork) moved {} bytes to its peer's Node address {OTHER_IP}; its condition {:?}\n{}",
            host_sink.total(),
            pod(node, "hnet-0").and_then(|p| transport_condition(&p)),
            agent_logs(node)
        )
    })?;
    let message = pod(node, "hnet-0")
        .and_then(|p| transport_condition(&p))
        .map(|(_, _, m)| m)
        .unwrap_or_default();
    if !message.contains("with 1 peer") {
        return Err(format!(
            "hnet-0's condition does not name its one peer: {message}"
        ));
    }
    println!(
        "figure: hnet-0 (hostNetwork) pushing TCP to its peer's Node address -> False/SocketsFallback: {message}"
    );

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
    // More windows first than confirmation needs, so every other pod has had its chances.
    std::thread::sleep(WINDOW * (CONFIRM + 1));
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
    // hnet-quiet shares hnet-0's namespace (the node's) and its job, and moves nothing: its
    // TCP is its own processes' sockets, so hnet-0's stream is not its.
    let enough = TCP_MIN * WINDOW.as_secs() * u64::from(CONFIRM);
    let hnet_moved = host_sink.total();
    if hnet_moved < enough {
        return Err(format!(
            "hnet-0 moved only {hnet_moved} bytes: it would not show that hnet-quiet is told apart"
        ));
    }
    let (_, condition) = judged_not_sockets(
        node,
        &metrics,
        "hnet-quiet",
        &format!("hostNetwork beside hnet-0's {hnet_moved} bytes, moving nothing"),
    )?;
    println!(
        "figure: hnet-quiet (hostNetwork, same job and namespace as hnet-0, {hnet_moved} bytes moved beside it): condition {condition:?}"
    );
    // Bulk TCP with what is not the job: another job's pod streaming into the listener, the
    // storage server feeding the reader. Judged, shown, never sockets.
    for (name, moved) in [
        ("listener", intruder.total()),
        ("reader", storage.with(reader_ip)),
    ] {
        if moved < enough {
            return Err(format!(
                "only {moved} bytes moved with {name}: it would not show that TCP outside its job never decides"
            ));
        }
        let (lines, condition) = judged_not_sockets(
            node,
            &metrics,
            name,
            &format!("{moved} bytes with addresses outside its job"),
        )?;
        let other = lines
            .iter()
            .find(|l| l.starts_with("fabricgate_pod_other_tcp_bytes_total{"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if other < enough as f64 {
            return Err(format!(
                "{name}'s fabricgate_pod_other_tcp_bytes_total is {other}, {moved} bytes moved: {lines:?}"
            ));
        }
        println!(
            "figure: {name}: {moved} bytes with addresses outside its job, other_tcp_bytes {other}, condition {condition:?}"
        );
    }
    let web_bytes = sink.with(web_ip);
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
        "figure: the peer received {} bytes from the Job's pod, {web_bytes} from the unrelated pod (never judged)",
        sink.with(trainer_ip)
    );
    drop(intruder);
    drop(storage);

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
    drop(host_sink);
    drop(secondary_sink);
    drop(secondary);
    drop(remote);
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
