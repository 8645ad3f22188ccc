//! The TCP path's byte counters (`<sysfs>/class/net/<if>/statistics/{rx,tx}_bytes`): the
//! silent-fallback detector's input and `fabricgate_netdev_{receive,transmit}_bytes_total`. No
//! part of the verdict of its own (the fallback detector judges it, in observe::fallback).

mod metrics;

use super::Subsystem;
use crate::config::Config;
use crate::observe::metrics::CheckMetrics;
use crate::policy::check::NodeCheck;
use fabricgate_probes::Roots;
use fabricgate_probes::collect::Collector;
use fabricgate_probes::netdev::{self, NetdevConfig, NetdevReader};
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// `fallback.netdevs`, or every physical interface.
pub struct Netdev;

impl Subsystem for Netdev {
    fn name(&self) -> &'static str {
        netdev::NAME
    }

    fn collector(&self, config: &Config, roots: &Roots) -> Box<dyn Collector> {
        let interfaces = config.fallback.netdevs.clone();
        Box::new(NetdevReader::new(roots, NetdevConfig { interfaces }))
    }

    fn check(&self) -> Option<Arc<dyn NodeCheck>> {
        None
    }

    fn metrics(&self, registry: &mut Registry, _config: &Config) -> Box<dyn CheckMetrics> {
        Box::new(metrics::NetdevMetrics::register(registry))
    }
}
