//! What a process sees of its own container: its `RLIMIT_MEMLOCK`, whether it holds
//! `CAP_IPC_LOCK`, and which RDMA device nodes (`/dev/infiniband/uverbsN`) it was given.
//! `fabricgate preflight` uses these inside a worker pod. Parsers are pure; the readers go
//! through [`Roots`] (`<procfs>/self/limits`, `<procfs>/self/status`,
//! `<sysfs>/class/infiniband_verbs`, `<devfs>/infiniband`).

use crate::error::{ProbeError, Result};
use crate::roots::Roots;
use serde::Serialize;
use std::path::PathBuf;

/// A resource limit value: a number of bytes or `unlimited`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Limit {
    Bytes(u64),
    Unlimited,
}

impl Limit {
    /// Whether this limit is at least `want`.
    pub fn at_least(self, want: Limit) -> bool {
        match (self, want) {
            (Limit::Unlimited, _) => true,
            (Limit::Bytes(_), Limit::Unlimited) => false,
            (Limit::Bytes(have), Limit::Bytes(want)) => have >= want,
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Unlimited => f.write_str("unlimited"),
            Limit::Bytes(b) => f.write_str(&format_bytes(*b)),
        }
    }
}

/// `65536` → `64 KiB`; exact multiples only, otherwise plain bytes.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    for (size, unit) in UNITS {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{} {unit}", bytes / size);
        }
    }
    format!("{bytes} bytes")
}

impl std::str::FromStr for Limit {
    type Err = String;

    /// `unlimited`, a number of bytes, or a number with `K`/`KiB`/`M`/`MiB`/`G`/`GiB`/`T`/`TiB`
    /// (binary multiples, as `ulimit -l` and the kernel count).
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let text = s.trim();
        let bad = || {
            format!(
                "{s:?} is not a memory size; write \"unlimited\", bytes, or e.g. \"64KiB\", \"1GiB\""
            )
        };
        if text.eq_ignore_ascii_case("unlimited") || text.eq_ignore_ascii_case("infinity") {
            return Ok(Limit::Unlimited);
        }
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (digits, unit) = text.split_at(split);
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let shift = match unit.trim() {
            "" | "B" => 0,
            "K" | "k" | "KiB" | "KB" | "kB" => 10,
            "M" | "MiB" | "MB" => 20,
            "G" | "GiB" | "GB" => 30,
            "T" | "TiB" | "TB" => 40,
            _ => return Err(bad()),
        };
        n.checked_mul(1u64 << shift)
            .map(Limit::Bytes)
            .ok_or_else(bad)
    }
}

/// Soft and hard `RLIMIT_MEMLOCK` as `/proc/self/limits` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemlockLimit {
    pub soft: Limit,
    pub hard: Limit,
}

/// The `Max locked memory` line of `/proc/<pid>/limits`:
/// `Max locked memory         65536                65536                bytes`.
pub fn parse_memlock(limits: &str) -> Option<MemlockLimit> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let mut fields = line["Max locked memory".len()..].split_whitespace();
    let value = |f: Option<&str>| match f? {
        "unlimited" => Some(Limit::Unlimited),
        n => n.parse().ok().map(Limit::Bytes),
    };
    Some(MemlockLimit {
        soft: value(fields.next())?,
        hard: value(fields.next())?,
    })
}

/// The `CapEff:` line of `/proc/<pid>/status` (a tab, then hex): the effective capability
/// set.
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
}

/// `CAP_IPC_LOCK` (capability 14): pinning memory is not bounded by `RLIMIT_MEMLOCK`.
pub const CAP_IPC_LOCK: u32 = 14;

/// This process's memlock limit and whether it holds `CAP_IPC_LOCK`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemlockReport {
    /// `None` when `<procfs>/self/limits` could not be read or parsed.
    pub limit: Option<MemlockLimit>,
    /// `None` when `<procfs>/self/status` could not be read or parsed.
    pub ipc_lock: Option<bool>,
    pub errors: Vec<String>,
}

