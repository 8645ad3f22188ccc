//! For the metrics tests (and any test reading an HTTP endpoint): probing fixture nodes with a
//! fixed clock, plain HTTP, reading samples out of an exposition.

use fabricgate::config::Config;
use fabricgate::config::FeatureSection;
use fabricgate::dra::metrics::DraMetrics;
use fabricgate::dra::settings::DraSettings;
use fabricgate::observe::metrics::Metrics;
use fabricgate::policy;
use fabricgate_probes::netdev;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, ProbeReport, ProbeTimings, Prober, Roots};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A committed fixture node (`tests/fixtures/<name>`, with `sys/` and `proc/`).
pub fn committed_fixture(name: &str) -> PathBuf {
    super::fixture(name)
}

/// The requirements file that goes with the committed fixtures.
pub fn ndr_requirements() -> Config {
    Config::load(&committed_fixture("requirements-ndr.yaml")).unwrap()
}

/// Probe the node at `node` (`sys/`, `proc/`) with sysfs only, with a fixed clock and fixed
/// timings so the output is reproducible. Only the counter files the agent reads are read, so
/// the golden expositions also prove that selection loses no exported series.
pub fn probe_fixture(node: &Path, timestamp: f64) -> ProbeReport {
    let config = ProbeConfig {
        verbs: VerbsMode::Off,
        collectors: fabricgate::checks::registered().collectors(&Config::default()),
        counter_names: fabricgate::observe::metrics::counters_read(),
        ..ProbeConfig::default()
    };
    let mut prober = Prober::new(Roots::new(node.join("sys"), node.join("proc")), config);
    let mut report = prober.probe();
    report.timestamp = timestamp;
    set_counters_timestamp(&mut report, timestamp);
    report.timings = ProbeTimings {
        rdma_sysfs_seconds: 0.0042,
        rdma_verbs_seconds: 0.0,
        collected: [
            ("storage_seconds".to_owned(), 0.0007),
            ("netdev_seconds".to_owned(), 0.0001),
            ("gpudirect_seconds".to_owned(), 0.0003),
        ]
        .into(),
    };
    report
}

/// An unhealthy node: the `ndr-port-down` fixture (mlx5_3 DOWN), a hung required Lustre
/// mount, a failed self-test on mlx5_0 and a passing one on mlx5_1, and over one fallback
/// window 200 MB/s of TCP per physical interface while the RDMA counters stand still; DRA
/// with mlx5_3 under a DeviceTaintRule and mlx5_10 (not in the fixture) in a pod's claim.
pub fn unhealthy_metrics() -> Metrics {
    use fabricgate_probes::rdma::SelftestResult;
    use fabricgate_probes::storage::MountStatus;
    let mut config = ndr_requirements();
    config.lustre.mounts = vec!["/lustre/scratch".into()];
    config.runtime = fabricgate::config::Section::holding(
        "runtime",
        &fabricgate::transport::settings::RuntimeSettings {
            enabled: true,
            ..Default::default()
        },
    )
    .unwrap();
    config.kubernetes.dra = Config::parse(
        "kubernetes:\n  dra:\n    drivers: [{name: dra.net}, {name: rdma.example.com}]\n",
    )
    .unwrap()
    .kubernetes
    .dra;
    let (metrics, pods) = Metrics::with_config_and(&config, |live| {
        Some(fabricgate::transport::metrics::PodMetrics::register(live))
    });
    let dra_settings = DraSettings::of(&config).unwrap();
    let (metrics, dra) = metrics.with_families(|r| DraMetrics::register(r, &dra_settings));
    let metrics = fabricgate::checks::registered().metrics(metrics, &config);
    let node = committed_fixture("ndr-port-down");
    let t0 = 1_700_000_000.0;
    let window = config.fallback.window.as_secs();
    for (i, t) in [(0, t0), (1, t0 + window as f64)] {
        let mut report = probe_fixture(&node, t);
        let mut netdevs = netdev::reports(&report).to_vec();
        for nd in &mut netdevs {
            nd.rx_bytes = nd.rx_bytes.map(|b| b + i * 200_000_000 * window);
        }
        netdev::set_reports(&mut report, netdevs);
        let mut hung = mount_report("/lustre/scratch", MountStatus::Hung, None, None);
        hung.message = "statfs started 5s ago has still not returned".into();
        edit_storage(&mut report, |s| s.mounts.push(hung));
        let devices = &mut report.rdma.devices;
        devices[0].ports[0].selftest = Some(SelftestResult {
            ok: false,
            failed_step: Some("reg_mr".into()),
            errno: Some(12),
            message: Some("reg_mr: errno 12 (ENOMEM): RLIMIT_MEMLOCK too low".into()),
            duration_us: Some(310.0),
            ..SelftestResult::default()
        });
        devices[1].ports[0].selftest = Some(SelftestResult {
            ok: true,
            latency_us: Some(2108.0),
            gid_index: None,
            duration_us: Some(5400.0),
            ..SelftestResult::default()
        });
        let verdict =
            policy::evaluate_checked(&report, &config, &fabricgate::checks::registered().checks());
        metrics.record_probe(&report, &verdict);
    }
    // A DRA node: the bad HCA kept off new claims by a DeviceTaintRule, and an eleventh HCA
    // moved into a training pod's network namespace by its claim.
    let tainted = [policy::devices::DeviceTaint {
        driver: "dra.net".into(),
        pool: "gpu-b".into(),
        device: "pci-0000-8a-00-0".into(),
        hca: "mlx5_3".into(),
        reason: "PortDown".into(),
        message: "mlx5_3 port 1 is DOWN".into(),
    }];
    let in_use = [fabricgate::dra::assess::InUseHca {
        hca: "mlx5_10".into(),
        claim: "train/worker-0-rdma".into(),
    }];
    let drivers = [("dra.net".into(), true), ("rdma.example.com".into(), false)];
    dra.set(&metrics, &drivers, &in_use, &tainted);
    dra.set_rules_writable(&metrics, true);
    record_pods(
        pods.as_ref()
            .expect("runtime.enabled registers the pod families"),
    );
    metrics
}

