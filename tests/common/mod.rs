//! Helpers shared by the metrics integration tests.

#![allow(dead_code)]

pub mod fixture;

use fabricgate::config::Config;
use fabricgate::metrics::Metrics;
use fabricgate::policy;
use fabricgate_probes::netdev::NetdevConfig;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, ProbeReport, ProbeTimings, Prober, Roots};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A committed fixture node (`tests/fixtures/<name>`, with `sys/` and `proc/`).
pub fn committed_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The requirements file that goes with the committed fixtures.
pub fn ndr_requirements() -> Config {
    Config::load(&committed_fixture("requirements-ndr.yaml")).unwrap()
}

/// Probe the node at `node` (`sys/`, `proc/`) with sysfs only, with a fixed clock and fixed
/// timings so the output is reproducible.
pub fn probe_fixture(node: &Path, timestamp: f64) -> ProbeReport {
    let config = ProbeConfig {
        verbs: VerbsMode::Off,
        netdev: NetdevConfig::default(),
        ..ProbeConfig::default()
    };
    let mut prober = Prober::new(Roots::new(node.join("sys"), node.join("proc")), config);
    let mut report = prober.probe();
    report.timestamp = timestamp;
    set_counters_timestamp(&mut report, timestamp);
    report.timings = ProbeTimings {
        rdma_sysfs_seconds: 0.0042,
        rdma_verbs_seconds: 0.0,
        storage_seconds: 0.0007,
        netdev_seconds: 0.0001,
    };
    report
}

/// Pretend every port's counters were read at `timestamp` (the fixed clock of a test).
pub fn set_counters_timestamp(report: &mut ProbeReport, timestamp: f64) {
    for port in report
        .rdma
        .devices
        .iter_mut()
        .flat_map(|d| d.ports.iter_mut())
    {
        port.counters_timestamp = Some(timestamp);
    }
}

/// Record one probe of the fixture into `metrics`.
pub fn record_fixture(metrics: &Metrics, node: &Path, config: &Config, timestamp: f64) {
    let report = probe_fixture(node, timestamp);
    let verdict = policy::evaluate(&report, config);
    metrics.record_probe(&report, &verdict);
}

/// A plain HTTP/1.1 GET; returns (status, headers lower-cased, body).
pub fn http_get(addr: &str, path: &str, accept: Option<&str>) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// Whether a tool is installed; outside CI a missing tool skips the test (with a reason),
/// in CI it is a failure.
pub fn have_tool(tool: &str) -> bool {
    let found = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{tool} is not installed; .ci/metrics.sh installs it"
        );
        eprintln!("SKIP: {tool} not installed (apt-get install prometheus)");
    }
    found
}

/// Sample value of the exposition line that starts with `series ` (exact name and labels).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
}
