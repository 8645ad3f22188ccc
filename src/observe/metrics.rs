//! Prometheus metrics and the agent's HTTP endpoints (`/metrics`, `/healthz`, `/readyz`).
//!
//! One [`Metrics`] is shared by the probe loop (which calls [`Metrics::record_probe`] after
//! every probe) and the HTTP server ([`serve`]). Metric names and labels are the interface
//! dashboards and alert rules rely on; docs/metrics.md lists them.
//!
//! Kernel counters are exported through [`Monotonic`] accumulators (src/counters.rs): a counter the kernel
//! resets (driver reload, `perfquery -R`) or wraps becomes a step of zero-or-more, so
//! `rate()` is never negative and no increase is lost across the reset.

use crate::config::Config;
pub use crate::observe::counters::Monotonic;
use crate::observe::fallback::{FallbackDetector, FallbackStatus};
use crate::observe::health::Health;
use crate::observe::server::Limits;
use crate::policy::{Scope, Verdict};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::rdma::PortReport;
use fabricgate_probes::storage::{MountStatus, StorageReport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

/// Content type of OpenMetrics text 1.0.0.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the classic Prometheus text format.
pub const PROMETHEUS_CONTENT_TYPE: &str =
    prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// IB performance-management error counters exported as
/// `fabricgate_rdma_port_errors_total{counter=...}` (the names are the sysfs file names).
pub const ERROR_COUNTERS: &[&str] = &[
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_xmit_discards",
    "excessive_buffer_overrun_errors",
    "local_link_integrity_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_rcv_constraint_errors",
    "port_xmit_constraint_errors",
    "VL15_dropped",
];

/// Driver `hw_counters` exported as `fabricgate_rdma_port_hw_events_total{counter=...}`: the
/// RoCE retry, sequence and congestion counters that explain a slow or stalling fabric. A
/// fixed list keeps the series bounded (mlx5 alone has dozens of hw_counters).
pub const HW_COUNTERS: &[&str] = &[
    "out_of_sequence",
    "packet_seq_err",
    "rnr_nak_retry_err",
    "local_ack_timeout_err",
    "implied_nak_seq_err",
    "duplicate_request",
    "req_cqe_error",
    "resp_cqe_error",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "rp_cnp_handled",
];

/// The byte counters behind `fabricgate_rdma_port_{transmit,receive}_bytes_total` and the
/// fallback detector's RDMA rate.
pub const DATA_COUNTERS: &[&str] = &["port_xmit_data", "port_rcv_data"];

/// The counter files the agent reads: what it exports and what its fallback detector needs.
/// The rest of `counters/` and `hw_counters/` (about half of an mlx5 port's ~50 files) would be
/// read on every probe for nothing.
pub fn counters_read() -> fabricgate_probes::rdma::sysfs::CounterNames {
    let owned = |names: &[&str]| names.iter().map(|&n| n.to_owned()).collect::<Vec<_>>();
    fabricgate_probes::rdma::sysfs::CounterNames {
        counters: Some([owned(DATA_COUNTERS), owned(ERROR_COUNTERS)].concat()),
        hw_counters: Some(owned(HW_COUNTERS)),
    }
}

/// The `probe` label values of the duration histogram and the error counter.
pub const PROBE_KINDS: &[&str] = &["rdma_sysfs", "rdma_verbs", "storage", "netdev", "gpudirect"];

/// The `kind` label values of `fabricgate_node_writes_total`.
pub const NODE_WRITE_KINDS: &[&str] = &["labels", "taint", "conditions", "event"];

const DURATION_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

type GaugeF64 = Gauge<f64, AtomicU64>;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortLabels {
    device: String,
    port: u32,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortInfoLabels {
    device: String,
    port: u32,
    link_layer: String,
    netdev: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortCounterLabels {
    device: String,
    port: u32,
    counter: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MountLabels {
    mount: String,
}

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
struct GpuPairLabels {
    gpu: String,
    hca: String,
    relation: &'static str,
    numa: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EcnLabels {
    device: String,
    port: u32,
    /// `np` (notification point) or `rp` (reaction point).
    point: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FindingLabels {
    scope: &'static str,
    reason: &'static str,
}

/// A gauge that is absent until its value is known (a missing value is not 0).
type OptionalGauge = Family<Vec<(&'static str, &'static str)>, GaugeF64>;

fn set_optional(g: &OptionalGauge, v: Option<f64>) {
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
    lustre_ready: Gauge,
    findings: Family<FindingLabels, Gauge>,

    port_state: Family<PortLabels, Gauge>,
    port_phys_state: Family<PortLabels, Gauge>,
    port_rate_gbps: Family<PortLabels, GaugeF64>,
    port_up: Family<PortLabels, Gauge>,
    selftest_ok: Family<PortLabels, Gauge>,
    selftest_latency: Family<PortLabels, GaugeF64>,
    port_info: Family<PortInfoLabels, Gauge>,
    port_tx_bytes: Family<PortLabels, Counter>,
    port_rx_bytes: Family<PortLabels, Counter>,
    port_errors: Family<PortCounterLabels, Counter>,
    port_hw: Family<PortCounterLabels, Counter>,

    netdev_rx_bytes: Family<DeviceLabels, Counter>,
    netdev_tx_bytes: Family<DeviceLabels, Counter>,

    mount_up: Family<MountLabels, Gauge>,
    mount_hung: Family<MountLabels, Gauge>,
    mount_statfs_seconds: Family<MountLabels, GaugeF64>,
    mount_free_bytes: Family<MountLabels, Gauge>,
    mount_available_bytes: Family<MountLabels, Gauge>,
    mount_free_inodes: Family<MountLabels, Gauge>,

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
    gpudirect_ready: Gauge,
    gpudirect_gpus: Gauge,
    gpudirect_pair_relation: Family<GpuPairLabels, Gauge>,
    gpudirect_worst_relation: OptionalGauge,
    gpudirect_acs_redirect_bridges: Gauge,
    gpudirect_peer_memory: Gauge,
    port_active_mtu: Family<PortLabels, Gauge>,
    port_ecn_enabled: Family<EcnLabels, Gauge>,
}

/// Reader state behind the counters: the last raw value of every kernel counter series.
#[derive(Debug)]
struct Readers {
    port_tx: HashMap<PortLabels, Monotonic>,
    port_rx: HashMap<PortLabels, Monotonic>,
    port_errors: HashMap<PortCounterLabels, Monotonic>,
    port_hw: HashMap<PortCounterLabels, Monotonic>,
    netdev_rx: HashMap<DeviceLabels, Monotonic>,
    netdev_tx: HashMap<DeviceLabels, Monotonic>,
    /// Each port's `counters_timestamp` when its counters were last added: between two reads
    /// (`rdma.counters_interval`) a report carries the same values, which add nothing.
    port_counters_added: HashMap<PortLabels, f64>,
    /// When each RDMA device / netdev was last in a report (stale-series pruning).
    rdma_seen: HashMap<String, std::time::Instant>,
    netdev_seen: HashMap<String, std::time::Instant>,
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

/// Remember who was seen now and return the names unseen for longer than `grace`.
fn expire(
    seen: &mut HashMap<String, std::time::Instant>,
    present: impl Iterator<Item = String>,
    now: std::time::Instant,
    grace: std::time::Duration,
) -> Vec<String> {
    for name in present {
        seen.insert(name, now);
    }
    let gone: Vec<String> = seen
        .iter()
        .filter(|(_, t)| now.saturating_duration_since(**t) > grace)
        .map(|(n, _)| n.clone())
        .collect();
    for n in &gone {
        seen.remove(n);
    }
    gone
}

/// Drop the series (and their accumulators) whose labels `is_gone`.
fn drop_series<L: Clone + Hash + Eq + EncodeLabelSet + std::fmt::Debug>(
    family: &Family<L, Counter>,
    readers: &mut HashMap<L, Monotonic>,
    is_gone: impl Fn(&L) -> bool,
) {
    readers.retain(|labels, _| {
        if is_gone(labels) {
            family.remove(labels);
            false
        } else {
            true
        }
    });
}

/// Add the increase of one kernel counter read to its exported counter.
fn accumulate<L: Clone + Hash + Eq + EncodeLabelSet + std::fmt::Debug>(
    family: &Family<L, Counter>,
    readers: &mut HashMap<L, Monotonic>,
    labels: L,
    raw: u64,
) {
    let delta = match readers.get_mut(&labels) {
        Some(m) => m.observe(raw),
        None => {
            readers.insert(labels.clone(), Monotonic::starting_at(raw));
            raw
        }
    };
    family.get_or_create(&labels).inc_by(delta);
}

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
    /// `rdma.roce.ecn_priority`: the priority `fabricgate_rdma_port_ecn_enabled` reports.
    ecn_priority: u8,
    /// The `fabricgate_peer_*` families, registered when `peers.enabled`.
    pub peers: Option<crate::peers::PeerMetrics>,
    /// What triggered each probe and which event sources listen (docs/events.md).
    pub events: crate::observe::events::EventMetrics,
    /// Families that change without the state lock (HTTP connections, peers): encoded at
    /// every scrape and written after `registry`'s cached exposition.
    live: Registry,
    /// `/metrics` encoded once per change (src/exposition.rs).
    exposition: crate::observe::exposition::Cache,
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

    /// Metrics whose fallback detector follows `config.fallback` and `config.rdma.devices`.
    pub fn with_config(config: &Config) -> Self {
        let f = Families::default();
        let probe_duration: Family<ProbeLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(duration_histogram);
        let mut r = Registry::default();
        macro_rules! reg {
            ($name:literal, $help:literal, $m:expr) => {
                r.register(concat!("fabricgate_", $name), $help, $m.clone())
            };
            ($name:literal, $help:literal, $m:expr, $unit:expr) => {
                r.register_with_unit(concat!("fabricgate_", $name), $help, $unit, $m.clone())
            };
        }
        reg!(
            "node_ready",
            "1 when the node passed every check (RDMA and storage), else 0",
            f.node_ready
        );
        reg!(
            "rdma_ready",
            "1 when the RDMA requirements are met, else 0",
            f.rdma_ready
        );
        reg!(
            "lustre_ready",
            "1 when every required mount is healthy, else 0",
            f.lustre_ready
        );
        reg!(
            "findings",
            "Problems that keep the node unvalidated, by scope and reason (the Node condition reason)",
            f.findings
        );
        reg!(
            "rdma_port_state",
            "Logical port state (ports/N/state): 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER",
            f.port_state
        );
        reg!(
            "rdma_port_phys_state",
            "Physical port state (ports/N/phys_state): 2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery",
            f.port_phys_state
        );
        reg!(
            "rdma_port_rate_gbps",
            "Negotiated port rate in Gb/s (ports/N/rate)",
            f.port_rate_gbps
        );
        reg!(
            "rdma_port_up",
            "1 when the port is ACTIVE and LinkUp, else 0",
            f.port_up
        );
        reg!(
            "rdma_selftest_ok",
            "1 when the last loopback RC data-path self-test on the port passed, 0 when it failed",
            f.selftest_ok
        );
        reg!(
            "rdma_selftest_latency",
            "Round-trip latency of the last passing data-path self-test",
            f.selftest_latency,
            Unit::Seconds
        );
        reg!(
            "rdma_port_info",
            "Port attributes as labels (link layer, netdev of a RoCE port); always 1",
            f.port_info
        );
        reg!(
            "rdma_port_transmit",
            "Data octets sent by the port (port_xmit_data x 4)",
            f.port_tx_bytes,
            Unit::Bytes
        );
        reg!(
            "rdma_port_receive",
            "Data octets received by the port (port_rcv_data x 4)",
            f.port_rx_bytes,
            Unit::Bytes
        );
        reg!(
            "rdma_port_errors",
            "Port error counters (ports/N/counters), by counter file name",
            f.port_errors
        );
        reg!(
            "rdma_port_hw_events",
            "Driver hw_counters (RoCE retries, sequence errors, congestion notifications), by name",
            f.port_hw
        );
        reg!(
            "netdev_receive",
            "Bytes received on the TCP path of the interface (statistics/rx_bytes)",
            f.netdev_rx_bytes,
            Unit::Bytes
        );
        reg!(
            "netdev_transmit",
            "Bytes sent on the TCP path of the interface (statistics/tx_bytes)",
            f.netdev_tx_bytes,
            Unit::Bytes
        );
        reg!(
            "mount_up",
            "1 when the mount is present and statfs answered, else 0",
            f.mount_up
        );
        reg!(
            "mount_hung",
            "1 when statfs on the mount did not return in time, else 0",
            f.mount_hung
        );
        reg!(
            "mount_statfs",
            "How long statfs on the mount took",
            f.mount_statfs_seconds,
            Unit::Seconds
        );
        reg!(
            "mount_free",
            "Free bytes on the mount",
            f.mount_free_bytes,
            Unit::Bytes
        );
        reg!(
            "mount_available",
            "Bytes available to unprivileged users on the mount",
            f.mount_available_bytes,
            Unit::Bytes
        );
        reg!(
            "mount_free_inodes",
            "Free inodes on the mount",
            f.mount_free_inodes
        );
        reg!(
            "probe_duration",
            "Wall time of each probe kind",
            probe_duration,
            Unit::Seconds
        );
        reg!(
            "probe_errors",
            "Errors reported by each probe kind",
            f.probe_errors
        );
        reg!(
            "last_probe_timestamp",
            "Unix time when the last completed probe started",
            f.last_probe_timestamp,
            Unit::Seconds
        );
        reg!(
            "node_writes",
            "Writes to the Kubernetes API, by kind",
            f.node_writes
        );
        reg!(
            "breaker_open",
            "1 while the blast-radius breaker keeps this node from being tainted, else 0",
            f.breaker_open
        );
        reg!(
            "fallback_suspected",
            "1 when TCP traffic is high while the RDMA ports are idle (silent TCP fallback), else 0",
            f.fallback_suspected
        );
        reg!(
            "fallback_tcp_bytes_per_second",
            "Average TCP-path byte rate over the fallback window (all configured netdevs)",
            f.fallback_tcp_rate
        );
        reg!(
            "fallback_rdma_bytes_per_second",
            "Average RDMA byte rate over the fallback window (all in-scope ports)",
            f.fallback_rdma_rate
        );
        reg!(
            "gpudirect_ready",
            "1 when the GPUDirect checks pass (or do not apply: no GPUs and not required), else 0",
            f.gpudirect_ready
        );
        reg!(
            "gpudirect_gpus",
            "NVIDIA GPUs found in sysfs (PCI vendor 0x10de, display/3D class)",
            f.gpudirect_gpus
        );
        reg!(
            "gpudirect_pair_relation",
            "PCIe relation between each GPU and its nearest HCA: 0 PIX, 1 PXB, 2 PHB, 3 NODE, 4 SYS",
            f.gpudirect_pair_relation
        );
        reg!(
            "gpudirect_worst_relation",
            "Worst GPU-HCA relation on the node: 0 PIX, 1 PXB, 2 PHB, 3 NODE, 4 SYS (absent without pairs)",
            f.gpudirect_worst_relation
        );
        reg!(
            "gpudirect_acs_redirect_bridges",
            "Bridges on GPU-HCA paths with ACS request or completion redirection enabled",
            f.gpudirect_acs_redirect_bridges
        );
        reg!(
            "gpudirect_peer_memory",
            "1 when GPU memory can be registered with the HCA (nvidia_peermem loaded, or DMA-BUF), else 0",
            f.gpudirect_peer_memory
        );
        reg!(
            "rdma_port_active_mtu",
            "Active RDMA MTU of the port (verbs; RoCE with --verbs off: derived from the netdev MTU)",
            f.port_active_mtu,
            Unit::Bytes
        );
        reg!(
            "rdma_port_ecn_enabled",
            "1 when ECN is on for rdma.roce.ecn_priority at the notification (np) or reaction (rp) point",
            f.port_ecn_enabled
        );
        // A gauge rather than an OpenMetrics `info` family: the classic text parser (and
        // `promtool check metrics`) know no `info` type, and every exporter spells it so.
        let build: Family<Vec<(&'static str, &'static str)>, Gauge> = Family::default();
        build
            .get_or_create(&vec![
                ("version", env!("CARGO_PKG_VERSION")),
                ("rust_version", env!("CARGO_PKG_RUST_VERSION")),
            ])
            .set(1);
        reg!("build_info", "Build of the running agent; always 1", build);
        reg!(
            "agent_error",
            "1 while the agent itself cannot do its job (condition reason AgentError: resource \
             exhaustion, a stalled probe, no access to device nodes or mounts), else 0",
            f.agent_error
        );
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
        // Counted by the event thread and the probe loop without the state lock.
        let events = crate::observe::events::EventMetrics::register(&mut live);
        Self {
            registry: r,
            families: f,
            probe_duration,
            state: Mutex::new(Readers {
                port_tx: HashMap::new(),
                port_rx: HashMap::new(),
                port_errors: HashMap::new(),
                port_hw: HashMap::new(),
                netdev_rx: HashMap::new(),
                netdev_tx: HashMap::new(),
                port_counters_added: HashMap::new(),
                rdma_seen: HashMap::new(),
                netdev_seen: HashMap::new(),
                series_grace: DEFAULT_STALE_SERIES_GRACE,
            }),
            fallback: Mutex::new(Fallback {
                detector: FallbackDetector::new(config),
                last: FallbackStatus::default(),
            }),
            health: Health::default(),
            ecn_priority: config.rdma.roce.ecn_priority,
            peers,
            events,
            live,
            exposition: crate::observe::exposition::Cache::default(),
        }
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

    /// Record one completed probe and its verdict; the first call makes `/readyz` answer 200.
    ///
    /// The fallback detector runs first, under its own lock; the metrics lock (which a scrape
    /// also takes) is held only while the registry is updated, so a scrape never sees half a
    /// probe and never waits for the detector.
    pub fn record_probe(&self, report: &ProbeReport, verdict: &Verdict) {
        let fallback = {
            let mut fb = self.fallback.lock().unwrap_or_else(|p| p.into_inner());
            fb.last = fb.detector.observe(report);
            fb.last
        };
        let mut st = self.lock();
        self.record_verdict(verdict);
        let (errors_sysfs, errors_verbs) = self.record_rdma(report, &mut st);
        let errors_netdev = self.record_netdevs(report, &mut st);
        let errors_storage = self.record_mounts(&report.storage);
        let t = &report.timings;
        let verbs_ran = report.rdma.verbs.is_some();
        for (probe, seconds, ran, errors) in [
            ("rdma_sysfs", t.rdma_sysfs_seconds, true, errors_sysfs),
            ("rdma_verbs", t.rdma_verbs_seconds, verbs_ran, errors_verbs),
            ("storage", t.storage_seconds, true, errors_storage),
            ("netdev", t.netdev_seconds, true, errors_netdev),
            (
                "gpudirect",
                t.gpudirect_seconds,
                true,
                report.gpudirect.errors.len(),
            ),
        ] {
            let l = ProbeLabels { probe };
            if ran {
                self.probe_duration.get_or_create(&l).observe(seconds);
            }
            self.families
                .probe_errors
                .get_or_create(&l)
                .inc_by(u64::try_from(errors).unwrap_or(u64::MAX));
        }
        let f = &self.families;
        f.last_probe_timestamp.set(report.timestamp);
        self.record_gpudirect(report, verdict);

        // Counters of a device gone for longer than the grace (renamed, removed) are dropped,
        // so /metrics does not grow with every device name ever seen.
        let now = std::time::Instant::now();
        let grace = st.series_grace;
        let gone = expire(
            &mut st.rdma_seen,
            report.rdma.devices.iter().map(|d| d.name.clone()),
            now,
            grace,
        );
        if !gone.is_empty() {
            let port_gone = |l: &PortLabels| gone.contains(&l.device);
            let counter_gone = |l: &PortCounterLabels| gone.contains(&l.device);
            drop_series(&f.port_tx_bytes, &mut st.port_tx, port_gone);
            drop_series(&f.port_rx_bytes, &mut st.port_rx, port_gone);
            drop_series(&f.port_errors, &mut st.port_errors, counter_gone);
            drop_series(&f.port_hw, &mut st.port_hw, counter_gone);
            st.port_counters_added.retain(|l, _| !port_gone(l));
        }
        let gone = expire(
            &mut st.netdev_seen,
            report.netdevs.iter().map(|n| n.name.clone()),
            now,
            grace,
        );
        if !gone.is_empty() {
            let dev_gone = |l: &DeviceLabels| gone.contains(&l.device);
            drop_series(&f.netdev_rx_bytes, &mut st.netdev_rx, dev_gone);
            drop_series(&f.netdev_tx_bytes, &mut st.netdev_tx, dev_gone);
        }

        f.fallback_suspected.set(i64::from(fallback.suspected));
        set_optional(&f.fallback_tcp_rate, fallback.tcp_bytes_per_second);
        set_optional(&f.fallback_rdma_rate, fallback.rdma_bytes_per_second);
        drop(st);
        self.health.probe_completed();
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

    fn record_verdict(&self, verdict: &Verdict) {
        let f = &self.families;
        f.node_ready.set(i64::from(verdict.ready));
        f.rdma_ready.set(i64::from(verdict.rdma.part.ready));
        f.lustre_ready.set(i64::from(verdict.lustre.ready));
        f.findings.clear();
        let findings = verdict.rdma.part.findings.iter();
        for finding in findings
            .chain(&verdict.lustre.findings)
            .chain(&verdict.gpudirect.part.findings)
            .chain(&verdict.placement.findings)
        {
            let scope = match finding.scope {
                Scope::Rdma => "rdma",
                Scope::Lustre => "lustre",
                Scope::Gpudirect => "gpudirect",
                Scope::Placement => "placement",
            };
            let reason = finding.code;
            f.findings
                .get_or_create(&FindingLabels { scope, reason })
                .inc();
        }
    }

    /// Port gauges and counters; returns the errors the sysfs and verbs probes reported.
    fn record_rdma(&self, report: &ProbeReport, st: &mut Readers) -> (usize, usize) {
        let f = &self.families;
        // Gauges describe the present: a port that vanished must vanish from /metrics too.
        // Counters stay (with their accumulators) so a port that comes back continues upward.
        for fam in [
            &f.port_state,
            &f.port_phys_state,
            &f.port_up,
            &f.selftest_ok,
        ] {
            fam.clear();
        }
        f.port_rate_gbps.clear();
        f.port_info.clear();
        f.selftest_latency.clear();
        let verbs_error = |e: &Option<String>| usize::from(e.is_some());
        let mut errors_sysfs = report.rdma.errors.len();
        let mut errors_verbs = report
            .rdma
            .verbs
            .as_ref()
            .map_or(0, |v| verbs_error(&v.error));
        for dev in &report.rdma.devices {
            errors_sysfs += dev.errors.len();
            errors_verbs += dev.verbs.as_ref().map_or(0, |v| verbs_error(&v.error));
            for port in &dev.ports {
                errors_sysfs += port.errors.len();
                self.record_port(&dev.name, port, st);
            }
        }
        (errors_sysfs, errors_verbs)
    }

    fn record_port(&self, device: &str, port: &PortReport, st: &mut Readers) {
        let f = &self.families;
        let labels = PortLabels {
            device: device.to_owned(),
            port: port.port,
        };
        if let Some(s) = port.state {
            f.port_state.get_or_create(&labels).set(i64::from(s.code()));
        }
        if let Some(s) = port.phys_state {
            f.port_phys_state
                .get_or_create(&labels)
                .set(i64::from(s.code()));
        }
        if let Some(rate) = &port.rate {
            f.port_rate_gbps.get_or_create(&labels).set(rate.gbps);
        }
        f.port_up
            .get_or_create(&labels)
            .set(i64::from(port.is_up()));
        if let Some(sel) = &port.selftest {
            f.selftest_ok.get_or_create(&labels).set(i64::from(sel.ok));
            if let Some(us) = sel.latency_us.filter(|_| sel.ok) {
                f.selftest_latency.get_or_create(&labels).set(us / 1e6);
            }
        }
        f.port_info
            .get_or_create(&PortInfoLabels {
                device: device.to_owned(),
                port: port.port,
                link_layer: port
                    .link_layer
                    .as_ref()
                    .map_or_else(String::new, |l| l.name().to_owned()),
                netdev: port.netdevs().join(","),
            })
            .set(1);
        if let Some(read_at) = port.counters_timestamp {
            match st.port_counters_added.get_mut(&labels) {
                Some(added) if *added == read_at => return,
                Some(added) => *added = read_at,
                None => {
                    st.port_counters_added.insert(labels.clone(), read_at);
                }
            }
        }
        if let Some(b) = port.transmit_bytes() {
            accumulate(&f.port_tx_bytes, &mut st.port_tx, labels.clone(), b);
        }
        if let Some(b) = port.receive_bytes() {
            accumulate(&f.port_rx_bytes, &mut st.port_rx, labels, b);
        }
        // The port error counters and the driver's hw_counters: one loop, two tables.
        for (names, values, family, readers) in [
            (
                ERROR_COUNTERS,
                &port.counters,
                &f.port_errors,
                &mut st.port_errors,
            ),
            (HW_COUNTERS, &port.hw_counters, &f.port_hw, &mut st.port_hw),
        ] {
            for &counter in names {
                if let Some(&v) = values.get(counter) {
                    let l = PortCounterLabels {
                        device: device.to_owned(),
                        port: port.port,
                        counter,
                    };
                    accumulate(family, readers, l, v);
                }
            }
        }
    }

    /// Netdev byte counters; returns the errors the netdev probe reported.
    fn record_netdevs(&self, report: &ProbeReport, st: &mut Readers) -> usize {
        let f = &self.families;
        let mut errors = 0;
        for nd in &report.netdevs {
            errors += nd.errors.len();
            let l = DeviceLabels {
                device: nd.name.clone(),
            };
            if let Some(b) = nd.rx_bytes {
                accumulate(&f.netdev_rx_bytes, &mut st.netdev_rx, l.clone(), b);
            }
            if let Some(b) = nd.tx_bytes {
                accumulate(&f.netdev_tx_bytes, &mut st.netdev_tx, l, b);
            }
        }
        errors
    }

    /// Mount gauges (cleared first: an unmounted path disappears); returns the storage errors.
    fn record_mounts(&self, storage: &StorageReport) -> usize {
        let f = &self.families;
        for fam in [
            &f.mount_up,
            &f.mount_hung,
            &f.mount_free_bytes,
            &f.mount_available_bytes,
            &f.mount_free_inodes,
        ] {
            fam.clear();
        }
        f.mount_statfs_seconds.clear();
        let (mounts, errors) = mount_samples(storage);
        let as_gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for m in mounts {
            let l = MountLabels { mount: m.mount };
            f.mount_up.get_or_create(&l).set(i64::from(m.up));
            f.mount_hung.get_or_create(&l).set(i64::from(m.hung));
            if let Some(s) = m.statfs_seconds {
                f.mount_statfs_seconds.get_or_create(&l).set(s);
            }
            for (family, value) in [
                (&f.mount_free_bytes, m.free_bytes),
                (&f.mount_available_bytes, m.available_bytes),
                (&f.mount_free_inodes, m.free_inodes),
            ] {
                if let Some(v) = value {
                    family.get_or_create(&l).set(as_gauge(v));
                }
            }
        }
        errors
    }

    fn record_gpudirect(&self, report: &ProbeReport, verdict: &Verdict) {
        let f = &self.families;
        let gd = &report.gpudirect;
        f.gpudirect_ready
            .set(i64::from(verdict.gpudirect.part.ready));
        f.gpudirect_gpus
            .set(i64::try_from(gd.gpus.len()).unwrap_or(i64::MAX));
        f.gpudirect_pair_relation.clear();
        for p in &gd.pairs {
            f.gpudirect_pair_relation
                .get_or_create(&GpuPairLabels {
                    gpu: p.gpu.clone(),
                    hca: p.hca.clone(),
                    relation: p.relation.name(),
                    numa: p.numa.map_or(String::new(), |n| n.to_string()),
                })
                .set(i64::from(p.relation.rank()));
        }
        set_optional(
            &f.gpudirect_worst_relation,
            gd.worst_relation.map(|r| f64::from(r.rank())),
        );
        let redirecting: std::collections::BTreeSet<&str> = gd
            .pairs
            .iter()
            .flat_map(|p| p.redirecting_bridges())
            .map(|b| b.address.as_str())
            .collect();
        f.gpudirect_acs_redirect_bridges
            .set(i64::try_from(redirecting.len()).unwrap_or(i64::MAX));
        f.gpudirect_peer_memory.set(i64::from(gd.peermem.usable()));
        f.port_active_mtu.clear();
        f.port_ecn_enabled.clear();
        for t in &gd.transport {
            if let Some(mtu) = t.active_mtu {
                f.port_active_mtu
                    .get_or_create(&PortLabels {
                        device: t.device.clone(),
                        port: t.port,
                    })
                    .set(i64::from(mtu));
            }
            let Some(ecn) = &t.ecn else { continue };
            for (point, map) in [("np", &ecn.np), ("rp", &ecn.rp)] {
                if let Some(on) = map.get(&self.ecn_priority) {
                    f.port_ecn_enabled
                        .get_or_create(&EcnLabels {
                            device: t.device.clone(),
                            port: t.port,
                            point,
                        })
                        .set(i64::from(*on));
                }
            }
        }
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

/// Order the series of every family by their labels. prometheus-client keeps a family's
/// series in a hash map, so its order changes from scrape to scrape; a stable order keeps the
/// golden file exact and diffs of two scrapes readable. The lines of one series (a
/// histogram's buckets, sum and count) stay together and in their order.
pub(crate) fn sort_series(text: &str) -> String {
    /// The series' labels without `le` (a histogram's bucket lines differ only in `le`,
    /// which the classic encoder writes last and the OpenMetrics encoder first).
    fn series_key(line: &str) -> Cow<'_, str> {
        let labels = line.find('{').map_or("", |open| {
            let close = line.rfind('}').unwrap_or(line.len());
            &line[open + 1..close]
        });
        let le = if labels.starts_with("le=\"") {
            Some(0)
        } else {
            labels.find(",le=\"").map(|i| i + 1)
        };
        let Some(start) = le else {
            return Cow::Borrowed(labels);
        };
        let value_start = start + 4;
        let end = labels[value_start..]
            .find('"')
            .map_or(labels.len(), |i| value_start + i + 1);
        let (before, after) = (
            labels[..start].trim_end_matches(','),
            labels[end..].trim_start_matches(','),
        );
        match (before.is_empty(), after.is_empty()) {
            (_, true) => Cow::Borrowed(before),
            (true, false) => Cow::Borrowed(after),
            (false, false) => Cow::Owned(format!("{before},{after}")),
        }
    }
    fn flush(out: &mut String, groups: &mut Vec<(Cow<'_, str>, Vec<&str>)>) {
        groups.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, lines) in groups.drain(..) {
            for l in lines {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut groups: Vec<(Cow<'_, str>, Vec<&str>)> = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            flush(&mut out, &mut groups);
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let key = series_key(line);
        match groups.last_mut() {
            Some((k, lines)) if *k == key => lines.push(line),
            _ => groups.push((key, vec![line])),
        }
    }
    flush(&mut out, &mut groups);
    out
}

/// What the metrics need of one checked mount.
#[derive(Debug, Clone, PartialEq)]
pub struct MountSample {
    pub mount: String,
    pub up: bool,
    pub hung: bool,
    pub statfs_seconds: Option<f64>,
    pub free_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    pub free_inodes: Option<u64>,
}

/// The per-mount figures of a storage report, and the number of storage errors (problems
/// not tied to one mount, Lustre client errors, and mounts whose statfs failed).
pub fn mount_samples(report: &StorageReport) -> (Vec<MountSample>, usize) {
    let samples = report
        .mounts
        .iter()
        .map(|m| {
            let capacity = m.capacity.as_ref();
            MountSample {
                mount: m.path.clone(),
                up: !matches!(
                    m.status,
                    MountStatus::Missing | MountStatus::Hung | MountStatus::Error
                ),
                hung: m.status == MountStatus::Hung,
                statfs_seconds: m.statfs_seconds,
                free_bytes: capacity.map(|c| c.free_bytes),
                available_bytes: capacity.map(|c| c.available_bytes),
                free_inodes: capacity.and_then(|c| c.free_inodes),
            }
        })
        .collect();
    let failed = report
        .mounts
        .iter()
        .filter(|m| m.status == MountStatus::Error)
        .count();
    (
        samples,
        report.errors.len() + report.client.errors.len() + failed,
    )
}

/// True when the scraper's `Accept` header asks for OpenMetrics (Prometheus 2.x asks for it
/// first, with the classic text format as a fallback).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            let mut params = part.split(';');
            let media = params.next().unwrap_or("").trim();
            let q_zero = params.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f64>().ok())
                    == Some(0.0)
            });
            media.eq_ignore_ascii_case("application/openmetrics-text") && !q_zero
        })
    })
}

/// `?format=openmetrics|prometheus` overrides the `Accept` header (Prometheus before 2.49
/// cannot choose the format a scrape asks for, but can add URL parameters).
fn format_override(query: Option<&str>) -> Option<bool> {
    query?.split('&').find_map(|kv| match kv {
        "format=openmetrics" => Some(true),
        "format=prometheus" => Some(false),
        _ => None,
    })
}

async fn metrics_handler(
    State(metrics): State<Arc<Metrics>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let openmetrics = format_override(uri.query()).unwrap_or_else(|| {
        wants_openmetrics(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()))
    });
    let body = metrics.exposition(openmetrics);
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        PROMETHEUS_CONTENT_TYPE
    };
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
        body,
    )
        .into_response()
}

async fn readyz_handler(State(metrics): State<Arc<Metrics>>) -> Response {
    match metrics.health.readiness() {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn healthz_handler(State(metrics): State<Arc<Metrics>>) -> Response {
    match metrics.health.liveness() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("unhealthy: {why}\n"),
        )
            .into_response(),
    }
}

impl crate::observe::server::ServerObserver for Metrics {
    fn connection(&self, admission: crate::observe::server::Admission, open: usize) {
        let f = &self.families;
        f.http_connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
        let why = match admission {
            crate::observe::server::Admission::Admitted => return,
            crate::observe::server::Admission::Evicted => "evicted",
            crate::observe::server::Admission::Rejected => "rejected",
        };
        f.http_dropped.get_or_create(&WhyLabels { why }).inc();
    }

    fn closed(&self, open: usize) {
        self.families
            .http_connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }
}

async fn index_handler() -> &'static str {
    "fabricgate: /metrics /healthz /readyz\n"
}

