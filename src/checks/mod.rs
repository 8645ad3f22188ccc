//! The node's subsystems behind one interface: each one's probe (a [`Collector`] in the
//! probes crate), its part of the verdict ([`NodeCheck`], folded in by the one Judge) and its
//! own metrics ([`CheckMetrics`]), listed once in [`registered`]. A new subsystem is its
//! probe's file or folder in `probes/src/`, its folder here, and one line in `register!`
//! (docs/design.md, "Where a new check goes"). Its requirements, if any, are its own
//! `checks.<name>:` section of the file.
//!
//! This floor sits above `observe` (a subsystem implements the policy's and the metrics'
//! interfaces) and below the subcommands that probe, judge and record.

#[cfg(test)]
mod tests;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::observe::metrics::{CheckMetrics, Metrics};
use crate::policy::Verdict;
use crate::policy::check::{Checks, NodeCheck};
use fabricgate_probes::collect::{Collector, NewCollector};
use fabricgate_probes::{ProbeReport, Roots};
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// One subsystem: its probe, its judgment, its metrics.
pub trait Subsystem: Send + Sync {
    /// Its collector's name: the `probe` label, the key of its `checks.<name>:` section.
    fn name(&self) -> &'static str;

    /// Its probe, made once per prober.
    fn collector(&self, config: &Config, roots: &Roots) -> Box<dyn Collector>;

    /// Its part of the verdict (a Node condition, a label, findings); `None` for one that
    /// only probes and records (the TCP path's counters).
    fn check(&self) -> Option<Arc<dyn NodeCheck>>;

    /// Its own families, registered in `registry`, and their recorder.
    fn metrics(&self, registry: &mut Registry, config: &Config) -> Box<dyn CheckMetrics>;

    /// Its section of `check --format table`, if any (its findings are in the table's reasons
    /// and warnings already).
    fn table(&self, _out: &mut String, _report: &ProbeReport, _verdict: &Verdict) {}

    /// Its `checks.<name>:` section (or whatever of the file it reads) is valid.
    ///
    /// # Errors
    /// [`Error::ConfigParse`] or [`Error::ConfigValue`] naming the key (see
    /// [`crate::config::Section::read`]).
    fn validate(&self, _config: &Config) -> Result<()> {
        Ok(())
    }
}

/// Declares each subsystem's folder and lists it in [`registered`], in the order they probe:
/// one line a subsystem (`folder::Type`).
macro_rules! register {
    ($($folder:ident :: $subsystem:ident),* $(,)?) => {
        $(mod $folder;)*

        /// The registered subsystems, in the order they probe.
        pub fn registered() -> Registered {
            Registered::new(vec![$(Arc::new($folder::$subsystem)),*])
        }
    };
}

register! {
    storage::Storage,
    gpudirect::Gpudirect,
    netdev::Netdev,
}

/// What [`registered`] lists, handed to the prober, the Judge and the metrics.
#[derive(Clone)]
pub struct Registered(Vec<Arc<dyn Subsystem>>);

impl Registered {
    /// These subsystems, in this order (what [`registered`] builds; tests register their own).
    pub fn new(subsystems: Vec<Arc<dyn Subsystem>>) -> Self {
        Self(subsystems)
    }

    /// The subsystems, in the order they probe.
    pub fn iter(&self) -> impl Iterator<Item = &dyn Subsystem> {
        self.0.iter().map(|s| &**s)
    }

    /// For [`fabricgate_probes::ProbeConfig::collectors`].
    pub fn collectors(&self, config: &Config) -> Vec<NewCollector> {
        self.0
            .iter()
            .map(|s| {
                let (s, config) = (Arc::clone(s), config.clone());
                NewCollector::new(move |roots| s.collector(&config, roots))
            })
            .collect()
    }

    /// For [`crate::policy::judge::Judge::with_checks`] and
    /// [`crate::policy::evaluate_checked`].
    pub fn checks(&self) -> Checks {
        Checks::new(self.0.iter().filter_map(|s| s.check()).collect())
    }

    /// `metrics` with every subsystem's own families.
    pub fn metrics(&self, metrics: Metrics, config: &Config) -> Metrics {
        metrics.with_checks(|registry| {
            self.0
                .iter()
                .map(|s| (s.name(), s.metrics(registry, config)))
                .collect()
        })
    }

    /// Each subsystem's section of `config` is valid, and `checks:` names only registered
    /// ones.
    ///
    /// # Errors
    /// The first wrong value, naming its key.
    pub fn validate(&self, config: &Config) -> Result<()> {
        if let Some(unknown) = config
            .checks
            .keys()
            .find(|name| !self.0.iter().any(|s| s.name() == name.as_str()))
        {
            let known: Vec<&str> = self.0.iter().map(|s| s.name()).collect();
            return Err(Error::ConfigParse {
                path: Default::default(),
                message: format!(
                    "checks.{unknown}: no such subsystem; the registered ones are {}",
                    known.join(", ")
                ),
            });
        }
        self.0.iter().try_for_each(|s| s.validate(config))
    }
}
