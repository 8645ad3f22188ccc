//! The requirements file (`--config FILE`, YAML). Every key is optional; unknown keys, bad
//! values and unreadable files are errors that name the key or path.

use crate::error::{Error, Result};
use fabricgate_probes::gpudirect::pci::Relation;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub(crate) mod duration;
pub mod events;
mod file;
pub(crate) mod labels;
pub mod peers;
mod pool;
mod requirements;
mod section;
mod settings;
pub mod storage;
#[cfg(test)]
mod tests;
pub mod webhook;

pub use duration::parse_bounded_duration;
use file::read_config_file;
pub use file::{MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, nesting_depth};
use labels::validate_label_prefix;
pub use labels::{is_label_value, validate_label_key};
pub use pool::{POOL_SELECTOR_FILE, pool_selector_path};
pub use requirements::{
    DEFAULT_DEVICE_PLUGIN_DIR, DeviceGlob, GpudirectRequirements, KubernetesRequirements,
    LinkLayerRequirement, LustreRequirements, MAX_GLOB_BYTES, MountRequirement,
    PlacementRequirements, RdmaRequirements, RoceRequirements,
};
pub use section::{FeatureSection, Section};
pub use settings::{
    BreakerSettings, DEFAULT_GUARD_LEASE, DEFAULT_LABEL_PREFIX, DEFAULT_RECOVER_AFTER,
    FallbackSettings, NodeSettings, OnAgentError, TaintEffect,
};

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
    /// GPUDirect RDMA: GPU ↔ HCA topology, ACS on the paths, the peer-memory path.
    pub gpudirect: GpudirectRequirements,
    /// Labels the operator (or another controller) must have put on the Node.
    pub placement: PlacementRequirements,
    /// Inter-node RDMA measurements (docs/peers.md); off by default.
    pub peers: peers::PeersSettings,
    /// Probe at once on kernel events (docs/events.md); on by default.
    pub events: events::EventsSettings,
    /// What the agent requires of its own Node object (device-plugin liveness).
    pub kubernetes: KubernetesRequirements,
    /// What the admission webhook lets opted-in pods set for NCCL (docs/preflight.md).
    pub webhook: webhook::WebhookSettings,
    /// What `fabricgate admission-check` asks of a gang's nodes (docs/gangs.md; the gang
    /// pre-flight's own section: `gang::settings`).
    pub gang: Section,
    /// `storage.lustre.require_lnet`: the LNet networks Lustre's imports must use.
    pub storage: storage::StorageSettings,
    /// Which pods of the node are judged at run time: RDMA or sockets (runtime transport's
    /// own section: `transport::settings`).
    pub runtime: Section,
    /// The registered subsystems' own sections, by name (`checks.<name>`; each read by its
    /// subsystem in src/checks/, an unknown name refused at load).
    pub checks: std::collections::BTreeMap<String, Section>,
}

/// A wrong value of the requirements file at `key`, and what to give instead.
fn bad(key: &str, message: String) -> Result<()> {
    Err(Error::ConfigValue {
        key: key.to_owned(),
        message,
    })
}

