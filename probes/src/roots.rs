//! The one place where filesystem roots are decided, so every probe can run against a fixture
//! tree (the same idea as node_exporter's `--path.sysfs` / `--path.procfs`).

use std::path::{Path, PathBuf};

/// Roots of the pseudo file systems the probes read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    sysfs: PathBuf,
    procfs: PathBuf,
    /// Root of the device nodes (`/dev`); only `fabricgate preflight` looks there.
    devfs: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Self::new("/sys", "/proc")
    }
}

impl Roots {
    pub fn new(sysfs: impl Into<PathBuf>, procfs: impl Into<PathBuf>) -> Self {
        Self {
            sysfs: sysfs.into(),
            procfs: procfs.into(),
            devfs: PathBuf::from("/dev"),
        }
    }

    /// The same roots with device nodes looked up under `devfs` instead of `/dev`.
    #[must_use]
    pub fn with_devfs(mut self, devfs: impl Into<PathBuf>) -> Self {
        self.devfs = devfs.into();
        self
    }

    pub fn devfs_root(&self) -> &Path {
        &self.devfs
    }

    /// `<devfs>/<rel>`; `rel` is relative to `/dev` (e.g. `infiniband/uverbs0`).
    pub fn dev(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.devfs.join(strip_root(rel.as_ref()))
    }

    /// True when both roots are the live system ones; verbs and statfs only make sense then.
    pub fn is_live(&self) -> bool {
        self.sysfs == Path::new("/sys") && self.procfs == Path::new("/proc")
    }

    pub fn sysfs_root(&self) -> &Path {
        &self.sysfs
    }

    pub fn procfs_root(&self) -> &Path {
        &self.procfs
    }

    /// `<sysfs>/<rel>`; `rel` is relative to the sysfs mount point (e.g. `class/infiniband`).
    pub fn sys(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.sysfs.join(strip_root(rel.as_ref()))
    }

    /// `path` (under the sysfs root) with every symlink resolved, as `fs::canonicalize` gives
    /// it; an error when it dangles, cannot be read, or leaves the sysfs root (a fixture
    /// tree's links stay inside the tree, as the kernel's stay inside `/sys`).
    ///
    /// # Errors
    /// The I/O error of resolving either path, or `InvalidData` when the target is outside.
    pub fn resolve_sys(&self, path: &Path) -> std::io::Result<PathBuf> {
        self.resolve_sys_under(path, &self.canonical_sysfs_root()?)
    }

    /// The sysfs root with every symlink resolved.
    ///
    /// # Errors
    /// The I/O error of resolving it.
    pub fn canonical_sysfs_root(&self) -> std::io::Result<PathBuf> {
        std::fs::canonicalize(&self.sysfs)
    }

    /// [`Roots::resolve_sys`] with the root already resolved ([`Roots::canonical_sysfs_root`]),
    /// for callers that resolve many paths.
    ///
    /// # Errors
    /// As [`Roots::resolve_sys`].
    pub fn resolve_sys_under(&self, path: &Path, root: &Path) -> std::io::Result<PathBuf> {
        let target = std::fs::canonicalize(path)?;
        if target.starts_with(root) {
            Ok(target)
        } else {
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "resolves to {}, outside the sysfs root {}",
                    target.display(),
                    root.display()
                ),
            ))
        }
    }

    /// `<procfs>/<rel>`; `rel` is relative to the procfs mount point (e.g. `self/mountinfo`).
    pub fn proc(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.procfs.join(strip_root(rel.as_ref()))
    }
}

fn strip_root(path: &Path) -> &Path {
    path.strip_prefix("/").unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_relative_and_absolute_paths_under_the_root() {
        let roots = Roots::new("/tmp/fx/sys", "/tmp/fx/proc");
        assert_eq!(
            roots.sys("class/infiniband"),
            PathBuf::from("/tmp/fx/sys/class/infiniband")
        );
        assert_eq!(
            roots.proc("/self/mountinfo"),
            PathBuf::from("/tmp/fx/proc/self/mountinfo")
        );
        assert!(!roots.is_live());
        assert!(Roots::default().is_live());
        assert_eq!(
            roots.dev("infiniband/uverbs0"),
            PathBuf::from("/dev/infiniband/uverbs0")
        );
        let roots = roots.with_devfs("/tmp/fx/dev");
        assert_eq!(
            roots.dev("/infiniband/uverbs0"),
            PathBuf::from("/tmp/fx/dev/infiniband/uverbs0")
        );
    }

    #[test]
    fn resolve_sys_follows_links_inside_the_root_only() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        std::fs::create_dir_all(sys.join("devices/pci0000:00/0000:3b:00.0")).unwrap();
        std::fs::create_dir_all(sys.join("class")).unwrap();
        let roots = Roots::new(&sys, dir.path().join("proc"));
        let inside = sys.join("class/inside");
        std::os::unix::fs::symlink("../devices/pci0000:00/0000:3b:00.0", &inside).unwrap();
        let want = std::fs::canonicalize(sys.join("devices/pci0000:00/0000:3b:00.0")).unwrap();
        assert_eq!(roots.resolve_sys(&inside).unwrap(), want);
        let outside = sys.join("class/outside");
        std::os::unix::fs::symlink("../..", &outside).unwrap();
        let e = roots.resolve_sys(&outside).unwrap_err();
        assert!(e.to_string().contains("outside the sysfs root"), "{e}");
        let dangling = sys.join("class/dangling");
        std::os::unix::fs::symlink("../devices/gone", &dangling).unwrap();
        assert_eq!(
            roots.resolve_sys(&dangling).unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
    }
}
