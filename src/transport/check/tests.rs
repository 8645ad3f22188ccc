use super::*;
use fabricgate_probes::rdma::{PhysState, PortState};
use fabricgate_probes::transport::InternodeTcp;
use fabricgate_probes::transport::ports::{PortCounter, PortTraffic};
use fabricgate_probes::transport::restrack::{QpState, QpType};
use fabricgate_probes::transport::sample::NO_RDMA_NETLINK;
use std::net::IpAddr;

const RDMA_POD: &str = "1111aaaa-2222-4333-8444-555566667777";
const SOCKETS_POD: &str = "2222bbbb-3333-4444-8555-666677778888";
const BLIND_POD: &str = "3333cccc-4444-4555-8666-777788889999";
const IDLE_QP_POD: &str = "4444dddd-5555-4666-8777-88889999aaaa";

fn tcp(bytes: u64) -> Observed<InternodeTcp> {
    Observed::Seen(InternodeTcp {
        bytes,
        window: Duration::from_secs(5),
        peers: vec!["169.254.77.2".parse::<IpAddr>().unwrap()],
        interfaces: vec!["eth0".into()],
        other_bytes: 0,
    })
}

fn rc_qp() -> QpEntry {
    rc_qp_on("rxe0")
}

fn rc_qp_on(device: &str) -> QpEntry {
    QpEntry {
        device_index: 0,
        device: device.into(),
        port: Some(1),
        lqpn: 17,
        rqpn: Some(18),
        qp_type: QpType::Rc,
        state: QpState::Rts,
        owner: QpOwner::Pid(120),
        pdn: Some(1),
    }
}

/// What `device`'s port 1 carried over the window, `pod` holding its data-path QPs.
fn traffic(device: &str, pod: &str, sent: u64, counter: PortCounter) -> PortTraffic {
    PortTraffic {
        device: device.into(),
        port: 1,
        link_layer: Some("Ethernet".into()),
        counter,
        transmit_bytes: Some(sent),
        receive_bytes: Some(sent / 64),
        subtracted: Vec::new(),
        window: Duration::from_secs(5),
        pods: vec![pod.to_owned()],
        others: Vec::new(),
        unseen: None,
    }
}

/// An RDMA pod, a pod on sockets, a pod whose QPs cannot be listed, and a pod holding an idle
/// RC QP beside bulk TCP, as `check` prints them.
fn section() -> PodsSection {
    let config = Config::default();
    let rxe = PortCounter::PacketsTimesMtu { mtu: 1024 };
    let facts = [
        (
            RDMA_POD,
            Observed::Seen(vec![rc_qp()]),
            tcp(4_096),
            vec![traffic("rxe0", RDMA_POD, 6_553_600, rxe)],
        ),
        (
            SOCKETS_POD,
            Observed::Seen(Vec::new()),
            tcp(60_000_000),
            Vec::new(),
        ),
        (
            BLIND_POD,
            Observed::Unseen {
                reason: NO_RDMA_NETLINK.to_owned(),
            },
            tcp(0),
            Vec::new(),
        ),
        (
            IDLE_QP_POD,
            Observed::Seen(vec![rc_qp_on("mlx5_0")]),
            tcp(60_000_000),
            vec![traffic("mlx5_0", IDLE_QP_POD, 0, PortCounter::DataWords)],
        ),
    ]
    .map(|(uid, qps, internode_tcp, ports)| PodTransportFacts {
        pod_uid: uid.to_owned(),
        qps,
        internode_tcp,
        ports,
    });
    let job = |uid: &str| {
        Some(JobId {
            namespace: String::new(),
            job: format!("Pod/{uid}"),
        })
    };
    let shares = port_shares(&facts, job);
    let status = FallbackStatus {
        suspected: false,
        tcp_bytes_per_second: Some(12_500_000.0),
        rdma_bytes_per_second: None,
    };
    PodsSection {
        pods: facts
            .into_iter()
            .map(|f| {
                let job = job(&f.pod_uid);
                judge(
                    f,
                    &config,
                    &RuntimeSettings::default(),
                    &shares,
                    job.as_ref(),
                )
            })
            .collect(),
        ports: shares,
        notes: vec![NO_RDMA_NETLINK.to_owned()],
        window: Some(Duration::from_millis(5_020)),
        node_fallback: Some(NodeFallback {
            why: fallback_why(&status, &config.fallback),
            status,
        }),
        namespace_hcas: Vec::new(),
        peers_note: "peers from the cluster: the pods of each pod's job on other nodes".into(),
        names: [(SOCKETS_POD.to_owned(), ("ml".to_owned(), "w-0".to_owned()))].into(),
    }
}