impl Config {
    /// Load and validate a requirements file, with the pool of [`POOL_SELECTOR_FILE`] beside it.
    ///
    /// # Errors
    /// [`Error::ConfigRead`] if the file cannot be read, [`Error::ConfigParse`] for YAML and
    /// unknown keys (the message names the key and line), [`Error::ConfigValue`] for values
    /// out of range.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_config_file(path)?;
        let mut config = Self::parse(&text).map_err(|e| e.in_config_file(path))?;
        pool::apply_pool_file(&mut config, path)?;
        Ok(config)
    }

    /// Parse and validate YAML text (an empty document gives the defaults).
    ///
    /// # Errors
    /// As [`Config::load`], with an empty path in [`Error::ConfigParse`].
    pub fn parse(text: &str) -> Result<Self> {
        let parse_err = |message: String| Error::ConfigParse {
            path: Default::default(),
            message,
        };
        if text.len() > MAX_CONFIG_BYTES {
            return Err(parse_err(format!(
                "{} bytes is more than the {MAX_CONFIG_BYTES} a requirements file may have",
                text.len()
            )));
        }
        let depth = nesting_depth(text);
        if depth > MAX_CONFIG_DEPTH {
            return Err(parse_err(format!(
                "nested {depth} levels deep; a requirements file needs at most 4 and {MAX_CONFIG_DEPTH} \
                 are accepted"
            )));
        }
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

    /// The first value out of range, as `Error::ConfigValue`. The checks run in a fixed
    /// order, so a file with several wrong values always names the same one.
    fn validate(&self) -> Result<()> {
        self.validate_rdma_rate_and_node()?;
        self.validate_kubernetes()?;
        self.validate_mounts_and_counts()?;
        self.validate_transport_and_placement()?;
        self.peers.validate()?;
        self.webhook.validate()?;
        self.storage.validate()?;
        validate_label_prefix(&self.node.label_prefix)
    }

    /// `rdma.min_rate_gbps`, then the breaker's fraction, the pool selector and the guard's
    /// Lease name.
    fn validate_rdma_rate_and_node(&self) -> Result<()> {
        if !self.rdma.min_rate_gbps.is_finite() || self.rdma.min_rate_gbps < 0.0 {
            return bad(
                "rdma.min_rate_gbps",
                format!(
                    "{} is not a rate; give a number of Gb/s >= 0 (e.g. 400)",
                    self.rdma.min_rate_gbps
                ),
            );
        }
        let fraction = self.node.breaker.max_unvalidated_fraction;
        if !(0.0..=1.0).contains(&fraction) {
            return bad(
                "node.breaker.max_unvalidated_fraction",
                format!("{fraction} is not a fraction; give a number from 0 to 1 (e.g. 0.5)"),
            );
        }
        if !self.node.pool_selector.is_empty()
            && self
                .node
                .pool_selector
                .split(',')
                .any(|term| term.trim().is_empty())
        {
            return bad(
                "node.pool_selector",
                format!(
                    "{:?} has an empty term; give the DaemonSet's nodeSelector as a label \
                     selector (e.g. \"pool=gpu-a,fabric=ib\")",
                    self.node.pool_selector
                ),
            );
        }
        let lease = &self.node.breaker.guard_lease;
        let dns_name = lease.len() <= 253
            && lease
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
            && lease.starts_with(|c: char| c.is_ascii_alphanumeric())
            && lease.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !lease.is_empty() && !dns_name {
            return bad(
                "node.breaker.guard_lease",
                format!(
                    "{lease:?} is not a Lease name; give the guard's --lease-name (e.g. \
                     \"fabricgate-guard\"), or \"\" to always list the pool"
                ),
            );
        }
        Ok(())
    }

    /// The device-plugin directory and sockets, and the RDMA resources (`kubernetes.dra` is
    /// DRA's own, checked by `dra::settings`).
    fn validate_kubernetes(&self) -> Result<()> {
        if !self.kubernetes.device_plugin_dir.starts_with('/') {
            return bad(
                "kubernetes.device_plugin_dir",
                format!(
                    "{:?} is not an absolute path; give the directory as mounted in the \
                     agent's container (e.g. {DEFAULT_DEVICE_PLUGIN_DIR})",
                    self.kubernetes.device_plugin_dir
                ),
            );
        }
        for socket in &self.kubernetes.device_plugin_sockets {
            if socket.is_empty() || socket.contains('/') || socket == "." || socket == ".." {
                return bad(
                    "kubernetes.device_plugin_sockets",
                    format!(
                        "{socket:?} is not a file name; give the socket's name inside \
                         kubernetes.device_plugin_dir (e.g. \"rdma-shared.sock\")"
                    ),
                );
            }
        }
        for r in &self.kubernetes.rdma_resources {
            let valid = r.split_once('/').is_some_and(|(domain, name)| {
                !domain.is_empty()
                    && !name.is_empty()
                    && !name.contains('/')
                    && r.len() <= 253
                    && r.bytes().all(|b| {
                        b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'/')
                    })
            });
            if !valid {
                return bad(
                    "kubernetes.rdma_resources",
                    format!(
                        "{r:?} is not an extended resource name; give the name the device \
                         plugin advertises, e.g. \"rdma/hca_shared_devices_a\""
                    ),
                );
            }
        }
        Ok(())
    }

    /// Lustre and other mounts, the fallback's netdevs, `node.recover_after` and
    /// `lustre.min_free_percent`.
    fn validate_mounts_and_counts(&self) -> Result<()> {
        for (i, m) in self.lustre.mounts.iter().enumerate() {
            if !m.starts_with('/') {
                return bad(
                    &format!("lustre.mounts[{i}]"),
                    format!("{m:?} is not an absolute path"),
                );
            }
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
        Ok(())
    }

    /// The RDMA MTU and ECN priority, the GPUDirect relation and the placement labels.
    fn validate_transport_and_placement(&self) -> Result<()> {
        if let Some(mtu) = self.rdma.min_mtu
            && !fabricgate_probes::gpudirect::transport::IB_MTUS.contains(&mtu)
        {
            return bad(
                "rdma.min_mtu",
                format!("{mtu} is not an RDMA MTU; give 256, 512, 1024, 2048 or 4096"),
            );
        }
        if self.rdma.roce.ecn_priority > 7 {
            return bad(
                "rdma.roce.ecn_priority",
                format!(
                    "{} is not a priority; give 0..7",
                    self.rdma.roce.ecn_priority
                ),
            );
        }
        if let Err(e) = self.gpudirect.max_relation.parse::<Relation>() {
            return bad("gpudirect.max_relation", e);
        }
        for (i, key) in self.placement.required_labels.iter().enumerate() {
            if let Err(e) = validate_label_key(key) {
                return bad(&format!("placement.required_labels[{i}]"), e);
            }
        }
        Ok(())
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

    /// The device-name matcher for `rdma.devices` (compiled at load).
    pub fn device_matcher(&self) -> globset::GlobMatcher {
        self.rdma.devices.matcher().clone()
    }
}
