//! The steady cost of runtime transport: what one window costs the agent on a node with 8
//! judged pods. `PodSampler::sample` over a temporary procfs laid out as the host's
//! (kthreadd at PID 2; 8 pods of 4 processes in kubepods cgroups, each pod its own network
//! namespace with its routes and addresses; 300 other processes), with the kernel's answers
//! recorded (16 RC QPs per pod, 64 TCP sockets per namespace whose byte counts grow every
//! call), and a sysfs of 8 InfiniBand HCAs (one port each, its data counters, its IPoIB
//! netdev) beside 2 Ethernet netdevs: every port carries data-path QPs, so each window reads
//! every port's counters and subtracts its IPoIB. The netlink round trips themselves are not
//! in it (no RDMA netlink here): the figure is the sampler's own work per window, which the
//! agent pays once per `runtime.window`.

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate_probes::Roots;
use fabricgate_probes::transport::restrack::{QpEntry, QpOwner, QpState, QpType};
use fabricgate_probes::transport::sample::{Kernel, PodSampler, RemoteScope, SampleRequest};
use fabricgate_probes::transport::tcp::TcpSocket;
use std::collections::BTreeSet;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;

#[path = "support/kubepods.rs"]
mod kubepods;
use kubepods::{other_processes, pod_pid, pod_process, pod_uid, write};

const PODS: u32 = 8;
const PROCS_PER_POD: u32 = 4;
const OTHER_PROCS: u32 = 300;
const QPS_PER_POD: u32 = 16;
const SOCKETS_PER_NS: u32 = 64;

#[derive(Debug)]
struct Recorded {
    calls: u64,
}

impl Kernel for Recorded {
    fn qps(&mut self) -> fabricgate_probes::Result<Vec<QpEntry>> {
        Ok((0..PODS)
            .flat_map(|pod| {
                (0..QPS_PER_POD).map(move |q| QpEntry {
                    device_index: q % 8,
                    device: format!("mlx5_{}", q % 8),
                    port: Some(1),
                    lqpn: 100 + pod * QPS_PER_POD + q,
                    rqpn: Some(9000 + q),
                    qp_type: QpType::Rc,
                    state: QpState::Rts,
                    owner: QpOwner::Pid(pod_pid(pod, 0)),
                    pdn: Some(1),
                })
            })
            .collect())
    }

    fn tcp_sockets(
        &mut self,
        _ns: Option<&Path>,
        _max: usize,
    ) -> fabricgate_probes::Result<Vec<TcpSocket>> {
        self.calls += 1;
        let grown = self.calls * 1_000_000;
        Ok((0..SOCKETS_PER_NS)
            .map(|s| TcpSocket {
                local: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 244, 0, 5)), 40000 + s as u16),
                remote: SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::new(10, 0, 1, 2 + (s % 7) as u8)),
                    29500,
                ),
                inode: 70000 + s,
                cookie: u64::from(s),
                state: 1,
                bytes_acked: Some(grown),
                bytes_received: Some(grown / 2),
            })
            .collect())
    }
}

/// The host's procfs as the sampler reads it.
fn procfs(proc: &Path) {
    write(&proc.join("2/comm"), "kthreadd\n");
    let route = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                 eth0\t00000000\t0101000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                 ib0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
    let fib = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 10.244.0.5\n        /32 host LOCAL\n";
    for pid in ["self".to_owned(), "1".to_owned()] {
        write(&proc.join(format!("{pid}/ns/net")), "");
        write(&proc.join(format!("{pid}/net/route")), route);
        write(&proc.join(format!("{pid}/net/fib_trie")), fib);
        write(&proc.join(format!("{pid}/net/if_inet6")), "");
        write(&proc.join(format!("{pid}/net/ipv6_route")), "");
        write(&proc.join(format!("{pid}/cgroup")), "0::/init.scope\n");
    }
    other_processes(proc, OTHER_PROCS);
    for pod in 0..PODS {
        for i in 0..PROCS_PER_POD {
            let pid = pod_pid(pod, i);
            pod_process(proc, &pod_uid(pod), pid);
            let dir = proc.join(pid.to_string());
            write(&dir.join("ns/net"), "");
            write(&dir.join("net/route"), route);
            write(&dir.join("net/fib_trie"), fib);
            write(&dir.join("net/if_inet6"), "");
            write(&dir.join("net/ipv6_route"), "");
        }
    }
}

