use super::*;

/// A procfs without `kthreadd` at PID 2 is not the host's: every requested pod is unknown
/// (from its second sample, as the contract says) with what to add; `check` gets a note.
#[test]
fn without_the_host_pid_namespace_pods_are_unknown_with_what_to_add() {
    let dir = tempfile::tempdir().unwrap();
    let roots = Roots::new(dir.path().join("sys"), dir.path().join("proc"));
    let mut sampler = PodSampler::new(roots);
    let request = SampleRequest {
        pod_uids: Some(["a".to_owned()].into()),
        host_network: BTreeSet::new(),
        remote: RemoteScope::NotLocal,
    };
    assert!(sampler.sample(&request).is_empty());
    let facts = sampler.sample(&request);
    assert_eq!(facts.len(), 1);
    assert!(
        matches!(&facts[0].qps, Observed::Unseen { reason } if reason.contains("hostPID: true"))
    );
    assert_eq!(sampler.notes(), [NO_HOST_PID]);
}

#[test]
fn remote_scopes() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let local: BTreeSet<IpAddr> = [ip("10.0.0.5")].into();
    let not_local = RemoteScope::NotLocal;
    assert_eq!(
        not_local.classify("a", ip("10.0.0.6"), &local),
        RemoteKind::Peer
    );
    assert_eq!(
        not_local.classify("a", ip("10.0.0.5"), &local),
        RemoteKind::Local
    );
    assert_eq!(
        not_local.classify("a", ip("127.0.0.1"), &local),
        RemoteKind::Local
    );
    let peers = RemoteScope::JobPeers([("a".to_owned(), [ip("192.168.7.9")].into())].into());
    assert_eq!(
        peers.classify("a", ip("192.168.7.9"), &local),
        RemoteKind::Peer
    );
    // Another pod's peer, or a pod with no peer at all, is other traffic.
    assert_eq!(
        peers.classify("b", ip("192.168.7.9"), &local),
        RemoteKind::Other
    );
    assert_eq!(
        peers.classify("a", ip("8.8.8.8"), &local),
        RemoteKind::Other
    );
    assert_eq!(
        peers.classify("a", ip("10.0.0.5"), &local),
        RemoteKind::Local
    );
}

/// A kernel whose one pod namespace holds three established sockets: to a peer of its job, to
/// a storage address, and to loopback; each sample they have moved `step` bytes more.
#[derive(Debug)]
struct ThreeSockets {
    moved: u64,
    step: u64,
}

impl Kernel for ThreeSockets {
    fn qps(&mut self) -> Result<Vec<QpEntry>> {
        Ok(Vec::new())
    }

    fn tcp_sockets(&mut self, _ns: Option<&Path>, _max: usize) -> Result<Vec<TcpSocket>> {
        self.moved += self.step;
        let socket = |cookie: u64, remote: &str| TcpSocket {
            local: "10.99.0.4:40000".parse().unwrap(),
            remote: remote.parse().unwrap(),
            inode: cookie as u32,
            cookie,
            state: 1,
            bytes_acked: Some(self.moved),
            bytes_received: Some(0),
        };
        Ok(vec![
            socket(1, "192.168.7.9:29500"),
            socket(2, "203.0.113.10:9000"),
            socket(3, "127.0.0.1:8080"),
        ])
    }
}

/// Only the job's peers decide: the bytes to the peer are the pod's inter-node TCP, those to
/// the storage address are `other_bytes`, loopback is neither; and a pod whose job has no
/// peer on another node moves no inter-node TCP at all, whatever it sends.
#[test]
fn only_the_jobs_peers_count_and_other_tcp_is_reported_apart() {
    let dir = tempfile::tempdir().unwrap();
    let roots = host_procfs(dir.path());
    add_pod_process(dir.path(), 100);
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    for (peers, want_peer, want_other) in [
        (Some([ip("192.168.7.9")].into()), 1_000, 1_000),
        (None, 0, 2_000),
    ] {
        let mut sampler = PodSampler::with_kernel(
            roots.clone(),
            Box::new(ThreeSockets {
                moved: 0,
                step: 1_000,
            }),
        );
        let request = SampleRequest {
            remote: RemoteScope::JobPeers(peers.into_iter().map(|p| (POD.to_owned(), p)).collect()),
            ..request_of(POD)
        };
        assert!(sampler.sample(&request).is_empty(), "the baseline");
        let facts = sampler.sample(&request);
        let Observed::Seen(tcp) = &facts[0].internode_tcp else {
            panic!("{facts:?}");
        };
        assert_eq!(
            (tcp.bytes, tcp.other_bytes),
            (want_peer, want_other),
            "{tcp:?}"
        );
        let want_peers: Vec<IpAddr> = if want_peer > 0 {
            vec![ip("192.168.7.9")]
        } else {
            Vec::new()
        };
        assert_eq!(tcp.peers, want_peers);
    }
}

