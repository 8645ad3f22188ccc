//! Recording a probe: the verdict and port series, and the kernel
//! counters behind their reset-proof accumulators.

use super::{
    ERROR_COUNTERS, FindingLabels, HW_COUNTERS, Metrics, PortCounterLabels, PortInfoLabels,
    PortLabels, ProbeLabels, Readers, set_optional,
};
use crate::observe::counters::{accumulate, drop_series, expire};
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::rdma::PortReport;

impl Metrics {
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
        let t = &report.timings;
        let verbs_ran = report.rdma.verbs.is_some();
        self.record_probe_kind("rdma_sysfs", Some(t.rdma_sysfs_seconds), errors_sysfs);
        let verbs_seconds = verbs_ran.then_some(t.rdma_verbs_seconds);
        self.record_probe_kind("rdma_verbs", verbs_seconds, errors_verbs);
        let f = &self.families;
        f.last_probe_timestamp.set(report.timestamp);

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
        f.fallback_suspected.set(i64::from(fallback.suspected));
        set_optional(&f.fallback_tcp_rate, fallback.tcp_bytes_per_second);
        set_optional(&f.fallback_rdma_rate, fallback.rdma_bytes_per_second);
        self.record_checks(report, verdict, grace);
        drop(st);
        self.health.probe_completed();
    }

    /// One probe kind's wall time (`None`: it did not run) and errors, built-in or registered.
    pub(super) fn record_probe_kind(
        &self,
        probe: &'static str,
        seconds: Option<f64>,
        errors: usize,
    ) {
        let l = ProbeLabels { probe };
        if let Some(seconds) = seconds {
            self.probe_duration.get_or_create(&l).observe(seconds);
        }
        self.families
            .probe_errors
            .get_or_create(&l)
            .inc_by(u64::try_from(errors).unwrap_or(u64::MAX));
    }

    fn record_verdict(&self, verdict: &Verdict) {
        let f = &self.families;
        f.node_ready.set(i64::from(verdict.ready));
        f.rdma_ready.set(i64::from(verdict.rdma.part.ready));
        f.findings.clear();
        for finding in verdict.parts().flat_map(|p| &p.findings) {
            let scope = finding.scope.name();
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
}
