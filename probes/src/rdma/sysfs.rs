//! The RDMA tree in sysfs: `class/infiniband/<dev>` (a symlink into `devices/`), its ports,
//! GID tables, counters, and the PCIe link of the HCA behind the `device` link.
//!
//! Parsers are pure functions over the file content; the reader around them turns every
//! failure into a per-device or per-port error so one bad device never hides the others.

use super::{
    DeviceReport, Gid, GidType, LinkLayer, NodeType, PciLink, PhysState, PortReport, PortState,
    Rate, RdmaReport,
};
use crate::Roots;
use crate::error::ProbeError;
use crate::sysfs_io::{AttrReader, list_dir};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

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

fn is_zero_gid(gid: &str) -> bool {
    gid.bytes().all(|b| b == b'0' || b == b':')
}

/// Read every RDMA device under `<sysfs>/class/infiniband`.
pub fn probe(roots: &Roots) -> RdmaReport {
    let class = roots.sys("class/infiniband");
    let mut report = RdmaReport::default();
    let names = match list_dir(&class) {
        Ok(Some(names)) => names,
        Ok(None) => return report,
        Err(e) => {
            report.subsystem_present = true;
            report.errors.push(e.to_string());
            return report;
        }
    };
    report.subsystem_present = true;
    report.devices = read_devices(roots, &class, &names);
    report
}

/// Devices are independent, and reading one is a thousand small syscalls, not parsing; on a
/// node with many HCAs the probe reads them on up to one thread per core (at most 4), each
/// taking every n-th device, and keeps the sorted order.
fn read_devices(roots: &Roots, class: &Path, names: &[String]) -> Vec<DeviceReport> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(4)
        .min(names.len() / 2)
        .max(1);
    let read_share = |first: usize| {
        let mut reader = AttrReader::new();
        names
            .iter()
            .enumerate()
            .skip(first)
            .step_by(threads)
            .map(|(i, name)| {
                let dev = read_device(&mut reader, roots, &class.join(name), name.clone());
                (i, dev)
            })
            .collect::<Vec<_>>()
    };
    let mut devices: Vec<(usize, DeviceReport)> = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads)
            .map(|first| scope.spawn(move || read_share(first)))
            .collect();
        let mut all = read_share(0);
        for helper in helpers {
            match helper.join() {
                Ok(part) => all.extend(part),
                // A panic while reading is a bug; surface it as the serial code would.
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        all
    });
    devices.sort_by_key(|(i, _)| *i);
    devices.into_iter().map(|(_, d)| d).collect()
}

fn read_device(reader: &mut AttrReader, roots: &Roots, dir: &Path, name: String) -> DeviceReport {
    let mut dev = DeviceReport {
        name,
        ..DeviceReport::default()
    };
    let errors = &mut dev.errors;
    dev.node_type = reader.parsed(
        &dir.join("node_type"),
        "\"N: NAME\"",
        errors,
        parse_node_type,
    );
    dev.node_guid = reader.string(&dir.join("node_guid"), errors);
    dev.sys_image_guid = reader.string(&dir.join("sys_image_guid"), errors);
    dev.fw_ver = reader.string(&dir.join("fw_ver"), errors);
    dev.hca_type = reader.string(&dir.join("hca_type"), errors);
    dev.board_id = reader.string(&dir.join("board_id"), errors);
    match resolve_pci_function(roots, &dir.join("device")) {
        Ok(Some(function)) => dev.pci = Some(read_pci(reader, &function, errors)),
        Ok(None) => {}
        Err(why) => {
            errors.push(why.clone());
            dev.pci_error = Some(why);
        }
    }

    let ports_dir = dir.join("ports");
    match list_dir(&ports_dir) {
        Ok(Some(entries)) => {
            let mut numbers: Vec<u32> = entries.iter().filter_map(|n| n.parse().ok()).collect();
            numbers.sort_unstable();
            if numbers.is_empty() {
                dev.errors.push(format!(
                    "{}: no ports listed; the driver did not register any port",
                    ports_dir.display()
                ));
            }
            dev.ports = numbers
                .into_iter()
                .map(|n| read_port(reader, &ports_dir.join(n.to_string()), n))
                .collect();
        }
        Ok(None) => dev.errors.push(format!(
            "{}: missing; the device registered without ports (driver failed to initialise?)",
            ports_dir.display()
        )),
        Err(e) => dev.errors.push(e.to_string()),
    }
    dev
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

/// The sysfs folder of the PCI function behind a device's `device` link: the link
/// canonicalised (through [`Roots`], so fixture trees resolve inside themselves), then the
/// nearest folder named like a PCI address at or above it, so a device on an auxiliary bus
/// (an mlx5 sub-function) resolves to its physical function. `Ok(None)` when there is no
/// `device` link at all (software devices such as rxe have none); `Err` with what went wrong
/// and what it means when the link exists but names no PCI function.
fn resolve_pci_function(roots: &Roots, link: &Path) -> Result<Option<PathBuf>, String> {
    if fs::symlink_metadata(link).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(None);
    }
    let cannot = |what: String| {
        format!(
            "{}: {what}; the HCA's PCIe link cannot be checked",
            link.display()
        )
    };
    let resolve =
        |root: PathBuf| Ok::<_, std::io::Error>((roots.resolve_sys_under(link, &root)?, root));
    let (target, root) = roots
        .canonical_sysfs_root()
        .and_then(resolve)
        .map_err(|e| cannot(format!("cannot resolve the PCI function: {e}")))?;
    let function = target
        .ancestors()
        .take_while(|p| p.starts_with(&root) && *p != root)
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_pci_address)
        });
    match function {
        Some(f) => Ok(Some(f.to_owned())),
        None => Err(cannot(format!(
            "resolves to {}, which is not inside a PCI function",
            target.strip_prefix(&root).unwrap_or(&target).display()
        ))),
    }
}

