//! Pure PCI parsing: sysfs `class`/`vendor` values, the binary `config` space (extended
//! capability list and the ACS capability), and the PCIe relation between two functions given
//! their paths under `/sys/devices`.
//!
//! Register layout from the kernel's `include/uapi/linux/pci_regs.h`: extended capabilities
//! start at offset 0x100 (`PCI_CFG_SPACE_SIZE`); each header is a little-endian u32 with the
//! capability ID in bits 0..16 (`PCI_EXT_CAP_ID`), the version in 16..20 and the offset of the
//! next header in 20..32 (`PCI_EXT_CAP_NEXT`, the low two bits reserved). The ACS capability
//! (`PCI_EXT_CAP_ID_ACS` = 0x0D) holds the capability register at +4 (`PCI_ACS_CAP`) and the
//! control register at +6 (`PCI_ACS_CTRL`), both u16.

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// `PCI_VENDOR_ID_NVIDIA`.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// `PCI_BASE_CLASS_DISPLAY`: VGA (0x0300), XGA (0x0301), 3D (0x0302), other (0x0380).
pub const BASE_CLASS_DISPLAY: u8 = 0x03;
/// `PCI_CFG_SPACE_SIZE`: where the extended capabilities begin.
pub const EXT_CAP_START: usize = 0x100;
/// `PCI_CFG_SPACE_EXP_SIZE`.
pub const EXT_CFG_SPACE_SIZE: usize = 4096;
/// `PCI_EXT_CAP_ID_ACS`.
pub const EXT_CAP_ID_ACS: u16 = 0x000d;

/// `PCI_ACS_*` bits of the capability and control registers.
pub mod acs {
    /// Source Validation.
    pub const SV: u16 = 0x0001;
    /// Translation Blocking.
    pub const TB: u16 = 0x0002;
    /// P2P Request Redirect.
    pub const RR: u16 = 0x0004;
    /// P2P Completion Redirect.
    pub const CR: u16 = 0x0008;
    /// Upstream Forwarding.
    pub const UF: u16 = 0x0010;
    /// P2P Egress Control.
    pub const EC: u16 = 0x0020;
    /// Direct Translated P2P.
    pub const DT: u16 = 0x0040;
}

/// Parse `0x10de` (sysfs `vendor`, `device`).
pub fn parse_hex_u16(s: &str) -> Option<u16> {
    let s = s.trim();
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))?;
    u16::from_str_radix(digits, 16).ok()
}

/// Parse `0x030200` (sysfs `class`: base class, subclass, programming interface).
pub fn parse_class(s: &str) -> Option<u32> {
    let s = s.trim();
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))?;
    u32::from_str_radix(digits, 16)
        .ok()
        .filter(|c| *c <= 0x00ff_ffff)
}

/// An NVIDIA display or 3D controller (not an NVSwitch, which is a bridge, 0x0680).
pub fn is_nvidia_gpu(vendor: u16, class: u32) -> bool {
    vendor == VENDOR_NVIDIA && (class >> 16) as u8 == BASE_CLASS_DISPLAY
}

/// What the config space says about ACS on one function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum AcsState {
    /// The extended config space could not be read: an unprivileged read of `config` returns
    /// only the first 64 bytes (the kernel hides the rest without CAP_SYS_ADMIN).
    Unknown { bytes_read: usize },
    /// The function has no ACS capability (nothing redirects peer-to-peer traffic here).
    Absent,
    /// The ACS capability and its control register.
    Present { capability: u16, control: u16 },
}

impl AcsState {
    /// Request or completion redirection enabled: peer-to-peer requests go up to the root
    /// complex instead of across the switch.
    pub fn redirects(self) -> bool {
        matches!(self, Self::Present { control, .. } if control & (acs::RR | acs::CR) != 0)
    }
}

