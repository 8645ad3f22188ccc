//! A real `prometheus` server scrapes the agent's `/metrics` (served over a fixture node) in
//! both formats, and the HTTP query API returns the series with the values the fixture holds.

mod common;

use common::{committed_fixture, have_tool, http_get, ndr_requirements, record_fixture};
use fabricgate::metrics::{self, Metrics};
use serde_json::Value;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
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

fn single(prom: &str, promql: &str, deadline: Instant) -> f64 {
    let got = wait_for(prom, promql, deadline);
    assert_eq!(got.len(), 1, "{promql}: {got:?}");
    got[0].1
}

#[test]
fn real_prometheus_scrapes_both_formats_and_answers_queries() {
    if !have_tool("prometheus") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The example GPU node: 8 x 400G NDR InfiniBand + 2 x 200G RoCE storage ports.
    let node = committed_fixture("ndr-8x400-healthy");
    let config = ndr_requirements();
    let metrics = Arc::new(Metrics::with_config(&config));
    record_fixture(&metrics, &node, &config, 1_700_000_000.0);
    let read_u64 = |rel: &str| -> f64 {
        std::fs::read_to_string(node.join("sys").join(rel))
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap() as f64
    };
    let xmit_words = read_u64("class/infiniband/mlx5_0/ports/1/counters/port_xmit_data");
    let roce_rx = read_u64("class/net/ens10f0np0/statistics/rx_bytes");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let agent = listener.local_addr().unwrap().to_string();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(metrics::serve(listener, metrics.clone(), async {
        let _ = stop_rx.await;
    }));

    // Job "fabricgate" lets Prometheus negotiate (it asks for OpenMetrics first); job
    // "fabricgate-text" forces the classic text format through the URL parameter.
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         scrape_configs:\n\
         \x20 - job_name: fabricgate\n    static_configs:\n      - targets: ['{agent}']\n\
         \x20 - job_name: fabricgate-text\n    params:\n      format: [prometheus]\n    \
         static_configs:\n      - targets: ['{agent}']\n"
    );
    let config_path = tmp.path().join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let prom = format!("127.0.0.1:{}", free_port());
    let _server = KillOnDrop(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                tmp.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let ready = std::net::TcpStream::connect(&prom).is_ok()
            && http_get(&prom, "/-/ready", None).0 == 200;
        if ready {
            break;
        }
        assert!(Instant::now() < deadline, "prometheus did not become ready");
        std::thread::sleep(Duration::from_millis(250));
    }

    for job in ["fabricgate", "fabricgate-text"] {
        let sel = format!("job=\"{job}\"");
        assert_eq!(
            single(&prom, &format!("up{{{sel}}}"), deadline),
            1.0,
            "{job}"
        );
        assert_eq!(
            single(&prom, &format!("fabricgate_node_ready{{{sel}}}"), deadline),
            1.0
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
        assert_eq!(
            single(
                &prom,
                &format!("fabricgate_probe_duration_seconds_count{{{sel},probe=\"rdma_sysfs\"}}"),
                deadline
            ),
            1.0
        );
        // record_fixture pins the sysfs probe at 4.2 ms: in the 5 ms bucket, not the 2.5 ms.
        for (le, want) in [("0.0025", 0.0), ("0.005", 1.0), ("+Inf", 1.0)] {
            assert_eq!(
                single(
                    &prom,
                    &format!(
                        "fabricgate_probe_duration_seconds_bucket{{{sel},probe=\"rdma_sysfs\",le=\"{le}\"}}"
                    ),
                    deadline
                ),
                want,
                "{job} le={le}"
            );
        }
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
    let _ = stop_tx.send(());
}
