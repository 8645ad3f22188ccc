//! Shared storage: the mount table, hang-proof statfs, Lustre client health.
//!
//! Per probe: read `<procfs>/self/mountinfo`; pick the mounts to check (the required ones,
//! plus every Lustre mount when `all_lustre`); statfs them all at once on worker threads with
//! one deadline ([`statfs::StatfsPool`]); read the Lustre client's `health_check` and import
//! states ([`lustre`]). Only statfs touches the mounts themselves; everything else reads
//! procfs/sysfs, so a dead file server can delay a probe by at most the statfs timeout.

mod collector;
pub mod lnet;
pub mod lustre;
pub mod mountinfo;
pub mod statfs;

use crate::roots::Roots;
use mountinfo::{MountEntry, MountTable, MountTableFile};
use serde::Serialize;
use statfs::{LL_SUPER_MAGIC, Outcome, StatfsInfo, StatfsPool};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use collector::{NAME, of, set};
pub use lnet::LnetNi;
pub use lustre::{Import, LustreClient, LustreHealth};

/// Default for `lustre.statfs_timeout`.
pub const DEFAULT_STATFS_TIMEOUT: Duration = Duration::from_secs(5);

/// What storage must be probed (derived from the requirements file).
#[derive(Debug, Clone, PartialEq)]
pub struct StorageConfig {
    /// Mounts that must be present and healthy, in the order they are reported.
    pub required: Vec<MountSpec>,
    /// Also check every Lustre mount found in the mount table.
    pub all_lustre: bool,
    /// How long one probe waits for statfs.
    pub statfs_timeout: Duration,
    /// Capacity floor (percent of blocks and of inodes free) for Lustre mounts found through
    /// `all_lustre`; required mounts carry their own.
    pub lustre_min_free_percent: f64,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            required: Vec::new(),
            all_lustre: true,
            statfs_timeout: DEFAULT_STATFS_TIMEOUT,
            lustre_min_free_percent: 0.0,
        }
    }
}

/// One mount to check.
#[derive(Debug, Clone, PartialEq)]
pub struct MountSpec {
    pub path: PathBuf,
    /// Required file-system type as the mount table names it (`lustre`, `nfs4`); `None`: any.
    pub fstype: Option<String>,
    /// Read-only is a problem.
    pub writable: bool,
    /// Percent of blocks and of inodes that must be free; 0 disables the check.
    pub min_free_percent: f64,
}

impl MountSpec {
    /// A required Lustre mount: type `lustre`, writable.
    pub fn lustre(path: impl Into<PathBuf>, min_free_percent: f64) -> Self {
        Self {
            path: path.into(),
            fstype: Some("lustre".into()),
            writable: true,
            min_free_percent,
        }
    }

    fn is_lustre(&self) -> bool {
        self.fstype.as_deref() == Some("lustre")
    }
}

/// The outcome for one mount. Serialized names are part of `fabricgate check --format json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MountStatus {
    Ok,
    /// Not in the mount table.
    Missing,
    /// statfs did not return within the timeout (or an earlier call is still stuck).
    Hung,
    /// Mounted with another file-system type than required.
    WrongType,
    /// Read-only where it must be writable.
    ReadOnly,
    /// Less free space or inodes than `min_free_percent`.
    Full,
    /// statfs failed, or the mount table could not be read.
    Error,
}

impl MountStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Missing => "missing",
            Self::Hung => "hung",
            Self::WrongType => "wrong_type",
            Self::ReadOnly => "read_only",
            Self::Full => "full",
            Self::Error => "error",
        }
    }
}

/// Size and inode figures from statfs. Inode fields are `None` where the file system does
/// not count inodes (`f_files` is 0).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Capacity {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Free to unprivileged users.
    pub available_bytes: u64,
    /// `available / total` in percent; `None` for a zero-sized file system.
    pub available_percent: Option<f64>,
    pub total_inodes: Option<u64>,
    pub free_inodes: Option<u64>,
    pub free_inodes_percent: Option<f64>,
}

