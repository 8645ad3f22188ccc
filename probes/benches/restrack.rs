//! The cost of per-pod RDMA tracking: one resource-tracking dump of 10,000 QPs parsed and
//! each QP attributed to its pod, in at most 20 ms of CPU. The dump is synthetic but laid out
//! as the kernel's (benches/support/restrack_synth.rs); 64 owner processes, each with a
//! kubepods-shaped `/proc/<pid>/cgroup` in a temporary procfs.

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate_probes::Roots;
use fabricgate_probes::transport::{attribute, restrack};
use std::hint::black_box;

#[path = "support/kubepods.rs"]
mod kubepods;
#[path = "support/restrack_synth.rs"]
mod synth;

fn dump_and_attribute(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let proc = dir.path().join("proc");
    let pids: Vec<u32> = (4000..4064).collect();
    for pid in &pids {
        kubepods::pod_process(&proc, &kubepods::pod_uid(*pid), *pid);
    }
    let roots = Roots::new(dir.path().join("sys"), &proc);
    // The kernel fills each dump message up to a page-sized skb: about 40 entries of this size.
    let reply = synth::qp_dump(0, "mlx5_0", 10_000, &pids, 40);
    c.bench_function("restrack_10000_qps_parse_and_attribute", |b| {
        b.iter(|| {
            let qps = restrack::parse_qp_dump(black_box(&reply)).expect("dump");
            let attributed = attribute(&roots, qps);
            assert_eq!(attributed.len(), 10_000);
            attributed
        })
    });
}

criterion_group!(benches, dump_and_attribute);
criterion_main!(benches);
