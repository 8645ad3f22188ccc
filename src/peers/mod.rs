//! Inter-node RDMA measurements in the agent: peer discovery (a static list, the A records of
//! a headless Service), round-robin rounds on their own thread, the `fabricgate_peer_*`
//! metrics with bounded cardinality, the optional `peers.required` policy, and
//! `fabricgate ping`. The `peers:` settings they follow live in `config::peers`.
//!
//! The protocol, the responder and the measurement itself live in
//! `fabricgate_probes::rdma::peer` (synchronous, no tokio).

use crate::config::Config;
use crate::config::peers::{PeerSpec, PeersSettings, Required};
use crate::error::{Error, Result};
use crate::policy::{Finding, Scope, Taint, Verdict};
use fabricgate_probes::Roots;
use fabricgate_probes::rdma::RdmaReport;
use fabricgate_probes::rdma::peer::{
    self, ErrorKind, Identity, LocalPort, Outcome, Plan, Responder, Skip,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// Discovery

/// A resolved peer.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    pub label: String,
    pub addr: SocketAddr,
}

/// The static list and the Service name, resolved afresh each round.
#[derive(Debug, Clone, Default)]
pub struct Discovery {
    pub static_peers: Vec<PeerSpec>,
    /// Headless Service name; its A/AAAA records (system resolver) at the responder port.
    pub service: Option<String>,
    pub port: u16,
}

impl Discovery {
    /// Every peer, sorted and without duplicates (by address), and what failed to resolve.
    pub fn resolve(&self) -> (Vec<Target>, Vec<String>) {
        let mut seen: BTreeMap<SocketAddr, String> = BTreeMap::new();
        let mut errors = Vec::new();
        for spec in &self.static_peers {
            match (spec.host.as_str(), spec.port).to_socket_addrs() {
                Ok(mut addrs) => match addrs.next() {
                    Some(a) => {
                        seen.entry(a).or_insert_with(|| spec.label(self.port));
                    }
                    None => errors.push(format!("{}: no address", spec.host)),
                },
                Err(e) => errors.push(format!("cannot resolve peer {}: {e}", spec.host)),
            }
        }
        if let Some(service) = &self.service {
            // getaddrinfo: /etc/hosts, /etc/resolv.conf (search domains, ndots) as configured.
            match (service.as_str(), self.port).to_socket_addrs() {
                Ok(addrs) => {
                    for a in addrs {
                        seen.entry(a).or_insert_with(|| {
                            PeerSpec {
                                host: a.ip().to_string(),
                                port: a.port(),
                            }
                            .label(self.port)
                        });
                    }
                }
                Err(e) => errors.push(format!(
                    "cannot resolve peers.service {service}: {e}; check the headless Service \
                     and the node's DNS"
                )),
            }
        }
        let targets = seen
            .into_iter()
            .map(|(addr, label)| Target { label, addr })
            .collect();
        (targets, errors)
    }
}

/// Round-robin over a changing peer list: each round continues after the last peer measured,
/// so over `len / per_round` rounds every peer is measured once. Addresses that turned out to
/// be this node or another group are left out until they leave the list.
#[derive(Debug, Default)]
pub struct Selector {
    last: Option<SocketAddr>,
    excluded: BTreeSet<SocketAddr>,
}

impl Selector {
    /// Candidates in order for this round (all of them; the caller stops after `per_round`
    /// measured).
    pub fn order(&self, targets: &[Target]) -> Vec<Target> {
        let eligible: Vec<&Target> = targets
            .iter()
            .filter(|t| !self.excluded.contains(&t.addr))
            .collect();
        let start = self
            .last
            .map_or(0, |last| eligible.partition_point(|t| t.addr <= last));
        eligible[start..]
            .iter()
            .chain(&eligible[..start])
            .map(|t| (*t).clone())
            .collect()
    }

    pub fn measured(&mut self, addr: SocketAddr) {
        self.last = Some(addr);
    }

    pub fn exclude(&mut self, addr: SocketAddr) {
        self.excluded.insert(addr);
        self.last = Some(addr);
    }

    /// Forget exclusions of addresses no longer listed (a node replaced at the same address
    /// is tried again once it has left and come back).
    pub fn retain(&mut self, targets: &[Target]) {
        let listed: BTreeSet<SocketAddr> = targets.iter().map(|t| t.addr).collect();
        self.excluded.retain(|a| listed.contains(a));
    }
}

// ---------------------------------------------------------------------------------------
// Metrics

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
    responder_seen: Arc<Mutex<[u64; 3]>>,
}

