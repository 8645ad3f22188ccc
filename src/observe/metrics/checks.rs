//! A registered subsystem's own metric families (src/checks/): registered beside the built-in
//! ones and recorded under the same lock with each probe, so a scrape never sees half a probe.
//! Its `fabricgate_probe_duration_seconds{probe}` and `fabricgate_probe_errors_total{probe}`
//! series come with the registration.

use super::{Metrics, ProbeLabels};
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use prometheus_client::registry::Registry;
use std::time::Duration;

/// How one subsystem records a probe in its own families.
pub trait CheckMetrics: Send + Sync + std::fmt::Debug {
    /// Record one probe. `series_grace`: how long the series of something that vanished stay
    /// (`--stale-series-grace`).
    fn record(&self, report: &ProbeReport, verdict: &Verdict, series_grace: Duration);
}

/// One registered subsystem's metrics: its probe's name and its recorder.
#[derive(Debug)]
pub(super) struct CheckRecorder {
    pub(super) probe: &'static str,
    pub(super) metrics: Box<dyn CheckMetrics>,
}

impl Metrics {
    /// With the registered subsystems' own families: `register` adds them to the registry and
    /// returns each one's probe name (its collector's) and recorder.
    #[must_use]
    pub fn with_checks(
        mut self,
        register: impl FnOnce(&mut Registry) -> Vec<(&'static str, Box<dyn CheckMetrics>)>,
    ) -> Self {
        for (probe, metrics) in register(&mut self.registry) {
            self.families
                .probe_errors
                .get_or_create(&ProbeLabels { probe })
                .inc_by(0);
            self.checks.push(CheckRecorder { probe, metrics });
        }
        self
    }

    /// The registered subsystems' part of one probe's record.
    pub(super) fn record_checks(&self, report: &ProbeReport, verdict: &Verdict, grace: Duration) {
        for CheckRecorder { probe, metrics } in &self.checks {
            let errors = report.facts.of_probe(probe).map_or(0, |f| f.errors().len());
            self.record_probe_kind(probe, report.timings.collected(probe), errors);
            metrics.record(report, verdict, grace);
        }
    }
}
