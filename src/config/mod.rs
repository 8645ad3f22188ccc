//! The requirements file (`--config FILE`, YAML). Every key is optional; unknown keys, bad
//! values and unreadable files are errors that name the key or path.

use crate::error::{Error, Result};
use fabricgate_probes::gpudirect::pci::Relation;
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

pub mod events;
pub mod peers;

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
}

/// Device-plugin liveness: what the agent requires of its own (watched) Node, and of the
/// plugin's socket and device nodes on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesRequirements {
    /// Extended resources a device plugin advertises (`rdma/hca_shared_devices_a`,
    /// `nvidia.com/hostdev`): each must be in the Node's `status.capacity` and have
    /// `status.allocatable` > 0; and when set, every selected RDMA device must have its
    /// `/dev/infiniband/uverbsN` in the agent's container (the plugin hands them out).
    /// Empty (the default): not checked.
    pub rdma_resources: Vec<String>,
    /// The kubelet's device-plugins directory as mounted (read-only) in the agent's container.
    pub device_plugin_dir: String,
    /// Socket file names in `device_plugin_dir` that must exist (the plugins' registered
    /// endpoints). Empty (the default): not checked.
    pub device_plugin_sockets: Vec<String>,
}

/// Where the kubelet keeps device-plugin sockets.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

impl Default for KubernetesRequirements {
    fn default() -> Self {
        Self {
            rdma_resources: Vec::new(),
            device_plugin_dir: DEFAULT_DEVICE_PLUGIN_DIR.into(),
            device_plugin_sockets: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaRequirements {
    /// Glob over device names that count (`mlx5_*`), compiled at load.
    pub devices: DeviceGlob,
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
    #[serde(with = "schedule")]
    pub selftest: SelftestSchedule,
    /// Bound on one port's self-test (humantime: `2s`, `500ms`; 1ms to 60s).
    #[serde(with = "selftest_timeout")]
    pub selftest_timeout: Duration,
    /// Each counted port's active MTU (bytes: 256, 512, 1024, 2048, 4096) must be at least
    /// this; on RoCE also the netdev MTU must carry it. `None`: not checked.
    pub min_mtu: Option<u32>,
    pub roce: RoceRequirements,
    /// How often the slow attributes are read: `counters/` and `hw_counters/`, each device's
    /// identity, firmware and PCIe capabilities, InfiniBand ports' GID tables, the GPU scan of
    /// an unchanged PCI bus (humantime, 0s to 24h; `0s` or anything up to `--interval`: every
    /// probe). Unset: every probe when `--interval` is at least 10 s, else every 10 s.
    #[serde(with = "counters_interval", skip_serializing_if = "Option::is_none")]
    pub counters_interval: Option<Duration>,
}

/// RoCE-only transport rules (`rdma.roce`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoceRequirements {
    /// ECN must be on (notification and reaction point) for `ecn_priority` where the driver
    /// exposes it in sysfs (mlx5: `class/net/<if>/ecn/roce_{np,rp}/enable/<prio>`).
    pub require_ecn: bool,
    /// The priority RoCE traffic uses (0..7; NCCL's traffic class maps to it; commonly 3).
    pub ecn_priority: u8,
}

impl Default for RoceRequirements {
    fn default() -> Self {
        Self {
            require_ecn: false,
            ecn_priority: 3,
        }
    }
}

/// `gpudirect:` requirements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpudirectRequirements {
    /// Problems found here keep the node unvalidated (otherwise they are warnings).
    pub required: bool,
    /// Worst acceptable PCIe relation between a GPU and its nearest HCA: `PIX`, `PXB`,
    /// `PHB`, `NODE` or `SYS`.
    pub max_relation: String,
    /// Accept ACS request/completion redirection on a GPU–HCA path (some platforms set it on
    /// purpose and route peer-to-peer through the root complex).
    pub allow_acs: bool,
}

impl Default for GpudirectRequirements {
    fn default() -> Self {
        Self {
            required: false,
            max_relation: "PXB".into(),
            allow_acs: false,
        }
    }
}

impl GpudirectRequirements {
    /// The parsed `gpudirect.max_relation` (validated at load; `PXB` if somehow invalid).
    pub fn max_relation(&self) -> Relation {
        self.max_relation.parse().unwrap_or(Relation::Pxb)
    }
}

/// `placement:` requirements.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementRequirements {
    /// Label keys that must be present on the Node (e.g. the topology levels of a Kueue
    /// `Topology`); checked by the agent against its Node, not by `check`.
    pub required_labels: Vec<String>,
}

