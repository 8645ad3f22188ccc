//! `fabricgate run` without a cluster: usage errors and `--dry-run` with no Kubernetes
//! configuration at all. Everything the agent does to a cluster is in `tests/cluster.rs`,
//! against the real kube-apiserver.

mod common;
mod support;

use common::wait_until;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::sysfs::FakeHca;

fn run(hca: &FakeHca, log: &std::path::Path, extra: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .arg("run")
        .arg("--sysfs-root")
        .arg(hca.sysfs_root())
        .arg("--proc-root")
        .arg(hca.proc_root())
        .args(["--verbs", "off", "--metrics-addr", "127.0.0.1:0"])
        .args(extra)
        .env("KUBECONFIG", hca.scratch().join("no-such-kubeconfig"))
        .env("HOME", hca.scratch())
        .env("NODE_NAME", "gpu-node-1")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

#[test]
fn missing_node_name_is_a_usage_error() {
    let hca = FakeHca::new(true);
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .arg("run")
        .arg("--sysfs-root")
        .arg(hca.sysfs_root())
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NODE_NAME"), "{err}");
}

#[test]
fn without_a_cluster_run_fails_clearly_unless_dry_run() {
    let hca = FakeHca::new(true);
    let log = hca.scratch().join("agent-0.log");
    let mut child = run(&hca, &log, &["--interval", "100ms"]);
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(2));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("--dry-run"), "{text}");

    let log = hca.scratch().join("agent-1.log");
    let mut child = run(&hca, &log, &["--interval", "100ms", "--dry-run"]);
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_until("dry-run log", Duration::from_secs(10), || {
        read().contains("would set taint none")
    });
    hca.set_port(false);
    wait_until("dry-run log of the change", Duration::from_secs(10), || {
        let l = read();
        l.contains("would set taint fabricgate.io/unvalidated:NoSchedule") && l.contains("PortDown")
    });
    // Logged at each change, not each tick.
    assert!(read().matches("would set taint").count() <= 3, "{}", read());
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}
