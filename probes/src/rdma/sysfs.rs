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
use crate::sysfs_io::{Attr, AttrBuf, DirStamp, list_dir, parsed, string};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

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

/// Read every RDMA device under `<sysfs>/class/infiniband` once, counters included.
pub fn probe(roots: &Roots) -> RdmaReport {
    SysfsReader::new(roots).probe(true)
}

/// Which files of `counters/` and `hw_counters/` a reader reads; `None` for a group: all of
/// them. The agent reads only what it exports and what its fallback detector needs (25 of the
/// ~50 files of an mlx5 port), `check` reads everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterNames {
    pub counters: Option<Vec<String>>,
    pub hw_counters: Option<Vec<String>>,
}

/// Keeps the attribute files of every device and port open between probes, so a probe is one
/// `pread` per attribute: no path building, no `open`/`close`. Before reading a device the
/// reader `stat`s its directory, and re-opens everything below it when the device appeared,
/// disappeared or was re-created (a new inode, or a changed directory), or when a read said
/// a file is gone (`ENODEV`); likewise each port's directory. The GID table and the counter
/// groups are created and removed with their port by the kernel, so they are not `stat`ed on
/// every probe.
pub struct SysfsReader {
    roots: Roots,
    class: PathBuf,
    devices: Vec<DevHandles>,
    /// One read buffer per worker thread.
    bufs: Vec<AttrBuf>,
    counter_names: Arc<CounterNames>,
}

impl std::fmt::Debug for SysfsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SysfsReader")
            .field("class", &self.class)
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl SysfsReader {
    pub fn new(roots: &Roots) -> Self {
        Self::with_counter_names(roots, CounterNames::default())
    }

    /// A reader that reads only `names` of each port's counter groups.
    pub fn with_counter_names(roots: &Roots, names: CounterNames) -> Self {
        Self {
            roots: roots.clone(),
            class: roots.sys("class/infiniband"),
            devices: Vec::new(),
            bufs: Vec::new(),
            counter_names: Arc::new(names),
        }
    }

    /// Read every device. `slow`: also re-read what changes seldom or is not in the verdict:
    /// `counters/` and `hw_counters/`, each device's identity, firmware and PCIe capabilities,
    /// and the GID tables of InfiniBand ports. Otherwise these carry the values of their last
    /// read (counters with their `counters_timestamp`); a device or port seen for the first
    /// time, or re-created, is always read in full.
    pub fn probe(&mut self, slow: bool) -> RdmaReport {
        let mut report = RdmaReport::default();
        let listing = match list_dir(&self.class) {
            Ok(Some(listing)) => listing,
            Ok(None) => {
                self.devices.clear();
                return report;
            }
            Err(e) => {
                report.subsystem_present = true;
                report.errors.push(e.to_string());
                self.devices.clear();
                return report;
            }
        };
        report.subsystem_present = true;

        // Keep the handles of devices still listed; new names get unopened handles.
        let mut old = std::mem::take(&mut self.devices).into_iter().peekable();
        let mut devices = Vec::with_capacity(listing.names.len());
        for name in listing.names {
            while old.next_if(|h| h.name < name).is_some() {}
            match old.next_if(|h| h.name == name) {
                Some(h) => devices.push(h),
                None => devices.push(DevHandles::new(
                    &self.roots,
                    &self.class,
                    name,
                    &self.counter_names,
                )),
            }
        }
        self.devices = devices;

        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        report.devices = read_devices(&mut self.devices, &mut self.bufs, slow, now);

        // A name that is not UTF-8 cannot be a label or a metric value; say so rather than
        // dropping the device silently.
        for raw in listing.undecodable {
            let shown = raw.as_bytes().escape_ascii().to_string();
            report.devices.push(DeviceReport {
                errors: vec![format!(
                    "{}/{shown}: the device name is not UTF-8, so the device is not probed; \
                     rename it (rdma dev set NAME name NEW) or check the driver",
                    self.class.display()
                )],
                name: shown,
                ..DeviceReport::default()
            });
        }
        report
    }
}

/// A port's state as one quick read found it ([`SysfsReader::port_states`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortStateRead {
    pub device: String,
    pub port: u32,
    pub state: PortState,
    pub phys_state: Option<PhysState>,
}

