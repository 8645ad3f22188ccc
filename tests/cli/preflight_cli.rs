//! `fabricgate preflight` through the real binary over `tests/fixtures/pod-4of8`: what an
//! init container sees on an 8 x 400G node when the device plugin gave its pod 4 HCAs
//! (`/dev/infiniband/uverbs0..3`). Verbs are off (no RDMA on the test host; the Soft-RoCE VM
//! test runs preflight with verbs for real).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pod-4of8")
}

const FOUR_NDR: &str = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 4\n  \
                        min_rate_gbps: 400\n  link_layer: InfiniBand\n";

struct Run {
    out: Output,
    dir: tempfile::TempDir,
}

impl Run {
    fn code(&self) -> i32 {
        self.out.status.code().expect("exit code")
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }
    fn termination_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("termination-log")).unwrap_or_default()
    }
    fn nccl(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.path().join("nccl").join(name)).ok()
    }
}

/// Run preflight over the fixture; `proc`/`dev` replace the fixture's folders when given.
fn preflight(
    requirements: &str,
    proc: Option<&Path>,
    dev: Option<&Path>,
    extra: &[&str],
    prepare: impl FnOnce(&Path),
) -> Run {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("nccl")).unwrap();
    prepare(dir.path());
    let fx = fixture();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .arg("preflight")
        .args(["--verbs", "off"])
        .arg("--sysfs-root")
        .arg(fx.join("sys"))
        .arg("--proc-root")
        .arg(proc.map_or_else(|| fx.join("proc"), Path::to_owned))
        .arg("--dev-root")
        .arg(dev.map_or_else(|| fx.join("dev"), Path::to_owned))
        .arg("--nccl-dir")
        .arg(dir.path().join("nccl"))
        .arg("--termination-log")
        .arg(dir.path().join("termination-log"))
        .env("FABRICGATE_REQUIREMENTS", requirements)
        .args(extra)
        .output()
        .unwrap();
    Run { out, dir }
}

/// A copy of the fixture's proc folder with `self/limits` and `self/status` edited.
fn proc_with(dir: &Path, memlock: &str, cap_eff: &str) -> PathBuf {
    let proc = dir.join("proc");
    std::fs::create_dir_all(proc.join("self")).unwrap();
    let src = fixture().join("proc/self");
    for name in ["mountinfo", "limits", "status"] {
        let text = std::fs::read_to_string(src.join(name)).unwrap();
        let text = match name {
            "limits" => text.replace(
                "Max locked memory         unlimited            unlimited ",
                &format!("Max locked memory         {memlock:<20} {memlock:<20}"),
            ),
            "status" => text.replace("CapEff:\t00000000a80425fb", &format!("CapEff:\t{cap_eff}")),
            _ => text,
        };
        std::fs::write(proc.join("self").join(name), text).unwrap();
    }
    proc
}

#[test]
fn four_given_hcas_pass_and_pin_nccl_to_exactly_them() {
    let r = preflight(FOUR_NDR, None, None, &[], |_| {});
    assert_eq!(r.code(), 0, "stdout {} stderr {}", r.stdout(), r.stderr());
    let conf = r.nccl("nccl.conf").expect("nccl.conf written");
    let vars: Vec<&str> = conf.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        vars,
        [
            "NCCL_NET=IB",
            "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
        ]
    );
    let env = r.nccl("nccl.env").expect("nccl.env written");
    assert!(
        env.contains("export NCCL_IB_HCA='=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1'"),
        "{env}"
    );
    // The HCAs sysfs shows but the pod was not given are named, and not counted.
    let err = r.stderr();
    assert!(
        err.contains("mlx5_4: ") && err.contains("dev/infiniband/uverbs4 is not in this container"),
        "{err}"
    );
    assert!(
        r.termination_log()
            .starts_with("fabricgate preflight: validated mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"),
        "{}",
        r.termination_log()
    );
}

