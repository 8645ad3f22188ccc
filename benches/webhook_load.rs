//! The admission webhook under load: the real server (`webhook::serve`,
//! TLS with the test CA, its connection cap and timeouts) answering the recorded PyTorchJob
//! worker's AdmissionReview on keep-alive HTTPS connections, as the API server's webhook
//! client sends them: for each number of connections, every connection sends its next review
//! as soon as the last is answered, for `FABRICGATE_WEBHOOK_SECS` (default 10) seconds.
//! Printed: reviews per second and the latency's p50, p99 and max. The webhook does not read
//! the API server, so the pool's size does not enter; the rate of pod creations does.
//!
//! `cargo bench --bench webhook_load` (release build; the clients share this machine's cores
//! with the server).

#[path = "../tests/common/tls.rs"]
mod tls;

use bytes::Bytes;
use fabricgate::config::Config;
use fabricgate::pod::webhook::{self, MutationConfig, ServerConfig};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::{Duration, Instant};

const REQUIREMENTS: &str = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  \
                            min_rate_gbps: 400\n  link_layer: InfiniBand\n\
                            lustre:\n  mounts: [/lustre/scratch]\n";
const CONNECTIONS: [usize; 5] = [1, 4, 16, 64, 256];

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let secs: u64 = std::env::var("FABRICGATE_WEBHOOK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(load(Duration::from_secs(secs)));
}

async fn load(each: Duration) {
    let dir = tempfile::tempdir().expect("scratch");
    let pki = tls::TestPki::generate(dir.path());
    let config = Config::parse(REQUIREMENTS).expect("requirements");
    let mutation = MutationConfig::new(
        &config,
        REQUIREMENTS,
        "registry.example.com/fabricgate:0.1.0",
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("its address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(webhook::serve(
        ServerConfig::new(mutation, pki.cert_file.clone(), pki.key_file.clone()),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let review = Bytes::from(
        std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/admission/pytorchjob-worker.json"),
        )
        .expect("the recorded review"),
    );
    let url = format!("https://127.0.0.1:{}/mutate", addr.port());
    println!(
        "webhook under load: the recorded PyTorchJob worker's AdmissionReview ({} bytes), \
         {each:?} per row, keep-alive HTTPS",
        review.len()
    );
    for connections in CONNECTIONS {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*pki.client_config()).clone())
            .https_only()
            .enable_http1()
            .build();
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(connections)
            .build(https);
        let deadline = Instant::now() + each;
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                let (client, url, review) = (client.clone(), url.clone(), review.clone());
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    let mut failed = 0usize;
                    while Instant::now() < deadline {
                        let req = http::Request::post(&url)
                            .header("content-type", "application/json")
                            .body(Full::new(review.clone()))
                            .expect("a request");
                        let t0 = Instant::now();
                        match client.request(req).await {
                            Ok(res) if res.status() == 200 => {
                                let ok = res.into_body().collect().await.is_ok();
                                if ok {
                                    latencies.push(t0.elapsed());
                                } else {
                                    failed += 1;
                                }
                            }
                            _ => failed += 1,
                        }
                    }
                    (latencies, failed)
                })
            })
            .collect();
        let started = Instant::now();
        let mut all = Vec::new();
        let mut failed = 0;
        for w in workers {
            if let Ok((l, f)) = w.await {
                all.extend(l);
                failed += f;
            }
        }
        let took = started.elapsed();
        all.sort();
        let pct = |p: f64| {
            all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
        };
        println!(
            "  {connections:>3} connections: {:>6.0} reviews/s, p50 {:.1} ms, p99 {:.1} ms, \
             max {:.1} ms ({} answered, {failed} failed)",
            all.len() as f64 / took.as_secs_f64(),
            pct(0.50),
            pct(0.99),
            all.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
            all.len()
        );
    }
    let _ = stop.send(());
    let _ = server.await;
}