impl SysfsReader {
    /// Re-read only `state` and `phys_state` of the ports the last [`Self::probe`] opened:
    /// two `pread`s per port, nothing re-opened, no directory checked. A port whose state
    /// cannot be read now (its device going away) is left out: this is for acting fast on
    /// positive evidence (a port that is down now), the next full probe says the rest.
    pub fn port_states(&mut self) -> Vec<PortStateRead> {
        if self.bufs.is_empty() {
            self.bufs.push(AttrBuf::new());
        }
        let buf = &mut self.bufs[0];
        let mut out = Vec::new();
        for dev in &self.devices {
            for port in &dev.ports {
                let Some(state) = port
                    .state
                    .read(buf)
                    .ok()
                    .flatten()
                    .and_then(parse_port_state)
                else {
                    continue;
                };
                let phys_state = port
                    .phys_state
                    .read(buf)
                    .ok()
                    .flatten()
                    .and_then(parse_phys_state);
                out.push(PortStateRead {
                    device: dev.name.clone(),
                    port: port.port,
                    state,
                    phys_state,
                });
            }
        }
        out
    }
}

const DEVICES_PER_READ_THREAD: usize = 16;

/// Devices are independent; on a node with many RDMA devices the probe reads them on up to
/// one thread per core (at most 4), each taking a contiguous share, and keeps the sorted order.
/// A thread per 16 devices: spawning and joining one costs about as much CPU as reading a
/// dozen devices (on `ndr-8x400-healthy`, 10 devices, a helper thread every tick made the
/// agent at `--interval 1s` cost 2.37 instead of 1.93 millicores), so GPU nodes (8–12 HCAs)
/// are read on the probe's own thread and only the wall time of very large ones is shortened.
fn read_devices(
    devices: &mut [DevHandles],
    bufs: &mut Vec<AttrBuf>,
    slow: bool,
    now: f64,
) -> Vec<DeviceReport> {
    // Asked once: `available_parallelism` reads the cgroup's CPU quota files each time.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let threads = cores
        .min(4)
        .min(devices.len() / DEVICES_PER_READ_THREAD)
        .max(1);
    while bufs.len() < threads {
        bufs.push(AttrBuf::new());
    }
    let read_share = |share: &mut [DevHandles], buf: &mut AttrBuf| {
        share
            .iter_mut()
            .map(|h| h.read(buf, slow, now))
            .collect::<Vec<_>>()
    };
    if threads == 1 {
        return read_share(devices, &mut bufs[0]);
    }
    let per = devices.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut shares = devices.chunks_mut(per).zip(bufs.iter_mut());
        let first = shares.next();
        let helpers: Vec<_> = shares
            .map(|(share, buf)| scope.spawn(move || read_share(share, buf)))
            .collect();
        let mut all = first.map_or_else(Vec::new, |(share, buf)| read_share(share, buf));
        for helper in helpers {
            match helper.join() {
                Ok(part) => all.extend(part),
                // A panic while reading is a bug; surface it as the serial code would.
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        all
    })
}

/// The open files of one device.
struct DevHandles {
    name: String,
    dir: PathBuf,
    /// The directory when the files were opened; `None` before the first open.
    stamp: Option<Option<DirStamp>>,
    /// A read said a file is gone: re-open on the next probe.
    stale: bool,
    node_type: Attr,
    node_guid: Attr,
    sys_image_guid: Attr,
    fw_ver: Attr,
    hca_type: Attr,
    board_id: Attr,
    /// The slow attributes as last read (`None`: read them on the next probe).
    fixed: Option<Fixed>,
    pci: Option<PciHandles>,
    /// Why the PCI function behind the `device` link cannot be named (its PCIe check fails).
    pci_error: Option<String>,
    roots: Roots,
    counter_names: Arc<CounterNames>,
    ports: Vec<PortHandles>,
    /// Why there are no ports (no folder, empty, unreadable), reported on every probe.
    ports_error: Option<String>,
}

/// A device's attributes read on the slow cadence with the counters: fixed for the device's
/// life, or changed only by a firmware activation (`fw_ver`) or a reset that re-creates it.
/// Re-reading them every second was a third of an InfiniBand node's `pread`s.
#[derive(Default)]
struct Fixed {
    node_type: Option<NodeType>,
    node_guid: Option<String>,
    sys_image_guid: Option<String>,
    fw_ver: Option<String>,
    hca_type: Option<String>,
    board_id: Option<String>,
    /// The PCI function's NUMA node and link capabilities (the current link is read on every
    /// probe: it can retrain).
    numa_node: Option<u32>,
    max_speed_gts: Option<f64>,
    max_width: Option<u32>,
    /// Problems of the last read, reported with its values until the next one.
    errors: Vec<String>,
}

