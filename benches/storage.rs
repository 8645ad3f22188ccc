//! Storage probe costs: parsing a large mount table (2,000 lines, as on a Kubernetes node
//! with many pod volumes) and probing 20 healthy mounts (statfs on worker threads + table
//! lookups + Lustre client files).
//!
//! `cargo bench --bench storage`

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate_probes::Roots;
use fabricgate_probes::storage::mountinfo::MountTable;
use fabricgate_probes::storage::{MountSpec, StorageConfig, StorageProber};
use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;

#[path = "mountinfo_table.rs"]
mod mountinfo_table;

/// A 2,000-line table shaped like a busy node's: overlay roots, secrets and projected
/// volumes with escaped names, a few network file systems.
fn big_mountinfo(extra: &[PathBuf]) -> String {
    let base = 2000 - 1 - extra.len();
    let mut s = mountinfo_table::busy_node_mountinfo(base);
    for (id, p) in (100 + base..).zip(extra) {
        let _ = writeln!(
            s,
            "{id} 28 0:{id} / {} rw,relatime - nfs4 nfs1:/export/{id} rw,vers=4.2",
            p.display()
        );
    }
    s
}

fn bench(c: &mut Criterion) {
    let table = big_mountinfo(&[]);
    assert_eq!(table.lines().count(), 2000);
    c.bench_function("mountinfo_parse_2000_lines", |b| {
        b.iter(|| MountTable::parse(black_box(&table)))
    });

    let dirs: Vec<tempfile::TempDir> = (0..20).map(|_| tempfile::tempdir().unwrap()).collect();
    let paths: Vec<PathBuf> = dirs.iter().map(|d| d.path().to_owned()).collect();
    let proc = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(proc.path().join("self")).unwrap();
    std::fs::write(proc.path().join("self/mountinfo"), big_mountinfo(&paths)).unwrap();
    let sys = tempfile::tempdir().unwrap();
    let roots = Roots::new(sys.path(), proc.path());
    let mut prober = StorageProber::new(StorageConfig {
        required: paths
            .iter()
            .map(|p| MountSpec {
                path: p.clone(),
                fstype: Some("nfs4".into()),
                writable: true,
                min_free_percent: 1.0,
            })
            .collect(),
        ..StorageConfig::default()
    });
    let r = prober.probe(&roots);
    assert!(r.all_ok(), "{:#?}", r.mounts);
    assert_eq!(r.mounts.len(), 20);
    c.bench_function("storage_probe_20_healthy_mounts", |b| {
        b.iter(|| black_box(prober.probe(&roots)))
    });

    // 10,000 Lustre entries (`all_lustre`, the default) took 7.7 s per probe when
    // mounts were de-duplicated pairwise. The points do not exist here, so each statfs fails
    // fast with ENOENT: what is measured is the table, the de-duplication and the lookups
    // (and one statfs worker per mount).
    let proc = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(proc.path().join("self")).unwrap();
    let mut lustre = String::from(
        "28 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro\n",
    );
    for i in 0..10_000 {
        let _ = writeln!(
            lustre,
            "{} 28 0:{} / /lustre/project{i:05} rw,relatime shared:{i} - lustre 10.1.1.1@o2ib:/proj{i} rw,flock,lazystatfs",
            100 + i,
            100 + i
        );
    }
    std::fs::write(proc.path().join("self/mountinfo"), &lustre).unwrap();
    let roots = Roots::new(sys.path(), proc.path());
    let mut prober = StorageProber::new(StorageConfig::default());
    let r = prober.probe(&roots);
    assert_eq!(r.mounts.len(), 10_000);
    let mut group = c.benchmark_group("storage");
    group.sample_size(10);
    group.bench_function("storage_probe_10000_lustre_mounts", |b| {
        b.iter(|| black_box(prober.probe(&roots)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
