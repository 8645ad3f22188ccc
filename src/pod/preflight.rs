//! `fabricgate preflight`: the init container of a training worker. From inside the pod it
//! checks what this pod was given — the RDMA device nodes, the ports behind them (verbs, the
//! requirements file's `rdma:` rules, optionally the loopback self-test), `RLIMIT_MEMLOCK`, the
//! required mounts — with the same probes and policy as `fabricgate check`. On success it
//! pins NCCL to exactly the validated ports (`nccl.conf` for `NCCL_CONF_FILE`, `nccl.env` for
//! older NCCL); on failure it says why, one sentence per problem, also in the termination log.

use crate::config::Config;
use crate::policy::{self, check::Checks};
use crate::text::truncate_marked;
use fabricgate_probes::pod::{self, DeviceNode, Limit, MemlockReport};
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use serde::Serialize;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// File names inside `--nccl-dir`.
pub const NCCL_CONF: &str = "nccl.conf";
pub const NCCL_ENV: &str = "nccl.env";

/// The kubelet keeps at most this much of a termination message.
pub const TERMINATION_LOG_MAX: usize = 4096;

/// Whether preflight runs the loopback data-path self-test on each port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SelftestChoice {
    /// As the requirements say: on unless `rdma.selftest: off`.
    #[default]
    Auto,
    On,
    Off,
}

/// What preflight requires beyond the requirements file, and where it writes.
#[derive(Debug, Clone)]
pub struct Options {
    pub selftest: SelftestChoice,
    /// `RLIMIT_MEMLOCK` (soft) must be at least this, unless the process holds `CAP_IPC_LOCK`.
    pub min_memlock: Limit,
    /// Overrides `rdma.min_active_ports` (a pod given fewer HCAs than the node has).
    pub min_active_ports: Option<u32>,
    /// Value of `NCCL_NET` in the written files.
    pub nccl_net: String,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            selftest: SelftestChoice::Auto,
            min_memlock: Limit::Unlimited,
            min_active_ports: None,
            nccl_net: "IB".into(),
        }
    }
}

/// The result of one preflight run.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// 0 validated, 1 not validated, 3 could not probe at all (as `fabricgate check`).
    pub exit_code: u8,
    /// One sentence per problem; empty when validated.
    pub problems: Vec<String>,
    /// Problems that do not block (a spare port down, a device not given to this pod).
    pub notes: Vec<String>,
    /// The validated `(device, port)` list NCCL is pinned to (empty on failure).
    pub ports: Vec<(String, u32)>,
    pub device_nodes: Vec<DeviceNode>,
    pub memlock: MemlockReport,
    /// Wall time of each probe kind.
    pub timings: fabricgate_probes::ProbeTimings,
    pub elapsed_seconds: f64,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.exit_code == crate::EXIT_VALIDATED
    }

    /// `=mlx5_0:1,mlx5_1:1`: the exact-match form of `NCCL_IB_HCA`.
    pub fn ib_hca(&self) -> String {
        ib_hca(&self.ports)
    }

    /// What goes to the termination log: the problems, or a one-line success summary.
    pub fn termination_message(&self) -> String {
        if self.ok() {
            format!(
                "fabricgate preflight: validated {}; NCCL pinned to them",
                self.ports
                    .iter()
                    .map(|(d, p)| format!("{d}:{p}"))
                    .collect::<Vec<_>>()
                    .join(",")
            )
        } else {
            truncate_marked(&self.problems.join("\n"), TERMINATION_LOG_MAX)
        }
    }
}

/// `NCCL_IB_HCA` with the `=` prefix: exact device names, each with its port
/// (`=mlx5_0:1,mlx5_1:1`); without `=`, NCCL would treat `mlx5_1` as a prefix of `mlx5_10`.
pub fn ib_hca(ports: &[(String, u32)]) -> String {
    let list: Vec<String> = ports.iter().map(|(d, p)| format!("{d}:{p}")).collect();
    format!("={}", list.join(","))
}

