//! A one-HCA sysfs tree in a tempdir whose port can be flipped up and down, in the kernel's
//! formats (`class/infiniband/<dev>` is a symlink into `devices/`, as on a real system).

use std::path::{Path, PathBuf};

pub struct FakeHca {
    dir: tempfile::TempDir,
    port_dir: PathBuf,
}

impl FakeHca {
    /// `mlx5_0` with one 400 Gb/s NDR InfiniBand port (LID 7), up when `up`.
    pub fn new(up: bool) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let sys = dir.path().join("sys");
        let dev_rel = "devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0";
        let dev = sys.join(dev_rel);
        let port_dir = dev.join("ports/1");
        std::fs::create_dir_all(&port_dir).expect("mkdir port");
        std::fs::create_dir_all(sys.join("class/infiniband")).expect("mkdir class");
        std::os::unix::fs::symlink(
            format!("../../{dev_rel}"),
            sys.join("class/infiniband/mlx5_0"),
        )
        .expect("symlink");
        std::fs::write(dev.join("node_type"), "1: CA\n").expect("node_type");
        std::fs::write(port_dir.join("rate"), "400 Gb/sec (4X NDR)\n").expect("rate");
        std::fs::write(port_dir.join("link_layer"), "InfiniBand\n").expect("link_layer");
        std::fs::write(port_dir.join("phys_state"), "5: LinkUp\n").expect("phys_state");
        std::fs::write(port_dir.join("lid"), "0x7\n").expect("lid");
        // A real kernel always has a mount table; this one has no shared file system.
        std::fs::create_dir_all(dir.path().join("proc/self")).expect("mkdir proc");
        std::fs::write(
            dir.path().join("proc/self/mountinfo"),
            "21 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n\
             22 21 0:20 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw\n",
        )
        .expect("mountinfo");
        let hca = Self { dir, port_dir };
        hca.set_port(up);
        hca
    }

    pub fn sysfs_root(&self) -> PathBuf {
        self.dir.path().join("sys")
    }

    pub fn proc_root(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    /// A scratch directory that lives as long as the tree.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// Flip the port's logical state; written by rename so a probe never sees half a file.
    pub fn set_port(&self, up: bool) {
        let text = if up { "4: ACTIVE\n" } else { "1: DOWN\n" };
        let tmp = self.port_dir.join(".state.tmp");
        std::fs::write(&tmp, text).expect("write state");
        std::fs::rename(&tmp, self.port_dir.join("state")).expect("rename state");
    }
}
