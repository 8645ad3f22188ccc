//! The requirements file (`--config FILE`, YAML). Every key is optional; unknown keys, bad
//! values and unreadable files are errors that name the key or path.

use crate::error::{Error, Result};
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    pub rdma: RdmaRequirements,
    pub lustre: LustreRequirements,
    /// Other required mounts of any type (NFS, GPFS, WekaFS, ...).
    pub mounts: Vec<MountRequirement>,
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
    /// Loopback RC data-path self-test: `off`, `on-start` or `every N probes`.
    pub selftest: String,
    /// Bound on one port's self-test (humantime: `2s`, `500ms`).
    pub selftest_timeout: String,
    /// How often `counters/` and `hw_counters/` are read (humantime; `0s`: every probe).
    /// Unset: every probe when `--interval` is at least 10 s, else every 10 s.
    pub counters_interval: Option<String>,
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
            counters_interval: None,
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

    /// How often the probe reads the counters for a probe loop every `probe_interval`:
    /// `None` is every probe (validated at load; the default if somehow invalid).
    pub fn counters_interval(&self, probe_interval: Duration) -> Option<Duration> {
        match self
            .counters_interval
            .as_deref()
            .map(humantime::parse_duration)
        {
            Some(Ok(d)) => (d > probe_interval).then_some(d),
            _ => fabricgate_probes::default_counters_interval(probe_interval),
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LustreRequirements {
    /// Required mount points; each must be a mounted, healthy, writable Lustre file system.
    pub mounts: Vec<String>,
    /// Also require every Lustre mount found on the node (and the client's imports) healthy.
    pub all_lustre: bool,
    /// How long one probe waits for statfs on the mounts (`5s`, `1500ms`).
    #[serde(with = "humantime_duration")]
    pub statfs_timeout: std::time::Duration,
    /// Capacity floor: percent of blocks and of inodes that must be free (0 = no check).
    pub min_free_percent: f64,
}

impl Default for LustreRequirements {
    fn default() -> Self {
        Self {
            mounts: Vec::new(),
            all_lustre: true,
            statfs_timeout: fabricgate_probes::storage::DEFAULT_STATFS_TIMEOUT,
            min_free_percent: 0.0,
        }
    }
}

/// A required mount of any type (the top-level `mounts:` list).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountRequirement {
    pub path: String,
    /// File-system type as `/proc/self/mountinfo` names it (`nfs4`, `gpfs`, `wekafs`).
    #[serde(default)]
    pub fstype: Option<String>,
    /// Read-only is a problem unless this is false (e.g. a read-only datasets export).
    #[serde(default = "default_true")]
    pub writable: bool,
}

fn default_true() -> bool {
    true
}

/// `statfs_timeout: 5s` in YAML, as humantime writes and reads it.
mod humantime_duration {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(text.trim()).map_err(|e| {
            D::Error::custom(format!(
                "lustre.statfs_timeout: {text:?} is not a duration ({e}); write e.g. \"5s\" or \"1500ms\""
            ))
        })
    }
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

/// The silent-TCP-fallback detector (`fabricgate_fallback_suspected`): over `window`, TCP
/// bytes on `netdevs` at or above `tcp_min_bytes_per_second` while the in-scope RDMA ports
/// (`rdma.devices`) move at most `rdma_max_bytes_per_second`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FallbackSettings {
    pub enabled: bool,
    /// Sliding window the two rates are averaged over (`10m`, `90s`).
    #[serde(with = "humantime_duration")]
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
        if let Some(text) = &self.rdma.counters_interval {
            match humantime::parse_duration(text) {
                Ok(d) if d <= Duration::from_secs(24 * 3600) => {}
                _ => {
                    return bad(
                        "rdma.counters_interval",
                        format!(
                            "{text:?} is not a duration between 0s (every probe) and 24h \
                             (e.g. \"10s\")"
                        ),
                    );
                }
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
        if self.node.recover_after == 0 {
            return bad(
                "node.recover_after",
                "0 would never mark the node ready; give a count >= 1 (default 3)".to_owned(),
            );
        }
        if self.lustre.statfs_timeout.is_zero() {
            return bad(
                "lustre.statfs_timeout",
                "must be longer than 0 (e.g. \"5s\")".into(),
            );
        }
        if !self.lustre.min_free_percent.is_finite()
            || !(0.0..100.0).contains(&self.lustre.min_free_percent)
        {
            return bad(
                "lustre.min_free_percent",
                format!(
                    "{} is not a percentage; give a number >= 0 and < 100",
                    self.lustre.min_free_percent
                ),
            );
        }
        for (i, m) in self.mounts.iter().enumerate() {
            if !m.path.starts_with('/') {
                return bad(
                    &format!("mounts[{i}].path"),
                    format!("{:?} is not an absolute path", m.path),
                );
            }
            if let Some(t) = &m.fstype
                && (t.is_empty() || t.contains(char::is_whitespace))
            {
                return bad(
                    &format!("mounts[{i}].fstype"),
                    format!(
                        "{t:?} is not a file-system type; use the name /proc/self/mountinfo \
                         shows (e.g. nfs4)"
                    ),
                );
            }
        }
        validate_label_prefix(&self.node.label_prefix)
    }

    /// What the storage probe must check, from `lustre:` and `mounts:`.
    pub fn storage_config(&self) -> fabricgate_probes::storage::StorageConfig {
        use fabricgate_probes::storage::{MountSpec, StorageConfig};
        let mut required: Vec<MountSpec> = self
            .lustre
            .mounts
            .iter()
            .map(|p| MountSpec::lustre(p, self.lustre.min_free_percent))
            .collect();
        required.extend(self.mounts.iter().map(|m| MountSpec {
            path: m.path.clone().into(),
            fstype: m.fstype.clone(),
            writable: m.writable,
            min_free_percent: 0.0,
        }));
        StorageConfig {
            required,
            all_lustre: self.lustre.all_lustre,
            statfs_timeout: self.lustre.statfs_timeout,
            lustre_min_free_percent: self.lustre.min_free_percent,
        }
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
        assert!(c.lustre.all_lustre);
        assert_eq!(c.lustre.statfs_timeout, std::time::Duration::from_secs(5));
        assert_eq!(c.lustre.min_free_percent, 0.0);
        assert!(c.mounts.is_empty());
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
    fn storage_sections_parse_and_build_the_probe_config() {
        let c = Config::parse(
            "lustre:\n  mounts: [\"/lustre/scratch\"]\n  all_lustre: false\n  \
             statfs_timeout: 1500ms\n  min_free_percent: 5\n\
             mounts:\n  - path: /datasets\n    fstype: nfs4\n    writable: false\n  - path: /home\n",
        )
        .unwrap();
        assert!(!c.lustre.all_lustre);
        assert_eq!(
            c.lustre.statfs_timeout,
            std::time::Duration::from_millis(1500)
        );
        assert_eq!(c.mounts[0].fstype.as_deref(), Some("nfs4"));
        assert!(!c.mounts[0].writable);
        assert!(c.mounts[1].writable);
        assert_eq!(c.mounts[1].fstype, None);
        let s = c.storage_config();
        assert!(!s.all_lustre);
        assert_eq!(s.statfs_timeout, std::time::Duration::from_millis(1500));
        assert_eq!(s.required.len(), 3);
        assert_eq!(s.required[0].fstype.as_deref(), Some("lustre"));
        assert_eq!(s.required[0].min_free_percent, 5.0);
        assert!(s.required[0].writable);
        assert_eq!(s.required[1].path, std::path::PathBuf::from("/datasets"));
        assert_eq!(s.required[2].min_free_percent, 0.0);
        // Round trip: the serialized duration reads back.
        let again = Config::parse(&serde_norway::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn bad_storage_values_name_the_key() {
        for (yaml, key) in [
            ("lustre:\n  statfs_timeout: soon\n", "statfs_timeout"),
            ("lustre:\n  statfs_timeout: 0s\n", "lustre.statfs_timeout"),
            (
                "lustre:\n  min_free_percent: 100\n",
                "lustre.min_free_percent",
            ),
            (
                "lustre:\n  min_free_percent: -1\n",
                "lustre.min_free_percent",
            ),
            ("lustre:\n  mounts: [scratch]\n", "lustre.mounts[0]"),
            ("lustre:\n  all_lustre: maybe\n", "all_lustre"),
            ("lustre:\n  statfs_timout: 5s\n", "statfs_timout"),
            ("mounts:\n  - path: datasets\n", "mounts[0].path"),
            (
                "mounts:\n  - path: /a\n  - path: /b\n    fstype: \"\"\n",
                "mounts[1].fstype",
            ),
            ("mounts:\n  - path: /a\n    type: nfs\n", "type"),
            ("mounts:\n  - fstype: nfs\n", "path"),
        ] {
            let e = Config::parse(yaml).unwrap_err();
            assert_eq!(e.exit_code(), crate::EXIT_USAGE);
            let e = e.to_string();
            assert!(e.contains(key), "{yaml:?}: {e}");
        }
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
