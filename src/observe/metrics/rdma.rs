//! The RDMA ports' families (`fabricgate_rdma_port_*`, `fabricgate_rdma_selftest_*`): their
//! registration and what one probe records in them, the kernel counters through their
//! reset-proof accumulators, and the series of a device gone for longer than the grace
//! dropped.

use super::{GaugeF64, Monotonic};
use crate::observe::counters::{accumulate, drop_series, expire};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::rdma::PortReport;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::collections::HashMap;

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

/// Handles on the RDMA ports' families (each is an `Arc` inside, shared with the registry).
#[derive(Debug, Default)]
pub(super) struct RdmaFamilies {
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
}

/// Reader state behind the ports' counters: the last raw value of every kernel counter series.
#[derive(Debug, Default)]
pub(super) struct RdmaReaders {
    port_tx: HashMap<PortLabels, Monotonic>,
    port_rx: HashMap<PortLabels, Monotonic>,
    port_errors: HashMap<PortCounterLabels, Monotonic>,
    port_hw: HashMap<PortCounterLabels, Monotonic>,
    /// Each port's `counters_timestamp` when its counters were last added: between two reads
    /// (`rdma.counters_interval`) a report carries the same values, which add nothing.
    port_counters_added: HashMap<PortLabels, f64>,
    /// When each RDMA device was last in a report (stale-series pruning).
    rdma_seen: HashMap<String, std::time::Instant>,
}

impl RdmaFamilies {
    pub(super) fn register(&self, r: &mut Registry) {
        let f = self;
        reg!(
            r,
            "rdma_port_state",
            "Logical port state (ports/N/state): 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER",
            f.port_state
        );
        reg!(
            r,
            "rdma_port_phys_state",
            "Physical port state (ports/N/phys_state): 2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery",
            f.port_phys_state
        );
        reg!(
            r,
            "rdma_port_rate_gbps",
            "Negotiated port rate in Gb/s (ports/N/rate)",
            f.port_rate_gbps
        );
        reg!(
            r,
            "rdma_port_up",
            "1 when the port is ACTIVE and LinkUp, else 0",
            f.port_up
        );
        reg!(
            r,
            "rdma_selftest_ok",
            "1 when the last loopback RC data-path self-test on the port passed, 0 when it failed",
            f.selftest_ok
        );
        reg!(
            r,
            "rdma_selftest_latency",
            "Round-trip latency of the last passing data-path self-test",
            f.selftest_latency,
            Unit::Seconds
        );
        reg!(
            r,
            "rdma_port_info",
            "Port attributes as labels (link layer, netdev of a RoCE port); always 1",
            f.port_info
        );
        reg!(
            r,
            "rdma_port_transmit",
            "Data octets sent by the port (port_xmit_data x 4)",
            f.port_tx_bytes,
            Unit::Bytes
        );
        reg!(
            r,
            "rdma_port_receive",
            "Data octets received by the port (port_rcv_data x 4)",
            f.port_rx_bytes,
            Unit::Bytes
        );
        reg!(
            r,
            "rdma_port_errors",
            "Port error counters (ports/N/counters), by counter file name",
            f.port_errors
        );
        reg!(
            r,
            "rdma_port_hw_events",
            "Driver hw_counters (RoCE retries, sequence errors, congestion notifications), by name",
            f.port_hw
        );
    }

    /// Counters of a device gone for longer than `grace` (renamed, removed) are dropped, so
    /// /metrics does not grow with every device name ever seen.
    pub(super) fn expire(
        &self,
        report: &ProbeReport,
        st: &mut RdmaReaders,
        grace: std::time::Duration,
    ) {
        let now = std::time::Instant::now();
        let gone = expire(
            &mut st.rdma_seen,
            report.rdma.devices.iter().map(|d| d.name.clone()),
            now,
            grace,
        );
        if !gone.is_empty() {
            let port_gone = |l: &PortLabels| gone.contains(&l.device);
            let counter_gone = |l: &PortCounterLabels| gone.contains(&l.device);
            drop_series(&self.port_tx_bytes, &mut st.port_tx, port_gone);
            drop_series(&self.port_rx_bytes, &mut st.port_rx, port_gone);
            drop_series(&self.port_errors, &mut st.port_errors, counter_gone);
            drop_series(&self.port_hw, &mut st.port_hw, counter_gone);
            st.port_counters_added.retain(|l, _| !port_gone(l));
        }
    }

    /// Port gauges and counters; returns the errors the sysfs and verbs probes reported.
    pub(super) fn record(&self, report: &ProbeReport, st: &mut RdmaReaders) -> (usize, usize) {
        let f = self;
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

    fn record_port(&self, device: &str, port: &PortReport, st: &mut RdmaReaders) {
        let f = self;
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
}