impl Default for RdmaRequirements {
    fn default() -> Self {
        Self {
            devices: DeviceGlob::any(),
            min_active_ports: 1,
            min_rate_gbps: 0.0,
            link_layer: LinkLayerRequirement::Any,
            require_roce_v2: true,
            require_full_pcie_link: true,
            selftest: SelftestSchedule::OnStart,
            selftest_timeout: fabricgate_probes::rdma::verbs::selftest::DEFAULT_TIMEOUT,
            min_mtu: None,
            roce: RoceRequirements::default(),
            counters_interval: None,
        }
    }
}

impl RdmaRequirements {
    /// `rdma.selftest`, parsed at load.
    pub fn selftest_schedule(&self) -> SelftestSchedule {
        self.selftest
    }

    /// `rdma.selftest_timeout`, parsed and bounded at load.
    pub fn selftest_timeout(&self) -> Duration {
        self.selftest_timeout
    }

    /// How often the probe reads the counters for a probe loop every `probe_interval`:
    /// `None` is every probe (validated at load; the default if somehow invalid).
    pub fn counters_interval(&self, probe_interval: Duration) -> Option<Duration> {
        match self.counters_interval {
            Some(d) => (d > probe_interval).then_some(d),
            None => fabricgate_probes::default_counters_interval(probe_interval),
        }
    }
}

/// Longest `rdma.devices` glob accepted (device names are at most 64 bytes).
pub const MAX_GLOB_BYTES: usize = 256;

/// `rdma.devices`: the glob text as written and its compiled matcher.
#[derive(Debug, Clone)]
pub struct DeviceGlob {
    text: String,
    matcher: globset::GlobMatcher,
}

impl DeviceGlob {
    /// `*`: every device.
    pub fn any() -> Self {
        match "*".parse() {
            Ok(g) => g,
            Err(_) => unreachable!("\"*\" is a valid glob"),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn matcher(&self) -> &globset::GlobMatcher {
        &self.matcher
    }

    pub fn is_match(&self, name: &str) -> bool {
        self.matcher.is_match(name)
    }
}

impl PartialEq for DeviceGlob {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl std::fmt::Display for DeviceGlob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for DeviceGlob {
    type Err = String;

    /// Bounded before it reaches the glob compiler (a 400 KB glob used to panic it).
    fn from_str(text: &str) -> Result<Self, String> {
        if text.len() > MAX_GLOB_BYTES {
            return Err(format!(
                "a glob of {} bytes is longer than the {MAX_GLOB_BYTES} accepted; device names \
                 are short (e.g. \"mlx5_*\")",
                text.len()
            ));
        }
        if text.is_empty() {
            return Err("an empty glob matches no device; use \"*\" for all".into());
        }
        let glob =
            globset::Glob::new(text).map_err(|e| format!("{text:?} is not a valid glob: {e}"))?;
        Ok(Self {
            text: text.to_owned(),
            matcher: glob.compile_matcher(),
        })
    }
}

impl Serialize for DeviceGlob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for DeviceGlob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        // serde_norway names the enclosing section only; the message names the key.
        text.parse()
            .map_err(|e| serde::de::Error::custom(format!("rdma.devices: {e}")))
    }
}

/// `rdma.selftest` as written in YAML.
mod schedule {
    use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(v: &SelftestSchedule, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&match v {
            SelftestSchedule::Off => "off".to_owned(),
            SelftestSchedule::OnStart => "on-start".to_owned(),
            SelftestSchedule::Every(n) => format!("every {n} probes"),
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SelftestSchedule, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|e| D::Error::custom(format!("rdma.selftest: {e}")))
    }
}

/// Parse a humantime duration within `[min, max]`; the message says what is accepted.
///
/// # Errors
/// A message naming the text and the bounds (the caller adds the key or flag).
pub fn parse_bounded_duration(
    text: &str,
    min: Duration,
    max: Duration,
) -> std::result::Result<Duration, String> {
    let range = || {
        format!(
            "between {} and {}",
            humantime::format_duration(min),
            humantime::format_duration(max)
        )
    };
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "{text:?} is not a duration ({e}); give one {} (e.g. \"5s\", \"1500ms\")",
            range()
        )
    })?;
    if d < min || d > max {
        return Err(format!(
            "{text:?} is out of range; give a duration {}",
            range()
        ));
    }
    Ok(d)
}

