//! One full sysfs probe + policy pass over a 12-device / 24-port node with every counter.
//! Target: at most 2 ms median on the project's 2-core machine.
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
    fabricgate::observe::server::raise_nofile();
    let config = Config::parse("rdma:\n  min_active_ports: 24\n  min_rate_gbps: 400\n")
        .expect("bench config parses");

    // Each variant probes once before timing starts (that probe opens every attribute file).
    let mut bench_probe = |name: &str, probe_config: ProbeConfig| {
        let mut prober = Prober::new(
            roots.clone(),
            ProbeConfig {
                verbs: VerbsMode::Off,
                ..probe_config
            },
        );
        // Sanity: the fixture really has 24 ports with counters, and they pass.
        let report = prober.probe();
        let ports: usize = report.rdma.devices.iter().map(|d| d.ports.len()).sum();
        assert_eq!(ports, 24);
        assert!(policy::evaluate(&report, &config).ready);
        c.bench_function(name, |b| {
            b.iter(|| {
                let report = prober.probe();
                black_box(policy::evaluate(black_box(&report), &config))
            })
        });
    };

    // Every counter file read on every probe, as `fabricgate check` does.
    bench_probe(
        "sysfs probe + policy, 12 devices / 24 ports",
        ProbeConfig::default(),
    );
    // What `fabricgate run` reads on a probe that reads counters: only the counter files it
    // exports or its fallback detector needs.
    bench_probe(
        "sysfs probe + policy, 12 devices / 24 ports, the agent's counter files",
        ProbeConfig {
            counter_names: fabricgate::observe::metrics::counters_read(),
            ..ProbeConfig::default()
        },
    );
    // Counters on their own cadence (`rdma.counters_interval`): the probes between two
    // counter reads read only what the verdict needs.
    bench_probe(
        "sysfs probe + policy, 12 devices / 24 ports, verdict attributes only",
        ProbeConfig {
            counters_interval: Some(std::time::Duration::from_secs(3600)),
            ..ProbeConfig::default()
        },
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