#[test]
fn fewer_given_ports_than_required_fail_and_remove_stale_nccl_files() {
    let eight = FOUR_NDR.replace("min_active_ports: 4", "min_active_ports: 8");
    let r = preflight(&eight, None, None, &[], |dir| {
        std::fs::write(dir.join("nccl/nccl.conf"), "NCCL_IB_HCA==mlx5_7:1\n").unwrap();
    });
    assert_eq!(r.code(), 1, "{}", r.stderr());
    assert!(
        r.termination_log()
            .contains("4 usable RDMA ports of 8 required"),
        "{}",
        r.termination_log()
    );
    assert_eq!(r.nccl("nccl.conf"), None, "a stale config must not survive");
    // --min-active-ports overrides the file for pods given part of the node.
    let r = preflight(&eight, None, None, &["--min-active-ports", "4"], |_| {});
    assert_eq!(r.code(), 0, "{}", r.stderr());
}

#[test]
fn no_device_nodes_in_the_pod_names_the_missing_nodes() {
    let empty = tempfile::tempdir().unwrap();
    let r = preflight(FOUR_NDR, None, Some(empty.path()), &[], |_| {});
    assert_eq!(r.code(), 1, "{}", r.stderr());
    let log = r.termination_log();
    assert_eq!(log.lines().count(), 1, "one sentence per problem: {log}");
    assert!(
        log.starts_with("no RDMA device node in this container: "),
        "{log}"
    );
    for n in 0..8 {
        assert!(
            log.contains(&format!("infiniband/uverbs{n} (mlx5_{n})")),
            "{log}"
        );
    }
    assert!(log.contains("device plugin"), "{log}");
    assert_eq!(r.nccl("nccl.conf"), None);
    assert!(
        r.stderr().contains(&log),
        "stderr carries the same sentences"
    );
}

#[test]
fn memlock_64k_without_ipc_lock_fails_naming_memlock() {
    let tmp = tempfile::tempdir().unwrap();
    let proc = proc_with(tmp.path(), "65536", "00000000a80425fb");
    let r = preflight(FOUR_NDR, Some(&proc), None, &[], |_| {});
    assert_eq!(r.code(), 1, "{}", r.stderr());
    let log = r.termination_log();
    assert!(
        log.contains("memlock limit (RLIMIT_MEMLOCK) is 64 KiB (hard 64 KiB)")
            && log.contains("IPC_LOCK"),
        "{log}"
    );
    // The same limit with CAP_IPC_LOCK (bit 14) passes: pinning ignores the limit then.
    let proc = proc_with(&tmp.path().join("cap"), "65536", "00000000a80465fb");
    let r = preflight(FOUR_NDR, Some(&proc), None, &[], |_| {});
    assert_eq!(r.code(), 0, "{}", r.stderr());
    // ...and a lower bar set by flag passes too.
    let proc = proc_with(&tmp.path().join("low"), "65536", "00000000a80425fb");
    let r = preflight(
        FOUR_NDR,
        Some(&proc),
        None,
        &["--min-memlock", "64KiB"],
        |_| {},
    );
    assert_eq!(r.code(), 0, "{}", r.stderr());
}

#[test]
fn a_required_mount_missing_in_the_pod_names_the_path() {
    let req = format!("{FOUR_NDR}mounts:\n  - path: /lustre/scratch\n    fstype: lustre\n");
    let r = preflight(&req, None, None, &[], |_| {});
    assert_eq!(r.code(), 1, "{}", r.stderr());
    let log = r.termination_log();
    assert!(log.starts_with("/lustre/scratch: "), "{log}");
}