/// The PCIe link of the PCI function in `function` (a canonical sysfs folder).
fn read_pci(reader: &mut AttrReader, function: &Path, errors: &mut Vec<String>) -> PciLink {
    let address = function
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let link = function;
    let mut pci = PciLink {
        address,
        ..PciLink::default()
    };
    pci.numa_node = reader
        .parsed(&link.join("numa_node"), "an integer", errors, |s| {
            s.trim().parse::<i64>().ok()
        })
        .and_then(|n| u32::try_from(n).ok());
    // `Unknown` speed (link down, or a virtual function) is reported as absent, not an error.
    pci.current_speed_gts = reader
        .read(&link.join("current_link_speed"))
        .ok()
        .flatten()
        .and_then(parse_pcie_speed);
    pci.max_speed_gts = reader
        .read(&link.join("max_link_speed"))
        .ok()
        .flatten()
        .and_then(parse_pcie_speed);
    pci.current_width = reader
        .read(&link.join("current_link_width"))
        .ok()
        .flatten()
        .and_then(|s| s.trim().parse().ok());
    pci.max_width = reader
        .read(&link.join("max_link_width"))
        .ok()
        .flatten()
        .and_then(|s| s.trim().parse().ok());
    pci
}

fn read_port(reader: &mut AttrReader, dir: &Path, port: u32) -> PortReport {
    let mut p = PortReport {
        port,
        ..PortReport::default()
    };
    let errors = &mut p.errors;
    p.state = reader.parsed(
        &dir.join("state"),
        "\"N: STATE\" such as \"4: ACTIVE\"",
        errors,
        parse_port_state,
    );
    p.phys_state = reader.parsed(
        &dir.join("phys_state"),
        "\"N: STATE\" such as \"5: LinkUp\"",
        errors,
        parse_phys_state,
    );
    p.rate = reader.parsed(
        &dir.join("rate"),
        "\"N Gb/sec (WX SPEED)\"",
        errors,
        parse_rate,
    );
    p.link_layer = reader.parsed(&dir.join("link_layer"), "a link layer", errors, |s| {
        Some(LinkLayer::parse(s))
    });
    p.lid = reader.parsed(&dir.join("lid"), "a hex LID", errors, parse_hex_u32);
    p.sm_lid = reader.parsed(&dir.join("sm_lid"), "a hex LID", errors, parse_hex_u32);
    p.gids = read_gids(reader, dir, errors);
    p.counters = read_counters(reader, &dir.join("counters"), errors);
    p.hw_counters = read_counters(reader, &dir.join("hw_counters"), errors);
    p
}

