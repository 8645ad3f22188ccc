//! The bytes an RDMA port moved over a window: what a pod's data-path queue pairs really
//! carried, as opposed to their presence.
//!
//! What each counter counts (from the kernel sources; docs/runtime-transport.md has the table):
//! - `counters/port_xmit_data`, `port_rcv_data` (present when the driver answers PMA MADs:
//!   mlx4, mlx5, qib, hfi1): data octets ÷ 4, headers included, on all VLs.
//!   - InfiniBand link layer: every packet the port carries, so IPoIB (a UD or, in connected
//!     mode, an RC QP of the `ib_ipoib` module) counts too. The IPoIB netdevs of the port
//!     (`type` 32, the same PCI function, `dev_port` = port − 1) are read over the same window
//!     and their bytes subtracted; what is left of an IPoIB stream is its IB headers (about 2 %
//!     in datagram mode, well under 1 % in connected mode).
//!   - Ethernet link layer (RoCE): mlx5 answers from the vport's `*_ib_unicast/multicast`
//!     counters (`drivers/infiniband/hw/mlx5/mad.c`), mlx4 from its RoCE flow counters: RoCE
//!     traffic only, the netdev's own TCP is not in it. Nothing to subtract.
//! - No `counters/` (rxe, siw, irdma, bnxt_re, efa: no PMA): rxe's `hw_counters/sent_pkts` and
//!   `rcvd_pkts` count RoCE packets only (`drivers/infiniband/sw/rxe/rxe_hw_counters.c`, bumped
//!   in `rxe_xmit_packet` and `rxe_rcv`); bytes are estimated as packets × the port's active
//!   MTU, which rxe derives from its netdev's MTU (`rxe_set_mtu`): exact for full-MTU payload,
//!   an ACK counted as a full packet. Any other driver has no byte figure here (`None`).

use crate::Roots;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

/// `ARPHRD_INFINIBAND`: the `type` of an IPoIB netdev.
const ARPHRD_INFINIBAND: &str = "32";

/// Which counters give a port's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum PortCounter {
    /// `counters/port_xmit_data` and `port_rcv_data`, × 4.
    DataWords,
    /// `hw_counters/sent_pkts` and `rcvd_pkts` × the active MTU (rxe): an estimate.
    PacketsTimesMtu { mtu: u32 },
    /// Neither: no byte figure for this port.
    None,
}

impl PortCounter {
    /// For a person and `check`'s table.
    pub fn describe(&self) -> String {
        match self {
            Self::DataWords => "port_xmit_data/port_rcv_data × 4".to_owned(),
            Self::PacketsTimesMtu { mtu } => {
                format!("hw_counters sent_pkts/rcvd_pkts × MTU {mtu} (estimate)")
            }
            Self::None => "no byte counters".to_owned(),
        }
    }
}

/// One read of a port's counters.
#[derive(Debug, Clone, PartialEq)]
pub struct PortReading {
    pub at: Instant,
    pub link_layer: Option<String>,
    pub counter: PortCounter,
    /// Bytes sent and received since the counters started (`None`: unreadable).
    pub transmit: Option<u64>,
    pub receive: Option<u64>,
    /// InfiniBand only: the port's IPoIB netdevs and their bytes sent and received.
    pub ipoib: Vec<(String, Option<u64>, Option<u64>)>,
}

/// What one port carried over a window, and who holds data-path QPs on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PortTraffic {
    pub device: String,
    pub port: u32,
    pub link_layer: Option<String>,
    pub counter: PortCounter,
    /// Bytes over the window, IPoIB subtracted (`None`: no figure; `unseen` says why).
    pub transmit_bytes: Option<u64>,
    pub receive_bytes: Option<u64>,
    /// The IPoIB netdevs whose bytes were subtracted.
    pub subtracted: Vec<String>,
    pub window: Duration,
    /// The UIDs of the pods whose processes hold data-path QPs on this port.
    pub pods: Vec<String>,
    /// Other holders of data-path QPs on it: `kernel ko2iblnd`, `host pid 4242`.
    pub others: Vec<String>,
    /// Why there is no byte figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unseen: Option<String>,
}

impl PortTraffic {
    /// Sent plus received over the window; `None` without a figure for either.
    pub fn bytes(&self) -> Option<u64> {
        Some(self.transmit_bytes?.saturating_add(self.receive_bytes?))
    }
}

/// An IPoIB netdev: its name, its PCI function (the `device` link resolved) and `dev_port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpoibNetdev {
    pub name: String,
    pub function: std::path::PathBuf,
    pub dev_port: u64,
}