#[test]
fn the_table_section_reads_as_a_person_on_the_node_reads_it() {
    let want = "
Pods: sampled over 5.0 s
  POD UID                               TRANSPORT  QPS   INTER-NODE TCP  WHY
  1111aaaa-2222-4333-8444-555566667777  rdma       1 RC  4.1 kB          1 data-path QP in RTS; 4.1 kB over TCP with 1 peer in 5 s via eth0
  2222bbbb-3333-4444-8555-666677778888  sockets    0     60.0 MB         0 data-path QPs; 60.0 MB over TCP with 1 peer in 5 s via eth0
  3333cccc-4444-4555-8666-777788889999  unknown    ?     0 B             its queue pairs cannot be listed: the kernel has no RDMA netlink (NETLINK_RDMA: protocol not supported): ib_core is not loaded, so no queue pair exists on this node
  4444dddd-5555-4666-8777-88889999aaaa  sockets    1 RC  60.0 MB         1 data-path QP in RTS, but mlx5_0/1 carried 0 B in 5 s; 60.0 MB over TCP with 1 peer in 5 s via eth0
  ! the kernel has no RDMA netlink (NETLINK_RDMA: protocol not supported): ib_core is not loaded, so no queue pair exists on this node
  peers: peers from the cluster: the pods of each pod's job on other nodes
  node heuristic (fallback) over the same window: says nothing: the RDMA ports in scope have no byte counters (port_xmit_data, port_rcv_data); TCP 12.5 MB/s

RDMA ports of the pods' data-path queue pairs, over the same window:
  PORT      SENT    RECEIVED  WHOSE                                     COUNTED FROM
  mlx5_0/1  0 B     0 B       Pod/4444dddd-5555-4666-8777-88889999aaaa  port_xmit_data/port_rcv_data × 4
  rxe0/1    6.6 MB  102.4 kB  Pod/1111aaaa-2222-4333-8444-555566667777  hw_counters sent_pkts/rcvd_pkts × MTU 1024 (estimate)
";
    assert_eq!(to_table(&section()), want);
}

#[test]
fn the_json_section_has_exactly_the_issues_keys_per_pod() {
    let mut doc = json!({"ready": true});
    insert_json(&mut doc, &section());
    let want = json!({
        "ready": true,
        "pods": [
            {
                "uid": RDMA_POD,
                "namespace": "",
                "name": "",
                "transport": "rdma",
                "qps": [{
                    "device": "rxe0", "port": 1, "type": "RC", "state": "RTS",
                    "lqpn": 17, "rqpn": 18, "pid": 120
                }],
                "reason": "DataPathQueuePairs",
                "internode_tcp_bytes": 4096,
                "other_tcp_bytes": 0,
                "rdma_bytes": 6_656_000,
                "rdma_ports": ["rxe0/1"],
                "why": "1 data-path QP in RTS; 4.1 kB over TCP with 1 peer in 5 s via eth0"
            },
            {
                "uid": SOCKETS_POD,
                "namespace": "ml",
                "name": "w-0",
                "transport": "sockets",
                "qps": [],
                "reason": "SocketsFallback",
                "internode_tcp_bytes": 60_000_000,
                "other_tcp_bytes": 0,
                "rdma_bytes": null,
                "rdma_ports": [],
                "why": "0 data-path QPs; 60.0 MB over TCP with 1 peer in 5 s via eth0"
            },
            {
                "uid": BLIND_POD,
                "namespace": "",
                "name": "",
                "transport": "unknown",
                "qps": null,
                "reason": "TransportUnknown",
                "internode_tcp_bytes": 0,
                "other_tcp_bytes": 0,
                "rdma_bytes": null,
                "rdma_ports": [],
                "why": format!("its queue pairs cannot be listed: {NO_RDMA_NETLINK}")
            },
            {
                "uid": IDLE_QP_POD,
                "namespace": "",
                "name": "",
                "transport": "sockets",
                "qps": [{
                    "device": "mlx5_0", "port": 1, "type": "RC", "state": "RTS",
                    "lqpn": 17, "rqpn": 18, "pid": 120
                }],
                "reason": "SocketsBesideIdleQueuePairs",
                "internode_tcp_bytes": 60_000_000,
                "other_tcp_bytes": 0,
                "rdma_bytes": 0,
                "rdma_ports": ["mlx5_0/1"],
                "why": "1 data-path QP in RTS, but mlx5_0/1 carried 0 B in 5 s; 60.0 MB over \
                        TCP with 1 peer in 5 s via eth0"
            }
        ],
        "pod_namespace_rdma": [],
        "pods_sample": {
            "window_seconds": 5.02,
            "notes": [NO_RDMA_NETLINK],
            "peers": "peers from the cluster: the pods of each pod's job on other nodes",
            "node_fallback": {
                "suspected": false,
                "tcp_bytes_per_second": 12_500_000.0,
                "rdma_bytes_per_second": null,
                "why": "says nothing: the RDMA ports in scope have no byte counters \
                        (port_xmit_data, port_rcv_data); TCP 12.5 MB/s"
            },
            "ports": [
                {
                    "device": "mlx5_0", "port": 1,
                    "jobs": [{"namespace": "", "job": format!("Pod/{IDLE_QP_POD}")}],
                    "others": [],
                    "counter": {"kind": "data_words"},
                    "transmit_bytes": 0, "receive_bytes": 0
                },
                {
                    "device": "rxe0", "port": 1,
                    "jobs": [{"namespace": "", "job": format!("Pod/{RDMA_POD}")}],
                    "others": [],
                    "counter": {"kind": "packets_times_mtu", "mtu": 1024},
                    "transmit_bytes": 6_553_600, "receive_bytes": 102_400
                }
            ]
        }
    });
    assert_eq!(doc, want);
}

