//! The per-pod sampler: one call lists the QPs of every pod and measures each pod's
//! TCP with other nodes since the previous call. Stateful (it keeps each pod's byte baseline),
//! never sleeps: the agent calls it once a `runtime.window`, `fabricgate check` twice
//! `--pods-window` apart.
//!
//! CONTRACT (the agent and `check` build on these names; the implementation behind them is
//! the probes' work): `PodSampler::new(roots)`, `PodSampler::sample(&mut self, &SampleRequest)`
//! → `Vec<PodTransportFacts>`, one per pod in the request that has a baseline from an earlier
//! call (a pod seen for the first time gets its baseline now and appears from the next call).
//!
//! One sample: the QP dump of every RDMA device (`restrack`), attributed to pods by the
//! owners' cgroups; every pod's processes (`procs`); per pod, the TCP sockets of its network
//! namespace (`tcp`, the namespace entered from a short-lived thread), or for a pod on the
//! host's network only the sockets its processes hold open; the bytes each socket moved since
//! the pod's baseline (`tcpi_bytes_acked + tcpi_bytes_received`; a socket new since then
//! counts whole), summed over the sockets whose remote end is one of the pod's peers
//! ([`RemoteScope`]); what went elsewhere off the node is summed apart (`other_bytes`).

use super::ports::{self, PortReading, PortTraffic};
use super::restrack::{self, QpEntry, QpOwner};
use super::tcp::{self, TcpSocket};
use super::{InternodeTcp, Observed, PodTransportFacts, QpAttribution, attribute, procs};
use crate::Roots;
use crate::error::{ProbeError, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::time::Instant;

/// Which remote addresses are a pod's peers: the ends whose TCP can decide `sockets`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteScope {
    /// Without a cluster (`fabricgate check` with no API server to ask): any address not on
    /// this node (not loopback, not one of the node's own addresses, not in one of this node's
    /// pods' networks).
    NotLocal,
    /// With the cluster: per pod UID, every address of the pods of its job on other nodes
    /// (`status.podIPs`, Multus's `network-status` IPs, a `hostNetwork` pod's Node addresses).
    /// A pod absent here has no peer: none of its TCP is inter-node traffic of its job.
    JobPeers(BTreeMap<String, BTreeSet<IpAddr>>),
}

/// Where one socket's remote end is, for one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    /// On this node (loopback, this node's or its pods' own addresses).
    Local,
    /// A peer: a pod of the same job on another node (or, without a cluster, any remote).
    Peer,
    /// Anything else off this node: object storage, a dataset server, a stranger.
    Other,
}

/// What to sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleRequest {
    /// The pods to sample by UID; `None`: every pod cgroup that holds QPs or moves TCP to a
    /// remote address (`fabricgate check` without a cluster).
    pub pod_uids: Option<BTreeSet<String>>,
    /// Pods that share the host's network namespace (`hostNetwork: true`): their own sockets
    /// are counted, not the namespace's.
    pub host_network: BTreeSet<String>,
    pub remote: RemoteScope,
}

/// What the agent needs and lacks, word for word in every `unknown` it causes.
pub const NO_HOST_PID: &str = "the agent is not in the host PID namespace, so it sees neither the \
     pods' processes nor their queue pairs; add hostPID: true (deploy/overlays/runtime-transport)";
/// Not a blind spot: without `ib_core` there is no RDMA device, so no process can hold a queue
/// pair; the pods' QPs are known to be none and their TCP still decides.
pub const NO_RDMA_NETLINK: &str = "the kernel has no RDMA netlink (NETLINK_RDMA: protocol not \
     supported): ib_core is not loaded, so no queue pair exists on this node";

/// The kernel's answers the sampler needs: the live kernel ([`LiveKernel`]), or recorded
/// replies in tests.
pub trait Kernel: std::fmt::Debug + Send {
    /// Every QP of every RDMA device.
    ///
    /// # Errors
    /// [`ProbeError::RdmaNetlinkUnavailable`] without RDMA netlink; others for bad replies.
    fn qps(&mut self) -> Result<Vec<QpEntry>>;

    /// The TCP sockets of the network namespace `ns` (`<procfs>/<pid>/ns/net` of a pod's
    /// process) that can carry TCP with another node (none to a loopback address), counting
    /// at most `max`; `None`: the agent's own namespace (the host's: the agent runs with
    /// `hostNetwork`).
    ///
    /// # Errors
    /// [`ProbeError::Netns`] when the namespace cannot be entered, `Read` with `NotFound`
    /// when its process exited, `Netlink` for bad replies or more than `max` sockets.
    fn tcp_sockets(&mut self, ns: Option<&Path>, max: usize) -> Result<Vec<TcpSocket>>;
}

