//! The requirements file (`--config FILE`, YAML). Every key is optional; unknown keys, bad
//! values and unreadable files are errors that name the key or path.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    pub rdma: RdmaRequirements,
    pub lustre: LustreRequirements,
    pub node: NodeSettings,
    pub fallback: FallbackSettings,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaRequirements {
    /// Glob over device names that count (`mlx5_*`).
    pub devices: String,
    /// Ports that must be ACTIVE + LinkUp and meet the rules below.
    pub min_active_ports: u32,
    /// Each counted port's rate must be at least this.
    pub min_rate_gbps: f64,
    pub link_layer: LinkLayerRequirement,
    /// An Ethernet port counts only if it has a RoCE v2 GID.
    pub require_roce_v2: bool,
    /// The HCA's PCIe link must run at its maximum speed and width.
    pub require_full_pcie_link: bool,
}

impl Default for RdmaRequirements {
    fn default() -> Self {
        Self {
            devices: "*".into(),
            min_active_ports: 1,
            min_rate_gbps: 0.0,
            link_layer: LinkLayerRequirement::Any,
            require_roce_v2: true,
            require_full_pcie_link: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum LinkLayerRequirement {
    InfiniBand,
    Ethernet,
    #[default]
    #[serde(rename = "any")]
    Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LustreRequirements {
    /// Required mount points.
    pub mounts: Vec<String>,
}

/// How the verdict is written onto the Node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSettings {
    /// Prefix of every label and of the taint key (`fabricgate.io/`).
    pub label_prefix: String,
    pub taint_effect: TaintEffect,
}

impl Default for NodeSettings {
    fn default() -> Self {
        Self {
            label_prefix: DEFAULT_LABEL_PREFIX.into(),
            taint_effect: TaintEffect::NoSchedule,
        }
    }
}

/// The silent-TCP-fallback detector (`fabricgate_fallback_suspected`): over `window`, TCP
/// bytes on `netdevs` at or above `tcp_min_bytes_per_second` while the in-scope RDMA ports
/// (`rdma.devices`) move at most `rdma_max_bytes_per_second`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FallbackSettings {
    pub enabled: bool,
    /// Sliding window the two rates are averaged over (`10m`, `90s`).
    #[serde(with = "duration_text")]
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

/// `Duration` as humantime text (`10m`) in the YAML file.
mod duration_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| {
            serde::de::Error::custom(format!("{text:?} is not a duration such as \"10m\": {e}"))
        })
    }
}

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

impl Config {
    /// Load and validate a requirements file.
    ///
    /// # Errors
    /// [`Error::ConfigRead`] if the file cannot be read, [`Error::ConfigParse`] for YAML and
    /// unknown keys (the message names the key and line), [`Error::ConfigValue`] for values
    /// out of range.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            Error::ConfigParse { message, .. } => Error::ConfigParse {
                path: path.to_owned(),
                message,
            },
            other => other,
        })
    }

    /// Parse and validate YAML text (an empty document gives the defaults).
    ///
    /// # Errors
    /// As [`Config::load`], with an empty path in [`Error::ConfigParse`].
    pub fn parse(text: &str) -> Result<Self> {
        let config: Self = if text.trim().is_empty() {
            Self::default()
        } else {
            serde_norway::from_str(text).map_err(|e| Error::ConfigParse {
                path: Default::default(),
                message: e.to_string(),
            })?
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::ConfigValue {
                key: key.to_owned(),
                message,
            })
        };
        if !self.rdma.min_rate_gbps.is_finite() || self.rdma.min_rate_gbps < 0.0 {
            return bad(
                "rdma.min_rate_gbps",
                format!(
                    "{} is not a rate; give a number of Gb/s >= 0 (e.g. 400)",
                    self.rdma.min_rate_gbps
                ),
            );
        }
        if let Err(e) = globset::Glob::new(&self.rdma.devices) {
            return bad(
                "rdma.devices",
                format!("{:?} is not a valid glob: {e}", self.rdma.devices),
            );
        }
        for (i, m) in self.lustre.mounts.iter().enumerate() {
            if !m.starts_with('/') {
                return bad(
                    &format!("lustre.mounts[{i}]"),
                    format!("{m:?} is not an absolute path"),
                );
            }
        }
        if self.fallback.window < Duration::from_secs(1) {
            return bad(
                "fallback.window",
                format!(
                    "{} is too short; give at least a few probe intervals (e.g. \"10m\")",
                    humantime::format_duration(self.fallback.window)
                ),
            );
        }
        for (i, n) in self.fallback.netdevs.iter().enumerate() {
            if n.is_empty() || n.contains('/') || n == "." || n == ".." {
                return bad(
                    &format!("fallback.netdevs[{i}]"),
                    format!("{n:?} is not an interface name (see `ip link`)"),
                );
            }
        }
        validate_label_prefix(&self.node.label_prefix)
    }

    /// The device-name matcher for `rdma.devices`.
    pub fn device_matcher(&self) -> globset::GlobMatcher {
        globset::Glob::new(&self.rdma.devices)
            .unwrap_or_else(|_| match globset::Glob::new("*") {
                Ok(g) => g,
                Err(_) => unreachable!("\"*\" is a valid glob"),
            })
            .compile_matcher()
    }
}