fn read_gids(reader: &mut AttrReader, port_dir: &Path, errors: &mut Vec<String>) -> Vec<Gid> {
    let gids_dir = port_dir.join("gids");
    let names = match list_dir(&gids_dir) {
        Ok(Some(n)) => n,
        Ok(None) => return Vec::new(),
        Err(e) => {
            errors.push(e.to_string());
            return Vec::new();
        }
    };
    let mut indices: Vec<u32> = names.iter().filter_map(|n| n.parse().ok()).collect();
    indices.sort_unstable();
    let mut out = Vec::new();
    for index in indices {
        let idx = index.to_string();
        let gid = match reader.read(&gids_dir.join(&idx)) {
            Ok(Some(g)) if !is_zero_gid(g) => g.trim().to_owned(),
            // Unused entries read as all zeroes (or fail on some kernels): not in use.
            _ => continue,
        };
        // The kernel answers EINVAL for attributes of entries without a netdev (InfiniBand).
        let attrs = port_dir.join("gid_attrs");
        let gid_type = reader
            .read(&attrs.join("types").join(&idx))
            .ok()
            .flatten()
            .map(GidType::parse);
        let netdev = reader
            .read(&attrs.join("ndevs").join(&idx))
            .ok()
            .flatten()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty());
        out.push(Gid {
            index,
            gid,
            gid_type,
            netdev,
        });
    }
    out
}