/// The running kernel, through the probes' netlink socket.
#[derive(Debug, Default)]
pub struct LiveKernel;

impl Kernel for LiveKernel {
    fn qps(&mut self) -> Result<Vec<QpEntry>> {
        restrack::read_live_qps()
    }

    fn tcp_sockets(&mut self, ns: Option<&Path>, max: usize) -> Result<Vec<TcpSocket>> {
        let mut socket = match ns {
            None => tcp::open().map_err(|e| ProbeError::Netlink {
                request: "sock_diag socket",
                message: e.to_string(),
            })?,
            Some(path) => tcp::open_in_netns(path).map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => ProbeError::read(path, e),
                _ => ProbeError::Netns {
                    path: path.to_owned(),
                    source: e,
                },
            })?,
        };
        tcp::read_sockets_bounded(&mut socket, max)
    }
}

/// The sampler and its baselines.
#[derive(Debug)]
pub struct PodSampler {
    roots: Roots,
    kernel: Box<dyn Kernel>,
    baselines: HashMap<String, Baseline>,
    notes: Vec<String>,
    /// Sockets counted per namespace at most (`runtime.max_sockets_per_pod`).
    max_sockets: usize,
    /// The last reading of each port that data-path QPs were on.
    port_readings: HashMap<(String, u32), PortReading>,
}

/// Who holds data-path QPs on each port: pods by UID, and anyone else for a person.
type PortUsers = BTreeMap<(String, u32), (BTreeSet<String>, BTreeSet<String>)>;

/// A pod's counters at its last sample: per socket (namespace, cookie), its bytes; `None`
/// when its sockets could not be read then.
#[derive(Debug)]
struct Baseline {
    at: Instant,
    sockets: Option<HashMap<(u64, u64), u64>>,
}

/// One pod's sockets in one sample, and the routes of their namespace.
#[derive(Debug)]
struct PodSockets {
    netns: u64,
    sockets: Vec<TcpSocket>,
    routes: Vec<procs::Route>,
}

impl PodSampler {
    /// The sampler of the running kernel.
    pub fn new(roots: Roots) -> Self {
        Self::with_kernel(roots, Box::new(LiveKernel))
    }

    /// A sampler of another [`Kernel`] (recorded replies in tests).
    pub fn with_kernel(roots: Roots, kernel: Box<dyn Kernel>) -> Self {
        Self {
            roots,
            kernel,
            baselines: HashMap::new(),
            notes: Vec::new(),
            max_sockets: tcp::DEFAULT_MAX_SOCKETS,
            port_readings: HashMap::new(),
        }
    }

    /// Count at most `max` TCP sockets per network namespace (`runtime.max_sockets_per_pod`):
    /// a pod past it is `unknown` for the window, with a reason that names `max`, and the
    /// others go on being judged.
    #[must_use]
    pub fn with_max_sockets(mut self, max: usize) -> Self {
        self.max_sockets = max.max(1);
        self
    }

    pub fn roots(&self) -> &Roots {
        &self.roots
    }

    /// What the last sample could not see for every pod alike, for a person ("the kernel
    /// has no RDMA netlink ...", "a kubepods cgroup of a shape not known: ...").
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// How many pods have a baseline now: the pods the next sample can report. 0 after a
    /// first sample tells `fabricgate check` there is no window worth waiting for.
    pub fn pods_tracked(&self) -> usize {
        self.baselines.len()
    }

    /// One sample of the pods of `request`.
    pub fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts> {
        self.sample_at(request, Instant::now())
    }

