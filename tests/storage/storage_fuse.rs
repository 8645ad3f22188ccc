//! A REAL hung mount: a FUSE file system (tests/fuse/hangfs.c, built here against libfuse3)
//! whose statfs never answers, like a Lustre or NFS mount whose servers are gone. The probe
//! must report it `hung` within the timeout while a healthy tmpfs beside it is `ok`, never
//! start a second statfs on it while the first is stuck, and keep the thread count bounded.
//!
//! Needs root, /dev/fuse, cc, pkg-config and libfuse3-dev (.ci/storage.sh installs them).
//! The test re-runs itself alone in a child process, under `unshare --mount` so its mounts
//! are invisible to the rest of the machine (a `df` elsewhere must not hang on them) and
//! vanish with the process.

use crate::common;

use common::storage::{TmpfsMount, thread_count, threads_named};
use common::{in_ci, require, require_root};
use fabricgate_probes::Roots;
use fabricgate_probes::storage::statfs::WORKER_THREAD_NAME;
use fabricgate_probes::storage::{MountSpec, MountStatus, StorageConfig, StorageProber};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TEST_NAME: &str = "hung_fuse_mount_is_hung_within_the_timeout_and_leaks_no_threads";
const INNER: &str = "FABRICGATE_FUSE_TEST_INNER";
const TIMEOUT: Duration = Duration::from_secs(1);
/// Slack over the statfs timeout for thread start-up and reading procfs on a loaded CI box.
const MARGIN: Duration = Duration::from_millis(1500);

#[test]
fn hung_fuse_mount_is_hung_within_the_timeout_and_leaks_no_threads() {
    if !require_root("mount(2) and FUSE") {
        return;
    }
    if !require(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing",
        "apt-get install fuse3; .ci/storage.sh installs it",
    ) {
        return;
    }
    // Always in a child process of its own: the thread counts below are this process's, and
    // other tests of the binary run beside this one.
    if std::env::var_os(INNER).is_none() {
        let exe = std::env::current_exe().unwrap();
        let test = common::test_path(module_path!(), TEST_NAME);
        let mut cmd = if common::can_unshare_mounts() {
            let mut c = Command::new("unshare");
            c.args(["--mount", "--propagation", "private", "--"])
                .arg(exe);
            c
        } else {
            assert!(!in_ci(), "CI=true but `unshare --mount` does not work");
            eprintln!(
                "note: unshare unavailable; the FUSE mounts are visible machine-wide while the test runs"
            );
            Command::new(exe)
        };
        let out = cmd
            .args(["--exact", &test, "--nocapture", "--test-threads=1"])
            .env(INNER, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("{stdout}");
        eprintln!("{stderr}");
        assert!(out.status.success(), "the test failed in its own process");
        assert!(stdout.contains("1 passed"), "the inner test did not run");
        return;
    }
    run();
}

/// Build hangfs; `None` (skip outside CI) when no C compiler or libfuse3 headers.
fn build_hangfs(dir: &Path) -> Option<PathBuf> {
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "fuse3"])
        .output();
    let flags = match flags {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        _ => {
            require(
                false,
                "pkg-config cannot find fuse3",
                "apt-get install pkg-config libfuse3-dev; .ci/storage.sh installs them",
            );
            return None;
        }
    };
    let bin = dir.join("hangfs");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuse/hangfs.c");
    let status = Command::new("cc")
        .args(["-Wall", "-O2"])
        .arg(&src)
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(&bin)
        .status();
    match status {
        Ok(s) if s.success() => Some(bin),
        other => {
            assert!(!in_ci(), "cc failed to build {}: {other:?}", src.display());
            require(
                false,
                "no C compiler (cc) that builds tests/fuse/hangfs.c",
                "apt-get install gcc",
            );
            None
        }
    }
}

