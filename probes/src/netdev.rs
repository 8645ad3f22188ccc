//! Byte counters of the network interfaces that carry TCP traffic
//! (`<sysfs>/class/net/<if>/statistics/{rx,tx}_bytes`), so the agent can see traffic that
//! should have gone over RDMA but did not (the silent TCP fallback).
//!
//! RDMA traffic offloaded to the HCA does not pass the kernel's network stack, so these
//! counters hold the TCP/IP path only, even on the netdev of a RoCE port.

use crate::collect::{Collector, Fact, Pass};
use crate::report::ProbeReport;
use crate::roots::Roots;
use crate::sysfs_io::{AttrBuf, KeptAttr, list_dir};
use serde::Serialize;
use std::fs;
use std::path::{Path, PathBuf};

/// Which interfaces to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetdevConfig {
    /// Interface names; empty means "every physical interface" (one whose sysfs node is not
    /// under `devices/virtual/`, which leaves out `lo`, bridges, veths, bonds and tunnels), or,
    /// where there is none (the agent runs in a pod's network namespace), every interface
    /// but `lo`.
    pub interfaces: Vec<String>,
}

/// At most this many interfaces are read in automatic mode: keeps the metric series bounded
/// on hosts with odd setups (hundreds of SR-IOV functions).
pub const MAX_AUTO_INTERFACES: usize = 32;

/// Counters of one interface after one probe.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NetdevReport {
    pub name: String,
    /// `statistics/rx_bytes`; `None` when absent or unreadable.
    pub rx_bytes: Option<u64>,
    pub tx_bytes: Option<u64>,
    pub errors: Vec<String>,
}

/// The collector's name: its `probe` label and timing (`netdev_seconds`).
pub const NAME: &str = "netdev";
/// Its key in the report (`check`'s JSON).
pub const KEY: &str = "netdevs";

/// The interfaces this probe read (none when the netdev collector did not run).
pub fn reports(report: &ProbeReport) -> &[NetdevReport] {
    report
        .facts
        .get::<Vec<NetdevReport>>(KEY)
        .map_or(&[], Vec::as_slice)
}

/// Put `netdevs` in `report` as the collector would have (a report built or changed in code).
pub fn set_reports(report: &mut ProbeReport, netdevs: Vec<NetdevReport>) {
    report.facts.insert(KEY, fact(netdevs).from_probe(NAME));
}

/// The fact of one probe: the interfaces, and their errors as the probe's.
fn fact(netdevs: Vec<NetdevReport>) -> Fact {
    let errors = netdevs.iter().flat_map(|n| n.errors.clone()).collect();
    Fact::new(netdevs).with_errors(errors)
}

impl Collector for NetdevReader {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key(&self) -> &'static str {
        KEY
    }

    fn collect(&mut self, _pass: &Pass<'_>) -> Fact {
        fact(self.probe())
    }
}

/// Read the configured interfaces, or every physical one when none is configured, once.
pub fn probe(roots: &Roots, config: &NetdevConfig) -> Vec<NetdevReport> {
    NetdevReader::new(roots, config.clone()).probe()
}

/// Reads the interfaces' counters probe after probe with their files kept open: a probe lists
/// `class/net` and `readlink`s each entry (a new target is a new interface, judged physical or
/// virtual again), then one `pread` per counter. Resolving every link and opening every
/// counter file on each probe was most of the netdev probe's cost at `--interval 1s`.
pub struct NetdevReader {
    roots: Roots,
    config: NetdevConfig,
    class: PathBuf,
    /// The sysfs root with its links resolved, once (it is fixed for the agent's life).
    sys_root: Option<PathBuf>,
    /// By name, sorted.
    interfaces: Vec<Interface>,
    buf: AttrBuf,
}

struct Interface {
    name: String,
    /// The `class/net/<if>` link's target as last read.
    target: Option<PathBuf>,
    is_virtual: bool,
    rx_bytes: KeptAttr,
    tx_bytes: KeptAttr,
}

impl NetdevReader {
    pub fn new(roots: &Roots, config: NetdevConfig) -> Self {
        Self {
            class: roots.sys("class/net"),
            roots: roots.clone(),
            config,
            sys_root: None,
            interfaces: Vec::new(),
            buf: AttrBuf::new(),
        }
    }

