//! The `pods` section of `fabricgate check` (docs/runtime-transport.md): without a
//! cluster, every pod cgroup on this node whose processes hold RDMA queue pairs or move TCP to
//! a non-local address, sampled twice `--pods-window` apart and judged by
//! `transport::verdict::judge_pod` with the config's `runtime:` settings. Beside it, what the
//! node's byte heuristic (`observe::fallback`) says over the same window.
//!
//! With it, the RDMA devices a pod's own network namespace holds that the node's probe does not
//! list (RDMA netns mode `exclusive`: an HCA a DRA driver moved into the pod), looked at from
//! inside that namespace (`fabricgate_probes::transport::pod_hcas`), each port with its state.
//!
//! The section never changes `check`'s exit code: what it cannot see (no host PID namespace,
//! no RDMA netlink) is an `unknown` pod or a note, with the why.

use super::check_peers::ClusterPeers;
use crate::config::{Config, FallbackSettings};
use crate::observe::fallback::{FallbackDetector, FallbackStatus};
use crate::transport::bandwidth::{JobId, PortShare, job_ports, port_shares};
use crate::transport::settings::RuntimeSettings;
use crate::transport::verdict::{PodVerdict, human_bytes, judge_pod};
use fabricgate_probes::transport::pod_hcas::{self, LiveNamespaces, NamespaceRdma, PodHcas};
use fabricgate_probes::transport::restrack::{NetlinkPort, QpEntry, QpOwner};
use fabricgate_probes::transport::sample::{NO_HOST_PID, PodSampler, SampleRequest};
use fabricgate_probes::transport::{Observed, PodTransportFacts, procs};
use fabricgate_probes::{ProbeReport, Roots};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// One pod: what was seen and the verdict on it.
#[derive(Debug, Clone)]
pub struct PodLine {
    pub facts: PodTransportFacts,
    pub verdict: PodVerdict,
}

/// The node heuristic's answer over the pods' window, and why, for a person.
#[derive(Debug, Clone)]
pub struct NodeFallback {
    pub status: FallbackStatus,
    pub why: String,
}

/// What `check` prints in its `pods` section.
#[derive(Debug, Clone, Default)]
pub struct PodsSection {
    /// Sorted by pod UID.
    pub pods: Vec<PodLine>,
    /// What the sample could not see for every pod alike.
    pub notes: Vec<String>,
    /// The time between the two samples; `None` when no pod process was found, so nothing was
    /// worth waiting for.
    pub window: Option<Duration>,
    pub node_fallback: Option<NodeFallback>,
    /// Pods whose own network namespace holds RDMA devices the node's probe does not list, or
    /// could not be looked into; sorted by pod UID.
    pub namespace_hcas: Vec<PodHcas>,
    /// How the pods' peers were found (the cluster's jobs, or why any non-local address).
    pub peers_note: String,
    /// Pod UID → (namespace, name), where the cluster was asked.
    pub names: BTreeMap<String, (String, String)>,
    /// Every port the pods' data-path QPs are on: what it carried over the window, and whose.
    pub ports: Vec<PortShare>,
}

/// Sample every pod of the node (sample, wait `window`, sample) and judge each one. `first`
/// is the node's probe report taken just before; `probe_again` takes the one after the window,
/// for the node heuristic.
pub fn sample(
    sampler: &mut PodSampler,
    config: &Config,
    settings: &RuntimeSettings,
    window: Duration,
    peers: ClusterPeers,
    first: &ProbeReport,
    probe_again: impl FnOnce() -> ProbeReport,
) -> PodsSection {
    let request = SampleRequest {
        pod_uids: None,
        host_network: BTreeSet::new(),
        remote: peers.scope,
    };
    // The first sample only takes each pod's baseline.
    let _ = sampler.sample(&request);
    if sampler.pods_tracked() == 0 {
        let notes = sampler.notes().to_vec();
        let pods = if notes.iter().any(|n| n == NO_HOST_PID) {
            blind_pods(sampler.roots(), config, settings)
        } else {
            Vec::new()
        };
        return PodsSection {
            pods,
            notes,
            window: None,
            node_fallback: None,
            namespace_hcas: Vec::new(),
            peers_note: peers.note,
            names: peers.names,
            ports: Vec::new(),
        };
    }
    // A person at a terminal waits the window out: say so (on stderr, the output stays clean).
    eprintln!(
        "pods: first sample of {} pod(s) taken; the second in {} (--pods-window)",
        sampler.pods_tracked(),
        humantime::format_duration(window)
    );
    let start = Instant::now();
    std::thread::sleep(window);
    let facts = sampler.sample(&request);
    let waited = start.elapsed();
    let second = probe_again();
    let namespace_hcas = namespace_hcas(sampler.roots(), &second, &mut LiveNamespaces);
    let job_of = |uid: &str| {
        Some(peers.jobs.get(uid).cloned().unwrap_or_else(|| JobId {
            namespace: String::new(),
            job: format!("Pod/{uid}"),
        }))
    };
    let ports = port_shares(&facts, job_of);
    PodsSection {
        pods: facts
            .into_iter()
            .map(|f| {
                let job = job_of(&f.pod_uid);
                judge(f, config, settings, &ports, job.as_ref())
            })
            .collect(),
        ports,
        notes: sampler.notes().to_vec(),
        window: Some(waited),
        node_fallback: Some(node_fallback(config, window, first, &second)),
        namespace_hcas,
        peers_note: peers.note,
        names: peers.names,
    }
}

