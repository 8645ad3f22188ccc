//! statfs(2) that cannot hang the agent.
//!
//! A statfs on a Lustre or NFS mount whose servers are gone blocks in the kernel, often
//! uninterruptibly, and no signal or timeout ends it. So every call runs on its own small
//! worker thread and the prober waits for it only until a deadline. A call that misses the
//! deadline stays tracked in [`StatfsPool`]: while it is stuck the mount is reported hung and
//! no second call is started, so a hung mount costs exactly one thread however many probes
//! run (otherwise each probe would add a stuck thread, as node_exporter's did).

use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `f_type` of a Lustre client mount.
pub const LL_SUPER_MAGIC: u64 = 0x0BD0_0BD0;

/// `ST_RDONLY` in `f_flags` (statfs(2)).
const ST_RDONLY: u64 = 0x0001;

/// Name of the worker threads, so tests and operators can count them in /proc.
pub const WORKER_THREAD_NAME: &str = "fg-statfs";

/// statfs needs almost no stack; a stuck worker should cost as little memory as possible.
const WORKER_STACK_BYTES: usize = 128 * 1024;
/// statfs calls one probe runs at a time (calls stuck since earlier probes are not counted).
pub const MAX_CONCURRENT: usize = 64;

/// What statfs said about a mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StatfsInfo {
    /// `f_type`, the file system's magic number.
    pub fs_type: u64,
    /// Unit of the block counts (`f_frsize`, or `f_bsize` where that is 0).
    pub block_size: u64,
    pub blocks: u64,
    pub blocks_free: u64,
    /// Blocks available to unprivileged users.
    pub blocks_available: u64,
    pub files: u64,
    pub files_free: u64,
    /// `ST_RDONLY` set in `f_flags`.
    pub read_only: bool,
}

/// The one place in fabricgate that calls statfs(2). It may block forever on a hung mount:
/// call it only from a [`StatfsPool`] worker.
///
/// # Errors
/// The OS error of statfs(2) (ENOENT, EACCES, ENOTCONN on an aborted FUSE mount, ...).
// The statfs fields are `long`: i64 here, i32 on 32-bit targets, hence the widening calls.
#[allow(clippy::useless_conversion)]
pub fn statfs(path: &Path) -> io::Result<StatfsInfo> {
    let st = rustix::fs::statfs(path).map_err(io::Error::from)?;
    // The kernel's magic numbers are 32-bit; f_type is a signed long, so keep the low 32 bits
    // to print e.g. 0xf2f52010 the same on every architecture.
    let fs_type = (i64::from(st.f_type) as u64) & 0xFFFF_FFFF;
    let frsize = u64::try_from(i64::from(st.f_frsize)).unwrap_or(0);
    let bsize = u64::try_from(i64::from(st.f_bsize)).unwrap_or(0);
    let flags = i64::from(st.f_flags) as u64;
    Ok(StatfsInfo {
        fs_type,
        block_size: if frsize == 0 { bsize } else { frsize },
        blocks: st.f_blocks,
        blocks_free: st.f_bfree,
        blocks_available: st.f_bavail,
        files: st.f_files,
        files_free: st.f_ffree,
        read_only: flags & ST_RDONLY != 0,
    })
}

/// How one mount's statfs went in this probe.
#[derive(Debug)]
pub enum Outcome {
    /// The call returned (successfully or not) after `elapsed`.
    Done {
        result: io::Result<StatfsInfo>,
        elapsed: Duration,
    },
    /// The call has not returned; it was started `waiting` ago. `new` is false when it was
    /// started by an earlier probe and is still stuck (so no new call was made).
    Hung { waiting: Duration, new: bool },
    /// No worker thread could be started.
    SpawnFailed(io::Error),
}

struct InFlight {
    started: Instant,
    rx: Receiver<(io::Result<StatfsInfo>, Duration)>,
    handle: JoinHandle<()>,
}

/// The call a worker makes: [`statfs`], or a stand-in in unit tests.
type StatfsFn = fn(&Path) -> io::Result<StatfsInfo>;

/// Keeps the outstanding statfs calls between probes.
pub struct StatfsPool {
    in_flight: HashMap<PathBuf, InFlight>,
    op: StatfsFn,
}

impl Default for StatfsPool {
    fn default() -> Self {
        Self {
            in_flight: HashMap::new(),
            op: statfs,
        }
    }
}

