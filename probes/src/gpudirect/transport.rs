//! Transport settings of each RDMA port: the active MTU, the RoCE netdev's MTU and the
//! driver's ECN switches (mlx5: `class/net/<if>/ecn/roce_np/enable/<prio>` and
//! `.../roce_rp/enable/<prio>`, priorities 0..7).

use crate::rdma::{LinkLayer, RdmaReport};
use crate::roots::Roots;
use crate::sysfs_io::{AttrBuf, KeptAttr};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;

/// Bytes of RoCE v2 headers the kernel subtracts from the netdev MTU to get the largest RDMA
/// MTU (`iboe_get_mtu` in `include/rdma/ib_addr.h`): GRH 40 + UDP 8 + BTH 12 + XRC 4 +
/// AtomicETH 28 + ICRC 4.
pub const ROCE_HEADER_BYTES: u32 = 40 + 8 + 12 + 4 + 28 + 4;

/// The RDMA MTUs (`enum ib_mtu`), in bytes.
pub const IB_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

/// The largest RDMA MTU a RoCE netdev with this MTU carries (`iboe_get_mtu`); `None` below 256.
pub fn roce_mtu_for_netdev(netdev_mtu: u32) -> Option<u32> {
    let room = netdev_mtu.checked_sub(ROCE_HEADER_BYTES)?;
    IB_MTUS.into_iter().rev().find(|m| *m <= room)
}

/// The smallest netdev MTU that carries `rdma_mtu`.
pub fn netdev_mtu_for_roce(rdma_mtu: u32) -> u32 {
    rdma_mtu.saturating_add(ROCE_HEADER_BYTES)
}

/// Where the active MTU came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MtuSource {
    /// `ibv_query_port` `active_mtu`.
    Verbs,
    /// Derived from the RoCE netdev's MTU the way the kernel does (`--verbs off`).
    Netdev,
}

/// ECN switches per priority, as the driver exposes them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Ecn {
    /// Notification point (`roce_np/enable/<prio>`): marks CNPs back to the sender.
    pub np: BTreeMap<u8, bool>,
    /// Reaction point (`roce_rp/enable/<prio>`): slows down on CNPs.
    pub rp: BTreeMap<u8, bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PortTransport {
    pub device: String,
    pub port: u32,
    pub link_layer: Option<String>,
    /// The port's netdev (RoCE), from its GID table.
    pub netdev: Option<String>,
    pub netdev_mtu: Option<u32>,
    /// Bytes; `None` when unknown (InfiniBand with `--verbs off`: sysfs has no MTU file).
    pub active_mtu: Option<u32>,
    pub active_mtu_source: Option<MtuSource>,
    /// `None` where the driver exposes no `ecn` folder (not mlx5, or not RoCE).
    pub ecn: Option<Ecn>,
    pub errors: Vec<String>,
}

/// The files of each RoCE netdev the transport probe reads, kept open between probes: its MTU
/// and the ECN switches (16 on mlx5), for the netdevs the last probe saw.
#[derive(Default)]
pub(crate) struct TransportFiles {
    netdevs: BTreeMap<String, NetdevFiles>,
    buf: AttrBuf,
}

struct NetdevFiles {
    mtu: KeptAttr,
    ecn: PathBuf,
    /// `(notification point?, priority, enable file)`, opened when `ecn/` is first seen.
    switches: Vec<(bool, u8, KeptAttr)>,
}

impl NetdevFiles {
    fn open(roots: &Roots, netdev: &str) -> Self {
        let dir = roots.sys("class/net").join(netdev);
        Self {
            mtu: KeptAttr::open(dir.join("mtu")),
            ecn: dir.join("ecn"),
            switches: Vec::new(),
        }
    }

    /// `None` where the driver exposes no `ecn` folder.
    fn read_ecn(&mut self, buf: &mut AttrBuf, errors: &mut Vec<String>) -> Option<Ecn> {
        match fs::metadata(&self.ecn) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                errors.push(format!("{}: not a directory", self.ecn.display()));
                return None;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                errors.push(format!("cannot read {}: {e}", self.ecn.display()));
                return None;
            }
        }
        if self.switches.is_empty() {
            for (np, proto) in [(true, "roce_np"), (false, "roce_rp")] {
                for prio in 0u8..8 {
                    let path = self.ecn.join(proto).join("enable").join(prio.to_string());
                    self.switches.push((np, prio, KeptAttr::open(path)));
                }
            }
        }
        let mut ecn = Ecn::default();
        for (np, prio, file) in &mut self.switches {
            if let Some(on) = file.parsed(buf, "0 or 1", errors, parse_switch) {
                if *np { &mut ecn.np } else { &mut ecn.rp }.insert(*prio, on);
            }
        }
        Some(ecn)
    }
}

impl TransportFiles {
    /// Read the transport settings of every port of the devices `in_scope` accepts.
    pub(crate) fn probe(
        &mut self,
        roots: &Roots,
        rdma: &RdmaReport,
        in_scope: &dyn Fn(&str) -> bool,
    ) -> Vec<PortTransport> {
        let mut out = Vec::new();
        let mut seen = Vec::new();
        for dev in rdma.devices.iter().filter(|d| in_scope(&d.name)) {
            for port in &dev.ports {
                let mut t = PortTransport {
                    device: dev.name.clone(),
                    port: port.port,
                    link_layer: port.link_layer.as_ref().map(|l| l.name().to_owned()),
                    netdev: port.netdevs().first().map(|s| (*s).to_owned()),
                    netdev_mtu: None,
                    active_mtu: None,
                    active_mtu_source: None,
                    ecn: None,
                    errors: Vec::new(),
                };
                if let Some(nd) = &t.netdev {
                    let files = self
                        .netdevs
                        .entry(nd.clone())
                        .or_insert_with(|| NetdevFiles::open(roots, nd));
                    t.netdev_mtu = files
                        .mtu
                        .parsed(&mut self.buf, "an MTU", &mut t.errors, |s| {
                            s.trim().parse().ok()
                        });
                    t.ecn = files.read_ecn(&mut self.buf, &mut t.errors);
                    seen.push(nd.clone());
                }
                if let Some(mtu) = port.verbs.as_ref().map(|v| v.active_mtu).filter(|m| *m > 0) {
                    t.active_mtu = Some(mtu);
                    t.active_mtu_source = Some(MtuSource::Verbs);
                } else if port.link_layer == Some(LinkLayer::Ethernet)
                    && let Some(mtu) = t.netdev_mtu.and_then(roce_mtu_for_netdev)
                {
                    t.active_mtu = Some(mtu);
                    t.active_mtu_source = Some(MtuSource::Netdev);
                }
                out.push(t);
            }
        }
        self.netdevs.retain(|name, _| seen.contains(name));
        out
    }
}

/// `1` / `0`.
pub fn parse_switch(s: &str) -> Option<bool> {
    match s.trim() {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roce_mtu_follows_the_kernel() {
        assert_eq!(roce_mtu_for_netdev(9000), Some(4096));
        assert_eq!(roce_mtu_for_netdev(4192), Some(4096));
        assert_eq!(roce_mtu_for_netdev(4191), Some(2048));
        assert_eq!(roce_mtu_for_netdev(1500), Some(1024));
        assert_eq!(roce_mtu_for_netdev(300), None);
        assert_eq!(netdev_mtu_for_roce(4096), 4192);
        assert_eq!(parse_switch("1\n"), Some(true));
        assert_eq!(parse_switch("on"), None);
    }
}
