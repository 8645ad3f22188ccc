//! All of fabricgate's hardware and OS knowledge: RDMA devices (sysfs and verbs), mounts and
//! Lustre. Synchronous and free of Kubernetes; every path comes from one [`Roots`].

pub mod error;
pub mod netdev;
pub mod rdma;
pub mod roots;
pub mod storage;

pub use error::{ProbeError, Result};
pub use roots::Roots;

use serde::Serialize;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What to probe and how.
#[derive(Debug, Clone, Default)]
pub struct ProbeConfig {
    pub verbs: rdma::VerbsMode,
    pub storage: storage::StorageConfig,
    /// Interfaces whose TCP-path byte counters are read (the fallback detector's input).
    pub netdev: netdev::NetdevConfig,
}

/// One probe of the node.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// Seconds since the Unix epoch when the probe started.
    pub timestamp: f64,
    pub rdma: rdma::RdmaReport,
    pub storage: storage::StorageReport,
    /// TCP-path byte counters of the configured (or physical) network interfaces.
    pub netdevs: Vec<netdev::NetdevReport>,
    pub timings: ProbeTimings,
}

/// Wall time of each probe kind, for `fabricgate_probe_duration_seconds{probe=...}`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProbeTimings {
    pub rdma_sysfs_seconds: f64,
    pub rdma_verbs_seconds: f64,
    pub storage_seconds: f64,
    pub netdev_seconds: f64,
}

/// Holds the state that must outlive a single probe (the statfs workers that may be stuck on a
/// hung mount), so the daemon keeps one `Prober` for its whole life.
pub struct Prober {
    roots: Roots,
    config: ProbeConfig,
    storage: storage::StorageProber,
}

impl Prober {
    pub fn new(roots: Roots, config: ProbeConfig) -> Self {
        let storage = storage::StorageProber::new(config.storage.clone());
        Self {
            roots,
            config,
            storage,
        }
    }

    pub fn roots(&self) -> &Roots {
        &self.roots
    }

    pub fn config(&self) -> &ProbeConfig {
        &self.config
    }

    /// Run every probe once. Never panics on system input and never blocks longer than the
    /// configured statfs timeout plus a small margin.
    pub fn probe(&mut self) -> ProbeReport {
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs_f64();
        let mut timings = ProbeTimings::default();

        let started = Instant::now();
        let mut rdma = rdma::sysfs::probe(&self.roots);
        timings.rdma_sysfs_seconds = started.elapsed().as_secs_f64();

        if self.config.verbs == rdma::VerbsMode::Required {
            let started = Instant::now();
            rdma::verbs::probe_into(&mut rdma);
            timings.rdma_verbs_seconds = started.elapsed().as_secs_f64();
        }

        let started = Instant::now();
        let storage = self.storage.probe(&self.roots);
        timings.storage_seconds = started.elapsed().as_secs_f64();

        let started = Instant::now();
        let netdevs = netdev::probe(&self.roots, &self.config.netdev);
        timings.netdev_seconds = started.elapsed().as_secs_f64();

        ProbeReport {
            timestamp,
            rdma,
            storage,
            netdevs,
            timings,
        }
    }
}