struct PciHandles {
    address: String,
    /// [`PciLink::sysfs_dir`].
    below_root: Option<String>,
    numa_node: Attr,
    current_link_speed: Attr,
    max_link_speed: Attr,
    current_link_width: Attr,
    max_link_width: Attr,
}

struct PortHandles {
    port: u32,
    dir: PathBuf,
    stamp: Option<DirStamp>,
    state: Attr,
    phys_state: Attr,
    rate: Attr,
    link_layer: Attr,
    lid: Attr,
    sm_lid: Attr,
    gids_dir: PathBuf,
    gids: Vec<GidHandles>,
    /// The GIDs in use as last read; an InfiniBand port's table is re-read on the slow
    /// cadence only (the verdict reads GIDs of Ethernet ports alone, and an mlx5 IB port
    /// lists 128 entries), any other port's on every probe.
    gids_read: Option<Vec<Gid>>,
    gids_error: Option<String>,
    counter_names: Arc<CounterNames>,
    counters: CounterGroup,
    hw_counters: CounterGroup,
    /// When the counter groups were last read (seconds since the Unix epoch).
    counters_timestamp: Option<f64>,
}

struct GidHandles {
    index: u32,
    gid: Attr,
    gid_type: Attr,
    netdev: Attr,
}

/// `counters/` or `hw_counters/`: its files and the values of their last read.
struct CounterGroup {
    files: Vec<(String, Attr)>,
    list_error: Option<String>,
    values: Arc<BTreeMap<String, u64>>,
    /// Problems of the last read, reported with its values until the next one.
    errors: Vec<String>,
}

fn placeholder() -> Attr {
    Attr::open(PathBuf::new())
}

impl DevHandles {
    fn new(roots: &Roots, class: &Path, name: String, counter_names: &Arc<CounterNames>) -> Self {
        Self {
            pci_error: None,
            roots: roots.clone(),
            counter_names: Arc::clone(counter_names),
            dir: class.join(&name),
            name,
            stamp: None,
            stale: false,
            node_type: placeholder(),
            node_guid: placeholder(),
            sys_image_guid: placeholder(),
            fw_ver: placeholder(),
            hca_type: placeholder(),
            board_id: placeholder(),
            fixed: None,
            pci: None,
            ports: Vec::new(),
            ports_error: None,
        }
    }

    fn open(&mut self, stamp: Option<DirStamp>) {
        let dir = &self.dir;
        self.stamp = Some(stamp);
        self.stale = false;
        self.node_type = Attr::open(dir.join("node_type"));
        self.node_guid = Attr::open(dir.join("node_guid"));
        self.sys_image_guid = Attr::open(dir.join("sys_image_guid"));
        self.fw_ver = Attr::open(dir.join("fw_ver"));
        self.hca_type = Attr::open(dir.join("hca_type"));
        self.board_id = Attr::open(dir.join("board_id"));
        self.fixed = None;
        (self.pci, self.pci_error) = match resolve_pci_function(&self.roots, &dir.join("device")) {
            Ok(Some((function, below))) => (Some(PciHandles::open(&function, below)), None),
            Ok(None) => (None, None),
            Err(why) => (None, Some(why)),
        };
        self.ports_error = None;
        let ports_dir = dir.join("ports");
        self.ports = match list_dir(&ports_dir) {
            Ok(Some(listing)) => {
                let mut numbers: Vec<u32> = listing
                    .names
                    .iter()
                    .filter_map(|n| n.parse().ok())
                    .collect();
                numbers.sort_unstable();
                if numbers.is_empty() {
                    self.ports_error = Some(format!(
                        "{}: no ports listed; the driver did not register any port",
                        ports_dir.display()
                    ));
                }
                numbers
                    .into_iter()
                    .map(|n| {
                        PortHandles::open(ports_dir.join(n.to_string()), n, &self.counter_names)
                    })
                    .collect()
            }
            Ok(None) => {
                self.ports_error = Some(format!(
                    "{}: missing; the device registered without ports (driver failed to \
                     initialise?)",
                    ports_dir.display()
                ));
                Vec::new()
            }
            Err(e) => {
                self.ports_error = Some(e.to_string());
                Vec::new()
            }
        };
    }

