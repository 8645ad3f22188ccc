//! GPUDirect RDMA (`gpudirect:`): which GPUs the node has, the PCIe relation between each GPU
//! and its nearest HCA, ACS on the paths, the peer-memory path; and the RDMA ports' transport
//! settings (MTU, ECN) its probe reads, which the RDMA policy judges too
//! (`fabricgate_probes::gpudirect::transport_of`). Its probe is
//! `probes/src/gpudirect/` ([gpudirect.md](../../../docs/gpudirect.md)).

mod judge;
mod metrics;
mod table;
#[cfg(test)]
mod tests;

use super::Subsystem;
use crate::config::Config;
use crate::observe::metrics::CheckMetrics;
use crate::policy::check::NodeCheck;
use crate::policy::Verdict;
use fabricgate_probes::{ProbeReport, Roots};
use fabricgate_probes::collect::Collector;
use fabricgate_probes::gpudirect::{GpudirectConfig, GpudirectReader};
use prometheus_client::registry::Registry;
use std::sync::Arc;

pub use fabricgate_probes::gpudirect::NAME;

pub struct Gpudirect;

impl Subsystem for Gpudirect {
    fn name(&self) -> &'static str {
        NAME
    }

    fn collector(&self, config: &Config, roots: &Roots) -> Box<dyn Collector> {
        let hca_devices = Some(config.rdma.devices.as_str().to_owned());
        Box::new(GpudirectReader::new(roots, GpudirectConfig { hca_devices }))
    }

    fn check(&self) -> Option<Arc<dyn NodeCheck>> {
        Some(Arc::new(judge::GpudirectCheck))
    }

    fn metrics(&self, registry: &mut Registry, config: &Config) -> Box<dyn CheckMetrics> {
        Box::new(metrics::GpudirectMetrics::register(registry, config))
    }

    fn table(&self, out: &mut String, report: &ProbeReport, verdict: &Verdict) {
        table::table(out, report, verdict);
    }
}
