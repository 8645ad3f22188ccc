//! `/metrics` over a fixture node: golden files, the HTTP endpoints, `promtool check metrics`,
//! counters that never go backwards, and the fallback gauge.

use crate::common;

use common::fixture::{Shape, write_node};
use common::{
    committed_fixture, have_tool, http_get, mount_report, ndr_requirements, probe_fixture,
    record_fixture, sample, unhealthy_metrics,
};
use fabricgate::config::Config;
use fabricgate::observe::metrics::{self, Metrics};
use fabricgate::policy;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Compare with the golden file; `UPDATE_GOLDEN=1` rewrites it instead (refused under CI).
pub(crate) fn check_golden(name: &str, got: &str) {
    let path = golden_dir().join(name);
    if common::update_golden() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; run with UPDATE_GOLDEN=1", path.display()));
    if want != got {
        for (i, (w, g)) in want.lines().zip(got.lines()).enumerate() {
            assert_eq!(
                w,
                g,
                "{name} line {} differs (UPDATE_GOLDEN=1 to accept)",
                i + 1
            );
        }
        panic!(
            "{name}: {} lines expected, {} got (UPDATE_GOLDEN=1 to accept)",
            want.lines().count(),
            got.lines().count()
        );
    }
}

/// The example GPU node (8 x NDR InfiniBand + 2 RoCE storage ports) and its requirements.
fn fixture_metrics() -> Metrics {
    let config = ndr_requirements();
    let metrics = common::agent_metrics(&config);
    record_fixture(
        &metrics,
        &committed_fixture("ndr-8x400-healthy"),
        &config,
        1_700_000_000.0,
    );
    metrics
}

fn small_node_metrics() -> (tempfile::TempDir, Metrics) {
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    let metrics = common::agent_metrics(&Config::default());
    record_fixture(&metrics, tmp.path(), &Config::default(), 1_700_000_000.0);
    (tmp, metrics)
}

#[test]
fn golden_prometheus_text_and_openmetrics() {
    let metrics = fixture_metrics();
    let text = metrics.encode(false);
    let om = metrics.encode(true);
    check_golden("metrics.prom", &text);
    check_golden("metrics.openmetrics", &om);
    // What /metrics serves (cached, live families spliced in) is the same bytes.
    let served = |openmetrics| String::from_utf8(metrics.exposition(openmetrics).to_vec());
    assert_eq!(served(false).unwrap(), text);
    assert_eq!(served(true).unwrap(), om);
}

