//! Byte counters of the network interfaces that carry TCP traffic
//! (`<sysfs>/class/net/<if>/statistics/{rx,tx}_bytes`), so the agent can see traffic that
//! should have gone over RDMA but did not (the silent TCP fallback).
//!
//! RDMA traffic offloaded to the HCA does not pass the kernel's network stack, so these
//! counters hold the TCP/IP path only, even on the netdev of a RoCE port.

use crate::Roots;
use crate::error::ProbeError;
use crate::sysfs_io::{AttrReader, list_dir};
use serde::Serialize;
use std::path::Path;

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

/// Read the configured interfaces, or every physical one when none is configured.
pub fn probe(roots: &Roots, config: &NetdevConfig) -> Vec<NetdevReport> {
    let class = roots.sys("class/net");
    let names = if config.interfaces.is_empty() {
        match physical_interfaces(&class) {
            Ok(names) => names,
            Err(e) => {
                return vec![NetdevReport {
                    name: String::new(),
                    errors: vec![e.to_string()],
                    ..NetdevReport::default()
                }];
            }
        }
    } else {
        config.interfaces.clone()
    };
    names
        .into_iter()
        .map(|name| read_interface(&class, name, !config.interfaces.is_empty()))
        .collect()
}

fn physical_interfaces(class: &Path) -> Result<Vec<String>, ProbeError> {
    let entries = list_dir(class)?.map(|l| l.names).unwrap_or_default();
    let mut all: Vec<(String, bool)> = entries
        .into_iter()
        .filter(|name| name != "lo")
        .map(|name| {
            let virtual_ = is_virtual(&class.join(&name));
            (name, virtual_)
        })
        .collect();
    all.sort();
    let physical: Vec<String> = all
        .iter()
        .filter(|(_, v)| !v)
        .map(|(n, _)| n.clone())
        .collect();
    let mut names = if physical.is_empty() {
        all.into_iter().map(|(n, _)| n).collect()
    } else {
        physical
    };
    names.truncate(MAX_AUTO_INTERFACES);
    Ok(names)
}

/// `class/net/<if>` links into `devices/virtual/net/<if>` for software interfaces and into
/// the bus device (`devices/pci.../net/<if>`) for hardware ones.
fn is_virtual(link: &Path) -> bool {
    let target = crate::sysfs_io::canonical_cached(link).unwrap_or_else(|_| link.to_owned());
    // Judge only the part below the sysfs root (`<root>/class/net/<if>`), whatever the root.
    let root = link
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .and_then(|r| crate::sysfs_io::canonical_cached(r).ok());
    let below = root
        .as_deref()
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

fn read_interface(class: &Path, name: String, configured: bool) -> NetdevReport {
    let dir = class.join(&name);
    let mut report = NetdevReport {
        name,
        ..NetdevReport::default()
    };
    if configured && !dir.exists() {
        report.errors.push(format!(
            "{}: no such interface; fix fallback.netdevs in the config (see `ip link`)",
            dir.display()
        ));
        return report;
    }
    let stats = dir.join("statistics");
    let mut reader = AttrReader::new();
    let errors = &mut report.errors;
    report.rx_bytes = reader.parsed(
        &stats.join("rx_bytes"),
        "a decimal byte counter",
        errors,
        parse_counter,
    );
    report.tx_bytes = reader.parsed(
        &stats.join("tx_bytes"),
        "a decimal byte counter",
        errors,
        parse_counter,
    );
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

    #[test]
    fn no_net_class_gives_no_interfaces() {
        let tmp = tempfile::tempdir().unwrap();
        let roots = Roots::new(tmp.path(), tmp.path());
        assert!(probe(&roots, &NetdevConfig::default()).is_empty());
    }
}
