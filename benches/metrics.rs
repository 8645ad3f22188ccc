//! Encoding `/metrics` for a 12-device/24-port node (tests/fixtures/bench-12x2; target: under
//! 1 ms median), recording one probe into the registry, and what a scrape between two probes
//! costs now that the exposition is encoded once per probe (src/observe/exposition.rs).
//!
//! `cargo bench --bench metrics`

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate::config::Config;
use fabricgate::observe::metrics::Metrics;
use fabricgate::policy;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let node = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bench-12x2");
    let config = Config::default();
    let mut prober = Prober::new(
        Roots::new(node.join("sys"), node.join("proc")),
        ProbeConfig {
            verbs: VerbsMode::Off,
            ..ProbeConfig::default()
        },
    );
    let report = prober.probe();
    let ports: usize = report.rdma.devices.iter().map(|d| d.ports.len()).sum();
    assert_eq!((report.rdma.devices.len(), ports), (12, 24));
    let verdict = policy::evaluate(&report, &config);
    let metrics = Metrics::with_config(&config);
    metrics.record_probe(&report, &verdict);

    c.bench_function("encode_prometheus_text_12dev_24port", |b| {
        b.iter(|| black_box(metrics.encode(false)))
    });
    c.bench_function("encode_openmetrics_12dev_24port", |b| {
        b.iter(|| black_box(metrics.encode(true)))
    });
    c.bench_function("serve_cached_exposition_12dev_24port", |b| {
        b.iter(|| black_box(metrics.exposition(black_box(false))))
    });
    c.bench_function("record_probe_12dev_24port", |b| {
        b.iter(|| metrics.record_probe(black_box(&report), black_box(&verdict)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