/// A running hangfs mount. Drop kills the server first (which makes every stuck statfs
/// return ENOTCONN and frees its thread), then lazily unmounts, even when the test panics.
struct HungMount {
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl HungMount {
    fn start(bin: &Path) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new(bin)
            .arg(dir.path())
            .args(["-f", "-o", "fsname=fabricgate-hang,subtype=hangfs"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut m = Self {
            child: Some(child),
            dir,
        };
        m.wait_mounted();
        m
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Poll the mount table (never the mount itself, which may hang).
    fn wait_mounted(&mut self) {
        let want = format!(" {} ", self.dir.path().display());
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
            if table
                .lines()
                .any(|l| l.contains(&want) && l.contains(" - fuse.hangfs "))
            {
                return;
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("hangfs exited before mounting: {status}");
            }
            assert!(Instant::now() < deadline, "hangfs did not mount within 15s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for HungMount {
    fn drop(&mut self) {
        self.kill();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .stderr(Stdio::null())
            .status();
    }
}

fn spec(path: &Path, fstype: Option<&str>) -> MountSpec {
    MountSpec {
        path: path.to_owned(),
        fstype: fstype.map(str::to_owned),
        writable: true,
        min_free_percent: 0.0,
    }
}

fn run() {
    let work = tempfile::tempdir().unwrap();
    let Some(bin) = build_hangfs(work.path()) else {
        return;
    };
    let healthy = TmpfsMount::new("size=16m");
    let mut hung_a = HungMount::start(&bin);
    let hung_b = HungMount::start(&bin);

    let mut prober = StorageProber::new(StorageConfig {
        required: vec![
            spec(hung_a.path(), None),
            spec(healthy.path(), Some("tmpfs")),
            spec(hung_b.path(), Some("fuse.hangfs")),
        ],
        all_lustre: false,
        statfs_timeout: TIMEOUT,
        lustre_min_free_percent: 0.0,
    });
    let roots = Roots::default();
    let baseline = thread_count();
    assert_eq!(threads_named(WORKER_THREAD_NAME), 0);

    // First probe: both hung mounts get one statfs each and the probe waits out the timeout
    // once for all of them, not once per mount.
    let started = Instant::now();
    let r = prober.probe(&roots);
    let took = started.elapsed();
    assert!(took >= TIMEOUT, "returned before the timeout: {took:?}");
    assert!(took < TIMEOUT + MARGIN, "probe took {took:?}");
    let status: Vec<MountStatus> = r.mounts.iter().map(|m| m.status).collect();
    assert_eq!(
        status,
        [MountStatus::Hung, MountStatus::Ok, MountStatus::Hung],
        "{:#?}",
        r.mounts
    );
    assert!(
        r.mounts[0].message.contains("did not return within 1.0s"),
        "{}",
        r.mounts[0].message
    );
    assert_eq!(r.mounts[0].fstype.as_deref(), Some("fuse.hangfs"));
    assert_eq!(r.mounts[0].statfs_seconds, None);
    assert_eq!(r.mounts[1].fstype.as_deref(), Some("tmpfs"));
    assert!(r.mounts[1].capacity.as_ref().unwrap().total_bytes >= 16 * 1024 * 1024);
    assert_eq!(r.stuck_statfs, 2);
    assert_eq!(
        threads_named(WORKER_THREAD_NAME),
        2,
        "one stuck worker per hung mount"
    );

    // 100 more probes: the stuck calls are not repeated, so no thread piles up and each probe
    // returns at once (the healthy tmpfs answers in microseconds).
    for i in 0..100 {
        let started = Instant::now();
        let r = prober.probe(&roots);
        let took = started.elapsed();
        assert!(took < TIMEOUT + MARGIN, "cycle {i}: probe took {took:?}");
        assert_eq!(r.mounts[0].status, MountStatus::Hung, "cycle {i}");
        assert_eq!(
            r.mounts[1].status,
            MountStatus::Ok,
            "cycle {i}: {}",
            r.mounts[1].message
        );
        assert_eq!(r.mounts[2].status, MountStatus::Hung, "cycle {i}");
        assert!(
            r.mounts[0].message.contains("has still not returned"),
            "{}",
            r.mounts[0].message
        );
        assert_eq!(r.stuck_statfs, 2, "cycle {i}");
    }
    assert_eq!(threads_named(WORKER_THREAD_NAME), 2);
    let after = thread_count();
    assert!(
        after <= baseline + 2,
        "threads grew from {baseline} to {after} over 100 probes with two hung mounts"
    );

    // Kill one server: its stuck statfs returns (ENOTCONN), the thread goes, and the next
    // probe starts a fresh call that fails fast instead of hanging.
    hung_a.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while prober.stuck_statfs() > 1 {
        assert!(
            Instant::now() < deadline,
            "the stuck statfs did not return after the server died"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = prober.probe(&roots);
    assert_eq!(r.mounts[0].status, MountStatus::Error, "{:#?}", r.mounts[0]);
    assert!(
        r.mounts[0].message.contains("statfs"),
        "{}",
        r.mounts[0].message
    );
    assert_eq!(r.mounts[2].status, MountStatus::Hung);
    assert_eq!(r.stuck_statfs, 1);
    // The returned call's thread ends right after it hands back its answer: it is gone
    // shortly, not necessarily at the instant the count dropped.
    let deadline = Instant::now() + Duration::from_secs(10);
    while threads_named(WORKER_THREAD_NAME) > 1 {
        assert!(
            Instant::now() < deadline,
            "the returned statfs's thread did not end: {} workers",
            threads_named(WORKER_THREAD_NAME)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(threads_named(WORKER_THREAD_NAME), 1);
}