/// Every pod with a network namespace of its own, looked into: the ports of the RDMA devices
/// there that `report` (the node's probe) does not list — in shared mode every namespace
/// lists the node's devices, which say nothing new — and the pods that could not be entered.
pub fn namespace_hcas(
    roots: &Roots,
    report: &ProbeReport,
    rdma: &mut dyn NamespaceRdma,
) -> Vec<PodHcas> {
    let (processes, _) = procs::pod_processes(roots);
    let wanted: BTreeSet<String> = processes.keys().cloned().collect();
    let node: BTreeSet<&str> = report
        .rdma
        .devices
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    pod_hcas::look(roots, &processes, &wanted, rdma)
        .into_iter()
        .filter_map(|mut pod| {
            match &mut pod.ports {
                Observed::Seen(ports) => {
                    ports.retain(|p| !node.contains(p.device.as_str()));
                    if ports.is_empty() {
                        return None;
                    }
                }
                Observed::Unseen { reason } => {
                    if reason == pod_hcas::SHARES_AGENT_NETNS || reason == pod_hcas::NO_PROCESS {
                        return None;
                    }
                }
            }
            Some(pod)
        })
        .collect()
}

fn judge(
    facts: PodTransportFacts,
    config: &Config,
    settings: &RuntimeSettings,
    shares: &[PortShare],
    job: Option<&JobId>,
) -> PodLine {
    let matcher = config.device_matcher();
    let in_scope = |device: &str, _| matcher.is_match(device);
    let ports = job_ports(&facts, shares, job, in_scope);
    let verdict = judge_pod(&facts, settings, in_scope, ports.as_ref());
    PodLine { facts, verdict }
}

/// Without the host PID namespace no process (and so no QP or socket) of a pod is visible,
/// but the pods' cgroups are: each is listed as `unknown`, with what to add.
fn blind_pods(roots: &Roots, config: &Config, settings: &RuntimeSettings) -> Vec<PodLine> {
    fn unseen<T>() -> Observed<T> {
        Observed::Unseen {
            reason: NO_HOST_PID.to_owned(),
        }
    }
    procs::pod_cgroups(roots)
        .into_iter()
        .map(|pod_uid| {
            let facts = PodTransportFacts {
                pod_uid,
                qps: unseen(),
                internode_tcp: unseen(),
                ports: Vec::new(),
            };
            judge(facts, config, settings, &[], None)
        })
        .collect()
}

/// What `observe::fallback` concludes from the two node reports, its window set to the pods'
/// (its thresholds as configured).
fn node_fallback(
    config: &Config,
    window: Duration,
    first: &ProbeReport,
    second: &ProbeReport,
) -> NodeFallback {
    let mut short = config.clone();
    short.fallback.window = window.max(Duration::from_secs(1));
    let mut detector = FallbackDetector::new(&short);
    detector.observe(first);
    let status = detector.observe(second);
    NodeFallback {
        why: fallback_why(&status, &config.fallback),
        status,
    }
}