    pub fn probe(&mut self) -> Vec<NetdevReport> {
        let configured = !self.config.interfaces.is_empty();
        let names = if configured {
            self.config.interfaces.clone()
        } else {
            match list_dir(&self.class) {
                Ok(listing) => {
                    let mut names = listing.map(|l| l.names).unwrap_or_default();
                    names.retain(|n| n != "lo");
                    names
                }
                Err(e) => {
                    self.interfaces.clear();
                    return vec![NetdevReport {
                        name: String::new(),
                        errors: vec![e.to_string()],
                        ..NetdevReport::default()
                    }];
                }
            }
        };
        self.refresh(&names);
        let chosen: Vec<usize> = if configured {
            (0..self.interfaces.len()).collect()
        } else {
            physical_first(&self.interfaces)
        };
        chosen
            .into_iter()
            .map(|i| {
                let iface = &mut self.interfaces[i];
                read_interface(iface, &self.class, configured, &mut self.buf)
            })
            .collect()
    }

    /// Keep the interfaces still listed under the same link target; (re)open the others.
    fn refresh(&mut self, names: &[String]) {
        if self.sys_root.is_none() {
            self.sys_root = self.roots.canonical_sysfs_root().ok();
        }
        let mut old = std::mem::take(&mut self.interfaces);
        for name in names {
            let link = self.class.join(name);
            let target = fs::read_link(&link).ok();
            let kept = old
                .iter()
                .position(|i| i.name == *name && i.target == target)
                .map(|at| old.swap_remove(at));
            let iface = kept.unwrap_or_else(|| {
                let stats = link.join("statistics");
                Interface {
                    is_virtual: is_virtual(&link, self.sys_root.as_deref()),
                    name: name.clone(),
                    target,
                    rx_bytes: KeptAttr::open(stats.join("rx_bytes")),
                    tx_bytes: KeptAttr::open(stats.join("tx_bytes")),
                }
            });
            self.interfaces.push(iface);
        }
    }
}

/// Automatic mode: the physical interfaces (at most [`MAX_AUTO_INTERFACES`]), or every listed
/// one where none is physical (a pod's network namespace).
fn physical_first(interfaces: &[Interface]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..interfaces.len()).collect();
    order.sort_by(|&a, &b| interfaces[a].name.cmp(&interfaces[b].name));
    let physical: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| !interfaces[i].is_virtual)
        .collect();
    let mut chosen = if physical.is_empty() { order } else { physical };
    chosen.truncate(MAX_AUTO_INTERFACES);
    chosen
}

/// `class/net/<if>` links into `devices/virtual/net/<if>` for software interfaces and into
/// the bus device (`devices/pci.../net/<if>`) for hardware ones.
fn is_virtual(link: &Path, sys_root: Option<&Path>) -> bool {
    let target = fs::canonicalize(link).unwrap_or_else(|_| link.to_owned());
    // Judge only the part below the sysfs root, whatever the root.
    let below = sys_root
        .and_then(|r| target.strip_prefix(r).ok())
        .unwrap_or(&target);
    let mut parts = below.components().map(|c| c.as_os_str());
    while let Some(part) = parts.next() {
        if part == "devices" {
            return parts.next().is_some_and(|next| next == "virtual");
        }
    }
    false
}

fn read_interface(
    iface: &mut Interface,
    class: &Path,
    configured: bool,
    buf: &mut AttrBuf,
) -> NetdevReport {
    let mut report = NetdevReport {
        name: iface.name.clone(),
        ..NetdevReport::default()
    };
    if configured && iface.target.is_none() {
        let dir = class.join(&iface.name);
        if !dir.exists() {
            report.errors.push(format!(
                "{}: no such interface; fix fallback.netdevs in the config (see `ip link`)",
                dir.display()
            ));
            return report;
        }
    }
    let errors = &mut report.errors;
    let counter = "a decimal byte counter";
    report.rx_bytes = iface.rx_bytes.parsed(buf, counter, errors, parse_counter);
    report.tx_bytes = iface.tx_bytes.parsed(buf, counter, errors, parse_counter);
    report
}

