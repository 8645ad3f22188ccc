//! Shared storage (`lustre:`, `mounts:`, `storage.lustre.require_lnet`): every required mount
//! stat'ed within its timeout on the probe's own workers (a hung Lustre mount never hangs the
//! agent), the Lustre client's health, imports and LNet networks. Its probe is
//! `probes/src/storage/` (key `storage`); its part is `lustre` (`LustreReady`, the label
//! `lustre.ready`, `check`'s `lustre` object).

mod judge;
mod metrics;
mod table;
#[cfg(test)]
mod tests;

use super::Subsystem;
use crate::config::Config;
use crate::observe::metrics::CheckMetrics;
use crate::policy::Verdict;
use crate::policy::check::NodeCheck;
use fabricgate_probes::collect::Collector;
use fabricgate_probes::storage::{NAME, StorageProber};
use fabricgate_probes::{ProbeReport, Roots};
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// Its part of the verdict: the scope of its findings, its label and `check`'s key.
pub use crate::policy::LUSTRE as CHECK;

pub struct Storage;

impl Subsystem for Storage {
    fn name(&self) -> &'static str {
        NAME
    }

    fn collector(&self, config: &Config, _roots: &Roots) -> Box<dyn Collector> {
        Box::new(StorageProber::new(config.storage_config()))
    }

    fn check(&self) -> Option<Arc<dyn NodeCheck>> {
        Some(Arc::new(judge::LustreCheck))
    }

    fn metrics(&self, registry: &mut Registry, _config: &Config) -> Box<dyn CheckMetrics> {
        Box::new(metrics::StorageMetrics::register(registry))
    }

    fn table(&self, out: &mut String, report: &ProbeReport, verdict: &Verdict) {
        table::table(out, report, verdict);
    }
}