    /// `slow`: also re-read the counters and the slow attributes ([`Fixed`], the GID tables of
    /// InfiniBand ports); otherwise they carry their last values (read at once when new).
    fn read(&mut self, buf: &mut AttrBuf, slow: bool, now: f64) -> DeviceReport {
        let stamp = DirStamp::of(&self.dir);
        if self.stale || self.stamp != Some(stamp) {
            self.open(stamp);
        }
        if slow || self.fixed.is_none() {
            self.fixed = Some(self.read_fixed(buf));
        }
        let fixed = self.fixed.as_ref();
        let mut dev = DeviceReport {
            name: self.name.clone(),
            node_type: fixed.and_then(|f| f.node_type.clone()),
            node_guid: fixed.and_then(|f| f.node_guid.clone()),
            sys_image_guid: fixed.and_then(|f| f.sys_image_guid.clone()),
            fw_ver: fixed.and_then(|f| f.fw_ver.clone()),
            hca_type: fixed.and_then(|f| f.hca_type.clone()),
            board_id: fixed.and_then(|f| f.board_id.clone()),
            errors: fixed.map(|f| f.errors.clone()).unwrap_or_default(),
            ..DeviceReport::default()
        };
        let errors = &mut dev.errors;
        let gone = &mut self.stale;
        dev.pci = self.pci.as_ref().map(|p| p.read(buf, fixed));
        if let Some(why) = &self.pci_error {
            errors.push(why.clone());
            dev.pci_error = Some(why.clone());
        }
        if let Some(e) = &self.ports_error {
            errors.push(e.clone());
        }
        dev.ports = self
            .ports
            .iter_mut()
            .map(|p| p.read(buf, slow, now, gone))
            .collect();
        dev
    }

    fn read_fixed(&mut self, buf: &mut AttrBuf) -> Fixed {
        let mut f = Fixed::default();
        let errors = &mut f.errors;
        let gone = &mut self.stale;
        f.node_type = get(
            &self.node_type,
            buf,
            "\"N: NAME\"",
            errors,
            gone,
            parse_node_type,
        );
        f.node_guid = text(&self.node_guid, buf, errors, gone);
        f.sys_image_guid = text(&self.sys_image_guid, buf, errors, gone);
        f.fw_ver = text(&self.fw_ver, buf, errors, gone);
        f.hca_type = text(&self.hca_type, buf, errors, gone);
        f.board_id = text(&self.board_id, buf, errors, gone);
        if let Some(pci) = &self.pci {
            f.numa_node = get(&pci.numa_node, buf, "an integer", errors, gone, |s| {
                s.trim().parse::<i64>().ok()
            })
            .and_then(|n| u32::try_from(n).ok());
            // `Unknown` speed (a virtual function) is absent, not an error.
            f.max_speed_gts = quiet(&pci.max_link_speed, buf, parse_pcie_speed);
            f.max_width = quiet(&pci.max_link_width, buf, |s| s.trim().parse().ok());
        }
        f
    }
}

