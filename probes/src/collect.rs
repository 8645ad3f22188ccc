//! One subsystem's probe behind one interface: a [`Collector`] reads what its subsystem knows
//! once per probe and hands back a [`Fact`], which the [`crate::Prober`] files in the report
//! under the subsystem's name (its key in `check`'s JSON, its `probe` label in the metrics).
//! The agent's side of the same subsystem judges that fact and records its metrics
//! (docs/design.md, "Where a new check goes").

use crate::report::ProbeReport;
use crate::roots::Roots;
use std::fmt;
use std::sync::Arc;

pub use crate::fact::{Fact, Facts, RESERVED_NAMES, valid_name};

/// The probe of one subsystem.
pub trait Collector: Send {
    /// The subsystem's name, its `probe` label and timing (`<name>_seconds`): `[a-z_]+`,
    /// unique, none of the report's own keys.
    fn name(&self) -> &'static str;

    /// Its key in the report (and `check`'s JSON), when it is not the name (`netdevs`, the
    /// TCP path's counters, a list named in the plural before it was a collector).
    fn key(&self) -> &'static str {
        self.name()
    }

    /// Probe once. Never panics on system input; what it cannot read goes in the fact's
    /// errors.
    fn collect(&mut self, pass: &Pass<'_>) -> Fact;
}

/// One probe, as a collector sees it.
#[derive(Debug, Clone, Copy)]
pub struct Pass<'a> {
    pub roots: &'a Roots,
    /// This probe so far: the RDMA probe and the collectors registered before this one (the
    /// host checks come after them all).
    pub report: &'a ProbeReport,
    /// Whether this probe reads the slow attributes (`rdma.counters_interval`): a collector
    /// with costly reads does them then.
    pub slow: bool,
}

/// Makes a registered subsystem's collector, once per [`crate::Prober`] (the agent's
/// registration list fills [`crate::ProbeConfig::collectors`] with these).
#[derive(Clone)]
pub struct NewCollector(Arc<MakeCollector>);

type MakeCollector = dyn Fn(&Roots) -> Box<dyn Collector> + Send + Sync;

impl NewCollector {
    pub fn new(make: impl Fn(&Roots) -> Box<dyn Collector> + Send + Sync + 'static) -> Self {
        Self(Arc::new(make))
    }

    pub fn make(&self, roots: &Roots) -> Box<dyn Collector> {
        (self.0)(roots)
    }
}

impl fmt::Debug for NewCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NewCollector")
    }
}
