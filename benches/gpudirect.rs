//! Probe-time cost of the GPUDirect topology walk on the DGX-like fixture (8 GPUs, 8 RoCE
//! HCAs behind 4 PCIe switch complexes, 2 sockets): listing `bus/pci/devices` for GPUs,
//! resolving every GPU and HCA path, pairing them, reading the ACS capability of the bridges
//! on each pair's path, the peer-memory files and each port's MTU and ECN switches.
//! Run: `cargo bench --bench gpudirect` (the figure is in docs/gpudirect.md).

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate::config::Config;
use fabricgate::policy;
use fabricgate_probes::gpudirect::{self, GpudirectConfig};
use fabricgate_probes::rdma::{self, VerbsMode};
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dgx-healthy");
    let roots = Roots::new(base.join("sys"), base.join("proc"));
    let config = Config::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/requirements-dgx.yaml"),
    )
    .expect("bench config loads");
    let rdma = rdma::sysfs::probe(&roots);
    let gd_config = GpudirectConfig {
        hca_devices: Some(config.rdma.devices.as_str().to_owned()),
    };
    // Sanity: the walk finds the fixture's 8 pairs with every ACS register read.
    let report = gpudirect::probe(&roots, &gd_config, &rdma);
    assert_eq!(report.pairs.len(), 8);
    assert!(report.pairs.iter().all(|p| p.bridges.len() == 3));

    let mut group = c.benchmark_group("gpudirect");
    group
        .sample_size(50)
        .measurement_time(Duration::from_secs(5));
    group.bench_function(
        "topology walk + ACS + peer memory + transport, 8 GPUs / 8 HCAs",
        |b| b.iter(|| black_box(gpudirect::probe(&roots, &gd_config, black_box(&rdma)))),
    );

    // As the agent probes and judges: with the registered subsystems (GPUDirect among them).
    let registered = fabricgate::checks::registered();
    let checks = registered.checks();
    let mut prober = Prober::new(
        roots.clone(),
        ProbeConfig {
            verbs: VerbsMode::Off,
            collectors: registered.collectors(&config),
            ..ProbeConfig::default()
        },
    );
    let first = prober.probe();
    assert_eq!(gpudirect::of(&first).map(|g| g.pairs.len()), Some(8));
    assert!(policy::evaluate_checked(&first, &config, &checks).ready);
    group.bench_function("whole probe + policy, DGX-like node", |b| {
        b.iter(|| {
            let report = prober.probe();
            black_box(policy::evaluate_checked(
                black_box(&report),
                &config,
                &checks,
            ))
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
