//! For the storage tests: a scratch procfs root with a hand-written mountinfo, root-only
//! tmpfs mounts that clean up after themselves, thread counts.

use std::path::Path;
use std::process::Command;

/// A procfs root whose `self/mountinfo` holds `lines` (the fixture's table plus extras).
pub struct ProcRoot {
    pub dir: tempfile::TempDir,
}

impl ProcRoot {
    pub fn new(mountinfo: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("self")).unwrap();
        std::fs::write(dir.path().join("self/mountinfo"), mountinfo).unwrap();
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// A mountinfo line for `path` with the given type and options, escaped like the kernel does.
pub fn mountinfo_line(id: u32, path: &Path, fstype: &str, source: &str, opts: &str) -> String {
    let mut escaped = String::new();
    for c in path.to_string_lossy().chars() {
        match c {
            ' ' => escaped.push_str("\\040"),
            '\t' => escaped.push_str("\\011"),
            '\n' => escaped.push_str("\\012"),
            '\\' => escaped.push_str("\\134"),
            c => escaped.push(c),
        }
    }
    format!("{id} 28 0:{id} / {escaped} {opts},relatime shared:{id} - {fstype} {source} {opts}\n")
}

/// A tmpfs mounted by the test (needs root), unmounted on drop even if the test fails.
pub struct TmpfsMount {
    dir: tempfile::TempDir,
}

impl TmpfsMount {
    pub fn new(options: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "fabricgate-test"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(
            status.success(),
            "mount -t tmpfs -o {options} failed: {status}"
        );
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Threads of this process whose name is `name` (from /proc/self/task/*/comm).
pub fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .count()
}

/// All threads of this process.
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}
