//! A real `prometheus` server scrapes the real agent (`fabricgate run --dry-run` over the
//! example GPU node fixture) in both formats, and the HTTP query API returns the series with
//! the values the fixture holds.

use crate::common;

use common::{committed_fixture, have_tool, http_get};
use serde_json::Value;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the server when the test ends, however it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The instant vector for `promql`, as (labels, value) pairs.
fn query(prom: &str, promql: &str) -> Vec<(Value, f64)> {
    let (status, _, body) = http_get(
        prom,
        &format!("/api/v1/query?query={}", urlencode(promql)),
        None,
    );
    assert_eq!(status, 200, "{promql}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "success", "{body}");
    v["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["metric"].clone(),
                r["value"][1].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

/// Poll until `promql` returns something (scrapes land every second).
fn wait_for(prom: &str, promql: &str, deadline: Instant) -> Vec<(Value, f64)> {
    loop {
        let got = query(prom, promql);
        if !got.is_empty() {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "no result for {promql} within the deadline"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Poll until `promql` returns exactly `want` (a gauge the agent changes over time).
fn wait_value(prom: &str, promql: &str, want: f64, deadline: Instant) {
    loop {
        let got = query(prom, promql);
        if got.len() == 1 && got[0].1 == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{promql}: wanted {want}, last got {got:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn single(prom: &str, promql: &str, deadline: Instant) -> f64 {
    let got = wait_for(prom, promql, deadline);
    assert_eq!(got.len(), 1, "{promql}: {got:?}");
    got[0].1
}

/// `fabricgate run --dry-run` over the example GPU node as node `name`, probing every second;
/// returns its metrics address once `/readyz` answers, and the process (killed on drop).
fn start_agent(name: &str, deadline: Instant) -> (String, KillOnDrop) {
    let node = committed_fixture("ndr-8x400-healthy");
    let agent = format!("127.0.0.1:{}", free_port());
    let child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .args(["run", "--dry-run", "--node-name", name, "--verbs", "off"])
            .arg("--sysfs-root")
            .arg(node.join("sys"))
            .arg("--proc-root")
            .arg(node.join("proc"))
            .arg("--config")
            .arg(committed_fixture("requirements-ndr.yaml"))
            .args(["--metrics-addr", &agent, "--interval", "1s"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_ready(&agent, "/readyz", deadline);
    (agent, child)
}

fn wait_ready(addr: &str, path: &str, deadline: Instant) {
    while !(std::net::TcpStream::connect(addr).is_ok() && http_get(addr, path, None).0 == 200) {
        assert!(
            Instant::now() < deadline,
            "{addr}{path} did not become ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A real `prometheus` with `config` (storage in `dir`), once it is ready.
fn start_prometheus(
    dir: &std::path::Path,
    config: &str,
    deadline: Instant,
) -> (String, KillOnDrop) {
    let config_path = dir.join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let prom = format!("127.0.0.1:{}", free_port());
    let server = KillOnDrop(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    wait_ready(&prom, "/-/ready", deadline);
    (prom, server)
}

#[test]
fn real_prometheus_scrapes_both_formats_and_answers_queries() {
    if !have_tool("prometheus") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The example GPU node: 8 x 400G NDR InfiniBand + 2 x 200G RoCE storage ports.
    let node = committed_fixture("ndr-8x400-healthy");
    let read_u64 = |rel: &str| -> f64 {
        std::fs::read_to_string(node.join("sys").join(rel))
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap() as f64
    };
    let xmit_words = read_u64("class/infiniband/mlx5_0/ports/1/counters/port_xmit_data");
    let roce_rx = read_u64("class/net/ens10f0np0/statistics/rx_bytes");

    let deadline = Instant::now() + Duration::from_secs(90);
    let (agent, _agent) = start_agent("gpu-a", deadline);

    // Job "fabricgate" lets Prometheus negotiate (it asks for OpenMetrics first); job
    // "fabricgate-text" forces the classic text format through the URL parameter.
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         scrape_configs:\n\
         \x20 - job_name: fabricgate\n    static_configs:\n      - targets: ['{agent}']\n\
         \x20 - job_name: fabricgate-text\n    params:\n      format: [prometheus]\n    \
         static_configs:\n      - targets: ['{agent}']\n"
    );
    let (prom, _server) = start_prometheus(tmp.path(), &config, deadline);

    for job in ["fabricgate", "fabricgate-text"] {
        let sel = format!("job=\"{job}\"");
        assert_eq!(
            single(&prom, &format!("up{{{sel}}}"), deadline),
            1.0,
            "{job}"
        );
        // The agent validates the node after `recover_after` good probes (3 s here).
        wait_value(
            &prom,
            &format!("fabricgate_node_ready{{{sel}}}"),
            1.0,
            deadline,
        );
        assert_eq!(
            single(
                &prom,
                &format!("fabricgate_rdma_port_rate_gbps{{{sel},device=\"mlx5_8\",port=\"1\"}}"),
                deadline
            ),
            200.0
        );
        assert_eq!(
            single(
                &prom,
                &format!(
                    "fabricgate_rdma_port_transmit_bytes_total{{{sel},device=\"mlx5_0\",port=\"1\"}}"
                ),
                deadline
            ),
            4.0 * xmit_words
        );
        assert_eq!(
            single(
                &prom,
                &format!("fabricgate_netdev_receive_bytes_total{{{sel},device=\"ens10f0np0\"}}"),
                deadline
            ),
            roce_rx
        );
        let count = single(
            &prom,
            &format!("fabricgate_probe_duration_seconds_count{{{sel},probe=\"rdma_sysfs\"}}"),
            deadline,
        );
        let inf = single(
            &prom,
            &format!(
                "fabricgate_probe_duration_seconds_bucket{{{sel},probe=\"rdma_sysfs\",le=\"+Inf\"}}"
            ),
            deadline,
        );
        assert!(
            count >= 1.0 && inf >= count - 1.0,
            "{job}: count {count}, +Inf {inf}"
        );
        let ports = wait_for(
            &prom,
            &format!("fabricgate_rdma_port_up{{{sel}}}"),
            deadline,
        );
        assert_eq!(ports.len(), 10, "{ports:?}");
        assert!(ports.iter().all(|(_, v)| *v == 1.0), "{ports:?}");
    }
    // Both formats carry the same samples: nothing lost in either encoding.
    let om = single(
        &prom,
        "scrape_samples_scraped{job=\"fabricgate\"}",
        deadline,
    );
    let text = single(
        &prom,
        "scrape_samples_scraped{job=\"fabricgate-text\"}",
        deadline,
    );
    assert_eq!(om, text);
    assert!(om > 100.0, "{om}");
}

/// Every PromQL expression (`expr`) anywhere in a Grafana dashboard.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match dashboard {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => out.extend(dashboard_exprs(value)),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| out.extend(dashboard_exprs(v))),
        _ => {}
    }
    out
}

/// The agent's own metrics server (`metrics::serve`) in-process, serving `metrics`.
fn serve_in_process(metrics: fabricgate::observe::metrics::Metrics) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let metrics = std::sync::Arc::new(metrics);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let _ = fabricgate::observe::metrics::serve(listener, metrics, std::future::pending())
                .await;
        });
    });
    addr
}

/// The guard's metrics server (`GuardMetrics::router` on `observe::server`) in-process: a
/// leader that swept its pool and tainted one Node.
fn serve_guard_in_process() -> String {
    use fabricgate::cluster::guard::{GuardMetrics, Outcome, WriteKind};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let metrics = std::sync::Arc::new(GuardMetrics::new());
    metrics.turned(true);
    metrics.swept(6, 1);
    metrics.wrote(WriteKind::Taint, Outcome::Ok, None);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let _ = fabricgate::observe::server::serve(
                listener,
                metrics.router(),
                fabricgate::observe::server::Limits::default(),
                std::sync::Arc::new(()),
                std::future::pending(),
            )
            .await;
        });
    });
    addr
}

/// Every query of `deploy/grafana/fabricgate.json` runs against a real Prometheus that scrapes
/// two agents and the guard, and each returns data:
/// - node `gpu-a`: `fabricgate run` (the binary) over the healthy example node;
/// - node `gpu-b`: the agent's metrics server and registry in-process, recording the
///   `ndr-port-down` fixture with a hung Lustre mount, a failed and a passing data-path
///   self-test, silent TCP fallback and two judged pods, one on sockets
///   (`common::unhealthy_metrics`). The self-test needs
///   RDMA hardware, which `fabricgate run` over a fixture tree cannot have;
/// - job `fabricgate-guard`: the guard's metrics server in-process (the row Guard).
#[test]
fn every_dashboard_query_returns_data_from_the_agent() {
    if !have_tool("prometheus") {
        return;
    }
    let path = common::repo_root().join("deploy/grafana/fabricgate.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let titles: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["title"].as_str())
        .collect();
    for wanted in [
        "Fleet readiness",
        "Nodes not validated, with their reasons",
        "RDMA port state",
        "RDMA port throughput",
        "Silent TCP fallback suspected",
        "Data-path self-test",
        "Probe duration",
        "HCAs tainted by DeviceTaintRule",
        "DRA driver up",
        "HCAs held by pods' claims, outside the node's view",
        "Guard: leader and refused writes",
        "Guard: Node writes",
        "Jobs with pods on sockets",
        "Pod transport",
        "Active fabric bandwidth per job",
        "Shared RDMA ports (bytes not attributed)",
    ] {
        assert!(
            titles.contains(&wanted),
            "no panel {wanted:?} in {titles:?}"
        );
    }

    let tmp = tempfile::tempdir().unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let (agent, _agent) = start_agent("gpu-a", deadline);
    let unhealthy = serve_in_process(common::unhealthy_metrics());
    wait_ready(&unhealthy, "/readyz", deadline);
    let guard = serve_guard_in_process();
    wait_ready(&guard, "/readyz", deadline);
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
         scrape_configs:\n\
         \x20 - job_name: fabricgate\n    static_configs:\n\
         \x20     - targets: ['{agent}']\n        labels: {{node: gpu-a}}\n\
         \x20     - targets: ['{unhealthy}']\n        labels: {{node: gpu-b}}\n\
         \x20 - job_name: fabricgate-guard\n    static_configs:\n\
         \x20     - targets: ['{guard}']\n"
    );
    let (prom, _server) = start_prometheus(tmp.path(), &config, deadline);
    // Both agents scraped, and the binary validated its node (recover_after good probes).
    wait_value(&prom, "count(up{job=\"fabricgate\"} == 1)", 2.0, deadline);
    wait_value(
        &prom,
        "fabricgate_node_ready{node=\"gpu-a\"}",
        1.0,
        deadline,
    );

    for expr in &exprs {
        // rate() needs two samples in its window: poll until every query answers.
        let got = loop {
            let got = query(&prom, expr);
            if got.iter().any(|(_, v)| !v.is_nan()) {
                break got;
            }
            assert!(
                Instant::now() < deadline,
                "dashboard query {expr:?} returned no data: {got:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        };
        assert!(got.iter().all(|(m, _)| m.is_object()), "{expr}: {got:?}");
    }
    // The reasons table names the unhealthy node's findings.
    let findings = query(&prom, "fabricgate_findings > 0");
    let reasons: Vec<String> = findings
        .iter()
        .map(|(m, _)| format!("{}/{}", m["node"], m["reason"]))
        .collect();
    assert!(
        reasons.iter().any(|r| r == "\"gpu-b\"/\"PortDown\""),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().all(|r| r.starts_with("\"gpu-b\"")),
        "{reasons:?}"
    );
    // The in-use table names the pod's HCA and its claim, on the DRA node only.
    let in_use = query(&prom, "fabricgate_dra_device_in_use == 1");
    let rows: Vec<String> = in_use
        .iter()
        .map(|(m, _)| format!("{}/{}/{}", m["node"], m["hca"], m["claim"]))
        .collect();
    assert_eq!(
        rows,
        ["\"gpu-b\"/\"mlx5_10\"/\"train/worker-0-rdma\""],
        "{in_use:?}"
    );
}