impl std::fmt::Debug for StatfsPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatfsPool")
            .field("in_flight", &self.in_flight.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl StatfsPool {
    pub fn new() -> Self {
        Self::default()
    }

    /// statfs every path, at most [`MAX_CONCURRENT`] at a time, waiting at most `timeout` in
    /// total. Paths must be distinct. Returns one outcome per path, in order.
    pub fn run(&mut self, paths: &[PathBuf], timeout: Duration) -> Vec<Outcome> {
        self.reap();
        // One shared deadline: the probe as a whole waits `timeout`, not `timeout` per mount.
        let now = Instant::now();
        let deadline = now
            .checked_add(timeout)
            .unwrap_or_else(|| now + Duration::from_secs(86_400));
        let mut outcomes: Vec<Option<Outcome>> = paths.iter().map(|_| None).collect();
        // Started by this run and not collected yet, oldest first.
        let mut active: VecDeque<usize> = VecDeque::new();
        for (i, path) in paths.iter().enumerate() {
            if let Some(call) = self.in_flight.get(path) {
                // reap() removed every finished call, so this one is still stuck.
                outcomes[i] = Some(Outcome::Hung {
                    waiting: call.started.elapsed(),
                    new: false,
                });
                continue;
            }
            // A node with thousands of mounts must not start thousands of threads at once
            // (each a stack, a signal stack and a malloc arena): collect the oldest first.
            while active.len() >= MAX_CONCURRENT {
                let Some(j) = active.pop_front() else { break };
                outcomes[j] = Some(self.collect(&paths[j], deadline));
            }
            match spawn(path, self.op) {
                Ok(call) => {
                    self.in_flight.insert(path.clone(), call);
                    active.push_back(i);
                }
                Err(e) => outcomes[i] = Some(Outcome::SpawnFailed(e)),
            }
        }
        for j in active {
            outcomes[j] = Some(self.collect(&paths[j], deadline));
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Outcome::SpawnFailed(io::Error::other("internal: no outcome recorded"))
                })
            })
            .collect()
    }

    /// Wait until `deadline` for the call on `path` this run started.
    fn collect(&mut self, path: &Path, deadline: Instant) -> Outcome {
        let Some(call) = self.in_flight.get(path) else {
            return Outcome::SpawnFailed(io::Error::other("internal: no statfs call in flight"));
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match call.rx.recv_timeout(left) {
            Ok((result, elapsed)) => {
                self.finish(path);
                Outcome::Done { result, elapsed }
            }
            Err(RecvTimeoutError::Timeout) => Outcome::Hung {
                waiting: call.started.elapsed(),
                new: true,
            },
            Err(RecvTimeoutError::Disconnected) => {
                self.finish(path);
                Outcome::Done {
                    result: Err(io::Error::other(
                        "statfs worker thread ended without a result",
                    )),
                    elapsed: Duration::ZERO,
                }
            }
        }
    }

    /// statfs calls started by earlier probes that have not returned yet.
    pub fn stuck(&mut self) -> usize {
        self.reap();
        self.in_flight.len()
    }

    /// Forget (and join) every call that has returned since it was started.
    fn reap(&mut self) {
        let done: Vec<PathBuf> = self
            .in_flight
            .iter()
            .filter(|(_, c)| !matches!(c.rx.try_recv(), Err(TryRecvError::Empty)))
            .map(|(p, _)| p.clone())
            .collect();
        for path in done {
            self.finish(&path);
        }
    }

    fn finish(&mut self, path: &Path) {
        if let Some(call) = self.in_flight.remove(path) {
            // The worker has sent its result and is returning; joining keeps the thread
            // count exact. A panicking worker has nothing left to clean up.
            let _ = call.handle.join();
        }
    }
}

fn spawn(path: &Path, op: StatfsFn) -> io::Result<InFlight> {
    let (tx, rx) = mpsc::sync_channel(1);
    let owned = path.to_owned();
    let handle = std::thread::Builder::new()
        .name(WORKER_THREAD_NAME.into())
        .stack_size(WORKER_STACK_BYTES)
        .spawn(move || {
            let started = Instant::now();
            let result = op(&owned);
            // The receiver may be gone (prober dropped); nothing to do then.
            let _ = tx.send((result, started.elapsed()));
        })?;
    Ok(InFlight {
        started: Instant::now(),
        rx,
        handle,
    })
}