impl Capacity {
    fn from_statfs(s: &StatfsInfo) -> Self {
        let percent =
            |part: u64, whole: u64| (whole > 0).then(|| part as f64 * 100.0 / whole as f64);
        let inodes = s.files > 0;
        Self {
            total_bytes: s.blocks.saturating_mul(s.block_size),
            free_bytes: s.blocks_free.saturating_mul(s.block_size),
            available_bytes: s.blocks_available.saturating_mul(s.block_size),
            available_percent: percent(s.blocks_available, s.blocks),
            total_inodes: inodes.then_some(s.files),
            free_inodes: inodes.then_some(s.files_free),
            free_inodes_percent: percent(s.files_free, s.files),
        }
    }
}

/// One checked mount.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MountReport {
    /// The mount point as configured (or as found, for discovered Lustre mounts).
    pub path: String,
    /// The type the mount table gives; `None` when not mounted.
    pub fstype: Option<String>,
    pub status: MountStatus,
    /// What is wrong and what to do, or a short summary when `ok`.
    pub message: String,
    /// Required by the config (`lustre.mounts` or `mounts`), rather than found by
    /// `lustre.all_lustre`.
    pub required: bool,
    pub expected_fstype: Option<String>,
    /// Mount source (`10.1.1.1@o2ib:/scratch`).
    pub source: Option<String>,
    /// Lustre file-system name from the source (`scratch`).
    pub lustre_fsname: Option<String>,
    /// From mount options or statfs `ST_RDONLY`; `None` when not mounted.
    pub read_only: Option<bool>,
    /// statfs `f_type`, hex (`0x0bd00bd0`); `None` without a statfs answer.
    pub fs_magic: Option<String>,
    pub capacity: Option<Capacity>,
    /// How long statfs took; `None` when it did not return.
    pub statfs_seconds: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct StorageReport {
    /// Required mounts first (in config order), then discovered Lustre mounts.
    pub mounts: Vec<MountReport>,
    pub client: LustreClient,
    /// Entries in the mount table.
    pub mount_table_entries: usize,
    /// statfs calls still outstanding after this probe (one per hung mount at most).
    pub stuck_statfs: usize,
    /// Problems not tied to one mount (the mount table unreadable, unparsable lines).
    pub errors: Vec<String>,
}

impl StorageReport {
    /// The required mounts the mount table does not have.
    pub fn required_missing(&self) -> Vec<String> {
        self.mounts
            .iter()
            .filter(|m| m.required && m.status == MountStatus::Missing)
            .map(|m| m.path.clone())
            .collect()
    }

    /// Every checked mount is `ok`.
    pub fn all_ok(&self) -> bool {
        self.mounts.iter().all(|m| m.status == MountStatus::Ok)
    }
}

/// Keeps the statfs workers alive across probes: a call stuck on a hung mount is never
/// repeated while it lasts, so the daemon must keep one `StorageProber` for its whole life.
#[derive(Debug)]
pub struct StorageProber {
    config: StorageConfig,
    pool: StatfsPool,
    /// The mount table, re-parsed only when the kernel says it changed.
    mountinfo: MountTableFile,
}

struct Target {
    spec: MountSpec,
    required: bool,
}

impl StorageProber {
    pub fn new(config: StorageConfig) -> Self {
        Self {
            config,
            pool: StatfsPool::new(),
            mountinfo: MountTableFile::default(),
        }
    }

    pub fn config(&self) -> &StorageConfig {
        &self.config
    }

    /// How many times the mount table was read and parsed (once per change of the mount
    /// namespace on procfs; on every probe for a table that is a plain file).
    pub fn mount_table_parses(&self) -> u64 {
        self.mountinfo.parses()
    }

    /// statfs calls started by earlier probes that are still stuck.
    pub fn stuck_statfs(&mut self) -> usize {
        self.pool.stuck()
    }

