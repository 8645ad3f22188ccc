//! statfs on real tmpfs mounts the test creates (needs root for mount(2); skipped with a
//! reason outside CI, required in CI).

use crate::common;

use common::storage::{ProcRoot, TmpfsMount, mountinfo_line};
use common::{fixture, require_root};
use fabricgate::config::Config;
use fabricgate_probes::storage::{MountSpec, MountStatus, StorageConfig, StorageProber};
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use std::io::Write;

fn spec(m: &TmpfsMount, min_free_percent: f64) -> MountSpec {
    MountSpec {
        path: m.path().to_owned(),
        fstype: Some("tmpfs".into()),
        writable: true,
        min_free_percent,
    }
}

fn live_probe(specs: Vec<MountSpec>) -> fabricgate_probes::storage::StorageReport {
    let mut p = StorageProber::new(StorageConfig {
        required: specs,
        all_lustre: false,
        ..StorageConfig::default()
    });
    p.probe(&Roots::default())
}

#[test]
fn lustre_entry_pointing_at_a_real_tmpfs_is_wrong_type() {
    if !require_root("mount -t tmpfs") {
        return;
    }
    let tmpfs = TmpfsMount::new("size=8m");
    // The fixture's table, with the Lustre line's mount point moved onto the real tmpfs: the
    // table says lustre, statfs says TMPFS_MAGIC.
    let table = std::fs::read_to_string(fixture("lustre-healthy/proc/self/mountinfo")).unwrap();
    let table = table.replace(
        " /lustre/scratch ",
        &format!(" {} ", tmpfs.path().display()),
    );
    let proc = ProcRoot::new(&table);
    let sys = fixture("lustre-healthy/sys");
    let yaml = format!(
        "rdma: {{min_active_ports: 0}}\nlustre:\n  mounts: [\"{}\"]\n",
        tmpfs.path().display()
    );
    let config = Config::parse(&yaml).unwrap();
    let mut prober = Prober::new(
        Roots::new(&sys, proc.path()),
        ProbeConfig {
            collectors: fabricgate::checks::registered().collectors(&config),
            ..ProbeConfig::default()
        },
    );
    let report = prober.probe();
    let m = &common::storage_of(&report).mounts[0];
    assert_eq!(m.status, MountStatus::WrongType, "{m:#?}");
    assert_eq!(m.fstype.as_deref(), Some("lustre"));
    assert_eq!(m.fs_magic.as_deref(), Some("0x01021994"));
    assert!(m.message.contains("(tmpfs)"), "{}", m.message);
    assert!(
        m.message.contains("LL_SUPER_MAGIC 0x0bd00bd0"),
        "{}",
        m.message
    );
    assert!(m.statfs_seconds.is_some());
    let v = common::evaluate(&report, &config);
    assert_eq!(common::lustre(&v).findings[0].code, "WrongFilesystemType");
    assert!(!common::lustre(&v).ready);
}

#[test]
fn writable_tmpfs_is_ok_with_capacity() {
    if !require_root("mount -t tmpfs") {
        return;
    }
    let tmpfs = TmpfsMount::new("size=8m,nr_inodes=1000");
    let r = live_probe(vec![spec(&tmpfs, 5.0)]);
    let m = &r.mounts[0];
    assert_eq!(m.status, MountStatus::Ok, "{m:#?}");
    assert_eq!(m.read_only, Some(false));
    assert_eq!(m.source.as_deref(), Some("fabricgate-test"));
    let c = m.capacity.as_ref().unwrap();
    assert_eq!(c.total_bytes, 8 * 1024 * 1024);
    assert_eq!(c.total_inodes, Some(1000));
    assert!(c.available_percent.unwrap() > 99.0);
}

#[test]
fn read_only_tmpfs_is_read_only() {
    if !require_root("mount -t tmpfs") {
        return;
    }
    let tmpfs = TmpfsMount::new("ro,size=1m");
    let r = live_probe(vec![spec(&tmpfs, 0.0)]);
    let m = &r.mounts[0];
    assert_eq!(m.status, MountStatus::ReadOnly, "{m:#?}");
    assert_eq!(m.read_only, Some(true));
    // Not a problem where the config allows read-only.
    let mut allowed = spec(&tmpfs, 0.0);
    allowed.writable = false;
    assert_eq!(live_probe(vec![allowed]).mounts[0].status, MountStatus::Ok);
}

#[test]
fn filled_tmpfs_is_full_below_the_floor() {
    if !require_root("mount -t tmpfs") {
        return;
    }
    let tmpfs = TmpfsMount::new("size=1m");
    let mut f = std::fs::File::create(tmpfs.path().join("fill")).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    // Write until ENOSPC.
    while f.write_all(&chunk).is_ok() {}
    drop(f);
    let r = live_probe(vec![spec(&tmpfs, 10.0)]);
    let m = &r.mounts[0];
    assert_eq!(m.status, MountStatus::Full, "{m:#?}");
    assert!(
        m.message.contains("below the required 10%"),
        "{}",
        m.message
    );
    // A floor of 0 disables the check.
    assert_eq!(
        live_probe(vec![spec(&tmpfs, 0.0)]).mounts[0].status,
        MountStatus::Ok
    );
}

#[test]
fn escaped_mount_point_on_a_real_tmpfs() {
    if !require_root("mount -t tmpfs") {
        return;
    }
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("with space\tand tab");
    std::fs::create_dir(&dir).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "fabricgate-test"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _guard = Unmount(dir.clone());
    // The live table has the kernel's own escapes (\040, \011) for this path.
    let live = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        live.contains("with\\040space\\011and\\040tab"),
        "kernel escaping changed?"
    );
    let r = live_probe(vec![MountSpec {
        path: dir.clone(),
        fstype: Some("tmpfs".into()),
        writable: true,
        min_free_percent: 0.0,
    }]);
    assert_eq!(r.mounts[0].status, MountStatus::Ok, "{:#?}", r.mounts[0]);
    // And the test helper escapes the same way.
    assert!(mountinfo_line(1, &dir, "tmpfs", "x", "rw").contains("with\\040space\\011and\\040tab"));
}