/// Every IPoIB netdev of the node (`type` 32), read once for all the ports of a sample.
pub fn ipoib_netdevs_of_node(roots: &Roots) -> Vec<IpoibNetdev> {
    let Ok(entries) = std::fs::read_dir(roots.sys("class/net")) else {
        return Vec::new();
    };
    let mut out: Vec<IpoibNetdev> = entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let dir = roots.sys(format!("class/net/{name}"));
            if read_trimmed(&dir.join("type")).as_deref() != Some(ARPHRD_INFINIBAND) {
                return None;
            }
            Some(IpoibNetdev {
                dev_port: read_u64(&dir.join("dev_port"))?,
                function: std::fs::canonicalize(dir.join("device")).ok()?,
                name,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Read port `port` of RDMA device `device` now, `ipoib` being the node's IPoIB netdevs
/// ([`ipoib_netdevs_of_node`]).
pub fn read_port(
    roots: &Roots,
    device: &str,
    port: u32,
    ipoib: &[IpoibNetdev],
    at: Instant,
) -> PortReading {
    let dir = roots.sys(format!("class/infiniband/{device}/ports/{port}"));
    let link_layer = read_trimmed(&dir.join("link_layer"));
    let counters = dir.join("counters");
    let words = |name: &str| read_u64(&counters.join(name)).map(|w| w.saturating_mul(4));
    let (counter, transmit, receive) = if counters.join("port_xmit_data").exists() {
        (
            PortCounter::DataWords,
            words("port_xmit_data"),
            words("port_rcv_data"),
        )
    } else if dir.join("hw_counters/sent_pkts").exists() {
        match active_mtu(roots, &dir) {
            Some(mtu) => {
                let bytes = |name: &str| {
                    read_u64(&dir.join("hw_counters").join(name))
                        .map(|p| p.saturating_mul(u64::from(mtu)))
                };
                (
                    PortCounter::PacketsTimesMtu { mtu },
                    bytes("sent_pkts"),
                    bytes("rcvd_pkts"),
                )
            }
            None => (PortCounter::None, None, None),
        }
    } else {
        (PortCounter::None, None, None)
    };
    let ipoib = if link_layer.as_deref() == Some("InfiniBand") && counter == PortCounter::DataWords
    {
        ipoib_of_port(roots, ipoib, device, port)
            .into_iter()
            .map(|name| {
                let stat =
                    |f: &str| read_u64(&roots.sys(format!("class/net/{name}/statistics/{f}")));
                let (tx, rx) = (stat("tx_bytes"), stat("rx_bytes"));
                (name, tx, rx)
            })
            .collect()
    } else {
        Vec::new()
    };
    PortReading {
        at,
        link_layer,
        counter,
        transmit,
        receive,
        ipoib,
    }
}

/// What the port carried between two readings: bytes sent and received with IPoIB subtracted,
/// the netdevs subtracted, or why there is no figure.
pub fn between(
    before: &PortReading,
    after: &PortReading,
) -> Result<(u64, u64, Vec<String>), String> {
    if before.counter != after.counter {
        return Err("its counters changed kind between the readings".into());
    }
    if after.counter == PortCounter::None {
        return Err(
            "the port has no byte counters (neither counters/port_xmit_data nor an rxe \
             hw_counters/sent_pkts with a netdev MTU)"
                .into(),
        );
    }
    let delta = |b: Option<u64>, a: Option<u64>, what: &str| -> Result<u64, String> {
        match (b, a) {
            (Some(b), Some(a)) if a >= b => Ok(a - b),
            (Some(_), Some(_)) => Err(format!("its {what} counter went back (reset)")),
            _ => Err(format!("its {what} counter could not be read")),
        }
    };
    let mut transmit = delta(before.transmit, after.transmit, "transmit")?;
    let mut receive = delta(before.receive, after.receive, "receive")?;
    let mut subtracted = Vec::new();
    for (name, tx, rx) in &after.ipoib {
        let Some((_, tx0, rx0)) = before.ipoib.iter().find(|(n, ..)| n == name) else {
            return Err(format!(
                "its IPoIB netdev {name} appeared during the window; its bytes cannot be subtracted"
            ));
        };
        let what = format!("IPoIB {name}");
        transmit = transmit.saturating_sub(delta(*tx0, *tx, &format!("{what} tx_bytes"))?);
        receive = receive.saturating_sub(delta(*rx0, *rx, &format!("{what} rx_bytes"))?);
        subtracted.push(name.clone());
    }
    Ok((transmit, receive, subtracted))
}

/// The IPoIB netdevs of `device`'s port `port` among `ipoib`: the same PCI function (`device`
/// links resolve alike), `dev_port` = port − 1 (set by `ib_ipoib` for the parent and its
/// P_Key children). Sorted.
pub fn ipoib_of_port(roots: &Roots, ipoib: &[IpoibNetdev], device: &str, port: u32) -> Vec<String> {
    let Ok(hca) = std::fs::canonicalize(roots.sys(format!("class/infiniband/{device}/device")))
    else {
        return Vec::new();
    };
    ipoib
        .iter()
        .filter(|n| n.function == hca && n.dev_port == u64::from(port.saturating_sub(1)))
        .map(|n| n.name.clone())
        .collect()
}

/// rxe's active MTU from its netdev's (`rxe_set_mtu`: the netdev MTU less the largest RoCE v2
/// headers, rounded down to an IB MTU, at most 4096); `None` when the netdev or its MTU is
/// not there to read.
fn active_mtu(roots: &Roots, port_dir: &Path) -> Option<u32> {
    let netdev = read_trimmed(&port_dir.join("gid_attrs/ndevs/0"))?;
    let mtu = read_u64(&roots.sys(format!("class/net/{netdev}/mtu")))?;
    Some(roce_mtu(mtu))
}

/// The IB MTU a RoCE port of netdev MTU `netdev_mtu` uses: GRH 40 + UDP 8 + BTH 12 + XRC 4 +
/// AtomicETH 28 + ICRC 4 bytes off, then the largest of 4096, 2048, 1024, 512 that fits
/// (256 below).
pub fn roce_mtu(netdev_mtu: u64) -> u32 {
    const HEADERS: u64 = 40 + 8 + 12 + 4 + 28 + 4;
    let room = netdev_mtu.saturating_sub(HEADERS);
    [4096, 2048, 1024, 512]
        .into_iter()
        .find(|m| room >= u64::from(*m))
        .unwrap_or(256)
}

fn read_trimmed(path: &Path) -> Option<String> {
    crate::sysfs_io::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn read_u64(path: &Path) -> Option<u64> {
    read_trimmed(path)?.parse().ok()
}

#[cfg(test)]
mod tests;
