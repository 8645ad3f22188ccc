//! Probe a fixture tree N times (sysfs only) and judge each probe: the workload of
//! `benches/callgrind_probe.sh`, which counts the instructions of one probe as the difference
//! between runs with different N (start-up and the first, opening probe cancel out).
//!
//! `cargo run --release --example probe_loop -- tests/fixtures/bench-12x2 11`

use fabricgate::config::Config;
use fabricgate::policy;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::hint::black_box;
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let node = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "tests/fixtures/bench-12x2".into()),
    );
    let probes: u32 = args.next().map_or(Ok(1), |n| n.parse())?;
    // `counters`: read every counter file on every probe (as `check` does); `agent`: only the
    // counter files `fabricgate run` reads, on every probe (its default for --interval >= 10s);
    // `verdict`: only the verdict attributes after the first probe (counters on their own
    // cadence).
    let mode = args.next().unwrap_or_else(|| "counters".into());
    let counters = mode != "verdict";
    let config = Config::parse("rdma:\n  min_active_ports: 24\n  min_rate_gbps: 400\n")?;
    // As the agent does before its first probe: the descriptor budget of kept-open
    // attribute files follows the soft limit.
    fabricgate::observe::server::raise_nofile();
    let mut prober = Prober::new(
        Roots::new(node.join("sys"), node.join("proc")),
        ProbeConfig {
            verbs: VerbsMode::Off,
            counters_interval: (!counters).then(|| std::time::Duration::from_secs(3600)),
            counter_names: if mode == "agent" {
                fabricgate::observe::metrics::counters_read()
            } else {
                Default::default()
            },
            ..ProbeConfig::default()
        },
    );
    let mut ready = 0;
    for _ in 0..probes {
        let report = prober.probe();
        ready += u32::from(black_box(policy::evaluate(&report, &config)).ready);
    }
    println!("{ready}/{probes} probes ready");
    Ok(())
}