/// A label prefix is a DNS subdomain followed by `/` (Kubernetes label key prefix rules).
fn validate_label_prefix(prefix: &str) -> Result<()> {
    let err = |message: String| {
        Err(Error::ConfigValue {
            key: "node.label_prefix".into(),
            message,
        })
    };
    let Some(domain) = prefix.strip_suffix('/') else {
        return err(format!(
            "{prefix:?} must end with '/' (e.g. \"fabricgate.io/\")"
        ));
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if domain.is_empty() || domain.len() > 253 || !domain.split('.').all(label_ok) {
        return err(format!(
            "{prefix:?} is not a DNS subdomain followed by '/' (lowercase letters, digits, '-', '.')"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_documented_defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.rdma.devices, "*");
        assert_eq!(c.rdma.min_active_ports, 1);
        assert_eq!(c.rdma.min_rate_gbps, 0.0);
        assert_eq!(c.rdma.link_layer, LinkLayerRequirement::Any);
        assert!(c.rdma.require_roce_v2);
        assert!(c.rdma.require_full_pcie_link);
        assert!(c.lustre.mounts.is_empty());
        assert_eq!(c.node.taint_key(), "fabricgate.io/unvalidated");
    }

    #[test]
    fn full_file_parses() {
        let c = Config::parse(
            "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  min_rate_gbps: 400\n  \
             link_layer: InfiniBand\n  require_roce_v2: false\n  require_full_pcie_link: false\n\
             lustre:\n  mounts: [\"/lustre/scratch\"]\n",
        )
        .unwrap();
        assert_eq!(c.rdma.min_active_ports, 8);
        assert_eq!(c.rdma.min_rate_gbps, 400.0);
        assert_eq!(c.rdma.link_layer, LinkLayerRequirement::InfiniBand);
        assert!(c.device_matcher().is_match("mlx5_3"));
        assert!(!c.device_matcher().is_match("rxe0"));
        assert_eq!(c.lustre.mounts, vec!["/lustre/scratch".to_string()]);
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = Config::parse("rdma:\n  min_port: 2\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("min_port"), "{e}");
        let e = Config::parse("rdma:\n  min_rate_gbps: -1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rdma.min_rate_gbps"), "{e}");
        let e = Config::parse("rdma:\n  link_layer: Infiniband\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("Infiniband"), "{e}");
        let e = Config::parse("rdma:\n  min_active_ports: many\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("min_active_ports"), "{e}");
        let e = Config::parse("rdma:\n  devices: \"mlx5_[\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rdma.devices"), "{e}");
        let e = Config::parse("node:\n  label_prefix: Fabric\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("node.label_prefix"), "{e}");
    }

    #[test]
    fn fallback_section_defaults_parse_and_validate() {
        let c = Config::parse("").unwrap();
        assert!(c.fallback.enabled);
        assert_eq!(c.fallback.window, Duration::from_secs(600));
        assert!(c.fallback.netdevs.is_empty());
        assert_eq!(c.fallback.tcp_min_bytes_per_second, 100_000_000);
        assert_eq!(c.fallback.rdma_max_bytes_per_second, 1_000_000);
        let c = Config::parse(
            "fallback:\n  window: 90s\n  netdevs: [eth0, bond0]\n  \
             tcp_min_bytes_per_second: 5000\n  rdma_max_bytes_per_second: 10\n",
        )
        .unwrap();
        assert_eq!(c.fallback.window, Duration::from_secs(90));
        assert_eq!(c.fallback.netdevs, ["eth0", "bond0"]);
        assert_eq!(c.fallback.tcp_min_bytes_per_second, 5000);
        let e = Config::parse("fallback:\n  window: soon\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("soon"), "{e}");
        let e = Config::parse("fallback:\n  window: 10ms\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fallback.window"), "{e}");
        let e = Config::parse("fallback:\n  netdevs: [\"../x\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fallback.netdevs[0]"), "{e}");
        let e = Config::parse("fallback:\n  tcp_rate: 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tcp_rate"), "{e}");
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let e = Config::load(Path::new("/nonexistent/fabricgate.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/fabricgate.yaml"), "{e}");
    }
}