/// `P2P-request-redirect, P2P-completion-redirect` for the bits set in an ACS control value.
pub fn acs_control_names(control: u16) -> Vec<&'static str> {
    [
        (acs::SV, "SrcValid"),
        (acs::TB, "TransBlk"),
        (acs::RR, "ReqRedir"),
        (acs::CR, "CmpltRedir"),
        (acs::UF, "UpstreamFwd"),
        (acs::EC, "EgressCtrl"),
        (acs::DT, "DirectTrans"),
    ]
    .into_iter()
    .filter(|(bit, _)| control & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

fn u16_at(config: &[u8], off: usize) -> Option<u16> {
    let b = config.get(off..off + 2)?;
    Some(u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(config: &[u8], off: usize) -> Option<u32> {
    let b = config.get(off..off + 4)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Offset of extended capability `id` (the kernel's `pci_find_ext_capability`): `Ok(None)`
/// when the list does not hold it, `Err(len)` when `config` is too short to tell. The walk is
/// bounded like the kernel's (at most `(4096 - 256) / 8` headers), so a looping or garbage list
/// ends.
pub fn find_ext_capability(config: &[u8], id: u16) -> Result<Option<usize>, usize> {
    if config.len() < EXT_CAP_START + 4 {
        return Err(config.len());
    }
    let mut pos = EXT_CAP_START;
    let mut ttl = (EXT_CFG_SPACE_SIZE - EXT_CAP_START) / 8;
    while ttl > 0 {
        let Some(header) = u32_at(config, pos) else {
            return Ok(None);
        };
        // No extended capabilities at all (conventional PCI, or a read of all ones).
        if header == 0 || header == 0xffff_ffff {
            return Ok(None);
        }
        if (header & 0xffff) as u16 == id {
            return Ok(Some(pos));
        }
        let next = ((header >> 20) & 0xffc) as usize;
        if next < EXT_CAP_START {
            return Ok(None);
        }
        pos = next;
        ttl -= 1;
    }
    Ok(None)
}

/// The ACS state of a function from its `config` bytes.
pub fn parse_acs(config: &[u8]) -> AcsState {
    match find_ext_capability(config, EXT_CAP_ID_ACS) {
        Err(bytes_read) => AcsState::Unknown { bytes_read },
        Ok(None) => AcsState::Absent,
        Ok(Some(pos)) => acs_at(config, pos).unwrap_or(AcsState::Unknown {
            bytes_read: config.len(),
        }),
    }
}

/// The ACS capability whose header starts at `pos` of `bytes` (header, then the capability
/// and control registers); `None` unless the header there is ACS's and the registers follow.
pub fn acs_at(bytes: &[u8], pos: usize) -> Option<AcsState> {
    if u16_at(bytes, pos)? != EXT_CAP_ID_ACS {
        return None;
    }
    Some(AcsState::Present {
        capability: u16_at(bytes, pos + 4)?,
        control: u16_at(bytes, pos + 6)?,
    })
}

/// The PCIe relation between a GPU and an HCA, best first (NCCL's and `nvidia-smi topo -m`'s
/// vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Relation {
    /// Through at most one PCIe switch (or the same bridge).
    Pix,
    /// Through several PCIe switches, without crossing the host bridge.
    Pxb,
    /// Through the PCIe host bridge (the CPU's root complex).
    Phb,
    /// Across host bridges within one NUMA node.
    Node,
    /// Across the SMP interconnect between NUMA nodes (sockets).
    Sys,
}

impl Relation {
    pub const ALL: [Self; 5] = [Self::Pix, Self::Pxb, Self::Phb, Self::Node, Self::Sys];

    pub fn name(self) -> &'static str {
        match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        }
    }

    /// 0 (PIX) .. 4 (SYS), for the metric.
    pub fn rank(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for Relation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Relation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|r| r.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!("{s:?} is not a PCIe relation; use one of PIX, PXB, PHB, NODE, SYS")
            })
    }
}

impl Serialize for Relation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// A PCI function name such as `0000:3b:00.0` (`%04x:%02x:%02x.%d`; domains may be wider).
pub fn is_pci_address(s: &str) -> bool {
    let mut parts = s.split(':');
    let (Some(domain), Some(bus), Some(devfn), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
    let Some((dev, func)) = devfn.split_once('.') else {
        return false;
    };
    domain.len() >= 4
        && domain.bytes().all(|b| b.is_ascii_hexdigit())
        && hex(bus, 2)
        && hex(dev, 2)
        && func.len() == 1
        && func.bytes().all(|b| (b'0'..=b'7').contains(&b))
}

/// Where a PCI function sits: the components of its path below `/sys/devices`, from the host
/// bridge (`pci0000:00`) down to the function itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciPath {
    pub components: Vec<String>,
}

impl PciPath {
    /// From a path relative to the sysfs root (`devices/pci0000:00/0000:00:01.0/...`);
    /// `None` unless it is under `devices/pci*` and ends in a PCI function.
    pub fn parse(rel: &str) -> Option<Self> {
        let mut parts = rel.trim_matches('/').split('/');
        if parts.next() != Some("devices") {
            return None;
        }
        let components: Vec<String> = parts.map(str::to_owned).collect();
        let root = components.first()?;
        let last = components.last()?;
        if !root.starts_with("pci") || components.len() < 2 || !is_pci_address(last) {
            return None;
        }
        Some(Self { components })
    }

    /// The host bridge (`pci0000:00`).
    pub fn host_bridge(&self) -> &str {
        self.components.first().map_or("", String::as_str)
    }

    /// The function's own address.
    pub fn address(&self) -> &str {
        self.components.last().map_or("", String::as_str)
    }

