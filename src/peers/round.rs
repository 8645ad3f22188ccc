//! What one measurement round found: the peers measured from each local port, read by the
//! rounds (the `peers.required` window) and by the metrics.

use super::discovery::Target;
use fabricgate_probes::rdma::peer::{LocalPort, Outcome};
use std::time::Duration;

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
