//! A registered subsystem's own metric families (src/checks/), and a feature's: registered beside
//! the built-in ones and recorded under the same lock with each probe, so a scrape never sees half a probe.
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

    /// With a feature's own families (DRA's `fabricgate_dra_*`) registered among the cached
    /// ones: the feature keeps its handles and changes them through [`Self::changing`].
    #[must_use]
    pub fn with_families<T>(mut self, register: impl FnOnce(&mut Registry) -> T) -> (Self, T) {
        let families = register(&mut self.registry);
        (self, families)
    }

    /// Run `change` (a feature's families changing) under the state lock, marking the cached
    /// exposition stale: a scrape sees all of the change or none of it.
    pub fn changing<R>(&self, change: impl FnOnce() -> R) -> R {
        let _guard = self.lock();
        change()
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
