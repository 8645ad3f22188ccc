//! All of fabricgate's hardware and OS knowledge: RDMA devices (sysfs and verbs), mounts and
//! Lustre. Synchronous and free of Kubernetes; every path comes from one [`Roots`].

pub mod error;
pub mod rdma;
pub mod roots;
pub mod storage;

pub use error::{ProbeError, Result};
pub use roots::Roots;

use rdma::verbs::selftest::{self, SelftestSchedule};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What to probe and how.
#[derive(Debug, Clone, Default)]
pub struct ProbeConfig {
    pub verbs: rdma::VerbsMode,
    pub storage: storage::StorageConfig,
    pub selftest: SelftestConfig,
}

/// The loopback data-path self-test (needs `verbs: Required`).
#[derive(Debug, Clone)]
pub struct SelftestConfig {
    pub schedule: SelftestSchedule,
    /// Bound on one port's test.
    pub timeout: Duration,
    /// Glob over device names to test (the requirements' `rdma.devices`); `None`: all.
    pub devices: Option<String>,
}

impl Default for SelftestConfig {
    fn default() -> Self {
        Self {
            schedule: SelftestSchedule::default(),
            timeout: selftest::DEFAULT_TIMEOUT,
            devices: None,
        }
    }
}

impl SelftestConfig {
    /// An invalid glob matches nothing (the agent's config validation rejects it first).
    fn matcher(&self) -> Option<globset::GlobMatcher> {
        let pattern = self.devices.as_deref().unwrap_or("*");
        globset::Glob::new(pattern)
            .ok()
            .map(|g| g.compile_matcher())
    }
}

/// What the prober remembers about one port between probes, for the self-test schedule.
#[derive(Debug, Clone, Default)]
struct PortMemory {
    was_up: bool,
    last: Option<rdma::SelftestResult>,
}

/// One probe of the node.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// Seconds since the Unix epoch when the probe started.
    pub timestamp: f64,
    pub rdma: rdma::RdmaReport,
    pub storage: storage::StorageReport,
    pub timings: ProbeTimings,
}

/// Wall time of each probe kind, for `fabricgate_probe_duration_seconds{probe=...}`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProbeTimings {
    pub rdma_sysfs_seconds: f64,
    pub rdma_verbs_seconds: f64,
    pub storage_seconds: f64,
}

/// Holds the state that must outlive a single probe (the statfs workers that may be stuck on a
/// hung mount), so the daemon keeps one `Prober` for its whole life.
pub struct Prober {
    roots: Roots,
    config: ProbeConfig,
    storage: storage::StorageProber,
    /// Probes completed so far (drives `every N probes`).
    probes: u64,
    ports: BTreeMap<(String, u32), PortMemory>,
}

impl Prober {
    pub fn new(roots: Roots, config: ProbeConfig) -> Self {
        let storage = storage::StorageProber::new(config.storage.clone());
        Self {
            roots,
            config,
            storage,
            probes: 0,
            ports: BTreeMap::new(),
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
            self.selftest(&mut rdma);
            timings.rdma_verbs_seconds = started.elapsed().as_secs_f64();
        }
        self.probes += 1;

        let started = Instant::now();
        let storage = self.storage.probe(&self.roots);
        timings.storage_seconds = started.elapsed().as_secs_f64();

        ProbeReport {
            timestamp,
            rdma,
            storage,
            timings,
        }
    }

    /// Run the data-path self-test where the schedule says so, and report the last result
    /// elsewhere. A port is tested when it comes up (first probe included), every N probes
    /// with `every N probes`, and on every probe while its last test failed, so a repaired
    /// port recovers without a restart. Ports that are down or on devices verbs cannot open
    /// are not tested: the verdict already names why they are unusable.
    fn selftest(&mut self, rdma: &mut rdma::RdmaReport) {
        let cfg = &self.config.selftest;
        let every_due = match cfg.schedule {
            SelftestSchedule::Off => return,
            SelftestSchedule::OnStart => false,
            SelftestSchedule::Every(n) => self.probes % u64::from(n.max(1)) == 0,
        };
        let Some(matcher) = cfg.matcher() else {
            return;
        };
        let memory = &mut self.ports;
        let mut select = |dev: &rdma::DeviceReport, port: &rdma::PortReport| {
            let opened = dev.verbs.as_ref().is_some_and(|v| v.opened);
            if !opened || !port.is_up() || !matcher.is_match(&dev.name) {
                return false;
            }
            let mem = memory.get(&(dev.name.clone(), port.port));
            every_due || mem.is_none_or(|m| !m.was_up || m.last.as_ref().is_none_or(|r| !r.ok))
        };
        selftest::run(rdma, &mut select, cfg.timeout);

        let mut seen = Vec::new();
        for dev in &mut rdma.devices {
            for port in &mut dev.ports {
                let key = (dev.name.clone(), port.port);
                let mem = memory.entry(key.clone()).or_default();
                match &port.selftest {
                    Some(fresh) => mem.last = Some(fresh.clone()),
                    None => port.selftest = mem.last.clone(),
                }
                mem.was_up = port.is_up();
                seen.push(key);
            }
        }
        // A device that vanished (e.g. `rdma link delete`) is tested afresh if it returns.
        memory.retain(|k, _| seen.contains(k));
    }
}
