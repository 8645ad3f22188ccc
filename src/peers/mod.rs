//! Inter-node RDMA measurements in the agent: peer discovery (a static list, the A records of
//! a headless Service), round-robin rounds on their own thread, the `fabricgate_peer_*`
//! metrics with bounded cardinality, the optional `peers.required` policy, and
//! `fabricgate ping`. The `peers:` settings they follow live in `config::peers`.
//!
//! The protocol, the responder and the measurement itself live in
//! `fabricgate_probes::rdma::peer` (synchronous, no tokio).

mod discovery;
mod metrics;
mod ping;
mod round;
mod rounds;
#[cfg(test)]
mod tests;

pub use discovery::{Discovery, Selector, Target};
pub use metrics::PeerMetrics;
pub use ping::{PingReport, ping};
pub use round::{PeerResult, Round};
pub use rounds::{PeerAgent, Rounds, group_of};
