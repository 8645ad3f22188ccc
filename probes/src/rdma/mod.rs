//! RDMA devices and ports: what sysfs says, what verbs says, and the loopback self-test.

pub mod peer;
pub mod sysfs;
pub mod types;
// The only module allowed `unsafe` (see the crate root).
#[allow(unsafe_code)]
pub mod verbs;

use serde::{Serialize, Serializer};
use std::collections::BTreeMap;
use std::sync::Arc;

pub use types::{GidType, LinkLayer, NodeType, PcieSpeed, PhysState, PortState, Rate, format_gbps};

/// Everything known about the node's RDMA devices after one probe.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RdmaReport {
    /// `class/infiniband` exists: the kernel has an RDMA core loaded.
    pub subsystem_present: bool,
    pub devices: Vec<DeviceReport>,
    /// The verbs layer as a whole; `None` when verbs were not probed (`--verbs off`).
    pub verbs: Option<VerbsStatus>,
    /// Problems not tied to one device (e.g. `class/infiniband` unreadable).
    pub errors: Vec<String>,
}

/// Whether the verbs library could enumerate devices at all.
#[derive(Debug, Clone, Serialize)]
pub struct VerbsStatus {
    /// Device names that `ibv_get_device_list` returned.
    pub devices: Vec<String>,
    /// Why enumeration failed, with what to do (e.g. ENOSYS: no RDMA in this kernel).
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct DeviceReport {
    pub name: String,
    pub node_type: Option<NodeType>,
    pub node_guid: Option<String>,
    pub sys_image_guid: Option<String>,
    pub fw_ver: Option<String>,
    pub hca_type: Option<String>,
    pub board_id: Option<String>,
    /// The PCI function behind the `device` link; `None` for a device without one (rxe, siw)
    /// and when it cannot be resolved (then `pci_error` says why).
    pub pci: Option<PciLink>,
    /// Why the `device` link exists but names no readable PCI function; also in `errors`.
    /// The PCIe link rule (`rdma.require_full_pcie_link`) fails for such a device.
    pub pci_error: Option<String>,
    pub ports: Vec<PortReport>,
    /// `None` when verbs were not probed; otherwise what opening a context gave.
    pub verbs: Option<VerbsDevice>,
    /// Problems that affect the whole device (no ports folder, unreadable attributes).
    pub errors: Vec<String>,
}

/// The HCA's PCIe link, read through the device's `device` symlink.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PciLink {
    /// `0000:3b:00.0`
    pub address: String,
    /// The function's folder below the sysfs root, resolved when the device was opened
    /// (`devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0`): where the GPUDirect probe places the
    /// HCA in the PCIe tree without resolving its links again. Not part of the JSON report.
    #[serde(skip)]
    pub sysfs_dir: Option<String>,
    /// `None` when the platform reports no affinity (`-1`) or the file is absent.
    pub numa_node: Option<u32>,
    pub current_speed_gts: Option<f64>,
    pub current_width: Option<u32>,
    pub max_speed_gts: Option<f64>,
    pub max_width: Option<u32>,
}

impl PciLink {
    /// True when speed or width is known to run below the maximum the device supports.
    pub fn is_degraded(&self) -> bool {
        let below = |cur: Option<f64>, max: Option<f64>| matches!((cur, max), (Some(c), Some(m)) if c + 1e-9 < m);
        below(self.current_speed_gts, self.max_speed_gts)
            || below(
                self.current_width.map(f64::from),
                self.max_width.map(f64::from),
            )
    }
}

/// One entry of the port's GID table that is in use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gid {
    pub index: u32,
    pub gid: String,
    pub gid_type: Option<GidType>,
    /// Network device the GID belongs to (RoCE); `None` on InfiniBand.
    pub netdev: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct PortReport {
    pub port: u32,
    pub state: Option<PortState>,
    pub phys_state: Option<PhysState>,
    pub rate: Option<Rate>,
    pub link_layer: Option<LinkLayer>,
    pub lid: Option<u32>,
    pub sm_lid: Option<u32>,
    pub gids: Vec<Gid>,
    /// `counters/*`, raw as the kernel gives them (`port_xmit_data` is in 4-octet units).
    /// Shared with the prober, which reads counters on their own cadence
    /// (`rdma.counters_interval`): between reads a report carries the last values.
    pub counters: Arc<BTreeMap<String, u64>>,
    /// `hw_counters/*` (driver-specific, e.g. RoCE congestion and retry counters).
    pub hw_counters: Arc<BTreeMap<String, u64>>,
    /// When `counters` and `hw_counters` were read (seconds since the Unix epoch); rates over
    /// them must use this, not the probe's timestamp. `None` when never read.
    pub counters_timestamp: Option<f64>,
    pub verbs: Option<VerbsPort>,
    pub selftest: Option<SelftestResult>,
    pub errors: Vec<String>,
}

