//! The admission webhook's own cost per pod: one AdmissionReview (the recorded PyTorchJob
//! worker of tests/fixtures/admission/) parsed, mutated and answered, and an already mutated
//! pod (reinvocation: no patch). What the API server adds (TLS, its own admission chain) is
//! measured through the real API server, not here.
//!
//! `cargo bench --bench webhook`

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate::config::Config;
use fabricgate::pod::webhook::{self, MutationConfig};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/admission");
    // The configuration tests/webhook.rs mutated the stored fixture with: reinvocation
    // recognises the init container by its content.
    let yaml = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  min_rate_gbps: 400\n  \
                link_layer: InfiniBand\nlustre:\n  mounts: [/lustre/scratch]\nmounts:\n  - \
                path: /datasets\n    writable: false\n";
    let image = "registry.example.com/fabricgate:0.1.0";
    let cfg = MutationConfig::new(&Config::parse(yaml).unwrap(), yaml, image);
    let fresh = std::fs::read(dir.join("pytorchjob-worker.json")).unwrap();
    let mutated = std::fs::read(dir.join("already-mutated.json")).unwrap();
    assert!(webhook::review(&fresh, &cfg).unwrap()["response"]["patch"].is_string());

    c.bench_function("admission_review_pytorchjob_worker", |b| {
        b.iter(|| black_box(webhook::review(black_box(&fresh), &cfg)))
    });
    c.bench_function("admission_review_already_mutated", |b| {
        b.iter(|| black_box(webhook::review(black_box(&mutated), &cfg)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
