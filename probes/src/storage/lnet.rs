//! LNet, the network under a Lustre client: which network each import's server NID is on,
//! and whether the node's own LNet interfaces (NIs) are up.
//!
//! A client whose RDMA network (`o2ib`) fails can keep working over another LNet network
//! (`tcp`) when the servers list NIDs on both: the imports' `current_connection` moves to
//! `10.2.1.4@tcp`, the mounts stay healthy and only the bandwidth tells. Files read (the
//! formats mirror lustre-release `lnet/lnet/router_proc.c`, `proc_lnet_nis`):
//!
//! - `<sysfs>/kernel/debug/lnet/nis` (Lustre 2.9 and later, debugfs), or
//!   `<procfs>/sys/lnet/nis` (older clients, sysctl): a header line, then one line per NI and
//!   CPU partition: `"%-24s %6s %5d %4d %4d %4d %5d %5d %5d\n"` of nid, status (`up` or
//!   `down`), alive, refs, peer, rtr, max, tx, min.

use crate::roots::Roots;
use serde::Serialize;

/// One local LNet interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LnetNi {
    /// `10.1.1.21@o2ib`
    pub nid: String,
    /// `o2ib`, `tcp1`, `lo`
    pub net: String,
    /// `status` was `up` on every line of this NI.
    pub up: bool,
}

/// The node's LNet interfaces, in file order, one entry per NID; `None` when neither file
/// exists or can be read (debugfs not mounted, LNet not loaded).
pub fn probe(roots: &Roots) -> Option<Vec<LnetNi>> {
    [
        roots.sys("kernel/debug/lnet/nis"),
        roots.proc("sys/lnet/nis"),
    ]
    .iter()
    .find_map(|path| crate::sysfs_io::read_to_string(path).ok())
    .map(|text| parse_nis(&text))
}

/// Parse the `nis` file. Lines that are not `NID STATUS ...` (the header among them) are
/// skipped; an NI listed once per CPU partition is one entry, down if any line says so.
pub fn parse_nis(text: &str) -> Vec<LnetNi> {
    let mut out: Vec<LnetNi> = Vec::new();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(nid), Some(status)) = (fields.next(), fields.next()) else {
            continue;
        };
        let up = match status {
            "up" => true,
            "down" => false,
            _ => continue,
        };
        let Some(net) = nid_net(nid) else {
            continue;
        };
        match out.iter_mut().find(|ni| ni.nid == nid) {
            Some(ni) => ni.up &= up,
            None => out.push(LnetNi {
                nid: nid.to_owned(),
                net: net.to_owned(),
                up,
            }),
        }
    }
    out
}

/// `10.1.1.3@o2ib` → `o2ib`; `None` without a network part.
pub fn nid_net(nid: &str) -> Option<&str> {
    let (_, net) = nid.rsplit_once('@')?;
    (!net.is_empty()).then_some(net)
}

/// Whether LNet network `net` is one that `required` names: `o2ib` names every network of
/// that LND (`o2ib`, `o2ib0`, `o2ib1`, ...); `o2ib1` names that one network (`o2ib` and
/// `o2ib0` are the same network).
pub fn net_matches(required: &str, net: &str) -> bool {
    let (want_lnd, want_num) = split_net(required);
    let (lnd, num) = split_net(net);
    want_lnd == lnd && want_num.is_none_or(|w| w == num.unwrap_or(0))
}

/// `o2ib1` → (`o2ib`, Some(1)); `tcp` → (`tcp`, None).
fn split_net(net: &str) -> (&str, Option<u32>) {
    let lnd = net.trim_end_matches(|c: char| c.is_ascii_digit());
    (lnd, net[lnd.len()..].parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As `proc_lnet_nis` prints it on a two-partition client (one line per NI and CPT).
    const NIS: &str = "\
nid                      status alive refs peer  rtr   max    tx   min
0@lo                         up     0    2    0    0     0     0     0
0@lo                         up     0    0    0    0     0     0     0
10.1.1.21@o2ib               up    -1    2    8    0    64    64    56
10.1.1.21@o2ib             down    -1    1    8    0    64    64    48
10.2.1.21@tcp1               up    -1    1    8    0   256   256   252
";

    #[test]
    fn nis_one_entry_per_nid_down_if_any_partition_is() {
        let nis = parse_nis(NIS);
        let got: Vec<(&str, &str, bool)> = nis
            .iter()
            .map(|n| (n.nid.as_str(), n.net.as_str(), n.up))
            .collect();
        assert_eq!(
            got,
            vec![
                ("0@lo", "lo", true),
                ("10.1.1.21@o2ib", "o2ib", false),
                ("10.2.1.21@tcp1", "tcp1", true),
            ]
        );
        assert!(parse_nis("").is_empty());
        assert!(parse_nis("nid status\ngarbage\n10.0.0.1 up\n").is_empty());
    }

    #[test]
    fn networks_match_by_lnd_or_exact_number() {
        assert_eq!(nid_net("10.1.1.3@o2ib"), Some("o2ib"));
        assert_eq!(nid_net("[fe80::1]@tcp"), Some("tcp"));
        assert_eq!(nid_net("10.1.1.3"), None);
        assert_eq!(nid_net("10.1.1.3@"), None);
        assert!(net_matches("o2ib", "o2ib"));
        assert!(net_matches("o2ib", "o2ib1"));
        assert!(net_matches("o2ib0", "o2ib"));
        assert!(net_matches("o2ib1", "o2ib1"));
        assert!(!net_matches("o2ib1", "o2ib"));
        assert!(!net_matches("o2ib", "tcp"));
        assert!(!net_matches("o2ib", "tcp0"));
        assert!(!net_matches("tcp", "o2ib"));
    }

    #[test]
    fn debugfs_first_then_procfs_then_none() {
        let dir = tempfile::tempdir().unwrap();
        let roots = Roots::new(dir.path().join("sys"), dir.path().join("proc"));
        assert_eq!(probe(&roots), None);
        std::fs::create_dir_all(dir.path().join("proc/sys/lnet")).unwrap();
        std::fs::write(dir.path().join("proc/sys/lnet/nis"), NIS).unwrap();
        assert_eq!(probe(&roots).map(|n| n.len()), Some(3));
        std::fs::create_dir_all(dir.path().join("sys/kernel/debug/lnet")).unwrap();
        let header_only = format!("{}\n", NIS.lines().next().unwrap());
        std::fs::write(dir.path().join("sys/kernel/debug/lnet/nis"), header_only).unwrap();
        assert_eq!(probe(&roots), Some(Vec::new()), "debugfs wins");
    }
}