#[test]
fn bad_requirements_are_a_usage_error_in_the_termination_log() {
    let r = preflight("rdma:\n  min_port: 2\n", None, None, &[], |_| {});
    assert_eq!(r.code(), 2, "{}", r.stderr());
    let log = r.termination_log();
    assert!(
        log.contains("$FABRICGATE_REQUIREMENTS") && log.contains("min_port"),
        "{log}"
    );
    // Inline requirements and --config together are refused.
    let r = preflight(FOUR_NDR, None, None, &["--config", "/dev/null"], |_| {});
    assert_eq!(r.code(), 2, "{}", r.stderr());
}

/// Preflight over the fixture with the requirements in `FABRICGATE_REQUIREMENTS` and the
/// termination log at `log`; `Err` when the binary could not even be started.
fn preflight_env(requirements: &str, log: &Path, nccl: &Path) -> std::io::Result<Output> {
    let fx = fixture();
    Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .arg("preflight")
        .args(["--verbs", "off"])
        .arg("--sysfs-root")
        .arg(fx.join("sys"))
        .arg("--proc-root")
        .arg(fx.join("proc"))
        .arg("--dev-root")
        .arg(fx.join("dev"))
        .arg("--nccl-dir")
        .arg(nccl)
        .arg("--termination-log")
        .arg(log)
        .env("FABRICGATE_REQUIREMENTS", requirements)
        .output()
}

/// Preflight exited 2 on a validated run when `/dev/termination-log` was absent.
#[test]
fn redteam_a_missing_termination_log_never_changes_the_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let nccl = dir.path().join("nccl");
    std::fs::create_dir(&nccl).unwrap();
    let absent = dir.path().join("no-such-dir/termination-log");
    let out = preflight_env(FOUR_NDR, &absent, &nccl).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "validated stays 0: {err}");
    assert!(
        err.contains("cannot write") && err.contains("termination-log"),
        "{err}"
    );
    assert!(nccl.join("nccl.conf").exists());
    // And a failing run still says 1, not 2.
    let eight = FOUR_NDR.replace("min_active_ports: 4", "min_active_ports: 8");
    let out = preflight_env(&eight, &absent, &nccl).unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A 150 KiB requirements file made the init container's environment too large
/// to exec. What the webhook hands preflight now starts, and means the same requirements.
#[test]
fn redteam_150_kib_of_requirements_still_exec_preflight() {
    use fabricgate::config::Config;
    use fabricgate::pod::webhook::{self, MutationConfig};
    let long = format!(
        "{FOUR_NDR}{}",
        "# Site notes kept with the requirements: which pools, who to call, why.\n"
            .repeat(150 * 1024 / 72 + 1)
    );
    assert!(long.len() >= 150 * 1024);
    let dir = tempfile::tempdir().unwrap();
    let nccl = dir.path().join("nccl");
    std::fs::create_dir(&nccl).unwrap();
    let log = dir.path().join("termination-log");
    // The file as it was handed over before: one environment string over the kernel's
    // 128 KiB MAX_ARG_STRLEN, so the container could not even start.
    let e = preflight_env(&long, &log, &nccl).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::E2BIG), "{e}");

    let m = MutationConfig::new(&Config::parse(&long).unwrap(), &long, "fabricgate:test");
    let pod = serde_json::json!({
        "metadata": {"name": "w", "labels": {"fabricgate.io/preflight": "true"}},
        "spec": {"containers": [{"name": "w", "image": "x",
            "resources": {"limits": {"rdma/ib": "1"}}}]},
    });
    let patch = webhook::mutate(&pod, &m).json_patch().unwrap();
    let mut mutated = pod.clone();
    json_patch::patch(&mut mutated, &patch).unwrap();
    let init = &mutated["spec"]["initContainers"][0];
    let value = init["env"][0]["value"].as_str().unwrap();
    assert_eq!(init["env"][0]["name"], webhook::REQUIREMENTS_ENV);
    let out = preflight_env(value, &log, &nccl).expect("preflight starts");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read_to_string(nccl.join("nccl.conf"))
            .unwrap()
            .contains("NCCL_IB_HCA==mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1")
    );
}
