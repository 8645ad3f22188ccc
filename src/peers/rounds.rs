//! Measurement rounds on their own thread: who is measured each round, the `peers.required`
//! window and the finding it adds, and the agent's responder.

use super::discovery::{Discovery, Selector};
use super::metrics::PeerMetrics;
use super::round::{PeerResult, Round};
use crate::config::Config;
use crate::config::peers::{PeerSpec, PeersSettings, Required};
use crate::error::{Error, Result};
use crate::policy::{Finding, Scope};
use fabricgate_probes::Roots;
use fabricgate_probes::rdma::RdmaReport;
use fabricgate_probes::rdma::peer::{
    self, ErrorKind, Identity, KeyRing, LocalPort, Outcome, Plan, Responder, Skip,
};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// State kept across rounds.
pub struct Rounds {
    pub discovery: Discovery,
    pub identity: Identity,
    /// The pool's keys (re-read from `peers.key_file` when it changes).
    pub keys: Arc<KeyRing>,
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
        keys: Arc<KeyRing>,
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
            keys,
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
            let keys = self.keys.keys();
            let mut measured = 0;
            for target in self.selector.order(&targets) {
                if measured >= self.per_round {
                    break;
                }
                let mut skipped = None;
                for local in ports {
                    let outcome = peer::measure(
                        target.addr,
                        local,
                        &self.identity,
                        &keys,
                        &self.plan,
                        self.timeout,
                    );
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
                    // Authenticated answers (the client believes no other): not worth asking
                    // again for a while (EXCLUSION_ROUNDS).
                    Some(Skip::SelfNode | Skip::OtherGroup) => self.selector.exclude(target.addr),
                    // Its agent is starting, or busy: next time round.
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

/// The agent's peer machinery: responder, measuring thread, shared state.
pub struct PeerAgent {
    responder: Responder,
    keys: Arc<KeyRing>,
    ports: Arc<Mutex<Vec<LocalPort>>>,
    required: Arc<Mutex<Option<Finding>>>,
    required_on: bool,
    metrics: PeerMetrics,
    devices: globset::GlobMatcher,
    /// The addresses of the usable ports (the value of the Node annotation
    /// `fabricgate.io/peers-gids`), kept by [`Self::update_ports`] for the Node writer.
    addresses: Arc<Mutex<String>>,
}

impl PeerAgent {
    /// Load the pool's keys, bind the responder on `peers.listen` and start serving.
    ///
    /// # Errors
    /// [`Error::ConfigValue`] without a usable `peers.key_file`; [`Error::Usage`] when the
    /// address cannot be bound.
    pub fn start(
        config: &Config,
        identity: Identity,
        roots: &Roots,
        metrics: PeerMetrics,
    ) -> Result<Self> {
        let keys = Arc::new(config.peers.load_keys()?);
        let listen = &config.peers.listen;
        let listener = std::net::TcpListener::bind(listen).map_err(|e| Error::Usage {
            flag: "peers.listen".into(),
            message: format!("cannot listen on {listen}: {e}"),
        })?;
        // A session may take as long as a client's bound, plus setup.
        let limit = config.peers.timeout + Duration::from_secs(5);
        let responder =
            Responder::start(listener, identity, Arc::clone(&keys), roots.clone(), limit).map_err(
                |e| Error::Internal {
                    message: format!("cannot start the peer responder: {e}"),
                },
            )?;
        tracing::info!(
            addr = %responder.local_addr(),
            key_file = %config.peers.key_file,
            keys = keys.keys().len(),
            "peer responder listening"
        );
        Ok(Self {
            responder,
            keys,
            ports: Arc::new(Mutex::new(Vec::new())),
            required: Arc::new(Mutex::new(None)),
            required_on: config.peers.required().is_some(),
            metrics,
            devices: config.device_matcher(),
            addresses: Arc::default(),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.responder.local_addr()
    }

    /// The ports the responder serves (kept fresh by [`Self::update_ports`]), shared: the
    /// gang pre-flight measures from them.
    pub fn shared_ports(&self) -> Arc<Mutex<Vec<LocalPort>>> {
        Arc::clone(&self.ports)
    }

    /// The addresses of the usable ports (`fabricgate.io/peers-gids`), shared with the Node
    /// writer.
    pub fn shared_addresses(&self) -> Arc<Mutex<String>> {
        Arc::clone(&self.addresses)
    }

    /// What the responder saw of each gang check's sessions.
    pub fn receipts(&self) -> fabricgate_probes::rdma::peer::Receipts {
        self.responder.receipts()
    }

    /// The responder's expected peers (a live gang check's predecessor gets places there).
    pub fn expected_peers(&self) -> fabricgate_probes::rdma::peer::ExpectedPeers {
        self.responder.expected_peers()
    }

    /// The keys the responder uses; the rounds use the same ones.
    pub fn keys(&self) -> Arc<KeyRing> {
        Arc::clone(&self.keys)
    }

    /// After each probe: the validated ports are the ones served and measured from.
    pub fn update_ports(&self, report: &RdmaReport) {
        let ports = LocalPort::usable(report, &|d| self.devices.is_match(d));
        self.metrics.forget_unusable(&ports);
        self.responder.set_ports(ports.clone());
        *self.addresses.lock().unwrap_or_else(|p| p.into_inner()) = gids_value(report, &ports);
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
                    let generation = rounds.keys.generation();
                    let round = rounds.run(&local);
                    log_keys(&rounds.keys, generation);
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

fn log_keys(keys: &KeyRing, before: u64) {
    if let Some(e) = keys.take_reload_error() {
        tracing::warn!(error = %e, "peers key file");
    }
    if keys.generation() != before {
        tracing::info!(
            keys = keys.keys().len(),
            "peers key file changed; using the new keys"
        );
    }
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
            Outcome::Skipped(s @ (Skip::Busy | Skip::Starting)) => {
                tracing::info!(peer = %peer, reason = ?s, "peer skipped this round")
            }
            Outcome::Skipped(s) => tracing::info!(
                peer = %peer, reason = ?s, rounds = super::discovery::EXCLUSION_ROUNDS,
                "peer skipped for the next rounds"
            ),
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

/// The value of the Node annotation `fabricgate.io/peers-gids` for `ports` (the usable ones) of `report`; empty when
/// there is none to publish.
pub fn gids_value(
    report: &fabricgate_probes::rdma::RdmaReport,
    ports: &[fabricgate_probes::rdma::peer::LocalPort],
) -> String {
    let mut out = Vec::new();
    for p in ports.iter().take(64) {
        let Some(port) = report
            .devices
            .iter()
            .find(|d| d.name == p.device)
            .and_then(|d| d.ports.iter().find(|r| r.port == u32::from(p.port)))
        else {
            continue;
        };
        let addr = match p.gid_index {
            Some(i) => port
                .gids
                .iter()
                .find(|g| g.index == u32::from(i))
                .map(|g| g.gid.clone()),
            None => port.lid.filter(|l| *l != 0).map(|l| format!("lid:{l}")),
        };
        if let Some(a) = addr {
            out.push(format!("{}/{}={a}", p.device, p.port));
        }
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_counts_good_rounds_in_the_window() {
        let settings = PeersSettings {
            required: "2 of the last 3 rounds".into(),
            ..PeersSettings::default()
        };
        let keys = || {
            Arc::new(KeyRing::fixed(
                fabricgate_probes::rdma::peer::Keys::from_secrets(&[]),
            ))
        };
        let mut rounds = Rounds::new(
            &settings,
            &[],
            Identity::default(),
            keys(),
            Roots::default(),
        );
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
            keys(),
            Roots::default(),
        );
        assert_eq!(off.required_met(), None);
        assert!(off.required_finding().is_none());
    }
}