/// A YAML duration field with bounds: `bounded_duration!(module, "key.path", MIN, MAX)`.
/// serde_norway prefixes errors with the enclosing section only, so the message names the key.
macro_rules! bounded_duration {
    ($name:ident, $key:literal, $min:expr, $max:expr) => {
        mod $name {
            use serde::{Deserialize, Deserializer, Serializer, de::Error as _};
            use std::time::Duration;

            pub const MIN: Duration = $min;
            pub const MAX: Duration = $max;

            pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&humantime::format_duration(*d).to_string())
            }

            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
                let text = String::deserialize(d)?;
                super::parse_bounded_duration(&text, MIN, MAX)
                    .map_err(|e| D::Error::custom(format!("{}: {e}", $key)))
            }
        }
    };
}
pub(crate) use bounded_duration;

bounded_duration!(
    selftest_timeout,
    "rdma.selftest_timeout",
    Duration::from_millis(1),
    Duration::from_secs(60)
);
bounded_duration!(
    statfs_timeout,
    "lustre.statfs_timeout",
    Duration::from_millis(10),
    Duration::from_secs(600)
);
/// `rdma.counters_interval`: optional, bounded like the others.
mod counters_interval {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_bounded_duration(&text, Duration::ZERO, Duration::from_secs(24 * 3600))
            .map(Some)
            .map_err(|e| D::Error::custom(format!("rdma.counters_interval: {e}")))
    }
}

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
    /// How long one probe waits for statfs on the mounts (`5s`, `1500ms`; 10ms to 10m).
    #[serde(with = "statfs_timeout")]
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
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            max_unvalidated_fraction: 0.5,
            max_new_per_window: 20,
            window: Duration::from_secs(600),
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

impl Config {
    /// Load and validate a requirements file.
    ///
    /// # Errors
    /// [`Error::ConfigRead`] if the file cannot be read, [`Error::ConfigParse`] for YAML and
    /// unknown keys (the message names the key and line), [`Error::ConfigValue`] for values
    /// out of range.
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_config_file(path)?;
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
        self.peers.validate()?;
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

    /// The device-name matcher for `rdma.devices` (compiled at load).
    pub fn device_matcher(&self) -> globset::GlobMatcher {
        self.rdma.devices.matcher().clone()
    }
}

/// Largest requirements file accepted.
pub const MAX_CONFIG_BYTES: usize = 256 * 1024;
/// Deepest nesting accepted (block indentation levels, `- ` items and flow brackets).
pub const MAX_CONFIG_DEPTH: usize = 32;

/// Read the requirements file without ever blocking on it: it must be a regular file (a FIFO,
/// a directory or `/dev/zero` is refused before a byte is read) of at most
/// [`MAX_CONFIG_BYTES`].
fn read_config_file(path: &Path) -> Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let read_err = |source: std::io::Error| Error::ConfigRead {
        path: path.to_owned(),
        source,
    };
    let not_regular = |what: &str| Error::ConfigParse {
        path: path.to_owned(),
        message: format!("is {what}, not a regular file; give the path of a YAML file"),
    };
    // O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    let ft = meta.file_type();
    if !ft.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(not_regular(what));
    }
    let limit = u64::try_from(MAX_CONFIG_BYTES).unwrap_or(u64::MAX);
    if meta.len() > limit {
        return Err(Error::ConfigParse {
            path: path.to_owned(),
            message: format!(
                "{} bytes is more than the {MAX_CONFIG_BYTES} a requirements file may have",
                meta.len()
            ),
        });
    }
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(Error::ConfigParse {
            path: path.to_owned(),
            message: format!("more than the {MAX_CONFIG_BYTES} bytes a requirements file may have"),
        });
    }
    String::from_utf8(bytes).map_err(|e| Error::ConfigParse {
        path: path.to_owned(),
        message: format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
    })
}