/// 8 HCAs as the kernel lays them out (`class/infiniband/mlx5_N` → the PCI function's
/// `infiniband/mlx5_N`, whose `device` points back), each with port 1's InfiniBand data
/// counters and its IPoIB netdev `ibN`; two Ethernet netdevs beside them.
fn sysfs(sys: &Path) {
    for n in 0..8 {
        let pci = format!("devices/pci0000:00/0000:0{n}:00.0");
        let hca = sys.join(format!("{pci}/infiniband/mlx5_{n}"));
        write(
            &hca.join("ports/1/link_layer"),
            "InfiniBand
",
        );
        write(
            &hca.join("ports/1/counters/port_xmit_data"),
            "123456789
",
        );
        write(
            &hca.join("ports/1/counters/port_rcv_data"),
            "987654321
",
        );
        link("../../../0000:0{n}:00.0", &hca.join("device"), n);
        link(
            &format!("../../{pci}/infiniband/mlx5_{n}"),
            &sys.join(format!("class/infiniband/mlx5_{n}")),
            n,
        );
        let ib = sys.join(format!("{pci}/net/ib{n}"));
        write(
            &ib.join("type"),
            "32
",
        );
        write(
            &ib.join("dev_port"),
            "0
",
        );
        write(
            &ib.join("statistics/tx_bytes"),
            "1000
",
        );
        write(
            &ib.join("statistics/rx_bytes"),
            "1000
",
        );
        link("../../../0000:0{n}:00.0", &ib.join("device"), n);
        link(
            &format!("../../{pci}/net/ib{n}"),
            &sys.join(format!("class/net/ib{n}")),
            n,
        );
    }
    for name in ["eth0", "eth1"] {
        let dev = sys.join(format!("devices/virtual/net/{name}"));
        write(
            &dev.join("type"),
            "1
",
        );
        link(
            &format!("../../devices/virtual/net/{name}"),
            &sys.join(format!("class/net/{name}")),
            0,
        );
    }
}

/// A symlink at `at` to `target` (`{n}` in it replaced by `n`).
fn link(target: &str, at: &Path, n: u32) {
    if let Some(parent) = at.parent() {
        std::fs::create_dir_all(parent).expect("sysfs dir");
    }
    std::os::unix::fs::symlink(target.replace("{n}", &n.to_string()), at).expect("symlink");
}

fn eight_pods_one_window(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let proc = dir.path().join("proc");
    procfs(&proc);
    sysfs(&dir.path().join("sys"));
    let roots = Roots::new(dir.path().join("sys"), &proc);
    let mut sampler = PodSampler::with_kernel(roots, Box::new(Recorded { calls: 0 }));
    let request = SampleRequest {
        pod_uids: Some((0..PODS).map(pod_uid).collect()),
        host_network: BTreeSet::new(),
        remote: RemoteScope::JobPeers(
            (0..PODS)
                .map(|p| {
                    let peers = (2..9)
                        .map(|h| IpAddr::V4(Ipv4Addr::new(10, 0, 1, h)))
                        .collect();
                    (pod_uid(p), peers)
                })
                .collect(),
        ),
    };
    assert!(
        sampler.sample(&request).is_empty(),
        "the first sample sets the baselines"
    );
    let facts = sampler.sample(&request);
    assert_eq!(facts.len(), PODS as usize, "{:?}", sampler.notes());
    assert!(
        facts.iter().all(|f| f.ports.len() == 8
            && f.ports
                .iter()
                .all(|p| p.transmit_bytes.is_some() && p.subtracted.len() == 1)),
        "every pod's 8 ports read, IPoIB subtracted: {:?}",
        facts[0].ports
    );
    c.bench_function("sample_8_pods_one_window", |b| {
        b.iter(|| {
            let facts = sampler.sample(black_box(&request));
            assert_eq!(facts.len(), PODS as usize);
            facts
        })
    });
}

criterion_group!(benches, eight_pods_one_window);
criterion_main!(benches);
