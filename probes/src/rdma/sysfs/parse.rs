//! Pure parsers of the attribute files' content: whatever bytes a driver (or a fixture) puts
//! there, they give a value or `None`, never a panic.

use crate::rdma::{NodeType, PhysState, PortState, Rate};

/// Parse `4: ACTIVE` (the kernel's `"%d: %s"`); the number is authoritative.
pub fn parse_port_state(s: &str) -> Option<PortState> {
    parse_numbered(s).map(PortState::from_code)
}

/// Parse `5: LinkUp`.
pub fn parse_phys_state(s: &str) -> Option<PhysState> {
    parse_numbered(s).map(PhysState::from_code)
}

/// Parse `1: CA`.
pub fn parse_node_type(s: &str) -> Option<NodeType> {
    let (num, name) = s.trim().split_once(':')?;
    Some(NodeType {
        code: num.trim().parse().ok()?,
        name: name.trim().to_owned(),
    })
}

fn parse_numbered(s: &str) -> Option<u8> {
    let (num, name) = s.trim().split_once(':')?;
    if name.trim().is_empty() {
        return None;
    }
    num.trim().parse().ok()
}

/// Parse the kernel's `rate_show` output: `"%d%s Gb/sec (%dX%s)"`, e.g. `400 Gb/sec (4X NDR)`,
/// `2.5 Gb/sec (1X SDR)`. Some drivers omit the speed name (`10 Gb/sec (4X)`).
pub fn parse_rate(s: &str) -> Option<Rate> {
    let s = s.trim();
    let (gbps, rest) = s.split_once(" Gb/sec")?;
    let gbps: f64 = gbps.trim().parse().ok()?;
    if !gbps.is_finite() || gbps < 0.0 {
        return None;
    }
    let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
    let (width, speed) = inner.split_once('X')?;
    Some(Rate {
        gbps,
        width: width.trim().parse().ok()?,
        speed: speed.trim().to_owned(),
    })
}

/// Parse `0x1a` (LIDs are printed in hex).
pub fn parse_hex_u32(s: &str) -> Option<u32> {
    let s = s.trim();
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))?;
    u32::from_str_radix(digits, 16).ok()
}

/// Parse a PCIe speed: `16.0 GT/s PCIe`, `8 GT/s`, `2.5 GT/s PCIe`; `Unknown` gives `None`.
pub fn parse_pcie_speed(s: &str) -> Option<f64> {
    let (num, _) = s.trim().split_once(" GT/s")?;
    num.trim().parse().ok()
}

/// What a counter file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterText {
    Value(u64),
    /// `N/A (no PMA)`: the port has no performance management agent; absent, not 0.
    NotAvailable,
}

/// Counter values: decimal, or `N/A (no PMA)`; `None` for anything else.
pub fn parse_counter(s: &str) -> Option<CounterText> {
    let s = s.trim();
    if s.starts_with("N/A") {
        return Some(CounterText::NotAvailable);
    }
    s.parse().ok().map(CounterText::Value)
}

/// An unused GID table entry.
pub(super) fn is_zero_gid(gid: &str) -> bool {
    gid.bytes().all(|b| b == b'0' || b == b':')
}

/// `0000:3b:00.0` (domain, bus, device.function; the domain may be longer than 4 digits).
pub fn is_pci_address(name: &str) -> bool {
    let hex = |s: &str, len: std::ops::RangeInclusive<usize>| {
        len.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    let mut parts = name.split(':');
    let (Some(domain), Some(bus), Some(devfn), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Some((dev, func)) = devfn.split_once('.') else {
        return false;
    };
    hex(domain, 4..=8)
        && hex(bus, 2..=2)
        && hex(dev, 2..=2)
        && matches!(func.as_bytes(), [b'0'..=b'7'])
}
