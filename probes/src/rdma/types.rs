//! Values the kernel reports for RDMA devices and ports, as typed enums. Raw integers that the
//! kernel may extend become `Unknown(n)` rather than an error (the rust-ibverbs habit).

use serde::{Serialize, Serializer};
use std::fmt;

/// `enum ib_port_state` (`ports/N/state`, `ibv_port_attr.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PortState {
    Nop,
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    Unknown(u8),
}

impl PortState {
    pub fn from_code(code: u8) -> Self {
        match code {
            0 => Self::Nop,
            1 => Self::Down,
            2 => Self::Init,
            3 => Self::Armed,
            4 => Self::Active,
            5 => Self::ActiveDefer,
            n => Self::Unknown(n),
        }
    }

    pub fn code(self) -> u8 {
        match self {
            Self::Nop => 0,
            Self::Down => 1,
            Self::Init => 2,
            Self::Armed => 3,
            Self::Active => 4,
            Self::ActiveDefer => 5,
            Self::Unknown(n) => n,
        }
    }

    /// The kernel's name (`drivers/infiniband/core/sysfs.c`, `state_show`).
    pub fn name(self) -> String {
        match self {
            Self::Nop => "NOP".into(),
            Self::Down => "DOWN".into(),
            Self::Init => "INIT".into(),
            Self::Armed => "ARMED".into(),
            Self::Active => "ACTIVE".into(),
            Self::ActiveDefer => "ACTIVE_DEFER".into(),
            Self::Unknown(n) => format!("UNKNOWN({n})"),
        }
    }
}

/// Physical port state (`ports/N/phys_state`, `ibv_port_attr.phys_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PhysState {
    Sleep,
    Polling,
    Disabled,
    PortConfigurationTraining,
    LinkUp,
    LinkErrorRecovery,
    PhyTest,
    Unknown(u8),
}

impl PhysState {
    pub fn from_code(code: u8) -> Self {
        match code {
            1 => Self::Sleep,
            2 => Self::Polling,
            3 => Self::Disabled,
            4 => Self::PortConfigurationTraining,
            5 => Self::LinkUp,
            6 => Self::LinkErrorRecovery,
            7 => Self::PhyTest,
            n => Self::Unknown(n),
        }
    }

    pub fn code(self) -> u8 {
        match self {
            Self::Sleep => 1,
            Self::Polling => 2,
            Self::Disabled => 3,
            Self::PortConfigurationTraining => 4,
            Self::LinkUp => 5,
            Self::LinkErrorRecovery => 6,
            Self::PhyTest => 7,
            Self::Unknown(n) => n,
        }
    }

    /// The kernel's name (`phys_state_to_str`).
    pub fn name(self) -> String {
        match self {
            Self::Sleep => "Sleep".into(),
            Self::Polling => "Polling".into(),
            Self::Disabled => "Disabled".into(),
            Self::PortConfigurationTraining => "PortConfigurationTraining".into(),
            Self::LinkUp => "LinkUp".into(),
            Self::LinkErrorRecovery => "LinkErrorRecovery".into(),
            Self::PhyTest => "Phy Test".into(),
            Self::Unknown(n) => format!("Unknown({n})"),
        }
    }
}

/// `ports/N/link_layer`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
    Unknown(String),
}

impl LinkLayer {
    pub fn parse(s: &str) -> Self {
        match s.trim() {
            "InfiniBand" => Self::InfiniBand,
            "Ethernet" => Self::Ethernet,
            other => Self::Unknown(other.to_owned()),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Self::InfiniBand => "InfiniBand",
            Self::Ethernet => "Ethernet",
            Self::Unknown(s) => s,
        }
    }
}

/// `gid_attrs/types/N`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GidType {
    /// `IB/RoCE v1`: native InfiniBand, or RoCE v1 on Ethernet (not routable).
    IbRoceV1,
    RoceV2,
    Unknown(String),
}

impl GidType {
    pub fn parse(s: &str) -> Self {
        match s.trim() {
            "IB/RoCE v1" => Self::IbRoceV1,
            "RoCE v2" => Self::RoceV2,
            other => Self::Unknown(other.to_owned()),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Self::IbRoceV1 => "IB/RoCE v1",
            Self::RoceV2 => "RoCE v2",
            Self::Unknown(s) => s,
        }
    }
}

/// `node_type` of a device (`1: CA`, `4: RNIC`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeType {
    pub code: u8,
    pub name: String,
}

/// A parsed `ports/N/rate` line such as `400 Gb/sec (4X NDR)`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rate {
    pub gbps: f64,
    /// Lane count (`4` for `4X`).
    pub width: u8,
    /// Lane speed name (`NDR`, `HDR`, `SDR`, ...); empty if the kernel gave none.
    pub speed: String,
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} Gb/s ({}X", format_gbps(self.gbps), self.width)?;
        if !self.speed.is_empty() {
            write!(f, " {}", self.speed)?;
        }
        write!(f, ")")
    }
}

/// `400` for 400.0, `2.5` for 2.5: the form used in labels and reasons.
pub fn format_gbps(gbps: f64) -> String {
    if gbps.fract() == 0.0 {
        format!("{gbps:.0}")
    } else {
        let s = format!("{gbps:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// PCIe link speed in GT/s as the kernel prints it (`16.0 GT/s PCIe`, older `8 GT/s`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PcieSpeed(pub f64);

macro_rules! serialize_by_name {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.name())
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.name())
            }
        }
    )*};
}
serialize_by_name!(PortState, PhysState, LinkLayer, GidType);

impl Serialize for NodeType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_codes_round_trip_and_unknowns_are_kept() {
        for code in 0..=9u8 {
            assert_eq!(PortState::from_code(code).code(), code);
            assert_eq!(PhysState::from_code(code).code(), code);
        }
        assert_eq!(PortState::from_code(9).name(), "UNKNOWN(9)");
        assert_eq!(PhysState::from_code(5).name(), "LinkUp");
    }

    #[test]
    fn gbps_formats_without_trailing_zeroes() {
        assert_eq!(format_gbps(400.0), "400");
        assert_eq!(format_gbps(2.5), "2.5");
        assert_eq!(format_gbps(53.125), "53.125");
    }
}
