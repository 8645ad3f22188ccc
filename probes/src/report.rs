//! One probe of the node as the [`crate::Prober`] hands it over: the built-in probes' typed
//! reports and the registered collectors' facts.

use crate::fact::Facts;
use crate::{host, rdma};
use serde::Serialize;
use std::collections::BTreeMap;

/// One probe of the node.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProbeReport {
    /// Seconds since the Unix epoch when the probe started.
    pub timestamp: f64,
    pub rdma: rdma::RdmaReport,
    pub timings: ProbeTimings,
    /// What the host shows beside the hardware (not in `check`'s JSON: the policy turns it
    /// into findings and agent errors).
    #[serde(skip)]
    pub host: host::HostReport,
    /// What each registered [`crate::collect::Collector`] found, under its name.
    #[serde(flatten)]
    pub facts: Facts,
}

/// Wall time of each probe kind, for `fabricgate_probe_duration_seconds{probe=...}`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProbeTimings {
    pub rdma_sysfs_seconds: f64,
    pub rdma_verbs_seconds: f64,
    /// Each registered collector's, as `<name>_seconds`.
    #[serde(flatten)]
    pub collected: BTreeMap<String, f64>,
}

impl ProbeTimings {
    /// The wall time of collector `name` in this probe, when it ran.
    pub fn collected(&self, name: &str) -> Option<f64> {
        self.collected.get(&format!("{name}_seconds")).copied()
    }
}