/// A kernel that answers no RDMA netlink and no sockets.
#[derive(Debug)]
struct NoRdmaKernel;

impl Kernel for NoRdmaKernel {
    fn qps(&mut self) -> Result<Vec<QpEntry>> {
        Err(ProbeError::RdmaNetlinkUnavailable {
            source: io::Error::from_raw_os_error(libc::EPROTONOSUPPORT),
        })
    }

    fn tcp_sockets(&mut self, _ns: Option<&Path>, _max: usize) -> Result<Vec<TcpSocket>> {
        Ok(Vec::new())
    }
}

/// Without `ib_core` (the real node's kernel has no CONFIG_INFINIBAND) no process can hold a
/// queue pair: every pod's QPs are seen, and none; a note says why. Its TCP still decides
/// (`unknown` would hide a pod on sockets on exactly the node that has no RDMA at all).
#[test]
fn without_rdma_netlink_every_pod_holds_no_qp_and_a_note_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let roots = host_procfs(dir.path());
    add_pod_process(dir.path(), 100);
    let mut sampler = PodSampler::with_kernel(roots, Box::new(NoRdmaKernel));
    let request = request_of(POD);
    assert!(sampler.sample(&request).is_empty());
    let facts = sampler.sample(&request);
    assert_eq!(facts.len(), 1);
    assert!(
        matches!(&facts[0].qps, Observed::Seen(qps) if qps.is_empty()),
        "{:?}",
        facts[0].qps
    );
    assert!(
        matches!(&facts[0].internode_tcp, Observed::Seen(t) if t.bytes == 0),
        "{:?}",
        facts[0].internode_tcp
    );
    assert_eq!(sampler.notes(), [NO_RDMA_NETLINK]);
}

/// A pod the agent's watch shows before its sandbox runs (no process in its cgroup yet) is
/// not seen yet: no baseline, so its first window is not `unknown`; once it runs, the usual
/// baseline, then facts.
#[test]
fn a_pod_without_processes_yet_gets_its_baseline_once_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let roots = host_procfs(dir.path());
    let mut sampler = PodSampler::with_kernel(roots, Box::new(NoRdmaKernel));
    let request = request_of(POD);
    assert!(sampler.sample(&request).is_empty());
    assert!(sampler.sample(&request).is_empty(), "still not started");
    add_pod_process(dir.path(), 100);
    assert!(sampler.sample(&request).is_empty(), "the baseline");
    let facts = sampler.sample(&request);
    assert_eq!(facts.len(), 1);
    assert!(matches!(&facts[0].internode_tcp, Observed::Seen(_)));
}

const POD: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

fn request_of(uid: &str) -> SampleRequest {
    SampleRequest {
        pod_uids: Some([uid.to_owned()].into()),
        host_network: BTreeSet::new(),
        remote: RemoteScope::NotLocal,
    }
}

/// A procfs whose PID 2 is `kthreadd` (the host PID namespace).
fn host_procfs(dir: &Path) -> Roots {
    std::fs::create_dir_all(dir.join("proc/2")).unwrap();
    std::fs::write(dir.join("proc/2/comm"), "kthreadd\n").unwrap();
    Roots::new(dir.join("sys"), dir.join("proc"))
}

/// A process of POD (cgroupfs driver, cgroup v1, as on the real node) with a network
/// namespace of its own.
fn add_pod_process(dir: &Path, pid: u32) {
    let p = dir.join(format!("proc/{pid}"));
    std::fs::create_dir_all(p.join("ns")).unwrap();
    std::fs::write(
        p.join("cgroup"),
        format!(
            "4:memory:/kubepods/besteffort/pod{POD}/3f5e1c0a9b8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f\n"
        ),
    )
    .unwrap();
    std::fs::write(p.join("ns/net"), "").unwrap();
}