/// Read `<procfs>/self/limits` and `<procfs>/self/status`.
pub fn memlock(roots: &Roots) -> MemlockReport {
    let mut errors = Vec::new();
    let mut read = |rel: &str| {
        let path = roots.proc(rel);
        match std::fs::read_to_string(&path) {
            Ok(text) => Some((path, text)),
            Err(e) => {
                errors.push(ProbeError::read(&path, e).to_string());
                None
            }
        }
    };
    let limits = read("self/limits");
    let status = read("self/status");
    let limit = limits.and_then(|(path, text)| {
        let parsed = parse_memlock(&text);
        if parsed.is_none() {
            errors.push(ProbeError::parse(&path, "", "a \"Max locked memory\" line").to_string());
        }
        parsed
    });
    let ipc_lock = status.and_then(|(path, text)| {
        let parsed = parse_cap_eff(&text).map(|caps| caps & (1 << CAP_IPC_LOCK) != 0);
        if parsed.is_none() {
            errors.push(ProbeError::parse(&path, "", "a \"CapEff:\" line").to_string());
        }
        parsed
    });
    MemlockReport {
        limit,
        ipc_lock,
        errors,
    }
}

/// One RDMA device's user-space verbs node and whether this container has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceNode {
    /// RDMA device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// `uverbs0`
    pub uverbs: String,
    /// `/dev/infiniband/uverbs0` (under the devfs root).
    pub path: PathBuf,
    /// The node exists in this container's `/dev`.
    pub present: bool,
}

/// Every `<sysfs>/class/infiniband_verbs/uverbsN` with its `ibdev`, and whether
/// `<devfs>/infiniband/uverbsN` exists: sysfs is not namespaced, so a container sees every
/// device of the host there, but only the device nodes a device plugin injected in `/dev`.
///
/// # Errors
/// [`ProbeError::ReadDir`] when `class/infiniband_verbs` exists but cannot be listed.
/// An absent folder (no `ib_uverbs` module) is an empty list.
pub fn device_nodes(roots: &Roots) -> Result<Vec<DeviceNode>> {
    let dir = roots.sys("class/infiniband_verbs");
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(ProbeError::ReadDir { path: dir, source }),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let uverbs = entry.file_name().to_string_lossy().into_owned();
        if !uverbs.starts_with("uverbs") {
            continue; // abi_version
        }
        let Ok(ibdev) = std::fs::read_to_string(entry.path().join("ibdev")) else {
            continue; // vanished meanwhile, or unreadable: not a device we can name
        };
        let path = roots.dev(format!("infiniband/{uverbs}"));
        out.push(DeviceNode {
            device: ibdev.trim().to_owned(),
            present: path.exists(),
            uverbs,
            path,
        });
    }
    out.sort_by(|a, b| a.device.cmp(&b.device));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max locked memory         65536                65536                bytes     \n\
