//! The `fabricgate_peer_*` metrics, with bounded cardinality: the series of the peers measured
//! in the last `keep_rounds` rounds, from ports that are still usable.

use super::round::Round;
use fabricgate_probes::rdma::peer::{self, ErrorKind, LocalPort, Outcome, Skip};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct PeerLabels {
    device: String,
    port: u32,
    peer: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RttLabels {
    device: String,
    port: u32,
    peer: String,
    stat: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    device: String,
    port: u32,
    peer: String,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

type GaugeF64 = Gauge<f64, AtomicU64>;

/// The `fabricgate_peer_*` families; registered only when `peers.enabled`.
#[derive(Debug, Clone, Default)]
pub struct PeerMetrics {
    rtt: Family<RttLabels, GaugeF64>,
    bandwidth: Family<PeerLabels, GaugeF64>,
    errors: Family<ErrorLabels, Counter>,
    rounds: Counter,
    round_cpu: GaugeF64,
    round_duration: GaugeF64,
    required_met: Family<Vec<(&'static str, &'static str)>, Gauge>,
    responder_sessions: Family<ResultLabels, Counter>,
    responder_cpu: Counter<f64, AtomicU64>,
    /// Peer series of each of the last `keep_rounds` rounds, newest last.
    window: Arc<Mutex<VecDeque<BTreeSet<PeerLabels>>>>,
    responder_seen: Arc<Mutex<[u64; 4]>>,
}

const RTT_STATS: [&str; 3] = ["min", "median", "max"];
const RESPONDER_RESULTS: [&str; 4] = ["served", "refused", "unauthenticated", "failed"];

impl PeerMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        macro_rules! family {
            ($name:literal, $help:literal, $metric:ident) => {
                r.register($name, $help, m.$metric.clone())
            };
            ($name:literal, $help:literal, $metric:ident, $unit:expr) => {
                r.register_with_unit($name, $help, $unit, m.$metric.clone())
            };
        }
        family!(
            "fabricgate_peer_rtt",
            "Round trip of small RDMA WRITEs to a peer over the last burst (stat: min, median, max)",
            rtt,
            Unit::Seconds
        );
        family!(
            "fabricgate_peer_bandwidth_bytes_per_second",
            "RDMA WRITE bandwidth to a peer over the last burst (when peers.bandwidth.enabled)",
            bandwidth
        );
        family!(
            "fabricgate_peer_errors",
            "Failed peer measurements by kind: connect (side channel), timeout (no answer), verification (bytes wrong)",
            errors
        );
        family!(
            "fabricgate_peer_rounds",
            "Peer measurement rounds completed",
            rounds
        );
        family!(
            "fabricgate_peer_round_cpu",
            "CPU time of the last peer round (the measuring thread)",
            round_cpu,
            Unit::Seconds
        );
        family!(
            "fabricgate_peer_round_duration",
            "Wall time of the last peer round",
            round_duration,
            Unit::Seconds
        );
        family!(
            "fabricgate_peer_required_met",
            "1 when peers.required holds (N of the last M rounds reached a peer), else 0; absent when off",
            required_met
        );
        family!(
            "fabricgate_peer_responder_sessions",
            "Sessions the responder handled, by result (served, refused, unauthenticated, failed)",
            responder_sessions
        );
        family!(
            "fabricgate_peer_responder_cpu",
            "CPU time the responder's sessions used",
            responder_cpu,
            Unit::Seconds
        );
        for result in RESPONDER_RESULTS {
            m.responder_sessions
                .get_or_create(&ResultLabels { result })
                .inc_by(0);
        }
        m
    }

    /// Record one round's results; series of peers outside the last `keep` rounds go away.
    /// `usable_now`: the local ports usable when the round ended; a port that went down while
    /// the round waited out its timeout gets no current values.
    pub fn record_round(&self, round: &Round, keep: usize, usable_now: &[LocalPort]) {
        let usable = usable_set(usable_now);
        let mut keys = BTreeSet::new();
        for r in &round.results {
            let key = PeerLabels {
                device: r.local.device.clone(),
                port: u32::from(r.local.port),
                peer: r.target.label.clone(),
            };
            // The error series exist from the first measurement, so `increase()` sees the
            // first error as a step from 0.
            for kind in ErrorKind::ALL {
                self.errors
                    .get_or_create(&error_labels(&key, kind))
                    .inc_by(0);
            }
            match &r.outcome {
                Outcome::Measured(_) if !usable.contains(&(key.device.clone(), key.port)) => {
                    self.remove_values(&key);
                }
                Outcome::Measured(m) => {
                    let v = [m.rtt_min(), m.rtt_median(), m.rtt_max()];
                    for (stat, d) in RTT_STATS.into_iter().zip(v) {
                        self.rtt
                            .get_or_create(&rtt_labels(&key, stat))
                            .set(d.as_secs_f64());
                    }
                    match m.bandwidth {
                        Some(bw) => {
                            self.bandwidth.get_or_create(&key).set(bw);
                        }
                        None => {
                            self.bandwidth.remove(&key);
                        }
                    }
                }
                Outcome::Failed { kind, .. } => {
                    // No current value: a failed peer has no RTT (absent, not 0).
                    self.remove_values(&key);
                    if let Some(kind) = kind {
                        self.errors.get_or_create(&error_labels(&key, *kind)).inc();
                    }
                }
                Outcome::Skipped(Skip::Starting) => self.remove_values(&key),
                // Busy (possibly someone holding its sessions): neither an error nor a reason
                // to drop the last values measured.
                Outcome::Skipped(Skip::Busy) => {}
                Outcome::Skipped(_) => {
                    self.remove_values(&key);
                    for kind in ErrorKind::ALL {
                        self.errors.remove(&error_labels(&key, kind));
                    }
                    continue;
                }
            }
            keys.insert(key);
        }
        // Ports that are no longer usable have no current values either.
        let mut window = self.window.lock().unwrap_or_else(|p| p.into_inner());
        self.remove_values_outside(&window, &usable);
        window.push_back(keys);
        while window.len() > keep.max(1) {
            let Some(old) = window.pop_front() else {
                break;
            };
            for key in old {
                if !window.iter().any(|w| w.contains(&key)) {
                    self.remove_values(&key);
                    for kind in ErrorKind::ALL {
                        self.errors.remove(&error_labels(&key, kind));
                    }
                }
            }
        }
        self.rounds.inc();
        if let Some(cpu) = round.cpu {
            self.round_cpu.set(cpu.as_secs_f64());
        }
        self.round_duration.set(round.elapsed.as_secs_f64());
    }

    /// Drop the current values (RTT, bandwidth) of every local port not in `usable` at once,
    /// when a probe finds it gone: a round in flight may wait out `peers.timeout` before it
    /// records anything.
    pub fn forget_unusable(&self, usable: &[LocalPort]) {
        let window = self.window.lock().unwrap_or_else(|p| p.into_inner());
        self.remove_values_outside(&window, &usable_set(usable));
    }

    fn remove_values_outside(
        &self,
        window: &VecDeque<BTreeSet<PeerLabels>>,
        usable: &BTreeSet<(String, u32)>,
    ) {
        for key in window.iter().flatten() {
            if !usable.contains(&(key.device.clone(), key.port)) {
                self.remove_values(key);
            }
        }
    }

    fn remove_values(&self, key: &PeerLabels) {
        for stat in RTT_STATS {
            self.rtt.remove(&rtt_labels(key, stat));
        }
        self.bandwidth.remove(key);
    }

    pub fn set_required(&self, met: Option<bool>) {
        match met {
            Some(met) => {
                self.required_met
                    .get_or_create(&Vec::new())
                    .set(i64::from(met));
            }
            None => self.required_met.clear(),
        }
    }

    /// Bring the responder counters up to its current totals.
    pub fn record_responder(&self, stats: &peer::ResponderStats) {
        let now = [
            stats.served.load(Ordering::Relaxed),
            stats.refused.load(Ordering::Relaxed),
            stats.unauthenticated.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
        ];
        let mut seen = self
            .responder_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (i, result) in RESPONDER_RESULTS.into_iter().enumerate() {
            let delta = now[i].saturating_sub(seen[i]);
            self.responder_sessions
                .get_or_create(&ResultLabels { result })
                .inc_by(delta);
        }
        *seen = now;
        let cpu = stats.cpu_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let have = self.responder_cpu.get();
        if cpu > have {
            self.responder_cpu.inc_by(cpu - have);
        }
    }
}

fn rtt_labels(key: &PeerLabels, stat: &'static str) -> RttLabels {
    RttLabels {
        device: key.device.clone(),
        port: key.port,
        peer: key.peer.clone(),
        stat,
    }
}

fn error_labels(key: &PeerLabels, kind: ErrorKind) -> ErrorLabels {
    ErrorLabels {
        device: key.device.clone(),
        port: key.port,
        peer: key.peer.clone(),
        kind: kind.as_str(),
    }
}

/// `(device, port)` of each port, as the metric labels hold them.
fn usable_set(ports: &[LocalPort]) -> BTreeSet<(String, u32)> {
    ports
        .iter()
        .map(|p| (p.device.clone(), u32::from(p.port)))
        .collect()
}
