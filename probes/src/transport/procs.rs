//! What procfs tells about the pods' processes and their network namespaces, through
//! [`Roots`]: which processes each pod has, the namespace each is in, a process's socket
//! inodes, a namespace's own addresses and routes (`/proc/<pid>/net/` shows the namespace of
//! `<pid>`); and, without the host PID namespace, which pod cgroups exist (`<sysfs>/fs/cgroup`).
//! Thin readers beside pure parsers of the kernel's text formats.

use super::cgroup::{self, CgroupOwner};
use crate::Roots;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// True when `<procfs>` is the host's PID namespace: only there is `kthreadd`, the kernel
/// threads' parent, PID 2.
pub fn in_host_pid_namespace(roots: &Roots) -> bool {
    std::fs::read_to_string(roots.proc("2/comm")).is_ok_and(|c| c.trim_end() == "kthreadd")
}

/// The processes of every pod, by pod UID (PIDs sorted); a process that exits meanwhile is
/// left out. Also the `kubepods` paths of a shape not known (for a note).
pub fn pod_processes(roots: &Roots) -> (BTreeMap<String, Vec<u32>>, BTreeSet<String>) {
    let mut pods: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut unrecognized = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(roots.procfs_root()) else {
        return (pods, unrecognized);
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    for pid in pids {
        let Ok(text) = std::fs::read_to_string(roots.proc(format!("{pid}/cgroup"))) else {
            continue;
        };
        match cgroup::parse_proc_cgroup(&text) {
            CgroupOwner::Pod(pod) => pods.entry(pod.pod_uid).or_default().push(pid),
            CgroupOwner::Unrecognized { path } => {
                unrecognized.insert(path);
            }
            CgroupOwner::Host => {}
        }
    }
    (pods, unrecognized)
}

/// The UIDs of the pod cgroups under `<sysfs>/fs/cgroup` (v2, or each v1 hierarchy; systemd
/// and cgroupfs drivers), walking only the `kubepods` part of the tree.
pub fn pod_cgroups(roots: &Roots) -> BTreeSet<String> {
    // Far more than the kubelet's pods and QoS levels; a bound on a strange tree.
    const MOST_DIRECTORIES: usize = 100_000;
    let mut uids = BTreeSet::new();
    let mut stack: Vec<(PathBuf, String, usize)> = vec![(roots.sys("fs/cgroup"), String::new(), 0)];
    let mut visited = 0usize;
    while let Some((dir, rel, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            visited += 1;
            if visited > MOST_DIRECTORIES {
                return uids;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = format!("{rel}/{name}");
            if let Some(pod) = cgroup::parse_path(&path) {
                uids.insert(pod.pod_uid);
                continue;
            }
            // The hierarchies of v1 at the top, then only kubepods and its QoS levels.
            let descend = depth == 0
                || name.contains("kubepods")
                || matches!(name.as_str(), "besteffort" | "burstable");
            if descend && depth < 6 {
                stack.push((entry.path(), path, depth + 1));
            }
        }
    }
    uids
}

/// `<procfs>/<pid>/ns/net`.
pub fn netns_path(roots: &Roots, pid: &str) -> PathBuf {
    roots.proc(format!("{pid}/ns/net"))
}

/// The identity of a process's network namespace: the inode of `ns/net` (what `ip netns
/// identify` compares); `pid` may be `self`.
///
/// # Errors
/// The process exited (`NotFound`), or its namespace may not be looked at (`PermissionDenied`).
pub fn netns_id(roots: &Roots, pid: &str) -> io::Result<u64> {
    std::fs::metadata(netns_path(roots, pid)).map(|m| m.ino())
}

/// The socket inodes a process holds open (`socket:[inode]` links in `<pid>/fd`); a process
/// gone, or fds that cannot be listed, give none.
pub fn socket_inodes(roots: &Roots, pid: u32, into: &mut BTreeSet<u32>) {
    let Ok(entries) = std::fs::read_dir(roots.proc(format!("{pid}/fd"))) else {
        return;
    };
    for entry in entries.flatten() {
        if let Ok(target) = std::fs::read_link(entry.path()) {
            into.extend(target.to_str().and_then(socket_inode));
        }
    }
}

/// `socket:[12345]` → 12345.
pub fn socket_inode(link: &str) -> Option<u32> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Most bytes read of one `<pid>/net/` file: a namespace's routes and addresses are a few
/// kilobytes; a process with `CAP_NET_ADMIN` in its namespace can make them gigabytes (a
/// million routes), and the agent reads no more of them than this (8,000 routes or so: the
/// rest of a longer table is not looked at, and traffic over those routes names no interface).
pub const MAX_NET_FILE_BYTES: u64 = 1024 * 1024;

/// `<pid>/net/<file>`, at most [`MAX_NET_FILE_BYTES`] of it, cut back to its last whole
/// line; `None` when it cannot be read.
pub fn read_net_file(roots: &Roots, pid: &str, file: &str) -> Option<String> {
    use std::io::Read;
    let f = std::fs::File::open(roots.proc(format!("{pid}/net/{file}"))).ok()?;
    let mut bytes = Vec::new();
    f.take(MAX_NET_FILE_BYTES).read_to_end(&mut bytes).ok()?;
    if bytes.len() as u64 == MAX_NET_FILE_BYTES {
        let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        bytes.truncate(whole);
    }
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The host's addresses, seen from the agent's own network namespace (`self`: the agent runs
/// with `hostNetwork`): its IPv4 `LOCAL` routes (`net/fib_trie`) and IPv6 addresses
/// (`net/if_inet6`), each read through [`read_net_file`]; what cannot be read adds none. A pod's
/// own addresses come from its sockets instead (the sampler), so no pod's table is read whole.
pub fn local_addresses(roots: &Roots, pid: &str, into: &mut BTreeSet<IpAddr>) {
    if let Some(text) = read_net_file(roots, pid, "fib_trie") {
        into.extend(parse_fib_trie_local(&text).into_iter().map(IpAddr::V4));
    }
    if let Some(text) = read_net_file(roots, pid, "if_inet6") {
        into.extend(parse_if_inet6(&text).into_iter().map(IpAddr::V6));
    }
}

/// The addresses of `/proc/net/fib_trie` whose entry says `host LOCAL`: an address line
/// (`|-- 10.0.0.5`) followed by its routes (`/32 host LOCAL`).
pub fn parse_fib_trie_local(text: &str) -> BTreeSet<Ipv4Addr> {
    let mut out = BTreeSet::new();
    let mut last: Option<Ipv4Addr> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(address) = line.strip_prefix("|-- ") {
            last = address.parse().ok();
        } else if line.starts_with('/') && line.ends_with("host LOCAL") {
            out.extend(last);
        }
    }
    out
}

/// The addresses of `/proc/net/if_inet6` (first column, 32 hex digits).
pub fn parse_if_inet6(text: &str) -> BTreeSet<Ipv6Addr> {
    text.lines()
        .filter_map(|l| parse_ipv6_hex(l.split_whitespace().next()?))
        .collect()
}

fn parse_ipv6_hex(hex: &str) -> Option<Ipv6Addr> {
    u128::from_str_radix(hex, 16)
        .ok()
        .filter(|_| hex.len() == 32)
        .map(Ipv6Addr::from)
}

/// One route of a namespace: destination network, prefix length, interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub destination: IpAddr,
    pub prefix: u8,
    pub interface: String,
}

/// The routes of the namespace of `pid` (`net/route`, `net/ipv6_route`, each read through
/// [`read_net_file`]); none when unreadable.
pub fn routes(roots: &Roots, pid: &str) -> Vec<Route> {
    let read = |file: &str| read_net_file(roots, pid, file);
    let mut out = read("route").map(|t| parse_route(&t)).unwrap_or_default();
    out.extend(
        read("ipv6_route")
            .map(|t| parse_ipv6_route(&t))
            .unwrap_or_default(),
    );
    out
}

/// `RTF_UP` and `RTF_REJECT` of `linux/route.h`.
const RTF_UP: u32 = 0x1;
const RTF_REJECT: u32 = 0x200;

/// `/proc/net/route`: `Iface Destination Gateway Flags RefCnt Use Metric Mask ...`, the
/// addresses as the kernel's in-memory `__be32` printed in hex (so read back native-endian).
pub fn parse_route(text: &str) -> Vec<Route> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let hex = |i: usize| u32::from_str_radix(f.get(i)?, 16).ok();
            let flags = hex(3)?;
            if flags & RTF_UP == 0 || flags & RTF_REJECT != 0 {
                return None;
            }
            let destination = Ipv4Addr::from(hex(1)?.to_ne_bytes());
            let mask = u32::from_be_bytes(hex(7)?.to_ne_bytes());
            Some(Route {
                destination: IpAddr::V4(destination),
                prefix: u8::try_from(mask.leading_ones()).ok()?,
                interface: (*f.first()?).to_owned(),
            })
        })
        .collect()
}