/// Read and parse an attribute: absence is `None`, failures go to `errors` (naming the path),
/// and a file that is gone marks the device for re-opening.
fn get<T>(
    attr: &Attr,
    buf: &mut AttrBuf,
    expected: &'static str,
    errors: &mut Vec<String>,
    gone: &mut bool,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Option<T> {
    let result = attr.read(buf);
    if let Err(e) = &result {
        *gone |= e.is_gone();
    }
    parsed(result, attr.path(), expected, errors, parse)
}

fn text(
    attr: &Attr,
    buf: &mut AttrBuf,
    errors: &mut Vec<String>,
    gone: &mut bool,
) -> Option<String> {
    let result = attr.read(buf);
    if let Err(e) = &result {
        *gone |= e.is_gone();
    }
    string(result, attr.path(), errors)
}

/// Read and parse an attribute whose failures are not errors (the kernel answers EINVAL for
/// GID attributes of entries without a netdev, `Unknown` for the speed of a link that is down).
fn quiet<T>(attr: &Attr, buf: &mut AttrBuf, parse: impl FnOnce(&str) -> Option<T>) -> Option<T> {
    attr.read(buf).ok().flatten().and_then(parse)
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
/// Also gives the function's folder below the sysfs root (`devices/pci…/<address>`).
fn resolve_pci_function(
    roots: &Roots,
    link: &Path,
) -> Result<Option<(PathBuf, Option<String>)>, String> {
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
        Some(f) => {
            let below = f
                .strip_prefix(&root)
                .ok()
                .and_then(Path::to_str)
                .map(str::to_owned);
            Ok(Some((f.to_owned(), below)))
        }
        None => Err(cannot(format!(
            "resolves to {}, which is not inside a PCI function",
            target.strip_prefix(&root).unwrap_or(&target).display()
        ))),
    }
}

impl PciHandles {
    /// The PCIe link attributes of the PCI function in `function` (a canonical sysfs folder).
    fn open(function: &Path, below_root: Option<String>) -> Self {
        Self {
            below_root,
            address: function
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            numa_node: Attr::open(function.join("numa_node")),
            current_link_speed: Attr::open(function.join("current_link_speed")),
            max_link_speed: Attr::open(function.join("max_link_speed")),
            current_link_width: Attr::open(function.join("current_link_width")),
            max_link_width: Attr::open(function.join("max_link_width")),
        }
    }

    /// The current link (it can retrain at any time) beside the capabilities in `fixed`.
    fn read(&self, buf: &mut AttrBuf, fixed: Option<&Fixed>) -> PciLink {
        let width = |s: &str| s.trim().parse().ok();
        PciLink {
            address: self.address.clone(),
            sysfs_dir: self.below_root.clone(),
            numa_node: fixed.and_then(|f| f.numa_node),
            // `Unknown` speed (link down, or a virtual function) is absent, not an error.
            current_speed_gts: quiet(&self.current_link_speed, buf, parse_pcie_speed),
            max_speed_gts: fixed.and_then(|f| f.max_speed_gts),
            current_width: quiet(&self.current_link_width, buf, width),
            max_width: fixed.and_then(|f| f.max_width),
        }
    }
}

impl PortHandles {
    fn open(dir: PathBuf, port: u32, names: &Arc<CounterNames>) -> Self {
        let gids_dir = dir.join("gids");
        let mut p = Self {
            port,
            stamp: DirStamp::of(&dir),
            state: Attr::open(dir.join("state")),
            phys_state: Attr::open(dir.join("phys_state")),
            rate: Attr::open(dir.join("rate")),
            link_layer: Attr::open(dir.join("link_layer")),
            lid: Attr::open(dir.join("lid")),
            sm_lid: Attr::open(dir.join("sm_lid")),
            gids: Vec::new(),
            gids_read: None,
            gids_error: None,
            counters: CounterGroup::open(dir.join("counters"), names.counters.as_deref()),
            hw_counters: CounterGroup::open(dir.join("hw_counters"), names.hw_counters.as_deref()),
            counter_names: Arc::clone(names),
            counters_timestamp: None,
            gids_dir,
            dir,
        };
        p.open_gids();
        p
    }

    fn open_gids(&mut self) {
        self.gids.clear();
        self.gids_error = None;
        let listing = match list_dir(&self.gids_dir) {
            Ok(Some(listing)) => listing,
            Ok(None) => return,
            Err(e) => {
                self.gids_error = Some(e.to_string());
                return;
            }
        };
        let mut indices: Vec<u32> = listing
            .names
            .iter()
            .filter_map(|n| n.parse().ok())
            .collect();
        indices.sort_unstable();
        let attrs = self.dir.join("gid_attrs");
        self.gids = indices
            .into_iter()
            .map(|index| {
                let idx = index.to_string();
                GidHandles {
                    index,
                    gid: Attr::open(self.gids_dir.join(&idx)),
                    gid_type: Attr::open(attrs.join("types").join(&idx)),
                    netdev: Attr::open(attrs.join("ndevs").join(&idx)),
                }
            })
            .collect();
    }

    fn read(&mut self, buf: &mut AttrBuf, slow: bool, now: f64, gone: &mut bool) -> PortReport {
        if DirStamp::of(&self.dir) != self.stamp {
            let names = Arc::clone(&self.counter_names);
            *self = Self::open(std::mem::take(&mut self.dir), self.port, &names);
        }
        let mut p = PortReport {
            port: self.port,
            ..PortReport::default()
        };
        let errors = &mut p.errors;
        p.state = get(
            &self.state,
            buf,
            "\"N: STATE\" such as \"4: ACTIVE\"",
            errors,
            gone,
            parse_port_state,
        );
        p.phys_state = get(
            &self.phys_state,
            buf,
            "\"N: STATE\" such as \"5: LinkUp\"",
            errors,
            gone,
            parse_phys_state,
        );
        p.rate = get(
            &self.rate,
            buf,
            "\"N Gb/sec (WX SPEED)\"",
            errors,
            gone,
            parse_rate,
        );
        p.link_layer = get(&self.link_layer, buf, "a link layer", errors, gone, |s| {
            Some(LinkLayer::parse(s))
        });
        p.lid = get(&self.lid, buf, "a hex LID", errors, gone, parse_hex_u32);
        p.sm_lid = get(&self.sm_lid, buf, "a hex LID", errors, gone, parse_hex_u32);
        if let Some(e) = &self.gids_error {
            errors.push(e.clone());
        }
        let gids = match &self.gids_read {
            Some(gids) if !slow && p.link_layer == Some(LinkLayer::InfiniBand) => gids.clone(),
            _ => {
                let gids: Vec<Gid> = self.gids.iter().filter_map(|g| g.read(buf)).collect();
                self.gids_read = Some(gids.clone());
                gids
            }
        };
        p.gids = gids;

        if slow || self.counters_timestamp.is_none() {
            self.counters.read(buf, gone);
            self.hw_counters.read(buf, gone);
            self.counters_timestamp = Some(now);
        }
        p.counters = Arc::clone(&self.counters.values);
        p.hw_counters = Arc::clone(&self.hw_counters.values);
        p.counters_timestamp = self.counters_timestamp;
        errors.extend(self.counters.errors.iter().cloned());
        errors.extend(self.hw_counters.errors.iter().cloned());
        p
    }
}

impl GidHandles {
    fn read(&self, buf: &mut AttrBuf) -> Option<Gid> {
        // Unused entries read as all zeroes (or fail on some kernels): not in use.
        let gid = match self.gid.read(buf) {
            Ok(Some(g)) if !is_zero_gid(g) => g.trim().to_owned(),
            _ => return None,
        };
        // The kernel answers EINVAL for attributes of entries without a netdev (InfiniBand).
        let gid_type = quiet(&self.gid_type, buf, |s| Some(GidType::parse(s)));
        let netdev = quiet(&self.netdev, buf, |s| {
            Some(s.trim().to_owned()).filter(|s| !s.is_empty())
        });
        Some(Gid {
            index: self.index,
            gid,
            gid_type,
            netdev,
        })
    }
}

impl CounterGroup {
    /// List `dir` and open its files (only those in `wanted`, when given): once per port open,
    /// since the kernel creates the group with its port.
    fn open(dir: PathBuf, wanted: Option<&[String]>) -> Self {
        let mut list_error = None;
        let files = match list_dir(&dir) {
            Ok(Some(listing)) => listing
                .names
                .into_iter()
                .filter(|name| wanted.is_none_or(|w| w.contains(name)))
                .map(|name| {
                    let attr = Attr::open(dir.join(&name));
                    (name, attr)
                })
                .collect(),
            Ok(None) => Vec::new(),
            Err(e) => {
                list_error = Some(e.to_string());
                Vec::new()
            }
        };
        Self {
            files,
            list_error,
            values: Arc::new(BTreeMap::new()),
            errors: Vec::new(),
        }
    }

    /// Re-read every counter, updating the values in place (no allocation once the names
    /// are known and the previous report has been dropped).
    fn read(&mut self, buf: &mut AttrBuf, gone: &mut bool) {
        self.errors.clear();
        if let Some(e) = &self.list_error {
            self.errors.push(e.clone());
        }
        let values = Arc::make_mut(&mut self.values);
        for (name, attr) in &self.files {
            let value = match attr.read(buf) {
                Ok(Some(text)) => match parse_counter(text) {
                    Some(CounterText::Value(v)) => Some(v),
                    Some(CounterText::NotAvailable) => None,
                    // `lifespan` is a writable knob in hw_counters, not a counter.
                    None if name == "lifespan" => None,
                    None => {
                        self.errors.push(
                            ProbeError::parse(attr.path(), text, "a decimal counter").to_string(),
                        );
                        None
                    }
                },
                Ok(None) => None,
                Err(e) => {
                    *gone |= e.is_gone();
                    self.errors.push(e.to_string());
                    None
                }
            };
            match (value, values.get_mut(name.as_str())) {
                (Some(v), Some(slot)) => *slot = v,
                (Some(v), None) => {
                    values.insert(name.clone(), v);
                }
                (None, Some(_)) => {
                    values.remove(name.as_str());
                }
                (None, None) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sysfs_io::AttrReader;

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
        let (function, below) = resolve_pci_function(&roots, &sf).unwrap().unwrap();
        assert!(
            function.ends_with("0000:00:01.0/0000:3b:00.0"),
            "{function:?}"
        );
        assert_eq!(
            below.as_deref(),
            Some("devices/pci0000:00/0000:00:01.0/0000:3b:00.0")
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