    /// One probe. Returns within `statfs_timeout` plus the time to read procfs/sysfs, however
    /// many mounts hang.
    pub fn probe(&mut self, roots: &Roots) -> StorageReport {
        let mut report = StorageReport::default();
        let mountinfo_path = roots.proc("self/mountinfo");
        let table_arc = match self.mountinfo.table(&mountinfo_path) {
            Ok(table) => {
                for bad in &table.bad_lines {
                    report
                        .errors
                        .push(format!("{}: {bad}", mountinfo_path.display()));
                }
                Some(table)
            }
            Err(e) => {
                report.errors.push(format!(
                    "cannot read the mount table {}: {e}; check --proc-root",
                    mountinfo_path.display()
                ));
                None
            }
        };
        let table: Option<&MountTable> = table_arc.as_deref();
        report.mount_table_entries = table.map_or(0, MountTable::len);
        let index = table.map(MountTable::index);

        let targets = self.targets(table);
        let mut statfs_paths: Vec<PathBuf> = Vec::new();
        let mut pending: Vec<(usize, MountEntry<'_>)> = Vec::new();
        for (i, target) in targets.iter().enumerate() {
            let spec = &target.spec;
            let mut m = MountReport {
                path: spec.path.to_string_lossy().into_owned(),
                fstype: None,
                status: MountStatus::Error,
                message: String::new(),
                required: target.required,
                expected_fstype: spec.fstype.clone(),
                source: None,
                lustre_fsname: None,
                read_only: None,
                fs_magic: None,
                capacity: None,
                statfs_seconds: None,
            };
            let (Some(table), Some(index)) = (table, index.as_ref()) else {
                m.message = format!(
                    "cannot tell whether it is mounted: the mount table {} is unreadable",
                    mountinfo_path.display()
                );
                report.mounts.push(m);
                continue;
            };
            let Some(entry) = index.find(&spec.path) else {
                m.status = MountStatus::Missing;
                m.message = missing_message(spec, table, &mountinfo_path);
                report.mounts.push(m);
                continue;
            };
            m.fstype = Some(entry.fstype.to_owned());
            m.source = Some(entry.source.to_owned());
            m.read_only = Some(entry.is_read_only());
            if entry.fstype == "lustre" {
                m.lustre_fsname = lustre::fsname_from_source(entry.source);
            }
            if let Some(want) = spec.fstype.as_deref().filter(|w| *w != entry.fstype) {
                m.status = MountStatus::WrongType;
                m.message = format!(
                    "mounted as {} (source {}), but {want} is required",
                    entry.fstype, entry.source
                );
                report.mounts.push(m);
                continue;
            }
            report.mounts.push(m);
            statfs_paths.push(spec.path.clone());
            pending.push((i, entry));
        }

        let timeout = self.config.statfs_timeout;
        let outcomes = self.pool.run(&statfs_paths, timeout);
        for ((i, entry), outcome) in pending.into_iter().zip(outcomes) {
            let spec = &targets[i].spec;
            judge(&mut report.mounts[i], spec, &entry, outcome, timeout);
        }
        report.stuck_statfs = self.pool.stuck();
        report.client = lustre::probe(roots);
        report
    }

    /// Required mounts (deduplicated; a `lustre.mounts` entry wins over a `mounts` entry for
    /// the same path), then the Lustre mounts found when `all_lustre` is on.
    fn targets(&self, table: Option<&MountTable>) -> Vec<Target> {
        let mut out: Vec<Target> = Vec::new();
        // A set, not pairwise comparison: 10,000 Lustre mounts must not cost 10,000².
        let mut seen: HashSet<PathBuf> = HashSet::new();
        let mut ordered: Vec<&MountSpec> = self.config.required.iter().collect();
        // Stable sort: Lustre specs first only for the dedup decision, then restore order.
        ordered.sort_by_key(|s| !s.is_lustre());
        let mut keep: HashSet<*const MountSpec> = HashSet::new();
        for spec in ordered {
            if seen.insert(mountinfo::normalize(&spec.path)) {
                keep.insert(std::ptr::from_ref(spec));
            }
        }
        for spec in &self.config.required {
            if keep.contains(&std::ptr::from_ref(spec)) {
                out.push(Target {
                    spec: spec.clone(),
                    required: true,
                });
            }
        }
        if self.config.all_lustre
            && let Some(table) = table
        {
            for entry in table.of_type("lustre") {
                // The kernel prints canonical mount points: no normalising needed.
                // The same point may appear twice when over-mounted; check the visible one.
                if !seen.insert(entry.mount_point.to_owned()) {
                    continue;
                }
                out.push(Target {
                    spec: MountSpec::lustre(
                        entry.mount_point.to_owned(),
                        self.config.lustre_min_free_percent,
                    ),
                    required: false,
                });
            }
        }
        out
    }
}

fn missing_message(spec: &MountSpec, table: &MountTable, mountinfo: &Path) -> String {
    let what = spec
        .fstype
        .as_deref()
        .map_or_else(|| "a mount".to_owned(), |t| format!("a {t} mount"));
    let under = table.containing(&spec.path).map_or_else(String::new, |e| {
        format!(
            "; the path is on {} ({})",
            e.mount_point.display(),
            e.fstype
        )
    });
    format!(
        "not mounted: {what} is required here but {} has no entry for it{under}; \
         mount it (check the node's fstab/automount and the storage network)",
        mountinfo.display()
    )
}

fn judge(
    m: &mut MountReport,
    spec: &MountSpec,
    entry: &MountEntry<'_>,
    outcome: Outcome,
    timeout: Duration,
) {
    let info = match outcome {
        Outcome::Hung { waiting, new } => {
            m.status = MountStatus::Hung;
            m.message = if new {
                format!(
                    "statfs did not return within {}; the file system's servers may be \
                     unreachable (check the storage network and servers)",
                    fmt_duration(timeout)
                )
            } else {
                format!(
                    "statfs started {} ago has still not returned; not retrying until it \
                     does (check the storage network and servers)",
                    fmt_duration(waiting)
                )
            };
            return;
        }
        Outcome::SpawnFailed(e) => {
            m.status = MountStatus::Error;
            m.message = format!("cannot start a statfs worker thread: {e}");
            return;
        }
        Outcome::Done { result, elapsed } => {
            m.statfs_seconds = Some(elapsed.as_secs_f64());
            match result {
                Ok(info) => info,
                Err(e) => {
                    m.status = MountStatus::Error;
                    m.message = format!("statfs {} failed: {e}", spec.path.display());
                    return;
                }
            }
        }
    };
    m.fs_magic = Some(format!("{:#010x}", info.fs_type));
    let capacity = Capacity::from_statfs(&info);
    let read_only = entry.is_read_only() || info.read_only;
    m.read_only = Some(read_only);

    if entry.fstype == "lustre" && info.fs_type != LL_SUPER_MAGIC {
        m.status = MountStatus::WrongType;
        m.message = format!(
            "the mount table says lustre, but statfs reports file-system magic {:#010x}{} \
             instead of LL_SUPER_MAGIC {LL_SUPER_MAGIC:#010x}; something else is mounted or \
             stacked here",
            info.fs_type,
            statfs::magic_name(info.fs_type).map_or(String::new(), |n| format!(" ({n})"))
        );
    } else if spec.writable && read_only {
        m.status = MountStatus::ReadOnly;
        m.message = format!(
            "mounted read-only ({}); it must be writable: remount it rw and check the \
             server for errors that forced read-only",
            if entry.is_read_only() {
                "ro in the mount options"
            } else {
                "statfs reports ST_RDONLY"
            }
        );
    } else if let Some(why) = too_full(&capacity, spec.min_free_percent) {
        m.status = MountStatus::Full;
        m.message = why;
    } else {
        m.status = MountStatus::Ok;
        m.message = match capacity.available_percent {
            Some(p) => format!(
                "ok: {p:.1}% of {} available",
                fmt_bytes(capacity.total_bytes)
            ),
            None => "ok".to_owned(),
        };
    }
    m.capacity = Some(capacity);
}

fn too_full(c: &Capacity, min_free_percent: f64) -> Option<String> {
    if min_free_percent <= 0.0 {
        return None;
    }
    if let Some(p) = c.available_percent.filter(|p| *p < min_free_percent) {
        return Some(format!(
            "only {p:.1}% of the space is available ({} of {}), below the required \
             {min_free_percent}%; free space or raise the quota",
            fmt_bytes(c.available_bytes),
            fmt_bytes(c.total_bytes)
        ));
    }
    if let Some(p) = c.free_inodes_percent.filter(|p| *p < min_free_percent) {
        return Some(format!(
            "only {p:.1}% of the inodes are free, below the required {min_free_percent}%; \
             delete small files"
        ));
    }
    None
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 10.0 {
        format!("{s:.1}s")
    } else {
        format!("{}s", d.as_secs())
    }
}

fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

// The daemon moves its prober onto a blocking thread; keep that possible.
const _: fn() = || {
    fn assert_send<T: Send>() {}
    assert_send::<StorageProber>();
};

#[cfg(test)]
mod tests {
    use super::*;