/// The heuristic's answer in words: which of its two rates decided it.
pub fn fallback_why(status: &FallbackStatus, settings: &FallbackSettings) -> String {
    let rate = |r: f64| format!("{}/s", human_bytes(r.max(0.0) as u64));
    let tcp_min = rate(settings.tcp_min_bytes_per_second as f64);
    let rdma_max = rate(settings.rdma_max_bytes_per_second as f64);
    if !settings.enabled {
        return "off (fallback.enabled: false)".to_owned();
    }
    match (status.tcp_bytes_per_second, status.rdma_bytes_per_second) {
        (Some(tcp), Some(rdma)) if status.suspected => format!(
            "suspected: TCP {} on the node's netdevs while the RDMA ports moved {}",
            rate(tcp),
            rate(rdma)
        ),
        (None, _) => "says nothing: no netdev byte counter could be read".to_owned(),
        (Some(tcp), None) => format!(
            "says nothing: the RDMA ports in scope have no byte counters (port_xmit_data, \
             port_rcv_data); TCP {}",
            rate(tcp)
        ),
        (Some(tcp), Some(rdma)) if rdma > settings.rdma_max_bytes_per_second as f64 => format!(
            "not suspected: the RDMA ports are not idle ({} > fallback.rdma_max_bytes_per_second \
             {rdma_max}); TCP {}",
            rate(rdma),
            rate(tcp)
        ),
        (Some(tcp), Some(rdma)) => format!(
            "not suspected: TCP {} is below fallback.tcp_min_bytes_per_second {tcp_min}; RDMA {}",
            rate(tcp),
            rate(rdma)
        ),
    }
}

/// A QP as `check` prints it: the names `rdma res show qp` uses for type and state.
fn qp_json(qp: &QpEntry) -> Value {
    json!({
        "device": qp.device,
        "port": qp.port,
        "type": upper(&qp.qp_type),
        "state": upper(&qp.state),
        "lqpn": qp.lqpn,
        "rqpn": qp.rqpn,
        "pid": match qp.owner {
            QpOwner::Pid(pid) => Some(pid),
            _ => None,
        },
    })
}

/// A port as `check` prints it: the kernel's names for its states (`rdma link show`).
fn port_json(port: &NetlinkPort) -> Value {
    json!({
        "device": port.device,
        "port": port.port,
        "state": port.state.map(|s| s.name()),
        "physical_state": port.physical_state.map(|s| s.name()),
        "netdev": port.netdev,
    })
}

fn upper(value: &impl std::fmt::Debug) -> String {
    format!("{value:?}").to_uppercase()
}

/// Add `pods` (one object per pod) and `pods_sample` (the window, the notes and the node
/// heuristic) to `check`'s JSON document.
pub fn insert_json(doc: &mut Value, section: &PodsSection) {
    let Value::Object(map) = doc else {
        return;
    };
    let pods: Vec<Value> = section
        .pods
        .iter()
        .map(|p| {
            // Without a cluster the pod's name is not known.
            let (namespace, name) = section
                .names
                .get(&p.facts.pod_uid)
                .map_or(("", ""), |(n, p)| (n.as_str(), p.as_str()));
            json!({
                "uid": p.facts.pod_uid,
                "namespace": namespace,
                "name": name,
                "transport": p.verdict.transport,
                "qps": match &p.facts.qps {
                    Observed::Seen(qps) => Value::Array(qps.iter().map(qp_json).collect()),
                    Observed::Unseen { .. } => Value::Null,
                },
                "reason": p.verdict.reason,
                "internode_tcp_bytes": p.verdict.internode_tcp_bytes,
                "other_tcp_bytes": p.verdict.other_tcp_bytes,
                "rdma_bytes": p.verdict.rdma_bytes,
                "rdma_ports": p.facts.ports.iter()
                    .map(|t| format!("{}/{}", t.device, t.port))
                    .collect::<Vec<_>>(),
                "why": p.verdict.why,
            })
        })
        .collect();
    map.insert("pods".into(), Value::Array(pods));
    let node_fallback = section.node_fallback.as_ref().map(|f| {
        json!({
            "suspected": f.status.suspected,
            "tcp_bytes_per_second": f.status.tcp_bytes_per_second,
            "rdma_bytes_per_second": f.status.rdma_bytes_per_second,
            "why": f.why,
        })
    });
    let in_namespaces: Vec<Value> = section
        .namespace_hcas
        .iter()
        .map(|p| {
            let (ports, why) = match &p.ports {
                Observed::Seen(ports) => (
                    Value::Array(ports.iter().map(port_json).collect()),
                    Value::Null,
                ),
                Observed::Unseen { reason } => (Value::Null, Value::String(reason.clone())),
            };
            json!({"uid": p.pod_uid, "pid": p.pid, "ports": ports, "why": why})
        })
        .collect();
    map.insert("pod_namespace_rdma".into(), Value::Array(in_namespaces));
    map.insert(
        "pods_sample".into(),
        json!({
            "window_seconds": section.window.map(|w| w.as_secs_f64()),
            "notes": section.notes,
            "peers": section.peers_note,
            "node_fallback": node_fallback,
            "ports": section.ports,
        }),
    );
}

const HEADER: [&str; 5] = ["POD UID", "TRANSPORT", "QPS", "INTER-NODE TCP", "WHY"];