/// An upper estimate of how deeply `text` nests: block indentation levels plus `- ` sequence
/// markers plus open flow brackets outside quotes. Linear, so deep nesting is refused before
/// the YAML parser spends time on it.
pub fn nesting_depth(text: &str) -> usize {
    let mut max = 0usize;
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    let (mut single, mut double) = (false, false);
    for line in text.lines() {
        let trimmed = line.trim_start_matches([' ', '\t']);
        if trimmed.is_empty() || (trimmed.starts_with('#') && !single && !double) {
            continue;
        }
        if flow == 0 && !single && !double {
            let indent = line.len() - trimmed.len();
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
        }
        let mut rest = trimmed;
        let mut dashes = 0usize;
        if !single && !double {
            while let Some(r) = rest.strip_prefix('-') {
                if !(r.is_empty() || r.starts_with([' ', '\t'])) {
                    break;
                }
                dashes += 1;
                rest = r.trim_start_matches([' ', '\t']);
            }
        }
        let mut peak = flow;
        let mut escaped = false;
        // Quotes open a scalar only where one can start (`it's` is no quote).
        let mut prev_sep = true;
        let mut prev_space = true;
        for c in rest.chars() {
            if double {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '"' => double = false,
                    _ => {}
                }
                continue;
            }
            if single {
                if c == '\'' {
                    single = false;
                }
                continue;
            }
            match c {
                '"' if prev_sep => double = true,
                '\'' if prev_sep => single = true,
                '#' if prev_space => break,
                '[' | '{' => {
                    flow += 1;
                    peak = peak.max(flow);
                }
                ']' | '}' => flow = flow.saturating_sub(1),
                _ => {}
            }
            prev_space = c == ' ' || c == '\t';
            prev_sep = prev_space || matches!(c, '[' | '{' | ',');
        }
        max = max.max(indents.len() + dashes + peak);
    }
    max
}

/// A Kubernetes label key: optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters (alphanumerics, `-`, `_`, `.`; alphanumeric at both ends).
pub fn validate_label_key(key: &str) -> std::result::Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && validate_label_prefix(&format!("{p}/")).is_err()
    {
        return Err(format!("{key:?}: the prefix {p:?} is not a DNS subdomain"));
    }
    if !is_label_value(name) || name.is_empty() {
        return Err(format!(
            "{key:?}: the name must be 1-63 characters of [A-Za-z0-9-_.], alphanumeric at both ends"
        ));
    }
    Ok(())
}

