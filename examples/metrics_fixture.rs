//! Helper for benches/compare_node_exporter.sh while `fabricgate run` is not available: serves
//! fabricgate's `/metrics` over a fixture node (`DIR/sys`, `DIR/proc`), probing it every
//! second with verbs off, through the same registry and HTTP server the agent uses.
//!
//! ```text
//! cargo run --example metrics_fixture -- tests/fixtures/bench-12x2 127.0.0.1:9464
//! ```

use fabricgate::config::Config;
use fabricgate::observe::metrics::{self, Metrics};
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
        [dir, addr] => serve(PathBuf::from(dir), addr),
        _ => Err("usage: metrics_fixture NODE_DIR ADDR".into()),
    }
}

fn serve(dir: PathBuf, addr: &str) -> Result<(), Box<dyn Error>> {
    let config = Config::default();
    let metrics = Arc::new(Metrics::with_config(&config));
    let mut prober = Prober::new(
        Roots::new(dir.join("sys"), dir.join("proc")),
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
