//! The probe requirements: `rdma:` (with `roce:`), `lustre:`, `mounts:`, `gpudirect:`,
//! `placement:` and `kubernetes:`.

use super::duration::{bounded_duration, parse_bounded_duration};
use fabricgate_probes::gpudirect::pci::Relation;
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Device-plugin liveness: what the agent requires of its own (watched) Node, and of the
/// plugin's socket and device nodes on the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// How long a Node whose `rdma_resources` all read 0 in both capacity and allocatable -
    /// what a kubelet restart shows until the plugins register again - is held back from
    /// failing (humantime, 0s to 10m; `0s`: off). A plugin that dies under a running kubelet
    /// (capacity kept, allocatable 0) fails the node at once either way.
    #[serde(with = "plugin_grace")]
    pub plugin_grace: Duration,
    /// DRA drivers that publish the node's HCAs (`kubernetes.dra`, docs/dra.md).
    /// Read by DRA itself (`dra::settings::DraSettings`).
    pub dra: super::Section,
}

/// `kubernetes.plugin_grace`: three kubelet status syncs (10 s each) for the plugins to
/// register again after a kubelet restart (measured: back on the Node 9.8 s after the kubelet
/// started, docs/testing.md "The real node").
pub const DEFAULT_PLUGIN_GRACE: Duration = Duration::from_secs(30);

/// Where the kubelet keeps device-plugin sockets.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

impl Default for KubernetesRequirements {
    fn default() -> Self {
        Self {
            rdma_resources: Vec::new(),
            device_plugin_dir: DEFAULT_DEVICE_PLUGIN_DIR.into(),
            device_plugin_sockets: Vec::new(),
            plugin_grace: DEFAULT_PLUGIN_GRACE,
            dra: super::Section::default(),
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

bounded_duration!(
    selftest_timeout,
    "rdma.selftest_timeout",
    Duration::from_millis(1),
    Duration::from_secs(60)
);
bounded_duration!(
    plugin_grace,
    "kubernetes.plugin_grace",
    Duration::ZERO,
    Duration::from_secs(600)
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
