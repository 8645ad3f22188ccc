//! Prometheus metrics and the agent's HTTP endpoints (`/metrics`, `/healthz`, `/readyz`).
//!
//! One [`Metrics`] is shared by the probe loop (which calls [`Metrics::record_probe`] after
//! every probe) and the HTTP server ([`serve`]). Metric names and labels are the interface
//! dashboards and alert rules rely on; docs/metrics.md lists them.
//!
//! Kernel counters are exported through [`Monotonic`] accumulators (src/counters.rs): a counter the kernel
//! resets (driver reload, `perfquery -R`) or wraps becomes a step of zero-or-more, so
//! `rate()` is never negative and no increase is lost across the reset.

/// Register `$m` (a clone: families are shared handles) as `fabricgate_<name>`.
macro_rules! reg {
    ($r:expr, $name:literal, $help:literal, $m:expr) => {
        $r.register(concat!("fabricgate_", $name), $help, $m.clone())
    };
    ($r:expr, $name:literal, $help:literal, $m:expr, $unit:expr) => {
        $r.register_with_unit(concat!("fabricgate_", $name), $help, $unit, $m.clone())
    };
}

mod checks;
mod http;
mod rdma;
mod record;
mod register;
#[cfg(test)]
mod tests;

pub use checks::CheckMetrics;
pub use http::{
    exposition_response, health_response, negotiate, router, serve, serve_with_limits,
    wants_openmetrics,
};
pub use rdma::{DATA_COUNTERS, ERROR_COUNTERS, HW_COUNTERS, counters_read};

use crate::config::Config;
pub use crate::observe::counters::Monotonic;
use crate::observe::fallback::{FallbackDetector, FallbackStatus};
use crate::observe::health::Health;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::hash::Hash;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard};