    fn info(blocks: u64, avail: u64, files: u64, ffree: u64) -> StatfsInfo {
        StatfsInfo {
            fs_type: LL_SUPER_MAGIC,
            block_size: 4096,
            blocks,
            blocks_free: avail,
            blocks_available: avail,
            files,
            files_free: ffree,
            read_only: false,
        }
    }

    #[test]
    fn capacity_and_floor() {
        let c = Capacity::from_statfs(&info(1000, 40, 100, 50));
        assert_eq!(c.total_bytes, 4_096_000);
        assert_eq!(c.available_percent, Some(4.0));
        assert_eq!(c.free_inodes_percent, Some(50.0));
        assert!(too_full(&c, 0.0).is_none());
        assert!(too_full(&c, 5.0).unwrap().contains("4.0%"));
        assert!(too_full(&c, 3.0).is_none());
        let c = Capacity::from_statfs(&info(1000, 900, 100, 1));
        assert!(too_full(&c, 5.0).unwrap().contains("inodes"));
        // No inode accounting: not "full".
        let c = Capacity::from_statfs(&info(1000, 900, 0, 0));
        assert_eq!(c.total_inodes, None);
        assert!(too_full(&c, 5.0).is_none());
    }

    #[test]
    fn byte_and_duration_formatting() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(fmt_duration(Duration::from_secs(65)), "65s");
    }

