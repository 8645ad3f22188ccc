//! The verdict per pod at run time: is a training pod on RDMA or on sockets? Pure:
//! the facts one sampling window saw (`probes::transport::PodTransportFacts`) and `runtime:` in,
//! a [`PodVerdict`] out; no clock, no I/O.
//!
//! - `rdma`: the pod's processes hold a data-path QP (RC, UC, XRC, or a driver's own, e.g.
//!   mlx5's DC) in RTS on an in-scope port. UD and GSI alone do not count: NCCL's data moves
//!   over RC, and a UD QP is what any verbs user (or a CM) holds without moving data.
//! - `sockets`: no such QP, and at least `tcp_min_bytes_per_second` × the window of TCP with
//!   the pod's peers (the pods of its job on other nodes), whatever interface carried it, in
//!   either direction; TCP with any other address never decides. Or such QPs, but the ports
//!   they are on are the job's alone and carried less than a tenth of that TCP
//!   (`SocketsBesideIdleQueuePairs`): a decoy or stale QP does not hide a fallback.
//! - `idle`: no such QP and less TCP than that.
//! - `unknown`: the agent could not see (its QPs or its TCP), with the reason.
//!
//! [`confirm`] then holds a `sockets` verdict back until `runtime.confirm_windows` windows in
//! a row showed it, and clears a pod's `False` after `runtime.clear_after` of quiet.

use crate::transport::bandwidth::JobPorts;
use crate::transport::settings::RuntimeSettings;
use fabricgate_probes::transport::{InternodeTcp, Observed, PodTransportFacts};
use serde::Serialize;
use std::fmt;
use std::time::Duration;

/// A pod's transport, as `fabricgate_pod_transport{transport}` and `check`'s JSON write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Rdma,
    Sockets,
    Idle,
    Unknown,
}

impl Transport {
    pub const ALL: [Self; 4] = [Self::Rdma, Self::Sockets, Self::Idle, Self::Unknown];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rdma => "rdma",
            Self::Sockets => "sockets",
            Self::Idle => "idle",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The reason of the pod condition `fabricgate.io/TransportReady` for each transport.
pub const REASON_RDMA: &str = "DataPathQueuePairs";
pub const REASON_SOCKETS: &str = "SocketsFallback";
/// Sockets while the pod holds data-path QPs whose ports (its job's alone) carry nothing.
pub const REASON_SOCKETS_BESIDE_IDLE: &str = "SocketsBesideIdleQueuePairs";
pub const REASON_IDLE: &str = "NoInterNodeTraffic";
pub const REASON_UNKNOWN: &str = "TransportUnknown";

/// One pod's verdict and the facts that decided it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodVerdict {
    pub transport: Transport,
    /// CamelCase, stable: the pod condition's reason ([`REASON_RDMA`], ...).
    pub reason: &'static str,
    /// For a person: "0 data-path QPs; 41.0 GB over TCP to 7 nodes in 60 s via ib0".
    pub why: String,
    /// Data-path QPs in RTS on in-scope ports (`None`: not seen).
    pub data_path_qps: Option<usize>,
    /// TCP bytes with the pod's peers over the window (`None`: not measured).
    pub internode_tcp_bytes: Option<u64>,
    /// TCP bytes with other addresses off the node over the window: object storage, a dataset
    /// server, a pod of another job (`None`: not measured). Never decides `sockets`.
    pub other_tcp_bytes: Option<u64>,
    /// What the pod's data-path ports carried over the window, when they are its job's alone
    /// and have byte counters (`None` otherwise).
    pub rdma_bytes: Option<u64>,
    /// With `idle`: the pod has been quiet for `runtime.clear_after`, so a `False` it shows
    /// returns to `Unknown`/`NoInterNodeTraffic` (set by [`confirm`]).
    #[serde(skip)]
    pub clears: bool,
}

/// Whether a condition's reason says sockets (what the guard's eviction and the gang requeue
/// act on when the condition is `False`).
pub fn is_sockets_reason(reason: &str) -> bool {
    reason == REASON_SOCKETS || reason == REASON_SOCKETS_BESIDE_IDLE
}

