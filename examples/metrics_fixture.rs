//! Helper for benches/compare_node_exporter.sh: writes the benchmark's synthetic node (12 RDMA
//! devices, 24 ports) and serves fabricgate's `/metrics` over it, probing it every second.
//!
//! ```text
//! cargo run --example metrics_fixture -- write DIR
//! cargo run --example metrics_fixture -- serve DIR 127.0.0.1:9464
//! ```

#[path = "../tests/common/fixture.rs"]
mod fixture;

use fabricgate::config::Config;
use fabricgate::metrics::{self, Metrics};
use fabricgate::policy;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [cmd, dir] if cmd == "write" => {
            fixture::write_node(&PathBuf::from(dir), fixture::Shape::LARGE, 1);
            Ok(())
        }
        [cmd, dir, addr] if cmd == "serve" => serve(PathBuf::from(dir), addr),
        _ => Err("usage: metrics_fixture write DIR | serve DIR ADDR".into()),
    }
}

fn serve(dir: PathBuf, addr: &str) -> Result<(), Box<dyn Error>> {
    let config = Config::default();
    let metrics = Arc::new(Metrics::with_config(&config));
    let mut prober = Prober::new(
        Roots::new(&dir, &dir),
        ProbeConfig {
            verbs: VerbsMode::Off,
            ..ProbeConfig::default()
        },
    );
    let m = metrics.clone();
    std::thread::spawn(move || {
        loop {
            let report = prober.probe();
            m.record_probe(&report, &policy::evaluate(&report, &config));
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        metrics::serve(listener, metrics, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
    })?;
    Ok(())
}
