//! Bounded probe I/O through the real `fabricgate check` binary: a FIFO
//! where `rate` should be and a symlink to `/dev/zero` as an attribute end the check within
//! seconds, with the attribute named; a mount table with non-UTF-8 mount points and one with
//! 10,000 Lustre entries are read, never rejected as a whole.

use crate::common;

use common::{check_json_args, fixture, report_port};
use serde_json::Value;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Run {
    code: Option<i32>,
    json: Value,
    stderr: String,
    took: Duration,
}

/// `fabricgate check --format json` with a hard deadline: a hang is a failure, not a stuck
/// test. The address space is capped at 2 GiB, so a read that grows without bound fails the
/// run instead of the machine.
fn check(sys: &Path, proc: &Path, config_yaml: &str, deadline: Duration) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fabricgate.yaml");
    std::fs::write(&config, config_yaml).unwrap();
    // Files, not pipes: a large report must not fill a pipe nobody reads yet.
    let stdout_path = dir.path().join("stdout");
    let stderr_path = dir.path().join("stderr");
    let started = Instant::now();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg("ulimit -v 2097152 && exec \"$@\"")
        .arg("fabricgate")
        .arg(env!("CARGO_BIN_EXE_fabricgate"))
        .args(check_json_args(sys, proc, &config))
        .stdout(Stdio::from(std::fs::File::create(&stdout_path).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&stderr_path).unwrap()))
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fabricgate check did not finish within {deadline:?}: the probe blocked");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    let stdout = std::fs::read(&stdout_path).unwrap();
    let stderr = std::fs::read(&stderr_path).unwrap();
    Run {
        code: status.code(),
        json: serde_json::from_slice(&stdout).unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        took,
    }
}

const NDR: &str = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 7\n  min_rate_gbps: 400\n  link_layer: InfiniBand\nlustre: {all_lustre: false}\n";

/// The real path of `class/infiniband/<dev>/ports/<n>` in a copied tree.
fn port_dir(sys: &Path, dev: &str, n: u32) -> PathBuf {
    std::fs::canonicalize(sys.join("class/infiniband").join(dev))
        .unwrap()
        .join("ports")
        .join(n.to_string())
}

#[test]
fn a_fifo_where_rate_should_be_is_reported_not_waited_on() {
    let tmp = tempfile::tempdir().unwrap();
    common::copy_tree(&fixture("ndr-8x400-healthy"), tmp.path());
    let sys = tmp.path().join("sys");
    let rate = port_dir(&sys, "mlx5_0", 1).join("rate");
    std::fs::remove_file(&rate).unwrap();
    let made = Command::new("mkfifo").arg(&rate).status().unwrap();
    assert!(made.success(), "mkfifo {}", rate.display());

    let r = check(&sys, &tmp.path().join("proc"), NDR, Duration::from_secs(20));
    assert!(r.took < Duration::from_secs(10), "took {:?}", r.took);
    assert_eq!(
        r.code,
        Some(0),
        "one port lost of 8, 7 required: {}",
        r.stderr
    );
    let p = report_port(&r.json, "mlx5_0", 1);
    assert!(p["rate"].is_null(), "{p:#}");
    let errors = p["errors"].to_string();
    assert!(
        errors.contains("FIFO") && errors.contains("mlx5_0/ports/1/rate"),
        "the FIFO is named: {errors}"
    );
    // The other ports are read as usual.
    assert_eq!(report_port(&r.json, "mlx5_1", 1)["rate_gbps"], 400.0);
}

#[test]
fn an_attribute_linked_to_dev_zero_is_reported_without_growing() {
    let tmp = tempfile::tempdir().unwrap();
    common::copy_tree(&fixture("ndr-8x400-healthy"), tmp.path());
    let sys = tmp.path().join("sys");
    let dir = port_dir(&sys, "mlx5_2", 1);
    for name in ["state", "counters/port_xmit_data"] {
        let path = dir.join(name);
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    }

    let r = check(&sys, &tmp.path().join("proc"), NDR, Duration::from_secs(20));
    assert!(r.took < Duration::from_secs(10), "took {:?}", r.took);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let p = report_port(&r.json, "mlx5_2", 1);
    assert!(p["state"].is_null(), "{p:#}");
    assert!(p["counters"].get("port_xmit_data").is_none(), "{p:#}");
    let errors = p["errors"].to_string();
    for name in ["ports/1/state", "counters/port_xmit_data"] {
        assert!(
            errors.contains("character device") && errors.contains(name),
            "{name} is named: {errors}"
        );
    }
    // The unreadable state costs that port only: 7 of 8 ports still count.
    assert_eq!(r.json["ready"], true, "{:#}", r.json);
}

/// A `mountinfo` line for a mount of `fstype` at `point` (raw bytes: the kernel prints
/// non-UTF-8 bytes as they are).
fn line(out: &mut Vec<u8>, id: u32, point: &[u8], fstype: &str, source: &[u8]) {
    out.extend_from_slice(format!("{id} 25 0:{id} / ").as_bytes());
    out.extend_from_slice(point);
    out.extend_from_slice(format!(" rw,relatime shared:{id} - {fstype} ").as_bytes());
    out.extend_from_slice(source);
    out.extend_from_slice(b" rw,flock,lazystatfs\n");
}