/// The `NCCL_CONF_FILE` contents (NCCL >= 2.23 reads `NAME=value` lines verbatim; `#` starts
/// a comment; a variable already in the environment wins over the file).
pub fn nccl_conf(ports: &[(String, u32)], net: &str) -> String {
    format!(
        "# Written by fabricgate preflight: the RDMA ports validated inside this pod.\n\
         # NCCL >= 2.23 reads it through NCCL_CONF_FILE; NCCL_NET makes NCCL fail instead of\n\
         # falling back to TCP sockets.\n\
         NCCL_NET={net}\n\
         NCCL_IB_HCA={}\n",
        ib_hca(ports)
    )
}

/// The same settings as shell exports, for NCCL < 2.23: `. /fabricgate/nccl.env`.
pub fn nccl_env(ports: &[(String, u32)], net: &str) -> String {
    format!(
        "# Written by fabricgate preflight; source it before starting NCCL < 2.23.\n\
         export NCCL_NET='{net}'\n\
         export NCCL_IB_HCA='{}'\n",
        ib_hca(ports)
    )
}

/// Characters NCCL's list syntax and a single-quoted shell word both carry safely.
fn safe_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// Probe once from inside the pod and judge it. Never panics on system input; bounded by the
/// statfs timeout plus the self-test timeout per port.
/// `checks`: the registered subsystems (their probes are `probe`'s collectors): the storage
/// part is read from them.
pub fn run(
    roots: &Roots,
    probe: ProbeConfig,
    config: &Config,
    checks: &Checks,
    opts: &Options,
) -> Outcome {
    let started = Instant::now();
    let mut config = config.clone();
    if let Some(n) = opts.min_active_ports {
        config.rdma.min_active_ports = n;
    }
    let mut probe = probe;
    probe.selftest.schedule = match (opts.selftest, config.rdma.selftest_schedule()) {
        (SelftestChoice::Off, _) | (SelftestChoice::Auto, SelftestSchedule::Off) => {
            SelftestSchedule::Off
        }
        _ => SelftestSchedule::OnStart,
    };

    let mut problems: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();

    let device_nodes = match pod::device_nodes(roots) {
        Ok(nodes) => nodes,
        Err(e) => {
            notes.push(format!("cannot list the RDMA device nodes: {e}"));
            Vec::new()
        }
    };
    let (report, all_missing) = probe_given_devices(
        roots,
        probe,
        &config,
        &device_nodes,
        &mut problems,
        &mut notes,
    );

    let verdict = policy::evaluate_checked(&report, &config, checks);
    if !all_missing {
        if verdict.rdma.part.ready {
            notes.extend(verdict.rdma.part.warnings.iter().map(|f| f.message.clone()));
        } else {
            problems.extend(verdict.rdma.part.findings.iter().map(|f| f.message.clone()));
        }
    }
    if let Some(storage) = verdict.checks.get(policy::LUSTRE) {
        let part = &storage.part;
        if part.ready {
            notes.extend(part.warnings.iter().map(|f| f.message.clone()));
        } else {
            problems.extend(part.findings.iter().map(|f| f.message.clone()));
        }
    }

    let memlock = pod::memlock(roots);
    if let Some(problem) = memlock_problem(&memlock, opts.min_memlock) {
        problems.push(problem);
    }

    let mut ports = Vec::new();
    if problems.is_empty() {
        ports = policy::usable_ports(&report, &config);
        if let Some((dev, _)) = ports.iter().find(|(d, _)| !safe_name(d)) {
            problems.push(format!(
                "RDMA device name {dev:?} cannot be written into NCCL_IB_HCA; rename it \
                 (letters, digits, '_', '-', '.')"
            ));
            ports.clear();
        }
    }

    let exit_code = if problems.is_empty() {
        crate::EXIT_VALIDATED
    } else if crate::policy::exit_code(&report, &verdict) == crate::EXIT_CANNOT_PROBE
        && !all_missing
    {
        crate::EXIT_CANNOT_PROBE
    } else {
        crate::EXIT_NOT_VALIDATED
    };
    Outcome {
        exit_code,
        problems,
        notes,
        ports,
        device_nodes,
        memlock,
        timings: report.timings.clone(),
        elapsed_seconds: started.elapsed().as_secs_f64(),
    }
}