impl PortReport {
    /// ACTIVE and LinkUp per sysfs.
    pub fn is_up(&self) -> bool {
        self.state == Some(PortState::Active) && self.phys_state == Some(PhysState::LinkUp)
    }

    pub fn has_roce_v2_gid(&self) -> bool {
        self.gids
            .iter()
            .any(|g| g.gid_type == Some(GidType::RoceV2))
    }

    /// Distinct netdevs behind this port's GIDs, in GID order.
    pub fn netdevs(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for name in self.gids.iter().filter_map(|g| g.netdev.as_deref()) {
            if !out.contains(&name) {
                out.push(name);
            }
        }
        out
    }

    /// Bytes sent, from `port_xmit_data` (4-octet units); `None` when the counter is absent.
    pub fn transmit_bytes(&self) -> Option<u64> {
        self.counters
            .get("port_xmit_data")
            .map(|v| v.saturating_mul(4))
    }

    pub fn receive_bytes(&self) -> Option<u64> {
        self.counters
            .get("port_rcv_data")
            .map(|v| v.saturating_mul(4))
    }
}

impl Serialize for PortReport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct View<'a> {
            port: u32,
            state: Option<&'a PortState>,
            state_code: Option<u8>,
            phys_state: Option<&'a PhysState>,
            phys_state_code: Option<u8>,
            rate_gbps: Option<f64>,
            rate: Option<&'a Rate>,
            link_layer: Option<&'a LinkLayer>,
            lid: Option<u32>,
            sm_lid: Option<u32>,
            netdevs: Vec<&'a str>,
            gids: &'a [Gid],
            counters: &'a BTreeMap<String, u64>,
            hw_counters: &'a BTreeMap<String, u64>,
            counters_timestamp: Option<f64>,
            verbs: Option<&'a VerbsPort>,
            selftest: Option<&'a SelftestResult>,
            errors: &'a [String],
        }
        View {
            port: self.port,
            state: self.state.as_ref(),
            state_code: self.state.map(PortState::code),
            phys_state: self.phys_state.as_ref(),
            phys_state_code: self.phys_state.map(PhysState::code),
            rate_gbps: self.rate.as_ref().map(|r| r.gbps),
            rate: self.rate.as_ref(),
            link_layer: self.link_layer.as_ref(),
            lid: self.lid,
            sm_lid: self.sm_lid,
            netdevs: self.netdevs(),
            gids: &self.gids,
            counters: &self.counters,
            hw_counters: &self.hw_counters,
            counters_timestamp: self.counters_timestamp,
            verbs: self.verbs.as_ref(),
            selftest: self.selftest.as_ref(),
            errors: &self.errors,
        }
        .serialize(s)
    }
}

/// What opening a verbs context on the device gave.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerbsDevice {
    /// A context was opened and `ibv_query_device` answered.
    pub opened: bool,
    /// Why not, with what to do.
    pub error: Option<String>,
    pub fw_ver: Option<String>,
    pub node_guid: Option<String>,
    pub phys_port_cnt: Option<u8>,
    pub max_qp: Option<i32>,
    pub max_mr_size: Option<u64>,
}

/// `ibv_query_port` on one port.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VerbsPort {
    pub state: PortState,
    pub phys_state: PhysState,
    pub link_layer: LinkLayer,
    pub rate_gbps: Option<f64>,
    pub active_width: u8,
    pub active_speed: u32,
    pub lid: u16,
    pub sm_lid: u16,
    pub active_mtu: u32,
    pub gid_tbl_len: i32,
}

/// Result of the loopback RC data-path self-test on one port.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SelftestResult {
    pub ok: bool,
    /// The step that failed (`alloc_pd`, `reg_mr`, `modify_qp RTR`, `poll_cq`, ...).
    pub failed_step: Option<String>,
    pub errno: Option<i32>,
    /// The whole story, starting with the step: `reg_mr: errno 12 (ENOMEM): ...`.
    pub message: Option<String>,
    /// Round-trip latency of the RDMA WRITE (post to completion, which needs the
    /// responder's ACK), microseconds.
    pub latency_us: Option<f64>,
    /// GID table index the queue pairs were addressed with (RoCE); `None` on InfiniBand.
    pub gid_index: Option<u32>,
    /// Wall time of the whole test on this port, setup and teardown included, microseconds.
    pub duration_us: Option<f64>,
}

/// How the verbs layer is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerbsMode {
    /// Skip verbs (fixture runs, or nodes where only sysfs is wanted).
    Off,
    /// Open every device; a device sysfs shows but verbs cannot open is a finding.
    #[default]
    Required,
}
