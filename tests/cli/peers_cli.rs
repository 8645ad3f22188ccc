//! `fabricgate ping` and the agent's peer wiring where no RDMA device is needed (the
//! measurements themselves run between two real rxe devices in tests/vm/peers_vm.rs).

use crate::common;

use common::fabricgate;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn ping_without_a_local_rdma_port_is_exit_3_and_says_why() {
    let (code, stdout) = common::json_over_an_empty_node(&["ping", "127.0.0.1:9"]);
    assert_eq!(code, 3, "{stdout}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["ok"], false);
    assert_eq!(doc["address"], "127.0.0.1:9");
    assert!(
        doc["errors"][0]
            .as_str()
            .unwrap()
            .contains("no usable local RDMA port"),
        "{doc}"
    );
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let (code, stdout, _) = fabricgate(&["ping", "127.0.0.1", "--sysfs-root", root]);
    assert_eq!(code, 3);
    assert!(
        stdout.starts_with("fabricgate ping 127.0.0.1 (127.0.0.1:9465): UNREACHABLE"),
        "{stdout}"
    );
}

#[test]
fn ping_usage_errors_are_exit_2_naming_the_value() {
    let (code, _, stderr) = fabricgate(&["ping", "127.0.0.1", "--count", "1000"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("RTT burst of 1000 messages"), "{stderr}");
    let (code, _, stderr) =
        fabricgate(&["ping", "127.0.0.1", "--bandwidth", "--bw-duration", "1m"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("bandwidth burst"), "{stderr}");
    let (code, _, stderr) = fabricgate(&["ping"]);
    assert_eq!(code, 2, "{stderr}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("fabricgate.yaml");
    std::fs::write(&cfg, "peers:\n  per_round: 0\n").unwrap();
    let (code, _, stderr) = fabricgate(&["ping", "x", "--config", cfg.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("peers.per_round"), "{stderr}");
}

/// A running `fabricgate run`, killed when dropped.
pub(super) struct Agent {
    pub(super) child: Child,
    /// Its stderr, at info level.
    pub(super) log: PathBuf,
    /// The address of its /metrics.
    pub(super) metrics: String,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `fabricgate run --dry-run` for Node node-a over the empty tree `dir` (no RDMA, no cluster):
/// a probe every second without verbs, /metrics on a free port, its log in `dir/agent.log`,
/// then `extra` flags.
fn start_dry_run_agent(dir: &Path, extra: &[&str]) -> Agent {
    spawn_dry_run_agent(dir, "node-a", dir, dir.join("agent.log"), extra)
}

/// `fabricgate run --dry-run` for Node `node` over the sysfs tree `sysfs`, with `home` as its
/// HOME (no cluster): a probe every second without verbs, /metrics on a free port, its log at
/// `log` (info level), then `extra` flags.
pub(super) fn spawn_dry_run_agent(
    home: &Path,
    node: &str,
    sysfs: &Path,
    log: PathBuf,
    extra: &[&str],
) -> Agent {
    let metrics = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["run", "--dry-run", "--node-name", node, "--interval", "1s"])
        .args(["--verbs", "off", "--metrics-addr", &metrics])
        .arg("--sysfs-root")
        .arg(sysfs)
        .args(extra)
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("HOME", home)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Agent {
        child,
        log,
        metrics,
    }
}

pub(super) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(super) fn get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

pub(super) fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pool's key file in these tests.
pub(super) const KEY: &str = "6b1f0c3e9a2d4f5b8c7e6d5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c\n";

/// An agent with `peers.enabled` and no RDMA: the responder listens and answers a stranger's
/// version-1 HELLO (before: a LIMITS frame naming the node) with its version and nothing
/// else; the peer families are in /metrics and count the refused session; rounds run
/// (measuring nothing without a usable local port).
#[test]
fn agent_with_peers_enabled_runs_the_responder_and_exports_peer_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("fabricgate.yaml");
    let key = dir.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "peers:\n  enabled: true\n  listen: \"127.0.0.1:0\"\n  interval: 1s\n  \
             key_file: {}\n",
            key.display()
        ),
    )
    .unwrap();
    let agent = start_dry_run_agent(
        dir.path(),
        &["--config", cfg.to_str().unwrap(), "--peers", "127.0.0.1:9"],
    );
    let responder = wait_for("the responder's address in the log", || {
        let text = std::fs::read_to_string(&agent.log).ok()?;
        let line = text
            .lines()
            .find(|l| l.contains("peer responder listening"))?;
        Some(
            line.split("addr=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .to_owned(),
        )
    });

    // A HELLO of protocol version 1 with an empty plan: VERSION, with nothing identifying.
    let mut s = TcpStream::connect(&responder).unwrap();
    let mut hello = [0u8; 256];
    hello[..4].copy_from_slice(b"FGPR");
    hello[4..6].copy_from_slice(&1u16.to_be_bytes());
    hello[6] = 1;
    s.write_all(&hello).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut frame = [0u8; 256];
    s.read_exact(&mut frame).unwrap();
    assert_eq!(&frame[..4], b"FGPR");
    assert_eq!(&frame[4..6], &2u16.to_be_bytes(), "its version");
    assert_eq!(frame[6], 7, "CHALLENGE");
    assert_eq!(frame[7], 6, "VERSION");
    assert!(frame[8..].iter().all(|&b| b == 0), "and nothing else");

    let body = wait_for("rounds and the refused session in /metrics", || {
        let body = get(&agent.metrics, "/metrics")?;
        let refused = body
            .lines()
            .any(|l| l == "fabricgate_peer_responder_sessions_total{result=\"refused\"} 1");
        let rounds = body
            .lines()
            .find_map(|l| l.strip_prefix("fabricgate_peer_rounds_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        (refused && rounds >= 1.0).then_some(body)
    });
    for family in [
        "# TYPE fabricgate_peer_rounds_total counter",
        "# TYPE fabricgate_peer_round_duration_seconds gauge",
        "# TYPE fabricgate_peer_responder_cpu_seconds_total counter",
    ] {
        assert!(body.contains(family), "{family} missing:\n{body}");
    }
    // No local port: nothing measured, so no per-peer series (the families appear with
    // their first series) and no errors blamed on a peer.
    assert!(!body.contains("peer=\""), "{body}");
    assert!(!body.contains("fabricgate_peer_rtt_seconds"), "{body}");
}

/// Peers on without a usable key is a configuration error naming the file and the Secret to
/// create, never an unauthenticated responder.
#[test]
fn peers_enabled_without_a_key_is_exit_2_saying_how_to_create_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("fabricgate.yaml");
    let key = dir.path().join("no-such-key");
    std::fs::write(
        &cfg,
        format!(
            "peers:\n  enabled: true\n  listen: \"127.0.0.1:0\"\n  key_file: {}\n",
            key.display()
        ),
    )
    .unwrap();
    let mut agent = start_dry_run_agent(dir.path(), &["--config", cfg.to_str().unwrap()]);
    let status = wait_for("the agent to exit", || {
        agent.child.try_wait().ok().flatten()
    });
    assert_eq!(status.code(), Some(2));
    let text = std::fs::read_to_string(&agent.log).unwrap();
    for want in [
        "peers.key_file",
        key.to_str().unwrap(),
        "create secret generic fabricgate-peers",
        "openssl rand -hex 32",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    // A file without a key is no better.
    std::fs::write(&key, "# rotate me\n").unwrap();
    let mut agent = start_dry_run_agent(dir.path(), &["--config", cfg.to_str().unwrap()]);
    let status = wait_for("the agent to exit", || {
        agent.child.try_wait().ok().flatten()
    });
    assert_eq!(status.code(), Some(2));
    let text = std::fs::read_to_string(&agent.log).unwrap();
    assert!(text.contains("holds no key"), "{text}");
    assert!(!text.contains("peer responder listening"), "{text}");
}

#[test]
fn peers_flag_without_peers_enabled_is_ignored_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let agent = start_dry_run_agent(dir.path(), &["--peers", "10.0.0.2,10.0.0.3:7000"]);
    let body = wait_for("/metrics after the first probe", || {
        let body = get(&agent.metrics, "/metrics")?;
        body.contains("fabricgate_last_probe_timestamp_seconds ")
            .then_some(body)
    });
    assert!(!body.contains("fabricgate_peer_"), "{body}");
    let text = std::fs::read_to_string(&agent.log).unwrap();
    assert!(text.contains("--peers is ignored"), "{text}");
}