/// A valid Kubernetes label value (empty allowed): at most 63 characters of `[A-Za-z0-9-_.]`,
/// beginning and ending with an alphanumeric.
pub fn is_label_value(v: &str) -> bool {
    let alnum = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && alnum(v.chars().next())
        && alnum(v.chars().last())
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
        assert_eq!(c.rdma.devices.as_str(), "*");
        assert_eq!(c.node.on_agent_error, OnAgentError::Taint);
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
    fn fail_closed_keys_parse_and_bad_values_name_the_key() {
        let c = Config::parse(
            "kubernetes:\n  rdma_resources: [\"rdma/hca_shared_devices_a\"]\n\
             node:\n  pool_selector: \"pool=a,fabric=ib\"\n  breaker:\n    enabled: false\n\
             \x20   max_unvalidated_fraction: 0.25\n    max_new_per_window: 3\n    window: 5m\n",
        )
        .unwrap();
        assert_eq!(
            c.kubernetes.rdma_resources,
            vec!["rdma/hca_shared_devices_a".to_owned()]
        );
        assert_eq!(c.node.pool_selector, "pool=a,fabric=ib");
        assert!(!c.node.breaker.enabled);
        assert_eq!(c.node.breaker.max_unvalidated_fraction, 0.25);
        assert_eq!(c.node.breaker.max_new_per_window, 3);
        assert_eq!(c.node.breaker.window, Duration::from_secs(300));
        let d = Config::default();
        assert!(d.kubernetes.rdma_resources.is_empty() && d.node.pool_selector.is_empty());
        assert!(d.kubernetes.device_plugin_sockets.is_empty());
        assert_eq!(d.kubernetes.device_plugin_dir, DEFAULT_DEVICE_PLUGIN_DIR);
        let c = Config::parse(
            "kubernetes:\n  device_plugin_dir: /host/device-plugins\n  \
             device_plugin_sockets: [rdma.sock]\n",
        )
        .unwrap();
        assert_eq!(c.kubernetes.device_plugin_dir, "/host/device-plugins");
        assert_eq!(c.kubernetes.device_plugin_sockets, ["rdma.sock"]);
        assert_eq!(d.node.breaker.max_unvalidated_fraction, 0.5);
        for (yaml, key) in [
            (
                "kubernetes:\n  rdma_resources: [\"hca\"]\n",
                "kubernetes.rdma_resources",
            ),
            (
                "node:\n  breaker:\n    max_unvalidated_fraction: 1.5\n",
                "node.breaker.max_unvalidated_fraction",
            ),
            ("node:\n  breaker:\n    window: 0s\n", "node.breaker.window"),
            ("node:\n  pool_selector: \"a=b,\"\n", "node.pool_selector"),
            (
                "kubernetes:\n  device_plugin_dir: var/lib/kubelet\n",
                "kubernetes.device_plugin_dir",
            ),
            (
                "kubernetes:\n  device_plugin_sockets: [\"../kubelet.sock\"]\n",
                "kubernetes.device_plugin_sockets",
            ),
        ] {
            let e = Config::parse(yaml).unwrap_err().to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
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
    fn gpudirect_transport_and_placement_keys() {
        let c = Config::parse("").unwrap();
        assert!(!c.gpudirect.required);
        assert_eq!(c.gpudirect.max_relation(), Relation::Pxb);
        assert!(!c.gpudirect.allow_acs);
        assert_eq!(c.rdma.min_mtu, None);
        assert!(!c.rdma.roce.require_ecn);
        assert_eq!(c.rdma.roce.ecn_priority, 3);
        assert!(c.placement.required_labels.is_empty());
        let c = Config::parse(
            "rdma:\n  min_mtu: 4096\n  roce:\n    require_ecn: true\n    ecn_priority: 5\n\
             gpudirect:\n  required: true\n  max_relation: PIX\n  allow_acs: true\n\
             placement:\n  required_labels: [topology.kubernetes.io/zone, example.com/rack, block]\n",
        )
        .unwrap();
        assert_eq!(c.rdma.min_mtu, Some(4096));
        assert!(c.rdma.roce.require_ecn);
        assert_eq!(c.rdma.roce.ecn_priority, 5);
        assert!(c.gpudirect.required && c.gpudirect.allow_acs);
        assert_eq!(c.gpudirect.max_relation(), Relation::Pix);
        assert_eq!(c.placement.required_labels.len(), 3);
        for (yaml, key) in [
            ("rdma:\n  min_mtu: 1500\n", "rdma.min_mtu"),
            (
                "rdma:\n  roce:\n    ecn_priority: 8\n",
                "rdma.roce.ecn_priority",
            ),
            ("rdma:\n  roce:\n    ecn: true\n", "ecn"),
            (
                "gpudirect:\n  max_relation: CLOSE\n",
                "gpudirect.max_relation",
            ),
            ("gpudirect:\n  requried: true\n", "requried"),
            (
                "placement:\n  required_labels: [\"bad key!\"]\n",
                "placement.required_labels[0]",
            ),
            (
                "placement:\n  required_labels: [\"Example.com/rack\"]\n",
                "placement.required_labels[0]",
            ),
        ] {
            let e = Config::parse(yaml).unwrap_err().to_string();
            assert!(e.contains(key), "{yaml:?}: {e}");
        }
        assert!(is_label_value("0.1.2.3") && is_label_value("") && is_label_value("PXB"));
        assert!(
            !is_label_value("-x") && !is_label_value("a/b") && !is_label_value(&"a".repeat(64))
        );
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let e = Config::load(Path::new("/nonexistent/fabricgate.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/fabricgate.yaml"), "{e}");
    }
}

#[cfg(test)]
mod hardening_tests {
    use super::*;

    fn err(yaml: &str) -> String {
        let e = Config::parse(yaml).unwrap_err();
        assert_eq!(e.exit_code(), crate::EXIT_USAGE, "{yaml:?}");
        e.to_string()
    }

    #[test]
    fn each_duration_error_names_its_own_key() {
        // fallback.window used to be reported as lustre.statfs_timeout.
        let e = err("fallback:\n  window: soon\n");
        assert!(e.contains("fallback.window"), "{e}");
        assert!(!e.contains("statfs_timeout"), "{e}");
        let e = err("rdma:\n  selftest_timeout: 2 fortnights\n");
        assert!(e.contains("rdma.selftest_timeout"), "{e}");
        let e = err("lustre:\n  statfs_timeout: soon\n");
        assert!(e.contains("lustre.statfs_timeout"), "{e}");
        let e = err("rdma:\n  selftest: sometimes\n");
        assert!(e.contains("rdma.selftest"), "{e}");
        let e = err("rdma:\n  devices: \"mlx5_[\"\n");
        assert!(e.contains("rdma.devices"), "{e}");
    }

    #[test]
    fn durations_are_bounded_at_both_ends() {
        for (yaml, key) in [
            (
                "lustre:\n  statfs_timeout: 300000000000y\n",
                "lustre.statfs_timeout",
            ),
            ("lustre:\n  statfs_timeout: 1ms\n", "lustre.statfs_timeout"),
            ("rdma:\n  selftest_timeout: 61s\n", "rdma.selftest_timeout"),
            ("rdma:\n  selftest_timeout: 0s\n", "rdma.selftest_timeout"),
            ("fallback:\n  window: 300000000000y\n", "fallback.window"),
            ("fallback:\n  window: 10ms\n", "fallback.window"),
        ] {
            let e = err(yaml);
            assert!(e.contains(key) && e.contains("between"), "{yaml:?}: {e}");
        }
        let c =
            Config::parse("lustre:\n  statfs_timeout: 10m\nfallback:\n  window: 7days\n").unwrap();
        assert_eq!(c.lustre.statfs_timeout, Duration::from_secs(600));
        assert_eq!(c.fallback.window, Duration::from_secs(7 * 86_400));
    }

    #[test]
    fn schedule_timeout_and_glob_are_typed_at_load() {
        let c = Config::parse(
            "rdma:\n  devices: \"mlx5_*\"\n  selftest: every 6 probes\n  selftest_timeout: 500ms\n",
        )
        .unwrap();
        assert_eq!(c.rdma.selftest, SelftestSchedule::Every(6));
        assert_eq!(c.rdma.selftest_timeout, Duration::from_millis(500));
        assert!(c.rdma.devices.is_match("mlx5_0"));
        assert!(!c.rdma.devices.is_match("rxe0"));
        let again = Config::parse(&serde_norway::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn a_huge_glob_is_refused_before_compiling() {
        let glob = "a".repeat(100 * 1024);
        let started = std::time::Instant::now();
        let e = err(&format!("rdma:\n  devices: \"{glob}\"\n"));
        assert!(
            e.contains("rdma.devices") && e.contains("longer than"),
            "{}",
            &e[..200.min(e.len())]
        );
        // Generous: the check is linear; the old path panicked in the glob compiler.
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        let e = err("rdma:\n  devices: \"\"\n");
        assert!(e.contains("rdma.devices"), "{e}");
    }

    #[test]
    fn deep_nesting_is_refused_before_parsing() {
        let flow = format!("rdma: {}{}\n", "[".repeat(10_000), "]".repeat(10_000));
        let e = err(&flow);
        assert!(e.contains("nested"), "{e}");
        let mut block = String::new();
        for i in 0..100 {
            block.push_str(&" ".repeat(i));
            block.push_str("k:\n");
        }
        assert!(err(&block).contains("nested"));
        let dashes = format!("mounts:\n  {}/a\n", "- ".repeat(100));
        assert!(err(&dashes).contains("nested"));
        // The shipped example is shallow.
        assert!(nesting_depth("rdma:\n  devices: \"[[[[\"\nmounts:\n  - path: /a\n") <= 4);
    }

    #[test]
    fn on_agent_error_parses() {
        let c = Config::parse("node:\n  on_agent_error: keep\n").unwrap();
        assert_eq!(c.node.on_agent_error, OnAgentError::Keep);
        let e = err("node:\n  on_agent_error: maybe\n");
        assert!(e.contains("node.on_agent_error"), "{e}");
    }

    #[test]
    fn a_config_path_that_is_not_a_regular_file_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let e = Config::load(dir.path()).unwrap_err();
        assert_eq!(e.exit_code(), crate::EXIT_USAGE);
        assert!(e.to_string().contains("a directory"), "{e}");
        let e = Config::load(Path::new("/dev/zero")).unwrap_err();
        assert!(e.to_string().contains("a device"), "{e}");
        let fifo = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(status.is_ok_and(|s| s.success()), "mkfifo (coreutils)");
        let e = Config::load(&fifo).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let big = dir.path().join("big.yaml");
        std::fs::write(&big, "#".repeat(MAX_CONFIG_BYTES + 1)).unwrap();
        let e = Config::load(&big).unwrap_err();
        assert!(e.to_string().contains("bytes"), "{e}");
    }
}
