//! The silent-TCP-fallback detector.
//!
//! When NCCL (or MPI, or Lustre's LNet) cannot use the RDMA ports it falls back to sockets and
//! keeps working, only slower, so nothing fails and nobody looks. The tell is in the byte
//! counters: the TCP path (pod network, the netdevs behind RoCE ports) is busy while the RDMA
//! ports sit idle. Over a sliding window we average both rates from the probe reports; when
//! TCP is at or above `tcp_min_bytes_per_second` and RDMA at or below
//! `rdma_max_bytes_per_second` the fallback is suspected.
//!
//! RDMA traffic bypasses the kernel network stack, so it never shows up in the netdev
//! counters; TCP traffic never shows up in `port_xmit_data`/`port_rcv_data` of a RoCE port.
//! IPoIB is the exception (it is TCP carried by the IB port, so it counts as RDMA-port bytes
//! here): a fallback onto IPoIB keeps the ports busy and is not what this detector catches.

use crate::config::{Config, FallbackSettings};
use crate::observe::counters::Monotonic;
use fabricgate_probes::ProbeReport;
use std::collections::{HashMap, VecDeque};

/// What the detector concluded after one probe.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FallbackStatus {
    pub suspected: bool,
    /// Average TCP-path bytes per second over the window; `None` until two samples exist
    /// (or when no netdev counter could be read).
    pub tcp_bytes_per_second: Option<f64>,
    /// Average RDMA bytes per second over the in-scope ports; `None` as above.
    pub rdma_bytes_per_second: Option<f64>,
}

/// A running byte total at the time its counters were read.
#[derive(Debug, Clone, Copy)]
struct Sample {
    t: f64,
    bytes: f64,
}

/// The samples of one side (RDMA or TCP) within the window.
#[derive(Debug, Default)]
struct Series {
    samples: VecDeque<Sample>,
}

impl Series {
    fn push(&mut self, t: f64, bytes: f64, window: f64, now: f64) {
        if self.samples.back().is_none_or(|s| t > s.t) {
            self.samples.push_back(Sample { t, bytes });
        }
        // Keep one sample at or before the window's start so the span covers the window.
        while self.samples.len() > 2 && self.samples[1].t <= now - window {
            self.samples.pop_front();
        }
    }

    /// Average rate and the span it covers; `None` until two samples exist.
    fn rate(&self) -> Option<(f64, f64)> {
        let (first, last) = (self.samples.front()?, self.samples.back()?);
        let span = last.t - first.t;
        (span > 0.0).then(|| ((last.bytes - first.bytes) / span, span))
    }
}

/// Keeps the samples of the last window; one per probe.
#[derive(Debug)]
pub struct FallbackDetector {
    settings: FallbackSettings,
    devices: globset::GlobMatcher,
    /// Per-series accumulators, so a counter reset is a zero step, never a negative one.
    rdma_series: HashMap<(String, u32, bool), Monotonic>,
    tcp_series: HashMap<(String, bool), Monotonic>,
    rdma_total: f64,
    tcp_total: f64,
    /// RDMA totals at the time the port counters were read (`counters_timestamp`: the probe
    /// may read them less often than it probes), TCP totals at the probe's time.
    rdma_samples: Series,
    tcp_samples: Series,
}

impl FallbackDetector {
    pub fn new(config: &Config) -> Self {
        Self {
            settings: config.fallback.clone(),
            devices: config.device_matcher(),
            rdma_series: HashMap::new(),
            tcp_series: HashMap::new(),
            rdma_total: 0.0,
            tcp_total: 0.0,
            rdma_samples: Series::default(),
            tcp_samples: Series::default(),
        }
    }