/// The cached exposition (src/observe/exposition.rs) is encoded once per change and per format, and
/// is at every moment what a fresh encoding gives: after a probe, a node write, an agent
/// error, and a change of the families set without the state lock (HTTP connections).
#[test]
fn served_exposition_is_encoded_once_per_change_and_always_fresh() {
    use fabricgate::observe::server::{Admission, ServerObserver};
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    let metrics = Metrics::new();
    let same = |openmetrics: bool| {
        let served = metrics.exposition(openmetrics);
        let fresh = metrics.encode(openmetrics);
        assert_eq!(String::from_utf8(served.to_vec()).unwrap(), fresh);
        served
    };
    record_fixture(&metrics, tmp.path(), &Config::default(), 1.0);
    let first = same(false);
    let encodes = metrics.exposition_encodes();
    // Nothing changed: the same buffer, no encoding.
    for _ in 0..5 {
        let again = metrics.exposition(false);
        assert_eq!(
            again.as_ptr(),
            first.as_ptr(),
            "a new buffer for an unchanged registry"
        );
    }
    assert_eq!(metrics.exposition_encodes(), encodes);
    // The other format is encoded once, on its first scrape.
    same(true);
    same(true);
    assert_eq!(metrics.exposition_encodes(), encodes + 1);

    // A connection (set without the state lock) is spliced in, no full encoding.
    metrics.connection(Admission::Evicted, 7);
    let t = String::from_utf8(same(false).to_vec()).unwrap();
    assert_eq!(sample(&t, "fabricgate_http_connections"), Some(7.0));
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_http_connections_dropped_total{why="evicted"}"#
        ),
        Some(1.0)
    );
    assert_eq!(metrics.exposition_encodes(), encodes + 1);

    // Changes under the state lock: encoded again.
    metrics.record_node_write("taint");
    let t = String::from_utf8(same(false).to_vec()).unwrap();
    assert_eq!(
        sample(&t, r#"fabricgate_node_writes_total{kind="taint"}"#),
        Some(1.0)
    );
    metrics.set_agent_error(Some("disk full"));
    let t = String::from_utf8(same(false).to_vec()).unwrap();
    assert_eq!(sample(&t, "fabricgate_agent_error"), Some(1.0));
    write_node(tmp.path(), Shape::SMALL, 5);
    record_fixture(&metrics, tmp.path(), &Config::default(), 2.0);
    let t = String::from_utf8(same(false).to_vec()).unwrap();
    assert_eq!(
        sample(&t, "fabricgate_last_probe_timestamp_seconds"),
        Some(2.0)
    );
    same(true);
    assert_eq!(metrics.exposition_encodes(), encodes + 5);

    // The peers' families are recorded by their own thread, without the state lock.
    let config = Config::parse("peers:\n  enabled: true\n").unwrap();
    let metrics = Metrics::with_config(&config);
    let before = String::from_utf8(metrics.exposition(false).to_vec()).unwrap();
    assert_eq!(sample(&before, "fabricgate_peer_required_met"), None);
    let encodes = metrics.exposition_encodes();
    metrics.peers.as_ref().unwrap().set_required(Some(true));
    let served = String::from_utf8(metrics.exposition(false).to_vec()).unwrap();
    assert_eq!(served, metrics.encode(false));
    assert_eq!(sample(&served, "fabricgate_peer_required_met"), Some(1.0));
    assert_eq!(metrics.exposition_encodes(), encodes);
}