fn read_counters(
    reader: &mut AttrReader,
    dir: &Path,
    errors: &mut Vec<String>,
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let names = match list_dir(dir) {
        Ok(Some(n)) => n,
        Ok(None) => return out,
        Err(e) => {
            errors.push(e.to_string());
            return out;
        }
    };
    for name in names {
        let path: PathBuf = dir.join(&name);
        match reader.read(&path) {
            Ok(Some(text)) => match parse_counter(text) {
                Some(CounterText::Value(v)) => {
                    out.insert(name, v);
                }
                Some(CounterText::NotAvailable) => {}
                // `lifespan` is a writable knob in hw_counters, not a counter.
                None if name == "lifespan" => {}
                None => {
                    errors.push(ProbeError::parse(&path, text, "a decimal counter").to_string())
                }
            },
            Ok(None) => {}
            Err(e) => errors.push(e.to_string()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rxe0 in a real guest: `fw_ver` holds just "\n". That must not block the device.
    #[test]
    fn empty_text_attribute_is_absent_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fw_ver");
        fs::write(&path, "\n").unwrap();
        let mut errors = Vec::new();
        assert_eq!(AttrReader::new().string(&path, &mut errors), None);
        assert!(errors.is_empty(), "{errors:?}");
        fs::write(&path, "20.39.1002\n").unwrap();
        assert_eq!(
            AttrReader::new().string(&path, &mut errors).as_deref(),
            Some("20.39.1002")
        );
    }

    #[test]
    fn parses_every_kernel_port_state() {
        let cases = [
            ("0: NOP\n", PortState::Nop),
            ("1: DOWN\n", PortState::Down),
            ("2: INIT\n", PortState::Init),
            ("3: ARMED\n", PortState::Armed),
            ("4: ACTIVE\n", PortState::Active),
            ("5: ACTIVE_DEFER\n", PortState::ActiveDefer),
            ("7: UNKNOWN\n", PortState::Unknown(7)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_port_state(text), Some(want), "{text:?}");
        }
        assert_eq!(parse_port_state("ACTIVE"), None);
        assert_eq!(parse_port_state("4:"), None);
        assert_eq!(parse_port_state("x: ACTIVE"), None);
    }

    #[test]
    fn parses_every_kernel_phys_state() {
        let cases = [
            ("1: Sleep", PhysState::Sleep),
            ("2: Polling", PhysState::Polling),
            ("3: Disabled", PhysState::Disabled),
            (
                "4: PortConfigurationTraining",
                PhysState::PortConfigurationTraining,
            ),
            ("5: LinkUp", PhysState::LinkUp),
            ("6: LinkErrorRecovery", PhysState::LinkErrorRecovery),
            ("7: Phy Test", PhysState::PhyTest),
            ("0: <unknown>", PhysState::Unknown(0)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_phys_state(text), Some(want), "{text:?}");
        }
    }

    #[test]
    fn parses_rates_with_width_and_speed() {
        let r = parse_rate("400 Gb/sec (4X NDR)\n").unwrap();
        assert_eq!((r.gbps, r.width, r.speed.as_str()), (400.0, 4, "NDR"));
        let r = parse_rate("2.5 Gb/sec (1X SDR)").unwrap();
        assert_eq!((r.gbps, r.width, r.speed.as_str()), (2.5, 1, "SDR"));
        let r = parse_rate("200 Gb/sec (2X NDR)").unwrap();
        assert_eq!((r.gbps, r.width), (200.0, 2));
        let r = parse_rate("10 Gb/sec (4X)").unwrap();
        assert_eq!((r.gbps, r.width, r.speed.as_str()), (10.0, 4, ""));
        assert_eq!(parse_rate("fast"), None);
        assert_eq!(parse_rate("400 Gb/sec"), None);
        assert_eq!(parse_rate("-1 Gb/sec (4X NDR)"), None);
    }

    #[test]
    fn parses_lids_pcie_and_counters() {
        assert_eq!(parse_hex_u32("0x1a\n"), Some(26));
        assert_eq!(parse_hex_u32("26"), None);
        assert_eq!(parse_pcie_speed("32.0 GT/s PCIe\n"), Some(32.0));
        assert_eq!(parse_pcie_speed("8 GT/s"), Some(8.0));
        assert_eq!(parse_pcie_speed("Unknown"), None);
        assert_eq!(parse_counter("123\n"), Some(CounterText::Value(123)));
        assert_eq!(
            parse_counter("N/A (no PMA)\n"),
            Some(CounterText::NotAvailable)
        );
        assert_eq!(parse_counter("lots"), None);
        assert_eq!(
            parse_node_type("1: CA\n"),
            Some(NodeType {
                code: 1,
                name: "CA".into()
            })
        );
    }

    #[test]
    fn pci_addresses_are_recognised() {
        for good in ["0000:3b:00.0", "0000:00:1f.7", "10000:01:00.0"] {
            assert!(is_pci_address(good), "{good}");
        }
        for bad in [
            "mlx5_core.sf.2",
            "pci0000:00",
            "0000:3b:00",
            "0000:3b:00.8",
            "0000:3b:0.0",
            "0000:3b:00.0:1",
            "",
        ] {
            assert!(!is_pci_address(bad), "{bad}");
        }
    }

    /// The three outcomes of resolving a `device` link: none (software device), a PCI
    /// function at or above the target, and a target outside any PCI function.
    #[test]
    fn device_links_resolve_to_the_pci_function_or_say_why_not() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        let roots = Roots::new(&sys, dir.path().join("proc"));
        let mk = |rel: &str| fs::create_dir_all(sys.join(rel)).unwrap();
        mk("devices/virtual/infiniband/rxe0");
        mk("devices/pci0000:00/0000:00:01.0/0000:3b:00.0/mlx5_core.sf.4/infiniband/mlx5_4");
        mk("devices/platform/HISI00D1:00/infiniband/hns_0");
        let link = |target: &str, at: &str| {
            std::os::unix::fs::symlink(target, sys.join(at).join("device")).unwrap();
            sys.join(at).join("device")
        };
        let none = sys.join("devices/virtual/infiniband/rxe0/device");
        assert_eq!(resolve_pci_function(&roots, &none), Ok(None));

        let sf = link(
            "../../../mlx5_core.sf.4",
            "devices/pci0000:00/0000:00:01.0/0000:3b:00.0/mlx5_core.sf.4/infiniband/mlx5_4",
        );
        let function = resolve_pci_function(&roots, &sf).unwrap().unwrap();
        assert!(
            function.ends_with("0000:00:01.0/0000:3b:00.0"),
            "{function:?}"
        );

        let platform = link("../..", "devices/platform/HISI00D1:00/infiniband/hns_0");
        let why = resolve_pci_function(&roots, &platform).unwrap_err();
        assert!(
            why.contains(
                "resolves to devices/platform/HISI00D1:00, which is not inside a PCI \
                          function; the HCA's PCIe link cannot be checked"
            ),
            "{why}"
        );
    }

    #[test]
    fn zero_gids_are_unused() {
        assert!(is_zero_gid("0000:0000:0000:0000:0000:0000:0000:0000"));
        assert!(!is_zero_gid("fe80:0000:0000:0000:ec0d:9a03:0078:6a6a"));
    }
}