const RTT_STATS: [&str; 3] = ["min", "median", "max"];

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
            "Sessions the responder handled, by result (served, refused, failed)",
            responder_sessions
        );
        family!(
            "fabricgate_peer_responder_cpu",
            "CPU time the responder's sessions used",
            responder_cpu,
            Unit::Seconds
        );
        for result in ["served", "refused", "failed"] {
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
            stats.failed.load(Ordering::Relaxed),
        ];
        let mut seen = self
            .responder_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (i, result) in ["served", "refused", "failed"].into_iter().enumerate() {
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

// ---------------------------------------------------------------------------------------
// Rounds

/// One peer measured from one local port.
#[derive(Debug, Clone)]
pub struct PeerResult {
    pub target: Target,
    pub local: LocalPort,
    pub outcome: Outcome,
}

/// What one round did.
#[derive(Debug, Clone, Default)]
pub struct Round {
    pub results: Vec<PeerResult>,
    pub errors: Vec<String>,
    pub elapsed: Duration,
    /// CPU time of the measuring thread, when `/proc/thread-self/schedstat` is readable.
    pub cpu: Option<Duration>,
}

impl Round {
    /// A good round: some peer was measured and verified.
    pub fn reached_a_peer(&self) -> bool {
        self.results
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Measured(_)))
    }
}

/// State kept across rounds.
pub struct Rounds {
    pub discovery: Discovery,
    pub identity: Identity,
    pub plan: Plan,
    pub per_round: usize,
    pub timeout: Duration,
    pub roots: Roots,
    selector: Selector,
    history: VecDeque<bool>,
    required: Option<Required>,
}

impl Rounds {
    pub fn new(
        settings: &PeersSettings,
        extra: &[PeerSpec],
        identity: Identity,
        roots: Roots,
    ) -> Self {
        let port = settings.port();
        let mut static_peers: Vec<PeerSpec> = settings
            .static_peers
            .iter()
            .filter_map(|p| PeerSpec::parse(p, port).ok())
            .collect();
        static_peers.extend(extra.iter().cloned());
        Self {
            discovery: Discovery {
                static_peers,
                service: Some(settings.service.clone()).filter(|s| !s.is_empty()),
                port,
            },
            identity,
            plan: settings.plan(),
            per_round: settings.per_round as usize,
            timeout: settings.timeout,
            roots,
            selector: Selector::default(),
            history: VecDeque::new(),
            required: settings.required(),
        }
    }

    /// Measure up to `per_round` peers from every port in `ports`.
    pub fn run(&mut self, ports: &[LocalPort]) -> Round {
        let started = Instant::now();
        let cpu0 = peer::thread_cpu_ns(&self.roots);
        let (targets, errors) = self.discovery.resolve();
        self.selector.retain(&targets);
        let mut round = Round {
            errors,
            ..Round::default()
        };
        if !ports.is_empty() {
            let mut measured = 0;
            for target in self.selector.order(&targets) {
                if measured >= self.per_round {
                    break;
                }
                let mut skipped = None;
                for local in ports {
                    let outcome =
                        peer::measure(target.addr, local, &self.identity, &self.plan, self.timeout);
                    if let Outcome::Skipped(why) = outcome {
                        skipped = Some(why);
                    }
                    round.results.push(PeerResult {
                        target: target.clone(),
                        local: local.clone(),
                        outcome,
                    });
                    if skipped.is_some() {
                        break;
                    }
                }
                match skipped {
                    // Never worth asking again while the address stays listed.
                    Some(Skip::SelfNode | Skip::OtherGroup) => self.selector.exclude(target.addr),
                    // Its agent is starting: next time round.
                    Some(_) => self.selector.measured(target.addr),
                    None => {
                        self.selector.measured(target.addr);
                        measured += 1;
                    }
                }
            }
        }
        round.elapsed = started.elapsed();
        round.cpu = match (cpu0, peer::thread_cpu_ns(&self.roots)) {
            (Some(a), Some(b)) => Some(Duration::from_nanos(b.saturating_sub(a))),
            _ => None,
        };
        if let Some(req) = self.required {
            self.history.push_back(round.reached_a_peer());
            while self.history.len() > req.m as usize {
                self.history.pop_front();
            }
        }
        round
    }

    /// `None` when `peers.required` is off; else whether it holds. Before M rounds have run,
    /// N good ones among those seen are still needed (so a node is not ready until it has
    /// reached peers N times).
    pub fn required_met(&self) -> Option<bool> {
        let req = self.required?;
        let good = self.history.iter().filter(|&&g| g).count();
        Some(good >= req.n as usize)
    }