#[test]
fn non_utf8_mount_points_do_not_hide_the_mount_table() {
    let tmp = tempfile::tempdir().unwrap();
    let sys = tmp.path().join("sys");
    std::fs::create_dir_all(&sys).unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut table = b"25 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n".to_vec();
    line(&mut table, 30, b"/mnt/caf\xe9", "tmpfs", b"none");
    line(
        &mut table,
        31,
        b"/home/\xff\xfe/scratch",
        "nfs4",
        b"nfs1:/export/\xff",
    );
    line(
        &mut table,
        32,
        data.as_os_str().as_bytes(),
        "nfs4",
        b"nfs1:/export/data",
    );
    std::fs::create_dir_all(tmp.path().join("proc/self")).unwrap();
    std::fs::write(tmp.path().join("proc/self/mountinfo"), &table).unwrap();

    let config = format!(
        "rdma: {{min_active_ports: 0}}\nlustre: {{all_lustre: false}}\nmounts:\n  - path: {}\n    fstype: nfs4\n",
        data.display()
    );
    let r = check(
        &sys,
        &tmp.path().join("proc"),
        &config,
        Duration::from_secs(20),
    );
    let storage = &r.json["lustre"];
    assert_eq!(r.code, Some(0), "{:#} {}", r.json, r.stderr);
    assert_eq!(storage["mounts"][0]["status"], "ok", "{storage:#}");
    assert!(!r.json.to_string().contains("MountTable"), "{:#}", r.json);
}

#[test]
fn ten_thousand_lustre_mounts_are_checked_in_seconds() {
    let tmp = tempfile::tempdir().unwrap();
    let sys = tmp.path().join("sys");
    std::fs::create_dir_all(&sys).unwrap();
    let mut table = b"25 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n".to_vec();
    for i in 0..10_000u32 {
        let point = format!("/lustre/project{i:05}");
        line(
            &mut table,
            100 + i,
            point.as_bytes(),
            "lustre",
            b"10.1.1.1@o2ib:/proj",
        );
    }
    // The same point mounted twice: checked once.
    line(
        &mut table,
        20_000,
        b"/lustre/project00000",
        "lustre",
        b"10.1.1.1@o2ib:/proj",
    );
    std::fs::create_dir_all(tmp.path().join("proc/self")).unwrap();
    std::fs::write(tmp.path().join("proc/self/mountinfo"), &table).unwrap();

    let r = check(
        &sys,
        &tmp.path().join("proc"),
        "rdma: {min_active_ports: 0}\n",
        Duration::from_secs(60),
    );
    assert!(r.took < Duration::from_secs(30), "took {:?}", r.took);
    let mounts = r.json["lustre"]["mounts"].as_array().unwrap();
    assert_eq!(mounts.len(), 10_000);
    // None of these paths exists here: each is an error of its own, the table is fine.
    assert_eq!(r.code, Some(1));
    assert!(!r.json.to_string().contains("MountTable"));
}

/// A real mount point whose name holds a 0xff byte, in a private mount namespace (`unshare
/// -m`, needs root): the live `/proc/self/mountinfo` prints the byte unescaped, and the
/// check still reads the table and finds the required mount next to it.
#[test]
fn a_real_non_utf8_mount_point_in_a_private_namespace() {
    if !common::require_unshare_mounts() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let sys = tmp.path().join("sys");
    std::fs::create_dir_all(&sys).unwrap();
    let odd = tmp.path().join(OsStr::from_bytes(b"caf\xe9 \xff\\dir"));
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    let config = tmp.path().join("fabricgate.yaml");
    std::fs::write(
        &config,
        format!(
            "rdma: {{min_active_ports: 0}}\nlustre: {{all_lustre: false}}\nmounts:\n  - path: {}\n    fstype: tmpfs\n",
            data.display()
        ),
    )
    .unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "bash", "-c"])
        .arg(
            "mount -t tmpfs fg-odd \"$1\" && mount -t tmpfs fg-data \"$2\" && \
             grep -c fg-odd /proc/self/mountinfo >&2 && shift 2 && exec \"$@\"",
        )
        .arg("fabricgate")
        .arg(&odd)
        .arg(&data)
        .arg(env!("CARGO_BIN_EXE_fabricgate"))
        .args(check_json_args(&sys, Path::new("/proc"), &config))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let json: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert!(
        stderr.starts_with('1'),
        "the odd tmpfs is in the table: {stderr}"
    );
    assert_eq!(out.status.code(), Some(0), "{json:#} {stderr}");
    let m = &json["lustre"]["mounts"][0];
    assert_eq!(m["status"], "ok", "{json:#}");
    assert_eq!(m["fstype"], "tmpfs");
    assert!(!json.to_string().contains("MountTable"), "{json:#}");
}