/// A kernel whose pod (PID 100) holds an RC QP in RTS on rxe0 port 1 and a UD QP on mlx5_0,
/// where the kernel's `ko2iblnd` holds an RC QP in RTS too.
#[derive(Debug)]
struct QpsOnTwoPorts;

impl Kernel for QpsOnTwoPorts {
    fn qps(&mut self) -> Result<Vec<QpEntry>> {
        use crate::transport::restrack::{QpState, QpType};
        let qp = |device: &str, qp_type, owner| QpEntry {
            device_index: 0,
            device: device.into(),
            port: Some(1),
            lqpn: 17,
            rqpn: None,
            qp_type,
            state: QpState::Rts,
            owner,
            pdn: None,
        };
        Ok(vec![
            qp("rxe0", QpType::Rc, QpOwner::Pid(100)),
            qp("mlx5_0", QpType::Ud, QpOwner::Pid(100)),
            qp("mlx5_0", QpType::Rc, QpOwner::Kernel("ko2iblnd".into())),
        ])
    }

    fn tcp_sockets(&mut self, _ns: Option<&Path>, _max: usize) -> Result<Vec<TcpSocket>> {
        Ok(Vec::new())
    }
}

/// A pod's facts carry the ports of its data-path QPs (not of its UD QP) with what each moved
/// since the previous sample: none at the first reading (the baseline), then the packets rxe
/// counted times its MTU; the kernel's QP on another port makes that port someone else's.
#[test]
fn a_pods_facts_carry_what_its_data_path_ports_moved_since_the_last_sample() {
    let dir = tempfile::tempdir().unwrap();
    let roots = host_procfs(dir.path());
    add_pod_process(dir.path(), 100);
    let sys = dir.path().join("sys");
    let port = sys.join("devices/virtual/infiniband/rxe0/ports/1");
    std::fs::create_dir_all(port.join("hw_counters")).unwrap();
    std::fs::create_dir_all(port.join("gid_attrs/ndevs")).unwrap();
    std::fs::write(port.join("link_layer"), "Ethernet\n").unwrap();
    std::fs::write(port.join("gid_attrs/ndevs/0"), "eth0\n").unwrap();
    std::fs::create_dir_all(sys.join("class/infiniband")).unwrap();
    std::os::unix::fs::symlink(
        "../../devices/virtual/infiniband/rxe0",
        sys.join("class/infiniband/rxe0"),
    )
    .unwrap();
    std::fs::create_dir_all(sys.join("class/net/eth0")).unwrap();
    std::fs::write(sys.join("class/net/eth0/mtu"), "1500\n").unwrap();
    let packets = |sent: u64| {
        std::fs::write(port.join("hw_counters/sent_pkts"), format!("{sent}\n")).unwrap();
        std::fs::write(port.join("hw_counters/rcvd_pkts"), "7\n").unwrap();
    };
    packets(100);
    let mut sampler = PodSampler::with_kernel(roots, Box::new(QpsOnTwoPorts));
    let request = request_of(POD);
    assert!(sampler.sample(&request).is_empty(), "the pod's baseline");
    packets(1_100);
    let facts = sampler.sample(&request);
    assert_eq!(facts[0].ports.len(), 1, "{:?}", facts[0].ports);
    let rxe = &facts[0].ports[0];
    assert_eq!((rxe.device.as_str(), rxe.port), ("rxe0", 1));
    assert_eq!(rxe.pods, [POD]);
    assert!(rxe.others.is_empty());
    assert_eq!(
        rxe.counter,
        crate::transport::ports::PortCounter::PacketsTimesMtu { mtu: 1024 }
    );
    assert_eq!(
        (rxe.transmit_bytes, rxe.receive_bytes),
        (Some(1_000 * 1024), Some(0))
    );
    assert_eq!(rxe.bytes(), Some(1_000 * 1024));
    // The pod's QP on mlx5_0 is UD: that port is not one of its data-path ports.
    assert!(facts[0].ports.iter().all(|p| p.device != "mlx5_0"));
}
