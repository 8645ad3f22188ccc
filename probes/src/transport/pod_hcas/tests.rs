use super::*;
use crate::rdma::types::{PhysState, PortState};
use std::path::PathBuf;

/// A recorded kernel: the ports each namespace path lists, or an error.
#[derive(Debug, Default)]
struct Recorded {
    answers: BTreeMap<PathBuf, std::result::Result<Vec<NetlinkPort>, i32>>,
    asked: Vec<PathBuf>,
}

impl NamespaceRdma for Recorded {
    fn ports(&mut self, ns: &Path) -> Result<Vec<NetlinkPort>> {
        self.asked.push(ns.to_owned());
        match self.answers.get(ns) {
            Some(Ok(ports)) => Ok(ports.clone()),
            Some(Err(errno)) => Err(ProbeError::Netns {
                path: ns.to_owned(),
                source: io::Error::from_raw_os_error(*errno),
            }),
            None => panic!("asked for {}", ns.display()),
        }
    }
}

fn mlx5_3(state: PortState) -> NetlinkPort {
    NetlinkPort {
        device: "mlx5_3".into(),
        port: 1,
        state: Some(state),
        physical_state: Some(PhysState::LinkUp),
        netdev: Some("net1".into()),
    }
}

/// A procfs where `self` and PID 10 share one namespace file (the agent's, hostNetwork),
/// PIDs 20 and 21 another (one pod's sandbox and container) and PID 30 a third.
fn procfs() -> (tempfile::TempDir, Roots) {
    let dir = tempfile::tempdir().unwrap();
    let proc = dir.path().join("proc");
    for pid in ["self", "10", "20", "21", "30"] {
        std::fs::create_dir_all(proc.join(pid).join("ns")).unwrap();
    }
    std::fs::write(proc.join("self/ns/net"), "").unwrap();
    std::fs::hard_link(proc.join("self/ns/net"), proc.join("10/ns/net")).unwrap();
    std::fs::write(proc.join("20/ns/net"), "").unwrap();
    std::fs::hard_link(proc.join("20/ns/net"), proc.join("21/ns/net")).unwrap();
    std::fs::write(proc.join("30/ns/net"), "").unwrap();
    let roots = Roots::new(dir.path().join("sys"), proc);
    (dir, roots)
}

#[test]
fn each_wanted_pod_is_looked_at_in_its_own_namespace_or_says_why_not() {
    let (_dir, roots) = procfs();
    let pods: BTreeMap<String, Vec<u32>> = [
        ("host-net".to_owned(), vec![10]),
        ("holder".to_owned(), vec![20, 21]),
        ("denied".to_owned(), vec![30]),
        ("gone".to_owned(), vec![99]),
    ]
    .into();
    let ns = |pid: u32| roots.proc(format!("{pid}/ns/net"));
    let mut rdma = Recorded::default();
    rdma.answers
        .insert(ns(20), Ok(vec![mlx5_3(PortState::Active)]));
    rdma.answers.insert(ns(30), Err(libc::EPERM));
    let wanted: BTreeSet<String> = ["host-net", "holder", "denied", "gone", "unknown"]
        .map(str::to_owned)
        .into();
    let looked = look(&roots, &pods, &wanted, &mut rdma);
    let by_uid: BTreeMap<&str, &PodHcas> = looked.iter().map(|p| (p.pod_uid.as_str(), p)).collect();
    assert_eq!(by_uid.len(), 5);
    assert_eq!(by_uid["holder"].pid, Some(20));
    assert_eq!(
        by_uid["holder"].ports,
        Observed::Seen(vec![mlx5_3(PortState::Active)])
    );
    assert!(
        matches!(&by_uid["host-net"].ports, Observed::Unseen { reason } if reason == SHARES_AGENT_NETNS)
    );
    assert!(
        matches!(&by_uid["denied"].ports, Observed::Unseen { reason }
            if reason.contains("cannot enter the network namespace") && reason.contains("CAP_SYS_ADMIN")),
        "{:?}",
        by_uid["denied"].ports
    );
    for uid in ["gone", "unknown"] {
        assert_eq!(by_uid[uid].pid, None);
        assert!(matches!(&by_uid[uid].ports, Observed::Unseen { reason } if reason == NO_PROCESS));
    }
    // Only the two foreign namespaces were entered, each once.
    assert_eq!(rdma.asked, vec![ns(30), ns(20)]);
}

#[test]
fn pods_sharing_a_namespace_cost_one_dump() {
    let (_dir, roots) = procfs();
    let pods: BTreeMap<String, Vec<u32>> =
        [("a".to_owned(), vec![20]), ("b".to_owned(), vec![21])].into();
    let mut rdma = Recorded::default();
    rdma.answers
        .insert(roots.proc("20/ns/net"), Ok(vec![mlx5_3(PortState::Down)]));
    let wanted: BTreeSet<String> = ["a", "b"].map(str::to_owned).into();
    let looked = look(&roots, &pods, &wanted, &mut rdma);
    assert_eq!(rdma.asked.len(), 1);
    assert!(
        looked
            .iter()
            .all(|p| p.ports == Observed::Seen(vec![mlx5_3(PortState::Down)]))
    );
}
