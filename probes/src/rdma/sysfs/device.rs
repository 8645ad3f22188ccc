//! The open files of one device: its identity and firmware, the PCI function behind its
//! `device` link (NUMA node, PCIe link), and its ports.

use super::CounterNames;
use super::attr::{get, placeholder, quiet, text};
use super::parse::{is_pci_address, parse_node_type, parse_pcie_speed};
use super::port::PortHandles;
use crate::rdma::{DeviceReport, NodeType, PciLink};
use crate::roots::Roots;
use crate::sysfs_io::{Attr, AttrBuf, DirStamp, list_dir};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The open files of one device.
pub(super) struct DevHandles {
    pub(super) name: String,
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
    pub(super) ports: Vec<PortHandles>,
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

impl DevHandles {
    pub(super) fn new(
        roots: &Roots,
        class: &Path,
        name: String,
        counter_names: &Arc<CounterNames>,
    ) -> Self {
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
    pub(super) fn read(&mut self, buf: &mut AttrBuf, slow: bool, now: f64) -> DeviceReport {
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

/// The sysfs folder of the PCI function behind a device's `device` link: the link
/// canonicalised (through [`Roots`], so fixture trees resolve inside themselves), then the
/// nearest folder named like a PCI address at or above it, so a device on an auxiliary bus
/// (an mlx5 sub-function) resolves to its physical function. `Ok(None)` when there is no
/// `device` link at all (software devices such as rxe have none); `Err` with what went wrong
/// and what it means when the link exists but names no PCI function.
/// Also gives the function's folder below the sysfs root (`devices/pci…/<address>`).
pub(super) fn resolve_pci_function(
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