    /// [`Self::sample`] at a given instant (the window is the time between two samples).
    pub fn sample_at(&mut self, request: &SampleRequest, now: Instant) -> Vec<PodTransportFacts> {
        self.notes.clear();
        if !procs::in_host_pid_namespace(&self.roots) {
            return self.blind(request, now);
        }
        let (mut qps, qp_unseen, users) = self.pod_qps();
        let port_traffic = self.port_traffic(&users, now);
        let (processes, unrecognized) = procs::pod_processes(&self.roots);
        self.notes.extend(unrecognized.into_iter().map(|path| {
            format!("a kubepods cgroup of a shape not known: {path} (its processes are not attributed to a pod)")
        }));
        let uids: BTreeSet<String> = match &request.pod_uids {
            Some(uids) => uids.clone(),
            None => processes.keys().chain(qps.keys()).cloned().collect(),
        };
        let host_ns = procs::netns_id(&self.roots, "self").ok();
        let mut local = BTreeSet::new();
        procs::local_addresses(&self.roots, "self", &mut local);
        let mut dumps = HashMap::new();
        let views: Vec<(String, std::result::Result<PodSockets, String>)> = uids
            .iter()
            .map(|uid| {
                let pids = processes.get(uid).map_or(&[][..], Vec::as_slice);
                let host = request.host_network.contains(uid);
                let view = self.pod_sockets(pids, host, host_ns, &mut dumps, &mut local);
                (uid.clone(), view)
            })
            .collect();
        self.baselines.retain(|uid, _| uids.contains(uid));
        let mut out = Vec::new();
        for (uid, view) in views {
            // A pod whose processes have not started yet (seen by the agent's watch before
            // its sandbox runs) has nothing to measure: not seen yet, rather than a baseline
            // that would make its first window `unknown`.
            if !processes.contains_key(&uid) && !self.baselines.contains_key(&uid) {
                continue;
            }
            let Some(internode_tcp) = self.measure(&uid, view, &request.remote, &local, now) else {
                continue;
            };
            let qps = match &qp_unseen {
                Some(reason) => Observed::Unseen {
                    reason: reason.clone(),
                },
                None => Observed::Seen(qps.remove(&uid).unwrap_or_default()),
            };
            let ports = match &qps {
                Observed::Seen(list) => list
                    .iter()
                    .filter(|qp| qp.is_data_path())
                    .filter_map(|qp| Some((qp.device.clone(), qp.port?)))
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .filter_map(|key| port_traffic.get(&key).cloned())
                    .collect(),
                Observed::Unseen { .. } => Vec::new(),
            };
            let moves = matches!(&internode_tcp, Observed::Seen(t) if t.bytes > 0)
                || matches!(&internode_tcp, Observed::Unseen { .. });
            let holds = matches!(&qps, Observed::Seen(q) if !q.is_empty());
            if request.pod_uids.is_some() || moves || holds {
                out.push(PodTransportFacts {
                    pod_uid: uid,
                    qps,
                    internode_tcp,
                    ports,
                });
            }
        }
        out
    }

    /// Without the host PID namespace: every requested pod unknown, and a note.
    fn blind(&mut self, request: &SampleRequest, now: Instant) -> Vec<PodTransportFacts> {
        self.notes.push(NO_HOST_PID.to_owned());
        let Some(uids) = &request.pod_uids else {
            self.baselines.clear();
            return Vec::new();
        };
        self.baselines.retain(|uid, _| uids.contains(uid));
        fn unseen<T>() -> Observed<T> {
            Observed::Unseen {
                reason: NO_HOST_PID.to_owned(),
            }
        }
        uids.iter()
            .filter(|uid| {
                let first = !self.baselines.contains_key(*uid);
                self.baselines.insert(
                    (*uid).clone(),
                    Baseline {
                        at: now,
                        sockets: None,
                    },
                );
                !first
            })
            .map(|uid| PodTransportFacts {
                pod_uid: uid.clone(),
                qps: unseen(),
                internode_tcp: unseen(),
                ports: Vec::new(),
            })
            .collect()
    }

    /// Every QP attributed to its pod, or why none could be listed, and who holds data-path
    /// QPs on each port where a pod holds one (a port only the kernel or host processes use is
    /// left out: it is never read). A kernel without RDMA netlink has none to list: every pod
    /// holds none (a note says why).
    fn pod_qps(&mut self) -> (BTreeMap<String, Vec<QpEntry>>, Option<String>, PortUsers) {
        let mut users = PortUsers::new();
        let list = match self.kernel.qps() {
            Ok(list) => list,
            Err(ProbeError::RdmaNetlinkUnavailable { .. }) => {
                self.notes.push(NO_RDMA_NETLINK.to_owned());
                return (BTreeMap::new(), None, users);
            }
            Err(other) => {
                let reason = format!("the RDMA resource dump failed: {other}");
                self.notes.push(reason.clone());
                return (BTreeMap::new(), Some(reason), users);
            }
        };
        let mut by_pod: BTreeMap<String, Vec<QpEntry>> = BTreeMap::new();
        let mut hidden = 0usize;
        for qp in attribute(&self.roots, list) {
            let port = qp
                .qp
                .port
                .filter(|_| qp.qp.is_data_path())
                .map(|p| users.entry((qp.qp.device.clone(), p)).or_default());
            let pid = match qp.qp.owner {
                QpOwner::Pid(pid) => pid.to_string(),
                _ => "?".to_owned(),
            };
            let other = match qp.owner {
                QpAttribution::Pod(pod) => {
                    if let Some((pods, _)) = port {
                        pods.insert(pod.pod_uid.clone());
                    }
                    by_pod.entry(pod.pod_uid).or_default().push(qp.qp);
                    continue;
                }
                QpAttribution::Hidden => {
                    hidden += 1;
                    "a process in another PID namespace".to_owned()
                }
                QpAttribution::Unrecognized { path } => {
                    self.notes.push(format!(
                        "a QP of {} is owned by a process in a kubepods cgroup of a shape not known: {path}",
                        qp.qp.device
                    ));
                    format!("pid {pid} ({path})")
                }
                QpAttribution::Kernel { name } => format!("kernel {name}"),
                QpAttribution::Host => format!("host pid {pid}"),
                QpAttribution::ProcessGone => continue,
                QpAttribution::Unreadable { .. } => format!("pid {pid}"),
            };
            if let Some((_, others)) = port {
                others.insert(other);
            }
        }
        if hidden > 0 {
            self.notes.push(format!(
                "{hidden} QP(s) without a visible owner (a PID namespace the agent is not an ancestor of)"
            ));
        }
        users.retain(|_, (pods, _)| !pods.is_empty());
        (by_pod, None, users)
    }