    /// Add one probe report and judge the window that ends with it.
    pub fn observe(&mut self, report: &ProbeReport) -> FallbackStatus {
        let t = report.timestamp;
        if self.tcp_samples.samples.back().is_some_and(|s| t <= s.t) {
            // The wall clock stepped back: rates across the step would be nonsense.
            self.tcp_samples.samples.clear();
            self.rdma_samples.samples.clear();
        }
        // When the RDMA counters in this report were read.
        let mut rdma_t: Option<f64> = None;

        let mut rdma_ports = 0usize;
        let mut rdma_delta = 0u64;
        let mut seen_rdma = Vec::new();
        for dev in report
            .rdma
            .devices
            .iter()
            .filter(|d| self.devices.is_match(&d.name))
        {
            for port in &dev.ports {
                let mut counted = false;
                for (tx, bytes) in [(true, port.transmit_bytes()), (false, port.receive_bytes())] {
                    let Some(bytes) = bytes else { continue };
                    counted = true;
                    let read_at = port.counters_timestamp.unwrap_or(t);
                    rdma_t = Some(rdma_t.map_or(read_at, |r: f64| r.max(read_at)));
                    let key = (dev.name.clone(), port.port, tx);
                    rdma_delta =
                        rdma_delta.saturating_add(moved(&mut self.rdma_series, &key, bytes));
                    seen_rdma.push(key);
                }
                rdma_ports += usize::from(counted);
            }
        }
        self.rdma_series.retain(|k, _| seen_rdma.contains(k));

        let mut tcp_netdevs = 0usize;
        let mut tcp_delta = 0u64;
        let mut seen_tcp = Vec::new();
        for nd in fabricgate_probes::netdev::reports(report) {
            let mut counted = false;
            for (tx, bytes) in [(true, nd.tx_bytes), (false, nd.rx_bytes)] {
                let Some(bytes) = bytes else { continue };
                counted = true;
                let key = (nd.name.clone(), tx);
                tcp_delta = tcp_delta.saturating_add(moved(&mut self.tcp_series, &key, bytes));
                seen_tcp.push(key);
            }
            tcp_netdevs += usize::from(counted);
        }
        self.tcp_series.retain(|k, _| seen_tcp.contains(k));

        self.rdma_total += rdma_delta as f64;
        self.tcp_total += tcp_delta as f64;
        let window = self.settings.window.as_secs_f64();
        self.tcp_samples.push(t, self.tcp_total, window, t);
        if let Some(rdma_t) = rdma_t {
            self.rdma_samples.push(rdma_t, self.rdma_total, window, t);
        }

        let (Some((tcp, tcp_span)), Some((rdma, rdma_span))) =
            (self.tcp_samples.rate(), self.rdma_samples.rate())
        else {
            return FallbackStatus {
                tcp_bytes_per_second: self
                    .tcp_samples
                    .rate()
                    .filter(|_| tcp_netdevs > 0)
                    .map(|r| r.0),
                rdma_bytes_per_second: self
                    .rdma_samples
                    .rate()
                    .filter(|_| rdma_ports > 0)
                    .map(|r| r.0),
                ..FallbackStatus::default()
            };
        };
        let span = tcp_span.min(rdma_span);
        let tcp_rate = (tcp_netdevs > 0).then_some(tcp);
        let rdma_rate = (rdma_ports > 0).then_some(rdma);
        // Half a window of evidence before judging: a node that just booted, or an agent
        // that just restarted, has seen too little to page anyone.
        let enough = span >= window / 2.0;
        let suspected = self.settings.enabled
            && enough
            && matches!((tcp_rate, rdma_rate), (Some(tcp), Some(rdma))
                if tcp >= self.settings.tcp_min_bytes_per_second as f64
                    && rdma <= self.settings.rdma_max_bytes_per_second as f64);
        FallbackStatus {
            suspected,
            tcp_bytes_per_second: tcp_rate,
            rdma_bytes_per_second: rdma_rate,
        }
    }
}

