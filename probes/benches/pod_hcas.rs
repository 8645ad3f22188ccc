//! The cost of looking into DRA claim pods' network namespaces (the agent's
//! `dra::in_pods`, every probe interval while this node's pods name DRA claims):
//! - `dra_look_8_claim_pods`: one look's own work — `procs::pod_processes` over a temporary
//!   procfs laid out as the host's (8 claim pods × 4 processes in kubepods cgroups, each pod its
//!   own network namespace, 300 other processes), then `pod_hcas::look` with each namespace's
//!   RDMA netlink replies recorded (the Soft-RoCE VM's port dump of an HCA in a pod's
//!   namespace, `probes/tests/fixtures/restrack/netns-exclusive/hca-pod/`, parsed per call);
//! - `open_in_netns_per_namespace`: what entering one namespace costs on the live kernel —
//!   `netlink::Socket::open_in_netns` into this process's own namespace (a thread spawned,
//!   `setns`, a socket opened, the thread joined). NETLINK_ROUTE stands in for NETLINK_RDMA,
//!   which this machine's kernel lacks; the dumps' round trips themselves are not in it. Needs
//!   CAP_SYS_ADMIN; without it the row is left out, and says so.

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate_probes::Roots;
use fabricgate_probes::netlink::{Protocol, Socket};
use fabricgate_probes::transport::pod_hcas::{self, NamespaceRdma};
use fabricgate_probes::transport::procs;
use fabricgate_probes::transport::restrack::{self, NetlinkPort};
use std::collections::BTreeSet;
use std::hint::black_box;
use std::path::{Path, PathBuf};

#[path = "support/kubepods.rs"]
mod kubepods;
use kubepods::{other_processes, pod_pid, pod_process, pod_uid, write};

const PODS: u32 = 8;
const PROCS_PER_POD: u32 = 4;
const OTHER_PROCS: u32 = 300;

/// The port dump the Soft-RoCE VM's kernel sent from the namespace holding rxe0.
#[derive(Debug)]
struct Recorded {
    datagrams: Vec<Vec<u8>>,
}

impl NamespaceRdma for Recorded {
    fn ports(&mut self, _ns: &Path) -> fabricgate_probes::Result<Vec<NetlinkPort>> {
        restrack::parse_port_dump(&self.datagrams)
    }
}

fn recorded() -> Recorded {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/restrack/netns-exclusive/hca-pod");
    let datagrams = ["ports-0-00.bin", "ports-0-01.bin"]
        .iter()
        .map(|f| std::fs::read(dir.join(f)).expect("the captured port dump"))
        .collect();
    Recorded { datagrams }
}

/// The host's procfs as the look reads it: `ns/net` a file per process (its inode names the
/// namespace, as the kernel's link does).
fn procfs(proc: &Path) {
    write(&proc.join("self/ns/net"), "");
    other_processes(proc, OTHER_PROCS);
    for pod in 0..PODS {
        for i in 0..PROCS_PER_POD {
            let pid = pod_pid(pod, i);
            pod_process(proc, &pod_uid(pod), pid);
            let dir = proc.join(pid.to_string());
            write(&dir.join("ns/net"), "");
        }
    }
}

fn look_into_claim_pods(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let proc = dir.path().join("proc");
    procfs(&proc);
    let roots = Roots::new(dir.path().join("sys"), &proc);
    let wanted: BTreeSet<String> = (0..PODS).map(pod_uid).collect();
    let mut rdma = recorded();
    c.bench_function("dra_look_8_claim_pods", |b| {
        b.iter(|| {
            let (processes, _) = procs::pod_processes(black_box(&roots));
            let seen = pod_hcas::look(&roots, &processes, &wanted, &mut rdma);
            assert_eq!(seen.len(), PODS as usize);
            assert!(
                seen.iter()
                    .all(|s| matches!(&s.ports, fabricgate_probes::transport::Observed::Seen(p) if p.len() == 1)),
                "{seen:?}"
            );
            seen
        })
    });
}

fn enter_one_namespace(c: &mut Criterion) {
    let own = Path::new("/proc/self/ns/net");
    if let Err(e) = Socket::open_in_netns(Protocol::ROUTE, own) {
        eprintln!("open_in_netns_per_namespace left out: {own:?}: {e} (needs CAP_SYS_ADMIN)");
        return;
    }
    c.bench_function("open_in_netns_per_namespace", |b| {
        b.iter(|| Socket::open_in_netns(Protocol::ROUTE, black_box(own)).expect("socket"))
    });
}

criterion_group!(benches, look_into_claim_pods, enter_one_namespace);
criterion_main!(benches);
