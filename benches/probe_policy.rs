//! One full sysfs probe + policy pass over a 12-device / 24-port node with every counter.
//! Target (issues 2 and 17): at most 2 ms median on the project's 2-core machine.
//! Run: `cargo bench --bench probe_policy`.

use criterion::{Criterion, criterion_group, criterion_main};
use fabricgate::config::Config;
use fabricgate::policy;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::hint::black_box;
use std::path::Path;

fn bench(c: &mut Criterion) {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bench-12x2");
    let roots = Roots::new(base.join("sys"), base.join("proc"));
    // As the agent does before its first probe (the kept-open budget follows the limit).
    fabricgate::server::raise_nofile();
    let config = Config::parse("rdma:\n  min_active_ports: 24\n  min_rate_gbps: 400\n")
        .expect("bench config parses");
    let mut prober = Prober::new(
        roots,
        ProbeConfig {
            verbs: VerbsMode::Off,
            ..ProbeConfig::default()
        },
    );
    // Sanity: the fixture really has 24 ports with counters, and they pass.
    let report = prober.probe();
    let ports: usize = report.rdma.devices.iter().map(|d| d.ports.len()).sum();
    assert_eq!(ports, 24);
    assert!(policy::evaluate(&report, &config).ready);

    c.bench_function("sysfs probe + policy, 12 devices / 24 ports", |b| {
        b.iter(|| {
            let report = prober.probe();
            black_box(policy::evaluate(black_box(&report), &config))
        })
    });

    // What `fabricgate run` reads on a probe that reads counters: only the counter files it
    // exports or its fallback detector needs (`fabricgate check` reads them all, as above).
    let mut prober = Prober::new(
        prober.roots().clone(),
        ProbeConfig {
            verbs: VerbsMode::Off,
            counter_names: fabricgate::metrics::counters_read(),
            ..ProbeConfig::default()
        },
    );
    let _ = prober.probe();
    c.bench_function(
        "sysfs probe + policy, 12 devices / 24 ports, the agent's counter files",
        |b| {
            b.iter(|| {
                let report = prober.probe();
                black_box(policy::evaluate(black_box(&report), &config))
            })
        },
    );

    // Counters on their own cadence (`rdma.counters_interval`): the probes between two
    // counter reads read only what the verdict needs.
    let mut prober = Prober::new(
        prober.roots().clone(),
        ProbeConfig {
            verbs: VerbsMode::Off,
            counters_interval: Some(std::time::Duration::from_secs(3600)),
            ..ProbeConfig::default()
        },
    );
    let _ = prober.probe();
    c.bench_function(
        "sysfs probe + policy, 12 devices / 24 ports, verdict attributes only",
        |b| {
            b.iter(|| {
                let report = prober.probe();
                black_box(policy::evaluate(black_box(&report), &config))
            })
        },
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