/// The probe of the devices this pod was given. sysfs is not namespaced: the pod sees every
/// HCA of the host there, but only the device nodes the device plugin injected, so devices
/// without their node are not this pod's (a note each, and out of the report). With none of
/// the devices in scope given, a problem and the storage probe alone (`true`: all missing).
fn probe_given_devices(
    roots: &Roots,
    probe: ProbeConfig,
    config: &Config,
    device_nodes: &[DeviceNode],
    problems: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> (fabricgate_probes::ProbeReport, bool) {
    let matcher = config.device_matcher();
    let in_scope = |name: &str| matcher.is_match(name);
    let missing: Vec<&DeviceNode> = device_nodes
        .iter()
        .filter(|n| !n.present && in_scope(&n.device))
        .collect();
    let given = device_nodes
        .iter()
        .filter(|n| n.present && in_scope(&n.device))
        .count();
    if !missing.is_empty() && given == 0 {
        problems.push(format!(
            "no RDMA device node in this container: {} missing; the device plugin did not \
             inject /dev/infiniband into this pod (request the RDMA resource, e.g. \
             rdma/<name>, in this container's resources)",
            missing
                .iter()
                .map(|n| format!("{} ({})", n.path.display(), n.device))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        // Nothing of the pod's RDMA to look at: fail fast, with the storage probe only (no
        // verbs providers loaded, no GID tables read).
        return (storage_only(roots, config), true);
    }
    let mut report = Prober::new(roots.clone(), probe).probe();
    for n in &missing {
        notes.push(format!(
            "{}: {} is not in this container; the device is not counted",
            n.device,
            n.path.display()
        ));
    }
    report
        .rdma
        .devices
        .retain(|d| !missing.iter().any(|n| n.device == d.name));
    (report, false)
}

/// A report with the storage probe alone (RDMA left empty).
fn storage_only(roots: &Roots, config: &Config) -> fabricgate_probes::ProbeReport {
    use fabricgate_probes::storage;
    let started = Instant::now();
    let found = storage::StorageProber::new(config.storage_config()).probe(roots);
    let mut report = fabricgate_probes::ProbeReport {
        timestamp: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        ..Default::default()
    };
    report.timings.collected.insert(
        format!("{}_seconds", storage::NAME),
        started.elapsed().as_secs_f64(),
    );
    storage::set(&mut report, found);
    report
}

/// Whether `RLIMIT_MEMLOCK` lets RDMA pin memory: the soft limit is what a process gets.
fn memlock_problem(report: &MemlockReport, min: Limit) -> Option<String> {
    if report.ipc_lock == Some(true) {
        return None; // CAP_IPC_LOCK: ib_umem_get ignores the limit.
    }
    let Some(limit) = report.limit else {
        return Some(format!(
            "cannot tell the memlock limit (RLIMIT_MEMLOCK): {}; RDMA needs {min} to pin \
             NCCL's buffers",
            report.errors.join("; ")
        ));
    };
    if limit.soft.at_least(min) {
        return None;
    }
    Some(format!(
        "memlock limit (RLIMIT_MEMLOCK) is {} (hard {}), below the {min} RDMA needs to pin \
         NCCL's buffers; raise the container runtime's memlock limit (containerd/CRI-O: \
         LimitMEMLOCK=infinity) or add the IPC_LOCK capability to this container",
        limit.soft, limit.hard
    ))
}

/// Write `nccl.conf` and `nccl.env` into `dir` without following any link a container
/// planted there: both are written into a fresh directory that this call creates inside `dir`
/// (mode 0700, a name nobody could have taken: `mkdir` fails on anything already there, a
/// symlink included), each file created new (`O_EXCL`), then renamed into `dir`. `rename`
/// replaces whatever has the name, a symlink included, without following it, so a reader
/// sees the old file or the whole new one.
///
/// # Errors
/// The I/O error, with the path, when `dir` is not writable.
pub fn write_nccl_files(
    dir: &Path,
    ports: &[(String, u32)],
    net: &str,
) -> crate::Result<(PathBuf, PathBuf)> {
    let conf = dir.join(NCCL_CONF);
    let env = dir.join(NCCL_ENV);
    let staging = staging_dir(dir)?;
    let written = write_new(&staging.join(NCCL_CONF), &nccl_conf(ports, net))
        .and_then(|()| write_new(&staging.join(NCCL_ENV), &nccl_env(ports, net)))
        .and_then(|()| rename(&staging.join(NCCL_CONF), &conf))
        .and_then(|()| rename(&staging.join(NCCL_ENV), &env));
    for name in [NCCL_CONF, NCCL_ENV] {
        let _ = std::fs::remove_file(staging.join(name));
    }
    let _ = std::fs::remove_dir(&staging);
    written.map(|()| (conf, env))
}

fn nccl_dir_error(path: &Path, what: &str, e: &io::Error) -> crate::Error {
    crate::Error::Usage {
        flag: "--nccl-dir".into(),
        message: format!(
            "cannot {what} {}: {e}; mount the shared emptyDir there",
            path.display()
        ),
    }
}

/// A new directory in `dir` that this process made (never one that was there before).
fn staging_dir(dir: &Path) -> crate::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut last = None;
    for attempt in 0..16u32 {
        let path = dir.join(format!(
            ".fabricgate-{}-{nanos:x}-{attempt}",
            std::process::id()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some((path, e)),
            Err(e) => return Err(nccl_dir_error(&path, "create", &e)),
        }
    }
    let (path, e) = last.unwrap_or_else(|| (dir.to_owned(), io::ErrorKind::AlreadyExists.into()));
    Err(nccl_dir_error(&path, "create", &e))
}

fn write_new(path: &Path, text: &str) -> crate::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| nccl_dir_error(path, "write", &e))
}

fn rename(from: &Path, to: &Path) -> crate::Result<()> {
    std::fs::rename(from, to).map_err(|e| nccl_dir_error(to, "write", &e))
}

/// Remove files a previous successful run left in `dir` (an init container rerun after a
/// failure must not leave NCCL pinned to ports that no longer pass).
///
/// # Errors
/// Any removal error but "not found", with the path.
pub fn remove_nccl_files(dir: &Path) -> crate::Result<()> {
    for name in [NCCL_CONF, NCCL_ENV] {
        let path = dir.join(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(crate::Error::Usage {
                    flag: "--nccl-dir".into(),
                    message: format!("cannot remove {}: {e}", path.display()),
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// Write the termination message (`/dev/termination-log`), so `kubectl describe pod` shows it.
///
/// A symlink at `path` is not followed. The log is for humans only: the caller reports an
/// error on stderr and exits with the verdict's code all the same.
///
/// # Errors
/// The I/O error (a missing `/dev/termination-log` outside Kubernetes, a read-only /dev).
pub fn write_termination_log(path: &Path, message: &str) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?
        .write_all(message.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ports() -> Vec<(String, u32)> {
        vec![("mlx5_0".into(), 1), ("mlx5_1".into(), 1)]
    }

    #[test]
    fn ib_hca_uses_nccls_exact_match_syntax() {
        assert_eq!(ib_hca(&ports()), "=mlx5_0:1,mlx5_1:1");
        let conf = nccl_conf(&ports(), "IB");
        let vars: Vec<&str> = conf.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(vars, ["NCCL_NET=IB", "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1"]);
        let env = nccl_env(&[("rxe0".into(), 1)], "IB");
        assert!(env.contains("export NCCL_IB_HCA='=rxe0:1'\n"), "{env}");
        assert!(env.contains("export NCCL_NET='IB'\n"), "{env}");
    }

    #[test]
    fn memlock_needs_the_limit_or_ipc_lock() {
        use fabricgate_probes::pod::MemlockLimit;
        let low = MemlockReport {
            limit: Some(MemlockLimit {
                soft: Limit::Bytes(65536),
                hard: Limit::Bytes(65536),
            }),
            ipc_lock: Some(false),
            errors: Vec::new(),
        };
        let msg = memlock_problem(&low, Limit::Unlimited).unwrap();
        assert!(
            msg.starts_with("memlock limit (RLIMIT_MEMLOCK) is 64 KiB"),
            "{msg}"
        );
        assert!(memlock_problem(&low, Limit::Bytes(65536)).is_none());
        let capable = MemlockReport {
            ipc_lock: Some(true),
            ..low.clone()
        };
        assert!(memlock_problem(&capable, Limit::Unlimited).is_none());
        let unknown = MemlockReport {
            limit: None,
            ipc_lock: None,
            errors: vec!["cannot read /proc/self/limits: gone".into()],
        };
        let msg = memlock_problem(&unknown, Limit::Unlimited).unwrap();
        assert!(msg.contains("/proc/self/limits"), "{msg}");
    }

    #[test]
    fn termination_message_is_bounded() {
        let text = "é".repeat(5000);
        let t = truncate_marked(&text, TERMINATION_LOG_MAX);
        assert!(t.len() <= TERMINATION_LOG_MAX);
        assert!(t.ends_with(" ..."));
        assert_eq!(truncate_marked("short", 10), "short");
    }

    #[test]
    fn files_are_written_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (conf, env) = write_nccl_files(dir.path(), &ports(), "IB").unwrap();
        assert!(
            std::fs::read_to_string(&conf)
                .unwrap()
                .contains("NCCL_IB_HCA==mlx5_0:1,mlx5_1:1")
        );
        assert!(env.exists());
        assert!(!dir.path().join("nccl.tmp").exists());
        remove_nccl_files(dir.path()).unwrap();
        assert!(!conf.exists() && !env.exists());
        remove_nccl_files(dir.path()).unwrap();
        let e = write_nccl_files(&dir.path().join("absent"), &ports(), "IB").unwrap_err();
        assert!(e.to_string().contains("absent/.fabricgate-"), "{e}");
    }

    /// A container that can write the NCCL directory plants `nccl.tmp` (the old
    /// temporary name) and the final names as symlinks to a file elsewhere; preflight must
    /// write neither through them.
    #[test]
    fn redteam_planted_symlinks_in_the_nccl_dir_are_never_followed() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let nccl = dir.path().join("nccl");
        std::fs::create_dir(&nccl).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        for name in ["nccl.tmp", "nccl.conf", "nccl.env"] {
            symlink(&victim, nccl.join(name)).unwrap();
        }
        let (conf, env) = write_nccl_files(&nccl, &ports(), "IB").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
        for f in [&conf, &env] {
            let meta = std::fs::symlink_metadata(f).unwrap();
            assert!(
                meta.file_type().is_file(),
                "{} replaced by a file",
                f.display()
            );
        }
        assert!(
            std::fs::read_to_string(&conf)
                .unwrap()
                .contains("NCCL_IB_HCA==")
        );
        let left: Vec<_> = std::fs::read_dir(&nccl)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(".fabricgate-"))
            .collect();
        assert!(left.is_empty(), "staging directory removed: {left:?}");
        // The termination log is not written through a link either.
        let log = dir.path().join("termination-log");
        symlink(&victim, &log).unwrap();
        assert!(write_termination_log(&log, "x").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }
}