    /// The PCI functions above this one (bridges and switch ports), top first.
    fn ancestors(&self) -> &[String] {
        &self.components[..self.components.len().saturating_sub(1)]
    }
}

/// The relation between two functions and the bridges on the path between them (the switch
/// ports a peer-to-peer transfer crosses; up to the root ports when it crosses the host).
pub fn relation(
    a: &PciPath,
    a_numa: Option<u32>,
    b: &PciPath,
    b_numa: Option<u32>,
) -> (Relation, Vec<String>) {
    let (aa, ba) = (a.ancestors(), b.ancestors());
    let common = aa.iter().zip(ba).take_while(|(x, y)| x == y).count();
    let bridges = |list: &[String]| -> Vec<String> {
        list.iter().filter(|c| is_pci_address(c)).cloned().collect()
    };
    if common == 0 {
        let mut path = bridges(aa);
        path.reverse();
        path.extend(bridges(ba));
        let rel = if a_numa == b_numa {
            Relation::Node
        } else {
            Relation::Sys
        };
        return (rel, path);
    }
    // Bridges strictly below the lowest common ancestor on each side, and that ancestor.
    let mut path = bridges(&aa[common..]);
    path.reverse();
    let lca = &aa[common - 1];
    if is_pci_address(lca) {
        path.push(lca.clone());
    }
    path.extend(bridges(&ba[common..]));
    if !is_pci_address(lca) {
        return (Relation::Phb, path);
    }
    // One switch: downstream port, upstream port, downstream port (or one shared bridge).
    let rel = if path.len() <= 3 {
        Relation::Pix
    } else {
        Relation::Pxb
    };
    (rel, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(s: &str) -> PciPath {
        PciPath::parse(s).unwrap()
    }

    /// A 4096-byte config space with AER at 0x100 and ACS at 0x148.
    fn config_with_acs(control: u16) -> Vec<u8> {
        let mut c = vec![0u8; EXT_CFG_SPACE_SIZE];
        let aer: u32 = 0x0001 | (1 << 16) | (0x148 << 20);
        c[0x100..0x104].copy_from_slice(&aer.to_le_bytes());
        let acs_hdr: u32 = 0x000d | (1 << 16);
        c[0x148..0x14c].copy_from_slice(&acs_hdr.to_le_bytes());
        c[0x14c..0x14e].copy_from_slice(&0x005fu16.to_le_bytes());
        c[0x14e..0x150].copy_from_slice(&control.to_le_bytes());
        c
    }

    #[test]
    fn parses_sysfs_ids_and_classes() {
        assert_eq!(parse_hex_u16("0x10de\n"), Some(0x10de));
        assert_eq!(parse_hex_u16("10de"), None);
        assert_eq!(parse_class("0x030200\n"), Some(0x030200));
        assert_eq!(parse_class("0x1030200"), None);
        assert!(is_nvidia_gpu(0x10de, 0x030200));
        assert!(is_nvidia_gpu(0x10de, 0x030000));
        assert!(!is_nvidia_gpu(0x10de, 0x068000), "NVSwitch is a bridge");
        assert!(!is_nvidia_gpu(0x1a03, 0x030000), "ASPEED BMC VGA");
        assert!(!is_nvidia_gpu(0x15b3, 0x020700));
    }

    #[test]
    fn finds_acs_after_other_extended_capabilities() {
        let c = config_with_acs(0);
        assert_eq!(find_ext_capability(&c, EXT_CAP_ID_ACS), Ok(Some(0x148)));
        assert_eq!(find_ext_capability(&c, 0x0001), Ok(Some(0x100)));
        assert_eq!(find_ext_capability(&c, 0x0010), Ok(None));
        assert_eq!(
            parse_acs(&c),
            AcsState::Present {
                capability: 0x5f,
                control: 0
            }
        );
        assert!(!parse_acs(&c).redirects());
        let c = config_with_acs(acs::SV | acs::RR | acs::CR | acs::UF);
        assert!(parse_acs(&c).redirects());
        assert_eq!(
            acs_control_names(0x1d),
            ["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]
        );
        // Egress control alone does not redirect.
        assert!(!parse_acs(&config_with_acs(acs::EC)).redirects());
    }

    #[test]
    fn short_config_is_unknown_not_absent() {
        // What an unprivileged read returns: the first 64 bytes of the header.
        let c = config_with_acs(0x1d);
        assert_eq!(parse_acs(&c[..64]), AcsState::Unknown { bytes_read: 64 });
        assert_eq!(parse_acs(&c[..256]), AcsState::Unknown { bytes_read: 256 });
        assert_eq!(parse_acs(&[]), AcsState::Unknown { bytes_read: 0 });
        assert!(!AcsState::Unknown { bytes_read: 64 }.redirects());
    }

    #[test]
    fn empty_looping_or_garbage_lists_end() {
        assert_eq!(parse_acs(&vec![0u8; 4096]), AcsState::Absent);
        assert_eq!(parse_acs(&vec![0xffu8; 4096]), AcsState::Absent);
        // A header whose next pointer points at itself: bounded, no ACS.
        let mut c = vec![0u8; 4096];
        let hdr: u32 = 0x0001 | (0x100 << 20);
        c[0x100..0x104].copy_from_slice(&hdr.to_le_bytes());
        assert_eq!(parse_acs(&c), AcsState::Absent);
        // Next pointer past the end of a truncated buffer.
        let hdr: u32 = 0x0001 | (0xffc << 20);
        let mut c = vec![0u8; 0x200];
        c[0x100..0x104].copy_from_slice(&hdr.to_le_bytes());
        assert_eq!(parse_acs(&c), AcsState::Absent);
        // ACS header at the very end: registers cut off.
        let mut c = vec![0u8; 0x104];
        c[0x100..0x104].copy_from_slice(&0x0001_000du32.to_le_bytes());
        assert_eq!(parse_acs(&c), AcsState::Unknown { bytes_read: 0x104 });
    }

    #[test]
    fn pci_addresses_and_paths() {
        assert!(is_pci_address("0000:3b:00.0"));
        assert!(is_pci_address("10000:e1:1f.7"));
        assert!(!is_pci_address("0000:3b:00.8"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(!is_pci_address("infiniband"));
        assert!(PciPath::parse("devices/virtual/net/lo").is_none());
        assert!(PciPath::parse("devices/pci0000:00").is_none());
        let p = path("devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        assert_eq!(p.host_bridge(), "pci0000:00");
        assert_eq!(p.address(), "0000:01:00.0");
    }

    #[test]
    fn relations_follow_the_tree() {
        let root = "devices/pci0000:10/0000:10:01.0/0000:11:00.0";
        // Two levels of switches: 0000:12:00.0 -> 0000:13:00.0 (USP) -> DSPs 14:00.0/14:01.0.
        let gpu0 = path(&format!(
            "{root}/0000:12:00.0/0000:13:00.0/0000:14:00.0/0000:15:00.0"
        ));
        let hca0 = path(&format!(
            "{root}/0000:12:00.0/0000:13:00.0/0000:14:01.0/0000:16:00.0"
        ));
        let hca1 = path(&format!(
            "{root}/0000:12:01.0/0000:17:00.0/0000:18:01.0/0000:1a:00.0"
        ));
        let (rel, bridges) = relation(&gpu0, Some(0), &hca0, Some(0));
        assert_eq!(rel, Relation::Pix);
        assert_eq!(bridges, ["0000:14:00.0", "0000:13:00.0", "0000:14:01.0"]);
        let (rel, bridges) = relation(&gpu0, Some(0), &hca1, Some(0));
        assert_eq!(rel, Relation::Pxb);
        assert_eq!(
            bridges,
            [
                "0000:14:00.0",
                "0000:13:00.0",
                "0000:12:00.0",
                "0000:11:00.0",
                "0000:12:01.0",
                "0000:17:00.0",
                "0000:18:01.0"
            ]
        );
        // Two root ports of one host bridge.
        let other_rp = path("devices/pci0000:10/0000:10:03.0/0000:30:00.0");
        let (rel, bridges) = relation(&gpu0, Some(0), &other_rp, Some(0));
        assert_eq!(rel, Relation::Phb);
        assert_eq!(bridges.first().map(String::as_str), Some("0000:14:00.0"));
        assert_eq!(bridges.last().map(String::as_str), Some("0000:10:03.0"));
        // Another host bridge: same NUMA node or across sockets.
        let far = path("devices/pci0000:90/0000:90:01.0/0000:91:00.0");
        assert_eq!(relation(&gpu0, Some(0), &far, Some(0)).0, Relation::Node);
        assert_eq!(relation(&gpu0, Some(0), &far, Some(1)).0, Relation::Sys);
        assert_eq!(relation(&gpu0, None, &far, None).0, Relation::Node);
        // Two functions of one card under one bridge.
        let f0 = path("devices/pci0000:10/0000:10:01.0/0000:11:00.0");
        let f1 = path("devices/pci0000:10/0000:10:01.0/0000:11:00.1");
        assert_eq!(
            relation(&f0, Some(0), &f1, Some(0)),
            (Relation::Pix, vec!["0000:10:01.0".into()])
        );
        assert!(Relation::Pix < Relation::Pxb && Relation::Node < Relation::Sys);
        assert_eq!("pxb".parse::<Relation>(), Ok(Relation::Pxb));
        assert!("near".parse::<Relation>().is_err());
    }
}
