//! `fabricgate run` without a cluster: usage errors and `--dry-run` with no Kubernetes
//! configuration at all. Everything the agent does to a cluster is in `tests/cluster.rs`,
//! against the real kube-apiserver.

mod common;

use common::start_agent;
use common::sysfs::FakeHca;
use std::process::Command;
use std::time::Duration;

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
    let mut agent = start_agent("gpu-node-1", &hca, None, &["--interval", "100ms"]);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(2));
    assert!(agent.log().contains("--dry-run"), "{}", agent.log());

    let agent = start_agent(
        "gpu-node-1",
        &hca,
        None,
        &["--interval", "100ms", "--dry-run"],
    );
    agent.wait("dry-run log", Duration::from_secs(10), || {
        agent.log().contains("would set taint none")
    });
    hca.set_port(false);
    agent.wait("dry-run log of the change", Duration::from_secs(10), || {
        let l = agent.log();
        l.contains("would set taint fabricgate.io/unvalidated:NoSchedule") && l.contains("PortDown")
    });
    // Logged at each change, not each tick.
    let log = agent.log();
    assert!(log.matches("would set taint").count() <= 3, "{log}");
    let (status, _) = agent.stop();
    assert!(status.success(), "{status:?}");
}