/// Content type of OpenMetrics text 1.0.0.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the classic Prometheus text format.
pub const PROMETHEUS_CONTENT_TYPE: &str =
    prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The built-in `probe` label values of the duration histogram and the error counter (each
/// registered subsystem adds its own, src/checks/).
pub const PROBE_KINDS: &[&str] = &["rdma_sysfs", "rdma_verbs"];

/// The `kind` label values of `fabricgate_node_writes_total`.
pub const NODE_WRITE_KINDS: &[&str] = &["labels", "taint", "conditions", "event"];

const DURATION_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

pub type GaugeF64 = Gauge<f64, AtomicU64>;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    probe: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WhyLabels {
    why: &'static str,
}

/// The `why` label values of `fabricgate_http_connections_dropped_total`.
pub const HTTP_DROP_REASONS: &[&str] = &["evicted", "rejected"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FindingLabels {
    scope: &'static str,
    reason: &'static str,
}

/// A gauge that is absent until its value is known (a missing value is not 0).
pub type OptionalGauge = Family<Vec<(&'static str, &'static str)>, GaugeF64>;

/// Set `g` to `v`, or leave it without a sample when `v` is unknown.
pub fn set_optional(g: &OptionalGauge, v: Option<f64>) {
    match v {
        Some(v) => {
            g.get_or_create(&Vec::new()).set(v);
        }
        None => g.clear(),
    }
}

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

/// Handles on every metric family (each is an `Arc` inside, shared with the registry).
#[derive(Debug, Default)]
struct Families {
    node_ready: Gauge,
    rdma_ready: Gauge,
    findings: Family<FindingLabels, Gauge>,

    /// The RDMA ports' families (`rdma.rs`).
    rdma: rdma::RdmaFamilies,

    probe_errors: Family<ProbeLabels, Counter>,
    last_probe_timestamp: GaugeF64,
    node_writes: Family<KindLabels, Counter>,
    breaker_open: Gauge,

    fallback_suspected: Gauge,
    fallback_tcp_rate: OptionalGauge,
    fallback_rdma_rate: OptionalGauge,

    agent_error: Gauge,
    http_connections: Gauge,
    http_dropped: Family<WhyLabels, Counter>,
}

/// Reader state behind the counters: the last raw value of every kernel counter series.
#[derive(Debug)]
struct Readers {
    /// The RDMA ports' counters (`rdma.rs`).
    rdma: rdma::RdmaReaders,
    /// Series of a device absent for longer than this are dropped (`--stale-series-grace`).
    series_grace: std::time::Duration,
}

/// The fallback detector and its last conclusion, behind their own lock.
#[derive(Debug)]
struct Fallback {
    detector: FallbackDetector,
    last: FallbackStatus,
}

/// Default of `--stale-series-grace`.
pub const DEFAULT_STALE_SERIES_GRACE: std::time::Duration = std::time::Duration::from_secs(600);

/// All metric families, shared between the probe loop and the HTTP server.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    families: Families,
    probe_duration: Family<ProbeLabels, Histogram, fn() -> Histogram>,
    /// Held while recording and while encoding, so a scrape never sees half a probe.
    state: Mutex<Readers>,
    /// Not under `state`: the detector's window work never holds up a scrape.
    fallback: Mutex<Fallback>,
    health: Health,
    /// The `fabricgate_peer_*` families, registered when `peers.enabled`.
    pub peers: Option<crate::peers::PeerMetrics>,
    /// What triggered each probe and which event sources listen (docs/events.md).
    pub events: crate::observe::events::EventMetrics,
    /// Families that change without the state lock (HTTP connections, peers): encoded at
    /// every scrape and written after `registry`'s cached exposition.
    live: Registry,
    /// `/metrics` encoded once per change (src/exposition.rs).
    exposition: crate::observe::exposition::Cache,
    /// The registered subsystems' own families (src/checks/).
    checks: Vec<checks::CheckRecorder>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics with the default requirements (fallback detector over every RDMA device).
    pub fn new() -> Self {
        Self::with_config(&Config::default())
    }

    /// The state lock, taken by everything that changes the registry (other than the
    /// families in `live`): taking it marks the cached exposition stale.
    fn lock(&self) -> MutexGuard<'_, Readers> {
        let guard = self.lock_for_reading();
        self.exposition.bump();
        guard
    }

    /// The state lock without marking the exposition stale (encoding only).
    fn lock_for_reading(&self) -> MutexGuard<'_, Readers> {
        // A panic while recording leaves plain numbers behind; keep serving them.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long the series of a vanished device stay (`--stale-series-grace`).
    pub fn set_stale_series_grace(&self, grace: std::time::Duration) {
        self.lock().series_grace = grace;
    }

    /// The agent's health state behind `/healthz` and `/readyz`.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Set or clear the agent error (`fabricgate_agent_error`, `/readyz`).
    pub fn set_agent_error(&self, message: Option<&str>) {
        let _guard = self.lock();
        self.families.agent_error.set(i64::from(message.is_some()));
        self.health.set_agent_error(message.map(str::to_owned));
    }

    /// Whether the blast-radius breaker is holding back this node's taint.
    pub fn set_breaker_open(&self, open: bool) {
        let _guard = self.lock();
        self.families.breaker_open.set(i64::from(open));
    }

    /// Count a write to the API server (`kind`: `labels`, `taint`, `conditions`, `event`).
    pub fn record_node_write(&self, kind: &'static str) {
        let _guard = self.lock();
        self.families
            .node_writes
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// The fallback detector's conclusion after the last probe.
    pub fn fallback_status(&self) -> FallbackStatus {
        self.fallback.lock().unwrap_or_else(|p| p.into_inner()).last
    }

    /// `/readyz`: true once the first probe completed and while the probe loop is neither
    /// stalled nor in an agent error ([`Health::readiness`]).
    pub fn is_ready(&self) -> bool {
        self.health.is_ready()
    }

    /// What `/metrics` serves: [`Metrics::encode`]'s bytes, encoded at most once per change
    /// of the registry and per format (src/exposition.rs); a scrape between two changes is
    /// served the same buffer.
    pub fn exposition(&self, openmetrics: bool) -> axum::body::Bytes {
        self.exposition.get(openmetrics, &self.live, || {
            let _guard = self.lock_for_reading();
            let generation = self.exposition.generation();
            let text = crate::observe::exposition::encode_registry(&self.registry, openmetrics);
            (generation, text)
        })
    }

    /// How many times `/metrics` had to encode the whole registry (for tests and benches).
    pub fn exposition_encodes(&self) -> u64 {
        self.exposition.encodes()
    }

    /// The exposition text, encoded now; OpenMetrics when `openmetrics`, else Prometheus text
    /// 0.0.4.
    pub fn encode(&self, openmetrics: bool) -> String {
        let _guard = self.lock_for_reading();
        let mut out = crate::observe::exposition::encode_registry(&self.registry, openmetrics);
        out.push_str(&crate::observe::exposition::encode_registry(
            &self.live,
            openmetrics,
        ));
        if openmetrics {
            out.push_str(crate::observe::exposition::EOF);
        }
        out
    }
}