/// The verdict on one pod. `in_scope(device, port)` says whether a port is one the
/// requirements select (a QP on a port outside them, e.g. a storage HCA, is not the job's
/// fabric); a QP not bound to a port counts when its device has any port in scope, which the
/// caller says with `in_scope(device, 0)`. `ports`: what the pod's data-path ports carried,
/// when they are its job's alone (`transport::bandwidth::job_ports`).
pub fn judge_pod(
    facts: &PodTransportFacts,
    settings: &RuntimeSettings,
    in_scope: impl Fn(&str, u32) -> bool,
    ports: Option<&JobPorts>,
) -> PodVerdict {
    let data_path = match &facts.qps {
        Observed::Seen(qps) => Some(
            qps.iter()
                .filter(|qp| qp.is_data_path() && in_scope(&qp.device, qp.port.unwrap_or(0)))
                .count(),
        ),
        Observed::Unseen { .. } => None,
    };
    let tcp = match &facts.internode_tcp {
        Observed::Seen(tcp) => Some(tcp),
        Observed::Unseen { .. } => None,
    };
    let tcp_bytes = tcp.map(|t| t.bytes);
    // Bulk TCP with the peers: at least `tcp_min_bytes_per_second` over the window, and some.
    let bulk = |t: &InternodeTcp| t.bytes > 0 && t.bytes >= threshold_bytes(settings, t);
    let verdict = |transport, reason, why| PodVerdict {
        transport,
        reason,
        why,
        data_path_qps: data_path,
        internode_tcp_bytes: tcp_bytes,
        other_tcp_bytes: tcp.map(|t| t.other_bytes),
        rdma_bytes: ports.map(|p| p.bytes),
        clears: false,
    };
    if let Some(n) = data_path.filter(|n| *n > 0) {
        let qps = plural(n, "data-path QP in RTS", "data-path QPs in RTS");
        if let (Some(ports), Some(t)) = (ports, tcp)
            && bulk(t)
            && ports.bytes.saturating_mul(10) < t.bytes
        {
            let why = format!(
                "{qps}, but {} carried {} in {} s; {}",
                ports.names.join(", "),
                human_bytes(ports.bytes),
                t.window.as_secs(),
                describe_tcp(t)
            );
            return verdict(Transport::Sockets, REASON_SOCKETS_BESIDE_IDLE, why);
        }
        let why = match tcp {
            Some(t) => format!("{qps}; {}", describe_tcp(t)),
            None => qps,
        };
        return verdict(Transport::Rdma, REASON_RDMA, why);
    }
    let (Some(_), Some(tcp)) = (data_path, tcp) else {
        let mut unseen = Vec::new();
        if let Observed::Unseen { reason } = &facts.qps {
            unseen.push(format!("its queue pairs cannot be listed: {reason}"));
        }
        if let Observed::Unseen { reason } = &facts.internode_tcp {
            unseen.push(format!("its TCP cannot be measured: {reason}"));
        }
        return verdict(Transport::Unknown, REASON_UNKNOWN, unseen.join("; "));
    };
    if bulk(tcp) {
        let why = format!("0 data-path QPs; {}", describe_tcp(tcp));
        return verdict(Transport::Sockets, REASON_SOCKETS, why);
    }
    let why = format!(
        "0 data-path QPs; {} (below {} over the window)",
        describe_tcp(tcp),
        human_bytes(threshold_bytes(settings, tcp))
    );
    verdict(Transport::Idle, REASON_IDLE, why)
}

/// `tcp_min_bytes_per_second` over the time the sample really covered (at least 1 s).
fn threshold_bytes(settings: &RuntimeSettings, tcp: &InternodeTcp) -> u64 {
    let seconds = tcp.window.as_secs_f64().max(1.0);
    (settings.tcp_min_bytes_per_second as f64 * seconds).ceil() as u64
}

