//! The storage probe: Lustre fixture trees, real tmpfs mounts (root), a real hung FUSE mount
//! (root + FUSE) and a real mount-table change (root), and their SKIP/CI rules.

mod common;

// `storage_fuse` and `mount_change` count threads and parses of their own process: each runs
// its test again in a child process of this binary (`--exact`, one test thread), so the
// other tests running in this process beside them do not change those counts.
#[path = "storage/mount_change.rs"]
mod mount_change;
#[path = "storage/storage_fixtures.rs"]
mod storage_fixtures;
#[path = "storage/storage_fuse.rs"]
mod storage_fuse;
#[path = "storage/storage_tmpfs.rs"]
mod storage_tmpfs;