    /// The finding `peers.required` adds while it does not hold.
    pub fn required_finding(&self) -> Option<Finding> {
        let req = self.required?;
        if self.required_met()? {
            return None;
        }
        let good = self.history.iter().filter(|&&g| g).count();
        Some(Finding {
            scope: Scope::Rdma,
            code: "PeersUnreachable",
            message: format!(
                "peers.required: reached a peer over RDMA in {good} of the last {} rounds, \
                 {} needed",
                self.history.len(),
                req.n
            ),
        })
    }
}

/// Add a `peers.required` finding to a verdict: RDMA and the node become not ready, with the
/// taint, labels and conditions that go with it.
pub fn apply_finding(mut v: Verdict, finding: Finding, config: &Config) -> Verdict {
    let prefix = &config.node.label_prefix;
    v.rdma.part.ready = false;
    v.rdma.part.findings.push(finding);
    v.ready = false;
    v.labels.insert(format!("{prefix}ready"), "false".into());
    v.labels
        .insert(format!("{prefix}rdma.ready"), "false".into());
    v.taints = vec![Taint {
        key: config.node.taint_key(),
        value: None,
        effect: config.node.taint_effect.as_str().to_owned(),
    }];
    let findings: Vec<&Finding> = v
        .rdma
        .part
        .findings
        .iter()
        .chain(&v.lustre.findings)
        .collect();
    for c in &mut v.conditions {
        let mine: Vec<&&Finding> = match c.type_.as_str() {
            "FabricReady" => findings.iter().collect(),
            "RDMAReady" => findings.iter().filter(|f| f.scope == Scope::Rdma).collect(),
            _ => continue,
        };
        c.status = "False".into();
        c.reason = mine.first().map_or("NotValidated", |f| f.code).to_owned();
        c.message = mine
            .iter()
            .map(|f| f.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
    }
    v
}

/// The agent's peer machinery: responder, measuring thread, shared state.
pub struct PeerAgent {
    responder: Responder,
    ports: Arc<Mutex<Vec<LocalPort>>>,
    required: Arc<Mutex<Option<Finding>>>,
    required_on: bool,
    metrics: PeerMetrics,
    devices: globset::GlobMatcher,
}

impl PeerAgent {
    /// Bind the responder on `peers.listen` and start serving.
    ///
    /// # Errors
    /// [`Error::Usage`] when the address cannot be bound.
    pub fn start(
        config: &Config,
        identity: Identity,
        roots: &Roots,
        metrics: PeerMetrics,
    ) -> Result<Self> {
        let listen = &config.peers.listen;
        let listener = std::net::TcpListener::bind(listen).map_err(|e| Error::Usage {
            flag: "peers.listen".into(),
            message: format!("cannot listen on {listen}: {e}"),
        })?;
        // A session may take as long as a client's bound, plus setup.
        let limit = config.peers.timeout + Duration::from_secs(5);
        let responder =
            Responder::start(listener, identity, roots.clone(), limit).map_err(|e| {
                Error::Internal {
                    message: format!("cannot start the peer responder: {e}"),
                }
            })?;
        tracing::info!(addr = %responder.local_addr(), "peer responder listening");
        Ok(Self {
            responder,
            ports: Arc::new(Mutex::new(Vec::new())),
            required: Arc::new(Mutex::new(None)),
            required_on: config.peers.required().is_some(),
            metrics,
            devices: config.device_matcher(),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.responder.local_addr()
    }

    /// After each probe: the validated ports are the ones served and measured from.
    pub fn update_ports(&self, report: &RdmaReport) {
        let ports = LocalPort::usable(report, &|d| self.devices.is_match(d));
        self.metrics.forget_unusable(&ports);
        self.responder.set_ports(ports.clone());
        *self.ports.lock().unwrap_or_else(|p| p.into_inner()) = ports;
        self.metrics.record_responder(self.responder.stats());
    }

    /// The `peers.required` finding to add to the verdict, if any.
    pub fn required_finding(&self) -> Option<Finding> {
        if !self.required_on {
            return None;
        }
        self.required
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Run rounds every `interval` on a thread until `stop` is dropped or sent to.
    ///
    /// # Errors
    /// [`Error::Internal`] when the thread cannot be started.
    pub fn spawn_rounds(
        &self,
        mut rounds: Rounds,
        interval: Duration,
        keep: usize,
        stop: std::sync::mpsc::Receiver<()>,
    ) -> Result<()> {
        let ports = Arc::clone(&self.ports);
        let required = Arc::clone(&self.required);
        let metrics = self.metrics.clone();
        if rounds.required.is_some() {
            *required.lock().unwrap_or_else(|p| p.into_inner()) = rounds.required_finding();
            metrics.set_required(rounds.required_met());
        }
        std::thread::Builder::new()
            .name("fabricgate-peers".into())
            .spawn(move || {
                loop {
                    match stop.recv_timeout(interval) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let local = ports.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    let round = rounds.run(&local);
                    log_round(&round);
                    let usable_now = ports.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    metrics.record_round(&round, keep, &usable_now);
                    metrics.set_required(rounds.required_met());
                    *required.lock().unwrap_or_else(|p| p.into_inner()) = rounds.required_finding();
                }
            })
            .map_err(|e| Error::Internal {
                message: format!("cannot start the peer thread: {e}"),
            })?;
        Ok(())
    }
}

/// `(device, port)` of each port, as the metric labels hold them.
fn usable_set(ports: &[LocalPort]) -> BTreeSet<(String, u32)> {
    ports
        .iter()
        .map(|p| (p.device.clone(), u32::from(p.port)))
        .collect()
}

fn log_round(round: &Round) {
    for e in &round.errors {
        tracing::warn!(error = %e, "peer discovery");
    }
    for r in &round.results {
        let (device, port, peer) = (&r.local.device, r.local.port, &r.target.label);
        match &r.outcome {
            Outcome::Measured(m) => tracing::debug!(
                device = %device, port, peer = %peer,
                rtt_median_us = m.rtt_median().as_secs_f64() * 1e6,
                bandwidth = ?m.bandwidth,
                "peer measured"
            ),
            Outcome::Skipped(s) => {
                tracing::info!(peer = %peer, reason = ?s, "peer skipped from now on")
            }
            Outcome::Failed { kind, message } => tracing::warn!(
                device = %device, port, peer = %peer,
                kind = kind.map_or("local", ErrorKind::as_str),
                error = %message,
                "peer measurement failed"
            ),
        }
    }
    tracing::debug!(
        results = round.results.len(),
        elapsed_ms = round.elapsed.as_secs_f64() * 1e3,
        cpu_ms = round.cpu.map(|c| c.as_secs_f64() * 1e3),
        "peer round done"
    );
}

/// The node's group for `peers.match_label`: the label's value on our Node, read once at
/// start (one GET); empty when the label is unset or there is no cluster.
pub async fn group_of(client: Option<&kube::Client>, node: &str, label: &str) -> String {
    if label.is_empty() {
        return String::new();
    }
    let Some(client) = client else {
        return String::new();
    };
    let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    match api.get(node).await {
        Ok(n) => n
            .metadata
            .labels
            .and_then(|l| l.get(label).cloned())
            .unwrap_or_default(),
        Err(e) => {
            tracing::warn!(error = %e, label, "cannot read the Node's peer group label; using no group");
            String::new()
        }
    }
}

// ---------------------------------------------------------------------------------------
// fabricgate ping

/// What `fabricgate ping` measured from each local port.
#[derive(Debug, Clone)]
pub struct PingReport {
    pub peer: String,
    pub addr: Option<SocketAddr>,
    pub results: Vec<(LocalPort, Outcome)>,
    /// Why nothing could be measured (no usable local port, unresolvable peer).
    pub errors: Vec<String>,
}

/// `fabricgate ping` exit codes: 0 every port reached the peer, 1 the peer was unreachable
/// from some port (connect, timeout, verification, or refused), 3 nothing could be measured
/// here (no usable local port, local verbs failure).
impl PingReport {
    pub fn exit_code(&self) -> u8 {
        if self.results.is_empty() {
            return if self.addr.is_none() && !self.errors.is_empty() {
                crate::EXIT_NOT_VALIDATED
            } else {
                crate::EXIT_CANNOT_PROBE
            };
        }
        let local_only = self
            .results
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Failed { kind: None, .. }));
        if local_only {
            crate::EXIT_CANNOT_PROBE
        } else if self
            .results
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Measured(_)))
        {
            crate::EXIT_VALIDATED
        } else {
            crate::EXIT_NOT_VALIDATED
        }
    }

    pub fn to_json(&self) -> Value {
        let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
        let ports: Vec<Value> = self
            .results
            .iter()
            .map(|(local, o)| {
                let mut v = json!({
                    "device": local.device,
                    "port": local.port,
                    "ok": matches!(o, Outcome::Measured(_)),
                });
                match o {
                    Outcome::Measured(m) => {
                        v["peer_node"] = json!(m.peer_node);
                        v["peer_device"] = json!(m.peer_device);
                        v["peer_port"] = json!(m.peer_port);
                        v["rtt_count"] = json!(m.rtts.len());
                        v["rtt_us"] = json!({
                            "min": us(m.rtt_min()),
                            "p50": us(m.rtt_median()),
                            "p90": us(peer::percentile(&m.rtts, 0.9)),
                            "p99": us(peer::percentile(&m.rtts, 0.99)),
                            "max": us(m.rtt_max()),
                        });
                        v["bandwidth_bytes_per_second"] = json!(m.bandwidth);
                        v["bandwidth_bytes"] = json!(m.bw_bytes);
                        v["elapsed_ms"] = json!((m.elapsed.as_secs_f64() * 1e4).round() / 10.0);
                    }
                    Outcome::Skipped(s) => {
                        v["error_kind"] = Value::Null;
                        v["message"] = json!(match s {
                            Skip::SelfNode => "the peer is this node",
                            Skip::OtherGroup => "the peer is in another group (peers.match_label)",
                            Skip::Starting => "the peer's agent is starting; try again",
                        });
                    }
                    Outcome::Failed { kind, message } => {
                        v["error_kind"] = json!(kind.map_or("local", ErrorKind::as_str));
                        v["message"] = json!(message);
                    }
                }
                v
            })
            .collect();
        json!({
            "peer": self.peer,
            "address": self.addr.map(|a| a.to_string()),
            "ok": self.exit_code() == crate::EXIT_VALIDATED,
            "ports": ports,
            "errors": self.errors,
        })
    }

    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let addr = self.addr.map_or_else(|| "?".to_owned(), |a| a.to_string());
        let _ = writeln!(
            out,
            "fabricgate ping {} ({addr}): {}",
            self.peer,
            if self.exit_code() == crate::EXIT_VALIDATED {
                "reachable"
            } else {
                "UNREACHABLE"
            }
        );
        for e in &self.errors {
            let _ = writeln!(out, "  ✗ {e}");
        }
        if self.results.is_empty() {
            return out;
        }
        let _ = writeln!(
            out,
            "  {:<12} {:<16} {:>10} {:>10} {:>10} {:>10} {:>12}  DETAIL",
            "LOCAL", "PEER", "RTT MIN", "RTT P50", "RTT P99", "RTT MAX", "BANDWIDTH"
        );
        let fmt = |d: Duration| {
            let us = d.as_secs_f64() * 1e6;
            if us >= 1_000.0 {
                format!("{:.2} ms", us / 1e3)
            } else {
                format!("{us:.1} µs")
            }
        };
        for (local, o) in &self.results {
            let here = format!("{}/{}", local.device, local.port);
            match o {
                Outcome::Measured(m) => {
                    let there = format!("{}/{}", m.peer_device, m.peer_port);
                    let bw = m.bandwidth.map_or_else(
                        || "-".to_owned(),
                        |b| {
                            if b >= 125e6 {
                                format!("{:.2} Gb/s", b * 8.0 / 1e9)
                            } else {
                                format!("{:.2} MB/s", b / 1e6)
                            }
                        },
                    );
                    let _ = writeln!(
                        out,
                        "  {here:<12} {there:<16} {:>10} {:>10} {:>10} {:>10} {bw:>12}  {} messages{}",
                        fmt(m.rtt_min()),
                        fmt(m.rtt_median()),
                        fmt(peer::percentile(&m.rtts, 0.99)),
                        fmt(m.rtt_max()),
                        m.rtts.len(),
                        if m.peer_node.is_empty() {
                            String::new()
                        } else {
                            format!(", node {}", m.peer_node)
                        }
                    );
                }
                Outcome::Skipped(s) => {
                    let _ = writeln!(out, "  {here:<12} skipped: {s:?}");
                }
                Outcome::Failed { kind, message } => {
                    let _ = writeln!(
                        out,
                        "  {here:<12} FAILED ({}): {message}",
                        kind.map_or("local", ErrorKind::as_str)
                    );
                }
            }
        }
        out
    }
}

