//! Runtime facts per pod (issue 42): which processes hold RDMA queue pairs, and which pod
//! each process belongs to. Pure parsers and thin readers; the agent joins them with the
//! pods it watches.
//!
//! - [`cgroup`]: `/proc/<pid>/cgroup` → pod UID and container ID ([`pod_of_pid`]).

pub mod cgroup;

use crate::Roots;
use crate::error::{ProbeError, Result};
use cgroup::CgroupOwner;
use std::io;

/// Whose cgroup process `pid` is in; `Ok(None)` when the process is gone (it exited between
/// the QP dump and this read: its QPs are gone with it).
///
/// # Errors
/// [`ProbeError::Read`] for any other failure to read `<procfs>/<pid>/cgroup`.
pub fn pod_of_pid(roots: &Roots, pid: u32) -> Result<Option<CgroupOwner>> {
    let path = roots.proc(format!("{pid}/cgroup"));
    match crate::sysfs_io::read_to_string(&path) {
        Ok(text) => Ok(Some(cgroup::parse_proc_cgroup(&text))),
        // ESRCH: the process became a zombie after the open.
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            Ok(None)
        }
        Err(e) => Err(ProbeError::read(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_read_through_roots_and_a_pid_gone() {
        let dir = tempfile::tempdir().unwrap();
        let proc = dir.path().join("proc");
        std::fs::create_dir_all(proc.join("120")).unwrap();
        std::fs::write(
            proc.join("120/cgroup"),
            "0::/kubepods/besteffort/pod5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f/abc\n",
        )
        .unwrap();
        let roots = Roots::new(dir.path().join("sys"), &proc);
        let Some(CgroupOwner::Pod(pod)) = pod_of_pid(&roots, 120).unwrap() else {
            panic!("pid 120 is in a pod");
        };
        assert_eq!(pod.pod_uid, "5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f");
        assert_eq!(pod.container_id.as_deref(), Some("abc"));
        // Exited between the dump and the read: gone, not an error.
        assert_eq!(pod_of_pid(&roots, 121).unwrap(), None);
    }

    /// This test process is not in a pod (nor gone) on the live procfs.
    #[test]
    fn the_live_procfs_answers_for_this_process() {
        let roots = Roots::new("/sys", "/proc");
        let owner = pod_of_pid(&roots, std::process::id()).unwrap();
        assert!(owner.is_some());
    }
}
