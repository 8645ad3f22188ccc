//! The `gang:` section: what `fabricgate admission-check` (the Kueue admission-check
//! controller, docs/gangs.md) asks of a gang's nodes before Kueue releases it.

use super::duration::{bounded_duration, parse_bounded_duration};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Default `gang.namespace`: where the FabricCheck objects live.
pub const DEFAULT_NAMESPACE: &str = "fabricgate";
/// Default `gang.timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);
/// Default `gang.max_nodes`.
pub const DEFAULT_MAX_NODES: usize = 256;
/// Upper bound of `gang.max_nodes` (a FabricCheck's members stay far below the object limit).
pub const MAX_MAX_NODES: usize = 4096;

/// `gang:` in the config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GangSettings {
    /// Namespace of the FabricCheck objects (the agents' namespace).
    pub namespace: String,
    /// How long the gang's agents have to write their results (1s to 10m); a member that has
    /// not answered by then fails the check (`Retry`, never `Ready`).
    #[serde(with = "timeout")]
    pub timeout: Duration,
    /// Also run an RDMA WRITE bandwidth burst per pair and require this much (Gbit/s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_bandwidth_gbps: Option<f64>,
    /// Largest gang the pre-flight runs on (2 to 4096); a larger one is `Rejected`.
    pub max_nodes: usize,
    /// A pair is good only when it was measured over RDMA. `false`: for clusters (and
    /// tests) without verbs, an answer over the peers' side channel is enough, and the
    /// check's message says so.
    pub require_rdma: bool,
}

impl Default for GangSettings {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            min_bandwidth_gbps: None,
            max_nodes: DEFAULT_MAX_NODES,
            require_rdma: true,
        }
    }
}

bounded_duration!(
    timeout,
    "gang.timeout",
    Duration::from_secs(1),
    Duration::from_secs(600)
);

impl GangSettings {
    pub(super) fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::ConfigValue {
                key: format!("gang.{key}"),
                message,
            })
        };
        let dns_label = !self.namespace.is_empty()
            && self.namespace.len() <= 63
            && self
                .namespace
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !self.namespace.starts_with('-')
            && !self.namespace.ends_with('-');
        if !dns_label {
            return bad(
                "namespace",
                format!(
                    "{:?} is not a namespace name; give a DNS label such as {DEFAULT_NAMESPACE}",
                    self.namespace
                ),
            );
        }
        if !(2..=MAX_MAX_NODES).contains(&self.max_nodes) {
            return bad(
                "max_nodes",
                format!(
                    "{} is out of range; give 2 to {MAX_MAX_NODES} (default {DEFAULT_MAX_NODES})",
                    self.max_nodes
                ),
            );
        }
        if let Some(g) = self.min_bandwidth_gbps
            && !(g.is_finite() && g > 0.0 && g <= 100_000.0)
        {
            return bad(
                "min_bandwidth_gbps",
                format!("{g} is out of range; give Gbit/s above 0 (e.g. 25), or leave it out"),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_bounds_and_errors_name_the_key() {
        let d = GangSettings::default();
        d.validate().unwrap();
        assert_eq!(d.namespace, "fabricgate");
        assert_eq!(d.timeout, Duration::from_secs(20));
        assert_eq!(d.max_nodes, 256);
        assert!(d.require_rdma && d.min_bandwidth_gbps.is_none());
        let ok: GangSettings = serde_norway::from_str(
            "namespace: gangs\ntimeout: 5s\nmin_bandwidth_gbps: 25\nmax_nodes: 64\n\
             require_rdma: false\n",
        )
        .unwrap();
        ok.validate().unwrap();
        assert_eq!(ok.timeout, Duration::from_secs(5));
        assert_eq!(ok.min_bandwidth_gbps, Some(25.0));
        assert!(!ok.require_rdma);
        let e = serde_norway::from_str::<GangSettings>("timeout: 0s\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gang.timeout"), "{e}");
        for (yaml, key) in [
            ("max_nodes: 1\n", "gang.max_nodes"),
            ("max_nodes: 5000\n", "gang.max_nodes"),
            ("namespace: Bad_NS\n", "gang.namespace"),
            ("min_bandwidth_gbps: 0\n", "gang.min_bandwidth_gbps"),
        ] {
            let s: GangSettings = serde_norway::from_str(yaml).unwrap();
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
        assert!(serde_norway::from_str::<GangSettings>("peers_port: 1\n").is_err());
    }
}