    /// What each port of `users` (those with a pod's data-path QPs: on mlx5 each read is a
    /// firmware command) carried since its last reading (none the first time: the reading is
    /// the baseline), and who holds QPs there.
    fn port_traffic(
        &mut self,
        users: &PortUsers,
        now: Instant,
    ) -> BTreeMap<(String, u32), PortTraffic> {
        self.port_readings.retain(|key, _| users.contains_key(key));
        let ipoib = if users.is_empty() {
            Vec::new()
        } else {
            ports::ipoib_netdevs_of_node(&self.roots)
        };
        users
            .iter()
            .map(|((device, port), (pods, others))| {
                let reading = ports::read_port(&self.roots, device, *port, &ipoib, now);
                let previous = self
                    .port_readings
                    .insert((device.clone(), *port), reading.clone());
                let mut traffic = PortTraffic {
                    device: device.clone(),
                    port: *port,
                    link_layer: reading.link_layer.clone(),
                    counter: reading.counter.clone(),
                    transmit_bytes: None,
                    receive_bytes: None,
                    subtracted: Vec::new(),
                    window: Default::default(),
                    pods: pods.iter().cloned().collect(),
                    others: others.iter().cloned().collect(),
                    unseen: None,
                };
                match previous {
                    None => {
                        traffic.unseen = Some(
                            "first reading of the port's counters: a figure from the next window"
                                .into(),
                        );
                    }
                    Some(before) => {
                        traffic.window = reading.at.saturating_duration_since(before.at);
                        match ports::between(&before, &reading) {
                            Ok((tx, rx, subtracted)) => {
                                traffic.transmit_bytes = Some(tx);
                                traffic.receive_bytes = Some(rx);
                                traffic.subtracted = subtracted;
                            }
                            Err(why) => traffic.unseen = Some(why),
                        }
                    }
                }
                ((device.clone(), *port), traffic)
            })
            .collect()
    }

