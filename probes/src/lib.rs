//! All of fabricgate's hardware and OS knowledge: RDMA devices (sysfs and verbs), mounts and
//! Lustre. Synchronous and free of Kubernetes; every path comes from one [`Roots`].
//! [`Prober::probe`] runs the built-in probes, then each registered [`collect::Collector`]
//! (the agent's list, `src/checks/`).
//!
//! `unsafe` is denied here and allowed on one module only, `rdma::verbs` (the libibverbs
//! wrapper), where every block carries a `// SAFETY:` comment (clippy enforces it).

#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod collect;
pub mod error;
pub mod events;
mod fact;
pub mod gpudirect;
pub mod host;
mod kept_files;
pub mod netdev;
pub mod netlink;
pub mod pod;
pub mod rdma;
mod report;
pub mod roots;
pub mod storage;
mod sysfs_io;
pub mod transport;

pub use error::{ProbeError, Result};
pub use report::{ProbeReport, ProbeTimings};
pub use roots::Roots;

use rdma::verbs::selftest::{self, SelftestSchedule};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What to probe and how.
#[derive(Debug, Clone, Default)]
pub struct ProbeConfig {
    pub verbs: rdma::VerbsMode,
    pub selftest: SelftestConfig,
    /// How often the slow attributes are read (`rdma.counters_interval`): `counters/` and
    /// `hw_counters/`, each RDMA device's identity, firmware and PCIe capabilities, InfiniBand
    /// ports' GID tables, and a scan of the PCI bus for GPUs whose function list has not
    /// changed; `None`: on every probe. The verdict's attributes are read on every probe
    /// regardless.
    pub counters_interval: Option<Duration>,
    /// Which counter files are read (default: all of them).
    pub counter_names: rdma::sysfs::CounterNames,
    /// The device plugins' sockets and device nodes, and the container's own mounts.
    pub host: host::HostConfig,
    /// The registered subsystems' probes, run after the built-in ones in this order.
    pub collectors: Vec<collect::NewCollector>,
}

/// The default of `rdma.counters_interval` for a probe interval: every probe when probes are
/// at least 10 s apart, else every 10 s (the freshness a 15 s Prometheus scrape needs).
pub fn default_counters_interval(probe_interval: Duration) -> Option<Duration> {
    (probe_interval < DEFAULT_COUNTERS_INTERVAL).then_some(DEFAULT_COUNTERS_INTERVAL)
}

/// See [`default_counters_interval`].
pub const DEFAULT_COUNTERS_INTERVAL: Duration = Duration::from_secs(10);

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

/// Holds the state that must outlive a single probe (the statfs workers that may be stuck on a
/// hung mount), so the daemon keeps one `Prober` for its whole life.
pub struct Prober {
    roots: Roots,
    config: ProbeConfig,
    /// The RDMA attribute files, kept open between probes.
    sysfs: rdma::sysfs::SysfsReader,
    /// When the RDMA counters (and the other slow attributes) were last read (drives
    /// `counters_interval`).
    counters_read: Option<Instant>,
    /// Probes completed so far (drives `every N probes`).
    probes: u64,
    ports: BTreeMap<(String, u32), PortMemory>,
    /// Made from [`ProbeConfig::collectors`].
    collectors: Vec<Box<dyn collect::Collector>>,
}

