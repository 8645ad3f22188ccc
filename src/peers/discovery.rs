//! Peer discovery: the static list and the headless Service resolved afresh each round, and
//! the round-robin over what they give.

use crate::config::peers::PeerSpec;
use std::collections::{BTreeMap, BTreeSet};

/// Rounds an address that answered SELF or OTHER_GROUP (authenticated) is left out of; then
/// it is asked again (a node's group label may change, its address be reused).
pub const EXCLUSION_ROUNDS: u64 = 10;
use std::net::{SocketAddr, ToSocketAddrs};

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
/// be this node or another group are left out for [`EXCLUSION_ROUNDS`] rounds, or until they
/// leave the list.
#[derive(Debug, Default)]
pub struct Selector {
    last: Option<SocketAddr>,
    /// Excluded addresses and the round they were excluded in.
    excluded: BTreeMap<SocketAddr, u64>,
    round: u64,
}

impl Selector {
    /// Candidates in order for this round (all of them; the caller stops after `per_round`
    /// measured).
    pub fn order(&self, targets: &[Target]) -> Vec<Target> {
        let eligible: Vec<&Target> = targets
            .iter()
            .filter(|t| !self.excluded.contains_key(&t.addr))
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
        self.excluded.insert(addr, self.round);
        self.last = Some(addr);
    }

    /// Start a round over `targets`: forget exclusions of addresses no longer listed (a node
    /// replaced at the same address is tried again once it has left and come back) and
    /// exclusions older than [`EXCLUSION_ROUNDS`].
    pub fn retain(&mut self, targets: &[Target]) {
        self.round += 1;
        let listed: BTreeSet<SocketAddr> = targets.iter().map(|t| t.addr).collect();
        let now = self.round;
        self.excluded
            .retain(|a, at| listed.contains(a) && now - *at <= EXCLUSION_ROUNDS);
    }
}
