//! The requirements file (`--config FILE`, YAML). Every key is optional; unknown keys, bad
//! values and unreadable files are errors that name the key or path.

use crate::error::{Error, Result};
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    pub rdma: RdmaRequirements,
    pub lustre: LustreRequirements,
    pub node: NodeSettings,
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
    /// Loopback RC data-path self-test: `off`, `on-start` or `every N probes`.
    pub selftest: String,
    /// Bound on one port's self-test (humantime: `2s`, `500ms`).
    pub selftest_timeout: String,
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
            selftest: "on-start".into(),
            selftest_timeout: "2s".into(),
        }
    }
}

impl RdmaRequirements {
    /// The parsed `rdma.selftest` (validated at load; `on-start` if somehow invalid).
    pub fn selftest_schedule(&self) -> SelftestSchedule {
        self.selftest.parse().unwrap_or_default()
    }

    /// The parsed `rdma.selftest_timeout` (validated at load; 2 s if somehow invalid).
    pub fn selftest_timeout(&self) -> std::time::Duration {
        humantime::parse_duration(&self.selftest_timeout)
            .unwrap_or(fabricgate_probes::rdma::verbs::selftest::DEFAULT_TIMEOUT)
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
    /// Consecutive good probes before a not-ready node is marked ready again (>= 1).
    pub recover_after: u32,
}

impl Default for NodeSettings {
    fn default() -> Self {
        Self {
            label_prefix: DEFAULT_LABEL_PREFIX.into(),
            taint_effect: TaintEffect::NoSchedule,
            recover_after: DEFAULT_RECOVER_AFTER,
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
        if let Err(e) = self.rdma.selftest.parse::<SelftestSchedule>() {
            return bad("rdma.selftest", e);
        }
        match humantime::parse_duration(&self.rdma.selftest_timeout) {
            Ok(d) if !d.is_zero() && d <= std::time::Duration::from_secs(60) => {}
            _ => {
                return bad(
                    "rdma.selftest_timeout",
                    format!(
                        "{:?} is not a duration between 1ms and 60s (e.g. \"2s\")",
                        self.rdma.selftest_timeout
                    ),
                );
            }
        }
        for (i, m) in self.lustre.mounts.iter().enumerate() {
            if !m.starts_with('/') {
                return bad(
                    &format!("lustre.mounts[{i}]"),
                    format!("{m:?} is not an absolute path"),
                );
            }
        }
        if self.node.recover_after == 0 {
            return bad(
                "node.recover_after",
                "0 would never mark the node ready; give a count >= 1 (default 3)".to_owned(),
            );
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
        assert_eq!(c.node.recover_after, 3);
    }

    #[test]
    fn recover_after_must_be_positive() {
        let c = Config::parse("node:\n  recover_after: 5\n").unwrap();
        assert_eq!(c.node.recover_after, 5);
        let e = Config::parse("node:\n  recover_after: 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("node.recover_after"), "{e}");
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
    fn selftest_schedule_parses_and_bad_values_name_the_key() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.rdma.selftest_schedule(), SelftestSchedule::OnStart);
        assert_eq!(c.rdma.selftest_timeout(), std::time::Duration::from_secs(2));
        let c = Config::parse("rdma:\n  selftest: every 6 probes\n  selftest_timeout: 500ms\n")
            .unwrap();
        assert_eq!(c.rdma.selftest_schedule(), SelftestSchedule::Every(6));
        assert_eq!(
            c.rdma.selftest_timeout(),
            std::time::Duration::from_millis(500)
        );
        let c = Config::parse("rdma:\n  selftest: \"off\"\n").unwrap();
        assert_eq!(c.rdma.selftest_schedule(), SelftestSchedule::Off);
        let e = Config::parse("rdma:\n  selftest: sometimes\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rdma.selftest") && e.contains("every N probes"),
            "{e}"
        );
        let e = Config::parse("rdma:\n  selftest_timeout: 0s\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rdma.selftest_timeout"), "{e}");
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let e = Config::load(Path::new("/nonexistent/fabricgate.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/fabricgate.yaml"), "{e}");
    }
}
