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
}