/// A short name for well-known magic numbers, for messages.
pub fn magic_name(magic: u64) -> Option<&'static str> {
    Some(match magic {
        LL_SUPER_MAGIC => "lustre",
        0x0102_1994 => "tmpfs",
        0xEF53 => "ext2/3/4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x794C_7630 => "overlayfs",
        0x4750_4653 => "gpfs",
        0x2FC1_2FC1 => "zfs",
        0x5346_544E => "ntfs",
        0xFF53_4D42 => "cifs",
        0x0100_2420 => "beegfs",
        0x9FA0 => "proc",
        0x6265_6572 => "sysfs",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statfs_of_a_real_directory_is_sane() {
        let dir = tempfile::tempdir().unwrap();
        let info = statfs(dir.path()).unwrap();
        assert!(info.blocks >= info.blocks_free);
        assert!(info.blocks_free >= info.blocks_available);
        assert!(info.block_size > 0);
        assert_ne!(info.fs_type, LL_SUPER_MAGIC);
    }

    #[test]
    fn statfs_of_a_missing_path_is_enoent() {
        let e = statfs(Path::new("/nonexistent/fabricgate/x")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn pool_returns_results_and_keeps_no_threads() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let mut pool = StatfsPool::new();
        let paths = vec![
            a.path().to_owned(),
            b.path().to_owned(),
            PathBuf::from("/nonexistent/x"),
        ];
        for _ in 0..3 {
            let out = pool.run(&paths, Duration::from_secs(5));
            assert_eq!(out.len(), 3);
            assert!(
                matches!(out[0], Outcome::Done { result: Ok(_), .. }),
                "{out:?}"
            );
            assert!(
                matches!(out[1], Outcome::Done { result: Ok(_), .. }),
                "{out:?}"
            );
            assert!(
                matches!(out[2], Outcome::Done { result: Err(_), .. }),
                "{out:?}"
            );
            assert_eq!(pool.stuck(), 0);
        }
    }

    static GATE: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    static OPENED: std::sync::Condvar = std::sync::Condvar::new();
    static HANG_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// Like statfs, but a path named `hang` blocks until the gate opens.
    fn gated(path: &Path) -> io::Result<StatfsInfo> {
        if path.ends_with("hang") {
            HANG_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut open = GATE.lock().unwrap();
            while !*open {
                open = OPENED.wait(open).unwrap();
            }
        }
        statfs(Path::new("/"))
    }

    #[test]
    fn a_stuck_call_is_never_repeated_and_the_deadline_is_shared() {
        let mut pool = StatfsPool {
            in_flight: HashMap::new(),
            op: gated,
        };
        let paths = vec![
            PathBuf::from("/a/hang"),
            PathBuf::from("/"),
            PathBuf::from("/b/hang"),
        ];
        let timeout = Duration::from_millis(200);
        let started = Instant::now();
        let out = pool.run(&paths, timeout);
        let took = started.elapsed();
        assert!(took >= timeout && took < timeout * 5, "{took:?}");
        assert!(matches!(out[0], Outcome::Hung { new: true, .. }), "{out:?}");
        assert!(
            matches!(out[1], Outcome::Done { result: Ok(_), .. }),
            "{out:?}"
        );
        assert!(matches!(out[2], Outcome::Hung { new: true, .. }), "{out:?}");
        for _ in 0..50 {
            let started = Instant::now();
            let out = pool.run(&paths, timeout);
            // Nothing new to wait for: the stuck calls are reported at once.
            assert!(started.elapsed() < timeout, "{:?}", started.elapsed());
            assert!(
                matches!(out[0], Outcome::Hung { new: false, .. }),
                "{out:?}"
            );
            assert!(
                matches!(out[2], Outcome::Hung { new: false, .. }),
                "{out:?}"
            );
        }
        assert_eq!(HANG_CALLS.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(pool.stuck(), 2);

        // The server comes back: the stuck calls return, are reaped, and fresh ones succeed.
        *GATE.lock().unwrap() = true;
        OPENED.notify_all();
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.stuck() > 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        let out = pool.run(&paths, timeout);
        assert!(
            out.iter()
                .all(|o| matches!(o, Outcome::Done { result: Ok(_), .. })),
            "{out:?}"
        );
        assert_eq!(HANG_CALLS.load(std::sync::atomic::Ordering::SeqCst), 4);
    }

    #[test]
    fn magic_names() {
        assert_eq!(magic_name(LL_SUPER_MAGIC), Some("lustre"));
        assert_eq!(magic_name(0x0102_1994), Some("tmpfs"));
        assert_eq!(magic_name(1), None);
    }

    static RUNNING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static MOST: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// Counts how many calls run at once, each lasting a millisecond.
    fn counted(_: &Path) -> io::Result<StatfsInfo> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = RUNNING.fetch_add(1, SeqCst) + 1;
        MOST.fetch_max(now, SeqCst);
        std::thread::sleep(Duration::from_millis(1));
        RUNNING.fetch_sub(1, SeqCst);
        Err(io::Error::from(io::ErrorKind::NotFound))
    }

    #[test]
    fn thousands_of_mounts_run_at_most_max_concurrent_at_a_time() {
        let mut pool = StatfsPool {
            op: counted,
            ..StatfsPool::default()
        };
        let paths: Vec<PathBuf> = (0..1000)
            .map(|i| PathBuf::from(format!("/m/{i}")))
            .collect();
        let out = pool.run(&paths, Duration::from_secs(30));
        assert_eq!(out.len(), 1000);
        assert!(
            out.iter()
                .all(|o| matches!(o, Outcome::Done { result: Err(_), .. }))
        );
        let most = MOST.load(std::sync::atomic::Ordering::SeqCst);
        assert!((2..=MAX_CONCURRENT).contains(&most), "{most} calls at once");
        assert_eq!(pool.stuck(), 0);
    }
}