/// Runtime transport on the unhealthy node: one Job's pod on RDMA (two RC QPs in RTS on
/// mlx5_0/1, the Job's own port, which carried 12 GB out and 11 GB in over the window; and
/// mlx5_1/1, shared with another Job), another Job's pod on sockets (41 GB over TCP to other
/// nodes in the window).
fn record_pods(pods: &fabricgate::transport::metrics::PodMetrics) {
    use fabricgate::transport::metrics::PodSample;
    use fabricgate::transport::verdict::{self, PodVerdict, Transport};
    use fabricgate_probes::transport::restrack::{QpEntry, QpOwner, QpState, QpType};
    let qp = |lqpn| QpEntry {
        device_index: 0,
        device: "mlx5_0".into(),
        port: Some(1),
        lqpn,
        rqpn: Some(lqpn + 100),
        qp_type: QpType::Rc,
        state: QpState::Rts,
        owner: QpOwner::Pid(4242),
        pdn: Some(1),
    };
    let qps = [qp(17), qp(18)];
    let rdma = PodVerdict {
        transport: Transport::Rdma,
        reason: verdict::REASON_RDMA,
        why: "2 data-path QPs in RTS on mlx5_0/1".into(),
        data_path_qps: Some(2),
        internode_tcp_bytes: Some(1_000_000),
        other_tcp_bytes: Some(0),
        rdma_bytes: Some(23_000_000_000),
        clears: false,
    };
    let sockets = PodVerdict {
        transport: Transport::Sockets,
        reason: verdict::REASON_SOCKETS,
        why: "0 data-path QPs; 41.0 GB over TCP with 7 peers in 30 s via ib0; 2.0 GB with \
              addresses outside its job"
            .into(),
        data_path_qps: Some(0),
        internode_tcp_bytes: Some(41_000_000_000),
        other_tcp_bytes: Some(2_000_000_000),
        rdma_bytes: None,
        clears: false,
    };
    pods.record(&[
        PodSample {
            namespace: "ml",
            pod: "llm-0",
            owner: Some(("Job", "llm")),
            verdict: &rdma,
            qps: Some(&qps),
        },
        PodSample {
            namespace: "ml",
            pod: "bert-0",
            owner: Some(("Job", "bert")),
            verdict: &sockets,
            qps: Some(&[]),
        },
    ]);
    use fabricgate::transport::bandwidth::{JobId, PortShare};
    use fabricgate_probes::transport::ports::PortCounter;
    let job = |name: &str| JobId {
        namespace: "ml".into(),
        job: name.into(),
    };
    let port = |device: &str, jobs: Vec<JobId>, tx, rx| PortShare {
        device: device.into(),
        port: 1,
        jobs,
        others: Vec::new(),
        counter: PortCounter::DataWords,
        transmit_bytes: Some(tx),
        receive_bytes: Some(rx),
        unseen: None,
    };
    pods.record_ports(&[
        port(
            "mlx5_0",
            vec![job("Job/llm")],
            12_000_000_000,
            11_000_000_000,
        ),
        port(
            "mlx5_1",
            vec![job("Job/eval"), job("Job/llm")],
            1_000_000,
            1_000_000,
        ),
    ]);
}