/// Bytes moved since the previous observation of a series; 0 for a series seen first now
/// (its absolute value says nothing about the window).
fn moved<K: std::hash::Hash + Eq + Clone>(
    series: &mut HashMap<K, Monotonic>,
    key: &K,
    raw: u64,
) -> u64 {
    match series.get_mut(key) {
        Some(m) => m.observe(raw),
        None => {
            series.insert(key.clone(), Monotonic::starting_at(raw));
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::ProbeTimings;
    use fabricgate_probes::netdev::NetdevReport;
    use fabricgate_probes::rdma::{DeviceReport, PortReport, RdmaReport};
    use std::time::Duration;

    fn report(t: f64, rdma_words: u64, tcp_bytes: u64) -> ProbeReport {
        let mut port = PortReport {
            port: 1,
            ..PortReport::default()
        };
        let counters = std::sync::Arc::make_mut(&mut port.counters);
        counters.insert("port_xmit_data".into(), rdma_words);
        counters.insert("port_rcv_data".into(), rdma_words);
        port.counters_timestamp = Some(t);
        let mut report = ProbeReport {
            timestamp: t,
            rdma: RdmaReport {
                subsystem_present: true,
                devices: vec![DeviceReport {
                    name: "mlx5_0".into(),
                    ports: vec![port],
                    ..DeviceReport::default()
                }],
                ..RdmaReport::default()
            },
            timings: ProbeTimings::default(),
            host: Default::default(),
            facts: Default::default(),
        };
        let eth0 = NetdevReport {
            name: "eth0".into(),
            rx_bytes: Some(tcp_bytes),
            tx_bytes: Some(0),
            errors: Vec::new(),
        };
        fabricgate_probes::netdev::set_reports(&mut report, vec![eth0]);
        report
    }

    fn config(window_s: u64) -> Config {
        let mut c = Config::default();
        c.fallback.window = Duration::from_secs(window_s);
        c
    }

    /// The incident: 1 GB/s of TCP for the whole window, RDMA ports flat.
    #[test]
    fn busy_tcp_and_idle_rdma_is_suspected_once_half_a_window_is_seen() {
        let mut d = FallbackDetector::new(&config(600));
        let mut last = FallbackStatus::default();
        for i in 0..=60u64 {
            let t = 1_000.0 + 10.0 * i as f64;
            last = d.observe(&report(t, 5_000, 1_000_000_000 * 10 * i));
            if i < 30 {
                assert!(!last.suspected, "too early at sample {i}: {last:?}");
            }
        }
        assert!(last.suspected, "{last:?}");
        assert_eq!(last.tcp_bytes_per_second, Some(1e9));
        assert_eq!(last.rdma_bytes_per_second, Some(0.0));
    }

    #[test]
    fn busy_rdma_or_quiet_tcp_is_not_suspected() {
        // Healthy training: TCP busy-ish (checkpoints, logs) but RDMA far busier.
        let mut d = FallbackDetector::new(&config(60));
        let mut s = FallbackStatus::default();
        for i in 0..=12u64 {
            s = d.observe(&report(
                10.0 * i as f64,
                250_000_000 * 10 * i,
                200_000_000 * 10 * i,
            ));
        }
        assert!(!s.suspected, "{s:?}");
        assert_eq!(s.rdma_bytes_per_second, Some(2e9));
        // Idle node: both quiet.
        let mut d = FallbackDetector::new(&config(60));
        for i in 0..=12u64 {
            s = d.observe(&report(10.0 * i as f64, 0, 1_000 * i));
        }
        assert!(!s.suspected, "{s:?}");
    }

    #[test]
    fn the_window_slides_so_the_alarm_clears_when_rdma_resumes() {
        let mut d = FallbackDetector::new(&config(60));
        let mut s = FallbackStatus::default();
        let (mut rdma, mut tcp) = (0u64, 0u64);
        for i in 0..=12 {
            tcp += 2_000_000_000;
            s = d.observe(&report(10.0 * f64::from(i), rdma, tcp));
        }
        assert!(s.suspected);
        for i in 13..=30 {
            rdma += 2_000_000_000;
            tcp += 2_000_000_000;
            s = d.observe(&report(10.0 * f64::from(i), rdma, tcp));
        }
        assert!(!s.suspected, "{s:?}");
        assert_eq!(s.rdma_bytes_per_second, Some(2e9 * 4.0 * 2.0 / 10.0));
    }

    /// Probes every second, counters read every 10 s (`rdma.counters_interval`): the RDMA
    /// rate uses the counters' own timestamps, so it is exact, not smeared or inflated.
    #[test]
    fn counters_read_on_their_own_cadence_give_exact_rates() {
        let mut d = FallbackDetector::new(&config(60));
        let mut s = FallbackStatus::default();
        // 1 MB/s of RDMA (250,000 words/s per direction, 2 directions), 300 MB/s of TCP.
        for i in 0..=120u64 {
            let t = 1_000.0 + i as f64;
            let read_at = (i / 10) * 10;
            let mut r = report(t, 250_000 * read_at / 2, 300_000_000 * i);
            r.rdma.devices[0].ports[0].counters_timestamp = Some(1_000.0 + read_at as f64);
            s = d.observe(&r);
            if i >= 20 {
                assert_eq!(s.rdma_bytes_per_second, Some(1e6), "sample {i}: {s:?}");
                assert_eq!(s.tcp_bytes_per_second, Some(3e8), "sample {i}: {s:?}");
            }
        }
        assert!(s.suspected, "{s:?}");
    }

    #[test]
    fn a_counter_reset_never_makes_a_negative_rate() {
        let mut d = FallbackDetector::new(&config(60));
        d.observe(&report(0.0, 1_000_000, 9_000_000_000));
        // Driver reload: both counters restart near zero.
        let s = d.observe(&report(10.0, 10, 1_000));
        assert!(s.tcp_bytes_per_second.unwrap() >= 0.0, "{s:?}");
        assert!(s.rdma_bytes_per_second.unwrap() >= 0.0, "{s:?}");
        assert_eq!(s.tcp_bytes_per_second, Some(100.0));
    }

    #[test]
    fn disabled_or_without_rdma_ports_never_suspects() {
        let mut c = config(60);
        c.fallback.enabled = false;
        let mut d = FallbackDetector::new(&c);
        let mut s = FallbackStatus::default();
        for i in 0..=12u64 {
            s = d.observe(&report(10.0 * i as f64, 0, 2_000_000_000 * i));
        }
        assert!(!s.suspected);
        assert!(s.tcp_bytes_per_second.is_some(), "rates are still reported");

        let mut c = config(60);
        c.rdma.devices = "bnxt_*".parse().unwrap();
        let mut d = FallbackDetector::new(&c);
        for i in 0..=12u64 {
            s = d.observe(&report(10.0 * i as f64, 0, 2_000_000_000 * i));
        }
        assert!(!s.suspected, "no in-scope RDMA port: not an RDMA node");
        assert_eq!(s.rdma_bytes_per_second, None);
    }
}
