//! Recording a probe: the verdict, the RDMA ports (`rdma.rs`), the probes' durations and
//! errors, the fallback detector's conclusion and the registered subsystems' families.

use super::{FindingLabels, Metrics, ProbeLabels, set_optional};
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;

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
        let (errors_sysfs, errors_verbs) = self.families.rdma.record(report, &mut st.rdma);
        let t = &report.timings;
        let verbs_ran = report.rdma.verbs.is_some();
        self.record_probe_kind("rdma_sysfs", Some(t.rdma_sysfs_seconds), errors_sysfs);
        let verbs_seconds = verbs_ran.then_some(t.rdma_verbs_seconds);
        self.record_probe_kind("rdma_verbs", verbs_seconds, errors_verbs);
        let f = &self.families;
        f.last_probe_timestamp.set(report.timestamp);

        let grace = st.series_grace;
        f.rdma.expire(report, &mut st.rdma, grace);
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
}