/// A required Lustre mount of `/lustre/scratch`'s file system in the given state.
pub fn mount_report(
    path: &str,
    status: fabricgate_probes::storage::MountStatus,
    statfs_seconds: Option<f64>,
    capacity: Option<fabricgate_probes::storage::Capacity>,
) -> fabricgate_probes::storage::MountReport {
    fabricgate_probes::storage::MountReport {
        path: path.into(),
        fstype: Some("lustre".into()),
        status,
        message: String::new(),
        required: true,
        expected_fstype: Some("lustre".into()),
        source: Some("10.1.1.1@o2ib:/scratch".into()),
        lustre_fsname: Some("scratch".into()),
        read_only: Some(false),
        fs_magic: None,
        capacity,
        statfs_seconds,
    }
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

/// What the agent judges: the report against `config`, with every registered subsystem.
pub fn evaluate(report: &ProbeReport, config: &Config) -> fabricgate::policy::Verdict {
    policy::evaluate_checked(report, config, &fabricgate::checks::registered().checks())
}

/// The verdict's shared-storage part (`lustre`, the storage subsystem's).
pub fn lustre(v: &fabricgate::policy::Verdict) -> &fabricgate::policy::PartVerdict {
    &v.checks
        .get(fabricgate::policy::LUSTRE)
        .expect("the storage subsystem is registered")
        .part
}

/// What the storage probe found (it ran: the prober had the registered collectors).
pub fn storage_of(report: &ProbeReport) -> &fabricgate_probes::storage::StorageReport {
    fabricgate_probes::storage::of(report).expect("the storage collector ran")
}

/// Change the report's storage as the storage probe would have found it.
pub fn edit_storage(
    report: &mut ProbeReport,
    change: impl FnOnce(&mut fabricgate_probes::storage::StorageReport),
) {
    use fabricgate_probes::storage;
    let mut found = storage::of(report).cloned().unwrap_or_default();
    change(&mut found);
    storage::set(report, found);
}

/// The agent's metrics: the built-in families and every registered subsystem's.
pub fn agent_metrics(config: &Config) -> Metrics {
    fabricgate::checks::registered().metrics(Metrics::with_config(config), config)
}

/// Record one probe of the fixture into `metrics`.
pub fn record_fixture(metrics: &Metrics, node: &Path, config: &Config, timestamp: f64) {
    let report = probe_fixture(node, timestamp);
    let verdict =
        policy::evaluate_checked(&report, config, &fabricgate::checks::registered().checks());
    metrics.record_probe(&report, &verdict);
}

/// A plain HTTP/1.1 GET; returns (status, headers lower-cased, body). The test fails when the
/// server does not answer within 30 s.
pub fn http_get(addr: &str, path: &str, accept: Option<&str>) -> (u16, String, String) {
    try_http_get(addr, path, accept, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("GET http://{addr}{path}: no answer"))
}

/// [`http_get`], `None` when the server refuses the connection or does not answer a connect,
/// a write or a read within `budget` (an agent that is not up yet, or a starved one).
pub fn try_http_get(
    addr: &str,
    path: &str,
    accept: Option<&str>,
    budget: Duration,
) -> Option<(u16, String, String)> {
    let sock = addr.to_socket_addrs().ok()?.next()?;
    let mut s = TcpStream::connect_timeout(&sock, budget).ok()?;
    s.set_read_timeout(Some(budget)).ok()?;
    s.set_write_timeout(Some(budget)).ok()?;
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Some((status, head, body))
}

/// The payload of a `Transfer-Encoding: chunked` body (Prometheus answers large queries so).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Sample value of the exposition line that starts with `series ` (exact name and labels).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
}