/// The section as `check`'s table prints it, after the node's.
pub fn to_table(section: &PodsSection) -> String {
    let mut out = String::from("\nPods:");
    if let Some(w) = section.window {
        let _ = write!(out, " sampled over {:.1} s", w.as_secs_f64());
    }
    out.push('\n');
    if section.pods.is_empty() {
        out.push_str("  (no pod cgroup holds queue pairs or moves TCP to a non-local address)\n");
    }
    let rows: Vec<Vec<String>> = section
        .pods
        .iter()
        .map(|p| {
            vec![
                p.facts.pod_uid.clone(),
                p.verdict.transport.to_string(),
                qps_cell(&p.facts.qps),
                p.verdict
                    .internode_tcp_bytes
                    .map_or_else(|| "?".to_owned(), human_bytes),
                p.verdict.why.clone(),
            ]
        })
        .collect();
    if !rows.is_empty() {
        crate::text::write_columns(&mut out, &HEADER, rows);
    }
    for note in &section.notes {
        let _ = writeln!(out, "  ! {note}");
    }
    if !section.peers_note.is_empty() {
        let _ = writeln!(out, "  peers: {}", section.peers_note);
    }
    if let Some(f) = &section.node_fallback {
        let _ = writeln!(
            out,
            "  node heuristic (fallback) over the same window: {}",
            f.why
        );
    }
    if !section.ports.is_empty() {
        out.push_str("\nRDMA ports of the pods' data-path queue pairs, over the same window:\n");
        let rows: Vec<Vec<String>> = section.ports.iter().map(port_row).collect();
        crate::text::write_columns(&mut out, &PORTS_HEADER, rows);
    }
    if !section.namespace_hcas.is_empty() {
        out.push_str(
            "\nRDMA devices in pods' own network namespaces (not in the node's; in use by the pod):\n",
        );
        let rows: Vec<Vec<String>> = section
            .namespace_hcas
            .iter()
            .flat_map(|p| {
                let pid = p.pid.map_or_else(|| "?".to_owned(), |pid| pid.to_string());
                match &p.ports {
                    Observed::Seen(ports) => ports
                        .iter()
                        .map(|port| {
                            vec![
                                p.pod_uid.clone(),
                                pid.clone(),
                                format!("{}/{}", port.device, port.port),
                                port.state.map_or_else(|| "?".to_owned(), |s| s.name()),
                                port.physical_state
                                    .map_or_else(|| "?".to_owned(), |s| s.name()),
                                port.netdev.clone().unwrap_or_default(),
                            ]
                        })
                        .collect::<Vec<_>>(),
                    Observed::Unseen { reason } => vec![vec![
                        p.pod_uid.clone(),
                        pid,
                        "?".to_owned(),
                        reason.clone(),
                        String::new(),
                        String::new(),
                    ]],
                }
            })
            .collect();
        crate::text::write_columns(&mut out, &NAMESPACE_HEADER, rows);
    }
    out
}

const PORTS_HEADER: [&str; 5] = ["PORT", "SENT", "RECEIVED", "WHOSE", "COUNTED FROM"];

/// One port: its bytes each way, whose it is (one job, or every holder of a shared port).
fn port_row(share: &PortShare) -> Vec<String> {
    let bytes = |b: Option<u64>| b.map_or_else(|| "?".to_owned(), human_bytes);
    let mut holders: Vec<String> = share.jobs.iter().map(|j| j.job.clone()).collect();
    holders.extend(share.others.iter().cloned());
    let whose = match share.owner() {
        Some(job) => job.job.clone(),
        None => format!("shared: {}", holders.join(", ")),
    };
    let counted = match &share.unseen {
        Some(why) => format!("{}: {why}", share.counter.describe()),
        None => share.counter.describe(),
    };
    vec![
        share.name(),
        bytes(share.transmit_bytes),
        bytes(share.receive_bytes),
        whose,
        counted,
    ]
}

const NAMESPACE_HEADER: [&str; 6] = ["POD UID", "PID", "PORT", "STATE", "PHYS", "NETDEV"];

/// `2 RC, 1 UD`; `0`; `?` when the QPs could not be listed.
fn qps_cell(qps: &Observed<Vec<QpEntry>>) -> String {
    let Observed::Seen(qps) = qps else {
        return "?".to_owned();
    };
    if qps.is_empty() {
        return "0".to_owned();
    }
    let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
    for qp in qps {
        *by_type.entry(upper(&qp.qp_type)).or_default() += 1;
    }
    by_type
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests;