/// The series of an unhealthy node are pinned too, not only those of a healthy one.
#[test]
fn golden_unhealthy_node() {
    let metrics = unhealthy_metrics();
    let text = metrics.encode(false);
    for (series, want) in [
        ("fabricgate_node_ready", 0.0),
        ("fabricgate_rdma_ready", 0.0),
        ("fabricgate_lustre_ready", 0.0),
        (r#"fabricgate_rdma_port_up{device="mlx5_3",port="1"}"#, 0.0),
        (
            r#"fabricgate_rdma_port_state{device="mlx5_3",port="1"}"#,
            1.0,
        ),
        (r#"fabricgate_mount_hung{mount="/lustre/scratch"}"#, 1.0),
        (r#"fabricgate_mount_up{mount="/lustre/scratch"}"#, 0.0),
        ("fabricgate_fallback_suspected", 1.0),
        (
            r#"fabricgate_rdma_selftest_ok{device="mlx5_0",port="1"}"#,
            0.0,
        ),
        (
            r#"fabricgate_rdma_selftest_ok{device="mlx5_1",port="1"}"#,
            1.0,
        ),
        (
            r#"fabricgate_rdma_selftest_latency_seconds{device="mlx5_1",port="1"}"#,
            0.002108,
        ),
        (
            r#"fabricgate_findings{scope="lustre",reason="MountHung"}"#,
            1.0,
        ),
        (r#"fabricgate_dra_devices_tainted{reason="PortDown"}"#, 1.0),
        (r#"fabricgate_dra_driver_up{driver="dra.net"}"#, 1.0),
        (
            r#"fabricgate_dra_driver_up{driver="rdma.example.com"}"#,
            0.0,
        ),
        ("fabricgate_dra_device_rules_writable", 1.0),
    ] {
        assert_eq!(sample(&text, series), Some(want), "{series}\n{text}");
    }
    assert!(
        text.contains(r#"fabricgate_findings{scope="rdma",reason="PortDown"}"#),
        "{text}"
    );
    assert!(
        sample(&text, "fabricgate_fallback_tcp_bytes_per_second").is_some_and(|r| r >= 1e8),
        "{text}"
    );
    check_golden("metrics-unhealthy.prom", &text);
    check_golden("metrics-unhealthy.openmetrics", &metrics.encode(true));
}

#[test]
fn fixture_values_arrive_under_the_issue_names() {
    let (_tmp, metrics) = small_node_metrics();
    let t = metrics.encode(false);
    assert_eq!(sample(&t, "fabricgate_node_ready"), Some(1.0), "{t}");
    assert_eq!(sample(&t, "fabricgate_rdma_ready"), Some(1.0));
    assert_eq!(sample(&t, "fabricgate_lustre_ready"), Some(1.0));
    let p = r#"{device="mlx5_0",port="1"}"#;
    assert_eq!(
        sample(&t, &format!("fabricgate_rdma_port_state{p}")),
        Some(4.0)
    );
    assert_eq!(
        sample(&t, &format!("fabricgate_rdma_port_phys_state{p}")),
        Some(5.0)
    );
    assert_eq!(
        sample(&t, &format!("fabricgate_rdma_port_rate_gbps{p}")),
        Some(400.0)
    );
    assert_eq!(
        sample(&t, &format!("fabricgate_rdma_port_up{p}")),
        Some(1.0)
    );
    // port_xmit_data is in 4-octet words: 1_000_000 * seed(1) words = 4 MB.
    assert_eq!(
        sample(&t, &format!("fabricgate_rdma_port_transmit_bytes_total{p}")),
        Some(4_000_000.0)
    );
    assert_eq!(
        sample(&t, &format!("fabricgate_rdma_port_receive_bytes_total{p}")),
        Some(8_000_000.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_errors_total{device="mlx5_0",port="1",counter="link_downed"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_hw_events_total{device="mlx5_2",port="1",counter="np_cnp_sent"}"#
        ),
        Some(840.0)
    );
    assert!(
        !t.contains(r#"fabricgate_rdma_port_hw_events_total{device="mlx5_0""#),
        "an IB port without hw_counters has no hw series (absent, not 0)"
    );
    assert!(
        !t.contains("rx_write_requests"),
        "hw_counters outside the list stay out"
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_info{device="mlx5_2",port="1",link_layer="Ethernet",netdev="ens3f0np0"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_netdev_receive_bytes_total{device="eth0"}"#
        ),
        Some(7_000_000.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_netdev_transmit_bytes_total{device="ens3f0np0"}"#
        ),
        Some(3_000_000.0)
    );
    assert!(
        !t.contains(r#"device="lo""#),
        "virtual interfaces are not read in auto mode"
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_probe_duration_seconds_count{probe="rdma_sysfs"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_probe_duration_seconds_bucket{probe="rdma_sysfs",le="0.005"}"#
        ),
        Some(1.0)
    );
    assert!(
        !t.contains(r#"fabricgate_probe_duration_seconds_count{probe="rdma_verbs"}"#),
        "verbs off: no verbs timing"
    );
    assert_eq!(
        sample(&t, r#"fabricgate_probe_errors_total{probe="rdma_sysfs"}"#),
        Some(0.0)
    );
    assert_eq!(
        sample(&t, "fabricgate_last_probe_timestamp_seconds"),
        Some(1.7e9)
    );
    assert_eq!(
        sample(&t, r#"fabricgate_node_writes_total{kind="labels"}"#),
        Some(0.0)
    );
    assert_eq!(sample(&t, "fabricgate_fallback_suspected"), Some(0.0));
    assert!(t.contains("fabricgate_build_info{version=\""));
}

#[test]
fn not_ready_node_exports_its_findings_and_down_port() {
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    std::fs::write(
        tmp.path().join("sys/class/infiniband/mlx5_1/ports/1/state"),
        "2: INIT\n",
    )
    .unwrap();
    let config = Config::parse("rdma:\n  min_active_ports: 3\n").unwrap();
    let metrics = Metrics::with_config(&config);
    record_fixture(&metrics, tmp.path(), &config, 1.0);
    let t = metrics.encode(false);
    assert_eq!(sample(&t, "fabricgate_node_ready"), Some(0.0));
    assert_eq!(sample(&t, "fabricgate_rdma_ready"), Some(0.0));
    assert_eq!(
        sample(&t, r#"fabricgate_rdma_port_up{device="mlx5_1",port="1"}"#),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_state{device="mlx5_1",port="1"}"#
        ),
        Some(2.0)
    );
    assert!(
        t.lines()
            .any(|l| l.starts_with(r#"fabricgate_findings{scope="rdma",reason=""#)),
        "{t}"
    );
}

#[test]
fn counters_never_go_backwards_across_a_kernel_reset() {
    let tmp = tempfile::tempdir().unwrap();
    let config = Config::default();
    let metrics = common::agent_metrics(&config);
    let series = r#"fabricgate_rdma_port_transmit_bytes_total{device="mlx5_0",port="1"}"#;
    let netdev = r#"fabricgate_netdev_receive_bytes_total{device="eth0"}"#;
    let mut last = (0.0, 0.0);
    // Traffic, then a driver reload (counters restart low), then traffic again.
    for (i, tick) in [5u64, 9, 1, 3].into_iter().enumerate() {
        write_node(tmp.path(), Shape::SMALL, tick);
        record_fixture(&metrics, tmp.path(), &config, 100.0 + i as f64);
        let t = metrics.encode(false);
        let now = (sample(&t, series).unwrap(), sample(&t, netdev).unwrap());
        assert!(
            now.0 >= last.0 && now.1 >= last.1,
            "went backwards: {last:?} -> {now:?}"
        );
        last = now;
    }
    // 9 ticks before the reset, plus 1 (the restart) and 2 more after it.
    assert_eq!(last.0, 4_000_000.0 * 12.0);
    assert_eq!(last.1, 7_000_000.0 * 12.0);
}

#[test]
fn vanished_port_leaves_gauges_but_keeps_counters_monotonic() {
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 2);
    let metrics = Metrics::new();
    let config = Config::default();
    record_fixture(&metrics, tmp.path(), &config, 1.0);
    std::fs::remove_file(tmp.path().join("sys/class/infiniband/mlx5_1")).unwrap();
    record_fixture(&metrics, tmp.path(), &config, 2.0);
    let t = metrics.encode(false);
    assert_eq!(
        sample(&t, r#"fabricgate_rdma_port_up{device="mlx5_1",port="1"}"#),
        None
    );
    assert!(
        sample(
            &t,
            r#"fabricgate_rdma_port_transmit_bytes_total{device="mlx5_1",port="1"}"#
        )
        .is_some()
    );
}

#[test]
fn fallback_gauge_rises_when_tcp_is_busy_and_rdma_idle() {
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    let config = Config::parse("fallback:\n  window: 60s\n").unwrap();
    let metrics = Metrics::with_config(&config);
    let mut report = probe_fixture(tmp.path(), 0.0);
    for i in 0..=12u64 {
        report.timestamp = 10.0 * i as f64;
        common::set_counters_timestamp(&mut report, 10.0 * i as f64);
        // RDMA counters frozen (but read on every probe); eth0 moves 2 GB every 10 s.
        let mut netdevs = fabricgate_probes::netdev::reports(&report).to_vec();
        netdevs
            .iter_mut()
            .find(|n| n.name == "eth0")
            .unwrap()
            .rx_bytes = Some(2_000_000_000 * i);
        fabricgate_probes::netdev::set_reports(&mut report, netdevs);
        let verdict = policy::evaluate(&report, &config);
        metrics.record_probe(&report, &verdict);
    }
    let t = metrics.encode(false);
    assert_eq!(
        sample(&t, "fabricgate_fallback_suspected"),
        Some(1.0),
        "{t}"
    );
    assert_eq!(
        sample(&t, "fabricgate_fallback_tcp_bytes_per_second"),
        Some(2e8)
    );
    assert_eq!(
        sample(&t, "fabricgate_fallback_rdma_bytes_per_second"),
        Some(0.0)
    );
    assert!(metrics.fallback_status().suspected);
}

#[test]
fn node_writes_are_counted_by_kind() {
    let metrics = Metrics::new();
    metrics.record_node_write("labels");
    metrics.record_node_write("labels");
    metrics.record_node_write("taint");
    let t = metrics.encode(false);
    assert_eq!(
        sample(&t, r#"fabricgate_node_writes_total{kind="labels"}"#),
        Some(2.0)
    );
    assert_eq!(
        sample(&t, r#"fabricgate_node_writes_total{kind="taint"}"#),
        Some(1.0)
    );
    assert_eq!(
        sample(&t, r#"fabricgate_node_writes_total{kind="event"}"#),
        Some(0.0)
    );
}

pub(crate) fn promtool_check(text: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && msg.trim().is_empty(), msg)
}

#[test]
fn promtool_check_metrics_passes_on_served_output() {
    if !have_tool("promtool") {
        return;
    }
    let metrics = Arc::new(fixture_metrics());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, stop) = start_server(&rt, metrics);
    let (_, _, text) = http_get(&addr, "/metrics", None);
    let (ok, msg) = promtool_check(&text);
    assert!(
        ok,
        "promtool check metrics (Prometheus text): {msg}\n{text}"
    );
    // promtool 2.x parses only the classic format; the OpenMetrics output is parsed by a real
    // Prometheus server in tests/metrics/prometheus_server.rs (it asks for OpenMetrics first).
    let (_, _, forced) = http_get(
        &addr,
        "/metrics?format=prometheus",
        Some("application/openmetrics-text"),
    );
    assert_eq!(
        forced, text,
        "?format=prometheus overrides the Accept header"
    );
    // A broken exposition must fail, or the checks above prove nothing.
    let (ok, _) = promtool_check("# TYPE x counter\nx_total{a=\"b\"} 1\nx_total{a=\"b\"} 1\n");
    assert!(!ok);
    let _ = stop.send(());
}

fn start_server(
    rt: &tokio::runtime::Runtime,
    metrics: Arc<Metrics>,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(metrics::serve(listener, metrics, async {
        let _ = rx.await;
    }));
    (addr, tx)
}

#[test]
fn http_endpoints_negotiate_format_and_report_readiness() {
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    let metrics = Arc::new(Metrics::new());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, stop) = start_server(&rt, metrics.clone());

    assert_eq!(http_get(&addr, "/healthz", None).0, 200);
    let (status, _, body) = http_get(&addr, "/readyz", None);
    assert_eq!(status, 503, "{body}");
    record_fixture(&metrics, tmp.path(), &Config::default(), 5.0);
    assert_eq!(http_get(&addr, "/readyz", None).0, 200);

    let (status, head, body) = http_get(&addr, "/metrics", None);
    assert_eq!(status, 200);
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(!body.contains("# EOF"));
    assert!(body.contains("# TYPE fabricgate_rdma_port_transmit_bytes_total counter"));

    let prom2 = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
    let (status, head, body) = http_get(&addr, "/metrics", Some(prom2));
    assert_eq!(status, 200);
    assert!(
        head.contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"));
    assert!(body.contains("# TYPE fabricgate_rdma_port_transmit_bytes counter"));
    assert!(body.contains("# UNIT fabricgate_rdma_port_transmit_bytes bytes"));

    assert_eq!(http_get(&addr, "/nope", None).0, 404);
    stop.send(()).unwrap();
}

#[test]
fn serve_returns_when_shutdown_completes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let result = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            metrics::serve(listener, Arc::new(Metrics::new()), async {}),
        )
        .await;
        assert!(matches!(result, Ok(Ok(()))), "{result:?}");
    });
}

#[test]
fn mounts_export_up_hung_statfs_time_and_free_space() {
    use fabricgate_probes::storage::{Capacity, MountStatus};
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    let config = Config::default();
    let metrics = common::agent_metrics(&config);
    let mut report = probe_fixture(tmp.path(), 1.0);
    let mounts = vec![
        mount_report(
            "/lustre/scratch",
            MountStatus::Ok,
            Some(0.002),
            Some(Capacity {
                total_bytes: 1000,
                free_bytes: 600,
                available_bytes: 500,
                available_percent: Some(50.0),
                total_inodes: Some(100),
                free_inodes: Some(42),
                free_inodes_percent: Some(42.0),
            }),
        ),
        mount_report("/lustre/home", MountStatus::Hung, None, None),
        mount_report("/data", MountStatus::Missing, None, None),
    ];
    common::edit_storage(&mut report, |s| {
        s.mounts = mounts;
        s.errors.push("mountinfo line 7 unparsable".into());
    });
    let verdict = common::evaluate(&report, &config);
    metrics.record_probe(&report, &verdict);
    let t = metrics.encode(false);
    let m = |name: &str, mount: &str| sample(&t, &format!("{name}{{mount=\"{mount}\"}}"));
    assert_eq!(m("fabricgate_mount_up", "/lustre/scratch"), Some(1.0));
    assert_eq!(m("fabricgate_mount_hung", "/lustre/scratch"), Some(0.0));
    assert_eq!(
        m("fabricgate_mount_statfs_seconds", "/lustre/scratch"),
        Some(0.002)
    );
    assert_eq!(
        m("fabricgate_mount_free_bytes", "/lustre/scratch"),
        Some(600.0)
    );
    assert_eq!(
        m("fabricgate_mount_available_bytes", "/lustre/scratch"),
        Some(500.0)
    );
    assert_eq!(
        m("fabricgate_mount_free_inodes", "/lustre/scratch"),
        Some(42.0)
    );
    assert_eq!(m("fabricgate_mount_up", "/lustre/home"), Some(0.0));
    assert_eq!(m("fabricgate_mount_hung", "/lustre/home"), Some(1.0));
    assert_eq!(
        m("fabricgate_mount_statfs_seconds", "/lustre/home"),
        None,
        "statfs never returned: no duration, not 0"
    );
    assert_eq!(m("fabricgate_mount_free_bytes", "/lustre/home"), None);
    assert_eq!(m("fabricgate_mount_up", "/data"), Some(0.0));
    assert_eq!(m("fabricgate_mount_hung", "/data"), Some(0.0));
    assert_eq!(
        sample(&t, r#"fabricgate_probe_errors_total{probe="storage"}"#),
        Some(1.0)
    );
    // The mount vanishes from the next report: its gauges go with it.
    common::edit_storage(&mut report, |s| s.mounts.truncate(1));
    metrics.record_probe(&report, &verdict);
    let t = metrics.encode(false);
    assert_eq!(sample(&t, r#"fabricgate_mount_up{mount="/data"}"#), None);
}

#[test]
fn selftest_results_are_exported_per_port() {
    use fabricgate_probes::rdma::SelftestResult;
    let tmp = tempfile::tempdir().unwrap();
    write_node(tmp.path(), Shape::SMALL, 1);
    let config = Config::parse("rdma:\n  min_active_ports: 1\n").unwrap();
    let mut report = probe_fixture(tmp.path(), 1.0);
    let ports = &mut report.rdma.devices;
    ports[0].ports[0].selftest = Some(SelftestResult {
        ok: true,
        latency_us: Some(2500.0),
        ..SelftestResult::default()
    });
    ports[1].ports[0].selftest = Some(SelftestResult {
        ok: false,
        failed_step: Some("reg_mr".into()),
        errno: Some(12),
        ..SelftestResult::default()
    });
    let metrics = Metrics::with_config(&config);
    metrics.record_probe(&report, &policy::evaluate(&report, &config));
    let t = metrics.encode(false);
    let dev0 = &report.rdma.devices[0].name;
    let dev1 = &report.rdma.devices[1].name;
    assert_eq!(
        sample(
            &t,
            &format!(r#"fabricgate_rdma_selftest_ok{{device="{dev0}",port="1"}}"#)
        ),
        Some(1.0),
        "{t}"
    );
    assert_eq!(
        sample(
            &t,
            &format!(r#"fabricgate_rdma_selftest_latency_seconds{{device="{dev0}",port="1"}}"#)
        ),
        Some(0.0025)
    );
    assert_eq!(
        sample(
            &t,
            &format!(r#"fabricgate_rdma_selftest_ok{{device="{dev1}",port="1"}}"#)
        ),
        Some(0.0)
    );
    assert!(!t.contains(&format!(
        r#"fabricgate_rdma_selftest_latency_seconds{{device="{dev1}""#
    )));
    let (ok, out) = promtool_check(&t);
    assert!(ok, "{out}");
}
