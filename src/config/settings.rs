//! How the agent acts on its verdict: `node:` (labels, taint, the blast-radius breaker) and
//! `fallback:` (the silent-TCP-fallback detector).

use super::duration::{bounded_duration, parse_bounded_duration};
use serde::{Deserialize, Serialize};
use std::time::Duration;

bounded_duration!(
    breaker_window,
    "node.breaker.window",
    Duration::from_secs(1),
    Duration::from_secs(7 * 86_400)
);
bounded_duration!(
    fallback_window,
    "fallback.window",
    Duration::from_secs(1),
    Duration::from_secs(7 * 86_400)
);

/// How the verdict is written onto the Node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSettings {
    /// Prefix of every label and of the taint key (`fabricgate.io/`).
    pub label_prefix: String,
    pub taint_effect: TaintEffect,
    /// Consecutive good probes before a not-ready node is marked ready again (>= 1).
    pub recover_after: u32,
    /// Label selector of this agent's pool: the DaemonSet's nodeSelector (`pool=gpu-a`).
    /// The blast-radius breaker counts only these Nodes; empty: the breaker is off.
    pub pool_selector: String,
    pub breaker: BreakerSettings,
    /// What an agent error (condition reason `AgentError`) does to the taint: `taint` (fail
    /// closed) or `keep` (leave it as it is).
    pub on_agent_error: OnAgentError,
}

impl Default for NodeSettings {
    fn default() -> Self {
        Self {
            label_prefix: DEFAULT_LABEL_PREFIX.into(),
            taint_effect: TaintEffect::NoSchedule,
            recover_after: DEFAULT_RECOVER_AFTER,
            on_agent_error: OnAgentError::Taint,
            pool_selector: String::new(),
            breaker: BreakerSettings::default(),
        }
    }
}

/// The blast-radius breaker: before newly tainting its Node, the agent counts the Nodes of
/// its pool (`node.pool_selector`) that already carry the taint, and does not taint past these
/// limits (condition reason `BreakerOpen`). It never blocks untainting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerSettings {
    /// `false`: taint regardless of the pool (the operator override for the whole pool; the
    /// annotation `<label_prefix>breaker-override: "true"` does it for one Node).
    pub enabled: bool,
    /// Tainting this Node must not bring the tainted share of the pool above this (0..=1).
    pub max_unvalidated_fraction: f64,
    /// At most this many Nodes of the pool may have turned not ready (our `FabricReady`
    /// condition's transition time) within `window`, this one included; 0: no such cap.
    pub max_new_per_window: u32,
    #[serde(with = "breaker_window")]
    pub window: Duration,
    /// The guard's Lease (in the agent's namespace) whose `<label_prefix>pool` annotation holds
    /// the pool as the guard's leader counts it: a newly failing agent reads that one object
    /// instead of listing the pool. Empty, or no fresh summary there (no guard deployed, its
    /// leader gone): the agent lists the pool's Nodes as before.
    pub guard_lease: String,
}

/// The guard's default `--lease-name`.
pub const DEFAULT_GUARD_LEASE: &str = "fabricgate-guard";

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            max_unvalidated_fraction: 0.5,
            max_new_per_window: 20,
            window: Duration::from_secs(600),
            guard_lease: DEFAULT_GUARD_LEASE.to_owned(),
        }
    }
}

/// `node.on_agent_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnAgentError {
    /// Taint the node while the agent cannot judge it (fail closed).
    #[default]
    Taint,
    /// Leave the taint as it is on the Node until the agent can judge again.
    Keep,
}

/// The silent-TCP-fallback detector (`fabricgate_fallback_suspected`): over `window`, TCP
/// bytes on `netdevs` at or above `tcp_min_bytes_per_second` while the in-scope RDMA ports
/// (`rdma.devices`) move at most `rdma_max_bytes_per_second`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FallbackSettings {
    pub enabled: bool,
    /// Sliding window the two rates are averaged over (`10m`, `90s`; 1s to 7 days).
    #[serde(with = "fallback_window")]
    pub window: Duration,
    /// Interfaces on the TCP path (pod network, RoCE netdevs); empty: every physical one
    /// (every one but `lo` where there is none, as in a pod's network namespace).
    pub netdevs: Vec<String>,
    /// TCP receive + transmit rate, summed over `netdevs`, that counts as "high".
    pub tcp_min_bytes_per_second: u64,
    /// RDMA receive + transmit rate, summed over the in-scope ports, that counts as "idle".
    pub rdma_max_bytes_per_second: u64,
}

impl Default for FallbackSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            window: Duration::from_secs(600),
            netdevs: Vec::new(),
            // 100 MB/s (800 Mb/s): far above control-plane chatter, far below what a
            // data-parallel job pushes when NCCL falls back to sockets.
            tcp_min_bytes_per_second: 100_000_000,
            // 1 MB/s: an RDMA port carrying any collective traffic moves orders more.
            rdma_max_bytes_per_second: 1_000_000,
        }
    }
}

pub const DEFAULT_RECOVER_AFTER: u32 = 3;

pub const DEFAULT_LABEL_PREFIX: &str = "fabricgate.io/";

impl NodeSettings {
    pub fn taint_key(&self) -> String {
        format!("{}unvalidated", self.label_prefix)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum TaintEffect {
    #[default]
    NoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoSchedule => "NoSchedule",
            Self::NoExecute => "NoExecute",
        }
    }
}
