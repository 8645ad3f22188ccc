//! `fabricgate check`'s pods section through the real binary: fixture procfs trees
//! with pod-shaped `/proc/<pid>/cgroup` (the Soft-RoCE VM's capture), the JSON keys, the
//! table, `--pods off`, and that the section never changes the exit code. The live kernel's
//! RDMA and TCP are the VM's to test (tests/vm/transport_vm.rs).

use crate::common;

use fabricgate_probes::transport::sample::NO_HOST_PID;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

/// The pod of the captured cgroup file (the RC server of tests/vm/capture-restrack.sh).
const POD: &str = "5f1d3c2e-8a4b-4f6e-9c1d-2b3a4c5d6e7f";
const NDR: &str = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  min_rate_gbps: 400\n  link_layer: InfiniBand\n";

fn captured_cgroup() -> String {
    let path = common::repo_root().join("probes/tests/fixtures/restrack/cgroup-140");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A procfs of the host's PID namespace (`kthreadd` at PID 2) with one pod process, 140, whose
/// `ns/net` is no namespace at all: its sockets cannot be listed.
fn host_procfs(dir: &Path) {
    let proc = dir.join("proc");
    std::fs::create_dir_all(proc.join("2")).unwrap();
    std::fs::write(proc.join("2/comm"), "kthreadd\n").unwrap();
    std::fs::create_dir_all(proc.join("140/ns")).unwrap();
    std::fs::write(proc.join("140/cgroup"), captured_cgroup()).unwrap();
    std::fs::write(proc.join("140/ns/net"), "").unwrap();
    std::fs::create_dir_all(proc.join("self")).unwrap();
    std::fs::copy(
        common::fixture("ndr-8x400-healthy/proc/self/mountinfo"),
        proc.join("self/mountinfo"),
    )
    .unwrap();
}

fn check(sys: &Path, proc: &Path, extra: &[&str]) -> Output {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), NDR).unwrap();
    Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["check", "--verbs", "off", "--sysfs-root"])
        .arg(sys)
        .arg("--proc-root")
        .arg(proc)
        .arg("--config")
        .arg(config.path())
        .args(extra)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn a_pod_whose_tcp_cannot_be_measured_is_unknown_with_the_why_and_check_still_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    host_procfs(dir.path());
    let sys = common::fixture("ndr-8x400-healthy/sys");
    let out = check(
        &sys,
        &dir.path().join("proc"),
        &["--format", "json", "--pods-window", "100ms"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let doc = common::stdout_json(&out);
    let pods = doc["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 1, "{doc:#}");
    let pod = &pods[0];
    let keys: Vec<&str> = pod
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut want = [
        "uid",
        "namespace",
        "name",
        "transport",
        "reason",
        "qps",
        "internode_tcp_bytes",
        "other_tcp_bytes",
        "rdma_ports",
        "rdma_bytes",
        "why",
    ];
    want.sort_unstable();
    let mut keys = keys;
    keys.sort_unstable();
    assert_eq!(keys, want);
    assert_eq!(pod["uid"], POD);
    assert_eq!((&pod["namespace"], &pod["name"]), (&"".into(), &"".into()));
    assert_eq!(pod["transport"], "unknown", "{pod:#}");
    assert_eq!(pod["reason"], "TransportUnknown", "{pod:#}");
    assert_eq!(pod["internode_tcp_bytes"], Value::Null);
    // No data-path QP of its own, so no port of its own and no figure.
    assert_eq!(pod["rdma_ports"], Value::Array(Vec::new()), "{pod:#}");
    assert_eq!(pod["rdma_bytes"], Value::Null, "{pod:#}");
    // Its QPs are this machine's kernel's to list: none of them is the fixture pod's, or the
    // kernel has no RDMA netlink at all.
    assert!(
        pod["qps"] == Value::Array(Vec::new()) || pod["qps"].is_null(),
        "{pod:#}"
    );
    let why = pod["why"].as_str().unwrap();
    assert!(
        why.contains("its TCP cannot be measured: its sockets cannot be listed"),
        "{why}"
    );
    let sample = &doc["pods_sample"];
    // No cluster to ask: the section says so, and what it takes as a peer instead.
    let peers = sample["peers"].as_str().unwrap_or_default();
    assert!(
        peers.starts_with("no cluster to ask") && peers.contains("any address not on this node"),
        "{sample:#}"
    );
    assert!(
        sample["window_seconds"].as_f64().unwrap() >= 0.1,
        "{sample:#}"
    );
    assert!(sample["node_fallback"]["why"].is_string(), "{sample:#}");
    assert_eq!(sample["node_fallback"]["suspected"], false);

    // The same node without the section: the same exit code and node verdict.
    let off = check(
        &sys,
        &dir.path().join("proc"),
        &["--format", "json", "--pods", "off"],
    );
    assert_eq!(off.status.code(), Some(0));
    let off = common::stdout_json(&off);
    assert!(off.get("pods").is_none() && off.get("pods_sample").is_none());
    assert_eq!(off["ready"], doc["ready"]);
    assert_eq!(off["labels"], doc["labels"]);
}

/// Without the host PID namespace (no `kthreadd` at PID 2 of the procfs) no process is
/// visible, but the pod cgroups are: each is an `unknown` row saying what to add. Not waited
/// for, and the node's exit code (1: no RDMA here) is the same with and without the section.
#[test]
fn without_the_host_pid_namespace_each_pod_cgroup_is_an_unknown_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = captured_cgroup();
    let path = path.trim_end().trim_start_matches("0::/");
    std::fs::create_dir_all(dir.path().join("sys/fs/cgroup").join(path)).unwrap();
    std::fs::create_dir_all(dir.path().join("sys/fs/cgroup/system.slice/ssh.service")).unwrap();
    std::fs::create_dir_all(dir.path().join("proc")).unwrap();
    let (sys, proc) = (dir.path().join("sys"), dir.path().join("proc"));
    let out = check(&sys, &proc, &["--pods-window", "10m"]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    let section = &text[text.find("\nPods:").unwrap_or_else(|| panic!("{text}"))..];
    let why = format!(
        "its queue pairs cannot be listed: {NO_HOST_PID}; its TCP cannot be measured: {NO_HOST_PID}"
    );
    let want = format!(
        "\nPods:\n\
         \x20 POD UID                               TRANSPORT  QPS  INTER-NODE TCP  WHY\n\
         \x20 {POD}  unknown    ?    ?               {why}\n\
         \x20 ! {NO_HOST_PID}\n\
         \x20 peers: no cluster to ask (no --kubeconfig, not in a pod): a pod's peers are taken \
         to be any address not on this node, so TCP with object storage or another job counts \
         too; give --kubeconfig (or run in a pod) for the job's own peers\n"
    );
    assert_eq!(section, want);
    let off = check(&sys, &proc, &["--pods", "off"]);
    assert_eq!(off.status.code(), Some(1));
    assert!(!stdout(&off).contains("\nPods:"), "{}", stdout(&off));
}

#[test]
fn pods_flags_out_of_range_are_usage_errors() {
    let sys = common::fixture("ndr-8x400-healthy/sys");
    let proc = common::fixture("ndr-8x400-healthy/proc");
    for args in [
        ["--pods", "maybe"],
        ["--pods-window", "0s"],
        ["--pods-window", "11m"],
        ["--pods-window", "soon"],
    ] {
        let out = check(&sys, &proc, &args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(args[0]), "{args:?}: {err}");
    }
}
