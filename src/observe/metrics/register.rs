//! The registration list: every family's name, help and unit, and the label values present
//! from the start.

use super::{
    DEFAULT_STALE_SERIES_GRACE, Fallback, Families, HTTP_DROP_REASONS, KindLabels, Metrics,
    NODE_WRITE_KINDS, PROBE_KINDS, ProbeLabels, Readers, WhyLabels, duration_histogram,
};
use crate::config::Config;
use crate::observe::fallback::{FallbackDetector, FallbackStatus};
use crate::observe::health::Health;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::sync::Mutex;

impl Metrics {
    /// Metrics whose fallback detector follows `config.fallback` and `config.rdma.devices`.
    pub fn with_config(config: &Config) -> Self {
        Self::with_config_and(config, |_| ()).0
    }

    /// [`Self::with_config`], with a feature's own families registered by `feature` among
    /// the live ones (runtime transport's `fabricgate_pod_*`): the feature keeps its handles,
    /// and this crate's metrics need not know it.
    pub fn with_config_and<T>(
        config: &Config,
        feature: impl FnOnce(&mut Registry) -> T,
    ) -> (Self, T) {
        let f = Families::default();
        let probe_duration: Family<ProbeLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(duration_histogram);
        let mut r = Registry::default();
        register_verdict(&mut r, &f);
        f.rdma.register(&mut r);
        register_probes(&mut r, &f, &probe_duration);
        register_node_guards(&mut r, &f);
        register_agent(&mut r, &f);
        // The families below change without the state lock (the HTTP server at every
        // connection, the peers' thread): they go to `live`, encoded at every scrape and
        // written after the cached rest (src/exposition.rs). Register any family that is
        // not changed under `Metrics::lock` there, last.
        let mut live = Registry::default();
        live.register(
            "fabricgate_http_connections",
            "Open connections to the metrics server",
            f.http_connections.clone(),
        );
        live.register(
            "fabricgate_http_connections_dropped",
            "Connections the metrics server closed to stay within its cap: evicted (oldest idle \
             one, for a newer connection) or rejected (every open one was busy)",
            f.http_dropped.clone(),
        );
        for &why in HTTP_DROP_REASONS {
            f.http_dropped.get_or_create(&WhyLabels { why }).inc_by(0);
        }

        for &probe in PROBE_KINDS {
            f.probe_errors
                .get_or_create(&ProbeLabels { probe })
                .inc_by(0);
        }
        for &kind in NODE_WRITE_KINDS {
            f.node_writes.get_or_create(&KindLabels { kind }).inc_by(0);
        }

        let peers = config
            .peers
            .enabled
            .then(|| crate::peers::PeerMetrics::register(&mut live));
        let registered = feature(&mut live);
        // Counted by the event thread and the probe loop without the state lock.
        let events = crate::observe::events::EventMetrics::register(&mut live);
        let metrics = Self {
            registry: r,
            families: f,
            probe_duration,
            state: Mutex::new(Readers {
                rdma: super::rdma::RdmaReaders::default(),
                series_grace: DEFAULT_STALE_SERIES_GRACE,
            }),
            fallback: Mutex::new(Fallback {
                detector: FallbackDetector::new(config),
                last: FallbackStatus::default(),
            }),
            health: Health::default(),
            peers,
            events,
            live,
            exposition: crate::observe::exposition::Cache::default(),
            checks: Vec::new(),
        };
        (metrics, registered)
    }
}

/// The verdict: node, RDMA and storage readiness and the findings.
fn register_verdict(r: &mut Registry, f: &Families) {
    reg!(
        r,
        "node_ready",
        "1 when the node passed every check (RDMA and storage), else 0",
        f.node_ready
    );
    reg!(
        r,
        "rdma_ready",
        "1 when the RDMA requirements are met, else 0",
        f.rdma_ready
    );
    reg!(
        r,
        "findings",
        "Problems that keep the node unvalidated, by scope and reason (the Node condition reason)",
        f.findings
    );
}

/// The probes' own durations and errors, and the writes to the API.
fn register_probes(
    r: &mut Registry,
    f: &Families,
    probe_duration: &Family<ProbeLabels, Histogram, fn() -> Histogram>,
) {
    reg!(
        r,
        "probe_duration",
        "Wall time of each probe kind",
        probe_duration,
        Unit::Seconds
    );
    reg!(
        r,
        "probe_errors",
        "Errors reported by each probe kind",
        f.probe_errors
    );
    reg!(
        r,
        "last_probe_timestamp",
        "Unix time when the last completed probe started",
        f.last_probe_timestamp,
        Unit::Seconds
    );
    reg!(
        r,
        "node_writes",
        "Writes to the Kubernetes API, by kind",
        f.node_writes
    );
}

/// What guards the taint and its use: the breaker, the fallback detector.
fn register_node_guards(r: &mut Registry, f: &Families) {
    reg!(
        r,
        "breaker_open",
        "1 while the blast-radius breaker keeps this node from being tainted, else 0",
        f.breaker_open
    );
    reg!(
        r,
        "fallback_suspected",
        "1 when TCP traffic is high while the RDMA ports are idle (silent TCP fallback), else 0",
        f.fallback_suspected
    );
    reg!(
        r,
        "fallback_tcp_bytes_per_second",
        "Average TCP-path byte rate over the fallback window (all configured netdevs)",
        f.fallback_tcp_rate
    );
    reg!(
        r,
        "fallback_rdma_bytes_per_second",
        "Average RDMA byte rate over the fallback window (all in-scope ports)",
        f.fallback_rdma_rate
    );
}

/// The agent itself: its build and its own trouble.
fn register_agent(r: &mut Registry, f: &Families) {
    // A gauge rather than an OpenMetrics `info` family: the classic text parser (and
    // `promtool check metrics`) know no `info` type, and every exporter spells it so.
    let build: Family<Vec<(&'static str, &'static str)>, Gauge> = Family::default();
    build
        .get_or_create(&vec![
            ("version", env!("CARGO_PKG_VERSION")),
            ("rust_version", env!("CARGO_PKG_RUST_VERSION")),
        ])
        .set(1);
    reg!(
        r,
        "build_info",
        "Build of the running agent; always 1",
        build
    );
    reg!(
        r,
        "agent_error",
        "1 while the agent itself cannot do its job (condition reason AgentError: resource \
         exhaustion, a stalled probe, no access to device nodes or mounts), else 0",
        f.agent_error
    );
}
