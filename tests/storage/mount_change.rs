//! The mount table is parsed again only when the kernel says it changed,
//! seen with a real mount: in a private mount namespace (`unshare -m`, needs root) a tmpfs is
//! mounted and unmounted under a required path while one `StorageProber` probes through
//! `--proc-root /proc`. Each change is parsed exactly once and seen at the next probe; probes
//! in between reuse the table.
//!
//! The namespace is made by running this test binary again under `unshare`, with only the
//! ignored inner test selected: nothing else mounts in that namespace, so the counts are
//! exact.

use crate::common;

use fabricgate_probes::Roots;
use fabricgate_probes::storage::{MountSpec, MountStatus, StorageConfig, StorageProber};
use std::path::Path;
use std::process::Command;

/// Set (to the directory to mount on) in the re-executed test binary.
const INNER: &str = "FABRICGATE_MOUNT_CHANGE_DIR";

#[test]
fn a_real_mount_change_is_parsed_once_and_an_unchanged_table_never() {
    if !common::require_unshare_mounts() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &common::test_path(module_path!(), "in_a_private_namespace"),
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(INNER, tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The inner test really ran (a filter that matched nothing would pass too).
    assert!(stdout.contains("1 passed"), "{stdout}\n{stderr}");
    assert!(stdout.contains("MOUNT-CHANGE-SEEN"), "{stdout}\n{stderr}");
}

fn mount(args: &[&str], dir: &Path) {
    let ok = Command::new(args[0])
        .args(&args[1..])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "{args:?} {} failed", dir.display());
}

#[test]
#[ignore = "run inside a private mount namespace by a_real_mount_change_is_parsed_once_and_an_unchanged_table_never"]
fn in_a_private_namespace() {
    let Some(dir) = std::env::var_os(INNER) else {
        panic!("run only by a_real_mount_change_is_parsed_once_and_an_unchanged_table_never");
    };
    let dir = Path::new(&dir);
    let roots = Roots::new("/sys", "/proc");
    let mut prober = StorageProber::new(StorageConfig {
        required: vec![MountSpec {
            path: dir.to_owned(),
            fstype: Some("tmpfs".into()),
            writable: true,
            min_free_percent: 0.0,
        }],
        all_lustre: false,
        ..StorageConfig::default()
    });
    let status = |p: &mut StorageProber| p.probe(&roots).mounts[0].status;

    assert_eq!(status(&mut prober), MountStatus::Missing);
    assert_eq!(prober.mount_table_parses(), 1);
    for _ in 0..3 {
        assert_eq!(status(&mut prober), MountStatus::Missing);
    }
    assert_eq!(
        prober.mount_table_parses(),
        1,
        "an unchanged table was parsed again"
    );

    mount(&["mount", "-t", "tmpfs", "fg-change"], dir);
    assert_eq!(status(&mut prober), MountStatus::Ok);
    assert_eq!(
        prober.mount_table_parses(),
        2,
        "the new mount was not parsed once"
    );
    for _ in 0..3 {
        assert_eq!(status(&mut prober), MountStatus::Ok);
    }
    assert_eq!(prober.mount_table_parses(), 2);

    mount(&["umount"], dir);
    assert_eq!(status(&mut prober), MountStatus::Missing);
    assert_eq!(
        prober.mount_table_parses(),
        3,
        "the unmount was not parsed once"
    );
    assert_eq!(status(&mut prober), MountStatus::Missing);
    assert_eq!(prober.mount_table_parses(), 3);
    println!("MOUNT-CHANGE-SEEN");
}
