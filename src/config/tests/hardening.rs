use crate::config::*;
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use std::time::Duration;

fn err(yaml: &str) -> String {
    let e = Config::parse(yaml).unwrap_err();
    assert_eq!(e.exit_code(), crate::EXIT_USAGE, "{yaml:?}");
    e.to_string()
}

#[test]
fn each_duration_error_names_its_own_key() {
    // fallback.window used to be reported as lustre.statfs_timeout.
    let e = err("fallback:\n  window: soon\n");
    assert!(e.contains("fallback.window"), "{e}");
    assert!(!e.contains("statfs_timeout"), "{e}");
    let e = err("rdma:\n  selftest_timeout: 2 fortnights\n");
    assert!(e.contains("rdma.selftest_timeout"), "{e}");
    let e = err("lustre:\n  statfs_timeout: soon\n");
    assert!(e.contains("lustre.statfs_timeout"), "{e}");
    let e = err("rdma:\n  selftest: sometimes\n");
    assert!(e.contains("rdma.selftest"), "{e}");
    let e = err("rdma:\n  devices: \"mlx5_[\"\n");
    assert!(e.contains("rdma.devices"), "{e}");
}

#[test]
fn durations_are_bounded_at_both_ends() {
    for (yaml, key) in [
        (
            "lustre:\n  statfs_timeout: 300000000000y\n",
            "lustre.statfs_timeout",
        ),
        ("lustre:\n  statfs_timeout: 1ms\n", "lustre.statfs_timeout"),
        ("rdma:\n  selftest_timeout: 61s\n", "rdma.selftest_timeout"),
        ("rdma:\n  selftest_timeout: 0s\n", "rdma.selftest_timeout"),
        ("fallback:\n  window: 300000000000y\n", "fallback.window"),
        ("fallback:\n  window: 10ms\n", "fallback.window"),
    ] {
        let e = err(yaml);
        assert!(e.contains(key) && e.contains("between"), "{yaml:?}: {e}");
    }
    let c = Config::parse("lustre:\n  statfs_timeout: 10m\nfallback:\n  window: 7days\n").unwrap();
    assert_eq!(c.lustre.statfs_timeout, Duration::from_secs(600));
    assert_eq!(c.fallback.window, Duration::from_secs(7 * 86_400));
}

#[test]
fn schedule_timeout_and_glob_are_typed_at_load() {
    let c = Config::parse(
        "rdma:\n  devices: \"mlx5_*\"\n  selftest: every 6 probes\n  selftest_timeout: 500ms\n",
    )
    .unwrap();
    assert_eq!(c.rdma.selftest, SelftestSchedule::Every(6));
    assert_eq!(c.rdma.selftest_timeout, Duration::from_millis(500));
    assert!(c.rdma.devices.is_match("mlx5_0"));
    assert!(!c.rdma.devices.is_match("rxe0"));
    let again = Config::parse(&serde_norway::to_string(&c).unwrap()).unwrap();
    assert_eq!(again, c);
}

#[test]
fn a_huge_glob_is_refused_before_compiling() {
    let glob = "a".repeat(100 * 1024);
    let started = std::time::Instant::now();
    let e = err(&format!("rdma:\n  devices: \"{glob}\"\n"));
    assert!(
        e.contains("rdma.devices") && e.contains("longer than"),
        "{}",
        &e[..200.min(e.len())]
    );
    // Generous: the check is linear; the old path panicked in the glob compiler.
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    let e = err("rdma:\n  devices: \"\"\n");
    assert!(e.contains("rdma.devices"), "{e}");
}

#[test]
fn deep_nesting_is_refused_before_parsing() {
    let flow = format!("rdma: {}{}\n", "[".repeat(10_000), "]".repeat(10_000));
    let e = err(&flow);
    assert!(e.contains("nested"), "{e}");
    let mut block = String::new();
    for i in 0..100 {
        block.push_str(&" ".repeat(i));
        block.push_str("k:\n");
    }
    assert!(err(&block).contains("nested"));
    let dashes = format!("mounts:\n  {}/a\n", "- ".repeat(100));
    assert!(err(&dashes).contains("nested"));
    // The shipped example is shallow.
    assert!(nesting_depth("rdma:\n  devices: \"[[[[\"\nmounts:\n  - path: /a\n") <= 4);
}

#[test]
fn on_agent_error_parses() {
    let c = Config::parse("node:\n  on_agent_error: keep\n").unwrap();
    assert_eq!(c.node.on_agent_error, OnAgentError::Keep);
    let e = err("node:\n  on_agent_error: maybe\n");
    assert!(e.contains("node.on_agent_error"), "{e}");
}

#[test]
fn a_config_path_that_is_not_a_regular_file_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let e = Config::load(dir.path()).unwrap_err();
    assert_eq!(e.exit_code(), crate::EXIT_USAGE);
    assert!(e.to_string().contains("a directory"), "{e}");
    let e = Config::load(Path::new("/dev/zero")).unwrap_err();
    assert!(e.to_string().contains("a device"), "{e}");
    let fifo = dir.path().join("fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(status.is_ok_and(|s| s.success()), "mkfifo (coreutils)");
    let e = Config::load(&fifo).unwrap_err();
    assert!(e.to_string().contains("a FIFO"), "{e}");
    let big = dir.path().join("big.yaml");
    std::fs::write(&big, "#".repeat(MAX_CONFIG_BYTES + 1)).unwrap();
    let e = Config::load(&big).unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
}
