//! The peer mesh's jobs (docs/peers.md, docs/gangs.md): the rounds thread, and with a cluster
//! the gang ring, which answers `FabricCheck`s; the Node advertises the responder's address
//! and ports for them ([`Advertised`]).

use super::timing::Failpoint;
use crate::config::{Config, FeatureSection};
use crate::error::Result;
use crate::gang::ring::{self, ENDPOINT_ANNOTATION, Ring};
use crate::gang::settings::GangSettings;
use crate::node::Clients;
use crate::peers::{PeerAgent, Rounds};
use fabricgate_probes::rdma::peer::Identity;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The peer responder and its rounds thread, for the agent's life.
pub(super) struct Mesh {
    pub(super) agent: PeerAgent,
    identity: Identity,
    /// `gang.namespace`: where the ring finds its FabricChecks.
    gang_namespace: String,
    /// The probe interval.
    interval: Duration,
    /// Dropped with the mesh (when `run` returns): stops the rounds thread.
    _stop: std::sync::mpsc::Sender<()>,
}

/// What the Node writer advertises for the gang pre-flight.
#[derive(Default)]
pub(super) struct Advertised {
    /// `fabricgate.io/peers-endpoint`: the responder's address.
    pub(super) annotations: BTreeMap<String, String>,
    /// `fabricgate.io/peers-gids`: the addresses of its ports, kept fresh by the probe loop,
    /// for the dialling member to hold its responder to.
    pub(super) gids: Option<Arc<Mutex<String>>>,
}

impl Mesh {
    /// Start the rounds (every `peers.interval`, or the probe interval) when `peers` are on.
    pub(super) fn start(
        peers: Option<(PeerAgent, Rounds)>,
        config: &Config,
        interval: Duration,
    ) -> Result<Option<Self>> {
        let Some((agent, rounds)) = peers else {
            return Ok(None);
        };
        let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
        let identity = rounds.identity.clone();
        let gang_namespace = GangSettings::of(config)?.namespace;
        agent.spawn_rounds(
            rounds,
            config.peers.interval(interval),
            config.peers.keep_rounds as usize,
            stop_rx,
        )?;
        Ok(Some(Self {
            agent,
            identity,
            gang_namespace,
            interval,
            _stop: stop,
        }))
    }

    /// Start the gang ring of `node` until `stop`; what the Node must advertise for it.
    pub(super) fn start_ring(
        &self,
        node: &str,
        config: &Config,
        clients: &Clients,
        rdma: bool,
        failpoint: Failpoint,
        stop: watch::Receiver<bool>,
    ) -> Advertised {
        let pa = &self.agent;
        let mut annotations = BTreeMap::new();
        match advertised(pa.local_addr()) {
            Some(endpoint) => {
                annotations.insert(ENDPOINT_ANNOTATION.to_owned(), endpoint);
            }
            None => tracing::warn!(
                listen = %pa.local_addr(),
                "peers.listen is a wildcard address: the Node gets no \
                 fabricgate.io/peers-endpoint annotation and gang pre-flights cannot name this \
                 node; pass --peers-listen=$(HOST_IP):9465 as the DaemonSet does"
            ),
        }
        let ring = Ring {
            node: node.to_owned(),
            namespace: self.gang_namespace.clone(),
            identity: self.identity.clone(),
            ports: pa.shared_ports(),
            rdma,
            keys: pa.keys(),
            plan: config.peers.plan(),
            bandwidth: (
                config.peers.bandwidth.message_size,
                config.peers.bandwidth.duration,
            ),
            session: config.peers.timeout,
            source: Some(pa.local_addr().ip()).filter(|ip| !ip.is_unspecified()),
            expected: Some(pa.expected_peers()),
            receipts: pa.receipts(),
            requests: clients.requests.clone(),
            watch: clients.watch.clone(),
            // Without the CRD (no admission check installed) every agent's list fails: retry
            // at most every 5 minutes, not every interval, so a fleet does not load the apiserver.
            max_backoff: self.interval.max(ring::MAX_BACKOFF),
            clock_ahead: failpoint.clock_ahead(),
        };
        tokio::spawn(ring::run(ring, stop));
        Advertised {
            annotations,
            gids: Some(pa.shared_addresses()),
        }
    }
}

/// The responder's address as peers reach it, `ip:port`; `None` for a wildcard address.
fn advertised(addr: std::net::SocketAddr) -> Option<String> {
    (!addr.ip().is_unspecified()).then(|| addr.to_string())
}
