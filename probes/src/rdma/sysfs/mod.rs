//! The RDMA tree in sysfs: `class/infiniband/<dev>` (a symlink into `devices/`), its ports,
//! GID tables, counters, and the PCIe link of the HCA behind the `device` link.
//!
//! Parsers are pure functions over the file content; the reader around them turns every
//! failure into a per-device or per-port error so one bad device never hides the others.
//!
//! Layout: `parse` holds the parsers, `device` and `port` the open files of a device and of a
//! port (with its GID table and counter groups), `attr` the read of one attribute; this
//! module the reader that walks them.

mod attr;
mod device;
mod parse;
mod port;
#[cfg(test)]
mod tests;

pub use parse::{
    CounterText, is_pci_address, parse_counter, parse_hex_u32, parse_node_type, parse_pcie_speed,
    parse_phys_state, parse_port_state, parse_rate,
};

use super::{DeviceReport, PhysState, PortState, RdmaReport};
use crate::roots::Roots;
use crate::sysfs_io::{AttrBuf, list_dir};
use device::DevHandles;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

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