/// `12345\n` → 12345.
pub fn parse_counter(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn iface(root: &Path, name: &str, physical: bool, rx: &str, tx: &str) {
        let rel = if physical {
            format!("devices/pci0000:00/0000:00:03.0/net/{name}")
        } else {
            format!("devices/virtual/net/{name}")
        };
        let dir = root.join(&rel);
        fs::create_dir_all(dir.join("statistics")).unwrap();
        fs::write(dir.join("statistics/rx_bytes"), rx).unwrap();
        fs::write(dir.join("statistics/tx_bytes"), tx).unwrap();
        fs::create_dir_all(root.join("class/net")).unwrap();
        symlink(format!("../../{rel}"), root.join("class/net").join(name)).unwrap();
    }

    #[test]
    fn auto_mode_reads_physical_interfaces_only() {
        let tmp = tempfile::tempdir().unwrap();
        iface(tmp.path(), "eth0", true, "1000\n", "2000\n");
        iface(tmp.path(), "lo", false, "5\n", "5\n");
        iface(tmp.path(), "veth1234", false, "5\n", "5\n");
        let roots = Roots::new(tmp.path(), tmp.path());
        let got = probe(&roots, &NetdevConfig::default());
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].name, "eth0");
        assert_eq!(got[0].rx_bytes, Some(1000));
        assert_eq!(got[0].tx_bytes, Some(2000));
        assert!(got[0].errors.is_empty());
    }

    #[test]
    fn auto_mode_in_a_pod_namespace_reads_the_virtual_interfaces_but_lo() {
        let tmp = tempfile::tempdir().unwrap();
        iface(tmp.path(), "eth0", false, "1000\n", "2000\n");
        iface(tmp.path(), "lo", false, "5\n", "5\n");
        let roots = Roots::new(tmp.path(), tmp.path());
        let got = probe(&roots, &NetdevConfig::default());
        let names: Vec<&str> = got.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["eth0"]);
    }

    #[test]
    fn configured_interfaces_are_read_and_a_missing_one_is_an_error_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        iface(tmp.path(), "lo", false, "5\n", "garbage\n");
        let roots = Roots::new(tmp.path(), tmp.path());
        let config = NetdevConfig {
            interfaces: vec!["lo".into(), "eth9".into()],
        };
        let got = probe(&roots, &config);
        assert_eq!(got[0].rx_bytes, Some(5));
        assert_eq!(
            got[0].tx_bytes, None,
            "a malformed counter is absent, not 0"
        );
        assert!(got[0].errors[0].contains("tx_bytes"), "{:?}", got[0].errors);
        assert_eq!(got[1].rx_bytes, None);
        assert!(got[1].errors[0].contains("eth9"), "{:?}", got[1].errors);
        assert!(got[1].errors[0].contains("fallback.netdevs"));
    }

    /// One reader probe after probe: counters rewritten in place are seen through the kept
    /// files, a new interface is picked up, a removed one dropped, and a name whose link now
    /// points elsewhere (re-created as a virtual interface) is judged and opened afresh.
    #[test]
    fn a_kept_reader_follows_counters_and_interfaces_coming_and_going() {
        let tmp = tempfile::tempdir().unwrap();
        iface(tmp.path(), "eth0", true, "1\n", "2\n");
        let roots = Roots::new(tmp.path(), tmp.path());
        let mut reader = NetdevReader::new(&roots, NetdevConfig::default());
        let names = |got: &[NetdevReport]| got.iter().map(|n| n.name.clone()).collect::<Vec<_>>();
        assert_eq!(reader.probe()[0].rx_bytes, Some(1));

        let stats = tmp.path().join("class/net/eth0/statistics");
        fs::write(stats.join("rx_bytes"), "1000\n").unwrap();
        iface(tmp.path(), "eth1", true, "7\n", "8\n");
        let got = reader.probe();
        assert_eq!(names(&got), ["eth0", "eth1"]);
        assert_eq!((got[0].rx_bytes, got[1].tx_bytes), (Some(1000), Some(8)));

        // eth1 goes; eth0 is re-created as a virtual interface (a new link target), so the
        // physical-only selection now holds nothing and falls back to every interface.
        fs::remove_file(tmp.path().join("class/net/eth1")).unwrap();
        fs::remove_file(tmp.path().join("class/net/eth0")).unwrap();
        iface(tmp.path(), "eth0", false, "5\n", "6\n");
        let got = reader.probe();
        assert_eq!(names(&got), ["eth0"]);
        assert_eq!((got[0].rx_bytes, got[0].tx_bytes), (Some(5), Some(6)));
        assert!(got[0].errors.is_empty(), "{:?}", got[0].errors);
        iface(tmp.path(), "eth2", true, "9\n", "9\n");
        assert_eq!(names(&reader.probe()), ["eth2"], "physical again");
    }

    #[test]
    fn no_net_class_gives_no_interfaces() {
        let tmp = tempfile::tempdir().unwrap();
        let roots = Roots::new(tmp.path(), tmp.path());
        assert!(probe(&roots, &NetdevConfig::default()).is_empty());
    }
}
