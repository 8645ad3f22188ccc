//! Prometheus metrics and the agent's HTTP endpoints (`/metrics`, `/healthz`, `/readyz`).
//!
//! INTERFACE STUB: the daemon calls exactly these; the metrics work fills them in.

use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// All metric families, shared between the probe loop and the HTTP server.
#[derive(Debug, Default)]
pub struct Metrics {
    first_probe_done: AtomicBool,
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record one completed probe and its verdict; the first call makes `/readyz` answer 200.
    pub fn record_probe(&self, _report: &ProbeReport, _verdict: &Verdict) {
        self.first_probe_done.store(true, Ordering::Release);
    }

    /// Count a write to the API server (`kind`: `labels`, `taint`, `conditions`, `event`).
    pub fn record_node_write(&self, _kind: &'static str) {}

    /// `/readyz`: true once the first probe completed.
    pub fn is_ready(&self) -> bool {
        self.first_probe_done.load(Ordering::Acquire)
    }

    /// The exposition text; OpenMetrics when `openmetrics`, else Prometheus text 0.0.4.
    pub fn encode(&self, _openmetrics: bool) -> String {
        String::new()
    }
}

/// Serve `/metrics`, `/healthz`, `/readyz` on `listener` until `shutdown` completes.
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    _listener: tokio::net::TcpListener,
    _metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    shutdown.await;
    Ok(())
}