/// `/proc/net/ipv6_route`: `dest plen src splen nexthop metric refcnt use flags iface`.
pub fn parse_ipv6_route(text: &str) -> Vec<Route> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(8)?, 16).ok()?;
            if flags & RTF_UP == 0 || flags & RTF_REJECT != 0 {
                return None;
            }
            Some(Route {
                destination: IpAddr::V6(parse_ipv6_hex(f.first()?)?),
                prefix: u8::from_str_radix(f.get(1)?, 16).ok()?,
                interface: (*f.get(9)?).to_owned(),
            })
        })
        .collect()
}

/// The interface of the longest-prefix route to `address` (`lo` never: loopback is not
/// inter-node); `None` when no route matches.
pub fn interface_for(routes: &[Route], address: IpAddr) -> Option<&str> {
    routes
        .iter()
        .filter(|r| r.interface != "lo" && in_network(address, r.destination, r.prefix))
        .max_by_key(|r| r.prefix)
        .map(|r| r.interface.as_str())
}

/// `address` is in `network/prefix` (same family only).
pub fn in_network(address: IpAddr, network: IpAddr, prefix: u8) -> bool {
    let masked = |bits: u128, width: u32| {
        let keep = u32::from(prefix).min(width);
        if keep == 0 { 0 } else { bits >> (width - keep) }
    };
    match (address, network) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            masked(u32::from(a).into(), 32) == masked(u32::from(n).into(), 32)
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => masked(a.into(), 128) == masked(n.into(), 128),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/net/route` and `/proc/net/ipv6_route` of this build host, byte for byte.
    const ROUTE: &str = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT                                                       \neth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0                                                                               \neth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0                                                                               \n";
    const IPV6_ROUTE: &str = "fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0\n00000000000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo\n00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n";
    const IF_INET6: &str = "00000000000000000000000000000001 01 80 10 80       lo\nfd000000000000000000000000000002 04 40 00 82     eth0\n";

    #[test]
    fn routes_pick_the_longest_prefix_and_never_lo() {
        let mut routes = parse_route(ROUTE);
        assert_eq!(routes.len(), 2);
        assert_eq!(
            routes[1].destination,
            "192.0.2.0".parse::<IpAddr>().unwrap()
        );
        assert_eq!(routes[1].prefix, 24);
        routes.extend(parse_ipv6_route(IPV6_ROUTE));
        // The reject route (flags 0x200) is left out.
        assert_eq!(routes.len(), 4);
        routes.push(Route {
            destination: "10.1.0.0".parse().unwrap(),
            prefix: 16,
            interface: "ib0".into(),
        });
        let via = |a: &str| interface_for(&routes, a.parse().unwrap());
        assert_eq!(via("10.1.7.9"), Some("ib0"));
        assert_eq!(via("192.0.2.77"), Some("eth0"));
        assert_eq!(via("8.8.8.8"), Some("eth0"));
        assert_eq!(via("fd00::9"), Some("eth0"));
        assert_eq!(via("::1"), None);
    }

    #[test]
    fn local_addresses_of_fib_trie_and_if_inet6() {
        let trie = "Local:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n           |-- 127.0.0.1\n              /32 host LOCAL\n           |-- 192.0.2.0\n              /24 link UNICAST\n           |-- 192.0.2.2\n              /32 host LOCAL\n        |-- 192.0.2.255\n           /32 link BROADCAST\n";
        let v4: Vec<String> = parse_fib_trie_local(trie)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(v4, ["127.0.0.1", "192.0.2.2"]);
        let v6: Vec<String> = parse_if_inet6(IF_INET6)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(v6, ["::1", "fd00::2"]);
    }

    #[test]
    fn socket_links_and_networks() {
        assert_eq!(socket_inode("socket:[161823]"), Some(161_823));
        assert_eq!(socket_inode("pipe:[161823]"), None);
        assert_eq!(socket_inode("socket:[x]"), None);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(in_network(ip("10.244.3.7"), ip("10.244.3.0"), 24));
        assert!(!in_network(ip("10.244.4.7"), ip("10.244.3.0"), 24));
        assert!(in_network(ip("1.2.3.4"), ip("0.0.0.0"), 0));
        assert!(!in_network(ip("fd00::1"), ip("10.0.0.0"), 8));
        assert!(in_network(ip("fd00::1:2"), ip("fd00::"), 64));
    }

    /// This process: the live procfs answers (its namespace, its sockets).
    #[test]
    fn the_live_procfs_answers() {
        let roots = Roots::default();
        assert!(netns_id(&roots, "self").is_ok());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut inodes = BTreeSet::new();
        socket_inodes(&roots, std::process::id(), &mut inodes);
        assert!(!inodes.is_empty(), "the listener's socket");
        drop(listener);
    }
}