    /// The sockets of a pod with processes `pids`: its namespace's, or on the host's network
    /// (`host`, or found sharing the agent's namespace) those its processes hold open. The
    /// `Err` is the reason for a person.
    fn pod_sockets(
        &mut self,
        pids: &[u32],
        host: bool,
        host_ns: Option<u64>,
        dumps: &mut HashMap<u64, std::result::Result<Vec<TcpSocket>, String>>,
        local: &mut BTreeSet<IpAddr>,
    ) -> std::result::Result<PodSockets, String> {
        if pids.is_empty() {
            return Err(format!(
                "no process of the pod runs on this node now (none in {}/<pid>/cgroup)",
                self.roots.procfs_root().display()
            ));
        }
        let mut denied = None;
        let found = pids.iter().find_map(|pid| {
            match procs::netns_id(&self.roots, &pid.to_string()) {
                Ok(id) => Some((*pid, id)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => {
                    denied.get_or_insert_with(|| {
                        let path = procs::netns_path(&self.roots, &pid.to_string());
                        format!("cannot look at {}: {e}; needs CAP_SYS_PTRACE (deploy/overlays/runtime-transport)", path.display())
                    });
                    None
                }
            }
        });
        let Some((pid, netns)) = found else {
            return Err(
                denied.unwrap_or_else(|| "the pod's processes exited during the sample".into())
            );
        };
        let host = host || Some(netns) == host_ns;
        let pid_dir = pid.to_string();
        let kernel = &mut self.kernel;
        let max_sockets = self.max_sockets;
        let dump = dumps.entry(netns).or_insert_with(|| {
            let ns = procs::netns_path(&self.roots, &pid_dir);
            kernel
                .tcp_sockets((!host).then_some(ns.as_path()), max_sockets)
                .map_err(|e| format!("its sockets cannot be listed: {e}"))
        });
        let all = dump.as_ref().map_err(Clone::clone)?;
        let sockets = if host {
            let mut inodes = BTreeSet::new();
            for pid in pids {
                procs::socket_inodes(&self.roots, *pid, &mut inodes);
            }
            all.iter()
                .filter(|s| inodes.contains(&s.inode))
                .cloned()
                .collect()
        } else {
            // The namespace's own addresses are its sockets' local ends (a connection to its
            // own address has both ends here): no need to read its address table.
            local.extend(
                all.iter()
                    .map(|s| s.local.ip())
                    .filter(|ip| !ip.is_loopback() && !ip.is_unspecified()),
            );
            all.clone()
        };
        // The routes from the first of the pod's processes still there to read them: a pod's
        // short-lived processes (a `head` in a loop) come and go between the listing and here.
        let routes = if host {
            procs::routes(&self.roots, "self")
        } else {
            std::iter::once(pid)
                .chain(pids.iter().copied().filter(|p| *p != pid))
                .map(|p| procs::routes(&self.roots, &p.to_string()))
                .find(|r| !r.is_empty())
                .unwrap_or_default()
        };
        Ok(PodSockets {
            netns,
            sockets,
            routes,
        })
    }

    /// The pod's TCP with remote ends in `scope` since its baseline, which it then replaces;
    /// `None` the first time (the baseline only).
    fn measure(
        &mut self,
        uid: &str,
        view: std::result::Result<PodSockets, String>,
        scope: &RemoteScope,
        local: &BTreeSet<IpAddr>,
        now: Instant,
    ) -> Option<Observed<InternodeTcp>> {
        let current = view.as_ref().ok().map(|v| {
            v.sockets
                .iter()
                .filter_map(|s| Some(((v.netns, s.cookie), s.bytes()?)))
                .collect::<HashMap<_, _>>()
        });
        let previous = self.baselines.insert(
            uid.to_owned(),
            Baseline {
                at: now,
                sockets: current,
            },
        )?;
        let view = match view {
            Ok(view) => view,
            Err(reason) => return Some(Observed::Unseen { reason }),
        };
        let Some(before) = previous.sockets else {
            return Some(Observed::Unseen {
                reason: "its sockets were not readable at the previous sample; measured from now"
                    .into(),
            });
        };
        let mut tcp = InternodeTcp {
            window: now.saturating_duration_since(previous.at),
            ..InternodeTcp::default()
        };
        let (mut peers, mut interfaces) = (BTreeSet::new(), BTreeSet::new());
        for socket in &view.sockets {
            let remote = socket.remote.ip();
            let Some(total) = socket.bytes() else {
                continue;
            };
            let kind = scope.classify(uid, remote, local);
            if kind == RemoteKind::Local {
                continue;
            }
            let moved = before
                .get(&(view.netns, socket.cookie))
                .map_or(total, |b| total.saturating_sub(*b));
            if moved == 0 {
                continue;
            }
            if kind == RemoteKind::Other {
                tcp.other_bytes = tcp.other_bytes.saturating_add(moved);
                continue;
            }
            tcp.bytes = tcp.bytes.saturating_add(moved);
            peers.insert(remote);
            interfaces.extend(procs::interface_for(&view.routes, remote).map(str::to_owned));
        }
        tcp.peers = peers.into_iter().collect();
        tcp.interfaces = interfaces.into_iter().collect();
        Some(Observed::Seen(tcp))
    }
}

impl RemoteScope {
    /// Where `remote` is for the pod `uid`, `local` being the addresses of this node's own
    /// namespaces (the host's and the pods' seen in this sample).
    pub fn classify(&self, uid: &str, remote: IpAddr, local: &BTreeSet<IpAddr>) -> RemoteKind {
        if remote.is_loopback() || remote.is_unspecified() || local.contains(&remote) {
            return RemoteKind::Local;
        }
        match self {
            Self::NotLocal => RemoteKind::Peer,
            Self::JobPeers(peers) if peers.get(uid).is_some_and(|p| p.contains(&remote)) => {
                RemoteKind::Peer
            }
            Self::JobPeers(_) => RemoteKind::Other,
        }
    }
}

#[cfg(test)]
mod tests;