    #[test]
    fn targets_dedup_and_discover_lustre() {
        let table = MountTable::parse(
            "25 1 259:2 / / rw - ext4 /dev/sda rw\n\
             30 25 0:52 / /lustre/scratch rw - lustre 10.1.1.1@o2ib:/scratch rw\n\
             31 25 0:53 / /lustre/home rw - lustre 10.1.1.1@o2ib:/home rw\n",
        );
        let cfg = StorageConfig {
            required: vec![
                MountSpec {
                    path: "/lustre/scratch/".into(),
                    fstype: None,
                    writable: false,
                    min_free_percent: 0.0,
                },
                MountSpec::lustre("/lustre/scratch", 1.0),
                MountSpec {
                    path: "/datasets".into(),
                    fstype: Some("nfs4".into()),
                    writable: true,
                    min_free_percent: 0.0,
                },
            ],
            ..StorageConfig::default()
        };
        let p = StorageProber::new(cfg.clone());
        let t = p.targets(Some(&table));
        let paths: Vec<_> = t
            .iter()
            .map(|t| (t.spec.path.clone(), t.required))
            .collect();
        assert_eq!(
            paths,
            vec![
                (PathBuf::from("/lustre/scratch"), true),
                (PathBuf::from("/datasets"), true),
                (PathBuf::from("/lustre/home"), false),
            ]
        );
        assert!(t[0].spec.is_lustre());
        let p = StorageProber::new(StorageConfig {
            all_lustre: false,
            ..cfg
        });
        assert_eq!(p.targets(Some(&table)).len(), 2);
    }
}