/// The HTTP routes, for callers that embed them in their own server.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/", get(index_handler))
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz_handler))
        .route("/readyz", get(readyz_handler))
        .with_state(metrics)
}

/// Serve `/metrics`, `/healthz`, `/readyz` on `listener` until `shutdown` completes.
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_limits(listener, metrics, Limits::default(), shutdown).await
}

/// [`serve`] within explicit connection limits (the agent derives them from `RLIMIT_NOFILE`).
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve_with_limits(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let observer: Arc<dyn crate::observe::server::ServerObserver> = Arc::clone(&metrics) as _;
    crate::observe::server::serve(listener, router(metrics), limits, observer, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_counters_reach_the_served_exposition_without_the_state_lock() {
        let m = Metrics::new();
        let text = |m: &Metrics| String::from_utf8_lossy(&m.exposition(false)).into_owned();
        assert!(text(&m).contains("fabricgate_probe_trigger_total{trigger=\"interval\"} 0"));
        // Counted by the probe loop, outside the state lock: the next scrape shows it.
        m.events
            .probe_triggered(&crate::observe::events::Trigger::Interval);
        assert!(text(&m).contains("fabricgate_probe_trigger_total{trigger=\"interval\"} 1"));
        m.set_breaker_open(true);
        assert!(text(&m).contains("fabricgate_breaker_open 1"));
    }

    #[test]
    fn breaker_open_is_exported() {
        let m = Metrics::new();
        assert!(m.encode(false).contains("fabricgate_breaker_open 0"));
        m.set_breaker_open(true);
        assert!(m.encode(false).contains("fabricgate_breaker_open 1"));
        m.set_breaker_open(false);
        assert!(m.encode(false).contains("fabricgate_breaker_open 0"));
    }

    #[test]
    fn accept_header_negotiation() {
        let prom2 = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                     version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prom2)));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
        assert_eq!(format_override(Some("format=prometheus")), Some(false));
        assert_eq!(format_override(Some("a=b&format=openmetrics")), Some(true));
        assert_eq!(format_override(Some("format=xml")), None);
        assert_eq!(format_override(None), None);
    }

    #[test]
    fn series_are_sorted_by_labels_and_histogram_lines_stay_together() {
        let text = "# TYPE a gauge\na{d=\"b\"} 2\na{d=\"a\"} 1\n# TYPE h histogram\n\
                    h_bucket{p=\"z\",le=\"1\"} 1\nh_bucket{p=\"z\",le=\"+Inf\"} 1\n\
                    h_sum{p=\"z\"} 1\nh_count{p=\"z\"} 1\nh_bucket{p=\"a\",le=\"1\"} 0\n\
                    h_bucket{p=\"a\",le=\"+Inf\"} 0\nh_sum{p=\"a\"} 0\nh_count{p=\"a\"} 0\n\
                    # TYPE u histogram\nu_bucket{le=\"5\"} 1\nu_bucket{le=\"10\"} 1\nu_sum 1\nu_count 1\n";
        let want = "# TYPE a gauge\na{d=\"a\"} 1\na{d=\"b\"} 2\n# TYPE h histogram\n\
                    h_bucket{p=\"a\",le=\"1\"} 0\nh_bucket{p=\"a\",le=\"+Inf\"} 0\n\
                    h_sum{p=\"a\"} 0\nh_count{p=\"a\"} 0\nh_bucket{p=\"z\",le=\"1\"} 1\n\
                    h_bucket{p=\"z\",le=\"+Inf\"} 1\nh_sum{p=\"z\"} 1\nh_count{p=\"z\"} 1\n\
                    # TYPE u histogram\nu_bucket{le=\"5\"} 1\nu_bucket{le=\"10\"} 1\nu_sum 1\nu_count 1\n";
        assert_eq!(sort_series(text), want);
        let om = "# TYPE h histogram\nh_bucket{le=\"1\",p=\"z\"} 1\nh_bucket{le=\"+Inf\",p=\"z\"} 1\n\
                  h_count{p=\"z\"} 1\nh_bucket{le=\"1\",p=\"a\"} 0\nh_bucket{le=\"+Inf\",p=\"a\"} 0\n\
                  h_count{p=\"a\"} 0\n# EOF\n";
        let want = "# TYPE h histogram\nh_bucket{le=\"1\",p=\"a\"} 0\nh_bucket{le=\"+Inf\",p=\"a\"} 0\n\
                    h_count{p=\"a\"} 0\nh_bucket{le=\"1\",p=\"z\"} 1\nh_bucket{le=\"+Inf\",p=\"z\"} 1\n\
                    h_count{p=\"z\"} 1\n# EOF\n";
        assert_eq!(sort_series(om), want);
    }
}