#[test]
fn no_pod_is_said_so_and_not_waited_for() {
    let text = to_table(&PodsSection::default());
    assert_eq!(
        text,
        "\nPods:\n  (no pod cgroup holds queue pairs or moves TCP to a non-local address)\n"
    );
    // A procfs with no pod process (and the host's PID 2): no wait, no pod, no heuristic.
    let dir = tempfile::tempdir().unwrap();
    let proc = dir.path().join("proc");
    std::fs::create_dir_all(proc.join("2")).unwrap();
    std::fs::write(proc.join("2/comm"), "kthreadd\n").unwrap();
    let mut sampler = PodSampler::new(Roots::new(dir.path().join("sys"), &proc));
    let report = ProbeReport::default();
    let start = Instant::now();
    let section = sample(
        &mut sampler,
        &Config::default(),
        &RuntimeSettings::default(),
        Duration::from_secs(30),
        ClusterPeers::not_local("no cluster in this test"),
        &report,
        || panic!("no second probe without pods"),
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(section.pods.is_empty() && section.window.is_none());
    assert!(section.node_fallback.is_none());
}

/// Without the host PID namespace each pod cgroup (systemd driver on v2, cgroupfs driver on a
/// v1 hierarchy) is an `unknown` pod saying what to add; other cgroups are not pods.
#[test]
fn without_the_host_pid_namespace_every_pod_cgroup_is_unknown_with_what_to_add() {
    let dir = tempfile::tempdir().unwrap();
    let cg = dir.path().join("sys/fs/cgroup");
    let systemd = "kubepods.slice/kubepods-burstable.slice/\
                   kubepods-burstable-pod1111aaaa_2222_4333_8444_555566667777.slice";
    for d in [
        format!("{systemd}/cri-containerd-abc.scope"),
        "memory/kubepods/besteffort/pod2222bbbb-3333-4444-8555-666677778888/ctr".to_owned(),
        "system.slice/containerd.service".to_owned(),
        "memory/kubepods/besteffort/not-a-pod".to_owned(),
    ] {
        std::fs::create_dir_all(cg.join(d)).unwrap();
    }
    let roots = Roots::new(dir.path().join("sys"), dir.path().join("proc"));
    assert_eq!(
        procs::pod_cgroups(&roots).into_iter().collect::<Vec<_>>(),
        [RDMA_POD, SOCKETS_POD]
    );
    let mut sampler = PodSampler::new(roots);
    let section = sample(
        &mut sampler,
        &Config::default(),
        &RuntimeSettings::default(),
        Duration::from_secs(30),
        ClusterPeers::not_local("no cluster in this test"),
        &ProbeReport::default(),
        || panic!("nothing to wait for"),
    );
    assert_eq!(section.notes, [NO_HOST_PID]);
    assert_eq!(section.pods.len(), 2);
    for p in &section.pods {
        assert_eq!(
            p.verdict.transport,
            crate::transport::verdict::Transport::Unknown
        );
        assert!(p.verdict.why.contains("hostPID: true"), "{}", p.verdict.why);
    }
}

#[test]
fn the_heuristic_says_which_rate_decided() {
    let settings = FallbackSettings::default();
    let status = |tcp, rdma, suspected| FallbackStatus {
        suspected,
        tcp_bytes_per_second: tcp,
        rdma_bytes_per_second: rdma,
    };
    let why = |s| fallback_why(&s, &settings);
    assert_eq!(
        why(status(Some(2e8), Some(0.0), true)),
        "suspected: TCP 200.0 MB/s on the node's netdevs while the RDMA ports moved 0 B/s"
    );
    assert!(why(status(Some(2e8), Some(5e9), false)).starts_with(
        "not suspected: the RDMA ports are not idle (5.0 GB/s > \
         fallback.rdma_max_bytes_per_second 1.0 MB/s)"
    ));
    assert!(why(status(Some(1e3), Some(0.0), false)).starts_with(
        "not suspected: TCP 1.0 kB/s is below fallback.tcp_min_bytes_per_second 100.0 MB/s"
    ));
    assert!(why(status(None, None, false)).starts_with("says nothing: no netdev"));
    let off = FallbackSettings {
        enabled: false,
        ..settings.clone()
    };
    assert_eq!(
        fallback_why(&status(None, None, false), &off),
        "off (fallback.enabled: false)"
    );
}

/// A kernel whose namespaces list recorded ports, by the path entered.
#[derive(Debug, Default)]
struct Namespaces(BTreeMap<std::path::PathBuf, fabricgate_probes::Result<Vec<NetlinkPort>>>);

impl NamespaceRdma for Namespaces {
    fn ports(&mut self, ns: &std::path::Path) -> fabricgate_probes::Result<Vec<NetlinkPort>> {
        match self.0.remove(ns) {
            Some(answer) => answer,
            None => panic!("entered {} twice or unexpectedly", ns.display()),
        }
    }
}

fn port(device: &str, state: PortState, phys: PhysState) -> NetlinkPort {
    NetlinkPort {
        device: device.into(),
        port: 1,
        state: Some(state),
        physical_state: Some(phys),
        netdev: None,
    }
}

/// The pods' own namespaces in `check`: an HCA only a pod's namespace lists is shown with its
/// port; the node's own devices, which every namespace lists in shared mode, are not; a
/// namespace that cannot be entered says why; the agent's own namespace is not entered.
#[test]
fn hcas_only_a_pods_namespace_lists_are_shown_with_their_ports() {
    use fabricgate_probes::rdma::DeviceReport;
    let dir = tempfile::tempdir().unwrap();
    let proc = dir.path().join("proc");
    let cgroup = |uid: &str| {
        format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-9b8e.scope\n",
            uid.replace('-', "_")
        )
    };
    for (pid, uid) in [(100, RDMA_POD), (200, SOCKETS_POD), (300, BLIND_POD)] {
        std::fs::create_dir_all(proc.join(format!("{pid}/ns"))).unwrap();
        std::fs::write(proc.join(format!("{pid}/cgroup")), cgroup(uid)).unwrap();
        std::fs::write(proc.join(format!("{pid}/ns/net")), "").unwrap();
    }
    std::fs::create_dir_all(proc.join("self/ns")).unwrap();
    std::fs::hard_link(proc.join("300/ns/net"), proc.join("self/ns/net")).unwrap();
    let roots = Roots::new(dir.path().join("sys"), &proc);
    let mut report = ProbeReport::default();
    report.rdma.devices.push(DeviceReport {
        name: "mlx5_0".into(),
        ..DeviceReport::default()
    });
    let mut kernel = Namespaces::default();
    kernel.0.insert(
        proc.join("100/ns/net"),
        Ok(vec![
            port("mlx5_0", PortState::Active, PhysState::LinkUp),
            port("mlx5_3", PortState::Down, PhysState::Disabled),
        ]),
    );
    kernel.0.insert(
        proc.join("200/ns/net"),
        Err(fabricgate_probes::ProbeError::Netns {
            path: proc.join("200/ns/net"),
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        }),
    );
    let seen = namespace_hcas(&roots, &report, &mut kernel);
    assert!(kernel.0.is_empty(), "both foreign namespaces entered");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].pod_uid, RDMA_POD);
    assert_eq!(
        seen[0].ports,
        Observed::Seen(vec![port("mlx5_3", PortState::Down, PhysState::Disabled)])
    );
    assert_eq!(seen[1].pod_uid, SOCKETS_POD);

    let section = PodsSection {
        namespace_hcas: seen,
        ..PodsSection::default()
    };
    let table = to_table(&section);
    let tail = table
        .split_once("RDMA devices in pods' own network namespaces")
        .map(|(_, t)| t)
        .unwrap_or_else(|| panic!("{table}"));
    let lines: Vec<&str> = tail.lines().collect();
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["POD", "UID", "PID", "PORT", "STATE", "PHYS", "NETDEV"]
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        [RDMA_POD, "100", "mlx5_3/1", "DOWN", "Disabled"]
    );
    assert!(
        lines[3].contains("cannot enter the network namespace"),
        "{table}"
    );

    let mut doc = json!({});
    insert_json(&mut doc, &section);
    assert_eq!(
        doc["pod_namespace_rdma"][0],
        json!({"uid": RDMA_POD, "pid": 100, "why": null, "ports": [{
            "device": "mlx5_3", "port": 1, "state": "DOWN", "physical_state": "Disabled",
            "netdev": null
        }]})
    );
    assert!(doc["pod_namespace_rdma"][1]["ports"].is_null());
    assert!(
        doc["pod_namespace_rdma"][1]["why"]
            .as_str()
            .is_some_and(|w| w.contains("CAP_SYS_ADMIN"))
    );
}