fn describe_tcp(tcp: &InternodeTcp) -> String {
    let mut text = format!(
        "{} over TCP with {} in {} s",
        human_bytes(tcp.bytes),
        plural(tcp.peers.len(), "peer", "peers"),
        tcp.window.as_secs()
    );
    if !tcp.interfaces.is_empty() {
        text.push_str(" via ");
        text.push_str(&tcp.interfaces.join(", "));
    }
    if tcp.other_bytes > 0 {
        text.push_str(&format!(
            "; {} with addresses outside its job",
            human_bytes(tcp.other_bytes)
        ));
    }
    text
}

/// What the runtime task remembers of a judged pod between windows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodHistory {
    /// Windows in a row that judged the pod `sockets`.
    pub sockets_windows: u32,
    /// How long the pod has been `idle` since its last `sockets` or `rdma` window.
    pub quiet: Duration,
}

/// The verdict to act on, from this window's and the pod's history (which it updates):
/// - `sockets` stands only from the `runtime.confirm_windows`-th window in a row; before, the
///   pod is `idle` ("not yet confirmed"), which changes no condition, so one window of a
///   checkpoint restore or a warm-up never turns a pod `False`;
/// - `rdma` and `unknown` stand at once (a `False` returns to `True` as soon as data-path QPs
///   are seen; what the agent cannot see is never left `False`);
/// - `idle` for `runtime.clear_after` in a row `clears` (a `False` returns to `Unknown`).
pub fn confirm(
    verdict: PodVerdict,
    history: &mut PodHistory,
    settings: &RuntimeSettings,
    window: Duration,
) -> PodVerdict {
    match verdict.transport {
        Transport::Sockets => {
            history.sockets_windows = history.sockets_windows.saturating_add(1);
            history.quiet = Duration::ZERO;
            if history.sockets_windows >= settings.confirm_windows {
                return verdict;
            }
            PodVerdict {
                transport: Transport::Idle,
                reason: REASON_IDLE,
                why: format!(
                    "on sockets for {} of {} windows, not yet confirmed (runtime.confirm_windows): {}",
                    history.sockets_windows, settings.confirm_windows, verdict.why
                ),
                ..verdict
            }
        }
        Transport::Rdma | Transport::Unknown => {
            *history = PodHistory::default();
            verdict
        }
        Transport::Idle => {
            history.sockets_windows = 0;
            history.quiet = history.quiet.saturating_add(window);
            PodVerdict {
                clears: history.quiet >= settings.clear_after,
                ..verdict
            }
        }
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// Decimal units, as `41.0 GB`, `512 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1000.0;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::transport::restrack::{QpEntry, QpOwner, QpState, QpType};
    use std::net::{IpAddr, Ipv4Addr};
    use std::time::Duration;

    fn qp(device: &str, port: u32, qp_type: QpType, state: QpState) -> QpEntry {
        QpEntry {
            device_index: 0,
            device: device.into(),
            port: Some(port),
            lqpn: 17,
            rqpn: None,
            qp_type,
            state,
            owner: QpOwner::Pid(120),
            pdn: None,
        }
    }

    fn tcp(bytes: u64, peers: u8) -> Observed<InternodeTcp> {
        Observed::Seen(InternodeTcp {
            bytes,
            window: Duration::from_secs(30),
            peers: (1..=peers)
                .map(|i| IpAddr::V4(Ipv4Addr::new(10, 0, 0, i)))
                .collect(),
            interfaces: vec!["ib0".into()],
            other_bytes: 0,
        })
    }

    fn facts(qps: Vec<QpEntry>, internode_tcp: Observed<InternodeTcp>) -> PodTransportFacts {
        PodTransportFacts {
            pod_uid: "u".into(),
            qps: Observed::Seen(qps),
            internode_tcp,
            ports: Vec::new(),
        }
    }

    fn judge(f: &PodTransportFacts) -> PodVerdict {
        judge_pod(
            f,
            &RuntimeSettings::default(),
            |dev, _| dev != "mlx5_8",
            None,
        )
    }

    #[test]
    fn an_rc_qp_in_rts_on_an_in_scope_port_is_rdma_whatever_the_tcp() {
        let v = judge(&facts(
            vec![qp("mlx5_0", 1, QpType::Rc, QpState::Rts)],
            tcp(41_000_000_000, 7),
        ));
        assert_eq!(v.transport, Transport::Rdma);
        assert_eq!(v.reason, REASON_RDMA);
        assert_eq!(v.data_path_qps, Some(1));
        assert!(v.why.starts_with("1 data-path QP in RTS;"), "{}", v.why);
    }

    /// A data-path QP whose ports are the job's alone and carry next to nothing while bulk TCP
    /// flows to the job's peers is no alibi: `sockets`, `SocketsBesideIdleQueuePairs`. Ports
    /// that carry the job's traffic, ports not known to be the job's (no figure: `None`), or
    /// TCP below the threshold leave it `rdma`.
    #[test]
    fn an_idle_queue_pair_beside_bulk_tcp_to_the_peers_is_sockets() {
        let rc = || vec![qp("mlx5_0", 1, QpType::Rc, QpState::Rts)];
        let ports = |bytes| JobPorts {
            bytes,
            names: vec!["mlx5_0/1".into()],
        };
        let settings = RuntimeSettings::default();
        let judge_with =
            |f: &PodTransportFacts, p: Option<&JobPorts>| judge_pod(f, &settings, |_, _| true, p);
        let bulk = facts(rc(), tcp(41_000_000_000, 7));
        let v = judge_with(&bulk, Some(&ports(4_000)));
        assert_eq!(v.transport, Transport::Sockets);
        assert_eq!(v.reason, REASON_SOCKETS_BESIDE_IDLE);
        assert!(is_sockets_reason(v.reason));
        assert_eq!(
            v.why,
            "1 data-path QP in RTS, but mlx5_0/1 carried 4.0 kB in 30 s; 41.0 GB over TCP with \
             7 peers in 30 s via ib0"
        );
        assert_eq!(v.rdma_bytes, Some(4_000));
        // A tenth of the TCP or more on the job's ports: its QPs move its data.
        let v = judge_with(&bulk, Some(&ports(4_100_000_000)));
        assert_eq!((v.transport, v.reason), (Transport::Rdma, REASON_RDMA));
        assert_eq!(judge_with(&bulk, None).transport, Transport::Rdma);
        let little = facts(rc(), tcp(1_000, 1));
        assert_eq!(
            judge_with(&little, Some(&ports(0))).transport,
            Transport::Rdma
        );
    }

    #[test]
    fn bulk_tcp_without_a_data_path_qp_is_sockets_and_says_the_facts() {
        // UD and GSI, an RC not in RTS, and an RC on a port out of scope do not count.
        let v = judge(&facts(
            vec![
                qp("mlx5_0", 1, QpType::Ud, QpState::Rts),
                qp("mlx5_0", 1, QpType::Gsi, QpState::Rts),
                qp("mlx5_0", 1, QpType::Rc, QpState::Init),
                qp("mlx5_8", 1, QpType::Rc, QpState::Rts),
            ],
            tcp(41_000_000_000, 7),
        ));
        assert_eq!(v.transport, Transport::Sockets);
        assert_eq!(v.reason, REASON_SOCKETS);
        assert_eq!(
            v.why,
            "0 data-path QPs; 41.0 GB over TCP with 7 peers in 30 s via ib0"
        );
        assert_eq!(v.internode_tcp_bytes, Some(41_000_000_000));
    }

    #[test]
    fn tcp_below_the_rate_over_the_window_is_idle() {
        // 10 MB/s over 30 s is 300 MB: one byte less is idle, exactly that is sockets.
        let v = judge(&facts(vec![], tcp(299_999_999, 2)));
        assert_eq!(v.transport, Transport::Idle);
        assert!(v.why.contains("below 300.0 MB"), "{}", v.why);
        assert_eq!(
            judge(&facts(vec![], tcp(300_000_000, 2))).transport,
            Transport::Sockets
        );
        assert_eq!(judge(&facts(vec![], tcp(0, 0))).transport, Transport::Idle);
    }

    #[test]
    fn what_the_agent_cannot_see_is_unknown_with_the_reason() {
        let hidden = PodTransportFacts {
            pod_uid: "u".into(),
            qps: Observed::Unseen {
                reason: "not in the host PID namespace".into(),
            },
            internode_tcp: tcp(41_000_000_000, 7),
            ports: Vec::new(),
        };
        let v = judge(&hidden);
        assert_eq!(v.transport, Transport::Unknown);
        assert_eq!(v.data_path_qps, None);
        assert!(v.why.contains("host PID namespace"), "{}", v.why);
        let no_tcp = facts(
            vec![],
            Observed::Unseen {
                reason: "its network namespace cannot be entered".into(),
            },
        );
        assert_eq!(judge(&no_tcp).transport, Transport::Unknown);
        // A data-path QP is enough for rdma even when its TCP cannot be measured.
        let rdma_no_tcp = facts(
            vec![qp("mlx5_0", 1, QpType::Driver, QpState::Rts)],
            Observed::Unseen { reason: "x".into() },
        );
        assert_eq!(judge(&rdma_no_tcp).transport, Transport::Rdma);
    }

    /// One window of bulk TCP (a checkpoint restore, a warm-up) never stands as `sockets`;
    /// the second in a row does. A pod back on data-path QPs is `rdma` at once; quiet for
    /// `clear_after` it clears.
    #[test]
    fn sockets_stands_only_once_confirmed_and_quiet_clears_it() {
        let settings = RuntimeSettings::default();
        let window = Duration::from_secs(30);
        let mut history = PodHistory::default();
        let sockets = || judge(&facts(vec![], tcp(41_000_000_000, 7)));
        let idle = || judge(&facts(vec![], tcp(0, 0)));
        let first = confirm(sockets(), &mut history, &settings, window);
        assert_eq!(first.transport, Transport::Idle);
        assert!(
            first.why.starts_with("on sockets for 1 of 2 windows"),
            "{}",
            first.why
        );
        // A quiet window in between starts the count again.
        assert_eq!(
            confirm(idle(), &mut history, &settings, window).transport,
            Transport::Idle
        );
        assert_eq!(
            confirm(sockets(), &mut history, &settings, window).transport,
            Transport::Idle
        );
        let second = confirm(sockets(), &mut history, &settings, window);
        assert_eq!(second.transport, Transport::Sockets);
        assert_eq!(second.reason, REASON_SOCKETS);
        let rdma = judge(&facts(
            vec![qp("mlx5_0", 1, QpType::Rc, QpState::Rts)],
            tcp(0, 0),
        ));
        assert_eq!(
            confirm(rdma, &mut history, &settings, window).transport,
            Transport::Rdma
        );
        assert_eq!(history, PodHistory::default());
        let quiet_windows = settings.clear_after.as_secs() / window.as_secs();
        for n in 1..=quiet_windows {
            let v = confirm(idle(), &mut history, &settings, window);
            assert_eq!(v.clears, n == quiet_windows, "window {n}");
        }
    }

    #[test]
    fn tcp_outside_the_job_is_shown_and_never_decides() {
        let mut t = tcp(0, 0);
        if let Observed::Seen(t) = &mut t {
            t.other_bytes = 41_000_000_000;
        }
        let v = judge(&facts(vec![], t));
        assert_eq!(v.transport, Transport::Idle);
        assert_eq!(v.other_tcp_bytes, Some(41_000_000_000));
        assert!(
            v.why.contains("41.0 GB with addresses outside its job"),
            "{}",
            v.why
        );
    }

    #[test]
    fn bytes_read_as_a_person_reads_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1_500), "1.5 kB");
        assert_eq!(human_bytes(41_000_000_000), "41.0 GB");
    }
}