impl Prober {
    pub fn new(roots: Roots, config: ProbeConfig) -> Self {
        let sysfs =
            rdma::sysfs::SysfsReader::with_counter_names(&roots, config.counter_names.clone());
        let collectors = config.collectors.iter().map(|c| c.make(&roots)).collect();
        Self {
            sysfs,
            counters_read: None,
            roots,
            config,
            probes: 0,
            ports: BTreeMap::new(),
            collectors,
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
        let slow = self.counters_due(started);
        if slow {
            self.counters_read = Some(started);
        }
        let mut rdma = self.sysfs.probe(slow);
        timings.rdma_sysfs_seconds = started.elapsed().as_secs_f64();

        if self.config.verbs == rdma::VerbsMode::Required {
            let started = Instant::now();
            rdma::verbs::probe_into(&mut rdma);
            self.selftest(&mut rdma);
            timings.rdma_verbs_seconds = started.elapsed().as_secs_f64();
        }
        self.probes += 1;

        let mut report = ProbeReport {
            timestamp,
            rdma,
            timings,
            host: host::HostReport::default(),
            facts: fact::Facts::default(),
        };
        for collector in &mut self.collectors {
            let started = Instant::now();
            let name = collector.name();
            let pass = collect::Pass {
                roots: &self.roots,
                report: &report,
                slow,
            };
            let fact = collector.collect(&pass).from_probe(name);
            report
                .timings
                .collected
                .insert(format!("{name}_seconds"), started.elapsed().as_secs_f64());
            report.facts.insert(collector.key(), fact);
        }
        // After the collectors: a required mount the container lacks is read from storage's.
        let required_missing = storage::of(&report)
            .map(storage::StorageReport::required_missing)
            .unwrap_or_default();
        report.host = host::check(
            &self.config.host,
            &self.roots,
            &report.rdma,
            &required_missing,
        );
        report
    }

    /// Only the RDMA ports' `state` and `phys_state`, re-read through the files the last probe
    /// opened (two `pread`s per port): what an event-triggered probe acts on first
    /// (docs/events.md). See [`rdma::sysfs::SysfsReader::port_states`].
    pub fn port_states(&mut self) -> Vec<rdma::sysfs::PortStateRead> {
        self.sysfs.port_states()
    }

    /// Whether this probe reads the counters: always without a `counters_interval`, else when
    /// the interval has passed (less 5 %, so a jittered probe loop does not skip a beat).
    fn counters_due(&self, now: Instant) -> bool {
        match (self.config.counters_interval, self.counters_read) {
            (None, _) | (_, None) => true,
            (Some(every), Some(last)) => now.saturating_duration_since(last) + every / 20 >= every,
        }
    }

    /// Run the data-path self-test where the schedule says so, and report the last result
    /// elsewhere. A port is tested when it comes up (first probe included), every N probes
    /// with `every N probes`, and on every probe while its last test failed, so a repaired
    /// port recovers without a restart. Ports that are down or on devices verbs cannot open
    /// are not tested: the verdict already names why they are unusable.
    fn selftest(&mut self, rdma: &mut rdma::RdmaReport) {
        let cfg = &self.config.selftest;
        if cfg.schedule == SelftestSchedule::Off {
            return;
        }
        let (schedule, probes) = (cfg.schedule, self.probes);
        let Some(matcher) = cfg.matcher() else {
            return;
        };
        let memory = &mut self.ports;
        let mut select = |dev: &rdma::DeviceReport, port: &rdma::PortReport| {
            let opened = dev.verbs.as_ref().is_some_and(|v| v.opened);
            if !opened || !port.is_up() || !matcher.is_match(&dev.name) {
                return false;
            }
            selftest_due(schedule, probes, memory.get(&(dev.name.clone(), port.port)))
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

/// Whether an up port is tested on probe number `probes` (0-based): when first seen up or
/// back up, while its last result failed, and every N probes with `every N probes`.
fn selftest_due(schedule: SelftestSchedule, probes: u64, memory: Option<&PortMemory>) -> bool {
    let every_due = match schedule {
        SelftestSchedule::Off => return false,
        SelftestSchedule::OnStart => false,
        SelftestSchedule::Every(n) => probes.is_multiple_of(u64::from(n.max(1))),
    };
    every_due || memory.is_none_or(|m| !m.was_up || m.last.as_ref().is_none_or(|r| !r.ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counters on every probe when probes are at least 10 s apart, else
    /// every 10 s; due again after the interval (less 5 % of jitter), and always at first.
    #[test]
    fn counters_cadence_defaults_to_every_probe_from_10s_else_every_10s() {
        let s = Duration::from_secs;
        assert_eq!(default_counters_interval(s(10)), None);
        assert_eq!(default_counters_interval(s(60)), None);
        assert_eq!(default_counters_interval(s(1)), Some(s(10)));
        assert_eq!(
            default_counters_interval(Duration::from_millis(500)),
            Some(s(10))
        );
        let mut p = Prober::new(
            Roots::new("/nonexistent", "/nonexistent"),
            ProbeConfig {
                counters_interval: default_counters_interval(s(1)),
                ..ProbeConfig::default()
            },
        );
        let t0 = Instant::now();
        assert!(p.counters_due(t0), "the first probe reads the counters");
        p.counters_read = Some(t0);
        assert!(!p.counters_due(t0 + s(1)));
        assert!(!p.counters_due(t0 + s(9)));
        assert!(p.counters_due(t0 + Duration::from_millis(9_600)));
        assert!(p.counters_due(t0 + s(10)));
    }

    fn mem(was_up: bool, ok: Option<bool>) -> PortMemory {
        PortMemory {
            was_up,
            last: ok.map(|ok| rdma::SelftestResult {
                ok,
                ..rdma::SelftestResult::default()
            }),
        }
    }

    #[test]
    fn on_start_tests_new_recovered_and_failing_ports_only() {
        let on = SelftestSchedule::OnStart;
        assert!(selftest_due(on, 0, None), "first sight");
        assert!(
            !selftest_due(on, 7, Some(&mem(true, Some(true)))),
            "passed: kept"
        );
        assert!(
            selftest_due(on, 7, Some(&mem(true, Some(false)))),
            "failed: retried"
        );
        assert!(
            selftest_due(on, 7, Some(&mem(false, Some(true)))),
            "back up"
        );
        assert!(!selftest_due(SelftestSchedule::Off, 0, None));
    }

    #[test]
    fn every_n_probes_retests_passing_ports_on_schedule() {
        let every3 = SelftestSchedule::Every(3);
        let passed = mem(true, Some(true));
        let due: Vec<u64> = (0..7)
            .filter(|&p| selftest_due(every3, p, Some(&passed)))
            .collect();
        assert_eq!(due, vec![0, 3, 6]);
    }
}