Max address space         unlimited            unlimited            bytes     \n";

    #[test]
    fn memlock_line_parses_numbers_and_unlimited() {
        assert_eq!(
            parse_memlock(LIMITS),
            Some(MemlockLimit {
                soft: Limit::Bytes(65536),
                hard: Limit::Bytes(65536)
            })
        );
        let unlimited = LIMITS.replace(
            "65536                65536",
            "unlimited            unlimited",
        );
        assert_eq!(
            parse_memlock(&unlimited).map(|m| m.soft),
            Some(Limit::Unlimited)
        );
        assert_eq!(parse_memlock("Max cpu time unlimited unlimited"), None);
        assert_eq!(parse_memlock("Max locked memory  lots  more bytes"), None);
    }

    #[test]
    fn cap_eff_finds_ipc_lock() {
        let status = "Name:\tfabricgate\nCapInh:\t0\nCapEff:\t0000000000004000\n";
        let caps = parse_cap_eff(status).unwrap();
        assert_ne!(caps & (1 << CAP_IPC_LOCK), 0);
        assert_eq!(
            parse_cap_eff("CapEff:\t00000000a80425fb\n"),
            Some(0xa804_25fb)
        );
        assert_eq!(parse_cap_eff("CapEff:\tzz\n"), None);
        assert_eq!(parse_cap_eff("Name: x\n"), None);
    }

    #[test]
    fn sizes_parse_and_print_in_binary_units() {
        assert_eq!("64KiB".parse(), Ok(Limit::Bytes(65536)));
        assert_eq!("64 K".parse(), Ok(Limit::Bytes(65536)));
        assert_eq!("1GiB".parse(), Ok(Limit::Bytes(1 << 30)));
        assert_eq!("4096".parse(), Ok(Limit::Bytes(4096)));
        assert_eq!("unlimited".parse(), Ok(Limit::Unlimited));
        assert!("lots".parse::<Limit>().is_err());
        assert!("12XB".parse::<Limit>().is_err());
        assert!("99999999999999T".parse::<Limit>().is_err());
        assert_eq!(Limit::Bytes(65536).to_string(), "64 KiB");
        assert_eq!(Limit::Bytes(8 << 20).to_string(), "8 MiB");
        assert_eq!(Limit::Bytes(1000).to_string(), "1000 bytes");
        assert!(Limit::Unlimited.at_least(Limit::Unlimited));
        assert!(!Limit::Bytes(u64::MAX).at_least(Limit::Unlimited));
        assert!(Limit::Bytes(65536).at_least(Limit::Bytes(65536)));
        assert!(!Limit::Bytes(65535).at_least(Limit::Bytes(65536)));
    }

    #[test]
    fn memlock_report_reads_through_the_proc_root() {
        let dir = tempfile::tempdir().unwrap();
        let proc = dir.path().join("proc");
        std::fs::create_dir_all(proc.join("self")).unwrap();
        std::fs::write(proc.join("self/limits"), LIMITS).unwrap();
        std::fs::write(proc.join("self/status"), "CapEff:\t0000000000000000\n").unwrap();
        let r = memlock(&Roots::new(dir.path().join("sys"), &proc));
        assert_eq!(r.limit.map(|l| l.soft), Some(Limit::Bytes(65536)));
        assert_eq!(r.ipc_lock, Some(false));
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        // Missing files: None, and the error names the path.
        let r = memlock(&Roots::new(dir.path(), dir.path()));
        assert_eq!(r.limit, None);
        assert_eq!(r.ipc_lock, None);
        assert!(r.errors[0].contains("self/limits"), "{:?}", r.errors);
    }

    #[test]
    fn device_nodes_pair_sysfs_with_dev() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        let dev = dir.path().join("dev");
        for (uverbs, ibdev) in [("uverbs0", "mlx5_0"), ("uverbs1", "mlx5_1")] {
            let d = sys.join("class/infiniband_verbs").join(uverbs);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("ibdev"), format!("{ibdev}\n")).unwrap();
        }
        std::fs::write(sys.join("class/infiniband_verbs/abi_version"), "6\n").unwrap();
        std::fs::create_dir_all(dev.join("infiniband")).unwrap();
        std::fs::write(dev.join("infiniband/uverbs1"), "").unwrap();
        let roots = Roots::new(&sys, dir.path()).with_devfs(&dev);
        let nodes = device_nodes(&roots).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].device, "mlx5_0");
        assert!(!nodes[0].present);
        assert_eq!(nodes[0].path, dev.join("infiniband/uverbs0"));
        assert_eq!(nodes[1].uverbs, "uverbs1");
        assert!(nodes[1].present);
        // No ib_uverbs at all: nothing, not an error.
        assert!(
            device_nodes(&Roots::new(dir.path(), dir.path()))
                .unwrap()
                .is_empty()
        );
    }
}