/// Resolve `peer` and measure it from every usable local port (or only `device`).
pub fn ping(
    peer_text: &str,
    report: &RdmaReport,
    config: &Config,
    device: Option<&str>,
    identity: &Identity,
    plan: &Plan,
    timeout: Duration,
) -> PingReport {
    let mut out = PingReport {
        peer: peer_text.to_owned(),
        addr: None,
        results: Vec::new(),
        errors: Vec::new(),
    };
    let spec = match PeerSpec::parse(peer_text, config.peers.port()) {
        Ok(s) => s,
        Err(e) => {
            out.errors.push(e);
            return out;
        }
    };
    match (spec.host.as_str(), spec.port)
        .to_socket_addrs()
        .map(|mut a| a.next())
    {
        Ok(Some(a)) => out.addr = Some(a),
        Ok(None) => out.errors.push(format!("{}: no address", spec.host)),
        Err(e) => out
            .errors
            .push(format!("cannot resolve {}: {e}", spec.host)),
    }
    let matcher = config.device_matcher();
    let ports = LocalPort::usable(report, &|d| {
        matcher.is_match(d) && device.is_none_or(|want| want == d)
    });
    if ports.is_empty() {
        let mut why =
            "no usable local RDMA port (up, opened by verbs, matching rdma.devices".to_owned();
        if let Some(d) = device {
            let _ = write!(why, " and --device {d}");
        }
        why.push_str("); run `fabricgate check` to see why");
        out.errors.push(why);
    }
    let Some(addr) = out.addr else {
        return out;
    };
    for local in ports {
        let o = peer::measure(addr, &local, identity, plan, timeout);
        out.results.push((local, o));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::rdma::peer::Measurement;

    fn targets(n: u8) -> Vec<Target> {
        (1..=n)
            .map(|i| Target {
                label: format!("10.0.0.{i}"),
                addr: SocketAddr::from(([10, 0, 0, i], 9465)),
            })
            .collect()
    }

    #[test]
    fn round_robin_covers_every_peer_and_survives_list_changes() {
        let mut sel = Selector::default();
        let t = targets(5);
        let mut seen = Vec::new();
        for _ in 0..5 {
            let order = sel.order(&t);
            assert_eq!(order.len(), 5);
            for x in order.iter().take(2) {
                sel.measured(x.addr);
                seen.push(x.label.clone());
            }
        }
        // 5 rounds of 2 over 5 peers: each peer exactly twice, in rotation.
        for x in &t {
            assert_eq!(
                seen.iter().filter(|s| **s == x.label).count(),
                2,
                "{seen:?}"
            );
        }
        // Self is excluded until it leaves the list.
        sel.exclude(t[0].addr);
        assert!(!sel.order(&t).iter().any(|x| x.addr == t[0].addr));
        sel.retain(&t[1..]);
        assert!(sel.order(&t).iter().any(|x| x.addr == t[0].addr));
        // The last peer measured vanished: continue after where it was.
        let mut sel = Selector::default();
        sel.measured(t[2].addr);
        let shorter: Vec<Target> = t.iter().filter(|x| x.addr != t[2].addr).cloned().collect();
        assert_eq!(sel.order(&shorter)[0].addr, t[3].addr);
    }

    #[test]
    fn discovery_resolves_static_peers_and_reports_bad_names() {
        let d = Discovery {
            static_peers: vec![
                PeerSpec::parse("127.0.0.1", 9465).unwrap(),
                PeerSpec::parse("127.0.0.1:9465", 9465).unwrap(),
                PeerSpec::parse("localhost:7000", 9465).unwrap(),
                PeerSpec::parse("no-such-host.invalid", 9465).unwrap(),
            ],
            service: None,
            port: 9465,
        };
        let (t, errors) = d.resolve();
        assert!(t.iter().any(|x| x.label == "127.0.0.1"));
        assert_eq!(
            t.iter().filter(|x| x.addr.port() == 9465).count(),
            1,
            "duplicates collapse: {t:?}"
        );
        assert!(t.iter().any(|x| x.label == "localhost:7000"), "{t:?}");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("no-such-host.invalid"));
    }

    fn measured(us: u64) -> Outcome {
        Outcome::Measured(Measurement {
            peer_node: "b".into(),
            peer_device: "rxe0".into(),
            peer_port: 1,
            rtts: vec![
                Duration::from_micros(us),
                Duration::from_micros(us + 1),
                Duration::from_micros(us + 5),
            ],
            bandwidth: Some(1e9),
            bw_bytes: 1 << 20,
            elapsed: Duration::from_millis(3),
        })
    }

    fn result(peer: u8, outcome: Outcome) -> PeerResult {
        PeerResult {
            target: targets(peer).pop().unwrap(),
            local: LocalPort {
                device: "rxe0".into(),
                port: 1,
                gid_index: Some(1),
            },
            outcome,
        }
    }

    /// The local port goes down while a round is in flight (it may wait out `peers.timeout`):
    /// the next probe drops the port's values at once, and the round, when it ends, does not
    /// bring them back.
    #[test]
    fn a_port_gone_mid_round_loses_its_values_at_the_probe_not_the_round() {
        let mut r = Registry::default();
        let m = PeerMetrics::register(&mut r);
        let rtt = |r: &Registry| {
            let mut s = String::new();
            prometheus_client::encoding::text::encode(&mut s, r).unwrap();
            s.lines()
                .filter(|l| l.starts_with("fabricgate_peer_rtt_seconds{"))
                .count()
        };
        let ports = [result(1, measured(10)).local];
        let measured_round = Round {
            results: vec![result(1, measured(10))],
            ..Round::default()
        };
        m.record_round(&measured_round, 2, &ports);
        assert_eq!(rtt(&r), 3);
        m.forget_unusable(&[]);
        assert_eq!(rtt(&r), 0, "dropped when the probe finds the port gone");
        // The round that started before the port went down measured it.
        m.record_round(&measured_round, 2, &[]);
        assert_eq!(rtt(&r), 0, "a late measurement of a gone port is not shown");
        m.record_round(&measured_round, 2, &ports);
        assert_eq!(rtt(&r), 3, "back once the port is usable again");
    }

    #[test]
    fn metrics_follow_rounds_and_forget_peers_outside_the_window() {
        let mut r = Registry::default();
        let m = PeerMetrics::register(&mut r);
        let text = |r: &Registry| {
            let mut s = String::new();
            prometheus_client::encoding::text::encode(&mut s, r).unwrap();
            s
        };
        let ports = vec![result(1, measured(10)).local];
        let round = |results| Round {
            results,
            ..Round::default()
        };
        m.record_round(
            &round(vec![result(1, measured(10)), result(2, measured(20))]),
            2,
            &ports,
        );
        let t = text(&r);
        assert!(
            t.contains(r#"fabricgate_peer_rtt_seconds{device="rxe0",port="1",peer="10.0.0.2",stat="median"} 0.000021"#),
            "{t}"
        );
        assert!(t.contains(r#"fabricgate_peer_bandwidth_bytes_per_second{device="rxe0",port="1",peer="10.0.0.1"} 1000000000"#), "{t}");
        assert!(t.contains(r#"fabricgate_peer_errors_total{device="rxe0",port="1",peer="10.0.0.1",kind="timeout"} 0"#), "{t}");

        // Peer 2 times out: its RTT goes away, its timeout counter counts.
        m.record_round(
            &round(vec![result(
                2,
                Outcome::Failed {
                    kind: Some(ErrorKind::Timeout),
                    message: "x".into(),
                },
            )]),
            2,
            &ports,
        );
        let t = text(&r);
        assert!(!t.contains(r#"peer="10.0.0.2",stat="median""#), "{t}");
        assert!(t.contains(r#"fabricgate_peer_errors_total{device="rxe0",port="1",peer="10.0.0.2",kind="timeout"} 1"#), "{t}");
        assert!(
            t.contains(r#"peer="10.0.0.1",stat="median""#),
            "still in the window: {t}"
        );

        // Two more rounds with peer 3 only: peers 1 and 2 fall out of the 2-round window.
        for _ in 0..2 {
            m.record_round(&round(vec![result(3, measured(30))]), 2, &ports);
        }
        let t = text(&r);
        assert!(!t.contains(r#"peer="10.0.0.1""#), "{t}");
        assert!(!t.contains(r#"peer="10.0.0.2""#), "{t}");
        assert!(t.contains(r#"peer="10.0.0.3",stat="max""#), "{t}");
        assert!(t.contains("fabricgate_peer_rounds_total 4"), "{t}");

        // The local port goes down: no current values for it, errors stay.
        m.record_round(&round(vec![]), 2, &[]);
        let t = text(&r);
        assert!(!t.contains("fabricgate_peer_rtt_seconds{"), "{t}");
    }

    #[test]
    fn series_stay_bounded_however_many_peers_come_and_go() {
        let mut r = Registry::default();
        let m = PeerMetrics::register(&mut r);
        for i in 0..200u8 {
            let res = vec![result(i.max(1), measured(10))];
            let ports = [res[0].local.clone()];
            let round = Round {
                results: res,
                ..Round::default()
            };
            m.record_round(&round, 3, &ports);
        }
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &r).unwrap();
        let rtt = s
            .lines()
            .filter(|l| l.starts_with("fabricgate_peer_rtt_seconds{"))
            .count();
        assert_eq!(rtt, 3 * 3, "3 rounds × 1 peer × 3 stats:\n{s}");
    }

    #[test]
    fn required_counts_good_rounds_in_the_window() {
        let settings = PeersSettings {
            required: "2 of the last 3 rounds".into(),
            ..PeersSettings::default()
        };
        let mut rounds = Rounds::new(&settings, &[], Identity::default(), Roots::default());
        assert_eq!(rounds.required_met(), Some(false), "no rounds yet");
        for good in [true, false, true] {
            rounds.history.push_back(good);
        }
        assert_eq!(rounds.required_met(), Some(true));
        rounds.history.pop_front();
        rounds.history.push_back(false);
        assert_eq!(rounds.required_met(), Some(false));
        let f = rounds.required_finding().unwrap();
        assert_eq!(f.code, "PeersUnreachable");
        assert!(
            f.message.contains("1 of the last 3 rounds"),
            "{}",
            f.message
        );
        let off = Rounds::new(
            &PeersSettings::default(),
            &[],
            Identity::default(),
            Roots::default(),
        );
        assert_eq!(off.required_met(), None);
        assert!(off.required_finding().is_none());
    }

    #[test]
    fn a_required_finding_taints_and_names_itself_in_the_conditions() {
        let config = Config::default();
        let report = fabricgate_probes::ProbeReport {
            timestamp: 0.0,
            rdma: RdmaReport::default(),
            storage: Default::default(),
            netdevs: Vec::new(),
            gpudirect: Default::default(),
            timings: Default::default(),
        };
        let v = crate::policy::evaluate(&report, &config);
        let v = apply_finding(
            v,
            Finding {
                scope: Scope::Rdma,
                code: "PeersUnreachable",
                message: "peers.required: ...".into(),
            },
            &config,
        );
        assert!(!v.ready);
        assert_eq!(v.taints[0].key, "fabricgate.io/unvalidated");
        let rdma = v
            .conditions
            .iter()
            .find(|c| c.type_ == "RDMAReady")
            .unwrap();
        assert_eq!(rdma.status, "False");
        assert!(rdma.message.contains("peers.required"), "{}", rdma.message);
        assert_eq!(v.labels["fabricgate.io/rdma.ready"], "false");
    }

    #[test]
    fn ping_without_local_ports_or_peer_says_why() {
        let config = Config::default();
        let r = ping(
            "127.0.0.1:1",
            &RdmaReport::default(),
            &config,
            None,
            &Identity::default(),
            &Plan::default(),
            Duration::from_secs(1),
        );
        assert_eq!(r.exit_code(), crate::EXIT_CANNOT_PROBE);
        assert!(
            r.errors[0].contains("no usable local RDMA port"),
            "{:?}",
            r.errors
        );
        let t = r.to_table();
        assert!(t.contains("UNREACHABLE"), "{t}");
        let bad = ping(
            "no-such-host.invalid",
            &RdmaReport::default(),
            &config,
            None,
            &Identity::default(),
            &Plan::default(),
            Duration::from_secs(1),
        );
        assert_eq!(bad.exit_code(), crate::EXIT_NOT_VALIDATED);
        assert_eq!(bad.to_json()["ok"], false);
    }

    #[test]
    fn ping_report_formats_measurements_and_failures() {
        let local = result(1, measured(10)).local;
        let r = PingReport {
            peer: "node-b".into(),
            addr: Some(SocketAddr::from(([10, 0, 0, 2], 9465))),
            results: vec![
                (local.clone(), measured(10)),
                (
                    LocalPort {
                        device: "rxe1".into(),
                        ..local
                    },
                    Outcome::Failed {
                        kind: Some(ErrorKind::Timeout),
                        message: "poll_cq: ETIMEDOUT".into(),
                    },
                ),
            ],
            errors: vec![],
        };
        assert_eq!(r.exit_code(), crate::EXIT_NOT_VALIDATED);
        let j = r.to_json();
        assert_eq!(j["ports"][0]["rtt_us"]["min"], 10.0);
        assert_eq!(j["ports"][0]["rtt_us"]["max"], 15.0);
        assert_eq!(j["ports"][1]["error_kind"], "timeout");
        let t = r.to_table();
        assert!(t.contains("10.0 µs") && t.contains("8.00 Gb/s"), "{t}");
        assert!(t.contains("FAILED (timeout)"), "{t}");
    }
}
